//! SPIFFE identities of mesh workloads
//! (`spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`): the
//! strict parser lives in `baton-config` (re-exported here); reading them
//! out of a certificate's URI SAN needs an X.509 parser and lives here.

use rustls_pki_types::CertificateDer;

pub use baton_config::spiffe::{SpiffeError, SpiffeId};

/// Every SPIFFE identity in a certificate's URI SANs (mesh certificates carry
/// exactly one; other URI SANs are ignored). An unparsable certificate yields
/// an error rather than "no identity" so a broken peer is visible.
pub fn spiffe_ids(cert: &CertificateDer<'_>) -> Result<Vec<SpiffeId>, String> {
    use x509_parser::prelude::*;
    let (_, parsed) =
        X509Certificate::from_der(cert.as_ref()).map_err(|e| format!("parse certificate: {e}"))?;
    let san = parsed
        .subject_alternative_name()
        .map_err(|e| format!("subjectAltName: {e}"))?;
    let Some(san) = san else {
        return Ok(Vec::new());
    };
    Ok(san
        .value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(uri) => uri.parse::<SpiffeId>().ok(),
            _ => None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_extracted_from_the_uri_san() {
        let mut params = rcgen::CertificateParams::new(vec!["ignored.example".into()]).unwrap();
        params.subject_alt_names.push(rcgen::SanType::URI(
            "spiffe://td/ns/n/sa/s".try_into().unwrap(),
        ));
        params.subject_alt_names.push(rcgen::SanType::URI(
            "https://not-spiffe/".try_into().unwrap(),
        ));
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let ids = spiffe_ids(cert.der()).unwrap();
        assert_eq!(ids, vec![SpiffeId::new("td", "n", "s").unwrap()]);
    }
}
