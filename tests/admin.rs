//! Operating the gateway: metrics, the admin listener and its key API, trace context.

use crate::common;

use std::time::Duration;

use common::{send, wait_until, Backend, CountingUpstream, GatewayConfig, TestEnv};

const TOKEN: &str = "test-admin-token-0123456789";
const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// An admin listener with the key API on.
fn admin_config() -> GatewayConfig {
    GatewayConfig::new()
        .set("admin.listen", "127.0.0.1:0")
        .set("admin.admin_token", TOKEN)
}

fn admin_url(env: &TestEnv, path: &str) -> String {
    format!(
        "http://{}{}",
        env.gateway.admin.expect("admin listener"),
        path
    )
}

/// `idemgate_requests_total{route="defaults",outcome="<outcome>"}` from a scrape.
fn requests(scrape: &str, outcome: &str) -> u64 {
    let prefix = format!("idemgate_requests_total{{route=\"defaults\",outcome=\"{outcome}\"}} ");
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// `method url` (an admin listener URL) with `token` as the bearer.
async fn authed(
    env: &TestEnv,
    method: reqwest::Method,
    url: impl reqwest::IntoUrl,
    token: &str,
) -> reqwest::Response {
    env.client
        .request(method, url)
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
}

/// The status a request gets.
async fn status(req: reqwest::RequestBuilder) -> u16 {
    req.send().await.unwrap().status().as_u16()
}

on_both_backends!(
    metrics_count_every_outcome,
    key_api_requires_the_token,
    inspect_shows_the_record_and_trace,
    eviction_lets_the_key_run_again,
);

async fn metrics_count_every_outcome(b: Backend) {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(300));
    let env = TestEnv::start_with(b, upstream, admin_config()).await;
    let before = env.gateway.metrics().await;
    for outcome in [
        "miss",
        "replayed",
        "in_flight_conflict",
        "mismatch",
        "passthrough",
        "rejected_invalid",
    ] {
        assert_eq!(requests(&before, outcome), 0, "{outcome}");
    }
    let first = tokio::spawn(send(env.post_keyed("/v1/p", "m").body("x")));
    env.upstream.wait_for_calls(1).await;
    assert_eq!(
        send(env.post_keyed("/v1/p", "m").body("x")).await.status,
        409
    );
    first.await.unwrap();
    assert!(send(env.post_keyed("/v1/p", "m").body("x"))
        .await
        .replayed());
    assert!(send(env.post_keyed("/v1/p", "m").body("x"))
        .await
        .replayed());
    assert_eq!(
        send(env.post_keyed("/v1/p", "m").body("other"))
            .await
            .status,
        409
    );
    send(env.post("/v1/p").body("x")).await;
    assert_eq!(
        send(env.post_keyed("/v1/p", "").body("x")).await.status,
        400
    );

    let after = env.gateway.metrics().await;
    assert_eq!(requests(&after, "miss"), 1);
    assert_eq!(requests(&after, "in_flight_conflict"), 1);
    assert_eq!(requests(&after, "replayed"), 2);
    assert_eq!(requests(&after, "mismatch"), 1);
    assert_eq!(requests(&after, "passthrough"), 1);
    assert_eq!(requests(&after, "rejected_invalid"), 1);
    for family in [
        "idemgate_overhead_seconds_count",
        "idemgate_upstream_duration_seconds_count",
        "idemgate_store_operation_seconds_count{operation=\"claim\"}",
        "idemgate_in_flight_claims",
        "idemgate_replayed_bytes_total",
    ] {
        assert!(after.contains(family), "{family} missing from:\n{after}");
    }
    assert!(after.contains("# HELP idemgate_requests Requests by route and outcome"));
    assert!(
        !after.contains("idemgate_in_flight_claims 1"),
        "no claim is held once all answered"
    );
}

async fn key_api_requires_the_token(b: Backend) {
    let env = TestEnv::start(b, admin_config()).await;
    assert_eq!(
        status(env.client.get(admin_url(&env, "/healthz"))).await,
        200
    );
    assert_eq!(
        status(env.client.get(admin_url(&env, "/readyz"))).await,
        200
    );
    let url = admin_url(&env, "/keys/k1");
    let none = env.client.get(&url).send().await.unwrap();
    assert_eq!(none.status(), 401);
    assert!(none.headers().contains_key("www-authenticate"));
    let wrong = authed(
        &env,
        reqwest::Method::GET,
        &url,
        "test-admin-token-0123456780",
    )
    .await;
    assert_eq!(wrong.status(), 401);
    let right = authed(&env, reqwest::Method::GET, &url, TOKEN).await;
    assert_eq!(right.status(), 404, "authorised, and no such key");
    // The scheme is case-insensitive (RFC 9110 section 11.1).
    for scheme in ["bearer", "BEARER", "bEaReR"] {
        let r = env
            .client
            .get(&url)
            .header("authorization", format!("{scheme} {TOKEN}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{scheme}: authorised, and no such key");
    }
    let basic = env
        .client
        .get(&url)
        .header("authorization", format!("Basic {TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(basic.status(), 401, "another scheme with the right token");
    let all = authed(
        &env,
        reqwest::Method::DELETE,
        admin_url(&env, "/keys"),
        "nope",
    )
    .await;
    assert_eq!(all.status(), 401);

    // Without a token in the config the key API is off, health and metrics stay on.
    let env = TestEnv::start(b, GatewayConfig::new().set("admin.listen", "127.0.0.1:0")).await;
    let off = authed(
        &env,
        reqwest::Method::GET,
        admin_url(&env, "/keys/k1"),
        TOKEN,
    )
    .await;
    assert_eq!(off.status(), 404);
    assert!(off.text().await.unwrap().contains("admin-disabled"));
    assert_eq!(
        status(env.client.get(admin_url(&env, "/metrics"))).await,
        200
    );
}

async fn inspect_shows_the_record_and_trace(b: Backend) {
    let env = TestEnv::start(b, admin_config()).await;
    let first = send(
        env.post_keyed("/v1/p", "inspect-me")
            .bearer_auth("alice")
            .header("traceparent", TRACE)
            .body("x"),
    )
    .await;
    assert_eq!(
        env.upstream.last_headers()["traceparent"],
        TRACE,
        "forwarded to the upstream"
    );
    let url = admin_url(&env, "/keys/inspect-me?authorization=Bearer%20alice");
    let seen: serde_json::Value = authed(&env, reqwest::Method::GET, &url, TOKEN)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(seen["state"], "completed");
    assert_eq!(seen["status"], 201);
    assert_eq!(seen["body_bytes"], first.body.len());
    assert_eq!(seen["traceparent"], TRACE, "stored with the record");
    assert_eq!(seen["trailer_names"], serde_json::json!([]));
    assert!(seen["expires_in_ms"].as_u64().unwrap() > 86_000_000);
    assert!(seen["written_at"].as_str().unwrap().ends_with('Z'));
    assert!(seen.get("body_base64").is_none(), "no body unless asked");
    let with_body: serde_json::Value =
        authed(&env, reqwest::Method::GET, format!("{url}&body=1"), TOKEN)
            .await
            .json()
            .await
            .unwrap();
    use base64::Engine;
    let body = base64::engine::general_purpose::STANDARD
        .decode(with_body["body_base64"].as_str().unwrap())
        .unwrap();
    assert_eq!(body, first.body.to_vec());
    // Another caller's scope does not see it.
    let other = authed(
        &env,
        reqwest::Method::GET,
        admin_url(&env, "/keys/inspect-me?authorization=Bearer%20bob"),
        TOKEN,
    )
    .await;
    assert_eq!(other.status(), 404);
}

async fn eviction_lets_the_key_run_again(b: Backend) {
    let env = TestEnv::start(b, admin_config()).await;
    send(env.post_keyed("/v1/p", "evict-me").body("x")).await;
    send(env.post_keyed("/v1/p", "other-1").body("x")).await;
    send(env.post_keyed("/v1/p", "other-2").body("x")).await;
    assert!(send(env.post_keyed("/v1/p", "evict-me").body("x"))
        .await
        .replayed());
    let gone = authed(
        &env,
        reqwest::Method::DELETE,
        admin_url(&env, "/keys/evict-me"),
        TOKEN,
    )
    .await;
    assert_eq!(gone.status(), 200);
    let again = send(env.post_keyed("/v1/p", "evict-me").body("x")).await;
    assert!(
        !again.replayed(),
        "evicted: the next request runs again (and the local cache forgot it)"
    );
    assert_eq!(env.upstream.calls(), 4);

    let refused = authed(
        &env,
        reqwest::Method::DELETE,
        admin_url(&env, "/keys"),
        TOKEN,
    )
    .await;
    assert_eq!(
        refused.status(),
        400,
        "the emergency switch needs ?confirm=all"
    );
    let all: serde_json::Value = authed(
        &env,
        reqwest::Method::DELETE,
        admin_url(&env, "/keys?confirm=all"),
        TOKEN,
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(all["evicted"], 3);
    for key in ["evict-me", "other-1", "other-2"] {
        assert!(
            !send(env.post_keyed("/v1/p", key).body("x"))
                .await
                .replayed(),
            "{key}"
        );
    }
    assert_eq!(env.upstream.calls(), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_store() {
    let env = TestEnv::start(Backend::Redis, admin_config()).await;
    let url = admin_url(&env, "/readyz");
    assert_eq!(status(env.client.get(&url)).await, 200);
    env.redis().kill();
    assert_eq!(status(env.client.get(&url)).await, 503);
    env.redis().restart().await;
    wait_until(
        Duration::from_secs(5),
        "ready again after Redis came back",
        async || status(env.client.get(&url)).await == 200,
    )
    .await;
}
