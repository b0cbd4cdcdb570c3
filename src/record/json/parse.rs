//! The parser: a strict reading of one JSON value into a tree that borrows from the body.

use std::borrow::Cow;

/// The deepest nesting of arrays and objects accepted.
pub(crate) const MAX_DEPTH: usize = 128;

/// Why a body is not acceptable JSON; the message is shown to the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the body is not valid JSON: {0}")]
pub(crate) struct JsonError(pub(crate) String);

fn err<T>(what: impl Into<String>) -> Result<T, JsonError> {
    Err(JsonError(what.into()))
}

/// A parsed JSON value, borrowing from the body.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Json<'a> {
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
pub(crate) struct Number<'a> {
    pub(super) text: &'a str,
    // Where the fraction's `.` and the exponent's `e` are in `text` (its length when absent).
    pub(super) dot: u32,
    pub(super) e: u32,
}

impl<'a> Number<'a> {
    /// The number as written in the body.
    pub(crate) fn as_str(&self) -> &'a str {
        self.text
    }
}

/// A string as written between its quotes, unescaped on demand.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Str<'a> {
    raw: &'a str,
    // The length of the unescaped string, in bytes (a body is far below 4 GiB).
    len: u32,
    // Whether `raw` holds a backslash escape.
    escaped: bool,
}

impl<'a> Str<'a> {
    /// The string, unescaped (borrowed from the body when it has no escape).
    #[inline]
    pub(crate) fn value(&self) -> Cow<'a, str> {
        if !self.escaped {
            return Cow::Borrowed(self.raw);
        }
        let mut out = String::with_capacity(self.raw.len());
        #[expect(
            clippy::expect_used,
            reason = "a Str is made only by the parser, once unescape took its raw text"
        )]
        unescape(self.raw, 0, &mut |s| out.push_str(s)).expect("validated when parsed");
        Cow::Owned(out)
    }

    /// The length of the unescaped string, in bytes.
    pub(super) fn len(&self) -> usize {
        self.len as usize
    }

    pub(super) fn write(&self, out: &mut impl FnMut(&[u8])) {
        if self.escaped {
            #[expect(
                clippy::expect_used,
                reason = "a Str is made only by the parser, once unescape took its raw text"
            )]
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
    while let Some(&c) = b.get(i) {
        if c != b'\\' {
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
    let (code, used) = if (0xD800..0xDC00).contains(&first) {
        if b.get(i + 6) != Some(&b'\\') || b.get(i + 7) != Some(&b'u') {
            return err(format!("unpaired surrogate at byte {}", at + i));
        }
        let second = hex(i + 8)?;
        if !(0xDC00..0xE000).contains(&second) {
            return err(format!("unpaired surrogate at byte {}", at + i));
        }
        (0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00), 12)
    } else {
        (first, 6)
    };
    match char::from_u32(code) {
        Some(c) => Ok((c, used)),
        None => err(format!("unpaired surrogate at byte {}", at + i)),
    }
}

/// Parse `body` as one JSON value.
pub(crate) fn parse(body: &[u8]) -> Result<Json<'_>, JsonError> {
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
    while let Some(chunk) = b.get(i..).and_then(<[u8]>::first_chunk::<8>) {
        let x = u64::from_le_bytes(*chunk);
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
        let twice = members.windows(2).find_map(|w| match w {
            [(a, _), (b, _)] if a == b => Some(a),
            _ => None,
        });
        if let Some(name) = twice {
            return err(format!("the member {name:?} appears twice in one object"));
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

#[cfg(test)]
mod tests {
    use super::*;
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
}
