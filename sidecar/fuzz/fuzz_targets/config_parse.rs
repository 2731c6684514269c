//! Arbitrary text through the YAML parser and the validator: neither may
//! panic, and anything accepted must survive a serialize/parse round trip.
#![no_main]

use baton_sidecar::config::{compile, yaml};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(snapshot) = yaml::parse(text) else { return };
    if compile(&snapshot).is_ok() {
        let again = yaml::parse(&yaml::to_string(&snapshot).expect("serializable")).expect("round trip");
        assert!(compile(&again).is_ok());
    }
});
