//! The rules about a message's head that more than one part of the gateway applies: what is
//! hop-by-hop, how a body is framed, and which requests the gateway admits at all.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode};

use crate::error::GatewayError;

/// Headers that describe one connection, never forwarded nor stored (RFC 9110 section 7.6.1).
/// `Trailer` is not one of them: it names a message's trailer fields end to end (section 6.6.2),
/// and an HTTP/1.1 client that accepts trailers gets those it names.
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

/// Whether a request's `TE` accepts trailers. `TE: trailers` is the one `TE` HTTP/2 allows
/// (RFC 9113 section 8.2.2), and a gRPC server requires it; the proxy says it again to an
/// HTTP/2 upstream, as hop-by-hop headers are never forwarded as they came.
pub(crate) fn accepts_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            let coding = t.split(';').next().unwrap_or("").trim();
            coding.eq_ignore_ascii_case("trailers")
        })
}

/// The media type of a `Content-Type` value (`type/subtype`, its parameters and spaces aside);
/// `None` when the value is not text.
pub(crate) fn media_type(content_type: &[u8]) -> Option<&str> {
    let ct = std::str::from_utf8(content_type).ok()?;
    Some(ct.split(';').next().unwrap_or("").trim())
}

/// Remove the hop-by-hop headers and every header that `Connection` names.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none of them: one pass over the few names present is cheaper than a
    // hash lookup per hop-by-hop name.
    if !headers.keys().any(|n| HOP_BY_HOP.contains(n)) {
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
    admit_authority(req)
}

/// The request's authority, said once: no userinfo in `:authority` or an absolute-form target
/// (RFC 9113 section 8.3.1, RFC 9110 section 4.2.4), one `Host`, and a `Host` beside an
/// authority names the same one (compared without regard to case), so that what the upstream
/// is told in `X-Forwarded-Host` is what the request was routed by.
fn admit_authority<B>(req: &Request<B>) -> Result<(), GatewayError> {
    let authority = req.uri().authority().map(|a| a.as_str());
    if authority.is_some_and(|a| a.contains('@')) {
        return Err(GatewayError::InvalidAuthority(
            "userinfo (user:password@) is not allowed in the request's authority",
        ));
    }
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(GatewayError::InvalidAuthority(
            "a request carries one Host header at most",
        ));
    }
    match (host, authority) {
        (Some(host), _) if host.as_bytes().contains(&b'@') => Err(GatewayError::InvalidAuthority(
            "userinfo (user:password@) is not allowed in Host",
        )),
        (Some(host), Some(authority))
            if !host.as_bytes().eq_ignore_ascii_case(authority.as_bytes()) =>
        {
            Err(GatewayError::InvalidAuthority(
                "Host names another authority than the request's :authority (or target)",
            ))
        }
        _ => Ok(()),
    }
}

/// Whether `status` can end an exchange: 200 to 599. An informational status (1xx: a `101`
/// nobody asked for, since the gateway forwards no `Upgrade`) or one outside the range RFC 9110
/// defines is a broken answer, however the recording rules would treat it.
pub(crate) fn is_final_status(status: StatusCode) -> bool {
    (200..=599).contains(&status.as_u16())
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
    fn te_trailers_is_told_apart() {
        let te = |values: &[&'static str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::TE, HeaderValue::from_static(v));
            }
            accepts_trailers(&h)
        };
        assert!(te(&["trailers"]) && te(&["gzip, Trailers"]) && te(&["deflate", "trailers"]));
        assert!(!te(&[]) && !te(&["gzip"]) && !te(&["trailersx"]));
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
    fn the_authority_is_said_once_without_userinfo() {
        let admitted = |uri: &str, hosts: &[&'static str]| {
            let mut req = Request::builder().method("POST").uri(uri);
            for h in hosts {
                req = req.header(header::HOST, *h);
            }
            admit(&req.body(()).unwrap()).map_err(|e| e.kind())
        };
        assert_eq!(admitted("/p", &["api.example"]), Ok(()));
        assert_eq!(admitted("http://api.example/p", &[]), Ok(()));
        assert_eq!(admitted("http://api.example/p", &["API.example"]), Ok(()));
        let refused = Err("invalid-authority");
        assert_eq!(
            admitted("http://api.example/p", &["other.example"]),
            refused
        );
        assert_eq!(
            admitted("http://api.example:8443/p", &["api.example"]),
            refused
        );
        assert_eq!(admitted("http://user:secret@api.example/p", &[]), refused);
        assert_eq!(admitted("/p", &["user:secret@api.example"]), refused);
        assert_eq!(admitted("/p", &["a.example", "a.example"]), refused);
    }

    #[test]
    fn only_200_to_599_end_an_exchange() {
        let fin = |s: u16| is_final_status(StatusCode::from_u16(s).unwrap());
        assert!(fin(200) && fin(204) && fin(304) && fin(599));
        assert!(!fin(100) && !fin(101) && !fin(103) && !fin(600) && !fin(999));
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
