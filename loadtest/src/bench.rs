//! The run's state and the measuring every section shares: warm-up, a closed-loop phase with the
//! CPU time per request of each process, a fixed-rate phase, and the sanity checks.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use testkit::metrics::{commandstats, per_request};

use crate::load::{self, CpuPerRequest, Keys, Pace, Report};
use crate::metrics::round_trips;
use crate::procs;

/// One row of the results table.
pub struct Row {
    pub scenario: String,
    pub body: usize,
    // The median (by req/s) of `samples`.
    pub closed: Report,
    // One closed-loop report per round.
    pub samples: Vec<Report>,
    pub at_rate: Option<Report>,
}

/// A scenario measured at a fixed rate for its time to first byte (section `stream`): every
/// round's report, with its percentiles taken over all of them together.
pub struct FirstByteRow {
    pub scenario: String,
    pub body: usize,
    pub rate: f64,
    pub rounds: Vec<Report>,
    /// The row whose first-byte percentiles this one's are compared with ("added").
    pub against: Option<String>,
}

impl FirstByteRow {
    /// The rounds' reports as one: their histograms merged, the CPU the median round's.
    pub fn merged(&self) -> Report {
        let mut all = self.rounds[0].clone();
        for r in &self.rounds[1..] {
            all.hist.add(&r.hist).unwrap();
            all.first_byte.add(&r.first_byte).unwrap();
            all.requests += r.requests;
            all.ok += r.ok;
            all.conflicts += r.conflicts;
            all.errors += r.errors;
            all.elapsed += r.elapsed;
        }
        let mut by_cpu: Vec<&Report> = self.rounds.iter().collect();
        by_cpu.sort_by(|x, y| {
            let proxy = |r: &Report| r.cpu.map_or(0.0, |c| c.proxy);
            proxy(x).total_cmp(&proxy(y))
        });
        all.cpu = by_cpu[by_cpu.len() / 2].cpu;
        all
    }
}

pub struct Bench {
    pub secs: Duration,
    pub warm: Duration,
    pub connections: usize,
    pub rows: Vec<Row>,
    pub first_byte: Vec<FirstByteRow>,
    pub notes: Vec<String>,
    /// The chaos section's table rows.
    pub chaos: Vec<String>,
    pub insane: Vec<String>,
    pub run_id: u64,
    // Closed-loop rounds per scenario (interleaved); the table shows the median.
    pub rounds: usize,
    // The response body size of the phases being measured.
    pub size: usize,
    // The upstream's and Redis's processes, for the CPU figures.
    pub upstream_pids: Vec<u32>,
    pub redis_pids: Vec<u32>,
    // The body of every request sent (the small payment, but for the fingerprint phases).
    pub request: bytes::Bytes,
    // The path every request goes to (`/v1/payments`, but for the stream section's).
    pub path: String,
}

/// The path of every section's requests but the stream section's.
pub const PAYMENTS: &str = "/v1/payments";

impl Bench {
    /// A run of `secs` phases after `warm` of warm-up, on `connections` connections, `rounds`
    /// closed-loop rounds per scenario.
    pub fn new(secs: Duration, warm: Duration, connections: usize, rounds: usize) -> Bench {
        Bench {
            secs,
            warm,
            connections,
            rows: Vec::new(),
            first_byte: Vec::new(),
            notes: Vec::new(),
            chaos: Vec::new(),
            insane: Vec::new(),
            run_id: 0,
            rounds,
            size: 1024,
            upstream_pids: Vec::new(),
            redis_pids: Vec::new(),
            request: load::small_request(),
            path: PAYMENTS.to_string(),
        }
    }

    pub fn prefix(&mut self, what: &str) -> String {
        self.run_id += 1;
        format!("{what}-{}-{}", std::process::id(), self.run_id)
    }

    /// Warm up `addrs` with `keys` (pools, caches and, for the replay path, the hot keys' first
    /// executions); the keys of the measured phase: the same, or for unique keys fresh ones
    /// named `what`, so that the phase measures misses only.
    pub async fn warm_up(&mut self, addrs: &[SocketAddr], keys: Keys, what: &str) -> Keys {
        load::run_spread(
            addrs,
            &self.path,
            self.request.clone(),
            keys.clone(),
            self.connections,
            self.warm,
            Pace::Closed,
        )
        .await;
        // Every hot key recorded before a replay phase counts: on a slow store the timed
        // warm-up may leave some unexecuted, whose duplicates would get 409 in-flight.
        let hot = match &keys {
            Keys::Hot(_, n) => Some(*n),
            Keys::Stripe(inner) => match **inner {
                Keys::Hot(_, n) => Some(n),
                _ => None,
            },
            _ => None,
        };
        if let Some(n) = hot {
            load::record_each(addrs[0], "/v1/payments", self.request.clone(), &keys, n).await;
        }
        match keys {
            Keys::Unique(_) => Keys::Unique(self.prefix(what)),
            Keys::Stripe(inner) if matches!(*inner, Keys::Unique(_)) => {
                Keys::Stripe(Box::new(Keys::Unique(self.prefix(what))))
            }
            k => k,
        }
    }

    /// A closed-loop run against `addr`, with the CPU time per request of `proxy` (the processes
    /// under test), the upstream, Redis and the load generator (this process).
    pub async fn closed(&self, addr: SocketAddr, keys: Keys, proxy: &[u32]) -> Report {
        self.closed_spread(&[addr], keys, proxy).await
    }

    /// [`Bench::closed`] against several replicas, the connections spread over them.
    pub async fn closed_spread(&self, addrs: &[SocketAddr], keys: Keys, proxy: &[u32]) -> Report {
        self.measured(addrs, keys, proxy, Pace::Closed).await
    }

    /// A phase at `pace` against `addrs` (the connections spread over them), with the CPU time
    /// per request of `proxy`, the upstream, Redis and the load generator.
    pub async fn measured(
        &self,
        addrs: &[SocketAddr],
        keys: Keys,
        proxy: &[u32],
        pace: Pace,
    ) -> Report {
        let me = [std::process::id()];
        let sample = || {
            [
                procs::cpu_ns(proxy),
                procs::cpu_ns(&self.upstream_pids),
                procs::cpu_ns(&self.redis_pids),
                procs::cpu_ns(&me),
            ]
        };
        let before = sample();
        let mut r = load::run_spread(
            addrs,
            &self.path,
            self.request.clone(),
            keys,
            self.connections,
            self.secs,
            pace,
        )
        .await;
        let after = sample();
        let per =
            |i: usize| after[i].saturating_sub(before[i]) as f64 / 1e3 / r.requests.max(1) as f64;
        r.cpu = Some(CpuPerRequest {
            proxy: per(0),
            upstream: per(1),
            redis: per(2),
            load: per(3),
        });
        r
    }

    pub async fn at_rate(&self, addr: SocketAddr, keys: Keys, rate: f64) -> Report {
        load::run(addr, PAYMENTS, keys, 32, self.secs, Pace::Rate(rate)).await
    }

    pub fn check(&mut self, name: &str, r: &Report, expect_conflicts: bool) {
        if r.requests == 0 {
            self.insane.push(format!("{name}: no request completed"));
        } else if r.errors * 100 > r.requests {
            self.insane.push(format!(
                "{name}: {} errors in {} requests",
                r.errors, r.requests
            ));
        } else if !expect_conflicts && r.conflicts > 0 {
            self.insane
                .push(format!("{name}: {} unexpected 409s", r.conflicts));
        }
    }
}

/// Warm up, then measure one closed-loop phase and record it as a row. With `redis`, the Redis
/// commands the measured part caused are noted per request.
pub async fn phase(
    b: &mut Bench,
    scenario: &str,
    addr: SocketAddr,
    proxy: &[u32],
    keys: Keys,
    redis: Option<(&mut redis::aio::MultiplexedConnection, SocketAddr)>,
) -> Report {
    let size = b.size;
    let keys = match keys {
        Keys::Unique(_) => Keys::Unique(b.prefix("miss")),
        Keys::Hot(_, n) => Keys::Hot(format!("hot-{size}"), n),
        k => k,
    };
    let keys = b.warm_up(&[addr], keys, "miss").await;
    let r = match redis {
        Some((conn, admin)) => {
            let (before, trips_before) = (commandstats(conn, "calls").await, round_trips(admin));
            let r = b.closed(addr, keys, proxy).await;
            let (after, trips_after) = (commandstats(conn, "calls").await, round_trips(admin));
            let trips = (trips_after - trips_before) as f64 / r.requests.max(1) as f64;
            b.notes.push(per_request_note(
                scenario,
                size,
                trips,
                (&before, &after),
                r.requests,
            ));
            r
        }
        None => b.closed(addr, keys, proxy).await,
    };
    b.check(scenario, &r, false);
    eprintln!(
        "  {scenario:<34} {:>9.0} req/s  p50 {:.2} ms  p99 {:.2} ms",
        r.rps(),
        r.ms(0.5),
        r.ms(0.99)
    );
    b.rows.push(Row {
        scenario: scenario.to_string(),
        body: size,
        closed: r.clone(),
        samples: vec![r.clone()],
        at_rate: None,
    });
    r
}

/// Check round `round` of scenario `i` of a section whose rounds are interleaved, and keep it: a
/// new row in the first round (its index pushed to `rows`), a sample of its row after.
pub fn keep_round(
    b: &mut Bench,
    rows: &mut Vec<usize>,
    (i, scenario, round): (usize, &str, usize),
    r: Report,
) {
    b.check(&format!("{scenario} (round {})", round + 1), &r, false);
    eprintln!(
        "  {scenario:<52} {:>9.0} /s  p50 {:.2} ms  p99 {:.2} ms  (round {})",
        r.rps(),
        r.ms(0.5),
        r.ms(0.99),
        round + 1
    );
    if round == 0 {
        rows.push(b.rows.len());
        b.rows.push(Row {
            scenario: scenario.to_string(),
            body: b.size,
            closed: r.clone(),
            samples: vec![r],
            at_rate: None,
        });
    } else {
        b.rows[rows[i]].samples.push(r);
    }
}

/// Make each of `rows` show its median round (by req/s), once every round is kept.
pub fn medians(b: &mut Bench, rows: &[usize]) {
    for &i in rows {
        let mut samples = b.rows[i].samples.clone();
        samples.sort_by(|x, y| x.rps().total_cmp(&y.rps()));
        b.rows[i].closed = samples[samples.len() / 2].clone();
    }
}

/// `1 KiB`, `64 KiB`, or bytes.
pub fn human(size: usize) -> String {
    if size >= 1024 && size.is_multiple_of(1024) {
        format!("{} KiB", size / 1024)
    } else {
        format!("{size} B")
    }
}

/// The note of a phase on Redis: round trips and commands per request.
fn per_request_note(
    what: &str,
    size: usize,
    trips: f64,
    (before, after): (&HashMap<String, u64>, &HashMap<String, u64>),
    requests: u64,
) -> String {
    format!(
        "{} body, {what}: {trips:.2} Redis round trips per request (the gateway's store operations not answered by its local cache); Redis commands per request, incl. those run inside the scripts: {}",
        human(size),
        per_request(before, after, requests)
    )
}
