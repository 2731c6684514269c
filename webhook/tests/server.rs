//! In-process HTTPS tests: the real server on 127.0.0.1 port 0, real TLS
//! (certificates from the self-managed CA code), real HTTP/1.1 and HTTP/2,
//! real AdmissionReview bodies.

use std::{sync::Arc, time::Duration};

use baton_crds::contract::{annotations, containers, labels, webhook as names};
use baton_webhook::{
    admin::Admin,
    ca,
    cache::{Snapshot, StaticState},
    handler::Admission,
    inject::{InjectConfig, ServerVersion},
    metrics::{self, Metrics},
    spawn_servers,
    tls::{CertFiles, CertStore},
    validate::PodPorts,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use rustls_pki_types::{CertificateDer, ServerName, pem::PemObject};
use serde_json::{Value, json};
use time::OffsetDateTime;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

const SNI: &str = "baton-webhook.baton-system.svc";

struct Harness {
    addr: std::net::SocketAddr,
    admin_addr: std::net::SocketAddr,
    ca: ca::CaPem,
    store: Arc<CertStore>,
    stop: CancellationToken,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn snapshot() -> Snapshot {
    let mesh_root =
        ca::generate_ca(OffsetDateTime::now_utc(), Duration::from_secs(86_400)).unwrap();
    let release = serde_json::from_value(json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
        "metadata": {"name": "default"},
        "spec": {"version": "1.0.0", "image": "baton/sidecar:1.0.0", "emptyImage": "baton/empty:1"},
    }))
    .unwrap();
    let route = serde_json::from_value(json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "Route",
        "metadata": {"name": "existing", "namespace": "apps"},
        "spec": {"parentRef": {"name": "web", "port": 80}, "rules": [{"backendRefs": [{"name": "web", "port": 80}]}]},
    }))
    .unwrap();
    Snapshot {
        namespace_labels: [(labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned())].into(),
        releases: vec![Arc::new(release)],
        routes: vec![Arc::new(route)],
        server_version: Some(ServerVersion::new(1, 20)),
        pods: vec![PodPorts {
            name: "web-1".into(),
            labels: [("app".to_owned(), "web".to_owned())].into(),
            port_names: ["http".to_owned(), "metrics".to_owned()].into(),
        }],
        // The operator's published mesh roots, copied into every injected Pod.
        trust_bundle: Some(mesh_root.bundle.into()),
        ..Snapshot::default()
    }
}

fn issue(ca: &ca::CaPem) -> ca::ServingCert {
    ca::issue_serving(
        ca,
        &ca::service_dns_names("baton-webhook", "baton-system"),
        &["127.0.0.1".parse().unwrap()],
        OffsetDateTime::now_utc(),
        Duration::from_secs(3600),
    )
    .unwrap()
}

async fn start() -> Harness {
    let ca = ca::generate_ca(OffsetDateTime::now_utc(), Duration::from_secs(86_400)).unwrap();
    let cert = issue(&ca);
    let store = CertStore::new();
    store
        .store_pem(cert.cert_pem.as_bytes(), cert.key_pem.as_bytes())
        .unwrap();
    let mut registry = metrics::registry();
    let metrics = Arc::new(Metrics::register(&mut registry));
    let state: Arc<StaticState> = Arc::new(StaticState(snapshot()));
    let admission = Arc::new(Admission::new(
        state.clone(),
        InjectConfig::default(),
        metrics.clone(),
        None,
    ));
    let admin = Arc::new(Admin {
        store: store.clone(),
        state,
        registry: Arc::new(registry),
        metrics,
        draining: Default::default(),
    });
    let stop = CancellationToken::new();
    let servers = spawn_servers(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        admission,
        admin,
        store.clone(),
        stop.clone(),
    )
    .unwrap();
    Harness {
        addr: servers.addr,
        admin_addr: servers.admin_addr,
        ca,
        store,
        stop,
    }
}

fn client_config(ca_pem: &str, alpn: &[u8]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(baton_webhook::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    Arc::new(config)
}

type Tls = tokio_rustls::client::TlsStream<TcpStream>;

async fn connect(h: &Harness, alpn: &[u8]) -> Tls {
    let tcp = TcpStream::connect(h.addr).await.unwrap();
    tokio_rustls::TlsConnector::from(client_config(&h.ca.bundle, alpn))
        .connect(ServerName::try_from(SNI).unwrap(), tcp)
        .await
        .unwrap()
}

fn peer_leaf(tls: &Tls) -> Vec<u8> {
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

/// An HTTP/1.1 connection that can send several requests.
struct H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>);

impl H1 {
    async fn open(tls: Tls) -> Self {
        let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .unwrap();
        tokio::spawn(conn);
        Self(send)
    }

    async fn send(&mut self, method: &str, path: &str, body: Vec<u8>) -> (u16, Bytes) {
        let req = http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", SNI)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = self.0.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.into_body().collect().await.unwrap().to_bytes())
    }
}

async fn post(h: &Harness, path: &str, body: Vec<u8>) -> (u16, Bytes) {
    H1::open(connect(h, b"http/1.1").await)
        .await
        .send("POST", path, body)
        .await
}

fn review(kind: Value, resource: &str, object: Option<Value>) -> Vec<u8> {
    let mut request = json!({
        "uid": "d5d8c8a2-8b4e-4b84-9d29-4b1b2f1c0c11",
        "kind": kind,
        "resource": {"group": kind["group"], "version": kind["version"], "resource": resource},
        "namespace": "apps",
        "operation": "CREATE",
        "userInfo": {"username": "tester"},
    });
    if let Some(o) = object {
        request["object"] = o;
    }
    serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})).unwrap()
}

fn pod() -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "web-1", "namespace": "apps", "labels": {"app": "web"}},
           "spec": {"containers": [{"name": "app", "image": "app:1"}]}})
}

fn pod_kind() -> Value {
    json!({"group": "", "version": "v1", "kind": "Pod"})
}

fn response_of(body: &Bytes) -> Value {
    let v: Value = serde_json::from_slice(body).unwrap();
    assert_eq!(v["kind"], "AdmissionReview");
    assert_eq!(v["response"]["uid"], "d5d8c8a2-8b4e-4b84-9d29-4b1b2f1c0c11");
    v["response"].clone()
}

#[tokio::test]
async fn a_pod_review_over_https_gets_a_json_patch_that_injects_the_sidecar() {
    let h = start().await;
    let (status, body) = post(
        &h,
        names::MUTATE_PODS_PATH,
        review(pod_kind(), "pods", Some(pod())),
    )
    .await;
    assert_eq!(status, 200);
    let resp = response_of(&body);
    assert_eq!(resp["allowed"], true);
    assert_eq!(resp["patchType"], "JSONPatch");
    use base64_decode as b64;
    let patch: json_patch::Patch =
        serde_json::from_slice(&b64(resp["patch"].as_str().unwrap())).unwrap();
    let mut doc = pod();
    json_patch::patch(&mut doc, &patch).unwrap();
    assert_eq!(doc["spec"]["containers"][0]["name"], containers::SLOT_A);
    assert_eq!(
        doc["metadata"]["annotations"][annotations::STATUS],
        "injected"
    );

    // Submitting the injected pod again (reinvocation) yields no patch.
    let (status, body) = post(
        &h,
        names::MUTATE_PODS_PATH,
        review(pod_kind(), "pods", Some(doc)),
    )
    .await;
    assert_eq!(status, 200);
    let resp = response_of(&body);
    assert_eq!(resp["allowed"], true);
    assert!(resp.get("patch").is_none(), "{resp}");
}

#[tokio::test]
async fn http2_is_negotiated_and_served() {
    let h = start().await;
    let tls = connect(&h, b"h2").await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("https://{SNI}{}", names::MUTATE_PODS_PATH))
        .body(Full::new(Bytes::from(review(
            pod_kind(),
            "pods",
            Some(pod()),
        ))))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(response_of(&body)["allowed"], true);
}

#[tokio::test]
async fn malformed_json_is_a_400_with_a_message_not_a_500() {
    let h = start().await;
    for body in [
        b"{not json".to_vec(),
        b"".to_vec(),
        br#"{"kind":"Pod"}"#.to_vec(),
    ] {
        let (status, text) = post(&h, names::MUTATE_PODS_PATH, body).await;
        assert_eq!(status, 400);
        assert!(!text.is_empty());
    }
}

#[tokio::test]
async fn a_review_of_the_wrong_kind_is_denied_with_a_clear_message() {
    let h = start().await;
    let kind = json!({"group": "apps", "version": "v1", "kind": "Deployment"});
    let (status, body) = post(
        &h,
        names::MUTATE_PODS_PATH,
        review(
            kind,
            "deployments",
            Some(json!({"metadata": {"name": "d"}})),
        ),
    )
    .await;
    assert_eq!(status, 200);
    let resp = response_of(&body);
    assert_eq!(resp["allowed"], false);
    let message = resp["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("only handles core/v1 Pods, got apps/v1 Deployment"),
        "{message}"
    );
    assert_eq!(resp["status"]["code"], 403);
}

#[tokio::test]
async fn a_review_without_object_is_denied_with_a_clear_message() {
    let h = start().await;
    let (status, body) = post(
        &h,
        names::MUTATE_PODS_PATH,
        review(pod_kind(), "pods", None),
    )
    .await;
    assert_eq!(status, 200);
    let resp = response_of(&body);
    assert_eq!(resp["allowed"], false);
    assert!(
        resp["status"]["message"]
            .as_str()
            .unwrap()
            .contains("has no object")
    );
}

#[tokio::test]
async fn unknown_paths_are_404_and_wrong_methods_405() {
    let h = start().await;
    let mut conn = H1::open(connect(&h, b"http/1.1").await).await;
    assert_eq!(
        conn.send("POST", "/mutate", review(pod_kind(), "pods", Some(pod())))
            .await
            .0,
        404
    );
    assert_eq!(conn.send("GET", "/", vec![]).await.0, 404);
    assert_eq!(
        conn.send("GET", names::MUTATE_PODS_PATH, vec![]).await.0,
        405
    );
}

#[tokio::test]
async fn an_invalid_route_is_refused_by_validate_with_the_field_path() {
    let h = start().await;
    let kind = json!({"group": "baton.dev", "version": "v1alpha1", "kind": "Route"});
    let route = json!({"apiVersion": "baton.dev/v1alpha1", "kind": "Route",
                       "metadata": {"name": "r", "namespace": "apps"},
                       "spec": {"parentRef": {"name": "api", "port": 80},
                                "rules": [{"backendRefs": [{"name": "api", "port": 80, "weight": 0}]}]}});
    let (status, body) = post(
        &h,
        names::VALIDATE_PATH,
        review(kind.clone(), "routes", Some(route)),
    )
    .await;
    assert_eq!(status, 200);
    let resp = response_of(&body);
    assert_eq!(resp["allowed"], false);
    let message = resp["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("Route apps/r is invalid") && message.contains("weight"),
        "{message}"
    );

    // A second Route for a Service port already routed (cross-object rule).
    let dup = json!({"apiVersion": "baton.dev/v1alpha1", "kind": "Route",
                     "metadata": {"name": "dup", "namespace": "apps"},
                     "spec": {"parentRef": {"name": "web", "port": 80},
                              "rules": [{"backendRefs": [{"name": "web", "port": 80}]}]}});
    let (_, body) = post(&h, names::VALIDATE_PATH, review(kind, "routes", Some(dup))).await;
    let resp = response_of(&body);
    assert_eq!(resp["allowed"], false);
    assert!(
        resp["status"]["message"]
            .as_str()
            .unwrap()
            .contains("Route apps/existing already routes")
    );
}

#[tokio::test]
async fn an_authorization_policy_naming_a_port_no_selected_pod_declares_is_refused_with_the_names_they_do()
 {
    let h = start().await;
    let kind = json!({"group": "baton.dev", "version": "v1alpha1", "kind": "AuthorizationPolicy"});
    let policy = |ports: Value| {
        json!({"apiVersion": "baton.dev/v1alpha1", "kind": "AuthorizationPolicy",
               "metadata": {"name": "p", "namespace": "apps"},
               "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "ports": ports}})
    };
    let ask = |ports: Value| {
        let body = review(kind.clone(), "authorizationpolicies", Some(policy(ports)));
        let h = &h;
        async move { response_of(&post(h, names::VALIDATE_PATH, body).await.1) }
    };
    let resp = ask(json!(["grpc"])).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    let message = resp["status"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("AuthorizationPolicy apps/p is invalid: spec.ports[0]: no Pod the policy selects (1 of them) declares a container port named \"grpc\"; they declare http, metrics"),
        "{message}"
    );
    // A malformed name is refused before any Pod is asked.
    let resp = ask(json!([80, "Not_A_Name"])).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    let message = resp["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("spec.ports[1]: \"Not_A_Name\" is not a port name"),
        "{message}"
    );
    let resp = ask(json!(["http", 9000])).await;
    assert_eq!(resp["allowed"], true, "{resp}");
}

#[tokio::test]
async fn the_admin_port_reports_ready_and_exports_metrics() {
    let h = start().await;
    // One admission so the counters have a sample.
    post(
        &h,
        names::MUTATE_PODS_PATH,
        review(pod_kind(), "pods", Some(pod())),
    )
    .await;
    let get = |path: &'static str| {
        let addr = h.admin_addr;
        async move {
            let tcp = TcpStream::connect(addr).await.unwrap();
            let (mut send, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
                    .await
                    .unwrap();
            tokio::spawn(conn);
            let req = http::Request::builder()
                .uri(path)
                .header("host", "admin")
                .body(Full::new(Bytes::new()))
                .unwrap();
            let resp = send.send_request(req).await.unwrap();
            let status = resp.status().as_u16();
            (
                status,
                String::from_utf8(
                    resp.into_body()
                        .collect()
                        .await
                        .unwrap()
                        .to_bytes()
                        .to_vec(),
                )
                .unwrap(),
            )
        }
    };
    assert_eq!(get("/live").await.0, 200);
    assert_eq!(get("/ready").await, (200, "ready\n".to_owned()));
    let (status, text) = get("/metrics").await;
    assert_eq!(status, 200);
    assert!(
        text.contains(
            r#"baton_webhook_admissions_total{endpoint="mutate-pods",result="patched"} 1"#
        ),
        "{text}"
    );
    assert!(
        text.contains("baton_webhook_admission_duration_seconds_bucket"),
        "{text}"
    );
    assert!(
        text.contains(r#"baton_webhook_injection_decisions_total{decision="injected"} 1"#),
        "{text}"
    );
    assert_eq!(get("/nope").await.0, 404);
}

#[tokio::test]
async fn ready_is_503_until_a_certificate_is_loaded() {
    let admin = Admin {
        store: CertStore::new(),
        state: Arc::new(StaticState(snapshot())),
        registry: Arc::new(metrics::registry()),
        metrics: Arc::new(Metrics::unregistered()),
        draining: Default::default(),
    };
    assert_eq!(
        admin.not_ready_reason(),
        Some("no serving certificate loaded yet")
    );
}

#[tokio::test]
async fn a_rotated_certificate_is_served_to_new_connections_without_restart() {
    let h = start().await;
    let first = connect(&h, b"http/1.1").await;
    let leaf1 = peer_leaf(&first);
    let mut old_conn = H1::open(first).await;
    assert_eq!(old_conn.send("GET", "/nope", vec![]).await.0, 404);

    // Rotate: a new leaf from the same CA.
    let cert = issue(&h.ca);
    h.store
        .store_pem(cert.cert_pem.as_bytes(), cert.key_pem.as_bytes())
        .unwrap();
    let second = connect(&h, b"http/1.1").await;
    let leaf2 = peer_leaf(&second);
    assert_ne!(leaf1, leaf2);
    assert_eq!(
        leaf2,
        CertificateDer::from_pem_slice(cert.cert_pem.as_bytes())
            .unwrap()
            .to_vec()
    );
    // The established connection keeps working on its old session.
    assert_eq!(old_conn.send("GET", "/nope", vec![]).await.0, 404);
    assert_eq!(
        H1::open(second)
            .await
            .send(
                "POST",
                names::MUTATE_PODS_PATH,
                review(pod_kind(), "pods", Some(pod()))
            )
            .await
            .0,
        200
    );
}

#[tokio::test]
async fn a_rotated_ca_is_trusted_through_the_merged_bundle() {
    let h = start().await;
    let new_ca = ca::generate_ca(OffsetDateTime::now_utc(), Duration::from_secs(86_400)).unwrap();
    let bundle = ca::merge_bundle(&new_ca.cert, &h.ca.bundle, OffsetDateTime::now_utc());
    let cert = issue(&new_ca);
    h.store
        .store_pem(cert.cert_pem.as_bytes(), cert.key_pem.as_bytes())
        .unwrap();
    // A client holding only the old bundle is refused; the merged bundle
    // verifies the new chain.
    let tcp = TcpStream::connect(h.addr).await.unwrap();
    let old = tokio_rustls::TlsConnector::from(client_config(&h.ca.bundle, b"http/1.1"))
        .connect(ServerName::try_from(SNI).unwrap(), tcp)
        .await;
    assert!(old.is_err());
    let tcp = TcpStream::connect(h.addr).await.unwrap();
    tokio_rustls::TlsConnector::from(client_config(&bundle, b"http/1.1"))
        .connect(ServerName::try_from(SNI).unwrap(), tcp)
        .await
        .unwrap();
}

#[tokio::test]
async fn certificate_files_are_reloaded_when_they_change() {
    let dir = tempfile::tempdir().unwrap();
    let ca = ca::generate_ca(OffsetDateTime::now_utc(), Duration::from_secs(86_400)).unwrap();
    let files = CertFiles {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
    };
    let first = issue(&ca);
    std::fs::write(&files.cert, &first.cert_pem).unwrap();
    std::fs::write(&files.key, &first.key_pem).unwrap();
    let store = CertStore::new();
    files.load_into(&store).unwrap();
    let leaf1 = store.leaf_der().unwrap();
    let stop = CancellationToken::new();
    let watcher = tokio::spawn(files.clone().watch(
        store.clone(),
        Duration::from_millis(20),
        stop.clone(),
    ));

    // A half-written pair (new cert, old key) must not replace the good one.
    let second = issue(&ca);
    std::fs::write(&files.cert, &second.cert_pem).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(store.leaf_der().unwrap(), leaf1);
    std::fs::write(&files.key, &second.key_pem).unwrap();
    let mut reloaded = false;
    for _ in 0..250 {
        if store.leaf_der().unwrap() != leaf1 {
            reloaded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    watcher.await.unwrap();
    assert!(reloaded, "the store never picked up the new files");
    assert_eq!(
        store.leaf_der().unwrap().to_vec(),
        CertificateDer::from_pem_slice(second.cert_pem.as_bytes())
            .unwrap()
            .to_vec()
    );
}

/// Standard base64 (the `patch` field of an AdmissionResponse).
fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c) << (18 - 6 * i);
        }
        let n = chunk.len() * 6 / 8;
        for i in 0..n {
            out.push((acc >> (16 - 8 * i)) as u8);
        }
    }
    out
}

#[tokio::test]
async fn an_in_flight_review_finishes_after_stop_while_new_connections_are_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let entered = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let stop = CancellationToken::new();
    let server = {
        let (entered, release) = (entered.clone(), release.clone());
        tokio::spawn(baton_webhook::server::serve(
            listener,
            None,
            move |req: baton_webhook::server::SimpleRequest| {
                let (entered, release) = (entered.clone(), release.clone());
                async move {
                    entered.notify_one();
                    release.notified().await;
                    baton_webhook::server::response(http::StatusCode::OK, "text/plain", req.body)
                }
            },
            stop.clone(),
        ))
    };
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let in_flight = tokio::spawn(async move {
        let req = http::Request::post("/mutate-pods")
            .header("host", "webhook")
            .body(Full::new(Bytes::from_static(b"review")))
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.into_body().collect().await.unwrap().to_bytes())
    });
    entered.notified().await;

    // Stop while the review is being handled.
    stop.cancel();
    let mut refused = false;
    for _ in 0..200 {
        if TcpStream::connect(addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(refused, "the stopped server still accepts connections");
    assert!(
        !server.is_finished(),
        "the server returned with a review in flight"
    );

    release.notify_one();
    let (status, body) = in_flight.await.unwrap();
    assert_eq!((status, &body[..]), (200, &b"review"[..]));
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the server returns once the review is answered")
        .unwrap();
}

#[tokio::test]
async fn ready_is_503_once_shutdown_started_while_the_rest_is_ready() {
    let store = CertStore::new();
    let ca = ca::generate_ca(OffsetDateTime::now_utc(), Duration::from_secs(86_400)).unwrap();
    let cert = issue(&ca);
    store
        .store_pem(cert.cert_pem.as_bytes(), cert.key_pem.as_bytes())
        .unwrap();
    let admin = Admin {
        store,
        state: Arc::new(StaticState(snapshot())),
        registry: Arc::new(metrics::registry()),
        metrics: Arc::new(Metrics::unregistered()),
        draining: Default::default(),
    };
    assert_eq!(admin.not_ready_reason(), None);
    admin.draining.start();
    assert_eq!(admin.not_ready_reason(), Some("shutting down"));
}
