//! `baton-tls-record` on arbitrary input: the record-layer state as the
//! handoff carries it (JSON) and the records a moved session receives.
//!
//! * Any bytes parsed as a `TlsWireState` and resumed: an error or a
//!   stream, never a panic.
//! * The first byte picks a valid state (version, AEAD, chunk size, with or
//!   without TLS 1.3 traffic secrets); in raw mode the rest is received
//!   ciphertext as it comes off the socket (headers, lengths, bodies too
//!   short, failed authentication); in sealed mode (TLS 1.3, AES-128-GCM)
//!   the rest is a list of (content type, payload) records this target
//!   seals with the state's key, so alerts, handshake messages (KeyUpdate
//!   included) and padding reach the parser behind authentication. Reading
//!   ends in EOF or an error, never a panic or a loop.
//! * `RecordAlignedIo` over the same bytes hands every byte on, in order.
#![no_main]

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use baton_tls_record::{
    DirectionSecrets, RecordAlignedIo, TLS12, TLS13, TlsRecordStream, TlsWireState,
};
use libfuzzer_sys::fuzz_target;
use ring::aead;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Received bytes, at most `chunk` per read; writes are discarded.
struct Wire<'a> {
    input: &'a [u8],
    chunk: usize,
}

impl AsyncRead for Wire<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let n = self.input.len().min(self.chunk).min(buf.remaining());
        buf.put_slice(&self.input[..n]);
        self.input = &self.input[n..];
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Wire<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Poll::Ready(Ok(data.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

const AEADS: [(&str, usize); 3] = [
    ("aes_128_gcm", 16),
    ("aes_256_gcm", 32),
    ("chacha20_poly1305", 32),
];
const KEY: u8 = 0x42;
const IV: [u8; 12] = [7; 12];

fn state(version: u16, aead: (&str, usize), secrets: bool) -> TlsWireState {
    let dir = DirectionSecrets {
        seq: 0,
        key: vec![KEY; aead.1],
        iv: IV.to_vec(),
        traffic_secret: secrets.then(|| vec![9; if aead.0 == "aes_256_gcm" { 48 } else { 32 }]),
    };
    TlsWireState {
        version,
        aead: aead.0.into(),
        tx: dir.clone(),
        rx: dir,
        server: true,
    }
}

/// TLS 1.3 records sealed with AES-128-GCM under [`KEY`]/[`IV`], one per
/// (type, length, payload) triple of `spec`.
fn sealed(spec: &[u8]) -> Vec<u8> {
    let key =
        aead::LessSafeKey::new(aead::UnboundKey::new(&aead::AES_128_GCM, &[KEY; 16]).unwrap());
    let mut out = Vec::new();
    let mut rest = spec;
    let mut seq = 0u64;
    while let [typ, len, tail @ ..] = rest {
        let n = (*len as usize).min(tail.len());
        let (payload, next) = tail.split_at(n);
        rest = next;
        let mut body = payload.to_vec();
        body.push(*typ);
        let len = (body.len() + 16) as u16;
        let header = [23, 3, 3, (len >> 8) as u8, len as u8];
        let mut nonce = IV;
        for (b, s) in nonce[4..].iter_mut().zip(seq.to_be_bytes()) {
            *b ^= s;
        }
        let tag = key
            .seal_in_place_separate_tag(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(header),
                &mut body,
            )
            .unwrap();
        out.extend_from_slice(&header);
        out.extend_from_slice(&body);
        out.extend_from_slice(tag.as_ref());
        seq += 1;
    }
    out
}

/// Reads until EOF or an error; the bytes read.
fn drain<R: AsyncRead + Unpin>(mut r: R, limit: usize) -> Vec<u8> {
    let mut cx = Context::from_waker(Waker::noop());
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    // Every read consumes input or ends: more polls than bytes is a loop.
    for _ in 0..limit + 16 {
        let mut rb = ReadBuf::new(&mut buf);
        match Pin::new(&mut r).poll_read(&mut cx, &mut rb) {
            Poll::Ready(Ok(())) if rb.filled().is_empty() => return got,
            Poll::Ready(Ok(())) => got.extend_from_slice(rb.filled()),
            Poll::Ready(Err(_)) => return got,
            Poll::Pending => panic!("in-memory I/O never blocks"),
        }
    }
    panic!("reading {limit} bytes did not end");
}

fuzz_target!(|data: &[u8]| {
    if let Ok(state) = serde_json::from_slice::<TlsWireState>(data) {
        let _ = TlsRecordStream::new(
            Wire {
                input: &[],
                chunk: 1,
            },
            &state,
            Vec::new(),
            Vec::new(),
        );
    }
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(sel >> 4) + 1;
    let secrets = sel & 0b1000 != 0;
    let (state, wire) = if sel & 1 == 1 {
        (state(TLS13, AEADS[0], secrets), sealed(rest))
    } else {
        let version = if sel & 0b10 == 0 { TLS12 } else { TLS13 };
        (
            state(version, AEADS[usize::from(sel >> 2) % 3], secrets),
            rest.to_vec(),
        )
    };
    let stream = TlsRecordStream::new(
        Wire {
            input: &wire,
            chunk,
        },
        &state,
        Vec::new(),
        Vec::new(),
    )
    .expect("a valid state");
    let plain = drain(stream, wire.len());
    assert!(plain.len() <= wire.len(), "more plaintext than ciphertext");
    let aligned = drain(
        RecordAlignedIo::new(Wire {
            input: &wire,
            chunk,
        }),
        wire.len(),
    );
    assert_eq!(
        aligned, wire,
        "the aligned reader hands every byte on, in order"
    );
});
