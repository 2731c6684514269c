//! Baton's control plane as `e2e/cluster.sh install` runs it: the operator
//! and webhook Deployments of `manifests/` (through `e2e/overlay`), two Pods
//! each. Helpers to find those Pods, wait for a Deployment to be whole
//! again, read the leader Lease, tell a process inside a Pod from one on the
//! host, and read the connection-tracking entries that show how the API
//! server reached the webhook.
//!
//! The parsers are pure and unit-tested; the rest reads the cluster or
//! `/proc` and never changes the host.

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use baton_crds::contract::SYSTEM_NAMESPACE;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::ListParams;
use kube::{Api, Client};

use crate::wait::{Check, Timeout, pod_state, wait_for};

/// Namespace label a test's SidecarRelease selects (value: the namespace).
pub const RELEASE_SCOPE_LABEL: &str = "baton.dev/e2e-release";

/// The operator Service's ClusterIP, pinned by `e2e/overlay` (no DNS on
/// this cluster), which the webhook injects as the control-plane address.
pub const OPERATOR_CLUSTER_IP: &str = "10.96.0.20";
/// The Lease the operator replicas elect a leader with.
pub const OPERATOR_LEASE: &str = "baton-operator";
/// The operator's lease duration (`--lease-seconds` default).
pub const LEASE_DURATION: Duration = Duration::from_secs(15);

/// Deployment (and `app.kubernetes.io/name`) of a component:
/// `baton-operator`, `baton-webhook`.
pub fn deployment_name(component: &str) -> String {
    format!("baton-{component}")
}

/// The Pods of a component, terminating ones included.
pub async fn component_pods(client: &Client, component: &str) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let selector = format!("app.kubernetes.io/name={}", deployment_name(component));
    api.list(&ListParams::default().labels(&selector))
        .await
        .unwrap_or_else(|e| panic!("listing {selector} pods: {e}"))
        .items
}

/// Whether the Pod is Ready and not being deleted.
pub fn serving(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Waits until the component's Deployment has exactly its `spec.replicas`
/// Pods, all Ready, none terminating. Returns them.
pub async fn wait_whole(
    client: &Client,
    component: &str,
    timeout: Duration,
) -> Result<Vec<Pod>, Timeout> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let name = deployment_name(component);
    wait_for(&format!("deployment {name} whole"), timeout, || {
        let (deployments, name) = (deployments.clone(), name.clone());
        async move {
            let want = match deployments.get(&name).await {
                Ok(d) => d.spec.and_then(|s| s.replicas).unwrap_or(1),
                Err(e) => return Check::NotYet(format!("get deployment: {e}")),
            };
            let pods = component_pods(client, component).await;
            let ready = pods.iter().filter(|p| serving(p)).count();
            if pods.len() == usize::try_from(want).unwrap_or(0) && ready == pods.len() {
                Check::Done(pods)
            } else {
                Check::NotYet(format!(
                    "want {want} ready pods, have: {}",
                    pods.iter()
                        .map(|p| format!(
                            "{} {}{}",
                            p.metadata.name.as_deref().unwrap_or("?"),
                            pod_state(p),
                            if p.metadata.deletion_timestamp.is_some() {
                                " (terminating)"
                            } else {
                                ""
                            }
                        ))
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            }
        }
    })
    .await
}

/// The holder of the operator's leader Lease, if any.
pub async fn lease_holder(client: &Client) -> Option<String> {
    let api: Api<Lease> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    api.get_opt(OPERATOR_LEASE)
        .await
        .unwrap_or_else(|e| panic!("reading Lease {OPERATOR_LEASE}: {e}"))
        .and_then(|l| l.spec?.holder_identity)
        .filter(|h| !h.is_empty())
}

/// The ClusterIP of a Service in the system namespace.
pub async fn cluster_ip(client: &Client, service: &str) -> IpAddr {
    let api: Api<Service> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let svc = api
        .get(service)
        .await
        .unwrap_or_else(|e| panic!("service {service}: {e}"));
    svc.spec
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("service {service} has no ClusterIP"))
}

/// The version of the releases [`create_release`] makes.
pub const RELEASE_VERSION: &str = "0.1.0-e2e";

/// Labels of a namespace opted in to injection and selected by the release
/// [`create_release`] makes for it.
pub fn injected_namespace_labels(scope: &str) -> std::collections::BTreeMap<String, String> {
    use baton_crds::contract::labels;
    [
        (labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned()),
        (RELEASE_SCOPE_LABEL.to_owned(), scope.to_owned()),
    ]
    .into()
}

/// A cluster-scoped SidecarRelease named `name` that governs the namespaces
/// labelled `RELEASE_SCOPE_LABEL=<scope>` (ahead of any other release). The
/// caller deletes it ([`delete_release`]).
///
/// Each slot requests 10m CPU instead of the webhook's default 50m: both
/// slots carry the release's requests (docs/decisions/0035), and the suite's
/// test binaries run at once on a 2-CPU node, where 100m per meshed Pod
/// would leave later Pods Pending. The tests that are about the defaults or
/// the rollout's resources create their own releases (`rollout.rs`).
pub async fn create_release(
    client: &Client,
    name: &str,
    scope: &str,
) -> baton_crds::SidecarRelease {
    let release: baton_crds::SidecarRelease = serde_json::from_value(serde_json::json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
        "metadata": {"name": name},
        "spec": {
            "version": RELEASE_VERSION,
            "image": crate::pods::image("sidecar"),
            "emptyImage": crate::pods::image("empty"),
            "namespaceSelector": {"matchLabels": {RELEASE_SCOPE_LABEL: scope}},
            "priority": 1000,
            "resources": {
                "requests": {"cpu": "10m", "memory": "32Mi"},
                "limits": {"memory": "128Mi"}
            },
        },
    }))
    .expect("release");
    Api::<baton_crds::SidecarRelease>::all(client.clone())
        .create(&kube::api::PostParams::default(), &release)
        .await
        .unwrap_or_else(|e| panic!("creating SidecarRelease {name}: {e}"))
}

/// Deletes a release made by [`create_release`] (errors only logged: this
/// runs in clean-up).
pub async fn delete_release(client: &Client, name: &str) {
    let api = Api::<baton_crds::SidecarRelease>::all(client.clone());
    if let Err(error) = api.delete(name, &kube::api::DeleteParams::default()).await {
        tracing::warn!(%error, "deleting SidecarRelease {name}");
    }
}

/// A Pod that is admitted (and so injected) like any other but never
/// scheduled: its nodeSelector matches no node. Admission is what these
/// tests measure; 50 meshed Pods starting at once would only measure the
/// machine's two cores.
pub fn unscheduled_pod(name: &str) -> Pod {
    let mut pod = crate::pods::pod(
        name,
        vec![crate::pods::container("app", "demo-http-echo", &[])],
    );
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_selector = Some([("baton.dev/e2e-never".to_owned(), "true".to_owned())].into());
    }
    pod
}

/// The SidecarRelease's status, once its `total` is `want`.
pub async fn wait_release_total(
    client: &Client,
    name: &str,
    want: i32,
    timeout: Duration,
) -> Result<baton_crds::SidecarReleaseStatus, Timeout> {
    let api = Api::<baton_crds::SidecarRelease>::all(client.clone());
    wait_for(
        &format!("SidecarRelease {name} status.total={want}"),
        timeout,
        || {
            let api = api.clone();
            async move {
                match api.get(name).await {
                    Ok(r) => match r.status {
                        Some(s) if s.total == want => Check::Done(s),
                        other => Check::NotYet(format!("{other:?}")),
                    },
                    Err(e) => Check::NotYet(e.to_string()),
                }
            }
        },
    )
    .await
}

/// A process on this machine running one of Baton's binaries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatonProcess {
    pub pid: u32,
    pub exe: String,
    /// Whether it runs inside a Pod (its cgroup is under `kubepods`).
    pub in_pod: bool,
    /// Its `/proc/<pid>/cgroup` (names the Pod's UID when it is in one).
    pub cgroup: String,
}

impl BatonProcess {
    /// Whether it runs in the Pod with this UID (the cgroup path names it,
    /// with `_` for `-` under the systemd driver).
    pub fn in_pod_uid(&self, uid: &str) -> bool {
        self.in_pod && (self.cgroup.contains(uid) || self.cgroup.contains(&uid.replace('-', "_")))
    }
}

/// How a process runs: its effective UID and whether its root filesystem
/// (`/` in its mount namespace) is mounted read-only. Read from `/proc`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    pub euid: u32,
    pub root_read_only: bool,
}

/// The effective UID of a `/proc/<pid>/status` text.
pub fn effective_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|id| id.parse().ok())
}

/// Whether the root of a `/proc/<pid>/mountinfo` text is mounted read-only:
/// the per-mount options (field 6) of the last mount on `/` (the one on top).
pub fn root_read_only(mountinfo: &str) -> Option<bool> {
    mountinfo
        .lines()
        .rev()
        .find_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            (fields.get(4) == Some(&"/")).then(|| fields.get(5).copied())?
        })
        .map(|opts| opts.split(',').any(|o| o == "ro"))
}

/// How process `pid` runs (read-only scan of `/proc/<pid>`).
pub fn confinement(pid: u32) -> Result<Confinement, String> {
    let read = |f: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/{f}"))
            .map_err(|e| format!("/proc/{pid}/{f}: {e}"))
    };
    let status = read("status")?;
    let mountinfo = read("mountinfo")?;
    Ok(Confinement {
        euid: effective_uid(&status).ok_or(format!("/proc/{pid}/status: no Uid line"))?,
        root_read_only: root_read_only(&mountinfo)
            .ok_or(format!("/proc/{pid}/mountinfo: no mount on /"))?,
    })
}

/// Whether a `/proc/<pid>/cgroup` text places the process in a Pod.
pub fn cgroup_is_a_pod(cgroup: &str) -> bool {
    cgroup
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .any(|path| path.starts_with("/kubepods"))
}

/// Every process whose executable's file name is one of `binaries`
/// (read-only scan of `/proc`).
pub fn baton_processes(binaries: &[&str]) -> Vec<BatonProcess> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(exe) = std::fs::read_link(entry.path().join("exe")) else {
            continue;
        };
        let exe = exe
            .to_string_lossy()
            .trim_end_matches(" (deleted)")
            .to_owned();
        let name = exe.rsplit('/').next().unwrap_or_default();
        if !binaries.contains(&name) {
            continue;
        }
        let cgroup = std::fs::read_to_string(entry.path().join("cgroup")).unwrap_or_default();
        found.push(BatonProcess {
            pid,
            exe: exe.clone(),
            in_pod: cgroup_is_a_pod(&cgroup),
            cgroup,
        });
    }
    found
}

/// One tracked TCP connection: where it was sent and who answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flow {
    pub orig_src: IpAddr,
    pub orig_dst: SocketAddr,
    /// The source of the replies: differs from `orig_dst` after a DNAT.
    pub reply_src: SocketAddr,
}

/// Parses `conntrack -L` lines (the first `src=/dst=/sport=/dport=` group is
/// the original direction, the second the reply).
pub fn parse_conntrack(text: &str) -> Vec<Flow> {
    text.lines()
        .filter_map(|line| {
            let mut src = Vec::new();
            let mut dst = Vec::new();
            let mut sport = Vec::new();
            let mut dport = Vec::new();
            for word in line.split_whitespace() {
                if let Some((k, v)) = word.split_once('=') {
                    match k {
                        "src" => src.push(v),
                        "dst" => dst.push(v),
                        "sport" => sport.push(v),
                        "dport" => dport.push(v),
                        _ => {}
                    }
                }
            }
            let addr = |ip: &str, port: &str| -> Option<SocketAddr> {
                Some(SocketAddr::new(ip.parse().ok()?, port.parse().ok()?))
            };
            Some(Flow {
                orig_src: src.first()?.parse().ok()?,
                orig_dst: addr(dst.first()?, dport.first()?)?,
                reply_src: addr(src.get(1)?, sport.get(1)?)?,
            })
        })
        .collect()
}

/// Tracked TCP connections sent to `dst` (read-only `conntrack -L`).
pub fn flows_to(dst: SocketAddr) -> Vec<Flow> {
    let out = Command::new("conntrack")
        .args(["-L", "-p", "tcp", "-d"])
        .arg(dst.ip().to_string())
        .args(["--dport", &dst.port().to_string()])
        .output()
        .expect("running conntrack -L");
    parse_conntrack(&String::from_utf8_lossy(&out.stdout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cgroup_under_kubepods_is_a_pod_and_a_login_session_is_not() {
        assert!(cgroup_is_a_pod(
            "12:memory:/kubepods/burstable/pod1234/abcdef\n11:cpu,cpuacct:/kubepods/burstable/pod1234/abcdef\n"
        ));
        assert!(cgroup_is_a_pod(
            "0::/kubepods.slice/kubepods-pod1.slice/x\n"
        ));
        assert!(!cgroup_is_a_pod("12:memory:/user.slice\n0::/init.scope\n"));
        assert!(!cgroup_is_a_pod(""));
    }

    #[test]
    fn conntrack_lines_give_the_original_destination_and_the_replying_endpoint() {
        let text = "tcp      6 86397 ESTABLISHED src=10.88.0.1 dst=10.96.14.7 sport=51000 dport=8443 \
                    src=10.88.0.9 dst=10.88.0.1 sport=8443 dport=51000 [ASSURED] mark=0 use=1\n\
                    conntrack v1.4.7 (conntrack-tools): 1 flow entries have been shown.\n";
        assert_eq!(
            parse_conntrack(text),
            vec![Flow {
                orig_src: "10.88.0.1".parse().unwrap(),
                orig_dst: "10.96.14.7:8443".parse().unwrap(),
                reply_src: "10.88.0.9:8443".parse().unwrap(),
            }]
        );
    }

    #[test]
    fn the_effective_uid_and_the_root_mounts_options_are_read_from_proc() {
        let status = "Name:\tbaton-sidecar\nUid:\t0\t65532\t65532\t65532\nGid:\t0\t0\t0\t0\n";
        assert_eq!(effective_uid(status), Some(65532));
        assert_eq!(effective_uid("Name:\tx\n"), None);
        // A container's root (overlay, read-only), then a bind mount on top
        // of other paths; the host's root is read-write.
        let container = "1201 1100 0:312 / / ro,relatime master:1 - overlay overlay rw,lowerdir=/a\n\
                         1202 1201 0:313 / /proc rw,nosuid - proc proc rw\n\
                         1210 1201 253:1 /x /etc/hosts rw,relatime - ext4 /dev/vda rw\n";
        assert_eq!(root_read_only(container), Some(true));
        let host = "25 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n";
        assert_eq!(root_read_only(host), Some(false));
        // Remounted: the last mount on / is the one in effect.
        assert_eq!(
            root_read_only(&format!(
                "{host}26 25 253:1 / / ro,relatime - ext4 /dev/vda rw\n"
            )),
            Some(true)
        );
        assert_eq!(
            root_read_only("1202 1201 0:313 / /proc rw - proc proc rw\n"),
            None
        );
    }
}
