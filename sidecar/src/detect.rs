//! Protocol detection from a connection's first bytes (pure).
//!
//! Decides between HTTP/2 prior knowledge (the 24-byte client preface), a TLS
//! ClientHello (handed to the TLS layer), HTTP/1.x (a request line ending in
//! ` HTTP/1.0` / ` HTTP/1.1`) and anything else (raw TCP). The caller reads
//! until [`detect`] stops asking for more or the detection timeout fires (a
//! server-speaks-first protocol never sends first: raw TCP).

/// What a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    Http2,
    Tls,
    Tcp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detection {
    Done(Protocol),
    NeedMore,
}

pub const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Bytes after which an unterminated request line is judged by its method
/// alone (long URLs) and anything else is raw TCP.
pub const MAX_DETECT_BYTES: usize = 8192;

const METHODS: &[&[u8]] = &[
    b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS", b"TRACE", b"PATCH",
];

/// Classify `buf`, the bytes read so far.
pub fn detect(buf: &[u8]) -> Detection {
    if buf.is_empty() {
        return Detection::NeedMore;
    }
    // HTTP/2 preface (must precede the HTTP/1 check: "PRI" is a token).
    let n = buf.len().min(H2_PREFACE.len());
    if buf[..n] == H2_PREFACE[..n] {
        return if n == H2_PREFACE.len() {
            Detection::Done(Protocol::Http2)
        } else {
            Detection::NeedMore
        };
    }
    // TLS record: handshake (22), major version 3.
    if buf[0] == 0x16 {
        return match buf.get(1) {
            None => Detection::NeedMore,
            Some(3) => Detection::Done(Protocol::Tls),
            Some(_) => Detection::Done(Protocol::Tcp),
        };
    }
    // HTTP/1: TOKEN SP target SP HTTP/1.x CRLF
    let token_len = buf.iter().take_while(|b| b.is_ascii_uppercase()).count();
    if token_len == buf.len() {
        return if token_len < 16 {
            Detection::NeedMore
        } else {
            Detection::Done(Protocol::Tcp)
        };
    }
    if token_len == 0 || token_len >= 16 || buf[token_len] != b' ' {
        return Detection::Done(Protocol::Tcp);
    }
    match buf.iter().position(|b| *b == b'\n') {
        Some(eol) => {
            let line = buf[..eol].strip_suffix(b"\r").unwrap_or(&buf[..eol]);
            if line.ends_with(b" HTTP/1.1") || line.ends_with(b" HTTP/1.0") {
                Detection::Done(Protocol::Http1)
            } else {
                Detection::Done(Protocol::Tcp)
            }
        }
        None if buf.len() >= MAX_DETECT_BYTES => {
            if METHODS.contains(&&buf[..token_len]) {
                Detection::Done(Protocol::Http1)
            } else {
                Detection::Done(Protocol::Tcp)
            }
        }
        None => Detection::NeedMore,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(b: &[u8]) -> Detection {
        detect(b)
    }

    #[test]
    fn http1_request_lines_are_detected_once_complete() {
        assert_eq!(d(b"GET / HTTP/1.1\r\n"), Detection::Done(Protocol::Http1));
        assert_eq!(d(b"POST /x?y HTTP/1.0\n"), Detection::Done(Protocol::Http1));
        assert_eq!(d(b"G"), Detection::NeedMore);
        assert_eq!(d(b"GET /"), Detection::NeedMore);
        assert_eq!(d(b"GET / HTTP/1.1"), Detection::NeedMore);
    }

    #[test]
    fn h2_preface_is_detected_only_when_complete() {
        assert_eq!(d(H2_PREFACE), Detection::Done(Protocol::Http2));
        assert_eq!(d(&H2_PREFACE[..10]), Detection::NeedMore);
        assert_eq!(d(b"PRI"), Detection::NeedMore);
        let mut more = H2_PREFACE.to_vec();
        more.extend_from_slice(b"\x00\x00");
        assert_eq!(d(&more), Detection::Done(Protocol::Http2));
    }

    #[test]
    fn tls_client_hello_is_detected() {
        assert_eq!(d(&[0x16]), Detection::NeedMore);
        assert_eq!(d(&[0x16, 0x03, 0x01]), Detection::Done(Protocol::Tls));
        assert_eq!(d(&[0x16, 0x09]), Detection::Done(Protocol::Tcp));
    }

    #[test]
    fn anything_else_is_raw_tcp() {
        assert_eq!(d(b"\x00\x01binary"), Detection::Done(Protocol::Tcp));
        assert_eq!(d(b"hello world\n"), Detection::Done(Protocol::Tcp));
        assert_eq!(
            d(b"SET key value\r\n"),
            Detection::Done(Protocol::Tcp),
            "not an HTTP request line"
        );
        assert_eq!(d(b"PING\r\n"), Detection::Done(Protocol::Tcp));
        assert_eq!(d(b"ABCDEFGHIJKLMNOPQ"), Detection::Done(Protocol::Tcp));
        assert_eq!(d(b"GET / SSH-2.0\r\n"), Detection::Done(Protocol::Tcp));
    }

    #[test]
    fn long_unterminated_lines_fall_back_on_the_method() {
        let mut long = b"GET /".to_vec();
        long.resize(MAX_DETECT_BYTES, b'a');
        assert_eq!(d(&long), Detection::Done(Protocol::Http1));
        let mut weird = b"FOO /".to_vec();
        weird.resize(MAX_DETECT_BYTES, b'a');
        assert_eq!(d(&weird), Detection::Done(Protocol::Tcp));
    }

    /// Once detection decides, more bytes never change the decision (the
    /// fuzz target checks the same property on arbitrary input).
    #[test]
    fn a_decision_is_stable_when_more_bytes_arrive() {
        let samples: [&[u8]; 6] = [
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            b"ABCDEFGHIJKLMNOPQRS / HTTP/1.1\r\n",
            H2_PREFACE,
            b"\x16\x03\x01\x00\x10",
            b"PRX * HTTP/2.0\r\n",
            b"GET /x SSH\r\nmore",
        ];
        for sample in samples {
            let mut decided = None;
            for n in 0..=sample.len() {
                match (detect(&sample[..n]), decided) {
                    (Detection::Done(p), None) => decided = Some(p),
                    (Detection::Done(p), Some(d)) => assert_eq!(p, d, "{sample:?} at {n}"),
                    (Detection::NeedMore, Some(d)) => {
                        panic!("{sample:?} went back to NeedMore after {d:?}")
                    }
                    (Detection::NeedMore, None) => {}
                }
            }
        }
    }

    #[test]
    fn detection_never_panics_on_any_two_byte_prefix() {
        for a in 0..=255u8 {
            for b in 0..=255u8 {
                let _ = detect(&[a, b]);
            }
        }
    }
}
