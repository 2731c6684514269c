//! The newest certificate issued to each Pod, for `kubectl baton status`
//! (the admin port's `/sidecars`): a sidecar's expiry is otherwise visible
//! only inside its Pod.
//!
//! Bounded: one entry per Pod, an entry leaves once its certificate has
//! expired (a deleted Pod's entry too), and past [`CAPACITY`] the entries
//! nearest expiry give way, so no traffic pattern grows it without limit.

use std::collections::HashMap;
use std::sync::Mutex;

use baton_crds::sidecars::Certificate;

/// Most Pods remembered (far above the 10,000 sidecars a replica serves).
pub const CAPACITY: usize = 65_536;

#[derive(Debug, Default)]
pub struct Ledger {
    by_pod: Mutex<HashMap<String, i64>>,
}

impl Ledger {
    /// Records a certificate for `pod` (`namespace/name`) valid until
    /// `not_after` (unix seconds), at `now`.
    pub fn record(&self, pod: String, not_after: i64, now: i64) {
        let mut map = self.by_pod.lock().expect("ledger lock");
        if map.len() >= CAPACITY && !map.contains_key(&pod) {
            map.retain(|_, t| *t > now);
            if map.len() >= CAPACITY {
                // Still full of live certificates: drop the nearest expiry.
                if let Some(k) = map.iter().min_by_key(|(_, t)| **t).map(|(k, _)| k.clone()) {
                    map.remove(&k);
                }
            }
        }
        let entry = map.entry(pod).or_insert(not_after);
        *entry = (*entry).max(not_after);
    }

    /// Every live entry, sorted by Pod; expired ones are dropped.
    pub fn snapshot(&self, now: i64) -> Vec<Certificate> {
        let mut map = self.by_pod.lock().expect("ledger lock");
        map.retain(|_, t| *t > now);
        let mut out: Vec<Certificate> = map
            .iter()
            .map(|(pod, t)| Certificate {
                pod: pod.clone(),
                not_after: *t,
            })
            .collect();
        out.sort_by(|a, b| a.pod.cmp(&b.pod));
        out
    }

    pub fn len(&self) -> usize {
        self.by_pod.lock().expect("ledger lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_certificate_per_pod_is_kept_and_expired_ones_leave() {
        let l = Ledger::default();
        l.record("ns/a".into(), 200, 100);
        l.record("ns/a".into(), 150, 100);
        l.record("ns/b".into(), 120, 100);
        let snap = l.snapshot(100);
        assert_eq!(
            snap.iter()
                .map(|c| (c.pod.as_str(), c.not_after))
                .collect::<Vec<_>>(),
            [("ns/a", 200), ("ns/b", 120)]
        );
        assert_eq!(l.snapshot(130).len(), 1, "ns/b expired at 120");
        assert_eq!(l.len(), 1);
    }

    #[test]
    fn it_never_grows_past_its_capacity() {
        let l = Ledger::default();
        for i in 0..CAPACITY + 100 {
            l.record(format!("ns/p{i}"), 1_000 + i as i64, 0);
        }
        assert_eq!(l.len(), CAPACITY);
        // The nearest expiries gave way to the newest Pods.
        let snap = l.snapshot(0);
        assert!(
            snap.iter()
                .any(|c| c.pod == format!("ns/p{}", CAPACITY + 99))
        );
        assert!(!snap.iter().any(|c| c.pod == "ns/p0"));
    }
}
