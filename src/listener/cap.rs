//! `max_client_connections`: the process's cap on open client connections, which a reload
//! may raise or lower.

use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::metrics::ListenerMetrics;
use crate::metrics::Metrics;

/// The process's cap on open client connections, shared by its workers: a worker takes a
/// permit before it accepts, so that past the cap new connections wait in the kernel's backlog.
#[derive(Debug)]
pub(crate) struct ConnectionCap {
    permits: Arc<Semaphore>,
    // The cap in force (a reload may change it).
    max: Mutex<usize>,
    // Workers waiting for a permit, and since when one has been (the time at the cap).
    waiting: Mutex<(usize, Option<Instant>)>,
    metrics: Arc<ListenerMetrics>,
}

impl ConnectionCap {
    pub(crate) fn new(max: usize, metrics: &Metrics) -> Arc<Self> {
        // Past tokio's bound, as good as no bound.
        let max = max.min(Semaphore::MAX_PERMITS);
        Arc::new(ConnectionCap {
            permits: Arc::new(Semaphore::new(max)),
            max: Mutex::new(max),
            waiting: Mutex::new((0, None)),
            metrics: metrics.families(),
        })
    }

    /// Hold the open connections to `max` from now on: a higher cap admits more at once; a
    /// lower one takes back the permits as connections close (none is closed for it).
    pub(crate) fn resize(&self, max: usize) {
        let max = max.min(Semaphore::MAX_PERMITS);
        let mut current = self.max.lock().unwrap_or_else(PoisonError::into_inner);
        if max > *current {
            self.permits.add_permits(max - *current);
        } else {
            let mut owed = *current - max;
            owed -= self.permits.forget_permits(owed);
            if owed > 0 {
                // The rest as connections close; a reload outside a runtime forgets what it can.
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    let permits = self.permits.clone();
                    let owed = u32::try_from(owed).unwrap_or(u32::MAX);
                    runtime.spawn(async move {
                        if let Ok(taken) = permits.acquire_many_owned(owed).await {
                            taken.forget();
                        }
                    });
                }
            }
        }
        *current = max;
    }

    /// A permit for one more connection, once the open ones are below the cap.
    #[expect(
        clippy::expect_used,
        reason = "the cap's semaphore is never closed: acquiring fails only on a closed one"
    )]
    pub(super) async fn permit(&self) -> OwnedSemaphorePermit {
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return permit;
        }
        self.at_cap(1);
        let permit = self.permits.clone().acquire_owned().await;
        self.at_cap(-1);
        permit.expect("the semaphore is never closed")
    }

    /// One more (`1`) or one fewer (`-1`) worker waiting at the cap: time is counted from the
    /// first one waiting to the last one done.
    fn at_cap(&self, change: isize) {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        waiting.0 = waiting.0.saturating_add_signed(change);
        match (waiting.0, waiting.1) {
            (0, Some(since)) => {
                self.metrics.at_connection_cap(since.elapsed());
                waiting.1 = None;
            }
            (_, None) if change > 0 => waiting.1 = Some(Instant::now()),
            _ => {}
        }
    }
}
