//! Upstream clusters: endpoint selection (round-robin, power-of-two-choices
//! least-request), outlier ejection with exponential back-off, and pooled
//! HTTP clients (HTTP/1.1 keep-alive or HTTP/2 multiplexing).
//!
//! Cluster state outlives config reloads: [`Upstreams::build`] reuses a
//! cluster whose configuration did not change, so pools and ejections
//! survive a reload; changed clusters get fresh state.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use http::uri::Authority;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::body::ProxyBody;
use crate::config::{ClusterConfig, LbPolicy, UpstreamProtocol};
use crate::filters::fast_rand;
use crate::metrics::Metrics;

/// One upstream address and its health/load state.
#[derive(Debug)]
pub struct Endpoint {
    pub addr: SocketAddr,
    pub authority: Authority,
    active: AtomicU32,
    consecutive_failures: AtomicU32,
    /// Milliseconds since the cluster epoch until which it is ejected.
    ejected_until: AtomicU64,
    ejections: AtomicU32,
}

impl Endpoint {
    fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            authority: Authority::try_from(addr.to_string().as_str())
                .expect("a socket address is a valid authority"),
            active: AtomicU32::new(0),
            consecutive_failures: AtomicU32::new(0),
            ejected_until: AtomicU64::new(0),
            ejections: AtomicU32::new(0),
        }
    }

    pub fn active(&self) -> u32 {
        self.active.load(Ordering::Relaxed)
    }
}

/// Outcome of one request to an endpoint, for outlier detection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    /// Connect failure, reset, timeout or a 5xx.
    Failure,
}

/// A cluster ready to send to.
#[derive(Debug)]
pub struct Cluster {
    pub config: ClusterConfig,
    pub name: Arc<str>,
    pub endpoints: Vec<Endpoint>,
    rr: AtomicUsize,
    epoch: Instant,
    pub client: Client<HttpConnector, ProxyBody>,
    metrics: Arc<Metrics>,
}

/// Decrements the endpoint's in-flight count when dropped.
#[derive(Debug)]
pub struct ActiveGuard {
    cluster: Arc<Cluster>,
    idx: usize,
}

impl ActiveGuard {
    pub fn endpoint(&self) -> &Endpoint {
        &self.cluster.endpoints[self.idx]
    }
    pub fn report(&self, outcome: Outcome) {
        self.cluster.report(self.idx, outcome);
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.cluster.endpoints[self.idx]
            .active
            .fetch_sub(1, Ordering::Relaxed);
    }
}

impl Cluster {
    pub fn new(config: ClusterConfig, metrics: Arc<Metrics>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(config.connect_timeout_ms)));
        connector.set_nodelay(true);
        connector.enforce_http(true);
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_millis(config.pool_idle_timeout_ms))
            .pool_max_idle_per_host(config.pool_max_idle_per_endpoint)
            .http2_only(config.protocol == UpstreamProtocol::Http2);
        let client = builder.build(connector);
        Self {
            name: Arc::from(config.name.as_str()),
            endpoints: config
                .endpoints
                .iter()
                .copied()
                .map(Endpoint::new)
                .collect(),
            config,
            rr: AtomicUsize::new(0),
            epoch: Instant::now(),
            client,
            metrics,
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn is_ejected(&self, e: &Endpoint, now: u64) -> bool {
        e.ejected_until.load(Ordering::Relaxed) > now
    }

    /// Choose an endpoint per the cluster's policy, skipping ejected ones
    /// (if every endpoint is ejected, all are candidates again: better to try
    /// than to fail for sure). `None` only for a cluster without endpoints.
    pub fn pick(self: &Arc<Self>) -> Option<ActiveGuard> {
        let n = self.endpoints.len();
        if n == 0 {
            return None;
        }
        let now = self.now_ms();
        let idx = if n == 1 {
            0
        } else {
            match self.config.lb {
                LbPolicy::RoundRobin => {
                    let start = self.rr.fetch_add(1, Ordering::Relaxed);
                    (0..n)
                        .map(|i| (start + i) % n)
                        .find(|&i| !self.is_ejected(&self.endpoints[i], now))
                        .unwrap_or(start % n)
                }
                LbPolicy::LeastRequest => {
                    let healthy = |i: usize| !self.is_ejected(&self.endpoints[i], now);
                    let a = fast_rand() as usize % n;
                    let mut b = fast_rand() as usize % (n - 1);
                    if b >= a {
                        b += 1;
                    }
                    match (healthy(a), healthy(b)) {
                        (true, false) => a,
                        (false, true) => b,
                        (false, false) => (0..n).find(|&i| healthy(i)).unwrap_or(a),
                        (true, true) => {
                            if self.endpoints[b].active() < self.endpoints[a].active() {
                                b
                            } else {
                                a
                            }
                        }
                    }
                }
            }
        };
        self.endpoints[idx].active.fetch_add(1, Ordering::Relaxed);
        Some(ActiveGuard {
            cluster: self.clone(),
            idx,
        })
    }

    /// Record an outcome; ejects after `consecutive_failures` in a row, for
    /// base × 2^(ejections so far) ms (capped), unless that would eject
    /// more than `max_ejected_percent` of the cluster (at least one may go).
    pub fn report(&self, idx: usize, outcome: Outcome) {
        let Some(o) = &self.config.outlier else {
            return;
        };
        let e = &self.endpoints[idx];
        match outcome {
            Outcome::Success => {
                e.consecutive_failures.store(0, Ordering::Relaxed);
            }
            Outcome::Failure => {
                let fails = e.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
                if fails < o.consecutive_failures {
                    return;
                }
                let now = self.now_ms();
                if self.is_ejected(e, now) {
                    return;
                }
                let ejected = self
                    .endpoints
                    .iter()
                    .filter(|x| self.is_ejected(x, now))
                    .count();
                let allowed = (self.endpoints.len() * o.max_ejected_percent as usize / 100).max(1);
                if ejected >= allowed {
                    return;
                }
                let n = e.ejections.fetch_add(1, Ordering::Relaxed).min(16);
                let ms = o
                    .base_ejection_ms
                    .saturating_mul(1 << n)
                    .min(o.max_ejection_ms);
                e.ejected_until.store(now + ms, Ordering::Relaxed);
                e.consecutive_failures.store(0, Ordering::Relaxed);
                self.metrics.outlier_ejections.inc();
                tracing::warn!(cluster = %self.name, endpoint = %e.addr, ejection_ms = ms, "outlier ejected");
            }
        }
    }

    /// Whether endpoint `addr` is currently ejected (admin/tests).
    pub fn ejected(&self, addr: SocketAddr) -> bool {
        let now = self.now_ms();
        self.endpoints
            .iter()
            .any(|e| e.addr == addr && self.is_ejected(e, now))
    }
}

/// All clusters of a snapshot, indexed like `snapshot.clusters`.
#[derive(Debug, Default)]
pub struct Upstreams {
    pub clusters: Vec<Arc<Cluster>>,
}

impl Upstreams {
    /// Build state for `configs`, reusing unchanged clusters from `previous`.
    pub fn build(
        configs: &[ClusterConfig],
        previous: Option<&Upstreams>,
        metrics: &Arc<Metrics>,
    ) -> Self {
        let clusters = configs
            .iter()
            .map(|c| {
                previous
                    .and_then(|p| p.clusters.iter().find(|old| old.config == *c))
                    .cloned()
                    .unwrap_or_else(|| Arc::new(Cluster::new(c.clone(), metrics.clone())))
            })
            .collect();
        Self { clusters }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OutlierConfig;

    fn cluster(n: u16, lb: LbPolicy, outlier: Option<OutlierConfig>) -> Arc<Cluster> {
        let cfg = ClusterConfig {
            name: "c".into(),
            endpoints: (1..=n)
                .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
                .collect(),
            lb,
            protocol: UpstreamProtocol::Http1,
            connect_timeout_ms: 100,
            pool_idle_timeout_ms: 1000,
            pool_max_idle_per_endpoint: 1,
            outlier,
        };
        Arc::new(Cluster::new(cfg, Arc::new(Metrics::new())))
    }

    #[tokio::test]
    async fn round_robin_cycles_through_endpoints() {
        let c = cluster(3, LbPolicy::RoundRobin, None);
        let ports: Vec<u16> = (0..6)
            .map(|_| c.pick().unwrap().endpoint().addr.port())
            .collect();
        assert_eq!(ports, vec![1, 2, 3, 1, 2, 3]);
    }

    #[tokio::test]
    async fn least_request_prefers_the_less_loaded_endpoint() {
        let c = cluster(2, LbPolicy::LeastRequest, None);
        // Endpoint 1 is busy; with two endpoints P2C always compares both.
        c.endpoints[0].active.store(5, Ordering::Relaxed);
        assert!((0..20).all(|_| c.pick().unwrap().endpoint().addr.port() == 2));
        c.endpoints[0].active.store(0, Ordering::Relaxed);
        let held: Vec<_> = (0..3).map(|_| c.pick().unwrap()).collect();
        let on_2 = held
            .iter()
            .filter(|g| g.endpoint().addr.port() == 2)
            .count();
        assert!(
            (1..=2).contains(&on_2),
            "load spreads over both endpoints, got {on_2} of 3 on endpoint 2"
        );
    }

    #[tokio::test]
    async fn consecutive_failures_eject_with_doubling_backoff_and_a_cap_on_ejected_share() {
        let o = OutlierConfig {
            consecutive_failures: 2,
            base_ejection_ms: 10_000,
            max_ejection_ms: 60_000,
            max_ejected_percent: 50,
        };
        let c = cluster(2, LbPolicy::RoundRobin, Some(o));
        let a = c.endpoints[0].addr;
        let b = c.endpoints[1].addr;
        c.report(0, Outcome::Failure);
        assert!(!c.ejected(a), "one failure is not enough");
        c.report(0, Outcome::Failure);
        assert!(c.ejected(a));
        assert!(
            (0..4).all(|_| c.pick().unwrap().endpoint().addr == b),
            "ejected endpoint is skipped"
        );
        c.report(1, Outcome::Failure);
        c.report(1, Outcome::Failure);
        assert!(
            !c.ejected(b),
            "max_ejected_percent keeps half the cluster in"
        );
        // Back-off doubles: second ejection of `a` lasts 2x base.
        c.endpoints[0].ejected_until.store(0, Ordering::Relaxed);
        c.report(0, Outcome::Failure);
        c.report(0, Outcome::Failure);
        let until = c.endpoints[0].ejected_until.load(Ordering::Relaxed);
        assert!(
            until >= 20_000,
            "second ejection lasts 2 × base, got {until}"
        );
        c.report(0, Outcome::Success);
        assert_eq!(
            c.endpoints[0].consecutive_failures.load(Ordering::Relaxed),
            0
        );
    }

    #[tokio::test]
    async fn unchanged_clusters_survive_a_rebuild() {
        let m = Arc::new(Metrics::new());
        let cfg = cluster(1, LbPolicy::RoundRobin, None).config.clone();
        let first = Upstreams::build(std::slice::from_ref(&cfg), None, &m);
        let same = Upstreams::build(std::slice::from_ref(&cfg), Some(&first), &m);
        assert!(Arc::ptr_eq(&first.clusters[0], &same.clusters[0]));
        let mut changed = cfg.clone();
        changed.connect_timeout_ms += 1;
        let other = Upstreams::build(&[changed], Some(&first), &m);
        assert!(!Arc::ptr_eq(&first.clusters[0], &other.clusters[0]));
    }
}
