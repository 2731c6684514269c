//! The state of an HTTP/2 connection outside its HPACK tables, followed
//! from the bytes passing each way: what moving an idle connection to a new
//! process has to carry (docs/decisions/0060) — the client's SETTINGS, both
//! connection flow-control windows, the highest client stream id, which
//! streams are open, and whether the client has acknowledged every SETTINGS
//! the server sent.
//!
//! Pure: fed byte slices in wire order (any split), no I/O. The frame shim
//! (`h2_shim`, decisions 0060 and 0062) feeds it the plaintext
//! under hyper and, at a handoff, carries [`ConnState::encode`] and starts
//! a fresh `h2` behind [`ConnState::synthetic_preface`].

use std::collections::BTreeMap;

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Every connection-level window starts here (RFC 9113 §6.9.2).
pub const DEFAULT_WINDOW: i64 = 65_535;
/// The largest flow-control window (RFC 9113 §6.9.1).
pub const MAX_WINDOW: i64 = (1 << 31) - 1;

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PUSH_PROMISE: u8 = 0x5;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
/// The largest SETTINGS_MAX_FRAME_SIZE (2^24 − 1).
const MAX_PAYLOAD: usize = (1 << 24) - 1;
/// The highest SETTINGS identifier followed (the registry's go to 0x9).
const MAX_SETTING_ID: u16 = 0x10;
/// Version byte of [`ConnState::encode`]'s form.
const FORM_VERSION: u8 = 2;

/// Why the bytes (or a carried form) are not a connection this can follow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("the client preface is wrong")]
    BadPreface,
    #[error("malformed {0} frame")]
    Malformed(&'static str),
    #[error("a flow-control window left its range (RFC 9113 §6.9.1)")]
    Window,
    #[error("server push is not followed")]
    Push,
    #[error("carried state: {0}")]
    Form(&'static str),
}

/// One direction's frame boundaries, across reads.
#[derive(Debug, Clone, Default)]
struct Scanner {
    head: [u8; 9],
    have: usize,
    cur: Option<Current>,
}

/// The frame being read.
#[derive(Debug, Clone)]
struct Current {
    head: [u8; 9],
    len: usize,
    left: usize,
    /// Kept only for the frames whose content matters here.
    payload: Vec<u8>,
    keep: bool,
}

/// A complete frame: type, flags, stream id, payload length, and the
/// payload itself for SETTINGS, WINDOW_UPDATE and GOAWAY.
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    len: usize,
    payload: Vec<u8>,
}

/// The most of a SETTINGS, WINDOW_UPDATE or GOAWAY payload kept (a larger
/// one is refused: no legitimate peer sends it).
const MAX_KEPT: usize = 1 << 16;

impl Scanner {
    /// Feeds `bytes`, calling `each` for every frame completed.
    fn feed(
        &mut self,
        mut bytes: &[u8],
        mut each: impl FnMut(Frame) -> Result<(), StateError>,
    ) -> Result<(), StateError> {
        loop {
            if let Some(c) = &mut self.cur {
                let take = c.left.min(bytes.len());
                if c.keep {
                    c.payload.extend_from_slice(&bytes[..take]);
                }
                c.left -= take;
                bytes = &bytes[take..];
                if c.left > 0 {
                    return Ok(());
                }
                let c = self.cur.take().expect("a frame in progress");
                each(Frame {
                    kind: c.head[3],
                    flags: c.head[4],
                    stream: u32::from_be_bytes([c.head[5], c.head[6], c.head[7], c.head[8]])
                        & 0x7fff_ffff,
                    len: c.len,
                    payload: c.payload,
                })?;
                continue;
            }
            if bytes.is_empty() {
                return Ok(());
            }
            let take = (9 - self.have).min(bytes.len());
            self.head[self.have..self.have + take].copy_from_slice(&bytes[..take]);
            self.have += take;
            bytes = &bytes[take..];
            if self.have < 9 {
                return Ok(());
            }
            self.have = 0;
            let len = (usize::from(self.head[0]) << 16)
                | (usize::from(self.head[1]) << 8)
                | usize::from(self.head[2]);
            let keep = matches!(self.head[3], SETTINGS | WINDOW_UPDATE | GOAWAY);
            if keep && len > MAX_KEPT {
                return Err(StateError::Malformed("oversized control"));
            }
            self.cur = Some(Current {
                head: self.head,
                len,
                left: len,
                payload: Vec::with_capacity(if keep { len } else { 0 }),
                keep,
            });
        }
    }

    fn at_boundary(&self) -> bool {
        self.have == 0 && self.cur.is_none()
    }
}

/// Where a client stream is: which side has ended it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Ends {
    client: bool,
    server: bool,
}

/// The followed state of one HTTP/2 connection (server side).
#[derive(Debug, Clone)]
pub struct ConnState {
    preface_left: usize,
    from_client: Scanner,
    to_client: Scanner,
    /// The client's SETTINGS, last value per identifier.
    client_settings: BTreeMap<u16, u32>,
    /// What the server may still send on the connection (RFC 9113 §6.9).
    send_window: i64,
    /// What the client may still send on the connection.
    recv_window: i64,
    highest_client_stream: u32,
    open: BTreeMap<u32, Ends>,
    /// SETTINGS frames the server sent that the client has not acknowledged.
    unacked_settings: u32,
    goaway: bool,
    /// The client acknowledged the HPACK table reset and has sent no header
    /// block since, so its next one must start with the size update. Set
    /// by whoever drives the reset (the frame shim), not by the frames: a
    /// block that already carried it went to the old process.
    update_pending: bool,
}

impl Default for ConnState {
    fn default() -> Self {
        Self {
            preface_left: PREFACE.len(),
            from_client: Scanner::default(),
            to_client: Scanner::default(),
            client_settings: BTreeMap::new(),
            send_window: DEFAULT_WINDOW,
            recv_window: DEFAULT_WINDOW,
            highest_client_stream: 0,
            open: BTreeMap::new(),
            unacked_settings: 0,
            goaway: false,
            update_pending: false,
        }
    }
}

impl ConnState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes the client sent, in order (the preface first).
    pub fn from_client(&mut self, mut bytes: &[u8]) -> Result<(), StateError> {
        if self.preface_left > 0 {
            let at = PREFACE.len() - self.preface_left;
            let take = self.preface_left.min(bytes.len());
            if bytes[..take] != PREFACE[at..at + take] {
                return Err(StateError::BadPreface);
            }
            self.preface_left -= take;
            bytes = &bytes[take..];
        }
        let mut scanner = std::mem::take(&mut self.from_client);
        let r = scanner.feed(bytes, |f| self.client_frame(f));
        self.from_client = scanner;
        r
    }

    /// Bytes the server sent, in order.
    pub fn to_client(&mut self, bytes: &[u8]) -> Result<(), StateError> {
        let mut scanner = std::mem::take(&mut self.to_client);
        let r = scanner.feed(bytes, |f| self.server_frame(f));
        self.to_client = scanner;
        r
    }

    fn client_frame(&mut self, f: Frame) -> Result<(), StateError> {
        match f.kind {
            DATA => {
                self.recv_window -= data_len(&f) as i64;
                if self.recv_window < 0 {
                    return Err(StateError::Window);
                }
                if f.flags & END_STREAM != 0 {
                    self.end(f.stream, true);
                }
            }
            HEADERS => {
                if !f.stream.is_multiple_of(2) && f.stream > self.highest_client_stream {
                    self.highest_client_stream = f.stream;
                    self.open.insert(f.stream, Ends::default());
                }
                if f.flags & END_STREAM != 0 {
                    self.end(f.stream, true);
                }
            }
            RST_STREAM => {
                self.open.remove(&f.stream);
            }
            SETTINGS if f.flags & ACK != 0 => {
                self.unacked_settings = self.unacked_settings.saturating_sub(1);
            }
            SETTINGS => {
                if !f.payload.len().is_multiple_of(6) {
                    return Err(StateError::Malformed("SETTINGS"));
                }
                for p in f.payload.chunks_exact(6) {
                    let id = u16::from_be_bytes([p[0], p[1]]);
                    let value = u32::from_be_bytes([p[2], p[3], p[4], p[5]]);
                    // Unknown identifiers are ignored (RFC 9113 §6.5.2);
                    // the registered ones are all below this.
                    if !setting_valid(id, value) {
                        return Err(StateError::Malformed("SETTINGS value"));
                    }
                    if id <= MAX_SETTING_ID {
                        self.client_settings.insert(id, value);
                    }
                }
            }
            WINDOW_UPDATE => {
                let inc = window_increment(&f)?;
                if f.stream == 0 {
                    self.send_window += inc;
                    if self.send_window > MAX_WINDOW {
                        return Err(StateError::Window);
                    }
                }
            }
            GOAWAY => self.goaway = true,
            _ => {}
        }
        Ok(())
    }

    fn server_frame(&mut self, f: Frame) -> Result<(), StateError> {
        match f.kind {
            DATA => {
                self.send_window -= data_len(&f) as i64;
                if self.send_window < 0 {
                    return Err(StateError::Window);
                }
                if f.flags & END_STREAM != 0 {
                    self.end(f.stream, false);
                }
            }
            HEADERS if f.flags & END_STREAM != 0 => self.end(f.stream, false),
            RST_STREAM => {
                self.open.remove(&f.stream);
            }
            SETTINGS if f.flags & ACK == 0 => self.unacked_settings += 1,
            PUSH_PROMISE => return Err(StateError::Push),
            WINDOW_UPDATE => {
                let inc = window_increment(&f)?;
                if f.stream == 0 {
                    self.recv_window += inc;
                    if self.recv_window > MAX_WINDOW {
                        return Err(StateError::Window);
                    }
                }
            }
            GOAWAY => self.goaway = true,
            _ => {}
        }
        Ok(())
    }

    fn end(&mut self, stream: u32, by_client: bool) {
        if let Some(e) = self.open.get_mut(&stream) {
            if by_client {
                e.client = true;
            } else {
                e.server = true;
            }
            if e.client && e.server {
                self.open.remove(&stream);
            }
        }
    }

    /// A safe point to move the connection: the preface read, both
    /// directions at a frame boundary, no stream open, every SETTINGS the
    /// server sent acknowledged, no GOAWAY either way.
    pub fn idle(&self) -> bool {
        self.preface_left == 0
            && self.from_client.at_boundary()
            && self.to_client.at_boundary()
            && self.open.is_empty()
            && self.unacked_settings == 0
            && !self.goaway
    }

    pub fn open_streams(&self) -> usize {
        self.open.len()
    }

    pub fn send_window(&self) -> i64 {
        self.send_window
    }

    pub fn recv_window(&self) -> i64 {
        self.recv_window
    }

    pub fn client_setting(&self, id: u16) -> Option<u32> {
        self.client_settings.get(&id).copied()
    }

    pub fn highest_client_stream(&self) -> u32 {
        self.highest_client_stream
    }

    /// What a fresh server must read first to continue this connection: the
    /// preface magic, the client's SETTINGS in one frame, and a connection
    /// WINDOW_UPDATE bringing its send window from 65,535 to this one's.
    /// `None` when the send window is below 65,535: no frame can lower a
    /// fresh server's idea of it (decision 0060 falls back to draining).
    pub fn synthetic_preface(&self) -> Option<Vec<u8>> {
        if self.send_window < DEFAULT_WINDOW {
            return None;
        }
        let mut out = PREFACE.to_vec();
        let settings: Vec<u8> = self
            .client_settings
            .iter()
            .flat_map(|(id, v)| {
                let mut p = id.to_be_bytes().to_vec();
                p.extend_from_slice(&v.to_be_bytes());
                p
            })
            .collect();
        push_frame(&mut out, SETTINGS, 0, 0, &settings);
        let extra = self.send_window - DEFAULT_WINDOW;
        if extra > 0 {
            push_frame(&mut out, WINDOW_UPDATE, 0, 0, &(extra as u32).to_be_bytes());
        }
        Some(out)
    }

    /// The carried form of an idle connection's state.
    pub fn encode(&self) -> Result<Vec<u8>, StateError> {
        if !self.idle() {
            return Err(StateError::Form("only an idle connection is carried"));
        }
        let mut out = vec![FORM_VERSION];
        out.extend_from_slice(&(self.send_window as i32).to_be_bytes());
        out.extend_from_slice(&(self.recv_window as i32).to_be_bytes());
        out.extend_from_slice(&self.highest_client_stream.to_be_bytes());
        out.push(self.client_settings.len() as u8);
        for (id, v) in &self.client_settings {
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&v.to_be_bytes());
        }
        out.push(u8::from(self.update_pending));
        Ok(out)
    }

    /// The state [`ConnState::encode`] carried; anything else is refused.
    pub fn decode(form: &[u8]) -> Result<Self, StateError> {
        let mut r = Reader(form);
        let mut take = |n: usize| r.take(n);
        if take(1)?[0] != FORM_VERSION {
            return Err(StateError::Form("unknown version"));
        }
        let i32_at = |b: &[u8]| i32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let send_window = i64::from(i32_at(take(4)?));
        let recv_window = i64::from(i32_at(take(4)?));
        if send_window < 0 || recv_window < 0 {
            return Err(StateError::Form("a negative window"));
        }
        let s = take(4)?;
        let highest_client_stream = u32::from_be_bytes([s[0], s[1], s[2], s[3]]);
        if highest_client_stream > MAX_WINDOW as u32
            || (highest_client_stream != 0 && highest_client_stream.is_multiple_of(2))
        {
            return Err(StateError::Form("client stream ids are odd and below 2^31"));
        }
        let n = take(1)?[0];
        let mut client_settings = BTreeMap::new();
        for _ in 0..n {
            let p = take(6)?;
            let id = u16::from_be_bytes([p[0], p[1]]);
            let value = u32::from_be_bytes([p[2], p[3], p[4], p[5]]);
            if !setting_valid(id, value) || id > MAX_SETTING_ID {
                return Err(StateError::Form("a SETTINGS value out of its range"));
            }
            // One canonical form: identifiers ascending, each once.
            if client_settings
                .keys()
                .next_back()
                .is_some_and(|last| *last >= id)
            {
                return Err(StateError::Form("SETTINGS identifiers not ascending"));
            }
            client_settings.insert(id, value);
        }
        let update_pending = match take(1)?[0] {
            0 => false,
            1 => true,
            _ => return Err(StateError::Form("a flag that is neither 0 nor 1")),
        };
        if !r.0.is_empty() {
            return Err(StateError::Form("trailing bytes"));
        }
        Ok(Self {
            preface_left: 0,
            client_settings,
            send_window,
            recv_window,
            highest_client_stream,
            update_pending,
            ..Self::default()
        })
    }

    /// Whether the client's next header block must start with the HPACK
    /// size update (see the field).
    pub fn update_pending(&self) -> bool {
        self.update_pending
    }

    /// Records it (the frame shim, which drives the table reset).
    pub fn set_update_pending(&mut self, pending: bool) {
        self.update_pending = pending;
    }
}

/// What a DATA frame counts against flow control: its whole payload,
/// padding included (RFC 9113 §6.9.1).
fn data_len(f: &Frame) -> usize {
    f.len
}

/// Whether a SETTINGS value is within its range (RFC 9113 §6.5.2; values
/// out of it are connection errors).
fn setting_valid(id: u16, value: u32) -> bool {
    match id {
        0x2 => value <= 1,
        0x4 => i64::from(value) <= MAX_WINDOW,
        0x5 => (16_384..=MAX_PAYLOAD as u32).contains(&value),
        _ => true,
    }
}

/// A cursor over a carried form.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], StateError> {
        if self.0.len() < n {
            return Err(StateError::Form("truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
}

fn window_increment(f: &Frame) -> Result<i64, StateError> {
    let p = &f.payload;
    if p.len() != 4 {
        return Err(StateError::Malformed("WINDOW_UPDATE"));
    }
    Ok(i64::from(
        u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff,
    ))
}

fn push_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len() as u32;
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        push_frame(&mut out, kind, flags, stream, payload);
        out
    }

    fn settings(pairs: &[(u16, u32)]) -> Vec<u8> {
        let p: Vec<u8> = pairs
            .iter()
            .flat_map(|(id, v)| {
                let mut b = id.to_be_bytes().to_vec();
                b.extend_from_slice(&v.to_be_bytes());
                b
            })
            .collect();
        frame(SETTINGS, 0, 0, &p)
    }

    /// A client's side of one exchange: preface, SETTINGS, a connection
    /// WINDOW_UPDATE, a request with a 100-byte body; later its ACK.
    fn client_bytes() -> (Vec<u8>, Vec<u8>) {
        let mut c = PREFACE.to_vec();
        c.extend(settings(&[(0x1, 4096), (0x4, 1 << 20), (0x3, 100)]));
        c.extend(frame(WINDOW_UPDATE, 0, 0, &1_000_000u32.to_be_bytes()));
        c.extend(frame(HEADERS, 0x4, 1, &[0x82, 0x86, 0x84]));
        c.extend(frame(DATA, END_STREAM, 1, &[7u8; 100]));
        (c, frame(SETTINGS, ACK, 0, &[]))
    }

    fn server_bytes() -> Vec<u8> {
        let mut s = settings(&[(0x3, 256)]);
        s.extend(frame(SETTINGS, ACK, 0, &[]));
        s.extend(frame(WINDOW_UPDATE, 0, 0, &983_041u32.to_be_bytes()));
        s.extend(frame(HEADERS, 0x4, 1, &[0x88]));
        s.extend(frame(DATA, END_STREAM, 1, &[1u8; 300]));
        s
    }

    fn check_after_exchange(st: &ConnState) {
        assert!(st.idle());
        assert_eq!(st.send_window(), DEFAULT_WINDOW + 1_000_000 - 300);
        assert_eq!(st.recv_window(), DEFAULT_WINDOW - 100 + 983_041);
        assert_eq!(st.highest_client_stream(), 1);
        assert_eq!(st.client_setting(0x4), Some(1 << 20));
        assert_eq!(st.client_setting(0x1), Some(4096));
    }

    #[test]
    fn an_exchange_leaves_the_windows_settings_and_stream_ids_both_ends_hold() {
        let (c, ack) = client_bytes();
        let mut st = ConnState::new();
        st.from_client(&c).unwrap();
        assert!(!st.idle(), "a stream is open");
        assert_eq!(st.open_streams(), 1);
        st.to_client(&server_bytes()).unwrap();
        assert!(!st.idle(), "the server's SETTINGS is not acknowledged");
        st.from_client(&ack).unwrap();
        check_after_exchange(&st);
    }

    #[test]
    fn any_split_of_the_bytes_gives_the_same_state() {
        let (c, ack) = client_bytes();
        let s = server_bytes();
        for at in 0..=c.len() {
            let mut st = ConnState::new();
            st.from_client(&c[..at]).unwrap();
            st.from_client(&c[at..]).unwrap();
            for b in s.chunks(1) {
                st.to_client(b).unwrap();
            }
            st.from_client(&ack).unwrap();
            check_after_exchange(&st);
        }
        // Mid-frame is not idle.
        let mut st = ConnState::new();
        st.from_client(&c).unwrap();
        st.to_client(&s).unwrap();
        st.from_client(&ack[..4]).unwrap();
        assert!(!st.idle());
    }

    #[test]
    fn a_reset_stream_is_closed_and_a_goaway_is_never_idle() {
        let (c, ack) = client_bytes();
        let mut st = ConnState::new();
        st.from_client(&c[..c.len() - 109]).unwrap(); // without the DATA frame
        st.to_client(&settings(&[])).unwrap();
        st.from_client(&ack).unwrap();
        assert_eq!(st.open_streams(), 1);
        st.to_client(&frame(RST_STREAM, 0, 1, &8u32.to_be_bytes()))
            .unwrap();
        assert!(st.idle());
        st.to_client(&frame(GOAWAY, 0, 0, &[0; 8])).unwrap();
        assert!(!st.idle());
    }

    #[test]
    fn malformed_input_is_refused() {
        let mut st = ConnState::new();
        assert_eq!(
            st.from_client(b"GET / HTTP/1.1\r\n"),
            Err(StateError::BadPreface)
        );
        let mut st = ConnState::new();
        st.from_client(PREFACE).unwrap();
        assert!(st.from_client(&frame(SETTINGS, 0, 0, &[0; 5])).is_err());
        let mut st = ConnState::new();
        st.from_client(PREFACE).unwrap();
        let over = (MAX_WINDOW - DEFAULT_WINDOW + 1) as u32;
        assert_eq!(
            st.from_client(&frame(WINDOW_UPDATE, 0, 0, &over.to_be_bytes())),
            Err(StateError::Window)
        );
        let mut st = ConnState::new();
        assert_eq!(
            st.to_client(&frame(PUSH_PROMISE, 0x4, 1, &[0, 0, 0, 2])),
            Err(StateError::Push)
        );
    }

    fn idle_state() -> ConnState {
        let (c, ack) = client_bytes();
        let mut st = ConnState::new();
        st.from_client(&c).unwrap();
        st.to_client(&server_bytes()).unwrap();
        st.from_client(&ack).unwrap();
        st
    }

    #[test]
    fn the_carried_form_round_trips_and_only_an_idle_connection_is_carried() {
        let st = idle_state();
        let form = st.encode().unwrap();
        let back = ConnState::decode(&form).unwrap();
        check_after_exchange(&back);
        assert_eq!(back.encode().unwrap(), form);
        let mut busy = ConnState::new();
        busy.from_client(&client_bytes().0).unwrap();
        assert!(busy.encode().is_err());
    }

    #[test]
    fn a_carried_form_that_is_cut_short_or_out_of_range_is_refused() {
        let form = idle_state().encode().unwrap();
        for n in 0..form.len() {
            assert!(ConnState::decode(&form[..n]).is_err(), "cut at {n}");
        }
        let mut trailing = form.clone();
        trailing.push(0);
        assert!(ConnState::decode(&trailing).is_err());
        let mut version = form.clone();
        version[0] = 9;
        assert!(ConnState::decode(&version).is_err());
        let mut even = form.clone();
        even[9..13].copy_from_slice(&2u32.to_be_bytes());
        assert!(ConnState::decode(&even).is_err());
        // One setting, ENABLE_PUSH = 2.
        let mut bad = form[..13].to_vec();
        bad.push(1);
        bad.extend_from_slice(&[0, 2, 0, 0, 0, 2]);
        bad.push(0);
        assert!(ConnState::decode(&bad).is_err());
        // The same identifier twice.
        let mut twice = form[..13].to_vec();
        twice.push(2);
        twice.extend_from_slice(&[0, 3, 0, 0, 0, 1, 0, 3, 0, 0, 0, 2]);
        twice.push(0);
        assert!(ConnState::decode(&twice).is_err());
        let mut flag = form.clone();
        *flag.last_mut().unwrap() = 2;
        assert!(ConnState::decode(&flag).is_err());
    }

    #[test]
    fn whether_the_size_update_is_still_owed_travels_with_the_connection() {
        // A client whose first block after the reset went to the old
        // process owes the new one no size update; expecting one drained
        // healthy connections under load.
        for pending in [false, true] {
            let mut st = idle_state();
            st.set_update_pending(pending);
            let back = ConnState::decode(&st.encode().unwrap()).unwrap();
            assert_eq!(back.update_pending(), pending);
        }
    }

    #[test]
    fn the_synthetic_preface_gives_a_fresh_server_the_client_settings_and_the_send_window() {
        let st = idle_state();
        let preface = st.synthetic_preface().expect("send window above 65,535");
        let mut fresh = ConnState::new();
        fresh.from_client(&preface).unwrap();
        assert_eq!(fresh.send_window(), st.send_window());
        assert_eq!(fresh.client_setting(0x4), Some(1 << 20));
        assert_eq!(fresh.client_setting(0x3), Some(100));
        // A send window below the default cannot be recreated.
        let mut low = ConnState::new();
        low.from_client(PREFACE).unwrap();
        low.from_client(&settings(&[])).unwrap();
        low.to_client(&frame(DATA, 0, 1, &[0; 10])).unwrap();
        assert!(low.synthetic_preface().is_none());
    }
}
