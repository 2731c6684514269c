//! The HTTP/1 framing shadow (request-smuggling guard) on arbitrary bytes:
//! never panics, and whether and where it refuses (request index, absolute
//! end of the refused head) does not depend on how the stream is split into
//! reads. The first input byte picks the read size.
#![no_main]

use baton_sidecar::conn::{FramingVerdict, H1Framing};
use libfuzzer_sys::fuzz_target;

fn run(data: &[u8], step: usize) -> Option<(u64, usize)> {
    let mut framing = H1Framing::new(1024);
    let mut offset = 0;
    for piece in data.chunks(step) {
        if let FramingVerdict::Refuse { index, deliver } = framing.feed(piece) {
            assert!(deliver >= 1 && deliver <= piece.len());
            return Some((index, offset + deliver));
        }
        offset += piece.len();
    }
    None
}

fuzz_target!(|input: &[u8]| {
    let Some((&step, data)) = input.split_first() else { return };
    let whole = run(data, data.len().max(1));
    assert_eq!(whole, run(data, usize::from(step).max(1)));
});
