//! Mesh TLS or the application's own TLS, told apart by the ClientHello.
//!
//! Under a Permissive policy an inbound port carries three kinds of traffic:
//! plaintext, mesh mTLS from another sidecar, and TLS a client outside the
//! mesh speaks to the application itself (HTTPS straight to the app). The
//! first bytes (`0x16 0x03`) only tell TLS from plaintext; answering every
//! ClientHello with the mesh certificate breaks the third kind. So the
//! originating sidecar marks its ClientHello with the server name
//! [`MESH_SERVER_NAME`] (SNI; `.invalid` is reserved by RFC 6761, so no
//! application's own TLS can carry it), and the terminating side reads the
//! whole ClientHello before it decides (decision 0026).
//!
//! [`classify`] is pure: it looks at the first TLS record only, at most
//! [`MAX_HELLO_BYTES`] (one record of 2^14 bytes and its header). A
//! ClientHello split over several records, or a record that claims more, is
//! never mesh TLS (a Baton sidecar's ClientHello is a few hundred bytes): the
//! caller passes it through (Permissive) or refuses it (Strict).
//! [`peek_client_hello`] is the one I/O step: it peeks (never consumes) until
//! [`classify`] decides or the detection timeout fires, so whatever is
//! chosen next (terminate, pass through, refuse) sees every byte.

use std::time::Duration;

use tokio::net::TcpStream;

/// The server name every originating sidecar sends (SNI): the mark of mesh
/// TLS. Peers are verified by SPIFFE identity, never by this name.
pub const MESH_SERVER_NAME: &str = "mesh.baton.invalid";

const RECORD_HEADER: usize = 5;
/// Largest TLSPlaintext fragment (RFC 8446 §5.1, RFC 5246 §6.2.1).
const MAX_FRAGMENT: usize = 1 << 14;
/// Most bytes [`classify`] ever asks for: one full record.
pub const MAX_HELLO_BYTES: usize = RECORD_HEADER + MAX_FRAGMENT;

const CONTENT_HANDSHAKE: u8 = 0x16;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
const NAME_TYPE_HOST: u8 = 0;

/// What the first bytes of a connection are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hello {
    /// Not a TLS handshake record: plaintext of some protocol.
    NotTls,
    /// Undecided until at least this many bytes (in total) are there;
    /// never more than [`MAX_HELLO_BYTES`].
    NeedMore(usize),
    /// A ClientHello with the mesh marker: terminate mesh mTLS.
    Mesh,
    /// TLS that is not mesh TLS.
    App(AppTls),
}

/// Why TLS was judged not to be mesh TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppTls {
    /// A complete ClientHello without the marker (no SNI, or another name).
    NoMarker,
    /// The ClientHello continues past its first record.
    Fragmented,
    /// The first record claims more than 2^14 bytes.
    Oversized,
    /// The first record is not a well-formed ClientHello.
    Malformed,
    /// The first record did not arrive within the detection timeout.
    Incomplete,
}

impl AppTls {
    /// Bounded label for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            AppTls::NoMarker => "no_mesh_marker",
            AppTls::Fragmented => "fragmented_client_hello",
            AppTls::Oversized => "oversized_record",
            AppTls::Malformed => "malformed_client_hello",
            AppTls::Incomplete => "incomplete_client_hello",
        }
    }
}

/// Classifies `buf`, the first bytes of a connection (pure).
pub fn classify(buf: &[u8]) -> Hello {
    match buf {
        [] | [CONTENT_HANDSHAKE] => return Hello::NeedMore(2),
        [CONTENT_HANDSHAKE, 3, ..] => {}
        _ => return Hello::NotTls,
    }
    if buf.len() < RECORD_HEADER {
        return Hello::NeedMore(RECORD_HEADER);
    }
    let len = usize::from(u16::from_be_bytes([buf[3], buf[4]]));
    if len > MAX_FRAGMENT {
        return Hello::App(AppTls::Oversized);
    }
    let end = RECORD_HEADER + len;
    if buf.len() < end {
        return Hello::NeedMore(end);
    }
    match client_hello_names_mesh(&buf[RECORD_HEADER..end]) {
        Ok(true) => Hello::Mesh,
        Ok(false) => Hello::App(AppTls::NoMarker),
        Err(why) => Hello::App(why),
    }
}

/// Big-endian reader over a byte slice; `None` = ran past the end.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn u24(&mut self) -> Option<usize> {
        self.take(3)
            .map(|b| (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]))
    }
    /// An opaque vector with a one-byte length.
    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()?;
        self.take(usize::from(n))
    }
    /// An opaque vector with a two-byte length.
    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.take(usize::from(n))
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Whether the handshake fragment (one record's body) is a ClientHello
/// whose server_name extension lists [`MESH_SERVER_NAME`] (RFC 8446 §4.1.2,
/// RFC 6066 §3; TLS 1.2's layout is the same up to the extensions).
fn client_hello_names_mesh(fragment: &[u8]) -> Result<bool, AppTls> {
    let mut r = Reader(fragment);
    if r.u8() != Some(HANDSHAKE_CLIENT_HELLO) {
        return Err(AppTls::Malformed);
    }
    let len = r.u24().ok_or(AppTls::Malformed)?;
    // The message goes on in the next record: not ours to reassemble.
    let body = r.take(len).ok_or(AppTls::Fragmented)?;
    let mut r = Reader(body);
    let malformed = |_| AppTls::Malformed;
    let fields = (|| {
        r.take(2)?; // legacy_version
        r.take(32)?; // random
        let session_id = r.vec8()?;
        let suites = r.vec16()?;
        let compression = r.vec8()?;
        Some(session_id.len() <= 32 && !suites.is_empty() && !compression.is_empty())
    })();
    match fields {
        Some(true) => {}
        _ => return Err(AppTls::Malformed),
    }
    // A ClientHello without extensions is legal (TLS 1.2): no SNI.
    if r.is_empty() {
        return Ok(false);
    }
    let extensions = r.vec16().ok_or(AppTls::Malformed)?;
    if !r.is_empty() {
        return Err(AppTls::Malformed);
    }
    let mut exts = Reader(extensions);
    let mut mesh = false;
    while !exts.is_empty() {
        let kind = exts.u16().ok_or(AppTls::Malformed)?;
        let data = exts.vec16().ok_or(AppTls::Malformed)?;
        if kind == EXT_SERVER_NAME {
            mesh |= names_mesh(data).map_err(malformed)?;
        }
    }
    Ok(mesh)
}

/// Whether a server_name extension's body lists the mesh name.
fn names_mesh(data: &[u8]) -> Result<bool, ()> {
    let mut r = Reader(data);
    let list = r.vec16().ok_or(())?;
    if !r.is_empty() {
        return Err(());
    }
    let mut names = Reader(list);
    let mut mesh = false;
    while !names.is_empty() {
        let kind = names.u8().ok_or(())?;
        let name = names.vec16().ok_or(())?;
        mesh |= kind == NAME_TYPE_HOST && name.eq_ignore_ascii_case(MESH_SERVER_NAME.as_bytes());
    }
    Ok(mesh)
}

/// Peeks at `tcp` (never consumes) until [`classify`] decides or `limit`
/// passes. `None`: nothing decidable arrived in time (a silent client, or a
/// lone `0x16`), which callers treat like plaintext detection's timeout. A
/// TLS record still incomplete at the deadline is [`AppTls::Incomplete`].
pub async fn peek_client_hello(tcp: &TcpStream, limit: Duration) -> std::io::Result<Option<Hello>> {
    let deadline = tokio::time::Instant::now() + limit;
    let at_deadline = |seen: &[u8]| match classify(seen) {
        Hello::NeedMore(_) if seen.len() >= 2 => Some(Hello::App(AppTls::Incomplete)),
        Hello::NeedMore(_) => None,
        decided => Some(decided),
    };
    let mut buf = vec![0u8; RECORD_HEADER];
    let mut seen = 0;
    loop {
        let n = match tokio::time::timeout_at(deadline, tcp.peek(&mut buf)).await {
            Err(_) => return Ok(at_deadline(&buf[..seen])),
            Ok(r) => r?,
        };
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        seen = n;
        match classify(&buf[..n]) {
            // The header told the record's length: peek that much at once.
            Hello::NeedMore(want) if want > buf.len() => buf.resize(want, 0),
            // The rest is in flight. Peek returns at once while any byte is
            // queued, so wait a moment instead of spinning.
            Hello::NeedMore(_) => {
                if tokio::time::Instant::now() >= deadline {
                    return Ok(at_deadline(&buf[..seen]));
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            decided => return Ok(Some(decided)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// The first flight of a real rustls client for `name`.
    fn rustls_hello(
        name: &str,
        sni: bool,
        alpn: &[&[u8]],
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> Vec<u8> {
        let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(versions)
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
        cfg.enable_sni = sni;
        cfg.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
        let name = rustls_pki_types::ServerName::try_from(name.to_owned()).unwrap();
        let mut conn = rustls::ClientConnection::new(Arc::new(cfg), name).unwrap();
        let mut out = Vec::new();
        while conn.wants_write() {
            conn.write_tls(&mut out).unwrap();
        }
        out
    }

    fn mesh_hello() -> Vec<u8> {
        rustls_hello(
            MESH_SERVER_NAME,
            true,
            &[b"h2", b"http/1.1"],
            rustls::DEFAULT_VERSIONS,
        )
    }

    /// A minimal ClientHello record with `extensions` (type, body).
    fn synthetic(extensions: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend([7u8; 32]);
        body.push(0); // session id
        body.extend([0, 2, 0x13, 0x01]); // one suite
        body.extend([1, 0]); // null compression
        let mut exts = Vec::new();
        for (kind, data) in extensions {
            exts.extend(kind.to_be_bytes());
            exts.extend((data.len() as u16).to_be_bytes());
            exts.extend(data);
        }
        body.extend((exts.len() as u16).to_be_bytes());
        body.extend(exts);
        record(&handshake(&body))
    }

    fn handshake(body: &[u8]) -> Vec<u8> {
        let mut m = vec![HANDSHAKE_CLIENT_HELLO];
        m.extend(&(body.len() as u32).to_be_bytes()[1..]);
        m.extend(body);
        m
    }

    fn record(fragment: &[u8]) -> Vec<u8> {
        let mut r = vec![CONTENT_HANDSHAKE, 3, 1];
        r.extend((fragment.len() as u16).to_be_bytes());
        r.extend(fragment);
        r
    }

    /// A server_name extension body listing `names` (type, name).
    fn sni(names: &[(u8, &[u8])]) -> Vec<u8> {
        let mut list = Vec::new();
        for (kind, name) in names {
            list.push(*kind);
            list.extend((name.len() as u16).to_be_bytes());
            list.extend(*name);
        }
        let mut out = (list.len() as u16).to_be_bytes().to_vec();
        out.extend(list);
        out
    }

    #[test]
    fn a_rustls_client_hello_naming_the_mesh_is_mesh_tls() {
        assert_eq!(classify(&mesh_hello()), Hello::Mesh);
        let tls12: &[&'static rustls::SupportedProtocolVersion] = &[&rustls::version::TLS12];
        let tls13: &[&'static rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
        let alpns: [&[&[u8]]; 3] = [&[], &[b"h2"], &[b"http/1.1"]];
        for versions in [tls12, tls13] {
            for alpn in alpns {
                let h = rustls_hello(MESH_SERVER_NAME, true, alpn, versions);
                assert_eq!(classify(&h), Hello::Mesh, "{versions:?} {alpn:?}");
            }
        }
    }

    #[test]
    fn a_rustls_client_hello_without_the_marker_is_the_applications_tls() {
        let cases = [
            rustls_hello("app.example", true, &[b"h2"], rustls::DEFAULT_VERSIONS),
            // The mesh name without SNI (what sidecars sent before 0026).
            rustls_hello(MESH_SERVER_NAME, false, &[], rustls::DEFAULT_VERSIONS),
            // An IP address: rustls sends no SNI at all.
            rustls_hello("127.0.0.1", true, &[], rustls::DEFAULT_VERSIONS),
            rustls_hello(
                "mesh.baton.invalid.example",
                true,
                &[],
                &[&rustls::version::TLS12],
            ),
        ];
        for h in cases {
            assert_eq!(classify(&h), Hello::App(AppTls::NoMarker));
        }
    }

    #[test]
    fn every_prefix_of_a_client_hello_asks_for_exactly_what_is_missing() {
        let h = mesh_hello();
        assert!(h.len() < MAX_HELLO_BYTES);
        for n in 0..h.len() {
            let want = match n {
                0 | 1 => 2,
                2..=4 => RECORD_HEADER,
                _ => h.len(),
            };
            assert_eq!(classify(&h[..n]), Hello::NeedMore(want), "prefix {n}");
        }
        // Bytes past the record (the next flight) change nothing.
        let mut more = h.clone();
        more.extend(b"\x14\x03\x03\x00\x01\x01");
        assert_eq!(classify(&more), Hello::Mesh);
    }

    #[test]
    fn a_client_hello_split_over_two_records_is_not_mesh_tls() {
        let h = mesh_hello();
        let fragment = &h[RECORD_HEADER..];
        let (a, b) = fragment.split_at(fragment.len() / 2);
        let mut split = record(a);
        split.extend(record(b));
        assert_eq!(classify(&split), Hello::App(AppTls::Fragmented));
        // Even when the first record holds only the handshake header.
        assert_eq!(
            classify(&record(&fragment[..4])),
            Hello::App(AppTls::Fragmented)
        );
    }

    #[test]
    fn a_record_larger_than_two_to_the_fourteen_is_not_mesh_tls_and_not_waited_for() {
        let mut h = vec![CONTENT_HANDSHAKE, 3, 3];
        h.extend(((MAX_FRAGMENT + 1) as u16).to_be_bytes());
        assert_eq!(classify(&h), Hello::App(AppTls::Oversized));
        // Exactly 2^14 is waited for and parsed.
        let marker = (EXT_SERVER_NAME, sni(&[(0, MESH_SERVER_NAME.as_bytes())]));
        let pad = MAX_HELLO_BYTES - synthetic(&[marker.clone(), (21, vec![])]).len();
        let full = synthetic(&[marker, (21, vec![0; pad])]);
        assert_eq!(full.len(), MAX_HELLO_BYTES);
        assert_eq!(classify(&full[..100]), Hello::NeedMore(MAX_HELLO_BYTES));
        assert_eq!(classify(&full), Hello::Mesh);
    }

    #[test]
    fn plaintext_first_bytes_are_not_tls() {
        let cases: [&[u8]; 7] = [
            b"GET / HTTP/1.1\r\n",
            b"PRI * HTTP/2.0",
            &[0x16, 0x01],
            &[0x16, 0x02, 0x00],
            &[0x17, 0x03, 0x03],
            &[0x00],
            &[0x80, 0x2e, 0x01], // SSLv2-style hello
        ];
        for p in cases {
            assert_eq!(classify(p), Hello::NotTls, "{p:?}");
        }
    }

    #[test]
    fn server_name_lists_are_read_entry_by_entry() {
        let mesh = MESH_SERVER_NAME.as_bytes();
        let ext = |names: &[(u8, &[u8])]| classify(&synthetic(&[(EXT_SERVER_NAME, sni(names))]));
        assert_eq!(ext(&[(0, mesh)]), Hello::Mesh);
        assert_eq!(ext(&[(0, &b"MESH.Baton.Invalid"[..])]), Hello::Mesh);
        assert_eq!(ext(&[(0, &b"other"[..]), (0, mesh)]), Hello::Mesh);
        // Only the host_name type counts.
        assert_eq!(ext(&[(1, mesh)]), Hello::App(AppTls::NoMarker));
        assert_eq!(ext(&[]), Hello::App(AppTls::NoMarker));
        assert_eq!(
            ext(&[(0, &b"mesh.baton.invali"[..])]),
            Hello::App(AppTls::NoMarker)
        );
        // Other extensions around it are skipped.
        let h = synthetic(&[
            (10, vec![0, 2, 0, 29]),
            (EXT_SERVER_NAME, sni(&[(0, mesh)])),
            (16, vec![0, 3, 2, b'h', b'2']),
        ]);
        assert_eq!(classify(&h), Hello::Mesh);
        // No extensions at all (legal in TLS 1.2).
        let mut body = vec![3, 3];
        body.extend([7u8; 32]);
        body.extend([0, 0, 2, 0x13, 0x01, 1, 0]);
        assert_eq!(
            classify(&record(&handshake(&body))),
            Hello::App(AppTls::NoMarker)
        );
    }

    #[test]
    fn malformed_client_hellos_are_not_mesh_tls() {
        let good = synthetic(&[(EXT_SERVER_NAME, sni(&[(0, MESH_SERVER_NAME.as_bytes())]))]);
        let fragment = &good[RECORD_HEADER..];
        let bad = |f: &[u8]| classify(&record(f));
        // A ServerHello, an empty record, a handshake header only.
        let mut server_hello = fragment.to_vec();
        server_hello[0] = 2;
        assert_eq!(bad(&server_hello), Hello::App(AppTls::Malformed));
        assert_eq!(bad(&[]), Hello::App(AppTls::Malformed));
        // Trailing bytes after the extensions.
        let mut body = fragment[4..].to_vec();
        body.push(0);
        assert_eq!(bad(&handshake(&body)), Hello::App(AppTls::Malformed));
        // Every truncation of the body (lengths fixed up to match) is
        // malformed, never mesh and never a panic.
        let body = &fragment[4..];
        for n in 0..body.len() {
            let h = bad(&handshake(&body[..n]));
            assert!(
                matches!(h, Hello::App(AppTls::Malformed | AppTls::NoMarker)),
                "{n}: {h:?}"
            );
        }
        // A session id longer than 32 bytes.
        let mut long_sid = vec![3, 3];
        long_sid.extend([0u8; 32]);
        long_sid.push(33);
        long_sid.extend([0u8; 33]);
        long_sid.extend([0, 2, 0x13, 0x01, 1, 0]);
        assert_eq!(bad(&handshake(&long_sid)), Hello::App(AppTls::Malformed));
        // An SNI extension whose list length disagrees with its body.
        let mut broken = sni(&[(0, MESH_SERVER_NAME.as_bytes())]);
        broken[1] += 1;
        assert_eq!(
            classify(&synthetic(&[(EXT_SERVER_NAME, broken)])),
            Hello::App(AppTls::Malformed)
        );
    }

    #[test]
    fn garbage_after_a_handshake_header_never_panics_or_reads_as_mesh() {
        // Deterministic pseudo-random bodies under a valid record header.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for len in 0..600usize {
            let mut body = Vec::with_capacity(len);
            for _ in 0..len {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                body.push(x as u8);
            }
            let mut h = vec![CONTENT_HANDSHAKE, 3, 3];
            h.extend((len as u16).to_be_bytes());
            h.extend(&body);
            assert!(matches!(classify(&h), Hello::App(_)), "{len}");
        }
    }

    #[tokio::test]
    async fn peeking_leaves_every_byte_in_the_socket() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        let h = mesh_hello();
        // The hello arrives in two writes: the peek waits for the rest.
        client.write_all(&h[..10]).await.unwrap();
        let writer = {
            let rest = h[10..].to_vec();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                client.write_all(&rest).await.unwrap();
                client
            })
        };
        let got = peek_client_hello(&server, Duration::from_secs(10)).await;
        assert_eq!(got.unwrap(), Some(Hello::Mesh));
        let _client = writer.await.unwrap();
        let mut all = vec![0u8; h.len()];
        let mut server = server;
        server.read_exact(&mut all).await.unwrap();
        assert_eq!(all, h);
    }

    #[tokio::test]
    async fn a_silent_client_or_an_unfinished_record_decides_at_the_deadline() {
        use tokio::io::AsyncWriteExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut silent = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        let limit = Duration::from_millis(50);
        assert_eq!(peek_client_hello(&server, limit).await.unwrap(), None);
        silent.write_all(&[CONTENT_HANDSHAKE]).await.unwrap();
        assert_eq!(peek_client_hello(&server, limit).await.unwrap(), None);
        silent.write_all(&mesh_hello()[1..20]).await.unwrap();
        assert_eq!(
            peek_client_hello(&server, limit).await.unwrap(),
            Some(Hello::App(AppTls::Incomplete))
        );
        drop(silent);
        let mut closed = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        closed.shutdown().await.unwrap();
        assert!(peek_client_hello(&server, limit).await.is_err());
    }
}
