//! HTTP/1.1 request validation corpus (issue #23): raw request bytes sent to
//! a real sidecar on 127.0.0.1, against an upstream that records every byte
//! it receives, in three setups: the fast path on; the fast path on but
//! declining every request at the route (a listener with an access log, so
//! each head is validated by the fast path and then handed to hyper); and
//! the fast path off (every request through hyper).
//!
//! For each vector: the statuses the client gets, the refusal reason (the
//! `x-baton-local-reason` header, `Connection: close`, and the connection
//! closed after the answer), and exactly what reached the upstream — every
//! request it received, normalised (request line, headers sorted with
//! lower-case names, decoded body), and no byte that is not part of one of
//! them. After each vector a sentinel request on a fresh connection proves
//! the upstream has seen everything the sidecar was going to send.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_sidecar::config::yaml;
use baton_sidecar::server::{Running, StartOptions, start};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the recording upstream saw.
#[derive(Debug, Default)]
struct Seen {
    /// Every byte received, on any connection.
    raw: usize,
    /// The complete requests, normalised, and the bytes each took.
    requests: Vec<(String, usize)>,
}

struct Recorder {
    addr: SocketAddr,
    seen: Arc<Mutex<Seen>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Recorder {
    fn take(&self) -> Seen {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

/// An HTTP/1.1 upstream that records and answers `200 ok` to every
/// complete request (length or chunked body), keeping connections open.
async fn recorder() -> Recorder {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let shared = seen.clone();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let seen = shared.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    while let Some((text, len)) = parse_request(&buf) {
                        buf.drain(..len);
                        seen.lock().unwrap().requests.push((text, len));
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if s.write_all(ok).await.is_err() {
                            return;
                        }
                    }
                    let mut chunk = [0u8; 4096];
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            seen.lock().unwrap().raw += n;
                            buf.extend_from_slice(&chunk[..n]);
                        }
                    }
                }
            });
        }
    });
    Recorder { addr, seen, task }
}

/// One complete request at the start of `buf`, normalised, and its length.
fn parse_request(buf: &[u8]) -> Option<(String, usize)> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&buf[..end - 4]).into_owned();
    let mut lines = head.split("\r\n");
    let request_line = lines.next()?.to_owned();
    let mut headers: Vec<String> = lines
        .map(|l| {
            let (n, v) = l.split_once(':').unwrap_or((l, ""));
            format!("{}: {}", n.to_ascii_lowercase(), v.trim())
        })
        .collect();
    headers.sort();
    let header = |name: &str| {
        headers
            .iter()
            .find_map(|h| h.strip_prefix(&format!("{name}: ")))
            .map(str::to_owned)
    };
    let (body, len) = if header("transfer-encoding").as_deref() == Some("chunked") {
        let mut body = Vec::new();
        let mut at = end;
        loop {
            let eol = buf[at..].windows(2).position(|w| w == b"\r\n")? + at;
            let size = usize::from_str_radix(std::str::from_utf8(&buf[at..eol]).ok()?, 16).ok()?;
            at = eol + 2;
            if size == 0 {
                if buf.len() < at + 2 {
                    return None;
                }
                break (body, at + 2);
            }
            if buf.len() < at + size + 2 {
                return None;
            }
            body.extend_from_slice(&buf[at..at + size]);
            at += size + 2;
        }
    } else {
        let n: usize = header("content-length").map_or(0, |v| v.parse().unwrap());
        if buf.len() < end + n {
            return None;
        }
        (buf[end..end + n].to_vec(), end + n)
    };
    let mut text = format!("{request_line}\n{}", headers.join("\n"));
    if !body.is_empty() {
        text.push_str(&format!("\n\n{}", String::from_utf8_lossy(&body)));
    }
    Some((text, len))
}

/// One response from `bytes`: status, `x-baton-local-reason`, whether it
/// says `connection: close`, and its length.
fn parse_response(bytes: &[u8]) -> Option<(u16, Option<String>, bool, usize)> {
    let end = bytes.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&bytes[..end]).to_ascii_lowercase();
    let status = head.get(9..12)?.parse().ok()?;
    let field = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.trim().to_owned())
    };
    let len: usize = field("content-length").map_or(0, |v| v.parse().unwrap());
    let len = if head.starts_with("http/1.") && bytes.len() >= end + len {
        end + len
    } else {
        return None;
    };
    let close = field("connection").is_some_and(|v| v.contains("close"));
    Some((status, field("x-baton-local-reason"), close, len))
}

/// What one vector must produce.
struct Vector {
    name: &'static str,
    bytes: &'static [u8],
    /// The statuses of the responses, in order.
    statuses: Vec<u16>,
    /// For a refused vector: the last response's reason (it closes the
    /// connection).
    refused: Option<&'static str>,
    /// What the upstream receives, normalised (`{UP}`: the upstream's
    /// address).
    forwarded: Vec<&'static str>,
}

fn refuse(name: &'static str, bytes: &'static [u8], status: u16, reason: &'static str) -> Vector {
    Vector {
        name,
        bytes,
        statuses: vec![status],
        refused: Some(reason),
        forwarded: vec![],
    }
}

fn accept(name: &'static str, bytes: &'static [u8], forwarded: &'static str) -> Vector {
    Vector {
        name,
        bytes,
        statuses: vec![200],
        refused: None,
        forwarded: vec![forwarded],
    }
}

/// The corpus: RFC 9112 request-line, target and `Host` rules, header-line
/// shapes, framing conflicts (the classic smuggling shapes), chunk-size
/// edge cases, the `Upgrade` policy, and requests that must pass unchanged.
fn corpus() -> Vec<Vector> {
    vec![
        // Requests that pass, with exactly what the upstream gets.
        accept("origin-form GET", b"GET /a?b=1 HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n\r\n", "GET /a?b=1 HTTP/1.1\nhost: x\nx-a: 1"),
        accept("bare LF line ends", b"GET /lf HTTP/1.1\nHost: x\n\n", "GET /lf HTTP/1.1\nhost: x"),
        accept("an empty line before the request line", b"\r\nGET /e HTTP/1.1\r\nHost: x\r\n\r\n", "GET /e HTTP/1.1\nhost: x"),
        accept("OPTIONS *", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", "OPTIONS * HTTP/1.1\nhost: x"),
        accept("extension method", b"PROPFIND /dav HTTP/1.1\r\nHost: x\r\n\r\n", "PROPFIND /dav HTTP/1.1\nhost: x"),
        accept("POST with a length", b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", "POST /p HTTP/1.1\ncontent-length: 5\nhost: x\n\nhello"),
        accept("chunked POST", b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n0\r\n\r\n", "POST /c HTTP/1.1\nhost: x\ntransfer-encoding: chunked\n\nhello"),
        accept("absolute form: the target's authority wins over Host", b"GET http://a.example:8080/p?q HTTP/1.1\r\nHost: b.example\r\n\r\n", "GET /p?q HTTP/1.1\nhost: a.example:8080"),
        accept("HTTP/1.0 without Host", b"GET /old HTTP/1.0\r\n\r\n", "GET /old HTTP/1.1\nhost: {UP}"),
        accept("h2c offer: ignored, served as HTTP/1.1", b"GET /h2c HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n", "GET /h2c HTTP/1.1\nhost: x"),
        accept("Upgrade without the connection option is a dropped hop-by-hop header", b"GET /u HTTP/1.1\r\nHost: x\r\nUpgrade: foo\r\n\r\n", "GET /u HTTP/1.1\nhost: x"),
        accept("HTTP2-Settings without an h2c offer is dropped", b"GET /s HTTP/1.1\r\nHost: x\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n", "GET /s HTTP/1.1\nhost: x"),
        accept("fields named in Connection are dropped", b"GET /n HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, x-hop\r\nX-Hop: 1\r\nX-End: 2\r\n\r\n", "GET /n HTTP/1.1\nhost: x\nx-end: 2"),
        // Host (RFC 9112 §3.2).
        refuse("no Host in HTTP/1.1", b"GET / HTTP/1.1\r\n\r\n", 400, "host_missing"),
        refuse("no Host with an absolute-form target", b"GET http://a.example/ HTTP/1.1\r\n\r\n", 400, "host_missing"),
        refuse("two Host lines", b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "host_duplicate"),
        refuse("two equal Host lines", b"GET / HTTP/1.1\r\nHost: a\r\nhost: a\r\n\r\n", 400, "host_duplicate"),
        refuse("two Host lines in HTTP/1.0", b"GET / HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", 400, "host_duplicate"),
        refuse("empty Host", b"GET / HTTP/1.1\r\nHost:\r\n\r\n", 400, "host_invalid"),
        refuse("Host with a space", b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", 400, "host_invalid"),
        refuse("Host with userinfo", b"GET / HTTP/1.1\r\nHost: user@a\r\n\r\n", 400, "host_invalid"),
        refuse("Host with a path", b"GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", 400, "host_invalid"),
        refuse("Host with a bad port", b"GET / HTTP/1.1\r\nHost: a:x\r\n\r\n", 400, "host_invalid"),
        // The target.
        refuse("absolute form with another scheme", b"GET ftp://a/ HTTP/1.1\r\nHost: a\r\n\r\n", 400, "target_invalid"),
        refuse("absolute form with userinfo", b"GET http://u:p@a/ HTTP/1.1\r\nHost: a\r\n\r\n", 400, "target_invalid"),
        refuse("absolute form without a host", b"GET http:///p HTTP/1.1\r\nHost: a\r\n\r\n", 400, "target_invalid"),
        refuse("asterisk form on GET", b"GET * HTTP/1.1\r\nHost: a\r\n\r\n", 400, "target_invalid"),
        refuse("authority form on GET", b"GET a.example:80 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "target_invalid"),
        refuse("a fragment", b"GET /a#b HTTP/1.1\r\nHost: a\r\n\r\n", 400, "target_invalid"),
        refuse("a character the URI grammar excludes", b"GET /a<b> HTTP/1.1\r\nHost: a\r\n\r\n", 400, "target_invalid"),
        refuse("CONNECT", b"CONNECT a.example:443 HTTP/1.1\r\nHost: a.example:443\r\n\r\n", 501, "connect_unsupported"),
        // The request line.
        refuse("no HTTP version", b"GET /\r\n\r\n", 400, "version_missing"),
        refuse("no HTTP version, then headers", b"GET /x\r\nHost: a\r\n\r\n", 400, "version_missing"),
        refuse("HTTP/2.0 in an HTTP/1 request line", b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505, "version_unsupported"),
        refuse("HTTP/1.2", b"GET / HTTP/1.2\r\nHost: a\r\n\r\n", 505, "version_unsupported"),
        refuse("HTTP/0.9 spelled out", b"GET / HTTP/0.9\r\nHost: a\r\n\r\n", 505, "version_unsupported"),
        refuse("lower-case version", b"GET / http/1.1\r\nHost: a\r\n\r\n", 400, "request_line_invalid"),
        refuse("two spaces", b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", 400, "request_line_invalid"),
        refuse("a tab as separator", b"GET\t/ HTTP/1.1\r\nHost: a\r\n\r\n", 400, "method_invalid"),
        refuse("a space inside the method", b"GE T / HTTP/1.1\r\nHost: a\r\n\r\n", 400, "request_line_invalid"),
        refuse("a separator in the method", b"G(T / HTTP/1.1\r\nHost: a\r\n\r\n", 400, "method_invalid"),
        refuse("a method in brackets", b"[GET] / HTTP/1.1\r\nHost: a\r\n\r\n", 400, "method_invalid"),
        refuse("a DEL in the target", b"GET /\x7f HTTP/1.1\r\nHost: a\r\n\r\n", 400, "target_invalid"),
        refuse("a NUL in the target", b"GET /a\x00 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "target_invalid"),
        refuse("a bare CR in the request line", b"GET / HTTP/1.1\rHost: a\r\n\r\n", 400, "bare_cr"),
        // Header lines.
        refuse("obs-fold", b"GET / HTTP/1.1\r\nHost: a\r\nX-A: 1\r\n Content-Length: 4\r\n\r\nabcd", 400, "header_folded"),
        refuse("space before the colon", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length : 4\r\n\r\nabcd", 400, "header_line_invalid"),
        refuse("tab before the colon", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding\t: chunked\r\n\r\n0\r\n\r\n", 400, "header_line_invalid"),
        refuse("no colon", b"GET / HTTP/1.1\r\nHost: a\r\nBad Header Line\r\n\r\n", 400, "header_line_invalid"),
        refuse("empty name", b"GET / HTTP/1.1\r\nHost: a\r\n: v\r\n\r\n", 400, "header_line_invalid"),
        refuse("NUL in a value", b"GET / HTTP/1.1\r\nHost: a\r\nX-A: a\x00b\r\n\r\n", 400, "header_value_invalid"),
        refuse("bare CR in a value", b"GET / HTTP/1.1\r\nHost: a\r\nX-A: a\rb\r\n\r\n", 400, "bare_cr"),
        refuse("a bare CR before the empty line", b"GET / HTTP/1.1\r\nHost: a\r\n\r\r\n", 400, "bare_cr"),
        refuse("a header line that starts with a bare CR", b"GET / HTTP/1.1\r\nHost: a\r\n\rX-A: 1\r\n\r\n", 400, "bare_cr"),
        // Framing: the classic smuggling shapes (RFC 9112 §6).
        refuse("CL then TE", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n", 400, "request_smuggling"),
        refuse("TE then CL", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n", 400, "request_smuggling"),
        refuse("two differing lengths", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde", 400, "content_length_invalid"),
        refuse("two equal lengths", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nabcde", 400, "content_length_invalid"),
        refuse("a length list", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\nabcde", 400, "content_length_invalid"),
        refuse("a signed length", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\nabcde", 400, "content_length_invalid"),
        refuse("a hex length", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0x5\r\n\r\nabcde", 400, "content_length_invalid"),
        refuse("a length beyond 64 bits", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n", 400, "content_length_invalid"),
        refuse("a coding other than chunked last", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\nabc", 400, "transfer_encoding_invalid"),
        refuse("chunked not last", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n", 400, "transfer_encoding_invalid"),
        refuse("chunked twice", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "transfer_encoding_invalid"),
        refuse("an unknown coding before chunked", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501, "transfer_coding_unsupported"),
        refuse("a look-alike coding", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", 400, "transfer_encoding_invalid"),
        refuse("Transfer-Encoding in HTTP/1.0", b"POST / HTTP/1.0\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "transfer_encoding_invalid"),
        // Chunk-size edge cases (the first chunk, checked before the head leaves).
        refuse("a negative chunk size", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nx\r\n0\r\n\r\n", 400, "chunk_size_invalid"),
        refuse("a 0x chunk size", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n", 400, "chunk_size_invalid"),
        refuse("a space before the chunk size", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n 5\r\nhello\r\n0\r\n\r\n", 400, "chunk_size_invalid"),
        refuse("a chunk size beyond 64 bits", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n10000000000000000\r\nhello\r\n0\r\n\r\n", 400, "chunk_size_invalid"),
        refuse("a bare LF after the chunk size", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n", 400, "chunk_size_invalid"),
        refuse("an empty chunk size", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n\r\nhello\r\n0\r\n\r\n", 400, "chunk_size_invalid"),
        // Upgrade.
        refuse("an upgrade to another protocol", b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: foo/2\r\n\r\n", 400, "upgrade_unsupported"),
        refuse("an upgrade to HTTP/2.0 by name", b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: HTTP/2.0\r\n\r\n", 400, "upgrade_unsupported"),
        refuse("WebSocket and h2c on two Upgrade lines", b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nUpgrade: h2c\r\n\r\n", 400, "upgrade_unsupported"),
        refuse("WebSocket on POST", b"POST / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nContent-Length: 0\r\n\r\n", 400, "upgrade_unsupported"),
        // Connection options that would drop a routing or framing field.
        refuse("Connection names Content-Length (its body is a request)", b"POST / HTTP/1.1\r\nHost: a\r\nConnection: content-length\r\nContent-Length: 35\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n", 400, "connection_option_invalid"),
        refuse("Connection names Transfer-Encoding", b"POST / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, Transfer-Encoding\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "connection_option_invalid"),
        refuse("Connection names Host", b"GET / HTTP/1.1\r\nHost: a\r\nConnection: host\r\n\r\n", 400, "connection_option_invalid"),
        // Pipelined: the good request passes, the bad one is refused, what
        // follows it is never parsed.
        Vector {
            name: "pipelined behind a good request",
            bytes: b"GET /first HTTP/1.1\r\nHost: a\r\n\r\nPOST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
            statuses: vec![200, 400],
            refused: Some("request_smuggling"),
            forwarded: vec!["GET /first HTTP/1.1\nhost: a"],
        },
        Vector {
            name: "a duplicate Host pipelined behind a good request",
            bytes: b"GET /first HTTP/1.1\r\nHost: a\r\n\r\nGET /second HTTP/1.1\r\nHost: a\r\nHost: evil\r\n\r\n",
            statuses: vec![200, 400],
            refused: Some("host_duplicate"),
            forwarded: vec!["GET /first HTTP/1.1\nhost: a"],
        },
    ]
}

const SENTINEL: &[u8] = b"GET /sentinel HTTP/1.1\r\nHost: s\r\n\r\n";
const SENTINEL_SEEN: &str = "GET /sentinel HTTP/1.1\nhost: s";

/// Which HTTP/1 path the requests take.
#[derive(Debug, Clone, Copy)]
enum Path {
    /// The fast path, for every request it takes.
    Fast,
    /// The fast path validates each head, then declines it at the route (a
    /// header-matching route on the listener, which the fast path leaves to
    /// hyper) and hands it to hyper: the seam between the two paths.
    FastDeclined,
    /// `runtime.h1_fast_path: false`: hyper only.
    Hyper,
}

async fn sidecar(path: Path, upstream: SocketAddr) -> Running {
    let (fast_path, header_route) = match path {
        Path::Fast => (true, ""),
        // Never matches (no request of the corpus has the header).
        Path::FastDeclined => (
            true,
            "{name: by-header, match: {headers: [{name: x-never, exact: 'yes'}]}, backends: [{cluster: a}]}, ",
        ),
        Path::Hyper => (false, ""),
    };
    // Trace context off: the corpus pins the forwarded heads byte for
    // byte, and the sidecar's own `traceparent` would be in every one.
    let text = format!(
        "runtime: {{h1_fast_path: {fast_path}, trace_context: false}}\nlisteners: [{{name: out, address: '127.0.0.1:0'}}]\nclusters: [{{name: a, endpoints: ['{upstream}']}}]\nroutes: [{header_route}{{name: r, backends: [{{cluster: a}}]}}]"
    );
    let mut snap = yaml::parse(&text).unwrap();
    snap.admin.address = "127.0.0.1:0".parse().unwrap();
    start(snap, StartOptions::default()).await.unwrap()
}

/// Send `bytes` on a new connection; read `want` responses (or until the
/// sidecar closes). Returns the responses and whether the connection was
/// closed after them.
async fn exchange(
    addr: SocketAddr,
    bytes: &[u8],
    want: usize,
) -> (Vec<(u16, Option<String>, bool)>, bool) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let mut closed = false;
    loop {
        while let Some((status, reason, close, len)) = parse_response(&buf) {
            buf.drain(..len);
            out.push((status, reason, close));
        }
        if closed || (out.len() == want && out.last().is_some_and(|r| !r.2)) {
            break;
        }
        let mut chunk = [0u8; 4096];
        match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed = true,
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => break,
        }
    }
    assert!(
        buf.is_empty(),
        "trailing bytes after the responses: {:?}",
        String::from_utf8_lossy(&buf)
    );
    (out, closed)
}

async fn run_corpus(which: Path) {
    let up = recorder().await;
    let sc = sidecar(which, up.addr).await;
    let addr = sc.addr("out").unwrap();
    let path = format!("{which:?} path");
    let mut refusals: std::collections::BTreeMap<&str, usize> = Default::default();
    // Every vector runs; the failures are listed together.
    let mut failures = Vec::new();
    let corpus = corpus();
    for v in &corpus {
        let mut fail = |what: String| failures.push(format!("{path}: {}: {what}", v.name));
        let (responses, closed) = exchange(addr, v.bytes, v.statuses.len()).await;
        let statuses: Vec<u16> = responses.iter().map(|r| r.0).collect();
        if statuses != v.statuses {
            fail(format!("statuses {statuses:?}, expected {:?}", v.statuses));
        }
        if let Some(reason) = v.refused {
            match responses.last() {
                Some((_, got, close)) => {
                    if got.as_deref() != Some(reason) {
                        fail(format!("reason {got:?}, expected {reason}"));
                    }
                    if !close {
                        fail("the refusal does not say Connection: close".into());
                    }
                }
                None => fail("no answer".into()),
            }
            if !closed {
                fail("the connection stays open after a refusal".into());
            }
            *refusals.entry(reason).or_default() += 1;
        }
        // The sentinel comes after everything the vector could have sent.
        let (sentinel, _) = exchange(addr, SENTINEL, 1).await;
        if sentinel.first().map(|r| r.0) != Some(200) {
            fail(format!("sentinel answered {sentinel:?}"));
        }
        let seen = up.take();
        let mut expected: Vec<String> = v
            .forwarded
            .iter()
            .map(|f| f.replace("{UP}", &up.addr.to_string()))
            .collect();
        expected.push(SENTINEL_SEEN.to_owned());
        let got: Vec<&str> = seen.requests.iter().map(|(t, _)| t.as_str()).collect();
        if got != expected {
            fail(format!("the upstream got {got:?}, expected {expected:?}"));
        }
        let accounted: usize = seen.requests.iter().map(|(_, n)| n).sum();
        if seen.raw != accounted {
            fail(format!(
                "the upstream got {} bytes that are not part of an expected request",
                seen.raw - accounted.min(seen.raw)
            ));
        }
    }
    let failed: std::collections::BTreeSet<&str> = failures
        .iter()
        .filter_map(|f| f.split(": ").nth(1))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} vectors failed:\n{}",
        failed.len(),
        corpus.len(),
        failures.join("\n")
    );
    // Counted by reason, once per refusal.
    let m = admin_metrics(&sc).await;
    for (reason, n) in refusals {
        let line = format!("baton_sidecar_http1_request_refusals_total{{reason=\"{reason}\"}} {n}");
        assert!(m.contains(&line), "{path}: {line}\n{m}");
    }
    // The setup took the path it names: the fast path served requests, or
    // validated heads and handed them over at the route, or was off.
    let counter = |name: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let served = counter("baton_sidecar_h1_fast_path_requests_total ");
    let declined = counter("baton_sidecar_h1_fast_path_fallbacks_total{reason=\"route\"} ");
    match which {
        Path::Fast => assert!(served > 0 && declined == 0, "{path}: {served} {declined}"),
        Path::FastDeclined => assert!(served == 0 && declined > 0, "{path}: {served} {declined}"),
        Path::Hyper => assert!(served == 0 && declined == 0, "{path}: {served} {declined}"),
    }
    sc.stop().await;
}

/// The admin `/metrics` text.
async fn admin_metrics(sc: &Running) -> String {
    let mut s = TcpStream::connect(sc.admin_addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_corpus_is_refused_or_forwarded_exactly_on_the_fast_path() {
    run_corpus(Path::Fast).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_corpus_is_refused_or_forwarded_exactly_when_the_fast_path_declines_the_route() {
    run_corpus(Path::FastDeclined).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_corpus_is_refused_or_forwarded_exactly_on_the_hyper_path() {
    run_corpus(Path::Hyper).await;
}

/// A malformed chunk after the first one is found while the request
/// streams (its head has left): the upstream request is aborted, so the
/// upstream never gets a complete request, and nothing after the bad chunk
/// is parsed as a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_later_chunk_aborts_the_upstream_request_on_both_paths() {
    for path in [Path::Fast, Path::Hyper] {
        let fast_path = matches!(path, Path::Fast);
        let up = recorder().await;
        let sc = sidecar(path, up.addr).await;
        let addr = sc.addr("out").unwrap();
        let (responses, closed) = exchange(
            addr,
            b"POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
            usize::MAX,
        )
        .await;
        assert!(
            closed,
            "fast path {fast_path}: the connection ends: {responses:?}"
        );
        assert!(
            responses.iter().all(|r| r.0 >= 400),
            "fast path {fast_path}: no success for a malformed body: {responses:?}"
        );
        let (sentinel, _) = exchange(addr, SENTINEL, 1).await;
        assert_eq!(sentinel[0].0, 200);
        let seen = up.take();
        let got: Vec<&str> = seen.requests.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(
            got,
            [SENTINEL_SEEN],
            "fast path {fast_path}: only the sentinel is complete"
        );
        sc.stop().await;
    }
}
