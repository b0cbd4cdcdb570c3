//! Where two features meet: records kept forever and an upstream's `max-age` across the whole
//! u64 range, tombstones and eviction or `failure_ttl`, Repeatable Requests and a store outage,
//! waiting duplicates attaching to a stream, store stalls longer than a lease. Each over real
//! sockets, on every backend it concerns.

use crate::common;

use std::time::{Duration, SystemTime};

use common::{send, wait_until, Backend, CountingUpstream, GatewayConfig, Seen, TestEnv};
use toml::toml;

const TOKEN: &str = "test-admin-token-0123456789";

on_both_backends!(
    any_max_age_is_recorded_and_replayed_with_a_valid_expiry,
    a_bare_comma_is_two_keys_and_is_refused,
    a_failure_leaves_no_tombstone_so_the_fixed_request_runs_after_failure_ttl,
    a_duplicate_waiting_for_a_stream_attaches_with_one_waiter_permit,
    a_repeat_older_than_the_shortest_record_life_is_refused,
);

/// `max-age` values across the u64 range: the edges of every unit a store or a formatter
/// counts in, and a few drawn from a seeded generator.
fn max_ages() -> Vec<u64> {
    let mut ages = vec![
        1,
        59,
        86_400,
        u64::from(u32::MAX),
        300_000_000_000,
        9_223_372_036_854,
        10_000_000_000_000,
        3_153_600_000,
        3_153_600_001,
        u64::MAX / 1000,
        i64::MAX as u64,
        u64::MAX - 1,
        u64::MAX,
    ];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..5 {
        // xorshift64: reproducible, spread over the whole range.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ages.push(x);
    }
    ages
}

/// The route's record lifetimes: forever where the store keeps records forever, else a bound of
/// 100 years (the longest any duration takes effect with), so that `max-age` is never cut short
/// by the route and the stores and formatters see the whole range.
fn longest_lifetimes(b: Backend) -> toml::Table {
    match b {
        Backend::Embedded | Backend::Postgres => toml! {
            ttl = "forever"
            expiry_header = "idempotency-expires"
        },
        Backend::Memory | Backend::Redis => toml! {
            ttl = "1h"
            max_ttl = "36500d"
            expiry_header = "idempotency-expires"
        },
    }
}

/// The expiry header, when there is one, is an HTTP-date no sooner than `lives` from now
/// (within a minute's slack for a slow machine) and no later than 100 years and a day.
fn expires_within(seen: &Seen, at_least: Duration) {
    let Some(value) = seen.header("idempotency-expires") else {
        return;
    };
    let at = httpdate::parse_http_date(value).unwrap_or_else(|e| panic!("{value:?}: {e}"));
    let now = SystemTime::now();
    let century = Duration::from_secs(100 * 365 * 24 * 3600 + 86_400);
    assert!(at <= now + century, "{value}");
    let least = at_least.min(century - Duration::from_secs(86_400));
    assert!(
        at + Duration::from_secs(60) >= now + least,
        "{value} is sooner than {least:?}"
    );
}

/// An upstream's `Idempotency-Control: max-age` of any size is recorded (for at most 100 years)
/// and replayed, buffered and streamed, with an expiry header that is a valid HTTP-date or none;
/// each key runs the upstream once. A value past year 9999 made the expiry date panic, and
/// PostgreSQL's interval overflow failed every completion.
async fn any_max_age_is_recorded_and_replayed_with_a_valid_expiry(b: Backend) {
    let settings = GatewayConfig::new()
        .set("defaults.lock_ttl", "2s")
        .route("/v1/p", longest_lifetimes(b))
        .route("/v1/s", {
            let mut t = longest_lifetimes(b);
            t.insert("stream".into(), true.into());
            // The retry waits for the recording that follows the streamed answer.
            t.insert("on_in_flight".into(), "wait".into());
            t
        });
    let env = TestEnv::start(b, settings).await;
    let ages = max_ages();
    for (i, age) in ages.iter().enumerate() {
        for route in ["/v1/p", "/v1/s"] {
            let path = format!("{route}?control=max-age%3D{age}");
            let key = format!("age-{i}-{}", &route[4..]);
            let first = send(env.post_keyed(&path, &key).body("x")).await;
            assert_eq!(first.status, 201, "{path}: {first:?}");
            assert!(!first.replayed());
            expires_within(&first, Duration::from_secs((*age).min(1 << 40)));
            let retry = send(env.post_keyed(&path, &key).body("x")).await;
            assert!(retry.replayed(), "{path}: {retry:?}");
            assert_eq!(retry.body, first.body, "{path}");
            expires_within(&retry, Duration::from_secs((*age).min(1 << 40)));
        }
    }
    assert_eq!(env.upstream.calls(), ages.len() * 2, "each key ran once");
}

/// A bare key with a comma is what two key header lines look like once combined: refused; a
/// quoted one is one key.
async fn a_bare_comma_is_two_keys_and_is_refused(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    let combined = send(env.post_keyed("/v1/p", "abc,def").body("x")).await;
    assert_eq!(combined.status, 400);
    assert_eq!(combined.problem_type(), "urn:idemgate:problem:invalid-key");
    let quoted = send(env.post_keyed("/v1/p", "\"a,b\"").body("x")).await;
    assert_eq!(quoted.status, 201);
    assert!(send(env.post_keyed("/v1/p", "\"a,b\"").body("x"))
        .await
        .replayed());
    assert_eq!(env.upstream.calls(), 1);
}

/// On a route that refuses expired keys, a recorded failure (a 400 kept for `failure_ttl`)
/// leaves no tombstone: once it expires, the fixed request runs with the same key, and so does
/// the same failing one, neither answered 409 or 410; a success still leaves one.
async fn a_failure_leaves_no_tombstone_so_the_fixed_request_runs_after_failure_ttl(b: Backend) {
    let refuse = toml! {
        ttl = "1s"
        failure_ttl = "1s"
        after_expiry = "refuse"
    };
    let env = TestEnv::start(b, GatewayConfig::new().route("/v1/p", refuse)).await;
    let bad = send(env.post_keyed("/v1/p?status=400", "k").body("bad")).await;
    assert_eq!(bad.status, 400);
    let good = send(env.post_keyed("/v1/p", "ok").body("fine")).await;
    assert_eq!(good.status, 201);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let fixed = send(env.post_keyed("/v1/p", "k").body("fixed")).await;
    assert_eq!(fixed.status, 201, "{fixed:?}");
    let again = send(env.post_keyed("/v1/p?status=400", "k2").body("bad")).await;
    assert_eq!(again.status, 400);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let same = send(env.post_keyed("/v1/p?status=400", "k2").body("bad")).await;
    assert_eq!(same.status, 400, "{same:?}");
    assert!(!same.replayed());
    let success = send(env.post_keyed("/v1/p", "ok").body("fine")).await;
    assert_eq!(
        success.status, 410,
        "a success leaves a tombstone: {success:?}"
    );
    assert_eq!(env.upstream.calls(), 5);
}

/// With `max_waiters = 1`, a duplicate that waits for a streamed answer attaches to it with the
/// permit it already holds: it gets the live answer, not a 409 at `wait_timeout`.
async fn a_duplicate_waiting_for_a_stream_attaches_with_one_waiter_permit(b: Backend) {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(300));
    let streamed = toml! {
        stream = true
        on_in_flight = "wait"
        max_waiters = 1
        wait_timeout = "5s"
    };
    let env = TestEnv::start_with(
        b,
        upstream,
        GatewayConfig::new().route("/v1/events", streamed),
    )
    .await;
    let path = "/v1/events?events=4&gap_ms=400";
    let first = tokio::spawn(send(env.post_keyed(path, "s").body("x")));
    env.upstream.wait_for_calls(1).await;
    let duplicate = send(env.post_keyed(path, "s").body("x")).await;
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(duplicate.status, 201, "{duplicate:?}");
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, first.body);
    assert_eq!(env.upstream.calls(), 1);
}

/// A repeatable request first sent longer ago than the shortest life the route gives a record
/// (`failure_ttl` here) is refused, since its record may be gone: never run again.
async fn a_repeat_older_than_the_shortest_record_life_is_refused(b: Backend) {
    let repeatable = toml! {
        repeatability = true
        ttl = "1h"
        failure_ttl = "2s"
    };
    let env = TestEnv::start(b, GatewayConfig::new().route("/v1/p", repeatable)).await;
    let sent = |ago: u64, id: &str| {
        let at = SystemTime::now() - Duration::from_secs(ago);
        env.post("/v1/p?status=400")
            .header("repeatability-request-id", id)
            .header("repeatability-first-sent", httpdate::fmt_http_date(at))
            .body("x")
    };
    let recent = send(sent(0, "r1")).await;
    assert_eq!(recent.status, 400);
    assert_eq!(recent.header("repeatability-result"), Some("accepted"));
    let old = send(sent(60, "r2")).await;
    assert_eq!(old.status, 412, "{old:?}");
    assert_eq!(old.header("repeatability-result"), Some("rejected"));
    assert_eq!(env.upstream.calls(), 1);
}

/// A record evicted for room before its ttl takes its tombstone along: a retry of its key runs
/// again (201), never `410 key-expired` for a record that "expired" in the future.
async fn eviction_for_room_never_answers_410(b: Backend) {
    let refuse = toml! {
        ttl = "1h"
        after_expiry = "refuse"
    };
    let settings = GatewayConfig::new()
        .set("store.max_entries", 6)
        .route("/v1/p", refuse);
    let env = TestEnv::start(b, settings).await;
    for i in 0..8 {
        let seen = send(env.post_keyed("/v1/p", &format!("k{i}")).body("x")).await;
        assert_eq!(seen.status, 201);
    }
    let retry = send(env.post_keyed("/v1/p", "k0").body("x")).await;
    assert_eq!(retry.status, 201, "evicted, so run again: {retry:?}");
    assert!(!retry.replayed());
    assert_eq!(env.upstream.calls(), 9);
}

mod bounded {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_memory_eviction_for_room_never_answers_410() {
        super::eviction_for_room_never_answers_410(super::Backend::Memory).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_embedded_eviction_for_room_never_answers_410() {
        super::eviction_for_room_never_answers_410(super::Backend::Embedded).await
    }
}

/// Repeatable Requests with `on_store_error = "pass"` and the store down: a request forwarded
/// without idempotency may have run, so it says `accepted` (a `rejected` one is resubmitted
/// under a new id, and would run twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeatable_request_forwarded_without_the_store_is_accepted() {
    let repeatable = toml! {
        repeatability = true
        on_store_error = "pass"
    };
    let settings = GatewayConfig::new()
        .set("store.timeout", "300ms")
        .route("/v1/p", repeatable);
    let env = TestEnv::start(Backend::Redis, settings).await;
    env.redis().kill();
    let seen = send(
        env.post("/v1/p")
            .header("repeatability-request-id", "r1")
            .header(
                "repeatability-first-sent",
                httpdate::fmt_http_date(SystemTime::now()),
            )
            .body("x"),
    )
    .await;
    assert_eq!(seen.status, 201);
    assert_eq!(seen.header("repeatability-result"), Some("accepted"));
    assert_eq!(env.upstream.calls(), 1);
}

/// A gateway config with an admin listener, to read the key view.
fn with_admin(config: GatewayConfig) -> GatewayConfig {
    config
        .set("admin.listen", "127.0.0.1:0")
        .set("admin.admin_token", TOKEN)
}

/// The state the admin key view shows for `key` ("in_flight", "completed", ...; "" when the
/// store does not answer or holds nothing).
async fn state_of(env: &TestEnv, key: &str) -> String {
    let admin = env.gateway.admin.expect("admin listener");
    let answer = env
        .client
        .get(format!("http://{admin}/keys/{key}"))
        .bearer_auth(TOKEN)
        .send()
        .await;
    let Ok(answer) = answer else {
        return String::new();
    };
    let json: serde_json::Value = answer.json().await.unwrap_or_default();
    json["state"].as_str().unwrap_or("").to_string()
}

/// A store stall longer than the rest of the lease (here: the whole lease) while the upstream
/// runs: the client gets its answer, the completion is sent again until the store answers, and
/// since no newer claim took the key meanwhile it is recorded, so the retry replays: one
/// execution, none counted as unrecorded. The lease ran from the last renewal, so the claim had
/// lapsed in the store when it came back.
async fn a_store_stall_longer_than_the_lease_still_records_the_answer(b: Backend) {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(1000));
    let settings = with_admin(GatewayConfig::new())
        .set("store.timeout", "300ms")
        .set("defaults.lock_ttl", "2s");
    let env = TestEnv::start_with(b, upstream, settings).await;
    let server = env.store_server();
    let first = tokio::spawn(send(env.post_keyed("/v1/p", "stall").body("x")));
    env.upstream.wait_for_calls(1).await;
    match b {
        Backend::Redis => server.redis().pause(),
        _ => server.postgres().pause(),
    }
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "the answer is delivered: {first:?}");
    // Past the whole lease, then the store is back.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    match b {
        Backend::Redis => server.redis().resume(),
        _ => server.postgres().resume(),
    }
    wait_until(
        Duration::from_secs(10),
        "the late answer recorded",
        async || state_of(&env, "stall").await == "completed",
    )
    .await;
    let retry = send(env.post_keyed("/v1/p", "stall").body("x")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(env.upstream.calls(), 1);
    let unrecorded = "idemgate_calls_unsettled_total{route=\"defaults\",reason=\"unrecorded\"}";
    assert_eq!(env.gateway.metric(unrecorded).await, 0.0);
}

mod stalls {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_redis_a_store_stall_longer_than_the_lease_still_records_the_answer() {
        super::a_store_stall_longer_than_the_lease_still_records_the_answer(super::Backend::Redis)
            .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_postgres_a_store_stall_longer_than_the_lease_still_records_the_answer() {
        super::a_store_stall_longer_than_the_lease_still_records_the_answer(
            super::Backend::Postgres,
        )
        .await
    }
}

/// A newer claim took the key while the first call ran (its claim lost, as a failover that
/// lost it would): the first answer is delivered but cannot be recorded, and is counted as
/// unrecorded, logged with its key's hash; the newer claim's answer is the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_a_newer_claim_displaced_is_counted_as_unrecorded() {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(800));
    let env = TestEnv::start_with(Backend::Redis, upstream, with_admin(GatewayConfig::new())).await;
    let first = tokio::spawn(send(env.post_keyed("/v1/p", "lost").body("x")));
    env.upstream.wait_for_calls(1).await;
    // The claim is lost, and a retry claims the key anew.
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut env.redis().connection().await)
        .await
        .unwrap();
    let second = tokio::spawn(send(env.post_keyed("/v1/p", "lost").body("x")));
    let first = first.await.unwrap();
    let second = second.await.unwrap();
    assert_eq!((first.status, second.status), (201, 201));
    assert_eq!(env.upstream.calls(), 2);
    let unrecorded = "idemgate_calls_unsettled_total{route=\"defaults\",reason=\"unrecorded\"}";
    assert_eq!(env.gateway.metric(unrecorded).await, 1.0);
    let replay = send(env.post_keyed("/v1/p", "lost").body("x")).await;
    assert!(replay.replayed());
    assert_eq!(
        replay.body, second.body,
        "the newer claim's answer is the record"
    );
}
