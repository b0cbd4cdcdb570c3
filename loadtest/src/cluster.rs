//! Section `cluster`, scaling out: two gateway replicas on a Redis Cluster against the same two
//! on one Redis, and what `wait_replicas = 1` costs there.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;
use testkit::metrics::{errors_text, errorstats, info_counts, per_request, since};
use testkit::{panic_text, GatewayConfig, RedisCluster, RedisServer};

use crate::bench::{human, Bench, Row};
use crate::load::{self, Keys, Report};
use crate::metrics::round_trips;
use crate::procs::{self, Proc};

/// One measured setup: two gateways and the Redis processes behind them.
struct Setup {
    name: &'static str,
    addrs: Vec<SocketAddr>,
    admins: Vec<SocketAddr>,
    gateway_pids: Vec<u32>,
    redis_pids: Vec<u32>,
    /// The ports of the nodes that take the clients' commands (the primaries), and of their
    /// replicas.
    primaries: Vec<u16>,
    replicas: Vec<u16>,
    /// The replicas' processes, whose CPU is told apart from the primaries'.
    replica_pids: Vec<u32>,
}

impl Setup {
    fn new(name: &'static str, gateways: &[Proc], redis_pids: Vec<u32>) -> Setup {
        Setup {
            name,
            addrs: gateways.iter().map(|g| g.addr).collect(),
            admins: gateways.iter().filter_map(|g| g.admin).collect(),
            gateway_pids: gateways.iter().flat_map(Proc::pids).collect(),
            redis_pids,
            primaries: Vec::new(),
            replicas: Vec::new(),
            replica_pids: Vec::new(),
        }
    }

    fn round_trips(&self) -> u64 {
        self.admins.iter().map(|&a| round_trips(a)).sum()
    }
}

/// `INFO commandstats` of the nodes on `ports`: calls by command, summed.
async fn commandstats(ports: &[u16]) -> HashMap<String, u64> {
    info_counts(ports, "commandstats", "cmdstat_", "calls").await
}

/// `config` on `cluster`, two of its primaries as the seed nodes.
pub async fn on_two_primaries(config: GatewayConfig, cluster: &RedisCluster) -> GatewayConfig {
    let seeds: Vec<String> = cluster.primaries().await[..2]
        .iter()
        .map(|&i| format!("redis://127.0.0.1:{}", cluster.port(i)))
        .collect();
    config.redis_cluster_seeds(seeds)
}

/// A Redis fixture started, or why it did not start (its panic's message).
pub async fn started<T>(start: impl Future<Output = T>) -> Result<T, String> {
    AssertUnwindSafe(start)
        .catch_unwind()
        .await
        .map_err(|e| panic_text(&*e))
}

/// Two gateways with `config`, on one store.
pub async fn two_gateways(config: &GatewayConfig) -> Vec<Proc> {
    vec![procs::gateway(config).await, procs::gateway(config).await]
}

/// Warm up, then one measured closed-loop phase through `setup`'s gateways with the Redis
/// round trips and commands per request noted; a row of the table.
async fn phase(b: &mut Bench, setup: &Setup, scenario: &str, keys: Keys) -> usize {
    let keys = b.warm_up(&setup.addrs, keys, "cluster-miss").await;
    let before = (
        setup.round_trips(),
        commandstats(&setup.primaries).await,
        commandstats(&setup.replicas).await,
    );
    b.redis_pids = setup.redis_pids.clone();
    let replica_cpu = procs::cpu_ns(&setup.replica_pids);
    let r = b
        .closed_spread(&setup.addrs, keys, &setup.gateway_pids)
        .await;
    let replica_cpu = procs::cpu_ns(&setup.replica_pids).saturating_sub(replica_cpu) as f64
        / 1e3
        / r.requests.max(1) as f64;
    let after = (
        setup.round_trips(),
        commandstats(&setup.primaries).await,
        commandstats(&setup.replicas).await,
    );
    let trips = after.0.saturating_sub(before.0) as f64 / r.requests.max(1) as f64;
    let mut note = format!(
        "{} body, {scenario}: {trips:.2} Redis round trips per request (both gateways' store operations not answered by their local cache); Redis commands per request, incl. those run inside the scripts, on the {}: {}",
        human(b.size),
        if setup.replicas.is_empty() { "one Redis".to_string() } else { format!("{} primaries", setup.primaries.len()) },
        per_request(&before.1, &after.1, r.requests)
    );
    if !setup.replicas.is_empty() {
        let redis_cpu = r.cpu.map_or(0.0, |c| c.redis);
        note.push_str(&format!(
            "; on their {} replicas (the replication stream): {}; Redis CPU per request {:.1} µs on the primaries, {replica_cpu:.1} on the replicas",
            setup.replicas.len(),
            per_request(&before.2, &after.2, r.requests),
            redis_cpu - replica_cpu,
        ));
    }
    b.notes.push(note);
    b.check(scenario, &r, false);
    eprintln!(
        "  {scenario:<48} {:>9.0} req/s  p50 {:.2} ms  p99 {:.2} ms  {trips:.2} round trips",
        r.rps(),
        r.ms(0.5),
        r.ms(0.99)
    );
    b.rows.push(Row {
        scenario: scenario.to_string(),
        body: b.size,
        closed: r.clone(),
        samples: vec![r],
        at_rate: None,
    });
    b.rows.len() - 1
}

/// Section `cluster`: miss and replay throughput through two gateway replicas on a Redis
/// Cluster of 3 primaries and 3 replicas against the same two gateways on one standalone Redis,
/// and the miss with `wait_replicas = 1` on the cluster; rounds interleaved; the Redis round
/// trips and commands per request, and the MOVED/ASK redirections over every node (must be 0).
pub async fn run(b: &mut Bench, quick: bool) {
    // With --quick, a smoke run: 0.5 s phases.
    let secs = b.secs;
    if quick {
        b.secs = b.secs.min(Duration::from_millis(500));
    }
    b.size = 1024;
    b.request = load::small_request();
    let cluster = match started(RedisCluster::start()).await {
        Ok(c) => c,
        Err(e) => {
            b.insane.push(format!("cluster: {e}"));
            b.secs = secs;
            return;
        }
    };
    let all_nodes = cluster.ports();
    // What the cluster's making left (redis-cli's retried CLUSTER REPLICATE): not counted.
    let errors_before = errorstats(&all_nodes).await;
    let standalone = RedisServer::start().await;
    let up = procs::upstream(b.size, 0);
    b.upstream_pids = up.pids();
    let prefix = format!("c{}:", b.prefix("cl"));
    let config = procs::config(up.addr);
    let on_redis = two_gateways(&config.clone().redis_url(&standalone.url()).prefix(&prefix)).await;
    let config = on_two_primaries(config, &cluster).await.prefix(&prefix);
    let (on_cluster, waiting) = (
        two_gateways(&config).await,
        two_gateways(&config.set("store.wait_replicas", 1)).await,
    );
    let p = cluster.primaries().await;
    let replica_nodes: Vec<usize> = (0..all_nodes.len()).filter(|i| !p.contains(i)).collect();
    let primaries: Vec<u16> = p.iter().map(|&i| cluster.port(i)).collect();
    let replicas: Vec<u16> = replica_nodes.iter().map(|&i| cluster.port(i)).collect();
    let replica_pids: Vec<u32> = replica_nodes
        .iter()
        .filter_map(|&i| cluster.pid(i))
        .collect();
    let redis_pids: Vec<u32> = standalone.pid().into_iter().collect();
    let mut s_redis = Setup::new("redis", &on_redis, redis_pids);
    s_redis.primaries = vec![standalone.port];
    let mut s_cluster = Setup::new("redis-cluster", &on_cluster, cluster.pids());
    s_cluster.primaries = primaries.clone();
    s_cluster.replicas = replicas.clone();
    s_cluster.replica_pids = replica_pids.clone();
    let mut s_wait = Setup::new("redis-cluster, wait_replicas 1", &waiting, cluster.pids());
    s_wait.primaries = primaries;
    s_wait.replicas = replicas;
    s_wait.replica_pids = replica_pids;

    let hot = |s: &Setup| Keys::Hot(format!("hot-{}", s.name), 1000);
    let scenarios: Vec<(String, &Setup, bool)> = vec![
        ("2 gateways miss, redis".into(), &s_redis, true),
        ("2 gateways miss, redis-cluster".into(), &s_cluster, true),
        (
            "2 gateways miss, redis-cluster, wait_replicas 1".into(),
            &s_wait,
            true,
        ),
        ("2 gateways replay, redis".into(), &s_redis, false),
        ("2 gateways replay, redis-cluster".into(), &s_cluster, false),
    ];
    let mut rows = Vec::new();
    for (scenario, setup, miss) in &scenarios {
        let keys = if *miss {
            Keys::Unique(String::new())
        } else {
            hot(setup)
        };
        rows.push(phase(b, setup, scenario, keys).await);
    }
    for round in 1..b.rounds {
        for ((scenario, setup, miss), &i) in scenarios.iter().zip(&rows) {
            let keys = if *miss {
                Keys::Unique(b.prefix("cluster-miss"))
            } else {
                hot(setup)
            };
            b.redis_pids = setup.redis_pids.clone();
            let r = b
                .closed_spread(&setup.addrs, keys, &setup.gateway_pids)
                .await;
            b.check(&format!("{scenario} (round {})", round + 1), &r, false);
            eprintln!(
                "  {scenario:<48} {:>9.0} req/s  (round {})",
                r.rps(),
                round + 1
            );
            b.rows[i].samples.push(r);
        }
    }
    for &i in &rows {
        let mut samples = b.rows[i].samples.clone();
        samples.sort_by(|x, y| x.rps().total_cmp(&y.rps()));
        b.rows[i].closed = samples[samples.len() / 2].clone();
    }

    // The ratios, each with the one the CPU per request of all processes predicts.
    let median = |i: usize, f: &dyn Fn(&Report) -> f64| {
        let mut v: Vec<f64> = b.rows[i].samples.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let all_cpu = |r: &Report| r.cpu.map_or(0.0, |c| c.all());
    let gw_cpu = |r: &Report| r.cpu.map_or(0.0, |c| c.proxy);
    let redis_cpu = |r: &Report| r.cpu.map_or(0.0, |c| c.redis);
    let ratio = |a: usize, z: usize| {
        let (ra, rz) = (median(a, &Report::rps), median(z, &Report::rps));
        let (ca, cz) = (median(a, &all_cpu), median(z, &all_cpu));
        format!(
            "{:.2} [CPU {:.2}]",
            ra / rz.max(f64::MIN_POSITIVE),
            cz / ca.max(f64::MIN_POSITIVE)
        )
    };
    let errors = since(&errors_before, errorstats(&all_nodes).await);
    let redirections =
        errors.get("MOVED").copied().unwrap_or(0) + errors.get("ASK").copied().unwrap_or(0);
    if redirections > 0 {
        b.insane.push(format!(
            "cluster: {redirections} MOVED/ASK redirections over the 6 nodes (errors: {})",
            errors_text(&errors)
        ));
    }
    b.notes.push(format!(
        "cluster (1 KiB, 2 gateways, {} rounds; a cluster of 3 primaries + 3 replicas against one standalone Redis): miss cluster / standalone = {}, replay cluster / standalone = {}; on the cluster, miss with wait_replicas 1 / 0 = {}, gateway CPU per miss {:.1} µs with 1 against {:.1} with 0 (Redis, all 6 nodes: {:.1} against {:.1}); standalone miss: gateways {:.1}, Redis {:.1} µs; error replies over the cluster's nodes for the whole section: {} (MOVED + ASK = {redirections})",
        b.rounds,
        ratio(rows[1], rows[0]),
        ratio(rows[4], rows[3]),
        ratio(rows[2], rows[1]),
        median(rows[2], &gw_cpu),
        median(rows[1], &gw_cpu),
        median(rows[2], &redis_cpu),
        median(rows[1], &redis_cpu),
        median(rows[0], &gw_cpu),
        median(rows[0], &redis_cpu),
        errors_text(&errors),
    ));
    drop((on_redis, on_cluster, waiting, up, standalone, cluster));
    b.redis_pids = Vec::new();
    b.secs = secs;
}
