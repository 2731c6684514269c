//! The carried HTTP/2 connection state (docs/decisions/0060) on arbitrary
//! bytes: `ConnState::decode` never panics, and a form it accepts encodes
//! back to the same bytes; the frame follower, fed the same bytes as a
//! connection's two directions in reads of the first byte's size, never
//! panics, and whatever it accepts it accepts whichever way it is split.
#![no_main]

use baton_wire::h2_state::{ConnState, PREFACE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(st) = ConnState::decode(data) {
        assert_eq!(st.encode().expect("a decoded state is idle"), data);
    }
    let Some((&size, rest)) = data.split_first() else {
        return;
    };
    let size = usize::from(size).max(1);
    let mut client = PREFACE.to_vec();
    client.extend_from_slice(rest);
    let (mut whole, mut split) = (ConnState::new(), ConnState::new());
    let a = whole.from_client(&client).is_ok() && whole.to_client(rest).is_ok();
    let b = client.chunks(size).all(|c| split.from_client(c).is_ok())
        && rest.chunks(size).all(|c| split.to_client(c).is_ok());
    assert_eq!(a, b, "the split changed the verdict");
    if a {
        assert_eq!(whole.idle(), split.idle());
        assert_eq!(whole.send_window(), split.send_window());
        assert_eq!(whole.recv_window(), split.recv_window());
        assert_eq!(whole.open_streams(), split.open_streams());
        let _ = whole.synthetic_preface();
        if let Ok(form) = whole.encode() {
            let back = ConnState::decode(&form).expect("its own form");
            assert_eq!(back.send_window(), whole.send_window());
        }
    }
});
