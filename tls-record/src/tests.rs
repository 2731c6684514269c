//! The record layer on its own: records sealed by one side and opened by
//! the other for every version and AEAD, the state's wire form, and every
//! malformed input (state, record header, body, alert, handshake message)
//! refused with an error rather than a panic. Sessions that rustls set up
//! and the handoff moves are tested in `baton-handoff`
//! (`handoff/tests/tls_session_moves.rs`).

use std::io;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, duplex};

use super::fuzzing::Wire;
use super::*;

const KINDS: [AeadKind; 3] = [
    AeadKind::Aes128Gcm,
    AeadKind::Aes256Gcm,
    AeadKind::Chacha20Poly1305,
];

fn key_len(kind: AeadKind) -> usize {
    kind.algorithm().key_len()
}

fn direction(kind: AeadKind, fill: u8, seq: u64, secret: Option<Vec<u8>>) -> DirectionSecrets {
    DirectionSecrets {
        seq,
        key: vec![fill; key_len(kind)],
        iv: vec![fill.wrapping_add(1); 12],
        traffic_secret: secret,
    }
}

/// A state and its peer's mirror image (tx ⇄ rx).
fn pair(version: u16, kind: AeadKind) -> (TlsWireState, TlsWireState) {
    let a = TlsWireState {
        version,
        aead: kind.name().into(),
        tx: direction(kind, 1, 7, None),
        rx: direction(kind, 2, 9, None),
        server: true,
    };
    let b = TlsWireState {
        tx: a.rx.clone(),
        rx: a.tx.clone(),
        server: false,
        ..a.clone()
    };
    (a, b)
}

/// The same, with TLS 1.3 traffic secrets (KeyUpdate can be followed).
fn pair_with_secrets(kind: AeadKind) -> (TlsWireState, TlsWireState) {
    let len = if kind == AeadKind::Aes256Gcm { 48 } else { 32 };
    let (mut a, mut b) = pair(TLS13, kind);
    a.tx.traffic_secret = Some(vec![3; len]);
    a.rx.traffic_secret = Some(vec![4; len]);
    b.tx.traffic_secret = a.rx.traffic_secret.clone();
    b.rx.traffic_secret = a.tx.traffic_secret.clone();
    (a, b)
}

/// Seals records as `state`'s peer would send them to `state`.
fn sealer(state: &TlsWireState) -> Cipher {
    Cipher::new(AeadKind::from_name(&state.aead).unwrap(), &state.rx).unwrap()
}

/// Opens what `state` sent, as its peer would.
fn opener(state: &TlsWireState) -> Cipher {
    Cipher::new(AeadKind::from_name(&state.aead).unwrap(), &state.tx).unwrap()
}

fn seal(c: &mut Cipher, version: u16, typ: u8, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    c.seal(version, typ, data, &mut out);
    out
}

/// Opens every whole record in `bytes`: (content type, plaintext).
fn open_all(c: &mut Cipher, version: u16, mut bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while bytes.len() >= HEADER_LEN {
        let header: [u8; 5] = bytes[..5].try_into().unwrap();
        let len = u16::from_be_bytes([header[3], header[4]]) as usize;
        let mut body = bytes[5..5 + len].to_vec();
        let (typ, range) = c.open(version, header, &mut body).unwrap();
        out.push((typ, body[range].to_vec()));
        bytes = &bytes[5 + len..];
    }
    out
}

/// Reads until EOF or an error; what was read and how it ended.
async fn read_all<S: AsyncRead + Unpin>(s: &mut S) -> (Vec<u8>, io::Result<()>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf).await {
            Ok(0) => return (got, Ok(())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return (got, Err(e)),
        }
    }
}

fn stream(state: &TlsWireState, input: Vec<u8>) -> TlsRecordStream<Wire> {
    TlsRecordStream::new(Wire::new(input, usize::MAX), state, Vec::new(), Vec::new()).unwrap()
}

// ------------------------------------------------------------ records

#[tokio::test]
async fn every_version_and_aead_carries_data_both_ways_between_mirrored_states() {
    let big: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
    for version in [TLS12, TLS13] {
        for kind in KINDS {
            let (a, b) = pair(version, kind);
            let (x, y) = duplex(1 << 20);
            let mut a = TlsRecordStream::new(x, &a, Vec::new(), Vec::new()).unwrap();
            let mut b = TlsRecordStream::new(y, &b, Vec::new(), Vec::new()).unwrap();
            a.write_all(b"hello").await.unwrap();
            a.write_all(&big).await.unwrap();
            a.flush().await.unwrap();
            let mut got = vec![0u8; 5 + big.len()];
            b.read_exact(&mut got).await.unwrap();
            assert_eq!(&got[..5], b"hello", "{version:x} {kind:?}");
            assert_eq!(&got[5..], &big[..]);
            b.write_all(b"back").await.unwrap();
            b.flush().await.unwrap();
            let mut back = [0u8; 4];
            a.read_exact(&mut back).await.unwrap();
            assert_eq!(&back, b"back");
            // 1 + 3 records (40,000 bytes in 16 KiB records) from a; 1 back.
            assert_eq!(a.sequence_numbers(), (7 + 4, 9 + 1), "{version:x} {kind:?}");
        }
    }
}

#[tokio::test]
async fn records_arriving_one_byte_at_a_time_still_open() {
    for version in [TLS12, TLS13] {
        let (a, _) = pair(version, AeadKind::Aes128Gcm);
        let mut peer = sealer(&a);
        let mut wire = seal(&mut peer, version, CT_APPLICATION_DATA, b"one");
        wire.extend(seal(&mut peer, version, CT_APPLICATION_DATA, b"two"));
        let mut s = TlsRecordStream::new(Wire::new(wire, 1), &a, Vec::new(), Vec::new()).unwrap();
        let (got, end) = read_all(&mut s).await;
        assert_eq!(got, b"onetwo");
        end.unwrap();
    }
}

#[tokio::test]
async fn pending_ciphertext_and_plaintext_from_the_old_process_come_first() {
    let (a, _) = pair(TLS13, AeadKind::Chacha20Poly1305);
    let mut peer = sealer(&a);
    let first = seal(&mut peer, TLS13, CT_APPLICATION_DATA, b"-first");
    let second = seal(&mut peer, TLS13, CT_APPLICATION_DATA, b"-second");
    // The old process had read half of the first record.
    let (head, tail) = first.split_at(7);
    let mut rest = tail.to_vec();
    rest.extend(second);
    let mut s = TlsRecordStream::new(
        Wire::new(rest, usize::MAX),
        &a,
        head.to_vec(),
        b"unread".to_vec(),
    )
    .unwrap();
    let (got, end) = read_all(&mut s).await;
    assert_eq!(got, b"unread-first-second");
    end.unwrap();
}

#[tokio::test]
async fn tls13_change_cipher_spec_records_are_skipped() {
    let (a, _) = pair(TLS13, AeadKind::Aes128Gcm);
    let mut wire = vec![CT_CHANGE_CIPHER_SPEC, 3, 3, 0, 1, 1];
    wire.extend(seal(&mut sealer(&a), TLS13, CT_APPLICATION_DATA, b"data"));
    let (got, end) = read_all(&mut stream(&a, wire)).await;
    assert_eq!(got, b"data");
    end.unwrap();
}

#[tokio::test]
async fn tls13_padding_is_stripped_and_an_all_zero_plaintext_refused() {
    let (a, _) = pair(TLS13, AeadKind::Aes256Gcm);
    let mut peer = sealer(&a);
    // Inner plaintext "pad" ‖ type 23 ‖ zero padding, sealed as type 23.
    let mut padded = b"pad".to_vec();
    padded.push(CT_APPLICATION_DATA);
    padded.extend([0u8; 5]);
    let mut wire = Vec::new();
    peer.seal(TLS13, 0, &padded, &mut wire); // the trailing type byte is 0: padding
    let (got, end) = read_all(&mut stream(&a, wire)).await;
    assert_eq!(got, b"pad");
    end.unwrap();
    let mut peer = sealer(&a);
    let mut wire = Vec::new();
    peer.seal(TLS13, 0, &[0, 0, 0], &mut wire);
    let (_, end) = read_all(&mut stream(&a, wire)).await;
    assert_eq!(end.unwrap_err().kind(), io::ErrorKind::InvalidData);
}

// ------------------------------------------------- malformed records

#[tokio::test]
async fn a_tampered_record_fails_authentication_for_every_version_and_aead() {
    for version in [TLS12, TLS13] {
        for kind in KINDS {
            let (a, _) = pair(version, kind);
            let mut wire = seal(&mut sealer(&a), version, CT_APPLICATION_DATA, b"secret");
            let last = wire.len() - 1;
            wire[last] ^= 1;
            let (got, end) = read_all(&mut stream(&a, wire)).await;
            assert!(got.is_empty());
            let err = end.unwrap_err();
            assert_eq!(
                err.kind(),
                io::ErrorKind::InvalidData,
                "{version:x} {kind:?}"
            );
            assert_eq!(err.to_string(), "TLS record failed authentication");
        }
    }
}

#[tokio::test]
async fn a_record_body_too_short_for_its_aead_is_refused_not_sliced() {
    for version in [TLS12, TLS13] {
        for kind in KINDS {
            let (a, _) = pair(version, kind);
            for len in 0..=(GCM_EXPLICIT_LEN + TAG_LEN) as u16 {
                let mut wire = vec![CT_APPLICATION_DATA, 3, 3];
                wire.extend(len.to_be_bytes());
                wire.extend(vec![0u8; len as usize]);
                let (_, end) = read_all(&mut stream(&a, wire)).await;
                assert_eq!(
                    end.unwrap_err().kind(),
                    io::ErrorKind::InvalidData,
                    "{version:x} {kind:?} body {len}"
                );
            }
        }
    }
}

#[tokio::test]
async fn an_oversized_record_header_is_refused_before_its_body_arrives() {
    let (a, _) = pair(TLS13, AeadKind::Aes128Gcm);
    let (_, end) = read_all(&mut stream(&a, vec![CT_APPLICATION_DATA, 3, 3, 0xff, 0xff])).await;
    let err = end.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    assert_eq!(err.to_string(), "oversized TLS record");
}

#[tokio::test]
async fn eof_inside_a_record_is_an_error_and_eof_between_records_is_eof() {
    let (a, _) = pair(TLS12, AeadKind::Aes128Gcm);
    let whole = seal(&mut sealer(&a), TLS12, CT_APPLICATION_DATA, b"x");
    let (got, end) = read_all(&mut stream(&a, whole.clone())).await;
    assert_eq!(got, b"x");
    end.unwrap();
    let (_, end) = read_all(&mut stream(&a, whole[..whole.len() - 1].to_vec())).await;
    assert_eq!(end.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
}

// ------------------------------------------------------------- alerts

#[tokio::test]
async fn close_notify_is_eof_and_shutdown_sends_one_then_refuses_writes() {
    let (a, b) = pair(TLS13, AeadKind::Aes128Gcm);
    let (x, y) = duplex(1 << 16);
    let mut a = TlsRecordStream::new(x, &a, Vec::new(), Vec::new()).unwrap();
    let mut b = TlsRecordStream::new(y, &b, Vec::new(), Vec::new()).unwrap();
    a.write_all(b"last").await.unwrap();
    a.shutdown().await.unwrap();
    let err = a.write_all(b"more").await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
    let (got, end) = read_all(&mut b).await;
    assert_eq!(got, b"last");
    end.unwrap();
    // A closed stream is not handed on.
    assert!(a.export().is_err());
}

#[tokio::test]
async fn a_fatal_alert_is_an_error_naming_it_and_a_malformed_alert_is_refused() {
    let (a, _) = pair(TLS13, AeadKind::Aes128Gcm);
    let wire = seal(&mut sealer(&a), TLS13, CT_ALERT, &[2, 40]);
    let err = read_all(&mut stream(&a, wire)).await.1.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
    assert_eq!(err.to_string(), "peer sent fatal TLS alert 40");
    for alert in [&[][..], &[1][..], &[1, 0, 0][..]] {
        let wire = seal(&mut sealer(&a), TLS13, CT_ALERT, alert);
        let err = read_all(&mut stream(&a, wire)).await.1.unwrap_err();
        assert_eq!(err.to_string(), "malformed alert", "{alert:?}");
    }
}

#[tokio::test]
async fn a_tls12_warning_alert_is_informational() {
    let (a, _) = pair(TLS12, AeadKind::Aes256Gcm);
    let mut peer = sealer(&a);
    let mut wire = seal(&mut peer, TLS12, CT_ALERT, &[1, 90]);
    wire.extend(seal(&mut peer, TLS12, CT_APPLICATION_DATA, b"after"));
    let (got, end) = read_all(&mut stream(&a, wire)).await;
    assert_eq!(got, b"after");
    end.unwrap();
}

#[tokio::test]
async fn an_unexpected_content_type_closes_with_unexpected_message() {
    let (a, _) = pair(TLS13, AeadKind::Aes128Gcm);
    let wire = seal(&mut sealer(&a), TLS13, 99, b"?");
    let mut s = stream(&a, wire);
    let err = read_all(&mut s).await.1.unwrap_err();
    assert_eq!(err.to_string(), "unexpected TLS content type 99");
    let sent = open_all(&mut opener(&a), TLS13, &s.get_ref().output);
    assert_eq!(sent, vec![(CT_ALERT, vec![2, ALERT_UNEXPECTED_MESSAGE])]);
}

// ------------------------------------------------ handshake messages

#[tokio::test]
async fn a_tls12_renegotiation_is_declined_with_a_warning_and_data_flows_on() {
    let (a, _) = pair(TLS12, AeadKind::Chacha20Poly1305);
    let mut peer = sealer(&a);
    let mut wire = seal(&mut peer, TLS12, CT_HANDSHAKE, &[1, 0, 0, 0]);
    wire.extend(seal(&mut peer, TLS12, CT_APPLICATION_DATA, b"still here"));
    let mut s = stream(&a, wire);
    let (got, end) = read_all(&mut s).await;
    assert_eq!(got, b"still here");
    end.unwrap();
    let sent = open_all(&mut opener(&a), TLS12, &s.get_ref().output);
    assert_eq!(sent, vec![(CT_ALERT, vec![1, ALERT_NO_RENEGOTIATION])]);
}

#[tokio::test]
async fn a_requested_key_update_is_followed_and_answered_under_the_old_key() {
    for kind in KINDS {
        let (a, _) = pair_with_secrets(kind);
        let mut peer = sealer(&a);
        // KeyUpdate(update_requested), then data under the next key.
        let mut wire = seal(&mut peer, TLS13, CT_HANDSHAKE, &[HS_KEY_UPDATE, 0, 0, 1, 1]);
        assert!(peer.key_update());
        wire.extend(seal(&mut peer, TLS13, CT_APPLICATION_DATA, b"new key"));
        let mut s = stream(&a, wire);
        let mut got = [0u8; 7];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"new key", "{kind:?}");
        assert_eq!(s.key_updates(), 2);
        // Our answer goes out (with the next read, write or flush) under the
        // old key; then we switched.
        s.flush().await.unwrap();
        let mut theirs = opener(&a);
        let sent = open_all(&mut theirs, TLS13, &s.get_ref().output);
        assert_eq!(sent, vec![(CT_HANDSHAKE, vec![HS_KEY_UPDATE, 0, 0, 1, 0])]);
        s.write_all(b"reply").await.unwrap();
        assert!(theirs.key_update());
        let out = s.get_ref().output.clone();
        let sent = open_all(
            &mut theirs,
            TLS13,
            &out[out.len() - (5 + 5 + 1 + TAG_LEN)..],
        );
        assert_eq!(sent, vec![(CT_APPLICATION_DATA, b"reply".to_vec())]);
        // The updated keys are what an export carries on.
        let (_, state, _, _) = s.export().unwrap();
        assert_eq!(state.tx.seq, 1);
        assert_eq!(state.rx.seq, 1);
        assert_ne!(state.rx.traffic_secret, a.rx.traffic_secret);
    }
}

#[tokio::test]
async fn a_key_update_split_across_records_is_reassembled_and_blocks_export_meanwhile() {
    let (a, _) = pair_with_secrets(AeadKind::Aes128Gcm);
    let mut peer = sealer(&a);
    let first = seal(&mut peer, TLS13, CT_HANDSHAKE, &[HS_KEY_UPDATE, 0]);
    let mut s =
        TlsRecordStream::new(Wire::new(Vec::new(), usize::MAX), &a, first, Vec::new()).unwrap();
    // Only half a message: no plaintext, clean EOF, and not exportable.
    let (got, end) = read_all(&mut s).await;
    assert!(got.is_empty());
    end.unwrap();
    let mut s = s
        .export()
        .expect_err("a split handshake message is not a safe point");
    let mut wire = seal(&mut peer, TLS13, CT_HANDSHAKE, &[0, 1, 0]);
    assert!(peer.key_update());
    wire.extend(seal(&mut peer, TLS13, CT_APPLICATION_DATA, b"ok"));
    s.io = Wire::new(wire, usize::MAX);
    let (got, end) = read_all(&mut s).await;
    assert_eq!(got, b"ok");
    end.unwrap();
    assert_eq!(s.key_updates(), 1);
}

#[tokio::test]
async fn a_key_update_without_a_captured_secret_closes_cleanly_with_an_error() {
    let (a, _) = pair(TLS13, AeadKind::Aes128Gcm);
    let wire = seal(
        &mut sealer(&a),
        TLS13,
        CT_HANDSHAKE,
        &[HS_KEY_UPDATE, 0, 0, 1, 0],
    );
    let mut s = stream(&a, wire);
    let err = read_all(&mut s).await.1.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
    assert!(err.to_string().contains("closed cleanly"), "{err}");
    let sent = open_all(&mut opener(&a), TLS13, &s.get_ref().output);
    assert_eq!(sent, vec![(CT_ALERT, vec![1, ALERT_CLOSE_NOTIFY])]);
}

#[tokio::test]
async fn malformed_post_handshake_messages_are_refused_with_unexpected_message() {
    let (a, _) = pair_with_secrets(AeadKind::Aes128Gcm);
    for message in [
        &[HS_KEY_UPDATE, 0, 0, 1, 2][..],    // request value out of range
        &[HS_KEY_UPDATE, 0, 0, 2, 0, 0][..], // KeyUpdate body of 2 bytes
        &[1, 0, 0, 0][..],                   // a ClientHello after the handshake
    ] {
        let wire = seal(&mut sealer(&a), TLS13, CT_HANDSHAKE, message);
        let mut s = stream(&a, wire);
        let err = read_all(&mut s).await.1.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{message:?}");
        assert!(
            err.to_string()
                .starts_with("unexpected post-handshake message")
        );
    }
    // A session ticket (client role) is accepted and dropped.
    let mut peer = sealer(&a);
    let mut wire = seal(
        &mut peer,
        TLS13,
        CT_HANDSHAKE,
        &[HS_NEW_SESSION_TICKET, 0, 0, 2, 9, 9],
    );
    wire.extend(seal(&mut peer, TLS13, CT_APPLICATION_DATA, b"fine"));
    let (got, end) = read_all(&mut stream(&a, wire)).await;
    assert_eq!(got, b"fine");
    end.unwrap();
}

// ---------------------------------------------------------- the state

#[test]
fn a_wire_state_round_trips_through_its_json_form() {
    for version in [TLS12, TLS13] {
        for kind in KINDS {
            let (a, b) = pair(version, kind);
            for state in [a, b] {
                let json = serde_json::to_vec(&state).unwrap();
                let back: TlsWireState = serde_json::from_slice(&json).unwrap();
                assert_eq!(back, state);
            }
        }
    }
    let (a, _) = pair_with_secrets(AeadKind::Aes256Gcm);
    let back: TlsWireState = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
    assert_eq!(back, a);
}

#[test]
fn a_state_from_an_older_version_without_role_or_traffic_secret_reads_as_a_server() {
    let json = r#"{"version":772,"aead":"aes_128_gcm",
        "tx":{"seq":1,"key":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0],"iv":[0,0,0,0,0,0,0,0,0,0,0,0]},
        "rx":{"seq":2,"key":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0],"iv":[0,0,0,0,0,0,0,0,0,0,0,0]}}"#;
    let state: TlsWireState = serde_json::from_str(json).unwrap();
    assert!(state.server);
    assert_eq!(state.tx.traffic_secret, None);
    assert_eq!((state.tx.seq, state.rx.seq), (1, 2));
}

#[tokio::test]
async fn an_export_carries_the_state_on_and_resumes_where_it_stopped() {
    let (a, b) = pair(TLS12, AeadKind::Aes128Gcm);
    let (x, y) = duplex(1 << 16);
    let mut a = TlsRecordStream::new(x, &a, Vec::new(), Vec::new()).unwrap();
    let mut b = TlsRecordStream::new(y, &b, Vec::new(), Vec::new()).unwrap();
    a.write_all(b"one").await.unwrap();
    let mut got = [0u8; 3];
    b.read_exact(&mut got).await.unwrap();
    let (tx_seq, rx_seq) = a.sequence_numbers();
    let (io, state, ciphertext, plaintext) = a.export().unwrap();
    assert_eq!((state.tx.seq, state.rx.seq), (tx_seq, rx_seq));
    assert!(ciphertext.is_empty() && plaintext.is_empty());
    // Through its wire form, as the handoff carries it.
    let state: TlsWireState = serde_json::from_slice(&serde_json::to_vec(&state).unwrap()).unwrap();
    let mut a = TlsRecordStream::new(io, &state, ciphertext, plaintext).unwrap();
    a.write_all(b"two").await.unwrap();
    b.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"two");
}

#[test]
fn a_malformed_state_is_refused_with_an_error_naming_what_is_wrong() {
    let (good, _) = pair(TLS13, AeadKind::Aes128Gcm);
    let new = |s: &TlsWireState| {
        TlsRecordStream::new(Wire::new(Vec::new(), 1), s, Vec::new(), Vec::new())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let mut s = good.clone();
    s.version = 0x0302;
    assert_eq!(new(&s), "unsupported TLS version 0x0302");
    let mut s = good.clone();
    s.aead = "rc4".into();
    assert_eq!(new(&s), "unsupported AEAD rc4");
    let mut s = good.clone();
    s.tx.key.pop();
    assert_eq!(new(&s), "bad key material: AEAD key length");
    let mut s = good.clone();
    s.rx.iv = vec![0; 11];
    assert_eq!(new(&s), "bad key material: IV must be 12 bytes");
    let mut s = good;
    s.aead = "aes_256_gcm".into(); // a 16-byte key for a 32-byte cipher
    assert_eq!(new(&s), "bad key material: AEAD key length");
    for json in [
        "",
        "{",
        "null",
        r#"{"version":772}"#,
        r#"{"version":-1,"aead":1}"#,
    ] {
        assert!(
            serde_json::from_str::<TlsWireState>(json).is_err(),
            "{json}"
        );
    }
}

#[test]
fn debug_output_never_contains_key_material() {
    let (mut a, _) = pair_with_secrets(AeadKind::Aes128Gcm);
    a.tx.key = vec![0xab; 16];
    let shown = format!("{a:?}");
    assert!(!shown.contains("171"), "{shown}"); // 0xab
    assert!(shown.contains("has_traffic_secret: true"), "{shown}");
    let s = stream(&a, Vec::new());
    let shown = format!("{s:?}");
    assert!(
        shown.contains("0x0304") && !shown.contains("171"),
        "{shown}"
    );
}

#[test]
fn aead_names_round_trip_and_unknown_names_are_refused() {
    for kind in KINDS {
        assert_eq!(AeadKind::from_name(kind.name()).unwrap(), kind);
    }
    assert!(matches!(
        AeadKind::from_name("AES_128_GCM"),
        Err(TlsStateError::Aead(_))
    ));
}

// ------------------------------------------------- secret capture

#[test]
fn a_captured_traffic_secret_is_found_by_the_iv_it_derives_for_three_generations() {
    let capture = SecretCapture::new(100);
    let secret = vec![5u8; 32];
    rustls::KeyLog::log(&capture, "CLIENT_HANDSHAKE_TRAFFIC_SECRET", &[], &secret);
    assert!(
        capture.is_empty(),
        "only application traffic secrets are kept"
    );
    rustls::KeyLog::log(&capture, "SERVER_TRAFFIC_SECRET_0", &[], &secret);
    assert_eq!(capture.len(), 1);
    // Generation 1 (after one KeyUpdate rustls followed before the move).
    let mut next = vec![0u8; 32];
    expand_label(hkdf::HKDF_SHA256, &secret, b"traffic upd", &mut next);
    assert_eq!(capture.take(&derive_iv(&next)), Some(next.clone()));
    assert_eq!(capture.take(&derive_iv(&next)), None, "taken once");
    assert_eq!(capture.take(&derive_iv(&secret)), Some(secret));
    assert_eq!(capture.take(&[0u8; 11]), None, "not an IV");
}

#[test]
fn the_capture_evicts_its_oldest_entries_beyond_capacity() {
    let capture = SecretCapture::new(CAPTURED_GENERATIONS);
    let (first, second) = (vec![1u8; 32], vec![2u8; 32]);
    rustls::KeyLog::log(&capture, "CLIENT_TRAFFIC_SECRET_0", &[], &first);
    rustls::KeyLog::log(&capture, "CLIENT_TRAFFIC_SECRET_0", &[], &second);
    assert_eq!(capture.take(&derive_iv(&first)), None);
    assert_eq!(capture.take(&derive_iv(&second)), Some(second));
}

// ---------------------------------------------- the aligned reader

fn records(lens: &[usize]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, len) in lens.iter().enumerate() {
        out.extend([CT_APPLICATION_DATA, 3, 3]);
        out.extend((*len as u16).to_be_bytes());
        out.extend(vec![i as u8; *len]);
    }
    out
}

#[test]
fn whole_records_counts_only_complete_records_that_fit() {
    let data = records(&[10, 20, 30]);
    assert_eq!(whole_records(&data, usize::MAX), data.len());
    assert_eq!(whole_records(&data[..data.len() - 1], usize::MAX), 15 + 25);
    assert_eq!(whole_records(&data, 15 + 25), 15 + 25);
    // Not even one fits: the first whole record, which the caller splits.
    assert_eq!(whole_records(&data, 4), 15);
    assert_eq!(whole_records(&data[..4], usize::MAX), 0, "a partial header");
    assert_eq!(whole_records(&[], usize::MAX), 0);
}

#[test]
fn owed_after_tracks_a_record_handed_out_in_pieces() {
    let data = records(&[10, 20]);
    assert_eq!(owed_after(&data, 0, 15), 0);
    assert_eq!(owed_after(&data, 0, 6), 9);
    assert_eq!(owed_after(&data[6..], 9, 9), 0);
    assert_eq!(owed_after(&data, 0, 15 + 3), 22);
}

#[tokio::test]
async fn the_aligned_reader_hands_out_whole_records_and_keeps_a_partial_one() {
    let data = records(&[10, 20, 30]);
    let cut = data.len() - 7;
    let mut r = RecordAlignedIo::new(Wire::new(data[..cut].to_vec(), usize::MAX));
    let mut buf = vec![0u8; 1024];
    let n = r.read(&mut buf).await.unwrap();
    assert_eq!(n, 15 + 25);
    assert!(r.is_aligned());
    let (_, rest) = r.into_parts();
    assert_eq!(rest, data[15 + 25..cut].to_vec());
}

#[tokio::test]
async fn a_buffer_smaller_than_a_record_loses_alignment_until_the_record_completes() {
    let data = records(&[30, 5]);
    let mut r = RecordAlignedIo::new(Wire::new(data.clone(), 8));
    let mut small = [0u8; 16];
    let mut got = Vec::new();
    let mut aligned_at = Vec::new();
    loop {
        let n = r.read(&mut small).await.unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&small[..n]);
        if r.is_aligned() {
            aligned_at.push(got.len());
        }
    }
    assert_eq!(got, data);
    assert_eq!(aligned_at, vec![35, 45], "aligned only at record ends");
}

// ------------------------------------------------------------- fuzzing

/// The fuzz target's check on inputs chosen to reach every branch it
/// covers: every selector byte over raw and sealed bodies, a state's JSON,
/// alerts, KeyUpdates, padding and oversized headers. The fuzzer explores
/// from here (`sidecar/fuzz`, target `tls_record`).
#[test]
fn the_fuzz_targets_check_holds_on_inputs_reaching_every_branch() {
    let (json_state, _) = pair(TLS13, AeadKind::Aes128Gcm);
    crate::fuzzing::run(&serde_json::to_vec(&json_state).unwrap());
    let bodies: [&[u8]; 8] = [
        &[],
        &[CT_APPLICATION_DATA, 3, 3, 0, 20, 1, 2, 3],
        &[CT_APPLICATION_DATA, 3, 3, 0xff, 0xff],
        // (type, length, payload) triples for the sealed mode:
        &[
            CT_APPLICATION_DATA,
            5,
            b'h',
            b'e',
            b'l',
            b'l',
            b'o',
            CT_ALERT,
            2,
            1,
            0,
        ],
        &[
            CT_HANDSHAKE,
            5,
            HS_KEY_UPDATE,
            0,
            0,
            1,
            1,
            CT_APPLICATION_DATA,
            2,
            b'h',
            b'i',
        ],
        &[CT_HANDSHAKE, 2, HS_KEY_UPDATE, 0, CT_HANDSHAKE, 3, 0, 1, 0],
        &[0, 3, 0, 0, 0, CT_ALERT, 2, 2, 40, 99, 1, 0],
        &[
            CT_CHANGE_CIPHER_SPEC,
            1,
            1,
            CT_HANDSHAKE,
            4,
            HS_NEW_SESSION_TICKET,
            0,
            0,
            0,
        ],
    ];
    for sel in 0..=255u8 {
        for body in bodies {
            let mut input = vec![sel];
            input.extend_from_slice(body);
            crate::fuzzing::run(&input);
        }
    }
}
