//! `idemgate-loadtest`: measures idemgate against a direct upstream and nginx, side by side in
//! one run, and prints one table. See loadtest/README.md; run it with `loadtest/run [--quick]`.
//!
//! One module per section of the run (`proxy`, the main table; `https`, `http2`, `library`,
//! `fingerprint`, `mcp`, `expiry`, `seal`, `stream`, `telemetry`, `webhook`, `storm`, `soak`, `cluster`, `postgres`,
//! `embedded`, `failover`, `chaos`), on `bench` (the measuring they share), `load` (the load generator),
//! `procs` (the processes under test; Redis's come from `testkit`), `metrics`, `table` (the
//! printed results) and `charts` (the same as SVG charts). `upstream`, `app` and `collector`
//! (the telemetry section's sink) are the subcommands the harness runs as child processes.

mod app;
mod bench;
mod chaos;
mod charts;
mod cluster;
mod embedded;
mod expiry;
mod failover;
mod fingerprint;
mod http2;
mod https;
mod library;
mod load;
mod mcp;
mod metrics;
mod postgres;
mod procs;
mod proxy;
mod seal;
mod soak;
mod storm;
mod stream;
mod table;
mod telemetry;
mod tls;
mod upstream;
mod webhook;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use bench::Bench;
use testkit::RedisServer;

#[derive(Parser)]
#[command(about = "Benchmark idemgate against a direct upstream and nginx")]
struct Cli {
    /// A short run (about four minutes) for CI: 1 KiB bodies only (but the stream section's
    /// replays), 1.2 s phases, no soak, the cluster and stream sections in 0.5 s phases, one
    /// failover (cluster, wait_replicas 1) and seven 20 s chaos runs.
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
    /// library, fingerprint, mcp (an MCP tools/call's miss and replay against nginx), expiry
    /// (the Redis miss with after_expiry = "refuse" against the
    /// default), seal (the Redis miss and replay, with and without the local cache, with
    /// seal = "on" against "off"), stream (the first byte of a keyed streamed miss against a
    /// pass-through at a fixed rate, and replays of a 64 KiB event stream against nginx),
    /// telemetry (the miss and replay with OTel traces exported,
    /// sampled, or to a collector that is down, against none), webhook (Stripe-signed
    /// deliveries, first and duplicate, against nginx passing them), storm, soak, cluster (2 gateways
    /// on a Redis Cluster against one Redis, and wait_replicas), postgres (the gateway on
    /// PostgreSQL against pgbench with the
    /// store's statements), embedded (the gateway on the durable embedded store with fsync against
    /// the memory store), failover (Redis Cluster and Sentinel; cluster only with --quick),
    /// chaos (every backend under faults, its history checked).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// The failover section's runs, as backend:wait_replicas (comma-separated), e.g.
    /// redis-sentinel:1; default redis-cluster:1,redis-cluster:0,redis-sentinel:1,
    /// redis-sentinel:0, or redis-cluster:1 with --quick.
    #[arg(long, value_delimiter = ',')]
    failover: Vec<String>,
    /// The chaos section's runs, as backend:regime (comma-separated; backends memory,
    /// embedded, redis, redis-cluster, postgres; regimes long, an 8 s lease, and short, a 2 s
    /// one); default every backend in both, or with --quick every backend long and redis and
    /// postgres short.
    #[arg(long, value_delimiter = ',')]
    chaos: Vec<String>,
    /// Seconds of faults in each chaos run (default 60, or 20 with --quick).
    #[arg(long)]
    chaos_secs: Option<f64>,
    /// The seed of the chaos section's draws: faults, the upstream's misbehaviour, the clients.
    #[arg(long, default_value_t = 1)]
    seed: u64,
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
    /// Run the OTLP sink collector of the telemetry section (used by the harness itself).
    Collector {
        #[arg(long)]
        listen: SocketAddr,
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
    /// Run a private PostgreSQL (the tests' fixture: `initdb` into a temporary directory, a free
    /// port) until SIGTERM or Ctrl-C; print its URL on the first line (for `loadtest/callgrind`).
    Postgres,
    /// Draw the charts (SVG) of a run from its printed output.
    Charts(charts::FromOutput),
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
    if let Some(Cmd::Collector { listen }) = cli.command {
        rt.block_on(telemetry::sink(listen)).unwrap();
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
        rt.block_on(load::by_hand(
            target,
            &keys,
            Duration::from_secs_f64(secs),
            connections,
            rate,
            request_bytes,
        ));
        return ExitCode::SUCCESS;
    }
    if let Some(Cmd::Charts(args)) = cli.command {
        return charts::from_output(args);
    }
    if let Some(Cmd::Postgres) = cli.command {
        rt.block_on(postgres::serve());
        return ExitCode::SUCCESS;
    }
    rt.block_on(bench(cli))
}

/// The benchmark: every section `--only` names (all by default) on one Redis, then the table
/// and the sanity verdict.
async fn bench(cli: Cli) -> ExitCode {
    let secs = Duration::from_secs_f64(cli.secs.unwrap_or(if cli.quick { 1.2 } else { 5.0 }));
    let mut b = Bench::new(
        secs,
        if cli.quick {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(2)
        },
        cli.connections,
        cli.rounds.unwrap_or(if cli.quick { 1 } else { 3 }),
    );
    let soak = cli.soak.unwrap_or(if cli.quick { 0 } else { 120 });
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::start().await;
    let redis_url = redis.url();
    b.redis_pids = redis.pid().into_iter().collect();
    let mut redis_conn = redis.connection().await;
    eprintln!(
        "idemgate loadtest: {} s phases, {} connections",
        secs.as_secs_f64(),
        cli.connections
    );

    let sizes: &[usize] = if cli.quick { &[1024] } else { &[1024, 65536] };
    let run = |section: &str| cli.only.is_empty() || cli.only.iter().any(|s| s == section);
    for &size in sizes.iter().filter(|_| run("proxy")) {
        proxy::run(&mut b, dir.path(), size, (&mut redis_conn, &redis_url)).await;
    }
    if run("https") {
        https::run(&mut b, dir.path()).await;
    }
    if run("http2") {
        http2::run(&mut b, dir.path()).await;
    }
    if run("library") {
        library::run(&mut b).await;
    }
    if run("fingerprint") {
        fingerprint::run(&mut b, sizes).await;
    }
    if run("mcp") {
        mcp::run(&mut b, dir.path()).await;
    }
    if run("expiry") {
        // The run's Redis, for its CPU per miss: a section before may have set others (none).
        b.redis_pids = redis.pid().into_iter().collect();
        expiry::run(&mut b, (&mut redis_conn, &redis_url), cli.quick).await;
    }
    if run("seal") {
        b.redis_pids = redis.pid().into_iter().collect();
        seal::run(&mut b, (&mut redis_conn, &redis_url), sizes, cli.quick).await;
    }
    if run("stream") {
        b.redis_pids = redis.pid().into_iter().collect();
        stream::run(&mut b, dir.path(), (&mut redis_conn, &redis_url), cli.quick).await;
    }
    if run("telemetry") {
        telemetry::run(&mut b).await;
    }
    if run("webhook") {
        webhook::run(&mut b, dir.path()).await;
    }
    if run("storm") {
        storm::run(&mut b, &redis_url).await;
    }
    if run("cluster") {
        cluster::run(&mut b, cli.quick).await;
    }
    if run("postgres") {
        postgres::run(&mut b, dir.path()).await;
    }
    if run("embedded") {
        embedded::run(&mut b, dir.path(), cli.quick).await;
    }
    if run("failover") {
        failover::run(&mut b, cli.quick, &cli.failover).await;
    }
    if run("chaos") {
        let plan = chaos::Plan::new(cli.quick, &cli.chaos, cli.chaos_secs, cli.seed);
        chaos::run(&mut b, &plan).await;
    }
    if soak > 0 && run("soak") {
        soak::run(&mut b, &redis_url, soak).await;
    }
    table::print(&b);
    charts::after_run(&b, !cli.quick && cli.only.is_empty());
    if b.insane.is_empty() {
        println!("\nsanity: ok");
        ExitCode::SUCCESS
    } else {
        println!("\nsanity: FAILED");
        b.insane.iter().for_each(|s| println!("- {s}"));
        ExitCode::FAILURE
    }
}
