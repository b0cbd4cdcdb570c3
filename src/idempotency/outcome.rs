//! What a request came to: the inner service's answer, the layer's own, and how each is
//! counted when the request ends. Every part of the protocol (admission, the keyed path, the
//! claimed call) ends in a [`Finished`].

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use axum::body::Body;
use http::Response;
use prometheus_client::metrics::gauge::Gauge;
use tokio::time::Instant;

use super::metrics::{EngineMetrics, Outcome};
use super::repeatability;
use super::routes::RouteState;
use super::shared::Shared;
use crate::error::GatewayError;
use crate::record::policy::ErrorFormat;

/// A boxed, sendable future: the service's and the layer's own.
pub(super) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A response or the inner service's error.
pub(super) type Answer<E> = Result<Response<Body>, E>;

/// The inner service's answer, and how long it took to give it.
pub(super) struct Forwarded<E> {
    pub(super) answer: Answer<E>,
    pub(super) took: Duration,
}

impl<E> Forwarded<E> {
    /// The request ends with this answer, counted as `outcome`.
    pub(super) fn ended(self, outcome: Outcome) -> Finished<E> {
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
pub(super) struct Finished<E> {
    pub(super) outcome: Outcome,
    pub(super) answer: Answer<E>,
    pub(super) inner_time: Duration,
    // Whether the request was handed to the inner service (it may have been processed).
    pub(super) forwarded: bool,
}

impl<E> Finished<E> {
    /// The layer's own answer, with its outcome; nothing was called.
    pub(super) fn refused(outcome: Outcome, e: GatewayError, format: ErrorFormat) -> Self {
        Finished::answered(outcome, e.respond(format))
    }

    /// The layer's own answer (a refusal, a replay), with its outcome; nothing was called.
    pub(super) fn answered(outcome: Outcome, resp: Response<Body>) -> Self {
        Finished {
            outcome,
            answer: Ok(resp),
            inner_time: Duration::ZERO,
            forwarded: false,
        }
    }
}

impl<St> Shared<St> {
    /// Count what a request came to on its route, with the layer's overhead (the inner
    /// service's time left out), and mark a Repeatable Requests answer accepted or rejected.
    pub(super) fn finish<E>(
        &self,
        route: &RouteState,
        started: Instant,
        repeatable: bool,
        finished: Finished<E>,
    ) -> Answer<E> {
        route.metrics.count(finished.outcome);
        self.metrics
            .overhead(started.elapsed().saturating_sub(finished.inner_time));
        let mut answer = finished.answer;
        if let (true, Ok(resp)) = (repeatable, &mut answer) {
            // Accepted whenever the request may have been processed: forwarded (a miss, or
            // without idempotency when the store was down), or answered by a replay.
            let accepted = finished.forwarded || finished.outcome == Outcome::replayed;
            repeatability::mark(resp.headers_mut(), accepted);
        }
        answer
    }
}

/// A claimed call counted in `idemgate_in_flight_claims` for as long as it lives: the gauge goes
/// down however the call's task ends (a panic, a shutdown that drops it).
pub(super) struct InFlight(Gauge);

impl InFlight {
    /// Count one more claimed call in flight, until the guard is dropped.
    pub(super) fn count(metrics: &EngineMetrics) -> Self {
        let gauge = metrics.in_flight().clone();
        gauge.inc();
        InFlight(gauge)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A request whose answer is not given yet: dropped before [`answered`](Self::answered) (its
/// client went away and the server dropped the request), it counts the request in
/// `idemgate_client_disconnects_total` with the outcome it had come to, `undecided` before that.
pub(super) struct Unanswered<'m> {
    metrics: &'m EngineMetrics,
    // 0: undecided; else the index in `Outcome::ALL` plus one.
    decided: AtomicU8,
    answered: bool,
}

impl<'m> Unanswered<'m> {
    pub(super) fn new(metrics: &'m EngineMetrics) -> Self {
        Unanswered {
            metrics,
            decided: Default::default(),
            answered: false,
        }
    }

    /// The request has come to `outcome`, though its answer is still to come.
    pub(super) fn decided(&self, outcome: Outcome) {
        let at = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        self.decided.store(at as u8 + 1, Ordering::Relaxed);
    }

    /// The answer is given: nothing to count.
    pub(super) fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let at = self.decided.load(Ordering::Relaxed) as usize;
        let outcome = at
            .checked_sub(1)
            .and_then(|at| Outcome::ALL.get(at))
            .map_or("undecided", |o| o.as_str());
        self.metrics.disconnected(outcome);
    }
}
