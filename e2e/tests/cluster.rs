//! The cluster itself, before Baton is involved: plain pods run and serve
//! HTTP/1.1, HTTP/2 and TCP over the bridge; an init container with
//! NET_ADMIN can program iptables in the pod's network namespace; ClusterIP
//! Services work through kube-proxy from the host and from Pods, and Pods
//! reach the API server through the `kubernetes` Service; and no packet
//! leaves the machine (the harness's guard chains are in place, first, and
//! counting).
//!
//! `#[ignore]`d: run with `e2e/run.sh` (needs root and the local cluster).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use baton_e2e::demo::{HEADER_ORIGINAL_DST, HEADER_SERVER_PORT};
use baton_e2e::guards::{self, FORWARD_GUARD, OUTPUT_GUARD};
use baton_e2e::netns::OutsideNetns;
use baton_e2e::traffic::{self, Load, Protocol};
use baton_e2e::{pods, wait, with_temp_ns};
use k8s_openapi::api::core::v1::{Endpoints, Pod, Service};
use kube::api::{LogParams, PostParams};
use kube::{Api, Client};
use rand::Rng;
use tokio::io::AsyncReadExt;

const READY: Duration = Duration::from_secs(60);

async fn create(client: &Client, ns: &str, pod: &Pod) -> Api<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), pod)
        .await
        .unwrap_or_else(|e| panic!("creating pod {:?}: {e}", pod.metadata.name));
    api
}

async fn logs(api: &Api<Pod>, pod: &str, container: &str) -> String {
    let params = LogParams {
        container: Some(container.to_owned()),
        ..LogParams::default()
    };
    api.logs(pod, &params)
        .await
        .unwrap_or_else(|e| panic!("logs of {pod}/{container}: {e}"))
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn a_plain_pod_in_an_unlabelled_namespace_runs_untouched_and_serves_every_protocol() {
    with_temp_ns(|client, ns| async move {
        let mut pod = pods::http_echo("echo", 8080);
        let spec = pod.spec.as_mut().expect("pod spec");
        spec.containers.push(pods::container(
            "tcp",
            "demo-tcp-echo",
            &["--listen", "0.0.0.0:9000"],
        ));
        create(&client, &ns, &pod).await;
        let running = wait::pod_ready(&client, &ns, "echo", READY)
            .await
            .expect("pod Ready");

        // Untouched: exactly what was submitted, no init containers, no
        // Baton labels or annotations.
        let spec = running.spec.as_ref().expect("spec");
        let names: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["echo", "tcp"]);
        assert!(
            spec.init_containers.as_ref().is_none_or(Vec::is_empty),
            "{spec:#?}"
        );
        let meta = &running.metadata;
        let baton_keys: Vec<&String> = meta
            .labels
            .iter()
            .flatten()
            .chain(meta.annotations.iter().flatten())
            .map(|(k, _)| k)
            .filter(|k| k.starts_with("baton.dev/"))
            .collect();
        assert!(
            baton_keys.is_empty(),
            "unexpected Baton metadata: {baton_keys:?}"
        );

        let ip = wait::pod_ip(&running);
        for protocol in [Protocol::Http1, Protocol::Http2] {
            let report = traffic::run(
                SocketAddr::new(ip, 8080),
                &Load::new(protocol).exchanges(40),
            )
            .await;
            report.assert_all_ok();
        }
        let report = traffic::run(
            SocketAddr::new(ip, 9000),
            &Load::new(Protocol::Tcp)
                .exchanges(20)
                .payload_bytes(64 * 1024),
        )
        .await;
        report.assert_all_ok();
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn an_init_container_with_net_admin_programs_an_iptables_redirect_that_takes_effect() {
    with_temp_ns(|client, ns| async move {
        // The app listens on 9090 only; the init container redirects 8080 to it.
        let mut pod = pods::http_echo("redirected", 9090);
        let init = pods::with_net_admin(pods::shell(
            "iptables-init",
            "iptables -t nat -A PREROUTING -p tcp --dport 8080 -j REDIRECT --to-ports 9090 \
             && iptables -t nat -S PREROUTING",
        ));
        pod.spec.as_mut().expect("spec").init_containers = Some(vec![init]);
        let api = create(&client, &ns, &pod).await;
        let running = wait::pod_ready(&client, &ns, "redirected", READY)
            .await
            .expect("pod Ready");

        let rules = logs(&api, "redirected", "iptables-init").await;
        assert!(
            rules.contains("--dport 8080") && rules.contains("REDIRECT --to-ports 9090"),
            "the init container did not list its rule: {rules}"
        );

        let ip = wait::pod_ip(&running);
        let report = traffic::run(
            SocketAddr::new(ip, 8080),
            &Load::new(Protocol::Http1).exchanges(10),
        )
        .await;
        report.assert_all_ok();
        // Served by the 9090 listener, and the kernel kept the pre-NAT
        // destination: the redirect did it, not a listener on 8080.
        assert_eq!(
            report.header(HEADER_SERVER_PORT),
            Some("9090"),
            "{:?}",
            report.first_headers
        );
        assert_eq!(
            report.header(HEADER_ORIGINAL_DST),
            Some(SocketAddr::new(ip, 8080).to_string().as_str()),
            "{:?}",
            report.first_headers
        );
        // HTTP/2 streams go through the same redirect.
        traffic::run(
            SocketAddr::new(ip, 8080),
            &Load::new(Protocol::Http2).exchanges(10),
        )
        .await
        .assert_all_ok();
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn pods_cannot_reach_an_address_off_the_bridge_and_the_forward_guard_counts_the_drop() {
    with_temp_ns(|client, ns| async move {
        // "Outside": a namespace of our own, reachable from the host.
        let id = rand::rng().random_range(1..=250u8);
        let outside = OutsideNetns::create(id)
            .await
            .expect("creating the outside netns");
        let mut control = tokio::net::TcpStream::connect(outside.addr)
            .await
            .expect("the host reaches the outside namespace (control)");
        let mut greeting = String::new();
        control
            .read_to_string(&mut greeting)
            .await
            .expect("read greeting");
        assert_eq!(greeting, "outside\n");
        assert_eq!(outside.accepted(), 1);

        // A listener on the bridge gateway: what a pod may reach.
        let gateway: IpAddr = "10.88.0.1".parse().expect("gateway ip");
        let on_bridge = tokio::net::TcpListener::bind((gateway, 0))
            .await
            .expect("bind on the bridge");
        let bridge_port = on_bridge.local_addr().expect("addr").port();
        let accept_bridge =
            tokio::spawn(async move { on_bridge.accept().await.map(|(_, peer)| peer) });

        let before = guards::dropped_packets(
            &guards::read_chain("iptables", FORWARD_GUARD).expect("guard chain"),
        );
        let script = format!(
            "nc -w 3 {gateway} {bridge_port} </dev/null; echo bridge=$?; \
             nc -w 3 {outside_ip} {outside_port} </dev/null; echo outside=$?",
            outside_ip = outside.addr.ip(),
            outside_port = outside.addr.port(),
        );
        let mut prober = pods::pod("prober", vec![pods::shell("probe", &script)]);
        prober.spec.as_mut().expect("spec").restart_policy = Some("Never".to_owned());
        let api = create(&client, &ns, &prober).await;
        wait::pod_finished(&client, &ns, "prober", READY)
            .await
            .expect("prober finished");
        let output = logs(&api, "prober", "probe").await;

        assert!(
            output.contains("bridge=0"),
            "the pod could not reach the bridge gateway: {output}"
        );
        let peer = tokio::time::timeout(Duration::from_secs(5), accept_bridge)
            .await
            .expect("bridge listener accepted")
            .expect("accept task")
            .expect("accept");
        assert!(peer.ip().to_string().starts_with("10.88."), "peer {peer}");

        assert!(
            output.contains("outside=") && !output.contains("outside=0"),
            "the pod reached an address off the bridge: {output}"
        );
        assert_eq!(
            outside.accepted(),
            1,
            "the outside namespace saw a connection from the pod"
        );
        let after = guards::dropped_packets(
            &guards::read_chain("iptables", FORWARD_GUARD).expect("guard chain"),
        );
        assert!(
            after > before,
            "the forward guard did not count the pod's SYNs (before {before}, after {after})"
        );
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn egress_guards_come_first_and_nothing_tried_the_metadata_address() {
    // Fails clearly when run with --ignored but without the cluster.
    baton_e2e::cluster::kubeconfig_path();
    for tool in ["iptables", "ip6tables"] {
        assert!(
            guards::jumps_first(tool, "FORWARD", FORWARD_GUARD).expect("read FORWARD"),
            "{tool} FORWARD does not jump to {FORWARD_GUARD} first"
        );
        assert!(
            guards::jumps_first(tool, "OUTPUT", OUTPUT_GUARD).expect("read OUTPUT"),
            "{tool} OUTPUT does not jump to {OUTPUT_GUARD} first"
        );
        let fwd = guards::read_chain(tool, FORWARD_GUARD).expect("forward guard");
        assert_eq!(
            fwd.iter().map(|r| r.spec.as_str()).collect::<Vec<_>>(),
            [format!(
                "-i {} ! -o {} -j DROP",
                guards::BRIDGE,
                guards::BRIDGE
            )]
        );
    }
    let out = guards::read_chain("iptables", OUTPUT_GUARD).expect("output guard");
    assert_eq!(
        out.iter().map(|r| r.spec.as_str()).collect::<Vec<_>>(),
        ["-d 169.254.0.0/16 -j DROP", "-d 10.96.0.0/16 -j DROP"]
    );
    // The kubelet runs with AWS_EC2_METADATA_DISABLED=true and nothing else
    // in the cluster has a reason to try the metadata address: zero drops.
    assert_eq!(
        guards::dropped_packets(&out[..1]),
        0,
        "something on the host sent to 169.254.0.0/16: {out:?}"
    );
}

/// A ClusterIP Service in front of `pod`'s `port`; waits until its
/// Endpoints list the pod (kube-proxy programs it from there).
async fn service_for(client: &Client, ns: &str, pod: &str, port: u16) -> SocketAddr {
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": pod},
        "spec": {"selector": {"app": pod}, "ports": [{"port": port, "targetPort": port, "protocol": "TCP"}]},
    }))
    .expect("service");
    let api: Api<Service> = Api::namespaced(client.clone(), ns);
    let created = api
        .create(&PostParams::default(), &svc)
        .await
        .expect("create service");
    let ip: IpAddr = created
        .spec
        .and_then(|s| s.cluster_ip)
        .expect("a ClusterIP")
        .parse()
        .expect("ClusterIP parses");
    let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), ns);
    baton_e2e::wait_for("the Service's endpoints", READY, || async {
        match endpoints.get_opt(pod).await {
            Ok(Some(e))
                if e.subsets
                    .iter()
                    .flatten()
                    .any(|s| s.addresses.as_ref().is_some_and(|a| !a.is_empty())) =>
            {
                baton_e2e::Check::Done(())
            }
            other => baton_e2e::Check::NotYet(format!("{other:?}")),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    SocketAddr::new(ip, port)
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn a_cluster_ip_service_reaches_its_pod_from_the_host_and_from_another_pod() {
    with_temp_ns(|client, ns| async move {
        create(&client, &ns, &pods::http_echo("echo", 8080)).await;
        let echo = wait::pod_ready(&client, &ns, "echo", READY)
            .await
            .expect("echo Ready");
        let vip = service_for(&client, &ns, "echo", 8080).await;
        assert!(vip.ip().to_string().starts_with("10.96."), "{vip}");

        // From the host: kube-proxy's OUTPUT rules translate the VIP. kube-proxy
        // may take a sync period to program a new Service: retry the first
        // exchange, then demand a clean run.
        baton_e2e::wait_for("the ClusterIP answering from the host", READY, || async {
            let report = traffic::run(vip, &Load::new(Protocol::Http1).exchanges(1)).await;
            if report.ok() {
                baton_e2e::Check::Done(())
            } else {
                baton_e2e::Check::NotYet(format!("{report:?}"))
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let report = traffic::run(vip, &Load::new(Protocol::Http1).exchanges(50)).await;
        report.assert_all_ok();
        assert_eq!(
            report.header("x-echo-server-name"),
            echo.metadata.name.as_deref()
        );

        // From another pod (routed through the host, DNATed in PREROUTING; the
        // reply crosses the bridge back through conntrack).
        let script = format!("wget -S -O /dev/null http://{vip}/ 2>&1; echo wget=$?",);
        let mut prober = pods::pod("prober", vec![pods::shell("probe", &script)]);
        prober.spec.as_mut().expect("spec").restart_policy = Some("Never".to_owned());
        let api = create(&client, &ns, &prober).await;
        wait::pod_finished(&client, &ns, "prober", READY)
            .await
            .expect("prober finished");
        let output = logs(&api, "prober", "probe").await;
        assert!(output.contains("wget=0"), "{output}");
        assert!(
            output.to_lowercase().contains("x-echo-server-name: echo"),
            "the answer did not come from the echo pod: {output}"
        );
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn pods_reach_the_api_server_through_the_kubernetes_service() {
    with_temp_ns(|client, ns| async move {
        // The API server's endpoint reconciler publishes its advertise
        // address, the bridge gateway, which Pods can reach.
        let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), "default");
        let published = endpoints
            .get("kubernetes")
            .await
            .expect("kubernetes endpoints");
        let addresses: Vec<String> = published
            .subsets
            .iter()
            .flatten()
            .flat_map(|s| s.addresses.iter().flatten().map(|a| a.ip.clone()))
            .collect();
        assert_eq!(addresses, ["10.88.0.1"], "{published:?}");
        let services: Api<Service> = Api::namespaced(client.clone(), "default");
        let vip = services
            .get("kubernetes")
            .await
            .expect("kubernetes service")
            .spec
            .and_then(|s| s.cluster_ip)
            .expect("ClusterIP");

        // A TLS ClientHello's worth of bytes is not needed: a completed TCP
        // handshake through the VIP is what kube-proxy provides; the
        // operator and webhook Pods prove the HTTPS part (e2e/tests/install.rs).
        let script = format!("nc -w 3 {vip} 443 </dev/null; echo api=$?");
        let mut prober = pods::pod("prober", vec![pods::shell("probe", &script)]);
        prober.spec.as_mut().expect("spec").restart_policy = Some("Never".to_owned());
        let api = create(&client, &ns, &prober).await;
        wait::pod_finished(&client, &ns, "prober", READY)
            .await
            .expect("prober finished");
        let output = logs(&api, "prober", "probe").await;
        assert!(
            output.contains("api=0"),
            "the pod could not connect to {vip}:443: {output}"
        );
    })
    .await;
}
