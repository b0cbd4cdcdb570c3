//! The PostgreSQL store against a private server: what only it has (its table, its schema
//! version, the reaper, its pool under an outage) and the gateway over it when the server stops,
//! stalls or restarts, or two gateways share it. The contract and the behaviour tests run on it
//! too (tests/store.rs, `on_postgres` in every behaviour test).

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{send, wait_until, Backend, InProcessGateway, PostgresServer, TestConfig, TestEnv};
use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::key::ScopedKey;
use idemgate::idempotency::policy::Ttl;
use idemgate::idempotency::record::{EntryState, Token};
use idemgate::store::postgres::{PostgresError, REAP_EVERY};
use idemgate::store::{Claim, Inspect, PostgresSettings, PostgresStore, Store, StoreError};
use idemgate::store::{ClaimTerms, Claimant};

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
        s.claim(
            &Claimant::new(ScopedKey([i; 32]), fp, t),
            ClaimTerms::lease(short),
        )
        .await
        .unwrap();
        if i % 2 == 0 {
            assert!(s
                .complete(
                    &Claimant::new(ScopedKey([i; 32]), fp, t),
                    &EntryState::NotReplayable,
                    short.into()
                )
                .await
                .unwrap());
        }
    }
    let live = ScopedKey([99; 32]);
    s.claim(
        &Claimant::new(live, fp, Token::random()),
        ClaimTerms::lease(LEASE),
    )
    .await
    .unwrap();
    let forever = ScopedKey([98; 32]);
    let t = Token::random();
    s.claim(&Claimant::new(forever, fp, t), ClaimTerms::lease(short))
        .await
        .unwrap();
    let kept = EntryState::NotReplayable;
    assert!(s
        .complete(&Claimant::new(forever, fp, t), &kept, Ttl::Forever.into())
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
    server.psql("COMMENT ON TABLE idemgate_records IS 'idemgate schema 3'");
    match PostgresStore::connect(&PostgresSettings::new(server.url())).await {
        Err(StoreError::Postgres(PostgresError::SchemaTooNew { found: 3, .. })) => {}
        other => panic!("expected the newer schema refused, got {other:?}"),
    }
    // The binary exits 1 saying so.
    let config = TestConfig::new()
        .postgres(&server)
        .upstream("http://127.0.0.1:9");
    let (code, logs) = run_binary(&config);
    assert_eq!(code, Some(1), "{logs}");
    assert!(logs.contains("schema version 3"), "{logs}");
    assert!(!logs.contains(testkit::postgres::PASSWORD), "{logs}");
    // A table of the same name that is not ours is never written to.
    server.psql("CREATE TABLE ledger (id int)");
    let settings = PostgresSettings::new(server.url()).table("ledger");
    match PostgresStore::connect(&settings).await {
        Err(StoreError::Postgres(PostgresError::NotOurs { .. })) => {}
        other => panic!("expected a foreign table refused, got {other:?}"),
    }
}

/// A table an idemgate of schema 1 made (its index on every row's expiry) is migrated at start:
/// its records replay, and the expiry index leaves out the rows kept forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_of_schema_1_is_migrated_at_start_and_keeps_its_records() {
    let server = PostgresServer::start().await;
    let s = store(&server).await;
    let (k, fp, t) = (ScopedKey([5; 32]), Fingerprint([1; 32]), Token::random());
    s.claim(&Claimant::new(k, fp, t), ClaimTerms::lease(LEASE))
        .await
        .unwrap();
    assert!(s
        .complete(
            &Claimant::new(k, fp, t),
            &EntryState::NotReplayable,
            LEASE.into()
        )
        .await
        .unwrap());
    drop(s);
    // Schema 1, as that idemgate made it.
    server.psql(
        "DROP INDEX idemgate_records_expiring; \
         CREATE INDEX idemgate_records_expires_at ON idemgate_records (expires_at); \
         COMMENT ON TABLE idemgate_records IS 'idemgate schema 1'",
    );
    let s = store(&server).await;
    let comment = "SELECT obj_description('idemgate_records'::regclass, 'pg_class')";
    assert_eq!(server.psql(comment), "idemgate schema 2");
    let indexes = "SELECT string_agg(indexname || ':' || indexdef, ' | ' ORDER BY indexname) \
                   FROM pg_indexes WHERE tablename = 'idemgate_records'";
    let indexes = server.psql(indexes);
    assert!(
        !indexes.contains("idemgate_records_expires_at"),
        "{indexes}"
    );
    assert!(
        indexes.contains("WHERE (expires_at <> 'infinity"),
        "{indexes}"
    );
    let again = s
        .claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
        .unwrap();
    assert!(
        matches!(again, Claim::NotReplayable),
        "the record survived: {again:?}"
    );
    // A second start finds it migrated and changes nothing.
    drop(s);
    drop(store(&server).await);
    assert_eq!(server.psql(comment), "idemgate schema 2");
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
    s.claim(
        &Claimant::new(ScopedKey([1; 32]), fp, Token::random()),
        ClaimTerms::lease(LEASE),
    )
    .await
    .unwrap();
    server.pause();
    for i in 2..5u8 {
        let started = Instant::now();
        let err = s
            .claim(
                &Claimant::new(ScopedKey([i; 32]), fp, Token::random()),
                ClaimTerms::lease(LEASE),
            )
            .await;
        assert!(err.is_err(), "{err:?}");
        assert!(
            started.elapsed() < timeout + Duration::from_millis(1000),
            "failed after {:?}",
            started.elapsed()
        );
    }
    server.resume();
    wait_until(
        Duration::from_secs(5),
        "the store answers again",
        async || {
            s.claim(
                &Claimant::new(ScopedKey([9; 32]), fp, Token::random()),
                ClaimTerms::lease(LEASE),
            )
            .await
            .is_ok()
        },
    )
    .await;
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
        s.claim(&Claimant::new(k, fp, t), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    let seen = s.inspect(&k).await.unwrap().expect("the claim");
    assert!(matches!(seen.entry.state, EntryState::InFlight));
    assert!(seen.expires_in.unwrap() <= LEASE);
    assert!(s.evict(&k).await.unwrap());
    assert!(!s.evict(&k).await.unwrap());
    s.claim(&Claimant::new(k, fp, t), ClaimTerms::lease(LEASE))
        .await
        .unwrap();
    s.claim(
        &Claimant::new(ScopedKey([6; 32]), fp, t),
        ClaimTerms::lease(LEASE),
    )
    .await
    .unwrap();
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
        s.claim(&Claimant::new(k, fp, t), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
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

/// A server that asks for a client certificate on top of the password (`clientcert=verify-ca`):
/// refused without one, served with the one its CA issued, named in the settings or in the
/// gateway's `[store]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_for_a_server_that_asks_for_one() {
    let ca = common::TestCa::new();
    let cert = ca.server("postgres", &["127.0.0.1"], common::Validity::Now);
    let server = PostgresServer::start_requiring_clients(
        cert.cert().as_ref(),
        cert.key_path().as_ref(),
        ca.ca().as_ref(),
    )
    .await;
    let url = server
        .url()
        .replace("sslmode=disable", "sslmode=verify-full");
    let mut settings = PostgresSettings::new(&url).timeout(Duration::from_secs(2));
    settings.tls_ca_file = Some(ca.ca().to_string());
    assert!(
        PostgresStore::connect(&settings).await.is_err(),
        "no client certificate, no connection"
    );
    let client = ca.client("gateway");
    settings.tls_cert_file = Some(client.cert().to_string());
    settings.tls_key_file = Some(client.key_path().to_string());
    let s = PostgresStore::connect(&settings)
        .await
        .expect("TLS with the client certificate");
    let (k, fp, t) = (ScopedKey([9; 32]), Fingerprint([9; 32]), Token::random());
    assert!(matches!(
        s.claim(&Claimant::new(k, fp, t), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    let upstream = common::CountingUpstream::start().await;
    let config = TestConfig::new()
        .upstream(&upstream.url())
        .set("store.backend", "postgres")
        .set("store.url", url.as_str())
        .set("store.tls_ca_file", ca.ca())
        .set("store.tls_cert_file", client.cert())
        .set("store.tls_key_file", client.key_path());
    let gateway = InProcessGateway::start(&config).await;
    gateway.runs_once_then_replays(&upstream, "mtls").await;
}

/// The row `key` holds as PostgreSQL versions it: its `xmin` (the transaction that wrote this
/// version) and `xmax` (one that deleted, updated or locked it; 0 when none).
fn row_version(server: &PostgresServer, key: &ScopedKey) -> String {
    let hex: String = key.0.iter().map(|b| format!("{b:02x}")).collect();
    server.psql(&format!(
        "SELECT xmin::text || '/' || xmax::text FROM idemgate_records WHERE key = '\\x{hex}'"
    ))
}

/// A live row is read, never written: in-flight answers, mismatches and replays leave its
/// version as it was, without even a row lock; completing writes a new version, and so does
/// taking over an expired claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_row_is_read_not_rewritten() {
    let server = PostgresServer::start().await;
    let s = store(&server).await;
    let (k, fp, t) = (ScopedKey([8; 32]), Fingerprint([8; 32]), Token::random());
    assert!(matches!(
        s.claim(&Claimant::new(k, fp, t), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    let claimed = row_version(&server, &k);
    let other = Fingerprint([9; 32]);
    for _ in 0..3 {
        let c = s
            .claim(
                &Claimant::new(k, fp, Token::random()),
                ClaimTerms::lease(LEASE),
            )
            .await
            .unwrap();
        assert!(matches!(c, Claim::InFlight), "{c:?}");
        let c = s
            .claim(
                &Claimant::new(k, other, Token::random()),
                ClaimTerms::lease(LEASE),
            )
            .await
            .unwrap();
        assert!(matches!(c, Claim::Mismatch), "{c:?}");
    }
    assert_eq!(row_version(&server, &k), claimed);
    assert!(s
        .complete(
            &Claimant::new(k, fp, t),
            &EntryState::NotReplayable,
            LEASE.into()
        )
        .await
        .unwrap());
    let completed = row_version(&server, &k);
    assert_ne!(completed, claimed);
    assert!(completed.ends_with("/0"), "{completed}");
    for _ in 0..3 {
        let c = s
            .claim(
                &Claimant::new(k, fp, Token::random()),
                ClaimTerms::lease(LEASE),
            )
            .await
            .unwrap();
        assert!(matches!(c, Claim::NotReplayable), "{c:?}");
    }
    assert_eq!(row_version(&server, &k), completed);
    // An expired claim is taken over by the next claim: a new version, with the new token.
    let short = ScopedKey([10; 32]);
    let lease = Duration::from_millis(100);
    s.claim(
        &Claimant::new(short, fp, Token::random()),
        ClaimTerms::lease(lease),
    )
    .await
    .unwrap();
    let first = row_version(&server, &short);
    tokio::time::sleep(lease * 2).await;
    let next = Token::random();
    assert!(matches!(
        s.claim(&Claimant::new(short, fp, next), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    assert_ne!(row_version(&server, &short), first);
    assert!(s
        .renew(&Claimant::new(short, fp, next), LEASE)
        .await
        .unwrap());
}

/// Many claims of one key at once, on a free key and on an expired claim: exactly one wins, and
/// every other is told the key is in flight (it reads the winner's row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_have_exactly_one_winner() {
    let server = PostgresServer::start().await;
    let s = store(&server).await;
    let fp = Fingerprint([3; 32]);
    let race = async |key: ScopedKey| {
        let claims: Vec<_> = (0..12)
            .map(|_| {
                let s = s.clone();
                tokio::spawn(async move {
                    s.claim(
                        &Claimant::new(key, fp, Token::random()),
                        ClaimTerms::lease(LEASE),
                    )
                    .await
                })
            })
            .collect();
        let mut won = 0;
        for c in claims {
            match c.await.unwrap().unwrap() {
                Claim::Claimed => won += 1,
                Claim::InFlight => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        won
    };
    for i in 0..10u8 {
        let key = ScopedKey([i; 32]);
        assert_eq!(race(key).await, 1, "a free key");
        // The winner's lease runs out: the key is taken over by exactly one of the next ones.
        s.evict(&key).await.unwrap();
        s.claim(
            &Claimant::new(key, fp, Token::random()),
            ClaimTerms::lease(Duration::from_millis(50)),
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert_eq!(race(key).await, 1, "an expired claim");
    }
}

const ADMIN_TOKEN: &str = "postgres-admin-token-0123456789";

/// `idemgate_local_cache_hits_total` of `gateway`: replays it served from its local cache.
async fn local_cache_hits(gateway: &InProcessGateway) -> u64 {
    gateway
        .metrics()
        .await
        .lines()
        .find_map(|l| l.strip_prefix("idemgate_local_cache_hits_total "))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// `DELETE /keys/{key}` on `gateway`'s admin listener: how many it evicted.
async fn evict(gateway: &InProcessGateway, key: &str) -> u64 {
    let admin = gateway.admin.expect("an admin listener");
    let resp = common::client()
        .delete(format!("http://{admin}/keys/{key}"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: serde_json::Value = resp.json().await.unwrap();
    body["evicted"].as_u64().unwrap()
}

fn with_admin() -> TestConfig {
    TestConfig::new()
        .set("admin.listen", "127.0.0.1:0")
        .set("admin.admin_token", ADMIN_TOKEN)
}

/// After the first replay through a process, the next ones come from its local cache: they
/// are answered with PostgreSQL stopped in its tracks (SIGSTOP), and counted as hits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_come_from_the_local_cache_without_a_statement() {
    let env = TestEnv::start(
        Backend::Postgres,
        with_admin().set("store.timeout", "500ms"),
    )
    .await;
    let first = send(env.post_keyed("/v1/p", "cached").body("x")).await;
    assert_eq!(first.status, 201);
    // The record is written as the response ends: the first replay shows it is there.
    wait_until(Duration::from_secs(5), "the first replay", async || {
        send(env.post_keyed("/v1/p", "cached").body("x"))
            .await
            .replayed()
    })
    .await;
    let hits = local_cache_hits(&env.gateway).await;
    env.postgres().pause();
    for _ in 0..5 {
        let again = send(env.post_keyed("/v1/p", "cached").body("x")).await;
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, first.body);
    }
    // A request the cache cannot answer reaches the stalled server: a store error.
    assert_eq!(
        send(env.post_keyed("/v1/p", "other").body("x"))
            .await
            .status,
        503
    );
    env.postgres().resume();
    assert_eq!(local_cache_hits(&env.gateway).await, hits + 5);
    assert_eq!(env.upstream.calls(), 1);
}

/// An admin eviction drops the key from the local cache of the process that served it at once,
/// and from every other gateway's on the table when the notification arrives: the next request
/// runs again, whichever gateway it reaches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_reaches_every_gateways_local_cache() {
    let env = TestEnv::start(Backend::Postgres, with_admin()).await;
    let other = InProcessGateway::start(&env.config()).await;
    let post = |g: &InProcessGateway, key: &str| {
        env.client
            .post(g.url("/v1/p"))
            .header("idempotency-key", key.to_string())
            .body("x")
    };
    for key in ["here", "there"] {
        assert_eq!(send(post(&env.gateway, key)).await.status, 201);
        // Replayed twice through each gateway: the second comes from its local cache.
        for g in [&env.gateway, &other] {
            let hits = local_cache_hits(g).await;
            wait_until(Duration::from_secs(5), "a replay", async || {
                send(post(g, key)).await.replayed()
            })
            .await;
            assert!(send(post(g, key)).await.replayed());
            assert_eq!(local_cache_hits(g).await, hits + 1, "{key}");
        }
    }
    assert_eq!(env.upstream.calls(), 2);
    // Evicted through the gateway that then gets the retry: gone from its cache at once.
    assert_eq!(evict(&env.gateway, "here").await, 1);
    let again = send(post(&env.gateway, "here")).await;
    assert_eq!(again.status, 201);
    assert!(!again.replayed());
    assert_eq!(env.upstream.calls(), 3);
    // Evicted through the other gateway: this one hears of it.
    assert_eq!(evict(&other, "there").await, 1);
    wait_until(
        Duration::from_secs(2),
        "the eviction reaches the other gateway",
        async || !send(post(&env.gateway, "there")).await.replayed(),
    )
    .await;
    assert_eq!(env.upstream.calls(), 4);
    other.stop().await;
}

/// Waiters (`on_in_flight = "wait"`) on the gateway that runs the request they wait for are
/// woken by its completion: each answered within 50 ms of it (polling looks every 100 ms at
/// most after the first few looks, so five such waits all within 50 ms by luck are unlikely).
/// A waiter on another gateway polls, and gets the replay all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_woken_by_their_gateways_completion() {
    let config = TestConfig::new()
        .set("defaults.on_in_flight", "wait")
        .set("defaults.wait_timeout", "5s");
    let env = TestEnv::start(Backend::Postgres, config).await;
    let other = InProcessGateway::start(&env.config()).await;
    let timed = |req: reqwest::RequestBuilder| async move {
        let seen = send(req.body("x")).await;
        (seen, Instant::now())
    };
    let path = "/v1/p?delay_ms=400";
    let firsts: Vec<_> = (0..5)
        .map(|i| tokio::spawn(timed(env.post_keyed(path, &format!("wake-{i}")))))
        .collect();
    env.upstream.wait_for_calls(5).await;
    let waiters: Vec<_> = (0..5)
        .map(|i| tokio::spawn(timed(env.post_keyed(path, &format!("wake-{i}")))))
        .collect();
    let far = env
        .client
        .post(other.url(path))
        .header("idempotency-key", "wake-0");
    let far = tokio::spawn(timed(far));
    for (first, waiter) in firsts.into_iter().zip(waiters) {
        let (first, first_at) = first.await.unwrap();
        let (waited, waiter_at) = waiter.await.unwrap();
        assert_eq!(first.status, 201);
        assert!(waited.replayed(), "{waited:?}");
        assert_eq!(waited.body, first.body);
        let after = waiter_at.saturating_duration_since(first_at);
        assert!(after <= Duration::from_millis(50), "{after:?}");
    }
    assert!(far.await.unwrap().0.replayed());
    assert_eq!(env.upstream.calls(), 5);
    other.stop().await;
}

/// Each worker thread has its own share of `pool_size`: under many concurrent misses the whole
/// process holds at most `pool_size` connections for requests, plus the one that checked the
/// table and the one listening for evictions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_size_bounds_the_whole_process() {
    let upstream = common::CountingUpstream::start()
        .await
        .delay(Duration::from_millis(200));
    let config = TestConfig::new()
        .set("workers", 2)
        .set("store.pool_size", 4)
        .set("store.timeout", "10s");
    let env = TestEnv::start_with(Backend::Postgres, upstream, config).await;
    let sent: Vec<_> = (0..30)
        .map(|i| {
            tokio::spawn(send(
                env.post_keyed("/v1/p", &format!("pool-{i}")).body("x"),
            ))
        })
        .collect();
    for seen in sent {
        assert_eq!(seen.await.unwrap().status, 201);
    }
    let open: u64 = env
        .postgres()
        .psql("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idemgate'")
        .parse()
        .unwrap();
    assert!((3..=6).contains(&open), "{open} connections");
}
