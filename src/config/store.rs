//! The `[store]` table: which backend keeps the records, and that backend's settings. A field of
//! one backend set under another is an error, so a setting never silently does nothing.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use super::human::{HumanDuration, HumanSize};
use super::{redact_url, ConfigError};
use crate::store::redis::RedisOptions;
use crate::store::{cached, memory, redis as redis_store, StoreError};

/// How the Redis store keeps response bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// LZ4 for bodies of 1 KiB and more without a `Content-Encoding`, kept only when it saves
    /// at least an eighth.
    #[default]
    Lz4,
    /// Bodies as they came.
    None,
}

/// The `[store]` table as written: every backend's fields, checked against the backend chosen.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    backend: Option<String>,
    // memory
    max_entries: Option<usize>,
    max_bytes: Option<HumanSize>,
    // redis, redis-cluster, redis-sentinel
    url: Option<String>,
    urls: Option<Vec<String>>,
    master_name: Option<String>,
    wait_replicas: Option<u32>,
    prefix: Option<String>,
    timeout: Option<HumanDuration>,
    local_cache: Option<HumanSize>,
    local_cache_ttl: Option<HumanDuration>,
    tls_ca_file: Option<String>,
    compression: Option<Compression>,
}

/// Which store keeps the records, with its settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// The embedded in-process store: zero setup, one gateway process, lost on restart.
    Memory(MemorySettings),
    /// Redis (one server, a Redis Cluster, or a primary found through Sentinel): shared by every
    /// gateway replica and durable as far as Redis is.
    Redis(RedisSettings),
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig::Memory(MemorySettings::default())
    }
}

/// `backend = "memory"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemorySettings {
    /// Most records kept; past it completed records are evicted (never in-flight ones).
    pub max_entries: usize,
    /// Most bytes of stored responses kept, evicting likewise.
    pub max_bytes: u64,
}

impl Default for MemorySettings {
    fn default() -> Self {
        MemorySettings {
            max_entries: memory::DEFAULT_MAX_ENTRIES,
            max_bytes: memory::DEFAULT_MAX_BYTES,
        }
    }
}

/// Which Redis deployment holds the records, and how to find it. URLs may carry a password, so
/// they are never logged whole.
#[derive(Clone, PartialEq, Eq)]
pub enum Topology {
    /// `backend = "redis"`: one server at `url` (`redis://`, `rediss://` or `unix://`).
    Single {
        /// The server.
        url: String,
    },
    /// `backend = "redis-cluster"`: seed nodes of a Redis Cluster; the rest are discovered.
    Cluster {
        /// Seed nodes.
        urls: Vec<String>,
    },
    /// `backend = "redis-sentinel"`: the primary that these sentinels name `master_name`. The
    /// data nodes are reached with the sentinels' user, password and TLS setting.
    Sentinel {
        /// The sentinels.
        urls: Vec<String>,
        /// The name the sentinels monitor the primary under.
        master_name: String,
    },
}

impl Topology {
    /// The `backend` value that selects this topology.
    pub fn backend(&self) -> &'static str {
        match self {
            Topology::Single { .. } => "redis",
            Topology::Cluster { .. } => "redis-cluster",
            Topology::Sentinel { .. } => "redis-sentinel",
        }
    }

    /// Every URL, for TLS checks and logs.
    pub fn urls(&self) -> Vec<&str> {
        match self {
            Topology::Single { url } => vec![url.as_str()],
            Topology::Cluster { urls } | Topology::Sentinel { urls, .. } => {
                urls.iter().map(String::as_str).collect()
            }
        }
    }
}

impl fmt::Debug for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Passwords in URLs are never printed.
        let redacted = |urls: &[String]| urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>();
        match self {
            Topology::Single { url } => f
                .debug_struct("Single")
                .field("url", &redact_url(url))
                .finish(),
            Topology::Cluster { urls } => f
                .debug_struct("Cluster")
                .field("urls", &redacted(urls))
                .finish(),
            Topology::Sentinel { urls, master_name } => f
                .debug_struct("Sentinel")
                .field("urls", &redacted(urls))
                .field("master_name", master_name)
                .finish(),
        }
    }
}

/// `backend = "redis"`, `"redis-cluster"` or `"redis-sentinel"`.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisSettings {
    /// Where the records are.
    pub topology: Topology,
    /// Replicas that must acknowledge each claim and completion (`WAIT`); 0: none.
    pub wait_replicas: u32,
    /// Prefix of every key the gateway writes, so one Redis can serve several deployments.
    pub prefix: String,
    /// How long to wait to connect or for one answer before the store counts as down.
    pub timeout: Duration,
    /// Bytes of completed responses each gateway process keeps to replay without a round trip
    /// (0 turns the local cache off).
    pub local_cache: u64,
    /// The longest a response stays in the local cache.
    pub local_cache_ttl: Duration,
    /// For `rediss://`: a PEM file of the CA(s) to trust instead of the system's.
    pub tls_ca_file: Option<String>,
    /// How stored bodies are compressed.
    pub compression: Compression,
}

impl RedisSettings {
    /// The settings for the one Redis at `url`, every other field at its default.
    pub fn new(url: impl Into<String>) -> Self {
        Self::with_topology(Topology::Single { url: url.into() })
    }

    /// The settings for Redis found by `topology`, every other field at its default.
    pub fn with_topology(topology: Topology) -> Self {
        RedisSettings {
            topology,
            wait_replicas: 0,
            prefix: redis_store::DEFAULT_PREFIX.to_string(),
            timeout: redis_store::DEFAULT_TIMEOUT,
            local_cache: cached::DEFAULT_BYTES,
            local_cache_ttl: cached::DEFAULT_MAX_AGE,
            tls_ca_file: None,
            compression: Compression::default(),
        }
    }

    /// How to reach this Redis (with the PEM of `tls_ca_file`, read now).
    pub fn options(&self) -> Result<RedisOptions, StoreError> {
        let mut options = RedisOptions::with_topology(self.topology.clone())
            .wait_replicas(self.wait_replicas)
            .prefix(&self.prefix)
            .timeout(self.timeout)
            .compression(self.compression);
        if let Some(path) = &self.tls_ca_file {
            let pem = std::fs::read(path).map_err(|e| {
                StoreError::Redis(redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "cannot read store.tls_ca_file",
                    format!("{path}: {e}"),
                )))
            })?;
            options = options.tls_ca(pem);
        }
        Ok(options)
    }
}

impl fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL's password is never printed.
        f.debug_struct("RedisSettings")
            .field("topology", &self.topology)
            .field("wait_replicas", &self.wait_replicas)
            .field("prefix", &self.prefix)
            .field("timeout", &HumanDuration(self.timeout))
            .field("local_cache", &HumanSize(self.local_cache))
            .field("local_cache_ttl", &HumanDuration(self.local_cache_ttl))
            .field("tls_ca_file", &self.tls_ca_file)
            .field("compression", &self.compression)
            .finish()
    }
}

impl StoreConfig {
    /// The backend for logs: its name, and for Redis the URL with any password as `***`.
    pub fn describe(&self) -> String {
        match self {
            StoreConfig::Memory(_) => "memory".into(),
            StoreConfig::Redis(r) => format!(
                "{} {}",
                r.topology.backend(),
                r.topology
                    .urls()
                    .iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }

    /// The backend's name, as `backend` is written.
    pub fn backend(&self) -> &'static str {
        match self {
            StoreConfig::Memory(_) => "memory",
            StoreConfig::Redis(r) => r.topology.backend(),
        }
    }

    /// Validate the table as written.
    pub(super) fn from_raw(raw: RawStore) -> Result<Self, ConfigError> {
        let backend = raw.backend.as_deref().unwrap_or("memory");
        const BACKENDS: [&str; 4] = ["memory", "redis", "redis-cluster", "redis-sentinel"];
        if !BACKENDS.contains(&backend) {
            return Err(ConfigError::invalid(
                "store.backend",
                format!(
                    "{backend:?} is not a backend; use \"memory\", \"redis\", \"redis-cluster\" or \"redis-sentinel\""
                ),
            ));
        }
        // Each field with the backends it belongs to.
        const REDIS_ALL: &[&str] = &["redis", "redis-cluster", "redis-sentinel"];
        let set: [(&str, bool, &[&str]); 12] = [
            ("max_entries", raw.max_entries.is_some(), &["memory"]),
            ("max_bytes", raw.max_bytes.is_some(), &["memory"]),
            ("url", raw.url.is_some(), &["redis"]),
            (
                "urls",
                raw.urls.is_some(),
                &["redis-cluster", "redis-sentinel"],
            ),
            (
                "master_name",
                raw.master_name.is_some(),
                &["redis-sentinel"],
            ),
            ("wait_replicas", raw.wait_replicas.is_some(), REDIS_ALL),
            ("prefix", raw.prefix.is_some(), REDIS_ALL),
            ("timeout", raw.timeout.is_some(), REDIS_ALL),
            ("local_cache", raw.local_cache.is_some(), REDIS_ALL),
            ("local_cache_ttl", raw.local_cache_ttl.is_some(), REDIS_ALL),
            ("tls_ca_file", raw.tls_ca_file.is_some(), REDIS_ALL),
            ("compression", raw.compression.is_some(), REDIS_ALL),
        ];
        if let Some((field, _, owners)) = set
            .iter()
            .find(|(_, set, owners)| *set && !owners.contains(&backend))
        {
            let owners = owners
                .iter()
                .map(|o| format!("\"{o}\""))
                .collect::<Vec<_>>()
                .join(" or ");
            return Err(ConfigError::invalid(
                format!("store.{field}"),
                format!("belongs to backend = {owners}, not \"{backend}\""),
            ));
        }
        if backend == "memory" {
            let defaults = MemorySettings::default();
            let max_entries = match raw.max_entries {
                Some(0) => {
                    return Err(ConfigError::invalid(
                        "store.max_entries",
                        "must be at least 1",
                    ))
                }
                Some(n) => n,
                None => defaults.max_entries,
            };
            let max_bytes = match raw.max_bytes {
                Some(HumanSize(0)) => {
                    return Err(ConfigError::invalid(
                        "store.max_bytes",
                        "must be greater than zero",
                    ))
                }
                Some(HumanSize(n)) => n,
                None => defaults.max_bytes,
            };
            return Ok(StoreConfig::Memory(MemorySettings {
                max_entries,
                max_bytes,
            }));
        }
        let topology = match backend {
            "redis" => {
                let url = raw.url.ok_or_else(|| {
                    ConfigError::invalid("store.url", "is required when store.backend = \"redis\"")
                })?;
                check_url("store.url", &url)?;
                Topology::Single { url }
            }
            _ => {
                let urls = raw.urls.unwrap_or_default();
                if urls.is_empty() {
                    return Err(ConfigError::invalid(
                        "store.urls",
                        format!("needs at least one URL when store.backend = \"{backend}\""),
                    ));
                }
                for url in &urls {
                    if url.starts_with("unix://") {
                        return Err(ConfigError::invalid(
                            "store.urls",
                            "must be redis:// or rediss:// URLs (nodes are reached over TCP)",
                        ));
                    }
                    check_url("store.urls", url)?;
                }
                if urls.iter().any(|u| u.starts_with("rediss://"))
                    && !urls.iter().all(|u| u.starts_with("rediss://"))
                {
                    return Err(ConfigError::invalid(
                        "store.urls",
                        "mixes redis:// and rediss://: use one scheme for every node",
                    ));
                }
                if backend == "redis-cluster" {
                    Topology::Cluster { urls }
                } else {
                    let master_name = raw.master_name.unwrap_or_default();
                    if master_name.is_empty() {
                        return Err(ConfigError::invalid(
                            "store.master_name",
                            "is required when store.backend = \"redis-sentinel\"",
                        ));
                    }
                    Topology::Sentinel { urls, master_name }
                }
            }
        };
        let mut settings = RedisSettings::with_topology(topology);
        settings.wait_replicas = raw.wait_replicas.unwrap_or(0);
        if let Some(prefix) = raw.prefix {
            // The prefix scopes every key this gateway writes, and the admin API's evict-all
            // deletes everything under it: an empty one would mean the whole database.
            if prefix.is_empty() || prefix.contains(['*', '?', '[', ']', '\\']) {
                return Err(ConfigError::invalid(
                    "store.prefix",
                    "must be non-empty and free of the glob characters * ? [ ] \\",
                ));
            }
            // In a cluster, braces would make a hash tag of the prefix: every record on one slot.
            if backend == "redis-cluster" && prefix.contains(['{', '}']) {
                return Err(ConfigError::invalid(
                    "store.prefix",
                    "must be free of { and } on a Redis Cluster (they would put every record on one slot)",
                ));
            }
            settings.prefix = prefix;
        }
        match raw.timeout {
            Some(HumanDuration(d)) if d.is_zero() => {
                return Err(ConfigError::invalid(
                    "store.timeout",
                    "must be greater than zero",
                ))
            }
            Some(HumanDuration(d)) => settings.timeout = d,
            None => {}
        }
        if let Some(HumanSize(n)) = raw.local_cache {
            settings.local_cache = n;
        }
        if let Some(HumanDuration(d)) = raw.local_cache_ttl {
            settings.local_cache_ttl = d;
        }
        if let Some(path) = raw.tls_ca_file {
            if !settings
                .topology
                .urls()
                .iter()
                .all(|u| u.starts_with("rediss://"))
            {
                return Err(ConfigError::invalid(
                    "store.tls_ca_file",
                    "needs rediss:// URLs",
                ));
            }
            if let Err(e) = std::fs::metadata(&path) {
                return Err(ConfigError::invalid(
                    "store.tls_ca_file",
                    format!("{path}: {e}"),
                ));
            }
            settings.tls_ca_file = Some(path);
        }
        if let Some(c) = raw.compression {
            settings.compression = c;
        }
        Ok(StoreConfig::Redis(settings))
    }
}

/// A Redis URL's scheme, checked for `field`.
fn check_url(field: &str, url: &str) -> Result<(), ConfigError> {
    if url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("unix://") {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            field,
            "must start with redis://, rediss:// or unix://",
        ))
    }
}
