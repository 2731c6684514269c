//! A connection in transit: stopped at a safe point ([`Resumable`]), taken
//! apart into sockets plus TLS record state, written into a
//! `Connection` frame ([`push_connection`]) and read back from one
//! ([`Resumable::from_frame`]) — or served again in this process
//! ([`spawn_resumed`]).

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;

use baton_tls_record::{AeadKind, TLS12, TLS13, TlsRecordStream, TlsWireState};

use crate::conn::{BoxIo, ConnMeta, Detached, Parked, ParkedAt, ParkedIo, SessionDetach};
use crate::plane::{Resumed, Serving};
use crate::protocol::{Batch, ConnKind as WireKind, ConnectionHeader, Message, ProtocolError};

/// Serializable [`ConnMeta`] (ids are per process and not carried).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct MetaWire {
    listener: String,
    peer: SocketAddr,
    local: SocketAddr,
    #[serde(default)]
    original_dst: Option<SocketAddr>,
    #[serde(default)]
    peer_identity: Option<String>,
    #[serde(default)]
    alpn: Option<Vec<u8>>,
    #[serde(default)]
    tls: bool,
}

impl MetaWire {
    fn from_meta(m: &ConnMeta) -> Self {
        Self {
            listener: m.listener.to_string(),
            peer: m.peer,
            local: m.local,
            original_dst: m.original_dst,
            peer_identity: m.peer_identity.clone(),
            alpn: m.alpn.clone(),
            tls: m.tls,
        }
    }

    fn into_meta(self, id: u64) -> ConnMeta {
        ConnMeta {
            id,
            listener: Arc::from(self.listener),
            peer: self.peer,
            local: self.local,
            original_dst: self.original_dst,
            peer_identity: self.peer_identity,
            alpn: self.alpn,
            tls: self.tls,
        }
    }
}

/// One end (downstream or upstream) of a connection being resumed.
enum End {
    /// A socket; with the record-layer state (and the ciphertext received
    /// but not yet decrypted) when a TLS session continues on it.
    Raw(TcpStream, Option<Box<(TlsWireState, Vec<u8>)>>),
    /// A session another layer boxed (TLS), taken apart only through
    /// [`SessionDetach`].
    Boxed(BoxIo),
}

impl End {
    fn from_parked(io: ParkedIo) -> Self {
        match io {
            ParkedIo::Tcp(t) => End::Raw(t, None),
            ParkedIo::Boxed(b) => End::Boxed(b),
        }
    }

    /// Stops a TLS session at a record boundary and turns it into a socket
    /// plus record state; also returns the plaintext decrypted but not yet
    /// read. `Err` gives the end back when it cannot move (not at a record
    /// boundary, or no layer to take it apart); `Ok(None)` means the session
    /// turned out to be broken.
    async fn extract(
        self,
        conn: u64,
        sessions: Option<&dyn SessionDetach>,
    ) -> Result<Option<(Self, Vec<u8>)>, Self> {
        let b = match self {
            End::Raw(..) => return Ok(Some((self, Vec::new()))),
            End::Boxed(b) => b,
        };
        let Some(sessions) = sessions else {
            return Err(End::Boxed(b));
        };
        match sessions.detach(b, conn).await {
            Detached::Moved {
                tcp,
                state,
                ciphertext,
                plaintext,
            } => Ok(Some((
                End::Raw(tcp, Some(Box::new((*state, ciphertext)))),
                plaintext,
            ))),
            Detached::Stays(b) => Err(End::Boxed(b)),
            Detached::Broken => Ok(None),
        }
    }

    /// The stream to serve this end with in this process: a socket with TLS
    /// state continues on our record layer.
    fn into_io(self, conn: u64) -> Option<ParkedIo> {
        Some(match self {
            End::Raw(tcp, None) => ParkedIo::Tcp(tcp),
            End::Raw(tcp, Some(sealed)) => {
                let (state, ciphertext) = *sealed;
                match TlsRecordStream::new(tcp, &state, ciphertext, Vec::new()) {
                    Ok(s) => ParkedIo::Boxed(Box::new(s)),
                    Err(e) => {
                        tracing::error!(conn, error = %e, "cannot resume the TLS record layer; connection closed");
                        return None;
                    }
                }
            }
            End::Boxed(b) => ParkedIo::Boxed(b),
        })
    }
}

/// A connection stopped at a safe point, ready to be resumed (here or, once
/// both ends are raw sockets, in the next process).
pub(crate) struct Resumable {
    meta: ConnMeta,
    kind: WireKind,
    down: End,
    up: Option<End>,
    /// Plaintext read from downstream, not yet consumed (for HTTP/1: the
    /// pipelined bytes hyper read ahead).
    to_upstream: Bytes,
    to_downstream: Bytes,
    /// When its task stopped reading it (on the old process); `None` from a
    /// peer that does not say.
    pub(crate) paused_since: Option<Instant>,
}

impl Resumable {
    pub(crate) fn from_parked(p: ParkedAt) -> Option<Self> {
        let paused_since = Some(p.at);
        match p.parked {
            Parked::Tcp {
                meta,
                downstream,
                upstream,
                to_upstream,
                to_downstream,
            } => Some(Self {
                meta,
                kind: WireKind::Tcp,
                down: End::from_parked(downstream),
                up: Some(End::from_parked(upstream)),
                to_upstream,
                to_downstream,
                paused_since,
            }),
            Parked::Http1 {
                meta,
                downstream,
                unread,
            } => Some(Self {
                meta,
                kind: WireKind::Http1,
                down: End::from_parked(downstream),
                up: None,
                to_upstream: unread,
                to_downstream: Bytes::new(),
                paused_since,
            }),
            // The carried state rides where HTTP/1 has nothing: the
            // downstream-bound part of the blob (see `WireKind::Http2`).
            Parked::Http2 {
                meta,
                downstream,
                unread,
                state,
            } => Some(Self {
                meta,
                kind: WireKind::Http2,
                down: End::from_parked(downstream),
                up: None,
                to_upstream: unread,
                to_downstream: state,
                paused_since,
            }),
            Parked::Draining => None,
        }
    }

    /// Turns both ends into raw sockets plus record state, so the
    /// connection can be sent. `Err` gives the connection back when an end
    /// is not at a record boundary (it then finishes in this process; an
    /// end already extracted continues on our record layer); `Ok(None)`
    /// means the connection turned out to be broken.
    pub(crate) async fn extract_tls(
        mut self,
        sessions: Option<&dyn SessionDetach>,
    ) -> Result<Option<Self>, Self> {
        let id = self.meta.id;
        let down = match self.down.extract(id, sessions).await {
            Ok(Some((end, plain))) => {
                // rustls decrypted these after everything the data plane
                // holds (for HTTP/2 too: `to_downstream` is its state).
                append(&mut self.to_upstream, &plain);
                end
            }
            Ok(None) => return Ok(None),
            Err(end) => {
                self.down = end;
                return Err(self);
            }
        };
        self.down = down;
        if let Some(up) = self.up.take() {
            match up.extract(id, sessions).await {
                Ok(Some((end, plain))) => {
                    append(&mut self.to_downstream, &plain);
                    self.up = Some(end);
                }
                Ok(None) => return Ok(None),
                Err(end) => {
                    self.up = Some(end);
                    return Err(self);
                }
            }
        }
        Ok(Some(self))
    }

    /// Builds a connection received from the previous process.
    pub(crate) fn from_frame(
        h: &ConnectionHeader,
        blob: Vec<u8>,
        fds: Vec<OwnedFd>,
        id: u64,
    ) -> Result<Self, String> {
        let want = match h.kind {
            WireKind::Tcp => 2,
            WireKind::Http1 | WireKind::Http2 => 1,
        };
        if fds.len() != want {
            return Err(format!(
                "{:?} connection needs {want} descriptors, got {}",
                h.kind,
                fds.len()
            ));
        }
        for t in h.tls.iter().chain(h.up_tls.as_deref()) {
            // Check the state now so a bad one is declined, not adopted.
            AeadKind::from_name(&t.aead).map_err(|e| e.to_string())?;
            if t.version != TLS12 && t.version != TLS13 {
                return Err(format!("unsupported TLS version 0x{:04x}", t.version));
            }
        }
        if h.up_tls.is_some() && h.kind != WireKind::Tcp {
            return Err("upstream TLS state on a connection without an upstream".into());
        }
        let lens = [
            h.to_upstream_len,
            h.to_downstream_len,
            h.tls_ciphertext_len,
            h.up_tls_ciphertext_len,
        ];
        if lens.iter().map(|&l| l as usize).sum::<usize>() != blob.len() {
            return Err(format!(
                "blob of {} bytes does not match its parts {lens:?}",
                blob.len()
            ));
        }
        let meta: MetaWire =
            serde_json::from_value(h.meta.clone()).map_err(|e| format!("bad meta: {e}"))?;
        let mut fds = fds.into_iter();
        let tcp = |fd: OwnedFd| -> Result<TcpStream, String> {
            let s = std::net::TcpStream::from(fd);
            s.set_nonblocking(true).map_err(|e| e.to_string())?;
            TcpStream::from_std(s).map_err(|e| e.to_string())
        };
        let down = tcp(fds.next().expect("counted"))?;
        let up = match fds.next() {
            Some(fd) => Some(tcp(fd)?),
            None => None,
        };
        let mut blob = Bytes::from(blob);
        let mut take = |n: u32| blob.split_to(n as usize);
        let to_upstream = take(h.to_upstream_len);
        let to_downstream = take(h.to_downstream_len);
        let down_ct = take(h.tls_ciphertext_len);
        let up_ct = take(h.up_tls_ciphertext_len);
        Ok(Self {
            meta: meta.into_meta(id),
            kind: h.kind,
            down: End::Raw(down, h.tls.clone().map(|t| Box::new((t, down_ct.to_vec())))),
            up: up.map(|u| End::Raw(u, h.up_tls.clone().map(|t| Box::new((*t, up_ct.to_vec()))))),
            to_upstream,
            to_downstream,
            paused_since: monotonic::to_instant(h.parked_at_ns),
        })
    }
}

/// `CLOCK_MONOTONIC`, which both processes of a pod read alike (one kernel,
/// no time namespace), as nanoseconds on the wire: `Instant` is that clock
/// but does not expose it.
mod monotonic {
    use std::time::{Duration, Instant};

    fn now_ns() -> Option<u64> {
        let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).ok()?;
        Some(t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
    }

    /// `t` on the wire; 0 if the clock cannot be read.
    pub(super) fn to_ns(t: Instant) -> u64 {
        now_ns().map_or(0, |now| now.saturating_sub(t.elapsed().as_nanos() as u64))
    }

    /// Back from the wire: `None` for 0 (a peer that did not send it) and for
    /// anything in the future or over a minute old (not the same clock).
    pub(super) fn to_instant(ns: u64) -> Option<Instant> {
        let now = now_ns()?;
        if ns == 0 || ns > now || now - ns > 60_000_000_000 {
            return None;
        }
        Instant::now().checked_sub(Duration::from_nanos(now - ns))
    }
}

fn append(to: &mut Bytes, more: &[u8]) {
    if !more.is_empty() {
        let mut all = to.to_vec();
        all.extend_from_slice(more);
        *to = Bytes::from(all);
    }
}

/// Serve a resumed connection in this process (the data plane registers
/// and counts it). A TLS session whose secrets were extracted continues on
/// our record layer.
pub(crate) fn spawn_resumed(serving: &Arc<dyn Serving>, r: Resumable) {
    // Called on the handoff's thread: the connection belongs to the runtime
    // that serves (its sockets register there, its task runs there).
    let _rt = serving.runtime().enter();
    let Some(down) = r.down.into_io(r.meta.id) else {
        return;
    };
    let up = match r.up.map(|u| u.into_io(r.meta.id)) {
        None => None,
        Some(None) => return,
        Some(Some(io)) => Some(io),
    };
    serving.clone().resume(Resumed {
        kind: r.kind,
        meta: r.meta,
        down,
        up,
        to_upstream: r.to_upstream,
        to_downstream: r.to_downstream,
    });
}

/// Appends connection `id`'s frame to `batch`; its sockets stay open (in
/// `pending`) until the batch is sent and acknowledged.
pub(crate) fn push_connection(
    batch: &mut Batch,
    id: u64,
    r: &Resumable,
) -> Result<(), ProtocolError> {
    let raw = |e: &End| -> (RawFd, Option<TlsWireState>, Vec<u8>) {
        let End::Raw(tcp, tls) = e else {
            unreachable!("only raw sockets are sent (extract_tls ran)")
        };
        match tls.as_deref() {
            Some((state, ct)) => (tcp.as_raw_fd(), Some(state.clone()), ct.clone()),
            None => (tcp.as_raw_fd(), None, Vec::new()),
        }
    };
    let (down_fd, tls, down_ct) = raw(&r.down);
    let mut fds = vec![down_fd];
    let (up_tls, up_ct) = match r.up.as_ref().map(raw) {
        Some((fd, state, ct)) => {
            fds.push(fd);
            (state, ct)
        }
        None => (None, Vec::new()),
    };
    let parts: [&[u8]; 4] = [&r.to_upstream, &r.to_downstream, &down_ct, &up_ct];
    let mut blob = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        blob.extend_from_slice(p);
    }
    let header = ConnectionHeader {
        id,
        kind: r.kind,
        to_upstream_len: r.to_upstream.len() as u32,
        to_downstream_len: r.to_downstream.len() as u32,
        tls_ciphertext_len: down_ct.len() as u32,
        tls,
        up_tls_ciphertext_len: up_ct.len() as u32,
        up_tls: up_tls.map(Box::new),
        meta: serde_json::to_value(MetaWire::from_meta(&r.meta)).unwrap_or_default(),
        parked_at_ns: r.paused_since.map_or(0, monotonic::to_ns),
    };
    batch.push(&Message::Connection(header), &blob, &fds)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn header(kind: WireKind, tls: Option<TlsWireState>) -> ConnectionHeader {
        ConnectionHeader {
            id: 1,
            kind,
            to_upstream_len: 2,
            to_downstream_len: 1,
            tls_ciphertext_len: 0,
            up_tls: None,
            up_tls_ciphertext_len: 0,
            tls,
            meta: serde_json::to_value(MetaWire {
                listener: "outbound".into(),
                peer: "127.0.0.1:1".parse().unwrap(),
                local: "127.0.0.1:2".parse().unwrap(),
                original_dst: None,
                peer_identity: Some("spiffe://td/ns/a/sa/b".into()),
                alpn: None,
                tls: false,
            })
            .unwrap(),
            parked_at_ns: 0,
        }
    }

    #[test]
    fn a_pause_start_survives_the_wire_and_nonsense_is_ignored() {
        let t = Instant::now() - Duration::from_millis(3);
        let back = monotonic::to_instant(monotonic::to_ns(t)).expect("a recent instant");
        // Same clock, read twice: off by the time between two reads, not by
        // a unit or an epoch (the bound is loose so a preempted read passes).
        let off = if back > t { back - t } else { t - back };
        assert!(off < Duration::from_millis(100), "{off:?}");
        assert!(monotonic::to_instant(0).is_none(), "not sent");
        let now = monotonic::to_ns(Instant::now());
        assert!(
            monotonic::to_instant(now + 60_000_000_000).is_none(),
            "future"
        );
        if now > 120_000_000_000 {
            assert!(
                monotonic::to_instant(now - 120_000_000_000).is_none(),
                "stale"
            );
        }
    }

    fn fds(n: usize) -> Vec<OwnedFd> {
        (0..n)
            .map(|_| OwnedFd::from(std::net::TcpListener::bind("127.0.0.1:0").unwrap()))
            .collect()
    }

    #[tokio::test]
    async fn a_connection_with_the_wrong_number_of_descriptors_is_declined() {
        let err = Resumable::from_frame(&header(WireKind::Tcp, None), b"abc".to_vec(), fds(1), 7)
            .err()
            .unwrap();
        assert!(err.contains("needs 2 descriptors"), "{err}");
    }

    #[tokio::test]
    async fn a_tls_connection_with_an_unknown_cipher_or_version_is_declined() {
        let d = baton_tls_record::DirectionSecrets {
            seq: 0,
            key: vec![0; 16],
            iv: vec![0; 12],
            traffic_secret: None,
        };
        let mut t = TlsWireState {
            version: TLS13,
            aead: "rc4".into(),
            tx: d.clone(),
            rx: d,
            server: true,
        };
        let err = Resumable::from_frame(
            &header(WireKind::Http1, Some(t.clone())),
            b"abc".to_vec(),
            fds(1),
            7,
        )
        .err()
        .unwrap();
        assert!(err.contains("rc4"), "{err}");
        t.aead = "aes_128_gcm".into();
        t.version = 0x0301;
        assert!(
            Resumable::from_frame(
                &header(WireKind::Http1, Some(t)),
                b"abc".to_vec(),
                fds(1),
                7
            )
            .is_err()
        );
    }

    #[tokio::test]
    async fn a_received_connection_keeps_its_metadata_and_splits_its_bytes() {
        let r = Resumable::from_frame(&header(WireKind::Tcp, None), b"upd".to_vec(), fds(2), 9)
            .ok()
            .unwrap();
        assert_eq!((r.meta.id, &*r.meta.listener), (9, "outbound"));
        assert_eq!(
            r.meta.peer_identity.as_deref(),
            Some("spiffe://td/ns/a/sa/b")
        );
        assert_eq!(
            (&r.to_upstream[..], &r.to_downstream[..]),
            (&b"up"[..], &b"d"[..])
        );
        assert!(matches!(r.down, End::Raw(_, None)));
        assert!(matches!(r.up, Some(End::Raw(_, None))));
    }

    fn secrets() -> TlsWireState {
        let d = baton_tls_record::DirectionSecrets {
            seq: 3,
            key: vec![1; 16],
            iv: vec![2; 12],
            traffic_secret: None,
        };
        TlsWireState {
            version: TLS13,
            aead: "aes_128_gcm".into(),
            tx: d.clone(),
            rx: d,
            server: false,
        }
    }

    #[tokio::test]
    async fn an_upstream_tls_session_gets_its_state_and_the_last_part_of_the_blob() {
        let mut h = header(
            WireKind::Tcp,
            Some(TlsWireState {
                server: true,
                ..secrets()
            }),
        );
        h.tls_ciphertext_len = 2;
        h.up_tls = Some(Box::new(secrets()));
        h.up_tls_ciphertext_len = 3;
        let r = Resumable::from_frame(&h, b"updDDuuu".to_vec(), fds(2), 9)
            .ok()
            .unwrap();
        assert_eq!(
            (&r.to_upstream[..], &r.to_downstream[..]),
            (&b"up"[..], &b"d"[..])
        );
        let End::Raw(_, Some(sealed)) = &r.down else {
            panic!("downstream TLS state")
        };
        let (down, down_ct) = &**sealed;
        assert!(down.server && down_ct == b"DD");
        let Some(End::Raw(_, Some(sealed))) = &r.up else {
            panic!("upstream TLS state")
        };
        let (up, up_ct) = &**sealed;
        assert!(!up.server && up_ct == b"uuu");
    }

    #[tokio::test]
    async fn an_http2_connection_takes_one_descriptor_and_gets_its_unread_bytes_and_state() {
        let mut h = header(WireKind::Http2, None);
        // `to_upstream`: client bytes for `h2`; `to_downstream`: the state.
        h.to_upstream_len = 1;
        h.to_downstream_len = 3;
        let r = Resumable::from_frame(&h, b"uSTA".to_vec(), fds(1), 4)
            .ok()
            .unwrap();
        assert_eq!(r.kind, WireKind::Http2);
        assert_eq!(
            (&r.to_upstream[..], &r.to_downstream[..]),
            (&b"u"[..], &b"STA"[..])
        );
        assert!(r.up.is_none());
        assert!(Resumable::from_frame(&h, b"uSTA".to_vec(), fds(2), 4).is_err());
        // And it is what an answer of `Parked::Http2` becomes.
        let tcp = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
            c.set_nonblocking(true).unwrap();
            TcpStream::from_std(c).unwrap()
        };
        let meta = Resumable::from_frame(&h, b"uSTA".to_vec(), fds(1), 4)
            .ok()
            .unwrap()
            .meta;
        let parked = ParkedAt {
            parked: Parked::Http2 {
                meta,
                downstream: ParkedIo::Tcp(tcp),
                unread: Bytes::from_static(b"u"),
                state: Bytes::from_static(b"STA"),
            },
            at: Instant::now(),
        };
        let r = Resumable::from_parked(parked).expect("an HTTP/2 connection moves");
        assert_eq!(r.kind, WireKind::Http2);
        assert_eq!(
            (&r.to_upstream[..], &r.to_downstream[..]),
            (&b"u"[..], &b"STA"[..])
        );
    }

    #[tokio::test]
    async fn inconsistent_upstream_tls_frames_are_declined() {
        // Upstream state on an HTTP/1 connection (it has no upstream socket).
        let mut h = header(WireKind::Http1, None);
        h.up_tls = Some(Box::new(secrets()));
        let err = Resumable::from_frame(&h, b"upd".to_vec(), fds(1), 1)
            .err()
            .unwrap();
        assert!(err.contains("without an upstream"), "{err}");
        // A blob that does not match the lengths its header announces.
        let mut h = header(WireKind::Tcp, None);
        h.up_tls = Some(Box::new(secrets()));
        h.up_tls_ciphertext_len = 10;
        let err = Resumable::from_frame(&h, b"upd".to_vec(), fds(2), 1)
            .err()
            .unwrap();
        assert!(err.contains("does not match"), "{err}");
    }
}
