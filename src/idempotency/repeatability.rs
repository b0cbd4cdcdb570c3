//! OASIS Repeatable Requests 1.0 on a route with `repeatability = true`: the key comes from
//! `Repeatability-Request-ID` (scoped by `Repeatability-Client-ID` too), the request says when it
//! was first sent (`Repeatability-First-Sent`), and a repeat too old for its record to be kept is
//! refused rather than run again. Every answer to such a request says whether it was accepted.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::error::GatewayError;
use crate::record::policy::{Policy, Ttl};

/// The request's identifier: the key.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("repeatability-request-id");
/// The client's identifier: part of the key's scope.
pub const CLIENT_ID: HeaderName = HeaderName::from_static("repeatability-client-id");
/// When the request was first sent, an HTTP-date: required with a request identifier.
pub const FIRST_SENT: HeaderName = HeaderName::from_static("repeatability-first-sent");
/// On every answer to a repeatable request: `accepted` or `rejected`.
pub const RESULT: HeaderName = HeaderName::from_static("repeatability-result");

/// How far in the future a `First-Sent` may be (clocks disagree a little).
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(60);

/// The headers a route reads its key from and scopes it by: the policy's own, with
/// `Repeatability-Request-ID` first and `Repeatability-Client-ID` last when the route speaks
/// Repeatable Requests. (An `Idempotency-Key` beside a Request-ID with another value is then
/// the 400 of two key headers that disagree.)
pub(crate) fn key_headers(policy: &Policy) -> (Vec<HeaderName>, Vec<HeaderName>) {
    let (mut keys, mut scope) = (policy.key_headers.clone(), policy.scope_headers.clone());
    if policy.repeatability {
        keys.retain(|h| *h != REQUEST_ID);
        keys.insert(0, REQUEST_ID);
        scope.retain(|h| *h != CLIENT_ID);
        scope.push(CLIENT_ID);
    }
    (keys, scope)
}

/// Whether a request to a route is repeatable: the route speaks Repeatable Requests and the
/// request carries a `Repeatability-Request-ID`.
pub(super) fn is_repeatable(policy: &Policy, headers: &HeaderMap) -> bool {
    policy.repeatability && headers.contains_key(REQUEST_ID)
}

/// Check a repeatable request's `Repeatability-First-Sent` at `now`: missing or unparsable is
/// 400; older than `ttl`, the shortest life the route gives a record (its record may be gone,
/// so a repeat could run twice), or more than [`MAX_CLOCK_SKEW`] ahead is 412.
pub(super) fn check_first_sent(
    headers: &HeaderMap,
    ttl: Ttl,
    now: SystemTime,
) -> Result<(), GatewayError> {
    let mut values = headers.get_all(FIRST_SENT).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(GatewayError::InvalidRepeatability(
            "a Repeatability-Request-ID needs exactly one Repeatability-First-Sent header (an HTTP-date)",
        ));
    };
    let sent = value
        .to_str()
        .ok()
        .and_then(|v| httpdate::parse_http_date(v.trim()).ok())
        .ok_or(GatewayError::InvalidRepeatability(
            "Repeatability-First-Sent is not an HTTP-date (e.g. \"Sun, 06 Nov 1994 08:49:37 GMT\")",
        ))?;
    if let Ok(ahead) = sent.duration_since(now) {
        if ahead > MAX_CLOCK_SKEW {
            return Err(GatewayError::RepeatabilityRejected(
                "Repeatability-First-Sent is more than a minute in the future",
            ));
        }
    }
    let age = now.duration_since(sent).unwrap_or_default();
    if ttl.finite().is_some_and(|ttl| age > ttl) {
        return Err(GatewayError::RepeatabilityRejected(
            "the request was first sent longer ago than this endpoint keeps its answers, so it cannot be repeated safely; send it as a new request",
        ));
    }
    Ok(())
}

/// Mark the answer to a repeatable request: `accepted` when it is the first answer or a replay,
/// `rejected` when the gateway refused it.
pub(super) fn mark(headers: &mut HeaderMap, accepted: bool) {
    let result = match accepted {
        true => HeaderValue::from_static("accepted"),
        false => HeaderValue::from_static("rejected"),
    };
    headers.insert(RESULT, result);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first_sent(at: SystemTime) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_static("r1"));
        let date = httpdate::fmt_http_date(at);
        h.insert(FIRST_SENT, HeaderValue::from_str(&date).unwrap());
        h
    }

    #[test]
    fn first_sent_must_be_within_the_ttl_and_not_ahead() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000);
        let day = Ttl::For(Duration::from_secs(86_400));
        let kind = |h: &HeaderMap, ttl| check_first_sent(h, ttl, now).map_err(|e| e.kind());
        assert_eq!(kind(&first_sent(now), day), Ok(()));
        let hour_ago = first_sent(now - Duration::from_secs(3600));
        assert_eq!(kind(&hour_ago, day), Ok(()));
        let two_days = first_sent(now - Duration::from_secs(2 * 86_400));
        assert_eq!(kind(&two_days, day), Err("repeatability-rejected"));
        assert_eq!(kind(&two_days, Ttl::Forever), Ok(()));
        let skewed = first_sent(now + Duration::from_secs(30));
        assert_eq!(kind(&skewed, day), Ok(()));
        let ahead = first_sent(now + Duration::from_secs(120));
        assert_eq!(kind(&ahead, day), Err("repeatability-rejected"));
        let mut garbled = first_sent(now);
        garbled.insert(FIRST_SENT, HeaderValue::from_static("yesterday"));
        assert_eq!(kind(&garbled, day), Err("invalid-repeatability"));
        let mut missing = first_sent(now);
        missing.remove(FIRST_SENT);
        assert_eq!(kind(&missing, day), Err("invalid-repeatability"));
    }

    #[test]
    fn the_request_id_comes_first_and_the_client_id_scopes() {
        let policy = Policy::builder().repeatability(true).build().unwrap();
        let (keys, scope) = key_headers(&policy);
        assert_eq!(
            keys,
            [REQUEST_ID, http::HeaderName::from_static("idempotency-key")]
        );
        assert_eq!(scope, [http::header::AUTHORIZATION, CLIENT_ID]);
        let plain = Policy::default();
        assert_eq!(
            key_headers(&plain),
            (plain.key_headers.clone(), plain.scope_headers.clone())
        );
    }
}
