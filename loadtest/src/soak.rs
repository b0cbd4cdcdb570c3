//! Section `soak`: the gateway's RSS over a long run of unique keys on Redis.

use std::time::{Duration, Instant};

use crate::bench::Bench;
use crate::load::{self, Keys, Pace};
use crate::procs;

/// The gateway's RSS across a long run of unique keys on Redis, sampled every 10 s.
pub async fn run(b: &mut Bench, redis_url: &str, secs: u64) {
    let up = procs::upstream(1024, 0);
    let gw = procs::gateway(&procs::config(up.addr).redis_url(redis_url).prefix("bench:")).await;
    let prefix = b.prefix("soak");
    let addr = gw.addr;
    let connections = b.connections;
    let load = tokio::spawn(async move {
        load::run(
            addr,
            "/v1/payments",
            Keys::Unique(prefix),
            connections,
            Duration::from_secs(secs),
            Pace::Closed,
        )
        .await
    });
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(secs) {
        tokio::time::sleep(Duration::from_secs(10).min(Duration::from_secs(secs))).await;
        samples.push(gw.rss_kib());
    }
    let r = load.await.unwrap();
    b.check("soak", &r, false);
    // The first sample is warm-up (pools and allocator arenas filling); flatness is judged after it.
    let steady = if samples.len() > 2 {
        &samples[1..]
    } else {
        &samples[..]
    };
    let (min, max) = (
        *steady.iter().min().unwrap_or(&0),
        *steady.iter().max().unwrap_or(&0),
    );
    let spread = if min > 0 {
        (max - min) as f64 / min as f64 * 100.0
    } else {
        0.0
    };
    b.notes.push(format!(
        "RSS soak: {secs} s of unique keys on Redis, {} requests ({:.0} req/s); gateway RSS every 10 s (MiB): {}; after the first sample min {} max {} KiB, spread {spread:.1}% ({})",
        r.requests,
        r.rps(),
        samples.iter().map(|k| format!("{:.1}", *k as f64 / 1024.0)).collect::<Vec<_>>().join(", "),
        min,
        max,
        if spread <= 10.0 { "flat within ±10%" } else { "NOT flat" }
    ));
}
