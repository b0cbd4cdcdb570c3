//! The canonical form a `fingerprint = "json"` route hashes, fed to the hasher as tagged,
//! length-prefixed pieces straight from the parsed body.

use sha2::digest::Update;

use super::parse::{Json, Number};
use super::pointer::{array_index, Pointer};

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
    /// The canonical form: `0`, or an optional `-`, the significant digits, `e` and the
    /// exponent of the last digit (`150` is `15e1`, `0.05` is `5e-2`). The hasher is fed it in
    /// pieces; the tests read it whole.
    #[cfg(test)]
    fn canonical(&self) -> String {
        let mut exp = [0u8; 24];
        let parts = self.canonical_parts(&mut exp);
        String::from_utf8(parts.concat()).expect("ASCII")
    }

    /// The value of a number the parser accepted.
    #[expect(
        clippy::indexing_slicing,
        reason = "dot and e are the parser's offsets in this number's text: 0 < dot <= e <= len"
    )]
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
#[expect(
    clippy::indexing_slicing,
    reason = "an i64 takes at most 19 digits and a sign, and the buffer holds 24"
)]
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

/// Feed the canonical form of `doc` to `h` (a hasher or a MAC), leaving out what any of
/// `ignore` points to. Each value is a tag byte (`z`, `t`, `f`, `n`, `s`, `a`, `o`), then for a
/// number or a string its length (LEB128) and bytes, for an array its items and `e`, for an
/// object, in key order, `k`, each key's length and bytes and its value, and `e`.
pub(crate) fn hash_canonical(doc: &Json<'_>, ignore: &[Pointer], h: &mut impl Update) {
    let mut sink = Sink {
        h,
        buf: Vec::with_capacity(SINK_BYTES),
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
    // At most SINK_BYTES.
    buf: Vec<u8>,
}

impl<H: Update> Sink<'_, H> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        if bytes.len() > SINK_BYTES.saturating_sub(self.buf.len()) {
            self.flush();
            if bytes.len() >= SINK_BYTES {
                self.h.update(bytes);
                return;
            }
        }
        self.buf.extend_from_slice(bytes);
    }

    #[inline]
    fn byte(&mut self, b: u8) {
        if self.buf.len() >= SINK_BYTES {
            self.flush();
        }
        self.buf.push(b);
    }

    /// `n` in LEB128: seven bits a byte, low ones first, the high bit set on all but the last.
    #[inline]
    fn len(&mut self, mut n: usize) {
        while n >= 0x80 {
            self.byte((n & 0x7f) as u8 | 0x80);
            n >>= 7;
        }
        self.byte(n as u8);
    }

    fn flush(&mut self) {
        if !self.buf.is_empty() {
            self.h.update(&self.buf);
            self.buf.clear();
        }
    }
}

/// The most pointers a route may ignore (the walk tracks them in one 64-bit set).
pub(crate) const MAX_IGNORED: usize = 64;

/// The patterns of `ignore` among `live` (the ones whose first `depth` tokens match the path so
/// far) that also match `step` at `depth`, and whether one of them ends there (the value at
/// that step is ignored).
fn step(ignore: &[Pointer], live: u64, depth: usize, step: Step<'_>) -> (u64, bool) {
    let (mut next, mut ends) = (0u64, false);
    let mut rest = live;
    while rest != 0 {
        let i = rest.trailing_zeros() as usize;
        rest &= rest - 1;
        let Some(Pointer { tokens, .. }) = ignore.get(i) else {
            continue;
        };
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

#[cfg(test)]
mod tests {
    use super::super::parse::parse;
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
}
