//! What a sidecar reports about itself to the operator, outside the config
//! stream: JSON documents on its admin port that the operator reads from the
//! Pod IP. One type per document, here because both programs must agree on
//! it and neither depends on the other.

use serde::{Deserialize, Serialize};

/// Path of the offload report on the sidecar's admin port.
pub const OFFLOAD_PATH: &str = "/offload";

/// `GET /offload`: which engine signs the sidecar's TLS handshakes. The
/// operator's AcceleratorPool books read it from every Pod that holds a
/// device, so a device that fails after admission shows in the pool's
/// status, not only in the sidecar's metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct OffloadReport {
    /// `false` until the sidecar serves TLS (the engine is chosen with the
    /// first TLS context); every other field is then empty.
    pub configured: bool,
    /// `Disabled`, `Preferred` or `Required`.
    pub mode: String,
    /// The engine asked for (`openssl` for a device, `software`).
    pub requested: String,
    /// The engine that signs: `software` after a fallback.
    pub active: String,
    /// Why the requested engine is not in use (it failed its self-test at
    /// start), when it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<String>,
    /// `Required` is satisfied (always true otherwise).
    pub ready: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_ready_reason: Option<String>,
    /// Signatures the requested engine failed at run time that software
    /// redid (`Preferred`), since the process started; the reader compares
    /// two reports to see whether the device fails now.
    pub sign_errors_redone_in_software: u64,
    /// The last such failure's message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_sign_error: Option<String>,
}

impl OffloadReport {
    /// The device is not signing: the sidecar chose software at start, or
    /// signatures failed since `previous` (the reader's last report of the
    /// same process). `Some(reason)` for the pool's fallback list.
    pub fn falling_back_since(&self, previous: Option<&OffloadReport>) -> Option<String> {
        if !self.configured || self.mode == "Disabled" {
            return None;
        }
        if self.requested != "software" && self.active == "software" {
            return Some(format!(
                "EngineUnavailable: {}",
                self.fallback_reason
                    .as_deref()
                    .unwrap_or("the requested engine is not in use")
            ));
        }
        let before = previous
            .map(|p| p.sign_errors_redone_in_software)
            // A smaller count is a new process (a handoff): all of its own
            // errors are new.
            .filter(|b| *b <= self.sign_errors_redone_in_software)
            .unwrap_or(0);
        (self.sign_errors_redone_in_software > before).then(|| {
            format!(
                "SignErrors: {} signature(s) redone in software{}",
                self.sign_errors_redone_in_software - before,
                self.last_sign_error
                    .as_deref()
                    .map(|e| format!(", last: {e}"))
                    .unwrap_or_default()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn granted() -> OffloadReport {
        OffloadReport {
            configured: true,
            mode: "Preferred".into(),
            requested: "openssl".into(),
            active: "openssl".into(),
            ready: true,
            ..OffloadReport::default()
        }
    }

    #[test]
    fn a_working_device_or_no_device_is_no_fallback() {
        assert_eq!(granted().falling_back_since(None), None);
        assert_eq!(OffloadReport::default().falling_back_since(None), None);
        let software = OffloadReport {
            requested: "software".into(),
            active: "software".into(),
            ..granted()
        };
        assert_eq!(software.falling_back_since(None), None);
    }

    #[test]
    fn a_start_up_fallback_counts_with_its_reason() {
        let r = OffloadReport {
            active: "software".into(),
            fallback_reason: Some("self-test failed: no provider".into()),
            ..granted()
        };
        assert_eq!(
            r.falling_back_since(Some(&r)).as_deref(),
            Some("EngineUnavailable: self-test failed: no provider")
        );
    }

    #[test]
    fn run_time_sign_errors_count_only_while_they_grow() {
        let before = OffloadReport {
            sign_errors_redone_in_software: 3,
            ..granted()
        };
        let now = OffloadReport {
            sign_errors_redone_in_software: 5,
            last_sign_error: Some("device lost".into()),
            ..granted()
        };
        assert_eq!(
            now.falling_back_since(Some(&before)).as_deref(),
            Some("SignErrors: 2 signature(s) redone in software, last: device lost")
        );
        assert_eq!(now.falling_back_since(Some(&now)), None, "no new errors");
        // First report of a process: every error so far counts.
        assert!(now.falling_back_since(None).is_some());
        // A new process after a handoff starts its count again.
        let after_handoff = OffloadReport {
            sign_errors_redone_in_software: 1,
            ..now.clone()
        };
        assert!(after_handoff.falling_back_since(Some(&now)).is_some());
    }

    #[test]
    fn the_wire_form_is_camel_case_and_tolerates_missing_fields() {
        let json = serde_json::to_value(granted()).unwrap();
        assert_eq!(json["signErrorsRedoneInSoftware"], 0);
        assert!(json.get("fallbackReason").is_none());
        let old: OffloadReport = serde_json::from_str(r#"{"configured":false}"#).unwrap();
        assert_eq!(old, OffloadReport::default());
    }
}
