//! The config push protocol's wire format, shared by the operator (server)
//! and the sidecar (client).
//!
//! One HTTP/2 stream per sidecar: `POST` [`WATCH_PATH`] over TLS with the
//! sidecar's projected ServiceAccount token as a bearer token, the Pod it
//! speaks for in [`POD_HEADER`] and the version it already serves in
//! [`VERSION_HEADER`], and what its client understands beyond full
//! snapshots in [`CAPABILITIES_HEADER`]. The response body carries [`Push`]
//! frames, the request body [`Reply`] frames. A frame is a 4-byte big-endian length and
//! that many bytes of JSON. Semantics follow Envoy's xDS: every push has a
//! version and a nonce; the sidecar answers each with an ACK (applied) or a
//! NACK (refused, with the error — it keeps serving its last good config).
//!
//! A push carries either the whole [`Snapshot`] or a [`Delta`]: the
//! sections that changed since the version the sidecar serves (xDS's
//! incremental variant, by section). The operator sends a delta only to a
//! stream that declared the `delta` capability, only onto a version the
//! sidecar has ACKed, and a full snapshot on (re)connect and after a NACK; the sidecar applies a delta onto its serving snapshot and
//! validates the result as it would a full one, so ACK and NACK mean the
//! same for both.
//!
//! Why length-prefixed JSON over plain HTTP/2 rather than gRPC: the
//! snapshot is already serde data with one JSON form (`/config`, the
//! handoff); a protobuf schema would be a second definition to keep in step,
//! and tonic a second HTTP/2 stack beside hyper in both binaries.

use std::collections::HashMap;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::{
    AdminConfig, ClusterConfig, ListenerConfig, Policies, RouteConfig, RuntimeConfig, Snapshot,
    TcpRouteConfig, TlsSettings,
};

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
/// What the sidecar's client understands beyond the base protocol, as
/// comma-separated tokens (e.g. `delta`). A sidecar that sends no such
/// header (one from before deltas) gets only full snapshots; a token the
/// operator does not know is ignored, so a newer sidecar works with an older
/// operator.
pub const CAPABILITIES_HEADER: &str = "x-baton-capabilities";

/// The protocol features one stream's client declared in
/// [`CAPABILITIES_HEADER`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// The client applies [`Delta`] pushes (token `delta`).
    pub delta: bool,
    /// The client follows the TLS section's re-issue trigger
    /// ([`crate::tls::Reissue`]) and reports the trust generation it holds
    /// ([`Reply::Certificate`]) (token `reissue`). A stream without it is
    /// sent no trigger: an earlier sidecar refuses the unknown field.
    pub reissue: bool,
}

impl Capabilities {
    const DELTA: &str = "delta";
    const REISSUE: &str = "reissue";

    /// Everything this build of the client understands.
    pub const ALL: Capabilities = Capabilities {
        delta: true,
        reissue: true,
    };

    /// Parses the header's value: tokens separated by commas, surrounding
    /// whitespace and case ignored, unknown tokens ignored.
    pub fn parse(value: &str) -> Capabilities {
        let mut caps = Capabilities::default();
        for token in value.split(',').map(str::trim) {
            if token.eq_ignore_ascii_case(Self::DELTA) {
                caps.delta = true;
            }
            if token.eq_ignore_ascii_case(Self::REISSUE) {
                caps.reissue = true;
            }
        }
        caps
    }

    /// The header's value for these capabilities.
    pub fn header_value(&self) -> String {
        let mut tokens = Vec::new();
        if self.delta {
            tokens.push(Self::DELTA);
        }
        if self.reissue {
            tokens.push(Self::REISSUE);
        }
        tokens.join(",")
    }
}

/// One push to one sidecar: exactly one of `snapshot` (the whole config)
/// and `delta` (the sections that changed since version `base`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Push {
    pub version: u64,
    /// Names this push in the reply (a version may be re-sent).
    pub nonce: String,
    /// With a delta: the version it applies onto, which must be the one the
    /// sidecar serves (otherwise the push is refused, NACK, and the operator
    /// follows with a full snapshot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<Snapshot>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<Delta>,
}

impl Push {
    /// The snapshot this push stands for, given the one the sidecar serves,
    /// stamped with the push's version. Not yet validated.
    pub fn resolve(self, serving: &Snapshot) -> Result<Snapshot, DeltaError> {
        let mut snapshot = match (self.snapshot, self.delta) {
            (Some(snapshot), None) => snapshot,
            (None, Some(delta)) => {
                let base = self
                    .base
                    .ok_or(DeltaError::Shape("a delta without a base"))?;
                if serving.version != base {
                    return Err(DeltaError::BaseMismatch {
                        base,
                        serving: serving.version,
                    });
                }
                delta.apply(serving)?
            }
            (None, None) => return Err(DeltaError::Shape("neither")),
            (Some(_), Some(_)) => return Err(DeltaError::Shape("both")),
        };
        snapshot.version = self.version;
        Ok(snapshot)
    }
}

/// A push's config: the whole snapshot, or the sections that changed since
/// the version the sidecar serves.
///
/// Why deltas: most changes touch one section (a Route edit: `routes`; a Pod
/// scaling: one cluster's endpoints), while a full snapshot carries every
/// Service's cluster; every byte is encrypted and framed once per connected
/// sidecar. The operator sends a delta only onto a version the sidecar has
/// ACKed; a full snapshot goes on (re)connect and after a NACK, so a sidecar
/// never needs anything but its serving snapshot to apply a push.
///
/// The delta itself names no version: the streams of one group share its
/// bytes while each has its own version ([`Push::base`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Delta {
    pub sections: Vec<Section>,
}

/// The new value of one snapshot section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Section {
    Admin(AdminConfig),
    Runtime(RuntimeConfig),
    Listeners(Vec<ListenerConfig>),
    Routes(Keyed<RouteConfig>),
    /// Sent only when the tcp routes changed, so a delta-capable sidecar
    /// from before tcp routes never sees the variant unless a tcp Route
    /// targets it (it then refuses the frame, as it would the snapshot).
    #[serde(rename = "tcp_routes")]
    TcpRoutes(Keyed<TcpRouteConfig>),
    Clusters(Keyed<ClusterConfig>),
    /// Boxed: the section is several times the size of the others (the
    /// JSON is the same).
    Tls(Option<Box<TlsSettings>>),
    Policies(Policies),
}

/// A list section by name (names are unique in a valid snapshot: the
/// sidecar's validation refuses duplicates): `order` names every entry of
/// the new list in order, `changed` holds the entries that are new or
/// differ; an entry named in `order` and not in `changed` keeps its
/// definition from the base. A Route edit sends one route, a Pod scaling
/// one cluster, not the whole list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Keyed<T> {
    pub order: Vec<String>,
    pub changed: Vec<T>,
}

/// An entry of a [`Keyed`] section.
pub trait Named {
    fn name(&self) -> &str;
}

impl Named for RouteConfig {
    fn name(&self) -> &str {
        &self.name
    }
}

impl Named for TcpRouteConfig {
    fn name(&self) -> &str {
        &self.name
    }
}

impl Named for ClusterConfig {
    fn name(&self) -> &str {
        &self.name
    }
}

impl<T: Named + Clone + PartialEq> Keyed<T> {
    fn between(old: &[T], new: &[T]) -> Self {
        let before: HashMap<&str, &T> = old.iter().map(|e| (e.name(), e)).collect();
        Keyed {
            order: new.iter().map(|e| e.name().to_owned()).collect(),
            changed: new
                .iter()
                .filter(|e| before.get(e.name()) != Some(e))
                .cloned()
                .collect(),
        }
    }

    fn apply(&self, base: &[T]) -> Result<Vec<T>, DeltaError> {
        let mut by_name: HashMap<&str, &T> = base.iter().map(|e| (e.name(), e)).collect();
        for e in &self.changed {
            by_name.insert(e.name(), e);
        }
        self.order
            .iter()
            .map(|name| {
                by_name
                    .get(name.as_str())
                    .map(|e| (*e).clone())
                    .ok_or_else(|| DeltaError::Unknown(name.clone()))
            })
            .collect()
    }
}

/// Why a delta does not apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeltaError {
    #[error("delta applies onto version {base}, the sidecar serves {serving}")]
    BaseMismatch { base: u64, serving: u64 },
    #[error("delta keeps {0:?}, which the serving config does not have")]
    Unknown(String),
    #[error("push carries {0}: exactly one of snapshot and delta is required")]
    Shape(&'static str),
}

impl Delta {
    /// The sections of `new` that differ from `old`:
    /// `Delta::between(old, new).apply(old)` is `new` (but its version).
    pub fn between(old: &Snapshot, new: &Snapshot) -> Delta {
        let mut sections = Vec::new();
        if old.admin != new.admin {
            sections.push(Section::Admin(new.admin.clone()));
        }
        if old.runtime != new.runtime {
            sections.push(Section::Runtime(new.runtime.clone()));
        }
        if old.listeners != new.listeners {
            sections.push(Section::Listeners(new.listeners.clone()));
        }
        if old.routes != new.routes {
            sections.push(Section::Routes(Keyed::between(&old.routes, &new.routes)));
        }
        if old.tcp_routes != new.tcp_routes {
            sections.push(Section::TcpRoutes(Keyed::between(
                &old.tcp_routes,
                &new.tcp_routes,
            )));
        }
        if old.clusters != new.clusters {
            sections.push(Section::Clusters(Keyed::between(
                &old.clusters,
                &new.clusters,
            )));
        }
        if old.tls != new.tls {
            sections.push(Section::Tls(new.tls.clone().map(Box::new)));
        }
        if old.policies != new.policies {
            sections.push(Section::Policies(new.policies.clone()));
        }
        Delta { sections }
    }

    /// The snapshot this delta makes of `serving`; the result still goes
    /// through the sidecar's validation before it replaces anything.
    pub fn apply(&self, serving: &Snapshot) -> Result<Snapshot, DeltaError> {
        let mut out = serving.clone();
        for section in &self.sections {
            match section {
                Section::Admin(v) => out.admin = v.clone(),
                Section::Runtime(v) => out.runtime = v.clone(),
                Section::Listeners(v) => out.listeners = v.clone(),
                Section::Routes(k) => out.routes = k.apply(&serving.routes)?,
                Section::TcpRoutes(k) => out.tcp_routes = k.apply(&serving.tcp_routes)?,
                Section::Clusters(k) => out.clusters = k.apply(&serving.clusters)?,
                Section::Tls(v) => out.tls = v.as_deref().cloned(),
                Section::Policies(v) => out.policies = v.clone(),
            }
        }
        Ok(out)
    }
}

/// Which field of a [`Push`] a [`SharedPush`]'s JSON is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigKind {
    Snapshot,
    Delta { base: u64 },
}

/// A push whose config is already JSON (`json`: one [`Snapshot`] or
/// [`Delta`], per `kind`). The operator serializes a config once per group
/// of sidecars that get the same one and shares the bytes between their
/// pushes; on the wire it is a [`Push`] ([`SharedPush::frame_parts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPush {
    pub version: u64,
    pub nonce: String,
    /// `Delta { base }`: a delta onto version `base`.
    pub kind: ConfigKind,
    pub json: Bytes,
}

impl SharedPush {
    /// Serializes `snapshot` for sharing between pushes.
    pub fn snapshot_json(snapshot: &Snapshot) -> Bytes {
        serde_json::to_vec(snapshot)
            .expect("snapshots serialize")
            .into()
    }

    /// Serializes `delta` for sharing between pushes.
    pub fn delta_json(delta: &Delta) -> Bytes {
        serde_json::to_vec(delta).expect("deltas serialize").into()
    }

    /// The frame of this push in three pieces that decode as a [`Push`]: the
    /// length prefix with the version and nonce, the shared JSON itself
    /// (a reference, not a copy: one buffer serves every stream of a group)
    /// and the closing brace.
    pub fn frame_parts(&self) -> [Bytes; 3] {
        let nonce = serde_json::to_string(&self.nonce).expect("strings serialize");
        // The fields in [`Push`]'s order, so the frame is byte for byte
        // what serializing the Push would give.
        let head = match self.kind {
            ConfigKind::Snapshot => format!(
                "{{\"version\":{},\"nonce\":{nonce},\"snapshot\":",
                self.version
            ),
            ConfigKind::Delta { base } => format!(
                "{{\"version\":{},\"nonce\":{nonce},\"base\":{base},\"delta\":",
                self.version
            ),
        };
        let len = head.len() + self.json.len() + 1;
        let mut first = Vec::with_capacity(4 + head.len());
        first.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
        first.extend_from_slice(head.as_bytes());
        [first.into(), self.json.clone(), Bytes::from_static(b"}")]
    }
}

/// One [`SharedPush`] as one contiguous frame (tests; the server sends
/// [`SharedPush::frame_parts`]).
pub fn encode_shared(push: &SharedPush) -> Vec<u8> {
    push.frame_parts().concat()
}

/// The sidecar's answer to one push.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Reply {
    /// Applied: the sidecar now serves `version`.
    Ack { nonce: String, version: u64 },
    /// Refused; the sidecar keeps its last good config.
    Nack { nonce: String, error: String },
    /// Not an answer to a push: the trust generation of the certificate the
    /// sidecar holds now ([`crate::tls::Reissue::generation`]). Sent only on
    /// a stream that was pushed a re-issue trigger (so the operator
    /// understands it), once after that push and again whenever the
    /// certificate changes: the operator counts the sidecars still holding
    /// an earlier generation, which is what a root rotation waits for.
    Certificate { generation: String },
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
        let Some(len) = self.complete()? else {
            return Ok(None);
        };
        let msg = serde_json::from_slice(&self.buf[4..4 + len]);
        self.buf.drain(..4 + len);
        Ok(Some(msg?))
    }

    /// The next complete frame's payload, undecoded.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        let Some(len) = self.complete()? else {
            return Ok(None);
        };
        let payload = self.buf[4..4 + len].to_vec();
        self.buf.drain(..4 + len);
        Ok(Some(payload))
    }

    /// The payload length of the first frame, if it has arrived whole.
    fn complete(&self) -> Result<Option<usize>, FrameError> {
        let Some(head) = self.buf.first_chunk::<4>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(*head) as usize;
        if len > MAX_FRAME {
            return Err(FrameError::TooLarge(len));
        }
        Ok((self.buf.len() >= 4 + len).then_some(len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_parse_known_tokens_and_ignore_the_rest() {
        let delta = Capabilities {
            delta: true,
            ..Capabilities::default()
        };
        let reissue = Capabilities {
            reissue: true,
            ..Capabilities::default()
        };
        for (value, want) in [
            ("reissue", reissue),
            ("delta, REISSUE", Capabilities::ALL),
            ("", Capabilities::default()),
            ("delta", delta),
            (" Delta ", delta),
            ("gzip, delta", delta),
            ("delta,future-thing", delta),
            ("gzip", Capabilities::default()),
            ("deltas", Capabilities::default()),
            (",,", Capabilities::default()),
        ] {
            assert_eq!(Capabilities::parse(value), want, "{value:?}");
        }
        assert_eq!(
            Capabilities::parse(&Capabilities::ALL.header_value()),
            Capabilities::ALL
        );
        assert_eq!(Capabilities::default().header_value(), "");
    }

    #[test]
    fn a_certificate_report_reads_back_and_names_its_type() {
        let report = Reply::Certificate {
            generation: "3f2a".into(),
        };
        let json = serde_json::to_string(&report).unwrap();
        assert_eq!(json, r#"{"type":"certificate","generation":"3f2a"}"#);
        let mut d = Decoder::default();
        d.extend(&encode(&report));
        assert_eq!(d.next_message::<Reply>().unwrap(), Some(report));
    }

    #[test]
    fn frames_survive_any_chunking() {
        let push = Push {
            version: 7,
            nonce: "n7".into(),
            base: None,
            snapshot: Some(crate::pod_default()),
            delta: None,
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
        let delta = Delta::between(&snapshot, &changed(&snapshot));
        for (kind, json, base, want_snapshot, want_delta) in [
            (
                ConfigKind::Snapshot,
                SharedPush::snapshot_json(&snapshot),
                None,
                Some(snapshot.clone()),
                None,
            ),
            (
                ConfigKind::Delta { base: 41 },
                SharedPush::delta_json(&delta),
                Some(41),
                None,
                Some(delta.clone()),
            ),
        ] {
            let shared = SharedPush {
                version: 42,
                // A nonce that needs escaping still round-trips.
                nonce: "n\"42\\".into(),
                kind,
                json,
            };
            let mut d = Decoder::default();
            for part in shared.frame_parts() {
                d.extend(&part);
            }
            let got: Push = d.next_message().unwrap().unwrap();
            assert_eq!(
                got,
                Push {
                    version: 42,
                    nonce: shared.nonce.clone(),
                    base,
                    snapshot: want_snapshot,
                    delta: want_delta,
                }
            );
            assert_eq!(
                encode_shared(&shared),
                encode(&got),
                "byte for byte what serializing the Push gives"
            );
        }
    }

    /// `base` with a change in every section.
    fn changed(base: &Snapshot) -> Snapshot {
        let mut new = base.clone();
        new.admin.address = "127.0.0.1:1".parse().unwrap();
        new.runtime.worker_threads = 3;
        new.listeners.pop();
        new.routes.push(
            serde_json::from_value(serde_json::json!({
                "name": "r", "backends": [{"cluster": "b", "weight": 1}]
            }))
            .unwrap(),
        );
        new.tcp_routes.push(
            serde_json::from_value(serde_json::json!({
                "name": "t", "destinations": ["10.96.0.1:5432"],
                "backends": [{"cluster": "b", "weight": 3}, {"cluster": "c"}],
                "connect_timeout_ms": 250
            }))
            .unwrap(),
        );
        new.clusters = vec![cluster("b", 2), cluster("c", 1)];
        new.tls = Some(crate::TlsSettings::default());
        new.policies =
            serde_json::from_value(serde_json::json!({"rbac": [{"name": "p", "rules": []}]}))
                .unwrap();
        new
    }

    fn cluster(name: &str, last_octet: u8) -> ClusterConfig {
        ClusterConfig::new(name, vec![([10, 0, 0, last_octet], 80).into()])
    }

    fn with_clusters(clusters: Vec<ClusterConfig>) -> Snapshot {
        Snapshot {
            version: 5,
            clusters,
            ..crate::pod_default()
        }
    }

    #[test]
    fn a_delta_applied_onto_its_base_gives_the_new_snapshot() {
        let a = with_clusters(vec![cluster("a", 1), cluster("b", 1), cluster("c", 1)]);
        let cases = [
            ("nothing", a.clone()),
            ("every section", changed(&a)),
            (
                "one cluster's endpoints",
                with_clusters(vec![cluster("a", 1), cluster("b", 9), cluster("c", 1)]),
            ),
            (
                "reordered, one removed, one added",
                with_clusters(vec![cluster("c", 1), cluster("d", 1), cluster("a", 1)]),
            ),
            ("no clusters", with_clusters(vec![])),
            ("tls removed", {
                let mut with_tls = a.clone();
                with_tls.tls = Some(crate::TlsSettings::default());
                let delta = Delta::between(&with_tls, &a);
                assert_eq!(delta.apply(&with_tls).unwrap().tls, None);
                a.clone()
            }),
        ];
        for (what, new) in cases {
            let delta = Delta::between(&a, &new);
            // Through the wire, as the sidecar gets it.
            let json = serde_json::to_vec(&delta).unwrap();
            let delta: Delta = serde_json::from_slice(&json).unwrap();
            let mut got = delta.apply(&a).unwrap();
            got.version = new.version;
            assert_eq!(got, new, "{what}");
        }
    }

    #[test]
    fn a_delta_carries_only_what_changed() {
        let a = with_clusters(vec![cluster("a", 1), cluster("b", 1), cluster("c", 1)]);
        assert!(Delta::between(&a, &a).sections.is_empty());
        let b = with_clusters(vec![cluster("a", 1), cluster("b", 9), cluster("c", 1)]);
        assert_eq!(
            Delta::between(&a, &b).sections,
            vec![Section::Clusters(Keyed {
                order: vec!["a".into(), "b".into(), "c".into()],
                changed: vec![cluster("b", 9)],
            })]
        );
        let route = |name: &str, weight: u32| -> RouteConfig {
            serde_json::from_value(serde_json::json!({
                "name": name, "backends": [{"cluster": "a", "weight": weight}]
            }))
            .unwrap()
        };
        let mut c = a.clone();
        c.routes = vec![route("r1", 1), route("r2", 1)];
        let mut d = c.clone();
        d.routes[1] = route("r2", 2);
        assert_eq!(
            Delta::between(&c, &d).sections,
            vec![Section::Routes(Keyed {
                order: vec!["r1".into(), "r2".into()],
                changed: vec![route("r2", 2)],
            })]
        );
    }

    fn tcp_route(name: &str, weights: (u32, u32)) -> TcpRouteConfig {
        serde_json::from_value(serde_json::json!({
            "name": name, "listeners": ["outbound"], "destinations": ["10.96.0.7:5432"],
            "backends": [{"cluster": "a", "weight": weights.0}, {"cluster": "b", "weight": weights.1}]
        }))
        .unwrap()
    }

    #[test]
    fn a_tcp_route_edit_sends_only_the_tcp_routes_section() {
        let a = with_clusters(vec![cluster("a", 1), cluster("b", 1)]);
        let mut b = a.clone();
        b.tcp_routes = vec![tcp_route("t", (3, 1))];
        let mut c = b.clone();
        c.tcp_routes = vec![tcp_route("t", (1, 1))];
        let delta = Delta::between(&b, &c);
        assert_eq!(
            delta.sections,
            vec![Section::TcpRoutes(Keyed {
                order: vec!["t".into()],
                changed: vec![tcp_route("t", (1, 1))],
            })]
        );
        let json = serde_json::to_value(&delta).unwrap();
        assert!(json["sections"][0].get("tcp_routes").is_some(), "{json}");
        // Removing the last tcp route is a change too.
        let mut got = Delta::between(&c, &a).apply(&c).unwrap();
        got.version = a.version;
        assert_eq!(got, a);
    }

    #[test]
    fn a_snapshot_without_tcp_routes_serializes_as_before_and_one_with_them_round_trips() {
        // Wire compatibility: a sidecar from before tcp routes refuses
        // unknown fields, so the key must be absent when there are none.
        let plain = with_clusters(vec![cluster("a", 1), cluster("b", 1)]);
        let json = serde_json::to_value(&plain).unwrap();
        assert!(json.get("tcp_routes").is_none(), "{json}");
        // An older operator's snapshot (no key) parses with none.
        let back: Snapshot = serde_json::from_value(json).unwrap();
        assert!(back.tcp_routes.is_empty());
        // The handoff carries the config as a JSON value: tcp routes survive.
        let mut with = plain;
        with.tcp_routes = vec![tcp_route("t", (3, 1))];
        let value = serde_json::to_value(&with).unwrap();
        assert_eq!(serde_json::from_value::<Snapshot>(value).unwrap(), with);
    }

    #[test]
    fn a_push_resolves_to_its_snapshot_stamped_with_its_version() {
        let a = with_clusters(vec![cluster("a", 1)]);
        let b = with_clusters(vec![cluster("b", 1)]);
        let push = |base, snapshot, delta| Push {
            version: 6,
            nonce: "n".into(),
            base,
            snapshot,
            delta,
        };
        let want = Snapshot {
            version: 6,
            ..b.clone()
        };
        assert_eq!(
            push(None, Some(b.clone()), None).resolve(&a),
            Ok(want.clone())
        );
        let delta = Delta::between(&a, &b);
        assert_eq!(
            push(Some(5), None, Some(delta.clone())).resolve(&a),
            Ok(want)
        );
        assert_eq!(
            push(None, None, None).resolve(&a),
            Err(DeltaError::Shape("neither"))
        );
        assert_eq!(
            push(None, Some(b), Some(delta.clone())).resolve(&a),
            Err(DeltaError::Shape("both"))
        );
        assert_eq!(
            push(None, None, Some(delta.clone())).resolve(&a),
            Err(DeltaError::Shape("a delta without a base"))
        );
    }

    #[test]
    fn a_delta_onto_another_version_or_missing_cluster_is_refused() {
        let a = with_clusters(vec![cluster("a", 1)]);
        let b = with_clusters(vec![cluster("a", 1), cluster("b", 1)]);
        let push = |base| Push {
            version: 6,
            nonce: "n".into(),
            base: Some(base),
            snapshot: None,
            delta: Some(Delta::between(&a, &b)),
        };
        assert_eq!(
            push(4).resolve(&a),
            Err(DeltaError::BaseMismatch {
                base: 4,
                serving: 5
            })
        );
        let other = with_clusters(vec![cluster("z", 1)]);
        assert_eq!(
            push(5).resolve(&other),
            Err(DeltaError::Unknown("a".into()))
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
