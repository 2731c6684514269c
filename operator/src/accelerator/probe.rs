//! What the sidecars that hold a device say about it: the controller reads
//! `GET /offload` ([`baton_config::report::OffloadReport`]) from every
//! running meshed Pod granted a device, each [`super::controller::RESYNC`],
//! and turns the answers into per-Pod verdicts for the books: a device that
//! failed its self-test at start, or whose signatures fail now (software
//! redoes them under `Preferred`), makes that Pod a fallback in the pool's
//! status although the webhook granted it.
//!
//! A sidecar that does not answer (starting, an older version without
//! `/offload`, a network hiccup) keeps its last verdict: one missed read
//! neither raises nor clears a fallback.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use baton_config::report::{OFFLOAD_PATH, OffloadReport};
use futures::StreamExt;
use futures::future::BoxFuture;

/// How long one read may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Reads in flight at once.
const CONCURRENCY: usize = 32;

/// Reads one sidecar's report (the real one: [`http_probe`]; tests pass
/// their own).
pub type OffloadProbe =
    Arc<dyn Fn(SocketAddr) -> BoxFuture<'static, Option<OffloadReport>> + Send + Sync>;

/// `GET /offload` on the sidecar's admin port.
pub fn http_probe() -> OffloadProbe {
    Arc::new(|addr| {
        Box::pin(async move {
            let body = crate::sidecar_admin::get(addr, OFFLOAD_PATH, PROBE_TIMEOUT).await?;
            serde_json::from_slice(&body).ok()
        })
    })
}

/// One Pod to read: its UID and the sidecar's admin address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub uid: String,
    pub addr: SocketAddr,
}

impl Target {
    pub fn new(uid: String, ip: IpAddr) -> Self {
        Self {
            uid,
            addr: SocketAddr::new(ip, baton_crds::contract::ports::ADMIN),
        }
    }
}

/// The last report and verdict per Pod UID.
#[derive(Debug, Default)]
pub struct RuntimeFallbacks {
    last: HashMap<String, (OffloadReport, Option<String>)>,
}

impl RuntimeFallbacks {
    /// Reads every target; forgets Pods no longer among them. Returns
    /// whether any verdict changed.
    pub async fn refresh(&mut self, probe: &OffloadProbe, targets: &[Target]) -> bool {
        let reports: Vec<(String, Option<OffloadReport>)> =
            futures::stream::iter(targets.iter().cloned())
                .map(|t| {
                    let probe = probe.clone();
                    async move { (t.uid, probe(t.addr).await) }
                })
                .buffer_unordered(CONCURRENCY)
                .collect()
                .await;
        let before = self.verdicts();
        self.last
            .retain(|uid, _| targets.iter().any(|t| &t.uid == uid));
        for (uid, report) in reports {
            let Some(report) = report else { continue };
            let verdict = report.falling_back_since(self.last.get(&uid).map(|(r, _)| r));
            self.last.insert(uid, (report, verdict));
        }
        before != self.verdicts()
    }

    /// Every Pod whose sidecar signs in software, by UID, with why (what
    /// the books take as [`super::accounting::RuntimeVerdicts`]).
    pub fn verdicts(&self) -> BTreeMap<String, String> {
        self.last
            .iter()
            .filter_map(|(uid, (_, v))| Some((uid.clone(), v.clone()?)))
            .collect()
    }

    /// Why the sidecar of Pod `uid` signs in software, if it does.
    pub fn reason(&self, uid: &str) -> Option<String> {
        self.last.get(uid).and_then(|(_, v)| v.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A probe that answers from a table the test edits (`None`: no answer).
    fn table() -> (OffloadProbe, Arc<Mutex<HashMap<SocketAddr, OffloadReport>>>) {
        let t: Arc<Mutex<HashMap<SocketAddr, OffloadReport>>> = Arc::default();
        let t2 = t.clone();
        let probe: OffloadProbe = Arc::new(move |addr| {
            let r = t2.lock().unwrap().get(&addr).cloned();
            Box::pin(async move { r })
        });
        (probe, t)
    }

    fn report(errors: u64) -> OffloadReport {
        OffloadReport {
            configured: true,
            mode: "Preferred".into(),
            requested: "openssl".into(),
            active: "openssl".into(),
            ready: true,
            sign_errors_redone_in_software: errors,
            ..OffloadReport::default()
        }
    }

    fn target(uid: &str, last: u8) -> Target {
        Target::new(uid.into(), IpAddr::from([10, 0, 0, last]))
    }

    #[tokio::test]
    async fn verdicts_follow_the_reports_and_a_missed_read_changes_nothing() {
        let (probe, answers) = table();
        let (a, b) = (target("a", 1), target("b", 2));
        let targets = [a.clone(), b.clone()];
        let mut rf = RuntimeFallbacks::default();
        answers.lock().unwrap().insert(a.addr, report(0));
        answers.lock().unwrap().insert(b.addr, report(0));
        assert!(!rf.refresh(&probe, &targets).await, "all well: nothing new");
        assert_eq!(rf.reason("a"), None);

        // a's device starts failing.
        answers.lock().unwrap().insert(a.addr, report(4));
        assert!(rf.refresh(&probe, &targets).await);
        assert!(rf.reason("a").unwrap().starts_with("SignErrors: 4 "));
        assert_eq!(rf.reason("b"), None);

        // a does not answer: its verdict stands.
        answers.lock().unwrap().remove(&a.addr);
        assert!(!rf.refresh(&probe, &targets).await);
        assert!(rf.reason("a").is_some());

        // a answers again with no new errors: the device works again.
        answers.lock().unwrap().insert(a.addr, report(4));
        assert!(rf.refresh(&probe, &targets).await);
        assert_eq!(rf.reason("a"), None);

        // b fell back at start; then b's pod is gone: forgotten.
        let mut fell_back = report(0);
        fell_back.active = "software".into();
        answers.lock().unwrap().insert(b.addr, fell_back);
        assert!(rf.refresh(&probe, &targets).await);
        assert!(rf.reason("b").unwrap().starts_with("EngineUnavailable"));
        assert!(rf.refresh(&probe, std::slice::from_ref(&a)).await);
        assert_eq!(rf.reason("b"), None);
    }

    #[tokio::test]
    async fn the_http_probe_reads_a_real_admin_socket_and_a_closed_port_is_no_answer() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let body = serde_json::to_vec(&report(2)).unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0; 1024];
            let n = s.read(&mut buf).await.unwrap();
            assert!(buf[..n].starts_with(b"GET /offload HTTP/1.1\r\n"));
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            s.write_all(head.as_bytes()).await.unwrap();
            s.write_all(&body).await.unwrap();
        });
        assert_eq!(http_probe()(addr).await, Some(report(2)));
        server.await.unwrap();
        // Nothing listens there any more.
        assert_eq!(http_probe()(addr).await, None);
    }
}
