//! The gateway's OpenTelemetry traces (`[telemetry]`): which requests are recorded, the tracing
//! layer that turns their spans into OTel spans, and the exporter that sends those to a
//! collector over OTLP/HTTP without ever holding up a request.
//!
//! Sampling comes first. `Sampling`, the outermost service, decides per request before any
//! span exists: a client's `traceparent` decides by its sampled flag, a request without one is
//! recorded with probability `sample_ratio`. Only then does the engine's debug-level
//! `idempotent_request` span, and its children (store operations, the upstream call), pass
//! the OTel layer's filter ([`SampledSpans`]); an unsampled request creates no span at all.
//!
//! The export runs apart from the workers: ended spans go into the SDK's batch queue (bounded,
//! [`MAX_QUEUED_SPANS`]), a thread of the SDK sends them in batches, on a one-thread runtime of
//! its own. A span that finds the queue full, or whose export fails (the collector down, slow
//! past the exporter's timeout, or refusing), is dropped and counted in
//! `idemgate_trace_spans_dropped_total`.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::Context as OtelContext;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, SpanData, SpanExporter,
    SpanProcessor,
};
use opentelemetry_sdk::Resource;
use prometheus_client::metrics::counter::Counter;
use tracing::subscriber::Interest;
use tracing::{Metadata, Subscriber};
use tracing_subscriber::layer::{Context as LayerContext, Filter};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::config::TelemetryConfig;
use crate::idempotency::trace::{self, REQUEST_SPAN};
use crate::idempotency::TRACEPARENT;
use crate::metrics::{registered, Families};

/// Ended spans waiting for export, at most; past it a span is dropped (and counted).
pub const MAX_QUEUED_SPANS: usize = 2048;

/// How long a shutdown waits for the queued spans to be exported.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The name of the instrumentation scope spans are exported under.
const SCOPE: &str = "idemgate";

/// The exporter's HTTP client: over TLS with the config's client configuration for an https://
/// collector.
fn http_client(config: &TelemetryConfig) -> Arc<dyn opentelemetry_http::HttpClient> {
    use opentelemetry_http::hyper::HyperClient;
    match &config.tls {
        Some(tls) => {
            let https = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config((**tls).clone())
                .https_only()
                .enable_http1()
                .build();
            Arc::new(HyperClient::new(https, EXPORT_TIMEOUT, None))
        }
        None => Arc::new(HyperClient::with_default_connector(EXPORT_TIMEOUT, None)),
    }
}

/// A running exporter: the tracer provider, and the runtime its HTTP client runs on.
pub struct Telemetry {
    provider: SdkTracerProvider,
    runtime: tokio::runtime::Runtime,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Telemetry")
    }
}

/// Telemetry's metric family: the spans dropped instead of exported.
#[derive(Debug)]
pub struct SpanMetrics {
    /// Spans dropped (given to the exporter to count into).
    pub dropped: Counter,
}

impl Families for SpanMetrics {
    fn register(registry: &mut prometheus_client::registry::Registry) -> Self {
        SpanMetrics {
            dropped: registered(
                registry,
                "idemgate_trace_spans_dropped",
                "Trace spans not exported ([telemetry]): the export queue was full, or the collector refused or did not answer",
                Counter::default(),
            ),
        }
    }
}

impl Telemetry {
    /// Start exporting to `config`'s collector, counting dropped spans into `dropped`. Nothing
    /// is sent until spans end; a collector that is not there is not an error here.
    pub fn start(config: &TelemetryConfig, dropped: Counter) -> Result<Self, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("idemgate-otlp")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the trace exporter's thread: {e}"))?;
        let resource = Resource::builder()
            .with_service_name(config.service_name.clone())
            .build();
        let mut otlp = {
            // The hyper client is made inside the runtime it will run on.
            let _entered = runtime.enter();
            opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(Protocol::HttpBinary)
                .with_endpoint(config.traces_url.to_string())
                .with_shared_http_client(http_client(config))
                .with_timeout(EXPORT_TIMEOUT)
                .build()
                .map_err(|e| format!("cannot build the trace exporter: {e}"))?
        };
        otlp.set_resource(&resource);
        let queued = Arc::new(AtomicUsize::new(0));
        let exporter = CountingExporter {
            inner: Arc::new(otlp),
            runtime: runtime.handle().clone(),
            queued: queued.clone(),
            dropped: dropped.clone(),
            failing: AtomicBool::new(false),
        };
        let batch = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(MAX_QUEUED_SPANS)
                    .build(),
            )
            .build();
        let processor = BoundedProcessor {
            inner: batch,
            queued,
            dropped,
        };
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            // Sampling was decided before the span existed (`Sampling`): every span that
            // reaches the SDK is recorded.
            .with_sampler(Sampler::AlwaysOn)
            .with_resource(resource)
            .build();
        Ok(Telemetry { provider, runtime })
    }

    /// The tracing layer that records the spans of sampled requests as OTel spans.
    pub fn layer<S>(&self) -> impl Layer<S>
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer(SCOPE))
            // What each span carries is its own fields; no code location, thread or target,
            // and no OTel context switched on every poll (the parent comes from the span tree).
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_context_activation(false)
            .with_filter(SampledSpans)
    }

    /// Export what is queued (for at most a few seconds) and stop.
    pub async fn shutdown(self) {
        let Telemetry { provider, runtime } = self;
        // A blocking call: it waits for the SDK's thread, whose exports run on `runtime`.
        let flushed =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT))
                .await;
        if let Ok(Err(e)) = flushed {
            tracing::warn!(error = %e, "trace exporter did not flush before stopping");
        }
        runtime.shutdown_background();
    }
}

/// How long one export may take, retries included (the OTLP exporter's default).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

// === sampling ===

thread_local! {
    // Set while a sampled request's service call runs (synchronously, on this thread): the
    // span of the request is created in that call.
    static SAMPLING: Cell<bool> = const { Cell::new(false) };
}

/// Marks the current thread as running a sampled request's call, until dropped.
struct SampledCall;

impl SampledCall {
    fn start() -> Self {
        SAMPLING.with(|s| s.set(true));
        SampledCall
    }
}

impl Drop for SampledCall {
    fn drop(&mut self) {
        SAMPLING.with(|s| s.set(false));
    }
}

/// The outermost service of a gateway with `[telemetry]`: decides whether a request is
/// recorded, and under which parent, before the engine creates its span.
#[derive(Clone, Debug)]
pub(crate) struct Sampling<S> {
    inner: S,
    ratio: SampleRatio,
}

impl<S> Sampling<S> {
    pub(crate) fn new(inner: S, ratio: SampleRatio) -> Self {
        Sampling { inner, ratio }
    }
}

/// `sample_ratio`, shared by every worker's [`Sampling`] and changed by a reload.
#[derive(Clone, Debug, Default)]
pub(crate) struct SampleRatio(Arc<AtomicU64>);

impl SampleRatio {
    /// The ratio in force from now on.
    pub(crate) fn set(&self, ratio: f64) {
        self.0.store(ratio.to_bits(), Ordering::Relaxed);
    }

    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

impl<S, B> tower::Service<Request<B>> for Sampling<S>
where
    S: tower::Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> S::Future {
        match sampled_parent(req.headers(), self.ratio.get()) {
            None => self.inner.call(req),
            Some(parent) => {
                // The request's span takes its parent from the OTel context current while it
                // is created (it has no tracing parent).
                let _parent = parent.attach();
                let _sampled = SampledCall::start();
                self.inner.call(req)
            }
        }
    }
}

/// The parent of a request's trace when it is recorded; none when it is not. A client's
/// `traceparent` decides by its sampled flag (parent-based); without one (or with a malformed
/// one), the trace starts here with probability `ratio`.
fn sampled_parent(headers: &http::HeaderMap, ratio: f64) -> Option<OtelContext> {
    match headers
        .get(TRACEPARENT)
        .and_then(|v| trace::parse(v.as_bytes()))
    {
        Some(parent) if parent.is_sampled() => {
            Some(OtelContext::new().with_remote_span_context(parent))
        }
        Some(_) => None,
        None if ratio >= 1.0 || rand::random::<f64>() < ratio => Some(OtelContext::new()),
        None => None,
    }
}

/// The OTel layer's filter: the engine's spans of sampled requests, nothing else (no events,
/// no other crate's spans).
#[derive(Debug, Clone, Copy)]
pub struct SampledSpans;

impl SampledSpans {
    fn ours(meta: &Metadata<'_>) -> bool {
        meta.is_span() && meta.target().starts_with("idemgate")
    }

    /// Whether one of the engine's spans is recorded: a request's when it is sampled, a store
    /// operation's or upstream call's when it is inside a span that was (`in_recorded`).
    fn sampled(meta: &Metadata<'_>, in_recorded: impl FnOnce() -> bool) -> bool {
        if meta.name() == REQUEST_SPAN {
            SAMPLING.with(Cell::get)
        } else {
            in_recorded()
        }
    }
}

impl<S> Filter<S> for SampledSpans
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn enabled(&self, meta: &Metadata<'_>, cx: &LayerContext<'_, S>) -> bool {
        Self::ours(meta) && Self::sampled(meta, || cx.lookup_current().is_some())
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if Self::ours(meta) {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::DEBUG)
    }
}

/// A filter in front of every layer: the engine's spans of a request that is not sampled are
/// not made at all, unless the log asks for spans of their level (`logs_debug`). The per-layer
/// filters alone would leave the registry making, entering and closing spans that no layer
/// records, on every request.
#[derive(Debug, Clone, Copy)]
pub struct UnsampledOff {
    logs_debug: bool,
}

impl UnsampledOff {
    /// The gate for a log whose filter lets through at most `log_level` (`None`: unknown).
    pub fn new(log_level: Option<tracing::level_filters::LevelFilter>) -> Self {
        let debug = tracing::level_filters::LevelFilter::DEBUG;
        UnsampledOff {
            logs_debug: log_level.is_none_or(|level| level >= debug),
        }
    }
}

impl<S> Layer<S> for UnsampledOff
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if !self.logs_debug && SampledSpans::ours(meta) {
            Interest::sometimes()
        } else {
            Interest::always()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>, cx: LayerContext<'_, S>) -> bool {
        self.logs_debug
            || !SampledSpans::ours(meta)
            || SampledSpans::sampled(meta, || cx.lookup_current().is_some())
    }
}

// === export ===

/// The SDK's batch processor behind a bound of its own that counts what it turns away: the
/// SDK counts queue-full drops but does not tell. Spans handed on are counted in `queued`
/// until their export ends, so the SDK's queue (as large) never overflows.
#[derive(Debug)]
struct BoundedProcessor {
    inner: BatchSpanProcessor,
    queued: Arc<AtomicUsize>,
    dropped: Counter,
}

impl SpanProcessor for BoundedProcessor {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &OtelContext) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.queued.fetch_add(1, Ordering::Relaxed) >= MAX_QUEUED_SPANS {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            self.dropped.inc();
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, run on the exporter's runtime (its hyper client needs one; the SDK's
/// thread has none), counting the spans of a failed export as dropped. The first failure is
/// logged, and the recovery; not every failed batch.
#[derive(Debug)]
struct CountingExporter {
    inner: Arc<opentelemetry_otlp::SpanExporter>,
    runtime: tokio::runtime::Handle,
    queued: Arc<AtomicUsize>,
    dropped: Counter,
    // Whether the last export failed.
    failing: AtomicBool,
}

impl SpanExporter for CountingExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let inner = self.inner.clone();
        let exported = self
            .runtime
            .spawn(async move { inner.export(batch).await })
            .await
            .unwrap_or_else(|e| Err(OTelSdkError::InternalFailure(e.to_string())));
        self.queued.fetch_sub(spans, Ordering::Relaxed);
        match &exported {
            Ok(()) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("trace export works again");
                }
            }
            Err(e) => {
                self.dropped.inc_by(spans as u64);
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, spans, "trace export failed; spans are dropped (and counted in idemgate_trace_spans_dropped_total) until it works again");
                }
            }
        }
        exported
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        // Set before the exporter was shared; an export in progress holds a clone.
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.set_resource(resource);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, HeaderValue};

    fn with_traceparent(value: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(TRACEPARENT, HeaderValue::from_static(value));
        headers
    }

    #[test]
    fn a_client_traceparent_decides_by_its_flag() {
        let sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let parent = sampled_parent(&with_traceparent(sampled), 0.0).unwrap();
        let remote = parent.span().span_context().clone();
        assert_eq!(
            remote.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert!(remote.is_remote());
        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        assert!(sampled_parent(&with_traceparent(unsampled), 1.0).is_none());
    }

    #[test]
    fn without_one_the_ratio_decides() {
        let none = HeaderMap::new();
        assert!(sampled_parent(&none, 1.0).is_some());
        assert!(sampled_parent(&none, 0.0).is_none());
        assert!(sampled_parent(&with_traceparent("garbage"), 1.0).is_some());
        let sampled = (0..4000)
            .filter(|_| sampled_parent(&none, 0.25).is_some())
            .count();
        assert!((800..1200).contains(&sampled), "{sampled} of 4000 at 0.25");
    }

    /// Records the spans it is shown.
    struct Count(Arc<AtomicUsize>);

    impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Count {
        fn on_new_span(
            &self,
            _: &tracing::span::Attributes<'_>,
            _: &tracing::span::Id,
            _: LayerContext<'_, S>,
        ) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Make the engine's request span and a store operation's inside it, under `subscriber`;
    /// whether each exists (is not disabled).
    fn made(subscriber: impl Subscriber + Send + Sync + 'static, sampled: bool) -> (bool, bool) {
        tracing::subscriber::with_default(subscriber, || {
            let _sampled = sampled.then(SampledCall::start);
            let request = tracing::debug_span!(target: "idemgate::idempotency::service", "idempotent_request");
            let _in = request.enter();
            let op = tracing::debug_span!(target: "idemgate::idempotency::shared", "store.claim");
            (!request.is_disabled(), !op.is_disabled())
        })
    }

    #[test]
    fn an_unsampled_request_makes_no_span_at_all() {
        use tracing_subscriber::layer::SubscriberExt;
        let world = |gate: UnsampledOff, recorded: &Arc<AtomicUsize>| {
            let log = tracing_subscriber::EnvFilter::new("info");
            tracing_subscriber::registry()
                .with(gate)
                .with(tracing_subscriber::fmt::layer().with_filter(log))
                .with(Count(recorded.clone()).with_filter(SampledSpans))
        };
        let info = UnsampledOff::new(Some(tracing::level_filters::LevelFilter::INFO));
        let recorded = Arc::new(AtomicUsize::new(0));
        assert_eq!(made(world(info, &recorded), false), (false, false));
        assert_eq!(recorded.load(Ordering::SeqCst), 0);
        assert_eq!(made(world(info, &recorded), true), (true, true));
        assert_eq!(
            recorded.load(Ordering::SeqCst),
            2,
            "a sampled request's spans are recorded"
        );
        // A log at debug level wants the spans of every request.
        let debug = UnsampledOff::new(Some(tracing::level_filters::LevelFilter::DEBUG));
        assert_eq!(made(world(debug, &recorded), false), (true, true));
        assert_eq!(
            recorded.load(Ordering::SeqCst),
            2,
            "but the OTel layer still records none"
        );
    }
}
