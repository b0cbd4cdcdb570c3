//! The life cycle of a claim this layer holds: asked for under a drop guard ([`PendingClaim`]),
//! its lease renewed while the inner service runs, then completed (sent again in the background
//! when the store did not record it), released, or taken back when its answer was lost. Every
//! store operation on it is fenced by the claim's token: a holder whose lease ran out changes
//! nothing.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, error, warn};

use super::metrics::{StoreOp, Unsettled};
use super::shared::Shared;
use crate::record::key::{IdempotencyKey, KeySource};
use crate::record::policy::{ErrorFormat, Policy};
use crate::record::EntryState;
use crate::store::{Claim, ClaimTerms, Claimant, Keep, Store, StoreError, Watch};

/// A claim on a key: what fences its store operations (key, token), what it records
/// (fingerprint, under the route's policy), and what its warnings name (route, key tag).
pub(super) struct Held {
    // The key, the request's fingerprint and the claim's token.
    pub(super) who: Claimant,
    // The route's policy: its name, lease and ttls.
    pub(super) policy: Arc<Policy>,
    // The client's key, logged only as a short hash.
    pub(super) client_key: IdempotencyKey,
    // Where the key came from, kept with the record.
    pub(super) source: KeySource,
    // The shape of the gateway's own answers to this request (a gRPC status to a gRPC call).
    pub(super) format: ErrorFormat,
    // A keyed JSON-RPC call: its id and how its answers are read and replayed.
    pub(super) jsonrpc: Option<Arc<super::jsonrpc::Call>>,
}

impl Held {
    /// The key as logs show it.
    pub(super) fn tag(&self) -> String {
        self.client_key.short_hash()
    }
}

/// A claim and the layer's store, metrics and background tasks it is carried out with. Cheap
/// to clone: the background re-send of a completion and the drop guard keep a clone.
pub(super) struct Lease<St> {
    shared: Arc<Shared<St>>,
    pub(super) held: Arc<Held>,
    // When the lease last started: its claim, or its last renewal (as asked: the store's own
    // "now" comes after). Renewals keep one schedule from it across every wait that holds the
    // lease (the head's, then a streamed body's).
    renewed: Arc<Mutex<Instant>>,
}

impl<St> Clone for Lease<St> {
    fn clone(&self) -> Self {
        Lease {
            shared: self.shared.clone(),
            held: self.held.clone(),
            renewed: self.renewed.clone(),
        }
    }
}

impl<St: Store> Lease<St> {
    pub(super) fn new(shared: Arc<Shared<St>>, held: Held) -> Self {
        Lease {
            shared,
            held: Arc::new(held),
            renewed: Arc::new(Mutex::new(Instant::now())),
        }
    }

    fn renewed(&self) -> std::sync::MutexGuard<'_, Instant> {
        self.renewed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ask the store for the key. From here until the store's answer is in hand, the claim may
    /// be applied without this request knowing: if the request goes away (the client hung up)
    /// or the answer is lost (a timeout), the guard takes the claim back so that it does not
    /// sit in flight for a lease with nobody working on it. A record this build cannot read is
    /// an answer all the same.
    pub(super) async fn claim(&self) -> Result<Claim, StoreError> {
        let (shared, held) = (&self.shared, &self.held);
        let pending = PendingClaim::arm(self);
        *self.renewed() = Instant::now();
        let terms = ClaimTerms {
            lease: held.policy.lock_ttl,
            after_expiry: held.policy.after_expiry,
        };
        let claim = shared.store.claim(&held.who, terms);
        let claim = shared.timed(StoreOp::claim, claim).await;
        match &claim {
            Ok(_) | Err(StoreError::Decode(_) | StoreError::Unreadable(_)) => pending.disarm(),
            Err(_) => drop(pending),
        }
        claim
    }

    /// A subscription to changes of the key (a completion or a release by its holder), when
    /// the store offers one.
    pub(super) async fn watch(&self) -> Option<Watch> {
        self.shared.store.watch(&self.held.who.key).await
    }

    /// Renew the lease every third of its length for as long as this future is polled, a
    /// third of a lease after it last started (its claim, or the last renewal of any earlier
    /// hold): so a hold that begins late in a period renews at once. Never returns: when the
    /// lease is lost (a newer claim exists, or it ran out while the store could not be
    /// reached), renewing stops; the completion then records the answer only if no newer claim
    /// took the key meanwhile.
    pub(super) async fn hold(&self) -> std::convert::Infallible {
        let held = &self.held;
        let (route, lock_ttl) = (&held.policy.route, held.policy.lock_ttl);
        let every = (lock_ttl / 3).max(Duration::from_millis(10));
        let mut next = crate::time::after(*self.renewed(), every);
        loop {
            tokio::time::sleep_until(next).await;
            let asked = Instant::now();
            next = crate::time::after(asked, every);
            let renew = self.shared.store.renew(&held.who, lock_ttl);
            match self.shared.timed(StoreOp::renew, renew).await {
                Ok(true) => {
                    *self.renewed() = asked;
                    debug!(%route, key = %held.tag(), "lease renewed")
                }
                Ok(false) => {
                    warn!(%route, key = %held.tag(), "lease lost while the upstream was running; the answer is recorded only if no newer claim took the key");
                    return std::future::pending().await;
                }
                Err(e) => {
                    warn!(%route, key = %held.tag(), error = %e, "lease renewal failed; retrying")
                }
            }
        }
    }

    /// Record `state` for `ttl`; when the store does not answer (or no replica acknowledges
    /// the write), the response is delivered anyway and the completion sent again in the
    /// background until the store answers.
    pub(super) async fn complete(&self, state: &EntryState, keep: Keep) {
        let (shared, held) = (&self.shared, &self.held);
        let route = &held.policy.route;
        if matches!(state, EntryState::NotReplayable) {
            shared.metrics.not_replayable(route);
            warn!(%route, key = %held.tag(), max_body = held.policy.max_body, "response larger than the route's max_body: recorded as not replayable, a retry of this key gets 409 not-replayable");
        }
        let complete = shared.store.complete(&held.who, state, keep);
        match shared.timed(StoreOp::complete, complete).await {
            Ok(true) => {}
            Ok(false) => self.unrecorded("a newer claim holds the key"),
            Err(e) => {
                if matches!(e, StoreError::NotAcknowledged { .. }) {
                    shared.metrics.unacknowledged(StoreOp::complete);
                }
                warn!(%route, key = %held.tag(), error = %e, "store did not record the response (or no replica acknowledged it); delivered anyway, sent again in the background until the store answers");
                let (this, state) = (self.clone(), state.clone());
                shared
                    .tasks
                    .spawn(async move { this.complete_again(&state, keep).await });
            }
        }
    }

    /// Send a completion again until the store answers (a stall, a failover in progress, a
    /// restart) and the replicas acknowledge it. The lease may run out meanwhile: the store
    /// still records the answer when no newer claim took the key, so a retry that arrives once
    /// the store is back replays it. Sending stops once the record would have expired anyway
    /// (its ttl, at least a lease, after the first try); fenced by the token, and a completion
    /// already there counts as done.
    async fn complete_again(&self, state: &EntryState, keep: Keep) {
        let held = &self.held;
        let route = &held.policy.route;
        let lasts = keep.ttl.clamped().max(held.policy.lock_ttl);
        let until = crate::time::after(Instant::now(), lasts);
        let mut unsent = Unrecorded::arm(self);
        let mut delay = Duration::from_millis(100);
        let mut written = false;
        while Instant::now() + delay < until {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(RESEND_AT_MOST);
            let complete = self.shared.store.complete(&held.who, state, keep);
            match complete.await {
                Ok(true) => {
                    unsent.disarm();
                    tracing::info!(%route, key = %held.tag(), "response recorded on a later try");
                    return;
                }
                Ok(false) => {
                    unsent.disarm();
                    self.unrecorded(
                        "a newer claim took the key while the store could not be reached",
                    );
                    return;
                }
                Err(e) => {
                    written |= matches!(e, StoreError::NotAcknowledged { .. });
                    debug!(%route, key = %held.tag(), error = %e, "recording the response failed again");
                }
            }
        }
        if written {
            unsent.disarm();
            warn!(%route, key = %held.tag(), "response recorded, but no replica acknowledged it before its record would have expired; a failover now could lose it");
        }
    }

    /// Count and log a call whose answer was delivered but not recorded: a retry of its key
    /// runs again.
    fn unrecorded(&self, why: &str) {
        let (held, route) = (&self.held, &self.held.policy.route);
        self.shared.metrics.unsettled(route, Unsettled::unrecorded);
        error!(%route, key = %held.tag(), why, "response delivered but not recorded; a retry of this key runs again");
    }

    /// Let the key go, so that a retry runs at once.
    pub(super) async fn release(&self) {
        let held = &self.held;
        let release = self.shared.store.release(&held.who);
        if let Err(e) = self.shared.timed(StoreOp::release, release).await {
            warn!(route = %held.policy.route, key = %held.tag(), error = %e, "store failed to release the key; it stays claimed until its lease ends")
        }
    }

    /// Take back a claim whose answer was lost. It may still be applied after the error: stuck
    /// behind a stalled Redis, or sent on a connection that was replaced while the release goes
    /// on the new one, so that Redis may run the two in either order. So the release is tried
    /// again as Redis recovers: six tries, 0.1 s apart doubling (3.1 s of pauses), until one
    /// removes the claim. Fenced by the token: it never removes anyone else's claim.
    async fn take_back(&self) {
        let held = &self.held;
        let mut delay = Duration::from_millis(100);
        for attempt in 0..6 {
            if attempt > 0 {
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            if let Ok(true) = self.shared.store.release(&held.who).await {
                debug!(route = %held.policy.route, key = %held.tag(), "claim with a lost answer taken back");
                return;
            }
        }
    }
}

/// Armed while a claim's answer is awaited: dropped armed (the request's future was dropped, or
/// the store failed to answer), it takes the claim back in a task of its own, fenced by the token,
/// since the claim may have been applied all the same.
struct PendingClaim<St: Store> {
    armed: Option<Lease<St>>,
}

impl<St: Store> PendingClaim<St> {
    fn arm(lease: &Lease<St>) -> Self {
        PendingClaim {
            armed: Some(lease.clone()),
        }
    }

    /// The store answered: whatever it said, this request acts on it.
    fn disarm(mut self) {
        self.armed = None;
    }
}

impl<St: Store> Drop for PendingClaim<St> {
    fn drop(&mut self) {
        if let Some(lease) = self.armed.take() {
            // Outside a runtime (a test dropping a future at exit) there is nothing to run it on;
            // the claim then ends with its lease.
            if tokio::runtime::Handle::try_current().is_ok() {
                let tasks = lease.shared.tasks.clone();
                tasks.spawn(async move { lease.take_back().await });
            }
        }
    }
}

/// How long a completion is sent again at most between tries.
const RESEND_AT_MOST: Duration = Duration::from_millis(500);

/// Armed while a completion is sent again in the background: dropped armed (the gateway shut
/// down before the store answered), the call counts as unrecorded.
struct Unrecorded<'a, St: Store> {
    armed: Option<&'a Lease<St>>,
}

impl<'a, St: Store> Unrecorded<'a, St> {
    fn arm(lease: &'a Lease<St>) -> Self {
        Unrecorded { armed: Some(lease) }
    }

    fn disarm(&mut self) {
        self.armed = None;
    }
}

impl<St: Store> Drop for Unrecorded<'_, St> {
    fn drop(&mut self) {
        if let Some(lease) = self.armed.take() {
            lease.unrecorded("the store did not answer before the record would have expired, or the gateway stopped first");
        }
    }
}
