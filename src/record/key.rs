//! The `Idempotency-Key` header: extraction, validation and scoping.

use std::borrow::Cow;

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

use super::json::{hash_canonical, Json, Pointer};
use crate::error::GatewayError;

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// A validated idempotency key: 1 to `key_max_len` visible ASCII characters.
///
/// The IETF draft defines the header as a structured-field string (`"abc"`); a quoted value is
/// unquoted here, so `abc` and `"abc"` are the same key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

/// Where a request's key came from: shown in the debug log and the admin key view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    /// A request header (one of `key_headers`).
    Header,
    /// A field of the JSON body (`key_from_body`).
    Body,
    /// An HMAC of fields of the JSON body (`derived_key`).
    Derived,
}

impl KeySource {
    /// The name logs and the admin API give it.
    pub fn as_str(self) -> &'static str {
        match self {
            KeySource::Header => "header",
            KeySource::Body => "body",
            KeySource::Derived => "derived",
        }
    }
}

impl IdempotencyKey {
    /// Extract the key from the first of `names` that `headers` carry: `Ok(None)` when none
    /// does, an error when one is repeated or invalid, or when two of them carry different
    /// keys (the same key under two names is that key).
    pub fn from_headers(
        headers: &HeaderMap,
        names: &[HeaderName],
        max_len: usize,
    ) -> Result<Option<Self>, GatewayError> {
        let mut found: Option<(Self, &HeaderName)> = None;
        for name in names {
            let mut values = headers.get_all(name).iter();
            let Some(value) = values.next() else {
                continue;
            };
            if values.next().is_some() {
                return Err(GatewayError::InvalidKey(format!(
                    "send exactly one {name} header"
                )));
            }
            let key = Self::parse(value.as_bytes(), max_len)?;
            match &found {
                None => found = Some((key, name)),
                Some((first, _)) if *first == key => {}
                Some((_, first_name)) => {
                    return Err(GatewayError::InvalidKey(format!(
                        "the {first_name} and {name} headers carry different keys"
                    )))
                }
            }
        }
        Ok(found.map(|(key, _)| key))
    }

    /// The key at `pointer` in a JSON body: `Ok(None)` when the body has no such field; an error
    /// naming the pointer when the value is not a string or a number, or not a valid key. A
    /// number is taken as written.
    pub(crate) fn from_json(
        doc: &Json<'_>,
        pointer: &Pointer,
        max_len: usize,
    ) -> Result<Option<Self>, GatewayError> {
        let raw = match pointer.get(doc) {
            None => return Ok(None),
            Some(Json::String(s)) => s.value(),
            Some(Json::Number(n)) => Cow::Borrowed(n.as_str()),
            Some(_) => {
                return Err(GatewayError::InvalidKey(format!(
                    "the key at {} in the body must be a string or a number",
                    pointer.as_str()
                )))
            }
        };
        if raw.len() > max_len {
            return Err(GatewayError::InvalidKey(format!(
                "the key at {} in the body is {} characters long; the limit is {max_len}",
                pointer.as_str(),
                raw.len()
            )));
        }
        Self::validated(raw.as_bytes().to_vec(), max_len)
            .map(Some)
            .map_err(|e| match e {
                GatewayError::InvalidKey(why) => GatewayError::InvalidKey(format!(
                    "{} (at {} in the body)",
                    why,
                    pointer.as_str()
                )),
                other => other,
            })
    }

    /// The key derived from `fields` of a JSON body: an HMAC-SHA256, with `secret`, over each
    /// field's pointer and canonical value; `None` when a field is missing.
    pub(crate) fn derived(doc: &Json<'_>, fields: &[Pointer], secret: &KeySecret) -> Option<Self> {
        use hmac::{Hmac, KeyInit, Mac};
        #[expect(
            clippy::expect_used,
            reason = "HMAC takes a key of any length (RFC 2104: a long one is hashed first)"
        )]
        let mut mac =
            Hmac::<Sha256>::new_from_slice(secret.expose()).expect("HMAC takes any key length");
        for field in fields {
            let value = field.get(doc)?;
            let name = field.as_str().as_bytes();
            mac.update(&(name.len() as u64).to_be_bytes());
            mac.update(name);
            hash_canonical(value, &[], &mut mac);
        }
        Some(IdempotencyKey(format!(
            "derived-{}",
            hex(&mac.finalize().into_bytes())
        )))
    }

    /// Validate one header value.
    pub fn parse(raw: &[u8], max_len: usize) -> Result<Self, GatewayError> {
        let raw = trim(raw);
        let key = if let [b'"', inner @ .., b'"'] = raw {
            unquote(inner)?
        } else if raw.contains(&b',') {
            // Two field lines combined by an intermediary (RFC 9110 5.3) look like this.
            return Err(GatewayError::InvalidKey(
                "a key with a comma must be a quoted string (\"a,b\"); a bare one is what two keys combined into one header look like".into(),
            ));
        } else {
            raw.to_vec()
        };
        Self::validated(key, max_len)
    }

    /// A key of 1 to `max_len` visible ASCII characters.
    fn validated(key: Vec<u8>, max_len: usize) -> Result<Self, GatewayError> {
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
        // Visible ASCII: each byte is its character.
        Ok(IdempotencyKey(
            key.iter().copied().map(char::from).collect(),
        ))
    }

    /// The key as the client sent it (unquoted).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The store address of this key for the caller identified by `scope_headers`: a SHA-256 over
    /// the key and every scope header's values, so callers with different credentials never share
    /// a record even when they pick the same key.
    ///
    /// With `scope_cookies`, the values of those cookies (from the `Cookie` headers) scope it too;
    /// other cookies do not.
    pub fn scoped(
        &self,
        headers: &HeaderMap,
        scope_headers: &[HeaderName],
        scope_cookies: &[String],
    ) -> ScopedKey {
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
        // Only when cookies scope the key, so that keys scoped by headers alone keep their
        // addresses.
        if !scope_cookies.is_empty() {
            write_field(&mut h, b"cookies");
            for name in scope_cookies {
                write_field(&mut h, name.as_bytes());
                let values: Vec<&[u8]> = cookies(headers, name).collect();
                h.update((values.len() as u32).to_be_bytes());
                for v in values {
                    write_field(&mut h, v);
                }
            }
        }
        ScopedKey(h.finalize().into())
    }

    /// A short, non-reversible tag of the key for logs (never log the raw key).
    pub fn short_hash(&self) -> String {
        let d: [u8; 32] = Sha256::digest(self.0.as_bytes()).into();
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

    /// Where the stores that keep entries by scoped key (memory, embedded, PostgreSQL) keep this
    /// key's tombstone: another address, derived from this one, that no request's key hashes to.
    pub fn tombstone(&self) -> ScopedKey {
        let mut h = Sha256::new();
        h.update(b"idemgate tombstone\0");
        h.update(self.0);
        ScopedKey(h.finalize().into())
    }
}

/// The values of the cookie `name` in the `Cookie` headers of a request (RFC 6265: pairs
/// separated by `;`).
fn cookies<'h>(headers: &'h HeaderMap, name: &'h str) -> impl Iterator<Item = &'h [u8]> + 'h {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b';'))
        .filter_map(move |pair| {
            let mut halves = trim(pair).splitn(2, |&b| b == b'=');
            let (cookie, value) = (halves.next()?, halves.next()?);
            (trim(cookie) == name.as_bytes()).then(|| trim(value))
        })
}

/// Length-prefix a field so that ("ab","c") and ("a","bc") hash differently.
pub(crate) fn write_field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// Lower-case hex of `bytes`.
#[expect(
    clippy::indexing_slicing,
    reason = "a nibble (0 to 15) indexes 16 digits"
)]
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

/// The secret that derived keys are an HMAC with (`IDEMGATE_KEY_SECRET`): never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct KeySecret(std::sync::Arc<[u8]>);

impl KeySecret {
    /// The shortest secret accepted, in bytes.
    pub const MIN_LEN: usize = 16;

    /// A secret of at least [`KeySecret::MIN_LEN`] bytes.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, String> {
        let secret = secret.as_ref();
        if secret.len() < Self::MIN_LEN {
            return Err(format!(
                "must be at least {} characters long",
                Self::MIN_LEN
            ));
        }
        Ok(KeySecret(secret.into()))
    }

    /// The secret's bytes.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
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
    fn the_shortest_and_oddest_header_values_are_read_without_fault() {
        // A lone quote is a bare key of one character; two are an empty quoted key.
        assert_eq!(key("\"").unwrap().as_str(), "\"");
        assert_eq!(key(" \"a\" ").unwrap().as_str(), "a");
        assert!(key("\"\\\"").is_err(), "an escape cut by the closing quote");
        assert!(key(" \t ").is_err());
        assert_eq!(key("~").unwrap().as_str(), "~");
        let k = key("k").unwrap();
        assert_eq!(k.short_hash().len(), 12);
    }

    #[test]
    fn cookies_without_a_value_or_a_name_are_read_as_they_are() {
        let mut h = HeaderMap::new();
        h.append(
            http::header::COOKIE,
            HeaderValue::from_static("=; a; ;b==x; =c; d=;"),
        );
        let values = |name| cookies(&h, name).collect::<Vec<_>>();
        assert_eq!(values("b"), vec![&b"=x"[..]]);
        assert_eq!(values(""), vec![&b""[..], &b"c"[..]]);
        assert_eq!(values("d"), vec![&b""[..]]);
        assert!(values("a").is_empty(), "a pair without '=' names nothing");
    }

    #[test]
    fn a_bare_comma_is_two_keys_combined_and_a_quoted_one_is_a_key() {
        assert!(key("abc,def").is_err());
        assert!(key("abc, def").is_err());
        assert_eq!(key("\"a,b\"").unwrap().as_str(), "a,b");
    }

    #[test]
    fn duplicated_header_is_refused() {
        let mut h = HeaderMap::new();
        h.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        h.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert!(IdempotencyKey::from_headers(&h, &[IDEMPOTENCY_KEY], 16).is_err());
        assert!(
            IdempotencyKey::from_headers(&HeaderMap::new(), &[IDEMPOTENCY_KEY], 16)
                .unwrap()
                .is_none()
        );
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
        assert_ne!(k.scoped(&a, &scope, &[]), k.scoped(&b, &scope, &[]));
        assert_ne!(
            k.scoped(&a, &scope, &[]),
            k.scoped(&HeaderMap::new(), &scope, &[])
        );
        assert_eq!(k.scoped(&a, &scope, &[]), k.scoped(&a.clone(), &scope, &[]));
        assert_eq!(k.scoped(&a, &[], &[]), k.scoped(&b, &[], &[]));
    }

    #[test]
    fn key_headers_are_tried_in_order_and_must_agree() {
        let names = [
            IDEMPOTENCY_KEY,
            HeaderName::from_static("x-idempotency-key"),
        ];
        let with = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.append(*n, HeaderValue::from_static(v));
            }
            IdempotencyKey::from_headers(&h, &names, 16).map(|k| k.map(|k| k.0))
        };
        assert_eq!(
            with(&[("x-idempotency-key", "a")]).unwrap().as_deref(),
            Some("a")
        );
        assert_eq!(
            with(&[("idempotency-key", "a"), ("x-idempotency-key", "\"a\"")])
                .unwrap()
                .as_deref(),
            Some("a"),
            "the same key under two names"
        );
        assert!(with(&[("idempotency-key", "a"), ("x-idempotency-key", "b")]).is_err());
        assert!(with(&[]).unwrap().is_none());
    }

    #[test]
    fn body_keys_are_strings_or_numbers_within_the_limit() {
        let doc = crate::record::json::parse(
            br#"{"ref":"r-1","n":12345,"obj":{},"long":"0123456789abcdefX","sp":"a b"}"#,
        )
        .unwrap();
        let at = |p: &str| Pointer::parse(p).unwrap();
        let key = |p: &str| IdempotencyKey::from_json(&doc, &at(p), 16);
        assert_eq!(
            key("/ref").unwrap().unwrap(),
            IdempotencyKey::parse(b"r-1", 16).unwrap()
        );
        assert_eq!(key("/n").unwrap().unwrap().as_str(), "12345");
        assert!(key("/missing").unwrap().is_none());
        for bad in ["/obj", "/long", "/sp"] {
            let e = key(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn derived_keys_follow_the_canonical_values() {
        let secret = KeySecret::new("0123456789abcdef-secret").unwrap();
        let other = KeySecret::new("fedcba9876543210-secret").unwrap();
        let fields = [
            Pointer::parse("/merchant").unwrap(),
            Pointer::parse("/amount").unwrap(),
        ];
        let key = |body: &str, secret: &KeySecret| {
            let doc = crate::record::json::parse(body.as_bytes()).unwrap();
            IdempotencyKey::derived(&doc, &fields, secret)
        };
        let a = key(r#"{"merchant":"m1","amount":100,"ts":1}"#, &secret).unwrap();
        let b = key(r#"{"ts":2,"amount":1.0e2,"merchant":"m1"}"#, &secret).unwrap();
        assert_eq!(
            a, b,
            "key order, number spelling and other fields do not matter"
        );
        assert_ne!(
            a,
            key(r#"{"merchant":"m1","amount":101}"#, &secret).unwrap()
        );
        assert_ne!(a, key(r#"{"merchant":"m1","amount":100}"#, &other).unwrap());
        assert!(
            key(r#"{"merchant":"m1"}"#, &secret).is_none(),
            "a missing field: no key"
        );
    }

    #[test]
    fn scope_cookies_separate_sessions_and_ignore_other_cookies() {
        let k = key("k1").unwrap();
        let cookies = ["session_id".to_string()];
        let jar = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(http::header::COOKIE, HeaderValue::from_static(v));
            h
        };
        let a = k.scoped(&jar("session_id=s1; theme=dark"), &[], &cookies);
        assert_eq!(
            a,
            k.scoped(&jar("theme=light;session_id=s1"), &[], &cookies)
        );
        assert_ne!(
            a,
            k.scoped(&jar("session_id=s2; theme=dark"), &[], &cookies)
        );
        assert_ne!(a, k.scoped(&HeaderMap::new(), &[], &cookies));
        assert_eq!(
            k.scoped(&jar("session_id=s1"), &[], &[]),
            k.scoped(&HeaderMap::new(), &[], &[]),
            "cookies scope nothing unless named"
        );
    }
}
