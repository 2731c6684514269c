//! Certificate and trust-bundle rotation: under continuous load (new
//! handshakes and long-lived connections) not one request fails, new
//! handshakes see the new certificate, established connections are not
//! touched; the file watcher applies a complete rotation and ignores a
//! half-written one.

use crate::tls_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use baton_sidecar::tls::material::Material;
use baton_sidecar::tls::settings::{CertSource, TlsMode};
use baton_sidecar::tls::{TlsContext, TlsMetrics};
use rustls_pki_types::CertificateDer;
use tls_support::*;
use tokio::net::TcpStream;

/// A client without session resumption: a resumed TLS 1.3 session carries
/// no certificate, and rustls reports the original session's one, which would
/// hide what the server presents now.
fn probe_client(pki: &Pki, bundle: Vec<CertificateDer<'static>>) -> Arc<TlsContext> {
    let mut s = settings(TlsMode::Strict);
    s.session_resumption = false;
    let mut m = pki.leaf("probe", Key::P256);
    m.trust_bundle = bundle;
    context(&s, m)
}

/// The leaf certificate a full handshake sees now.
async fn server_leaf(
    client: &Arc<TlsContext>,
    addr: std::net::SocketAddr,
) -> CertificateDer<'static> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut s, _) = client
        .connector()
        .connect(tcp, &id("backend"), None)
        .await
        .unwrap();
    exchange(&mut s, "who").await.unwrap();
    s.get_ref().1.peer_certificates().unwrap()[0]
        .clone()
        .into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_under_load_fails_no_request_and_new_handshakes_see_the_new_certificate() {
    let ca1 = Pki::new("ca-1");
    let ca2 = Pki::new("ca-2");
    let server = context(&settings(TlsMode::Strict), ca1.leaf("backend", Key::P256));
    let client = context(&settings(TlsMode::Strict), ca1.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server.clone()).await;
    let probe = probe_client(&ca1, vec![ca1.ca_der(), ca2.ca_der()]);
    let first = server_leaf(&probe, srv.addr).await;

    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    // Long-lived connections established before any rotation.
    for n in 0..4 {
        let tcp = TcpStream::connect(srv.addr).await.unwrap();
        let (mut s, _) = client
            .connector()
            .connect(tcp, &id("backend"), None)
            .await
            .unwrap();
        let (stop, ok) = (stop.clone(), ok.clone());
        tasks.push(tokio::spawn(async move {
            use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
            let mut r = BufReader::new(&mut s);
            let mut line = String::new();
            r.read_line(&mut line).await.map_err(|e| e.to_string())?;
            // Bounded: at most 2,000 exchanges or until told to stop.
            for i in 0..2_000 {
                if stop.load(Ordering::SeqCst) && i > 0 {
                    break;
                }
                let msg = format!("long-{n}-{i}\n");
                r.get_mut()
                    .write_all(msg.as_bytes())
                    .await
                    .map_err(|e| e.to_string())?;
                r.get_mut().flush().await.map_err(|e| e.to_string())?;
                line.clear();
                r.read_line(&mut line).await.map_err(|e| e.to_string())?;
                if line != msg {
                    return Err(format!("echo mismatch: {line:?} != {msg:?}"));
                }
                ok.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Ok::<(), String>(())
        }));
    }
    // New connections (a full handshake each) while rotating.
    for _ in 0..4 {
        let (client, stop, ok, addr) = (client.clone(), stop.clone(), ok.clone(), srv.addr);
        tasks.push(tokio::spawn(async move {
            for i in 0..200 {
                if stop.load(Ordering::SeqCst) && i > 0 {
                    break;
                }
                mtls_round_trip(&client, addr, &id("backend")).await?;
                ok.fetch_add(1, Ordering::SeqCst);
            }
            Ok(())
        }));
    }

    // Five rotations; the third moves the server to a new CA, after the
    // client was given a bundle trusting both (the order a CA rollover uses).
    let mut last = None;
    for round in 0..5 {
        tokio::time::sleep(Duration::from_millis(60)).await;
        let mut m: Material = if round >= 2 {
            ca2.leaf("backend", Key::P256)
        } else {
            ca1.leaf("backend", Key::P256)
        };
        if round == 2 {
            let mut cm = ca1.leaf("frontend", Key::P256);
            cm.trust_bundle = vec![ca1.ca_der(), ca2.ca_der()];
            client.update_material(cm).unwrap();
        }
        m.trust_bundle = vec![ca1.ca_der(), ca2.ca_der()];
        last = Some(m.cert_chain[0].clone());
        server.update_material(m).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(60)).await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap().expect("a request failed during rotation");
    }
    assert!(
        ok.load(Ordering::SeqCst) > 20,
        "too little load to mean anything"
    );
    assert_eq!(server.metrics().material_generation.get(), 6);
    let now = server_leaf(&probe, srv.addr).await;
    assert_ne!(now, first);
    assert_eq!(Some(now), last);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_watcher_applies_a_complete_rotation_and_ignores_a_half_written_one() {
    let pki = Pki::new("mesh-ca");
    let dir = tempfile::tempdir().unwrap();
    let (chain, key, bundle) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("ca.pem"),
    );
    let pem = |der: &[u8], label: &str| {
        // Minimal PEM writer via openssl's base64.
        let b64 = openssl::base64::encode_block(der);
        let body: Vec<String> = b64
            .as_bytes()
            .chunks(64)
            .map(|c| String::from_utf8(c.to_vec()).unwrap())
            .collect();
        format!(
            "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
            body.join("\n")
        )
    };
    let write = |m: &Material, which: &str| {
        if which.contains('c') {
            std::fs::write(&chain, pem(&m.cert_chain[0], "CERTIFICATE")).unwrap();
        }
        if which.contains('k') {
            std::fs::write(&key, pem(m.key.secret_der(), "PRIVATE KEY")).unwrap();
        }
        if which.contains('b') {
            std::fs::write(&bundle, pem(&m.trust_bundle[0], "CERTIFICATE")).unwrap();
        }
    };
    let a = pki.leaf("backend", Key::P256);
    write(&a, "ckb");
    let mut s = settings(TlsMode::Strict);
    s.source = Some(CertSource::Files {
        cert_chain: chain.clone(),
        key: key.clone(),
        trust_bundle: bundle.clone(),
        poll_interval_ms: 25,
    });
    let server = TlsContext::from_files(&s, TlsMetrics::default()).unwrap();
    let _watcher = server.watch_files().unwrap();
    let client = probe_client(&pki, vec![pki.ca_der()]);
    let srv = EchoServer::start(server.clone()).await;
    assert_eq!(server_leaf(&client, srv.addr).await, a.cert_chain[0]);

    // Half-way through a rotation: the new key is there, the new cert not
    // yet. The pair does not match, so nothing changes.
    let b = pki.leaf("backend", Key::P384);
    write(&b, "k");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(server.metrics().material_generation.get(), 1);
    assert_eq!(server_leaf(&client, srv.addr).await, a.cert_chain[0]);

    // The rotation completes: the new pair is served (bounded wait).
    write(&b, "c");
    let mut served = None;
    for _ in 0..200 {
        let leaf = server_leaf(&client, srv.addr).await;
        if leaf == b.cert_chain[0] {
            served = Some(leaf);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(served.is_some(), "rotated certificate never served");
    assert_eq!(server.metrics().material_generation.get(), 2);
}

#[test]
fn material_whose_key_does_not_match_the_certificate_is_refused_and_the_old_stays() {
    let pki = Pki::new("mesh-ca");
    let server = context(&settings(TlsMode::Strict), pki.leaf("backend", Key::P256));
    let mut bad = pki.leaf("backend", Key::P256);
    bad.key = pki.leaf("backend", Key::P256).key;
    let err = server.update_material(bad).unwrap_err();
    assert!(err.to_string().contains("does not match"), "{err}");
    assert_eq!(server.metrics().material_generation.get(), 1);
}

#[test]
fn a_certificate_naming_another_workload_is_refused_and_the_old_stays() {
    // A TlsPolicy's Secret is mounted as files; the snapshot names the
    // workload's identity, and peers expect exactly that one.
    let pki = Pki::new("mesh-ca");
    let mut s = settings(TlsMode::Strict);
    s.identity.local = Some(id("backend").to_string());
    let server = context(&s, pki.leaf("backend", Key::P256));
    let err = server
        .update_material(pki.leaf("frontend", Key::P256))
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&id("frontend").to_string()) && msg.contains(&id("backend").to_string()),
        "{msg}"
    );
    assert_eq!(server.metrics().material_generation.get(), 1);
    // Its own identity is taken.
    assert_eq!(
        server
            .update_material(pki.leaf("backend", Key::P256))
            .unwrap(),
        2
    );
}
