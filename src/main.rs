//! The `idemgate` binary: parse the command line, set up logging, run until SIGINT/SIGTERM.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use idemgate::config::Config;
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

// mimalloc: hyper's many small per-request allocations are noticeably cheaper than with the
// system allocator (see loadtest/README.md for the figures).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// HTTP idempotency gateway: makes client retries with Idempotency-Key safe.
#[derive(Parser)]
#[command(version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    /// The TOML config file to run with.
    #[arg(long, short)]
    config: Option<String>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run on the embedded store in front of an example payments API, printing curl lines to try.
    Demo {
        /// Where the gateway listens.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
    },
    /// Validate a config file and print the effective policy of every route.
    CheckConfig {
        /// The TOML config file.
        file: String,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let result = match (cli.command, cli.config) {
        (Some(Command::Demo { listen }), _) => demo(&listen).await,
        (Some(Command::CheckConfig { file }), _) => check_config(&file),
        (None, Some(file)) => run(&file).await,
        (None, None) => {
            Err("give --config FILE (see config/example.toml), or try `idemgate demo`".into())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemgate: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(file: &str) -> Result<(), String> {
    let config = Config::load(file).map_err(|e| e.to_string())?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    idemgate::app::run(listener, config, shutdown_signal())
        .await
        .map_err(|e| e.to_string())
}

fn check_config(file: &str) -> Result<(), String> {
    let config = Config::load(file).map_err(|e| e.to_string())?;
    println!("{file}: valid");
    println!("listen   = {}", config.listen);
    println!("upstream = {}", config.upstream);
    println!(
        "store    = {:?} (prefix {:?})",
        store_label(&config),
        config.store.prefix
    );
    println!("[defaults] {:#?}", config.defaults);
    for r in &config.routes {
        println!("[route {}] {:#?}", r.path, r.policy);
    }
    Ok(())
}

fn store_label(config: &Config) -> &'static str {
    match config.store.backend {
        idemgate::config::StoreBackend::Memory => "memory",
        idemgate::config::StoreBackend::Redis { .. } => "redis",
    }
}

async fn demo(listen: &str) -> Result<(), String> {
    let upstream = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let upstream_addr = upstream.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move { axum::serve(upstream, idemgate::demo::payments_api()).await });
    let config = Config::from_toml(&idemgate::demo::config_toml(
        listen,
        &format!("http://{upstream_addr}"),
    ))
    .map_err(|e| e.to_string())?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e} (pick another with --listen)"))?;
    println!("{}", idemgate::demo::instructions(listen));
    idemgate::app::run(listener, config, shutdown_signal())
        .await
        .map_err(|e| e.to_string())
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: no new connections, finishing open ones");
}
