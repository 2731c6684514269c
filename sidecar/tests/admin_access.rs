//! Who may call the sidecar: every admin endpoint called by a caller on the
//! Pod's loopback and by one from elsewhere (in process, then over a real
//! socket from a non-loopback local address), `wait-ready` still working,
//! and a handoff attempted by a process under another UID refused while the
//! old sidecar keeps serving.

use crate::handoff_support;

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_sidecar::admin::{Admin, LogLevelHook};
use baton_sidecar::config::yaml;
use baton_sidecar::lifecycle::Phase;
use baton_sidecar::server::{Running, StartOptions, start};
use bytes::Bytes;
use handoff_support::{BIN, Sidecar, World, admin_get, metric_sum};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A data plane with no listeners; its admin socket on `admin`.
async fn sidecar(admin: &str) -> Running {
    let mut snap = yaml::parse("version: 1\n").unwrap();
    snap.admin.address = admin.parse().unwrap();
    start(snap, StartOptions::default()).await.unwrap()
}

/// The admin service with a log-level hook that records what it was given.
fn with_hook(running: &Running) -> (Admin, Arc<Mutex<Vec<String>>>) {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let mut admin = running.admin.clone();
    let c = calls.clone();
    let hook: LogLevelHook = Arc::new(move |l: &str| {
        c.lock().unwrap().push(l.to_string());
        Ok(())
    });
    admin.log_level = Some(hook);
    (admin, calls)
}

async fn call(admin: &Admin, peer: &str, method: Method, path: &str) -> (StatusCode, String) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .body(Full::new(Bytes::from_static(b"debug")))
        .unwrap();
    let r = admin.handle(req, peer.parse().unwrap()).await;
    let status = r.status();
    if status == StatusCode::FORBIDDEN {
        assert_eq!(
            r.headers()["x-baton-local-reason"],
            "admin_not_loopback",
            "{path}"
        );
    }
    let body = r.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Every endpoint, the method it takes, and whether only the Pod may call it.
const ENDPOINTS: [(&str, &str, bool); 10] = [
    ("GET", "/live", false),
    ("GET", "/ready", false),
    ("GET", "/metrics", false),
    ("GET", "/handoff", false),
    ("GET", "/offload", false),
    ("GET", "/config", true),
    ("GET", "/connections", true),
    ("POST", "/log-level", true),
    ("PUT", "/log-level", true),
    ("POST", "/shutdown", true),
];

#[tokio::test]
async fn every_admin_endpoint_answers_the_pod_and_only_probes_metrics_and_status_answer_others() {
    let running = sidecar("127.0.0.1:0").await;
    let (admin, calls) = with_hook(&running);

    // Callers outside the Pod: the kubelet or another Pod over the Pod IP,
    // IPv4, IPv6 and IPv4-mapped on a dual-stack socket.
    for peer in [
        "10.0.0.7:40000",
        "[fd00::7]:40000",
        "[::ffff:10.0.0.7]:40000",
    ] {
        for (method, path, pod_only) in ENDPOINTS {
            let (status, body) = call(&admin, peer, method.parse().unwrap(), path).await;
            if pod_only {
                assert_eq!(
                    status,
                    StatusCode::FORBIDDEN,
                    "{peer} {method} {path}: {body}"
                );
                assert!(body.contains("only callers inside the Pod"), "{body}");
            } else {
                assert_eq!(status, StatusCode::OK, "{peer} {method} {path}: {body}");
            }
        }
    }
    // Nothing a refused caller asked for happened.
    assert!(calls.lock().unwrap().is_empty(), "the log level changed");
    assert_eq!(running.shared.lifecycle.current(), Phase::Serving);
    let metrics = running.shared.metrics.encode();
    for (endpoint, n) in [
        ("/config", 3),
        ("/connections", 3),
        ("/log-level", 6),
        ("/shutdown", 3),
    ] {
        assert!(
            metrics.contains(&format!(
                "baton_sidecar_admin_refused_total{{endpoint=\"{endpoint}\"}} {n}"
            )),
            "{endpoint}: {metrics}"
        );
    }

    // Callers inside the Pod (the application, `kubectl port-forward`).
    for peer in [
        "127.0.0.1:40000",
        "127.8.9.10:40000",
        "[::1]:40000",
        "[::ffff:127.0.0.1]:40000",
    ] {
        for (method, path, _) in ENDPOINTS.iter().filter(|e| e.1 != "/shutdown") {
            let (status, body) = call(&admin, peer, method.parse().unwrap(), path).await;
            assert_eq!(status, StatusCode::OK, "{peer} {method} {path}: {body}");
        }
    }
    assert_eq!(
        calls.lock().unwrap().len(),
        8,
        "two log-level calls per peer"
    );
    // The Jobs contract: the application in the same Pod ends the sidecar.
    let (status, _) = call(&admin, "127.0.0.1:40000", Method::POST, "/shutdown").await;
    assert_eq!(status, StatusCode::OK);
    assert!(running.shared.lifecycle.current() >= Phase::Draining);
    running.stop().await;
}

/// A local IPv4 address that is not loopback (traffic to it never leaves
/// the machine: the kernel delivers it locally), if the machine has one.
fn non_loopback_local_ipv4() -> Option<IpAddr> {
    nix::ifaddrs::getifaddrs()
        .ok()?
        .filter_map(|i| i.address?.as_sockaddr_in().map(|a| IpAddr::V4(a.ip())))
        .find(|ip| !ip.is_loopback() && !ip.is_unspecified())
}

/// One raw HTTP/1.1 request to `to` from a socket bound to `from`.
async fn request_from(from: IpAddr, to: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::new(from, 0)).unwrap();
    let mut s = tokio::time::timeout(Duration::from_secs(5), sock.connect(to))
        .await
        .unwrap()
        .unwrap();
    s.write_all(
        format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    (
        text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0),
        text,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_real_socket_a_non_loopback_caller_is_refused_and_wait_ready_still_works() {
    let running = sidecar("0.0.0.0:0").await;
    let port = running.admin_addr.port();
    let loopback = SocketAddr::from(([127, 0, 0, 1], port));

    // `baton-sidecar wait-ready` (the application's start gate) calls from loopback.
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(BIN)
            .args([
                "wait-ready",
                "--admin",
                &loopback.to_string(),
                "--timeout-secs",
                "10",
            ])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let lo = IpAddr::from([127, 0, 0, 1]);
    assert_eq!(request_from(lo, loopback, "GET", "/config").await.0, 200);
    // No TLS in this config: no engine was chosen.
    let (status, response) = request_from(lo, loopback, "GET", "/offload").await;
    assert_eq!(status, 200);
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    let report: baton_config::report::OffloadReport =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {response}"));
    assert!(!report.configured, "{body}");

    let Some(ip) = non_loopback_local_ipv4() else {
        eprintln!("SKIPPED the non-loopback half: this machine has no non-loopback IPv4 address");
        running.stop().await;
        return;
    };
    let outside = SocketAddr::new(ip, port);
    for (method, path, want) in [
        ("GET", "/ready", 200),
        ("GET", "/metrics", 200),
        ("GET", "/handoff", 200),
        ("GET", "/offload", 200),
        ("GET", "/config", 403),
        ("GET", "/connections", 403),
        ("POST", "/log-level?level=trace", 403),
        ("POST", "/shutdown", 403),
    ] {
        let (status, text) = request_from(ip, outside, method, path).await;
        assert_eq!(status, want, "{method} {path} from {ip}: {text}");
    }
    assert_eq!(running.shared.lifecycle.current(), Phase::Serving);
    // The same socket still serves the Pod.
    let (status, _) = request_from(lo, loopback, "POST", "/shutdown").await;
    assert_eq!(status, 200);
    running.stop().await;
}

/// Old sidecar serving; a process under `nobody` (the application container
/// that mounts the shared volume) tries to take over. The socket's mode
/// keeps it from connecting at all; with the mode opened up (root in the
/// application container bypasses it), SO_PEERCRED refuses it. Either way
/// the old sidecar keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_attempt_from_another_uid_is_refused_and_the_old_sidecar_keeps_serving() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root to start a process under another UID (nobody)");
        return;
    }
    const NOBODY: u32 = 65534;
    let world = World::new().await;
    let mut old = world.spawn(&[]);
    world.wait_ready(Duration::from_secs(20)).await;
    let mode = std::fs::metadata(&world.socket)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the handoff socket is owner-only");
    // Let `nobody` read the config and reach the socket's directory.
    std::fs::set_permissions(world.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&world.config, std::fs::Permissions::from_mode(0o644)).unwrap();

    // The test binary may sit under a directory `nobody` cannot search
    // (CI builds under /root/.cache), so the intruder runs a copy.
    let bin = world.dir.path().join("baton-sidecar-copy");
    std::fs::copy(BIN, &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let intruder = |n: u32| {
        let log = world.dir.path().join(format!("intruder-{n}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(["run", "--config"])
            .arg(&world.config)
            .env("BATON_HANDOFF_SOCKET", &world.socket)
            .env(
                "BATON_HANDOFF_STATUS_FILE",
                world.dir.path().join("intruder-status.json"),
            )
            .env("BATON_LOG", "info")
            // Its own check of the old sidecar's UID passes, so it gets as
            // far as asking: the old sidecar's refusal is what is tested.
            .env("BATON_HANDOFF_PEER_UIDS", "0")
            .uid(NOBODY)
            .gid(NOBODY)
            .stdin(std::process::Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        // A child forked by a parallel test while the copy was open for
        // writing may hold it briefly: ETXTBSY, retried.
        let mut tries = 0;
        let child = loop {
            match cmd.spawn() {
                Err(e) if e.raw_os_error() == Some(26) && tries < 50 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => break other.unwrap(),
            }
        };
        Sidecar { child, log }
    };
    let refused_peer = || async {
        let m = admin_get(world.admin, "/metrics").await.unwrap().1;
        metric_sum(
            &m,
            r#"baton_sidecar_handoffs_total{role="old",result="refused_peer"}"#,
        )
    };

    // 1. Owner-only socket: `nobody` cannot connect; it gives up.
    let mut first = intruder(1);
    assert!(
        first.wait_exit(Duration::from_secs(20)).is_some(),
        "the intruder kept running:\n{}",
        first.log_all()
    );
    assert_eq!(refused_peer().await, 0, "it never reached the old sidecar");

    // 2. Socket opened to everyone: it connects, SO_PEERCRED refuses it.
    std::fs::set_permissions(&world.socket, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut second = intruder(2);
    let exited = second.wait_exit(Duration::from_secs(20));
    let log = second.log_all();
    assert!(
        exited.is_some_and(|s| !s.success()),
        "the intruder did not fail: {exited:?}\n{log}"
    );
    assert!(log.contains("is not the sidecar's uid"), "{log}");
    assert_eq!(refused_peer().await, 1);
    assert!(
        old.log_all()
            .contains("handoff refused: the peer is not a sidecar of this Pod"),
        "{}",
        old.log_all()
    );

    // The old sidecar never stopped serving.
    assert!(old.alive());
    let (status, body) = admin_get(world.admin, "/handoff").await.unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("\"phase\": \"serving\""), "{body}");
    let mut c = handoff_support::connect(world.http).await;
    assert!(handoff_support::get(&mut c, "/after-intruder").await);
    assert!(world.status().is_none(), "no handoff happened");
}
