//! The upstream client: pooled HTTP/1.1 keep-alive connections, hop-by-hop header handling.

use std::time::Duration;

use axum::body::Body;
use http::header::{self, HeaderMap, HeaderName};
use http::uri::{PathAndQuery, Uri};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Why a forward failed; the difference decides whether a claim may be released.
#[derive(Debug)]
pub enum ForwardError {
    /// No connection could be made: the request was certainly not sent.
    Connect(hyper_util::client::legacy::Error),
    /// Failed after the request may have been sent (reset, malformed response, ...).
    Other(hyper_util::client::legacy::Error),
}

impl std::fmt::Display for ForwardError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Connect(e) => write!(f, "cannot connect to upstream: {e:?}"),
            Self::Other(e) => write!(f, "upstream request failed: {e:?}"),
        }
    }
}

/// The one upstream all requests go to.
#[derive(Clone, Debug)]
pub struct Upstream {
    client: Client<HttpConnector, Body>,
    // `scheme://authority` of the upstream.
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    // Path prefix of the upstream URL without its trailing slash ("" for none).
    prefix: String,
    // The `Host` sent upstream, made once (the client would otherwise format it per request).
    host: http::HeaderValue,
}

impl Upstream {
    /// A pooled client for `base` (`http://host:port[/prefix]`).
    pub fn new(base: &Uri) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(256)
            .build(connector);
        Upstream {
            client,
            scheme: base.scheme().cloned().unwrap_or(http::uri::Scheme::HTTP),
            authority: base.authority().cloned().expect("validated by config"),
            prefix: base.path().trim_end_matches('/').to_string(),
            host: http::HeaderValue::from_str(base.authority().expect("validated").as_str())
                .expect("an authority is a valid header value"),
        }
    }

    /// Send a request (its head already stripped of hop-by-hop headers by the caller or here).
    pub async fn forward(
        &self,
        mut req: Request<Body>,
    ) -> Result<Response<Incoming>, ForwardError> {
        let mut parts = std::mem::take(req.uri_mut()).into_parts();
        let pq = parts
            .path_and_query
            .take()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        parts.path_and_query = Some(if self.prefix.is_empty() {
            // Already parsed and valid: moved, not parsed again.
            pq
        } else {
            format!("{}{}", self.prefix, pq.as_str())
                .parse()
                .expect("prefix + valid path")
        });
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        *req.uri_mut() = Uri::from_parts(parts).expect("valid parts");
        strip_hop_by_hop(req.headers_mut());
        // The upstream's own authority, as nginx's default `proxy_set_header Host $proxy_host`.
        if let Some(host) = req.headers_mut().insert(header::HOST, self.host.clone()) {
            req.headers_mut()
                .insert(HeaderName::from_static("x-forwarded-host"), host);
        }
        *req.version_mut() = http::Version::HTTP_11;
        self.client.request(req).await.map_err(|e| {
            if e.is_connect() {
                ForwardError::Connect(e)
            } else {
                ForwardError::Other(e)
            }
        })
    }
}

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
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none of them: one pass over the few names present is cheaper than a
    // hash lookup per hop-by-hop name (this runs twice per forwarded request).
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

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

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
}
