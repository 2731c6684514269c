//! Authorization stays in force across a handoff (issue #36): two real
//! `baton-sidecar` processes on loopback, the new one started with no
//! policy of its own (a Pod's sidecar: its config arrives by push), so
//! what it enforces is the snapshot the old one handed it.
//!
//! A denied client (bound to 127.0.0.2; the policy allows 127.0.0.1/32)
//! and an allowed one send requests on keep-alive connections (which the
//! handoff moves between two requests), on a new connection each, and over
//! raw TCP, before, during and after the handoff. Not one request or
//! connection the policy denies may reach the application, whichever
//! process served it, and every allowed one must succeed.

use crate::handoff_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use handoff_support::{World, admin_get, metric_sum};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const ALLOWED: &str = "127.0.0.1";
const DENIED: &str = "127.0.0.2";

/// Where the handoff is, for the tallies: 0 before, 1 during, 2 after
/// (the old process has exited).
static PHASE: AtomicUsize = AtomicUsize::new(0);

/// Per phase: answers seen.
#[derive(Default)]
struct Tally {
    by_phase: [AtomicU64; 3],
    failures: std::sync::Mutex<Vec<String>>,
}

impl Tally {
    fn seen(&self) {
        self.by_phase[PHASE.load(Ordering::Relaxed)].fetch_add(1, Ordering::Relaxed);
    }

    fn fail(&self, what: String) {
        let phase = ["before", "during", "after"][PHASE.load(Ordering::Relaxed)];
        self.failures
            .lock()
            .unwrap()
            .push(format!("{phase}: {what}"));
    }

    fn counts(&self) -> [u64; 3] {
        [0, 1, 2].map(|i| self.by_phase[i].load(Ordering::Relaxed))
    }
}

async fn connect_from(from: &str, to: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    let s = TcpSocket::new_v4()?;
    s.bind(format!("{from}:0").parse().unwrap())?;
    tokio::time::timeout(Duration::from_secs(5), s.connect(to))
        .await
        .map_err(|_| std::io::Error::other("connect timeout"))?
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn h1(from: &str, to: std::net::SocketAddr) -> std::io::Result<Sender> {
    let s = connect_from(from, to).await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(conn);
    Ok(sender)
}

/// One GET: the status, or a transport error (the connection ended).
async fn get(sender: &mut Sender, path: &str) -> Result<StatusCode, String> {
    sender.ready().await.map_err(|e| e.to_string())?;
    let req = Request::get(path)
        .header("host", "app")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req))
        .await
        .map_err(|_| "no answer within 10 s".to_string())?
        .map_err(|e| e.to_string())?;
    let status = resp.status();
    resp.into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(status)
}

/// HTTP requests from `from` until `stop`: on one keep-alive connection
/// or a new one each. Allowed:
/// every answer must be 200; denied: every answer must be 403.
async fn http_client(
    world: Arc<World>,
    from: &'static str,
    keepalive: bool,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) {
    let want = if from == ALLOWED {
        StatusCode::OK
    } else {
        StatusCode::FORBIDDEN
    };
    let kind = if keepalive { "keepalive" } else { "new" };
    let mut conn: Option<Sender> = None;
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let path = if from == ALLOWED {
            format!("/allowed/{kind}/{n}")
        } else {
            format!("/denied/{kind}/{n}")
        };
        let sender = match conn.as_mut() {
            Some(s) => s,
            None => match h1(from, world.http).await {
                Ok(s) => conn.insert(s),
                Err(e) => {
                    tally.fail(format!("{from} {kind}: connect: {e}"));
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
            },
        };
        match get(sender, &path).await {
            Ok(s) if s == want => tally.seen(),
            Ok(s) => tally.fail(format!("{from} {path}: {s}, want {want}")),
            // The handoff moves keep-alive connections (G3): none may end.
            Err(e) => {
                tally.fail(format!("{from} {path}: {e}"));
                conn = None;
            }
        }
        if !keepalive {
            conn = None;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Raw TCP from `from` until `stop`, a new connection each time: allowed
/// ones echo every byte; denied ones are closed without a byte.
async fn tcp_client(
    world: Arc<World>,
    from: &'static str,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let payload = format!("{from} tcp {n}\n").into_bytes();
        let one = async {
            let mut s = connect_from(from, world.tcp)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let _ = s.write_all(&payload).await;
            let mut back = Vec::new();
            if from == ALLOWED {
                back.resize(payload.len(), 0);
                s.read_exact(&mut back)
                    .await
                    .map_err(|e| format!("read: {e}"))?;
                if back != payload {
                    return Err("echo differs".to_string());
                }
            } else {
                match s.read_to_end(&mut back).await {
                    Ok(_) if back.is_empty() => {}
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
                    Ok(_) => return Err(format!("ADMITTED: {} bytes came back", back.len())),
                    Err(e) => return Err(format!("read: {e}")),
                }
            }
            Ok(())
        };
        match tokio::time::timeout(Duration::from_secs(10), one).await {
            Ok(Ok(())) => tally.seen(),
            Ok(Err(e)) => tally.fail(format!("{from} tcp {n}: {e}")),
            Err(_) => tally.fail(format!("{from} tcp {n}: no end within 10 s")),
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorization_stays_in_force_across_a_handoff() {
    let world = World::new().await;
    let (up_http, up_echo) = (world.upstream.http, world.upstream.echo);
    let config = world.dir.path().join("authz.yaml");
    std::fs::write(
        &config,
        format!(
            "version: 1
admin: {{ address: {admin} }}
runtime: {{ worker_threads: 1, drain_timeout_ms: 5000 }}
listeners:
  - {{ name: http, address: {http}, capture: explicit, rbac: local-only }}
  - {{ name: tcp, address: {tcp}, protocol: tcp, tcp_cluster: echo, rbac: local-only }}
routes:
  - {{ name: all, backends: [{{ cluster: up }}] }}
clusters:
  - {{ name: up, endpoints: [{up_http}] }}
  - {{ name: echo, endpoints: [{up_echo}] }}
policies:
  rbac:
  - name: local-only
    rules: [{{ name: local, action: allow, cidrs: ['127.0.0.1/32'] }}]
    default_action: deny
",
            admin = world.admin,
            http = world.http,
            tcp = world.tcp,
        ),
    )
    .unwrap();
    // The new process's own config: the admin port only.
    let pod = world.dir.path().join("pod.yaml");
    std::fs::write(
        &pod,
        format!("version: 0\nadmin: {{ address: {} }}\n", world.admin),
    )
    .unwrap();

    let mut old = world.spawn_with_config(&config, &[]);
    world.wait_ready(Duration::from_secs(20)).await;
    let world = Arc::new(world);
    let stop = Arc::new(AtomicBool::new(false));
    let allowed = Arc::new(Tally::default());
    let denied = Arc::new(Tally::default());
    let mut clients = Vec::new();
    for (from, tally) in [(ALLOWED, &allowed), (DENIED, &denied)] {
        for keepalive in [true, false] {
            clients.push(tokio::spawn(http_client(
                world.clone(),
                from,
                keepalive,
                stop.clone(),
                tally.clone(),
            )));
        }
        clients.push(tokio::spawn(tcp_client(
            world.clone(),
            from,
            stop.clone(),
            tally.clone(),
        )));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    PHASE.store(1, Ordering::Relaxed);
    let mut new = world.spawn_with_config(&pod, &[]);
    let status = world
        .wait_complete(new.pid(), Duration::from_secs(20))
        .await;
    let exited = old.wait_exit(Duration::from_secs(20));
    assert!(
        exited.is_some_and(|s| s.success()),
        "old process did not exit cleanly: {exited:?}\n{}",
        old.log_tail()
    );
    // Only the new process is left.
    PHASE.store(2, Ordering::Relaxed);
    let after = denied.counts()[2];
    let deadline = Instant::now() + Duration::from_secs(10);
    while (denied.counts()[2] < after + 50 || allowed.counts()[2] < 50) && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }

    let logs = || {
        format!(
            "handoff: {status}\nnew:\n{}\nold:\n{}",
            new.log_tail(),
            old.log_tail()
        )
    };
    let admitted: Vec<String> = world
        .upstream
        .served
        .lock()
        .unwrap()
        .keys()
        .filter(|p| p.starts_with("/denied/"))
        .cloned()
        .collect();
    assert!(
        admitted.is_empty(),
        "{} requests the policy denies reached the app: {admitted:?}\n{}",
        admitted.len(),
        logs()
    );
    let denied_failures = denied.failures.lock().unwrap().clone();
    assert!(
        denied_failures.is_empty(),
        "denied client: {denied_failures:#?}\n{}",
        logs()
    );
    let allowed_failures = allowed.failures.lock().unwrap().clone();
    assert!(
        allowed_failures.is_empty(),
        "allowed client: {allowed_failures:#?}\n{}",
        logs()
    );
    let (d, a) = (denied.counts(), allowed.counts());
    assert!(
        d[0] > 0 && d[2] >= 50 && a[0] > 0 && a[2] >= 50,
        "answers (before, during, after): denied {d:?}, allowed {a:?}\n{}",
        logs()
    );
    eprintln!("answers (before, during, after): denied {d:?}, allowed {a:?}");
    // The two keep-alive connections (the denied client's and the allowed
    // one's) were among those moved: the new process decided their next
    // requests.
    assert!(
        status["connections"].as_u64().unwrap_or(0) >= 2,
        "connections moved: {status}"
    );
    // The new process counts denials under the inherited policy (its own
    // on top of the carried-over ones).
    let (_, m) = admin_get(world.admin, "/metrics").await.unwrap();
    let deny = metric_sum(
        &m,
        "baton_sidecar_authz_total{policy=\"local-only\",rule=\"default\",verdict=\"deny\"}",
    );
    assert!(
        deny >= d.iter().sum::<u64>(),
        "deny counter {deny}, denials seen {d:?}"
    );
    new.kill();
}
