//! The gateway's config, built in code and rendered to the TOML the gateway parses:
//!
//! ```ignore
//! let config = GatewayConfig::new()
//!     .upstream(&upstream.url())
//!     .redis(&server)
//!     .set("store.timeout", "300ms")
//!     .set("defaults.lock_ttl", "2s")
//!     .route("/v1/payments", toml! { require_key = true })
//!     .admin();
//! ```
//!
//! Paths in [`GatewayConfig::set`] are the config file's, dotted: `"workers"`,
//! `"store.timeout"`, `"defaults.ttl"`, `"upstreams.default.ca_file"`. The typed methods say the
//! common things in one word (a store, an upstream, an admin listener, the secrets the binary
//! reads from its environment).

use crate::gateway::Ports;
use crate::{PostgresServer, RedisCluster, RedisSentinelSet, RedisServer, Replicated, StoreServer};

/// A gateway config as a TOML table, with what the binary reads from its environment.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    table: toml::Table,
    /// What `IDEMGATE_KEY_SECRET` holds for this gateway (derived keys), if anything.
    pub key_secret: Option<String>,
    /// What `IDEMGATE_SEAL_KEYS` holds for this gateway (sealed records), if anything.
    pub seal_keys: Option<String>,
    /// Further variables of a gateway process's environment.
    pub env: Vec<(String, String)>,
}

impl Default for GatewayConfig {
    /// Listen on a free loopback port, keep records in memory; no upstream yet.
    fn default() -> Self {
        GatewayConfig {
            table: toml::Table::new(),
            key_secret: None,
            seal_keys: None,
            env: Vec::new(),
        }
        .set("listen", "127.0.0.1:0")
        .set("store.backend", "memory")
    }
}

impl GatewayConfig {
    /// Listen on a free loopback port, keep records in memory; no upstream yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Run a gateway process with `name=value` in its environment.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.to_string(), value.to_string()));
        self
    }

    /// Forward to `url` (`http://127.0.0.1:PORT`).
    pub fn upstream(self, url: &str) -> Self {
        self.set("upstream", url)
    }

    /// An admin listener (metrics, readiness, the key API) on a free loopback port: the
    /// gateway's own in a process of the test, the one [`Ports::admin`] names in a child
    /// process.
    pub fn admin(self) -> Self {
        self.set("admin.listen", "127.0.0.1:0")
    }

    /// Keep records in `server`, under the prefix `test:`.
    pub fn redis(self, server: &RedisServer) -> Self {
        self.redis_url(&server.url()).prefix("test:")
    }

    /// Keep records in the Redis at `url` (which need not be up), under the default prefix.
    pub fn redis_url(self, url: &str) -> Self {
        self.set("store.backend", "redis").set("store.url", url)
    }

    /// Keep records in `cluster` (`backend = "redis-cluster"`, every node a seed), under the
    /// prefix `test:`.
    pub fn redis_cluster(self, cluster: &RedisCluster) -> Self {
        self.redis_cluster_seeds(cluster.urls()).prefix("test:")
    }

    /// Keep records in the Redis Cluster whose nodes `seeds` name, under the default prefix.
    pub fn redis_cluster_seeds(self, seeds: Vec<String>) -> Self {
        self.set("store.backend", "redis-cluster")
            .set("store.urls", seeds)
    }

    /// Keep records in the primary that `set`'s sentinels name (`backend = "redis-sentinel"`,
    /// `master_name` as they monitor it), under the prefix `test:`.
    pub fn redis_sentinel(self, set: &RedisSentinelSet) -> Self {
        self.set("store.backend", "redis-sentinel")
            .set("store.urls", set.urls())
            .set("store.master_name", crate::MASTER_NAME)
            .prefix("test:")
    }

    /// Keep records in the replicated `store` ([`GatewayConfig::redis_cluster`] or
    /// [`GatewayConfig::redis_sentinel`]).
    pub fn replicated(self, store: Replicated<'_>) -> Self {
        match store {
            Replicated::Cluster(cluster) => self.redis_cluster(cluster),
            Replicated::Sentinel(set) => self.redis_sentinel(set),
        }
    }

    /// Keep Redis keys under `prefix` (on a Redis backend: the others have no prefix).
    pub fn prefix(self, prefix: &str) -> Self {
        self.set("store.prefix", prefix)
    }

    /// Keep records in `server`'s database (`backend = "postgres"`, the default table).
    pub fn postgres(self, server: &PostgresServer) -> Self {
        self.postgres_url(&server.url())
    }

    /// Keep records in the PostgreSQL database at `url`.
    pub fn postgres_url(self, url: &str) -> Self {
        self.set("store.backend", "postgres").set("store.url", url)
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

    /// The field at the dotted `path`, if it is set.
    pub fn get(&self, path: &str) -> Option<&toml::Value> {
        let mut names = path.split('.');
        let first = self.table.get(names.next()?)?;
        names.try_fold(first, |value, name| value.get(name))
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

    /// The config file of a gateway process on `ports`: it listens on `ports.listen`, and an
    /// admin listener on a free port ([`GatewayConfig::admin`]) on `ports.admin`.
    pub fn to_toml_on(&self, ports: Ports) -> String {
        let free_admin = self
            .get("admin.listen")
            .and_then(toml::Value::as_str)
            .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
            .is_some_and(|a| a.port() == 0);
        let config = self.clone().set("listen", ports.listen.to_string());
        match free_admin {
            true => config.set("admin.listen", ports.admin.to_string()),
            false => config,
        }
        .to_toml()
    }

    /// What a gateway process has in its environment besides what it inherits: the secrets
    /// ([`GatewayConfig::key_secret`], [`GatewayConfig::seal`]) and [`GatewayConfig::env`].
    pub fn environment(&self) -> Vec<(String, String)> {
        let secrets = [
            ("IDEMGATE_KEY_SECRET", &self.key_secret),
            ("IDEMGATE_SEAL_KEYS", &self.seal_keys),
        ];
        secrets
            .into_iter()
            .filter_map(|(name, value)| Some((name.to_string(), value.clone()?)))
            .chain(self.env.iter().cloned())
            .collect()
    }
}
