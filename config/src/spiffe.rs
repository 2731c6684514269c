//! SPIFFE identities of mesh workloads:
//! `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`, carried in
//! the URI SAN of every mesh certificate and named in the `tls` section, in
//! a cluster's `mtls.identity` and in RBAC rules.
//!
//! Parsing is strict (one shape only) because the identity is an
//! authorization input: RBAC filters compare it, so two spellings of the same
//! workload must not exist. Reading identities out of a certificate needs an
//! X.509 parser and lives in the sidecar.

use std::fmt;
use std::str::FromStr;

/// A verified or expected workload identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpiffeId {
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
}

/// Why a string is not a mesh SPIFFE ID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpiffeError {
    #[error("not a spiffe:// URI")]
    Scheme,
    #[error("invalid trust domain")]
    TrustDomain,
    #[error("path must be /ns/<namespace>/sa/<service-account>")]
    Path,
    #[error("invalid name {0:?}: lowercase letters, digits, '-' and '.', at most 253 characters")]
    Name(String),
}

/// A trust domain as SPIFFE allows it: lowercase letters, digits, `.`, `-`
/// and `_`, at most 255 characters.
pub fn valid_trust_domain(td: &str) -> bool {
    !td.is_empty()
        && td.len() <= 255
        && td
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(&b))
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 253
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.".contains(&b))
}

impl SpiffeId {
    pub fn new(
        trust_domain: &str,
        namespace: &str,
        service_account: &str,
    ) -> Result<Self, SpiffeError> {
        format!("spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}").parse()
    }
}

impl FromStr for SpiffeId {
    type Err = SpiffeError;
    fn from_str(s: &str) -> Result<Self, SpiffeError> {
        let rest = s.strip_prefix("spiffe://").ok_or(SpiffeError::Scheme)?;
        let (td, path) = rest.split_once('/').ok_or(SpiffeError::Path)?;
        if !valid_trust_domain(td) {
            return Err(SpiffeError::TrustDomain);
        }
        let parts: Vec<&str> = path.split('/').collect();
        match parts.as_slice() {
            ["ns", ns, "sa", sa] => {
                for n in [ns, sa] {
                    if !valid_name(n) {
                        return Err(SpiffeError::Name(n.to_string()));
                    }
                }
                Ok(SpiffeId {
                    trust_domain: td.to_string(),
                    namespace: ns.to_string(),
                    service_account: sa.to_string(),
                })
            }
            _ => Err(SpiffeError::Path),
        }
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_well_formed_identity_round_trips() {
        let s = "spiffe://cluster.local/ns/default/sa/reviews";
        let id: SpiffeId = s.parse().unwrap();
        assert_eq!(id.namespace, "default");
        assert_eq!(id.service_account, "reviews");
        assert_eq!(id.to_string(), s);
    }

    #[test]
    fn malformed_identities_are_refused() {
        for bad in [
            "http://cluster.local/ns/a/sa/b",
            "spiffe://cluster.local",
            "spiffe:///ns/a/sa/b",
            "spiffe://Cluster.Local/ns/a/sa/b",
            "spiffe://cluster.local/ns/a/sa/b/extra",
            "spiffe://cluster.local/sa/b/ns/a",
            "spiffe://cluster.local/ns//sa/b",
            "spiffe://cluster.local/ns/A/sa/b",
            "spiffe://cluster.local/ns/a/sa/b?x=1",
        ] {
            assert!(bad.parse::<SpiffeId>().is_err(), "{bad} accepted");
        }
    }
}
