//! Command-line interface: argument types (clap) and the blocking entry
//! points `main.rs` calls. Kept in the library so it is tested and so
//! `main.rs` stays a few lines.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use baton_contract as contract;
use clap::{Args, Parser, Subcommand};

use crate::config::{
    Capture, ClusterConfig, ConfigError, Direction, ListenerConfig, RouteConfig, Snapshot,
    WeightedBackend, store::load_file,
};
use crate::filters::Cidr;
use crate::init::{InitOptions, parse_list};
use crate::server::{StartError, StartOptions};

#[derive(Debug, Parser)]
#[command(name = "baton-sidecar", version, about = "Baton's per-pod proxy")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy (standalone with --config, or quick mode with --listen/--upstream).
    /// Boxed: its flags outweigh every other subcommand's many times.
    Run(Box<RunArgs>),
    /// Program iptables for transparent capture (init container).
    Init(InitArgs),
    /// Validate a config file and exit.
    Validate {
        #[arg(long)]
        config: PathBuf,
    },
    /// Wait until the local admin port answers /ready with 200.
    WaitReady {
        #[arg(long, default_value_t = SocketAddr::from(([127, 0, 0, 1], contract::ports::ADMIN)))]
        admin: SocketAddr,
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
    },
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// YAML snapshot; watched and re-applied when it changes.
    #[arg(long, env = contract::env::CONFIG, conflicts_with_all = ["listen", "upstream"])]
    pub config: Option<PathBuf>,
    /// How often to check the config file for changes.
    #[arg(long, default_value_t = 1000)]
    pub watch_interval_ms: u64,
    /// Quick mode: listen here and forward every request/connection to --upstream.
    #[arg(long, requires = "upstream")]
    pub listen: Option<SocketAddr>,
    #[arg(long, requires = "listen")]
    pub upstream: Option<SocketAddr>,
    /// Worker threads (overrides the config's runtime.worker_threads).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Admin address (overrides the config).
    #[arg(long)]
    pub admin: Option<SocketAddr>,
    #[command(flatten)]
    pub control: ControlArgs,
}

/// The operator's config stream (see [`crate::control`]).
#[derive(Debug, Args)]
pub struct ControlArgs {
    /// Take config from the operator's push stream (on top of the in-pod
    /// default or --config, which serve until the first push).
    #[arg(long = "config-push", env = contract::env::CONFIG_PUSH, default_value_t = false, action = clap::ArgAction::Set)]
    pub enabled: bool,
    /// Operator host (DNS name or IP); the webhook injects it.
    #[arg(long = "control-plane-address", env = contract::env::CONTROL_PLANE_ADDRESS)]
    pub address: Option<String>,
    #[arg(
        long = "control-plane-port",
        env = "BATON_CONTROL_PLANE_PORT",
        default_value_t = contract::identity::CONFIG_PUSH_PORT
    )]
    pub port: u16,
    /// Name the operator's certificate carries.
    #[arg(
        long = "control-plane-server-name",
        env = "BATON_CONTROL_PLANE_SERVER_NAME",
        default_value = "baton-identity.baton-system.svc"
    )]
    pub server_name: String,
    /// CA bundle that authenticates the operator.
    #[arg(long = "control-plane-ca", env = contract::env::CONTROL_PLANE_CA)]
    pub ca_bundle: Option<PathBuf>,
    /// The newest trust bundle the Pod's sidecars learned from the identity
    /// service, trusted together with `--control-plane-ca` (injected slots:
    /// on the shared volume).
    #[arg(long = "trust-state", env = contract::env::TRUST_STATE)]
    pub trust_state: Option<PathBuf>,
    /// Projected ServiceAccount token (audience of the mesh); default: where
    /// the webhook mounts it.
    #[arg(long = "control-plane-token")]
    pub token_path: Option<PathBuf>,
    #[arg(long = "pod-namespace", env = contract::env::POD_NAMESPACE)]
    pub pod_namespace: Option<String>,
    #[arg(long = "pod-name", env = contract::env::POD_NAME)]
    pub pod_name: Option<String>,
}

impl ControlArgs {
    /// The client's configuration, `None` when the stream is off, or what is
    /// missing to turn it on.
    pub fn config(&self) -> Result<Option<crate::control::ControlConfig>, String> {
        if !self.enabled {
            return Ok(None);
        }
        let need = |v: &Option<String>, what: &str| {
            v.clone()
                .filter(|s| !s.is_empty())
                .ok_or_else(|| format!("--config-push needs {what}"))
        };
        let address = need(&self.address, "--control-plane-address")?;
        let ca_bundle = self
            .ca_bundle
            .clone()
            .ok_or("--config-push needs --control-plane-ca")?;
        let pod = format!(
            "{}/{}",
            need(&self.pod_namespace, "--pod-namespace")?,
            need(&self.pod_name, "--pod-name")?
        );
        // An IPv6 literal needs brackets before the port.
        let host = if address.contains(':') && !address.starts_with('[') {
            format!("[{address}]")
        } else {
            address
        };
        Ok(Some(crate::control::ControlConfig {
            address: format!("{host}:{}", self.port),
            server_name: self.server_name.clone(),
            ca_bundle,
            trust_state: self.trust_state.clone(),
            token_path: self.token_path.clone().unwrap_or_else(|| {
                std::path::Path::new(contract::volumes::TOKEN_MOUNT_PATH)
                    .join(contract::volumes::TOKEN_FILE)
            }),
            pod,
            min_backoff: std::time::Duration::from_millis(200),
            max_backoff: std::time::Duration::from_secs(30),
        }))
    }
}

#[derive(Debug, Args)]
pub struct InitArgs {
    #[arg(long, default_value_t = contract::ports::OUTBOUND)]
    pub outbound_port: u16,
    #[arg(long, default_value_t = contract::ports::INBOUND)]
    pub inbound_port: u16,
    /// UID whose traffic is never captured (the sidecar's own).
    #[arg(long, default_value_t = contract::SIDECAR_UID as u32)]
    pub proxy_uid: u32,
    #[arg(long, env = contract::env::EXCLUDE_INBOUND_PORTS, default_value = "")]
    pub exclude_inbound_ports: String,
    #[arg(long, env = contract::env::EXCLUDE_OUTBOUND_PORTS, default_value = "")]
    pub exclude_outbound_ports: String,
    #[arg(long, env = contract::env::EXCLUDE_OUTBOUND_CIDRS, default_value = "")]
    pub exclude_outbound_cidrs: String,
    /// Do not capture inbound traffic.
    #[arg(long)]
    pub no_inbound: bool,
    /// Print the rules instead of applying them.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long, default_value = "iptables")]
    pub iptables: String,
}

/// Everything that can make the binary exit non-zero.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Start(#[from] StartError),
    #[error(transparent)]
    Handoff(#[from] crate::process::RunError),
    #[error(transparent)]
    Init(#[from] crate::init::InitError),
    #[error("{0}")]
    Usage(String),
    #[error("cannot start the runtime: {0}")]
    Runtime(std::io::Error),
    #[error("not ready after {0} s")]
    NotReady(u64),
}

/// The snapshot quick mode serves: one listener, one cluster, HTTP routed
/// to it (TCP too, since detection falls back to the same cluster).
pub fn quick_snapshot(listen: SocketAddr, upstream: SocketAddr) -> Snapshot {
    Snapshot {
        version: 1,
        listeners: vec![ListenerConfig {
            name: "quick".into(),
            address: listen,
            direction: Direction::Outbound,
            capture: Capture::Explicit,
            protocol: Default::default(),
            opaque_ports: vec![],
            detect_timeout_ms: 500,
            tcp_cluster: Some("upstream".into()),
            port_map: Default::default(),
            passthrough: false,
            max_connections: None,
            rbac: None,
            access_log: false,
            terminate_tls: Default::default(),
        }],
        routes: vec![RouteConfig {
            name: "default".into(),
            listeners: vec![],
            matches: Default::default(),
            backends: vec![WeightedBackend {
                cluster: "upstream".into(),
                weight: 1,
            }],
            timeout_ms: None,
            retry: None,
            fault: None,
            mirror: None,
            request_headers: Default::default(),
            response_headers: Default::default(),
        }],
        clusters: vec![ClusterConfig {
            name: "upstream".into(),
            endpoints: vec![upstream],
            lb: Default::default(),
            protocol: Default::default(),
            connect_timeout_ms: 1000,
            pool_idle_timeout_ms: 60_000,
            pool_max_idle_per_endpoint: 256,
            outlier: None,
            mtls: None,
        }],
        ..Default::default()
    }
}

type LogHandle =
    tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, tracing_subscriber::Registry>;

/// Install the global subscriber; returns a hook for `/log-level`.
pub fn init_tracing() -> Option<crate::admin::LogLevelHook> {
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::try_from_env(contract::env::LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (filter, handle): (_, LogHandle) = tracing_subscriber::reload::Layer::new(filter);
    let ok = tracing_subscriber::registry()
        .with(filter)
        // stderr: stdout carries only the access log's JSON lines, so a
        // log pipeline can parse the stream without telling them apart.
        .with(
            tracing_subscriber::fmt::layer()
                .with_target(true)
                .with_writer(std::io::stderr),
        )
        .try_init()
        .is_ok();
    ok.then(|| {
        Arc::new(move |level: &str| {
            let f = tracing_subscriber::EnvFilter::try_new(level).map_err(|e| e.to_string())?;
            handle.reload(f).map_err(|e| e.to_string())
        }) as crate::admin::LogLevelHook
    })
}

/// Run a parsed command to completion (blocking).
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Run(args) => run_proxy(*args),
        Command::Init(args) => run_init(args),
        Command::Validate { config } => {
            let snap = load_file(&config)?;
            crate::config::compile(&snap)?;
            // `compile` validated the TLS section with the rest; building
            // its rustls objects (as a reload's TLS hook does) is the part
            // that depends on the crypto provider. No I/O.
            if let Some(section) = &snap.tls {
                crate::tls::settings::compile(section)
                    .map_err(|e| crate::config::ConfigError::Tls(Box::new(e)))?;
            }
            println!("{}: valid (version {})", config.display(), snap.version);
            Ok(())
        }
        Command::WaitReady {
            admin,
            timeout_secs,
        } => wait_ready(admin, timeout_secs),
    }
}

fn run_proxy(args: RunArgs) -> Result<(), CliError> {
    // First, while this is the only thread (see `sched::presize_fd_table`).
    if let Err(e) = crate::sched::presize_fd_table(crate::sched::FD_TABLE_SLOTS) {
        eprintln!("cannot reserve descriptor slots: {e}");
    }
    let log_level = init_tracing();
    let (mut snapshot, watch) = match (&args.config, args.listen, args.upstream) {
        (Some(path), _, _) => (
            load_file(path)?,
            Some((path.clone(), Duration::from_millis(args.watch_interval_ms))),
        ),
        (None, Some(l), Some(u)) => (quick_snapshot(l, u), None),
        _ => (crate::config::pod_default(), None),
    };
    if let Some(w) = args.workers {
        snapshot.runtime.worker_threads = w;
    }
    if let Some(a) = args.admin {
        snapshot.admin.address = a;
    } else if args.listen.is_some() {
        // Quick mode: an ephemeral admin port, so several can run side by side.
        snapshot.admin.address = SocketAddr::from(([127, 0, 0, 1], 0));
    }
    crate::config::compile(&snapshot)?;
    let control = args.control.config().map_err(CliError::Usage)?;
    // One worker: a current-thread runtime (no work-stealing machinery, no
    // cross-thread wakeups); more: the multi-thread scheduler.
    let rt = &snapshot.runtime;
    let mut builder = if rt.worker_threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(rt.worker_threads)
            .thread_name("baton-worker");
        b
    };
    if let Some(n) = rt.event_interval {
        builder.event_interval(n);
    }
    if let Some(n) = rt.global_queue_interval {
        builder.global_queue_interval(n);
    }
    let runtime = builder.enable_all().build().map_err(CliError::Runtime)?;
    // Mesh TLS from the snapshot's `tls` section (inside the runtime: the
    // certificate file watcher is a task).
    let tls = runtime
        .block_on(async { crate::tls::MeshTls::from_section(snapshot.tls.as_ref()) })
        .map_err(|e| ConfigError::Tls(Box::new(e)))?;
    // TLS 1.3 traffic secrets for the handoff (KeyUpdate after a move).
    tls.set_key_log(crate::tls_record::secret_capture());
    // In a pod, a slot this process already handed off from stays idle
    // (see `lifecycle::Retirement`): the kubelet restarted it, and taking
    // the connections back from the successor would start a ping-pong.
    let retirement = crate::lifecycle::Retirement::from_env();
    if retirement.is_retired() {
        runtime.block_on(crate::lifecycle::idle_until_terminated(
            "this slot handed off already; waiting for the operator to swap it back to the idle image",
        ));
        return Ok(());
    }
    // With handoff: adopt from a live sidecar on the shared volume, or
    // start fresh and answer the next one's handoff request.
    runtime.block_on(async {
        let ending = crate::process::run(
            snapshot,
            {
                let mut opts = StartOptions {
                    watch,
                    log_level,
                    ..Default::default()
                };
                tls.plug(&mut opts);
                opts
            },
            // The certificate and key travel with the handoff. A slot whose
            // Required offload engine does not work (its container holds no
            // device) must not take over from the sidecar that has one.
            crate::handoff::HandoffConfig::from_env(env!("CARGO_PKG_VERSION"))
                .with_identity(tls.clone())
                .with_sessions(tls.clone())
                .with_adopt_refusal(tls.offload_readiness().err()),
            // /ready reflects the offload engine and /metrics carries the TLS
            // series (the `tls` hook and the originator are plugged in before
            // the data plane starts, above). The
            // config stream starts after the store holds what a handoff
            // handed over, so it resumes at that version.
            |running| {
                tls.attach(running);
                if let Some(cfg) = control {
                    running
                        .admin
                        .readiness
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(crate::control::readiness(running.shared.store.clone()));
                    let shared = running.shared.clone();
                    let certificate = Some(tls.certificate_generation());
                    let link = tls.operator_link();
                    // The stream lives as long as the process.
                    let (_stop, stop) = tokio::sync::watch::channel(false);
                    tokio::spawn(async move {
                        let _stop = _stop;
                        crate::control::run_reporting(
                            cfg,
                            shared.store.clone(),
                            shared.metrics.clone(),
                            stop,
                            certificate,
                            link,
                        )
                        .await
                    });
                }
            },
        )
        .await?;
        if ending == crate::lifecycle::Ending::HandedOff && retirement.enabled() {
            if let Err(e) = retirement.retire() {
                // Still idle: exiting would let the kubelet restart us into
                // a second sidecar. Only the restart guard is lost.
                tracing::warn!(error = %e, "cannot leave the retired marker");
            }
            crate::lifecycle::idle_until_terminated(
                "handed off; waiting for the operator to swap this slot back to the idle image",
            )
            .await;
        }
        Ok::<(), CliError>(())
    })?;
    Ok(())
}

fn run_init(a: InitArgs) -> Result<(), CliError> {
    let _ = init_tracing();
    let opts = InitOptions {
        outbound_port: a.outbound_port,
        inbound_port: a.inbound_port,
        proxy_uid: a.proxy_uid,
        exclude_inbound_ports: parse_list(&a.exclude_inbound_ports).map_err(CliError::Usage)?,
        exclude_outbound_ports: parse_list(&a.exclude_outbound_ports).map_err(CliError::Usage)?,
        exclude_outbound_cidrs: a
            .exclude_outbound_cidrs
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(Cidr::parse)
            .collect::<Result<_, _>>()
            .map_err(CliError::Usage)?,
        inbound: !a.no_inbound,
    };
    if a.dry_run {
        for r in crate::init::rules(&opts) {
            println!("{} {}", a.iptables, r.join(" "));
        }
        return Ok(());
    }
    crate::init::apply(&opts, &a.iptables)?;
    Ok(())
}

fn wait_ready(admin: SocketAddr, timeout_secs: u64) -> Result<(), CliError> {
    use std::io::{Read, Write};
    let deadline = std::time::Instant::now() + Duration::from_secs(timeout_secs);
    while std::time::Instant::now() < deadline {
        if let Ok(mut s) = std::net::TcpStream::connect_timeout(&admin, Duration::from_secs(1)) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let req = format!(
                "GET {} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
                contract::commands::READY_PATH
            );
            let mut resp = String::new();
            if s.write_all(req.as_bytes()).is_ok()
                && s.read_to_string(&mut resp).is_ok()
                && resp.starts_with("HTTP/1.1 200")
            {
                return Ok(());
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(CliError::NotReady(timeout_secs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn the_config_stream_is_off_by_default_and_names_what_it_is_missing() {
        let parse = |args: &[&str]| {
            let mut all = vec!["baton-sidecar", "run"];
            all.extend_from_slice(args);
            match Cli::try_parse_from(all).unwrap().command {
                Command::Run(r) => r.control,
                other => panic!("{other:?}"),
            }
        };
        assert!(parse(&[]).config().unwrap().is_none());
        let err = parse(&["--config-push", "true", "--control-plane-ca", "/ca.pem"])
            .config()
            .unwrap_err();
        assert!(err.contains("--control-plane-address"), "{err}");
        let cfg = parse(&[
            "--config-push",
            "true",
            "--control-plane-address",
            "fd00::10",
            "--control-plane-ca",
            "/ca.pem",
            "--pod-namespace",
            "shop",
            "--pod-name",
            "cart-1",
        ])
        .config()
        .unwrap()
        .unwrap();
        assert_eq!(cfg.address, "[fd00::10]:8444");
        assert_eq!(cfg.pod, "shop/cart-1");
        assert_eq!(
            cfg.token_path,
            std::path::Path::new("/var/run/secrets/baton.dev/identity/token")
        );
    }

    #[test]
    fn quick_and_pod_default_snapshots_are_valid() {
        crate::config::compile(&quick_snapshot(
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        ))
        .unwrap();
        crate::config::compile(&crate::config::pod_default()).unwrap();
    }

    #[test]
    fn run_accepts_quick_mode_and_refuses_mixing_it_with_a_config() {
        Cli::try_parse_from([
            "baton-sidecar",
            "run",
            "--listen",
            "127.0.0.1:1",
            "--upstream",
            "127.0.0.1:2",
            "--workers",
            "1",
        ])
        .unwrap();
        assert!(Cli::try_parse_from(["baton-sidecar", "run", "--listen", "127.0.0.1:1"]).is_err());
        assert!(
            Cli::try_parse_from([
                "baton-sidecar",
                "run",
                "--config",
                "x",
                "--listen",
                "127.0.0.1:1",
                "--upstream",
                "127.0.0.1:2"
            ])
            .is_err()
        );
    }
}
