//! Section `stream`: streamed answers (`stream = true`) on Redis, one gateway with a streamed
//! route in front of the upstream's event streams (`upstream.rs`, `?size=&events=&gap_ms=`).
//!
//! - **First byte at a fixed rate**: a 1 KiB event stream whose head and first event come at
//!   once and three more events `GAP_MS` apart, straight from the upstream, passed through the
//!   gateway (no key) and as a keyed miss on the same route (a fresh key each), on Redis and, to
//!   tell the store's round trip from the streaming, on the memory store; open loop at `RATE`,
//!   rounds interleaved with the order rotated. Time to the first byte of body: its percentiles
//!   over all rounds and by round, each keyed miss's against the pass-through's, and the CPU
//!   per request of each.
//! - **Replay of a 64 KiB event stream**: 16 events sent at once, chunked (no `Content-Length`),
//!   replayed through the gateway (its local cache, and `local_cache = "0"`) against nginx
//!   proxying the upstream's same answer (unbuffered, as in front of event streams, and buffered
//!   as in the main table); closed loop, rounds interleaved.
//!
//! The checks, none on a timing: the gateway streams (the first bytes a client reads of a slow
//! stream hold its first event only), the keyed answers and their replays are the upstream's
//! bytes, a replay after `Last-Event-ID` holds the events after it, no replay phase ran the
//! upstream, and the upstream ran each key once.

use std::net::SocketAddr;
use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use redis::aio::MultiplexedConnection;
use testkit::GatewayConfig;

use crate::bench::{keep_round, medians, Bench, FirstByteRow, PAYMENTS};
use crate::expiry::flush;
use crate::load::{self, Keys, Pace, Report};
use crate::metrics::{executions, executions_per_key, round_trips, scrape};
use crate::procs::{self, Proc};
use crate::telemetry::load_average;
use crate::upstream::sse_events;

/// The streamed route.
const ROUTE: &str = "/v1/stream";
/// The first-byte phases' answer: its size, events, and the gap between events.
const EVENTS: (usize, usize) = (1024, 4);
const GAP_MS: u64 = 5;
/// The first-byte phases' rate and connections: each connection sends a request every 32 ms,
/// twice as long as an answer takes, so that none waits for the one before.
const RATE: f64 = 1000.0;
const RATE_CONNECTIONS: usize = 32;
/// The replayed answer: 64 KiB in 16 events, all at once.
const EXPORT: (usize, usize) = (65536, 16);
/// The keys the replay phases cycle over, per gateway: 12.5 MiB of records, well inside the
/// local cache's default 64 MiB.
const HOT: u64 = 200;

/// The first-byte scenarios, in the order of their rows, each with the row it is compared with.
const FIRST_BYTE: [(&str, Option<usize>); 4] = [
    ("event stream, direct to upstream", None),
    ("event stream, gateway pass-through (no key)", Some(0)),
    ("event stream, gateway keyed miss, redis", Some(1)),
    ("event stream, gateway keyed miss, memory", Some(1)),
];

/// The replay scenarios, in the order of their rows (the chart compares the gateway's with the
/// nginx row named like them).
const REPLAY: [&str; 4] = [
    "nginx proxy, proxy_buffering off, 64 KiB stream",
    "nginx proxy, event stream",
    "gateway replay, redis, event stream",
    "gateway replay, redis, local_cache 0, event stream",
];

/// `ROUTE` asking the upstream for `events` events of `size` bytes in all, `gap_ms` apart.
fn path(size: usize, events: usize, gap_ms: u64) -> String {
    format!("{ROUTE}?size={size}&events={events}&gap_ms={gap_ms}")
}

/// A gateway on the run's Redis with `ROUTE` streamed; without the local cache unless `cached`.
async fn gateway(redis_url: &str, upstream: SocketAddr, cached: bool) -> Proc {
    let config = streamed(upstream).redis_url(redis_url);
    let config = match cached {
        true => config.prefix("stream:"),
        false => config.prefix("stream-nc:").set("store.local_cache", "0"),
    };
    procs::gateway(&config).await
}

/// A gateway in front of `upstream` with `ROUTE` streamed.
fn streamed(upstream: SocketAddr) -> GatewayConfig {
    procs::config(upstream).route(ROUTE, toml::toml! { stream = true })
}

/// Section `stream`: the first byte at a fixed rate, then the replays against nginx; `quick`
/// (the CI smoke run) in phases of 0.5 s at most.
pub async fn run(
    b: &mut Bench,
    dir: &Path,
    (redis_conn, redis_url): (&mut MultiplexedConnection, &str),
    quick: bool,
) {
    let (load_before, size, secs) = (load_average(), b.size, b.secs);
    if quick {
        b.secs = secs.min(std::time::Duration::from_millis(500));
    }
    flush(redis_conn).await;
    let up = procs::upstream_with(EVENTS.0, 0, true);
    b.upstream_pids = up.pids();
    let gws = [
        gateway(redis_url, up.addr, true).await,
        gateway(redis_url, up.addr, false).await,
    ];
    streams(b, &gws[0]).await;
    let memory = procs::gateway(&streamed(up.addr)).await;
    first_byte(b, [&gws[0], &memory], &up).await;
    drop(memory);
    replay(b, dir, &gws, &up).await;
    executed_once(b, up.addr).await;
    b.notes.push(format!(
        "stream: load average {load_before} at the section's start, {} at its end",
        load_average()
    ));
    (b.path, b.size, b.secs) = (PAYMENTS.to_string(), size, secs);
    drop((gws, up));
    // The records of the section are of no use to the next ones.
    flush(redis_conn).await;
}

/// What a client got: status, whether it was a replay, content type, its first frame of body
/// and the whole body.
struct Answer {
    status: u16,
    replayed: bool,
    content_type: String,
    first: Bytes,
    body: Bytes,
}

/// One POST to `path` on a new connection, with `key` and `Last-Event-ID` when given; `None`
/// without a whole answer within 10 s.
async fn fetch(
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    last_event_id: Option<&str>,
) -> Option<Answer> {
    let answer = fetch_once(addr, path, key, last_event_id);
    tokio::time::timeout(std::time::Duration::from_secs(10), answer)
        .await
        .ok()?
}

async fn fetch_once(
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    last_event_id: Option<&str>,
) -> Option<Answer> {
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let (mut s, conn) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .ok()?;
    tokio::spawn(conn);
    let mut req = http::Request::post(path)
        .header("host", "bench")
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    if let Some(id) = last_event_id {
        req = req.header("last-event-id", id);
    }
    let resp = s
        .send_request(req.body(Full::new(load::small_request())).ok()?)
        .await
        .ok()?;
    let header = |name: &str| {
        let v = resp.headers().get(name);
        v.and_then(|v| v.to_str().ok()).unwrap_or("").to_string()
    };
    let (replayed, content_type) = (
        header("idempotent-replayed") == "true",
        header("content-type"),
    );
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut all = Vec::new();
    let mut first = None;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.ok()?.into_data() {
            first.get_or_insert_with(|| data.clone());
            all.extend_from_slice(&data);
        }
    }
    Some(Answer {
        status,
        replayed,
        content_type,
        first: first.unwrap_or_default(),
        body: all.into(),
    })
}

/// The check that the rows measure a streamed answer: through the gateway, keyed and not, the
/// first bytes of a stream whose second event comes 200 ms after its first hold the first event
/// only, and the whole answer is the upstream's (and, keyed, so is its replay).
async fn streams(b: &mut Bench, gw: &Proc) {
    let slow = path(EVENTS.0, 2, 200);
    let events = sse_events(EVENTS.0, 2);
    let whole: Bytes = events.concat().into();
    let key = b.prefix("stream-probe");
    for (what, key) in [("pass-through", None), ("keyed miss", Some(key.as_str()))] {
        match fetch(gw.addr, &slow, key, None).await {
            Some(a) if a.status == 200 && a.body == whole => {
                if a.first.len() > events[0].len() {
                    b.insane.push(format!(
                        "stream: the {what}'s first {} bytes held more than the first event ({} bytes): not streamed",
                        a.first.len(),
                        events[0].len()
                    ));
                }
            }
            Some(a) => b.insane.push(format!(
                "stream: the {what} answered {} with {} bytes, not the upstream's {}",
                a.status,
                a.body.len(),
                whole.len()
            )),
            None => b.insane.push(format!("stream: the {what} got no answer")),
        }
    }
    let replay = fetch(gw.addr, &slow, Some(&key), None).await;
    if !replay.is_some_and(|a| a.status == 200 && a.replayed && a.body == whole) {
        b.insane
            .push("stream: the probe's replay is not the recorded stream".into());
    }
}

/// The first-byte phases: each scenario at `RATE`, rounds interleaved, order rotated each round.
async fn first_byte(b: &mut Bench, [gw, memory]: [&Proc; 2], up: &Proc) {
    b.path = path(EVENTS.0, EVENTS.1, GAP_MS);
    b.size = EVENTS.0;
    let connections = std::mem::replace(&mut b.connections, RATE_CONNECTIONS);
    let target = |i: usize| match i {
        0 => (up.addr, Vec::new()),
        3 => (memory.addr, memory.pids()),
        _ => (gw.addr, gw.pids()),
    };
    let keys = |b: &mut Bench, i: usize| match i {
        2 | 3 => Keys::Unique(b.prefix("stream-miss")),
        _ => Keys::None,
    };
    for i in 0..FIRST_BYTE.len() {
        let k = keys(b, i);
        b.warm_up(&[target(i).0], k, "stream-miss").await;
    }
    let admin = gw.admin.expect("the gateway has an admin listener");
    let mut rounds: Vec<Vec<Report>> = vec![Vec::new(); FIRST_BYTE.len()];
    // Per keyed round: Redis round trips per miss, and claims slower than 0.8, 1.6, 3.2 ms.
    let mut trips = Vec::new();
    for round in 0..b.rounds {
        for j in 0..FIRST_BYTE.len() {
            let i = (j + round) % FIRST_BYTE.len();
            let ((addr, pids), k) = (target(i), keys(b, i));
            let before = (round_trips(admin), slow_claims(admin));
            let r = b.measured(&[addr], k, &pids, Pace::Rate(RATE)).await;
            if i == 2 {
                let per = |n: u64| n as f64 / r.requests.max(1) as f64;
                let slow = slow_claims(admin).map(|n| n as f64);
                let slow =
                    [0, 1, 2].map(|j| (slow[j] - before.1[j] as f64) / r.requests.max(1) as f64);
                trips.push((per(round_trips(admin) - before.0), slow));
            }
            let name = format!("{} at {RATE:.0}/s (round {})", FIRST_BYTE[i].0, round + 1);
            b.check(&name, &r, false);
            eprintln!(
                "  {name:<64} first byte p50 {:.3} ms  p99 {:.3} ms  proxy {:.1} µs/req",
                r.first_byte_ms(0.5),
                r.first_byte_ms(0.99),
                r.cpu.map_or(0.0, |c| c.proxy)
            );
            rounds[i].push(r);
        }
    }
    b.connections = connections;
    b.notes.push(first_byte_note(&rounds, &trips));
    for (i, rounds) in rounds.into_iter().enumerate() {
        let (scenario, against) = FIRST_BYTE[i];
        b.first_byte.push(FirstByteRow {
            scenario: scenario.to_string(),
            body: EVENTS.0,
            rate: RATE,
            rounds,
            against: against.map(|j| FIRST_BYTE[j].0.to_string()),
        });
    }
}

/// The note of the first-byte phases: each keyed miss's first byte against the pass-through's,
/// round by round, and the Redis miss's round trips and slow claims.
fn first_byte_note(rounds: &[Vec<Report>], trips: &[(f64, [f64; 3])]) -> String {
    let by_round = |k: usize| -> String {
        let d: Vec<[f64; 3]> = rounds[k]
            .iter()
            .zip(&rounds[1])
            .map(|(miss, pass)| {
                [0.5, 0.99, 0.999].map(|q| miss.first_byte_ms(q) - pass.first_byte_ms(q))
            })
            .collect();
        let median = |j: usize| {
            let mut v: Vec<f64> = d.iter().map(|x| x[j]).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let list: Vec<String> = d
            .iter()
            .map(|x| format!("{:+.3} / {:+.3} / {:+.3}", x[0], x[1], x[2]))
            .collect();
        format!(
            "{} (the rounds' median: {:+.3} / {:+.3} / {:+.3})",
            list.join(", "),
            median(0),
            median(1),
            median(2)
        )
    };
    let slow: Vec<String> = trips
        .iter()
        .map(|(_, s)| format!("{:.1} / {:.1} / {:.1}", s[0] * 1e3, s[1] * 1e3, s[2] * 1e3))
        .collect();
    let trips: Vec<String> = trips.iter().map(|t| format!("{:.2}", t.0)).collect();
    format!(
        "stream (1 KiB event stream in {} events {GAP_MS} ms apart, {RATE:.0}/s on {RATE_CONNECTIONS} connections): first byte of the keyed miss minus the pass-through's, p50 / p99 / p99.9 ms by round, on Redis: {} (goal: p99 under +1 ms); on the memory store: {}; Redis round trips per keyed miss by round: {}; claims slower than 0.8 / 1.6 / 3.2 ms per 1000 keyed misses by round (the gateway's histogram): {}",
        EVENTS.1,
        by_round(2),
        by_round(3),
        trips.join(", "),
        slow.join(", ")
    )
}

/// The replay phases: the hot keys primed through both gateways, then the four scenarios in
/// interleaved rounds; the replays checked against the upstream's bytes after.
async fn replay(b: &mut Bench, dir: &Path, gws: &[Proc; 2], up: &Proc) {
    b.path = path(EXPORT.0, EXPORT.1, 0);
    b.size = EXPORT.0;
    let events = sse_events(EXPORT.0, EXPORT.1);
    let nginx = [
        procs::nginx_unbuffered(dir, up.addr),
        procs::nginx(dir, up.addr),
    ];
    prime(b, gws, &events).await;
    let target = |i: usize| match i {
        0 | 1 => (&nginx[i], Keys::None),
        _ => (&gws[i - 2], Keys::Hot(format!("stream-hot-{}", i - 2), HOT)),
    };
    let mut rows = Vec::new();
    for round in 0..b.rounds {
        for j in 0..REPLAY.len() {
            let i = (j + round) % REPLAY.len();
            let (proc, keys) = target(i);
            if round == 0 {
                b.warm_up(&[proc.addr], keys.clone(), "stream-warm").await;
            }
            let ran = executions(up.addr).await;
            let r = b.closed(proc.addr, keys, &proc.pids()).await;
            let ran = executions(up.addr).await - ran;
            if i >= 2 && ran > 0 {
                b.insane.push(format!(
                    "stream: {} (round {}): the upstream ran {ran} times",
                    REPLAY[i],
                    round + 1
                ));
            }
            keep_round(b, &mut rows, (i, REPLAY[i], round), r);
        }
    }
    medians(b, &rows);
    replayed_bytes(b, gws, &events).await;
    drop(nginx);
}

/// Run each hot key once through each gateway, checking that the client got the upstream's bytes.
async fn prime(b: &mut Bench, gws: &[Proc; 2], events: &[Bytes]) {
    let whole: Bytes = events.concat().into();
    for (g, gw) in gws.iter().enumerate() {
        for i in 0..HOT {
            let key = format!("stream-hot-{g}-{i}");
            let a = fetch(gw.addr, &b.path, Some(&key), None).await;
            if !a.is_some_and(|a| a.status == 200 && a.body == whole) {
                b.insane.push(format!(
                    "stream: the first answer of {key} is not the upstream's stream"
                ));
                return;
            }
        }
    }
}

/// A few hot keys replayed through each gateway: the upstream's bytes, marked replayed, as an
/// event stream; and after `Last-Event-ID: 7`, the events after the eighth.
async fn replayed_bytes(b: &mut Bench, gws: &[Proc; 2], events: &[Bytes]) {
    let whole: Bytes = events.concat().into();
    let after: Bytes = events[8..].concat().into();
    for (g, gw) in gws.iter().enumerate() {
        for i in [0, HOT / 2, HOT - 1] {
            let key = format!("stream-hot-{g}-{i}");
            for (id, expected) in [(None, &whole), (Some("7"), &after)] {
                let a = fetch(gw.addr, &b.path, Some(&key), id).await;
                let ok = a.as_ref().is_some_and(|a| {
                    a.status == 200
                        && a.replayed
                        && a.content_type == "text/event-stream"
                        && a.body == expected
                });
                if !ok {
                    b.insane.push(format!(
                        "stream: the replay of {key} through {} (Last-Event-ID {id:?}) is not the recorded stream: {}",
                        REPLAY[g + 2],
                        a.map_or("no answer".into(), |a| format!(
                            "{} {} bytes, replayed {}, {}",
                            a.status,
                            a.body.len(),
                            a.replayed,
                            a.content_type
                        ))
                    ));
                }
            }
        }
    }
}

/// The gateway's claims so far that took longer than 0.8, 1.6 and 3.2 ms (from the buckets of
/// `idemgate_store_operation_seconds`).
fn slow_claims(admin: SocketAddr) -> [u64; 3] {
    let text = scrape(admin);
    let count = |le: &str| -> u64 {
        let bucket = |l: &&str| {
            l.starts_with("idemgate_store_operation_seconds_bucket{")
                && l.contains("operation=\"claim\"")
                && l.contains(&format!("le=\"{le}\""))
        };
        text.lines()
            .filter(bucket)
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    let all = count("+Inf");
    ["0.0008", "0.0016", "0.0032"].map(|le| all.saturating_sub(count(le)))
}

/// The upstream ran each key it saw once.
async fn executed_once(b: &mut Bench, upstream: SocketAddr) {
    match executions_per_key(upstream).await {
        (keys, executions, 0) if keys == executions && keys > 0 => b.notes.push(format!(
            "stream: the upstream ran each of {keys} keys once"
        )),
        (keys, executions, twice) => b.insane.push(format!(
            "stream: the upstream's executions per key: {keys} keys, {executions} executions, {twice} keys run twice"
        )),
    }
}
