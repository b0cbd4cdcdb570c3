//! JSON bodies: a strict parser into a tree that borrows from the body, the canonical form a
//! `fingerprint = "json"` route hashes, and JSON pointers (RFC 6901) into the tree.
//!
//! The canonical form: object members sorted by key (Unicode code point order, which is UTF-8
//! byte order), whitespace ignored, strings compared after unescaping (no Unicode
//! normalisation), numbers compared by exact decimal value (`1`, `1.0` and `1e0` are equal, `-0`
//! equals `0`, and no value is rounded through floating point). A body that does not parse, has
//! two members with one key (after unescaping), nests deeper than [`MAX_DEPTH`] or has an
//! exponent beyond ±10^18 is refused. The form is fed to the hasher as tagged, length-prefixed
//! pieces, never built as a second copy of the body.

use std::borrow::Cow;

use sha2::digest::Update;

/// The deepest nesting of arrays and objects accepted.
pub const MAX_DEPTH: usize = 128;

/// Why a body is not acceptable JSON; the message is shown to the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the body is not valid JSON: {0}")]
pub struct JsonError(pub String);

fn err<T>(what: impl Into<String>) -> Result<T, JsonError> {
    Err(JsonError(what.into()))
}

/// A parsed JSON value, borrowing unescaped strings from the body.
#[derive(Debug, Clone, PartialEq)]
pub enum Json<'a> {
    /// `null`
    Null,
    /// `true` or `false`
    Bool(bool),
    /// A number: its text as written, and its canonical form.
    Number {
        /// As written in the body.
        text: &'a str,
        /// Exact decimal value: `0`, or an optional `-`, the significant digits and `e` with
        /// the exponent of the last digit (`150` is `15e1`, `0.05` is `5e-2`).
        canonical: String,
    },
    /// A string, unescaped.
    String(Cow<'a, str>),
    /// An array.
    Array(Vec<Json<'a>>),
    /// An object, its members sorted by key.
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
}

/// Parse `body` as one JSON value.
pub fn parse(body: &[u8]) -> Result<Json<'_>, JsonError> {
    let text = std::str::from_utf8(body).map_err(|_| JsonError("not UTF-8".into()))?;
    let mut p = Parser {
        text,
        bytes: body,
        at: 0,
    };
    p.skip_ws();
    let value = p.value(0)?;
    p.skip_ws();
    if p.at != p.bytes.len() {
        return err(format!("unexpected data at byte {}", p.at));
    }
    Ok(value)
}

struct Parser<'a> {
    text: &'a str,
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Parser<'a> {
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.at) {
            self.at += 1;
        }
    }

    fn expect(&mut self, word: &str) -> Result<(), JsonError> {
        if self.text[self.at..].starts_with(word) {
            self.at += word.len();
            Ok(())
        } else {
            err(format!("unexpected data at byte {}", self.at))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Json<'a>, JsonError> {
        match self.bytes.get(self.at) {
            None => err("unexpected end"),
            Some(b'n') => self.expect("null").map(|_| Json::Null),
            Some(b't') => self.expect("true").map(|_| Json::Bool(true)),
            Some(b'f') => self.expect("false").map(|_| Json::Bool(false)),
            Some(b'"') => self.string().map(Json::String),
            Some(b'[') => self.array(depth + 1),
            Some(b'{') => self.object(depth + 1),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => err(format!("unexpected data at byte {}", self.at)),
        }
    }

    fn array(&mut self, depth: usize) -> Result<Json<'a>, JsonError> {
        if depth > MAX_DEPTH {
            return err(format!("nested deeper than {MAX_DEPTH}"));
        }
        self.at += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.bytes.get(self.at) == Some(&b']') {
            self.at += 1;
            return Ok(Json::Array(items));
        }
        loop {
            self.skip_ws();
            items.push(self.value(depth)?);
            self.skip_ws();
            match self.bytes.get(self.at) {
                Some(b',') => self.at += 1,
                Some(b']') => {
                    self.at += 1;
                    return Ok(Json::Array(items));
                }
                _ => return err(format!("expected ',' or ']' at byte {}", self.at)),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Json<'a>, JsonError> {
        if depth > MAX_DEPTH {
            return err(format!("nested deeper than {MAX_DEPTH}"));
        }
        self.at += 1;
        let mut members: Vec<(Cow<'a, str>, Json<'a>)> = Vec::new();
        self.skip_ws();
        if self.bytes.get(self.at) == Some(&b'}') {
            self.at += 1;
            return Ok(Json::Object(members));
        }
        loop {
            self.skip_ws();
            if self.bytes.get(self.at) != Some(&b'"') {
                return err(format!("expected a member name at byte {}", self.at));
            }
            let key = self.string()?;
            self.skip_ws();
            if self.bytes.get(self.at) != Some(&b':') {
                return err(format!("expected ':' at byte {}", self.at));
            }
            self.at += 1;
            self.skip_ws();
            let value = self.value(depth)?;
            members.push((key, value));
            self.skip_ws();
            match self.bytes.get(self.at) {
                Some(b',') => self.at += 1,
                Some(b'}') => {
                    self.at += 1;
                    break;
                }
                _ => return err(format!("expected ',' or '}}' at byte {}", self.at)),
            }
        }
        members.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = members.windows(2).find(|w| w[0].0 == w[1].0) {
            return err(format!(
                "the member {:?} appears twice in one object",
                w[0].0
            ));
        }
        Ok(Json::Object(members))
    }

    fn string(&mut self) -> Result<Cow<'a, str>, JsonError> {
        let start = self.at + 1;
        let mut i = start;
        // Fast path: no escape, the string borrows from the body.
        loop {
            match self.bytes.get(i) {
                None => return err("unterminated string"),
                Some(b'"') => {
                    self.at = i + 1;
                    return Ok(Cow::Borrowed(&self.text[start..i]));
                }
                Some(b'\\') => break,
                Some(0..=0x1f) => return err(format!("control character in a string at byte {i}")),
                Some(_) => i += 1,
            }
        }
        let mut out = String::from(&self.text[start..i]);
        loop {
            match self.bytes.get(i) {
                None => return err("unterminated string"),
                Some(b'"') => {
                    self.at = i + 1;
                    return Ok(Cow::Owned(out));
                }
                Some(b'\\') => {
                    let c = match self.bytes.get(i + 1) {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => {
                            let (c, used) = self.unicode_escape(i)?;
                            out.push(c);
                            i += used;
                            continue;
                        }
                        _ => return err(format!("invalid escape at byte {i}")),
                    };
                    out.push(c);
                    i += 2;
                }
                Some(0..=0x1f) => return err(format!("control character in a string at byte {i}")),
                Some(_) => {
                    // Copy the run up to the next quote or backslash.
                    let run = self.bytes[i..]
                        .iter()
                        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
                        .unwrap_or(self.bytes.len() - i);
                    out.push_str(&self.text[i..i + run]);
                    i += run;
                }
            }
        }
    }

    /// The character of a `\uXXXX` escape at `i` (a surrogate pair takes two), and the bytes it
    /// took.
    fn unicode_escape(&self, i: usize) -> Result<(char, usize), JsonError> {
        let hex = |at: usize| -> Result<u32, JsonError> {
            let digits = self
                .text
                .get(at..at + 4)
                .ok_or_else(|| JsonError("truncated \\u escape".into()))?;
            u32::from_str_radix(digits, 16)
                .map_err(|_| JsonError(format!("invalid \\u escape at byte {at}")))
        };
        let first = hex(i + 2)?;
        if (0xD800..0xDC00).contains(&first) {
            if self.bytes.get(i + 6) != Some(&b'\\') || self.bytes.get(i + 7) != Some(&b'u') {
                return err(format!("unpaired surrogate at byte {i}"));
            }
            let second = hex(i + 8)?;
            if !(0xDC00..0xE000).contains(&second) {
                return err(format!("unpaired surrogate at byte {i}"));
            }
            let c = 0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00);
            return Ok((char::from_u32(c).expect("a valid pair"), 12));
        }
        match char::from_u32(first) {
            Some(c) => Ok((c, 6)),
            None => err(format!("unpaired surrogate at byte {i}")),
        }
    }

    fn number(&mut self) -> Result<Json<'a>, JsonError> {
        let start = self.at;
        let b = self.bytes;
        let mut i = start;
        let negative = b.get(i) == Some(&b'-');
        if negative {
            i += 1;
        }
        let int_start = i;
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                while let Some(b'0'..=b'9') = b.get(i) {
                    i += 1;
                }
            }
            _ => return err(format!("invalid number at byte {start}")),
        }
        let int_digits = &self.text[int_start..i];
        let mut frac_digits = "";
        if b.get(i) == Some(&b'.') {
            let f = i + 1;
            i = f;
            while let Some(b'0'..=b'9') = b.get(i) {
                i += 1;
            }
            if i == f {
                return err(format!("invalid number at byte {start}"));
            }
            frac_digits = &self.text[f..i];
        }
        let mut exponent: i128 = 0;
        if let Some(b'e' | b'E') = b.get(i) {
            i += 1;
            let sign: i128 = match b.get(i) {
                Some(b'-') => {
                    i += 1;
                    -1
                }
                Some(b'+') => {
                    i += 1;
                    1
                }
                _ => 1,
            };
            let e = i;
            while let Some(b'0'..=b'9') = b.get(i) {
                i += 1;
            }
            if i == e {
                return err(format!("invalid number at byte {start}"));
            }
            let digits = self.text[e..i].trim_start_matches('0');
            if digits.len() > 18 {
                return err(format!("exponent out of range at byte {start}"));
            }
            exponent = sign * digits.parse::<i128>().unwrap_or(0);
        }
        self.at = i;
        Ok(Json::Number {
            text: &self.text[start..i],
            canonical: canonical_number(negative, int_digits, frac_digits, exponent),
        })
    }
}

/// The exact decimal value of a number as `[-]DIGITSeEXP`, or `0`.
fn canonical_number(negative: bool, int: &str, frac: &str, exponent: i128) -> String {
    let digits: String = int.chars().chain(frac.chars()).collect();
    let significant = digits.trim_start_matches('0');
    if significant.is_empty() {
        return "0".into();
    }
    let trimmed = significant.trim_end_matches('0');
    let dropped = (significant.len() - trimmed.len()) as i128;
    let exp = exponent - frac.len() as i128 + dropped;
    format!("{}{trimmed}e{exp}", if negative { "-" } else { "" })
}

// === pointers ===

/// A JSON pointer (RFC 6901), its reference tokens unescaped. In a `fingerprint_ignore`
/// pattern, the token `*` also matches any array index.
#[derive(Clone, PartialEq, Eq)]
pub struct Pointer {
    text: String,
    tokens: Vec<String>,
}

impl std::fmt::Debug for Pointer {
    /// As written in the config: `"/items/*/client_ts"`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.text, f)
    }
}

impl Pointer {
    /// Parse a pointer: empty (the whole document), or `/`-separated tokens with `~1` for `/`
    /// and `~0` for `~`.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Ok(Pointer {
                text: String::new(),
                tokens: Vec::new(),
            });
        }
        let Some(rest) = text.strip_prefix('/') else {
            return Err(format!(
                "{text:?} is not a JSON pointer: it must start with '/'"
            ));
        };
        let tokens = rest
            .split('/')
            .map(|t| {
                let mut out = String::with_capacity(t.len());
                let mut chars = t.chars();
                while let Some(c) = chars.next() {
                    match c {
                        '~' => match chars.next() {
                            Some('0') => out.push('~'),
                            Some('1') => out.push('/'),
                            _ => {
                                return Err(format!(
                                    "{text:?} is not a JSON pointer: '~' must be followed by 0 or 1"
                                ))
                            }
                        },
                        c => out.push(c),
                    }
                }
                Ok(out)
            })
            .collect::<Result<_, _>>()?;
        Ok(Pointer {
            text: text.to_string(),
            tokens,
        })
    }

    /// The pointer as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The value it points to in `doc`.
    pub fn get<'d, 'a>(&self, doc: &'d Json<'a>) -> Option<&'d Json<'a>> {
        let mut at = doc;
        for token in &self.tokens {
            at = match at {
                Json::Object(members) => members
                    .binary_search_by(|(k, _)| k.as_ref().cmp(token.as_str()))
                    .ok()
                    .map(|i| &members[i].1)?,
                Json::Array(items) => items.get(array_index(token)?)?,
                _ => return None,
            };
        }
        Some(at)
    }
}

/// An array index token: digits without a leading zero.
fn array_index(token: &str) -> Option<usize> {
    if token.is_empty() || (token.len() > 1 && token.starts_with('0')) {
        return None;
    }
    token.parse().ok()
}

// === the canonical form, hashed ===

/// Feed the canonical form of `doc` to `h` (a hasher or a MAC), leaving out what any of
/// `ignore` points to.
pub fn hash_canonical(doc: &Json<'_>, ignore: &[Pointer], h: &mut impl Update) {
    let mut path: Vec<PathStep<'_>> = Vec::new();
    feed(doc, ignore, &mut path, h);
}

#[derive(Clone, Copy)]
enum PathStep<'p> {
    Key(&'p str),
    Index,
}

/// Whether `path` (the steps to a value) is matched by `pattern`.
fn matches(pattern: &Pointer, path: &[PathStep<'_>]) -> bool {
    pattern.tokens.len() == path.len()
        && pattern.tokens.iter().zip(path).all(|(t, step)| match step {
            PathStep::Key(k) => t == k,
            PathStep::Index => t == "*",
        })
}

fn len(h: &mut impl Update, n: usize) {
    h.update(&(n as u64).to_be_bytes());
}

fn feed<'p>(
    value: &'p Json<'_>,
    ignore: &[Pointer],
    path: &mut Vec<PathStep<'p>>,
    h: &mut impl Update,
) {
    match value {
        Json::Null => h.update(b"z"),
        Json::Bool(true) => h.update(b"t"),
        Json::Bool(false) => h.update(b"f"),
        Json::Number { canonical, .. } => {
            h.update(b"n");
            len(h, canonical.len());
            h.update(canonical.as_bytes());
        }
        Json::String(s) => {
            h.update(b"s");
            len(h, s.len());
            h.update(s.as_bytes());
        }
        Json::Array(items) => {
            path.push(PathStep::Index);
            let kept: Vec<&Json<'_>> = if ignore.iter().any(|p| matches(p, path)) {
                Vec::new()
            } else {
                items.iter().collect()
            };
            h.update(b"a");
            len(h, kept.len());
            for item in kept {
                feed(item, ignore, path, h);
            }
            path.pop();
        }
        Json::Object(members) => {
            let mut kept = Vec::with_capacity(members.len());
            for (k, v) in members {
                path.push(PathStep::Key(k));
                if !ignore.iter().any(|p| matches(p, path)) {
                    kept.push((k, v));
                }
                path.pop();
            }
            h.update(b"o");
            len(h, kept.len());
            for (k, v) in kept {
                len(h, k.len());
                h.update(k.as_bytes());
                path.push(PathStep::Key(k));
                feed(v, ignore, path, h);
                path.pop();
            }
        }
    }
}

/// Whether a `Content-Type` says JSON: `application/json` or `*/*+json`, parameters aside.
pub fn is_json_type(content_type: &[u8]) -> bool {
    let Ok(ct) = std::str::from_utf8(content_type) else {
        return false;
    };
    let essence = ct.split(';').next().unwrap_or("").trim();
    let Some((kind, sub)) = essence.split_once('/') else {
        return false;
    };
    !kind.is_empty()
        && (sub.eq_ignore_ascii_case("json") && kind.eq_ignore_ascii_case("application")
            || sub.len() > 5 && sub[sub.len() - 5..].eq_ignore_ascii_case("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn digest(body: &str, ignore: &[&str]) -> [u8; 32] {
        let doc = parse(body.as_bytes()).unwrap();
        let ignore: Vec<Pointer> = ignore.iter().map(|p| Pointer::parse(p).unwrap()).collect();
        let mut h = Sha256::new();
        hash_canonical(&doc, &ignore, &mut h);
        h.finalize().into()
    }

    fn same(a: &str, b: &str) -> bool {
        digest(a, &[]) == digest(b, &[])
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        assert!(same(
            r#"{"a":1,"b":[true,null]}"#,
            "{ \"b\" : [ true , null ] ,\n \"a\" : 1 }"
        ));
        assert!(!same(r#"{"a":1}"#, r#"{"a":2}"#));
        assert!(!same(r#"[1,2]"#, r#"[2,1]"#), "array order matters");
    }

    #[test]
    fn strings_compare_unescaped_without_normalisation() {
        assert!(same(r#"{"k":"é"}"#, r#"{"k":"\u00e9"}"#));
        assert!(same(r#"{"a":"x"}"#, r#"{"\u0061":"x"}"#));
        assert!(same(r#""\ud83d\ude00""#, "\"\u{1F600}\""));
        assert!(
            !same("\"\u{e9}\"", "\"e\u{301}\""),
            "no Unicode normalisation"
        );
        assert!(parse(br#""\ud83d""#).is_err(), "an unpaired surrogate");
        assert!(parse(b"\"a\x01\"").is_err(), "a raw control character");
    }

    #[test]
    fn numbers_compare_by_exact_decimal_value() {
        for (a, b) in [
            ("1", "1.0"),
            ("1", "1e0"),
            ("-0", "0"),
            ("0.0", "-0e5"),
            ("150", "1.5e2"),
            ("0.05", "5E-2"),
        ] {
            assert!(same(a, b), "{a} = {b}");
        }
        assert!(
            !same("9007199254740993", "9007199254740992"),
            "no float rounding"
        );
        assert!(!same("1", "1.0000000000000000000001"));
        assert!(!same("1", "-1"));
        assert!(!same("1", "\"1\""), "a number is not a string");
        assert!(
            parse(b"1e9999999999999999999").is_err(),
            "an exponent out of range"
        );
        for bad in ["01", "1.", ".5", "-", "1e", "+1", "0x1", "NaN"] {
            assert!(parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn duplicate_keys_after_unescaping_are_refused() {
        let e = parse(br#"{"a":1,"\u0061":2}"#).unwrap_err();
        assert!(e.0.contains("appears twice"), "{e}");
        assert!(
            parse(br#"{"a":1,"b":{"a":2}}"#).is_ok(),
            "one key per object"
        );
    }

    #[test]
    fn nesting_is_bounded() {
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(parse(ok.as_bytes()).is_ok());
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert!(parse(deep.as_bytes()).unwrap_err().0.contains("deeper"));
        let very = "[".repeat(100_000);
        assert!(parse(very.as_bytes()).is_err(), "never a stack overflow");
    }

    #[test]
    fn ignored_fields_are_left_out_present_or_not() {
        let ignore = ["/request_id", "/items/*/client_ts"];
        let a = digest(
            r#"{"amount":5,"request_id":"r1","items":[{"sku":"x","client_ts":1}]}"#,
            &ignore,
        );
        let b = digest(
            r#"{"amount":5,"items":[{"sku":"x","client_ts":2}]}"#,
            &ignore,
        );
        let c = digest(r#"{"amount":6,"items":[{"sku":"x"}]}"#, &ignore);
        let d = digest(r#"{"amount":5,"items":[{"sku":"y"}]}"#, &ignore);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
    }

    #[test]
    fn pointers_follow_rfc_6901() {
        let doc = parse(br#"{"a/b":{"m~n":[10,{"x":"y"}]},"":1}"#).unwrap();
        let get = |p: &str| Pointer::parse(p).unwrap().get(&doc).cloned();
        assert!(matches!(get("/a~1b/m~0n/1/x"), Some(Json::String(s)) if s == "y"));
        assert!(matches!(
            get("/a~1b/m~0n/0"),
            Some(Json::Number { text: "10", .. })
        ));
        assert!(
            matches!(get("/"), Some(Json::Number { .. })),
            "the empty key"
        );
        assert!(get("/a~1b/m~0n/01").is_none(), "no leading zeros");
        assert!(get("/missing").is_none());
        assert!(Pointer::parse("a").is_err());
        assert!(Pointer::parse("/a~2").is_err());
    }

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
