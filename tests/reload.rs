//! Reloads (SIGHUP) of the gateway binary: what a reload puts in force for new requests, what
//! it leaves to the requests and connections already open, and the reloads it refuses.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use toml::toml;

use crate::common::metrics::value_of;
use crate::common::raw::RawClient;
use crate::common::{
    binary, client, send, wait_until, Backend, CountingUpstream, GatewayConfig, GatewayProcess,
    StoreServer, TestCa, Validity,
};

const SUCCESS: &str = "idemgate_config_reloads_total{result=\"success\"}";
const FAILURE: &str = "idemgate_config_reloads_total{result=\"failure\"}";

/// A gateway process in front of two upstreams (`a`, the default at start, and `b`), on a
/// backend's store, with the config it runs.
struct World {
    a: CountingUpstream,
    b: CountingUpstream,
    gateway: GatewayProcess,
    config: GatewayConfig,
    client: reqwest::Client,
    _server: Option<StoreServer>,
    _log: tempfile::TempDir,
}

impl World {
    /// `settings` (routes, defaults) over upstream `a` and the backend's store, two workers.
    async fn start(backend: Backend, settings: GatewayConfig) -> Self {
        let (a, b) = (
            CountingUpstream::start().await,
            CountingUpstream::start().await,
        );
        Self::start_with(backend, settings, a, b).await
    }

    async fn start_with(
        backend: Backend,
        settings: GatewayConfig,
        a: CountingUpstream,
        b: CountingUpstream,
    ) -> Self {
        let server = StoreServer::for_backend(backend).await;
        let log = tempfile::tempdir().unwrap();
        let config = match backend {
            Backend::Embedded => settings.embedded(&log.path().join("store")),
            _ => settings.store(server.as_ref()),
        };
        let config = config.upstream(&a.url()).set("workers", 2).admin();
        let gateway = binary()
            .env("RUST_LOG", "idemgate=warn")
            .log_to(&log.path().join("gateway.log"))
            .start(&config)
            .await;
        gateway.wait_for_admin(Duration::from_secs(10)).await;
        World {
            a,
            b,
            gateway,
            config,
            client: client(),
            _server: server,
            _log: log,
        }
    }

    /// Reload with `config` and wait until the gateway counts it as a success.
    async fn reload(&mut self, config: GatewayConfig) {
        let before = self.metric(SUCCESS).await;
        self.gateway.reload(&config);
        self.counted(SUCCESS, before + 1.0).await;
        self.config = config;
    }

    /// Reload with the file `text` and wait until the gateway counts it as refused.
    async fn refused(&self, text: &str) {
        let before = self.metric(FAILURE).await;
        self.gateway.reload_text(text);
        self.counted(FAILURE, before + 1.0).await;
    }

    async fn counted(&self, series: &str, n: f64) {
        let what = format!("{series} reaches {n}");
        wait_until(Duration::from_secs(10), &what, async || {
            self.metric(series).await >= n
        })
        .await;
    }

    async fn metric(&self, series: &str) -> f64 {
        let text = self.gateway.scrape().await.unwrap();
        value_of(&text, series).unwrap_or_else(|| panic!("no {series} in:\n{text}"))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._log.path().join("gateway.log")).unwrap_or_default()
    }

    fn post(&self, path: &str) -> reqwest::RequestBuilder {
        self.client.post(self.gateway.url(path))
    }

    fn post_keyed(&self, path: &str, key: &str) -> reqwest::RequestBuilder {
        self.post(path).header("idempotency-key", key)
    }
}

async fn new_ttl_applies_to_new_keys_while_older_records_replay(backend: Backend) {
    let config = GatewayConfig::new().route("/v1/p", toml! { ttl = "60s" });
    let mut w = World::start(backend, config.clone()).await;
    let old = send(w.post_keyed("/v1/p", "old").body("x")).await;
    assert_eq!(old.status, 201);
    w.reload(config_with_route(&w.config, "/v1/p", toml! { ttl = "1s" }))
        .await;
    assert_eq!(
        send(w.post_keyed("/v1/p", "new").body("x")).await.status,
        201
    );
    assert_eq!(w.a.calls(), 2);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // The new key's record lived 1 s: it runs again. The old one's 60 s are its own.
    let new = send(w.post_keyed("/v1/p", "new").body("x")).await;
    assert!(
        !new.replayed(),
        "a record made with ttl 1s replayed after 2.5 s"
    );
    let again = send(w.post_keyed("/v1/p", "old").body("x")).await;
    assert!(
        again.replayed(),
        "a record made before the reload did not replay"
    );
    assert_eq!(again.body, old.body);
    assert_eq!(w.a.calls(), 3);
}

async fn default_upstream_switched_and_earlier_records_replay(backend: Backend) {
    let mut w = World::start(backend, GatewayConfig::new()).await;
    let first = send(w.post_keyed("/v1/p", "k1").body("x")).await;
    assert_eq!(first.status, 201);
    let switched = w.config.clone().upstream(&w.b.url());
    w.reload(switched).await;
    assert_eq!(
        send(w.post_keyed("/v1/p", "k2").body("x")).await.status,
        201
    );
    assert_eq!(send(w.post("/v1/unkeyed").body("x")).await.status, 201);
    assert_eq!((w.a.calls(), w.b.calls()), (1, 2), "new requests go to b");
    let retry = send(w.post_keyed("/v1/p", "k1").body("x")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!((w.a.calls(), w.b.calls()), (1, 2), "a replay calls neither");
}

async fn a_request_in_flight_across_a_reload_is_recorded_once(backend: Backend) {
    let slow = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(1500));
    let b = CountingUpstream::start().await;
    let mut w = World::start_with(backend, GatewayConfig::new(), slow, b).await;
    let in_flight = tokio::spawn(send(w.post_keyed("/v1/p", "k").body("x")));
    w.a.wait_for_calls(1).await;
    let switched = w
        .config
        .clone()
        .upstream(&w.b.url())
        .set("defaults.ttl", "2h");
    w.reload(switched).await;
    let first = in_flight.await.unwrap();
    assert_eq!(
        first.status, 201,
        "the request in flight finished on its upstream"
    );
    let retry = send(w.post_keyed("/v1/p", "k").body("x")).await;
    assert!(retry.replayed(), "the request in flight was not recorded");
    assert_eq!(retry.body, first.body);
    assert_eq!((w.a.calls(), w.b.calls()), (1, 0));
}

on_both_backends!(
    new_ttl_applies_to_new_keys_while_older_records_replay,
    default_upstream_switched_and_earlier_records_replay,
    a_request_in_flight_across_a_reload_is_recorded_once,
);

/// `config` with the route at `path` replaced by one with `settings` (or added).
fn config_with_route(config: &GatewayConfig, path: &str, settings: toml::Table) -> GatewayConfig {
    let mut config = config.clone();
    if let Some(toml::Value::Array(routes)) = config.get("routes").cloned() {
        let kept: Vec<toml::Value> = routes
            .into_iter()
            .filter(|r| r.get("path").and_then(toml::Value::as_str) != Some(path))
            .collect();
        config = config.set("routes", toml::Value::Array(kept));
    }
    config.route(path, settings)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_key_toggled_and_a_route_added() {
    let config = GatewayConfig::new().route("/v1/p", toml! { require_key = false });
    let mut w = World::start(Backend::Memory, config).await;
    assert_eq!(send(w.post("/v1/p").body("x")).await.status, 201);
    assert_eq!(send(w.post("/v1/q").body("x")).await.status, 201);
    let strict = config_with_route(&w.config, "/v1/p", toml! { require_key = true });
    let strict = config_with_route(&strict, "/v1/q", toml! { require_key = true });
    w.reload(strict).await;
    let refused = send(w.post("/v1/p").body("x")).await;
    assert_eq!(refused.status, 400, "require_key turned on");
    assert_eq!(
        send(w.post("/v1/q").body("x")).await.status,
        400,
        "the added route"
    );
    let lax = config_with_route(&w.config, "/v1/p", toml! { require_key = false });
    w.reload(lax).await;
    assert_eq!(
        send(w.post("/v1/p").body("x")).await.status,
        201,
        "turned off again"
    );
    assert_eq!(send(w.post("/v1/q").body("x")).await.status, 400);
    assert_eq!(w.metric(FAILURE).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_alive_connection_survives_a_reload() {
    let mut w = World::start(Backend::Memory, GatewayConfig::new()).await;
    let mut conn = RawClient::connect(w.gateway.addr()).await;
    let request =
        b"POST /v1/p HTTP/1.1\r\nhost: gw\r\nidempotency-key: k\r\ncontent-length: 1\r\n\r\nx";
    assert_eq!(
        conn.send(request).await.response().await.unwrap().status(),
        201
    );
    let switched = w.config.clone().upstream(&w.b.url());
    w.reload(switched).await;
    let again = conn.send(request).await.response().await;
    let again = again.expect("the connection was closed by the reload");
    assert_eq!(again.status(), 201);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let other = b"POST /v1/p HTTP/1.1\r\nhost: gw\r\ncontent-length: 1\r\n\r\nx";
    assert_eq!(
        conn.send(other).await.response().await.unwrap().status(),
        201
    );
    assert_eq!(
        (w.a.calls(), w.b.calls()),
        (1, 1),
        "the same connection, the new upstream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_survives_reloads() {
    let mut w = World::start(Backend::Memory, GatewayConfig::new()).await;
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let url = w.gateway.url("/v1/p");
    let post = |key: &str| h2.post(&url).header("idempotency-key", key).body("x");
    assert_eq!(send(post("k1")).await.status, 201);
    for ttl in ["2h", "3h"] {
        w.reload(w.config.clone().set("defaults.ttl", ttl)).await;
        assert_eq!(send(post(ttl)).await.status, 201);
    }
    assert!(send(post("k1")).await.replayed());
    // One client connection carried every request, across both reloads.
    assert_eq!(w.metric("idemgate_client_connections").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_reload_leaves_the_running_configuration_serving() {
    let config = GatewayConfig::new().route("/v1/p", toml! { require_key = true });
    let w = World::start(Backend::Memory, config).await;
    let valid = w.gateway.toml_for(&w.config);
    let other_store = tempfile::tempdir().unwrap();
    let refusals: [(&str, String); 5] = [
        ("syntax", format!("{valid}\n[[routes\n")),
        ("unknown field", format!("surprise = 1\n{valid}")),
        (
            "store",
            w.gateway
                .toml_for(&w.config.clone().embedded(other_store.path())),
        ),
        (
            "listen",
            w.config.clone().set("listen", "127.0.0.1:1").to_toml(),
        ),
        (
            "workers",
            w.gateway.toml_for(&w.config.clone().set("workers", 3)),
        ),
    ];
    for (n, (what, text)) in refusals.iter().enumerate() {
        w.refused(text).await;
        assert_eq!(w.metric(FAILURE).await, (n + 1) as f64, "{what}");
        let refused = send(w.post("/v1/p").body("x")).await;
        assert_eq!(
            refused.status, 400,
            "after the {what} reload: require_key still on"
        );
        assert_eq!(
            send(w.post_keyed("/v1/p", &format!("k{n}")).body("x"))
                .await
                .status,
            201
        );
    }
    assert_eq!(w.metric(SUCCESS).await, 0.0);
    let log = w.log();
    for field in ["surprise", "store:", "listen:", "workers:"] {
        assert!(
            log.contains(field) && log.contains("reload refused"),
            "the log does not name {field}:\n{log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_is_replaced() {
    let old_token = "old-token-0123456789";
    let config = GatewayConfig::new().set("admin.admin_token", old_token);
    let mut w = World::start(Backend::Memory, config).await;
    let inspect = |token: &str| {
        w.client
            .get(format!("http://{}/keys/k", w.gateway.admin()))
            .bearer_auth(token)
    };
    assert_eq!(send(inspect(old_token)).await.status, 404, "no record yet");
    let new_token = "new-token-9876543210";
    w.reload(w.config.clone().set("admin.admin_token", new_token))
        .await;
    let inspect = |token: &str| {
        w.client
            .get(format!("http://{}/keys/k", w.gateway.admin()))
            .bearer_auth(token)
    };
    assert_eq!(send(inspect(old_token)).await.status, 401, "the old token");
    assert_eq!(send(inspect(new_token)).await.status, 404, "the new token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_connections_take_the_new_client_timeouts() {
    let config = GatewayConfig::new().set("client_header_timeout", "30s");
    let mut w = World::start(Backend::Memory, config).await;
    let mut before = RawClient::connect(w.gateway.addr()).await;
    w.reload(w.config.clone().set("client_header_timeout", "500ms"))
        .await;
    let mut after = RawClient::connect(w.gateway.addr()).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // A connection that sent no request head within the new 500 ms is closed; one opened
    // before the reload keeps its 30 s and still serves.
    assert!(
        after.response().await.is_none(),
        "the new timeout did not apply"
    );
    let request = b"POST /v1/p HTTP/1.1\r\nhost: gw\r\ncontent-length: 1\r\n\r\nx";
    let answer = before.send(request).await.response().await;
    assert_eq!(answer.expect("closed").status(), 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_connection_cap_admits_the_connection_waiting() {
    let config = GatewayConfig::new().set("max_client_connections", 1);
    let mut w = World::start(Backend::Memory, config).await;
    let request = b"POST /v1/p HTTP/1.1\r\nhost: gw\r\ncontent-length: 1\r\n\r\nx";
    let mut first = RawClient::connect(w.gateway.addr()).await;
    let answer = first.send(request).await.response().await;
    assert_eq!(answer.unwrap().status(), 201);
    let mut second = RawClient::connect(w.gateway.addr()).await;
    second.send(request).await;
    let waiting = tokio::time::timeout(Duration::from_millis(700), second.response()).await;
    assert!(
        waiting.is_err(),
        "a second connection was served past the cap of 1"
    );
    w.reload(w.config.clone().set("max_client_connections", 2))
        .await;
    let answer = second
        .response()
        .await
        .expect("the second connection closed");
    assert_eq!(answer.status(), 201);
}

/// The certificate a TLS listener at `addr` presents to a client trusting `ca`.
async fn presented(addr: std::net::SocketAddr, ca: &TestCa) -> Vec<u8> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.root()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = connector.connect(name, tcp).await.unwrap();
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_certificate_is_rotated_and_a_mismatched_pair_refused() {
    let ca = TestCa::new();
    let names = ["127.0.0.1", "localhost"];
    let first = ca.server("first", &names, Validity::Now);
    let second = ca.server("second", &names, Validity::Now);
    let config = GatewayConfig::new()
        .set("tls.cert_file", first.cert())
        .set("tls.key_file", first.key_path());
    let mut w = World::start(Backend::Memory, config).await;
    let addr = w.gateway.addr();
    assert_eq!(presented(addr, &ca).await, first.chain[0].to_vec());
    let client = ca.client_trusting();
    let url = format!("https://localhost:{}/v1/p", addr.port());
    let post = || client.post(&url).header("idempotency-key", "k").body("x");
    assert_eq!(send(post()).await.status, 201);
    let rotated = w
        .config
        .clone()
        .set("tls.cert_file", second.cert())
        .set("tls.key_file", second.key_path());
    w.reload(rotated).await;
    assert_eq!(presented(addr, &ca).await, second.chain[0].to_vec());
    assert!(send(post()).await.replayed(), "served after the rotation");
    // The first certificate with the second's key: refused, the second pair kept.
    let mismatched = w
        .config
        .clone()
        .set("tls.cert_file", first.cert())
        .set("tls.key_file", second.key_path());
    w.refused(&w.gateway.toml_for(&mismatched)).await;
    assert_eq!(presented(addr, &ca).await, second.chain[0].to_vec());
    assert!(send(post()).await.replayed());
    assert!(w.log().contains("tls.key_file"), "{}", w.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_files_rewritten_on_disk_are_picked_up_and_a_mismatched_pair_ignored() {
    let ca = TestCa::new();
    let names = ["127.0.0.1", "localhost"];
    let first = ca.server("first", &names, Validity::Now);
    let second = ca.server("second", &names, Validity::Now);
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::copy(&first.cert_file, &cert).unwrap();
    std::fs::copy(&first.key_file, &key).unwrap();
    let config = GatewayConfig::new()
        .set("tls.cert_file", cert.to_str().unwrap())
        .set("tls.key_file", key.to_str().unwrap())
        .set("tls.reload_interval", "100ms");
    let w = World::start(Backend::Memory, config).await;
    let addr = w.gateway.addr();
    assert_eq!(presented(addr, &ca).await, first.chain[0].to_vec());
    // Let the watcher see the files once before they change.
    tokio::time::sleep(Duration::from_millis(300)).await;
    std::fs::copy(&second.cert_file, &cert).unwrap();
    std::fs::copy(&second.key_file, &key).unwrap();
    wait_until(
        Duration::from_secs(5),
        "the rewritten pair presented",
        async || presented(addr, &ca).await == second.chain[0].to_vec(),
    )
    .await;
    // Half a rotation: the first certificate beside the second key. Ignored, counted.
    std::fs::copy(&first.cert_file, &cert).unwrap();
    w.counted(FAILURE, 1.0).await;
    assert_eq!(presented(addr, &ca).await, second.chain[0].to_vec());
    // The rotation completed: in force.
    std::fs::copy(&first.key_file, &key).unwrap();
    wait_until(
        Duration::from_secs(5),
        "the completed pair presented",
        async || presented(addr, &ca).await == first.chain[0].to_vec(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_reloads_in_two_seconds_under_load_fail_no_request() {
    let config = GatewayConfig::new().route("/v1/p", toml! { ttl = "60s" });
    let w = World::start(Backend::Memory, config.clone()).await;
    let started = w.metric(SUCCESS).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let load: Vec<_> = (0..4)
        .map(|i| {
            let (client, url) = (w.client.clone(), w.gateway.url("/v1/p"));
            let (stop, sent) = (stop.clone(), sent.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let req = client.post(&url).body("x");
                    let req = match n % 2 {
                        0 => req.header("idempotency-key", format!("k{i}-{n}")),
                        _ => req,
                    };
                    let seen = send(req).await;
                    assert_eq!(seen.status, 201, "request {n} of client {i} failed");
                    sent.fetch_add(1, Ordering::SeqCst);
                    n += 1;
                }
            })
        })
        .collect();
    for i in 0..20 {
        let ttl = format!("{}s", 60 + i);
        let next = config_with_route(&w.config, "/v1/p", toml! { ttl = ttl });
        w.gateway.reload(&next);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    w.counted(SUCCESS, started + 20.0).await;
    stop.store(true, Ordering::SeqCst);
    for task in load {
        task.await.unwrap();
    }
    assert!(
        sent.load(Ordering::SeqCst) > 20,
        "too little load to say anything"
    );
    assert_eq!(w.metric(FAILURE).await, 0.0);
}

/// `idemgate_tls_certificate_expiry_timestamp_seconds` of the upstream named `name`.
fn upstream_expiry(name: &str) -> String {
    format!("idemgate_tls_certificate_expiry_timestamp_seconds{{name=\"upstream:{name}\"}}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_tls_files_rewritten_on_disk_are_picked_up_and_a_mismatched_pair_ignored() {
    let ca = TestCa::new();
    let server = ca.server("upstream", &["127.0.0.1"], Validity::Now);
    let mtls = CountingUpstream::start_tls(ca.server_config(&server, true)).await;
    // Valid until 4000-01-01 and 4010-01-01: told apart by their expiry.
    let (first, second) = (
        ca.client_until("first", 4000),
        ca.client_until("second", 4010),
    );
    let (first_until, second_until) = (64_060_588_800.0, 64_376_208_000.0);
    let listener = ca.server("listener", &["127.0.0.1", "localhost"], Validity::Now);
    let dir = tempfile::tempdir().unwrap();
    let at = |file: &str| dir.path().join(file).to_str().unwrap().to_string();
    let (cert, key, trusted) = (at("client.crt"), at("client.key"), at("ca.pem"));
    std::fs::copy(&first.cert_file, &cert).unwrap();
    std::fs::copy(&first.key_file, &key).unwrap();
    std::fs::copy(&ca.ca_file, &trusted).unwrap();
    let config = GatewayConfig::new()
        .set("tls.cert_file", listener.cert())
        .set("tls.key_file", listener.key_path())
        .set("tls.reload_interval", "100ms")
        .set("upstreams.mtls.url", mtls.https_url().as_str())
        .set("upstreams.mtls.ca_file", trusted.as_str())
        .set("upstreams.mtls.client_cert_file", cert.as_str())
        .set("upstreams.mtls.client_key_file", key.as_str())
        .route("/v1/m", toml! { upstream = "mtls" });
    let w = World::start(Backend::Memory, config).await;
    let client = ca.client_trusting();
    let url = format!("https://localhost:{}/v1/m", w.gateway.addr().port());
    // The client certificate the upstream saw on the request just sent through the gateway.
    let seen = async || {
        assert_eq!(send(client.get(&url)).await.status, 201);
        mtls.last_client_cert().expect("no client certificate")
    };
    assert_eq!(seen().await, first.chain[0].to_vec());
    assert_eq!(w.metric(&upstream_expiry("mtls")).await, first_until);
    // Let the watcher see the files once before they change.
    tokio::time::sleep(Duration::from_millis(300)).await;
    std::fs::copy(&second.cert_file, &cert).unwrap();
    std::fs::copy(&second.key_file, &key).unwrap();
    wait_until(
        Duration::from_secs(5),
        "the rewritten client certificate presented",
        async || seen().await == second.chain[0].to_vec(),
    )
    .await;
    assert_eq!(w.metric(&upstream_expiry("mtls")).await, second_until);
    // Half a rotation: the first certificate beside the second key. Ignored, counted.
    let failures = w.metric(FAILURE).await;
    std::fs::copy(&first.cert_file, &cert).unwrap();
    w.counted(FAILURE, failures + 1.0).await;
    assert_eq!(seen().await, second.chain[0].to_vec());
    assert_eq!(w.metric(&upstream_expiry("mtls")).await, second_until);
    assert!(
        w.log().contains("upstreams.mtls.client_key_file"),
        "{}",
        w.log()
    );
    // The rotation completed: in force.
    std::fs::copy(&first.key_file, &key).unwrap();
    wait_until(
        Duration::from_secs(5),
        "the completed pair presented",
        async || seen().await == first.chain[0].to_vec(),
    )
    .await;
    assert_eq!(w.metric(&upstream_expiry("mtls")).await, first_until);
    // A CA file that no longer reads: ignored, named, counted; the upstream still reached.
    let failures = w.metric(FAILURE).await;
    std::fs::write(&trusted, "not a certificate").unwrap();
    w.counted(FAILURE, failures + 1.0).await;
    assert!(w.log().contains("upstreams.mtls.ca_file"), "{}", w.log());
    assert_eq!(seen().await, first.chain[0].to_vec());
    assert_eq!(w.metric(SUCCESS).await, 0.0, "no SIGHUP was sent");
}
