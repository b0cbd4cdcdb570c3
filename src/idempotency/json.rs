//! JSON bodies: a strict parser into a tree that borrows from the body, the canonical form a
//! `fingerprint = "json"` route hashes, and JSON pointers (RFC 6901) into the tree.
//!
//! The canonical form: object members sorted by key (Unicode code point order, which is UTF-8
//! byte order), whitespace ignored, strings compared after unescaping (no Unicode
//! normalisation), numbers compared by exact decimal value (`1`, `1.0` and `1e0` are equal, `-0`
//! equals `0`, and no value is rounded through floating point). A body that does not parse, has
//! two members with one key (after unescaping), nests deeper than [`MAX_DEPTH`] or has an
//! exponent beyond ±10^18 is refused. The form is fed to the hasher as tagged, length-prefixed
//! pieces straight from the body (escaped strings are unescaped on the way), never built as a
//! second copy of the body.

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

/// A parsed JSON value, borrowing from the body.
#[derive(Debug, Clone, PartialEq)]
pub enum Json<'a> {
    /// `null`
    Null,
    /// `true` or `false`
    Bool(bool),
    /// A number.
    Number(Number<'a>),
    /// A string.
    String(Str<'a>),
    /// An array.
    Array(Vec<Json<'a>>),
    /// An object, its members sorted by (unescaped) key.
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
}

/// A number as written; its exact decimal value is read from the text when needed.
#[derive(Debug, Clone, PartialEq)]
pub struct Number<'a> {
    text: &'a str,
    // Where the fraction's `.` and the exponent's `e` are in `text` (its length when absent).
    dot: u32,
    e: u32,
}

/// A number's exact decimal value: the significant digits, without leading and trailing zeros,
/// in up to two pieces of its text (both empty for zero), and the exponent of the last one.
struct Decimal<'a> {
    negative: bool,
    digits: (&'a [u8], &'a [u8]),
    exponent: i64,
}

fn trim_zeros_start(mut digits: &[u8]) -> &[u8] {
    while let [b'0', rest @ ..] = digits {
        digits = rest;
    }
    digits
}

fn trim_zeros_end(mut digits: &[u8]) -> &[u8] {
    while let [rest @ .., b'0'] = digits {
        digits = rest;
    }
    digits
}

impl<'a> Number<'a> {
    /// The number as written in the body.
    pub fn as_str(&self) -> &'a str {
        self.text
    }

    /// The canonical form: `0`, or an optional `-`, the significant digits, `e` and the
    /// exponent of the last digit (`150` is `15e1`, `0.05` is `5e-2`).
    pub fn canonical(&self) -> String {
        let mut exp = [0u8; 24];
        let parts = self.canonical_parts(&mut exp);
        String::from_utf8(parts.concat()).expect("ASCII")
    }

    /// The value of a number the parser accepted.
    fn decimal(&self) -> Decimal<'a> {
        let t = self.text.as_bytes();
        let (dot, e) = (self.dot as usize, self.e as usize);
        let negative = t[0] == b'-';
        let int = &t[negative as usize..dot];
        let frac = if dot < e { &t[dot + 1..e] } else { &[][..] };
        let exponent = if e < t.len() {
            parse_exponent(&t[e + 1..])
        } else {
            0
        };
        // Leading zeros go from the integer part (and from the fraction when the integer part
        // is zero), trailing zeros from the fraction (and from the integer part when the
        // fraction is all zeros).
        let (mut a, mut f) = (trim_zeros_start(int), frac);
        if a.is_empty() {
            f = trim_zeros_start(f);
        }
        let trimmed = trim_zeros_end(f);
        let mut dropped = f.len() - trimmed.len();
        f = trimmed;
        if f.is_empty() {
            let trimmed = trim_zeros_end(a);
            dropped += a.len() - trimmed.len();
            a = trimmed;
        }
        Decimal {
            negative,
            digits: (a, f),
            exponent: exponent - frac.len() as i64 + dropped as i64,
        }
    }

    /// The canonical form in pieces (the exponent's digits written into `exp`).
    fn canonical_parts<'b>(&self, exp: &'b mut [u8; 24]) -> [&'b [u8]; 5]
    where
        'a: 'b,
    {
        let d = self.decimal();
        if d.digits.0.is_empty() && d.digits.1.is_empty() {
            return [b"0", b"", b"", b"", b""];
        }
        let sign: &[u8] = if d.negative { b"-" } else { b"" };
        [sign, d.digits.0, d.digits.1, b"e", itoa(d.exponent, exp)]
    }
}

/// An exponent's digits with an optional sign, at most 18 significant digits (checked by the
/// parser).
fn parse_exponent(text: &[u8]) -> i64 {
    let (sign, digits) = match text {
        [b'-', rest @ ..] => (-1, rest),
        [b'+', rest @ ..] => (1, rest),
        _ => (1, text),
    };
    sign * digits
        .iter()
        .fold(0i64, |n, d| n * 10 + i64::from(d - b'0'))
}

/// `n` in decimal, written at the end of `buf`.
fn itoa(n: i64, buf: &mut [u8; 24]) -> &[u8] {
    let mut at = buf.len();
    let mut m = n.unsigned_abs();
    loop {
        at -= 1;
        buf[at] = b'0' + (m % 10) as u8;
        m /= 10;
        if m == 0 {
            break;
        }
    }
    if n < 0 {
        at -= 1;
        buf[at] = b'-';
    }
    &buf[at..]
}

/// A string as written between its quotes, unescaped on demand.
#[derive(Debug, Clone, PartialEq)]
pub struct Str<'a> {
    raw: &'a str,
    // The length of the unescaped string, in bytes (a body is far below 4 GiB).
    len: u32,
    // Whether `raw` holds a backslash escape.
    escaped: bool,
}

impl<'a> Str<'a> {
    /// The string, unescaped (borrowed from the body when it has no escape).
    #[inline]
    pub fn value(&self) -> Cow<'a, str> {
        if !self.escaped {
            return Cow::Borrowed(self.raw);
        }
        let mut out = String::with_capacity(self.raw.len());
        unescape(self.raw, 0, &mut |s| out.push_str(s)).expect("validated when parsed");
        Cow::Owned(out)
    }

    /// The length of the unescaped string, in bytes.
    fn len(&self) -> usize {
        self.len as usize
    }

    fn write(&self, out: &mut impl FnMut(&[u8])) {
        if self.escaped {
            unescape(self.raw, 0, &mut |s| out(s.as_bytes())).expect("validated when parsed");
        } else {
            out(self.raw.as_bytes());
        }
    }
}

/// Unescape the inside of a string (`raw`, found at byte `at` of the body), handing `emit` the
/// pieces in order; an error for an invalid escape.
fn unescape(raw: &str, at: usize, emit: &mut impl FnMut(&str)) -> Result<(), JsonError> {
    let b = raw.as_bytes();
    let mut i = 0;
    let mut run = 0;
    while i < b.len() {
        if b[i] != b'\\' {
            i += 1;
            continue;
        }
        if run < i {
            emit(&raw[run..i]);
        }
        let simple = match b.get(i + 1) {
            Some(b'"') => "\"",
            Some(b'\\') => "\\",
            Some(b'/') => "/",
            Some(b'b') => "\u{8}",
            Some(b'f') => "\u{c}",
            Some(b'n') => "\n",
            Some(b'r') => "\r",
            Some(b't') => "\t",
            Some(b'u') => {
                let (c, used) = unicode_escape(b, i, at)?;
                emit(c.encode_utf8(&mut [0u8; 4]));
                i += used;
                run = i;
                continue;
            }
            _ => return err(format!("invalid escape at byte {}", at + i)),
        };
        emit(simple);
        i += 2;
        run = i;
    }
    if run < b.len() {
        emit(&raw[run..]);
    }
    Ok(())
}

/// The character of the `\uXXXX` escape at `i` of `b` (a surrogate pair takes two), and the
/// bytes it took; `at` places `b` in the body, for the error message.
fn unicode_escape(b: &[u8], i: usize, at: usize) -> Result<(char, usize), JsonError> {
    let hex = |from: usize| -> Result<u32, JsonError> {
        let digits = b
            .get(from..from + 4)
            .ok_or_else(|| JsonError("truncated \\u escape".into()))?;
        let mut n = 0u32;
        for &d in digits {
            let v = (d as char)
                .to_digit(16)
                .ok_or_else(|| JsonError(format!("invalid \\u escape at byte {}", at + from)))?;
            n = n << 4 | v;
        }
        Ok(n)
    };
    let first = hex(i + 2)?;
    if (0xD800..0xDC00).contains(&first) {
        if b.get(i + 6) != Some(&b'\\') || b.get(i + 7) != Some(&b'u') {
            return err(format!("unpaired surrogate at byte {}", at + i));
        }
        let second = hex(i + 8)?;
        if !(0xDC00..0xE000).contains(&second) {
            return err(format!("unpaired surrogate at byte {}", at + i));
        }
        let c = 0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00);
        return Ok((char::from_u32(c).expect("a valid pair"), 12));
    }
    match char::from_u32(first) {
        Some(c) => Ok((c, 6)),
        None => err(format!("unpaired surrogate at byte {}", at + i)),
    }
}

/// Parse `body` as one JSON value.
pub fn parse(body: &[u8]) -> Result<Json<'_>, JsonError> {
    let text = std::str::from_utf8(body).map_err(|_| JsonError("not UTF-8".into()))?;
    let mut p = Parser {
        text,
        bytes: body,
        at: 0,
        items: Vec::new(),
        members: Vec::new(),
    };
    p.skip_ws();
    let value = p.value(0)?;
    p.skip_ws();
    if p.at != p.bytes.len() {
        return err(format!("unexpected data at byte {}", p.at));
    }
    Ok(value)
}

/// The index of the first byte from `i` on that ends a run of plain string characters: a
/// quote, a backslash or a control character (or the end), eight bytes at a time.
#[inline(always)]
fn plain_run(b: &[u8], mut i: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    // A high bit set in each byte of `v` that is zero (and maybe in bytes above one that is).
    let zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGHS;
    while let Some(chunk) = b.get(i..i + 8) {
        let x = u64::from_le_bytes(chunk.try_into().expect("eight bytes"));
        let special = zero(x ^ (ONES * u64::from(b'"')))
            | zero(x ^ (ONES * u64::from(b'\\')))
            | (x.wrapping_sub(ONES * 0x20) & !x & HIGHS);
        if special != 0 {
            // The lowest flag is exact: flags above it may be borrows, never below.
            return i + (special.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while let Some(&c) = b.get(i) {
        if c == b'"' || c == b'\\' || c < 0x20 {
            break;
        }
        i += 1;
    }
    i
}

struct Parser<'a> {
    text: &'a str,
    bytes: &'a [u8],
    at: usize,
    // The items and members of the arrays and objects being read, innermost last: each is
    // moved into a vector of its exact size when it ends.
    items: Vec<Json<'a>>,
    members: Vec<(Cow<'a, str>, Json<'a>)>,
}

impl<'a> Parser<'a> {
    #[inline(always)]
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
            Some(b'-' | b'0'..=b'9') => self.number().map(Json::Number),
            Some(_) => err(format!("unexpected data at byte {}", self.at)),
        }
    }

    fn array(&mut self, depth: usize) -> Result<Json<'a>, JsonError> {
        if depth > MAX_DEPTH {
            return err(format!("nested deeper than {MAX_DEPTH}"));
        }
        self.at += 1;
        self.skip_ws();
        if self.bytes.get(self.at) == Some(&b']') {
            self.at += 1;
            return Ok(Json::Array(Vec::new()));
        }
        let base = self.items.len();
        loop {
            self.skip_ws();
            let item = self.value(depth)?;
            self.items.push(item);
            self.skip_ws();
            match self.bytes.get(self.at) {
                Some(b',') => self.at += 1,
                Some(b']') => {
                    self.at += 1;
                    return Ok(Json::Array(self.items.drain(base..).collect()));
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
        self.skip_ws();
        if self.bytes.get(self.at) == Some(&b'}') {
            self.at += 1;
            return Ok(Json::Object(Vec::new()));
        }
        let base = self.members.len();
        loop {
            self.skip_ws();
            if self.bytes.get(self.at) != Some(&b'"') {
                return err(format!("expected a member name at byte {}", self.at));
            }
            let key = self.string()?.value();
            self.skip_ws();
            if self.bytes.get(self.at) != Some(&b':') {
                return err(format!("expected ':' at byte {}", self.at));
            }
            self.at += 1;
            self.skip_ws();
            let value = self.value(depth)?;
            self.members.push((key, value));
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
        let mut members: Vec<_> = self.members.drain(base..).collect();
        members.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = members.windows(2).find(|w| w[0].0 == w[1].0) {
            return err(format!(
                "the member {:?} appears twice in one object",
                w[0].0
            ));
        }
        Ok(Json::Object(members))
    }

    #[inline(always)]
    fn string(&mut self) -> Result<Str<'a>, JsonError> {
        let start = self.at + 1;
        let b = self.bytes;
        let mut i = start;
        let mut escaped = false;
        loop {
            i = plain_run(b, i);
            match b.get(i) {
                None => return err("unterminated string"),
                Some(b'"') => break,
                Some(b'\\') => {
                    escaped = true;
                    i += 2;
                }
                Some(_) => return err(format!("control character in a string at byte {i}")),
            }
        }
        self.at = i + 1;
        let raw = &self.text[start..i];
        let mut len = raw.len();
        if escaped {
            len = 0;
            unescape(raw, start, &mut |s| len += s.len())?;
        }
        Ok(Str {
            raw,
            len: len as u32,
            escaped,
        })
    }

    #[inline(always)]
    fn number(&mut self) -> Result<Number<'a>, JsonError> {
        let start = self.at;
        let b = self.bytes;
        let mut i = start;
        let negative = b.get(i) == Some(&b'-');
        if negative {
            i += 1;
        }
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                while let Some(b'0'..=b'9') = b.get(i) {
                    i += 1;
                }
            }
            _ => return err(format!("invalid number at byte {start}")),
        }
        let dot = i;
        if b.get(i) == Some(&b'.') {
            let f = i + 1;
            i = f;
            while let Some(b'0'..=b'9') = b.get(i) {
                i += 1;
            }
            if i == f {
                return err(format!("invalid number at byte {start}"));
            }
        }
        let e = i;
        if let Some(b'e' | b'E') = b.get(i) {
            i += 1;
            if let Some(b'-' | b'+') = b.get(i) {
                i += 1;
            }
            let digits = i;
            while let Some(b'0'..=b'9') = b.get(i) {
                i += 1;
            }
            if i == digits {
                return err(format!("invalid number at byte {start}"));
            }
            if self.text[digits..i].trim_start_matches('0').len() > 18 {
                return err(format!("exponent out of range at byte {start}"));
            }
        }
        self.at = i;
        Ok(Number {
            text: &self.text[start..i],
            dot: (dot - start) as u32,
            e: (e - start) as u32,
        })
    }
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
/// `ignore` points to. Each value is a tag byte (`z`, `t`, `f`, `n`, `s`, `a`, `o`), then for a
/// number or a string its length (LEB128) and bytes, for an array its items and `e`, for an
/// object, in key order, `k`, each key's length and bytes and its value, and `e`.
pub fn hash_canonical(doc: &Json<'_>, ignore: &[Pointer], h: &mut impl Update) {
    let mut sink = Sink {
        h,
        buf: [0; SINK_BYTES],
        n: 0,
    };
    assert!(
        ignore.len() <= MAX_IGNORED,
        "at most {MAX_IGNORED} ignored pointers"
    );
    // The empty pointer names the whole document: then nothing is left of it.
    if ignore.iter().any(|p| p.tokens.is_empty()) {
        sink.byte(b'-');
        return sink.flush();
    }
    let live = if ignore.is_empty() {
        0
    } else {
        u64::MAX >> (64 - ignore.len())
    };
    feed(doc, ignore, live, 0, &mut sink);
    sink.flush();
}

const SINK_BYTES: usize = 512;

/// Gathers the small pieces of the canonical form into one update of the hasher; a piece as
/// large as the buffer goes to the hasher directly.
struct Sink<'h, H: Update> {
    h: &'h mut H,
    buf: [u8; SINK_BYTES],
    n: usize,
}

impl<H: Update> Sink<'_, H> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        if bytes.len() > SINK_BYTES - self.n {
            self.flush();
            if bytes.len() >= SINK_BYTES {
                self.h.update(bytes);
                return;
            }
        }
        self.buf[self.n..self.n + bytes.len()].copy_from_slice(bytes);
        self.n += bytes.len();
    }

    #[inline]
    fn byte(&mut self, b: u8) {
        if self.n == SINK_BYTES {
            self.flush();
        }
        self.buf[self.n] = b;
        self.n += 1;
    }

    #[inline]
    fn len(&mut self, mut n: usize) {
        if n < 0x80 {
            return self.byte(n as u8);
        }
        let mut out = [0u8; 10];
        let mut i = 0;
        loop {
            let low = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out[i] = low;
                break;
            }
            out[i] = low | 0x80;
            i += 1;
        }
        self.put(&out[..=i]);
    }

    fn flush(&mut self) {
        if self.n > 0 {
            self.h.update(&self.buf[..self.n]);
            self.n = 0;
        }
    }
}

/// The most pointers a route may ignore (the walk tracks them in one 64-bit set).
pub const MAX_IGNORED: usize = 64;

/// The patterns of `ignore` among `live` (the ones whose first `depth` tokens match the path so
/// far) that also match `step` at `depth`, and whether one of them ends there (the value at
/// that step is ignored).
fn step(ignore: &[Pointer], live: u64, depth: usize, step: Step<'_>) -> (u64, bool) {
    let (mut next, mut ends) = (0u64, false);
    let mut rest = live;
    while rest != 0 {
        let i = rest.trailing_zeros() as usize;
        rest &= rest - 1;
        let tokens = &ignore[i].tokens;
        let hit = match (tokens.get(depth), step) {
            (Some(t), Step::Key(k)) => t == k,
            (Some(t), Step::Index(n)) => t == "*" || array_index(t) == Some(n),
            (None, _) => false,
        };
        if hit {
            if tokens.len() == depth + 1 {
                ends = true;
            } else {
                next |= 1 << i;
            }
        }
    }
    (next, ends)
}

#[derive(Clone, Copy)]
enum Step<'p> {
    Key(&'p str),
    Index(usize),
}

fn feed<H: Update>(
    value: &Json<'_>,
    ignore: &[Pointer],
    live: u64,
    depth: usize,
    out: &mut Sink<'_, H>,
) {
    match value {
        Json::Null => out.byte(b'z'),
        Json::Bool(true) => out.byte(b't'),
        Json::Bool(false) => out.byte(b'f'),
        Json::Number(n) => {
            let mut exp = [0u8; 24];
            let parts = n.canonical_parts(&mut exp);
            out.byte(b'n');
            out.len(parts.iter().map(|p| p.len()).sum());
            parts.iter().for_each(|p| out.put(p));
        }
        Json::String(s) => {
            out.byte(b's');
            out.len(s.len());
            s.write(&mut |b| out.put(b));
        }
        Json::Array(items) => {
            // Every item starts with its tag, so `e` ends the array unambiguously. An ignored
            // item is left out.
            out.byte(b'a');
            for (n, item) in items.iter().enumerate() {
                let (next, ends) = match live {
                    0 => (0, false),
                    _ => step(ignore, live, depth, Step::Index(n)),
                };
                if !ends {
                    feed(item, ignore, next, depth + 1, out);
                }
            }
            out.byte(b'e');
        }
        Json::Object(members) => {
            // Every member starts with `k`, so `e` ends the object unambiguously. An ignored
            // member is left out.
            out.byte(b'o');
            for (k, v) in members {
                let (next, ends) = match live {
                    0 => (0, false),
                    _ => step(ignore, live, depth, Step::Key(k)),
                };
                if !ends {
                    out.byte(b'k');
                    out.len(k.len());
                    out.put(k.as_bytes());
                    feed(v, ignore, next, depth + 1, out);
                }
            }
            out.byte(b'e');
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
    fn canonical_numbers_are_exact() {
        let canonical = |text: &str| match parse(text.as_bytes()).unwrap() {
            Json::Number(n) => n.canonical(),
            other => panic!("{other:?}"),
        };
        for (text, want) in [
            ("0", "0"),
            ("-0.000", "0"),
            ("150", "15e1"),
            ("10.50", "105e-1"),
            ("100.00", "1e2"),
            ("0.050", "5e-2"),
            ("-2.5E+3", "-25e2"),
            ("1e-0", "1e0"),
            (
                "123456789012345678901234567890",
                "12345678901234567890123456789e1",
            ),
        ] {
            assert_eq!(canonical(text), want, "{text}");
        }
    }

    #[test]
    fn escapes_are_read_exactly() {
        assert!(same(r#""a\"b""#, r#""a\u0022b""#));
        assert!(same(r#""\\""#, r#""\u005c""#));
        assert!(same(r#"{"a\nb":"\t"}"#, "{\"a\\u000ab\":\"\\u0009\"}"));
        for bad in [
            r#""abc\"#,
            r#""\x""#,
            r#""\u12""#,
            r#""\u12G4""#,
            "\"\\\u{e9}\"",
        ] {
            assert!(parse(bad.as_bytes()).is_err(), "{bad}");
        }
        let doc = parse(br#"{"k":"caf\u00e9 \"x\""}"#).unwrap();
        let Json::Object(members) = &doc else {
            panic!()
        };
        let Json::String(s) = &members[0].1 else {
            panic!()
        };
        assert_eq!(s.value(), "café \"x\"");
    }

    #[test]
    fn the_string_scan_stops_where_a_byte_loop_does() {
        let naive = |b: &[u8], i: usize| {
            (i..b.len())
                .find(|&j| b[j] == b'"' || b[j] == b'\\' || b[j] < 0x20)
                .unwrap_or(b.len())
        };
        let specials = [b'"', b'\\', 0x00, 0x1f, 0x20, 0x21, 0x7f, 0x80, 0xff, b'a'];
        // Every special byte at every offset of a 20-byte run, from every start.
        for &special in &specials {
            for at in 0..20 {
                let mut b = vec![b'x'; 20];
                b[at] = special;
                for start in 0..20 {
                    assert_eq!(
                        plain_run(&b, start),
                        naive(&b, start),
                        "{special:#x} at {at} from {start}"
                    );
                }
            }
        }
        let utf8 = "caf\u{e9} \u{1F600} na\u{ef}ve\"".as_bytes();
        assert_eq!(plain_run(utf8, 0), utf8.len() - 1);
    }

    #[test]
    fn an_array_index_or_a_star_ignores_items() {
        let body = r#"{"items":[{"sku":"a","ts":1},{"sku":"b","ts":2}]}"#;
        let other = r#"{"items":[{"sku":"a","ts":9},{"sku":"b","ts":2}]}"#;
        assert_eq!(
            digest(body, &["/items/0/ts"]),
            digest(other, &["/items/0/ts"])
        );
        assert_ne!(
            digest(body, &["/items/1/ts"]),
            digest(other, &["/items/1/ts"])
        );
        assert_eq!(
            digest(body, &["/items/*/ts"]),
            digest(other, &["/items/*/ts"])
        );
        assert_eq!(digest(body, &["/items/0"]), digest(other, &["/items/0"]));
        assert_eq!(
            digest(body, &[""]),
            digest("[1]", &[""]),
            "the whole document"
        );
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
        assert!(matches!(get("/a~1b/m~0n/1/x"), Some(Json::String(s)) if s.value() == "y"));
        assert!(matches!(
            get("/a~1b/m~0n/0"),
            Some(Json::Number(n)) if n.as_str() == "10"
        ));
        assert!(matches!(get("/"), Some(Json::Number(_))), "the empty key");
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
