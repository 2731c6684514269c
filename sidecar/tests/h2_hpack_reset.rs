//! Evidence for docs/decisions/0060 (moving idle HTTP/2 connections): the
//! client's HPACK encoder table can be emptied with a
//! SETTINGS_HEADER_TABLE_SIZE=0 round trip (RFC 7541 §4.2, §6.3), after
//! which a *fresh* `h2` server — what the new process would run — decodes
//! the client's next request; without the round trip it cannot.
//!
//! A scripted server (raw frames on a real socket) answers one request of
//! hyper's HTTP/2 client (the `h2` crate, as in tonic and the sidecar), then
//! captures the HEADERS block of the client's second request and feeds it,
//! behind a synthetic client preface, to a fresh hyper HTTP/2 server.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 1;
const SETTINGS: u8 = 4;
const GOAWAY: u8 = 7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;
/// A header the client's encoder inserts into its dynamic table.
const CUSTOM: (&str, &str) = ("x-baton-probe", "a value long enough to be worth indexing");
const LIMIT: Duration = Duration::from_secs(10);

struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

impl Frame {
    fn encode(&self) -> Vec<u8> {
        let len = self.payload.len() as u32;
        let mut out = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            self.kind,
            self.flags,
        ];
        out.extend_from_slice(&self.stream.to_be_bytes());
        out.extend_from_slice(&self.payload);
        out
    }
}

async fn read_frame(io: &mut (impl AsyncRead + Unpin)) -> Frame {
    let mut head = [0u8; 9];
    tokio::time::timeout(LIMIT, io.read_exact(&mut head))
        .await
        .expect("a frame in time")
        .expect("a frame");
    let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
    let mut payload = vec![0u8; len];
    io.read_exact(&mut payload).await.unwrap();
    Frame {
        kind: head[3],
        flags: head[4],
        stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
        payload,
    }
}

async fn write_frame(io: &mut (impl AsyncWrite + Unpin), f: Frame) {
    io.write_all(&f.encode()).await.unwrap();
}

/// Reads frames, acknowledging the client's SETTINGS and counting its
/// ACKs of ours in `acks`, until a HEADERS frame (returned) or, with
/// `until_acks`, until that many ACKs (`None`).
async fn next_headers_or_ack(
    io: &mut TcpStream,
    until_acks: Option<usize>,
    acks: &mut usize,
) -> Option<Frame> {
    loop {
        if until_acks.is_some_and(|n| *acks >= n) {
            return None;
        }
        let f = read_frame(io).await;
        match (f.kind, f.flags & ACK != 0) {
            (SETTINGS, false) => {
                write_frame(
                    io,
                    Frame {
                        kind: SETTINGS,
                        flags: ACK,
                        stream: 0,
                        payload: vec![],
                    },
                )
                .await
            }
            (SETTINGS, true) => *acks += 1,
            (HEADERS, _) if until_acks.is_none() => {
                assert!(
                    f.flags & END_HEADERS != 0,
                    "a header block in one frame (no CONTINUATION)"
                );
                return Some(f);
            }
            _ => {}
        }
    }
}

/// The HEADERS frame of the client's second request, with (`reset`) or
/// without a SETTINGS_HEADER_TABLE_SIZE=0 round trip after the first.
async fn second_request_block(reset: bool) -> Frame {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (ack_tx, ack_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (mut io, _) = listener.accept().await.unwrap();
        let mut preface = [0u8; 24];
        io.read_exact(&mut preface).await.unwrap();
        assert_eq!(&preface[..], PREFACE);
        write_frame(
            &mut io,
            Frame {
                kind: SETTINGS,
                flags: 0,
                stream: 0,
                payload: vec![],
            },
        )
        .await;
        let mut acks = 0;
        let first = next_headers_or_ack(&mut io, None, &mut acks).await.unwrap();
        // `:status: 200` from the static table, end of stream.
        write_frame(
            &mut io,
            Frame {
                kind: HEADERS,
                flags: END_HEADERS | END_STREAM,
                stream: first.stream,
                payload: vec![0x88],
            },
        )
        .await;
        if reset {
            write_frame(
                &mut io,
                Frame {
                    kind: SETTINGS,
                    flags: 0,
                    stream: 0,
                    payload: vec![0, 1, 0, 0, 0, 0],
                },
            )
            .await;
            // The ACK of the first SETTINGS and of this one.
            assert!(
                next_headers_or_ack(&mut io, Some(2), &mut acks)
                    .await
                    .is_none()
            );
        }
        let _ = ack_tx.send(());
        next_headers_or_ack(&mut io, None, &mut acks).await.unwrap()
    });

    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake::<_, _, Empty<Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let request = |path: &str| {
        http::Request::get(format!("http://upstream{path}"))
            .header(CUSTOM.0, CUSTOM.1)
            .body(Empty::new())
            .unwrap()
    };
    let first = tokio::time::timeout(LIMIT, sender.send_request(request("/one")))
        .await
        .expect("first answer in time")
        .unwrap();
    assert_eq!(first.status(), 200);
    tokio::time::timeout(LIMIT, ack_rx)
        .await
        .expect("the client acknowledged in time")
        .unwrap();
    // The second request is only sent; the scripted server never answers.
    let second = sender.send_request(request("/two"));
    tokio::spawn(async move {
        let _ = tokio::time::timeout(LIMIT, second).await;
    });
    tokio::time::timeout(LIMIT, server)
        .await
        .expect("the second request in time")
        .unwrap()
}

/// What a fresh hyper HTTP/2 server makes of `block`, behind a synthetic
/// preface (magic and an empty SETTINGS): the request's probe header, or
/// the GOAWAY error code it answered with.
async fn fresh_server_reads(block: Frame) -> Result<String, u32> {
    let (mut client, server_io) = tokio::io::duplex(1 << 16);
    let seen: Arc<Mutex<Option<String>>> = Arc::default();
    let s = seen.clone();
    let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let value = req
            .headers()
            .get(CUSTOM.0)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .unwrap_or_default();
        *s.lock().unwrap() = Some(format!("{} {value}", req.uri().path()));
        async { Ok::<_, std::convert::Infallible>(http::Response::new(Empty::<Bytes>::new())) }
    });
    let server = tokio::spawn(
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(server_io), svc),
    );
    client.write_all(PREFACE).await.unwrap();
    write_frame(
        &mut client,
        Frame {
            kind: SETTINGS,
            flags: 0,
            stream: 0,
            payload: vec![],
        },
    )
    .await;
    write_frame(&mut client, block).await;
    let outcome = loop {
        let f = read_frame(&mut client).await;
        match f.kind {
            HEADERS => break Ok(seen.lock().unwrap().clone().expect("the service ran")),
            GOAWAY => {
                let code =
                    u32::from_be_bytes([f.payload[4], f.payload[5], f.payload[6], f.payload[7]]);
                break Err(code);
            }
            _ => {}
        }
    };
    server.abort();
    outcome
}

#[tokio::test]
async fn without_a_reset_the_next_request_references_the_old_table_and_a_fresh_server_refuses_it() {
    let block = second_request_block(false).await;
    // It refers to entries the first request inserted, which a decoder that
    // never saw them cannot resolve: the connection fails (`h2` answers
    // GOAWAY PROTOCOL_ERROR for an index past its table; RFC 7541 §2.3.3
    // calls it a decoding error, COMPRESSION_ERROR in RFC 9113 terms).
    let outcome = fresh_server_reads(block).await;
    assert!(
        matches!(outcome, Err(0x1) | Err(0x9)),
        "a fresh server decoded a block that refers to another decoder's table: {outcome:?}"
    );
}

#[tokio::test]
async fn after_a_header_table_size_0_round_trip_a_fresh_server_decodes_the_next_request() {
    let block = second_request_block(true).await;
    // RFC 7541 §4.2/§6.3: the block starts with a dynamic table size
    // update to 0 (001 00000).
    assert_eq!(block.payload[0], 0x20, "{:02x?}", block.payload);
    // Stream 3 on a server that never saw stream 1: accepted (RFC 9113
    // §5.1.1), decoded with an empty table.
    assert_eq!(block.stream, 3);
    assert_eq!(
        fresh_server_reads(block).await,
        Ok(format!("/two {}", CUSTOM.1))
    );
}
