//! The config push protocol's wire format, shared by the operator (server)
//! and the sidecar (client).
//!
//! One HTTP/2 stream per sidecar: `POST` [`WATCH_PATH`] over TLS with the
//! sidecar's projected ServiceAccount token as a bearer token, the Pod it
//! speaks for in [`POD_HEADER`] and the version it already serves in
//! [`VERSION_HEADER`]. The response body carries [`Push`] frames, the
//! request body [`Reply`] frames. A frame is a 4-byte big-endian length and
//! that many bytes of JSON. Semantics follow Envoy's xDS: every push has a
//! version and a nonce; the sidecar answers each with an ACK (applied) or a
//! NACK (refused, with the error — it keeps serving its last good config).
//!
//! Why length-prefixed JSON over plain HTTP/2 rather than gRPC: the
//! snapshot is already serde data with one JSON form (`/config`, the
//! handoff); a protobuf schema would be a second definition to keep in step,
//! and tonic a second HTTP/2 stack beside hyper in both binaries.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::Snapshot;

/// Path of the watch stream.
pub const WATCH_PATH: &str = "/v1/config/watch";
/// `namespace/name` of the Pod the sidecar speaks for; must be the Pod its
/// token is bound to.
pub const POD_HEADER: &str = "x-baton-pod";
/// Version the sidecar serves when it (re)connects (0: none yet). A process
/// that took over through a handoff resumes at the inherited version.
pub const VERSION_HEADER: &str = "x-baton-version";
/// Largest frame either side accepts.
pub const MAX_FRAME: usize = 16 << 20;

/// A snapshot sent to one sidecar.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Push {
    pub version: u64,
    /// Names this push in the reply (a version may be re-sent).
    pub nonce: String,
    pub snapshot: Snapshot,
}

/// A push whose snapshot is already JSON (`snapshot_json`, the
/// serialization of one [`Snapshot`]). The operator serializes a snapshot
/// once and sends it to every sidecar it compiles to; on the wire it is a
/// [`Push`] ([`encode_shared`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPush {
    pub version: u64,
    pub nonce: String,
    pub snapshot_json: std::sync::Arc<[u8]>,
}

impl SharedPush {
    /// Serializes `snapshot` for sharing between pushes.
    pub fn snapshot_json(snapshot: &Snapshot) -> std::sync::Arc<[u8]> {
        serde_json::to_vec(snapshot)
            .expect("snapshots serialize")
            .into()
    }
}

/// One [`SharedPush`] as a frame that decodes as a [`Push`]: the fields in
/// [`Push`]'s order around the pre-serialized snapshot, so a push costs a
/// copy of the snapshot's JSON, not a serialization.
pub fn encode_shared(push: &SharedPush) -> Vec<u8> {
    let nonce = serde_json::to_string(&push.nonce).expect("strings serialize");
    let head = format!(
        "{{\"version\":{},\"nonce\":{nonce},\"snapshot\":",
        push.version
    );
    let len = head.len() + push.snapshot_json.len() + 1;
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(&push.snapshot_json);
    out.push(b'}');
    out
}

/// The sidecar's answer to one push.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Reply {
    /// Applied: the sidecar now serves `version`.
    Ack { nonce: String, version: u64 },
    /// Refused; the sidecar keeps its last good config.
    Nack { nonce: String, error: String },
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {0} bytes is larger than the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    #[error("frame is not valid: {0}")]
    Json(#[from] serde_json::Error),
}

/// One message as a frame.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let json = serde_json::to_vec(msg).expect("push messages serialize");
    let mut out = Vec::with_capacity(4 + json.len());
    out.extend_from_slice(&u32::try_from(json.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&json);
    out
}

/// Reassembles frames from body chunks of any size.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: Vec<u8>,
}

impl Decoder {
    pub fn extend(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete message, `Ok(None)` until one has arrived. An
    /// error poisons the stream: the caller closes it.
    pub fn next_message<T: DeserializeOwned>(&mut self) -> Result<Option<T>, FrameError> {
        let Some(head) = self.buf.first_chunk::<4>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(*head) as usize;
        if len > MAX_FRAME {
            return Err(FrameError::TooLarge(len));
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let msg = serde_json::from_slice(&self.buf[4..4 + len]);
        self.buf.drain(..4 + len);
        Ok(Some(msg?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_survive_any_chunking() {
        let push = Push {
            version: 7,
            nonce: "n7".into(),
            snapshot: crate::pod_default(),
        };
        let ack = Reply::Ack {
            nonce: "n7".into(),
            version: 7,
        };
        let mut wire = encode(&push);
        wire.extend(encode(&ack));
        for chunk in [1, 3, 4, 5, 64, wire.len()] {
            let mut d = Decoder::default();
            let mut got_push = None;
            let mut got_reply = None;
            for piece in wire.chunks(chunk) {
                d.extend(piece);
                if got_push.is_none() {
                    got_push = d.next_message::<Push>().unwrap();
                }
                if got_push.is_some() && got_reply.is_none() {
                    got_reply = d.next_message::<Reply>().unwrap();
                }
            }
            assert_eq!(got_push.as_ref(), Some(&push), "chunk {chunk}");
            assert_eq!(got_reply.as_ref(), Some(&ack), "chunk {chunk}");
        }
    }

    #[test]
    fn a_shared_push_decodes_as_the_push_it_stands_for() {
        let snapshot = crate::pod_default();
        let shared = SharedPush {
            version: 42,
            // A nonce that needs escaping still round-trips.
            nonce: "n\"42\\".into(),
            snapshot_json: SharedPush::snapshot_json(&snapshot),
        };
        let mut d = Decoder::default();
        d.extend(&encode_shared(&shared));
        let got: Push = d.next_message().unwrap().unwrap();
        assert_eq!(
            got,
            Push {
                version: 42,
                nonce: shared.nonce.clone(),
                snapshot,
            }
        );
        assert_eq!(
            encode_shared(&shared),
            encode(&got),
            "byte for byte what serializing the Push gives"
        );
    }

    #[test]
    fn oversized_and_malformed_frames_are_errors() {
        let mut d = Decoder::default();
        d.extend(&(MAX_FRAME as u32 + 1).to_be_bytes());
        assert!(matches!(
            d.next_message::<Reply>(),
            Err(FrameError::TooLarge(_))
        ));
        let mut d = Decoder::default();
        d.extend(&3u32.to_be_bytes());
        d.extend(b"{x}");
        assert!(matches!(
            d.next_message::<Reply>(),
            Err(FrameError::Json(_))
        ));
    }

    #[test]
    fn replies_are_tagged_json() {
        let nack = Reply::Nack {
            nonce: "a".into(),
            error: "bad".into(),
        };
        let json = serde_json::to_value(&nack).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"type": "nack", "nonce": "a", "error": "bad"})
        );
    }
}
