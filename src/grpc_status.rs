//! gRPC's status vocabulary, shared by the engine (which statuses are recorded) and the
//! gateway's own answers to a gRPC call: the status codes, the trailers that carry them, and a
//! trailers-only answer.

use std::time::Duration;

use axum::body::Body;
use http::header::{self, HeaderName, HeaderValue};
use http::Response;

/// The trailer (or trailers-only header) that carries a call's status code.
pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// The trailer that carries a call's status message, percent-encoded.
pub(crate) const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// How long a client that asks to be retried should wait, in ms (gRPC's retry pushback).
pub(crate) const GRPC_RETRY_PUSHBACK: HeaderName =
    HeaderName::from_static("grpc-retry-pushback-ms");

/// The gRPC status codes the gateway names (the rest are numbers it only passes on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Code {
    Ok = 0,
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Aborted = 10,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    DataLoss = 15,
}

/// A trailers-only answer (HTTP 200, no body): `code` in `grpc-status`, `message` in
/// `grpc-message`, and when the client should retry later, `grpc-retry-pushback-ms`.
pub(crate) fn trailers_only(
    code: Code,
    message: &str,
    retry_after: Option<Duration>,
) -> Response<Body> {
    let mut resp = Response::new(Body::empty());
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert(GRPC_STATUS, HeaderValue::from(code as u16));
    headers.insert(GRPC_MESSAGE, percent_encoded(message));
    if let Some(after) = retry_after {
        headers.insert(
            GRPC_RETRY_PUSHBACK,
            HeaderValue::from(after.as_millis() as u64),
        );
    }
    resp
}

/// `grpc-message`'s encoding: printable ASCII except `%` as it is, every other byte of the
/// UTF-8 as `%XX`.
#[expect(
    clippy::expect_used,
    reason = "only printable ASCII is pushed: every other byte is written as %XX"
)]
fn percent_encoded(message: &str) -> HeaderValue {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    HeaderValue::from_str(&out).expect("printable ASCII")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encoded("50% é\n"), "50%25 %C3%A9%0A");
        let resp = trailers_only(
            Code::Aborted,
            "in-flight: wait",
            Some(Duration::from_secs(1)),
        );
        assert_eq!(resp.status(), http::StatusCode::OK);
        assert_eq!(resp.headers()[GRPC_STATUS], "10");
        assert_eq!(resp.headers()[GRPC_MESSAGE], "in-flight: wait");
        assert_eq!(resp.headers()[GRPC_RETRY_PUSHBACK], "1000");
    }
}
