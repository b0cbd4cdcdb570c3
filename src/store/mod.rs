//! The store of idempotency records, behind one small async trait.
//!
//! Every method is one atomic step (one Redis round trip): a claim checks and sets in one go, and
//! completing, releasing and renewing are fenced by the claim's [`Token`], so a holder whose lease
//! ran out cannot overwrite or delete what a newer holder wrote.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::ScopedKey;
use crate::idempotency::policy::Ttl;
use crate::idempotency::policy::MAX_DURATION;
use crate::idempotency::record::{now_ms, Entry, EntryState, StoredResponse, Token, Tombstone};

mod any;
pub mod cached;
pub(crate) mod codec;
pub mod embedded;
pub mod memory;
pub mod postgres;
pub mod redis;
mod seal;
mod settings;
mod watch;

pub use self::any::AnyStore;
pub use self::cached::{CachedStore, LocalCache};
pub use self::embedded::EmbeddedStore;
pub use self::memory::MemoryStore;
pub use self::postgres::{PostgresSettings, PostgresStore};
pub use self::redis::Evicted;
pub use self::redis::RedisStore;
pub use self::seal::{Seal, SealKeys, SealMode, Unreadable, SEAL_KEYS_VAR};
pub(crate) use self::settings::tls_field;
pub use self::settings::{
    redact_url, Compression, EmbeddedSettings, MemorySettings, NodeAuth, RedisSettings,
    StoreConfig, Topology,
};
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
        let ttl_ms = self.ttl.clamped().as_millis() as u64;
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

/// A store failure (unreachable, timed out, or returned something unreadable).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Redis answered with an error or the connection failed.
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// An in-process store is at `max_entries` or `max_bytes` and holds nothing it may evict
    /// (in-flight claims, and records kept forever).
    #[error("the store is full of in-flight claims or records kept forever (store.max_entries, store.max_bytes)")]
    Full,
    /// The embedded store's file could not be opened, read or written (locked by another
    /// process, disk full), or no commit came within `store.timeout`.
    #[error("embedded store: {0}")]
    Embedded(String),
    /// Fewer replicas than `wait_replicas` acknowledged a write within the timeout: a failover
    /// now could lose it.
    #[error("{acked} of {wanted} replicas acknowledged the write in time (store.wait_replicas)")]
    NotAcknowledged {
        /// Replicas that acknowledged.
        acked: i64,
        /// Replicas wanted.
        wanted: u32,
    },
    /// PostgreSQL refused, failed or did not answer in time.
    #[error("postgres: {0}")]
    Postgres(#[from] postgres::PostgresError),
    /// A stored record could not be decoded.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// A stored record could not be opened (sealing): never replayed, never run again.
    #[error(transparent)]
    Unreadable(#[from] Unreadable),
}

/// The operations the state machine needs. Implementations must make each one atomic.
pub trait Store: Clone + Send + Sync + 'static {
    /// Claim `key` as in flight for `lease` if it is free; otherwise decide from what it holds
    /// ([`Claim::decide`]). With `tombstones` (a route that refuses a retry after expiry), a key
    /// whose record has expired but whose tombstone lives is not free, and the decision comes
    /// from the tombstone ([`Claim::Expired`], or [`Claim::Mismatch`] for another request); a
    /// live record wins over its tombstone.
    fn claim_with(
        &self,
        key: &ScopedKey,
        fingerprint: &Fingerprint,
        token: &Token,
        lease: Duration,
        tombstones: bool,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// [`Store::claim_with`] without tombstones: a key whose record has expired is free.
    fn claim(
        &self,
        key: &ScopedKey,
        fingerprint: &Fingerprint,
        token: &Token,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        self.claim_with(key, fingerprint, token, lease, false)
    }

    /// [`Store::claim_with`] with tombstones: a key whose record has expired is refused while
    /// its tombstone lives.
    fn claim_unless_expired(
        &self,
        key: &ScopedKey,
        fingerprint: &Fingerprint,
        token: &Token,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        self.claim_with(key, fingerprint, token, lease, true)
    }

    /// Replace our in-flight claim with a completed entry kept as `keep` says (with the
    /// tombstone it leaves, if any, in the same atomic step). Returns `false` (and writes
    /// nothing) when the key is no longer claimed with `token`.
    fn complete(
        &self,
        key: &ScopedKey,
        fingerprint: &Fingerprint,
        token: &Token,
        state: &EntryState,
        keep: Keep,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Delete our in-flight claim so that a retry runs again. `false` when it is not ours.
    fn release(
        &self,
        key: &ScopedKey,
        token: &Token,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Extend our in-flight claim's lease. `false` when it is not ours any more.
    fn renew(
        &self,
        key: &ScopedKey,
        token: &Token,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

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
    /// Bytes the store holds for it (the encoded value for Redis, an estimate for memory).
    pub stored_bytes: usize,
}

/// Operations for operators (the admin API), not for the request path.
pub trait Inspect: Store {
    /// Whether the store answers.
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// What `key` holds: its entry, or its tombstone when its record has expired.
    fn inspect(
        &self,
        key: &ScopedKey,
    ) -> impl Future<Output = Result<Option<Inspected>, StoreError>> + Send;

    /// Delete `key` whatever its state, and its tombstone; whether either existed.
    fn evict(&self, key: &ScopedKey) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Delete every record of this gateway (under the prefix); how many.
    fn evict_all(&self) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The local cache in front of the store, if there is one: its entries and bytes.
    fn local_cache_size(&self) -> Option<(u64, u64)> {
        None
    }
}

/// Why bytes from the store could not be read as an entry.
#[derive(Debug, thiserror::Error)]
#[error("corrupt or unknown record encoding: {0}")]
pub struct DecodeError(pub(crate) &'static str);
