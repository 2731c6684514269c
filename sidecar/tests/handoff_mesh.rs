//! A handoff as it happens in a Pod: the new sidecar starts with no policy
//! of its own (in a Pod, its config arrives by push) and takes over from one
//! serving mesh mTLS. It must serve every connection, from the first, under
//! the policy and with the certificate the old process served them with:
//! new outbound connections originate mesh mTLS, new inbound ones are
//! terminated, and no client notices the change.
//!
//! Before this held, the new process served the inherited routes and
//! clusters with its TLS layer still off until the operator's next push, and
//! a meshed client Pod's sidecar answered 503 ("cluster wants mesh mTLS but
//! the sidecar has no TLS layer", "TLS is disabled by policy") to requests
//! sent during a rollout (issue #33).

use crate::handoff_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use handoff_support::{Pattern, World, admin_get};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One short exchange on a new connection through the `mtls-out` listener:
/// plaintext in, mesh mTLS originated to the sidecar's own mesh-TLS
/// listener (terminated there), then the echo server; every byte checked.
async fn mtls_exchange(world: &World, seed: u64) -> Result<(), String> {
    let addr = world.mtls_out.expect("a world with TLS");
    let one = async {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let len = 1 + (seed as usize * 7919) % 4096;
        let mut out = vec![0u8; len];
        Pattern::new(seed).fill(&mut out);
        s.write_all(&out).await.map_err(|e| format!("write: {e}"))?;
        let mut back = vec![0u8; len];
        s.read_exact(&mut back)
            .await
            .map_err(|e| format!("read after 0 of {len} bytes checked: {e}"))?;
        if back != out {
            return Err("echoed bytes differ".to_string());
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(10), one)
        .await
        .map_err(|_| "no echo within 10 s".to_string())?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_started_without_a_policy_takes_over_under_the_served_one() {
    let world = World::new_with_tls().await;
    let mut old = world.spawn(&[]);
    world.wait_ready(Duration::from_secs(20)).await;
    mtls_exchange(&world, 0)
        .await
        .unwrap_or_else(|e| panic!("before the handoff: {e}\n{}", old.log_tail()));

    // The new process's own config: the admin port, nothing else (no
    // listeners, no clusters, no `tls` section), as a Pod's sidecar starts.
    let pod = world.dir.path().join("pod.yaml");
    std::fs::write(
        &pod,
        format!("version: 0\nadmin: {{ address: {} }}\n", world.admin),
    )
    .unwrap();

    // New connections all along, one at a time, until told to stop
    // (bounded: at most 5,000 exchanges).
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let world = Arc::new(world);
    let client = tokio::spawn({
        let (world, stop, done) = (world.clone(), stop.clone(), done.clone());
        async move {
            let mut failures = Vec::new();
            for seed in 1..=5_000u64 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                if let Err(e) = mtls_exchange(&world, seed).await {
                    failures.push(format!("exchange {seed}: {e}"));
                }
                done.fetch_add(1, Ordering::Relaxed);
            }
            failures
        }
    });

    let mut new = world.spawn_with_config(&pod, &[]);
    let status = world
        .wait_complete(new.pid(), Duration::from_secs(20))
        .await;
    let at_takeover = done.load(Ordering::Relaxed);
    let handshakes_at_takeover = ok_handshakes(&world).await;
    // Keep going on the new process alone: at least 50 more exchanges, for
    // at most 10 s.
    let deadline = Instant::now() + Duration::from_secs(10);
    while done.load(Ordering::Relaxed) < at_takeover + 50 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let failures = client.await.unwrap();
    let after = done.load(Ordering::Relaxed) - at_takeover;
    assert!(
        failures.is_empty(),
        "{} failed exchanges: {failures:#?}\nhandoff: {status}\nnew:\n{}\nold:\n{}",
        failures.len(),
        new.log_tail(),
        old.log_tail()
    );
    assert!(
        after >= 50,
        "only {after} exchanges after the takeover\n{}",
        new.log_tail()
    );

    // The new process holds the served policy: ready, and it originated and
    // terminated mesh mTLS for the exchanges it served (the counters are
    // carried across the handoff, so the difference is the new process's).
    let (code, body) = admin_get(world.admin, "/ready").await.unwrap();
    assert_eq!(code, 200, "{body}");
    let (client, server) = ok_handshakes(&world).await;
    let (client0, server0) = handshakes_at_takeover;
    assert!(
        client - client0 >= 50 && server - server0 >= 50,
        "{after} exchanges after the takeover, but handshakes: client {client0} → {client}, server {server0} → {server}"
    );
    new.kill();
    old.kill();
}

/// Successful mesh handshakes counted so far, (client side, server side).
async fn ok_handshakes(world: &World) -> (u64, u64) {
    let (_, metrics) = admin_get(world.admin, "/metrics").await.unwrap();
    let count = |side: &str| {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("baton_sidecar_tls_handshakes_total{")
                    && l.contains(&format!("side=\"{side}\""))
                    && l.contains("result=\"ok\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    (count("client"), count("server"))
}
