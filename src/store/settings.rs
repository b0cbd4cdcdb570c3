//! Which store keeps the records ([`StoreConfig`], one backend's settings), and what the
//! backends' settings share. The configuration reads `[store]` into these.

use std::fmt;
use std::time::Duration;

use super::{
    cached, EmbeddedSettings, MemorySettings, PostgresSettings, RedisSettings, Seal, SealKeys,
    SealMode,
};

/// How long connecting or one answer may take when no timeout is given.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// The files of a shared store's TLS connections (`rediss://` for Redis, any `sslmode` but
/// `disable` for PostgreSQL): paths only, read when the store opens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// `tls_ca_file`: a PEM file of the CA(s) to trust instead of the system's.
    pub ca_file: Option<String>,
    /// `tls_cert_file`: the certificate (chain, PEM) the gateway presents to a server that asks
    /// for one (mutual TLS), with its key in `key_file`.
    pub cert_file: Option<String>,
    /// `tls_key_file`: its key (the path only: the key itself is never printed).
    pub key_file: Option<String>,
}

impl TlsFiles {
    /// The client certificate's file and its key's, when both are given.
    pub(crate) fn client_pair(&self) -> Option<(&str, &str)> {
        self.cert_file.as_deref().zip(self.key_file.as_deref())
    }

    /// These files as fields of `d`, named as `[store]` names them.
    pub(crate) fn debug_fields(&self, d: &mut fmt::DebugStruct<'_, '_>) {
        d.field("tls_ca_file", &self.ca_file)
            .field("tls_cert_file", &self.cert_file)
            .field("tls_key_file", &self.key_file);
    }
}

/// The local cache of completed records each gateway process keeps in front of a shared store
/// (`local_cache`, `local_cache_ttl`), to replay them without asking the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalCacheSettings {
    /// `local_cache`: bytes of completed responses kept (0 turns the cache off).
    pub bytes: u64,
    /// `local_cache_ttl`: the longest a response stays in the cache.
    pub ttl: Duration,
}

impl Default for LocalCacheSettings {
    fn default() -> Self {
        LocalCacheSettings {
            bytes: cached::DEFAULT_BYTES,
            ttl: cached::DEFAULT_MAX_AGE,
        }
    }
}

impl LocalCacheSettings {
    /// These settings as fields of `d`, named and written as `[store]` has them.
    pub(crate) fn debug_fields(&self, d: &mut fmt::DebugStruct<'_, '_>) {
        d.field(
            "local_cache",
            &format_args!("{}", bytesize::ByteSize(self.bytes).display().iec()),
        )
        .field(
            "local_cache_ttl",
            &format_args!("{}", humantime::format_duration(self.ttl)),
        );
    }
}

/// The `[store]` field of a file the TLS module names (`ca_file`, `client_cert_file`,
/// `client_key_file`): `tls_ca_file`, `tls_cert_file`, `tls_key_file`.
pub(crate) fn tls_field(file: &str) -> String {
    format!("tls_{}", file.trim_start_matches("client_"))
}

/// `scheme://user:***@host/...` for `scheme://user:password@host/...`; other URLs unchanged.
pub fn redact_url(url: &str) -> String {
    redact_url_as(url, "***")
}

/// What a printed configuration (`check-config`) shows for a secret; refused where a secret is
/// read, so that the printout read back cannot run with it as a password.
pub const REDACTED: &str = "<redacted>";

/// `url` with its passwords as `marker`: its userinfo's, and the value of a query parameter that
/// carries one ([`PASSWORD_PARAMS`]).
pub(crate) fn redact_url_as(url: &str, marker: &str) -> String {
    let url = match userinfo(url) {
        Some((head, _password, host)) => format!("{head}:{marker}@{host}"),
        None => url.to_string(),
    };
    let Some((base, params)) = query_params(&url) else {
        return url;
    };
    let params: Vec<String> = params
        .map(|p| match (p.secret, p.value) {
            (true, Some(_)) => format!("{}={marker}", p.name),
            (_, Some(value)) => format!("{}={value}", p.name),
            (_, None) => p.name.to_string(),
        })
        .collect();
    format!("{base}?{}", params.join("&"))
}

/// The query parameters that carry a password: PostgreSQL's `password`, and `pass` (Redis's, in
/// a `unix://` URL).
const PASSWORD_PARAMS: [&str; 2] = ["password", "pass"];

/// One `name=value` (or bare `name`) of a URL's query.
struct QueryParam<'a> {
    name: &'a str,
    value: Option<&'a str>,
    /// Whether it carries a password (its name percent-decoded, as the clients read it).
    secret: bool,
}

/// What comes before `url`'s query, and each of its parameters.
fn query_params(url: &str) -> Option<(&str, impl Iterator<Item = QueryParam<'_>>)> {
    let (base, query) = url.split_once('?')?;
    let params = query.split('&').map(|param| {
        let (name, value) = param
            .split_once('=')
            .map_or((param, None), |(n, v)| (n, Some(v)));
        let decoded = percent_encoding::percent_decode_str(name).decode_utf8_lossy();
        let secret = PASSWORD_PARAMS.contains(&decoded.as_ref());
        QueryParam {
            name,
            value,
            secret,
        }
    });
    Some((base, params))
}

/// Why a secret that is the [`REDACTED`] marker is refused.
pub(crate) const REDACTED_REFUSED: &str =
    "is \"<redacted>\", as check-config prints a secret: give the secret itself";

/// Whether a password of `url` (its userinfo's, or a query parameter's) is the [`REDACTED`]
/// marker.
pub(crate) fn has_redacted_password(url: &str) -> bool {
    let in_query = query_params(url)
        .is_some_and(|(_, mut params)| params.any(|p| p.secret && p.value == Some(REDACTED)));
    in_query || userinfo(url).is_some_and(|(_, password, _)| password == REDACTED)
}

/// `scheme://user`, the password and what follows the userinfo, for a URL with a password.
fn userinfo(url: &str) -> Option<(&str, &str, &str)> {
    let (scheme, rest) = url.split_once("://")?;
    // The last '@' ends the userinfo: a password may itself contain '@'.
    let (userinfo, host) = rest.rsplit_once('@')?;
    let (user, password) = userinfo.split_once(':')?;
    Some((&url[..scheme.len() + 3 + user.len()], password, host))
}

/// Which store keeps the records, with its settings.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreConfig {
    /// The in-process memory store: zero setup, one gateway process, lost on restart.
    Memory(MemorySettings),
    /// Redis (one server, a Redis Cluster, or a primary found through Sentinel): shared by every
    /// gateway replica and durable as far as Redis is.
    Redis(RedisSettings),
    /// A table in PostgreSQL: shared by every gateway replica, durable as PostgreSQL is.
    Postgres(PostgresSettings),
    /// The durable embedded store: a file in a directory this gateway owns.
    Embedded(EmbeddedSettings),
}

/// The durable embedded store in [`DEFAULT_PATH`](super::embedded::DEFAULT_PATH): a gateway
/// that keeps its records across restarts unless told otherwise.
impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig::Embedded(EmbeddedSettings::new(super::embedded::DEFAULT_PATH))
    }
}

impl StoreConfig {
    /// The backend for logs: its name, and its path or URLs (any password in a URL as `***`).
    pub fn describe(&self) -> String {
        match self {
            StoreConfig::Memory(_) => "memory".into(),
            StoreConfig::Embedded(e) => format!("embedded {}", e.path.display()),
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
            StoreConfig::Postgres(p) => format!("postgres {}", redact_url(&p.url)),
        }
    }

    /// What a gateway (other than the demo) logs at start about this store's durability.
    pub fn durability_warning(&self) -> Option<&'static str> {
        match self {
            StoreConfig::Memory(_) => Some("store.backend = \"memory\": every record dies with this process, so a retry after a restart runs again; use \"embedded\" or Redis in production"),
            _ => None,
        }
    }

    /// Whether the backend keeps a record for as long as it is asked, `ttl = "forever"`
    /// included: the durable ones. (A memory store dies with its process; Redis evicts under
    /// memory pressure and keeps no record across a loss of its data.)
    pub fn keeps_forever(&self) -> bool {
        matches!(self, StoreConfig::Postgres(_) | StoreConfig::Embedded(_))
    }

    /// The sealing settings of a backend that seals (all but memory).
    pub fn seal(&self) -> Option<&Seal> {
        match self {
            StoreConfig::Memory(_) => None,
            StoreConfig::Redis(r) => Some(&r.seal),
            StoreConfig::Postgres(p) => Some(&p.seal),
            StoreConfig::Embedded(e) => Some(&e.seal),
        }
    }

    fn seal_mut(&mut self) -> Option<&mut Seal> {
        match self {
            StoreConfig::Memory(_) => None,
            StoreConfig::Redis(r) => Some(&mut r.seal),
            StoreConfig::Postgres(p) => Some(&mut p.seal),
            StoreConfig::Embedded(e) => Some(&mut e.seal),
        }
    }

    /// Read as `[store] seal` says; the keys come with [`with_seal_keys`](Self::with_seal_keys).
    pub(crate) fn set_seal_mode(&mut self, mode: SealMode) {
        if let Some(seal) = self.seal_mut() {
            *seal = Seal::unkeyed(mode);
        }
    }

    /// The keys of `IDEMGATE_SEAL_KEYS` (the text of the variable, when set), checked against
    /// the mode: the reason is for the variable, and never quotes a key.
    pub(crate) fn with_seal_keys(&mut self, keys: Option<&str>) -> Result<(), String> {
        let keys = keys.map(SealKeys::parse).transpose()?;
        if let Some(seal) = self.seal_mut() {
            *seal = Seal::new(seal.mode(), keys)?;
        }
        Ok(())
    }

    /// The backend's name, as `backend` is written.
    pub fn backend(&self) -> &'static str {
        match self {
            StoreConfig::Memory(_) => "memory",
            StoreConfig::Redis(r) => r.topology.backend(),
            StoreConfig::Postgres(_) => "postgres",
            StoreConfig::Embedded(_) => "embedded",
        }
    }
}
