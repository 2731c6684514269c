//! Handoff benchmark (ignored by default; run by `bench/handoff-bench.sh`).
//!
//! For each connection count: N idle HTTP/1.1 keep-alive connections through
//! a sidecar, probe clients (`BATON_BENCH_PROBES`, default 4) measuring
//! request latency, then a handoff to a second process. Reports the handoff duration (as the new process measured
//! it, and wall time from spawn to completion), probe p50/p99 in steady
//! state and during the handoff (same run, same machine), peak RSS (VmHWM)
//! of both processes, and checks every idle connection still works after.

use crate::handoff_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use handoff_support::{World, connect, get};

fn hwm_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// CPU time (user + system) a process has used so far, in milliseconds.
fn cpu_ms(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are
    // fields 14 and 15 of the whole line.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // /proc counts in USER_HZ, which is 100 on Linux whatever the kernel's HZ.
    Some(ticks * 10)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// A runtime with one worker thread of its own: the upstream and the probes
/// each get one, so the latency a probe measures is the sidecar's and not
/// the harness's (the main runtime also holds the N idle client connections
/// and polls the status file).
fn own_runtime(name: &str) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()
        .unwrap()
}

/// Mean, and the bucket bounds under which 99 % and all of the pauses fall,
/// from the new process's `handoff_connection_pause_seconds` histogram.
fn pause_summary(metrics: &str) -> String {
    let name = "baton_sidecar_handoff_connection_pause_seconds";
    let value = |suffix: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}_{suffix} ")))
            .and_then(|v| v.parse::<f64>().ok())
    };
    let (Some(sum), Some(count)) = (value("sum"), value("count")) else {
        return "not exported".into();
    };
    let buckets: Vec<(f64, f64)> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("{name}_bucket{{le=\"")))
        .filter_map(|l| {
            let (le, n) = l.split_once("\"} ")?;
            Some((le.parse().unwrap_or(f64::INFINITY), n.parse().ok()?))
        })
        .collect();
    let under = |q: f64| {
        buckets
            .iter()
            .find(|(_, n)| *n >= q * count)
            .map_or("?".to_string(), |(le, _)| format!("{:.1}", le * 1000.0))
    };
    format!(
        "{count} connections, mean {:.3} ms, 99 % <= {} ms, all <= {} ms",
        sum / count.max(1.0) * 1000.0,
        under(0.99),
        under(1.0)
    )
}

async fn bench(n: usize) {
    let (upstream_rt, probe_rt) = (own_runtime("bench-upstream"), own_runtime("bench-probes"));
    let world = upstream_rt.spawn(World::new()).await.unwrap();
    let mut old = world.spawn(&[]);
    world.wait_ready(Duration::from_secs(20)).await;
    // The next process is forked now, before the connections exist, and
    // exec'd at the handoff: it starts with a small descriptor table, as a
    // sidecar a container runtime starts does (see `World::prepare`).
    let next = world.prepare(&[]);
    // N idle keep-alive connections, each after one request (so each is an
    // established HTTP/1.1 connection between requests).
    let mut idle = Vec::with_capacity(n);
    for chunk in 0..n.div_ceil(200) {
        let mut batch = Vec::new();
        for i in chunk * 200..((chunk + 1) * 200).min(n) {
            batch.push(tokio::spawn({
                let addr = world.http;
                async move {
                    let mut s = connect(addr).await;
                    assert!(get(&mut s, &format!("/idle/{i}")).await);
                    s
                }
            }));
        }
        for b in batch {
            idle.push(b.await.unwrap());
        }
    }
    // Probes: each a keep-alive connection sending sequential requests 1 ms
    // apart, latency per request, tagged by phase. Several, so the "during"
    // window has enough samples that p99 is a percentile, not the one
    // request each connection spends frozen while it moves.
    let probes: usize = std::env::var("BATON_BENCH_PROBES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let during = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let probe_tasks: Vec<_> = (0..probes)
        .map(|p| {
            probe_rt.spawn({
                let (during, stop, addr) = (during.clone(), stop.clone(), world.http);
                async move {
                    let mut s = connect(addr).await;
                    let (mut steady, mut handoff, mut failed) = (Vec::new(), Vec::new(), 0);
                    let mut seq = 0;
                    while !stop.load(Ordering::Relaxed) {
                        seq += 1;
                        let phase = during.load(Ordering::Relaxed);
                        let t = Instant::now();
                        let ok = get(&mut s, &format!("/probe/{p}/{seq}")).await;
                        let ms = t.elapsed().as_secs_f64() * 1000.0;
                        if !ok {
                            failed += 1;
                            s = connect(addr).await;
                        } else if phase && during.load(Ordering::Relaxed) {
                            handoff.push((t, ms));
                        } else if !phase {
                            steady.push(ms);
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    (steady, handoff, failed)
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;

    during.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    let new = next.start();
    let (old_pid, new_pid) = (old.pid(), new.pid());
    let mut old_hwm = hwm_kb(old_pid).unwrap_or(0);
    // CPU the old process spends from the spawn until it exits (last read
    // before it is gone), the new one until it completes.
    let old_cpu_before = cpu_ms(old_pid).unwrap_or(0);
    let mut old_cpu = old_cpu_before;
    let status = loop {
        old_hwm = old_hwm.max(hwm_kb(old_pid).unwrap_or(0));
        old_cpu = cpu_ms(old_pid).unwrap_or(old_cpu);
        if let Some(s) = world.status()
            && s["pid"] == new_pid
        {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "handoff of {n} connections did not complete"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let wall_ms = t0.elapsed().as_millis();
    let new_cpu = cpu_ms(new_pid).unwrap_or(0);
    // Keep measuring until the old process has exited.
    while old.alive() && t0.elapsed() < Duration::from_secs(60) {
        old_hwm = old_hwm.max(hwm_kb(old_pid).unwrap_or(0));
        old_cpu = cpu_ms(old_pid).unwrap_or(old_cpu);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let exited_ms = t0.elapsed().as_secs_f64() * 1000.0;
    tokio::time::sleep(Duration::from_millis(200)).await;
    during.store(false, Ordering::Relaxed);
    let new_hwm = hwm_kb(new_pid).unwrap_or(0);
    stop.store(true, Ordering::Relaxed);
    let (mut steady, mut timed, mut failed) = (Vec::new(), Vec::new(), 0);
    for t in probe_tasks {
        let (s, h, f) = t.await.unwrap();
        steady.extend(s);
        timed.extend(h);
        failed += f;
    }

    // Where the slowest requests of the window started, relative to the
    // spawn of the new process (BATON_BENCH_SLOWEST=n to print them).
    if let Some(k) = std::env::var("BATON_BENCH_SLOWEST")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        // Instant is CLOCK_MONOTONIC: its Debug form lines up with a trace
        // taken by `perf sched record -k mono`.
        println!("  spawn at {t0:?}");
        println!("  complete at +{wall_ms} ms, old process gone at +{exited_ms:.0} ms");
        let mut by_ms = timed.clone();
        by_ms.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
        for (t, ms) in by_ms.iter().take(k) {
            let at = t.saturating_duration_since(t0).as_secs_f64() * 1000.0;
            println!("  slow: started at +{at:.1} ms, took {ms:.3} ms");
        }
    }
    // Each moved connection's pause, as the new process measured it.
    if let Ok((200, m)) = handoff_support::admin_get(world.admin, "/metrics").await {
        println!("  pause per moved connection: {}", pause_summary(&m));
    }
    let mut handoff: Vec<f64> = timed.iter().map(|(_, ms)| *ms).collect();
    // Every idle connection moved and still works.
    let mut broken = 0;
    for (i, s) in idle.iter_mut().enumerate() {
        if !get(s, &format!("/after/{i}")).await {
            broken += 1;
        }
    }
    let (s50, s99) = (pct(&mut steady, 0.5), pct(&mut steady, 0.99));
    let (h50, h99) = (pct(&mut handoff, 0.5), pct(&mut handoff, 0.99));
    println!(
        "| {n} | {} | {wall_ms} | {} | {} / {new_cpu} | {s50:.3} / {s99:.3} | {h50:.3} / {h99:.3} ({} samples) | {:.2} | {:.1} / {:.1} | {broken} | {failed} |",
        status["durationMs"],
        status["connections"],
        old_cpu - old_cpu_before,
        handoff.len(),
        h99 / s99,
        old_hwm as f64 / 1024.0,
        new_hwm as f64 / 1024.0,
    );
    assert_eq!(broken, 0, "connections lost in the handoff");
    assert_eq!(failed, 0, "probe requests failed");
    drop(new);
    drop(world);
    upstream_rt.shutdown_background();
    probe_rt.shutdown_background();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run bench/handoff-bench.sh"]
async fn handoff_bench() {
    // RLIMIT_NOFILE is raised by bench/handoff-bench.sh (children inherit it).
    let counts: Vec<usize> = std::env::var("BATON_BENCH_CONNS")
        .unwrap_or_else(|_| "100,1000,10000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    println!(
        "| idle conns | handoff ms (new) | wall ms (spawn→complete) | moved | CPU ms old (spawn→exit) / new (start→complete) | probe p50/p99 ms steady | p50/p99 ms during | p99 ratio | peak RSS MiB old/new | broken | probe failures |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for n in counts {
        bench(n).await;
    }
}
