//! tcp routes end to end in one process: a sidecar with real sockets on
//! 127.0.0.1, two TCP echo upstreams, and clients that open connections to
//! the destination a tcp route owns. The listener captures explicitly, so
//! the destination is the listener's own address (under transparent
//! capture it is the original destination; the lookup is the same).
//!
//! No timing thresholds: the split is checked against a generous binomial
//! bound, and every wait is on a socket event.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use baton_sidecar::config::{Snapshot, yaml};
use baton_sidecar::server::{Running, StartOptions, start};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// An echo upstream that first sends its one-byte tag (so a client can
/// tell which backend it reached), then echoes everything back. Counts
/// the connections it accepted and those still open.
struct Echo {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn echo(tag: u8) -> Echo {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let open = Arc::new(AtomicUsize::new(0));
    let (a, o) = (accepted.clone(), open.clone());
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            a.fetch_add(1, Ordering::SeqCst);
            o.fetch_add(1, Ordering::SeqCst);
            let o = o.clone();
            tokio::spawn(async move {
                if s.write_all(&[tag]).await.is_ok() {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                }
                o.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    Echo {
        addr,
        accepted,
        open,
        task,
    }
}

/// The config: listener `out`, clusters `a` and `b` (plus `empty`, which
/// has no endpoints) and, when `dst` is set, a tcp route `split` from that
/// destination to `backends` (a YAML list of weighted clusters).
fn config(a: SocketAddr, b: SocketAddr, dst: Option<(SocketAddr, &str)>) -> Snapshot {
    let mut text = format!(
        "admin: {{address: '127.0.0.1:0'}}
listeners: [{{name: out, address: '127.0.0.1:0', detect_timeout_ms: 5000}}]
clusters:
- {{name: a, endpoints: ['{a}']}}
- {{name: b, endpoints: ['{b}']}}
- {{name: empty, endpoints: []}}
"
    );
    if let Some((dst, backends)) = dst {
        text.push_str(&format!(
            "tcp_routes: [{{name: split, listeners: [out], destinations: ['{dst}'], backends: {backends}, connect_timeout_ms: 2000}}]\n"
        ));
    }
    yaml::parse(&text).unwrap()
}

/// A sidecar serving `a` and `b`, with the tcp route `backends` installed
/// on its own listener address (known only once it is bound).
async fn sidecar(a: &Echo, b: &Echo, backends: &str) -> (Running, SocketAddr) {
    let sc = start(config(a.addr, b.addr, None), StartOptions::default())
        .await
        .unwrap();
    let out = sc.addr("out").unwrap();
    apply(&sc, a, b, out, backends);
    (sc, out)
}

fn apply(sc: &Running, a: &Echo, b: &Echo, out: SocketAddr, backends: &str) {
    sc.shared
        .store
        .apply(&config(a.addr, b.addr, Some((out, backends))))
        .unwrap();
}

/// Open a connection through the sidecar: the backend's tag, then the
/// payload echoed back byte for byte. Returns the tag and the open stream.
async fn exchange(out: SocketAddr, payload: &[u8]) -> (u8, TcpStream) {
    let mut s = TcpStream::connect(out).await.unwrap();
    // Looks like HTTP on purpose: a tcp route's destination is opaque, so
    // the sidecar must pass it on instead of answering it (404).
    s.write_all(payload).await.unwrap();
    let mut tag = [0u8; 1];
    s.read_exact(&mut tag).await.unwrap();
    let mut back = vec![0u8; payload.len()];
    s.read_exact(&mut back).await.unwrap();
    assert!(back == payload, "bytes differ");
    (tag[0], s)
}

fn payload(i: usize) -> Vec<u8> {
    let mut p = format!("GET /conn/{i} HTTP/1.1\r\nHost: db\r\n\r\n").into_bytes();
    // Every byte value, so nothing is lost to text handling.
    p.extend((0..=255u8).cycle().skip(i % 256).take(1024 + i % 97));
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_connections_split_three_to_one_with_every_byte_echoed() {
    let (a, b) = (echo(b'a').await, echo(b'b').await);
    let (sc, out) = sidecar(&a, &b, "[{cluster: a, weight: 3}, {cluster: b, weight: 1}]").await;
    let mut to_a = 0;
    // 1,000 connections, 25 at a time (the machine is small).
    for chunk in 0..40 {
        let batch: Vec<_> = (0..25)
            .map(|j| {
                let i = chunk * 25 + j;
                tokio::spawn(async move {
                    let (tag, mut s) = exchange(out, &payload(i)).await;
                    s.shutdown().await.unwrap();
                    // The upstream closes after our FIN: nothing more comes.
                    let mut rest = Vec::new();
                    s.read_to_end(&mut rest).await.unwrap();
                    assert!(rest.is_empty());
                    tag
                })
            })
            .collect();
        for t in batch {
            match t.await.unwrap() {
                b'a' => to_a += 1,
                b'b' => {}
                other => panic!("unknown backend tag {other}"),
            }
        }
    }
    // Binomial(1000, 0.75): mean 750, sd ~13.7; 650..=850 is > 7 sd wide.
    assert!((650..=850).contains(&to_a), "{to_a} of 1000 went to a");
    assert_eq!(
        a.accepted.load(Ordering::SeqCst) + b.accepted.load(Ordering::SeqCst),
        1000
    );
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weight_change_steers_new_connections_while_an_open_one_keeps_its_backend() {
    let (a, b) = (echo(b'a').await, echo(b'b').await);
    let (sc, out) = sidecar(&a, &b, "[{cluster: a, weight: 1}, {cluster: b, weight: 1}]").await;
    let (kept, mut long) = exchange(out, &payload(0)).await;
    // Drain the backend the open connection uses: new connections must all
    // go to the other one.
    let (drained, other, other_tag) = if kept == b'a' {
        (&a, &b, b'b')
    } else {
        (&b, &a, b'a')
    };
    let weights = if kept == b'a' {
        "[{cluster: a, weight: 0}, {cluster: b, weight: 1}]"
    } else {
        "[{cluster: a, weight: 1}, {cluster: b, weight: 0}]"
    };
    apply(&sc, &a, &b, out, weights);
    let before = other.accepted.load(Ordering::SeqCst);
    for i in 1..=100 {
        let (tag, s) = exchange(out, &payload(i)).await;
        assert_eq!(tag, other_tag, "connection {i} after the change");
        drop(s);
    }
    assert_eq!(other.accepted.load(Ordering::SeqCst), before + 100);
    // The open connection still reaches its first backend, intact.
    let more = payload(4242);
    long.write_all(&more).await.unwrap();
    let mut back = vec![0u8; more.len()];
    long.read_exact(&mut back).await.unwrap();
    assert!(back == more, "bytes differ on the kept connection");
    assert_eq!(drained.accepted.load(Ordering::SeqCst), 1);
    assert_eq!(drained.open.load(Ordering::SeqCst), 1);
    sc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_without_endpoints_closes_the_connection() {
    let (a, b) = (echo(b'a').await, echo(b'b').await);
    let (sc, out) = sidecar(&a, &b, "[{cluster: empty}]").await;
    let mut s = TcpStream::connect(out).await.unwrap();
    let _ = s.write_all(b"hello").await;
    let mut buf = Vec::new();
    // Closed without a byte (EOF or reset, depending on timing).
    match s.read_to_end(&mut buf).await {
        Ok(_) => assert!(buf.is_empty(), "{buf:?}"),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    assert_eq!(a.accepted.load(Ordering::SeqCst), 0);
    assert_eq!(b.accepted.load(Ordering::SeqCst), 0);
    sc.stop().await;
}
