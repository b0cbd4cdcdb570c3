//! The wait of a duplicate for an in-flight request (`on_in_flight = "wait"`): bounded in
//! number by the route's `max_waiters` and in time by its `wait_timeout`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::lease::Lease;
use super::routes::RouteState;
use crate::record::policy::OnInFlight;
use crate::store::{Store, Watch};

/// A duplicate's wait for the request that holds its key, across its looks at the store.
pub(super) struct Waiter {
    // Its route's policy and waiter permits.
    route: Arc<RouteState>,
    // Set once the key is first found in flight and a permit taken.
    waiting: Option<Waiting>,
}

impl Waiter {
    /// Not waiting yet, on `route`.
    pub(super) fn new(route: Arc<RouteState>) -> Self {
        Waiter {
            route,
            waiting: None,
        }
    }

    /// A waiter permit for a duplicate that stops waiting to attach to a live answer: the one
    /// this wait holds, or else one of the route's, if any is free.
    pub(super) fn permit(&mut self) -> Option<OwnedSemaphorePermit> {
        match self.waiting.take() {
            Some(waiting) => Some(waiting._permit),
            None => self.route.waiters.clone().try_acquire_owned().ok(),
        }
    }

    /// The key was found in flight: whether to look again (after waiting for the holder, or
    /// until `offered` ends, when this is not the first look), or to answer "in flight" now
    /// (the route does not wait, its waiters are all taken, or the wait is over).
    pub(super) async fn look_again<St: Store>(
        &mut self,
        lease: &Lease<St>,
        offered: impl Future<Output = ()>,
    ) -> bool {
        if self.route.policy.on_in_flight != OnInFlight::Wait {
            return false;
        }
        let Some(waiting) = self.waiting.as_mut() else {
            let Some(mut waiting) = Waiting::start(&self.route) else {
                return false;
            };
            // Subscribed first, then looked at again: a completion between the two is seen by
            // the second look.
            waiting.watch = lease.watch().await;
            self.waiting = Some(waiting);
            return true;
        };
        let Some(delay) = waiting.next_delay() else {
            return false;
        };
        tokio::select! {
            () = waiting.sleep(delay) => {}
            () = offered => {}
        }
        true
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
            deadline: crate::time::after(Instant::now(), route.policy.wait_timeout),
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

    /// Sleep for `delay`, or less when the store says the key changed.
    async fn sleep(&mut self, delay: Duration) {
        match self.watch.as_mut() {
            Some(watch) => {
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = watch.changed() => {}
                }
            }
            None => tokio::time::sleep(delay).await,
        }
    }
}
