//! Where payment APIs live: TLS and mutual-TLS upstreams, several named upstreams, HTTP/2 to the
//! upstream, and the forwarding headers. Every peer is a real server the test starts.

use crate::common;

use common::{
    send, Backend, CountingUpstream, GatewayConfig, InProcessGateway, Seen, StoreServer, TestCa,
    Validity,
};
use toml::toml;

const UPSTREAM_TLS: &str = "the TLS handshake with the upstream failed";

on_both_backends!(
    an_https_upstream_with_a_private_ca,
    a_tls_failure_releases_the_key_and_says_so,
    mutual_tls_presents_the_client_certificate,
    the_server_name_can_differ_from_the_host,
    two_named_upstreams_behind_two_routes,
    http2_to_the_upstream,
    forwarding_headers_reach_the_upstream,
);

/// A gateway on `backend` with `config` (its store filled in), and the Redis it uses.
async fn start(b: Backend, config: GatewayConfig) -> (InProcessGateway, Option<StoreServer>) {
    let redis = StoreServer::for_backend(b).await;
    let gateway = InProcessGateway::start(&config.store(redis.as_ref())).await;
    (gateway, redis)
}

fn post(gateway: &InProcessGateway, path: &str, key: &str) -> reqwest::RequestBuilder {
    common::client()
        .post(gateway.url(path))
        .header("idempotency-key", key)
        .body("x")
}

/// The detail of a problem+json answer.
fn detail(seen: &Seen) -> String {
    let v: serde_json::Value = serde_json::from_slice(&seen.body).unwrap();
    v["detail"].as_str().unwrap().to_string()
}

async fn an_https_upstream_with_a_private_ca(b: Backend) {
    let ca = TestCa::new();
    let cert = ca.server("upstream", &["127.0.0.1", "localhost"], Validity::Now);
    let upstream = CountingUpstream::start_tls(ca.server_config(&cert, false)).await;
    let config = GatewayConfig::new()
        .upstream(&upstream.https_url())
        .set("upstreams.default.ca_file", ca.ca());
    let (gateway, _redis) = start(b, config).await;
    let first = send(post(&gateway, "/v1/p", "tls-1")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = send(post(&gateway, "/v1/p", "tls-1")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(upstream.calls(), 1);
    // Pass-through goes the same way.
    let plain = send(common::client().get(gateway.url("/v1/p"))).await;
    assert_eq!(plain.status, 201);
    assert_eq!(upstream.calls(), 2);
}

/// Each way a TLS handshake with the upstream fails: nothing was processed, so the key is
/// released (the retry meets no claim) and the client's 502 says it was TLS.
async fn a_tls_failure_releases_the_key_and_says_so(b: Backend) {
    let ca = TestCa::new();
    let other_ca = TestCa::new();
    let good = ca.server("good", &["127.0.0.1"], Validity::Now);
    let expired = ca.server("expired", &["127.0.0.1"], Validity::Expired);
    let wrong_name = ca.server("wrong-name", &["payments.example"], Validity::Now);
    let cases = [
        (
            "unknown CA",
            other_ca.server_config(&other_ca.server("x", &["127.0.0.1"], Validity::Now), false),
        ),
        ("expired certificate", ca.server_config(&expired, false)),
        ("name mismatch", ca.server_config(&wrong_name, false)),
        // TLS 1.3: the server refuses the missing client certificate with an alert that comes
        // after the gateway has written its request.
        ("client certificate required", ca.server_config(&good, true)),
    ];
    for (case, server) in cases {
        let upstream = CountingUpstream::start_tls(server).await;
        let config = GatewayConfig::new()
            .upstream(&upstream.https_url())
            .set("upstreams.default.ca_file", ca.ca());
        let (gateway, _redis) = start(b, config).await;
        for attempt in ["first", "retry"] {
            let seen = send(post(&gateway, "/v1/p", "tls-fail")).await;
            assert_eq!(seen.status, 502, "{case}, {attempt}: {seen:?}");
            assert_eq!(
                seen.problem_type(),
                "urn:idemgate:problem:upstream-unavailable"
            );
            assert!(
                detail(&seen).contains(UPSTREAM_TLS),
                "{case}, {attempt}: {}",
                detail(&seen)
            );
        }
        assert_eq!(upstream.calls(), 0, "{case}: nothing was processed");
    }
}

async fn mutual_tls_presents_the_client_certificate(b: Backend) {
    let ca = TestCa::new();
    let server = ca.server("upstream", &["127.0.0.1"], Validity::Now);
    let client = ca.client("gateway");
    let upstream = CountingUpstream::start_tls(ca.server_config(&server, true)).await;
    let redis = StoreServer::for_backend(b).await;
    let base = GatewayConfig::new()
        .upstream(&upstream.https_url())
        .set("upstreams.default.ca_file", ca.ca())
        .store(redis.as_ref());
    // Without the certificate: refused, released.
    let without = InProcessGateway::start(&base).await;
    let refused = send(post(&without, "/v1/p", "mtls")).await;
    assert_eq!(refused.status, 502, "{refused:?}");
    assert!(detail(&refused).contains(UPSTREAM_TLS));
    // With it (on Redis, the same key right after the fix): runs normally.
    let with = InProcessGateway::start(
        &base
            .clone()
            .set("upstreams.default.client_cert_file", client.cert())
            .set("upstreams.default.client_key_file", client.key_path()),
    )
    .await;
    let key = if b != Backend::Memory {
        "mtls"
    } else {
        "mtls-2"
    };
    let ok = send(post(&with, "/v1/p", key)).await;
    assert_eq!(ok.status, 201, "{ok:?}");
    assert!(send(post(&with, "/v1/p", key)).await.replayed());
    assert_eq!(upstream.calls(), 1);
}

async fn the_server_name_can_differ_from_the_host(b: Backend) {
    let ca = TestCa::new();
    let cert = ca.server("upstream", &["payments.internal"], Validity::Now);
    let upstream = CountingUpstream::start_tls(ca.server_config(&cert, false)).await;
    let config = GatewayConfig::new()
        .upstream(&upstream.https_url())
        .set("upstreams.default.ca_file", ca.ca())
        .set("upstreams.default.server_name", "payments.internal");
    let (gateway, _redis) = start(b, config).await;
    let seen = send(post(&gateway, "/v1/p", "sni")).await;
    assert_eq!(seen.status, 201, "{seen:?}");
}

async fn two_named_upstreams_behind_two_routes(b: Backend) {
    let payments = CountingUpstream::start().await;
    let ca = TestCa::new();
    let cert = ca.server("refunds", &["127.0.0.1"], Validity::Now);
    let refunds = CountingUpstream::start_tls(ca.server_config(&cert, false)).await;
    let config = GatewayConfig::new()
        .upstream(&payments.url())
        .set("upstreams.refunds.url", refunds.https_url().as_str())
        .set("upstreams.refunds.ca_file", ca.ca())
        .route("/v1/refunds/{*rest}", toml! { upstream = "refunds" });
    let (gateway, _redis) = start(b, config).await;
    for (path, key) in [("/v1/payments", "p-1"), ("/v1/refunds/r1", "r-1")] {
        let first = send(post(&gateway, path, key)).await;
        assert_eq!(first.status, 201, "{path}: {first:?}");
        let again = send(post(&gateway, path, key)).await;
        assert!(again.replayed(), "{path}");
        assert_eq!(again.body, first.body);
    }
    assert_eq!((payments.calls(), refunds.calls()), (1, 1));
    assert_eq!(
        refunds.last_headers()["x-forwarded-host"],
        gateway.addr.to_string()
    );
}

async fn http2_to_the_upstream(b: Backend) {
    // h2c with prior knowledge...
    let plain = CountingUpstream::start().await;
    let config = GatewayConfig::new()
        .upstream(&plain.url())
        .set("upstreams.default.http2", true);
    let (gateway, _redis) = start(b, config).await;
    let seen = send(post(&gateway, "/v1/p", "h2c")).await;
    assert_eq!(seen.status, 201, "{seen:?}");
    assert_eq!(plain.last_version(), http::Version::HTTP_2);
    assert!(send(post(&gateway, "/v1/p", "h2c")).await.replayed());
    // ...and over TLS, by ALPN.
    let ca = TestCa::new();
    let cert = ca.server("h2", &["127.0.0.1"], Validity::Now);
    let tls = CountingUpstream::start_tls(ca.server_config(&cert, false)).await;
    let config = GatewayConfig::new()
        .upstream(&tls.https_url())
        .set("upstreams.default.ca_file", ca.ca())
        .set("upstreams.default.http2", true)
        // One worker, so that every request goes through one connection pool.
        .set("workers", 1);
    let (gateway, _redis2) = start(b, config).await;
    for key in ["h2-a", "h2-b", "h2-c"] {
        assert_eq!(send(post(&gateway, "/v1/p", key)).await.status, 201);
    }
    assert_eq!(tls.last_version(), http::Version::HTTP_2);
    assert_eq!(
        tls.connections(),
        1,
        "the requests share one HTTP/2 connection"
    );
    // Without http2 the same upstream is spoken to in HTTP/1.1 (ALPN http/1.1).
    let config = GatewayConfig::new()
        .upstream(&tls.https_url())
        .set("upstreams.default.ca_file", ca.ca());
    let (gateway, _redis3) = start(b, config).await;
    assert_eq!(send(post(&gateway, "/v1/p", "h1")).await.status, 201);
    assert_eq!(tls.last_version(), http::Version::HTTP_11);
}

async fn forwarding_headers_reach_the_upstream(b: Backend) {
    let upstream = CountingUpstream::start().await;
    let (gateway, _redis) = start(b, GatewayConfig::new().upstream(&upstream.url())).await;
    send(post(&gateway, "/v1/p", "xff")).await;
    let seen = upstream.last_headers();
    assert_eq!(seen["x-forwarded-for"], "127.0.0.1");
    assert_eq!(seen["x-forwarded-proto"], "http");
    // What an outer proxy sent stays, before the address this gateway saw.
    send(
        common::client()
            .get(gateway.url("/v1/p"))
            .header("x-forwarded-for", "203.0.113.7")
            .header("x-forwarded-proto", "spoofed"),
    )
    .await;
    let seen = upstream.last_headers();
    assert_eq!(seen["x-forwarded-for"], "203.0.113.7, 127.0.0.1");
    assert_eq!(seen["x-forwarded-proto"], "http");
}

/// The upstream's counters name it: requests by result, connections opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_name_the_upstream() {
    let payments = CountingUpstream::start().await;
    let ca = TestCa::new();
    let untrusted = TestCa::new();
    let cert = untrusted.server("refunds", &["127.0.0.1"], Validity::Now);
    let refunds = CountingUpstream::start_tls(untrusted.server_config(&cert, false)).await;
    let config = GatewayConfig::new()
        .upstream(&payments.url())
        .set("upstreams.refunds.url", refunds.https_url().as_str())
        .set("upstreams.refunds.ca_file", ca.ca())
        .set("admin.listen", "127.0.0.1:0")
        .set("workers", 1)
        .route("/v1/refunds/{*rest}", toml! { upstream = "refunds" });
    let gateway = InProcessGateway::start(&config).await;
    for key in ["a", "b", "c"] {
        assert_eq!(send(post(&gateway, "/v1/payments", key)).await.status, 201);
    }
    assert_eq!(send(post(&gateway, "/v1/refunds/r", "r")).await.status, 502);
    let scrape = gateway.metrics().await;
    for line in [
        "idemgate_upstream_requests_total{upstream=\"default\",result=\"response\"} 3",
        "idemgate_upstream_requests_total{upstream=\"refunds\",result=\"tls_failed\"} 1",
        "idemgate_upstream_connections_opened_total{upstream=\"default\"} 1",
    ] {
        assert!(scrape.contains(line), "{line} not in:\n{scrape}");
    }
}

/// With `max_connections` open, more requests wait for one to come back (a worker never opens
/// more), each for at most its route's `upstream_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connections_bounds_the_connections_a_worker_opens() {
    let upstream = CountingUpstream::start()
        .await
        .delay(std::time::Duration::from_millis(300));
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .set("upstreams.default.max_connections", 1)
        .set("workers", 1);
    let gateway = InProcessGateway::start(&config).await;
    let started = std::time::Instant::now();
    let mut calls = Vec::new();
    for _ in 0..3 {
        calls.push(tokio::spawn(send(
            common::client().get(gateway.url("/v1/p")),
        )));
    }
    for c in calls {
        assert_eq!(c.await.unwrap().status, 201);
    }
    assert_eq!(upstream.connections(), 1, "one connection, taken in turn");
    assert!(started.elapsed() >= std::time::Duration::from_millis(900));
    // A request that cannot get a connection within its upstream_timeout gets 504.
    let config = config
        .set("defaults.upstream_timeout", "400ms")
        .route("/slow", toml! { upstream_timeout = "5s" });
    let gateway = InProcessGateway::start(&config).await;
    let first = tokio::spawn(send(
        common::client().get(gateway.url("/slow?delay_ms=1500")),
    ));
    upstream.wait_for_calls(4).await;
    let waited = send(common::client().get(gateway.url("/v1/p?delay_ms=0"))).await;
    assert_eq!(waited.status, 504, "{waited:?}");
    // A keyed request that waited in vain was not sent either: its key is released.
    let keyed = send(post(&gateway, "/v1/p?delay_ms=0", "busy")).await;
    assert_eq!(keyed.status, 504, "{keyed:?}");
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(upstream.calls(), 4, "the ones that waited were never sent");
    let retry = send(post(&gateway, "/v1/p?delay_ms=0", "busy")).await;
    assert_eq!(retry.status, 201, "released, not in flight: {retry:?}");
}

#[tokio::test]
async fn each_presented_certificate_shows_its_not_after() {
    let ca = TestCa::new();
    // rcgen's Expired certificate ends on 2021-01-01; its default one on 4096-01-01.
    let listener = ca.server("gateway", &["127.0.0.1"], Validity::Expired);
    let client = ca.client("gateway-client");
    let gateway = InProcessGateway::start(
        &GatewayConfig::new()
            .upstream("https://127.0.0.1:9")
            .set("upstreams.default.ca_file", ca.ca())
            .set("upstreams.default.client_cert_file", client.cert())
            .set("upstreams.default.client_key_file", client.key_path())
            .set("tls.cert_file", listener.cert())
            .set("tls.key_file", listener.key_path())
            .admin(),
    )
    .await;
    let admin = gateway.admin.unwrap();
    let family = "idemgate_tls_certificate_expiry_timestamp_seconds";
    let of = |name: &str| format!("{family}{{name=\"{name}\"}}");
    assert_eq!(
        common::metrics::metric(admin, &of("listener")).await,
        1_609_459_200.0
    );
    assert_eq!(
        common::metrics::metric(admin, &of("upstream:default")).await,
        // 4096-01-01T00:00:00Z
        67_090_118_400.0
    );
}
