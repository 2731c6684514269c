//! Protocol detection from a connection's first bytes (pure).
//!
//! Decides between HTTP/2 prior knowledge (the 24-byte client preface), a TLS
//! ClientHello (handed to the TLS layer), HTTP/1.x (a first line shaped like
//! a request line, valid or not: the HTTP path refuses the malformed ones)
//! and anything else (raw TCP). The caller reads
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
    // HTTP/1. Whatever is shaped like a request line goes to the HTTP path,
    // which validates it and answers a malformed one (400/505) instead of
    // tunnelling it to the upstream as raw TCP: a first line ending in
    // ` HTTP/<digit>.<digit>` (any method bytes, any version), or a known
    // method, a space and `/` (HTTP/0.9's version-less `GET /`, a bare CR).
    // Bytes that cannot be in a text protocol's first line (a control
    // character, a non-ASCII byte, a space or an empty line first) decide
    // raw TCP at once, so binary protocols are not kept waiting for a line
    // end.
    // Empty lines before a request line are skipped (RFC 9112 §2.2), as
    // both HTTP/1 parsers do.
    let skipped = buf
        .iter()
        .take_while(|b| matches!(b, b'\r' | b'\n'))
        .count();
    let buf = &buf[skipped..];
    match buf.first() {
        None if skipped < 8 => return Detection::NeedMore,
        Some(b) if b.is_ascii_graphic() => {}
        _ => return Detection::Done(Protocol::Tcp),
    }
    let window = &buf[..buf.len().min(MAX_DETECT_BYTES)];
    let eol = window.iter().position(|b| *b == b'\n');
    let line = &window[..eol.unwrap_or(window.len())];
    let method_len = line.iter().take_while(|b| b.is_ascii_uppercase()).count();
    let known_method = METHODS.contains(&&line[..method_len]);
    // A known method, a space and `/` is HTTP whatever follows: a control or
    // non-ASCII byte later in such a line is the HTTP path's to refuse, not
    // raw bytes to relay (no binary protocol starts with `GET /`).
    let origin_form = known_method && line.get(method_len..method_len + 2) == Some(b" /");
    if !origin_form
        && line
            .iter()
            .any(|&b| (b < 0x20 && b != b'\t' && b != b'\r') || b >= 0x7f)
    {
        return Detection::Done(Protocol::Tcp);
    }
    match eol {
        Some(_) => {
            if origin_form {
                return Detection::Done(Protocol::Http1);
            }
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            match line.len().checked_sub(9).map(|i| &line[i..]) {
                Some([b' ', h, t1, t2, p, b'/', major, b'.', minor])
                    if [*h, *t1, *t2, *p].eq_ignore_ascii_case(b"HTTP")
                        && major.is_ascii_digit()
                        && minor.is_ascii_digit() =>
                {
                    Detection::Done(Protocol::Http1)
                }
                _ => Detection::Done(Protocol::Tcp),
            }
        }
        None if buf.len() >= MAX_DETECT_BYTES => {
            if known_method {
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
        assert_eq!(d(b"\r\n"), Detection::NeedMore);
        assert_eq!(
            d(b"\r\nGET / HTTP/1.1\r\n"),
            Detection::Done(Protocol::Http1)
        );
        assert_eq!(d(b"\r\n\r\n\r\n\r\n\r\n"), Detection::Done(Protocol::Tcp));
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
        assert_eq!(
            d(b"get key\r\n"),
            Detection::Done(Protocol::Tcp),
            "memcached"
        );
        assert_eq!(d(b"A\x00\x00\x00binary"), Detection::Done(Protocol::Tcp));
        assert_eq!(d(b"ABCDEFGHIJKLMNOPQ"), Detection::NeedMore);
    }

    #[test]
    fn malformed_request_lines_are_http_so_the_http_path_refuses_them() {
        for line in [
            &b"GET /\r\n"[..],
            b"GET / HTTP/2.0\r\n",
            b"GET / HTTP/1.2\r\n",
            b"get / HTTP/1.1\r\n",
            b"G(T / HTTP/1.1\r\n",
            b"GET  /  HTTP/1.1\r\n",
            b"GET / http/1.1\r\n",
            b"GET / HTTP/1.1\rHost: x\r\n",
            b"GET / SSH-2.0\r\n",
            b"GET /\x7f HTTP/1.1\r\n",
            b"GET /a\x00 HTTP/1.1\r\n",
            b"POST /caf\xc3\xa9 HTTP/1.1\r\n",
        ] {
            assert_eq!(d(line), Detection::Done(Protocol::Http1), "{line:?}");
        }
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
        let samples: [&[u8]; 7] = [
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            b"ABCDEFGHIJKLMNOPQRS / HTTP/1.1\r\n",
            H2_PREFACE,
            b"\x16\x03\x01\x00\x10",
            b"PRX * HTTP/2.0\r\n",
            b"GET /x SSH\r\nmore",
            b"GET /\x00\x7f HTTP/1.1\r\n",
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
