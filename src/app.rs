//! Wiring: from a validated [`Config`] to a running server, and its graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tracing::{error, info, warn};

use crate::admin;
use crate::config::{Config, StoreBackend};
use crate::idempotency::{Gateway, RouteTable};
use crate::metrics::Metrics;
use crate::store::{CachedStore, LocalCache, MemoryStore, RedisStore, Store, StoreError};

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
    // Bound at start-up so that a taken port fails the start, not a later moment.
    admin: Option<TcpListener>,
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
                let store =
                    MemoryStore::with_limits(config.store.max_entries, config.store.max_bytes);
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
            StoreBackend::Redis { .. } => {
                let store = match connect_redis(&config).await {
                    Ok(store) => store,
                    // Unreachable (not misconfigured): start anyway, as if Redis had gone down
                    // while running. Keyed requests follow on_store_error until it answers;
                    // unkeyed ones flow.
                    Err(StoreError::Redis(e))
                        if e.is_io_error() || e.is_connection_refusal() || e.is_timeout() =>
                    {
                        error!(error = %e, "Redis is unreachable at start-up; starting anyway (keyed requests follow on_store_error until it answers)");
                        lazy_redis(&config)?
                    }
                    Err(e) => return Err(e.into()),
                };
                match store.durability_warnings().await {
                    Ok(warnings) => warnings.iter().for_each(|w| warn!("{w}")),
                    Err(e) => {
                        info!(error = %e, "could not read the Redis configuration (CONFIG GET refused?)")
                    }
                }
                StoreHandle::Redis(store)
            }
        };
        let admin = match config.admin.listen {
            Some(addr) => Some(TcpListener::bind(addr).await?),
            None => None,
        };
        Ok(App {
            config,
            store,
            admin,
        })
    }

    /// The admin listener's address, when one is configured.
    pub fn admin_addr(&self) -> Option<std::net::SocketAddr> {
        self.admin.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Serve on `listener` until `shutdown` resolves; then stop accepting, let open requests
    /// finish and be recorded within `shutdown_grace`, and return.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), AppError> {
        let config = Arc::new(self.config);
        let metrics = Metrics::new();
        let routes = RouteTable::new(&config, &metrics);
        let admin = self.admin;
        let (stop_admin, admin_stopped) = tokio::sync::oneshot::channel::<()>();
        let start_admin = |router: axum::Router| {
            admin.map(|listener| {
                info!(listen = ?listener.local_addr().ok(), "admin listening");
                tokio::spawn(async move {
                    let stopped = async {
                        let _ = admin_stopped.await;
                    };
                    if let Err(e) = axum::serve(listener, router)
                        .with_graceful_shutdown(stopped)
                        .await
                    {
                        warn!(error = %e, "admin listener failed");
                    }
                })
            })
        };
        let result = match self.store {
            StoreHandle::Memory(store, _purger) => {
                let admin = start_admin(admin::router(
                    store.clone(),
                    metrics,
                    config.clone(),
                    routes.clone(),
                ));
                // One map shared by every worker.
                let make = move || {
                    let store = store.clone();
                    async move { Ok(store) }
                };
                let result = serve(listener, config, routes, make, shutdown).await;
                (result, admin)
            }
            StoreHandle::Redis(shared) => {
                // One multiplexed connection per worker, so its commands stay on its thread. A
                // worker that cannot connect (Redis went away since start-up) uses the shared
                // handle, which reconnects by itself, rather than failing the start.
                let c = config.clone();
                // One local cache of completed records for the whole process.
                let cache = LocalCache::new(c.store.local_cache, c.store.local_cache_ttl)
                    .counting_hits(metrics.local_cache_hits());
                let admin = start_admin(admin::router(
                    CachedStore::new(shared.clone(), cache.clone()),
                    metrics,
                    config.clone(),
                    routes.clone(),
                ));
                let make = move || {
                    let (c, shared, cache) = (c.clone(), shared.clone(), cache.clone());
                    async move {
                        let redis = match connect_redis(&c).await {
                            Ok(own) => own,
                            Err(e) => {
                                warn!(error = %e, "worker could not open its own Redis connection; sharing the first");
                                shared
                            }
                        };
                        Ok(CachedStore::new(redis, cache))
                    }
                };
                let result = serve(listener, config, routes, make, shutdown).await;
                (result, admin)
            }
        };
        // The admin listener outlives the drain (readiness and metrics stay visible), then stops.
        let (result, admin) = result;
        drop(stop_admin);
        if let Some(admin) = admin {
            let _ = tokio::time::timeout(Duration::from_secs(5), admin).await;
        }
        result
    }
}

/// Connect to the configured Redis, with the configured CA for `rediss://`.
async fn connect_redis(config: &Config) -> Result<RedisStore, StoreError> {
    let (url, ca) = redis_settings(config)?;
    RedisStore::connect_with_ca(url, &config.store.prefix, config.store.timeout, ca)
        .await
        .map(|s| s.with_compression(config.store.compression))
}

/// A Redis handle that connects on first use.
fn lazy_redis(config: &Config) -> Result<RedisStore, StoreError> {
    let (url, ca) = redis_settings(config)?;
    RedisStore::lazy(url, &config.store.prefix, config.store.timeout, ca)
        .map(|s| s.with_compression(config.store.compression))
}

/// The Redis URL and the PEM of `store.tls_ca_file`, if one is set.
fn redis_settings(config: &Config) -> Result<(&str, Option<Vec<u8>>), StoreError> {
    let StoreBackend::Redis { url } = &config.store.backend else {
        unreachable!("only called for a Redis config")
    };
    let ca = match &config.store.tls_ca_file {
        Some(path) => Some(std::fs::read(path).map_err(|e| {
            StoreError::Redis(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "cannot read store.tls_ca_file",
                format!("{path}: {e}"),
            )))
        })?),
        None => None,
    };
    Ok((url, ca))
}

/// [`App::new`] then [`App::serve`].
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    App::new(config).await?.serve(listener, shutdown).await
}

/// Run `config.workers` threads, each a single-threaded event loop accepting from the one
/// listening socket with its own gateway (store handle, upstream pool, task tracker), as nginx
/// runs worker processes: a request, its upstream connection and its background work never hop
/// threads. Returns once every worker has drained after `shutdown`.
async fn serve<S, F, Fut>(
    listener: TcpListener,
    config: Arc<Config>,
    routes: RouteTable,
    make_store: F,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AppError>
where
    S: Store,
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<S, StoreError>> + Send,
{
    let listener = listener.into_std()?;
    info!(
        listen = %listener.local_addr()?,
        upstream = %config.upstream,
        store = store_name(&config.store.backend),
        routes = config.routes.len(),
        workers = config.workers,
        "idemgate listening"
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (ready_tx, mut ready_rx) =
        tokio::sync::mpsc::channel::<Result<(), AppError>>(config.workers);
    let (done_tx, mut done_rx) = tokio::sync::mpsc::channel::<()>(config.workers);
    for i in 0..config.workers {
        let listener = listener.try_clone()?;
        let (config, routes, make_store, stop, ready, done) = (
            config.clone(),
            routes.clone(),
            make_store.clone(),
            stop_rx.clone(),
            ready_tx.clone(),
            done_tx.clone(),
        );
        std::thread::Builder::new()
            .name(format!("idemgate-worker-{i}"))
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready.blocking_send(Err(e.into()));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let gateway = match make_store().await {
                        Ok(store) => Gateway::with_routes(routes, &config, store),
                        Err(e) => {
                            let _ = ready.send(Err(e.into())).await;
                            return;
                        }
                    };
                    worker(listener, config, gateway, stop, ready).await;
                });
                drop(done);
            })?;
    }
    // Only the workers' duplicates of the socket remain: when they drop theirs on shutdown the
    // port closes, so new connections are refused rather than left in the backlog.
    drop((listener, ready_tx, done_tx));
    for _ in 0..config.workers {
        if let Some(Err(e)) = ready_rx.recv().await {
            let _ = stop_tx.send(true);
            return Err(e);
        }
    }
    shutdown.await;
    info!(grace = ?config.shutdown_grace, "shutting down: no new connections, finishing open requests");
    let _ = stop_tx.send(true);
    // Every worker drops its `done` sender when it has drained (each bounded by the grace).
    while done_rx.recv().await.is_some() {}
    info!("idemgate stopped");
    Ok(())
}

/// One worker: accept until told to stop, then drain connections and background upstream calls
/// within the grace.
async fn worker<S: Store>(
    listener: std::net::TcpListener,
    config: Arc<Config>,
    gateway: Gateway<S>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    ready: tokio::sync::mpsc::Sender<Result<(), AppError>>,
) {
    let listener = match TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            let _ = ready.send(Err(e.into())).await;
            return;
        }
    };
    let _ = ready.send(Ok(())).await;
    drop(ready);
    let tasks = gateway.tasks();
    // HTTP/1.1 straight on hyper: no router in front of the one service, no protocol sniffing.
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
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
            _ = stop.wait_for(|stop| *stop) => break,
        };
        let _ = stream.set_nodelay(true);
        let conn = http.serve_connection(TokioIo::new(stream), gateway.clone());
        tokio::spawn(graceful.watch(conn));
    }
    drop(listener);
    let deadline = Instant::now() + config.shutdown_grace;
    if tokio::time::timeout_at(deadline, graceful.shutdown())
        .await
        .is_err()
    {
        warn!(grace = ?config.shutdown_grace, "shutdown grace ran out with connections still open");
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
