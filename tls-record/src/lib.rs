//! Continue a TLS connection in another process: a userspace record layer.
//!
//! rustls established the connection in the old process. At the handoff the
//! old process extracts the record-layer secrets
//! ([`rustls::Connection::dangerous_extract_secrets`], which needs
//! `enable_secret_extraction` in the config) — AEAD key, IV and sequence
//! number per direction — and passes them with the socket. Both roles move:
//! inbound (server) sessions and originated (client) sessions to upstreams;
//! the record layer is the same for both. The kernel TLS ULP
//! (what rustls' `kernel` module targets) is not available on our nodes, so
//! [`TlsRecordStream`] implements the record layer itself on ring's AEADs, the
//! same primitives rustls uses:
//!
//! | version | nonce | AAD | on the wire |
//! |---|---|---|---|
//! | TLS 1.3 | iv ⊕ seq | record header | type 23, inner type byte after the plaintext |
//! | TLS 1.2 AES-GCM | iv\[..4\] ‖ explicit; rustls' explicit = iv\[4..\] ⊕ seq | seq ‖ type ‖ version ‖ len | 8-byte explicit nonce before the ciphertext |
//! | TLS 1.2 ChaCha20-Poly1305 | iv ⊕ seq | seq ‖ type ‖ version ‖ len | ciphertext ‖ tag |
//!
//! **TLS 1.3 KeyUpdate after the move is handled**, not refused: the old process
//! also captures the application traffic secrets through a [`SecretCapture`]
//! key log, indexed by the IV they derive (so no client random is needed to find
//! a connection's entry), and the new process runs the RFC 8446 §7.2 update
//! (`traffic upd` HKDF-Expand-Label) itself, answering an `update_requested`
//! with its own KeyUpdate. rustls' `KernelConnection::update_*_secret` would do
//! the same, but that object cannot cross a process boundary and exists only
//! for unbuffered connections. When no traffic secret was captured, a KeyUpdate
//! closes the connection cleanly (close_notify, then an error to the caller)
//! instead of corrupting it.
//!
//! Alerts: a received close_notify is EOF; `poll_shutdown` sends close_notify;
//! a fatal alert is an error. A TLS 1.2 renegotiation attempt gets the
//! `no_renegotiation` warning, as rustls itself answers.
//!
//! The old process must stop at a record boundary, or rustls would hold part of
//! a record that cannot be extracted: [`RecordAlignedIo`] wraps its socket and
//! hands rustls only whole records, keeping the rest to pass along.
//!
//! A leaf crate: it depends on no other Baton crate, and both the sidecar's
//! TLS layer and the handoff (`baton-handoff`, which carries
//! [`TlsWireState`] on its wire) use it. Its own tests (`tests.rs`) seal
//! and open records for every version and AEAD and feed it malformed
//! states and records; the tests that move real rustls sessions through
//! the handoff's wire format live in `baton-handoff`
//! (`handoff/tests/tls_session_moves.rs`), and the `tls_record` fuzz target
//! (`sidecar/fuzz`) runs its state and record parsing on arbitrary input.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, ready};

use ring::{aead, hkdf};
use rustls::{ConnectionTrafficSecrets, ExtractedSecrets, ProtocolVersion};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::io::poll_read_buf;

use serde::{Deserialize, Serialize};

/// Record-layer state of a TLS connection (what the handoff carries for it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsWireState {
    /// 0x0303 (TLS 1.2) or 0x0304 (TLS 1.3).
    pub version: u16,
    /// `aes_128_gcm`, `aes_256_gcm` or `chacha20_poly1305`.
    pub aead: String,
    pub tx: DirectionSecrets,
    pub rx: DirectionSecrets,
    /// Whether the TLS connection is the downstream (server role) one.
    #[serde(default = "yes")]
    pub server: bool,
}

fn yes() -> bool {
    true
}

/// One direction of a record layer.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectionSecrets {
    pub seq: u64,
    pub key: Vec<u8>,
    pub iv: Vec<u8>,
    /// TLS 1.3 application traffic secret (lets the new process follow a
    /// KeyUpdate); absent when the old process could not capture it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_secret: Option<Vec<u8>>,
}

impl std::fmt::Debug for DirectionSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("DirectionSecrets")
            .field("seq", &self.seq)
            .field("has_traffic_secret", &self.traffic_secret.is_some())
            .finish_non_exhaustive()
    }
}

const CT_CHANGE_CIPHER_SPEC: u8 = 20;
const CT_ALERT: u8 = 21;
const CT_HANDSHAKE: u8 = 22;
const CT_APPLICATION_DATA: u8 = 23;
const HS_KEY_UPDATE: u8 = 24;
const HS_NEW_SESSION_TICKET: u8 = 4;
const ALERT_CLOSE_NOTIFY: u8 = 0;
const ALERT_UNEXPECTED_MESSAGE: u8 = 10;
const ALERT_NO_RENEGOTIATION: u8 = 100;
const HEADER_LEN: usize = 5;
const MAX_PLAINTEXT: usize = 16 * 1024;
/// Largest ciphertext body accepted (TLS 1.2 allows 2^14 + 2048).
const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 2048;
const TAG_LEN: usize = 16;
const GCM_EXPLICIT_LEN: usize = 8;
/// Stop accepting writes while this much ciphertext is still unsent.
const WRITE_HIGH_WATER: usize = 64 * 1024;
/// Room made for one socket read.
const READ_CHUNK: usize = 16 * 1024;
pub const TLS12: u16 = 0x0303;
pub const TLS13: u16 = 0x0304;

#[derive(Debug, thiserror::Error)]
pub enum TlsStateError {
    #[error("unsupported TLS version 0x{0:04x}")]
    Version(u16),
    #[error("unsupported AEAD {0}")]
    Aead(String),
    #[error("bad key material: {0}")]
    Key(&'static str),
    #[error("rustls: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The AEADs TLS 1.2 and 1.3 suites use (what rustls' ring provider offers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AeadKind {
    Aes128Gcm,
    Aes256Gcm,
    Chacha20Poly1305,
}

impl AeadKind {
    pub fn name(self) -> &'static str {
        match self {
            AeadKind::Aes128Gcm => "aes_128_gcm",
            AeadKind::Aes256Gcm => "aes_256_gcm",
            AeadKind::Chacha20Poly1305 => "chacha20_poly1305",
        }
    }

    pub fn from_name(name: &str) -> Result<Self, TlsStateError> {
        Ok(match name {
            "aes_128_gcm" => AeadKind::Aes128Gcm,
            "aes_256_gcm" => AeadKind::Aes256Gcm,
            "chacha20_poly1305" => AeadKind::Chacha20Poly1305,
            other => return Err(TlsStateError::Aead(other.to_string())),
        })
    }

    fn algorithm(self) -> &'static aead::Algorithm {
        match self {
            AeadKind::Aes128Gcm => &aead::AES_128_GCM,
            AeadKind::Aes256Gcm => &aead::AES_256_GCM,
            AeadKind::Chacha20Poly1305 => &aead::CHACHA20_POLY1305,
        }
    }

    /// TLS 1.3 hash of the suite: only AES-256-GCM pairs with SHA-384.
    fn hkdf(self) -> hkdf::Algorithm {
        match self {
            AeadKind::Aes256Gcm => hkdf::HKDF_SHA384,
            _ => hkdf::HKDF_SHA256,
        }
    }
}

/// Output length for ring's HKDF-Expand.
struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// RFC 8446 §7.1 HKDF-Expand-Label with an empty context.
fn expand_label(alg: hkdf::Algorithm, secret: &[u8], label: &[u8], out: &mut [u8]) {
    let prk = hkdf::Prk::new_less_safe(alg, secret);
    let full_len = 6 + label.len();
    let out_len = (out.len() as u16).to_be_bytes();
    let info: [&[u8]; 5] = [&out_len, &[full_len as u8], b"tls13 ", label, &[0u8]];
    prk.expand(&info, Len(out.len()))
        .and_then(|okm| okm.fill(out))
        .expect("HKDF output length is within limits");
}

fn hkdf_for_secret(secret: &[u8]) -> hkdf::Algorithm {
    if secret.len() == 48 {
        hkdf::HKDF_SHA384
    } else {
        hkdf::HKDF_SHA256
    }
}

/// IV a TLS 1.3 traffic secret derives (12 bytes for every AEAD).
fn derive_iv(secret: &[u8]) -> [u8; 12] {
    let mut iv = [0u8; 12];
    expand_label(hkdf_for_secret(secret), secret, b"iv", &mut iv);
    iv
}

/// Traffic-secret generations indexed per logged secret (see
/// [`SecretCapture`]): KeyUpdates rustls followed before the move, up to
/// this many minus one, still let the new process follow later ones.
pub const CAPTURED_GENERATIONS: usize = 3;

/// The process-wide capture the TLS layer logs into and the handoff reads
/// (install with `MeshTls::set_key_log(secret_capture())`).
pub fn secret_capture() -> std::sync::Arc<SecretCapture> {
    static CAPTURE: std::sync::OnceLock<std::sync::Arc<SecretCapture>> = std::sync::OnceLock::new();
    // 3 generations x 2 directions x ~10k live TLS 1.3 connections.
    CAPTURE
        .get_or_init(|| std::sync::Arc::new(SecretCapture::new(60_000)))
        .clone()
}

/// A rustls key log that keeps TLS 1.3 application traffic secrets so a
/// connection can follow KeyUpdates after it moves.
///
/// Entries are indexed by the IV the secret derives; the extracted secrets
/// carry that IV, so the old process finds a connection's secret without a
/// client random. Bounded: the oldest entries are evicted beyond `capacity`
/// (a connection whose entry was evicted still moves; it just closes cleanly
/// on a later KeyUpdate).
#[derive(Debug)]
pub struct SecretCapture {
    inner: Mutex<CaptureInner>,
    capacity: usize,
}

#[derive(Debug, Default)]
struct CaptureInner {
    by_iv: HashMap<[u8; 12], Vec<u8>>,
    order: VecDeque<[u8; 12]>,
}

impl SecretCapture {
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Mutex::new(CaptureInner::default()),
            capacity,
        }
    }

    /// Removes and returns the traffic secret whose derived IV is `iv`.
    pub fn take(&self, iv: &[u8]) -> Option<Vec<u8>> {
        let key: [u8; 12] = iv.try_into().ok()?;
        self.inner.lock().ok()?.by_iv.remove(&key)
    }

    /// Traffic secrets held (each is indexed under `CAPTURED_GENERATIONS`
    /// IVs; a secret taken by a move removes only its matching generation,
    /// so this is an upper bound after moves).
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .map(|i| i.by_iv.len().div_ceil(CAPTURED_GENERATIONS))
            .unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl rustls::KeyLog for SecretCapture {
    fn will_log(&self, label: &str) -> bool {
        matches!(label, "CLIENT_TRAFFIC_SECRET_0" | "SERVER_TRAFFIC_SECRET_0")
    }

    fn log(&self, label: &str, _client_random: &[u8], secret: &[u8]) {
        if !self.will_log(label) {
            return;
        }
        // Index the secret and the next CAPTURED_GENERATIONS - 1 updates of
        // it: rustls may have followed a KeyUpdate before the move, and the
        // extracted IV then belongs to a later generation.
        let mut generations = Vec::with_capacity(CAPTURED_GENERATIONS);
        let mut current = secret.to_vec();
        for _ in 0..CAPTURED_GENERATIONS {
            let mut next = vec![0u8; current.len()];
            expand_label(
                hkdf_for_secret(&current),
                &current,
                b"traffic upd",
                &mut next,
            );
            generations.push((derive_iv(&current), std::mem::replace(&mut current, next)));
        }
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        for (iv, secret) in generations {
            if inner.by_iv.insert(iv, secret).is_none() {
                inner.order.push_back(iv);
            }
        }
        while inner.by_iv.len() > self.capacity {
            let Some(old) = inner.order.pop_front() else {
                break;
            };
            inner.by_iv.remove(&old);
        }
        // Keep `order` from growing with already-taken entries.
        if inner.order.len() > 2 * self.capacity.max(1) {
            let CaptureInner { by_iv, order } = &mut *inner;
            order.retain(|k| by_iv.contains_key(k));
        }
    }
}

/// Builds the wire state of a `server`- or client-role session from what
/// rustls extracted, attaching the traffic secrets from `capture` when it
/// holds them.
pub fn wire_state_from_rustls(
    version: ProtocolVersion,
    secrets: ExtractedSecrets,
    capture: Option<&SecretCapture>,
    server: bool,
) -> Result<TlsWireState, TlsStateError> {
    let version = match version {
        ProtocolVersion::TLSv1_2 => TLS12,
        ProtocolVersion::TLSv1_3 => TLS13,
        other => return Err(TlsStateError::Version(u16::from(other))),
    };
    let dir = |(seq, s): (u64, ConnectionTrafficSecrets)| -> Result<(AeadKind, DirectionSecrets), TlsStateError> {
        let (kind, key, iv) = match s {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (AeadKind::Aes128Gcm, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (AeadKind::Aes256Gcm, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (AeadKind::Chacha20Poly1305, key, iv),
            _ => return Err(TlsStateError::Aead("non-AEAD or unknown suite".into())),
        };
        let traffic_secret = if version == TLS13 {
            capture.and_then(|c| c.take(iv.as_ref()))
        } else {
            None
        };
        Ok((
            kind,
            DirectionSecrets { seq, key: key.as_ref().to_vec(), iv: iv.as_ref().to_vec(), traffic_secret },
        ))
    };
    let (kind, tx) = dir(secrets.tx)?;
    let (_, rx) = dir(secrets.rx)?;
    Ok(TlsWireState {
        version,
        aead: kind.name().to_string(),
        tx,
        rx,
        server,
    })
}

/// One direction's record protection.
struct Cipher {
    kind: AeadKind,
    key: aead::LessSafeKey,
    /// Raw key, kept so the connection can move on again.
    key_bytes: Vec<u8>,
    iv: [u8; 12],
    seq: u64,
    traffic_secret: Option<Vec<u8>>,
}

impl Cipher {
    fn new(kind: AeadKind, d: &DirectionSecrets) -> Result<Self, TlsStateError> {
        let key = aead::UnboundKey::new(kind.algorithm(), &d.key)
            .map_err(|_| TlsStateError::Key("AEAD key length"))?;
        let iv: [u8; 12] =
            d.iv.as_slice()
                .try_into()
                .map_err(|_| TlsStateError::Key("IV must be 12 bytes"))?;
        Ok(Self {
            kind,
            key: aead::LessSafeKey::new(key),
            key_bytes: d.key.clone(),
            iv,
            seq: d.seq,
            traffic_secret: d.traffic_secret.clone(),
        })
    }

    fn nonce(&self) -> aead::Nonce {
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        aead::Nonce::assume_unique_for_key(n)
    }

    /// RFC 8446 §7.2: next secret, then key and IV from it; sequence restarts.
    fn key_update(&mut self) -> bool {
        let Some(secret) = &self.traffic_secret else {
            return false;
        };
        let alg = self.kind.hkdf();
        let mut next = vec![0u8; secret.len()];
        expand_label(alg, secret, b"traffic upd", &mut next);
        let mut key = vec![0u8; self.kind.algorithm().key_len()];
        expand_label(alg, &next, b"key", &mut key);
        let mut iv = [0u8; 12];
        expand_label(alg, &next, b"iv", &mut iv);
        self.key = aead::LessSafeKey::new(
            aead::UnboundKey::new(self.kind.algorithm(), &key).expect("derived key length"),
        );
        self.key_bytes = key;
        self.iv = iv;
        self.seq = 0;
        self.traffic_secret = Some(next);
        true
    }

    fn tls12_aad(seq: u64, typ: u8, len: usize) -> aead::Aad<[u8; 13]> {
        let mut a = [0u8; 13];
        a[..8].copy_from_slice(&seq.to_be_bytes());
        a[8] = typ;
        a[9..11].copy_from_slice(&TLS12.to_be_bytes());
        a[11..13].copy_from_slice(&(len as u16).to_be_bytes());
        aead::Aad::from(a)
    }

    /// Appends one protected record carrying `data` (≤ 2^14 bytes) to `out`.
    fn seal(&mut self, version: u16, typ: u8, data: &[u8], out: &mut Vec<u8>) {
        let start = out.len();
        if version == TLS13 {
            let len = data.len() + 1 + TAG_LEN;
            out.extend_from_slice(&[CT_APPLICATION_DATA, 3, 3]);
            out.extend_from_slice(&(len as u16).to_be_bytes());
            let header: [u8; 5] = out[start..start + 5].try_into().expect("5 bytes");
            out.extend_from_slice(data);
            out.push(typ);
            let nonce = self.nonce();
            let tag = self
                .key
                .seal_in_place_separate_tag(
                    nonce,
                    aead::Aad::from(header),
                    &mut out[start + HEADER_LEN..],
                )
                .expect("sealing within record limits");
            out.extend_from_slice(tag.as_ref());
        } else {
            let explicit = if self.kind == AeadKind::Chacha20Poly1305 {
                0
            } else {
                GCM_EXPLICIT_LEN
            };
            let len = explicit + data.len() + TAG_LEN;
            out.push(typ);
            out.extend_from_slice(&TLS12.to_be_bytes());
            out.extend_from_slice(&(len as u16).to_be_bytes());
            let nonce = self.nonce();
            if explicit > 0 {
                // rustls' construction: explicit part = (iv ⊕ seq)[4..].
                out.extend_from_slice(&nonce.as_ref()[4..]);
            }
            let body = out.len();
            out.extend_from_slice(data);
            let aad = Self::tls12_aad(self.seq, typ, data.len());
            let tag = self
                .key
                .seal_in_place_separate_tag(nonce, aad, &mut out[body..])
                .expect("sealing within record limits");
            out.extend_from_slice(tag.as_ref());
        }
        self.seq += 1;
    }

    /// Opens one record in place; returns (content type, plaintext range).
    fn open(
        &mut self,
        version: u16,
        header: [u8; 5],
        body: &mut [u8],
    ) -> io::Result<(u8, std::ops::Range<usize>)> {
        let bad = || {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "TLS record failed authentication",
            )
        };
        let (typ, range) = if version == TLS13 {
            if body.len() < TAG_LEN + 1 {
                return Err(bad());
            }
            let nonce = self.nonce();
            let plain = self
                .key
                .open_in_place(nonce, aead::Aad::from(header), body)
                .map_err(|_| bad())?;
            // Strip zero padding; the last non-zero byte is the real type.
            let end = plain.iter().rposition(|&b| b != 0).ok_or_else(bad)?;
            (plain[end], 0..end)
        } else if self.kind == AeadKind::Chacha20Poly1305 {
            if body.len() < TAG_LEN {
                return Err(bad());
            }
            let aad = Self::tls12_aad(self.seq, header[0], body.len() - TAG_LEN);
            let n = self
                .key
                .open_in_place(self.nonce(), aad, body)
                .map_err(|_| bad())?
                .len();
            (header[0], 0..n)
        } else {
            if body.len() < GCM_EXPLICIT_LEN + TAG_LEN {
                return Err(bad());
            }
            let mut n = [0u8; 12];
            n[..4].copy_from_slice(&self.iv[..4]);
            n[4..].copy_from_slice(&body[..GCM_EXPLICIT_LEN]);
            let aad = Self::tls12_aad(self.seq, header[0], body.len() - GCM_EXPLICIT_LEN - TAG_LEN);
            let nonce = aead::Nonce::assume_unique_for_key(n);
            let len = self
                .key
                .open_within(nonce, aad, body, GCM_EXPLICIT_LEN..)
                .map_err(|_| bad())?
                .len();
            (header[0], 0..len)
        };
        self.seq += 1;
        Ok((typ, range))
    }
}

/// A TLS connection continued from extracted secrets: plaintext in and out,
/// records on `io`.
pub struct TlsRecordStream<S> {
    io: S,
    version: u16,
    rx: Cipher,
    tx: Cipher,
    /// Ciphertext received, not yet a whole record.
    rbuf: Vec<u8>,
    /// Decrypted application data not yet read.
    plain: Vec<u8>,
    plain_pos: usize,
    /// Ciphertext waiting to be written.
    wbuf: Vec<u8>,
    wpos: usize,
    /// Handshake bytes of a message split across records.
    hs: Vec<u8>,
    peer_closed: bool,
    we_closed: bool,
    /// An error to report after flushing our close_notify.
    fail: Option<(io::ErrorKind, String)>,
    key_updates: u64,
}

impl<S> std::fmt::Debug for TlsRecordStream<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsRecordStream")
            .field("version", &format_args!("0x{:04x}", self.version))
            .field("aead", &self.rx.kind)
            .field("rx_seq", &self.rx.seq)
            .field("tx_seq", &self.tx.seq)
            .finish_non_exhaustive()
    }
}

impl<S> TlsRecordStream<S> {
    /// Resumes the record layer on `io`. `pending_ciphertext` is what the old
    /// process read but did not decrypt (a partial record, see
    /// [`RecordAlignedIo`]); `pending_plaintext` what it decrypted but did not
    /// consume.
    pub fn new(
        io: S,
        state: &TlsWireState,
        pending_ciphertext: Vec<u8>,
        pending_plaintext: Vec<u8>,
    ) -> Result<Self, TlsStateError> {
        if state.version != TLS12 && state.version != TLS13 {
            return Err(TlsStateError::Version(state.version));
        }
        let kind = AeadKind::from_name(&state.aead)?;
        Ok(Self {
            io,
            version: state.version,
            rx: Cipher::new(kind, &state.rx)?,
            tx: Cipher::new(kind, &state.tx)?,
            rbuf: pending_ciphertext,
            plain: pending_plaintext,
            plain_pos: 0,
            wbuf: Vec::new(),
            wpos: 0,
            hs: Vec::new(),
            peer_closed: false,
            we_closed: false,
            fail: None,
            key_updates: 0,
        })
    }

    /// Hands the connection on (another handoff): the socket, the record
    /// state, undecrypted bytes and unread plaintext. Refused (the stream is
    /// given back) while anything is unsent or a handshake message is split.
    #[allow(clippy::type_complexity, clippy::result_large_err)]
    pub fn export(self) -> Result<(S, TlsWireState, Vec<u8>, Vec<u8>), Self> {
        if self.wpos < self.wbuf.len()
            || !self.hs.is_empty()
            || self.we_closed
            || self.fail.is_some()
        {
            return Err(self);
        }
        let dir = |c: &Cipher| DirectionSecrets {
            seq: c.seq,
            key: c.key_bytes.clone(),
            iv: c.iv.to_vec(),
            traffic_secret: c.traffic_secret.clone(),
        };
        let state = TlsWireState {
            version: self.version,
            aead: self.rx.kind.name().to_string(),
            tx: dir(&self.tx),
            rx: dir(&self.rx),
            server: true,
        };
        let plain = self.plain[self.plain_pos..].to_vec();
        Ok((self.io, state, self.rbuf, plain))
    }

    /// Key updates followed since the move (both directions counted).
    pub fn key_updates(&self) -> u64 {
        self.key_updates
    }

    pub fn get_ref(&self) -> &S {
        &self.io
    }

    /// Sequence numbers (tx, rx), e.g. to hand the connection on again.
    pub fn sequence_numbers(&self) -> (u64, u64) {
        (self.tx.seq, self.rx.seq)
    }

    fn alert(&mut self, level: u8, desc: u8) {
        let v = self.version;
        let mut out = std::mem::take(&mut self.wbuf);
        self.tx.seal(v, CT_ALERT, &[level, desc], &mut out);
        self.wbuf = out;
    }

    /// Closes with close_notify and makes every later read fail with `msg`.
    fn close_with(&mut self, kind: io::ErrorKind, msg: String) {
        if !self.we_closed {
            self.alert(1, ALERT_CLOSE_NOTIFY);
            self.we_closed = true;
        }
        self.fail = Some((kind, msg));
    }

    /// Processes whole records from `rbuf`; stops after producing plaintext.
    fn process_records(&mut self) -> io::Result<()> {
        let mut off = 0;
        while self.plain_pos >= self.plain.len() && !self.peer_closed && self.fail.is_none() {
            if self.rbuf.len() - off < HEADER_LEN {
                break;
            }
            let header: [u8; 5] = self.rbuf[off..off + HEADER_LEN]
                .try_into()
                .expect("5 bytes");
            let len = u16::from_be_bytes([header[3], header[4]]) as usize;
            if len > MAX_CIPHERTEXT + 256 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "oversized TLS record",
                ));
            }
            if self.rbuf.len() - off < HEADER_LEN + len {
                break;
            }
            let body_start = off + HEADER_LEN;
            off = body_start + len;
            if self.version == TLS13 && header[0] == CT_CHANGE_CIPHER_SPEC {
                continue; // middlebox-compatibility record, unprotected
            }
            let (typ, range) =
                self.rx
                    .open(self.version, header, &mut self.rbuf[body_start..off])?;
            let payload = body_start + range.start..body_start + range.end;
            match typ {
                CT_APPLICATION_DATA => {
                    self.plain.clear();
                    self.plain_pos = 0;
                    self.plain.extend_from_slice(&self.rbuf[payload]);
                }
                CT_ALERT => {
                    let a = &self.rbuf[payload];
                    if a.len() != 2 {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "malformed alert",
                        ));
                    }
                    if a[1] == ALERT_CLOSE_NOTIFY {
                        self.peer_closed = true;
                    } else if a[0] == 1 && self.version == TLS12 {
                        // TLS 1.2 warning alerts are informational.
                    } else {
                        let desc = a[1];
                        self.rbuf.drain(..off);
                        return Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            format!("peer sent fatal TLS alert {desc}"),
                        ));
                    }
                }
                CT_HANDSHAKE => {
                    let bytes = self.rbuf[payload].to_vec();
                    self.handshake(&bytes);
                }
                other => {
                    self.alert(2, ALERT_UNEXPECTED_MESSAGE);
                    self.we_closed = true;
                    self.fail = Some((
                        io::ErrorKind::InvalidData,
                        format!("unexpected TLS content type {other}"),
                    ));
                }
            }
        }
        self.rbuf.drain(..off);
        Ok(())
    }

    /// Post-handshake messages: TLS 1.3 KeyUpdate is followed; a TLS 1.2
    /// renegotiation is declined like rustls does.
    fn handshake(&mut self, bytes: &[u8]) {
        if self.version == TLS12 {
            self.alert(1, ALERT_NO_RENEGOTIATION);
            return;
        }
        self.hs.extend_from_slice(bytes);
        while self.hs.len() >= 4 {
            let typ = self.hs[0];
            let len = u32::from_be_bytes([0, self.hs[1], self.hs[2], self.hs[3]]) as usize;
            if self.hs.len() < 4 + len {
                return;
            }
            let body: Vec<u8> = self.hs[4..4 + len].to_vec();
            self.hs.drain(..4 + len);
            match (typ, body.as_slice()) {
                (HS_KEY_UPDATE, [request]) if *request <= 1 => {
                    if !self.rx.key_update() {
                        self.close_with(
                            io::ErrorKind::ConnectionAborted,
                            "TLS 1.3 KeyUpdate after handoff without a captured traffic secret: closed cleanly".into(),
                        );
                        return;
                    }
                    self.key_updates += 1;
                    if *request == 1 {
                        // Answer with update_not_requested under the old key,
                        // then switch (RFC 8446 §4.6.3).
                        if self.tx.traffic_secret.is_none() {
                            self.close_with(
                                io::ErrorKind::ConnectionAborted,
                                "peer requested a KeyUpdate we cannot follow: closed cleanly"
                                    .into(),
                            );
                            return;
                        }
                        let v = self.version;
                        let mut out = std::mem::take(&mut self.wbuf);
                        self.tx
                            .seal(v, CT_HANDSHAKE, &[HS_KEY_UPDATE, 0, 0, 1, 0], &mut out);
                        self.wbuf = out;
                        self.tx.key_update();
                        self.key_updates += 1;
                    }
                }
                (HS_NEW_SESSION_TICKET, _) => {} // client role: tickets are not kept across a move
                _ => {
                    self.alert(2, ALERT_UNEXPECTED_MESSAGE);
                    self.we_closed = true;
                    self.fail = Some((
                        io::ErrorKind::InvalidData,
                        format!("unexpected post-handshake message {typ}"),
                    ));
                    return;
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> TlsRecordStream<S> {
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.wpos < self.wbuf.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.wbuf[self.wpos..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.wpos += n;
        }
        self.wbuf.clear();
        self.wpos = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for TlsRecordStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.plain_pos < this.plain.len() {
                let n = (this.plain.len() - this.plain_pos).min(buf.remaining());
                buf.put_slice(&this.plain[this.plain_pos..this.plain_pos + n]);
                this.plain_pos += n;
                return Poll::Ready(Ok(()));
            }
            // Control replies (KeyUpdate, alerts) go out before we report.
            if this.wpos < this.wbuf.len() {
                match this.poll_drain(cx) {
                    Poll::Ready(r) => r?,
                    Poll::Pending if this.fail.is_some() => return Poll::Pending,
                    Poll::Pending => {}
                }
            }
            if let Some((kind, msg)) = &this.fail {
                return Poll::Ready(Err(io::Error::new(*kind, msg.clone())));
            }
            if this.peer_closed {
                return Poll::Ready(Ok(()));
            }
            let before = (this.rbuf.len(), this.plain.len(), this.plain_pos);
            this.process_records()?;
            if this.plain_pos < this.plain.len() || this.fail.is_some() || this.peer_closed {
                continue;
            }
            if (this.rbuf.len(), this.plain.len(), this.plain_pos) != before {
                continue; // consumed control records; look again
            }
            // Need more ciphertext: read into rbuf's spare capacity (no
            // zeroed scratch buffer per read).
            this.rbuf.reserve(READ_CHUNK);
            if ready!(poll_read_buf(Pin::new(&mut this.io), cx, &mut this.rbuf))? == 0 {
                return Poll::Ready(if this.rbuf.is_empty() {
                    // TCP EOF without close_notify: report EOF, as a
                    // truncation is the proxy's to judge (rustls does too).
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "TLS record truncated by EOF",
                    ))
                });
            }
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for TlsRecordStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.we_closed {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "TLS connection closed",
            )));
        }
        if this.wbuf.len() - this.wpos >= WRITE_HIGH_WATER {
            ready!(this.poll_drain(cx))?;
        }
        let mut taken = 0;
        let v = this.version;
        while taken < data.len() && this.wbuf.len() - this.wpos < WRITE_HIGH_WATER {
            let n = (data.len() - taken).min(MAX_PLAINTEXT);
            let mut out = std::mem::take(&mut this.wbuf);
            this.tx
                .seal(v, CT_APPLICATION_DATA, &data[taken..taken + n], &mut out);
            this.wbuf = out;
            taken += n;
        }
        // Push what we can now; anything left goes on the next write/flush.
        if let Poll::Ready(Err(e)) = this.poll_drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(taken))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.we_closed {
            this.alert(1, ALERT_CLOSE_NOTIFY);
            this.we_closed = true;
        }
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

/// Wraps the old process's socket so rustls only ever sees whole TLS records.
///
/// rustls cannot export a partially received record, so at the handoff the
/// bytes of an incomplete record must still be ours to pass along. This
/// reader returns data only up to a record boundary (unless the caller's
/// buffer is smaller than one record, in which case [`Self::is_aligned`]
/// turns false until the record is complete — not a safe point).
#[derive(Debug)]
pub struct RecordAlignedIo<T> {
    io: T,
    pending: Vec<u8>,
    /// Bytes of the current record already handed out beyond a boundary.
    owed: usize,
}

impl<T> RecordAlignedIo<T> {
    pub fn new(io: T) -> Self {
        Self {
            io,
            pending: Vec::new(),
            owed: 0,
        }
    }

    /// True when everything handed to rustls ends on a record boundary.
    pub fn is_aligned(&self) -> bool {
        self.owed == 0
    }

    pub fn get_ref(&self) -> &T {
        &self.io
    }

    /// The socket and the received bytes rustls has not seen.
    pub fn into_parts(self) -> (T, Vec<u8>) {
        (self.io, self.pending)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for RecordAlignedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.pending.is_empty() && this.owed == 0 {
            // Fast path: read straight into the caller's buffer and keep
            // back only a trailing partial record, if any. With small
            // exchanges every read ends on a record boundary, so nothing is
            // copied.
            let start = buf.filled().len();
            ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
            let got = &buf.filled()[start..];
            let whole = whole_records(got, usize::MAX);
            if whole == got.len() {
                return Poll::Ready(Ok(())); // aligned, or EOF
            }
            this.pending.extend_from_slice(&got[whole..]);
            buf.set_filled(start + whole);
            if whole > 0 {
                return Poll::Ready(Ok(()));
            }
            // Not one whole record yet: the loop below waits for the rest.
        }
        loop {
            let ready_len = if this.owed > 0 {
                this.owed.min(this.pending.len())
            } else {
                whole_records(&this.pending, buf.remaining())
            };
            if ready_len > 0 {
                let n = ready_len.min(buf.remaining());
                buf.put_slice(&this.pending[..n]);
                this.owed = owed_after(&this.pending, this.owed, n);
                this.pending.drain(..n);
                return Poll::Ready(Ok(()));
            }
            this.pending.reserve(READ_CHUNK);
            if ready!(poll_read_buf(Pin::new(&mut this.io), cx, &mut this.pending))? == 0 {
                // EOF: hand over whatever is left so rustls sees the truncation.
                let n = this.pending.len().min(buf.remaining());
                buf.put_slice(&this.pending[..n]);
                this.pending.drain(..n);
                return Poll::Ready(Ok(()));
            }
        }
    }
}

/// Length of the longest prefix of `data` made of whole records that fits
/// in `room`; if not even one record fits, the first whole record (which the
/// caller then splits, losing alignment until it completes).
// Inlinable into the sidecar, where the generic reader using it is compiled
// (it runs on every read of a mesh TLS socket).
#[inline]
fn whole_records(data: &[u8], room: usize) -> usize {
    let mut off = 0;
    while data.len() - off >= HEADER_LEN {
        let len = u16::from_be_bytes([data[off + 3], data[off + 4]]) as usize;
        if data.len() - off < HEADER_LEN + len {
            break;
        }
        if off + HEADER_LEN + len > room && off > 0 {
            break;
        }
        off += HEADER_LEN + len;
    }
    off
}

/// Bytes of a record still owed after handing out `pending[..n]`, when
/// `owed` bytes of the record in progress were owed before. Only called with
/// `n` inside whole records, so every header it needs is in `pending`.
// Inlinable into the sidecar, where the generic reader using it is compiled
// (it runs on every read of a mesh TLS socket).
#[inline]
fn owed_after(pending: &[u8], mut owed: usize, n: usize) -> usize {
    let mut off = 0;
    while off < n {
        if owed == 0 {
            owed = HEADER_LEN + u16::from_be_bytes([pending[off + 3], pending[off + 4]]) as usize;
        }
        let take = owed.min(n - off);
        off += take;
        owed -= take;
    }
    owed
}

impl<T: AsyncWrite + Unpin> AsyncWrite for RecordAlignedIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, data)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(test)]
mod tests;
