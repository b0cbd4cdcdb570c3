//! The parser and the canonical form checked against references of their own, over generated
//! documents (proptest):
//!
//! - acceptance: the parser and `serde_json` accept and refuse the same texts, valid ones with
//!   awkward strings, numbers and whitespace and byte-level mutations of them, except where
//!   one of them is stricter on purpose ([`Verdict`]); any other disagreement fails;
//! - canonical equality: two documents hash alike exactly when they are equal as JSON values,
//!   by an oracle of the test's own ([`same`]: members unordered, numbers as exact decimals).
//!
//! `PROPTEST_CASES` sets the number of cases (a soak run); failures are not persisted: the
//! failing input is printed, shrunk, and a bug found gets a unit test of its own.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};

use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::sample::{select, Index};
use proptest::test_runner::{Config, TestRunner};
use sha2::{Digest, Sha256};

use super::canonical::hash_canonical;
use super::parse::{parse, MAX_DEPTH};

// === The model: a JSON value with exact numbers ===

/// A generated JSON value. `Raw` (acceptance only) is a leaf written as is, often invalid.
#[derive(Debug, Clone)]
enum Model {
    Null,
    Bool(bool),
    Num(Dec),
    Str(String),
    Arr(Vec<Model>),
    /// Members in generated order (keys unique, except in the acceptance property).
    Obj(Vec<(String, Model)>),
    Raw(String),
}

/// An exact decimal: sign, significant digits without leading or trailing zeros (empty for
/// zero, which has no sign), and the exponent of the last digit.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Dec {
    negative: bool,
    digits: String,
    exp: i64,
}

impl Dec {
    fn new(negative: bool, digits: &str, exp: i64) -> Dec {
        let digits = digits.trim_start_matches('0');
        let kept = digits.trim_end_matches('0');
        if kept.is_empty() {
            return Dec {
                negative: false,
                digits: String::new(),
                exp: 0,
            };
        }
        Dec {
            negative,
            digits: kept.to_string(),
            exp: exp + (digits.len() - kept.len()) as i64,
        }
    }

    /// The oracle's reading of a JSON number's text.
    fn parse(text: &str) -> Dec {
        let (negative, rest) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (mantissa, exp) = match rest.find(['e', 'E']) {
            Some(at) => (
                &rest[..at],
                rest[at + 1..].parse::<i64>().expect("exponent"),
            ),
            None => (rest, 0),
        };
        let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        Dec::new(negative, &format!("{int}{frac}"), exp - frac.len() as i64)
    }
}

/// Whether two values are equal as JSON: objects unordered, arrays ordered, strings as
/// characters, numbers as exact decimals.
#[expect(
    clippy::unreachable,
    reason = "test code: the oracle is given valid values only"
)]
fn same(a: &Model, b: &Model) -> bool {
    match (a, b) {
        (Model::Null, Model::Null) => true,
        (Model::Bool(x), Model::Bool(y)) => x == y,
        (Model::Num(x), Model::Num(y)) => x == y,
        (Model::Str(x), Model::Str(y)) => x == y,
        (Model::Arr(x), Model::Arr(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y))
        }
        (Model::Obj(x), Model::Obj(y)) => {
            x.len() == y.len()
                && x.iter().all(|(k, v)| {
                    y.iter()
                        .find(|(key, _)| key == k)
                        .is_some_and(|(_, w)| same(v, w))
                })
        }
        (Model::Raw(_), _) | (_, Model::Raw(_)) => unreachable!("valid values only"),
        _ => false,
    }
}

fn depth(m: &Model) -> usize {
    match m {
        Model::Arr(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Model::Obj(members) => 1 + members.iter().map(|(_, v)| depth(v)).max().unwrap_or(0),
        _ => 0,
    }
}

// === Strategies ===

/// Leaves written as is in the acceptance property: invalid numbers, literals, strings and
/// whitespace, and numbers at the exponent bound on both sides of it.
#[rustfmt::skip]
const RAW: &[&str] = &[
    // Numbers and literals JSON does not have.
    "01", "-01", "00", "-00", "1.", ".5", "-", "1e", "1e+", "+1", "0x1", "1.e5", "-.5", "1E-",
    "NaN", "Infinity", "-Infinity", "1_0", "0.", "2.5.1", "1ee2", "--1", "- 1", "\u{ff10}",
    "nul", "True", "nulll", "fals", "undefined", "'a'",
    // Exponents at the bound, on both sides of it.
    "1e1000000000000000000", "0e1000000000000000000", "1e-1000000000000000000",
    "-1.5E+0001234567890123456789", "0.0e-9999999999999999999", "1e999999999999999999",
    "1e-999999999999999999", "0e999999999999999999", "1e0000000000000000000000001",
    // Strings: lone and paired surrogates, raw control characters, bad escapes.
    "\"\\ud800\"", "\"\\udc00\"", "\"\\ud800\\u0041\"", "\"\\ud800x\"", "\"\\ud800\\ud800\"",
    "\"\\udbff\\udfff\"", "\"a\u{1}b\"", "\"\\x\"", "\"\\u12G4\"", "\"\\u00e\"", "\"tab\there\"",
    "\"\\'\"", "\"abc", "\"\\U0041\"", "\"\u{7f}\"", "\"\\/\"",
    // Spaces JSON does not allow.
    "\u{a0}1", "\u{feff}1", "\u{c}1",
];

/// Characters that strings are made of: a few letters (so keys collide and share prefixes),
/// what must be escaped, what may be, and characters of every UTF-8 length.
fn chr() -> impl Strategy<Value = char> {
    prop_oneof![
        6 => proptest::char::range('a', 'd'),
        3 => select(vec![
            '"', '\\', '/', '\u{0}', '\u{1f}', '\n', '\t', '\u{8}', '\u{7f}', 'é', '\u{301}',
            '€', '\u{ffff}', '\u{10000}', '😀', '\u{10ffff}', '\u{2028}', ' ', 'E', '0',
        ]),
        1 => any::<char>(),
    ]
}

fn text() -> impl Strategy<Value = String> {
    vec(chr(), 0..10).prop_map(|chars| chars.into_iter().collect())
}

/// Numbers: short and long digit strings, pairs that one `f64` cannot tell apart, zero, and
/// exponents small, near the `f64` range's ends, and up to the parser's bound.
fn dec() -> impl Strategy<Value = Dec> {
    let digits = prop_oneof![
        4 => (1u64..1000).prop_map(|n| n.to_string()),
        2 => "[1-9][0-9]{0,40}",
        2 => select(vec![
            "9007199254740993", "9007199254740992", "30000000000000004", "3", "1",
            "100000000000000000000001", "1000000000000000000000",
        ])
        .prop_map(String::from),
        1 => Just(String::new()),
    ];
    let exp = prop_oneof![
        8 => -20i64..20,
        2 => -45i64..45,
        1 => prop_oneof![290i64..330, -345i64..-300],
        1 => -100_000_000_000_000_000i64..100_000_000_000_000_000,
    ];
    (any::<bool>(), digits, exp)
        .prop_map(|(negative, digits, exp)| Dec::new(negative, &digits, exp))
}

fn leaf() -> impl Strategy<Value = Model> {
    prop_oneof![
        1 => Just(Model::Null),
        1 => any::<bool>().prop_map(Model::Bool),
        4 => dec().prop_map(Model::Num),
        4 => text().prop_map(Model::Str),
    ]
}

/// Numbers whose exponent has 18 to 20 significant digits (and maybe leading zeros): the
/// parser's bound is 18.
fn at_the_exponent_bound() -> impl Strategy<Value = String> {
    let mantissa = select(vec!["0", "-0", "1", "-2.5", "0.000", "10"]);
    let sign = select(vec!["", "+", "-"]);
    (mantissa, any::<bool>(), sign, "0{0,2}[1-9][0-9]{17,19}")
        .prop_map(|(m, e, sign, digits)| format!("{m}{}{sign}{digits}", if e { 'e' } else { 'E' }))
}

/// A JSON value; with `awkward`, some leaves are [`RAW`] and members may share a key.
fn value(awkward: bool) -> BoxedStrategy<Model> {
    let leaf = if awkward {
        prop_oneof![
            40 => leaf(),
            1 => select(RAW).prop_map(|raw| Model::Raw(raw.to_string())),
            2 => at_the_exponent_bound().prop_map(Model::Raw),
        ]
        .boxed()
    } else {
        leaf().boxed()
    };
    leaf.prop_recursive(4, 32, 6, move |inner| {
        let members = if awkward {
            let key = prop_oneof![3 => text(), 1 => select(vec!["a", "b"]).prop_map(String::from)];
            vec((key, inner.clone()), 0..5).boxed()
        } else {
            btree_map(text(), inner.clone(), 0..5)
                .prop_map(|m| m.into_iter().collect())
                .boxed()
        };
        prop_oneof![
            vec(inner, 0..5).prop_map(Model::Arr),
            members.prop_map(Model::Obj)
        ]
    })
    .boxed()
}

/// An awkward value, now and then nested to just below, at or just above the nesting limits.
fn document() -> impl Strategy<Value = Model> {
    let deep = prop_oneof![Just(MAX_DEPTH - 1), Just(MAX_DEPTH), Just(MAX_DEPTH + 1)];
    let target = prop_oneof![6 => Just(0usize), 1 => deep, 1 => Just(MAX_DEPTH)];
    (value(true), target).prop_map(|(mut m, target)| {
        for level in depth(&m)..target {
            m = match level % 2 {
                0 => Model::Arr(vec![m]),
                _ => Model::Obj(vec![("k".to_string(), m)]),
            };
        }
        m
    })
}

// === Writing a value out, one of many ways ===

/// splitmix64: the spelling choices of one rendering, from one generated seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
}

/// Writes a [`Model`] as JSON text: members in a random order, random whitespace, each
/// character escaped or not (a short escape, `\u` in either case, a surrogate pair), each
/// number in one of its spellings; with `awkward`, now and then a space JSON does not allow.
struct Writer {
    rng: Rng,
    awkward: bool,
    out: String,
}

fn render(m: &Model, seed: u64, awkward: bool) -> String {
    let mut w = Writer {
        rng: Rng(seed),
        awkward,
        out: String::new(),
    };
    w.ws();
    w.value(m);
    w.ws();
    w.out
}

impl Writer {
    fn ws(&mut self) {
        let ws = match self.rng.below(12) {
            0 => " ",
            1 => "\n",
            2 => "\t",
            3 => "\r\n",
            4 => " \t\n\r ",
            _ => "",
        };
        self.out.push_str(ws);
        if self.awkward && self.rng.one_in(400) {
            let bad = ["\u{a0}", "\u{c}", "\u{b}", "\u{feff}", "\u{2028}"];
            self.out.push_str(bad[self.rng.below(bad.len())]);
        }
    }

    fn value(&mut self, m: &Model) {
        match m {
            Model::Null => self.out.push_str("null"),
            Model::Bool(b) => self.out.push_str(if *b { "true" } else { "false" }),
            Model::Num(d) => self.number(d),
            Model::Str(s) => self.string(s),
            Model::Raw(raw) => self.out.push_str(raw),
            Model::Arr(items) => {
                self.out.push('[');
                self.ws();
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.out.push(',');
                        self.ws();
                    }
                    self.value(item);
                    self.ws();
                }
                self.out.push(']');
            }
            Model::Obj(members) => {
                let mut order: Vec<usize> = (0..members.len()).collect();
                for i in (1..order.len()).rev() {
                    order.swap(i, self.rng.below(i + 1));
                }
                self.out.push('{');
                self.ws();
                for (n, &i) in order.iter().enumerate() {
                    if n > 0 {
                        self.out.push(',');
                        self.ws();
                    }
                    self.string(&members[i].0);
                    self.ws();
                    self.out.push(':');
                    self.ws();
                    self.value(&members[i].1);
                    self.ws();
                }
                self.out.push('}');
            }
        }
    }

    fn string(&mut self, s: &str) {
        let start = self.out.len();
        self.out.push('"');
        for c in s.chars() {
            let short = match c {
                '"' => Some("\\\""),
                '\\' => Some("\\\\"),
                '\u{8}' => Some("\\b"),
                '\u{c}' => Some("\\f"),
                '\n' => Some("\\n"),
                '\r' => Some("\\r"),
                '\t' => Some("\\t"),
                '/' if self.rng.one_in(2) => Some("\\/"),
                _ => None,
            };
            let must = c < ' ' || c == '"' || c == '\\';
            match (short, must || self.rng.one_in(3)) {
                (Some(esc), _) if self.rng.below(4) > 0 => self.out.push_str(esc),
                (_, true) => self.unicode_escape(c),
                (_, false) => self.out.push(c),
            }
        }
        self.out.push('"');
        let back: String = serde_json::from_str(&self.out[start..]).expect("a valid string");
        assert_eq!(back, s, "the writer spells strings right");
    }

    fn unicode_escape(&mut self, c: char) {
        let mut units = [0u16; 2];
        for unit in c.encode_utf16(&mut units) {
            let hex = format!("\\u{:04x}", unit);
            let hex = match self.rng.one_in(2) {
                true => hex.to_uppercase().replace("\\U", "\\u"),
                false => hex,
            };
            self.out.push_str(&hex);
        }
    }

    /// One spelling of `d`: the point anywhere (with zeros to fill), trailing zeros after it,
    /// an exponent or none (`e` or `E`, a `+` or none, leading zeros), `-0` for zero.
    fn number(&mut self, d: &Dec) {
        let start = self.out.len();
        if d.negative || (d.digits.is_empty() && self.rng.one_in(3)) {
            self.out.push('-');
        }
        let n = d.digits.len() as i64;
        // The written exponent: the value is the written mantissa times 10^written.
        let written = match (n, self.rng.below(4)) {
            (0, _) if self.rng.one_in(2) => 0,
            (0, _) => self.rng.below(41) as i64 - 20,
            (_, 0) => 0,
            (_, 1) => d.exp,
            (_, 2) => d.exp + n - 1,
            _ => d.exp + self.rng.below(7) as i64 - 3,
        };
        let written = if (d.exp - written).abs() > 40 {
            d.exp
        } else {
            written
        };
        let shift = d.exp - written;
        let zeros = |k: i64| "0".repeat(k.max(0) as usize);
        if n == 0 {
            self.out.push('0');
        } else if shift >= 0 {
            self.out.push_str(&d.digits);
            self.out.push_str(&zeros(shift));
        } else if -shift >= n {
            self.out.push_str("0.");
            self.out.push_str(&zeros(-shift - n));
            self.out.push_str(&d.digits);
        } else {
            let (int, frac) = d.digits.split_at((n + shift) as usize);
            self.out.push_str(&format!("{int}.{frac}"));
        }
        if self.rng.one_in(3) {
            let dot = if shift >= 0 || n == 0 { "." } else { "" };
            self.out
                .push_str(&format!("{dot}{}", zeros(1 + self.rng.below(3) as i64)));
        }
        if written != 0 || self.rng.one_in(4) {
            self.out.push(if self.rng.one_in(2) { 'e' } else { 'E' });
            if written < 0 {
                self.out.push('-');
            } else if self.rng.one_in(3) {
                self.out.push('+');
            }
            self.out.push_str(&zeros(self.rng.below(3) as i64));
            self.out.push_str(&written.unsigned_abs().to_string());
        }
        assert_eq!(Dec::parse(&self.out[start..]), *d, "{}", &self.out[start..]);
    }
}

// === Acceptance: the parser against serde_json ===

/// How the parser and `serde_json::from_slice::<Value>` (its default features: numbers as
/// `f64`, 128 levels of recursion) judged one text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Verdict {
    BothAccept,
    BothRefuse,
    /// Ours refuses two members with one key (after unescaping); serde_json keeps the last.
    DuplicateKey,
    /// Ours refuses an exponent of more than 18 significant digits; serde_json reads the
    /// number as 0 when its mantissa is zero or its exponent negative (and refuses it as out
    /// of range otherwise, as ours does).
    ExponentBound,
    /// serde_json refuses a number beyond `f64`'s range; ours keeps every number exact.
    SerdeF64Range,
    /// serde_json refuses [`SERDE_DEPTH`] levels of nesting; ours accepts up to
    /// [`MAX_DEPTH`] levels and refuses deeper, where serde_json refuses too: the parser's
    /// own depth limit never shows as a disagreement.
    SerdeRecursionLimit,
}

/// The nesting serde_json refuses: it starts from 128 levels to go and fails when none is left,
/// so it accepts 127.
const SERDE_DEPTH: usize = 128;

/// Judge `text`; an unclassified disagreement is an error, described.
fn verdict(text: &[u8]) -> Result<Verdict, String> {
    let ours = parse(text).map(|_| ()).map_err(|e| e.0);
    let theirs = serde_json::from_slice::<serde_json::Value>(text)
        .map(|_| ())
        .map_err(|e| e.to_string());
    match (ours, theirs) {
        (Ok(()), Ok(())) => Ok(Verdict::BothAccept),
        (Err(_), Err(_)) => Ok(Verdict::BothRefuse),
        (Err(ours), Ok(())) => {
            let facts = Facts::of(text);
            if ours.contains("appears twice") && has_duplicate_key(text) {
                Ok(Verdict::DuplicateKey)
            } else if ours.contains("exponent out of range") && facts.long_exponent {
                Ok(Verdict::ExponentBound)
            } else {
                Err(format!("ours refuses ({ours}), serde_json accepts"))
            }
        }
        (Ok(()), Err(theirs)) => {
            let facts = Facts::of(text);
            if theirs.starts_with("recursion limit exceeded") && facts.depth >= SERDE_DEPTH {
                Ok(Verdict::SerdeRecursionLimit)
            } else if theirs.starts_with("number out of range") && facts.beyond_f64 {
                Ok(Verdict::SerdeF64Range)
            } else {
                Err(format!("ours accepts, serde_json refuses ({theirs})"))
            }
        }
    }
}

/// What a scan of a text's tokens finds, outside strings: how deep it nests, whether a
/// number has an exponent of more than 18 significant digits, and whether one is beyond
/// `f64`'s range (read by the standard library, which rounds correctly).
struct Facts {
    depth: usize,
    long_exponent: bool,
    beyond_f64: bool,
}

impl Facts {
    fn of(text: &[u8]) -> Facts {
        let mut facts = Facts {
            depth: 0,
            long_exponent: false,
            beyond_f64: false,
        };
        let (mut i, mut depth) = (0, 0usize);
        while let Some(&c) = text.get(i) {
            i += 1;
            match c {
                b'"' => {
                    while let Some(&c) = text.get(i) {
                        i += if c == b'\\' { 2 } else { 1 };
                        if c == b'"' {
                            break;
                        }
                    }
                }
                b'[' | b'{' => {
                    depth += 1;
                    facts.depth = facts.depth.max(depth);
                }
                b']' | b'}' => depth = depth.saturating_sub(1),
                b'-' | b'0'..=b'9' => {
                    let start = i - 1;
                    while let Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') = text.get(i) {
                        i += 1;
                    }
                    let number = String::from_utf8_lossy(&text[start..i]);
                    let exponent = number.split(['e', 'E']).nth(1).unwrap_or("");
                    let significant = exponent
                        .trim_start_matches(['+', '-'])
                        .trim_start_matches('0');
                    facts.long_exponent |= significant.len() > 18;
                    facts.beyond_f64 |= number.parse::<f64>().is_ok_and(f64::is_infinite);
                }
                _ => {}
            }
        }
        facts
    }
}

/// Whether serde_json, reading `text`, meets an object with two members of one key.
fn has_duplicate_key(text: &[u8]) -> bool {
    serde_json::from_slice::<Dups>(text).is_ok_and(|d| d.0)
}

/// A document read only to find duplicate keys (serde_json unescapes them).
struct Dups(bool);

impl<'de> serde::Deserialize<'de> for Dups {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(DupsVisitor)
    }
}

struct DupsVisitor;

impl<'de> serde::de::Visitor<'de> for DupsVisitor {
    type Value = Dups;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Dups, E> {
        Ok(Dups(false))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Dups, E> {
        Ok(Dups(false))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Dups, E> {
        Ok(Dups(false))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Dups, E> {
        Ok(Dups(false))
    }
    fn visit_str<E>(self, _: &str) -> Result<Dups, E> {
        Ok(Dups(false))
    }
    fn visit_unit<E>(self) -> Result<Dups, E> {
        Ok(Dups(false))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Dups, A::Error> {
        let mut any = false;
        while let Some(Dups(d)) = seq.next_element()? {
            any |= d;
        }
        Ok(Dups(any))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Dups, A::Error> {
        let (mut keys, mut any) = (HashSet::new(), false);
        while let Some(key) = map.next_key::<String>()? {
            any |= !keys.insert(key);
            any |= map.next_value::<Dups>()?.0;
        }
        Ok(Dups(any))
    }
}

/// A byte-level edit of a text; positions are taken modulo its length.
#[derive(Debug, Clone)]
enum Edit {
    Insert(Index, u8),
    Delete(Index),
    Replace(Index, u8),
    Truncate(Index),
    Append(Vec<u8>),
}

fn byte() -> impl Strategy<Value = u8> {
    let interesting = b"{}[]:,\"\\-+.eE0159 \n\tu/ntfal\x00\x1f\x7f\x80\xbf\xc3\xe2\xf0\xff";
    prop_oneof![3 => select(interesting.to_vec()), 1 => any::<u8>()]
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        3 => (any::<Index>(), byte()).prop_map(|(at, b)| Edit::Insert(at, b)),
        3 => any::<Index>().prop_map(Edit::Delete),
        3 => (any::<Index>(), byte()).prop_map(|(at, b)| Edit::Replace(at, b)),
        1 => any::<Index>().prop_map(Edit::Truncate),
        1 => vec(byte(), 1..4).prop_map(Edit::Append),
    ]
}

fn apply(text: &mut Vec<u8>, edit: &Edit) {
    let len = text.len();
    match edit {
        Edit::Insert(at, b) => text.insert(at.index(len + 1), *b),
        Edit::Delete(at) if len > 0 => {
            text.remove(at.index(len));
        }
        Edit::Replace(at, b) if len > 0 => text[at.index(len)] = *b,
        Edit::Truncate(at) => text.truncate(at.index(len + 1)),
        Edit::Append(bytes) => text.extend_from_slice(bytes),
        Edit::Delete(_) | Edit::Replace(..) => {}
    }
}

// === Canonical equality: the hash against the oracle ===

/// A change to one node of a value: which node (preorder), which change (`pick`), and what
/// it may bring in (a leaf, a key, positions).
#[derive(Debug, Clone)]
struct Change {
    node: Index,
    pick: u8,
    leaf: Model,
    key: String,
    a: Index,
    b: Index,
}

fn change() -> impl Strategy<Value = Change> {
    (
        any::<Index>(),
        any::<u8>(),
        leaf(),
        text(),
        any::<Index>(),
        any::<Index>(),
    )
        .prop_map(|(node, pick, leaf, key, a, b)| Change {
            node,
            pick,
            leaf,
            key,
            a,
            b,
        })
}

fn size(m: &Model) -> usize {
    match m {
        Model::Arr(items) => 1 + items.iter().map(size).sum::<usize>(),
        Model::Obj(members) => 1 + members.iter().map(|(_, v)| size(v)).sum::<usize>(),
        _ => 1,
    }
}

/// The `n`th node of `m` in preorder, or how many nodes past `m` it lies.
fn nth(m: &mut Model, n: usize) -> Result<&mut Model, usize> {
    if n == 0 {
        return Ok(m);
    }
    let mut n = n - 1;
    let children: Vec<&mut Model> = match m {
        Model::Arr(items) => items.iter_mut().collect(),
        Model::Obj(members) => members.iter_mut().map(|(_, v)| v).collect(),
        _ => Vec::new(),
    };
    for child in children {
        match nth(child, n) {
            Ok(found) => return Ok(found),
            Err(rest) => n = rest,
        }
    }
    Err(n)
}

/// `m` with `c` applied to one of its nodes: a number's last digit changed, dropped or one
/// appended, its sign flipped, or the number made a string; a string or a scalar changed; an
/// array's items swapped, one removed or added; an object's member added, removed or renamed.
/// Mostly a different value, sometimes not (two equal items swapped, `-0` for `0`): the oracle
/// says which.
fn changed(m: &Model, c: &Change) -> Model {
    let mut m = m.clone();
    let at = c.node.index(size(&m));
    let node = nth(&mut m, at).expect("a node");
    let pick = usize::from(c.pick);
    *node = match &*node {
        Model::Num(d) => {
            let n = d.digits.len();
            let last = d.digits.bytes().last().unwrap_or(b'0');
            match pick % 5 {
                0 => {
                    let bumped = if last == b'9' {
                        '8'
                    } else {
                        (last + 1) as char
                    };
                    let digits = format!("{}{bumped}", &d.digits[..n.saturating_sub(1)]);
                    Model::Num(Dec::new(d.negative, &digits, d.exp))
                }
                1 => Model::Num(Dec::new(
                    d.negative,
                    &d.digits[..n.saturating_sub(1)],
                    d.exp + 1,
                )),
                2 => {
                    let digits = format!("{}{}", d.digits, 1 + pick / 5 % 9);
                    Model::Num(Dec::new(d.negative, &digits, d.exp - 1))
                }
                3 => Model::Num(Dec::new(!d.negative, &d.digits, d.exp)),
                _ => Model::Str(d.digits.clone()),
            }
        }
        Model::Str(s) => match pick % 3 {
            0 => Model::Str(format!("{s}{}", c.key)),
            1 if s.contains('é') => Model::Str(s.replacen('é', "e\u{301}", 1)),
            1 => Model::Str(s.chars().skip(1).collect()),
            _ => c.leaf.clone(),
        },
        Model::Bool(b) if pick % 2 == 0 => Model::Bool(!b),
        Model::Arr(items) => {
            let mut items = items.clone();
            let len = items.len();
            match pick % 3 {
                0 if len >= 2 => items.swap(c.a.index(len), c.b.index(len)),
                1 if len >= 1 => {
                    items.remove(c.a.index(len));
                }
                _ => items.push(c.leaf.clone()),
            }
            Model::Arr(items)
        }
        Model::Obj(members) => {
            let mut members = members.clone();
            let len = members.len();
            let taken = members.iter().any(|(k, _)| *k == c.key);
            match pick % 3 {
                1 if len >= 1 => {
                    members.remove(c.a.index(len));
                }
                2 if len >= 1 && !taken => members[c.a.index(len)].0 = c.key.clone(),
                _ if taken => members.retain(|(k, _)| *k != c.key),
                _ => members.push((c.key.clone(), c.leaf.clone())),
            }
            Model::Obj(members)
        }
        _ => c.leaf.clone(),
    };
    m
}

fn fingerprint(text: &str) -> [u8; 32] {
    let doc = parse(text.as_bytes()).unwrap_or_else(|e| panic!("{e}: {text}"));
    let mut h = Sha256::new();
    hash_canonical(&doc, &[], &mut h);
    h.finalize().into()
}

// === The properties ===

/// The cases of each property by default: a few seconds in a debug build.
const CASES: u32 = 1000;

fn runner() -> TestRunner {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(CASES);
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

#[test]
fn the_parser_accepts_what_serde_json_accepts_but_on_purpose() {
    let seen = RefCell::new(BTreeMap::<Verdict, u32>::new());
    let strategy = (document(), any::<u64>(), vec(edit(), 1..4));
    let result = runner().run(&strategy, |(doc, seed, edits)| {
        let mut text = render(&doc, seed, true).into_bytes();
        for at in 0..=edits.len() {
            if at > 0 {
                apply(&mut text, &edits[at - 1]);
            }
            let verdict = verdict(&text).map_err(|why| {
                TestCaseError::fail(format!("{why}: {:?}", String::from_utf8_lossy(&text)))
            })?;
            *seen.borrow_mut().entry(verdict).or_default() += 1;
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let seen = seen.into_inner();
    eprintln!("texts judged: {seen:?}");
    for verdict in [
        Verdict::BothAccept,
        Verdict::BothRefuse,
        Verdict::DuplicateKey,
        Verdict::ExponentBound,
        Verdict::SerdeF64Range,
        Verdict::SerdeRecursionLimit,
    ] {
        assert!(
            seen.contains_key(&verdict),
            "no text judged {verdict:?}: {seen:?}"
        );
    }
}

#[test]
fn documents_hash_alike_exactly_when_they_are_equal_values() {
    let (equal, different) = (RefCell::new(0u32), RefCell::new(0u32));
    let strategy = (value(false), any::<u64>(), any::<u64>(), change());
    let result = runner().run(&strategy, |(m, seed, other_seed, c)| {
        let text = render(&m, seed, false);
        let again = render(&m, other_seed, false);
        prop_assert_eq!(
            fingerprint(&text),
            fingerprint(&again),
            "{} vs {}",
            text,
            again
        );
        let m2 = changed(&m, &c);
        let other = render(&m2, other_seed, false);
        let equal_values = same(&m, &m2);
        *if equal_values { &equal } else { &different }.borrow_mut() += 1;
        prop_assert_eq!(
            fingerprint(&text) == fingerprint(&other),
            equal_values,
            "{} vs {}",
            text,
            other
        );
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (equal, different) = (equal.into_inner(), different.into_inner());
    eprintln!("changed values: {equal} equal, {different} different");
    assert!(
        equal > 0 && different > equal,
        "{equal} equal, {different} different"
    );
}

#[test]
fn each_deliberate_difference_is_classified() {
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    for (text, want) in [
        (
            "{\"a\":1,\"b\":[1e5,\"x\"]}".to_string(),
            Verdict::BothAccept,
        ),
        (deep(SERDE_DEPTH - 1), Verdict::BothAccept),
        ("[1,]".to_string(), Verdict::BothRefuse),
        (deep(MAX_DEPTH + 1), Verdict::BothRefuse),
        ("1e1000000000000000000".to_string(), Verdict::BothRefuse),
        (r#"{"a":1,"\u0061":2}"#.to_string(), Verdict::DuplicateKey),
        (
            "[0e1000000000000000000]".to_string(),
            Verdict::ExponentBound,
        ),
        (
            "-1e-1000000000000000000".to_string(),
            Verdict::ExponentBound,
        ),
        ("1e400".to_string(), Verdict::SerdeF64Range),
        ("1e999999999999999999".to_string(), Verdict::SerdeF64Range),
        (deep(MAX_DEPTH), Verdict::SerdeRecursionLimit),
    ] {
        assert_eq!(verdict(text.as_bytes()), Ok(want), "{text}");
    }
    assert!(verdict(b"[1,2").is_ok(), "both refuse");
}
