//! What the `tls_record` fuzz target (`sidecar/fuzz`) runs on each input,
//! here so it is compiled and exercised by `cargo test` too (feature
//! `fuzzing` for the fuzz crate; not part of the API).
//!
//! * Any bytes parsed as a [`TlsWireState`] (the handoff's JSON form) and
//!   resumed: an error or a stream, never a panic.
//! * The first byte picks a valid state (version, AEAD, read size, TLS 1.3
//!   traffic secrets or not). In raw mode the rest is ciphertext as it comes
//!   off the socket (headers, lengths, short bodies, failed
//!   authentication); in sealed mode (TLS 1.3) the rest is a list of
//!   (content type, length, payload) records sealed here with the state's
//!   key, so alerts, handshake messages (KeyUpdate included) and padding
//!   reach the parser behind authentication. Reading ends in EOF or an
//!   error, never a panic or a loop, and yields no more plaintext than
//!   ciphertext.
//! * [`RecordAlignedIo`] over the same bytes hands every byte on, in order.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::{
    AeadKind, Cipher, DirectionSecrets, RecordAlignedIo, TLS12, TLS13, TlsRecordStream,
    TlsWireState,
};

/// In-memory I/O: reads `input` at most `chunk` bytes at a time, collects
/// writes in `output`.
#[derive(Debug)]
pub struct Wire {
    pub input: Vec<u8>,
    pub pos: usize,
    pub chunk: usize,
    pub output: Vec<u8>,
}

impl Wire {
    pub fn new(input: Vec<u8>, chunk: usize) -> Self {
        Self {
            input,
            pos: 0,
            chunk: chunk.max(1),
            output: Vec::new(),
        }
    }
}

impl AsyncRead for Wire {
    fn poll_read(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let n = (this.input.len() - this.pos)
            .min(this.chunk)
            .min(buf.remaining());
        buf.put_slice(&this.input[this.pos..this.pos + n]);
        this.pos += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Wire {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().output.extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

const KINDS: [AeadKind; 3] = [
    AeadKind::Aes128Gcm,
    AeadKind::Aes256Gcm,
    AeadKind::Chacha20Poly1305,
];

/// A valid state with fixed keys, both directions alike.
pub fn state(version: u16, kind: AeadKind, traffic_secrets: bool) -> TlsWireState {
    let secret_len = if kind == AeadKind::Aes256Gcm { 48 } else { 32 };
    let dir = DirectionSecrets {
        seq: 0,
        key: vec![0x42; kind.algorithm().key_len()],
        iv: vec![7; 12],
        traffic_secret: traffic_secrets.then(|| vec![9; secret_len]),
    };
    TlsWireState {
        version,
        aead: kind.name().into(),
        tx: dir.clone(),
        rx: dir,
        server: true,
    }
}

/// Records sealed as `state`'s peer sends them, one per (type, length,
/// payload) triple of `spec` (a short payload is what is left).
pub fn sealed(state: &TlsWireState, spec: &[u8]) -> Vec<u8> {
    let kind = AeadKind::from_name(&state.aead).expect("a valid state");
    let mut peer = Cipher::new(kind, &state.rx).expect("a valid state");
    let mut out = Vec::new();
    let mut rest = spec;
    while let [typ, len, tail @ ..] = rest {
        let (payload, next) = tail.split_at(usize::from(*len).min(tail.len()));
        peer.seal(state.version, *typ, payload, &mut out);
        rest = next;
    }
    out
}

/// Polls `r` until EOF or an error; what it read. Panics on a loop: every
/// read either yields a byte or ends, so `limit` bytes allow `limit + 1`
/// reads.
pub fn drain<R: AsyncRead + Unpin>(mut r: R, limit: usize) -> Vec<u8> {
    let mut cx = Context::from_waker(Waker::noop());
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    for _ in 0..=limit {
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

/// One fuzz input (see the module docs).
pub fn run(data: &[u8]) {
    if let Ok(state) = serde_json::from_slice::<TlsWireState>(data) {
        let _ = TlsRecordStream::new(Wire::new(Vec::new(), 1), &state, Vec::new(), Vec::new());
    }
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(sel >> 4) + 1;
    let secrets = sel & 0b1000 != 0;
    let kind = KINDS[usize::from(sel >> 2 & 0b11) % 3];
    let (state, wire) = if sel & 1 == 1 {
        let state = state(TLS13, kind, secrets);
        let wire = sealed(&state, rest);
        (state, wire)
    } else {
        let version = if sel & 0b10 == 0 { TLS12 } else { TLS13 };
        (state(version, kind, secrets), rest.to_vec())
    };
    let stream = TlsRecordStream::new(
        Wire::new(wire.clone(), chunk),
        &state,
        Vec::new(),
        Vec::new(),
    )
    .expect("a valid state");
    let plain = drain(stream, wire.len());
    assert!(plain.len() <= wire.len(), "more plaintext than ciphertext");
    let aligned = drain(
        RecordAlignedIo::new(Wire::new(wire.clone(), chunk)),
        wire.len(),
    );
    assert_eq!(
        aligned, wire,
        "the aligned reader hands every byte on, in order"
    );
}
