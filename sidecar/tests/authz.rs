//! Authorization policies (issue #36) enforced by one in-process sidecar
//! with real sockets on loopback: HTTP per request (HTTP/1.1 and HTTP/2,
//! 403 for a denied one, nothing forwarded), connections that are not HTTP
//! per connection (closed before the backend sees a connection or a byte),
//! audit (let through, counted), and policy changes (the next request of
//! an open keep-alive connection; an established TCP connection the new
//! policy denies is closed).
//!
//! Clients are told apart by their source address: Linux routes all of
//! 127.0.0.0/8 to loopback, so a client bound to 127.0.0.2 is "another
//! host" to a policy that allows 127.0.0.1/32.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use baton_sidecar::config::yaml;
use baton_sidecar::server::{Running, StartOptions, start};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::log_sink;
use log_sink::Sink;

/// The allowed client's address and the denied one's.
const ALLOWED: &str = "127.0.0.1";
const OTHER: &str = "127.0.0.2";

/// An HTTP upstream (1.1 and 2) answering 200 with its path; counts hits.
struct Upstream {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn upstream() -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let h = h.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    h.fetch_add(1, Ordering::SeqCst);
                    let path = req.uri().path().to_owned();
                    async move { Ok::<_, std::io::Error>(Response::new(Full::new(Bytes::from(path)))) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Upstream { addr, hits, task }
}

/// A TCP echo backend counting the connections it accepted and the bytes
/// it received.
struct Echo {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    bytes: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn echo() -> Echo {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let bytes = Arc::new(AtomicUsize::new(0));
    let (a, b) = (accepted.clone(), bytes.clone());
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            a.fetch_add(1, Ordering::SeqCst);
            let b = b.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            b.fetch_add(n, Ordering::SeqCst);
                            if s.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    Echo {
        addr,
        accepted,
        bytes,
        task,
    }
}

fn snapshot(text: &str) -> baton_sidecar::config::Snapshot {
    let mut snap = yaml::parse(text).unwrap();
    snap.admin.address = "127.0.0.1:0".parse().unwrap();
    snap
}

async fn sidecar(text: &str) -> Running {
    start(snapshot(text), StartOptions::default())
        .await
        .unwrap()
}

fn apply(sc: &Running, text: &str) {
    sc.shared.store.apply(&snapshot(text)).unwrap();
}

/// A TCP connection to `to` from `from` (an address on loopback).
async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(format!("{from}:0").parse().unwrap()).unwrap();
    s.connect(to).await.unwrap()
}

type H1 = hyper::client::conn::http1::SendRequest<Full<Bytes>>;
type H2 = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

/// One keep-alive HTTP/1.1 connection (every request on it goes over the
/// same socket: the client cannot reconnect behind the test's back).
async fn h1(from: &str, to: SocketAddr) -> H1 {
    let s = connect_from(from, to).await;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

async fn h2(from: &str, to: SocketAddr) -> H2 {
    let s = connect_from(from, to).await;
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(s))
            .await
            .unwrap();
    tokio::spawn(conn);
    sender
}

/// HTTP/1.1 in origin form (`path`, as clients send it: the fast path
/// takes it), HTTP/2 with the whole URI (its pseudo-headers).
fn request(method: &str, path: &str, headers: &[(&str, &str)]) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "app");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(Bytes::new())).unwrap()
}

/// Status, local-reason header and body of one request.
async fn read(resp: Response<Incoming>) -> (StatusCode, String, String) {
    let status = resp.status();
    let reason = resp
        .headers()
        .get("x-baton-local-reason")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, reason, String::from_utf8_lossy(&body).into_owned())
}

async fn on_h1(
    c: &mut H1,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, String, String) {
    c.ready().await.unwrap();
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        c.send_request(request(method, path, headers)),
    )
    .await
    .expect("an answer within 10 s")
    .expect("an answer on the same connection");
    read(resp).await
}

async fn on_h2(
    c: &mut H2,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, String, String) {
    c.ready().await.unwrap();
    let mut req = request(method, path, headers);
    *req.version_mut() = http::Version::HTTP_2;
    *req.uri_mut() = format!("http://app{path}").parse().unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), c.send_request(req))
        .await
        .expect("an answer within 10 s")
        .expect("an answer on the same connection");
    read(resp).await
}

async fn metrics(sc: &Running) -> String {
    let mut s = TcpStream::connect(sc.admin_addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// The value of one series (0 when absent).
fn series(metrics: &str, name_and_labels: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or(0)
}

fn authz(policy: &str, rule: &str, verdict: &str) -> String {
    format!(
        "baton_sidecar_authz_total{{policy=\"{policy}\",rule=\"{rule}\",verdict=\"{verdict}\"}} "
    )
}

/// Whether the sidecar closes `s` without sending a byte (EOF or reset)
/// after `payload` (ignored if the write fails: already closed).
async fn closed_without_a_byte(mut s: TcpStream, payload: &[u8]) -> bool {
    let _ = s.write_all(payload).await;
    let mut buf = Vec::new();
    match tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await {
        Ok(Ok(_)) => buf.is_empty(),
        Ok(Err(e)) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Err(_) => false,
    }
}

/// Writes `payload`, reads it back.
async fn echoes(s: &mut TcpStream, payload: &[u8]) -> bool {
    if s.write_all(payload).await.is_err() {
        return false;
    }
    let mut back = vec![0u8; payload.len()];
    matches!(
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back)).await,
        Ok(Ok(_))
    ) && back == payload
}

const HTTP_POLICY: &str = "
policies:
  rbac:
  - name: api
    rules:
    - {action: deny, paths: [/api/admin]}
    - {name: blocked, action: deny, headers: [{name: X-Block}]}
    - {action: deny, headers: [{name: x-env, prefix: prod-}]}
    - {name: readers, action: allow, cidrs: ['127.0.0.1/32'], methods: [GET, HEAD], path_prefixes: [/api/]}
    default_action: deny
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_requests_are_decided_one_by_one_on_http1_and_http2() {
    let up = upstream().await;
    let sc = sidecar(&format!(
        "listeners: [{{name: in, address: '127.0.0.1:0', rbac: api}}]
clusters: [{{name: a, endpoints: ['{}']}}]
routes: [{{name: r, match: {{path: {{prefix: /api/}}}}, backends: [{{cluster: a}}]}}]
{HTTP_POLICY}",
        up.addr
    ))
    .await;
    let addr = sc.addr("in").unwrap();
    let denied = |(status, reason, body): (StatusCode, String, String)| {
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        assert_eq!(reason, "rbac_denied");
        assert_eq!(body, "denied by rbac policy\n", "a short static body");
        assert!(
            !body.contains("api") && !body.contains("readers"),
            "no policy names"
        );
    };
    let mut c1 = h1(ALLOWED, addr).await;
    let mut c2 = h2(ALLOWED, addr).await;
    for proto in ["h1", "h2"] {
        let mut ask = async |method: &str, path: &str, headers: &[(&str, &str)]| match proto {
            "h1" => on_h1(&mut c1, method, path, headers).await,
            _ => on_h2(&mut c2, method, path, headers).await,
        };
        let (s, _, body) = ask("GET", "/api/items", &[]).await;
        assert_eq!(
            (s, body.as_str()),
            (StatusCode::OK, "/api/items"),
            "{proto}"
        );
        assert_eq!(ask("HEAD", "/api/items", &[]).await.0, StatusCode::OK);
        denied(ask("POST", "/api/items", &[]).await);
        denied(ask("GET", "/api/admin", &[]).await);
        // Exact: a longer path is not the denied one.
        assert_eq!(ask("GET", "/api/admin/x", &[]).await.0, StatusCode::OK);
        // Header names in any case; presence; prefix.
        denied(ask("GET", "/api/items", &[("x-block", "")]).await);
        denied(ask("GET", "/api/items", &[("X-ENV", "prod-eu")]).await);
        assert_eq!(
            ask("GET", "/api/items", &[("x-env", "staging")]).await.0,
            StatusCode::OK
        );
        // Denied before routing answers: no route is 403 too, not 404.
        denied(ask("GET", "/elsewhere", &[]).await);
    }
    // The other host gets nothing, whatever it asks.
    let mut other = h1(OTHER, addr).await;
    denied(on_h1(&mut other, "GET", "/api/items", &[]).await);
    let mut other2 = h2(OTHER, addr).await;
    denied(on_h2(&mut other2, "GET", "/api/items", &[]).await);

    assert_eq!(
        up.hits.load(Ordering::SeqCst),
        2 * 4,
        "only allowed requests reach the app"
    );
    let m = metrics(&sc).await;
    assert_eq!(series(&m, &authz("api", "readers", "allow")), 8, "{m}");
    assert_eq!(series(&m, &authz("api", "rules[0]", "deny")), 2);
    assert_eq!(series(&m, &authz("api", "blocked", "deny")), 2);
    assert_eq!(series(&m, &authz("api", "rules[2]", "deny")), 2);
    assert_eq!(series(&m, &authz("api", "default", "deny")), 2 * 2 + 2);
    assert_eq!(
        series(
            &m,
            "baton_sidecar_local_responses_total{reason=\"rbac_denied\"} "
        ),
        2 * 5 + 2
    );
    sc.stop().await;
}

fn keepalive_config(up: SocketAddr, policy: Option<&str>) -> String {
    let (rbac, policies) = match policy {
        Some(p) => (", rbac: p", format!("policies: {{rbac: [{p}]}}\n")),
        None => ("", String::new()),
    };
    format!(
        "listeners: [{{name: in, address: '127.0.0.1:0'{rbac}}}]
clusters: [{{name: a, endpoints: ['{up}']}}]
routes: [{{name: r, backends: [{{cluster: a}}]}}]
{policies}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_governs_the_next_request_of_an_open_keep_alive_connection() {
    let up = upstream().await;
    let sc = sidecar(&keepalive_config(up.addr, None)).await;
    let addr = sc.addr("in").unwrap();
    // Opened before any policy: HTTP/1.1 on the fast path, and HTTP/2.
    let mut c1 = h1(ALLOWED, addr).await;
    let mut c2 = h2(ALLOWED, addr).await;
    assert_eq!(on_h1(&mut c1, "GET", "/1", &[]).await.0, StatusCode::OK);
    assert_eq!(on_h2(&mut c2, "GET", "/1", &[]).await.0, StatusCode::OK);
    let fast = series(
        &metrics(&sc).await,
        "baton_sidecar_h1_fast_path_requests_total ",
    );
    assert_eq!(fast, 1, "the first request took the fast path");

    // Deny everyone: the same connections' next requests are refused.
    apply(
        &sc,
        &keepalive_config(up.addr, Some("{name: p, rules: [], default_action: deny}")),
    );
    assert_eq!(
        on_h1(&mut c1, "GET", "/2", &[]).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        on_h2(&mut c2, "GET", "/2", &[]).await.0,
        StatusCode::FORBIDDEN
    );
    // Allow this client again: served again, on the same connections.
    apply(
        &sc,
        &keepalive_config(
            up.addr,
            Some(
                "{name: p, rules: [{action: allow, cidrs: ['127.0.0.1/32']}], default_action: deny}",
            ),
        ),
    );
    assert_eq!(on_h1(&mut c1, "GET", "/3", &[]).await.0, StatusCode::OK);
    assert_eq!(on_h2(&mut c2, "GET", "/3", &[]).await.0, StatusCode::OK);
    // And a policy that names another address denies again.
    apply(
        &sc,
        &keepalive_config(
            up.addr,
            Some(
                "{name: p, rules: [{action: allow, cidrs: ['127.0.0.2/32']}], default_action: deny}",
            ),
        ),
    );
    assert_eq!(
        on_h1(&mut c1, "GET", "/4", &[]).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        on_h2(&mut c2, "GET", "/4", &[]).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(up.hits.load(Ordering::SeqCst), 4);
    let m = metrics(&sc).await;
    assert_eq!(
        series(
            &m,
            "baton_sidecar_connections_total{listener=\"in\",protocol=\"http1\"} "
        ),
        1,
        "one HTTP/1.1 connection all along"
    );
    assert_eq!(
        series(
            &m,
            "baton_sidecar_connections_total{listener=\"in\",protocol=\"http2\"} "
        ),
        1,
        "one HTTP/2 connection all along"
    );
    sc.stop().await;
}

/// Listeners whose connections are not HTTP, each with policy `p`:
/// `protocol: tcp`; an opaque port (the listener's own, known once bound);
/// `auto` with a short detection timeout (a client that waits for the
/// server to speak first becomes raw TCP).
fn tcp_config(backend: SocketAddr, opaque_port: u16, policy: &str) -> String {
    format!(
        "listeners:
- {{name: tcp, address: '127.0.0.1:0', protocol: tcp, tcp_cluster: b, rbac: p}}
- {{name: opaque, address: '127.0.0.1:0', opaque_ports: [{opaque_port}], tcp_cluster: b, rbac: p}}
- {{name: silent, address: '127.0.0.1:0', tcp_cluster: b, detect_timeout_ms: 100, rbac: p}}
clusters: [{{name: b, endpoints: ['{backend}']}}]
policies: {{rbac: [{policy}]}}
"
    )
}

const TCP_POLICY: &str = "{name: p, rules: [
  {name: web-only, action: allow, methods: [GET]},
  {name: local, action: allow, cidrs: ['127.0.0.1/32']}], default_action: deny}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_tcp_connection_is_closed_before_the_backend_sees_it() {
    let backend = echo().await;
    let sc = sidecar(&tcp_config(backend.addr, 1, TCP_POLICY)).await;
    let opaque = sc.addr("opaque").unwrap();
    apply(&sc, &tcp_config(backend.addr, opaque.port(), TCP_POLICY));
    let listeners = [
        ("tcp", sc.addr("tcp").unwrap()),
        ("opaque", opaque),
        ("silent", sc.addr("silent").unwrap()),
    ];
    for (name, addr) in listeners {
        // Denied: closed without a byte; the backend sees no connection.
        // (The GET rule needs a request: it never matches a connection,
        // even one whose first bytes look like HTTP, as on opaque ports.)
        let s = connect_from(OTHER, addr).await;
        let payload: &[u8] = if name == "silent" {
            b""
        } else {
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        };
        assert!(
            closed_without_a_byte(s, payload).await,
            "{name}: denied connection not closed"
        );
        assert_eq!(backend.accepted.load(Ordering::SeqCst), 0, "{name}");
        assert_eq!(backend.bytes.load(Ordering::SeqCst), 0, "{name}");
    }
    // Allowed: every byte echoed.
    for (name, addr) in listeners {
        let mut s = connect_from(ALLOWED, addr).await;
        if name == "silent" {
            // Let the detection time out first (server speaks first).
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        assert!(echoes(&mut s, b"hello\x00\xff").await, "{name}");
    }
    assert_eq!(backend.accepted.load(Ordering::SeqCst), 3);
    let m = metrics(&sc).await;
    assert_eq!(series(&m, &authz("p", "default", "deny")), 3, "{m}");
    assert_eq!(series(&m, &authz("p", "local", "allow")), 3, "{m}");
    assert_eq!(series(&m, &authz("p", "web-only", "allow")), 0, "{m}");
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_established_tcp_connection_the_new_policy_denies_is_closed() {
    let backend = echo().await;
    let allow_local =
        "{name: p, rules: [{action: allow, cidrs: ['127.0.0.1/32']}], default_action: deny}";
    let sc = sidecar(&tcp_config(backend.addr, 1, allow_local)).await;
    let addr = sc.addr("tcp").unwrap();
    let mut kept = connect_from(ALLOWED, addr).await;
    assert!(echoes(&mut kept, b"before").await);
    // A change that still allows it leaves it be.
    let allow_loopback =
        "{name: p, rules: [{action: allow, cidrs: ['127.0.0.0/8']}], default_action: deny}";
    apply(&sc, &tcp_config(backend.addr, 1, allow_loopback));
    assert!(echoes(&mut kept, b"still").await);
    // One that denies it closes it.
    let deny_all = "{name: p, rules: [], default_action: deny}";
    apply(&sc, &tcp_config(backend.addr, 1, deny_all));
    let mut buf = [0u8; 16];
    match tokio::time::timeout(Duration::from_secs(10), kept.read(&mut buf)).await {
        Ok(Ok(0)) => {}
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the revoked connection is still open: {other:?}"),
    }
    let m = metrics(&sc).await;
    assert_eq!(series(&m, &authz("p", "default", "deny")), 1, "{m}");
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_lets_through_and_counts_what_it_would_deny() {
    let up = upstream().await;
    let backend = echo().await;
    let policy = "{name: watch, rules: [
      {name: note-admin, action: audit, path_prefixes: [/admin]},
      {name: local, action: allow, cidrs: ['127.0.0.1/32']}], default_action: audit}";
    let sc = sidecar(&format!(
        "listeners:
- {{name: in, address: '127.0.0.1:0', rbac: watch}}
- {{name: tcp, address: '127.0.0.1:0', protocol: tcp, tcp_cluster: b, rbac: watch}}
clusters: [{{name: a, endpoints: ['{}']}}, {{name: b, endpoints: ['{}']}}]
routes: [{{name: r, backends: [{{cluster: a}}]}}]
policies: {{rbac: [{policy}]}}
",
        up.addr, backend.addr
    ))
    .await;
    let addr = sc.addr("in").unwrap();
    let mut other = h1(OTHER, addr).await;
    let (s, _, body) = on_h1(&mut other, "GET", "/x", &[]).await;
    assert_eq!(
        (s, body.as_str()),
        (StatusCode::OK, "/x"),
        "would deny: let through"
    );
    assert_eq!(
        on_h1(&mut other, "GET", "/admin", &[]).await.0,
        StatusCode::OK
    );
    let mut local = h1(ALLOWED, addr).await;
    assert_eq!(
        on_h1(&mut local, "GET", "/admin", &[]).await.0,
        StatusCode::OK
    );
    let mut s = connect_from(OTHER, sc.addr("tcp").unwrap()).await;
    assert!(
        echoes(&mut s, b"audited").await,
        "a connection is let through too"
    );
    assert_eq!(up.hits.load(Ordering::SeqCst), 3);
    let m = metrics(&sc).await;
    assert_eq!(series(&m, &authz("watch", "default", "audit")), 3, "{m}");
    assert_eq!(series(&m, &authz("watch", "note-admin", "audit")), 2, "{m}");
    assert_eq!(series(&m, &authz("watch", "local", "allow")), 1, "{m}");
    assert_eq!(
        series(
            &m,
            "baton_sidecar_local_responses_total{reason=\"rbac_denied\"} "
        ),
        0
    );
    sc.stop().await;
}

/// One raw HTTP/1.1 exchange on `s` (the request written as given, so
/// paths reach the sidecar byte for byte): status, local reason, body.
async fn raw_exchange(s: &mut TcpStream, request: &str) -> (u16, String, String) {
    s.write_all(request.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let read = async {
        loop {
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await.unwrap();
            assert!(n > 0, "connection closed before a whole response");
            buf.extend_from_slice(&chunk[..n]);
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut resp = httparse::Response::new(&mut headers);
            if let Ok(httparse::Status::Complete(head)) = resp.parse(&buf) {
                let header = |name: &str| {
                    resp.headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(name))
                        .map(|h| String::from_utf8_lossy(h.value).into_owned())
                };
                // The answer to HEAD has no body, whatever its length says.
                let len: usize = if request.starts_with("HEAD ") {
                    0
                } else {
                    header("content-length").unwrap().parse().unwrap()
                };
                if buf.len() >= head + len {
                    return (
                        resp.code.unwrap(),
                        header("x-baton-local-reason").unwrap_or_default(),
                        String::from_utf8_lossy(&buf[head..head + len]).into_owned(),
                    );
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("a response within 10 s")
}

/// A policy with path, header, method, CIDR and audit rules (path
/// conditions: requests are matched and forwarded normalized).
fn paths_policy(name: &str) -> String {
    format!(
        "  - name: {name}
    rules:
    - {{action: deny, path_prefixes: [/admin]}}
    - {{name: blocked, action: deny, headers: [{{name: X-Block, prefix: 'y'}}]}}
    - {{name: watch, action: audit, paths: [/api/watched]}}
    - {{name: readers, action: allow, cidrs: ['127.0.0.1/32'], methods: [GET, HEAD], path_prefixes: [/api/]}}
    default_action: deny
"
    )
}

/// The requests both paths are asked, and what each must get: status,
/// local reason, body (an upstream answer is the path it received).
const SAME_ON_BOTH_PATHS: &[(&str, u16, &str, &str)] = &[
    (
        "GET /api/items HTTP/1.1\r\nHost: app\r\n\r\n",
        200,
        "",
        "/api/items",
    ),
    (
        "GET /admin HTTP/1.1\r\nHost: app\r\n\r\n",
        403,
        "rbac_denied",
        "denied by rbac policy\n",
    ),
    (
        "GET //admin HTTP/1.1\r\nHost: app\r\n\r\n",
        403,
        "rbac_denied",
        "denied by rbac policy\n",
    ),
    (
        "GET /a/../admin HTTP/1.1\r\nHost: app\r\n\r\n",
        403,
        "rbac_denied",
        "denied by rbac policy\n",
    ),
    (
        "GET /%61dmin HTTP/1.1\r\nHost: app\r\n\r\n",
        403,
        "rbac_denied",
        "denied by rbac policy\n",
    ),
    (
        "GET /api/%2e%2e/admin/x HTTP/1.1\r\nHost: app\r\n\r\n",
        403,
        "rbac_denied",
        "denied by rbac policy\n",
    ),
    (
        "GET /admin%2F.. HTTP/1.1\r\nHost: app\r\n\r\n",
        400,
        "path_escaped_separator",
        "request path refused: the path has an encoded '/' or '\\' (%2F, %5C) or a '\\'\n",
    ),
    // Forwarded with the path the policy matched; the query kept.
    (
        "GET /api/./x//items?q=1 HTTP/1.1\r\nHost: app\r\n\r\n",
        200,
        "",
        "/api/x/items",
    ),
    // Denied with a body: the body is read, the connection goes on.
    (
        "POST /api/items HTTP/1.1\r\nHost: app\r\nContent-Length: 5\r\n\r\nhello",
        403,
        "rbac_denied",
        "denied by rbac policy\n",
    ),
    (
        "GET /api/items HTTP/1.1\r\nHost: app\r\nx-block: yes\r\n\r\n",
        403,
        "rbac_denied",
        "denied by rbac policy\n",
    ),
    // No body after the head of a denied HEAD: the next answer is read
    // where it starts.
    (
        "HEAD /admin HTTP/1.1\r\nHost: app\r\n\r\n",
        403,
        "rbac_denied",
        "",
    ),
    (
        "GET /api/items HTTP/1.1\r\nHost: app\r\nX-Block: no\r\n\r\n",
        200,
        "",
        "/api/items",
    ),
    (
        "GET /api/watched HTTP/1.1\r\nHost: app\r\n\r\n",
        200,
        "",
        "/api/watched",
    ),
    (
        "GET /elsewhere HTTP/1.1\r\nHost: app\r\n\r\n",
        403,
        "rbac_denied",
        "denied by rbac policy\n",
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fast_path_decides_and_logs_requests_as_the_general_path_does() {
    let up = upstream().await;
    // `fast` is served by the HTTP/1.1 fast path; `general` takes hyper's
    // path for every request (a header-matching route on it, which the
    // fast path leaves to the general path). Same rules, one policy each,
    // so each path's counters can be read apart.
    let sink = Sink::default();
    let mut snap = snapshot(&format!(
        "listeners:
- {{name: fast, address: '127.0.0.1:0', rbac: api-fast, access_log: true}}
- {{name: general, address: '127.0.0.1:0', rbac: api-general, access_log: true}}
clusters: [{{name: a, endpoints: ['{}']}}]
routes:
- {{name: by-header, listeners: [general], match: {{headers: [{{name: x-never, exact: 'yes'}}]}}, backends: [{{cluster: a}}]}}
- {{name: r, backends: [{{cluster: a}}]}}
policies:
  rbac:
{}{}",
        up.addr,
        paths_policy("api-fast"),
        paths_policy("api-general")
    ));
    snap.runtime.access_log_lines_per_second = Some(10_000);
    let sc = start(
        snap,
        StartOptions {
            access_log: Some(Box::new(sink.clone())),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    for listener in ["fast", "general"] {
        let mut s = connect_from(ALLOWED, sc.addr(listener).unwrap()).await;
        for (request, status, reason, body) in SAME_ON_BOTH_PATHS {
            let got = raw_exchange(&mut s, request).await;
            assert_eq!(
                got,
                (*status, reason.to_string(), body.to_string()),
                "{listener}: {request:?}"
            );
        }
    }
    let n = SAME_ON_BOTH_PATHS.len();
    let m = metrics(&sc).await;
    assert_eq!(
        series(&m, "baton_sidecar_h1_fast_path_requests_total "),
        n as u64,
        "every request on `fast` was served by the fast path: {m}"
    );
    assert_eq!(
        series(
            &m,
            "baton_sidecar_h1_fast_path_fallbacks_total{reason=\"route\"} "
        ),
        1,
        "only `general`'s connection fell back, once: {m}"
    );
    // The same verdicts, counted under the same rules.
    for (rule, verdict, count) in [
        ("rules[0]", "deny", 6),
        ("blocked", "deny", 1),
        ("watch", "audit", 1),
        ("readers", "allow", 4),
        ("default", "deny", 2),
    ] {
        for policy in ["api-fast", "api-general"] {
            assert_eq!(
                series(&m, &authz(policy, rule, verdict)),
                count,
                "{policy} {rule}: {m}"
            );
        }
    }
    // The same access-log lines (but for what differs per request).
    let lines = sink.lines(2 * n).await;
    let (fast, general): (Vec<_>, Vec<_>) =
        lines.into_iter().partition(|l| l["listener"] == "fast");
    assert_eq!((fast.len(), general.len()), (n, n));
    for (f, g) in fast.iter().zip(&general) {
        for v in [f, g] {
            assert_eq!(v["trace_id"].as_str().map(str::len), Some(32), "{v}");
            assert!(v["start_time"].is_string() && v["duration_us"].is_u64());
        }
        let strip = |v: &serde_json::Value| {
            let mut v = v.clone();
            for k in [
                "start_time",
                "duration_us",
                "peer",
                "trace_id",
                "span_id",
                "listener",
            ] {
                v.as_object_mut().unwrap().remove(k);
            }
            v
        };
        assert_eq!(strip(f), strip(g));
    }
    assert_eq!(fast[0]["upstream"], up.addr.to_string());
    assert_eq!(fast[0]["bytes_out"], "/api/items".len());
    assert_eq!(fast[7]["path"], "/api/./x//items", "logged as received");
    assert_eq!(fast[8]["authz"], "deny");
    assert_eq!(fast[12]["authz"], "audit");
    assert_eq!(
        fast[10]["bytes_out"], 0,
        "nothing after the head of a HEAD answer"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_without_path_conditions_forwards_paths_as_received() {
    let up = upstream().await;
    let sc = sidecar(&keepalive_config(
        up.addr,
        Some("{name: p, rules: [{action: allow, cidrs: ['127.0.0.1/32']}], default_action: deny}"),
    ))
    .await;
    let mut s = connect_from(ALLOWED, sc.addr("in").unwrap()).await;
    for path in ["/a//b/../c", "/x%2Fy"] {
        let got = raw_exchange(&mut s, &format!("GET {path} HTTP/1.1\r\nHost: app\r\n\r\n")).await;
        assert_eq!(got, (200, String::new(), path.to_string()));
    }
    let m = metrics(&sc).await;
    assert_eq!(series(&m, "baton_sidecar_h1_fast_path_requests_total "), 2);
    sc.stop().await;
}
