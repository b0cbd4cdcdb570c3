//! Time as the gateway reckons it. Every duration that comes from the config, a client, an
//! upstream or a stored record (a ttl, an upstream's `max-age`, a lease, a tombstone's life) is
//! bounded by [`MAX_DURATION`] when it is used, and every deadline, expiry, SQL interval and
//! HTTP-date is made here with saturating arithmetic, so that no value can overflow a time or
//! make a formatter panic.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::HeaderValue;

/// The longest duration any setting takes effect with (100 years); longer values are clamped,
/// so that deadline arithmetic can never overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The last second an HTTP-date can name (9999-12-31T23:59:59Z), in seconds since the epoch.
const LAST_HTTP_DATE: u64 = 253_402_300_799;

/// How long a record is kept: a duration, or until an operator evicts it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Ttl {
    /// Kept this long (at most [`MAX_DURATION`]: a longer one is used as that).
    For(Duration),
    /// Never expires (`"forever"`): only the durable stores keep such records, and only an
    /// admin eviction removes one. Redis, which the gateway never asks to, keeps one for
    /// [`MAX_DURATION`].
    Forever,
}

impl Ttl {
    /// `secs` seconds (an upstream's `max-age`, up to `u64::MAX`), bounded by [`MAX_DURATION`].
    pub fn secs(secs: u64) -> Self {
        Ttl::For(Duration::from_secs(secs).min(MAX_DURATION))
    }

    /// The duration, bounded by [`MAX_DURATION`]; `None` for [`Ttl::Forever`].
    pub fn finite(self) -> Option<Duration> {
        match self {
            Ttl::For(d) => Some(d.min(MAX_DURATION)),
            Ttl::Forever => None,
        }
    }

    /// The duration, [`MAX_DURATION`] for [`Ttl::Forever`].
    pub fn clamped(self) -> Duration {
        self.finite().unwrap_or(MAX_DURATION)
    }
}

impl From<Duration> for Ttl {
    fn from(d: Duration) -> Self {
        Ttl::For(d)
    }
}

impl std::fmt::Debug for Ttl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ttl::For(d) => d.fmt(f),
            Ttl::Forever => f.write_str("forever"),
        }
    }
}

impl std::fmt::Display for Ttl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ttl::For(d) => humantime::format_duration(*d).fmt(f),
            Ttl::Forever => f.write_str("forever"),
        }
    }
}

/// `d` bounded by [`MAX_DURATION`].
pub fn bounded(d: Duration) -> Duration {
    d.min(MAX_DURATION)
}

/// Whole milliseconds of `d` bounded by [`MAX_DURATION`], at least 1: a Redis `PX`, an SQL
/// interval, an expiry in ms. Never 0, which a store would read as "already gone" or refuse.
pub fn millis(d: Duration) -> u64 {
    // MAX_DURATION in ms (3.2e12) fits a u64, and an SQL interval, by far.
    bounded(d).as_millis().max(1) as u64
}

/// `d` after `now`, for a deadline or an expiry: saturating, never a panic.
pub fn after(now: tokio::time::Instant, d: Duration) -> tokio::time::Instant {
    let d = bounded(d);
    now.checked_add(d).unwrap_or(now)
}

/// `d` after `now_ms` (ms since the Unix epoch), saturating.
pub fn after_ms(now_ms: u64, d: Duration) -> u64 {
    now_ms.saturating_add(millis(d))
}

/// Now, in ms since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `at` as an HTTP-date (RFC 9110 5.6.7), or `None` when it is outside what one can say (before
/// 1970 or after 9999).
pub fn http_date(at: SystemTime) -> Option<String> {
    let secs = at.duration_since(UNIX_EPOCH).ok()?.as_secs();
    (secs <= LAST_HTTP_DATE).then(|| httpdate::fmt_http_date(at))
}

/// [`http_date`] of a time in ms since the Unix epoch (a record's written or expiry time).
pub fn http_date_ms(ms: u64) -> Option<String> {
    http_date(UNIX_EPOCH.checked_add(Duration::from_millis(ms))?)
}

/// A time in ms since the Unix epoch as RFC 3339 with milliseconds, or `None` past year 9999.
pub fn rfc3339_ms(ms: u64) -> Option<String> {
    let at = UNIX_EPOCH.checked_add(Duration::from_millis(ms))?;
    (ms / 1000 <= LAST_HTTP_DATE).then(|| humantime::format_rfc3339_millis(at).to_string())
}

/// The HTTP-date `lives` from now, as a header value: `None` for a record kept forever or when
/// the date cannot be written.
pub fn expiry_date(lives: Option<Duration>) -> Option<HeaderValue> {
    let at = SystemTime::now().checked_add(bounded(lives?))?;
    HeaderValue::from_str(&http_date(at)?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_max_age_is_bounded() {
        for secs in [0, 1, 86_400, 300_000_000_000, 10_000_000_000_000, u64::MAX] {
            let ttl = Ttl::secs(secs);
            assert!(ttl.clamped() <= MAX_DURATION, "{secs}");
            assert!(expiry_date(ttl.finite()).is_some(), "{secs}");
            assert!(millis(ttl.clamped()) >= 1);
        }
        assert_eq!(Ttl::For(Duration::MAX).finite(), Some(MAX_DURATION));
    }

    #[test]
    fn http_dates_end_at_year_9999() {
        assert_eq!(
            http_date_ms(LAST_HTTP_DATE * 1000).as_deref(),
            Some("Fri, 31 Dec 9999 23:59:59 GMT")
        );
        assert_eq!(http_date_ms(LAST_HTTP_DATE * 1000 + 1000), None);
        assert_eq!(http_date_ms(u64::MAX), None);
        assert_eq!(rfc3339_ms(u64::MAX), None);
        assert_eq!(rfc3339_ms(0).as_deref(), Some("1970-01-01T00:00:00.000Z"));
        assert_eq!(
            http_date_ms(0).as_deref(),
            Some("Thu, 01 Jan 1970 00:00:00 GMT")
        );
    }

    #[test]
    fn arithmetic_saturates() {
        let now = tokio::time::Instant::now();
        assert!(after(now, Duration::MAX) > now);
        assert_eq!(after_ms(u64::MAX - 1, Duration::MAX), u64::MAX);
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::MAX), millis(MAX_DURATION));
    }
}
