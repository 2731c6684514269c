//! The API server's version, which decides how sidecars are injected.

use std::fmt;

/// `major.minor` of the API server, as `/version` reports it (`"20+"` on
/// some distributions: trailing non-digits are ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServerVersion {
    pub major: u32,
    pub minor: u32,
}

/// First minor with native sidecars (init containers with
/// `restartPolicy: Always`) enabled by default (beta in 1.29, GA in 1.33).
pub const NATIVE_SIDECARS_SINCE: ServerVersion = ServerVersion {
    major: 1,
    minor: 29,
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

    #[test]
    fn native_sidecars_start_at_1_29() {
        assert!(!ServerVersion::new(1, 20).supports_native_sidecars());
        assert!(!ServerVersion::new(1, 28).supports_native_sidecars());
        assert!(ServerVersion::new(1, 29).supports_native_sidecars());
        assert!(ServerVersion::new(2, 0).supports_native_sidecars());
    }
}
