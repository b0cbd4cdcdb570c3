//! The `idemgate` binary: parse the command line, set up logging, run until SIGINT/SIGTERM,
//! reload the configuration on SIGHUP.

mod demo;

use std::io::Write as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use idemgate::config::Config;
use idemgate::telemetry::{SpanMetrics, Telemetry, UnsampledOff};
use idemgate::Metrics;
use tokio::net::TcpListener;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

// mimalloc: hyper's many small per-request allocations are noticeably cheaper than with the
// system allocator (see loadtest/README.md for the figures).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// HTTP idempotency gateway: makes client retries with Idempotency-Key safe.
#[derive(Parser)]
#[command(version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    /// The TOML config file to run with; IDEMGATE_... variables override it (or replace it).
    #[arg(long, short)]
    config: Option<String>,
    /// Log lines as human-readable text or as JSON objects; the level comes from RUST_LOG.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run on the in-memory store in front of an example payments API, printing curl lines to try.
    Demo {
        /// Where the gateway listens.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
    },
    /// Validate a config (file and IDEMGATE_... variables) and print the effective settings.
    CheckConfig {
        /// The TOML config file (optional when the environment carries the config).
        file: Option<String>,
    },
    /// Exit 0 when the admin listener's /healthz answers 200 (for container health checks).
    Healthcheck {
        /// The health URL.
        #[arg(long, default_value = "http://127.0.0.1:9090/healthz")]
        url: String,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let format = cli.log_format;
    let result = match (cli.command, cli.config) {
        (Some(Command::Demo { listen }), _) => {
            init_logging(format, None);
            demo(&listen).await
        }
        (Some(Command::CheckConfig { file }), _) => {
            init_logging(format, None);
            check_config(file.as_deref())
        }
        (Some(Command::Healthcheck { url }), _) => {
            init_logging(format, None);
            healthcheck(&url).await
        }
        // Logging starts once the config says whether traces are exported.
        (None, file) => run(file.as_deref(), format).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemgate: {e}");
            ExitCode::FAILURE
        }
    }
}

fn load(file: Option<&str>) -> Result<Config, String> {
    Config::load(file).map_err(|e| {
        if file.is_none() {
            format!("{e} (give --config FILE, see config/example.toml, or set IDEMGATE_UPSTREAM; or try `idemgate demo`)")
        } else {
            e.to_string()
        }
    })
}

/// Log to stderr at `RUST_LOG`'s level (default `info`); with `telemetry`, also record the
/// sampled requests' spans for export.
fn init_logging(format: LogFormat, telemetry: Option<&Telemetry>) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let Some(telemetry) = telemetry else {
        // Without traces, one global filter: spans below its level cost next to nothing.
        match format {
            LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).init(),
            LogFormat::Json => tracing_subscriber::fmt()
                .json()
                .with_current_span(true)
                .with_env_filter(filter)
                .init(),
        }
        return;
    };
    // With traces, each layer filters for itself: the debug-level spans of sampled requests
    // reach the OTel layer whatever RUST_LOG says; an unsampled request's are not made at all.
    let filter_level = filter.max_level_hint();
    let fmt = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer().with_filter(filter).boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_filter(filter)
            .boxed(),
    };
    tracing_subscriber::registry()
        .with(UnsampledOff::new(filter_level))
        .with(fmt)
        .with(telemetry.layer())
        .init();
}

async fn run(file: Option<&str>, format: LogFormat) -> Result<(), String> {
    let shutdown = shutdown_signal();
    let hangups = hangup_signal();
    let config = load(file)?;
    let metrics = Metrics::new();
    let dropped = metrics.families::<SpanMetrics>().dropped.clone();
    let telemetry = match &config.telemetry {
        Some(t) => Some(Telemetry::start(t, dropped)?),
        None => None,
    };
    init_logging(format, telemetry.as_ref());
    let served = serve(config, metrics, shutdown, hangups, file).await;
    if let Some(telemetry) = telemetry {
        telemetry.shutdown().await;
    }
    served
}

async fn serve(
    config: Config,
    metrics: Metrics,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    hangups: Hangups,
    file: Option<&str>,
) -> Result<(), String> {
    if let Some(t) = &config.telemetry {
        tracing::info!(collector = %t.traces_url, sample_ratio = t.sample_ratio, "exporting traces");
    }
    tracing::info!(store = %config.store.describe(), "configuration loaded");
    if let Some(warning) = config.store.durability_warning() {
        tracing::warn!("{warning}");
    }
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    // A signal while the store is being opened (a Redis that does not answer can take its
    // timeout) stops the start there.
    let mut shutdown = Box::pin(shutdown);
    let app = tokio::select! {
        app = idemgate::App::with_metrics(config, metrics) => app.map_err(|e| e.to_string())?,
        () = &mut shutdown => return Ok(()),
    };
    let reloads = tokio::spawn(reload_on_hangup(
        hangups,
        file.map(str::to_owned),
        app.reloader(),
    ));
    let served = app.serve(listener, shutdown).await;
    reloads.abort();
    served.map_err(|e| e.to_string())
}

/// SIGHUP, as the reload's trigger (installed at start, so that an early one does not kill
/// the process).
#[cfg(unix)]
type Hangups = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangups = ();

fn hangup_signal() -> Hangups {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        signal(SignalKind::hangup()).ok()
    }
}

/// On each SIGHUP, read `file` with the environment over it, as at start, and reload.
async fn reload_on_hangup(
    mut hangups: Hangups,
    file: Option<String>,
    reloader: idemgate::Reloader,
) {
    loop {
        #[cfg(unix)]
        next(&mut hangups).await;
        #[cfg(not(unix))]
        std::future::pending::<()>().await;
        tracing::info!(
            file = file.as_deref().unwrap_or("environment"),
            "SIGHUP: reloading the configuration"
        );
        // Refusals are logged and counted by the reloader.
        let _ = reloader.reload(Config::load(file.as_deref()));
    }
}

fn check_config(file: Option<&str>) -> Result<(), String> {
    let (config, sources) = Config::load_with_sources(file).map_err(|e| e.to_string())?;
    let shown = config.effective_toml(&sources, file.unwrap_or("environment"));
    // Written whole, so that a reader that stops early (`| head`) ends nothing but the output.
    let _ = std::io::stdout().write_all(shown.as_bytes());
    Ok(())
}

async fn healthcheck(url: &str) -> Result<(), String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let authority = uri.authority().ok_or("the URL needs a host")?.to_string();
    let check = async {
        let stream = tokio::net::TcpStream::connect(&authority)
            .await
            .map_err(|e| e.to_string())?;
        let (mut send, conn) = hyper::client::conn::http1::handshake::<
            _,
            http_body_util::Empty<bytes::Bytes>,
        >(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let req = http::Request::get(uri.path())
            .header(http::header::HOST, &authority)
            .body(http_body_util::Empty::new())
            .map_err(|e| e.to_string())?;
        let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
        if resp.status() == http::StatusCode::OK {
            Ok(())
        } else {
            Err(format!("{url} answered {}", resp.status()))
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(3), check)
        .await
        .map_err(|_| format!("{url} did not answer in 3 s"))?
}

async fn demo(listen: &str) -> Result<(), String> {
    let upstream = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let upstream_addr = upstream.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move { axum::serve(upstream, demo::payments_api()).await });
    let config = Config::from_toml(&demo::config_toml(
        listen,
        &format!("http://{upstream_addr}"),
    ))
    .map_err(|e| e.to_string())?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e} (pick another with --listen)"))?;
    println!("{}", demo::instructions(listen));
    idemgate::run(listener, config, shutdown_signal())
        .await
        .map_err(|e| e.to_string())
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM. The handlers are installed now, not when the future
/// is first polled: until then a signal would take its default action and kill the process
/// without draining (the listener is bound, and requests flow, before the server awaits this).
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let (mut int, mut term) = {
        use tokio::signal::unix::{signal, SignalKind};
        (
            signal(SignalKind::interrupt()).ok(),
            signal(SignalKind::terminate()).ok(),
        )
    };
    async move {
        #[cfg(unix)]
        tokio::select! { _ = next(&mut int) => {}, _ = next(&mut term) => {} }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
        tracing::info!("shutting down: no new connections, finishing open ones");
    }
}

/// The next delivery of `signal` (never, when it could not be installed).
#[cfg(unix)]
async fn next(signal: &mut Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending().await,
    }
}
