//! The gateway's config, built in code and rendered to the TOML the gateway parses:
//!
//! ```ignore
//! let config = TestConfig::new()
//!     .upstream(&upstream.url())
//!     .redis(&server)
//!     .set("store.timeout", "300ms")
//!     .set("defaults.lock_ttl", "2s")
//!     .route("/v1/payments", toml! { require_key = true });
//! ```
//!
//! A [`TestEnv`](super::TestEnv) fills in the upstream and the store itself: a test hands it
//! only the settings it cares about.

use super::{PostgresServer, RedisCluster, RedisSentinelSet, RedisServer, StoreServer};

/// A gateway config as a TOML table. Paths in [`TestConfig::set`] are the config file's,
/// dotted: `"workers"`, `"store.timeout"`, `"defaults.ttl"`, `"admin.listen"`.
#[derive(Clone, Debug)]
pub struct TestConfig {
    table: toml::Table,
    /// What `IDEMGATE_KEY_SECRET` holds for this gateway (derived keys), if anything.
    pub key_secret: Option<String>,
    /// What `IDEMGATE_SEAL_KEYS` holds for this gateway (sealed records), if anything.
    pub seal_keys: Option<String>,
    /// Further variables of a [`GatewayBinary`](super::GatewayBinary)'s environment.
    pub env: Vec<(String, String)>,
}

impl Default for TestConfig {
    /// Listen on a free loopback port, keep records in memory; no upstream yet.
    fn default() -> Self {
        TestConfig {
            table: toml::Table::new(),
            key_secret: None,
            seal_keys: None,
            env: Vec::new(),
        }
        .set("listen", "127.0.0.1:0")
        .set("store.backend", "memory")
    }
}

impl TestConfig {
    /// Listen on a free loopback port, keep records in memory; no upstream yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Run a [`GatewayBinary`](super::GatewayBinary) with `name=value` in its environment.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.to_string(), value.to_string()));
        self
    }

    /// Forward to `url` (`http://127.0.0.1:PORT`).
    pub fn upstream(self, url: &str) -> Self {
        self.set("upstream", url)
    }

    /// Keep records in `server`, under the prefix `test:`.
    pub fn redis(self, server: &RedisServer) -> Self {
        self.redis_url(&server.url()).set("store.prefix", "test:")
    }

    /// Keep records in the Redis at `url` (which need not be up), under the default prefix.
    pub fn redis_url(self, url: &str) -> Self {
        self.set("store.backend", "redis").set("store.url", url)
    }

    /// Keep records in `cluster` (`backend = "redis-cluster"`, every node a seed), under the
    /// prefix `test:`.
    pub fn redis_cluster(self, cluster: &RedisCluster) -> Self {
        self.set("store.backend", "redis-cluster")
            .set("store.urls", cluster.urls())
            .set("store.prefix", "test:")
    }

    /// Keep records in the primary that `set`'s sentinels name (`backend = "redis-sentinel"`,
    /// `master_name` as they monitor it), under the prefix `test:`.
    pub fn redis_sentinel(self, set: &RedisSentinelSet) -> Self {
        self.set("store.backend", "redis-sentinel")
            .set("store.urls", set.urls())
            .set("store.master_name", super::cluster::MASTER_NAME)
            .set("store.prefix", "test:")
    }

    /// Keep records in `server`'s database (`backend = "postgres"`, the default table).
    pub fn postgres(self, server: &PostgresServer) -> Self {
        self.set("store.backend", "postgres")
            .set("store.url", server.url())
    }

    /// Keep records in `server` when there is one, else in memory: for code that runs on
    /// any backend (see [`StoreServer::for_backend`]).
    pub fn store(self, server: Option<&StoreServer>) -> Self {
        match server {
            Some(StoreServer::Redis(server)) => self.redis(server),
            Some(StoreServer::Postgres(server)) => self.postgres(server),
            None => self.set("store.backend", "memory"),
        }
    }

    /// Keep records in the embedded store in `dir`.
    pub fn embedded(self, dir: &std::path::Path) -> Self {
        self.set("store.backend", "embedded")
            .set("store.path", dir.display().to_string())
    }

    /// Give the gateway `secret` as `IDEMGATE_KEY_SECRET` (derived keys are made with it).
    pub fn key_secret(mut self, secret: &str) -> Self {
        self.key_secret = Some(secret.to_string());
        self
    }

    /// Seal records as `mode` says (`"off"`, `"on"`, `"required"`) with `keys` as
    /// `IDEMGATE_SEAL_KEYS` (`"k2:<base64>,k1:<base64>"`).
    pub fn seal(mut self, mode: &str, keys: &str) -> Self {
        self.seal_keys = Some(keys.to_string());
        self.set("store.seal", mode)
    }

    /// Set the field at the dotted `path` (its tables are created as needed).
    pub fn set(mut self, path: &str, value: impl Into<toml::Value>) -> Self {
        let (tables, field) = match path.rsplit_once('.') {
            Some((tables, field)) => (Some(tables), field),
            None => (None, path),
        };
        let mut table = &mut self.table;
        for name in tables.into_iter().flat_map(|t| t.split('.')) {
            table = table
                .entry(name)
                .or_insert_with(|| toml::Table::new().into())
                .as_table_mut()
                .unwrap_or_else(|| panic!("{name} in {path} is not a table"));
        }
        table.insert(field.to_string(), value.into());
        self
    }

    /// Add a `[[routes]]` entry for `path` with `settings` (`toml! { require_key = true }`).
    pub fn route(mut self, path: &str, mut settings: toml::Table) -> Self {
        settings.insert("path".to_string(), path.into());
        self.table
            .entry("routes")
            .or_insert_with(|| toml::Value::Array(Vec::new()))
            .as_array_mut()
            .expect("routes is an array of tables")
            .push(settings.into());
        self
    }

    /// The config file's text.
    pub fn to_toml(&self) -> String {
        self.table.to_string()
    }

    /// The config as the gateway library parses it.
    pub fn parse(&self) -> idemgate::config::Config {
        let secrets = idemgate::config::Secrets {
            key_secret: self.key_secret.as_ref().map(|s| s.as_bytes()),
            seal_keys: self.seal_keys.as_deref(),
        };
        idemgate::config::Config::from_toml_with_secrets(&self.to_toml(), secrets)
            .unwrap_or_else(|e| panic!("invalid test config ({e}):\n{}", self.to_toml()))
    }
}
