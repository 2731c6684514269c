//! Process assembly: build the shared state, bind (or adopt) listeners,
//! start the admin server and the config watcher, serve, drain.
//!
//! [`start`] returns a [`Running`] handle with the bound addresses, which is
//! what the binary (through [`run`], or [`crate::process::run`] with the
//! hot upgrade) and the in-process tests both use.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{Admin, LogLevelHook, ReadinessHook};
use crate::config::store::{ConfigStore, TlsHook, watch_file};
use crate::config::{ConfigError, Snapshot};
use crate::http_proxy::Shared;
use crate::lifecycle::{Lifecycle, Phase};
use crate::listener::{TlsTerminator, bind, serve_listener};
use crate::metrics::Metrics;
use crate::upstream::Originator;

/// Why the sidecar could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot bind listener {name} on {addr}: {source}")]
    Bind {
        name: String,
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// How to start.
#[derive(Default)]
pub struct StartOptions {
    /// Watch this file and apply it when it changes.
    pub watch: Option<(PathBuf, Duration)>,
    /// Listening sockets adopted from elsewhere (the handoff), by listener
    /// name; used instead of binding.
    pub inherited: HashMap<String, std::net::TcpListener>,
    /// Admin listener adopted from elsewhere.
    pub inherited_admin: Option<std::net::TcpListener>,
    pub tls: Option<Arc<dyn TlsTerminator>>,
    /// The TLS layer's mesh mTLS originator for clusters with `mtls` and its
    /// check of every later snapshot's `tls` section. Both are installed
    /// before the first listener accepts: a process that takes over serves
    /// its first connection with them (see `MeshTls::plug`).
    pub originator: Option<Arc<dyn Originator>>,
    pub tls_hook: Option<TlsHook>,
    pub log_level: Option<LogLevelHook>,
    pub metrics: Option<Arc<Metrics>>,
    /// Where access-log lines go; stdout when `None` (tests read them).
    pub access_log: Option<Box<dyn std::io::Write + Send>>,
    /// Start in [`Phase::Adopting`] instead of `Serving` (the new process of
    /// a handoff; the handoff moves it to `Serving` when complete).
    pub adopting: bool,
}

impl std::fmt::Debug for StartOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartOptions")
            .field("watch", &self.watch)
            .finish_non_exhaustive()
    }
}

struct ListenerTask {
    configured: SocketAddr,
    bound: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    /// A clone of the listening socket, for the handoff to send.
    socket: std::net::TcpListener,
}

/// A started sidecar.
pub struct Running {
    pub shared: Arc<Shared>,
    pub admin_addr: SocketAddr,
    pub admin: Admin,
    listeners: Arc<std::sync::Mutex<HashMap<String, ListenerTask>>>,
    stop_tx: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    /// A clone of the admin listening socket, for the handoff to send.
    admin_socket: std::net::TcpListener,
    tls: Option<Arc<dyn TlsTerminator>>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("admin_addr", &self.admin_addr)
            .finish_non_exhaustive()
    }
}

fn start_listener(
    name: &str,
    configured: SocketAddr,
    std_listener: std::net::TcpListener,
    shared: &Arc<Shared>,
    tls: &Option<Arc<dyn TlsTerminator>>,
) -> std::io::Result<ListenerTask> {
    let bound = std_listener.local_addr()?;
    let socket = std_listener.try_clone()?;
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn({
        let shared = shared.clone();
        let name: Arc<str> = Arc::from(name);
        let tls = tls.clone();
        async move {
            if let Err(e) = serve_listener(std_listener, name.clone(), shared, tls, stop_rx).await {
                tracing::error!(listener = %name, error = %e, "listener failed");
            }
        }
    });
    Ok(ListenerTask {
        configured,
        bound,
        stop,
        task,
        socket,
    })
}

/// Bind listeners for `snapshot` that are not already running; stop the
/// ones that disappeared or moved.
fn reconcile_listeners(
    snapshot: &Snapshot,
    running: &mut HashMap<String, ListenerTask>,
    inherited: &mut HashMap<String, std::net::TcpListener>,
    shared: &Arc<Shared>,
    tls: &Option<Arc<dyn TlsTerminator>>,
) -> Result<(), StartError> {
    let wanted: HashMap<&str, SocketAddr> = snapshot
        .listeners
        .iter()
        .map(|l| (l.name.as_str(), l.address))
        .collect();
    running.retain(|name, t| {
        let keep = wanted.get(name.as_str()) == Some(&t.configured);
        if !keep {
            tracing::info!(listener = %name, "listener removed or moved; closing it");
            let _ = t.stop.send(true);
        }
        keep
    });
    for l in &snapshot.listeners {
        if running.contains_key(&l.name) {
            continue;
        }
        let sock = match inherited.remove(&l.name) {
            Some(s) => s,
            None => bind(l.address).map_err(|source| StartError::Bind {
                name: l.name.clone(),
                addr: l.address,
                source,
            })?,
        };
        let t = start_listener(&l.name, l.address, sock, shared, tls).map_err(|source| {
            StartError::Bind {
                name: l.name.clone(),
                addr: l.address,
                source,
            }
        })?;
        running.insert(l.name.clone(), t);
    }
    Ok(())
}

/// Start serving `snapshot`. Must be called inside a tokio runtime.
pub async fn start(snapshot: Snapshot, mut opts: StartOptions) -> Result<Running, StartError> {
    let metrics = opts
        .metrics
        .take()
        .unwrap_or_else(|| Arc::new(Metrics::new()));
    let lifecycle = Lifecycle::new(metrics.clone());
    if opts.adopting {
        // Taking over a serving socket: the admin port may answer probes
        // before start-up finishes, and the old process still serves.
        lifecycle.set(Phase::Adopting);
    }
    let store = Arc::new(ConfigStore::new(&snapshot, metrics.clone())?);
    if let Some(o) = opts.originator.take() {
        store.set_originator(o);
    }
    if let Some(hook) = opts.tls_hook.take() {
        store.set_tls_hook(hook);
    }
    let shared = Shared::new(
        store.clone(),
        metrics,
        lifecycle.clone(),
        opts.access_log.take(),
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();

    // Admin first, so probes answer (503) while starting.
    let admin_std = match opts.inherited_admin.take() {
        Some(s) => s,
        None => bind(snapshot.admin.address).map_err(|source| StartError::Bind {
            name: "admin".into(),
            addr: snapshot.admin.address,
            source,
        })?,
    };
    let admin_addr = admin_std.local_addr().map_err(|source| StartError::Bind {
        name: "admin".into(),
        addr: snapshot.admin.address,
        source,
    })?;
    let admin_socket = admin_std.try_clone().map_err(|source| StartError::Bind {
        name: "admin".into(),
        addr: snapshot.admin.address,
        source,
    })?;
    let admin = Admin {
        shared: shared.clone(),
        log_level: opts.log_level.clone(),
        readiness: Default::default(),
        handoff: Default::default(),
        offload: Default::default(),
    };
    let admin_listener =
        tokio::net::TcpListener::from_std(admin_std).map_err(|source| StartError::Bind {
            name: "admin".into(),
            addr: snapshot.admin.address,
            source,
        })?;
    // Admin is tasks[0] (see `stop_admin`).
    tasks.push(tokio::spawn(admin.clone().serve(admin_listener)));

    // The event-loop lag probe runs on the runtime that serves traffic;
    // without it the sidecar still serves, it just cannot say how responsive
    // it is.
    match crate::loop_lag::spawn(
        shared.metrics.event_loop_lag.clone(),
        crate::loop_lag::INTERVAL,
    ) {
        Ok(task) => tasks.push(task),
        Err(e) => tracing::warn!(error = %e, "cannot start the event-loop lag probe"),
    }

    let mut running = HashMap::new();
    reconcile_listeners(
        &snapshot,
        &mut running,
        &mut opts.inherited,
        &shared,
        &opts.tls,
    )?;
    let listeners = Arc::new(std::sync::Mutex::new(running));

    // Reconcile listeners after every applied snapshot.
    tasks.push(tokio::spawn({
        let shared = shared.clone();
        let listeners = listeners.clone();
        let tls = opts.tls.clone();
        let mut versions = store.subscribe();
        let mut stop = stop_rx.clone();
        async move {
            loop {
                tokio::select! {
                    r = versions.changed() => if r.is_err() { return },
                    _ = crate::lifecycle::wait_until(&mut stop, |s| *s) => return,
                }
                let snap = shared.store.snapshot();
                let mut l = listeners.lock().unwrap_or_else(|e| e.into_inner());
                if let Err(e) = reconcile_listeners(&snap, &mut l, &mut HashMap::new(), &shared, &tls) {
                    tracing::error!(error = %e, "listener update failed; other listeners keep serving");
                }
            }
        }
    }));

    if let Some((path, interval)) = opts.watch.take() {
        tasks.push(tokio::spawn(watch_file(
            store.clone(),
            path,
            interval,
            stop_rx.clone(),
        )));
    }

    lifecycle.set(if opts.adopting {
        Phase::Adopting
    } else {
        Phase::Serving
    });
    Ok(Running {
        shared,
        admin_addr,
        admin,
        listeners,
        stop_tx,
        tasks,
        admin_socket,
        tls: opts.tls,
    })
}

impl Running {
    /// The bound address of listener `name` (port 0 resolved).
    pub fn addr(&self, name: &str) -> Option<SocketAddr> {
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|t| t.bound)
    }

    /// Clones of every listening socket by name (for the handoff to send
    /// with SCM_RIGHTS; the accept loops keep running on the originals).
    pub fn listening_sockets(&self) -> std::io::Result<HashMap<String, std::net::TcpListener>> {
        let l = self.listeners.lock().unwrap_or_else(|e| e.into_inner());
        l.iter()
            .map(|(n, t)| Ok((n.clone(), t.socket.try_clone()?)))
            .collect()
    }

    /// A clone of the admin listening socket (for the handoff).
    pub fn admin_socket(&self) -> std::io::Result<std::net::TcpListener> {
        self.admin_socket.try_clone()
    }

    /// The TLS layer this process serves with, if any (the handoff resumes
    /// adopted connections with it).
    pub fn tls(&self) -> Option<Arc<dyn TlsTerminator>> {
        self.tls.clone()
    }

    /// Stop the accept loops but keep the listening sockets open (the
    /// handoff: another process accepts from the same sockets now, and
    /// nothing queued in the backlog is lost). Connections keep running.
    pub fn pause_accepting(&self) {
        for t in self
            .listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            let _ = t.stop.send(true);
        }
    }

    /// Restart accept loops stopped by [`Self::pause_accepting`] (a failed
    /// handoff) on the same sockets.
    pub fn resume_accepting(&self) -> std::io::Result<()> {
        // Called from the handoff's thread: the accept loops belong on the
        // runtime that serves.
        let _rt = self.shared.runtime.enter();
        let mut l = self.listeners.lock().unwrap_or_else(|e| e.into_inner());
        for (name, t) in l.iter_mut() {
            if *t.stop.borrow() {
                let sock = t.socket.try_clone()?;
                *t = start_listener(name, t.configured, sock, &self.shared, &self.tls)?;
            }
        }
        Ok(())
    }

    /// Stop accepting on the admin socket (after a handoff the new process
    /// answers probes on the same socket; a draining old one would say 503).
    /// Admin requests already accepted finish.
    pub fn stop_admin(&self) {
        if let Some(admin) = self.tasks.first() {
            admin.abort();
        }
    }

    /// Add a readiness condition (see [`ReadinessHook`]).
    pub fn add_readiness(&self, hook: ReadinessHook) {
        self.admin
            .readiness
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(hook);
    }

    /// Drain: stop accepting, let in-flight work finish within `grace`,
    /// then stop everything.
    pub async fn drain(self, grace: Duration) {
        let lc = &self.shared.lifecycle;
        if lc.current() < Phase::Draining {
            lc.set(Phase::Draining);
        }
        let deadline = tokio::time::Instant::now() + grace;
        let _ = tokio::time::timeout_at(deadline, self.shared.registry.wait_empty()).await;
        let left = self.shared.registry.len();
        if left > 0 {
            tracing::warn!(
                connections = left,
                "grace period over; closing remaining connections"
            );
        }
        // Connections that ended with a lingering close (drained HTTP/2)
        // finish it before the process stops, within the same grace.
        let _ = tokio::time::timeout_at(deadline, crate::linger::settled()).await;
        self.stop().await;
    }

    /// Stop now.
    pub async fn stop(self) {
        let _ = self.stop_tx.send(true);
        for (_, t) in self
            .listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
        {
            let _ = t.stop.send(true);
            t.task.abort();
        }
        self.shared.lifecycle.set(Phase::Stopped);
        for t in self.tasks {
            t.abort();
        }
    }
}

/// Serve until SIGTERM/SIGINT or `/shutdown`, then drain.
pub async fn run(snapshot: Snapshot, opts: StartOptions) -> Result<(), StartError> {
    let grace = Duration::from_millis(snapshot.runtime.drain_timeout_ms);
    let running = start(snapshot, opts).await?;
    let lifecycle = running.shared.lifecycle.clone();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {
            tracing::info!("SIGTERM: draining");
        }
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: draining"),
        _ = lifecycle.reached(Phase::Draining) => {}
    }
    running.drain(grace).await;
    Ok(())
}
