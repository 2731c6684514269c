//! Golden metrics per route *and* peer identity, with bounded cardinality:
//! `baton_sidecar_route_requests_total{route,peer,class}` and
//! `baton_sidecar_route_request_duration_seconds{route,peer}`.
//!
//! Why bounded: routes come from the config (bounded by whoever writes
//! it), but peer identities come from whoever connects. At most
//! `runtime.route_metrics_max_series` (default 300) (route, peer) pairs get
//! series of their own; every observation for a pair beyond that is
//! recorded under `route="overflow", peer="overflow"` and counted in
//! `baton_sidecar_route_metrics_overflow_total`. One overflow pair rather
//! than an overflow peer per route keeps the bound strict whatever the
//! number of routes; the per-route totals stay exact in the families
//! without a peer (`baton_sidecar_requests_total{route,status_class}`).
//!
//! Why cheap: a pair's handles (five counters and a histogram, shared with
//! the families) are resolved once and kept; the HTTP/1.1 fast path keeps
//! the last pair per connection ([`ConnCache`]), so a keep-alive
//! connection's requests do no lookup, no lock and no allocation here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use crate::metrics::{Metrics, StatusClass};

/// The label value of a peer without a mesh identity (plaintext, or TLS
/// without a client certificate).
pub const UNAUTHENTICATED: &str = "unauthenticated";
/// The label value of both labels past the bound.
pub const OVERFLOW: &str = "overflow";

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClassLabels {
    route: Arc<str>,
    peer: Arc<str>,
    class: StatusClass,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PairLabels {
    route: Arc<str>,
    peer: Arc<str>,
}

/// One (route, peer) pair's series.
#[derive(Debug)]
pub struct PairMetrics {
    by_class: [Counter; 5],
    duration: Histogram,
    /// Set on the overflow pair: each observation also counts as overflowed.
    overflowed: Option<Counter>,
}

impl PairMetrics {
    pub fn record(&self, status: u16, seconds: f64) {
        self.by_class[StatusClass::of(status) as usize].inc();
        self.duration.observe(seconds);
        if let Some(c) = &self.overflowed {
            c.inc();
        }
    }
}

/// The per-peer route families and the table of pairs that have series.
#[derive(Debug)]
pub struct PeerRouteMetrics {
    requests: Family<ClassLabels, Counter>,
    duration: Family<PairLabels, Histogram, fn() -> Histogram>,
    /// route → peer → handles; at most the bound's number of pairs.
    pairs: Mutex<Pairs>,
    overflow: Arc<PairMetrics>,
}

#[derive(Debug, Default)]
struct Pairs {
    by_route: HashMap<Arc<str>, HashMap<Arc<str>, Arc<PairMetrics>>>,
    count: usize,
}

fn latency_histogram() -> Histogram {
    // The buckets of `request_duration_seconds`: 100 µs .. ~13 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

impl PeerRouteMetrics {
    /// Register the families with the process registry.
    pub fn new(metrics: &Metrics) -> Self {
        let requests = Family::<ClassLabels, Counter>::default();
        let duration: Family<PairLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        let overflowed = Counter::default();
        metrics.register(|r| {
            r.register(
                "route_requests",
                "HTTP requests by route, peer identity and status class (bounded: runtime.route_metrics_max_series pairs, then route=peer=\"overflow\")",
                requests.clone(),
            );
            r.register(
                "route_request_duration_seconds",
                "Time to response head by route and peer identity (same bound)",
                duration.clone(),
            );
            r.register(
                "route_metrics_overflow",
                "Observations recorded under route=peer=\"overflow\" because the (route, peer) bound was reached",
                overflowed.clone(),
            );
        });
        let overflow = Arc::new(Self::handles(
            &requests,
            &duration,
            &Arc::from(OVERFLOW),
            &Arc::from(OVERFLOW),
            Some(overflowed),
        ));
        Self {
            requests,
            duration,
            pairs: Mutex::new(Pairs::default()),
            overflow,
        }
    }

    fn handles(
        requests: &Family<ClassLabels, Counter>,
        duration: &Family<PairLabels, Histogram, fn() -> Histogram>,
        route: &Arc<str>,
        peer: &Arc<str>,
        overflowed: Option<Counter>,
    ) -> PairMetrics {
        let class = |class| {
            requests
                .get_or_create(&ClassLabels {
                    route: route.clone(),
                    peer: peer.clone(),
                    class,
                })
                .clone()
        };
        PairMetrics {
            by_class: [
                class(StatusClass::C1xx),
                class(StatusClass::C2xx),
                class(StatusClass::C3xx),
                class(StatusClass::C4xx),
                class(StatusClass::C5xx),
            ],
            duration: duration
                .get_or_create(&PairLabels {
                    route: route.clone(),
                    peer: peer.clone(),
                })
                .clone(),
            overflowed,
        }
    }

    /// The handles of (`route`, `peer`), created while fewer than `max`
    /// pairs exist, else the overflow pair's. A pair, once created, keeps
    /// its series (values continue across reloads; a lower bound applies to
    /// new pairs only).
    pub fn pair(&self, route: &Arc<str>, peer: Option<&str>, max: usize) -> Arc<PairMetrics> {
        let peer = peer.unwrap_or(UNAUTHENTICATED);
        let mut pairs = self.pairs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = pairs.by_route.get(&**route).and_then(|p| p.get(peer)) {
            return h.clone();
        }
        if pairs.count >= max {
            return self.overflow.clone();
        }
        let peer: Arc<str> = Arc::from(peer);
        let h = Arc::new(Self::handles(
            &self.requests,
            &self.duration,
            route,
            &peer,
            None,
        ));
        pairs.count += 1;
        pairs
            .by_route
            .entry(route.clone())
            .or_default()
            .insert(peer, h.clone());
        h
    }

    /// Pairs with series of their own (the overflow pair not included).
    pub fn pairs(&self) -> usize {
        self.pairs.lock().unwrap_or_else(|e| e.into_inner()).count
    }
}

/// The last pair one connection recorded: a connection's peer never
/// changes and its requests mostly hit one route, so the table is looked up
/// only when the route changes.
#[derive(Debug, Default)]
pub struct ConnCache {
    last: Option<(Arc<str>, Arc<PairMetrics>)>,
}

impl ConnCache {
    /// The handles of (`route`, this connection's `peer`).
    pub fn get(
        &mut self,
        table: &PeerRouteMetrics,
        route: &Arc<str>,
        peer: Option<&str>,
        max: usize,
    ) -> &PairMetrics {
        let hit = matches!(&self.last, Some((r, _)) if Arc::ptr_eq(r, route));
        if !hit {
            self.last = Some((route.clone(), table.pair(route, peer, max)));
        }
        &self.last.as_ref().expect("set above").1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(m: &Metrics, prefix: &str) -> Vec<String> {
        m.encode()
            .lines()
            .filter(|l| l.starts_with(prefix))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn requests_are_counted_by_route_peer_and_class_with_a_latency_histogram() {
        let m = Metrics::new();
        let t = PeerRouteMetrics::new(&m);
        let route: Arc<str> = Arc::from("api");
        let id = "spiffe://cluster.local/ns/a/sa/web";
        t.pair(&route, Some(id), 300).record(200, 0.001);
        t.pair(&route, Some(id), 300).record(503, 0.002);
        t.pair(&route, None, 300).record(404, 0.003);
        let out = m.encode();
        assert!(out.contains(&format!(
            "baton_sidecar_route_requests_total{{route=\"api\",peer=\"{id}\",class=\"2xx\"}} 1"
        )));
        assert!(out.contains(&format!(
            "baton_sidecar_route_requests_total{{route=\"api\",peer=\"{id}\",class=\"5xx\"}} 1"
        )));
        assert!(out.contains(
            "baton_sidecar_route_requests_total{route=\"api\",peer=\"unauthenticated\",class=\"4xx\"} 1"
        ));
        assert!(out.contains(&format!(
            "baton_sidecar_route_request_duration_seconds_count{{route=\"api\",peer=\"{id}\"}} 2"
        )));
        assert_eq!(t.pairs(), 2);
    }

    #[test]
    fn pairs_beyond_the_bound_are_recorded_as_overflow_and_counted() {
        let m = Metrics::new();
        let t = PeerRouteMetrics::new(&m);
        let route: Arc<str> = Arc::from("api");
        for i in 0..10 {
            t.pair(&route, Some(&format!("peer-{i}")), 3)
                .record(200, 0.001);
        }
        // An existing pair keeps its series after the bound is reached.
        t.pair(&route, Some("peer-0"), 3).record(200, 0.001);
        assert_eq!(t.pairs(), 3);
        let out = m.encode();
        assert!(out.contains(
            "baton_sidecar_route_requests_total{route=\"overflow\",peer=\"overflow\",class=\"2xx\"} 7"
        ));
        assert!(out.contains("baton_sidecar_route_metrics_overflow_total 7"));
        assert!(out.contains(
            "baton_sidecar_route_requests_total{route=\"api\",peer=\"peer-0\",class=\"2xx\"} 2"
        ));
        // Distinct pairs in the exposition: the 3 allowed and the overflow one.
        let pairs: std::collections::BTreeSet<String> =
            series(&m, "baton_sidecar_route_request_duration_seconds_count")
                .into_iter()
                .collect();
        assert_eq!(pairs.len(), 4, "{pairs:?}");
    }

    #[test]
    fn a_connection_cache_records_into_the_same_series_as_the_table() {
        let m = Metrics::new();
        let t = PeerRouteMetrics::new(&m);
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let mut cache = ConnCache::default();
        for route in [&a, &a, &b, &a] {
            cache.get(&t, route, Some("id"), 300).record(200, 0.001);
        }
        let out = m.encode();
        assert!(out.contains(
            "baton_sidecar_route_requests_total{route=\"a\",peer=\"id\",class=\"2xx\"} 3"
        ));
        assert!(out.contains(
            "baton_sidecar_route_requests_total{route=\"b\",peer=\"id\",class=\"2xx\"} 1"
        ));
    }
}
