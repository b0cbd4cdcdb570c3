//! The `Idempotency-Key` header: extraction, validation and scoping.

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

use crate::error::GatewayError;

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// A validated idempotency key: 1 to `key_max_len` visible ASCII characters.
///
/// The IETF draft defines the header as a structured-field string (`"abc"`); a quoted value is
/// unquoted here, so `abc` and `"abc"` are the same key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Extract the key from `headers`: `Ok(None)` when there is none, an error when there are
    /// several or the one there is invalid.
    pub fn from_headers(headers: &HeaderMap, max_len: usize) -> Result<Option<Self>, GatewayError> {
        let mut values = headers.get_all(&IDEMPOTENCY_KEY).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(GatewayError::InvalidKey(
                "send exactly one Idempotency-Key header".into(),
            ));
        }
        Self::parse(value.as_bytes(), max_len).map(Some)
    }

    /// Validate one header value.
    pub fn parse(raw: &[u8], max_len: usize) -> Result<Self, GatewayError> {
        let raw = trim(raw);
        let key = if raw.len() >= 2 && raw[0] == b'"' && raw[raw.len() - 1] == b'"' {
            unquote(&raw[1..raw.len() - 1])?
        } else {
            raw.to_vec()
        };
        if key.is_empty() {
            return Err(GatewayError::InvalidKey(
                "the Idempotency-Key header is empty".into(),
            ));
        }
        if key.len() > max_len {
            return Err(GatewayError::InvalidKey(format!(
                "the Idempotency-Key is {} characters long; the limit is {max_len}",
                key.len()
            )));
        }
        if let Some(bad) = key.iter().find(|b| !(0x21..=0x7e).contains(*b)) {
            return Err(GatewayError::InvalidKey(format!(
                "the Idempotency-Key may hold only visible ASCII characters (found byte 0x{bad:02x})"
            )));
        }
        Ok(IdempotencyKey(
            String::from_utf8(key).expect("visible ASCII is UTF-8"),
        ))
    }

    /// The key as the client sent it (unquoted).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The store address of this key for the caller identified by `scope_headers`: a SHA-256 over
    /// the key and every scope header's values, so callers with different credentials never share
    /// a record even when they pick the same key.
    pub fn scoped(&self, headers: &HeaderMap, scope_headers: &[HeaderName]) -> ScopedKey {
        let mut h = Sha256::new();
        write_field(&mut h, self.0.as_bytes());
        for name in scope_headers {
            write_field(&mut h, name.as_str().as_bytes());
            let values = headers.get_all(name);
            h.update((values.iter().count() as u32).to_be_bytes());
            for v in values {
                write_field(&mut h, v.as_bytes());
            }
        }
        ScopedKey(h.finalize().into())
    }

    /// A short, non-reversible tag of the key for logs (never log the raw key).
    pub fn short_hash(&self) -> String {
        let d = Sha256::digest(self.0.as_bytes());
        hex(&d[..6])
    }
}

/// The hashed (key, scope) pair that addresses a record in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ScopedKey(pub [u8; 32]);

impl ScopedKey {
    /// The record's name in the store (after the prefix): the first 128 bits of the hash in
    /// URL-safe base64, 22 characters. Short on purpose: Redis keeps the name once per record,
    /// and a name of up to 28 bytes with its prefix fits jemalloc's 32-byte class (64 hex digits
    /// took 80 bytes). 128 bits keep accidental collisions out of reach (about 1e-15 among a
    /// trillion records) and a chosen one costs a 2^128 search.
    pub fn store_name(&self) -> String {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&self.0[..16])
    }
}

/// Length-prefix a field so that ("ab","c") and ("a","bc") hash differently.
pub(crate) fn write_field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

fn trim(mut b: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = b {
        b = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = b {
        b = rest;
    }
    b
}

/// Undo sf-string escapes (`\"` and `\\`); any other backslash or a bare quote is invalid.
fn unquote(inner: &[u8]) -> Result<Vec<u8>, GatewayError> {
    let mut out = Vec::with_capacity(inner.len());
    let mut it = inner.iter();
    while let Some(&b) = it.next() {
        match b {
            b'\\' => match it.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(c),
                _ => {
                    return Err(GatewayError::InvalidKey(
                        "invalid escape in quoted Idempotency-Key".into(),
                    ))
                }
            },
            b'"' => {
                return Err(GatewayError::InvalidKey(
                    "unescaped quote in Idempotency-Key".into(),
                ))
            }
            _ => out.push(b),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn key(raw: &str) -> Result<IdempotencyKey, GatewayError> {
        IdempotencyKey::parse(raw.as_bytes(), 16)
    }

    #[test]
    fn quoted_and_bare_forms_are_the_same_key() {
        assert_eq!(key("abc").unwrap(), key("\"abc\"").unwrap());
        assert_eq!(key("\"a\\\"b\"").unwrap().as_str(), "a\"b");
    }

    #[test]
    fn invalid_keys_are_refused() {
        assert!(key("").is_err());
        assert!(key("\"\"").is_err());
        assert!(key("0123456789abcdefX").is_err());
        assert!(key("0123456789abcdef").is_ok());
        assert!(key("a b").is_err());
        assert!(key("\"a\\nb\"").is_err());
        assert!(IdempotencyKey::parse("é".as_bytes(), 16).is_err());
    }

    #[test]
    fn duplicated_header_is_refused() {
        let mut h = HeaderMap::new();
        h.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        h.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert!(IdempotencyKey::from_headers(&h, 16).is_err());
        assert!(IdempotencyKey::from_headers(&HeaderMap::new(), 16)
            .unwrap()
            .is_none());
    }

    #[test]
    fn scope_separates_callers() {
        let k = key("k1").unwrap();
        let scope = [http::header::AUTHORIZATION];
        let mut a = HeaderMap::new();
        a.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_static("Bearer a"),
        );
        let mut b = HeaderMap::new();
        b.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_static("Bearer b"),
        );
        assert_ne!(k.scoped(&a, &scope), k.scoped(&b, &scope));
        assert_ne!(k.scoped(&a, &scope), k.scoped(&HeaderMap::new(), &scope));
        assert_eq!(k.scoped(&a, &scope), k.scoped(&a.clone(), &scope));
        assert_eq!(k.scoped(&a, &[]), k.scoped(&b, &[]));
    }
}
