//! A claimed call's answer on a `stream = true` route: its first answer, read from a new tape
//! that duplicates can attach to, and the recording of the rest once the body has ended (for a
//! gRPC call, as its status in the trailers says).

use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::Response;
use tracing::{error, warn};

use super::lease::{Held, Lease};
use super::live::{OnAir, Tape};
use super::metrics::Unsettled;
use super::response::{self, Terms};
use super::shared::Shared;
use crate::record::{EntryState, StoredResponse};
use crate::store::{Keep, Store};

/// How long a streamed answer is recorded: known from its head, or decided by its trailers (a
/// gRPC call's status), when its body has ended.
pub(super) enum StreamTtl {
    Known(Keep),
    AtEnd(Terms),
}

/// A streamed response as the inner service gave it: its head, and its body still to come.
pub(super) struct Streaming {
    pub(super) head: http::response::Parts,
    pub(super) body: Body,
    // How long it is kept: known from its head, or decided at its end (a gRPC call's status).
    pub(super) ttl: StreamTtl,
}

/// A streamed answer whose head is answered: its body still to be read onto its tape and
/// recorded, while the tape is offered to duplicates.
pub(super) struct Tail {
    tape: Arc<Tape>,
    body: Body,
    ttl: StreamTtl,
    is_head: bool,
    _on_air: OnAir,
}

impl<St: Store> Shared<St> {
    /// The first answer of a streamed response (to a `HEAD` request when `is_head`), read from a new tape offered to duplicates, and what is left to record: the
    /// body onto that tape.
    pub(super) fn stream_on(
        &self,
        held: &Held,
        streaming: Streaming,
        is_head: bool,
        traceparent: Option<http::HeaderValue>,
    ) -> (Response<Body>, Tail) {
        let policy = &*held.policy;
        let Streaming { head, body, ttl } = streaming;
        let head = StoredResponse::new(head, (Bytes::new(), None), traceparent, held.source);
        let head = Arc::new(head);
        let lives = match &ttl {
            StreamTtl::Known(keep) => keep.ttl.finite(),
            StreamTtl::AtEnd(_) => None,
        };
        let tape = Tape::new(head.clone(), held.who.fingerprint, lives, policy.max_body);
        let first = tape.first_reader().into_body();
        let tail = Tail {
            _on_air: self.live.open(held.who.key, &tape),
            tape,
            body,
            ttl,
            is_head,
        };
        (response::first_streamed(&head, first, policy, lives), tail)
    }

    /// Read a streamed answer to its end onto its tape, whether or not anyone still reads it,
    /// holding the lease; then record it (not replayable past `max_body`) and end the tape.
    /// An answer that breaks off midway is not recorded: the key stays claimed until its lease
    /// ends, as for any answer whose body failed.
    pub(super) async fn record_stream(&self, lease: &Lease<St>, tail: Tail) {
        let (held, policy) = (&*lease.held, &*lease.held.policy);
        let Tail {
            tape,
            body,
            ttl,
            is_head,
            ..
        } = tail;
        let copied = tokio::select! {
            biased;
            copied = tape.record_from(body, policy.upstream_timeout) => copied,
            never = lease.hold() => match never {},
        };
        if let Err(e) = copied {
            warn!(route = %policy.route, key = %held.tag(), error = %e, "streamed answer broke off midway; key stays claimed until its lease ends");
            self.metrics.unsettled(&policy.route, e.reason());
            tape.finish(false);
            return;
        }
        let recorded = tape.recorded();
        let ttl = match ttl {
            StreamTtl::Known(keep) => Some(keep),
            // A gRPC call's status, in its trailers (its head had none); past max_body it is too
            // large to wait for, and judged by the HTTP rules, as a buffered one is.
            StreamTtl::AtEnd(terms) => {
                let head = (tape.head.status, &http::HeaderMap::new());
                match &recorded {
                    Some((_, trailers)) => terms.keep(head, trailers.as_ref(), true, policy),
                    None => terms.keep(head, None, false, policy),
                }
            }
        };
        let Some(ttl) = ttl else {
            // Its status says "try again" (or no-store): the key is released, as for a
            // buffered answer.
            lease.release().await;
            tape.finish(true);
            return;
        };
        let state = match recorded {
            Some(rest) => {
                let stored = tape.head.completed(rest);
                if !response::framed(&stored, is_head) {
                    error!(route = %policy.route, key = %held.tag(), "streamed answer's length disagrees with its Content-Length; not recorded, key stays claimed until its lease ends");
                    self.metrics.unsettled(&policy.route, Unsettled::failed);
                    tape.finish(false);
                    return;
                }
                EntryState::Completed(Arc::new(stored))
            }
            None => EntryState::NotReplayable,
        };
        lease.complete(&state, ttl).await;
        tape.finish(true);
    }
}
