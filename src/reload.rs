//! A reload (`SIGHUP`): a new configuration, read and validated as at start, checked against
//! the running one and put in force whole, or refused whole.
//!
//! What a reload changes: the routes and their policies (the engine's route table), and the
//! upstreams (the proxy's set); each is swapped whole, so that the next request takes the new
//! one while a request in flight finishes under what it started with. Everything else is the
//! running process's: a reload that changes it is refused, naming the field.

use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tracing::{info, warn};

use crate::config::Config;
use crate::error::ConfigError;
use crate::idempotency::{IdempotencyLayer, Routes};
use crate::metrics::{registered, Families, Metrics};
use crate::proxy::UpstreamSet;
use crate::store::AnyStore;

/// Why a reload was refused (the running configuration keeps serving).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The new configuration does not read or validate.
    #[error("{0}")]
    Invalid(#[from] ConfigError),
    /// It changes a field that only a restart can change.
    #[error("{field}: changed, and only a restart can change it")]
    NeedsRestart {
        /// The field, as `check-config` names it.
        field: &'static str,
    },
}

/// Puts a new configuration in force in a running gateway. Cheap to clone.
#[derive(Clone)]
pub struct Reloader {
    inner: Arc<Inner>,
}

struct Inner {
    // The configuration in force, which a new one is compared with. A std Mutex: held for a
    // comparison and two swaps, never across an await.
    running: Mutex<Arc<Config>>,
    // The layer whose route table a reload replaces (every worker's layer shares it).
    layer: IdempotencyLayer<AnyStore>,
    // The upstream set every worker's proxy follows.
    upstreams: UpstreamSet,
    metrics: Arc<ReloadMetrics>,
}

impl Reloader {
    /// A reloader for the gateway running `config` with `layer` over proxies following
    /// `upstreams`; the last successful load is now.
    pub(crate) fn new(
        config: Arc<Config>,
        layer: IdempotencyLayer<AnyStore>,
        upstreams: UpstreamSet,
        metrics: &Metrics,
    ) -> Self {
        let metrics = metrics.families::<ReloadMetrics>();
        metrics.loaded_now();
        Reloader {
            inner: Arc::new(Inner {
                running: Mutex::new(config),
                layer,
                upstreams,
                metrics,
            }),
        }
    }

    /// Put `loaded` in force if it read and validated, and changes nothing that needs a
    /// restart; otherwise keep the running configuration. Logged and counted either way.
    pub fn reload(&self, loaded: Result<Config, ConfigError>) -> Result<(), ReloadError> {
        let result = loaded
            .map_err(ReloadError::from)
            .and_then(|config| self.apply(config));
        match &result {
            Ok(()) => {
                self.inner.metrics.successes.inc();
                self.inner.metrics.loaded_now();
                info!("configuration reloaded");
            }
            Err(e) => {
                self.inner.metrics.failures.inc();
                warn!(error = %e, "reload refused: the running configuration keeps serving");
            }
        }
        result
    }

    fn apply(&self, config: Config) -> Result<(), ReloadError> {
        let inner = &self.inner;
        let mut running = inner.running.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(field) = needs_restart(&running, &config) {
            return Err(ReloadError::NeedsRestart { field });
        }
        let routes = Routes::from_config(&config.defaults, config.route_policies());
        inner.layer.set_routes(routes);
        inner.upstreams.replace(config.upstreams.values());
        info!(
            upstream = %config.upstream,
            routes = config.routes.len(),
            "new requests take the reloaded routes and upstreams"
        );
        *running = Arc::new(config);
        Ok(())
    }
}

/// The first field `new` changes that a reload cannot, named as `check-config` names it.
fn needs_restart(old: &Config, new: &Config) -> Option<&'static str> {
    let debug = |v: &dyn std::fmt::Debug| format!("{v:?}");
    let fields: [(&'static str, bool); 13] = [
        ("listen", old.listen == new.listen),
        ("admin.listen", old.admin.listen == new.admin.listen),
        ("workers", old.workers == new.workers),
        ("store", old.store == new.store),
        ("tls", debug(&old.tls) == debug(&new.tls)),
        (
            "admin.admin_token",
            old.admin.admin_token == new.admin.admin_token,
        ),
        ("shutdown_grace", old.shutdown_grace == new.shutdown_grace),
        (
            "client_header_timeout",
            old.client_header_timeout == new.client_header_timeout,
        ),
        (
            "client_idle_timeout",
            old.client_idle_timeout == new.client_idle_timeout,
        ),
        (
            "client_min_body_rate",
            old.client_min_body_rate == new.client_min_body_rate,
        ),
        (
            "client_min_body_rate_grace",
            old.client_min_body_rate_grace == new.client_min_body_rate_grace,
        ),
        (
            "max_client_connections",
            old.max_client_connections == new.max_client_connections,
        ),
        ("telemetry", debug(&old.telemetry) == debug(&new.telemetry)),
    ];
    fields
        .into_iter()
        .find(|(_, same)| !same)
        .map(|(field, _)| field)
}

// === impl ReloadMetrics ===

/// A reload's result, as `idemgate_config_reloads_total{result}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum ReloadResult {
    success,
    failure,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    result: ReloadResult,
}

/// The reload's families: reloads by result, and when the configuration in force was loaded.
#[derive(Debug)]
pub(crate) struct ReloadMetrics {
    successes: Counter,
    failures: Counter,
    last_success: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl ReloadMetrics {
    /// The configuration in force was loaded now.
    fn loaded_now(&self) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.last_success.set(now);
    }
}

impl Families for ReloadMetrics {
    fn register(registry: &mut Registry) -> Self {
        let reloads = registered(
            registry,
            "idemgate_config_reloads",
            "Configuration reloads (SIGHUP), by result: success (in force) or failure (refused: invalid, or changing what needs a restart)",
            Family::<ResultLabels, Counter>::default(),
        );
        let count = |result| reloads.get_or_create(&ResultLabels { result }).clone();
        let last_success = registered(
            registry,
            "idemgate_config_last_reload_success_timestamp_seconds",
            "When the configuration in force was loaded (at start, or by the last successful reload), in seconds since the Unix epoch",
            Gauge::default(),
        );
        ReloadMetrics {
            successes: count(ReloadResult::success),
            failures: count(ReloadResult::failure),
            last_success,
        }
    }
}
