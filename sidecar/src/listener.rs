//! Accept loops and per-connection handling.
//!
//! ```text
//! accept ─▶ network filters ─▶ detect ─┬─▶ HTTP/1 server ─▶ HttpService
//!   (bound here or passed in       │   ├─▶ HTTP/2 server ─▶ HttpService
//!    by the handoff as an fd)      │   ├─▶ TLS layer ─▶ (detect again / ALPN)
//!                                  │   └─▶ TCP proxy
//! ```
//! Every connection is in the [`ConnRegistry`] for its whole life and
//! listens for a park request (see [`crate::conn`]).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use crate::client_hello::{AppTls, Hello, peek_client_hello};
use crate::config::{Capture, Direction, ListenerProtocol, TlsTermination};
use crate::conn::{BoxIo, ConnGuard, ConnKind, ParkRequest, ParkableIo, PrefixedIo};
use crate::detect::{Detection, MAX_DETECT_BYTES, Protocol, detect};
use crate::filters::{ConnMeta, NetworkFilter};
use crate::http_conn;
use crate::http_proxy::Shared;
use crate::metrics::ConnLabels;

/// Result of the TLS layer accepting a connection: the decrypted stream and
/// the metadata it learned (peer identity, ALPN).
pub type TlsAccepted = std::io::Result<(BoxIo, ConnMeta)>;

/// Hook the TLS layer implements: terminate TLS on a connection whose first
/// bytes are a ClientHello with the mesh marker. The data plane then detects the inner protocol
/// (ALPN `h2` → HTTP/2, `http/1.1` → HTTP/1, else by the first bytes).
pub trait TlsTerminator: Send + Sync + 'static {
    fn accept(
        &self,
        io: PrefixedIo<TcpStream>,
        meta: ConnMeta,
    ) -> Pin<Box<dyn Future<Output = TlsAccepted> + Send>>;

    /// Whether plaintext is accepted on `listener` (Strict mode says no).
    fn plaintext_allowed(&self, _listener: &str) -> bool {
        true
    }

    /// Whether TLS without the mesh marker (the application's own TLS from
    /// a client outside the mesh) may pass through `listener` as opaque
    /// bytes (Permissive: counted) or is refused (Strict: counted, logged).
    fn app_tls_allowed(&self, _listener: &str, _why: AppTls) -> bool {
        true
    }

    /// Whether mesh TLS is terminated at all (a Strict or Permissive
    /// policy). When it is, even a listener that skips protocol detection
    /// (`protocol: tcp`/`http1`/`http2`, opaque ports) peeks at the whole
    /// ClientHello and terminates only mesh TLS (the SNI marker of
    /// [`crate::client_hello`]); when it is not, TLS passes through such a
    /// listener untouched (the application's own TLS).
    fn terminates(&self) -> bool {
        true
    }
}

/// Bind a listening socket the way the sidecar wants it (reuseaddr,
/// large backlog), as a std listener so it can also come from an fd.
pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )?;
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(4096)?;
    Ok(sock.into())
}

/// Accept on `listener` (bound here, or adopted from another process by
/// the handoff) until the lifecycle reaches Draining or `stop` fires.
pub async fn serve_listener(
    listener: std::net::TcpListener,
    name: Arc<str>,
    shared: Arc<Shared>,
    tls: Option<Arc<dyn TlsTerminator>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = TcpListener::from_std(listener)?;
    let mut phase = shared.lifecycle.subscribe();
    tracing::info!(listener = %name, addr = %listener.local_addr()?, "accepting");
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = crate::lifecycle::wait_until(&mut phase, |p| p.stops_accepting()) => break,
            _ = crate::lifecycle::wait_until(&mut stop, |s| *s) => break,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(listener = %name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let shared = shared.clone();
        let name = name.clone();
        let tls = tls.clone();
        tokio::spawn(async move { handle_connection(stream, peer, name, shared, tls).await });
    }
    tracing::info!(listener = %name, "stopped accepting");
    Ok(())
}

/// Handle one accepted connection from start to end (also usable for a
/// connection adopted from elsewhere).
pub async fn handle_connection(
    stream: TcpStream,
    peer: SocketAddr,
    listener: Arc<str>,
    shared: Arc<Shared>,
    tls: Option<Arc<dyn TlsTerminator>>,
) {
    let _ = stream.set_nodelay(true);
    let active = shared.store.load();
    let Some(l) = active.config.listener(&listener) else {
        return;
    };
    let local = stream.local_addr().unwrap_or(peer);
    // Mesh mTLS (termination, Strict/Permissive) is for traffic entering
    // the pod. Outbound listeners take the local app's plaintext; TLS the
    // app speaks itself passes through them as opaque bytes.
    let tls = match l.config.direction {
        Direction::Inbound => tls,
        Direction::Outbound => None,
    };
    let original_dst = match l.config.capture {
        Capture::Transparent => crate::orig_dst::original_dst(&stream, local),
        Capture::Explicit => None,
    };
    let meta = ConnMeta {
        id: shared.registry.next_id(),
        listener: listener.clone(),
        peer,
        local,
        original_dst,
        peer_identity: None,
        alpn: None,
        tls: false,
    };

    // Network filters.
    let _permit = match l.config.max_connections {
        Some(max) => match (NetworkFilter::ConnectionLimit {
            max,
            live: shared.conn_count(&listener),
        })
        .on_accept()
        {
            Some(p) => Some(p),
            None => {
                shared.metrics.local_response("connection_limit");
                return;
            }
        },
        None => None,
    };
    let (guard, park) = shared.registry.register(meta.clone());

    let detect_timeout = Duration::from_millis(l.config.detect_timeout_ms);
    let opaque = l.is_opaque(meta.original_dst.unwrap_or(meta.local));
    let forced = match l.config.protocol {
        ListenerProtocol::Http1 => Some(Protocol::Http1),
        ListenerProtocol::Http2 => Some(Protocol::Http2),
        ListenerProtocol::Tcp => Some(Protocol::Tcp),
        ListenerProtocol::Auto if opaque => Some(Protocol::Tcp),
        ListenerProtocol::Auto => None,
    };
    let terminate_all = l.config.terminate_tls == TlsTermination::All;
    drop(active);

    let mut stream = stream;
    let inbound = match &tls {
        // Inbound under mesh TLS (Strict, Permissive): the whole ClientHello
        // is peeked at (never consumed) before anything is decided, on every
        // listener (the listener's protocol is what is inside the mesh TLS):
        // only a ClientHello with the mesh marker is terminated.
        Some(t) if t.terminates() => match peek_client_hello(&stream, detect_timeout).await {
            Err(_) => return,
            Ok(Some(Hello::Mesh)) => Inbound::MeshTls(t.clone()),
            // A TLS edge for clients outside the mesh terminates them all.
            Ok(Some(Hello::App(_))) if terminate_all => Inbound::MeshTls(t.clone()),
            Ok(Some(Hello::App(why))) => Inbound::UnmarkedTls(t.clone(), why),
            // Silent until the timeout: plaintext, as detection's timeout.
            Ok(None) => Inbound::Plain(forced.unwrap_or(Protocol::Tcp), Bytes::new()),
            // Not a TLS record: plaintext, detected as usual.
            Ok(Some(Hello::NotTls | Hello::NeedMore(_))) => {
                match detect_plain(&mut stream, forced, detect_timeout).await {
                    Ok((Protocol::Tls, prefix)) => Inbound::Plain(Protocol::Tcp, prefix),
                    Ok((p, prefix)) => Inbound::Plain(p, prefix),
                    Err(_) => return,
                }
            }
        },
        // No mesh TLS here (no TLS layer, or one whose policy does not
        // terminate: none applied yet, or Disabled): a ClientHello is the
        // application's own TLS and passes through the mesh untouched.
        _ => match detect_plain(&mut stream, forced, detect_timeout).await {
            Ok((Protocol::Tls, prefix)) => Inbound::PassthroughTls(prefix),
            Ok((p, prefix)) => Inbound::Plain(p, prefix),
            Err(_) => return,
        },
    };
    match inbound {
        Inbound::MeshTls(t) => {
            guard.set_kind(ConnKind::Tls);
            guard.set_tls();
            match t.accept(PrefixedIo::new(Bytes::new(), stream), meta).await {
                Ok((io, meta)) => serve_decrypted(io, meta, forced, shared, guard, park).await,
                Err(e) => tracing::debug!(error = %e, "tls accept failed"),
            }
        }
        // TLS from outside the mesh to the application itself: opaque bytes
        // (Permissive, counted) or refused (Strict, counted and logged).
        Inbound::UnmarkedTls(t, why) => {
            if !t.app_tls_allowed(&listener, why) {
                shared.metrics.local_response("app_tls_refused");
                tracing::info!(listener = %listener, peer = %peer, reason = why.as_str(), "TLS without the mesh marker refused (strict mTLS)");
                return;
            }
            let io = PrefixedIo::new(Bytes::new(), stream);
            serve_plain(io, meta, Protocol::Tcp, shared, guard, park).await
        }
        Inbound::PassthroughTls(prefix) => {
            let io = PrefixedIo::new(prefix, stream);
            serve_plain(io, meta, Protocol::Tcp, shared, guard, park).await
        }
        Inbound::Plain(p, prefix) => {
            if let Some(t) = &tls
                && !t.plaintext_allowed(&listener)
            {
                shared.metrics.local_response("plaintext_refused");
                tracing::info!(listener = %listener, peer = %peer, "plaintext refused (strict mTLS)");
                return;
            }
            serve_plain(
                PrefixedIo::new(prefix, stream),
                meta,
                p,
                shared,
                guard,
                park,
            )
            .await
        }
    }
}

/// What an inbound connection turned out to be, and the bytes already read.
enum Inbound {
    /// A ClientHello with the mesh marker: terminate mesh TLS.
    MeshTls(Arc<dyn TlsTerminator>),
    /// TLS without the marker under a terminating policy (which decides
    /// whether it passes); nothing consumed.
    UnmarkedTls(Arc<dyn TlsTerminator>, AppTls),
    /// TLS where no policy terminates: passes through; the prefix was read.
    PassthroughTls(Bytes),
    /// Plaintext of this protocol; the prefix was read during detection.
    Plain(Protocol, Bytes),
}

/// The listener's forced protocol, or detection from the first bytes.
async fn detect_plain(
    stream: &mut TcpStream,
    forced: Option<Protocol>,
    timeout: Duration,
) -> std::io::Result<(Protocol, Bytes)> {
    match forced {
        Some(p) => Ok((p, Bytes::new())),
        None => read_and_detect(stream, timeout).await,
    }
}

/// Read until detection decides or the timeout fires (server speaks first:
/// raw TCP). Returns the protocol and the bytes read.
async fn read_and_detect(
    stream: &mut TcpStream,
    timeout: Duration,
) -> std::io::Result<(Protocol, Bytes)> {
    let mut buf = BytesMut::with_capacity(1024);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match detect(&buf) {
            Detection::Done(p) => return Ok((p, buf.freeze())),
            Detection::NeedMore if buf.len() >= MAX_DETECT_BYTES => {
                return Ok((Protocol::Tcp, buf.freeze()));
            }
            Detection::NeedMore => {}
        }
        if buf.capacity() - buf.len() < 512 {
            buf.reserve(4096);
        }
        match tokio::time::timeout_at(deadline, stream.read_buf(&mut buf)).await {
            Err(_) => return Ok((Protocol::Tcp, buf.freeze())),
            Ok(Ok(0)) => {
                return if buf.is_empty() {
                    Err(std::io::ErrorKind::UnexpectedEof.into())
                } else {
                    Ok((Protocol::Tcp, buf.freeze()))
                };
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e),
        }
    }
}

/// Serve a decrypted stream from the TLS layer. An opaque listener
/// (`forced` TCP) passes the inner bytes on untouched; otherwise ALPN
/// decides, then the listener's protocol, else detection.
async fn serve_decrypted(
    mut io: BoxIo,
    meta: ConnMeta,
    forced: Option<Protocol>,
    shared: Arc<Shared>,
    guard: ConnGuard,
    park: oneshot::Receiver<ParkRequest>,
) {
    let by_alpn = match meta.alpn.as_deref() {
        Some(b"h2") => Some(Protocol::Http2),
        Some(b"http/1.1") => Some(Protocol::Http1),
        _ => None,
    };
    let inner = match forced {
        Some(Protocol::Tcp) => Some(Protocol::Tcp),
        f => by_alpn.or(f),
    };
    let (protocol, prefix) = match inner {
        Some(p) => (p, Bytes::new()),
        None => {
            let timeout = shared
                .store
                .load()
                .config
                .listener(&meta.listener)
                .map_or(Duration::from_millis(500), |l| {
                    Duration::from_millis(l.config.detect_timeout_ms)
                });
            let mut buf = BytesMut::with_capacity(1024);
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                match detect(&buf) {
                    Detection::Done(Protocol::Tls) => break (Protocol::Tcp, buf.freeze()),
                    Detection::Done(p) => break (p, buf.freeze()),
                    Detection::NeedMore if buf.len() >= MAX_DETECT_BYTES => {
                        break (Protocol::Tcp, buf.freeze());
                    }
                    Detection::NeedMore => {}
                }
                buf.reserve(1024);
                match tokio::time::timeout_at(deadline, io.read_buf(&mut buf)).await {
                    Ok(Ok(n)) if n > 0 => {}
                    Ok(Ok(_)) | Ok(Err(_)) if buf.is_empty() => return,
                    _ => break (Protocol::Tcp, buf.freeze()),
                }
            }
        }
    };
    serve_plain(
        PrefixedIo::new(prefix, io),
        meta,
        protocol,
        shared,
        guard,
        park,
    )
    .await
}

/// Hand a stream whose protocol is known to its handler.
pub async fn serve_plain<I: ParkableIo>(
    io: PrefixedIo<I>,
    meta: ConnMeta,
    protocol: Protocol,
    shared: Arc<Shared>,
    guard: ConnGuard,
    park: oneshot::Receiver<ParkRequest>,
) {
    serve_known(io, meta, protocol, shared, guard, park, None).await
}

/// An HTTP/2 connection moved from the previous process, continued from
/// its carried state (decision 0062).
pub(crate) async fn serve_resumed_http2<I: ParkableIo>(
    io: PrefixedIo<I>,
    meta: ConnMeta,
    shared: Arc<Shared>,
    guard: ConnGuard,
    park: oneshot::Receiver<ParkRequest>,
    state: crate::h2_state::ConnState,
) {
    serve_known(io, meta, Protocol::Http2, shared, guard, park, Some(state)).await
}

async fn serve_known<I: ParkableIo>(
    io: PrefixedIo<I>,
    meta: ConnMeta,
    protocol: Protocol,
    shared: Arc<Shared>,
    guard: ConnGuard,
    park: oneshot::Receiver<ParkRequest>,
    h2_resume: Option<crate::h2_state::ConnState>,
) {
    let kind = match protocol {
        Protocol::Http1 => ConnKind::Http1,
        Protocol::Http2 => ConnKind::Http2,
        _ => ConnKind::Tcp,
    };
    guard.set_kind(kind);
    let labels = ConnLabels {
        listener: meta.listener.clone(),
        protocol: kind.as_str(),
    };
    shared.metrics.connections.get_or_create(&labels).inc();
    let active_gauge = shared
        .metrics
        .connections_active
        .get_or_create(&labels)
        .clone();
    active_gauge.inc();
    match protocol {
        Protocol::Http1 if shared.store.snapshot().runtime.h1_fast_path => {
            crate::h1fast::serve(io, meta, shared, park).await
        }
        Protocol::Http1 => http_conn::serve_http1(io, meta, shared, park).await,
        Protocol::Http2 => http_conn::serve_http2(io, meta, shared, park, h2_resume).await,
        _ => serve_tcp(io, meta, shared, park).await,
    }
    active_gauge.dec();
    drop(guard);
}

async fn serve_tcp<I: ParkableIo>(
    io: PrefixedIo<I>,
    meta: ConnMeta,
    shared: Arc<Shared>,
    park: oneshot::Receiver<ParkRequest>,
) {
    // Subscribed before the config is loaded: a policy applied from here
    // on is seen by the re-check below.
    let versions = shared.store.subscribe();
    let active = shared.store.load();
    let Some(l) = active.config.listener(&meta.listener) else {
        return;
    };
    // The connection's access-log line, written however it ends.
    let mut log = l.config.access_log.then(|| {
        let rate = active.config.snapshot.runtime.access_log_lines_per_second();
        crate::access_log::TcpLine::start(&shared.access_log, rate, &meta)
    });
    // The listener's policy governs connections that are not HTTP too:
    // decided once, before the upstream connect (no byte reaches the app
    // of a denied one), by what a connection has: identity, address, port.
    // Rules that need a request never match here.
    if let Some(rbac) = &l.rbac {
        let verdict = rbac.check(&meta, None);
        verdict.record(&shared.metrics, &meta, None);
        if let Some(line) = &mut log {
            line.record.authz = crate::access_log::Authz::of(&verdict);
        }
        if verdict.denied() {
            shared.metrics.local_response("rbac_denied");
            return;
        }
    }
    let port = meta.dst_port();
    // A tcp route owns its destination outright (it is the most specific
    // rule: IP and port): the backend is drawn here, once, so the
    // connection keeps it whatever later configs say.
    let tcp_route = l.tcp_route(meta.original_dst.unwrap_or(meta.local));
    let connect_timeout = tcp_route.and_then(|r| r.connect_timeout);
    let by_tcp_route = tcp_route.map(|r| r.pick_backend(crate::filters::fast_rand()));
    // No fixed cluster: a connection to a Service (its ClusterIP and port,
    // as a route names them) goes to that Service's cluster, so it gets the
    // cluster's mTLS and endpoints; anything else passes through.
    let by_route = || {
        meta.original_dst.and_then(|dst| {
            crate::routing::connection_cluster(&l.routes, dst, crate::filters::fast_rand())
        })
    };
    let target = match (
        by_tcp_route
            .or_else(|| l.port_map.get(&port).or(l.tcp_cluster.as_ref()).copied())
            .or_else(by_route),
        meta.original_dst,
    ) {
        (Some(c), _) => {
            let cluster = active.upstreams.clusters[c].clone();
            cluster
                .pick()
                .map(|ep| (ep.endpoint().addr, Some((ep, cluster))))
        }
        (None, Some(dst)) if l.config.passthrough => Some((dst, None)),
        _ => None,
    };
    drop(active);
    // A backend without endpoints (or no rule at all): the connection is
    // closed, the TCP form of HTTP's 503.
    let Some((addr, ep)) = target else {
        shared.metrics.upstream_error("no_endpoints");
        tracing::debug!(
            conn = meta.id,
            "tcp: no cluster or passthrough for this connection; closing"
        );
        return;
    };
    if let Some(line) = &mut log {
        line.record.upstream = Some(addr.to_string());
    }
    let connected = match &ep {
        Some((_, cluster)) => cluster.connect_tcp(addr, connect_timeout).await,
        // Original-destination passthrough: plain TCP, 1 s connect timeout.
        None => crate::upstream::connect(addr, Duration::from_secs(1))
            .await
            .map(crate::upstream::TcpUpstream::Plain),
    };
    let up = match connected {
        Ok(s) => {
            if let Some((ep, _)) = &ep {
                ep.report(crate::upstream::Outcome::Success);
            }
            s
        }
        Err(e) => {
            if let Some((ep, _)) = &ep {
                ep.report(crate::upstream::Outcome::Failure);
            }
            shared.metrics.upstream_error("connect");
            tracing::debug!(conn = meta.id, upstream = %addr, error = %e, "tcp: upstream connect failed");
            return;
        }
    };
    let (prefix, io) = io.into_parts();
    let (end, moved) = until_revoked(
        crate::tcp_proxy::proxy(
            io,
            up,
            &prefix,
            &meta,
            park,
            &shared.bytes_rx,
            &shared.bytes_tx,
        ),
        (
            crate::tcp_proxy::TcpEnd::Closed,
            crate::tcp_proxy::Moved::default(),
        ),
        &shared,
        &meta,
        versions,
    )
    .await;
    drop(ep);
    if let Some(line) = &mut log {
        line.record.bytes_in = moved.up;
        line.record.bytes_out = moved.down;
        if matches!(end, crate::tcp_proxy::TcpEnd::Parked) {
            line.skip();
        }
    }
    if let crate::tcp_proxy::TcpEnd::Error(e) = end {
        tracing::debug!(conn = meta.id, error = %e, "tcp proxy ended with an error");
    }
}

/// Runs a proxied TCP connection (`proxy`) until it ends, or until a config
/// applied after it was admitted has a policy that denies it: then the
/// connection is closed (both sockets dropped), counted as a denial and
/// logged (docs/decisions/0047: a revoked permission ends established
/// connections too, as it ends the next request of an HTTP one). A config
/// whose listener has no policy, or which drops the listener, leaves it be.
pub(crate) async fn until_revoked<T>(
    proxy: impl Future<Output = T>,
    closed: T,
    shared: &Shared,
    meta: &ConnMeta,
    mut versions: tokio::sync::watch::Receiver<u64>,
) -> T {
    let revoked = async {
        loop {
            if versions.changed().await.is_err() {
                // The store is gone: nothing will change any more.
                return std::future::pending().await;
            }
            let active = shared.store.load();
            let Some(rbac) = active
                .config
                .listener(&meta.listener)
                .and_then(|l| l.rbac.clone())
            else {
                continue;
            };
            let verdict = rbac.check(meta, None);
            if verdict.denied() {
                return verdict;
            }
        }
    };
    tokio::select! {
        // The proxy first: a park request it answers is never cut short.
        biased;
        end = proxy => end,
        verdict = revoked => {
            verdict.count(&shared.metrics);
            shared.metrics.local_response("rbac_denied");
            tracing::info!(target: "authz", conn = meta.id, listener = %meta.listener,
                peer = %meta.peer, identity = meta.peer_identity.as_deref().unwrap_or("-"),
                tls = meta.tls, policy = verdict.policy(), rule = verdict.rule(),
                "established connection closed: the policy now in force denies it");
            closed
        }
    }
}
