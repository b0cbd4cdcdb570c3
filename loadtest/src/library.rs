//! Section `library`: the layer inside an axum app against the app alone.

use crate::bench::{phase, Bench};
use crate::load::{Keys, Report};
use crate::procs;

/// The library's figure: an axum app with idemgate's layer on its route against the same app
/// without it (1 KiB bodies): replay throughput, and the latency a miss adds at p50 (at a fixed
/// rate, a quarter of the slower maximum, so that queueing does not count as added latency).
pub async fn run(b: &mut Bench) {
    b.size = 1024;
    let plain = procs::app(b.size, false);
    let layered = procs::app(b.size, true);
    let (plain_pids, layered_pids) = (plain.pids(), layered.pids());
    b.upstream_pids = Vec::new();
    let hot = || Keys::Hot(String::new(), 1000);
    let alone = phase(b, "axum app alone", plain.addr, &plain_pids, hot(), None).await;
    let replay = phase(
        b,
        "axum app + layer, replay",
        layered.addr,
        &layered_pids,
        hot(),
        None,
    )
    .await;
    let miss = phase(
        b,
        "axum app + layer, miss",
        layered.addr,
        &layered_pids,
        Keys::Unique(String::new()),
        None,
    )
    .await;
    // A quarter of the slower maximum: on a small machine the load generator shares the cores,
    // and at half the added latency would be mostly queueing.
    let rate = (alone.rps().min(miss.rps()) / 4.0).max(100.0);
    let alone_at = b.at_rate(plain.addr, Keys::None, rate).await;
    let fresh = Keys::Unique(b.prefix("app-rate-miss"));
    let miss_at = b.at_rate(layered.addr, fresh, rate).await;
    b.check("axum app alone at a fixed rate", &alone_at, false);
    b.check("axum app + layer, miss at a fixed rate", &miss_at, false);
    let cpu = |r: &Report| r.cpu.map_or(0.0, |c| c.proxy);
    b.notes.push(format!(
        "library (1 KiB, axum app in-process): replay through the layer / the app alone = {:.2} [CPU {:.2}] ({:.1} vs {:.1} µs of app CPU per request); a miss adds {:+.3} ms at p50 and {:+.3} ms at p99 at {rate:.0} req/s (app alone p50 {:.3} ms, miss through the layer {:.3} ms; miss CPU {:.1} µs per request)",
        replay.rps() / alone.rps(),
        if cpu(&replay) > 0.0 { cpu(&alone) / cpu(&replay) } else { 0.0 },
        cpu(&replay),
        cpu(&alone),
        miss_at.ms(0.5) - alone_at.ms(0.5),
        miss_at.ms(0.99) - alone_at.ms(0.99),
        alone_at.ms(0.5),
        miss_at.ms(0.5),
        cpu(&miss),
    ));
    drop((plain, layered));
}
