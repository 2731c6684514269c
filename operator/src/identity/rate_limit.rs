//! Per-Pod token buckets: a sidecar looping on certificate requests spends
//! its own bucket and gets 429s, while every other Pod keeps its own.
//!
//! Pure: the caller passes `now`. Buckets that have refilled completely are
//! dropped when the map grows, so memory follows the Pods active recently,
//! not every Pod ever seen.

use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
pub struct RateLimit {
    /// Requests a Pod may make back to back.
    pub burst: u32,
    /// One token returns every `refill` (sustained rate = 1/refill).
    pub refill: Duration,
}

impl Default for RateLimit {
    /// A sidecar needs one request per renewal (every ~16 h) plus a few on
    /// start and handoff; 10 back to back, then one every 6 s, is far above
    /// that and far below what would starve the issuer.
    fn default() -> Self {
        RateLimit {
            burst: 10,
            refill: Duration::from_secs(6),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

#[derive(Debug)]
pub struct RateLimiter {
    limit: RateLimit,
    buckets: HashMap<String, Bucket>,
    /// Prune full buckets when the map reaches this size.
    prune_at: usize,
}

impl RateLimiter {
    pub fn new(limit: RateLimit) -> Self {
        RateLimiter {
            limit,
            buckets: HashMap::new(),
            prune_at: 1024,
        }
    }

    fn refilled(&self, b: Bucket, now: Instant) -> f64 {
        let per_sec = 1.0 / self.limit.refill.as_secs_f64().max(1e-9);
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        (b.tokens + elapsed * per_sec).min(f64::from(self.limit.burst))
    }

    /// Takes one token from `key`'s bucket, or says how long until one is
    /// back.
    pub fn check(&mut self, key: &str, now: Instant) -> Result<(), Duration> {
        if self.buckets.len() >= self.prune_at {
            let full = f64::from(self.limit.burst);
            let stale: Vec<String> = self
                .buckets
                .iter()
                .filter(|(_, b)| self.refilled(**b, now) >= full)
                .map(|(k, _)| k.clone())
                .collect();
            for k in stale {
                self.buckets.remove(&k);
            }
            // Everyone is active: grow rather than forget a throttled Pod.
            self.prune_at = (self.buckets.len() * 2).max(1024);
        }
        let current = match self.buckets.get(key) {
            Some(b) => self.refilled(*b, now),
            None => f64::from(self.limit.burst),
        };
        if current >= 1.0 {
            self.buckets.insert(
                key.to_owned(),
                Bucket {
                    tokens: current - 1.0,
                    at: now,
                },
            );
            Ok(())
        } else {
            self.buckets.insert(
                key.to_owned(),
                Bucket {
                    tokens: current,
                    at: now,
                },
            );
            Err(self.limit.refill.mul_f64(1.0 - current))
        }
    }

    pub fn tracked(&self) -> usize {
        self.buckets.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(burst: u32, refill_secs: u64) -> RateLimiter {
        RateLimiter::new(RateLimit {
            burst,
            refill: Duration::from_secs(refill_secs),
        })
    }

    #[test]
    fn a_pod_may_burst_then_is_refused_with_the_time_until_the_next_token() {
        let mut l = limiter(3, 10);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(l.check("pod-a", t0), Ok(()));
        }
        assert_eq!(l.check("pod-a", t0), Err(Duration::from_secs(10)));
        // Half a refill later, half a token is back: 5 s to go.
        let wait = l.check("pod-a", t0 + Duration::from_secs(5)).unwrap_err();
        assert_eq!(wait.as_secs(), 5);
        assert_eq!(l.check("pod-a", t0 + Duration::from_secs(10)), Ok(()));
    }

    #[test]
    fn one_pods_loop_does_not_spend_another_pods_tokens() {
        let mut l = limiter(2, 60);
        let t0 = Instant::now();
        for _ in 0..100 {
            let _ = l.check("looping", t0);
        }
        assert!(l.check("looping", t0).is_err());
        assert_eq!(l.check("quiet", t0), Ok(()));
        assert_eq!(l.check("quiet", t0), Ok(()));
    }

    #[test]
    fn tokens_never_accumulate_beyond_the_burst() {
        let mut l = limiter(2, 1);
        let t0 = Instant::now();
        assert_eq!(l.check("p", t0), Ok(()));
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(l.check("p", later), Ok(()));
        assert_eq!(l.check("p", later), Ok(()));
        assert!(l.check("p", later).is_err());
    }

    #[test]
    fn idle_full_buckets_are_forgotten_when_the_map_grows() {
        let mut l = limiter(1, 1);
        l.prune_at = 4;
        let t0 = Instant::now();
        for i in 0..4 {
            assert_eq!(l.check(&format!("p{i}"), t0), Ok(()));
        }
        assert_eq!(l.tracked(), 4);
        // Two seconds later every bucket is full again: pruned on the next call.
        assert_eq!(l.check("new", t0 + Duration::from_secs(2)), Ok(()));
        assert_eq!(l.tracked(), 1);
    }

    #[test]
    fn throttled_pods_are_kept_when_every_bucket_is_busy() {
        let mut l = limiter(1, 3600);
        l.prune_at = 2;
        let t0 = Instant::now();
        assert_eq!(l.check("a", t0), Ok(()));
        assert_eq!(l.check("b", t0), Ok(()));
        // "a" is empty; pruning must not reset it.
        assert_eq!(l.check("c", t0), Ok(()));
        assert!(l.check("a", t0).is_err());
    }
}
