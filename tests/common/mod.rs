//! Shared integration-test helpers: a real redis-server on a free port, a real upstream HTTP
//! server, and the real gateway over real sockets. They read like sentences:
//! `let env = TestEnv::start(backend, "[defaults]\nttl = \"1s\"").await; env.post("/x").key("k")`.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;

pub mod raw;

// === Backends ===

/// Which store a behavioural test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis,
}

/// Generate one test per backend for each named `async fn(Backend)`.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod on_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::common::Backend::Memory).await
                }
            )*
        }
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::common::Backend::Redis).await
                }
            )*
        }
    };
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

// === redis-server ===

/// A redis-server child process on a free port, in its own temporary directory. Killed on drop.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    appendonly: bool,
}

impl RedisServer {
    /// Start a redis-server without persistence.
    pub async fn start() -> Self {
        Self::start_with(false).await
    }

    /// Start a redis-server with AOF persistence (`appendfsync always`) in its directory.
    pub async fn start_durable() -> Self {
        Self::start_with(true).await
    }

    /// Start a redis-server (no persistence) on `port`.
    pub async fn start_on_port(port: u16) -> Self {
        let mut server = RedisServer {
            child: None,
            port,
            dir: tempfile::tempdir().unwrap(),
            appendonly: false,
        };
        server.spawn().await;
        server
    }

    async fn start_with(appendonly: bool) -> Self {
        let mut server = RedisServer {
            child: None,
            port: free_port(),
            dir: tempfile::tempdir().unwrap(),
            appendonly,
        };
        server.spawn().await;
        server
    }

    async fn spawn(&mut self) {
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--save")
            .arg("")
            .arg("--maxmemory-policy")
            .arg("noeviction");
        if self.appendonly {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (scripts/test installs it)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(client) = redis::Client::open(self.url()) {
                if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                    let pong: redis::RedisResult<String> =
                        redis::cmd("PING").query_async(&mut c).await;
                    if pong.is_ok() {
                        return;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on port {}",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `redis://127.0.0.1:PORT/0`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// SIGKILL the server (no shutdown save).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP: the server stalls (connections stay open, nothing is answered).
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`RedisServer::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("running").id();
        assert!(Command::new("kill")
            .arg(sig)
            .arg(pid.to_string())
            .status()
            .unwrap()
            .success());
    }

    /// Kill and start again on the same port and directory (AOF, if on, is reloaded).
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    /// A raw connection for assertions.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

// === the upstream ===

/// A real HTTP upstream that counts its executions. Behaviour per request, by query string:
/// `status=NNN` answers that status, `delay_ms=N` sleeps first; path `/echo` answers the request
/// body as-is; path `/big` answers `bytes=N` bytes. Every other path answers a JSON description
/// of the request with the execution number, so two executions never answer the same bytes.
#[derive(Clone)]
pub struct Upstream {
    pub addr: SocketAddr,
    state: Arc<UpstreamState>,
}

#[derive(Default)]
struct UpstreamState {
    calls: AtomicUsize,
    // The client addresses seen: one per connection.
    peers: Mutex<std::collections::HashSet<SocketAddr>>,
    delay: Mutex<Duration>,
    last_headers: Mutex<Option<HeaderMap>>,
}

impl Upstream {
    /// Start on a free port.
    pub async fn start() -> Self {
        Self::start_on(TcpListener::bind("127.0.0.1:0").await.unwrap()).await
    }

    /// Start on a free port of the IPv6 loopback address.
    pub async fn start_v6() -> Self {
        Self::start_on(TcpListener::bind("[::1]:0").await.unwrap()).await
    }

    /// Start on a given port (to bring an upstream up where the gateway already points).
    pub async fn start_on_port(port: u16) -> Self {
        Self::start_on(TcpListener::bind(("127.0.0.1", port)).await.unwrap()).await
    }

    async fn start_on(listener: TcpListener) -> Self {
        let state = Arc::new(UpstreamState::default());
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(state.clone());
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
        });
        Upstream { addr, state }
    }

    /// Every request waits this long before answering.
    pub fn delay(self, d: Duration) -> Self {
        *self.state.delay.lock().unwrap() = d;
        self
    }

    /// How many requests reached the upstream.
    pub fn calls(&self) -> usize {
        self.state.calls.load(Ordering::SeqCst)
    }

    /// How many connections requests came on.
    pub fn connections(&self) -> usize {
        self.state.peers.lock().unwrap().len()
    }

    /// The headers of the last request that reached the upstream.
    pub fn last_headers(&self) -> HeaderMap {
        self.state
            .last_headers
            .lock()
            .unwrap()
            .clone()
            .expect("no request reached the upstream")
    }

    pub fn url(&self) -> String {
        // `SocketAddr`'s display brackets an IPv6 address, as a URL wants.
        format!("http://{}", self.addr)
    }
}

#[derive(serde::Deserialize)]
struct Knobs {
    status: Option<u16>,
    delay_ms: Option<u64>,
    bytes: Option<usize>,
}

async fn handle(
    State(state): State<Arc<UpstreamState>>,
    Query(knobs): Query<Knobs>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<SocketAddr>,
    req: Request,
) -> Response {
    let n = state.calls.fetch_add(1, Ordering::SeqCst) + 1;
    state.peers.lock().unwrap().insert(peer);
    let (parts, body) = req.into_parts();
    *state.last_headers.lock().unwrap() = Some(parts.headers.clone());
    let body: Bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let delay = knobs
        .delay_ms
        .map(Duration::from_millis)
        .unwrap_or_else(|| *state.delay.lock().unwrap());
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let status = StatusCode::from_u16(knobs.status.unwrap_or(201)).unwrap();
    let call = [("x-call", n.to_string())];
    match parts.uri.path() {
        "/echo" => (
            status,
            call,
            [("content-type", "application/octet-stream")],
            body,
        )
            .into_response(),
        "/big" => {
            let bytes: Vec<u8> = (0..knobs.bytes.unwrap_or(0))
                .map(|i| (i % 251) as u8)
                .collect();
            (status, call, bytes).into_response()
        }
        path => {
            let key = parts
                .headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok());
            let json = serde_json::json!({
                "call": n,
                "method": parts.method.as_str(),
                "path": path,
                "idempotency_key": key,
                "body_len": body.len(),
            });
            let mut resp = (status, call, axum::Json(json)).into_response();
            resp.headers_mut()
                .append("set-cookie", "a=1".parse().unwrap());
            resp.headers_mut()
                .append("set-cookie", "b=2".parse().unwrap());
            resp
        }
    }
}

// === the gateway ===

/// The gateway running in this process on a real socket; stopped on drop.
pub struct Gateway {
    pub addr: SocketAddr,
    /// The admin listener, when the config has one.
    pub admin: Option<SocketAddr>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Gateway {
    /// Start the gateway with a complete TOML config (its `listen` is ignored: a free port is used).
    pub async fn spawn(toml: &str) -> Self {
        let config = idemgate::config::Config::from_toml(toml).expect("test config must be valid");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        // Connect the store before returning, so the gateway is ready when the test goes on.
        let app = idemgate::app::App::new(config)
            .await
            .expect("gateway failed to start");
        let admin = app.admin_addr();
        let task = tokio::spawn(async move {
            app.serve(listener, async {
                let _ = rx.await;
            })
            .await
            .expect("gateway failed");
        });
        Gateway {
            addr,
            admin,
            shutdown: Some(tx),
            task: Some(task),
        }
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

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

// === one test's world ===

/// An upstream, optionally a redis-server, and a gateway between them and the test's client.
pub struct TestEnv {
    pub backend: Backend,
    pub upstream: Upstream,
    pub redis: Option<RedisServer>,
    pub gateway: Gateway,
    pub client: reqwest::Client,
    /// The extra TOML the gateway was started with, to restart it alike.
    extra: String,
}

/// The base config for `backend`, pointing at `upstream_url`, followed by `extra` tables.
pub fn config_for(
    backend: Backend,
    redis: Option<&RedisServer>,
    upstream_url: &str,
    extra: &str,
) -> String {
    let store = match (backend, redis) {
        (Backend::Redis, Some(r)) => format!(
            "backend = \"redis\"\nurl = \"{}\"\nprefix = \"test:\"",
            r.url()
        ),
        _ => "backend = \"memory\"".to_string(),
    };
    format!(
        "listen = \"127.0.0.1:0\"\nupstream = \"{upstream_url}\"\n\n[store]\n{store}\n\n{extra}\n"
    )
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

impl TestEnv {
    /// Start the world for `backend`; `extra` is TOML appended to the config (`[defaults]`, routes).
    pub async fn start(backend: Backend, extra: &str) -> Self {
        Self::start_with(backend, Upstream::start().await, extra).await
    }

    /// Start with a given upstream (e.g. one with a delay).
    pub async fn start_with(backend: Backend, upstream: Upstream, extra: &str) -> Self {
        let redis = match backend {
            Backend::Redis => Some(RedisServer::start().await),
            Backend::Memory => None,
        };
        let gateway =
            Gateway::spawn(&config_for(backend, redis.as_ref(), &upstream.url(), extra)).await;
        TestEnv {
            backend,
            upstream,
            redis,
            gateway,
            client: client(),
            extra: extra.to_string(),
        }
    }

    /// Stop the gateway and start a new one with the same config and store.
    pub async fn restart_gateway(&mut self) {
        let config = config_for(
            self.backend,
            self.redis.as_ref(),
            &self.upstream.url(),
            &self.extra,
        );
        let old = std::mem::replace(&mut self.gateway, Gateway::spawn(&config).await);
        old.stop().await;
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.gateway.addr, path)
    }

    /// A POST through the gateway.
    pub fn post(&self, path: &str) -> reqwest::RequestBuilder {
        self.client.post(self.url(path))
    }

    /// A POST through the gateway with an `Idempotency-Key`.
    pub fn post_keyed(&self, path: &str, key: &str) -> reqwest::RequestBuilder {
        self.post(path).header("idempotency-key", key)
    }
}

/// A response read whole, for comparisons.
#[derive(Debug, Clone)]
pub struct Seen {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Bytes,
}

impl Seen {
    pub async fn of(resp: reqwest::Response) -> Self {
        Seen {
            status: resp.status().as_u16(),
            headers: resp.headers().clone(),
            body: resp.bytes().await.unwrap(),
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The `type` of a problem+json body (panics when the body is not one).
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        v["type"].as_str().unwrap().to_string()
    }

    /// The headers other than `Idempotent-Replayed`, in order, for replay comparisons.
    pub fn headers_without_marker(&self) -> Vec<(String, Vec<u8>)> {
        self.headers
            .iter()
            .filter(|(n, _)| n.as_str() != "idempotent-replayed")
            .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
            .collect()
    }
}

/// Send and read whole.
pub async fn send(req: reqwest::RequestBuilder) -> Seen {
    Seen::of(req.send().await.expect("request failed")).await
}

// === the gateway as a separate process (for kill -9 and SIGTERM) ===

/// The real `idemgate` binary running with a config file, on a free port.
pub struct GatewayProcess {
    pub addr: SocketAddr,
    child: Option<Child>,
    _config: tempfile::NamedTempFile,
}

impl GatewayProcess {
    /// Start the binary with `toml` (whose `listen` line is replaced by a free port).
    pub async fn start(toml: &str) -> Self {
        let port = free_port();
        let toml = toml.replace(
            "listen = \"127.0.0.1:0\"",
            &format!("listen = \"127.0.0.1:{port}\""),
        );
        let config = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(config.path(), toml).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .arg("--config")
            .arg(config.path())
            .env(
                "RUST_LOG",
                std::env::var("TEST_LOG").unwrap_or_else(|_| "off".into()),
            )
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(Instant::now() < deadline, "gateway process did not start");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        GatewayProcess {
            addr,
            child: Some(child),
            _config: config,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// SIGKILL: no chance to clean up, as in a crash.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Send SIGTERM.
    pub fn sigterm(&self) {
        let pid = self.child.as_ref().expect("running").id();
        let ok = Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Wait for the process to exit (up to `limit`), returning its exit status.
    pub async fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        let child = self.child.as_mut().expect("running");
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "gateway did not exit in {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

// === redis-server over TLS ===

/// A redis-server that speaks only TLS, with a fresh self-signed certificate for 127.0.0.1.
pub struct TlsRedisServer {
    child: Child,
    pub port: u16,
    /// The PEM certificate clients must trust.
    pub ca_file: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl TlsRedisServer {
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let cert = rcgen::generate_simple_self_signed(vec![
            "127.0.0.1".to_string(),
            "localhost".to_string(),
        ])
        .unwrap();
        let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert_file, cert.cert.pem()).unwrap();
        std::fs::write(&key_file, cert.signing_key.serialize_pem()).unwrap();
        let port = free_port();
        let child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--tls-port", &port.to_string(), "--tls-auth-clients", "no"])
            .arg("--tls-cert-file")
            .arg(&cert_file)
            .arg("--tls-key-file")
            .arg(&key_file)
            .arg("--tls-ca-cert-file")
            .arg(&cert_file)
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed");
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "TLS redis-server did not start");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        TlsRedisServer {
            child,
            port,
            ca_file: cert_file,
            _dir: dir,
        }
    }
}

impl Drop for TlsRedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
