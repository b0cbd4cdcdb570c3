//! gRPC calls through the idempotency layer (docs/behaviour.md, "gRPC"): which requests are gRPC
//! calls, which of them are unary (the only ones a key protects), which gRPC statuses are
//! recorded, and the gateway's own refusals as gRPC statuses.
//!
//! A gRPC call is an HTTP/2 `POST` with `content-type: application/grpc` (`+proto`, `+json`, ...);
//! its messages are length-prefixed (a flag byte, a 4-byte big-endian length, the message) and
//! its status comes in the response's trailers (`grpc-status`, `grpc-message`), or in the
//! headers of a trailers-only answer.

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{StatusCode, Version};
use http_body::Body as _;
use http_body_util::BodyExt;

use super::body::{joined, BoxError, Collected};
use crate::error::ErrorFormat;
use crate::grpc_status::{Code, GRPC_STATUS};

/// The length prefix of a gRPC message: a compressed flag, then a 4-byte big-endian length.
const PREFIX_LEN: usize = 5;

/// How long a call's request stream may stay open after its first whole message before the
/// call is taken for a streaming one. Unary clients half-close with their message (gRPC's
/// clients send the message and the end of the stream together); a second covers a
/// retransmission or two of a last frame lost on the way, so that a unary call is not run
/// without idempotency for it.
const HALF_CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Whether a request is a gRPC call: HTTP/2 with a `application/grpc` content type (alone or
/// with a `+subtype` or parameters). Such a request gets the gRPC rules on whatever route it
/// matches; nothing is configured.
pub(crate) fn is_call(version: Version, headers: &HeaderMap) -> bool {
    version == Version::HTTP_2
        && headers.get(header::CONTENT_TYPE).is_some_and(|ct| {
            let ct = ct.as_bytes();
            const GRPC: &[u8] = b"application/grpc";
            ct.get(..GRPC.len())
                .is_some_and(|start| start.eq_ignore_ascii_case(GRPC))
                && matches!(ct.get(GRPC.len()), None | Some(b'+' | b';'))
        })
}

/// The shape of the gateway's own answers to a request: a gRPC status for a gRPC call
/// ([`is_call`]), the route's `format` for anything else.
pub(crate) fn error_format(is_call: bool, format: ErrorFormat) -> ErrorFormat {
    if is_call {
        ErrorFormat::Grpc
    } else {
        format
    }
}

/// The length a message's prefix declares, when `buf` holds a whole prefix.
fn declared_len(buf: &[u8]) -> Option<u64> {
    // A compression flag, then the length.
    let len: [u8; 4] = buf.get(1..PREFIX_LEN)?.try_into().ok()?;
    Some(u32::from_be_bytes(len).into())
}

/// A gRPC call's request body, as the unary rule reads it.
pub(super) enum Call {
    /// A unary call's body read whole, or found larger than the cap.
    Unary(Collected),
    /// A streaming call's: the chunks read so far, and the rest, to pass on as it comes.
    Streaming { read: Vec<Bytes>, rest: Body },
}

/// Read a gRPC call's request body as the unary rule needs it: to its end when it is exactly
/// one whole length-prefixed message (`Whole`), or only until it proves to be something else:
/// a first message larger than `cap` (`TooLarge`), bytes after the first message, or a stream
/// still open [`HALF_CLOSE_GRACE`] after it (`Streaming`). A body that ends before a whole
/// message is `Whole` too: the upstream judges it.
pub(super) async fn collect_call(mut body: Body, cap: u64) -> Result<Call, axum::Error> {
    let mut read: Vec<Bytes> = Vec::new();
    // The bytes read, and the first of them: the first message's length prefix.
    let (mut total, mut prefix) = (0u64, Vec::with_capacity(PREFIX_LEN));
    loop {
        let expected = declared_len(&prefix).map(|n| n + PREFIX_LEN as u64);
        match expected {
            Some(n) if n > cap => return Ok(Call::Unary(Collected::TooLarge { read, rest: body })),
            Some(n) if total > n => return Ok(Call::Streaming { read, rest: body }),
            _ => {}
        }
        let one = expected == Some(total);
        let next = if one && body.is_end_stream() {
            None
        } else if one {
            match tokio::time::timeout(HALF_CLOSE_GRACE, body.frame()).await {
                Ok(next) => next,
                Err(_) => return Ok(Call::Streaming { read, rest: body }),
            }
        } else {
            body.frame().await
        };
        let Some(frame) = next else {
            return Ok(Call::Unary(Collected::Whole(joined(read, total), None)));
        };
        match frame?.into_data() {
            Ok(data) => {
                let missing = PREFIX_LEN.saturating_sub(prefix.len());
                prefix.extend(data.iter().take(missing));
                total += data.len() as u64;
                read.push(data);
            }
            // Request trailers: not what a unary client sends; passed on as they are.
            Err(frame) => {
                let trailers = frame.into_trailers().ok();
                let rest = Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
                    trailers.map(|t| Ok::<_, BoxError>(http_body::Frame::trailers(t))),
                )));
                return Ok(Call::Streaming { read, rest });
            }
        }
    }
}

/// Whether a gRPC call's status is still to come in its trailers: an answer with HTTP 200 and
/// no `grpc-status` among its headers (a trailers-only answer carries it there).
pub(super) fn status_follows(head: &http::response::Parts) -> bool {
    head.status == StatusCode::OK && !head.headers.contains_key(GRPC_STATUS)
}

/// A gRPC answer's status code: from its trailers, or from its headers when it is
/// trailers-only. An answer without one is broken, and counts as `UNKNOWN` (as a client reads
/// it).
pub(super) fn status_of(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> u32 {
    trailers
        .and_then(|t| t.get(GRPC_STATUS))
        .or_else(|| headers.get(GRPC_STATUS))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(Code::Unknown as u32)
}

/// Whether a gRPC answer with status `code` is recorded. Stored: `OK` and the codes that say
/// the request itself is wrong (`INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`,
/// `PERMISSION_DENIED`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`, `UNAUTHENTICATED`). Released, as
/// a 5xx is: the codes that say "try again" (`CANCELLED`, `DEADLINE_EXCEEDED`,
/// `RESOURCE_EXHAUSTED`, `ABORTED`, `UNAVAILABLE`), always, and the server's failures
/// (`UNKNOWN`, `UNIMPLEMENTED`, `INTERNAL`, `DATA_LOSS`, any other) unless the route has
/// `cache_server_errors`.
pub(super) fn is_storable(code: u32, cache_server_errors: bool) -> bool {
    match code {
        0 | 3 | 5 | 6 | 7 | 9 | 11 | 16 => true,
        1 | 4 | 8 | 10 | 14 => false,
        _ => cache_server_errors,
    }
}

/// Whether a recorded gRPC answer is a failure (kept for the route's `failure_ttl`).
pub(super) fn is_failure(code: u32) -> bool {
    code != Code::Ok as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::GatewayError;
    use crate::grpc_status::{GRPC_MESSAGE, GRPC_RETRY_PUSHBACK};
    use http::HeaderValue;

    fn headers(ct: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
        h
    }

    #[test]
    fn grpc_calls_are_told_by_content_type_over_http2() {
        for ct in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC+json",
            "application/grpc;charset=utf-8",
        ] {
            assert!(is_call(Version::HTTP_2, &headers(ct)), "{ct}");
        }
        for ct in [
            "application/grpc-web",
            "application/json",
            "application/grp",
        ] {
            assert!(!is_call(Version::HTTP_2, &headers(ct)), "{ct}");
        }
        assert!(!is_call(Version::HTTP_11, &headers("application/grpc")));
        assert!(!is_call(Version::HTTP_2, &HeaderMap::new()));
    }

    #[test]
    fn stored_and_released_codes() {
        for code in [0, 3, 5, 6, 7, 9, 11, 16] {
            assert!(is_storable(code, false), "{code}");
        }
        for code in [1, 2, 4, 8, 10, 12, 13, 14, 15, 17] {
            assert!(!is_storable(code, false), "{code}");
        }
        assert!(is_storable(13, true) && is_storable(2, true));
        assert!(!is_storable(14, true) && !is_storable(4, true));
    }

    #[test]
    fn status_from_trailers_or_a_trailers_only_head() {
        let mut trailers = HeaderMap::new();
        trailers.insert(GRPC_STATUS, HeaderValue::from_static("5"));
        assert_eq!(status_of(&HeaderMap::new(), Some(&trailers)), 5);
        let mut head = HeaderMap::new();
        head.insert(GRPC_STATUS, HeaderValue::from_static("14"));
        assert_eq!(status_of(&head, None), 14);
        assert_eq!(status_of(&HeaderMap::new(), None), Code::Unknown as u32);
    }

    #[test]
    fn refusals_are_trailers_only_statuses() {
        let resp = GatewayError::MissingKey.respond(ErrorFormat::Grpc);
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()[GRPC_STATUS], "3");
        let message = resp.headers()[GRPC_MESSAGE].to_str().unwrap();
        let instance = message
            .strip_prefix(
                "missing-key: this endpoint requires an Idempotency-Key header (instance urn:uuid:",
            )
            .and_then(|rest| rest.strip_suffix(')'));
        assert_eq!(instance.map(str::len), Some(36), "{message}");
        let e = GatewayError::InFlight {
            retry_after: Duration::from_secs(1),
        };
        let resp = e.respond(ErrorFormat::Grpc);
        assert_eq!(resp.headers()[GRPC_STATUS], "10");
        assert_eq!(resp.headers()[GRPC_RETRY_PUSHBACK], "1000");
    }

    fn frames(parts: Vec<&'static [u8]>, open: bool) -> Body {
        use futures_util::StreamExt;
        let parts = futures_util::stream::iter(
            parts
                .into_iter()
                .map(|p| Ok::<_, BoxError>(Bytes::from_static(p))),
        );
        if open {
            Body::from_stream(parts.chain(futures_util::stream::pending()))
        } else {
            Body::from_stream(parts)
        }
    }

    #[tokio::test]
    async fn one_whole_message_is_unary_anything_else_streams() {
        let msg: &[u8] = b"\0\0\0\0\x03abc";
        match collect_call(frames(vec![&msg[..4], &msg[4..]], false), 64).await {
            Ok(Call::Unary(Collected::Whole(b, _))) => assert_eq!(&b[..], msg),
            _ => panic!("one message, then the end"),
        }
        let streams = |body| async move {
            matches!(collect_call(body, 64).await, Ok(Call::Streaming { .. }))
        };
        assert!(streams(frames(vec![msg, b"\0\0\0\0\x01z"], false)).await);
        assert!(streams(frames(vec![b"\0\0\0\0\x01z\0"], false)).await);
        assert!(streams(frames(vec![msg], true)).await, "still open");
        match collect_call(frames(vec![b"\0\0"], false), 64).await {
            Ok(Call::Unary(Collected::Whole(b, _))) => assert_eq!(&b[..], b"\0\0"),
            _ => panic!("cut short: the upstream judges it"),
        }
        let big = frames(vec![b"\0\0\0\x01\0"], true);
        assert!(matches!(
            collect_call(big, 64).await,
            Ok(Call::Unary(Collected::TooLarge { .. }))
        ));
    }
}
