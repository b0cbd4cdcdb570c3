//! The PostgreSQL store against a private server: what only it has (its table, its schema
//! version, the reaper, its pool under an outage) and the gateway over it when the server stops,
//! stalls or restarts, or two gateways share it. The contract and the behaviour tests run on it
//! too (tests/store.rs, `on_postgres` in every behaviour test).

use crate::common;

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use common::{send, wait_until, Backend, GatewayConfig, InProcessGateway, PostgresServer, TestEnv};
use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::key::ScopedKey;
use idemgate::idempotency::policy::Ttl;
use idemgate::idempotency::record::{EntryState, Token};
use idemgate::store::postgres::{PostgresError, REAP_EVERY};
use idemgate::store::{Claim, Inspect, PostgresSettings, PostgresStore, Store};
use idemgate::store::{ClaimTerms, Claimant};

const LEASE: Duration = Duration::from_secs(5);

/// The records table's comment: its schema version.
const COMMENT: &str = "SELECT obj_description('idemgate_records'::regclass, 'pg_class')";

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
fn run_binary(config: &GatewayConfig) -> (Option<i32>, String) {
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
        Err(e)
            if matches!(
                e.backend_error(),
                Some(PostgresError::SchemaTooNew { found: 3, .. })
            ) => {}
        other => panic!("expected the newer schema refused, got {other:?}"),
    }
    // The binary exits 1 saying so.
    let config = GatewayConfig::new()
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
        Err(e) if matches!(e.backend_error(), Some(PostgresError::NotOurs { .. })) => {}
        other => panic!("expected a foreign table refused, got {other:?}"),
    }
}

/// A table an idemgate of schema 1 made (its index on every row's expiry) is migrated once the
/// store has found it: its records replay, and the expiry index leaves out the rows kept
/// forever.
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
    wait_until(
        Duration::from_secs(30),
        "the table is at schema 2",
        async || server.psql(COMMENT) == "idemgate schema 2",
    )
    .await;
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
    assert_eq!(server.psql(COMMENT), "idemgate schema 2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_exits_1_without_printing_it() {
    let server = PostgresServer::start().await;
    let config = GatewayConfig::new()
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
    let env = TestEnv::start(Backend::Postgres, GatewayConfig::new()).await;
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
    let config = GatewayConfig::new()
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
    let config = GatewayConfig::new().set("store.timeout", "10s");
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
    settings.tls.ca_file = Some(ca.display().to_string());
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
        Err(e) if e.backend_error::<PostgresError>().is_some() => {
            assert!(!e.is_unreachable(), "{e}")
        }
        Ok(_) => panic!("a self-signed certificate was trusted without its CA"),
        Err(other) => panic!("unexpected {other:?}"),
    }
    let config = GatewayConfig::new()
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
    settings.tls.ca_file = Some(ca.ca().to_string());
    assert!(
        PostgresStore::connect(&settings).await.is_err(),
        "no client certificate, no connection"
    );
    let client = ca.client("gateway");
    settings.tls.cert_file = Some(client.cert().to_string());
    settings.tls.key_file = Some(client.key_path().to_string());
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
    let config = GatewayConfig::new()
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

fn with_admin() -> GatewayConfig {
    GatewayConfig::new()
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
/// most after the first few looks, so five such waits all within 50 ms by luck are unlikely),
/// in the best of three tries (a loaded machine may delay one try's answers). A waiter on
/// another gateway polls, and gets the replay all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_woken_by_their_gateways_completion() {
    let config = GatewayConfig::new()
        .set("defaults.on_in_flight", "wait")
        .set("defaults.wait_timeout", "5s");
    let env = TestEnv::start(Backend::Postgres, config).await;
    let other = InProcessGateway::start(&env.config()).await;
    let mut slowest = Vec::new();
    for attempt in 0..3 {
        let late = waiters_woken_after(&env, &other, attempt).await;
        if late <= Duration::from_millis(50) {
            break;
        }
        slowest.push(late);
    }
    assert!(slowest.len() < 3, "slowest waiter of each try: {slowest:?}");
    assert_eq!(env.upstream.calls(), 5 * (slowest.len() + 1));
    other.stop().await;
}

/// One try of [`waiters_are_woken_by_their_gateways_completion`]: five requests, a waiter for
/// each on the same gateway and one on `other`; how long after its request the slowest waiter
/// was answered.
async fn waiters_woken_after(env: &TestEnv, other: &InProcessGateway, attempt: usize) -> Duration {
    let timed = |req: reqwest::RequestBuilder| async move {
        let seen = send(req.body("x")).await;
        (seen, Instant::now())
    };
    let path = "/v1/p?delay_ms=400";
    let key = |i: usize| format!("wake-{attempt}-{i}");
    let calls = env.upstream.calls();
    let firsts: Vec<_> = (0..5)
        .map(|i| tokio::spawn(timed(env.post_keyed(path, &key(i)))))
        .collect();
    env.upstream.wait_for_calls(calls + 5).await;
    let waiters: Vec<_> = (0..5)
        .map(|i| tokio::spawn(timed(env.post_keyed(path, &key(i)))))
        .collect();
    let far = env
        .client
        .post(other.url(path))
        .header("idempotency-key", key(0));
    let far = tokio::spawn(timed(far));
    let mut slowest = Duration::ZERO;
    for (first, waiter) in firsts.into_iter().zip(waiters) {
        let (first, first_at) = first.await.unwrap();
        let (waited, waiter_at) = waiter.await.unwrap();
        assert_eq!(first.status, 201);
        assert!(waited.replayed(), "{waited:?}");
        assert_eq!(waited.body, first.body);
        slowest = slowest.max(waiter_at.saturating_duration_since(first_at));
    }
    assert!(far.await.unwrap().0.replayed());
    slowest
}

/// Each worker thread has its own share of `pool_size`: under many concurrent misses the whole
/// process holds at most `pool_size` connections for requests, plus the one that checked the
/// table and the one listening for evictions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_size_bounds_the_whole_process() {
    let upstream = common::CountingUpstream::start()
        .await
        .delay(Duration::from_millis(200));
    let config = GatewayConfig::new()
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

/// A connection of the test's own, as the gateway's role: another client beside the store (an
/// older gateway, a person at psql).
async fn session(server: &PostgresServer) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

/// `key` as a bytea literal.
fn bytea(key: &ScopedKey) -> String {
    let hex: String = key.0.iter().map(|b| format!("{b:02x}")).collect();
    format!("'\\x{hex}'::bytea")
}

/// Begin a transaction on `client` that inserts `key`'s row and holds it uncommitted: a claim
/// of the key waits for it to end.
async fn hold(client: &tokio_postgres::Client, key: &ScopedKey) {
    client
        .batch_execute(&format!(
            "BEGIN; INSERT INTO idemgate_records VALUES ({}, '\\x00', false, '\\x00', now())",
            bytea(key)
        ))
        .await
        .unwrap();
}

/// The gateway's statements waiting on a lock.
fn waiting_on_locks(server: &PostgresServer) -> String {
    server.psql(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name = 'idemgate' AND wait_event_type = 'Lock'",
    )
}

/// A claim stalled behind another transaction past the store's timeout is cancelled by the
/// server too, so that it cannot commit after the gateway gave up on it (a 503) and hold the
/// key with nobody working on it: with a URL that carries its own `options`, one of them
/// turning `statement_timeout` off, and with a timeout past PostgreSQL's longest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_given_up_on_is_cancelled_on_the_server_whatever_the_url_says() {
    let server = PostgresServer::start().await;
    let url = format!(
        "{}&options=-c%20statement_timeout%3D0%20-c%20search_path%3Dpublic",
        server.url()
    );
    let settings = PostgresSettings::new(&url).timeout(Duration::from_millis(500));
    let s = PostgresStore::connect(&settings).await.unwrap();
    let (key, fp) = (ScopedKey([11; 32]), Fingerprint([11; 32]));
    let other = session(&server).await;
    hold(&other, &key).await;
    let claim = s
        .claim(
            &Claimant::new(key, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await;
    assert!(claim.is_err(), "{claim:?}");
    wait_until(
        Duration::from_secs(5),
        "the server cancelled the claim",
        async || waiting_on_locks(&server) == "0",
    )
    .await;
    // The way is free again: a claim still waiting would now take the key.
    other.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        rows(&server),
        0,
        "the claim given up on did not commit later"
    );
    assert!(matches!(
        s.claim(
            &Claimant::new(key, fp, Token::random()),
            ClaimTerms::lease(LEASE)
        )
        .await
        .unwrap(),
        Claim::Claimed
    ));
    // A timeout past PostgreSQL's longest statement_timeout is its longest, not a refused
    // connection.
    let longest = PostgresSettings::new(&url).timeout(idemgate::time::MAX_DURATION);
    let s = PostgresStore::connect(&longest).await.unwrap();
    let claim = s
        .claim(
            &Claimant::new(ScopedKey([12; 32]), fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await;
    assert!(matches!(claim.unwrap(), Claim::Claimed));
}

/// A claim that waited most of its timeout for the pool's one connection is cancelled on the
/// server when the gateway gives up on it, not a whole timeout after it began there (the server
/// counts `statement_timeout` from the statement's start: left at that, the claim ran on past
/// the gateway's 503, past the engine's take-back of about 3 s with a long enough timeout, and
/// committed with nobody working on it). One that starts late and succeeds hands its connection
/// back bound by the whole timeout again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_started_late_is_cancelled_on_the_server_when_the_gateway_gives_up() {
    let server = PostgresServer::start().await;
    let mut settings = PostgresSettings::new(server.url()).timeout(Duration::from_secs(5));
    settings.pool_size = 1;
    let s = PostgresStore::connect(&settings).await.unwrap();
    let keys: Vec<_> = (20..25).map(|i| ScopedKey([i; 32])).collect();
    let mut holders = Vec::new();
    for key in &keys {
        holders.push(session(&server).await);
        hold(holders.last().unwrap(), key).await;
    }
    let claim = |key: ScopedKey| {
        let s = s.clone();
        tokio::spawn(async move {
            let who = Claimant::new(key, Fingerprint([20; 32]), Token::random());
            s.claim(&who, ClaimTerms::lease(LEASE)).await
        })
    };
    let waiting = async |n: &str| {
        wait_until(Duration::from_secs(5), "claims wait", async || {
            waiting_on_locks(&server) == n
        })
        .await;
    };
    let release = async |i: usize| holders[i].batch_execute("ROLLBACK").await.unwrap();
    // The second claim waits 4 s of its 5 for the pool's one connection, held by the first.
    let first = claim(keys[0]);
    waiting("1").await;
    let second = claim(keys[1]);
    tokio::time::sleep(Duration::from_secs(4)).await;
    release(0).await;
    assert!(matches!(first.await.unwrap(), Ok(Claim::Claimed)));
    let second = second.await.unwrap();
    assert!(second.is_err(), "{second:?}");
    wait_until(
        Duration::from_millis(1500),
        "the server gave up on the claim with the gateway",
        async || waiting_on_locks(&server) == "0",
    )
    .await;
    release(1).await;
    let row = format!(
        "SELECT count(*) FROM idemgate_records WHERE key = {}",
        bytea(&keys[1])
    );
    assert_eq!(
        server.psql(&row),
        "0",
        "the claim given up on never committed"
    );
    // Again with 1.5 s left, the row free 0.3 s into them: claimed.
    let first = claim(keys[2]);
    waiting("1").await;
    let second = claim(keys[3]);
    tokio::time::sleep(Duration::from_millis(3500)).await;
    release(2).await;
    assert!(matches!(first.await.unwrap(), Ok(Claim::Claimed)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    release(3).await;
    assert!(matches!(second.await.unwrap(), Ok(Claim::Claimed)));
    // The next statement on that connection has its whole 5 s: it waits 2.5 s, and claims.
    let third = claim(keys[4]);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    release(4).await;
    let third = third.await.unwrap();
    assert!(matches!(third, Ok(Claim::Claimed)), "{third:?}");
}

/// A schema-1 table of `rows` rows (live for a day), as an idemgate of that schema left it.
async fn schema_1_table(server: &PostgresServer, rows: u32) {
    drop(store(server).await);
    server.psql(&format!(
        "DROP INDEX idemgate_records_expiring; \
         INSERT INTO idemgate_records \
         SELECT decode(lpad(to_hex(i), 64, '0'), 'hex'), '\\x00', false, '\\x00', now() + interval '1 day' \
         FROM generate_series(1, {rows}) i; \
         CREATE INDEX idemgate_records_expires_at ON idemgate_records (expires_at); \
         COMMENT ON TABLE idemgate_records IS 'idemgate schema 1'"
    ));
}

/// The expiry indexes of the records table: (name, valid, definition).
fn expiry_indexes(server: &PostgresServer) -> String {
    server.psql(
        "SELECT string_agg(c.relname || ':' || i.indisvalid || ':' || pg_get_indexdef(c.oid), ' | ' ORDER BY c.relname) \
         FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         WHERE i.indrelid = 'idemgate_records'::regclass AND NOT i.indisprimary",
    )
}

/// Set once the test has seen what it waited for: the tasks beside it stop.
type Done = std::sync::Arc<std::sync::atomic::AtomicBool>;

fn stopped(done: &Done) -> bool {
    done.load(std::sync::atomic::Ordering::Relaxed)
}

/// An older gateway's writes on `client`: one UPDATE of a live row after the other until
/// `done`; when each ended.
fn older_gateway_writes(client: tokio_postgres::Client, done: Done) -> JoinHandle<Vec<Instant>> {
    tokio::spawn(async move {
        let mut ends = Vec::new();
        for i in 1.. {
            if stopped(&done) {
                break;
            }
            client
                .execute(
                    "UPDATE idemgate_records SET expires_at = now() + interval '1 day' \
                     WHERE key = decode(lpad(to_hex($1::int), 64, '0'), 'hex')",
                    &[&i],
                )
                .await
                .unwrap();
            ends.push(Instant::now());
        }
        ends
    })
}

/// What the test saw of the index builds on the server, looking every 20 ms.
#[derive(Default)]
struct Builds {
    // Each `CREATE INDEX` seen running: its backend and start.
    seen: std::collections::BTreeSet<(i32, String)>,
    // When one was first and last seen running.
    first: Option<Instant>,
    last: Option<Instant>,
    // The most `ShareLock`s (what a plain `CREATE INDEX` takes, blocking writers) seen at once
    // on the table.
    share_locks: i64,
}

impl Builds {
    /// Whether `at` was while an index was being built.
    fn during(&self, at: Instant) -> bool {
        matches!((self.first, self.last), (Some(f), Some(l)) if f <= at && at <= l)
    }

    /// How long the builds ran, from the first look that saw one to the last.
    fn span(&self) -> Duration {
        match (self.first, self.last) {
            (Some(f), Some(l)) => l - f,
            _ => Duration::ZERO,
        }
    }
}

/// Watch the index builds on the table through `client` until `done`.
fn watch_builds(
    client: tokio_postgres::Client,
    done: Done,
) -> (Arc<Mutex<Builds>>, JoinHandle<()>) {
    let builds = Arc::new(Mutex::new(Builds::default()));
    let seen = builds.clone();
    let task = tokio::spawn(async move {
        // Each build running (client backends only: a parallel build's workers show the same
        // query), and the table's ShareLocks, on a row of their own.
        let look = "SELECT pid, query_start::text, 0::bigint FROM pg_stat_activity \
                    WHERE query ILIKE 'CREATE INDEX%' AND state = 'active' \
                    AND backend_type = 'client backend' \
                    UNION ALL SELECT 0, '', count(*) FROM pg_locks \
                    WHERE relation = 'idemgate_records'::regclass AND mode = 'ShareLock'";
        while !stopped(&done) {
            let rows = client.query(look, &[]).await.unwrap();
            let now = Instant::now();
            {
                let mut b = seen.lock().unwrap();
                for row in rows {
                    match row.get::<_, i32>(0) {
                        0 => b.share_locks = b.share_locks.max(row.get(2)),
                        pid => {
                            b.seen.insert((pid, row.get(1)));
                            b.first.get_or_insert(now);
                            b.last = Some(now);
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    (builds, task)
}

/// A big table of schema 1 (1.5 million rows, as in production), two gateways starting together
/// on it with `[store] timeout = "200ms"`, an older gateway's writes going on: the index is
/// built once, concurrently, while both gateways serve keyed requests and the writes go on
/// (no `ShareLock`), and the table ends at version 2 with a valid index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_table_of_schema_1_is_migrated_once_while_it_is_served() {
    let server = PostgresServer::start().await;
    schema_1_table(&server, 1_500_000).await;
    let done = Done::default();
    let writes = older_gateway_writes(session(&server).await, done.clone());
    let (builds, watching) = watch_builds(session(&server).await, done.clone());
    let upstream = common::CountingUpstream::start().await;
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .postgres(&server)
        .set("store.timeout", "200ms");
    let started = Instant::now();
    let (one, two) = tokio::join!(
        InProcessGateway::start(&config),
        InProcessGateway::start(&config)
    );
    let c = common::client();
    let mut served = Vec::new();
    for i in 0.. {
        if server.psql(COMMENT) == "idemgate schema 2" {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(120), "not migrated");
        let gateway = [&one, &two][i % 2];
        let key = format!("during-{i}");
        let seen = send(
            c.post(gateway.url("/v1/p"))
                .header("idempotency-key", key)
                .body("x"),
        )
        .await;
        assert_eq!(seen.status, 201, "{seen:?}");
        served.push(Instant::now());
    }
    let migrated_in = started.elapsed();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let written = writes.await.unwrap();
    watching.await.unwrap();
    let builds = std::mem::take(&mut *builds.lock().unwrap());
    let served = served.iter().filter(|at| builds.during(**at)).count();
    let written = written.iter().filter(|at| builds.during(**at)).count();
    eprintln!(
        "migrated in {migrated_in:?}; the build ran for about {:?}, meanwhile {served} requests served and {written} rows written",
        builds.span()
    );
    assert_eq!(builds.seen.len(), 1, "one CREATE INDEX: {:?}", builds.seen);
    assert!(
        builds.span() > Duration::from_millis(200),
        "the build ({:?}) must outlast the store's timeout for this test to mean anything",
        builds.span()
    );
    assert_eq!(builds.share_locks, 0, "writers were blocked");
    assert!(
        written >= 3,
        "{written} rows written while the index was built"
    );
    assert!(
        served >= 1,
        "{served} requests served while the index was built"
    );
    assert_eq!(
        expiry_indexes(&server),
        "idemgate_records_expiring:true:CREATE INDEX idemgate_records_expiring ON public.idemgate_records USING btree (expires_at) WHERE (expires_at <> 'infinity'::timestamp with time zone)"
    );
    let replay = send(
        c.post(two.url("/v1/p"))
            .header("idempotency-key", "during-0")
            .body("x"),
    )
    .await;
    assert!(replay.replayed(), "{replay:?}");
}

/// A concurrent build of the new index cancelled halfway leaves it invalid: the next start
/// drops it and builds it again, and only then is the table at version 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_an_interrupted_build_left_invalid_is_built_again() {
    let server = PostgresServer::start().await;
    schema_1_table(&server, 10_000).await;
    // A writer's open transaction: the build, its index made (invalid), waits for it to end.
    let writer = session(&server).await;
    writer
        .batch_execute("BEGIN; UPDATE idemgate_records SET token = token WHERE false")
        .await
        .unwrap();
    let person = session(&server).await;
    let build = tokio::spawn(async move {
        person
            .batch_execute(
                "CREATE INDEX CONCURRENTLY idemgate_records_expiring ON idemgate_records \
                 (expires_at) WHERE expires_at <> 'infinity'",
            )
            .await
    });
    wait_until(
        Duration::from_secs(10),
        "the build made its index and waits",
        async || expiry_indexes(&server).contains("idemgate_records_expiring:false"),
    )
    .await;
    server.psql(
        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
         WHERE query LIKE 'CREATE INDEX CONCURRENTLY%' AND backend_type = 'client backend'",
    );
    assert!(
        build.await.unwrap().is_err(),
        "the build was not interrupted"
    );
    writer.batch_execute("ROLLBACK").await.unwrap();
    let left = expiry_indexes(&server);
    assert!(
        left.contains("idemgate_records_expiring:false"),
        "an invalid index: {left}"
    );
    let settings =
        PostgresSettings::new(server.url()).migration_timeout(idemgate::time::MAX_DURATION);
    let s = PostgresStore::connect(&settings).await.unwrap();
    wait_until(
        Duration::from_secs(60),
        "the table is at schema 2",
        async || server.psql(COMMENT) == "idemgate schema 2",
    )
    .await;
    let indexes = expiry_indexes(&server);
    assert!(
        indexes.starts_with("idemgate_records_expiring:true:") && !indexes.contains('|'),
        "{indexes}"
    );
    let (key, fp) = (ScopedKey([15; 32]), Fingerprint([15; 32]));
    let claim = s
        .claim(
            &Claimant::new(key, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await;
    assert!(matches!(claim.unwrap(), Claim::Claimed));
}
