//! Prometheus metrics (prometheus-client, the Prometheus project's own Rust client: typed
//! families that register themselves with help strings, OpenMetrics text out).
//!
//! This module keeps the registry and its encoding, and knows no subsystem: each subsystem
//! defines the families it counts beside the code that counts them, as a [`Families`] type
//! (the engine's in `idempotency/metrics.rs`, the store's in `store/metrics.rs`, the proxy's in
//! `proxy/metrics.rs`, the listener's in `listener/metrics.rs`, telemetry's in `telemetry.rs`),
//! registered on first use and shared after. Each subsystem takes its families when it is built,
//! so the gateway's whole set is registered at start, every series of a label set known up
//! front starting at zero. Per-request work is kept to atomic increments: counters and
//! histograms are resolved when a route, an upstream or a store is set up, not per request.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};

/// The metric families of one subsystem, registered together.
pub trait Families: Send + Sync + 'static {
    /// Register every family of the subsystem in `registry`.
    fn register(registry: &mut Registry) -> Self;
}

/// The process's metrics: one registry, and the families registered in it. Cheap to clone;
/// clones share the registry and the values.
#[derive(Clone, Default)]
pub struct Metrics {
    inner: Arc<Mutex<Registered>>,
}

#[derive(Default)]
struct Registered {
    registry: Registry,
    families: HashMap<TypeId, Arc<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    /// A fresh registry, with no family registered until a subsystem takes its own.
    pub fn new() -> Self {
        Self::default()
    }

    /// The families `F`, registered now if they are not yet.
    pub fn families<F: Families>(&self) -> Arc<F> {
        let mut registered = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let id = TypeId::of::<F>();
        let known = registered.families.get(&id).cloned();
        if let Some(families) = known.and_then(|f| f.downcast::<F>().ok()) {
            return families;
        }
        let families = Arc::new(F::register(&mut registered.registry));
        registered.families.insert(id, families.clone());
        families
    }

    /// The OpenMetrics text exposition of every family, in the order they were registered.
    pub fn encode(&self) -> String {
        let registered = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registered.registry) {
            tracing::error!(error = %e, "the metrics could not be encoded whole");
        }
        out
    }
}

/// `metric`, registered as `name` with `help`.
pub fn registered<M: Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// A latency histogram: 50 µs to about 26 s.
pub(crate) fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.00005, 2.0, 20))
}

/// A family of histograms, each made by [`latency_histogram`].
pub(crate) type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// The label of a series kept per route.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct RouteLabels {
    /// The route's name.
    pub(crate) route: String,
}

/// Count one event of `route` in `family` (events rare enough to look their series up).
pub(crate) fn count_for(family: &Family<RouteLabels, Counter>, route: &str) {
    let route = route.to_string();
    family.get_or_create(&RouteLabels { route }).inc();
}

/// The label of a series kept per reason.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct ReasonLabels {
    /// Why.
    pub(crate) reason: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Two(Counter);

    impl Families for Two {
        fn register(registry: &mut Registry) -> Self {
            Two(registered(
                registry,
                "two",
                "Counted twice",
                Counter::default(),
            ))
        }
    }

    #[test]
    fn families_are_registered_once_and_shared() {
        let metrics = Metrics::new();
        metrics.families::<Two>().0.inc();
        metrics.clone().families::<Two>().0.inc();
        let text = metrics.encode();
        assert_eq!(text.matches("# HELP two").count(), 1, "{text}");
        assert!(text.contains("two_total 2"), "{text}");
    }
}
