//! `kubectl baton upgrade | pause | resume | rollback`: patch a
//! SidecarRelease (a JSON merge patch of the fields the command owns) and,
//! with `--watch`, follow the rollout until the operator reports it
//! Complete (exit 0) or Paused / Degraded (exit 1, with the reason and the
//! failed pods).
//!
//! ```text
//! plan.rs   the image for a new version, the patch bodies, the rollback target
//! watch.rs  the verdict and progress text from a release; the polling loop
//! ```

pub mod plan;
pub mod watch;

use std::time::Duration;

use anyhow::anyhow;
use baton_crds::SidecarRelease;
use baton_crds::conditions::{self, sidecar_release as cond};
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::Value;

use crate::{Ctx, Format, Outcome, output};
use watch::{Goal, Sink, Watch};

/// Field manager recorded in `managedFields` for the CLI's patches.
pub const FIELD_MANAGER: &str = "kubectl-baton";

#[derive(Debug, clap::Args)]
pub struct UpgradeArgs {
    /// The SidecarRelease (cluster-scoped).
    pub release: String,
    /// Sidecar version to roll out.
    #[arg(long)]
    pub version: String,
    /// Sidecar image (default: the release's image with its tag set to
    /// `--version`).
    #[arg(long)]
    pub image: Option<String>,
    #[command(flatten)]
    pub watch: WatchArgs,
}

#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    /// The SidecarRelease (cluster-scoped).
    pub release: String,
    #[command(flatten)]
    pub watch: WatchArgs,
}

#[derive(Debug, Clone, clap::Args)]
pub struct WatchArgs {
    /// Follow the rollout until it is Complete (exit 0) or Paused /
    /// Degraded (exit 1, with the reason). With `pause`: until the
    /// operator reports the release Paused.
    #[arg(long, short = 'w')]
    pub watch: bool,
    /// Bound on `--watch`.
    #[arg(long, default_value = "10m", value_parser = crate::parse_duration)]
    pub watch_timeout: Duration,
}

pub async fn upgrade(ctx: &Ctx, args: UpgradeArgs) -> anyhow::Result<Outcome> {
    let api = api(ctx).await?;
    let name = args.release.as_str();
    let r = get(ctx, &api, name).await?;
    let from = r.spec.version.clone();
    let image = match &args.image {
        Some(i) => i.clone(),
        None if args.version == from => r.spec.image.clone(),
        None => plan::image_for(&r.spec.image, &from, &args.version)?,
    };
    let mut sink = sink(ctx);
    let r = if args.version == from && image == r.spec.image {
        sink.line(&format!(
            "sidecarrelease/{name}: already at {from} (image {image}); nothing to change"
        ));
        r
    } else {
        let r = patch(ctx, &api, name, plan::upgrade_patch(&args.version, &image)).await?;
        sink.line(&format!(
            "sidecarrelease/{name}: {from} → {} (image {image})",
            args.version
        ));
        r
    };
    warn_paused(&r);
    finish(ctx, &api, name, r, &args.watch, Goal::Rollout, sink).await
}

/// `pause` (`paused` true) and `resume` (false).
pub async fn pause(ctx: &Ctx, args: ReleaseArgs, paused: bool) -> anyhow::Result<Outcome> {
    let api = api(ctx).await?;
    let name = args.release.as_str();
    let r = get(ctx, &api, name).await?;
    let mut sink = sink(ctx);
    let r = if r.spec.upgrade.paused == paused {
        let state = if paused { "paused" } else { "not paused" };
        sink.line(&format!(
            "sidecarrelease/{name}: already {state} (spec.upgrade.paused is {paused}); nothing to change"
        ));
        r
    } else {
        let r = patch(ctx, &api, name, plan::pause_patch(paused)).await?;
        sink.line(&if paused {
            format!(
                "sidecarrelease/{name}: paused (spec.upgrade.paused false → true): the operator moves no further pods to {}; handoffs in flight finish",
                r.spec.version
            )
        } else {
            format!(
                "sidecarrelease/{name}: resumed (spec.upgrade.paused true → false): the operator goes on rolling out {}",
                r.spec.version
            )
        });
        r
    };
    if !paused {
        note_self_pause(&r);
    }
    let goal = if paused { Goal::Pause } else { Goal::Rollout };
    finish(ctx, &api, name, r, &args.watch, goal, sink).await
}

pub async fn rollback(ctx: &Ctx, args: ReleaseArgs) -> anyhow::Result<Outcome> {
    let api = api(ctx).await?;
    let name = args.release.as_str();
    let r = get(ctx, &api, name).await?;
    let to = plan::rollback_target(&r)?;
    let from = r.spec.version.clone();
    let r = patch(ctx, &api, name, plan::rollback_patch(&to)).await?;
    let mut sink = sink(ctx);
    let empty = to
        .empty_image
        .as_deref()
        .map(|e| format!(", empty image {e}"))
        .unwrap_or_default();
    sink.line(&format!(
        "sidecarrelease/{name}: rolled back {from} → {} (image {}{empty})",
        to.version, to.image
    ));
    warn_paused(&r);
    finish(ctx, &api, name, r, &args.watch, Goal::Rollout, sink).await
}

/// With `--watch`, follows the release; then prints it for `-o json|yaml`.
async fn finish(
    ctx: &Ctx,
    api: &Api<SidecarRelease>,
    name: &str,
    r: SidecarRelease,
    args: &WatchArgs,
    goal: Goal,
    mut sink: Sink,
) -> anyhow::Result<Outcome> {
    let (outcome, r) = if args.watch {
        let w = Watch::new(goal, args.watch_timeout);
        let (outcome, last) = watch::follow(ctx, api, name, &w, &mut sink).await?;
        (outcome, last.unwrap_or(r))
    } else {
        (Outcome::Success, r)
    };
    if let Some(text) = output::structured(ctx.output(), &r)? {
        print!("{text}");
    }
    Ok(outcome)
}

/// Human lines go to stdout, or to stderr when stdout carries `-o json|yaml`.
fn sink(ctx: &Ctx) -> Sink {
    if ctx.output() == Format::Table {
        Sink::Stdout
    } else {
        Sink::Stderr
    }
}

fn warn_paused(r: &SidecarRelease) {
    if r.spec.upgrade.paused {
        let name = r.metadata.name.as_deref().unwrap_or_default();
        eprintln!(
            "warning: sidecarrelease/{name} is paused: the rollout will not start until `kubectl baton resume {name}`"
        );
    }
}

/// `resume` does not clear the operator's own pause: say what does.
fn note_self_pause(r: &SidecarRelease) {
    let Some(c) = r.status.as_ref().and_then(|s| {
        s.conditions.iter().find(|c| {
            c.type_ == cond::PAUSED
                && c.status == conditions::TRUE
                && c.reason == cond::reasons::FAILURE_THRESHOLD
        })
    }) else {
        return;
    };
    let name = r.metadata.name.as_deref().unwrap_or_default();
    eprintln!(
        "note: sidecarrelease/{name} paused itself ({}): resume does not lift that; `kubectl baton rollback {name}`, or fix the image and retry the failed pods. {}",
        c.reason, c.message
    );
}

async fn api(ctx: &Ctx) -> anyhow::Result<Api<SidecarRelease>> {
    Ok(Api::all(ctx.client().await?))
}

/// GET within `--timeout`, with a plain error when the release does not
/// exist or the caller may not read it.
pub(crate) async fn get(
    ctx: &Ctx,
    api: &Api<SidecarRelease>,
    name: &str,
) -> anyhow::Result<SidecarRelease> {
    ctx.bounded(&format!("get sidecarrelease {name:?}"), async {
        api.get(name).await.map_err(|e| api_error(e, "get", name))
    })
    .await
}

/// Merge patch within `--timeout`.
async fn patch(
    ctx: &Ctx,
    api: &Api<SidecarRelease>,
    name: &str,
    body: Value,
) -> anyhow::Result<SidecarRelease> {
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    ctx.bounded(&format!("patch sidecarrelease {name:?}"), async {
        api.patch(name, &params, &Patch::Merge(&body))
            .await
            .map_err(|e| api_error(e, "patch", name))
    })
    .await
}

/// Marks errors that say the release does not exist.
#[derive(Debug, thiserror::Error)]
#[error("sidecarrelease {0:?} not found (kubectl get sidecarreleases lists them)")]
pub struct NotFound(pub String);

pub(crate) fn is_not_found(e: &anyhow::Error) -> bool {
    e.downcast_ref::<NotFound>().is_some()
}

fn api_error(e: kube::Error, verb: &str, name: &str) -> anyhow::Error {
    match e {
        kube::Error::Api(s) if s.is_not_found() => NotFound(name.to_owned()).into(),
        kube::Error::Api(s) if s.code == 403 => anyhow!(
            "cannot {verb} sidecarrelease {name:?}: forbidden ({}); these commands need get and patch on sidecarreleases.baton.dev",
            s.message
        ),
        kube::Error::Api(s) if s.code == 422 => anyhow!(
            "the API server refused the change to sidecarrelease {name:?}: {}",
            s.message
        ),
        e @ (kube::Error::Service(_) | kube::Error::HyperError(_)) => anyhow::Error::new(e)
            .context(format!(
                "{verb} sidecarrelease {name:?}: cannot reach the API server; is the cluster reachable (kubectl cluster-info)?"
            )),
        e => anyhow::Error::new(e).context(format!("{verb} sidecarrelease {name:?}")),
    }
}

#[cfg(test)]
mod tests;
