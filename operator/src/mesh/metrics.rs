//! Config push metrics, registered under `baton_operator_push_*`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplyLabels {
    /// `ack`, `nack`, or `stale` (a reply to a superseded push).
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    /// Why a stream was refused (`missing_token`, `token_rejected`,
    /// `wrong_audience`, `pod_mismatch`, `not_meshed`, ...).
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransportLabels {
    /// `framed` (current sidecars) or `h2` (sidecars from before the
    /// framed transport, decision 0066).
    pub transport: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WatchLabels {
    /// The watched kind (`Service`, `EndpointSlice`, `Pod`, ...).
    pub kind: &'static str,
}

#[derive(Clone, Debug)]
pub struct PushMetrics {
    pub connected: Gauge,
    /// Streams opened, by the transport their sidecar speaks.
    pub opened: Family<TransportLabels, Counter>,
    pub pushes: Counter,
    pub replies: Family<ReplyLabels, Counter>,
    pub push_to_ack: Histogram,
    pub compile_seconds: Histogram,
    pub refusals: Family<RefusalLabels, Counter>,
    /// Streams closed for a malformed frame.
    pub bad_frames: Counter,
    /// Certificate requests that arrived on config stream connections.
    pub sign_requests: Counter,
    /// Watch (list or watch call) failures feeding the index, by kind.
    pub watch_errors: Family<WatchLabels, Counter>,
}

impl Default for PushMetrics {
    fn default() -> Self {
        Self {
            connected: Gauge::default(),
            opened: Family::default(),
            pushes: Counter::default(),
            replies: Family::default(),
            // 1 ms .. ~16 s
            push_to_ack: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            // 0.1 ms .. ~1.6 s
            compile_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 15)),
            refusals: Family::default(),
            bad_frames: Counter::default(),
            sign_requests: Counter::default(),
            watch_errors: Family::default(),
        }
    }
}

impl PushMetrics {
    /// Registers every metric under `registry` (the caller picks the
    /// sub-registry prefix, `push`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "connected_sidecars",
            "Sidecar config streams open on this replica",
            self.connected.clone(),
        );
        registry.register(
            "streams_opened",
            "Config streams opened, by transport (framed: current sidecars; h2: sidecars from before it)",
            self.opened.clone(),
        );
        registry.register("pushes", "Snapshots sent to sidecars", self.pushes.clone());
        registry.register(
            "replies",
            "Sidecar replies to pushes, by kind",
            self.replies.clone(),
        );
        registry.register(
            "push_to_ack_seconds",
            "Time from a push to the sidecar's ACK",
            self.push_to_ack.clone(),
        );
        registry.register(
            "compile_seconds",
            "Time to recompile every connected sidecar's snapshot after a change",
            self.compile_seconds.clone(),
        );
        registry.register(
            "stream_refusals",
            "Config streams refused, by reason",
            self.refusals.clone(),
        );
        registry.register(
            "watch_errors",
            "Failed list or watch calls feeding the config index, by kind",
            self.watch_errors.clone(),
        );
        registry.register(
            "bad_frames",
            "Config streams closed for a malformed frame",
            self.bad_frames.clone(),
        );
        registry.register(
            "sign_requests",
            "Certificate requests sidecars sent on their config stream's connection (answered by the identity service)",
            self.sign_requests.clone(),
        );
    }
}
