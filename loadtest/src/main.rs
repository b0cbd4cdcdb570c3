//! `idemgate-loadtest`: measures idemgate against a direct upstream and nginx, side by side in
//! one run, and prints one table. See loadtest/README.md; run it with `loadtest/run [--quick]`.

mod app;
mod cluster;
mod load;
mod procs;
mod tls;
mod upstream;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use load::{CpuPerRequest, Keys, Pace, Report};

#[derive(Parser)]
#[command(about = "Benchmark idemgate against a direct upstream and nginx")]
struct Cli {
    /// A short run (about a minute) for CI: 1 KiB bodies only, 1.2 s phases, no soak, the
    /// cluster section in 0.5 s phases and one failover (cluster, wait_replicas 1).
    #[arg(long)]
    quick: bool,
    /// Seconds of each measured phase (default 5, or 1.2 with --quick).
    #[arg(long)]
    secs: Option<f64>,
    /// Concurrent connections of the closed-loop phases.
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// Closed-loop rounds per scenario, interleaved; the median is reported (default 3, or 1
    /// with --quick).
    #[arg(long)]
    rounds: Option<usize>,
    /// Seconds of the RSS soak (miss path on Redis); default 120, 0 with --quick.
    #[arg(long)]
    soak: Option<u64>,
    /// Run only these sections (comma-separated): proxy (the main table), https, http2,
    /// library, fingerprint, storm, soak, cluster (2 gateways on a Redis Cluster against one
    /// Redis, and wait_replicas), failover (Redis Cluster and Sentinel; cluster only with
    /// --quick).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// The failover section's runs, as backend:wait_replicas (comma-separated), e.g.
    /// redis-sentinel:1; default redis-cluster:1,redis-cluster:0,redis-sentinel:1,
    /// redis-sentinel:0, or redis-cluster:1 with --quick.
    #[arg(long, value_delimiter = ',')]
    failover: Vec<String>,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the fixed-response upstream (used by the harness itself).
    Upstream {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long, default_value_t = 1024)]
        body: usize,
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
        /// Serve over TLS with the certificates `tls.rs` wrote there, a client certificate
        /// required.
        #[arg(long)]
        tls_dir: Option<std::path::PathBuf>,
        /// Count executions per Idempotency-Key (`GET /__keys`).
        #[arg(long)]
        count_keys: bool,
    },
    /// Run the axum app of the library's figure (used by the harness itself).
    App {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long, default_value_t = 1024)]
        body: usize,
        /// With idemgate's layer on its route.
        #[arg(long)]
        layer: bool,
    },
    /// Drive load at one address and print the result (for profiling one scenario by hand).
    Load {
        #[arg(long)]
        target: SocketAddr,
        /// none, unique or hot
        #[arg(long, default_value = "none")]
        keys: String,
        #[arg(long, default_value_t = 5.0)]
        secs: f64,
        #[arg(long, default_value_t = 64)]
        connections: usize,
        /// Requests per second in all (open loop); without it, as fast as answered.
        #[arg(long)]
        rate: Option<f64>,
        /// Send a JSON request body of about this many bytes (a payments order) instead of the
        /// small payment.
        #[arg(long)]
        request_bytes: Option<usize>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    if let Some(Cmd::Upstream {
        listen,
        body,
        delay_ms,
        tls_dir,
        count_keys,
    }) = cli.command
    {
        let tls = tls_dir.map(|d| tls::server_config(&tls::Files::in_dir(&d)));
        rt.block_on(upstream::serve(
            listen,
            body,
            Duration::from_millis(delay_ms),
            tls,
            count_keys,
        ))
        .unwrap();
        return ExitCode::SUCCESS;
    }
    if let Some(Cmd::App {
        listen,
        body,
        layer,
    }) = cli.command
    {
        rt.block_on(app::serve(listen, body, layer)).unwrap();
        return ExitCode::SUCCESS;
    }
    if let Some(Cmd::Load {
        target,
        keys,
        secs,
        connections,
        rate,
        request_bytes,
    }) = cli.command
    {
        let keys = match keys.as_str() {
            "unique" => Keys::Unique(format!("manual-{}", std::process::id())),
            "hot" => Keys::Hot("manual-hot".into(), 1000),
            _ => Keys::None,
        };
        let body = request_bytes.map_or_else(load::small_request, load::json_request);
        let r = rt.block_on(load::run_with_body(
            target,
            "/v1/payments",
            body,
            keys,
            connections,
            Duration::from_secs_f64(secs),
            rate.map_or(Pace::Closed, Pace::Rate),
        ));
        println!(
            "{} requests, {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms, max {:.2} ms, {} 409s, {} errors",
            r.requests,
            r.rps(),
            r.ms(0.5),
            r.ms(0.99),
            r.ms(0.999),
            r.ms(1.0),
            r.conflicts,
            r.errors
        );
        return ExitCode::SUCCESS;
    }
    rt.block_on(bench(cli))
}

/// One row of the results table.
struct Row {
    scenario: String,
    body: usize,
    // The median (by req/s) of `samples`.
    closed: Report,
    // One closed-loop report per round.
    samples: Vec<Report>,
    at_rate: Option<Report>,
}

struct Bench {
    secs: Duration,
    warm: Duration,
    connections: usize,
    rows: Vec<Row>,
    notes: Vec<String>,
    insane: Vec<String>,
    run_id: u64,
    // Closed-loop rounds per scenario (interleaved); the table shows the median.
    rounds: usize,
    // The response body size of the phases being measured.
    size: usize,
    // The upstream's and Redis's processes, for the CPU figures.
    upstream_pids: Vec<u32>,
    redis_pids: Vec<u32>,
    // The body of every request sent (the small payment, but for the fingerprint phases).
    request: bytes::Bytes,
}

impl Bench {
    fn prefix(&mut self, what: &str) -> String {
        self.run_id += 1;
        format!("{what}-{}-{}", std::process::id(), self.run_id)
    }

    /// Warm up `addrs` with `keys` (pools, caches and, for the replay path, the hot keys' first
    /// executions); the keys of the measured phase: the same, or for unique keys fresh ones
    /// named `what`, so that the phase measures misses only.
    async fn warm_up(&mut self, addrs: &[SocketAddr], keys: Keys, what: &str) -> Keys {
        load::run_spread(
            addrs,
            "/v1/payments",
            self.request.clone(),
            keys.clone(),
            self.connections,
            self.warm,
            Pace::Closed,
        )
        .await;
        match keys {
            Keys::Unique(_) => Keys::Unique(self.prefix(what)),
            k => k,
        }
    }

    /// A closed-loop run against `addr`, with the CPU time per request of `proxy` (the processes
    /// under test), the upstream, Redis and the load generator (this process).
    async fn closed(&self, addr: SocketAddr, keys: Keys, proxy: &[u32]) -> Report {
        self.closed_spread(&[addr], keys, proxy).await
    }

    /// [`Bench::closed`] against several replicas, the connections spread over them.
    async fn closed_spread(&self, addrs: &[SocketAddr], keys: Keys, proxy: &[u32]) -> Report {
        let me = [std::process::id()];
        let sample = || {
            [
                procs::cpu_ns(proxy),
                procs::cpu_ns(&self.upstream_pids),
                procs::cpu_ns(&self.redis_pids),
                procs::cpu_ns(&me),
            ]
        };
        let before = sample();
        let mut r = load::run_spread(
            addrs,
            "/v1/payments",
            self.request.clone(),
            keys,
            self.connections,
            self.secs,
            Pace::Closed,
        )
        .await;
        let after = sample();
        let per =
            |i: usize| after[i].saturating_sub(before[i]) as f64 / 1e3 / r.requests.max(1) as f64;
        r.cpu = Some(CpuPerRequest {
            proxy: per(0),
            upstream: per(1),
            redis: per(2),
            load: per(3),
        });
        r
    }

    async fn at_rate(&self, addr: SocketAddr, keys: Keys, rate: f64) -> Report {
        load::run(addr, "/v1/payments", keys, 32, self.secs, Pace::Rate(rate)).await
    }

    fn check(&mut self, name: &str, r: &Report, expect_conflicts: bool) {
        if r.requests == 0 {
            self.insane.push(format!("{name}: no request completed"));
        } else if r.errors * 100 > r.requests {
            self.insane.push(format!(
                "{name}: {} errors in {} requests",
                r.errors, r.requests
            ));
        } else if !expect_conflicts && r.conflicts > 0 {
            self.insane
                .push(format!("{name}: {} unexpected 409s", r.conflicts));
        }
    }
}

async fn bench(cli: Cli) -> ExitCode {
    let secs = Duration::from_secs_f64(cli.secs.unwrap_or(if cli.quick { 1.2 } else { 5.0 }));
    let mut b = Bench {
        secs,
        warm: if cli.quick {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(2)
        },
        connections: cli.connections,
        rows: Vec::new(),
        notes: Vec::new(),
        insane: Vec::new(),
        run_id: 0,
        rounds: cli.rounds.unwrap_or(if cli.quick { 1 } else { 3 }),
        size: 1024,
        upstream_pids: Vec::new(),
        redis_pids: Vec::new(),
        request: load::small_request(),
    };
    let soak = cli.soak.unwrap_or(if cli.quick { 0 } else { 120 });
    let dir = tempfile::tempdir().unwrap();
    let redis = procs::redis(dir.path());
    let redis_url = format!("redis://{}/0", redis.addr);
    b.redis_pids = redis.pids();
    let mut redis_conn = redis::Client::open(redis_url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    eprintln!(
        "idemgate loadtest: {} s phases, {} connections",
        secs.as_secs_f64(),
        cli.connections
    );

    let sizes: &[usize] = if cli.quick { &[1024] } else { &[1024, 65536] };
    let run = |section: &str| cli.only.is_empty() || cli.only.iter().any(|s| s == section);
    for &size in sizes.iter().filter(|_| run("proxy")) {
        b.size = size;
        // Each body size starts from an empty Redis, so the per-record figures are its own.
        // ASYNC: freeing a million records takes longer than the client's response timeout.
        let _: () = redis::cmd("FLUSHALL")
            .arg("ASYNC")
            .query_async(&mut redis_conn)
            .await
            .unwrap();
        let up = procs::upstream(size, 0);
        let nginx = procs::nginx(dir.path(), up.addr);
        let mem = procs::gateway(dir.path(), "memory", up.addr, "");
        let red = procs::gateway(dir.path(), &redis_url, up.addr, "");
        b.upstream_pids = up.pids();
        let (nginx_pids, mem_pids, red_pids) = (nginx.pids(), mem.pids(), red.pids());

        // Closed loop: the most each can do.
        let unique = || Keys::Unique(String::new());
        let hot = || Keys::Hot(String::new(), 1000);
        phase(&mut b, "direct to upstream", up.addr, &[], Keys::None, None).await;
        phase(
            &mut b,
            "nginx proxy",
            nginx.addr,
            &nginx_pids,
            Keys::None,
            None,
        )
        .await;
        phase(
            &mut b,
            "gateway pass-through (no key)",
            mem.addr,
            &mem_pids,
            Keys::None,
            None,
        )
        .await;
        phase(
            &mut b,
            "gateway miss, memory",
            mem.addr,
            &mem_pids,
            unique(),
            None,
        )
        .await;
        phase(
            &mut b,
            "gateway miss, redis",
            red.addr,
            &red_pids,
            unique(),
            Some((&mut redis_conn, red.admin.unwrap())),
        )
        .await;
        stored_bytes(&mut b, &mut redis_conn, red.addr, size).await;
        incompressible_stored_bytes(
            &mut b,
            &mut redis_conn,
            (dir.path(), &redis_url, up.addr),
            size,
        )
        .await;
        phase(
            &mut b,
            "gateway replay, memory",
            mem.addr,
            &mem_pids,
            hot(),
            None,
        )
        .await;
        phase(
            &mut b,
            "gateway replay, redis",
            red.addr,
            &red_pids,
            hot(),
            Some((&mut redis_conn, red.admin.unwrap())),
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
                let keys = keys_for(&scenario, &mut b);
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
            let keys = keys_for(&scenario, &mut b);
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

    if run("https") {
        https(&mut b, dir.path()).await;
    }
    if run("http2") {
        http2_replay(&mut b, dir.path()).await;
    }
    if run("library") {
        library(&mut b).await;
    }
    if run("fingerprint") {
        fingerprint(&mut b, dir.path(), sizes).await;
    }
    if run("storm") {
        storm(&mut b, dir.path(), &redis_url).await;
    }
    if run("cluster") {
        cluster::throughput(&mut b, dir.path(), cli.quick).await;
    }
    if run("failover") {
        cluster::failover(&mut b, dir.path(), cli.quick, &cli.failover).await;
    }
    if soak > 0 && run("soak") {
        soak_rss(&mut b, dir.path(), &redis_url, soak).await;
    }
    print_table(&b);
    if b.insane.is_empty() {
        println!("\nsanity: ok");
        ExitCode::SUCCESS
    } else {
        println!("\nsanity: FAILED");
        b.insane.iter().for_each(|s| println!("- {s}"));
        ExitCode::FAILURE
    }
}

/// An https upstream that requires a client certificate (mutual TLS), 1 KiB: nginx proxying to
/// it (`proxy_pass https://`, keep-alive, the same client certificate) against the gateway's
/// pass-through and miss; and how many connections (TLS handshakes) the gateway opened per
/// 1000 requests.
async fn https(b: &mut Bench, dir: &std::path::Path) {
    b.size = 1024;
    let files = tls::write(&dir.join("tls"));
    let up = procs::upstream_tls(b.size, &dir.join("tls"));
    let nginx = procs::nginx_tls(dir, up.addr, &files);
    let upstream = format!(
        "upstream = \"https://{}\"\n[upstreams.default]\nserver_name = \"{}\"\nca_file = {:?}\nclient_cert_file = {:?}\nclient_key_file = {:?}\n",
        up.addr,
        tls::UPSTREAM_NAME,
        files.ca,
        files.client_cert,
        files.client_key
    );
    let gw = procs::gateway_to(dir, "memory", &upstream);
    b.upstream_pids = up.pids();
    let (nginx_pids, gw_pids) = (nginx.pids(), gw.pids());
    let before = upstream_counters(gw.admin.unwrap());
    let nginx_r = phase(
        b,
        "nginx proxy, https upstream",
        nginx.addr,
        &nginx_pids,
        Keys::None,
        None,
    )
    .await;
    let pass = phase(
        b,
        "gateway pass-through, https upstream",
        gw.addr,
        &gw_pids,
        Keys::None,
        None,
    )
    .await;
    let miss = phase(
        b,
        "gateway miss (memory), https upstream",
        gw.addr,
        &gw_pids,
        Keys::Unique(String::new()),
        None,
    )
    .await;
    let after = upstream_counters(gw.admin.unwrap());
    let (opened, requests) = (after.0 - before.0, after.1 - before.1);
    let cpu = |r: &Report| r.cpu.map_or(0.0, |c| c.all());
    b.notes.push(format!(
        "https upstream with mutual TLS (1 KiB): pass-through / nginx = {:.2} [CPU {:.2}], miss (memory) / nginx = {:.2} [CPU {:.2}]; the gateway opened {opened} connections for {requests} requests ({:.2} per 1000 requests: pooled, no handshake per request)",
        pass.rps() / nginx_r.rps(),
        cpu(&nginx_r) / cpu(&pass).max(f64::MIN_POSITIVE),
        miss.rps() / nginx_r.rps(),
        cpu(&nginx_r) / cpu(&miss).max(f64::MIN_POSITIVE),
        opened as f64 * 1000.0 / requests.max(1) as f64,
    ));
    drop((up, nginx, gw));
}

/// Connections opened and responses received, summed over the gateway's upstreams.
fn upstream_counters(admin: SocketAddr) -> (u64, u64) {
    let text = scrape(admin);
    let sum = |prefix: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    (
        sum("idemgate_upstream_connections_opened_total"),
        sum("idemgate_upstream_requests_total{upstream=\"default\",result=\"response\"}"),
    )
}

/// Replays of one key driven by h2load (nghttp2's load generator), over HTTP/2 (h2c, 32 streams
/// on each of 8 connections) against HTTP/1.1 (64 connections, one request at a time each), on
/// the same gateway: the throughput ratio, and the gateway's CPU per request.
async fn http2_replay(b: &mut Bench, dir: &std::path::Path) {
    let up = procs::upstream(1024, 0);
    let gw = procs::gateway(dir, "memory", up.addr, "");
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
            "replay over HTTP/2 / over HTTP/1.1 (1 KiB, h2load, one gateway on the embedded store) = {:.2} [CPU {:.2}] ({h2:.0} vs {h1:.0} req/s; gateway CPU {h2_cpu:.1} vs {h1_cpu:.1} µs per request)",
            h2 / h1,
            h1_cpu / h2_cpu,
        ));
    }
    drop((up, gw));
}

/// The library's figure: an axum app with idemgate's layer on its route against the same app
/// without it (1 KiB bodies): replay throughput, and the latency a miss adds at p50 (at a fixed
/// rate, a quarter of the slower maximum, so that queueing does not count as added latency).
async fn library(b: &mut Bench) {
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

/// What `fingerprint = "json"` costs over "exact": the miss path on the embedded store, with a
/// JSON request body of each size (a payments order with line items, see
/// [`load::json_request`]) and two ignored fields, one inside the items array; interleaved
/// rounds, the CPU per miss of the gateway side by side. The upstream answers 1 KiB.
async fn fingerprint(b: &mut Bench, dir: &std::path::Path, sizes: &[usize]) {
    let up = procs::upstream(1024, 0);
    b.upstream_pids = up.pids();
    b.redis_pids = Vec::new();
    let route = |mode: &str| {
        format!(
            "[[routes]]\npath = \"/v1/payments\"\nmethods = [\"POST\"]\nfingerprint = \"{mode}\"\nfingerprint_ignore = [\"/request_id\", \"/items/*/client_ts\"]\n"
        )
    };
    let exact = procs::gateway(dir, "memory", up.addr, &route("exact"));
    let json = procs::gateway(dir, "memory", up.addr, &route("json"));
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

/// Warm up, then measure one closed-loop phase and record it as a row. With `redis`, the Redis
/// commands the measured part caused are noted per request.
async fn phase(
    b: &mut Bench,
    scenario: &str,
    addr: SocketAddr,
    proxy: &[u32],
    keys: Keys,
    redis: Option<(&mut redis::aio::MultiplexedConnection, SocketAddr)>,
) -> Report {
    let size = b.size;
    let keys = match keys {
        Keys::Unique(_) => Keys::Unique(b.prefix("miss")),
        Keys::Hot(_, n) => Keys::Hot(format!("hot-{size}"), n),
        k => k,
    };
    let keys = b.warm_up(&[addr], keys, "miss").await;
    let r = match redis {
        Some((conn, admin)) => {
            let (before, trips_before) = (commandstats(conn).await, round_trips(admin));
            let r = b.closed(addr, keys, proxy).await;
            let (after, trips_after) = (commandstats(conn).await, round_trips(admin));
            let trips = (trips_after - trips_before) as f64 / r.requests.max(1) as f64;
            b.notes.push(per_request(
                scenario, size, trips, &before, &after, r.requests,
            ));
            r
        }
        None => b.closed(addr, keys, proxy).await,
    };
    b.check(scenario, &r, false);
    eprintln!(
        "  {scenario:<34} {:>9.0} req/s  p50 {:.2} ms  p99 {:.2} ms",
        r.rps(),
        r.ms(0.5),
        r.ms(0.99)
    );
    b.rows.push(Row {
        scenario: scenario.to_string(),
        body: size,
        closed: r.clone(),
        samples: vec![r.clone()],
        at_rate: None,
    });
    r
}

async fn commandstats(conn: &mut redis::aio::MultiplexedConnection) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_string(), calls))
        })
        .collect()
}

/// The gateway's own count of Redis round trips so far: its store operations (each one round
/// trip) minus the reads its local cache answered. From its `/metrics`.
/// The gateway's metrics, as text.
fn scrape(admin: SocketAddr) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(admin).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

fn round_trips(admin: SocketAddr) -> u64 {
    let text = scrape(admin);
    let value = |line: &str| -> u64 {
        line.rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0) as u64
    };
    let ops: u64 = text
        .lines()
        .filter(|l| l.starts_with("idemgate_store_operation_seconds_count"))
        .map(value)
        .sum();
    let hits: u64 = text
        .lines()
        .filter(|l| l.starts_with("idemgate_local_cache_hits_total"))
        .map(value)
        .sum();
    ops - hits
}

fn per_request(
    what: &str,
    size: usize,
    trips: f64,
    before: &HashMap<String, u64>,
    after: &HashMap<String, u64>,
    requests: u64,
) -> String {
    let mut parts: Vec<(String, f64)> = after
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                (*v - before.get(k).copied().unwrap_or(0)) as f64 / requests.max(1) as f64,
            )
        })
        .filter(|(k, v)| *v > 0.001 && k != "info")
        .collect();
    parts.sort_by(|a, b| b.1.total_cmp(&a.1));
    let detail: Vec<String> = parts.iter().map(|(k, v)| format!("{k} {v:.2}")).collect();
    format!(
        "{} body, {what}: {trips:.2} Redis round trips per request (the gateway's store operations not answered by its local cache); Redis commands per request, incl. those run inside the scripts: {}",
        human(size),
        detail.join(", ")
    )
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
    (dir, redis_url, upstream): (&std::path::Path, &str, SocketAddr),
    size: usize,
) {
    let gw = procs::gateway_with_prefix(dir, redis_url, upstream, "", "noise:");
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

/// Many clients, few keys, a slow upstream: every key must run exactly once.
async fn storm(b: &mut Bench, dir: &std::path::Path, redis_url: &str) {
    let up = procs::upstream(1024, 20);
    for store in ["memory", redis_url] {
        let gw = procs::gateway(dir, store, up.addr, "");
        let label = if store == "memory" { "memory" } else { "redis" };
        let before = upstream_count(up.addr).await;
        let prefix = b.prefix("storm");
        let r = load::run(
            gw.addr,
            "/v1/payments",
            Keys::Storm(prefix, 64),
            64,
            b.secs,
            Pace::Closed,
        )
        .await;
        let executions = upstream_count(up.addr).await - before;
        let keys = r.requests.div_ceil(64);
        b.check(&format!("duplicate storm, {label}"), &r, true);
        if executions > keys {
            b.insane.push(format!(
                "duplicate storm, {label}: {executions} executions for {keys} keys"
            ));
        }
        b.notes.push(format!(
            "duplicate storm, {label} (64 connections, 64 requests per key, upstream 20 ms): {} requests, {keys} keys, {executions} upstream executions, {} answered 409 in flight, {:.0} req/s",
            r.requests,
            r.conflicts,
            r.rps()
        ));
        eprintln!(
            "  duplicate storm, {label:<20} {:>9.0} req/s  {executions} executions / {keys} keys",
            r.rps()
        );
        b.rows.push(Row {
            scenario: format!("duplicate storm, {label}"),
            body: 1024,
            closed: r.clone(),
            samples: vec![r],
            at_rate: None,
        });
    }
}

async fn upstream_count(addr: SocketAddr) -> u64 {
    get_text(addr, "/__count").await.parse().unwrap()
}

/// `GET path` from `addr`, the body as text.
async fn get_text(addr: SocketAddr, path: &str) -> String {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut s, conn) = hyper::client::conn::http1::handshake::<
        _,
        http_body_util::Empty<bytes::Bytes>,
    >(hyper_util::rt::TokioIo::new(stream))
    .await
    .unwrap();
    tokio::spawn(conn);
    let resp = s
        .send_request(
            http::Request::get(path)
                .header("host", "u")
                .body(http_body_util::Empty::new())
                .unwrap(),
        )
        .await
        .unwrap();
    use http_body_util::BodyExt;
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).to_string()
}

/// The gateway's RSS across a long run of unique keys on Redis, sampled every 10 s.
async fn soak_rss(b: &mut Bench, dir: &std::path::Path, redis_url: &str, secs: u64) {
    let up = procs::upstream(1024, 0);
    let gw = procs::gateway(dir, redis_url, up.addr, "");
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

fn human(size: usize) -> String {
    if size >= 1024 && size.is_multiple_of(1024) {
        format!("{} KiB", size / 1024)
    } else {
        format!("{size} B")
    }
}

fn print_table(b: &Bench) {
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
    println!("\nratios (same run; in brackets the same ratio from CPU per request of all processes, which noise moves less):");
    for &size in &[1024usize, 65536] {
        let get = |name: &str| {
            b.rows
                .iter()
                .find(|r| r.body == size && r.scenario == name)
                .map(|r| (r.closed.rps(), r.closed.cpu.map(|c| c.all()).unwrap_or(0.0)))
        };
        let (Some(nginx), Some(pass)) = (get("nginx proxy"), get("gateway pass-through (no key)"))
        else {
            continue;
        };
        // Throughput ratio a / b, and the one CPU predicts: b's CPU per request / a's.
        let ratio = |a: (f64, f64), b: (f64, f64)| {
            let by_cpu = if a.1 > 0.0 { b.1 / a.1 } else { 0.0 };
            format!("{:.2} [{by_cpu:.2}]", a.0 / b.0)
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
    println!("\nnotes:");
    b.notes.iter().for_each(|n| println!("- {n}"));
}
