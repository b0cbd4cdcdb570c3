//! The gateway's behaviour as a client sees it, over real sockets, against both stores.

use crate::common;

use std::time::Duration;

use common::{
    send, wait_until, Backend, CountingUpstream, GatewayConfig, InProcessGateway, RedisServer,
    ReservedPort, Seen, StoreServer, TestEnv,
};
use toml::toml;

const MISMATCH: &str = "urn:idemgate:problem:mismatch";
const IN_FLIGHT: &str = "urn:idemgate:problem:in-flight";
const INVALID_KEY: &str = "urn:idemgate:problem:invalid-key";

on_both_backends!(
    first_request_then_replay,
    concurrent_duplicates_run_the_upstream_once,
    different_request_with_same_key_is_a_mismatch,
    mismatch_status_can_be_422,
    different_authorization_is_a_different_caller,
    server_errors_are_not_stored,
    server_errors_are_stored_when_configured,
    client_errors_are_stored_but_not_429,
    ttl_expiry_lets_the_key_run_again,
    invalid_keys_are_refused,
    quoted_key_is_the_same_key,
    missing_key_on_required_route,
    oversized_body_is_refused,
    binary_body_replays_byte_exact,
    unkeyed_and_other_methods_pass_through,
    oversized_response_is_delivered_once_and_not_replayed,
    hop_by_hop_headers_are_not_forwarded,
    unreachable_upstream_releases_the_key,
    upstream_timeout_keeps_the_key_claimed,
    lease_is_renewed_while_the_upstream_runs,
    route_specific_policy_applies,
);

async fn first_request_then_replay(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    let first = send(env.post_keyed("/v1/payments", "k1").body("{\"amount\":10}")).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    // Let a second apart so a regenerated Date header would differ.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let again = send(env.post_keyed("/v1/payments", "k1").body("{\"amount\":10}")).await;
    assert_eq!(env.upstream.calls(), 1);
    assert!(again.replayed());
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body);
    // Every header but Set-Cookie (recorded, never replayed: replay_drop_headers' default).
    let without_cookies = |seen: &common::Seen| -> Vec<(String, Vec<u8>)> {
        seen.headers_without_marker()
            .into_iter()
            .filter(|(n, _)| n != "set-cookie")
            .collect()
    };
    assert_eq!(without_cookies(&again), without_cookies(&first));
    assert_eq!(first.headers.get_all("set-cookie").iter().count(), 2);
    assert_eq!(again.headers.get_all("set-cookie").iter().count(), 0);
    // The key reached the upstream: a second line of defence for upstreams that dedupe.
    assert_eq!(env.upstream.last_headers()["idempotency-key"], "k1");
}

async fn concurrent_duplicates_run_the_upstream_once(b: Backend) {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(700));
    let env = TestEnv::start_with(b, upstream, GatewayConfig::new()).await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let req = env
            .post_keyed("/v1/payments", "storm")
            .body("{\"amount\":5}");
        tasks.push(tokio::spawn(send(req)));
    }
    let mut executed = 0;
    let mut conflicts = 0;
    let mut replays = 0;
    for t in tasks {
        let seen = t.await.unwrap();
        match seen.status {
            201 if seen.replayed() => replays += 1,
            201 => executed += 1,
            409 => {
                assert_eq!(seen.problem_type(), IN_FLIGHT);
                assert_eq!(seen.header("retry-after"), Some("1"));
                conflicts += 1;
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!(env.upstream.calls(), 1);
    assert_eq!(executed, 1);
    assert_eq!(executed + conflicts + replays, 50);
    assert!(conflicts > 0);
    // Once it completed, a retry is a replay.
    let after = send(
        env.post_keyed("/v1/payments", "storm")
            .body("{\"amount\":5}"),
    )
    .await;
    assert!(after.replayed());
    assert_eq!(env.upstream.calls(), 1);
}

async fn different_request_with_same_key_is_a_mismatch(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    assert_eq!(
        send(env.post_keyed("/v1/a", "k").body("one")).await.status,
        201
    );
    let body = send(env.post_keyed("/v1/a", "k").body("two")).await;
    let path = send(env.post_keyed("/v1/b", "k").body("one")).await;
    let query = send(env.post_keyed("/v1/a?x=1", "k").body("one")).await;
    let method = send(
        env.client
            .patch(env.url("/v1/a"))
            .header("idempotency-key", "k")
            .body("one"),
    )
    .await;
    let ctype = send(
        env.post_keyed("/v1/a", "k")
            .header("content-type", "application/json")
            .body("one"),
    )
    .await;
    for seen in [body, path, query, method, ctype] {
        assert_eq!(seen.status, 409, "{seen:?}");
        assert_eq!(seen.problem_type(), MISMATCH);
    }
    assert_eq!(env.upstream.calls(), 1);
}

async fn mismatch_status_can_be_422(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new().set("defaults.mismatch_status", 422)).await;
    send(env.post_keyed("/v1/a", "k").body("one")).await;
    let seen = send(env.post_keyed("/v1/a", "k").body("two")).await;
    assert_eq!(seen.status, 422);
    assert_eq!(seen.problem_type(), MISMATCH);
}

async fn different_authorization_is_a_different_caller(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    let alice = send(
        env.post_keyed("/v1/p", "shared")
            .bearer_auth("alice")
            .body("x"),
    )
    .await;
    let bob = send(
        env.post_keyed("/v1/p", "shared")
            .bearer_auth("bob")
            .body("x"),
    )
    .await;
    assert_eq!((alice.status, bob.status), (201, 201));
    assert!(!bob.replayed(), "bob must never get alice's response");
    assert_ne!(alice.body, bob.body);
    assert_eq!(env.upstream.calls(), 2);
    let alice2 = send(
        env.post_keyed("/v1/p", "shared")
            .bearer_auth("alice")
            .body("x"),
    )
    .await;
    assert!(alice2.replayed());
    assert_eq!(alice2.body, alice.body);
    // No Authorization at all is a third caller.
    let anon = send(env.post_keyed("/v1/p", "shared").body("x")).await;
    assert!(!anon.replayed());
    assert_eq!(env.upstream.calls(), 3);
}

async fn server_errors_are_not_stored(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    let first = send(env.post_keyed("/v1/p?status=500", "k").body("x")).await;
    assert_eq!(first.status, 500);
    let retry = send(env.post_keyed("/v1/p?status=500", "k").body("x")).await;
    assert_eq!(retry.status, 500);
    assert!(!retry.replayed());
    assert_eq!(env.upstream.calls(), 2);
}

async fn server_errors_are_stored_when_configured(b: Backend) {
    let env = TestEnv::start(
        b,
        GatewayConfig::new().set("defaults.cache_server_errors", true),
    )
    .await;
    send(env.post_keyed("/v1/p?status=503", "k").body("x")).await;
    let retry = send(env.post_keyed("/v1/p?status=503", "k").body("x")).await;
    assert_eq!(retry.status, 503);
    assert!(retry.replayed());
    assert_eq!(env.upstream.calls(), 1);
}

async fn client_errors_are_stored_but_not_429(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    send(env.post_keyed("/v1/p?status=404", "k404").body("x")).await;
    let retry = send(env.post_keyed("/v1/p?status=404", "k404").body("x")).await;
    assert_eq!(retry.status, 404);
    assert!(retry.replayed());
    assert_eq!(env.upstream.calls(), 1);
    for status in [429, 408] {
        let path = format!("/v1/p?status={status}");
        send(env.post_keyed(&path, "krl").body("x")).await;
        let retry = send(env.post_keyed(&path, "krl").body("x")).await;
        assert_eq!(retry.status, status);
        assert!(!retry.replayed());
    }
    assert_eq!(env.upstream.calls(), 5);
}

async fn ttl_expiry_lets_the_key_run_again(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new().set("defaults.ttl", "1s")).await;
    send(env.post_keyed("/v1/p", "k").body("x")).await;
    assert!(send(env.post_keyed("/v1/p", "k").body("x"))
        .await
        .replayed());
    // Replays until the record expires; the first request after that runs again.
    let mut after = None;
    wait_until(
        Duration::from_millis(1300),
        "the record has expired (ttl 1s)",
        async || {
            let seen = send(env.post_keyed("/v1/p", "k").body("x")).await;
            let expired = !seen.replayed();
            after = Some(seen);
            expired
        },
    )
    .await;
    let after = after.unwrap();
    assert_eq!(after.status, 201);
    assert!(!after.replayed());
    assert_eq!(env.upstream.calls(), 2);
}

async fn invalid_keys_are_refused(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new().set("defaults.key_max_len", 8)).await;
    let too_long = send(env.post_keyed("/v1/p", "123456789").body("x")).await;
    let empty = send(env.post_keyed("/v1/p", "").body("x")).await;
    let quoted_empty = send(env.post_keyed("/v1/p", "\"\"").body("x")).await;
    let twice = send(
        env.post("/v1/p")
            .header("idempotency-key", "a")
            .header("idempotency-key", "b")
            .body("x"),
    )
    .await;
    for seen in [too_long, empty, quoted_empty, twice] {
        assert_eq!(seen.status, 400, "{seen:?}");
        assert_eq!(seen.problem_type(), INVALID_KEY);
    }
    assert_eq!(
        send(env.post_keyed("/v1/p", "12345678").body("x"))
            .await
            .status,
        201
    );
    assert_eq!(env.upstream.calls(), 1);
}

async fn quoted_key_is_the_same_key(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    send(env.post_keyed("/v1/p", "abc").body("x")).await;
    assert!(send(env.post_keyed("/v1/p", "\"abc\"").body("x"))
        .await
        .replayed());
    assert_eq!(env.upstream.calls(), 1);
}

async fn missing_key_on_required_route(b: Backend) {
    let env = TestEnv::start(
        b,
        GatewayConfig::new().route("/v1/payments", toml! { require_key = true }),
    )
    .await;
    let seen = send(env.post("/v1/payments").body("x")).await;
    assert_eq!(seen.status, 400);
    assert_eq!(seen.problem_type(), "urn:idemgate:problem:missing-key");
    // Other routes do not require it.
    assert_eq!(send(env.post("/v1/other").body("x")).await.status, 201);
    assert_eq!(env.upstream.calls(), 1);
}

async fn oversized_body_is_refused(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new().set("defaults.max_body", "1KiB")).await;
    let declared = send(env.post_keyed("/v1/p", "k").body(vec![b'a'; 1025])).await;
    assert_eq!(declared.status, 413);
    assert_eq!(
        declared.problem_type(),
        "urn:idemgate:problem:body-too-large"
    );
    // Without Content-Length (chunked), the limit holds while reading.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        vec![Ok(vec![b'a'; 600]), Ok(vec![b'a'; 600])];
    let stream = futures_util::stream::iter(chunks);
    let chunked = send(
        env.post_keyed("/v1/p", "k2")
            .body(reqwest::Body::wrap_stream(stream)),
    )
    .await;
    assert_eq!(chunked.status, 413);
    assert_eq!(env.upstream.calls(), 0);
    // Exactly at the limit is fine; the refused key was never claimed.
    assert_eq!(
        send(env.post_keyed("/v1/p", "k").body(vec![b'a'; 1024]))
            .await
            .status,
        201
    );
}

async fn binary_body_replays_byte_exact(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    let payload: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let first = send(env.post_keyed("/echo", "bin").body(payload.clone())).await;
    assert_eq!(first.body.as_ref(), payload.as_slice());
    let again = send(env.post_keyed("/echo", "bin").body(payload.clone())).await;
    assert!(again.replayed());
    assert_eq!(again.body.as_ref(), payload.as_slice());
    assert_eq!(env.upstream.calls(), 1);
}

async fn unkeyed_and_other_methods_pass_through(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    for _ in 0..2 {
        assert_eq!(send(env.post("/v1/p").body("x")).await.status, 201);
        let get = send(
            env.client
                .get(env.url("/v1/p"))
                .header("idempotency-key", "g"),
        )
        .await;
        assert!(!get.replayed());
        let put = send(
            env.client
                .put(env.url("/v1/p"))
                .header("idempotency-key", "g")
                .body("y"),
        )
        .await;
        assert!(!put.replayed());
    }
    assert_eq!(env.upstream.calls(), 6);
}

async fn oversized_response_is_delivered_once_and_not_replayed(b: Backend) {
    let config = GatewayConfig::new()
        .set("defaults.max_body", "64KiB")
        .set("admin.listen", "127.0.0.1:0");
    let env = TestEnv::start(b, config).await;
    let recorded = r#"idemgate_records_not_replayable_total{route="defaults"}"#;
    assert_eq!(env.gateway.metric(recorded).await, 0.0);
    let first = send(env.post_keyed("/big?bytes=300000", "big").body("x")).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body.len(), 300_000);
    assert!(first
        .body
        .iter()
        .enumerate()
        .all(|(i, b)| *b == (i % 251) as u8));
    let retry = send(env.post_keyed("/big?bytes=300000", "big").body("x")).await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem_type(), "urn:idemgate:problem:not-replayable");
    assert_eq!(env.upstream.calls(), 1);
    assert_eq!(
        env.gateway.metric(recorded).await,
        1.0,
        "counted once, when recorded"
    );
}

async fn hop_by_hop_headers_are_not_forwarded(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    send(
        env.post_keyed("/v1/p", "hop")
            .header("connection", "x-private-hop")
            .header("x-private-hop", "secret")
            .header("proxy-authorization", "Basic abc")
            .header("x-end-to-end", "kept")
            .body("x"),
    )
    .await;
    let seen = env.upstream.last_headers();
    assert!(seen.get("x-private-hop").is_none());
    assert!(seen.get("proxy-authorization").is_none());
    assert_eq!(seen["x-end-to-end"], "kept");
    assert_eq!(seen["idempotency-key"], "hop");
}

async fn unreachable_upstream_releases_the_key(b: Backend) {
    // The upstream's port is reserved but not listened on: connections to it are refused.
    let port = ReservedPort::new();
    let redis = StoreServer::for_backend(b).await;
    let config = GatewayConfig::new()
        .upstream(&port.url())
        .store(redis.as_ref());
    let gateway = InProcessGateway::start(&config).await;
    let client = common::client();
    let url = gateway.url("/v1/p");
    let down = send(client.post(&url).header("idempotency-key", "k").body("x")).await;
    assert_eq!(down.status, 502);
    assert_eq!(
        down.problem_type(),
        "urn:idemgate:problem:upstream-unavailable"
    );
    // Nothing was sent, so the key was released: once the upstream is up, the retry runs.
    let upstream = CountingUpstream::start_on(port.listen()).await;
    let up = send(client.post(&url).header("idempotency-key", "k").body("x")).await;
    assert_eq!(up.status, 201);
    assert!(!up.replayed());
    assert_eq!(upstream.calls(), 1);
}

async fn upstream_timeout_keeps_the_key_claimed(b: Backend) {
    let env = TestEnv::start(
        b,
        GatewayConfig::new()
            .set("defaults.upstream_timeout", "300ms")
            .set("defaults.lock_ttl", "2s"),
    )
    .await;
    let slow = send(env.post_keyed("/v1/p?delay_ms=1000", "slow").body("x")).await;
    assert_eq!(slow.status, 504);
    assert_eq!(slow.problem_type(), "urn:idemgate:problem:upstream-timeout");
    // The upstream may still be executing: the key stays claimed until its lease ends...
    let retry = send(env.post_keyed("/v1/p?delay_ms=1000", "slow").body("x")).await;
    assert_eq!(retry.problem_type(), IN_FLIGHT);
    assert_eq!(env.upstream.calls(), 1);
    // ...and then a retry runs again.
    let retried = env
        .retry_while_in_flight(
            ("/v1/p?delay_ms=1000", "slow", "x"),
            Duration::from_millis(2200),
            "the lease has ended (lock_ttl 2s)",
        )
        .await;
    let later = send(env.post_keyed("/v1/p?delay_ms=10", "slow2").body("x")).await;
    assert_eq!(later.status, 201);
    assert_eq!(
        retried.status, 504,
        "the lease ended, so the retry ran the upstream again"
    );
    assert_eq!(env.upstream.calls(), 3);
}

async fn lease_is_renewed_while_the_upstream_runs(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new().set("defaults.lock_ttl", "1s")).await;
    let first = tokio::spawn(send(
        env.post_keyed("/v1/p?delay_ms=3000", "long").body("x"),
    ));
    // Retries every 500 ms, for 2.5 s: well past the 1 s lease, had it not been renewed.
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let retry = send(env.post_keyed("/v1/p?delay_ms=3000", "long").body("x")).await;
        assert_eq!(retry.status, 409, "lease must be renewed past lock_ttl");
        assert_eq!(retry.problem_type(), IN_FLIGHT);
    }
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert!(
        send(env.post_keyed("/v1/p?delay_ms=3000", "long").body("x"))
            .await
            .replayed()
    );
    assert_eq!(env.upstream.calls(), 1);
}

async fn route_specific_policy_applies(b: Backend) {
    let config = GatewayConfig::new()
        .route(
            "/v1/payments/{id}/capture",
            toml! { methods = ["POST"] ttl = "7d" require_key = true },
        )
        .route("/v1/{*rest}", toml! { methods = ["PUT"] });
    let env = TestEnv::start(b, config).await;
    // Specific route: key required.
    assert_eq!(send(env.post("/v1/payments/p1/capture")).await.status, 400);
    // Subtree route: PUT is idempotent there, POST is not.
    send(
        env.client
            .put(env.url("/v1/things"))
            .header("idempotency-key", "k")
            .body("x"),
    )
    .await;
    let put = send(
        env.client
            .put(env.url("/v1/things"))
            .header("idempotency-key", "k")
            .body("x"),
    )
    .await;
    assert!(put.replayed());
    let post = send(env.post_keyed("/v1/things", "k2").body("x")).await;
    assert!(!post.replayed());
    assert!(!send(env.post_keyed("/v1/things", "k2").body("x"))
        .await
        .replayed());
    // No route: defaults (POST keyed).
    send(env.post_keyed("/other", "k3").body("x")).await;
    assert!(send(env.post_keyed("/other", "k3").body("x"))
        .await
        .replayed());
    assert_eq!(env.upstream.calls(), 4);
}

// === Redis only ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_gateway_replays_from_redis() {
    let mut env = TestEnv::start(Backend::Redis, GatewayConfig::new()).await;
    let first = send(env.post_keyed("/v1/p", "persist").body("x")).await;
    env.restart_gateway().await;
    let again = send(env.post_keyed("/v1/p", "persist").body("x")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(env.upstream.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_share_keys() {
    let env = TestEnv::start(Backend::Redis, GatewayConfig::new()).await;
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(500));
    let config = env.config().upstream(&upstream.url());
    let (a, b) = (
        InProcessGateway::start(&config).await,
        InProcessGateway::start(&config).await,
    );
    let mut tasks = Vec::new();
    for i in 0..20 {
        let addr = if i % 2 == 0 { a.addr } else { b.addr };
        let req = env
            .client
            .post(format!("http://{addr}/v1/p"))
            .header("idempotency-key", "replicas")
            .body("x");
        tasks.push(tokio::spawn(send(req)));
    }
    let results: Vec<Seen> = futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(upstream.calls(), 1);
    assert_eq!(
        results
            .iter()
            .filter(|s| s.status == 201 && !s.replayed())
            .count(),
        1
    );
    let replay = send(
        env.client
            .post(b.url("/v1/p"))
            .header("idempotency-key", "replicas")
            .body("x"),
    )
    .await;
    assert!(replay.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_record_is_compact_and_expires() {
    let env = TestEnv::start(
        Backend::Redis,
        GatewayConfig::new().set("defaults.ttl", "1h"),
    )
    .await;
    let payload = vec![7u8; 10_000];
    let first = send(env.post_keyed("/echo", "compact").body(payload)).await;
    let mut conn = env.redis().connection().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("test:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1);
    assert_eq!(
        keys[0].len(),
        "test:".len() + 22,
        "prefix + 128 bits of SHA-256 in base64, never the raw key"
    );
    let value: Vec<u8> = redis::cmd("GET")
        .arg(&keys[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    let headers: usize = first
        .headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len())
        .sum();
    assert!(
        value.len() <= first.body.len() + headers + 256,
        "{} bytes stored",
        value.len()
    );
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&keys[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 3_500_000 && ttl <= 3_600_000, "ttl {ttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_kept_alive_and_reused() {
    // One worker, so that every request goes through one pool.
    let env = TestEnv::start(Backend::Memory, GatewayConfig::new().set("workers", 1)).await;
    let url = |path: &str| env.url(path);
    for i in 0..5 {
        // Small and streamed pass-through bodies, a miss, its replay, a 204 without a body.
        let small = send(env.client.get(url("/v1/p"))).await;
        assert_eq!(small.status, 201);
        let big = send(env.client.get(url("/big?bytes=300000"))).await;
        assert_eq!(big.body.len(), 300_000);
        let key = format!("reuse-{i}");
        let miss = send(
            env.client
                .post(url("/big?bytes=200000"))
                .header("idempotency-key", &key)
                .body("x"),
        )
        .await;
        assert_eq!(miss.body.len(), 200_000);
        let empty = send(env.client.post(url("/v1/p?status=204")).body("x")).await;
        assert_eq!(empty.status, 204);
    }
    assert_eq!(env.upstream.calls(), 20);
    assert_eq!(
        env.upstream.connections(),
        1,
        "every request should have reused the one keep-alive connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_upstream_is_reached() {
    let upstream = CountingUpstream::start_v6().await;
    assert!(upstream.url().starts_with("http://[::1]:"));
    let env = TestEnv::start_with(Backend::Memory, upstream, GatewayConfig::new()).await;
    let first = send(env.post_keyed("/v1/p", "v6").body("x")).await;
    assert_eq!(first.status, 201);
    assert!(send(env.post_keyed("/v1/p", "v6").body("x"))
        .await
        .replayed());
    assert_eq!(env.upstream.calls(), 1);
}

/// An upstream that closes a keep-alive connection after 50 ms idle (as Node.js does after 5 s):
/// the pool must notice and open a new connection, not fail the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_the_upstream_closed_when_idle_are_not_reused() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let (connections, calls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (conns, seen) = (connections.clone(), calls.clone());
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            conns.fetch_add(1, Ordering::SeqCst);
            let seen = seen.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req| {
                    let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
                    async move {
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from(format!("call {n}"))),
                        ))
                    }
                });
                let mut http = hyper::server::conn::http1::Builder::new();
                http.timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(Duration::from_millis(50));
                let _ = http
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    // One worker, so that every request goes through one pool.
    let config = GatewayConfig::new()
        .upstream(&format!("http://{upstream}"))
        .set("workers", 1);
    let gateway = InProcessGateway::start(&config).await;
    let client = common::client();
    for i in 0..4 {
        let url = gateway.url("/v1/p");
        let pass = send(client.get(&url)).await;
        assert_eq!(pass.status, 200, "{pass:?}");
        let keyed = send(
            client
                .post(&url)
                .header("idempotency-key", format!("idle-{i}"))
                .body("x"),
        )
        .await;
        assert_eq!(keyed.status, 200, "{keyed:?}");
        // Idle longer than the upstream keeps a connection, with a margin for the gateway to see
        // it close: a request racing the close itself is not what this test is about.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(calls.load(Ordering::SeqCst), 8);
    assert!(
        connections.load(Ordering::SeqCst) >= 4,
        "the upstream closed each idle connection"
    );
}

/// The one record's value in Redis, for a test that wrote one.
async fn only_record(conn: &mut redis::aio::MultiplexedConnection) -> Vec<u8> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("test:*")
        .query_async(conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    redis::cmd("GET")
        .arg(&keys[0])
        .query_async(conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stores_compressible_bodies_compressed_and_replays_them_whole() {
    let json: Vec<u8> = (0..600)
        .flat_map(|i| {
            format!(
                "{{\"id\":\"pi_{i:06}\",\"amount\":{},\"status\":\"succeeded\"}},",
                i * 7
            )
            .into_bytes()
        })
        .collect();
    // Default: LZ4.
    let env = TestEnv::start(Backend::Redis, GatewayConfig::new()).await;
    let first = send(env.post_keyed("/echo", "lz4").body(json.clone())).await;
    assert_eq!(first.body, json);
    let mut conn = env.redis().connection().await;
    let stored = only_record(&mut conn).await;
    assert!(
        stored.len() * 3 < json.len(),
        "{} bytes stored for {}",
        stored.len(),
        json.len()
    );
    // A replay read back from Redis (another process: no local cache) is the same bytes.
    let config = env.config();
    drop(env.gateway);
    let other = InProcessGateway::start(&config).await;
    let replay = send(
        env.client
            .post(other.url("/echo"))
            .header("idempotency-key", "lz4")
            .body(json.clone()),
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(replay.body, json);
    assert_eq!(env.upstream.calls(), 1);

    // compression = "none": the body is stored as it came.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    drop(other);
    let plain = InProcessGateway::start(&config.set("store.compression", "none")).await;
    send(
        env.client
            .post(plain.url("/echo"))
            .header("idempotency-key", "plain")
            .body(json.clone()),
    )
    .await;
    assert!(only_record(&mut conn).await.len() > json.len());
}

/// Counts the round trips clients make to Redis, from Redis's own statistics: each request
/// these tests send arrives as one read event (`total_reads_processed`), and so does each INFO
/// this counter sends, which it takes off.
struct RoundTrips {
    conn: redis::aio::MultiplexedConnection,
    last: u64,
}

impl RoundTrips {
    async fn start(redis: &RedisServer) -> Self {
        let mut conn = redis.connection().await;
        let last = Self::reads(&mut conn).await;
        RoundTrips { conn, last }
    }

    async fn reads(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("stats")
            .query_async(conn)
            .await
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("total_reads_processed:"))
            .map_or(0, |n| n.trim().parse().unwrap())
    }

    /// Round trips since the last call (not counting this counter's own).
    async fn since(&mut self) -> u64 {
        let now = Self::reads(&mut self.conn).await;
        let trips = now - self.last - 1;
        self.last = now;
        trips
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_come_from_the_local_cache_without_a_round_trip() {
    let env = TestEnv::start(
        Backend::Redis,
        GatewayConfig::new().set("admin.listen", "127.0.0.1:0"),
    )
    .await;
    // Warm up: connections, the startup checks and the script cache cost round trips of their own.
    send(env.post_keyed("/v1/p", "warm-up").body("x")).await;
    // A margin for any round trip the warm-up set off to land before counting starts: no one
    // event marks that there are no more.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut trips = RoundTrips::start(env.redis()).await;
    let first = send(env.post_keyed("/v1/p", "cached").body("x")).await;
    assert_eq!(trips.since().await, 2, "a miss: claim, complete");
    // The first replay reads Redis (one round trip) and fills this process's cache...
    assert!(send(env.post_keyed("/v1/p", "cached").body("x"))
        .await
        .replayed());
    assert_eq!(trips.since().await, 1);
    // ...the next ones come from it.
    for _ in 0..5 {
        let again = send(env.post_keyed("/v1/p", "cached").body("x")).await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
    }
    assert_eq!(trips.since().await, 0, "replays must not touch Redis");
    // A different request with the key still goes to the store, which decides: mismatch.
    let other = send(env.post_keyed("/v1/p", "cached").body("y")).await;
    assert_eq!(other.problem_type(), MISMATCH);
    assert_eq!(trips.since().await, 1);
    // The gateway's own count agrees.
    let metrics = env.gateway.metrics().await;
    assert!(
        metrics.contains("idemgate_local_cache_hits_total 5"),
        "{metrics}"
    );
    // One record is cached (the warm-up key was never replayed), weighed with its response.
    assert!(
        metrics.contains("idemgate_local_cache_entries 1\n"),
        "{metrics}"
    );
    let bytes: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("idemgate_local_cache_bytes "))
        .and_then(|v| v.trim().parse().ok())
        .expect("idemgate_local_cache_bytes");
    assert!(bytes > first.body.len() as u64 + 128, "{bytes}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_local_cache_a_replay_is_one_round_trip() {
    let env = TestEnv::start(
        Backend::Redis,
        GatewayConfig::new().set("store.local_cache", 0),
    )
    .await;
    let url = env.url("/v1/p");
    // The record is written as the response ends: a first replay shows it is there.
    wait_until(
        Duration::from_secs(5),
        "the record is complete",
        async || {
            send(env.post_keyed("/v1/p", "nc").body("x"))
                .await
                .replayed()
        },
    )
    .await;
    let mut trips = RoundTrips::start(env.redis()).await;
    for _ in 0..5 {
        assert!(send(
            env.client
                .post(&url)
                .header("idempotency-key", "nc")
                .body("x")
        )
        .await
        .replayed());
    }
    assert_eq!(trips.since().await, 5);
}
