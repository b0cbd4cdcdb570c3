//! The store contract (the documentation of `Store` and `Inspect` in `src/store/mod.rs`) as a
//! reference model in plain Rust (`store_model/model.rs`: a map and the clock), and a
//! state-machine property test: sequences of calls (`store_model/ops.rs`: claims, completions,
//! renewals, releases, evictions and inspections by several claimants on a few keys, with
//! leases, ttls and tombstones drawn across their whole range, 0, 1 ms, hours, `MAX_DURATION`,
//! `u64::MAX` ms, `Duration::MAX` and forever) run against the model and against every backend,
//! every answer compared. A disagreement is shrunk to a shortest sequence, printed as Rust.
//!
//! The backends: memory and embedded (with the default bounds, and bounded tightly enough to
//! evict and refuse), Redis (one server, with native and with scripted claims; a Cluster),
//! PostgreSQL, and the local cache in front of Redis and of PostgreSQL. One server per backend
//! for the whole run, emptied (`evict_all`) before each case.
//!
//! `STORE_MODEL_CASES` sets the cases per backend ([`DEFAULT_CASES`] by default: about a minute
//! for every backend together on four test threads); `STORE_MODEL_SEED` the seed (fixed by
//! default, so that every run checks the same cases; `random` for a new one). Each backend mixes
//! its name into the seed, so they see different sequences; a failure names the seed. The
//! sequences a run once found are kept in [`REGRESSIONS`], run first on every backend.

use crate::common;

use std::time::Duration;

use common::{PostgresServer, RedisCluster, RedisServer};
use idemgate::idempotency::record::now_ms;
use idemgate::store::{
    self, CachedStore, EmbeddedSettings, EmbeddedStore, LocalCache, MemoryStore, PostgresSettings,
    PostgresStore, RedisSettings, RedisStore, Topology,
};
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};
use tokio::time::Instant;

mod model;
mod ops;

use self::model::{Answer, Bounds, Forever, Possible, Profile, Window};
use self::ops::*;

/// Cases per backend when `STORE_MODEL_CASES` is not set.
const DEFAULT_CASES: u32 = 300;

/// The seed when `STORE_MODEL_SEED` is not set.
const DEFAULT_SEED: u64 = 20_240_917;

/// A bounded in-process store's limits: three entries, and room for two large bodies and a
/// half.
const BOUNDS: Bounds = Bounds {
    max_entries: 3,
    max_large: 2,
};

/// How long a store operation may take before it fails: far more than any takes, so that a
/// loaded machine never fails a case.
const TIMEOUT: Duration = Duration::from_secs(10);

const UNBOUNDED: Profile = Profile {
    bounds: None,
    forever: Forever::NoExpiry,
    cached: false,
};

const BOUNDED: Profile = Profile {
    bounds: Some(BOUNDS),
    ..UNBOUNDED
};

/// Redis keeps a record asked forever for `MAX_DURATION`.
const REDIS: Profile = Profile {
    forever: Forever::ForMaxDuration,
    ..UNBOUNDED
};

/// Behind the local cache.
const fn cached(profile: Profile) -> Profile {
    Profile {
        cached: true,
        ..profile
    }
}

/// What keeps a backend's server (or directory) alive for the run.
type Fixture = Box<dyn std::any::Any>;

#[test]
fn on_memory() {
    run("memory", UNBOUNDED, async || {
        (no_fixture(), MemoryStore::new())
    });
}

#[test]
fn on_memory_bounded() {
    run("memory bounded", BOUNDED, async || {
        let store = MemoryStore::with_limits(BOUNDS.max_entries, max_bytes());
        (no_fixture(), store)
    });
}

#[test]
fn on_embedded() {
    run("embedded", UNBOUNDED, async || embedded(None));
}

#[test]
fn on_embedded_bounded() {
    run("embedded bounded", BOUNDED, async || embedded(Some(BOUNDS)));
}

#[test]
fn on_redis() {
    run("redis", REDIS, async || {
        let server = RedisServer::start().await;
        let store = redis(RedisSettings::new(server.url())).await;
        (Box::new(server) as Fixture, store)
    });
}

/// What a Redis older than 7.0, which refuses `SET NX GET`, gets.
#[test]
fn on_redis_script_claims() {
    run("redis with scripted claims", REDIS, async || {
        let server = RedisServer::start().await;
        let store = redis(RedisSettings::new(server.url())).await;
        (Box::new(server) as Fixture, store.claim_with_script())
    });
}

#[test]
fn on_redis_cluster() {
    run("redis cluster", REDIS, async || {
        let cluster = RedisCluster::start().await;
        let urls = cluster.urls();
        let store = redis(RedisSettings::with_topology(Topology::Cluster { urls })).await;
        (Box::new(cluster) as Fixture, store)
    });
}

#[test]
fn on_redis_cached() {
    run("redis behind the local cache", cached(REDIS), async || {
        let server = RedisServer::start().await;
        let store = redis(RedisSettings::new(server.url())).await;
        (
            Box::new(server) as Fixture,
            CachedStore::new(store, cache()),
        )
    });
}

#[test]
fn on_postgres() {
    run("postgres", UNBOUNDED, async || postgres().await);
}

#[test]
fn on_postgres_cached() {
    run(
        "postgres behind the local cache",
        cached(UNBOUNDED),
        async || {
            let (server, store) = postgres().await;
            (server, CachedStore::new(store, cache()))
        },
    );
}

fn no_fixture() -> Fixture {
    Box::new(())
}

/// `max_bytes` for [`BOUNDS`]: room for `max_large` large bodies and half of one more.
fn max_bytes() -> u64 {
    (BOUNDS.max_large * LARGE + LARGE / 2) as u64
}

/// The embedded store in a directory of its own, bounded or with the default bounds. Without
/// fsync: the contract is the same, and a case's commits would wait on the disk.
fn embedded(bounds: Option<Bounds>) -> (Fixture, EmbeddedStore) {
    let dir = tempfile::tempdir().unwrap();
    let mut settings = EmbeddedSettings::new(dir.path());
    settings.fsync = false;
    settings.timeout = TIMEOUT;
    if bounds.is_some() {
        settings.max_entries = BOUNDS.max_entries;
        settings.max_bytes = max_bytes();
    }
    let store = EmbeddedStore::open(&settings).unwrap();
    (Box::new(dir), store)
}

async fn redis(settings: RedisSettings) -> RedisStore {
    RedisStore::connect(&settings.prefix("model:").timeout(TIMEOUT))
        .await
        .unwrap()
}

async fn postgres() -> (Fixture, PostgresStore) {
    let server = PostgresServer::start().await;
    let settings = PostgresSettings::new(server.url()).timeout(TIMEOUT);
    let store = PostgresStore::connect(&settings).await.unwrap();
    (Box::new(server), store)
}

/// The local cache as the gateway makes it by default (60 s, room for every large body).
fn cache() -> LocalCache {
    LocalCache::new(1 << 20, Duration::from_secs(60))
}

/// Run the regression cases, then the generated ones, on the store `start` makes; panic with
/// the shrunk sequence at the first disagreement.
fn run<S: store::Inspect>(
    backend: &str,
    profile: Profile,
    start: impl AsyncFnOnce() -> (Fixture, S),
) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (cases, seed) = (cases(), seed());
    let (_fixture, store) = rt.block_on(start());
    let began = std::time::Instant::now();
    let answers = Tally::default();
    for (name, ops) in REGRESSIONS {
        if let Err(why) = rt.block_on(check(&store, profile, &ops(), &answers)) {
            panic!("{backend}: the regression case {name} fails: {why}");
        }
    }
    let config = Config {
        cases,
        rng_seed: RngSeed::Fixed(seed ^ fnv(backend)),
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&ops(), |ops| {
        rt.block_on(check(&store, profile, &ops, &answers))
            .map_err(TestCaseError::fail)
    });
    match result {
        Ok(()) => eprintln!(
            "store model on {backend}: {} regression and {cases} generated cases agree ({:.1?}, \
             STORE_MODEL_SEED={seed}); answers: {:?}",
            REGRESSIONS.len(),
            began.elapsed(),
            answers.lock().unwrap()
        ),
        Err(TestError::Fail(why, ops)) => panic!(
            "the store model and {backend} disagree (STORE_MODEL_SEED={seed}): {why}\n\
             shrunk sequence, to keep in REGRESSIONS:\n{}",
            as_rust(&ops)
        ),
        Err(TestError::Abort(why)) => panic!("{backend}: {why}"),
    }
}

/// `STORE_MODEL_CASES`, or [`DEFAULT_CASES`].
fn cases() -> u32 {
    match std::env::var("STORE_MODEL_CASES") {
        Ok(n) => n.parse().expect("STORE_MODEL_CASES: a number of cases"),
        Err(_) => DEFAULT_CASES,
    }
}

/// `STORE_MODEL_SEED` (`random`: one from the clock, the same for every backend of the run),
/// or [`DEFAULT_SEED`].
fn seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| match std::env::var("STORE_MODEL_SEED").as_deref() {
        Ok("random") => now_ms() ^ u64::from(std::process::id()) << 40,
        Ok(n) => n.parse().expect("STORE_MODEL_SEED: a number, or random"),
        Err(_) => DEFAULT_SEED,
    })
}

/// A stable hash of a backend's name (FNV-1a), mixed into the seed.
fn fnv(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn as_rust(ops: &[Op]) -> String {
    let lines: String = ops.iter().map(|op| format!("    {op:?},\n")).collect();
    format!("vec![\n{lines}]")
}

/// One case: the store emptied, then each call made on it and its answer checked against
/// every state the model allows; before a call whose answer depends on an entry written for a
/// brief span, a wait until that span has surely ended.
async fn check<S: store::Inspect>(
    store: &S,
    profile: Profile,
    ops: &[Op],
    answers: &Tally,
) -> Result<(), String> {
    store
        .evict_all()
        .await
        .map_err(|e| format!("evict_all: {e}"))?;
    let mut model = Possible::new(profile);
    for (step, op) in ops.iter().enumerate() {
        if let Some(until) = model.brief_until(op) {
            tokio::time::sleep_until(until).await;
        }
        model.lapse(Instant::now());
        let (start, wall) = (Instant::now(), now_ms());
        let answer = call(store, op).await;
        *answers.lock().unwrap().entry(kind(&answer)).or_default() += 1;
        let now = Window {
            step,
            start,
            end: Instant::now(),
            wall: (wall, now_ms()),
        };
        model
            .observe(op, now, &answer)
            .map_err(|why| format!("step {step}, {op:?}: {why}"))?;
    }
    Ok(())
}

/// How many answers of each kind a run got: that the cases reach every branch shows here.
type Tally = std::sync::Mutex<std::collections::BTreeMap<&'static str, u32>>;

fn kind(answer: &Answer) -> &'static str {
    use idemgate::store::Claim as C;
    match answer {
        Answer::Claim(Ok(C::Claimed)) => "claimed",
        Answer::Claim(Ok(C::Replay(_))) => "replay",
        Answer::Claim(Ok(C::InFlight)) => "in flight",
        Answer::Claim(Ok(C::NotReplayable)) => "not replayable",
        Answer::Claim(Ok(C::Mismatch)) => "mismatch",
        Answer::Claim(Ok(C::Expired { .. })) => "expired",
        Answer::Claim(Err(idemgate::StoreError::Full)) => "full",
        Answer::Yes(Ok(true)) => "true",
        Answer::Yes(Ok(false)) => "false",
        Answer::Inspect(Ok(Some(_))) => "inspected",
        Answer::Inspect(Ok(None)) => "nothing",
        Answer::Claim(Err(_)) | Answer::Yes(Err(_)) | Answer::Inspect(Err(_)) => "error",
    }
}

/// `op` on the store.
async fn call<S: store::Inspect>(store: &S, op: &Op) -> Answer {
    match *op {
        Claim { who, lease, refuse } => {
            Answer::Claim(store.claim(&who.claimant(), terms(lease, refuse)).await)
        }
        Complete {
            who,
            outcome,
            ttl,
            tombstone,
        } => {
            let keep = keep(ttl, tombstone);
            Answer::Yes(
                store
                    .complete(&who.claimant(), &outcome.state(), keep)
                    .await,
            )
        }
        Renew { who, lease } => Answer::Yes(store.renew(&who.claimant(), lease.duration()).await),
        Release { who } => Answer::Yes(store.release(&who.claimant()).await),
        Evict { key: k } => Answer::Yes(store.evict(&key(k)).await),
        Inspect { key: k } => Answer::Inspect(store.inspect(&key(k)).await),
    }
}

/// A regression case: its name, and its sequence.
type Regression = (&'static str, fn() -> Vec<Op>);

/// The named functions below, as regression cases.
macro_rules! regressions {
    ($($name:ident),* $(,)?) => { &[$((stringify!($name), $name)),*] };
}

/// Sequences a run found, shrunk, each named for what it showed; every backend runs them first.
const REGRESSIONS: &[Regression] = regressions![
    a_record_kept_forever_has_no_expiry,
    evicting_a_lapsed_claim_finds_nothing,
    a_live_tombstone_keeps_out_a_late_record_kept_forever,
    an_own_claim_retried_on_a_refusing_route_is_still_claimed,
    a_record_written_for_a_moment_is_the_first_evicted,
    a_zero_ttl_lives_a_millisecond_everywhere,
    a_tombstone_says_its_record_lived_its_ttl_exactly,
    a_cached_replay_never_outlives_its_record,
];

fn who(key: u8, fp: u8, token: u8) -> Who {
    Who { key, fp, token }
}

const SMALL: Outcome = Response {
    status: 200,
    body: Small(0),
};

/// Memory kept a record asked forever for `MAX_DURATION`, and said so.
fn a_record_kept_forever_has_no_expiry() -> Vec<Op> {
    vec![
        Complete {
            who: who(3, 0, 0),
            outcome: SMALL,
            ttl: Forever,
            tombstone: None,
        },
        Inspect { key: 3 },
    ]
}

/// Memory and embedded said `true` for a lapsed claim they had not purged yet.
fn evicting_a_lapsed_claim_finds_nothing() -> Vec<Op> {
    vec![
        Claim {
            who: who(2, 0, 0),
            lease: Ms(1),
            refuse: false,
        },
        Evict { key: 2 },
    ]
}

/// Embedded, Redis and PostgreSQL checked for a live tombstone only when the late record left
/// one, which a record kept forever does not.
fn a_live_tombstone_keeps_out_a_late_record_kept_forever() -> Vec<Op> {
    vec![
        Complete {
            who: who(3, 0, 0),
            outcome: SMALL,
            ttl: For(Ms(1)),
            tombstone: Some(Hours(1)),
        },
        Complete {
            who: who(3, 0, 0),
            outcome: SMALL,
            ttl: Forever,
            tombstone: Some(Hours(1)),
        },
    ]
}

/// PostgreSQL claimed, then gave the key back when its tombstone lived: the claimant's own live
/// claim, retried on a refusing route, was released and answered as expired.
fn an_own_claim_retried_on_a_refusing_route_is_still_claimed() -> Vec<Op> {
    vec![
        Complete {
            who: who(3, 0, 0),
            outcome: SMALL,
            ttl: For(Ms(1)),
            tombstone: Some(Hours(1)),
        },
        Claim {
            who: who(3, 0, 1),
            lease: Hours(1),
            refuse: false,
        },
        Claim {
            who: who(3, 0, 1),
            lease: Hours(1),
            refuse: true,
        },
    ]
}

/// A bounded store over its bounds evicts the record it has just written for a moment before
/// one kept an hour (the model had left brief records out).
fn a_record_written_for_a_moment_is_the_first_evicted() -> Vec<Op> {
    vec![
        Complete {
            who: who(0, 0, 0),
            outcome: SMALL,
            ttl: For(Hours(1)),
            tombstone: Some(Hours(1)),
        },
        Claim {
            who: who(2, 0, 0),
            lease: MaxDuration,
            refuse: false,
        },
        Complete {
            who: who(1, 0, 0),
            outcome: SMALL,
            ttl: For(Ms(1)),
            tombstone: None,
        },
        Inspect { key: 0 },
    ]
}

/// Memory ended a zero ttl at once, so a bounded store purged the record as expired and kept
/// its tombstone, where the others (a millisecond) evicted it with its tombstone.
fn a_zero_ttl_lives_a_millisecond_everywhere() -> Vec<Op> {
    vec![
        Complete {
            who: who(1, 0, 0),
            outcome: SMALL,
            ttl: For(Hours(1)),
            tombstone: None,
        },
        Claim {
            who: who(2, 0, 0),
            lease: Hours(1),
            refuse: false,
        },
        Complete {
            who: who(0, 0, 0),
            outcome: SMALL,
            ttl: For(Zero),
            tombstone: Some(Hours(1)),
        },
        Complete {
            who: who(0, 0, 0),
            outcome: SMALL,
            ttl: For(Hours(1)),
            tombstone: Some(Hours(1)),
        },
    ]
}

/// The stores that encode records read the clock twice for a tombstone, so its written time
/// could be a millisecond past its expiry less the ttl (seen when the clock ticked between).
fn a_tombstone_says_its_record_lived_its_ttl_exactly() -> Vec<Op> {
    let refused = Claim {
        who: who(2, 1, 0),
        lease: Ms(2),
        refuse: true,
    };
    let mut ops = Vec::new();
    for _ in 0..5 {
        ops.extend([
            Complete {
                who: who(2, 1, 2),
                outcome: SMALL,
                ttl: For(Zero),
                tombstone: Some(Hours(15)),
            },
            refused,
            Inspect { key: 2 },
            Evict { key: 2 },
        ]);
    }
    ops
}

/// The local cache reckoned a record's expiry from when the store's answer arrived, so it said
/// the record lived longer than it did by the length of the call.
fn a_cached_replay_never_outlives_its_record() -> Vec<Op> {
    let replayed = Claim {
        who: who(0, 1, 1),
        lease: Ms(1),
        refuse: true,
    };
    vec![
        Complete {
            who: who(0, 1, 0),
            outcome: SMALL,
            ttl: For(MaxDuration),
            tombstone: None,
        },
        replayed,
        replayed,
        replayed,
    ]
}
