//! The fingerprint of a keyed request: what "the same request" means.

use http::request::Parts;
use http::HeaderName;
use sha2::{Digest, Sha256};

use super::json::{hash_canonical, Json, Pointer};
use super::key::write_field;
use super::policy::{FingerprintMode, Policy};

/// SHA-256 over method, path and query, content-type and body (and, as a route says, the
/// canonical form of a JSON body and some headers). Two requests with one key and the
/// same fingerprint are retries of each other; a different fingerprint is a misuse of the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Fingerprint the request head and its buffered body, byte for byte.
    pub fn of(parts: &Parts, body: &[u8]) -> Self {
        Self::with(parts, body, None, &[], &[])
    }

    /// Fingerprint a request as `policy` says: with `fingerprint = "json"` and a JSON-typed
    /// body (`doc`, parsed), its canonical form leaving out `fingerprint_ignore`; otherwise the
    /// exact bytes; and the values of `fingerprint_headers`.
    pub(crate) fn for_policy(
        parts: &Parts,
        body: &[u8],
        doc: Option<&Json<'_>>,
        policy: &Policy,
    ) -> Self {
        let doc = doc.filter(|_| policy.fingerprint == FingerprintMode::Json);
        Self::with(
            parts,
            body,
            doc,
            &policy.fingerprint_ignore,
            &policy.fingerprint_headers,
        )
    }

    fn with(
        parts: &Parts,
        body: &[u8],
        doc: Option<&Json<'_>>,
        ignore: &[Pointer],
        headers: &[HeaderName],
    ) -> Self {
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
        match doc {
            None => write_field(&mut h, body),
            Some(doc) => {
                write_field(&mut h, b"json");
                hash_canonical(doc, ignore, &mut h);
            }
        }
        // Only when headers count, so that other fingerprints stay what they were.
        if !headers.is_empty() {
            write_field(&mut h, b"headers");
            for name in headers {
                write_field(&mut h, name.as_str().as_bytes());
                let values = parts.headers.get_all(name);
                h.update((values.iter().count() as u32).to_be_bytes());
                for v in values {
                    write_field(&mut h, v.as_bytes());
                }
            }
        }
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

    #[test]
    fn a_json_fingerprint_follows_the_canonical_form_and_the_headers_chosen() {
        let policy = Policy::builder()
            .fingerprint(FingerprintMode::Json)
            .fingerprint_ignore(["/request_id"])
            .fingerprint_headers(["x-api-version"])
            .build()
            .unwrap();
        let fp = |body: &str, version: &str| {
            let (parts, ()) = http::Request::post("/p")
                .header("content-type", "application/json")
                .header("x-api-version", version)
                .body(())
                .unwrap()
                .into_parts();
            let doc = crate::record::json::parse(body.as_bytes()).unwrap();
            Fingerprint::for_policy(&parts, body.as_bytes(), Some(&doc), &policy)
        };
        let base = fp(r#"{"a":1,"request_id":"x"}"#, "1");
        assert_eq!(base, fp(r#"{ "request_id":"y", "a": 1.0 }"#, "1"));
        assert_ne!(base, fp(r#"{"a":2}"#, "1"));
        assert_ne!(base, fp(r#"{"a":1}"#, "2"), "a fingerprint header counts");
        // The default policy keeps the exact bytes, as before.
        let (parts, ()) = http::Request::post("/p").body(()).unwrap().into_parts();
        let doc = crate::record::json::parse(b"{}").unwrap();
        assert_eq!(
            Fingerprint::for_policy(&parts, b"{}", Some(&doc), &Policy::default()),
            Fingerprint::of(&parts, b"{}")
        );
    }
}
