//! Admission: every decision taken on a request before the first await, from its head alone.
//! Idempotency applies or not (the method), the key in a header or none (refused when the
//! route requires one, or looked for in the body), the Repeatable Requests checks, and the
//! format of the layer's own answers. A request is admitted into an [`Admission`]; the keyed
//! path (`keyed.rs`) then runs it.

use std::sync::Arc;

use axum::body::Body;
use http::{Request, Response};
use tokio::time::Instant;

use super::body::ByteBody;
use super::grpc;
use super::inner::Inner;
use super::metrics::Outcome;
use super::outcome::{BoxFuture, Finished, Unanswered};
use super::repeatability;
use super::response::relayed;
use super::routes::RouteState;
use super::shared::Shared;
use crate::error::GatewayError;
use crate::record::key::IdempotencyKey;
use crate::record::policy::ErrorFormat;
use crate::store::Store;

/// What becomes of a request, decided from its head before any await.
pub(super) enum Admission {
    /// Answered by the layer at once, nothing called.
    Refused(Refusal),
    /// Not idempotent: simply the inner service.
    Pass,
    /// The keyed path runs it.
    Keyed(Admitted),
}

/// The layer's own answer to a request refused on admission.
pub(super) struct Refusal {
    pub(super) error: GatewayError,
    pub(super) format: ErrorFormat,
    // A Repeatable Requests request: its answer is marked rejected.
    pub(super) repeatable: bool,
}

/// A request admitted to the keyed path.
pub(super) struct Admitted {
    // The key a header carried; none when the body is to be searched for one.
    pub(super) key: Option<IdempotencyKey>,
    // A gRPC call: its body read as the unary rule reads it, refusals as gRPC statuses.
    pub(super) grpc: bool,
    // A Repeatable Requests request: its answer is marked accepted or rejected.
    pub(super) repeatable: bool,
}

/// Admit `req` on `route`: every decision that needs nothing but the request's head.
pub(super) fn admit(route: &RouteState, req: &Request<Body>) -> Admission {
    let policy = &route.policy;
    let applies = policy.applies_to(req.method());
    let key = if applies {
        IdempotencyKey::from_headers(req.headers(), &route.key_headers, policy.key_max_len)
    } else {
        Ok(None)
    };
    let repeatable = applies && repeatability::is_repeatable(policy, req.headers());
    if applies && policy.webhook.is_some() {
        // A webhook delivery's key is its event id, found once its signature is checked.
        return Admission::Keyed(Admitted {
            key: None,
            grpc: false,
            repeatable: false,
        });
    }
    let grpc = grpc::is_call(req.version(), req.headers());
    let format = super::jsonrpc::error_format(policy, grpc);
    let refused = |error, repeatable| {
        Admission::Refused(Refusal {
            error,
            format,
            repeatable,
        })
    };
    let key = match key {
        Ok(Some(key)) => Some(key),
        // The key may be in the body (a JSON one: never a gRPC call's): the keyed path reads
        // it first.
        Ok(None) if applies && policy.keys_from_body() && !grpc => None,
        Ok(None) if applies && policy.require_key => {
            return refused(GatewayError::MissingKey, false);
        }
        // Not idempotent: simply the inner service.
        Ok(None) => return Admission::Pass,
        Err(e) => return refused(e, repeatable),
    };
    if repeatable {
        let now = std::time::SystemTime::now();
        if let Err(e) = repeatability::check_first_sent(req.headers(), policy.shortest_life(), now)
        {
            return refused(e, true);
        }
    }
    Admission::Keyed(Admitted {
        key,
        grpc,
        repeatable,
    })
}

impl<St: Store> Shared<St> {
    /// Answer a refusal without calling anything, counted as `rejected_invalid` (marked
    /// rejected for a Repeatable Requests request).
    pub(super) fn refuse_now<E>(
        &self,
        route: &RouteState,
        started: Instant,
        refusal: Refusal,
    ) -> BoxFuture<Result<Response<Body>, E>>
    where
        E: Send + 'static,
    {
        let Refusal {
            error: e,
            format,
            repeatable,
        } = refusal;
        let finished = Finished::answered(Outcome::rejected_invalid, e.respond(format));
        Box::pin(std::future::ready(
            self.finish(route, started, repeatable, finished),
        ))
    }

    /// Hand a request idempotency does not apply to to the inner service, counted as a
    /// pass-through. The inner service is called now: it is the one that was polled ready.
    pub(super) fn pass_now<S, RB>(
        self: Arc<Self>,
        route: Arc<RouteState>,
        mut inner: S,
        req: Request<Body>,
        started: Instant,
    ) -> BoxFuture<Result<Response<Body>, S::Error>>
    where
        S: Inner<RB>,
        RB: ByteBody,
    {
        let call = inner.call(req);
        self.metrics.overhead(started.elapsed());
        Box::pin(async move {
            let unanswered = Unanswered::new(&self.metrics);
            unanswered.decided(Outcome::passthrough);
            let called = Instant::now();
            let answer = call.await.map(relayed);
            unanswered.answered();
            self.metrics.upstream(called.elapsed());
            route.metrics.count(Outcome::passthrough);
            answer
        })
    }
}
