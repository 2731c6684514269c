//! Verdicts on certificates and what carries them (pure): `webhook`,
//! `identity` and `data-plane`.

use std::collections::BTreeSet;

use baton_crds::contract::{SYSTEM_NAMESPACE, identity as id, webhook as wh};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Endpoints, Secret};
use k8s_openapi::jiff::Timestamp;

use super::Check;
use super::cluster::{INSTALL, can_i};
use super::fetch::{DataPlane, Got, WebhookObjects};

/// The webhook CA warns this close to its expiry (it renews itself well
/// before, so a CA this close means renewal is failing).
pub const WEBHOOK_CA_WARN_DAYS: i64 = 7;
/// The identity CA warns this close to its expiry (renewing it is a
/// staged root rotation, which takes time).
pub const IDENTITY_CA_WARN_DAYS: i64 = 30;
/// At most this many namespaces are named in a data-plane failure.
pub const NAMESPACES_NAMED: usize = 3;
const DAY: i64 = 86_400;

/// One parsed certificate: what the checks need of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cert {
    pub der: Vec<u8>,
    pub subject: String,
    /// Unix seconds.
    pub not_after: i64,
}

/// Every certificate of a PEM bundle, in order (other blocks and blocks
/// that do not parse are skipped).
pub fn certificates(pem: &[u8]) -> Vec<Cert> {
    x509_parser::pem::Pem::iter_from_buffer(pem)
        .filter_map(Result::ok)
        .filter(|p| p.label == "CERTIFICATE")
        .filter_map(|p| {
            let cert = p.parse_x509().ok()?;
            Some(Cert {
                subject: cert.subject().to_string(),
                not_after: cert.validity().not_after.timestamp(),
                der: p.contents.clone(),
            })
        })
        .collect()
}

fn secret_key<'a>(secret: &'a Secret, key: &str) -> Option<&'a [u8]> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| b.0.as_slice())
}

fn date(unix: i64) -> String {
    Timestamp::from_second(unix).map_or_else(|_| unix.to_string(), |t| t.to_string())
}

/// A certificate's expiry: × when expired, ‼ within `warn_days`.
pub fn expiry(name: &str, cert: &Cert, now: i64, warn_days: i64, hint: &str) -> Check {
    let left = cert.not_after - now;
    let when = date(cert.not_after);
    if left <= 0 {
        Check::failure(name, format!("{} expired at {when}", cert.subject), hint)
    } else if left < warn_days * DAY {
        Check::warning(
            name,
            format!(
                "{} expires at {when}, in {}",
                cert.subject,
                crate::output::age(left)
            ),
            hint,
        )
    } else {
        Check::ok(
            name,
            format!("{} valid until {when} ({} days)", cert.subject, left / DAY),
        )
    }
}

fn webhook_logs() -> String {
    format!(
        "kubectl -n {SYSTEM_NAMESPACE} logs deployment/{}",
        wh::SERVICE
    )
}

/// `webhook`: the API server can reach the webhook and trusts what it
/// serves.
pub fn webhook(w: &WebhookObjects, now: i64) -> Vec<Check> {
    let (ca_check, ca) = webhook_ca(&w.ca, now);
    // (name, caBundle) of each entry: the two kinds' entry types differ.
    let mutating = w.mutating.as_ref().map(|c| {
        c.webhooks
            .iter()
            .flatten()
            .map(|h| (h.name.clone(), h.client_config.ca_bundle.clone()))
            .collect()
    });
    let validating = w.validating.as_ref().map(|c| {
        c.webhooks
            .iter()
            .flatten()
            .map(|h| (h.name.clone(), h.client_config.ca_bundle.clone()))
            .collect()
    });
    vec![
        endpoints(&w.endpoints),
        configuration(
            "MutatingWebhookConfiguration",
            wh::MUTATING_CONFIGURATION,
            &mutating,
            ca.as_ref(),
        ),
        configuration(
            "ValidatingWebhookConfiguration",
            wh::VALIDATING_CONFIGURATION,
            &validating,
            ca.as_ref(),
        ),
        ca_check,
    ]
}

/// The webhook Service has at least one ready address.
pub fn endpoints(got: &Got<Endpoints>) -> Check {
    let name = format!("{} Service endpoints", wh::SERVICE);
    let e = match got {
        Got::Found(e) => e,
        Got::Missing => return Check::failure(name, "Endpoints object not found", INSTALL),
        Got::Unreadable(why) => {
            return Check::failure(
                name,
                format!("cannot read: {why}"),
                can_i("get", "endpoints", Some(SYSTEM_NAMESPACE)),
            );
        }
    };
    let count = |f: fn(&k8s_openapi::api::core::v1::EndpointSubset) -> usize| -> usize {
        e.subsets.iter().flatten().map(f).sum()
    };
    let ready = count(|s| s.addresses.as_ref().map_or(0, Vec::len));
    let not_ready = count(|s| s.not_ready_addresses.as_ref().map_or(0, Vec::len));
    if ready > 0 {
        Check::ok(name, format!("{ready} ready"))
    } else {
        Check::failure(
            name,
            format!(
                "no ready endpoint ({not_ready} not ready): the API server cannot call the webhook, so injected namespaces cannot create Pods"
            ),
            format!(
                "kubectl -n {SYSTEM_NAMESPACE} get pods -l app.kubernetes.io/name={}",
                wh::SERVICE
            ),
        )
    }
}

/// The webhook CA from its Secret, and the check of its expiry.
pub fn webhook_ca(got: &Got<Secret>, now: i64) -> (Check, Option<Cert>) {
    let name = format!("webhook CA (Secret {})", wh::CA_SECRET);
    let secret = match got {
        Got::Found(s) => s,
        Got::Missing => {
            return (
                Check::failure(
                    name,
                    "not found",
                    format!("the webhook creates it when it starts: {}", webhook_logs()),
                ),
                None,
            );
        }
        Got::Unreadable(why) => {
            return (
                Check::failure(
                    name,
                    format!("cannot read: {why}"),
                    can_i("get", "secrets", Some(SYSTEM_NAMESPACE)),
                ),
                None,
            );
        }
    };
    let Some(cert) = secret_key(secret, wh::CA_CERT_KEY)
        .map(certificates)
        .and_then(|c| c.into_iter().next())
    else {
        return (
            Check::failure(
                name,
                format!("no certificate under {}", wh::CA_CERT_KEY),
                format!(
                    "delete the Secret and let the webhook recreate it: kubectl -n {SYSTEM_NAMESPACE} delete secret {}",
                    wh::CA_SECRET
                ),
            ),
            None,
        );
    };
    let hint = format!(
        "the webhook renews its CA ahead of expiry; find why it did not: {}",
        webhook_logs()
    );
    (
        expiry(&name, &cert, now, WEBHOOK_CA_WARN_DAYS, &hint),
        Some(cert),
    )
}

/// One webhook configuration: present, and every entry's `caBundle` holds
/// the current webhook CA.
///
/// Why this proves the API server trusts what the webhook serves: the
/// webhook's serving certificate is issued by the CA in Secret
/// baton-webhook-ca (webhook/src/ca.rs), and the API server verifies that
/// certificate against `caBundle`. The CLI cannot dial the in-cluster
/// Service itself, but if `caBundle` contains the CA that signs the serving
/// certificate, the API server's TLS handshake succeeds.
pub fn configuration(
    kind: &str,
    name: &str,
    entries: &Got<Vec<(String, Option<ByteString>)>>,
    ca: Option<&Cert>,
) -> Check {
    let label = format!("{kind} {name}");
    let entries = match entries {
        Got::Found(e) => e,
        Got::Missing => return Check::failure(label, "not found", INSTALL),
        Got::Unreadable(why) => {
            return Check::failure(
                label,
                format!("cannot read: {why}"),
                can_i("get", &format!("{}s", kind.to_lowercase()), None),
            );
        }
    };
    if entries.is_empty() {
        return Check::failure(label, "holds no webhook", INSTALL);
    }
    let Some(ca) = ca else {
        return Check::warning(
            label,
            format!(
                "{} webhooks; caBundle not verified: the webhook CA is unavailable",
                entries.len()
            ),
            webhook_logs(),
        );
    };
    let stale: Vec<&str> = entries
        .iter()
        .filter(|(_, bundle)| {
            !bundle
                .as_ref()
                .is_some_and(|b| certificates(&b.0).iter().any(|c| c.der == ca.der))
        })
        .map(|(n, _)| n.as_str())
        .collect();
    if stale.is_empty() {
        Check::ok(
            label,
            format!(
                "caBundle of {} webhooks trusts the current webhook CA",
                entries.len()
            ),
        )
    } else {
        Check::failure(
            label,
            format!(
                "caBundle of {} does not hold the current webhook CA: the API server would refuse the webhook's certificate",
                stale.join(", ")
            ),
            format!(
                "the webhook writes caBundle every minute; find why it did not: {}",
                webhook_logs()
            ),
        )
    }
}

/// The roots sidecars trust: `ca.crt` of the identity CA Secret, or
/// `tls.crt` when `ca.crt` is absent (a bare self-managed root), as the
/// operator publishes them (operator/src/identity/trust.rs).
pub fn trust_roots(secret: &Secret) -> Vec<Cert> {
    let roots = secret_key(secret, id::TRUST_KEY)
        .map(certificates)
        .unwrap_or_default();
    if roots.is_empty() {
        secret_key(secret, "tls.crt")
            .map(certificates)
            .unwrap_or_default()
    } else {
        roots
    }
}

fn identity_hint() -> String {
    format!(
        "renew the mesh CA in Secret {SYSTEM_NAMESPACE}/{} with a staged root rotation (docs/tls.md)",
        id::CA_SECRET
    )
}

/// `identity`: the mesh CA Secret holds an unexpired issuing certificate
/// and trust roots.
pub fn identity(got: &Got<Secret>, now: i64) -> Vec<Check> {
    let name = format!("identity CA (Secret {})", id::CA_SECRET);
    let secret = match got {
        Got::Found(s) => s,
        Got::Missing => {
            return vec![Check::failure(
                name,
                "not found",
                format!(
                    "the operator generates a self-managed root when it starts (kubectl -n {SYSTEM_NAMESPACE} logs deployment/baton-operator), or create it with tls.crt, tls.key and ca.crt"
                ),
            )];
        }
        Got::Unreadable(why) => {
            return vec![Check::failure(
                name,
                format!("cannot read: {why}"),
                can_i("get", "secrets", Some(SYSTEM_NAMESPACE)),
            )];
        }
    };
    let issuing = secret_key(secret, "tls.crt")
        .map(certificates)
        .and_then(|c| c.into_iter().next());
    let mut out = vec![match issuing {
        Some(cert) => expiry(&name, &cert, now, IDENTITY_CA_WARN_DAYS, &identity_hint()),
        None => Check::failure(name, "no certificate under tls.crt", identity_hint()),
    }];
    let roots = trust_roots(secret);
    let roots_name = "identity trust roots (ca.crt)";
    out.push(match roots.iter().min_by_key(|c| c.not_after) {
        None => Check::failure(roots_name, "no certificate", identity_hint()),
        Some(_) if roots.iter().all(|c| c.not_after <= now) => Check::failure(
            roots_name,
            format!("all {} expired", roots.len()),
            identity_hint(),
        ),
        Some(first) => {
            let mut c = expiry(
                roots_name,
                first,
                now,
                IDENTITY_CA_WARN_DAYS,
                &identity_hint(),
            );
            // An expired root next to a valid one is only clutter: the
            // valid one still verifies.
            if c.status == super::Status::Failure {
                c.status = super::Status::Warning;
                c.hint = Some(format!(
                    "remove the expired root from ca.crt of Secret {SYSTEM_NAMESPACE}/{}",
                    id::CA_SECRET
                ));
            }
            c
        }
    });
    out
}

/// `data-plane`: the trust bundle the webhook copies into every injected
/// Pod (ConfigMap baton-system/baton-mesh-trust) holds every current root,
/// and which injected Pods still depend on the per-namespace ConfigMap of
/// operators before decision 0058.
pub fn data_plane(dp: &DataPlane, ca: &Got<Secret>) -> Vec<Check> {
    let mut out = Vec::new();
    let mut meshed = BTreeSet::new();
    for (got, what, resource) in [
        (&dp.opted_in, "opted-in namespaces", "namespaces"),
        (&dp.injected_pods, "injected Pods", "pods --all-namespaces"),
    ] {
        match got {
            Got::Found(names) => meshed.extend(names.iter().cloned()),
            Got::Missing => {}
            Got::Unreadable(why) => out.push(Check::failure(
                format!("list {what}"),
                format!("cannot list: {why}"),
                can_i("list", resource, None),
            )),
        }
    }
    out.push(published_bundle(&dp.trust, ca));
    if meshed.is_empty() {
        if out.len() == 1 {
            out.push(Check::warning(
                "meshed namespaces",
                "none: no namespace is labelled baton.dev/inject=enabled and no Pod is injected",
                "kubectl label namespace <ns> baton.dev/inject=enabled",
            ));
        }
        return out;
    }
    if let Got::Found(legacy) = &dp.legacy_pods {
        out.push(legacy_pods(legacy));
    }
    out
}

/// The bundle the webhook copies: present, and holding every root of the
/// CA Secret (without the CA, the identity category says why, only
/// presence is checked).
fn published_bundle(trust: &Got<ConfigMap>, ca: &Got<Secret>) -> Check {
    let name = format!(
        "trust bundle (ConfigMap {SYSTEM_NAMESPACE}/{})",
        id::TRUST_CONFIG_MAP
    );
    let logs = format!("kubectl -n {SYSTEM_NAMESPACE} logs deployment/baton-operator");
    let bundle = match trust {
        Got::Found(cm) => cm.data.as_ref().and_then(|d| d.get(id::TRUST_KEY)),
        Got::Missing => None,
        Got::Unreadable(why) => {
            return Check::failure(
                name,
                format!("cannot read: {why}"),
                can_i("get", "configmaps", Some(SYSTEM_NAMESPACE)),
            );
        }
    };
    let Some(bundle) = bundle.filter(|b| !certificates(b.as_bytes()).is_empty()) else {
        return Check::failure(
            name,
            "missing: the webhook refuses opted-in Pods until the operator publishes it",
            format!(
                "the leading operator publishes it once it has a CA; find why it did not: {logs}"
            ),
        );
    };
    let Got::Found(secret) = ca else {
        return Check::ok(
            name,
            "present (not compared: the identity CA is unavailable); the webhook copies it into every Pod it injects",
        );
    };
    let have = certificates(bundle.as_bytes());
    let lacking = trust_roots(secret)
        .iter()
        .filter(|r| !have.iter().any(|c| c.der == r.der))
        .count();
    if lacking == 0 {
        Check::ok(
            name,
            "current: the webhook copies it into every Pod it injects",
        )
    } else {
        Check::failure(
            name,
            format!(
                "stale: {lacking} root(s) of Secret {SYSTEM_NAMESPACE}/{} missing, so new Pods would not trust them",
                id::CA_SECRET
            ),
            format!(
                "the leading operator republishes it within its reload interval; find why it did not: {logs}"
            ),
        )
    }
}

/// Injected Pods from before decision 0058: their config stream trusts
/// their namespace's old ConfigMap, which nothing updates any more.
fn legacy_pods(legacy: &[String]) -> Check {
    let name = "Pods injected with the per-namespace trust ConfigMap";
    if legacy.is_empty() {
        return Check::ok(name, "none: every injected Pod carries its trust bundle");
    }
    let mut named = legacy
        .iter()
        .take(NAMESPACES_NAMED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if legacy.len() > NAMESPACES_NAMED {
        named.push_str(&format!(" and {} more", legacy.len() - NAMESPACES_NAMED));
    }
    Check::warning(
        name,
        format!(
            "{} injected before the trust bundle moved into the Pod: {named}; their config streams could not reconnect after a root rotation",
            legacy.len()
        ),
        "re-create them (kubectl rollout restart of their workloads) before rotating the mesh root; then delete the old ConfigMaps (docs/operations.md)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::Status;
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
    };
    use serde_json::json;
    use std::time::Duration;

    /// 2024-01-01T00:00:00Z.
    const NOW: i64 = 1_704_067_200;

    /// A CA certificate valid from `NOW + from_days` for `days`.
    fn ca_pem(from_days: i64, days: u64) -> String {
        let start = time::OffsetDateTime::from_unix_timestamp(NOW + from_days * DAY).unwrap();
        baton_webhook::ca::generate_ca(start, Duration::from_secs(days * DAY as u64))
            .unwrap()
            .cert
    }

    fn secret(data: &[(&str, &str)]) -> Got<Secret> {
        Got::Found(Secret {
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
                    .collect(),
            ),
            ..Secret::default()
        })
    }

    #[test]
    fn pem_bundles_yield_every_certificate_with_its_expiry() {
        let a = ca_pem(0, 10);
        let b = ca_pem(0, 20);
        let certs = certificates(format!("{a}junk\n{b}").as_bytes());
        assert_eq!(certs.len(), 2);
        assert_eq!(certs[0].not_after, NOW + 10 * DAY);
        assert!(
            certs[0].subject.contains("baton-webhook-ca"),
            "{}",
            certs[0].subject
        );
        assert!(certificates(b"not pem").is_empty());
    }

    #[test]
    fn expiry_is_ok_far_off_warns_close_and_fails_past() {
        let cert = |days: i64| Cert {
            der: vec![],
            subject: "CN=x".into(),
            not_after: NOW + days * DAY,
        };
        let c = expiry("ca", &cert(100), NOW, 30, "h");
        assert_eq!(c.status, Status::Ok);
        assert_eq!(
            c.detail.as_deref(),
            Some("CN=x valid until 2024-04-10T00:00:00Z (100 days)")
        );
        let c = expiry("ca", &cert(3), NOW, 7, "h");
        assert_eq!(c.status, Status::Warning);
        assert_eq!(
            c.detail.as_deref(),
            Some("CN=x expires at 2024-01-04T00:00:00Z, in 3d0h")
        );
        assert_eq!(c.hint.as_deref(), Some("h"));
        let c = expiry("ca", &cert(-1), NOW, 7, "h");
        assert_eq!(c.status, Status::Failure);
        assert!(c.detail.unwrap().contains("expired at 2023-12-31"));
    }

    fn endpoints_with(ready: usize, not_ready: usize) -> Got<Endpoints> {
        let addr = |i: usize| json!({"ip": format!("10.0.0.{i}")});
        Got::Found(
            serde_json::from_value(json!({
                "metadata": {"name": "baton-webhook"},
                "subsets": [{
                    "addresses": (0..ready).map(addr).collect::<Vec<_>>(),
                    "notReadyAddresses": (0..not_ready).map(addr).collect::<Vec<_>>(),
                }],
            }))
            .unwrap(),
        )
    }

    #[test]
    fn endpoints_need_one_ready_address() {
        let c = endpoints(&endpoints_with(2, 0));
        assert_eq!(c.status, Status::Ok);
        assert_eq!(c.detail.as_deref(), Some("2 ready"));
        let c = endpoints(&endpoints_with(0, 1));
        assert_eq!(c.status, Status::Failure);
        assert!(
            c.detail
                .unwrap()
                .starts_with("no ready endpoint (1 not ready)")
        );
        assert_eq!(
            c.hint.as_deref(),
            Some("kubectl -n baton-system get pods -l app.kubernetes.io/name=baton-webhook")
        );
        // Scaled to 0: the Endpoints object has no subsets at all.
        let empty = Got::Found(serde_json::from_value(json!({"metadata": {}})).unwrap());
        assert_eq!(endpoints(&empty).status, Status::Failure);
        let c = endpoints(&Got::Missing);
        assert_eq!(c.hint.as_deref(), Some(INSTALL));
    }

    fn objects(ca: &str, bundle: &str) -> WebhookObjects {
        let b64 = |s: &str| serde_json::to_value(ByteString(s.as_bytes().to_vec())).unwrap();
        let entry = |name: &str| {
            json!({"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None",
                   "clientConfig": {"caBundle": b64(bundle)}})
        };
        let mutating: MutatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": {"name": "baton-sidecar-injector"},
            "webhooks": [entry("inject.baton.dev"), entry("inject-pod.baton.dev")],
        }))
        .unwrap();
        let validating: ValidatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": {"name": "baton-validator"},
            "webhooks": [entry("validate.baton.dev")],
        }))
        .unwrap();
        WebhookObjects {
            endpoints: endpoints_with(2, 0),
            mutating: Got::Found(mutating),
            validating: Got::Found(validating),
            ca: secret(&[("ca.crt", ca), ("ca-bundle.crt", bundle)]),
        }
    }

    #[test]
    fn a_healthy_webhook_passes_every_check() {
        let ca = ca_pem(0, 365);
        let previous = ca_pem(-10, 20);
        let checks = webhook(&objects(&ca, &format!("{ca}{previous}")), NOW);
        assert_eq!(checks.len(), 4);
        for c in &checks {
            assert_eq!(c.status, Status::Ok, "{c:?}");
        }
        assert_eq!(
            checks[1].detail.as_deref(),
            Some("caBundle of 2 webhooks trusts the current webhook CA")
        );
        assert_eq!(checks[3].name, "webhook CA (Secret baton-webhook-ca)");
    }

    #[test]
    fn a_ca_bundle_without_the_current_ca_fails() {
        let ca = ca_pem(0, 365);
        let other = ca_pem(0, 365);
        let checks = webhook(&objects(&ca, &other), NOW);
        assert_eq!(checks[1].status, Status::Failure);
        assert!(
            checks[1]
                .detail
                .clone()
                .unwrap()
                .starts_with("caBundle of inject.baton.dev, inject-pod.baton.dev does not hold")
        );
        assert!(
            checks[1]
                .hint
                .clone()
                .unwrap()
                .contains("logs deployment/baton-webhook")
        );
        assert_eq!(checks[2].status, Status::Failure);
        let empty = webhook(&objects(&ca, ""), NOW);
        assert_eq!(empty[2].status, Status::Failure);
    }

    #[test]
    fn a_webhook_ca_close_to_expiry_warns_and_an_expired_one_fails() {
        let soon = ca_pem(-300, 303);
        let checks = webhook(&objects(&soon, &soon), NOW);
        assert_eq!(checks[3].status, Status::Warning);
        assert!(checks[3].hint.clone().unwrap().contains("renews its CA"));
        let past = ca_pem(-300, 299);
        assert_eq!(
            webhook(&objects(&past, &past), NOW)[3].status,
            Status::Failure
        );
    }

    #[test]
    fn missing_webhook_objects_fail_and_an_unknown_ca_leaves_the_bundle_unverified() {
        let ca = ca_pem(0, 365);
        let mut w = objects(&ca, &ca);
        w.mutating = Got::Missing;
        w.validating = Got::Unreadable("403 Forbidden: no".into());
        w.ca = Got::Missing;
        let checks = webhook(&w, NOW);
        assert_eq!(checks[1].status, Status::Failure);
        assert_eq!(checks[1].hint.as_deref(), Some(INSTALL));
        assert_eq!(checks[2].status, Status::Failure);
        assert!(
            checks[2]
                .hint
                .clone()
                .unwrap()
                .contains("can-i get validatingwebhookconfigurations")
        );
        assert_eq!(checks[3].status, Status::Failure);
        assert!(
            checks[3]
                .hint
                .clone()
                .unwrap()
                .contains("the webhook creates it")
        );
        let mut w = objects(&ca, &ca);
        w.ca = secret(&[("ca.crt", "garbage")]);
        let checks = webhook(&w, NOW);
        assert_eq!(checks[1].status, Status::Warning);
        assert_eq!(checks[3].status, Status::Failure);
        assert_eq!(
            checks[3].detail.as_deref(),
            Some("no certificate under ca.crt")
        );
    }

    #[test]
    fn a_valid_identity_ca_shows_its_expiry() {
        let root = ca_pem(0, 365);
        let checks = identity(&secret(&[("tls.crt", &root), ("ca.crt", &root)]), NOW);
        assert_eq!(checks.len(), 2);
        assert!(checks.iter().all(|c| c.status == Status::Ok), "{checks:?}");
        assert!(
            checks[0]
                .detail
                .clone()
                .unwrap()
                .contains("valid until 2024-12-")
        );
        assert_eq!(checks[0].name, "identity CA (Secret baton-identity-ca)");
        // A bare root: tls.crt alone is the trust bundle.
        let checks = identity(&secret(&[("tls.crt", &root)]), NOW);
        assert_eq!(checks[1].status, Status::Ok);
    }

    #[test]
    fn an_identity_ca_under_30_days_warns_and_an_expired_one_fails() {
        let soon = ca_pem(-300, 320);
        let checks = identity(&secret(&[("tls.crt", &soon), ("ca.crt", &soon)]), NOW);
        assert_eq!(checks[0].status, Status::Warning);
        assert!(checks[0].hint.clone().unwrap().contains("root rotation"));
        let past = ca_pem(-300, 100);
        let checks = identity(&secret(&[("tls.crt", &past), ("ca.crt", &past)]), NOW);
        assert_eq!(checks[0].status, Status::Failure);
        assert_eq!(checks[1].status, Status::Failure);
        assert_eq!(checks[1].detail.as_deref(), Some("all 1 expired"));
    }

    #[test]
    fn an_expired_root_next_to_a_valid_one_only_warns() {
        let root = ca_pem(0, 365);
        let old = ca_pem(-300, 100);
        let checks = identity(
            &secret(&[("tls.crt", &root), ("ca.crt", &format!("{root}{old}"))]),
            NOW,
        );
        assert_eq!(checks[0].status, Status::Ok);
        assert_eq!(checks[1].status, Status::Warning);
        assert!(
            checks[1]
                .hint
                .clone()
                .unwrap()
                .contains("remove the expired root")
        );
    }

    #[test]
    fn a_missing_unreadable_or_empty_identity_secret_fails() {
        let c = &identity(&Got::Missing, NOW)[0];
        assert_eq!(c.status, Status::Failure);
        assert!(
            c.hint
                .clone()
                .unwrap()
                .contains("tls.crt, tls.key and ca.crt")
        );
        let c = &identity(&Got::Unreadable("403 Forbidden: no".into()), NOW)[0];
        assert!(
            c.hint
                .clone()
                .unwrap()
                .contains("can-i get secrets -n baton-system")
        );
        let checks = identity(&secret(&[]), NOW);
        assert_eq!(
            checks[0].detail.as_deref(),
            Some("no certificate under tls.crt")
        );
        assert_eq!(checks[1].status, Status::Failure);
    }

    fn trust_map(bundle: &str) -> ConfigMap {
        serde_json::from_value(json!({
            "metadata": {"name": "baton-mesh-trust", "namespace": "baton-system"},
            "data": {"ca.crt": bundle},
        }))
        .unwrap()
    }

    fn plane(opted_in: &[&str], injected: &[&str], trust: Got<ConfigMap>) -> DataPlane {
        let names = |v: &[&str]| Got::Found(v.iter().map(|s| (*s).to_owned()).collect());
        DataPlane {
            opted_in: names(opted_in),
            injected_pods: names(injected),
            legacy_pods: names(&[]),
            trust,
        }
    }

    #[test]
    fn the_published_bundle_with_every_current_root_passes() {
        let root = ca_pem(0, 365);
        let ca = secret(&[("tls.crt", &root), ("ca.crt", &root)]);
        let dp = plane(&["a"], &["b", "b"], Got::Found(trust_map(&root)));
        let checks = data_plane(&dp, &ca);
        assert_eq!(checks.len(), 2, "{checks:?}");
        assert_eq!(checks[0].status, Status::Ok);
        assert_eq!(
            checks[0].name,
            "trust bundle (ConfigMap baton-system/baton-mesh-trust)"
        );
        assert!(checks[0].detail.clone().unwrap().starts_with("current"));
        assert_eq!(checks[1].status, Status::Ok, "no Pod from before 0058");
    }

    #[test]
    fn a_missing_or_stale_published_bundle_fails_saying_what_it_costs() {
        let root = ca_pem(0, 365);
        let new = ca_pem(0, 365);
        // Rotation step 1: the Secret trusts a second root.
        let both = format!("{root}{new}");
        let ca = secret(&[("tls.crt", &root), ("ca.crt", &both)]);
        let checks = data_plane(&plane(&["a"], &[], Got::Found(trust_map(&root))), &ca);
        assert_eq!(checks[0].status, Status::Failure);
        assert!(
            checks[0]
                .detail
                .clone()
                .unwrap()
                .starts_with("stale: 1 root(s)"),
            "{:?}",
            checks[0].detail
        );
        assert!(
            checks[0]
                .hint
                .clone()
                .unwrap()
                .contains("logs deployment/baton-operator")
        );
        for trust in [Got::Missing, Got::Found(trust_map(""))] {
            let checks = data_plane(&plane(&["a"], &[], trust), &ca);
            assert_eq!(checks[0].status, Status::Failure);
            assert!(
                checks[0]
                    .detail
                    .clone()
                    .unwrap()
                    .contains("the webhook refuses opted-in Pods")
            );
        }
        // The bundle is checked even before anything is meshed: the first
        // Pods need it.
        let checks = data_plane(&plane(&[], &[], Got::Missing), &ca);
        assert_eq!(checks[0].status, Status::Failure);
    }

    #[test]
    fn pods_injected_before_the_bundle_moved_into_the_pod_are_named() {
        let root = ca_pem(0, 365);
        let ca = secret(&[("tls.crt", &root), ("ca.crt", &root)]);
        let mut dp = plane(&["a"], &["a"], Got::Found(trust_map(&root)));
        dp.legacy_pods = Got::Found(
            ["a/w-1", "a/w-2", "b/x-1", "c/y-1"]
                .map(String::from)
                .to_vec(),
        );
        let checks = data_plane(&dp, &ca);
        let legacy = &checks[1];
        assert_eq!(legacy.status, Status::Warning);
        assert_eq!(
            legacy.detail.as_deref(),
            Some(
                "4 injected before the trust bundle moved into the Pod: a/w-1, a/w-2, b/x-1 and 1 more; their config streams could not reconnect after a root rotation"
            )
        );
        assert!(
            legacy
                .hint
                .clone()
                .unwrap()
                .contains("before rotating the mesh root")
        );
    }

    #[test]
    fn no_meshed_namespace_warns_and_unlistable_objects_fail() {
        let ca = Got::Missing;
        let root = ca_pem(0, 365);
        let checks = data_plane(&plane(&[], &[], Got::Found(trust_map(&root))), &ca);
        // Without the CA only presence is checked.
        assert_eq!(checks[0].status, Status::Ok);
        assert!(checks[0].detail.clone().unwrap().contains("not compared"));
        assert_eq!(checks[1].status, Status::Warning);
        assert_eq!(
            checks[1].hint.as_deref(),
            Some("kubectl label namespace <ns> baton.dev/inject=enabled")
        );
        let mut dp = plane(&["a"], &[], Got::Found(trust_map(&root)));
        dp.injected_pods = Got::Unreadable("403 Forbidden: no".into());
        let checks = data_plane(&dp, &ca);
        assert_eq!(checks[0].status, Status::Failure);
        assert!(
            checks[0]
                .hint
                .clone()
                .unwrap()
                .contains("can-i list pods --all-namespaces")
        );
        dp.trust = Got::Unreadable("403 Forbidden: no".into());
        let checks = data_plane(&dp, &ca);
        assert_eq!(checks[1].status, Status::Failure);
        assert!(
            checks[1]
                .hint
                .clone()
                .unwrap()
                .contains("can-i get configmaps")
        );
    }
}
