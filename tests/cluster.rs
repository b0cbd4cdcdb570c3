//! The `redis-cluster` and `redis-sentinel` stores, against a real Redis Cluster (three
//! primaries, one replica each) and a real Sentinel set (a primary, a replica, three sentinels),
//! with failovers injected by `kill -9`.

mod common;

use std::time::{Duration, Instant};

use common::{wait_until, RedisCluster, RedisSentinelSet};
use redis::AsyncCommands;

// === the fixtures themselves, with redis-rs only ===

/// The cluster fixture: three primaries sharding the keys, a replica taking over a killed
/// primary's slots with its data, and the killed node back as a replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_fixture_shards_fails_over_and_takes_a_node_back() {
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
    // WAIT goes to every primary, over the connections the writes took.
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(2000)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(acked, 1, "every primary has its replica");
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
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(2000)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(acked, 1, "every primary has a replica again");
}

/// The Sentinel fixture: the sentinels promote the replica of a killed primary, and the killed
/// one comes back as its replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sentinel_fixture_fails_over_and_takes_the_old_primary_back() {
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
