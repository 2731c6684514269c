//! Multi-process handoff tests: two (or more, in turn) real `baton-sidecar`
//! processes hand listeners and live connections to each other on loopback
//! while a load client checks every response and every byte.
//!
//! Knobs (environment, for longer soak runs): `BATON_HANDOFF_ROUNDS`
//! (consecutive handoffs, default 50) and `BATON_HANDOFF_CHAOS_RUNS` (default
//! 20).

use crate::handoff_support;

use std::time::{Duration, Instant};

use handoff_support::{
    Load, LoadShape, World, admin_get, connect, get, knob, metric_sum, metrics, wait_exit,
};

/// Waits until the admin port reports `phase` as the current one.
async fn wait_phase(world: &World, phase: &str, within: Duration) {
    let deadline = Instant::now() + within;
    let want = format!("baton_sidecar_lifecycle_phase{{phase=\"{phase}\"}} 1");
    while Instant::now() < deadline {
        if let Ok((200, body)) = admin_get(world.admin, "/metrics").await
            && body.contains(&want)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("phase {phase} not reached within {within:?}");
}

/// No load client failed; otherwise the failures and the log tails of the
/// processes `pids` and of every process that held a stalled connection.
fn assert_clean(world: &World, stats: &handoff_support::Stats, pids: &[u32]) {
    let failures = stats.failures.lock().unwrap().clone();
    if failures.is_empty() {
        return;
    }
    let mut pids = pids.to_vec();
    pids.extend(stats.stalled_pids.lock().unwrap().iter());
    panic!(
        "{} failures: {failures:#?}\nlogs:\n{}",
        failures.len(),
        world.log_tails_of(&pids)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consecutive_handoffs_lose_no_request_no_byte_and_no_counter() {
    let rounds = knob("BATON_HANDOFF_ROUNDS", 50);
    let world = World::new_with_tls().await;
    // Alternate builds: even generations are this build (protocol 2..=3),
    // odd ones a "next version" speaking 3..=4, so upgrade and rollback both
    // negotiate 3. (Older peers: see the tests after this one.)
    let env_for = |g: usize| -> Vec<(&'static str, &'static str)> {
        if g % 2 == 1 {
            vec![("BATON_HANDOFF_PROTOCOL_RANGE", "3-4")]
        } else {
            vec![]
        }
    };
    let mut current = world.spawn(&env_for(0));
    world.wait_ready(Duration::from_secs(20)).await;
    let load = Load::start(
        &world,
        LoadShape {
            keepalive: 3,
            new_conns: 1,
            h2: 1,
            echo: 3,
            tls12: 1,
            tls13: 1,
            https: 1,
            mtls_echo: 2,
            ..LoadShape::default()
        },
    )
    .await;
    // Readiness probes throughout, as the kubelet would send them: every
    // answer on the shared admin port must be 200.
    let probe_stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = tokio::spawn({
        let (admin, stop) = (world.admin, probe_stop.clone());
        async move {
            let (mut ok, mut bad) = (0u64, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match admin_get(admin, "/ready").await {
                    Ok((200, _)) => ok += 1,
                    other => bad.push(format!("{other:?}")),
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (ok, bad)
        }
    });
    let mut last_requests = 0u64;
    let mut durations = Vec::new();
    let mut moved_total = 0u64;
    for round in 1..=rounds {
        tokio::time::sleep(Duration::from_millis(120)).await;
        let mut next = world.spawn(&env_for(round));
        let (old_pid, new_pid) = (current.pid(), next.pid());
        load.stats.set_phase(format!(
            "during handoff #{round} (pid {old_pid} -> pid {new_pid})"
        ));
        let status = world
            .wait_complete(next.pid(), Duration::from_secs(20))
            .await;
        load.stats.set_phase(format!(
            "after handoff #{round} completed (pid {new_pid} serving, pid {old_pid} draining)"
        ));
        durations.push(status["durationMs"].as_u64().unwrap());
        moved_total += status["connections"].as_u64().unwrap();
        // The old process exits by itself once it holds nothing.
        let exit = wait_exit(&mut current, Duration::from_secs(20)).await;
        assert!(
            exit.is_some_and(|s| s.success()),
            "round {round}: old process did not exit cleanly: {exit:?}\n{}",
            current.log_tail()
        );
        load.stats.set_phase(format!(
            "after handoff #{round} (pid {new_pid} serving alone)"
        ));
        assert!(
            next.alive(),
            "round {round}: new process died\n{}",
            next.log_tail()
        );
        let m = metrics(&world).await;
        let requests = metric_sum(&m, "baton_sidecar_requests_total{");
        assert!(
            requests >= last_requests,
            "round {round}: requests_total went backwards: {last_requests} -> {requests}"
        );
        last_requests = requests;
        assert!(
            m.contains("baton_sidecar_handoff_complete 1"),
            "round {round}: no completion metric"
        );
        // Each adopted connection's pause is observed once.
        assert_eq!(
            metric_sum(&m, "baton_sidecar_handoff_connection_pause_seconds_count"),
            status["connections"].as_u64().unwrap(),
            "round {round}: pauses observed"
        );
        assert!(m.contains("baton_sidecar_lifecycle_phase{phase=\"serving\"} 1"));
        // The admin endpoint reports the same completion as the file.
        let (code, body) = admin_get(world.admin, "/handoff").await.unwrap();
        let admin: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(code, 200, "{body}");
        assert_eq!(admin["phase"], "serving", "{body}");
        assert_eq!(admin["complete"], true, "{body}");
        assert_eq!(admin["lastHandoff"], status, "round {round}: {body}");
        current = next;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    load.stats.set_phase(format!(
        "closing after {rounds} handoffs (pid {} serving)",
        current.pid()
    ));
    let stats = load.finish().await;
    assert_clean(&world, &stats, &[current.pid()]);
    probe_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ready_ok, not_ready) = prober.await.unwrap();
    assert!(
        not_ready.is_empty(),
        "/ready not 200 during handoffs: {not_ready:?}"
    );
    assert!(
        ready_ok > rounds as u64,
        "too few readiness probes: {ready_ok}"
    );
    let dups = world.upstream.duplicates();
    assert!(dups.is_empty(), "requests served twice: {dups:?}");
    let ok = stats.ok.load(std::sync::atomic::Ordering::Relaxed);
    let echoed = stats.echo_bytes.load(std::sync::atomic::Ordering::Relaxed);
    let tls_bytes = stats.tls_bytes.load(std::sync::atomic::Ordering::Relaxed);
    assert!(tls_bytes > 0, "no TLS traffic");
    let https = stats.https_ok.load(std::sync::atomic::Ordering::Relaxed);
    assert!(https > rounds as u64, "too few HTTPS requests: {https}");
    assert!(
        ok > rounds as u64 * 10,
        "too little traffic to mean anything: {ok} requests"
    );
    assert!(
        echoed > 0 && moved_total >= rounds as u64 * 3,
        "echo {echoed} B, moved {moved_total}"
    );
    // The last process counted at least every request this test completed.
    let m = metrics(&world).await;
    assert!(metric_sum(&m, "baton_sidecar_requests_total{") >= ok);
    // The originated mTLS sessions moved with their record state: each was
    // established once, by the first process (the two `mtls_echo` clients'),
    // and never again by a later one (TLS handshake counters continue across
    // handoffs, so the last process reports the first one's two).
    assert_eq!(
        metric_sum(&m, "baton_sidecar_tls_handshakes_total{side=\"client\""),
        2,
        "originated sessions were re-established instead of moved:\n{m}"
    );
    durations.sort_unstable();
    eprintln!(
        "{rounds} handoffs: {ok} requests ({} h2 retries after GOAWAY), {echoed} echoed bytes ({tls_bytes} over TLS 1.2/1.3), {moved_total} connections moved; handoff ms p50 {} max {}",
        stats.h2_retries.load(std::sync::atomic::Ordering::Relaxed),
        durations[durations.len() / 2],
        durations[durations.len() - 1]
    );
}

/// A protocol-1 peer cannot continue an originated TLS session: a raw TCP
/// connection with one stays on the old process and drains there (until it
/// closes), while everything else moves; nothing is lost either way. (The
/// old process plays the protocol-2 build, 1..=2: this one no longer speaks
/// 1.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_1_peer_leaves_originated_tls_connections_draining_on_the_old_process() {
    let world = World::new_with_tls().await;
    let mut old = world.spawn(&[("BATON_HANDOFF_PROTOCOL_RANGE", "1-2")]);
    world.wait_ready(Duration::from_secs(20)).await;
    let load = Load::start(
        &world,
        LoadShape {
            keepalive: 1,
            echo: 1,
            tls13: 1,
            mtls_echo: 1,
            ..LoadShape::default()
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mut new = world.spawn(&[("BATON_HANDOFF_PROTOCOL_RANGE", "1-1")]);
    let status = world
        .wait_complete(new.pid(), Duration::from_secs(20))
        .await;
    assert_eq!(status["protocolVersion"], 1, "{status}");
    // keep-alive + echo + TLS 1.3 echo + the inbound leg of the mTLS stream.
    assert_eq!(status["connections"], 4, "{status}");
    // The outbound leg is still the old process's, and still flowing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        old.alive(),
        "the old process must keep the originated session\n{}",
        old.log_tail()
    );
    let stats = load.finish().await;
    // Once its last connection closes the old process exits by itself.
    let exit = wait_exit(&mut old, Duration::from_secs(10)).await;
    assert!(
        exit.is_some_and(|s| s.success()),
        "old: {exit:?}\n{}",
        old.log_tail()
    );
    assert!(new.alive());
    assert_clean(&world, &stats, &[old.pid(), new.pid()]);
}

/// Starts a sidecar under load, then a second one with `env` that must
/// refuse (or be refused) to take over: it exits with an error whose log
/// has every `expect` string, and the first keeps serving every connection
/// with no handoff reported. Returns the metrics scraped afterwards.
async fn a_second_sidecar_is_turned_away(
    world: &World,
    env: &[(&str, &str)],
    expect: &[&str],
) -> String {
    let mut old = world.spawn(&[]);
    world.wait_ready(Duration::from_secs(20)).await;
    let load = Load::start(
        world,
        LoadShape {
            keepalive: 2,
            new_conns: 1,
            h2: 1,
            echo: 2,
            ..LoadShape::default()
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut new = world.spawn(env);
    let exit = wait_exit(&mut new, Duration::from_secs(20)).await;
    assert!(
        exit.is_some_and(|s| !s.success()),
        "the turned-away process must exit with an error: {exit:?}"
    );
    let log = new.log_all();
    for e in expect {
        assert!(log.contains(e), "{e:?} not in: {}", new.log_tail());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(old.alive());
    let m = metrics(world).await;
    assert!(
        m.contains("baton_sidecar_lifecycle_phase{phase=\"serving\"} 1"),
        "{m}"
    );
    assert!(
        world.status().is_none(),
        "no handoff may be reported complete"
    );
    let stats = load.finish().await;
    assert_clean(world, &stats, &[old.pid()]);
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incompatible_protocol_version_is_refused_and_the_old_keeps_serving() {
    let world = World::new().await;
    let m = a_second_sidecar_is_turned_away(
        &world,
        &[("BATON_HANDOFF_PROTOCOL_RANGE", "5-6")],
        &["incompatible"],
    )
    .await;
    assert!(
        m.contains("baton_sidecar_handoffs_total{role=\"old\",result=\"refused\"} 1"),
        "{m}"
    );
}

/// A new sidecar whose offload is Required but whose engine does not work
/// in its slot (the device is held by the serving sidecar's container)
/// must not take over: it exits with the reason and the old keeps serving
/// everything, device included (docs/upgrade.md, "Accelerators").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_sidecar_without_its_required_offload_engine_refuses_to_take_over() {
    let world = World::new_with_tls().await;
    a_second_sidecar_is_turned_away(
        &world,
        &[
            ("BATON_OFFLOAD_MODE", "Required"),
            ("BATON_OFFLOAD_ENGINE", "no-such-device"),
        ],
        &["not taking over from the running sidecar", "Required"],
    )
    .await;
}

/// Runs `runs` handoffs that are each cut short by `cut` (SIGKILL or
/// SIGSTOP of the new process at a random point), and checks after each one
/// that the old process serves again and that exactly the connections the
/// new process had acknowledged were lost — every other connection, parked
/// and resumed or never touched, carries on byte-exactly.
async fn interrupted_handoffs(
    runs: usize,
    stop_instead_of_kill: bool,
    cut_window_ms: std::ops::Range<u64>,
) {
    // With TLS: a TLS connection whose secrets were extracted for a handoff
    // that then failed continues on our record layer in the old process.
    let world = World::new_with_tls().await;
    let mut old = world.spawn(&[("BATON_HANDOFF_TIMEOUT_MS", "800")]);
    world.wait_ready(Duration::from_secs(20)).await;
    for run in 0..runs {
        // Long-lived connections only: each is either moved (and dies with
        // the new process) or kept (and must not notice anything).
        let load = Load::start(
            &world,
            LoadShape {
                keepalive: 3,
                echo: 4,
                tls12: 1,
                tls13: 1,
                pace: Duration::from_millis(3),
                ..LoadShape::default()
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(80)).await;
        let before = metrics(&world).await;
        let moved_before = metric_sum(
            &before,
            "baton_sidecar_handoff_connections_total{outcome=\"moved\"}",
        );
        // 25 ms per adoption step: the handoff of 8 connections takes
        // > 200 ms, so a cut in 0..200 ms always lands inside it.
        let mut new = world.spawn(&[("BATON_HANDOFF_TEST_STEP_DELAY_MS", "25")]);
        let at = rand::random_range(cut_window_ms.clone());
        tokio::time::sleep(Duration::from_millis(at)).await;
        if stop_instead_of_kill {
            new.signal(nix::sys::signal::Signal::SIGSTOP);
            // The old gives up after its step timeout and resumes.
            tokio::time::sleep(Duration::from_millis(1200)).await;
        }
        new.kill();
        assert!(
            world.status().is_none_or(|s| s["pid"] != new.pid()),
            "run {run}: the new process completed before the cut at {at} ms"
        );
        wait_phase(&world, "serving", Duration::from_secs(10)).await;
        assert!(
            old.alive(),
            "run {run}: old process died\n{}",
            old.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
        let after = metrics(&world).await;
        let moved = metric_sum(
            &after,
            "baton_sidecar_handoff_connections_total{outcome=\"moved\"}",
        ) - moved_before;
        let stats = load.finish().await;
        let failures = stats.failures.lock().unwrap().clone();
        assert_eq!(
            failures.len() as u64,
            moved,
            "run {run} (cut at {at} ms): only the {moved} acknowledged connections may break, got {failures:#?}\n{}",
            old.log_tail()
        );
        // New connections are accepted again by the old process.
        let fresh = Load::start(
            &world,
            LoadShape {
                keepalive: 1,
                new_conns: 1,
                h2: 1,
                echo: 1,
                pace: Duration::from_millis(3),
                ..LoadShape::default()
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(60)).await;
        let stats = fresh.finish().await;
        assert_clean(&world, &stats, &[old.pid()]);
    }
    let m = metrics(&world).await;
    // (A cut before the new process even connected is no handoff at all.)
    assert!(
        metric_sum(
            &m,
            "baton_sidecar_handoffs_total{role=\"old\",result=\"failed\"}"
        ) >= 1
    );
    assert!(old.alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_new_process_mid_handoff_loses_no_untransferred_connection() {
    interrupted_handoffs(knob("BATON_HANDOFF_CHAOS_RUNS", 20), false, 0..200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_new_process_times_out_and_the_old_resumes_everything_unacknowledged() {
    interrupted_handoffs(2, true, 80..200).await;
}

/// Flow control: the old process keeps at most `IN_FLIGHT` connections
/// parked or sent and not yet acknowledged, so a new process that reads
/// slowly cannot leave connections frozen in the socket's buffer. A peer
/// speaking the protocol by hand takes the frames but acknowledges only
/// when it chooses; when it goes away, everything it did not acknowledge is
/// served by the old process again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_process_sends_no_more_than_in_flight_unacknowledged_connections() {
    use baton_sidecar::handoff::protocol::{Channel, Message, VersionRange};
    use baton_sidecar::handoff::session::IN_FLIGHT;

    let world = World::new().await;
    let mut old = world.spawn(&[]);
    world.wait_ready(Duration::from_secs(20)).await;
    let n = 3 * IN_FLIGHT;
    let mut idle = Vec::new();
    for i in 0..n {
        let mut s = connect(world.http).await;
        assert!(get(&mut s, &format!("/idle/{i}")).await);
        idle.push(s);
    }

    let stream = tokio::net::UnixStream::connect(&world.socket)
        .await
        .unwrap();
    let (tx, mut rx) = Channel::new(stream).split();
    let recv = async |rx: &mut baton_sidecar::handoff::protocol::Receiver| {
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("a frame within 10 s")
            .expect("a well-formed frame")
    };
    tx.send(
        &Message::Hello {
            versions: VersionRange::this_build(),
            sidecar_version: "flow-control-test".into(),
        },
        b"",
        &[],
    )
    .await
    .unwrap();
    for want in ["welcome", "listeners", "state"] {
        assert_eq!(recv(&mut rx).await.msg.kind(), want);
    }
    tx.send(&Message::Accepting, b"", &[]).await.unwrap();

    // IN_FLIGHT connections arrive (however slowly this machine runs), then
    // nothing more while none is acknowledged.
    let mut got = Vec::new();
    let take =
        async |rx: &mut baton_sidecar::handoff::protocol::Receiver, got: &mut Vec<u64>, n| {
            for _ in 0..n {
                match recv(rx).await.msg {
                    Message::Connection(h) => got.push(h.id),
                    m => panic!("unexpected {}", m.kind()),
                }
            }
            let more = tokio::time::timeout(Duration::from_millis(500), rx.recv()).await;
            assert!(more.is_err(), "a connection beyond IN_FLIGHT: {more:?}");
        };
    take(&mut rx, &mut got, IN_FLIGHT).await;

    // Each acknowledgement lets exactly one more go.
    for id in got.drain(..3) {
        tx.send(&Message::Ack { id }, b"", &[]).await.unwrap();
    }
    take(&mut rx, &mut got, 3).await;
    assert_eq!(got.len(), IN_FLIGHT);

    // The peer goes away: the old process serves again, with every
    // connection it did not let go of (the 3 acknowledged ones are gone
    // with the peer that took them).
    drop((tx, rx));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(old.alive(), "{}", old.log_tail());
    let mut working = 0;
    for (i, s) in idle.iter_mut().enumerate() {
        if get(s, &format!("/after/{i}")).await {
            working += 1;
        }
    }
    assert_eq!(working, n - 3, "{}", old.log_tail());
    let mut fresh = connect(world.http).await;
    assert!(get(&mut fresh, "/fresh").await, "accepting again");
    let m = metrics(&world).await;
    assert!(
        m.contains("baton_sidecar_handoffs_total{role=\"old\",result=\"failed\"} 1"),
        "{m}"
    );
    assert!(m.contains("baton_sidecar_lifecycle_phase{phase=\"serving\"} 1"));
}
