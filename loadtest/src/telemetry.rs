//! Section `telemetry`: what `[telemetry]` costs the miss and the replay (memory store, 1 KiB):
//! the gateway without it, exporting every trace (`sample_ratio = 1.0`), one in a hundred
//! (`0.01`), and every trace to a collector that is down; the collector is [`sink`], a child
//! process that answers every OTLP export `200`. Four gateways side by side, rounds
//! interleaved with the order rotated each round; each ratio against "off" is taken within a
//! round, then the median of the rounds, with the gateway's CPU per request.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::bench::{keep_round, medians, Bench};
use crate::load::{self, Keys, Report};
use crate::metrics::scrape;
use crate::procs::{self, Proc};

/// The gateways, in the order of the rows: name, `sample_ratio` (none: no `[telemetry]`),
/// whether its collector is down.
const SETUPS: [(&str, Option<f64>, bool); 4] = [
    ("off", None, false),
    ("on, sample_ratio 1.0", Some(1.0), false),
    ("on, sample_ratio 0.01", Some(0.01), false),
    ("on, 1.0, collector down", Some(1.0), true),
];

/// The paths each gateway is measured on.
const KINDS: [&str; 2] = ["miss", "replay"];

/// Section `telemetry`: the four gateways' miss and replay; the ratios to "off", CPU per
/// request, the miss's p50 with the collector down, and what reached the sink or was dropped.
pub async fn run(b: &mut Bench) {
    let redis_pids = std::mem::take(&mut b.redis_pids);
    b.size = 1024;
    b.request = load::small_request();
    let load_before = load_average();
    let up = procs::upstream(b.size, 0);
    b.upstream_pids = up.pids();
    let collector = procs::collector();
    // Nothing listens there.
    let down = testkit::free_addr();
    let mut gws: Vec<Proc> = Vec::new();
    for (_, ratio, is_down) in SETUPS {
        let at = if is_down { down } else { collector.addr };
        let config = match ratio {
            None => procs::config(up.addr),
            Some(r) => procs::config(up.addr)
                .set("telemetry.otlp_endpoint", format!("http://{at}"))
                .set("telemetry.sample_ratio", r),
        };
        gws.push(procs::gateway(&config).await);
    }
    let mut rows = Vec::new();
    // By kind, then setup: every round's report.
    let mut rounds = vec![vec![Vec::new(); SETUPS.len()]; KINDS.len()];
    for round in 0..b.rounds {
        for (k, kind) in KINDS.iter().enumerate() {
            for j in 0..SETUPS.len() {
                // Rotated every round, so that no gateway always follows the same one.
                let i = (j + round) % SETUPS.len();
                let r = phase(b, &gws[i], i, k == 1, round == 0).await;
                rounds[k][i].push(r.clone());
                let scenario = format!("gateway {kind}, memory, telemetry {}", SETUPS[i].0);
                keep_round(b, &mut rows, (k * SETUPS.len() + i, &scenario, round), r);
            }
        }
    }
    medians(b, &rows);
    let dropped: Vec<u64> = gws.iter().map(dropped_spans).collect();
    let received = exports(collector.addr);
    check(b, &dropped, received);
    b.notes.push(note(
        b,
        &rounds,
        &dropped,
        received,
        (load_before, load_average()),
    ));
    drop((gws, collector, up));
    b.redis_pids = redis_pids;
}

/// One closed-loop phase through gateway `i` (warmed up first when `first`): unique keys, or
/// (`replay`) 1000 keys executed by the warm-up and replayed after.
async fn phase(b: &mut Bench, gw: &Proc, i: usize, replay: bool, first: bool) -> Report {
    let keys = match replay {
        true => Keys::Hot(format!("hot-tel-{i}"), 1000),
        false => Keys::Unique(b.prefix("tel-miss")),
    };
    let keys = match first {
        true => b.warm_up(&[gw.addr], keys, "tel-miss").await,
        false => keys,
    };
    b.closed(gw.addr, keys, &gw.pids()).await
}

/// The sanity checks, none on a timing: spans reached the sink, the gateway whose collector
/// is down counted drops, the one without `[telemetry]` none.
fn check(b: &mut Bench, dropped: &[u64], received: (u64, u64)) {
    if received.0 == 0 {
        b.insane
            .push("telemetry: the sink collector received no export".into());
    }
    if dropped[3] == 0 {
        b.insane
            .push("telemetry: the gateway whose collector is down counted no dropped span".into());
    }
    // With the collector up, a burst the export thread cannot keep up with is dropped too (by
    // design: the queue is bounded): reported in the note, not a failure. Without
    // [telemetry], nothing is.
    if dropped[0] > 0 {
        b.insane.push(format!(
            "telemetry: the gateway without [telemetry] counted {} dropped spans",
            dropped[0]
        ));
    }
}

/// The note: throughput ratios to "off" (median of the per-round ratios, and each round's),
/// CPU per request, the miss's p50, and the spans exported or dropped.
fn note(
    b: &Bench,
    rounds: &[Vec<Vec<Report>>],
    dropped: &[u64],
    received: (u64, u64),
    load: (String, String),
) -> String {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let cpu = |r: &Report| r.cpu.map_or(0.0, |c| c.proxy);
    let mut parts = Vec::new();
    for (k, kind) in KINDS.iter().enumerate() {
        let by_setup = &rounds[k];
        let ratios: Vec<String> = (1..SETUPS.len())
            .map(|i| {
                let paired: Vec<f64> = by_setup[i]
                    .iter()
                    .zip(&by_setup[0])
                    .map(|(on, off)| on.rps() / off.rps().max(f64::MIN_POSITIVE))
                    .collect();
                let shown: Vec<String> = paired.iter().map(|p| format!("{p:.3}")).collect();
                format!(
                    "{} {:.3} (by round {})",
                    SETUPS[i].0,
                    median(paired.clone()),
                    shown.join(", ")
                )
            })
            .collect();
        let cpus: Vec<String> = (0..SETUPS.len())
            .map(|i| {
                let c = median(by_setup[i].iter().map(cpu).collect());
                format!("{} {c:.1}", SETUPS[i].0)
            })
            .collect();
        let p50: Vec<String> = (0..SETUPS.len())
            .map(|i| {
                let p = median(by_setup[i].iter().map(|r| r.ms(0.5)).collect());
                format!("{} {p:.2}", SETUPS[i].0)
            })
            .collect();
        parts.push(format!(
            "{kind}: req/s against off {}; gateway CPU µs per request {}; p50 ms {}",
            ratios.join(", "),
            cpus.join(", "),
            p50.join(", ")
        ));
    }
    format!(
        "telemetry (1 KiB, memory store, {} connections, {} round{}, order rotated each round; goals against off: >= 0.85 at 1.0, >= 0.97 at 0.01; load average before {}, after {}): {}; the sink received {} exports ({:.1} MiB); spans dropped (off, 1.0, 0.01, collector down): {:?}",
        b.connections,
        b.rounds,
        if b.rounds == 1 { "" } else { "s" },
        load.0,
        load.1,
        parts.join("; "),
        received.0,
        received.1 as f64 / (1 << 20) as f64,
        dropped,
    )
}

/// The gateway's `idemgate_trace_spans_dropped_total`.
fn dropped_spans(gw: &Proc) -> u64 {
    let Some(admin) = gw.admin else { return 0 };
    scrape(admin)
        .lines()
        .find_map(|l| l.strip_prefix("idemgate_trace_spans_dropped_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// The first three fields of /proc/loadavg.
pub fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// What the sink at `addr` received: exports and bytes (`GET /__count`).
fn exports(addr: SocketAddr) -> (u64, u64) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, 0);
    };
    let _ = s.write_all(b"GET /__count HTTP/1.0\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let body = text.rsplit("\r\n\r\n").next().unwrap_or_default();
    let mut fields = body.split_whitespace().map(|f| f.parse().unwrap_or(0));
    (fields.next().unwrap_or(0), fields.next().unwrap_or(0))
}

/// The sink collector: reads every request whole and answers `200` with an empty body (an empty
/// `ExportTraceServiceResponse`: all accepted); counts exports and bytes, told by
/// `GET /__count` as `<exports> <bytes>`.
pub async fn sink(addr: SocketAddr) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    let counts = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    loop {
        let (stream, _) = listener.accept().await?;
        let counts = counts.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let counts = counts.clone();
                async move {
                    if req.uri().path() == "/__count" {
                        let (n, bytes) = (&counts.0, &counts.1);
                        let text = format!(
                            "{} {}",
                            n.load(Ordering::Relaxed),
                            bytes.load(Ordering::Relaxed)
                        );
                        return Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(text))));
                    }
                    let body = req.into_body().collect().await.map(|b| b.to_bytes());
                    let len = body.map_or(0, |b| b.len() as u64);
                    counts.0.fetch_add(1, Ordering::Relaxed);
                    counts.1.fetch_add(len, Ordering::Relaxed);
                    let mut resp = Response::new(Full::new(Bytes::new()));
                    resp.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/x-protobuf"),
                    );
                    Ok(resp)
                }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
