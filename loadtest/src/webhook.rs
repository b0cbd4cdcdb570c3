//! Section `webhook`: verified webhook ingress. Stripe-signed deliveries through the gateway on
//! a `webhook = "stripe"` route (each event's first delivery verified and forwarded, then its
//! duplicates, signed again, replayed), against nginx passing the same deliveries, and beside
//! the gateway's keyed miss with an `Idempotency-Key` and no signature.

use std::path::Path;

use crate::bench::{human, keep_round, medians, Bench, PAYMENTS};
use crate::load::{Keys, Report, WEBHOOK_SECRET};
use crate::procs;

/// The variable the gateway reads the delivery secret from.
const SECRET_VAR: &str = "LOADTEST_WEBHOOK_SECRET";

/// Interleaved rounds of the four scenarios on the memory store, the upstream answering 1 KiB;
/// the note gives the gateway's CPU per request on each path and what verifying costs over a
/// keyed miss.
pub async fn run(b: &mut Bench, dir: &Path) {
    let up = procs::upstream(1024, 0);
    b.upstream_pids = up.pids();
    b.redis_pids = Vec::new();
    let nginx = procs::nginx(dir, up.addr);
    let route = toml::toml! { webhook = "stripe" webhook_secret_env = "LOADTEST_WEBHOOK_SECRET" };
    let config = procs::config(up.addr)
        .route(PAYMENTS, route)
        .env(SECRET_VAR, WEBHOOK_SECRET);
    let hooks = procs::gateway(&config).await;
    let keyed = procs::gateway(&procs::config(up.addr)).await;
    let (nginx_pids, hooks_pids, keyed_pids) = (nginx.pids(), hooks.pids(), keyed.pids());
    let stripe = |keys: Keys| Keys::Stripe(Box::new(keys));
    let hot = b.prefix("webhook-hot");
    let scenarios = [
        (
            "nginx, Stripe delivery",
            nginx.addr,
            &nginx_pids,
            stripe(Keys::Unique(String::new())),
        ),
        (
            "gateway webhook, first delivery (verified)",
            hooks.addr,
            &hooks_pids,
            stripe(Keys::Unique(String::new())),
        ),
        (
            "gateway webhook, duplicate (replayed)",
            hooks.addr,
            &hooks_pids,
            stripe(Keys::Hot(hot, 1000)),
        ),
        (
            "gateway keyed miss, no signature",
            keyed.addr,
            &keyed_pids,
            Keys::Unique(String::new()),
        ),
    ];
    let mut rows = Vec::new();
    for round in 0..b.rounds {
        for (i, (scenario, addr, pids, keys)) in scenarios.iter().enumerate() {
            let keys = match round {
                0 => b.warm_up(&[*addr], keys.clone(), "webhook").await,
                _ => match keys {
                    Keys::Stripe(inner) if matches!(**inner, Keys::Unique(_)) => {
                        stripe(Keys::Unique(b.prefix("webhook")))
                    }
                    Keys::Unique(_) => Keys::Unique(b.prefix("webhook")),
                    k => k.clone(),
                },
            };
            let r = b.closed(*addr, keys, pids).await;
            keep_round(b, &mut rows, (i, scenario, round), r);
        }
    }
    medians(b, &rows);
    let cpu = |row: usize| {
        let mut v: Vec<f64> = b.rows[row]
            .samples
            .iter()
            .map(|r: &Report| r.cpu.map_or(0.0, |c| c.proxy))
            .collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [n, first, dup, miss] = [rows[0], rows[1], rows[2], rows[3]].map(cpu);
    let rps = |row: usize| b.rows[row].closed.rps();
    b.notes.push(format!(
        "webhook (Stripe deliveries, memory store, {} answer, {} rounds): proxy CPU per request: nginx {n:.1} µs, gateway first delivery (verified, recorded) {first:.1} µs, duplicate (verified, replayed) {dup:.1} µs, keyed miss without a signature {miss:.1} µs (verifying costs {:+.1} µs); req/s first delivery / nginx = {:.2}, duplicate / nginx = {:.2}",
        human(b.size),
        b.rounds,
        first - miss,
        rps(rows[1]) / rps(rows[0]).max(f64::MIN_POSITIVE),
        rps(rows[2]) / rps(rows[0]).max(f64::MIN_POSITIVE),
    ));
    drop((up, nginx, hooks, keyed));
}
