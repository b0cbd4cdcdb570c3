//! Key, fingerprint and replay policy, per route: where the key comes from (header aliases, a
//! body field, a key derived from body fields), what the fingerprint covers (canonical JSON,
//! ignored fields, headers), how long a record lives (by status, as the upstream says), and what
//! a replay carries (no Set-Cookie, the expiry header).

use crate::common;

use std::time::{Duration, SystemTime};

use common::{send, wait_until, Backend, GatewayConfig, Seen, TestEnv};
use toml::toml;

const TOKEN: &str = "test-admin-token-0123456789";
const SECRET: &str = "derived-keys-secret-0123456789";

/// A POST of the JSON `body` to `path`, with `key` as its Idempotency-Key when given.
fn post_json(env: &TestEnv, path: &str, key: Option<&str>, body: &str) -> reqwest::RequestBuilder {
    let req = env
        .post(path)
        .header("content-type", "application/json")
        .body(body.to_string());
    match key {
        Some(key) => req.header("idempotency-key", key),
        None => req,
    }
}

/// The `detail` of a problem+json answer.
fn detail(seen: &Seen) -> String {
    let v: serde_json::Value = serde_json::from_slice(&seen.body).unwrap();
    v["detail"].as_str().unwrap_or_default().to_string()
}

const MISMATCH: &str = "urn:idemgate:problem:mismatch";
const INVALID_KEY: &str = "urn:idemgate:problem:invalid-key";
const INVALID_JSON: &str = "urn:idemgate:problem:invalid-json";

async fn json_fingerprint_replays_reserialised_json_and_exact_does_not(b: Backend) {
    let env = TestEnv::start(
        b,
        GatewayConfig::new().route("/v1/json", toml! { fingerprint = "json" }),
    )
    .await;
    let first = r#"{"amount":100,"currency":"EUR","meta":{"a":[1,2],"b":"é"}}"#;
    let again = "{ \"meta\" : { \"b\" : \"\\u00e9\", \"a\" : [ 1.0, 2e0 ] },\n  \"currency\":\"EUR\", \"amount\": 1.00E2 }";
    for path in ["/v1/json", "/v1/exact"] {
        let made = send(post_json(&env, path, Some(path), first)).await;
        assert_eq!(made.status, 201, "{path}");
        let retry = send(post_json(&env, path, Some(path), again)).await;
        if path == "/v1/json" {
            assert!(retry.replayed(), "same payment, re-serialised: {retry:?}");
            assert_eq!(retry.body, made.body);
        } else {
            assert_eq!(retry.problem_type(), MISMATCH, "exact bytes differ");
        }
    }
    assert_eq!(env.upstream.calls(), 2);
    // Another amount is another request, however it is spelled...
    let other = r#"{"amount":101,"currency":"EUR","meta":{"a":[1,2],"b":"é"}}"#;
    let seen = send(post_json(&env, "/v1/json", Some("/v1/json"), other)).await;
    assert_eq!(seen.problem_type(), MISMATCH);
    // ...and numbers are never rounded through floating point.
    let big = send(post_json(
        &env,
        "/v1/json",
        Some("big"),
        r#"{"amount":9007199254740993}"#,
    ))
    .await;
    assert_eq!(big.status, 201);
    let near = send(post_json(
        &env,
        "/v1/json",
        Some("big"),
        r#"{"amount":9007199254740992}"#,
    ))
    .await;
    assert_eq!(near.problem_type(), MISMATCH);
    // A body that is not JSON-typed is fingerprinted as its bytes.
    let text = |body: &str| {
        env.post("/v1/json")
            .header("idempotency-key", "text")
            .header("content-type", "text/plain")
            .body(body.to_string())
    };
    assert_eq!(send(text("{\"a\":1}")).await.status, 201);
    assert_eq!(send(text("{ \"a\": 1 }")).await.problem_type(), MISMATCH);
    assert_eq!(env.upstream.calls(), 4);
}

async fn ignored_fields_do_not_cause_a_mismatch(b: Backend) {
    let env = TestEnv::start(
        b,
        GatewayConfig::new()
            .set("defaults.fingerprint", "json")
            .set(
                "defaults.fingerprint_ignore",
                toml::Value::Array(vec!["/request_id".into(), "/items/*/client_ts".into()]),
            ),
    )
    .await;
    let first =
        r#"{"request_id":"r1","items":[{"sku":"a","client_ts":1},{"sku":"b","client_ts":2}]}"#;
    assert_eq!(
        send(post_json(&env, "/v1/p", Some("k"), first))
            .await
            .status,
        201
    );
    // A fresh request_id, other timestamps in the array, or an ignored field left out: a retry.
    for retry in [
        r#"{"request_id":"r2","items":[{"sku":"a","client_ts":9},{"sku":"b","client_ts":8}]}"#,
        r#"{"items":[{"client_ts":7,"sku":"a"},{"sku":"b"}]}"#,
    ] {
        let seen = send(post_json(&env, "/v1/p", Some("k"), retry)).await;
        assert!(seen.replayed(), "{retry}: {seen:?}");
    }
    // Another field changed: another request.
    let changed =
        r#"{"request_id":"r1","items":[{"sku":"c","client_ts":1},{"sku":"b","client_ts":2}]}"#;
    let seen = send(post_json(&env, "/v1/p", Some("k"), changed)).await;
    assert_eq!(seen.problem_type(), MISMATCH);
    assert_eq!(env.upstream.calls(), 1);
}

async fn invalid_json_is_refused_and_nothing_is_claimed(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new().set("defaults.fingerprint", "json")).await;
    let deep = format!("{}{}", "[".repeat(129), "]".repeat(129));
    for (body, why) in [
        (r#"{"amount":1"#, "cut short"),
        (r#"{"a":1,"\u0061":2}"#, "duplicate key after unescaping"),
        (deep.as_str(), "nested past the limit"),
    ] {
        let seen = send(post_json(&env, "/v1/p", Some("k"), body)).await;
        assert_eq!(seen.status, 400, "{why}");
        assert_eq!(seen.problem_type(), INVALID_JSON, "{why}");
    }
    // 128 levels are fine.
    let ok = format!("{}{}", "[".repeat(128), "]".repeat(128));
    assert_eq!(
        send(post_json(&env, "/v1/p", Some("deep"), &ok))
            .await
            .status,
        201
    );
    // Nothing was claimed: the fixed request runs under the same key.
    let fixed = send(post_json(&env, "/v1/p", Some("k"), r#"{"amount":1}"#)).await;
    assert_eq!(fixed.status, 201);
    assert!(!fixed.replayed());
    assert_eq!(env.upstream.calls(), 2);
}

async fn fingerprint_headers_are_part_of_the_request(b: Backend) {
    let env = TestEnv::start(
        b,
        GatewayConfig::new().set(
            "defaults.fingerprint_headers",
            toml::Value::Array(vec!["X-Api-Version".into()]),
        ),
    )
    .await;
    let with = |version: &str| {
        env.post_keyed("/v1/p", "k")
            .header("x-api-version", version)
            .body("x")
    };
    assert_eq!(send(with("2024-01")).await.status, 201);
    assert!(send(with("2024-01")).await.replayed());
    assert_eq!(send(with("2025-06")).await.problem_type(), MISMATCH);
    assert_eq!(
        send(env.post_keyed("/v1/p", "k").body("x"))
            .await
            .problem_type(),
        MISMATCH,
        "a header that was sent is not the same as none"
    );
    assert_eq!(env.upstream.calls(), 1);
}

async fn key_header_aliases_name_one_key(b: Backend) {
    let env = TestEnv::start(
        b,
        GatewayConfig::new().set(
            "defaults.key_headers",
            toml::Value::Array(vec!["idempotency-key".into(), "x-idempotency-key".into()]),
        ),
    )
    .await;
    let made = send(
        env.post("/v1/p")
            .header("x-idempotency-key", "k1")
            .body("x"),
    )
    .await;
    assert_eq!(made.status, 201);
    // The same key under the other name, or under both: the same record.
    assert!(send(env.post_keyed("/v1/p", "k1").body("x"))
        .await
        .replayed());
    let both = env
        .post_keyed("/v1/p", "k1")
        .header("x-idempotency-key", "k1")
        .body("x");
    assert!(send(both).await.replayed());
    // Two names with different keys: which one the client meant is unknown.
    let conflict = env
        .post_keyed("/v1/p", "k1")
        .header("x-idempotency-key", "k2")
        .body("x");
    let seen = send(conflict).await;
    assert_eq!(seen.status, 400);
    assert_eq!(seen.problem_type(), INVALID_KEY);
    assert!(
        detail(&seen).contains("x-idempotency-key"),
        "{}",
        detail(&seen)
    );
    assert_eq!(env.upstream.calls(), 1);
}

/// An admin listener on `config`, to read what the key view says.
fn with_admin(config: GatewayConfig) -> GatewayConfig {
    config
        .set("admin.listen", "127.0.0.1:0")
        .set("admin.admin_token", TOKEN)
}

/// What the admin key view says about `key` (no scope headers, no route), as JSON.
async fn inspect(env: &TestEnv, key: &str) -> serde_json::Value {
    inspect_at(env, key, "/").await
}

async fn a_body_key_names_the_same_record_as_a_header_key(b: Backend) {
    let env = TestEnv::start(
        b,
        with_admin(GatewayConfig::new().set("defaults.key_from_body", "/payment/reference")),
    )
    .await;
    let body = r#"{"payment":{"reference":"r-1"},"amount":5}"#;
    let made = send(post_json(&env, "/v1/p", None, body)).await;
    assert_eq!(made.status, 201);
    assert_eq!(inspect(&env, "r-1").await["key_source"], "body");
    assert!(send(post_json(&env, "/v1/p", None, body)).await.replayed());
    // A key is a key wherever it came from.
    assert!(send(post_json(&env, "/v1/p", Some("r-1"), body))
        .await
        .replayed());
    // A header key comes first: this body's reference is not used.
    let header_first = send(post_json(&env, "/v1/p", Some("h-1"), body)).await;
    assert!(!header_first.replayed());
    assert_eq!(inspect(&env, "h-1").await["key_source"], "header");
    // A number is a key as written.
    let numbered = r#"{"payment":{"reference":42}}"#;
    assert_eq!(
        send(post_json(&env, "/v1/p", None, numbered)).await.status,
        201
    );
    assert!(send(post_json(&env, "/v1/p", Some("42"), numbered))
        .await
        .replayed());
    assert_eq!(env.upstream.calls(), 3);
    // Not a string or a number, or too long: a 400 that names the pointer.
    let long = format!(r#"{{"payment":{{"reference":"{}"}}}}"#, "r".repeat(300));
    for bad in [r#"{"payment":{"reference":{"id":1}}}"#, long.as_str()] {
        let seen = send(post_json(&env, "/v1/p", None, bad)).await;
        assert_eq!(seen.problem_type(), INVALID_KEY);
        assert!(
            detail(&seen).contains("/payment/reference"),
            "{}",
            detail(&seen)
        );
    }
    // No key anywhere: passed through, as without the setting.
    let keyless = send(post_json(&env, "/v1/p", None, r#"{"amount":5}"#)).await;
    assert_eq!(keyless.status, 201);
    assert_eq!(env.upstream.calls(), 4);
}

async fn a_derived_key_is_the_payment_identity(b: Backend) {
    let settings = with_admin(GatewayConfig::new().key_secret(SECRET))
        .set("defaults.fingerprint", "json")
        .set(
            "defaults.fingerprint_ignore",
            toml::Value::Array(vec!["/sent_at".into()]),
        )
        .set(
            "defaults.derived_key",
            toml::Value::Array(vec!["/merchant".into(), "/order".into(), "/amount".into()]),
        )
        .route("/v1/strict", toml! { require_key = true });
    let env = TestEnv::start(b, settings).await;
    let first = r#"{"merchant":"m-1","order":"o-7","amount":100,"sent_at":"10:00"}"#;
    let made = send(post_json(&env, "/v1/p", None, first)).await;
    assert_eq!(made.status, 201);
    // Same fields in another order, another ignored field: the same record.
    let again = r#"{"sent_at":"10:05","amount":1.0e2,"order":"o-7","merchant":"m-1"}"#;
    let retry = send(post_json(&env, "/v1/p", None, again)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, made.body);
    // Another amount: another payment, another record.
    let other = r#"{"merchant":"m-1","order":"o-7","amount":101}"#;
    let seen = send(post_json(&env, "/v1/p", None, other)).await;
    assert_eq!(seen.status, 201);
    assert!(!seen.replayed());
    assert_eq!(env.upstream.calls(), 2);
    // A field missing: no key, so require_key decides.
    let partial = r#"{"merchant":"m-1","amount":100}"#;
    assert_eq!(
        send(post_json(&env, "/v1/p", None, partial)).await.status,
        201
    );
    assert_eq!(env.upstream.calls(), 3, "passed through");
    let refused = send(post_json(&env, "/v1/strict", None, partial)).await;
    assert_eq!(refused.problem_type(), "urn:idemgate:problem:missing-key");
    assert_eq!(env.upstream.calls(), 3);
}

async fn failure_ttl_lets_a_fixed_request_run_while_a_success_stays(b: Backend) {
    let env = TestEnv::start(
        b,
        GatewayConfig::new()
            .set("defaults.ttl", "1h")
            .set("defaults.failure_ttl", "1s"),
    )
    .await;
    let bad = send(env.post_keyed("/v1/p?status=400", "bad").body("x")).await;
    assert_eq!(bad.status, 400);
    assert!(send(env.post_keyed("/v1/p?status=400", "bad").body("x"))
        .await
        .replayed());
    assert_eq!(
        send(env.post_keyed("/v1/p", "good").body("x")).await.status,
        201
    );
    // The 400 expires after failure_ttl: the client's retry runs again.
    wait_until(Duration::from_secs(5), "the 400 expired", async || {
        !send(env.post_keyed("/v1/p?status=400", "bad").body("x"))
            .await
            .replayed()
    })
    .await;
    assert!(send(env.post_keyed("/v1/p", "good").body("x"))
        .await
        .replayed());
    assert_eq!(env.upstream.calls(), 3);
}

async fn the_upstream_steers_a_response_with_idempotency_control(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new().set("defaults.ttl", "1h")).await;
    // no-store (and max-age=0): not recorded, the key is free again at once.
    for control in ["no-store", "max-age%3D0"] {
        let path = format!("/v1/p?control={control}");
        let key = format!("k-{control}");
        let first = send(env.post_keyed(&path, &key).body("x")).await;
        assert_eq!(first.status, 201);
        assert_eq!(first.header("idempotency-control"), None, "never relayed");
        let second = send(env.post_keyed(&path, &key).body("x")).await;
        assert!(!second.replayed(), "{control}: not recorded");
    }
    assert_eq!(env.upstream.calls(), 4);
    // max-age: recorded for that long instead of the route's ttl.
    let first = send(
        env.post_keyed("/v1/p?control=max-age%3D1", "short")
            .body("x"),
    )
    .await;
    assert_eq!(first.header("idempotency-control"), None);
    let replay = send(
        env.post_keyed("/v1/p?control=max-age%3D1", "short")
            .body("x"),
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(
        replay.header("idempotency-control"),
        None,
        "not in the record either"
    );
    wait_until(Duration::from_secs(5), "the record expired", async || {
        !send(
            env.post_keyed("/v1/p?control=max-age%3D1", "short")
                .body("x"),
        )
        .await
        .replayed()
    })
    .await;
    // Stripped from responses to requests without a key, too.
    let unkeyed = send(env.post("/v1/p?control=no-store").body("x")).await;
    assert_eq!(unkeyed.status, 201);
    assert_eq!(unkeyed.header("idempotency-control"), None);
    let get = send(env.client.get(env.url("/v1/p?control=max-age%3D5"))).await;
    assert_eq!(get.header("idempotency-control"), None);
}

async fn set_cookie_is_recorded_but_not_replayed(b: Backend) {
    let settings =
        with_admin(GatewayConfig::new()).route("/v1/all", toml! { replay_drop_headers = [] });
    let env = TestEnv::start(b, settings).await;
    let cookies = |seen: &Seen| -> Vec<String> {
        seen.headers
            .get_all("set-cookie")
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect()
    };
    let first = send(env.post_keyed("/v1/p", "k").body("x")).await;
    assert_eq!(
        cookies(&first),
        ["a=1", "b=2"],
        "the first caller gets its cookies"
    );
    let replay = send(env.post_keyed("/v1/p", "k").body("x")).await;
    assert!(replay.replayed());
    assert!(cookies(&replay).is_empty(), "a replay hands out no session");
    assert_eq!(replay.body, first.body);
    let names = inspect(&env, "k").await["header_names"].clone();
    assert!(
        names.as_array().unwrap().iter().any(|n| n == "set-cookie"),
        "recorded: {names}"
    );
    // An empty list replays every header.
    send(env.post_keyed("/v1/all", "k2").body("x")).await;
    let replay = send(env.post_keyed("/v1/all", "k2").body("x")).await;
    assert!(replay.replayed());
    assert_eq!(cookies(&replay), ["a=1", "b=2"]);
}

async fn scope_cookies_separate_sessions(b: Backend) {
    let env = TestEnv::start(
        b,
        GatewayConfig::new().set(
            "defaults.scope_cookies",
            toml::Value::Array(vec!["session_id".into()]),
        ),
    )
    .await;
    let with_cookie = |cookie: &str| {
        env.post_keyed("/v1/p", "k")
            .header("cookie", cookie)
            .body("x")
    };
    let alice = send(with_cookie("session_id=alice; theme=dark")).await;
    assert_eq!(alice.status, 201);
    let bob = send(with_cookie("theme=dark; session_id=bob")).await;
    assert!(!bob.replayed(), "another session: its own record");
    assert_eq!(env.upstream.calls(), 2);
    // Other cookies do not matter.
    let again = send(with_cookie("theme=light; session_id=alice; lang=fr")).await;
    assert!(again.replayed());
    assert_eq!(again.body, alice.body);
    let none = send(env.post_keyed("/v1/p", "k").body("x")).await;
    assert!(!none.replayed(), "no session: a scope of its own");
    assert_eq!(env.upstream.calls(), 3);
}

async fn the_expiry_header_tells_when_the_record_goes(b: Backend) {
    let env = TestEnv::start(
        b,
        GatewayConfig::new()
            .set("defaults.ttl", "1h")
            .set("defaults.failure_ttl", "5m")
            .set("defaults.expiry_header", "idempotency-expires"),
    )
    .await;
    let expires = |seen: &Seen| -> SystemTime {
        let value = seen
            .header("idempotency-expires")
            .unwrap_or_else(|| panic!("no expiry header: {seen:?}"));
        httpdate::parse_http_date(value).unwrap()
    };
    let near = |at: SystemTime, after: Duration| {
        let want = SystemTime::now() + after;
        let off = want.duration_since(at).unwrap_or_else(|e| e.duration());
        assert!(off < Duration::from_secs(5), "{at:?} is not about {want:?}");
    };
    let first = send(env.post_keyed("/v1/p", "k").body("x")).await;
    near(expires(&first), Duration::from_secs(3600));
    let replay = send(env.post_keyed("/v1/p", "k").body("x")).await;
    assert!(replay.replayed());
    assert_eq!(expires(&replay), expires(&first), "the record's own expiry");
    // A second replay (from the local cache in front of Redis) says the same.
    let again = send(env.post_keyed("/v1/p", "k").body("x")).await;
    assert_eq!(expires(&again), expires(&first));
    let failed = send(env.post_keyed("/v1/p?status=422", "f").body("x")).await;
    near(expires(&failed), Duration::from_secs(300));
    // A response that is not recorded has no expiry to tell.
    let unstored = send(env.post_keyed("/v1/p?status=503", "s").body("x")).await;
    assert_eq!(unstored.header("idempotency-expires"), None);
}

on_both_backends!(
    json_fingerprint_replays_reserialised_json_and_exact_does_not,
    ignored_fields_do_not_cause_a_mismatch,
    invalid_json_is_refused_and_nothing_is_claimed,
    fingerprint_headers_are_part_of_the_request,
    key_header_aliases_name_one_key,
    a_body_key_names_the_same_record_as_a_header_key,
    a_derived_key_is_the_payment_identity,
    failure_ttl_lets_a_fixed_request_run_while_a_success_stays,
    the_upstream_steers_a_response_with_idempotency_control,
    set_cookie_is_recorded_but_not_replayed,
    scope_cookies_separate_sessions,
    the_expiry_header_tells_when_the_record_goes,
    expired_keys_are_refused_with_410_until_their_tombstone_goes,
);

/// `after_expiry = "refuse"` against the default `"run"`, with records that live a second.
async fn expired_keys_are_refused_with_410_until_their_tombstone_goes(b: Backend) {
    let refuse = toml! {
        ttl = "1s"
        after_expiry = "refuse"
        tombstone_ttl = "2s"
    };
    let mut stripe = refuse.clone();
    stripe.insert("error_format".into(), "stripe".into());
    let config = GatewayConfig::new()
        .route("/v1/refuse", refuse)
        .route("/v1/stripe", stripe)
        .route("/v1/run", toml! { ttl = "1s" });
    let env = TestEnv::start(b, with_admin(config)).await;
    let pay = |path: &str, key: &str, body: &str| env.post_keyed(path, key).body(body.to_string());
    // One key per route: a key is one request whatever the route.
    for (path, key) in [("/v1/refuse", "k"), ("/v1/stripe", "s"), ("/v1/run", "u")] {
        assert_eq!(send(pay(path, key, "a")).await.status, 201, "{path}");
    }
    // Released answers leave no tombstone: their retries run at once, as always.
    assert_eq!(
        send(pay("/v1/refuse?status=503", "r", "a")).await.status,
        503
    );
    assert_eq!(
        send(pay("/v1/refuse?control=no-store", "n", "a"))
            .await
            .status,
        201
    );
    assert_eq!(env.upstream.calls(), 5);
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let expired = send(pay("/v1/refuse", "k", "a")).await;
    assert_eq!(expired.status, 410, "{expired:?}");
    assert_eq!(expired.problem_type(), "urn:idemgate:problem:key-expired");
    assert!(
        detail(&expired).contains("with status 201"),
        "{}",
        detail(&expired)
    );
    let other = send(pay("/v1/refuse", "k", "b")).await;
    assert_eq!(other.problem_type(), MISMATCH);
    let shaped = send(pay("/v1/stripe", "s", "a")).await;
    let v: serde_json::Value = serde_json::from_slice(&shaped.body).unwrap();
    assert_eq!(
        (shaped.status, &v["error"]["type"]),
        (410, &"idempotency_error".into())
    );
    assert_eq!(v["error"]["code"], "key_expired");
    let view = inspect_at(&env, "k", "/v1/refuse").await;
    assert_eq!(
        (&view["state"], &view["status"]),
        (&"expired".into(), &201.into())
    );
    assert_eq!(
        env.upstream.calls(),
        5,
        "nothing expired reached the upstream"
    );
    // The default runs an expired key again, and so do released keys.
    assert_eq!(send(pay("/v1/run", "u", "a")).await.status, 201);
    assert_eq!(
        send(pay("/v1/refuse?status=503", "r", "a")).await.status,
        503
    );
    assert_eq!(send(pay("/v1/refuse", "n", "a")).await.status, 201);
    assert_eq!(env.upstream.calls(), 8);

    // An operator may free a key by evicting its tombstone.
    let admin = env.gateway.admin.expect("admin listener");
    let evicted = env
        .client
        .delete(format!("http://{admin}/keys/s?route=/v1/stripe"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(evicted.status(), 200);
    assert_eq!(send(pay("/v1/stripe", "s", "a")).await.status, 201);
    // After tombstone_ttl the key is free by itself.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    assert_eq!(send(pay("/v1/refuse", "k", "a")).await.status, 201);
    assert_eq!(env.upstream.calls(), 10);
}

/// [`inspect`] on the route `path` takes.
async fn inspect_at(env: &TestEnv, key: &str, path: &str) -> serde_json::Value {
    let admin = env.gateway.admin.expect("admin listener");
    env.client
        .get(format!("http://{admin}/keys/{key}?route={path}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}
