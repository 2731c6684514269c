//! Access logs: one JSON line per HTTP request and per TCP connection on
//! listeners with `access_log: true`, written to stdout.
//!
//! Why this shape:
//! * The data plane never blocks on a log: a line is handed to a bounded
//!   queue ([`QUEUE`] lines) that a thread of its own drains to stdout
//!   (serializing there, off the data plane). A full queue drops the line.
//! * Bounded volume: a token bucket (`runtime.access_log_lines_per_second`,
//!   default 1000, one second of burst) is checked before anything is
//!   built (an HTTP line when its request arrives, a TCP line when its
//!   connection ends); lines beyond it are dropped. Both drops are counted
//!   in `baton_sidecar_access_log_dropped_total{reason}`.
//! * No header values are logged at all (so never `Authorization`,
//!   `Cookie` or `Set-Cookie`): the line has the method, authority, path
//!   without its query string (which can carry tokens too) and what the
//!   sidecar decided.
//! * Serialized with serde_json, so every value is escaped properly.
//!
//! An HTTP line is written when the exchange ends (the response body is
//! finished or dropped), so its duration and byte counts cover the bodies:
//! [`Pending`] collects them and submits its line when dropped. Both
//! HTTP/1 paths (the fast path and hyper's) start it with [`start_http`]
//! and give it its answer with [`Pending::answered`]: one line, one shape.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde::Serialize;

use crate::filters::ConnMeta;
use crate::metrics::Metrics;
use crate::trace::Span;

/// Lines waiting for the writer at most.
pub const QUEUE: usize = 4096;

/// The authorization verdict a line reports: `allow`, `deny`, `audit`
/// (would have been denied, let through), or `-` (no policy decided).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub enum Authz {
    #[serde(rename = "allow")]
    Allow,
    #[serde(rename = "deny")]
    Deny,
    #[serde(rename = "audit")]
    Audit,
    #[default]
    #[serde(rename = "-")]
    None,
}

impl Authz {
    /// The log's word for a policy's verdict: `audit` when an audit rule
    /// (or an audit default) recorded a request it let through.
    pub fn of(v: &crate::filters::Verdict) -> Authz {
        if v.denied() {
            Authz::Deny
        } else if v.audit_rule().is_some() {
            Authz::Audit
        } else {
            Authz::Allow
        }
    }
}

/// One access-log line. Field order is the JSON's.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Record {
    /// RFC 3339, UTC, microseconds.
    pub start_time: String,
    /// From the request head (or the accepted connection) to the end of
    /// the response body (or the connection).
    pub duration_us: u64,
    /// `http/1.1`, `h2`, `http/1.0` or `tcp`.
    pub protocol: &'static str,
    pub method: Option<String>,
    pub authority: Option<String>,
    /// Without the query string.
    pub path: Option<String>,
    /// `None` for TCP.
    pub status: Option<u16>,
    /// Body bytes from the client (HTTP) or all bytes (TCP).
    pub bytes_in: u64,
    /// Body bytes to the client (HTTP) or all bytes (TCP).
    pub bytes_out: u64,
    /// The upstream address the request or connection went to.
    pub upstream: Option<String>,
    /// The client's address.
    pub peer: String,
    /// The client's mesh identity (SPIFFE ID), when it presented one.
    pub peer_identity: Option<String>,
    pub authz: Authz,
    pub trace_id: Option<String>,
    pub span_id: Option<String>,
    pub listener: String,
    pub route: Option<String>,
    /// Why the sidecar answered itself, when it did (`no_route`,
    /// `rbac_denied`, `upstream_unavailable`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_reason: Option<String>,
}

/// RFC 3339 in UTC with microseconds (`2026-12-07T06:05:13.123456Z`).
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, day) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

/// Days since 1970-01-01 → (year, month, day) in the proleptic Gregorian
/// calendar (H. Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// A token bucket holding up to one second of `rate`.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn take(&mut self, rate: u32, now: Instant) -> bool {
        let rate = f64::from(rate);
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * rate).min(rate);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The process's access log: rate limit, queue and writer thread.
#[derive(Debug)]
pub struct AccessLog {
    tx: SyncSender<Record>,
    bucket: Mutex<Bucket>,
    rate_limited: Counter,
    queue_full: Counter,
}

impl AccessLog {
    /// Start the writer thread on `out` (stdout when `None`) and register
    /// the metrics. The thread ends when the last handle is dropped.
    pub fn start(metrics: &Metrics, out: Option<Box<dyn Write + Send>>) -> Arc<Self> {
        let dropped = Family::<Vec<(&'static str, &'static str)>, Counter>::default();
        let written = Counter::default();
        metrics.register(|r| {
            r.register(
                "access_log_dropped",
                "Access-log lines dropped, by reason (rate_limited: over runtime.access_log_lines_per_second; queue_full: the writer fell behind)",
                dropped.clone(),
            );
            r.register(
                "access_log_lines",
                "Access-log lines written",
                written.clone(),
            );
        });
        let (tx, rx) = sync_channel::<Record>(QUEUE);
        let out = out.unwrap_or_else(|| Box::new(std::io::stdout()));
        let spawned = std::thread::Builder::new()
            .name("baton-access-log".into())
            .spawn(move || write_lines(rx, out, written));
        if let Err(e) = spawned {
            // Without a writer every line counts as a full queue.
            tracing::warn!(error = %e, "access log writer thread not started");
        }
        // One statement each: a family's guard lives to the end of the
        // statement, and creating the second series needs the write lock.
        let rate_limited = dropped
            .get_or_create(&vec![("reason", "rate_limited")])
            .clone();
        let queue_full = dropped
            .get_or_create(&vec![("reason", "queue_full")])
            .clone();
        Arc::new(Self {
            tx,
            bucket: Mutex::new(Bucket {
                tokens: 0.0,
                last: Instant::now() - std::time::Duration::from_secs(1),
            }),
            rate_limited,
            queue_full,
        })
    }

    /// Whether one more line fits in the rate limit (counts it if not).
    pub fn admit(&self, rate: u32) -> bool {
        let ok = self
            .bucket
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(rate, Instant::now());
        if !ok {
            self.rate_limited.inc();
        }
        ok
    }

    /// Queue a line admitted by [`AccessLog::admit`]; never blocks.
    pub fn submit(&self, record: Record) {
        match self.tx.try_send(record) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.queue_full.inc();
            }
        }
    }
}

/// How long the writer lets lines gather once they keep coming.
const BATCH_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);

/// The writer thread. Idle, it waits for a line (the first one wakes it);
/// while lines keep coming it sleeps [`BATCH_PAUSE`] between rounds and
/// writes each round's lines in one flush. Why: waiting in `recv` for every
/// line made each one cost the data plane a wake-up of this thread and a
/// `write` of its own — ~16 µs of CPU per line on the sidecar's core
/// (docs/decisions/0053); asleep, it is not woken by a send, and a round
/// is one write. A line reaches stdout at most ~10 ms later; the queue
/// ([`QUEUE`] lines) holds 10 ms of 400,000 lines/s.
fn write_lines(
    rx: std::sync::mpsc::Receiver<Record>,
    out: Box<dyn Write + Send>,
    written: Counter,
) {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, out);
    let write = |out: &mut std::io::BufWriter<_>, r: &Record| {
        if serde_json::to_writer(&mut *out, r).is_ok() && out.write_all(b"\n").is_ok() {
            written.inc();
        }
    };
    while let Ok(first) = rx.recv() {
        write(&mut out, &first);
        loop {
            let mut round = 0usize;
            loop {
                match rx.try_recv() {
                    Ok(r) => {
                        write(&mut out, &r);
                        round += 1;
                    }
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        let _ = out.flush();
                        return;
                    }
                }
            }
            let _ = out.flush();
            if round == 0 {
                break;
            }
            std::thread::sleep(BATCH_PAUSE);
        }
    }
}

/// An HTTP request's line in the making: fields are set as the request
/// proceeds, body bytes are counted as they pass, and the line is
/// submitted when the last holder drops it (the response body ended).
#[derive(Debug)]
pub struct Pending {
    log: Arc<AccessLog>,
    started: Instant,
    record: Mutex<Record>,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
}

impl Pending {
    /// A line already admitted by the rate limit ([`AccessLog::admit`]).
    pub fn new(log: Arc<AccessLog>, started: Instant, record: Record) -> Arc<Self> {
        Arc::new(Self {
            log,
            started,
            record: Mutex::new(record),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
        })
    }

    /// Change the line's fields.
    pub fn update(&self, f: impl FnOnce(&mut Record)) {
        f(&mut self.record.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// The verdict of the listener's policy.
    pub fn authorized(&self, v: &crate::filters::Verdict) {
        let word = Authz::of(v);
        self.update(|r| r.authz = word);
    }

    /// The answer's status and, for an answer the sidecar made itself, its
    /// reason (then a denial is logged as one, whatever set it).
    pub fn answered(&self, status: u16, local_reason: Option<&str>) {
        self.update(|r| {
            r.status = Some(status);
            if local_reason == Some(crate::filters::DENIED_REASON) {
                r.authz = Authz::Deny;
            }
            r.local_reason = local_reason.map(str::to_owned);
        });
    }

    pub fn add_in(&self, n: u64) {
        self.bytes_in.fetch_add(n, Ordering::Relaxed);
    }

    pub fn add_out(&self, n: u64) {
        self.bytes_out.fetch_add(n, Ordering::Relaxed);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut r = std::mem::take(self.record.get_mut().unwrap_or_else(|e| e.into_inner()));
        r.duration_us = self.started.elapsed().as_micros() as u64;
        r.bytes_in = *self.bytes_in.get_mut();
        r.bytes_out = *self.bytes_out.get_mut();
        self.log.submit(r);
    }
}

/// What an HTTP request's line starts with, borrowed from whichever path
/// serves it (the general path's `http::Request`, the fast path's head).
#[derive(Debug, Clone, Copy)]
pub struct RequestLine<'a> {
    /// `http/1.1`, `h2` or `http/1.0`.
    pub protocol: &'static str,
    pub method: &'a str,
    /// The authority the request was routed by (`:authority`, an
    /// absolute-form target's, else `Host`).
    pub authority: Option<&'a str>,
    /// Without the query string, as received.
    pub path: &'a str,
}

/// The line of an HTTP request either HTTP/1 path (or the HTTP/2 one)
/// starts serving; `None` when the rate limit drops it (counted), before
/// anything is built.
pub fn start_http(
    log: &Arc<AccessLog>,
    rate: u32,
    started: Instant,
    conn: &ConnMeta,
    req: RequestLine<'_>,
    span: Option<&Span>,
) -> Option<Arc<Pending>> {
    if !log.admit(rate) {
        return None;
    }
    Some(Pending::new(
        log.clone(),
        started,
        Record {
            start_time: rfc3339(SystemTime::now()),
            protocol: req.protocol,
            method: Some(req.method.to_owned()),
            authority: req.authority.map(str::to_owned),
            path: Some(req.path.to_owned()),
            peer: conn.peer.to_string(),
            peer_identity: conn.peer_identity.as_deref().map(str::to_owned),
            trace_id: span.map(Span::trace_id_hex),
            span_id: span.map(Span::span_id_hex),
            listener: conn.listener.to_string(),
            ..Default::default()
        },
    ))
}

/// A TCP connection's line, submitted when dropped (every way the
/// connection ends), unless [`TcpLine::skip`] was called.
#[derive(Debug)]
pub struct TcpLine {
    log: Arc<AccessLog>,
    rate: u32,
    started: Instant,
    pub record: Record,
    skip: bool,
}

impl TcpLine {
    pub fn start(log: &Arc<AccessLog>, rate: u32, conn: &ConnMeta) -> Self {
        Self {
            log: log.clone(),
            rate,
            started: Instant::now(),
            record: Record {
                start_time: rfc3339(SystemTime::now()),
                protocol: "tcp",
                peer: conn.peer.to_string(),
                peer_identity: conn.peer_identity.as_deref().map(str::to_owned),
                listener: conn.listener.to_string(),
                ..Default::default()
            },
            skip: false,
        }
    }

    /// The connection moved to another process (a handoff): no line here.
    pub fn skip(&mut self) {
        self.skip = true;
    }
}

impl Drop for TcpLine {
    fn drop(&mut self) {
        if self.skip || !self.log.admit(self.rate) {
            return;
        }
        let mut r = std::mem::take(&mut self.record);
        r.duration_us = self.started.elapsed().as_micros() as u64;
        self.log.submit(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Sink {
        /// The lines written so far, waiting (bounded) for `n` of them.
        fn lines(&self, n: usize) -> Vec<serde_json::Value> {
            for _ in 0..500 {
                let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
                let lines: Vec<_> = text
                    .lines()
                    .map(|l| serde_json::from_str(l).unwrap())
                    .collect();
                if lines.len() >= n {
                    return lines;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            panic!("fewer than {n} lines written within 5 s");
        }
    }

    #[test]
    fn rfc3339_formats_utc_with_microseconds() {
        let t = SystemTime::UNIX_EPOCH + Duration::new(1_796_623_513, 123_456_789);
        assert_eq!(rfc3339(t), "2026-12-07T06:05:13.123456Z");
        assert_eq!(
            rfc3339(SystemTime::UNIX_EPOCH),
            "1970-01-01T00:00:00.000000Z"
        );
        // A leap day.
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.000000Z");
    }

    #[test]
    fn a_pending_line_is_written_as_escaped_json_with_its_byte_counts() {
        let m = Metrics::new();
        let sink = Sink::default();
        let log = AccessLog::start(&m, Some(Box::new(sink.clone())));
        let p = Pending::new(
            log.clone(),
            Instant::now(),
            Record {
                start_time: rfc3339(SystemTime::now()),
                protocol: "http/1.1",
                method: Some("GET".into()),
                path: Some("/a\"b\\c\n".into()),
                peer: "127.0.0.1:5".into(),
                listener: "out".into(),
                ..Default::default()
            },
        );
        p.update(|r| r.status = Some(200));
        p.add_in(3);
        p.add_out(10);
        p.add_out(5);
        drop(p);
        let lines = sink.lines(1);
        assert_eq!(lines[0]["path"], "/a\"b\\c\n");
        assert_eq!(lines[0]["status"], 200);
        assert_eq!(lines[0]["bytes_in"], 3);
        assert_eq!(lines[0]["bytes_out"], 15);
        assert_eq!(lines[0]["authz"], "-");
        assert_eq!(lines[0]["upstream"], serde_json::Value::Null);
        assert!(
            m.encode()
                .contains("baton_sidecar_access_log_lines_total 1")
        );
    }

    #[test]
    fn a_request_line_over_the_rate_is_not_built_and_a_denial_is_logged_as_one() {
        let m = Metrics::new();
        let sink = Sink::default();
        let log = AccessLog::start(&m, Some(Box::new(sink.clone())));
        let conn = ConnMeta {
            id: 1,
            listener: Arc::from("in"),
            peer: "127.0.0.1:5".parse().unwrap(),
            local: "127.0.0.1:80".parse().unwrap(),
            original_dst: None,
            peer_identity: None,
            alpn: None,
            tls: false,
        };
        let line = RequestLine {
            protocol: "http/1.1",
            method: "GET",
            authority: Some("app"),
            path: "/admin",
        };
        // A rate of 1: the bucket holds one line.
        let first = start_http(&log, 1, Instant::now(), &conn, line, None);
        let second = start_http(&log, 1, Instant::now(), &conn, line, None);
        assert!(second.is_none(), "over the rate: nothing built");
        let first = first.expect("within the rate");
        first.answered(403, Some(crate::filters::DENIED_REASON));
        first.add_out(22);
        drop(first);
        let l = &sink.lines(1)[0];
        assert_eq!(
            (
                &l["status"],
                &l["authz"],
                &l["local_reason"],
                &l["bytes_out"]
            ),
            (
                &serde_json::json!(403),
                &serde_json::json!("deny"),
                &serde_json::json!("rbac_denied"),
                &serde_json::json!(22)
            )
        );
        assert_eq!(
            (&l["authority"], &l["path"]),
            (&serde_json::json!("app"), &serde_json::json!("/admin"))
        );
        assert!(
            m.encode()
                .contains("baton_sidecar_access_log_dropped_total{reason=\"rate_limited\"} 1")
        );
    }

    #[test]
    fn lines_beyond_the_rate_are_dropped_and_counted() {
        let m = Metrics::new();
        let log = AccessLog::start(&m, Some(Box::new(Sink::default())));
        // The bucket starts full with one second's worth (5 here); with no
        // time to refill, 20 attempts admit about 5 (a few more if the
        // test is slow, never all).
        let admitted = (0..20).filter(|_| log.admit(5)).count();
        assert!((5..20).contains(&admitted), "{admitted}");
        let out = m.encode();
        let dropped = 20 - admitted;
        assert!(
            out.contains(&format!(
                "baton_sidecar_access_log_dropped_total{{reason=\"rate_limited\"}} {dropped}"
            )),
            "{out}"
        );
    }

    #[test]
    fn the_bucket_refills_at_the_rate_up_to_one_second() {
        let t0 = Instant::now();
        let mut b = Bucket {
            tokens: 0.0,
            last: t0,
        };
        assert!(!b.take(10, t0));
        assert!(b.take(10, t0 + Duration::from_millis(100)));
        assert!(!b.take(10, t0 + Duration::from_millis(100)));
        // Ten seconds idle refill one second's worth, not ten.
        let later = t0 + Duration::from_secs(10);
        let n = (0..50).filter(|_| b.take(10, later)).count();
        assert_eq!(n, 10);
    }

    #[test]
    fn a_full_queue_drops_lines_instead_of_blocking() {
        /// A writer that blocks until released: the queue fills.
        struct Stuck(Arc<(Mutex<bool>, std::sync::Condvar)>);
        impl Write for Stuck {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                let (lock, cv) = &*self.0;
                let mut go = lock.lock().unwrap();
                while !*go {
                    go = cv.wait(go).unwrap();
                }
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let m = Metrics::new();
        let log = AccessLog::start(&m, Some(Box::new(Stuck(gate.clone()))));
        // More than the queue plus the BufWriter's worth and the one line
        // the writer holds: some must be dropped, and submit returns.
        let n = QUEUE + 2000;
        for _ in 0..n {
            log.submit(Record {
                path: Some("x".repeat(200)),
                ..Default::default()
            });
        }
        let out = m.encode();
        let full: u64 = out
            .lines()
            .find_map(|l| {
                l.strip_prefix("baton_sidecar_access_log_dropped_total{reason=\"queue_full\"} ")
            })
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(full > 0, "{out}");
        let (lock, cv) = &*gate;
        *lock.lock().unwrap() = true;
        cv.notify_all();
    }
}
