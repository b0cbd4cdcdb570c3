//! One upstream, as one worker reaches it: a pool of hyper HTTP/1.1 keep-alive connections (or
//! one shared HTTP/2 connection), bounded by `max_connections`.
//!
//! An HTTP/1.1 request takes the most recently used idle connection (or opens one), and the
//! connection goes back when its response body has been read to the end. (hyper-util's general
//! client does the same for any host, at the cost of hashing the host for every checkout and
//! return and a task per request to watch for idleness.) An HTTP/2 upstream gets one connection
//! per worker, its streams multiplexed, opened again when it closes.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Scheme, Uri};
use http::{Request, Response};
use http_body::{Body as _, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::connect::{is_handshake_alert, ConnectError, Connector};
use super::metrics::{ProxyMetrics, UpstreamCounters, UpstreamResult};
use super::ProxyError;
use super::UpstreamConfig;
use crate::headers::{accepts_trailers, is_final_status, relayable};
use crate::idempotency::NotSent;

/// Most idle connections a worker keeps per upstream.
const MAX_IDLE: usize = 256;

/// How long a connection may sit idle before the pool drops it (under nginx's 75 s keep-alive
/// timeout). An upstream that closes idle connections sooner (Node.js and Apache: 5 s) is seen
/// by the connection's task, and a closed connection is never handed out; one the upstream
/// closes just as a request is written to it is the one case left (the request then fails as
/// possibly sent, as with any proxy).
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// An HTTP/1.1 connection and the permit it holds under `max_connections`.
struct H1 {
    sender: http1::SendRequest<Body>,
    _permit: OwnedSemaphorePermit,
}

/// An idle connection and when it went idle.
type Idle = (H1, Instant);

/// Idle HTTP/1.1 connections, the most recently used last.
#[derive(Clone, Default)]
struct Pool {
    idle: Arc<Mutex<VecDeque<Idle>>>,
    // Wakes a request waiting for a connection (all `max_connections` open) when one comes back.
    returned: Arc<tokio::sync::Notify>,
}

impl Pool {
    fn take(&self) -> Option<H1> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some((conn, since)) = idle.pop_back() {
            if since.elapsed() < IDLE_TIMEOUT {
                return Some(conn);
            }
            // The rest are older still: close them all.
            idle.clear();
        }
        None
    }

    fn put(&self, conn: H1) {
        if conn.sender.is_closed() {
            return;
        }
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        // Close the longest idle one when it has timed out (or to make room).
        if idle
            .front()
            .is_some_and(|(_, since)| now.duration_since(*since) >= IDLE_TIMEOUT)
            || idle.len() >= MAX_IDLE
        {
            idle.pop_front();
        }
        idle.push_back((conn, now));
        drop(idle);
        self.returned.notify_one();
    }
}

/// One upstream of one worker.
pub(crate) struct Upstream {
    name: Arc<str>,
    connector: Connector,
    // HTTP/1.1: idle connections, and permits for `max_connections` open ones.
    pool: Pool,
    permits: Arc<Semaphore>,
    // HTTP/2: the one shared connection, once open.
    h2: Option<tokio::sync::Mutex<Option<http2::SendRequest<Body>>>>,
    // `http` or `https`, and the upstream's authority, for HTTP/2's absolute URIs.
    scheme: Scheme,
    authority: http::uri::Authority,
    // Path prefix of the upstream URL without its trailing slash ("" for none).
    prefix: String,
    // The `Host` sent upstream, made once.
    host: HeaderValue,
    counters: UpstreamCounters,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("name", &self.name)
            .field("authority", &self.authority)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// A response body from the upstream. Read to its end, it gives its HTTP/1.1 connection back to
/// the pool.
pub(crate) struct UpstreamBody {
    inner: Incoming,
    back: Option<(H1, Pool)>,
}

impl UpstreamBody {
    /// Return the connection to the pool (once).
    fn give_back(&mut self) {
        if let Some((conn, pool)) = self.back.take() {
            pool.put(conn);
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

/// The target of a request to `uri` at an upstream whose path prefix is `prefix`, in origin
/// form (`/path?query`); an error when it would be longer than a URI may be.
fn origin_form(prefix: &str, uri: &Uri) -> Result<PathAndQuery, http::uri::InvalidUri> {
    let pq = uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    if prefix.is_empty() {
        return Ok(pq);
    }
    format!("{prefix}{}", pq.as_str()).parse()
}

/// What a connection failure means for the request: not sent, and whether TLS was at fault.
fn refused(name: &Arc<str>, e: ConnectError) -> ProxyError {
    let tls = matches!(e, ConnectError::Tls(_));
    ProxyError::not_sent(name.clone(), tls, e)
}

impl Upstream {
    /// The upstream `config`, counting into `metrics`.
    #[expect(
        clippy::expect_used,
        reason = "the config refuses an upstream URL without a host, and an authority's \
                  characters are all valid in a header value"
    )]
    pub(crate) fn new(config: &UpstreamConfig, metrics: &ProxyMetrics) -> Self {
        let authority = config
            .url
            .authority()
            .cloned()
            .expect("validated by config");
        Upstream {
            name: config.name.as_str().into(),
            connector: Connector::new(
                &authority,
                config.tls.clone(),
                config.connect_timeout,
                config.http2,
            ),
            pool: Pool::default(),
            // Past tokio's bound, as good as no bound.
            permits: Arc::new(Semaphore::new(
                config.max_connections.min(Semaphore::MAX_PERMITS),
            )),
            h2: config.http2.then(|| tokio::sync::Mutex::new(None)),
            scheme: if config.is_https() {
                Scheme::HTTPS
            } else {
                Scheme::HTTP
            },
            host: HeaderValue::from_str(authority.as_str())
                .expect("an authority is a valid header value"),
            authority,
            prefix: config.url.path().trim_end_matches('/').to_string(),
            counters: metrics.upstream(&config.name),
        }
    }

    /// The request could not be sent for `cause`, nothing of it having left.
    fn not_sent(&self, cause: impl Into<super::BoxError>) -> ProxyError {
        ProxyError::not_sent(self.name.clone(), false, cause)
    }

    /// The upstream's name, as logs and metrics give it.
    pub(crate) fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// Count what became of one request.
    pub(crate) fn count(&self, result: UpstreamResult) {
        self.counters.count(result);
    }

    /// Open a connection (TCP, and TLS for https), counted.
    async fn connect(&self) -> Result<super::connect::Stream, ProxyError> {
        let stream = self
            .connector
            .connect()
            .await
            .map_err(|e| refused(&self.name, e))?;
        self.counters.opened();
        Ok(stream)
    }

    /// Open a new HTTP/1.1 connection (holding a permit).
    async fn open_h1(&self, permit: OwnedSemaphorePermit) -> Result<H1, ProxyError> {
        let stream = self.connect().await?;
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ProxyError::not_sent(self.name.clone(), false, e))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(H1 {
            sender,
            _permit: permit,
        })
    }

    /// An idle pooled HTTP/1.1 connection, or a new one; whether it was pooled. Waits for a
    /// permit when `max_connections` are open.
    async fn h1(&self) -> Result<(H1, bool), ProxyError> {
        while let Some(mut conn) = self.pool.take() {
            if conn.sender.is_ready() {
                return Ok((conn, true));
            }
            // Its last response was read to the end but the connection has not yet said it
            // is idle again: that is a moment away, unless it closed.
            if !conn.sender.is_closed() && conn.sender.ready().await.is_ok() {
                return Ok((conn, true));
            }
        }
        let permit = match self.permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            // All open: wait for one to come back, or for a permit a closed one frees. The wait
            // is bounded by the route's upstream_timeout around the whole forward.
            Err(_) => loop {
                let returned = self.pool.returned.notified();
                tokio::pin!(returned);
                returned.as_mut().enable();
                if let Some(conn) = self.pool.take() {
                    if !conn.sender.is_closed() {
                        return Ok((conn, true));
                    }
                }
                tokio::select! {
                    permit = self.permits.clone().acquire_owned() => {
                        break permit.map_err(|e| self.not_sent(e))?;
                    }
                    () = returned => {}
                }
            },
        };
        Ok((self.open_h1(permit).await?, false))
    }

    /// The shared HTTP/2 connection, opened when there is none or it closed; whether it was
    /// already open.
    async fn h2(
        &self,
        slot: &tokio::sync::Mutex<Option<http2::SendRequest<Body>>>,
    ) -> Result<(http2::SendRequest<Body>, bool), ProxyError> {
        let mut shared = slot.lock().await;
        if let Some(sender) = shared.as_ref() {
            if !sender.is_closed() {
                return Ok((sender.clone(), true));
            }
        }
        let stream = self.connect().await?;
        let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .map_err(|e| ProxyError::not_sent(self.name.clone(), false, e))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        *shared = Some(sender.clone());
        Ok((sender, false))
    }

    /// Send a request. Hop-by-hop headers are stripped here, from the request and from the
    /// response, and a `Content-Length` beside `Transfer-Encoding` is dropped from both.
    /// A request waits for a connection (all `max_connections` busy) until `deadline` at most.
    pub(crate) async fn forward(
        &self,
        mut req: Request<Body>,
        deadline: tokio::time::Instant,
    ) -> Result<Response<UpstreamBody>, ProxyError> {
        let pq = origin_form(&self.prefix, req.uri()).map_err(|e| self.not_sent(e))?;
        // The client's authority: an HTTP/2 request's :authority (or an absolute-form target),
        // else its Host header; when both are there they agree (the listener admits no other).
        let client_host = match req.uri().authority() {
            Some(authority) => HeaderValue::from_str(authority.as_str()).ok(),
            None => req.headers().get(header::HOST).cloned(),
        };
        let trailers = accepts_trailers(req.headers());
        relayable(req.headers_mut());
        if let Some(host) = client_host {
            req.headers_mut()
                .insert(HeaderName::from_static("x-forwarded-host"), host);
        }
        match &self.h2 {
            None => {
                *req.uri_mut() = Uri::from(pq);
                // The upstream's own authority, as nginx's `proxy_set_header Host $proxy_host`.
                req.headers_mut().insert(header::HOST, self.host.clone());
                *req.version_mut() = http::Version::HTTP_11;
                self.send_h1(req, deadline).await
            }
            Some(slot) => {
                // HTTP/2 carries the authority in the URI (:authority), not in `Host`.
                *req.uri_mut() = Uri::builder()
                    .scheme(self.scheme.clone())
                    .authority(self.authority.clone())
                    .path_and_query(pq)
                    .build()
                    .map_err(|e| self.not_sent(e))?;
                req.headers_mut().remove(header::HOST);
                // Over HTTP/1.1 `TE` would ask for trailers of that one connection's chunked
                // coding, which nobody downstream needs from it; HTTP/2 (gRPC) needs it.
                if trailers {
                    req.headers_mut()
                        .insert(header::TE, HeaderValue::from_static("trailers"));
                }
                *req.version_mut() = http::Version::HTTP_2;
                self.send_h2(slot, req).await
            }
        }
    }

    async fn send_h1(
        &self,
        req: Request<Body>,
        deadline: tokio::time::Instant,
    ) -> Result<Response<UpstreamBody>, ProxyError> {
        let (mut conn, pooled) = match tokio::time::timeout_at(deadline, self.h1()).await {
            Ok(conn) => conn?,
            Err(_) => {
                return Err(ProxyError::Busy {
                    upstream: self.name.clone(),
                    cause: NotSent::new("no connection came free before the deadline"),
                })
            }
        };
        let resp = match conn.sender.try_send_request(req).await {
            Ok(resp) => resp,
            Err(mut e) => match e.take_message() {
                // The connection closed before it took the request (the upstream closed an idle
                // keep-alive connection): not sent, so it is safe to send on a fresh one.
                Some(req) if pooled => {
                    drop(conn);
                    let permit = self
                        .permits
                        .clone()
                        .acquire_owned()
                        .await
                        .map_err(|e| self.not_sent(e))?;
                    conn = self.open_h1(permit).await?;
                    match conn.sender.send_request(req).await {
                        Ok(resp) => resp,
                        Err(e) => return Err(self.failed(e, true)),
                    }
                }
                Some(_) => {
                    return Err(ProxyError::not_sent(
                        self.name.clone(),
                        false,
                        e.into_error(),
                    ))
                }
                None => return Err(self.failed(e.into_error(), !pooled)),
            },
        };
        // A connection that answered with no final response is not given back: it may have
        // switched protocols.
        self.final_answer(resp.status())?;
        let (mut head, body) = resp.into_parts();
        relayable(&mut head.headers);
        let mut body = UpstreamBody {
            inner: body,
            back: Some((conn, self.pool.clone())),
        };
        // A response without a body (204, 304, HEAD) is already complete.
        body.give_back_if_done();
        Ok(Response::from_parts(head, body))
    }

    async fn send_h2(
        &self,
        slot: &tokio::sync::Mutex<Option<http2::SendRequest<Body>>>,
        req: Request<Body>,
    ) -> Result<Response<UpstreamBody>, ProxyError> {
        let (mut sender, pooled) = self.h2(slot).await?;
        if sender.ready().await.is_err() {
            // Closed since: open it again (nothing was sent on it).
            *slot.lock().await = None;
            (sender, _) = self.h2(slot).await?;
        }
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| self.failed(e, !pooled))?;
        self.final_answer(resp.status())?;
        let (mut head, body) = resp.into_parts();
        relayable(&mut head.headers);
        Ok(Response::from_parts(
            head,
            UpstreamBody {
                inner: body,
                back: None,
            },
        ))
    }

    /// An answer with a status that ends no exchange is a broken one (the gateway forwards no
    /// `Upgrade`, so a `101` is never asked for).
    fn final_answer(&self, status: http::StatusCode) -> Result<(), ProxyError> {
        if is_final_status(status) {
            return Ok(());
        }
        Err(ProxyError::InvalidResponse {
            upstream: self.name.clone(),
            status: status.as_u16(),
        })
    }

    /// A request that failed after it may have been written: still "not sent" when a fresh
    /// connection's TLS handshake was refused by an alert (TLS 1.3 refuses a client certificate
    /// after the client finished its side of the handshake).
    fn failed(&self, e: hyper::Error, fresh: bool) -> ProxyError {
        if fresh && is_handshake_alert(&e) {
            ProxyError::not_sent(self.name.clone(), true, e)
        } else {
            ProxyError::Failed {
                upstream: self.name.clone(),
                cause: e.into(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_goes_under_the_prefix_within_a_uri_s_length() {
        let uri: Uri = "/v1/charges?x=1".parse().unwrap();
        assert_eq!(origin_form("", &uri).unwrap(), "/v1/charges?x=1");
        assert_eq!(origin_form("/api", &uri).unwrap(), "/api/v1/charges?x=1");
        // The longest path a client may send, which the prefix makes too long for a URI.
        let longest = format!("/{}", "a".repeat(usize::from(u16::MAX) - 2));
        let uri: Uri = longest.parse().unwrap();
        assert_eq!(origin_form("", &uri).unwrap().as_str(), longest);
        assert!(origin_form("/api", &uri).is_err());
    }
}
