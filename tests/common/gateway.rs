//! The gateway under test, and one test's world around it.
//!
//! - [`TestEnv::start(backend, settings)`](TestEnv::start): an upstream, a redis-server on the
//!   Redis backend, and the gateway between them; `env.post_keyed("/v1/p", "k")` sends through it.
//! - [`InProcessGateway::start(&config)`](InProcessGateway::start): another gateway in this
//!   process, e.g. a second replica on the same Redis (`env.config()` is the first one's config).
//! - [`binary()`](binary)`.start(&config)`: the `idemgate` binary as a child process (testkit's
//!   [`GatewayProcess`]), for what needs a real process: `kill9()`, `sigterm()`,
//!   `wait_exit(limit)`.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;

use testkit::metrics::{metric, scrape};
use testkit::{GatewayProcess, Launch};

use super::{
    client, send, wait_until, Backend, CountingUpstream, GatewayConfig, PostgresServer,
    RedisServer, Seen, StoreServer, TestCa, Validity,
};

/// The gateway running in this process on a loopback port it bound itself; stopped on drop.
pub struct InProcessGateway {
    pub addr: SocketAddr,
    /// The admin listener, when the config has one.
    pub admin: Option<SocketAddr>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl InProcessGateway {
    /// Start the gateway with `config` (its `listen` is ignored: a free port is used). Returns
    /// once the store is connected, so the gateway is ready when the test goes on.
    pub async fn start(config: &GatewayConfig) -> Self {
        Self::try_start(config)
            .await
            .expect("gateway failed to start")
    }

    /// [`start`](Self::start), or why the gateway would not.
    pub async fn try_start(config: &GatewayConfig) -> Result<Self, idemgate::AppError> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let app = idemgate::App::new(parse(config)).await?;
        let admin = app.admin_addr();
        let task = tokio::spawn(async move {
            app.serve(listener, async {
                let _ = rx.await;
            })
            .await
            .expect("gateway failed");
        });
        Ok(InProcessGateway {
            addr,
            admin,
            shutdown: Some(tx),
            task: Some(task),
        })
    }

    /// A gateway that is not running (a placeholder while another starts).
    fn stopped() -> Self {
        InProcessGateway {
            addr: ([127, 0, 0, 1], 0).into(),
            admin: None,
            shutdown: None,
            task: None,
        }
    }

    /// `http://ADDR/path`
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// A keyed `POST /v1/p` runs the upstream (201) and its retry is replayed: `upstream` (fresh
    /// for the test) is called once.
    pub async fn runs_once_then_replays(&self, upstream: &CountingUpstream, key: &str) {
        let post = || {
            client()
                .post(self.url("/v1/p"))
                .header("idempotency-key", key)
                .body("x")
        };
        assert_eq!(send(post()).await.status, 201);
        assert!(send(post()).await.replayed(), "{key}: replayed");
        assert_eq!(upstream.calls(), 1, "{key}: one call");
    }

    /// What its admin listener's `GET /metrics` says (the config must have `admin.listen`).
    pub async fn metrics(&self) -> String {
        scrape(self.admin.expect("an admin listener in the config"))
            .await
            .unwrap()
    }

    /// The value of one series of its `GET /metrics` (see [`testkit::metrics::metric`]).
    pub async fn metric(&self, series: &str) -> f64 {
        metric(self.admin.expect("an admin listener in the config"), series).await
    }

    /// Stop accepting and wait for the server task to end.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    }
}

impl Drop for InProcessGateway {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// The config as the gateway library parses it, with the secrets a gateway process would find
/// in its environment.
fn parse(config: &GatewayConfig) -> idemgate::config::Config {
    let mut secrets = idemgate::config::Secrets::default();
    secrets.key_secret = config.key_secret.as_ref().map(|s| s.as_bytes());
    secrets.seal_keys = config.seal_keys.as_deref();
    secrets.vars = Some(&config.env);
    idemgate::config::Config::from_toml_with_secrets(&config.to_toml(), secrets)
        .unwrap_or_else(|e| panic!("invalid test config ({e}):\n{}", config.to_toml()))
}

/// The `idemgate` binary of this build, to start as a child process:
/// `binary().start(&config).await`. Its log goes where `TEST_LOG` says (a `RUST_LOG` filter;
/// off by default).
pub fn binary() -> Launch {
    let log = std::env::var("TEST_LOG").unwrap_or_else(|_| "off".into());
    GatewayProcess::binary(env!("CARGO_BIN_EXE_idemgate")).env("RUST_LOG", &log)
}

/// One test's world: a [`CountingUpstream`], a [`RedisServer`] on the Redis backend, and an
/// [`InProcessGateway`] between them and the test's client.
pub struct TestEnv {
    pub backend: Backend,
    pub upstream: CountingUpstream,
    pub gateway: InProcessGateway,
    pub client: reqwest::Client,
    server: Option<StoreServer>,
    /// The embedded store's directory, on that backend (removed when the world goes).
    _dir: Option<tempfile::TempDir>,
    /// The gateway's whole config, to restart it alike or start a sibling.
    config: GatewayConfig,
}

impl TestEnv {
    /// Start the world for `backend`. `settings` is the gateway's config without its upstream
    /// and store, which this world fills in: `GatewayConfig::new().set("defaults.ttl", "1s")`.
    pub async fn start(backend: Backend, settings: GatewayConfig) -> Self {
        Self::start_with(backend, CountingUpstream::start().await, settings).await
    }

    /// Start with a given upstream (e.g. one with a delay).
    pub async fn start_with(
        backend: Backend,
        upstream: CountingUpstream,
        settings: GatewayConfig,
    ) -> Self {
        let server = StoreServer::for_backend(backend).await;
        let dir = (backend == Backend::Embedded).then(|| tempfile::tempdir().unwrap());
        let config = match &dir {
            Some(dir) => settings.upstream(&upstream.url()).embedded(dir.path()),
            None => settings.upstream(&upstream.url()).store(server.as_ref()),
        };
        let gateway = InProcessGateway::start(&config).await;
        TestEnv {
            backend,
            upstream,
            gateway,
            client: client(),
            server,
            _dir: dir,
            config,
        }
    }

    /// The config the gateway runs with (upstream and store included), to start another
    /// gateway alike: `InProcessGateway::start(&env.config().set("workers", 1))`.
    pub fn config(&self) -> GatewayConfig {
        self.config.clone()
    }

    /// The redis-server of a Redis-backend world.
    pub fn redis(&self) -> &RedisServer {
        self.server
            .as_ref()
            .expect("a redis-server runs only on the Redis backend")
            .redis()
    }

    /// The server of a Redis- or Postgres-backend world, whichever it is.
    pub fn store_server(&self) -> &StoreServer {
        self.server
            .as_ref()
            .expect("a store server runs only on the Redis and Postgres backends")
    }

    /// The PostgreSQL server of a Postgres-backend world.
    pub fn postgres(&self) -> &PostgresServer {
        self.server
            .as_ref()
            .expect("PostgreSQL runs only on the Postgres backend")
            .postgres()
    }

    /// Stop the gateway and start a new one with `config` (`env.config()` changed) on the same
    /// store.
    pub async fn restart_gateway_with(&mut self, config: GatewayConfig) {
        self.config = config;
        self.restart_gateway().await;
    }

    /// Stop the gateway and start a new one with the same config and store.
    pub async fn restart_gateway(&mut self) {
        if self.backend != Backend::Embedded {
            let new = InProcessGateway::start(&self.config).await;
            std::mem::replace(&mut self.gateway, new).stop().await;
            return;
        }
        // One gateway per directory: the old one lets go of the file before the new one opens it
        // (its writer closes the file once the last handle is gone).
        let dummy = InProcessGateway::stopped();
        std::mem::replace(&mut self.gateway, dummy).stop().await;
        let mut started = None;
        wait_until(
            Duration::from_secs(10),
            "the store's file let go",
            async || {
                started = InProcessGateway::try_start(&self.config).await.ok();
                started.is_some()
            },
        )
        .await;
        self.gateway = started.unwrap();
    }

    /// `http://GATEWAY/path`
    pub fn url(&self, path: &str) -> String {
        self.gateway.url(path)
    }

    /// A POST through the gateway.
    pub fn post(&self, path: &str) -> reqwest::RequestBuilder {
        self.client.post(self.url(path))
    }

    /// A POST through the gateway with an `Idempotency-Key`.
    pub fn post_keyed(&self, path: &str, key: &str) -> reqwest::RequestBuilder {
        self.post(path).header("idempotency-key", key)
    }

    /// Retry `POST path` with `key` and `body` while it is answered `409 in-flight` (any other
    /// problem fails the test), for at most `limit`; the first other answer. `what` says what is
    /// awaited, for the failure message.
    pub async fn retry_while_in_flight(
        &self,
        (path, key, body): (&str, &str, &str),
        limit: Duration,
        what: &str,
    ) -> Seen {
        let mut answer = None;
        wait_until(limit, what, async || {
            let seen = send(self.post_keyed(path, key).body(body.to_string())).await;
            if seen.status != 409 {
                answer = Some(seen);
                return true;
            }
            assert_eq!(seen.problem_type(), "urn:idemgate:problem:in-flight");
            false
        })
        .await;
        answer.expect("answered")
    }
}

/// What a running gateway's admin listener exposes at `GET /metrics`, once its routes and
/// upstream have made their series (a family with no series is not exposed; the registry starts
/// every series of a label set known up front at zero).
pub async fn every_family_scraped() -> String {
    // A webhook route: its family's series start at zero.
    let webhook = toml::toml! { webhook = "github" webhook_secret_env = "DOCS_WEBHOOK_SECRET" };
    // A listener certificate: the expiry family holds its series.
    let ca = TestCa::new();
    let cert = ca.server("gateway", &["127.0.0.1"], Validity::Now);
    let config = GatewayConfig::new()
        .upstream("http://127.0.0.1:9")
        .set("admin.listen", "127.0.0.1:0")
        .set("tls.cert_file", cert.cert())
        .set("tls.key_file", cert.key_path())
        .route("/hooks", webhook)
        .route("/mcp", toml::toml! { protocol = "mcp" })
        .env("DOCS_WEBHOOK_SECRET", "a-webhook-secret");
    let gateway = InProcessGateway::start(&config).await;
    let mut scraped = String::new();
    wait_until(
        Duration::from_secs(10),
        "the upstream's series",
        async || {
            scraped = gateway.metrics().await;
            scraped.contains("idemgate_upstream_requests_total{")
        },
    )
    .await;
    gateway.stop().await;
    scraped
}
