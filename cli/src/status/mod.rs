//! `kubectl baton status`: one row per injected Pod (release, version,
//! slot, config sync, certificate expiry, last handoff, upgrade, restarts),
//! then a summary per SidecarRelease.
//!
//! ```text
//! fetch   I/O: the Pods (paged), the releases, every operator replica's
//!         /sidecars report through the API server's Pod proxy
//! join    pure: Pods + releases + reports -> rows and summaries
//! render  pure: rows and summaries -> table, JSON or YAML
//! ```
//!
//! [`produce`] is the whole command minus printing; `run` and the
//! benchmark (`cargo bench -p baton-cli --bench status`) both call it.

pub mod fetch;
pub mod join;
pub mod render;

use std::time::{SystemTime, UNIX_EPOCH};

pub use fetch::{Fetched, Reports};
pub use join::{Coverage, Failure, Handoff, PodRow, ReleaseSummary, Status, Upgrade, join};
pub use render::render;

use crate::{Ctx, Format, Outcome};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Label selector on Pods (`app=web,tier!=db`).
    #[arg(short = 'l', long)]
    pub selector: Option<String>,
}

/// What to show: the scope (`None`: every namespace), the user's selector
/// and the format.
#[derive(Debug, Clone)]
pub struct Query {
    pub namespace: Option<String>,
    pub selector: Option<String>,
    pub format: Format,
}

/// The command's output: the text for stdout, the warnings for stderr, and
/// whether any Pod was found.
#[derive(Debug, Clone)]
pub struct Produced {
    pub text: String,
    pub warnings: Vec<String>,
    pub pods: usize,
}

/// Fetch, join and render at `now` (unix seconds).
pub async fn produce(client: &kube::Client, query: &Query, now: i64) -> anyhow::Result<Produced> {
    let fetched = fetch::fetch(
        client,
        query.namespace.as_deref(),
        query.selector.as_deref(),
    )
    .await?;
    let all_namespaces = query.namespace.is_none();
    let status = join(&fetched, now, all_namespaces);
    let text = render(&status, query.format, all_namespaces)?;
    Ok(Produced {
        text,
        warnings: fetched.warnings(),
        pods: status.pods.len(),
    })
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<Outcome> {
    let client = ctx.client().await?;
    let query = Query {
        namespace: ctx.namespace_scope().await?,
        selector: args.selector,
        format: ctx.output(),
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let out = ctx
        .bounded("listing the injected Pods", produce(&client, &query, now))
        .await?;
    for w in &out.warnings {
        eprintln!("warning: {w}");
    }
    if out.pods == 0 && query.format == Format::Table {
        match &query.namespace {
            Some(ns) => eprintln!("No injected Pods found in namespace {ns}."),
            None => eprintln!("No injected Pods found."),
        }
    }
    print!("{}", out.text);
    Ok(Outcome::Success)
}
