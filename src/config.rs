//! The TOML configuration a user writes, and its validation.
//!
//! The structs here are the reference for the file format: every field's doc comment says what it
//! means and what it defaults to. [`Config::from_toml`] parses and validates in one step, so a
//! [`Config`] that exists is a config the gateway can run; every error names the field at fault.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode, Uri};
use serde::de::{self, Deserializer};
use serde::Deserialize;

/// The longest duration any setting takes effect with (100 years); longer values are clamped.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A configuration error. Its message always names the field (`routes[1].ttl: ...`).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Io {
        /// The path given on the command line.
        path: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The TOML did not parse, or a field has the wrong type or an unknown name.
    #[error("invalid config: {0}")]
    Parse(String),
    /// A field parsed but its value is not allowed.
    #[error("invalid config: {field}: {reason}")]
    Invalid {
        /// The dotted path of the field, e.g. `routes[0].ttl`.
        field: String,
        /// Why the value is refused.
        reason: String,
    },
}

impl ConfigError {
    /// A value refused: `field` names it (`routes[1].ttl`), `reason` says why.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::invalid(field, reason)
}

/// A duration written as a human string: `"250ms"`, `"30s"`, `"24h"`, `"7d"`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl fmt::Debug for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        // Clamped to MAX_DURATION so that deadline arithmetic can never overflow.
        humantime::parse_duration(s.trim())
            .map(|d| HumanDuration(d.min(MAX_DURATION)))
            .map_err(|e| de::Error::custom(format!("{s:?} is not a duration like \"30s\" ({e})")))
    }
}

/// A size written as a human string: `"64KiB"`, `"1MiB"`, or a plain number of bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct HumanSize(pub u64);

impl fmt::Debug for HumanSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", bytesize::ByteSize(self.0).display().iec())
    }
}

impl<'de> Deserialize<'de> for HumanSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Str(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(HumanSize(n)),
            Raw::Str(s) => bytesize::ByteSize::from_str(s.trim())
                .map(|b| HumanSize(b.as_u64()))
                .map_err(|e| de::Error::custom(format!("{s:?} is not a size like \"1MiB\" ({e})"))),
        }
    }
}

/// What a duplicate of an in-flight request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnInFlight {
    /// Answer 409 problem+json with `Retry-After` at once.
    #[default]
    Reject,
    /// Wait (up to `wait_timeout`, at most `max_waiters` at once) for the first request to finish,
    /// then answer with its replay; past either bound, the 409.
    Wait,
}

/// What a keyed request gets when the store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    /// Fail closed: 503 problem+json with `Retry-After`; nothing is forwarded.
    #[default]
    Reject,
    /// Fail open: forward without idempotency (logged as a warning).
    Pass,
}

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

/// The file as written. Unknown fields are errors, so a typo never silently does nothing.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    /// Address the gateway listens on. Default `127.0.0.1:8080`.
    listen: Option<String>,
    /// Base URL of the one upstream, `http://host:port`. Required.
    upstream: Option<String>,
    /// After SIGTERM/SIGINT, how long open requests may take to finish. Default `30s`.
    shutdown_grace: Option<HumanDuration>,
    /// Worker threads, each with its own event loop and upstream pool. Default: one per core.
    workers: Option<usize>,
    #[serde(default)]
    store: RawStore,
    #[serde(default)]
    admin: RawAdmin,
    #[serde(default)]
    defaults: RawPolicy,
    #[serde(default)]
    routes: Vec<RawPolicy>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawStore {
    backend: Option<String>,
    url: Option<String>,
    prefix: Option<String>,
    timeout: Option<HumanDuration>,
    max_entries: Option<usize>,
    max_bytes: Option<HumanSize>,
    local_cache: Option<HumanSize>,
    local_cache_ttl: Option<HumanDuration>,
    tls_ca_file: Option<String>,
    compression: Option<Compression>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    listen: Option<String>,
    admin_token: Option<String>,
}

/// Every policy field is optional so that `[defaults]` and each `[[routes]]` use one schema and a
/// route overrides only what it names. (One struct rather than a route embedding a policy with
/// `#[serde(flatten)]`, because serde cannot deny unknown fields through a flatten.)
#[derive(Debug, Deserialize, Default, Clone)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    /// Only in `[[routes]]`: the path pattern.
    path: Option<String>,
    methods: Option<Vec<String>>,
    ttl: Option<HumanDuration>,
    lock_ttl: Option<HumanDuration>,
    require_key: Option<bool>,
    max_body: Option<HumanSize>,
    key_max_len: Option<usize>,
    scope_headers: Option<Vec<String>>,
    mismatch_status: Option<u16>,
    cache_server_errors: Option<bool>,
    upstream_timeout: Option<HumanDuration>,
    on_in_flight: Option<OnInFlight>,
    wait_timeout: Option<HumanDuration>,
    max_waiters: Option<usize>,
    on_store_error: Option<OnStoreError>,
}

/// Which store keeps the records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreBackend {
    /// The embedded in-process store: zero setup, one gateway process, lost on restart.
    Memory,
    /// Redis: shared by every gateway replica and durable as far as Redis is.
    Redis {
        /// `redis://` or `rediss://` URL; may carry a password, so never log it whole.
        url: String,
    },
}

impl StoreBackend {
    /// The backend for logs: the Redis URL with any password replaced by `***`.
    pub fn describe(&self) -> String {
        match self {
            StoreBackend::Memory => "memory".into(),
            StoreBackend::Redis { url } => format!("redis {}", redact_url(url)),
        }
    }
}

/// `scheme://user:***@host/...` for `scheme://user:password@host/...`; other URLs unchanged.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    // The last '@' ends the userinfo: a password may itself contain '@'.
    let Some((userinfo, host)) = rest.rsplit_once('@') else {
        return url.to_string();
    };
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_string(),
    }
}

/// The `[store]` table, validated.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// The backend to use.
    pub backend: StoreBackend,
    /// Prefix of every key the gateway writes, so one Redis can serve several deployments.
    pub prefix: String,
    /// Redis: how long to wait to connect or for one answer before the store counts as down.
    pub timeout: Duration,
    /// Memory: most records kept; past it completed records are evicted (never in-flight ones).
    pub max_entries: usize,
    /// Memory: most bytes of stored responses kept, evicting likewise.
    pub max_bytes: u64,
    /// Redis: bytes of completed responses each gateway process keeps to replay without a round
    /// trip (0 turns the local cache off).
    pub local_cache: u64,
    /// Redis: the longest a response stays in the local cache (bounds how long an eviction made
    /// through another replica goes unnoticed here).
    pub local_cache_ttl: Duration,
    /// Redis over TLS (`rediss://`): a PEM file of the CA(s) to trust instead of the system's.
    pub tls_ca_file: Option<String>,
    /// Redis: how stored bodies are compressed.
    pub compression: Compression,
}

impl StoreConfig {
    /// How to reach the Redis of a `backend = "redis"` config (with the PEM of `tls_ca_file`,
    /// read now).
    pub fn redis_options(
        &self,
    ) -> Result<crate::store::redis::RedisOptions, crate::store::StoreError> {
        let StoreBackend::Redis { url } = &self.backend else {
            unreachable!("only called for a Redis config")
        };
        let mut options = crate::store::redis::RedisOptions::new(url)
            .prefix(&self.prefix)
            .timeout(self.timeout)
            .compression(self.compression);
        if let Some(path) = &self.tls_ca_file {
            let pem = std::fs::read(path).map_err(|e| {
                crate::store::StoreError::Redis(redis::RedisError::from((
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

/// The `[admin]` table, validated.
#[derive(Clone, Default)]
pub struct AdminConfig {
    /// Where the admin listener (health, readiness, metrics, keys) listens; none: no listener.
    pub listen: Option<SocketAddr>,
    /// The bearer token of the key API; none: the key API is off.
    pub admin_token: Option<String>,
}

impl fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the token.
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field(
                "admin_token",
                &self.admin_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// The effective idempotency policy of one route: `[defaults]` merged over the built-in defaults,
/// then the route's own fields merged over that.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Where this policy came from: `"defaults"` or the route's path; used in logs and metrics.
    pub route: String,
    /// Methods where idempotency applies; others pass through untouched.
    pub methods: Vec<Method>,
    /// How long a completed response is replayed.
    pub ttl: Duration,
    /// Lease of an in-flight claim.
    pub lock_ttl: Duration,
    /// Whether a request without a key is refused with 400.
    pub require_key: bool,
    /// Largest keyed request body accepted and largest response recorded for replay.
    pub max_body: u64,
    /// Longest key accepted.
    pub key_max_len: usize,
    /// Request headers whose values scope the key (lower-case names).
    pub scope_headers: Vec<HeaderName>,
    /// Status for a key reused with a different request (409 or 422).
    pub mismatch_status: StatusCode,
    /// Store 5xx responses too (Stripe's behaviour) instead of releasing the key.
    pub cache_server_errors: bool,
    /// How long to wait for the upstream's full response.
    pub upstream_timeout: Duration,
    /// What a duplicate of an in-flight request gets.
    pub on_in_flight: OnInFlight,
    /// With `on_in_flight = "wait"`: the longest a duplicate waits.
    pub wait_timeout: Duration,
    /// With `on_in_flight = "wait"`: most duplicates waiting at once on this route.
    pub max_waiters: usize,
    /// What a keyed request gets when the store is unreachable.
    pub on_store_error: OnStoreError,
}

impl Policy {
    /// The built-in `upstream_timeout`.
    pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);

    fn builtin() -> Self {
        Policy {
            route: "defaults".into(),
            methods: vec![Method::POST, Method::PATCH],
            ttl: Duration::from_secs(24 * 3600),
            lock_ttl: Duration::from_secs(30),
            require_key: false,
            max_body: 1024 * 1024,
            key_max_len: 255,
            scope_headers: vec![http::header::AUTHORIZATION],
            mismatch_status: StatusCode::CONFLICT,
            cache_server_errors: false,
            upstream_timeout: Self::DEFAULT_UPSTREAM_TIMEOUT,
            on_in_flight: OnInFlight::Reject,
            wait_timeout: Duration::from_secs(10),
            max_waiters: 1024,
            on_store_error: OnStoreError::Reject,
        }
    }

    /// A policy built in code: the built-in defaults, with what the builder sets, validated
    /// exactly as the same fields in TOML are.
    pub fn builder() -> PolicyBuilder {
        PolicyBuilder::default()
    }

    /// Whether idempotency applies to `method` on this route.
    pub fn applies_to(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// Overlay the fields `raw` sets, validating each; `at` is the table's name for errors.
    fn overlay(mut self, raw: &RawPolicy, at: &str) -> Result<Self, ConfigError> {
        if let Some(methods) = &raw.methods {
            if methods.is_empty() {
                return Err(invalid(
                    format!("{at}.methods"),
                    "must name at least one method",
                ));
            }
            self.methods = methods
                .iter()
                .map(|m| {
                    let upper = m.trim().to_ascii_uppercase();
                    match Method::from_bytes(upper.as_bytes()) {
                        Ok(method) if !upper.is_empty() => Ok(method),
                        _ => Err(invalid(
                            format!("{at}.methods"),
                            format!("{m:?} is not an HTTP method"),
                        )),
                    }
                })
                .collect::<Result<_, _>>()?;
        }
        let positive =
            |d: Option<HumanDuration>, name: &str| -> Result<Option<Duration>, ConfigError> {
                match d {
                    Some(HumanDuration(d)) if d.is_zero() => {
                        Err(invalid(format!("{at}.{name}"), "must be greater than zero"))
                    }
                    Some(HumanDuration(d)) => Ok(Some(d)),
                    None => Ok(None),
                }
            };
        if let Some(d) = positive(raw.ttl, "ttl")? {
            self.ttl = d;
        }
        if let Some(d) = positive(raw.lock_ttl, "lock_ttl")? {
            self.lock_ttl = d;
        }
        if let Some(d) = positive(raw.upstream_timeout, "upstream_timeout")? {
            self.upstream_timeout = d;
        }
        if let Some(b) = raw.require_key {
            self.require_key = b;
        }
        if let Some(HumanSize(n)) = raw.max_body {
            if n == 0 {
                return Err(invalid(
                    format!("{at}.max_body"),
                    "must be greater than zero",
                ));
            }
            self.max_body = n;
        }
        if let Some(n) = raw.key_max_len {
            if n == 0 || n > 8192 {
                return Err(invalid(
                    format!("{at}.key_max_len"),
                    "must be between 1 and 8192",
                ));
            }
            self.key_max_len = n;
        }
        if let Some(names) = &raw.scope_headers {
            self.scope_headers = names
                .iter()
                .map(|n| {
                    HeaderName::from_bytes(n.trim().to_ascii_lowercase().as_bytes()).map_err(|_| {
                        invalid(
                            format!("{at}.scope_headers"),
                            format!("{n:?} is not a header name"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?;
        }
        if let Some(s) = raw.mismatch_status {
            if s != 409 && s != 422 {
                return Err(invalid(
                    format!("{at}.mismatch_status"),
                    "must be 409 or 422",
                ));
            }
            self.mismatch_status = StatusCode::from_u16(s).expect("409 and 422 are valid");
        }
        if let Some(b) = raw.cache_server_errors {
            self.cache_server_errors = b;
        }
        if let Some(o) = raw.on_in_flight {
            self.on_in_flight = o;
        }
        if let Some(d) = positive(raw.wait_timeout, "wait_timeout")? {
            self.wait_timeout = d;
        }
        if let Some(n) = raw.max_waiters {
            if n == 0 {
                return Err(invalid(format!("{at}.max_waiters"), "must be at least 1"));
            }
            self.max_waiters = n;
        }
        if let Some(o) = raw.on_store_error {
            self.on_store_error = o;
        }
        Ok(self)
    }
}

impl Default for Policy {
    /// The built-in defaults.
    fn default() -> Self {
        Policy::builtin()
    }
}

/// Builds a [`Policy`] in code, field by field as in TOML; [`PolicyBuilder::build`] validates.
///
/// ```
/// use idemgate::Policy;
/// use std::time::Duration;
///
/// let policy = Policy::builder()
///     .methods([http::Method::POST])
///     .require_key(true)
///     .ttl(Duration::from_secs(3600))
///     .build()?;
/// assert_eq!(policy.lock_ttl, Policy::default().lock_ttl);
/// assert!(Policy::builder().ttl(Duration::ZERO).build().is_err());
/// # Ok::<(), idemgate::ConfigError>(())
/// ```
#[derive(Debug, Default, Clone)]
pub struct PolicyBuilder {
    raw: RawPolicy,
}

impl PolicyBuilder {
    /// `methods`: the methods idempotency applies to.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.raw.methods = Some(methods.into_iter().map(|m| m.to_string()).collect());
        self
    }

    /// `ttl`: how long a completed response is replayed.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.raw.ttl = Some(HumanDuration(ttl.min(MAX_DURATION)));
        self
    }

    /// `lock_ttl`: the lease of an in-flight claim.
    pub fn lock_ttl(mut self, lease: Duration) -> Self {
        self.raw.lock_ttl = Some(HumanDuration(lease.min(MAX_DURATION)));
        self
    }

    /// `require_key`: refuse keyless requests with 400.
    pub fn require_key(mut self, required: bool) -> Self {
        self.raw.require_key = Some(required);
        self
    }

    /// `max_body`: the largest keyed request body accepted and response recorded.
    pub fn max_body(mut self, bytes: u64) -> Self {
        self.raw.max_body = Some(HumanSize(bytes));
        self
    }

    /// `key_max_len`: the longest key accepted.
    pub fn key_max_len(mut self, len: usize) -> Self {
        self.raw.key_max_len = Some(len);
        self
    }

    /// `scope_headers`: request headers whose values scope the key.
    pub fn scope_headers<'a>(mut self, names: impl IntoIterator<Item = &'a str>) -> Self {
        self.raw.scope_headers = Some(names.into_iter().map(str::to_string).collect());
        self
    }

    /// `mismatch_status`: 409 or 422.
    pub fn mismatch_status(mut self, status: StatusCode) -> Self {
        self.raw.mismatch_status = Some(status.as_u16());
        self
    }

    /// `cache_server_errors`: store 5xx responses too.
    pub fn cache_server_errors(mut self, cache: bool) -> Self {
        self.raw.cache_server_errors = Some(cache);
        self
    }

    /// `upstream_timeout`: how long the inner service may take to answer.
    pub fn upstream_timeout(mut self, timeout: Duration) -> Self {
        self.raw.upstream_timeout = Some(HumanDuration(timeout.min(MAX_DURATION)));
        self
    }

    /// `on_in_flight`: what a duplicate of an in-flight request gets.
    pub fn on_in_flight(mut self, on: OnInFlight) -> Self {
        self.raw.on_in_flight = Some(on);
        self
    }

    /// `wait_timeout`: the longest a duplicate waits.
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.raw.wait_timeout = Some(HumanDuration(timeout.min(MAX_DURATION)));
        self
    }

    /// `max_waiters`: most duplicates waiting at once.
    pub fn max_waiters(mut self, n: usize) -> Self {
        self.raw.max_waiters = Some(n);
        self
    }

    /// `on_store_error`: what a keyed request gets when the store fails.
    pub fn on_store_error(mut self, on: OnStoreError) -> Self {
        self.raw.on_store_error = Some(on);
        self
    }

    /// The policy, or the first field refused (named as `policy.<field>`).
    pub fn build(self) -> Result<Policy, ConfigError> {
        Policy::builtin().overlay(&self.raw, "policy")
    }
}

/// One `[[routes]]` entry, resolved.
#[derive(Debug, Clone)]
pub struct Route {
    /// The path pattern in axum/matchit syntax (`/v1/payments/{id}`, `/v1/{*rest}`).
    pub path: String,
    /// The effective policy.
    pub policy: Arc<Policy>,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Base URL of the upstream (scheme `http`, with authority, optional path prefix).
    pub upstream: Uri,
    /// The store.
    pub store: StoreConfig,
    /// The policy for requests that match no route.
    pub defaults: Arc<Policy>,
    /// The routes, in file order.
    pub routes: Vec<Route>,
    /// After a shutdown signal, how long open requests may take to finish.
    pub shutdown_grace: Duration,
    /// Worker threads serving connections.
    pub workers: usize,
    /// The admin listener.
    pub admin: AdminConfig,
}

impl Config {
    /// Read and validate a TOML file.
    pub fn load(path: &str) -> Result<Self, ConfigError> {
        Self::load_with_env(Some(path), std::env::vars())
    }

    /// The file at `path` (if any), with `IDEMGATE_...` variables from `env` over it: nested
    /// fields joined by a double underscore (`IDEMGATE_STORE__URL`, `IDEMGATE_DEFAULTS__TTL`),
    /// values read as TOML where they parse as such (`true`, `409`, `[POST, PATCH]`) and as
    /// strings otherwise; `IDEMGATE_ADMIN_TOKEN` is short for `IDEMGATE_ADMIN__ADMIN_TOKEN`.
    pub fn load_with_env(
        path: Option<&str>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        use figment::providers::{Format, Toml};
        let text = match path {
            Some(path) => std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
                path: path.to_string(),
                source,
            })?,
            None => String::new(),
        };
        let mut figment = figment::Figment::from(Toml::string(&text));
        for (name, value) in env {
            let Some(rest) = name.strip_prefix("IDEMGATE_") else {
                continue;
            };
            let key = match rest.to_ascii_lowercase().as_str() {
                "admin_token" => "admin.admin_token".to_string(),
                other => other.replace("__", "."),
            };
            let value: figment::value::Value =
                value.parse().unwrap_or_else(|_| value.clone().into());
            figment = figment.merge((key.as_str(), value));
        }
        let raw: RawConfig = figment
            .extract()
            .map_err(|e| ConfigError::Parse(e.to_string()))?;
        Self::from_raw(raw)
    }

    /// Parse and validate TOML text.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        Self::from_raw(raw)
    }

    fn from_raw(raw: RawConfig) -> Result<Self, ConfigError> {
        let listen = raw.listen.as_deref().unwrap_or("127.0.0.1:8080");
        let listen: SocketAddr = listen.parse().map_err(|_| {
            invalid(
                "listen",
                format!("{listen:?} is not an address like \"127.0.0.1:8080\""),
            )
        })?;

        let upstream = raw
            .upstream
            .ok_or_else(|| invalid("upstream", "is required"))?;
        let upstream = parse_upstream(&upstream)?;

        let prefix = raw.store.prefix.unwrap_or_else(|| "idemgate:".to_string());
        // The prefix scopes every key this gateway writes, and the admin API's evict-all deletes
        // everything under it: an empty one would mean the whole database.
        if prefix.is_empty() || prefix.contains(['*', '?', '[', ']', '\\']) {
            return Err(invalid(
                "store.prefix",
                "must be non-empty and free of the glob characters * ? [ ] \\",
            ));
        }
        let timeout = match raw.store.timeout {
            Some(HumanDuration(d)) if d.is_zero() => {
                return Err(invalid("store.timeout", "must be greater than zero"))
            }
            Some(HumanDuration(d)) => d,
            None => Duration::from_secs(2),
        };
        let max_entries = match raw.store.max_entries {
            Some(0) => return Err(invalid("store.max_entries", "must be at least 1")),
            Some(n) => n,
            None => 100_000,
        };
        let max_bytes = match raw.store.max_bytes {
            Some(HumanSize(0)) => {
                return Err(invalid("store.max_bytes", "must be greater than zero"))
            }
            Some(HumanSize(n)) => n,
            None => 256 * 1024 * 1024,
        };
        let local_cache = raw.store.local_cache.map_or(64 * 1024 * 1024, |s| s.0);
        let local_cache_ttl = raw
            .store
            .local_cache_ttl
            .map_or(Duration::from_secs(60), |d| d.0);
        let shutdown_grace = raw.shutdown_grace.map_or(Duration::from_secs(30), |d| d.0);
        let admin = AdminConfig {
            listen: match raw.admin.listen.as_deref() {
                None => None,
                Some(a) => Some(a.parse().map_err(|_| {
                    invalid(
                        "admin.listen",
                        format!("{a:?} is not an address like \"127.0.0.1:9090\""),
                    )
                })?),
            },
            admin_token: match raw.admin.admin_token {
                Some(t) if t.trim().len() < 16 => {
                    return Err(invalid(
                        "admin.admin_token",
                        "must be at least 16 characters",
                    ))
                }
                t => t,
            },
        };
        let workers = match raw.workers {
            Some(n) if n == 0 || n > 1024 => {
                return Err(invalid("workers", "must be between 1 and 1024"))
            }
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let backend = match raw.store.backend.as_deref().unwrap_or("memory") {
            "memory" => StoreBackend::Memory,
            "redis" => {
                let url = raw.store.url.ok_or_else(|| {
                    invalid("store.url", "is required when store.backend = \"redis\"")
                })?;
                if !(url.starts_with("redis://")
                    || url.starts_with("rediss://")
                    || url.starts_with("unix://"))
                {
                    return Err(invalid(
                        "store.url",
                        "must start with redis://, rediss:// or unix://",
                    ));
                }
                StoreBackend::Redis { url }
            }
            other => {
                return Err(invalid(
                    "store.backend",
                    format!("{other:?} is not a backend; use \"memory\" or \"redis\""),
                ))
            }
        };

        let tls_ca_file = raw.store.tls_ca_file;
        if let Some(path) = &tls_ca_file {
            if !matches!(&backend, StoreBackend::Redis { url } if url.starts_with("rediss://")) {
                return Err(invalid("store.tls_ca_file", "needs a rediss:// store.url"));
            }
            if let Err(e) = std::fs::metadata(path) {
                return Err(invalid("store.tls_ca_file", format!("{path}: {e}")));
            }
        }
        if raw.defaults.path.is_some() {
            return Err(invalid("defaults.path", "belongs in a [[routes]] entry"));
        }
        let defaults = Arc::new(Policy::builtin().overlay(&raw.defaults, "defaults")?);
        let mut matcher = matchit::Router::new();
        let mut routes = Vec::with_capacity(raw.routes.len());
        for (i, r) in raw.routes.iter().enumerate() {
            let at = format!("routes[{i}]");
            let path = r
                .path
                .clone()
                .ok_or_else(|| invalid(format!("{at}.path"), "is required"))?;
            if !path.starts_with('/') {
                return Err(invalid(format!("{at}.path"), "must start with '/'"));
            }
            matcher
                .insert(path.clone(), i)
                .map_err(|e| invalid(format!("{at}.path"), e.to_string()))?;
            let mut policy = (*defaults).clone().overlay(r, &at)?;
            policy.route = path.clone();
            routes.push(Route {
                path,
                policy: Arc::new(policy),
            });
        }

        Ok(Config {
            listen,
            upstream,
            store: StoreConfig {
                backend,
                prefix,
                timeout,
                max_entries,
                max_bytes,
                local_cache,
                local_cache_ttl,
                tls_ca_file,
                compression: raw.store.compression.unwrap_or_default(),
            },
            defaults,
            routes,
            shutdown_grace,
            workers,
            admin,
        })
    }
}

fn parse_upstream(s: &str) -> Result<Uri, ConfigError> {
    let uri: Uri = s.parse().map_err(|_| {
        invalid(
            "upstream",
            format!("{s:?} is not a URL like \"http://127.0.0.1:9000\""),
        )
    })?;
    if uri.scheme_str() != Some("http") {
        return Err(invalid(
            "upstream",
            "must be an http:// URL (TLS to the upstream is not supported yet)",
        ));
    }
    if uri.authority().is_none() {
        return Err(invalid(
            "upstream",
            "must name a host, like \"http://127.0.0.1:9000\"",
        ));
    }
    if uri.query().is_some() {
        return Err(invalid("upstream", "must not carry a query string"));
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        Config::from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn minimal_config_uses_builtin_defaults() {
        let c = Config::from_toml("upstream = \"http://127.0.0.1:9000\"").unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(c.store.backend, StoreBackend::Memory);
        assert_eq!(c.defaults.methods, vec![Method::POST, Method::PATCH]);
        assert_eq!(c.defaults.ttl, Duration::from_secs(86400));
        assert_eq!(c.defaults.max_body, 1 << 20);
    }

    #[test]
    fn routes_override_only_what_they_name() {
        let c = Config::from_toml(
            r#"
            upstream = "http://127.0.0.1:9000"
            [defaults]
            lock_ttl = "5s"
            [[routes]]
            path = "/v1/payments/{id}/capture"
            methods = ["post"]
            ttl = "7d"
            require_key = true
            max_body = "64KiB"
            "#,
        )
        .unwrap();
        let p = &c.routes[0].policy;
        assert_eq!(p.ttl, Duration::from_secs(7 * 86400));
        assert_eq!(p.lock_ttl, Duration::from_secs(5));
        assert_eq!(p.methods, vec![Method::POST]);
        assert!(p.require_key);
        assert_eq!(p.max_body, 64 * 1024);
        assert_eq!(p.route, "/v1/payments/{id}/capture");
    }

    #[test]
    fn errors_name_the_field() {
        assert!(err("").contains("upstream"));
        let base = "upstream = \"http://127.0.0.1:9000\"\n";
        assert!(err(&format!("{base}[defaults]\nttl = \"0s\"")).contains("defaults.ttl"));
        assert!(err(&format!("{base}[defaults]\nttl = \"-1s\"")).contains("ttl"));
        assert!(err(&format!(
            "{base}[[routes]]\npath = \"/a\"\nlock_ttl = \"0ms\""
        ))
        .contains("routes[0].lock_ttl"));
        assert!(err(&format!("{base}[defaults]\nmax_body = \"lots\"")).contains("max_body"));
        assert!(err(&format!("{base}[defaults]\nmismatch_status = 400"))
            .contains("defaults.mismatch_status"));
        assert!(err(&format!("{base}[store]\nbackend = \"redis\"")).contains("store.url"));
        assert!(err(&format!("{base}[store]\nbackend = \"etcd\"")).contains("store.backend"));
        assert!(err(&format!("{base}[store]\nprefix = \"\"")).contains("store.prefix"));
        assert!(err(&format!("{base}[store]\nprefix = \"a*\"")).contains("store.prefix"));
        assert!(err(&format!("{base}[defaults]\nttll = \"1s\"")).contains("ttll"));
        assert!(err(&format!(
            "{base}[[routes]]\npath = \"/a/{{id}}\"\n[[routes]]\npath = \"/a/{{other}}\""
        ))
        .contains("routes[1].path"));
        assert!(err("upstream = \"https://x\"").contains("upstream"));
        assert!(err(&format!(
            "{base}[[routes]]\npath = \"/a\"\nrequire_kye = true"
        ))
        .contains("require_kye"));
        assert!(err(&format!("{base}[defaults]\npath = \"/a\"")).contains("defaults.path"));
        let plain = "[store]\nbackend = \"redis\"\nurl = \"redis://h:6379\"\ntls_ca_file = \"/etc/hostname\"";
        assert!(err(&format!("{base}{plain}")).contains("store.tls_ca_file"));
        let missing = "[store]\nbackend = \"redis\"\nurl = \"rediss://h:6379\"\ntls_ca_file = \"/nonexistent/ca.pem\"";
        assert!(err(&format!("{base}{missing}")).contains("store.tls_ca_file"));
    }

    #[test]
    fn very_large_ttl_is_accepted() {
        let c =
            Config::from_toml("upstream = \"http://h:1\"\n[defaults]\nttl = \"3650d\"").unwrap();
        assert_eq!(c.defaults.ttl, Duration::from_secs(3650 * 86400));
        let c =
            Config::from_toml("upstream = \"http://h:1\"\n[defaults]\nttl = \"5000000000000s\"")
                .unwrap();
        assert_eq!(c.defaults.ttl, MAX_DURATION);
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn environment_beats_the_file() {
        let dir = tempfile_path("env-beats-file.toml");
        std::fs::write(
            &dir,
            "upstream = \"http://127.0.0.1:9000\"\n[defaults]\nttl = \"1h\"\nlock_ttl = \"5s\"",
        )
        .unwrap();
        let c = Config::load_with_env(
            Some(dir.to_str().unwrap()),
            env(&[
                ("IDEMGATE_DEFAULTS__TTL", "2h"),
                ("IDEMGATE_DEFAULTS__METHODS", "[POST, PUT]"),
                ("IDEMGATE_DEFAULTS__REQUIRE_KEY", "true"),
                ("IDEMGATE_DEFAULTS__MISMATCH_STATUS", "422"),
                ("IDEMGATE_ADMIN_TOKEN", "0123456789abcdef-secret"),
                ("UNRELATED", "x"),
            ]),
        )
        .unwrap();
        std::fs::remove_file(&dir).ok();
        assert_eq!(c.defaults.ttl, Duration::from_secs(7200));
        assert_eq!(
            c.defaults.lock_ttl,
            Duration::from_secs(5),
            "the file's value stays where env is silent"
        );
        assert_eq!(c.defaults.methods, vec![Method::POST, Method::PUT]);
        assert!(c.defaults.require_key);
        assert_eq!(c.defaults.mismatch_status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(
            c.admin.admin_token.as_deref(),
            Some("0123456789abcdef-secret")
        );
        assert!(
            !format!("{c:?}").contains("0123456789abcdef-secret"),
            "the token is never printed"
        );
    }

    #[test]
    fn environment_alone_is_a_config() {
        let c = Config::load_with_env(
            None,
            env(&[
                ("IDEMGATE_UPSTREAM", "http://10.0.0.1:8000"),
                ("IDEMGATE_LISTEN", "0.0.0.0:8080"),
                ("IDEMGATE_STORE__BACKEND", "redis"),
                ("IDEMGATE_STORE__URL", "redis://user:pw@redis:6379/0"),
                ("IDEMGATE_ADMIN__LISTEN", "0.0.0.0:9090"),
                (
                    "IDEMGATE_ROUTES",
                    "[{path = \"/v1/payments\", require_key = true, ttl = \"7d\"}]",
                ),
            ]),
        )
        .unwrap();
        assert_eq!(c.listen.to_string(), "0.0.0.0:8080");
        assert!(matches!(c.store.backend, StoreBackend::Redis { .. }));
        assert_eq!(c.admin.listen.unwrap().port(), 9090);
        assert_eq!(c.routes.len(), 1);
        assert!(c.routes[0].policy.require_key);
        assert_eq!(c.routes[0].policy.ttl, Duration::from_secs(7 * 86400));
    }

    #[test]
    fn environment_errors_name_the_field() {
        let base = [("IDEMGATE_UPSTREAM", "http://127.0.0.1:9000")];
        let e = Config::load_with_env(None, env(&[base[0], ("IDEMGATE_DEFAULTS__TTL", "0s")]))
            .unwrap_err();
        assert!(e.to_string().contains("defaults.ttl"), "{e}");
        let e = Config::load_with_env(None, env(&[base[0], ("IDEMGATE_DEFAULTS__TLL", "1s")]))
            .unwrap_err();
        assert!(e.to_string().contains("tll"), "{e}");
        let e = Config::load_with_env(
            None,
            env(&[base[0], ("IDEMGATE_DEFAULTS__KEY_MAX_LEN", "lots")]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("key_max_len"), "{e}");
    }

    fn tempfile_path(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("idemgate-{}-{name}", std::process::id()))
    }

    #[test]
    fn secrets_are_redacted() {
        assert_eq!(
            redact_url("redis://user:pw@h:6379/0"),
            "redis://user:***@h:6379/0"
        );
        assert_eq!(redact_url("rediss://:pw@h:6379"), "rediss://:***@h:6379");
        assert_eq!(redact_url("redis://h:6379/0"), "redis://h:6379/0");
        assert_eq!(redact_url("redis://u:p@ss@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact_url("redis://user@h:1/0"), "redis://user@h:1/0");
    }
}
