//! The handoff wire protocol: framed messages (+ descriptors) on the handoff socket.
//!
//! Frame layout (all integers big-endian):
//!
//! ```text
//! +------------+----------+----------+---------------+-----------+
//! | header_len | blob_len | fd_count | header (JSON) | blob      |
//! |  u32       |  u32     |  u16     | header_len B  | blob_len B|
//! +------------+----------+----------+---------------+-----------+
//! ```
//!
//! The header is a JSON [`Message`]; the blob carries raw bytes that would be
//! wasteful in JSON (unread connection bytes). `fd_count` descriptors ride
//! on the first bytes of the frame (see [`super::fd`]); the 10-byte prefix
//! therefore bounds one frame to `10 * SCM_MAX_FD` descriptors.
//!
//! Why JSON headers: both sides of a handoff are *different* versions (N and
//! N±1). Serde ignores unknown fields and `#[serde(default)]` fills missing
//! ones, so a version can add optional fields without breaking its
//! neighbours; anything bigger bumps the protocol version, and [`negotiate`]
//! picks the highest version both sides speak.
//!
//! The codec ([`encode`], [`Decoder`]) is pure and tested without sockets;
//! [`Channel`] is the thin I/O layer over [`FdStream`].

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::os::fd::{OwnedFd, RawFd};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::fd::{FdStream, SCM_MAX_FD};

/// Fixed prefix: header_len (4) + blob_len (4) + fd_count (2).
pub const PREFIX_LEN: usize = 10;
/// Upper bound on a JSON header: a config snapshot is the largest.
pub const MAX_HEADER_LEN: usize = 16 << 20;
/// Upper bound on a blob: a connection's buffered bytes in both directions.
pub const MAX_BLOB_LEN: usize = 64 << 20;
/// Upper bound on descriptors per frame (one per prefix byte and batch).
pub const MAX_FDS_PER_FRAME: usize = PREFIX_LEN * SCM_MAX_FD;

/// Inclusive range of protocol versions a build speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionRange {
    pub min: u32,
    pub max: u32,
}

impl VersionRange {
    /// What this build speaks: its own version and the one before it, so that
    /// N→N+1 (upgrade) and N+1→N (rollback) both negotiate N.
    pub fn this_build() -> Self {
        let v = baton_contract::HANDOFF_PROTOCOL_VERSION;
        Self {
            min: v.saturating_sub(1).max(1),
            max: v,
        }
    }
}

/// Picks the highest version both ranges contain, or explains why none.
pub fn negotiate(ours: VersionRange, theirs: VersionRange) -> Result<u32, String> {
    if theirs.min > theirs.max {
        return Err(format!(
            "peer sent an empty version range {}..={}",
            theirs.min, theirs.max
        ));
    }
    let hi = ours.max.min(theirs.max);
    let lo = ours.min.max(theirs.min);
    if hi >= lo {
        Ok(hi)
    } else {
        Err(format!(
            "incompatible handoff protocol: we speak {}..={}, peer speaks {}..={}",
            ours.min, ours.max, theirs.min, theirs.max
        ))
    }
}

/// What kind of connection is moving, which decides how the new process
/// resumes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnKind {
    /// Opaque TCP proxy: fds = [downstream, upstream].
    Tcp,
    /// HTTP/1.1 between requests: fds = [downstream]; `to_upstream` holds
    /// bytes of the next (pipelined) request already read.
    Http1,
    /// Protocol 3: HTTP/2 with no stream open: fds = [downstream];
    /// `to_upstream` holds client bytes read and not given to `h2` yet,
    /// `to_downstream` the connection's carried state (the sidecar's
    /// `h2_state::ConnState::encode`; decision 0062).
    Http2,
}

pub use baton_tls_record::{DirectionSecrets, TlsWireState};

/// One handoff message. Direction in the comments: old → new or new → old.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    /// new → old: first message.
    Hello {
        versions: VersionRange,
        sidecar_version: String,
    },
    /// old → new: accepted, speaking `protocol_version`.
    Welcome {
        protocol_version: u32,
        sidecar_version: String,
    },
    /// old → new: refused; the old process keeps serving.
    Refuse { reason: String },
    /// old → new: listening sockets, one descriptor each, in order.
    Listeners { listeners: Vec<ListenerInfo> },
    /// new → old: the new process accepts on every passed listener now, so
    /// the old one may stop accepting without any SYN going unanswered.
    Accepting,
    /// old → new: config snapshot, certificate and counters.
    State(StateSnapshot),
    /// old → new: one live connection. The blob holds `to_upstream_len` bytes
    /// (read from downstream, not yet forwarded) then `to_downstream_len`.
    Connection(ConnectionHeader),
    /// new → old: connection `id` adopted; the old may release it.
    Ack { id: u64 },
    /// new → old: connection `id` could not be adopted; the old keeps it.
    Nack { id: u64, reason: String },
    /// old → new: nothing more will be sent; `connections` were offered.
    /// `counters` holds what the old process counted since `State` (its
    /// HTTP/2 connections drained first), so totals carry over exactly.
    Done {
        connections: u64,
        #[serde(default)]
        counters: BTreeMap<String, u64>,
    },
    /// new → old: handoff complete; the old may exit.
    Complete,
}

impl Message {
    /// Message type name, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "hello",
            Message::Welcome { .. } => "welcome",
            Message::Refuse { .. } => "refuse",
            Message::Listeners { .. } => "listeners",
            Message::Accepting => "accepting",
            Message::State(_) => "state",
            Message::Connection(_) => "connection",
            Message::Ack { .. } => "ack",
            Message::Nack { .. } => "nack",
            Message::Done { .. } => "done",
            Message::Complete => "complete",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenerInfo {
    /// Listener name in the config (`outbound`, `inbound`, `admin`, …).
    pub name: String,
    /// Local address it is bound to.
    pub addr: String,
}

#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StateSnapshot {
    /// The current config snapshot, as the data plane serializes it.
    #[serde(default)]
    pub config: serde_json::Value,
    /// Mesh certificate chain and key (PEM), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_chain_pem: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_key_pem: Option<String>,
    /// Trust bundle (PEM) that goes with the certificate (protocol 1 peers
    /// ignore it; an identity without it is not imported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust_bundle_pem: Option<String>,
    /// Monotonic counters by metric name, so none goes backwards.
    #[serde(default)]
    pub counters: BTreeMap<String, u64>,
}

/// Never prints the certificate material (the key is a secret).
impl std::fmt::Debug for StateSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateSnapshot")
            .field("config", &self.config)
            .field("identity", &self.private_key_pem.is_some())
            .field("counters", &self.counters)
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConnectionHeader {
    pub id: u64,
    pub kind: ConnKind,
    #[serde(default)]
    pub to_upstream_len: u32,
    #[serde(default)]
    pub to_downstream_len: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsWireState>,
    /// TLS only: received ciphertext not yet decrypted (a partial record),
    /// after the two plaintext parts in the blob.
    #[serde(default)]
    pub tls_ciphertext_len: u32,
    /// Protocol 2: record-layer state of the originated TLS session to the
    /// upstream (raw TCP only; `server` is false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub up_tls: Option<Box<TlsWireState>>,
    /// Protocol 2: the upstream session's received, undecrypted ciphertext,
    /// last in the blob.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub up_tls_ciphertext_len: u32,
    /// Data-plane details needed to resume (listener name, route, peer…).
    #[serde(default)]
    pub meta: serde_json::Value,
    /// `CLOCK_MONOTONIC` nanoseconds at which the old process stopped
    /// reading the connection (0: not sent). The new process measures the
    /// connection's pause from it; any version may omit or ignore it.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub parked_at_ns: u64,
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// First protocol version whose connections may carry [`ConnectionHeader::up_tls`].
pub const UPSTREAM_TLS_SINCE: u32 = 2;
/// First protocol version that may send [`ConnKind::Http2`] connections
/// (a version-2 peer cannot read the kind: its HTTP/2 connections drain).
pub const HTTP2_SINCE: u32 = 3;

/// A decoded frame: message, blob, and the descriptors that came with it.
#[derive(Debug)]
pub struct Frame {
    pub msg: Message,
    pub blob: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("handoff socket I/O: {0}")]
    Io(#[from] io::Error),
    #[error("frame header of {0} bytes exceeds the limit")]
    HeaderTooLarge(usize),
    #[error("frame blob of {0} bytes exceeds the limit")]
    BlobTooLarge(usize),
    #[error("frame carries {0} descriptors, more than the limit")]
    TooManyFds(usize),
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("frame announced {expected} descriptors but {got} arrived")]
    MissingFds { expected: usize, got: usize },
    #[error("peer closed the handoff socket")]
    Closed,
    #[error("peer closed the handoff socket in the middle of a frame")]
    Truncated,
    #[error("unexpected message: {0}")]
    Unexpected(String),
    #[error("refused: {0}")]
    Refused(String),
    #[error("timed out waiting for the peer")]
    Timeout,
}

impl ProtocolError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            ProtocolError::Io(_) => "io",
            ProtocolError::HeaderTooLarge(_)
            | ProtocolError::BlobTooLarge(_)
            | ProtocolError::TooManyFds(_)
            | ProtocolError::Malformed(_)
            | ProtocolError::MissingFds { .. } => "malformed",
            ProtocolError::Closed | ProtocolError::Truncated => "closed",
            ProtocolError::Unexpected(_) => "unexpected",
            ProtocolError::Refused(_) => "refused",
            ProtocolError::Timeout => "timeout",
        }
    }
}

/// Encodes one frame. Pure.
pub fn encode(msg: &Message, blob: &[u8], fd_count: usize) -> Result<Vec<u8>, ProtocolError> {
    let header = serde_json::to_vec(msg).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    if header.len() > MAX_HEADER_LEN {
        return Err(ProtocolError::HeaderTooLarge(header.len()));
    }
    if blob.len() > MAX_BLOB_LEN {
        return Err(ProtocolError::BlobTooLarge(blob.len()));
    }
    if fd_count > MAX_FDS_PER_FRAME {
        return Err(ProtocolError::TooManyFds(fd_count));
    }
    let mut out = Vec::with_capacity(PREFIX_LEN + header.len() + blob.len());
    out.extend_from_slice(&(header.len() as u32).to_be_bytes());
    out.extend_from_slice(&(blob.len() as u32).to_be_bytes());
    out.extend_from_slice(&(fd_count as u16).to_be_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(blob);
    Ok(out)
}

/// Incremental frame decoder. Pure: feed bytes, take frames.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: Vec<u8>,
}

/// A decoded frame before its descriptors are attached.
#[derive(Debug, PartialEq)]
pub struct RawFrame {
    pub msg: Message,
    pub blob: Vec<u8>,
    pub fd_count: usize,
}

impl Decoder {
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes held that do not yet form a whole frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Takes the next whole frame, if one is buffered. Limits are checked as
    /// soon as the prefix arrives so a hostile length never allocates.
    pub fn next_frame(&mut self) -> Result<Option<RawFrame>, ProtocolError> {
        if self.buf.len() < PREFIX_LEN {
            return Ok(None);
        }
        let header_len = u32::from_be_bytes(self.buf[0..4].try_into().expect("4 bytes")) as usize;
        let blob_len = u32::from_be_bytes(self.buf[4..8].try_into().expect("4 bytes")) as usize;
        let fd_count = u16::from_be_bytes(self.buf[8..10].try_into().expect("2 bytes")) as usize;
        if header_len > MAX_HEADER_LEN {
            return Err(ProtocolError::HeaderTooLarge(header_len));
        }
        if blob_len > MAX_BLOB_LEN {
            return Err(ProtocolError::BlobTooLarge(blob_len));
        }
        if fd_count > MAX_FDS_PER_FRAME {
            return Err(ProtocolError::TooManyFds(fd_count));
        }
        let total = PREFIX_LEN + header_len + blob_len;
        if self.buf.len() < total {
            return Ok(None);
        }
        let msg: Message = serde_json::from_slice(&self.buf[PREFIX_LEN..PREFIX_LEN + header_len])
            .map_err(|e| ProtocolError::Malformed(e.to_string()))?;
        let blob = self.buf[PREFIX_LEN + header_len..total].to_vec();
        self.buf.drain(..total);
        if let Message::Connection(c) = &msg
            && c.to_upstream_len as usize
                + c.to_downstream_len as usize
                + c.tls_ciphertext_len as usize
                != blob.len()
        {
            return Err(ProtocolError::Malformed(format!(
                "connection {} announces {}+{}+{} buffered bytes but the blob has {}",
                c.id,
                c.to_upstream_len,
                c.to_downstream_len,
                c.tls_ciphertext_len,
                blob.len()
            )));
        }
        Ok(Some(RawFrame {
            msg,
            blob,
            fd_count,
        }))
    }
}

/// Framed messages with descriptors over the handoff socket.
#[derive(Debug)]
pub struct Channel {
    tx: Sender,
    rx: Receiver,
}

impl Channel {
    pub fn new(stream: tokio::net::UnixStream) -> Self {
        let stream = Arc::new(FdStream::new(stream));
        Self {
            tx: Sender {
                stream: stream.clone(),
            },
            rx: Receiver {
                stream,
                decoder: Decoder::default(),
                fds: VecDeque::new(),
                read_buf: vec![0u8; 64 * 1024].into_boxed_slice(),
            },
        }
    }

    pub async fn send(
        &self,
        msg: &Message,
        blob: &[u8],
        fds: &[RawFd],
    ) -> Result<(), ProtocolError> {
        self.tx.send(msg, blob, fds).await
    }

    pub async fn recv(&mut self) -> Result<Frame, ProtocolError> {
        self.rx.recv().await
    }

    /// Separate halves, so one task can read while another writes (each
    /// side of a handoff reads acknowledgements while it sends).
    pub fn split(self) -> (Sender, Receiver) {
        (self.tx, self.rx)
    }
}

/// Sending half of a [`Channel`]; cheap to clone.
#[derive(Debug, Clone)]
pub struct Sender {
    stream: Arc<FdStream>,
}

impl Sender {
    pub async fn send(
        &self,
        msg: &Message,
        blob: &[u8],
        fds: &[RawFd],
    ) -> Result<(), ProtocolError> {
        let bytes = encode(msg, blob, fds.len())?;
        self.stream.send(&bytes, fds).await?;
        tracing::trace!(
            frame = msg.kind(),
            bytes = bytes.len(),
            fds = fds.len(),
            "handoff frame sent"
        );
        Ok(())
    }

    /// Sends the frames of `batch` in order, in one write when the socket
    /// takes it; an empty batch sends nothing.
    pub async fn send_batch(&self, batch: &Batch) -> Result<(), ProtocolError> {
        if batch.is_empty() {
            return Ok(());
        }
        if batch.fds.len() > MAX_FDS_PER_FRAME {
            return Err(ProtocolError::TooManyFds(batch.fds.len()));
        }
        self.stream.send(&batch.bytes, &batch.fds).await?;
        tracing::trace!(
            frames = batch.frames,
            bytes = batch.bytes.len(),
            fds = batch.fds.len(),
            "handoff frames sent"
        );
        Ok(())
    }

    /// Shuts the socket down both ways. After this returns the peer can no
    /// longer send (its writes fail with EPIPE), while frames it sent before
    /// stay readable: the old process relies on that to know exactly which
    /// acknowledgements arrived before it gave up on a handoff.
    pub fn shutdown(&self) {
        use std::os::fd::AsRawFd;
        let _ = nix::sys::socket::shutdown(
            self.stream.get_ref().as_raw_fd(),
            nix::sys::socket::Shutdown::Both,
        );
    }
}

/// Receiving half of a [`Channel`].
#[derive(Debug)]
pub struct Receiver {
    stream: Arc<FdStream>,
    decoder: Decoder,
    fds: VecDeque<OwnedFd>,
    read_buf: Box<[u8]>,
}

impl Receiver {
    /// Receives the next frame. [`ProtocolError::Closed`] on a clean EOF
    /// between frames, [`ProtocolError::Truncated`] in the middle of one.
    pub async fn recv(&mut self) -> Result<Frame, ProtocolError> {
        loop {
            if let Some(frame) = self.try_recv()? {
                return Ok(frame);
            }
            let n = self.stream.recv(&mut self.read_buf, &mut self.fds).await?;
            tracing::trace!(bytes = n, fds = self.fds.len(), "handoff socket read");
            if n == 0 {
                return Err(if self.decoder.buffered() == 0 {
                    ProtocolError::Closed
                } else {
                    ProtocolError::Truncated
                });
            }
            self.decoder.feed(&self.read_buf[..n]);
        }
    }

    /// The next frame if a read already brought all of it, without touching
    /// the socket (one read often brings several frames).
    pub fn try_recv(&mut self) -> Result<Option<Frame>, ProtocolError> {
        let Some(raw) = self.decoder.next_frame()? else {
            return Ok(None);
        };
        // The frame's descriptors rode on its first bytes (or earlier
        // ones, in a batch), which we have read, so they are all queued.
        if self.fds.len() < raw.fd_count {
            return Err(ProtocolError::MissingFds {
                expected: raw.fd_count,
                got: self.fds.len(),
            });
        }
        let fds = self.fds.drain(..raw.fd_count).collect();
        tracing::trace!(
            frame = raw.msg.kind(),
            fds = raw.fd_count,
            "handoff frame received"
        );
        Ok(Some(Frame {
            msg: raw.msg,
            blob: raw.blob,
            fds,
        }))
    }
}

/// Several frames written with one `sendmsg` (fewer system calls and
/// wake-ups on both sides when many connections move). On the wire it is
/// exactly the frames one after the other, so any peer reads it; the
/// descriptors of all of them ride on the first bytes, i.e. never after the
/// frame they belong to, which is all a receiver needs.
#[derive(Debug, Default)]
pub struct Batch {
    bytes: Vec<u8>,
    fds: Vec<RawFd>,
    frames: usize,
}

impl Batch {
    /// Appends one frame. The descriptors must stay open until the batch is
    /// sent.
    pub fn push(&mut self, msg: &Message, blob: &[u8], fds: &[RawFd]) -> Result<(), ProtocolError> {
        self.bytes.extend_from_slice(&encode(msg, blob, fds.len())?);
        self.fds.extend_from_slice(fds);
        self.frames += 1;
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.frames
    }

    pub fn is_empty(&self) -> bool {
        self.frames == 0
    }

    /// Empties the batch, keeping its buffers for the next one.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.fds.clear();
        self.frames = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(msg: Message, blob: &[u8]) -> RawFrame {
        let bytes = encode(&msg, blob, 0).unwrap();
        let mut d = Decoder::default();
        // Byte at a time: the decoder must cope with any split.
        for b in &bytes[..bytes.len() - 1] {
            d.feed(&[*b]);
            assert!(d.next_frame().unwrap().is_none());
        }
        d.feed(&bytes[bytes.len() - 1..]);
        let f = d.next_frame().unwrap().unwrap();
        assert_eq!(f.msg, msg);
        assert_eq!(d.buffered(), 0);
        f
    }

    #[test]
    fn every_message_survives_a_byte_at_a_time_roundtrip() {
        let msgs = vec![
            Message::Hello {
                versions: VersionRange { min: 1, max: 2 },
                sidecar_version: "0.1.0".into(),
            },
            Message::Welcome {
                protocol_version: 1,
                sidecar_version: "0.1.0".into(),
            },
            Message::Refuse {
                reason: "no".into(),
            },
            Message::Listeners {
                listeners: vec![ListenerInfo {
                    name: "outbound".into(),
                    addr: "127.0.0.1:15001".into(),
                }],
            },
            Message::Accepting,
            Message::State(StateSnapshot {
                config: serde_json::json!({"version": 3}),
                cert_chain_pem: Some("CERT".into()),
                private_key_pem: Some("KEY".into()),
                trust_bundle_pem: Some("BUNDLE".into()),
                counters: [("requests_total".to_string(), 42u64)].into(),
            }),
            Message::Ack { id: 9 },
            Message::Nack {
                id: 9,
                reason: "x".into(),
            },
            Message::Done {
                connections: 3,
                counters: [("x_total".to_string(), 1u64)].into(),
            },
            Message::Complete,
        ];
        for m in msgs {
            roundtrip(m, b"");
        }
    }

    #[test]
    fn a_connection_frame_carries_its_buffered_bytes_in_the_blob() {
        let msg = Message::Connection(ConnectionHeader {
            id: 7,
            kind: ConnKind::Tcp,
            to_upstream_len: 3,
            to_downstream_len: 2,
            tls_ciphertext_len: 0,
            up_tls: None,
            up_tls_ciphertext_len: 0,
            tls: Some(TlsWireState {
                version: 0x0304,
                aead: "aes_128_gcm".into(),
                tx: DirectionSecrets {
                    seq: 5,
                    key: vec![1; 16],
                    iv: vec![2; 12],
                    traffic_secret: Some(vec![3; 32]),
                },
                rx: DirectionSecrets {
                    seq: 6,
                    key: vec![4; 16],
                    iv: vec![5; 12],
                    traffic_secret: None,
                },
                server: true,
            }),
            meta: serde_json::json!({"listener": "outbound"}),
            parked_at_ns: 123_456_789,
        });
        let f = roundtrip(msg, b"abcde");
        assert_eq!(f.blob, b"abcde");
    }

    #[test]
    fn a_connection_whose_lengths_disagree_with_its_blob_is_malformed() {
        let msg = Message::Connection(ConnectionHeader {
            id: 1,
            kind: ConnKind::Http1,
            to_upstream_len: 10,
            to_downstream_len: 0,
            tls_ciphertext_len: 0,
            up_tls: None,
            up_tls_ciphertext_len: 0,
            tls: None,
            meta: serde_json::Value::Null,
            parked_at_ns: 0,
        });
        let mut d = Decoder::default();
        d.feed(&encode(&msg, b"short", 0).unwrap());
        assert!(matches!(d.next_frame(), Err(ProtocolError::Malformed(_))));
    }

    #[test]
    fn hostile_lengths_are_refused_before_anything_is_allocated() {
        let mut d = Decoder::default();
        d.feed(&u32::MAX.to_be_bytes());
        d.feed(&0u32.to_be_bytes());
        d.feed(&0u16.to_be_bytes());
        assert!(matches!(
            d.next_frame(),
            Err(ProtocolError::HeaderTooLarge(_))
        ));

        let mut d = Decoder::default();
        d.feed(&2u32.to_be_bytes());
        d.feed(&u32::MAX.to_be_bytes());
        d.feed(&0u16.to_be_bytes());
        assert!(matches!(
            d.next_frame(),
            Err(ProtocolError::BlobTooLarge(_))
        ));

        let mut d = Decoder::default();
        d.feed(&2u32.to_be_bytes());
        d.feed(&0u32.to_be_bytes());
        d.feed(&u16::MAX.to_be_bytes());
        assert!(matches!(d.next_frame(), Err(ProtocolError::TooManyFds(_))));
    }

    #[test]
    fn garbage_json_and_unknown_message_types_are_malformed() {
        for header in [
            &b"{not json"[..],
            br#"{"type":"teleport"}"#,
            br#"{"type":"ack"}"#,
        ] {
            let mut bytes = Vec::new();
            bytes.extend_from_slice(&(header.len() as u32).to_be_bytes());
            bytes.extend_from_slice(&0u32.to_be_bytes());
            bytes.extend_from_slice(&0u16.to_be_bytes());
            bytes.extend_from_slice(header);
            let mut d = Decoder::default();
            d.feed(&bytes);
            assert!(
                matches!(d.next_frame(), Err(ProtocolError::Malformed(_))),
                "{}",
                String::from_utf8_lossy(header)
            );
        }
    }

    #[test]
    fn unknown_fields_from_a_newer_peer_are_ignored() {
        let header = br#"{"type":"ack","id":4,"added_in_v2":{"x":1}}"#;
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&(header.len() as u32).to_be_bytes());
        bytes.extend_from_slice(&0u32.to_be_bytes());
        bytes.extend_from_slice(&0u16.to_be_bytes());
        bytes.extend_from_slice(header);
        let mut d = Decoder::default();
        d.feed(&bytes);
        assert_eq!(d.next_frame().unwrap().unwrap().msg, Message::Ack { id: 4 });
    }

    #[test]
    fn two_frames_in_one_read_decode_in_order() {
        let mut d = Decoder::default();
        d.feed(&encode(&Message::Ack { id: 1 }, b"", 0).unwrap());
        d.feed(&encode(&Message::Ack { id: 2 }, b"", 1).unwrap());
        assert_eq!(d.next_frame().unwrap().unwrap().msg, Message::Ack { id: 1 });
        let f = d.next_frame().unwrap().unwrap();
        assert_eq!((f.msg, f.fd_count), (Message::Ack { id: 2 }, 1));
        assert!(d.next_frame().unwrap().is_none());
    }

    #[test]
    fn adjacent_versions_negotiate_both_ways_and_distant_ones_refuse() {
        let v1 = VersionRange { min: 1, max: 1 };
        let v2 = VersionRange { min: 1, max: 2 };
        let v3 = VersionRange { min: 2, max: 3 };
        let v4 = VersionRange { min: 3, max: 4 };
        assert_eq!(negotiate(v1, v2), Ok(1));
        assert_eq!(negotiate(v2, v1), Ok(1));
        assert_eq!(negotiate(v2, v3), Ok(2));
        assert_eq!(negotiate(v3, v2), Ok(2));
        assert!(negotiate(v1, v3).is_err());
        assert!(negotiate(v2, v4).unwrap_err().contains("incompatible"));
        assert!(negotiate(v2, VersionRange { min: 5, max: 4 }).is_err());
        let this = VersionRange::this_build();
        assert_eq!(negotiate(this, this), Ok(this.max));
    }

    #[test]
    fn key_material_never_appears_in_debug_output() {
        let s = DirectionSecrets {
            seq: 1,
            key: vec![0xAB; 16],
            iv: vec![0xCD; 12],
            traffic_secret: None,
        };
        let dbg = format!("{s:?}");
        assert!(!dbg.contains("171") && !dbg.contains("AB"), "{dbg}");
    }

    #[tokio::test]
    async fn a_batch_is_the_frames_back_to_back_and_each_keeps_its_descriptors() {
        use std::os::fd::AsRawFd;
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (tx, _) = Channel::new(a).split();
        let (_, mut rx) = Channel::new(b).split();
        let (r1, w1) = nix::unistd::pipe().unwrap();
        let (r3, w3) = nix::unistd::pipe().unwrap();
        let mut batch = Batch::default();
        batch
            .push(
                &Message::Ack { id: 1 },
                b"",
                &[w1.as_raw_fd(), w1.as_raw_fd()],
            )
            .unwrap();
        batch.push(&Message::Ack { id: 2 }, b"xyz", &[]).unwrap();
        batch
            .push(&Message::Ack { id: 3 }, b"", &[w3.as_raw_fd()])
            .unwrap();
        // On the wire exactly what three separate sends would write, so a
        // peer that does not batch reads it unchanged.
        let separate = [
            encode(&Message::Ack { id: 1 }, b"", 2).unwrap(),
            encode(&Message::Ack { id: 2 }, b"xyz", 0).unwrap(),
            encode(&Message::Ack { id: 3 }, b"", 1).unwrap(),
        ]
        .concat();
        assert_eq!(batch.bytes, separate);
        assert_eq!(batch.len(), 3);
        tx.send_batch(&batch).await.unwrap();

        let f1 = rx.recv().await.unwrap();
        assert_eq!((f1.msg, f1.fds.len()), (Message::Ack { id: 1 }, 2));
        // The rest came with the same read: no socket wait.
        let f2 = rx.try_recv().unwrap().unwrap();
        assert_eq!(
            (f2.msg, f2.blob, f2.fds.len()),
            (Message::Ack { id: 2 }, b"xyz".to_vec(), 0)
        );
        let f3 = rx.try_recv().unwrap().unwrap();
        assert_eq!((f3.msg, f3.fds.len()), (Message::Ack { id: 3 }, 1));
        assert!(rx.try_recv().unwrap().is_none());
        // Each frame got its own descriptors: write through them, read back.
        for (fd, r, tag) in [(&f1.fds[1], &r1, b'1'), (&f3.fds[0], &r3, b'3')] {
            nix::unistd::write(fd, &[tag]).unwrap();
            let mut back = [0u8; 1];
            nix::unistd::read(r, &mut back).unwrap();
            assert_eq!(back[0], tag);
        }

        batch.clear();
        assert!(batch.is_empty());
        tx.send_batch(&batch).await.unwrap();
        drop(tx);
        assert!(matches!(rx.recv().await, Err(ProtocolError::Closed)));
    }

    #[tokio::test]
    async fn channel_delivers_frames_with_their_descriptors() {
        use std::os::fd::AsRawFd;
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let a = Channel::new(a);
        let mut b = Channel::new(b);
        let (r, w) = nix::unistd::pipe().unwrap();
        a.send(&Message::Ack { id: 1 }, b"", &[]).await.unwrap();
        a.send(
            &Message::Listeners { listeners: vec![] },
            b"xy",
            &[r.as_raw_fd(), w.as_raw_fd()],
        )
        .await
        .unwrap();
        let f1 = b.recv().await.unwrap();
        assert_eq!((f1.msg, f1.fds.len()), (Message::Ack { id: 1 }, 0));
        let f2 = b.recv().await.unwrap();
        assert_eq!((f2.blob.as_slice(), f2.fds.len()), (&b"xy"[..], 2));
        drop(a);
        assert!(matches!(b.recv().await, Err(ProtocolError::Closed)));
    }
}
