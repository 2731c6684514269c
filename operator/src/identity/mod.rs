//! Mesh identity: the operator's CA issues short-lived SPIFFE certificates
//! to sidecars.
//!
//! ```text
//!  sidecar ── POST /v1/sign {csr} ──► identity server (every replica, own port)
//!   Bearer <projected SA token,          │ TokenReview (audience identity.baton.dev)
//!    audience identity.baton.dev>        │ Pod bound to the token: injected?
//!                                        │ per-Pod token bucket
//!                                        │ CSR: key type, signature, SAN == identity
//!  ◄── {certificateChain, trustBundle} ──┘ signed by the CA below
//!
//!  Secret baton-system/baton-identity-ca  (tls.crt, tls.key, ca.crt)
//!    created once (self-managed root) or provided (plug-in CA / cert-manager),
//!    re-read every reload interval: a user's rotation edit applies live
//! ```
//!
//! Pure heart, thin I/O (STYLE practice 13): [`issue`] (caller from a
//! TokenReview, CSR checks, certificate building, the typed refusals),
//! [`authority`] (CA material), [`rate_limit`] are pure and tested
//! exhaustively; [`cluster`] (TokenReview, Pod, Events behind a trait),
//! [`store`] (the Secret), [`service`] and [`server`] are the I/O around them.

pub mod authority;
pub mod cluster;
pub mod issue;
pub mod ledger;
pub mod metrics;
pub mod rate_limit;
pub mod rotation;
pub mod server;
pub mod service;
pub mod store;
pub mod trust;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use time::OffsetDateTime;

use authority::Authority;
use cluster::KubeCluster;
use metrics::IdentityMetrics;
use server::ServingCert;
use service::{IdentityService, ServiceConfig};
use store::CaSource;

/// Everything the identity service needs to run.
#[derive(Debug, Clone)]
pub struct IdentityConfig {
    pub addr: SocketAddr,
    /// Namespace of the CA Secret (`baton-system`).
    pub namespace: String,
    pub source: CaSource,
    pub service: ServiceConfig,
    /// SANs of the endpoint's own certificate.
    pub dns_names: Vec<String>,
    pub ips: Vec<IpAddr>,
    pub serving_lifetime: Duration,
    /// How often the CA Secret is re-read (rotation edits apply within it).
    pub reload_interval: Duration,
    /// This replica's name, for Events.
    pub instance: Option<String>,
    /// Where issued certificates are recorded (read by the admin port).
    pub ledger: Arc<ledger::Ledger>,
    /// Re-issue requests this replica signs per second (the CA-wide
    /// re-issue bucket, and the spread the hub pushes).
    pub reissue_rate: u32,
    /// Where the trust state of the material in use is published (the
    /// config push hub and the leader's rotation observer read it).
    pub trust: Arc<tokio::sync::watch::Sender<Option<rotation::TrustState>>>,
    /// Where the running service is published once built, so the config
    /// push endpoint can answer certificate requests arriving on its
    /// connections (decision 0056).
    pub published: Arc<std::sync::OnceLock<Arc<IdentityService<KubeCluster>>>>,
}

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("serving certificate: {0}")]
    Serving(String),
}

impl IdentityError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            IdentityError::Bind { .. } => "bind",
            IdentityError::Serving(_) => "serving",
        }
    }
}

fn seconds_until(t: OffsetDateTime, now: OffsetDateTime) -> f64 {
    (t - now).as_seconds_f64()
}

fn publish_ca(metrics: &IdentityMetrics, a: &Authority) {
    let now = OffsetDateTime::now_utc();
    metrics.set_ca(
        seconds_until(a.issuer_not_after(), now),
        seconds_until(a.root_not_after(), now),
        seconds_until(a.bundle_min_not_after(), now),
        a.bundle_len(),
    );
}

/// Loads (or creates) the CA, retrying until it is usable: a missing
/// plug-in Secret or a bad edit is logged with its reason, never fatal.
async fn load_authority(api: &Api<Secret>, cfg: &IdentityConfig) -> (Authority, Option<String>) {
    loop {
        let outcome = store::ensure(api, &cfg.source, &cfg.namespace, &cfg.service.trust_domain)
            .await
            .and_then(|(pem, rv)| {
                Authority::from_pem(&pem, OffsetDateTime::now_utc())
                    .map(|a| (a, rv))
                    .map_err(|source| store::StoreError::Material {
                        secret: cfg.source.secret().to_owned(),
                        source,
                    })
            });
        match outcome {
            Ok(loaded) => return loaded,
            Err(error) => {
                tracing::error!(%error, reason = store::error_label(&error), "mesh CA not usable; retrying");
                tokio::time::sleep(cfg.reload_interval).await;
            }
        }
    }
}

fn issue_serving(
    authority: &Authority,
    cfg: &IdentityConfig,
    serving: &ServingCert,
) -> Result<OffsetDateTime, IdentityError> {
    let now = OffsetDateTime::now_utc();
    let (chain, key) = authority
        .serving_certificate(&cfg.dns_names, &cfg.ips, now, cfg.serving_lifetime)
        .map_err(|e| IdentityError::Serving(e.to_string()))?;
    serving
        .store_pem(&chain, &key)
        .map_err(|e| IdentityError::Serving(e.to_string()))?;
    // Renew at two thirds of the lifetime, like every certificate here.
    Ok(now + cfg.serving_lifetime.mul_f64(2.0 / 3.0))
}

/// Runs the identity service until the task is dropped.
pub async fn run(
    client: Client,
    cfg: IdentityConfig,
    metrics: IdentityMetrics,
) -> Result<(), IdentityError> {
    run_with_serving(client, cfg, metrics, Arc::new(ServingCert::default())).await
}

/// [`run`], keeping `serving` issued and rotated: another endpoint of this
/// replica (the config push) serves the same certificate.
pub async fn run_with_serving(
    client: Client,
    cfg: IdentityConfig,
    metrics: IdentityMetrics,
    serving: Arc<ServingCert>,
) -> Result<(), IdentityError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &cfg.namespace);
    let (authority, mut rv) = load_authority(&api, &cfg).await;
    tracing::info!(?authority, "mesh CA loaded");
    publish_ca(&metrics, &authority);
    cfg.trust
        .send_replace(Some(authority.trust_state().clone()));
    let mut renew_serving_at = issue_serving(&authority, &cfg, &serving)?;
    let authority = Arc::new(ArcSwap::from_pointee(authority));

    let listener = tokio::net::TcpListener::bind(cfg.addr)
        .await
        .map_err(|source| IdentityError::Bind {
            addr: cfg.addr,
            source,
        })?;
    tracing::info!(addr = %cfg.addr, "identity service listening");
    let service = Arc::new(
        IdentityService::new(
            KubeCluster::new(client, cfg.instance.clone()),
            cfg.service.clone(),
            authority.clone(),
            metrics.clone(),
        )
        .with_ledger(cfg.ledger.clone())
        .with_reissue_rate(cfg.reissue_rate),
    );
    // The service runs once per process: set once.
    let _ = cfg.published.set(service.clone());
    let mut server = tokio::spawn(server::serve(
        listener,
        server::acceptor(serving.clone()),
        service,
        baton_crds::contract::identity::SIGN_PATH,
    ));

    let mut tick = tokio::time::interval(cfg.reload_interval);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            result = &mut server => {
                // The accept loop only ends on a panic; surface it.
                return Err(IdentityError::Serving(format!("server task ended: {result:?}")));
            }
        }
        match store::reload(&api, &cfg.source, &cfg.namespace, rv.as_deref()).await {
            Ok(None) => {}
            Ok(Some((pem, new_rv))) => match Authority::from_pem(&pem, OffsetDateTime::now_utc()) {
                Ok(next) => {
                    tracing::info!(authority = ?next, "mesh CA changed; issuing from the new material");
                    match issue_serving(&next, &cfg, &serving) {
                        Ok(at) => renew_serving_at = at,
                        Err(error) => tracing::error!(%error, "serving certificate not renewed"),
                    }
                    let trust = next.trust_state().clone();
                    authority.store(Arc::new(next));
                    // After the store: a sidecar woken by the new generation
                    // must find it issuing here.
                    cfg.trust.send_if_modified(|t| {
                        let changed = t.as_ref() != Some(&trust);
                        *t = Some(trust);
                        changed
                    });
                    rv = new_rv;
                }
                Err(error) => {
                    // Keep issuing from the last good material.
                    tracing::error!(%error, reason = error.metric_label(), "mesh CA edit refused; keeping the previous CA");
                    rv = new_rv;
                }
            },
            Err(error) => {
                tracing::warn!(%error, "mesh CA Secret not re-read; keeping the current CA");
            }
        }
        let current = authority.load();
        publish_ca(&metrics, &current);
        if OffsetDateTime::now_utc() >= renew_serving_at {
            match issue_serving(&current, &cfg, &serving) {
                Ok(at) => renew_serving_at = at,
                Err(error) => tracing::error!(%error, "serving certificate not renewed"),
            }
        }
    }
}
