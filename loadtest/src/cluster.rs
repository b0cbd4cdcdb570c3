//! Scaling out: two gateway replicas on a Redis Cluster against the same two on one Redis, and
//! what `wait_replicas = 1` costs there (section `cluster`); a primary killed with SIGKILL under
//! keyed requests with retries, on a cluster and on a Sentinel set (section `failover`).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::load::{self, Keys, Live, Report};
use crate::procs::{self, Cluster, Proc, RedisNode, SentinelSet};
use crate::{human, round_trips, Bench, Row};

/// One measured setup: two gateways and the Redis processes behind them.
struct Setup {
    name: &'static str,
    addrs: Vec<SocketAddr>,
    admins: Vec<SocketAddr>,
    gateway_pids: Vec<u32>,
    redis_pids: Vec<u32>,
    /// The nodes that take the clients' commands (the primaries), and their replicas.
    primaries: Vec<SocketAddr>,
    replicas: Vec<SocketAddr>,
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

/// `INFO <section>` of each node, its `<prefix><name>:...,<field>=<n>,...` lines summed by name.
fn info_counts(
    nodes: &[SocketAddr],
    section: &str,
    prefix: &str,
    field: &str,
) -> HashMap<String, u64> {
    let mut sum = HashMap::new();
    for &node in nodes {
        let Ok(text) = procs::query::<String>(node, redis::cmd("INFO").arg(section)) else {
            continue;
        };
        for l in text.lines() {
            let Some((name, rest)) = l.strip_prefix(prefix).and_then(|l| l.split_once(':')) else {
                continue;
            };
            let n = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix(field)?.strip_prefix('='))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            *sum.entry(name.to_string()).or_default() += n;
        }
    }
    sum
}

fn commandstats(nodes: &[SocketAddr]) -> HashMap<String, u64> {
    info_counts(nodes, "commandstats", "cmdstat_", "calls")
}

/// Error replies by their first word (MOVED, ASK, CLUSTERDOWN, ...), of each node.
fn errorstats(nodes: &[SocketAddr]) -> Vec<HashMap<String, u64>> {
    nodes
        .iter()
        .map(|&n| info_counts(&[n], "errorstats", "errorstat_", "count"))
        .collect()
}

/// Commands answered with an error, by command, of each node: `<command> rejected` (refused
/// before running: a redirection, READONLY, CLUSTERDOWN) and `<command> failed` (an error
/// while running).
fn failed_commands(nodes: &[SocketAddr]) -> Vec<HashMap<String, u64>> {
    nodes
        .iter()
        .map(|&n| {
            let mut m = HashMap::new();
            for field in ["rejected", "failed"] {
                let calls =
                    info_counts(&[n], "commandstats", "cmdstat_", &format!("{field}_calls"));
                m.extend(calls.into_iter().map(|(k, v)| (format!("{k} {field}"), v)));
            }
            m
        })
        .collect()
}

/// `name n, ...` of the commands run per request between two `commandstats`, most first.
fn per_request(
    before: &HashMap<String, u64>,
    after: &HashMap<String, u64>,
    requests: u64,
) -> String {
    let mut parts: Vec<(&String, f64)> = after
        .iter()
        .map(|(k, v)| {
            let d = v.saturating_sub(before.get(k).copied().unwrap_or(0));
            (k, d as f64 / requests.max(1) as f64)
        })
        .filter(|(k, v)| *v > 0.001 && !matches!(k.as_str(), "info" | "ping"))
        .collect();
    parts.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    let parts: Vec<String> = parts.iter().map(|(k, v)| format!("{k} {v:.2}")).collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

/// The error replies of [`errorstats`] `after` less `before`, summed over the nodes. A count
/// lower than before is a node started again (its counts start from 0): all of it is new.
fn since(
    before: &[HashMap<String, u64>],
    after: Vec<HashMap<String, u64>>,
) -> HashMap<String, u64> {
    let mut sum: HashMap<String, u64> = HashMap::new();
    for (b, a) in before.iter().zip(after) {
        for (k, v) in a {
            let was = b.get(&k).copied().unwrap_or(0);
            *sum.entry(k).or_default() += if v >= was { v - was } else { v };
        }
    }
    sum
}

fn errors_text(errors: &HashMap<String, u64>) -> String {
    let mut e: Vec<String> = errors
        .iter()
        .filter(|(_, &n)| n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    e.sort();
    if e.is_empty() {
        "none".into()
    } else {
        e.join(", ")
    }
}

/// The `[store]` table of a standalone Redis.
fn standalone_toml(node: &Proc) -> String {
    format!("backend = \"redis\"\nurl = \"redis://{}\"", node.addr)
}

/// Two gateways on `store` (a `[store]` table's body) in front of `upstream`.
fn two_gateways(dir: &Path, store: &str, upstream: SocketAddr, prefix: &str) -> Vec<Proc> {
    (0..2)
        .map(|_| procs::gateway_with_prefix(dir, store, upstream, "", prefix))
        .collect()
}

/// Warm up, then one measured closed-loop phase through `setup`'s gateways with the Redis
/// round trips and commands per request noted; a row of the table.
async fn phase(b: &mut Bench, setup: &Setup, scenario: &str, keys: Keys) -> usize {
    let keys = b.warm_up(&setup.addrs, keys, "cluster-miss").await;
    let before = (
        setup.round_trips(),
        commandstats(&setup.primaries),
        commandstats(&setup.replicas),
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
        commandstats(&setup.primaries),
        commandstats(&setup.replicas),
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
pub async fn throughput(b: &mut Bench, dir: &Path, quick: bool) {
    // With --quick, a smoke run: 0.5 s phases.
    let secs = b.secs;
    if quick {
        b.secs = b.secs.min(Duration::from_millis(500));
    }
    b.size = 1024;
    b.request = load::small_request();
    let cluster_dir = dir.join("cluster-bench");
    let cluster = match tokio::task::spawn_blocking(move || Cluster::start(&cluster_dir, 3))
        .await
        .unwrap()
    {
        Ok(c) => c,
        Err(e) => {
            b.insane.push(format!("cluster: {e}"));
            b.secs = secs;
            return;
        }
    };
    let all_nodes: Vec<SocketAddr> = cluster.nodes.iter().map(|n| n.addr).collect();
    // What the cluster's making left (redis-cli's retried CLUSTER REPLICATE): not counted.
    let errors_before = errorstats(&all_nodes);
    let standalone = procs::redis(dir);
    let up = procs::upstream(b.size, 0);
    b.upstream_pids = up.pids();
    let prefix = format!("c{}:", b.prefix("cl"));
    let on_redis = two_gateways(dir, &standalone_toml(&standalone), up.addr, &prefix);
    let on_cluster = two_gateways(dir, &cluster.store_toml(), up.addr, &prefix);
    let waiting = two_gateways(
        dir,
        &format!("{}\nwait_replicas = 1", cluster.store_toml()),
        up.addr,
        &prefix,
    );
    let p = cluster.primaries();
    let replica_nodes: Vec<&RedisNode> = (0..cluster.nodes.len())
        .filter(|i| !p.contains(i))
        .map(|i| &cluster.nodes[i])
        .collect();
    let primaries: Vec<SocketAddr> = p.iter().map(|&i| cluster.nodes[i].addr).collect();
    let replicas: Vec<SocketAddr> = replica_nodes.iter().map(|n| n.addr).collect();
    let replica_pids: Vec<u32> = replica_nodes.iter().flat_map(|n| n.pids()).collect();
    let mut s_redis = Setup::new("redis", &on_redis, standalone.pids());
    s_redis.primaries = vec![standalone.addr];
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
    let errors = since(&errors_before, errorstats(&all_nodes));
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

// === failover ===

enum Topology {
    Cluster(Cluster),
    Sentinel(SentinelSet),
}

impl Topology {
    fn store_toml(&self) -> String {
        match self {
            Topology::Cluster(c) => c.store_toml(),
            Topology::Sentinel(s) => s.store_toml(),
        }
    }

    fn nodes(&self) -> &[RedisNode] {
        match self {
            Topology::Cluster(c) => &c.nodes,
            Topology::Sentinel(s) => &s.nodes,
        }
    }
}

/// What the supervisor did and saw, in time from the load's start.
#[derive(Default, Debug)]
struct Timeline {
    kill: Duration,
    killed: Option<SocketAddr>,
    /// The replica seen as the primary (the cluster's own view, or the sentinels').
    promoted: Option<Duration>,
    /// The killed node started again as a replica.
    restarted: Option<Duration>,
    /// The restarted node replicating (`master_link_status:up`).
    synced: Option<Duration>,
    error: Option<String>,
}

/// `kill -9` the primary (on a cluster, the one the gateways have as their first seed node),
/// wait for the failover, then start the killed node again as a replica (a cluster node with its
/// directory and nodes.conf, so it rejoins and follows its promoted replica; a Sentinel set's
/// with `--replicaof` the new primary), and wait for it to be in sync.
fn supervise(topology: &mut Topology, live: &Live) -> Timeline {
    let mut t = Timeline::default();
    let since = |live: &Live| live.start.elapsed();
    match topology {
        Topology::Cluster(cluster) => {
            let Some(&victim) = cluster.primaries().first() else {
                t.error = Some("no primary found".into());
                return t;
            };
            let Some(replica) = cluster.replica_of(victim) else {
                t.error = Some("the primary has no replica".into());
                return t;
            };
            t.killed = Some(cluster.nodes[victim].addr);
            t.kill = since(live);
            cluster.nodes[victim].kill9();
            if let Err(e) = procs::wait_until("the replica promoted", 30, || {
                cluster.nodes[replica].is_primary() == Some(true)
            }) {
                t.error = Some(e);
                return t;
            }
            t.promoted = Some(since(live));
            cluster.nodes[victim].restart(&[]);
            t.restarted = Some(since(live));
            if let Err(e) = wait_synced(&cluster.nodes[victim]) {
                t.error = Some(e);
                return t;
            }
            t.synced = Some(since(live));
        }
        Topology::Sentinel(set) => {
            let Some(primary) = set.primary_addr() else {
                t.error = Some("no sentinel answers".into());
                return t;
            };
            let Some(victim) = set.nodes.iter().position(|n| n.addr == primary) else {
                t.error = Some(format!("the sentinels' primary {primary} is not ours"));
                return t;
            };
            let other = set.nodes[1 - victim].addr;
            t.killed = Some(primary);
            t.kill = since(live);
            set.nodes[victim].kill9();
            if let Err(e) = procs::wait_until("the sentinels' failover", 30, || {
                set.primary_addr() == Some(other)
            }) {
                t.error = Some(e);
                return t;
            }
            t.promoted = Some(since(live));
            let port = other.port().to_string();
            set.nodes[victim].restart(&["--replicaof".into(), "127.0.0.1".into(), port]);
            t.restarted = Some(since(live));
            if let Err(e) = wait_synced(&set.nodes[victim]) {
                t.error = Some(e);
                return t;
            }
            t.synced = Some(since(live));
        }
    }
    t
}

fn wait_synced(node: &RedisNode) -> Result<(), String> {
    procs::wait_until("the restarted node in sync", 30, || {
        node.info("replication").is_some_and(|r| {
            r.get("role").is_some_and(|v| v == "slave")
                && r.get("master_link_status").is_some_and(|v| v == "up")
        })
    })
}

/// Section `failover`: for a cluster and a Sentinel set, each with `wait_replicas` 1 and 0 (with
/// `--quick`, the cluster with 1 only), or the runs `--failover` names.
pub async fn failover(b: &mut Bench, dir: &Path, quick: bool, runs: &[String]) {
    let default: &[&str] = if quick {
        &["redis-cluster:1"]
    } else {
        &[
            "redis-cluster:1",
            "redis-cluster:0",
            "redis-sentinel:1",
            "redis-sentinel:0",
        ]
    };
    let runs: Vec<&str> = if runs.is_empty() {
        default.to_vec()
    } else {
        runs.iter().map(String::as_str).collect()
    };
    for run in runs {
        let parsed = run
            .split_once(':')
            .and_then(|(kind, wait)| Some((kind, wait.parse::<u32>().ok()?)))
            .filter(|(kind, _)| matches!(*kind, "redis-cluster" | "redis-sentinel"));
        match parsed {
            Some((kind, wait)) => failover_run(b, dir, kind, wait, quick).await,
            None => b.insane.push(format!(
                "--failover {run}: not redis-cluster:N or redis-sentinel:N"
            )),
        }
    }
}

/// Clients retrying (each key until a 2xx), the pause after the last refusal that ends a run,
/// and the longest a run goes on after the kill.
const CLIENTS: usize = 16;
const BACKOFF: Duration = Duration::from_millis(50);
const QUIET: Duration = Duration::from_secs(2);
const CAP: Duration = Duration::from_secs(40);

async fn failover_run(b: &mut Bench, dir: &Path, kind: &str, wait: u32, quick: bool) {
    let label = format!("failover, {kind}, wait_replicas {wait}");
    let d: PathBuf = dir.join(b.prefix("failover"));
    let sentinel = kind == "redis-sentinel";
    let topology = tokio::task::spawn_blocking(move || {
        if sentinel {
            SentinelSet::start(&d).map(Topology::Sentinel)
        } else {
            Cluster::start(&d, 3).map(Topology::Cluster)
        }
    })
    .await
    .unwrap();
    let mut topology = match topology {
        Ok(t) => t,
        Err(e) => {
            b.insane.push(format!("{label}: {e}"));
            return;
        }
    };
    let up = procs::upstream_with(1024, 0, true);
    let store = format!("{}\nwait_replicas = {wait}", topology.store_toml());
    let gateways = two_gateways(dir, &store, up.addr, "fo:");
    let addrs: Vec<SocketAddr> = gateways.iter().map(|g| g.addr).collect();
    let all_nodes: Vec<SocketAddr> = topology.nodes().iter().map(|n| n.addr).collect();
    let errors_before = errorstats(&all_nodes);
    let failed_before = failed_commands(&all_nodes);

    let live = Live::new();
    let clients = tokio::spawn(load::run_retrying(
        addrs,
        b.prefix("fo-key"),
        CLIENTS,
        BACKOFF,
        live.clone(),
    ));
    tokio::time::sleep(if quick {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(3)
    })
    .await;
    let before_kill = live.succeeded.load(Ordering::Relaxed);
    let supervisor = {
        let live = live.clone();
        std::thread::spawn(move || {
            let t = supervise(&mut topology, &live);
            (topology, t)
        })
    };
    // The nodes' error replies every 250 ms, to tell when each kind was answered.
    let sampler = {
        let (live, nodes, before) = (live.clone(), all_nodes.clone(), errors_before.clone());
        std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !live.stop.load(Ordering::Relaxed) {
                let at = live.start.elapsed();
                samples.push((at, since(&before, errorstats(&nodes))));
                std::thread::sleep(Duration::from_millis(250));
            }
            samples
        })
    };
    // Until the supervisor is done, and then no refusal for QUIET; at most CAP after the kill.
    let quiet_for = if quick { QUIET / 2 } else { QUIET };
    let started = live.start.elapsed();
    let capped = loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = live.start.elapsed();
        let quiet = now.saturating_sub(Duration::from_millis(
            live.last_refusal_ms.load(Ordering::Relaxed),
        ));
        if supervisor.is_finished() && quiet >= quiet_for {
            break false;
        }
        if now - started > CAP {
            break true;
        }
    };
    live.stop.store(true, Ordering::Relaxed);
    let report = clients.await.unwrap();
    let (topology, t) = tokio::task::spawn_blocking(move || supervisor.join().unwrap())
        .await
        .unwrap();
    let samples = tokio::task::spawn_blocking(move || sampler.join().unwrap())
        .await
        .unwrap();
    let errors = since(&errors_before, errorstats(&all_nodes));
    let failed = since(&failed_before, failed_commands(&all_nodes));
    // Each kind of error reply with the window in which its count grew, from the kill.
    let error_windows: Vec<String> = {
        let mut kinds: Vec<&String> = errors
            .iter()
            .filter(|(_, &n)| n > 0)
            .map(|(k, _)| k)
            .collect();
        kinds.sort();
        kinds
            .into_iter()
            .map(|k| {
                let mut prev = 0;
                let (mut first, mut last) = (None, None);
                for (at, e) in &samples {
                    let n = e.get(k).copied().unwrap_or(0);
                    if n > prev {
                        first.get_or_insert(*at);
                        last = Some(*at);
                        prev = n;
                    }
                }
                let rel = |d: Option<Duration>| {
                    d.map_or("?".into(), |d| {
                        format!("{:+.2}", d.as_secs_f64() - t.kill.as_secs_f64())
                    })
                };
                format!("{k} {} (seen {} to {} s)", errors[k], rel(first), rel(last))
            })
            .collect()
    };
    let (keys_executed, executions, twice) = upstream_keys(up.addr).await;
    drop(gateways);
    drop(topology);

    let after_kill: Vec<&load::Attempt> =
        report.attempts.iter().filter(|a| a.end > t.kill).collect();
    let refused: Vec<&&load::Attempt> = after_kill.iter().filter(|a| a.refused()).collect();
    let before: usize = report
        .attempts
        .iter()
        .filter(|a| a.end <= t.kill && a.refused())
        .count();
    let confirms_refused = refused.iter().filter(|a| a.confirm).count();
    // Refusals until the failover was seen, until the killed node was restarted, until it was
    // in sync, and after.
    let marks = [t.promoted, t.restarted, t.synced];
    let mut windows = [0u64; 4];
    for a in &refused {
        let w = marks
            .iter()
            .take_while(|m| m.is_some_and(|m| a.end > m))
            .count();
        windows[w] += 1;
    }
    let mut by_status: BTreeMap<u16, u64> = BTreeMap::new();
    for a in &refused {
        *by_status.entry(a.status).or_default() += 1;
    }
    let last_refusal = refused.iter().map(|a| a.end).max();
    let recovery = last_refusal.map_or(Duration::ZERO, |e| e - t.kill);
    // The store refusing (503, no answer) apart from keys left in flight (409): a record lost
    // with its primary keeps its key claimed until the lease ends.
    let last_of = |conflict: bool| {
        refused
            .iter()
            .filter(|a| (a.status == 409) == conflict)
            .map(|a| a.end)
            .max()
    };
    let (last_store, last_conflict) = (last_of(false), last_of(true));
    let longest = after_kill
        .iter()
        .map(|a| a.end - a.start)
        .max()
        .unwrap_or_default();
    let secs = |d: Option<Duration>| {
        d.map_or("never".into(), |d| {
            format!("{:+.2} s", d.as_secs_f64() - t.kill.as_secs_f64())
        })
    };
    let statuses: Vec<String> = by_status
        .iter()
        .map(|(s, n)| {
            if *s == 0 {
                format!("no answer {n}")
            } else {
                format!("{s} {n}")
            }
        })
        .collect();
    if let Some(e) = &t.error {
        b.insane.push(format!("{label}: supervisor: {e}"));
    }
    if capped {
        b.insane.push(format!(
            "{label}: keyed requests were still refused {} s after the kill",
            CAP.as_secs()
        ));
    }
    if wait >= 1 && twice > 0 {
        b.insane.push(format!(
            "{label}: {twice} keys executed twice by the upstream"
        ));
    }
    if before_kill == 0 {
        b.insane
            .push(format!("{label}: no key succeeded before the kill"));
    }
    // Refusals per second from the kill, through each gateway (for the eye: where they end).
    let mut per_second: BTreeMap<u64, [u64; 2]> = BTreeMap::new();
    for a in &refused {
        per_second.entry((a.end - t.kill).as_secs()).or_default()[a.replica.min(1)] += 1;
    }
    let timeline: Vec<String> = per_second
        .iter()
        .map(|(s, [x, y])| format!("{s}s: {x}+{y}"))
        .collect();
    eprintln!(
        "    refusals per second from the kill (gateway 1 + gateway 2): {}",
        timeline.join(", ")
    );
    // And the 2xx answers per quarter second around the failover.
    let mut ok: BTreeMap<u64, u64> = BTreeMap::new();
    for a in after_kill.iter().filter(|a| (200..300).contains(&a.status)) {
        *ok.entry((a.end - t.kill).as_millis() as u64 / 250)
            .or_default() += 1;
    }
    let ok: Vec<String> = (0..16)
        .map(|q| ok.get(&q).copied().unwrap_or(0).to_string())
        .collect();
    eprintln!("    2xx per 250 ms for 4 s from the kill: {}", ok.join(" "));
    eprintln!(
        "  {label:<40} recovered {:.2} s after the kill, {} refused, {twice} keys executed twice",
        recovery.as_secs_f64(),
        refused.len()
    );
    b.notes.push(format!(
        "{label} (1 KiB, 2 gateways, {CLIENTS} clients each retrying its key every {} ms on 503/409/502/504 until a 2xx, then once more on the other gateway; kill -9 of the primary {} at {:.1} s): failover seen {}, killed node restarted as a replica {}, in sync {}; keyed requests succeed again {:.2} s after the kill (the last refusal; the last 503 or unanswered {}, the last 409 {}); {} attempts refused ({}; {confirms_refused} of them retries after a 2xx; {} until the failover was seen, {} until the restart, {} until in sync, {} after) of {} after the kill, {before} before it (409s: a retry after a 2xx can reach the other gateway before the record is written); longest attempt {} ms; {} keys completed, {} unfinished at the stop, {} given up; upstream: {keys_executed} keys executed {executions} times, {twice} keys executed twice; error replies over the nodes: {}; the commands answered with them: {}",
        BACKOFF.as_millis(),
        t.killed.map_or("?".into(), |a| a.to_string()),
        t.kill.as_secs_f64(),
        secs(t.promoted),
        secs(t.restarted),
        secs(t.synced),
        recovery.as_secs_f64(),
        secs(last_store),
        secs(last_conflict),
        refused.len(),
        if statuses.is_empty() { "none".into() } else { statuses.join(", ") },
        windows[0],
        windows[1],
        windows[2],
        windows[3],
        after_kill.len(),
        longest.as_millis(),
        report.keys,
        report.unfinished,
        report.given_up,
        if error_windows.is_empty() { "none".into() } else { error_windows.join(", ") },
        errors_text(&failed),
    ));
}

/// The upstream's `GET /__keys`: keys executed, executions, keys executed more than once.
async fn upstream_keys(addr: SocketAddr) -> (u64, u64, u64) {
    let text = crate::get_text(addr, "/__keys").await;
    let v: Vec<u64> = text
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    match v[..] {
        [k, e, t] => (k, e, t),
        _ => (0, 0, 0),
    }
}
