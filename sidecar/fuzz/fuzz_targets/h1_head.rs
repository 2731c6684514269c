//! The fast path's head parser (httparse, as `h1fast` calls it) and the
//! shared request-head validation on arbitrary bytes: neither panics, and a
//! head the validation accepts is one httparse reads completely, with the
//! same request line (so the fast path never forwards a head it read
//! differently from what was validated).
#![no_main]

use baton_wire::h1valid::validate;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    let parsed = req.parse(data);
    let Ok(_) = validate(data) else { return };
    match parsed {
        Ok(httparse::Status::Complete(n)) => assert_eq!(n, data.len()),
        Err(httparse::Error::TooManyHeaders) => return,
        other => panic!("validated, but httparse: {other:?}"),
    }
    let line = data
        .split(|b| *b == b'\n')
        .find(|l| !l.is_empty() && *l != b"\r")
        .expect("a request line");
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let parsed = format!(
        "{} {} HTTP/1.{}",
        req.method.unwrap(),
        req.path.unwrap(),
        req.version.unwrap()
    );
    assert_eq!(line, parsed.as_bytes());
});
