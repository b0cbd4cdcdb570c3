//! The proxy: the gateway's inner service, forwarding each request to the upstream over pooled
//! HTTP/1.1 keep-alive connections.
//!
//! [`Proxy`] is a tower `Service`; the idempotency layer wraps it like any other service. Its
//! errors say whether the request was sent ([`ProxyError`]; a connection that could not be made
//! carries [`NotSent`], which the layer reads to release a claim).
//!
//! Each worker has a pool of its own: a stack of idle hyper HTTP/1.1 connections to the one
//! upstream. A request takes the most recently used idle connection (or opens one), and the
//! connection goes back when its response body has been read to the end. (hyper-util's general
//! client does the same for any host, at the cost of hashing the host for every checkout and
//! return and a task per request to watch for idleness.)

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderName};
use http::uri::{PathAndQuery, Uri};
use http::{Request, Response};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use crate::config::Policy;
use crate::error::GatewayError;
use crate::headers::{content_length, relayable};
use crate::idempotency::NotSent;

/// A boxed error, for messages.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a forward failed. What the difference means for a claim is read by the idempotency layer
/// from the error's `source()` chain: only [`NotSent`] lets it release the key.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// No connection could be made, or the connection closed before it took the request: the
    /// request was certainly not sent.
    #[error("cannot reach the upstream")]
    NotSent(#[source] NotSent),
    /// Failed after the request may have been sent (reset, malformed response, ...).
    #[error("upstream request failed: {0}")]
    Failed(#[source] BoxError),
    /// No response head within the route's `upstream_timeout`.
    #[error("the upstream did not answer in time")]
    Timeout,
}

impl From<&ProxyError> for GatewayError {
    fn from(e: &ProxyError) -> Self {
        match e {
            ProxyError::NotSent(_) | ProxyError::Failed(_) => GatewayError::Upstream,
            ProxyError::Timeout => GatewayError::UpstreamTimeout,
        }
    }
}

fn not_sent(cause: impl Into<BoxError>) -> ProxyError {
    ProxyError::NotSent(NotSent::new(cause))
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
pub(crate) struct Upstream {
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
pub(crate) struct UpstreamBody {
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
    pub(crate) fn new(base: &Uri) -> Self {
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
    async fn connect(&self) -> Result<SendRequest<Body>, ProxyError> {
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
            Ok(Err(e)) => return Err(not_sent(e)),
            Err(_) => return Err(not_sent("connect timed out")),
        };
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(not_sent)?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// An idle pooled connection, or a new one; whether it was pooled.
    async fn sender(&self) -> Result<(SendRequest<Body>, bool), ProxyError> {
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
    /// response, and a `Content-Length` beside `Transfer-Encoding` is dropped from both.
    pub(crate) async fn forward(
        &self,
        mut req: Request<Body>,
    ) -> Result<Response<UpstreamBody>, ProxyError> {
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
                        .map_err(|e| ProxyError::Failed(e.into()))?
                }
                Some(_) => return Err(not_sent(e.into_error())),
                None => return Err(ProxyError::Failed(e.into_error().into())),
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

/// Responses up to this size with a known length are read whole and sent in one write, as
/// nginx's proxy buffering does; anything else streams through.
const SEND_WHOLE_UP_TO: u64 = 16 * 1024;

/// The upstream as a tower `Service`: the inner service of the gateway's idempotency layer.
/// Cheap to clone (clones share the pool). Each request's response head must arrive within the
/// `upstream_timeout` of the [`Policy`] the layer hands down as a request extension (the
/// built-in default when there is none).
#[derive(Clone, Debug)]
pub struct Proxy {
    // Behind one reference count: the proxy is cloned for every request.
    upstream: Arc<Upstream>,
}

impl Proxy {
    /// A proxy to `base` (`http://host:port[/prefix]`) with a connection pool of its own.
    pub fn new(base: &Uri) -> Self {
        Proxy {
            upstream: Arc::new(Upstream::new(base)),
        }
    }

    async fn call(self, req: Request<Body>) -> Result<Response<Body>, ProxyError> {
        let timeout = req
            .extensions()
            .get::<Arc<Policy>>()
            .map_or(Policy::DEFAULT_UPSTREAM_TIMEOUT, |p| p.upstream_timeout);
        let resp = tokio::time::timeout(timeout, self.upstream.forward(req))
            .await
            .map_err(|_| ProxyError::Timeout)??;
        let (head, body) = resp.into_parts();
        if content_length(&head.headers).is_some_and(|n| n <= SEND_WHOLE_UP_TO) {
            let whole = body
                .collect()
                .await
                .map_err(|e| ProxyError::Failed(e.into()))?;
            return Ok(Response::from_parts(head, Body::from(whole.to_bytes())));
        }
        Ok(Response::from_parts(head, Body::new(body)))
    }
}

impl tower::Service<Request<Body>> for Proxy {
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, ProxyError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        Box::pin(self.clone().call(req))
    }
}
