//! The client side: accepting connections up to `max_client_connections`, serving each with
//! HTTP/1.1 or HTTP/2 (h2c with prior knowledge, or ALPN over TLS) under its watchdog, and the
//! per-connection service that admits a request and adds the forwarding headers.
//!
//! - `watch.rs`: the watchdog of one connection (`client_header_timeout`,
//!   `client_idle_timeout`) and the socket and body wrappers that report to it.
//! - `rate.rs`: `client_min_body_rate`, the request body that arrives too slowly cut.
//! - `cap.rs`: `max_client_connections`, the cap shared by the workers.

mod cap;
mod metrics;
mod rate;
mod watch;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use axum::body::Body;
use futures_util::FutureExt;
use http::{HeaderName, HeaderValue, Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tower::{Service, ServiceExt};
use tracing::{debug, error, warn};

use self::metrics::{ClosedBy, ListenerMetrics};
use crate::error::GatewayError;
use crate::headers::admit;
use crate::idempotency::{grpc, LiveTable};
use crate::proxy::ProxyError;
pub(crate) use cap::ConnectionCap;
pub(crate) use rate::MinBodyRate;
use rate::{Cut, Paced};
pub(crate) use watch::Timeouts;
use watch::{ConnState, Expired, Serving, Watchdog, Watched, WatchedIo};

/// How long a client's TLS handshake may take at most (and never more than
/// `client_header_timeout`, which it counts towards).
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A client's IP address as a header value (`X-Forwarded-For`).
#[expect(
    clippy::expect_used,
    reason = "an IP address is written with digits, hex letters, dots and colons"
)]
fn ip_value(peer: SocketAddr) -> HeaderValue {
    HeaderValue::from_str(&peer.ip().to_string()).expect("an IP is a header value")
}

/// What every connection of one worker is served with.
pub(crate) struct Worker<S> {
    pub(crate) listener: TcpListener,
    pub(crate) stack: S,
    pub(crate) tls: Option<tokio_rustls::TlsAcceptor>,
    // The client timeouts in force, read for each new connection (a reload may change them).
    pub(crate) timeouts: Arc<arc_swap::ArcSwap<Timeouts>>,
    pub(crate) cap: Arc<ConnectionCap>,
    pub(crate) metrics: Arc<ListenerMetrics>,
    // The routes in force, for the shape of the refusals this listener gives itself.
    pub(crate) routes: LiveTable,
}

impl<S, RB> Worker<S>
where
    S: Service<Request<Body>, Response = Response<RB>, Error = ProxyError> + Clone + Send + 'static,
    S::Future: Send,
    RB: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    RB::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// Accept until `stop` turns true; then stop accepting and return the open connections,
    /// each told to finish (HTTP/2: GOAWAY), for the caller to wait on within its grace.
    pub(crate) async fn run(self, mut stop: tokio::sync::watch::Receiver<bool>) -> TaskTracker {
        let mut http = auto::Builder::new(TokioExecutor::new());
        // The watchdog bounds a request head's arrival, on both protocols.
        http.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(None)
            .keep_alive(true);
        http.http2().timer(TokioTimer::new());
        let http = Arc::new(http);
        let proto = HeaderValue::from_static(if self.tls.is_some() { "https" } else { "http" });
        let connections = TaskTracker::new();
        loop {
            let accepted = tokio::select! {
                accepted = self.accept() => accepted,
                _ = stop.wait_for(|stop| *stop) => break,
            };
            let (stream, peer, permit) = accepted;
            let timeouts = **self.timeouts.load();
            let gateway = Gateway {
                stack: self.stack.clone(),
                routes: self.routes.clone(),
                peer: ip_value(peer),
                proto: proto.clone(),
                conn: ConnState::new(),
                body_rate: timeouts.body_rate,
                metrics: self.metrics.clone(),
            };
            let connection = Connection {
                http: http.clone(),
                timeouts,
                metrics: self.metrics.clone(),
                stop: stop.clone(),
                peer,
            };
            let tls = self.tls.clone();
            connections.spawn(async move {
                let _permit = permit;
                match tls {
                    None => connection.serve(stream, gateway).await,
                    Some(acceptor) => connection.serve_tls(acceptor, stream, gateway).await,
                }
            });
        }
        drop(self.listener);
        connections.close();
        connections
    }

    /// The next connection, under the cap. Failures to accept (out of file descriptors and the
    /// like) back off instead of spinning.
    async fn accept(&self) -> (TcpStream, SocketAddr, OwnedSemaphorePermit) {
        loop {
            let permit = self.cap.permit().await;
            match self.listener.accept().await {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    return (stream, peer, permit);
                }
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    drop(permit);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// What hyper serves one connection with: the [`Gateway`] over the layer and the proxy.
trait ConnService:
    hyper::service::Service<
        Request<Incoming>,
        Response = Response<Watched<Body>>,
        Error = Infallible,
        Future: Send + 'static,
    > + Send
    + 'static
{
}

impl<T> ConnService for T where
    T: hyper::service::Service<
            Request<Incoming>,
            Response = Response<Watched<Body>>,
            Error = Infallible,
            Future: Send + 'static,
        > + Send
        + 'static
{
}

/// One client connection being served.
struct Connection {
    http: Arc<auto::Builder<TokioExecutor>>,
    timeouts: Timeouts,
    metrics: Arc<ListenerMetrics>,
    stop: tokio::sync::watch::Receiver<bool>,
    peer: SocketAddr,
}

impl Connection {
    async fn serve_tls<S>(
        self,
        acceptor: tokio_rustls::TlsAcceptor,
        stream: TcpStream,
        gateway: Gateway<S>,
    ) where
        Gateway<S>: ConnService,
    {
        let limit = TLS_HANDSHAKE_TIMEOUT.min(self.timeouts.header);
        let peer = self.peer;
        match tokio::time::timeout(limit, acceptor.accept(stream)).await {
            Ok(Ok(stream)) => self.serve(stream, gateway).await,
            Ok(Err(e)) => debug!(%peer, error = %e, "TLS handshake with a client failed"),
            Err(_) => {
                debug!(%peer, "TLS handshake with a client timed out");
                self.metrics.closed(ClosedBy::header_timeout);
            }
        }
    }

    /// Serve requests until the client closes, a timeout ends the connection, or the worker
    /// stops (then open requests finish first).
    async fn serve<T, S>(mut self, stream: T, gateway: Gateway<S>)
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        Gateway<S>: ConnService,
    {
        let open = self.metrics.open.clone();
        open.inc();
        let state = gateway.conn.clone();
        let mut watchdog = Watchdog::new(state.clone(), self.timeouts);
        let io = TokioIo::new(WatchedIo::new(stream, gateway.conn.clone()));
        let conn = self.http.serve_connection(io, gateway);
        tokio::pin!(conn);
        // Once a graceful close has begun (shutdown, or idle), the connection finishes what is
        // in progress; an idle one gets `client_header_timeout` for its GOAWAY exchange.
        let mut closing = false;
        let goaway = tokio::time::sleep(Duration::MAX);
        tokio::pin!(goaway);
        let mut idle_closing = false;
        loop {
            tokio::select! {
                // The connection first: the watchdog then sees what its poll changed.
                biased;
                _ = Serving::new(&state, conn.as_mut()) => break,
                expired = &mut watchdog, if !idle_closing => {
                    let reason = match expired {
                        Expired::Header => ClosedBy::header_timeout,
                        Expired::Idle => ClosedBy::idle_timeout,
                        Expired::Stalled => ClosedBy::stalled,
                    };
                    debug!(peer = %self.peer, ?reason, "closing a client connection");
                    self.metrics.closed(reason);
                    if expired != Expired::Idle || closing {
                        break;
                    }
                    // Idle: HTTP/2 says GOAWAY first; HTTP/1.1 just closes.
                    conn.as_mut().graceful_shutdown();
                    (closing, idle_closing) = (true, true);
                    goaway.as_mut().reset(Instant::now() + self.timeouts.header);
                }
                () = &mut goaway, if idle_closing => break,
                _ = self.stop.wait_for(|stop| *stop), if !closing => {
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
        open.dec();
    }
}

/// The gateway's service stack as hyper calls it, for one client connection: requests the
/// gateway does not admit are answered at once; the rest get the forwarding headers and go
/// through the idempotency layer to the proxy, and a proxy error becomes its problem+json answer.
#[derive(Clone)]
struct Gateway<S> {
    stack: S,
    // Each route's `error_format`, for the answers given here rather than by the engine.
    routes: LiveTable,
    // The client's address, as `X-Forwarded-For` appends it.
    peer: HeaderValue,
    // The listener's scheme, as `X-Forwarded-Proto` says it.
    proto: HeaderValue,
    // What the connection's watchdog reads.
    conn: Arc<ConnState>,
    // `client_min_body_rate`, which request bodies are held to.
    body_rate: Option<MinBodyRate>,
    metrics: Arc<ListenerMetrics>,
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

impl<S> Gateway<S> {
    /// Append the client's address to `X-Forwarded-For` (whatever an outer proxy put there
    /// stays, before it: the rightmost entry is the one this gateway saw), and say the
    /// listener's scheme in `X-Forwarded-Proto`.
    fn forwarding_headers(&self, headers: &mut http::HeaderMap) {
        let earlier: Vec<&[u8]> = headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        let value = if earlier.is_empty() {
            self.peer.clone()
        } else {
            let mut joined = earlier.join(&b", "[..]);
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(self.peer.as_bytes());
            HeaderValue::from_bytes(&joined).unwrap_or_else(|_| self.peer.clone())
        };
        headers.insert(X_FORWARDED_FOR, value);
        headers.insert(X_FORWARDED_PROTO, self.proto.clone());
    }
}

impl<S, RB> hyper::service::Service<Request<Incoming>> for Gateway<S>
where
    S: Service<Request<Body>, Response = Response<RB>, Error = ProxyError> + Clone + Send + 'static,
    S::Future: Send,
    RB: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    RB::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = Response<Watched<Body>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let in_progress = self.conn.request_started();
        let call = grpc::is_call(req.version(), req.headers());
        if let Err(refused) = admit(&req) {
            let format = self.routes.policy_for(req.uri().path()).error_format;
            let resp = refused.respond(grpc::error_format(call, format));
            return Box::pin(std::future::ready(Ok(
                resp.map(|b| in_progress.response_body(b))
            )));
        }
        // A gRPC call may stream its messages as slowly as it likes (the idle timeout still
        // holds it); an empty body has no rate.
        let paced = (self.body_rate)
            .filter(|_| !call && !http_body::Body::is_end_stream(req.body()))
            .map(|rate| (rate, Arc::new(Cut::default())));
        let mut req = req.map(|body| {
            let body = self.conn.request_body(body);
            match &paced {
                Some((rate, cut)) => Body::new(Paced::new(body, *rate, cut.clone())),
                None => Body::new(body),
            }
        });
        self.forwarding_headers(req.headers_mut());
        let stack = self.stack.clone();
        let (routes, uri, version) = (self.routes.clone(), req.uri().clone(), req.version());
        let metrics = self.metrics.clone();
        Box::pin(async move {
            // A defect answers this request with a 500 in the route's format (which tower-http's
            // CatchPanic cannot choose) rather than closing the connection with no answer.
            let called = std::panic::AssertUnwindSafe(stack.oneshot(req)).catch_unwind();
            let format = || grpc::error_format(call, routes.policy_for(uri.path()).error_format);
            let resp = match paced {
                None => Some(called.await),
                Some((_, ref cut)) => {
                    let mut called = std::pin::pin!(called);
                    std::future::poll_fn(|cx| {
                        if cut.poll_cut(cx).is_ready() {
                            return Poll::Ready(None);
                        }
                        // A body cut while the stack turned its failure into an answer: the cut.
                        let resp = std::task::ready!(called.as_mut().poll(cx));
                        Poll::Ready(Some(resp).filter(|_| !cut.is_cut()))
                    })
                    .await
                }
            };
            let resp = match (resp, paced) {
                (Some(Ok(Ok(resp))), _) => resp.map(Body::new),
                (Some(Ok(Err(e))), _) => GatewayError::from(&e).respond(format()),
                (Some(Err(panic)), _) => {
                    let panic = crate::error::panic_message(&*panic);
                    error!(%panic, path = uri.path(), "the gateway failed while handling a request; answered 500");
                    GatewayError::Internal.respond(format())
                }
                (None, rate) => {
                    metrics.body_too_slow();
                    let rate = rate.map_or(0, |(r, _)| r.bytes_per_second.get());
                    too_slow(GatewayError::BodyTooSlow(rate).respond(format()), version)
                }
            };
            Ok(resp.map(|b| in_progress.response_body(b)))
        })
    }
}

/// The answer to a request whose body was cut for its rate: over HTTP/1.1 the connection closes
/// after it (the rest of the body will not be read); over HTTP/2 only the stream ends.
fn too_slow(mut resp: Response<Body>, version: http::Version) -> Response<Body> {
    if version < http::Version::HTTP_2 {
        resp.headers_mut()
            .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}
