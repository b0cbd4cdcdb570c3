//! The idempotency policy of a route: its fields, their built-in defaults, the rules their
//! values follow, and the builder, all from one list.
//!
//! `policy_fields!` is that list: each policy field once, with its doc, its type, its
//! built-in default, the rule its value follows (a unit type in `check`) and the shape of its
//! builder setter. It hands the list to a callback macro: here `policy_struct!` makes
//! [`Policy`] (field docs included), [`Policy::default`] and the [`PolicyBuilder`] setters;
//! `config/policy.rs` makes the TOML table of `[defaults]` and `[[routes]]` and its merge. The
//! list's order is the struct's, so `check-config` shows the fields in it.
//!
//! A row reads `field: Type = default, rule Rule, set<'a>(arg: ArgType) => input;`:
//! - no `rule`: the field is not in TOML and has no setter (`route`, `key_secret`);
//! - `rule` without `set`: the setter is written by hand below the list (`derived_key` also
//!   takes the secret, `max_ttl` notes it was given);
//! - `set(arg: ArgType)` gives the setter's argument to the rule as it is; `=> input` converts
//!   it first (`strings(names)`, `ttl.into()`), written in terms of `arg`.
//!
//! A rule checks what the builder gives it (a [`Duration`], a `Vec<String>` of header names);
//! the TOML reads the same through the rule, from the value as written: `config/checked.rs`
//! says, once per rule, what that is (durations, lifetimes and sizes as human strings, anything
//! else as itself).
//!
//! Adding a field: its row here, its row in docs/configuration.md and its line in
//! config/example.toml; a new rule also takes its definition in `check` and its line in
//! `config/checked.rs`.

use std::time::Duration;

use http::header::{AUTHORIZATION, SET_COOKIE};
use http::{HeaderName, Method, StatusCode};
use serde::{Deserialize, Serialize};

// The list names its rules bare; they resolve here and where config expands the list.
use check::*;

use super::json::Pointer;
pub use super::key::KeySecret;
use super::key::IDEMPOTENCY_KEY;
pub use super::webhook::{Sender, WebhookSecrets};
use crate::error::ConfigError;
pub use crate::error::ErrorFormat;

/// The key headers of a `protocol = "mcp"` route unless it names its own: the standard one, then
/// the header MCP 2026-07-28 mirrors a tool argument annotated `x-mcp-header` into.
pub const MCP_KEY_HEADERS: [&str; 2] = ["idempotency-key", "mcp-param-idempotency-key"];

/// The body keys of a `protocol = "mcp"` route unless it names its own, tried in order.
pub const MCP_KEY_POINTERS: [&str; 2] = [
    "/params/_meta/idempotencyKey",
    "/params/arguments/idempotency_key",
];

/// The name of the upstream requests go to unless their route names another.
pub const DEFAULT_UPSTREAM: &str = "default";

pub use crate::time::{Ttl, MAX_DURATION};

/// What a duplicate of an in-flight request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum OnInFlight {
    /// Answer 409 problem+json with `Retry-After` at once.
    #[default]
    Reject,
    /// Wait (up to `wait_timeout`, at most `max_waiters` at once) for the first request to finish,
    /// then answer with its replay; past either bound, the 409.
    Wait,
}

/// What a keyed request gets when the store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum OnStoreError {
    /// Fail closed: 503 problem+json with `Retry-After`; nothing is forwarded.
    #[default]
    Reject,
    /// Fail open: forward without idempotency (logged as a warning).
    Pass,
}

/// What "the same request" means for a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum FingerprintMode {
    /// The body's exact bytes.
    #[default]
    Exact,
    /// For a JSON-typed body (`application/json`, `*/*+json`), its canonical form (see
    /// docs/behaviour.md, "Canonical JSON"); other bodies by their exact bytes.
    Json,
}

/// What a retry gets once its key's record has expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum AfterExpiry {
    /// A new request: it runs again (Stripe's rule).
    #[default]
    Run,
    /// Refused with 410 for `tombstone_ttl` after the record expires; never run again.
    Refuse,
}

/// What a route's POST bodies speak (`protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Protocol {
    /// Any request: the key from a header or a JSON body, the fingerprint from the request.
    #[default]
    Http,
    /// JSON-RPC 2.0 over HTTP: calls of `keyed_methods` are keyed, one per request
    /// (docs/behaviour.md, "MCP and JSON-RPC").
    Jsonrpc,
    /// The Model Context Protocol's streamable HTTP: JSON-RPC with MCP's defaults
    /// (`keyed_methods = ["tools/call"]`, MCP's key headers and `_meta` key) and headers.
    Mcp,
}

impl Protocol {
    /// Whether the route's POST bodies are read as JSON-RPC.
    pub fn is_jsonrpc(self) -> bool {
        self != Protocol::Http
    }
}

/// The policy's fields, each once: `$callback! { rows }`, one row per field in the struct's
/// order (the row syntax is in the module doc). A callback matches the rows with the pattern
/// `policy_struct!` has.
macro_rules! policy_fields {
    ($callback:ident) => {
        $callback! {
            /// Where this policy came from: `"defaults"` or the route's path; used in logs and
            /// metrics.
            route: String = "defaults".into();
            /// Methods where idempotency applies; others pass through untouched.
            methods: Vec<Method> = vec![Method::POST, Method::PATCH], rule Methods,
                set(methods: impl IntoIterator<Item = Method>)
                    => methods.into_iter().map(|m| m.to_string()).collect();
            /// How long a completed response is replayed (a [`Duration`] or [`Ttl::Forever`]).
            ttl: Ttl = Ttl::For(Duration::from_secs(24 * 3600)), rule Lifetime,
                set(ttl: impl Into<Ttl>) => ttl.into();
            /// Lease of an in-flight claim.
            lock_ttl: Duration = Duration::from_secs(30), rule LockTtl, set(lease: Duration);
            /// Whether a request without a key is refused with 400.
            require_key: bool = false, rule Any<bool>, set(required: bool);
            /// Largest keyed request body accepted and largest response recorded for replay.
            max_body: u64 = 1024 * 1024, rule NonZeroSize, set(bytes: u64);
            /// Longest key accepted.
            key_max_len: usize = 255, rule KeyMaxLen, set(len: usize);
            /// Request headers whose values scope the key (lower-case names).
            scope_headers: Vec<HeaderName> = vec![AUTHORIZATION], rule HeaderNames,
                set<'a>(names: impl IntoIterator<Item = &'a str>) => strings(names);
            /// Status for a key reused with a different request (409 or 422).
            mismatch_status: StatusCode = StatusCode::CONFLICT, rule MismatchStatus,
                set(status: StatusCode) => status.as_u16();
            /// Store 5xx responses too (Stripe's behaviour) instead of releasing the key.
            cache_server_errors: bool = false, rule Any<bool>, set(cache: bool);
            /// How long to wait for the upstream's full response.
            upstream_timeout: Duration = Policy::DEFAULT_UPSTREAM_TIMEOUT, rule NonZero,
                set(timeout: Duration);
            /// What a duplicate of an in-flight request gets.
            on_in_flight: OnInFlight = OnInFlight::Reject, rule Any<OnInFlight>,
                set(on: OnInFlight);
            /// With `on_in_flight = "wait"`: the longest a duplicate waits.
            wait_timeout: Duration = Duration::from_secs(10), rule NonZero,
                set(timeout: Duration);
            /// With `on_in_flight = "wait"`: most duplicates waiting at once on this route.
            max_waiters: usize = 1024, rule AtLeastOne, set(n: usize);
            /// What a keyed request gets when the store is unreachable.
            on_store_error: OnStoreError = OnStoreError::Reject, rule Any<OnStoreError>,
                set(on: OnStoreError);
            /// The named upstream the gateway forwards these requests to (`[upstreams.NAME]`);
            /// a library user's inner service may read it from the `Arc<Policy>` request
            /// extension.
            upstream: String = DEFAULT_UPSTREAM.to_string(), rule UpstreamName,
                set(name: &str) => name.to_string();
            /// Request headers that carry the key, tried in order (lower-case names).
            key_headers: Vec<HeaderName> = vec![IDEMPOTENCY_KEY], rule KeyHeaders,
                set<'a>(names: impl IntoIterator<Item = &'a str>) => strings(names);
            /// Where in a JSON body the key is, when no header carries one: JSON pointers tried
            /// in order (none: nowhere).
            key_from_body: Vec<Pointer> = Vec::new(), rule BodyKeyPointers,
                set<'a>(pointers: impl IntoIterator<Item = &'a str>) => strings(pointers);
            /// Fields of a JSON body whose canonical values, with [`Policy::key_secret`], make
            /// the key (an HMAC-SHA256) when no header or body key is present.
            derived_key: Vec<Pointer> = Vec::new(), rule Pointers;
            /// The secret of derived keys; set when `derived_key` is (from
            /// `IDEMGATE_KEY_SECRET`).
            key_secret: Option<KeySecret> = None;
            /// What "the same request" means for the body.
            fingerprint: FingerprintMode = FingerprintMode::Exact, rule Any<FingerprintMode>,
                set(mode: FingerprintMode);
            /// JSON pointers left out of a `"json"` fingerprint (`*` matches any array index).
            fingerprint_ignore: Vec<Pointer> = Vec::new(), rule IgnoredPointers,
                set<'a>(pointers: impl IntoIterator<Item = &'a str>) => strings(pointers);
            /// Cookies whose values scope the key, like `scope_headers`.
            scope_cookies: Vec<String> = Vec::new(), rule CookieNames,
                set<'a>(names: impl IntoIterator<Item = &'a str>) => strings(names);
            /// Request headers that are part of the fingerprint.
            fingerprint_headers: Vec<HeaderName> = Vec::new(), rule HeaderNames,
                set<'a>(names: impl IntoIterator<Item = &'a str>) => strings(names);
            /// How long a stored 4xx (or, with `cache_server_errors`, 5xx) response is
            /// replayed.
            failure_ttl: Ttl = Ttl::For(Duration::from_secs(24 * 3600)), rule Lifetime,
                set(ttl: impl Into<Ttl>) => ttl.into();
            /// The longest any record lives: `ttl`, `failure_ttl` and an upstream's
            /// `Idempotency-Control: max-age` are bounded by it. Forever when `ttl` or
            /// `failure_ttl` is and no `max_ttl` was given.
            max_ttl: Ttl = Ttl::For(Duration::from_secs(7 * 24 * 3600)), rule Lifetime;
            /// Response headers recorded but never replayed.
            replay_drop_headers: Vec<HeaderName> = vec![SET_COOKIE], rule HeaderNames,
                set<'a>(names: impl IntoIterator<Item = &'a str>) => strings(names);
            /// If set, every recorded or replayed answer carries this header with the record's
            /// expiry (`""`: none).
            expiry_header: Option<HeaderName> = None, rule OptionalHeaderName,
                set(name: &str) => name.to_string();
            /// The shape of the gateway's own refusals and failures on this route.
            error_format: ErrorFormat = ErrorFormat::Problem, rule Any<ErrorFormat>,
                set(format: ErrorFormat);
            /// What a retry gets after its key's record has expired.
            after_expiry: AfterExpiry = AfterExpiry::Run, rule Any<AfterExpiry>,
                set(after: AfterExpiry);
            /// With `after_expiry = "refuse"`: how long a key is remembered after its record
            /// expires.
            tombstone_ttl: Duration = Duration::from_secs(30 * 24 * 3600), rule NonZero,
                set(ttl: Duration);
            /// OASIS Repeatable Requests: the key from `Repeatability-Request-ID`, scoped by
            /// `Repeatability-Client-ID`, with `Repeatability-First-Sent` checked against
            /// `ttl`.
            repeatability: bool = false, rule Any<bool>, set(on: bool);
            /// Send a keyed answer to the client as it arrives while recording it, instead of
            /// buffering it whole first; with `on_in_flight = "wait"`, duplicates attach to the
            /// live answer.
            stream: bool = false, rule Any<bool>, set(stream: bool);
            /// A webhook route: the sender whose signature every delivery must carry, its event
            /// id the key (docs/behaviour.md, "Webhooks"); none by default.
            webhook: Option<Sender> = None, rule OptionalSender;
            /// With `webhook`: the environment variable holding its secret(s).
            webhook_secret_env: Option<String> = None, rule OptionalVarName;
            /// With `webhook`: the secrets read from `webhook_secret_env` (never printed).
            webhook_secrets: Option<WebhookSecrets> = None;
            /// With `webhook`: the accepted age (and skew) of a delivery's signed timestamp.
            webhook_tolerance: Duration = Duration::from_secs(300), rule NonZero,
                set(tolerance: Duration);
            /// What the route's POST bodies speak: plain HTTP, JSON-RPC 2.0, or MCP (JSON-RPC on
            /// streamable HTTP, with MCP's defaults for `key_headers` and `key_from_body`).
            protocol: Protocol = Protocol::Http, rule Any<Protocol>, set(protocol: Protocol);
            /// On a `jsonrpc` or `mcp` route: the JSON-RPC methods whose calls are keyed (empty:
            /// every method; `mcp` takes `["tools/call"]` unless given).
            keyed_methods: Vec<String> = Vec::new(), rule MethodNames,
                set<'a>(names: impl IntoIterator<Item = &'a str>) => strings(names);
        }
    };
}
pub(crate) use policy_fields;

/// Makes, from the rows of [`policy_fields!`], [`Policy`] with its built-in defaults and the
/// setters of [`PolicyBuilder`] for the rows that have `set`.
macro_rules! policy_struct {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident: $ty:ty = $default:expr
        $(, rule $rule:ty $(, set $(<$lt:lifetime>)? ($arg:ident: $arg_ty:ty) $(=> $input:expr)?)?)?;
    )*) => {
        /// The effective idempotency policy of one route: `[defaults]` merged over the built-in
        /// defaults, then the route's own fields merged over that.
        /// New fields come with new features: build one with [`Policy::builder`] or from
        /// [`Policy::default`].
        #[derive(Debug, Clone, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct Policy {
            $($(#[doc = $doc])* pub $field: $ty,)*
        }

        impl Policy {
            fn builtin() -> Self {
                Policy { $($field: $default,)* }
            }
        }

        impl PolicyBuilder {
            $($($(
                #[doc = concat!("`", stringify!($field), "`: sets [`Policy::", stringify!($field),
                    "`], checked as the TOML's is.")]
                pub fn $field $(<$lt>)? (self, $arg: $arg_ty) -> Self {
                    $(let $arg = $input;)?
                    self.set(stringify!($field), <$rule as Rule>::check($arg), |p, v| p.$field = v)
                }
            )?)?)*
        }
    };
}

policy_fields!(policy_struct);

impl Policy {
    /// The built-in `upstream_timeout`.
    pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);

    /// The shortest `lock_ttl`: the lease is renewed every third of it, and a renewal takes a
    /// store round trip and a timer tick (a millisecond), so a lease of a few milliseconds
    /// would run out before it could be renewed.
    pub const MIN_LOCK_TTL: Duration = Duration::from_millis(30);

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

    /// Whether the policy holds `keyed_methods` that its protocol never reads (it is not
    /// JSON-RPC): a route may not name them, as they would do nothing.
    pub(crate) fn keyed_methods_unread(&self) -> bool {
        !self.keyed_methods.is_empty() && !self.protocol.is_jsonrpc()
    }

    /// Whether a request without a key header may carry its key in the body (a JSON-RPC
    /// route reads every POST body: whether it is keyed is in it).
    pub fn keys_from_body(&self) -> bool {
        !self.key_from_body.is_empty() || self.key_secret.is_some() || self.protocol.is_jsonrpc()
    }

    /// The defaults `protocol = "mcp"` gives the fields a configuration did not name
    /// (`given` says which it named): MCP's key headers, `_meta` key and keyed methods.
    pub(crate) fn with_protocol_defaults(mut self, given: impl Fn(&str) -> bool) -> Self {
        if self.protocol != Protocol::Mcp {
            return self;
        }
        if !given("key_headers") {
            self.key_headers = MCP_KEY_HEADERS.map(HeaderName::from_static).to_vec();
        }
        if !given("key_from_body") {
            self.key_from_body = MCP_KEY_POINTERS
                .iter()
                .filter_map(|p| Pointer::parse(p).ok())
                .collect();
        }
        if !given("keyed_methods") {
            self.keyed_methods = vec!["tools/call".to_string()];
        }
        self
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
    use std::marker::PhantomData;
    use std::time::Duration;

    use http::{HeaderName, Method, StatusCode};

    use super::super::json::{Pointer, MAX_IGNORED};
    use super::super::webhook::Sender;
    use super::{Ttl, MAX_DURATION};

    /// A rule for one kind of value: what it reads, what it makes of it, and why it may refuse.
    pub(crate) trait Rule {
        /// The value as given to the builder (the TOML reads it from its written form).
        type Input;
        /// The value as the policy holds it.
        type Value;
        /// `input` as a value, or the reason it is refused.
        fn check(input: Self::Input) -> Result<Self::Value, String>;
    }

    /// Any value of `T`, as given.
    pub(crate) struct Any<T>(PhantomData<T>);

    impl<T> Rule for Any<T> {
        type Input = T;
        type Value = T;
        fn check(input: T) -> Result<T, String> {
            Ok(input)
        }
    }

    /// Defines rules as `Name: Input => Value = check;`, each a unit type; `check` is a function
    /// or a closure.
    macro_rules! rules {
        ($($(#[$doc:meta])* $name:ident: $input:ty => $value:ty = $check:expr;)*) => {$(
            $(#[$doc])*
            pub(crate) struct $name;

            impl Rule for $name {
                type Input = $input;
                type Value = $value;
                fn check(input: $input) -> Result<$value, String> {
                    let check: fn($input) -> Result<$value, String> = $check;
                    check(input)
                }
            }
        )*};
    }

    rules! {
        /// A duration greater than zero, once clamped to [`MAX_DURATION`] as a written one is.
        NonZero: Duration => Duration = |d| match d.min(MAX_DURATION) {
            d if d.is_zero() => Err("must be greater than zero".into()),
            d => Ok(d),
        };
        /// A lease: a duration as [`NonZero`] has it, at least [`Policy::MIN_LOCK_TTL`](super::Policy::MIN_LOCK_TTL).
        LockTtl: Duration => Duration = |d| match d.min(MAX_DURATION) {
            d if d < super::Policy::MIN_LOCK_TTL => Err(format!(
                "must be at least {:?}: the lease is renewed every third of it, so a shorter one runs out before it can be renewed",
                super::Policy::MIN_LOCK_TTL
            )),
            d => Ok(d),
        };
        /// A record lifetime: a duration as [`NonZero`] has it, or forever.
        Lifetime: Ttl => Ttl = |ttl| match ttl {
            Ttl::For(d) => NonZero::check(d).map(Ttl::For),
            Ttl::Forever => Ok(ttl),
        };
        /// A size greater than zero.
        NonZeroSize: u64 => u64 = |bytes| match bytes {
            0 => Err("must be greater than zero".into()),
            n => Ok(n),
        };
        /// A count of at least 1.
        AtLeastOne: usize => usize = |n| match n {
            0 => Err("must be at least 1".into()),
            n => Ok(n),
        };
        /// A key length between 1 and 8192.
        KeyMaxLen: usize => usize = |len| match len {
            1..=8192 => Ok(len),
            _ => Err("must be between 1 and 8192".into()),
        };
        /// 409 or 422.
        MismatchStatus: u16 => StatusCode = |status| match status {
            409 => Ok(StatusCode::CONFLICT),
            422 => Ok(StatusCode::UNPROCESSABLE_ENTITY),
            _ => Err("must be 409 or 422".into()),
        };
        /// HTTP methods, at least one, any case.
        Methods: Vec<String> => Vec<Method> = |names| {
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
        };
        /// Header names, lower-cased.
        HeaderNames: Vec<String> => Vec<HeaderName> = |names| {
            names
                .iter()
                .map(|n| {
                    HeaderName::from_bytes(n.trim().to_ascii_lowercase().as_bytes())
                        .map_err(|_| format!("{n:?} is not a header name"))
                })
                .collect()
        };
        /// Header names, at least one.
        KeyHeaders: Vec<String> => Vec<HeaderName> = |names| match names.is_empty() {
            true => Err("must name at least one header".into()),
            false => HeaderNames::check(names),
        };
        /// A header name, or `""` for none.
        OptionalHeaderName: String => Option<HeaderName> = |name| match name.trim() {
            "" => Ok(None),
            n => Ok(HeaderNames::check(vec![n.to_string()])?.pop()),
        };
        /// RFC 6901 pointers tried in order (`""` among them: none).
        BodyKeyPointers: Vec<String> => Vec<Pointer> = |texts| {
            texts.iter().filter(|t| !t.is_empty()).map(|t| Pointer::parse(t)).collect()
        };
        /// JSON-RPC method names, none empty.
        MethodNames: Vec<String> => Vec<String> = |names| match names.iter().find(|n| n.is_empty()) {
            Some(_) => Err("a method name cannot be empty".into()),
            None => Ok(names),
        };
        /// RFC 6901 pointers.
        Pointers: Vec<String> => Vec<Pointer> = |texts| {
            texts.iter().map(|t| Pointer::parse(t)).collect()
        };
        /// Pointers left out of a fingerprint (`*` for any array index), at most
        /// [`MAX_IGNORED`].
        IgnoredPointers: Vec<String> => Vec<Pointer> = |texts| match texts.len() > MAX_IGNORED {
            true => Err(format!("at most {MAX_IGNORED} pointers")),
            false => Pointers::check(texts),
        };
        /// Cookie names (RFC 6265 tokens).
        CookieNames: Vec<String> => Vec<String> = |names| {
            let token = |c: &String| {
                !c.is_empty()
                    && c.bytes()
                        .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b))
            };
            match names.iter().find(|c| !token(c)) {
                Some(bad) => Err(format!("{bad:?} is not a cookie name")),
                None => Ok(names),
            }
        };
        /// A webhook sender (`"standard"`, `"stripe"`, `"github"`), or `""` for none.
        OptionalSender: String => Option<Sender> = |name| match name.trim() {
            "" => Ok(None),
            "standard" => Ok(Some(Sender::Standard)),
            "stripe" => Ok(Some(Sender::Stripe)),
            "github" => Ok(Some(Sender::Github)),
            other => Err(format!(
                "{other:?} is not a webhook sender (\"standard\", \"stripe\" or \"github\")"
            )),
        };
        /// The name of an environment variable, or `""` for none.
        OptionalVarName: String => Option<String> = |name| match name.trim() {
            "" => Ok(None),
            n if n.contains(['=', '\0']) => Err(format!("{n:?} is not a variable name")),
            n => Ok(Some(n.to_string())),
        };
        /// The name of an `[upstreams.NAME]` table.
        UpstreamName: String => String = |name| {
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
        };
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
    // The fields set, for the defaults a protocol gives the others.
    given: Vec<&'static str>,
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
        self.given.push(field);
        match value {
            Ok(value) => put(&mut self.policy, value),
            Err(reason) => {
                self.refused.get_or_insert((field, reason));
            }
        }
        self
    }

    // The setters the list does not make: these two also keep what the policy alone cannot.

    /// `derived_key`: the JSON fields whose canonical values, with `secret`, make the key.
    pub fn derived_key<'a>(
        mut self,
        fields: impl IntoIterator<Item = &'a str>,
        secret: KeySecret,
    ) -> Self {
        self.secret = Some(secret);
        let value = Pointers::check(strings(fields));
        self.set("derived_key", value, |p, v| p.derived_key = v)
    }

    /// `webhook`: check every delivery's signature as `sender` writes it, with any of
    /// `secrets`, and key it by its event id; `ttl` becomes at least
    /// [`WEBHOOK_TTL`](super::webhook::WEBHOOK_TTL) (a later `ttl` sets it).
    pub fn webhook(mut self, sender: Sender, secrets: WebhookSecrets) -> Self {
        self.policy.webhook = Some(sender);
        self.policy.webhook_secrets = Some(secrets);
        self.policy.ttl = self.policy.ttl.max(Ttl::For(super::webhook::WEBHOOK_TTL));
        self
    }

    /// `max_ttl`: the longest any record lives.
    pub fn max_ttl(mut self, ttl: impl Into<Ttl>) -> Self {
        self.max_ttl_given = true;
        self.set("max_ttl", Lifetime::check(ttl.into()), |p, v| p.max_ttl = v)
    }

    /// The policy, or the first field refused (named as `policy.<field>`).
    pub fn build(self) -> Result<Policy, ConfigError> {
        if let Some((field, reason)) = self.refused {
            return Err(ConfigError::invalid(format!("policy.{field}"), reason));
        }
        let given = self.given;
        let policy = self.policy.with_protocol_defaults(|f| given.contains(&f));
        let policy = policy.settle_ttls(self.max_ttl_given, "policy")?;
        policy.with_key_secret(self.secret.as_ref(), "policy")
    }
}

fn strings<'a>(items: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    items.into_iter().map(str::to_string).collect()
}
