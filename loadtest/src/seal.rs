//! Section `seal`: what sealing records at rest (`[store] seal = "on"`) costs against `"off"` on
//! Redis, at each body size: the miss (the record sealed), the replay served from the process's
//! local cache (which keeps opened responses: no record opened), and the replay with
//! `local_cache = "0"` (every replay reads the record from Redis and opens it). Per size, four
//! gateways on the run's Redis, each under its own key prefix and all with the same key in
//! `IDEMGATE_SEAL_KEYS`: off and on, with the default local cache and without. Rounds
//! interleaved, the two modes of a scenario one after the other, their order swapped every
//! round; req/s and CPU per request of each, and the ratios on / off.

use std::net::SocketAddr;

use redis::aio::MultiplexedConnection;

use crate::bench::{human, keep_round, medians, Bench};
use crate::expiry::flush;
use crate::load::{self, CpuPerRequest, Keys, Report};
use crate::metrics::{executions, round_trips};
use crate::procs::{self, Proc};

/// The gateways' `seal`, in the order of the rows.
const MODES: [&str; 2] = ["off", "on"];

/// The sealing key every gateway of the section is given: fixed, as the benchmark's records are
/// no secret.
const SEAL_KEYS: &str = "bench:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

/// The keys the replay phases cycle over, each run once before the first phase: few enough
/// that their 64 KiB responses stay well inside the local cache's default 64 MiB.
const HOT: u64 = 200;
const HOT_PREFIX: &str = "seal-hot";

/// What a pair of rows sends, and to which pair of gateways.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// Unique keys: the record sealed (on) or not (off) and written.
    Miss,
    /// The hot keys, through the gateways with the default local cache.
    Replay,
    /// The hot keys, through the gateways with `local_cache = "0"`.
    ReplayUncached,
}

impl Scenario {
    const ALL: [Scenario; 3] = [Scenario::Miss, Scenario::Replay, Scenario::ReplayUncached];

    fn name(self) -> &'static str {
        match self {
            Scenario::Miss => "miss",
            Scenario::Replay => "replay",
            Scenario::ReplayUncached => "replay, local_cache 0",
        }
    }

    /// Whether its gateways keep the default local cache.
    fn cached(self) -> bool {
        self != Scenario::ReplayUncached
    }

    /// Redis round trips per request its gateways should make (none: answered by the cache).
    fn round_trips(self) -> f64 {
        match self {
            Scenario::Miss => 2.0,
            Scenario::Replay => 0.0,
            Scenario::ReplayUncached => 1.0,
        }
    }
}

/// One measured phase: its report, and what it moved besides.
#[derive(Clone)]
struct Phase {
    report: Report,
    // Executions of the upstream over the phase (a replay makes none).
    executed: u64,
    // The gateway's Redis round trips per request (store operations less local cache hits).
    round_trips: f64,
}

/// The gateways of one body size, `[off, on]` each.
struct Gateways {
    cached: Vec<Proc>,
    uncached: Vec<Proc>,
}

impl Gateways {
    async fn start(redis_url: &str, upstream: SocketAddr) -> Gateways {
        let mut gateways = Gateways {
            cached: Vec::new(),
            uncached: Vec::new(),
        };
        for cached in [true, false] {
            for mode in MODES {
                let config = procs::config(upstream)
                    .redis_url(redis_url)
                    .seal(mode, SEAL_KEYS);
                let config = match cached {
                    true => config.prefix(&format!("seal-{mode}-cached:")),
                    false => config
                        .prefix(&format!("seal-{mode}-uncached:"))
                        .set("store.local_cache", "0"),
                };
                let gateway = procs::gateway(&config).await;
                match cached {
                    true => gateways.cached.push(gateway),
                    false => gateways.uncached.push(gateway),
                }
            }
        }
        gateways
    }

    fn of(&self, scenario: Scenario) -> &[Proc] {
        match scenario.cached() {
            true => &self.cached,
            false => &self.uncached,
        }
    }
}

/// Section `seal`: at each of `sizes`, the three scenarios with sealing off and on side by
/// side; `quick` keeps the run's rounds (one). A full run has an even number of rounds, four at
/// least, so that each mode comes second in a pair as often as the other (on this machine which
/// one comes first can move a pair's ratio by 10%).
pub async fn run(
    b: &mut Bench,
    (redis_conn, redis_url): (&mut MultiplexedConnection, &str),
    sizes: &[usize],
    quick: bool,
) {
    let rounds = match quick {
        true => b.rounds,
        false => b.rounds.max(4).next_multiple_of(2),
    };
    b.request = load::small_request();
    for &size in sizes {
        b.size = size;
        flush(redis_conn).await;
        let up = procs::upstream(size, 0);
        b.upstream_pids = up.pids();
        let gws = Gateways::start(redis_url, up.addr).await;
        prime(b, &gws).await;
        let mut rows = Vec::new();
        let mut phases: Vec<Vec<Phase>> = vec![Vec::new(); Scenario::ALL.len() * MODES.len()];
        for round in 0..rounds {
            for (s, &scenario) in Scenario::ALL.iter().enumerate() {
                // Swapped every round, so that neither mode always follows the other's load.
                let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
                for i in order {
                    let gw = &gws.of(scenario)[i];
                    let p = phase(b, gw, up.addr, scenario, round == 0).await;
                    let row = s * MODES.len() + i;
                    keep_round(
                        b,
                        &mut rows,
                        (row, &label(scenario, i), round),
                        p.report.clone(),
                    );
                    phases[row].push(p);
                }
            }
        }
        medians(b, &rows);
        check(b, &phases);
        let records = records(b, redis_conn).await;
        for (s, &scenario) in Scenario::ALL.iter().enumerate() {
            let pair = &phases[s * MODES.len()..][..MODES.len()];
            b.notes.push(note(b, scenario, pair, rounds));
        }
        b.notes.push(records);
        drop((gws, up));
    }
    // The records of the section are of no use to the next ones.
    flush(redis_conn).await;
}

/// The row of `scenario` with sealing `MODES[i]`.
fn label(scenario: Scenario, i: usize) -> String {
    let path = match scenario {
        Scenario::Miss => "gateway miss, redis",
        Scenario::Replay => "gateway replay, redis",
        Scenario::ReplayUncached => "gateway replay, redis, local_cache 0",
    };
    format!("{path}, seal {}", MODES[i])
}

/// Run each hot key once through every gateway, so that the replay phases replay only.
async fn prime(b: &mut Bench, gws: &Gateways) {
    let each = gws.cached.iter().chain(&gws.uncached).map(|gw| async {
        let mut sender = None;
        let mut refused = None;
        for i in 0..HOT {
            let key = format!("{HOT_PREFIX}-{i}");
            let status = load::send_once(&mut sender, gw.addr, &key, &b.request).await;
            if !(200..300).contains(&status) {
                refused = Some(status);
            }
        }
        refused
    });
    let refused = futures_util::future::join_all(each).await;
    if let Some(status) = refused.into_iter().flatten().next() {
        b.insane.push(format!(
            "seal ({}): a hot key's first request answered {status}",
            human(b.size)
        ));
    }
}

/// One closed-loop phase of `scenario` through `gw` (warmed up first when `first`), with the
/// upstream's executions and the gateway's Redis round trips over it.
async fn phase(
    b: &mut Bench,
    gw: &Proc,
    upstream: SocketAddr,
    scenario: Scenario,
    first: bool,
) -> Phase {
    let keys = match scenario {
        Scenario::Miss => Keys::Unique(b.prefix("seal-miss")),
        Scenario::Replay | Scenario::ReplayUncached => Keys::Hot(HOT_PREFIX.into(), HOT),
    };
    let keys = match first {
        true => b.warm_up(&[gw.addr], keys, "seal-miss").await,
        false => keys,
    };
    let admin = gw.admin.expect("the gateway has an admin listener");
    let (ran, trips) = (executions(upstream).await, round_trips(admin));
    let report = b.closed(gw.addr, keys, &gw.pids()).await;
    let executed = executions(upstream).await.saturating_sub(ran);
    let trips = round_trips(admin).saturating_sub(trips);
    Phase {
        executed,
        round_trips: trips as f64 / report.requests.max(1) as f64,
        report,
    }
}

/// The sanity checks, none on a timing: replays ran nothing upstream, and each scenario made
/// the round trips it stands for (2 per miss, none per replay from the cache, 1 per replay
/// without it), so that the rows measure what they are named after.
fn check(b: &mut Bench, phases: &[Vec<Phase>]) {
    for (s, &scenario) in Scenario::ALL.iter().enumerate() {
        for i in 0..MODES.len() {
            for (round, p) in phases[s * MODES.len() + i].iter().enumerate() {
                let name = format!(
                    "seal: {} {} (round {})",
                    label(scenario, i),
                    human(b.size),
                    round + 1
                );
                if scenario != Scenario::Miss && p.executed > 0 {
                    b.insane
                        .push(format!("{name}: the upstream ran {} times", p.executed));
                }
                if (p.round_trips - scenario.round_trips()).abs() > 0.05 {
                    b.insane.push(format!(
                        "{name}: {:.3} Redis round trips per request, not {}",
                        p.round_trips,
                        scenario.round_trips()
                    ));
                }
            }
        }
    }
}

/// One completed record of each gateway as Redis holds it: its length, and whether the
/// response's content type shows in clear (it must with sealing off, and must not with it on).
async fn records(b: &mut Bench, conn: &mut MultiplexedConnection) -> String {
    let mut lengths = Vec::new();
    for mode in MODES {
        let prefix = format!("seal-{mode}-cached:");
        let Some(raw) = one_record(conn, &prefix).await else {
            b.insane
                .push(format!("seal: no record under {prefix} in Redis"));
            return String::new();
        };
        let clear = raw.windows(16).any(|w| w == b"application/json");
        if clear != (mode == "off") {
            b.insane.push(format!(
                "seal: a record of the seal = \"{mode}\" gateway {} the response's content type in clear",
                if clear { "shows" } else { "does not show" }
            ));
        }
        lengths.push(raw.len());
    }
    format!(
        "seal ({} body): one record in Redis is {} bytes with seal off, {} with seal on (LZ4 before sealing at 1 KiB and up; a sealed record adds its key id, nonce and tag)",
        human(b.size),
        lengths[0],
        lengths[1]
    )
}

/// A completed record under `prefix` (not a tombstone, a staged entry or a claim).
async fn one_record(conn: &mut MultiplexedConnection, prefix: &str) -> Option<Vec<u8>> {
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await
            .ok()?;
        for key in keys.iter().filter(|k| !k[prefix.len()..].contains(':')) {
            let raw: Option<Vec<u8>> = redis::cmd("GET").arg(key).query_async(conn).await.ok()?;
            // Byte 1 is the state: a completed record, in clear or compressed.
            if let Some(raw) = raw.filter(|r| matches!(r.get(1), Some(b'C' | b'Z'))) {
                return Some(raw);
            }
        }
        if next == 0 {
            return None;
        }
        cursor = next;
    }
}

/// The median of `f` over `phases`.
fn median(phases: &[Phase], f: impl Fn(&Report) -> f64) -> f64 {
    median_of(phases.iter().map(|p| f(&p.report)).collect())
}

/// The median of `v` (of an even count, the mean of the middle two).
fn median_of(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n % 2 {
        1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The note of one scenario: on / off req/s (medians and by round) against the goal, and the
/// gateway's and Redis's CPU per request of each.
fn note(b: &Bench, scenario: Scenario, pair: &[Vec<Phase>], rounds: usize) -> String {
    let cpu = |i: usize, f: fn(&CpuPerRequest) -> f64| {
        median(&pair[i], |r| r.cpu.as_ref().map_or(0.0, f))
    };
    let ratio = |x: f64, y: f64| x / y.max(f64::MIN_POSITIVE);
    // Each round's on / off of `f`: their median, and the list with the medians of the rounds
    // where on came second (rounds 1, 3, ...) and first.
    let by_round = |f: fn(&Report) -> f64| -> (f64, String) {
        let v: Vec<f64> = pair[0]
            .iter()
            .zip(&pair[1])
            .map(|(off, on)| ratio(f(&on.report), f(&off.report)))
            .collect();
        let mut list: Vec<String> = v.iter().map(|r| format!("{r:.3}")).collect();
        if v.len() >= 2 {
            let at = |second: bool| -> Vec<f64> {
                v.iter()
                    .skip(usize::from(!second))
                    .step_by(2)
                    .copied()
                    .collect()
            };
            let (second, first) = (median_of(at(true)), median_of(at(false)));
            list.push(format!("on second {second:.3}, on first {first:.3}"));
        }
        (median_of(v), list.join(", "))
    };
    let rps = |i: usize| median(&pair[i], Report::rps);
    let gw = |r: &Report| r.cpu.map_or(0.0, |c| c.proxy);
    let (gw_off, gw_on) = (cpu(0, |c| c.proxy), cpu(1, |c| c.proxy));
    let ((rps_paired, rps_rounds), (gw_paired, gw_rounds)) = (by_round(Report::rps), by_round(gw));
    format!(
        "seal ({} body, Redis, {}, {} connections, {rounds} round{}, order swapped each round): on / off req/s = {:.3} (medians), {rps_paired:.3} (median of the rounds' ratios; goal >= 0.9; by round {rps_rounds}); req/s off {:.0}, on {:.0}; gateway CPU µs per request (median of rounds) off {gw_off:.1}, on {gw_on:.1}, on / off = {:.3} (medians), {gw_paired:.3} (median of the rounds' ratios; by round {gw_rounds}); Redis CPU µs per request off {:.1}, on {:.1}; Redis round trips per request off {:.2}, on {:.2}",
        human(b.size),
        scenario.name(),
        b.connections,
        if rounds == 1 { "" } else { "s" },
        ratio(rps(1), rps(0)),
        rps(0),
        rps(1),
        ratio(gw_on, gw_off),
        cpu(0, |c| c.redis),
        cpu(1, |c| c.redis),
        pair[0].iter().map(|p| p.round_trips).sum::<f64>() / rounds as f64,
        pair[1].iter().map(|p| p.round_trips).sum::<f64>() / rounds as f64,
    )
}
