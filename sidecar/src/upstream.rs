//! Upstream clusters: endpoint selection (round-robin, power-of-two-choices
//! least-request), outlier ejection with exponential back-off, and pooled
//! HTTP clients (HTTP/1.1 keep-alive or HTTP/2 multiplexing).
//!
//! Cluster state outlives config reloads: [`Upstreams::build`] reuses a
//! cluster whose configuration did not change, so pools and ejections
//! survive a reload; changed clusters get fresh state.
//!
//! A cluster with `mtls` originates mesh mTLS on every new upstream
//! connection through the [`Originator`] the TLS layer installs in the
//! [`OriginatorSlot`]; pooled connections stay encrypted for their life.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use baton_config::{ClusterConfig, LbPolicy, UpstreamProtocol};
use http::Uri;
use http::uri::Authority;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;

use crate::body::ProxyBody;
use crate::conn::BoxIo;
use crate::filters::fast_rand;
use crate::metrics::Metrics;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Originates mesh mTLS on a connected upstream socket. Implemented by the
/// TLS layer (`tls::MeshTls`); a trait so clusters do not depend on it.
pub trait Originator: Send + Sync + 'static {
    /// TLS over `tcp` to a peer that must present `identity` (a SPIFFE ID),
    /// or, when `None`, the identity the TLS settings expect for
    /// `destination` (the cluster name). `alpn` is the one protocol offered.
    fn originate(
        &self,
        tcp: TcpStream,
        destination: Arc<str>,
        identity: Option<Arc<str>>,
        alpn: &'static [u8],
    ) -> Pin<Box<dyn Future<Output = std::io::Result<BoxIo>> + Send>>;

    /// Resolves once [`Originator::originate`] can succeed as far as this
    /// side knows (the TLS layer holds a certificate), or with the reason it
    /// cannot. Awaited before the TCP connect, so no upstream socket sits
    /// idle toward a peer whose protocol detection would time it out.
    fn ready(&self) -> Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

/// Where the TLS layer installs its [`Originator`]; shared by every
/// cluster, read once per new upstream connection (not per request).
#[derive(Clone, Default)]
pub struct OriginatorSlot(Arc<RwLock<Option<Arc<dyn Originator>>>>);

impl std::fmt::Debug for OriginatorSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OriginatorSlot")
            .field(&self.get().is_some())
            .finish()
    }
}

impl OriginatorSlot {
    pub fn set(&self, o: Arc<dyn Originator>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Some(o);
    }
    fn get(&self) -> Option<Arc<dyn Originator>> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// What clusters are built with: process metrics and the TLS originator.
#[derive(Debug, Clone)]
pub struct UpstreamDeps {
    pub metrics: Arc<Metrics>,
    pub originator: OriginatorSlot,
}

impl UpstreamDeps {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            metrics,
            originator: OriginatorSlot::default(),
        }
    }
}

/// Where a cluster's mesh mTLS goes: the peer identity and the originator.
#[derive(Debug)]
struct MtlsTarget {
    destination: Arc<str>,
    identity: Option<Arc<str>>,
    slot: OriginatorSlot,
}

impl MtlsTarget {
    /// See [`Originator::ready`].
    async fn ready(&self) -> std::io::Result<()> {
        match self.slot.get() {
            Some(originator) => originator.ready().await,
            None => Ok(()),
        }
    }

    /// Mesh mTLS over `tcp`, offering `alpn` (empty: none).
    async fn originate(&self, tcp: TcpStream, alpn: &'static [u8]) -> std::io::Result<TcpUpstream> {
        let Some(originator) = self.slot.get() else {
            return Err(std::io::Error::other(
                "cluster wants mesh mTLS but the sidecar has no TLS layer",
            ));
        };
        let io = originator
            .originate(tcp, self.destination.clone(), self.identity.clone(), alpn)
            .await?;
        Ok(TcpUpstream::Tls(io))
    }
}

/// The cluster client's connector: TCP (timeout, nodelay), then mesh mTLS
/// when the cluster asks for it.
#[derive(Clone)]
pub struct ClusterConnector {
    http: HttpConnector,
    mtls: Option<Arc<MtlsTarget>>,
    /// ALPN offered with mesh mTLS (the cluster's HTTP version).
    alpn: &'static [u8],
}

impl tower_service::Service<Uri> for ClusterConnector {
    type Response = TokioIo<TcpUpstream>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.http.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tcp = self.http.call(uri);
        let (mtls, alpn) = (self.mtls.clone(), self.alpn);
        Box::pin(async move {
            if let Some(t) = &mtls {
                t.ready().await?;
            }
            let tcp = tcp.await?.into_inner();
            let io = match mtls {
                None => TcpUpstream::Plain(tcp),
                Some(t) => t.originate(tcp, alpn).await?,
            };
            Ok(TokioIo::new(io))
        })
    }
}

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
    pub client: Client<ClusterConnector, ProxyBody>,
    /// Idle HTTP/1 connections of the fast path (`crate::h1fast`), oldest
    /// first: returned when their downstream connection ends, taken by the
    /// next one that needs the endpoint.
    idle: std::sync::Mutex<Vec<IdleConn>>,
    /// HTTP/1.1 connections of the general path (hyper's client connection
    /// driven by a task of its own), oldest first: checked in when a
    /// response body has ended, taken by the next request to the endpoint.
    /// In place of hyper-util's pool for HTTP/1.1 clusters: no pool key
    /// hashing or URI copies, and no task spawned per request to wait for
    /// the connection to become idle (docs/decisions/0059).
    senders: std::sync::Mutex<Vec<IdleSender>>,
    metrics: Arc<Metrics>,
    mtls: Option<Arc<MtlsTarget>>,
}

/// An HTTP/1.1 sender checked in to a cluster's list.
struct IdleSender {
    endpoint: usize,
    sender: Http1Sender,
    since: Instant,
}

impl std::fmt::Debug for IdleSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleSender")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

/// The sending half of a general-path HTTP/1.1 upstream connection.
pub type Http1Sender = hyper::client::conn::http1::SendRequest<ProxyBody>;

/// Why [`Cluster::send_http1`] got no response.
#[derive(Debug)]
pub enum SendError {
    /// No connection (connect, mesh mTLS or the HTTP/1.1 handshake failed):
    /// the request never left.
    Connect(std::io::Error),
    /// The connection failed after the request was (perhaps) sent.
    Reset(hyper::Error),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Connect(e) => write!(f, "connect: {e}"),
            SendError::Reset(e) => match std::error::Error::source(e) {
                Some(s) => write!(f, "{e}: {s}"),
                None => write!(f, "{e}"),
            },
        }
    }
}

/// Gives a sender back to its cluster when the response body has ended
/// (see [`crate::body::ProxyBody::with_end_hook`]); dropped before that,
/// the connection is not reused.
pub struct Checkin {
    cluster: Arc<Cluster>,
    endpoint: usize,
    sender: Http1Sender,
}

impl Checkin {
    pub fn done(self) {
        self.cluster.put_sender(self.endpoint, self.sender);
    }
}

/// An idle fast-path connection in a cluster's idle list.
struct IdleConn {
    endpoint: usize,
    io: TcpUpstream,
    since: Instant,
}

impl std::fmt::Debug for IdleConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleConn")
            .field("endpoint", &self.endpoint)
            .field("tls", &self.io.is_tls())
            .finish()
    }
}

/// A TCP connection to `addr` within `timeout`, with `TCP_NODELAY`.
pub async fn connect(addr: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    let tcp = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timeout"))??;
    let _ = tcp.set_nodelay(true);
    Ok(tcp)
}

/// An upstream connection: a plain socket, or an originated mesh-mTLS
/// session (the TLS layer's client stream, or after a handoff the record
/// layer that continues it). Both move with a handoff (protocol 2).
pub enum TcpUpstream {
    Plain(TcpStream),
    Tls(BoxIo),
}

impl TcpUpstream {
    pub fn is_tls(&self) -> bool {
        matches!(self, TcpUpstream::Tls(_))
    }

    /// Whether an idle connection can take a request: not closed by the
    /// upstream (its keep-alive timeout may be shorter than our pauses) and
    /// with nothing unsolicited to read. One non-blocking read attempt
    /// (usually not even a syscall: the socket is known not readable), as
    /// hyper's pool learns it from its connection task; without it a POST
    /// after a pause would meet a closed connection and fail.
    pub fn still_open(&mut self) -> bool {
        let mut byte = [0u8; 1];
        let mut buf = tokio::io::ReadBuf::new(&mut byte);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        tokio::io::AsyncRead::poll_read(Pin::new(self), &mut cx, &mut buf).is_pending()
    }
}

impl crate::conn::ParkableIo for TcpUpstream {
    fn into_parked(self) -> (crate::conn::ParkedIo, bytes::Bytes) {
        match self {
            TcpUpstream::Plain(s) => s.into_parked(),
            TcpUpstream::Tls(s) => s.into_parked(),
        }
    }
}

impl Connection for TcpUpstream {
    fn connected(&self) -> Connected {
        match self {
            TcpUpstream::Plain(s) => s.connected(),
            TcpUpstream::Tls(_) => Connected::new(),
        }
    }
}

impl tokio::io::AsyncRead for TcpUpstream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            TcpUpstream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            TcpUpstream::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for TcpUpstream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            TcpUpstream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            TcpUpstream::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            TcpUpstream::Plain(s) => Pin::new(s).poll_flush(cx),
            TcpUpstream::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            TcpUpstream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            TcpUpstream::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
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
    /// The endpoint's index in its cluster.
    pub fn index(&self) -> usize {
        self.idx
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
    pub fn new(config: ClusterConfig, deps: &UpstreamDeps) -> Self {
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
        let alpn: &'static [u8] = match config.protocol {
            UpstreamProtocol::Http1 => b"http/1.1",
            UpstreamProtocol::Http2 => b"h2",
        };
        let mtls = config.mtls.as_ref().map(|m| {
            Arc::new(MtlsTarget {
                destination: Arc::from(config.name.as_str()),
                identity: m.identity.as_deref().map(Arc::from),
                slot: deps.originator.clone(),
            })
        });
        let client = builder.build(ClusterConnector {
            http: connector,
            mtls: mtls.clone(),
            alpn,
        });
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
            idle: Default::default(),
            senders: Default::default(),
            metrics: deps.metrics.clone(),
            mtls,
        }
    }

    /// A new connection to `ep` for a raw TCP proxy: connect timeout (a tcp
    /// route's `timeout`, else the cluster's), then mesh mTLS (ALPN none)
    /// when the cluster asks for it.
    pub async fn connect_tcp(
        &self,
        addr: SocketAddr,
        timeout: Option<Duration>,
    ) -> std::io::Result<TcpUpstream> {
        self.connect_with(addr, b"", timeout).await
    }

    /// A new connection to `addr`: connect timeout, then mesh mTLS
    /// offering `alpn` (empty: none) when the cluster asks for it.
    pub async fn connect_upstream(
        &self,
        addr: SocketAddr,
        alpn: &'static [u8],
    ) -> std::io::Result<TcpUpstream> {
        self.connect_with(addr, alpn, None).await
    }

    async fn connect_with(
        &self,
        addr: SocketAddr,
        alpn: &'static [u8],
        timeout: Option<Duration>,
    ) -> std::io::Result<TcpUpstream> {
        if let Some(t) = &self.mtls {
            t.ready().await?;
        }
        let timeout =
            timeout.unwrap_or_else(|| Duration::from_millis(self.config.connect_timeout_ms));
        let tcp = connect(addr, timeout).await?;
        match &self.mtls {
            None => Ok(TcpUpstream::Plain(tcp)),
            Some(t) => t.originate(tcp, alpn).await,
        }
    }

    /// One HTTP/1.1 exchange with endpoint `idx` on a pooled connection
    /// (a new one when none is idle). `req` must be in origin form. A
    /// request that a reused connection hands back unsent (it was closed
    /// under us: the upstream's keep-alive timeout) goes on the next one.
    pub async fn send_http1(
        self: &Arc<Self>,
        idx: usize,
        mut req: http::Request<ProxyBody>,
    ) -> Result<(http::Response<hyper::body::Incoming>, Checkin), SendError> {
        loop {
            let (mut sender, reused) = match self.take_sender(idx).await {
                Some(s) => (s, true),
                None => (self.new_sender(idx).await?, false),
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    let checkin = Checkin {
                        cluster: self.clone(),
                        endpoint: idx,
                        sender,
                    };
                    return Ok((resp, checkin));
                }
                Err(mut e) => match e.take_message() {
                    Some(unsent) if reused => req = unsent,
                    _ => return Err(SendError::Reset(e.into_error())),
                },
            }
        }
    }

    /// The newest checked-in sender to `idx` that takes a request, waiting
    /// for one whose connection is still finishing the previous response
    /// (checked in at its body's end, it is ready once its task has run);
    /// closed and expired ones are dropped.
    async fn take_sender(&self, idx: usize) -> Option<Http1Sender> {
        let max_age = Duration::from_millis(self.config.pool_idle_timeout_ms);
        loop {
            let mut s = {
                let mut senders = self.senders.lock().unwrap_or_else(|p| p.into_inner());
                let now = Instant::now();
                let expired = senders.partition_point(|c| now.duration_since(c.since) >= max_age);
                senders.drain(..expired);
                let at = senders.iter().rposition(|c| c.endpoint == idx)?;
                senders.remove(at).sender
            };
            if s.is_ready() {
                return Some(s);
            }
            // Bounded: a connection whose request body is still being sent
            // (an upstream that answered before reading it all) may never
            // become ready; it is dropped (closed once idle) for the next.
            let wait = Duration::from_millis(self.config.connect_timeout_ms);
            if !s.is_closed() && matches!(tokio::time::timeout(wait, s.ready()).await, Ok(Ok(()))) {
                return Some(s);
            }
        }
    }

    async fn new_sender(&self, idx: usize) -> Result<Http1Sender, SendError> {
        let io = self
            .connect_upstream(self.endpoints[idx].addr, b"http/1.1")
            .await
            .map_err(SendError::Connect)?;
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .handshake(TokioIo::new(io))
            .await
            .map_err(|e| SendError::Connect(std::io::Error::other(e)))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream HTTP/1.1 connection ended with an error");
            }
        });
        Ok(sender)
    }

    /// Check a sender in (at most `pool_max_idle_per_endpoint` per
    /// endpoint: the oldest goes, its connection closes when idle).
    fn put_sender(&self, idx: usize, sender: Http1Sender) {
        if sender.is_closed() {
            return;
        }
        let mut senders = self.senders.lock().unwrap_or_else(|p| p.into_inner());
        if senders.iter().filter(|c| c.endpoint == idx).count()
            >= self.config.pool_max_idle_per_endpoint
        {
            match senders.iter().position(|c| c.endpoint == idx) {
                Some(oldest) => drop(senders.remove(oldest)),
                None => return,
            }
        }
        senders.push(IdleSender {
            endpoint: idx,
            sender,
            since: Instant::now(),
        });
    }

    /// An idle fast-path connection to endpoint `idx` that is still open
    /// (the newest first); expired ones (`pool_idle_timeout_ms`) are closed.
    pub fn take_idle(&self, idx: usize) -> Option<TcpUpstream> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let max_age = Duration::from_millis(self.config.pool_idle_timeout_ms);
        let expired = idle.partition_point(|c| now.duration_since(c.since) >= max_age);
        idle.drain(..expired);
        while let Some(at) = idle.iter().rposition(|c| c.endpoint == idx) {
            let mut c = idle.remove(at);
            if c.io.still_open() {
                return Some(c.io);
            }
        }
        None
    }

    /// Keep an idle fast-path connection for the next downstream connection
    /// (at most `pool_max_idle_per_endpoint` per endpoint: the oldest goes).
    pub fn put_idle(&self, idx: usize, io: TcpUpstream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.iter().filter(|c| c.endpoint == idx).count()
            >= self.config.pool_max_idle_per_endpoint
        {
            match idle.iter().position(|c| c.endpoint == idx) {
                Some(oldest) => drop(idle.remove(oldest)),
                None => return,
            }
        }
        idle.push(IdleConn {
            endpoint: idx,
            io,
            since: Instant::now(),
        });
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
        deps: &UpstreamDeps,
    ) -> Self {
        let clusters = configs
            .iter()
            .map(|c| {
                previous
                    .and_then(|p| p.clusters.iter().find(|old| old.config == *c))
                    .cloned()
                    .unwrap_or_else(|| Arc::new(Cluster::new(c.clone(), deps)))
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
            mtls: None,
        };
        Arc::new(Cluster::new(
            cfg,
            &UpstreamDeps::new(Arc::new(Metrics::new())),
        ))
    }

    /// A local HTTP/1.1 server answering every request with a body of
    /// `body_len` bytes (`close`: and `Connection: close`); counts the
    /// connections it accepted.
    async fn counting_upstream(
        body_len: usize,
        close: bool,
    ) -> (SocketAddr, Arc<AtomicU32>, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicU32::new(0));
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((s, _)) = listener.accept().await else {
                    return;
                };
                count.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |_req| async move {
                        let mut r = http::Response::new(http_body_util::Full::new(
                            bytes::Bytes::from(vec![b'x'; body_len]),
                        ));
                        if close {
                            r.headers_mut()
                                .insert("connection", http::HeaderValue::from_static("close"));
                        }
                        Ok::<_, std::convert::Infallible>(r)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        (addr, accepted, task)
    }

    fn cluster_to(addr: SocketAddr, max_idle: usize) -> Arc<Cluster> {
        let cfg = ClusterConfig {
            name: "c".into(),
            endpoints: vec![addr],
            lb: LbPolicy::RoundRobin,
            protocol: UpstreamProtocol::Http1,
            connect_timeout_ms: 1000,
            pool_idle_timeout_ms: 60_000,
            pool_max_idle_per_endpoint: max_idle,
            outlier: None,
            mtls: None,
        };
        Arc::new(Cluster::new(
            cfg,
            &UpstreamDeps::new(Arc::new(Metrics::new())),
        ))
    }

    /// One exchange the way the proxy makes it: the response body read to
    /// its end through a [`ProxyBody`] that checks the connection in.
    async fn exchange(c: &Arc<Cluster>) -> usize {
        use http_body_util::BodyExt;
        let req = http::Request::get("/x")
            .header("host", "up")
            .body(ProxyBody::Empty)
            .unwrap();
        let (resp, checkin) = c.send_http1(0, req).await.expect("an answer");
        assert_eq!(resp.status(), 200);
        let body = ProxyBody::streamed(resp.into_body())
            .with_end_hook(Some(crate::body::EndHook::new(|| checkin.done())));
        body.collect().await.unwrap().to_bytes().len()
    }

    fn idle_senders(c: &Cluster) -> usize {
        c.senders.lock().unwrap().len()
    }

    #[tokio::test]
    async fn http1_exchanges_reuse_one_connection_once_each_body_has_ended() {
        for body_len in [0, 10, 100_000] {
            let (addr, accepted, task) = counting_upstream(body_len, false).await;
            let c = cluster_to(addr, 4);
            for _ in 0..5 {
                assert_eq!(exchange(&c).await, body_len);
                assert_eq!(idle_senders(&c), 1, "body of {body_len} B: checked in");
            }
            assert_eq!(
                accepted.load(Ordering::Relaxed),
                1,
                "body of {body_len} B: one connection for five exchanges"
            );
            task.abort();
        }
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closes_is_not_reused() {
        let (addr, accepted, task) = counting_upstream(10, true).await;
        let c = cluster_to(addr, 4);
        for _ in 0..3 {
            assert_eq!(exchange(&c).await, 10);
        }
        assert_eq!(accepted.load(Ordering::Relaxed), 3);
        task.abort();
    }

    #[tokio::test]
    async fn concurrent_exchanges_keep_at_most_the_idle_limit() {
        let (addr, accepted, task) = counting_upstream(10, false).await;
        let c = cluster_to(addr, 2);
        let all: Vec<_> = (0..6)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move { exchange(&c).await })
            })
            .collect();
        for t in all {
            assert_eq!(t.await.unwrap(), 10);
        }
        assert!(idle_senders(&c) <= 2, "{} kept", idle_senders(&c));
        assert!(accepted.load(Ordering::Relaxed) <= 6);
        task.abort();
    }

    #[tokio::test]
    async fn an_unreachable_endpoint_is_a_connect_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let c = cluster_to(addr, 2);
        let req = http::Request::get("/").body(ProxyBody::Empty).unwrap();
        assert!(matches!(
            c.send_http1(0, req).await,
            Err(SendError::Connect(_))
        ));
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
        let m = UpstreamDeps::new(Arc::new(Metrics::new()));
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
