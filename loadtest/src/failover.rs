//! Section `failover`: a primary killed with SIGKILL under keyed requests with retries, on a
//! Redis Cluster and on a Sentinel set, through two gateways; when each step of the recovery was
//! seen, what the clients were refused and when, and what the upstream executed twice.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use testkit::metrics::{errors_text, errorstats, failed_commands, since};
use testkit::{
    Failover, GatewayConfig, RedisCluster, RedisSentinelSet, Replicated, Steps, Supervision,
};

use crate::bench::Bench;
use crate::cluster::{on_two_primaries, started, two_gateways};
use crate::load::{self, Live};
use crate::metrics::executions_per_key;
use crate::procs;

/// What the supervisor did and saw, in time from the load's start.
#[derive(Default, Debug)]
struct Timeline {
    kill: Duration,
    killed: Option<SocketAddr>,
    /// The store seen failed over (the cluster's own view, or the sentinels').
    promoted: Option<Duration>,
    /// The killed node started again as a replica.
    restarted: Option<Duration>,
    /// The store healthy again, the restarted node replicating (`master_link_status:up`).
    synced: Option<Duration>,
    error: Option<String>,
}

impl Timeline {
    /// The steps `failover` saw, from `start`; `error` when the supervisor stopped short.
    fn of(failover: Option<&Failover<'_>>, start: Instant, error: Option<String>) -> Timeline {
        let Some(f) = failover else {
            return Timeline {
                error,
                ..Timeline::default()
            };
        };
        let from = |at: Option<Instant>| at.map(|at| at.saturating_duration_since(start));
        Timeline {
            kill: f.killed_at.saturating_duration_since(start),
            killed: Some(SocketAddr::from(([127, 0, 0, 1], f.killed_port()))),
            promoted: from(f.failed_over_at),
            restarted: from(f.restarted_at),
            synced: from(f.healthy_at),
            error,
        }
    }
}

/// `config` on `store` (a cluster seeded with two of its primaries).
async fn on(store: Replicated<'_>, config: GatewayConfig) -> GatewayConfig {
    match store {
        Replicated::Cluster(cluster) => on_two_primaries(config, cluster).await,
        Replicated::Sentinel(set) => config.redis_sentinel(set),
    }
}

/// Section `failover`: for a cluster and a Sentinel set, each with `wait_replicas` 1 and 0 (with
/// `--quick`, the cluster with 1 only), or the runs `--failover` names.
pub async fn run(b: &mut Bench, quick: bool, runs: &[String]) {
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
            Some((kind, wait)) => failover_run(b, kind, wait, quick).await,
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

async fn failover_run(b: &mut Bench, kind: &str, wait: u32, quick: bool) {
    let label = format!("failover, {kind}, wait_replicas {wait}");
    let (cluster, set);
    let store = if kind == "redis-sentinel" {
        set = match started(RedisSentinelSet::start()).await {
            Ok(set) => set,
            Err(e) => return b.insane.push(format!("{label}: {e}")),
        };
        Replicated::Sentinel(&set)
    } else {
        cluster = match started(RedisCluster::start()).await {
            Ok(cluster) => cluster,
            Err(e) => return b.insane.push(format!("{label}: {e}")),
        };
        Replicated::Cluster(&cluster)
    };
    under_load(b, store, &label, wait, quick).await;
}

/// Two gateways on `store` with `wait_replicas = wait`, the retrying clients on them, and a
/// primary killed once they are under way; the figures as a note, and what is wrong as insane.
async fn under_load(b: &mut Bench, store: Replicated<'_>, label: &str, wait: u32, quick: bool) {
    let up = procs::upstream_with(1024, 0, true);
    let config = on(store, procs::config(up.addr)).await;
    let gateways = two_gateways(&config.prefix("fo:").set("store.wait_replicas", wait)).await;
    let addrs: Vec<SocketAddr> = gateways.iter().map(|g| g.addr).collect();
    let all_nodes = store.data_ports();
    let errors_before = errorstats(&all_nodes).await;
    let failed_before = failed_commands(&all_nodes).await;

    let live = Live::new();
    let clients = tokio::spawn(load::run_retrying(
        addrs,
        b.prefix("fo-key"),
        CLIENTS,
        BACKOFF,
        live.clone(),
    ));
    // The nodes' error replies every 250 ms, to tell when each kind was answered.
    let sampler = async {
        let mut samples = Vec::new();
        while !live.stop.load(Ordering::Relaxed) {
            let at = live.start.elapsed();
            samples.push((at, since(&errors_before, errorstats(&all_nodes).await)));
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        samples
    };
    let load = async {
        let (report, samples) = tokio::join!(clients, sampler);
        (report.unwrap(), samples)
    };
    let (before_kill, watched_from, capped) =
        (Cell::new(0), Cell::new(Duration::ZERO), Cell::new(false));
    // The supervisor kills -9 the primary (on a cluster, the first seed node the gateways have)
    // once the clients are under way, sees the failover, starts the killed node again as a
    // replica and sees the store healthy; the clients go on until no refusal for QUIET, at most
    // CAP after the kill.
    let steps = Steps {
        under_way: async || {
            let pause = match quick {
                true => Duration::from_millis(500),
                false => Duration::from_secs(3),
            };
            tokio::time::sleep(pause).await;
            before_kill.set(live.succeeded.load(Ordering::Relaxed));
            watched_from.set(live.start.elapsed());
        },
        failed_over: async || {},
        recovered: async |_: &Supervision<'_>| {
            let quiet_for = if quick { QUIET / 2 } else { QUIET };
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let now = live.start.elapsed();
                let quiet = now.saturating_sub(Duration::from_millis(
                    live.last_refusal_ms.load(Ordering::Relaxed),
                ));
                if quiet >= quiet_for {
                    break;
                }
                if now - watched_from.get() > CAP {
                    capped.set(true);
                    break;
                }
            }
        },
    };
    let ((report, mut samples), supervision) =
        store.under_load(None, load, &live.stop, steps).await;
    let (before_kill, capped) = (before_kill.get(), capped.get());
    // When each kind of error reply was seen, from the supervisor's start on: replies before it
    // (a script loaded at the first request) are not the failover's.
    samples.retain(|(at, _)| *at >= watched_from.get());
    let t = Timeline::of(supervision.failover.as_ref(), live.start, supervision.error);
    let errors = since(&errors_before, errorstats(&all_nodes).await);
    let failed = since(&failed_before, failed_commands(&all_nodes).await);
    let run = Run {
        error_windows: error_windows(&errors, &samples, t.kill),
        upstream: executions_per_key(up.addr).await,
        t,
        report,
        before_kill,
        capped,
        failed,
    };
    drop(gateways);
    figures(b, label, wait, run);
}

/// What one failover run saw.
struct Run {
    t: Timeline,
    report: load::RetryReport,
    /// Keys that succeeded before the kill.
    before_kill: u64,
    /// Whether keyed requests were still refused [`CAP`] after the kill.
    capped: bool,
    /// The upstream's keys executed, executions, and keys executed twice.
    upstream: (u64, u64, u64),
    /// Each kind of error reply the nodes answered, and when.
    error_windows: Vec<String>,
    /// The commands answered with an error.
    failed: HashMap<String, u64>,
}

/// The figures of `run`: refusals by window and status, recovery, duplicates; printed, as a
/// note, and what is wrong as insane.
fn figures(b: &mut Bench, label: &str, wait: u32, run: Run) {
    let Run {
        t,
        report,
        before_kill,
        capped,
        upstream: (keys_executed, executions, twice),
        error_windows,
        failed,
    } = run;
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

/// Each kind of error reply in `errors` with the window in which its count grew in `samples`,
/// in seconds from the kill.
fn error_windows(
    errors: &HashMap<String, u64>,
    samples: &[(Duration, HashMap<String, u64>)],
    kill: Duration,
) -> Vec<String> {
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
            for (at, e) in samples {
                let n = e.get(k).copied().unwrap_or(0);
                if n > prev {
                    first.get_or_insert(*at);
                    last = Some(*at);
                    prev = n;
                }
            }
            let rel = |d: Option<Duration>| {
                d.map_or("?".into(), |d| {
                    format!("{:+.2}", d.as_secs_f64() - kill.as_secs_f64())
                })
            };
            format!("{k} {} (seen {} to {} s)", errors[k], rel(first), rel(last))
        })
        .collect()
}
