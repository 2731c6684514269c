//! The data plane as the handoff drives it: [`crate::handoff::DataPlane`]
//! for the running server, [`crate::handoff::Serving`] for the state its
//! connection tasks share.
//!
//! This module sits above the server, the listeners and the protocol
//! handlers, and only [`crate::process`] imports it; the handoff mechanism
//! is the `baton-handoff` crate, which cannot import any of them, and the
//! server imports none of the handoff. The handoff's two lifecycle phases
//! are mapped onto the data plane's here.

use std::collections::HashMap;
use std::sync::Arc;

use crate::conn::{
    ConnGuard, ConnKind, ConnRegistry, ParkRequest, ParkableIo, ParkedIo, PrefixedIo,
};
use crate::detect::Protocol;
use crate::filters::ConnMeta;
use crate::handoff::plane::{CarriedCounters, Phase as HandoffPhase};
use crate::handoff::protocol::ConnKind as WireKind;
use crate::handoff::{DataPlane, Resumed, Serving};
use crate::http_proxy::Shared;
use crate::lifecycle::Phase;
use crate::listener::{serve_plain, serve_resumed_http2, until_revoked};
use crate::metrics::ConnLabels;
use crate::server::Running;
use crate::tcp_proxy::{TcpEnd, proxy_resumed};
use crate::upstream::TcpUpstream;

impl DataPlane for Running {
    fn listening_sockets(&self) -> std::io::Result<HashMap<String, std::net::TcpListener>> {
        Running::listening_sockets(self)
    }

    fn admin_socket(&self) -> std::io::Result<std::net::TcpListener> {
        Running::admin_socket(self)
    }

    fn pause_accepting(&self) {
        Running::pause_accepting(self)
    }

    fn resume_accepting(&self) -> std::io::Result<()> {
        Running::resume_accepting(self)
    }

    fn set_phase(&self, phase: HandoffPhase) {
        self.shared.lifecycle.set(match phase {
            HandoffPhase::Serving => Phase::Serving,
            HandoffPhase::HandingOff => Phase::HandingOff,
        });
    }

    fn record_status(&self, status: serde_json::Value) {
        *self.admin.handoff.lock().unwrap_or_else(|e| e.into_inner()) = Some(status);
    }

    fn serving(&self) -> Arc<dyn Serving> {
        self.shared.clone()
    }
}

impl Serving for Shared {
    fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    fn registry(&self) -> &ConnRegistry {
        &self.registry
    }

    fn counters(&self) -> &dyn CarriedCounters {
        &*self.metrics
    }

    fn config(&self) -> serde_json::Value {
        serde_json::to_value(&*self.store.snapshot()).unwrap_or_default()
    }

    fn resume(self: Arc<Self>, r: Resumed) {
        let _rt = self.runtime.enter();
        let shared = self;
        let meta = ConnMeta {
            id: shared.registry.next_id(),
            ..r.meta
        };
        let (guard, park) = shared.registry.register(meta.clone());
        if meta.tls {
            guard.set_tls();
        }
        let up = r.up.map(|u| match u {
            ParkedIo::Tcp(t) => TcpUpstream::Plain(t),
            ParkedIo::Boxed(b) => TcpUpstream::Tls(b),
        });
        match (r.kind, up) {
            (WireKind::Tcp, Some(up)) => {
                guard.set_kind(ConnKind::Tcp);
                let labels = ConnLabels {
                    listener: meta.listener.clone(),
                    protocol: ConnKind::Tcp.as_str(),
                };
                let active = shared
                    .metrics
                    .connections_active
                    .get_or_create(&labels)
                    .clone();
                active.inc();
                tokio::spawn(async move {
                    // The policy in force here governs the adopted
                    // connection as it would a new one: now (the config this
                    // process serves may be newer than the one that admitted
                    // it) and on every later change.
                    let versions = shared.store.subscribe();
                    if revoked_now(&shared, &meta) {
                        active.dec();
                        return;
                    }
                    let (rx, tx) = (&shared.bytes_rx, &shared.bytes_tx);
                    let (a, b) = (&r.to_upstream[..], &r.to_downstream[..]);
                    let end = match r.down {
                        ParkedIo::Tcp(d) => {
                            let p = proxy_resumed(d, up, a, b, &meta, park, rx, tx);
                            until_revoked(p, TcpEnd::Closed, &shared, &meta, versions).await
                        }
                        ParkedIo::Boxed(d) => {
                            let p = proxy_resumed(d, up, a, b, &meta, park, rx, tx);
                            until_revoked(p, TcpEnd::Closed, &shared, &meta, versions).await
                        }
                    };
                    if let TcpEnd::Error(e) = end {
                        tracing::debug!(conn = meta.id, error = %e, "resumed tcp connection ended with an error");
                    }
                    active.dec();
                    drop(guard);
                });
            }
            (WireKind::Http1, _) => {
                let (to_upstream, down) = (r.to_upstream, r.down);
                tokio::spawn(async move {
                    match down {
                        ParkedIo::Tcp(d) => {
                            resume_http1(d, to_upstream, meta, shared, guard, park).await
                        }
                        ParkedIo::Boxed(d) => {
                            resume_http1(d, to_upstream, meta, shared, guard, park).await
                        }
                    }
                });
            }
            (WireKind::Http2, _) => {
                // Checked before anything is served: a state this build
                // cannot continue closes the connection (the old process
                // only sends what it could recreate itself).
                let state = match crate::h2_state::ConnState::decode(&r.to_downstream) {
                    Ok(s) if s.synthetic_preface().is_some() => s,
                    Ok(_) => {
                        tracing::error!(
                            conn = meta.id,
                            "moved HTTP/2 connection with a send window below 65,535; closed"
                        );
                        return;
                    }
                    Err(e) => {
                        tracing::error!(conn = meta.id, error = %e, "moved HTTP/2 connection state unreadable; closed");
                        return;
                    }
                };
                let (to_upstream, down) = (r.to_upstream, r.down);
                tokio::spawn(async move {
                    match down {
                        ParkedIo::Tcp(d) => {
                            let io = PrefixedIo::new(to_upstream, d);
                            serve_resumed_http2(io, meta, shared, guard, park, state).await
                        }
                        ParkedIo::Boxed(d) => {
                            let io = PrefixedIo::new(to_upstream, d);
                            serve_resumed_http2(io, meta, shared, guard, park, state).await
                        }
                    }
                });
            }
            (WireKind::Tcp, None) => tracing::error!(
                conn = meta.id,
                "tcp connection without an upstream socket; closed"
            ),
        }
    }
}

/// Whether the serving config's policy denies an adopted TCP connection
/// (counted and logged when it does).
fn revoked_now(shared: &Shared, meta: &ConnMeta) -> bool {
    let active = shared.store.load();
    let Some(rbac) = active
        .config
        .listener(&meta.listener)
        .and_then(|l| l.rbac.clone())
    else {
        return false;
    };
    let verdict = rbac.check(meta, None);
    if !verdict.denied() {
        return false;
    }
    verdict.record(&shared.metrics, meta, None);
    shared.metrics.local_response("rbac_denied");
    true
}

/// An HTTP/1.1 connection resumed between two requests: the bytes already
/// read from it go in front, then the listener's HTTP/1.1 path serves it.
async fn resume_http1<I: ParkableIo>(
    down: I,
    to_upstream: bytes::Bytes,
    meta: ConnMeta,
    shared: Arc<Shared>,
    guard: ConnGuard,
    park: tokio::sync::oneshot::Receiver<ParkRequest>,
) {
    let io = PrefixedIo::new(to_upstream, down);
    serve_plain(io, meta, Protocol::Http1, shared, guard, park).await
}
