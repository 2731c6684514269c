//! The HTTP/1 request framing shadow (pure): finds each request head's end
//! in the raw downstream bytes, validates it ([`crate::h1valid::validate`]),
//! and skips each body exactly as hyper's decoder does, so it finds the next
//! head where hyper does. The sidecar's `FramingGuard` (in `conn`) puts it on
//! the read path of the general HTTP/1.1 path; the fast path uses
//! [`ChunkedEnd`] to find where a chunked response body ends.

use crate::h1valid::Refusal;

/// Where the framing shadow is in the request stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    /// Reading a request head (leading empty lines are skipped, as httparse
    /// does).
    Head,
    /// Inside a body of known length: bytes left.
    Fixed(u64),
    /// Inside a chunked body, in hyper's decoder states (strict CRLF).
    Chunk(ChunkState),
    /// Stopped following: after an upgrade/CONNECT head (the response decides
    /// what the next bytes are), or on anything hyper itself refuses (it then
    /// answers 400/431 and closes, so nothing later needs checking).
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    Start,
    Size(u64),
    Lws(u64),
    Ext(u64),
    SizeLf(u64),
    Data(u64),
    DataCr,
    DataLf,
    EndCr,
    Trailer,
    TrailerLf,
    EndLf,
}

/// What a request head says about the bytes after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeadScan {
    Next(Frame),
    /// The head fails [`crate::h1valid::validate`].
    Refuse(Refusal),
    /// As `Next`, but the client waits for `100 Continue` before it sends
    /// the body: its head cannot wait for the first chunk-size line.
    AwaitsContinue(Frame),
}

/// What [`H1Framing::feed`] found in a chunk of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FramingVerdict {
    /// Nothing to refuse. Every byte fed so far may go to the HTTP parser
    /// except the last [`H1Framing::withheld`] ones: the start of a head not
    /// yet complete, so not yet validated.
    Pass,
    /// Request number `index` (0-based on this connection) is refused for
    /// `why`. Its head is the `head_len` bytes (counted across reads) ending
    /// after the first `end` bytes of this chunk; none of it, nor anything
    /// after it, may reach the parser.
    Refuse {
        index: u64,
        why: Refusal,
        end: usize,
        head_len: usize,
    },
}

/// A shadow of HTTP/1 request framing over the raw downstream bytes.
///
/// hyper parses a head before the service sees it and keeps no trace of
/// what it resolved on its own (both `Content-Length` and
/// `Transfer-Encoding`, duplicate `Host` lines, a fragment), so the service
/// cannot refuse what RFC 9112 says to refuse. This shadow sees the raw
/// heads: it finds each head's end, runs [`crate::h1valid::validate`] on it
/// (the same check as the fast path's), reads the framing headers, and skips
/// each body exactly as hyper's decoder does, so it finds the next head where
/// hyper does. It only ever *adds* a refusal: wherever it could disagree with
/// hyper about framing it stops following and hyper's own handling stands.
#[derive(Debug)]
pub struct H1Framing {
    frame: Frame,
    /// Heads completed so far (= the index of the head being read).
    heads: u64,
    /// A head split across reads, collected until its end arrives.
    partial: Vec<u8>,
    /// While a chunked request's first chunk-size line is read: the bytes of
    /// its head and of that line so far, withheld until the line is valid
    /// (0 otherwise).
    gate: usize,
    max_head: usize,
}

impl H1Framing {
    /// `max_head`: the largest head hyper accepts (its `max_header_size`);
    /// beyond it hyper answers 431 and this stops following.
    pub fn new(max_head: usize) -> Self {
        Self {
            frame: Frame::Head,
            heads: 0,
            partial: Vec::new(),
            gate: 0,
            max_head,
        }
    }

    /// Whether it still follows the stream.
    pub fn following(&self) -> bool {
        self.frame != Frame::Off
    }

    /// Account for `data`, the next bytes read from the client.
    pub fn feed(&mut self, data: &[u8]) -> FramingVerdict {
        let mut at = 0;
        while at < data.len() {
            match self.frame {
                Frame::Off => break,
                Frame::Head => match self.head(data, at) {
                    Some((end, head_len, HeadScan::Refuse(why))) => {
                        self.frame = Frame::Off;
                        return FramingVerdict::Refuse {
                            index: self.heads,
                            why,
                            end,
                            head_len,
                        };
                    }
                    Some((end, head_len, HeadScan::Next(frame))) => {
                        if let Frame::Chunk(_) = frame {
                            self.gate = head_len;
                        }
                        self.heads += 1;
                        self.frame = frame;
                        at = end;
                    }
                    Some((end, _, HeadScan::AwaitsContinue(frame))) => {
                        self.heads += 1;
                        self.frame = frame;
                        at = end;
                    }
                    None => break,
                },
                Frame::Fixed(left) => {
                    let n = left.min((data.len() - at) as u64);
                    at += n as usize;
                    self.frame = if n == left {
                        Frame::Head
                    } else {
                        Frame::Fixed(left - n)
                    };
                }
                Frame::Chunk(ChunkState::Data(left)) => {
                    let n = left.min((data.len() - at) as u64);
                    at += n as usize;
                    self.frame = Frame::Chunk(if n == left {
                        ChunkState::DataCr
                    } else {
                        ChunkState::Data(left - n)
                    });
                }
                Frame::Chunk(state) => {
                    let next = chunk_step(state, data[at]);
                    at += 1;
                    if self.gate > 0 {
                        use ChunkState::*;
                        match next {
                            Frame::Off => {
                                // Refused before its head left: the request
                                // is the last head counted.
                                let head_len = self.gate + 1;
                                self.gate = 0;
                                self.frame = Frame::Off;
                                return FramingVerdict::Refuse {
                                    index: self.heads - 1,
                                    why: Refusal::ChunkSize,
                                    end: at,
                                    head_len,
                                };
                            }
                            Frame::Chunk(Start | Size(_) | Lws(_) | Ext(_) | SizeLf(_))
                                if self.gate <= self.max_head =>
                            {
                                self.gate += 1;
                            }
                            // The line is complete (or too long to hold:
                            // hyper's decoder judges it).
                            _ => self.gate = 0,
                        }
                    }
                    self.frame = next;
                }
            }
        }
        FramingVerdict::Pass
    }

    /// Bytes fed so far that belong to a head not yet complete: they may not
    /// reach the parser until the head is whole and validated.
    pub fn withheld(&self) -> usize {
        if self.partial.is_empty() {
            self.gate
        } else {
            self.partial.len()
        }
    }

    /// Look for the end of the current head in `data[at..]`: the index in
    /// `data` just past it, the head's length (across reads) and what it
    /// says, or `None` when more bytes are needed (what was read of the head
    /// is kept in `partial`).
    fn head(&mut self, data: &[u8], mut at: usize) -> Option<(usize, usize, HeadScan)> {
        if self.partial.is_empty() {
            while at < data.len() && matches!(data[at], b'\r' | b'\n') {
                at += 1;
            }
            if at == data.len() {
                return None;
            }
            // Common case: the whole head is in this read; nothing is copied.
            match head_end(&data[at..]) {
                HeadEnd::Complete(end) => {
                    return Some((at + end, end, self.judge(&data[at..at + end])));
                }
                HeadEnd::BareCr(end) => return Some((at + end, end, self.bare_cr(end))),
                HeadEnd::Partial => {}
            }
        }
        let already = self.partial.len();
        // The end marker (at most 3 bytes) may straddle the previous read.
        let from = already.saturating_sub(2);
        self.partial.extend_from_slice(&data[at..]);
        let found = match head_end(&self.partial[from..]) {
            HeadEnd::Complete(end) => Some((from + end, false)),
            HeadEnd::BareCr(end) => Some((from + end, true)),
            HeadEnd::Partial => None,
        };
        match found {
            Some((end, bare_cr)) => {
                let scan = if bare_cr {
                    self.bare_cr(end)
                } else {
                    self.judge(&self.partial[..end])
                };
                self.partial = Vec::new();
                Some((at + end - already, end, scan))
            }
            None => {
                if self.partial.len() > self.max_head {
                    // hyper answers 431: it gets the bytes.
                    self.partial = Vec::new();
                    self.frame = Frame::Off;
                }
                None
            }
        }
    }
}

impl H1Framing {
    /// A head cut short by a bare CR at `end`: refused, unless it is already
    /// longer than hyper accepts (then hyper answers 431, as [`Self::judge`]
    /// decides for a complete head), so the verdict does not depend on how
    /// the bytes were split into reads.
    fn bare_cr(&self, end: usize) -> HeadScan {
        if end > self.max_head {
            HeadScan::Next(Frame::Off)
        } else {
            HeadScan::Refuse(Refusal::BareCr)
        }
    }

    /// A head longer than hyper accepts gets 431 from hyper: stop following
    /// (the same whether it arrived in one read or several). Any other head
    /// is validated, then its framing read.
    fn judge(&self, head: &[u8]) -> HeadScan {
        if head.len() > self.max_head {
            return HeadScan::Next(Frame::Off);
        }
        match crate::h1valid::validate(head) {
            Err(why) => HeadScan::Refuse(why),
            Ok(accepted) => scan_head(head, accepted.upgrade == crate::h1valid::Upgrade::WebSocket),
        }
    }
}

/// Where the head at the start of a buffer ends, as far as its bytes say.
#[derive(Debug, PartialEq, Eq)]
enum HeadEnd {
    /// The head's length (request line, header lines and the empty line).
    Complete(usize),
    /// A line starts with a CR that no LF follows: the head can never be
    /// valid (httparse, hence hyper, fails on it at once), and without this
    /// the client would wait for a head end that never comes. Refused up to
    /// and including the byte after that CR.
    BareCr(usize),
    /// More bytes are needed.
    Partial,
}

/// Find the end of the head at the start of `buf` (LF or CRLF line ends, as
/// httparse accepts).
fn head_end(buf: &[u8]) -> HeadEnd {
    let mut from = 0;
    while let Some(i) = buf[from..].iter().position(|b| *b == b'\n') {
        let i = from + i;
        match buf.get(i + 1..) {
            Some([b'\n', ..]) => return HeadEnd::Complete(i + 2),
            Some([b'\r', b'\n', ..]) => return HeadEnd::Complete(i + 3),
            Some([b'\r', _, ..]) => return HeadEnd::BareCr(i + 3),
            _ => from = i + 1,
        }
    }
    HeadEnd::Partial
}

/// Read the framing of one complete, validated head (so: no obs-fold, no
/// conflicting or repeated lengths, at most one `chunked`). `relayed_upgrade`:
/// after it the response decides what the next bytes are.
fn scan_head(head: &[u8], relayed_upgrade: bool) -> HeadScan {
    if relayed_upgrade {
        return HeadScan::Next(Frame::Off);
    }
    let lines = head
        .split(|b| *b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .skip_while(|l| l.is_empty())
        .skip(1);
    let mut te = false;
    let mut expect = false;
    let mut length: Option<u64> = None;
    for line in lines.filter(|l| !l.is_empty()) {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            return HeadScan::Next(Frame::Off);
        };
        let name = &line[..colon];
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            te = true;
        } else if name.eq_ignore_ascii_case(b"content-length") {
            length = crate::h1valid::parse_length(&line[colon + 1..]);
        } else if name.eq_ignore_ascii_case(b"expect") {
            expect = true;
        }
    }
    let body = if te {
        Frame::Chunk(ChunkState::Start)
    } else {
        match length.unwrap_or(0) {
            0 => Frame::Head,
            n => Frame::Fixed(n),
        }
    };
    if expect {
        return HeadScan::AwaitsContinue(body);
    }
    HeadScan::Next(body)
}

/// Finds where a chunked body ends, in hyper's decoder states (strict
/// CRLF), without decoding it: the HTTP/1 fast path forwards response
/// bodies as they are. Counts the chunk data it passed (the access log's
/// byte count, as a decoder would see it).
#[derive(Debug)]
pub struct ChunkedEnd(ChunkState, u64);

impl Default for ChunkedEnd {
    fn default() -> Self {
        Self(ChunkState::Start, 0)
    }
}

/// A chunked body hyper's decoder would refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed chunked body")]
pub struct MalformedChunk;

impl ChunkedEnd {
    /// Consume `data`: `Ok(Some(n))` when the body ends after its first `n`
    /// bytes (the scan then starts over), `Err` for a malformed body.
    pub fn feed(&mut self, data: &[u8]) -> Result<Option<usize>, MalformedChunk> {
        let mut at = 0;
        while at < data.len() {
            if let ChunkState::Data(left) = self.0 {
                let n = left.min((data.len() - at) as u64);
                at += n as usize;
                self.1 += n;
                self.0 = if n == left {
                    ChunkState::DataCr
                } else {
                    ChunkState::Data(left - n)
                };
                continue;
            }
            match chunk_step(self.0, data[at]) {
                Frame::Chunk(next) => self.0 = next,
                Frame::Head => {
                    self.0 = ChunkState::Start;
                    return Ok(Some(at + 1));
                }
                Frame::Fixed(_) | Frame::Off => return Err(MalformedChunk),
            }
            at += 1;
        }
        Ok(None)
    }

    /// Chunk data bytes passed so far.
    pub fn data_bytes(&self) -> u64 {
        self.1
    }
}

/// One byte of chunked framing outside chunk data, as hyper's decoder reads
/// it; anything hyper would reject stops the shadow.
fn chunk_step(state: ChunkState, b: u8) -> Frame {
    use ChunkState::*;
    let hex = (b as char).to_digit(16).map(u64::from);
    let next = match (state, b) {
        (Start, _) => hex.map(Size),
        (Size(n), _) if hex.is_some() => n
            .checked_mul(16)
            .and_then(|n| n.checked_add(hex.unwrap_or(0)))
            .map(Size),
        (Size(n) | Lws(n), b' ' | b'\t') => Some(Lws(n)),
        (Size(n) | Lws(n), b';') => Some(Ext(n)),
        (Size(n) | Lws(n) | Ext(n), b'\r') => Some(SizeLf(n)),
        (Ext(_), b'\n') => None,
        (Ext(n), _) => Some(Ext(n)),
        (SizeLf(0), b'\n') => Some(EndCr),
        (SizeLf(n), b'\n') => Some(Data(n)),
        (DataCr, b'\r') => Some(DataLf),
        (DataLf, b'\n') => Some(Start),
        (EndCr, b'\r') => Some(EndLf),
        (Trailer, b'\r') => Some(TrailerLf),
        (EndCr | Trailer, _) => Some(Trailer),
        (TrailerLf, b'\n') => Some(EndCr),
        (EndLf, b'\n') => return Frame::Head,
        _ => None,
    };
    next.map_or(Frame::Off, Frame::Chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `stream` in pieces of `step` bytes; the refusal as (request
    /// index, absolute end of the refused head), and the heads completed.
    fn shadow(stream: &[u8], step: usize) -> (Option<(u64, usize)>, u64) {
        let mut f = H1Framing::new(8192);
        let mut offset = 0;
        for piece in stream.chunks(step) {
            if let FramingVerdict::Refuse { index, end, .. } = f.feed(piece) {
                assert!(
                    end > 0,
                    "a refusal always ends in the chunk that completes the head"
                );
                return (Some((index, offset + end)), f.heads);
            }
            offset += piece.len();
        }
        (None, f.heads)
    }

    /// Every split of the stream gives the same answer as one read.
    fn shadow_any_split(stream: &[u8]) -> (Option<(u64, usize)>, u64) {
        let whole = shadow(stream, stream.len().max(1));
        for step in 1..stream.len().min(40) {
            assert_eq!(shadow(stream, step), whole, "split every {step} bytes");
        }
        whole
    }

    #[test]
    fn framing_shadow_refuses_content_length_with_transfer_encoding_in_either_order() {
        let first = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n";
        let cl_te = b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n";
        let smuggled = b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
        let mut stream = first.to_vec();
        stream.extend_from_slice(cl_te);
        stream.extend_from_slice(smuggled);
        assert_eq!(
            shadow_any_split(&stream),
            (Some((1, first.len() + cl_te.len())), 1)
        );
        let te_cl =
            b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: x\r\n\r\n0\r\n\r\n";
        assert_eq!(shadow_any_split(te_cl), (Some((0, te_cl.len() - 5)), 0));
    }

    #[test]
    fn framing_shadow_skips_bodies_as_hyper_frames_them() {
        // Bodies that look like heads are data, not requests.
        let fake = "\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        let fixed = format!(
            "POST /f HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{fake}",
            fake.len()
        );
        let chunked = format!(
            "POST /c HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n\n{:x} ;ext=1\r\n{fake}\r\n0\r\nX-Trailer: y\r\n\r\n",
            fake.len()
        );
        let stream = format!(
            "\r\n{fixed}{chunked}GET /last HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
        );
        assert_eq!(shadow_any_split(stream.as_bytes()), (None, 3));
        // ...and a conflict after them is found at the right request.
        let stream = format!(
            "{fixed}{chunked}POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n"
        );
        assert_eq!(
            shadow_any_split(stream.as_bytes()),
            (Some((2, stream.len())), 2)
        );
    }

    #[test]
    fn framing_shadow_refuses_a_line_that_starts_with_a_bare_cr_without_waiting() {
        // No LF ever follows the CR, so the head has no end: without the
        // refusal the client would wait out the head timeout.
        for stream in [
            &b"GET / HTTP/1.1\r\nHost: a\r\n\r\r\n"[..],
            b"GET / HTTP/1.1\r\nHost: a\r\n\rX-A: 1\r\n\r\n",
            b"GET / HTTP/1.1\nHost: a\n\r\r",
        ] {
            let (refused, heads) = shadow_any_split(stream);
            let (index, end) = refused.unwrap_or_else(|| panic!("{stream:?} not refused"));
            assert_eq!((index, heads), (0, 0), "{stream:?}");
            assert!(end <= stream.len(), "{stream:?}");
            let mut f = H1Framing::new(8192);
            assert!(matches!(
                f.feed(stream),
                FramingVerdict::Refuse {
                    why: Refusal::BareCr,
                    ..
                }
            ));
        }
        // Past the largest head hyper accepts, hyper's 431 stands, however
        // the bytes are split (the fuzzer found a split that differed).
        let mut long = b"GET / HTTP/1.1\r\nX-Long: ".to_vec();
        long.resize(80, b'a');
        long.extend_from_slice(b"\r\n\rX");
        for step in 1..long.len() {
            let mut f = H1Framing::new(64);
            for piece in long.chunks(step) {
                assert!(
                    !matches!(f.feed(piece), FramingVerdict::Refuse { .. }),
                    "split every {step}"
                );
            }
        }
        // A CR that an LF follows is a line end, and a CR at the end of a
        // read may still be one: no refusal yet.
        assert_eq!(
            head_end(b"GET / HTTP/1.1\r\nHost: a\r\n\r"),
            HeadEnd::Partial
        );
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\n"), HeadEnd::Complete(18));
    }

    #[test]
    fn framing_shadow_stops_after_a_relayed_upgrade_and_refuses_invalid_heads() {
        // After a relayed upgrade the response decides what follows.
        let upgrade = b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\nPOST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(shadow_any_split(upgrade), (None, 1));
        // An ignored h2c offer is a plain request: the shadow goes on.
        let h2c = b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: upgrade, http2-settings\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\nGET / HTTP/1.1\r\n\r\n";
        assert_eq!(shadow_any_split(h2c), (Some((1, h2c.len())), 1));
        // Heads hyper would refuse by itself are refused here, with a reason,
        // before hyper sees them.
        for (refused, why) in [
            (
                &b"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n"[..],
                Refusal::ObsFold,
            ),
            (
                b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
                Refusal::HeaderLine,
            ),
            (
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                Refusal::ContentLength,
            ),
            (
                b"CONNECT h:1 HTTP/1.1\r\nHost: h:1\r\n\r\n",
                Refusal::Connect,
            ),
        ] {
            let mut f = H1Framing::new(8192);
            match f.feed(refused) {
                FramingVerdict::Refuse {
                    index: 0,
                    why: w,
                    end,
                    head_len,
                } => {
                    assert_eq!((w, end, head_len), (why, refused.len(), refused.len()));
                }
                other => panic!("{refused:?}: {other:?}"),
            }
        }
        // A head longer than hyper accepts (431) ends it.
        let mut f = H1Framing::new(64);
        assert_eq!(f.feed(&[b'G'; 100]), FramingVerdict::Pass);
        assert!(!f.following());
        assert_eq!(f.withheld(), 0, "hyper gets the bytes and answers 431");
    }

    /// The `h1_framing` fuzz target's property over a fixed-seed stream of
    /// mutated request streams (bounded, so it runs in `cargo test`): the
    /// shadow never panics, never withholds more than it was fed, and its
    /// verdict does not depend on how the stream is split into reads.
    #[test]
    fn mutated_streams_get_the_same_verdict_however_they_are_split() {
        use rand::{Rng, SeedableRng};
        let pieces: [&[u8]; 6] = [
            b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n",
            b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
            b"POST /c HTTP/1.1\nHost: x\nTransfer-Encoding: chunked\n\n3;e\r\nabc\r\n0\r\nT: 1\r\n\r\n",
            b"POST /d HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"GET /e HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",
            b"\r\nGET /f HTTP/1.0\r\n\r\n",
        ];
        let alphabet = b" \t\r\n:;0123456789abcdefxHT/.-";
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x6832_3366);
        let run = |data: &[u8], step: usize| {
            let mut f = H1Framing::new(512);
            let mut offset = 0;
            for piece in data.chunks(step) {
                if let FramingVerdict::Refuse {
                    index,
                    why,
                    end,
                    head_len,
                } = f.feed(piece)
                {
                    assert!(end >= 1 && end <= piece.len());
                    assert!(head_len >= 1 && head_len <= offset + end);
                    return Some((index, why, offset + end));
                }
                offset += piece.len();
                assert!(f.withheld() <= offset);
            }
            None
        };
        for _ in 0..3_000 {
            let mut data = Vec::new();
            for _ in 0..rng.random_range(1..4) {
                data.extend_from_slice(pieces[rng.random_range(0..pieces.len())]);
            }
            for _ in 0..rng.random_range(0..3) {
                let at = rng.random_range(0..data.len());
                data[at] = alphabet[rng.random_range(0..alphabet.len())];
            }
            let whole = run(&data, data.len());
            let step = rng.random_range(1..16);
            assert_eq!(
                run(&data, step),
                whole,
                "{:?} in steps of {step}",
                String::from_utf8_lossy(&data)
            );
        }
    }

    #[test]
    fn a_partial_head_is_withheld_until_it_is_complete() {
        let mut f = H1Framing::new(8192);
        assert_eq!(f.feed(b"\r\nGET / HT"), FramingVerdict::Pass);
        assert_eq!(f.withheld(), 8, "the empty line before it is not");
        assert_eq!(f.feed(b"TP/1.1\r\nHost: x\r\n"), FramingVerdict::Pass);
        assert_eq!(f.withheld(), 8 + 17);
        assert_eq!(f.feed(b"\r\n"), FramingVerdict::Pass);
        assert_eq!(f.withheld(), 0);
    }

    #[test]
    fn chunk_sizes_that_overflow_stop_the_shadow() {
        let mut f = H1Framing::new(8192);
        let head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(f.feed(head), FramingVerdict::Pass);
        assert!(f.following());
        assert_eq!(
            f.withheld(),
            head.len(),
            "held until the first size line is read"
        );
        match f.feed(b"1ffffffffffffffff\r\n") {
            FramingVerdict::Refuse {
                index: 0,
                why: Refusal::ChunkSize,
                end: 17,
                head_len,
            } => {
                assert_eq!(head_len, head.len() + 17);
            }
            other => panic!("{other:?}"),
        }
        assert!(!f.following());
        // A valid first size line releases the head; later chunks are hyper's.
        let mut f = H1Framing::new(8192);
        f.feed(head);
        assert_eq!(f.feed(b"5;x=1\r"), FramingVerdict::Pass);
        assert_eq!(f.withheld(), head.len() + 6);
        assert_eq!(f.feed(b"\nhel"), FramingVerdict::Pass);
        assert_eq!(f.withheld(), 0);
        f.feed(b"lo\r\nzz\r\n");
        assert!(!f.following(), "a later malformed size stops the shadow");
    }
}
