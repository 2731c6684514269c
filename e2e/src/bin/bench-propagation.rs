//! Config propagation through the deployed operator (issue #37 items 1 and
//! 6): the time from a Route created through the API server to the N-th
//! sidecar's ACK, with N simulated sidecars on the operator replicas' real
//! push endpoints. Run by `bench/propagation-bench.sh`, which brings the
//! local cluster up, installs Baton and samples the operator processes.
//!
//! Each simulated sidecar stands for a real, admitted Pod: the bench creates
//! N Pods in a namespace opted in to injection (the webhook injects them,
//! so the operator's index holds N injected Pods, as in a real mesh of that
//! size) that are never scheduled (their scheduler does not exist), asks
//! the API server for a token bound to each (TokenRequest, the mesh
//! audience: what the kubelet projects into a sidecar), and opens one push
//! stream per Pod in the framed transport over TLS (what a sidecar speaks
//! to this operator, decision 0066), verified against the operator's published
//! trust bundle, spread over the Ready operator replicas as the Service
//! spreads sidecars. Every push is ACKed at once, as a sidecar does once its
//! config is applied (the apply itself runs on the sidecar's CPU: measured
//! by `cargo bench -p baton-operator --bench config_push`, not here).
//!
//! A change: a Route created on its own Service. Its propagation is the time
//! from the create call to the moment the last stream has read (and ACKed)
//! a push with a newer version; before each change the streams are quiet
//! (no push for 1 s). Stream 0 decodes its pushes whole and checks that the
//! Route reached it. With `--failover`, after the changes the leader's Pod
//! is deleted: streams on it reconnect to the other replicas (as sidecars
//! do), and the report gives the time until a new leader holds the Lease,
//! until every stream is back, and one more change's propagation and
//! status, which must count every sidecar.
//!
//! Bounded: at most 10,000 streams and 100 changes; each wait has a
//! deadline; every connection goes to the cluster's Pod network on this
//! machine. The namespace (and so the Pods) and the release are deleted at
//! the end, also after a failure.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use baton_config::framed::{self, Kind};
use baton_config::push::{self, Push, Reply};
use baton_crds::contract;
use baton_e2e::install as baton;
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Service, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

const SERVER_NAME: &str = "baton-identity.baton-system.svc";
/// A scheduler no cluster runs: the Pods stay Pending without a retry loop
/// in the real scheduler (a nodeSelector would have it retry them all).
const NO_SCHEDULER: &str = "baton-bench-never";

#[derive(Parser, Debug)]
#[command(about = "Route create -> N-th sidecar ACK through the deployed operator")]
struct Args {
    /// Simulated sidecars (push streams), each with its own Pod.
    #[arg(long, default_value_t = 1000)]
    streams: usize,
    /// Route creations measured.
    #[arg(long, default_value_t = 20)]
    changes: usize,
    /// Namespace to create (deleted at the end).
    #[arg(long, default_value = "bench-propagation")]
    namespace: String,
    /// Afterwards, delete the leader's Pod and measure the failover.
    #[arg(long)]
    failover: bool,
    /// Where to write the figures as JSON.
    #[arg(long)]
    report_json: Option<std::path::PathBuf>,
    /// Only admit the Pods (no tokens, no streams, no changes), then hold
    /// them this many seconds before cleaning up: what the operator's
    /// memory does per Pod, e.g. under a heap profiler (bench/operator-heap.sh).
    #[arg(long)]
    pods_only_hold_seconds: Option<u64>,
}

/// What one stream reports: (stream, version, when read).
type Seen = (usize, u64, Instant);

#[derive(Default)]
struct Shared {
    /// Operator endpoints; streams pick by their index and attempt.
    addrs: Mutex<Vec<SocketAddr>>,
    /// Streams currently open (response headers received), in all and per
    /// operator endpoint.
    open: AtomicUsize,
    open_on: Mutex<std::collections::HashMap<SocketAddr, usize>>,
    /// Stream (re)connections refused or failed.
    errors: AtomicU64,
    /// The last error text (for the report on a stuck run).
    last_error: Mutex<String>,
    /// Stream errors by what they said (a refusal by its reason).
    error_kinds: Mutex<BTreeMap<String, u64>>,
    /// Route names stream 0 has seen in a push.
    seen_routes: Mutex<Vec<String>>,
    /// Bytes of stream 0's first push (the whole snapshot).
    first_push_bytes: AtomicUsize,
}

impl Shared {
    /// Streams open on one operator endpoint now.
    fn open_on(&self, addr: SocketAddr) -> usize {
        self.open_on
            .lock()
            .unwrap()
            .get(&addr)
            .copied()
            .unwrap_or_default()
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> Result<()> {
    let args = Args::parse();
    if !(1..=10_000).contains(&args.streams) || !(1..=100).contains(&args.changes) {
        bail!("--streams must be 1..=10000 and --changes 1..=100");
    }
    let client = baton_e2e::cluster::client().await;
    let ns = args.namespace.clone();
    let result = run(&client, &args).await;
    // Clean up whatever happened: the namespace takes the Pods, Services,
    // Routes and the ServiceAccount with it.
    baton::delete_release(&client, &ns).await;
    let _ = Api::<Namespace>::all(client.clone())
        .delete(&ns, &DeleteParams::background())
        .await;
    result
}

async fn run(client: &Client, args: &Args) -> Result<()> {
    let ns = args.namespace.as_str();
    let n = args.streams;
    let t_setup = Instant::now();
    let namespace: Namespace = serde_json::from_value(json!({
        "metadata": {"name": ns, "labels": baton::injected_namespace_labels(ns)}
    }))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .context("creating the namespace (left over from a run? delete it)")?;
    baton::create_release(client, ns, ns).await;
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "app"}}))?;
    Api::<ServiceAccount>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &sa)
        .await?;
    // One Service per change, each Route's parent; created before the
    // streams so they are in every first snapshot.
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    for c in 0..=args.changes {
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": format!("svc-{c}")},
            "spec": {"selector": {"app": format!("app-{c}")}, "ports": [{"name": "http", "port": 80}]}
        }))?;
        services.create(&PostParams::default(), &svc).await?;
    }
    let t_pods = Instant::now();
    let pods = create_pods(client, ns, n).await?;
    if let Some(hold) = args.pods_only_hold_seconds {
        eprintln!(
            "{n} pods admitted in {:.1} s; holding them {hold} s",
            t_pods.elapsed().as_secs_f64()
        );
        tokio::time::sleep(Duration::from_secs(hold)).await;
        return Ok(());
    }
    let tokens = request_tokens(client, ns, &pods).await?;
    let setup = t_setup.elapsed();
    eprintln!("{n} pods and tokens in {:.1} s", setup.as_secs_f64());

    let roots = trust_bundle(client).await?;
    let tls = tls_connector(&roots)?;
    let shared = Arc::new(Shared::default());
    *shared.addrs.lock().unwrap() = operator_addrs(client).await?;
    let (seen_tx, mut seen) = mpsc::unbounded_channel::<Seen>();
    let (stop_tx, stop) = watch::channel(false);
    let t_connect = Instant::now();
    for (i, (name, token)) in pods.iter().zip(tokens).enumerate() {
        tokio::spawn(sidecar(
            i,
            format!("{ns}/{name}"),
            token,
            tls.clone(),
            shared.clone(),
            seen_tx.clone(),
            stop.clone(),
        ));
        // Waves, as Pods start: not N handshakes in one instant.
        if i % 100 == 99 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    drop(seen_tx);
    let mut version = vec![0u64; n];
    let mut have = 0;
    let deadline = Instant::now() + Duration::from_secs(300);
    while have < n {
        let (i, v, _) = recv_until(&mut seen, deadline)
            .await
            .ok_or_else(|| stuck("every stream's first snapshot", &shared, have, n))?;
        if version[i] == 0 {
            have += 1;
        }
        version[i] = v;
    }
    let connect = t_connect.elapsed();
    eprintln!("{n} streams connected in {:.1} s", connect.as_secs_f64());

    let routes: Api<baton_crds::Route> = Api::namespaced(client.clone(), ns);
    let mut per_change = Vec::with_capacity(args.changes);
    let mut per_stream = Vec::with_capacity(n * args.changes);
    let mut status_after = Vec::with_capacity(args.changes);
    for c in 1..=args.changes {
        quiet(&mut seen, &mut version, Duration::from_secs(1)).await;
        let base = version.clone();
        let name = format!("route-{c}");
        let t0 = Instant::now();
        routes
            .create(&PostParams::default(), &route(&name, c))
            .await?;
        let (last, lat) = propagate(&mut seen, &mut version, &base, t0, &shared, n).await?;
        per_change.push(last);
        per_stream.extend(lat);
        // ACK accounting: the Route's status counts every sidecar.
        let programmed = wait_programmed(&routes, &name, n, Duration::from_secs(60)).await?;
        status_after.push(t0.elapsed());
        eprintln!(
            "change {c}: N-th ACK after {:.0} ms; status \"{programmed}\" after {:.0} ms",
            ms(last),
            ms(t0.elapsed())
        );
        let got = shared.seen_routes.lock().unwrap().contains(&name);
        if !got {
            bail!("stream 0 read a newer version but its config has no Route {name}");
        }
    }
    per_change.sort();
    per_stream.sort();
    status_after.sort();
    let mut report = json!({
        "streams": n,
        "changes": args.changes,
        "setup_s": setup.as_secs_f64(),
        "connect_s": connect.as_secs_f64(),
        "nth_ack_ms": {"p50": ms(pct(&per_change, 0.5)), "p99": ms(pct(&per_change, 0.99)), "max": ms(*per_change.last().unwrap())},
        "per_stream_ms": {"p50": ms(pct(&per_stream, 0.5)), "p99": ms(pct(&per_stream, 0.99))},
        "status_ms": {"p50": ms(pct(&status_after, 0.5)), "max": ms(*status_after.last().unwrap())},
        "stream_errors": shared.errors.load(Ordering::Relaxed),
        "stream_error_kinds": shared.error_kinds.lock().unwrap().clone(),
        "snapshot_bytes": shared.first_push_bytes.load(Ordering::Relaxed),
    });

    if args.failover {
        report["failover"] = failover(client, ns, args, &shared, &mut seen, &mut version).await?;
    }
    let _ = stop_tx.send(true);
    println!("{report}");
    if let Some(path) = &args.report_json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
    }
    Ok(())
}

/// The leader's Pod deleted with N streams open: time until another replica
/// holds the Lease, until every stream is open again, and one more change
/// (propagation and status, which must count all N).
async fn failover(
    client: &Client,
    ns: &str,
    args: &Args,
    shared: &Arc<Shared>,
    seen: &mut mpsc::UnboundedReceiver<Seen>,
    version: &mut [u64],
) -> Result<serde_json::Value> {
    let n = args.streams;
    let leader = baton::lease_holder(client)
        .await
        .ok_or_else(|| anyhow!("no operator holds the Lease"))?;
    // The holder's identity is its Pod's name.
    let leader_pod = leader;
    let lease_duration = Api::<Lease>::namespaced(client.clone(), contract::SYSTEM_NAMESPACE)
        .get(baton::OPERATOR_LEASE)
        .await?
        .spec
        .and_then(|s| s.lease_duration_seconds)
        .unwrap_or_default();
    let system: Api<Pod> = Api::namespaced(client.clone(), contract::SYSTEM_NAMESPACE);
    // Streams to the deleted Pod reconnect to the replicas left.
    let doomed: SocketAddr = system
        .get(&leader_pod)
        .await?
        .status
        .and_then(|s| s.pod_ip)
        .ok_or_else(|| anyhow!("leader Pod {leader_pod} has no IP"))?
        .parse::<std::net::IpAddr>()
        .map(|ip| SocketAddr::new(ip, contract::identity::CONFIG_PUSH_PORT))?;
    shared.addrs.lock().unwrap().retain(|a| *a != doomed);
    let moved = shared.open_on(doomed);
    let t0 = Instant::now();
    system.delete(&leader_pod, &DeleteParams::default()).await?;
    let mut new_leader = None;
    let mut all_back = None;
    let deadline = t0 + Duration::from_secs(180);
    while Instant::now() < deadline && (new_leader.is_none() || all_back.is_none()) {
        if new_leader.is_none()
            && let Some(h) = baton::lease_holder(client).await
            && h != leader_pod
        {
            new_leader = Some(t0.elapsed());
        }
        // Drain pushes (reconnected streams get a snapshot).
        while let Ok((i, v, _)) = seen.try_recv() {
            version[i] = v;
        }
        // Back: none left on the deleted Pod, every stream open elsewhere.
        let on_doomed = shared.open_on(doomed);
        if all_back.is_none() && on_doomed == 0 && shared.open.load(Ordering::Relaxed) == n {
            all_back = Some(t0.elapsed());
        }
        // New replicas join the endpoints as the Service would add them.
        let mut addrs = operator_addrs(client).await.unwrap_or_default();
        addrs.retain(|a| *a != doomed);
        if !addrs.is_empty() {
            *shared.addrs.lock().unwrap() = addrs;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let new_leader = new_leader.ok_or_else(|| anyhow!("no new leader within 180 s"))?;
    let all_back =
        all_back.ok_or_else(|| stuck("streams back after the failover", shared, 0, n))?;
    quiet(seen, version, Duration::from_secs(1)).await;
    let base = version.to_vec();
    let routes: Api<baton_crds::Route> = Api::namespaced(client.clone(), ns);
    let name = "route-after-failover";
    let t1 = Instant::now();
    routes
        .create(&PostParams::default(), &route(name, 0))
        .await?;
    let (last, _) = propagate(seen, version, &base, t1, shared, n).await?;
    let programmed = wait_programmed(&routes, name, n, Duration::from_secs(120)).await?;
    let status = t1.elapsed();
    eprintln!(
        "failover: new leader after {:.1} s (Lease {lease_duration} s), the {moved} streams on it back on the others after {:.1} s; \
         a change's N-th ACK after {:.0} ms, status \"{programmed}\" after {:.0} ms",
        new_leader.as_secs_f64(),
        all_back.as_secs_f64(),
        ms(last),
        ms(status)
    );
    Ok(json!({
        "lease_duration_s": lease_duration,
        "new_leader_s": new_leader.as_secs_f64(),
        "streams_back_s": all_back.as_secs_f64(),
        "streams_moved": moved,
        "nth_ack_ms": ms(last),
        "status_ms": ms(status),
        "status": programmed,
    }))
}

fn route(name: &str, c: usize) -> baton_crds::Route {
    serde_json::from_value(json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "Route",
        "metadata": {"name": name},
        "spec": {"parentRef": {"name": format!("svc-{c}"), "port": 80},
                 "rules": [{"backendRefs": [{"name": format!("svc-{c}"), "port": 80}]}]}
    }))
    .expect("route")
}

/// N Pods admitted through the webhook, never scheduled; their names.
async fn create_pods(client: &Client, ns: &str, n: usize) -> Result<Vec<String>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let names: Vec<String> = (0..n).map(|i| format!("p-{i}")).collect();
    futures::stream::iter(names.iter().cloned())
        .map(|name| {
            let api = api.clone();
            async move {
                let mut pod = baton::unscheduled_pod(&name);
                let spec = pod.spec.as_mut().expect("spec");
                spec.node_selector = None;
                spec.scheduler_name = Some(NO_SCHEDULER.into());
                spec.service_account_name = Some("app".into());
                pod.labels_mut().insert("app".into(), "bench".into());
                api.create(&PostParams::default(), &pod)
                    .await
                    .with_context(|| format!("creating Pod {name}"))
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(names)
}

/// A mesh-audience token bound to each Pod (by name and UID), as the
/// kubelet projects one into an injected Pod.
async fn request_tokens(client: &Client, ns: &str, names: &[String]) -> Result<Vec<String>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let uids: BTreeMap<String, String> = pods
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|p| Some((p.metadata.name?, p.metadata.uid?)))
        .collect();
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    futures::stream::iter(names.iter().cloned())
        .map(|name| {
            let sas = sas.clone();
            let uid = uids.get(&name).cloned();
            async move {
                let req = TokenRequest {
                    spec: TokenRequestSpec {
                        audiences: vec![contract::volumes::TOKEN_AUDIENCE.into()],
                        bound_object_ref: Some(BoundObjectReference {
                            api_version: Some("v1".into()),
                            kind: Some("Pod".into()),
                            name: Some(name.clone()),
                            uid,
                        }),
                        expiration_seconds: Some(3600),
                    },
                    ..Default::default()
                };
                let t = sas
                    .create_token_request("app", &PostParams::default(), &req)
                    .await
                    .with_context(|| format!("token for Pod {name}"))?;
                t.status
                    .map(|s| s.token)
                    .ok_or_else(|| anyhow!("no token for Pod {name}"))
            }
        })
        .buffered(16)
        .try_collect()
        .await
}

async fn trust_bundle(client: &Client) -> Result<rustls::RootCertStore> {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), contract::SYSTEM_NAMESPACE)
        .get(contract::identity::TRUST_CONFIG_MAP)
        .await?;
    let pem = cm
        .data
        .and_then(|d| d.get(contract::identity::TRUST_KEY).cloned())
        .ok_or_else(|| anyhow!("the trust ConfigMap has no bundle"))?;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        roots.add(c?)?;
    }
    Ok(roots)
}

fn tls_connector(roots: &rustls::RootCertStore) -> Result<tokio_rustls::TlsConnector> {
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots.clone())
    .with_no_client_auth();
    // What a sidecar speaks to this operator (decision 0066).
    config.alpn_protocols = vec![framed::ALPN.to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// The push endpoints of the Ready operator replicas.
async fn operator_addrs(client: &Client) -> Result<Vec<SocketAddr>> {
    let pods = baton::component_pods(client, "operator").await;
    Ok(pods
        .iter()
        .filter(|p| baton::serving(p))
        .filter_map(|p| p.status.as_ref()?.pod_ip.as_deref()?.parse().ok())
        .map(|ip| SocketAddr::new(ip, contract::identity::CONFIG_PUSH_PORT))
        .collect())
}

/// One simulated sidecar: keeps a push stream open (reconnecting like a
/// sidecar when it ends), ACKs every push and reports its version.
async fn sidecar(
    i: usize,
    pod: String,
    token: String,
    tls: tokio_rustls::TlsConnector,
    shared: Arc<Shared>,
    seen: mpsc::UnboundedSender<Seen>,
    mut stop: watch::Receiver<bool>,
) {
    for attempt in 0usize.. {
        let addr = {
            let addrs = shared.addrs.lock().unwrap();
            if addrs.is_empty() {
                None
            } else {
                Some(addrs[(i + attempt) % addrs.len()])
            }
        };
        let result = match addr {
            Some(addr) => tokio::select! {
                r = stream_once(i, addr, &pod, &token, &tls, &shared, &seen) => r,
                _ = stop.wait_for(|s| *s) => return,
            },
            None => Err("no operator endpoint".into()),
        };
        if let Err(e) = result {
            shared.errors.fetch_add(1, Ordering::Relaxed);
            *shared
                .error_kinds
                .lock()
                .unwrap()
                .entry(e.clone())
                .or_default() += 1;
            *shared.last_error.lock().unwrap() = format!("{pod}: {e}");
        }
        if *stop.borrow() || attempt > 1000 {
            return;
        }
        // A sidecar's reconnect backoff, jittered.
        let wait = Duration::from_millis(200 + rand::random::<u64>() % 800);
        tokio::time::sleep(wait).await;
    }
}

async fn stream_once(
    i: usize,
    addr: SocketAddr,
    pod: &str,
    token: &str,
    tls: &tokio_rustls::TlsConnector,
    shared: &Shared,
    seen: &mpsc::UnboundedSender<Seen>,
) -> Result<(), String> {
    let tcp = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::TcpStream::connect(addr),
    )
    .await
    .map_err(|_| "connect timed out".to_owned())?
    .map_err(|e| e.to_string())?;
    let tls = tls
        .connect(ServerName::try_from(SERVER_NAME).unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let mut tls = tls;
    let io = |e: std::io::Error| e.to_string();
    let hello = framed::Hello {
        token: token.to_owned(),
        pod: pod.to_owned(),
        version: 0,
        capabilities: push::Capabilities::ALL.header_value(),
    };
    tls.write_all(&framed::encode_json(Kind::Hello, &hello))
        .await
        .map_err(io)?;
    tls.flush().await.map_err(io)?;
    let mut decoder = framed::FrameDecoder::new(push::MAX_FRAME);
    let mut buf = vec![0u8; 16 << 10];
    let mut open = None;
    let mut received = 0;
    loop {
        let n = tls.read(&mut buf).await.map_err(io)?;
        if n == 0 {
            return Err("the operator ended the stream".into());
        }
        received += n;
        decoder.extend(&buf[..n]);
        while let Some(frame) = decoder.next_frame().map_err(|e| e.to_string())? {
            let payload = match frame {
                framed::Frame::Known(Kind::Push, payload) if open.is_some() => payload,
                framed::Frame::Known(Kind::Open, _) => {
                    open = Some(OpenGuard::new(shared, addr));
                    continue;
                }
                framed::Frame::Known(Kind::Ping, _) => {
                    tls.write_all(&framed::encode(Kind::Pong, &[]))
                        .await
                        .map_err(io)?;
                    tls.flush().await.map_err(io)?;
                    continue;
                }
                framed::Frame::Known(Kind::Refused, payload) => {
                    // By reason: the message names the Pod.
                    return Err(match framed::json::<framed::Refused>("REFUSED", &payload) {
                        Ok(r) => format!("refused {}: {}", r.status, r.reason),
                        Err(_) => String::from_utf8_lossy(&payload).into_owned(),
                    });
                }
                other => return Err(format!("unexpected {other:?}")),
            };
            // Stream 0 decodes whole pushes and notes the Routes in them;
            // the rest read the head only (see the module docs).
            let (version, nonce) = if i == 0 {
                let p: Push = framed::json("PUSH", &payload).map_err(|e| e.to_string())?;
                note_routes(&p, shared);
                if p.snapshot.is_some() {
                    shared.first_push_bytes.store(received, Ordering::Relaxed);
                }
                (p.version, p.nonce)
            } else {
                let p: PushHead = framed::json("PUSH", &payload).map_err(|e| e.to_string())?;
                (p.version, p.nonce)
            };
            let ack = Reply::Ack { nonce, version };
            tls.write_all(&framed::encode_json(Kind::Reply, &ack))
                .await
                .map_err(io)?;
            tls.flush().await.map_err(io)?;
            let _ = seen.send((i, version, Instant::now()));
        }
    }
}

/// Counts a stream as open (in all and on its endpoint) while it lives.
struct OpenGuard<'a>(&'a Shared, SocketAddr);

impl<'a> OpenGuard<'a> {
    fn new(shared: &'a Shared, addr: SocketAddr) -> Self {
        shared.open.fetch_add(1, Ordering::Relaxed);
        *shared.open_on.lock().unwrap().entry(addr).or_default() += 1;
        Self(shared, addr)
    }
}

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
        if let Some(n) = self.0.open_on.lock().unwrap().get_mut(&self.1) {
            *n -= 1;
        }
    }
}

#[derive(serde::Deserialize)]
struct PushHead {
    version: u64,
    nonce: String,
}

/// The bench's Route names (`route-…`) a push carries, whole or as a delta.
fn note_routes(p: &Push, shared: &Shared) {
    let text = serde_json::to_string(p).unwrap_or_default();
    let mut seen = shared.seen_routes.lock().unwrap();
    for (at, _) in text.match_indices("route-") {
        let name: String = text[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        if !seen.contains(&name) {
            seen.push(name);
        }
    }
}

async fn recv_until(seen: &mut mpsc::UnboundedReceiver<Seen>, deadline: Instant) -> Option<Seen> {
    let left = deadline.checked_duration_since(Instant::now())?;
    tokio::time::timeout(left, seen.recv()).await.ok().flatten()
}

/// Waits until no push has arrived for `gap` (at most 60 s).
async fn quiet(seen: &mut mpsc::UnboundedReceiver<Seen>, version: &mut [u64], gap: Duration) {
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end {
        match tokio::time::timeout(gap, seen.recv()).await {
            Ok(Some((i, v, _))) => version[i] = v,
            _ => return,
        }
    }
}

/// Until every stream has read a version newer than `base`: the time of the
/// last one, and each stream's.
async fn propagate(
    seen: &mut mpsc::UnboundedReceiver<Seen>,
    version: &mut [u64],
    base: &[u64],
    t0: Instant,
    shared: &Shared,
    n: usize,
) -> Result<(Duration, Vec<Duration>)> {
    let mut lat = Vec::with_capacity(n);
    let mut done = vec![false; n];
    let deadline = t0 + Duration::from_secs(120);
    while lat.len() < n {
        let (i, v, at) = recv_until(seen, deadline)
            .await
            .ok_or_else(|| stuck("a change's propagation", shared, lat.len(), n))?;
        version[i] = v;
        if v > base[i] && !done[i] {
            done[i] = true;
            lat.push(at - t0);
        }
    }
    let last = lat.iter().copied().max().unwrap_or_default();
    Ok((last, lat))
}

/// The Route's Programmed message once it reads `n/n sidecars ACKed`.
async fn wait_programmed(
    routes: &Api<baton_crds::Route>,
    name: &str,
    n: usize,
    timeout: Duration,
) -> Result<String> {
    let want = format!("{n}/{n} sidecars ACKed");
    let end = Instant::now() + timeout;
    let mut last = String::new();
    while Instant::now() < end {
        if let Ok(r) = routes.get(name).await {
            last = r
                .status
                .iter()
                .flat_map(|s| s.conditions.iter())
                .find(|c| c.type_ == "Programmed")
                .map(|c| c.message.clone())
                .unwrap_or_default();
            if last == want {
                return Ok(last);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("Route {name}: status never read \"{want}\" (last: \"{last}\")")
}

fn stuck(what: &str, shared: &Shared, have: usize, n: usize) -> anyhow::Error {
    anyhow!(
        "{what}: {have}/{n} within the deadline; {} streams open, {} stream errors, last: {}",
        shared.open.load(Ordering::Relaxed),
        shared.errors.load(Ordering::Relaxed),
        shared.last_error.lock().unwrap()
    )
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e4).round() / 10.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_twenty_changes_take_the_slowest_as_p99() {
        let v: Vec<Duration> = (1..=20).map(Duration::from_millis).collect();
        assert_eq!(pct(&v, 0.5), Duration::from_millis(10));
        assert_eq!(pct(&v, 0.99), Duration::from_millis(20));
    }
}
