//! Glue between the data plane and the TLS layer.
//!
//! [`MeshTls`] is what the data plane holds: it implements the listener's
//! [`TlsTerminator`] hook (inbound), offers [`MeshTls::connect`] for
//! outbound mTLS by destination name, validates and applies the snapshot's
//! `tls` section (the config store's TLS hook), and reports readiness.
//!
//! Wiring (three calls, done where the process is assembled):
//!
//! ```text
//! let tls = MeshTls::from_section(snapshot.tls.as_ref())?;      // before start
//! opts.tls = Some(tls.clone());                                  // StartOptions
//! let running = server::start(snapshot, opts).await?;
//! tls.attach(&running);   // config hook + /ready condition + /metrics families
//! ```
//!
//! A context is rebuilt only when the settings change; certificate rotation
//! within the same settings is the file watcher's / identity client's job,
//! so a snapshot reload never restarts TLS.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwapOption;
use tokio::net::TcpStream;

use super::context::PeerInfo;
use super::identity_client::{RetryPolicy, bootstrap_with};
use super::material::{FileWatcher, Material};
use super::material::{IdentityCarrier, IdentityImportError, IdentityPem};
use super::metrics::TlsMetrics;
use super::settings::{CertSource, TlsMode, TlsSettings};
use super::spiffe::SpiffeId;
use super::{TlsContext, TlsError};
use crate::conn::{BoxIo, PrefixedIo};
use crate::filters::ConnMeta;
use crate::listener::{TlsAccepted, TlsTerminator};
use crate::tls_record::RecordAlignedIo;
use crate::upstream::Originator;

#[derive(Default)]
struct Applied {
    settings: Option<TlsSettings>,
    _watcher: Option<FileWatcher>,
    /// Stops the identity client's renewal task of the previous settings.
    renewal_stop: Option<tokio::sync::watch::Sender<bool>>,
}

/// The TLS layer as the data plane sees it.
pub struct MeshTls {
    current: ArcSwapOption<TlsContext>,
    key_log: Mutex<Option<Arc<dyn rustls::KeyLog>>>,
    mode: std::sync::atomic::AtomicU8,
    applied: Mutex<Applied>,
    metrics: TlsMetrics,
    /// Set while an identity-service bootstrap is in flight (not ready).
    pending: Mutex<Option<String>>,
    /// Woken when a context is installed: outbound connections and inbound
    /// handshakes wait on it for the first certificate.
    installed: tokio::sync::Notify,
    /// This layer itself, for the `'static` inbound handshake future that
    /// may wait for the first certificate.
    me: std::sync::Weak<MeshTls>,
    /// The operator's re-issue trigger from the `tls` section, kept out of
    /// the settings compared for a rebuild: a trust change wakes the
    /// certificate client, it does not restart TLS.
    reissue: tokio::sync::watch::Sender<Option<baton_config::tls::Reissue>>,
    /// The trust generation of the certificate held (the config stream
    /// reports it to the operator).
    held: Arc<tokio::sync::watch::Sender<Option<String>>>,
    /// The config stream's connection to the operator, on which the
    /// certificate client sends its requests while it is open.
    link: crate::operator_link::OperatorLink,
}

/// How long an mTLS connection waits for the first certificate while the
/// identity bootstrap is in flight. A config that first requires mTLS
/// between two Pods reaches both sidecars at about the same time, possibly
/// before either holds its first (or re-bootstrapped) certificate: the
/// client's outbound connection and the server's inbound handshake both
/// wait, which turns that race into a few milliseconds of latency instead
/// of a 503 (Envoy's cluster and listener warming on their SDS secrets play
/// the same role).
pub const FIRST_CERTIFICATE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl std::fmt::Debug for MeshTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshTls")
            .field("mode", &self.mode())
            .field("active", &self.current.load().is_some())
            .finish()
    }
}

const MODE_NONE: u8 = 0;

fn mode_code(m: TlsMode) -> u8 {
    match m {
        TlsMode::Strict => 1,
        TlsMode::Permissive => 2,
        TlsMode::Disabled => 3,
    }
}

impl MeshTls {
    pub fn new(metrics: TlsMetrics) -> Arc<Self> {
        Arc::new_cyclic(|me| MeshTls {
            me: me.clone(),
            current: ArcSwapOption::empty(),
            key_log: Mutex::new(None),
            mode: MODE_NONE.into(),
            applied: Mutex::new(Applied::default()),
            metrics,
            pending: Mutex::new(None),
            installed: tokio::sync::Notify::new(),
            reissue: tokio::sync::watch::channel(None).0,
            held: Arc::new(tokio::sync::watch::channel(None).0),
            link: crate::operator_link::OperatorLink::default(),
        })
    }

    /// The slot the config stream publishes its operator connection in
    /// (the certificate client sends on it: decision 0056).
    pub fn operator_link(&self) -> crate::operator_link::OperatorLink {
        self.link.clone()
    }

    /// The trust generation of the certificate held, as it changes
    /// (`None`: none held, or an operator that names no generation).
    pub fn certificate_generation(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.held.subscribe()
    }

    /// Builds from the initial snapshot's `tls` section (process metrics).
    pub fn from_section(section: Option<&TlsSettings>) -> Result<Arc<Self>, TlsError> {
        let tls = MeshTls::new(TlsMetrics::global());
        tls.apply(section)?;
        Ok(tls)
    }

    /// The policy mode in force (`None` = no `tls` section).
    pub fn mode(&self) -> Option<TlsMode> {
        match self.mode.load(std::sync::atomic::Ordering::Acquire) {
            1 => Some(TlsMode::Strict),
            2 => Some(TlsMode::Permissive),
            3 => Some(TlsMode::Disabled),
            _ => None,
        }
    }

    pub fn context(&self) -> Option<Arc<TlsContext>> {
        self.current.load_full()
    }

    /// Validates `section` and, if the settings changed, builds and swaps a
    /// new context. On error nothing changes.
    pub fn apply(self: &Arc<Self>, section: Option<&TlsSettings>) -> Result<(), TlsError> {
        let mut settings: Option<TlsSettings> = section.cloned();
        if let Some(s) = &settings {
            super::settings::compile(s)?;
        }
        // The trigger goes to the certificate client; the rest decides
        // whether the context is rebuilt.
        let trigger = settings.as_mut().and_then(|s| s.reissue.take());
        self.reissue.send_if_modified(|t| {
            let changed = *t != trigger;
            *t = trigger;
            changed
        });
        let mut applied = self.applied.lock().unwrap_or_else(|p| p.into_inner());
        // Failed applies never update `applied`, so equal settings mean the
        // context (or its pending bootstrap) is already the right one.
        if applied.settings == settings {
            return Ok(());
        }
        let Some(s) = settings else {
            *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = None;
            self.current.store(None);
            self.mode
                .store(MODE_NONE, std::sync::atomic::Ordering::Release);
            *applied = Applied::default();
            return Ok(());
        };
        let runtime = tokio::runtime::Handle::try_current().ok();
        // A bootstrap of replaced settings no longer gates readiness.
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = None;
        match (&s.source, s.mode) {
            (_, TlsMode::Disabled) => {
                self.current.store(None);
                *applied = Applied {
                    settings: Some(s.clone()),
                    ..Default::default()
                };
            }
            (Some(CertSource::Files { .. }), _) => {
                let ctx = TlsContext::from_files(&s, self.metrics.clone())?;
                let watcher = runtime.as_ref().and_then(|rt| {
                    let _guard = rt.enter();
                    ctx.watch_files()
                });
                self.install(ctx);
                *applied = Applied {
                    settings: Some(s.clone()),
                    _watcher: watcher,
                    renewal_stop: None,
                };
            }
            (Some(CertSource::IdentityService { .. }), _) => {
                let Some(rt) = runtime else {
                    return Err(TlsError::NoRuntime);
                };
                let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
                *self.pending.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some("waiting for the first certificate from the identity service".into());
                let metrics = self.metrics.clone();
                let settings = s.clone();
                let (trigger, held, link) = (
                    self.reissue.subscribe(),
                    self.held.clone(),
                    self.link.clone(),
                );
                // The task holds only a Weak: dropping the MeshTls ends it.
                let this = Arc::downgrade(self);
                rt.spawn(async move {
                    // Until the first certificate arrives (or these settings
                    // are replaced): each round retries with back-off inside
                    // `bootstrap`, rounds are 30 s apart.
                    let mut stop = stop_rx.clone();
                    loop {
                        let r = bootstrap_with(
                            &settings,
                            metrics.clone(),
                            stop_rx.clone(),
                            RetryPolicy::default(),
                            trigger.clone(),
                            held.clone(),
                            link.clone(),
                        )
                        .await;
                        let Some(this) = this.upgrade() else { return };
                        match r {
                            Ok(ctx) => {
                                *this.pending.lock().unwrap_or_else(|p| p.into_inner()) = None;
                                this.install(ctx);
                                return;
                            }
                            Err(e) => {
                                tracing::error!(error = %e, "identity bootstrap failed; retrying");
                                // Serving with a certificate carried over by
                                // the handoff: still ready, keep trying.
                                if this.current.load().is_none() {
                                    *this.pending.lock().unwrap_or_else(|p| p.into_inner()) =
                                        Some(format!("identity bootstrap failed: {e}"));
                                }
                            }
                        }
                        drop(this);
                        tokio::select! {
                            _ = tokio::time::sleep(std::time::Duration::from_secs(30)) => {}
                            _ = stop.wait_for(|s| *s) => return,
                        }
                    }
                });
                if let Some(old) = applied.renewal_stop.take() {
                    let _ = old.send(true);
                }
                *applied = Applied {
                    settings: Some(s.clone()),
                    _watcher: None,
                    renewal_stop: Some(stop_tx),
                };
            }
            (None, mode) => return Err(TlsError::NoSource(mode)),
        }
        self.mode
            .store(mode_code(s.mode), std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// The handoff's key log (`SecretCapture`), installed on the current and
    /// every future context.
    pub fn set_key_log(&self, key_log: Arc<dyn rustls::KeyLog>) {
        *self.key_log.lock().unwrap_or_else(|p| p.into_inner()) = Some(key_log);
        if let Some(ctx) = self.current.load_full() {
            self.install_key_log(&ctx);
        }
    }

    /// Makes `ctx` the serving context and wakes connections waiting for
    /// a certificate.
    fn install(&self, ctx: Arc<TlsContext>) {
        self.install_key_log(&ctx);
        self.current.store(Some(ctx));
        self.installed.notify_waiters();
    }

    /// Resolves once a certificate is held; while none is and an identity
    /// bootstrap is in flight, waits for it up to [`FIRST_CERTIFICATE_WAIT`]
    /// (clusters await this before opening the upstream socket).
    pub async fn wait_for_certificate(&self) -> Result<(), TlsError> {
        self.context_or_wait().await.map(|_| ())
    }

    /// The serving context; while none exists and an identity bootstrap is
    /// in flight, waits for it up to [`FIRST_CERTIFICATE_WAIT`].
    async fn context_or_wait(&self) -> Result<Arc<TlsContext>, TlsError> {
        let deadline = tokio::time::Instant::now() + FIRST_CERTIFICATE_WAIT;
        loop {
            let notified = self.installed.notified();
            tokio::pin!(notified);
            // Registered before the check, so an install between the check
            // and the wait still wakes this connection.
            notified.as_mut().enable();
            if let Some(ctx) = self.current.load_full() {
                return Ok(ctx);
            }
            let Some(reason) = self
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
            else {
                return Err(TlsError::Disabled);
            };
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(TlsError::NoCertificate(reason));
            }
        }
    }

    fn install_key_log(&self, ctx: &TlsContext) {
        if let Some(k) = self
            .key_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            && let Err(e) = ctx.set_key_log(k)
        {
            tracing::error!(error = %e, "cannot install the handoff key log");
        }
    }

    /// The offload engine's readiness alone (`Ok` while no context is built
    /// yet: the engine is selected with the context).
    pub fn offload_readiness(&self) -> Result<(), String> {
        match self.current.load().as_ref() {
            Some(ctx) => ctx.offload().readiness(),
            None => Ok(()),
        }
    }

    /// `Err(reason)` while TLS cannot serve as configured.
    /// Only a sidecar holding no certificate at all waits on its bootstrap:
    /// after a settings change the certificate it holds keeps serving until
    /// the new one arrives, so the Pod stays Ready (dropping out of every
    /// client's endpoints for a policy edit would be an outage of its own).
    pub fn readiness(&self) -> Result<(), String> {
        match self.current.load().as_ref() {
            Some(ctx) => ctx.readiness(),
            None => match self
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
            {
                Some(p) => Err(p.clone()),
                None => Ok(()),
            },
        }
    }

    /// Outbound mTLS to `destination` (a cluster name in
    /// `identity.expected_peers`), over an already connected socket.
    pub async fn connect(
        &self,
        tcp: TcpStream,
        destination: &str,
        alpn: Option<Vec<Vec<u8>>>,
    ) -> Result<(BoxIo, PeerInfo), TlsError> {
        self.connect_to(tcp, destination, None, alpn).await
    }

    /// [`MeshTls::connect`] with an explicit expected identity (a cluster's
    /// `mtls.identity`), falling back to `expected_peers[destination]`.
    pub async fn connect_to(
        &self,
        tcp: TcpStream,
        destination: &str,
        identity: Option<&str>,
        alpn: Option<Vec<Vec<u8>>>,
    ) -> Result<(BoxIo, PeerInfo), TlsError> {
        let ctx = self.context_or_wait().await?;
        let expected: SpiffeId = identity
            .or_else(|| ctx.settings().expected_identity(destination))
            .ok_or_else(|| {
                TlsError::Io(std::io::Error::other(format!(
                    "no expected identity for destination {destination:?}: set the cluster's \
                     mtls.identity or tls.identity.expected_peers[{destination:?}]"
                )))
            })?
            .parse()
            .map_err(|e| TlsError::Io(std::io::Error::other(format!("{e}"))))?;
        // Record-aligned reads, as inbound: the handoff can stop the session
        // at a record boundary and move it with its secrets.
        let (stream, peer) = ctx
            .connector()
            .connect(RecordAlignedIo::new(tcp), &expected, alpn)
            .await?;
        Ok((Box::new(stream), peer))
    }

    /// Plugs this layer into a data plane about to start: the listeners'
    /// TLS terminator, the clusters' mesh mTLS originator and the check of
    /// every later snapshot's `tls` section. All three are in place before
    /// the first connection is accepted, which matters for a process taking
    /// over: adopted sockets are served from the moment it starts.
    pub fn plug(self: &Arc<Self>, opts: &mut crate::server::StartOptions) {
        opts.tls = Some(self.clone());
        opts.originator = Some(Arc::new(Outbound(self.clone())));
        let me = self.clone();
        opts.tls_hook = Some(Arc::new(move |section| Ok(me.apply(section)?)));
    }

    /// Installs the readiness condition, the offload report and the metrics
    /// on a started data plane (after [`MeshTls::plug`]).
    pub fn attach(self: &Arc<Self>, running: &crate::server::Running) {
        let me = self.clone();
        running
            .admin
            .readiness
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::new(move || me.readiness()));
        let me = self.clone();
        *running
            .admin
            .offload
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(move || {
            let report = me
                .current
                .load()
                .as_ref()
                .map(|ctx| ctx.offload().report())
                .unwrap_or_default();
            serde_json::to_value(report).unwrap_or_default()
        }));
        let metrics = self.metrics.clone();
        running
            .shared
            .metrics
            .register(move |r| metrics.register_into(r));
    }
}

impl IdentityCarrier for MeshTls {
    fn export(&self) -> Option<IdentityPem> {
        let (cert_chain, key, trust_bundle) = self.current.load().as_ref()?.material().to_pem();
        Some(IdentityPem {
            cert_chain,
            key,
            trust_bundle,
        })
    }

    /// First the inherited snapshot's `tls` section (the policy the old
    /// process served under), so this process's first connection is served
    /// under it; then the carried certificate, used only while this process
    /// waits for its identity service (a `files` source, or a certificate
    /// already issued, wins): it serves new handshakes until the bootstrap
    /// replaces it.
    fn import(
        &self,
        config: &serde_json::Value,
        pem: Option<&IdentityPem>,
    ) -> Result<bool, IdentityImportError> {
        // The process serves the inherited snapshot only when it reads as
        // one (`process::inherited_snapshot`); otherwise it serves its own,
        // whose policy is already in force here.
        if let Ok(snapshot) = serde_json::from_value::<crate::config::Snapshot>(config.clone()) {
            let Some(me) = self.me.upgrade() else {
                return Err(IdentityImportError::Policy("the TLS layer is gone".into()));
            };
            me.apply(snapshot.tls.as_ref())
                .map_err(|e| IdentityImportError::Policy(e.to_string()))?;
        }
        let Some(pem) = pem else {
            return Ok(false);
        };
        let applied = self.applied.lock().unwrap_or_else(|p| p.into_inner());
        let Some(settings) = applied.settings.as_ref() else {
            return Ok(false);
        };
        let waiting = matches!(settings.source, Some(CertSource::IdentityService { .. }))
            && self.current.load().is_none();
        if !waiting {
            return Ok(false);
        }
        let material = Material::from_pem(
            pem.cert_chain.as_bytes(),
            pem.key.as_bytes(),
            pem.trust_bundle.as_bytes(),
        )
        .map_err(|e| IdentityImportError::Unreadable(e.to_string()))?;
        if let Ok((_, not_after)) = material.validity()
            && not_after <= std::time::SystemTime::now()
        {
            return Err(IdentityImportError::Expired);
        }
        let ctx = TlsContext::with_selected_offload(settings, material, self.metrics.clone())
            .map_err(|e| IdentityImportError::Unusable(e.to_string()))?;
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.install(ctx);
        Ok(true)
    }
}

/// [`MeshTls`] as the clusters' [`Originator`] (owns an `Arc` so the
/// handshake future is `'static`).
struct Outbound(Arc<MeshTls>);

impl Originator for Outbound {
    fn originate(
        &self,
        tcp: TcpStream,
        destination: Arc<str>,
        identity: Option<Arc<str>>,
        alpn: &'static [u8],
    ) -> Pin<Box<dyn Future<Output = std::io::Result<BoxIo>> + Send>> {
        let tls = self.0.clone();
        // Raw TCP offers no ALPN at all (not the policy's list): the peer
        // must detect what the bytes are, as it would for plaintext.
        let alpn = Some(if alpn.is_empty() {
            Vec::new()
        } else {
            vec![alpn.to_vec()]
        });
        Box::pin(async move {
            tls.connect_to(tcp, &destination, identity.as_deref(), alpn)
                .await
                .map(|(io, _peer)| io)
                .map_err(|e| std::io::Error::other(format!("mesh mTLS to {destination}: {e}")))
        })
    }
    fn ready(&self) -> Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>> {
        let tls = self.0.clone();
        Box::pin(async move {
            tls.wait_for_certificate()
                .await
                .map_err(|e| std::io::Error::other(format!("mesh mTLS: {e}")))
        })
    }
}

/// The concrete type behind the `BoxIo` that [`MeshTls`] returns for an
/// inbound TLS connection: what [`super::detach`] recognizes before calling
/// `into_parts()` and `dangerous_extract_secrets()`.
pub type MeshServerStream = super::context::ServerTlsStream<RecordAlignedIo<PrefixedIo<TcpStream>>>;

/// The concrete type behind the `BoxIo` of an originated (outbound) mesh
/// mTLS session, which [`super::detach`] recognizes in the same way.
pub type MeshClientStream = super::context::ClientTlsStream<RecordAlignedIo<TcpStream>>;

impl TlsTerminator for MeshTls {
    fn accept(
        &self,
        io: PrefixedIo<TcpStream>,
        mut meta: ConnMeta,
    ) -> Pin<Box<dyn Future<Output = TlsAccepted> + Send>> {
        let me = self.me.upgrade();
        Box::pin(async move {
            // A peer's config can require mTLS toward this Pod before this
            // sidecar's first certificate arrived (a Strict policy applied
            // to both at once): hold the handshake for the bootstrap, as
            // outbound connections do, instead of refusing it.
            let Some(me) = me else {
                return Err(std::io::Error::other("TLS layer dropped"));
            };
            let ctx = match me.context_or_wait().await {
                Ok(ctx) => ctx,
                Err(e) => {
                    me.metrics.handshake("server", e.metric_label());
                    return Err(std::io::Error::other(format!("mesh mTLS accept: {e}")));
                }
            };
            // Record-aligned reads let the handoff stop at a record boundary
            // and move the connection with its secrets (see crate::tls_record).
            let (stream, peer) = ctx
                .acceptor()
                .accept_tls(RecordAlignedIo::new(io))
                .await
                .map_err(std::io::Error::other)?;
            meta.tls = true;
            meta.peer_identity = peer.identity.map(|i| i.to_string());
            meta.alpn = peer.alpn;
            Ok((Box::new(stream) as BoxIo, meta))
        })
    }

    fn terminates(&self) -> bool {
        matches!(self.mode(), Some(TlsMode::Strict | TlsMode::Permissive))
    }

    fn app_tls_allowed(&self, listener: &str, why: crate::client_hello::AppTls) -> bool {
        match self.mode() {
            Some(TlsMode::Strict) => {
                self.metrics.app_tls_refused.inc();
                tracing::warn!(
                    listener,
                    reason = why.as_str(),
                    "TLS without the mesh marker refused: Strict mTLS"
                );
                false
            }
            Some(TlsMode::Permissive) => {
                self.metrics.app_tls_passthrough.inc();
                true
            }
            _ => true,
        }
    }

    fn plaintext_allowed(&self, listener: &str) -> bool {
        match self.mode() {
            Some(TlsMode::Strict) => {
                self.metrics.plaintext_refused.inc();
                tracing::warn!(listener, "plaintext connection refused: Strict mTLS");
                false
            }
            Some(TlsMode::Permissive) => {
                self.metrics.plaintext_accepted.inc();
                true
            }
            _ => true,
        }
    }
}
