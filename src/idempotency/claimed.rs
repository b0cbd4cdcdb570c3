//! The claimed call: the inner service called while the lease is held, in a task of its own,
//! and what its answer comes to: recorded, released, passed on, or left claimed until the
//! lease ends.

use std::sync::Arc;
use std::time::Duration;

use super::shared::Shared;
use axum::body::Body;
use bytes::Bytes;
use futures_util::FutureExt;
use http::request::Parts;
use http::{Method, Request, Response};
use tokio::time::Instant;
use tower::ServiceExt;
use tracing::{debug, debug_span, error, warn, Instrument, Span};

use super::body::{collect_capped, replay_then_rest, with_trailers, ByteBody, Collected};
use super::grpc;
use super::inner::{is_not_sent, Deadline, Inner};
use super::jsonrpc;
use super::lease::{Held, Lease};
use super::metrics::{Outcome, Unsettled};
use super::outcome::{Answer, Finished, Forwarded, InFlight};
use super::response::{self, Terms, TRACEPARENT};
use super::streamed::{StreamTtl, Streaming, Tail};
use super::trace;
use crate::error::GatewayError;
use crate::headers::is_final_status;
use crate::record::{EntryState, StoredResponse};
use crate::store::{Keep, Store};

/// What the record of a claimed call needs of its execution.
struct Execution {
    // The trace of this execution, kept with the record.
    traceparent: Option<http::HeaderValue>,
    // A HEAD request: its answer has no body, whatever its Content-Length says.
    is_head: bool,
    // The call ended at its deadline: a failure then is a timeout.
    timed_out: bool,
}

impl Execution {
    /// Why a call whose outcome is unknown leaves its key claimed.
    fn unsettled(&self) -> Unsettled {
        match self.timed_out {
            true => Unsettled::timeout,
            false => Unsettled::failed,
        }
    }
}

/// What the inner service's call came to, for a claimed request.
pub(super) enum Called<E> {
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
    Streamed(Streaming),
    /// A JSON-RPC call's answer in an event stream: sent as it comes, its terminal response
    /// recorded (`jsonrpc/answer.rs`).
    JsonRpcStream(jsonrpc::JsonRpcStream),
}

/// What is left to do once the first answer of a streamed response has gone out.
enum Rest {
    /// Read the body onto its tape and record it.
    Tape(Tail),
    /// Relay a JSON-RPC call's event stream and record its terminal response.
    JsonRpc(jsonrpc::StreamTail),
}

impl<St: Store> Shared<St> {
    /// Run a claimed call in a task of its own, so that a client that disconnects does not
    /// cancel it: the call completes and its response is recorded for the retry. The tracker
    /// lets a graceful shutdown wait for it.
    pub(super) async fn run_in_task<S, RB>(
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
                match tail {
                    Some(Rest::Tape(tail)) => this.record_stream(&lease, tail).await,
                    Some(Rest::JsonRpc(tail)) => this.record_jsonrpc(&lease, tail).await,
                    None => {}
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
    ) -> (Forwarded<S::Error>, Option<Rest>)
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        let policy = &*lease.held.policy;
        // The record keeps the trace of this execution: this request's own span when it is
        // recorded as an OTel span, else the client's traceparent, as it was forwarded.
        let traceparent = trace::traceparent_of(&Span::current())
            .or_else(|| parts.headers.get(TRACEPARENT).cloned());
        let is_head = parts.method == Method::HEAD;
        let req = Request::from_parts(parts, Body::from(body));
        let (called, took) = self.call_by_deadline(inner, lease, req).await;
        // From here on the lease is no longer renewed.
        let execution = Execution {
            traceparent,
            is_head,
            // A call that ends in failure at its deadline timed out, whoever noticed first.
            timed_out: took >= policy.upstream_timeout,
        };
        let (answer, tail) = self.settle(lease, called, &execution).await;
        (Forwarded { answer, took }, tail)
    }

    /// What the claimed call's answer comes to: recorded, released, or left claimed until the
    /// lease ends; the client's answer, and a streamed answer's body still to record.
    async fn settle<E: std::fmt::Display>(
        &self,
        lease: &Lease<St>,
        called: Option<Called<E>>,
        execution: &Execution,
    ) -> (Answer<E>, Option<Rest>) {
        let (held, policy, format) = (&*lease.held, &*lease.held.policy, lease.held.format);
        let unsettled = || self.metrics.unsettled(&policy.route, execution.unsettled());
        // The outcome is unknown: the claim is kept until its lease ends.
        let left = |e: GatewayError| {
            unsettled();
            Ok(e.respond(format))
        };
        let answer = match called {
            None => {
                // The inner service may still be executing: keep the claim until its lease ends.
                warn!(route = %policy.route, key = %held.tag(), timeout = ?policy.upstream_timeout, "upstream timed out; key stays claimed until its lease ends");
                left(GatewayError::UpstreamTimeout)
            }
            Some(Called::NotSent(e)) => {
                warn!(route = %policy.route, key = %held.tag(), error = %e, "upstream unreachable; nothing was sent");
                lease.release().await;
                Err(e)
            }
            Some(Called::Failed(e)) => {
                warn_failed(held, execution.timed_out, &e);
                unsettled();
                Err(e)
            }
            Some(Called::BodyFailed) => left(GatewayError::Upstream),
            Some(Called::NotFinal(status)) => {
                warn!(route = %policy.route, key = %held.tag(), %status, "inner service answered with no final response; key stays claimed until its lease ends");
                left(GatewayError::UpstreamInvalidResponse(status.as_u16()))
            }
            Some(Called::Transient(resp)) => {
                lease.release().await;
                Ok(resp)
            }
            Some(Called::Whole(head, body, keep)) => {
                self.complete_whole(lease, head, body, keep, execution)
                    .await
            }
            Some(Called::TooLarge(head, read, rest, keep)) => {
                lease.complete(&EntryState::NotReplayable, keep).await;
                Ok(response::streamed_once(head, read, rest, policy, keep.ttl))
            }
            Some(Called::Streamed(streaming)) => {
                let traceparent = execution.traceparent.clone();
                let (first, tail) = self.stream_on(held, streaming, execution.is_head, traceparent);
                return (Ok(first), Some(Rest::Tape(tail)));
            }
            Some(Called::JsonRpcStream(stream)) => {
                let (first, tail) = stream.start(execution.traceparent.clone());
                return (Ok(first), Some(Rest::JsonRpc(tail)));
            }
        };
        (answer, None)
    }

    /// Record a whole response and answer with it; a response whose length disagrees with its
    /// Content-Length is neither recorded nor sent.
    async fn complete_whole<E>(
        &self,
        lease: &Lease<St>,
        head: http::response::Parts,
        body: (Bytes, Option<http::HeaderMap>),
        keep: Keep,
        execution: &Execution,
    ) -> Answer<E> {
        let (held, policy) = (&*lease.held, &*lease.held.policy);
        let traceparent = execution.traceparent.clone();
        let stored = Arc::new(StoredResponse::new(head, body, traceparent, held.source));
        if response::framed(&stored, execution.is_head) {
            lease
                .complete(&EntryState::Completed(stored.clone()), keep)
                .await;
            Ok(response::first(&stored, policy, keep.ttl))
        } else {
            // A response that would be sent with a wrong length: not recorded, not sent.
            error!(route = %policy.route, key = %held.tag(), "response length disagrees with its Content-Length; not recorded, key stays claimed until its lease ends");
            self.metrics.unsettled(&policy.route, execution.unsettled());
            Ok(GatewayError::Upstream.respond(held.format))
        }
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
            called = self.call_and_read(inner, req, held).instrument(upstream) => Some(called),
            () = tokio::time::sleep_until(deadline) => None,
            never = lease.hold() => match never {},
        };
        let took = started.elapsed();
        self.metrics.upstream(took);
        (called, took)
    }

    /// Call the inner service and read as much of the response as the decision needs.
    async fn call_and_read<S, RB>(
        &self,
        inner: S,
        req: Request<Body>,
        held: &Held,
    ) -> Called<S::Error>
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
        // A JSON-RPC call is judged by its terminal response, whatever the route streams.
        if held.jsonrpc.is_some() {
            return jsonrpc::read_answer(policy, head, body).await;
        }
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
            return Called::Streamed(Streaming { head, body, ttl });
        }
        read_answer(held, head, body, now.flatten(), grpc).await
    }
}

/// A storable response's body read whole to decide on it, or found larger than `max_body`; its
/// keep as `known` from its head, or else from its trailers (a gRPC call's status).
async fn read_answer<E>(
    held: &Held,
    mut head: http::response::Parts,
    body: Body,
    known: Option<Keep>,
    grpc: bool,
) -> Called<E> {
    let policy = &*held.policy;
    match collect_capped(body, policy.max_body).await {
        Ok(Collected::Whole(body, trailers)) => {
            let ttl = known
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
            match known.or_else(|| response::recorded_for(&mut head, None, false, policy)) {
                Some(ttl) => Called::TooLarge(head, read, rest, ttl),
                None => Called::Transient(Response::from_parts(head, replay_then_rest(read, rest))),
            }
        }
        Err(e) => {
            warn!(route = %policy.route, key = %held.tag(), error = %e, "upstream response body failed midway; key stays claimed until its lease ends");
            Called::BodyFailed
        }
    }
}

/// Log a claimed call that failed after its request may have been sent: timed out when the
/// inner service gave up at the route's deadline (the proxy's own timeout).
fn warn_failed(held: &Held, timed_out: bool, e: &dyn std::fmt::Display) {
    let policy = &held.policy;
    if timed_out {
        warn!(route = %policy.route, key = %held.tag(), timeout = ?policy.upstream_timeout, error = %e, "upstream timed out; key stays claimed until its lease ends");
    } else {
        warn!(route = %policy.route, key = %held.tag(), error = %e, "upstream failed after the request may have been sent; key stays claimed until its lease ends");
    }
}
