//! HTTP/1.1 request-head validation (RFC 9110 / RFC 9112), shared by both
//! HTTP/1 paths (pure).
//!
//! Why one function: the fast path (`h1fast`, httparse) and the general path
//! (hyper, behind the framing shadow in `conn`) parse heads differently, and
//! each parser lets different things through (httparse takes any token as a
//! method and raw bytes in the target; hyper keeps duplicate `Host` lines,
//! drops a fragment, resolves `Content-Length` + `Transfer-Encoding` on its
//! own). Both paths run [`validate`] on the raw head bytes *before* anything
//! is routed or written upstream: the fast path on every head it parsed, the
//! general path in the read-side shadow, which withholds a head from hyper
//! until it is complete and valid. A rule added here reaches both paths.
//!
//! What is refused (400 unless noted), following RFC 9112 and, where the RFC
//! leaves a choice, what nginx and Envoy do:
//! * the request line: a method that is not a token; anything but single
//!   spaces between its three parts; no HTTP version (`GET /`, 400); a version
//!   other than `HTTP/1.0` / `HTTP/1.1` (505; `HTTP/1.2` too, which RFC 9110
//!   §2.5 would serve as 1.1 but neither parser reads); `CONNECT` (501: the
//!   mesh does not tunnel);
//! * the target: origin-form (`/…`) for every method, `*` for `OPTIONS` only,
//!   absolute-form (`http://` / `https://` with a non-empty host and no
//!   userinfo, RFC 9110 §4.2.4), no fragment, nothing the `http` crate (what
//!   hyper builds) refuses;
//! * `Host` (RFC 9112 §3.2): exactly one line in HTTP/1.1 (at most one in
//!   1.0), a valid non-empty authority without userinfo. With an
//!   absolute-form target, the target's authority wins (RFC 9112 §3.2.2, as
//!   nginx and Envoy do) and is what the upstream gets as `Host`;
//! * header lines: obs-fold, a name that is not a token (whitespace before
//!   the colon included), a value with a control character, a bare CR
//!   anywhere;
//! * framing (RFC 9112 §6): `Content-Length` with `Transfer-Encoding`; more
//!   than one `Content-Length` line (nginx and Envoy refuse even equal ones);
//!   a non-numeric length; `Transfer-Encoding` in HTTP/1.0, whose last coding
//!   is not `chunked`, or with `chunked` twice; any other coding (501);
//! * `Upgrade` (with the `upgrade` connection option): one `websocket` on a
//!   `GET` is relayed as before; `h2c` alone is ignored (RFC 9110 §7.8 lets a
//!   server ignore an upgrade; nginx and Envoy serve such a request as
//!   HTTP/1.1, and RFC 9113 deprecates h2c); any other protocol is refused;
//! * `Connection` options naming `Host`, `Content-Length` or
//!   `Transfer-Encoding`: a proxy drops the fields `Connection` names
//!   (RFC 9110 §7.6.1), and dropping one of these would forward a request
//!   routed or framed differently from the one validated (a `Content-Length`
//!   dropped on the way leaves its body to be read as the next request).
//!
//! Bare LF line ends are accepted, as both parsers (and nginx) do (RFC 9112
//! §2.2 allows it). Chunked *bodies* are not checked here: the framing shadow
//! withholds a chunked request's head until its first chunk-size line is
//! valid ([`Refusal::ChunkSize`] otherwise); later chunks are checked as they
//! stream (hyper's decoder), and a malformed one aborts the upstream request.

use http::StatusCode;

/// Why a request head was refused; [`Refusal::reason`] is the metric label
/// and the `x-baton-local-reason` of the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[repr(u8)]
pub enum Refusal {
    #[error("malformed request line")]
    RequestLine = 1,
    #[error("request line without an HTTP version")]
    VersionMissing,
    #[error("HTTP version not supported (HTTP/1.0 and HTTP/1.1 only)")]
    VersionUnsupported,
    #[error("method is not a token")]
    Method,
    #[error("CONNECT is not supported")]
    Connect,
    #[error("invalid request target")]
    Target,
    #[error("malformed header line")]
    HeaderLine,
    #[error("obsolete line folding in a header")]
    ObsFold,
    #[error("control character in a header value")]
    HeaderValue,
    #[error("bare CR in the request head")]
    BareCr,
    #[error("missing Host header")]
    HostMissing,
    #[error("more than one Host header")]
    HostDuplicate,
    #[error("invalid Host header")]
    HostInvalid,
    #[error("request has both Content-Length and Transfer-Encoding")]
    Smuggling,
    #[error("invalid or repeated Content-Length")]
    ContentLength,
    #[error("invalid Transfer-Encoding")]
    TransferEncoding,
    #[error("only a single `chunked` transfer coding is accepted")]
    TransferCoding,
    #[error("upgrade to this protocol is not supported")]
    Upgrade,
    /// Found by the framing shadow, not by [`validate`]: the first chunk-size
    /// line of a chunked body (checked before the head is released).
    #[error("invalid chunk size line")]
    ChunkSize,
    #[error("Connection names a field that frames or routes the request")]
    ConnectionOption,
}

impl Refusal {
    /// Every refusal, for tests and the fuzz target.
    pub const ALL: [Refusal; 20] = [
        Refusal::RequestLine,
        Refusal::VersionMissing,
        Refusal::VersionUnsupported,
        Refusal::Method,
        Refusal::Connect,
        Refusal::Target,
        Refusal::HeaderLine,
        Refusal::ObsFold,
        Refusal::HeaderValue,
        Refusal::BareCr,
        Refusal::HostMissing,
        Refusal::HostDuplicate,
        Refusal::HostInvalid,
        Refusal::Smuggling,
        Refusal::ContentLength,
        Refusal::TransferEncoding,
        Refusal::TransferCoding,
        Refusal::Upgrade,
        Refusal::ChunkSize,
        Refusal::ConnectionOption,
    ];

    /// The status RFC 9110/9112 asks for.
    pub fn status(self) -> StatusCode {
        match self {
            Refusal::VersionUnsupported => StatusCode::HTTP_VERSION_NOT_SUPPORTED,
            Refusal::Connect | Refusal::TransferCoding => StatusCode::NOT_IMPLEMENTED,
            _ => StatusCode::BAD_REQUEST,
        }
    }

    /// The metric label (stable: dashboards use it).
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::RequestLine => "request_line_invalid",
            Refusal::VersionMissing => "version_missing",
            Refusal::VersionUnsupported => "version_unsupported",
            Refusal::Method => "method_invalid",
            Refusal::Connect => "connect_unsupported",
            Refusal::Target => "target_invalid",
            Refusal::HeaderLine => "header_line_invalid",
            Refusal::ObsFold => "header_folded",
            Refusal::HeaderValue => "header_value_invalid",
            Refusal::BareCr => "bare_cr",
            Refusal::HostMissing => "host_missing",
            Refusal::HostDuplicate => "host_duplicate",
            Refusal::HostInvalid => "host_invalid",
            Refusal::Smuggling => "request_smuggling",
            Refusal::ContentLength => "content_length_invalid",
            Refusal::TransferEncoding => "transfer_encoding_invalid",
            Refusal::TransferCoding => "transfer_coding_unsupported",
            Refusal::Upgrade => "upgrade_unsupported",
            Refusal::ChunkSize => "chunk_size_invalid",
            Refusal::ConnectionOption => "connection_option_invalid",
        }
    }

    /// For passing a refusal through an atomic.
    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(code: u8) -> Option<Refusal> {
        Refusal::ALL.into_iter().find(|r| r.code() == code)
    }

    /// The whole HTTP/1.1 answer, as the fast path writes it (the general
    /// path builds the same response through hyper): the status, the reason
    /// header, `Connection: close`, and the message as the body (none for a
    /// `HEAD` request).
    pub fn response(self, head_request: bool) -> Vec<u8> {
        let status = self.status();
        let body = format!("{self}\n");
        let mut out = format!(
            "HTTP/1.1 {} {}\r\ncontent-type: text/plain; charset=utf-8\r\nx-baton-local-reason: {}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
            status.as_u16(),
            status.canonical_reason().unwrap_or(""),
            self.reason(),
            body.len(),
        )
        .into_bytes();
        if !head_request {
            out.extend_from_slice(body.as_bytes());
        }
        out
    }
}

/// What an accepted upgrade request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upgrade {
    /// Not an upgrade request (an `Upgrade` header without the `upgrade`
    /// connection option is a plain hop-by-hop header, dropped).
    None,
    /// Relayed to the upstream; the connection is spliced after a 101.
    WebSocket,
    /// Ignored: served as an HTTP/1.1 request without the upgrade offer.
    H2c,
}

/// What the rest of the request path needs from an accepted head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    /// 0 or 1 (`HTTP/1.x`).
    pub minor_version: u8,
    pub upgrade: Upgrade,
    /// The target is in absolute form: its authority is the request's host.
    pub absolute_form: bool,
}

/// Validate one request head: the bytes from the start of the request line
/// (empty lines before it are skipped, RFC 9112 §2.2) through the empty line
/// that ends it.
pub fn validate(head: &[u8]) -> Result<Accepted, Refusal> {
    let mut lines = Lines::new(head);
    let request_line = loop {
        match lines.next() {
            Some(Ok([])) => continue,
            Some(Ok(line)) => break line,
            Some(Err(r)) => return Err(r),
            None => return Err(Refusal::RequestLine),
        }
    };
    let (method, target, minor_version) = request_line_parts(request_line)?;
    let absolute_form = check_target(method, target)?;

    let mut hosts = 0u32;
    let mut host: &[u8] = b"";
    let mut lengths = 0u32;
    let mut te = Codings::default();
    let mut te_seen = false;
    let mut connection_upgrade = false;
    // Every protocol of every `Upgrade` line: the paths must not read one
    // line where this reads another.
    let mut upgrade: Vec<&[u8]> = Vec::new();
    let mut ended = false;
    for line in lines.by_ref() {
        let line = line?;
        if line.is_empty() {
            ended = true;
            break;
        }
        if matches!(line[0], b' ' | b'\t') {
            return Err(Refusal::ObsFold);
        }
        let colon = line
            .iter()
            .position(|b| *b == b':')
            .ok_or(Refusal::HeaderLine)?;
        let name = &line[..colon];
        if name.is_empty() || !name.iter().all(|b| is_tchar(*b)) {
            return Err(Refusal::HeaderLine);
        }
        let value = &line[colon + 1..];
        if value.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f) {
            return Err(Refusal::HeaderValue);
        }
        let value = value.trim_ascii();
        if name.eq_ignore_ascii_case(b"host") {
            hosts += 1;
            host = value;
        } else if name.eq_ignore_ascii_case(b"content-length") {
            lengths += 1;
            if parse_length(value).is_none() {
                return Err(Refusal::ContentLength);
            }
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            te_seen = true;
            te.add(value);
        } else if name.eq_ignore_ascii_case(b"connection") {
            connection_upgrade |= has_token(value, b"upgrade");
            // Both paths drop the fields `Connection` names (RFC 9110
            // §7.6.1); dropping one of these would forward a request framed
            // or routed differently from the one validated here.
            if PROTECTED_FIELDS.iter().any(|f| has_token(value, f)) {
                return Err(Refusal::ConnectionOption);
            }
        } else if name.eq_ignore_ascii_case(b"upgrade") {
            upgrade.extend(
                value
                    .split(|b| *b == b',')
                    .map(<[u8]>::trim_ascii)
                    .filter(|p| !p.is_empty()),
            );
        }
    }
    if !ended || lines.rest_len() != 0 {
        // Not one whole head: callers pass exactly one.
        return Err(Refusal::RequestLine);
    }

    // Host (RFC 9112 §3.2): required in 1.1, never repeated, always valid.
    match hosts {
        0 if minor_version == 1 => return Err(Refusal::HostMissing),
        0 => {}
        1 => check_host(host)?,
        _ => return Err(Refusal::HostDuplicate),
    }

    // Framing (RFC 9112 §6.1, §6.3).
    if te_seen && lengths > 0 {
        return Err(Refusal::Smuggling);
    }
    if lengths > 1 {
        return Err(Refusal::ContentLength);
    }
    if te_seen {
        if minor_version == 0 || te.empty || !te.last_chunked {
            return Err(Refusal::TransferEncoding);
        }
        if te.other {
            return Err(Refusal::TransferCoding);
        }
        if te.chunked > 1 {
            return Err(Refusal::TransferEncoding);
        }
    }

    // Upgrade (RFC 9110 §7.8): only with the `upgrade` connection option.
    let upgrade = if connection_upgrade && minor_version == 1 && !upgrade.is_empty() {
        classify_upgrade(method, &upgrade)?
    } else {
        Upgrade::None
    };
    Ok(Accepted {
        minor_version,
        upgrade,
        absolute_form,
    })
}

/// Hop-by-hop fields neither path forwards (RFC 9110 §7.6.1, plus
/// `HTTP2-Settings`, which only means something with an `h2c` offer), besides
/// the ones `Connection` names. One list so both paths drop the same ones;
/// `Transfer-Encoding` is not in it (the fast path copies a chunked response
/// as it is; hyper re-frames and drops it on its own).
pub const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
    "http2-settings",
];

/// Fields a `Connection` option may not name: they decide where the request
/// goes (`Host`) and where it ends (`Content-Length`, `Transfer-Encoding`).
const PROTECTED_FIELDS: [&[u8]; 3] = [b"host", b"content-length", b"transfer-encoding"];

/// `method SP target SP HTTP/1.x`, with exactly one space between parts.
fn request_line_parts(line: &[u8]) -> Result<(&[u8], &[u8], u8), Refusal> {
    let mut parts = line.split(|b| *b == b' ');
    let method = parts.next().unwrap_or(b"");
    let target = parts.next();
    let version = parts.next();
    if parts.next().is_some() {
        return Err(Refusal::RequestLine);
    }
    if method.is_empty() || !method.iter().all(|b| is_tchar(*b)) {
        return Err(Refusal::Method);
    }
    let Some(target) = target.filter(|t| !t.is_empty() && !t.contains(&b'\t')) else {
        return Err(Refusal::RequestLine);
    };
    let Some(version) = version else {
        // HTTP/0.9's `GET /path`: no version at all.
        return Err(Refusal::VersionMissing);
    };
    let minor = match version {
        [b'H', b'T', b'T', b'P', b'/', major, b'.', minor]
            if major.is_ascii_digit() && minor.is_ascii_digit() =>
        {
            if *major != b'1' || *minor > b'1' {
                return Err(Refusal::VersionUnsupported);
            }
            minor - b'0'
        }
        _ => return Err(Refusal::RequestLine),
    };
    if method == b"CONNECT" {
        return Err(Refusal::Connect);
    }
    Ok((method, target, minor))
}

/// The request-target's form must suit the method (RFC 9112 §3.2); returns
/// whether it is in absolute form.
fn check_target(method: &[u8], target: &[u8]) -> Result<bool, Refusal> {
    if target == b"*" {
        return if method == b"OPTIONS" {
            Ok(false)
        } else {
            Err(Refusal::Target)
        };
    }
    // A fragment is never sent (RFC 9110 §4.2.5); hyper would drop it while
    // the fast path forwards it: refuse, so both paths agree.
    if target.contains(&b'#') {
        return Err(Refusal::Target);
    }
    // What hyper builds from the target: anything it refuses is refused here
    // (so both paths refuse it, with a reason).
    let uri = http::Uri::try_from(target).map_err(|_| Refusal::Target)?;
    if target[0] == b'/' {
        return Ok(false);
    }
    let scheme_ok = uri
        .scheme_str()
        .is_some_and(|s| s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https"));
    let Some(authority) = uri.authority() else {
        return Err(Refusal::Target);
    };
    if !scheme_ok || !authority_is_host_port(authority) || authority.as_str().contains('@') {
        return Err(Refusal::Target);
    }
    Ok(true)
}

/// A non-empty host and, if a `:` follows it, a port that is a number
/// (the `http` crate checks the port only when asked).
fn authority_is_host_port(authority: &http::uri::Authority) -> bool {
    let host = authority.host();
    !host.is_empty() && (authority.as_str().len() == host.len() || authority.port_u16().is_some())
}

/// `Host = uri-host [ ":" port ]` (RFC 9110 §7.2), non-empty, no userinfo.
fn check_host(value: &[u8]) -> Result<(), Refusal> {
    if value.is_empty() || value.contains(&b'@') {
        return Err(Refusal::HostInvalid);
    }
    let authority = http::uri::Authority::try_from(value).map_err(|_| Refusal::HostInvalid)?;
    if !authority_is_host_port(&authority) {
        return Err(Refusal::HostInvalid);
    }
    Ok(())
}

/// One `websocket` on a `GET` is relayed; only `h2c` is ignored; anything
/// else is refused. `protocols`: every one offered, across all `Upgrade`
/// lines (hyper's path reads the first line only, so two lines that each
/// look acceptable must not pass as one).
fn classify_upgrade(method: &[u8], protocols: &[&[u8]]) -> Result<Upgrade, Refusal> {
    let named = |p: &[u8], name: &[u8]| {
        p.split(|b| *b == b'/')
            .next()
            .is_some_and(|n| n.eq_ignore_ascii_case(name))
    };
    if let [only] = protocols
        && named(only, b"websocket")
    {
        return if method == b"GET" {
            Ok(Upgrade::WebSocket)
        } else {
            Err(Refusal::Upgrade)
        };
    }
    if protocols.iter().all(|p| p.eq_ignore_ascii_case(b"h2c")) {
        return Ok(Upgrade::H2c);
    }
    Err(Refusal::Upgrade)
}

/// `Transfer-Encoding` codings across all its lines.
#[derive(Debug, Default)]
struct Codings {
    chunked: u32,
    other: bool,
    last_chunked: bool,
    empty: bool,
}

impl Codings {
    fn add(&mut self, value: &[u8]) {
        let mut any = false;
        for coding in value.split(|b| *b == b',').map(<[u8]>::trim_ascii) {
            if coding.is_empty() {
                continue;
            }
            any = true;
            // A coding may carry parameters (`gzip;q=1`): the name decides.
            let chunked = coding.eq_ignore_ascii_case(b"chunked");
            if chunked {
                self.chunked += 1;
            } else {
                self.other = true;
            }
            self.last_chunked = chunked;
        }
        self.empty |= !any;
    }
}

/// Whether a comma-separated value lists `token` (case-insensitive).
fn has_token(value: &[u8], token: &[u8]) -> bool {
    value
        .split(|b| *b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// `tchar` (RFC 9110 §5.6.2).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The lines of a head: LF or CRLF ends; a CR anywhere else is a bare CR.
struct Lines<'a> {
    rest: &'a [u8],
}

impl<'a> Lines<'a> {
    fn new(head: &'a [u8]) -> Self {
        Self { rest: head }
    }

    fn rest_len(&self) -> usize {
        self.rest.len()
    }
}

impl<'a> Iterator for Lines<'a> {
    type Item = Result<&'a [u8], Refusal>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let Some(lf) = self.rest.iter().position(|b| *b == b'\n') else {
            // No line end: not a complete head.
            self.rest = &[];
            return Some(Err(Refusal::RequestLine));
        };
        let line = &self.rest[..lf];
        self.rest = &self.rest[lf + 1..];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.contains(&b'\r') {
            return Some(Err(Refusal::BareCr));
        }
        Some(Ok(line))
    }
}

/// A `Content-Length` value: digits only (RFC 9110 §8.6), no sign, no list.
pub fn parse_length(value: &[u8]) -> Option<u64> {
    let v = value.trim_ascii();
    if v.is_empty() {
        return None;
    }
    v.iter().try_fold(0u64, |n, b| {
        b.is_ascii_digit()
            .then(|| n.checked_mul(10)?.checked_add(u64::from(b - b'0')))
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(head: &str) -> Result<Accepted, Refusal> {
        validate(head.as_bytes())
    }

    fn refused(head: &str) -> Refusal {
        v(head).expect_err(head)
    }

    #[test]
    fn ordinary_requests_are_accepted_with_what_the_proxy_needs() {
        let ok = v("GET /a?b=1 HTTP/1.1\r\nHost: x:80\r\nAccept: */*\r\n\r\n").unwrap();
        assert_eq!(
            ok,
            Accepted {
                minor_version: 1,
                upgrade: Upgrade::None,
                absolute_form: false
            }
        );
        assert_eq!(v("GET / HTTP/1.0\r\n\r\n").unwrap().minor_version, 0);
        assert!(v("\r\n\r\nPOST /p HTTP/1.1\nHost: x\nContent-Length: 3\n\n").is_ok());
        assert!(v("OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n").is_ok());
        assert!(
            v("PROPFIND /dav HTTP/1.1\r\nHost: x\r\nX-Empty:\r\nX-Obs: caf\u{e9}\r\n\r\n").is_ok()
        );
        assert!(
            v("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n").is_ok(),
            "a single chunked coding"
        );
        assert!(v("GET / HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n").is_ok());
    }

    #[test]
    fn the_request_line_must_be_method_target_and_an_http_1_version() {
        assert_eq!(refused("GET /\r\n\r\n"), Refusal::VersionMissing);
        assert_eq!(refused("GET\r\n\r\n"), Refusal::RequestLine);
        assert_eq!(
            refused("GET / HTTP/2.0\r\nHost: x\r\n\r\n"),
            Refusal::VersionUnsupported
        );
        assert_eq!(
            refused("GET / HTTP/1.2\r\nHost: x\r\n\r\n"),
            Refusal::VersionUnsupported
        );
        assert_eq!(
            refused("GET / HTTP/0.9\r\n\r\n"),
            Refusal::VersionUnsupported
        );
        for bad in [
            "GET / http/1.1\r\nHost: x\r\n\r\n",
            "GET / HTTP/1.1 \r\nHost: x\r\n\r\n",
            "GET  / HTTP/1.1\r\nHost: x\r\n\r\n",
            "GET / HTTP/11.1\r\nHost: x\r\n\r\n",
            "GET /\tHTTP/1.1\r\nHost: x\r\n\r\n",
            " GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        ] {
            assert_eq!(refused(bad), Refusal::RequestLine, "{bad:?}");
        }
        for bad in [
            "G(T / HTTP/1.1\r\nHost: x\r\n\r\n",
            "GE\u{0}T / HTTP/1.1\r\nHost: x\r\n\r\n",
            "G\"T / HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(refused(bad), Refusal::Method, "{bad:?}");
        }
        assert_eq!(
            refused("CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n"),
            Refusal::Connect
        );
        assert_eq!(Refusal::Connect.status(), StatusCode::NOT_IMPLEMENTED);
        assert_eq!(
            Refusal::VersionUnsupported.status(),
            StatusCode::HTTP_VERSION_NOT_SUPPORTED
        );
    }

    #[test]
    fn targets_must_suit_the_method_and_parse_as_hyper_parses_them() {
        assert_eq!(
            refused("GET * HTTP/1.1\r\nHost: x\r\n\r\n"),
            Refusal::Target
        );
        assert_eq!(
            refused("GET x.example:80 HTTP/1.1\r\nHost: x\r\n\r\n"),
            Refusal::Target
        );
        assert_eq!(
            refused("GET /a#frag HTTP/1.1\r\nHost: x\r\n\r\n"),
            Refusal::Target
        );
        assert_eq!(
            refused("GET /a<b HTTP/1.1\r\nHost: x\r\n\r\n"),
            Refusal::Target
        );
        assert_eq!(
            refused("GET ftp://x/ HTTP/1.1\r\nHost: x\r\n\r\n"),
            Refusal::Target
        );
        assert_eq!(
            refused("GET http://u@x/ HTTP/1.1\r\nHost: x\r\n\r\n"),
            Refusal::Target
        );
        assert_eq!(
            refused("GET http:/// HTTP/1.1\r\nHost: x\r\n\r\n"),
            Refusal::Target
        );
        let abs = v("GET http://a.example:8080/p?q HTTP/1.1\r\nHost: b.example\r\n\r\n").unwrap();
        assert!(abs.absolute_form, "the target's authority wins over Host");
    }

    #[test]
    fn host_is_required_once_in_http_1_1_and_must_be_an_authority() {
        assert_eq!(refused("GET / HTTP/1.1\r\n\r\n"), Refusal::HostMissing);
        assert_eq!(
            refused("GET http://a/ HTTP/1.1\r\n\r\n"),
            Refusal::HostMissing,
            "absolute form does not make Host optional"
        );
        assert_eq!(
            refused("GET / HTTP/1.1\r\nHost: a\r\nhost: a\r\n\r\n"),
            Refusal::HostDuplicate
        );
        assert_eq!(
            refused("GET / HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n"),
            Refusal::HostDuplicate
        );
        for bad in ["", "a b", "u@a", "a:x", "a/b", ":80"] {
            assert_eq!(
                refused(&format!("GET / HTTP/1.1\r\nHost: {bad}\r\n\r\n")),
                Refusal::HostInvalid,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn header_lines_that_parsers_read_differently_are_refused() {
        assert_eq!(
            refused("GET / HTTP/1.1\r\nHost: x\r\nX: 1\r\n folded\r\n\r\n"),
            Refusal::ObsFold
        );
        assert_eq!(
            refused("GET / HTTP/1.1\r\nHost: x\r\nX : 1\r\n\r\n"),
            Refusal::HeaderLine
        );
        assert_eq!(
            refused("GET / HTTP/1.1\r\nHost: x\r\nNo colon\r\n\r\n"),
            Refusal::HeaderLine
        );
        assert_eq!(
            refused("GET / HTTP/1.1\r\nHost: x\r\n: empty\r\n\r\n"),
            Refusal::HeaderLine
        );
        assert_eq!(
            refused("GET / HTTP/1.1\r\nHost: x\r\nX\u{1}Y: 1\r\n\r\n"),
            Refusal::HeaderLine
        );
        assert_eq!(
            refused("GET / HTTP/1.1\r\nHost: x\r\nX: a\u{0}b\r\n\r\n"),
            Refusal::HeaderValue
        );
        assert_eq!(
            refused("GET / HTTP/1.1\r\nHost: x\r\nX: a\u{7f}\r\n\r\n"),
            Refusal::HeaderValue
        );
        assert_eq!(
            refused("GET / HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n"),
            Refusal::BareCr
        );
        assert_eq!(refused("GET / HTTP/1.1\rHost: x\r\n\r\n"), Refusal::BareCr);
    }

    #[test]
    fn framing_conflicts_are_refused_with_the_rfc_status() {
        let r = refused(
            "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        );
        assert_eq!(r, Refusal::Smuggling);
        assert_eq!(
            refused("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n"),
            Refusal::ContentLength
        );
        for bad in ["+1", "-1", "1,1", "0x10", "1 2", ""] {
            assert_eq!(
                refused(&format!(
                    "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {bad}\r\n\r\n"
                )),
                Refusal::ContentLength,
                "{bad:?}"
            );
        }
        let te = |v: &str, version: &str| {
            validate(
                format!("POST / HTTP/{version}\r\nHost: x\r\nTransfer-Encoding: {v}\r\n\r\n")
                    .as_bytes(),
            )
        };
        assert_eq!(te("gzip", "1.1"), Err(Refusal::TransferEncoding));
        assert_eq!(te("chunked, gzip", "1.1"), Err(Refusal::TransferEncoding));
        assert_eq!(te("gzip, chunked", "1.1"), Err(Refusal::TransferCoding));
        assert_eq!(
            te("chunked, chunked", "1.1"),
            Err(Refusal::TransferEncoding)
        );
        assert_eq!(te("", "1.1"), Err(Refusal::TransferEncoding));
        assert_eq!(te("chunked", "1.0"), Err(Refusal::TransferEncoding));
        assert_eq!(
            Refusal::TransferCoding.status(),
            StatusCode::NOT_IMPLEMENTED
        );
        assert_eq!(
            refused(
                "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
            ),
            Refusal::TransferEncoding
        );
    }

    #[test]
    fn websocket_is_relayed_h2c_ignored_and_other_upgrades_refused() {
        let up = |method: &str, value: &str| {
            validate(format!("{method} / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, Upgrade\r\nUpgrade: {value}\r\n\r\n").as_bytes()).map(|a| a.upgrade)
        };
        assert_eq!(up("GET", "websocket"), Ok(Upgrade::WebSocket));
        assert_eq!(up("GET", "WebSocket"), Ok(Upgrade::WebSocket));
        assert_eq!(up("POST", "websocket"), Err(Refusal::Upgrade));
        assert_eq!(up("GET", "h2c"), Ok(Upgrade::H2c));
        assert_eq!(up("GET", "foo/1"), Err(Refusal::Upgrade));
        assert_eq!(up("GET", "websocket, foo"), Err(Refusal::Upgrade));
        assert_eq!(up("GET", "HTTP/2.0"), Err(Refusal::Upgrade));
        // Two lines are one list: hyper's path reads only the first.
        assert_eq!(
            up("GET", "websocket\r\nUpgrade: h2c"),
            Err(Refusal::Upgrade)
        );
        assert_eq!(
            up("GET", "websocket\r\nUpgrade: websocket"),
            Err(Refusal::Upgrade)
        );
        assert_eq!(up("GET", "h2c\r\nUpgrade: h2c"), Ok(Upgrade::H2c));
        // Without the connection option it is not an upgrade request.
        assert_eq!(
            v("GET / HTTP/1.1\r\nHost: x\r\nUpgrade: foo\r\n\r\n").map(|a| a.upgrade),
            Ok(Upgrade::None)
        );
    }

    #[test]
    fn connection_may_not_name_the_fields_that_route_or_frame_the_request() {
        for named in [
            "content-length",
            "Content-Length",
            "keep-alive, host",
            "transfer-encoding",
        ] {
            assert_eq!(
                refused(&format!(
                    "POST / HTTP/1.1\r\nHost: x\r\nConnection: {named}\r\nContent-Length: 3\r\n\r\n"
                )),
                Refusal::ConnectionOption,
                "{named:?}"
            );
        }
        // Other options (hop-by-hop or end-to-end) are dropped as before.
        assert!(v("GET / HTTP/1.1\r\nHost: x\r\nConnection: close, x-hop, te\r\n\r\n").is_ok());
        assert!(v("GET / HTTP/1.1\r\nHost: x\r\nConnection: hostname\r\n\r\n").is_ok());
    }

    #[test]
    fn refusals_round_trip_through_their_code_and_answer_with_connection_close() {
        for r in Refusal::ALL {
            assert_eq!(Refusal::from_code(r.code()), Some(r));
            let resp = String::from_utf8(r.response(false)).unwrap();
            assert!(
                resp.starts_with(&format!("HTTP/1.1 {} ", r.status().as_u16())),
                "{resp}"
            );
            assert!(resp.contains("\r\nconnection: close\r\n"), "{resp}");
            assert!(resp.ends_with(&format!("{r}\n")), "{resp}");
            assert!(
                String::from_utf8(r.response(true))
                    .unwrap()
                    .ends_with("\r\n\r\n")
            );
        }
        assert_eq!(Refusal::from_code(0), None);
    }

    /// The property the fuzz target checks, over a fixed-seed stream of
    /// mutated heads (bounded: runs in `cargo test`): validation never
    /// panics, and every head it accepts is one httparse (what both paths
    /// parse with) reads completely, with the same method, target and
    /// version.
    #[test]
    fn mutated_heads_never_panic_and_accepted_ones_parse_the_same_in_httparse() {
        use rand::{Rng, SeedableRng};
        let seeds: [&[u8]; 6] = [
            b"GET /a?b HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
            b"POST http://h:1/p HTTP/1.1\r\nHost: y\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
            b"OPTIONS * HTTP/1.0\n\n",
            b"\r\nHEAD / HTTP/1.1\nhost: a:1\nx: \xff\t\n\n",
            b"PUT /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\n",
        ];
        let alphabet = b" \t\r\n:/?#@*-.,;\"()<>{}[]\x00\x7f\x80\xffHTPGEOSUhostcnlgrkdw0123456789";
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x6261_746f_6e23);
        for _ in 0..50_000 {
            let mut head = seeds[rng.random_range(0..seeds.len())].to_vec();
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(0..=head.len());
                let b = alphabet[rng.random_range(0..alphabet.len())];
                match rng.random_range(0..3) {
                    0 => head.insert(at, b),
                    1 if at < head.len() => {
                        head.remove(at);
                    }
                    _ if at < head.len() => head[at] = b,
                    _ => head.push(b),
                }
            }
            check_against_httparse(&head);
        }
    }

    /// Validation against httparse on one input: no panic; an accepted head
    /// is one complete httparse head with the same request line.
    pub(crate) fn check_against_httparse(head: &[u8]) {
        let Ok(_) = validate(head) else { return };
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(head) {
            Ok(httparse::Status::Complete(n)) => {
                assert_eq!(n, head.len(), "{:?}", String::from_utf8_lossy(head));
            }
            Err(httparse::Error::TooManyHeaders) => return,
            other => panic!(
                "accepted but httparse says {other:?}: {:?}",
                String::from_utf8_lossy(head)
            ),
        }
        let line = head
            .split(|b| *b == b'\n')
            .find(|l| !l.is_empty() && *l != b"\r")
            .unwrap();
        let line = String::from_utf8_lossy(line.strip_suffix(b"\r").unwrap_or(line)).into_owned();
        let parsed = format!(
            "{} {} HTTP/1.{}",
            req.method.unwrap(),
            req.path.unwrap(),
            req.version.unwrap()
        );
        assert_eq!(line, parsed);
    }
}
