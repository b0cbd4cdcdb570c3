//! Records sealed at rest (`[store] seal`, keys in `IDEMGATE_SEAL_KEYS`), against the real
//! stores: what lands in Redis, PostgreSQL and the embedded file holds no response in clear, and
//! a record changed or moved in the store is refused (500 record-unreadable), never replayed and
//! never run again.

use crate::common;

use common::{send, Backend, GatewayConfig, InProcessGateway, TestEnv};

/// Two keys of 32 bytes in base64, as `openssl rand -base64 32` makes them.
const K1: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
const K2: &str = "k2:HxwdHhobGBkWFxQVEhMQEQ4PDA0KCwgJBgcEBQIDAAE=";

/// What a payment API answers and must not leak: it comes back in the response body.
const MARKER: &str = "pan=4242424242424242;holder=MARKER-Ada-Lovelace";

/// The settings of a sealing gateway whose retries read the store (no local cache).
fn sealed(mode: &str, keys: &str) -> GatewayConfig {
    GatewayConfig::new()
        .set("admin.listen", "127.0.0.1:0")
        .seal(mode, keys)
}

/// The same with the local cache off, on the shared stores (so that a retry reads the store).
fn sealed_uncached(backend: Backend, mode: &str, keys: &str) -> GatewayConfig {
    let config = sealed(mode, keys);
    match backend {
        Backend::Redis | Backend::Postgres => config.set("store.local_cache", "0"),
        _ => config,
    }
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// Every record in the test Redis: its name and raw bytes.
async fn redis_records(env: &TestEnv) -> Vec<(String, Vec<u8>)> {
    let port = env.redis().port;
    let names: Vec<String> = testkit::cluster::query(port, redis::cmd("KEYS").arg("test:*"))
        .await
        .unwrap();
    let names = names.into_iter().filter(|n| !n.contains(":staged:"));
    let mut records = Vec::new();
    for name in names {
        let raw: Vec<u8> = testkit::cluster::query(port, redis::cmd("GET").arg(&name))
            .await
            .unwrap();
        records.push((name, raw));
    }
    records
}

async fn pay(env: &TestEnv, gateway: &InProcessGateway, key: &str) -> common::Seen {
    send(
        env.client
            .post(gateway.url("/echo"))
            .header("idempotency-key", key)
            .body(MARKER),
    )
    .await
}

async fn unreadable_count(gateway: &InProcessGateway, reason: &str) -> u64 {
    let series = format!("idemgate_records_unreadable_total{{reason=\"{reason}\"}}");
    gateway.metric(&series).await as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_in_a_response_never_reaches_redis_in_clear() {
    let env = TestEnv::start(Backend::Redis, sealed("on", K1)).await;
    let first = pay(&env, &env.gateway, "k").await;
    assert_eq!(first.status, 201);
    assert!(contains(&first.body, MARKER));
    let replay = pay(&env, &env.gateway, "k").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let records = redis_records(&env).await;
    assert_eq!(records.len(), 1, "one record");
    for (name, raw) in &records {
        assert!(!contains(raw, MARKER), "{name} holds the response in clear");
        assert!(!contains(raw, "Ada"), "{name}");
    }
    // Nor Redis's snapshot of its memory (what a backup or a replica receives).
    let dump = tempfile::NamedTempFile::new().unwrap();
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &env.redis().port.to_string(), "--rdb"])
        .arg(dump.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let rdb = std::fs::read(dump.path()).unwrap();
    assert!(rdb.len() > 50, "a dump of {} bytes", rdb.len());
    assert!(!contains(&rdb, MARKER));

    // The control: the same exchange unsealed puts the marker in Redis.
    let clear = InProcessGateway::start(&env.config().set("store.seal", "off")).await;
    assert_eq!(pay(&env, &clear, "k-clear").await.status, 201);
    let records = redis_records(&env).await;
    assert!(records.iter().any(|(_, raw)| contains(raw, MARKER)));
    assert_eq!(env.upstream.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_changed_or_copied_in_redis_is_refused_and_never_runs_again() {
    let env = TestEnv::start(Backend::Redis, sealed_uncached(Backend::Redis, "on", K1)).await;
    assert_eq!(pay(&env, &env.gateway, "a").await.status, 201);
    let [(a_name, a_raw)] = <[_; 1]>::try_from(redis_records(&env).await).unwrap();

    // One byte of the sealed body flipped.
    let port = env.redis().port;
    let mut flipped = a_raw.clone();
    let at = flipped.len() - 30;
    flipped[at] ^= 0x01;
    let set = redis::cmd("SET").arg(&a_name).arg(&flipped).clone();
    let _: () = testkit::cluster::query(port, &set).await.unwrap();
    let refused = pay(&env, &env.gateway, "a").await;
    assert_eq!(refused.status, 500);
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:record-unreadable"
    );
    assert!(!contains(&refused.body, MARKER));
    assert_eq!(env.upstream.calls(), 1, "never run again");
    assert_eq!(unreadable_count(&env.gateway, "tampered").await, 1);

    // The intact record of "a" copied over "b"'s name: the same request under "b" must not
    // get "a"'s response (the fingerprint matches; the key does not).
    let set = redis::cmd("SET").arg(&a_name).arg(&a_raw).clone();
    let _: () = testkit::cluster::query(port, &set).await.unwrap();
    assert!(pay(&env, &env.gateway, "a").await.replayed(), "restored");
    assert_eq!(pay(&env, &env.gateway, "b").await.status, 201);
    let b_name = redis_records(&env)
        .await
        .into_iter()
        .map(|(name, _)| name)
        .find(|name| *name != a_name)
        .unwrap();
    let copy = redis::cmd("COPY")
        .arg(&a_name)
        .arg(&b_name)
        .arg("REPLACE")
        .clone();
    let copied: i64 = testkit::cluster::query(port, &copy).await.unwrap();
    assert_eq!(copied, 1);
    let refused = pay(&env, &env.gateway, "b").await;
    assert_eq!(refused.status, 500, "{:?}", refused.header("x-call"));
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:record-unreadable"
    );
    assert_eq!(env.upstream.calls(), 2);
    assert_eq!(unreadable_count(&env.gateway, "tampered").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_opens_records_of_every_listed_key() {
    let env = TestEnv::start(Backend::Redis, sealed_uncached(Backend::Redis, "on", K1)).await;
    assert_eq!(pay(&env, &env.gateway, "old").await.status, 201);

    // k2 now seals; k1 still opens.
    let rotated = env.config().seal("on", &format!("{K2},{K1}"));
    let rotated = InProcessGateway::start(&rotated).await;
    assert!(pay(&env, &rotated, "old").await.replayed());
    assert_eq!(pay(&env, &rotated, "new").await.status, 201);
    let ids: Vec<Vec<u8>> = redis_records(&env)
        .await
        .into_iter()
        .map(|(_, raw)| raw[59..61].to_vec())
        .collect();
    assert!(
        ids.contains(&b"k1".to_vec()) && ids.contains(&b"k2".to_vec()),
        "{ids:?}"
    );

    // k1 dropped: its records no longer open; k2's do.
    let dropped = InProcessGateway::start(&env.config().seal("on", K2)).await;
    assert!(pay(&env, &dropped, "new").await.replayed());
    let refused = pay(&env, &dropped, "old").await;
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:record-unreadable"
    );
    assert_eq!(unreadable_count(&dropped, "unknown_key").await, 1);
    assert_eq!(env.upstream.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_refuses_a_clear_record_that_on_still_replays() {
    let env = TestEnv::start(
        Backend::Redis,
        GatewayConfig::new()
            .set("admin.listen", "127.0.0.1:0")
            .set("store.local_cache", "0"),
    )
    .await;
    assert_eq!(pay(&env, &env.gateway, "clear").await.status, 201);
    let on = InProcessGateway::start(&env.config().seal("on", K1)).await;
    assert!(pay(&env, &on, "clear").await.replayed());
    let required = InProcessGateway::start(&env.config().seal("required", K1)).await;
    let refused = pay(&env, &required, "clear").await;
    assert_eq!(refused.status, 500);
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:record-unreadable"
    );
    assert_eq!(unreadable_count(&required, "clear").await, 1);
    // New records under required are sealed and replay.
    assert_eq!(pay(&env, &required, "fresh").await.status, 201);
    assert!(pay(&env, &required, "fresh").await.replayed());
    assert_eq!(env.upstream.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tombstones_are_sealed_and_refuse_after_expiry() {
    let settings = sealed_uncached(Backend::Redis, "required", K1)
        .set("defaults.ttl", "1s")
        .set("defaults.after_expiry", "refuse");
    let env = TestEnv::start(Backend::Redis, settings).await;
    assert_eq!(pay(&env, &env.gateway, "t").await.status, 201);
    common::wait_until(
        std::time::Duration::from_secs(5),
        "the record expires",
        async || redis_records(&env).await.len() == 1,
    )
    .await;
    let [(name, raw)] = <[_; 1]>::try_from(redis_records(&env).await).unwrap();
    assert!(name.ends_with(":tomb"), "{name}");
    assert_eq!(raw[0], 4, "sealed");
    assert_eq!(pay(&env, &env.gateway, "t").await.status, 410);
    assert_eq!(env.upstream.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_hold_no_clear_response_and_a_changed_one_is_refused() {
    let env = TestEnv::start(
        Backend::Postgres,
        sealed_uncached(Backend::Postgres, "required", K1),
    )
    .await;
    assert_eq!(pay(&env, &env.gateway, "p").await.status, 201);
    assert!(pay(&env, &env.gateway, "p").await.replayed());
    let pg = env.postgres();
    let clear = pg.psql("SELECT count(*) FROM idemgate_records WHERE position(convert_to('MARKER', 'UTF8') in record) > 0");
    assert_eq!(clear.trim(), "0", "rows holding the marker");
    let sealed = pg.psql("SELECT count(*) FROM idemgate_records WHERE get_byte(record, 0) = 4");
    assert_eq!(sealed.trim(), "1");
    pg.psql("UPDATE idemgate_records SET record = set_byte(record, length(record) - 20, get_byte(record, length(record) - 20) # 1)");
    let refused = pay(&env, &env.gateway, "p").await;
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:record-unreadable"
    );
    assert_eq!(env.upstream.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_file_holds_no_clear_response_and_reopens_sealed() {
    let mut env = TestEnv::start(Backend::Embedded, sealed("on", K1)).await;
    let first = pay(&env, &env.gateway, "e").await;
    assert_eq!(first.status, 201);
    env.restart_gateway().await;
    let replay = pay(&env, &env.gateway, "e").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let config: toml::Table = env.config().to_toml().parse().unwrap();
    let path = config["store"]["path"].as_str().unwrap().to_string();
    let mut files = 0;
    for entry in std::fs::read_dir(&path).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        assert!(!contains(&bytes, MARKER));
        files += 1;
    }
    assert!(files > 0);
    // Opened without its key: refused, not run again.
    env.restart_gateway_with(env.config().seal("off", K2)).await;
    let refused = pay(&env, &env.gateway, "e").await;
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:record-unreadable"
    );
    assert_eq!(env.upstream.calls(), 1);
}
