//! A hyper [`Timer`] with deadlines rounded up to whole 250 ms slots.
//!
//! Why: hyper arms a header-read timer for every request head. With tokio's
//! timer, arming a deadline earlier than the driver's next wake-up makes the
//! time driver unpark the I/O driver — an `eventfd` write, one syscall per
//! request on a saturated proxy (seen with `perf record -e
//! syscalls:sys_enter_write --call-graph dwarf`). Rounding deadlines to
//! shared slots makes most new timers land on a slot the driver already
//! wakes for, so the syscall happens about once per slot instead of once per
//! request. Timeouts fire up to one slot late, which is irrelevant for
//! multi-second protocol timeouts.

use std::pin::Pin;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use hyper::rt::{Sleep, Timer};
use hyper_util::rt::TokioTimer;

const SLOT: Duration = Duration::from_millis(250);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// `deadline` rounded up to the next slot boundary.
pub fn round_up(deadline: Instant) -> Instant {
    let e = epoch();
    let since = deadline.saturating_duration_since(e).as_nanos();
    let slot = SLOT.as_nanos();
    let slots = since.div_ceil(slot);
    e + Duration::from_nanos((slots * slot) as u64)
}

#[derive(Debug, Clone, Copy, Default)]
pub struct CoarseTimer;

impl Timer for CoarseTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Sleep>> {
        TokioTimer::new().sleep_until(round_up(Instant::now() + duration))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Sleep>> {
        TokioTimer::new().sleep_until(round_up(deadline))
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn Sleep>>, new_deadline: Instant) {
        TokioTimer::new().reset(sleep, round_up(new_deadline))
    }

    fn now(&self) -> Instant {
        TokioTimer::new().now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_round_up_to_a_slot_and_never_earlier() {
        let now = Instant::now();
        for ms in [0u64, 1, 249, 250, 251, 10_000] {
            let d = now + Duration::from_millis(ms);
            let r = round_up(d);
            assert!(r >= d);
            assert!(r - d < SLOT);
            assert_eq!(round_up(r), r, "a slot boundary is its own rounding");
        }
    }

    #[tokio::test]
    async fn a_coarse_sleep_completes() {
        let s = CoarseTimer.sleep(Duration::from_millis(10));
        tokio::time::timeout(Duration::from_secs(5), async move {
            // hyper's Sleep is a Future
            s.await;
        })
        .await
        .unwrap();
    }
}
