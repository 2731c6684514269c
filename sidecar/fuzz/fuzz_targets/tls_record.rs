//! `baton-tls-record` on arbitrary input: the record-layer state as the
//! handoff carries it (JSON) and the records a moved session receives. The
//! check itself is `baton_tls_record::fuzzing::run` (so `cargo test` runs
//! it too): no panic and no loop on any state or record, never more
//! plaintext than ciphertext, and `RecordAlignedIo` hands every byte on.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| baton_tls_record::fuzzing::run(data));
