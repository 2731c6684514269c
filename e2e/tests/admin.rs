//! The sidecar's admin port in a real Pod (issue #25): callers from another
//! Pod can read probes, metrics and the handoff status but cannot drain the
//! sidecar, change its log level or read its configuration; the kubelet's
//! probes and a scrape from the node keep working; the application in the
//! same Pod can still end the sidecar with `POST /shutdown` (the Jobs
//! contract).
//!
//! The meshed Pod is built here from the e2e `sidecar` image with the
//! injected container's admin settings (the in-Pod default snapshot binds
//! `0.0.0.0:15020`, probes on that port, the sidecar's UID), so these tests
//! need only the cluster, not an installed webhook.
//!
//! `#[ignore]`d: run with `e2e/run.sh` (needs root and the local cluster).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use baton_crds::contract::{self, SIDECAR_UID, commands, ports};
use baton_e2e::{kubectl, pods, wait, with_temp_ns};
use k8s_openapi::api::core::v1::{HTTPGetAction, Pod, Probe, SecurityContext};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const READY: Duration = Duration::from_secs(60);

fn admin_probe(path: &str) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::Int(i32::from(ports::ADMIN)),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(1),
        timeout_seconds: Some(1),
        ..Probe::default()
    }
}

/// A Pod with an application container (`app`, busybox) and the sidecar
/// (`baton-sidecar-a`) serving its admin port like an injected one.
fn meshed_pod(name: &str) -> Pod {
    let mut sidecar = pods::container(contract::containers::SLOT_A, "sidecar", &[]);
    sidecar.readiness_probe = Some(admin_probe(commands::READY_PATH));
    sidecar.liveness_probe = Some(admin_probe(commands::LIVE_PATH));
    sidecar.security_context = Some(SecurityContext {
        run_as_user: Some(SIDECAR_UID),
        run_as_group: Some(SIDECAR_UID),
        run_as_non_root: Some(true),
        ..SecurityContext::default()
    });
    let app = pods::shell("app", "sleep 3600");
    pods::pod(name, vec![app, sidecar])
}

async fn create(client: &Client, ns: &str, pod: &Pod) -> Pod {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), pod)
        .await
        .unwrap_or_else(|e| panic!("creating pod {:?}: {e}", pod.metadata.name));
    let name = pod.metadata.name.clone().expect("pod name");
    wait::pod_ready(client, ns, &name, READY)
        .await
        .unwrap_or_else(|e| panic!("pod {name} Ready: {e}"))
}

/// `wget` inside `pod`'s `container`: (succeeded, stdout + stderr).
///
/// Bounded by busybox's `timeout`, not by wget's own `-T`: the static
/// busybox in the nettools image crashes (SIGSEGV) whenever `-T` is given.
fn wget(ns: &str, pod: &str, container: &str, method: &str, url: &str) -> (bool, String) {
    let mut args = vec![
        "exec", "-n", ns, pod, "-c", container, "--", "busybox", "timeout", "5", "wget", "-q",
        "-O-",
    ];
    if method == "POST" {
        args.push("--post-data=");
    }
    args.push(url);
    let out = kubectl(&args);
    (out.success, format!("{}{}", out.stdout, out.stderr))
}

/// One HTTP/1.1 request from this host (the node) to `addr`: (status, text).
async fn from_node(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let mut s = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
        .await
        .expect("connect timed out")
        .expect("connect");
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
        .expect("read timed out")
        .expect("read");
    let text = String::from_utf8_lossy(&out).into_owned();
    (
        text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0),
        text,
    )
}

fn admin(ip: IpAddr) -> SocketAddr {
    SocketAddr::new(ip, ports::ADMIN)
}

async fn sidecar_restarts(client: &Client, ns: &str, pod: &str) -> i32 {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let p = api.get(pod).await.expect("get pod");
    p.status
        .and_then(|s| s.container_statuses)
        .into_iter()
        .flatten()
        .find(|c| c.name == contract::containers::SLOT_A)
        .map_or(-1, |c| c.restart_count)
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn admin_refuses_shutdown_log_level_and_config_from_another_pod_and_keeps_serving() {
    with_temp_ns(|client, ns| async move {
        let meshed = create(&client, &ns, &meshed_pod("meshed")).await;
        create(
            &client,
            &ns,
            &pods::pod("other", vec![pods::shell("sh", "sleep 3600")]),
        )
        .await;
        let ip = wait::pod_ip(&meshed);
        for (method, path) in [
            ("POST", "/shutdown"),
            ("POST", "/log-level?level=trace"),
            ("GET", "/config"),
            ("GET", "/connections"),
        ] {
            let (ok, out) = wget(
                &ns,
                "other",
                "sh",
                method,
                &format!("http://{ip}:15020{path}"),
            );
            assert!(
                !ok && out.contains("403"),
                "{method} {path} from another Pod: {out}"
            );
        }
        // What another Pod may read still answers it.
        for path in ["/ready", "/metrics", "/handoff"] {
            let (ok, out) = wget(
                &ns,
                "other",
                "sh",
                "GET",
                &format!("http://{ip}:15020{path}"),
            );
            assert!(ok, "GET {path} from another Pod: {out}");
        }
        // The sidecar kept serving: still Ready, never restarted.
        tokio::time::sleep(Duration::from_secs(3)).await;
        wait::pod_ready(&client, &ns, "meshed", READY)
            .await
            .expect("still Ready");
        assert_eq!(sidecar_restarts(&client, &ns, "meshed").await, 0);
        let (status, text) = from_node(admin(ip), "GET", "/metrics").await;
        assert_eq!(status, 200, "{text}");
        assert!(
            text.contains(r#"baton_sidecar_admin_refused_total{endpoint="/shutdown"} 1"#),
            "{text}"
        );
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn admin_probes_from_the_kubelet_and_a_metrics_scrape_from_the_node_still_work() {
    with_temp_ns(|client, ns| async move {
        // Ready at all means the kubelet's readiness probe (from the node,
        // over the Pod IP) got 200.
        let meshed = create(&client, &ns, &meshed_pod("meshed")).await;
        let ip = wait::pod_ip(&meshed);
        for path in ["/ready", "/live", "/metrics", "/handoff"] {
            let (status, text) = from_node(admin(ip), "GET", path).await;
            assert_eq!(status, 200, "GET {path} from the node: {text}");
        }
        // The node is not inside the Pod either.
        let (status, text) = from_node(admin(ip), "GET", "/config").await;
        assert_eq!(status, 403, "{text}");
        let (status, text) = from_node(admin(ip), "POST", "/shutdown").await;
        assert_eq!(status, 403, "{text}");
        assert_eq!(sidecar_restarts(&client, &ns, "meshed").await, 0);
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn admin_the_application_in_the_same_pod_can_still_call_shutdown() {
    with_temp_ns(|client, ns| async move {
        let meshed = create(&client, &ns, &meshed_pod("meshed")).await;
        let ip = wait::pod_ip(&meshed);
        let (ok, out) = wget(&ns, "meshed", "app", "GET", "http://127.0.0.1:15020/config");
        assert!(ok, "GET /config from the application: {out}");
        let (ok, out) = wget(
            &ns,
            "meshed",
            "app",
            "POST",
            "http://127.0.0.1:15020/shutdown",
        );
        assert!(
            ok && out.contains("draining"),
            "POST /shutdown from the application: {out}"
        );
        // The sidecar drains and exits (the kubelet then restarts it).
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        baton_e2e::wait_for("the sidecar to exit", Duration::from_secs(30), || async {
            let p = api.get("meshed").await.expect("get pod");
            let s = p
                .status
                .and_then(|s| s.container_statuses)
                .into_iter()
                .flatten()
                .find(|c| c.name == contract::containers::SLOT_A);
            match s {
                Some(c)
                    if c.restart_count > 0
                        || c.last_state
                            .as_ref()
                            .is_some_and(|l| l.terminated.is_some()) =>
                {
                    baton_e2e::Check::Done(())
                }
                other => baton_e2e::Check::NotYet(format!("{other:?}; admin {}", admin(ip))),
            }
        })
        .await
        .expect("the sidecar exited after /shutdown");
    })
    .await;
}
