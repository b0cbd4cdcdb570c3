//! What is recorded and what is replayed: which responses are stored and for how long (status,
//! `Idempotency-Control`, the route's ttls), the framing a record must keep, and the responses
//! built from a record (the first answer and every replay, with the expiry header).

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{response, HeaderMap, Response, StatusCode};

use super::body::{with_trailers, ByteBody};
use super::grpc;
use crate::headers::declares_its_length;
use crate::record::policy::{AfterExpiry, Policy, Ttl};
use crate::record::StoredResponse;
use crate::store::Keep;

/// The W3C trace context header, forwarded to the inner service and stored with the record.
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The header that marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The header by which an upstream steers the recording of one response (`no-store`,
/// `max-age=SECONDS`); never relayed to a client.
pub const IDEMPOTENCY_CONTROL: HeaderName = HeaderName::from_static("idempotency-control");

/// A response the inner service gave, as relayed to the client: its body boxed, and
/// `Idempotency-Control` removed.
pub(super) fn relayed(resp: Response<impl ByteBody>) -> Response<Body> {
    let mut resp = resp.map(Body::new);
    if !resp.headers().is_empty() {
        resp.headers_mut().remove(IDEMPOTENCY_CONTROL);
    }
    resp
}

/// How to record a response whose head is `head` (how long, and whether it leaves a
/// tombstone), or `None` when it must not be recorded (a status that says "try again", or
/// `Idempotency-Control: no-store`). The answer to a gRPC call (`grpc`) with HTTP 200 is judged
/// by its gRPC status, read from `trailers` (or its head, when trailers-only). Takes
/// `Idempotency-Control` out of the head either way.
pub(super) fn recorded_for(
    head: &mut response::Parts,
    trailers: Option<&HeaderMap>,
    grpc: bool,
    policy: &Policy,
) -> Option<Keep> {
    Terms::take(head).keep((head.status, &head.headers), trailers, grpc, policy)
}

/// What a response's head says of its recording: its `Idempotency-Control`, taken out of the
/// head (never relayed), for [`Terms::ttl`] to decide once the status is known (a gRPC call's,
/// after its trailers).
pub(super) struct Terms(Control);

impl Terms {
    /// The terms of the response whose head is `head`, its `Idempotency-Control` removed.
    pub(super) fn take(head: &mut response::Parts) -> Self {
        Terms(Control::take(&mut head.headers))
    }

    /// [`recorded_for`] on a head taken before: its status and headers, then its trailers. A
    /// failure (a 4xx, a recorded 5xx, a gRPC status other than OK) is kept for `failure_ttl`
    /// and leaves no tombstone: once it expires, the corrected request may run with the same
    /// key, on a route that refuses expired keys too.
    pub(super) fn keep(
        &self,
        (status, headers): (StatusCode, &HeaderMap),
        trailers: Option<&HeaderMap>,
        grpc: bool,
        policy: &Policy,
    ) -> Option<Keep> {
        let (storable, failure) = if grpc && status == StatusCode::OK {
            let code = grpc::status_of(headers, trailers);
            let storable = grpc::is_storable(code, policy.cache_server_errors);
            (storable, grpc::is_failure(code))
        } else {
            // A webhook route records only a 2xx: any other answer lets the sender's retry run.
            let storable = is_storable(status, policy.cache_server_errors)
                && (policy.webhook.is_none() || status.is_success());
            (storable, status.as_u16() >= 400)
        };
        if !storable || self.0.no_store {
            return None;
        }
        let ttl = match self.0.max_age {
            // A repeatable route vouches for repeats sent within its records' shortest life
            // (repeatability.rs): an upstream's shorter max-age would break that promise.
            Some(age) if policy.repeatability => {
                age.max(policy.shortest_life()).min(policy.max_ttl)
            }
            Some(age) => age.min(policy.max_ttl),
            None if failure => policy.failure_ttl,
            None => policy.ttl,
        };
        let refuses = policy.after_expiry == AfterExpiry::Refuse && !failure;
        Some(Keep {
            ttl,
            tombstone: refuses.then_some(policy.tombstone_ttl),
        })
    }
}

/// What an upstream's `Idempotency-Control` asks for one response.
#[derive(Debug, Default, PartialEq, Eq)]
struct Control {
    // `no-store`, or `max-age=0`: not recorded.
    no_store: bool,
    // `max-age=SECONDS`: recorded for this long (bounded by the route's max_ttl, and by
    // MAX_DURATION however many seconds it says).
    max_age: Option<Ttl>,
}

impl Control {
    /// Read the directives of every `Idempotency-Control` header (comma-separated,
    /// case-insensitive; unknown ones ignored), and remove them.
    fn take(headers: &mut HeaderMap) -> Self {
        let mut control = Control::default();
        for value in headers.get_all(IDEMPOTENCY_CONTROL) {
            for directive in value.to_str().unwrap_or("").split(',').map(str::trim) {
                let (name, arg) = directive.split_once('=').unwrap_or((directive, ""));
                if name.eq_ignore_ascii_case("no-store") {
                    control.no_store = true;
                } else if name.eq_ignore_ascii_case("max-age") {
                    match arg.trim().trim_matches('"').parse::<u64>() {
                        Ok(0) => control.no_store = true,
                        Ok(secs) => control.max_age = Some(Ttl::secs(secs)),
                        Err(_) => {}
                    }
                }
            }
        }
        headers.remove(IDEMPOTENCY_CONTROL);
        control
    }
}

/// Stored: 2xx, 3xx and 4xx except 408 and 429 (and 5xx when the route says so). Not stored:
/// answers that say "try again" (5xx, 408 Request Timeout, 429 Too Many Requests).
fn is_storable(status: StatusCode, cache_server_errors: bool) -> bool {
    match status.as_u16() {
        408 | 429 => false,
        200..=499 => true,
        500..=599 => cache_server_errors,
        _ => false,
    }
}

/// Whether a stored response declares the length of the body it holds (a response whose
/// `Content-Length` disagrees with its body, or a record cut short in the store, does not), for
/// an answer to a `HEAD` request when `to_head`.
pub(super) fn framed(stored: &StoredResponse, to_head: bool) -> bool {
    declares_its_length(stored.status, stored.lengths(), stored.body.len(), to_head)
}

/// The first answer from a response just recorded for `ttl`.
pub(super) fn first(stored: &StoredResponse, policy: &Policy, ttl: Ttl) -> Response<Body> {
    let body = with_trailers(stored.body.clone(), stored.trailer_map());
    respond(stored, body, None, expiry(policy, ttl.finite()))
}

/// A replay of a stored response that lives `lives` more (forever: no expiry header): marked
/// `Idempotent-Replayed: true`, without the route's `replay_drop_headers`; its body from byte
/// `from` on (an event stream resumed after `Last-Event-ID`), with its length said anew.
pub(super) fn replay(
    stored: &StoredResponse,
    policy: &Policy,
    lives: Option<Duration>,
    from: usize,
) -> Response<Body> {
    let body = with_trailers(stored.body.slice(from..), stored.trailer_map());
    let drop = Some(&policy.replay_drop_headers[..]);
    let mut resp = respond(stored, body, drop, expiry(policy, lives));
    if from > 0 && resp.headers().contains_key(header::CONTENT_LENGTH) {
        let left = HeaderValue::from(stored.body.len() - from);
        resp.headers_mut().insert(header::CONTENT_LENGTH, left);
    }
    resp
}

/// The first answer of a streamed response whose record will live `lives` (`None`: forever, or
/// not known before its end): its head (`body` empty), and `body` as it comes.
pub(super) fn first_streamed(
    head: &StoredResponse,
    body: Body,
    policy: &Policy,
    lives: Option<Duration>,
) -> Response<Body> {
    respond(head, body, None, expiry(policy, lives))
}

/// A duplicate's answer from the live stream it attached to, marked as a replay; without a
/// length when it `resumes` an event stream partway.
pub(super) fn attached(
    head: &StoredResponse,
    body: Body,
    policy: &Policy,
    lives: Option<Duration>,
    resumes: bool,
) -> Response<Body> {
    let drop = Some(&policy.replay_drop_headers[..]);
    let mut resp = respond(head, body, drop, expiry(policy, lives));
    if resumes {
        resp.headers_mut().remove(header::CONTENT_LENGTH);
    }
    resp
}

/// The only answer from a response too large to record (the key is recorded as not replayable
/// for `ttl`): the chunks read so far, then the rest as it comes.
pub(super) fn streamed_once(
    head: response::Parts,
    read: Vec<Bytes>,
    rest: Body,
    policy: &Policy,
    ttl: Ttl,
) -> Response<Body> {
    let mut resp = Response::from_parts(head, super::body::replay_then_rest(read, rest));
    if let Some((name, value)) = expiry(policy, ttl.finite()) {
        resp.headers_mut().insert(name, value);
    }
    resp
}

/// The expiry header of `policy`, for a record that lives `lives` more (forever: none).
fn expiry(policy: &Policy, lives: Option<Duration>) -> Option<(HeaderName, HeaderValue)> {
    let name = policy.expiry_header.clone()?;
    Some((name, crate::time::expiry_date(lives)?))
}

/// Build the client's response from a stored head and `body`. A replay (`drop` given) carries
/// `Idempotent-Replayed: true` and none of the headers in `drop`; `expiry` is added when set.
fn respond(
    stored: &StoredResponse,
    body: Body,
    drop: Option<&[HeaderName]>,
    expiry: Option<(HeaderName, HeaderValue)>,
) -> Response<Body> {
    let mut resp = Response::new(body);
    *resp.status_mut() = stored.status;
    let headers = resp.headers_mut();
    headers.reserve(stored.headers.len() + 2);
    for (n, v) in &stored.headers {
        if drop.is_some_and(|drop| drop.contains(n)) {
            continue;
        }
        headers.append(n.clone(), v.clone());
    }
    if drop.is_some() {
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    if let Some((name, value)) = expiry {
        headers.insert(name, value);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storable_statuses() {
        for s in [200, 201, 204, 301, 400, 404, 409, 422] {
            assert!(is_storable(StatusCode::from_u16(s).unwrap(), false), "{s}");
        }
        for s in [408, 429, 500, 502, 503] {
            assert!(!is_storable(StatusCode::from_u16(s).unwrap(), false), "{s}");
        }
        assert!(is_storable(StatusCode::INTERNAL_SERVER_ERROR, true));
        assert!(!is_storable(StatusCode::TOO_MANY_REQUESTS, true));
    }
}
