//! Pod specs for the e2e images (`docker.io/baton/<name>:<tag>`, imported by
//! `e2e/images.sh`, always `imagePullPolicy: Never`: nothing is ever pulled).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, Pod, PodSpec, SecurityContext,
};
use kube::api::ObjectMeta;

/// Image repository of every e2e image.
pub const IMAGE_REPO: &str = "docker.io/baton";

/// Fully-qualified name of an e2e image; the tag comes from
/// `BATON_IMAGE_TAG` (default `e2e`, what `e2e/images.sh` imports).
pub fn image(name: &str) -> String {
    let tag = std::env::var("BATON_IMAGE_TAG").unwrap_or_else(|_| "e2e".to_owned());
    format!("{IMAGE_REPO}/{name}:{tag}")
}

/// A container running an e2e image, never pulled.
pub fn container(name: &str, image_name: &str, args: &[&str]) -> Container {
    Container {
        name: name.to_owned(),
        image: Some(image(image_name)),
        image_pull_policy: Some("Never".to_owned()),
        args: (!args.is_empty()).then(|| args.iter().map(|a| (*a).to_owned()).collect()),
        ..Container::default()
    }
}

/// A pod with the given containers; fast to delete (grace period 1 s).
pub fn pod(name: &str, containers: Vec<Container>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([("app".to_owned(), name.to_owned())])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers,
            termination_grace_period_seconds: Some(1),
            automount_service_account_token: Some(false),
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// The HTTP/1.1 + HTTP/2 echo server listening on `port`.
pub fn http_echo(name: &str, port: u16) -> Pod {
    let mut c = container(
        "echo",
        "demo-http-echo",
        &["--listen", &format!("0.0.0.0:{port}")],
    );
    c.ports = Some(vec![ContainerPort {
        container_port: i32::from(port),
        name: Some("http".to_owned()),
        ..ContainerPort::default()
    }]);
    c.readiness_probe = Some(k8s_openapi::api::core::v1::Probe {
        tcp_socket: Some(k8s_openapi::api::core::v1::TCPSocketAction {
            port: k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i32::from(port)),
            ..Default::default()
        }),
        period_seconds: Some(1),
        ..Default::default()
    });
    pod(name, vec![c])
}

/// The TCP echo server listening on `port`.
pub fn tcp_echo(name: &str, port: u16) -> Pod {
    pod(
        name,
        vec![container(
            "echo",
            "demo-tcp-echo",
            &["--listen", &format!("0.0.0.0:{port}")],
        )],
    )
}

/// A `nettools` (busybox + iptables) container running `script` with `sh -c`.
pub fn shell(name: &str, script: &str) -> Container {
    let mut c = container(name, "nettools", &[]);
    c.command = Some(vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        script.to_owned(),
    ]);
    c
}

/// Adds NET_ADMIN (and NET_RAW, which iptables needs for some matches) and
/// runs the container as root, like a mesh's iptables init container.
pub fn with_net_admin(mut c: Container) -> Container {
    c.security_context = Some(SecurityContext {
        run_as_user: Some(0),
        run_as_non_root: Some(false),
        capabilities: Some(Capabilities {
            add: Some(vec!["NET_ADMIN".to_owned(), "NET_RAW".to_owned()]),
            drop: None,
        }),
        ..SecurityContext::default()
    });
    c
}
