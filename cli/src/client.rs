//! The user's cluster, reached as kubectl reaches it (kubeconfig, context,
//! namespace), with every call bounded.

use std::future::Future;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::sync::OnceCell;

use crate::{Format, Global};

/// What every command works with: the flags, and a client made on first use
/// (`inject` never makes one).
pub struct Ctx {
    pub global: Global,
    client: OnceCell<(kube::Client, String)>,
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("global", &self.global)
            .finish_non_exhaustive()
    }
}

impl Ctx {
    pub fn new(global: Global) -> Self {
        Self {
            global,
            client: OnceCell::new(),
        }
    }

    /// A context whose client is given (tests: tower-test's mock API server).
    pub fn with_client(global: Global, client: kube::Client, namespace: &str) -> Self {
        Self {
            global,
            client: OnceCell::new_with(Some((client, namespace.to_owned()))),
        }
    }

    pub fn timeout(&self) -> Duration {
        self.global.timeout
    }

    pub fn output(&self) -> Format {
        self.global.output
    }

    /// The client, made from the kubeconfig on first use. Its connect, read
    /// and write timeouts are `--timeout`, so no single call can hang.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        Ok(self.client_and_namespace().await?.0.clone())
    }

    /// `-n`, else the context's namespace, else `default`.
    pub async fn namespace(&self) -> anyhow::Result<String> {
        if let Some(ns) = &self.global.namespace {
            return Ok(ns.clone());
        }
        Ok(self.client_and_namespace().await?.1.clone())
    }

    /// `None` for `-A`, else [`Self::namespace`].
    pub async fn namespace_scope(&self) -> anyhow::Result<Option<String>> {
        if self.global.all_namespaces {
            Ok(None)
        } else {
            Ok(Some(self.namespace().await?))
        }
    }

    async fn client_and_namespace(&self) -> anyhow::Result<&(kube::Client, String)> {
        self.client
            .get_or_try_init(|| async {
                let config = self.kube_config().await?;
                let namespace = config.default_namespace.clone();
                let client = kube::Client::try_from(config)
                    .context("cannot build a Kubernetes client from the kubeconfig")?;
                Ok::<_, anyhow::Error>((client, namespace))
            })
            .await
    }

    async fn kube_config(&self) -> anyhow::Result<kube::Config> {
        let options = KubeConfigOptions {
            context: self.global.context.clone(),
            ..KubeConfigOptions::default()
        };
        let mut config = match &self.global.kubeconfig {
            Some(path) => {
                let kc = Kubeconfig::read_from(path)
                    .with_context(|| format!("cannot read the kubeconfig {}", path.display()))?;
                kube::Config::from_custom_kubeconfig(kc, &options)
                    .await
                    .with_context(|| format!("kubeconfig {}", path.display()))?
            }
            None if self.global.context.is_some() => kube::Config::from_kubeconfig(&options)
                .await
                .context("cannot load the kubeconfig (~/.kube/config)")?,
            None => kube::Config::infer().await.context(
                "no cluster configured: set KUBECONFIG, pass --kubeconfig, or run in a Pod",
            )?,
        };
        let t = self.timeout();
        config.connect_timeout = Some(t);
        config.read_timeout = Some(t);
        config.write_timeout = Some(t);
        Ok(config)
    }

    /// Runs `what` within `--timeout`; past it, an error that names the
    /// step and the API server, so an unreachable cluster fails fast and
    /// clearly.
    pub async fn bounded<T>(
        &self,
        step: &str,
        what: impl Future<Output = anyhow::Result<T>>,
    ) -> anyhow::Result<T> {
        match tokio::time::timeout(self.timeout(), what).await {
            Ok(r) => r,
            Err(_) => Err(anyhow!(
                "{step}: no answer from the API server within {:?} (--timeout); is the cluster reachable (kubectl cluster-info)?",
                self.timeout()
            )),
        }
    }
}
