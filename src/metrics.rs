//! Prometheus metrics (prometheus-client, the Prometheus project's own Rust client: typed
//! families that register themselves with help strings, OpenMetrics text out).
//!
//! Per-request work is kept to atomic increments: every (route, outcome) counter and every
//! store-operation histogram is resolved once, when the route table is built, not per request.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Where an in-process store (memory, embedded) counts the completed records it evicted before
/// their TTL to stay within a bound: a retry of such a record runs again. (Expired records are
/// not counted: their purge loses nothing.)
#[derive(Debug, Clone, Default)]
pub struct Evictions {
    /// Records evicted because the store held `max_entries`.
    pub max_entries: Counter,
    /// Records evicted because the store held `max_bytes`.
    pub max_bytes: Counter,
}

impl Evictions {
    /// Count `n` evictions, made for the entry bound when `for_entries`, else for the byte bound.
    pub(crate) fn count(&self, for_entries: bool, n: u64) {
        if n > 0 {
            match for_entries {
                true => self.max_entries.inc_by(n),
                false => self.max_bytes.inc_by(n),
            };
        }
    }
}

/// Why a stored record did not open: the `reason` label of
/// `idemgate_records_unreadable_total` (the tag did not verify, the key id is not listed, a clear
/// record where sealing is required).
pub const UNREADABLE_REASONS: [&str; 3] = ["tampered", "unknown_key", "clear"];

/// What happened to a request, as counted by `idemgate_requests_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Outcome {
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
    pub const ALL: [Outcome; 9] = [
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
    pub fn as_str(self) -> &'static str {
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
pub enum Unsettled {
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
    pub const ALL: [Unsettled; 3] = [Unsettled::timeout, Unsettled::failed, Unsettled::unrecorded];
}

/// A claimed call counted in `idemgate_in_flight` for as long as it lives: the gauge goes down
/// however the call's task ends (a panic, a shutdown that drops it).
pub struct InFlight(Gauge);

impl InFlight {
    /// Count one more claimed call in flight, until the guard is dropped.
    pub fn count(metrics: &Metrics) -> Self {
        let gauge = metrics.in_flight().clone();
        gauge.inc();
        InFlight(gauge)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A request whose answer is not given yet: dropped before [`answered`](Self::answered) (its
/// client went away and the server dropped the request), it counts the request in
/// `idemgate_client_disconnects_total` with the outcome it had come to, `undecided` before that.
pub(crate) struct Unanswered<'m> {
    metrics: &'m Metrics,
    // 0: undecided; else the index in `Outcome::ALL` plus one.
    decided: std::sync::atomic::AtomicU8,
    answered: bool,
}

impl<'m> Unanswered<'m> {
    pub(crate) fn new(metrics: &'m Metrics) -> Self {
        Unanswered {
            metrics,
            decided: Default::default(),
            answered: false,
        }
    }

    /// The request has come to `outcome`, though its answer is still to come.
    pub(crate) fn decided(&self, outcome: Outcome) {
        let at = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        self.decided
            .store(at as u8 + 1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The answer is given: nothing to count.
    pub(crate) fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let at = self.decided.load(std::sync::atomic::Ordering::Relaxed) as usize;
        let outcome = at
            .checked_sub(1)
            .and_then(|at| Outcome::ALL.get(at))
            .map_or("undecided", |o| o.as_str());
        self.metrics
            .inner
            .disconnects
            .get_or_create(&DisconnectLabels { outcome })
            .inc();
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DisconnectLabels {
    outcome: &'static str,
}

/// A store operation, as labelled in `idemgate_store_operation_seconds{operation}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum StoreOp {
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
struct RouteLabels {
    route: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct UnsettledLabels {
    route: String,
    reason: Unsettled,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OpLabels {
    operation: StoreOp,
}

/// What became of a request the proxy sent, as counted by
/// `idemgate_upstream_requests_total{upstream, result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum UpstreamResult {
    /// A response head came back.
    response,
    /// No connection could be made: nothing was sent.
    not_sent,
    /// The TLS handshake failed (or was refused): nothing was processed.
    tls_failed,
    /// Failed after the request may have been sent.
    failed,
    /// No response head within the route's `upstream_timeout`.
    timeout,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct UpstreamLabels {
    upstream: String,
    result: UpstreamResult,
}

/// Why the gateway closed a client connection, as counted by
/// `idemgate_client_connections_closed_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ClosedBy {
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

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct UpstreamName {
    upstream: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// The process's metrics; cheap to clone, clones share the values.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    unsettled: Family<UnsettledLabels, Counter>,
    grpc_streaming_keyed: Family<RouteLabels, Counter>,
    overhead: Histogram,
    upstream: Histogram,
    store_ops: HistogramFamily<OpLabels>,
    in_flight: Gauge,
    replayed_bytes: Counter,
    store_errors_passed: Counter,
    store: StoreFamilies,
    disconnects: Family<DisconnectLabels, Counter>,
    trace_spans_dropped: Counter,
    upstream_requests: Family<UpstreamLabels, Counter>,
    upstream_connections: Family<UpstreamName, Counter>,
    clients: ClientConnections,
    jsonrpc: crate::idempotency::jsonrpc::JsonRpcMetrics,
}

/// The store's families besides its operations' latency.
#[derive(Debug)]
struct StoreFamilies {
    unacknowledged: Family<OpLabels, Counter>,
    local_cache_hits: Counter,
    local_cache_entries: Gauge,
    local_cache_bytes: Gauge,
    store_commits: Counter,
    evictions: Family<ReasonLabels, Counter>,
    unreadable: Family<ReasonLabels, Counter>,
    not_replayable: Family<RouteLabels, Counter>,
}

impl StoreFamilies {
    fn register(registry: &mut Registry) -> Self {
        let unacknowledged = registered(
            registry,
            "idemgate_store_unacknowledged_writes",
            "Claims and completions fewer replicas than store.wait_replicas acknowledged in time",
            Family::<OpLabels, Counter>::default(),
        );
        let local_cache_hits = registered(
            registry,
            "idemgate_local_cache_hits",
            "Replays served from this process's local cache of completed records, with no store round trip (Redis and PostgreSQL)",
            Counter::default(),
        );
        let local_cache_entries = registered(
            registry,
            "idemgate_local_cache_entries",
            "Completed records in this process's local cache (Redis and PostgreSQL; read when scraped)",
            Gauge::default(),
        );
        let local_cache_bytes = registered(
            registry,
            "idemgate_local_cache_bytes",
            "Bytes in this process's local cache, responses plus 128 per entry (Redis and PostgreSQL; read when scraped)",
            Gauge::default(),
        );
        let store_commits = registered(
            registry,
            "idemgate_store_commits",
            "Durable commits (fsyncs) of the embedded store; divided by the misses, fsyncs per miss (embedded only)",
            Counter::default(),
        );
        let evictions = registered(
            registry,
            "idemgate_store_evictions",
            "Completed records the memory or embedded store evicted before their TTL to stay within a bound (reason: max_entries, max_bytes); a retry of one runs again",
            Family::<ReasonLabels, Counter>::default(),
        );
        let unreadable = registered(
            registry,
            "idemgate_records_unreadable",
            "Stored records that did not open (reason: tampered, unknown_key, clear) and were refused, never replayed nor run again",
            Family::<ReasonLabels, Counter>::default(),
        );
        let not_replayable = registered(
            registry,
            "idemgate_records_not_replayable",
            "Responses recorded without their body because it passed the route's max_body (by route): a retry of such a key gets 409 not-replayable",
            Family::<RouteLabels, Counter>::default(),
        );
        StoreFamilies {
            unacknowledged,
            local_cache_hits,
            local_cache_entries,
            local_cache_bytes,
            store_commits,
            evictions,
            unreadable,
            not_replayable,
        }
    }
}

/// The upstream families: requests by result, connections opened.
fn register_upstream(
    registry: &mut Registry,
) -> (
    Family<UpstreamLabels, Counter>,
    Family<UpstreamName, Counter>,
) {
    let upstream_requests = Family::<UpstreamLabels, Counter>::default();
    registry.register(
        "idemgate_upstream_requests",
        "Requests the proxy sent, by upstream and what became of them",
        upstream_requests.clone(),
    );
    let upstream_connections = Family::<UpstreamName, Counter>::default();
    registry.register(
        "idemgate_upstream_connections_opened",
        "Connections opened to each upstream (TCP, and the TLS handshake for https)",
        upstream_connections.clone(),
    );
    (upstream_requests, upstream_connections)
}

/// The client connections' families.
struct ClientConnections {
    open: Gauge,
    closed: Family<ClosedLabels, Counter>,
    at_cap: Counter<f64, std::sync::atomic::AtomicU64>,
    too_slow: Counter,
}

impl ClientConnections {
    fn register(registry: &mut Registry) -> Self {
        let open = Gauge::default();
        registry.register(
            "idemgate_client_connections",
            "Client connections open in this process",
            open.clone(),
        );
        let closed = Family::<ClosedLabels, Counter>::default();
        registry.register(
            "idemgate_client_connections_closed",
            "Client connections the gateway closed, by the timeout that ended them",
            closed.clone(),
        );
        let at_cap = Counter::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "idemgate_client_connections_at_cap_seconds",
            "Time spent with max_client_connections open, new connections waiting in the kernel's backlog",
            at_cap.clone(),
        );
        let too_slow = Counter::default();
        registry.register(
            "idemgate_client_bodies_too_slow",
            "Request bodies cut for arriving slower than client_min_body_rate, answered 408",
            too_slow.clone(),
        );
        ClientConnections {
            open,
            closed,
            at_cap,
            too_slow,
        }
    }
}

/// Count one event of `route` in `family` (events rare enough to look their series up).
fn count_for(family: &Family<RouteLabels, Counter>, route: &str) {
    let route = route.to_string();
    family.get_or_create(&RouteLabels { route }).inc();
}

/// `metric`, registered as `name` with `help`.
fn registered<M: prometheus_client::registry::Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

fn latency_histogram() -> Histogram {
    // 50 µs to about 26 s.
    Histogram::new(exponential_buckets(0.00005, 2.0, 20))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    /// A fresh registry with every idemgate family registered.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let requests = registered(
            &mut registry,
            "idemgate_requests",
            "Requests by route and outcome",
            Family::<RequestLabels, Counter>::default(),
        );
        let unsettled = registered(
            &mut registry,
            "idemgate_calls_unsettled",
            "Keyed upstream calls a retry may run again (by route and reason): timeout and failed, whose outcome is unknown, so the key stays claimed until its lease ends; unrecorded, whose answer was delivered but not recorded",
            Family::<UnsettledLabels, Counter>::default(),
        );
        let grpc_streaming_keyed = registered(
            &mut registry,
            "idemgate_grpc_streaming_keyed",
            "gRPC calls with an idempotency key passed on without idempotency because they stream (client or bidirectional streaming, or held open past a second), by route: the key is not applied, and a retry runs again",
            Family::<RouteLabels, Counter>::default(),
        );
        let overhead = registered(
            &mut registry,
            "idemgate_overhead_seconds",
            "Time the gateway itself adds to a request (total minus time waiting for the upstream)",
            latency_histogram(),
        );
        let upstream = registered(
            &mut registry,
            "idemgate_upstream_duration_seconds",
            "Time from forwarding a request to having the upstream's response (head, and body when recorded)",
            latency_histogram(),
        );
        let store_ops: HistogramFamily<OpLabels> = registered(
            &mut registry,
            "idemgate_store_operation_seconds",
            "Latency of store operations by operation",
            Family::new_with_constructor(latency_histogram),
        );
        let in_flight = registered(
            &mut registry,
            "idemgate_in_flight_claims",
            "Keys this process holds claimed while their upstream call runs",
            Gauge::default(),
        );
        let replayed_bytes = registered(
            &mut registry,
            "idemgate_replayed_bytes",
            "Response body bytes served from stored records",
            Counter::default(),
        );
        let store_errors_passed = registered(
            &mut registry,
            "idemgate_store_error_passthrough",
            "Keyed requests forwarded WITHOUT idempotency because the store was down (on_store_error = \"pass\")",
            Counter::default(),
        );
        let disconnects = registered(
            &mut registry,
            "idemgate_client_disconnects",
            "Requests whose client went away before their answer, by the outcome they had come to (undecided: before the claim was answered); a claimed call runs on and is recorded",
            Family::<DisconnectLabels, Counter>::default(),
        );
        let trace_spans_dropped = registered(
            &mut registry,
            "idemgate_trace_spans_dropped",
            "Trace spans not exported ([telemetry]): the export queue was full, or the collector refused or did not answer",
            Counter::default(),
        );
        let store = StoreFamilies::register(&mut registry);
        let (upstream_requests, upstream_connections) = register_upstream(&mut registry);
        let clients = ClientConnections::register(&mut registry);
        let jsonrpc = crate::idempotency::jsonrpc::JsonRpcMetrics::register(&mut registry);
        let metrics = Metrics {
            inner: Arc::new(Inner {
                clients,
                upstream_requests,
                upstream_connections,
                registry,
                requests,
                unsettled,
                grpc_streaming_keyed,
                overhead,
                upstream,
                store_ops,
                in_flight,
                replayed_bytes,
                store_errors_passed,
                store,
                disconnects,
                trace_spans_dropped,
                jsonrpc,
            }),
        };
        metrics.start_at_zero();
        metrics
    }

    /// Every series of a label set known up front starts at zero: a rule's `increase()` then
    /// sees the first event, and a dashboard shows zero instead of no data.
    fn start_at_zero(&self) {
        let m = &self.inner;
        for reason in [
            ClosedBy::header_timeout,
            ClosedBy::idle_timeout,
            ClosedBy::stalled,
        ] {
            drop(m.clients.closed.get_or_create(&ClosedLabels { reason }));
        }
        for operation in [StoreOp::claim, StoreOp::complete] {
            drop(
                m.store
                    .unacknowledged
                    .get_or_create(&OpLabels { operation }),
            );
        }
        for outcome in Outcome::ALL.iter().map(|o| o.as_str()).chain(["undecided"]) {
            drop(m.disconnects.get_or_create(&DisconnectLabels { outcome }));
        }
        for reason in ["max_entries", "max_bytes"] {
            drop(m.store.evictions.get_or_create(&ReasonLabels { reason }));
        }
        for reason in UNREADABLE_REASONS {
            drop(m.store.unreadable.get_or_create(&ReasonLabels { reason }));
        }
    }

    /// The JSON-RPC routes' family.
    pub(crate) fn jsonrpc(&self) -> &crate::idempotency::jsonrpc::JsonRpcMetrics {
        &self.inner.jsonrpc
    }

    /// The counters of one route, one per outcome, resolved now so requests only increment.
    pub fn route(&self, route: &str) -> RouteMetrics {
        let labels = RouteLabels {
            route: route.to_string(),
        };
        drop(self.inner.store.not_replayable.get_or_create(&labels));
        drop(self.inner.grpc_streaming_keyed.get_or_create(&labels));
        for reason in Unsettled::ALL {
            let route = route.to_string();
            drop(
                self.inner
                    .unsettled
                    .get_or_create(&UnsettledLabels { route, reason }),
            );
        }
        let counter = |outcome| {
            self.inner
                .requests
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
    pub fn store_ops(&self) -> StoreOpMetrics {
        let histogram = |operation| {
            self.inner
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

    /// The counters of one upstream, resolved now.
    pub fn upstream_counters(&self, upstream: &str) -> UpstreamCounters {
        let result = |result| {
            self.inner
                .upstream_requests
                .get_or_create(&UpstreamLabels {
                    upstream: upstream.to_string(),
                    result,
                })
                .clone()
        };
        UpstreamCounters {
            response: result(UpstreamResult::response),
            not_sent: result(UpstreamResult::not_sent),
            tls_failed: result(UpstreamResult::tls_failed),
            failed: result(UpstreamResult::failed),
            timeout: result(UpstreamResult::timeout),
            opened: self
                .inner
                .upstream_connections
                .get_or_create(&UpstreamName {
                    upstream: upstream.to_string(),
                })
                .clone(),
        }
    }

    /// Record the gateway's own time for one request.
    pub fn overhead(&self, d: Duration) {
        self.inner.overhead.observe(d.as_secs_f64());
    }

    /// Record one upstream call.
    pub fn upstream(&self, d: Duration) {
        self.inner.upstream.observe(d.as_secs_f64());
    }

    /// The in-flight claims gauge.
    pub fn in_flight(&self) -> &Gauge {
        &self.inner.in_flight
    }

    /// Count replayed body bytes.
    pub fn replayed_bytes(&self, n: usize) {
        self.inner.replayed_bytes.inc_by(n as u64);
    }

    /// Count a keyed request forwarded without idempotency because the store was down.
    pub fn store_error_passed(&self) {
        self.inner.store_errors_passed.inc();
    }

    /// The counters the memory and the embedded store count their evictions for room into.
    pub fn store_evictions(&self) -> Evictions {
        let of = |reason| {
            self.inner
                .store
                .evictions
                .get_or_create(&ReasonLabels { reason })
                .clone()
        };
        Evictions {
            max_entries: of("max_entries"),
            max_bytes: of("max_bytes"),
        }
    }

    /// Count a stored record that did not open, by why (`tampered`, `unknown_key`, `clear`).
    pub fn unreadable(&self, reason: &'static str) {
        self.inner
            .store
            .unreadable
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Count a response of `route` recorded as not replayable (its body passed `max_body`).
    pub fn not_replayable(&self, route: &str) {
        count_for(&self.inner.store.not_replayable, route);
    }

    /// Count a keyed gRPC call of `route` passed on without idempotency because it streams.
    pub fn grpc_streaming_keyed(&self, route: &str) {
        count_for(&self.inner.grpc_streaming_keyed, route);
    }

    /// Count a keyed call of `route` whose outcome is unknown, by why.
    pub fn unsettled(&self, route: &str, reason: Unsettled) {
        let route = route.to_string();
        self.inner
            .unsettled
            .get_or_create(&UnsettledLabels { route, reason })
            .inc();
    }

    /// Count a claim or completion that too few replicas acknowledged (`wait_replicas`).
    pub fn unacknowledged(&self, operation: StoreOp) {
        self.inner
            .store
            .unacknowledged
            .get_or_create(&OpLabels { operation })
            .inc();
    }

    /// The counter of replays served from the local cache (given to the cache to count into).
    pub fn local_cache_hits(&self) -> Counter {
        self.inner.store.local_cache_hits.clone()
    }

    /// The counter of the embedded store's durable commits (given to the store to count into).
    pub fn store_commits(&self) -> Counter {
        self.inner.store.store_commits.clone()
    }

    /// The counter of trace spans dropped (given to the exporter to count into).
    pub fn trace_spans_dropped(&self) -> Counter {
        self.inner.trace_spans_dropped.clone()
    }

    /// Record the local cache's size (entries, bytes), just before a scrape.
    pub fn local_cache_size(&self, entries: u64, bytes: u64) {
        let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.inner.store.local_cache_entries.set(clamp(entries));
        self.inner.store.local_cache_bytes.set(clamp(bytes));
    }

    /// The open client connections gauge.
    pub fn client_connections(&self) -> &Gauge {
        &self.inner.clients.open
    }

    /// Count a client connection closed by `reason`.
    pub fn client_closed(&self, reason: ClosedBy) {
        self.inner
            .clients
            .closed
            .get_or_create(&ClosedLabels { reason })
            .inc();
    }

    /// Count a request body cut for arriving slower than `client_min_body_rate`.
    pub fn client_body_too_slow(&self) {
        self.inner.clients.too_slow.inc();
    }

    /// Add time spent at `max_client_connections`.
    pub fn at_connection_cap(&self, d: Duration) {
        self.inner.clients.at_cap.inc_by(d.as_secs_f64());
    }

    /// The OpenMetrics text exposition of every family.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.inner.registry) {
            tracing::error!(error = %e, "the metrics could not be encoded whole");
        }
        out
    }
}

/// One route's outcome counters.
#[derive(Clone, Debug)]
pub struct RouteMetrics {
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
    pub fn count(&self, outcome: Outcome) {
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
pub struct StoreOpMetrics {
    claim: Histogram,
    complete: Histogram,
    release: Histogram,
    renew: Histogram,
}

impl StoreOpMetrics {
    /// Record how long one `op` took.
    pub fn observe(&self, op: StoreOp, took: Duration) {
        match op {
            StoreOp::claim => &self.claim,
            StoreOp::complete => &self.complete,
            StoreOp::release => &self.release,
            StoreOp::renew => &self.renew,
        }
        .observe(took.as_secs_f64());
    }
}

/// One upstream's counters.
#[derive(Clone, Debug)]
pub struct UpstreamCounters {
    response: Counter,
    not_sent: Counter,
    tls_failed: Counter,
    failed: Counter,
    timeout: Counter,
    opened: Counter,
}

impl UpstreamCounters {
    /// Count one request with `result`.
    pub fn count(&self, result: UpstreamResult) {
        match result {
            UpstreamResult::response => &self.response,
            UpstreamResult::not_sent => &self.not_sent,
            UpstreamResult::tls_failed => &self.tls_failed,
            UpstreamResult::failed => &self.failed,
            UpstreamResult::timeout => &self.timeout,
        }
        .inc();
    }

    /// Count one connection opened.
    pub fn opened(&self) {
        self.opened.inc();
    }
}
