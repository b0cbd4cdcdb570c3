//! Wiring: from a validated [`Config`] to a running server (the idempotency layer over the
//! proxy, on worker threads), and its graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::time::Instant;
use tower::Layer;
use tracing::{info, warn};

use crate::admin;
use crate::config::Config;
use crate::idempotency::{IdempotencyLayer, Routes};
use crate::listener::Worker;
use crate::metrics::Metrics;
use crate::proxy::{Proxy, ProxyError};
use crate::reload::{Live, Reloader};
use crate::store::{AnyStore, StoreError};
use crate::telemetry::Sampling;
use crate::telemetry::SpanMetrics;
use crate::tls::CertificateMetrics;

/// Why the gateway could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The store could not be opened at start-up: misconfigured, refused, or (the embedded
    /// store) its file held by another process.
    #[error("cannot connect to the store: {0}")]
    Store(#[from] StoreError),
    /// Serving failed.
    #[error("server error: {0}")]
    Io(#[from] std::io::Error),
}

/// A gateway whose store is open, ready to serve.
pub struct App {
    config: Arc<Config>,
    // What a reload replaces: the layer's routes, the upstreams, the client settings.
    live: Live,
    reloader: Reloader,
    // Bound at start-up so that a taken port fails the start, not a later moment.
    admin: Option<TcpListener>,
}

impl App {
    /// Open the configured store (for Redis: connect, and warn when its settings could lose
    /// records). Fails when the store is misconfigured or refuses; an unreachable Redis or
    /// PostgreSQL is picked up later.
    pub async fn new(config: Config) -> Result<Self, AppError> {
        Self::with_metrics(config, Metrics::new()).await
    }

    /// [`App::new`], counting into `metrics` (which the binary's trace exporter counts into
    /// too).
    pub async fn with_metrics(config: Config, metrics: Metrics) -> Result<Self, AppError> {
        // The trace exporter's family, whether or not traces are exported: it reads zero then.
        drop(metrics.families::<SpanMetrics>());
        let certificates = metrics.families::<CertificateMetrics>();
        for (name, file) in config.presented_certificates() {
            certificates.record(&name, &file);
        }
        let store = AnyStore::open(&config.store, &metrics).await?;
        let admin = match config.admin.listen {
            Some(addr) => Some(TcpListener::bind(addr).await?),
            None => None,
        };
        let config = Arc::new(config);
        let layer = IdempotencyLayer::with_routes(
            store,
            Routes::from_config(&config.defaults, config.route_policies()),
        )
        .with_metrics(metrics);
        let live = Live::new(&config, layer);
        let reloader = Reloader::new(config.clone(), live.clone(), live.layer.metrics());
        Ok(App {
            config,
            live,
            reloader,
            admin,
        })
    }

    /// The admin listener's address, when one is configured.
    pub fn admin_addr(&self) -> Option<std::net::SocketAddr> {
        self.admin.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// What puts a new configuration in force while the gateway serves (the binary calls it on
    /// `SIGHUP`).
    pub fn reloader(&self) -> Reloader {
        self.reloader.clone()
    }

    /// Serve on `listener` until `shutdown` resolves; then stop accepting, let open requests
    /// finish and be recorded within `shutdown_grace`, and return.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), AppError> {
        let (config, live) = (self.config, self.live);
        let layer = live.layer.clone();
        let (stop_admin, admin_stopped) = tokio::sync::oneshot::channel::<()>();
        let admin = self.admin.map(|listener| {
            info!(listen = ?listener.local_addr().ok(), "admin listening");
            let (routes, token) = (layer.clone(), live.admin_token.clone());
            let router = admin::router(
                layer.store().clone(),
                layer.metrics().clone(),
                move || (**token.load()).clone(),
                move || routes.routes(),
            );
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
        });
        let watch = tokio::spawn(self.reloader.watch_certificate());
        let result = serve(listener, config, live, shutdown).await;
        watch.abort();
        // The admin listener outlives the drain (readiness and metrics stay visible), then stops.
        drop(stop_admin);
        if let Some(admin) = admin {
            let _ = tokio::time::timeout(Duration::from_secs(5), admin).await;
        }
        result
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

/// Run `config.workers` threads, each a single-threaded event loop accepting from the one
/// listening socket with its own stack (store handle, upstream pool, task tracker), as nginx
/// runs worker processes: a request, its upstream connection and its background work never hop
/// threads. Returns once every worker has drained after `shutdown`.
async fn serve(
    listener: TcpListener,
    config: Arc<Config>,
    live: Live,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    let listener = listener.into_std()?;
    info!(
        listen = %listener.local_addr()?,
        upstream = %config.upstream,
        store = config.store.backend(),
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
        let (config, live, stop, ready, done) = (
            config.clone(),
            live.clone(),
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
                    let store = live.layer.store().for_worker(config.workers).await;
                    let layer = live.layer.with_store(store);
                    worker(listener, config, &live, layer, stop, ready).await;
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

/// One worker: accept until told to stop, then drain connections and claimed calls within the
/// grace.
async fn worker(
    listener: std::net::TcpListener,
    config: Arc<Config>,
    live: &Live,
    layer: IdempotencyLayer<AnyStore>,
    stop: tokio::sync::watch::Receiver<bool>,
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
    let tasks = layer.tasks();
    // No tower-http TraceLayer here: its per-request cost shows on the forwarding path (the
    // figure is in loadtest/README.md); keyed requests have a debug span of their own.
    let stack = layer.layer(Proxy::following(&live.upstreams, layer.metrics()));
    // Without [telemetry], no sampling service: the stack is what it would be without it.
    let connections = match &config.telemetry {
        None => accept(listener, stack, live, &layer, stop).await,
        Some(_) => {
            let stack = Sampling::new(stack, live.sample_ratio.clone());
            accept(listener, stack, live, &layer, stop).await
        }
    };
    // The grace starts when the stop does.
    let grace = config.shutdown_grace;
    let deadline = Instant::now() + grace;
    if tokio::time::timeout_at(deadline, connections.wait())
        .await
        .is_err()
    {
        warn!(?grace, "shutdown grace ran out with connections still open");
    }
    // Claimed calls whose clients went away are still being recorded: give them the rest.
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

/// Serve `stack` on a worker's `listener` until told to stop; the open connections, each told
/// to finish.
async fn accept<S, RB>(
    listener: TcpListener,
    stack: S,
    live: &Live,
    layer: &IdempotencyLayer<AnyStore>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio_util::task::TaskTracker
where
    S: tower::Service<
            http::Request<axum::body::Body>,
            Response = http::Response<RB>,
            Error = ProxyError,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
    RB: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    RB::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let worker = Worker {
        listener,
        stack,
        tls: live.tls_acceptor(),
        timeouts: live.timeouts.clone(),
        cap: live.cap.clone(),
        metrics: layer.metrics().families(),
        routes: layer.live_routes(),
    };
    worker.run(stop).await
}
