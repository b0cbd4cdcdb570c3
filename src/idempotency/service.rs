//! The tower service that runs the state machine of one request. Read `Inner::keyed` and
//! `Inner::run_claimed` top to bottom: they are the whole protocol.
//!
//! ```text
//!  keyed request ─► buffer body (413) ─► fingerprint ─► claim ─┬─ store down ─► on_store_error: 503 | forward unprotected
//!                                                   ▲          ├─ other fingerprint ─► mismatch (409/422)
//!                                                   │          ├─ in flight ─► on_in_flight: 409 in flight
//!                                                   └─ waiting ◄┘                 | wait (bounded) and claim again
//!                                                              ├─ not replayable ─► 409 not replayable
//!                                                              ├─ completed ─► replay
//!                                                              └─ claimed ─► run_claimed (spawned: survives client aborts)
//!  run_claimed: forward while renewing the lease ─┬─ not sent (connect error) ─► release, 502
//!                                                 ├─ timeout / failed after send ─► keep claim until the lease ends, 504/502
//!                                                 ├─ 5xx, 408, 429 ─► release, pass the response on
//!                                                 ├─ body ≤ max_body ─► complete (replayable), respond
//!                                                 └─ body > max_body ─► complete (not replayable), stream once
//!  complete, release and renew are fenced by the claim's token: a holder whose lease ran out
//!  changes nothing.
//! ```

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::header::{self, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, BodyStream, Limited};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::{debug, debug_span, error, field, warn, Instrument, Span};

use super::fingerprint::Fingerprint;
use super::key::{IdempotencyKey, ScopedKey};
use super::record::{Entry, EntryState, StoredResponse, Token};
use crate::config::{Config, OnInFlight, OnStoreError, Policy};
use crate::error::GatewayError;
use crate::metrics::{Metrics, Outcome, RouteMetrics, StoreOp};
use crate::proxy::{check_transfer_coding, ForwardError, Upstream, UpstreamBody};
use crate::store::{Claim, Store, StoreError};
use prometheus_client::metrics::histogram::Histogram;

/// The W3C trace context header, forwarded to the upstream and stored with the record.
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The header that marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Pass-through responses up to this size with a known length are buffered and sent whole.
const PASS_THROUGH_BUFFER: u64 = 16 * 1024;

/// How long a duplicate of an in-flight request is told to wait (`Retry-After`).
const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The gateway as a tower service: cheap to clone, all clones share one state.
pub struct Gateway<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for Gateway<S> {
    fn clone(&self) -> Self {
        Gateway {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<S> {
    // Where records live.
    store: S,
    // The pooled client to the one upstream.
    upstream: Upstream,
    // Which policy a path gets; shared by every worker so route state is process-wide.
    routes: RouteTable,
    // Every spawned upstream call, so that shutdown can wait for them to be recorded.
    tasks: TaskTracker,
    // The process's metrics, and the store-operation histograms resolved once.
    metrics: Metrics,
    store_ops: [Histogram; 4],
}

/// The routes of a config with their live state: cheap to clone, clones share the state.
#[derive(Clone)]
pub struct RouteTable {
    // Route patterns to their resolved policies; the most specific pattern wins (matchit).
    routes: Arc<matchit::Router<Arc<RouteState>>>,
    // The policy of requests that match no route.
    defaults: Arc<RouteState>,
    // Where the gateways built on this table count.
    metrics: Metrics,
}

impl RouteTable {
    /// The table of `config`'s routes, counting into `metrics`.
    pub fn new(config: &Config, metrics: &Metrics) -> Self {
        let mut routes = matchit::Router::new();
        for r in &config.routes {
            routes
                .insert(r.path.clone(), RouteState::new(&r.policy, metrics))
                .expect("route paths were validated by Config");
        }
        RouteTable {
            routes: Arc::new(routes),
            defaults: RouteState::new(&config.defaults, metrics),
            metrics: metrics.clone(),
        }
    }

    /// The policy requests to `path` get.
    pub fn policy_for(&self, path: &str) -> &Policy {
        &self.route_for(path).policy
    }

    fn route_for(&self, path: &str) -> &Arc<RouteState> {
        self.routes
            .at(path)
            .map(|m| m.value)
            .unwrap_or(&self.defaults)
    }
}

/// A route's policy and its live state.
struct RouteState {
    policy: Arc<Policy>,
    // Its outcome counters, resolved once.
    metrics: RouteMetrics,
    // Bounds the duplicates waiting at once under `on_in_flight = "wait"`.
    waiters: Arc<Semaphore>,
}

impl RouteState {
    fn new(policy: &Arc<Policy>, metrics: &Metrics) -> Arc<Self> {
        Arc::new(RouteState {
            policy: policy.clone(),
            metrics: metrics.route(&policy.route),
            waiters: Arc::new(Semaphore::new(policy.max_waiters)),
        })
    }
}

impl<S: Store> Gateway<S> {
    /// Build the gateway for a validated config over `store`, with metrics of its own.
    pub fn new(config: &Config, store: S) -> Self {
        Self::with_routes(RouteTable::new(config, &Metrics::new()), config, store)
    }

    /// Build a gateway that shares `routes` (and so their waiter bounds) with other gateways:
    /// one per worker thread, each with its own store handle, upstream pool and task tracker.
    pub fn with_routes(routes: RouteTable, config: &Config, store: S) -> Self {
        let metrics = routes.metrics.clone();
        Gateway {
            inner: Arc::new(Inner {
                store,
                upstream: Upstream::new(&config.upstream),
                routes,
                tasks: TaskTracker::new(),
                store_ops: [
                    StoreOp::claim,
                    StoreOp::complete,
                    StoreOp::release,
                    StoreOp::renew,
                ]
                .map(|op| metrics.store_op(op)),
                metrics,
            }),
        }
    }

    /// The tracker of spawned upstream calls: close it and wait on it to let them finish.
    pub fn tasks(&self) -> TaskTracker {
        self.inner.tasks.clone()
    }
}

impl<S: Store> tower::Service<Request<Body>> for Gateway<S> {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move { Ok(inner.handle(req).await) })
    }
}

/// The same service as hyper calls it, straight on the connection's requests: without tower's
/// adapter (its `Oneshot` and `MapRequest` wrappers around every request's future).
impl<S: Store> hyper::service::Service<Request<hyper::body::Incoming>> for Gateway<S> {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, req: Request<hyper::body::Incoming>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move { Ok(inner.handle(req.map(Body::new)).await) })
    }
}

/// What came back from the upstream for a claimed request.
enum UpstreamResult {
    /// Nothing was sent (connection refused): safe to run again.
    NotSent,
    /// The request may have reached the upstream, but no usable response came back.
    Failed,
    /// A response that must not be stored (5xx, 408, 429): passed on, key released.
    Transient(http::response::Parts, UpstreamBody),
    /// A storable response whose whole body fits in `max_body`.
    Whole(http::response::Parts, Bytes),
    /// A storable response larger than `max_body`: the chunks read so far and the rest.
    TooLarge(http::response::Parts, Vec<Bytes>, UpstreamBody),
}

impl<S: Store> Inner<S> {
    async fn handle(self: Arc<Self>, req: Request<Body>) -> Response<Body> {
        let started = Instant::now();
        let route = self.routes.route_for(req.uri().path()).clone();
        let (outcome, resp, upstream) = self.clone().dispatch(&route, req).await;
        route.metrics.count(outcome);
        self.metrics
            .overhead(started.elapsed().saturating_sub(upstream));
        resp
    }

    /// Pass through, refuse, or run the keyed state machine; with the outcome and the time spent
    /// waiting for the upstream.
    async fn dispatch(
        self: Arc<Self>,
        route: &Arc<RouteState>,
        req: Request<Body>,
    ) -> (Outcome, Response<Body>, Duration) {
        let policy = &route.policy;
        if req.method() == Method::CONNECT {
            return refuse(GatewayError::UnsupportedMethod(Method::CONNECT));
        }
        if let Err(e) = check_transfer_coding(req.headers()) {
            return refuse(e);
        }
        if !policy.applies_to(req.method()) {
            let (resp, upstream) = self.pass_through(req, policy).await;
            return (Outcome::passthrough, resp, upstream);
        }
        let key = match IdempotencyKey::from_headers(req.headers(), policy.key_max_len) {
            Ok(Some(key)) => key,
            Ok(None) if policy.require_key => return refuse(GatewayError::MissingKey),
            Ok(None) => {
                let (resp, upstream) = self.pass_through(req, policy).await;
                return (Outcome::passthrough, resp, upstream);
            }
            Err(e) => return refuse(e),
        };
        // At debug level: at the default `info` the span and its formatted fields would cost about a
        // fifth of the replay path (measured with loadtest; see the README, "Tracing and logs").
        let span = debug_span!(
            "idempotent_request",
            method = %req.method(),
            route = %policy.route,
            key = %key.short_hash(),
            outcome = field::Empty,
            original_trace = field::Empty,
        );
        let (outcome, result, upstream) = self
            .keyed(route.clone(), key, req)
            .instrument(span.clone())
            .await;
        span.record("outcome", outcome.as_str());
        let resp = match result {
            Ok(resp) => {
                debug!(parent: &span, status = resp.status().as_u16(), "done");
                resp
            }
            Err(e) => {
                debug!(parent: &span, status = e.status().as_u16(), problem = e.kind(), "refused");
                e.into_response()
            }
        };
        (outcome, resp, upstream)
    }

    /// The state machine of a keyed request, up to the claim.
    async fn keyed(
        self: Arc<Self>,
        route: Arc<RouteState>,
        key: IdempotencyKey,
        req: Request<Body>,
    ) -> (Outcome, Result<Response<Body>, GatewayError>, Duration) {
        const NO_UPSTREAM: Duration = Duration::ZERO;
        let policy = route.policy.clone();
        let (parts, body) = req.into_parts();
        let body = match buffer_request(&parts, body, policy.max_body).await {
            Ok(body) => body,
            Err(e) => return (Outcome::rejected_invalid, Err(e), NO_UPSTREAM),
        };
        let held = Arc::new(Held {
            key: key.scoped(&parts.headers, &policy.scope_headers),
            token: Token::random(),
            fingerprint: Fingerprint::of(&parts, &body),
            route: policy.clone(),
            client_key: key,
        });
        // Set once this request starts waiting for an in-flight duplicate (`on_in_flight = "wait"`).
        let mut waiting: Option<Waiting> = None;

        loop {
            // From here until the store's answer is in hand, the claim may be applied without
            // this request knowing: if the request goes away (the client hung up) or the answer
            // is lost (a timeout), the guard takes the claim back so that it does not sit in
            // flight for a lease with nobody working on it.
            let pending = PendingClaim::arm(&self, &held);
            let claim = self
                .timed(
                    StoreOp::claim,
                    self.store
                        .claim(&held.key, &held.fingerprint, &held.token, policy.lock_ttl),
                )
                .await;
            let claim = match claim {
                Ok(claim) => {
                    pending.disarm();
                    claim
                }
                Err(StoreError::Decode(e)) => {
                    // The store answered, with a record this build cannot read: never run again.
                    pending.disarm();
                    error!(error = %e, route = %policy.route, key = %held.tag(), "stored record cannot be decoded; refused (evict the key through the admin API to let it run again)");
                    return (
                        Outcome::store_error,
                        Err(GatewayError::CorruptRecord),
                        NO_UPSTREAM,
                    );
                }
                Err(e) => {
                    drop(pending);
                    let tag = held.tag();
                    match policy.on_store_error {
                        OnStoreError::Reject => {
                            error!(error = %e, route = %policy.route, key = %tag, "store unavailable; refusing the keyed request (on_store_error = reject)");
                            return (
                                Outcome::store_error,
                                Err(GatewayError::StoreUnavailable),
                                NO_UPSTREAM,
                            );
                        }
                        OnStoreError::Pass => {
                            warn!(error = %e, route = %policy.route, key = %tag, "store unavailable; forwarding WITHOUT idempotency (on_store_error = pass)");
                            self.metrics.store_error_passed();
                            let req = Request::from_parts(parts, Body::from(body));
                            let (resp, upstream) = self.pass_through(req, &policy).await;
                            return (Outcome::store_error, Ok(resp), upstream);
                        }
                    }
                }
            };
            match claim {
                Claim::Existing(Entry {
                    fingerprint: other, ..
                }) if other != held.fingerprint => {
                    let e = GatewayError::Mismatch {
                        status: policy.mismatch_status,
                    };
                    return (Outcome::mismatch, Err(e), NO_UPSTREAM);
                }
                Claim::Existing(Entry {
                    state: EntryState::InFlight,
                    ..
                }) => {
                    if policy.on_in_flight == OnInFlight::Wait {
                        let w = match waiting.as_mut() {
                            Some(w) => Some(w),
                            None => Waiting::start(&route).map(|w| waiting.insert(w)),
                        };
                        if let Some(delay) = w.and_then(Waiting::next_delay) {
                            tokio::time::sleep(delay).await;
                            continue;
                        }
                    }
                    let e = GatewayError::InFlight {
                        retry_after: IN_FLIGHT_RETRY_AFTER,
                    };
                    return (Outcome::in_flight_conflict, Err(e), NO_UPSTREAM);
                }
                Claim::Existing(Entry {
                    state: EntryState::NotReplayable,
                    ..
                }) => {
                    return (
                        Outcome::not_replayable,
                        Err(GatewayError::NotReplayable),
                        NO_UPSTREAM,
                    )
                }
                Claim::Existing(Entry {
                    state: EntryState::Completed(stored),
                    ..
                }) => {
                    if let Some(trace) = stored.traceparent.as_ref().and_then(|t| t.to_str().ok()) {
                        Span::current().record("original_trace", trace);
                    }
                    let lengths = stored
                        .headers
                        .iter()
                        .filter(|(n, _)| n == header::CONTENT_LENGTH);
                    let is_head = parts.method == Method::HEAD;
                    if !declares_its_length(
                        stored.status,
                        lengths.map(|(_, v)| v),
                        stored.body.len(),
                        is_head,
                    ) {
                        error!(route = %policy.route, key = %held.tag(), "stored record is damaged (its body disagrees with its Content-Length); refused (evict the key through the admin API to let it run again)");
                        return (
                            Outcome::store_error,
                            Err(GatewayError::CorruptRecord),
                            NO_UPSTREAM,
                        );
                    }
                    self.metrics.replayed_bytes(stored.body.len());
                    return (Outcome::replayed, Ok(respond(&stored, true)), NO_UPSTREAM);
                }
                Claim::Claimed => {
                    // The claimed work runs in its own task so that a client that disconnects does
                    // not cancel it: the upstream call completes and its response is stored for the
                    // retry. The tracker lets a graceful shutdown wait for it.
                    drop(waiting);
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    let this = self.clone();
                    this.metrics.in_flight().inc();
                    let work = async move {
                        let result = this.run_claimed(&held, parts, body).await;
                        this.metrics.in_flight().dec();
                        if tx.send(result).is_err() {
                            debug!("client went away; the response was recorded for its retry");
                        }
                    };
                    // No span of its own at info level: one per miss cost about 15% of the miss
                    // path's CPU (measured). Its warnings name the route and key themselves.
                    self.tasks.spawn(work.in_current_span());
                    let (result, upstream) = rx
                        .await
                        .unwrap_or((Err(GatewayError::Upstream), NO_UPSTREAM));
                    return (Outcome::miss, result, upstream);
                }
            }
        }
    }

    /// The state machine of a claimed key: forward while holding the lease, then record.
    async fn run_claimed(
        &self,
        held: &Held,
        parts: Parts,
        body: Bytes,
    ) -> (Result<Response<Body>, GatewayError>, Duration) {
        let policy = &*held.route;
        let traceparent = parts.headers.get(TRACEPARENT).cloned();
        let req = Request::from_parts(parts, Body::from(body));
        let started = Instant::now();
        let call = tokio::time::timeout(policy.upstream_timeout, self.call_upstream(req, held));
        let result = tokio::select! {
            result = call => result,
            never = self.hold_lease(held) => match never {},
        };
        let upstream = started.elapsed();
        self.metrics.upstream(upstream);
        // From here on the lease is no longer renewed.
        let result = match result {
            Err(_elapsed) => {
                // The upstream may still be executing: keep the claim until its lease ends.
                warn!(route = %policy.route, key = %held.tag(), timeout = ?policy.upstream_timeout, "upstream timed out; key stays claimed until its lease ends");
                Err(GatewayError::UpstreamTimeout)
            }
            Ok(UpstreamResult::NotSent) => {
                self.release(held).await;
                Err(GatewayError::Upstream)
            }
            Ok(UpstreamResult::Failed) => Err(GatewayError::Upstream),
            Ok(UpstreamResult::Transient(head, body)) => {
                self.release(held).await;
                Ok(Response::from_parts(head, Body::new(body)))
            }
            Ok(UpstreamResult::Whole(head, body)) => {
                let stored = Arc::new(StoredResponse {
                    status: head.status,
                    headers: head
                        .headers
                        .iter()
                        .map(|(n, v)| (n.clone(), v.clone()))
                        .collect(),
                    body,
                    traceparent,
                });
                let state = EntryState::Completed(stored.clone());
                self.complete(held, &state).await;
                Ok(respond(&stored, false))
            }
            Ok(UpstreamResult::TooLarge(head, read, rest)) => {
                self.complete(held, &EntryState::NotReplayable).await;
                let read = futures_util::stream::iter(read.into_iter().map(Ok::<_, hyper::Error>));
                let rest = BodyStream::new(rest).filter_map(|f| async move {
                    match f {
                        Ok(frame) => frame.into_data().ok().map(Ok),
                        Err(e) => Some(Err(e)),
                    }
                });
                Ok(Response::from_parts(
                    head,
                    Body::from_stream(read.chain(rest)),
                ))
            }
        };
        (result, upstream)
    }

    /// Send the request and read as much of the response as the decision needs.
    async fn call_upstream(&self, req: Request<Body>, held: &Held) -> UpstreamResult {
        let policy = &*held.route;
        let is_head = req.method() == Method::HEAD;
        let resp = match self.upstream.forward(req).await {
            Ok(resp) => resp,
            Err(e @ ForwardError::Connect(_)) => {
                warn!(route = %policy.route, key = %held.tag(), error = %e, "upstream unreachable; nothing was sent");
                return UpstreamResult::NotSent;
            }
            Err(e @ ForwardError::Other(_)) => {
                warn!(route = %policy.route, key = %held.tag(), error = %e, "upstream failed after the request may have been sent");
                return UpstreamResult::Failed;
            }
        };
        let (head, mut body) = resp.into_parts();
        if !is_storable(head.status, policy.cache_server_errors) {
            return UpstreamResult::Transient(head, body);
        }
        let declared = content_length(&head.headers);
        if declared.is_some_and(|n| n > policy.max_body) {
            return UpstreamResult::TooLarge(head, Vec::new(), body);
        }
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut total = 0u64;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else {
                warn!(route = %policy.route, key = %held.tag(), "upstream response body failed midway");
                return UpstreamResult::Failed;
            };
            if let Ok(data) = frame.into_data() {
                total += data.len() as u64;
                chunks.push(data);
                if total > policy.max_body {
                    return UpstreamResult::TooLarge(head, chunks, body);
                }
            }
        }
        let body = match chunks.len() {
            0 => Bytes::new(),
            1 => chunks.pop().expect("one chunk"),
            _ => {
                let mut buf = BytesMut::with_capacity(total as usize);
                chunks.iter().for_each(|c| buf.extend_from_slice(c));
                buf.freeze()
            }
        };
        let lengths = head.headers.get_all(header::CONTENT_LENGTH).iter();
        if !declares_its_length(head.status, lengths, body.len(), is_head) {
            // hyper reads bodies by their declared length: this would be a framing bug.
            error!(route = %policy.route, key = %held.tag(), "upstream response length disagrees with its Content-Length; not recorded");
            return UpstreamResult::Failed;
        }
        UpstreamResult::Whole(head, body)
    }

    /// Renew the lease every third of its length for as long as this future is polled. Never
    /// returns: when the lease is lost (a newer claim exists), renewing stops and fencing makes
    /// sure this holder's completion is refused.
    async fn hold_lease(&self, held: &Held) -> Infallible {
        let (route, lease) = (&held.route.route, held.route.lock_ttl);
        let every = (lease / 3).max(Duration::from_millis(10));
        loop {
            tokio::time::sleep(every).await;
            match self
                .timed(
                    StoreOp::renew,
                    self.store.renew(&held.key, &held.token, lease),
                )
                .await
            {
                Ok(true) => debug!(%route, key = %held.tag(), "lease renewed"),
                Ok(false) => {
                    warn!(%route, key = %held.tag(), "lease lost while the upstream was running; this holder's result will not be stored");
                    return std::future::pending().await;
                }
                Err(e) => {
                    warn!(%route, key = %held.tag(), error = %e, "lease renewal failed; retrying")
                }
            }
        }
    }

    async fn complete(&self, held: &Held, state: &EntryState) {
        let (route, ttl) = (&held.route.route, held.route.ttl);
        let (key, token) = (&held.key, &held.token);
        match self
            .timed(
                StoreOp::complete,
                self.store
                    .complete(key, &held.fingerprint, token, state, ttl),
            )
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                warn!(%route, key = %held.tag(), "lease was lost before completion; response delivered but not recorded")
            }
            Err(e) => {
                error!(%route, key = %held.tag(), error = %e, "store failed to record the response; delivered anyway, key stays in flight until its lease ends")
            }
        }
    }

    /// Take back a claim whose answer was lost. It may still be applied after the error: stuck
    /// behind a stalled Redis, or sent on a connection that was replaced while the release goes
    /// on the new one, so that Redis may run the two in either order. So the release is tried
    /// again as Redis recovers: six tries, 0.1 s apart doubling (3.1 s of pauses), until one
    /// removes the claim. Fenced by the token: it never removes anyone else's claim.
    async fn take_back(&self, held: &Held) {
        let mut delay = Duration::from_millis(100);
        for attempt in 0..6 {
            if attempt > 0 {
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            if let Ok(true) = self.store.release(&held.key, &held.token).await {
                debug!(route = %held.route.route, key = %held.tag(), "claim with a lost answer taken back");
                return;
            }
        }
    }

    async fn release(&self, held: &Held) {
        match self
            .timed(StoreOp::release, self.store.release(&held.key, &held.token))
            .await
        {
            Ok(_) => {}
            Err(e) => {
                warn!(route = %held.route.route, key = %held.tag(), error = %e, "store failed to release the key; it stays claimed until its lease ends")
            }
        }
    }

    /// Forward a request that idempotency does not apply to, streaming both ways; with the time
    /// until the upstream's response head.
    async fn pass_through(
        &self,
        req: Request<Body>,
        policy: &Policy,
    ) -> (Response<Body>, Duration) {
        let started = Instant::now();
        let result =
            tokio::time::timeout(policy.upstream_timeout, self.upstream.forward(req)).await;
        let upstream = started.elapsed();
        self.metrics.upstream(upstream);
        let resp = match result {
            Ok(Ok(resp)) => {
                let (head, body) = resp.into_parts();
                // A small response of known length is read whole and sent in one write (as
                // nginx's proxy buffering does); anything else streams through.
                let small = content_length(&head.headers).is_some_and(|n| n <= PASS_THROUGH_BUFFER);
                if small {
                    match body.collect().await {
                        Ok(whole) => Response::from_parts(head, Body::from(whole.to_bytes())),
                        Err(e) => {
                            warn!(error = %e, "pass-through response body failed midway");
                            GatewayError::Upstream.into_response()
                        }
                    }
                } else {
                    Response::from_parts(head, Body::new(body))
                }
            }
            Ok(Err(e)) => {
                warn!(error = %e, "pass-through request failed");
                GatewayError::Upstream.into_response()
            }
            Err(_) => GatewayError::UpstreamTimeout.into_response(),
        };
        (resp, upstream)
    }

    /// Await a store operation, recording its latency.
    async fn timed<T>(&self, op: StoreOp, f: impl Future<Output = T>) -> T {
        let started = Instant::now();
        let out = f.await;
        self.store_ops[op as usize].observe(started.elapsed().as_secs_f64());
        out
    }
}

/// A claim this gateway holds: what fences its store operations (key, token), what it records
/// (fingerprint, under the route's policy), and what its warnings name (route, key tag).
struct Held {
    key: ScopedKey,
    token: Token,
    fingerprint: Fingerprint,
    route: Arc<Policy>,
    // The client's key, logged only as a short hash.
    client_key: IdempotencyKey,
}

impl Held {
    /// The key as logs show it.
    fn tag(&self) -> String {
        self.client_key.short_hash()
    }
}

/// Armed while a claim's answer is awaited: dropped armed (the request's future was dropped, or
/// the store failed to answer), it takes the claim back in a task of its own, fenced by the token,
/// since the claim may have been applied all the same.
struct PendingClaim<S: Store> {
    armed: Option<(Arc<Inner<S>>, Arc<Held>)>,
}

impl<S: Store> PendingClaim<S> {
    fn arm(inner: &Arc<Inner<S>>, held: &Arc<Held>) -> Self {
        PendingClaim {
            armed: Some((inner.clone(), held.clone())),
        }
    }

    /// The store answered: whatever it said, this request acts on it.
    fn disarm(mut self) {
        self.armed = None;
    }
}

impl<S: Store> Drop for PendingClaim<S> {
    fn drop(&mut self) {
        if let Some((inner, held)) = self.armed.take() {
            let tasks = inner.tasks.clone();
            tasks.spawn(async move { inner.take_back(&held).await });
        }
    }
}

/// A duplicate waiting for an in-flight request: holds one of the route's waiter permits and
/// polls the store with a growing delay until the deadline.
struct Waiting {
    // Released when the wait ends, however it ends.
    _permit: OwnedSemaphorePermit,
    deadline: Instant,
    delay: Duration,
}

impl Waiting {
    /// Start waiting, or `None` when the route already has `max_waiters` waiting.
    fn start(route: &RouteState) -> Option<Self> {
        let permit = route.waiters.clone().try_acquire_owned().ok()?;
        Some(Waiting {
            _permit: permit,
            deadline: Instant::now() + route.policy.wait_timeout,
            delay: Duration::from_millis(5),
        })
    }

    /// How long to sleep before polling again, or `None` once the deadline has passed.
    fn next_delay(&mut self) -> Option<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let delay = self.delay.min(left);
        self.delay = (self.delay * 2).min(Duration::from_millis(100));
        Some(delay)
    }
}

/// A request refused before the store is asked (bad or missing key).
fn refuse(e: GatewayError) -> (Outcome, Response<Body>, Duration) {
    debug!(problem = e.kind(), "rejected");
    (Outcome::rejected_invalid, e.into_response(), Duration::ZERO)
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

/// The `Content-Length` of a message, when it has a valid one.
fn content_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Whether a response's `Content-Length` values, if any, are the length of its body (RFC 9112
/// section 6.3). Checked on every response the gateway sends from a buffer, fresh or replayed, so
/// that a wrong length never reaches a client. Responses without content (to HEAD; 1xx, 204,
/// 304) may declare the length of the representation instead.
fn declares_its_length<'a>(
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

/// Buffer a keyed request's body, refusing more than `limit` bytes with 413.
async fn buffer_request(parts: &Parts, body: Body, limit: u64) -> Result<Bytes, GatewayError> {
    let declared = content_length(&parts.headers);
    if declared.is_some_and(|n| n > limit) {
        return Err(GatewayError::BodyTooLarge { limit });
    }
    match Limited::new(body, limit as usize).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(GatewayError::BodyTooLarge { limit })
        }
        Err(_) => Err(GatewayError::InvalidBody),
    }
}

/// Build the client's response from a stored one; `replayed` adds `Idempotent-Replayed: true`.
fn respond(stored: &StoredResponse, replayed: bool) -> Response<Body> {
    let mut resp = Response::new(Body::from(stored.body.clone()));
    *resp.status_mut() = stored.status;
    let headers = resp.headers_mut();
    headers.reserve(stored.headers.len() + 1);
    for (n, v) in &stored.headers {
        headers.append(n.clone(), v.clone());
    }
    if replayed {
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
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
