//! The accept loop every listener runs, and the TLS handshake in front of
//! a connection.
//!
//! A failed accept (out of descriptors, say) costs a 50 ms pause, never the
//! listener; every connection runs in its own task, and who owns those
//! tasks is the caller's choice ([`Connections`]): the operator's
//! endpoints close every connection when their task is dropped, the
//! sidecar's admin port lets accepted requests finish after its accept
//! loop is aborted (a handoff gives the socket to the successor), the
//! webhook drains its connections gracefully on stop.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

/// A client that has not finished its TLS handshake by then is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Pause after a failed accept: EMFILE and friends would otherwise spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Who owns the connection tasks, and so what stopping the loop (or
/// dropping its future) does to them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connections {
    /// Owned by the loop: when it stops, or its future is dropped (its task
    /// aborted), every connection closes, as a process exit would.
    Owned,
    /// Spawned on their own: they outlive the loop. For a socket the
    /// process is giving away, where requests already accepted must finish.
    Detached,
    /// Owned by the loop, which once stopped waits for them to finish (each
    /// connection sees the same stop signal and shuts down gracefully).
    Drained,
}

/// Accepts on `listener` until `stop`, handing each connection (with
/// `TCP_NODELAY` set) and its peer address to `serve_conn` in a task of its
/// own. The listening socket is closed before this returns: a connection
/// the kernel would queue from then on could never be served; refused, the
/// client's next attempt goes to another replica.
pub async fn serve_plain<F, Fut>(
    listener: TcpListener,
    what: &'static str,
    stop: CancellationToken,
    connections: Connections,
    serve_conn: F,
) where
    F: Fn(TcpStream, SocketAddr) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut owned = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
            // Reap finished connections so the set does not grow.
            Some(_) = owned.join_next(), if !owned.is_empty() => continue,
        };
        let (tcp, peer) = match accepted {
            Ok(conn) => conn,
            Err(error) => {
                tracing::warn!(%error, endpoint = what, "accept failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let conn = serve_conn(tcp, peer);
        match connections {
            Connections::Detached => drop(tokio::spawn(conn)),
            Connections::Owned | Connections::Drained => drop(owned.spawn(conn)),
        }
    }
    drop(listener);
    if connections == Connections::Drained {
        while owned.join_next().await.is_some() {}
    }
}

/// [`serve_plain`] with a TLS handshake (at most [`HANDSHAKE_TIMEOUT`], in
/// the connection's own task) before `serve_conn`; a failed or slow
/// handshake costs only that connection.
pub async fn serve_tls<F, Fut>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    what: &'static str,
    stop: CancellationToken,
    connections: Connections,
    serve_conn: F,
) where
    F: Fn(TlsStream<TcpStream>, SocketAddr) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    serve_tls_inner(
        listener,
        acceptor,
        what,
        stop,
        connections,
        None,
        serve_conn,
    )
    .await;
}

/// [`serve_tls`] with at most `at_once` handshakes in progress; the other
/// accepted connections wait their turn (their [`HANDSHAKE_TIMEOUT`] starts
/// with it). For an endpoint whose clients all connect together — every
/// sidecar, when an operator replica starts — where each handshake in
/// flight holds a rustls connection and its buffers: thousands at once were
/// most of a replica's peak memory (decision 0066).
pub async fn serve_tls_bounded<F, Fut>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    what: &'static str,
    stop: CancellationToken,
    connections: Connections,
    at_once: usize,
    serve_conn: F,
) where
    F: Fn(TlsStream<TcpStream>, SocketAddr) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let bound = Arc::new(Semaphore::new(at_once.max(1)));
    serve_tls_inner(
        listener,
        acceptor,
        what,
        stop,
        connections,
        Some(bound),
        serve_conn,
    )
    .await;
}

async fn serve_tls_inner<F, Fut>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    what: &'static str,
    stop: CancellationToken,
    connections: Connections,
    bound: Option<Arc<Semaphore>>,
    serve_conn: F,
) where
    F: Fn(TlsStream<TcpStream>, SocketAddr) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let serve_conn = Arc::new(serve_conn);
    serve_plain(listener, what, stop, connections, move |tcp, peer| {
        let acceptor = acceptor.clone();
        let serve_conn = serve_conn.clone();
        let bound = bound.clone();
        async move {
            // Never closed, so acquiring only waits; released when the
            // handshake is over, whatever its outcome.
            let turn = match bound {
                Some(bound) => bound.acquire_owned().await.ok(),
                None => None,
            };
            // Boxed: a connection's task is sized for its largest state, and
            // the handshake's (a whole rustls connection inline, and the
            // timer) would otherwise stay allocated for as long as the
            // connection lives, which for a config stream is its sidecar's
            // life (decision 0066).
            let tls = Box::pin(handshake(&acceptor, tcp, peer, what)).await;
            drop(turn);
            if let Some(tls) = tls {
                serve_conn(tls, peer).await;
            }
        }
    })
    .await;
}

/// Completes the server side of a TLS handshake within
/// [`HANDSHAKE_TIMEOUT`]; a failure is logged (debug: clients cause it).
pub async fn handshake(
    acceptor: &TlsAcceptor,
    tcp: TcpStream,
    peer: SocketAddr,
    what: &'static str,
) -> Option<TlsStream<TcpStream>> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => Some(tls),
        Ok(Err(error)) => {
            tracing::debug!(%peer, %error, endpoint = what, "TLS handshake failed");
            None
        }
        Err(_) => {
            tracing::debug!(%peer, endpoint = what, "TLS handshake timed out");
            None
        }
    }
}
