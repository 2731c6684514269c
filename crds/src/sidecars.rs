//! The operator's `/sidecars` report (admin port): what each replica knows
//! of the sidecars connected to its config push streams, read by `kubectl
//! baton status` through the API server's Pod proxy, like `istioctl
//! proxy-status` reads istiod. Each replica reports only its own streams;
//! a reader merges the replicas' reports.

use serde::{Deserialize, Serialize};

/// Admin path of the report on every operator replica.
pub const PATH: &str = "/sidecars";

/// One replica's report.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// Whether the replica's config push is on (off: no stream, no state).
    pub config_push: bool,
    /// One entry per connected sidecar, sorted by Pod.
    #[serde(default)]
    pub sidecars: Vec<Sidecar>,
    /// Certificates the replica's identity service issued, by Pod (the
    /// newest each), sorted by Pod.
    #[serde(default)]
    pub certificates: Vec<Certificate>,
}

/// A sidecar's config stream.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sidecar {
    /// `namespace/name`.
    pub pod: String,
    /// The config generation the replica last sent on this stream.
    pub sent: u64,
    /// The generation the sidecar last ACKed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acked: Option<u64>,
    /// The last NACK's error, until the next ACK.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nack: Option<String>,
}

/// The newest certificate issued to a Pod.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Certificate {
    /// `namespace/name`.
    pub pod: String,
    /// Expiry, unix seconds.
    pub not_after: i64,
}

/// A sidecar's config as `kubectl baton status` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Sync {
    /// It ACKed the newest config sent to it.
    Synced,
    /// It refused (NACK) the newest config, or has not ACKed it yet; it
    /// serves its last good config.
    Stale,
    /// No replica holds a stream for it: nothing was sent.
    NotSent,
}

impl Sync {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Synced => "SYNCED",
            Self::Stale => "STALE",
            Self::NotSent => "NOT SENT",
        }
    }
}

impl Sidecar {
    /// This stream's verdict.
    pub fn sync(&self) -> Sync {
        if self.nack.is_none() && self.acked == Some(self.sent) {
            Sync::Synced
        } else {
            Sync::Stale
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_is_synced_only_when_its_newest_push_is_acked() {
        let s = |sent, acked, nack: Option<&str>| Sidecar {
            pod: "ns/p".into(),
            sent,
            acked,
            nack: nack.map(str::to_owned),
        };
        assert_eq!(s(3, Some(3), None).sync(), Sync::Synced);
        assert_eq!(s(4, Some(3), None).sync(), Sync::Stale);
        assert_eq!(s(3, None, None).sync(), Sync::Stale);
        assert_eq!(s(4, Some(3), Some("bad route")).sync(), Sync::Stale);
    }

    #[test]
    fn the_report_reads_back_what_it_writes() {
        let r = Report {
            config_push: true,
            sidecars: vec![Sidecar {
                pod: "a/b".into(),
                sent: 2,
                acked: Some(2),
                nack: None,
            }],
            certificates: vec![Certificate {
                pod: "a/b".into(),
                not_after: 1_800_000_000,
            }],
        };
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"configPush\":true"), "{json}");
        assert!(json.contains("\"notAfter\":1800000000"), "{json}");
        assert_eq!(serde_json::from_str::<Report>(&json).unwrap(), r);
    }
}
