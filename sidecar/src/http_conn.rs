//! The hyper side of a plain or decrypted connection: HTTP/1.1 (the general
//! path the fast path falls back to) and HTTP/2 (behind the frame shim that
//! lets an idle connection move, [`crate::h2_shim`]), each with its drain
//! and park handling.
//!
//! Its own module, below both [`crate::listener`] (which detects the
//! protocol and picks a server) and [`crate::h1fast`] (which hands the
//! connection over here when it meets a request it does not take), so the
//! two depend on it and never on each other.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::oneshot;

use crate::body::InFlight;
use crate::conn::{
    FramingGuard, H1Framing, H1Refusal, ParkRequest, ParkableIo, Parked, PrefixedIo,
};
use crate::filters::ConnMeta;
use crate::h2_shim::{Shim, ShimHandle, Verdict};
use crate::h2_state::ConnState;
use crate::http_proxy::{HttpService, Shared};

fn http_service(
    meta: ConnMeta,
    shared: &Arc<Shared>,
    h1_refusal: Option<Arc<H1Refusal>>,
) -> HttpService {
    HttpService {
        shared: shared.clone(),
        conn: Arc::new(meta),
        inflight: Arc::new(InFlight::default()),
        h1_refusal,
        peers: Default::default(),
    }
}

pub(crate) async fn serve_http1<I: ParkableIo>(
    io: PrefixedIo<I>,
    meta: ConnMeta,
    shared: Arc<Shared>,
    park: oneshot::Receiver<ParkRequest>,
) {
    let rt = shared.store.snapshot().runtime.clone();
    let refusal = H1Refusal::new();
    let svc = http_service(meta.clone(), &shared, Some(refusal.clone()));
    let inflight = svc.inflight.clone();
    // Request-smuggling shapes hyper only neutralises are refused (400).
    let io = FramingGuard::new(io, H1Framing::new(rt.max_header_bytes), refusal);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(crate::coarse_timer::CoarseTimer)
        .header_read_timeout(Duration::from_millis(rt.header_read_timeout_ms))
        .max_header_size(rt.max_header_bytes)
        .keep_alive(true);
    if rt.max_headers != 100 {
        builder.max_headers(rt.max_headers);
    }
    let mut conn = builder
        .serve_connection(TokioIo::new(io), svc)
        .with_upgrades();
    let mut drain = shared.lifecycle.drain_signal();
    let mut park = park;
    let mut draining = false;
    tokio::select! {
        r = &mut conn => { log_conn_end(&meta, r.err()); return; }
        _ = crate::lifecycle::wait_until(&mut drain, |d| *d) => { draining = true; }
        req = &mut park => if let Ok(req) = req {
                // Safe point: no request in flight. Keep driving the
                // connection (responses must flush) while waiting for it.
                let idle = async {
                    loop {
                        inflight.wait_idle().await;
                        // Let hyper finish writing the last response.
                        tokio::task::yield_now().await;
                        if inflight.count() == 0 { break; }
                    }
                };
                tokio::select! {
                    r = &mut conn => { log_conn_end(&meta, r.err()); drop(req); return; }
                    _ = idle => {}
                }
                match conn.into_parts() {
                    Some(parts) => {
                        // hyper's unparsed bytes came before what the
                        // layers under it still hold.
                        let (downstream, pre) = parts.io.into_inner().into_parked();
                        let mut unread = parts.read_buf.to_vec();
                        unread.extend_from_slice(&pre);
                        req.answer(Parked::Http1 { meta, downstream, unread: Bytes::from(unread) });
                    }
                    None => { req.answer(Parked::Draining); }
                }
                return;
        },
    }
    if draining {
        // Finish the in-flight request, then close (Connection: close).
        Pin::new(&mut conn).graceful_shutdown();
    }
    let r = conn.await;
    log_conn_end(&meta, r.err());
}

/// HTTP/2 behind the frame shim (decisions 0060, 0062): `resume` is the
/// carried state of a connection moved from the previous process.
pub(crate) async fn serve_http2<I: ParkableIo>(
    io: PrefixedIo<I>,
    meta: ConnMeta,
    shared: Arc<Shared>,
    mut park: oneshot::Receiver<ParkRequest>,
    resume: Option<ConnState>,
) {
    let rt = shared.store.snapshot().runtime.clone();
    let svc = http_service(meta.clone(), &shared, None);
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(rt.h2_max_concurrent_streams)
        .max_header_list_size(rt.max_header_bytes as u32);
    // Drained connections end while clients may still be sending streams:
    // close lingering, or a reset would hide the GOAWAY from them.
    let io = crate::linger::Lingering::new(io);
    let resumed = resume.is_some();
    let (shim, handle) = match resume {
        None => Shim::new(io),
        Some(state) => match Shim::resumed(io, state) {
            Some(s) => s,
            None => {
                tracing::error!(
                    conn = meta.id,
                    "moved HTTP/2 connection cannot be recreated; closed"
                );
                return;
            }
        },
    };
    let mut conn = Box::pin(builder.serve_connection(TokioIo::new(shim), svc));
    let mut drain = shared.lifecycle.drain_signal();
    tokio::select! {
        r = conn.as_mut() => {
            if resumed && r.is_err() && handle.ignored_reset() {
                // `h2` refused the block (GOAWAY, last stream 0: the
                // request is unprocessed and may be re-sent).
                shared.metrics.h2_handoff("failed_after_move");
                tracing::info!(conn = meta.id, peer = %meta.peer, "moved HTTP/2 connection ended: the client's HPACK encoder ignored SETTINGS_HEADER_TABLE_SIZE");
            }
            log_conn_end(&meta, r.err());
            return;
        }
        _ = crate::lifecycle::wait_until(&mut drain, |d| *d) => {}
        req = &mut park => if let Ok(req) = req {
            match migrate(conn.as_mut(), &handle, &mut drain, req.http2_until).await {
                Migration::Ended(r) => {
                    log_conn_end(&meta, r.err());
                    return;
                }
                Migration::Move => {
                    if let Some(t) = handle.take() {
                        // hyper's connection holds no byte of it now.
                        drop(conn);
                        let (downstream, pre) = t.io.into_inner().into_parked();
                        let mut unread = t.unread;
                        unread.extend_from_slice(&pre);
                        shared.metrics.h2_handoff("moved");
                        req.answer(Parked::Http2 {
                            meta,
                            downstream,
                            unread: Bytes::from(unread),
                            state: Bytes::from(t.state),
                        });
                        return;
                    }
                }
                Migration::Drain(reason) => {
                    tracing::debug!(conn = meta.id, reason, "HTTP/2 connection drains instead of moving");
                }
            }
            shared.metrics.h2_handoff("drained");
            req.answer(Parked::Draining);
        },
    }
    conn.as_mut().graceful_shutdown();
    let r = conn.await;
    log_conn_end(&meta, r.err());
}

/// How a park request on an HTTP/2 connection ended.
pub(crate) enum Migration {
    /// The connection ended on its own first.
    Ended(Result<(), hyper::Error>),
    /// At the safe point.
    Move,
    /// It cannot move: GOAWAY and drain.
    Drain(&'static str),
}

/// Drives the connection to its safe point: empties the client's HPACK
/// table, waits for no stream open — until `until`, or the process's drain,
/// whichever first; `None` (a peer that cannot take HTTP/2) drains at once.
pub(crate) async fn migrate<C, T>(
    mut conn: Pin<&mut C>,
    handle: &ShimHandle<T>,
    drain: &mut tokio::sync::watch::Receiver<bool>,
    until: Option<std::time::Instant>,
) -> Migration
where
    C: std::future::Future<Output = Result<(), hyper::Error>> + ?Sized,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let Some(until) = until else {
        return Migration::Drain("the next process cannot take HTTP/2");
    };
    if let Verdict::Drain(reason) = handle.verdict() {
        return Migration::Drain(reason);
    }
    handle.start_migration();
    let deadline = tokio::time::sleep_until(tokio::time::Instant::from_std(until));
    tokio::pin!(deadline);
    let draining = crate::lifecycle::wait_until(drain, |d| *d);
    tokio::pin!(draining);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = conn.as_mut().poll(cx) {
            return Poll::Ready(Migration::Ended(r));
        }
        if handle.poll_drive(cx).is_err() {
            // The connection sees the same error on its next write.
            return Poll::Ready(Migration::Drain("write failed"));
        }
        match handle.verdict() {
            Verdict::Move => return Poll::Ready(Migration::Move),
            Verdict::Drain(reason) => return Poll::Ready(Migration::Drain(reason)),
            Verdict::Wait => {}
        }
        if deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Migration::Drain("a stream outlived the handoff timeout"));
        }
        if draining.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Migration::Drain("the process drains"));
        }
        Poll::Pending
    })
    .await
}

fn log_conn_end(meta: &ConnMeta, err: Option<hyper::Error>) {
    if let Some(e) = err {
        tracing::debug!(conn = meta.id, peer = %meta.peer, error = %e, "connection ended with an error");
    }
}
