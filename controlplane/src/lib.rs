//! `baton-controlplane`: what the webhook and the operator share that
//! talks to the API server, each concern in one place with its tests.
//!
//! ```text
//! ca_secret  a CA kept in a Secret: read, write, create-or-adopt (two
//!            replicas starting at once end with one CA), rotate under a
//!            resourceVersion precondition, re-read on change
//! compact    a watch-backed cache of one small value per object, computed
//!            when its event arrives (not the object: every Pod's books)
//! reflect    a reflector-backed cache of one kind, trimmed, with a wake-up
//!            per change and a stop signal
//! testing    (feature `testing`) kube's tower-test mock API server: expect
//!            a request, answer it, API Status bodies
//! ```
//!
//! What each CA is (the webhook's self-rotating serving CA, the operator's
//! mesh root or plug-in intermediate) stays with its owner: this crate
//! knows only where the PEM texts live and how replicas agree on them.

pub mod ca_secret;
pub mod compact;
pub mod reflect;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
