//! The HTTP/1 framing shadow (request validation and smuggling guard) on
//! arbitrary bytes: never panics, and whether and where it refuses (request
//! index, reason, absolute end of the refused request) does not depend on
//! how the stream is split into reads. The first input byte picks the read
//! size.
#![no_main]

use baton_wire::h1framing::{FramingVerdict, H1Framing};
use baton_wire::h1valid::Refusal;
use libfuzzer_sys::fuzz_target;

fn run(data: &[u8], step: usize) -> Option<(u64, Refusal, usize)> {
    let mut framing = H1Framing::new(1024);
    let mut offset = 0;
    for piece in data.chunks(step) {
        if let FramingVerdict::Refuse { index, why, end, head_len } = framing.feed(piece) {
            assert!(end >= 1 && end <= piece.len());
            assert!(head_len >= 1 && head_len <= offset + end);
            return Some((index, why, offset + end));
        }
        assert!(framing.withheld() <= offset + piece.len());
        offset += piece.len();
    }
    None
}

fuzz_target!(|input: &[u8]| {
    let Some((&step, data)) = input.split_first() else { return };
    let whole = run(data, data.len().max(1));
    assert_eq!(whole, run(data, usize::from(step).max(1)));
});
