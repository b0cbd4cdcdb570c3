//! What every clone of a layer and its services share: the store, the route table, the tracker
//! of claimed calls, the metrics. The protocol (`service.rs`) and the lease (`lease.rs`) both
//! work on it.

use std::future::Future;
use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::{debug_span, Instrument, Span};

use super::jsonrpc::metrics::JsonRpcMetrics;
use super::live::LiveAnswers;
use super::metrics::{EngineMetrics, StoreOp, StoreOpMetrics};
use super::routes::LiveTable;
use super::webhook::WebhookMetrics;
use crate::metrics::Metrics;

/// What every clone of a layer and its services share.
pub(crate) struct Shared<St> {
    // Where records live.
    pub(crate) store: St,
    // Which policy a path gets, with the routes' live state.
    pub(crate) table: LiveTable,
    // Every claimed call, so that a shutdown can wait for them to be recorded.
    pub(crate) tasks: TaskTracker,
    // The registry the layer counts into, and the engine's families in it.
    pub(crate) registry: Metrics,
    pub(crate) metrics: Arc<EngineMetrics>,
    pub(crate) jsonrpc: Arc<JsonRpcMetrics>,
    pub(crate) webhooks: Arc<WebhookMetrics>,
    // The streamed answers being recorded in this process, for duplicates to attach to.
    pub(crate) live: Arc<LiveAnswers>,
    // The store-operation histograms, resolved once.
    ops: StoreOpMetrics,
}

impl<St> Shared<St> {
    pub(crate) fn new(
        store: St,
        table: LiveTable,
        registry: Metrics,
        tasks: TaskTracker,
        live: Arc<LiveAnswers>,
    ) -> Self {
        let metrics = registry.families::<EngineMetrics>();
        Shared {
            store,
            table,
            tasks,
            live,
            ops: metrics.store_ops(),
            metrics,
            jsonrpc: registry.families(),
            webhooks: registry.families(),
            registry,
        }
    }

    /// Await a store operation, recording its latency, in a span of its own (at debug level:
    /// disabled unless asked for, as the request's).
    pub(super) async fn timed<T>(&self, op: StoreOp, f: impl Future<Output = T>) -> T {
        let started = Instant::now();
        let out = f.instrument(op_span(op)).await;
        self.ops.observe(op, started.elapsed());
        out
    }
}

/// The span of one store operation.
fn op_span(op: StoreOp) -> Span {
    match op {
        StoreOp::claim => debug_span!("store.claim"),
        StoreOp::complete => debug_span!("store.complete"),
        StoreOp::release => debug_span!("store.release"),
        StoreOp::renew => debug_span!("store.renew"),
    }
}
