//! Wiring: from a validated [`Config`] to a running server, and its graceful shutdown.

use std::future::Future;
use std::time::Duration;

use axum::body::Body;
use http::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::config::{Config, StoreBackend};
use crate::idempotency::Gateway;
use crate::store::{MemoryStore, RedisStore, Store, StoreError};
use tower::ServiceExt;

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

/// A gateway whose store is connected, ready to serve.
pub struct App {
    config: Config,
    store: StoreHandle,
}

enum StoreHandle {
    // The embedded store and its purge task (aborted when the app is dropped).
    Memory(MemoryStore, AbortOnDrop),
    Redis(RedisStore),
}

impl App {
    /// Open the configured store (for Redis: connect, and warn when its settings could lose
    /// records). Fails when the store cannot be reached.
    pub async fn new(config: Config) -> Result<Self, AppError> {
        let store = match &config.store.backend {
            StoreBackend::Memory => {
                let store = MemoryStore::with_max_entries(config.store.max_entries);
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
                StoreHandle::Memory(store, AbortOnDrop(purger))
            }
            StoreBackend::Redis { url } => {
                let store =
                    RedisStore::connect(url, &config.store.prefix, config.store.timeout).await?;
                match store.durability_warnings().await {
                    Ok(warnings) => warnings.iter().for_each(|w| warn!("{w}")),
                    Err(e) => {
                        info!(error = %e, "could not read the Redis configuration (CONFIG GET refused?)")
                    }
                }
                StoreHandle::Redis(store)
            }
        };
        Ok(App { config, store })
    }

    /// Serve on `listener` until `shutdown` resolves; then stop accepting, let open requests
    /// finish and be recorded within `shutdown_grace`, and return.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), AppError> {
        match self.store {
            StoreHandle::Memory(store, _purger) => {
                serve(listener, &self.config, store, shutdown).await
            }
            StoreHandle::Redis(store) => serve(listener, &self.config, store, shutdown).await,
        }
    }
}

/// [`App::new`] then [`App::serve`].
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    App::new(config).await?.serve(listener, shutdown).await
}

async fn serve<S: Store>(
    listener: TcpListener,
    config: &Config,
    store: S,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    let gateway = Gateway::new(config, store);
    let tasks = gateway.tasks();
    info!(
        listen = %listener.local_addr()?,
        upstream = %config.upstream,
        store = store_name(&config.store.backend),
        routes = config.routes.len(),
        "idemgate listening"
    );
    // HTTP/1.1 straight on hyper: no router in front of the one service, no protocol sniffing.
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning or dying.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(
            gateway
                .clone()
                .map_request(|req: Request<Incoming>| req.map(Body::new)),
        );
        let conn = http.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(graceful.watch(conn));
    }
    // Signalled: stop accepting, let open connections finish their requests within the grace.
    drop(listener);
    let grace = config.shutdown_grace;
    let deadline = Instant::now() + grace;
    info!(grace = ?grace, "shutting down: no new connections, finishing open requests");
    if tokio::time::timeout_at(deadline, graceful.shutdown())
        .await
        .is_err()
    {
        warn!(grace = ?grace, "shutdown grace ran out with connections still open");
    }
    // Upstream calls whose clients went away are still being recorded: give them the rest.
    tasks.close();
    if tokio::time::timeout_at(deadline, tasks.wait())
        .await
        .is_err()
    {
        warn!(
            unfinished = tasks.len(),
            "shutdown grace ran out with upstream calls in flight; their keys stay claimed until their leases end"
        );
    }
    info!("idemgate stopped");
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
