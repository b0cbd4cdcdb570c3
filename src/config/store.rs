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
    // redis
    url: Option<String>,
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
    /// Redis: shared by every gateway replica and durable as far as Redis is.
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

/// `backend = "redis"`.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisSettings {
    /// `redis://`, `rediss://` or `unix://` URL; may carry a password, so never log it whole.
    pub url: String,
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
    /// The settings for Redis at `url`, every other field at its default.
    pub fn new(url: impl Into<String>) -> Self {
        RedisSettings {
            url: url.into(),
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
        let mut options = RedisOptions::new(&self.url)
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
            .field("url", &redact_url(&self.url))
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
            StoreConfig::Redis(r) => format!("redis {}", redact_url(&r.url)),
        }
    }

    /// The backend's name, as `backend` is written.
    pub fn backend(&self) -> &'static str {
        match self {
            StoreConfig::Memory(_) => "memory",
            StoreConfig::Redis(_) => "redis",
        }
    }

    /// Validate the table as written.
    pub(super) fn from_raw(raw: RawStore) -> Result<Self, ConfigError> {
        let backend = raw.backend.as_deref().unwrap_or("memory");
        // Each field with the backend it belongs to.
        let set = [
            ("max_entries", raw.max_entries.is_some(), "memory"),
            ("max_bytes", raw.max_bytes.is_some(), "memory"),
            ("url", raw.url.is_some(), "redis"),
            ("prefix", raw.prefix.is_some(), "redis"),
            ("timeout", raw.timeout.is_some(), "redis"),
            ("local_cache", raw.local_cache.is_some(), "redis"),
            ("local_cache_ttl", raw.local_cache_ttl.is_some(), "redis"),
            ("tls_ca_file", raw.tls_ca_file.is_some(), "redis"),
            ("compression", raw.compression.is_some(), "redis"),
        ];
        if !["memory", "redis"].contains(&backend) {
            return Err(ConfigError::invalid(
                "store.backend",
                format!("{backend:?} is not a backend; use \"memory\" or \"redis\""),
            ));
        }
        if let Some((field, _, owner)) =
            set.iter().find(|(_, set, owner)| *set && *owner != backend)
        {
            return Err(ConfigError::invalid(
                format!("store.{field}"),
                format!("belongs to backend = \"{owner}\", not \"{backend}\""),
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
        let url = raw.url.ok_or_else(|| {
            ConfigError::invalid("store.url", "is required when store.backend = \"redis\"")
        })?;
        if !(url.starts_with("redis://")
            || url.starts_with("rediss://")
            || url.starts_with("unix://"))
        {
            return Err(ConfigError::invalid(
                "store.url",
                "must start with redis://, rediss:// or unix://",
            ));
        }
        let mut settings = RedisSettings::new(url);
        if let Some(prefix) = raw.prefix {
            // The prefix scopes every key this gateway writes, and the admin API's evict-all
            // deletes everything under it: an empty one would mean the whole database.
            if prefix.is_empty() || prefix.contains(['*', '?', '[', ']', '\\']) {
                return Err(ConfigError::invalid(
                    "store.prefix",
                    "must be non-empty and free of the glob characters * ? [ ] \\",
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
            if !settings.url.starts_with("rediss://") {
                return Err(ConfigError::invalid(
                    "store.tls_ca_file",
                    "needs a rediss:// store.url",
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
