//! The gateway in its clients' own terms: every refusal it makes itself in Stripe's error shape
//! on a route with `error_format = "stripe"` (and read by the real stripe-python SDK, installed
//! from PyPI into a venv of the tests' own), while replays and upstream answers stay untouched.

use crate::common;

use std::time::{Duration, SystemTime};

use common::{free_port, send, Backend, CountingUpstream, GatewayConfig, Seen, TestEnv};
use testkit::PythonEnv;
use toml::toml;

/// The stripe-python release the tests drive the gateway with.
const STRIPE_PYTHON: &str = "stripe==16.1.0";

/// A world whose routes answer in Stripe's shape, except `/v1/plain`.
fn stripe_config() -> GatewayConfig {
    GatewayConfig::new()
        .set("defaults.error_format", "stripe")
        .set(
            "upstreams.down.url",
            format!("http://127.0.0.1:{}", free_port()),
        )
        .route("/v1/plain", toml! { error_format = "problem" })
        .route("/v1/required", toml! { require_key = true })
        .route("/v1/small", toml! { max_body = 16 })
        .route("/v1/by-body", toml! { key_from_body = "/reference" })
        .route("/v1/down", toml! { upstream = "down" })
}

/// Stripe's error object of an answer: (HTTP status, type, code), after checking its shape.
fn stripe_error(seen: &Seen) -> (u16, String, String) {
    assert_eq!(
        seen.header("content-type"),
        Some("application/json"),
        "{seen:?}"
    );
    let v: serde_json::Value = serde_json::from_slice(&seen.body).unwrap();
    let error = &v["error"];
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.len() > 20, "a message to act on: {v}");
    assert_eq!(v.as_object().unwrap().len(), 1, "only `error`: {v}");
    let field = |name: &str| error[name].as_str().unwrap_or_default().to_string();
    (seen.status, field("type"), field("code"))
}

fn expect(seen: &Seen, status: u16, kind: &str, code: &str) {
    let (got_status, got_kind, got_code) = stripe_error(seen);
    assert_eq!(
        (got_status, got_kind.as_str(), got_code.as_str()),
        (status, kind, code),
        "{seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_is_in_stripes_shape_and_replays_are_untouched() {
    let env = TestEnv::start(Backend::Memory, stripe_config()).await;
    let pay = |key: &str, body: &str| env.post_keyed("/v1/pay", key).body(body.to_string());

    let first = send(pay("k1", "amount=100")).await;
    assert_eq!(first.status, 201);
    let replay = send(pay("k1", "amount=100")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body, "a replay is the upstream's answer");
    // A key reused with another request: 400, as Stripe answers it (not mismatch_status).
    let reused = send(pay("k1", "amount=999")).await;
    expect(&reused, 400, "idempotency_error", "mismatch");
    // The same refusal on a route that keeps problem+json.
    send(env.post_keyed("/v1/plain", "k1").body("a")).await;
    let plain = send(env.post_keyed("/v1/plain", "k1").body("b")).await;
    assert_eq!(plain.problem_type(), "urn:idemgate:problem:mismatch");

    // Still in flight: 409 with Retry-After, Stripe's own code.
    let slow = env.post_keyed("/v1/pay?delay_ms=1500", "slow").body("x");
    let running = tokio::spawn(send(slow));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = send(env.post_keyed("/v1/pay?delay_ms=1500", "slow").body("x")).await;
    expect(&again, 409, "idempotency_error", "idempotency_key_in_use");
    assert!(again.header("retry-after").is_some(), "{again:?}");
    assert_eq!(running.await.unwrap().status, 201);

    // Requests the gateway cannot take.
    let missing = send(env.post("/v1/required").body("x")).await;
    expect(&missing, 400, "invalid_request_error", "missing_key");
    let long = "k".repeat(300);
    let invalid = send(env.post_keyed("/v1/pay", &long).body("x")).await;
    expect(&invalid, 400, "invalid_request_error", "invalid_key");
    let big = send(env.post_keyed("/v1/small", "big").body("x".repeat(100))).await;
    expect(&big, 413, "invalid_request_error", "body_too_large");
    let json = env
        .post("/v1/by-body")
        .header("content-type", "application/json")
        .body("{\"reference\": ");
    expect(
        &send(json).await,
        400,
        "invalid_request_error",
        "invalid_json",
    );

    // The upstream's failures, keyed (the engine's answer) or not (the listener's).
    let keyed = send(env.post_keyed("/v1/down", "down").body("x")).await;
    expect(&keyed, 502, "api_error", "upstream_unavailable");
    let unkeyed = send(env.client.get(env.url("/v1/down"))).await;
    expect(&unkeyed, 502, "api_error", "upstream_unavailable");
    // An upstream's own error passes as it came.
    let own = send(env.post_keyed("/v1/pay?status=402", "declined").body("x")).await;
    assert_eq!(own.status, 402);
    let v: serde_json::Value = serde_json::from_slice(&own.body).unwrap();
    assert!(v.get("error").is_none(), "the upstream's body: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_is_an_api_error_with_retry_after() {
    let env = TestEnv::start(Backend::Redis, stripe_config()).await;
    env.redis().kill();
    let seen = send(env.post_keyed("/v1/pay", "k").body("x")).await;
    expect(&seen, 503, "api_error", "store_unavailable");
    assert_eq!(seen.header("retry-after"), Some("1"));
}

/// What stripe-python makes of a `Customer.create`, its retry, the key reused with other
/// parameters, and a call while another with its key still runs.
const SDK_SCRIPT: &str = r#"
import sys, threading, time, stripe
stripe.api_key = "sk_test_idemgate"
stripe.api_base = sys.argv[1]
stripe.max_network_retries = 0

def outcome(call):
    try:
        call()
        return "ok"
    except stripe.IdempotencyError as e:
        return f"IdempotencyError {e.http_status} {e.user_message}"
    except stripe.StripeError as e:
        return f"{type(e).__name__} {e.http_status} {e.user_message}"

print(outcome(lambda: stripe.Customer.create(name="first", idempotency_key="cus-1")))
print(outcome(lambda: stripe.Customer.create(name="first", idempotency_key="cus-1")))
print(outcome(lambda: stripe.Customer.create(name="other", idempotency_key="cus-1")))
slow = threading.Thread(target=lambda: stripe.Customer.create(name="slow", idempotency_key="cus-2"))
slow.start()
time.sleep(0.3)
print(outcome(lambda: stripe.Customer.create(name="slow", idempotency_key="cus-2")))
slow.join()
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_python_raises_its_idempotency_error_for_a_reused_key() {
    let python = tokio::task::spawn_blocking(|| {
        PythonEnv::with_packages(
            env!("CARGO_TARGET_TMPDIR").as_ref(),
            "stripe-python",
            &[STRIPE_PYTHON],
        )
    })
    .await
    .unwrap();
    // Every call takes long enough for the last one to find the one before it in flight.
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(800));
    let env = TestEnv::start_with(Backend::Memory, upstream, stripe_config()).await;
    let api = env.url("");
    let out = tokio::task::spawn_blocking(move || python.run(SDK_SCRIPT, &[&api]))
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[..2], ["ok", "ok"], "{stdout}");
    let reused = "IdempotencyError 400 this Idempotency-Key was already used";
    assert!(lines[2].starts_with(reused), "{stdout}");
    assert!(
        lines[3].starts_with(
            "APIError 409 a request with this Idempotency-Key is still being processed"
        ),
        "{stdout}"
    );
    assert_eq!(
        env.upstream.calls(),
        2,
        "only the first of each key reached the upstream"
    );
}

/// A repeatable request to `/v1/repeat` with `id`, first sent `ago` (negative: ahead).
fn repeat(env: &TestEnv, id: &str, sent: SystemTime) -> reqwest::RequestBuilder {
    env.post("/v1/repeat")
        .header("repeatability-request-id", id)
        .header("repeatability-first-sent", httpdate::fmt_http_date(sent))
        .body("amount=100")
}

fn result(seen: &Seen) -> Option<&str> {
    seen.header("repeatability-result")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeatable_requests_are_accepted_replayed_and_refused_when_too_old() {
    let route = toml! {
        repeatability = true
        ttl = "1h"
    };
    let config = GatewayConfig::new().route("/v1/repeat", route);
    let env = TestEnv::start(Backend::Memory, config).await;
    let now = SystemTime::now();
    let first = send(repeat(&env, "r-1", now)).await;
    assert_eq!((first.status, result(&first)), (201, Some("accepted")));
    let again = send(repeat(&env, "r-1", now)).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(result(&again), Some("accepted"));
    assert_eq!(again.body, first.body);
    assert_eq!(env.upstream.calls(), 1);

    // First sent longer ago than the route keeps answers, or too far ahead: 412, never run.
    let old = send(repeat(&env, "r-old", now - Duration::from_secs(7200))).await;
    assert_eq!((old.status, result(&old)), (412, Some("rejected")));
    assert_eq!(
        old.problem_type(),
        "urn:idemgate:problem:repeatability-rejected"
    );
    let ahead = send(repeat(&env, "r-ahead", now + Duration::from_secs(600))).await;
    assert_eq!((ahead.status, result(&ahead)), (412, Some("rejected")));
    // A little clock skew is fine.
    let skewed = send(repeat(&env, "r-skew", now + Duration::from_secs(20))).await;
    assert_eq!(skewed.status, 201);
    assert_eq!(env.upstream.calls(), 2);

    // First-Sent missing or unparsable, or a different Idempotency-Key beside: 400.
    let missing = env
        .post("/v1/repeat")
        .header("repeatability-request-id", "r-2");
    let missing = send(missing.body("x")).await;
    assert_eq!(missing.status, 400);
    assert_eq!(
        missing.problem_type(),
        "urn:idemgate:problem:invalid-repeatability"
    );
    let garbled = repeat(&env, "r-2", now).header("repeatability-first-sent", "yesterday");
    assert_eq!(send(garbled).await.status, 400);
    let both = repeat(&env, "r-3", now).header("idempotency-key", "other");
    let both = send(both).await;
    assert_eq!(both.problem_type(), "urn:idemgate:problem:invalid-key");
    let same = send(repeat(&env, "r-3", now).header("idempotency-key", "r-3")).await;
    assert_eq!(
        same.status, 201,
        "the same key under both names is that key"
    );
    assert_eq!(env.upstream.calls(), 3);

    // The client id scopes the request id: two clients, two requests.
    let client = |c: &str| repeat(&env, "shared", now).header("repeatability-client-id", c);
    assert_eq!(send(client("a")).await.status, 201);
    assert_eq!(send(client("b")).await.status, 201);
    assert!(send(client("a")).await.replayed());
    assert_eq!(env.upstream.calls(), 5);

    // A key reused with another request is refused, and says so.
    let other = repeat(&env, "r-1", now).body("amount=999");
    let other = send(other).await;
    assert_eq!((other.status, result(&other)), (409, Some("rejected")));
    // Without a Request-ID, the route is an ordinary one: no Repeatability-Result.
    let plain = send(env.post_keyed("/v1/repeat", "plain").body("x")).await;
    assert_eq!((plain.status, result(&plain)), (201, None));
}
