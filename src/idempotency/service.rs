//! [`Idempotency`]: the state machine of one request, around any inner service. Read
//! `Shared::keyed` and `Shared::run_claimed` top to bottom: they are the whole protocol. The
//! claim's life cycle is in `lease.rs`, what is stored and replayed in `response.rs`, the wait
//! for an in-flight duplicate in `wait.rs`, streamed answers in `streamed.rs` (their tape in
//! `live.rs`).
//!
//! ```text
//!  keyed request ─► buffer body (413) ─► fingerprint ─► claim ─┬─ store down ─► on_store_error: 503 | call unprotected
//!                                                   ▲          ├─ mismatch (409/422)
//!                                                   │          ├─ in flight ─► on_in_flight: 409 in flight
//!                                                   └─ waiting ◄┘                 | wait (bounded) and claim again
//!                                                              ├─ in flight, streaming here (stream, wait) ─► attach to its tape
//!                                                              ├─ not replayable ─► 409 not replayable
//!                                                              ├─ replay ─► the stored response
//!                                                              └─ claimed ─► run_claimed (spawned: survives client aborts)
//!  run_claimed: call the inner service while the Lease is held (renewed)
//!                   ─┬─ error carrying NotSent ─► release, the error
//!                    ├─ timeout / other error / body failed / no final status (1xx) ─► keep the claim until the lease ends (counted unsettled)
//!                    ├─ 5xx, 408, 429 (gRPC: its status, grpc.rs) ─► release, pass the response on
//!                    ├─ body ≤ max_body ─► complete (replayable), respond
//!                    ├─ body > max_body ─► complete (not replayable), stream once
//!                    └─ stream = true ─► answer the head now; the task reads the body onto a
//!                       tape (live.rs) to its end, then completes (not replayable past max_body;
//!                       a gRPC call as its status in the trailers says: complete or release)
//!  complete, release and renew are fenced by the claim's token: a holder whose lease ran out
//!  changes nothing.
//! ```
//!
//! A gRPC call (`grpc.rs`) runs the same machine when it is unary or server-streaming (a
//! client or bidirectional streaming one is passed on), its answer judged by the status in its
//! trailers, the layer's own answers as gRPC statuses.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use super::shared::Shared;
use axum::body::Body;
use bytes::Bytes;
use futures_util::FutureExt;
use http::header;
use http::request::Parts;
use http::{Method, Request, Response};
use tokio::time::Instant;
use tower::ServiceExt;
use tracing::{debug, debug_span, error, field, warn, Instrument, Span};

use super::admit::{admit, Admission, Admitted};
use super::body::{collect_capped, replay_then_rest, with_trailers, ByteBody, Collected};
use super::grpc;
use super::inner::{is_not_sent, Deadline, Inner};
use super::lease::{Held, Lease};
use super::repeatability;
use super::response::{self, relayed, Terms, TRACEPARENT};
use super::routes::RouteState;
use super::sse;
use super::streamed::{StreamTtl, Tail};
use super::trace;
use super::wait::Waiter;
use crate::error::GatewayError;
use crate::headers::is_final_status;
use crate::metrics::{InFlight, Outcome, StoreOp, Unanswered, Unsettled};
use crate::record::fingerprint::Fingerprint;
use crate::record::json::{self, Json};
use crate::record::key::{IdempotencyKey, KeySource};
use crate::record::policy::{ErrorFormat, FingerprintMode, OnInFlight, OnStoreError, Policy};
use crate::record::{EntryState, StoredResponse, Token};
use crate::store::{Claim, Claimant, Keep, Replay, Store, StoreError};

/// The answer to a duplicate of an in-flight request: try again after a second (`Retry-After`).
const IN_FLIGHT: GatewayError = GatewayError::InFlight {
    retry_after: Duration::from_secs(1),
};

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

pub(super) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

// The public contract spells the inner service's bounds out (they are `Inner<RB>`, which is
// crate-private); every function behind it names `Inner<RB>`.
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
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        let route = shared.table.route_for(req.uri().path()).clone();
        let mut req = req.map(Body::new);
        // The inner service learns the policy applied (the proxy reads its upstream_timeout).
        req.extensions_mut().insert(route.policy.clone());
        let admitted = match admit(&route, &req) {
            Admission::Keyed(admitted) => admitted,
            Admission::Refused(refusal) => return shared.refuse_now(&route, started, refusal),
            Admission::Pass => return shared.pass_now(route, inner, req, started),
        };
        let Admitted {
            key,
            grpc,
            repeatable,
        } = admitted;
        let policy = &route.policy;
        // At debug level: at the default `info`, a span per request and its formatted fields
        // would weigh on the replay path (docs/operating.md, "Tracing and logs"). The
        // gateway's `[telemetry]` turns it on for the requests it samples.
        let span = debug_span!(
            trace::REQUEST_SPAN,
            otel.kind = "server",
            method = %req.method(),
            route = %policy.route,
            key = field::Empty,
            key_source = field::Empty,
            outcome = field::Empty,
            status = field::Empty,
            original_trace = field::Empty,
        );
        Box::pin(async move {
            let unanswered = Unanswered::new(&shared.metrics);
            // Boxed: the keyed path's state machine is deep, and a caller's own future (an axum
            // app's over a Redis store) would otherwise overflow the compiler's layout depth.
            let keyed = shared
                .clone()
                .keyed(route.clone(), inner, (key, grpc), req, &unanswered)
                .instrument(span.clone());
            let finished = Box::pin(keyed).await;
            unanswered.answered();
            span.record("outcome", finished.outcome.as_str());
            match &finished.answer {
                Ok(resp) => {
                    span.record("status", resp.status().as_u16());
                    debug!(parent: &span, status = resp.status().as_u16(), "done")
                }
                Err(e) => debug!(parent: &span, error = %e, "inner service failed"),
            }
            route.metrics.count(finished.outcome);
            shared
                .metrics
                .overhead(started.elapsed().saturating_sub(finished.inner_time));
            let mut answer = finished.answer;
            if let (true, Ok(resp)) = (repeatable, &mut answer) {
                // Accepted whenever the request may have been processed: forwarded (a miss, or
                // without idempotency when the store was down), or answered by a replay.
                let accepted = finished.forwarded || finished.outcome == Outcome::replayed;
                repeatability::mark(resp.headers_mut(), accepted);
            }
            answer
        })
    }
}

/// A response or the inner service's error.
type Answer<E> = Result<Response<Body>, E>;

/// The inner service's answer, and how long it took to give it.
struct Forwarded<E> {
    answer: Answer<E>,
    took: Duration,
}

impl<E> Forwarded<E> {
    /// The request ends with this answer, counted as `outcome`.
    fn ended(self, outcome: Outcome) -> Finished<E> {
        Finished {
            outcome,
            answer: self.answer,
            inner_time: self.took,
            forwarded: true,
        }
    }
}

/// What a keyed request came to: its outcome (for the metrics and the span), the answer the
/// client gets, and the time the inner service took (left out of the layer's overhead).
struct Finished<E> {
    outcome: Outcome,
    answer: Answer<E>,
    inner_time: Duration,
    // Whether the request was handed to the inner service (it may have been processed).
    forwarded: bool,
}

impl<E> Finished<E> {
    /// The layer's own answer, with its outcome; nothing was called.
    fn refused(outcome: Outcome, e: GatewayError, format: ErrorFormat) -> Self {
        debug!(problem = e.kind(), "refused");
        Finished {
            outcome,
            answer: Ok(e.respond(format)),
            inner_time: Duration::ZERO,
            forwarded: false,
        }
    }
}

/// What the inner service's call came to, for a claimed request.
enum Called<E> {
    /// It failed, and its error carries [`NotSent`](super::NotSent): safe to run again.
    NotSent(E),
    /// It failed after the request may have been processed.
    Failed(E),
    /// The response head came, but its body failed midway.
    BodyFailed,
    /// The response's status ends no exchange (1xx, or past 599): a broken answer, after the
    /// request may have been processed.
    NotFinal(http::StatusCode),
    /// A response that must not be stored (5xx, 408, 429): passed on, key released.
    Transient(Response<Body>),
    /// A storable response whose whole body (and trailers) fit in `max_body`, to keep for the
    /// duration.
    Whole(
        http::response::Parts,
        (Bytes, Option<http::HeaderMap>),
        Keep,
    ),
    /// A storable response larger than `max_body`: the chunks read so far and the rest; the
    /// key is recorded as not replayable for the duration.
    TooLarge(http::response::Parts, Vec<Bytes>, Body, Keep),
    /// A storable response on a `stream = true` route: sent as it comes, recorded at its end.
    Streamed(http::response::Parts, Body, StreamTtl),
}

impl<St: Store> Shared<St> {
    /// The state machine of a keyed request, up to the claim. Without `key` (no header carried
    /// one), the key is looked for in the body; a request that has none after all goes to the
    /// inner service as it would have without a key route.
    async fn keyed<S, RB>(
        self: Arc<Self>,
        route: Arc<RouteState>,
        inner: S,
        (key, grpc): (Option<IdempotencyKey>, bool),
        req: Request<Body>,
        unanswered: &Unanswered<'_>,
    ) -> Finished<S::Error>
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        use Outcome::rejected_invalid;
        let policy = route.policy.clone();
        let (parts, body) = req.into_parts();
        let format = grpc::error_format(grpc, policy.error_format);
        let body = match whole_body(body, grpc, key.is_some(), &policy).await {
            Ok(body) => body,
            Err(Ok(body)) => {
                unanswered.decided(Outcome::passthrough);
                if grpc && key.is_some() {
                    // Its key cannot be applied: shown, as a retry of it runs again.
                    self.metrics.grpc_streaming_keyed(&policy.route);
                }
                let req = Request::from_parts(parts, body);
                let passed = self.pass_through(inner, req).await;
                return passed.ended(Outcome::passthrough);
            }
            Err(Err(e)) => return Finished::refused(rejected_invalid, e, format),
        };
        let found = match find_key(&policy, &parts, &body, key) {
            Ok(found) => found,
            Err(e) => return Finished::refused(rejected_invalid, e, format),
        };
        let Some((key, source)) = found.key else {
            drop(found.doc);
            unanswered.decided(Outcome::passthrough);
            let req = Request::from_parts(parts, Body::from(body));
            let passed = self.pass_through(inner, req).await;
            return passed.ended(Outcome::passthrough);
        };
        Span::current().record("key", key.short_hash());
        Span::current().record("key_source", source.as_str());
        let held = Held {
            who: Claimant {
                key: key.scoped(&parts.headers, &route.scope_headers, &policy.scope_cookies),
                fingerprint: Fingerprint::for_policy(&parts, &body, found.doc.as_ref(), &policy),
                token: Token::random(),
            },
            policy: policy.clone(),
            client_key: key,
            source,
            format,
        };
        drop(found.doc);
        let lease = Lease::new(self.clone(), held);
        let claim = match self.claim_waiting(&route, &lease, &parts.headers).await {
            Ok(claim) => claim,
            Err(attached) => return attached,
        };
        match claim {
            Err(e) => self.without_store(e, &lease.held, inner, parts, body).await,
            Ok(Claim::Mismatch) => {
                let status = policy.mismatch_status;
                Finished::refused(Outcome::mismatch, GatewayError::Mismatch { status }, format)
            }
            Ok(Claim::InFlight) => {
                Finished::refused(Outcome::in_flight_conflict, IN_FLIGHT, format)
            }
            Ok(Claim::NotReplayable) => {
                Finished::refused(Outcome::not_replayable, GatewayError::NotReplayable, format)
            }
            Ok(Claim::Expired {
                tombstone,
                recorded_ms,
            }) => {
                let expired = GatewayError::KeyExpired {
                    status: tombstone.status,
                    recorded_ms,
                    expired_ms: tombstone.expired_ms,
                };
                Finished::refused(Outcome::expired, expired, format)
            }
            Ok(Claim::Replay(replay)) => self.replayed(&replay, &parts, &lease.held),
            Ok(Claim::Claimed) => {
                unanswered.decided(Outcome::miss);
                self.run_in_task(lease, inner, parts, body).await
            }
        }
    }

    /// Claim the key. A duplicate of an in-flight request may wait for it (`on_in_flight =
    /// "wait"`), looking at the store again until it can answer, or attach to its answer
    /// streaming in this process (`Err`: the attached answer).
    async fn claim_waiting<E>(
        &self,
        route: &Arc<RouteState>,
        lease: &Lease<St>,
        headers: &http::HeaderMap,
    ) -> Result<Result<Claim, StoreError>, Finished<E>> {
        let mut waiter = Waiter::new(route.clone());
        // A duplicate on a streamed route that waits attaches to a live answer.
        let policy = &lease.held.policy;
        let attaches = policy.stream && policy.on_in_flight == OnInFlight::Wait;
        loop {
            match lease.claim().await {
                Ok(Claim::InFlight) => {
                    // Made before the try to attach: an answer offered after it wakes the wait.
                    let offered = attaches.then(|| self.live.offered(&lease.held.who.key));
                    if attaches {
                        if let Some(attached) = self.attach(&mut waiter, &lease.held, headers) {
                            return Err(attached);
                        }
                    }
                    let offered = async {
                        match offered {
                            Some(offered) => offered.await,
                            None => std::future::pending().await,
                        }
                    };
                    if !waiter.look_again(lease, offered).await {
                        return Ok(Ok(Claim::InFlight));
                    }
                }
                claim => return Ok(claim),
            }
        }
    }

    /// The store gave no usable answer to the claim. A record this build cannot read is refused
    /// (never run again); otherwise the route's `on_store_error` refuses the request or forwards
    /// it without idempotency.
    async fn without_store<S, RB>(
        &self,
        e: StoreError,
        held: &Held,
        inner: S,
        parts: Parts,
        body: Bytes,
    ) -> Finished<S::Error>
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        let route = &held.policy.route;
        if let StoreError::Unreadable(e) = &e {
            self.metrics.unreadable(e.reason());
            let key_id = e.key_id().unwrap_or("-");
            error!(error = %e, reason = e.reason(), key_id, %route, key = %held.tag(), "stored record cannot be opened; refused, neither replayed nor run again (evict the key through the admin API to let it run again)");
            return Finished::refused(
                Outcome::store_error,
                GatewayError::RecordUnreadable,
                held.format,
            );
        }
        if let StoreError::Decode(e) = &e {
            error!(error = %e, %route, key = %held.tag(), "stored record cannot be decoded; refused (evict the key through the admin API to let it run again)");
            return Finished::refused(
                Outcome::store_error,
                GatewayError::CorruptRecord,
                held.format,
            );
        }
        if matches!(e, StoreError::NotAcknowledged { .. }) {
            self.metrics.unacknowledged(StoreOp::claim);
        }
        match held.policy.on_store_error {
            OnStoreError::Reject => {
                error!(error = %e, %route, key = %held.tag(), "store unavailable; refusing the keyed request (on_store_error = reject)");
                Finished::refused(
                    Outcome::store_error,
                    GatewayError::StoreUnavailable,
                    held.format,
                )
            }
            OnStoreError::Pass => {
                warn!(error = %e, %route, key = %held.tag(), "store unavailable; forwarding WITHOUT idempotency (on_store_error = pass)");
                self.metrics.store_error_passed();
                let req = Request::from_parts(parts, Body::from(body));
                self.pass_through(inner, req)
                    .await
                    .ended(Outcome::store_error)
            }
        }
    }

    /// The stored response, replayed to the request `parts` (an event stream from after its
    /// `Last-Event-ID`); refused when its record is damaged (its body disagrees with its
    /// Content-Length).
    fn replayed<E>(&self, replay: &Replay, parts: &Parts, held: &Held) -> Finished<E> {
        let stored = &replay.response;
        if !response::framed(stored, parts.method == Method::HEAD) {
            error!(route = %held.policy.route, key = %held.tag(), "stored record is damaged (its body disagrees with its Content-Length); refused (evict the key through the admin API to let it run again)");
            return Finished::refused(
                Outcome::store_error,
                GatewayError::CorruptRecord,
                held.format,
            );
        }
        if let Some(original) = &stored.traceparent {
            let span = Span::current();
            if let Ok(trace) = original.to_str() {
                span.record("original_trace", trace);
            }
            trace::link(&span, original);
        }
        let from = sse::resume_at(stored, &stored.body, sse::last_event_id(&parts.headers));
        self.metrics.replayed_bytes(stored.body.len() - from);
        let lives = replay.expires_in;
        Finished {
            outcome: Outcome::replayed,
            answer: Ok(response::replay(stored, &held.policy, lives, from)),
            inner_time: Duration::ZERO,
            forwarded: false,
        }
    }

    /// A duplicate attached to the answer its key's holder is streaming in this process (on a
    /// route with `stream = true` and `on_in_flight = "wait"`): the head and every byte so far
    /// at once, then the rest as it comes (an event stream from after its `Last-Event-ID`).
    /// `None` when no such answer is live here.
    fn attach<E>(
        &self,
        waiter: &mut Waiter,
        held: &Held,
        headers: &http::HeaderMap,
    ) -> Option<Finished<E>> {
        let policy = &held.policy;
        let last_event_id = sse::last_event_id(headers);
        let (key, fingerprint) = (&held.who.key, &held.who.fingerprint);
        let permit = || waiter.permit();
        let (tape, reader) = self.live.attach(key, fingerprint, last_event_id, permit)?;
        debug!("attached to the live answer");
        let resumes = reader.resumes();
        let body = reader.into_body();
        let answer = response::attached(&tape.head, body, policy, tape.lives, resumes);
        Some(Finished {
            outcome: Outcome::replayed,
            answer: Ok(answer),
            inner_time: Duration::ZERO,
            forwarded: false,
        })
    }

    /// Run a claimed call in a task of its own, so that a client that disconnects does not
    /// cancel it: the call completes and its response is recorded for the retry. The tracker
    /// lets a graceful shutdown wait for it.
    async fn run_in_task<S, RB>(
        self: &Arc<Self>,
        lease: Lease<St>,
        inner: S,
        parts: Parts,
        body: Bytes,
    ) -> Finished<S::Error>
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let format = lease.held.format;
        let this = self.clone();
        let work = async move {
            let _in_flight = InFlight::count(&this.metrics);
            let run = async {
                let (forwarded, tail) = this.run_claimed(inner, &lease, parts, body).await;
                if tx.send(forwarded).is_err() {
                    debug!("client went away; the response is recorded for its retry");
                }
                if let Some(tail) = tail {
                    this.record_stream(&lease, tail).await;
                }
            };
            // A defect must not take the key with it: the call's outcome is unknown, so the
            // key is left to its lease (counted as unsettled) and the client gets a 500.
            if let Err(panic) = std::panic::AssertUnwindSafe(run).catch_unwind().await {
                let route = &lease.held.policy.route;
                error!(%route, key = %lease.held.tag(), panic = crate::error::panic_message(&*panic), "the claimed call's task failed; the key stays claimed until its lease ends");
                this.metrics.unsettled(route, Unsettled::failed);
            }
        };
        // No span of its own at info level (its cost shows on the miss path); its warnings
        // name the route and key themselves.
        self.tasks.spawn(work.in_current_span());
        let forwarded = rx.await.unwrap_or_else(|_| Forwarded {
            // The task ended without an answer: it failed, or the runtime is going away.
            answer: Ok(GatewayError::Internal.respond(format)),
            took: Duration::ZERO,
        });
        forwarded.ended(Outcome::miss)
    }

    /// The state machine of a claimed key: call the inner service while holding the lease, then
    /// record; with the time the call took, and a streamed answer's body still to record.
    async fn run_claimed<S, RB>(
        &self,
        inner: S,
        lease: &Lease<St>,
        parts: Parts,
        body: Bytes,
    ) -> (Forwarded<S::Error>, Option<Tail>)
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        let (held, policy) = (&*lease.held, &*lease.held.policy);
        let format = held.format;
        // The record keeps the trace of this execution: this request's own span when it is
        // recorded as an OTel span, else the client's traceparent, as it was forwarded.
        let traceparent = trace::traceparent_of(&Span::current())
            .or_else(|| parts.headers.get(TRACEPARENT).cloned());
        let is_head = parts.method == Method::HEAD;
        let req = Request::from_parts(parts, Body::from(body));
        let (called, took) = self.call_by_deadline(inner, lease, req).await;
        // From here on the lease is no longer renewed.
        let mut tail = None;
        // A call that ends in failure at its deadline timed out, whoever noticed first.
        let timed_out = took >= policy.upstream_timeout;
        let unsettled = || {
            let reason = match timed_out {
                true => Unsettled::timeout,
                false => Unsettled::failed,
            };
            self.metrics.unsettled(&policy.route, reason);
        };
        let answer = match called {
            None => {
                // The inner service may still be executing: keep the claim until its lease ends.
                warn!(route = %policy.route, key = %held.tag(), timeout = ?policy.upstream_timeout, "upstream timed out; key stays claimed until its lease ends");
                unsettled();
                Ok(GatewayError::UpstreamTimeout.respond(format))
            }
            Some(Called::NotSent(e)) => {
                warn!(route = %policy.route, key = %held.tag(), error = %e, "upstream unreachable; nothing was sent");
                lease.release().await;
                Err(e)
            }
            Some(Called::Failed(e)) if timed_out => {
                // The inner service gave up at the same deadline (the proxy's own timeout).
                warn!(route = %policy.route, key = %held.tag(), timeout = ?policy.upstream_timeout, error = %e, "upstream timed out; key stays claimed until its lease ends");
                unsettled();
                Err(e)
            }
            Some(Called::Failed(e)) => {
                warn!(route = %policy.route, key = %held.tag(), error = %e, "upstream failed after the request may have been sent; key stays claimed until its lease ends");
                unsettled();
                Err(e)
            }
            Some(Called::BodyFailed) => {
                unsettled();
                Ok(GatewayError::Upstream.respond(format))
            }
            Some(Called::NotFinal(status)) => {
                warn!(route = %policy.route, key = %held.tag(), %status, "inner service answered with no final response; key stays claimed until its lease ends");
                unsettled();
                Ok(GatewayError::UpstreamInvalidResponse(status.as_u16()).respond(format))
            }
            Some(Called::Transient(resp)) => {
                lease.release().await;
                Ok(resp)
            }
            Some(Called::Whole(head, body, keep)) => {
                let stored = Arc::new(StoredResponse::new(head, body, traceparent, held.source));
                if response::framed(&stored, is_head) {
                    lease
                        .complete(&EntryState::Completed(stored.clone()), keep)
                        .await;
                    Ok(response::first(&stored, policy, keep.ttl))
                } else {
                    // A response that would be sent with a wrong length: not recorded, not sent.
                    error!(route = %policy.route, key = %held.tag(), "response length disagrees with its Content-Length; not recorded, key stays claimed until its lease ends");
                    unsettled();
                    Ok(GatewayError::Upstream.respond(format))
                }
            }
            Some(Called::TooLarge(head, read, rest, keep)) => {
                lease.complete(&EntryState::NotReplayable, keep).await;
                Ok(response::streamed_once(head, read, rest, policy, keep.ttl))
            }
            Some(Called::Streamed(head, body, ttl)) => {
                let (first, streamed) =
                    self.stream_on(held, (head, is_head), traceparent, (body, ttl));
                tail = Some(streamed);
                Ok(first)
            }
        };
        (Forwarded { answer, took }, tail)
    }

    /// Call the inner service with the route's deadline, holding the lease meanwhile: what the
    /// call came to (`None`: no answer by the deadline), and how long it took.
    async fn call_by_deadline<S, RB>(
        &self,
        inner: S,
        lease: &Lease<St>,
        mut req: Request<Body>,
    ) -> (Option<Called<S::Error>>, Duration)
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        let (held, policy) = (&*lease.held, &*lease.held.policy);
        let upstream = debug_span!("upstream", otel.kind = "client", upstream = %policy.upstream);
        trace::inject(&upstream, req.headers_mut());
        let started = Instant::now();
        // The inner service gets the same deadline: when it says "not sent" at that very
        // moment (it waited for a connection), its answer wins over the timeout.
        let deadline = crate::time::after(started, policy.upstream_timeout);
        req.extensions_mut().insert(Deadline(deadline));
        let called = tokio::select! {
            biased;
            called = self.call(inner, req, held).instrument(upstream) => Some(called),
            () = tokio::time::sleep_until(deadline) => None,
            never = lease.hold() => match never {},
        };
        let took = started.elapsed();
        self.metrics.upstream(took);
        (called, took)
    }

    /// Call the inner service and read as much of the response as the decision needs.
    async fn call<S, RB>(&self, inner: S, req: Request<Body>, held: &Held) -> Called<S::Error>
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        let policy = &*held.policy;
        let grpc = grpc::is_call(req.version(), req.headers());
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
        // A gRPC call's status comes in the trailers: decided once the body is read.
        let later = grpc && grpc::status_follows(&head);
        let now = (!later).then(|| response::recorded_for(&mut head, None, grpc, policy));
        if let Some(None) = now {
            return Called::Transient(Response::from_parts(head, body));
        }
        // On a streamed route the answer goes on as it comes (a gRPC call's status, which
        // follows its messages, decides at its end).
        if policy.stream {
            let ttl = match now.flatten() {
                Some(ttl) => StreamTtl::Known(ttl),
                None => StreamTtl::AtEnd(Terms::take(&mut head)),
            };
            return Called::Streamed(head, body, ttl);
        }
        match collect_capped(body, policy.max_body).await {
            Ok(Collected::Whole(body, trailers)) => {
                let ttl = now
                    .flatten()
                    .or_else(|| response::recorded_for(&mut head, trailers.as_ref(), grpc, policy));
                match ttl {
                    Some(ttl) => Called::Whole(head, (body, trailers), ttl),
                    None => {
                        Called::Transient(Response::from_parts(head, with_trailers(body, trailers)))
                    }
                }
            }
            // Too large to wait for a gRPC call's status: recorded as not replayable, as
            // any answer too large is (unless it says no-store).
            Ok(Collected::TooLarge { read, rest }) => {
                match now
                    .flatten()
                    .or_else(|| response::recorded_for(&mut head, None, false, policy))
                {
                    Some(ttl) => Called::TooLarge(head, read, rest, ttl),
                    None => {
                        Called::Transient(Response::from_parts(head, replay_then_rest(read, rest)))
                    }
                }
            }
            Err(e) => {
                warn!(route = %policy.route, key = %held.tag(), error = %e, "upstream response body failed midway; key stays claimed until its lease ends");
                Called::BodyFailed
            }
        }
    }

    /// Hand a request idempotency does not apply to to the inner service; with the time it took
    /// to answer.
    async fn pass_through<S, RB>(&self, inner: S, req: Request<Body>) -> Forwarded<S::Error>
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        let started = Instant::now();
        let answer = inner.oneshot(req).await.map(relayed);
        let took = started.elapsed();
        self.metrics.upstream(took);
        Forwarded { answer, took }
    }
}

/// A keyed request's `body` read whole (a gRPC call's as the unary rule reads it), or what
/// becomes of it instead: passed on without idempotency (a streaming gRPC call; a body too large
/// to look for a key in when no header carried one), or refused.
async fn whole_body(
    body: Body,
    grpc: bool,
    has_key: bool,
    policy: &Policy,
) -> Result<Bytes, Result<Body, GatewayError>> {
    let collected = if grpc {
        match grpc::collect_call(body, policy.max_body).await {
            Ok(grpc::Call::Unary(collected)) => Ok(collected),
            Ok(grpc::Call::Streaming { read, rest }) => {
                return Err(Ok(replay_then_rest(read, rest)))
            }
            Err(e) => Err(e),
        }
    } else {
        collect_capped(body, policy.max_body).await
    };
    match collected {
        Ok(Collected::Whole(body, _)) => Ok(body),
        Ok(Collected::TooLarge { read, rest }) if !has_key && !policy.require_key => {
            Err(Ok(replay_then_rest(read, rest)))
        }
        Ok(Collected::TooLarge { .. }) => Err(Err(GatewayError::BodyTooLarge {
            limit: policy.max_body,
        })),
        Err(_) => Err(Err(GatewayError::InvalidBody)),
    }
}

/// A keyed request's body as the protocol reads it before the claim.
struct Found<'b> {
    // The body parsed as JSON, when something needs it: a canonical fingerprint, or a key that
    // no header carried.
    doc: Option<Json<'b>>,
    // The key and where it came from; none when neither a header nor the body carries one.
    key: Option<(IdempotencyKey, KeySource)>,
}

/// The key of a request, from `key` (a header's) or else from its `body`; refused when the body
/// does not parse as the JSON its type says, or when the route requires a key and there is none.
fn find_key<'b>(
    policy: &Policy,
    parts: &Parts,
    body: &'b [u8],
    key: Option<IdempotencyKey>,
) -> Result<Found<'b>, GatewayError> {
    let json_typed = parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|ct| json::is_json_type(ct.as_bytes()));
    let doc = if json_typed && (policy.fingerprint == FingerprintMode::Json || key.is_none()) {
        Some(json::parse(body).map_err(|e| GatewayError::InvalidJson(e.0))?)
    } else {
        None
    };
    let key = match key {
        Some(key) => Some((key, KeySource::Header)),
        None => match body_key(policy, doc.as_ref())? {
            None if policy.require_key => return Err(GatewayError::MissingKey),
            found => found,
        },
    };
    Ok(Found { doc, key })
}

/// The key a JSON body carries (`key_from_body`), or else the one derived from its fields
/// (`derived_key`); `None` when neither is there (or the body is not JSON).
fn body_key(
    policy: &Policy,
    doc: Option<&Json<'_>>,
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
