//! The provider-dependent half of the snapshot's TLS section: the typed
//! section and SPIFFE identities are `baton-config`'s (types, parsing,
//! validation, shared with the operator); here they become rustls objects
//! and identities are read out of certificates. Pure, no I/O, and no import
//! of any other module. [`crate::tls`] re-exports both modules under their
//! old paths (`tls::settings`, `tls::spiffe`).

pub mod settings;
pub mod spiffe;
