//! Values written as human strings: durations (`"30s"`), sizes (`"64KiB"`) and rates
//! (`"240B/s"`).

use std::fmt;
use std::num::NonZeroU64;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use super::written::{text, Written};
use crate::record::policy::Ttl;
pub use crate::record::policy::MAX_DURATION;

/// A duration written as a human string: `"250ms"`, `"30s"`, `"24h"`, `"7d"`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// `d`, clamped to [`MAX_DURATION`] as a parsed value is.
    pub fn new(d: Duration) -> Self {
        HumanDuration(d.min(MAX_DURATION))
    }
}

impl fmt::Debug for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl Written for HumanDuration {
    fn written(&self) -> toml::Value {
        text(humantime::format_duration(self.0).to_string())
    }
}

/// A duration the configuration holds is written as a human one.
impl Written for Duration {
    fn written(&self) -> toml::Value {
        HumanDuration(*self).written()
    }
}

/// `s` as a duration, clamped to [`MAX_DURATION`] so that deadline arithmetic can never
/// overflow; refused saying what it should look like (`like`).
fn parse_duration<E: de::Error>(s: &str, like: &str) -> Result<Duration, E> {
    humantime::parse_duration(s.trim())
        .map(|d| d.min(MAX_DURATION))
        .map_err(|e| E::custom(format!("{s:?} is not a duration like {like} ({e})")))
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s, "\"30s\"").map(HumanDuration)
    }
}

/// A record lifetime written as a human duration, or `"forever"`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct HumanTtl(pub Ttl);

impl<'de> Deserialize<'de> for HumanTtl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.trim().eq_ignore_ascii_case("forever") {
            return Ok(HumanTtl(Ttl::Forever));
        }
        parse_duration(&s, "\"30s\" or \"forever\"").map(|d| HumanTtl(Ttl::For(d)))
    }
}

impl Written for HumanTtl {
    fn written(&self) -> toml::Value {
        text(self.0.to_string())
    }
}

impl Written for Ttl {
    fn written(&self) -> toml::Value {
        HumanTtl(*self).written()
    }
}

/// A size or a rate as written: a plain number, or a human string.
#[derive(Deserialize)]
#[serde(untagged)]
enum Raw {
    Int(u64),
    Str(String),
}

/// A size written as a human string: `"64KiB"`, `"1MiB"`, or a plain number of bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct HumanSize(pub u64);

impl fmt::Debug for HumanSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", bytesize::ByteSize(self.0).display().iec())
    }
}

/// A whole number of the largest binary unit that divides it (`"64KiB"`), else a number of
/// bytes (as a string past TOML's integers).
impl Written for HumanSize {
    fn written(&self) -> toml::Value {
        const UNITS: [&str; 6] = ["EiB", "PiB", "TiB", "GiB", "MiB", "KiB"];
        let n = self.0;
        for (i, unit) in UNITS.iter().enumerate() {
            let size = 1u64 << (10 * (UNITS.len() - i));
            if n != 0 && n.is_multiple_of(size) {
                return text(format!("{}{unit}", n / size));
            }
        }
        i64::try_from(n).map_or_else(|_| text(n.to_string()), toml::Value::Integer)
    }
}

/// Every `u64` the configuration holds is a size in bytes.
impl Written for u64 {
    fn written(&self) -> toml::Value {
        HumanSize(*self).written()
    }
}

impl<'de> Deserialize<'de> for HumanSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(HumanSize(n)),
            Raw::Str(s) => bytesize::ByteSize::from_str(s.trim())
                .map(|b| HumanSize(b.as_u64()))
                .map_err(|e| de::Error::custom(format!("{s:?} is not a size like \"1MiB\" ({e})"))),
        }
    }
}

/// A rate written as a size per second (`"240B/s"`, `"1MiB/s"`), or a number of bytes per
/// second; `"off"` or `0`: none.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct HumanRate(pub Option<NonZeroU64>);

impl fmt::Debug for HumanRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(rate) => write!(f, "{:?}/s", HumanSize(rate.get())),
            None => f.write_str("off"),
        }
    }
}

impl Written for HumanRate {
    fn written(&self) -> toml::Value {
        match self.0.map(|rate| HumanSize(rate.get()).written()) {
            None => text("off"),
            Some(toml::Value::String(size)) => text(format!("{size}/s")),
            Some(bytes) => bytes,
        }
    }
}

impl FromStr for HumanRate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let text = s.trim();
        if text.eq_ignore_ascii_case("off") {
            return Ok(HumanRate(None));
        }
        if let Ok(n) = text.parse::<u64>() {
            return Ok(HumanRate(NonZeroU64::new(n)));
        }
        let like = "a rate like \"240B/s\" or \"off\"";
        let size = text
            .strip_suffix("/s")
            .ok_or_else(|| format!("{s:?} is not {like}"))?;
        let bytes = bytesize::ByteSize::from_str(size.trim())
            .map_err(|e| format!("{s:?} is not {like} ({e})"))?
            .as_u64();
        // "0.5B/s" rounds to nothing: refused rather than read as "off".
        match NonZeroU64::new(bytes) {
            None if size.bytes().any(|b| (b'1'..=b'9').contains(&b)) => {
                Err(format!("{s:?} is less than 1 byte a second"))
            }
            rate => Ok(HumanRate(rate)),
        }
    }
}

impl<'de> Deserialize<'de> for HumanRate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(HumanRate(NonZeroU64::new(n))),
            // A refusal, so that the error names the field.
            Raw::Str(s) => s.parse().map_err(|reason| refused("", reason)),
        }
    }
}

/// Begins the message of a deserialisation error that is a refusal (never shown: the error
/// becomes `ConfigError::Invalid`, in `checked.rs`).
pub(super) const REFUSED: &str = "\u{1}refused:";

/// A refusal of the value being read, or of its field `within` (`""`: the value itself), as a
/// deserialisation error.
pub(super) fn refused<E: de::Error>(within: &str, reason: impl std::fmt::Display) -> E {
    E::custom(format_args!("{REFUSED}{within}\u{1}{reason}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value as written, read back by its reader.
    fn read<T: serde::de::DeserializeOwned>(value: &impl Written) -> T {
        let text = format!("v = {}", value.written());
        #[derive(Deserialize)]
        struct V<T> {
            v: T,
        }
        toml::from_str::<V<T>>(&text)
            .unwrap_or_else(|e| panic!("{text}: {e}"))
            .v
    }

    /// Every duration, lifetime, size and rate reads back, across each one's whole range, as
    /// the value it was written from.
    #[test]
    fn written_values_read_back_as_themselves() {
        let nanos = [
            1,
            999,
            1_000_000,
            1_500_000_000,
            59_999_999_999,
            86_400_000_000_001,
        ];
        let seconds = [1, 59, 60, 3_599, 86_400, 2_630_016, 31_557_600, 31_557_601];
        let durations = nanos
            .map(Duration::from_nanos)
            .into_iter()
            .chain(seconds.map(Duration::from_secs))
            .chain([
                MAX_DURATION,
                MAX_DURATION - Duration::from_nanos(1),
                Duration::ZERO,
            ]);
        for d in durations {
            assert_eq!(read::<HumanDuration>(&d).0, d, "{d:?}");
            assert_eq!(read::<HumanTtl>(&Ttl::For(d)).0, Ttl::For(d), "{d:?}");
        }
        assert_eq!(read::<HumanTtl>(&Ttl::Forever).0, Ttl::Forever);
        let big = u64::try_from(i64::MAX).unwrap();
        let sizes = [
            1,
            1023,
            1024,
            1025,
            64 << 10,
            3 << 20,
            5 << 30,
            15 << 60,
            big,
            big + 1,
        ];
        for n in sizes.into_iter().chain([u64::MAX, u64::MAX - 1]) {
            assert_eq!(read::<HumanSize>(&n).0, n, "{n}");
            let rate = HumanRate(NonZeroU64::new(n));
            assert_eq!(read::<HumanRate>(&rate), rate, "{n}");
        }
        assert_eq!(read::<HumanRate>(&HumanRate(None)), HumanRate(None));
        assert_eq!(HumanSize(64 << 10).written(), text("64KiB"));
        assert_eq!(
            HumanRate(NonZeroU64::new(1 << 20)).written(),
            text("1MiB/s")
        );
    }
}
