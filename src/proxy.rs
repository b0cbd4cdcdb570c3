//! The upstream client: pooled HTTP/1.1 keep-alive connections, hop-by-hop header handling.
//!
//! Each worker has a pool of its own: a stack of idle hyper HTTP/1.1 connections to the one
//! upstream. A request takes the most recently used idle connection (or opens one), and the
//! connection goes back when its response body has been read to the end. (hyper-util's general
//! client did the same for any host, at the cost of hashing the host for every checkout and
//! return and a task per request to watch for idleness: about a fifth of the gateway's own
//! instructions per forwarded request, counted with callgrind.)

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName};
use http::uri::{PathAndQuery, Uri};
use http::{Request, Response};
use http_body::{Body as _, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use crate::error::GatewayError;

/// A boxed error, for messages.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a forward failed; the difference decides whether a claim may be released.
#[derive(Debug)]
pub enum ForwardError {
    /// No connection could be made, or the connection closed before it took the request: the
    /// request was certainly not sent.
    Connect(BoxError),
    /// Failed after the request may have been sent (reset, malformed response, ...).
    Other(BoxError),
}

impl std::fmt::Display for ForwardError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Connect(e) => write!(f, "cannot connect to upstream: {e}"),
            Self::Other(e) => write!(f, "upstream request failed: {e}"),
        }
    }
}

/// Most idle connections a worker keeps.
const MAX_IDLE: usize = 256;

/// How long a connection may sit idle before the pool drops it (under nginx's 75 s keep-alive
/// timeout). An upstream that closes idle connections sooner (Node.js and Apache: 5 s) is seen
/// by the connection's task, and a closed connection is never handed out; one the upstream
/// closes just as a request is written to it is the one case left (the request then fails as
/// possibly sent, as with any proxy).
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long opening a connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// An idle connection and when it went idle.
type Idle = (SendRequest<Body>, Instant);

/// Idle connections of one worker, the most recently used last.
#[derive(Clone, Default)]
struct Pool {
    idle: Arc<Mutex<VecDeque<Idle>>>,
}

impl Pool {
    fn take(&self) -> Option<SendRequest<Body>> {
        let mut idle = self.idle.lock().expect("pool lock");
        while let Some((sender, since)) = idle.pop_back() {
            if since.elapsed() < IDLE_TIMEOUT {
                return Some(sender);
            }
            // The rest are older still: close them all.
            idle.clear();
        }
        None
    }

    fn put(&self, sender: SendRequest<Body>) {
        if sender.is_closed() {
            return;
        }
        let now = Instant::now();
        let mut idle = self.idle.lock().expect("pool lock");
        // Close the longest idle one when it has timed out (or to make room).
        if idle
            .front()
            .is_some_and(|(_, since)| now.duration_since(*since) >= IDLE_TIMEOUT)
            || idle.len() >= MAX_IDLE
        {
            idle.pop_front();
        }
        idle.push_back((sender, now));
    }
}

/// The one upstream all requests go to.
#[derive(Clone)]
pub struct Upstream {
    pool: Pool,
    // `host:port` to connect to.
    authority: http::uri::Authority,
    // Path prefix of the upstream URL without its trailing slash ("" for none).
    prefix: String,
    // The `Host` sent upstream, made once.
    host: http::HeaderValue,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("authority", &self.authority)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// A response body from the upstream. Read to its end, it gives its connection back to the pool.
pub struct UpstreamBody {
    inner: Incoming,
    back: Option<(SendRequest<Body>, Pool)>,
}

impl UpstreamBody {
    /// Return the connection to the pool (once).
    fn give_back(&mut self) {
        if let Some((sender, pool)) = self.back.take() {
            pool.put(sender);
        }
    }

    fn give_back_if_done(&mut self) {
        if self.inner.is_end_stream() {
            self.give_back();
        }
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &frame {
            None => self.give_back(),
            Some(Ok(_)) => self.give_back_if_done(),
            // A failed body leaves the connection unusable: it is dropped with the sender.
            Some(Err(_)) => self.back = None,
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // A consumer that stops at the declared length never polls for the end: the body is
        // complete all the same. An unfinished body drops the connection with it.
        self.give_back_if_done();
    }
}

impl Upstream {
    /// A pool for `base` (`http://host:port[/prefix]`).
    pub fn new(base: &Uri) -> Self {
        let authority = base.authority().cloned().expect("validated by config");
        Upstream {
            pool: Pool::default(),
            host: http::HeaderValue::from_str(authority.as_str())
                .expect("an authority is a valid header value"),
            authority,
            prefix: base.path().trim_end_matches('/').to_string(),
        }
    }

    /// Open a new connection.
    async fn connect(&self) -> Result<SendRequest<Body>, ForwardError> {
        let port = self.authority.port_u16().unwrap_or(80);
        // An IPv6 literal comes bracketed in a URL (`[::1]`), and bare to the resolver.
        let host = self
            .authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let connect = tokio::net::TcpStream::connect((host, port));
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return Err(ForwardError::Connect(e.into())),
            Err(_) => return Err(ForwardError::Connect("connect timed out".into())),
        };
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ForwardError::Connect(e.into()))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// An idle pooled connection, or a new one; whether it was pooled.
    async fn sender(&self) -> Result<(SendRequest<Body>, bool), ForwardError> {
        while let Some(mut sender) = self.pool.take() {
            if sender.is_ready() {
                return Ok((sender, true));
            }
            // Its last response was read to the end but the connection has not yet said it
            // is idle again: that is a moment away, unless it closed.
            if !sender.is_closed() && sender.ready().await.is_ok() {
                return Ok((sender, true));
            }
        }
        Ok((self.connect().await?, false))
    }

    /// Send a request. Hop-by-hop headers are stripped here, from the request and from the
    /// response, and the response's head is made safe to relay (see [`relayable`]).
    pub async fn forward(
        &self,
        mut req: Request<Body>,
    ) -> Result<Response<UpstreamBody>, ForwardError> {
        // Origin form (`/path?query`), under the upstream's path prefix.
        let pq = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        *req.uri_mut() = if self.prefix.is_empty() {
            Uri::from(pq)
        } else {
            format!("{}{}", self.prefix, pq.as_str())
                .parse()
                .expect("prefix + valid path")
        };
        relayable(req.headers_mut());
        // The upstream's own authority, as nginx's default `proxy_set_header Host $proxy_host`.
        if let Some(host) = req.headers_mut().insert(header::HOST, self.host.clone()) {
            req.headers_mut()
                .insert(HeaderName::from_static("x-forwarded-host"), host);
        }
        *req.version_mut() = http::Version::HTTP_11;

        let (mut sender, pooled) = self.sender().await?;
        let resp = match sender.try_send_request(req).await {
            Ok(resp) => resp,
            Err(mut e) => match e.take_message() {
                // The connection closed before it took the request (the upstream closed an idle
                // keep-alive connection): not sent, so it is safe to send on a fresh one.
                Some(req) if pooled => {
                    sender = self.connect().await?;
                    sender
                        .send_request(req)
                        .await
                        .map_err(|e| ForwardError::Other(e.into()))?
                }
                Some(_) => return Err(ForwardError::Connect(e.into_error().into())),
                None => return Err(ForwardError::Other(e.into_error().into())),
            },
        };
        let (mut head, body) = resp.into_parts();
        relayable(&mut head.headers);
        let mut body = UpstreamBody {
            inner: body,
            back: Some((sender, self.pool.clone())),
        };
        // A response without a body (204, 304, HEAD) is already complete.
        body.give_back_if_done();
        Ok(Response::from_parts(head, body))
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

/// Make a message's head safe to pass on: with `Transfer-Encoding` the length came from the
/// chunked framing hyper decoded, so a `Content-Length` beside it is stale (RFC 9112 section 6.3)
/// and goes, before the hop-by-hop headers do. The next hop frames the body anew.
pub fn relayable(headers: &mut HeaderMap) {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
    }
    strip_hop_by_hop(headers);
}

/// Refuse a request whose transfer codings the gateway would not relay faithfully (RFC 9112
/// section 6.1): `chunked` applied more than once is invalid (400), and any other coding is one
/// the gateway does not decode (501), so forwarding it would drop its label.
pub fn check_transfer_coding(headers: &HeaderMap) -> Result<(), GatewayError> {
    let mut chunked = 0;
    for value in headers.get_all(header::TRANSFER_ENCODING) {
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
    fn only_one_chunked_coding_is_accepted() {
        let te = |values: &[&'static str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::TRANSFER_ENCODING, HeaderValue::from_static(v));
            }
            check_transfer_coding(&h).map_err(|e| e.kind())
        };
        assert_eq!(te(&[]), Ok(()));
        assert_eq!(te(&["chunked"]), Ok(()));
        assert_eq!(te(&["Chunked "]), Ok(()));
        assert_eq!(te(&["chunked, chunked"]), Err("invalid-framing"));
        assert_eq!(te(&["chunked", "chunked"]), Err("invalid-framing"));
        assert_eq!(te(&["gzip, chunked"]), Err("unsupported-transfer-coding"));
        assert_eq!(te(&["identity"]), Err("unsupported-transfer-coding"));
    }
}
