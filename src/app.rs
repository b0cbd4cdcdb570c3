//! Wiring: from a validated [`Config`] to a running server.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tracing::info;

use crate::config::{Config, StoreBackend};
use crate::idempotency::Gateway;
use crate::store::{MemoryStore, RedisStore, Store, StoreError};

/// Why the gateway could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The store could not be reached at start-up.
    #[error("cannot connect to the store: {0}")]
    Store(#[from] StoreError),
    /// Serving failed.
    #[error("server error: {0}")]
    Io(#[from] std::io::Error),
}

/// How often the embedded store drops expired entries.
const PURGE_EVERY: Duration = Duration::from_secs(5);

/// Serve the gateway on `listener` until `shutdown` resolves, then drain open connections.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    match &config.store.backend {
        StoreBackend::Memory => {
            let store = MemoryStore::new();
            let purger = tokio::spawn({
                let store = store.clone();
                async move {
                    let mut tick = tokio::time::interval(PURGE_EVERY);
                    loop {
                        tick.tick().await;
                        store.purge_expired();
                    }
                }
            });
            let _stop_purger = AbortOnDrop(purger);
            serve(listener, &config, store, shutdown).await
        }
        StoreBackend::Redis { url } => {
            let store = RedisStore::connect(url, &config.store.prefix).await?;
            serve(listener, &config, store, shutdown).await
        }
    }
}

async fn serve<S: Store>(
    listener: TcpListener,
    config: &Config,
    store: S,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    let router = Router::new().fallback_service(Gateway::new(config, store));
    info!(
        listen = %listener.local_addr()?,
        upstream = %config.upstream,
        store = store_name(&config.store.backend),
        routes = config.routes.len(),
        "idemgate listening"
    );
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

fn store_name(b: &StoreBackend) -> &'static str {
    match b {
        StoreBackend::Memory => "memory",
        StoreBackend::Redis { .. } => "redis",
    }
}

/// Aborts a background task when dropped, so it never outlives the server it serves.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
