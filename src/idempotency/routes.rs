//! Which policy a request gets: the most specific route pattern that matches its path, or the
//! defaults.

use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::Semaphore;

use super::jsonrpc::metrics::JsonRpcMetrics;
use super::metrics::{EngineMetrics, RouteMetrics};
use super::webhook::WebhookMetrics;
use crate::error::ConfigError;
use crate::metrics::Metrics;
use crate::record::policy::Policy;

/// The policies a layer applies, by request path: path patterns in matchit syntax (the router
/// axum uses: `/v1/payments/{id}`, `/v1/{*rest}`), the most specific match winning, and a
/// default policy for every other path.
///
/// ```
/// use idemgate::{Policy, Routes};
/// use std::time::Duration;
///
/// let routes = Routes::new(Policy::default())
///     .route(
///         "/v1/payments/{id}/capture",
///         Policy::builder().require_key(true).ttl(Duration::from_secs(7 * 86400)).build()?,
///     )?;
/// assert!(routes.policy_for("/v1/payments/p_1/capture").require_key);
/// assert!(!routes.policy_for("/v1/refunds").require_key);
/// # Ok::<(), idemgate::ConfigError>(())
/// ```
#[derive(Clone, Debug)]
pub struct Routes {
    // Path patterns to indexes into `policies`.
    matcher: matchit::Router<usize>,
    policies: Vec<Arc<Policy>>,
    defaults: Arc<Policy>,
}

impl Routes {
    /// Every request gets `defaults`, until routes are added.
    pub fn new(defaults: Policy) -> Self {
        Routes {
            matcher: matchit::Router::new(),
            policies: Vec::new(),
            defaults: Arc::new(defaults),
        }
    }

    /// Requests whose path matches `path` get `policy` (named after the pattern in logs and
    /// metrics). A pattern that does not start with `/` or conflicts with one already added is
    /// refused.
    pub fn route(mut self, path: &str, mut policy: Policy) -> Result<Self, ConfigError> {
        let at = format!("routes[{}].path", self.policies.len());
        if !path.starts_with('/') {
            return Err(ConfigError::invalid(at, "must start with '/'"));
        }
        self.matcher
            .insert(path, self.policies.len())
            .map_err(|e| ConfigError::invalid(at, e.to_string()))?;
        policy.route = path.to_string();
        self.policies.push(Arc::new(policy));
        Ok(self)
    }

    /// The routes of a validated configuration: its defaults, and its routes' policies in file
    /// order, each named after its path pattern (its `route`).
    #[expect(
        clippy::expect_used,
        reason = "the config built this same table from these paths while it was validated"
    )]
    pub fn from_config<'a>(
        defaults: &Policy,
        routes: impl IntoIterator<Item = &'a Policy>,
    ) -> Self {
        routes
            .into_iter()
            .fold(Routes::new(defaults.clone()), |table, policy| {
                table
                    .route(&policy.route.clone(), policy.clone())
                    .expect("route paths were validated with the config")
            })
    }

    /// The policy requests to `path` get.
    pub fn policy_for(&self, path: &str) -> &Arc<Policy> {
        self.matcher
            .at(path)
            .ok()
            .and_then(|m| self.policies.get(*m.value))
            .unwrap_or(&self.defaults)
    }
}

/// The routes with their live state: cheap to clone, clones share the state (waiter bounds and
/// counters are per route and per process, whatever the number of workers).
#[derive(Clone)]
pub(crate) struct RouteTable {
    routes: Routes,
    // One entry per route, by the index `routes` gives.
    states: Arc<[Arc<RouteState>]>,
    defaults: Arc<RouteState>,
}

/// A route's policy and its live state.
pub(crate) struct RouteState {
    pub(crate) policy: Arc<Policy>,
    // Its outcome counters, resolved once.
    pub(crate) metrics: RouteMetrics,
    // Bounds the duplicates waiting at once under `on_in_flight = "wait"`.
    pub(crate) waiters: Arc<Semaphore>,
    // The headers the key is read from, and those that scope it (the policy's, with
    // Repeatable Requests' own when the route speaks it).
    pub(crate) key_headers: Vec<http::HeaderName>,
    pub(crate) scope_headers: Vec<http::HeaderName>,
}

/// The families whose series of a route start at zero when its state is made: the engine's,
/// and those of JSON-RPC and webhook routes.
type RouteFamilies = (Arc<EngineMetrics>, Arc<JsonRpcMetrics>, Arc<WebhookMetrics>);

impl RouteState {
    fn new(policy: &Arc<Policy>, families: &RouteFamilies) -> Arc<Self> {
        let (metrics, jsonrpc, webhooks) = families;
        let (key_headers, scope_headers) = super::repeatability::key_headers(policy);
        if policy.protocol.is_jsonrpc() {
            jsonrpc.start_at_zero(&policy.route, &policy.keyed_methods);
        }
        if policy.webhook.is_some() {
            webhooks.route(&policy.route);
        }
        Arc::new(RouteState {
            key_headers,
            scope_headers,
            policy: policy.clone(),
            metrics: metrics.route(&policy.route),
            // Past tokio's bound, as good as no bound.
            waiters: Arc::new(Semaphore::new(
                policy.max_waiters.min(Semaphore::MAX_PERMITS),
            )),
        })
    }
}

impl RouteTable {
    /// The live table of `routes`, counting into `metrics`.
    pub(crate) fn new(routes: Routes, metrics: &Metrics) -> Self {
        let families = (metrics.families(), metrics.families(), metrics.families());
        RouteTable {
            states: routes
                .policies
                .iter()
                .map(|p| RouteState::new(p, &families))
                .collect(),
            defaults: RouteState::new(&routes.defaults, &families),
            routes,
        }
    }

    /// The route requests to `path` take.
    pub(crate) fn route_for(&self, path: &str) -> &Arc<RouteState> {
        self.routes
            .matcher
            .at(path)
            .ok()
            .and_then(|m| self.states.get(*m.value))
            .unwrap_or(&self.defaults)
    }

    /// The routes, without their state.
    pub(crate) fn routes(&self) -> &Routes {
        &self.routes
    }
}

/// The route table in force, replaced whole by a reload: every clone (each worker's layer) sees
/// the new table at its next request, while a request in flight keeps the state it took.
#[derive(Clone)]
pub(crate) struct LiveTable(Arc<ArcSwap<RouteTable>>);

impl LiveTable {
    /// `table`, in force until replaced.
    pub(crate) fn new(table: RouteTable) -> Self {
        LiveTable(Arc::new(ArcSwap::from_pointee(table)))
    }

    /// The table in force now.
    pub(crate) fn load(&self) -> Arc<RouteTable> {
        self.0.load_full()
    }

    /// Put `table` in force for the requests that come next.
    pub(crate) fn replace(&self, table: RouteTable) {
        self.0.store(Arc::new(table));
    }

    /// The route requests to `path` take now.
    pub(crate) fn route_for(&self, path: &str) -> Arc<RouteState> {
        self.0.load().route_for(path).clone()
    }

    /// The policy requests to `path` get now.
    pub(crate) fn policy_for(&self, path: &str) -> Arc<Policy> {
        self.0.load().routes().policy_for(path).clone()
    }
}
