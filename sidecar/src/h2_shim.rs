//! The frame shim of decisions 0060 and 0062: an I/O wrapper under hyper's
//! HTTP/2 server that follows the connection's frames both ways
//! ([`ConnState`]) so an idle connection can move to another process, and
//! that starts a fresh `h2` there as if the connection had just begun.
//!
//! Old process ([`Shim::new`], then [`ShimHandle::start_migration`]): writes
//! SETTINGS{HEADER_TABLE_SIZE=0} at a frame boundary of `h2`'s output, so
//! the client empties its HPACK encoder table (RFC 7541 §4.2, §6.3);
//! swallows the client's ACK of it (`h2` never sent that SETTINGS, and an
//! unexpected ACK is a PROTOCOL_ERROR to it); and reports the safe point
//! ([`Verdict::Move`]): the ACK in, no stream open, `h2`'s writes flushed,
//! `h2` asked to read and got nothing, every byte it got a whole frame.
//! Client frame headers are held back until complete (at most 8 bytes), so
//! `h2` never holds part of one and the swallowed ACK can be cut out;
//! payloads pass as they come.
//!
//! New process ([`Shim::resumed`]): gives the fresh `h2` a synthetic client
//! preface ([`ConnState::synthetic_preface`]: the client's SETTINGS and its
//! send window), drops `h2`'s ACK of that SETTINGS (the client never sent
//! it), acknowledges `h2`'s own SETTINGS to it at once (the client already
//! runs with the same values since the old process sent them; its real ACK
//! is swallowed), lowers `h2`'s connection WINDOW_UPDATE increments by what
//! the client already believes it may send beyond 65,535, and raises
//! HEADER_TABLE_SIZE back to 4,096 so compression resumes.
//!
//! Cost: client bytes pass through without a copy (hyper's buffer is read
//! into directly, frames are cut in place); `h2`'s output is copied once
//! into the shim's buffer, where its frames are rewritten when needed.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::h2_state::{ConnState, DEFAULT_WINDOW, MAX_WINDOW, PREFACE};

const HEADERS: u8 = 0x1;
const SETTINGS: u8 = 0x4;
const WINDOW_UPDATE: u8 = 0x8;
const ACK: u8 = 0x1;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
const HEADER_TABLE_SIZE: u16 = 0x1;
/// What HPACK tables start at (RFC 7541 §6.5.2's default).
const DEFAULT_TABLE_SIZE: u32 = 4096;
/// Past this much of `h2`'s output unwritten, writes wait.
const OUT_HIGH: usize = 64 * 1024;
/// A write buffer this large is given back once emptied.
const OUT_KEEP: usize = 16 * 1024;

/// What a parking connection should do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not at a safe point yet.
    Wait,
    /// At the safe point: take the connection ([`ShimHandle::take`]).
    Move,
    /// It cannot move: GOAWAY and drain, for the reason given.
    Drain(&'static str),
}

/// Whose ACK a server SETTINGS on the wire waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Awaited {
    /// `h2`'s own: the client's ACK goes to it.
    H2,
    /// The shim's (or `h2`'s, already acknowledged to it): swallowed.
    /// `reset`: the HEADER_TABLE_SIZE=0 of a migration, after whose ACK the
    /// client's next header block must start with a size update.
    Shim { reset: bool },
}

/// What a connection moving out leaves: its transport, the client bytes
/// read and not given to `h2`, and its carried state.
pub struct Taken<T> {
    pub io: T,
    pub unread: Vec<u8>,
    pub state: Vec<u8>,
}

struct Core<T> {
    io: Option<T>,
    state: ConnState,
    /// A client frame header read in part (held back until whole).
    head: Vec<u8>,
    /// Preface bytes still to pass (24 on a new connection, 0 resumed).
    preface_left: usize,
    /// Payload bytes of the current client frame still to pass.
    payload_left: usize,
    /// The current client frame's payload offset at which a HEADERS block
    /// starts, when it must start with a size update.
    probe: Option<usize>,
    /// Offset into the current client frame's payload.
    payload_at: usize,
    /// Bytes for `h2` before anything more from the client (synthetic).
    up: Vec<u8>,
    up_at: usize,
    eof: bool,
    /// Stopped following (a frame no peer sends, or a state error): bytes
    /// pass unchanged and the connection cannot move.
    through: bool,
    awaited: VecDeque<Awaited>,
    /// `h2` SETTINGS ACKs to drop (answers to the synthetic SETTINGS).
    drop_acks: u32,
    /// Acknowledge `h2`'s next SETTINGS to it at once (resumed).
    ack_own: bool,
    /// Subtracted from `h2`'s connection WINDOW_UPDATE increments until 0
    /// (negative: added).
    window_adj: i64,
    expect_size_update: bool,
    /// The client's first header block after the reset had no size update.
    ignored_reset: bool,
    /// `h2`'s output not yet a whole frame.
    wpart: Vec<u8>,
    out: Vec<u8>,
    out_at: usize,
    /// A SETTINGS to write at the next frame boundary of `h2`'s output.
    inject: Option<(Vec<u8>, bool)>,
    flushed: bool,
    /// `h2`'s last read found nothing.
    read_idle: bool,
}

/// The I/O object hyper serves; [`ShimHandle`] is the serving task's view.
pub struct Shim<T> {
    core: Arc<Mutex<Core<T>>>,
}

/// The serving task's handle on a [`Shim`] hyper owns.
pub struct ShimHandle<T> {
    core: Arc<Mutex<Core<T>>>,
}

impl<T> Shim<T> {
    /// A connection from its first byte (the client preface).
    pub fn new(io: T) -> (Self, ShimHandle<T>) {
        Self::with(Core::new(io, ConnState::new(), PREFACE.len()))
    }

    /// A moved connection: a fresh `h2` behind a synthetic preface. `None`
    /// when the state cannot be recreated (the caller checks before moving).
    pub fn resumed(io: T, state: ConnState) -> Option<(Self, ShimHandle<T>)> {
        let preface = state.synthetic_preface()?;
        let mut core = Core::new(io, state, 0);
        core.window_adj = core.state.recv_window() - DEFAULT_WINDOW;
        core.up = preface;
        core.drop_acks = 1;
        core.ack_own = true;
        core.inject = Some((
            settings_frame(&[(HEADER_TABLE_SIZE, DEFAULT_TABLE_SIZE)]),
            false,
        ));
        // A client that sent no header block since it acknowledged the
        // reset must start its next one with the size update; one whose
        // encoder ignored the setting (Go's net/http 1.19 does) references
        // its old table instead, which the fresh decoder cannot resolve.
        // Watched so that case is counted, not hidden. A client whose first
        // block after the reset went to the old process (checked there)
        // sends none: expecting it then drained healthy connections.
        core.expect_size_update = core.state.update_pending();
        Some(Self::with(core))
    }

    fn with(core: Core<T>) -> (Self, ShimHandle<T>) {
        let core = Arc::new(Mutex::new(core));
        (Self { core: core.clone() }, ShimHandle { core })
    }
}

fn lock<T>(core: &Mutex<Core<T>>) -> MutexGuard<'_, Core<T>> {
    core.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T: AsyncRead + AsyncWrite + Unpin> ShimHandle<T> {
    /// Asks the client to empty its HPACK encoder table; from here on
    /// [`Self::verdict`] looks for the safe point.
    pub fn start_migration(&self) {
        let mut c = lock(&self.core);
        // A new reset: whatever the last one showed of the encoder, this
        // one is judged on its own.
        c.ignored_reset = false;
        c.expect_size_update = false;
        c.inject = Some((settings_frame(&[(HEADER_TABLE_SIZE, 0)]), true));
    }

    /// Writes what the shim itself has to send while `h2` writes nothing
    /// (the injected SETTINGS) and flushes. Call from the task that polls
    /// the connection.
    pub fn poll_drive(&self, cx: &mut Context<'_>) -> io::Result<()> {
        let mut c = lock(&self.core);
        if c.inject.is_some() && c.wpart.is_empty() {
            c.commit_inject();
        }
        if !c.flushed {
            match c.poll_flush_out(cx) {
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Ready(Ok(())) | Poll::Pending => {}
            }
        }
        Ok(())
    }

    /// Whether the client's first header block after the table reset (or,
    /// resumed, after the move) lacked the size update: its encoder ignored
    /// SETTINGS_HEADER_TABLE_SIZE.
    pub fn ignored_reset(&self) -> bool {
        lock(&self.core).ignored_reset
    }

    /// Where a migration stands (see [`Verdict`]).
    pub fn verdict(&self) -> Verdict {
        lock(&self.core).verdict()
    }

    /// The connection, at a [`Verdict::Move`]; `None` if already taken or
    /// the state will not encode. The `Shim` hyper holds is inert after.
    pub fn take(&self) -> Option<Taken<T>> {
        let mut c = lock(&self.core);
        let pending = c.expect_size_update;
        c.state.set_update_pending(pending);
        let state = c.state.encode().ok()?;
        let io = c.io.take()?;
        Some(Taken {
            io,
            unread: std::mem::take(&mut c.head),
            state,
        })
    }
}

impl<T> Core<T> {
    fn new(io: T, state: ConnState, preface_left: usize) -> Self {
        Self {
            io: Some(io),
            state,
            head: Vec::new(),
            preface_left,
            payload_left: 0,
            probe: None,
            payload_at: 0,
            up: Vec::new(),
            up_at: 0,
            eof: false,
            through: false,
            awaited: VecDeque::new(),
            drop_acks: 0,
            ack_own: false,
            window_adj: 0,
            expect_size_update: false,
            ignored_reset: false,
            wpart: Vec::new(),
            out: Vec::new(),
            out_at: 0,
            inject: None,
            flushed: true,
            read_idle: false,
        }
    }

    fn verdict(&self) -> Verdict {
        if self.through {
            return Verdict::Drain("frames not followed");
        }
        if self.ignored_reset {
            return Verdict::Drain("client encoder ignored the table size");
        }
        let quiet = self.io.is_some()
            && !self.eof
            && self.inject.is_none()
            && self.awaited.is_empty()
            && self.up_at == self.up.len()
            && self.payload_left == 0
            && self.wpart.is_empty()
            && self.out_at == self.out.len()
            && self.flushed
            && self.read_idle
            && self.state.idle();
        if !quiet {
            return Verdict::Wait;
        }
        if self.state.send_window() < DEFAULT_WINDOW {
            return Verdict::Drain("client send window below 65,535");
        }
        Verdict::Move
    }

    // ---- client → h2 ----

    /// Follows `region` (client bytes just read, `head` not included) and
    /// cuts it in place to what `h2` gets: returns the kept length. A frame
    /// header cut short at the end goes to `head`; with `head` non-empty the
    /// caller puts it in front of `region` first.
    fn take_input(&mut self, region: &mut [u8]) -> usize {
        let n = region.len();
        if self.through {
            return n;
        }
        let (mut i, mut w) = (0usize, 0usize);
        while i < n {
            if self.preface_left > 0 {
                let take = self.preface_left.min(n - i);
                self.feed_client(&region[i..i + take]);
                region.copy_within(i..i + take, w);
                (i, w) = (i + take, w + take);
                self.preface_left -= take;
                continue;
            }
            if self.payload_left > 0 {
                let take = self.payload_left.min(n - i);
                if let Some(at) = self.probe
                    && at < self.payload_at + take
                {
                    let b = region[i + (at - self.payload_at)];
                    // 001xxxxx: a dynamic table size update (RFC 7541 §6.3).
                    if b & 0xe0 != 0x20 {
                        self.ignored_reset = true;
                    }
                    self.probe = None;
                }
                self.feed_client(&region[i..i + take]);
                region.copy_within(i..i + take, w);
                (i, w) = (i + take, w + take);
                self.payload_left -= take;
                self.payload_at += take;
                if self.payload_left == 0 && self.probe.take().is_some() {
                    // The block started beyond this frame: not followed.
                    self.ignored_reset = true;
                }
                continue;
            }
            if n - i < 9 {
                self.head.extend_from_slice(&region[i..n]);
                break;
            }
            let h: [u8; 9] = region[i..i + 9].try_into().expect("nine bytes");
            let len = frame_len(&h);
            let (kind, flags) = (h[3], h[4]);
            self.feed_client(&h);
            let mut keep = true;
            if kind == SETTINGS && flags & ACK != 0 {
                match self.awaited.pop_front() {
                    Some(Awaited::Shim { reset }) => {
                        keep = false;
                        self.expect_size_update |= reset;
                    }
                    Some(Awaited::H2) | None => {}
                }
            } else if kind == HEADERS && self.expect_size_update {
                self.expect_size_update = false;
                let mut at = 0;
                if flags & PADDED != 0 {
                    at += 1;
                }
                if flags & PRIORITY != 0 {
                    at += 5;
                }
                self.probe = Some(at);
                if at >= len {
                    self.probe = None;
                    self.ignored_reset = true;
                }
            }
            if keep {
                region.copy_within(i..i + 9, w);
                w += 9;
            }
            i += 9;
            self.payload_left = len;
            self.payload_at = 0;
        }
        w
    }

    fn feed_client(&mut self, bytes: &[u8]) {
        if self.state.from_client(bytes).is_err() {
            self.through = true;
        }
    }
}

impl<T: AsyncRead + Unpin> Core<T> {
    fn poll_read_into(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if self.up_at < self.up.len() {
                let n = (self.up.len() - self.up_at).min(buf.remaining());
                buf.put_slice(&self.up[self.up_at..self.up_at + n]);
                self.up_at += n;
                if self.up_at == self.up.len() {
                    self.up.clear();
                    self.up_at = 0;
                }
                self.read_idle = false;
                return Poll::Ready(Ok(()));
            }
            if self.eof {
                return Poll::Ready(Ok(()));
            }
            let Some(io) = self.io.as_mut() else {
                // Taken: the connection lives elsewhere now.
                return Poll::Pending;
            };
            let start = buf.filled().len();
            // A held-back header goes first; it is short (< 9 bytes), and
            // a buffer that cannot take it plus more reads into `up`.
            if buf.remaining() < 64 {
                let mut tmp = [0u8; 64];
                let mut rb = ReadBuf::new(&mut tmp);
                match Pin::new(io).poll_read(cx, &mut rb) {
                    Poll::Pending => {
                        self.read_idle = true;
                        return Poll::Pending;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Ready(Ok(())) => {}
                }
                let got = rb.filled().len();
                let mut region = std::mem::take(&mut self.head);
                region.extend_from_slice(&tmp[..got]);
                if got == 0 {
                    self.eof = true;
                    self.up.extend_from_slice(&region);
                    continue;
                }
                let keep = self.take_input(&mut region);
                self.up.extend_from_slice(&region[..keep]);
                continue;
            }
            let held = std::mem::take(&mut self.head);
            buf.put_slice(&held);
            let r = Pin::new(io).poll_read(cx, buf);
            match r {
                Poll::Pending => {
                    // Nothing new: the held bytes stay held.
                    buf.set_filled(start);
                    self.head = held;
                    self.read_idle = true;
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => {
                    buf.set_filled(start);
                    self.head = held;
                    return Poll::Ready(Err(e));
                }
                Poll::Ready(Ok(())) => {}
            }
            let end = buf.filled().len();
            if end == start + held.len() {
                // End of stream: whatever was held goes to `h2` as is.
                self.eof = true;
                if end == start {
                    return Poll::Ready(Ok(()));
                }
                self.read_idle = false;
                return Poll::Ready(Ok(()));
            }
            // The held header was not followed yet: it is, with the rest.
            let keep = self.take_input(&mut buf.filled_mut()[start..end]);
            buf.set_filled(start + keep);
            if keep > 0 {
                self.read_idle = false;
                return Poll::Ready(Ok(()));
            }
            // All of it held back or swallowed: read again.
        }
    }
}

impl<T> Core<T> {
    // ---- h2 → client ----

    /// Takes `h2`'s bytes: whole frames are committed (rewritten where the
    /// shim must), a partial one waits in `wpart`.
    fn take_output(&mut self, buf: &[u8]) {
        if self.through {
            self.commit(buf);
            return;
        }
        self.wpart.extend_from_slice(buf);
        let mut part = std::mem::take(&mut self.wpart);
        let mut at = 0;
        while part.len() - at >= 9 {
            let h: [u8; 9] = part[at..at + 9].try_into().expect("nine bytes");
            let len = frame_len(&h);
            if part.len() - at < 9 + len {
                break;
            }
            self.output_frame(&part[at..at + 9 + len]);
            at += 9 + len;
        }
        part.drain(..at);
        self.wpart = part;
        if self.wpart.is_empty() && self.inject.is_some() {
            self.commit_inject();
        }
    }

    fn output_frame(&mut self, f: &[u8]) {
        let (kind, flags) = (f[3], f[4]);
        let stream = u32::from_be_bytes([f[5], f[6], f[7], f[8]]) & 0x7fff_ffff;
        match kind {
            SETTINGS if flags & ACK != 0 && self.drop_acks > 0 => {
                self.drop_acks -= 1;
                return;
            }
            SETTINGS if flags & ACK != 0 => {}
            SETTINGS => {
                if self.ack_own {
                    self.ack_own = false;
                    // The client runs with these already; `h2` applies them
                    // now, and the client's ACK is ours.
                    self.up
                        .extend_from_slice(&[0, 0, 0, SETTINGS, ACK, 0, 0, 0, 0]);
                    self.awaited.push_back(Awaited::Shim { reset: false });
                } else {
                    self.awaited.push_back(Awaited::H2);
                }
            }
            WINDOW_UPDATE if stream == 0 && self.window_adj != 0 && f.len() == 13 => {
                let inc = i64::from(u32::from_be_bytes([f[9], f[10], f[11], f[12]]) & 0x7fff_ffff);
                let new = (inc - self.window_adj).clamp(0, MAX_WINDOW);
                self.window_adj -= inc - new;
                if new == 0 {
                    return;
                }
                let mut g = f.to_vec();
                g[9..13].copy_from_slice(&(new as u32).to_be_bytes());
                self.commit(&g);
                return;
            }
            _ => {}
        }
        self.commit(f);
    }

    fn commit_inject(&mut self) {
        if let Some((frame, reset)) = self.inject.take() {
            self.awaited.push_back(Awaited::Shim { reset });
            self.commit(&frame);
        }
    }

    fn commit(&mut self, bytes: &[u8]) {
        if !self.through && self.state.to_client(bytes).is_err() {
            self.through = true;
        }
        self.out.extend_from_slice(bytes);
        self.flushed = false;
    }
}

impl<T: AsyncWrite + Unpin> Core<T> {
    /// Writes the buffered output; `Ready(Ok)` once it is all written.
    fn poll_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Some(io) = self.io.as_mut() else {
            return Poll::Ready(Err(io::ErrorKind::NotConnected.into()));
        };
        while self.out_at < self.out.len() {
            match Pin::new(&mut *io).poll_write(cx, &self.out[self.out_at..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => self.out_at += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        self.out_at = 0;
        if self.out.capacity() > OUT_KEEP {
            self.out = Vec::new();
        } else {
            self.out.clear();
        }
        Poll::Ready(Ok(()))
    }

    fn poll_flush_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.wpart.is_empty() && self.inject.is_some() {
            self.commit_inject();
        }
        std::task::ready!(self.poll_out(cx))?;
        let Some(io) = self.io.as_mut() else {
            return Poll::Ready(Err(io::ErrorKind::NotConnected.into()));
        };
        std::task::ready!(Pin::new(io).poll_flush(cx))?;
        self.flushed = true;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for Shim<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        lock(&self.core).poll_read_into(cx, buf)
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Shim<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut c = lock(&self.core);
        if c.out.len() - c.out_at >= OUT_HIGH {
            if let Poll::Ready(Err(e)) = c.poll_out(cx) {
                return Poll::Ready(Err(e));
            }
            if c.out.len() - c.out_at >= OUT_HIGH {
                return Poll::Pending;
            }
        }
        c.take_output(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        lock(&self.core).poll_flush_out(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut c = lock(&self.core);
        std::task::ready!(c.poll_flush_out(cx))?;
        match c.io.as_mut() {
            Some(io) => Pin::new(io).poll_shutdown(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}

fn frame_len(h: &[u8; 9]) -> usize {
    (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2])
}

fn settings_frame(pairs: &[(u16, u32)]) -> Vec<u8> {
    let len = pairs.len() * 6;
    let mut f = vec![
        (len >> 16) as u8,
        (len >> 8) as u8,
        len as u8,
        SETTINGS,
        0,
        0,
        0,
        0,
        0,
    ];
    for (id, v) in pairs {
        f.extend_from_slice(&id.to_be_bytes());
        f.extend_from_slice(&v.to_be_bytes());
    }
    f
}

#[cfg(test)]
mod tests {
    //! A scripted client (raw frames on an in-memory pipe) against hyper's
    //! HTTP/2 server behind the shim: the old side's round trip and safe
    //! point, the new side's synthetic start, and the fallbacks.

    use std::convert::Infallible;
    use std::time::{Duration, Instant};

    use bytes::Bytes;
    use http_body_util::Full;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;
    use crate::http_conn::{Migration, migrate};

    const DATA: u8 = 0x0;
    const GOAWAY: u8 = 0x7;
    const END_STREAM: u8 = 0x1;
    const END_HEADERS: u8 = 0x4;
    /// hyper's server connection window (its default).
    const CONN_WINDOW: i64 = 1024 * 1024;
    /// GET http://localhost/, `:authority` inserted into the dynamic table.
    const REQUEST: &[u8] = &[
        0x82, 0x86, 0x84, 0x41, 9, b'l', b'o', b'c', b'a', b'l', b'h', b'o', b's', b't',
    ];

    #[derive(Debug)]
    struct Frame {
        kind: u8,
        flags: u8,
        stream: u32,
        payload: Vec<u8>,
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// The next frame, `None` at end of stream.
    async fn read_frame(io: &mut DuplexStream) -> Option<Frame> {
        let mut h = [0u8; 9];
        io.read_exact(&mut h).await.ok()?;
        let mut payload = vec![0u8; frame_len(&h)];
        io.read_exact(&mut payload).await.ok()?;
        Some(Frame {
            kind: h[3],
            flags: h[4],
            stream: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff,
            payload,
        })
    }

    /// What the client saw of the server, frame by frame.
    #[derive(Default)]
    struct Seen {
        settings: Vec<Vec<u8>>,
        acks: usize,
        goaways: usize,
        window_increments: i64,
    }

    impl Seen {
        /// Reads until `until` says stop; SETTINGS are acknowledged as they
        /// come unless `ack` is false.
        async fn read_until(
            &mut self,
            io: &mut DuplexStream,
            ack: bool,
            mut until: impl FnMut(&Frame) -> bool,
        ) {
            loop {
                let f = read_frame(io).await.expect("a frame");
                match f.kind {
                    SETTINGS if f.flags & ACK != 0 => self.acks += 1,
                    SETTINGS => {
                        self.settings.push(f.payload.clone());
                        if ack {
                            io.write_all(&frame(SETTINGS, ACK, 0, &[])).await.unwrap();
                        }
                    }
                    GOAWAY => self.goaways += 1,
                    WINDOW_UPDATE if f.stream == 0 => {
                        self.window_increments +=
                            i64::from(u32::from_be_bytes(f.payload[..4].try_into().unwrap()));
                    }
                    _ => {}
                }
                if until(&f) {
                    return;
                }
            }
        }
    }

    fn ends_response(stream: u32) -> impl FnMut(&Frame) -> bool {
        move |f| f.stream == stream && matches!(f.kind, DATA | HEADERS) && f.flags & END_STREAM != 0
    }

    type Conn = Pin<Box<dyn Future<Output = Result<(), hyper::Error>> + Send>>;

    fn serve(shim: Shim<DuplexStream>) -> Conn {
        let svc = hyper::service::service_fn(|_req| async {
            Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(b"ok"))))
        });
        Box::pin(
            hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(shim), svc),
        )
    }

    use std::future::Future;

    /// Runs a migration of `conn` to its end (deadline `within` from now).
    fn migrate_in_task(
        mut conn: Conn,
        handle: ShimHandle<DuplexStream>,
        within: Duration,
    ) -> tokio::task::JoinHandle<(Migration, Option<Taken<DuplexStream>>, Conn)> {
        tokio::spawn(async move {
            let (_drain_tx, mut drain) = tokio::sync::watch::channel(false);
            let m = migrate(
                conn.as_mut(),
                &handle,
                &mut drain,
                Some(Instant::now() + within),
            )
            .await;
            let taken = matches!(m, Migration::Move)
                .then(|| handle.take())
                .flatten();
            (m, taken, conn)
        })
    }

    /// A client that made one request on a fresh connection through the
    /// shim; the server side is returned not yet polled further.
    async fn one_request() -> (DuplexStream, Conn, ShimHandle<DuplexStream>, Seen) {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let (shim, handle) = Shim::new(server);
        let mut conn = serve(shim);
        let mut seen = Seen::default();
        let mut start = PREFACE.to_vec();
        start.extend(frame(SETTINGS, 0, 0, &[]));
        // As real clients do: a connection window beyond the default.
        start.extend(frame(WINDOW_UPDATE, 0, 0, &(1u32 << 20).to_be_bytes()));
        start.extend(frame(HEADERS, END_STREAM | END_HEADERS, 1, REQUEST));
        client.write_all(&start).await.unwrap();
        // The server runs in the background only while the client reads.
        let client_side = async {
            seen.read_until(&mut client, true, ends_response(1)).await;
        };
        tokio::select! {
            _ = client_side => {}
            r = conn.as_mut() => panic!("the connection ended: {r:?}"),
        }
        (client, conn, handle, seen)
    }

    #[tokio::test]
    async fn an_idle_connection_moves_after_the_table_reset_and_a_fresh_server_continues_it() {
        let (mut client, conn, handle, mut seen) = one_request().await;
        let task = migrate_in_task(conn, handle, Duration::from_secs(30));
        // The shim asks for an empty table; the client acknowledges.
        seen.read_until(&mut client, true, |f| {
            f.kind == SETTINGS && f.flags & ACK == 0 && f.payload == [0, 1, 0, 0, 0, 0]
        })
        .await;
        let (m, taken, conn) = task.await.unwrap();
        assert!(matches!(m, Migration::Move), "{}", describe(&m));
        drop(conn);
        let taken = taken.expect("taken at the safe point");
        assert!(taken.unread.is_empty());
        assert_eq!(seen.goaways, 0);
        let state = ConnState::decode(&taken.state).unwrap();
        assert_eq!(state.highest_client_stream(), 1);

        // The new process: a fresh hyper behind the synthetic preface.
        let (shim, _handle) = Shim::resumed(taken.io, state).expect("recreatable");
        let mut conn = serve(shim);
        let acks_before = seen.acks;
        // After the ACK of the reset, the client's block starts with a size
        // update to 0; stream 3 is new to the fresh server.
        let mut block = vec![0x20];
        block.extend_from_slice(REQUEST);
        client
            .write_all(&frame(HEADERS, END_STREAM | END_HEADERS, 3, &block))
            .await
            .unwrap();
        let client_side = async {
            seen.read_until(&mut client, true, ends_response(3)).await;
        };
        tokio::select! {
            _ = client_side => {}
            r = conn.as_mut() => panic!("the resumed connection ended: {r:?}"),
        }
        // The client got the raise back to 4096 and the fresh server's
        // SETTINGS, and never an ACK of a SETTINGS it did not send.
        assert!(seen.settings.iter().any(|s| s == &[0, 1, 0, 0, 0x10, 0]));
        assert_eq!(seen.acks, acks_before, "no ACK for the synthetic SETTINGS");
        assert_eq!(seen.goaways, 0);
        // Both ends agree on what the client may send: the fresh server's
        // window update was lowered by what the first one had granted.
        assert_eq!(DEFAULT_WINDOW + seen.window_increments, CONN_WINDOW);
        // Nothing but the exchange: the client closes and the server ends
        // without a GOAWAY.
        drop(client);
        let _ = conn.await;
    }

    fn describe(m: &Migration) -> String {
        match m {
            Migration::Ended(r) => format!("ended: {r:?}"),
            Migration::Move => "move".into(),
            Migration::Drain(reason) => format!("drain: {reason}"),
        }
    }

    #[tokio::test]
    async fn a_client_whose_next_block_has_no_size_update_is_drained() {
        let (mut client, conn, handle, mut seen) = one_request().await;
        let task = migrate_in_task(conn, handle, Duration::from_secs(30));
        seen.read_until(&mut client, false, |f| {
            f.kind == SETTINGS && f.flags & ACK == 0 && f.payload == [0, 1, 0, 0, 0, 0]
        })
        .await;
        // The ACK and a block that does not start with the update, in one
        // write: the shim sees both before any safe point.
        let mut w = frame(SETTINGS, ACK, 0, &[]);
        w.extend(frame(HEADERS, END_STREAM | END_HEADERS, 3, REQUEST));
        client.write_all(&w).await.unwrap();
        let (m, taken, _conn) = task.await.unwrap();
        assert!(
            matches!(m, Migration::Drain(r) if r.contains("table size")),
            "{}",
            describe(&m)
        );
        assert!(taken.is_none());
    }

    #[tokio::test]
    async fn a_stream_open_past_the_deadline_drains() {
        let (mut client, conn, handle, _seen) = one_request().await;
        // A request whose body never ends.
        client
            .write_all(&frame(HEADERS, END_HEADERS, 3, &[0x83, 0x86, 0x84]))
            .await
            .unwrap();
        let task = migrate_in_task(conn, handle, Duration::ZERO);
        let (m, taken, _conn) = task.await.unwrap();
        assert!(matches!(m, Migration::Drain(_)), "{}", describe(&m));
        assert!(taken.is_none());
    }

    #[test]
    fn a_header_cut_anywhere_is_held_back_whole_and_the_ack_of_ours_is_cut_out() {
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(SETTINGS, 0, 0, &[]));
        bytes.extend(frame(SETTINGS, ACK, 0, &[]));
        bytes.extend(frame(
            HEADERS,
            END_STREAM | END_HEADERS,
            1,
            &[0x20, 0x82, 0x86, 0x84],
        ));
        let mut want = PREFACE.to_vec();
        want.extend(frame(SETTINGS, 0, 0, &[]));
        want.extend(frame(
            HEADERS,
            END_STREAM | END_HEADERS,
            1,
            &[0x20, 0x82, 0x86, 0x84],
        ));
        for cut in 0..=bytes.len() {
            let mut core = Core::new((), ConnState::new(), PREFACE.len());
            core.awaited.push_back(Awaited::Shim { reset: true });
            core.state.to_client(&frame(SETTINGS, 0, 0, &[])).unwrap();
            let mut got = Vec::new();
            for part in [&bytes[..cut], &bytes[cut..]] {
                let mut region = std::mem::take(&mut core.head);
                region.extend_from_slice(part);
                let keep = core.take_input(&mut region);
                got.extend_from_slice(&region[..keep]);
            }
            assert_eq!(got, want, "cut at {cut}");
            assert!(core.head.is_empty() && !core.ignored_reset && !core.through);
        }
    }
}
