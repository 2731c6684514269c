//! One certificate request, start to finish, independent of HTTP: bearer
//! token → TokenReview → caller → rate limit → Pod meshed? → CSR checks →
//! signed chain. Counts and times every outcome.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use super::authority::Authority;
use super::cluster::{Cluster, PodState};
use super::issue::{
    IssuePolicy, Issued, Refusal, build_certificate, caller_from_review, check_csr,
};
use super::metrics::IdentityMetrics;
use super::rate_limit::{RateLimit, RateLimiter};

/// Request body (the sidecar's `identity_client` wire format).
#[derive(Debug, Serialize, Deserialize)]
pub struct SignRequest {
    pub csr: String,
    /// Set by a sidecar asking because of a re-issue trigger (the trust
    /// generation it was pushed): such requests also spend the CA-wide
    /// re-issue bucket. Renewals and first certificates do not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reissue: Option<String>,
}

/// Response body of a 200.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SignResponse {
    pub certificate_chain: String,
    pub trust_bundle: String,
    /// The trust generation the certificate was issued under (a sidecar
    /// from before re-issue triggers ignores it).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trust_generation: String,
}

/// Response body of a refusal: the reason label and the sentence.
#[derive(Debug, Serialize, Deserialize)]
pub struct RefusalBody {
    pub reason: String,
    pub message: String,
}

/// Settings of the issuing service.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    pub trust_domain: String,
    pub audience: String,
    pub policy: IssuePolicy,
    pub rate_limit: RateLimit,
}

/// The issuing service, shared by every connection.
pub struct IdentityService<C> {
    cluster: Arc<C>,
    config: ServiceConfig,
    authority: Arc<ArcSwap<Authority>>,
    limiter: Mutex<RateLimiter>,
    /// One bucket for every replica's worth of re-issue requests
    /// ([`SignRequest::reissue`]): what a trust change may cost this CA.
    reissue: Mutex<RateLimiter>,
    /// At most one Event per (Pod, reason) a minute: a looping client must
    /// not turn into a stream of API writes.
    event_gate: Mutex<RateLimiter>,
    metrics: IdentityMetrics,
    /// The newest certificate per Pod, for the admin port's `/sidecars`.
    ledger: Arc<super::ledger::Ledger>,
}

/// Default of `--identity-reissue-rate`: re-issue requests a replica signs
/// per second (decision 0050).
pub const DEFAULT_REISSUE_RATE: u32 = 100;

/// The CA-wide re-issue bucket: a burst of one second's worth, then
/// `per_second`.
pub fn reissue_limit(per_second: u32) -> RateLimit {
    let per_second = per_second.max(1);
    RateLimit {
        burst: per_second,
        refill: std::time::Duration::from_secs(1) / per_second,
    }
}

/// The key of the single CA-wide bucket.
const FLEET: &str = "fleet";

/// Minimum spacing of identical refusal Events on one Pod.
const EVENT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

impl<C> std::fmt::Debug for IdentityService<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdentityService")
            .field("config", &self.config)
            .field("authority", &self.authority.load())
            .finish_non_exhaustive()
    }
}

impl<C: Cluster> IdentityService<C> {
    pub fn new(
        cluster: C,
        config: ServiceConfig,
        authority: Arc<ArcSwap<Authority>>,
        metrics: IdentityMetrics,
    ) -> Self {
        IdentityService {
            cluster: Arc::new(cluster),
            limiter: Mutex::new(RateLimiter::new(config.rate_limit)),
            reissue: Mutex::new(RateLimiter::new(reissue_limit(DEFAULT_REISSUE_RATE))),
            event_gate: Mutex::new(RateLimiter::new(RateLimit {
                burst: 1,
                refill: EVENT_INTERVAL,
            })),
            config,
            authority,
            metrics,
            ledger: Arc::default(),
        }
    }

    /// Re-issue requests this replica signs per second, beyond a burst of
    /// as many (`--identity-reissue-rate`).
    pub fn with_reissue_rate(mut self, per_second: u32) -> Self {
        self.reissue = Mutex::new(RateLimiter::new(reissue_limit(per_second)));
        self
    }

    /// Records issued certificates in `ledger` (shared with the admin port).
    pub fn with_ledger(mut self, ledger: Arc<super::ledger::Ledger>) -> Self {
        self.ledger = ledger;
        self
    }

    pub fn metrics(&self) -> &IdentityMetrics {
        &self.metrics
    }

    /// Answers one request: `authorization` is the raw header value.
    pub async fn handle(
        &self,
        authorization: Option<&str>,
        body: &[u8],
    ) -> Result<Issued, Refusal> {
        let start = Instant::now();
        let result = self.issue(authorization, body).await;
        let seconds = start.elapsed().as_secs_f64();
        match &result {
            Ok(_) => self.metrics.issued(seconds),
            Err(r) => self.metrics.refused(r.metric_label(), seconds),
        }
        result
    }

    async fn issue(&self, authorization: Option<&str>, body: &[u8]) -> Result<Issued, Refusal> {
        let token = authorization
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(Refusal::MissingToken)?;
        let request: SignRequest = serde_json::from_slice(body)
            .map_err(|e| Refusal::BadRequest(format!("want {{\"csr\": \"<PEM>\"}}: {e}")))?;
        let review = self.cluster.review(token, &self.config.audience).await?;
        let caller = caller_from_review(&review, &self.config.audience, &self.config.trust_domain)?;
        let outcome = self
            .issue_for(&caller, &request.csr, request.reissue.is_some())
            .await;
        match &outcome {
            Ok(issued) => {
                self.ledger.record(
                    format!("{}/{}", caller.identity.namespace, caller.pod_name),
                    issued.not_after.unix_timestamp(),
                    time::OffsetDateTime::now_utc().unix_timestamp(),
                );
                tracing::info!(
                    identity = %caller.identity,
                    pod = %caller.pod_name,
                    not_after = %issued.not_after,
                    "certificate issued"
                )
            }
            Err(refusal) => {
                tracing::warn!(
                    identity = %caller.identity,
                    pod = %caller.pod_name,
                    reason = refusal.metric_label(),
                    %refusal,
                    "certificate refused"
                );
                let gate_key = |reason: &str| format!("{}/{reason}", caller.pod_key());
                if let Some(reason) = refusal.event_reason().filter(|reason| {
                    self.event_gate
                        .lock()
                        .expect("event gate lock")
                        .check(&gate_key(reason), Instant::now())
                        .is_ok()
                }) {
                    let cluster = self.cluster.clone();
                    let caller = caller.clone();
                    let note = refusal.to_string();
                    // Never hold the answer back for an Event.
                    tokio::spawn(async move { cluster.refusal_event(&caller, reason, note).await });
                }
            }
        }
        outcome
    }

    async fn issue_for(
        &self,
        caller: &super::issue::Caller,
        csr: &str,
        reissue: bool,
    ) -> Result<Issued, Refusal> {
        // Before the Pod read and the signature: a looping client spends
        // its own bucket, not the API server's or the CA's time.
        let throttled = self
            .limiter
            .lock()
            .expect("rate limiter lock")
            .check(&caller.pod_key(), Instant::now());
        if let Err(wait) = throttled {
            return Err(Refusal::RateLimited {
                pod: format!("{}/{}", caller.identity.namespace, caller.pod_name),
                retry_after_secs: wait.as_secs().max(1),
            });
        }
        if reissue {
            let throttled = self
                .reissue
                .lock()
                .expect("re-issue limiter lock")
                .check(FLEET, Instant::now());
            if let Err(wait) = throttled {
                self.metrics.reissue_throttled();
                return Err(Refusal::ReissueDeferred {
                    retry_after_secs: wait.as_secs().max(1),
                });
            }
        }
        let namespace = &caller.identity.namespace;
        match self
            .cluster
            .pod(namespace, &caller.pod_name, caller.pod_uid.as_deref())
            .await?
        {
            PodState::Meshed => {}
            PodState::NotMeshed => {
                return Err(Refusal::PodNotMeshed {
                    namespace: namespace.clone(),
                    pod: caller.pod_name.clone(),
                });
            }
            PodState::Gone => {
                return Err(Refusal::PodNotFound {
                    namespace: namespace.clone(),
                    pod: caller.pod_name.clone(),
                });
            }
        }
        let checked = check_csr(csr, &caller.identity, &self.config.policy)?;
        let authority = self.authority.load();
        build_certificate(
            &checked,
            &caller.identity,
            &authority,
            &self.config.policy,
            OffsetDateTime::now_utc(),
            rand::random(),
        )
    }
}
