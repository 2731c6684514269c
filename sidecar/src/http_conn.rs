//! The hyper side of a plain or decrypted connection: HTTP/1.1 (the general
//! path the fast path falls back to) and HTTP/2, each with its drain and
//! park handling.
//!
//! Its own module, below both [`crate::listener`] (which detects the
//! protocol and picks a server) and [`crate::h1fast`] (which hands the
//! connection over here when it meets a request it does not take), so the
//! two depend on it and never on each other.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::oneshot;

use crate::body::InFlight;
use crate::conn::{
    FramingGuard, H1Framing, H1Refusal, ParkRequest, ParkableIo, Parked, PrefixedIo,
};
use crate::filters::ConnMeta;
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

pub(crate) async fn serve_http2<I: ParkableIo>(
    io: PrefixedIo<I>,
    meta: ConnMeta,
    shared: Arc<Shared>,
    mut park: oneshot::Receiver<ParkRequest>,
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
    let conn = builder.serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    let mut drain = shared.lifecycle.drain_signal();
    tokio::select! {
        r = &mut conn => { log_conn_end(&meta, r.err()); return; }
        _ = crate::lifecycle::wait_until(&mut drain, |d| *d) => {}
        req = &mut park => {
            // HTTP/2 cannot move mid-connection: GOAWAY and drain.
            if let Ok(req) = req { req.answer(Parked::Draining); }
        }
    }
    conn.as_mut().graceful_shutdown();
    let r = conn.await;
    log_conn_end(&meta, r.err());
}

fn log_conn_end(meta: &ConnMeta, err: Option<hyper::Error>) {
    if let Some(e) = err {
        tracing::debug!(conn = meta.id, peer = %meta.peer, error = %e, "connection ended with an error");
    }
}
