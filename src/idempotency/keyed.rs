//! The keyed path: a keyed request's body read, its key found (a header's, or in the body),
//! its fingerprint taken, the key claimed; then what the store's answer says: a refusal, a
//! replay, an attach to a live answer, a wait, or the claimed call (`claimed.rs`).

use std::sync::Arc;
use std::time::Duration;

use super::shared::Shared;
use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Method, Request};
use tokio::time::Instant;
use tower::ServiceExt;
use tracing::{debug, error, warn, Span};

use super::admit::Admitted;
use super::body::ByteBody;
use super::inner::Inner;
use super::jsonrpc::{self, Call, Reading};
use super::lease::{Held, Lease};
use super::metrics::{Outcome, StoreOp};
use super::outcome::{Finished, Forwarded, Unanswered};
use super::request_body::{find_key, whole_body};
use super::response::{self, relayed};
use super::routes::RouteState;
use super::sse;
use super::trace;
use super::wait::Waiter;
use super::webhook;
use crate::error::GatewayError;
use crate::record::fingerprint::Fingerprint;
use crate::record::key::{IdempotencyKey, KeySource};
use crate::record::policy::ErrorFormat;
use crate::record::policy::{OnInFlight, OnStoreError, Policy};
use crate::record::Token;
use crate::store::{Claim, Claimant, Replay, Store, StoreError};

/// The answer to a duplicate of an in-flight request: try again after a second (`Retry-After`).
const IN_FLIGHT: GatewayError = GatewayError::InFlight {
    retry_after: Duration::from_secs(1),
};

/// Who a keyed request is: its key, where the key was found, its fingerprint and, on a JSON-RPC
/// route, its call.
struct Identity {
    key: IdempotencyKey,
    source: KeySource,
    fingerprint: Fingerprint,
    call: Option<Arc<Call>>,
}

impl Identity {
    /// What a request so identified holds when it claims on `route`, recorded on its span.
    fn held(self, route: &RouteState, headers: &HeaderMap, format: ErrorFormat) -> Held {
        let span = Span::current();
        span.record("key", self.key.short_hash());
        span.record("key_source", self.source.as_str());
        if let Some(call) = &self.call {
            call.traced(&span);
        }
        let policy = &route.policy;
        Held {
            who: Claimant {
                key: (self.key).scoped(headers, &route.scope_headers, &policy.scope_cookies),
                fingerprint: self.fingerprint,
                token: Token::random(),
            },
            policy: policy.clone(),
            client_key: self.key,
            source: self.source,
            format,
            jsonrpc: self.call,
        }
    }
}

/// A request the keyed path does not claim for: it goes on without a key, or it is answered.
enum NotKeyed<E> {
    Pass,
    Answered(Box<Finished<E>>),
}

impl<St: Store> Shared<St> {
    /// The state machine of a keyed request, up to the claim. Without a key (no header carried
    /// one), the key is looked for in the body; a request that has none after all goes to the
    /// inner service as it would have without a key route.
    pub(super) async fn keyed<S, RB>(
        self: Arc<Self>,
        route: Arc<RouteState>,
        inner: S,
        admitted: Admitted,
        req: Request<Body>,
        unanswered: &Unanswered<'_>,
    ) -> Finished<S::Error>
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        use Outcome::rejected_invalid;
        let Admitted { key, grpc, .. } = admitted;
        let policy = route.policy.clone();
        let (mut parts, body) = req.into_parts();
        let format = jsonrpc::error_format(&policy, grpc);
        let keyed = key.is_some() || policy.webhook.is_some();
        let body = match whole_body(body, grpc, keyed, &policy).await {
            Ok(body) => body,
            Err(Ok(body)) => {
                self.streaming_grpc(&policy, key.is_some());
                return self.pass_keyless(inner, parts, body, unanswered).await;
            }
            Err(Err(e)) => return Finished::refused(rejected_invalid, e, format),
        };
        let identity = match self.identify(&policy, &mut parts, &body, key, format) {
            Ok(identity) => identity,
            Err(NotKeyed::Pass) => {
                let body = Body::from(body);
                return self.pass_keyless(inner, parts, body, unanswered).await;
            }
            Err(NotKeyed::Answered(finished)) => return *finished,
        };
        let call = identity.call.clone();
        let lease = Lease::new(self.clone(), identity.held(&route, &parts.headers, format));
        let finished = match self.claim_waiting(&route, &lease, &parts.headers).await {
            Ok(claim) => {
                self.answer_claim(claim, lease, inner, parts, body, unanswered)
                    .await
            }
            Err(attached) => attached,
        };
        match call {
            Some(call) => self.answered_call(&policy, &call, finished),
            None => finished,
        }
    }

    /// A JSON-RPC call's answer, with the call's own id, counted by its method and tool.
    fn answered_call<E>(&self, policy: &Policy, call: &Call, finished: Finished<E>) -> Finished<E> {
        let name = call.name.as_deref();
        self.jsonrpc
            .count(&policy.route, &call.method, name, finished.outcome);
        jsonrpc::with_id(&call.id, finished)
    }

    /// What the body says of a keyed request: who it is (its key, the key's source, its
    /// fingerprint, its JSON-RPC call), or that it goes on without a key, or its answer (a
    /// refusal, a swallowed cancellation). A webhook delivery is verified first, and its event's
    /// id is its key.
    fn identify<E>(
        &self,
        policy: &Policy,
        parts: &mut Parts,
        body: &Bytes,
        key: Option<IdempotencyKey>,
        format: ErrorFormat,
    ) -> Result<Identity, NotKeyed<E>> {
        let answered = |finished| NotKeyed::Answered(Box::new(finished));
        let refused = |e| answered(Finished::refused(Outcome::rejected_invalid, e, format));
        if policy.protocol.is_jsonrpc() {
            return match jsonrpc::read(policy, parts, body, key) {
                Reading::Keyed(k) => Ok(Identity {
                    key: k.key,
                    source: k.source,
                    fingerprint: k.fingerprint,
                    call: Some(k.call),
                }),
                Reading::Pass => Err(NotKeyed::Pass),
                Reading::Swallowed => Err(answered(jsonrpc::swallowed())),
                Reading::Refused(e, id) => Err(answered(jsonrpc::refused(
                    Outcome::rejected_invalid,
                    e,
                    id.as_ref(),
                ))),
            };
        }
        let found = webhook::event_key(&self.webhooks, policy, parts, body)
            .and_then(|event| find_key(policy, parts, body, event.or(key)))
            .map_err(refused)?;
        let Some((key, source)) = found.key else {
            return Err(NotKeyed::Pass);
        };
        let fingerprint = Fingerprint::for_policy(parts, body, found.doc.as_ref(), policy);
        Ok(Identity {
            key,
            source,
            fingerprint,
            call: None,
        })
    }

    /// A gRPC call that streams: a key it carries cannot be applied, which is counted, as a
    /// retry of it runs again.
    fn streaming_grpc(&self, policy: &Policy, keyed: bool) {
        if keyed {
            self.metrics.grpc_streaming_keyed(&policy.route);
        }
    }

    /// Forward a keyed request whose key cannot be applied (none found, or a streaming gRPC
    /// call), counted as a pass-through.
    async fn pass_keyless<S, RB>(
        &self,
        inner: S,
        parts: Parts,
        body: Body,
        unanswered: &Unanswered<'_>,
    ) -> Finished<S::Error>
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        unanswered.decided(Outcome::passthrough);
        let req = Request::from_parts(parts, body);
        self.pass_through(inner, req)
            .await
            .ended(Outcome::passthrough)
    }

    /// What the store's answer to the claim says: a refusal, a replay, the request forwarded
    /// without idempotency (the store down), or the claimed call.
    async fn answer_claim<S, RB>(
        self: &Arc<Self>,
        claim: Result<Claim, StoreError>,
        lease: Lease<St>,
        inner: S,
        parts: Parts,
        body: Bytes,
        unanswered: &Unanswered<'_>,
    ) -> Finished<S::Error>
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        let (policy, format) = (&lease.held.policy, lease.held.format);
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
        let lives = replay.expires_in;
        let replied = held
            .jsonrpc
            .as_ref()
            .and_then(|call| jsonrpc::replayed(call, stored, &held.policy, lives));
        match replied {
            Some(Ok(answer)) => return Finished::answered(Outcome::replayed, answer),
            Some(Err(e)) => return Finished::refused(Outcome::rejected_invalid, e, held.format),
            None => {}
        }
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
        let answer = response::replay(stored, &held.policy, lives, from);
        Finished::answered(Outcome::replayed, answer)
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
        Some(Finished::answered(Outcome::replayed, answer))
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
