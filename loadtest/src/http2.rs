//! Section `http2`: replays over HTTP/2 against HTTP/1.1, driven by h2load.

use std::path::Path;

use crate::bench::Bench;
use crate::procs;

/// Replays of one key driven by h2load (nghttp2's load generator), over HTTP/2 (h2c, 32 streams
/// on each of 8 connections) against HTTP/1.1 (64 connections, one request at a time each), on
/// the same gateway: the throughput ratio, and the gateway's CPU per request.
pub async fn run(b: &mut Bench, dir: &Path) {
    let up = procs::upstream(1024, 0);
    let gw = procs::gateway(&procs::config(up.addr)).await;
    let body = dir.join("h2load-body.json");
    std::fs::write(&body, b"{\"amount\":1000}").unwrap();
    let pids = gw.pids();
    let secs = b.secs.as_secs_f64().max(1.0).round() as u64;
    let mut results = Vec::new();
    for (label, protocol) in [
        ("HTTP/2", &["-c", "8", "-m", "32"][..]),
        ("HTTP/1.1", &["--h1", "-c", "64", "-m", "1"][..]),
    ] {
        let cpu_before = procs::cpu_ns(&pids);
        let out = std::process::Command::new("h2load")
            .args(protocol)
            .args(["-D", &secs.to_string(), "--warm-up-time", "1"])
            .args([
                "-H",
                "idempotency-key: h2load-hot",
                "-H",
                "content-type: application/json",
            ])
            .arg("-d")
            .arg(&body)
            .arg(format!("http://{}/v1/payments", gw.addr))
            .output();
        let cpu_after = procs::cpu_ns(&pids);
        let Ok(out) = out else {
            b.insane
                .push("h2load is not installed (Debian package nghttp2-client)".into());
            return;
        };
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let rps = text
            .lines()
            .find(|l| l.starts_with("finished in"))
            .and_then(|l| l.split(", ").nth(1))
            .and_then(|v| v.trim_end_matches(" req/s").parse::<f64>().ok());
        let done = text
            .lines()
            .find(|l| l.starts_with("requests:"))
            .and_then(|l| l.split(", ").find(|p| p.ends_with("succeeded")))
            .and_then(|p| p.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
        let twoxx = text
            .lines()
            .find(|l| l.starts_with("status codes:"))
            .and_then(|l| l.split_whitespace().nth(2))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        match rps {
            Some(rps) if done > 0 && twoxx * 100 >= done * 99 => {
                let cpu = (cpu_after - cpu_before) as f64 / 1e3 / done as f64;
                eprintln!("  replay over {label:<8} (h2load)       {rps:>9.0} req/s  gateway CPU {cpu:.1} µs/req");
                results.push((label, rps, cpu));
            }
            _ => b.insane.push(format!(
                "replay over {label} (h2load): {}",
                text.lines()
                    .filter(|l| l.starts_with("finished")
                        || l.starts_with("requests")
                        || l.starts_with("status"))
                    .collect::<Vec<_>>()
                    .join("; ")
            )),
        }
    }
    if let [(_, h2, h2_cpu), (_, h1, h1_cpu)] = results[..] {
        b.notes.push(format!(
            "replay over HTTP/2 / over HTTP/1.1 (1 KiB, h2load, one gateway on the memory store) = {:.2} [CPU {:.2}] ({h2:.0} vs {h1:.0} req/s; gateway CPU {h2_cpu:.1} vs {h1_cpu:.1} µs per request)",
            h2 / h1,
            h1_cpu / h2_cpu,
        ));
    }
    drop((up, gw));
}
