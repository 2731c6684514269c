//! What `upgrade`, `pause`, `resume` and `rollback` change, decided
//! without the cluster: the image for a new version, and the merge-patch
//! bodies.

use baton_crds::SidecarRelease;
use baton_crds::sidecar_release::ReleaseRevision;
use serde_json::{Value, json};

/// Why no image could be derived for a version (the user passes `--image`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error(
        "the release's image {image:?} is pinned by digest, so no image for {version} can be derived from it: pass --image (e.g. --image {repo}:{version})"
    )]
    Digest {
        image: String,
        repo: String,
        version: String,
    },
    #[error(
        "the release's image {image:?} has no tag to replace with {version}: pass --image (e.g. --image {image}:{version})"
    )]
    NoTag { image: String, version: String },
}

/// `image` with its tag moved from `current` to `version`.
///
/// The tag is what follows the last `:` of the last path segment, so a
/// registry port (`host:5000/baton/sidecar:0.1.0`) is not mistaken for one.
/// When the tag contains `current` (`v0.1.0`, `0.1.0-distroless`) only that
/// part changes, keeping the prefix or suffix; otherwise the whole tag
/// becomes `version`. Digest-pinned and untagged images are refused: the
/// new image cannot be known.
pub fn image_for(image: &str, current: &str, version: &str) -> Result<String, ImageError> {
    let image = image.trim();
    let (name, digest) = match image.split_once('@') {
        Some((n, d)) => (n, Some(d)),
        None => (image, None),
    };
    let last = name.rfind('/').map_or(0, |i| i + 1);
    let tag_at = name[last..].rfind(':').map(|i| last + i);
    let repo = tag_at.map_or(name, |i| &name[..i]);
    if digest.is_some() {
        return Err(ImageError::Digest {
            image: image.to_owned(),
            repo: repo.to_owned(),
            version: version.to_owned(),
        });
    }
    let tag = match tag_at {
        Some(i) if i + 1 < name.len() => &name[i + 1..],
        _ => {
            return Err(ImageError::NoTag {
                image: repo.to_owned(),
                version: version.to_owned(),
            });
        }
    };
    let new_tag = if !current.is_empty() && tag.contains(current) {
        tag.replacen(current, version, 1)
    } else {
        version.to_owned()
    };
    Ok(format!("{repo}:{new_tag}"))
}

/// Merge patch moving the release to `version` and `image`.
pub fn upgrade_patch(version: &str, image: &str) -> Value {
    json!({"spec": {"version": version, "image": image}})
}

/// Merge patch setting `spec.upgrade.paused`.
pub fn pause_patch(paused: bool) -> Value {
    json!({"spec": {"upgrade": {"paused": paused}}})
}

/// Merge patch returning the release to `to`; `emptyImage` only when the
/// history recorded one (otherwise the current one stays).
pub fn rollback_patch(to: &ReleaseRevision) -> Value {
    let mut spec = json!({"version": to.version, "image": to.image});
    if let Some(empty) = &to.empty_image {
        spec["emptyImage"] = json!(empty);
    }
    json!({ "spec": spec })
}

/// Where `rollback` goes: the newest completed version other than the
/// current one, or an error that says what the history holds.
pub fn rollback_target(release: &SidecarRelease) -> anyhow::Result<ReleaseRevision> {
    let name = release.metadata.name.as_deref().unwrap_or_default();
    let status = release.status.clone().unwrap_or_default();
    if let Some(to) = status.previous(&release.spec.version) {
        return Ok(to.clone());
    }
    let held = if status.history.is_empty() {
        "status.history is empty (no rollout has completed yet)".to_owned()
    } else {
        let versions: Vec<&str> = status.history.iter().map(|r| r.version.as_str()).collect();
        format!(
            "status.history holds only {} (the current version)",
            versions.join(", ")
        )
    };
    anyhow::bail!(
        "sidecarrelease/{name} has no earlier completed version to roll back to: {held}; \
         use `kubectl baton upgrade {name} --version V --image I` to choose one"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_crds::{SidecarReleaseSpec, SidecarReleaseStatus};

    #[test]
    fn the_tag_is_replaced_and_registry_ports_are_not_tags() {
        let cases = [
            (
                "docker.io/baton/sidecar:0.1.0",
                "docker.io/baton/sidecar:0.2.0",
            ),
            (
                "host:5000/baton/sidecar:0.1.0",
                "host:5000/baton/sidecar:0.2.0",
            ),
            (
                "localhost:5000/sidecar:latest",
                "localhost:5000/sidecar:0.2.0",
            ),
            ("sidecar:v0.1.0", "sidecar:v0.2.0"),
            (
                "ghcr.io/b/sidecar:0.1.0-distroless",
                "ghcr.io/b/sidecar:0.2.0-distroless",
            ),
            ("sidecar:e2e-v1", "sidecar:0.2.0"),
        ];
        for (from, want) in cases {
            assert_eq!(
                image_for(from, "0.1.0", "0.2.0").as_deref(),
                Ok(want),
                "{from}"
            );
        }
    }

    #[test]
    fn digests_and_untagged_images_are_refused_with_a_hint() {
        let e = image_for("host:5000/baton/sidecar@sha256:abcd", "0.1.0", "0.2.0").unwrap_err();
        assert!(matches!(e, ImageError::Digest { .. }));
        let msg = e.to_string();
        assert!(msg.contains("pinned by digest"), "{msg}");
        assert!(
            msg.contains("--image host:5000/baton/sidecar:0.2.0"),
            "{msg}"
        );

        let e = image_for("sidecar:0.1.0@sha256:abcd", "0.1.0", "0.2.0").unwrap_err();
        assert!(e.to_string().contains("--image sidecar:0.2.0"), "{e}");

        for untagged in ["host:5000/baton/sidecar", "sidecar", "sidecar:"] {
            let e = image_for(untagged, "0.1.0", "0.2.0").unwrap_err();
            assert!(matches!(e, ImageError::NoTag { .. }), "{untagged}");
            assert!(e.to_string().contains("pass --image"), "{e}");
        }
    }

    #[test]
    fn patch_bodies_touch_only_what_the_command_changes() {
        assert_eq!(
            upgrade_patch("0.2.0", "s:0.2.0"),
            json!({"spec": {"version": "0.2.0", "image": "s:0.2.0"}})
        );
        assert_eq!(
            pause_patch(true),
            json!({"spec": {"upgrade": {"paused": true}}})
        );
        assert_eq!(
            pause_patch(false),
            json!({"spec": {"upgrade": {"paused": false}}})
        );
        let with_empty = ReleaseRevision {
            version: "0.1.0".into(),
            image: "s:0.1.0".into(),
            empty_image: Some("e:1".into()),
        };
        assert_eq!(
            rollback_patch(&with_empty),
            json!({"spec": {"version": "0.1.0", "image": "s:0.1.0", "emptyImage": "e:1"}})
        );
        let without = ReleaseRevision {
            empty_image: None,
            ..with_empty
        };
        assert_eq!(
            rollback_patch(&without),
            json!({"spec": {"version": "0.1.0", "image": "s:0.1.0"}})
        );
    }

    fn release(version: &str, history: &[&str]) -> SidecarRelease {
        let spec: SidecarReleaseSpec = serde_json::from_value(json!({
            "version": version, "image": format!("s:{version}"), "emptyImage": "e:1"
        }))
        .unwrap();
        let mut r = SidecarRelease::new("default", spec);
        r.status = Some(SidecarReleaseStatus {
            history: history
                .iter()
                .map(|v| ReleaseRevision {
                    version: (*v).into(),
                    image: format!("s:{v}"),
                    empty_image: None,
                })
                .collect(),
            ..Default::default()
        });
        r
    }

    #[test]
    fn rollback_goes_to_the_newest_other_completed_version() {
        // Mid-rollout to 0.3.0 (not yet completed): back to 0.2.0.
        let to = rollback_target(&release("0.3.0", &["0.2.0", "0.1.0"])).unwrap();
        assert_eq!(to.version, "0.2.0");
        // 0.2.0 completed: back to 0.1.0.
        let to = rollback_target(&release("0.2.0", &["0.2.0", "0.1.0"])).unwrap();
        assert_eq!(to.version, "0.1.0");
    }

    #[test]
    fn rollback_without_an_earlier_version_says_what_history_holds() {
        let e = rollback_target(&release("0.1.0", &["0.1.0"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "sidecarrelease/default has no earlier completed version to roll back to"
            ),
            "{e}"
        );
        assert!(e.contains("holds only 0.1.0"), "{e}");
        let e = rollback_target(&release("0.1.0", &[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("status.history is empty"), "{e}");
    }
}
