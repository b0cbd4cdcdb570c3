//! Section `fingerprint`: what `fingerprint = "json"` costs over "exact" on the miss path.

use crate::bench::{human, phase, Bench};
use crate::load::{self, Keys, Report};
use crate::procs;

/// What `fingerprint = "json"` costs over "exact": the miss path on the memory store, with a
/// JSON request body of each size (a payments order with line items, see
/// [`load::json_request`]) and two ignored fields, one inside the items array; interleaved
/// rounds, the CPU per miss of the gateway side by side. The upstream answers 1 KiB.
pub async fn run(b: &mut Bench, sizes: &[usize]) {
    let up = procs::upstream(1024, 0);
    b.upstream_pids = up.pids();
    b.redis_pids = Vec::new();
    let on = |mode: &str| {
        procs::config(up.addr).route(
            "/v1/payments",
            toml::toml! {
                methods = ["POST"]
                fingerprint = mode
                fingerprint_ignore = ["/request_id", "/items/*/client_ts"]
            },
        )
    };
    let exact = procs::gateway(&on("exact")).await;
    let json = procs::gateway(&on("json")).await;
    let (exact_pids, json_pids) = (exact.pids(), json.pids());
    // Three rounds at least: the figure is a difference of a few per cent.
    let rounds = b.rounds.max(3);
    for &size in sizes {
        b.request = load::json_request(size);
        b.size = b.request.len();
        let label = |mode: &str| format!("gateway miss, fingerprint {mode}");
        let start = b.rows.len();
        phase(
            b,
            &label("exact"),
            exact.addr,
            &exact_pids,
            Keys::Unique(String::new()),
            None,
        )
        .await;
        phase(
            b,
            &label("json"),
            json.addr,
            &json_pids,
            Keys::Unique(String::new()),
            None,
        )
        .await;
        for round in 1..rounds {
            for (i, addr, pids) in [
                (start, exact.addr, &exact_pids),
                (start + 1, json.addr, &json_pids),
            ] {
                let keys = Keys::Unique(b.prefix("fp-miss"));
                let r = b.closed(addr, keys, pids).await;
                b.check(
                    &format!("{} (round {})", b.rows[i].scenario, round + 1),
                    &r,
                    false,
                );
                b.rows[i].samples.push(r);
            }
        }
        // The median CPU per miss of each, and the req/s of the same rounds.
        let median = |samples: &[Report], f: &dyn Fn(&Report) -> f64| {
            let mut v: Vec<f64> = samples.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let gw_cpu = |r: &Report| r.cpu.map_or(0.0, |c| c.proxy);
        for row in &mut b.rows[start..] {
            let mut samples = row.samples.clone();
            samples.sort_by(|x, y| x.rps().total_cmp(&y.rps()));
            row.closed = samples[samples.len() / 2].clone();
        }
        let (e, j) = (&b.rows[start].samples, &b.rows[start + 1].samples);
        let (e_cpu, j_cpu) = (median(e, &gw_cpu), median(j, &gw_cpu));
        let (e_rps, j_rps) = (median(e, &Report::rps), median(j, &Report::rps));
        b.notes.push(format!(
            "fingerprint (miss, memory store, {} JSON request, 2 ignored pointers, {rounds} rounds): gateway CPU per miss json {j_cpu:.1} µs vs exact {e_cpu:.1} µs ({:+.1}%); req/s json / exact = {:.2}",
            human(b.request.len()),
            (j_cpu / e_cpu.max(f64::MIN_POSITIVE) - 1.0) * 100.0,
            j_rps / e_rps.max(f64::MIN_POSITIVE),
        ));
    }
    b.request = load::small_request();
    drop((up, exact, json));
}
