//! [`IdempotencyLayer`]: what a user puts in front of a service.

use std::sync::Arc;

use tokio_util::task::TaskTracker;

use super::routes::{LiveTable, RouteTable, Routes};
use super::service::Idempotency;
use super::shared::Shared;
use crate::metrics::Metrics;
use crate::record::policy::Policy;
use crate::store::Store;

/// Makes the requests it sees idempotent: applied to a service, gives an [`Idempotency`] around
/// it. Cheap to clone; clones (and the services they make) share the store, the routes' live
/// state, the metrics and the background tasks.
///
/// ```
/// use idemgate::{IdempotencyLayer, MemoryStore, Policy};
/// use axum::{routing::post, Router};
///
/// # async fn charge() -> &'static str { "charged" }
/// # fn app() -> Result<Router, idemgate::ConfigError> {
/// let layer = IdempotencyLayer::new(MemoryStore::new(), Policy::builder().require_key(true).build()?);
/// let app: Router = Router::new().route("/v1/payments", post(charge)).layer(layer);
/// # Ok(app) }
/// ```
pub struct IdempotencyLayer<St> {
    shared: Arc<Shared<St>>,
}

impl<St> Clone for IdempotencyLayer<St> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            shared: self.shared.clone(),
        }
    }
}

impl<St: Store> IdempotencyLayer<St> {
    /// Apply `policy` to every request, keeping records in `store`.
    pub fn new(store: St, policy: Policy) -> Self {
        Self::with_routes(store, Routes::new(policy))
    }

    /// Apply the policy of the route each request's path matches ([`Routes`]).
    pub fn with_routes(store: St, routes: Routes) -> Self {
        let metrics = Metrics::new();
        IdempotencyLayer {
            shared: Arc::new(Shared::new(
                store,
                LiveTable::new(RouteTable::new(routes, &metrics)),
                metrics,
                TaskTracker::new(),
                Arc::default(),
            )),
        }
    }

    /// Count into `metrics` instead of a registry of the layer's own.
    pub fn with_metrics(self, metrics: Metrics) -> Self {
        let routes = self.routes();
        IdempotencyLayer {
            shared: Arc::new(Shared::new(
                self.shared.store.clone(),
                LiveTable::new(RouteTable::new(routes, &metrics)),
                metrics,
                self.shared.tasks.clone(),
                self.shared.live.clone(),
            )),
        }
    }

    /// The same layer over another handle to the store (the binary gives each worker thread
    /// its own Redis connection): routes, waiter bounds, metrics and live streamed answers stay
    /// shared; the background tasks are tracked apart, so each worker can wait for its own.
    pub fn with_store<T: Store>(&self, store: T) -> IdempotencyLayer<T> {
        IdempotencyLayer {
            shared: Arc::new(Shared::new(
                store,
                self.shared.table.clone(),
                self.shared.registry.clone(),
                TaskTracker::new(),
                self.shared.live.clone(),
            )),
        }
    }

    /// The metrics the layer counts into (Prometheus text with [`Metrics::encode`]).
    pub fn metrics(&self) -> &Metrics {
        &self.shared.registry
    }

    /// The routes the layer applies now.
    pub fn routes(&self) -> Routes {
        self.shared.table.load().routes().clone()
    }

    /// Apply `routes` to the requests that come next, in this layer and every clone of it (and
    /// each worker's [`with_store`](Self::with_store) layer); a request already admitted
    /// finishes under the policy it started with. A route whose path is new starts with fresh
    /// waiter bounds.
    pub fn set_routes(&self, routes: Routes) {
        let registry = &self.shared.registry;
        self.shared.table.replace(RouteTable::new(routes, registry));
    }

    /// The live route table, for the listener's own refusals.
    pub(crate) fn live_routes(&self) -> LiveTable {
        self.shared.table.clone()
    }

    /// The claimed calls running in the background (a claimed call outlives its client): on a
    /// graceful shutdown, `close()` it and `wait()` for them, so that their responses are
    /// recorded before the process exits.
    pub fn tasks(&self) -> TaskTracker {
        self.shared.tasks.clone()
    }

    /// The store the layer keeps its records in.
    pub fn store(&self) -> &St {
        &self.shared.store
    }
}

impl<S, St: Store> tower::Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.shared.clone())
    }
}
