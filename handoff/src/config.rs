//! Where and how a process hands off ([`HandoffConfig`], read from the
//! environment the webhook injects), and who may take over from it
//! ([`peer_allowed`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use baton_contract as contract;

use crate::conn::SessionDetach;
use crate::plane::IdentityCarrier;
use crate::protocol::VersionRange;

/// Where and how this process hands off.
#[derive(Clone)]
pub struct HandoffConfig {
    pub socket: PathBuf,
    pub status_file: PathBuf,
    /// Longest wait for the peer's next step before the handoff fails.
    pub step_timeout: Duration,
    /// Longest wait for in-flight requests to reach a safe point.
    pub park_timeout: Duration,
    pub versions: VersionRange,
    pub sidecar_version: String,
    /// Testing knob (0 in production): pause before each adoption step.
    pub test_step_delay: Duration,
    /// Carries the certificate and key across (the TLS layer).
    pub identity: Option<Arc<dyn IdentityCarrier>>,
    /// Takes parked TLS sessions apart so they can move (the TLS layer);
    /// without it a boxed (TLS) connection finishes in this process.
    pub sessions: Option<Arc<dyn SessionDetach>>,
    /// UIDs besides this process's effective UID that may take over on the
    /// handoff socket (see [`peer_allowed`]); empty in the injected Pod.
    pub peer_uids: Vec<u32>,
    /// Why this process must not take over from a live sidecar (offload
    /// Required but no working engine in this slot, e.g. the device is
    /// held by the other slot's container): it then leaves the serving
    /// sidecar untouched and the process main loop fails with the reason.
    pub adopt_refusal: Option<String>,
}

impl std::fmt::Debug for HandoffConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandoffConfig")
            .field("socket", &self.socket)
            .field("status_file", &self.status_file)
            .field("step_timeout", &self.step_timeout)
            .field("park_timeout", &self.park_timeout)
            .field("versions", &self.versions)
            .field("identity", &self.identity.is_some())
            .field("peer_uids", &self.peer_uids)
            .field("adopt_refusal", &self.adopt_refusal)
            .finish_non_exhaustive()
    }
}

impl HandoffConfig {
    /// Paths and timeouts from the environment (see `contract::env`),
    /// defaulting to the shared volume's paths; `sidecar_version` is the
    /// release this process runs (what the peer logs and the status shows).
    pub fn from_env(sidecar_version: &str) -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let ms = |k: &str, d: u64| {
            Duration::from_millis(var(k).and_then(|v| v.parse().ok()).unwrap_or(d))
        };
        let versions = var(contract::env::HANDOFF_PROTOCOL_RANGE)
            .and_then(|v| {
                let (a, b) = v.split_once('-')?;
                Some(VersionRange {
                    min: a.trim().parse().ok()?,
                    max: b.trim().parse().ok()?,
                })
            })
            .unwrap_or_else(VersionRange::this_build);
        Self {
            socket: var(contract::env::HANDOFF_SOCKET)
                .unwrap_or_else(|| contract::volumes::HANDOFF_SOCKET.into())
                .into(),
            status_file: var(contract::env::HANDOFF_STATUS_FILE)
                .unwrap_or_else(|| contract::volumes::HANDOFF_STATUS_FILE.into())
                .into(),
            step_timeout: ms(contract::env::HANDOFF_TIMEOUT_MS, 10_000),
            park_timeout: ms(contract::env::HANDOFF_PARK_TIMEOUT_MS, 30_000),
            versions,
            sidecar_version: sidecar_version.to_string(),
            test_step_delay: ms(contract::env::HANDOFF_TEST_STEP_DELAY_MS, 0),
            identity: None,
            sessions: None,
            peer_uids: var(contract::env::HANDOFF_PEER_UIDS)
                .map(|v| parse_uids(&v))
                .unwrap_or_default(),
            adopt_refusal: None,
        }
    }

    pub fn with_identity(mut self, identity: Arc<dyn IdentityCarrier>) -> Self {
        self.identity = Some(identity);
        self
    }

    pub fn with_sessions(mut self, sessions: Arc<dyn SessionDetach>) -> Self {
        self.sessions = Some(sessions);
        self
    }

    /// See [`HandoffConfig::adopt_refusal`].
    pub fn with_adopt_refusal(mut self, reason: Option<String>) -> Self {
        self.adopt_refusal = reason;
        self
    }
}

/// Pure: the UIDs of `BATON_HANDOFF_PEER_UIDS`. An entry that is not a
/// number is logged and ignored (it can only narrow who may take over).
fn parse_uids(v: &str) -> Vec<u32> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .filter_map(|s| match s.parse() {
            Ok(uid) => Some(uid),
            Err(_) => {
                tracing::warn!(
                    entry = s,
                    "{}: not a UID; ignored",
                    contract::env::HANDOFF_PEER_UIDS
                );
                None
            }
        })
        .collect()
}

/// Pure: whether a process with `peer_uid` may take over from a sidecar
/// running as `own_uid`. Whoever completes a handoff receives every live
/// connection, the TLS session keys and the mesh private key, so only the
/// sidecar's own UID (and UIDs listed explicitly) may; an application
/// container that mounts the shared volume runs under another UID.
pub fn peer_allowed(peer_uid: u32, own_uid: u32, extra: &[u32]) -> bool {
    peer_uid == own_uid || extra.contains(&peer_uid)
}

#[cfg(test)]
mod tests {
    use tokio::net::UnixStream;

    use super::*;

    #[test]
    fn only_the_sidecars_own_uid_and_listed_uids_may_take_over() {
        assert!(peer_allowed(1337, 1337, &[]));
        assert!(!peer_allowed(1000, 1337, &[]));
        // Root is no exception: an application container running as root
        // is exactly who must not pull the keys out.
        assert!(!peer_allowed(0, 1337, &[]));
        assert!(peer_allowed(1338, 1337, &[1338]));
        assert!(!peer_allowed(1000, 1337, &[1338]));
        assert_eq!(parse_uids(" 1338, x,,0 "), vec![1338, 0]);
    }

    #[tokio::test]
    async fn a_socket_from_this_process_carries_its_own_uid_so_a_successor_passes() {
        // Our own UID passes the check; the refusal path is covered with a
        // real process under another UID in sidecar/tests/admin_access.rs.
        let (a, _b) = UnixStream::pair().unwrap();
        let c = a.peer_cred().unwrap();
        assert!(peer_allowed(c.uid(), nix::unistd::geteuid().as_raw(), &[]));
    }

    #[test]
    fn the_test_knobs_default_to_off_and_the_contract_paths() {
        let c = HandoffConfig::from_env("test");
        if std::env::var(contract::env::HANDOFF_SOCKET).is_err() {
            assert_eq!(c.socket, PathBuf::from(contract::volumes::HANDOFF_SOCKET));
        }
        if std::env::var(contract::env::HANDOFF_PROTOCOL_RANGE).is_err() {
            assert_eq!(c.versions, VersionRange::this_build());
        }
    }
}
