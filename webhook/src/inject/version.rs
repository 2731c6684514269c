//! The API server's version, which decides how sidecars are injected.

use std::fmt;

/// `major.minor` of the API server, as `/version` reports it (`"20+"` on
/// some distributions: trailing non-digits are ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServerVersion {
    pub major: u32,
    pub minor: u32,
}

/// First minor where the webhook injects native sidecars (init containers
/// with `restartPolicy: Always`): not 1.29, where they appear, but the first
/// whose kubelet swaps a native sidecar's image in place, so that a hot
/// upgrade stays a hot upgrade and never turns into an eviction
/// ([`baton_crds::contract::kubernetes::NATIVE_SIDECAR_IMAGE_UPDATE_SINCE`]).
/// From 1.29 to 1.31 sidecars are ordinary containers, as before 1.29.
pub const NATIVE_SIDECARS_SINCE: ServerVersion = ServerVersion {
    major: baton_crds::contract::kubernetes::NATIVE_SIDECAR_IMAGE_UPDATE_SINCE.0,
    minor: baton_crds::contract::kubernetes::NATIVE_SIDECAR_IMAGE_UPDATE_SINCE.1,
};

impl ServerVersion {
    pub const fn new(major: u32, minor: u32) -> Self {
        Self { major, minor }
    }

    /// Parses `/version`'s `major` and `minor` fields.
    pub fn parse(major: &str, minor: &str) -> Option<Self> {
        let digits = |s: &str| -> Option<u32> {
            let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            s[..end].parse().ok()
        };
        Some(Self::new(digits(major)?, digits(minor)?))
    }

    pub fn supports_native_sidecars(self) -> bool {
        self >= NATIVE_SIDECARS_SINCE
    }
}

impl fmt::Display for ServerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_plus_suffixed_minors() {
        assert_eq!(
            ServerVersion::parse("1", "20"),
            Some(ServerVersion::new(1, 20))
        );
        assert_eq!(
            ServerVersion::parse("1", "29+"),
            Some(ServerVersion::new(1, 29))
        );
        assert_eq!(ServerVersion::parse("", "29"), None);
        assert_eq!(ServerVersion::parse("1", "x"), None);
    }

    /// `/version` as API servers answer it (the fields the webhook reads;
    /// managed offerings add a `+` and a vendor suffix to `gitVersion`).
    #[test]
    fn recorded_version_answers_decide_the_injection_mode() {
        let recorded = [
            (
                r#"{"major":"1","minor":"20","gitVersion":"v1.20.15","platform":"linux/amd64"}"#,
                false,
            ),
            (
                r#"{"major":"1","minor":"29","gitVersion":"v1.29.10","platform":"linux/amd64"}"#,
                false,
            ),
            (
                r#"{"major":"1","minor":"30+","gitVersion":"v1.30.6-eks-7f9249a","platform":"linux/amd64"}"#,
                false,
            ),
            (
                r#"{"major":"1","minor":"31","gitVersion":"v1.31.3-gke.1006000","platform":"linux/amd64"}"#,
                false,
            ),
            (
                r#"{"major":"1","minor":"32","gitVersion":"v1.32.0","platform":"linux/amd64"}"#,
                true,
            ),
            (
                r#"{"major":"1","minor":"33+","gitVersion":"v1.33.1+k3s1","platform":"linux/amd64"}"#,
                true,
            ),
        ];
        for (json, native) in recorded {
            let info: serde_json::Value = serde_json::from_str(json).unwrap();
            let v = ServerVersion::parse(
                info["major"].as_str().unwrap(),
                info["minor"].as_str().unwrap(),
            )
            .unwrap();
            assert_eq!(v.supports_native_sidecars(), native, "{json}");
        }
    }

    #[test]
    fn native_sidecars_start_where_the_kubelet_swaps_their_image_in_place() {
        // 1.29–1.31 have native sidecars, but a hot upgrade of one would be
        // an eviction there: ordinary containers.
        for minor in [20, 28, 29, 30, 31] {
            assert!(
                !ServerVersion::new(1, minor).supports_native_sidecars(),
                "1.{minor}"
            );
        }
        for minor in [32, 33, 34] {
            assert!(
                ServerVersion::new(1, minor).supports_native_sidecars(),
                "1.{minor}"
            );
        }
        assert!(ServerVersion::new(2, 0).supports_native_sidecars());
    }
}
