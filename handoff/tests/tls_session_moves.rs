//! Real rustls clients and servers over loopback; the server's connection is
//! moved mid-stream (secrets extracted, socket passed by SCM_RIGHTS, state
//! through the handoff codec) and continued by [`TlsRecordStream`], the
//! record layer of the `baton-tls-record` crate.

use std::collections::VecDeque;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use rustls::SupportedCipherSuite;
use rustls::crypto::ring::cipher_suite as cs;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use baton_handoff::fd::FdStream;
use baton_handoff::protocol::{ConnKind, ConnectionHeader, Decoder, Message, encode};
use baton_tls_record::*;

struct Pki {
    cert: CertificateDer<'static>,
    key: Vec<u8>,
}

fn pki() -> Pki {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    Pki {
        cert: ck.cert.der().clone(),
        key: ck.signing_key.serialize_der(),
    }
}

fn provider(suite: SupportedCipherSuite) -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![suite];
    Arc::new(p)
}

fn version_of(suite: SupportedCipherSuite) -> &'static rustls::SupportedProtocolVersion {
    match suite {
        SupportedCipherSuite::Tls13(_) => &rustls::version::TLS13,
        _ => &rustls::version::TLS12,
    }
}

fn configs(
    suite: SupportedCipherSuite,
    capture: Option<Arc<dyn rustls::KeyLog>>,
) -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
    let pki = pki();
    let mut server = rustls::ServerConfig::builder_with_provider(provider(suite))
        .with_protocol_versions(&[version_of(suite)])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![pki.cert.clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(pki.key.clone())),
        )
        .unwrap();
    server.enable_secret_extraction = true;
    if let Some(c) = capture {
        server.key_log = c;
    }
    let mut roots = rustls::RootCertStore::empty();
    roots.add(pki.cert).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(provider(suite))
        .with_protocol_versions(&[version_of(suite)])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    (Arc::new(server), Arc::new(client))
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed as u32) as u8
        })
        .collect()
}

type ClientStream = tokio_rustls::client::TlsStream<TcpStream>;

/// An application-data record header followed by `len` bytes of `fill`
/// (the contents do not matter to the record-aligned reader).
fn rec(len: usize, fill: u8) -> Vec<u8> {
    let mut r = vec![23u8, 3, 3];
    r.extend_from_slice(&(len as u16).to_be_bytes());
    r.extend(std::iter::repeat_n(fill, len));
    r
}

/// Handshake, exchange some data, leave unread data in every layer (rustls'
/// plaintext buffer, whole and partial records, the kernel queue), then move
/// the server side to a [`TlsRecordStream`] the way two processes would.
async fn established_then_moved(
    suite: SupportedCipherSuite,
    capture: bool,
) -> (
    ClientStream,
    TlsRecordStream<TcpStream>,
    Vec<u8>,
    TlsWireState,
) {
    established_then_moved_after_updates(suite, capture, 0).await
}

/// As [`established_then_moved`], after `pre_move_updates` KeyUpdates that
/// rustls itself follows before the move.
async fn established_then_moved_after_updates(
    suite: SupportedCipherSuite,
    capture: bool,
    pre_move_updates: usize,
) -> (
    ClientStream,
    TlsRecordStream<TcpStream>,
    Vec<u8>,
    TlsWireState,
) {
    let capture = capture.then(|| Arc::new(SecretCapture::new(1024)));
    let (scfg, ccfg) = configs(suite, capture.clone().map(|c| c as Arc<dyn rustls::KeyLog>));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = async {
        let (tcp, _) = listener.accept().await.unwrap();
        TlsAcceptor::from(scfg)
            .accept(RecordAlignedIo::new(tcp))
            .await
            .unwrap()
    };
    let connect = async {
        let tcp = TcpStream::connect(addr).await.unwrap();
        TlsConnector::from(ccfg)
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap()
    };
    let (mut server, mut client) = tokio::join!(accept, connect);

    for i in 0..pre_move_updates {
        client.get_mut().1.refresh_traffic_keys().unwrap();
        let m = pattern(100 + i as u8, 1000);
        client.write_all(&m).await.unwrap();
        client.flush().await.unwrap();
        let mut got = vec![0u8; m.len()];
        server.read_exact(&mut got).await.unwrap();
        server.write_all(&got).await.unwrap();
        server.flush().await.unwrap();
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(got, m);
    }

    // Phase 1: plain rustls on both sides.
    let msg1 = pattern(1, 10_000);
    client.write_all(&msg1).await.unwrap();
    let mut got = vec![0u8; 3_000];
    server.read_exact(&mut got).await.unwrap();
    assert_eq!(got, msg1[..3_000]);
    let reply1 = pattern(2, 5_000);
    server.write_all(&reply1).await.unwrap();
    server.flush().await.unwrap();
    let mut back = vec![0u8; reply1.len()];
    client.read_exact(&mut back).await.unwrap();
    assert_eq!(back, reply1);
    // More data in flight while the server is about to move.
    let msg2 = pattern(3, 50_000);
    client.write_all(&msg2).await.unwrap();
    client.flush().await.unwrap();

    // Safe point in the old process: process what rustls holds, drain its
    // plaintext, extract secrets, keep the partial record.
    let (aligned, mut conn) = server.into_inner();
    conn.process_new_packets().unwrap();
    let mut unread = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match conn.reader().read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => unread.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        aligned.is_aligned(),
        "rustls must not hold a partial record"
    );
    let version = conn.protocol_version().unwrap();
    let secrets = conn.dangerous_extract_secrets().unwrap();
    let state = wire_state_from_rustls(version, secrets, capture.as_deref(), true).unwrap();
    let (tcp, partial) = aligned.into_parts();

    // Through the handoff wire: socket by SCM_RIGHTS, state and buffered
    // bytes in a Connection frame.
    let (a, b) = tokio::net::UnixStream::pair().unwrap();
    let (a, b) = (FdStream::new(a), FdStream::new(b));
    let mut blob = partial.clone();
    blob.extend_from_slice(&unread);
    let header = Message::Connection(ConnectionHeader {
        id: 1,
        kind: ConnKind::Tcp,
        to_upstream_len: partial.len() as u32,
        to_downstream_len: unread.len() as u32,
        tls_ciphertext_len: 0,
        up_tls: None,
        up_tls_ciphertext_len: 0,
        tls: Some(state),
        meta: serde_json::Value::Null,
        parked_at_ns: 0,
    });
    let frame = encode(&header, &blob, 1).unwrap();
    a.send(&frame, &[tcp.as_raw_fd()]).await.unwrap();
    drop(tcp);
    let mut fds = VecDeque::new();
    let mut dec = Decoder::default();
    let raw = loop {
        if let Some(f) = dec.next_frame().unwrap() {
            break f;
        }
        let mut buf = [0u8; 65536];
        let n = b.recv(&mut buf, &mut fds).await.unwrap();
        dec.feed(&buf[..n]);
    };
    let Message::Connection(h) = raw.msg else {
        panic!("not a connection")
    };
    let state = h.tls.clone().unwrap();
    let (partial, unread) = raw.blob.split_at(h.to_upstream_len as usize);
    let std_tcp = std::net::TcpStream::from(fds.pop_front().unwrap());
    std_tcp.set_nonblocking(true).unwrap();
    let tcp = TcpStream::from_std(std_tcp).unwrap();
    let moved = TlsRecordStream::new(tcp, &state, partial.to_vec(), unread.to_vec()).unwrap();

    let mut expect = msg1[3_000..].to_vec();
    expect.extend_from_slice(&msg2);
    (client, moved, expect, state)
}

async fn moved_connection_continues_byte_exactly(suite: SupportedCipherSuite) {
    let (mut client, mut moved, expect, state) = established_then_moved(suite, true).await;
    let mut got = vec![0u8; expect.len()];
    moved.read_exact(&mut got).await.unwrap();
    assert!(
        got == expect,
        "bytes sent before the move arrive exactly once, in order"
    );

    // Both directions, concurrently, large enough to span many records.
    let up = pattern(4, 300_000);
    let down = pattern(5, 400_000);
    let c = async {
        let (mut r, mut w) = tokio::io::split(&mut client);
        let send = async {
            w.write_all(&up).await.unwrap();
            w.flush().await.unwrap();
        };
        let recv = async {
            let mut b = vec![0u8; down.len()];
            r.read_exact(&mut b).await.unwrap();
            b
        };
        tokio::join!(send, recv).1
    };
    let s = async {
        let (mut r, mut w) = tokio::io::split(&mut moved);
        let send = async {
            w.write_all(&down).await.unwrap();
            w.flush().await.unwrap();
        };
        let recv = async {
            let mut b = vec![0u8; up.len()];
            r.read_exact(&mut b).await.unwrap();
            b
        };
        tokio::join!(send, recv).1
    };
    let (client_got, server_got) = tokio::join!(c, s);
    assert!(client_got == down && server_got == up);

    // close_notify both ways is a clean EOF.
    client.shutdown().await.unwrap();
    let mut rest = Vec::new();
    moved.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    moved.shutdown().await.unwrap();
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    assert_eq!(moved.key_updates(), 0);
    if state.version == TLS13 {
        assert!(state.tx.traffic_secret.is_some() && state.rx.traffic_secret.is_some());
    }
}

#[tokio::test]
async fn tls13_aes128gcm_connection_continues_after_the_move() {
    moved_connection_continues_byte_exactly(cs::TLS13_AES_128_GCM_SHA256).await;
}

#[tokio::test]
async fn tls13_aes256gcm_connection_continues_after_the_move() {
    moved_connection_continues_byte_exactly(cs::TLS13_AES_256_GCM_SHA384).await;
}

#[tokio::test]
async fn tls13_chacha20_connection_continues_after_the_move() {
    moved_connection_continues_byte_exactly(cs::TLS13_CHACHA20_POLY1305_SHA256).await;
}

#[tokio::test]
async fn tls12_aes128gcm_connection_continues_after_the_move() {
    moved_connection_continues_byte_exactly(cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256).await;
}

#[tokio::test]
async fn tls12_aes256gcm_connection_continues_after_the_move() {
    moved_connection_continues_byte_exactly(cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384).await;
}

#[tokio::test]
async fn tls12_chacha20_connection_continues_after_the_move() {
    moved_connection_continues_byte_exactly(cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256)
        .await;
}

async fn key_update_after_the_move_is_followed(suite: SupportedCipherSuite) {
    let (mut client, mut moved, expect, _) = established_then_moved(suite, true).await;
    let mut got = vec![0u8; expect.len()];
    moved.read_exact(&mut got).await.unwrap();
    assert!(got == expect);
    for round in 0..3u8 {
        // rustls sends KeyUpdate(update_requested) and switches its tx key.
        client.get_mut().1.refresh_traffic_keys().unwrap();
        let msg = pattern(10 + round, 20_000);
        client.write_all(&msg).await.unwrap();
        client.flush().await.unwrap();
        let mut got = vec![0u8; msg.len()];
        moved.read_exact(&mut got).await.unwrap();
        assert!(got == msg, "decrypted under the updated client key");
        // Our reply (after our own KeyUpdate) must decrypt at the client.
        let reply = pattern(20 + round, 30_000);
        moved.write_all(&reply).await.unwrap();
        moved.flush().await.unwrap();
        let mut back = vec![0u8; reply.len()];
        client.read_exact(&mut back).await.unwrap();
        assert!(back == reply, "decrypted under our updated key");
    }
    assert_eq!(moved.key_updates(), 6);
}

#[tokio::test]
async fn tls13_key_update_after_the_move_is_followed_in_both_directions() {
    key_update_after_the_move_is_followed(cs::TLS13_AES_128_GCM_SHA256).await;
}

#[tokio::test]
async fn tls13_sha384_suite_key_update_uses_the_sha384_schedule() {
    key_update_after_the_move_is_followed(cs::TLS13_AES_256_GCM_SHA384).await;
}

#[tokio::test]
async fn key_update_without_a_captured_secret_closes_the_connection_cleanly() {
    let (mut client, mut moved, expect, state) =
        established_then_moved(cs::TLS13_CHACHA20_POLY1305_SHA256, false).await;
    assert!(state.rx.traffic_secret.is_none());
    let mut got = vec![0u8; expect.len()];
    moved.read_exact(&mut got).await.unwrap();
    client.get_mut().1.refresh_traffic_keys().unwrap();
    client.write_all(b"after update").await.unwrap();
    client.flush().await.unwrap();
    let mut buf = [0u8; 64];
    let err = moved.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionAborted);
    // The client sees close_notify: a clean EOF, not a reset or a decrypt error.
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
}

#[tokio::test]
async fn a_tampered_record_fails_authentication() {
    let (mut client, moved, expect, _) =
        established_then_moved(cs::TLS13_AES_128_GCM_SHA256, true).await;
    // Read what was pending, then corrupt the next record in flight by
    // writing a forged one straight onto the client's socket.
    let mut moved = moved;
    let mut got = vec![0u8; expect.len()];
    moved.read_exact(&mut got).await.unwrap();
    let forged = [
        23u8, 3, 3, 0, 20, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
    ];
    client.get_mut().0.write_all(&forged).await.unwrap();
    let mut buf = [0u8; 16];
    let err = moved.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
}

#[tokio::test]
async fn record_aligned_io_hands_out_whole_records_and_keeps_the_partial_one() {
    let (mut tx, rx) = duplex(1 << 20);
    let mut aligned = RecordAlignedIo::new(rx);
    let r1 = rec(100, 1);
    let r2 = rec(300, 2);
    let r3 = rec(50, 3);
    let mut wire = [r1.clone(), r2.clone()].concat();
    wire.extend_from_slice(&r3[..20]); // partial third record
    tx.write_all(&wire).await.unwrap();

    // A small buffer splits r2: not aligned until it is finished.
    let mut out = Vec::new();
    let mut small = [0u8; 128];
    let n = aligned.read(&mut small).await.unwrap();
    out.extend_from_slice(&small[..n]);
    assert_eq!(n, 105);
    assert!(aligned.is_aligned());
    let n = aligned.read(&mut small).await.unwrap();
    out.extend_from_slice(&small[..n]);
    assert!(!aligned.is_aligned());
    while !aligned.is_aligned() {
        let n = aligned.read(&mut small).await.unwrap();
        out.extend_from_slice(&small[..n]);
    }
    assert_eq!(out, [r1, r2].concat());
    let (_, pending) = aligned.into_parts();
    assert_eq!(pending, r3[..20]);
}

#[tokio::test]
async fn key_updates_rustls_followed_before_the_move_are_tracked_by_the_capture() {
    let (mut client, mut moved, expect, state) = established_then_moved_after_updates(
        cs::TLS13_AES_128_GCM_SHA256,
        true,
        CAPTURED_GENERATIONS - 1,
    )
    .await;
    assert!(state.rx.traffic_secret.is_some() && state.tx.traffic_secret.is_some());
    let mut got = vec![0u8; expect.len()];
    moved.read_exact(&mut got).await.unwrap();
    assert!(got == expect);
    client.get_mut().1.refresh_traffic_keys().unwrap();
    client.write_all(b"after").await.unwrap();
    client.flush().await.unwrap();
    let mut five = [0u8; 5];
    moved.read_exact(&mut five).await.unwrap();
    assert_eq!(&five, b"after");
    moved.write_all(b"reply").await.unwrap();
    moved.flush().await.unwrap();
    client.read_exact(&mut five).await.unwrap();
    assert_eq!(&five, b"reply");
}

#[tokio::test]
async fn a_continued_connection_exports_its_state_and_continues_again() {
    let (mut client, moved, expect, _) =
        established_then_moved(cs::TLS13_CHACHA20_POLY1305_SHA256, true).await;
    let mut moved = moved;
    let mut got = vec![0u8; expect.len()];
    moved.read_exact(&mut got).await.unwrap();
    client.get_mut().1.refresh_traffic_keys().unwrap();
    client.write_all(b"0123456789").await.unwrap();
    client.flush().await.unwrap();
    let mut five = [0u8; 5];
    moved.read_exact(&mut five).await.unwrap();
    // Second move: export with 5 plaintext bytes still unread (after
    // flushing our KeyUpdate answer, as the handoff does).
    moved.flush().await.unwrap();
    let (tcp, state, ct, plain) = moved.export().map_err(|_| "export refused").unwrap();
    let mut again = TlsRecordStream::new(tcp, &state, ct, plain).unwrap();
    again.read_exact(&mut five).await.unwrap();
    assert_eq!(&five, b"56789");
    again.write_all(b"second").await.unwrap();
    again.flush().await.unwrap();
    let mut six = [0u8; 6];
    client.read_exact(&mut six).await.unwrap();
    assert_eq!(&six, b"second");
}

/// The client role (an originated mesh-mTLS session to an upstream): the
/// client side moves mid-stream and follows the server's KeyUpdate.
async fn a_moved_client_session_continues(suite: SupportedCipherSuite) {
    let capture = Arc::new(SecretCapture::new(64));
    let (scfg, ccfg) = configs(suite, None);
    let mut ccfg = (*ccfg).clone();
    ccfg.enable_secret_extraction = true;
    ccfg.key_log = capture.clone();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = async {
        let (tcp, _) = listener.accept().await.unwrap();
        TlsAcceptor::from(scfg).accept(tcp).await.unwrap()
    };
    let connect = async {
        let tcp = TcpStream::connect(addr).await.unwrap();
        TlsConnector::from(Arc::new(ccfg))
            .connect(
                ServerName::try_from("localhost").unwrap(),
                RecordAlignedIo::new(tcp),
            )
            .await
            .unwrap()
    };
    let (mut server, mut client) = tokio::join!(accept, connect);
    client.write_all(b"hello").await.unwrap();
    client.flush().await.unwrap();
    let mut five = [0u8; 5];
    server.read_exact(&mut five).await.unwrap();
    // In flight towards the client while it moves.
    let early = pattern(6, 40_000);
    server.write_all(&early).await.unwrap();
    server.flush().await.unwrap();

    let (aligned, mut conn) = client.into_inner();
    conn.process_new_packets().unwrap();
    let mut unread = Vec::new();
    let mut chunk = [0u8; 4096];
    while let Ok(n) = conn.reader().read(&mut chunk) {
        if n == 0 {
            break;
        }
        unread.extend_from_slice(&chunk[..n]);
    }
    assert!(aligned.is_aligned());
    let version = conn.protocol_version().unwrap();
    let secrets = conn.dangerous_extract_secrets().unwrap();
    let state = wire_state_from_rustls(version, secrets, Some(&capture), false).unwrap();
    let (tcp, partial) = aligned.into_parts();
    let mut moved = TlsRecordStream::new(tcp, &state, partial, unread).unwrap();

    let mut got = vec![0u8; early.len()];
    moved.read_exact(&mut got).await.unwrap();
    assert!(
        got == early,
        "bytes sent before the move arrive exactly once"
    );
    let rounds = if state.version == TLS13 { 2u8 } else { 1 };
    for round in 0..rounds {
        if state.version == TLS13 {
            // The server asks for an update; we follow and answer it.
            server.get_mut().1.refresh_traffic_keys().unwrap();
        }
        let down = pattern(30 + round, 25_000);
        server.write_all(&down).await.unwrap();
        server.flush().await.unwrap();
        let mut got = vec![0u8; down.len()];
        moved.read_exact(&mut got).await.unwrap();
        assert!(got == down);
        let up = pattern(40 + round, 35_000);
        moved.write_all(&up).await.unwrap();
        moved.flush().await.unwrap();
        let mut got = vec![0u8; up.len()];
        server.read_exact(&mut got).await.unwrap();
        assert!(got == up, "the server decrypts what the moved client sends");
    }
    let expected_updates = if state.version == TLS13 { 4 } else { 0 };
    assert_eq!(moved.key_updates(), expected_updates);
    moved.shutdown().await.unwrap();
    let mut rest = Vec::new();
    server.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty(), "close_notify is a clean EOF at the server");
}

#[tokio::test]
async fn a_moved_tls13_client_session_follows_the_servers_key_update() {
    a_moved_client_session_continues(cs::TLS13_AES_256_GCM_SHA384).await;
}

#[tokio::test]
async fn a_moved_tls12_client_session_continues() {
    a_moved_client_session_continues(cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256).await;
}

#[tokio::test]
async fn record_aligned_io_reads_whole_records_straight_into_a_large_buffer() {
    let (mut tx, rx) = duplex(1 << 20);
    let mut aligned = RecordAlignedIo::new(rx);
    let (r1, r2, r3) = (rec(10, 1), rec(20, 2), rec(30, 3));
    tx.write_all(&[r1.clone(), r2.clone()].concat())
        .await
        .unwrap();
    let mut big = [0u8; 4096];
    let n = aligned.read(&mut big).await.unwrap();
    assert_eq!(&big[..n], &[r1, r2].concat()[..]);
    assert!(aligned.is_aligned());
    // A record header split across reads is kept back, then completed.
    tx.write_all(&r3[..3]).await.unwrap();
    tx.flush().await.unwrap();
    let rest = tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        tx.write_all(&r3[3..]).await.unwrap();
        (tx, r3)
    });
    let n = aligned.read(&mut big).await.unwrap();
    let (_tx, r3) = rest.await.unwrap();
    assert_eq!(&big[..n], &r3[..]);
    assert!(aligned.is_aligned());
    assert!(aligned.into_parts().1.is_empty());
}
