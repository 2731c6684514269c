//! The I/O of `status`: Pods (paged), SidecarReleases, and the operator
//! replicas' `/sidecars` reports through the API server's Pod proxy. What
//! cannot be read beyond the Pods becomes a warning, not a failure.

use anyhow::Context as _;
use baton_crds::SidecarRelease;
use baton_crds::contract::{SYSTEM_NAMESPACE, labels};
use baton_crds::sidecars::{self, Report};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;

/// Pods per list call; continue tokens fetch the rest.
pub const PAGE_SIZE: u32 = 500;
/// The operator replicas (in [`SYSTEM_NAMESPACE`]).
pub const OPERATOR_SELECTOR: &str = "app.kubernetes.io/name=baton-operator";
/// The operator's admin port, which serves [`sidecars::PATH`].
pub const OPERATOR_ADMIN_PORT: u16 = 9090;

/// Everything the join needs.
#[derive(Debug, Clone, Default)]
pub struct Fetched {
    /// The injected Pods in scope.
    pub pods: Vec<Pod>,
    /// Every SidecarRelease; `None` when they could not be listed.
    pub releases: Option<Vec<SidecarRelease>>,
    /// Why the releases could not be listed.
    pub releases_error: Option<String>,
    pub reports: Reports,
}

/// The operator replicas' reports.
#[derive(Debug, Clone, Default)]
pub struct Reports {
    /// Running operator replicas found (0 also when they could not be listed).
    pub replicas: usize,
    /// The reports read.
    pub reports: Vec<Report>,
    /// One line per replica (or list) that could not be read.
    pub errors: Vec<String>,
}

impl Reports {
    /// Every replica answered (and there was at least one).
    pub fn complete(&self) -> bool {
        self.errors.is_empty() && self.replicas > 0 && self.reports.len() == self.replicas
    }
}

impl Fetched {
    /// The one-line warnings for stderr.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(e) = &self.releases_error {
            out.push(format!(
                "cannot list SidecarReleases ({e}); the release summary lacks spec versions and rollouts"
            ));
        }
        if let Some(w) = report_warning(&self.reports) {
            out.push(w);
        }
        out
    }
}

/// The one-line warning about the reports, if any is missing.
pub fn report_warning(reports: &Reports) -> Option<String> {
    if reports.complete() {
        if !reports.reports.is_empty() && reports.reports.iter().all(|r| !r.config_push) {
            return Some(
                "config push is off on every operator replica: no config is sent (CONFIG: NOT SENT)"
                    .into(),
            );
        }
        return None;
    }
    let why = match reports.errors.as_slice() {
        [] if reports.replicas == 0 => {
            format!("no running operator replica in {SYSTEM_NAMESPACE} ({OPERATOR_SELECTOR})")
        }
        [] => "a replica's report is missing".to_owned(),
        [one] => one.clone(),
        [first, rest @ ..] => format!("{first} (and {} more)", rest.len()),
    };
    Some(format!(
        "config sync and certificates unknown (?) where no replica answered: {why}"
    ))
}

/// `baton.dev/injected` and the user's selector.
pub fn pod_selector(user: Option<&str>) -> String {
    match user.map(str::trim) {
        Some(s) if !s.is_empty() => format!("{},{s}", labels::INJECTED),
        _ => labels::INJECTED.to_owned(),
    }
}

/// Everything, the three parts concurrently. Only the Pods are required.
pub async fn fetch(
    client: &kube::Client,
    namespace: Option<&str>,
    selector: Option<&str>,
) -> anyhow::Result<Fetched> {
    let selector = pod_selector(selector);
    let (pods, releases, reports) = futures::join!(
        list_pods(client, namespace, &selector),
        list_releases(client),
        fetch_reports(client),
    );
    let (releases, releases_error) = match releases {
        Ok(r) => (Some(r), None),
        Err(e) => (None, Some(e)),
    };
    Ok(Fetched {
        pods: pods?,
        releases,
        releases_error,
        reports,
    })
}

/// The Pods matching `selector`, [`PAGE_SIZE`] per call.
pub async fn list_pods(
    client: &kube::Client,
    namespace: Option<&str>,
    selector: &str,
) -> anyhow::Result<Vec<Pod>> {
    let api: Api<Pod> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let mut params = ListParams::default().labels(selector).limit(PAGE_SIZE);
    let mut pods = Vec::new();
    loop {
        let page = api.list(&params).await.with_context(|| {
            format!(
                "cannot list Pods ({selector}) in {}",
                namespace.map_or("any namespace".to_owned(), |ns| format!("namespace {ns}"))
            )
        })?;
        pods.extend(page.items);
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => break,
        }
    }
    Ok(pods)
}

async fn list_releases(client: &kube::Client) -> Result<Vec<SidecarRelease>, String> {
    Api::<SidecarRelease>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .map_err(|e| describe(&e, "list sidecarreleases"))
}

/// Every running operator replica's report; what fails is an error line.
pub async fn fetch_reports(client: &kube::Client) -> Reports {
    let api: Api<Pod> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let replicas = match api
        .list(&ListParams::default().labels(OPERATOR_SELECTOR))
        .await
    {
        Ok(list) => list.items,
        Err(e) => {
            return Reports {
                errors: vec![format!(
                    "cannot list the operator Pods: {}",
                    describe(&e, "list pods in baton-system")
                )],
                ..Reports::default()
            };
        }
    };
    let names: Vec<String> = replicas
        .iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let answers =
        futures::future::join_all(names.iter().map(|name| fetch_report(client, name))).await;
    let mut out = Reports {
        replicas: names.len(),
        ..Reports::default()
    };
    for (name, answer) in names.iter().zip(answers) {
        match answer {
            Ok(report) => out.reports.push(report),
            Err(e) => out.errors.push(format!("operator {name}: {e}")),
        }
    }
    out
}

/// The API server's proxy path of `pod`'s report.
pub fn report_path(pod: &str) -> String {
    format!(
        "/api/v1/namespaces/{SYSTEM_NAMESPACE}/pods/{pod}:{OPERATOR_ADMIN_PORT}/proxy{}",
        sidecars::PATH
    )
}

/// One replica's report.
pub async fn fetch_report(client: &kube::Client, pod: &str) -> Result<Report, String> {
    let request = http::Request::get(report_path(pod))
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    let text = client
        .request_text(request)
        .await
        .map_err(|e| describe(&e, "get pods/proxy in baton-system"))?;
    serde_json::from_str(&text).map_err(|e| {
        format!("unreadable /sidecars report ({e}); is the operator older than this CLI?")
    })
}

/// A short reason, naming the permission on a 403 and the likely cause on
/// a 404.
fn describe(e: &kube::Error, verb: &str) -> String {
    match e {
        kube::Error::Api(s) if s.code == 403 => format!("forbidden: needs RBAC to {verb}"),
        kube::Error::Api(s) if s.code == 404 => {
            format!(
                "not found (404): {}; an operator or CRDs older than this CLI?",
                s.message.trim()
            )
        }
        kube::Error::Api(s) => format!("{} ({}): {}", s.reason, s.code, s.message.trim()),
        e => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_controlplane::testing::{mock_client, reply, status};
    use serde_json::json;

    #[test]
    fn the_selector_always_requires_injection() {
        assert_eq!(pod_selector(None), "baton.dev/injected");
        assert_eq!(pod_selector(Some("  ")), "baton.dev/injected");
        assert_eq!(pod_selector(Some("app=web")), "baton.dev/injected,app=web");
    }

    #[test]
    fn the_report_is_read_through_the_pod_proxy() {
        assert_eq!(
            report_path("baton-operator-7d9-x"),
            "/api/v1/namespaces/baton-system/pods/baton-operator-7d9-x:9090/proxy/sidecars"
        );
    }

    #[test]
    fn missing_reports_make_one_warning_line() {
        let all = Reports {
            replicas: 2,
            reports: vec![
                Report {
                    config_push: true,
                    ..Report::default()
                };
                2
            ],
            errors: vec![],
        };
        assert_eq!(report_warning(&all), None);
        let none = Reports::default();
        assert!(
            report_warning(&none)
                .unwrap()
                .contains("no running operator replica")
        );
        let two_failed = Reports {
            replicas: 2,
            reports: vec![],
            errors: vec![
                "operator a: forbidden".into(),
                "operator b: forbidden".into(),
            ],
        };
        let w = report_warning(&two_failed).unwrap();
        assert!(w.contains("operator a: forbidden (and 1 more)"), "{w}");
        assert!(!w.contains('\n'));
        let off = Reports {
            replicas: 1,
            reports: vec![Report::default()],
            errors: vec![],
        };
        assert!(report_warning(&off).unwrap().contains("config push is off"));
    }

    fn pod_json(ns: &str, name: &str) -> serde_json::Value {
        json!({"metadata": {"name": name, "namespace": ns, "labels": {"baton.dev/injected": "true"}},
               "status": {"phase": "Running"}})
    }

    /// A mock API server: two pages of Pods, one release, two operator
    /// replicas of which one is forbidden.
    #[tokio::test]
    async fn fetch_pages_through_pods_and_tolerates_a_forbidden_replica() {
        let (client, mut handle) = mock_client();
        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..6 {
                let (request, send) = handle.next_request().await.expect("a request");
                let path = request.uri().path().to_owned();
                let query = request.uri().query().unwrap_or_default().to_owned();
                seen.push(format!("{path}?{query}"));
                let (code, body) = match path.as_str() {
                    "/api/v1/namespaces/shop/pods" if query.contains("continue=tok1") => (
                        200,
                        json!({"kind": "PodList", "apiVersion": "v1", "metadata": {},
                               "items": [pod_json("shop", "web-2")]}),
                    ),
                    "/api/v1/namespaces/shop/pods" => (
                        200,
                        json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"continue": "tok1"},
                               "items": [pod_json("shop", "web-1")]}),
                    ),
                    "/apis/baton.dev/v1alpha1/sidecarreleases" => (
                        200,
                        json!({"kind": "SidecarReleaseList", "apiVersion": "baton.dev/v1alpha1", "metadata": {},
                               "items": [{"apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
                                          "metadata": {"name": "default"},
                                          "spec": {"version": "2", "image": "s:2", "emptyImage": "e"}}]}),
                    ),
                    "/api/v1/namespaces/baton-system/pods" => (
                        200,
                        json!({"kind": "PodList", "apiVersion": "v1", "metadata": {},
                               "items": [pod_json("baton-system", "op-1"), pod_json("baton-system", "op-2")]}),
                    ),
                    "/api/v1/namespaces/baton-system/pods/op-1:9090/proxy/sidecars" => (
                        200,
                        json!({"configPush": true,
                               "sidecars": [{"pod": "shop/web-1", "sent": 3, "acked": 3}],
                               "certificates": [{"pod": "shop/web-1", "notAfter": 1000}]}),
                    ),
                    "/api/v1/namespaces/baton-system/pods/op-2:9090/proxy/sidecars" => {
                        (403, status(403, "Forbidden"))
                    }
                    other => panic!("unexpected request {other}"),
                };
                reply(send, code, &body);
            }
            seen
        });
        let fetched = fetch(&client, Some("shop"), Some("app=web")).await.unwrap();
        let seen = server.await.unwrap();
        let names: Vec<_> = fetched
            .pods
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["web-1", "web-2"]);
        let first_page = seen
            .iter()
            .find(|s| s.starts_with("/api/v1/namespaces/shop/pods?") && !s.contains("continue"))
            .unwrap();
        assert!(first_page.contains("limit=500"), "{first_page}");
        assert!(
            first_page.contains("labelSelector=baton.dev%2Finjected%2Capp%3Dweb"),
            "{first_page}"
        );
        let operators = seen
            .iter()
            .find(|s| s.starts_with("/api/v1/namespaces/baton-system/pods?"))
            .unwrap();
        assert!(
            operators.contains("app.kubernetes.io%2Fname%3Dbaton-operator"),
            "{operators}"
        );
        assert_eq!(fetched.releases.as_ref().unwrap().len(), 1);
        assert_eq!(fetched.reports.replicas, 2);
        assert_eq!(fetched.reports.reports.len(), 1);
        assert!(!fetched.reports.complete());
        assert_eq!(fetched.reports.errors.len(), 1);
        assert!(
            fetched.reports.errors[0].contains("operator op-2: forbidden"),
            "{:?}",
            fetched.reports.errors
        );
        let warnings = fetched.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
    }

    #[tokio::test]
    async fn a_pod_list_failure_is_the_commands_error() {
        let (client, mut handle) = mock_client();
        let server = tokio::spawn(async move {
            for _ in 0..3 {
                let (request, send) = handle.next_request().await.expect("a request");
                let code = if request.uri().path() == "/api/v1/pods" {
                    403
                } else {
                    404
                };
                reply(send, code, &status(code, "nope"));
            }
        });
        let err = fetch(&client, None, None).await.unwrap_err();
        server.await.unwrap();
        assert!(format!("{err:#}").contains("cannot list Pods"), "{err:#}");
    }
}
