//! Self-managed certificates: a CA kept in a Secret, serving certificates
//! issued from it, and the CA bundle patched into Baton's webhook
//! configurations (the Linkerd approach, without an external issuer).
//!
//! ```text
//!  Secret baton-system/baton-webhook-ca      Mutating/ValidatingWebhookConfiguration
//!   ca.crt ca.key ca-bundle.crt ─────────────► webhooks[*].clientConfig.caBundle
//!        │ signs (per replica, in memory)
//!        ▼
//!   serving cert (SANs: service DNS names + --extra-san) ──► CertStore ──► TLS
//! ```
//!
//! Every replica runs the same loop ([`run`]); the Secret is created with
//! `create` (a concurrent creator loses with 409 and reads the winner's), and
//! replaced with a resourceVersion precondition, so replicas always converge
//! on one CA (those mechanics are [`baton_controlplane::ca_secret`]'s, shared
//! with the operator's mesh CA; what is decided here is when to rotate). Rotation order keeps every handshake verifiable: a new CA
//! enters the bundle (next to the old one, which stays until it expires)
//! before any serving certificate it signed is used.
//!
//! The pure half (generate, issue, renew decisions, bundle merging) is
//! tested without an API server; [`run`] is the thin I/O around it.

use std::{net::IpAddr, sync::Arc, time::Duration};

use baton_controlplane::ca_secret::{self, Layout};
use baton_crds::contract::{SYSTEM_NAMESPACE, webhook as names};
use k8s_openapi::{
    ByteString,
    api::{
        admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration},
        core::v1::Secret,
    },
};
use kube::{Api, Client, api::PostParams};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

use crate::{
    error::{Error, Result},
    tls::CertStore,
};

/// Validity periods and renewal points. Renewal happens once two thirds of
/// a certificate's life have passed (the cert-manager default).
#[derive(Debug, Clone)]
pub struct Lifetimes {
    pub ca: Duration,
    pub serving: Duration,
}

impl Default for Lifetimes {
    fn default() -> Self {
        Self {
            ca: Duration::from_secs(10 * 365 * 86_400),
            serving: Duration::from_secs(30 * 86_400),
        }
    }
}

/// A CA certificate and its key, PEM encoded, plus the trusted bundle
/// (current CA first, then older CAs that have not expired yet).
pub use baton_controlplane::ca_secret::CaPem;

/// A serving certificate (leaf only; the CA is in the bundle) and its key.
#[derive(Debug, Clone)]
pub struct ServingCert {
    pub cert_pem: String,
    pub key_pem: String,
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

/// The DNS names a Service is reachable by, as the API server dials it.
pub fn service_dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_owned(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// Creates a fresh self-signed CA valid from `now` for `validity`.
pub fn generate_ca(now: OffsetDateTime, validity: Duration) -> Result<CaPem> {
    let key = KeyPair::generate()?;
    let params = ca_params(now, validity);
    let cert = params.self_signed(&key)?.pem();
    Ok(CaPem {
        bundle: cert.clone(),
        cert,
        key: key.serialize_pem(),
    })
}

fn ca_params(now: OffsetDateTime, validity: Duration) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "baton-webhook-ca");
    dn.push(DnType::OrganizationName, "baton.dev");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    // Backdate a little: API server clocks may lag ours.
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + validity;
    params
}

/// Issues a serving certificate for `dns_names` and `ips`, signed by `ca`.
pub fn issue_serving(
    ca: &CaPem,
    dns_names: &[String],
    ips: &[IpAddr],
    now: OffsetDateTime,
    validity: Duration,
) -> Result<ServingCert> {
    let ca_key = KeyPair::from_pem(&ca.key)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        dns_names.first().map_or("baton-webhook", String::as_str),
    );
    params.distinguished_name = dn;
    params.subject_alt_names = dns_names
        .iter()
        .map(|n| n.clone().try_into().map(SanType::DnsName))
        .chain(ips.iter().map(|ip| Ok(SanType::IpAddress(*ip))))
        .collect::<Result<_, _>>()?;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + validity;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(ServingCert {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        not_before: params.not_before,
        not_after: params.not_after,
    })
}

/// Validity window of the first certificate in `pem`.
pub fn validity(pem: &str) -> Result<(OffsetDateTime, OffsetDateTime)> {
    let der = pem_blocks(pem)
        .into_iter()
        .next()
        .ok_or_else(|| Error::Pem("no CERTIFICATE block".into()))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| Error::Pem(format!("certificate does not parse: {e}")))?;
    let v = cert.validity();
    Ok((v.not_before.to_datetime(), v.not_after.to_datetime()))
}

/// True once two thirds of `[not_before, not_after]` have passed.
pub fn needs_renewal(
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
    now: OffsetDateTime,
) -> bool {
    let life = not_after - not_before;
    now >= not_before + life * 2 / 3
}

/// When a certificate valid over `[not_before, not_after]` is due.
pub fn renewal_time(not_before: OffsetDateTime, not_after: OffsetDateTime) -> OffsetDateTime {
    not_before + (not_after - not_before) * 2 / 3
}

fn pem_blocks(pem: &str) -> Vec<Vec<u8>> {
    use rustls_pki_types::{CertificateDer, pem::PemObject};
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .filter_map(Result::ok)
        .map(|c| c.to_vec())
        .collect()
}

/// Splits PEM text into its CERTIFICATE blocks, keeping each block's text
/// next to its DER (so a bundle can be rebuilt without re-encoding).
fn pem_text_blocks(pem: &str) -> Vec<(String, Vec<u8>)> {
    use rustls_pki_types::{CertificateDer, pem::PemObject};
    const END: &str = "-----END CERTIFICATE-----";
    let mut out = Vec::new();
    let mut rest = pem;
    while let Some(start) = rest.find("-----BEGIN CERTIFICATE-----") {
        let Some(end) = rest[start..].find(END) else {
            break;
        };
        let text = &rest[start..start + end + END.len()];
        if let Ok(der) = CertificateDer::from_pem_slice(text.as_bytes()) {
            out.push((format!("{text}\n"), der.to_vec()));
        }
        rest = &rest[start + end + END.len()..];
    }
    out
}

/// The bundle after rotating to `new_ca_pem`: the new CA first, then every
/// certificate of `old_bundle` that is still valid at `now` and differs from
/// the new one.
pub fn merge_bundle(new_ca_pem: &str, old_bundle: &str, now: OffsetDateTime) -> String {
    let mut out = new_ca_pem.trim_end().to_owned();
    out.push('\n');
    let new_der = pem_blocks(new_ca_pem);
    for (text, der) in pem_text_blocks(old_bundle) {
        if new_der.contains(&der) {
            continue;
        }
        let still_valid = x509_parser::parse_x509_certificate(&der)
            .map(|(_, c)| c.validity().not_after.to_datetime() > now)
            .unwrap_or(false);
        if still_valid {
            out.push_str(&text);
        }
    }
    out
}

/// The webhook CA's Secret in `namespace`.
pub fn layout(namespace: &str) -> Layout {
    Layout {
        name: names::CA_SECRET.to_owned(),
        namespace: namespace.to_owned(),
        type_: "Opaque",
        cert_key: names::CA_CERT_KEY,
        key_key: names::CA_KEY_KEY,
        bundle_key: names::CA_BUNDLE_KEY,
        labels: &[("app.kubernetes.io/part-of", "baton")],
        what: "webhook CA",
    }
}

/// What the self-managed loop needs to know.
#[derive(Debug, Clone)]
pub struct SelfManaged {
    pub namespace: String,
    pub dns_names: Vec<String>,
    pub ips: Vec<IpAddr>,
    pub lifetimes: Lifetimes,
    /// How often caBundle is re-checked (self-heals a reapplied manifest).
    pub sync_interval: Duration,
    /// Webhook configurations whose `caBundle` this CA owns.
    pub mutating_configuration: String,
    pub validating_configuration: String,
}

impl SelfManaged {
    pub fn new(service: &str, namespace: &str, ips: Vec<IpAddr>) -> Self {
        Self {
            namespace: namespace.to_owned(),
            dns_names: service_dns_names(service, namespace),
            ips,
            lifetimes: Lifetimes::default(),
            sync_interval: Duration::from_secs(60),
            mutating_configuration: names::MUTATING_CONFIGURATION.to_owned(),
            validating_configuration: names::VALIDATING_CONFIGURATION.to_owned(),
        }
    }
}

impl Default for SelfManaged {
    fn default() -> Self {
        Self::new(names::SERVICE, SYSTEM_NAMESPACE, Vec::new())
    }
}

fn is_status(err: &kube::Error, code: u16) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == code)
}

/// Loads the CA from its Secret, creating it when absent and rotating it
/// once two thirds of its life have passed: the new CA's bundle keeps the
/// old CA (until it expires), so certificates it signed stay trusted.
pub async fn ensure_ca(api: &Api<Secret>, cfg: &SelfManaged) -> Result<CaPem> {
    let generate = || generate_ca(OffsetDateTime::now_utc(), cfg.lifetimes.ca);
    let renew = |current: &CaPem| -> Result<Option<CaPem>> {
        let now = OffsetDateTime::now_utc();
        let (not_before, not_after) = validity(&current.cert)?;
        if !needs_renewal(not_before, not_after, now) {
            return Ok(None);
        }
        let mut rotated = generate_ca(now, cfg.lifetimes.ca)?;
        rotated.bundle = merge_bundle(&rotated.cert, &current.bundle, now);
        Ok(Some(rotated))
    };
    let (ca, _) = ca_secret::ensure(api, &layout(&cfg.namespace), Some(generate), renew).await?;
    Ok(ca)
}

/// Sets `caBundle` on every webhook of Baton's two configurations. Missing
/// configurations are skipped (installed later or not at all); unchanged
/// ones are not written. Returns how many configurations were updated.
///
/// Replicas starting together patch at the same moment: a write that loses
/// on `resourceVersion` (409) is retried from a fresh read, so every
/// replica converges at once rather than at its next sync.
pub async fn patch_ca_bundles(
    client: &Client,
    mutating_name: &str,
    validating_name: &str,
    bundle_pem: &str,
) -> Result<usize> {
    let bundle = ByteString(bundle_pem.as_bytes().to_vec());
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let m = patch_one(&mutating, mutating_name, |config| {
        let clients = config
            .webhooks
            .iter_mut()
            .flatten()
            .map(|h| &mut h.client_config);
        set_ca_bundle(clients, &bundle)
    })
    .await?;
    let v = patch_one(&validating, validating_name, |config| {
        let clients = config
            .webhooks
            .iter_mut()
            .flatten()
            .map(|h| &mut h.client_config);
        set_ca_bundle(clients, &bundle)
    })
    .await?;
    Ok(usize::from(m) + usize::from(v))
}

/// Read, let `set` change the object, write it back if it changed; a 409
/// starts over from a fresh read. Whether anything was written.
async fn patch_one<K>(api: &Api<K>, name: &str, set: impl Fn(&mut K) -> bool) -> Result<bool>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    const ATTEMPTS: usize = 5;
    for _attempt in 0..ATTEMPTS {
        let Some(mut object) = api.get_opt(name).await? else {
            tracing::debug!(name, "not installed; caBundle not patched");
            return Ok(false);
        };
        if !set(&mut object) {
            return Ok(false);
        }
        match api.replace(name, &PostParams::default(), &object).await {
            Ok(_) => return Ok(true),
            Err(e) if is_status(&e, 409) => {
                tracing::debug!(name, "caBundle write conflicted; reading again");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(Error::CaBundle(
        name.to_owned(),
        "kept conflicting with concurrent writers".to_owned(),
    ))
}

/// One pass of the loop: make sure the CA is current, the bundle is in the
/// configurations, and `store` serves a certificate from the current CA that
/// is not due for renewal. Returns when the next pass is due.
pub async fn reconcile(
    client: &Client,
    cfg: &SelfManaged,
    store: &CertStore,
    serving: &mut Option<(ServingCert, String)>,
) -> Result<OffsetDateTime> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &cfg.namespace);
    let ca = ensure_ca(&secrets, cfg).await?;
    // Bundle first: a certificate from a new CA must be trusted before use.
    if let Err(error) = patch_ca_bundles(
        client,
        &cfg.mutating_configuration,
        &cfg.validating_configuration,
        &ca.bundle,
    )
    .await
    {
        // Not fatal for serving (the API server may still trust the old
        // bundle); retried on the next pass.
        tracing::warn!(%error, "could not patch caBundle");
    }
    let now = OffsetDateTime::now_utc();
    let due = match serving {
        Some((cert, issuer)) => {
            *issuer != ca.cert || needs_renewal(cert.not_before, cert.not_after, now)
        }
        None => true,
    };
    if due {
        let cert = issue_serving(&ca, &cfg.dns_names, &cfg.ips, now, cfg.lifetimes.serving)?;
        store.store_pem(cert.cert_pem.as_bytes(), cert.key_pem.as_bytes())?;
        tracing::info!(not_after = %cert.not_after, "serving certificate issued");
        *serving = Some((cert, ca.cert.clone()));
    }
    let next = serving
        .as_ref()
        .map(|(c, _)| renewal_time(c.not_before, c.not_after))
        .unwrap_or(now);
    Ok(next)
}

/// Runs [`reconcile`] until `stop`, sleeping until the earlier of the next
/// renewal and the next bundle sync; errors back off and retry.
pub async fn run(client: Client, cfg: SelfManaged, store: Arc<CertStore>, stop: CancellationToken) {
    let mut serving = None;
    let mut backoff = Duration::from_secs(1);
    loop {
        let wait = match reconcile(&client, &cfg, &store, &mut serving).await {
            Ok(next_renewal) => {
                backoff = Duration::from_secs(1);
                let until_renewal = (next_renewal - OffsetDateTime::now_utc())
                    .try_into()
                    .unwrap_or(Duration::ZERO);
                until_renewal
                    .min(cfg.sync_interval)
                    .max(Duration::from_millis(100))
            }
            Err(error) => {
                tracing::warn!(%error, label = error.metric_label(), "certificate reconcile failed");
                backoff = (backoff * 2).min(Duration::from_secs(30));
                backoff
            }
        };
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// Points every webhook client config at `bundle`; whether anything changed
/// (so an unchanged configuration is not rewritten).
fn set_ca_bundle<'a>(
    clients: impl IntoIterator<
        Item = &'a mut k8s_openapi::api::admissionregistration::v1::WebhookClientConfig,
    >,
    bundle: &ByteString,
) -> bool {
    let mut changed = false;
    for client in clients {
        if client.ca_bundle.as_ref() != Some(bundle) {
            client.ca_bundle = Some(bundle.clone());
            changed = true;
        }
    }
    changed
}

#[cfg(test)]
mod tests {
    use rustls::client::danger::ServerCertVerifier;

    use super::*;

    fn at(secs: i64) -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000 + secs).unwrap()
    }

    #[test]
    fn service_names_cover_every_form_the_api_server_dials() {
        let names = service_dns_names("baton-webhook", "baton-system");
        assert!(names.contains(&"baton-webhook.baton-system.svc".to_owned()));
        assert!(names.contains(&"baton-webhook.baton-system.svc.cluster.local".to_owned()));
    }

    #[test]
    fn a_generated_ca_is_a_ca_and_round_trips_through_its_secret() {
        let ca = generate_ca(at(0), Duration::from_secs(3600)).unwrap();
        let der = pem_blocks(&ca.cert).remove(0);
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        assert!(cert.is_ca());
        let layout = layout("baton-system");
        let secret = layout.secret_for(&ca);
        assert_eq!(secret.metadata.name.as_deref(), Some(names::CA_SECRET));
        assert_eq!(secret.type_.as_deref(), Some("Opaque"));
        assert_eq!(layout.read::<Error>(&secret).unwrap(), ca);
    }

    #[test]
    fn a_secret_missing_the_key_is_reported_by_name() {
        let ca = generate_ca(at(0), Duration::from_secs(3600)).unwrap();
        let layout = layout("baton-system");
        let mut secret = layout.secret_for(&ca);
        secret.data.as_mut().unwrap().remove(names::CA_KEY_KEY);
        let err = Error::from(layout.read::<Error>(&secret).unwrap_err()).to_string();
        assert!(err.contains("ca.key missing"), "{err}");
    }

    #[test]
    fn serving_certificates_carry_the_sans_and_chain_to_the_ca() {
        let now = OffsetDateTime::now_utc();
        let ca = generate_ca(now, Duration::from_secs(3600)).unwrap();
        let dns = service_dns_names("baton-webhook", "baton-system");
        let ips: Vec<IpAddr> = vec!["127.0.0.1".parse().unwrap()];
        let cert = issue_serving(&ca, &dns, &ips, now, Duration::from_secs(600)).unwrap();
        let der = pem_blocks(&cert.cert_pem).remove(0);
        let (_, parsed) = x509_parser::parse_x509_certificate(&der).unwrap();
        let sans = parsed.subject_alternative_name().unwrap().unwrap().value;
        let rendered = format!("{:?}", sans.general_names);
        assert!(
            rendered.contains("baton-webhook.baton-system.svc"),
            "{rendered}"
        );
        assert!(rendered.contains("IPAddress([127, 0, 0, 1])"), "{rendered}");
        // Verify the chain with webpki, the same verifier rustls clients use.
        let mut roots = rustls::RootCertStore::empty();
        roots.add(pem_blocks(&ca.cert).remove(0).into()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            crate::tls::provider(),
        )
        .build()
        .unwrap();
        let name =
            rustls_pki_types::ServerName::try_from("baton-webhook.baton-system.svc").unwrap();
        verifier
            .verify_server_cert(
                &der.into(),
                &[],
                &name,
                &[],
                rustls_pki_types::UnixTime::now(),
            )
            .unwrap();
        crate::tls::certified_key(cert.cert_pem.as_bytes(), cert.key_pem.as_bytes()).unwrap();
    }

    #[test]
    fn renewal_is_due_after_two_thirds_of_the_lifetime() {
        assert!(!needs_renewal(at(0), at(300), at(199)));
        assert!(needs_renewal(at(0), at(300), at(200)));
        assert_eq!(renewal_time(at(0), at(300)), at(200));
    }

    #[test]
    fn validity_is_read_back_from_the_pem() {
        let ca = generate_ca(at(0), Duration::from_secs(3600)).unwrap();
        let (nb, na) = validity(&ca.cert).unwrap();
        assert_eq!(na, at(3600));
        assert_eq!(nb, at(-300));
        assert!(validity("garbage").is_err());
    }

    #[test]
    fn a_rotated_bundle_keeps_the_old_ca_until_it_expires() {
        let old = generate_ca(at(0), Duration::from_secs(1000)).unwrap();
        let new = generate_ca(at(700), Duration::from_secs(1000)).unwrap();
        let bundle = merge_bundle(&new.cert, &old.bundle, at(700));
        assert_eq!(pem_blocks(&bundle).len(), 2);
        assert_eq!(pem_blocks(&bundle)[0], pem_blocks(&new.cert)[0]);
        // Rotating again after the first CA expired drops it.
        let newer = generate_ca(at(1400), Duration::from_secs(1000)).unwrap();
        let bundle = merge_bundle(&newer.cert, &bundle, at(1400));
        let blocks = pem_blocks(&bundle);
        assert_eq!(blocks.len(), 2);
        assert!(!blocks.contains(&pem_blocks(&old.cert)[0]));
        // Merging the same CA twice does not duplicate it.
        assert_eq!(
            pem_blocks(&merge_bundle(&newer.cert, &newer.cert, at(1400))).len(),
            1
        );
    }

    // ---- against a mock API server (tower-test), asserting every request ----

    use baton_controlplane::testing::{Handle, expect, mock_client, reply, status};

    const SECRET_PATH: &str = "/api/v1/namespaces/baton-system/secrets";

    #[tokio::test]
    async fn a_ca_past_two_thirds_of_its_life_is_rotated_with_the_old_one_kept_in_the_bundle() {
        let (client, mut handle) = mock_client();
        let now = OffsetDateTime::now_utc();
        // Issued 700 s ago for 1000 s: due for rotation, not expired.
        let old = generate_ca(
            now - time::Duration::seconds(700),
            Duration::from_secs(1000),
        )
        .unwrap();
        let mut old_secret = serde_json::to_value(layout("baton-system").secret_for(&old)).unwrap();
        old_secret["metadata"]["resourceVersion"] = "42".into();
        let server = tokio::spawn(async move {
            let path = format!("{SECRET_PATH}/{}", names::CA_SECRET);
            let (_, send) = expect(&mut handle, "GET", &path).await;
            reply(send, 200, &old_secret);
            let (body, send) = expect(&mut handle, "PUT", &path).await;
            // Optimistic concurrency: the replace carries what was read.
            assert_eq!(body["metadata"]["resourceVersion"], "42");
            reply(send, 200, &body);
        });
        let api: Api<Secret> = Api::namespaced(client, "baton-system");
        let ca = ensure_ca(&api, &SelfManaged::default()).await.unwrap();
        server.await.unwrap();
        assert_ne!(ca.cert, old.cert);
        let blocks = pem_blocks(&ca.bundle);
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[1], pem_blocks(&old.cert)[0]);
    }

    #[tokio::test]
    async fn ca_bundle_is_patched_into_existing_configurations_only_when_it_differs() {
        let (client, mut handle) = mock_client();
        let bundle = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let config = serde_json::json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": names::MUTATING_CONFIGURATION, "resourceVersion": "7"},
            "webhooks": [{"name": names::MUTATING_WEBHOOK, "sideEffects": "None", "admissionReviewVersions": ["v1"],
                          "clientConfig": {"url": "https://127.0.0.1:8443/mutate-pods"}}],
        });
        let server = tokio::spawn(async move {
            let mpath = format!(
                "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{}",
                names::MUTATING_CONFIGURATION
            );
            let vpath = format!(
                "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{}",
                names::VALIDATING_CONFIGURATION
            );
            let (_, send) = expect(&mut handle, "GET", &mpath).await;
            reply(send, 200, &config);
            let (body, send) = expect(&mut handle, "PUT", &mpath).await;
            assert_eq!(
                body["webhooks"][0]["clientConfig"]["caBundle"],
                crate::review::base64(bundle.as_bytes())
            );
            assert_eq!(body["metadata"]["resourceVersion"], "7");
            reply(send, 200, &body);
            let (_, send) = expect(&mut handle, "GET", &vpath).await;
            reply(send, 404, &status(404, "NotFound"));
            // Second pass: already up to date, so only reads.
            let (_, send) = expect(&mut handle, "GET", &mpath).await;
            let mut current = config.clone();
            current["webhooks"][0]["clientConfig"]["caBundle"] =
                crate::review::base64(bundle.as_bytes()).into();
            reply(send, 200, &current);
            let (_, send) = expect(&mut handle, "GET", &vpath).await;
            reply(send, 404, &status(404, "NotFound"));
        });
        let m = names::MUTATING_CONFIGURATION;
        let v = names::VALIDATING_CONFIGURATION;
        assert_eq!(patch_ca_bundles(&client, m, v, bundle).await.unwrap(), 1);
        assert_eq!(patch_ca_bundles(&client, m, v, bundle).await.unwrap(), 0);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn one_reconcile_pass_creates_the_ca_and_loads_a_serving_certificate() {
        let (client, mut handle) = mock_client();
        let cfg = SelfManaged::new(
            "baton-webhook",
            "baton-system",
            vec!["127.0.0.1".parse().unwrap()],
        );
        let server = tokio::spawn(async move {
            let (_, send) = expect(
                &mut handle,
                "GET",
                &format!("{SECRET_PATH}/{}", names::CA_SECRET),
            )
            .await;
            reply(send, 404, &status(404, "NotFound"));
            let (body, send) = expect(&mut handle, "POST", SECRET_PATH).await;
            reply(send, 201, &body);
            // Neither configuration is installed: nothing to patch, not fatal.
            for kind in [
                "mutatingwebhookconfigurations",
                "validatingwebhookconfigurations",
            ] {
                let (request, send) = handle.next_request().await.unwrap();
                assert!(request.uri().path().contains(kind), "{}", request.uri());
                reply(send, 404, &status(404, "NotFound"));
            }
        });
        let store = CertStore::new();
        let mut serving = None;
        let next = reconcile(&client, &cfg, &store, &mut serving)
            .await
            .unwrap();
        server.await.unwrap();
        assert!(store.is_loaded());
        let (cert, issuer) = serving.unwrap();
        assert!(issuer.contains("BEGIN CERTIFICATE"));
        assert_eq!(next, renewal_time(cert.not_before, cert.not_after));
        assert!(next > OffsetDateTime::now_utc() + time::Duration::days(19));
    }

    /// A tiny in-memory API server for the objects the CA loop touches:
    /// Secrets (create fails with 409 when present) and the two webhook
    /// configurations (replace fails with 409 on a stale resourceVersion).
    /// The first `hold_gets` GETs of the CA Secret are answered only once
    /// all of them arrived, so concurrent replicas really race.
    async fn fake_api_server(mut handle: Handle, hold_gets: usize) -> serde_json::Value {
        use std::collections::HashMap;
        let mut objects: HashMap<String, serde_json::Value> = HashMap::new();
        let mut version = 1u64;
        for kind in [
            "mutatingwebhookconfigurations",
            "validatingwebhookconfigurations",
        ] {
            let name = if kind.starts_with("mutating") {
                names::MUTATING_CONFIGURATION
            } else {
                names::VALIDATING_CONFIGURATION
            };
            let path = format!("/apis/admissionregistration.k8s.io/v1/{kind}/{name}");
            objects.insert(path, serde_json::json!({
                "metadata": {"name": name, "resourceVersion": "1"},
                "webhooks": [
                    {"name": "a.baton.dev", "sideEffects": "None", "admissionReviewVersions": ["v1"], "clientConfig": {"service": {"name": "baton-webhook", "namespace": "baton-system"}}},
                    {"name": "b.baton.dev", "sideEffects": "None", "admissionReviewVersions": ["v1"], "clientConfig": {"service": {"name": "baton-webhook", "namespace": "baton-system"}}},
                ],
            }));
        }
        let secret_path = format!("{SECRET_PATH}/{}", names::CA_SECRET);
        let mut held = Vec::new();
        let mut released = hold_gets == 0;
        while let Some((request, send)) = handle.next_request().await {
            let method = request.method().clone();
            let path = request.uri().path().to_owned();
            let bytes = request.into_body().collect_bytes().await.unwrap();
            let body: serde_json::Value = if bytes.is_empty() {
                serde_json::Value::Null
            } else {
                serde_json::from_slice(&bytes).unwrap()
            };
            match method.as_str() {
                "GET" if path == secret_path && !released => {
                    held.push(send);
                    if held.len() == hold_gets {
                        released = true;
                        for send in held.drain(..) {
                            reply(send, 404, &status(404, "NotFound"));
                        }
                    }
                    continue;
                }
                "GET" => match objects.get(&path) {
                    Some(object) => reply(send, 200, object),
                    None => reply(send, 404, &status(404, "NotFound")),
                },
                "POST" => {
                    assert_eq!(path, SECRET_PATH);
                    if objects.contains_key(&secret_path) {
                        reply(send, 409, &status(409, "AlreadyExists"));
                    } else {
                        version += 1;
                        let mut object = body;
                        object["metadata"]["resourceVersion"] = version.to_string().into();
                        objects.insert(secret_path.clone(), object.clone());
                        reply(send, 201, &object);
                    }
                }
                "PUT" => {
                    let current = objects.get(&path).expect("replace of an existing object");
                    if current["metadata"]["resourceVersion"] != body["metadata"]["resourceVersion"]
                    {
                        reply(send, 409, &status(409, "Conflict"));
                    } else {
                        version += 1;
                        let mut object = body;
                        object["metadata"]["resourceVersion"] = version.to_string().into();
                        objects.insert(path, object.clone());
                        reply(send, 200, &object);
                    }
                }
                other => panic!("unexpected {other} {path}"),
            }
        }
        serde_json::json!({
            "secret": objects.get(&secret_path).cloned(),
            "mutating": objects.get(&format!("/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{}", names::MUTATING_CONFIGURATION)).cloned(),
            "validating": objects.get(&format!("/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{}", names::VALIDATING_CONFIGURATION)).cloned(),
        })
    }

    #[tokio::test]
    async fn two_replicas_starting_at_once_converge_on_one_ca_and_one_bundle() {
        let (client, handle) = mock_client();
        let server = tokio::spawn(fake_api_server(handle, 2));
        let cfg = SelfManaged::default();
        let replica = |client: Client, cfg: SelfManaged| async move {
            let store = CertStore::new();
            let mut serving = None;
            reconcile(&client, &cfg, &store, &mut serving)
                .await
                .unwrap();
            let (cert, issuer) = serving.expect("a serving certificate");
            (store.is_loaded(), cert, issuer)
        };
        let (a, b) = tokio::join!(
            replica(client.clone(), cfg.clone()),
            replica(client.clone(), cfg.clone())
        );
        drop(client);
        let state = server.await.unwrap();
        assert!(a.0 && b.0, "both replicas serve");
        // One CA: both serving certificates were issued by the CA that is in
        // the Secret, and that CA is the whole caBundle of every webhook.
        assert_eq!(a.2, b.2, "the replicas issued from different CAs");
        let stored: Secret = serde_json::from_value(state["secret"].clone()).unwrap();
        let ca = layout("baton-system").read::<Error>(&stored).unwrap();
        assert_eq!(ca.cert, a.2);
        let expected = crate::review::base64(ca.bundle.as_bytes());
        for kind in ["mutating", "validating"] {
            for hook in state[kind]["webhooks"].as_array().unwrap() {
                assert_eq!(hook["clientConfig"]["caBundle"], expected, "{kind}");
            }
        }
        assert_eq!(pem_blocks(&ca.bundle).len(), 1);
        // Both leaves verify against the bundle the API server now holds.
        let mut roots = rustls::RootCertStore::empty();
        roots.add(pem_blocks(&ca.bundle).remove(0).into()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            crate::tls::provider(),
        )
        .build()
        .unwrap();
        let name =
            rustls_pki_types::ServerName::try_from("baton-webhook.baton-system.svc").unwrap();
        for leaf in [&a.1, &b.1] {
            let der = pem_blocks(&leaf.cert_pem).remove(0);
            verifier
                .verify_server_cert(
                    &der.into(),
                    &[],
                    &name,
                    &[],
                    rustls_pki_types::UnixTime::now(),
                )
                .expect("leaf verifies against the caBundle");
        }
    }
}
