//! The fingerprint of a keyed request: what "the same request" means.

use http::request::Parts;
use sha2::{Digest, Sha256};

use super::key::write_field;

/// SHA-256 over method, path and query, content-type and body. Two requests with one key and the
/// same fingerprint are retries of each other; a different fingerprint is a misuse of the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Fingerprint the request head and its buffered body.
    pub fn of(parts: &Parts, body: &[u8]) -> Self {
        let mut h = Sha256::new();
        write_field(&mut h, parts.method.as_str().as_bytes());
        let pq = parts
            .uri
            .path_and_query()
            .map(|pq| pq.as_str())
            .unwrap_or("/");
        write_field(&mut h, pq.as_bytes());
        let ct = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        write_field(&mut h, ct);
        write_field(&mut h, body);
        Fingerprint(h.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(method: &str, uri: &str, ct: Option<&str>, body: &[u8]) -> Fingerprint {
        let mut b = http::Request::builder().method(method).uri(uri);
        if let Some(ct) = ct {
            b = b.header("content-type", ct);
        }
        let (parts, ()) = b.body(()).unwrap().into_parts();
        Fingerprint::of(&parts, body)
    }

    #[test]
    fn every_part_counts() {
        let base = fp("POST", "/a?x=1", Some("application/json"), b"{}");
        assert_eq!(base, fp("POST", "/a?x=1", Some("application/json"), b"{}"));
        assert_ne!(base, fp("PATCH", "/a?x=1", Some("application/json"), b"{}"));
        assert_ne!(base, fp("POST", "/b?x=1", Some("application/json"), b"{}"));
        assert_ne!(base, fp("POST", "/a?x=2", Some("application/json"), b"{}"));
        assert_ne!(base, fp("POST", "/a?x=1", Some("text/plain"), b"{}"));
        assert_ne!(base, fp("POST", "/a?x=1", Some("application/json"), b"{ }"));
    }
}
