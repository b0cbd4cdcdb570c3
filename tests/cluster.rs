//! The `redis-cluster` and `redis-sentinel` stores, against a real Redis Cluster (three
//! primaries, one replica each) and a real Sentinel set (a primary, a replica, three sentinels),
//! with two or three gateways on each: exactly once and byte-exact replays across gateways and
//! shards, admin evictions cluster-wide, waiters woken by pub/sub, and failovers injected by
//! `kill -9` with `wait_replicas = 1` (no duplicate) and `wait_replicas = 0` (duplicates shown).

use crate::common;

/// Tests that kill a node run one at a time: failure detection is a 1 s timeout, and two
/// failovers under load at once on two cores can starve a healthy node into a spurious one.
static KILLS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{
    send, wait_until, CountingUpstream, GatewayConfig, InProcessGateway, RedisCluster,
    RedisSentinelSet, Seen,
};
use idemgate::store::{NodeAuth, RedisSettings, RedisStore, Topology};
use redis::AsyncCommands;
use testkit::{Replicated, Steps, Supervision};

const TOKEN: &str = "cluster-admin-token-0123456789";
const IN_FLIGHT: &str = "urn:idemgate:problem:in-flight";
const STORE_UNAVAILABLE: &str = "urn:idemgate:problem:store-unavailable";

// === the fixtures themselves, with redis-rs only ===

/// The cluster fixture: three primaries sharding the keys, a replica taking over a killed
/// primary's slots with its data, and the killed node back as a replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_fixture_shards_fails_over_and_takes_a_node_back() {
    let _one_at_a_time = KILLS.lock().await;
    let started = Instant::now();
    let cluster = RedisCluster::start().await;
    eprintln!("cluster up in {:?}", started.elapsed());
    assert_eq!(cluster.primaries().await.len(), 3);
    // Two seeds: the client discovers the other four nodes.
    let client = redis::cluster::ClusterClient::new(cluster.urls()[..2].to_vec()).unwrap();
    let mut conn = client.get_async_connection().await.unwrap();
    for i in 0..100 {
        let _: () = conn.set(format!("fixture:{i}"), i).await.unwrap();
    }
    // WAIT goes to every primary, over the connections the writes took; within 200 ms, as a
    // replica's stream may start a moment after its sync (WAIT times out until then).
    let acknowledged = async |conn: &mut redis::cluster_async::ClusterConnection| {
        let acked: i64 = redis::cmd("WAIT")
            .arg(1)
            .arg(200)
            .query_async(conn)
            .await
            .unwrap();
        acked == 1
    };
    wait_until(
        Duration::from_secs(2),
        "every primary's replica acknowledges the writes",
        async || acknowledged(&mut conn).await,
    )
    .await;
    let keys = cluster.keys("fixture:*").await;
    assert_eq!(keys.len(), 100);
    for primary in cluster.primaries().await {
        let held = keys.iter().filter(|(p, _)| *p == primary).count();
        assert!(held > 0, "node {primary} holds none of the 100 keys");
    }

    let victim = cluster.kill9_primary_of("fixture:0").await;
    let failover = cluster.wait_for_failover(victim).await;
    eprintln!("failed over in {failover:?}");
    let primaries = cluster.primaries().await;
    assert_eq!(primaries.len(), 3);
    assert!(!primaries.contains(&victim), "{primaries:?}");
    for i in 0..100 {
        let v: i64 = conn.get(format!("fixture:{i}")).await.unwrap();
        assert_eq!(v, i, "fixture:{i} after the failover");
    }

    let back = cluster.restart(victim).await;
    eprintln!("node {victim} back as a replica in {back:?}");
    assert_eq!(
        cluster.primaries().await,
        primaries,
        "it rejoined as a replica"
    );
    let _: () = conn.set("fixture:after", 1).await.unwrap();
    wait_until(
        Duration::from_secs(2),
        "every primary has a replica again",
        async || acknowledged(&mut conn).await,
    )
    .await;
}

/// The Sentinel fixture: the sentinels promote the replica of a killed primary, and the killed
/// one comes back as its replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sentinel_fixture_fails_over_and_takes_the_old_primary_back() {
    let _one_at_a_time = KILLS.lock().await;
    let started = Instant::now();
    let set = RedisSentinelSet::start().await;
    eprintln!("Sentinel set up in {:?}", started.elapsed());
    assert_eq!(set.primary().await, 0);
    let connect = async || {
        redis::sentinel::SentinelClient::build(
            set.urls(),
            common::cluster::MASTER_NAME,
            None,
            redis::sentinel::SentinelServerType::Master,
        )
        .unwrap()
        .get_async_connection()
        .await
        .unwrap()
    };
    // Within 200 ms: the client's default response timeout is 500 ms.
    let wait_one = async |conn: &mut redis::aio::MultiplexedConnection| -> i64 {
        redis::cmd("WAIT")
            .arg(1)
            .arg(200)
            .query_async(conn)
            .await
            .unwrap()
    };
    let mut conn = connect().await;
    let _: () = conn.set("fixture", "before").await.unwrap();
    assert_eq!(wait_one(&mut conn).await, 1, "the replica acknowledged");

    let victim = set.kill9_primary().await;
    assert_eq!(victim, 0);
    let failover = set.wait_for_failover(victim).await;
    eprintln!("failed over in {failover:?}");
    assert_eq!(set.primary().await, 1);
    let mut conn = connect().await;
    let v: String = conn.get("fixture").await.unwrap();
    assert_eq!(v, "before");
    let _: () = conn.set("fixture", "alone").await.unwrap();
    assert_eq!(wait_one(&mut conn).await, 0, "no replica yet");

    let back = set.restart_as_replica(victim).await;
    eprintln!("node {victim} back as a replica in {back:?}");
    assert_eq!(set.primary().await, 1);
    // Its replication stream may start a moment after the sync (WAIT times out until then).
    let _: () = conn.set("fixture", "after").await.unwrap();
    wait_until(
        Duration::from_secs(2),
        "the old primary acknowledges writes",
        async || wait_one(&mut conn).await == 1,
    )
    .await;
}

// === several gateways on one store ===

/// `n` gateways on one store, each with its own local cache and admin listener, in front of one
/// upstream.
struct Gateways {
    all: Vec<InProcessGateway>,
    client: reqwest::Client,
}

impl Gateways {
    /// Start `n` gateways with `config` (upstream and store filled in), each with the key API on.
    async fn start(n: usize, config: &GatewayConfig) -> Self {
        // In-process gateways log into the test's output when `TEST_LOG` says (a `RUST_LOG`
        // filter, e.g. `idemgate=debug`), as the gateway binaries do.
        if let Ok(filter) = std::env::var("TEST_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_test_writer()
                .try_init();
        }
        let config = config
            .clone()
            .set("admin.listen", "127.0.0.1:0")
            .set("admin.admin_token", TOKEN);
        let mut all = Vec::new();
        for _ in 0..n {
            all.push(InProcessGateway::start(&config).await);
        }
        Gateways {
            all,
            client: common::client(),
        }
    }

    /// A keyed POST through gateway `g`.
    fn post(&self, g: usize, path: &str, key: &str) -> reqwest::RequestBuilder {
        self.client
            .post(self.all[g].url(path))
            .header("idempotency-key", key)
    }

    /// `method path` on gateway `g`'s admin listener, with the token; the JSON answer.
    async fn admin(&self, g: usize, method: reqwest::Method, path: &str) -> serde_json::Value {
        let admin = self.all[g].admin.expect("an admin listener");
        let resp = self
            .client
            .request(method, format!("http://{admin}{path}"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        resp.json().await.unwrap()
    }

    /// `idemgate_local_cache_hits_total` of gateway `g`: replays it served from its local cache.
    async fn local_cache_hits(&self, g: usize) -> u64 {
        self.all[g]
            .metrics()
            .await
            .lines()
            .find_map(|l| l.strip_prefix("idemgate_local_cache_hits_total "))
            .map_or(0, |v| v.trim().parse().unwrap())
    }

    /// `idemgate_store_unacknowledged_writes_total` for `op` (`claim`, `complete`), summed over
    /// the gateways. The label is matched by its value only (the gateway names it `operation`,
    /// as in its other store metrics).
    async fn unacknowledged(&self, op: &str) -> u64 {
        let mut total = 0;
        for g in &self.all {
            total += g
                .metrics()
                .await
                .lines()
                .filter(|l| l.starts_with("idemgate_store_unacknowledged_writes_total{"))
                .filter(|l| l.contains(&format!("=\"{op}\"}}")))
                .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
                .sum::<u64>();
        }
        total
    }
}

/// The headers a replay must repeat: all but the replay marker and Set-Cookie (recorded, never
/// replayed by default).
fn replayable_headers(seen: &Seen) -> Vec<(String, Vec<u8>)> {
    seen.headers_without_marker()
        .into_iter()
        .filter(|(n, _)| n != "set-cookie")
        .collect()
}

/// `len` bytes that no compression shrinks (a xorshift stream seeded by `seed`): a record this
/// size is this size in Redis too.
fn incompressible(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Send `POST /v1/p` with every key, each `copies` times at once through the gateways in turn,
/// and check that each key ran once: one fresh 201, every other copy a 409 in flight or a
/// byte-exact replay of it. Returns each key's fresh answer.
async fn duplicates_at_once(
    gateways: &Gateways,
    keys: &[String],
    copies: usize,
) -> BTreeMap<String, Seen> {
    let mut answers: BTreeMap<String, Vec<Seen>> = BTreeMap::new();
    // Fifty keys at a time: a few hundred connections, well within a default limit of open files.
    for (batch, chunk) in keys.chunks(50).enumerate() {
        let mut tasks = Vec::new();
        for (i, key) in chunk.iter().enumerate() {
            for copy in 0..copies {
                let g = (batch * 50 + i + copy) % gateways.all.len();
                let req = gateways.post(g, "/v1/p", key);
                let key = key.clone();
                tasks.push(tokio::spawn(
                    async move { (key, send(req.body("x")).await) },
                ));
            }
        }
        for t in tasks {
            let (key, seen) = t.await.unwrap();
            answers.entry(key).or_default().push(seen);
        }
    }
    let mut fresh = BTreeMap::new();
    for (key, seen) in answers {
        let (ran, others): (Vec<Seen>, Vec<Seen>) = seen
            .into_iter()
            .partition(|s| s.status == 201 && !s.replayed());
        assert_eq!(ran.len(), 1, "{key} ran {} times", ran.len());
        for other in &others {
            if other.status == 409 {
                assert_eq!(other.problem_type(), IN_FLIGHT, "{key}");
            } else {
                assert!(other.replayed(), "{key}: {other:?}");
                assert_eq!(other.body, ran[0].body, "{key}");
            }
        }
        fresh.insert(key, ran.into_iter().next().unwrap());
    }
    fresh
}

/// Every record key of the prefix `test:` is a hash tag, `test:{<name>}` (the record's name:
/// 22 characters of URL-safe base64), so that the record, its staging keys and its channel share
/// one slot.
fn assert_hash_tagged(keys: &[(usize, String)]) {
    for (_, key) in keys {
        let name = key
            .strip_prefix("test:{")
            .and_then(|k| k.strip_suffix('}'))
            .unwrap_or_else(|| panic!("{key} is not test:{{<name>}}"));
        assert!(
            name.len() == 22
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "{key}"
        );
    }
}

/// 200 keys over every slot, each sent four times at once through three gateways: one execution
/// per key, the rest in flight or replays; every gateway replays each; the records are spread
/// over the three primaries, one hash-tagged key each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_concurrent_duplicates_across_gateways_run_once() {
    let cluster = RedisCluster::start().await;
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(50));
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis_cluster(&cluster);
    let gateways = Gateways::start(3, &config).await;
    let keys: Vec<String> = (0..200).map(|i| format!("dup-{i}")).collect();
    let fresh = duplicates_at_once(&gateways, &keys, 4).await;
    assert_eq!(upstream.calls(), 200, "one execution per key");

    for (key, first) in &fresh {
        for g in 0..3 {
            let again = send(gateways.post(g, "/v1/p", key).body("x")).await;
            assert!(again.replayed(), "{key} on gateway {g}: {again:?}");
            assert_eq!(again.body, first.body, "{key} on gateway {g}");
        }
    }
    assert_eq!(upstream.calls(), 200);

    let records = cluster.keys("test:*").await;
    assert_eq!(records.len(), 200, "one Redis key per record");
    assert_hash_tagged(&records);
    for primary in cluster.primaries().await {
        let held = records.iter().filter(|(p, _)| *p == primary).count();
        assert!(held > 0, "primary {primary} holds none of the 200 records");
    }
}

/// Records of every size, below and above the 16 KiB from which a completion goes through a
/// staging key, replay byte for byte from every gateway; nothing staged is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_records_of_every_size_replay_byte_for_byte_from_every_gateway() {
    let cluster = RedisCluster::start().await;
    let upstream = CountingUpstream::start().await;
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis_cluster(&cluster);
    let gateways = Gateways::start(3, &config).await;
    // (path, request body): `/echo` answers the body, `/big` a compressible one of `bytes`.
    let cases: Vec<(String, Vec<u8>)> = vec![
        ("/v1/p".into(), b"x".to_vec()),
        ("/big?bytes=0".into(), b"x".to_vec()),
        ("/big?bytes=100000".into(), b"x".to_vec()),
        ("/echo".into(), incompressible(1, 1)),
        ("/echo".into(), incompressible(16 * 1024 - 1024, 2)),
        ("/echo".into(), incompressible(16 * 1024 + 1024, 3)),
        ("/echo".into(), incompressible(200_000, 4)),
        ("/echo".into(), incompressible(900_000, 5)),
    ];
    for (i, (path, body)) in cases.iter().enumerate() {
        let key = format!("size-{i}");
        let first = send(gateways.post(0, path, &key).body(body.clone())).await;
        assert_eq!(first.status, 201, "{path}");
        if path == "/echo" {
            assert_eq!(first.body, body[..], "{path}: the upstream's answer");
        }
        // The other gateways first: they have no local copy and read Redis.
        for g in [1, 2, 0] {
            let again = send(gateways.post(g, path, &key).body(body.clone())).await;
            assert!(
                again.replayed(),
                "{path} ({} bytes) on {g}",
                first.body.len()
            );
            assert_eq!(again.status, first.status);
            assert!(
                again.body == first.body,
                "{path}: {} bytes replayed as {} different bytes on gateway {g}",
                first.body.len(),
                again.body.len()
            );
            assert_eq!(replayable_headers(&again), replayable_headers(&first));
        }
    }
    assert_eq!(upstream.calls(), cases.len());
    let records = cluster.keys("test:*").await;
    assert_eq!(
        records.len(),
        cases.len(),
        "nothing staged left behind: {records:?}"
    );
    assert_hash_tagged(&records);
}

/// `after_expiry = "refuse"` on a cluster: each tombstone is written beside its record, in its
/// hash slot, by the completion (small records and staged large ones alike), and read by the
/// claim script on every gateway once the record has expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_tombstones_share_their_records_slot() {
    let cluster = RedisCluster::start().await;
    let upstream = CountingUpstream::start().await;
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis_cluster(&cluster)
        .set("defaults.ttl", "1s")
        .set("defaults.after_expiry", "refuse");
    let gateways = Gateways::start(2, &config).await;
    let paths = ["/v1/p", "/big?bytes=100000"];
    let keys: Vec<(String, &str)> = (0..20).map(|i| (format!("t-{i}"), paths[i % 2])).collect();
    for (key, path) in &keys {
        assert_eq!(
            send(gateways.post(0, path, key).body("x")).await.status,
            201
        );
    }
    tokio::time::sleep(Duration::from_millis(1300)).await;
    for (key, path) in &keys {
        for g in [1, 0] {
            let seen = send(gateways.post(g, path, key).body("x")).await;
            assert_eq!(seen.status, 410, "{key} on gateway {g}: {seen:?}");
        }
    }
    assert_eq!(upstream.calls(), keys.len());
    let tombstones: Vec<(usize, String)> = cluster
        .keys("test:*")
        .await
        .into_iter()
        .map(|(node, key)| (node, key.strip_suffix(":tomb").expect("a tombstone").into()))
        .collect();
    assert_eq!(tombstones.len(), keys.len(), "{tombstones:?}");
    assert_hash_tagged(&tombstones);
}

/// An admin eviction of one key, then of every key, on one gateway: the next request runs again
/// whichever gateway it reaches, including those whose local cache held the record (each drops
/// it when the eviction is published), and evict-all empties every primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_admin_evictions_reach_every_primary_and_every_local_cache() {
    let cluster = RedisCluster::start().await;
    let upstream = CountingUpstream::start().await;
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis_cluster(&cluster);
    let gateways = Gateways::start(3, &config).await;
    let keys: Vec<String> = (0..30).map(|i| format!("evict-{i}")).collect();
    let mut recorded = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        let first = send(gateways.post(i % 3, "/v1/p", key).body("x")).await;
        assert_eq!(first.status, 201);
        // Replayed by every gateway: every local cache holds it.
        for g in 0..3 {
            assert!(send(gateways.post(g, "/v1/p", key).body("x"))
                .await
                .replayed());
        }
        recorded.insert(key.clone(), first.body);
    }
    assert_eq!(upstream.calls(), 30);
    // Gateway 1 holds evict-0 in its local cache: it replays it without Redis.
    let hits = gateways.local_cache_hits(1).await;
    assert!(send(gateways.post(1, "/v1/p", "evict-0").body("x"))
        .await
        .replayed());
    assert_eq!(gateways.local_cache_hits(1).await, hits + 1);

    // One key, evicted through gateway 0: gateway 1 runs it again, the others replay that.
    let gone = gateways
        .admin(0, reqwest::Method::DELETE, "/keys/evict-0")
        .await;
    assert_eq!(gone["evicted"], 1);
    let old = recorded["evict-0"].clone();
    let mut rerun = None;
    wait_until(
        Duration::from_millis(500),
        "gateway 1 forgets the evicted record",
        async || {
            let seen = send(gateways.post(1, "/v1/p", "evict-0").body("x")).await;
            let forgot = seen.body != old;
            rerun = Some(seen);
            forgot
        },
    )
    .await;
    let rerun = rerun.unwrap();
    assert!(!rerun.replayed(), "evicted: it runs again");
    assert_eq!(upstream.calls(), 31);
    for g in [2, 0] {
        let seen = send(gateways.post(g, "/v1/p", "evict-0").body("x")).await;
        assert!(seen.replayed(), "gateway {g}");
        assert_eq!(seen.body, rerun.body, "gateway {g} replays the new record");
    }
    recorded.insert("evict-0".into(), rerun.body);

    // Every key, through gateway 2: the records were on every primary.
    let records = cluster.keys("test:*").await;
    assert_eq!(records.len(), 30);
    let holders: std::collections::BTreeSet<usize> = records.iter().map(|(p, _)| *p).collect();
    assert_eq!(holders.len(), 3, "the records are on every primary");
    let all = gateways
        .admin(2, reqwest::Method::DELETE, "/keys?confirm=all")
        .await;
    assert_eq!(all["evicted"], 30);
    assert_eq!(
        cluster.keys("test:*").await,
        vec![],
        "every primary emptied"
    );
    for (i, key) in keys.iter().enumerate() {
        // Each gateway in turn; the first to reach Redis runs it again, the others replay that.
        for g in [i % 3, (i + 1) % 3, (i + 2) % 3] {
            let what = format!("gateway {g} forgets {key}");
            wait_until(Duration::from_millis(500), &what, async || {
                send(gateways.post(g, "/v1/p", key).body("x")).await.body != recorded[key]
            })
            .await;
        }
    }
    assert_eq!(upstream.calls(), 31 + 30, "each key ran once more");
}

/// Waiters (`on_in_flight = "wait"`) on other gateways than the request they wait for: each is
/// answered within 50 ms of it, woken by pub/sub rather than by polling (which looks every
/// 100 ms at most, so five such waits all within 50 ms by luck are unlikely). A waiter on a
/// request that answers 503 (released, not recorded) runs it itself as soon.
async fn waiters_are_woken_across_gateways(config: GatewayConfig, upstream: &CountingUpstream) {
    let config = config
        .set("defaults.on_in_flight", "wait")
        .set("defaults.wait_timeout", "5s");
    let gateways = Gateways::start(3, &config).await;
    let calls = upstream.calls();
    // (path, whether the first answer is recorded)
    let cases = [
        ("/v1/p?delay_ms=400", true),
        ("/v1/p?delay_ms=400", true),
        ("/v1/p?delay_ms=400", true),
        ("/v1/p?delay_ms=400", true),
        ("/v1/p?delay_ms=400", true),
        ("/v1/p?delay_ms=400&status=503", false),
    ];
    // (the answer, when it was sent, when it was answered)
    let timed = |req: reqwest::RequestBuilder| async move {
        let sent = Instant::now();
        let seen = send(req.body("x")).await;
        (seen, sent, Instant::now())
    };
    let mut firsts = Vec::new();
    for (i, (path, _)) in cases.iter().enumerate() {
        let key = format!("wake-{i}");
        firsts.push(tokio::spawn(timed(gateways.post(0, path, &key))));
    }
    upstream.wait_for_calls(calls + cases.len()).await;
    let mut waiters = Vec::new();
    for (i, (path, _)) in cases.iter().enumerate() {
        let key = format!("wake-{i}");
        waiters.push(tokio::spawn(timed(gateways.post(1 + i % 2, path, &key))));
    }
    for (i, (first, waiter)) in firsts.into_iter().zip(waiters).enumerate() {
        let (first, _, first_at) = first.await.unwrap();
        let (waited, waiter_sent, waiter_at) = waiter.await.unwrap();
        let (path, recorded) = cases[i];
        let waiting = first_at.saturating_duration_since(waiter_sent);
        assert!(
            waiting >= Duration::from_millis(100),
            "{path}: the waiter was sent only {waiting:?} before the first answer"
        );
        let after = waiter_at.saturating_duration_since(first_at);
        eprintln!("waiter on {path} answered {after:?} after the first request");
        if recorded {
            assert_eq!(first.status, 201);
            assert!(waited.replayed(), "{path}: {waited:?}");
            assert_eq!(waited.body, first.body);
            assert!(after <= Duration::from_millis(50), "{path}: {after:?}");
        } else {
            assert_eq!((first.status, waited.status), (503, 503));
            assert!(!waited.replayed(), "released: the waiter ran it");
            // Its own call takes 400 ms.
            let late = after.saturating_sub(Duration::from_millis(400));
            assert!(late <= Duration::from_millis(50), "{path}: {after:?}");
        }
    }
    assert_eq!(
        upstream.calls(),
        calls + cases.len() + 1,
        "one call per key, and one more for the released key's waiter"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_waiters_on_other_gateways_are_woken_by_the_completion() {
    let cluster = RedisCluster::start().await;
    let upstream = CountingUpstream::start().await;
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis_cluster(&cluster);
    waiters_are_woken_across_gateways(config, &upstream).await;
}

/// Through the sentinels: concurrent duplicates run once, records below and above 16 KiB replay
/// byte for byte from both gateways, and waiters are woken across gateways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_exactly_once_replays_and_waiters() {
    let set = RedisSentinelSet::start().await;
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(50));
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis_sentinel(&set);
    let gateways = Gateways::start(2, &config).await;
    let keys: Vec<String> = (0..100).map(|i| format!("dup-{i}")).collect();
    let fresh = duplicates_at_once(&gateways, &keys, 3).await;
    assert_eq!(upstream.calls(), 100, "one execution per key");
    for (key, first) in fresh.iter().take(10) {
        let again = send(gateways.post(1, "/v1/p", key).body("x")).await;
        assert!(again.replayed(), "{key}");
        assert_eq!(again.body, first.body);
    }
    for (i, len) in [16 * 1024 - 1024, 16 * 1024 + 1024, 300_000]
        .into_iter()
        .enumerate()
    {
        let (key, body) = (format!("size-{i}"), incompressible(len, i as u64 + 7));
        let first = send(gateways.post(0, "/echo", &key).body(body.clone())).await;
        assert_eq!(first.body, body[..]);
        for g in [1, 0] {
            let again = send(gateways.post(g, "/echo", &key).body(body.clone())).await;
            assert!(again.replayed(), "{len} bytes on gateway {g}");
            assert!(again.body == first.body, "{len} bytes on gateway {g}");
            assert_eq!(replayable_headers(&again), replayable_headers(&first));
        }
    }
    assert_eq!(upstream.calls(), 103);
    let mut primary = redis::Client::open(set.url(set.primary().await))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stored: Vec<String> = primary.keys("test:*").await.unwrap();
    assert_eq!(stored.len(), 103, "nothing staged left behind");

    waiters_are_woken_across_gateways(config, &upstream).await;
}

// === failover, injected for real ===

/// How long a client retries one key before the test fails.
const KEY_DEADLINE: Duration = Duration::from_secs(30);

/// What the clients of a failover run saw.
#[derive(Default)]
struct Storm {
    /// Every answer: when, and its status.
    answers: Vec<(Instant, u16)>,
    /// Each key's two final (2xx) answers, and when the key was first sent.
    keys: Vec<(String, Instant, [Seen; 2])>,
}

/// Send `key` through `gateway` until it is answered 2xx, retrying on 503, 409, 502 and 504
/// (what a failover may answer) for at most [`KEY_DEADLINE`]; every answer goes to `log`.
async fn until_2xx(gateways: &Gateways, g: usize, key: &str, log: &Mutex<Storm>) -> Seen {
    let mut answer = None;
    let what = format!("{key} is answered 2xx through gateway {g}");
    wait_until(KEY_DEADLINE, &what, async || {
        let seen = send(gateways.post(g, "/v1/p", key).body("x")).await;
        log.lock()
            .unwrap()
            .answers
            .push((Instant::now(), seen.status));
        if (200..300).contains(&seen.status) {
            answer = Some(seen);
            return true;
        }
        assert!(
            [503, 409, 502, 504].contains(&seen.status),
            "{key}: {seen:?}"
        );
        false
    })
    .await;
    answer.unwrap()
}

/// A failover under load: clients (six tasks) send each key twice at once, through two gateways,
/// each copy retried until 2xx, while a primary holding some of the records is killed -9, the
/// store fails over, and a supervisor restarts the killed node as a replica. Every key must
/// succeed; with `wait_replicas = 1` none may run twice. Prints what the clients saw.
async fn failover_under_load(name: &str, store: Replicated<'_>, wait_replicas: u32) {
    let _one_at_a_time = KILLS.lock().await;
    // Each key's call takes 200 ms: calls are under way when the primary dies.
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(200));
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .replicated(store)
        .set("store.wait_replicas", wait_replicas)
        .set("store.timeout", "500ms")
        // Longer than a failover and a restart: the lease that a stuck claim (and the
        // background resending of a completion) lasts.
        .set("defaults.lock_ttl", "10s");
    let gateways = Gateways::start(2, &config).await;
    let log = Mutex::new(Storm::default());
    let stop = AtomicBool::new(false);
    let client = async |c: usize| {
        for n in 0.. {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let (key, sent) = (format!("{name}-{c}-{n}"), Instant::now());
            let (a, b) = tokio::join!(
                until_2xx(&gateways, 0, &key, &log),
                until_2xx(&gateways, 1, &key, &log)
            );
            log.lock().unwrap().keys.push((key, sent, [a, b]));
        }
    };
    let clients = futures_util::future::join_all((0..6).map(client));
    let done = || log.lock().unwrap().keys.len();
    let mut probes_ran = 0;
    let steps = Steps {
        under_way: async || {
            let what = "keys succeed before the kill";
            wait_until(Duration::from_secs(10), what, async || done() >= 20).await;
        },
        // The promoted primary has no replica until the supervisor acts: a claim on it is not
        // acknowledged, so it is refused (and counted). New keys probe for it, as the clients'
        // keys may all be waiting for their first execution's record.
        failed_over: async || {
            if wait_replicas == 0 {
                return;
            }
            let mut probe = 0;
            wait_until(
                Duration::from_secs(5),
                "a claim on the promoted primary is refused as unacknowledged",
                async || {
                    probe += 1;
                    let key = format!("{name}-probe-{probe}");
                    let seen = send(gateways.post(probe % 2, "/v1/p", &key).body("x")).await;
                    match seen.status {
                        201 => probes_ran += 1,
                        503 => assert_eq!(seen.problem_type(), STORE_UNAVAILABLE),
                        _ => panic!("{key}: {seen:?}"),
                    }
                    gateways.unacknowledged("claim").await > 0
                },
            )
            .await;
        },
        recovered: async |run: &Supervision<'_>| {
            if let Some(e) = &run.error {
                panic!("the supervisor: {e}");
            }
            let restarted_at = run.failover.as_ref().and_then(|f| f.healthy_at).unwrap();
            wait_until(
                Duration::from_secs(15),
                "keys first sent after the restart succeed",
                async || {
                    let log = log.lock().unwrap();
                    log.keys
                        .iter()
                        .filter(|(_, s, _)| *s > restarted_at)
                        .count()
                        >= 20
                },
            )
            .await;
        },
    };
    let (_, run) = store
        .under_load(Some("test:*"), clients, &stop, steps)
        .await;
    let f = run.failover.expect("a primary killed");
    let at = |step: Option<Instant>| step.unwrap().saturating_duration_since(f.killed_at);
    let (killed_at, failover) = (f.killed_at, at(f.failed_over_at));
    let (restarted, restart) = (at(f.restarted_at), at(f.healthy_at) - at(f.restarted_at));

    let log = log.into_inner().unwrap();
    let mut refused: BTreeMap<u16, usize> = BTreeMap::new();
    let mut last_refusal = None;
    for (at, status) in &log.answers {
        if !(200..300).contains(status) {
            *refused.entry(*status).or_default() += 1;
            last_refusal = Some(at.saturating_duration_since(killed_at));
        }
    }
    let mut duplicated = Vec::new();
    for (key, _, [a, b]) in &log.keys {
        match (a.replayed(), b.replayed()) {
            (false, false) => duplicated.push(key.clone()),
            (true, false) => assert_eq!(a.body, b.body, "{key}: a replay of the execution"),
            (false, true) => assert_eq!(b.body, a.body, "{key}: a replay of the execution"),
            (true, true) => panic!("{key}: two replays, no execution seen"),
        }
    }
    let keys = log.keys.len();
    eprintln!(
        "{name}: wait_replicas = {wait_replicas}, {keys} keys each sent twice at once: \
         failed over {failover:?} after the kill -9, restarted by the supervisor {restarted:?} \
         after it (a replica again {restart:?} later); {} requests refused {refused:?}, the \
         last {} after the kill; unacknowledged claims {}, completions {}; \
         {} duplicate execution(s) {duplicated:?}",
        refused.values().sum::<usize>(),
        last_refusal.map_or("none".to_string(), |d| format!("{d:?}")),
        gateways.unacknowledged("claim").await,
        gateways.unacknowledged("complete").await,
        duplicated.len(),
    );
    assert_eq!(
        upstream.calls(),
        keys + duplicated.len() + probes_ran,
        "every execution was seen by a client"
    );
    if wait_replicas > 0 {
        assert_eq!(duplicated, Vec::<String>::new(), "no key ran twice");
    }
}

/// A failover longer than the rest of a lease: `lock_ttl = "1s"`, a 1 s upstream call, and the
/// primary holding the key killed -9 right after the claim (the failover takes over a second
/// here, with a 1 s node timeout; Redis's default of 15 s is longer than most leases). The
/// promoted replica's copy of the claim lapses meanwhile, and since no newer claim took the
/// key, the completion (sent again until the new primary takes it) is recorded there: the
/// retry replays, and the upstream ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_failover_longer_than_the_rest_of_the_lease_still_records_the_answer() {
    let _one_at_a_time = KILLS.lock().await;
    let cluster = RedisCluster::start().await;
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(1000));
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis_cluster(&cluster)
        .set("store.wait_replicas", 1)
        .set("store.timeout", "500ms")
        .set("defaults.lock_ttl", "1s");
    let gateways = Gateways::start(1, &config).await;
    let first = tokio::spawn(send(gateways.post(0, "/v1/p", "fo").body("x")));
    upstream.wait_for_calls(1).await;
    let (_, record) = cluster.keys("*").await.first().expect("the claim").clone();
    let killed = cluster.kill9_primary_of(&record).await;
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "the answer is delivered: {first:?}");
    let took = cluster.wait_for_failover(killed).await;
    println!("failover took {took:?} (lease 1s)");
    // The promoted primary acknowledges nothing until it has a replica again.
    cluster.restart(killed).await;
    // The completion, sent again meanwhile, lands on the promoted primary (a retry that came
    // first would have run again: the window the docs name, counted as unrecorded).
    let admin = gateways.all[0].admin.expect("an admin listener");
    wait_until(
        Duration::from_secs(30),
        "the late answer recorded",
        async || {
            let view = gateways
                .client
                .get(format!("http://{admin}/keys/fo"))
                .bearer_auth(TOKEN)
                .send()
                .await;
            let Ok(view) = view else { return false };
            let view: serde_json::Value = view.json().await.unwrap_or_default();
            view["state"] == "completed"
        },
    )
    .await;
    let log = Mutex::new(Storm::default());
    let retry = until_2xx(&gateways, 0, "fo", &log).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_with_wait_replicas_runs_nothing_twice() {
    let cluster = RedisCluster::start().await;
    failover_under_load("cluster-wait1", Replicated::Cluster(&cluster), 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_without_wait_replicas_shows_its_duplicates() {
    let cluster = RedisCluster::start().await;
    failover_under_load("cluster-wait0", Replicated::Cluster(&cluster), 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_with_wait_replicas_runs_nothing_twice() {
    let set = RedisSentinelSet::start().await;
    failover_under_load("sentinel-wait1", Replicated::Sentinel(&set), 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_without_wait_replicas_shows_its_duplicates() {
    let set = RedisSentinelSet::start().await;
    failover_under_load("sentinel-wait0", Replicated::Sentinel(&set), 0).await;
}

/// `wait_replicas = 1` on a Redis that has no replica (the plain `redis` backend: the rule is the
/// same on all three): ten keyed requests at once are each refused 503 within about the store
/// timeout, nothing is forwarded, each claim is counted as unacknowledged and released, so the
/// retries are refused by the store again rather than found in flight, and no key is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacknowledged_claims_are_refused_counted_and_released() {
    let redis = common::RedisServer::start().await;
    let upstream = CountingUpstream::start().await;
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis(&redis)
        .set("store.wait_replicas", 1)
        .set("store.timeout", "300ms");
    let gateways = Gateways::start(1, &config).await;
    let timed = async |i: usize| {
        let started = Instant::now();
        let seen = send(gateways.post(0, "/v1/p", &format!("unacked-{i}")).body("x")).await;
        (seen, started.elapsed())
    };
    let answers = futures_util::future::join_all((0..10).map(timed)).await;
    let slowest = answers.iter().map(|(_, took)| *took).max().unwrap();
    eprintln!("ten claims without a replica refused within {slowest:?}");
    for (i, (seen, _)) in answers.iter().enumerate() {
        assert_eq!(seen.status, 503, "unacked-{i}: {seen:?}");
        assert_eq!(seen.problem_type(), STORE_UNAVAILABLE);
    }
    assert_eq!(upstream.calls(), 0, "nothing forwarded");
    assert_eq!(
        gateways.unacknowledged("claim").await,
        10,
        "every refused claim counted as unacknowledged"
    );
    assert!(
        slowest <= Duration::from_millis(1000),
        "a claim waits for its replicas about the store timeout (300 ms), not {slowest:?}"
    );
    for i in 0..10 {
        let retry = send(gateways.post(0, "/v1/p", &format!("unacked-{i}")).body("x")).await;
        assert_eq!(
            retry.problem_type(),
            STORE_UNAVAILABLE,
            "unacked-{i}: the unacknowledged claim was released"
        );
    }
    let mut conn = redis.connection().await;
    let left: Vec<String> = conn.keys("test:*").await.unwrap();
    assert_eq!(left, Vec::<String>::new(), "no claim left");
}

// === configuration ===

fn check_config(text: &str) -> std::process::Output {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), text).unwrap();
    std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .arg("check-config")
        .arg(file.path())
        .env("RUST_LOG", "off")
        .output()
        .unwrap()
}

/// The data nodes behind the sentinels take their own ACL user and password (`node_username`,
/// `node_password`), which the sentinels do not have: the gateway logs in to the primary as
/// that user, and a wrong password is a store that cannot be reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_data_nodes_take_their_own_credentials() {
    let set = RedisSentinelSet::start().await;
    let user = redis::cmd("ACL")
        .arg(
            &[
                "SETUSER",
                "gateway",
                "on",
                ">node-secret",
                "~*",
                "&*",
                "+@all",
            ][..],
        )
        .clone();
    for port in set.ports() {
        let _: () = testkit::cluster::query(port, &user).await.unwrap();
    }
    let upstream = CountingUpstream::start().await;
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .redis_sentinel(&set)
        .set("store.node_username", "gateway")
        .set("store.node_password", "node-secret");
    let gateway = InProcessGateway::start(&config).await;
    gateway.runs_once_then_replays(&upstream, "node-auth").await;
    let primary = set.ports()[set.primary().await];
    let clients: String =
        testkit::cluster::query(primary, &redis::cmd("CLIENT").arg("LIST").clone())
            .await
            .unwrap();
    assert!(clients.contains("user=gateway"), "{clients}");
    let wrong = RedisSettings::with_topology(Topology::Sentinel {
        urls: set.urls(),
        master_name: common::cluster::MASTER_NAME.into(),
    })
    .timeout(Duration::from_secs(2))
    .node_auth(NodeAuth {
        username: Some("gateway".into()),
        password: Some("not-the-secret".into()),
    });
    assert!(
        RedisStore::connect(&wrong).await.is_err(),
        "a wrong password"
    );
}

/// Each missing or misplaced cluster/Sentinel field exits 1 naming it; a valid config is shown
/// with every URL's password redacted.
#[test]
fn cluster_and_sentinel_settings_are_checked_and_passwords_never_printed() {
    let base = "upstream = \"http://127.0.0.1:9\"\n[store]\n";
    let cases = [
        ("backend = \"redis-cluster\"", "store.urls"),
        ("backend = \"redis-cluster\"\nurls = []", "store.urls"),
        (
            "backend = \"redis-cluster\"\nurl = \"redis://127.0.0.1:7001\"",
            "store.url",
        ),
        (
            "backend = \"redis-sentinel\"\nurls = [\"redis://127.0.0.1:26379\"]",
            "store.master_name",
        ),
        (
            "backend = \"memory\"\nwait_replicas = 1",
            "store.wait_replicas",
        ),
        ("wait_replicas = 1", "store.wait_replicas"),
        (
            "backend = \"redis-cluster\"\nurls = [\"redis://127.0.0.1:7001\"]\nnode_password = \"x\"",
            "store.node_password",
        ),
        (
            "backend = \"redis-sentinel\"\nurls = [\"redis://127.0.0.1:26379\"]\nmaster_name = \"m\"\nnode_password = \"\"",
            "store.node_password",
        ),
    ];
    for (table, field) in cases {
        let out = check_config(&format!("{base}{table}\n"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{table}");
        assert!(stderr.contains(field), "{field} not named in: {stderr}");
    }
    for (table, shown) in [
        (
            "backend = \"redis-cluster\"\nurls = [\"redis://app:hunter2-secret@127.0.0.1:7001\", \
             \"redis://:other-secret@127.0.0.1:7002\"]\nwait_replicas = 1",
            "urls = [\"redis://app:<redacted>@127.0.0.1:7001\", \"redis://:<redacted>@127.0.0.1:7002\"]",
        ),
        (
            "backend = \"redis-sentinel\"\nurls = [\"redis://app:hunter2-secret@127.0.0.1:26379\", \
             \"redis://:other-secret@127.0.0.1:26380\"]\nmaster_name = \"idemgate\"",
            "urls = [\"redis://app:<redacted>@127.0.0.1:26379\", \"redis://:<redacted>@127.0.0.1:26380\"]",
        ),
        (
            "backend = \"redis-sentinel\"\nurls = [\"redis://127.0.0.1:26379\"]\nmaster_name = \"idemgate\"\n\
             node_username = \"gateway\"\nnode_password = \"hunter2-secret\"",
            "\nnode_password = \"<redacted>\"  # file\n",
        ),
    ] {
        let out = check_config(&format!("{base}{table}\n"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{table}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains(shown), "{shown} not in: {stdout}");
        assert!(
            !stdout.contains("hunter2-secret") && !stdout.contains("other-secret"),
            "a password printed: {stdout}"
        );
    }
}

/// Keyed requests through two gateways (30 keys before, 30 new keys after), while a primary is
/// killed -9 and the store fails over; with `restart`, the supervisor restarts the killed node
/// as a replica right after the failover, before any request. Every new key must succeed within
/// 5 s of the failover: the gateways use the promoted primary, not the old one (dead, or back
/// as a replica that refuses writes).
async fn new_keys_succeed_after_a_failover(store: Replicated<'_>, restart: bool) {
    let _one_at_a_time = KILLS.lock().await;
    let upstream = CountingUpstream::start().await;
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .replicated(store)
        .set("store.timeout", "500ms");
    let gateways = Gateways::start(2, &config).await;
    for i in 0..30 {
        let key = format!("before-{i}");
        let seen = send(gateways.post(i % 2, "/v1/p", &key).body("x")).await;
        assert_eq!(seen.status, 201);
    }
    let mut killed = store.kill9_primary_holding("test:*").await;
    // Keyed requests go on while the store fails over (each refused 503, or served when its
    // key's shard is up).
    let ran_during = std::sync::atomic::AtomicUsize::new(0);
    let during = async {
        let mut n = 0;
        loop {
            let key = format!("during-{n}");
            let seen = send(gateways.post(n % 2, "/v1/p", &key).body("x")).await;
            assert!([201, 503].contains(&seen.status), "{seen:?}");
            if seen.status == 201 {
                ran_during.fetch_add(1, Ordering::SeqCst);
            }
            n += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let failover = tokio::select! {
        failover = killed.wait_for_failover() => failover,
        () = during => unreachable!(),
    };
    if restart {
        killed.restart_as_replica().await;
    }
    // Rounds of ten new keys, five through each gateway, until a whole round succeeds.
    let (mut round, mut ran_after) = (0, 0);
    let mut refused: BTreeMap<String, usize> = BTreeMap::new();
    let what = format!(
        "a round of new keys all succeed after the failover{}",
        if restart { " and the restart" } else { "" }
    );
    let took = wait_until(Duration::from_secs(5), &what, async || {
        round += 1;
        let mut all = true;
        for i in 0..10 {
            let key = format!("after-{round}-{i}");
            let seen = send(gateways.post(i % 2, "/v1/p", &key).body("x")).await;
            if seen.status == 201 {
                ran_after += 1;
            } else {
                assert_eq!(seen.status, 503, "{key}: {seen:?}");
                *refused.entry(format!("gateway {}", i % 2)).or_default() += 1;
                all = false;
            }
        }
        all
    })
    .await;
    eprintln!(
        "failed over {failover:?} after the kill; a whole round of new keys succeeded {took:?} \
         later, in round {round} (refused before: {refused:?})"
    );
    // Records from before the failover were replicated: they replay (from either gateway).
    for i in 0..30 {
        let key = format!("before-{i}");
        let seen = send(gateways.post((i + 1) % 2, "/v1/p", &key).body("x")).await;
        assert!(seen.replayed(), "{key}: {seen:?}");
    }
    // The request of the "during" loop that was cut off when the failover was seen may have
    // run without being counted there.
    let counted = 30 + ran_during.load(Ordering::SeqCst) + ran_after;
    assert!(
        (counted..=counted + 1).contains(&upstream.calls()),
        "{} upstream calls, {counted} counted",
        upstream.calls()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_gateways_use_the_promoted_primary_while_the_old_one_is_down() {
    let cluster = RedisCluster::start().await;
    new_keys_succeed_after_a_failover(Replicated::Cluster(&cluster), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_gateways_use_the_promoted_primary_once_the_old_one_is_a_replica() {
    let cluster = RedisCluster::start().await;
    new_keys_succeed_after_a_failover(Replicated::Cluster(&cluster), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_gateways_use_the_promoted_primary_while_the_old_one_is_down() {
    let set = RedisSentinelSet::start().await;
    new_keys_succeed_after_a_failover(Replicated::Sentinel(&set), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_gateways_use_the_promoted_primary_once_the_old_one_is_a_replica() {
    let set = RedisSentinelSet::start().await;
    new_keys_succeed_after_a_failover(Replicated::Sentinel(&set), true).await;
}
