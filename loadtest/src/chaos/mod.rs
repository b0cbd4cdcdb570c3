//! Section `chaos`: the gateway as deployed (the real binary, several processes on one shared
//! store) under faults, and a history checker that judges what clients saw, Jepsen-style.
//!
//! Each run is one backend in one lease regime: clients send keyed payments and retry them
//! ([`client`]); an upstream logs every execution and the bytes it answered, and misbehaves
//! ([`upstream`]); a nemesis injects faults on a seeded schedule ([`nemesis`]). Then the faults
//! stop, the leases run out, and every key is retried until it replays; [`check`](mod@check) judges the
//! history. The runs of one invocation go at once, each on its own store and ports.

mod check;
mod client;
mod nemesis;
mod upstream;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::FutureExt;

use crate::bench::Bench;
use check::{check, History, Verdict};
use client::Clients;
use nemesis::{Backend, System};
use testkit::panic_text;
use upstream::Upstream;

/// The lease, the upstream's pace and the length of the faults.
#[derive(Debug, Clone, Copy)]
pub struct Regime {
    pub name: &'static str,
    /// `lock_ttl`.
    pub lease: Duration,
    pub upstream_timeout: Duration,
    /// How long a normal execution takes, from and to.
    pub work: (Duration, Duration),
    /// How long the store or a gateway stays paused, or the disk full.
    pub stall: (Duration, Duration),
    /// How long a killed gateway stays down.
    pub down: (Duration, Duration),
}

impl Regime {
    /// A lease longer than every fault: nothing may run twice that the gateway did not count.
    pub fn long() -> Regime {
        Regime {
            name: "long",
            lease: Duration::from_secs(8),
            upstream_timeout: Duration::from_secs(2),
            work: (Duration::from_millis(10), Duration::from_millis(150)),
            stall: (Duration::from_millis(500), Duration::from_millis(3500)),
            down: (Duration::from_millis(300), Duration::from_secs(2)),
        }
    }

    /// A lease shorter than the faults (2 s, calls of about 1 s, stalls of 3.5 s): leases run
    /// out under calls, and what runs twice must be counted unsettled.
    pub fn short() -> Regime {
        Regime {
            name: "short",
            lease: Duration::from_secs(2),
            upstream_timeout: Duration::from_millis(1500),
            work: (Duration::from_millis(800), Duration::from_millis(1200)),
            stall: (Duration::from_millis(3500), Duration::from_millis(3500)),
            down: (Duration::from_millis(300), Duration::from_secs(2)),
        }
    }

    fn parse(name: &str) -> Option<Regime> {
        [Regime::long(), Regime::short()]
            .into_iter()
            .find(|r| r.name == name)
    }

    /// A client's patience for one attempt: a slow call, and two store timeouts, and slack.
    fn client_timeout(&self) -> Duration {
        self.upstream_timeout + Duration::from_secs(6)
    }
}

/// Clients per run.
const CLIENTS: usize = 8;

/// What the section runs: `backend:regime` each, for `secs` of faults, from `seed`.
pub struct Plan {
    pub runs: Vec<String>,
    pub secs: f64,
    pub seed: u64,
}

impl Plan {
    /// The runs `--chaos` names, or the default: with `--quick`, every backend in the long
    /// regime and Redis and PostgreSQL in the short one, for 20 s each; else both regimes
    /// everywhere for 60 s.
    pub fn new(quick: bool, runs: &[String], secs: Option<f64>, seed: u64) -> Plan {
        let runs = if !runs.is_empty() {
            runs.to_vec()
        } else if quick {
            let mut runs: Vec<String> = Backend::ALL
                .iter()
                .map(|b| format!("{}:long", b.name()))
                .collect();
            runs.extend(["redis:short".into(), "postgres:short".into()]);
            runs
        } else {
            Backend::ALL
                .iter()
                .flat_map(|b| [format!("{}:long", b.name()), format!("{}:short", b.name())])
                .collect()
        };
        Plan {
            runs,
            secs: secs.unwrap_or(if quick { 20.0 } else { 60.0 }),
            seed,
        }
    }
}

/// One run's figures.
struct Report {
    label: String,
    verdict: Verdict,
    faults: BTreeMap<&'static str, usize>,
    /// How long the clients ran with the nemesis, and the settling after.
    run: Duration,
    settle: Duration,
    crashed: Vec<String>,
    errors: Vec<String>,
    dir: PathBuf,
}

/// Section `chaos`: every run of `plan` at once; a table, and what is wrong as insane.
pub async fn run(b: &mut Bench, plan: &Plan) {
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("out/chaos");
    let mut runs = Vec::new();
    for spec in &plan.runs {
        let parsed = spec
            .split_once(':')
            .and_then(|(b, r)| Some((Backend::parse(b)?, Regime::parse(r)?)));
        match parsed {
            Some((backend, regime)) => runs.push((backend, regime)),
            None => b.insane.push(format!(
                "--chaos {spec}: not BACKEND:REGIME (memory, embedded, redis, redis-cluster, postgres; long, short)"
            )),
        }
    }
    eprintln!(
        "chaos: {} runs at once, {} s of faults each, seed {}",
        runs.len(),
        plan.secs,
        plan.seed
    );
    // Each run on a runtime of its own, on threads of its own: a fault's blocking step (a disk
    // filled, a server waited for) stalls no other run's clients.
    let (secs, seed) = (plan.secs, plan.seed);
    let threads: Vec<_> = runs
        .into_iter()
        .map(|(backend, regime)| {
            let label = format!("{}, {} lease", backend.name(), regime.name);
            let dir = out.join(format!("{}-{}-seed{seed}", backend.name(), regime.name));
            std::thread::spawn(move || {
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir).unwrap();
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .unwrap();
                let outcome = runtime.block_on(
                    AssertUnwindSafe(one_run(backend, regime, (secs, seed), &dir)).catch_unwind(),
                );
                outcome.map_err(|e| format!("{label}: {}", panic_text(&*e)))
            })
        })
        .collect();
    let reports: Vec<_> = tokio::task::block_in_place(|| {
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err("the run's thread panicked".into()))
            })
            .collect()
    });
    for report in reports {
        match report {
            Ok(r) => judge(b, r, plan.seed),
            Err(e) => b.insane.push(format!("chaos {e}")),
        }
    }
}

/// One backend in one regime: start, load and faults, settle, check.
async fn one_run(backend: Backend, regime: Regime, (secs, seed): (f64, u64), dir: &Path) -> Report {
    let label = format!("{}, {} lease", backend.name(), regime.name);
    let start = Instant::now();
    let seed = seed ^ ((backend as u64 + 1) << 32) ^ regime.lease.as_secs();
    let upstream = Upstream::start(start, seed, regime).await;
    let mut system = System::start(backend, regime, upstream.addr, dir, start).await;
    let clients = Arc::new(Clients {
        start,
        addrs: system.addrs(),
        incarnations: system.incarnations.clone(),
        stop: Default::default(),
        timeout: regime.client_timeout(),
        keys: Mutex::new(Vec::new()),
        attempts: Mutex::new(Vec::new()),
    });
    let load = start.elapsed();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(clients.clone().run(i, seed)))
        .collect();
    let mut rng = fastrand::Rng::with_seed(seed);
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let faults = system.nemesis(until, &mut rng).await;
    clients.stop.store(true, Ordering::SeqCst);
    for t in tasks {
        let _ = t.await;
    }
    let run = start.elapsed() - load;
    eprintln!(
        "  chaos {label}: faults over after {:.1} s; settling",
        run.as_secs_f64()
    );
    // Faults stop, leases run out (a call's, then its lease after a timeout), then every key is
    // retried until it replays.
    upstream.calm();
    tokio::time::sleep(regime.upstream_timeout + regime.lease + Duration::from_secs(1)).await;
    client::settle(clients.clone(), 2 * regime.lease + Duration::from_secs(20)).await;
    let settle = start.elapsed() - load - run;
    let (processes, crashed) = system.finish().await;
    let history = History {
        keys: clients
            .keys
            .lock()
            .unwrap()
            .iter()
            .map(|(k, _)| k.clone())
            .collect(),
        executions: upstream.executions(),
        attempts: clients.attempts.lock().unwrap().clone(),
        processes,
        faults,
        lease: regime.lease,
        upstream_timeout: regime.upstream_timeout,
    };
    let verdict = check(&history);
    write_history(dir, &history, &verdict);
    let mut faults = BTreeMap::new();
    for f in &history.faults {
        *faults.entry(f.kind).or_default() += 1;
    }
    Report {
        label,
        verdict,
        faults,
        run,
        settle,
        crashed,
        errors: system.errors.clone(),
        dir: dir.to_path_buf(),
    }
}

/// Print `r`'s line, keep it for the table, and what is wrong as insane.
fn judge(b: &mut Bench, r: Report, seed: u64) {
    let v = &r.verdict;
    let pct = |(ok, of): (usize, usize)| {
        if of == 0 {
            "-".to_string()
        } else {
            format!("{:.0}% of {of}", 100.0 * ok as f64 / of as f64)
        }
    };
    let faults: Vec<String> = r.faults.iter().map(|(k, n)| format!("{k} {n}")).collect();
    let line = format!(
        "| {} | {:.0} s + {:.0} s | {} | {} | {} | {} ({} answered 503) | {} / {} / {} | {} | {} | {} | {} | {} |",
        r.label,
        r.run.as_secs_f64(),
        r.settle.as_secs_f64(),
        v.keys,
        v.attempts,
        if faults.is_empty() { "none".into() } else { faults.join(", ") },
        v.executions,
        v.unavailable,
        v.dup_unexplained,
        v.dup_unsettled,
        v.dup_crash,
        v.unsettled,
        v.wrong,
        v.stuck,
        pct(v.during_faults),
        pct(v.outside_faults),
    );
    eprintln!("  chaos {line}");
    b.chaos.push(line);
    let what = format!(
        "chaos {} (seed {seed}, history in {})",
        r.label,
        r.dir.display()
    );
    for e in &r.errors {
        b.insane.push(format!("{what}: harness: {e}"));
    }
    for c in &r.crashed {
        b.insane.push(format!("{what}: {c}"));
    }
    if !v.sound() {
        b.insane.push(format!(
            "{what}: {} unexplained duplicates, {} wrong bodies, {} stuck keys; {}",
            v.dup_unexplained,
            v.wrong,
            v.stuck,
            v.anomalies
                .iter()
                .take(5)
                .cloned()
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    if v.keys == 0 || v.during_faults.1 == 0 {
        b.insane
            .push(format!("{what}: no key sent, or no attempt during a fault"));
    }
}

/// The header of the table [`judge`]'s lines make.
pub const TABLE_HEAD: &str = "| run | faults + settling | operations (keys) | attempts | faults by kind | executions | duplicates: unexplained / unsettled / crash window | unsettled counted | wrong bodies | stuck keys | 2xx of attempts during faults | outside faults |\n|---|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|";

/// The history and the verdict as text in `dir`, for reading an anomaly by hand.
fn write_history(dir: &Path, h: &History, v: &Verdict) {
    use std::fmt::Write;
    let mut text = String::new();
    let _ = writeln!(text, "# anomalies\n{}", v.anomalies.join("\n"));
    let _ = writeln!(text, "\n# processes");
    for p in &h.processes {
        let _ = writeln!(text, "{p:?}");
    }
    let _ = writeln!(text, "\n# faults");
    for f in &h.faults {
        let _ = writeln!(
            text,
            "{:.3}-{:.3} s {}",
            f.start.as_secs_f64(),
            f.end.as_secs_f64(),
            f.kind
        );
    }
    let _ = writeln!(
        text,
        "\n# executions (start-end s, key, process, act, status, bytes; cut-short: the gateway hung up before the answer was due)"
    );
    for e in &h.executions {
        let _ = writeln!(
            text,
            "{:.3}-{:.3} {} p{} {:?} {} {}{}",
            e.start.as_secs_f64(),
            e.end.as_secs_f64(),
            e.key,
            e.process,
            e.act,
            e.status,
            e.body.len(),
            if e.cut_short { " cut-short" } else { "" }
        );
    }
    let _ = writeln!(
        text,
        "\n# attempts (start-end s, key, process, phase, outcome)"
    );
    for a in &h.attempts {
        let outcome = match &a.outcome {
            check::Outcome::Answered {
                status,
                replayed,
                problem,
                body,
            } => format!(
                "{status}{}{} {} bytes",
                if *replayed { " replayed" } else { "" },
                problem
                    .as_deref()
                    .map_or(String::new(), |p| format!(" {p}")),
                body.len()
            ),
            other => format!("{other:?}"),
        };
        let _ = writeln!(
            text,
            "{:.3}-{:.3} {} p{} {:?} {outcome}",
            a.start.as_secs_f64(),
            a.end.as_secs_f64(),
            a.key,
            a.process,
            a.phase
        );
    }
    let _ = std::fs::write(dir.join("history.txt"), text);
}
