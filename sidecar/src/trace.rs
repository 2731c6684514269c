//! W3C Trace Context (`traceparent` / `tracestate`) for proxied HTTP
//! requests: the sidecar is one span of the trace.
//!
//! * A request with a valid `traceparent` keeps its trace id and flags; the
//!   upstream receives a `traceparent` whose parent id is the sidecar's own
//!   new span id, and `tracestate` unchanged.
//! * A request without one (or with an invalid one, or with more than one)
//!   starts a new trace: a random 16-byte trace id, a new span id, and the
//!   sampled flag set for `runtime.trace_sample_percent` of new traces
//!   (default 100: Baton records no spans itself, so the flag only tells the
//!   application's tracer whether to record; with the OpenTelemetry default,
//!   a parent-based sampler, an unsampled parent would silently stop the
//!   traces the application recorded before the mesh). An incoming
//!   `tracestate` belongs to the trace it came with, so it is dropped when
//!   the trace restarts (W3C Trace Context §3.3.1.1).
//! * B3 headers (`b3`, `x-b3-*`) are not read or changed.
//!
//! The trace and span ids appear in the request's access-log line.
//! Parsing is pure and allocation-free: the HTTP/1.1 fast path runs it on
//! the header bytes it already has.

/// A parsed `traceparent` (only what version 00 defines).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    pub flags: u8,
}

pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

/// The `traceparent` value length for version 00: `vv-<32>-<16>-ff`.
pub const TRACEPARENT_LEN: usize = 55;

/// Flags the sidecar forwards as received: sampled (level 1) and
/// random-trace-id (level 2) — both describe the trace, which is kept.
/// Unknown bits are cleared, as the specification asks of a version-00
/// participant.
const KNOWN_FLAGS: u8 = 0x03;
const SAMPLED: u8 = 0x01;

/// Parse a `traceparent` header value; `None` when invalid (§3.2): only
/// lowercase hex, version `ff` forbidden, all-zero trace or parent ids
/// forbidden, exactly 55 bytes for version 00. A higher version may be
/// longer, then the byte after the flags must be `-` (its first four fields
/// are read as version 00's).
pub fn parse(value: &[u8]) -> Option<TraceParent> {
    if value.len() < TRACEPARENT_LEN {
        return None;
    }
    let version = hex_byte(&value[0..2])?;
    if version == 0xff
        || (version == 0 && value.len() != TRACEPARENT_LEN)
        || (value.len() > TRACEPARENT_LEN && value[TRACEPARENT_LEN] != b'-')
    {
        return None;
    }
    if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let mut trace_id = [0u8; 16];
    for (i, b) in trace_id.iter_mut().enumerate() {
        *b = hex_byte(&value[3 + 2 * i..5 + 2 * i])?;
    }
    let mut parent_id = [0u8; 8];
    for (i, b) in parent_id.iter_mut().enumerate() {
        *b = hex_byte(&value[36 + 2 * i..38 + 2 * i])?;
    }
    let flags = hex_byte(&value[53..55])?;
    if trace_id == [0; 16] || parent_id == [0; 8] {
        return None;
    }
    Some(TraceParent {
        trace_id,
        parent_id,
        flags,
    })
}

/// One byte from two lowercase hex digits (uppercase is invalid here).
fn hex_byte(two: &[u8]) -> Option<u8> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    Some(nibble(two[0])? << 4 | nibble(two[1])?)
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn write_hex(out: &mut [u8], bytes: &[u8]) {
    for (i, b) in bytes.iter().enumerate() {
        out[2 * i] = HEX[usize::from(b >> 4)];
        out[2 * i + 1] = HEX[usize::from(b & 0x0f)];
    }
}

/// The sidecar's span of one request: the trace it belongs to, its own
/// span id, and whether the trace was started here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
    /// The incoming parent, when the request carried a valid one.
    pub parent_id: Option<[u8; 8]>,
}

impl Span {
    /// The sidecar's span for a request whose `traceparent` headers are
    /// `incoming` (each value; more than one is invalid, §3.2). `percent`:
    /// share of new traces marked sampled (`runtime.trace_sample_percent`).
    pub fn for_request<'a>(mut incoming: impl Iterator<Item = &'a [u8]>, percent: f64) -> Self {
        let parsed = match (incoming.next(), incoming.next()) {
            (Some(v), None) => parse(v),
            _ => None,
        };
        let span_id = new_span_id();
        match parsed {
            Some(tp) => Span {
                trace_id: tp.trace_id,
                span_id,
                flags: tp.flags & KNOWN_FLAGS,
                parent_id: Some(tp.parent_id),
            },
            None => {
                let trace_id = new_trace_id();
                Span {
                    trace_id,
                    span_id,
                    flags: if sampled(&trace_id, percent) {
                        SAMPLED
                    } else {
                        0
                    },
                    parent_id: None,
                }
            }
        }
    }

    /// [`Span::for_request`] from a request's headers (the general path).
    pub fn from_headers(headers: &http::HeaderMap, percent: f64) -> Self {
        Self::for_request(
            headers
                .get_all(TRACEPARENT)
                .iter()
                .map(http::HeaderValue::as_bytes),
            percent,
        )
    }

    /// Set the forwarded `traceparent` (this span as the parent); drop
    /// `tracestate` when the trace restarted here.
    pub fn apply(&self, headers: &mut http::HeaderMap) {
        if let Ok(v) = http::HeaderValue::from_bytes(&self.traceparent()) {
            headers.insert(TRACEPARENT, v);
        }
        if self.restarted() {
            headers.remove(TRACESTATE);
        }
    }

    /// Whether the incoming trace context is replaced (so an incoming
    /// `tracestate` is dropped).
    pub fn restarted(&self) -> bool {
        self.parent_id.is_none()
    }

    #[cfg(test)]
    fn sampled(&self) -> bool {
        self.flags & SAMPLED != 0
    }

    /// The `traceparent` to forward: version 00, this span as the parent.
    pub fn traceparent(&self) -> [u8; TRACEPARENT_LEN] {
        let mut out = *b"00-00000000000000000000000000000000-0000000000000000-00";
        write_hex(&mut out[3..35], &self.trace_id);
        write_hex(&mut out[36..52], &self.span_id);
        write_hex(&mut out[53..55], &[self.flags]);
        out
    }

    pub fn trace_id_hex(&self) -> String {
        let mut out = [0u8; 32];
        write_hex(&mut out, &self.trace_id);
        String::from_utf8_lossy(&out).into_owned()
    }

    pub fn span_id_hex(&self) -> String {
        let mut out = [0u8; 16];
        write_hex(&mut out, &self.span_id);
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// Whether a new trace is sampled: decided from the trace id's random
/// bits, so every hop that applies the same percentage to the same id
/// agrees.
fn sampled(trace_id: &[u8; 16], percent: f64) -> bool {
    if percent >= 100.0 {
        return true;
    }
    if percent.is_nan() || percent <= 0.0 {
        return false;
    }
    let mut low = [0u8; 8];
    low.copy_from_slice(&trace_id[8..]);
    let draw = u64::from_be_bytes(low) % 1_000_000;
    (draw as f64) < percent * 10_000.0
}

/// Ids come from a per-thread SplitMix64 stream seeded once from the OS
/// generator (`rand`): unique and uniformly spread, which is what trace
/// and span ids need (they are not secrets), at a few ns each instead of
/// a ChaCha block per id (measured: docs/decisions/0048).
fn next_u64() -> u64 {
    use std::cell::Cell;
    thread_local! {
        static STATE: Cell<u64> = Cell::new(rand::random());
    }
    STATE.with(|s| {
        let x = s.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
        s.set(x);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

fn new_trace_id() -> [u8; 16] {
    loop {
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&next_u64().to_be_bytes());
        id[8..].copy_from_slice(&next_u64().to_be_bytes());
        if id != [0; 16] {
            return id;
        }
    }
}

fn new_span_id() -> [u8; 8] {
    loop {
        let id = next_u64().to_be_bytes();
        if id != [0; 8] {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_version_00_traceparent_parses() {
        let tp = parse(VALID).unwrap();
        assert_eq!(tp.trace_id[0], 0x4b);
        assert_eq!(tp.trace_id[15], 0x36);
        assert_eq!(
            tp.parent_id,
            [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
        );
        assert_eq!(tp.flags, 1);
    }

    #[test]
    fn invalid_traceparents_are_refused() {
        let bad: &[&[u8]] = &[
            // version ff is forbidden
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // version not hex
            b"0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // all-zero trace id
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            // all-zero parent id
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // uppercase hex
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A",
            // wrong lengths: short trace id, long parent id, short flags
            b"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b77-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            // version 00 with anything after the flags
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            // wrong separators
            b"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
            // a future version continued by something other than '-'
            b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            b"",
        ];
        for b in bad {
            assert_eq!(parse(b), None, "{}", String::from_utf8_lossy(b));
        }
    }

    #[test]
    fn a_higher_version_is_read_as_version_00_when_it_fits() {
        let v = b"cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds";
        assert_eq!(parse(v).unwrap().trace_id, parse(VALID).unwrap().trace_id);
        let exact = b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(parse(exact).is_some());
    }

    #[test]
    fn a_request_with_a_traceparent_keeps_its_trace_and_gets_the_sidecar_as_parent() {
        let span = Span::for_request([VALID].into_iter(), 0.0);
        let tp = parse(VALID).unwrap();
        assert_eq!(span.trace_id, tp.trace_id);
        assert_eq!(span.parent_id, Some(tp.parent_id));
        assert_ne!(span.span_id, tp.parent_id);
        assert!(span.sampled(), "the incoming sampled flag is kept");
        let out = span.traceparent();
        let forwarded = parse(&out).unwrap();
        assert_eq!(forwarded.trace_id, tp.trace_id);
        assert_eq!(forwarded.parent_id, span.span_id);
        assert_eq!(&out[..3], b"00-");
        assert_eq!(&out[53..], b"01");
        assert_eq!(span.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(!span.restarted());
    }

    #[test]
    fn an_unsampled_incoming_trace_stays_unsampled_and_unknown_flags_are_cleared() {
        let v = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-f0";
        let span = Span::for_request([&v[..]].into_iter(), 100.0);
        assert!(!span.sampled());
        assert_eq!(&span.traceparent()[53..], b"00");
    }

    #[test]
    fn a_missing_invalid_or_repeated_traceparent_starts_a_new_trace() {
        let none = Span::for_request(std::iter::empty(), 100.0);
        assert!(none.restarted());
        assert!(none.sampled());
        assert!(parse(&none.traceparent()).is_some());
        let invalid = Span::for_request([&b"00-zz"[..]].into_iter(), 0.0);
        assert!(invalid.restarted());
        assert!(!invalid.sampled());
        let twice = Span::for_request([VALID, VALID].into_iter(), 100.0);
        assert!(twice.restarted());
        assert_ne!(twice.trace_id, parse(VALID).unwrap().trace_id);
        // New ids differ from one request to the next.
        assert_ne!(none.trace_id, twice.trace_id);
        assert_ne!(none.span_id, twice.span_id);
    }

    #[test]
    fn the_sampling_share_follows_the_trace_id() {
        let mut id = [0u8; 16];
        id[15] = 1; // draw 1 of 1,000,000
        assert!(sampled(&id, 0.01));
        assert!(!sampled(&id, 0.0));
        id[8..].copy_from_slice(&999_999u64.to_be_bytes());
        assert!(!sampled(&id, 99.99));
        assert!(sampled(&id, 100.0));
    }
}
