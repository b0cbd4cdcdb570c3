//! The rules about a message's head that more than one part of the gateway applies: what is
//! hop-by-hop, how a body is framed, and which requests the gateway admits at all.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode};

use crate::error::GatewayError;

/// Headers that describe one connection, never forwarded nor stored (RFC 9110 section 7.6.1).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Remove the hop-by-hop headers and every header that `Connection` names.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none of them: one pass over the few names present is cheaper than a
    // hash lookup per hop-by-hop name.
    if !headers
        .keys()
        .any(|n| HOP_BY_HOP.contains(n) || n == header::TRAILER)
    {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
    // "trailer" announces trailers of this message's chunked coding; it goes with the framing.
    headers.remove(header::TRAILER);
}

/// Make a message's head safe to pass on: with `Transfer-Encoding` the length came from the
/// chunked framing hyper decoded, so a `Content-Length` beside it is stale (RFC 9112 section 6.3)
/// and goes, before the hop-by-hop headers do. The next hop frames the body anew.
pub(crate) fn relayable(headers: &mut HeaderMap) {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
    }
    strip_hop_by_hop(headers);
}

/// Whether the gateway takes `req` at all. `CONNECT` is refused (501: a reverse proxy is no
/// tunnel), and so are transfer codings it would not relay faithfully (RFC 9112 section 6.1):
/// `chunked` applied more than once is invalid (400), and any other coding is one the gateway
/// does not decode (501), so forwarding the body would drop its label.
pub(crate) fn admit<B>(req: &Request<B>) -> Result<(), GatewayError> {
    if req.method() == Method::CONNECT {
        return Err(GatewayError::UnsupportedMethod(Method::CONNECT));
    }
    let mut chunked = 0;
    for value in req.headers().get_all(header::TRANSFER_ENCODING) {
        let value = value
            .to_str()
            .map_err(|_| GatewayError::UnsupportedTransferCoding)?;
        for coding in value.split(',').map(str::trim).filter(|c| !c.is_empty()) {
            if !coding.eq_ignore_ascii_case("chunked") {
                return Err(GatewayError::UnsupportedTransferCoding);
            }
            chunked += 1;
        }
    }
    if chunked > 1 {
        return Err(GatewayError::InvalidFraming(
            "Transfer-Encoding: chunked may be applied only once",
        ));
    }
    Ok(())
}

/// The `Content-Length` of a message, when it has a valid one.
pub(crate) fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// Whether a response's `Content-Length` values, if any, are the length of its body (RFC 9112
/// section 6.3). Checked on every response the gateway records or replays, so that a wrong
/// length never reaches a client. Responses without content (to HEAD; 1xx, 204, 304) may declare
/// the length of the representation instead.
pub(crate) fn declares_its_length<'a>(
    status: StatusCode,
    mut lengths: impl Iterator<Item = &'a HeaderValue>,
    body_len: usize,
    is_head: bool,
) -> bool {
    if is_head
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return true;
    }
    lengths.all(|v| {
        v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()) == Some(body_len as u64)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_standard_and_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret-Hop"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key(header::CONTENT_TYPE));
    }

    #[test]
    fn a_length_beside_chunked_is_dropped() {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        relayable(&mut h);
        assert!(h.is_empty(), "{h:?}");
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        relayable(&mut h);
        assert_eq!(
            h[header::CONTENT_LENGTH],
            "5",
            "a length alone is the framing"
        );
    }

    #[test]
    fn connect_and_codings_other_than_one_chunked_are_refused() {
        let admitted = |method: &str, codings: &[&'static str]| {
            let mut req = Request::builder().method(method).uri("/");
            for v in codings {
                req = req.header(header::TRANSFER_ENCODING, *v);
            }
            admit(&req.body(()).unwrap()).map_err(|e| e.kind())
        };
        assert_eq!(admitted("POST", &[]), Ok(()));
        assert_eq!(admitted("POST", &["chunked"]), Ok(()));
        assert_eq!(admitted("POST", &["Chunked "]), Ok(()));
        assert_eq!(
            admitted("POST", &["chunked, chunked"]),
            Err("invalid-framing")
        );
        assert_eq!(
            admitted("POST", &["chunked", "chunked"]),
            Err("invalid-framing")
        );
        assert_eq!(
            admitted("POST", &["gzip, chunked"]),
            Err("unsupported-transfer-coding")
        );
        assert_eq!(
            admitted("POST", &["identity"]),
            Err("unsupported-transfer-coding")
        );
        assert_eq!(admitted("CONNECT", &[]), Err("unsupported-method"));
    }

    #[test]
    fn declared_lengths_must_match_the_body() {
        let v = |s: &'static str| HeaderValue::from_static(s);
        let ok = |status: u16, lengths: &[HeaderValue], len: usize, head: bool| {
            declares_its_length(
                StatusCode::from_u16(status).unwrap(),
                lengths.iter(),
                len,
                head,
            )
        };
        assert!(ok(201, &[], 20, false));
        assert!(ok(201, &[v("20")], 20, false));
        assert!(!ok(201, &[v("5")], 20, false));
        assert!(!ok(201, &[v("20"), v("5")], 20, false));
        assert!(!ok(201, &[v("x")], 20, false));
        assert!(
            ok(200, &[v("20")], 0, true),
            "HEAD declares the GET's length"
        );
        assert!(ok(304, &[v("20")], 0, false));
    }
}
