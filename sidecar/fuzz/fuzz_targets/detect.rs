//! Protocol detection on arbitrary bytes: never panics, and a decision made
//! on a prefix is never changed by more bytes.
#![no_main]

use baton_wire::detect::{Detection, detect};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut decided = None;
    for n in 0..=data.len().min(4096) {
        match (detect(&data[..n]), decided) {
            (Detection::Done(p), None) => decided = Some(p),
            (Detection::Done(p), Some(d)) => assert_eq!(p, d),
            (Detection::NeedMore, Some(_)) => panic!("decision reverted"),
            (Detection::NeedMore, None) => {}
        }
    }
});
