//! `baton-operator`: Baton's reconcilers.
//!
//! ```text
//!   SidecarRelease (cluster) ──selects──► injected Pods (label baton.dev/release=<name>)
//!          ▲                                  │ annotations: baton.dev/version,
//!          │ status (server-side apply):      │ baton.dev/active-slot; container readiness
//!          │ total/updated/ready/failed,      │
//!          └─ per-version counts, conditions ◄┘
//! ```
//!
//! The AcceleratorPool controller ([`accelerator`]) keeps each pool's books
//! (devices per node, who holds them, pending grants, fallbacks) in its
//! status, which the webhook's grant decision reads.
//!
//! The rollout controller: for every
//! SidecarRelease it moves the pods the webhook injected to `spec.version`
//! (a hot upgrade through the standby slot, or an eviction), and keeps the
//! release's status true to them (counts per version, failures with their
//! reasons, the Progressing / Complete / Degraded / Paused conditions
//! `kubectl get sr` shows). It runs replicated; a Lease elects the one
//! replica that acts and writes.
//!
//! Layout follows controller-rs: [`rollout::plan`] is a pure function from
//! (release, pods, what their sidecars say) to actions, [`release::status`]
//! a pure function from (release, pods) to status, [`rollout::controller`]
//! only reads, plans, acts and writes; [`leader`] and [`admin`] are the
//! process plumbing.

pub mod accelerator;
pub mod admin;
pub mod events;
pub mod identity;
pub mod leader;
pub mod mesh;
pub mod metrics;
#[cfg(test)]
mod mock_api;
pub mod release;
pub mod rollout;
pub mod sidecar_admin;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use baton_crds::contract;
use tokio::sync::watch;

/// Command-line arguments (each also settable from the environment).
#[derive(Debug, clap::Parser)]
#[command(name = "baton-operator", version, about = "Baton's reconcilers")]
pub struct Args {
    /// Admin listener: /live, /ready, /metrics.
    #[arg(long, env = "BATON_ADMIN_ADDR", default_value = "0.0.0.0:9090")]
    pub admin_addr: SocketAddr,
    /// Namespace holding the leader-election Lease.
    #[arg(long, env = "BATON_NAMESPACE", default_value = contract::SYSTEM_NAMESPACE)]
    pub namespace: String,
    /// This replica's identity in the Lease (the pod name in a cluster).
    #[arg(long, env = "BATON_POD_NAME")]
    pub identity: Option<String>,
    /// This replica's Pod uid: owner of its push tally ConfigMap, which the
    /// garbage collector then deletes with the Pod.
    #[arg(long, env = "BATON_POD_UID")]
    pub pod_uid: Option<String>,
    /// Seconds a leader holds the Lease without renewing it.
    #[arg(long, default_value_t = 15)]
    pub lease_seconds: u64,
    /// Log filter (tracing `EnvFilter` syntax).
    #[arg(long, env = "BATON_LOG", default_value = "info")]
    pub log: String,
    #[command(flatten)]
    pub mesh_identity: IdentityArgs,
    #[command(flatten)]
    pub config_push: PushArgs,
}

/// The config push flags (see `mesh`).
#[derive(Debug, clap::Args)]
pub struct PushArgs {
    /// Watch Services, endpoints, injected Pods, Routes and TlsPolicies and
    /// serve the sidecars' config streams (every replica). Needs the
    /// identity service, whose certificate it serves.
    #[arg(id = "config_push_enabled", long = "config-push", env = "BATON_CONFIG_PUSH", default_value_t = false, action = clap::ArgAction::Set)]
    pub enabled: bool,
    /// HTTPS (HTTP/2) listener of the config streams.
    #[arg(
        long = "config-push-addr",
        env = "BATON_CONFIG_PUSH_ADDR",
        default_value = "0.0.0.0:8444"
    )]
    pub listen: SocketAddr,
    /// DNS suffix of the cluster's Services.
    #[arg(
        long = "cluster-domain",
        env = "BATON_CLUSTER_DOMAIN",
        default_value = "cluster.local"
    )]
    pub cluster_domain: String,
    /// Identity endpoint URL written into compiled TLS sections. Unset: no
    /// TLS is compiled (sidecars talk plaintext; TlsPolicies select nothing).
    #[arg(
        long = "config-push-identity-url",
        env = "BATON_CONFIG_PUSH_IDENTITY_URL"
    )]
    pub identity_url: Option<String>,
    /// CA bundle path, inside the sidecar, that authenticates that endpoint.
    #[arg(
        long = "config-push-identity-ca-bundle",
        env = "BATON_CONFIG_PUSH_IDENTITY_CA_BUNDLE"
    )]
    pub identity_ca_bundle: Option<std::path::PathBuf>,
    /// What meshed Pods' inbound sides do with requests no
    /// AuthorizationPolicy decides, in namespaces without a
    /// baton.dev/default-authorization annotation: all-unauthenticated,
    /// all-authenticated, cluster-authenticated, deny or audit.
    #[arg(
        long = "default-authorization",
        env = "BATON_DEFAULT_AUTHORIZATION",
        default_value = "all-unauthenticated"
    )]
    pub default_authorization: baton_crds::authorization_policy::DefaultAuthorization,
}

impl PushArgs {
    /// The compiler's cluster-wide parameters.
    pub fn params(&self, trust_domain: &str) -> mesh::compile::MeshParams {
        mesh::compile::MeshParams {
            trust_domain: trust_domain.to_owned(),
            cluster_domain: self.cluster_domain.clone(),
            identity: self
                .identity_url
                .clone()
                .map(|url| mesh::compile::IdentitySource {
                    url,
                    ca_bundle: self.identity_ca_bundle.clone(),
                }),
            default_authorization: self.default_authorization,
        }
    }
}

/// Where the mesh CA comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CaMode {
    /// Generate a root into the CA Secret when it does not exist.
    SelfManaged,
    /// Use the CA Secret as provided (plug-in CA, cert-manager); never write it.
    External,
}

/// The identity service (mesh CA) flags.
#[derive(Debug, clap::Args)]
pub struct IdentityArgs {
    /// Serve the identity endpoint (every replica serves; no leader needed).
    #[arg(long = "identity-service", env = "BATON_IDENTITY_SERVICE", default_value_t = true, action = clap::ArgAction::Set)]
    pub enabled: bool,
    /// HTTPS listener of the identity endpoint.
    #[arg(
        long = "identity-addr",
        env = "BATON_IDENTITY_ADDR",
        default_value = "0.0.0.0:8443"
    )]
    pub addr: SocketAddr,
    /// SPIFFE trust domain of issued identities.
    #[arg(long = "identity-trust-domain", env = "BATON_TRUST_DOMAIN", default_value = contract::identity::DEFAULT_TRUST_DOMAIN)]
    pub trust_domain: String,
    /// `self-managed` (root created on first start) or `external` (plug-in CA).
    #[arg(
        long = "identity-ca",
        env = "BATON_IDENTITY_CA",
        value_enum,
        default_value = "self-managed"
    )]
    pub ca: CaMode,
    /// Secret (in --namespace) holding tls.crt / tls.key / ca.crt.
    #[arg(long = "identity-ca-secret", env = "BATON_IDENTITY_CA_SECRET", default_value = contract::identity::CA_SECRET)]
    pub ca_secret: String,
    /// Validity of a self-managed root, in days.
    #[arg(long = "identity-root-validity-days", default_value_t = 3650)]
    pub root_validity_days: u64,
    /// Lifetime of workload certificates, in seconds.
    #[arg(
        long = "identity-cert-lifetime-seconds",
        env = "BATON_IDENTITY_CERT_LIFETIME_SECONDS",
        default_value_t = 86_400
    )]
    pub cert_lifetime_seconds: u64,
    /// Accept RSA-2048 CSRs (ECDSA P-256 is always accepted).
    #[arg(long = "identity-allow-rsa", env = "BATON_IDENTITY_ALLOW_RSA", default_value_t = false, action = clap::ArgAction::Set)]
    pub allow_rsa: bool,
    /// Per-Pod burst of certificate requests.
    #[arg(long = "identity-rate-burst", default_value_t = 10)]
    pub rate_burst: u32,
    /// Seconds for one request of a Pod's bucket to come back.
    #[arg(long = "identity-rate-refill-seconds", default_value_t = 6)]
    pub rate_refill_seconds: u64,
    /// Extra DNS names of the endpoint's certificate (the Service's names are always in).
    #[arg(long = "identity-dns-name")]
    pub dns_names: Vec<String>,
    /// IP SANs of the endpoint's certificate (comma-separated in the
    /// environment): the Service's ClusterIP where sidecars dial an IP
    /// (a cluster without DNS).
    #[arg(
        long = "identity-ip",
        env = "BATON_IDENTITY_IPS",
        value_delimiter = ','
    )]
    pub ips: Vec<std::net::IpAddr>,
    /// Seconds between re-reads of the CA Secret (a rotation step applies
    /// within it).
    #[arg(
        long = "identity-reload-seconds",
        env = "BATON_IDENTITY_RELOAD_SECONDS",
        default_value_t = 10
    )]
    pub reload_seconds: u64,
    /// Re-issue requests (after a trust change) one replica signs per
    /// second; the spread pushed to its sidecars follows from it.
    #[arg(
        long = "identity-reissue-rate",
        env = "BATON_IDENTITY_REISSUE_RATE",
        default_value_t = identity::service::DEFAULT_REISSUE_RATE
    )]
    pub reissue_rate: u32,
}

impl IdentityArgs {
    /// The identity service's configuration, or why the flags are wrong.
    pub fn config(
        &self,
        namespace: &str,
        instance: Option<String>,
    ) -> anyhow::Result<identity::IdentityConfig> {
        anyhow::ensure!(
            identity::issue::valid_trust_domain(&self.trust_domain),
            "--identity-trust-domain {:?}: lowercase letters, digits, '-', '.', '_' only",
            self.trust_domain
        );
        anyhow::ensure!(
            self.cert_lifetime_seconds >= 60,
            "--identity-cert-lifetime-seconds must be at least 60"
        );
        anyhow::ensure!(
            self.rate_burst >= 1,
            "--identity-rate-burst must be at least 1"
        );
        anyhow::ensure!(
            self.rate_refill_seconds >= 1 && self.reload_seconds >= 1,
            "--identity-rate-refill-seconds and --identity-reload-seconds must be at least 1"
        );
        let secret = self.ca_secret.clone();
        let source = match self.ca {
            CaMode::SelfManaged => identity::store::CaSource::SelfManaged {
                secret,
                root_validity: Duration::from_secs(self.root_validity_days * 86_400),
            },
            CaMode::External => identity::store::CaSource::External { secret },
        };
        // Both Services in front of the replicas: `baton-identity`, and
        // `baton-operator`, the control-plane address the webhook injects
        // (sidecars reach the config stream and the identity endpoint there).
        let mut dns_names: Vec<String> = [
            contract::identity::SERVICE,
            contract::webhook::OPERATOR_SERVICE,
        ]
        .iter()
        .flat_map(|service| {
            [
                (*service).to_owned(),
                format!("{service}.{namespace}"),
                format!("{service}.{namespace}.svc"),
                format!("{service}.{namespace}.svc.cluster.local"),
            ]
        })
        .collect();
        dns_names.extend(self.dns_names.iter().cloned());
        Ok(identity::IdentityConfig {
            addr: self.addr,
            namespace: namespace.to_owned(),
            source,
            service: identity::service::ServiceConfig {
                trust_domain: self.trust_domain.clone(),
                audience: contract::volumes::TOKEN_AUDIENCE.to_owned(),
                policy: identity::issue::IssuePolicy {
                    allow_rsa: self.allow_rsa,
                    lifetime: Duration::from_secs(self.cert_lifetime_seconds),
                    ..identity::issue::IssuePolicy::default()
                },
                rate_limit: identity::rate_limit::RateLimit {
                    burst: self.rate_burst,
                    refill: Duration::from_secs(self.rate_refill_seconds),
                },
            },
            dns_names,
            ips: self.ips.clone(),
            serving_lifetime: Duration::from_secs(7 * 86_400),
            reload_interval: Duration::from_secs(self.reload_seconds),
            instance,
            ledger: Arc::default(),
            reissue_rate: self.reissue_rate.max(1),
            trust: Arc::new(watch::channel(None).0),
            published: Arc::default(),
        })
    }
}

/// Installs the global tracing subscriber.
pub fn init_tracing(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
}

/// Runs the operator until SIGTERM/SIGINT or the loss of leadership.
/// The whole process: a Tokio runtime running [`run`] until it returns.
///
/// Why `main.rs` calls this instead of `#[tokio::main] async fn main`:
/// release builds share no generic code between crates, so a binary that
/// awaited [`run`] itself instantiated the drop glue and polling of every
/// future under it again: the binary compiled as long as the whole library
/// (261 of the control-profile build's CPU seconds for the operator; 1.5 s
/// this way; docs/decisions/0064).
pub fn run_blocking(args: Args) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(args))
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    // kube's TLS stack needs a process-wide rustls provider; the workspace
    // builds rustls with ring only, chosen here explicitly.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes client configuration (in-cluster or KUBECONFIG)")?;
    let metrics = Arc::new(metrics::Metrics::default());
    let (ready_tx, ready_rx) = watch::channel(false);
    let view = Arc::new(admin::SidecarsView::default());
    let admin = tokio::spawn(admin::serve(
        args.admin_addr,
        metrics.clone(),
        ready_rx,
        view.clone(),
    ));

    let identity = args.identity.clone().unwrap_or_else(default_identity);
    // Every replica serves identity, leader or not: started before the
    // election. Its failures are logged and never stop the controllers.
    anyhow::ensure!(
        !args.config_push.enabled || args.mesh_identity.enabled,
        "--config-push needs --identity-service (it serves that endpoint's certificate)"
    );
    let serving = Arc::new(identity::server::ServingCert::default());
    // The identity service, once running, also answers certificate requests
    // on the config push endpoint's connections (decision 0056).
    let published: Arc<std::sync::OnceLock<_>> = Arc::default();
    // The CA material's trust state: identity publishes it, the hub pushes
    // its generation, the leader's rotation observer reads it.
    let trust = Arc::new(watch::channel(None).0);
    if args.mesh_identity.enabled {
        let mut cfg = args
            .mesh_identity
            .config(&args.namespace, Some(identity.clone()))?;
        cfg.trust = trust.clone();
        cfg.published = published.clone();
        let _ = view.ledger.set(cfg.ledger.clone());
        let (client, m) = (client.clone(), metrics.identity.clone());
        let serving = serving.clone();
        tokio::spawn(async move {
            if let Err(error) = crate::identity::run_with_serving(client, cfg, m, serving).await {
                tracing::error!(%error, reason = error.metric_label(), "identity service stopped");
            }
        });
    }
    // Every replica serves config streams too; only the leader writes status.
    let hub = if args.config_push.enabled {
        let hub =
            start_config_push(&args, &client, &metrics, serving, published, &identity).await?;
        tokio::spawn(push_reissue(
            hub.clone(),
            trust.subscribe(),
            args.mesh_identity.reissue_rate,
        ));
        let _ = view.hub.set(hub.clone());
        Some(hub)
    } else {
        None
    };
    let elector = leader::LeaderElector::new(
        client.clone(),
        &args.namespace,
        "baton-operator",
        &identity,
        Duration::from_secs(args.lease_seconds),
    );
    // Standby replicas are ready too: readiness means "able to take over".
    let _ = ready_tx.send(true);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    tracing::info!(%identity, "waiting for leadership");
    let mut leadership = tokio::select! {
        leadership = elector.acquire(metrics.clone()) => leadership?,
        () = &mut shutdown => {
            tracing::info!("shutting down (not leading)");
            return Ok(());
        }
    };
    tracing::info!(%identity, "leading; starting controllers");

    let pools = Arc::new(accelerator::controller::Context::new(
        client.clone(),
        metrics.clone(),
        Some(identity.clone()),
    ));
    let ctx = Arc::new(rollout::controller::Context::new(
        client,
        metrics.clone(),
        rollout::controller::http_probe(),
        Some(identity.clone()),
    ));
    // Only the leader observes the root rotation's phase (all replicas'
    // sidecars, through the tallies).
    let rotation = {
        let (client, hub) = (ctx.client.clone(), hub.clone());
        let (namespace, instance) = (args.namespace.clone(), identity.clone());
        let (trust, metrics) = (trust.subscribe(), metrics.identity.clone());
        async move {
            match hub.filter(|_| args.mesh_identity.enabled) {
                Some(hub) => {
                    let counts = {
                        let (client, namespace, instance) =
                            (client.clone(), namespace.clone(), instance.clone());
                        move || {
                            let (hub, client) = (hub.clone(), client.clone());
                            let (namespace, instance) = (namespace.clone(), instance.clone());
                            async move {
                                let own = hub.trust_count()?;
                                let peers: Vec<_> =
                                    mesh::tally::read_peers(&client, &namespace, &instance)
                                        .await
                                        .into_iter()
                                        .map(|t| (t.replica, t.trust))
                                        .collect();
                                Some(identity::rotation::Progress::merge(&own, &peers))
                            }
                        }
                    };
                    identity::rotation::run(
                        client,
                        namespace,
                        instance,
                        trust,
                        metrics,
                        Duration::from_secs(1),
                        counts,
                    )
                    .await
                }
                None => std::future::pending().await,
            }
        }
    };
    // Only the leader writes Route and TlsPolicy status.
    let status_writer = {
        let client = ctx.client.clone();
        let (namespace, identity) = (args.namespace.clone(), identity.clone());
        async move {
            match hub {
                Some(hub) => {
                    let period = Duration::from_secs(1);
                    mesh::status::run(client, hub, period, &namespace, &identity).await
                }
                None => std::future::pending().await,
            }
        }
    };
    // Only the leader publishes the trust bundle, in its own namespace
    // (the webhook copies it into each Pod: decision 0058).
    let trust_publisher = {
        let (client, enabled) = (ctx.client.clone(), args.mesh_identity.enabled);
        let (namespace, secret) = (args.namespace.clone(), args.mesh_identity.ca_secret.clone());
        let interval = Duration::from_secs(args.mesh_identity.reload_seconds);
        async move {
            if enabled {
                identity::trust::run(client, namespace, secret, interval).await;
            } else {
                std::future::pending::<()>().await;
            }
        }
    };
    let result = tokio::select! {
        result = rollout::controller::run(ctx) => result,
        () = trust_publisher => Err(anyhow::anyhow!("the trust bundle publisher stopped")),
        () = rotation => Err(anyhow::anyhow!("the rotation observer stopped")),
        () = status_writer => Err(anyhow::anyhow!("the status writer stopped")),
        result = accelerator::controller::run(pools) => result,
        lost = leadership.lost() => {
            // Like client-go's OnStoppedLeading: exit, let the pod restart and
            // rejoin as a candidate, so two replicas never write at once.
            anyhow::bail!("lost leadership: {lost}")
        }
        result = admin => result.context("admin server task")?,
        () = &mut shutdown => {
            tracing::info!("shutting down");
            Ok(())
        }
    };
    // The controllers are stopped (their futures dropped above): give the
    // Lease up so the standby takes over now, not after the lease duration.
    match leadership.release().await {
        Ok(true) => tracing::info!(%identity, "released the Lease"),
        Ok(false) => tracing::info!(%identity, "the Lease was no longer ours"),
        Err(error) => tracing::warn!(%error, "releasing the Lease failed; it expires on its own"),
    }
    result
}

/// Pushes each new trust generation as the re-issue trigger, spread for the
/// streams connected then at `rate` requests per second (every replica).
async fn push_reissue(
    hub: Arc<mesh::hub::Hub>,
    mut trust: watch::Receiver<Option<identity::rotation::TrustState>>,
    rate: u32,
) {
    loop {
        let generation = trust
            .borrow_and_update()
            .as_ref()
            .map(|t| t.generation.clone());
        if let Some(generation) = generation {
            let spread = identity::rotation::spread(hub.connected(), rate);
            hub.set_reissue(&generation, spread);
        }
        if trust.changed().await.is_err() {
            return;
        }
    }
}

/// Starts the watchers, the hub's debouncer and the config stream endpoint.
async fn start_config_push(
    args: &Args,
    client: &kube::Client,
    metrics: &metrics::Metrics,
    serving: Arc<identity::server::ServingCert>,
    published: Arc<
        std::sync::OnceLock<
            Arc<identity::service::IdentityService<identity::cluster::KubeCluster>>,
        >,
    >,
    instance: &str,
) -> anyhow::Result<Arc<mesh::hub::Hub>> {
    let hub = Arc::new(mesh::hub::Hub::new(
        args.config_push.params(&args.mesh_identity.trust_domain),
        metrics.push.clone(),
    ));
    tokio::spawn(mesh::watch::run(client.clone(), hub.clone()));
    tokio::spawn(hub.clone().run());
    // Every replica publishes how many of its sidecars ACKed what, so the
    // leader's Programmed counts the sidecars on the other replicas too.
    tokio::spawn(mesh::tally::publish(
        client.clone(),
        hub.clone(),
        args.namespace.clone(),
        instance.to_owned(),
        args.pod_uid.clone(),
        Duration::from_secs(1),
    ));
    let listener = tokio::net::TcpListener::bind(args.config_push.listen)
        .await
        .with_context(|| format!("bind --config-push-addr {}", args.config_push.listen))?;
    tracing::info!(addr = %args.config_push.listen, "config push listening");
    let server = Arc::new(mesh::server::PushServer {
        hub: hub.clone(),
        cluster: identity::cluster::KubeCluster::new(client.clone(), Some(instance.to_owned())),
        audience: contract::volumes::TOKEN_AUDIENCE.to_owned(),
        trust_domain: args.mesh_identity.trust_domain.clone(),
        authenticating: mesh::server::authenticating(),
        ping_interval: baton_config::framed::PING_INTERVAL,
        sign: Some(Arc::new(move |req| {
            let published = published.clone();
            Box::pin(async move {
                match published.get() {
                    Some(service) => identity::server::sign(service, &req).await,
                    None => identity::server::starting(),
                }
            })
        })),
    });
    tokio::spawn(async move {
        if let Err(error) =
            mesh::server::serve(listener, mesh::server::acceptor(serving), server).await
        {
            tracing::error!(%error, "config push endpoint stopped");
        }
    });
    Ok(hub)
}

fn default_identity() -> String {
    std::env::var("HOSTNAME").unwrap_or_else(|_| format!("baton-operator-{}", std::process::id()))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[test]
    fn identity_flags_default_to_a_self_managed_ca_and_24h_p256_certificates() {
        let args = Args::try_parse_from(["baton-operator"]).unwrap();
        assert!(args.mesh_identity.enabled);
        let cfg = args.mesh_identity.config("baton-system", None).unwrap();
        assert_eq!(cfg.addr.port(), contract::identity::PORT);
        assert_eq!(cfg.service.trust_domain, "cluster.local");
        assert_eq!(cfg.service.audience, contract::volumes::TOKEN_AUDIENCE);
        assert_eq!(cfg.service.policy.lifetime, Duration::from_secs(86_400));
        assert!(!cfg.service.policy.allow_rsa);
        assert!(matches!(
            cfg.source,
            identity::store::CaSource::SelfManaged { ref secret, .. } if secret == contract::identity::CA_SECRET
        ));
        assert!(
            cfg.dns_names
                .contains(&"baton-identity.baton-system.svc".to_owned())
        );
    }

    #[test]
    fn config_push_is_off_by_default_and_its_flags_fill_the_compiler_params() {
        let args = Args::try_parse_from(["baton-operator"]).unwrap();
        assert!(!args.config_push.enabled);
        assert_eq!(args.config_push.params("cluster.local").identity, None);
        let args = Args::try_parse_from([
            "baton-operator",
            "--config-push",
            "true",
            "--cluster-domain",
            "corp.internal",
            "--config-push-identity-url",
            "https://baton-identity.baton-system.svc:8443/v1/sign",
            "--config-push-identity-ca-bundle",
            "/var/run/baton/ca.crt",
        ])
        .unwrap();
        assert!(args.config_push.enabled);
        let p = args.config_push.params("mesh.example");
        assert_eq!(p.trust_domain, "mesh.example");
        assert_eq!(p.cluster_domain, "corp.internal");
        let id = p.identity.unwrap();
        assert_eq!(
            id.url,
            "https://baton-identity.baton-system.svc:8443/v1/sign"
        );
        assert_eq!(
            id.ca_bundle.as_deref(),
            Some(std::path::Path::new("/var/run/baton/ca.crt"))
        );
    }

    #[test]
    fn identity_flags_select_a_plug_in_ca_and_refuse_bad_values_with_the_flag_named() {
        let args = Args::try_parse_from([
            "baton-operator",
            "--identity-ca",
            "external",
            "--identity-ca-secret",
            "corp-issuer",
            "--identity-allow-rsa",
            "true",
            "--identity-cert-lifetime-seconds",
            "3600",
        ])
        .unwrap();
        let cfg = args.mesh_identity.config("baton-system", None).unwrap();
        assert_eq!(
            cfg.source,
            identity::store::CaSource::External {
                secret: "corp-issuer".into()
            }
        );
        assert!(cfg.service.policy.allow_rsa);
        assert_eq!(cfg.service.policy.lifetime, Duration::from_secs(3600));
        let bad = Args::try_parse_from(["baton-operator", "--identity-trust-domain", "Bad/Domain"])
            .unwrap();
        let err = bad.mesh_identity.config("baton-system", None).unwrap_err();
        assert!(err.to_string().contains("--identity-trust-domain"), "{err}");
        let bad = Args::try_parse_from(["baton-operator", "--identity-cert-lifetime-seconds", "5"])
            .unwrap();
        assert!(bad.mesh_identity.config("baton-system", None).is_err());
        // The Lease identity flag keeps its name.
        let a = Args::try_parse_from(["baton-operator", "--identity", "host-operator"]).unwrap();
        assert_eq!(a.identity.as_deref(), Some("host-operator"));
    }
}
