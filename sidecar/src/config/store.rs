//! The apply path: validate → compile → build upstream state → swap.
//!
//! The serving state is one `Arc<Active>` behind an [`ArcSwap`]. A request
//! loads it once (`load_full`) and keeps that `Arc` until it finishes, so
//! in-flight requests complete on the snapshot they started with while new
//! ones see the new snapshot immediately. A refused snapshot never touches
//! the serving state.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::watch;

use super::{CompiledConfig, ConfigError, Snapshot, TlsRefusal, TlsSettings, compile, yaml};
use crate::metrics::Metrics;
use crate::upstream::{Originator, UpstreamDeps, Upstreams};

/// What requests are served from.
#[derive(Debug)]
pub struct Active {
    pub config: CompiledConfig,
    pub upstreams: Upstreams,
}

/// Called with the `tls` section of a validated snapshot before it is
/// swapped in; an `Err` refuses the whole snapshot. The TLS layer installs
/// one with [`ConfigStore::set_tls_hook`] to validate and stage its state.
pub type TlsHook = Arc<dyn Fn(Option<&TlsSettings>) -> Result<(), TlsRefusal> + Send + Sync>;

pub struct ConfigStore {
    current: ArcSwap<Active>,
    metrics: Arc<Metrics>,
    /// What clusters are built with (metrics, the TLS originator).
    deps: UpstreamDeps,
    /// Serializes appliers (file watcher, operator stream, handoff) so
    /// "previous state" reuse is consistent.
    apply_lock: std::sync::Mutex<()>,
    tls_hook: std::sync::Mutex<Option<TlsHook>>,
    version_tx: watch::Sender<u64>,
}

impl std::fmt::Debug for ConfigStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigStore")
            .field("version", &self.version())
            .finish()
    }
}

impl ConfigStore {
    /// A store serving `snapshot`, which must be valid.
    pub fn new(snapshot: &Snapshot, metrics: Arc<Metrics>) -> Result<Self, ConfigError> {
        let config = compile(snapshot)?;
        let deps = UpstreamDeps::new(metrics.clone());
        let upstreams = Upstreams::build(&snapshot.clusters, None, &deps);
        metrics.config_version.set(snapshot.version as i64);
        metrics.config_applies.inc();
        let (version_tx, _) = watch::channel(snapshot.version);
        Ok(Self {
            current: ArcSwap::from_pointee(Active { config, upstreams }),
            metrics,
            deps,
            apply_lock: std::sync::Mutex::new(()),
            tls_hook: std::sync::Mutex::new(None),
            version_tx,
        })
    }

    /// Installs the TLS layer's originator for clusters with `mtls` (every
    /// cluster, current and future, sees it on its next new connection).
    pub fn set_originator(&self, o: Arc<dyn Originator>) {
        self.deps.originator.set(o);
    }

    pub fn set_tls_hook(&self, hook: TlsHook) {
        *self.tls_hook.lock().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    /// The serving state; hold the `Arc` for the whole request.
    pub fn load(&self) -> Arc<Active> {
        self.current.load_full()
    }

    /// The serving snapshot (for `/config` and the handoff).
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load().config.snapshot.clone()
    }

    pub fn version(&self) -> u64 {
        self.current.load().config.snapshot.version
    }

    /// Notified with the version after every successful apply.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version_tx.subscribe()
    }

    /// Validate and swap in `snapshot`; on error the serving state is kept.
    pub fn apply(&self, snapshot: &Snapshot) -> Result<(), ConfigError> {
        let _serial = self.apply_lock.lock().unwrap_or_else(|e| e.into_inner());
        let result = self.apply_locked(snapshot);
        match &result {
            Ok(()) => {
                self.metrics.config_applies.inc();
                self.metrics.config_version.set(snapshot.version as i64);
                tracing::info!(version = snapshot.version, "config applied");
                self.version_tx.send_replace(snapshot.version);
            }
            Err(e) => {
                self.metrics
                    .config_apply_errors
                    .get_or_create(&vec![("reason", e.metric_label())])
                    .inc();
                tracing::error!(version = snapshot.version, error = %e, "config refused; keeping the serving config");
            }
        }
        result
    }

    fn apply_locked(&self, snapshot: &Snapshot) -> Result<(), ConfigError> {
        let config = compile(snapshot)?;
        let hook = self
            .tls_hook
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(hook) = hook {
            hook(snapshot.tls.as_ref()).map_err(ConfigError::Tls)?;
        }
        let previous = self.current.load();
        let upstreams = Upstreams::build(&snapshot.clusters, Some(&previous.upstreams), &self.deps);
        self.current.store(Arc::new(Active { config, upstreams }));
        Ok(())
    }

    /// Parse YAML text and apply it.
    pub fn apply_yaml(&self, text: &str) -> Result<(), ConfigError> {
        let snapshot = yaml::parse(text).inspect_err(|e| {
            self.metrics
                .config_apply_errors
                .get_or_create(&vec![("reason", "parse")])
                .inc();
            tracing::error!(error = %e, "config refused; keeping the serving config");
        })?;
        self.apply(&snapshot)
    }
}

/// Read and parse a config file.
pub fn load_file(path: &Path) -> Result<Snapshot, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.display().to_string(),
        source,
    })?;
    Ok(yaml::parse(&text)?)
}

fn content_hash(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// Poll `path` every `interval` and apply it when its content changes.
/// Polling (not inotify) because ConfigMap volumes swap symlinks, which
/// watchers miss, and a hash comparison is cheap at this size.
pub async fn watch_file(
    store: Arc<ConfigStore>,
    path: PathBuf,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut last = std::fs::read(&path).ok().map(|b| content_hash(&b));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = crate::lifecycle::wait_until(&mut stop, |s| *s) => return,
        }
        let Ok(bytes) = tokio::fs::read(&path).await else {
            continue;
        };
        let hash = content_hash(&bytes);
        if Some(hash) == last {
            continue;
        }
        // A writer that truncates and rewrites in place can be caught
        // mid-write: apply only content that is stable across two reads
        // (atomic rename-into-place writers, like ConfigMap volumes, always are).
        tokio::time::sleep(interval.min(Duration::from_millis(50))).await;
        match tokio::fs::read(&path).await {
            Ok(again) if content_hash(&again) == hash => {}
            _ => continue,
        }
        last = Some(hash);
        match std::str::from_utf8(&bytes) {
            Ok(text) if text.trim().is_empty() => {
                store
                    .metrics
                    .config_apply_errors
                    .get_or_create(&vec![("reason", "empty")])
                    .inc();
                tracing::error!(path = %path.display(), "config file is empty; keeping the serving config");
            }
            Ok(text) => {
                let _ = store.apply_yaml(text);
            }
            Err(_) => tracing::error!(path = %path.display(), "config file is not UTF-8; ignored"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "version: 1\nclusters: [{name: a, endpoints: ['127.0.0.1:1']}]\nroutes: [{name: r, backends: [{cluster: a}]}]\n";

    #[test]
    fn invalid_snapshot_is_refused_and_the_old_one_keeps_serving() {
        let m = Arc::new(Metrics::new());
        let store = ConfigStore::new(&yaml::parse(GOOD).unwrap(), m.clone()).unwrap();
        let before = store.load();
        let err = store
            .apply_yaml("version: 2\nroutes: [{name: r, backends: [{cluster: missing}]}]\n")
            .unwrap_err();
        assert!(
            err.to_string().contains("unknown cluster \"missing\""),
            "{err}"
        );
        assert_eq!(store.version(), 1);
        assert!(Arc::ptr_eq(&before, &store.load()));
        assert!(
            m.encode()
                .contains("baton_sidecar_config_apply_errors_total{reason=\"invalid\"} 1")
        );
        assert!(store.apply_yaml("not: [valid").is_err());
        assert!(m.encode().contains("reason=\"parse\""));
    }

    #[test]
    fn in_flight_holders_keep_their_snapshot_across_a_swap() {
        let store =
            ConfigStore::new(&yaml::parse(GOOD).unwrap(), Arc::new(Metrics::new())).unwrap();
        let held = store.load();
        store
            .apply_yaml(&GOOD.replace("version: 1", "version: 2"))
            .unwrap();
        assert_eq!(held.config.snapshot.version, 1);
        assert_eq!(store.version(), 2);
        assert!(
            Arc::ptr_eq(
                &held.upstreams.clusters[0],
                &store.load().upstreams.clusters[0]
            ),
            "unchanged cluster reused"
        );
    }

    #[test]
    fn tls_hook_can_refuse_a_snapshot() {
        let store =
            ConfigStore::new(&yaml::parse(GOOD).unwrap(), Arc::new(Metrics::new())).unwrap();
        store.set_tls_hook(Arc::new(|tls| match tls {
            Some(t) if t.session_resumption => Err("no session cache here".into()),
            _ => Ok(()),
        }));
        let err = store
            .apply_yaml(&format!("{GOOD}tls: {{mode: Disabled}}\n"))
            .unwrap_err();
        assert!(matches!(err, ConfigError::Tls(_)));
        assert_eq!(store.version(), 1);
    }
}
