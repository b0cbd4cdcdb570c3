//! The idempotency policy of a route: its fields, their built-in defaults (written once, in
//! [`Policy::default`]), and their validation, shared by the TOML and [`Policy::builder`].

use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use serde::Deserialize;

use super::human::{HumanDuration, HumanSize};
use super::ConfigError;
use crate::idempotency::json::{Pointer, MAX_IGNORED};

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

/// What "the same request" means for a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum FingerprintMode {
    /// The body's exact bytes.
    #[default]
    Exact,
    /// For a JSON-typed body (`application/json`, `*/*+json`), its canonical form (see
    /// [`crate::idempotency::json`]); other bodies by their exact bytes.
    Json,
}

/// The secret that derived keys are an HMAC with (`IDEMGATE_KEY_SECRET`): never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct KeySecret(std::sync::Arc<[u8]>);

impl KeySecret {
    /// The shortest secret accepted, in bytes.
    pub const MIN_LEN: usize = 16;

    /// A secret of at least [`KeySecret::MIN_LEN`] bytes.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, String> {
        let secret = secret.as_ref();
        if secret.len() < Self::MIN_LEN {
            return Err(format!(
                "must be at least {} characters long",
                Self::MIN_LEN
            ));
        }
        Ok(KeySecret(secret.into()))
    }

    /// The secret's bytes.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Every policy field is optional so that `[defaults]` and each `[[routes]]` use one schema and a
/// route overrides only what it names. (One struct rather than a route embedding a policy with
/// `#[serde(flatten)]`, because serde cannot deny unknown fields through a flatten.)
#[derive(Debug, Deserialize, Default, Clone)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    /// Only in `[[routes]]`: the path pattern.
    pub(super) path: Option<String>,
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
    upstream: Option<String>,
    key_headers: Option<Vec<String>>,
    key_from_body: Option<String>,
    derived_key: Option<Vec<String>>,
    fingerprint: Option<FingerprintMode>,
    fingerprint_ignore: Option<Vec<String>>,
    scope_cookies: Option<Vec<String>>,
    fingerprint_headers: Option<Vec<String>>,
    failure_ttl: Option<HumanDuration>,
    max_ttl: Option<HumanDuration>,
    replay_drop_headers: Option<Vec<String>>,
    expiry_header: Option<String>,
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
    /// The named upstream the gateway forwards these requests to (`[upstreams.NAME]`); a
    /// library user's inner service may read it from the `Arc<Policy>` request extension.
    pub upstream: String,
    /// Request headers that carry the key, tried in order (lower-case names).
    pub key_headers: Vec<HeaderName>,
    /// Where in a JSON body the key is, when no header carries one.
    pub key_from_body: Option<Pointer>,
    /// Fields of a JSON body whose canonical values, with [`Policy::key_secret`], make the key
    /// (an HMAC-SHA256) when no header or body key is present.
    pub derived_key: Vec<Pointer>,
    /// The secret of derived keys; set when `derived_key` is (from `IDEMGATE_KEY_SECRET`).
    pub key_secret: Option<KeySecret>,
    /// What "the same request" means for the body.
    pub fingerprint: FingerprintMode,
    /// JSON pointers left out of a `"json"` fingerprint (`*` matches any array index).
    pub fingerprint_ignore: Vec<Pointer>,
    /// Cookies whose values scope the key, like `scope_headers`.
    pub scope_cookies: Vec<String>,
    /// Request headers that are part of the fingerprint.
    pub fingerprint_headers: Vec<HeaderName>,
    /// How long a stored 4xx (or, with `cache_server_errors`, 5xx) response is replayed.
    pub failure_ttl: Duration,
    /// The longest any record lives: `ttl`, `failure_ttl` and an upstream's
    /// `Idempotency-Control: max-age` are bounded by it.
    pub max_ttl: Duration,
    /// Response headers recorded but never replayed.
    pub replay_drop_headers: Vec<HeaderName>,
    /// If set, every recorded or replayed answer carries this header with the record's expiry.
    pub expiry_header: Option<HeaderName>,
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
            upstream: super::upstream::DEFAULT_UPSTREAM.to_string(),
            key_headers: vec![crate::idempotency::key::IDEMPOTENCY_KEY],
            key_from_body: None,
            derived_key: Vec::new(),
            key_secret: None,
            fingerprint: FingerprintMode::Exact,
            fingerprint_ignore: Vec::new(),
            scope_cookies: Vec::new(),
            fingerprint_headers: Vec::new(),
            failure_ttl: Duration::from_secs(24 * 3600),
            max_ttl: Duration::from_secs(7 * 24 * 3600),
            replay_drop_headers: vec![http::header::SET_COOKIE],
            expiry_header: None,
        }
    }

    /// A policy built in code: the built-in defaults, with what the builder sets, validated
    /// exactly as the same fields in TOML are.
    pub fn builder() -> PolicyBuilder {
        PolicyBuilder::default()
    }

    /// Give a policy that derives keys its secret; an error naming `{at}.derived_key` when it
    /// needs one and there is none.
    pub(super) fn with_key_secret(
        mut self,
        secret: Option<&KeySecret>,
        at: &str,
    ) -> Result<Self, ConfigError> {
        if self.derived_key.is_empty() {
            self.key_secret = None;
            return Ok(self);
        }
        match secret {
            Some(secret) => {
                self.key_secret = Some(secret.clone());
                Ok(self)
            }
            None => Err(ConfigError::invalid(
                format!("{at}.derived_key"),
                "needs a secret: set IDEMGATE_KEY_SECRET in the environment",
            )),
        }
    }

    /// Whether a request without a key header may carry its key in the body.
    pub fn keys_from_body(&self) -> bool {
        self.key_from_body.is_some() || self.key_secret.is_some()
    }

    /// Whether idempotency applies to `method` on this route.
    pub fn applies_to(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// Overlay the fields `raw` sets, validating each; `at` is the table's name for errors.
    pub(super) fn overlay(mut self, raw: &RawPolicy, at: &str) -> Result<Self, ConfigError> {
        if let Some(methods) = &raw.methods {
            if methods.is_empty() {
                return Err(ConfigError::invalid(
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
                        _ => Err(ConfigError::invalid(
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
                    Some(HumanDuration(d)) if d.is_zero() => Err(ConfigError::invalid(
                        format!("{at}.{name}"),
                        "must be greater than zero",
                    )),
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
                return Err(ConfigError::invalid(
                    format!("{at}.max_body"),
                    "must be greater than zero",
                ));
            }
            self.max_body = n;
        }
        if let Some(n) = raw.key_max_len {
            if n == 0 || n > 8192 {
                return Err(ConfigError::invalid(
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
                        ConfigError::invalid(
                            format!("{at}.scope_headers"),
                            format!("{n:?} is not a header name"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?;
        }
        if let Some(s) = raw.mismatch_status {
            if s != 409 && s != 422 {
                return Err(ConfigError::invalid(
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
                return Err(ConfigError::invalid(
                    format!("{at}.max_waiters"),
                    "must be at least 1",
                ));
            }
            self.max_waiters = n;
        }
        if let Some(o) = raw.on_store_error {
            self.on_store_error = o;
        }
        let header_names = |names: &Vec<String>,
                            field: &str|
         -> Result<Vec<HeaderName>, ConfigError> {
            names
                .iter()
                .map(|n| {
                    HeaderName::from_bytes(n.trim().to_ascii_lowercase().as_bytes()).map_err(|_| {
                        ConfigError::invalid(
                            format!("{at}.{field}"),
                            format!("{n:?} is not a header name"),
                        )
                    })
                })
                .collect()
        };
        let pointers = |texts: &Vec<String>, field: &str| -> Result<Vec<Pointer>, ConfigError> {
            texts
                .iter()
                .map(|t| {
                    Pointer::parse(t).map_err(|e| ConfigError::invalid(format!("{at}.{field}"), e))
                })
                .collect()
        };
        if let Some(names) = &raw.key_headers {
            if names.is_empty() {
                return Err(ConfigError::invalid(
                    format!("{at}.key_headers"),
                    "must name at least one header",
                ));
            }
            self.key_headers = header_names(names, "key_headers")?;
        }
        if let Some(pointer) = &raw.key_from_body {
            self.key_from_body = match pointer.as_str() {
                "" => None,
                p => Some(
                    Pointer::parse(p)
                        .map_err(|e| ConfigError::invalid(format!("{at}.key_from_body"), e))?,
                ),
            };
        }
        if let Some(fields) = &raw.derived_key {
            self.derived_key = pointers(fields, "derived_key")?;
        }
        if let Some(mode) = raw.fingerprint {
            self.fingerprint = mode;
        }
        if let Some(ignore) = &raw.fingerprint_ignore {
            if ignore.len() > MAX_IGNORED {
                return Err(ConfigError::invalid(
                    format!("{at}.fingerprint_ignore"),
                    format!("at most {MAX_IGNORED} pointers"),
                ));
            }
            self.fingerprint_ignore = pointers(ignore, "fingerprint_ignore")?;
        }
        if let Some(cookies) = &raw.scope_cookies {
            if let Some(bad) = cookies.iter().find(|c| {
                c.is_empty()
                    || !c
                        .bytes()
                        .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b))
            }) {
                return Err(ConfigError::invalid(
                    format!("{at}.scope_cookies"),
                    format!("{bad:?} is not a cookie name"),
                ));
            }
            self.scope_cookies = cookies.clone();
        }
        if let Some(names) = &raw.fingerprint_headers {
            self.fingerprint_headers = header_names(names, "fingerprint_headers")?;
        }
        if let Some(d) = positive(raw.failure_ttl, "failure_ttl")? {
            self.failure_ttl = d;
        }
        if let Some(d) = positive(raw.max_ttl, "max_ttl")? {
            self.max_ttl = d;
        }
        for (field, ttl) in [("ttl", self.ttl), ("failure_ttl", self.failure_ttl)] {
            if ttl > self.max_ttl {
                return Err(ConfigError::invalid(
                    format!("{at}.{field}"),
                    format!(
                        "{} is longer than max_ttl ({})",
                        humantime::format_duration(ttl),
                        humantime::format_duration(self.max_ttl)
                    ),
                ));
            }
        }
        if let Some(names) = &raw.replay_drop_headers {
            self.replay_drop_headers = header_names(names, "replay_drop_headers")?;
        }
        if let Some(name) = &raw.expiry_header {
            self.expiry_header = match name.trim() {
                "" => None,
                n => Some(header_names(&vec![n.to_string()], "expiry_header")?.remove(0)),
            };
        }
        if let Some(name) = &raw.upstream {
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(ConfigError::invalid(
                    format!("{at}.upstream"),
                    format!("{name:?} is not an upstream name (letters, digits, '-' and '_')"),
                ));
            }
            self.upstream = name.clone();
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
    secret: Option<KeySecret>,
}

impl PolicyBuilder {
    /// `methods`: the methods idempotency applies to.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.raw.methods = Some(methods.into_iter().map(|m| m.to_string()).collect());
        self
    }

    /// `ttl`: how long a completed response is replayed.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.raw.ttl = Some(HumanDuration::new(ttl));
        self
    }

    /// `lock_ttl`: the lease of an in-flight claim.
    pub fn lock_ttl(mut self, lease: Duration) -> Self {
        self.raw.lock_ttl = Some(HumanDuration::new(lease));
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
        self.raw.upstream_timeout = Some(HumanDuration::new(timeout));
        self
    }

    /// `on_in_flight`: what a duplicate of an in-flight request gets.
    pub fn on_in_flight(mut self, on: OnInFlight) -> Self {
        self.raw.on_in_flight = Some(on);
        self
    }

    /// `wait_timeout`: the longest a duplicate waits.
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.raw.wait_timeout = Some(HumanDuration::new(timeout));
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

    /// `key_headers`: the headers that carry the key, tried in order.
    pub fn key_headers<'a>(mut self, names: impl IntoIterator<Item = &'a str>) -> Self {
        self.raw.key_headers = Some(names.into_iter().map(str::to_string).collect());
        self
    }

    /// `key_from_body`: a JSON pointer to the key in a JSON body (`""`: none).
    pub fn key_from_body(mut self, pointer: &str) -> Self {
        self.raw.key_from_body = Some(pointer.to_string());
        self
    }

    /// `derived_key`: the JSON fields whose canonical values, with `secret`, make the key.
    pub fn derived_key<'a>(
        mut self,
        fields: impl IntoIterator<Item = &'a str>,
        secret: KeySecret,
    ) -> Self {
        self.raw.derived_key = Some(fields.into_iter().map(str::to_string).collect());
        self.secret = Some(secret);
        self
    }

    /// `fingerprint`: `Exact` bytes or canonical `Json`.
    pub fn fingerprint(mut self, mode: FingerprintMode) -> Self {
        self.raw.fingerprint = Some(mode);
        self
    }

    /// `fingerprint_ignore`: JSON pointers left out of a `Json` fingerprint.
    pub fn fingerprint_ignore<'a>(mut self, pointers: impl IntoIterator<Item = &'a str>) -> Self {
        self.raw.fingerprint_ignore = Some(pointers.into_iter().map(str::to_string).collect());
        self
    }

    /// `scope_cookies`: cookies whose values scope the key.
    pub fn scope_cookies<'a>(mut self, names: impl IntoIterator<Item = &'a str>) -> Self {
        self.raw.scope_cookies = Some(names.into_iter().map(str::to_string).collect());
        self
    }

    /// `fingerprint_headers`: request headers that are part of the fingerprint.
    pub fn fingerprint_headers<'a>(mut self, names: impl IntoIterator<Item = &'a str>) -> Self {
        self.raw.fingerprint_headers = Some(names.into_iter().map(str::to_string).collect());
        self
    }

    /// `failure_ttl`: how long a stored 4xx is replayed.
    pub fn failure_ttl(mut self, ttl: Duration) -> Self {
        self.raw.failure_ttl = Some(HumanDuration::new(ttl));
        self
    }

    /// `max_ttl`: the longest any record lives.
    pub fn max_ttl(mut self, ttl: Duration) -> Self {
        self.raw.max_ttl = Some(HumanDuration::new(ttl));
        self
    }

    /// `replay_drop_headers`: response headers recorded but never replayed.
    pub fn replay_drop_headers<'a>(mut self, names: impl IntoIterator<Item = &'a str>) -> Self {
        self.raw.replay_drop_headers = Some(names.into_iter().map(str::to_string).collect());
        self
    }

    /// `expiry_header`: the header that carries a record's expiry (`""`: none).
    pub fn expiry_header(mut self, name: &str) -> Self {
        self.raw.expiry_header = Some(name.to_string());
        self
    }

    /// `upstream`: the named upstream the gateway forwards to.
    pub fn upstream(mut self, name: &str) -> Self {
        self.raw.upstream = Some(name.to_string());
        self
    }

    /// The policy, or the first field refused (named as `policy.<field>`).
    pub fn build(self) -> Result<Policy, ConfigError> {
        Policy::builtin()
            .overlay(&self.raw, "policy")?
            .with_key_secret(self.secret.as_ref(), "policy")
    }
}
