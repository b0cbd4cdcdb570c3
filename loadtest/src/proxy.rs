//! Section `proxy`, the main table: direct to the upstream, nginx, and the gateway's
//! pass-through, miss and replay on the memory and Redis stores, for each body size; closed-loop
//! rounds interleaved, then one fixed rate for all; what one record takes in Redis.

use std::net::SocketAddr;
use std::path::Path;

use crate::bench::{human, phase, Bench};
use crate::load::Keys;
use crate::procs;

/// The main table for one body size: every scenario warmed up and measured, `b.rounds` rounds
/// interleaved, then all at one fixed rate. `redis` is the run's Redis (emptied first).
pub async fn run(
    b: &mut Bench,
    dir: &Path,
    size: usize,
    (redis_conn, redis_url): (&mut redis::aio::MultiplexedConnection, &str),
) {
    b.size = size;
    // Each body size starts from an empty Redis, so the per-record figures are its own.
    // ASYNC: freeing a million records takes longer than the client's response timeout.
    let _: () = redis::cmd("FLUSHALL")
        .arg("ASYNC")
        .query_async(&mut *redis_conn)
        .await
        .unwrap();
    let up = procs::upstream(size, 0);
    let nginx = procs::nginx(dir, up.addr);
    let mem = procs::gateway(&procs::config(up.addr)).await;
    let on_redis = procs::config(up.addr).redis_url(redis_url);
    let red = procs::gateway(&on_redis.clone().prefix("bench:")).await;
    b.upstream_pids = up.pids();
    let (nginx_pids, mem_pids, red_pids) = (nginx.pids(), mem.pids(), red.pids());

    // Closed loop: the most each can do.
    let unique = || Keys::Unique(String::new());
    let hot = || Keys::Hot(String::new(), 1000);
    phase(b, "direct to upstream", up.addr, &[], Keys::None, None).await;
    phase(b, "nginx proxy", nginx.addr, &nginx_pids, Keys::None, None).await;
    phase(
        b,
        "gateway pass-through (no key)",
        mem.addr,
        &mem_pids,
        Keys::None,
        None,
    )
    .await;
    phase(
        b,
        "gateway miss, memory",
        mem.addr,
        &mem_pids,
        unique(),
        None,
    )
    .await;
    phase(
        b,
        "gateway miss, redis",
        red.addr,
        &red_pids,
        unique(),
        Some((&mut *redis_conn, red.admin.unwrap())),
    )
    .await;
    stored_bytes(b, &mut *redis_conn, red.addr, size).await;
    incompressible_stored_bytes(b, &mut *redis_conn, (redis_url, up.addr), size).await;
    phase(
        b,
        "gateway replay, memory",
        mem.addr,
        &mem_pids,
        hot(),
        None,
    )
    .await;
    phase(
        b,
        "gateway replay, redis",
        red.addr,
        &red_pids,
        hot(),
        Some((&mut *redis_conn, red.admin.unwrap())),
    )
    .await;

    // More rounds, interleaved across the scenarios, so that the machine's drift (it is
    // shared and noisy) hits every scenario alike; each row keeps its median round.
    let start = b.rows.len() - 7;
    // Where each scenario sends its load, and the processes it measures.
    let target = |scenario: &str| -> (SocketAddr, &[u32]) {
        match scenario {
            "direct to upstream" => (up.addr, &[]),
            "nginx proxy" => (nginx.addr, &nginx_pids),
            s if s.contains("redis") => (red.addr, &red_pids),
            _ => (mem.addr, &mem_pids),
        }
    };
    for round in 1..b.rounds {
        for i in start..b.rows.len() {
            let scenario = b.rows[i].scenario.clone();
            let keys = keys_for(&scenario, b);
            let (addr, pids) = target(&scenario);
            let r = b.closed(addr, keys, pids).await;
            b.check(&format!("{scenario} (round {})", round + 1), &r, false);
            eprintln!(
                "  {scenario:<34} {:>9.0} req/s  (round {})",
                r.rps(),
                round + 1
            );
            b.rows[i].samples.push(r);
        }
    }
    for row in &mut b.rows[start..] {
        let mut samples = row.samples.clone();
        samples.sort_by(|x, y| x.rps().total_cmp(&y.rps()));
        row.closed = samples[samples.len() / 2].clone();
    }

    // Open loop at one fixed rate for all: the latency each layer adds over direct. The rate
    // is half the slowest maximum above, so that no layer is saturated and queueing does not
    // masquerade as added latency (half the *direct* maximum saturates every proxy here).
    let measured = &b.rows[b.rows.len() - 7..];
    let slowest = measured
        .iter()
        .map(|r| r.closed.rps())
        .fold(f64::MAX, f64::min);
    let rate = (slowest / 2.0).max(100.0);
    for i in start..b.rows.len() {
        let scenario = b.rows[i].scenario.clone();
        let (addr, _) = target(&scenario);
        let keys = keys_for(&scenario, b);
        let r = b.at_rate(addr, keys, rate).await;
        b.check(
            &format!("{} at {rate:.0} req/s", b.rows[i].scenario),
            &r,
            false,
        );
        b.rows[i].at_rate = Some(r);
    }
    b.notes.push(format!(
        "{} body: fixed rate {rate:.0} req/s (half the slowest maximum); gateway RSS after the phases: memory {} MiB, redis {} MiB; nginx master {} MiB",
        human(size),
        mem.rss_kib() / 1024,
        red.rss_kib() / 1024,
        nginx.rss_kib() / 1024
    ));
    drop((up, nginx, mem, red));
}

fn keys_for(scenario: &str, b: &mut Bench) -> Keys {
    if scenario.contains("miss") {
        Keys::Unique(b.prefix("rate-miss"))
    } else if scenario.contains("replay") {
        // The same hot keys the closed phase used, all completed by now.
        Keys::Hot(format!("hot-{}", b.size), 1000)
    } else {
        Keys::None
    }
}

/// MEMORY USAGE of one stored record against the response's own size.
async fn stored_bytes(
    b: &mut Bench,
    conn: &mut redis::aio::MultiplexedConnection,
    gateway: SocketAddr,
    size: usize,
) {
    let (_, keys): (u64, Vec<String>) = redis::cmd("SCAN")
        .arg(0)
        .arg("MATCH")
        .arg("bench:*")
        .arg("COUNT")
        .arg(1000)
        .query_async(conn)
        .await
        .unwrap();
    let Some(key) = keys.first() else {
        b.insane
            .push("no record found in Redis after the miss phase".into());
        return;
    };
    let headers = response_header_bytes(gateway).await;
    let note = record_usage(conn, key, headers, size).await;
    b.notes.push(format!("{} body: {note}", human(size)));
}

/// What one record takes in Redis (`MEMORY USAGE`, and the value's own length) against the
/// target of the response's headers + body + 256 bytes.
async fn record_usage(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    headers: usize,
    size: usize,
) -> String {
    let usage: u64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg(0)
        .query_async(&mut *conn)
        .await
        .unwrap();
    let value_len: u64 = redis::cmd("STRLEN")
        .arg(key)
        .query_async(&mut *conn)
        .await
        .unwrap();
    let budget = (headers + size + 256) as u64;
    let verdict = if usage <= budget { "within" } else { "OVER" };
    format!(
        "one record takes {usage} bytes in Redis (MEMORY USAGE; value {value_len} bytes) for a response of {headers} header bytes + {size} body bytes: {verdict} the headers + body + 256 = {budget} target"
    )
}

/// The worst case of [`stored_bytes`]: a response compression cannot shrink (random bytes),
/// through a gateway of its own key prefix so that its one record is easy to find.
async fn incompressible_stored_bytes(
    b: &mut Bench,
    conn: &mut redis::aio::MultiplexedConnection,
    (redis_url, upstream): (&str, SocketAddr),
    size: usize,
) {
    let config = procs::config(upstream)
        .redis_url(redis_url)
        .prefix("noise:");
    let gw = procs::gateway(&config).await;
    let headers = post_for_headers(gw.addr, "/incompressible", Some("noise-1")).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("noise:*")
        .query_async(conn)
        .await
        .unwrap();
    let Some(key) = keys.first() else {
        b.insane
            .push("no record found in Redis for the incompressible response".into());
        return;
    };
    let note = record_usage(conn, key, headers, size).await;
    b.notes.push(format!(
        "{} incompressible body (random bytes): {note}",
        human(size)
    ));
}

async fn response_header_bytes(gateway: SocketAddr) -> usize {
    post_for_headers(gateway, "/v1/payments", None).await
}

/// POST `path` through `gateway`, with `key` as its Idempotency-Key when given; the response's
/// header bytes (names and values).
async fn post_for_headers(gateway: SocketAddr, path: &str, key: Option<&str>) -> usize {
    let stream = tokio::net::TcpStream::connect(gateway).await.unwrap();
    let (mut s, conn) = hyper::client::conn::http1::handshake::<
        _,
        http_body_util::Full<bytes::Bytes>,
    >(hyper_util::rt::TokioIo::new(stream))
    .await
    .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::post(path).header("host", "bench");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
        .unwrap();
    let resp = s.send_request(req).await.unwrap();
    resp.headers()
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len())
        .sum()
}
