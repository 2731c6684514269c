//! Event-loop lag: how long a task that has just become ready waits before
//! the data-plane runtime polls it (in the spirit of Envoy's dispatcher
//! loop-duration and watchdog statistics).
//!
//! Why it exists: end-to-end latency under load mixes the event loop with
//! everything else on the machine (the client, other processes on the same
//! cores). What offloading TLS signatures is meant to keep small is one
//! thing only: the time between "this connection has work" and "the event
//! loop runs it". This probe measures exactly that, in-process.
//!
//! How: a plain OS thread — not a runtime worker, so a busy or blocked
//! runtime cannot delay the *sending* side — wakes up every ~10 ms and
//! writes the time into a socket (a Unix datagram pair) that a task on the
//! runtime reads. The task records `received - sent` in
//! `baton_sidecar_event_loop_lag_seconds`. The wake-up travels the path a
//! client's request does — the kernel marks a socket readable, the runtime's
//! I/O driver sees it at its next poll, the task waits its turn in the run
//! queue — so the lag is what a request on an idle connection waits before
//! the event loop reads it. (A tokio channel would measure a different
//! queue: wake-ups from other threads, which the scheduler checks on its
//! own interval.)
//!
//! * The interval is jittered (0.5–1.5 × nominal) so the probe cannot
//!   phase-lock with periodic work (timer slots, scrapes) and sample only
//!   its quiet or only its busy moments.
//! * Overhead is one thread wake-up and one task poll per ~10 ms.
//! * While the runtime is stuck, samples wait in the socket's queue and
//!   each records its own lag once the runtime runs again; a stall longer
//!   than the kernel queues (hundreds of samples) keeps the oldest samples
//!   (the largest lags) and drops newer ones, so a long stall is
//!   undercounted, never understated.
//! * The thread ends at its next tick after the task is gone (the runtime
//!   stopped or the task was aborted: the socket's other end is closed).

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use prometheus_client::metrics::histogram::Histogram;
use tokio::task::JoinHandle;

/// Nominal sampling interval.
pub const INTERVAL: Duration = Duration::from_millis(10);

/// Upper bounds, seconds: 1-2-5 steps from 10 µs (a parked runtime's
/// wake-up) to 100 ms (a runtime that misses whole scheduler slices).
/// Adjacent bounds differ by at most 2.5×, which bounds the error of a
/// quantile interpolated inside one bucket.
pub const BUCKETS: [f64; 13] = [
    0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_2, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
    0.1,
];

/// A histogram with [`BUCKETS`].
pub fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// Pure: `interval` scaled by a factor in [0.5, 1.5), from `unit` in [0, 1).
pub fn jittered(interval: Duration, unit: f64) -> Duration {
    interval.mul_f64(0.5 + unit.clamp(0.0, 1.0))
}

/// Record one sample: the time between `sent` and `received` (zero if the
/// clock readings are out of order, which `Instant` does not promise
/// against across threads).
pub fn record(lag: &Histogram, sent: Instant, received: Instant) {
    lag.observe(received.saturating_duration_since(sent).as_secs_f64());
}

/// Start the probe for the current runtime: the recording task on the
/// runtime (returned, so its owner can abort it) and the sampling thread.
/// Must be called inside a tokio runtime.
pub fn spawn(lag: Histogram, interval: Duration) -> std::io::Result<JoinHandle<()>> {
    let (tx, rx) = std::os::unix::net::UnixDatagram::pair()?;
    // A full queue (a stalled runtime) drops the sample instead of blocking.
    tx.set_nonblocking(true)?;
    rx.set_nonblocking(true)?;
    let rx = tokio::net::UnixDatagram::from_std(rx)?;
    // Times travel as nanoseconds since a shared base.
    let base = Instant::now();
    std::thread::Builder::new()
        .name("baton-loop-lag".into())
        .spawn(move || {
            loop {
                std::thread::sleep(jittered(interval, rand::random::<f64>()));
                let sent = base.elapsed().as_nanos() as u64;
                match tx.send(&sent.to_le_bytes()) {
                    Err(e) if e.kind() != ErrorKind::WouldBlock => return, // reader gone
                    _ => {}
                }
            }
        })?;
    Ok(tokio::spawn(async move {
        let mut buf = [0u8; 8];
        while let Ok(n) = rx.recv(&mut buf).await {
            if n == buf.len() {
                let sent = base + Duration::from_nanos(u64::from_le_bytes(buf));
                record(&lag, sent, Instant::now());
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_rise_from_ten_microseconds_to_a_hundred_milliseconds_in_small_steps() {
        assert_eq!(BUCKETS[0], 0.000_01);
        assert_eq!(BUCKETS[BUCKETS.len() - 1], 0.1);
        for w in BUCKETS.windows(2) {
            assert!(w[1] > w[0], "{w:?}");
            assert!(w[1] / w[0] <= 2.5 + 1e-9, "{w:?}");
        }
    }

    #[test]
    fn jitter_stays_within_half_and_one_and_a_half_intervals() {
        assert_eq!(jittered(INTERVAL, 0.0), INTERVAL / 2);
        assert_eq!(jittered(INTERVAL, 0.5), INTERVAL);
        assert!(jittered(INTERVAL, 0.999) < INTERVAL * 3 / 2);
        assert_eq!(jittered(INTERVAL, 7.0), INTERVAL * 3 / 2);
    }

    #[test]
    fn a_sample_records_the_time_between_send_and_receive() {
        let h = histogram();
        let sent = Instant::now();
        record(&h, sent, sent + Duration::from_millis(3));
        // Out of order across threads: recorded as zero, not a panic.
        record(&h, sent + Duration::from_millis(1), sent);
        assert_eq!(h.count(), 2);
        assert!((h.sum() - 0.003).abs() < 1e-9, "{}", h.sum());
    }

    /// Run the probe (every 2 ms) on a current-thread runtime until it has
    /// `samples` samples; `stall` runs between awaits, on the runtime's
    /// only thread.
    fn probe(samples: u64, stall: impl Fn()) -> Histogram {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let h = histogram();
        rt.block_on(async {
            let task = spawn(h.clone(), Duration::from_millis(2)).unwrap();
            // Bounded: 2 000 rounds of at least 1 ms each.
            for _ in 0..2_000 {
                if h.count() >= samples {
                    break;
                }
                stall();
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            task.abort();
        });
        h
    }

    #[test]
    fn the_probe_records_samples_on_a_running_runtime() {
        assert!(probe(10, || {}).count() >= 10);
    }

    #[test]
    fn a_blocked_runtime_shows_a_larger_lag_than_a_free_one() {
        let free = probe(20, || {});
        // Block the runtime's thread the way inline CPU work does.
        let blocked = probe(20, || std::thread::sleep(Duration::from_millis(30)));
        assert!(free.count() >= 20 && blocked.count() >= 20);
        let mean = |h: &Histogram| h.sum() / h.count() as f64;
        assert!(
            mean(&blocked) > mean(&free),
            "blocked {} s vs free {} s",
            mean(&blocked),
            mean(&free)
        );
    }
}
