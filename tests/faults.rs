//! Exactly once through faults: client aborts, gateway crashes, store outages, waiting
//! duplicates, graceful shutdown, Redis restarts. Every fault is injected for real.

use crate::common;

use std::time::{Duration, Instant};

use common::raw::RawUpstream;
use common::{
    binary, send, wait_until, Backend, CountingUpstream, GatewayConfig, InProcessGateway,
    RedisServer, Seen, TestEnv,
};
use tokio::io::AsyncWriteExt;

const IN_FLIGHT: &str = "urn:idemgate:problem:in-flight";

on_both_backends!(
    a_waiter_runs_the_request_when_the_first_one_released_the_key,
    client_abort_still_records_the_response,
    hang_up_before_the_body_is_complete_claims_nothing,
    hang_up_right_after_sending_leaves_no_stuck_key,
    waiting_duplicates_get_the_replay,
    waiters_are_bounded_in_number_and_time,
);

/// Send a keyed POST on a raw socket and hang up without reading the answer.
async fn post_and_hang_up(addr: std::net::SocketAddr, path: &str, key: &str, body: &str) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    s.flush().await.unwrap();
    // The client stays 100 ms, long enough for the gateway to read the request, then leaves.
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(s);
}

async fn client_abort_still_records_the_response(b: Backend) {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(600));
    let config = GatewayConfig::new().set("admin.listen", "127.0.0.1:0");
    let env = TestEnv::start_with(b, upstream, config).await;
    post_and_hang_up(env.gateway.addr, "/v1/p", "abort", "x").await;
    // The hang-up is counted with the outcome the request had come to.
    let gone =
        |outcome: &str| format!("idemgate_client_disconnects_total{{outcome=\"{outcome}\"}} 1");
    wait_until(
        Duration::from_secs(5),
        "the hang-up is counted",
        async || env.gateway.metrics().await.contains(&gone("miss")),
    )
    .await;
    // The upstream call goes on without the client: retries are in flight until it is answered.
    let retry = env
        .retry_while_in_flight(
            ("/v1/p", "abort", "x"),
            Duration::from_millis(900),
            "the upstream's answer is recorded",
        )
        .await;
    assert_eq!(retry.status, 201);
    assert!(
        retry.replayed(),
        "the retry must get the recorded response, not a second execution"
    );
    assert_eq!(env.upstream.calls(), 1);
    // A request without a key whose client leaves is counted as a pass-through.
    let mut s = tokio::net::TcpStream::connect(env.gateway.addr)
        .await
        .unwrap();
    s.write_all(b"POST /v1/p HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\nx")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(s);
    wait_until(
        Duration::from_secs(5),
        "the pass-through's hang-up is counted",
        async || env.gateway.metrics().await.contains(&gone("passthrough")),
    )
    .await;
}

async fn waiting_duplicates_get_the_replay(b: Backend) {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(500));
    let env = TestEnv::start_with(
        b,
        upstream,
        GatewayConfig::new()
            .set("defaults.on_in_flight", "wait")
            .set("defaults.wait_timeout", "5s"),
    )
    .await;
    let mut tasks = Vec::new();
    for _ in 0..10 {
        tasks.push(tokio::spawn(send(
            env.post_keyed("/v1/p", "wait").body("x"),
        )));
    }
    let mut bodies = Vec::new();
    let mut replays = 0;
    for t in tasks {
        let seen = t.await.unwrap();
        assert_eq!(seen.status, 201, "{seen:?}");
        replays += seen.replayed() as usize;
        bodies.push(seen.body);
    }
    assert_eq!(replays, 9);
    assert!(bodies.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(env.upstream.calls(), 1);
}

async fn waiters_are_bounded_in_number_and_time(b: Backend) {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(800));
    let extra = GatewayConfig::new()
        .set("defaults.on_in_flight", "wait")
        .set("defaults.wait_timeout", "5s")
        .set("defaults.max_waiters", 2);
    let env = TestEnv::start_with(b, upstream, extra).await;
    let first = tokio::spawn(send(env.post_keyed("/v1/p", "bounded").body("x")));
    env.upstream.wait_for_calls(1).await;
    let mut dups = Vec::new();
    for _ in 0..5 {
        dups.push(tokio::spawn(send(
            env.post_keyed("/v1/p", "bounded").body("x"),
        )));
    }
    let mut replays = 0;
    let mut conflicts = 0;
    for d in dups {
        let seen = d.await.unwrap();
        if seen.replayed() {
            replays += 1;
        } else {
            assert_eq!(seen.problem_type(), IN_FLIGHT);
            conflicts += 1;
        }
    }
    assert_eq!(
        (replays, conflicts),
        (2, 3),
        "two may wait, the rest get 409 at once"
    );
    assert_eq!(first.await.unwrap().status, 201);

    // Past wait_timeout, a waiter gets the 409.
    let env = TestEnv::start(
        b,
        GatewayConfig::new()
            .set("defaults.on_in_flight", "wait")
            .set("defaults.wait_timeout", "200ms"),
    )
    .await;
    let slow = tokio::spawn(send(
        env.post_keyed("/v1/p?delay_ms=3000", "timeout").body("x"),
    ));
    env.upstream.wait_for_calls(1).await;
    let started = Instant::now();
    let waited = send(env.post_keyed("/v1/p?delay_ms=3000", "timeout").body("x")).await;
    assert_eq!(waited.problem_type(), IN_FLIGHT);
    // Not before the 200 ms, and well before the holder's answer at 3 s.
    let waited_for = started.elapsed();
    assert!(waited_for >= Duration::from_millis(200), "{waited_for:?}");
    assert!(waited_for < Duration::from_millis(2000), "{waited_for:?}");
    assert_eq!(slow.await.unwrap().status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_gateway_leaves_the_key_in_flight_until_the_lease_ends() {
    let redis = RedisServer::start().await;
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(1500));
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis(&redis)
        .set("defaults.lock_ttl", "2s");
    let mut crashed = binary().start(&config).await;
    let client = common::client();
    let req = client
        .post(crashed.url("/v1/p"))
        .header("idempotency-key", "crash")
        .body("x");
    let pending = tokio::spawn(req.send());
    upstream.wait_for_calls(1).await;
    crashed.kill9();
    assert!(
        pending.await.unwrap().is_err(),
        "the client saw the connection die"
    );
    let killed_at = Instant::now();

    let survivor = binary().start(&config).await;
    let retry = send(
        client
            .post(survivor.url("/v1/p"))
            .header("idempotency-key", "crash")
            .body("x"),
    )
    .await;
    assert_eq!(
        retry.problem_type(),
        IN_FLIGHT,
        "the upstream may have executed: the key stays claimed"
    );
    // Once the lease has run out (at most lock_ttl after the last renewal), a retry runs again.
    let mut reran = None;
    wait_until(
        Duration::from_secs(6).saturating_sub(killed_at.elapsed()),
        "the key is free once its lease ends",
        async || {
            let sent = killed_at.elapsed();
            let r = send(
                client
                    .post(survivor.url("/v1/p"))
                    .header("idempotency-key", "crash")
                    .body("x"),
            )
            .await;
            if r.status == 201 {
                reran = Some(sent);
                return true;
            }
            assert_eq!(r.problem_type(), IN_FLIGHT);
            false
        },
    )
    .await;
    let reran = reran.unwrap();
    eprintln!("the key was freed {reran:?} after the kill");
    assert!(
        reran <= Duration::from_millis(2600),
        "freed after {reran:?}, lock_ttl is 2s"
    );
    assert_eq!(
        upstream.calls(),
        2,
        "the crashed call and the one retry after the lease"
    );
}

/// The store server goes down under a gateway (Redis killed, PostgreSQL stopped): keyed requests
/// get 503 store-unavailable and reach nothing, unkeyed ones flow, and once the server is back
/// the gateway serves keys again by itself (and PostgreSQL replays what it recorded before).
async fn store_outage_rejects_keyed_requests_and_recovers_by_itself(b: Backend) {
    // A short store timeout so that an outage is detected quickly.
    let env = TestEnv::start(b, GatewayConfig::new().set("store.timeout", "500ms")).await;
    assert_eq!(
        send(env.post_keyed("/v1/p", "before").body("x"))
            .await
            .status,
        201
    );

    env.store_server().take_down();
    let calls = env.upstream.calls();
    let refused = send(env.post_keyed("/v1/p", "during").body("x")).await;
    assert_eq!(refused.status, 503);
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:store-unavailable"
    );
    assert!(refused.header("retry-after").is_some());
    assert_eq!(
        env.upstream.calls(),
        calls,
        "nothing is forwarded under on_store_error = reject"
    );
    // Unkeyed requests keep flowing.
    assert_eq!(send(env.post("/v1/p").body("x")).await.status, 201);

    env.store_server().bring_back().await;
    let recovered = wait_until(
        Duration::from_secs(5),
        "keyed requests succeed after the store is back",
        async || {
            let r = send(env.post_keyed("/v1/p", "after").body("x")).await;
            if r.status != 201 {
                assert_eq!(r.status, 503);
            }
            r.status == 201
        },
    )
    .await;
    eprintln!("{b:?}: recovered {recovered:?} after the store came back");
    assert!(send(env.post_keyed("/v1/p", "after").body("x"))
        .await
        .replayed());
    // PostgreSQL kept what it committed; the test's redis-server keeps nothing on disk.
    if matches!(b, Backend::Postgres) {
        assert!(send(env.post_keyed("/v1/p", "before").body("x"))
            .await
            .replayed());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_rejects_keyed_requests_and_recovers_by_itself() {
    store_outage_rejects_keyed_requests_and_recovers_by_itself(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_rejects_keyed_requests_and_recovers_by_itself() {
    store_outage_rejects_keyed_requests_and_recovers_by_itself(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_outage_with_pass_policy_forwards_without_idempotency() {
    let env = TestEnv::start(
        Backend::Redis,
        GatewayConfig::new().set("defaults.on_store_error", "pass"),
    )
    .await;
    env.redis().kill();
    let a = send(env.post_keyed("/v1/p", "open").body("x")).await;
    let b = send(env.post_keyed("/v1/p", "open").body("x")).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(!b.replayed());
    assert_eq!(
        env.upstream.calls(),
        2,
        "fail open: every request is forwarded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_failure_after_the_upstream_answered_still_delivers_the_response() {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(800));
    let env = TestEnv::start_with(Backend::Redis, upstream, GatewayConfig::new()).await;
    let pending = tokio::spawn(send(env.post_keyed("/v1/p", "late").body("x")));
    // Redis dies while the upstream runs: the claim is in, the completion will fail.
    env.upstream.wait_for_calls(1).await;
    env.redis().kill();
    let seen = pending.await.unwrap();
    assert_eq!(
        seen.status, 201,
        "the upstream's answer must reach the client"
    );
    assert_eq!(env.upstream.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_requests_and_exits_zero() {
    let redis = RedisServer::start().await;
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(1000));
    let config = GatewayConfig::new().upstream(&upstream.url()).redis(&redis);
    let mut gateway = binary().start(&config).await;
    let client = common::client();
    let pending = tokio::spawn(send(
        client
            .post(gateway.url("/v1/p"))
            .header("idempotency-key", "term")
            .body("x"),
    ));
    upstream.wait_for_calls(1).await;
    gateway.sigterm();
    wait_until(
        Duration::from_millis(100),
        "the gateway refuses new connections after SIGTERM",
        async || {
            tokio::net::TcpStream::connect(gateway.addr())
                .await
                .is_err()
        },
    )
    .await;
    let seen = pending.await.unwrap();
    assert_eq!(seen.status, 201);
    assert!(gateway.wait_exit(Duration::from_secs(5)).await.success());
    // What it answered was recorded: another gateway replays it.
    let next = binary().start(&config).await;
    let replay = send(
        client
            .post(next.url("/v1/p"))
            .header("idempotency-key", "term")
            .body("x"),
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(replay.body, seen.body);
    assert_eq!(upstream.calls(), 1);
}

/// The signal handlers are in place from the moment the port accepts connections: a SIGTERM
/// while the gateway is still starting (here: waiting on a stalled Redis) drains and exits 0,
/// rather than killing the process by the signal's default action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_starting_still_exits_cleanly() {
    let redis = RedisServer::start().await;
    let upstream = CountingUpstream::start().await;
    redis.pause();
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis(&redis)
        .set("store.timeout", "1s");
    let mut gateway = binary().start(&config).await;
    gateway.sigterm();
    let status = gateway.wait_exit(Duration::from_secs(5)).await;
    redis.resume();
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_grace_bounds_the_wait() {
    // The upstream would answer after a minute; the gateway must be gone long before.
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_secs(60));
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .set("shutdown_grace", "1s");
    let mut gateway = binary().start(&config).await;
    let client = common::client();
    let _pending = tokio::spawn(
        client
            .post(gateway.url("/v1/p"))
            .header("idempotency-key", "g")
            .body("x")
            .send(),
    );
    upstream.wait_for_calls(1).await;
    let started = Instant::now();
    gateway.sigterm();
    let status = gateway.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "{status:?}");
    // The grace is 1 s; the rest is slack for a loaded machine.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_survive_a_redis_restart_with_aof() {
    let redis = RedisServer::start_durable().await;
    let upstream = CountingUpstream::start().await;
    let config = GatewayConfig::new().upstream(&upstream.url()).redis(&redis);
    let gateway = InProcessGateway::start(&config).await;
    let client = common::client();
    let url = gateway.url("/v1/p");
    let first = send(client.post(&url).header("idempotency-key", "aof").body("x")).await;
    redis.restart().await;
    let mut replay = None;
    wait_until(
        Duration::from_secs(5),
        "the gateway reaches the restarted Redis",
        async || {
            let r = send(client.post(&url).header("idempotency-key", "aof").body("x")).await;
            let reached = r.status != 503;
            replay = Some(r);
            reached
        },
    )
    .await;
    let replay = replay.unwrap();
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicting_or_volatile_redis_is_warned_about() {
    let redis = RedisServer::start().await;
    let options = idemgate::store::RedisSettings::new(redis.url()).prefix("w:");
    let store = idemgate::store::RedisStore::connect(&options)
        .await
        .unwrap();
    let warnings = store.durability_warnings().await.unwrap();
    assert_eq!(warnings.len(), 1, "no persistence: {warnings:?}");
    assert!(warnings[0].contains("persistence"));
    let mut conn = redis.connection().await;
    for (k, v) in [
        ("maxmemory", "100mb"),
        ("maxmemory-policy", "allkeys-lru"),
        ("appendonly", "yes"),
    ] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(k)
            .arg(v)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let warnings = store.durability_warnings().await.unwrap();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("noeviction"));
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(store.durability_warnings().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_redis_leaves_no_claim_behind() {
    let env = TestEnv::start(
        Backend::Redis,
        GatewayConfig::new().set("store.timeout", "1s"),
    )
    .await;
    // Serving first: a worker that starts while Redis is paused waits out its own connection's
    // timeouts before it accepts, which is start-up, not what this test is about.
    assert_eq!(send(env.post("/v1/p").body("x")).await.status, 201);
    let redis = env.redis();
    redis.pause();
    for key in ["stall-a", "stall-b", "stall"] {
        let started = Instant::now();
        let stalled = send(env.post_keyed("/v1/p", key).body("x")).await;
        assert_eq!(stalled.status, 503);
        // Within the store's timeout, not twice it (a timeout is not sent again).
        let took = started.elapsed();
        assert!(took < Duration::from_millis(1800), "{key}: {took:?}");
    }
    // Redis wakes up. A claim whose answer the gateway gave up on must not be left applied
    // (the gateway also takes such a claim back in the background, fenced by its token).
    // Redis may run such a late claim after the release sent on a replaced connection, so the
    // gateway keeps trying for a few seconds.
    redis.resume();
    let mut c = redis.connection().await;
    let taken_back = wait_until(
        Duration::from_secs(8),
        "no claim outlives the 503 it answered (the keys test:* are gone)",
        async || {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg("test:*")
                .query_async(&mut c)
                .await
                .unwrap();
            keys.is_empty()
        },
    )
    .await;
    eprintln!("claims taken back {taken_back:?} after Redis resumed");
    // So the retry runs now instead of after a 30 s lease.
    let retry = send(env.post_keyed("/v1/p", "stall").body("x")).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    // The unkeyed request before the pause, and the retry.
    assert_eq!(env.upstream.calls(), 2);
}

async fn a_waiter_runs_the_request_when_the_first_one_released_the_key(b: Backend) {
    let env = TestEnv::start(
        b,
        GatewayConfig::new()
            .set("defaults.on_in_flight", "wait")
            .set("defaults.wait_timeout", "5s"),
    )
    .await;
    // The first execution answers 503 after 400 ms: not stored, the key is released...
    let first = tokio::spawn(send(
        env.post_keyed("/v1/p?status=503&delay_ms=400", "takeover")
            .body("x"),
    ));
    env.upstream.wait_for_calls(1).await;
    // ...so the duplicate waiting on it claims the key and runs the request itself.
    let waiter = send(
        env.post_keyed("/v1/p?status=503&delay_ms=400", "takeover")
            .body("x"),
    )
    .await;
    assert_eq!(first.await.unwrap().status, 503);
    assert_eq!(waiter.status, 503);
    assert!(!waiter.replayed());
    assert_eq!(
        env.upstream.calls(),
        2,
        "one execution each, one after the other"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_starts_while_redis_is_down_and_catches_up() {
    // Nothing listens on `port`: the gateway starts all the same. (redis-server binds the port
    // itself later on, so it cannot be reserved here: were it taken meanwhile, the test fails.)
    let port = common::free_port();
    let upstream = CountingUpstream::start().await;
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis_url(&format!("redis://127.0.0.1:{port}/0"))
        .set("store.timeout", "300ms");
    let gateway = InProcessGateway::start(&config).await;
    let client = common::client();
    let url = gateway.url("/v1/p");
    assert_eq!(
        send(client.post(&url).body("x")).await.status,
        201,
        "unkeyed traffic flows"
    );
    let refused = send(
        client
            .post(&url)
            .header("idempotency-key", "early")
            .body("x"),
    )
    .await;
    assert_eq!(refused.status, 503);
    assert_eq!(upstream.calls(), 1, "nothing keyed was forwarded");
    // Redis comes up: keyed requests work without a gateway restart.
    let _redis = RedisServer::start_on_port(port).await;
    wait_until(
        Duration::from_secs(5),
        "keyed requests succeed once Redis is up",
        async || {
            let r = send(
                client
                    .post(&url)
                    .header("idempotency-key", "early")
                    .body("x"),
            )
            .await;
            if r.status != 201 {
                assert_eq!(r.status, 503);
            }
            r.status == 201
        },
    )
    .await;
    assert!(send(
        client
            .post(&url)
            .header("idempotency-key", "early")
            .body("x")
    )
    .await
    .replayed());
}

// === early hang-ups ===

/// Write `bytes` on a raw socket and close it at once, reading nothing: a client that lost the
/// network right after sending.
async fn write_and_close(addr: std::net::SocketAddr, bytes: &[u8]) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    s.flush().await.unwrap();
    drop(s);
}

/// A whole keyed POST with `Connection: close`.
fn keyed_post(key: &str, body: &str) -> String {
    format!(
        "POST /v1/p HTTP/1.1\r\nhost: x\r\nconnection: close\r\nidempotency-key: {key}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Retry `key` until it is answered by something other than 409 in flight. A 409 is accepted
/// only while the upstream may still be running the first call (`upstream_takes`, plus a margin):
/// never for the rest of a lease. Returns the answer.
async fn retry_until_answered(env: &TestEnv, key: &str, upstream_takes: Duration) -> Seen {
    env.retry_while_in_flight(
        ("/v1/p", key, "x"),
        upstream_takes + Duration::from_millis(700),
        "the key is no longer in flight after the hang-up",
    )
    .await
}

async fn hang_up_right_after_sending_leaves_no_stuck_key(b: Backend) {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_secs(1));
    let env = TestEnv::start_with(
        b,
        upstream,
        GatewayConfig::new().set("defaults.lock_ttl", "8s"),
    )
    .await;
    write_and_close(env.gateway.addr, keyed_post("gone", "x").as_bytes()).await;
    // Time for the gateway to read the request; whether it forwards it is up to the gateway, so
    // there is nothing to wait for.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let answer = retry_until_answered(&env, "gone", Duration::from_secs(1)).await;
    assert_eq!(answer.status, 201, "{answer:?}");
    // Either the first call was run and recorded (a replay), or it was never run (a fresh run).
    assert_eq!(env.upstream.calls(), 1, "the upstream runs once in total");
    assert!(send(env.post_keyed("/v1/p", "gone").body("x"))
        .await
        .replayed());
    assert_eq!(env.upstream.calls(), 1);
}

async fn hang_up_before_the_body_is_complete_claims_nothing(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    let head = "POST /v1/p HTTP/1.1\r\nhost: x\r\nidempotency-key: partial\r\ncontent-length: 10\r\n\r\nabc";
    write_and_close(env.gateway.addr, head.as_bytes()).await;
    // Time in which the gateway would have forwarded it, were it going to.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        env.upstream.calls(),
        0,
        "an incomplete request is never forwarded"
    );
    let retry = send(env.post_keyed("/v1/p", "partial").body("x")).await;
    assert_eq!(retry.status, 201, "nothing was claimed: {retry:?}");
    assert!(!retry.replayed());
    assert_eq!(env.upstream.calls(), 1);
}

/// The client hangs up while the claim is on its way to Redis (Redis stalled by SIGSTOP): the
/// claim is applied after the request is gone, and must not keep the key for a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_up_while_the_claim_is_pending_leaves_no_stuck_key() {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(500));
    let env = TestEnv::start_with(
        Backend::Redis,
        upstream,
        GatewayConfig::new().set("defaults.lock_ttl", "8s"),
    )
    .await;
    let redis = env.redis();
    redis.pause();
    write_and_close(env.gateway.addr, keyed_post("pending", "x").as_bytes()).await;
    // Time for the gateway to send the claim to the stalled Redis and see the client leave;
    // neither shows anywhere while Redis is stopped.
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.resume();
    let answer = retry_until_answered(&env, "pending", Duration::from_millis(500)).await;
    assert_eq!(answer.status, 201, "{answer:?}");
    assert_eq!(env.upstream.calls(), 1, "the upstream runs once in total");
    assert!(send(env.post_keyed("/v1/p", "pending").body("x"))
        .await
        .replayed());
}

/// `wait_replicas = 1` on a Redis without a replica: every claim goes unacknowledged, so keyed
/// requests are refused as a store outage (nothing forwarded, nothing left claimed) and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_no_replica_acknowledges_are_refused_and_counted() {
    let env = TestEnv::start(
        Backend::Redis,
        GatewayConfig::new()
            .set("store.wait_replicas", 1)
            .set("store.timeout", "200ms")
            .set("admin.listen", "127.0.0.1:0"),
    )
    .await;
    let refused = send(env.post_keyed("/v1/p", "k").body("x")).await;
    assert_eq!(refused.status, 503);
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:store-unavailable"
    );
    assert_eq!(env.upstream.calls(), 0, "nothing is forwarded");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut env.redis().connection().await)
        .await
        .unwrap();
    assert!(keys.is_empty(), "the claim was taken back: {keys:?}");
    let metrics = env.gateway.metrics().await;
    assert!(
        metrics.contains("idemgate_store_unacknowledged_writes_total{operation=\"claim\"} 1"),
        "{metrics}"
    );
    // Unkeyed requests never touch the store.
    assert_eq!(send(env.post("/v1/p").body("x")).await.status, 201);
}

/// Redis goes down while the upstream runs, so the completion fails; the response reaches the
/// client, and the completion is sent again in the background until Redis is back (AOF: the
/// claim survived the restart). The retry then gets the replay: the upstream ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_completion_is_sent_again_until_redis_is_back() {
    let redis = RedisServer::start_durable().await;
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(500));
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis(&redis)
        .set("store.timeout", "300ms");
    let gateway = InProcessGateway::start(&config).await;
    let client = common::client();
    let url = gateway.url("/v1/p");
    let pending = tokio::spawn(send(
        client
            .post(&url)
            .header("idempotency-key", "later")
            .body("x"),
    ));
    upstream.wait_for_calls(1).await;
    redis.kill();
    let first = pending.await.unwrap();
    assert_eq!(
        first.status, 201,
        "the upstream's answer reaches the client"
    );
    redis.restart().await;
    wait_until(
        Duration::from_secs(10),
        "the retry gets the replay",
        async || {
            let r = send(
                client
                    .post(&url)
                    .header("idempotency-key", "later")
                    .body("x"),
            )
            .await;
            assert!(
                [201, 409, 503].contains(&r.status),
                "a retry meanwhile is refused or waits: {r:?}"
            );
            r.replayed()
        },
    )
    .await;
    assert_eq!(upstream.calls(), 1, "the upstream ran once");
}

/// A call whose outcome the gateway cannot know (the upstream may have done the work) keeps its
/// key claimed, and is counted by why in `idemgate_calls_unsettled_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_of_unknown_outcome_keep_their_key_and_are_counted_by_reason() {
    let cases: [(&str, &[u8], bool, u16, &str); 4] = [
        // Never answers.
        ("silent", b"", false, 504, "timeout"),
        // Closes the connection without an answer.
        ("closed", b"", true, 502, "failed"),
        (
            "cut-short",
            b"HTTP/1.1 201 Created\r\ncontent-length: 10\r\n\r\nabc",
            true,
            502,
            "failed",
        ),
        (
            "not-final",
            b"HTTP/1.1 600 Beyond\r\ncontent-length: 0\r\n\r\n",
            false,
            502,
            "failed",
        ),
    ];
    for (case, answer, close, status, reason) in cases {
        let upstream = match close {
            true => RawUpstream::answering_then_closing(answer).await,
            false => RawUpstream::answering(answer).await,
        };
        let config = GatewayConfig::new()
            .upstream(&upstream.url())
            .set("admin.listen", "127.0.0.1:0")
            .set("defaults.upstream_timeout", "300ms");
        let gateway = InProcessGateway::start(&config).await;
        let post = || {
            common::client()
                .post(gateway.url("/v1/p"))
                .header("idempotency-key", case)
                .body("x")
        };
        let first = send(post()).await;
        assert_eq!(first.status, status, "{case}: {first:?}");
        let retry = send(post()).await;
        assert_eq!(retry.problem_type(), IN_FLIGHT, "{case}: {retry:?}");
        assert_eq!(upstream.requests().len(), 1, "{case}");
        for counted in ["timeout", "failed"] {
            let series = format!(
                "idemgate_calls_unsettled_total{{route=\"defaults\",reason=\"{counted}\"}}"
            );
            let expected = if counted == reason { 1.0 } else { 0.0 };
            assert_eq!(gateway.metric(&series).await, expected, "{case}: {series}");
        }
    }
}
