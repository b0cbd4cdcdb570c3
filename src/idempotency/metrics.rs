//! The engine's metric families: what became of each request, the claimed calls, the store
//! operations as the engine waits on them, and the records it found unreadable or could not
//! keep whole.

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::metrics::{
    count_for, latency_histogram, registered, Families, HistogramFamily, ReasonLabels, RouteLabels,
};
use crate::store::Unreadable;

/// What happened to a request, as counted by `idemgate_requests_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub(crate) enum Outcome {
    /// A keyed request that ran the upstream (first execution).
    miss,
    /// A replay of a stored response.
    replayed,
    /// A duplicate of an in-flight request, answered 409.
    in_flight_conflict,
    /// The key reused with a different request.
    mismatch,
    /// The key's response was too large to store; answered 409.
    not_replayable,
    /// The key's record expired and the route refuses it after expiry; answered 410.
    expired,
    /// Forwarded without idempotency: no key, or a method the route does not cover.
    passthrough,
    /// The store could not be reached (answered 503, or forwarded under `on_store_error = "pass"`).
    store_error,
    /// Refused before anything else: bad or missing key, unreadable or oversized body.
    rejected_invalid,
}

impl Outcome {
    /// Every outcome, in declaration order.
    pub(crate) const ALL: [Outcome; 9] = [
        Outcome::miss,
        Outcome::replayed,
        Outcome::in_flight_conflict,
        Outcome::mismatch,
        Outcome::not_replayable,
        Outcome::expired,
        Outcome::passthrough,
        Outcome::store_error,
        Outcome::rejected_invalid,
    ];

    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::miss => "miss",
            Outcome::replayed => "replayed",
            Outcome::in_flight_conflict => "in_flight_conflict",
            Outcome::mismatch => "mismatch",
            Outcome::not_replayable => "not_replayable",
            Outcome::expired => "expired",
            Outcome::passthrough => "passthrough",
            Outcome::store_error => "store_error",
            Outcome::rejected_invalid => "rejected_invalid",
        }
    }
}

/// Why a keyed call's outcome is unknown, as counted by `idemgate_calls_unsettled_total{reason}`:
/// the upstream may have done the work, so its key stays claimed until its lease ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub(crate) enum Unsettled {
    /// No answer within the route's `upstream_timeout` (or, streamed, no data for that long).
    timeout,
    /// The call or its answer broke after the request may have been sent: the connection
    /// failed, the body broke off midway, or the answer was no valid response.
    failed,
    /// The call ended and its answer was delivered, but it was not recorded: a newer claim
    /// took the key first (the store was unreachable past the lease), or the store did not
    /// answer for as long as the record would have lived.
    unrecorded,
}

impl Unsettled {
    /// Every reason, in declaration order.
    pub(crate) const ALL: [Unsettled; 3] =
        [Unsettled::timeout, Unsettled::failed, Unsettled::unrecorded];
}

/// A store operation, as labelled in `idemgate_store_operation_seconds{operation}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub(crate) enum StoreOp {
    /// Claim or read a key.
    claim,
    /// Record a completed response.
    complete,
    /// Release a claim.
    release,
    /// Renew a lease.
    renew,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    outcome: Outcome,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct UnsettledLabels {
    route: String,
    reason: Unsettled,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OpLabels {
    operation: StoreOp,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DisconnectLabels {
    outcome: &'static str,
}

/// The engine's families.
pub(crate) struct EngineMetrics {
    requests: Family<RequestLabels, Counter>,
    unsettled: Family<UnsettledLabels, Counter>,
    grpc_streaming_keyed: Family<RouteLabels, Counter>,
    latencies: Latencies,
    in_flight: Gauge,
    replayed_bytes: Counter,
    store_errors_passed: Counter,
    disconnects: Family<DisconnectLabels, Counter>,
    records: RecordFamilies,
}

/// How long the gateway itself, the upstream and the store took.
struct Latencies {
    overhead: Histogram,
    upstream: Histogram,
    store_ops: HistogramFamily<OpLabels>,
}

/// The records the engine wrote or read and could not use whole.
struct RecordFamilies {
    unacknowledged: Family<OpLabels, Counter>,
    unreadable: Family<ReasonLabels, Counter>,
    not_replayable: Family<RouteLabels, Counter>,
}

impl Families for EngineMetrics {
    fn register(registry: &mut Registry) -> Self {
        let metrics = EngineMetrics {
            requests: registered(
                registry,
                "idemgate_requests",
                "Requests by route and outcome",
                Family::default(),
            ),
            unsettled: registered(
                registry,
                "idemgate_calls_unsettled",
                "Keyed upstream calls a retry may run again (by route and reason): timeout and failed, whose outcome is unknown, so the key stays claimed until its lease ends; unrecorded, whose answer was delivered but not recorded",
                Family::default(),
            ),
            grpc_streaming_keyed: registered(
                registry,
                "idemgate_grpc_streaming_keyed",
                "gRPC calls with an idempotency key passed on without idempotency because they stream (client or bidirectional streaming, or held open past a second), by route: the key is not applied, and a retry runs again",
                Family::default(),
            ),
            latencies: Latencies::register(registry),
            in_flight: registered(
                registry,
                "idemgate_in_flight_claims",
                "Keys this process holds claimed while their upstream call runs",
                Gauge::default(),
            ),
            replayed_bytes: registered(
                registry,
                "idemgate_replayed_bytes",
                "Response body bytes served from stored records",
                Counter::default(),
            ),
            store_errors_passed: registered(
                registry,
                "idemgate_store_error_passthrough",
                "Keyed requests forwarded WITHOUT idempotency because the store was down (on_store_error = \"pass\")",
                Counter::default(),
            ),
            disconnects: registered(
                registry,
                "idemgate_client_disconnects",
                "Requests whose client went away before their answer, by the outcome they had come to (undecided: before the claim was answered); a claimed call runs on and is recorded",
                Family::default(),
            ),
            records: RecordFamilies::register(registry),
        };
        for outcome in Outcome::ALL.iter().map(|o| o.as_str()).chain(["undecided"]) {
            drop(
                metrics
                    .disconnects
                    .get_or_create(&DisconnectLabels { outcome }),
            );
        }
        metrics
    }
}

impl Latencies {
    fn register(registry: &mut Registry) -> Self {
        Latencies {
                overhead: registered(
                    registry,
                    "idemgate_overhead_seconds",
                    "Time the gateway itself adds to a request (total minus time waiting for the upstream)",
                    latency_histogram(),
                ),
                upstream: registered(
                    registry,
                    "idemgate_upstream_duration_seconds",
                    "Time from forwarding a request to having the upstream's response (head, and body when recorded)",
                    latency_histogram(),
                ),
                store_ops: registered(
                    registry,
                    "idemgate_store_operation_seconds",
                    "Latency of store operations by operation",
                    Family::new_with_constructor(latency_histogram),
                ),
        }
    }
}

impl RecordFamilies {
    fn register(registry: &mut Registry) -> Self {
        let families = RecordFamilies {
            unacknowledged: registered(
                registry,
                "idemgate_store_unacknowledged_writes",
                "Claims and completions fewer replicas than store.wait_replicas acknowledged in time",
                Family::default(),
            ),
            unreadable: registered(
                registry,
                "idemgate_records_unreadable",
                "Stored records that did not open (reason: tampered, unknown_key, clear) and were refused, never replayed nor run again",
                Family::default(),
            ),
            not_replayable: registered(
                registry,
                "idemgate_records_not_replayable",
                "Responses recorded without their body because it passed the route's max_body (by route): a retry of such a key gets 409 not-replayable",
                Family::default(),
            ),
        };
        for operation in [StoreOp::claim, StoreOp::complete] {
            drop(
                families
                    .unacknowledged
                    .get_or_create(&OpLabels { operation }),
            );
        }
        for reason in Unreadable::REASONS {
            drop(families.unreadable.get_or_create(&ReasonLabels { reason }));
        }
        families
    }
}

impl EngineMetrics {
    /// The counters of one route, one per outcome, resolved now so requests only increment.
    pub(crate) fn route(&self, route: &str) -> RouteMetrics {
        let labels = RouteLabels {
            route: route.to_string(),
        };
        drop(self.records.not_replayable.get_or_create(&labels));
        drop(self.grpc_streaming_keyed.get_or_create(&labels));
        for reason in Unsettled::ALL {
            let route = route.to_string();
            drop(
                self.unsettled
                    .get_or_create(&UnsettledLabels { route, reason }),
            );
        }
        let counter = |outcome| {
            self.requests
                .get_or_create(&RequestLabels {
                    route: route.to_string(),
                    outcome,
                })
                .clone()
        };
        RouteMetrics {
            miss: counter(Outcome::miss),
            replayed: counter(Outcome::replayed),
            in_flight_conflict: counter(Outcome::in_flight_conflict),
            mismatch: counter(Outcome::mismatch),
            not_replayable: counter(Outcome::not_replayable),
            expired: counter(Outcome::expired),
            passthrough: counter(Outcome::passthrough),
            store_error: counter(Outcome::store_error),
            rejected_invalid: counter(Outcome::rejected_invalid),
        }
    }

    /// The latency histograms of the store operations, resolved now.
    pub(crate) fn store_ops(&self) -> StoreOpMetrics {
        let histogram = |operation| {
            self.latencies
                .store_ops
                .get_or_create(&OpLabels { operation })
                .clone()
        };
        StoreOpMetrics {
            claim: histogram(StoreOp::claim),
            complete: histogram(StoreOp::complete),
            release: histogram(StoreOp::release),
            renew: histogram(StoreOp::renew),
        }
    }

    /// Record the gateway's own time for one request.
    pub(crate) fn overhead(&self, d: Duration) {
        self.latencies.overhead.observe(d.as_secs_f64());
    }

    /// Record one upstream call.
    pub(crate) fn upstream(&self, d: Duration) {
        self.latencies.upstream.observe(d.as_secs_f64());
    }

    /// Count replayed body bytes.
    pub(crate) fn replayed_bytes(&self, n: usize) {
        self.replayed_bytes.inc_by(n as u64);
    }

    /// Count a keyed request forwarded without idempotency because the store was down.
    pub(crate) fn store_error_passed(&self) {
        self.store_errors_passed.inc();
    }

    /// Count a stored record that did not open, by why (`tampered`, `unknown_key`, `clear`).
    pub(crate) fn unreadable(&self, reason: &'static str) {
        self.records
            .unreadable
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Count a response of `route` recorded as not replayable (its body passed `max_body`).
    pub(crate) fn not_replayable(&self, route: &str) {
        count_for(&self.records.not_replayable, route);
    }

    /// Count a keyed gRPC call of `route` passed on without idempotency because it streams.
    pub(crate) fn grpc_streaming_keyed(&self, route: &str) {
        count_for(&self.grpc_streaming_keyed, route);
    }

    /// Count a keyed call of `route` whose outcome is unknown, by why.
    pub(crate) fn unsettled(&self, route: &str, reason: Unsettled) {
        let route = route.to_string();
        self.unsettled
            .get_or_create(&UnsettledLabels { route, reason })
            .inc();
    }

    /// The gauge of claimed calls in flight.
    pub(crate) fn in_flight(&self) -> &Gauge {
        &self.in_flight
    }

    /// Count a request whose client went away once it had come to `outcome`.
    pub(crate) fn disconnected(&self, outcome: &'static str) {
        self.disconnects
            .get_or_create(&DisconnectLabels { outcome })
            .inc();
    }

    /// Count a claim or completion that too few replicas acknowledged (`wait_replicas`).
    pub(crate) fn unacknowledged(&self, operation: StoreOp) {
        self.records
            .unacknowledged
            .get_or_create(&OpLabels { operation })
            .inc();
    }
}

/// One route's outcome counters.
#[derive(Clone, Debug)]
pub(crate) struct RouteMetrics {
    miss: Counter,
    replayed: Counter,
    in_flight_conflict: Counter,
    mismatch: Counter,
    not_replayable: Counter,
    expired: Counter,
    passthrough: Counter,
    store_error: Counter,
    rejected_invalid: Counter,
}

impl RouteMetrics {
    /// Count one request with `outcome`.
    pub(crate) fn count(&self, outcome: Outcome) {
        match outcome {
            Outcome::miss => &self.miss,
            Outcome::replayed => &self.replayed,
            Outcome::in_flight_conflict => &self.in_flight_conflict,
            Outcome::mismatch => &self.mismatch,
            Outcome::not_replayable => &self.not_replayable,
            Outcome::expired => &self.expired,
            Outcome::passthrough => &self.passthrough,
            Outcome::store_error => &self.store_error,
            Outcome::rejected_invalid => &self.rejected_invalid,
        }
        .inc();
    }
}

/// The latency histogram of each store operation.
#[derive(Clone, Debug)]
pub(crate) struct StoreOpMetrics {
    claim: Histogram,
    complete: Histogram,
    release: Histogram,
    renew: Histogram,
}

impl StoreOpMetrics {
    /// Record how long one `op` took.
    pub(crate) fn observe(&self, op: StoreOp, took: Duration) {
        match op {
            StoreOp::claim => &self.claim,
            StoreOp::complete => &self.complete,
            StoreOp::release => &self.release,
            StoreOp::renew => &self.renew,
        }
        .observe(took.as_secs_f64());
    }
}
