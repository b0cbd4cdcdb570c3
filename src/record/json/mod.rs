//! JSON bodies: a strict parser into a tree that borrows from the body, the canonical form a
//! `fingerprint = "json"` route hashes, and JSON pointers (RFC 6901) into the tree.
//!
//! The canonical form: object members sorted by key (Unicode code point order, which is UTF-8
//! byte order), whitespace ignored, strings compared after unescaping (no Unicode
//! normalisation), numbers compared by exact decimal value (`1`, `1.0` and `1e0` are equal, `-0`
//! equals `0`, and no value is rounded through floating point). A body that does not parse, has
//! two members with one key (after unescaping), nests deeper than [`MAX_DEPTH`](parse::MAX_DEPTH) or has an
//! exponent beyond ±10^18 is refused. The form is fed to the hasher as tagged, length-prefixed
//! pieces straight from the body (escaped strings are unescaped on the way), never built as a
//! second copy of the body.
//!
//! Crate-private: only the engine reads bodies. [`Pointer`] is public because a [`Policy`]'s
//! fields hold pointers.
//!
//! [`Policy`]: crate::Policy

mod canonical;
#[cfg(test)]
mod differential;
mod parse;
mod pointer;

pub(crate) use canonical::{hash_canonical, MAX_IGNORED};
pub(crate) use parse::{parse, Json};
pub use pointer::Pointer;

use crate::headers::media_type;

/// Whether a `Content-Type` says JSON: `application/json` or `*/*+json`, parameters aside.
pub(crate) fn is_json_type(content_type: &[u8]) -> bool {
    let Some((kind, sub)) = media_type(content_type).and_then(|t| t.split_once('/')) else {
        return false;
    };
    !kind.is_empty()
        && (sub.eq_ignore_ascii_case("json") && kind.eq_ignore_ascii_case("application")
            || sub.len() > 5 && sub[sub.len() - 5..].eq_ignore_ascii_case("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn json_content_types() {
        for ct in [
            "application/json",
            "application/json; charset=utf-8",
            "application/vnd.api+json",
            "Application/JSON",
        ] {
            assert!(is_json_type(ct.as_bytes()), "{ct}");
        }
        for ct in [
            "text/plain",
            "application/jsonx",
            "json",
            "application/x-www-form-urlencoded",
        ] {
            assert!(!is_json_type(ct.as_bytes()), "{ct}");
        }
    }
}
