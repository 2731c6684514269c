//! The mesh trust bundle a Pod's sidecars learned, kept across processes.
//!
//! An injected sidecar authenticates the operator (its config stream and
//! the identity endpoint) with two sources of roots, trusted together:
//!
//! - the **injected** bundle, `volumes::TRUST_BUNDLE_PATH`: what the
//!   webhook copied into the Pod's annotation when it admitted the Pod
//!   (decision 0058). It never changes for the life of the Pod;
//! - the **kept** bundle, `volumes::TRUST_STATE_FILE` on the emptyDir both
//!   slots share: the newest bundle any sidecar process of the Pod received
//!   with a certificate from the identity service.
//!
//! After a root rotation the operator's serving certificate chains to a
//! root the injected bundle may not hold; the kept one does (every sidecar
//! took the two-root bundle before the operator issued from the new root,
//! docs/tls.md "Root rotation runbook"). A slot the kubelet restarts, or
//! the next process of a hot upgrade, reads the kept file at start, so it
//! verifies the operator without having held a certificate yet.
//!
//! The union, not the kept bundle alone: a kept file from a bundle that
//! has since been replaced must not lock the Pod out, and the injected
//! bundle is never older than the Pod. Both hold public certificates only.

use std::path::{Path, PathBuf};

use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Pem { path: PathBuf, message: String },
    #[error("no trust anchor in {injected} nor in {kept}")]
    Empty { injected: PathBuf, kept: String },
}

/// Where this process keeps the bundle: `BATON_TRUST_STATE`, which the
/// webhook sets on injected slots; `None` (kept nowhere) otherwise.
pub fn path_from_env() -> Option<PathBuf> {
    std::env::var_os(baton_contract::env::TRUST_STATE)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The certificates of the PEM file at `path`; a missing file holds none.
fn read(path: &Path) -> Result<Vec<CertificateDer<'static>>, TrustError> {
    let pem = match std::fs::read(path) {
        Ok(pem) => pem,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(TrustError::Read {
                path: path.to_owned(),
                source,
            });
        }
    };
    CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TrustError::Pem {
            path: path.to_owned(),
            message: e.to_string(),
        })
}

/// `a` then what `b` adds, each certificate once. Pure.
pub fn union(
    a: Vec<CertificateDer<'static>>,
    b: Vec<CertificateDer<'static>>,
) -> Vec<CertificateDer<'static>> {
    let mut out = a;
    for c in b {
        if !out.contains(&c) {
            out.push(c);
        }
    }
    out
}

/// The bundle kept at `path`: none when missing, and none (with a
/// warning) when it does not parse, rather than locking the Pod out.
pub fn kept(path: &Path) -> Vec<CertificateDer<'static>> {
    read(path).unwrap_or_else(|error| {
        tracing::warn!(%error, "kept trust bundle unreadable; trusting the injected one only");
        Vec::new()
    })
}

/// The roots that authenticate the operator: the injected bundle at
/// `injected` together with the kept one at `kept` ([`kept`]). Either may
/// be missing or empty (a Pod admitted without a bundle, a Pod that never
/// held a certificate); both empty is an error.
pub fn roots(
    injected: &Path,
    kept: Option<&Path>,
) -> Result<Vec<CertificateDer<'static>>, TrustError> {
    let all = union(read(injected)?, kept.map(self::kept).unwrap_or_default());
    if all.is_empty() {
        return Err(TrustError::Empty {
            injected: injected.to_owned(),
            kept: kept.map_or_else(|| "-".to_owned(), |k| k.display().to_string()),
        });
    }
    Ok(all)
}

/// Replaces the kept bundle with `bundle_pem` (the newest the identity
/// service sent), atomically: a process reading it concurrently sees the
/// previous file or this one, never a part. Unchanged content is not
/// rewritten.
pub fn keep(path: &Path, bundle_pem: &str) -> std::io::Result<()> {
    if std::fs::read(path).is_ok_and(|old| old == bundle_pem.as_bytes()) {
        return Ok(());
    }
    let file = path.file_name().map_or_else(
        || "trust-bundle".into(),
        |n| n.to_string_lossy().into_owned(),
    );
    // Per process: the two slots of a Pod may write at the same moment.
    let tmp = path.with_file_name(format!(".{file}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, bundle_pem)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    type Root = rcgen::CertifiedIssuer<'static, rcgen::KeyPair>;

    fn root(name: &str) -> Root {
        let kp = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        rcgen::CertifiedIssuer::self_signed(p, kp).unwrap()
    }

    /// A TLS server on loopback for `baton-identity.baton-system.svc` with
    /// a certificate issued by `by`; answers each handshake with "ok".
    async fn operator_signed_by(by: &Root) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
        let kp = rcgen::KeyPair::generate().unwrap();
        let p =
            rcgen::CertificateParams::new(vec!["baton-identity.baton-system.svc".into()]).unwrap();
        let cert = p.signed_by(&kp, by).unwrap();
        let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls_pki_types::PrivateKeyDer::Pkcs8(kp.serialize_der().into()),
        )
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = l.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    use tokio::io::AsyncWriteExt;
                    if let Ok(mut s) = acceptor.accept(tcp).await {
                        let _ = s.write_all(b"ok").await;
                        let _ = s.shutdown().await;
                    }
                });
            }
        });
        (addr, task)
    }

    /// A real handshake with `roots` against the server at `addr`.
    async fn handshake(
        roots: Vec<CertificateDer<'static>>,
        addr: std::net::SocketAddr,
    ) -> Result<(), String> {
        use tokio::io::AsyncReadExt;
        let mut store = rustls::RootCertStore::empty();
        for r in roots {
            store.add(r).map_err(|e| e.to_string())?;
        }
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(store)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls_pki_types::ServerName::try_from("baton-identity.baton-system.svc")
            .unwrap()
            .to_owned();
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        let mut got = Vec::new();
        tls.read_to_end(&mut got).await.map_err(|e| e.to_string())?;
        assert_eq!(got, b"ok");
        Ok(())
    }

    #[tokio::test]
    async fn after_a_root_rotation_a_new_process_verifies_the_operator_with_the_kept_bundle() {
        let dir = tempfile::tempdir().unwrap();
        let (old, new) = (root("root-1"), root("root-2"));
        // Admitted before the rotation: the injected bundle names the old
        // root only. The previous process kept the two-root bundle, then
        // the one-root bundle of the end of the rotation.
        let injected = dir.path().join("ca.crt");
        std::fs::write(&injected, old.pem()).unwrap();
        let kept = dir.path().join("trust-bundle.pem");
        keep(&kept, &format!("{}{}", old.pem(), new.pem())).unwrap();
        keep(&kept, &new.pem()).unwrap();
        // The operator now serves a certificate of the new root.
        let (addr, server) = operator_signed_by(&new).await;
        let without = roots(&injected, None).unwrap();
        let err = handshake(without, addr).await.unwrap_err();
        assert!(err.contains("UnknownIssuer"), "{err}");
        let with = roots(&injected, Some(&kept)).unwrap();
        assert_eq!(with.len(), 2, "the injected root and the kept one");
        handshake(with, addr).await.unwrap();
        server.abort();
    }

    #[tokio::test]
    async fn a_pod_admitted_after_the_rotation_verifies_with_the_injected_bundle_alone() {
        let dir = tempfile::tempdir().unwrap();
        let new = root("root-2");
        let injected = dir.path().join("ca.crt");
        std::fs::write(&injected, new.pem()).unwrap();
        // No process of this Pod held a certificate yet: nothing kept.
        let kept = dir.path().join("trust-bundle.pem");
        let (addr, server) = operator_signed_by(&new).await;
        handshake(roots(&injected, Some(&kept)).unwrap(), addr)
            .await
            .unwrap();
        server.abort();
    }

    #[test]
    fn an_empty_injected_bundle_is_enough_when_one_was_kept_and_both_empty_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let r = root("root-1");
        // A Pod admitted while the webhook had no bundle: the downwardAPI
        // file of a missing annotation is empty.
        let injected = dir.path().join("ca.crt");
        std::fs::write(&injected, "").unwrap();
        let kept = dir.path().join("trust-bundle.pem");
        let err = roots(&injected, Some(&kept)).unwrap_err();
        assert!(matches!(err, TrustError::Empty { .. }), "{err}");
        keep(&kept, &r.pem()).unwrap();
        assert_eq!(roots(&injected, Some(&kept)).unwrap(), [r.der().clone()]);
    }

    #[test]
    fn a_garbled_kept_file_does_not_lock_the_pod_out() {
        let dir = tempfile::tempdir().unwrap();
        let r = root("root-1");
        let injected = dir.path().join("ca.crt");
        std::fs::write(&injected, r.pem()).unwrap();
        let kept = dir.path().join("trust-bundle.pem");
        std::fs::write(
            &kept,
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        assert_eq!(roots(&injected, Some(&kept)).unwrap(), [r.der().clone()]);
    }

    #[test]
    fn keep_replaces_the_file_whole_and_leaves_no_temporary_behind() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (root("root-1"), root("root-2"));
        let kept = dir.path().join("trust-bundle.pem");
        keep(&kept, &a.pem()).unwrap();
        keep(&kept, &b.pem()).unwrap();
        assert_eq!(std::fs::read_to_string(&kept).unwrap(), b.pem());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["trust-bundle.pem"]);
    }

    #[test]
    fn the_union_keeps_the_first_order_and_each_certificate_once() {
        let (a, b, c) = (root("a"), root("b"), root("c"));
        let der = |r: &Root| r.der().clone();
        assert_eq!(
            union(vec![der(&a), der(&b)], vec![der(&b), der(&c)]),
            [der(&a), der(&b), der(&c)]
        );
    }
}
