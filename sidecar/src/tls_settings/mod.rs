//! The TLS section of a config snapshot and SPIFFE identities: pure types,
//! parsing and validation, with no I/O and no import of any other module.
//!
//! They sit below both the config compiler (which checks a cluster's
//! expected peer identity and reads the mode listeners depend on) and the
//! TLS layer (which builds rustls objects from them), so validating a
//! snapshot does not depend on the TLS layer. [`crate::tls`] re-exports both
//! modules under their old paths (`tls::settings`, `tls::spiffe`).

pub mod settings;
pub mod spiffe;
