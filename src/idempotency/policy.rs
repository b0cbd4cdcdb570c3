//! The idempotency policy of a route: its fields, their built-in defaults (written once, in
//! [`Policy::default`]), and the rules each field's value follows (`check`), shared by
//! [`Policy::builder`] and the TOML configuration.

use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use serde::Deserialize;

use super::json::Pointer;
pub use super::key::KeySecret;
use super::key::IDEMPOTENCY_KEY;
use crate::error::ConfigError;
pub use crate::error::ErrorFormat;

/// The name of the upstream requests go to unless their route names another.
pub const DEFAULT_UPSTREAM: &str = "default";

pub use crate::time::{Ttl, MAX_DURATION};

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
    /// docs/behaviour.md, "Canonical JSON"); other bodies by their exact bytes.
    Json,
}

/// What a retry gets once its key's record has expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AfterExpiry {
    /// A new request: it runs again (Stripe's rule).
    #[default]
    Run,
    /// Refused with 410 for `tombstone_ttl` after the record expires; never run again.
    Refuse,
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
    pub ttl: Ttl,
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
    pub failure_ttl: Ttl,
    /// The longest any record lives: `ttl`, `failure_ttl` and an upstream's
    /// `Idempotency-Control: max-age` are bounded by it. Forever when `ttl` or `failure_ttl` is
    /// and no `max_ttl` was given.
    pub max_ttl: Ttl,
    /// Response headers recorded but never replayed.
    pub replay_drop_headers: Vec<HeaderName>,
    /// If set, every recorded or replayed answer carries this header with the record's expiry.
    pub expiry_header: Option<HeaderName>,
    /// The shape of the gateway's own refusals and failures on this route.
    pub error_format: ErrorFormat,
    /// What a retry gets after its key's record has expired.
    pub after_expiry: AfterExpiry,
    /// With `after_expiry = "refuse"`: how long a key is remembered after its record expires.
    pub tombstone_ttl: Duration,
    /// OASIS Repeatable Requests: the key from `Repeatability-Request-ID`, scoped by
    /// `Repeatability-Client-ID`, with `Repeatability-First-Sent` checked against `ttl`.
    pub repeatability: bool,
    /// Send a keyed answer to the client as it arrives while recording it, instead of buffering
    /// it whole first; with `on_in_flight = "wait"`, duplicates attach to the live answer.
    pub stream: bool,
}

impl Policy {
    /// The built-in `upstream_timeout`.
    pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);

    /// The shortest `lock_ttl`: the lease is renewed every third of it, and a renewal takes a
    /// store round trip and a timer tick (a millisecond), so a lease of a few milliseconds
    /// would run out before it could be renewed.
    pub const MIN_LOCK_TTL: Duration = Duration::from_millis(30);

    fn builtin() -> Self {
        Policy {
            route: "defaults".into(),
            methods: vec![Method::POST, Method::PATCH],
            ttl: Ttl::For(Duration::from_secs(24 * 3600)),
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
            upstream: DEFAULT_UPSTREAM.to_string(),
            key_headers: vec![IDEMPOTENCY_KEY],
            key_from_body: None,
            derived_key: Vec::new(),
            key_secret: None,
            fingerprint: FingerprintMode::Exact,
            fingerprint_ignore: Vec::new(),
            scope_cookies: Vec::new(),
            fingerprint_headers: Vec::new(),
            failure_ttl: Ttl::For(Duration::from_secs(24 * 3600)),
            max_ttl: Ttl::For(Duration::from_secs(7 * 24 * 3600)),
            replay_drop_headers: vec![http::header::SET_COOKIE],
            expiry_header: None,
            error_format: ErrorFormat::Problem,
            after_expiry: AfterExpiry::Run,
            tombstone_ttl: Duration::from_secs(30 * 24 * 3600),
            repeatability: false,
            stream: false,
        }
    }

    /// The shortest life the route's own settings give a record: `ttl` or `failure_ttl`,
    /// whichever is shorter (an upstream's `max-age` aside).
    pub fn shortest_life(&self) -> Ttl {
        self.ttl.min(self.failure_ttl)
    }

    /// A policy built in code: the built-in defaults, with what the builder sets, validated
    /// exactly as the same fields in TOML are.
    pub fn builder() -> PolicyBuilder {
        PolicyBuilder::default()
    }

    /// Give a policy that derives keys its secret; an error naming `{at}.derived_key` when it
    /// needs one and there is none.
    pub(crate) fn with_key_secret(
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

    /// Settle the record lifetimes: with `ttl` or `failure_ttl` forever, `max_ttl` is forever
    /// too unless one was given (`max_ttl_given`), which is then an error naming both; then
    /// `ttl` and `failure_ttl` within `max_ttl`, an error naming `{at}.ttl` or `{at}.failure_ttl`.
    pub(crate) fn settle_ttls(
        mut self,
        max_ttl_given: bool,
        at: &str,
    ) -> Result<Self, ConfigError> {
        let lifetimes = [("ttl", self.ttl), ("failure_ttl", self.failure_ttl)];
        for (field, ttl) in lifetimes {
            if ttl == Ttl::Forever && self.max_ttl != Ttl::Forever {
                if max_ttl_given {
                    return Err(ConfigError::invalid(
                        format!("{at}.{field}"),
                        format!(
                            "is forever, but {at}.max_ttl is {}: leave max_ttl out (it is then forever) or make {field} finite",
                            self.max_ttl
                        ),
                    ));
                }
                self.max_ttl = Ttl::Forever;
            }
        }
        for (field, ttl) in lifetimes {
            if ttl > self.max_ttl {
                return Err(ConfigError::invalid(
                    format!("{at}.{field}"),
                    format!("{ttl} is longer than max_ttl ({})", self.max_ttl),
                ));
            }
        }
        Ok(self)
    }

    /// The first field set to forever (`ttl`, `failure_ttl`, `max_ttl`), if any.
    pub(crate) fn forever_field(&self) -> Option<&'static str> {
        [
            ("ttl", self.ttl),
            ("failure_ttl", self.failure_ttl),
            ("max_ttl", self.max_ttl),
        ]
        .into_iter()
        .find(|(_, ttl)| *ttl == Ttl::Forever)
        .map(|(field, _)| field)
    }

    /// Whether a request without a key header may carry its key in the body.
    pub fn keys_from_body(&self) -> bool {
        self.key_from_body.is_some() || self.key_secret.is_some()
    }

    /// Whether idempotency applies to `method` on this route.
    pub fn applies_to(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }
}

impl Default for Policy {
    /// The built-in defaults.
    fn default() -> Self {
        Policy::builtin()
    }
}

/// The rule of each field's value: `Ok` with the value as the policy holds it, or why it is
/// refused (the caller names the field). [`PolicyBuilder`] and the TOML configuration both apply
/// these, so a policy built in code is checked exactly as one written in a file.
pub(crate) mod check {
    use std::time::Duration;

    use http::{HeaderName, Method, StatusCode};

    use super::super::json::{Pointer, MAX_IGNORED};

    /// `ttl`, `lock_ttl` and the other durations.
    pub(crate) fn non_zero(d: Duration) -> Result<Duration, String> {
        match d.is_zero() {
            true => Err("must be greater than zero".into()),
            false => Ok(d),
        }
    }

    /// `ttl`, `failure_ttl`, `max_ttl`: a duration greater than zero, or forever.
    pub(crate) fn lifetime(ttl: super::Ttl) -> Result<super::Ttl, String> {
        match ttl {
            super::Ttl::For(d) => non_zero(d).map(super::Ttl::For),
            super::Ttl::Forever => Ok(ttl),
        }
    }

    /// `lock_ttl`: at least [`Policy::MIN_LOCK_TTL`](super::Policy::MIN_LOCK_TTL).
    pub(crate) fn lock_ttl(d: Duration) -> Result<Duration, String> {
        match d < super::Policy::MIN_LOCK_TTL {
            true => Err(format!(
                "must be at least {:?}: the lease is renewed every third of it, so a shorter one runs out before it can be renewed",
                super::Policy::MIN_LOCK_TTL
            )),
            false => Ok(d),
        }
    }

    /// `max_body`.
    pub(crate) fn non_zero_size(bytes: u64) -> Result<u64, String> {
        match bytes {
            0 => Err("must be greater than zero".into()),
            n => Ok(n),
        }
    }

    /// `key_max_len`.
    pub(crate) fn key_max_len(len: usize) -> Result<usize, String> {
        match len {
            1..=8192 => Ok(len),
            _ => Err("must be between 1 and 8192".into()),
        }
    }

    /// `max_waiters`.
    pub(crate) fn max_waiters(n: usize) -> Result<usize, String> {
        match n {
            0 => Err("must be at least 1".into()),
            n => Ok(n),
        }
    }

    /// `mismatch_status`.
    pub(crate) fn mismatch_status(status: u16) -> Result<StatusCode, String> {
        match status {
            409 => Ok(StatusCode::CONFLICT),
            422 => Ok(StatusCode::UNPROCESSABLE_ENTITY),
            _ => Err("must be 409 or 422".into()),
        }
    }

    /// `methods`: at least one, any case.
    pub(crate) fn methods(names: Vec<String>) -> Result<Vec<Method>, String> {
        if names.is_empty() {
            return Err("must name at least one method".into());
        }
        names
            .iter()
            .map(|m| {
                let upper = m.trim().to_ascii_uppercase();
                match Method::from_bytes(upper.as_bytes()) {
                    Ok(method) if !upper.is_empty() => Ok(method),
                    _ => Err(format!("{m:?} is not an HTTP method")),
                }
            })
            .collect()
    }

    /// `scope_headers`, `fingerprint_headers`, `replay_drop_headers`: lower-cased names.
    pub(crate) fn header_names(names: Vec<String>) -> Result<Vec<HeaderName>, String> {
        names
            .iter()
            .map(|n| {
                HeaderName::from_bytes(n.trim().to_ascii_lowercase().as_bytes())
                    .map_err(|_| format!("{n:?} is not a header name"))
            })
            .collect()
    }

    /// `key_headers`: at least one header name.
    pub(crate) fn key_headers(names: Vec<String>) -> Result<Vec<HeaderName>, String> {
        match names.is_empty() {
            true => Err("must name at least one header".into()),
            false => header_names(names),
        }
    }

    /// `expiry_header`: a header name, or `""` for none.
    pub(crate) fn optional_header_name(name: String) -> Result<Option<HeaderName>, String> {
        match name.trim() {
            "" => Ok(None),
            n => Ok(header_names(vec![n.to_string()])?.pop()),
        }
    }

    /// `key_from_body`: an RFC 6901 pointer, or `""` for none.
    pub(crate) fn optional_pointer(text: String) -> Result<Option<Pointer>, String> {
        match text.as_str() {
            "" => Ok(None),
            p => Pointer::parse(p).map(Some),
        }
    }

    /// `derived_key`: RFC 6901 pointers.
    pub(crate) fn pointers(texts: Vec<String>) -> Result<Vec<Pointer>, String> {
        texts.iter().map(|t| Pointer::parse(t)).collect()
    }

    /// `fingerprint_ignore`: pointers (`*` for any array index), at most [`MAX_IGNORED`].
    pub(crate) fn ignored_pointers(texts: Vec<String>) -> Result<Vec<Pointer>, String> {
        match texts.len() > MAX_IGNORED {
            true => Err(format!("at most {MAX_IGNORED} pointers")),
            false => pointers(texts),
        }
    }

    /// `scope_cookies`: cookie names (RFC 6265 tokens).
    pub(crate) fn cookie_names(names: Vec<String>) -> Result<Vec<String>, String> {
        let token = |c: &String| {
            !c.is_empty()
                && c.bytes()
                    .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b))
        };
        match names.iter().find(|c| !token(c)) {
            Some(bad) => Err(format!("{bad:?} is not a cookie name")),
            None => Ok(names),
        }
    }

    /// `upstream`: the name of an `[upstreams.NAME]` table.
    pub(crate) fn upstream_name(name: String) -> Result<String, String> {
        let valid = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        match valid {
            true => Ok(name),
            false => Err(format!(
                "{name:?} is not an upstream name (letters, digits, '-' and '_')"
            )),
        }
    }
}

/// Builds a [`Policy`] in code, field by field as in TOML, each value checked by the rule the
/// TOML's is; [`PolicyBuilder::build`] reports the first refused.
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
    policy: Policy,
    secret: Option<KeySecret>,
    // Whether `max_ttl` was set (otherwise it follows a forever `ttl`).
    max_ttl_given: bool,
    // The first value refused, with its field's name.
    refused: Option<(&'static str, String)>,
}

impl PolicyBuilder {
    /// Set a field with `put` when its `value` passed its rule; otherwise remember the first
    /// refusal.
    fn set<T>(
        mut self,
        field: &'static str,
        value: Result<T, String>,
        put: impl FnOnce(&mut Policy, T),
    ) -> Self {
        match value {
            Ok(value) => put(&mut self.policy, value),
            Err(reason) => {
                self.refused.get_or_insert((field, reason));
            }
        }
        self
    }

    /// A duration as the TOML reads it: clamped to [`MAX_DURATION`], then non-zero.
    fn duration(d: Duration) -> Result<Duration, String> {
        check::non_zero(d.min(MAX_DURATION))
    }

    /// A record lifetime as the TOML reads it: a duration as [`Self::duration`], or forever.
    fn lifetime(ttl: impl Into<Ttl>) -> Result<Ttl, String> {
        match ttl.into() {
            Ttl::For(d) => Self::duration(d).map(Ttl::For),
            Ttl::Forever => Ok(Ttl::Forever),
        }
    }

    /// `methods`: the methods idempotency applies to.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let names = methods.into_iter().map(|m| m.to_string()).collect();
        self.set("methods", check::methods(names), |p, v| p.methods = v)
    }

    /// `ttl`: how long a completed response is replayed (a [`Duration`] or [`Ttl::Forever`]).
    pub fn ttl(self, ttl: impl Into<Ttl>) -> Self {
        self.set("ttl", Self::lifetime(ttl), |p, v| p.ttl = v)
    }

    /// `lock_ttl`: the lease of an in-flight claim, at least [`Policy::MIN_LOCK_TTL`].
    pub fn lock_ttl(self, lease: Duration) -> Self {
        let value = check::lock_ttl(lease.min(MAX_DURATION));
        self.set("lock_ttl", value, |p, v| p.lock_ttl = v)
    }

    /// `require_key`: refuse keyless requests with 400.
    pub fn require_key(mut self, required: bool) -> Self {
        self.policy.require_key = required;
        self
    }

    /// `max_body`: the largest keyed request body accepted and response recorded.
    pub fn max_body(self, bytes: u64) -> Self {
        let value = check::non_zero_size(bytes);
        self.set("max_body", value, |p, v| p.max_body = v)
    }

    /// `key_max_len`: the longest key accepted.
    pub fn key_max_len(self, len: usize) -> Self {
        let value = check::key_max_len(len);
        self.set("key_max_len", value, |p, v| p.key_max_len = v)
    }

    /// `scope_headers`: request headers whose values scope the key.
    pub fn scope_headers<'a>(self, names: impl IntoIterator<Item = &'a str>) -> Self {
        let value = check::header_names(strings(names));
        self.set("scope_headers", value, |p, v| p.scope_headers = v)
    }

    /// `mismatch_status`: 409 or 422.
    pub fn mismatch_status(self, status: StatusCode) -> Self {
        let value = check::mismatch_status(status.as_u16());
        self.set("mismatch_status", value, |p, v| p.mismatch_status = v)
    }

    /// `cache_server_errors`: store 5xx responses too.
    pub fn cache_server_errors(mut self, cache: bool) -> Self {
        self.policy.cache_server_errors = cache;
        self
    }

    /// `upstream_timeout`: how long the inner service may take to answer.
    pub fn upstream_timeout(self, timeout: Duration) -> Self {
        let value = Self::duration(timeout);
        self.set("upstream_timeout", value, |p, v| p.upstream_timeout = v)
    }

    /// `stream`: send a keyed answer as it arrives while recording it.
    pub fn stream(mut self, stream: bool) -> Self {
        self.policy.stream = stream;
        self
    }

    /// `on_in_flight`: what a duplicate of an in-flight request gets.
    pub fn on_in_flight(mut self, on: OnInFlight) -> Self {
        self.policy.on_in_flight = on;
        self
    }

    /// `wait_timeout`: the longest a duplicate waits.
    pub fn wait_timeout(self, timeout: Duration) -> Self {
        let value = Self::duration(timeout);
        self.set("wait_timeout", value, |p, v| p.wait_timeout = v)
    }

    /// `max_waiters`: most duplicates waiting at once.
    pub fn max_waiters(self, n: usize) -> Self {
        self.set("max_waiters", check::max_waiters(n), |p, v| {
            p.max_waiters = v
        })
    }

    /// `on_store_error`: what a keyed request gets when the store fails.
    pub fn on_store_error(mut self, on: OnStoreError) -> Self {
        self.policy.on_store_error = on;
        self
    }

    /// `key_headers`: the headers that carry the key, tried in order.
    pub fn key_headers<'a>(self, names: impl IntoIterator<Item = &'a str>) -> Self {
        let value = check::key_headers(strings(names));
        self.set("key_headers", value, |p, v| p.key_headers = v)
    }

    /// `key_from_body`: a JSON pointer to the key in a JSON body (`""`: none).
    pub fn key_from_body(self, pointer: &str) -> Self {
        let value = check::optional_pointer(pointer.to_string());
        self.set("key_from_body", value, |p, v| p.key_from_body = v)
    }

    /// `derived_key`: the JSON fields whose canonical values, with `secret`, make the key.
    pub fn derived_key<'a>(
        mut self,
        fields: impl IntoIterator<Item = &'a str>,
        secret: KeySecret,
    ) -> Self {
        self.secret = Some(secret);
        let value = check::pointers(strings(fields));
        self.set("derived_key", value, |p, v| p.derived_key = v)
    }

    /// `fingerprint`: `Exact` bytes or canonical `Json`.
    pub fn fingerprint(mut self, mode: FingerprintMode) -> Self {
        self.policy.fingerprint = mode;
        self
    }

    /// `fingerprint_ignore`: JSON pointers left out of a `Json` fingerprint.
    pub fn fingerprint_ignore<'a>(self, pointers: impl IntoIterator<Item = &'a str>) -> Self {
        let value = check::ignored_pointers(strings(pointers));
        self.set("fingerprint_ignore", value, |p, v| p.fingerprint_ignore = v)
    }

    /// `scope_cookies`: cookies whose values scope the key.
    pub fn scope_cookies<'a>(self, names: impl IntoIterator<Item = &'a str>) -> Self {
        let value = check::cookie_names(strings(names));
        self.set("scope_cookies", value, |p, v| p.scope_cookies = v)
    }

    /// `fingerprint_headers`: request headers that are part of the fingerprint.
    pub fn fingerprint_headers<'a>(self, names: impl IntoIterator<Item = &'a str>) -> Self {
        let value = check::header_names(strings(names));
        self.set("fingerprint_headers", value, |p, v| {
            p.fingerprint_headers = v
        })
    }

    /// `failure_ttl`: how long a stored 4xx is replayed.
    pub fn failure_ttl(self, ttl: impl Into<Ttl>) -> Self {
        let value = Self::lifetime(ttl);
        self.set("failure_ttl", value, |p, v| p.failure_ttl = v)
    }

    /// `max_ttl`: the longest any record lives.
    pub fn max_ttl(mut self, ttl: impl Into<Ttl>) -> Self {
        self.max_ttl_given = true;
        self.set("max_ttl", Self::lifetime(ttl), |p, v| p.max_ttl = v)
    }

    /// `replay_drop_headers`: response headers recorded but never replayed.
    pub fn replay_drop_headers<'a>(self, names: impl IntoIterator<Item = &'a str>) -> Self {
        let value = check::header_names(strings(names));
        self.set("replay_drop_headers", value, |p, v| {
            p.replay_drop_headers = v
        })
    }

    /// `expiry_header`: the header that carries a record's expiry (`""`: none).
    pub fn expiry_header(self, name: &str) -> Self {
        let value = check::optional_header_name(name.to_string());
        self.set("expiry_header", value, |p, v| p.expiry_header = v)
    }

    /// `error_format`: the shape of the gateway's own refusals and failures.
    pub fn error_format(mut self, format: ErrorFormat) -> Self {
        self.policy.error_format = format;
        self
    }

    /// `after_expiry`: what a retry gets after its key's record has expired.
    pub fn after_expiry(mut self, after: AfterExpiry) -> Self {
        self.policy.after_expiry = after;
        self
    }

    /// `tombstone_ttl`: how long a key is remembered after its record expires.
    pub fn tombstone_ttl(self, ttl: Duration) -> Self {
        let value = Self::duration(ttl);
        self.set("tombstone_ttl", value, |p, v| p.tombstone_ttl = v)
    }

    /// `repeatability`: OASIS Repeatable Requests on this route.
    pub fn repeatability(mut self, on: bool) -> Self {
        self.policy.repeatability = on;
        self
    }

    /// `upstream`: the named upstream the gateway forwards to.
    pub fn upstream(self, name: &str) -> Self {
        let value = check::upstream_name(name.to_string());
        self.set("upstream", value, |p, v| p.upstream = v)
    }

    /// The policy, or the first field refused (named as `policy.<field>`).
    pub fn build(self) -> Result<Policy, ConfigError> {
        if let Some((field, reason)) = self.refused {
            return Err(ConfigError::invalid(format!("policy.{field}"), reason));
        }
        let policy = self.policy.settle_ttls(self.max_ttl_given, "policy")?;
        policy.with_key_secret(self.secret.as_ref(), "policy")
    }
}

fn strings<'a>(items: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    items.into_iter().map(str::to_string).collect()
}
