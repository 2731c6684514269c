//! Process wiring: flags, certificates, caches, the two listeners, signals.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use baton_crds::contract::{SYSTEM_NAMESPACE, webhook as names};
use baton_serving::accept::Connections;
use clap::{Parser, ValueEnum};
use tokio::{net::TcpListener, task::JoinHandle};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::{
    admin::{Admin, Draining},
    ca::{self, SelfManaged},
    cache::{Caches, ClusterState},
    error::Result,
    handler::Admission,
    inject::{CaptureMode, InjectConfig, NativeSidecars, default_control_plane_address},
    metrics::{self, Metrics},
    server,
    tls::{self, CertFiles, CertStore},
};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum CaptureArg {
    Transparent,
    Explicit,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum NativeArg {
    Auto,
    Always,
    Never,
}

/// Baton's admission webhook: sidecar injection and CRD validation.
#[derive(Debug, Clone, Parser)]
#[command(name = "baton-webhook", version)]
pub struct Args {
    /// HTTPS address for admission requests.
    #[arg(long, env = "BATON_WEBHOOK_LISTEN", default_value_t = SocketAddr::from(([0, 0, 0, 0], names::PORT)))]
    pub listen: SocketAddr,
    /// Plain-HTTP admin address: /ready, /live, /metrics.
    #[arg(long, env = "BATON_WEBHOOK_ADMIN_LISTEN", default_value_t = SocketAddr::from(([0, 0, 0, 0], names::ADMIN_PORT)))]
    pub admin_listen: SocketAddr,
    /// Serving certificate chain (PEM). With --tls-key, disables the
    /// self-managed CA (cert-manager mode); the files are watched.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Serving private key (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// How often the certificate files are checked for changes.
    #[arg(long, default_value_t = 10)]
    pub cert_reload_interval_secs: u64,
    /// Service name the API server dials (serving-cert SANs).
    #[arg(long, default_value = names::SERVICE)]
    pub service: String,
    /// Namespace of the Service and of the CA Secret.
    #[arg(long, env = "POD_NAMESPACE", default_value = SYSTEM_NAMESPACE)]
    pub namespace: String,
    /// Extra SANs for the serving certificate (IP addresses or DNS names),
    /// e.g. 127.0.0.1 when the API server dials a host process by URL.
    #[arg(long = "extra-san")]
    pub extra_sans: Vec<String>,
    /// Lifetime of self-issued serving certificates (renewed at 2/3).
    #[arg(long, default_value_t = 30 * 86_400)]
    pub serving_cert_validity_secs: u64,
    /// Lifetime of the self-managed CA (rotated at 2/3).
    #[arg(long, default_value_t = 3650)]
    pub ca_validity_days: u64,
    /// MutatingWebhookConfiguration whose caBundle the self-managed CA sets.
    #[arg(long, default_value = names::MUTATING_CONFIGURATION)]
    pub mutating_configuration: String,
    /// ValidatingWebhookConfiguration whose caBundle the self-managed CA sets.
    #[arg(long, default_value = names::VALIDATING_CONFIGURATION)]
    pub validating_configuration: String,
    /// How often caBundle is re-checked in the webhook configurations.
    #[arg(long, default_value_t = 60)]
    pub ca_bundle_sync_secs: u64,
    /// Capture mode for pods without a baton.dev/capture-mode annotation.
    #[arg(long, value_enum, default_value_t = CaptureArg::Transparent)]
    pub capture_mode: CaptureArg,
    /// Native sidecars: from the server version (auto), or forced.
    #[arg(long, value_enum, default_value_t = NativeArg::Auto)]
    pub native_sidecars: NativeArg,
    /// Path of the sidecar binary in the sidecar image (exec hooks).
    #[arg(long, default_value = "/usr/local/bin/baton-sidecar")]
    pub sidecar_binary: String,
    /// imagePullPolicy of injected containers (default: Kubernetes' default).
    #[arg(long, env = "BATON_INJECT_IMAGE_PULL_POLICY")]
    pub image_pull_policy: Option<String>,
    /// Host (DNS name or IP) of the control plane that injected sidecars
    /// reach, set in their environment as BATON_CONTROL_PLANE_ADDRESS.
    /// Default: the operator Service's DNS name,
    /// baton-operator.<namespace>.svc. Clusters without DNS pass the
    /// Service's ClusterIP.
    #[arg(long, env = "BATON_CONTROL_PLANE_ADDRESS")]
    pub control_plane_address: Option<String>,
    /// Injected sidecars take their config from the operator's push stream
    /// (BATON_CONFIG_PUSH). `false`: they run the in-pod default and Routes
    /// and TlsPolicies do not reach them.
    #[arg(long, env = "BATON_INJECT_CONFIG_PUSH", default_value_t = true, action = clap::ArgAction::Set)]
    pub config_push: bool,
    /// The mesh's SPIFFE trust domain, as the operator's --trust-domain:
    /// AuthorizationPolicies naming identities of another are refused.
    #[arg(long, env = "BATON_TRUST_DOMAIN", default_value = baton_crds::contract::identity::DEFAULT_TRUST_DOMAIN)]
    pub trust_domain: String,
    /// Seconds the postStart hook of ordinary-container sidecars (servers
    /// before 1.32) waits for the proxy.
    #[arg(long, default_value_t = 60)]
    pub wait_ready_timeout_secs: u32,
    /// On SIGTERM, how long the webhook keeps serving new connections while
    /// reporting not-ready, so the Service's endpoints and every node's
    /// kube-proxy rules drop this Pod before it stops accepting.
    #[arg(long, default_value_t = 5)]
    pub shutdown_delay_secs: u64,
    /// Longest graceful drain of in-flight reviews after that.
    #[arg(long, default_value_t = 20)]
    pub shutdown_grace_secs: u64,
}

impl Args {
    /// The injection settings these flags describe.
    pub fn inject_config(&self) -> InjectConfig {
        InjectConfig {
            default_capture: match self.capture_mode {
                CaptureArg::Transparent => CaptureMode::Transparent,
                CaptureArg::Explicit => CaptureMode::Explicit,
            },
            native_sidecars: match self.native_sidecars {
                NativeArg::Auto => NativeSidecars::Auto,
                NativeArg::Always => NativeSidecars::Always,
                NativeArg::Never => NativeSidecars::Never,
            },
            sidecar_binary: self.sidecar_binary.clone(),
            wait_ready_timeout_seconds: self.wait_ready_timeout_secs,
            image_pull_policy: self.image_pull_policy.clone(),
            control_plane_address: self
                .control_plane_address
                .clone()
                .filter(|a| !a.trim().is_empty())
                .unwrap_or_else(|| default_control_plane_address(&self.namespace)),
            config_push: self.config_push,
            trust_domain: self.trust_domain.clone(),
            trust_namespace: self.namespace.clone(),
            ..InjectConfig::default()
        }
    }

    fn self_managed(&self) -> SelfManaged {
        let mut cfg = SelfManaged::new(&self.service, &self.namespace, Vec::new());
        for san in &self.extra_sans {
            match san.parse::<IpAddr>() {
                Ok(ip) => cfg.ips.push(ip),
                Err(_) => cfg.dns_names.push(san.clone()),
            }
        }
        cfg.lifetimes.serving = Duration::from_secs(self.serving_cert_validity_secs);
        cfg.lifetimes.ca = Duration::from_secs(self.ca_validity_days * 86_400);
        cfg.sync_interval = Duration::from_secs(self.ca_bundle_sync_secs);
        cfg.mutating_configuration = self.mutating_configuration.clone();
        cfg.validating_configuration = self.validating_configuration.clone();
        cfg
    }
}

/// Installs the tracing subscriber (`RUST_LOG`, default `info`).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).try_init();
}

/// The two listeners of a running webhook (for tests and `run`).
#[derive(Debug)]
pub struct Servers {
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub admission: JoinHandle<()>,
    pub admin: JoinHandle<()>,
}

/// Serves admission (HTTPS, certificate from `store`) and admin on the given
/// listeners until `stop`.
pub fn spawn_servers(
    listener: TcpListener,
    admin_listener: TcpListener,
    admission: Arc<Admission>,
    admin: Arc<Admin>,
    store: Arc<CertStore>,
    stop: CancellationToken,
) -> Result<Servers> {
    let addr = listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;
    let acceptor = TlsAcceptor::from(Arc::new(tls::server_config(store)?));
    let admission = tokio::spawn(server::serve(
        listener,
        Some(acceptor),
        move |req| {
            let a = admission.clone();
            async move { a.handle(req).await }
        },
        stop.clone(),
    ));
    // The admin port every Baton process serves the same way; its routes
    // read no body, so the request is handed over as it is.
    let admin = tokio::spawn(baton_serving::admin::serve(
        admin_listener,
        stop,
        Connections::Drained,
        move |req, _peer| {
            let a = admin.clone();
            async move {
                a.handle(server::SimpleRequest {
                    method: req.method().clone(),
                    path: req.uri().path().to_owned(),
                    body: bytes::Bytes::new(),
                })
                .await
            }
        },
    ));
    Ok(Servers {
        addr,
        admin_addr,
        admission,
        admin,
    })
}

/// The whole process: a Tokio runtime running [`run`] until it returns.
///
/// Why `main.rs` calls this instead of `#[tokio::main] async fn main`:
/// release builds share no generic code between crates, so a binary that
/// awaited [`run`] itself instantiated the drop glue and polling of every
/// future under it again: the binary compiled as long as the whole library
/// (docs/decisions/0064).
pub fn run_blocking(args: Args) -> Result<()> {
    tokio::runtime::Runtime::new()?.block_on(run(args))
}

/// Runs the webhook until SIGTERM/SIGINT.
pub async fn run(args: Args) -> Result<()> {
    // Several rustls backends may be compiled into a workspace build: pick
    // ring for the kube client as the serving side does.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let stop = CancellationToken::new();
    let client = kube::Client::try_default().await?;
    let mut registry = metrics::registry();
    let metrics = Arc::new(Metrics::register(&mut registry));
    let registry = Arc::new(registry);

    let store = CertStore::new();
    match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            let files = CertFiles {
                cert: cert.clone(),
                key: key.clone(),
            };
            files.load_into(&store)?;
            metrics.cert_reloads.inc();
            tracing::info!(cert = %cert.display(), "serving certificate from files (CA managed elsewhere)");
            tokio::spawn(files.watch(
                store.clone(),
                Duration::from_secs(args.cert_reload_interval_secs),
                stop.clone(),
            ));
        }
        _ => {
            tracing::info!(namespace = %args.namespace, "self-managed CA");
            tokio::spawn(ca::run(
                client.clone(),
                args.self_managed(),
                store.clone(),
                stop.clone(),
            ));
        }
    }

    let caches = Caches::start(client.clone(), &args.namespace, stop.clone());
    let state: Arc<dyn ClusterState> = Arc::new(caches);
    let admission = Arc::new(Admission::new(
        state.clone(),
        args.inject_config(),
        metrics.clone(),
        Some(client),
    ));
    let draining = Draining::default();
    let admin = Arc::new(Admin {
        store: store.clone(),
        state,
        registry,
        metrics,
        draining: draining.clone(),
    });
    let listener = TcpListener::bind(args.listen).await?;
    let admin_listener = TcpListener::bind(args.admin_listen).await?;
    let servers = spawn_servers(
        listener,
        admin_listener,
        admission,
        admin,
        store,
        stop.clone(),
    )?;
    tracing::info!(addr = %servers.addr, admin = %servers.admin_addr, "serving");

    shutdown_signal().await;
    // Kubernetes removes a terminating Pod from the Service's endpoints and
    // every kube-proxy drops it from its rules a moment after SIGTERM, not
    // before: until then the API server may still open connections here. So
    // keep serving (reporting not-ready) for the delay, then stop accepting
    // and let in-flight reviews finish.
    draining.start();
    let delay = Duration::from_secs(args.shutdown_delay_secs);
    tracing::info!(?delay, "shutting down: not ready, still serving");
    tokio::time::sleep(delay).await;
    tracing::info!("no longer accepting; draining in-flight reviews");
    stop.cancel();
    let grace = Duration::from_secs(args.shutdown_grace_secs);
    let drained = tokio::time::timeout(grace, async {
        let _ = servers.admission.await;
        let _ = servers.admin.await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!("connections still open after the grace period; exiting");
    } else {
        tracing::info!("drained; exiting");
    }
    Ok(())
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}
