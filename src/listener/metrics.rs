//! The listener's metric families: client connections open and closed, time at the connection
//! cap, request bodies too slow.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::{registered, Families};

/// Why the gateway closed a client connection, as counted by
/// `idemgate_client_connections_closed_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub(crate) enum ClosedBy {
    /// No complete request head within `client_header_timeout`.
    header_timeout,
    /// No request in progress for `client_idle_timeout`.
    idle_timeout,
    /// The client took none of its answer, or sent none of its body, for `client_idle_timeout`.
    stalled,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClosedLabels {
    reason: ClosedBy,
}

/// The listener's families.
#[derive(Debug)]
pub(crate) struct ListenerMetrics {
    /// Client connections open in this process.
    pub(crate) open: Gauge,
    closed: Family<ClosedLabels, Counter>,
    at_cap: Counter<f64, AtomicU64>,
    too_slow: Counter,
}

impl Families for ListenerMetrics {
    fn register(registry: &mut Registry) -> Self {
        let metrics = ListenerMetrics {
            open: registered(
                registry,
                "idemgate_client_connections",
                "Client connections open in this process",
                Gauge::default(),
            ),
            closed: registered(
                registry,
                "idemgate_client_connections_closed",
                "Client connections the gateway closed, by the timeout that ended them",
                Family::default(),
            ),
            at_cap: registered(
                registry,
                "idemgate_client_connections_at_cap_seconds",
                "Time spent with max_client_connections open, new connections waiting in the kernel's backlog",
                Counter::default(),
            ),
            too_slow: registered(
                registry,
                "idemgate_client_bodies_too_slow",
                "Request bodies cut for arriving slower than client_min_body_rate, answered 408",
                Counter::default(),
            ),
        };
        for reason in [
            ClosedBy::header_timeout,
            ClosedBy::idle_timeout,
            ClosedBy::stalled,
        ] {
            drop(metrics.closed.get_or_create(&ClosedLabels { reason }));
        }
        metrics
    }
}

impl ListenerMetrics {
    /// Count a client connection closed by `reason`.
    pub(crate) fn closed(&self, reason: ClosedBy) {
        self.closed.get_or_create(&ClosedLabels { reason }).inc();
    }

    /// Count a request body cut for arriving slower than `client_min_body_rate`.
    pub(crate) fn body_too_slow(&self) {
        self.too_slow.inc();
    }

    /// Add time spent at `max_client_connections`.
    pub(crate) fn at_connection_cap(&self, d: Duration) {
        self.at_cap.inc_by(d.as_secs_f64());
    }
}
