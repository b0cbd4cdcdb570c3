//! The parsers' entry points for the fuzz targets in `fuzz/` (cargo-fuzz): one function per
//! target runs the target's whole body on arbitrary bytes and panics only when an invariant
//! breaks. Compiled with the `fuzzing` feature (the fuzz crate turns it on) and in tests, which
//! replay every seed of `fuzz/corpus/` through the same functions. How to run them:
//! docs/security.md, "Fuzzing".

#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::indexing_slicing,
    reason = "a fuzz target reports a broken invariant by panicking; no request reaches it"
)]

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};

use crate::config::Config;
use crate::idempotency::Routes;
use crate::record::json::{self, hash_canonical, Json, Pointer};
use crate::record::key::ScopedKey;
use crate::record::key::{IdempotencyKey, KeySecret, IDEMPOTENCY_KEY};
use crate::record::EntryState;
use crate::store::{codec, Seal, SealKeys, SealMode};

// === key ===

/// The key's parsers: `data` is a header value, then after a newline a JSON pointer, then after
/// another newline a JSON body. The header value is read as `Idempotency-Key` (bare and as an
/// sf-string), the body's key at the pointer as `key_from_body` reads it, and a derived key from
/// the field at the pointer.
pub fn key(data: &[u8]) {
    let mut parts = data.splitn(3, |&b| b == b'\n');
    let header = parts.next().unwrap_or_default();
    for max_len in [16, 255] {
        header_key(header, max_len);
    }
    if let (Some(pointer), Some(body)) = (parts.next(), parts.next()) {
        body_key(pointer, body, 255);
    }
}

/// A valid key: 1 to `max_len` visible ASCII characters.
fn assert_valid(key: &IdempotencyKey, max_len: usize) {
    let s = key.as_str();
    assert!(!s.is_empty() && s.len() <= max_len, "{s:?}: length");
    assert!(s.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{s:?}");
}

/// `key` as an sf-string: quoted, with `"` and `\` escaped.
fn sf_string(key: &str) -> String {
    let mut out = String::from("\"");
    for c in key.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

fn header_key(raw: &[u8], max_len: usize) {
    let parsed = IdempotencyKey::parse(raw, max_len);
    let quoted = parsed.as_ref().ok().map(|key| {
        assert_valid(key, max_len);
        // The sf-string form, with blanks around it, is the same key.
        let quoted = format!(" \t{} ", sf_string(key.as_str()));
        let again = IdempotencyKey::parse(quoted.as_bytes(), max_len);
        assert_eq!(again.as_ref().ok(), Some(key), "{quoted:?}");
        quoted
    });
    let Ok(value) = HeaderValue::from_bytes(raw) else {
        return;
    };
    let other = HeaderName::from_static("x-idempotency-key");
    let names = [IDEMPOTENCY_KEY, other.clone()];
    let mut headers = HeaderMap::new();
    headers.insert(IDEMPOTENCY_KEY, value.clone());
    let found = IdempotencyKey::from_headers(&headers, &names, max_len);
    match (&parsed, &found) {
        (Ok(key), Ok(Some(got))) => assert_eq!(key, got),
        (Err(_), Err(_)) => {}
        _ => panic!("parse {parsed:?}, from_headers {found:?}"),
    }
    if let (Ok(key), Some(quoted)) = (&parsed, quoted) {
        // The same key under a second name, spelt another way, is that key.
        let quoted = HeaderValue::from_str(&quoted).expect("visible ASCII");
        headers.insert(other, quoted);
        let found = IdempotencyKey::from_headers(&headers, &names, max_len);
        assert_eq!(found.ok().flatten().as_ref(), Some(key));
    }
    let mut twice = HeaderMap::new();
    twice.append(IDEMPOTENCY_KEY, value.clone());
    twice.append(IDEMPOTENCY_KEY, value);
    assert!(IdempotencyKey::from_headers(&twice, &names, max_len).is_err());
}

fn body_key(pointer: &[u8], body: &[u8], max_len: usize) {
    let Ok(text) = std::str::from_utf8(pointer) else {
        return;
    };
    let Ok(pointer) = Pointer::parse(text) else {
        return;
    };
    assert_eq!(pointer.as_str(), text);
    let Ok(doc) = json::parse(body) else {
        return;
    };
    let at = pointer.get(&doc);
    match IdempotencyKey::from_json(&doc, &pointer, max_len) {
        Ok(Some(key)) => {
            assert_valid(&key, max_len);
            let raw = match at {
                Some(Json::String(s)) => s.value().into_owned(),
                Some(Json::Number(n)) => n.as_str().to_string(),
                other => panic!("a key from {other:?}"),
            };
            assert_eq!(key.as_str(), raw);
        }
        Ok(None) => assert!(at.is_none()),
        Err(_) => assert!(at.is_some()),
    }
    let secret = KeySecret::new("fuzzing-secret-0123456789").expect("long enough");
    let derived = IdempotencyKey::derived(&doc, std::slice::from_ref(&pointer), &secret);
    assert_eq!(derived.is_some(), at.is_some());
    // Ignoring the field at the pointer changes the canonical form exactly when there is one
    // (a `*` token matches any array index there, but is no index for `get`).
    if !text.is_empty() && !text.split('/').any(|t| t == "*") {
        let ignored = digest(&doc, std::slice::from_ref(&pointer));
        assert_eq!(ignored == digest(&doc, &[]), at.is_none(), "{text:?}");
    }
}

// === record ===

/// The key whose records the `record` target opens, and the sealing key it opens them with.
const SEALED_KEY: ScopedKey = ScopedKey([5; 32]);
const SEAL_KEYS: &str = "fuzz:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

/// The codec of a store that seals with [`SEAL_KEYS`].
fn sealing() -> &'static codec::Codec {
    static CODEC: std::sync::OnceLock<codec::Codec> = std::sync::OnceLock::new();
    CODEC.get_or_init(|| {
        let keys = SealKeys::parse(SEAL_KEYS).expect("a valid key list");
        codec::Codec::new(false, Seal::new(SealMode::On, Some(keys)).expect("keys"))
    })
}

/// The record decoder: `data` is bytes read from a store. A record that decodes is encoded
/// again (plain and compressed) and read back as the same entry; read as [`SEALED_KEY`]'s
/// record by a sealing store, one that opens is sealed again and opens for that key only.
pub fn record(data: &[u8]) {
    sealed(data);
    let Ok((entry, token)) = codec::decode(Bytes::copy_from_slice(data)) else {
        return;
    };
    let again = codec::encode(&entry.fingerprint, &token, &entry.state);
    for encoded in [
        again.clone(),
        codec::encode_with(&entry.fingerprint, &token, &entry.state, true),
    ] {
        let (read, read_token) = codec::decode(encoded).expect("the codec reads its own records");
        assert_eq!(read_token, token);
        assert_eq!(read.fingerprint, entry.fingerprint);
        let written = codec::encode(&read.fingerprint, &read_token, &read.state);
        assert_eq!(timeless(&written), timeless(&again));
    }
}

fn sealed(data: &[u8]) {
    let codec = sealing();
    let Ok((entry, token)) = codec.decode(&SEALED_KEY, Bytes::copy_from_slice(data)) else {
        return;
    };
    if matches!(entry.state, EntryState::InFlight) {
        return;
    }
    let again = codec
        .record(&SEALED_KEY, &entry.fingerprint, &token, &entry.state)
        .into_bytes();
    let (read, read_token) = codec
        .decode(&SEALED_KEY, again.clone())
        .expect("a sealing store opens its own records");
    assert_eq!(read_token, token);
    assert_eq!(read.fingerprint, entry.fingerprint);
    assert!(
        codec.decode(&ScopedKey([6; 32]), again).is_err(),
        "a sealed record opens for another key"
    );
}

/// An encoded entry without its written-at time (the time it was encoded).
fn timeless(encoded: &[u8]) -> Vec<u8> {
    let mut bytes = encoded.to_vec();
    bytes[codec::WRITTEN_AT..codec::HEADER_LEN].fill(0);
    bytes
}

// === config ===

/// The configuration: `data` is a TOML file, read as `idemgate --config` reads it (through
/// figment, without the environment) and as [`Config::from_toml`] reads it, with and without a
/// key secret. Both readings accept the same files; a configuration that validates builds its
/// route table.
///
/// Validation reads the certificate files a configuration names; a document that names an
/// absolute path or one with `..` in a `*_file` field is left out, so that no input reads
/// `/dev/zero` or blocks on a pipe.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let parsed = toml::from_str::<toml::Table>(text);
    if parsed.as_ref().is_ok_and(names_outside_files) {
        return;
    }
    let mut configs = vec![
        Config::from_toml(text),
        Config::from_toml_with_key_secret(text, Some(b"fuzzing-secret-0123456789")),
    ];
    if parsed.is_ok() {
        use figment::providers::{Format, Toml};
        let figment = figment::Figment::from(Toml::string(text));
        let loaded = Config::from_figment(figment, Default::default());
        // (A document that writes the marker itself is refused where it is a secret, and
        // would not read back where it is not.)
        if let (Ok((config, sources)), false) = (&loaded, text.contains(crate::store::REDACTED)) {
            round_trips(config, sources);
        }
        let loaded = loaded.map(|(config, _)| config);
        // The binary accepts the files that `from_toml` accepts, and no others.
        assert_eq!(
            loaded.is_ok(),
            configs[0].is_ok(),
            "figment: {:?}, from_toml: {:?}",
            loaded.as_ref().err().map(|e| e.to_string()),
            configs[0].as_ref().err().map(|e| e.to_string()),
        );
        configs.push(loaded);
    }
    for config in configs.iter().flatten() {
        let shown = format!("{config:#?} {}", config.store.describe());
        assert!(!shown.is_empty());
        let routes = Routes::from_config(&config.defaults, config.route_policies());
        for route in &config.routes {
            routes.policy_for(&route.path);
        }
    }
}

/// What `check-config` prints for `config` reads back as the same configuration, which prints
/// the same (a printed secret is refused, naming its field, as it cannot be read back).
fn round_trips(config: &Config, sources: &crate::config::Sources) {
    use crate::store::REDACTED;
    use figment::providers::{Format, Toml};
    let printed = config.effective_toml(sources, "fuzz");
    if let Err(e) = Config::from_toml(&printed) {
        let refused = printed.contains(REDACTED) && e.to_string().contains("redacted");
        assert!(refused, "{e}\n{printed}");
    }
    // Every secret given again: the same configuration (whose Debug shows no secret).
    let given = printed.replace(REDACTED, "a-secret-given-again-0123456789");
    let figment = figment::Figment::from(Toml::string(&given));
    let (again, sources) = Config::from_figment(figment, Default::default())
        .unwrap_or_else(|e| panic!("{e}\n{given}"));
    assert_eq!(format!("{config:?}"), format!("{again:?}"), "{given}");
    let reprinted = again.effective_toml(&sources, "fuzz");
    let values = crate::config::effective_values;
    assert_eq!(values(&printed), values(&reprinted));
}

/// Whether a `*_file` field anywhere in `table` names an absolute path or climbs with `..`.
fn names_outside_files(table: &toml::Table) -> bool {
    table.iter().any(|(name, value)| match value {
        toml::Value::String(path) => {
            name.ends_with("_file") && (path.starts_with('/') || path.contains(".."))
        }
        toml::Value::Table(t) => names_outside_files(t),
        toml::Value::Array(items) => items.iter().any(|item| match item {
            toml::Value::Table(t) => names_outside_files(t),
            _ => false,
        }),
        _ => false,
    })
}

// === json ===

/// The JSON parser and its canonical form: `data` is a request body. serde_json must agree on
/// what is JSON (but for what ours refuses on purpose: duplicate keys, deep nesting, huge
/// exponents) and on the values; a document respelt (other escapes, member order, number
/// spelling, whitespace) or re-serialised by serde_json hashes the same.
pub fn json(data: &[u8]) {
    let ours = json::parse(data);
    let theirs = serde_json::from_slice::<serde_json::Value>(data);
    let doc = match (ours, theirs) {
        (Ok(doc), Ok(value)) => {
            if same_tree(&doc, &value) {
                // Every number was an integer serde_json holds exactly.
                let text = serde_json::to_vec(&value).expect("a Value serialises");
                let again = json::parse(&text).expect("serde_json writes JSON");
                assert_eq!(digest(&again, &[]), digest(&doc, &[]), "{text:?}");
            }
            doc
        }
        (Ok(doc), Err(e)) => {
            let why = e.to_string();
            let on_purpose = ["number out of range", "recursion limit exceeded"];
            assert!(on_purpose.iter().any(|w| why.contains(w)), "{why}");
            doc
        }
        (Err(e), Ok(_)) => {
            let why = e.to_string();
            let on_purpose = ["appears twice", "nested deeper", "exponent out of range"];
            assert!(on_purpose.iter().any(|w| why.contains(w)), "{why}");
            return;
        }
        (Err(_), Err(_)) => return,
    };
    let mut text = String::new();
    if respell(&doc, &mut text).is_some() {
        let again = json::parse(text.as_bytes()).expect("a respelt document parses");
        assert_eq!(digest(&again, &[]), digest(&doc, &[]), "{text}");
    }
}

/// The SHA-256 of `doc`'s canonical form, leaving out `ignore`.
fn digest(doc: &Json<'_>, ignore: &[Pointer]) -> [u8; 32] {
    let mut h = Sha256::new();
    hash_canonical(doc, ignore, &mut h);
    h.finalize().into()
}

/// Assert that serde_json read the same tree as ours; whether its numbers are exact (none was
/// read as a float).
fn same_tree(ours: &Json<'_>, theirs: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (ours, theirs) {
        (Json::Null, Value::Null) => true,
        (Json::Bool(a), Value::Bool(b)) => {
            assert_eq!(a, b);
            true
        }
        (Json::String(a), Value::String(b)) => {
            assert_eq!(a.value(), b.as_str());
            true
        }
        (Json::Number(_), Value::Number(b)) if b.is_f64() => false,
        (Json::Number(a), Value::Number(b)) => {
            let text = b.to_string();
            let b = json::parse(text.as_bytes()).expect("an integer");
            let a = Json::Number(a.clone());
            assert_eq!(digest(&a, &[]), digest(&b, &[]), "{a:?} against {text}");
            true
        }
        (Json::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len());
            a.iter()
                .zip(b)
                .fold(true, |exact, (a, b)| same_tree(a, b) & exact)
        }
        (Json::Object(a), Value::Object(b)) => {
            assert_eq!(a.len(), b.len());
            a.iter().fold(true, |exact, (k, a)| {
                let b = b.get(k.as_ref()).expect("the same keys");
                same_tree(a, b) & exact
            })
        }
        (a, b) => panic!("ours read {a:?} where serde_json read {b:?}"),
    }
}

/// Write `doc` spelt otherwise: every string character escaped, members in reverse order,
/// numbers as `0.DIGITS0E±N`, blanks between tokens; `None` when a number's exponent would
/// leave the accepted range.
fn respell(doc: &Json<'_>, out: &mut String) -> Option<()> {
    match doc {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => out.push_str(&respell_number(n.as_str())?),
        Json::String(s) => escape_all(&s.value(), out),
        Json::Array(items) => {
            out.push_str("[ ");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(" ,\n");
                }
                respell(item, out)?;
            }
            out.push_str(" ]");
        }
        Json::Object(members) => {
            out.push_str("{\t");
            for (i, (k, v)) in members.iter().rev().enumerate() {
                if i > 0 {
                    out.push_str("\r\n,");
                }
                escape_all(k, out);
                out.push_str(" : ");
                respell(v, out)?;
            }
            out.push('}');
        }
    }
    Some(())
}

/// A number as `0.` and all its digits with a zero more, and the exponent that keeps its value:
/// `-12.5e3` is `-0.1250E+5`.
fn respell_number(text: &str) -> Option<String> {
    let (sign, rest) = text.strip_prefix('-').map_or(("", text), |r| ("-", r));
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i128>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let exponent = exponent + int.len() as i128;
    // The parser takes exponents of at most 18 significant digits.
    (exponent.unsigned_abs() < 10u128.pow(18)).then(|| format!("{sign}0.{int}{frac}0E{exponent:+}"))
}

/// `s` as a JSON string with every character a `\u` escape (a surrogate pair beyond the BMP).
fn escape_all(s: &str, out: &mut String) {
    use std::fmt::Write;
    out.push('"');
    for c in s.chars() {
        let mut units = [0u16; 2];
        for unit in c.encode_utf16(&mut units) {
            write!(out, "\\u{unit:04X}").expect("writing to a String");
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    use http::StatusCode;

    use super::*;
    use crate::record::fingerprint::Fingerprint;
    use crate::record::key::KeySource;
    use crate::record::{StoredResponse, Token, Tombstone};

    /// A target's function.
    type Target = fn(&[u8]);

    /// Every target by name, as `fuzz/fuzz_targets/NAME.rs` and `fuzz/corpus/NAME/` name it.
    const TARGETS: [(&str, Target); 4] = [
        ("key", key),
        ("record", record),
        ("config", config),
        ("json", json),
    ];

    fn fuzz_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
    }

    /// The files of `dir` (none when it does not exist).
    fn files(dir: &Path) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut files: Vec<PathBuf> = entries
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        files
    }

    /// Run `target` on every seed of its corpus (inputs that once found a bug included): how
    /// many, and the files it panicked on.
    fn replay(name: &str, target: Target) -> (usize, Vec<String>) {
        let corpus = files(&fuzz_dir().join("corpus").join(name));
        let mut failed = Vec::new();
        for file in &corpus {
            let data = std::fs::read(file).unwrap();
            if std::panic::catch_unwind(|| target(&data)).is_err() {
                failed.push(file.display().to_string());
            }
        }
        (corpus.len(), failed)
    }

    #[test]
    fn every_target_runs_clean_on_its_corpus() {
        let mut failed = Vec::new();
        for (name, target) in TARGETS {
            let (seeds, panicked) = replay(name, target);
            assert!(seeds >= 5, "fuzz/corpus/{name}/ has {seeds} seeds");
            failed.extend(panicked);
        }
        assert!(failed.is_empty(), "panicked on: {failed:#?}");
    }

    #[test]
    fn every_fuzz_target_is_replayed_here() {
        let mut names: Vec<String> = files(&fuzz_dir().join("fuzz_targets"))
            .iter()
            .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let mut ours: Vec<&str> = TARGETS.iter().map(|(n, _)| *n).collect();
        ours.sort();
        assert_eq!(names, ours);
    }

    /// A record as the codec writes it, at a fixed time.
    fn encoded(state: EntryState) -> Vec<u8> {
        let mut bytes = codec::encode(&Fingerprint([7; 32]), &Token([9; 16]), &state).to_vec();
        bytes[codec::WRITTEN_AT..codec::HEADER_LEN]
            .copy_from_slice(&1_700_000_000_000u64.to_be_bytes());
        bytes
    }

    fn response(body: &[u8], key_source: Option<KeySource>) -> StoredResponse {
        StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (
                    HeaderName::from_static("content-type"),
                    HeaderValue::from_static("application/json"),
                ),
                (
                    HeaderName::from_static("set-cookie"),
                    HeaderValue::from_static("a=1"),
                ),
                (
                    HeaderName::from_static("set-cookie"),
                    HeaderValue::from_static("b=2; Path=/"),
                ),
            ],
            body: Bytes::copy_from_slice(body),
            trailers: Vec::new(),
            traceparent: Some(HeaderValue::from_static(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )),
            key_source,
        }
    }

    /// A gRPC answer's record: its status and trailing metadata in trailers.
    fn grpc_response() -> StoredResponse {
        let field = |n: &'static str, v: &'static str| {
            (HeaderName::from_static(n), HeaderValue::from_static(v))
        };
        StoredResponse {
            status: StatusCode::OK,
            headers: vec![field("content-type", "application/grpc")],
            body: Bytes::from_static(b"\0\0\0\0\x02ok"),
            trailers: vec![
                field("grpc-status", "5"),
                field("grpc-message", "not%20found"),
                field("x-trail", "a"),
            ],
            traceparent: None,
            key_source: Some(KeySource::Header),
        }
    }

    /// A completed record of an older version, as that version wrote it: status 201, one
    /// header, and (version 2) an empty traceparent.
    fn older(version: u8) -> Vec<u8> {
        let mut raw = vec![version, codec::COMPLETED];
        raw.extend_from_slice(&[7; 32]);
        raw.extend_from_slice(&[9; 16]);
        if version >= 2 {
            raw.extend_from_slice(&1_700_000_000_000u64.to_be_bytes());
        }
        raw.extend_from_slice(&201u16.to_be_bytes());
        raw.extend_from_slice(&1u16.to_be_bytes());
        raw.extend_from_slice(&1u16.to_be_bytes());
        raw.extend_from_slice(b"x");
        raw.extend_from_slice(&1u32.to_be_bytes());
        raw.extend_from_slice(b"y");
        if version >= 2 {
            raw.push(0);
        }
        raw.extend_from_slice(b"{\"id\":1}");
        raw
    }

    /// The length of the encoding of `state` before its body.
    fn head_len(state: &EntryState, compress: bool) -> usize {
        codec::encode_parts(&Fingerprint([7; 32]), &Token([9; 16]), state, compress)
            .head
            .len()
    }

    /// `raw` with `bytes` written over it from `at`.
    fn patched(mut raw: Vec<u8>, at: usize, bytes: &[u8]) -> Vec<u8> {
        raw[at..at + bytes.len()].copy_from_slice(bytes);
        raw
    }

    /// The record seeds: records the codec writes, records of the older versions it still
    /// reads, and near misses.
    fn record_seeds() -> Vec<(&'static str, Vec<u8>)> {
        let completed = |r| EntryState::Completed(Arc::new(r));
        let json: Vec<u8> = (0..100)
            .flat_map(|i| format!("{{\"id\":\"pi_{i:04}\",\"ok\":true}},").into_bytes())
            .collect();
        let big = completed(response(&json, None));
        let mut packed =
            codec::encode_with(&Fingerprint([7; 32]), &Token([9; 16]), &big, true).to_vec();
        assert_eq!(packed[codec::STATE_AT], codec::COMPRESSED);
        packed[codec::WRITTEN_AT..codec::HEADER_LEN]
            .copy_from_slice(&1_700_000_000_000u64.to_be_bytes());
        let expanded_at = head_len(&big, true);
        let full = completed(response(b"{\"id\":\"pay_1\"}", Some(KeySource::Body)));
        let key_source_at = head_len(&full, false) - 1;
        let full = encoded(full);
        // The first header's name length, and its value's length.
        let name_at = codec::HEADER_LEN + 4;
        let value_at = name_at + 2 + "content-type".len();
        let bare = StoredResponse {
            status: StatusCode::OK,
            headers: Vec::new(),
            body: Bytes::new(),
            trailers: Vec::new(),
            traceparent: None,
            key_source: None,
        };
        let grpc = completed(grpc_response());
        // The trailer count follows the key-source byte; the trailers end the head.
        let trailer_bytes: usize = (grpc_response().trailers.iter())
            .map(|(n, v)| 6 + n.as_str().len() + v.len())
            .sum();
        let trailers_at = head_len(&grpc, false) - 2 - trailer_bytes;
        let grpc = encoded(grpc);
        let tombstone =
            |status, expired_ms| encoded(EntryState::Expired(Tombstone { status, expired_ms }));
        let in_flight = encoded(EntryState::InFlight);
        vec![
            ("in-flight", in_flight.clone()),
            ("not-replayable", encoded(EntryState::NotReplayable)),
            (
                "tombstone",
                tombstone(Some(StatusCode::CREATED), 1_700_000_000_000),
            ),
            ("tombstone-not-replayable", tombstone(None, 1)),
            ("completed", full.clone()),
            ("completed-bare", encoded(completed(bare))),
            (
                "completed-header-key",
                encoded(completed(response(b"[]", Some(KeySource::Header)))),
            ),
            (
                "completed-derived-key",
                encoded(completed(response(b"", Some(KeySource::Derived)))),
            ),
            ("compressed", packed.clone()),
            ("version-1", older(1)),
            ("version-2", older(2)),
            ("truncated", full[..full.len() - 20].to_vec()),
            (
                "header-count-65535",
                patched(full.clone(), name_at - 2, &[0xff; 2]),
            ),
            (
                "header-name-65535",
                patched(full.clone(), name_at, &[0xff; 2]),
            ),
            (
                "header-value-4GiB",
                patched(full.clone(), value_at, &[0xff; 4]),
            ),
            ("key-source-4", patched(full.clone(), key_source_at, &[4])),
            ("completed-trailers", grpc.clone()),
            (
                "trailer-count-65535",
                patched(grpc.clone(), trailers_at, &[0xff; 2]),
            ),
            (
                "trailers-announced-none-follow",
                patched(full.clone(), key_source_at, &[0x82]),
            ),
            (
                "compressed-claims-1GiB",
                patched(packed.clone(), expanded_at, &(1u32 << 30).to_le_bytes()),
            ),
            (
                "compressed-corrupt",
                patched(packed.clone(), packed.len() - 8, &[0xff; 8]),
            ),
            (
                "unknown-state",
                patched(in_flight.clone(), codec::STATE_AT, b"Q"),
            ),
            ("unknown-version", patched(in_flight.clone(), 0, &[9])),
            ("tombstone-short", patched(in_flight, codec::STATE_AT, b"X")),
        ]
    }

    /// What a record reads as: its entry written again (at no time), or the bytes of one that
    /// does not read.
    fn reads_as(raw: &[u8]) -> Result<Vec<u8>, Vec<u8>> {
        match codec::decode(Bytes::copy_from_slice(raw)) {
            Ok((entry, token)) => Ok(timeless(&codec::encode(
                &entry.fingerprint,
                &token,
                &entry.state,
            ))),
            Err(_) => Err(raw.to_vec()),
        }
    }

    /// The record seeds in `fuzz/corpus/record/` are the codec's own: each reads as the record
    /// it was made from. `IDEMGATE_WRITE_SEEDS=1 cargo test --lib fuzzing` writes them again.
    #[test]
    fn the_record_seeds_are_the_codecs_own() {
        let dir = fuzz_dir().join("corpus").join("record");
        let write = std::env::var_os("IDEMGATE_WRITE_SEEDS").is_some();
        for (name, raw) in record_seeds() {
            let path = dir.join(name);
            if write {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &raw).unwrap();
                continue;
            }
            let committed = std::fs::read(&path).unwrap_or_else(|e| {
                panic!("{}: {e} (IDEMGATE_WRITE_SEEDS=1 writes it)", path.display())
            });
            assert_eq!(reads_as(&committed), reads_as(&raw), "{name}");
        }
    }

    #[test]
    fn the_sealed_seeds_open_with_the_targets_key_and_no_other() {
        let path = fuzz_dir()
            .join("corpus")
            .join("record")
            .join("sealed-completed");
        let codec = sealing();
        if std::env::var_os("IDEMGATE_WRITE_SEEDS").is_some() {
            let state = EntryState::Completed(Arc::new(response(b"{\"id\":\"pay_1\"}", None)));
            let sealed = codec.record(&SEALED_KEY, &Fingerprint([7; 32]), &Token([9; 16]), &state);
            std::fs::write(&path, sealed.into_bytes()).unwrap();
        }
        let raw = Bytes::from(std::fs::read(&path).unwrap());
        assert_eq!(raw[0], 4, "sealed");
        assert!(codec.decode(&SEALED_KEY, raw.clone()).is_ok());
        assert!(codec.decode(&ScopedKey([6; 32]), raw.clone()).is_err());
        assert!(
            codec::decode(raw).is_err(),
            "the clear decoder does not read it"
        );
    }

    #[test]
    fn the_targets_catch_what_they_check() {
        // A tree that serde_json reads otherwise is a panic.
        assert!(std::panic::catch_unwind(|| same_tree(
            &json::parse(br#"{"a":[1,"x"]}"#).unwrap(),
            &serde_json::json!({"a": [1, "y"]}),
        ))
        .is_err());
        assert_eq!(
            respell_number("-12.5e3").as_deref(),
            Some("-0.1250E+5"),
            "the respelling keeps the value"
        );
        let mut text = String::new();
        respell(
            &json::parse(br#"{"a":"\u00e9","b":[0.5]}"#).unwrap(),
            &mut text,
        )
        .unwrap();
        assert_eq!(
            text,
            "{\t\"\\u0062\" : [ 0.050E+1 ]\r\n,\"\\u0061\" : \"\\u00E9\"}"
        );
    }
}
