//! The printed results: the table, the CPU per request of each row, the ratios and the notes.

use std::collections::HashMap;

use crate::bench::{human, Bench};

/// Print the results of `b`.
pub fn print(b: &Bench) {
    println!(
        "\n| scenario | body | req/s (median of {}) | rounds req/s | p50 ms | p99 ms | p99.9 ms | added p50 ms @rate | added p99 ms @rate | proxy CPU µs/req | all CPU µs/req | 409s + errors |",
        b.rounds
    );
    println!("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut direct_rate: HashMap<usize, (f64, f64)> = HashMap::new();
    for row in &b.rows {
        if row.scenario == "direct to upstream" {
            if let Some(r) = &row.at_rate {
                direct_rate.insert(row.body, (r.ms(0.5), r.ms(0.99)));
            }
        }
    }
    for row in &b.rows {
        let r = &row.closed;
        let (added50, added99) = match (&row.at_rate, direct_rate.get(&row.body)) {
            (Some(x), Some((d50, d99))) if row.scenario != "direct to upstream" => (
                format!("{:+.3}", x.ms(0.5) - d50),
                format!("{:+.3}", x.ms(0.99) - d99),
            ),
            (Some(x), _) => (
                format!("({:.3})", x.ms(0.5)),
                format!("({:.3})", x.ms(0.99)),
            ),
            _ => ("".into(), "".into()),
        };
        let rounds: Vec<String> = row
            .samples
            .iter()
            .map(|x| format!("{:.0}", x.rps()))
            .collect();
        let (proxy_cpu, all_cpu) = match r.cpu {
            Some(c) => (format!("{:.1}", c.proxy), format!("{:.1}", c.all())),
            None => (String::new(), String::new()),
        };
        println!(
            "| {} | {} | {:.0} | {} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} | {} |",
            row.scenario,
            human(row.body),
            r.rps(),
            rounds.join(", "),
            r.ms(0.5),
            r.ms(0.99),
            r.ms(0.999),
            added50,
            added99,
            proxy_cpu,
            all_cpu,
            r.conflicts + r.errors
        );
    }
    println!(
        "\nCPU per request, µs (median round; proxy + upstream + Redis + load generator = all):"
    );
    for row in &b.rows {
        if let Some(c) = row.closed.cpu {
            println!(
                "- {}, {}: {:.1} + {:.1} + {:.1} + {:.1} = {:.1}",
                row.scenario,
                human(row.body),
                c.proxy,
                c.upstream,
                c.redis,
                c.load,
                c.all()
            );
        }
    }
    first_byte(b);
    println!("\nratios (same run; in brackets the same ratio from CPU per request of all processes, which noise moves less):");
    for &size in &[1024usize, 65536] {
        let get = |name: &str| figures(b, size, name);
        for path in [
            "gateway miss, redis",
            "gateway replay, redis",
            "gateway replay, redis, local_cache 0",
        ] {
            let seal = |mode: &str| get(&format!("{path}, seal {mode}"));
            if let (Some(off), Some(on)) = (seal("off"), seal("on")) {
                println!(
                    "- {}: {path}, seal on / off = {} (target >= 0.9)",
                    human(size),
                    ratio(on, off)
                );
            }
        }
        stream_ratios(b, size);
        let (Some(nginx), Some(pass)) = (get("nginx proxy"), get("gateway pass-through (no key)"))
        else {
            continue;
        };
        println!(
            "- {}: pass-through / nginx = {} (target >= 1.0)",
            human(size),
            ratio(pass, nginx)
        );
        for store in ["memory", "redis"] {
            if let Some(replay) = get(&format!("gateway replay, {store}")) {
                println!(
                    "- {}: replay ({store}) / nginx = {} (target >= 1.0)",
                    human(size),
                    ratio(replay, nginx)
                );
            }
            if let Some(miss) = get(&format!("gateway miss, {store}")) {
                println!(
                    "- {}: miss ({store}) / pass-through = {} (target >= 0.6)",
                    human(size),
                    ratio(miss, pass)
                );
            }
        }
    }
    if !b.chaos.is_empty() {
        println!("\nchaos (per backend and lease; duplicates beyond one execution per key):");
        println!("{}", crate::chaos::TABLE_HEAD);
        b.chaos.iter().for_each(|row| println!("{row}"));
    }
    println!("\nnotes:");
    b.notes.iter().for_each(|n| println!("- {n}"));
}

/// The req/s of the row `name` at `size`, and its CPU per request of all processes.
fn figures(b: &Bench, size: usize, name: &str) -> Option<(f64, f64)> {
    b.rows
        .iter()
        .find(|r| r.body == size && r.scenario == name)
        .map(|r| (r.closed.rps(), r.closed.cpu.map(|c| c.all()).unwrap_or(0.0)))
}

/// Throughput ratio a / b of two rows' [`figures`], and in brackets the one CPU predicts: b's
/// CPU per request / a's.
fn ratio(a: (f64, f64), b: (f64, f64)) -> String {
    let by_cpu = if a.1 > 0.0 { b.1 / a.1 } else { 0.0 };
    format!("{:.2} [{by_cpu:.2}]", a.0 / b.0)
}

/// The stream section's replays against nginx, when it ran at `size`.
fn stream_ratios(b: &Bench, size: usize) {
    for (gateway, nginx) in [
        (
            "gateway replay, redis, event stream",
            "nginx proxy, event stream",
        ),
        (
            "gateway replay, redis, event stream",
            "nginx proxy, proxy_buffering off, 64 KiB stream",
        ),
        (
            "gateway replay, redis, local_cache 0, event stream",
            "nginx proxy, event stream",
        ),
    ] {
        if let (Some(g), Some(n)) = (figures(b, size, gateway), figures(b, size, nginx)) {
            println!("- {}: {gateway} / {nginx} = {}", human(size), ratio(g, n));
        }
    }
}

/// The first-byte rows (section `stream`), when there are: percentiles over all their rounds,
/// each added to those of the row it is compared with.
fn first_byte(b: &Bench) {
    if b.first_byte.is_empty() {
        return;
    }
    println!("\nfirst byte at a fixed rate (open loop; percentiles over all rounds, CPU of the median round; added: over the row it is compared with, direct for the pass-through, the pass-through for a keyed miss):");
    println!("| scenario | body | rate /s | requests | first byte p50 ms | p99 ms | p99.9 ms | added p50 ms | added p99 ms | added p99.9 ms | whole answer p50 ms | p99 ms | proxy CPU µs/req | all CPU µs/req | 409s + errors |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for row in &b.first_byte {
        let r = row.merged();
        let against = row.against.as_ref().and_then(|name| {
            let other = b.first_byte.iter().find(|o| &o.scenario == name)?;
            Some(other.merged())
        });
        let added = |q: f64| {
            against.as_ref().map_or(String::new(), |o| {
                format!("{:+.3}", r.first_byte_ms(q) - o.first_byte_ms(q))
            })
        };
        let (proxy_cpu, all_cpu) = match r.cpu {
            Some(c) => (format!("{:.1}", c.proxy), format!("{:.1}", c.all())),
            None => (String::new(), String::new()),
        };
        println!(
            "| {} | {} | {:.0} | {} | {:.3} | {:.3} | {:.3} | {} | {} | {} | {:.2} | {:.2} | {} | {} | {} |",
            row.scenario,
            human(row.body),
            row.rate,
            r.requests,
            r.first_byte_ms(0.5),
            r.first_byte_ms(0.99),
            r.first_byte_ms(0.999),
            added(0.5),
            added(0.99),
            added(0.999),
            r.ms(0.5),
            r.ms(0.99),
            proxy_cpu,
            all_cpu,
            r.conflicts + r.errors
        );
    }
}
