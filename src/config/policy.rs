//! `[defaults]` and `[[routes]]`: one table of optional policy fields, each value checked by the
//! engine's rule for it as it is read, so that a route's policy is its table merged over
//! `[defaults]`, merged over the built-in [`Policy::default`].

use http::{HeaderName, Method, StatusCode};
use serde::Deserialize;

use super::checked::{rules, Any, Checked, Lifetime, NonZero, NonZeroSize};
use super::human::HumanDuration;
use crate::idempotency::json::Pointer;
use crate::idempotency::policy::{
    check, AfterExpiry, ErrorFormat, FingerprintMode, OnInFlight, OnStoreError, Policy,
};

/// Writes the table once: the struct with its serde schema, and the merge that sets on a policy
/// the fields the table names.
macro_rules! policy_table {
    ($($field:ident: $rule:ty,)*) => {
        /// `[defaults]` or one `[[routes]]` entry, as written: every field optional, so that a
        /// table overrides only what it names. (`path` is in the same struct rather than beside
        /// a flattened policy, because serde cannot deny unknown fields through a flatten.)
        #[derive(Debug, Default, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub(super) struct PolicyTable {
            /// Only in `[[routes]]`: the path pattern.
            pub(super) path: Option<String>,
            $($field: Option<Checked<$rule>>,)*
        }

        impl PolicyTable {
            /// Whether this table sets `max_ttl`.
            pub(super) fn sets_max_ttl(&self) -> bool {
                self.max_ttl.is_some()
            }

            /// `policy` with every field this table names set to the table's value.
            pub(super) fn merged_over(&self, mut policy: Policy) -> Policy {
                $(if let Some(value) = &self.$field {
                    policy.$field = value.get().clone();
                })*
                policy
            }
        }
    };
}

// Each field with its rule; the fields' meanings are documented on [`Policy`].
policy_table! {
    methods: Methods,
    ttl: Lifetime,
    lock_ttl: LockTtl,
    require_key: Any<bool>,
    max_body: NonZeroSize,
    key_max_len: KeyMaxLen,
    scope_headers: HeaderNames,
    mismatch_status: MismatchStatus,
    cache_server_errors: Any<bool>,
    upstream_timeout: NonZero,
    on_in_flight: Any<OnInFlight>,
    wait_timeout: NonZero,
    max_waiters: MaxWaiters,
    on_store_error: Any<OnStoreError>,
    upstream: UpstreamName,
    key_headers: KeyHeaders,
    key_from_body: OptionalPointer,
    derived_key: Pointers,
    fingerprint: Any<FingerprintMode>,
    fingerprint_ignore: IgnoredPointers,
    scope_cookies: CookieNames,
    fingerprint_headers: HeaderNames,
    failure_ttl: Lifetime,
    max_ttl: Lifetime,
    replay_drop_headers: HeaderNames,
    expiry_header: OptionalHeaderName,
    error_format: Any<ErrorFormat>,
    repeatability: Any<bool>,
    after_expiry: Any<AfterExpiry>,
    tombstone_ttl: NonZero,
    stream: Any<bool>,
}

rules! {
    /// A lease of at least `Policy::MIN_LOCK_TTL`.
    LockTtl: HumanDuration => std::time::Duration = |d: HumanDuration| check::lock_ttl(d.0);
    /// HTTP methods, at least one.
    Methods: Vec<String> => Vec<Method> = check::methods;
    /// Between 1 and 8192.
    KeyMaxLen: usize => usize = check::key_max_len;
    /// At least 1.
    MaxWaiters: usize => usize = check::max_waiters;
    /// 409 or 422.
    MismatchStatus: u16 => StatusCode = check::mismatch_status;
    /// Header names.
    HeaderNames: Vec<String> => Vec<HeaderName> = check::header_names;
    /// Header names, at least one.
    KeyHeaders: Vec<String> => Vec<HeaderName> = check::key_headers;
    /// A header name, or `""` for none.
    OptionalHeaderName: String => Option<HeaderName> = check::optional_header_name;
    /// An RFC 6901 pointer, or `""` for none.
    OptionalPointer: String => Option<Pointer> = check::optional_pointer;
    /// RFC 6901 pointers.
    Pointers: Vec<String> => Vec<Pointer> = check::pointers;
    /// RFC 6901 pointers left out of a fingerprint, a bounded number.
    IgnoredPointers: Vec<String> => Vec<Pointer> = check::ignored_pointers;
    /// Cookie names.
    CookieNames: Vec<String> => Vec<String> = check::cookie_names;
    /// The name of an `[upstreams.NAME]` table.
    UpstreamName: String => String = check::upstream_name;
}
