//! Section `embedded`: the gateway on the durable embedded store (`fsync = true`, its directory
//! on a disk, not tmpfs, so that each fsync reaches the device) against the gateway on the memory
//! store, misses at the run's connections; the fsyncs per miss from the gateway's
//! `idemgate_store_commits_total`; replays from the embedded store against nginx. Rounds
//! interleaved, as in the main table.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::bench::{human, keep_round, medians, Bench};
use crate::load::{Keys, Report};
use crate::metrics::scrape;
use crate::procs::{self, Proc};

/// Which keys a scenario sends.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Unkeyed,
    Miss,
    Replay,
}

/// What the store's metrics moved by over one phase.
#[derive(Clone, Copy, Default)]
struct Store {
    commits: u64,
    // Seconds and count of the claims, then of the completions.
    claims: (f64, u64),
    completes: (f64, u64),
    // The writer thread's ns on a core and waiting for one, and the phase's ns.
    writer: (u64, u64),
    wall: u64,
}

/// Section `embedded`: nginx, the gateway's miss on the memory store and on the embedded store
/// (with fsync, and without unless `quick`), and its replay from the embedded store; the ratios,
/// the fsyncs per miss and the disk's own fsync rate, with CPU per request.
pub async fn run(b: &mut Bench, dir: &Path, quick: bool) {
    let redis_pids = std::mem::take(&mut b.redis_pids);
    b.size = 1024;
    b.request = crate::load::small_request();
    let (disk, fs) = on_disk(dir);
    let up = procs::upstream(b.size, 0);
    b.upstream_pids = up.pids();
    let nginx = procs::nginx(dir, up.addr);
    let mem = procs::gateway(&procs::config(up.addr)).await;
    let embedded = |name: &str, fsync: bool| {
        let config = procs::config(up.addr)
            .embedded(&disk.path().join(name))
            .set("store.fsync", fsync);
        async move { procs::gateway(&config).await }
    };
    let mut gws = vec![&nginx, &mem];
    let durable = embedded("fsync", true).await;
    gws.push(&durable);
    let lazy = match quick {
        true => None,
        false => Some(embedded("no-fsync", false).await),
    };
    gws.extend(lazy.as_ref());
    let scenarios = scenarios(lazy.is_some());
    let mut rows = Vec::new();
    let mut stores = vec![Vec::new(); scenarios.len()];
    for round in 0..b.rounds {
        for (i, (scenario, p, kind)) in scenarios.iter().enumerate() {
            let (r, moved) = phase(b, gws[*p], *kind, round == 0).await;
            if let Some(moved) = moved {
                stores[i].push((moved, r.requests));
            }
            keep_round(b, &mut rows, (i, scenario, round), r);
        }
    }
    medians(b, &rows);
    // The misses with fsync: each phase durable, so its commits are the gateway's fsyncs.
    if stores[2].is_empty() || stores[2].iter().any(|(s, _)| s.commits == 0) {
        b.insane
            .push("embedded: a miss phase with fsync = true made no durable commit".into());
    }
    if rows.len() == scenarios.len() {
        let fsyncs = disk_fsyncs(disk.path(), if quick { 0.3 } else { 2.0 });
        b.notes.push(ratios(b, &rows, &stores, &fs, fsyncs));
    }
    let mib = |name: &str| {
        let file = disk.path().join(name).join("idemgate.redb");
        std::fs::metadata(file).map_or(0, |m| m.len()) / (1 << 20)
    };
    b.notes.push(format!(
        "embedded: gateway RSS after the phases: memory {} MiB, embedded (fsync) {} MiB; the redb file {} MiB (fsync), {} MiB (no fsync)",
        mem.rss_kib() / 1024,
        durable.rss_kib() / 1024,
        mib("fsync"),
        mib("no-fsync"),
    ));
    drop(gws);
    drop((lazy, durable, mem, nginx, up));
    b.redis_pids = redis_pids;
}

/// The scenarios in the order each round runs them: name, process (nginx, memory, embedded
/// with fsync, embedded without), keys.
fn scenarios(lazy: bool) -> Vec<(String, usize, Kind)> {
    let mut s = vec![
        ("nginx proxy, beside embedded".into(), 0, Kind::Unkeyed),
        (
            "gateway miss, memory, beside embedded".into(),
            1,
            Kind::Miss,
        ),
        ("gateway miss, embedded (fsync)".into(), 2, Kind::Miss),
        ("gateway replay, embedded (fsync)".into(), 2, Kind::Replay),
    ];
    if lazy {
        s.push(("gateway miss, embedded (no fsync)".into(), 3, Kind::Miss));
    }
    s
}

/// A directory for the stores on a disk: in `dir` unless that is in memory (tmpfs), else under
/// `target/`; and its file system's type, as `df` names it.
fn on_disk(dir: &Path) -> (tempfile::TempDir, String) {
    let fs = |p: &Path| {
        let out = std::process::Command::new("df")
            .args(["--output=fstype,source"])
            .arg(p)
            .output();
        out.ok()
            .and_then(|o| {
                let text = String::from_utf8_lossy(&o.stdout).into_owned();
                text.lines()
                    .nth(1)
                    .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" on "))
            })
            .unwrap_or_else(|| "an unknown file system".into())
    };
    let in_memory = |f: &str| f.starts_with("tmpfs") || f.starts_with("ramfs");
    let here = tempfile::tempdir_in(dir).unwrap();
    if !in_memory(&fs(here.path())) {
        let f = fs(here.path());
        return (here, f);
    }
    let there = tempfile::tempdir_in("target").unwrap();
    let f = fs(there.path());
    (there, f)
}

/// One closed-loop phase through `gw` (warmed up first in the first round, and before every
/// replay phase: the misses evict the oldest records once the store is at `max_entries`), with
/// what the store's metrics moved by when `gw` is a gateway.
async fn phase(b: &mut Bench, gw: &Proc, kind: Kind, first: bool) -> (Report, Option<Store>) {
    let keys = match kind {
        Kind::Unkeyed => Keys::None,
        Kind::Miss => Keys::Unique(b.prefix("emb-miss")),
        // 1000 keys, executed once by the warm-up, replayed after.
        Kind::Replay => Keys::Hot(format!("hot-emb-{}", b.size), 1000),
    };
    let keys = match first || kind == Kind::Replay {
        true => b.warm_up(&[gw.addr], keys, "emb-miss").await,
        false => keys,
    };
    let read = || {
        let mut s = store_metrics(&scrape(gw.admin?));
        s.writer = writer_sched(gw.pid()).unwrap_or_default();
        Some((s, Instant::now()))
    };
    let before = read();
    let r = b.closed(gw.addr, keys, &gw.pids()).await;
    let moved = before.zip(read()).map(|((x, t0), (y, t1))| Store {
        commits: y.commits.saturating_sub(x.commits),
        claims: (y.claims.0 - x.claims.0, y.claims.1 - x.claims.1),
        completes: (y.completes.0 - x.completes.0, y.completes.1 - x.completes.1),
        writer: (
            y.writer.0.saturating_sub(x.writer.0),
            y.writer.1.saturating_sub(x.writer.1),
        ),
        wall: (t1 - t0).as_nanos() as u64,
    });
    (r, moved)
}

/// The embedded store's writer thread in process `pid` (named `idemgate-store`): ns it has run
/// on a core and ns it has waited for one, from the kernel's schedstat.
fn writer_sched(pid: u32) -> Option<(u64, u64)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    tasks.flatten().find_map(|t| {
        let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
        if comm.trim() != "idemgate-store" {
            return None;
        }
        let stat = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
        let mut f = stat.split_whitespace().map(|v| v.parse::<u64>().ok());
        Some((f.next()??, f.next()??))
    })
}

/// The store's figures in a scrape: `idemgate_store_commits_total`, and the claims' and
/// completions' time and count from `idemgate_store_operation_seconds`.
fn store_metrics(text: &str) -> Store {
    let value = |prefix: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let op = |name: &str| {
        (
            value(&format!(
                "idemgate_store_operation_seconds_sum{{operation=\"{name}\"}} "
            )),
            value(&format!(
                "idemgate_store_operation_seconds_count{{operation=\"{name}\"}} "
            )) as u64,
        )
    };
    Store {
        commits: value("idemgate_store_commits_total ") as u64,
        claims: op("claim"),
        completes: op("complete"),
        ..Store::default()
    }
}

/// How many times a second one thread can overwrite 4 KiB of a file in `dir` and `fdatasync` it,
/// over `secs`: the disk's own floor for a durable commit (one device flush, no metadata).
fn disk_fsyncs(dir: &Path, secs: f64) -> f64 {
    use std::os::unix::fs::FileExt;
    let path = dir.join("fsync-probe");
    let file = std::fs::File::create(&path).unwrap();
    let block = [0x5au8; 4096];
    file.write_all_at(&block, 0).unwrap();
    file.sync_all().unwrap();
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_secs_f64(secs) {
        file.write_all_at(&block, 0).unwrap();
        file.sync_data().unwrap();
        n += 1;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(path);
    rate
}

/// The note of the ratios (each with the one CPU per request predicts in brackets), the fsyncs
/// per miss, and the store's time per claim and completion.
fn ratios(b: &Bench, rows: &[usize], stores: &[Vec<(Store, u64)>], fs: &str, disk: f64) -> String {
    let r = |i: usize| &b.rows[rows[i]].closed;
    let cpu = |i: usize| r(i).cpu.unwrap_or_default();
    let ratio = |a: usize, z: usize| {
        format!(
            "{:.2} [CPU {:.2}]",
            r(a).rps() / r(z).rps().max(f64::MIN_POSITIVE),
            cpu(z).all() / cpu(a).all().max(f64::MIN_POSITIVE)
        )
    };
    // Per round: fsyncs per miss, and ms per claim and per completion.
    let per_round = |i: usize| -> Vec<String> {
        stores[i]
            .iter()
            .map(|(s, misses)| {
                let ms = |(secs, n): (f64, u64)| secs * 1e3 / n.max(1) as f64;
                let share = |ns: u64| 100.0 * ns as f64 / s.wall.max(1) as f64;
                format!(
                    "{:.3} ({} commits / {misses} misses; claim {:.2} ms, completion {:.2} ms; the writer thread on a core {:.0}% of the phase, waiting for one {:.0}%)",
                    s.commits as f64 / (*misses).max(1) as f64,
                    s.commits,
                    ms(s.claims),
                    ms(s.completes),
                    share(s.writer.0),
                    share(s.writer.1),
                )
            })
            .collect()
    };
    let lazy = match rows.len() > 4 {
        true => format!(
            "; miss (no fsync) / miss (memory) = {}, its gateway CPU µs per miss {:.1}, its durable commits per miss by round: {}",
            ratio(4, 1),
            cpu(4).proxy,
            per_round(4).join(", ")
        ),
        false => String::new(),
    };
    let c = b.connections;
    format!(
        "embedded ({} body, {c} connections, {} rounds; the stores' directory on {fs}): miss (fsync) / miss (memory) = {} (goal >= 0.5); fsyncs per miss (fsync), by round: {} (goal < 0.2); replay (embedded) / nginx = {} (goal >= 1.0){lazy}; gateway CPU µs per miss: memory {:.1}, embedded (fsync) {:.1}; per replay {:.1}; the disk alone: {disk:.0} fsyncs/s ({:.2} ms each; 4 KiB overwritten and fdatasync'd, one thread)",
        human(b.size),
        b.rounds,
        ratio(2, 1),
        per_round(2).join(", "),
        ratio(3, 0),
        cpu(1).proxy,
        cpu(2).proxy,
        cpu(3).proxy,
        1e3 / disk.max(f64::MIN_POSITIVE),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_store_figures_of_a_scrape() {
        let text = "# TYPE idemgate_store_commits counter\nidemgate_store_commits_total 42\nidemgate_store_operation_seconds_sum{operation=\"claim\"} 0.5\nidemgate_store_operation_seconds_count{operation=\"claim\"} 100\nidemgate_store_operation_seconds_sum{operation=\"complete\"} 0.25\nidemgate_store_operation_seconds_count{operation=\"complete\"} 99\n";
        let s = store_metrics(text);
        assert_eq!(s.commits, 42);
        assert_eq!(s.claims, (0.5, 100));
        assert_eq!(s.completes, (0.25, 99));
    }
}
