//! The config stream's framed transport: the push protocol straight on TLS,
//! chosen by ALPN ([`ALPN`]), without HTTP/2 under it (decision 0066).
//!
//! Why: an operator replica holds one connection per sidecar. Over HTTP/2
//! each costs ~42 KiB while idle, 28 KiB of it the `h2` crate's fixed
//! per-connection buffers (16 KiB to write, 8 KiB to read, 4 KiB of HPACK
//! decoding) that no setting shrinks; 10,000 sidecars put two replicas far
//! past their memory limit. Here a connection holds rustls' record buffer,
//! one small read buffer and the stream's state, and frames that share a
//! config across streams are written by reference.
//!
//! A sidecar offers `baton-push/1` and `h2`; an operator that knows this
//! transport selects it, an older one selects `h2` and the sidecar speaks
//! the HTTP/2 protocol of [`crate::push`] as before. An older sidecar offers
//! only `h2`, which the operator still serves. So either side can be
//! upgraded first.
//!
//! A frame is a 4-byte big-endian length, one kind byte and the payload
//! (the length counts the kind byte). In order:
//!
//! ```text
//! sidecar  ── HELLO {token, pod, version, capabilities} ──►  operator
//!          ◄── OPEN | REFUSED {status, reason, message} ──
//!          ◄── PUSH (a push::Push)      ── REPLY (a push::Reply) ──►
//!          ── SIGN id, token, request ──►  ◄── SIGNED id, status, body
//!          ◄── PING                     ── PONG ──►
//! ```
//!
//! SIGN carries a certificate request on the held connection (decision
//! 0056's saving, kept): the identity service's request body and the
//! caller's token, answered by SIGNED with the same id. PING is sent by the
//! operator every [`PING_INTERVAL`]; a sidecar that has answered nothing by
//! the next one is gone, and a sidecar that has heard nothing for
//! [`SILENCE_LIMIT`] reconnects. A kind a side does not know is skipped
//! after the handshake (a newer peer may send more), refused before it.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use crate::push::{Capabilities, MAX_FRAME, SharedPush};

/// The ALPN protocol id of this transport.
pub const ALPN: &[u8] = b"baton-push/1";

/// Largest frame the operator reads before the stream is authenticated: a
/// HELLO is a token and a few fields, and an unauthenticated peer must not
/// make a replica buffer [`MAX_FRAME`].
pub const MAX_HELLO: usize = 64 << 10;

/// How often the operator pings an idle stream.
pub const PING_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a sidecar waits without a frame before it reconnects: two
/// pings and some slack.
pub const SILENCE_LIMIT: std::time::Duration = std::time::Duration::from_secs(75);

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Sidecar → operator, first: [`Hello`] as JSON.
    Hello = 1,
    /// Sidecar → operator: a [`crate::push::Reply`] as JSON.
    Reply = 2,
    /// Sidecar → operator: a certificate request ([`Sign`]).
    Sign = 3,
    /// Sidecar → operator: the answer to a [`Kind::Ping`] (empty).
    Pong = 4,
    /// Operator → sidecar: the stream is open (empty).
    Open = 16,
    /// Operator → sidecar, last: [`Refused`] as JSON.
    Refused = 17,
    /// Operator → sidecar: a [`crate::push::Push`] as JSON.
    Push = 18,
    /// Operator → sidecar: the answer to a [`Kind::Sign`] ([`Signed`]).
    Signed = 19,
    /// Operator → sidecar: are you there (empty).
    Ping = 20,
}

impl Kind {
    fn from_byte(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Reply,
            3 => Kind::Sign,
            4 => Kind::Pong,
            16 => Kind::Open,
            17 => Kind::Refused,
            18 => Kind::Push,
            19 => Kind::Signed,
            20 => Kind::Ping,
            _ => return None,
        })
    }
}

/// What the HTTP/2 protocol carries in its request headers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The projected ServiceAccount token (what `Authorization: Bearer`
    /// carries over HTTP/2).
    pub token: String,
    /// `namespace/name` of the Pod the sidecar speaks for.
    pub pod: String,
    /// The version the sidecar serves (0: none yet).
    pub version: u64,
    /// [`Capabilities::header_value`]'s tokens.
    pub capabilities: String,
}

impl Hello {
    pub fn capabilities(&self) -> Capabilities {
        Capabilities::parse(&self.capabilities)
    }
}

/// Why the operator did not open the stream: what the HTTP/2 protocol puts
/// in a refusal's status and JSON body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    pub status: u16,
    pub reason: String,
    pub message: String,
}

/// A certificate request on the held connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sign {
    /// Chosen by the sidecar; the answer carries it back.
    pub id: u32,
    /// The token the identity service reviews (may be newer than HELLO's).
    pub token: String,
    /// The identity service's request body (JSON).
    pub request: Bytes,
}

/// The identity service's answer to one [`Sign`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signed {
    pub id: u32,
    /// The HTTP status the identity endpoint would have answered.
    pub status: u16,
    pub body: Bytes,
}

/// One decoded frame. `Unknown` carries a kind this build does not know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Known(Kind, Bytes),
    Unknown(u8),
}

#[derive(Debug, thiserror::Error)]
pub enum FramedError {
    #[error("frame of {len} bytes is larger than the {limit}-byte limit")]
    TooLarge { len: usize, limit: usize },
    #[error("frame has no kind byte")]
    Empty,
    #[error("{what} frame is malformed: {why}")]
    Malformed { what: &'static str, why: String },
}

fn malformed(what: &'static str, why: impl std::fmt::Display) -> FramedError {
    FramedError::Malformed {
        what,
        why: why.to_string(),
    }
}

/// The head of a frame of `kind` whose payload is `payload_len` bytes.
fn head(kind: Kind, payload_len: usize) -> [u8; 5] {
    let len = u32::try_from(payload_len + 1).unwrap_or(u32::MAX);
    let mut out = [0; 5];
    out[..4].copy_from_slice(&len.to_be_bytes());
    out[4] = kind as u8;
    out
}

/// A frame of `kind` around `payload`.
pub fn encode(kind: Kind, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.extend_from_slice(&head(kind, payload.len()));
    out.extend_from_slice(payload);
    out
}

/// A frame of `kind` around `msg`'s JSON.
pub fn encode_json<T: Serialize>(kind: Kind, msg: &T) -> Vec<u8> {
    encode(
        kind,
        &serde_json::to_vec(msg).expect("protocol messages serialize"),
    )
}

/// A PUSH frame in pieces: the head, then [`SharedPush::frame_parts`]'s
/// JSON pieces, the config's bytes shared and not copied.
pub fn push_parts(push: &SharedPush) -> [Bytes; 3] {
    let [first, json, last] = push.frame_parts();
    // `frame_parts` opens with the HTTP/2 protocol's 4-byte length; this
    // frame's length counts the kind byte as well.
    let body_len = first.len() - 4 + json.len() + last.len();
    let mut head_and_first = BytesMut::with_capacity(5 + first.len() - 4);
    head_and_first.put_slice(&head(Kind::Push, body_len));
    head_and_first.put_slice(&first[4..]);
    [head_and_first.freeze(), json, last]
}

impl Sign {
    pub fn encode(&self) -> Vec<u8> {
        let token = self.token.as_bytes();
        let token_len = u16::try_from(token.len()).unwrap_or(u16::MAX);
        let mut payload = Vec::with_capacity(6 + token.len() + self.request.len());
        payload.put_u32(self.id);
        payload.put_u16(token_len);
        payload.extend_from_slice(&token[..usize::from(token_len)]);
        payload.extend_from_slice(&self.request);
        encode(Kind::Sign, &payload)
    }

    pub fn decode(mut payload: Bytes) -> Result<Sign, FramedError> {
        if payload.len() < 6 {
            return Err(malformed("SIGN", "shorter than its id and token length"));
        }
        let id = payload.get_u32();
        let token_len = usize::from(payload.get_u16());
        if payload.len() < token_len {
            return Err(malformed("SIGN", "shorter than its token"));
        }
        let token = String::from_utf8(payload.split_to(token_len).to_vec())
            .map_err(|e| malformed("SIGN", e))?;
        Ok(Sign {
            id,
            token,
            request: payload,
        })
    }
}

impl Signed {
    pub fn encode(&self) -> Vec<u8> {
        let mut payload = Vec::with_capacity(6 + self.body.len());
        payload.put_u32(self.id);
        payload.put_u16(self.status);
        payload.extend_from_slice(&self.body);
        encode(Kind::Signed, &payload)
    }

    pub fn decode(mut payload: Bytes) -> Result<Signed, FramedError> {
        if payload.len() < 6 {
            return Err(malformed("SIGNED", "shorter than its id and status"));
        }
        Ok(Signed {
            id: payload.get_u32(),
            status: payload.get_u16(),
            body: payload,
        })
    }
}

/// Parses a JSON payload of a frame named `what`.
pub fn json<T: serde::de::DeserializeOwned>(
    what: &'static str,
    payload: &[u8],
) -> Result<T, FramedError> {
    serde_json::from_slice(payload).map_err(|e| malformed(what, e))
}

/// Reassembles frames from reads of any size. Holds no memory while idle:
/// a replica keeps one per sidecar, and an empty buffer is released.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: BytesMut,
    limit: usize,
}

impl FrameDecoder {
    /// Frames larger than `limit` are an error.
    pub fn new(limit: usize) -> FrameDecoder {
        FrameDecoder {
            buf: BytesMut::new(),
            limit: limit.min(MAX_FRAME),
        }
    }

    /// Raises (or lowers) the largest frame accepted from now on.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit.min(MAX_FRAME);
    }

    pub fn extend(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete frame, `Ok(None)` until one has arrived. An error
    /// poisons the stream: the caller closes it.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FramedError> {
        let Some(head) = self.buf.first_chunk::<4>() else {
            self.release_if_empty();
            return Ok(None);
        };
        let len = u32::from_be_bytes(*head) as usize;
        if len > self.limit {
            return Err(FramedError::TooLarge {
                len,
                limit: self.limit,
            });
        }
        if len == 0 {
            return Err(FramedError::Empty);
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let mut frame = self.buf.split_to(4 + len);
        frame.advance(4);
        let kind = frame.get_u8();
        self.release_if_empty();
        Ok(Some(match Kind::from_byte(kind) {
            Some(kind) => Frame::Known(kind, frame.freeze()),
            None => Frame::Unknown(kind),
        }))
    }

    fn release_if_empty(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > 0 {
            self.buf = BytesMut::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::push::{ConfigKind, Push, Reply};

    fn decode_all(bytes: &[u8], chunk: usize) -> Vec<Frame> {
        let mut decoder = FrameDecoder::new(MAX_FRAME);
        let mut out = Vec::new();
        for piece in bytes.chunks(chunk) {
            decoder.extend(piece);
            while let Some(frame) = decoder.next_frame().unwrap() {
                out.push(frame);
            }
        }
        out
    }

    #[test]
    fn frames_survive_any_split_of_the_bytes() {
        let hello = Hello {
            token: "t0k".into(),
            pod: "ns/web-0".into(),
            version: 7,
            capabilities: Capabilities::ALL.header_value(),
        };
        let reply = Reply::Ack {
            nonce: "n1".into(),
            version: 8,
        };
        let mut wire = encode_json(Kind::Hello, &hello);
        wire.extend(encode_json(Kind::Reply, &reply));
        wire.extend(encode(Kind::Pong, &[]));
        for chunk in [1, 2, 3, 5, 64, wire.len()] {
            let frames = decode_all(&wire, chunk);
            assert_eq!(frames.len(), 3, "chunks of {chunk}");
            let Frame::Known(Kind::Hello, p) = &frames[0] else {
                panic!("{:?}", frames[0])
            };
            assert_eq!(json::<Hello>("HELLO", p).unwrap(), hello);
            assert_eq!(hello.capabilities(), Capabilities::ALL);
            let Frame::Known(Kind::Reply, p) = &frames[1] else {
                panic!("{:?}", frames[1])
            };
            assert_eq!(json::<Reply>("REPLY", p).unwrap(), reply);
            assert_eq!(frames[2], Frame::Known(Kind::Pong, Bytes::new()));
        }
    }

    #[test]
    fn a_push_in_shared_pieces_decodes_as_the_push() {
        let snapshot = crate::Snapshot::default();
        for kind in [ConfigKind::Snapshot, ConfigKind::Delta { base: 3 }] {
            let config = match kind {
                ConfigKind::Snapshot => SharedPush::snapshot_json(&snapshot),
                ConfigKind::Delta { .. } => {
                    SharedPush::delta_json(&crate::push::Delta::between(&snapshot, &snapshot))
                }
            };
            let shared = SharedPush {
                version: 4,
                nonce: "n\"4".into(),
                kind,
                json: config,
            };
            let parts = push_parts(&shared);
            // The config's bytes are the shared buffer, not a copy.
            assert_eq!(parts[1].as_ptr(), shared.json.as_ptr());
            let frames = decode_all(&parts.concat(), 7);
            let [Frame::Known(Kind::Push, p)] = frames.as_slice() else {
                panic!("{frames:?}")
            };
            let push: Push = json::<Push>("PUSH", p).unwrap();
            assert_eq!((push.version, push.nonce.as_str()), (4, "n\"4"));
        }
    }

    #[test]
    fn sign_and_signed_round_trip_and_short_payloads_are_refused() {
        let sign = Sign {
            id: 9,
            token: "tok".into(),
            request: Bytes::from_static(b"{\"csr\":\"x\"}"),
        };
        let frames = decode_all(&sign.encode(), 4);
        let [Frame::Known(Kind::Sign, p)] = frames.as_slice() else {
            panic!("{frames:?}")
        };
        assert_eq!(Sign::decode(p.clone()).unwrap(), sign);
        let signed = Signed {
            id: 9,
            status: 503,
            body: Bytes::from_static(b"{}"),
        };
        let frames = decode_all(&signed.encode(), 4);
        let [Frame::Known(Kind::Signed, p)] = frames.as_slice() else {
            panic!("{frames:?}")
        };
        assert_eq!(Signed::decode(p.clone()).unwrap(), signed);

        for short in [&b""[..], b"\0\0\0\x01", b"\0\0\0\x01\0\x09tok"] {
            assert!(Sign::decode(Bytes::copy_from_slice(short)).is_err());
        }
        assert!(Signed::decode(Bytes::from_static(b"\0\0\0\x01\0")).is_err());
        assert!(Sign::decode(Bytes::from_static(b"\0\0\0\x01\0\x02\xff\xfe")).is_err());
    }

    #[test]
    fn oversized_empty_and_unknown_frames_are_told_apart() {
        let mut decoder = FrameDecoder::new(MAX_HELLO);
        decoder.extend(&u32::try_from(MAX_HELLO + 1).unwrap().to_be_bytes());
        assert!(matches!(
            decoder.next_frame(),
            Err(FramedError::TooLarge {
                limit: MAX_HELLO,
                ..
            })
        ));
        let mut decoder = FrameDecoder::new(MAX_HELLO);
        decoder.extend(&[0, 0, 0, 0]);
        assert!(matches!(decoder.next_frame(), Err(FramedError::Empty)));
        let mut decoder = FrameDecoder::new(MAX_HELLO);
        decoder.extend(&[0, 0, 0, 2, 99, 0]);
        decoder.extend(&encode(Kind::Ping, &[]));
        assert_eq!(decoder.next_frame().unwrap(), Some(Frame::Unknown(99)));
        assert_eq!(
            decoder.next_frame().unwrap(),
            Some(Frame::Known(Kind::Ping, Bytes::new()))
        );
        // Raised after authentication: a snapshot-sized frame fits.
        decoder.set_limit(MAX_FRAME);
        decoder.extend(&encode(Kind::Push, &vec![b' '; MAX_HELLO * 2]));
        assert!(matches!(
            decoder.next_frame().unwrap(),
            Some(Frame::Known(Kind::Push, p)) if p.len() == MAX_HELLO * 2
        ));
    }

    #[test]
    fn an_idle_decoder_holds_no_buffer() {
        let mut decoder = FrameDecoder::new(MAX_FRAME);
        decoder.extend(&encode(Kind::Push, &vec![b' '; 100_000]));
        let frame = decoder.next_frame().unwrap();
        assert!(frame.is_some());
        assert_eq!(decoder.buf.capacity(), 0);
        decoder.extend(&encode(Kind::Pong, &[])[..3]);
        assert_eq!(decoder.next_frame().unwrap(), None);
        assert!(decoder.buf.capacity() > 0, "a partial frame is kept");
    }
}
