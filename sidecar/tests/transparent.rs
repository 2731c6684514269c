//! Transparent capture end to end: a network namespace created by the test,
//! real iptables REDIRECT rules programmed by `baton-sidecar init`, a client
//! running as an unprivileged uid, and the sidecar recovering the original
//! destination with SO_ORIGINAL_DST. Nothing leaves the namespace.
#![allow(unsafe_code)]

use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use baton_sidecar::config::yaml;
use baton_sidecar::server::{StartOptions, start};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::AsyncWriteExt;

/// The upstream's address, in the second namespace (reached over a veth
/// pair, so traffic to it leaves through an interface and is captured).
const NS_IP: &str = "10.77.0.1";

/// Deletes the namespaces (and with them every rule and link inside) on
/// drop, even when the test fails.
struct NetNs(Vec<String>);

impl Drop for NetNs {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn sh(args: &[&str]) -> Result<String, String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args[0]))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// `pod` (client + sidecar) and `peer` (upstreams), joined by a veth pair.
fn setup(pod: &str, peer: &str) -> Result<NetNs, String> {
    let mut guard = NetNs(Vec::new());
    for ns in [pod, peer] {
        sh(&["ip", "netns", "add", ns])?;
        guard.0.push(ns.to_owned());
        sh(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
    }
    sh(&[
        "ip", "-n", pod, "link", "add", "v0", "type", "veth", "peer", "name", "v1", "netns", peer,
    ])?;
    sh(&["ip", "-n", pod, "addr", "add", "10.77.0.2/24", "dev", "v0"])?;
    sh(&[
        "ip",
        "-n",
        peer,
        "addr",
        "add",
        &format!("{NS_IP}/24"),
        "dev",
        "v1",
    ])?;
    sh(&["ip", "-n", pod, "link", "set", "v0", "up"])?;
    sh(&["ip", "-n", peer, "link", "set", "v1", "up"])?;
    Ok(guard)
}

/// Move the calling thread into the namespace (sockets it creates live there).
fn enter(ns: &str) -> std::io::Result<()> {
    let f = std::fs::File::open(format!("/var/run/netns/{ns}"))?;
    // SAFETY: setns on a valid, open namespace fd only changes this thread's
    // network namespace; the fd outlives the call.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[test]
fn transparent_capture_redirects_outbound_traffic_and_recovers_the_original_destination() {
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIP transparent capture test: needs root for ip netns and iptables");
        return;
    }
    let ns = format!("baton-tp-{}", std::process::id());
    let peer = format!("baton-tp-{}-up", std::process::id());
    let _guard = match setup(&ns, &peer) {
        Ok(g) => g,
        Err(e) => {
            println!("SKIP transparent capture test: the kernel refused the namespace setup: {e}");
            return;
        }
    };
    let bin = env!("CARGO_BIN_EXE_baton-sidecar");
    // The sidecar in this test runs as root (uid 0): exclude that uid, and
    // run the client as nobody so its traffic is captured.
    if let Err(e) = sh(&[
        "ip",
        "netns",
        "exec",
        &ns,
        bin,
        "init",
        "--proxy-uid",
        "0",
        "--no-inbound",
    ]) {
        println!("SKIP transparent capture test: iptables refused the rules: {e}");
        return;
    }
    let rules = sh(&[
        "ip",
        "netns",
        "exec",
        &ns,
        "iptables",
        "-t",
        "nat",
        "-S",
        "BATON_OUTPUT",
    ])
    .unwrap();
    assert!(rules.contains("--uid-owner 0 -j RETURN"), "{rules}");

    // Upstreams and the sidecar run on one thread inside the namespace.
    let (ready_tx, ready_rx) = mpsc::channel();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let (ns_thread, peer_thread) = (ns.clone(), peer.clone());
    let server = std::thread::spawn(move || {
        // Upstream sockets are created in the peer namespace, everything
        // else (the sidecar) in the pod namespace; a socket stays in the
        // namespace it was created in.
        enter(&peer_thread).expect("setns peer");
        let http_std = std::net::TcpListener::bind((NS_IP, 8080)).unwrap();
        let echo_std = std::net::TcpListener::bind((NS_IP, 9000)).unwrap();
        http_std.set_nonblocking(true).unwrap();
        echo_std.set_nonblocking(true).unwrap();
        enter(&ns_thread).expect("setns pod");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let http = tokio::net::TcpListener::from_std(http_std).unwrap();
            tokio::spawn(async move {
                loop {
                    let Ok((s, _)) = http.accept().await else { return };
                    tokio::spawn(async move {
                        let svc = hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                            let body = format!("upstream saw {}", req.uri().path());
                            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(body))))
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(s), svc)
                            .await;
                    });
                }
            });
            let echo = tokio::net::TcpListener::from_std(echo_std).unwrap();
            tokio::spawn(async move {
                loop {
                    let Ok((mut s, _)) = echo.accept().await else { return };
                    tokio::spawn(async move {
                        let _ = s.write_all(b"echo:").await;
                        let (mut r, mut w) = s.split();
                        let _ = tokio::io::copy(&mut r, &mut w).await;
                    });
                }
            });
            let snap = yaml::parse(
                "admin: {address: '127.0.0.1:15020'}
listeners:
- {name: outbound, address: '0.0.0.0:15001', capture: transparent, passthrough: true, detect_timeout_ms: 300}",
            )
            .unwrap();
            let running = start(snap, StartOptions::default()).await.unwrap();
            ready_tx.send(running.shared.clone()).unwrap();
            let _ = done_rx.await;
            running.stop().await;
        });
    });
    let shared = ready_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("sidecar started in the namespace");

    let as_nobody = |cmd: &[&str]| {
        let mut args = vec![
            "ip",
            "netns",
            "exec",
            &ns,
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ];
        args.extend_from_slice(cmd);
        sh(&args)
    };
    // HTTP: captured, routed by passthrough to the original destination.
    let body = as_nobody(&[
        "curl",
        "-sS",
        "-m",
        "5",
        &format!("http://{NS_IP}:8080/hello"),
    ])
    .unwrap();
    assert_eq!(body, "upstream saw /hello");
    // Raw TCP (the server speaks first): captured, detection times out, bytes flow.
    let tcp = as_nobody(&[
        "bash",
        "-c",
        &format!("exec 3<>/dev/tcp/{NS_IP}/9000; printf ping >&3; head -c 9 <&3"),
    ])
    .unwrap();
    assert_eq!(tcp, "echo:ping");

    let metrics = shared.metrics.encode();
    assert!(
        metrics
            .contains("baton_sidecar_requests_total{route=\"passthrough\",status_class=\"2xx\"} 1"),
        "the HTTP request went through the sidecar: {metrics}"
    );
    assert!(
        metrics
            .contains("baton_sidecar_connections_total{listener=\"outbound\",protocol=\"tcp\"} 1"),
        "the TCP stream went through the sidecar: {metrics}"
    );
    // Root's own traffic (the sidecar's uid here) is not captured.
    let direct = sh(&[
        "ip",
        "netns",
        "exec",
        &ns,
        "curl",
        "-sS",
        "-m",
        "5",
        &format!("http://{NS_IP}:8080/direct"),
    ])
    .unwrap();
    assert_eq!(direct, "upstream saw /direct");
    assert!(
        !shared.metrics.encode().contains("status_class=\"2xx\"} 2"),
        "excluded uid bypassed the sidecar"
    );

    let _ = done_tx.send(());
    server.join().unwrap();
}
