//! The store contract, run against the embedded store and a real redis-server: atomic claims and
//! token fencing (a holder whose lease ran out can neither overwrite nor delete a newer claim).

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Backend, RedisServer};
use http::StatusCode;
use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::key::ScopedKey;
use idemgate::idempotency::record::{EntryState, StoredResponse, Token};
use idemgate::store::{Claim, MemoryStore, RedisStore, Store};

/// The stores the contract runs against: both backends, and Redis with claims through the Lua
/// script (what a Redis older than 7.0, which refuses `SET NX GET`, gets).
enum Kind {
    Memory,
    Redis,
    RedisScriptClaims,
}

impl From<Backend> for Kind {
    fn from(b: Backend) -> Self {
        match b {
            Backend::Memory => Kind::Memory,
            Backend::Redis => Kind::Redis,
        }
    }
}

/// Run `f` against a fresh store of `kind` (the redis-server lives as long as the test).
async fn with_store<F, Fut>(kind: impl Into<Kind>, f: F)
where
    F: FnOnce(StoreUnderTest) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let kind = kind.into();
    if let Kind::Memory = kind {
        return f(StoreUnderTest::Memory(MemoryStore::new())).await;
    }
    let server = RedisServer::start().await;
    let store = RedisStore::connect(&server.url(), "t:", std::time::Duration::from_secs(2))
        .await
        .unwrap();
    let store = match kind {
        Kind::RedisScriptClaims => store.claim_with_script(),
        _ => store,
    };
    f(StoreUnderTest::Redis(store)).await;
    drop(server);
}

enum StoreUnderTest {
    Memory(MemoryStore),
    Redis(RedisStore),
}

macro_rules! dispatch {
    ($s:expr, $st:ident => $e:expr) => {
        match $s {
            StoreUnderTest::Memory($st) => $e,
            StoreUnderTest::Redis($st) => $e,
        }
    };
}

impl StoreUnderTest {
    async fn claim(&self, k: &ScopedKey, fp: &Fingerprint, t: &Token, lease: Duration) -> Claim {
        dispatch!(self, s => s.claim(k, fp, t, lease).await.unwrap())
    }
    async fn complete(
        &self,
        k: &ScopedKey,
        fp: &Fingerprint,
        t: &Token,
        st: &EntryState,
        ttl: Duration,
    ) -> bool {
        dispatch!(self, s => s.complete(k, fp, t, st, ttl).await.unwrap())
    }
    async fn release(&self, k: &ScopedKey, t: &Token) -> bool {
        dispatch!(self, s => s.release(k, t).await.unwrap())
    }
    async fn renew(&self, k: &ScopedKey, t: &Token, lease: Duration) -> bool {
        dispatch!(self, s => s.renew(k, t, lease).await.unwrap())
    }
}

fn response(body: &'static str) -> EntryState {
    EntryState::Completed(Arc::new(StoredResponse {
        status: StatusCode::OK,
        headers: vec![],
        body: Bytes::from_static(body.as_bytes()),
        traceparent: None,
    }))
}

fn completed_body(c: Claim) -> Option<Bytes> {
    match c {
        Claim::Existing(e) => match e.state {
            EntryState::Completed(r) => Some(r.body.clone()),
            _ => None,
        },
        Claim::Claimed => None,
    }
}

on_both_backends!(
    claim_is_exclusive,
    stale_holder_is_fenced,
    renew_extends_only_own_lease
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_holds_with_script_claims() {
    claim_is_exclusive(Kind::RedisScriptClaims).await;
    stale_holder_is_fenced(Kind::RedisScriptClaims).await;
    renew_extends_only_own_lease(Kind::RedisScriptClaims).await;
}

async fn claim_is_exclusive(b: impl Into<Kind>) {
    with_store(b, |s| async move {
        let (k, fp) = (ScopedKey([1; 32]), Fingerprint([2; 32]));
        let (a, other) = (Token::random(), Token::random());
        assert!(matches!(
            s.claim(&k, &fp, &a, Duration::from_secs(5)).await,
            Claim::Claimed
        ));
        match s.claim(&k, &fp, &other, Duration::from_secs(5)).await {
            Claim::Existing(e) => {
                assert!(matches!(e.state, EntryState::InFlight));
                assert_eq!(e.fingerprint, fp);
            }
            Claim::Claimed => panic!("second claim must not succeed"),
        }
        assert!(
            s.complete(&k, &fp, &a, &response("done"), Duration::from_secs(60))
                .await
        );
        let again = s.claim(&k, &fp, &other, Duration::from_secs(5)).await;
        assert_eq!(completed_body(again).as_deref(), Some(&b"done"[..]));
        // A completed record is not released by anyone, its writer included.
        assert!(!s.release(&k, &a).await);
    })
    .await
}

/// A claim whose holder stalls past its 150 ms lease, and the retry's claim after it:
/// the two tokens.
async fn stale_and_fresh(s: &StoreUnderTest, k: &ScopedKey, fp: &Fingerprint) -> (Token, Token) {
    let (stale, fresh) = (Token::random(), Token::random());
    assert!(matches!(
        s.claim(k, fp, &stale, Duration::from_millis(150)).await,
        Claim::Claimed
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(
        s.claim(k, fp, &fresh, Duration::from_secs(5)).await,
        Claim::Claimed
    ));
    (stale, fresh)
}

async fn stale_holder_is_fenced(b: impl Into<Kind>) {
    with_store(b, |s| async move {
        let (k, fp) = (ScopedKey([3; 32]), Fingerprint([4; 32]));
        let (stale, fresh) = stale_and_fresh(&s, &k, &fp).await;
        // The stale holder wakes up: it can neither complete, renew nor release the new claim.
        assert!(
            !s.complete(&k, &fp, &stale, &response("stale"), Duration::from_secs(60))
                .await
        );
        assert!(!s.renew(&k, &stale, Duration::from_secs(60)).await);
        assert!(!s.release(&k, &stale).await);
        // The fresh holder completes; the stale one still cannot overwrite it.
        assert!(
            s.complete(&k, &fp, &fresh, &response("fresh"), Duration::from_secs(60))
                .await
        );
        assert!(
            !s.complete(&k, &fp, &stale, &response("stale"), Duration::from_secs(60))
                .await
        );
        let seen = s
            .claim(&k, &fp, &Token::random(), Duration::from_secs(5))
            .await;
        assert_eq!(completed_body(seen).as_deref(), Some(&b"fresh"[..]));
    })
    .await
}

async fn renew_extends_only_own_lease(b: impl Into<Kind>) {
    with_store(b, |s| async move {
        let (k, fp) = (ScopedKey([5; 32]), Fingerprint([6; 32]));
        let t = Token::random();
        assert!(matches!(
            s.claim(&k, &fp, &t, Duration::from_millis(300)).await,
            Claim::Claimed
        ));
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            assert!(s.renew(&k, &t, Duration::from_millis(300)).await);
        }
        // 600 ms after a 300 ms lease, still ours thanks to renewal.
        assert!(matches!(
            s.claim(&k, &fp, &Token::random(), Duration::from_secs(1))
                .await,
            Claim::Existing(_)
        ));
        assert!(s.release(&k, &t).await);
        assert!(matches!(
            s.claim(&k, &fp, &Token::random(), Duration::from_secs(1))
                .await,
            Claim::Claimed
        ));
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_private_ca() {
    let server = common::TlsRedisServer::start().await;
    let url = format!("rediss://127.0.0.1:{}/0", server.port);
    let ca = std::fs::read(&server.ca_file).unwrap();
    let store = RedisStore::connect_with_ca(&url, "tls:", Duration::from_secs(2), Some(ca))
        .await
        .expect("TLS connection with the CA");
    let s = StoreUnderTest::Redis(store);
    let (k, fp, t) = (ScopedKey([8; 32]), Fingerprint([9; 32]), Token::random());
    assert!(matches!(
        s.claim(&k, &fp, &t, Duration::from_secs(5)).await,
        Claim::Claimed
    ));
    assert!(
        s.complete(&k, &fp, &t, &response("over tls"), Duration::from_secs(60))
            .await
    );
    let again = s
        .claim(&k, &fp, &Token::random(), Duration::from_secs(5))
        .await;
    assert_eq!(completed_body(again).as_deref(), Some(&b"over tls"[..]));
    // Without the CA the self-signed certificate is not trusted: no silent downgrade.
    assert!(RedisStore::connect(&url, "tls:", Duration::from_secs(2))
        .await
        .is_err());
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
    let store = RedisStore::connect(&url, "acl:", Duration::from_secs(2))
        .await
        .expect("ACL login");
    let s = StoreUnderTest::Redis(store);
    let (k, fp, t) = (ScopedKey([10; 32]), Fingerprint([11; 32]), Token::random());
    assert!(matches!(
        s.claim(&k, &fp, &t, Duration::from_secs(5)).await,
        Claim::Claimed
    ));
    let wrong = format!("redis://gateway:wrong@127.0.0.1:{}/0", server.port);
    assert!(RedisStore::connect(&wrong, "acl:", Duration::from_secs(2))
        .await
        .is_err());
}

fn large(fill: u8) -> EntryState {
    EntryState::Completed(Arc::new(StoredResponse {
        status: StatusCode::OK,
        headers: vec![],
        body: Bytes::from(vec![fill; 100_000]),
        traceparent: None,
    }))
}

/// Large entries are completed through a staging key (a plain SET, then the fenced script renames
/// it): the same contract, nothing staged left behind, and a flushed script cache is reloaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_entries_complete_through_a_staging_key() {
    let server = RedisServer::start().await;
    let mut admin = server.connection().await;
    let store = RedisStore::connect(&server.url(), "big:", Duration::from_secs(2))
        .await
        .unwrap();
    let s = StoreUnderTest::Redis(store.clone());
    let (k, fp) = (ScopedKey([20; 32]), Fingerprint([21; 32]));
    let (stale, fresh) = stale_and_fresh(&s, &k, &fp).await;
    // The stale holder's large completion is refused and its staged entry removed.
    assert!(
        !s.complete(&k, &fp, &stale, &large(b's'), Duration::from_secs(60))
            .await
    );
    // Redis forgets its scripts: the next completion loads the script again.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        s.complete(&k, &fp, &fresh, &large(b'f'), Duration::from_secs(600))
            .await
    );
    // A retried completion (its first answer lost) is recognised as done.
    assert!(
        s.complete(&k, &fp, &fresh, &large(b'f'), Duration::from_secs(600))
            .await
    );
    let seen = s
        .claim(&k, &fp, &Token::random(), Duration::from_secs(5))
        .await;
    assert_eq!(
        completed_body(seen).as_deref(),
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
