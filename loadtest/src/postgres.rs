//! Section `postgres`: the gateway on `backend = "postgres"` against PostgreSQL's own limit,
//! pgbench running the store's two statements of a miss on the same private server at the same
//! concurrency; and replays against nginx. Rounds interleaved, as in the main table.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use testkit::PostgresServer;

use crate::bench::{human, keep_round, medians, Bench};
use crate::cluster::started;
use crate::load::{CpuPerRequest, Keys, Report};
use crate::procs::{self, Proc};

/// One miss as the store runs it, its two statements taken from the store itself
/// ([`idemgate::store::postgres::miss_statements`], the default table), each its own
/// transaction: their parameters as pgbench variables, a random key (32 bytes, as the gateway's
/// scoped key) and token (16 bytes), the records (`-D claimrec=`, `-D rec=`), the lease and the
/// TTL in ms.
fn script() -> String {
    let [claim, complete] =
        idemgate::store::postgres::miss_statements(idemgate::store::postgres::DEFAULT_TABLE);
    let with = |sql: &str, record: &str, ms: &str| {
        sql.replace("$1", "(sha256(int8send(:k)))")
            .replace("$2", "(int8send(:t) || int8send(:t))")
            .replace("$3", &format!("(:{record})"))
            .replace("$4", &format!("(:{ms})"))
    };
    format!(
        "\\set k random(1, 9223372036854775806)\n\\set t random(1, 9223372036854775806)\n{};\n{};\n",
        with(&claim, "claimrec", "lease"),
        with(&complete, "rec", "ttl"),
    )
}

/// The length of an in-flight record: the codec's fixed header (`store/codec.rs`).
const CLAIM_RECORD: usize = 58;

/// What one scenario measures each round.
#[derive(Clone, Copy)]
enum What {
    /// Through process `via` (nginx, then the gateways), whose store is server `on`: a miss
    /// or a replay.
    Http { via: usize, on: usize, miss: bool },
    /// pgbench at this many clients on server `on`.
    PgBench { clients: usize, on: usize },
}

/// The two servers: the tests' settings (fsync off), and PostgreSQL's own (fsync on).
const FAST: usize = 0;
const DURABLE: usize = 1;

/// Section `postgres`: nginx, the gateway's miss (pool of `connections`, and the default 16)
/// and replay on a private PostgreSQL, and pgbench with the miss's two statements at
/// `connections` clients; the miss and pgbench again on a server with fsync on; the ratios
/// miss / pgbench and replay / nginx, with CPU per request.
pub async fn run(b: &mut Bench, dir: &Path) {
    let servers = match servers().await {
        Ok(servers) => servers,
        Err(e) => {
            b.insane.push(format!("postgres: {e}"));
            return;
        }
    };
    let redis_pids = std::mem::take(&mut b.redis_pids);
    b.size = 1024;
    b.request = crate::load::small_request();
    let up = procs::upstream(b.size, 0);
    b.upstream_pids = up.pids();
    let nginx = procs::nginx(dir, up.addr);
    let c = b.connections;
    let mut gws: Vec<Proc> = Vec::new();
    for (pool, on) in [(c, FAST), (16, FAST), (c, DURABLE)] {
        let config = procs::config(up.addr)
            .postgres(&servers[on])
            .set("store.pool_size", pool as i64);
        gws.push(procs::gateway(&config).await);
    }
    let procs_of: Vec<&Proc> = std::iter::once(&nginx).chain(&gws).collect();
    let scenarios = scenarios(c);
    let mut rows = Vec::new();
    let mut script = None;
    'rounds: for round in 0..b.rounds {
        for (i, (scenario, what)) in scenarios.iter().enumerate() {
            let r = match *what {
                What::Http { via, on, miss } => {
                    let keys = match (miss, via) {
                        (true, _) => Keys::Unique(b.prefix("pg-miss")),
                        (false, 0) => Keys::None,
                        // 1000 keys, executed once by the first warm-up, replayed after.
                        (false, _) => Keys::Hot(format!("hot-pg-{}", b.size), 1000),
                    };
                    http(b, &servers[on], procs_of[via], keys, round == 0).await
                }
                What::PgBench { clients, on } => {
                    let script = &*script.get_or_insert_with(|| write_script(&servers[FAST], dir));
                    match pgbench(b, &servers[on], script, (clients, round == 0)).await {
                        Ok(r) => r,
                        Err(e) => {
                            b.insane.push(format!("{scenario}: {e}"));
                            break 'rounds;
                        }
                    }
                }
            };
            keep_round(b, &mut rows, (i, scenario, round), r);
        }
    }
    medians(b, &rows);
    if rows.len() == scenarios.len() {
        b.notes.push(ratios(b, &rows, script.as_ref()));
    }
    b.notes.push(format!(
        "postgres: gateway RSS after the phases: pool_size {c} {} MiB, pool_size 16 {} MiB; rows in the table at the end: {} (fsync on: {})",
        gws[0].rss_kib() / 1024,
        gws[1].rss_kib() / 1024,
        servers[FAST].psql("SELECT count(*) FROM idemgate_records"),
        servers[DURABLE].psql("SELECT count(*) FROM idemgate_records"),
    ));
    drop((gws, nginx, up, servers));
    b.redis_pids = redis_pids;
}

/// The two servers ([`FAST`], [`DURABLE`]), each taking the gateways' pools and pgbench's
/// clients side by side: more connections than the default 100.
async fn servers() -> Result<[PostgresServer; 2], String> {
    let fast = started(PostgresServer::start()).await?;
    let durable = started(PostgresServer::start_durable()).await?;
    for pg in [&fast, &durable] {
        pg.psql("ALTER SYSTEM SET max_connections = 400");
        pg.restart().await;
    }
    Ok([fast, durable])
}

/// A private PostgreSQL until SIGTERM or Ctrl-C, its URL printed first; stopped on the way out.
pub async fn serve() {
    use tokio::signal::unix::{signal, SignalKind};
    let pg = PostgresServer::start().await;
    println!("{}", pg.url());
    let mut term = signal(SignalKind::terminate()).unwrap();
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    drop(pg);
}

/// The scenarios, in the order each round runs them; `c` is the run's connections.
fn scenarios(c: usize) -> Vec<(String, What)> {
    let http = |via, on, miss| What::Http { via, on, miss };
    let pgbench = |clients, on| What::PgBench { clients, on };
    vec![
        ("nginx proxy, beside postgres".into(), http(0, FAST, false)),
        (
            format!("gateway miss, postgres (pool_size {c})"),
            http(1, FAST, true),
        ),
        (
            "gateway miss, postgres (pool_size 16, the default)".into(),
            http(2, FAST, true),
        ),
        ("gateway replay, postgres".into(), http(1, FAST, false)),
        (
            format!("pgbench, the miss's 2 statements ({c} clients)"),
            pgbench(c, FAST),
        ),
        (
            "pgbench, the miss's 2 statements (16 clients)".into(),
            pgbench(16, FAST),
        ),
        (
            format!("gateway miss, postgres fsync on (pool_size {c})"),
            http(3, DURABLE, true),
        ),
        (
            format!("pgbench, the miss's 2 statements, fsync on ({c} clients)"),
            pgbench(c, DURABLE),
        ),
    ]
}

/// One closed-loop phase through `gw` (warmed up first with `warm`), with the CPU per request of
/// PostgreSQL's processes as [`server_cpu`] counts it.
async fn http(b: &mut Bench, pg: &PostgresServer, gw: &Proc, keys: Keys, warm: bool) -> Report {
    let keys = match warm {
        true => b.warm_up(&[gw.addr], keys, "pg-miss").await,
        false => keys,
    };
    b.redis_pids = Vec::new();
    let before = server_cpu(pg);
    let mut r = b.closed(gw.addr, keys, &gw.pids()).await;
    let ns = since(&before, &server_cpu(pg));
    if let Some(c) = r.cpu.as_mut() {
        c.redis = ns as f64 / 1e3 / r.requests.max(1) as f64;
    }
    r
}

/// CPU time in ns of each of PostgreSQL's processes (the postmaster and its children: the
/// backends of every connection, made as the gateways' pools grow, and the helpers).
fn server_cpu(pg: &PostgresServer) -> HashMap<u32, u64> {
    pg.pid()
        .map(procs::with_children)
        .unwrap_or_default()
        .into_iter()
        .map(|pid| (pid, procs::cpu_ns(&[pid])))
        .collect()
}

/// The CPU time spent between two [`server_cpu`]s by the processes alive at the second (a process
/// that started in between counts from 0).
fn since(before: &HashMap<u32, u64>, after: &HashMap<u32, u64>) -> u64 {
    after
        .iter()
        .map(|(pid, ns)| ns.saturating_sub(before.get(pid).copied().unwrap_or(0)))
        .sum()
}

/// The pgbench script, with the record lengths the gateway's misses wrote.
struct Script {
    path: PathBuf,
    record: usize,
}

/// Write the script beside the run's files, the completed record as long as those the gateway
/// wrote (its first miss phase has run by now).
fn write_script(pg: &PostgresServer, dir: &Path) -> Script {
    let path = dir.join("pgbench-miss.sql");
    std::fs::write(&path, script()).unwrap();
    let record = pg
        .psql("SELECT coalesce(max(length(record)), 0) FROM idemgate_records WHERE NOT in_flight")
        .parse()
        .unwrap_or(0);
    Script { path, record }
}

/// `\x` and `n` random bytes in hex: a bytea value as text.
fn random_bytea(n: usize) -> String {
    let mut x = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut s = String::from("\\x");
    for _ in 0..n {
        // xorshift64: the bytes only need to be incompressible, not secret.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(&format!("{:02x}", x as u8));
    }
    s
}

/// One pgbench run at `clients` clients (`-M prepared`, as the store prepares its
/// statements): after a settling time (connections made, `b.warm`; longer with `warm`), a window
/// of `b.secs` in which its transactions (from its per-transaction log) and the CPU time of the
/// server's processes and of pgbench are counted.
async fn pgbench(
    b: &Bench,
    pg: &PostgresServer,
    script: &Script,
    (clients, warm): (usize, bool),
) -> Result<Report, String> {
    let settle = b.warm.max(Duration::from_millis(300)) * if warm { 2 } else { 1 };
    let total = (settle + b.secs).as_secs_f64() + 0.5;
    let logs = tempfile::tempdir().unwrap();
    let child = tokio::process::Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-j", "2", "-l"])
        .args(["-c", &clients.to_string()])
        .args(["-T", &format!("{}", total.ceil() as u64)])
        .arg(format!("--log-prefix={}", logs.path().join("tx").display()))
        .arg("-f")
        .arg(&script.path)
        .args(["-h", "127.0.0.1", "-p", &pg.port.to_string()])
        .args(["-U", testkit::postgres::USER])
        .arg("-D")
        .arg(format!("claimrec={}", random_bytea(CLAIM_RECORD)))
        .arg("-D")
        .arg(format!("rec={}", random_bytea(script.record)))
        .args(["-D", "lease=30000", "-D", "ttl=86400000", "idemgate"])
        .env("PGPASSWORD", testkit::postgres::PASSWORD)
        .current_dir(logs.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start pgbench: {e}"))?;
    let client = [child.id().unwrap_or(0)];
    tokio::time::sleep(settle).await;
    let (pg0, cl0, t0) = (server_cpu(pg), procs::cpu_ns(&client), SystemTime::now());
    tokio::time::sleep(b.secs).await;
    let (pg1, cl1, t1) = (server_cpu(pg), procs::cpu_ns(&client), SystemTime::now());
    let out = child.wait_with_output().await.unwrap();
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        return Err(format!(
            "pgbench failed ({}): {}",
            out.status,
            tail.join(" / ")
        ));
    }
    let mut r = window(logs.path(), t0, t1);
    if r.requests == 0 {
        // Nothing ended in the measured window (a short --quick phase on a loaded machine):
        // the whole run's transactions, so that the check sees whether pgbench worked at all.
        r = window(logs.path(), UNIX_EPOCH, SystemTime::now());
    }
    let per = |ns: u64| ns as f64 / 1e3 / r.requests.max(1) as f64;
    r.cpu = Some(CpuPerRequest {
        proxy: 0.0,
        upstream: 0.0,
        redis: per(since(&pg0, &pg1)),
        load: per(cl1.saturating_sub(cl0)),
    });
    Ok(r)
}

/// The transactions of pgbench's logs (`tx.*` in `dir`) that ended between `t0` and `t1`: a
/// report of them, latencies in the histogram, failed ones as errors.
fn window(dir: &Path, t0: SystemTime, t1: SystemTime) -> Report {
    let us = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_micros() as u64;
    let (from, to) = (us(t0), us(t1));
    let mut r = Report {
        elapsed: t1.duration_since(t0).unwrap_or_default(),
        ..Report::empty()
    };
    for file in std::fs::read_dir(dir).unwrap().flatten() {
        let text = std::fs::read_to_string(file.path()).unwrap_or_default();
        // client_id transaction_no time script_no time_epoch time_us [...]: `time` is the
        // latency in µs, or `failed`/`skipped`.
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let end = match (
                f.get(4).and_then(|s| s.parse::<u64>().ok()),
                f.get(5).and_then(|s| s.parse::<u64>().ok()),
            ) {
                (Some(s), Some(u)) => s * 1_000_000 + u,
                _ => continue,
            };
            if end < from || end > to {
                continue;
            }
            r.requests += 1;
            match f[2].parse::<u64>() {
                Ok(latency) => {
                    r.ok += 1;
                    let _ = r.hist.record(latency.max(1));
                }
                Err(_) => r.errors += 1,
            }
        }
    }
    r
}

/// The note of the ratios, each with the one the CPU per request of all processes predicts
/// in brackets, and where the CPU goes.
fn ratios(b: &Bench, rows: &[usize], script: Option<&Script>) -> String {
    let r = |i: usize| &b.rows[rows[i]].closed;
    let cpu = |i: usize| r(i).cpu.unwrap_or_default();
    let ratio = |a: usize, z: usize| {
        format!(
            "{:.2} [CPU {:.2}]",
            r(a).rps() / r(z).rps().max(f64::MIN_POSITIVE),
            cpu(z).all() / cpu(a).all().max(f64::MIN_POSITIVE)
        )
    };
    let c = b.connections;
    format!(
        "postgres ({} body, {c} connections / clients, {} rounds; PostgreSQL with fsync=off and full_page_writes=off as testkit starts it, and with its defaults (fsync on) where said; in the CPU lines the \"Redis\" share is PostgreSQL's processes, the load generator's is pgbench on its row): gateway miss / pgbench = {} with pool_size {c} against {c} clients (goal >= 0.7), {} with pool_size 16 against 16 clients, {} with fsync on; replay / nginx = {} (goal >= 1.0); CPU µs per miss: gateway {:.1} and PostgreSQL {:.1} with pool_size {c}, {:.1} and {:.1} with 16, {:.1} and {:.1} with fsync on; per pgbench transaction, PostgreSQL and pgbench: {:.1} and {:.1} at {c} clients, {:.1} and {:.1} at 16, {:.1} and {:.1} with fsync on; pgbench's completed record {} bytes, the claim's {CLAIM_RECORD}",
        human(b.size),
        b.rounds,
        ratio(1, 4),
        ratio(2, 5),
        ratio(6, 7),
        ratio(3, 0),
        cpu(1).proxy,
        cpu(1).redis,
        cpu(2).proxy,
        cpu(2).redis,
        cpu(6).proxy,
        cpu(6).redis,
        cpu(4).redis,
        cpu(4).load,
        cpu(5).redis,
        cpu(5).load,
        cpu(7).redis,
        cpu(7).load,
        script.map_or(0, |s| s.record),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_transactions_that_ended_inside_the_window() {
        let dir = tempfile::tempdir().unwrap();
        // client transaction latency_us script epoch_s epoch_us; one thread's file each.
        std::fs::write(
            dir.path().join("tx.1"),
            "0 1 900 0 100 999999\n0 2 1500 0 101 0\n1 1 2500 0 101 500000\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("tx.1.1"),
            "2 1 failed 0 101 700000\n2 2 800 0 102 1\n",
        )
        .unwrap();
        let at = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        let r = window(dir.path(), at(101), at(102));
        assert_eq!((r.requests, r.ok, r.errors), (3, 2, 1));
        assert_eq!(r.elapsed, Duration::from_secs(1));
        assert_eq!(r.hist.len(), 2);
        assert!((r.ms(1.0) - 2.5).abs() < 0.01, "{}", r.ms(1.0));
    }

    #[test]
    fn the_script_has_no_parameter_left() {
        let s = script();
        assert!(!s.contains('$'), "{s}");
        assert_eq!(s.lines().count(), 4, "{s}");
        assert!(s.contains(":claimrec") && s.contains(":rec") && s.contains(":ttl"));
    }

    #[test]
    fn random_bytea_is_hex_of_the_given_length() {
        let v = random_bytea(58);
        assert!(v.starts_with("\\x"));
        assert_eq!(v.len(), 2 + 2 * 58);
        assert!(v[2..].chars().all(|c| c.is_ascii_hexdigit()));
    }
}
