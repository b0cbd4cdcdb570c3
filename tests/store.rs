//! The store contract, written once over any `S: Store` and run against the in-memory store, the
//! durable embedded store (a redb file in a temporary directory), a real redis-server (with
//! native and with scripted claims), Redis behind the local cache and a private PostgreSQL server
//! (alone and behind the local cache):
//! atomic claims and token fencing (a holder whose lease ran out can neither overwrite nor delete
//! a newer claim, but records its answer where nobody claimed since).

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::RedisServer;
use http::StatusCode;
use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::key::ScopedKey;
use idemgate::idempotency::policy::Ttl;
use idemgate::idempotency::record::now_ms;
use idemgate::idempotency::record::{EntryState, StoredResponse, Token};
use idemgate::store::RedisSettings;
use idemgate::store::{
    CachedStore, Claim, Inspect, Keep, LocalCache, RedisStore, Replay, Store, StoreError,
};
use idemgate::store::{ClaimTerms, Claimant};
use idemgate::AfterExpiry;

/// Generate, for each named `async fn(S: Store)`, one test per store the contract binds.
macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod on_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(idemgate::store::MemoryStore::new()).await
                }
            )*
        }
        /// The durable embedded store, in a directory of its own.
        mod on_embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let dir = tempfile::tempdir().unwrap();
                    let settings = idemgate::store::EmbeddedSettings::new(dir.path());
                    super::$name(idemgate::store::EmbeddedStore::open(&settings).unwrap()).await
                }
            )*
        }
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let server = super::RedisServer::start().await;
                    super::$name(super::redis_store(&server, "t:").await).await
                }
            )*
        }
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let server = super::common::PostgresServer::start().await;
                    let settings = idemgate::store::PostgresSettings::new(server.url());
                    let store = idemgate::store::PostgresStore::connect(&settings).await.unwrap();
                    super::$name(store).await
                }
            )*
        }
        /// What a Redis older than 7.0, which refuses `SET NX GET`, gets.
        mod redis_script_claims {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let server = super::RedisServer::start().await;
                    super::$name(super::redis_store(&server, "t:").await.claim_with_script()).await
                }
            )*
        }
        /// The local cache in front changes nothing of the contract.
        mod redis_behind_the_local_cache {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let server = super::RedisServer::start().await;
                    let store = super::redis_store(&server, "t:").await;
                    let cache = super::LocalCache::new(1 << 20, std::time::Duration::from_secs(60));
                    super::$name(super::CachedStore::new(store, cache)).await
                }
            )*
        }
        /// PostgreSQL behind the local cache, as the gateway runs it.
        mod postgres_behind_the_local_cache {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let server = super::common::PostgresServer::start().await;
                    let settings = idemgate::store::PostgresSettings::new(server.url());
                    let store = idemgate::store::PostgresStore::connect(&settings).await.unwrap();
                    let cache = super::LocalCache::new(1 << 20, std::time::Duration::from_secs(60));
                    super::$name(super::CachedStore::new(store, cache)).await
                }
            )*
        }
    };
}

contract!(
    claim_is_exclusive,
    stale_holder_is_fenced,
    renew_extends_only_own_lease,
    a_different_request_is_a_mismatch,
    an_expired_record_leaves_a_tombstone,
    a_completion_after_the_lease_is_recorded_unless_a_newer_claim_came,
);

/// `after_expiry = "refuse"`: an expired record's tombstone decides, until it expires in turn.
async fn an_expired_record_leaves_a_tombstone<S: Inspect>(s: S) {
    let (k, fp, other) = (
        ScopedKey([3; 32]),
        Fingerprint([2; 32]),
        Fingerprint([9; 32]),
    );
    let remembered = Keep {
        ttl: Ttl::For(Duration::from_millis(300)),
        tombstone: Some(Duration::from_secs(60)),
    };
    let t = Token::random();
    let claimed = s
        .claim(
            &Claimant::new(k, fp, t),
            ClaimTerms::lease(LEASE).after_expiry(AfterExpiry::Refuse),
        )
        .await
        .unwrap();
    assert!(matches!(claimed, Claim::Claimed), "{claimed:?}");
    assert!(s
        .complete(&Claimant::new(k, fp, t), &response("paid"), remembered)
        .await
        .unwrap());
    // While the record lives, it wins over its tombstone.
    let live = s
        .claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE).after_expiry(AfterExpiry::Refuse),
        )
        .await;
    assert_eq!(replayed_body(live.unwrap()).unwrap(), "paid");
    tokio::time::sleep(Duration::from_millis(500)).await;
    match s
        .claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE).after_expiry(AfterExpiry::Refuse),
        )
        .await
        .unwrap()
    {
        Claim::Expired {
            tombstone,
            recorded_ms,
        } => {
            assert_eq!(tombstone.status, Some(StatusCode::OK));
            assert!(
                tombstone.expired_ms >= recorded_ms + 300,
                "{tombstone:?} {recorded_ms}"
            );
            assert!(tombstone.expired_ms <= now_ms(), "expired in the past");
        }
        other => panic!("not refused as expired: {other:?}"),
    }
    let mismatch = s
        .claim(
            &Claimant::new(k, other, Token::random()),
            ClaimTerms::lease(LEASE).after_expiry(AfterExpiry::Refuse),
        )
        .await;
    assert!(matches!(mismatch, Ok(Claim::Mismatch)), "{mismatch:?}");
    let inspected = s.inspect(&k).await.unwrap().expect("the tombstone");
    assert!(
        matches!(inspected.entry.state, EntryState::Expired(_)),
        "{inspected:?}"
    );
    assert!(
        inspected.stored_bytes < 300,
        "no response in a tombstone: {inspected:?}"
    );
    // An eviction removes it: the key is free.
    assert!(s.evict(&k).await.unwrap());
    let t = Token::random();
    let again = s
        .claim(
            &Claimant::new(k, fp, t),
            ClaimTerms::lease(LEASE).after_expiry(AfterExpiry::Refuse),
        )
        .await
        .unwrap();
    assert!(matches!(again, Claim::Claimed), "{again:?}");
    // A released key leaves none; nor does a record kept without one.
    assert!(s.release(&Claimant::new(k, fp, t)).await.unwrap());
    let t = Token::random();
    assert!(matches!(
        s.claim(
            &Claimant::new(k, fp, t),
            ClaimTerms::lease(LEASE).after_expiry(AfterExpiry::Refuse)
        )
        .await
        .unwrap(),
        Claim::Claimed
    ));
    let brief = Duration::from_millis(100);
    assert!(s
        .complete(&Claimant::new(k, fp, t), &response("paid"), brief.into())
        .await
        .unwrap());
    // And a tombstone's own life ends: the key is free after it.
    let k2 = ScopedKey([4; 32]);
    let short = Keep {
        ttl: Ttl::For(brief),
        tombstone: Some(Duration::from_millis(200)),
    };
    let t = Token::random();
    s.claim(
        &Claimant::new(k2, fp, t),
        ClaimTerms::lease(LEASE).after_expiry(AfterExpiry::Refuse),
    )
    .await
    .unwrap();
    assert!(s
        .complete(&Claimant::new(k2, fp, t), &EntryState::NotReplayable, short)
        .await
        .unwrap());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let free = s
        .claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE).after_expiry(AfterExpiry::Refuse),
        )
        .await
        .unwrap();
    assert!(matches!(free, Claim::Claimed), "{free:?}");
    let free = s
        .claim(
            &Claimant::new(k2, fp, Token::random()),
            ClaimTerms::lease(LEASE).after_expiry(AfterExpiry::Refuse),
        )
        .await
        .unwrap();
    assert!(matches!(free, Claim::Claimed), "{free:?}");
}

/// `ttl = "forever"`, on the stores that keep it.
mod kept_forever {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_embedded() {
        let dir = tempfile::tempdir().unwrap();
        let settings = idemgate::store::EmbeddedSettings::new(dir.path());
        super::kept_forever(idemgate::store::EmbeddedStore::open(&settings).unwrap()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_postgres() {
        let server = super::common::PostgresServer::start().await;
        let settings = idemgate::store::PostgresSettings::new(server.url());
        let store = idemgate::store::PostgresStore::connect(&settings)
            .await
            .unwrap();
        super::kept_forever(store).await
    }
}

/// A record kept forever replays with no expiry and outlives one kept for a moment.
async fn kept_forever<S: Inspect>(s: S) {
    let (forever, brief, fp) = (ScopedKey([7; 32]), ScopedKey([8; 32]), Fingerprint([2; 32]));
    for (k, ttl) in [
        (forever, Ttl::Forever),
        (brief, Ttl::For(Duration::from_millis(200))),
    ] {
        let t = Token::random();
        assert!(matches!(
            s.claim(&Claimant::new(k, fp, t), ClaimTerms::lease(LEASE))
                .await
                .unwrap(),
            Claim::Claimed
        ));
        assert!(s
            .complete(&Claimant::new(k, fp, t), &response("kept"), ttl.into())
            .await
            .unwrap());
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let claim = s
        .claim(
            &Claimant::new(brief, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Claimed), "{claim:?}");
    match s
        .claim(
            &Claimant::new(forever, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
        .unwrap()
    {
        Claim::Replay(replay) => {
            assert_eq!(replay.response.body, "kept");
            assert_eq!(
                replay.expires_in, None,
                "a record kept forever has no expiry"
            );
        }
        other => panic!("not replayed: {other:?}"),
    }
    let inspected = s.inspect(&forever).await.unwrap().expect("still there");
    assert_eq!(inspected.expires_in, None);
    assert!(s.evict(&forever).await.unwrap(), "an eviction removes it");
    assert!(s.inspect(&forever).await.unwrap().is_none());
}

async fn redis_store(server: &RedisServer, prefix: &str) -> RedisStore {
    RedisStore::connect(&RedisSettings::new(server.url()).prefix(prefix))
        .await
        .unwrap()
}

fn response(body: &'static str) -> EntryState {
    EntryState::Completed(Arc::new(StoredResponse {
        status: StatusCode::OK,
        headers: vec![],
        body: Bytes::from_static(body.as_bytes()),
        trailers: Vec::new(),
        traceparent: None,
        key_source: None,
    }))
}

fn replayed_body(c: Claim) -> Option<Bytes> {
    match c {
        Claim::Replay(Replay { response, .. }) => Some(response.body.clone()),
        _ => None,
    }
}

const LEASE: Duration = Duration::from_secs(5);
const TTL: Duration = Duration::from_secs(60);

async fn claim_is_exclusive<S: Store>(s: S) {
    let (k, fp) = (ScopedKey([1; 32]), Fingerprint([2; 32]));
    let (a, other) = (Token::random(), Token::random());
    assert!(matches!(
        s.claim(&Claimant::new(k, fp, a), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    assert!(
        matches!(
            s.claim(&Claimant::new(k, fp, other), ClaimTerms::lease(LEASE))
                .await
                .unwrap(),
            Claim::InFlight
        ),
        "second claim must not succeed"
    );
    // The holder's own claim, retried after a lost answer, is still its own.
    assert!(matches!(
        s.claim(&Claimant::new(k, fp, a), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    assert!(s
        .complete(&Claimant::new(k, fp, a), &response("done"), TTL.into())
        .await
        .unwrap());
    let again = s
        .claim(&Claimant::new(k, fp, other), ClaimTerms::lease(LEASE))
        .await
        .unwrap();
    assert_eq!(replayed_body(again).as_deref(), Some(&b"done"[..]));
    // A completed record is not released by anyone, its writer included.
    assert!(!s.release(&Claimant::new(k, fp, a)).await.unwrap());
}

async fn a_different_request_is_a_mismatch<S: Store>(s: S) {
    let (k, fp, other_fp) = (
        ScopedKey([12; 32]),
        Fingerprint([13; 32]),
        Fingerprint([14; 32]),
    );
    let t = Token::random();
    assert!(matches!(
        s.claim(&Claimant::new(k, fp, t), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    // In flight or completed, the key belongs to the first request.
    let in_flight = s
        .claim(
            &Claimant::new(k, other_fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
        .unwrap();
    assert!(matches!(in_flight, Claim::Mismatch), "{in_flight:?}");
    assert!(s
        .complete(
            &Claimant::new(k, fp, t),
            &EntryState::NotReplayable,
            TTL.into()
        )
        .await
        .unwrap());
    let done = s
        .claim(
            &Claimant::new(k, other_fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
        .unwrap();
    assert!(matches!(done, Claim::Mismatch), "{done:?}");
    let same = s
        .claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
        .unwrap();
    assert!(matches!(same, Claim::NotReplayable), "{same:?}");
}

/// A claim whose holder stalls past its 150 ms lease, and the retry's claim after it:
/// the two tokens.
async fn stale_and_fresh<S: Store>(s: &S, k: &ScopedKey, fp: &Fingerprint) -> (Token, Token) {
    let (stale, fresh) = (Token::random(), Token::random());
    let short = Duration::from_millis(150);
    assert!(matches!(
        s.claim(&Claimant::new(*k, *fp, stale), ClaimTerms::lease(short))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    // Past the lease: this stall is the scenario.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(
        s.claim(&Claimant::new(*k, *fp, fresh), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    (stale, fresh)
}

async fn stale_holder_is_fenced<S: Store>(s: S) {
    let (k, fp) = (ScopedKey([3; 32]), Fingerprint([4; 32]));
    let (stale, fresh) = stale_and_fresh(&s, &k, &fp).await;
    // The stale holder wakes up: it can neither complete, renew nor release the new claim.
    assert!(!s
        .complete(&Claimant::new(k, fp, stale), &response("stale"), TTL.into())
        .await
        .unwrap());
    assert!(!s.renew(&Claimant::new(k, fp, stale), TTL).await.unwrap());
    assert!(!s.release(&Claimant::new(k, fp, stale)).await.unwrap());
    // The fresh holder completes; the stale one still cannot overwrite it.
    assert!(s
        .complete(&Claimant::new(k, fp, fresh), &response("fresh"), TTL.into())
        .await
        .unwrap());
    assert!(!s
        .complete(&Claimant::new(k, fp, stale), &response("stale"), TTL.into())
        .await
        .unwrap());
    let seen = s
        .claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
        .unwrap();
    assert_eq!(replayed_body(seen).as_deref(), Some(&b"fresh"[..]));
}

/// A holder whose lease ran out while the store could not be reached (here: a lease shorter
/// than the call) still records its answer when no newer claim took the key, so that a retry
/// replays it; its own completion sent twice counts as written; once a newer claim holds the
/// key, or another record, a late completion writes nothing.
async fn a_completion_after_the_lease_is_recorded_unless_a_newer_claim_came<S: Store>(s: S) {
    let (k, fp) = (ScopedKey([9; 32]), Fingerprint([10; 32]));
    let late = Claimant::new(k, fp, Token::random());
    let short = ClaimTerms::lease(Duration::from_millis(150));
    assert!(matches!(
        s.claim(&late, short).await.unwrap(),
        Claim::Claimed
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Lapsed: not renewed, not released, but recorded.
    assert!(!s.renew(&late, LEASE).await.unwrap());
    assert!(!s.release(&late).await.unwrap());
    assert!(s
        .complete(&late, &response("late"), TTL.into())
        .await
        .unwrap());
    assert!(s
        .complete(&late, &response("late"), TTL.into())
        .await
        .unwrap());
    let retry = Claimant::new(k, fp, Token::random());
    let seen = s.claim(&retry, ClaimTerms::lease(LEASE)).await.unwrap();
    assert_eq!(replayed_body(seen).as_deref(), Some(&b"late"[..]));
    // Another lapsed holder of the same key finds a record there: nothing written.
    let other = Claimant::new(k, fp, Token::random());
    assert!(!s
        .complete(&other, &response("other"), TTL.into())
        .await
        .unwrap());
    let seen = s.claim(&retry, ClaimTerms::lease(LEASE)).await.unwrap();
    assert_eq!(replayed_body(seen).as_deref(), Some(&b"late"[..]));
    // A newer claim took the key after the lease ran out: the late answer is not written.
    let k2 = ScopedKey([11; 32]);
    let (stale, fresh) = stale_and_fresh(&s, &k2, &fp).await;
    let stale = Claimant::new(k2, fp, stale);
    assert!(!s
        .complete(&stale, &response("stale"), TTL.into())
        .await
        .unwrap());
    let fresh = Claimant::new(k2, fp, fresh);
    assert!(s
        .complete(&fresh, &response("fresh"), TTL.into())
        .await
        .unwrap());
}

async fn renew_extends_only_own_lease<S: Store>(s: S) {
    let (k, fp) = (ScopedKey([5; 32]), Fingerprint([6; 32]));
    let t = Token::random();
    let lease = Duration::from_millis(1200);
    assert!(matches!(
        s.claim(&Claimant::new(k, fp, t), ClaimTerms::lease(lease))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    for _ in 0..5 {
        // Renewing at a quarter of the lease (a loaded machine's sleep may overrun by far),
        // past where it would have ended: the scenario.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(s.renew(&Claimant::new(k, fp, t), lease).await.unwrap());
    }
    // 1.5 s after a 1.2 s lease, still ours thanks to renewal.
    let other = s
        .claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
        .unwrap();
    assert!(matches!(other, Claim::InFlight), "{other:?}");
    assert!(s.release(&Claimant::new(k, fp, t)).await.unwrap());
    assert!(matches!(
        s.claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE)
        )
        .await
        .unwrap(),
        Claim::Claimed
    ));
}

/// Claim the key `[n; 32]`, record `body` for it, and see a second claim replay it.
async fn records_and_replays(s: &RedisStore, n: u8, body: &'static str) {
    let (k, fp, t) = (ScopedKey([n; 32]), Fingerprint([n; 32]), Token::random());
    assert!(matches!(
        s.claim(&Claimant::new(k, fp, t), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    assert!(s
        .complete(&Claimant::new(k, fp, t), &response(body), TTL.into())
        .await
        .unwrap());
    let again = s
        .claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
        .unwrap();
    assert_eq!(replayed_body(again).as_deref(), Some(body.as_bytes()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_private_ca() {
    let server = common::TlsRedisServer::start().await;
    let url = format!("rediss://127.0.0.1:{}/0", server.port);
    let ca = std::fs::read(&server.ca_file).unwrap();
    let s = RedisStore::connect(&RedisSettings::new(&url).prefix("tls:").tls_ca(ca))
        .await
        .expect("TLS connection with the CA");
    records_and_replays(&s, 8, "over tls").await;
    // Without the CA the self-signed certificate is not trusted: no silent downgrade.
    assert!(RedisStore::connect(&RedisSettings::new(&url))
        .await
        .is_err());
}

/// A Redis that asks for a client certificate (`tls-auth-clients yes`): refused without one,
/// served with the one its CA issued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_client_certificate() {
    let ca = common::TestCa::new();
    let server = ca.server("redis", &["127.0.0.1"], common::Validity::Now);
    let server = common::TlsRedisServer::start_requiring_clients(
        server.cert().as_ref(),
        server.key_path().as_ref(),
        ca.ca().as_ref(),
    )
    .await;
    let url = format!("rediss://127.0.0.1:{}/0", server.port);
    let trusting = || {
        RedisSettings::new(&url)
            .prefix("mtls:")
            .timeout(Duration::from_secs(2))
            .tls_ca(std::fs::read(ca.ca()).unwrap())
    };
    assert!(
        RedisStore::connect(&trusting()).await.is_err(),
        "no client certificate, no connection"
    );
    let client = ca.client("gateway");
    let cert = std::fs::read(client.cert()).unwrap();
    let key = std::fs::read(client.key_path()).unwrap();
    let s = RedisStore::connect(&trusting().tls_client(cert, key))
        .await
        .expect("TLS connection with the client certificate");
    records_and_replays(&s, 12, "mutual").await;
    // The gateway with the same files named in [store].
    let upstream = common::CountingUpstream::start().await;
    let config = common::GatewayConfig::new()
        .upstream(&upstream.url())
        .set("store.backend", "redis")
        .set("store.url", &*url)
        .set("store.tls_ca_file", ca.ca())
        .set("store.tls_cert_file", client.cert())
        .set("store.tls_key_file", client.key_path());
    let gateway = common::InProcessGateway::start(&config).await;
    gateway.runs_once_then_replays(&upstream, "mtls").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_acl_user() {
    let server = RedisServer::start().await;
    let mut admin = server.connection().await;
    let _: () = redis::cmd("ACL")
        .arg(
            &[
                "SETUSER",
                "gateway",
                "on",
                ">s3cret-pass",
                "~acl:*",
                "+@all",
            ][..],
        )
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://gateway:s3cret-pass@127.0.0.1:{}/0", server.port);
    let s = RedisStore::connect(&RedisSettings::new(&url).prefix("acl:"))
        .await
        .expect("ACL login");
    let (k, fp, t) = (ScopedKey([10; 32]), Fingerprint([11; 32]), Token::random());
    assert!(matches!(
        s.claim(&Claimant::new(k, fp, t), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    let wrong = format!("redis://gateway:wrong@127.0.0.1:{}/0", server.port);
    assert!(
        RedisStore::connect(&RedisSettings::new(wrong).prefix("acl:"))
            .await
            .is_err()
    );
}

fn large(fill: u8) -> EntryState {
    EntryState::Completed(Arc::new(StoredResponse {
        status: StatusCode::OK,
        headers: vec![],
        body: Bytes::from(vec![fill; 100_000]),
        trailers: Vec::new(),
        traceparent: None,
        key_source: None,
    }))
}

/// Large entries are completed through a staging key (a plain SET, then the fenced script renames
/// it): the same contract, nothing staged left behind, and a flushed script cache is reloaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_entries_complete_through_a_staging_key() {
    let server = RedisServer::start().await;
    let mut admin = server.connection().await;
    let store = redis_store(&server, "big:").await;
    let s = store.clone();
    let (k, fp) = (ScopedKey([20; 32]), Fingerprint([21; 32]));
    let (stale, fresh) = stale_and_fresh(&s, &k, &fp).await;
    // The stale holder's large completion is refused and its staged entry removed.
    assert!(!s
        .complete(&Claimant::new(k, fp, stale), &large(b's'), TTL.into())
        .await
        .unwrap());
    // Redis forgets its scripts: the next completion loads the script again.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(s
        .complete(
            &Claimant::new(k, fp, fresh),
            &large(b'f'),
            (10 * TTL).into()
        )
        .await
        .unwrap());
    // A retried completion (its first answer lost) is recognised as done.
    assert!(s
        .complete(
            &Claimant::new(k, fp, fresh),
            &large(b'f'),
            (10 * TTL).into()
        )
        .await
        .unwrap());
    let seen = s
        .claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
        .unwrap();
    assert_eq!(
        replayed_body(seen).as_deref(),
        Some(&vec![b'f'; 100_000][..])
    );
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("big:*")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(
        keys,
        vec![store.redis_key(&k)],
        "nothing staged is left behind"
    );
    let pttl: i64 = redis::cmd("PTTL")
        .arg(store.redis_key(&k))
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        pttl > 500_000,
        "the record keeps its own TTL, not the staging one: {pttl}"
    );
}

/// `wait_replicas` on a Redis with no replica: a claim is refused as not acknowledged and taken
/// back (the key is free again); a completion is written but reported as not acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacknowledged_writes_are_reported_and_a_claim_is_taken_back() {
    let server = RedisServer::start().await;
    let options = RedisSettings::new(server.url())
        .prefix("w:")
        .timeout(Duration::from_millis(200));
    let plain = RedisStore::connect(&options).await.unwrap();
    let waiting = RedisStore::connect(&options.clone().wait_replicas(1))
        .await
        .unwrap();
    let (k, fp) = (ScopedKey([7; 32]), Fingerprint([8; 32]));
    match waiting
        .claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
    {
        Err(StoreError::NotAcknowledged {
            acked: 0,
            wanted: 1,
        }) => {}
        other => panic!("expected a claim no replica acknowledged, got {other:?}"),
    }
    let mine = Token::random();
    assert!(
        matches!(
            plain
                .claim(&Claimant::new(k, fp, mine), ClaimTerms::lease(LEASE))
                .await
                .unwrap(),
            Claim::Claimed
        ),
        "the unacknowledged claim was released"
    );
    match waiting
        .complete(&Claimant::new(k, fp, mine), &response("done"), TTL.into())
        .await
    {
        Err(StoreError::NotAcknowledged {
            acked: 0,
            wanted: 1,
        }) => {}
        other => panic!("expected a completion no replica acknowledged, got {other:?}"),
    }
    let seen = plain
        .claim(
            &Claimant::new(k, fp, Token::random()),
            ClaimTerms::lease(LEASE),
        )
        .await
        .unwrap();
    assert_eq!(replayed_body(seen).as_deref(), Some(&b"done"[..]));
}

/// With a replica streaming from the primary, the same writes are acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_a_replica_acknowledges_count() {
    let (primary, replica) = (RedisServer::start().await, RedisServer::start().await);
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(primary.port)
        .query_async(&mut replica.connection().await)
        .await
        .unwrap();
    let mut admin = primary.connection().await;
    common::wait_until(Duration::from_secs(10), "the replica streams", async || {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut admin)
            .await
            .unwrap();
        info.contains("state=online")
    })
    .await;
    let store = RedisStore::connect(
        &RedisSettings::new(primary.url())
            .prefix("w:")
            .wait_replicas(1),
    )
    .await
    .unwrap();
    let (k, fp, token) = (ScopedKey([9; 32]), Fingerprint([1; 32]), Token::random());
    assert!(matches!(
        store
            .claim(&Claimant::new(k, fp, token), ClaimTerms::lease(LEASE))
            .await
            .unwrap(),
        Claim::Claimed
    ));
    assert!(store
        .complete(&Claimant::new(k, fp, token), &large(b'r'), TTL.into())
        .await
        .unwrap());
    let on_replica: Option<Vec<u8>> = redis::cmd("GET")
        .arg(store.redis_key(&k))
        .query_async(&mut replica.connection().await)
        .await
        .unwrap();
    let on_primary: Option<Vec<u8>> = redis::cmd("GET")
        .arg(store.redis_key(&k))
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(on_primary.is_some());
    assert_eq!(
        on_replica, on_primary,
        "the acknowledged record is on the replica"
    );
}

/// A waiter's watch fires when the key is completed or released, from another connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_hears_completions_and_releases() {
    let server = RedisServer::start().await;
    let (waiter, holder) = (
        redis_store(&server, "n:").await,
        redis_store(&server, "n:").await,
    );
    let (k, fp) = (ScopedKey([3; 32]), Fingerprint([4; 32]));
    for finish in ["complete", "release"] {
        let token = Token::random();
        assert!(matches!(
            holder
                .claim(&Claimant::new(k, fp, token), ClaimTerms::lease(LEASE))
                .await
                .unwrap(),
            Claim::Claimed
        ));
        let mut watch = waiter.watch(&k).await.expect("Redis watches keys");
        let heard = tokio::time::timeout(Duration::from_millis(300), watch.changed());
        assert!(heard.await.is_err(), "nothing happened yet ({finish})");
        if finish == "complete" {
            assert!(holder
                .complete(&Claimant::new(k, fp, token), &response("x"), LEASE.into())
                .await
                .unwrap());
        } else {
            assert!(holder.release(&Claimant::new(k, fp, token)).await.unwrap());
        }
        let heard = tokio::time::timeout(Duration::from_secs(2), watch.changed());
        assert!(heard.await.is_ok(), "the watch heard the {finish}");
        let _: () = redis::cmd("DEL")
            .arg(holder.redis_key(&k))
            .query_async(&mut server.connection().await)
            .await
            .unwrap();
    }
}

/// An eviction through one gateway's store reaches every other's subscriber.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evictions_are_published_to_every_process() {
    use idemgate::store::Evicted;
    let server = RedisServer::start().await;
    let (here, there) = (
        redis_store(&server, "e:").await,
        redis_store(&server, "e:").await,
    );
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    there
        .on_evicted(move |what| {
            let _ = tx.send(what);
        })
        .await;
    let k = ScopedKey([5; 32]);
    here.evict(&k).await.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(2), rx.recv()).await;
    assert_eq!(heard.unwrap(), Some(Evicted::Key(k)));
    here.evict_all().await.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(2), rx.recv()).await;
    assert_eq!(heard.unwrap(), Some(Evicted::All));
}
