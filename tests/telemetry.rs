//! OpenTelemetry traces (`[telemetry]`): the gateway binary exports to an OTLP/HTTP receiver
//! this test runs, which decodes each export with `opentelemetry-proto`, over plain HTTP or TLS
//! (mutual, with a private CA); and a collector that is down or refuses the gateway costs
//! dropped (counted) spans, not answers.

use crate::common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use sha2::{Digest, Sha256};

use common::{
    binary, client, free_port, send, wait_until, CountingUpstream, GatewayConfig, GatewayProcess,
    TestCa, Validity,
};

/// An OTLP/HTTP receiver: every export's raw bytes, kept for the test to decode, and the
/// `x-api-key` each came with.
#[derive(Clone, Default)]
struct Receiver {
    exports: Arc<Mutex<Vec<Bytes>>>,
    api_keys: Arc<Mutex<Vec<String>>>,
}

impl Receiver {
    /// Listen on a free loopback port; `POST /v1/traces` answers 200 with an empty
    /// `ExportTraceServiceResponse`.
    async fn start() -> (Self, SocketAddr) {
        let (receiver, app) = Receiver::app();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (receiver, addr)
    }

    /// The same over TLS with `tls`.
    async fn start_tls(tls: Arc<rustls::ServerConfig>) -> (Self, SocketAddr) {
        let (receiver, app) = Receiver::app();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        common::tls::serve_tls(listener, tls, app);
        (receiver, addr)
    }

    /// A receiver and the app that fills it.
    fn app() -> (Self, axum::Router) {
        let receiver = Receiver::default();
        let kept = receiver.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            post(move |headers: axum::http::HeaderMap, body: Bytes| {
                let kept = kept.clone();
                async move {
                    kept.exports.lock().unwrap().push(body);
                    let api_key = headers.get("x-api-key").map(|v| v.to_str().unwrap());
                    let api_key = api_key.unwrap_or_default().to_string();
                    kept.api_keys.lock().unwrap().push(api_key);
                    (
                        [("content-type", "application/x-protobuf")],
                        Vec::<u8>::new(),
                    )
                }
            }),
        );
        (receiver, app)
    }

    /// Every span received so far, decoded, with the `service.name` it came under.
    fn spans(&self) -> Vec<(String, Span)> {
        let mut spans = Vec::new();
        for export in self.exports.lock().unwrap().iter() {
            let request = ExportTraceServiceRequest::decode(export.clone()).expect("OTLP protobuf");
            for resource in request.resource_spans {
                let service = resource
                    .resource
                    .iter()
                    .flat_map(|r| &r.attributes)
                    .find(|kv| kv.key == "service.name")
                    .and_then(|kv| string(kv.value.as_ref()?.value.as_ref()?))
                    .unwrap_or_default();
                for scope in resource.scope_spans {
                    spans.extend(scope.spans.into_iter().map(|s| (service.clone(), s)));
                }
            }
        }
        spans
    }

    /// Whether `needle` appears anywhere in what was exported.
    fn carries(&self, needle: &[u8]) -> bool {
        let exports = self.exports.lock().unwrap();
        exports
            .iter()
            .any(|e| e.windows(needle.len()).any(|w| w == needle))
    }
}

fn string(value: &Value) -> Option<String> {
    match value {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(i) => Some(i.to_string()),
        _ => None,
    }
}

/// The value of `span`'s attribute `key`, as a string.
fn attribute(span: &Span, key: &str) -> Option<String> {
    let kv = span.attributes.iter().find(|kv| kv.key == key)?;
    string(kv.value.as_ref()?.value.as_ref()?)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
const REPLAY_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const REPLAY_SPAN: &str = "b7ad6b7169203331";
const KEY: &str = "order-7f3a-raw-key-never-exported";

/// A gateway exporting to `collector` at `sample_ratio`, with an admin listener, batching
/// every 100 ms so that the test waits little.
fn traced(upstream: &CountingUpstream, collector: &str, sample_ratio: f64) -> (GatewayConfig, u16) {
    let admin = free_port();
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .set("workers", 1)
        .set("admin.listen", &*format!("127.0.0.1:{admin}"))
        .set("telemetry.otlp_endpoint", collector)
        .set("telemetry.service_name", "gateway-under-test")
        .set("telemetry.sample_ratio", sample_ratio)
        .route("/v1/payments", toml::toml! { require_key = true })
        .env("OTEL_BSP_SCHEDULE_DELAY", "100");
    (config, admin)
}

/// What the gateway whose admin listener is on `admin` says it dropped.
async fn dropped(admin: u16) -> f64 {
    let series = "idemgate_trace_spans_dropped_total";
    common::metrics::metric(([127, 0, 0, 1], admin).into(), series).await
}

/// The one span named `name` whose parent is `parent`.
fn child<'a>(spans: &'a [(String, Span)], parent: &Span, name: &str) -> &'a Span {
    let found: Vec<_> = spans
        .iter()
        .map(|(_, s)| s)
        .filter(|s| s.name == name && s.parent_span_id == parent.span_id)
        .collect();
    assert_eq!(found.len(), 1, "one {name} span under {}", parent.name);
    found[0]
}

#[tokio::test]
async fn a_miss_and_its_replay_are_exported_with_parent_attributes_and_link() {
    let upstream = CountingUpstream::start().await;
    let (receiver, addr) = Receiver::start().await;
    let (config, _) = traced(&upstream, &format!("http://{addr}"), 0.0);
    let gateway = binary().start(&config).await;
    let http = client();
    let pay = |trace: &str, span: &str| {
        http.post(gateway.url("/v1/payments"))
            .header("idempotency-key", KEY)
            .header("traceparent", format!("00-{trace}-{span}-01"))
            .body("amount=100")
    };
    let miss = send(pay(CLIENT_TRACE, CLIENT_SPAN)).await;
    assert_eq!(miss.status, 201);
    let miss_forwarded = upstream.last_headers()["traceparent"].clone();
    let replay = send(pay(REPLAY_TRACE, REPLAY_SPAN)).await;
    assert!(replay.replayed());
    // Sampled by the clients' flags although sample_ratio is 0; an unsampled client is not.
    let not_sampled = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-00");
    let unsampled = http
        .post(gateway.url("/v1/payments"))
        .header("idempotency-key", "another-key")
        .header("traceparent", &not_sampled)
        .body("amount=1");
    assert_eq!(send(unsampled).await.status, 201);
    assert_eq!(
        upstream.last_headers()["traceparent"],
        *not_sampled,
        "forwarded unchanged"
    );

    wait_until(
        Duration::from_secs(10),
        "the receiver has the miss's and the replay's spans",
        async || {
            let spans = receiver.spans();
            ["miss", "replayed"].iter().all(|outcome| {
                spans.iter().any(|(_, s)| {
                    attribute(s, "outcome").as_deref() == Some(outcome)
                        && spans.iter().any(|(_, c)| c.parent_span_id == s.span_id)
                })
            }) && spans.iter().any(|(_, s)| s.name == "store.complete")
        },
    )
    .await;
    let spans = receiver.spans();
    let request = |outcome: &str| {
        let found: Vec<_> = spans
            .iter()
            .map(|(_, s)| s)
            .filter(|s| s.name == "idempotent_request")
            .filter(|s| attribute(s, "outcome").as_deref() == Some(outcome))
            .collect();
        assert_eq!(found.len(), 1, "one {outcome} span in {spans:#?}");
        found[0].clone()
    };
    let miss = request("miss");
    assert!(spans
        .iter()
        .all(|(service, _)| service == "gateway-under-test"));
    assert_eq!(hex(&miss.trace_id), CLIENT_TRACE, "the client's trace");
    assert_eq!(hex(&miss.parent_span_id), CLIENT_SPAN, "the client's span");
    assert_eq!(miss.kind, SpanKind::Server as i32);
    assert_eq!(attribute(&miss, "route").as_deref(), Some("/v1/payments"));
    assert_eq!(attribute(&miss, "method").as_deref(), Some("POST"));
    assert_eq!(attribute(&miss, "status").as_deref(), Some("201"));
    let short_hash = hex(&Sha256::digest(KEY)[..6]);
    assert_eq!(attribute(&miss, "key"), Some(short_hash));
    assert!(
        !receiver.carries(KEY.as_bytes()),
        "the raw key was exported"
    );

    for name in ["store.claim", "store.complete"] {
        let op = child(&spans, &miss, name);
        assert_eq!(op.trace_id, miss.trace_id);
    }
    let call = child(&spans, &miss, "upstream");
    assert_eq!(call.kind, SpanKind::Client as i32);
    // The upstream's parent is the gateway's upstream call, in the client's trace.
    let sent = format!("00-{CLIENT_TRACE}-{}-01", hex(&call.span_id));
    assert_eq!(miss_forwarded, *sent);

    let replayed = request("replayed");
    assert_eq!(hex(&replayed.trace_id), REPLAY_TRACE);
    assert_eq!(hex(&replayed.parent_span_id), REPLAY_SPAN);
    let links: Vec<_> = replayed
        .links
        .iter()
        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
        .collect();
    assert_eq!(
        links,
        [(hex(&miss.trace_id), hex(&miss.span_id))],
        "the replay links to the execution it replays"
    );
    assert_eq!(
        attribute(&replayed, "original_trace"),
        Some(format!(
            "00-{}-{}-01",
            hex(&miss.trace_id),
            hex(&miss.span_id)
        ))
    );
    child(&spans, &replayed, "store.claim");
    assert!(
        spans
            .iter()
            .all(|(_, s)| s.parent_span_id != replayed.span_id || s.name != "upstream"),
        "a replay calls no upstream"
    );
    // The unsampled request left no span: one miss, one replay.
    let requests = spans.iter().filter(|(_, s)| s.name == "idempotent_request");
    assert_eq!(requests.count(), 2);
}

#[tokio::test]
async fn a_collector_that_is_down_drops_and_counts_spans_and_requests_are_answered() {
    let upstream = CountingUpstream::start().await;
    // Nothing listens there.
    let down = format!("http://127.0.0.1:{}", free_port());
    let (config, admin) = traced(&upstream, &down, 1.0);
    let gateway = binary().start(&config).await;
    let http = client();
    for i in 0..20 {
        let pay = http
            .post(gateway.url("/v1/payments"))
            .header("idempotency-key", format!("key-{i}"))
            .body("amount=100");
        assert_eq!(send(pay).await.status, 201);
    }
    wait_until(
        Duration::from_secs(15),
        "dropped spans are counted",
        async || dropped(admin).await >= 20.0,
    )
    .await;
    assert_eq!(upstream.calls(), 20);
}

#[tokio::test]
async fn an_https_collector_with_a_private_ca_and_mutual_tls_gets_the_spans() {
    let ca = TestCa::new();
    let server = ca.server("collector", &["localhost"], Validity::Now);
    let (receiver, addr) = Receiver::start_tls(ca.server_config(&server, true)).await;
    let collector = format!("https://localhost:{}", addr.port());
    let upstream = CountingUpstream::start().await;
    let pay = |gateway: &GatewayProcess, key: &str| {
        client()
            .post(gateway.url("/v1/payments"))
            .header("idempotency-key", key)
            .body("amount=100")
    };
    // Trusting the collector's CA, and presenting a certificate it trusts: the spans arrive,
    // with the headers the environment gives.
    let presented = ca.client("gateway");
    let (config, _) = traced(&upstream, &collector, 1.0);
    let config = config
        .set("telemetry.ca_file", ca.ca())
        .set("telemetry.client_cert_file", presented.cert())
        .set("telemetry.client_key_file", presented.key_path())
        .env("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=collector-secret");
    let gateway = binary().start(&config).await;
    assert_eq!(send(pay(&gateway, "tls-1")).await.status, 201);
    wait_until(
        Duration::from_secs(10),
        "the collector has the request's spans",
        async || {
            receiver
                .spans()
                .iter()
                .any(|(_, s)| attribute(s, "outcome").as_deref() == Some("miss"))
        },
    )
    .await;
    let api_keys = receiver.api_keys.lock().unwrap().clone();
    assert!(
        api_keys.iter().all(|k| k == "collector-secret"),
        "{api_keys:?}"
    );
    // Without the client certificate the collector refuses the connection: the spans are
    // dropped and counted, and the request is answered all the same.
    let (config, admin) = traced(&upstream, &collector, 1.0);
    let gateway = binary()
        .start(&config.set("telemetry.ca_file", ca.ca()))
        .await;
    let before = receiver.spans().len();
    assert_eq!(send(pay(&gateway, "tls-2")).await.status, 201);
    wait_until(
        Duration::from_secs(15),
        "dropped spans are counted",
        async || dropped(admin).await >= 1.0,
    )
    .await;
    assert_eq!(receiver.spans().len(), before);
}

/// The `instance` of a problem answer: a `urn:uuid:` of a version 4 UUID.
fn instance_of(problem: &serde_json::Value) -> String {
    let instance = problem["instance"].as_str().unwrap_or_default().to_string();
    let uuid = instance.strip_prefix("urn:uuid:").unwrap_or_default();
    assert!(
        uuid.len() == 36 && uuid.as_bytes()[14] == b'4' && uuid.split('-').count() == 5,
        "not an urn:uuid: {problem}"
    );
    instance
}

#[tokio::test]
async fn a_refusal_carries_an_instance_found_in_its_log_line_and_its_span() {
    let upstream = CountingUpstream::start().await;
    let (receiver, addr) = Receiver::start().await;
    let (config, _) = traced(&upstream, &format!("http://{addr}"), 1.0);
    let config = config.route("/v1/charges", toml::toml! { error_format = "stripe" });
    let log = tempfile::NamedTempFile::new().unwrap();
    let gateway = binary()
        .env("RUST_LOG", "info")
        .log_to(log.path())
        .start(&config)
        .await;
    let http = client();
    let pay = |path: &str, body: &'static str| {
        http.post(gateway.url(path))
            .header("idempotency-key", "instance-key")
            .body(body)
    };
    let first = send(pay("/v1/payments", "amount=1")).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let mut instances = Vec::new();
    for _ in 0..2 {
        let mismatch = send(pay("/v1/payments", "amount=2")).await;
        assert_eq!(mismatch.status, 409);
        instances.push(instance_of(
            &serde_json::from_slice(&mismatch.body).unwrap(),
        ));
    }
    assert_ne!(instances[0], instances[1], "one instance per occurrence");
    // Stripe's shape carries it in its error object (the key, used on another path, is a
    // mismatch there: 400, as Stripe answers it).
    let stripe = send(pay("/v1/charges", "amount=1")).await;
    assert_eq!(stripe.status, 400);
    let stripe: serde_json::Value = serde_json::from_slice(&stripe.body).unwrap();
    instances.push(instance_of(&stripe["error"]));

    for instance in &instances {
        wait_until(
            Duration::from_secs(10),
            "the refusal's log line and span name its instance",
            async || {
                let logged = std::fs::read_to_string(log.path()).unwrap_or_default();
                let line = logged.lines().find(|l| l.contains(instance.as_str()));
                let spanned = receiver.spans().iter().any(|(_, s)| {
                    s.name == "idempotent_request"
                        && attribute(s, "instance").as_deref() == Some(instance)
                        && attribute(s, "outcome").as_deref() == Some("mismatch")
                });
                line.is_some_and(|l| l.contains("mismatch")) && spanned
            },
        )
        .await;
    }
}

#[tokio::test]
async fn a_reload_changes_the_sample_ratio() {
    let upstream = CountingUpstream::start().await;
    let (receiver, addr) = Receiver::start().await;
    let (config, admin) = traced(&upstream, &format!("http://{addr}"), 0.0);
    let gateway = binary().start(&config).await;
    let http = client();
    let pay = |key: &str| {
        http.post(gateway.url("/v1/payments"))
            .header("idempotency-key", key)
            .body("amount=100")
    };
    // The `key` attribute a request span carries for the key `key`.
    let hashed = |key: &str| hex(&Sha256::digest(key)[..6]);
    let requested = || -> Vec<String> {
        let spans = receiver.spans();
        let requests = spans.iter().filter(|(_, s)| s.name == "idempotent_request");
        requests.filter_map(|(_, s)| attribute(s, "key")).collect()
    };
    let (before, after) = (["before-1", "before-2"], ["after-1", "after-2"]);
    for key in before {
        assert_eq!(send(pay(key)).await.status, 201);
    }
    let reloads = "idemgate_config_reloads_total{result=\"success\"}";
    let admin = ([127, 0, 0, 1], admin).into();
    gateway.reload(&config.clone().set("telemetry.sample_ratio", 1.0));
    wait_until(
        Duration::from_secs(10),
        "the reload is in force",
        async || common::metrics::metric(admin, reloads).await >= 1.0,
    )
    .await;
    for key in after {
        assert_eq!(send(pay(key)).await.status, 201);
    }
    wait_until(
        Duration::from_secs(10),
        "the spans of the requests after the reload",
        async || {
            let seen = requested();
            after.iter().all(|key| seen.contains(&hashed(key)))
        },
    )
    .await;
    // Exports keep the order spans ended in: any span of the requests before would be in.
    let seen = requested();
    assert_eq!(seen.len(), after.len(), "{seen:?}");
    for key in before {
        assert!(!seen.contains(&hashed(key)), "{key} sampled at 0.0");
    }
    assert_eq!(upstream.calls(), before.len() + after.len());
}
