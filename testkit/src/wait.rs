//! Waiting for a condition rather than sleeping for a guessed time:
//! `wait_until(Duration::from_secs(5), "the upstream has been called", async || upstream.calls() == 1).await`.

use std::time::{Duration, Instant};

/// How often [`wait_until`] checks its condition.
const POLL: Duration = Duration::from_millis(20);

/// Check `condition` every 20 ms until it holds, and return how long that took. Panics when it
/// still does not hold after `limit`, naming `what` was awaited ("redis-server answers").
///
/// The condition is checked once more after `limit` has passed, so a limit also reads as "by
/// then": `wait_until(Duration::from_millis(1300), ...)` holds if the condition does 1.3 s on.
/// A condition may assert on what it sees on the way ("every answer before recovery is a 503").
pub async fn wait_until(
    limit: Duration,
    what: &str,
    mut condition: impl AsyncFnMut() -> bool,
) -> Duration {
    let started = Instant::now();
    loop {
        if condition().await {
            return started.elapsed();
        }
        let waited = started.elapsed();
        assert!(
            waited < limit,
            "{what}: not within {limit:?} (waited {waited:?})"
        );
        tokio::time::sleep(POLL).await;
    }
}
