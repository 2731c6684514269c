//! What happened to each request, seen from outside a real sidecar on
//! loopback port 0: access-log lines (HTTP/1.1, HTTP/2, TCP, local
//! answers, the rate limit), W3C trace context on both HTTP/1 paths, and
//! the per-route, per-peer metrics with their bound.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_sidecar::config::yaml;
use baton_sidecar::server::{Running, StartOptions, start};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::log_sink;
use log_sink::Sink;

/// Headers of the last request the upstream received.
type Seen = Arc<Mutex<Option<http::HeaderMap>>>;

/// An HTTP/1.1 + HTTP/2 upstream answering `ok` (with a `Set-Cookie`), or
/// the request body back on `/echo`.
async fn upstream() -> (SocketAddr, Seen, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let s = s.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let s = s.clone();
                    async move {
                        *s.lock().unwrap() = Some(req.headers().clone());
                        let echo = req.uri().path() == "/echo";
                        let body = req.into_body().collect().await?.to_bytes();
                        let mut resp = Response::new(Full::new(if echo {
                            body
                        } else {
                            Bytes::from_static(b"ok")
                        }));
                        resp.headers_mut().insert(
                            "set-cookie",
                            "sid=setcookie-secret; HttpOnly".parse().unwrap(),
                        );
                        Ok::<_, hyper::Error>(resp)
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, seen, task)
}

/// A sidecar from YAML (`{U}` = the upstream) logging into a [`Sink`].
async fn sidecar(yaml_text: &str, upstream: SocketAddr) -> (Running, Sink) {
    let text = yaml_text.replace("{U}", &upstream.to_string());
    let mut snap = yaml::parse(&text).unwrap();
    snap.admin.address = "127.0.0.1:0".parse().unwrap();
    let sink = Sink::default();
    let opts = StartOptions {
        access_log: Some(Box::new(sink.clone())),
        ..Default::default()
    };
    (start(snap, opts).await.unwrap(), sink)
}

async fn send(
    c: &Client<HttpConnector, Full<Bytes>>,
    method: &str,
    url: String,
    headers: &[(&str, &str)],
    body: &'static str,
) -> (StatusCode, http::HeaderMap, Bytes) {
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
    .expect("request succeeds");
    let (status, headers) = (resp.status(), resp.headers().clone());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, body)
}

fn h1() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

fn h2() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

async fn metrics(r: &Running) -> String {
    send(
        &h1(),
        "GET",
        format!("http://{}/metrics", r.admin_addr),
        &[],
        "",
    )
    .await
    .2
    .iter()
    .map(|b| *b as char)
    .collect()
}

/// The value of one exposition line (`name{labels}`), 0 when absent.
fn value(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0, |v| v.parse().unwrap())
}

const LOGGED: &str = "listeners: [{name: out, address: '127.0.0.1:0', access_log: true}]
clusters: [{name: app, endpoints: ['{U}']}]
routes: [{name: r, backends: [{cluster: app}]}]";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_http_request_gets_one_json_line_without_credentials_or_query() {
    let (up, _seen, _t) = upstream().await;
    let (sc, sink) = sidecar(LOGGED, up).await;
    let addr = sc.addr("out").unwrap();
    let (status, headers, _) = send(
        &h1(),
        "GET",
        format!("http://{addr}/a/b?token=query-secret"),
        &[
            ("authorization", "Bearer authz-secret"),
            ("cookie", "session=cookie-secret"),
        ],
        "",
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        headers.contains_key("set-cookie"),
        "the app's header reaches the client"
    );
    let (status, _, body) = send(
        &h2(),
        "POST",
        format!("http://{addr}/echo"),
        &[],
        "0123456789",
    )
    .await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"0123456789"[..]));

    let lines = sink.lines(2).await;
    assert_eq!(lines.len(), 2, "one line per request");
    let get = &lines[0];
    assert_eq!(get["protocol"], "http/1.1");
    assert_eq!(get["method"], "GET");
    assert_eq!(get["authority"], addr.to_string());
    assert_eq!(get["path"], "/a/b");
    assert_eq!(get["status"], 200);
    assert_eq!(get["bytes_in"], 0);
    assert_eq!(get["bytes_out"], 2);
    assert_eq!(get["upstream"], up.to_string());
    assert_eq!(get["listener"], "out");
    assert_eq!(get["route"], "r");
    assert_eq!(get["authz"], "-");
    assert_eq!(get["peer_identity"], serde_json::Value::Null);
    assert!(get["peer"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert_eq!(get["trace_id"].as_str().unwrap().len(), 32);
    assert_eq!(get["span_id"].as_str().unwrap().len(), 16);
    assert!(get["start_time"].as_str().unwrap().ends_with('Z'));
    assert!(get["duration_us"].is_u64());
    let post = &lines[1];
    assert_eq!(post["protocol"], "h2");
    assert_eq!(post["method"], "POST");
    assert_eq!(post["bytes_in"], 10);
    assert_eq!(post["bytes_out"], 10);

    let text = sink.text();
    for secret in [
        "authz-secret",
        "cookie-secret",
        "setcookie-secret",
        "query-secret",
    ] {
        assert!(!text.contains(secret), "{secret} logged: {text}");
    }
    let m = metrics(&sc).await;
    assert_eq!(value(&m, "baton_sidecar_access_log_lines_total"), 2);
    assert_eq!(
        value(&m, "baton_sidecar_h1_fast_path_requests_total"),
        1,
        "the HTTP/1.1 request and its line were served by the fast path: {m}"
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_answers_are_logged_with_their_reason_and_a_denial_as_deny() {
    let (up, _seen, _t) = upstream().await;
    let (sc, sink) = sidecar(
        "listeners: [{name: out, address: '127.0.0.1:0', access_log: true, rbac: p}]
clusters: [{name: app, endpoints: ['{U}']}]
routes: [{name: r, match: {hosts: [allowed.test]}, backends: [{cluster: app}]}]
policies:
  rbac:
  - name: p
    rules:
    - {action: deny, path_prefixes: [/admin]}
    default_action: allow",
        up,
    )
    .await;
    let addr = sc.addr("out").unwrap();
    let c = h1();
    let url = format!("http://{addr}/admin");
    let (s, _, _) = send(&c, "GET", url, &[("host", "allowed.test")], "").await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _, _) = send(
        &c,
        "GET",
        format!("http://{addr}/x"),
        &[("host", "other.test")],
        "",
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let lines = sink.lines(2).await;
    assert_eq!(lines[0]["status"], 403);
    assert_eq!(lines[0]["authz"], "deny");
    assert_eq!(lines[0]["local_reason"], "rbac_denied");
    assert_eq!(lines[0]["route"], "r");
    assert_eq!(lines[0]["upstream"], serde_json::Value::Null);
    assert_eq!(lines[1]["status"], 404);
    // The policy decided this one too (its default lets it through).
    assert_eq!(lines[1]["authz"], "allow");
    assert_eq!(lines[1]["local_reason"], "no_route");
    assert_eq!(lines[1]["route"], serde_json::Value::Null);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_connection_gets_one_line_with_its_byte_counts() {
    let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let echo_addr = echo.local_addr().unwrap();
    let _echo = tokio::spawn(async move {
        while let Ok((mut s, _)) = echo.accept().await {
            tokio::spawn(async move {
                let _ = s.write_all(b"hi!").await;
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let (sc, sink) = sidecar(
        "listeners: [{name: db, address: '127.0.0.1:0', protocol: tcp, tcp_cluster: echo, access_log: true}]
clusters: [{name: echo, endpoints: ['{U}']}]",
        echo_addr,
    )
    .await;
    let mut s = TcpStream::connect(sc.addr("db").unwrap()).await.unwrap();
    s.write_all(b"12345").await.unwrap();
    s.shutdown().await.unwrap();
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, b"hi!12345");
    let lines = sink.lines(1).await;
    let l = &lines[0];
    assert_eq!(l["protocol"], "tcp");
    assert_eq!(l["bytes_in"], 5);
    assert_eq!(l["bytes_out"], 8);
    assert_eq!(l["upstream"], echo_addr.to_string());
    assert_eq!(l["status"], serde_json::Value::Null);
    assert_eq!(l["listener"], "db");
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lines_over_the_rate_are_dropped_and_counted() {
    let (up, _seen, _t) = upstream().await;
    let (sc, sink) = sidecar(
        &format!("runtime: {{access_log_lines_per_second: 2}}\n{LOGGED}"),
        up,
    )
    .await;
    let addr = sc.addr("out").unwrap();
    let c = h1();
    for _ in 0..20 {
        let (s, _, _) = send(&c, "GET", format!("http://{addr}/"), &[], "").await;
        assert_eq!(s, StatusCode::OK);
    }
    let written = sink.lines(2).await.len() as u64;
    // Lines are submitted after each response is complete: wait for all
    // 20 to be accounted for (bounded), then compare.
    let mut m = String::new();
    for _ in 0..100 {
        m = metrics(&sc).await;
        let dropped = value(
            &m,
            "baton_sidecar_access_log_dropped_total{reason=\"rate_limited\"}",
        );
        if value(&m, "baton_sidecar_access_log_lines_total") + dropped == 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lines = value(&m, "baton_sidecar_access_log_lines_total");
    let dropped = value(
        &m,
        "baton_sidecar_access_log_dropped_total{reason=\"rate_limited\"}",
    );
    assert_eq!(lines + dropped, 20, "{m}");
    assert!(dropped > 0 && lines < 20, "{m}");
    assert!(written <= lines);
    sc.stop().await;
}

/// The trace context the upstream saw for one request through `addr`.
async fn forwarded(addr: SocketAddr, seen: &Seen, headers: &[(&str, &str)]) -> http::HeaderMap {
    let (s, _, _) = send(&h1(), "GET", format!("http://{addr}/"), headers, "").await;
    assert_eq!(s, StatusCode::OK);
    seen.lock()
        .unwrap()
        .take()
        .expect("upstream saw the request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_is_continued_with_the_sidecar_as_parent_on_both_http1_paths() {
    let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (up, seen, _t) = upstream().await;
    // `out` and `logged` (access log) take the fast path; `general` the
    // general one (a header-matching route on it).
    let (sc, sink) = sidecar(
        "listeners: [{name: out, address: '127.0.0.1:0'}, {name: logged, address: '127.0.0.1:0', access_log: true}, {name: general, address: '127.0.0.1:0'}]
clusters: [{name: app, endpoints: ['{U}']}]
routes:
- {name: by-header, listeners: [general], match: {headers: [{name: x-never, exact: 'yes'}]}, backends: [{cluster: app}]}
- {name: r, backends: [{cluster: app}]}",
        up,
    )
    .await;
    for listener in ["out", "logged", "general"] {
        let addr = sc.addr(listener).unwrap();
        let got = forwarded(
            addr,
            &seen,
            &[
                ("traceparent", incoming),
                ("tracestate", "congo=t61rcWkgMzE"),
                ("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1"),
                ("x-b3-traceid", "80f198ee56343ba864fe8b2a57d3eff7"),
            ],
        )
        .await;
        let tp = got["traceparent"].to_str().unwrap();
        assert_eq!(got.get_all("traceparent").iter().count(), 1, "{listener}");
        assert_eq!(
            &tp[..36],
            &incoming[..36],
            "{listener}: same version and trace id"
        );
        assert_ne!(
            &tp[36..52],
            &incoming[36..52],
            "{listener}: a new parent id"
        );
        assert_eq!(&tp[52..], "-01", "{listener}: sampled kept");
        assert_eq!(got["tracestate"], "congo=t61rcWkgMzE", "{listener}");
        assert_eq!(
            got["b3"], "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1",
            "{listener}"
        );
        assert_eq!(got["x-b3-traceid"], "80f198ee56343ba864fe8b2a57d3eff7");
        if listener == "logged" {
            let line = &sink.lines(1).await[0];
            assert_eq!(line["trace_id"], &incoming[3..35]);
            assert_eq!(
                line["span_id"],
                &tp[36..52],
                "the logged span is the forwarded parent"
            );
        }

        // Without a (valid) traceparent: a new trace; its tracestate goes.
        let got = forwarded(
            addr,
            &seen,
            &[
                (
                    "traceparent",
                    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                ),
                ("tracestate", "congo=t61rcWkgMzE"),
            ],
        )
        .await;
        let tp = got["traceparent"].to_str().unwrap();
        assert_eq!(tp.len(), 55, "{listener}");
        assert!(
            tp.starts_with("00-") && tp.ends_with("-01"),
            "{listener}: {tp}"
        );
        assert_ne!(&tp[3..35], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(!got.contains_key("tracestate"), "{listener}");
        let plain = forwarded(addr, &seen, &[]).await;
        let other = plain["traceparent"].to_str().unwrap();
        assert_ne!(
            &other[3..35],
            &tp[3..35],
            "{listener}: a new trace per request"
        );
    }
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_can_be_switched_off() {
    let (up, seen, _t) = upstream().await;
    let (sc, _sink) = sidecar(
        "runtime: {trace_context: false}
listeners: [{name: out, address: '127.0.0.1:0'}]
clusters: [{name: app, endpoints: ['{U}']}]
routes: [{name: r, backends: [{cluster: app}]}]",
        up,
    )
    .await;
    let addr = sc.addr("out").unwrap();
    assert!(
        !forwarded(addr, &seen, &[])
            .await
            .contains_key("traceparent")
    );
    let bad = "00-zz";
    assert_eq!(
        forwarded(addr, &seen, &[("traceparent", bad)]).await["traceparent"],
        bad
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_counted_per_route_and_peer_up_to_the_bound_then_as_overflow() {
    let (up, _seen, _t) = upstream().await;
    // Two routes, room for one (route, peer) pair; `general` takes the
    // general path (a header-matching route on it), `out` the fast path,
    // and both count the same way.
    let (sc, _sink) = sidecar(
        "runtime: {route_metrics_max_series: 1}
listeners: [{name: out, address: '127.0.0.1:0'}, {name: general, address: '127.0.0.1:0'}]
clusters: [{name: app, endpoints: ['{U}']}]
routes:
- {name: by-header, listeners: [general], match: {headers: [{name: x-never, exact: 'yes'}]}, backends: [{cluster: app}]}
- {name: first, match: {path: {prefix: /first}}, backends: [{cluster: app}]}
- {name: second, match: {path: {prefix: /second}}, backends: [{cluster: app}]}",
        up,
    )
    .await;
    let c = h1();
    for (listener, path) in [
        ("out", "/first"),
        ("general", "/first"),
        ("out", "/second"),
        ("general", "/second"),
        ("out", "/first"),
    ] {
        let url = format!("http://{}{path}", sc.addr(listener).unwrap());
        assert_eq!(send(&c, "GET", url, &[], "").await.0, StatusCode::OK);
    }
    let m = metrics(&sc).await;
    let series = |route: &str| {
        format!(
            "baton_sidecar_route_requests_total{{route=\"{route}\",peer=\"{peer}\",class=\"2xx\"}}",
            peer = if route == "overflow" {
                "overflow"
            } else {
                "unauthenticated"
            }
        )
    };
    assert_eq!(value(&m, &series("first")), 3, "{m}");
    assert_eq!(value(&m, &series("second")), 0, "{m}");
    assert_eq!(value(&m, &series("overflow")), 2, "{m}");
    assert_eq!(
        value(&m, "baton_sidecar_route_metrics_overflow_total"),
        2,
        "{m}"
    );
    assert_eq!(
        value(
            &m,
            "baton_sidecar_route_request_duration_seconds_count{route=\"first\",peer=\"unauthenticated\"}"
        ),
        3
    );
    // The per-route family without a peer still has every route.
    assert_eq!(
        value(
            &m,
            "baton_sidecar_requests_total{route=\"second\",status_class=\"2xx\"}"
        ),
        2,
        "{m}"
    );
    assert!(
        m.contains("baton_sidecar_h1_fast_path_requests_total 3"),
        "{m}"
    );
    sc.stop().await;
}
