//! The TOML configuration a user writes, and its validation.
//!
//! The structs here are the reference for the file format: every field's doc comment says what it
//! means and what it defaults to (docs/configuration.md has the same as prose). [`Config::from_toml`]
//! parses and validates in one step, so a [`Config`] that exists is a config the gateway can run;
//! every error names the field at fault.
//!
//! - `policy`: `[defaults]` and `[[routes]]`, read into the engine's [`Policy`].
//! - [`store`]: the `[store]` table, one variant per backend.
//! - [`upstream`]: the `[upstreams.NAME]` tables and the listener's `[tls]`.
//! - [`telemetry`]: the `[telemetry]` table (OpenTelemetry traces over OTLP).
//! - [`human`]: durations and sizes written as human strings.
//! - `checked`: values checked by their rule as they are read, and errors naming the field.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use serde::Deserialize;

mod checked;
mod effective;
pub mod human;
mod policy;
pub mod store;
pub mod telemetry;
pub mod upstream;
mod webhook;
mod written;

pub use crate::error::ConfigError;
pub use crate::record::policy::{
    FingerprintMode, KeySecret, OnInFlight, OnStoreError, Policy, PolicyBuilder, Protocol,
};
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) use effective::values as effective_values;
pub use effective::Sources;
pub use human::{HumanDuration, HumanRate, HumanSize, MAX_DURATION};
pub use store::{
    redact_url, Compression, MemorySettings, RedisSettings, SealMode, StoreConfig, Topology,
};
pub use telemetry::TelemetryConfig;
pub use upstream::{ListenerTls, UpstreamConfig, DEFAULT_UPSTREAM};

use checked::Checked;
use policy::PolicyTable;
use telemetry::RawTelemetry;
use upstream::{RawTls, RawUpstream};

pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::invalid(field, reason)
}

/// Two optional fields that go together (a certificate and its key): both or neither. The error
/// names the one missing, within its table: `(field, why)`.
pub(super) fn paired<T>(
    (a, first): (&'static str, Option<T>),
    (b, second): (&'static str, Option<T>),
) -> Result<Option<(T, T)>, (&'static str, String)> {
    match (first, second) {
        (Some(x), Some(y)) => Ok(Some((x, y))),
        (None, None) => Ok(None),
        (Some(_), None) => Err((b, format!("is required with {a}"))),
        (None, Some(_)) => Err((a, format!("is required with {b}"))),
    }
}

/// The environment variable the key secret comes from (never a file: it is a secret).
pub const KEY_SECRET_VAR: &str = "IDEMGATE_KEY_SECRET";

pub use crate::store::SEAL_KEYS_VAR;

/// The secrets the gateway takes from its environment, never from a file. New ones may come:
/// start from [`Secrets::default`] and set the fields.
#[derive(Clone, Copy, Default)]
#[non_exhaustive]
pub struct Secrets<'a> {
    /// What `IDEMGATE_KEY_SECRET` holds: derived keys are made with it.
    pub key_secret: Option<&'a [u8]>,
    /// What `IDEMGATE_SEAL_KEYS` holds: the keys records are sealed with (`[store] seal`).
    pub seal_keys: Option<&'a str>,
    /// The variables a webhook route's `webhook_secret_env` is looked up in; `None`: the
    /// process's environment.
    pub vars: Option<&'a [(String, String)]>,
}

/// Where the gateway listens when `listen` is not given.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// How long open requests may take to finish after a shutdown signal, when not given.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// How long a client has to send a request head (a new connection's first one counted from the
/// accept), when not given.
pub const DEFAULT_CLIENT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a client connection may stay open with no request in progress, when not given.
pub const DEFAULT_CLIENT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The least rate of a request body once its grace has passed, when not given: Kestrel's
/// `MinRequestBodyDataRate`, 240 bytes a second.
pub const DEFAULT_CLIENT_MIN_BODY_RATE: NonZeroU64 = NonZeroU64::new(240).unwrap();

/// How long the gateway waits on a request body before its rate counts, when not given:
/// Kestrel's 5 s.
pub const DEFAULT_CLIENT_MIN_BODY_RATE_GRACE: Duration = Duration::from_secs(5);

/// Open client connections per process, when not given.
pub const DEFAULT_MAX_CLIENT_CONNECTIONS: usize = 10_000;

/// The file as written. Unknown fields are errors, so a typo never silently does nothing.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    listen: Option<String>,
    upstream: Option<String>,
    shutdown_grace: Option<HumanDuration>,
    workers: Option<usize>,
    client_header_timeout: Option<Checked<checked::NonZero>>,
    client_idle_timeout: Option<Checked<checked::NonZero>>,
    client_min_body_rate: Option<HumanRate>,
    client_min_body_rate_grace: Option<Checked<checked::NonZero>>,
    max_client_connections: Option<Checked<checked::AtLeastOne>>,
    #[serde(default)]
    upstreams: BTreeMap<String, RawUpstream>,
    tls: Option<RawTls>,
    #[serde(default)]
    store: StoreConfig,
    #[serde(default)]
    admin: RawAdmin,
    telemetry: Option<RawTelemetry>,
    #[serde(default)]
    defaults: PolicyTable,
    #[serde(default)]
    routes: Vec<PolicyTable>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    listen: Option<String>,
    admin_token: Option<String>,
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
    /// Address to listen on. Default [`DEFAULT_LISTEN`].
    pub listen: SocketAddr,
    /// The URL of the upstream `[defaults]` forwards to (the top-level `upstream`, unless
    /// `[defaults] upstream` names another).
    pub upstream: Uri,
    /// Every upstream by name; `default` is the top-level `upstream`.
    pub upstreams: BTreeMap<String, Arc<UpstreamConfig>>,
    /// TLS on the listener, when `[tls]` is given.
    pub tls: Option<ListenerTls>,
    /// The secret derived keys are made with (`IDEMGATE_KEY_SECRET`), when set.
    pub key_secret: Option<KeySecret>,
    /// The store and its settings. Default: the embedded store in `idemgate-data` (no `[store]`,
    /// or `[store]` without `backend`).
    pub store: StoreConfig,
    /// The policy for requests that match no route.
    pub defaults: Arc<Policy>,
    /// The routes, in file order.
    pub routes: Vec<Route>,
    /// After a shutdown signal, how long open requests may take to finish. Default
    /// [`DEFAULT_SHUTDOWN_GRACE`].
    pub shutdown_grace: Duration,
    /// Worker threads serving connections, each with its own event loop and upstream pool.
    /// Default: one per core.
    pub workers: usize,
    /// How long a client has to send a whole request head after its first byte, and a new
    /// connection its first request (TLS handshake and HTTP/2 preface included) after the
    /// accept. Default [`DEFAULT_CLIENT_HEADER_TIMEOUT`].
    pub client_header_timeout: Duration,
    /// A client connection with no request in progress is closed after this (HTTP/2: GOAWAY
    /// first); so is one on which the client takes none of its answer, or sends none of its
    /// body, for this long. Default [`DEFAULT_CLIENT_IDLE_TIMEOUT`].
    pub client_idle_timeout: Duration,
    /// A request body must arrive at least this fast (bytes a second), on average over the
    /// time the gateway waits on the client for it, once it has waited
    /// `client_min_body_rate_grace`; a slower one is cut and its request answered `408`. None:
    /// off. Default [`DEFAULT_CLIENT_MIN_BODY_RATE`].
    pub client_min_body_rate: Option<NonZeroU64>,
    /// The waiting on a request body before `client_min_body_rate` counts. Default
    /// [`DEFAULT_CLIENT_MIN_BODY_RATE_GRACE`].
    pub client_min_body_rate_grace: Duration,
    /// Open client connections per process; past it new ones wait in the kernel's backlog.
    /// Default [`DEFAULT_MAX_CLIENT_CONNECTIONS`].
    pub max_client_connections: usize,
    /// The admin listener.
    pub admin: AdminConfig,
    /// OpenTelemetry traces, when `[telemetry]` is given; none: nothing is exported.
    pub telemetry: Option<TelemetryConfig>,
}

impl Config {
    /// How often the certificate files in force (the listener's, and each upstream's TLS files)
    /// are looked at for a change on disk: `[tls] reload_interval`, or its default without
    /// `[tls]`. Zero: only a reload reads them.
    pub fn certificate_reload_interval(&self) -> Duration {
        self.tls
            .as_ref()
            .map_or(upstream::DEFAULT_TLS_RELOAD_INTERVAL, |t| t.reload_interval)
    }

    /// Every certificate the gateway presents, by the name its expiry metric gives it, with its
    /// PEM file: the listener's, each upstream's client certificate, the store's and the
    /// collector's.
    pub fn presented_certificates(&self) -> Vec<(String, String)> {
        let mut found = Vec::new();
        if let Some(tls) = &self.tls {
            found.push(("listener".to_string(), tls.cert_file.clone()));
        }
        for (name, upstream) in &self.upstreams {
            if let Some(cert) = &upstream.client_cert_file {
                found.push((format!("upstream:{name}"), cert.clone()));
            }
        }
        let store_tls = match &self.store {
            StoreConfig::Redis(redis) => Some(&redis.tls),
            StoreConfig::Postgres(postgres) => Some(&postgres.tls),
            StoreConfig::Memory(_) | StoreConfig::Embedded(_) => None,
        };
        if let Some(cert) = store_tls.and_then(|tls| tls.cert_file.as_ref()) {
            found.push(("store".to_string(), cert.clone()));
        }
        let collector = self.telemetry.as_ref();
        if let Some(cert) = collector.and_then(|t| t.client_cert_file.as_ref()) {
            found.push(("collector".to_string(), cert.clone()));
        }
        found
    }

    /// Read and validate a TOML file (if any), with the `IDEMGATE_...` variables of the
    /// process's environment over it: nested fields joined by a double underscore
    /// (`IDEMGATE_STORE__URL`, `IDEMGATE_DEFAULTS__TTL`), values read as TOML-like values
    /// where they parse as such (`true`, `409`, `[POST, PATCH]`) and as strings otherwise;
    /// `IDEMGATE_ADMIN_TOKEN` is short for `IDEMGATE_ADMIN__ADMIN_TOKEN`.
    pub fn load(path: Option<&str>) -> Result<Self, ConfigError> {
        Self::load_with_sources(path).map(|(config, _)| config)
    }

    /// [`Config::load`], with where each value came from, for [`Config::effective_toml`].
    pub fn load_with_sources(path: Option<&str>) -> Result<(Self, Sources), ConfigError> {
        use figment::providers::{Env, Format, Toml};
        let text = match path {
            Some(path) => std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
                path: path.to_string(),
                source,
            })?,
            None => String::new(),
        };
        // The secrets are not settings of the overlay.
        let env = Env::prefixed("IDEMGATE_")
            .ignore(&["key_secret", "seal_keys"])
            .map(|key| {
                if key == "admin_token" {
                    "admin.admin_token".into()
                } else {
                    key.as_str().replace("__", ".").into()
                }
            });
        let secret = std::env::var_os(KEY_SECRET_VAR);
        let seal_keys = std::env::var_os(SEAL_KEYS_VAR);
        let seal_keys = seal_keys
            .as_deref()
            .map(|keys| {
                keys.to_str()
                    .ok_or_else(|| invalid(SEAL_KEYS_VAR, "is not UTF-8"))
            })
            .transpose()?;
        let secrets = Secrets {
            key_secret: secret.as_ref().map(|s| s.as_encoded_bytes()),
            seal_keys,
            vars: None,
        };
        Self::from_figment(
            figment::Figment::from(Toml::string(&text)).merge(env),
            secrets,
        )
    }

    /// Read and validate what `figment` holds ([`Config::load`]: the file with the environment
    /// over it), with `secrets`; and where each value came from.
    pub(crate) fn from_figment(
        figment: figment::Figment,
        secrets: Secrets<'_>,
    ) -> Result<(Self, Sources), ConfigError> {
        let raw: RawConfig = figment.extract().map_err(checked::from_figment)?;
        Ok((Self::from_raw(raw, secrets)?, Sources::new(figment)))
    }

    /// This configuration as TOML the gateway reads back as it (secrets given again), as
    /// `check-config` prints it: defaults filled in, each route merged over `[defaults]`,
    /// secrets as `"<redacted>"`, after each value a comment saying where it came from
    /// (`sources`); `name` is what it was read from.
    pub fn effective_toml(&self, sources: &Sources, name: &str) -> String {
        effective::effective_toml(self, sources, name)
    }

    /// The routes' policies, in file order (each named after its path pattern), for
    /// [`Routes::from_config`](crate::idempotency::Routes::from_config).
    pub fn route_policies(&self) -> impl Iterator<Item = &Policy> {
        self.routes.iter().map(|r| &*r.policy)
    }

    /// Parse and validate TOML text (without a key secret: a route with `derived_key` is
    /// refused).
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Self::from_toml_with_key_secret(text, None)
    }

    /// Parse and validate TOML text, with the secret derived keys are made with.
    pub fn from_toml_with_key_secret(
        text: &str,
        secret: Option<&[u8]>,
    ) -> Result<Self, ConfigError> {
        let secrets = Secrets {
            key_secret: secret,
            ..Secrets::default()
        };
        Self::from_toml_with_secrets(text, secrets)
    }

    /// Parse and validate TOML text, with the secrets the environment would give.
    pub fn from_toml_with_secrets(text: &str, secrets: Secrets<'_>) -> Result<Self, ConfigError> {
        let toml =
            toml::Deserializer::parse(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        let raw: RawConfig = serde_path_to_error::deserialize(toml).map_err(checked::from_toml)?;
        Self::from_raw(raw, secrets)
    }

    fn from_raw(raw: RawConfig, secrets: Secrets<'_>) -> Result<Self, ConfigError> {
        let key_secret = secrets
            .key_secret
            .map(KeySecret::new)
            .transpose()
            .map_err(|reason| invalid(KEY_SECRET_VAR, reason))?;
        let listen = raw.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
        let listen: SocketAddr = listen.parse().map_err(|_| {
            invalid(
                "listen",
                format!("{listen:?} is not an address like \"127.0.0.1:8080\""),
            )
        })?;
        let upstreams = upstream::upstreams(raw.upstream, raw.upstreams)?;
        let tls = upstream::listener_tls(raw.tls)?;
        let mut store = raw.store;
        store
            .with_seal_keys(secrets.seal_keys)
            .map_err(|reason| invalid(SEAL_KEYS_VAR, reason))?;
        let shutdown_grace = raw.shutdown_grace.map_or(DEFAULT_SHUTDOWN_GRACE, |d| d.0);
        let admin = admin(raw.admin)?;
        let telemetry = telemetry::telemetry(raw.telemetry)?;
        let workers = match raw.workers {
            Some(n) if n == 0 || n > 1024 => {
                return Err(invalid("workers", "must be between 1 and 1024"))
            }
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let or = |field: Option<Checked<_>>, default| field.map_or(default, Checked::into_inner);
        let client_header_timeout = or(raw.client_header_timeout, DEFAULT_CLIENT_HEADER_TIMEOUT);
        let client_idle_timeout = or(raw.client_idle_timeout, DEFAULT_CLIENT_IDLE_TIMEOUT);
        let client_min_body_rate = raw
            .client_min_body_rate
            .map_or(Some(DEFAULT_CLIENT_MIN_BODY_RATE), |r| r.0);
        let client_min_body_rate_grace = or(
            raw.client_min_body_rate_grace,
            DEFAULT_CLIENT_MIN_BODY_RATE_GRACE,
        );
        let max_client_connections = raw
            .max_client_connections
            .map_or(DEFAULT_MAX_CLIENT_CONNECTIONS, Checked::into_inner)
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        let (defaults, routes) = policies(
            &raw.defaults,
            &raw.routes,
            key_secret.as_ref(),
            secrets.vars,
        )?;
        let upstream = forwarded_to(&upstreams, &defaults, &routes)?;
        kept_by(&store, &defaults, &routes)?;
        Ok(Config {
            listen,
            upstream,
            upstreams,
            tls,
            key_secret,
            store,
            defaults,
            routes,
            shutdown_grace,
            workers,
            client_header_timeout,
            client_idle_timeout,
            client_min_body_rate,
            client_min_body_rate_grace,
            max_client_connections,
            admin,
            telemetry,
        })
    }
}

/// The `[admin]` table, validated.
fn admin(raw: RawAdmin) -> Result<AdminConfig, ConfigError> {
    let listen = match raw.listen.as_deref() {
        None => None,
        Some(a) => Some(a.parse().map_err(|_| {
            invalid(
                "admin.listen",
                format!("{a:?} is not an address like \"127.0.0.1:9090\""),
            )
        })?),
    };
    let admin_token = match raw.admin_token {
        Some(t) if t == crate::store::REDACTED => {
            return Err(invalid("admin.admin_token", crate::store::REDACTED_REFUSED))
        }
        Some(t) if t.trim().len() < 16 => {
            return Err(invalid(
                "admin.admin_token",
                "must be at least 16 characters",
            ))
        }
        t => t,
    };
    Ok(AdminConfig {
        listen,
        admin_token,
    })
}

/// `[defaults]` merged over the built-in defaults, and each route merged over that; checked as
/// the route table will be built, so that building it cannot fail.
fn policies(
    defaults: &PolicyTable,
    routes: &[PolicyTable],
    key_secret: Option<&KeySecret>,
    vars: Option<&[(String, String)]>,
) -> Result<(Arc<Policy>, Vec<Route>), ConfigError> {
    if defaults.path.is_some() {
        return Err(invalid("defaults.path", "belongs in a [[routes]] entry"));
    }
    // Whether `max_ttl` was given, by the table or `[defaults]` under it.
    let resolve = |table: &PolicyTable, over: &Policy, max_ttl_given: bool, at: &str| {
        let given = |field: &str| table.sets(field) || defaults.sets(field);
        let policy = table
            .merged_over(over.clone())
            .with_protocol_defaults(given);
        if table.sets("keyed_methods") && policy.keyed_methods_unread() {
            let reason = "applies only where protocol = \"jsonrpc\" or \"mcp\"";
            return Err(invalid(format!("{at}.keyed_methods"), reason));
        }
        let policy = webhook::settle(policy, table.sets_ttl(), vars, at)?;
        let policy = policy.settle_ttls(max_ttl_given || table.sets_max_ttl(), at)?;
        policy.with_key_secret(key_secret, at)
    };
    let defaults_max_ttl = defaults.sets_max_ttl();
    let defaults = resolve(defaults, &Policy::default(), false, "defaults")?;
    let mut table = crate::idempotency::Routes::new(defaults.clone());
    let mut resolved = Vec::with_capacity(routes.len());
    for (i, r) in routes.iter().enumerate() {
        let at = format!("routes[{i}]");
        let path = r
            .path
            .clone()
            .ok_or_else(|| invalid(format!("{at}.path"), "is required"))?;
        let mut policy = resolve(r, &defaults, defaults_max_ttl, &at)?;
        policy.route = path.clone();
        table = table.route(&path, policy.clone())?;
        resolved.push(Route {
            path,
            policy: Arc::new(policy),
        });
    }
    Ok((Arc::new(defaults), resolved))
}

/// An error naming the first record lifetime set to forever on a store that cannot keep it.
fn kept_by(store: &StoreConfig, defaults: &Policy, routes: &[Route]) -> Result<(), ConfigError> {
    if store.keeps_forever() {
        return Ok(());
    }
    let policies = routes
        .iter()
        .enumerate()
        .map(|(i, r)| (format!("routes[{i}]"), &*r.policy));
    for (at, policy) in std::iter::once(("defaults".to_string(), defaults)).chain(policies) {
        if let Some(field) = policy.forever_field() {
            return Err(invalid(
                format!("{at}.{field}"),
                format!(
                    "\"forever\" needs a durable store (backend = \"embedded\" or \"postgres\"), not {:?}",
                    store.backend()
                ),
            ));
        }
    }
    Ok(())
}

/// The URL `[defaults]` forwards to; an error naming the policy whose upstream does not exist.
fn forwarded_to(
    upstreams: &BTreeMap<String, Arc<UpstreamConfig>>,
    defaults: &Policy,
    routes: &[Route],
) -> Result<Uri, ConfigError> {
    let named = |policy: &Policy, at: &str| match upstreams.get(&policy.upstream) {
        Some(u) => Ok(u.url.clone()),
        None if policy.upstream == DEFAULT_UPSTREAM => Err(invalid("upstream", "is required")),
        None => Err(invalid(
            format!("{at}.upstream"),
            format!(
                "{:?} names no upstream; define [upstreams.{}]",
                policy.upstream, policy.upstream
            ),
        )),
    };
    let upstream = named(defaults, "defaults")?;
    for (i, r) in routes.iter().enumerate() {
        named(&r.policy, &format!("routes[{i}]"))?;
    }
    Ok(upstream)
}

#[cfg(test)]
// figment's Jail returns figment's own (large) error type.
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;
    use crate::record::policy::Ttl;
    use crate::store::EmbeddedSettings;
    use http::{Method, StatusCode};

    fn err(text: &str) -> String {
        Config::from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn keyed_methods_without_a_jsonrpc_protocol_is_refused() {
        let base = "upstream = \"http://h:1\"\n[[routes]]\npath = \"/rpc\"\n";
        let e = Config::from_toml(&format!("{base}keyed_methods = [\"a\"]")).unwrap_err();
        assert!(e.to_string().contains("routes[0].keyed_methods"), "{e}");
        let ok = format!("{base}protocol = \"jsonrpc\"\nkeyed_methods = [\"a\"]");
        assert!(Config::from_toml(&ok).is_ok());
    }

    #[test]
    fn minimal_config_uses_builtin_defaults() {
        let c = Config::from_toml("upstream = \"http://127.0.0.1:9000\"").unwrap();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(
            c.store,
            StoreConfig::Embedded(EmbeddedSettings::new("idemgate-data"))
        );
        assert_eq!(*c.defaults, Policy::default());
        assert_eq!(c.shutdown_grace, DEFAULT_SHUTDOWN_GRACE);
        assert_eq!(c.client_header_timeout, DEFAULT_CLIENT_HEADER_TIMEOUT);
        assert_eq!(c.client_idle_timeout, DEFAULT_CLIENT_IDLE_TIMEOUT);
        assert_eq!(c.max_client_connections, DEFAULT_MAX_CLIENT_CONNECTIONS);
    }

    #[test]
    fn client_connection_limits_are_positive() {
        let base = "upstream = \"http://127.0.0.1:9000\"\n";
        for (line, field) in [
            ("client_header_timeout = \"0s\"", "client_header_timeout"),
            ("client_idle_timeout = \"0ms\"", "client_idle_timeout"),
            ("max_client_connections = 0", "max_client_connections"),
        ] {
            let e = err(&format!("{base}{line}"));
            assert!(e.contains(field), "{e}");
        }
        let c = Config::from_toml(&format!(
            "{base}client_header_timeout = \"5s\"\nclient_idle_timeout = \"2m\"\nmax_client_connections = 300"
        ))
        .unwrap();
        assert_eq!(c.client_header_timeout, Duration::from_secs(5));
        assert_eq!(c.client_idle_timeout, Duration::from_secs(120));
        assert_eq!(c.max_client_connections, 300);
    }

    #[test]
    fn the_min_body_rate_reads_as_a_size_a_second_or_off() {
        let base = "upstream = \"http://127.0.0.1:9000\"\n";
        let rate = |value: &str| {
            let c = Config::from_toml(&format!("{base}client_min_body_rate = {value}"));
            c.map(|c| c.client_min_body_rate.map(NonZeroU64::get))
        };
        let c = Config::from_toml(base).unwrap();
        assert_eq!(c.client_min_body_rate, Some(DEFAULT_CLIENT_MIN_BODY_RATE));
        assert_eq!(
            c.client_min_body_rate_grace,
            DEFAULT_CLIENT_MIN_BODY_RATE_GRACE
        );
        for (value, read) in [
            ("\"off\"", None),
            ("\"OFF\"", None),
            ("0", None),
            ("\"0\"", None),
            ("\"0B/s\"", None),
            ("1", Some(1)),
            ("\"1B/s\"", Some(1)),
            ("\"240B/s\"", Some(240)),
            ("\" 240 B/s \"", Some(240)),
            ("\"1.5KiB/s\"", Some(1536)),
            ("\"1MiB/s\"", Some(1 << 20)),
            ("\"16EiB/s\"", Some(u64::MAX)),
            ("\"1000000EiB/s\"", Some(u64::MAX)),
            (&i64::MAX.to_string(), Some(i64::MAX as u64)),
        ] {
            assert_eq!(rate(value).unwrap(), read, "{value}");
        }
        for (value, why) in [
            ("\"0.5B/s\"", "less than 1 byte a second"),
            ("\"240B\"", "not a rate like"),
            ("\"240B/m\"", "not a rate like"),
            ("\"fast\"", "not a rate like"),
            ("\"-1B/s\"", "not a rate like"),
            ("\"/s\"", "not a rate like"),
        ] {
            let e = rate(value).unwrap_err().to_string();
            assert!(
                e.contains("client_min_body_rate") && e.contains(why),
                "{value}: {e}"
            );
        }
        // Not a number of bytes, nor a string.
        let e = rate("-1").unwrap_err().to_string();
        assert!(e.contains("client_min_body_rate"), "{e}");
        // The grace: more than 0, up to the longest duration.
        let grace = |value: &str| {
            Config::from_toml(&format!("{base}client_min_body_rate_grace = \"{value}\""))
                .map(|c| c.client_min_body_rate_grace)
        };
        let e = grace("0s").unwrap_err().to_string();
        assert!(e.contains("client_min_body_rate_grace"), "{e}");
        assert_eq!(grace("1ms").unwrap(), Duration::from_millis(1));
        assert_eq!(grace("5000000000000s").unwrap(), MAX_DURATION);
    }

    #[test]
    fn the_min_body_rate_is_set_from_the_environment() {
        for (value, read) in [
            ("off", None),
            ("0", None),
            ("64KiB/s", NonZeroU64::new(65536)),
        ] {
            figment::Jail::expect_with(|jail| {
                jail.set_env("IDEMGATE_UPSTREAM", "http://127.0.0.1:9000");
                jail.set_env("IDEMGATE_CLIENT_MIN_BODY_RATE", value);
                assert_eq!(Config::load(None).unwrap().client_min_body_rate, read);
                Ok(())
            });
        }
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
        assert_eq!(p.ttl, Ttl::For(Duration::from_secs(7 * 86400)));
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
        // A lease too short to be renewed in time.
        let short = err(&format!("{base}[defaults]\nlock_ttl = \"29ms\""));
        assert!(
            short.contains("defaults.lock_ttl") && short.contains("at least 30ms"),
            "{short}"
        );
        assert!(Config::from_toml(&format!("{base}[defaults]\nlock_ttl = \"30ms\"")).is_ok());
        assert!(err(&format!("{base}[defaults]\nmax_body = \"lots\"")).contains("max_body"));
        assert!(err(&format!("{base}[defaults]\nmismatch_status = 400"))
            .contains("defaults.mismatch_status"));
        assert!(err(&format!("{base}[store]\nbackend = \"redis\"")).contains("store.url"));
        assert!(err(&format!("{base}[store]\nbackend = \"etcd\"")).contains("store.backend"));
        let redis = "[store]\nbackend = \"redis\"\nurl = \"redis://h:6379\"\n";
        assert!(err(&format!("{base}{redis}prefix = \"\"")).contains("store.prefix"));
        assert!(err(&format!("{base}{redis}prefix = \"a*\"")).contains("store.prefix"));
        assert!(err(&format!("{base}[defaults]\nttll = \"1s\"")).contains("ttll"));
        assert!(err(&format!(
            "{base}[[routes]]\npath = \"/a/{{id}}\"\n[[routes]]\npath = \"/a/{{other}}\""
        ))
        .contains("routes[1].path"));
        assert!(err("upstream = \"ftp://x\"").contains("upstream"));
        assert!(err(&format!(
            "{base}[[routes]]\npath = \"/a\"\nrequire_kye = true"
        ))
        .contains("require_kye"));
        assert!(err(&format!("{base}[defaults]\npath = \"/a\"")).contains("defaults.path"));
        assert!(
            err(&format!("{base}{redis}tls_ca_file = \"/etc/hostname\""))
                .contains("store.tls_ca_file")
        );
        let missing = "[store]\nbackend = \"redis\"\nurl = \"rediss://h:6379\"\ntls_ca_file = \"/nonexistent/ca.pem\"";
        assert!(err(&format!("{base}{missing}")).contains("store.tls_ca_file"));
    }

    #[test]
    fn a_backend_field_set_on_another_backend_is_an_error() {
        let base = "upstream = \"http://127.0.0.1:9000\"\n";
        let e = err(&format!("{base}[store]\nurl = \"redis://h:6379\""));
        assert!(e.contains("store.url") && e.contains("redis"), "{e}");
        let e = err(&format!(
            "{base}[store]\nbackend = \"memory\"\nprefix = \"x:\""
        ));
        assert!(e.contains("store.prefix"), "{e}");
        let e = err(&format!(
            "{base}[store]\nbackend = \"redis\"\nurl = \"redis://h:6379\"\nmax_entries = 5"
        ));
        assert!(
            e.contains("store.max_entries") && e.contains("memory"),
            "{e}"
        );
    }

    #[test]
    fn cluster_and_sentinel_stores_name_their_fields() {
        let base = "upstream = \"http://127.0.0.1:9000\"\n";
        let cluster = "[store]\nbackend = \"redis-cluster\"\n";
        let sentinel = "[store]\nbackend = \"redis-sentinel\"\n";
        assert!(err(&format!("{base}{cluster}")).contains("store.urls"));
        assert!(err(&format!("{base}{cluster}urls = []")).contains("store.urls"));
        assert!(err(&format!("{base}{cluster}url = \"redis://h:1\"")).contains("store.url"));
        assert!(err(&format!("{base}{cluster}urls = [\"http://h:1\"]")).contains("store.urls"));
        assert!(
            err(&format!("{base}{cluster}urls = [\"unix:///tmp/r.sock\"]")).contains("store.urls")
        );
        assert!(err(&format!(
            "{base}{cluster}urls = [\"redis://a:1\", \"rediss://b:1\"]"
        ))
        .contains("store.urls"));
        assert!(err(&format!(
            "{base}{cluster}urls = [\"redis://a:1\"]\nprefix = \"{{x}}:\""
        ))
        .contains("store.prefix"));
        assert!(err(&format!(
            "{base}{cluster}urls = [\"redis://a:1\"]\nmaster_name = \"m\""
        ))
        .contains("store.master_name"));
        assert!(
            err(&format!("{base}{sentinel}urls = [\"redis://s:26379\"]"))
                .contains("store.master_name")
        );
        assert!(err(&format!("{base}[store]\nwait_replicas = 1")).contains("store.wait_replicas"));
        assert!(err(&format!(
            "{base}[store]\nbackend = \"redis\"\nurl = \"redis://h:1\"\nwait_replicas = -1"
        ))
        .contains("wait_replicas"));
        // A prefix with braces is fine on one server, where it is no hash tag.
        Config::from_toml(&format!(
            "{base}[store]\nbackend = \"redis\"\nurl = \"redis://h:1\"\nprefix = \"{{x}}:\""
        ))
        .unwrap();
    }

    #[test]
    fn cluster_and_sentinel_stores_read_as_written() {
        let c = Config::from_toml(
            "upstream = \"http://h:1\"\n[store]\nbackend = \"redis-sentinel\"\n\
             urls = [\"redis://:pw@s1:26379\", \"redis://:pw@s2:26379\"]\n\
             master_name = \"idemgate\"\nwait_replicas = 1\nprefix = \"p:\"",
        )
        .unwrap();
        let StoreConfig::Redis(r) = &c.store else {
            panic!("a Redis store")
        };
        assert_eq!(
            r.topology,
            Topology::Sentinel {
                urls: vec!["redis://:pw@s1:26379".into(), "redis://:pw@s2:26379".into()],
                master_name: "idemgate".into()
            }
        );
        assert_eq!((r.wait_replicas, r.prefix.as_str()), (1, "p:"));
        assert_eq!(c.store.backend(), "redis-sentinel");
        let shown = format!("{:?} {}", c.store, c.store.describe());
        assert!(!shown.contains("pw"), "{shown}");
        assert!(shown.contains("redis://:***@s2:26379"), "{shown}");
        let c = Config::from_toml(
            "upstream = \"http://h:1\"\n[store]\nbackend = \"redis-cluster\"\nurls = [\"redis://a:7001\"]",
        )
        .unwrap();
        assert_eq!(c.store.backend(), "redis-cluster");
    }

    #[test]
    fn very_large_ttl_is_accepted() {
        let c = Config::from_toml(
            "upstream = \"http://h:1\"\n[defaults]\nttl = \"3650d\"\nmax_ttl = \"3650d\"",
        )
        .unwrap();
        assert_eq!(c.defaults.ttl, Ttl::For(Duration::from_secs(3650 * 86400)));
        let c = Config::from_toml(
            "upstream = \"http://h:1\"\n[defaults]\nttl = \"5000000000000s\"\nmax_ttl = \"5000000000000s\"",
        )
        .unwrap();
        assert_eq!(c.defaults.ttl, Ttl::For(MAX_DURATION));
        // A ttl past max_ttl (7d by default) is refused, naming the field.
        assert!(err("upstream = \"http://h:1\"\n[defaults]\nttl = \"8d\"").contains("defaults.ttl"));
        assert!(err("upstream = \"http://h:1\"\n[[routes]]\npath = \"/a\"\nfailure_ttl = \"1h\"\nmax_ttl = \"30m\"")
            .contains("routes[0].ttl"));
    }

    #[test]
    fn forever_is_for_durable_stores_and_raises_max_ttl() {
        let on = |store: &str, policy: &str| {
            format!("upstream = \"http://h:1\"\n[store]\n{store}\n{policy}")
        };
        let embedded = "backend = \"embedded\"\npath = \"/tmp/x\"";
        let forever = "[defaults]\nttl = \"forever\"";
        let c = Config::from_toml(&on(embedded, forever)).unwrap();
        assert_eq!(
            (c.defaults.ttl, c.defaults.max_ttl),
            (Ttl::Forever, Ttl::Forever)
        );
        assert_eq!(c.defaults.failure_ttl, Policy::default().failure_ttl);
        // A route may keep its records for less; its max_ttl is still forever.
        let route = "[[routes]]\npath = \"/a\"\nttl = \"1h\"";
        let c = Config::from_toml(&on(embedded, &format!("{forever}\n{route}"))).unwrap();
        assert_eq!(c.routes[0].policy.ttl, Ttl::For(Duration::from_secs(3600)));
        assert_eq!(c.routes[0].policy.max_ttl, Ttl::Forever);
        let pg = "backend = \"postgres\"\nurl = \"postgres://u@h/db\"";
        let audit = "[[routes]]\npath = \"/a\"\nttl = \"forever\"\nfailure_ttl = \"forever\"";
        let c = Config::from_toml(&on(pg, audit)).unwrap();
        assert_eq!(c.routes[0].policy.failure_ttl, Ttl::Forever);
        assert_eq!(c.defaults.max_ttl, Policy::default().max_ttl);
        // A finite max_ttl beside it is an error naming both, in the table or under it.
        let both = format!("{forever}\nmax_ttl = \"30d\"");
        let e = err(&on(embedded, &both));
        assert!(
            e.contains("defaults.ttl") && e.contains("defaults.max_ttl is 30days"),
            "{e}"
        );
        let under = "[defaults]\nmax_ttl = \"30d\"\n[[routes]]\npath = \"/a\"\nttl = \"forever\"";
        assert!(err(&on(embedded, under)).contains("routes[0].ttl"));
        // Memory and Redis cannot keep a record forever: an error naming the field.
        let e = err(&on("backend = \"memory\"", forever));
        assert!(
            e.contains("defaults.ttl") && e.contains("durable store"),
            "{e}"
        );
        let redis = "backend = \"redis\"\nurl = \"redis://h:6379\"";
        assert!(err(&on(redis, audit)).contains("routes[0].ttl"));
        let bound = "[[routes]]\npath = \"/a\"\nmax_ttl = \"forever\"";
        assert!(err(&on(redis, bound)).contains("routes[0].max_ttl"));
        assert!(err(&on(embedded, "[defaults]\nttl = \"always\"")).contains("or \"forever\""));
    }

    #[test]
    fn the_builder_keeps_forever_as_the_toml_does() {
        let p = Policy::builder().ttl(Ttl::Forever).build().unwrap();
        assert_eq!(p.max_ttl, Ttl::Forever);
        let e = Policy::builder()
            .ttl(Ttl::Forever)
            .max_ttl(Duration::from_secs(60))
            .build()
            .unwrap_err();
        assert!(e.to_string().contains("policy.ttl"), "{e}");
    }

    #[test]
    fn the_builder_validates_as_the_toml_does() {
        let built = Policy::builder()
            .methods([Method::POST])
            .ttl(Duration::from_secs(3600))
            .mismatch_status(StatusCode::UNPROCESSABLE_ENTITY)
            .scope_headers(["Authorization", "x-tenant"])
            .build()
            .unwrap();
        let parsed = Config::from_toml(
            "upstream = \"http://h:1\"\n[defaults]\nmethods = [\"POST\"]\nttl = \"1h\"\nmismatch_status = 422\nscope_headers = [\"Authorization\", \"x-tenant\"]",
        )
        .unwrap();
        assert_eq!(
            Policy {
                route: "defaults".into(),
                ..built
            },
            *parsed.defaults
        );
        let e = Policy::builder()
            .mismatch_status(StatusCode::BAD_REQUEST)
            .build();
        assert!(e
            .unwrap_err()
            .to_string()
            .contains("policy.mismatch_status"));
        assert!(Policy::builder().max_waiters(0).build().is_err());
        assert!(Policy::builder().methods([]).build().is_err());
    }

    #[test]
    fn environment_beats_the_file() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "idemgate.toml",
                "upstream = \"http://127.0.0.1:9000\"\n[defaults]\nttl = \"1h\"\nlock_ttl = \"5s\"",
            )?;
            jail.set_env("IDEMGATE_DEFAULTS__TTL", "2h");
            jail.set_env("IDEMGATE_DEFAULTS__METHODS", "[POST, PUT]");
            jail.set_env("IDEMGATE_DEFAULTS__REQUIRE_KEY", "true");
            jail.set_env("IDEMGATE_DEFAULTS__MISMATCH_STATUS", "422");
            jail.set_env("IDEMGATE_ADMIN_TOKEN", "0123456789abcdef-secret");
            jail.set_env("UNRELATED", "x");
            let c = Config::load(Some("idemgate.toml")).unwrap();
            assert_eq!(c.defaults.ttl, Ttl::For(Duration::from_secs(7200)));
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
            Ok(())
        });
    }

    #[test]
    fn environment_alone_is_a_config() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("IDEMGATE_UPSTREAM", "http://10.0.0.1:8000");
            jail.set_env("IDEMGATE_LISTEN", "0.0.0.0:8080");
            jail.set_env("IDEMGATE_STORE__BACKEND", "redis");
            jail.set_env("IDEMGATE_STORE__URL", "redis://user:pw@redis:6379/0");
            jail.set_env("IDEMGATE_ADMIN__LISTEN", "0.0.0.0:9090");
            jail.set_env(
                "IDEMGATE_ROUTES",
                "[{path = \"/v1/payments\", require_key = true, ttl = \"7d\"}]",
            );
            let c = Config::load(None).unwrap();
            assert_eq!(c.listen.to_string(), "0.0.0.0:8080");
            assert!(
                matches!(&c.store, StoreConfig::Redis(r) if r.topology == Topology::Single { url: "redis://user:pw@redis:6379/0".into() })
            );
            assert!(
                !format!("{c:?}").contains(":pw@"),
                "the password is never printed"
            );
            assert_eq!(c.admin.listen.unwrap().port(), 9090);
            assert_eq!(c.routes.len(), 1);
            assert!(c.routes[0].policy.require_key);
            assert_eq!(
                c.routes[0].policy.ttl,
                Ttl::For(Duration::from_secs(7 * 86400))
            );
            Ok(())
        });
    }

    #[test]
    fn environment_errors_name_the_field() {
        for (name, value, field) in [
            ("IDEMGATE_DEFAULTS__TTL", "0s", "defaults.ttl"),
            ("IDEMGATE_DEFAULTS__TLL", "1s", "tll"),
            ("IDEMGATE_DEFAULTS__KEY_MAX_LEN", "lots", "key_max_len"),
        ] {
            figment::Jail::expect_with(|jail| {
                jail.set_env("IDEMGATE_UPSTREAM", "http://127.0.0.1:9000");
                jail.set_env(name, value);
                let e = Config::load(None).unwrap_err().to_string();
                assert!(e.to_ascii_lowercase().contains(field), "{e}");
                Ok(())
            });
        }
    }

    /// Errors name a key as the user wrote it: figment's profile (`default.`) is not part of it.
    #[test]
    fn file_errors_name_the_key_as_written() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "idemgate.toml",
                "upstream = \"http://127.0.0.1:9000\"\n[tracing]\nx = 1",
            )?;
            let e = Config::load(Some("idemgate.toml")).unwrap_err().to_string();
            assert!(e.contains("for key \"tracing\" in TOML"), "{e}");
            jail.create_file(
                "idemgate.toml",
                "upstream = \"http://127.0.0.1:9000\"\n[telemetry]\nx = 1",
            )?;
            let e = Config::load(Some("idemgate.toml")).unwrap_err().to_string();
            assert!(e.contains("for key \"telemetry.x\" in TOML"), "{e}");
            jail.create_file(
                "idemgate.toml",
                "upstream = \"http://127.0.0.1:9000\"\n[[routes]]\npath = \"/a\"\nmax_body = \"lots\"",
            )?;
            let e = Config::load(Some("idemgate.toml")).unwrap_err().to_string();
            assert!(e.contains("\"lots\" is not a size"), "{e}");
            assert!(e.contains("for key \"routes[0].max_body\""), "{e}");
            jail.create_file(
                "idemgate.toml",
                "upstream = \"http://127.0.0.1:9000\"\n[[routes]]\npath = \"/a\"\nttl = \"0s\"",
            )?;
            let e = Config::load(Some("idemgate.toml")).unwrap_err().to_string();
            assert_eq!(
                e,
                "invalid config: routes[0].ttl: must be greater than zero"
            );
            Ok(())
        });
    }

    /// config/example.toml shows every default the code has, and config/redis.toml every Redis
    /// default: the files a user copies cannot drift from the built-in values.
    #[test]
    fn the_example_configs_show_the_built_in_defaults() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/config/");
        let example = std::fs::read_to_string(format!("{dir}example.toml")).unwrap();
        let c = Config::from_toml(&example).unwrap();
        assert_eq!(*c.defaults, Policy::default(), "[defaults] of example.toml");
        // Its MCP route keys what an MCP route keys by default, though [defaults] names the
        // fields (which then are not the protocol's).
        let mcp = c.routes.iter().find(|r| r.path == "/mcp").unwrap();
        let bare = Config::from_toml(
            "upstream = \"http://h:1\"\n[[routes]]\npath = \"/mcp\"\nprotocol = \"mcp\"",
        )
        .unwrap();
        let bare = &bare.routes[0].policy;
        assert_eq!(
            (
                &mcp.policy.key_headers,
                &mcp.policy.key_from_body,
                &mcp.policy.keyed_methods
            ),
            (&bare.key_headers, &bare.key_from_body, &bare.keyed_methods),
        );
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.shutdown_grace, DEFAULT_SHUTDOWN_GRACE);
        assert_eq!(c.client_header_timeout, DEFAULT_CLIENT_HEADER_TIMEOUT);
        assert_eq!(c.client_idle_timeout, DEFAULT_CLIENT_IDLE_TIMEOUT);
        assert_eq!(c.client_min_body_rate, Some(DEFAULT_CLIENT_MIN_BODY_RATE));
        assert_eq!(
            c.client_min_body_rate_grace,
            DEFAULT_CLIENT_MIN_BODY_RATE_GRACE
        );
        assert_eq!(c.max_client_connections, DEFAULT_MAX_CLIENT_CONNECTIONS);
        // The embedded store's fields are shown commented out (so that the same file can switch
        // to Redis from the environment); each such line parses to the default.
        let embedded = EmbeddedSettings::new(crate::store::embedded::DEFAULT_PATH);
        assert_eq!(c.store, StoreConfig::Embedded(embedded.clone()));
        for line in [
            format!("max_entries = {}", embedded.max_entries),
            format!("max_bytes = \"{}MiB\"", embedded.max_bytes >> 20),
            format!("path = {:?}", embedded.path),
        ] {
            assert!(example.contains(&line), "example.toml lacks {line:?}");
            let c =
                Config::from_toml(&format!("upstream = \"http://h:1\"\n[store]\n{line}")).unwrap();
            assert_eq!(c.store, StoreConfig::Embedded(embedded.clone()), "{line}");
        }
        // So are the telemetry's, each with the required endpoint.
        let endpoint = "otlp_endpoint = \"http://127.0.0.1:4318\"";
        let shown = Config::from_toml(&format!(
            "upstream = \"http://h:1\"\n[telemetry]\n{endpoint}"
        ))
        .unwrap()
        .telemetry;
        assert!(example.contains(&format!("# {endpoint}\n")));
        for line in [
            format!("service_name = \"{}\"", telemetry::DEFAULT_SERVICE_NAME),
            format!("sample_ratio = {:?}", telemetry::DEFAULT_SAMPLE_RATIO),
        ] {
            assert!(
                example.contains(&format!("# {line}\n")),
                "example.toml lacks {line:?}"
            );
            let c = Config::from_toml(&format!(
                "upstream = \"http://h:1\"\n[telemetry]\n{endpoint}\n{line}"
            ));
            let (got, shown) = (c.unwrap().telemetry, &shown);
            assert_eq!(format!("{got:?}"), format!("{shown:?}"), "{line}");
        }
        assert!(c.telemetry.is_none(), "[telemetry] is off in example.toml");
        let redis = std::fs::read_to_string(format!("{dir}redis.toml")).unwrap();
        let c = Config::from_toml(&redis).unwrap();
        let StoreConfig::Redis(settings) = c.store else {
            panic!("redis.toml is a Redis config")
        };
        assert_eq!(
            settings,
            RedisSettings::with_topology(settings.topology.clone())
        );
        assert_eq!(*c.defaults, Policy::default(), "[defaults] of redis.toml");
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
        // A password with '#', '/' or '?' left unencoded is still hidden (an '@' in a query is
        // then taken for a userinfo's: more is hidden, never less).
        assert_eq!(redact_url("redis://u:p#w/?@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact_url("redis://h:1/0?x=a@b"), "redis://h:***@b");
        // A password in the query: PostgreSQL's `password`, a unix:// Redis URL's `pass`.
        assert_eq!(
            redact_url("postgres://u@h/db?sslmode=disable&password=pw&x"),
            "postgres://u@h/db?sslmode=disable&password=***&x"
        );
        assert_eq!(
            redact_url("unix:///r.sock?db=1&pass=pw"),
            "unix:///r.sock?db=1&pass=***"
        );
        assert_eq!(
            redact_url("unix:///r.sock?pa%73s=pw&pass"),
            "unix:///r.sock?pa%73s=***&pass"
        );
        assert_eq!(redact_url("unix:///r.sock?db=1"), "unix:///r.sock?db=1");
    }
}
