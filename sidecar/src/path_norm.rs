//! Request-path normalization for authorization (issue #36): the path a
//! policy's `paths` and `path_prefixes` are matched against, and the one
//! forwarded upstream, on listeners whose policy has a path condition
//! (docs/decisions/0053).
//!
//! Why: a policy that denies `/admin` must not be dodged by `//admin`,
//! `/a/../admin` or `/%61dmin`, which most applications serve as `/admin`.
//! The rule, in order:
//!
//! 1. Percent-encodings are checked and those of unreserved characters
//!    (RFC 3986 §2.3: `A-Z a-z 0-9 - . _ ~`) decoded; every other one stays
//!    encoded, its hex digits upper-cased (§6.2.2.1).
//! 2. Refused (400, [`PathRefusal`]): a malformed percent-encoding; an
//!    encoded `/` or `\` (`%2F`, `%5C`) or a literal `\` — applications
//!    disagree on whether those separate segments, so no answer here is
//!    safe for every application behind the sidecar; an encoded control
//!    character (`%00`–`%1F`, `%7F`), which some decode and truncate at.
//! 3. Repeated slashes are merged (`//a///b` → `/a/b`).
//! 4. Dot segments are removed (§5.2.4: `/a/./b/../c` → `/a/c`; `..` never
//!    climbs above the root).
//!
//! A path with none of `%`, `\`, `//` or `/.` is already normal and is
//! returned borrowed: the common request costs one scan and no allocation.

use std::borrow::Cow;

/// Why a path cannot be normalized safely (the request is answered 400).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathRefusal {
    #[error("the path has an encoded '/' or '\\' (%2F, %5C) or a '\\'")]
    EscapedSeparator,
    #[error("the path has a malformed percent-encoding")]
    BadEscape,
    #[error("the path has an encoded control character")]
    EncodedControl,
}

impl PathRefusal {
    /// The local-response reason (metric label and `x-baton-local-reason`).
    pub fn reason(self) -> &'static str {
        match self {
            PathRefusal::EscapedSeparator => "path_escaped_separator",
            PathRefusal::BadEscape => "path_bad_escape",
            PathRefusal::EncodedControl => "path_encoded_control",
        }
    }

    /// The answer's body.
    pub fn body(self) -> String {
        format!("request path refused: {self}\n")
    }
}

/// `path` (without the query) normalized by the rule above. A path that
/// does not start with `/` (`*` of `OPTIONS *`) is returned as it is.
pub fn normalize(path: &str) -> Result<Cow<'_, str>, PathRefusal> {
    if !path.starts_with('/') || is_normal(path.as_bytes()) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(path.as_bytes())?;
    Ok(Cow::Owned(remove_dot_segments(&decoded)))
}

/// Nothing to do: no `%`, `\`, `//` or `/.`.
fn is_normal(path: &[u8]) -> bool {
    let mut prev = 0u8;
    for &b in path {
        if b == b'%' || b == b'\\' || (prev == b'/' && (b == b'/' || b == b'.')) {
            return false;
        }
        prev = b;
    }
    true
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Step 1 and 2: unreserved characters decoded, others kept (upper-case
/// hex), the refusals.
fn decode_unreserved(path: &[u8]) -> Result<String, PathRefusal> {
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        match path[i] {
            b'\\' => return Err(PathRefusal::EscapedSeparator),
            b'%' => {
                let (Some(hi), Some(lo)) = (
                    path.get(i + 1).copied().and_then(hex),
                    path.get(i + 2).copied().and_then(hex),
                ) else {
                    return Err(PathRefusal::BadEscape);
                };
                let v = hi << 4 | lo;
                if v == b'/' || v == b'\\' {
                    return Err(PathRefusal::EscapedSeparator);
                }
                if v < 0x20 || v == 0x7f {
                    return Err(PathRefusal::EncodedControl);
                }
                if unreserved(v) {
                    out.push(v);
                } else {
                    const HEX: &[u8; 16] = b"0123456789ABCDEF";
                    out.extend_from_slice(&[b'%', HEX[usize::from(hi)], HEX[usize::from(lo)]]);
                }
                i += 3;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    // Only ASCII was decoded and every other byte copied whole, so the
    // input's UTF-8 is intact.
    Ok(String::from_utf8(out)
        .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
}

/// Step 3 and 4 on a path starting with `/`: empty segments merged, `.`
/// dropped, `..` drops the segment before it. A path ending in a segment
/// that went away (`/a/.`, `/a/b/..`, `/a//`) keeps its trailing slash, as
/// RFC 3986's algorithm does.
fn remove_dot_segments(path: &str) -> String {
    let segments: Vec<&str> = path[1..].split('/').collect();
    let last = segments.len() - 1;
    let mut kept: Vec<&str> = Vec::with_capacity(segments.len());
    let mut trailing_slash = false;
    for (i, seg) in segments.into_iter().enumerate() {
        match seg {
            "" | "." => {}
            ".." => {
                kept.pop();
            }
            s => kept.push(s),
        }
        if i == last {
            trailing_slash = matches!(seg, "" | "." | "..");
        }
    }
    let mut out = String::with_capacity(path.len());
    for s in &kept {
        out.push('/');
        out.push_str(s);
    }
    if trailing_slash || kept.is_empty() {
        out.push('/');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(p: &str) -> Result<String, PathRefusal> {
        normalize(p).map(Cow::into_owned)
    }

    #[test]
    fn paths_that_name_admin_in_disguise_normalize_to_admin() {
        for p in [
            "/admin",
            "//admin",
            "///admin",
            "/a/../admin",
            "/./admin",
            "/%61dmin",
            "/%61%64%6D%69%6e",
            "/x/%2e%2e/admin",
            "/../admin",
            "/../../admin",
        ] {
            assert_eq!(n(p).as_deref(), Ok("/admin"), "{p}");
        }
    }

    #[test]
    fn encoded_slashes_backslashes_and_controls_are_refused() {
        for (p, why) in [
            ("/admin%2F..", PathRefusal::EscapedSeparator),
            ("/admin%2f..", PathRefusal::EscapedSeparator),
            ("/public/..%2Fadmin", PathRefusal::EscapedSeparator),
            ("/a%5C..%5Cadmin", PathRefusal::EscapedSeparator),
            ("/a\\..\\admin", PathRefusal::EscapedSeparator),
            ("/admin%00.html", PathRefusal::EncodedControl),
            ("/a%0D%0Ab", PathRefusal::EncodedControl),
            ("/a%7f", PathRefusal::EncodedControl),
            ("/a%zz", PathRefusal::BadEscape),
            ("/a%4", PathRefusal::BadEscape),
            ("/a%", PathRefusal::BadEscape),
        ] {
            assert_eq!(n(p), Err(why), "{p}");
        }
    }

    #[test]
    fn reserved_escapes_stay_encoded_with_upper_case_hex() {
        assert_eq!(n("/a%3fb").as_deref(), Ok("/a%3Fb"));
        assert_eq!(n("/a%20b/%7e").as_deref(), Ok("/a%20b/~"));
        assert_eq!(
            n("/caf%C3%A9").as_deref(),
            Ok("/caf%C3%A9"),
            "non-ASCII stays encoded"
        );
        assert_eq!(n("/café/./x").as_deref(), Ok("/café/x"), "raw UTF-8 kept");
    }

    #[test]
    fn trailing_slashes_and_the_root_follow_rfc_3986() {
        for (p, want) in [
            ("/", "/"),
            ("//", "/"),
            ("/.", "/"),
            ("/..", "/"),
            ("/a/", "/a/"),
            ("/a//", "/a/"),
            ("/a/.", "/a/"),
            ("/a/b/..", "/a/"),
            ("/a/./b/../c", "/a/c"),
            ("/a/.b/..c", "/a/.b/..c"),
            ("/a.", "/a."),
        ] {
            assert_eq!(n(p).as_deref(), Ok(want), "{p}");
        }
    }

    #[test]
    fn a_normal_path_is_borrowed_and_a_non_origin_target_is_left_alone() {
        assert!(matches!(normalize("/api/v1/items"), Ok(Cow::Borrowed(_))));
        assert!(matches!(normalize("/a.b/c."), Ok(Cow::Borrowed(_))));
        assert!(matches!(normalize("*"), Ok(Cow::Borrowed("*"))));
    }
}
