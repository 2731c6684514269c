//! `--watch`: follow a release until its status, for the current
//! generation, says the rollout completed or stopped. The verdict and the
//! progress text are pure functions of the release; [`follow`] only polls
//! and draws.

use std::io::IsTerminal as _;
use std::time::Duration;

use baton_crds::SidecarRelease;
use baton_crds::conditions::{self, sidecar_release as cond};
use baton_crds::sidecar_release::FailedPod;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Api;
use tokio::time::Instant;

use crate::{Ctx, Outcome};

/// What the watch waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Goal {
    /// `upgrade`, `resume`, `rollback`: the rollout completes.
    Rollout,
    /// `pause`: the operator acknowledges the pause.
    Pause,
}

/// A condition that ended the watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Why {
    pub type_: String,
    pub reason: String,
    pub message: String,
}

impl Why {
    fn of(c: &Condition) -> Self {
        Self {
            type_: c.type_.clone(),
            reason: c.reason.clone(),
            message: c.message.clone(),
        }
    }
}

/// Where the release stands, read from its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The status does not describe the current generation yet, or pods
    /// are still moving.
    Running,
    /// Complete=True (or, for [`Goal::Pause`], Paused=True) at the current
    /// generation.
    Done(Why),
    /// Paused=True or Degraded=True at the current generation: the first
    /// is the cause, the rest what else holds; and the pods that failed.
    Stopped {
        why: Vec<Why>,
        failed_pods: Vec<FailedPod>,
    },
}

fn condition<'a>(r: &'a SidecarRelease, type_: &str) -> Option<&'a Condition> {
    r.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_ && c.status == conditions::TRUE)
}

/// Whether the status describes `metadata.generation`.
pub fn observed(r: &SidecarRelease) -> bool {
    let generation = r.metadata.generation;
    generation.is_some() && r.status.as_ref().and_then(|s| s.observed_generation) == generation
}

/// The verdict on `r` for `goal`.
///
/// Rollout: Complete=True is done (whatever the reason: AllPodsUpdated,
/// NoPodsSelected, PartitionHeld, CanaryHeld); Paused=True (any reason)
/// stops; Degraded=True stops, except while `failureThreshold` tolerates
/// the failed pods (the operator keeps rolling out then, and pauses itself
/// once they exceed it). A status older than the current generation is
/// always Running.
pub fn verdict(r: &SidecarRelease, goal: Goal) -> Verdict {
    if !observed(r) {
        return Verdict::Running;
    }
    let status = r.status.clone().unwrap_or_default();
    let paused = condition(r, cond::PAUSED);
    if goal == Goal::Pause {
        return paused.map_or(Verdict::Running, |c| Verdict::Done(Why::of(c)));
    }
    if let Some(c) = condition(r, cond::COMPLETE) {
        return Verdict::Done(Why::of(c));
    }
    let degraded = condition(r, cond::DEGRADED);
    let threshold = r.spec.upgrade.failure_threshold;
    let tolerated = degraded.is_some_and(|c| {
        c.reason == cond::reasons::HANDOFF_FAILED && threshold > 0 && status.failed <= threshold
    });
    let why: Vec<Why> = paused
        .into_iter()
        .chain(degraded.filter(|_| !tolerated || paused.is_some()))
        .map(Why::of)
        .collect();
    if why.is_empty() {
        Verdict::Running
    } else {
        Verdict::Stopped {
            why,
            failed_pods: status.failed_pods,
        }
    }
}

/// Pods of the target version, and all pods (the progress bar's position
/// and length).
pub fn position(r: &SidecarRelease) -> (u64, u64) {
    let s = r.status.clone().unwrap_or_default();
    let on_target = if observed(r) {
        s.updated
    } else {
        s.versions
            .iter()
            .find(|v| v.version == r.spec.version)
            .map_or(0, |v| v.total)
    };
    let n = |x: i32| u64::try_from(x.max(0)).unwrap_or(0);
    (n(on_target), n(s.total))
}

/// The progress bar's message: pods per version, in flight, failed, and
/// the rollout word.
pub fn counts(r: &SidecarRelease) -> String {
    let Some(s) = r.status.as_ref().filter(|_| observed(r)) else {
        let seen = r
            .status
            .as_ref()
            .and_then(|s| s.observed_generation)
            .map_or("none yet".to_owned(), |g| g.to_string());
        return format!(
            "waiting for the operator to observe generation {} (status describes {seen})",
            r.metadata.generation.unwrap_or_default()
        );
    };
    let versions: Vec<String> = s
        .versions
        .iter()
        .map(|v| {
            let mut t = format!("{} {}/{} ready", v.version, v.ready, v.total);
            if v.failed > 0 {
                t.push_str(&format!(", {} failed", v.failed));
            }
            t
        })
        .collect();
    let versions = if versions.is_empty() {
        "no pods".to_owned()
    } else {
        versions.join("; ")
    };
    format!(
        "[{versions}] {} in flight, {} failed, {}",
        s.in_flight,
        s.failed,
        s.rollout.as_deref().unwrap_or("RollingOut")
    )
}

/// One line of plain progress (printed when it changes, without a
/// terminal):
/// `sidecarrelease/NAME: 3/5 pods on 0.2.0 [0.1.0 2/2 ready; 0.2.0 3/3 ready] 1 in flight, 0 failed, RollingOut`.
pub fn progress_line(r: &SidecarRelease) -> String {
    let name = r.metadata.name.as_deref().unwrap_or_default();
    if !observed(r) {
        return format!("sidecarrelease/{name}: {}", counts(r));
    }
    let (on, total) = position(r);
    format!(
        "sidecarrelease/{name}: {on}/{total} pods on {} {}",
        r.spec.version,
        counts(r)
    )
}

/// The lines that end a watch.
pub fn final_lines(r: &SidecarRelease, verdict: &Verdict) -> Vec<String> {
    let name = r.metadata.name.as_deref().unwrap_or_default();
    match verdict {
        Verdict::Running => vec![progress_line(r)],
        Verdict::Done(why) if why.type_ == cond::PAUSED => vec![format!(
            "sidecarrelease/{name}: paused ({}): {}",
            why.reason, why.message
        )],
        Verdict::Done(why) => vec![format!(
            "sidecarrelease/{name}: rollout complete ({}): {}",
            why.reason, why.message
        )],
        Verdict::Stopped { why, failed_pods } => {
            let mut lines: Vec<String> = why
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let lead = if i == 0 {
                        "rollout stopped: "
                    } else {
                        "  also "
                    };
                    if i == 0 {
                        format!(
                            "sidecarrelease/{name}: {lead}{} ({}): {}",
                            w.type_, w.reason, w.message
                        )
                    } else {
                        format!("{lead}{} ({}): {}", w.type_, w.reason, w.message)
                    }
                })
                .collect();
            for p in failed_pods {
                lines.push(format!(
                    "  failed pod {} → {}: {}",
                    p.pod, p.version, p.reason
                ));
            }
            match why.first().map(|w| w.reason.as_str()) {
                Some(cond::reasons::PAUSED_BY_USER) => {
                    lines.push(format!("  to continue: kubectl baton resume {name}"));
                }
                Some(cond::reasons::INVALID_SPEC) => {}
                _ => lines.push(format!("  to roll back: kubectl baton rollback {name}")),
            }
            lines
        }
    }
}

/// `10m`, `90s`, `1h`: a `--watch-timeout` as the user wrote it.
pub fn human(d: Duration) -> String {
    let s = d.as_secs();
    if d.subsec_millis() != 0 || s == 0 {
        format!("{}ms", d.as_millis())
    } else if s.is_multiple_of(3600) {
        format!("{}h", s / 3600)
    } else if s.is_multiple_of(60) {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

/// Where the watch's lines go.
#[derive(Debug)]
pub enum Sink {
    Stdout,
    Stderr,
    /// Tests read the lines.
    Memory(Vec<String>),
}

impl Sink {
    pub fn line(&mut self, line: &str) {
        match self {
            Self::Stdout => println!("{line}"),
            Self::Stderr => eprintln!("{line}"),
            Self::Memory(v) => v.push(line.to_owned()),
        }
    }
}

/// Draws progress: a live bar on a terminal, a plain line per change
/// otherwise.
struct Display<'a> {
    sink: &'a mut Sink,
    bar: Option<ProgressBar>,
    last: Option<String>,
}

impl<'a> Display<'a> {
    fn new(sink: &'a mut Sink, terminal: bool) -> Self {
        let bar = terminal.then(|| {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{spinner} {prefix} [{bar:20}] {pos}/{len} {elapsed} {wide_msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            bar.set_style(style);
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        });
        Self {
            sink,
            bar,
            last: None,
        }
    }

    fn update(&mut self, r: &SidecarRelease) {
        if let Some(bar) = &self.bar {
            let (on, total) = position(r);
            bar.set_prefix(format!(
                "{} → {}",
                r.metadata.name.as_deref().unwrap_or_default(),
                r.spec.version
            ));
            bar.set_length(total);
            bar.set_position(on);
            bar.set_message(counts(r));
        } else {
            let line = progress_line(r);
            if self.last.as_ref() != Some(&line) {
                self.sink.line(&line);
                self.last = Some(line);
            }
        }
    }

    /// A note that should not break the bar (a failed poll).
    fn note(&mut self, line: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| eprintln!("{line}")),
            None => eprintln!("{line}"),
        }
    }

    /// Removes the bar, leaving the terminal as it was, before the final
    /// lines.
    fn clear(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }

    fn line(&mut self, line: &str) {
        self.clear();
        self.sink.line(line);
    }
}

impl Drop for Display<'_> {
    fn drop(&mut self) {
        self.clear();
    }
}

/// How the watch runs.
#[derive(Debug, Clone)]
pub struct Watch {
    pub goal: Goal,
    pub timeout: Duration,
    pub poll_every: Duration,
    /// Draw a bar (stderr is a terminal) instead of plain lines.
    pub terminal: bool,
    /// Failed polls in a row before the watch gives up.
    pub max_poll_errors: u32,
}

impl Watch {
    pub fn new(goal: Goal, timeout: Duration) -> Self {
        Self {
            goal,
            timeout,
            poll_every: Duration::from_secs(1),
            terminal: std::io::stderr().is_terminal(),
            max_poll_errors: 5,
        }
    }
}

enum End {
    Finished(anyhow::Result<(Outcome, Box<SidecarRelease>)>),
    Interrupted,
}

/// Polls `name` every [`Watch::poll_every`] (each GET bounded by
/// `--timeout`, the whole by [`Watch::timeout`]) until the verdict is not
/// Running; Ctrl-C stops watching (not the rollout) and clears the bar.
/// Returns the outcome and the release last seen.
pub async fn follow(
    ctx: &Ctx,
    api: &Api<SidecarRelease>,
    name: &str,
    watch: &Watch,
    sink: &mut Sink,
) -> anyhow::Result<(Outcome, Option<SidecarRelease>)> {
    let mut display = Display::new(sink, watch.terminal);
    let mut last: Option<SidecarRelease> = None;
    let end = tokio::select! {
        r = poll(ctx, api, name, watch, &mut display, &mut last) => End::Finished(r),
        _ = tokio::signal::ctrl_c() => End::Interrupted,
    };
    match end {
        End::Finished(Ok((outcome, r))) => Ok((outcome, Some(*r))),
        End::Finished(Err(e)) => {
            display.clear();
            Err(e)
        }
        End::Interrupted => {
            display.line(&format!(
                "sidecarrelease/{name}: stopped watching (interrupted); the rollout goes on in the cluster"
            ));
            Ok((Outcome::Failure, last))
        }
    }
}

async fn poll(
    ctx: &Ctx,
    api: &Api<SidecarRelease>,
    name: &str,
    watch: &Watch,
    display: &mut Display<'_>,
    last: &mut Option<SidecarRelease>,
) -> anyhow::Result<(Outcome, Box<SidecarRelease>)> {
    let deadline = Instant::now() + watch.timeout;
    let mut errors = 0;
    loop {
        let got = tokio::time::timeout_at(deadline, super::get(ctx, api, name)).await;
        match got {
            Ok(Ok(r)) => {
                errors = 0;
                display.update(&r);
                let v = verdict(&r, watch.goal);
                if v != Verdict::Running {
                    display.clear();
                    for line in final_lines(&r, &v) {
                        display.line(&line);
                    }
                    let ok = matches!(v, Verdict::Done(_));
                    return Ok((Outcome::from_ok(ok), Box::new(r)));
                }
                *last = Some(r);
            }
            Ok(Err(e)) if super::is_not_found(&e) => return Err(e),
            Ok(Err(e)) => {
                errors += 1;
                if errors >= watch.max_poll_errors {
                    return Err(e.context(format!("{errors} polls in a row failed")));
                }
                display.note(&format!("warning: {e:#} (retrying)"));
            }
            Err(_) => {}
        }
        let next = (Instant::now() + watch.poll_every).min(deadline);
        tokio::time::sleep_until(next).await;
        if Instant::now() >= deadline {
            let state = last.as_ref().map_or_else(
                || "no state read".to_owned(),
                |r| {
                    let p = progress_line(r);
                    let prefix = format!("sidecarrelease/{name}: ");
                    p.strip_prefix(&prefix).unwrap_or(&p).to_owned()
                },
            );
            let what = match watch.goal {
                Goal::Rollout => "rollout not finished",
                Goal::Pause => "pause not acknowledged by the operator",
            };
            display.line(&format!(
                "sidecarrelease/{name}: {what} within {} (--watch-timeout); last state: {state}",
                human(watch.timeout)
            ));
            let r = last.clone().ok_or_else(|| {
                anyhow::anyhow!("sidecarrelease/{name}: no state read within the watch timeout")
            });
            return r.map(|r| (Outcome::Failure, Box::new(r)));
        }
    }
}
