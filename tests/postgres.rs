//! The PostgreSQL store against a private server: what only it has (its table, its schema
//! version, the reaper, its pool under an outage) and the gateway over it when the server stops,
//! stalls or restarts, or two gateways share it. The contract and the behaviour tests run on it
//! too (tests/store.rs, `on_postgres` in every behaviour test).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{send, wait_until, Backend, InProcessGateway, PostgresServer, TestConfig, TestEnv};
use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::key::ScopedKey;
use idemgate::idempotency::policy::Ttl;
use idemgate::idempotency::record::{EntryState, Token};
use idemgate::store::postgres::{PostgresError, REAP_EVERY};
use idemgate::store::{Claim, Inspect, PostgresSettings, PostgresStore, Store, StoreError};

const LEASE: Duration = Duration::from_secs(5);

async fn store(server: &PostgresServer) -> PostgresStore {
    PostgresStore::connect(&PostgresSettings::new(server.url()))
        .await
        .unwrap()
}

fn rows(server: &PostgresServer) -> u64 {
    server
        .psql("SELECT count(*) FROM idemgate_records")
        .parse()
        .unwrap()
}

/// The idemgate binary with `config`, run to its exit: (exit code, stderr).
fn run_binary(config: &TestConfig) -> (Option<i32>, String) {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), config.to_toml()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .arg("--config")
        .arg(file.path())
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let logs =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    (out.status.code(), logs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_deletes_expired_rows_and_only_those_never_a_record_kept_forever() {
    let server = PostgresServer::start().await;
    let s = store(&server).await;
    let fp = Fingerprint([1; 32]);
    let short = Duration::from_millis(200);
    for i in 0..5u8 {
        let t = Token::random();
        s.claim(&ScopedKey([i; 32]), &fp, &t, short).await.unwrap();
        if i % 2 == 0 {
            assert!(s
                .complete(
                    &ScopedKey([i; 32]),
                    &fp,
                    &t,
                    &EntryState::NotReplayable,
                    short.into()
                )
                .await
                .unwrap());
        }
    }
    let live = ScopedKey([99; 32]);
    s.claim(&live, &fp, &Token::random(), LEASE).await.unwrap();
    let forever = ScopedKey([98; 32]);
    let t = Token::random();
    s.claim(&forever, &fp, &t, short).await.unwrap();
    let kept = EntryState::NotReplayable;
    assert!(s
        .complete(&forever, &fp, &t, &kept, Ttl::Forever.into())
        .await
        .unwrap());
    assert_eq!(rows(&server), 7);
    // Expired claims and records are gone within the reaper's interval, by the store's own task;
    // a record kept forever is not.
    wait_until(
        REAP_EVERY + Duration::from_secs(3),
        "the reaper deleted the expired rows",
        async || rows(&server) == 2,
    )
    .await;
    assert!(s.inspect(&live).await.unwrap().is_some());
    assert_eq!(s.inspect(&forever).await.unwrap().unwrap().expires_in, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_is_refused_and_a_foreign_table_too() {
    let server = PostgresServer::start().await;
    drop(store(&server).await);
    server.psql("COMMENT ON TABLE idemgate_records IS 'idemgate schema 2'");
    match PostgresStore::connect(&PostgresSettings::new(server.url())).await {
        Err(StoreError::Postgres(PostgresError::SchemaTooNew { found: 2, .. })) => {}
        other => panic!("expected the newer schema refused, got {other:?}"),
    }
    // The binary exits 1 saying so.
    let config = TestConfig::new()
        .postgres(&server)
        .upstream("http://127.0.0.1:9");
    let (code, logs) = run_binary(&config);
    assert_eq!(code, Some(1), "{logs}");
    assert!(logs.contains("schema version 2"), "{logs}");
    assert!(!logs.contains(testkit::postgres::PASSWORD), "{logs}");
    // A table of the same name that is not ours is never written to.
    server.psql("CREATE TABLE ledger (id int)");
    let settings = PostgresSettings::new(server.url()).table("ledger");
    match PostgresStore::connect(&settings).await {
        Err(StoreError::Postgres(PostgresError::NotOurs { .. })) => {}
        other => panic!("expected a foreign table refused, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_exits_1_without_printing_it() {
    let server = PostgresServer::start().await;
    let config = TestConfig::new()
        .upstream("http://127.0.0.1:9")
        .set("store.backend", "postgres")
        .set("store.url", server.url_with("idemgate", "not-the-password"));
    let (code, logs) = run_binary(&config);
    assert_eq!(code, Some(1), "{logs}");
    assert!(logs.contains("password authentication failed"), "{logs}");
    assert!(!logs.contains("not-the-password"), "{logs}");
}

/// A stalled server (SIGSTOP): each operation fails within the timeout, never waits on, and the
/// store works again once the server answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_is_a_store_error_within_the_timeout() {
    let server = PostgresServer::start().await;
    let timeout = Duration::from_millis(400);
    let s = PostgresStore::connect(&PostgresSettings::new(server.url()).timeout(timeout))
        .await
        .unwrap();
    let fp = Fingerprint([2; 32]);
    s.claim(&ScopedKey([1; 32]), &fp, &Token::random(), LEASE)
        .await
        .unwrap();
    server.pause();
    for i in 2..5u8 {
        let started = Instant::now();
        let err = s
            .claim(&ScopedKey([i; 32]), &fp, &Token::random(), LEASE)
            .await;
        assert!(err.is_err(), "{err:?}");
        assert!(
            started.elapsed() < timeout + Duration::from_millis(300),
            "failed after {:?}",
            started.elapsed()
        );
    }
    server.resume();
    wait_until(
        Duration::from_secs(5),
        "the store answers again",
        async || {
            s.claim(&ScopedKey([9; 32]), &fp, &Token::random(), LEASE)
                .await
                .is_ok()
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_503_and_the_gateway_recovers_by_itself() {
    let env = TestEnv::start(
        Backend::Postgres,
        TestConfig::new().set("store.timeout", "500ms"),
    )
    .await;
    assert_eq!(
        send(env.post_keyed("/v1/p", "before").body("x"))
            .await
            .status,
        201
    );
    env.postgres().stop();
    let calls = env.upstream.calls();
    let refused = send(env.post_keyed("/v1/p", "during").body("x")).await;
    assert_eq!(refused.status, 503);
    assert_eq!(
        refused.problem_type(),
        "urn:idemgate:problem:store-unavailable"
    );
    assert_eq!(env.upstream.calls(), calls, "nothing forwarded");
    env.postgres().start_again().await;
    wait_until(
        Duration::from_secs(5),
        "keyed requests succeed after PostgreSQL is back",
        async || {
            let r = send(env.post_keyed("/v1/p", "after").body("x")).await;
            if r.status != 201 {
                assert_eq!(r.status, 503);
            }
            r.status == 201
        },
    )
    .await;
    assert!(send(env.post_keyed("/v1/p", "before").body("x"))
        .await
        .replayed());
}

/// Committed records survive the server's kill -9 and restart: a retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_records_replay_after_the_server_is_killed_and_restarted() {
    let env = TestEnv::start(Backend::Postgres, TestConfig::new()).await;
    let first = send(env.post_keyed("/v1/p", "k").body("x")).await;
    assert_eq!(first.status, 201);
    env.postgres().kill();
    env.postgres().start_again().await;
    let again = wait_until(Duration::from_secs(5), "the store is back", async || {
        send(env.post_keyed("/v1/p", "k").body("x")).await.status != 503
    })
    .await;
    let replay = send(env.post_keyed("/v1/p", "k").body("x")).await;
    assert!(replay.replayed(), "{replay:?} after {again:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(env.upstream.calls(), 1);
}

/// A PostgreSQL down when the gateway starts: it starts anyway, answers keyed requests 503,
/// and creates its table once the server is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_down_at_start_up_is_picked_up_later() {
    let server = PostgresServer::start().await;
    server.stop();
    let upstream = common::CountingUpstream::start().await;
    let config = TestConfig::new()
        .upstream(&upstream.url())
        .postgres(&server)
        .set("store.timeout", "500ms");
    let gateway = InProcessGateway::start(&config).await;
    let c = common::client();
    let post = || c.post(gateway.url("/v1/p")).header("idempotency-key", "k");
    assert_eq!(send(post().body("x")).await.status, 503);
    server.start_again().await;
    wait_until(Duration::from_secs(5), "the table is made", async || {
        send(post().body("x")).await.status == 201
    })
    .await;
    assert!(send(post().body("x")).await.replayed());
    assert_eq!(upstream.calls(), 1);
}

/// Two gateways on one database, duplicates sent to both at once: one upstream execution per
/// key, every other request a replay or a 409 in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_run_each_key_once() {
    let upstream = common::CountingUpstream::start()
        .await
        .delay(Duration::from_millis(300));
    // Two pools filling at once on a loaded machine: a store timeout with room to spare.
    let config = TestConfig::new().set("store.timeout", "10s");
    let env = TestEnv::start_with(Backend::Postgres, upstream, config).await;
    let other = InProcessGateway::start(&env.config()).await;
    let keys = 10;
    let mut sent = Vec::new();
    for k in 0..keys {
        for copy in 0..4 {
            let url = match copy % 2 {
                0 => env.url("/v1/p"),
                _ => other.url("/v1/p"),
            };
            let req = env
                .client
                .post(url)
                .header("idempotency-key", format!("dup-{k}"))
                .body("same");
            sent.push(tokio::spawn(send(req)));
        }
    }
    for seen in sent {
        let seen = seen.await.unwrap();
        assert!(
            seen.status == 201 || seen.status == 409,
            "unexpected {seen:?}"
        );
    }
    assert_eq!(env.upstream.calls(), keys, "one execution per key");
    // Afterwards, each key replays through either gateway.
    let through_other = send(
        env.client
            .post(other.url("/v1/p"))
            .header("idempotency-key", "dup-0")
            .body("same"),
    )
    .await;
    assert!(through_other.replayed());
    other.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_evict_see_the_table() {
    let server = PostgresServer::start().await;
    let s = store(&server).await;
    let (k, fp, t) = (ScopedKey([4; 32]), Fingerprint([5; 32]), Token::random());
    assert!(matches!(
        s.claim(&k, &fp, &t, LEASE).await.unwrap(),
        Claim::Claimed
    ));
    let seen = s.inspect(&k).await.unwrap().expect("the claim");
    assert!(matches!(seen.entry.state, EntryState::InFlight));
    assert!(seen.expires_in.unwrap() <= LEASE);
    assert!(s.evict(&k).await.unwrap());
    assert!(!s.evict(&k).await.unwrap());
    s.claim(&k, &fp, &t, LEASE).await.unwrap();
    s.claim(&ScopedKey([6; 32]), &fp, &t, LEASE).await.unwrap();
    assert_eq!(s.evict_all().await.unwrap(), 2);
    assert_eq!(rows(&server), 0);
    s.ping().await.unwrap();
}

/// TLS: with the server's CA the store works; without it (the system's roots) the certificate
/// is refused, and the binary exits 1 rather than starting as if the server were down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_verifies_the_certificate_and_a_wrong_setup_exits_1() {
    let server = PostgresServer::start_tls().await;
    let url = server
        .url()
        .replace("sslmode=disable", "sslmode=verify-full");
    let ca = server.ca_file.clone().unwrap();
    let mut settings = PostgresSettings::new(&url);
    settings.tls_ca_file = Some(ca.display().to_string());
    let s = PostgresStore::connect(&settings)
        .await
        .expect("TLS with the CA");
    let (k, fp, t) = (ScopedKey([7; 32]), Fingerprint([7; 32]), Token::random());
    assert!(matches!(
        s.claim(&k, &fp, &t, LEASE).await.unwrap(),
        Claim::Claimed
    ));
    let ssl: String = server.psql("SELECT count(*) FROM pg_stat_ssl WHERE ssl");
    assert_ne!(ssl, "0", "the store's connection uses TLS");
    match PostgresStore::connect(&PostgresSettings::new(&url)).await {
        Err(StoreError::Postgres(e)) => assert!(!e.unreachable(), "{e}"),
        Ok(_) => panic!("a self-signed certificate was trusted without its CA"),
        Err(other) => panic!("unexpected {other:?}"),
    }
    let config = TestConfig::new()
        .upstream("http://127.0.0.1:9")
        .set("store.backend", "postgres")
        .set("store.url", url.as_str());
    let (code, logs) = run_binary(&config);
    assert_eq!(code, Some(1), "{logs}");
    assert!(logs.contains("TLS"), "{logs}");
}
