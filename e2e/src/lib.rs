//! End-to-end test support for Baton against a real local Kubernetes 1.20
//! (built by `e2e/cluster.sh`), plus the demo applications that run in e2e
//! pods (`demo-http-echo`, `demo-tcp-echo`, `demo-load`, `demo-fetch`).
//!
//! The model is linkerd2's `policy-test` crate: each test runs inside
//! [`with_temp_ns`] (a fresh namespace, a tracing span, a dump of pods, events
//! and logs when it fails, the namespace deleted afterwards), asserts
//! admission with [`accepts`] / [`rejects`], waits with [`wait_for`], and
//! drives real traffic with [`traffic`] against pod IPs on the cluster's
//! private bridge.
//!
//! The tests in `e2e/tests/` are `#[ignore]`d so `cargo test --workspace`
//! stays cluster-free (they show up as "ignored"); `e2e/run.sh` brings the
//! cluster up, runs them with `--ignored` and always tears it down. They read
//! the cluster's kubeconfig from `BATON_E2E_KUBECONFIG` only.

pub mod admin;
pub mod admission;
pub mod cli;
pub mod cluster;
pub mod demo;
pub mod fetch;
pub mod guards;
pub mod install;
pub mod meshed;
pub mod netns;
pub mod ns;
pub mod pods;
pub mod rbac;
pub mod rollout;
pub mod traffic;
pub mod wait;

pub use admission::{accepts, creates, refuses, rejects};
pub use cluster::{client, kubectl, kubectl_ok};
pub use ns::{with_temp_ns, with_temp_ns_labelled};
pub use wait::{Check, wait_for};
