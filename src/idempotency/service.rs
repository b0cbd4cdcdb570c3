//! [`Idempotency`]: the state machine of one request, around any inner service, read as
//! "admit, then run": `admit.rs` takes every decision before the first await, `keyed.rs` runs
//! the keyed path up to the claim (`Shared::keyed`), `claimed.rs` the claimed call
//! (`Shared::run_claimed`). The claim's life cycle is in `lease.rs`, what is stored and
//! replayed in `response.rs`, the wait for an in-flight duplicate in `wait.rs`, streamed answers
//! in `streamed.rs` (their tape in `live.rs`).
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
use std::sync::Arc;
use std::task::{Context, Poll};

use super::shared::Shared;
use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use tokio::time::Instant;
use tracing::{debug, debug_span, field, Instrument, Span};

use super::admit::{admit, Admission};
use super::outcome::{BoxFuture, Unanswered};
use super::trace;
use crate::record::policy::Policy;
use crate::store::Store;

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
        let route = shared.table.route_for(req.uri().path());
        let mut req = req.map(Body::new);
        // Only the gateway says a webhook delivery was verified.
        req.headers_mut().remove(super::webhook::WEBHOOK_VERIFIED);
        // The inner service learns the policy applied (the proxy reads its upstream_timeout).
        req.extensions_mut().insert(route.policy.clone());
        let admitted = match admit(&route, &req) {
            Admission::Keyed(admitted) => admitted,
            Admission::Refused(refusal) => return shared.refuse_now(&route, started, refusal),
            Admission::Pass => return shared.pass_now(route, inner, req, started),
        };
        let repeatable = admitted.repeatable;
        let span = request_span(&req, &route.policy);
        Box::pin(async move {
            let unanswered = Unanswered::new(&shared.metrics);
            // Boxed: the keyed path's state machine is deep, and a caller's own future (an axum
            // app's over a Redis store) would otherwise overflow the compiler's layout depth.
            let keyed = shared
                .clone()
                .keyed(route.clone(), inner, admitted, req, &unanswered)
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
            shared.finish(&route, started, repeatable, finished)
        })
    }
}

/// The span of one admitted request. At debug level: at the default `info`, a span per request
/// and its formatted fields would weigh on the replay path (docs/operating.md, "Tracing and
/// logs"). The gateway's `[telemetry]` turns it on for the requests it samples.
fn request_span(req: &Request<Body>, policy: &Policy) -> Span {
    debug_span!(
        trace::REQUEST_SPAN,
        otel.kind = "server",
        method = %req.method(),
        route = %policy.route,
        key = field::Empty,
        key_source = field::Empty,
        outcome = field::Empty,
        status = field::Empty,
        original_trace = field::Empty,
        instance = field::Empty,
        jsonrpc.method = field::Empty,
        jsonrpc.name = field::Empty,
    )
}
