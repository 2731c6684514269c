//! Shared fixtures for the TLS integration tests: a throwaway PKI (rcgen;
//! RSA keys from OpenSSL because ring cannot generate them), contexts, and a
//! loopback echo server behind the real `Acceptor`.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use baton_sidecar::tls::material::Material;
use baton_sidecar::tls::offload::{Offload, OffloadMode, OffloadSettings};
use baton_sidecar::tls::settings::{CertSource, IdentitySettings, TlsMode, TlsSettings};
use baton_sidecar::tls::{Accepted, MeshTls, SpiffeId, TlsContext, TlsMetrics};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

pub const TD: &str = "cluster.local";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    P256,
    P384,
    Rsa2048,
    Rsa3072,
}

pub fn key_pair(k: Key) -> KeyPair {
    match k {
        Key::P256 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap(),
        Key::P384 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap(),
        Key::Rsa2048 | Key::Rsa3072 => {
            let bits = if k == Key::Rsa2048 { 2048 } else { 3072 };
            let pem = openssl::rsa::Rsa::generate(bits)
                .and_then(openssl::pkey::PKey::from_rsa)
                .and_then(|p| p.private_key_to_pem_pkcs8())
                .unwrap();
            KeyPair::from_pem(std::str::from_utf8(&pem).unwrap()).unwrap()
        }
    }
}

/// A CA that issues SPIFFE leaf certificates.
pub struct Pki {
    pub ca: CertifiedIssuer<'static, KeyPair>,
}

pub fn id(sa: &str) -> SpiffeId {
    SpiffeId::new(TD, "default", sa).unwrap()
}

pub fn now_plus(secs: i64) -> SystemTime {
    if secs >= 0 {
        SystemTime::now() + Duration::from_secs(secs as u64)
    } else {
        SystemTime::now() - Duration::from_secs((-secs) as u64)
    }
}

impl Pki {
    pub fn new(name: &str) -> Self {
        let mut p = CertificateParams::default();
        p.distinguished_name.push(DnType::CommonName, name);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        p.not_before = now_plus(-3600).into();
        p.not_after = now_plus(86_400).into();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        Pki {
            ca: CertifiedIssuer::self_signed(p, key).unwrap(),
        }
    }

    pub fn ca_der(&self) -> CertificateDer<'static> {
        self.ca.der().clone()
    }

    /// Leaf for `uri` valid in `[nb, na]`.
    pub fn leaf_with(&self, uri: &str, key: Key, nb: SystemTime, na: SystemTime) -> Material {
        let kp = key_pair(key);
        let mut p = CertificateParams::default();
        p.distinguished_name.push(DnType::CommonName, "workload");
        p.subject_alt_names = vec![SanType::URI(uri.try_into().unwrap())];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.not_before = nb.into();
        p.not_after = na.into();
        let cert = p.signed_by(&kp, &self.ca).unwrap();
        Material {
            cert_chain: vec![cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(kp.serialize_der().into()),
            trust_bundle: vec![self.ca_der()],
        }
    }

    pub fn leaf(&self, sa: &str, key: Key) -> Material {
        self.leaf_with(&id(sa).to_string(), key, now_plus(-60), now_plus(3600))
    }
}

pub fn settings(mode: TlsMode) -> TlsSettings {
    TlsSettings {
        mode,
        identity: IdentitySettings {
            trust_domain: TD.into(),
            ..Default::default()
        },
        source: Some(CertSource::Files {
            cert_chain: "/unused".into(),
            key: "/unused".into(),
            trust_bundle: "/unused".into(),
            poll_interval_ms: 1000,
        }),
        handshake_timeout_ms: 5_000,
        detect_timeout_ms: 500,
        ..Default::default()
    }
}

pub fn software_offload(metrics: &TlsMetrics) -> Arc<Offload> {
    Arc::new(Offload::select(
        &OffloadSettings {
            mode: OffloadMode::Preferred,
            workers: 2,
            ..Default::default()
        },
        &|_| None,
        metrics.clone(),
    ))
}

pub fn context(s: &TlsSettings, m: Material) -> Arc<TlsContext> {
    let metrics = TlsMetrics::default();
    TlsContext::new(s, m, software_offload(&metrics), metrics).unwrap()
}

/// Echo server behind the real acceptor. Every connection first gets one
/// line: `tls <peer-identity or ->` or `plain`, then an echo of each line.
pub struct EchoServer {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn echo<S: AsyncRead + AsyncWrite + Unpin>(s: S, banner: String) {
    let mut s = BufReader::new(s);
    if s.get_mut().write_all(banner.as_bytes()).await.is_err() {
        return;
    }
    let _ = s.get_mut().flush().await;
    let mut line = String::new();
    loop {
        line.clear();
        match s.read_line(&mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                if s.get_mut().write_all(line.as_bytes()).await.is_err() {
                    break;
                }
                let _ = s.get_mut().flush().await;
            }
        }
    }
    let _ = s.get_mut().shutdown().await;
}

impl EchoServer {
    pub async fn start(ctx: Arc<TlsContext>) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let acceptor = ctx.acceptor();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = l.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    match acceptor.accept(tcp).await {
                        Ok(Accepted::Tls(s, peer)) => {
                            let who = peer.identity.map(|i| i.to_string()).unwrap_or("-".into());
                            echo(s, format!("tls {who}\n")).await
                        }
                        Ok(Accepted::Plaintext(s)) => echo(s, "plain\n".into()).await,
                        // The application's own TLS: no application here
                        // to pass it to.
                        Ok(Accepted::AppTls(_)) => {}
                        Err(_) => {}
                    }
                });
            }
        });
        EchoServer { addr, task }
    }
}

/// Reads the banner, sends `msg`, returns (banner, echo).
pub async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    msg: &str,
) -> std::io::Result<(String, String)> {
    let mut r = BufReader::new(s);
    let mut banner = String::new();
    r.read_line(&mut banner).await?;
    r.get_mut().write_all(format!("{msg}\n").as_bytes()).await?;
    r.get_mut().flush().await?;
    let mut back = String::new();
    r.read_line(&mut back).await?;
    Ok((banner.trim().to_string(), back.trim().to_string()))
}

/// Connects with the context's connector and does one exchange.
pub async fn mtls_round_trip(
    client: &Arc<TlsContext>,
    addr: SocketAddr,
    expected: &SpiffeId,
) -> Result<(String, String), String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut s, peer) = client
        .connector()
        .connect(tcp, expected, None)
        .await
        .map_err(|e| format!("{e}: {:?}", std::error::Error::source(&e)))?;
    assert_eq!(peer.identity.as_ref(), Some(expected));
    let r = tokio::time::timeout(Duration::from_secs(5), exchange(&mut s, "ping"))
        .await
        .map_err(|_| "exchange timed out".to_string())?
        .map_err(|e| e.to_string())?;
    Ok(r)
}

/// Reads until EOF/error, bounded; true if the server closed without data.
pub async fn closed_without_data(tcp: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

pub fn pem(der: &[u8], label: &str) -> String {
    let b64 = openssl::base64::encode_block(der);
    let lines: Vec<&str> = b64
        .as_bytes()
        .chunks(64)
        .map(|c| std::str::from_utf8(c).unwrap())
        .collect();
    format!(
        "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
        lines.join("\n")
    )
}

/// Writes the `backend` workload's certificate, key and trust bundle into
/// `dir`; returns the `tls.source` YAML for them.
pub fn write_backend_pki(pki: &Pki, dir: &Path) -> String {
    let m = pki.leaf("backend", Key::P256);
    let (c, k, b) = (dir.join("c.pem"), dir.join("k.pem"), dir.join("b.pem"));
    std::fs::write(&c, pem(&m.cert_chain[0], "CERTIFICATE")).unwrap();
    std::fs::write(&k, pem(m.key.secret_der(), "PRIVATE KEY")).unwrap();
    std::fs::write(&b, pem(&m.trust_bundle[0], "CERTIFICATE")).unwrap();
    format!(
        "{{files: {{cert_chain: '{}', key: '{}', trust_bundle: '{}'}}}}",
        c.display(),
        k.display(),
        b.display()
    )
}

/// Starts an in-process sidecar from `text` with the mesh TLS layer
/// attached, applying the snapshot's `tls` section (none: no policy).
pub async fn start_with_mesh_tls(text: &str) -> (baton_sidecar::server::Running, Arc<MeshTls>) {
    let mut snap = baton_sidecar::config::yaml::parse(text).unwrap();
    baton_sidecar::config::compile(&snap).unwrap();
    snap.admin.address = "127.0.0.1:0".parse().unwrap();
    let tls = MeshTls::new(TlsMetrics::default());
    tls.apply(snap.tls.as_ref()).unwrap();
    let running = baton_sidecar::server::start(snap, {
        let mut opts = baton_sidecar::server::StartOptions::default();
        tls.plug(&mut opts);
        opts
    })
    .await
    .unwrap();
    tls.attach(&running);
    (running, tls)
}
