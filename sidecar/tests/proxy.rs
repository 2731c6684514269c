//! In-process tests of the data plane: real sockets on 127.0.0.1 port 0,
//! real hyper clients and upstream servers, one sidecar per test.

use std::collections::HashMap;
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
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A test upstream: HTTP/1.1 and HTTP/2 (auto), counting requests.
struct Upstream {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    /// Last request's headers, method and path, for assertions.
    last: Arc<std::sync::Mutex<Option<(String, String, http::HeaderMap)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Behaviour by path: `/status/N`, `/slow/MS`, `/reset` (close without a
/// response), `/echo` (body back), `/ws` (WebSocket-style 101 then echo);
/// anything else answers 200 with the upstream's name.
async fn upstream(name: &'static str) -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let last = Arc::new(std::sync::Mutex::new(None));
    let (h, l) = (hits.clone(), last.clone());
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (h, l) = (h.clone(), l.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
                    let (h, l) = (h.clone(), l.clone());
                    async move {
                        h.fetch_add(1, Ordering::SeqCst);
                        let path = req.uri().path().to_owned();
                        *l.lock().unwrap() = Some((
                            req.method().to_string(),
                            path.clone(),
                            req.headers().clone(),
                        ));
                        let mut resp = Response::new(Full::new(Bytes::from(name)));
                        resp.headers_mut()
                            .insert("x-upstream", name.parse().unwrap());
                        resp.headers_mut()
                            .insert("server", "test-upstream".parse().unwrap());
                        if let Some(code) = path.strip_prefix("/status/") {
                            *resp.status_mut() =
                                StatusCode::from_u16(code.parse().unwrap()).unwrap();
                        } else if let Some(ms) = path.strip_prefix("/slow/") {
                            tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
                        } else if path == "/reset" {
                            return Err::<Response<Full<Bytes>>, std::io::Error>(
                                std::io::Error::other("reset"),
                            );
                        } else if path == "/echo" {
                            let body = req
                                .body_mut()
                                .collect()
                                .await
                                .map_err(std::io::Error::other)?
                                .to_bytes();
                            *resp.body_mut() = Full::new(body);
                        } else if path == "/ws" {
                            let on = hyper::upgrade::on(&mut req);
                            tokio::spawn(async move {
                                if let Ok(up) = on.await {
                                    let mut io = TokioIo::new(up);
                                    let mut buf = [0u8; 1024];
                                    while let Ok(n) = io.read(&mut buf).await {
                                        if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                                            break;
                                        }
                                    }
                                }
                            });
                            *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
                            resp.headers_mut()
                                .insert("connection", "upgrade".parse().unwrap());
                            resp.headers_mut()
                                .insert("upgrade", "websocket".parse().unwrap());
                            *resp.body_mut() = Full::new(Bytes::new());
                        }
                        Ok(resp)
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection_with_upgrades(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Upstream {
        addr,
        hits,
        last,
        task,
    }
}

/// Raw TCP echo upstream (optionally greeting first: server-speaks-first).
async fn tcp_echo(greeting: Option<&'static [u8]>) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                if let Some(g) = greeting {
                    let _ = s.write_all(g).await;
                }
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    (addr, task)
}

/// Start a sidecar from YAML; `{NAME}` placeholders are replaced by `vars`.
async fn sidecar(yaml_text: &str, vars: &[(&str, SocketAddr)]) -> Running {
    let mut text = yaml_text.to_owned();
    for (k, v) in vars {
        text = text.replace(&format!("{{{k}}}"), &v.to_string());
    }
    let mut snap = yaml::parse(&text).unwrap();
    snap.admin.address = "127.0.0.1:0".parse().unwrap();
    start(snap, StartOptions::default()).await.unwrap()
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

fn h2_client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

async fn send(
    c: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    method: &str,
    url: String,
    headers: &[(&str, &str)],
    body: &'static str,
) -> (StatusCode, http::HeaderMap, String) {
    let mut b = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        c.request(b.body(Full::new(Bytes::from(body))).unwrap()),
    )
    .await
    .expect("response within 10 s")
    .expect("request succeeds at the transport level");
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

async fn get(addr: SocketAddr, path: &str) -> (StatusCode, http::HeaderMap, String) {
    send(&client(), "GET", format!("http://{addr}{path}"), &[], "").await
}

/// Raw HTTP/1 exchange: write `req`, read until the peer closes or 2 s pass.
async fn raw(addr: SocketAddr, req: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(req).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

async fn metrics(r: &Running) -> String {
    get(r.admin_addr, "/metrics").await.2
}

const ONE_LISTENER: &str = "listeners: [{name: out, address: '127.0.0.1:0'}]\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_requests_are_routed_by_host_path_method_header_and_query_with_header_rewrites() {
    let a = upstream("a").await;
    let b = upstream("b").await;
    let sc = sidecar(
        &format!(
            "{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}']}}, {{name: b, endpoints: ['{{B}}']}}]
routes:
- name: by-host
  match: {{hosts: ['*.b.test']}}
  backends: [{{cluster: b}}]
- name: by-header-query
  match: {{path: {{prefix: /api}}, methods: [PUT], headers: [{{name: x-canary, exact: 'on'}}], query: [{{name: v, exact: '2'}}]}}
  backends: [{{cluster: b}}]
- name: default
  backends: [{{cluster: a}}]
  request_headers: {{set: {{x-added: yes-1}}, remove: [x-secret]}}
  response_headers: {{set: {{x-route: default}}, remove: [server]}}
"
        ),
        &[("A", a.addr), ("B", b.addr)],
    )
    .await;
    let out = sc.addr("out").unwrap();
    let c = client();
    let (s, h, body) = send(
        &c,
        "GET",
        format!("http://{out}/x"),
        &[("x-secret", "s3cr3t")],
        "",
    )
    .await;
    assert_eq!((s, body.as_str()), (StatusCode::OK, "a"));
    assert_eq!(h["x-route"], "default");
    assert!(h.get("server").is_none(), "response header removed");
    let (_, _, seen) = a.last.lock().unwrap().clone().unwrap();
    assert_eq!(seen["x-added"], "yes-1");
    assert!(seen.get("x-secret").is_none(), "request header removed");

    let (_, _, body) = send(
        &c,
        "GET",
        format!("http://{out}/"),
        &[("host", "www.b.test:8080")],
        "",
    )
    .await;
    assert_eq!(body, "b", "wildcard host, port ignored");
    let (_, _, body) = send(
        &c,
        "PUT",
        format!("http://{out}/api/v?v=2"),
        &[("x-canary", "on")],
        "",
    )
    .await;
    assert_eq!(body, "b");
    let (_, _, body) = send(
        &c,
        "PUT",
        format!("http://{out}/api/v?v=3"),
        &[("x-canary", "on")],
        "",
    )
    .await;
    assert_eq!(body, "a", "query mismatch falls through");
    let (_, _, body) = send(
        &c,
        "GET",
        format!("http://{out}/api/v?v=2"),
        &[("x-canary", "on")],
        "",
    )
    .await;
    assert_eq!(body, "a", "method mismatch falls through");

    let m = metrics(&sc).await;
    assert!(
        m.contains("baton_sidecar_requests_total{route=\"default\",status_class=\"2xx\"} 3"),
        "{m}"
    );
    assert!(
        m.contains("baton_sidecar_request_duration_seconds_bucket{"),
        "latency histogram exported"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_backends_receive_traffic_from_one_route() {
    let a = upstream("a").await;
    let b = upstream("b").await;
    let sc = sidecar(
        &format!(
            "{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}']}}, {{name: b, endpoints: ['{{B}}']}}]
routes: [{{name: split, backends: [{{cluster: a, weight: 50}}, {{cluster: b, weight: 50}}]}}]"
        ),
        &[("A", a.addr), ("B", b.addr)],
    )
    .await;
    let out = sc.addr("out").unwrap();
    let c = client();
    let mut seen = HashMap::new();
    for _ in 0..100 {
        *seen
            .entry(send(&c, "GET", format!("http://{out}/"), &[], "").await.2)
            .or_insert(0) += 1;
    }
    // P(one side gets nothing) = 2^-99: both must be hit.
    assert!(
        seen.get("a").copied().unwrap_or(0) > 0 && seen.get("b").copied().unwrap_or(0) > 0,
        "{seen:?}"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_prior_knowledge_is_detected_and_proxied_to_http1_and_http2_upstreams() {
    let a = upstream("a").await;
    let sc = sidecar(
        &format!(
            "{ONE_LISTENER}clusters: [{{name: h1, endpoints: ['{{A}}']}}, {{name: h2, endpoints: ['{{A}}'], protocol: http2}}]
routes: [{{name: to-h2, match: {{path: {{prefix: /h2}}}}, backends: [{{cluster: h2}}]}}, {{name: to-h1, backends: [{{cluster: h1}}]}}]"
        ),
        &[("A", a.addr)],
    )
    .await;
    let out = sc.addr("out").unwrap();
    let c = h2_client();
    for path in ["/h1", "/h2"] {
        let resp = c
            .request(
                Request::get(format!("http://{out}{path}"))
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(resp.version(), http::Version::HTTP_2);
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "a");
    }
    // Concurrent streams on one connection.
    let futs: Vec<_> = (0..20)
        .map(|_| {
            c.request(
                Request::get(format!("http://{out}/h2/x"))
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
        })
        .collect();
    for f in futs {
        assert_eq!(f.await.unwrap().status(), StatusCode::OK);
    }
    let m = metrics(&sc).await;
    assert!(m.contains("protocol=\"http2\""), "{m}");
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_tcp_is_detected_and_proxied_byte_for_byte() {
    let (echo, _t) = tcp_echo(None).await;
    let sc = sidecar(
        "listeners: [{name: out, address: '127.0.0.1:0', tcp_cluster: echo}]\nclusters: [{name: echo, endpoints: ['{E}']}]",
        &[("E", echo)],
    )
    .await;
    let mut s = TcpStream::connect(sc.addr("out").unwrap()).await.unwrap();
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let (mut r, mut w) = s.split();
    let write = async {
        w.write_all(&payload).await.unwrap();
        w.shutdown().await.unwrap();
    };
    let mut back = Vec::new();
    let read = r.read_to_end(&mut back);
    let (_, n) = tokio::join!(write, read);
    n.unwrap();
    assert_eq!(back.len(), payload.len());
    assert!(back == payload, "bytes differ");
    let m = metrics(&sc).await;
    assert!(
        m.contains("baton_sidecar_connections_total{listener=\"out\",protocol=\"tcp\"} 1"),
        "{m}"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_speaks_first_protocols_fall_back_to_tcp_after_the_detection_timeout_and_opaque_ports_skip_it()
 {
    let (greeter, _t) = tcp_echo(Some(b"220 hello\r\n")).await;
    let sc = sidecar(
        "listeners:
- {name: out, address: '127.0.0.1:0', tcp_cluster: g, detect_timeout_ms: 100}
- {name: opaque, address: '127.0.0.1:0', tcp_cluster: g, protocol: tcp}
clusters: [{name: g, endpoints: ['{G}']}]",
        &[("G", greeter)],
    )
    .await;
    for l in ["out", "opaque"] {
        let mut s = TcpStream::connect(sc.addr(l).unwrap()).await.unwrap();
        let mut buf = [0u8; 11];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf, b"220 hello\r\n", "listener {l}");
        s.write_all(b"QUIT\r\n").await.unwrap();
        let mut q = [0u8; 6];
        s.read_exact(&mut q).await.unwrap();
        assert_eq!(&q, b"QUIT\r\n");
    }
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_upgrade_is_passed_through() {
    let a = upstream("a").await;
    let sc = sidecar(&format!("{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}']}}]\nroutes: [{{name: r, backends: [{{cluster: a}}]}}]"), &[("A", a.addr)]).await;
    let mut s = TcpStream::connect(sc.addr("out").unwrap()).await.unwrap();
    s.write_all(b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n").await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("upgrade: websocket"),
        "{head}"
    );
    for msg in [&b"frame-one"[..], b"\x81\x05hello", b"last"] {
        s.write_all(msg).await.unwrap();
        let mut back = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(back, msg);
    }
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_requests_are_retried_on_listed_statuses_resets_and_connect_failures() {
    let good = upstream("good").await;
    let bad = upstream("bad").await;
    let dead = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap(); // closed port
    let sc = sidecar(
        &format!(
            "{ONE_LISTENER}clusters:
- {{name: mixed, endpoints: ['{{BAD}}', '{{GOOD}}'], lb: round_robin}}
- {{name: deadgood, endpoints: ['{{DEAD}}', '{{GOOD}}'], lb: round_robin}}
routes:
- {{name: conn, match: {{path: {{prefix: /conn}}}}, backends: [{{cluster: deadgood}}], retry: {{attempts: 1, budget_min_per_sec: 100}}}}
- {{name: r, backends: [{{cluster: mixed}}], retry: {{attempts: 1, on_statuses: [503], budget_min_per_sec: 100}}}}"
        ),
        &[("GOOD", good.addr), ("BAD", bad.addr), ("DEAD", dead)],
    )
    .await;
    let out = sc.addr("out").unwrap();
    let c = client();
    // Round robin alternates bad/good; a 503 from `bad` is retried on `good`.
    for _ in 0..4 {
        let (s, _, _) = send(&c, "GET", format!("http://{out}/status/503"), &[], "").await;
        // `good` also answers 503 on this path; what matters is the count below.
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(
        bad.hits.load(Ordering::SeqCst) + good.hits.load(Ordering::SeqCst),
        8,
        "each GET tried twice"
    );
    let before = good.hits.load(Ordering::SeqCst);
    for _ in 0..4 {
        let (s, _, body) = send(&c, "GET", format!("http://{out}/reset-or-ok"), &[], "").await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, body.as_str()));
    }
    assert!(good.hits.load(Ordering::SeqCst) > before);
    // Connect failures are retried (the request never left), even for POST.
    for _ in 0..4 {
        let (s, _, body) = send(&c, "POST", format!("http://{out}/conn/x"), &[], "payload").await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, "good"));
    }
    let m = metrics(&sc).await;
    assert!(
        m.contains("baton_sidecar_retries_total{outcome=\"sent\"}"),
        "{m}"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_is_never_retried_on_a_5xx_or_a_reset() {
    let a = upstream("a").await;
    let sc = sidecar(
        &format!("{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}']}}]\nroutes: [{{name: r, backends: [{{cluster: a}}], retry: {{attempts: 3, on_statuses: [503], budget_min_per_sec: 100}}}}]"),
        &[("A", a.addr)],
    )
    .await;
    let out = sc.addr("out").unwrap();
    let c = client();
    let (s, _, _) = send(&c, "POST", format!("http://{out}/status/503"), &[], "x").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(a.hits.load(Ordering::SeqCst), 1, "POST sent exactly once");
    let (s, _, body) = send(&c, "POST", format!("http://{out}/reset"), &[], "x").await;
    assert_eq!(s, StatusCode::BAD_GATEWAY, "{body}");
    assert_eq!(
        a.hits.load(Ordering::SeqCst),
        2,
        "POST after a reset is not retried"
    );
    let (s, _, _) = send(&c, "GET", format!("http://{out}/reset"), &[], "").await;
    assert_eq!(s, StatusCode::BAD_GATEWAY);
    assert_eq!(
        a.hits.load(Ordering::SeqCst),
        6,
        "GET after a reset is retried 3 times"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_and_per_try_timeouts_answer_504() {
    let a = upstream("a").await;
    let sc = sidecar(
        &format!(
            "{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}']}}]
routes:
- {{name: per-try, match: {{path: {{prefix: /slow/3000}}}}, backends: [{{cluster: a}}], retry: {{attempts: 1, per_try_timeout_ms: 100, budget_min_per_sec: 100}}}}
- {{name: r, backends: [{{cluster: a}}], timeout_ms: 200}}"
        ),
        &[("A", a.addr)],
    )
    .await;
    let out = sc.addr("out").unwrap();
    let (s, _, body) = get(out, "/slow/2000").await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT, "{body}");
    assert!(body.contains("upstream request timeout"), "{body}");
    let (s, _, _) = get(out, "/slow/1").await;
    assert_eq!(s, StatusCode::OK);
    let (s, _, _) = get(out, "/slow/3000").await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(
        a.hits.load(Ordering::SeqCst),
        4,
        "per-try timeout retried once"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_abort_and_delay_requests_without_reaching_the_upstream() {
    let a = upstream("a").await;
    let sc = sidecar(
        &format!(
            "{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}']}}]
routes:
- {{name: abort, match: {{path: {{prefix: /abort}}}}, backends: [{{cluster: a}}], fault: {{abort: {{percent: 100, status: 418}}}}}}
- {{name: delay, match: {{path: {{prefix: /delay}}}}, backends: [{{cluster: a}}], fault: {{delay: {{percent: 100, ms: 300}}}}}}
- {{name: delay-timeout, match: {{path: {{prefix: /dt}}}}, backends: [{{cluster: a}}], fault: {{delay: {{percent: 100, ms: 50}}}}}}"
        ),
        &[("A", a.addr)],
    )
    .await;
    let out = sc.addr("out").unwrap();
    let (s, h, body) = get(out, "/abort").await;
    assert_eq!(s.as_u16(), 418);
    assert_eq!(h["x-baton-local-reason"], "fault_abort");
    assert_eq!(body, "fault injected\n");
    assert_eq!(a.hits.load(Ordering::SeqCst), 0);
    let started = std::time::Instant::now();
    let (s, _, _) = get(out, "/delay").await;
    assert_eq!(s, StatusCode::OK);
    // Not a timing threshold on the proxy's speed: the delay is a lower bound by construction.
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(a.hits.load(Ordering::SeqCst), 1);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirrored_requests_reach_the_shadow_without_changing_the_response() {
    let main = upstream("main").await;
    let shadow = upstream("shadow").await;
    let sc = sidecar(
        &format!(
            "{ONE_LISTENER}clusters: [{{name: main, endpoints: ['{{M}}']}}, {{name: shadow, endpoints: ['{{S}}']}}]
routes: [{{name: r, backends: [{{cluster: main}}], mirror: {{cluster: shadow, percent: 100}}}}]"
        ),
        &[("M", main.addr), ("S", shadow.addr)],
    )
    .await;
    let out = sc.addr("out").unwrap();
    let c = client();
    for _ in 0..5 {
        let (s, _, body) = send(
            &c,
            "POST",
            format!("http://{out}/echo"),
            &[],
            "mirrored-body",
        )
        .await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, "mirrored-body"));
    }
    // Mirrors are fire-and-forget and may arrive in any order: let the five
    // POST copies land (bounded) before the GET, so `last` is the GET's.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while shadow.hits.load(Ordering::SeqCst) < 5 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (s, _, body) = get(out, "/status/200").await;
    assert_eq!((s, body.as_str()), (StatusCode::OK, "main"));
    while shadow.hits.load(Ordering::SeqCst) < 6 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(shadow.hits.load(Ordering::SeqCst), 6);
    assert_eq!(main.hits.load(Ordering::SeqCst), 6);
    let (m, p, _) = shadow.last.lock().unwrap().clone().unwrap();
    assert_eq!((m.as_str(), p.as_str()), ("GET", "/status/200"));
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_denies_by_path_and_allows_by_source_ip_on_its_listener_only() {
    let a = upstream("a").await;
    let sc = sidecar(
        "listeners: [{name: in, address: '127.0.0.1:0', rbac: p}, {name: open, address: '127.0.0.1:0'}]
clusters: [{name: a, endpoints: ['{A}']}]
routes: [{name: r, backends: [{cluster: a}]}]
policies:
  rbac:
  - name: p
    rules:
    - {action: deny, path_prefixes: [/admin]}
    - {action: allow, identities: ['spiffe://td/ns/x/sa/y']}
    - {action: allow, cidrs: [127.0.0.0/8], methods: [GET]}
    default_action: deny",
        &[("A", a.addr)],
    )
    .await;
    let inb = sc.addr("in").unwrap();
    let c = client();
    assert_eq!(get(inb, "/ok").await.0, StatusCode::OK);
    let (s, h, body) = get(inb, "/admin/x").await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_eq!(h["x-baton-local-reason"], "rbac_denied");
    assert!(body.contains("rbac"), "{body}");
    let (s, _, _) = send(&c, "POST", format!("http://{inb}/ok"), &[], "").await;
    assert_eq!(
        s,
        StatusCode::FORBIDDEN,
        "POST from loopback without identity is not allowed"
    );
    assert_eq!(
        get(sc.addr("open").unwrap(), "/admin/x").await.0,
        StatusCode::OK,
        "policy is per listener"
    );
    assert_eq!(a.hits.load(Ordering::SeqCst), 2);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outlier_ejection_stops_traffic_to_a_failing_endpoint() {
    let good = upstream("good").await;
    let dead = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let sc = sidecar(
        &format!(
            "{ONE_LISTENER}clusters: [{{name: c, endpoints: ['{{DEAD}}', '{{GOOD}}'], outlier: {{consecutive_failures: 2, base_ejection_ms: 60000, max_ejection_ms: 120000}}}}]
routes: [{{name: r, backends: [{{cluster: c}}]}}]"
        ),
        &[("GOOD", good.addr), ("DEAD", dead)],
    )
    .await;
    let out = sc.addr("out").unwrap();
    let mut failures = 0;
    for _ in 0..20 {
        let (s, _, _) = get(out, "/").await;
        if s != StatusCode::OK {
            failures += 1;
        }
    }
    assert_eq!(
        failures, 2,
        "only the failures before ejection reach the dead endpoint"
    );
    let m = metrics(&sc).await;
    assert!(m.contains("baton_sidecar_outlier_ejections_total 1"), "{m}");
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_gives_503_with_a_clear_body() {
    let dead = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let sc = sidecar(
        &format!("{ONE_LISTENER}clusters: [{{name: gone, endpoints: ['{{D}}']}}, {{name: empty, endpoints: []}}]
routes: [{{name: e, match: {{path: {{prefix: /empty}}}}, backends: [{{cluster: empty}}]}}, {{name: r, backends: [{{cluster: gone}}]}}]"),
        &[("D", dead)],
    )
    .await;
    let out = sc.addr("out").unwrap();
    let (s, h, body) = get(out, "/").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(h["x-baton-local-reason"], "upstream_unavailable");
    assert!(
        body.starts_with("upstream unavailable: route r: gone"),
        "{body}"
    );
    assert!(body.contains(&dead.to_string()), "{body}");
    let (s, _, body) = get(out, "/empty").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("cluster empty has no endpoints"), "{body}");
    assert!(
        metrics(&sc)
            .await
            .contains("baton_sidecar_upstream_errors_total{class=\"connect\"}")
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_oversized_and_smuggling_shaped_requests_are_refused() {
    let a = upstream("a").await;
    let sc = sidecar(
        &format!("{ONE_LISTENER}runtime: {{max_header_bytes: 4096}}\nclusters: [{{name: a, endpoints: ['{{A}}']}}]\nroutes: [{{name: r, backends: [{{cluster: a}}]}}]"),
        &[("A", a.addr)],
    )
    .await;
    let out = sc.addr("out").unwrap();
    let bad = raw(out, b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n").await;
    assert!(bad.starts_with("HTTP/1.1 400"), "{bad}");
    let big = format!(
        "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(8000)
    );
    let resp = raw(out, big.as_bytes()).await;
    assert!(resp.starts_with("HTTP/1.1 431"), "{resp}");
    let dup_cl = raw(
        out,
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde",
    )
    .await;
    assert!(
        dup_cl.starts_with("HTTP/1.1 400"),
        "conflicting Content-Length: {dup_cl}"
    );
    let bad_te = raw(
        out,
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\nabc",
    )
    .await;
    assert!(
        bad_te.starts_with("HTTP/1.1 400"),
        "non-chunked Transfer-Encoding: {bad_te}"
    );
    // Header shapes that let two parsers disagree on where a header ends:
    // obs-fold and whitespace before the colon are refused by the parser.
    for shape in [
        &b"POST /echo HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n Content-Length: 4\r\n\r\nabcd"[..],
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length : 4\r\n\r\nabcd",
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    ] {
        let resp = raw(out, shape).await;
        assert!(
            resp.starts_with("HTTP/1.1 400"),
            "{:?}: {resp}",
            String::from_utf8_lossy(shape)
        );
    }
    // Transfer codings other than one `chunked`: not forwarded.
    let gzip = raw(
        out,
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    )
    .await;
    assert!(gzip.starts_with("HTTP/1.1 501"), "{gzip}");
    let twice = raw(
        out,
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    )
    .await;
    assert!(twice.starts_with("HTTP/1.1 400"), "{twice}");
    let te_10 = raw(
        out,
        b"POST /echo HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    )
    .await;
    assert!(
        te_10.starts_with("HTTP/1.1 400"),
        "Transfer-Encoding in HTTP/1.0: {te_10}"
    );
    assert_eq!(
        a.hits.load(Ordering::SeqCst),
        0,
        "nothing malformed reached the upstream"
    );

    // Content-Length + Transfer-Encoding, in either order: refused (400) and
    // the connection closed; the request hidden in the body is never parsed,
    // so it cannot reach the upstream.
    for smuggle in [
        &b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    ] {
        let resp = raw(out, smuggle).await;
        assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
        assert_eq!(
            resp.matches("HTTP/1.1 ").count(),
            1,
            "exactly one response: {resp}"
        );
        assert!(
            resp.to_ascii_lowercase().contains("connection: close"),
            "{resp}"
        );
        assert!(
            resp.contains("both Content-Length and Transfer-Encoding"),
            "{resp}"
        );
    }
    assert_eq!(
        a.hits.load(Ordering::SeqCst),
        0,
        "neither the refused requests nor the smuggled ones reached the upstream"
    );

    // Pipelined behind a good request on the same connection: the good one is
    // proxied, the conflicting one refused, the smuggled one never seen.
    let pipelined = raw(
        out,
        b"GET /first HTTP/1.1\r\nHost: x\r\n\r\nPOST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    let codes: Vec<&str> = pipelined
        .match_indices("HTTP/1.1 ")
        .map(|(i, _)| &pipelined[i + 9..i + 12])
        .collect();
    assert_eq!(codes, ["200", "400"], "{pipelined}");
    assert_eq!(a.hits.load(Ordering::SeqCst), 1);
    let (_, path, _) = a.last.lock().unwrap().clone().unwrap();
    assert_eq!(path, "/first");

    // A chunked body that merely contains a request is data: forwarded as
    // the body, and the next pipelined request is found after it.
    let inner = "GET /smuggled HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n";
    let legit = raw(
        out,
        format!(
            "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{inner}\r\n0\r\n\r\nGET /after HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            inner.len()
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(legit.matches("HTTP/1.1 200").count(), 2, "{legit}");
    assert!(legit.contains(inner), "body echoed: {legit}");
    assert_eq!(a.hits.load(Ordering::SeqCst), 3);
    let (_, path, _) = a.last.lock().unwrap().clone().unwrap();
    assert_eq!(path, "/after");

    let m = metrics(&sc).await;
    assert!(
        m.contains("baton_sidecar_local_responses_total{reason=\"request_smuggling\"} 3"),
        "{m}"
    );
    assert!(
        m.contains("baton_sidecar_local_responses_total{reason=\"transfer_coding_unsupported\"} 1"),
        "{m}"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_has_zero_failed_requests_and_switches_backends() {
    let a = upstream("a").await;
    let b = upstream("b").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.yaml");
    let cfg = |version: u32, cluster: &str| {
        format!(
            "version: {version}\nadmin: {{address: '127.0.0.1:0'}}\nlisteners: [{{name: out, address: '127.0.0.1:0'}}]
clusters: [{{name: a, endpoints: ['{}']}}, {{name: b, endpoints: ['{}']}}]
routes: [{{name: r, backends: [{{cluster: {cluster}}}]}}]\n",
            a.addr, b.addr
        )
    };
    std::fs::write(&path, cfg(1, "a")).unwrap();
    let snap = yaml::parse(&cfg(1, "a")).unwrap();
    let sc = start(
        snap,
        StartOptions {
            watch: Some((path.clone(), Duration::from_millis(20))),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let out = sc.addr("out").unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..4 {
        let stop = stop.clone();
        workers.push(tokio::spawn(async move {
            let c = client();
            let (mut ok, mut failed, mut seen_b) = (0u32, 0u32, false);
            // Bounded in count and time.
            for _ in 0..5000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let r = c
                    .request(
                        Request::get(format!("http://{out}/"))
                            .body(Full::new(Bytes::new()))
                            .unwrap(),
                    )
                    .await;
                match r {
                    Ok(resp) if resp.status() == StatusCode::OK => {
                        let body = resp.into_body().collect().await.unwrap().to_bytes();
                        seen_b |= body == "b";
                        ok += 1;
                    }
                    Ok(resp) => {
                        let st = resp.status();
                        let body = resp.into_body().collect().await.unwrap().to_bytes();
                        eprintln!("failed: {st} {body:?}");
                        failed += 1
                    }
                    Err(e) => {
                        eprintln!("failed: {e:?}");
                        failed += 1
                    }
                }
            }
            (ok, failed, seen_b)
        }));
    }
    let mut invalid_refused = false;
    for v in 2..12u32 {
        tokio::time::sleep(Duration::from_millis(60)).await;
        std::fs::write(&path, cfg(v, if v % 2 == 0 { "b" } else { "a" })).unwrap();
        if v == 7 {
            // Wait (bounded) for 7 to be serving, then for the invalid file
            // to be seen and refused: polling intervals stretch under load.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while sc.shared.store.version() != 7 && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            std::fs::write(
                &path,
                "version: 99\nroutes: [{name: r, backends: [{cluster: nope}]}]\n",
            )
            .unwrap();
            let refused = "baton_sidecar_config_apply_errors_total{reason=\"invalid\"} 1";
            while !metrics(&sc).await.contains(refused) && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            invalid_refused = sc.shared.store.version() == 7;
        }
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while sc.shared.store.version() != 11 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut ok, mut failed, mut seen_b) = (0, 0, false);
    for w in workers {
        let (o, f, b) = w.await.unwrap();
        ok += o;
        failed += f;
        seen_b |= b;
    }
    assert_eq!(failed, 0, "{ok} ok, {failed} failed");
    assert!(ok > 0 && seen_b);
    assert!(
        invalid_refused,
        "invalid file was refused while version 7 kept serving"
    );
    assert_eq!(sc.shared.store.version(), 11);
    let m = metrics(&sc).await;
    assert!(m.contains("baton_sidecar_config_version 11"), "{m}");
    assert!(
        m.contains("baton_sidecar_config_apply_errors_total{reason=\"invalid\"} 1"),
        "{m}"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_report_state_redact_secrets_and_shutdown_drains() {
    let a = upstream("a").await;
    let sc = sidecar(
        &format!("{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}']}}]\nroutes: [{{name: r, backends: [{{cluster: a}}]}}]\ntls: {{source: {{files: {{cert_chain: /x.pem, key: /PRIVATE.pem, trust_bundle: /ca.pem}}}}}}"),
        &[("A", a.addr)],
    )
    .await;
    let admin = sc.admin_addr;
    assert_eq!(get(admin, "/ready").await.0, StatusCode::OK);
    assert_eq!(get(admin, "/live").await.0, StatusCode::OK);
    let (_, _, cfg) = get(admin, "/config").await;
    assert!(
        cfg.contains("<redacted>") && !cfg.contains("PRIVATE") && cfg.contains("/x.pem"),
        "{cfg}"
    );
    assert_eq!(get(sc.addr("out").unwrap(), "/").await.0, StatusCode::OK);
    let m = metrics(&sc).await;
    for family in [
        "lifecycle_phase{phase=\"serving\"} 1",
        "config_version",
        "connections_active",
        "config_applies_total",
    ] {
        assert!(m.contains(family), "missing {family}: {m}");
    }
    let (s, _, _) = send(
        &client(),
        "POST",
        format!("http://{admin}/log-level"),
        &[],
        "debug",
    )
    .await;
    assert_eq!(
        s,
        StatusCode::NOT_IMPLEMENTED,
        "tests install no global subscriber"
    );
    // A request in flight when /shutdown arrives still completes.
    let out = sc.addr("out").unwrap();
    let slow = tokio::spawn(async move { get(out, "/slow/300").await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (s, _, _) = send(
        &client(),
        "POST",
        format!("http://{admin}/shutdown"),
        &[],
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        get(admin, "/ready").await.0,
        StatusCode::SERVICE_UNAVAILABLE,
        "not ready while draining"
    );
    assert_eq!(slow.await.unwrap().0, StatusCode::OK);
    let lc = sc.shared.lifecycle.clone();
    sc.drain(Duration::from_secs(5)).await;
    assert_eq!(lc.current(), baton_sidecar::lifecycle::Phase::Stopped);
    assert!(
        TcpStream::connect(out).await.is_err(),
        "listener closed after drain"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_loop_lag_probe_samples_the_serving_runtime() {
    let a = upstream("a").await;
    let sc = sidecar(
        &format!("{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}']}}]\nroutes: [{{name: r, backends: [{{cluster: a}}]}}]"),
        &[("A", a.addr)],
    )
    .await;
    let samples = |m: &str| -> u64 {
        m.lines()
            .find_map(|l| l.strip_prefix("baton_sidecar_event_loop_lag_seconds_count "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    // Bounded wait: the probe samples every ~10 ms.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut m = metrics(&sc).await;
    while samples(&m) < 3 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        m = metrics(&sc).await;
    }
    assert!(samples(&m) >= 3, "{m}");
    assert!(
        m.contains("baton_sidecar_event_loop_lag_seconds_bucket{le=\"0.00001\"}"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_connection_parks_between_requests_with_its_pipelined_bytes() {
    let a = upstream("a").await;
    let sc = sidecar(&format!("{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}']}}]\nroutes: [{{name: r, backends: [{{cluster: a}}]}}]"), &[("A", a.addr)]).await;
    let mut s = TcpStream::connect(sc.addr("out").unwrap()).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let conns = sc.shared.registry.list();
    assert_eq!(conns.len(), 1);
    assert_eq!(conns[0].kind, baton_sidecar::conn::ConnKind::Http1);
    let parked = sc
        .shared
        .registry
        .park(conns[0].id, true)
        .unwrap()
        .await
        .unwrap()
        .parked;
    let baton_sidecar::conn::Parked::Http1 {
        downstream, unread, ..
    } = parked
    else {
        panic!("http1")
    };
    assert!(unread.is_empty());
    let baton_sidecar::conn::ParkedIo::Tcp(mut downstream) = downstream else {
        panic!("a plain socket")
    };
    // The client keeps using the same connection; the new owner sees the bytes.
    s.write_all(b"GET /next HTTP/1.1\r\n").await.unwrap();
    let mut got = [0u8; 20];
    downstream.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"GET /next HTTP/1.1\r\n");
    // The connection's task deregisters right after handing the sockets
    // over; the reply can arrive first, so wait for it (bounded).
    assert!(
        tokio::time::timeout(Duration::from_secs(5), sc.shared.registry.wait_empty())
            .await
            .is_ok(),
        "parked connection left the registry"
    );
    sc.stop().await;
}

/// A raw HTTP/1.1 upstream with canned responses by path, for framings a
/// hyper server does not produce on demand. Records every request head and
/// body it receives and counts its connections.
struct Canned {
    addr: SocketAddr,
    conns: Arc<AtomicUsize>,
    seen: Arc<std::sync::Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Canned {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn canned_upstream() -> Canned {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (c, sn) = (conns.clone(), seen.clone());
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            let sn = sn.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        let mut chunk = [0u8; 4096];
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
                    let len: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap())
                        })
                        .unwrap_or(0);
                    while buf.len() < end + 4 + len {
                        let mut chunk = [0u8; 4096];
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).into_owned();
                    buf.drain(..end + 4 + len);
                    sn.lock().unwrap().push(format!("{head}{body}"));
                    let path = head.split(' ').nth(1).unwrap_or("/").to_owned();
                    let resp: String = match path.as_str() {
                        "/chunked" => "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-u: 1\r\n\r\n4\r\nWiki\r\n5;e=1\r\npedia\r\n0\r\nx-t: 1\r\n\r\n".into(),
                        "/close" => "HTTP/1.1 200 OK\r\nx-u: 1\r\n\r\nuntil-close".into(),
                        "/nocontent" => "HTTP/1.1 204 No Content\r\nx-u: 1\r\n\r\n".into(),
                        "/interim" => "HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".into(),
                        "/hop" => "HTTP/1.1 200 OK\r\nconnection: x-secret\r\nx-secret: 1\r\nkeep-alive: timeout=5\r\ncontent-length: 2\r\n\r\nok".into(),
                        "/length" => "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n0123456789".into(),
                        "/big" => format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{}", 1 << 20, "0123456789abcdef".repeat(1 << 16)),
                        _ => format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len()),
                    };
                    // HEAD: the head only (its content-length describes GET).
                    let resp = if head.starts_with("HEAD ") {
                        resp.split_once("\r\n\r\n")
                            .map(|(h, _)| format!("{h}\r\n\r\n"))
                            .unwrap()
                    } else {
                        resp
                    };
                    if s.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                    // `/close` is close-delimited; `/drop` answers, then
                    // closes a connection it said it would keep.
                    if path == "/close" || path == "/drop" {
                        return;
                    }
                }
            });
        }
    });
    Canned {
        addr,
        conns,
        seen,
        task,
    }
}

/// Read one response from a keep-alive connection: the head, then a body by
/// `content-length` or up to the end of a chunked body.
async fn read_response(s: &mut TcpStream, head_only: bool) -> String {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = String::from_utf8_lossy(&out).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let lower = head.to_ascii_lowercase();
            let done = if head_only || head.starts_with("HTTP/1.1 204") {
                true
            } else if let Some(l) = lower
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
            {
                body.len() >= l.trim().parse::<usize>().unwrap()
            } else if lower.contains("transfer-encoding: chunked") {
                body.ends_with("\r\n\r\n") && body.contains("\r\n0\r\n")
            } else {
                false
            };
            if done {
                return text;
            }
        }
        let mut chunk = vec![0u8; 64 * 1024];
        match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => out.extend_from_slice(&chunk[..n]),
            _ => return String::from_utf8_lossy(&out).into_owned(),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http1_fast_path_copies_every_framing_strips_hop_by_hop_headers_and_hands_the_rest_to_hyper()
 {
    let up = canned_upstream().await;
    let sc = sidecar(&format!("{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}']}}]\nroutes: [{{name: r, backends: [{{cluster: a}}]}}]"), &[("A", up.addr)]).await;
    let addr = sc.addr("out").unwrap();
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut ask = async |req: &str, head_only: bool| {
        s.write_all(req.as_bytes()).await.unwrap();
        read_response(&mut s, head_only).await
    };

    // Chunked response: copied as it is, extensions and trailers included.
    let r = ask("GET /chunked HTTP/1.1\r\nHost: x\r\n\r\n", false).await;
    assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
    assert!(
        r.ends_with("\r\n\r\n4\r\nWiki\r\n5;e=1\r\npedia\r\n0\r\nx-t: 1\r\n\r\n"),
        "{r}"
    );
    // Hop-by-hop response headers and the ones `connection` names go.
    let r = ask("GET /hop HTTP/1.1\r\nHost: x\r\n\r\n", false).await;
    assert!(
        r.ends_with("\r\n\r\nok") && !r.contains("x-secret") && !r.contains("keep-alive"),
        "{r}"
    );
    // A body larger than any buffer, byte for byte.
    let r = ask("GET /big HTTP/1.1\r\nHost: x\r\n\r\n", false).await;
    let body = r.split_once("\r\n\r\n").unwrap().1;
    assert!(
        body == "0123456789abcdef".repeat(1 << 16),
        "1 MiB body, got {} bytes",
        body.len()
    );
    // HEAD: a content-length with no body; the next response still parses.
    let r = ask("HEAD /length HTTP/1.1\r\nHost: x\r\n\r\n", true).await;
    assert!(
        r.contains("content-length: 10\r\n") && r.ends_with("\r\n\r\n"),
        "{r}"
    );
    let r = ask("GET /nocontent HTTP/1.1\r\nHost: x\r\n\r\n", false).await;
    assert!(r.starts_with("HTTP/1.1 204"), "{r}");
    // Interim 1xx responses are not forwarded.
    let r = ask("GET /interim HTTP/1.1\r\nHost: x\r\n\r\n", false).await;
    assert!(
        r.starts_with("HTTP/1.1 200 OK\r\n") && r.ends_with("ok"),
        "{r}"
    );
    // A request body, and hop-by-hop request headers dropped.
    let r = ask("POST /echo?q=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: keep-alive, x-drop\r\nX-Drop: 1\r\nTE: trailers\r\nX-Keep: 2\r\n\r\nhello", false).await;
    assert!(r.ends_with("\r\n\r\nhello"), "{r}");
    let last = up.seen.lock().unwrap().last().cloned().unwrap();
    // The sidecar's own trace context comes last (a new trace: the
    // request had none).
    let (rest, traceparent) = last
        .split_once("traceparent: ")
        .expect("a traceparent is forwarded");
    let (traceparent, body) = traceparent.split_once("\r\n").unwrap();
    assert_eq!(traceparent.len(), 55, "{traceparent}");
    assert_eq!(
        format!("{rest}{body}"),
        "POST /echo?q=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nX-Keep: 2\r\n\r\nhello"
    );
    // All of that on one upstream connection, bound to this client's.
    assert_eq!(up.conns.load(Ordering::SeqCst), 1);

    // The upstream closes a kept-alive connection while it is idle (its
    // keep-alive timeout): even a POST, which is never sent twice, goes on
    // a fresh connection instead of failing on the closed one.
    let r = ask("GET /drop HTTP/1.1\r\nHost: x\r\n\r\n", false).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = ask(
        "POST /after-drop HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi",
        false,
    )
    .await;
    assert!(
        r.starts_with("HTTP/1.1 200") && r.ends_with("\r\n\r\nhi"),
        "{r}"
    );
    assert_eq!(up.conns.load(Ordering::SeqCst), 2);

    // A close-delimited response ends the client's connection too.
    s.write_all(b"GET /close HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    let r = String::from_utf8_lossy(&rest);
    assert!(
        r.contains("connection: close\r\n") && r.ends_with("\r\n\r\nuntil-close"),
        "{r}"
    );

    // `Expect` is not the fast path's: hyper serves the request (and the
    // rest of that connection), with every byte read so far.
    let r = raw(addr, b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc").await;
    assert!(
        r.contains("HTTP/1.1 200 OK\r\n") && r.ends_with("\r\n\r\nabc"),
        "{r}"
    );
    let m = metrics(&sc).await;
    let fast: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("baton_sidecar_h1_fast_path_requests_total "))
        .expect("fast path counter")
        .parse()
        .unwrap();
    assert_eq!(fast, 10, "{m}");
    assert!(
        m.contains("baton_sidecar_h1_fast_path_fallbacks_total{reason=\"framing\"} 1"),
        "{m}"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_http1_fast_path_off_hyper_serves_every_request() {
    let a = upstream("a").await;
    let sc = sidecar(&format!("runtime: {{h1_fast_path: false}}\n{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}']}}]\nroutes: [{{name: r, backends: [{{cluster: a}}]}}]"), &[("A", a.addr)]).await;
    let (status, _, body) = get(sc.addr("out").unwrap(), "/").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "a"));
    let m = metrics(&sc).await;
    assert!(
        m.contains("baton_sidecar_h1_fast_path_requests_total 0"),
        "{m}"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_path_upstream_connections_are_shared_through_the_idle_list_up_to_its_limit() {
    for (max_idle, want) in [(4, 1), (0, 5)] {
        let up = canned_upstream().await;
        let sc = sidecar(&format!("{ONE_LISTENER}clusters: [{{name: a, endpoints: ['{{A}}'], pool_max_idle_per_endpoint: {max_idle}}}]\nroutes: [{{name: r, backends: [{{cluster: a}}]}}]"), &[("A", up.addr)]).await;
        for i in 0..5 {
            // One request per client connection, as curl or a health check.
            let r = raw(
                sc.addr("out").unwrap(),
                format!("GET /n{i} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await;
            assert!(
                r.starts_with("HTTP/1.1 200") && r.contains("connection: close\r\n"),
                "{r}"
            );
        }
        assert_eq!(
            up.conns.load(Ordering::SeqCst),
            want,
            "pool_max_idle_per_endpoint {max_idle}"
        );
        // Idle keep-alive clients hold no upstream connection: three of
        // them, one request each, one after the other, share one.
        if max_idle > 0 {
            let mut clients = Vec::new();
            for i in 0..3 {
                let mut s = TcpStream::connect(sc.addr("out").unwrap()).await.unwrap();
                let req = format!("GET /k{i} HTTP/1.1\r\nHost: x\r\n\r\n");
                s.write_all(req.as_bytes()).await.unwrap();
                let r = read_response(&mut s, false).await;
                assert!(r.starts_with("HTTP/1.1 200"), "{r}");
                clients.push(s);
            }
            assert_eq!(up.conns.load(Ordering::SeqCst), want);
        }
        sc.stop().await;
    }
}
