//! The store of idempotency records, behind one small async trait.
//!
//! Every method is one atomic step on every backend (one round trip to Redis or PostgreSQL, one
//! transaction of the embedded file, one lock of the memory map): a claim checks and sets in one
//! go, and completing, releasing and renewing are fenced by the claim's [`Token`], so a holder
//! whose lease ran out cannot overwrite or delete what a newer holder wrote.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::record::fingerprint::Fingerprint;
use crate::record::key::ScopedKey;
use crate::record::policy::AfterExpiry;
use crate::record::{now_ms, Entry, EntryState, StoredResponse, Token, Tombstone};
use crate::time::{Ttl, MAX_DURATION};

mod any;
pub mod cached;
pub(crate) mod codec;
pub mod embedded;
mod error;
pub mod memory;
mod metrics;
pub mod postgres;
pub mod redis;
mod seal;
mod settings;
mod watch;

pub use self::any::AnyStore;
pub use self::cached::{CachedStore, LocalCache};
pub use self::embedded::{EmbeddedSettings, EmbeddedStore};
pub use self::error::{BackendError, DecodeError, StoreError, StoreResult};
pub use self::memory::{MemorySettings, MemoryStore};
pub use self::metrics::{Evictions, StoreMetrics};
pub use self::postgres::{PostgresSettings, PostgresStore};
pub use self::redis::Evicted;
pub use self::redis::RedisStore;
pub use self::redis::{Compression, NodeAuth, RedisSettings, Topology};
pub use self::seal::{Seal, SealKeys, SealMode, Unreadable, SEAL_KEYS_VAR};
pub(crate) use self::settings::tls_field;
pub(crate) use self::settings::{has_redacted_password, redact_url_as, REDACTED_REFUSED};
pub use self::settings::{redact_url, LocalCacheSettings, StoreConfig, TlsFiles, REDACTED};
pub use self::watch::Watch;

/// What a claim decides for a request: the store's answer, computed by [`Claim::decide`] from
/// the entry the key holds and the request's fingerprint, the one place that decision is made.
#[derive(Debug, Clone)]
pub enum Claim {
    /// The key was free (or expired) and is now ours, in flight, for the lease.
    Claimed,
    /// Completed by an identical request: replay its response.
    Replay(Replay),
    /// An identical request holds the key and is still running.
    InFlight,
    /// Completed by an identical request whose response was too large to keep.
    NotReplayable,
    /// The key belongs to a different request (whatever its state: a misuse of the key wins over
    /// "in flight").
    Mismatch,
    /// The key's record expired and left a tombstone (`after_expiry = "refuse"`): an identical
    /// request is refused, never run again.
    Expired {
        /// What the tombstone remembers.
        tombstone: Tombstone,
        /// When the record was written, in ms since the Unix epoch.
        recorded_ms: u64,
    },
}

/// How long a completed record is kept, and whether it leaves a tombstone when it expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keep {
    /// How long the record is replayed.
    pub ttl: Ttl,
    /// With `after_expiry = "refuse"`: how long the key is remembered after its record expires.
    pub tombstone: Option<Duration>,
}

impl Keep {
    /// How long from now the record's tombstone lives, when it leaves one (a record kept
    /// forever never does).
    pub fn tombstone_lives(self) -> Option<Duration> {
        match (self.ttl, self.tombstone) {
            (Ttl::For(ttl), Some(after)) => Some(ttl.saturating_add(after).min(MAX_DURATION)),
            _ => None,
        }
    }

    /// The tombstone entry a record of `fingerprint` in `state`, written now, leaves, with how
    /// long from now it lives; `None` when it leaves none.
    pub fn tombstone_of(
        self,
        fingerprint: &Fingerprint,
        state: &EntryState,
    ) -> Option<(Entry, Duration)> {
        let lives = self.tombstone_lives()?;
        let written_ms = now_ms();
        let ttl_ms = crate::time::millis(self.ttl.clamped());
        let tombstone = Tombstone::of(state, written_ms, ttl_ms)?;
        let entry = Entry {
            fingerprint: *fingerprint,
            state: EntryState::Expired(tombstone),
            expires_in: Some(lives),
            written_ms,
        };
        Some((entry, lives))
    }
}

impl From<Ttl> for Keep {
    fn from(ttl: Ttl) -> Self {
        Keep {
            ttl,
            tombstone: None,
        }
    }
}

impl From<Duration> for Keep {
    fn from(ttl: Duration) -> Self {
        Ttl::For(ttl).into()
    }
}

/// A completed response to replay.
#[derive(Debug, Clone)]
pub struct Replay {
    /// The response, byte for byte.
    pub response: Arc<StoredResponse>,
    /// How much longer the store keeps it, when the store said.
    pub expires_in: Option<Duration>,
}

impl Claim {
    /// The decision for a request with `fingerprint` claiming with `token` a key that holds
    /// `held` (written by the claim whose token is `holder`).
    pub fn decide(held: Entry, holder: &Token, fingerprint: &Fingerprint, token: &Token) -> Self {
        match held.state {
            // Our own claim, applied although its answer was lost and the call retried.
            EntryState::InFlight if holder == token => Claim::Claimed,
            _ if held.fingerprint != *fingerprint => Claim::Mismatch,
            EntryState::InFlight => Claim::InFlight,
            EntryState::NotReplayable => Claim::NotReplayable,
            EntryState::Completed(response) => Claim::Replay(Replay {
                response,
                expires_in: held.expires_in,
            }),
            EntryState::Expired(tombstone) => Claim::Expired {
                tombstone,
                recorded_ms: held.written_ms,
            },
        }
    }
}

/// Who claims a key, or holds its claim: the key, the fingerprint of the request, and the
/// claim's fencing token. Every store operation on a claim names its claimant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claimant {
    /// The scoped key.
    pub key: ScopedKey,
    /// The request's fingerprint, kept with the claim and its record.
    pub fingerprint: Fingerprint,
    /// The claim's random token: whoever completes, renews or releases must present it.
    pub token: Token,
}

/// The terms a key is claimed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimTerms {
    /// How long the claim holds the key unless renewed.
    pub lease: Duration,
    /// What an expired record's key means: with [`AfterExpiry::Refuse`], a key whose record has
    /// expired but whose tombstone lives is not free.
    pub after_expiry: AfterExpiry,
}

impl ClaimTerms {
    /// A claim for `lease`, on a key that is free again once its record expires.
    pub fn lease(lease: Duration) -> Self {
        ClaimTerms {
            lease,
            after_expiry: AfterExpiry::Run,
        }
    }

    /// These terms on a key whose expired record's tombstone refuses it (`Refuse`) or not.
    pub fn after_expiry(self, after_expiry: AfterExpiry) -> Self {
        ClaimTerms {
            after_expiry,
            ..self
        }
    }
}

impl Claimant {
    /// The claimant of `key` with `fingerprint`, whose claim's token is `token`.
    pub fn new(key: ScopedKey, fingerprint: Fingerprint, token: Token) -> Self {
        Claimant {
            key,
            fingerprint,
            token,
        }
    }
}

/// The operations the state machine needs: the store contract. Implementations make each one
/// atomic, and every one of them answers as this contract says, on every backend (the model in
/// `tests/store_model.rs` holds them to it).
///
/// A key holds at most one live entry (an in-flight claim, or a completed record), and, on
/// routes that refuse a retry after expiry, a tombstone beside it that outlives the record. An
/// entry is live until its lease or ttl ends; a lapsed one is as good as absent.
pub trait Store: Clone + Send + Sync + 'static {
    /// Claim the key for `who` as in flight for `terms.lease` if it is free; otherwise decide
    /// from what it holds ([`Claim::decide`]): a live record or claim first, then (with
    /// [`AfterExpiry::Refuse`]) a live tombstone ([`Claim::Expired`], or [`Claim::Mismatch`] for
    /// another request). [`StoreError::Full`] when a bounded store has no room for the claim.
    fn claim(
        &self,
        who: &Claimant,
        terms: ClaimTerms,
    ) -> impl Future<Output = StoreResult<Claim>> + Send;

    /// Record `state` for `who`, kept as `keep` says (with the tombstone it leaves, if any, in
    /// the same atomic step). Written when the key holds `who`'s claim, and also when it holds
    /// nothing live (the claim's lease ran out, typically while the store could not be
    /// reached, and no newer claim took the key meanwhile: fencing forbids overwriting a newer
    /// claim, not writing where nobody else did), unless a live tombstone says another record
    /// was there. `who`'s own completion already there counts as written (a retried call whose
    /// answer was lost) and is left as it is. `false`, and nothing written, when another claim
    /// or record holds the key.
    fn complete(
        &self,
        who: &Claimant,
        state: &EntryState,
        keep: Keep,
    ) -> impl Future<Output = StoreResult<bool>> + Send;

    /// Delete `who`'s live in-flight claim so that a retry runs at once. `false` when the key
    /// holds no live claim of `who`'s.
    fn release(&self, who: &Claimant) -> impl Future<Output = StoreResult<bool>> + Send;

    /// Extend `who`'s live in-flight claim to `lease` from now. `false` when the key holds no
    /// live claim of `who`'s (its lease ran out: it is not taken again, since a renewal that
    /// arrives after the holder's own release must not claim the key for nobody).
    fn renew(
        &self,
        who: &Claimant,
        lease: Duration,
    ) -> impl Future<Output = StoreResult<bool>> + Send;

    /// Tell a request waiting for `key` when it was completed or released, so that it looks
    /// again at once; `None` when the store cannot (the waiter polls).
    fn watch(&self, key: &ScopedKey) -> impl Future<Output = Option<Watch>> + Send {
        let _ = key;
        async { None }
    }
}

/// What the admin API shows of a key.
#[derive(Debug, Clone)]
pub struct Inspected {
    /// The entry (state, fingerprint, response, written time).
    pub entry: Entry,
    /// How long the store keeps it.
    pub expires_in: Option<Duration>,
    /// Bytes the store holds for it (the encoded record for the embedded, Redis and PostgreSQL
    /// stores; an estimate for memory).
    pub stored_bytes: usize,
}

/// Operations for operators (the admin API), not for the request path.
pub trait Inspect: Store {
    /// Whether the store answers.
    fn ping(&self) -> impl Future<Output = StoreResult<()>> + Send;

    /// What `key` holds: its entry, or its tombstone when its record has expired.
    fn inspect(
        &self,
        key: &ScopedKey,
    ) -> impl Future<Output = StoreResult<Option<Inspected>>> + Send;

    /// Delete `key` whatever its state, and its tombstone; whether either was live (a lapsed
    /// one is as good as absent).
    fn evict(&self, key: &ScopedKey) -> impl Future<Output = StoreResult<bool>> + Send;

    /// Delete every record of this gateway (under the prefix); how many.
    fn evict_all(&self) -> impl Future<Output = StoreResult<u64>> + Send;

    /// The local cache in front of the store, if there is one: its entries and bytes.
    fn local_cache_size(&self) -> Option<(u64, u64)> {
        None
    }
}
