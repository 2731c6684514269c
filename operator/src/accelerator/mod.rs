//! AcceleratorPool: the books of scarce QAT devices. [`accounting`] is the
//! pure heart (pool, nodes, pods → status); [`controller`] feeds it from
//! watch caches, writes the status and publishes fallback Events.

pub mod accounting;
pub mod controller;
pub mod probe;
