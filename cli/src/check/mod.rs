//! `kubectl baton check`: is the mesh healthy? Baton's `linkerd check`.
//!
//! ```text
//! fetch.rs     the I/O: one bounded read per object a selected category needs,
//!              gathered into a plain `Observed` (a 403 or a missing object is
//!              data, not an error; only an unreachable API server aborts)
//! cluster.rs   kubernetes-api, crds, control-plane, pre-install   (pure)
//! certs.rs     webhook, identity, data-plane, PEM helpers          (pure)
//! releases.rs  releases                                            (pure)
//! ```
//!
//! Every verdict is a pure function of `Observed`, so each check's status
//! and hint is unit-tested with constructed API objects. A check is ok (✓),
//! a warning (‼) or a failure (×); the command fails (exit 1) iff any check
//! failed, so warnings never break a script that gates on `check`.

pub mod certs;
pub mod cluster;
pub mod fetch;
pub mod releases;

use std::fmt::Write as _;

use serde::Serialize;

use crate::{Ctx, Format, Outcome, output};

pub use fetch::{Got, Observed, PreObserved};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Before install: server version, the caller's permissions, conflicting
    /// webhook configurations.
    #[arg(long)]
    pub pre: bool,
    /// Run only this category of checks (kubernetes-api, crds,
    /// control-plane, webhook, identity, data-plane, releases; pre-install
    /// with --pre).
    #[arg(long)]
    pub category: Option<String>,
}

/// The verdict of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Warning,
    Failure,
}

impl Status {
    /// The mark `linkerd check` users know.
    pub fn symbol(self) -> &'static str {
        match self {
            Self::Ok => "✓",
            Self::Warning => "‼",
            Self::Failure => "×",
        }
    }
}

/// One check: what was checked, what was found, and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// What is checked (`baton-webhook Deployment`).
    pub name: String,
    pub status: Status,
    /// What was found (`0/0 replicas ready`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// A command to run or what to fix; set for warnings and failures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

impl Check {
    pub fn ok(name: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(name, Status::Ok, detail, None::<String>)
    }

    pub fn warning(
        name: impl Into<String>,
        detail: impl Into<String>,
        hint: impl Into<String>,
    ) -> Self {
        Self::new(name, Status::Warning, detail, Some(hint))
    }

    pub fn failure(
        name: impl Into<String>,
        detail: impl Into<String>,
        hint: impl Into<String>,
    ) -> Self {
        Self::new(name, Status::Failure, detail, Some(hint))
    }

    fn new(
        name: impl Into<String>,
        status: Status,
        detail: impl Into<String>,
        hint: Option<impl Into<String>>,
    ) -> Self {
        let detail: String = detail.into();
        Self {
            name: name.into(),
            status,
            detail: (!detail.is_empty()).then_some(detail),
            hint: hint.map(Into::into),
        }
    }
}

/// A named group of checks (`--category` takes the name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CategoryResult {
    pub name: &'static str,
    pub checks: Vec<Check>,
}

/// Everything `check` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The worst status of any check.
    pub status: Status,
    pub categories: Vec<CategoryResult>,
}

impl Report {
    pub fn new(categories: Vec<CategoryResult>) -> Self {
        let status = categories
            .iter()
            .flat_map(|c| &c.checks)
            .map(|c| c.status)
            .max()
            .unwrap_or(Status::Ok);
        Self { status, categories }
    }

    pub fn outcome(&self) -> Outcome {
        Outcome::from_ok(self.status != Status::Failure)
    }
}

/// The categories of a running mesh, in the order they print (each one
/// depends on the ones before it being healthy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Category {
    KubernetesApi,
    Crds,
    ControlPlane,
    Webhook,
    Identity,
    DataPlane,
    Releases,
}

impl Category {
    pub const ALL: [Category; 7] = [
        Self::KubernetesApi,
        Self::Crds,
        Self::ControlPlane,
        Self::Webhook,
        Self::Identity,
        Self::DataPlane,
        Self::Releases,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::KubernetesApi => "kubernetes-api",
            Self::Crds => "crds",
            Self::ControlPlane => "control-plane",
            Self::Webhook => "webhook",
            Self::Identity => "identity",
            Self::DataPlane => "data-plane",
            Self::Releases => "releases",
        }
    }
}

/// Name of the `--pre` category.
pub const PRE_INSTALL: &str = "pre-install";

/// What a command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// The pre-install checks.
    Pre,
    /// These categories of a running mesh.
    Installed(Vec<Category>),
}

/// Resolves `--pre` and `--category` (an unknown name is a usage error that
/// lists the valid ones).
pub fn select(args: &Args) -> anyhow::Result<Selection> {
    let valid = || {
        let mut names: Vec<&str> = Category::ALL.iter().map(|c| c.name()).collect();
        names.push(PRE_INSTALL);
        names.join(", ")
    };
    match (args.pre, args.category.as_deref()) {
        (true, None | Some(PRE_INSTALL)) | (false, Some(PRE_INSTALL)) => Ok(Selection::Pre),
        (true, Some(other)) => anyhow::bail!(
            "--pre runs the {PRE_INSTALL} category only, not {other:?} (drop --pre to check an installed mesh)"
        ),
        (false, None) => Ok(Selection::Installed(Category::ALL.to_vec())),
        (false, Some(name)) => match Category::ALL.iter().find(|c| c.name() == name) {
            Some(c) => Ok(Selection::Installed(vec![*c])),
            None => anyhow::bail!("unknown --category {name:?}; valid: {}", valid()),
        },
    }
}

/// Every selected category's checks, from what was observed (pure). A
/// category whose objects were not fetched is left out.
pub fn evaluate(observed: &Observed) -> Report {
    let now = observed.now;
    let categories = observed
        .categories
        .iter()
        .filter_map(|category| {
            let checks = match category {
                Category::KubernetesApi => cluster::kubernetes_api(&observed.version),
                Category::Crds => {
                    cluster::crds(observed.crds.as_ref()?, &baton_crds::schema::crds())
                }
                Category::ControlPlane => {
                    cluster::control_plane(observed.control_plane.as_ref()?, now)
                }
                Category::Webhook => certs::webhook(observed.webhook.as_ref()?, now),
                Category::Identity => certs::identity(observed.identity_ca.as_ref()?, now),
                Category::DataPlane => certs::data_plane(
                    observed.data_plane.as_ref()?,
                    observed.identity_ca.as_ref()?,
                ),
                Category::Releases => releases::releases(observed.releases.as_ref()?),
            };
            Some(CategoryResult {
                name: category.name(),
                checks,
            })
        })
        .collect();
    Report::new(categories)
}

/// The pre-install report (pure).
pub fn evaluate_pre(observed: &PreObserved) -> Report {
    Report::new(vec![CategoryResult {
        name: PRE_INSTALL,
        checks: cluster::pre_install(observed),
    }])
}

/// The table `linkerd check` users know: a header per category, a line per
/// check, an indented hint under each warning and failure, and a summary.
pub fn render_table(report: &Report) -> String {
    let mut out = String::new();
    for category in &report.categories {
        let _ = writeln!(out, "{}", category.name);
        let _ = writeln!(out, "{}", "-".repeat(category.name.chars().count()));
        for check in &category.checks {
            let _ = match &check.detail {
                Some(detail) => writeln!(out, "{} {}: {detail}", check.status.symbol(), check.name),
                None => writeln!(out, "{} {}", check.status.symbol(), check.name),
            };
            if let Some(hint) = &check.hint {
                let _ = writeln!(out, "    hint: {hint}");
            }
        }
        out.push('\n');
    }
    let _ = writeln!(out, "Status check results are {}", report.status.symbol());
    out
}

/// Renders in the chosen format.
pub fn render(format: Format, report: &Report) -> anyhow::Result<String> {
    Ok(match output::structured(format, report)? {
        Some(s) => s,
        None => render_table(report),
    })
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<Outcome> {
    let selection = select(&args)?;
    // The whole command shares one budget (each call inside has its own
    // bound too, which names the step that hung).
    let report = ctx
        .bounded("check", async {
            Ok(match &selection {
                Selection::Pre => evaluate_pre(&Box::pin(fetch::pre(ctx)).await?),
                Selection::Installed(categories) => {
                    evaluate(&Box::pin(fetch::observe(ctx, categories)).await?)
                }
            })
        })
        .await?;
    print!("{}", render(ctx.output(), &report)?);
    Ok(report.outcome())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(pre: bool, category: Option<&str>) -> Args {
        Args {
            pre,
            category: category.map(str::to_owned),
        }
    }

    #[test]
    fn categories_are_selected_by_name_and_pre_runs_pre_install() {
        assert_eq!(
            select(&args(false, None)).unwrap(),
            Selection::Installed(Category::ALL.to_vec())
        );
        assert_eq!(
            select(&args(false, Some("control-plane"))).unwrap(),
            Selection::Installed(vec![Category::ControlPlane])
        );
        assert_eq!(select(&args(true, None)).unwrap(), Selection::Pre);
        assert_eq!(
            select(&args(false, Some("pre-install"))).unwrap(),
            Selection::Pre
        );
        let err = select(&args(false, Some("nope"))).unwrap_err().to_string();
        assert!(err.contains("valid: kubernetes-api, crds"), "{err}");
        assert!(select(&args(true, Some("crds"))).is_err());
    }

    fn sample() -> Report {
        Report::new(vec![
            CategoryResult {
                name: "kubernetes-api",
                checks: vec![
                    Check::ok("can reach the API server", ""),
                    Check::ok("server version", "1.20 is supported"),
                ],
            },
            CategoryResult {
                name: "control-plane",
                checks: vec![Check::failure(
                    "baton-webhook Deployment",
                    "0/0 replicas ready",
                    "kubectl -n baton-system scale deployment baton-webhook --replicas=2",
                )],
            },
        ])
    }

    #[test]
    fn the_table_reads_like_linkerd_check() {
        assert_eq!(
            render_table(&sample()),
            "kubernetes-api\n--------------\n✓ can reach the API server\n✓ server version: 1.20 is supported\n\n\
             control-plane\n-------------\n× baton-webhook Deployment: 0/0 replicas ready\n    \
             hint: kubectl -n baton-system scale deployment baton-webhook --replicas=2\n\n\
             Status check results are ×\n"
        );
    }

    #[test]
    fn any_failure_fails_the_command_but_warnings_do_not() {
        assert_eq!(sample().outcome(), Outcome::Failure);
        let warned = Report::new(vec![CategoryResult {
            name: "releases",
            checks: vec![Check::ok("a", ""), Check::warning("b", "c", "d")],
        }]);
        assert_eq!(warned.status, Status::Warning);
        assert_eq!(warned.outcome(), Outcome::Success);
        assert_eq!(Report::new(vec![]).outcome(), Outcome::Success);
    }

    #[test]
    fn json_output_lists_categories_and_checks_with_their_status() {
        let json: serde_json::Value =
            serde_json::from_str(&render(Format::Json, &sample()).unwrap()).unwrap();
        assert_eq!(json["status"], "failure");
        assert_eq!(json["categories"][0]["name"], "kubernetes-api");
        assert_eq!(json["categories"][0]["checks"][0]["status"], "ok");
        assert!(json["categories"][0]["checks"][0].get("hint").is_none());
        let failed = &json["categories"][1]["checks"][0];
        assert_eq!(failed["status"], "failure");
        assert_eq!(failed["detail"], "0/0 replicas ready");
        assert!(failed["hint"].as_str().unwrap().contains("--replicas=2"));
        let yaml = render(Format::Yaml, &sample()).unwrap();
        assert!(yaml.contains("status: failure"), "{yaml}");
    }
}
