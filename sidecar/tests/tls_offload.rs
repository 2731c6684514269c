//! Private-key offload: both engines sign correctly (checked by a different
//! library than the one that signed), handshakes really run on the crypto
//! pool, and engine failures fall back (Preferred) or keep the sidecar not
//! ready (Required).

use crate::tls_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use baton_sidecar::tls::metrics::{EngineLabel, ReasonLabel};
use baton_sidecar::tls::offload::{
    Engine, EngineKey, EngineKind, Offload, OffloadError, OffloadMode, OffloadSettings,
    OpensslEngine, RECHECK, SoftwareEngine,
};
use baton_sidecar::tls::settings::TlsMode;
use baton_sidecar::tls::{TlsContext, TlsMetrics};
use rustls::{SignatureAlgorithm, SignatureScheme};
use rustls_pki_types::PrivateKeyDer;
use tls_support::*;

fn der(kp: &rcgen::KeyPair) -> PrivateKeyDer<'static> {
    PrivateKeyDer::Pkcs8(kp.serialize_der().into())
}

fn ring_alg(s: SignatureScheme) -> &'static dyn ring::signature::VerificationAlgorithm {
    use ring::signature::*;
    match s {
        SignatureScheme::ECDSA_NISTP256_SHA256 => &ECDSA_P256_SHA256_ASN1,
        SignatureScheme::ECDSA_NISTP384_SHA384 => &ECDSA_P384_SHA384_ASN1,
        SignatureScheme::RSA_PSS_SHA256 => &RSA_PSS_2048_8192_SHA256,
        SignatureScheme::RSA_PSS_SHA384 => &RSA_PSS_2048_8192_SHA384,
        SignatureScheme::RSA_PSS_SHA512 => &RSA_PSS_2048_8192_SHA512,
        SignatureScheme::RSA_PKCS1_SHA256 => &RSA_PKCS1_2048_8192_SHA256,
        SignatureScheme::RSA_PKCS1_SHA384 => &RSA_PKCS1_2048_8192_SHA384,
        SignatureScheme::RSA_PKCS1_SHA512 => &RSA_PKCS1_2048_8192_SHA512,
        other => panic!("no ring verifier for {other:?}"),
    }
}

fn openssl_verify(kp: &rcgen::KeyPair, s: SignatureScheme, msg: &[u8], sig: &[u8]) -> bool {
    use openssl::hash::MessageDigest;
    use openssl::rsa::Padding;
    use openssl::sign::{RsaPssSaltlen, Verifier};
    let pkey = openssl::pkey::PKey::public_key_from_der(
        &rcgen::PublicKeyData::subject_public_key_info(kp),
    )
    .unwrap();
    let (md, pss) = match s {
        SignatureScheme::ECDSA_NISTP256_SHA256 | SignatureScheme::RSA_PKCS1_SHA256 => {
            (MessageDigest::sha256(), false)
        }
        SignatureScheme::ECDSA_NISTP384_SHA384 | SignatureScheme::RSA_PKCS1_SHA384 => {
            (MessageDigest::sha384(), false)
        }
        SignatureScheme::RSA_PKCS1_SHA512 => (MessageDigest::sha512(), false),
        SignatureScheme::RSA_PSS_SHA256 => (MessageDigest::sha256(), true),
        SignatureScheme::RSA_PSS_SHA384 => (MessageDigest::sha384(), true),
        SignatureScheme::RSA_PSS_SHA512 => (MessageDigest::sha512(), true),
        other => panic!("no openssl verifier for {other:?}"),
    };
    let mut v = Verifier::new(md, &pkey).unwrap();
    if pkey.id() == openssl::pkey::Id::RSA {
        if pss {
            v.set_rsa_padding(Padding::PKCS1_PSS).unwrap();
            v.set_rsa_pss_saltlen(RsaPssSaltlen::DIGEST_LENGTH).unwrap();
            v.set_rsa_mgf1_md(md).unwrap();
        } else {
            v.set_rsa_padding(Padding::PKCS1).unwrap();
        }
    }
    v.verify_oneshot(sig, msg).unwrap_or(false)
}

#[test]
fn both_engines_produce_signatures_that_another_library_verifies() {
    let software = SoftwareEngine;
    let openssl = OpensslEngine::new(None).unwrap();
    let msg = b"TLS 1.3, server CertificateVerify\x00transcript-hash";
    for key in [Key::P256, Key::P384, Key::Rsa2048, Key::Rsa3072] {
        let kp = key_pair(key);
        let sw = software.load_key(&der(&kp)).unwrap();
        let os = openssl.load_key(&der(&kp)).unwrap();
        assert_eq!(
            sw.schemes(),
            os.schemes(),
            "{key:?}: engines disagree on schemes"
        );
        assert_eq!(sw.algorithm(), os.algorithm());
        for &scheme in os.schemes() {
            // OpenSSL's signature, checked by ring.
            let sig = os.sign(scheme, msg).unwrap();
            ring::signature::UnparsedPublicKey::new(ring_alg(scheme), kp.public_key_raw())
                .verify(msg, &sig)
                .unwrap_or_else(|_| {
                    panic!("{key:?} {scheme:?}: openssl signature rejected by ring")
                });
            // The software engine's signature (ring for ECDSA, libcrypto
            // for RSA), checked by both libraries.
            let sig = sw.sign(scheme, msg).unwrap();
            assert!(
                openssl_verify(&kp, scheme, msg, &sig),
                "{key:?} {scheme:?}: software signature rejected by openssl"
            );
            ring::signature::UnparsedPublicKey::new(ring_alg(scheme), kp.public_key_raw())
                .verify(msg, &sig)
                .unwrap_or_else(|_| {
                    panic!("{key:?} {scheme:?}: software signature rejected by ring")
                });
            // And a tampered message fails, so the check is not vacuous.
            assert!(!openssl_verify(&kp, scheme, b"tampered", &sig));
        }
    }
}

#[test]
fn the_openssl_engine_passes_its_self_test_with_the_default_provider() {
    let e = OpensslEngine::new(None).unwrap();
    baton_sidecar::tls::offload::self_test(&e).unwrap();
    // Explicitly loading the default provider works too.
    let e = OpensslEngine::new(Some("default")).unwrap();
    baton_sidecar::tls::offload::self_test(&e).unwrap();
}

fn offload(
    engine: EngineKind,
    mode: OffloadMode,
    provider: Option<&str>,
    m: &TlsMetrics,
) -> Arc<Offload> {
    Arc::new(Offload::select(
        &OffloadSettings {
            mode,
            engine,
            workers: 2,
            queue: 8,
            openssl_provider: provider.map(str::to_string),
        },
        &|_| None,
        m.clone(),
    ))
}

fn ctx_with(
    offload: Arc<Offload>,
    m: TlsMetrics,
    pki: &Pki,
    sa: &str,
    key: Key,
) -> Arc<TlsContext> {
    TlsContext::new(&settings(TlsMode::Strict), pki.leaf(sa, key), offload, m).unwrap()
}

fn engine_count(m: &TlsMetrics, engine: &str) -> u64 {
    m.offload_signatures
        .get_or_create(&EngineLabel {
            engine: engine.into(),
        })
        .get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_signed_by_the_openssl_engine_complete_and_are_measured() {
    let pki = Pki::new("mesh-ca");
    for key in [Key::P256, Key::Rsa2048] {
        let m = TlsMetrics::default();
        let off = offload(EngineKind::Openssl, OffloadMode::Required, None, &m);
        assert_eq!(off.readiness(), Ok(()));
        assert_eq!(off.status().active, EngineKind::Openssl);
        let server = ctx_with(off, m.clone(), &pki, "backend", key);
        let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", key));
        let srv = EchoServer::start(server).await;
        let (banner, _) = mtls_round_trip(&client, srv.addr, &id("backend"))
            .await
            .unwrap();
        assert_eq!(banner, format!("tls {}", id("frontend")));
        assert!(
            engine_count(&m, "openssl") >= 1,
            "{key:?}: no openssl signature recorded"
        );
        assert_eq!(engine_count(&m, "software"), 0);
    }
}

/// Software engine that records the thread each signature ran on.
#[derive(Debug, Default)]
struct Recording {
    threads: Arc<Mutex<Vec<String>>>,
}

#[derive(Debug)]
struct RecordingKey {
    inner: Arc<dyn EngineKey>,
    threads: Arc<Mutex<Vec<String>>>,
}

impl Engine for Recording {
    fn kind(&self) -> EngineKind {
        EngineKind::Software
    }
    fn load_key(&self, key: &PrivateKeyDer<'_>) -> Result<Arc<dyn EngineKey>, OffloadError> {
        Ok(Arc::new(RecordingKey {
            inner: SoftwareEngine.load_key(key)?,
            threads: self.threads.clone(),
        }))
    }
}

impl EngineKey for RecordingKey {
    fn algorithm(&self) -> SignatureAlgorithm {
        self.inner.algorithm()
    }
    fn schemes(&self) -> &[SignatureScheme] {
        self.inner.schemes()
    }
    fn sign(&self, scheme: SignatureScheme, message: &[u8]) -> Result<Vec<u8>, OffloadError> {
        let name = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_string();
        self.threads.lock().unwrap().push(name);
        self.inner.sign(scheme, message)
    }
}

async fn signing_threads(mode: OffloadMode) -> Vec<String> {
    let pki = Pki::new("mesh-ca");
    let rec = Recording::default();
    let threads = rec.threads.clone();
    let m = TlsMetrics::default();
    let off = Arc::new(Offload::with_candidate(
        &OffloadSettings {
            mode,
            workers: 1,
            ..Default::default()
        },
        Ok(Arc::new(rec)),
        m.clone(),
    ));
    let server = ctx_with(off, m, &pki, "backend", Key::P256);
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    mtls_round_trip(&client, srv.addr, &id("backend"))
        .await
        .unwrap();
    let t = threads.lock().unwrap().clone();
    // With a pool, the self-test signs once on the selecting thread first;
    // keep only the handshake's signatures.
    let skip = usize::from(mode != OffloadMode::Disabled);
    t.into_iter().skip(skip).collect()
}

#[tokio::test(flavor = "current_thread")]
async fn with_offload_the_handshake_signature_runs_on_a_crypto_thread_not_the_event_loop() {
    let loop_thread = std::thread::current()
        .name()
        .unwrap_or("unnamed")
        .to_string();
    let t = signing_threads(OffloadMode::Preferred).await;
    assert!(!t.is_empty(), "no handshake signature recorded");
    for name in &t {
        assert!(
            name.starts_with("baton-crypto-software-"),
            "signed on {name:?}"
        );
        assert_ne!(name, &loop_thread);
    }
}

#[tokio::test(flavor = "current_thread")]
async fn with_offload_disabled_the_signature_runs_inline_on_the_event_loop() {
    let loop_thread = std::thread::current()
        .name()
        .unwrap_or("unnamed")
        .to_string();
    let t = signing_threads(OffloadMode::Disabled).await;
    assert!(!t.is_empty());
    assert!(
        t.iter().all(|n| n == &loop_thread),
        "{t:?} vs {loop_thread}"
    );
}

#[tokio::test]
async fn an_unloadable_engine_falls_back_to_software_when_preferred() {
    let pki = Pki::new("mesh-ca");
    let m = TlsMetrics::default();
    let off = offload(
        EngineKind::Openssl,
        OffloadMode::Preferred,
        Some("baton-no-such-provider"),
        &m,
    );
    assert_eq!(off.readiness(), Ok(()));
    assert_eq!(off.status().active, EngineKind::Software);
    let reason = off.status().fallback_reason.clone().unwrap();
    assert!(reason.contains("baton-no-such-provider"), "{reason}");
    assert_eq!(m.fallbacks("engine_unavailable"), 1);
    assert_eq!(m.offload_ready.get(), 1);
    let server = ctx_with(off, m.clone(), &pki, "backend", Key::P256);
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    mtls_round_trip(&client, srv.addr, &id("backend"))
        .await
        .unwrap();
    assert!(engine_count(&m, "software") >= 1);
}

#[tokio::test]
async fn an_unloadable_engine_keeps_the_sidecar_not_ready_when_required() {
    let pki = Pki::new("mesh-ca");
    let m = TlsMetrics::default();
    let off = offload(
        EngineKind::Openssl,
        OffloadMode::Required,
        Some("baton-no-such-provider"),
        &m,
    );
    let reason = off.readiness().unwrap_err();
    assert!(
        reason.contains("Required") && reason.contains("baton-no-such-provider"),
        "{reason}"
    );
    assert_eq!(m.offload_ready.get(), 0);
    assert_eq!(m.fallbacks("engine_unavailable"), 0);
    let server = ctx_with(off, m.clone(), &pki, "backend", Key::P256);
    assert!(server.readiness().is_err());
    // No handshake is served in software behind the policy's back.
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    assert!(
        mtls_round_trip(&client, srv.addr, &id("backend"))
            .await
            .is_err()
    );
    assert_eq!(engine_count(&m, "software"), 0);
}

#[test]
fn the_environment_overrides_the_settings_and_a_bad_value_is_reported() {
    let m = TlsMetrics::default();
    let env = |k: &str| match k {
        "BATON_OFFLOAD_MODE" => Some("Required".to_string()),
        "BATON_OFFLOAD_ENGINE" => Some("fpga".to_string()),
        _ => None,
    };
    let off = Offload::select(&OffloadSettings::default(), &env, m);
    let reason = off.readiness().unwrap_err();
    assert!(
        reason.contains("BATON_OFFLOAD_ENGINE") && reason.contains("fpga"),
        "{reason}"
    );

    let env = |k: &str| (k == "BATON_OFFLOAD_ENGINE").then(|| "openssl".to_string());
    let off = Offload::select(&OffloadSettings::default(), &env, TlsMetrics::default());
    assert_eq!(off.status().active, EngineKind::Openssl);
    assert_eq!(off.status().mode, OffloadMode::Preferred);
}

/// An engine that passes its self-test and then fails every signature (a
/// device that dies after start-up).
#[derive(Debug, Default)]
struct Failing {
    broken: Arc<AtomicBool>,
}

#[derive(Debug)]
struct FailingKey {
    inner: Arc<dyn EngineKey>,
    broken: Arc<AtomicBool>,
}

impl Engine for Failing {
    fn kind(&self) -> EngineKind {
        EngineKind::Openssl
    }
    fn name(&self) -> &'static str {
        "failing"
    }
    fn load_key(&self, key: &PrivateKeyDer<'_>) -> Result<Arc<dyn EngineKey>, OffloadError> {
        Ok(Arc::new(FailingKey {
            inner: SoftwareEngine.load_key(key)?,
            broken: self.broken.clone(),
        }))
    }
}

impl EngineKey for FailingKey {
    fn algorithm(&self) -> SignatureAlgorithm {
        self.inner.algorithm()
    }
    fn schemes(&self) -> &[SignatureScheme] {
        self.inner.schemes()
    }
    fn sign(&self, scheme: SignatureScheme, message: &[u8]) -> Result<Vec<u8>, OffloadError> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(OffloadError::Sign {
                engine: "failing",
                reason: "device lost".into(),
            });
        }
        self.inner.sign(scheme, message)
    }
}

async fn handshake_with_failing_engine(
    mode: OffloadMode,
) -> (
    Result<(String, String), String>,
    TlsMetrics,
    Arc<Offload>,
    Arc<AtomicBool>,
) {
    let pki = Pki::new("mesh-ca");
    let engine = Failing::default();
    let broken = engine.broken.clone();
    let m = TlsMetrics::default();
    let off = Arc::new(Offload::with_candidate(
        &OffloadSettings {
            mode,
            ..Default::default()
        },
        Ok(Arc::new(engine)),
        m.clone(),
    ));
    assert_eq!(off.readiness(), Ok(()));
    broken.store(true, Ordering::SeqCst);
    let server = ctx_with(off.clone(), m.clone(), &pki, "backend", Key::P256);
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    (
        mtls_round_trip(&client, srv.addr, &id("backend")).await,
        m,
        off,
        broken,
    )
}

#[tokio::test]
async fn a_signature_failure_at_run_time_is_redone_in_software_when_preferred() {
    let (r, m, off, _) = handshake_with_failing_engine(OffloadMode::Preferred).await;
    r.unwrap();
    // Preferred stays ready: the signature was redone in software.
    assert_eq!(off.readiness(), Ok(()));
    assert!(m.fallbacks("sign_error") >= 1);
    let errors = m
        .offload_errors
        .get_or_create(&EngineLabel {
            engine: "failing".into(),
        })
        .get();
    assert!(errors >= 1);
    assert!(engine_count(&m, "software") >= 1);
    // What `/offload` tells the operator's AcceleratorPool books.
    let report = off.report();
    assert!(report.configured && report.ready, "{report:?}");
    assert_eq!(report.mode, "Preferred");
    assert!(report.sign_errors_redone_in_software >= 1, "{report:?}");
    assert!(
        report
            .last_sign_error
            .as_deref()
            .is_some_and(|e| e.contains("device lost")),
        "{report:?}"
    );
    let fell_back = report.falling_back_since(None).unwrap_or_default();
    assert!(
        fell_back.starts_with("SignErrors: "),
        "{fell_back} {report:?}"
    );
}

#[tokio::test]
async fn a_signature_failure_at_run_time_fails_the_handshake_when_required() {
    let (r, m, _, _) = handshake_with_failing_engine(OffloadMode::Required).await;
    assert!(r.is_err());
    assert_eq!(
        m.offload_fallbacks
            .get_or_create(&ReasonLabel {
                reason: "sign_error".into()
            })
            .get(),
        0
    );
}

#[tokio::test]
async fn a_required_engine_that_fails_at_run_time_makes_the_sidecar_not_ready_until_it_works_again()
{
    let (r, m, off, broken) = handshake_with_failing_engine(OffloadMode::Required).await;
    assert!(r.is_err());
    let now = std::time::Instant::now();
    let reason = off.readiness_at(now).unwrap_err();
    assert!(
        reason.contains("offload Required") && reason.contains("failed at run time"),
        "{reason}"
    );
    assert!(reason.contains("device lost"), "{reason}");
    assert_eq!(m.offload_ready.get(), 0);
    // Still broken at the next self-test: still not ready.
    assert!(off.readiness_at(now + RECHECK).is_err());
    // The device is back: the next self-test (not before RECHECK) passes.
    broken.store(false, Ordering::SeqCst);
    assert!(off.readiness_at(now + RECHECK).is_err());
    assert_eq!(off.readiness_at(now + RECHECK * 2), Ok(()));
    assert_eq!(m.offload_ready.get(), 1);
    assert_eq!(off.readiness(), Ok(()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_larger_than_the_pool_queues_instead_of_failing() {
    let pki = Pki::new("mesh-ca");
    let m = TlsMetrics::default();
    let off = Arc::new(Offload::select(
        &OffloadSettings {
            mode: OffloadMode::Required,
            engine: EngineKind::Software,
            workers: 1,
            queue: 1,
            openssl_provider: None,
        },
        &|_| None,
        m.clone(),
    ));
    let server = ctx_with(off, m.clone(), &pki, "backend", Key::P256);
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    let mut tasks = Vec::new();
    for _ in 0..24 {
        let client = client.clone();
        let addr = srv.addr;
        tasks.push(tokio::spawn(async move {
            mtls_round_trip(&client, addr, &id("backend")).await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    // Everything drained: nothing left queued or running.
    let l = EngineLabel {
        engine: "software".into(),
    };
    assert_eq!(m.offload_queue_depth.get_or_create(&l).get(), 0);
    assert_eq!(m.offload_in_flight.get_or_create(&l).get(), 0);
    assert!(m.offload_jobs.get_or_create(&l).get() >= 24);
}

#[test]
fn the_software_engine_signs_rsa_with_libcrypto_and_ecdsa_with_ring() {
    // libcrypto signs RSA ~1.7x faster than ring (bench/sign-speed.sh);
    // ring is kept for ECDSA, where it is the faster of the two.
    for (key, library) in [
        (Key::Rsa2048, "libcrypto"),
        (Key::Rsa3072, "libcrypto"),
        (Key::P256, "ring"),
        (Key::P384, "ring"),
    ] {
        let k = SoftwareEngine.load_key(&der(&key_pair(key))).unwrap();
        let shown = format!("{k:?}");
        assert!(
            shown.contains(&format!("library: \"{library}\"")),
            "{key:?}: {shown}"
        );
    }
}

/// Signatures per second of one thread, ring vs libcrypto, for RSA-2048 and
/// ECDSA P-256, interleaved (run by bench/sign-speed.sh, which adds
/// `openssl speed` as the ceiling of the same machine).
#[test]
#[ignore = "benchmark: run bench/sign-speed.sh"]
fn signing_speed_ring_vs_libcrypto() {
    let rounds: usize = std::env::var("BATON_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let openssl = OpensslEngine::new(None).unwrap();
    let msg = [7u8; 100];
    println!("| key | ring sign/s | libcrypto sign/s | libcrypto / ring |");
    println!("|---|---:|---:|---:|");
    for (key, scheme, n) in [
        (Key::Rsa2048, SignatureScheme::RSA_PSS_SHA256, 300),
        (Key::P256, SignatureScheme::ECDSA_NISTP256_SHA256, 3000),
    ] {
        let kp = key_pair(key);
        let ring_key = rustls::crypto::ring::sign::any_supported_type(&der(&kp)).unwrap();
        let ring_signer = ring_key.choose_scheme(&[scheme]).unwrap();
        let lc = openssl.load_key(&der(&kp)).unwrap();
        let (mut r, mut l) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = std::time::Instant::now();
            for _ in 0..n {
                ring_signer.sign(&msg).unwrap();
            }
            r.push(n as f64 / t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            for _ in 0..n {
                lc.sign(scheme, &msg).unwrap();
            }
            l.push(n as f64 / t.elapsed().as_secs_f64());
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            v[v.len() / 2]
        };
        let (r, l) = (med(&mut r), med(&mut l));
        println!("| {key:?} | {r:.0} | {l:.0} | {:.2} |", l / r);
    }
}
