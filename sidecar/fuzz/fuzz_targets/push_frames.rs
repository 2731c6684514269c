//! The config stream's framed transport (decision 0066) on arbitrary bytes,
//! what an operator replica reads from any TLS peer before authenticating
//! it: the frame decoder never panics, frames the same however the bytes
//! are split, and never yields a frame over its limit; SIGN and SIGNED
//! payloads it accepts encode back to the same frame; a HELLO either parses
//! or is refused.
#![no_main]

use baton_config::framed::{self, Frame, FrameDecoder, Hello, Kind, Sign, Signed};
use libfuzzer_sys::fuzz_target;

fn frames(data: &[u8], chunk: usize) -> (Vec<Frame>, bool) {
    let mut decoder = FrameDecoder::new(framed::MAX_HELLO);
    let mut out = Vec::new();
    for piece in data.chunks(chunk) {
        decoder.extend(piece);
        loop {
            match decoder.next_frame() {
                Ok(Some(frame)) => out.push(frame),
                Ok(None) => break,
                Err(_) => return (out, true),
            }
        }
    }
    (out, false)
}

fuzz_target!(|data: &[u8]| {
    let Some((&size, rest)) = data.split_first() else {
        return;
    };
    let (whole, whole_err) = frames(rest, rest.len().max(1));
    let (split, split_err) = frames(rest, usize::from(size).max(1));
    assert_eq!(whole, split, "the split changed the frames");
    assert_eq!(whole_err, split_err, "the split changed the verdict");
    for frame in whole {
        let Frame::Known(kind, payload) = frame else {
            continue;
        };
        assert!(payload.len() < framed::MAX_HELLO);
        match kind {
            Kind::Sign => {
                if let Ok(sign) = Sign::decode(payload.clone()) {
                    assert_eq!(sign.encode()[5..], payload[..]);
                }
            }
            Kind::Signed => {
                if let Ok(signed) = Signed::decode(payload.clone()) {
                    assert_eq!(signed.encode()[5..], payload[..]);
                }
            }
            Kind::Hello => {
                let _ = framed::json::<Hello>("HELLO", &payload);
            }
            _ => {}
        }
    }
});
