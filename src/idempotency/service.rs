//! [`Idempotency`]: the state machine of one request, around any inner service. Read
//! `Shared::keyed` and `Shared::run_claimed` top to bottom: they are the whole protocol.
//!
//! ```text
//!  keyed request ─► buffer body (413) ─► fingerprint ─► claim ─┬─ store down ─► on_store_error: 503 | call unprotected
//!                                                   ▲          ├─ mismatch (409/422)
//!                                                   │          ├─ in flight ─► on_in_flight: 409 in flight
//!                                                   └─ waiting ◄┘                 | wait (bounded) and claim again
//!                                                              ├─ not replayable ─► 409 not replayable
//!                                                              ├─ replay ─► the stored response
//!                                                              └─ claimed ─► run_claimed (spawned: survives client aborts)
//!  run_claimed: call the inner service while renewing the lease
//!                   ─┬─ error carrying NotSent ─► release, the error
//!                    ├─ timeout / other error / body failed / no final status (1xx) ─► keep the claim until the lease ends
//!                    ├─ 5xx, 408, 429 ─► release, pass the response on
//!                    ├─ body ≤ max_body ─► complete (replayable), respond
//!                    └─ body > max_body ─► complete (not replayable), stream once
//!  complete, release and renew are fenced by the claim's token: a holder whose lease ran out
//!  changes nothing.
//! ```

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, Request, Response, StatusCode};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;
use tracing::{debug, debug_span, error, field, warn, Instrument, Span};

use super::body::{collect_capped, replay_then_rest, Collected};
use super::fingerprint::Fingerprint;
use super::json;
use super::key::{IdempotencyKey, KeySource, ScopedKey};
use super::policy::{FingerprintMode, OnInFlight, OnStoreError, Policy};
use super::record::{EntryState, StoredResponse, Token};
use super::routes::{RouteState, RouteTable};
use crate::error::GatewayError;
use crate::headers::{declares_its_length, is_final_status};
use crate::metrics::{Metrics, Outcome, StoreOp, StoreOpMetrics};
use crate::store::Watch;
use crate::store::{Claim, Replay, Store, StoreError};

/// The W3C trace context header, forwarded to the inner service and stored with the record.
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The header that marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// How long a duplicate of an in-flight request is told to wait (`Retry-After`).
const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// When the layer wants a keyed request's answer (head and body): handed to the inner service
/// as a request extension, so that it can bound its own waits by the same instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline(pub Instant);

/// Marks an inner service's error as "the request was certainly not processed" (a connection
/// that could not be made, say): the layer then releases the key, so that a retry runs at once.
///
/// The layer looks for it along the error's `source()` chain, so an inner service expresses it
/// by returning an error that is, or wraps, a `NotSent`. Every other error keeps the key claimed
/// until its lease ends, since the request may have been processed.
#[derive(Debug, thiserror::Error)]
#[error("the request was not sent: {cause}")]
pub struct NotSent {
    #[source]
    cause: Box<dyn StdError + Send + Sync>,
}

impl NotSent {
    /// Say that the request was not sent, because of `cause`.
    pub fn new(cause: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        NotSent {
            cause: cause.into(),
        }
    }
}

/// Whether `e`, or an error it was caused by, is a [`NotSent`].
fn is_not_sent(e: &(dyn StdError + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if e.is::<NotSent>() {
            return true;
        }
        cause = e.source();
    }
    false
}

/// A service wrapped by an [`IdempotencyLayer`](super::IdempotencyLayer): requests idempotency
/// applies to run the keyed state machine around `inner`; every other request is simply passed
/// to `inner`.
///
/// The inner service's errors reach the caller unchanged; the layer's own answers (a replay, a
/// conflict, a refusal) are responses.
pub struct Idempotency<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S: Clone, St> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S, St> Idempotency<S, St> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<St>>) -> Self {
        Idempotency { inner, shared }
    }
}

/// What every clone of a layer and its services share.
pub(crate) struct Shared<St> {
    // Where records live.
    pub(crate) store: St,
    // Which policy a path gets, with the routes' live state.
    pub(crate) table: RouteTable,
    // Every claimed call, so that a shutdown can wait for them to be recorded.
    pub(crate) tasks: TaskTracker,
    pub(crate) metrics: Metrics,
    // The store-operation histograms, resolved once.
    ops: StoreOpMetrics,
}

impl<St> Shared<St> {
    pub(crate) fn new(store: St, table: RouteTable, metrics: Metrics, tasks: TaskTracker) -> Self {
        Shared {
            store,
            table,
            tasks,
            ops: metrics.store_ops(),
            metrics,
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, St, B, RB> tower::Service<Request<B>> for Idempotency<S, St>
where
    St: Store,
    S: tower::Service<Request<Body>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: StdError + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let started = Instant::now();
        // The service that was polled ready is the one that runs this request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        let route = shared.table.route_for(req.uri().path()).clone();
        let policy = &route.policy;
        let mut req = req.map(Body::new);
        // The inner service learns the policy applied (the proxy reads its upstream_timeout).
        req.extensions_mut().insert(policy.clone());
        let applies = policy.applies_to(req.method());
        let key = if applies {
            IdempotencyKey::from_headers(req.headers(), &policy.key_headers, policy.key_max_len)
        } else {
            Ok(None)
        };
        let key = match key {
            Ok(Some(key)) => Some(key),
            // The key may be in the body: the keyed path reads it first.
            Ok(None) if applies && policy.keys_from_body() => None,
            Ok(None) if applies && policy.require_key => {
                return shared.refuse_now(&route, started, GatewayError::MissingKey)
            }
            Ok(None) => {
                // Not idempotent: simply the inner service.
                let call = inner.call(req);
                shared.metrics.overhead(started.elapsed());
                return Box::pin(async move {
                    let called = Instant::now();
                    let answer = call.await.map(relayed);
                    shared.metrics.upstream(called.elapsed());
                    route.metrics.count(Outcome::passthrough);
                    answer
                });
            }
            Err(e) => return shared.refuse_now(&route, started, e),
        };
        // At debug level: at the default `info`, a span per request and its formatted fields
        // would weigh on the replay path (docs/operating.md, "Tracing and logs").
        let span = debug_span!(
            "idempotent_request",
            method = %req.method(),
            route = %policy.route,
            key = field::Empty,
            key_source = field::Empty,
            outcome = field::Empty,
            original_trace = field::Empty,
        );
        Box::pin(async move {
            let (outcome, answer, inner_time) = shared
                .clone()
                .keyed(route.clone(), inner, key, req)
                .instrument(span.clone())
                .await;
            span.record("outcome", outcome.as_str());
            match &answer {
                Ok(resp) => debug!(parent: &span, status = resp.status().as_u16(), "done"),
                Err(e) => debug!(parent: &span, error = %e, "inner service failed"),
            }
            route.metrics.count(outcome);
            shared
                .metrics
                .overhead(started.elapsed().saturating_sub(inner_time));
            answer
        })
    }
}

/// The header by which an upstream steers the recording of one response (`no-store`,
/// `max-age=SECONDS`); never relayed to a client.
pub const IDEMPOTENCY_CONTROL: HeaderName = HeaderName::from_static("idempotency-control");

/// A response the inner service gave, as relayed to the client: its body boxed, and
/// `Idempotency-Control` removed.
fn relayed<RB>(resp: Response<RB>) -> Response<Body>
where
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let mut resp = resp.map(Body::new);
    if !resp.headers().is_empty() {
        resp.headers_mut().remove(IDEMPOTENCY_CONTROL);
    }
    resp
}

/// What an upstream's `Idempotency-Control` asks for one response.
#[derive(Debug, Default, PartialEq, Eq)]
struct Control {
    // `no-store`, or `max-age=0`: not recorded.
    no_store: bool,
    // `max-age=SECONDS`: recorded for this long (bounded by the route's max_ttl).
    max_age: Option<Duration>,
}

impl Control {
    /// Read the directives of every `Idempotency-Control` header (comma-separated,
    /// case-insensitive; unknown ones ignored), and remove them.
    fn take(headers: &mut http::HeaderMap) -> Self {
        let mut control = Control::default();
        for value in headers.get_all(IDEMPOTENCY_CONTROL) {
            for directive in value.to_str().unwrap_or("").split(',').map(str::trim) {
                let (name, arg) = directive.split_once('=').unwrap_or((directive, ""));
                if name.eq_ignore_ascii_case("no-store") {
                    control.no_store = true;
                } else if name.eq_ignore_ascii_case("max-age") {
                    match arg.trim().trim_matches('"').parse::<u64>() {
                        Ok(0) => control.no_store = true,
                        Ok(secs) => control.max_age = Some(Duration::from_secs(secs)),
                        Err(_) => {}
                    }
                }
            }
        }
        headers.remove(IDEMPOTENCY_CONTROL);
        control
    }
}

/// A response or the inner service's error.
type Answer<E> = Result<Response<Body>, E>;

/// What the inner service's call came to, for a claimed request.
enum Called<E> {
    /// It failed, and its error carries [`NotSent`]: safe to run again.
    NotSent(E),
    /// It failed after the request may have been processed.
    Failed(E),
    /// The response head came, but its body failed midway.
    BodyFailed,
    /// The response's status ends no exchange (1xx, or past 599): a broken answer, after the
    /// request may have been processed.
    NotFinal(StatusCode),
    /// A response that must not be stored (5xx, 408, 429): passed on, key released.
    Transient(Response<Body>),
    /// A storable response whose whole body fits in `max_body`, to keep for the duration.
    Whole(http::response::Parts, Bytes, Duration),
    /// A storable response larger than `max_body`: the chunks read so far and the rest; the
    /// key is recorded as not replayable for the duration.
    TooLarge(http::response::Parts, Vec<Bytes>, Body, Duration),
}

impl<St: Store> Shared<St> {
    /// Answer `e` without calling anything, counted as a refusal.
    fn refuse_now<E>(
        &self,
        route: &RouteState,
        started: Instant,
        e: GatewayError,
    ) -> BoxFuture<Result<Response<Body>, E>>
    where
        E: Send + 'static,
    {
        debug!(problem = e.kind(), route = %route.policy.route, "refused");
        route.metrics.count(Outcome::rejected_invalid);
        self.metrics.overhead(started.elapsed());
        Box::pin(std::future::ready(Ok(e.into_response())))
    }

    /// The state machine of a keyed request, up to the claim. Without `key` (no header carried
    /// one), the key is looked for in the body; a request that has none after all goes to the
    /// inner service as it would have without a key route.
    async fn keyed<S, RB>(
        self: Arc<Self>,
        route: Arc<RouteState>,
        inner: S,
        key: Option<IdempotencyKey>,
        req: Request<Body>,
    ) -> (Outcome, Answer<S::Error>, Duration)
    where
        S: tower::Service<Request<Body>, Response = Response<RB>> + Send + 'static,
        S::Future: Send,
        S::Error: StdError + Send + 'static,
        RB: http_body::Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<Box<dyn StdError + Send + Sync>>,
    {
        const NO_CALL: Duration = Duration::ZERO;
        let policy = route.policy.clone();
        let (parts, body) = req.into_parts();
        let body = match collect_capped(body, policy.max_body).await {
            Ok(Collected::Whole(body)) => body,
            Ok(Collected::TooLarge { read, rest }) => {
                if key.is_none() && !policy.require_key {
                    // No key in a header, and too large to look for one in the body.
                    let req = Request::from_parts(parts, replay_then_rest(read, rest));
                    let (answer, took) = self.pass_through(inner, req).await;
                    return (Outcome::passthrough, answer, took);
                }
                let limit = policy.max_body;
                return refused(
                    Outcome::rejected_invalid,
                    GatewayError::BodyTooLarge { limit },
                );
            }
            Err(_) => return refused(Outcome::rejected_invalid, GatewayError::InvalidBody),
        };
        // The body is parsed once, when something needs it: a canonical fingerprint, or a key
        // that no header carried.
        let json_typed = parts
            .headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|ct| json::is_json_type(ct.as_bytes()));
        let doc = if json_typed && (policy.fingerprint == FingerprintMode::Json || key.is_none()) {
            match json::parse(&body) {
                Ok(doc) => Some(doc),
                Err(e) => {
                    return refused(Outcome::rejected_invalid, GatewayError::InvalidJson(e.0))
                }
            }
        } else {
            None
        };
        let (key, source) = match key {
            Some(key) => (key, KeySource::Header),
            None => match body_key(&policy, doc.as_ref()) {
                Ok(Some(found)) => found,
                Ok(None) if policy.require_key => {
                    return refused(Outcome::rejected_invalid, GatewayError::MissingKey)
                }
                Ok(None) => {
                    drop(doc);
                    let req = Request::from_parts(parts, Body::from(body));
                    let (answer, took) = self.pass_through(inner, req).await;
                    return (Outcome::passthrough, answer, took);
                }
                Err(e) => return refused(Outcome::rejected_invalid, e),
            },
        };
        Span::current().record("key", key.short_hash());
        Span::current().record("key_source", source.as_str());
        let held = Arc::new(Held {
            key: key.scoped(&parts.headers, &policy.scope_headers, &policy.scope_cookies),
            token: Token::random(),
            fingerprint: Fingerprint::for_policy(&parts, &body, doc.as_ref(), &policy),
            route: policy.clone(),
            client_key: key,
            source,
        });
        drop(doc);
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
                    return refused(Outcome::store_error, GatewayError::CorruptRecord);
                }
                Err(e) => {
                    drop(pending);
                    if matches!(e, StoreError::NotAcknowledged { .. }) {
                        self.metrics.unacknowledged(StoreOp::claim);
                    }
                    match policy.on_store_error {
                        OnStoreError::Reject => {
                            error!(error = %e, route = %policy.route, key = %held.tag(), "store unavailable; refusing the keyed request (on_store_error = reject)");
                            return refused(Outcome::store_error, GatewayError::StoreUnavailable);
                        }
                        OnStoreError::Pass => {
                            warn!(error = %e, route = %policy.route, key = %held.tag(), "store unavailable; forwarding WITHOUT idempotency (on_store_error = pass)");
                            self.metrics.store_error_passed();
                            let req = Request::from_parts(parts, Body::from(body));
                            let (answer, took) = self.pass_through(inner, req).await;
                            return (Outcome::store_error, answer, took);
                        }
                    }
                }
            };
            match claim {
                Claim::Mismatch => {
                    let e = GatewayError::Mismatch {
                        status: policy.mismatch_status,
                    };
                    return refused(Outcome::mismatch, e);
                }
                Claim::InFlight => {
                    if policy.on_in_flight == OnInFlight::Wait {
                        if waiting.is_none() {
                            if let Some(mut w) = Waiting::start(&route) {
                                // Subscribed first, then looked at again: a completion between
                                // the two is seen by the second look.
                                w.watch = self.store.watch(&held.key).await;
                                waiting = Some(w);
                                continue;
                            }
                        }
                        if let Some(w) = waiting.as_mut() {
                            if let Some(delay) = w.next_delay() {
                                match w.watch.as_mut() {
                                    Some(watch) => {
                                        tokio::select! {
                                            () = tokio::time::sleep(delay) => {}
                                            () = watch.changed() => {}
                                        }
                                    }
                                    None => tokio::time::sleep(delay).await,
                                }
                                continue;
                            }
                        }
                    }
                    let e = GatewayError::InFlight {
                        retry_after: IN_FLIGHT_RETRY_AFTER,
                    };
                    return refused(Outcome::in_flight_conflict, e);
                }
                Claim::NotReplayable => {
                    return refused(Outcome::not_replayable, GatewayError::NotReplayable)
                }
                Claim::Replay(Replay {
                    response,
                    expires_in,
                }) => {
                    if !framed_as_stored(&response, &parts.method) {
                        error!(route = %policy.route, key = %held.tag(), "stored record is damaged (its body disagrees with its Content-Length); refused (evict the key through the admin API to let it run again)");
                        return refused(Outcome::store_error, GatewayError::CorruptRecord);
                    }
                    if let Some(trace) = response.traceparent.as_ref().and_then(|t| t.to_str().ok())
                    {
                        Span::current().record("original_trace", trace);
                    }
                    self.metrics.replayed_bytes(response.body.len());
                    let resp = respond(
                        &response,
                        Some(&policy.replay_drop_headers),
                        expiry(&policy, expires_in),
                    );
                    return (Outcome::replayed, Ok(resp), NO_CALL);
                }
                Claim::Claimed => {
                    // The claimed work runs in its own task so that a client that disconnects does
                    // not cancel it: the call completes and its response is stored for the retry.
                    // The tracker lets a graceful shutdown wait for it.
                    drop(waiting);
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    let this = self.clone();
                    this.metrics.in_flight().inc();
                    let work = async move {
                        let result = this.run_claimed(inner, &held, parts, body).await;
                        this.metrics.in_flight().dec();
                        if tx.send(result).is_err() {
                            debug!("client went away; the response was recorded for its retry");
                        }
                    };
                    // No span of its own at info level (its cost shows on the miss path); its
                    // warnings name the route and key themselves.
                    self.tasks.spawn(work.in_current_span());
                    let (answer, took) = rx.await.unwrap_or_else(|_| {
                        // The task ended without an answer: it panicked, or the runtime is going away.
                        (Ok(GatewayError::Upstream.into_response()), NO_CALL)
                    });
                    return (Outcome::miss, answer, took);
                }
            }
        }
    }

    /// The state machine of a claimed key: call the inner service while holding the lease, then
    /// record; with the time the call took.
    async fn run_claimed<S, RB>(
        self: &Arc<Self>,
        inner: S,
        held: &Arc<Held>,
        parts: Parts,
        body: Bytes,
    ) -> (Answer<S::Error>, Duration)
    where
        S: tower::Service<Request<Body>, Response = Response<RB>>,
        S::Error: StdError + 'static,
        RB: http_body::Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<Box<dyn StdError + Send + Sync>>,
    {
        let policy = &*held.route;
        let traceparent = parts.headers.get(TRACEPARENT).cloned();
        let is_head = parts.method == Method::HEAD;
        let mut req = Request::from_parts(parts, Body::from(body));
        let started = Instant::now();
        // The inner service gets the same deadline: when it says "not sent" at that very
        // moment (it waited for a connection), its answer wins over the timeout.
        let deadline = started + policy.upstream_timeout;
        req.extensions_mut().insert(Deadline(deadline));
        let called = tokio::select! {
            biased;
            called = self.call(inner, req, held) => Ok(called),
            () = tokio::time::sleep_until(deadline) => Err(()),
            never = self.hold_lease(held) => match never {},
        };
        let took = started.elapsed();
        self.metrics.upstream(took);
        // From here on the lease is no longer renewed.
        let answer = match called {
            Err(()) => {
                // The inner service may still be executing: keep the claim until its lease ends.
                warn!(route = %policy.route, key = %held.tag(), timeout = ?policy.upstream_timeout, "upstream timed out; key stays claimed until its lease ends");
                Ok(GatewayError::UpstreamTimeout.into_response())
            }
            Ok(Called::NotSent(e)) => {
                warn!(route = %policy.route, key = %held.tag(), error = %e, "upstream unreachable; nothing was sent");
                self.release(held).await;
                Err(e)
            }
            Ok(Called::Failed(e)) => {
                warn!(route = %policy.route, key = %held.tag(), error = %e, "upstream failed after the request may have been sent; key stays claimed until its lease ends");
                Err(e)
            }
            Ok(Called::BodyFailed) => Ok(GatewayError::Upstream.into_response()),
            Ok(Called::NotFinal(status)) => {
                warn!(route = %policy.route, key = %held.tag(), %status, "inner service answered with no final response; key stays claimed until its lease ends");
                Ok(GatewayError::UpstreamInvalidResponse(status.as_u16()).into_response())
            }
            Ok(Called::Transient(resp)) => {
                self.release(held).await;
                Ok(resp)
            }
            Ok(Called::Whole(head, body, ttl)) => {
                let stored = Arc::new(StoredResponse::new(head, body, traceparent, held.source));
                if declares_its_length(stored.status, stored.lengths(), stored.body.len(), is_head)
                {
                    let state = EntryState::Completed(stored.clone());
                    self.complete(held, &state, ttl).await;
                    Ok(respond(&stored, None, expiry(policy, Some(ttl))))
                } else {
                    // A response that would be sent with a wrong length: not recorded, not sent.
                    error!(route = %policy.route, key = %held.tag(), "response length disagrees with its Content-Length; not recorded, key stays claimed until its lease ends");
                    Ok(GatewayError::Upstream.into_response())
                }
            }
            Ok(Called::TooLarge(head, read, rest, ttl)) => {
                self.complete(held, &EntryState::NotReplayable, ttl).await;
                let mut resp = Response::from_parts(head, replay_then_rest(read, rest));
                if let Some((name, value)) = expiry(policy, Some(ttl)) {
                    resp.headers_mut().insert(name, value);
                }
                Ok(resp)
            }
        };
        (answer, took)
    }

    /// Call the inner service and read as much of the response as the decision needs.
    async fn call<S, RB>(&self, inner: S, req: Request<Body>, held: &Held) -> Called<S::Error>
    where
        S: tower::Service<Request<Body>, Response = Response<RB>>,
        S::Error: StdError + 'static,
        RB: http_body::Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<Box<dyn StdError + Send + Sync>>,
    {
        let policy = &*held.route;
        let resp = match inner.oneshot(req).await {
            Ok(resp) => resp,
            Err(e) if is_not_sent(&e) => return Called::NotSent(e),
            Err(e) => return Called::Failed(e),
        };
        if !is_final_status(resp.status()) {
            return Called::NotFinal(resp.status());
        }
        let (mut head, body) = resp.into_parts();
        let body = Body::new(body);
        let control = Control::take(&mut head.headers);
        if !is_storable(head.status, policy.cache_server_errors) || control.no_store {
            return Called::Transient(Response::from_parts(head, body));
        }
        let ttl = match control.max_age {
            Some(age) => age.min(policy.max_ttl),
            None if head.status.as_u16() >= 400 => policy.failure_ttl,
            None => policy.ttl,
        };
        match collect_capped(body, policy.max_body).await {
            Ok(Collected::Whole(body)) => Called::Whole(head, body, ttl),
            Ok(Collected::TooLarge { read, rest }) => Called::TooLarge(head, read, rest, ttl),
            Err(e) => {
                warn!(route = %policy.route, key = %held.tag(), error = %e, "upstream response body failed midway; key stays claimed until its lease ends");
                Called::BodyFailed
            }
        }
    }

    /// Renew the lease every third of its length for as long as this future is polled. Never
    /// returns: when the lease is lost (a newer claim exists), renewing stops and fencing makes
    /// sure this holder's completion is refused.
    async fn hold_lease(&self, held: &Held) -> std::convert::Infallible {
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

    async fn complete(self: &Arc<Self>, held: &Arc<Held>, state: &EntryState, ttl: Duration) {
        let route = &held.route.route;
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
                if matches!(e, StoreError::NotAcknowledged { .. }) {
                    self.metrics.unacknowledged(StoreOp::complete);
                }
                warn!(%route, key = %held.tag(), error = %e, "store did not record the response (or no replica acknowledged it); delivered anyway, sent again in the background until the lease ends");
                let (this, held, state) = (self.clone(), held.clone(), state.clone());
                self.tasks
                    .spawn(async move { this.complete_again(&held, &state, ttl).await });
            }
        }
    }

    /// Send a completion again until the store records it and the replicas acknowledge it (a
    /// failover in progress, a Redis restart), for as long as the claim's lease could last:
    /// after that the key is free and the response no longer ours to record. Fenced by the
    /// token, and a completion already there counts as done.
    async fn complete_again(&self, held: &Held, state: &EntryState, ttl: Duration) {
        let route = &held.route.route;
        let until = Instant::now() + held.route.lock_ttl;
        let mut delay = Duration::from_millis(100);
        let mut written = false;
        while Instant::now() + delay < until {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(1));
            match self
                .store
                .complete(&held.key, &held.fingerprint, &held.token, state, ttl)
                .await
            {
                Ok(true) => {
                    tracing::info!(%route, key = %held.tag(), "response recorded on a later try");
                    return;
                }
                Ok(false) => {
                    warn!(%route, key = %held.tag(), "lease was lost before the response could be recorded");
                    return;
                }
                Err(e) => {
                    written |= matches!(e, StoreError::NotAcknowledged { .. });
                    debug!(%route, key = %held.tag(), error = %e, "recording the response failed again");
                }
            }
        }
        if written {
            warn!(%route, key = %held.tag(), "response recorded, but no replica acknowledged it before the lease ended; a failover now could lose it");
        } else {
            error!(%route, key = %held.tag(), "store did not record the response before the lease ended; a retry may run again");
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

    /// Hand a request idempotency does not apply to to the inner service; with the time it took
    /// to answer.
    async fn pass_through<S, RB>(
        &self,
        inner: S,
        req: Request<Body>,
    ) -> (Answer<S::Error>, Duration)
    where
        S: tower::Service<Request<Body>, Response = Response<RB>>,
        RB: http_body::Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<Box<dyn StdError + Send + Sync>>,
    {
        let started = Instant::now();
        let answer = inner.oneshot(req).await.map(relayed);
        let took = started.elapsed();
        self.metrics.upstream(took);
        (answer, took)
    }

    /// Await a store operation, recording its latency.
    async fn timed<T>(&self, op: StoreOp, f: impl Future<Output = T>) -> T {
        let started = Instant::now();
        let out = f.await;
        self.ops.observe(op, started.elapsed());
        out
    }
}

/// A claim this layer holds: what fences its store operations (key, token), what it records
/// (fingerprint, under the route's policy), and what its warnings name (route, key tag).
struct Held {
    key: ScopedKey,
    token: Token,
    fingerprint: Fingerprint,
    route: Arc<Policy>,
    // The client's key, logged only as a short hash.
    client_key: IdempotencyKey,
    // Where the key came from, kept with the record.
    source: KeySource,
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
struct PendingClaim<St: Store> {
    armed: Option<(Arc<Shared<St>>, Arc<Held>)>,
}

impl<St: Store> PendingClaim<St> {
    fn arm(shared: &Arc<Shared<St>>, held: &Arc<Held>) -> Self {
        PendingClaim {
            armed: Some((shared.clone(), held.clone())),
        }
    }

    /// The store answered: whatever it said, this request acts on it.
    fn disarm(mut self) {
        self.armed = None;
    }
}

impl<St: Store> Drop for PendingClaim<St> {
    fn drop(&mut self) {
        if let Some((shared, held)) = self.armed.take() {
            // Outside a runtime (a test dropping a future at exit) there is nothing to run it on;
            // the claim then ends with its lease.
            if tokio::runtime::Handle::try_current().is_ok() {
                let tasks = shared.tasks.clone();
                tasks.spawn(async move { shared.take_back(&held).await });
            }
        }
    }
}

/// A duplicate waiting for an in-flight request: holds one of the route's waiter permits and
/// looks at the store again when the key's holder completes or releases it (when the store
/// says), and otherwise with a growing delay until the deadline.
struct Waiting {
    // Released when the wait ends, however it ends.
    _permit: OwnedSemaphorePermit,
    deadline: Instant,
    delay: Duration,
    watch: Option<Watch>,
}

impl Waiting {
    /// Start waiting, or `None` when the route already has `max_waiters` waiting.
    fn start(route: &RouteState) -> Option<Self> {
        let permit = route.waiters.clone().try_acquire_owned().ok()?;
        Some(Waiting {
            _permit: permit,
            deadline: Instant::now() + route.policy.wait_timeout,
            delay: Duration::from_millis(5),
            watch: None,
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

/// The layer's own answer, with its outcome; nothing was called.
fn refused<E>(outcome: Outcome, e: GatewayError) -> (Outcome, Answer<E>, Duration) {
    debug!(problem = e.kind(), "refused");
    (outcome, Ok(e.into_response()), Duration::ZERO)
}

/// The key a JSON body carries (`key_from_body`), or else the one derived from its fields
/// (`derived_key`); `None` when neither is there (or the body is not JSON).
fn body_key(
    policy: &Policy,
    doc: Option<&json::Json<'_>>,
) -> Result<Option<(IdempotencyKey, KeySource)>, GatewayError> {
    let Some(doc) = doc else { return Ok(None) };
    if let Some(pointer) = &policy.key_from_body {
        if let Some(key) = IdempotencyKey::from_json(doc, pointer, policy.key_max_len)? {
            return Ok(Some((key, KeySource::Body)));
        }
    }
    if let Some(secret) = &policy.key_secret {
        if let Some(key) = IdempotencyKey::derived(doc, &policy.derived_key, secret) {
            return Ok(Some((key, KeySource::Derived)));
        }
    }
    Ok(None)
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

/// Whether a stored response still declares the length of the body it holds (a record cut short
/// in the store does not), for a replay to a request with `method`.
fn framed_as_stored(stored: &StoredResponse, method: &Method) -> bool {
    declares_its_length(
        stored.status,
        stored.lengths(),
        stored.body.len(),
        method == Method::HEAD,
    )
}

/// The expiry header of `policy`, for a record that lives `lives` more (unknown: none).
fn expiry(policy: &Policy, lives: Option<Duration>) -> Option<(HeaderName, HeaderValue)> {
    let name = policy.expiry_header.clone()?;
    let at = std::time::SystemTime::now() + lives?;
    let value = HeaderValue::from_str(&httpdate::fmt_http_date(at)).ok()?;
    Some((name, value))
}

/// Build the client's response from a stored one. A replay (`drop` given) carries
/// `Idempotent-Replayed: true` and none of the headers in `drop`; `expiry` is added when set.
fn respond(
    stored: &StoredResponse,
    drop: Option<&[HeaderName]>,
    expiry: Option<(HeaderName, HeaderValue)>,
) -> Response<Body> {
    let mut resp = Response::new(Body::from(stored.body.clone()));
    *resp.status_mut() = stored.status;
    let headers = resp.headers_mut();
    headers.reserve(stored.headers.len() + 2);
    for (n, v) in &stored.headers {
        if drop.is_some_and(|drop| drop.contains(n)) {
            continue;
        }
        headers.append(n.clone(), v.clone());
    }
    if drop.is_some() {
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    if let Some((name, value)) = expiry {
        headers.insert(name, value);
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
    fn not_sent_is_found_along_the_source_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] NotSent);
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(is_not_sent(&NotSent::new(io)));
        assert!(is_not_sent(&Outer(NotSent::new("refused"))));
        let other = std::io::Error::other("reset");
        assert!(!is_not_sent(&other));
    }
}
