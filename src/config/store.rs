//! The `[store]` table: `backend` chooses the table the other fields are read as, one struct per
//! backend, each value checked as it is read. A field of one backend set under another is an
//! error naming the backends it belongs to, so a setting never silently does nothing.

use serde::de::Deserializer;
use serde::Deserialize;

use super::checked::{self, fields_of, rules, Checked, NonZero};
use super::human::{HumanDuration, HumanSize};
pub use crate::store::{
    redact_url, Compression, EmbeddedSettings, MemorySettings, NodeAuth, PostgresSettings,
    RedisSettings, SealMode, StoreConfig, Topology,
};
use crate::store::{LocalCacheSettings, TlsFiles};

/// A field refused, named within `[store]`, and why.
type Refused = (String, String);

fn refused(field: &str, reason: impl Into<String>) -> Refused {
    (field.to_string(), reason.into())
}

impl<'de> Deserialize<'de> for StoreConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Read whole first: `backend`, wherever it is written, decides what the others are.
        let table = toml::Table::deserialize(d)?;
        read(table).map_err(|(field, reason)| checked::refused(&field, reason))
    }
}

/// One backend: its name, the fields of its table, and how the table becomes a store's settings.
struct Backend {
    name: &'static str,
    fields: fn() -> &'static [&'static str],
    read: fn(toml::Table) -> Result<StoreConfig, Refused>,
}

const BACKENDS: [Backend; 6] = [
    Backend::of::<MemoryTable>("memory"),
    Backend::of::<EmbeddedTable>("embedded"),
    Backend::of::<SingleTable>("redis"),
    Backend::of::<ClusterTable>("redis-cluster"),
    Backend::of::<SentinelTable>("redis-sentinel"),
    Backend::of::<PostgresTable>("postgres"),
];

impl Backend {
    const fn of<T: Table>(name: &'static str) -> Self {
        Backend {
            name,
            fields: fields_of::<T>,
            read: |table| checked::from_value::<T>(toml::Value::Table(table))?.settings(),
        }
    }
}

/// A backend's table, read.
trait Table: serde::de::DeserializeOwned {
    /// The store's settings, or the field at fault.
    fn settings(self) -> Result<StoreConfig, Refused>;
}

/// The table as written, read as its backend's.
fn read(mut table: toml::Table) -> Result<StoreConfig, Refused> {
    let name = match table.remove("backend") {
        None => "embedded".to_string(),
        Some(v) => String::deserialize(v).map_err(|e| refused("backend", e.message()))?,
    };
    let Some(backend) = BACKENDS.iter().find(|b| b.name == name) else {
        return Err(refused(
            "backend",
            format!("{name:?} is not a backend; use {}", backend_names()),
        ));
    };
    // Every backend but memory reads `seal`; its keys come from the environment later.
    let seal = match table.remove("seal") {
        None => SealMode::Off,
        Some(v) => SealMode::deserialize(v)
            .map_err(|_| refused("seal", "must be \"off\", \"on\" or \"required\""))?,
    };
    if seal != SealMode::Off && name == "memory" {
        return Err(refused("seal", "does not apply to backend = \"memory\": its records never leave this process, where the keys that would seal them live too; sealing is for the embedded, Redis and PostgreSQL stores"));
    }
    for field in table
        .keys()
        .filter(|f| !(backend.fields)().contains(&f.as_str()))
    {
        let owners: Vec<_> = BACKENDS
            .iter()
            .filter(|b| (b.fields)().contains(&field.as_str()))
            .map(|b| format!("\"{}\"", b.name))
            .collect();
        if !owners.is_empty() {
            return Err(refused(
                field,
                format!(
                    "belongs to backend = {}, not \"{name}\"",
                    owners.join(" or ")
                ),
            ));
        }
    }
    let mut config = (backend.read)(table)?;
    config.set_seal_mode(seal);
    Ok(config)
}

/// Every backend's name, quoted, as a list a person reads.
fn backend_names() -> String {
    let names: Vec<_> = BACKENDS.iter().map(|b| format!("\"{}\"", b.name)).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => names.concat(),
    }
}

/// `backend = "memory"`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MemoryTable {
    max_entries: Option<Checked<checked::AtLeastOne>>,
    max_bytes: Option<Checked<checked::NonZeroSize>>,
}

impl Table for MemoryTable {
    fn settings(self) -> Result<StoreConfig, Refused> {
        let mut settings = MemorySettings::default();
        if let Some(n) = self.max_entries {
            settings.max_entries = n.into_inner();
        }
        if let Some(n) = self.max_bytes {
            settings.max_bytes = n.into_inner();
        }
        Ok(StoreConfig::Memory(settings))
    }
}

/// `backend = "embedded"`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EmbeddedTable {
    path: Option<String>,
    fsync: Option<bool>,
    max_entries: Option<Checked<checked::AtLeastOne>>,
    max_bytes: Option<Checked<checked::NonZeroSize>>,
    timeout: Option<Checked<NonZero>>,
}

impl Table for EmbeddedTable {
    fn settings(self) -> Result<StoreConfig, Refused> {
        let path = match self.path {
            None => crate::store::embedded::DEFAULT_PATH.to_string(),
            Some(path) if !path.is_empty() => path,
            Some(_) => {
                return Err(refused(
                    "path",
                    "must name a directory the gateway owns (empty here)",
                ))
            }
        };
        let mut settings = EmbeddedSettings::new(path);
        if let Some(fsync) = self.fsync {
            settings.fsync = fsync;
        }
        if let Some(n) = self.max_entries {
            settings.max_entries = n.into_inner();
        }
        if let Some(n) = self.max_bytes {
            settings.max_bytes = n.into_inner();
        }
        if let Some(timeout) = self.timeout {
            settings.timeout = timeout.into_inner();
        }
        Ok(StoreConfig::Embedded(settings))
    }
}

/// Declares a Redis backend's table: its own fields, then the fields every Redis backend has.
macro_rules! redis_table {
    ($(#[$doc:meta])* $name:ident { $($field:ident: $ty:ty,)* }) => {
        $(#[$doc])*
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct $name {
            $($field: $ty,)*
            wait_replicas: Option<u32>,
            prefix: Option<Checked<Prefix>>,
            timeout: Option<Checked<NonZero>>,
            local_cache: Option<HumanSize>,
            local_cache_ttl: Option<HumanDuration>,
            tls_ca_file: Option<Checked<ExistingFile>>,
            tls_cert_file: Option<Checked<ExistingFile>>,
            tls_key_file: Option<Checked<ExistingFile>>,
            compression: Option<Compression>,
        }

        impl $name {
            /// The settings for `topology`, with the fields every Redis backend has.
            fn redis(self, topology: Topology) -> Result<RedisSettings, Refused> {
                let mut settings = RedisSettings::with_topology(topology);
                settings.wait_replicas = self.wait_replicas.unwrap_or(0);
                if let Some(prefix) = self.prefix {
                    settings.prefix = prefix.into_inner();
                }
                if let Some(timeout) = self.timeout {
                    settings.timeout = timeout.into_inner();
                }
                settings.local_cache = local_cache(self.local_cache, self.local_cache_ttl);
                let tls = settings.topology.urls().iter().all(|u| u.starts_with("rediss://"));
                let files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file);
                settings.tls = tls_files(files, tls, "needs rediss:// URLs")?;
                if let Some(c) = self.compression {
                    settings.compression = c;
                }
                Ok(settings)
            }
        }
    };
}

redis_table! {
    /// `backend = "redis"`: one server.
    SingleTable {
        url: Option<Checked<RedisUrl>>,
    }
}

impl Table for SingleTable {
    fn settings(self) -> Result<StoreConfig, Refused> {
        let url = self
            .url
            .as_ref()
            .ok_or_else(|| refused("url", "is required when store.backend = \"redis\""))?;
        let topology = Topology::Single {
            url: url.get().clone(),
        };
        self.redis(topology).map(StoreConfig::Redis)
    }
}

redis_table! {
    /// `backend = "redis-cluster"`: a Redis Cluster's seed nodes.
    ClusterTable {
        urls: Option<Checked<NodeUrls>>,
    }
}

impl Table for ClusterTable {
    fn settings(self) -> Result<StoreConfig, Refused> {
        let urls = node_urls(&self.urls, "redis-cluster")?;
        // Braces would make a hash tag of the prefix: every record on one slot.
        if let Some(prefix) = &self.prefix {
            if prefix.get().contains(['{', '}']) {
                return Err(refused(
                    "prefix",
                    "must be free of { and } on a Redis Cluster (they would put every record on one slot)",
                ));
            }
        }
        self.redis(Topology::Cluster { urls })
            .map(StoreConfig::Redis)
    }
}

redis_table! {
    /// `backend = "redis-sentinel"`: the sentinels, and the name of the primary they monitor.
    SentinelTable {
        urls: Option<Checked<NodeUrls>>,
        master_name: Option<String>,
        node_username: Option<String>,
        node_password: Option<String>,
    }
}

impl Table for SentinelTable {
    fn settings(self) -> Result<StoreConfig, Refused> {
        let urls = node_urls(&self.urls, "redis-sentinel")?;
        let master_name = self.master_name.clone().unwrap_or_default();
        if master_name.is_empty() {
            return Err(refused(
                "master_name",
                "is required when store.backend = \"redis-sentinel\"",
            ));
        }
        let node_auth = match (self.node_username.clone(), self.node_password.clone()) {
            (None, None) => None,
            (_, Some(p)) if p.is_empty() => {
                return Err(refused("node_password", "must not be empty"));
            }
            (_, Some(p)) if p == crate::store::REDACTED => {
                return Err(refused("node_password", crate::store::REDACTED_REFUSED));
            }
            (Some(u), _) if u.is_empty() => {
                return Err(refused("node_username", "must not be empty"));
            }
            (username, password) => Some(NodeAuth { username, password }),
        };
        let mut settings = self.redis(Topology::Sentinel { urls, master_name })?;
        settings.node_auth = node_auth;
        Ok(StoreConfig::Redis(settings))
    }
}

/// `backend = "postgres"`: a table in a PostgreSQL database.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PostgresTable {
    url: Option<Checked<PostgresUrl>>,
    table: Option<Checked<TableName>>,
    pool_size: Option<Checked<checked::AtLeastOne>>,
    timeout: Option<Checked<NonZero>>,
    migration_timeout: Option<Checked<NonZero>>,
    tls_ca_file: Option<Checked<ExistingFile>>,
    tls_cert_file: Option<Checked<ExistingFile>>,
    tls_key_file: Option<Checked<ExistingFile>>,
    local_cache: Option<HumanSize>,
    local_cache_ttl: Option<HumanDuration>,
}

impl Table for PostgresTable {
    fn settings(self) -> Result<StoreConfig, Refused> {
        let url = self
            .url
            .ok_or_else(|| refused("url", "is required when store.backend = \"postgres\""))?;
        let mut settings = PostgresSettings::new(url.into_inner());
        if let Some(table) = self.table {
            settings.table = table.into_inner();
        }
        if let Some(n) = self.pool_size {
            settings.pool_size = n.into_inner();
        }
        if let Some(timeout) = self.timeout {
            settings.timeout = timeout.into_inner();
        }
        if let Some(timeout) = self.migration_timeout {
            settings.migration_timeout = timeout.into_inner();
        }
        let tls = !settings.url.contains("sslmode=disable");
        let files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file);
        settings.tls = tls_files(files, tls, "needs TLS (not sslmode=disable)")?;
        settings.local_cache = local_cache(self.local_cache, self.local_cache_ttl);
        Ok(StoreConfig::Postgres(settings))
    }
}

/// `tls_ca_file`, `tls_cert_file` and `tls_key_file` as written (`ca`, `cert`, `key`), for a
/// store whose connections use `tls`; without it, any of them is refused: it `needs` TLS.
fn tls_files(
    (ca, cert, key): (FileField, FileField, FileField),
    tls: bool,
    needs: &str,
) -> Result<TlsFiles, Refused> {
    let mut files = TlsFiles::default();
    if let Some(path) = ca {
        if !tls {
            return Err(refused("tls_ca_file", needs));
        }
        files.ca_file = Some(path.into_inner());
    }
    if let Some((cert, key)) = client_pair(cert, key)? {
        if !tls {
            return Err(refused("tls_cert_file", needs));
        }
        (files.cert_file, files.key_file) = (Some(cert), Some(key));
    }
    Ok(files)
}

/// A file's path as written, checked to be readable.
type FileField = Option<Checked<ExistingFile>>;

/// `local_cache` and `local_cache_ttl` as written, the defaults where they are not.
fn local_cache(bytes: Option<HumanSize>, ttl: Option<HumanDuration>) -> LocalCacheSettings {
    let mut settings = LocalCacheSettings::default();
    if let Some(HumanSize(n)) = bytes {
        settings.bytes = n;
    }
    if let Some(HumanDuration(d)) = ttl {
        settings.ttl = d;
    }
    settings
}

/// A store client's certificate and key (`tls_cert_file`, `tls_key_file`), for mutual TLS: both
/// or neither, readable, and going together (checked now, so that `check-config` names the
/// file at fault).
fn client_pair(
    cert: Option<Checked<ExistingFile>>,
    key: Option<Checked<ExistingFile>>,
) -> Result<Option<(String, String)>, Refused> {
    let pair = super::paired(("tls_cert_file", cert), ("tls_key_file", key))
        .map_err(|(field, why)| refused(field, why))?;
    let Some((cert, key)) = pair else {
        return Ok(None);
    };
    let (cert, key) = (cert.into_inner(), key.into_inner());
    crate::tls::check_client_pair(&cert, &key)
        .map_err(|(file, why)| refused(&crate::store::tls_field(file), why))?;
    Ok(Some((cert, key)))
}

/// The nodes of a cluster or the sentinels: at least one.
fn node_urls(urls: &Option<Checked<NodeUrls>>, backend: &str) -> Result<Vec<String>, Refused> {
    match urls {
        Some(urls) if !urls.get().is_empty() => Ok(urls.get().clone()),
        _ => Err(refused(
            "urls",
            format!("needs at least one URL when store.backend = \"{backend}\""),
        )),
    }
}

/// A Redis URL's scheme.
fn redis_url(url: String) -> Result<String, String> {
    if crate::store::has_redacted_password(&url) {
        return Err(format!("its password {}", crate::store::REDACTED_REFUSED));
    }
    if url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("unix://") {
        Ok(url)
    } else {
        Err("must start with redis://, rediss:// or unix://".into())
    }
}

rules! {
    /// `redis://`, `rediss://` or `unix://`.
    RedisUrl: String => String = redis_url;
    /// Nodes reached over TCP, all with TLS or none.
    NodeUrls: Vec<String> => Vec<String> = |urls: Vec<String>| {
        for url in &urls {
            if url.starts_with("unix://") {
                return Err("must be redis:// or rediss:// URLs (nodes are reached over TCP)".to_string());
            }
            redis_url(url.clone())?;
        }
        let tls = urls.iter().filter(|u| u.starts_with("rediss://")).count();
        match tls == 0 || tls == urls.len() {
            true => Ok(urls),
            false => Err("mixes redis:// and rediss://: use one scheme for every node".to_string()),
        }
    };
    /// The prefix scopes every key this gateway writes, and the admin API's evict-all deletes
    /// everything under it: an empty one would mean the whole database.
    Prefix: String => String = |prefix: String| {
        match prefix.is_empty() || prefix.contains(['*', '?', '[', ']', '\\']) {
            true => Err("must be non-empty and free of the glob characters * ? [ ] \\".to_string()),
            false => Ok(prefix),
        }
    };
    /// `postgres://` or `postgresql://`, readable as a connection URL (its errors never show
    /// the URL: it may hold a password).
    PostgresUrl: String => String = |url: String| {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err("must start with postgres:// or postgresql://".to_string());
        }
        if crate::store::has_redacted_password(&url) {
            return Err(format!("its password {}", crate::store::REDACTED_REFUSED));
        }
        crate::store::postgres::connect_config(&url).map(|_| url)
    };
    /// A table name the gateway creates and quotes: lower case, so that it reads the same
    /// quoted or not, and short enough for its index's name.
    TableName: String => String = |name: String| {
        let ok = name.len() <= 48
            && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        match ok {
            true => Ok(name),
            false => Err("must be 1 to 48 of a-z, 0-9 and _, not starting with a digit".to_string()),
        }
    };
    /// A file that exists.
    ExistingFile: String => String = |path: String| match std::fs::metadata(&path) {
        Ok(_) => Ok(path),
        Err(e) => Err(format!("{path}: {e}")),
    };
}

#[cfg(test)]
mod postgres_tests {
    use super::*;
    use crate::config::Config;

    const BASE: &str = "upstream = \"http://h:1\"\n[store]\nbackend = \"postgres\"\n";

    fn err(fields: &str) -> String {
        Config::from_toml(&format!("{BASE}{fields}"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn postgres_reads_its_defaults_and_never_shows_the_password() {
        let c = Config::from_toml(&format!(
            "{BASE}url = \"postgres://gw:pa55@db:5432/pay?sslmode=verify-full\"\n"
        ))
        .unwrap();
        let StoreConfig::Postgres(p) = &c.store else {
            panic!("a PostgreSQL store")
        };
        assert_eq!(
            (p.table.as_str(), p.pool_size, p.timeout),
            ("idemgate_records", 16, std::time::Duration::from_secs(2))
        );
        assert_eq!(
            (p.local_cache.bytes, p.local_cache.ttl),
            (64 << 20, std::time::Duration::from_secs(60))
        );
        assert_eq!(c.store.backend(), "postgres");
        let shown = format!("{:?} {:#?} {}", c.store, p, c.store.describe());
        assert!(!shown.contains("pa55"), "{shown}");
        assert!(shown.contains("postgres://gw:***@db:5432/pay"), "{shown}");
        // The local cache, as in front of Redis.
        let c = Config::from_toml(&format!(
            "{BASE}url = \"postgres://db/x\"\nlocal_cache = \"1MiB\"\nlocal_cache_ttl = \"5s\"\n"
        ))
        .unwrap();
        let StoreConfig::Postgres(p) = &c.store else {
            panic!("a PostgreSQL store")
        };
        assert_eq!(
            (p.local_cache.bytes, p.local_cache.ttl),
            (1 << 20, std::time::Duration::from_secs(5))
        );
        assert!(format!("{p:#?}").contains("local_cache_ttl: 5s"), "{p:#?}");
    }

    #[test]
    fn postgres_migration_timeout_across_its_range() {
        let read = |value: &str| {
            let c =
                Config::from_toml(&format!("{BASE}url = \"postgres://db/x\"\n{value}")).unwrap();
            match c.store {
                StoreConfig::Postgres(p) => p,
                other => panic!("a PostgreSQL store, got {other:?}"),
            }
        };
        let default = read("");
        assert_eq!(
            default.migration_timeout,
            crate::store::postgres::DEFAULT_MIGRATION_TIMEOUT
        );
        assert!(
            format!("{default:#?}").contains("migration_timeout: 1day"),
            "{default:#?}"
        );
        assert_eq!(
            read("migration_timeout = \"1ms\"").migration_timeout,
            std::time::Duration::from_millis(1)
        );
        assert_eq!(
            read("migration_timeout = \"1000000y\"").migration_timeout,
            crate::time::MAX_DURATION
        );
        let zero = err("url = \"postgres://db/x\"\nmigration_timeout = \"0s\"");
        assert!(zero.contains("store.migration_timeout"), "{zero}");
        let under_redis = Config::from_toml(
            "upstream = \"http://h:1\"\n[store]\nbackend = \"redis\"\nurl = \"redis://r\"\nmigration_timeout = \"1h\"",
        )
        .unwrap_err()
        .to_string();
        assert!(
            under_redis.contains("store.migration_timeout") && under_redis.contains("\"postgres\""),
            "{under_redis}"
        );
    }

    #[test]
    fn postgres_fields_are_checked_by_name() {
        assert!(err("").contains("store.url"));
        assert!(err("url = \"mysql://db/x\"").contains("store.url"));
        let bad_mode = err("url = \"postgres://gw:pa55@db/x?sslmode=sometimes\"");
        assert!(
            bad_mode.contains("store.url") && !bad_mode.contains("pa55"),
            "{bad_mode}"
        );
        let url = "url = \"postgres://db/x\"\n";
        assert!(err(&format!("{url}table = \"Records\"")).contains("store.table"));
        assert!(err(&format!("{url}table = \"x; DROP TABLE y\"")).contains("store.table"));
        assert!(err(&format!("{url}pool_size = 0")).contains("store.pool_size"));
        assert!(err(&format!("{url}timeout = \"0s\"")).contains("store.timeout"));
        // A Redis field here names the backends it belongs to, and a PostgreSQL one under Redis.
        let misplaced = err(&format!("{url}prefix = \"p:\""));
        assert!(
            misplaced.contains("store.prefix") && misplaced.contains("redis"),
            "{misplaced}"
        );
        let under_redis = Config::from_toml(
            "upstream = \"http://h:1\"\n[store]\nbackend = \"redis\"\nurl = \"redis://r\"\ntable = \"t\"",
        )
        .unwrap_err()
        .to_string();
        assert!(
            under_redis.contains("store.table") && under_redis.contains("\"postgres\""),
            "{under_redis}"
        );
        let unknown = Config::from_toml("upstream = \"http://h:1\"\n[store]\nbackend = \"mysql\"")
            .unwrap_err()
            .to_string();
        assert!(unknown.contains("\"postgres\""), "{unknown}");
    }
}
