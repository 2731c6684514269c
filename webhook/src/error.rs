//! The crate's error type. Leaf errors stay small and typed so the server can
//! map them to a metric label and to the right admission answer (a denial is
//! never a transport error).

use thiserror::Error;

/// Everything that can go wrong in the webhook process outside the pure
/// admission logic (whose refusals are [`crate::inject::Denial`]s and
/// validation messages, not errors).
#[derive(Debug, Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("PEM: {0}")]
    Pem(String),
    #[error("certificate or key file {path}: {source}")]
    File {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CA secret {0}: {1}")]
    CaSecret(String, String),
    #[error("caBundle of webhook configuration {0}: {1}")]
    CaBundle(String, String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
}

impl Error {
    /// Short, bounded label for metrics (`error` label of counters).
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Tls(_) => "tls",
            Error::Rcgen(_) => "rcgen",
            Error::Pem(_) => "pem",
            Error::File { .. } => "file",
            Error::CaSecret(..) => "ca_secret",
            Error::CaBundle(..) => "ca_bundle",
            Error::Io(_) => "io",
            Error::Json(_) => "json",
        }
    }
}

/// A serving certificate that does not load keeps its old messages and
/// labels (`pem`, `tls`).
impl From<baton_serving::tls::CertError> for Error {
    fn from(e: baton_serving::tls::CertError) -> Self {
        match e {
            baton_serving::tls::CertError::Pem(m) => Error::Pem(m),
            baton_serving::tls::CertError::Tls(e) => Error::Tls(e),
        }
    }
}

/// The CA Secret's errors, as the webhook has always reported them.
impl From<baton_controlplane::ca_secret::SecretError<Error>> for Error {
    fn from(e: baton_controlplane::ca_secret::SecretError<Error>) -> Self {
        use baton_controlplane::ca_secret::SecretError;
        match e {
            SecretError::Material { source, .. } => source,
            SecretError::Api(e) => Error::Kube(e),
            SecretError::MissingKey(secret, key) => {
                Error::CaSecret(secret, format!("key {key} missing"))
            }
            SecretError::Conflict(secret) => Error::CaSecret(
                secret,
                "kept conflicting with concurrent writers".to_owned(),
            ),
            SecretError::Missing(secret, ..) => Error::CaSecret(secret, "not found".to_owned()),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
