//! Section `expiry`: what `after_expiry = "refuse"` costs a miss on Redis against the default
//! (`"run"`). Two gateways on the run's Redis, one route each, unique keys at the run's
//! connections; rounds interleaved, their order swapped every round. Per phase, the gateway's
//! own store operations (each one Redis round trip: a pipeline or a script call) and Redis's
//! commands (those run inside scripts included), per miss. Then (not with --quick) as many
//! rounds at one fixed rate for both, so that their CPU per miss is compared at the same load.

use std::collections::HashMap;

use redis::aio::MultiplexedConnection;

use crate::bench::{human, keep_round, medians, Bench};
use crate::load::{self, Keys, Pace, Report};
use testkit::metrics::commandstats;

use crate::metrics::{moved, store_operations};
use crate::procs::{self, Proc};

/// The routes' `after_expiry`, in the order of the rows.
const MODES: [&str; 2] = ["run", "refuse"];

/// What one miss phase moved on top of its report: the gateway's store operations by
/// operation, and Redis's calls and µs by command.
#[derive(Clone)]
struct Moved {
    requests: u64,
    ops: HashMap<String, u64>,
    commands: HashMap<String, u64>,
    usec: HashMap<String, u64>,
    // The times the gateway's threads, then Redis's, went to sleep.
    sleeps: (u64, u64),
}

impl Moved {
    fn round_trips(&self) -> f64 {
        self.ops.values().sum::<u64>() as f64 / self.requests.max(1) as f64
    }
}

/// Section `expiry`: the miss on Redis with `after_expiry = "run"` and `"refuse"`, side by
/// side; the ratios, the round trips and the commands per miss, with CPU per miss. `quick`
/// keeps the run's rounds (one); a full run has three at least, as the figure is a few per cent.
pub async fn run(
    b: &mut Bench,
    (redis_conn, redis_url): (&mut MultiplexedConnection, &str),
    quick: bool,
) {
    b.size = 1024;
    b.request = load::small_request();
    flush(redis_conn).await;
    let up = procs::upstream(b.size, 0);
    b.upstream_pids = up.pids();
    let mut gws: Vec<Proc> = Vec::new();
    for mode in MODES {
        let config = procs::config(up.addr)
            .redis_url(redis_url)
            .prefix("bench:")
            .route(
                "/v1/payments",
                toml::toml! { methods = ["POST"] after_expiry = mode },
            );
        gws.push(procs::gateway(&config).await);
    }
    let rounds = if quick { b.rounds } else { b.rounds.max(3) };
    let mut rows = Vec::new();
    let mut phases: Vec<Vec<(Report, Moved)>> = vec![Vec::new(); MODES.len()];
    for round in 0..rounds {
        // Swapped every round, so that neither always follows the other's load.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let (r, m) = phase(b, &gws[i], redis_conn, round == 0).await;
            phases[i].push((r.clone(), m));
            let scenario = format!("gateway miss, redis, after_expiry {}", MODES[i]);
            keep_round(b, &mut rows, (i, &scenario, round), r);
        }
    }
    medians(b, &rows);
    check(b, &phases);
    if rows.len() == MODES.len() {
        // Half the slower's maximum: both serve the same misses per second, so that their CPU
        // per miss is compared at the same load (it grows as the throughput falls).
        let rate = (rows
            .iter()
            .map(|&r| b.rows[r].closed.rps())
            .fold(f64::MAX, f64::min)
            / 2.0)
            .max(100.0);
        let paced = match quick {
            true => Vec::new(),
            false => at_one_rate(b, &gws, rate, rounds).await,
        };
        for (i, reports) in paced.iter().enumerate() {
            b.rows[rows[i]].at_rate = Some(reports[median_at(reports, gateway_cpu)].clone());
        }
        let mut note = note(b, &rows, &phases, rounds);
        if !paced.is_empty() {
            note.push_str(&paced_note(rate, &paced));
        }
        b.notes.push(note);
    }
    drop((gws, up));
    // The records and tombstones of the section are of no use to the next ones.
    flush(redis_conn).await;
}

/// Empty the run's Redis (for the sections that measure on it from empty).
pub async fn flush(conn: &mut MultiplexedConnection) {
    // ASYNC: freeing many records takes longer than the client's response timeout.
    let _: () = redis::cmd("FLUSHALL")
        .arg("ASYNC")
        .query_async(conn)
        .await
        .unwrap();
}

/// `rounds` rounds of misses at `rate` per second through each gateway, interleaved (order
/// swapped each round), each with its CPU per miss: their reports, by gateway.
async fn at_one_rate(b: &mut Bench, gws: &[Proc], rate: f64, rounds: usize) -> Vec<Vec<Report>> {
    let mut reports = vec![Vec::new(); gws.len()];
    for round in 0..rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let keys = Keys::Unique(b.prefix("exp-rate"));
            let r = b
                .measured(&[gws[i].addr], keys, &gws[i].pids(), Pace::Rate(rate))
                .await;
            let name = format!(
                "after_expiry {} at {rate:.0}/s (round {})",
                MODES[i],
                round + 1
            );
            b.check(&name, &r, false);
            eprintln!(
                "  {name:<52} p50 {:.2} ms  p99 {:.2} ms  gateway {:.1} µs/miss",
                r.ms(0.5),
                r.ms(0.99),
                gateway_cpu(&r)
            );
            reports[i].push(r);
        }
    }
    reports
}

fn gateway_cpu(r: &Report) -> f64 {
    r.cpu.map_or(0.0, |c| c.proxy)
}

/// The index of the report whose `f` is the median.
fn median_at(reports: &[Report], f: fn(&Report) -> f64) -> usize {
    let mut at: Vec<usize> = (0..reports.len()).collect();
    at.sort_by(|&x, &y| f(&reports[x]).total_cmp(&f(&reports[y])));
    at[at.len() / 2]
}

/// The note's part on the phases at one rate: gateway and Redis CPU per miss, and latency.
fn paced_note(rate: f64, paced: &[Vec<Report>]) -> String {
    let med = |i: usize, f: fn(&Report) -> f64| f(&paced[i][median_at(&paced[i], f)]);
    let redis = |r: &Report| r.cpu.map_or(0.0, |c| c.redis);
    let paired: Vec<String> = paced[0]
        .iter()
        .zip(&paced[1])
        .map(|(run, refuse)| {
            format!(
                "{:.3}",
                gateway_cpu(refuse) / gateway_cpu(run).max(f64::MIN_POSITIVE)
            )
        })
        .collect();
    format!(
        "; at {rate:.0} misses/s each (half the slower's maximum; medians of rounds): gateway CPU µs per miss run {:.1}, refuse {:.1}, refuse / run = {:.3} (goal <= 1.03), by round {}; Redis CPU µs per miss run {:.1}, refuse {:.1}; p50 ms run {:.2}, refuse {:.2}; p99 ms run {:.2}, refuse {:.2}",
        med(0, gateway_cpu),
        med(1, gateway_cpu),
        med(1, gateway_cpu) / med(0, gateway_cpu).max(f64::MIN_POSITIVE),
        paired.join(", "),
        med(0, redis),
        med(1, redis),
        med(0, |r| r.ms(0.5)),
        med(1, |r| r.ms(0.5)),
        med(0, |r| r.ms(0.99)),
        med(1, |r| r.ms(0.99)),
    )
}

/// One closed-loop miss phase through `gw` (warmed up first when `first`), with what the
/// gateway's store operations and Redis's command calls moved by over it.
async fn phase(
    b: &mut Bench,
    gw: &Proc,
    conn: &mut MultiplexedConnection,
    first: bool,
) -> (Report, Moved) {
    let keys = Keys::Unique(b.prefix("exp-miss"));
    let keys = match first {
        true => b.warm_up(&[gw.addr], keys, "exp-miss").await,
        false => keys,
    };
    let admin = gw.admin.expect("the gateway has an admin listener");
    let ops = store_operations(admin);
    let commands = commandstats(conn, "calls").await;
    let usec = commandstats(conn, "usec").await;
    let sleeps = || (procs::sleeps(&gw.pids()), procs::sleeps(&b.redis_pids));
    let slept = sleeps();
    let r = b.closed(gw.addr, keys, &gw.pids()).await;
    let now = sleeps();
    let slept = (now.0 - slept.0, now.1 - slept.1);
    let mut commands = moved(&commands, &commandstats(conn, "calls").await);
    let mut usec = moved(&usec, &commandstats(conn, "usec").await);
    // The harness's own INFO calls.
    commands.remove("info");
    usec.remove("info");
    let ops = moved(&ops, &store_operations(admin));
    let m = Moved {
        requests: r.requests,
        ops,
        commands,
        usec,
        sleeps: slept,
    };
    (r, m)
}

/// The sanity checks, none on a timing: two round trips per miss in every phase, and a
/// tombstone written per miss by `refuse` (one `SET` more than `run`).
fn check(b: &mut Bench, phases: &[Vec<(Report, Moved)>]) {
    for (mode, rounds) in MODES.iter().zip(phases) {
        for (round, (_, m)) in rounds.iter().enumerate() {
            let trips = m.round_trips();
            if (trips - 2.0).abs() > 0.01 {
                b.insane.push(format!(
                    "expiry: after_expiry {mode} (round {}): {trips:.3} Redis round trips per miss, not 2 ({:?})",
                    round + 1,
                    m.ops
                ));
            }
        }
    }
    let sets = |i: usize| per_miss(&phases[i], |m| m.commands.get("set").copied().unwrap_or(0));
    if sets(1) - sets(0) < 0.9 {
        b.insane.push(format!(
            "expiry: after_expiry refuse wrote {:.2} SETs per miss against run's {:.2}: no tombstone per miss",
            sets(1),
            sets(0)
        ));
    }
}

/// `count` of every phase over their misses.
fn per_miss(phases: &[(Report, Moved)], count: impl Fn(&Moved) -> u64) -> f64 {
    let n: u64 = phases.iter().map(|(_, m)| count(m)).sum();
    let misses: u64 = phases.iter().map(|(_, m)| m.requests).sum();
    n as f64 / misses.max(1) as f64
}

/// The median of `f` over the rounds.
fn median(phases: &[(Report, Moved)], f: impl Fn(&Report) -> f64) -> f64 {
    let mut v: Vec<f64> = phases.iter().map(|(r, _)| f(r)).collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The note: the ratios refuse / run, CPU per miss of each, round trips, Redis's commands and
/// their time per miss.
fn note(b: &Bench, rows: &[usize], phases: &[Vec<(Report, Moved)>], rounds: usize) -> String {
    let rps = |i: usize| b.rows[rows[i]].closed.rps();
    let cpu = |i: usize, f: fn(&load::CpuPerRequest) -> f64| {
        median(&phases[i], |r| r.cpu.as_ref().map_or(0.0, f))
    };
    let gw = |i: usize| cpu(i, |c| c.proxy);
    let all = |i: usize| cpu(i, load::CpuPerRequest::all);
    let paired: Vec<String> = phases[0]
        .iter()
        .zip(&phases[1])
        .map(|((run, _), (refuse, _))| {
            format!(
                "{:.3}",
                gateway_cpu(refuse) / gateway_cpu(run).max(f64::MIN_POSITIVE)
            )
        })
        .collect();
    let trips = |i: usize| -> String {
        let by_round: Vec<String> = phases[i]
            .iter()
            .map(|(_, m)| format!("{:.3}", m.round_trips()))
            .collect();
        let op = |name: &str| per_miss(&phases[i], |m| m.ops.get(name).copied().unwrap_or(0));
        format!(
            "{} by round (claim {:.3}, complete {:.3})",
            by_round.join(", "),
            op("claim"),
            op("complete")
        )
    };
    format!(
        "expiry ({} body, Redis, {} connections, {rounds} round{}, order swapped each round): refuse / run req/s = {:.3} [CPU {:.3}]; gateway CPU µs per miss (median of rounds): run {:.1}, refuse {:.1}, refuse / run = {:.3} (goal <= 1.03), by round {}; Redis CPU µs per miss: run {:.1}, refuse {:.1}; sleeps per miss (gateway's threads / Redis): run {:.2} / {:.2}, refuse {:.2} / {:.2}; Redis round trips per miss (the gateway's store operations / misses; goal 2): run {}, refuse {}; Redis commands per miss (those inside scripts included): run: {}; refuse: {}; Redis µs per miss in each command (evalsha's include its script's commands): run: {}; refuse: {}",
        human(b.size),
        b.connections,
        if rounds == 1 { "" } else { "s" },
        rps(1) / rps(0).max(f64::MIN_POSITIVE),
        all(0) / all(1).max(f64::MIN_POSITIVE),
        gw(0),
        gw(1),
        gw(1) / gw(0).max(f64::MIN_POSITIVE),
        paired.join(", "),
        cpu(0, |c| c.redis),
        cpu(1, |c| c.redis),
        per_miss(&phases[0], |m| m.sleeps.0),
        per_miss(&phases[0], |m| m.sleeps.1),
        per_miss(&phases[1], |m| m.sleeps.0),
        per_miss(&phases[1], |m| m.sleeps.1),
        trips(0),
        trips(1),
        by_command(&phases[0], |m| &m.commands),
        by_command(&phases[1], |m| &m.commands),
        by_command(&phases[0], |m| &m.usec),
        by_command(&phases[1], |m| &m.usec),
    )
}

/// `name n, ...` of what `of` counts by command, per miss over `phases`, largest first.
fn by_command(phases: &[(Report, Moved)], of: fn(&Moved) -> &HashMap<String, u64>) -> String {
    let mut names: Vec<&String> = phases.iter().flat_map(|(_, m)| of(m).keys()).collect();
    names.sort();
    names.dedup();
    let mut parts: Vec<(&String, f64)> = names
        .into_iter()
        .map(|k| (k, per_miss(phases, |m| of(m).get(k).copied().unwrap_or(0))))
        .filter(|(_, v)| *v > 0.001)
        .collect();
    parts.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    let parts: Vec<String> = parts.iter().map(|(k, v)| format!("{k} {v:.2}")).collect();
    parts.join(", ")
}
