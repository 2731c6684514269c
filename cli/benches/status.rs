//! `kubectl baton status` over 10,000 injected Pods, against an in-process
//! HTTP server that plays the API server: `/api/v1/pods` paged 500 at a
//! time with continue tokens, the operator Pods, each operator replica's
//! `/sidecars` report through the Pod proxy, and the SidecarReleases.
//! Runs the command's own code path (`status::produce`: fetch, join,
//! render to a String) on a current-thread runtime as the CLI does, and
//! prints the median wall time against the 5 s budget.
//!
//! ```text
//! cargo bench -p baton-cli --bench status
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_cli::Format;
use baton_cli::status::{self, Query};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

const PODS: usize = 10_000;
const PAGE: usize = 500;
const NAMESPACES: usize = 50;
const REPLICAS: usize = 2;
const RUNS: usize = 5;
const BUDGET: Duration = Duration::from_secs(5);
const NOW: i64 = 1_800_000_000;

/// The API server's canned answers, serialized once.
struct Cluster {
    pages: Vec<Bytes>,
    operators: Bytes,
    reports: Vec<Bytes>,
    releases: Bytes,
}

fn pod_name(i: usize) -> (String, String) {
    (format!("team-{:02}", i % NAMESPACES), format!("web-{i:05}"))
}

/// An injected Pod about the size of a real one (~3 KB of JSON).
fn pod(i: usize) -> Value {
    let (ns, name) = pod_name(i);
    let version = if i.is_multiple_of(10) {
        "1.4.0"
    } else {
        "1.5.0"
    };
    let slot = if i.is_multiple_of(2) { "a" } else { "b" };
    let mut annotations = json!({
        "baton.dev/release": "default",
        "baton.dev/version": version,
        "baton.dev/active-slot": slot,
        "baton.dev/status": "injected",
        "baton.dev/config-hash": "5f1c9a0e2b7d4c11",
        "baton.dev/capture-mode": "transparent",
        "baton.dev/last-handoff": json!({"version": version, "slot": slot, "fromVersion": "1.3.0",
            "startedAt": NOW - 3_600 - (i as i64), "finishedAt": NOW - 3_599 - (i as i64),
            "durationMs": 300 + i % 200, "retiredRestarts": 0}).to_string(),
    });
    if i.is_multiple_of(97) {
        annotations["baton.dev/upgrade"] = Value::String(json!({"version": "1.6.0", "image": "baton/sidecar:1.6.0",
            "slot": "b", "fromVersion": version, "startedAt": NOW - 2, "idleImage": "baton/empty:1"})
        .to_string());
    }
    let sidecar = |slot: &str, image: &str| {
        json!({"name": format!("baton-sidecar-{slot}"), "image": image, "restartPolicy": "Always",
               "ports": [{"name": "baton-admin", "containerPort": 15020, "protocol": "TCP"}],
               "env": [{"name": "BATON_SLOT", "value": slot}, {"name": "BATON_VERSION", "value": version},
                       {"name": "BATON_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
               "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
               "volumeMounts": [{"name": "baton-shared", "mountPath": "/var/run/baton"}]})
    };
    let status = |n: &str, restarts: i32| {
        json!({"name": n, "ready": true, "restartCount": restarts, "started": true,
               "image": "docker.io/x:1", "imageID": "docker.io/x@sha256:0123456789abcdef",
               "containerID": "containerd://0123456789abcdef0123456789abcdef",
               "state": {"running": {"startedAt": "2026-12-01T10:00:00Z"}}})
    };
    json!({
        "metadata": {"name": name, "namespace": ns, "uid": format!("00000000-0000-0000-0000-{i:012}"),
            "resourceVersion": format!("{}", 100_000 + i), "creationTimestamp": "2026-12-01T10:00:00Z",
            "generateName": "web-", "labels": {"app": "web", "baton.dev/injected": "true",
                "baton.dev/release": "default", "pod-template-hash": "7d9f8c6b5"},
            "annotations": annotations,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9f8c6b5",
                "uid": "11111111-2222-3333-4444-555555555555", "controller": true, "blockOwnerDeletion": true}]},
        "spec": {"nodeName": format!("node-{}", i % 100), "serviceAccountName": "web",
            "containers": [{"name": "app", "image": "docker.io/shop/web:2.3.1",
                "ports": [{"containerPort": 8080, "protocol": "TCP"}],
                "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}}}],
            "initContainers": [
                {"name": "baton-init", "image": "baton/sidecar:1.5.0", "args": ["init"]},
                sidecar("a", "baton/sidecar:1.5.0"), sidecar("b", "baton/empty:1")],
            "volumes": [{"name": "baton-shared", "emptyDir": {}}]},
        "status": {"phase": "Running", "podIP": format!("10.{}.{}.{}", i / 65_536, (i / 256) % 256, i % 256),
            "hostIP": "192.168.0.10", "startTime": "2026-12-01T10:00:00Z", "qosClass": "Burstable",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-01T10:00:05Z"},
                           {"type": "ContainersReady", "status": "True", "lastTransitionTime": "2026-12-01T10:00:05Z"}],
            "containerStatuses": [status("app", (i % 3) as i32)],
            "initContainerStatuses": [status("baton-init", 0), status("baton-sidecar-a", 1), status("baton-sidecar-b", 0)]}
    })
}

fn cluster() -> Cluster {
    let pages = (0..PODS / PAGE)
        .map(|p| {
            let items: Vec<Value> = (p * PAGE..(p + 1) * PAGE).map(pod).collect();
            let mut metadata = json!({"resourceVersion": "200000"});
            if p + 1 < PODS / PAGE {
                metadata["continue"] = json!(format!("page-{}", p + 1));
                metadata["remainingItemCount"] = json!(PODS - (p + 1) * PAGE);
            }
            Bytes::from(
                serde_json::to_vec(
                    &json!({"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": items}),
                )
                .unwrap(),
            )
        })
        .collect();
    let operators = (0..REPLICAS)
        .map(|r| {
            json!({"metadata": {"name": format!("baton-operator-{r}"), "namespace": "baton-system",
                   "labels": {"app.kubernetes.io/name": "baton-operator"}},
                   "status": {"phase": "Running"}})
        })
        .collect::<Vec<_>>();
    let operators = Bytes::from(
        serde_json::to_vec(
            &json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": operators}),
        )
        .unwrap(),
    );
    // Each replica streams to half the sidecars (10,000 in all).
    let reports = (0..REPLICAS)
        .map(|r| {
            let mine: Vec<usize> = (0..PODS).filter(|i| i % REPLICAS == r).collect();
            let key = |i: usize| {
                let (ns, name) = pod_name(i);
                format!("{ns}/{name}")
            };
            let sidecars: Vec<Value> = mine
                .iter()
                .map(|&i| match i % 50 {
                    0 => json!({"pod": key(i), "sent": 7, "acked": 6, "nack": "route web: unknown cluster"}),
                    1 => json!({"pod": key(i), "sent": 7, "acked": 6}),
                    _ => json!({"pod": key(i), "sent": 7, "acked": 7}),
                })
                .collect();
            let certificates: Vec<Value> = mine
                .iter()
                .map(|&i| json!({"pod": key(i), "notAfter": NOW + 80_000 + i as i64}))
                .collect();
            Bytes::from(
                serde_json::to_vec(
                    &json!({"configPush": true, "sidecars": sidecars, "certificates": certificates}),
                )
                .unwrap(),
            )
        })
        .collect();
    let releases = ["default", "canary", "batch"]
        .iter()
        .map(|n| {
            json!({"apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease", "metadata": {"name": n},
                   "spec": {"version": "1.5.0", "image": "baton/sidecar:1.5.0", "emptyImage": "baton/empty:1"},
                   "status": {"rollout": "RollingOut", "total": PODS}})
        })
        .collect::<Vec<_>>();
    let releases = Bytes::from(
        serde_json::to_vec(
            &json!({"kind": "SidecarReleaseList", "apiVersion": "baton.dev/v1alpha1",
                                   "metadata": {}, "items": releases}),
        )
        .unwrap(),
    );
    Cluster {
        pages,
        operators,
        reports,
        releases,
    }
}

fn answer(cluster: &Cluster, req: &Request<Incoming>) -> (u16, Bytes) {
    let path = req.uri().path();
    let query = req.uri().query().unwrap_or_default();
    let proxy = |r: usize| {
        format!("/api/v1/namespaces/baton-system/pods/baton-operator-{r}:9090/proxy/sidecars")
    };
    match path {
        "/api/v1/pods" => {
            assert!(query.contains("limit=500"), "{query}");
            let page = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("continue=page-"))
                .map_or(0, |n| n.parse::<usize>().unwrap());
            (200, cluster.pages[page].clone())
        }
        "/api/v1/namespaces/baton-system/pods" => (200, cluster.operators.clone()),
        "/apis/baton.dev/v1alpha1/sidecarreleases" => (200, cluster.releases.clone()),
        p => match (0..REPLICAS).find(|&r| proxy(r) == p) {
            Some(r) => (200, cluster.reports[r].clone()),
            None => (
                404,
                Bytes::from_static(b"{\"kind\":\"Status\",\"code\":404}"),
            ),
        },
    }
}

/// Serves `cluster` on 127.0.0.1:0 from its own thread and runtime.
fn serve(cluster: Arc<Cluster>) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let cluster = cluster.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        let (code, body) = answer(&cluster, &req);
                        async move {
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(code)
                                    .header("content-type", "application/json")
                                    .body(Full::new(body))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
    });
    rx.recv().unwrap()
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let started = Instant::now();
    let cluster = Arc::new(cluster());
    let bytes: usize = cluster.pages.iter().map(Bytes::len).sum();
    println!(
        "status bench: {PODS} Pods in {} pages of {PAGE} ({:.1} MB of JSON), {REPLICAS} operator replicas, built in {:.1?}",
        cluster.pages.len(),
        bytes as f64 / 1e6,
        started.elapsed()
    );
    let addr = serve(cluster);
    // The CLI's runtime: current-thread.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for format in [Format::Table, Format::Json] {
        let mut times = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            let t = Instant::now();
            let out = rt.block_on(async {
                // A fresh client each run, as each `kubectl baton status` is.
                let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
                let client = kube::Client::try_from(config).unwrap();
                let query = Query {
                    namespace: None,
                    selector: None,
                    format,
                };
                status::produce(&client, &query, NOW).await.unwrap()
            });
            times.push(t.elapsed());
            assert_eq!(out.pods, PODS);
            assert!(out.warnings.is_empty(), "{:?}", out.warnings);
            if format == Format::Table {
                // 10,000 rows, a blank line, the summary (header + 1 release row
                // with Pods + 0 others since -A lists all 3 releases).
                assert!(out.text.lines().count() > PODS, "too few lines");
                assert!(
                    !out.text.contains(" ? "),
                    "every Pod is covered by a report"
                );
            }
            std::hint::black_box(out.text);
        }
        times.sort();
        let median = times[RUNS / 2];
        println!(
            "status -A -o {format:?}: median {median:.0?} of {RUNS} runs (min {:.0?}, max {:.0?}); {:.1}% of the 5 s budget (ratio {:.3})",
            times[0],
            times[RUNS - 1],
            100.0 * median.as_secs_f64() / BUDGET.as_secs_f64(),
            median.as_secs_f64() / BUDGET.as_secs_f64(),
        );
        assert!(median <= BUDGET, "over the 5 s budget");
    }
}
