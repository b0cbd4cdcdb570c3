//! The in-memory store: a map in this process. Zero setup; lost when the process exits.
//!
//! Bounded twice: by `max_entries` and by `max_bytes` of stored responses. Past either bound the
//! completed records closest to expiry are evicted, one by one as room is needed (an index by
//! expiry finds them, so no operation scans the map); in-flight claims and records kept forever
//! never are. When only those remain, a new claim is refused ([`StoreError::Full`]) rather than
//! the map growing without bound.
//!
//! A record kept forever (`Ttl::Forever`: the library may ask it, the configuration refuses it
//! for this store, which a restart empties) has no expiry: it stays until an operator evicts it.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use super::{Claim, ClaimTerms, Claimant, Keep, Store, StoreError, StoreResult};
use crate::record::key::ScopedKey;
use crate::record::policy::AfterExpiry;
use crate::record::{now_ms, Entry, EntryState, Token};
use crate::store::Evictions;
use crate::time;

mod settings;

pub use self::settings::{MemorySettings, DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES};

/// A handle to the memory store; clones share one map. Expired entries are dropped every
/// [`PURGE_EVERY`] by a task the store owns, stopped when the last handle goes (made outside a
/// tokio runtime, the store has no such task: expired entries are then dropped only when room is
/// needed, and ignored on access all the same).
#[derive(Debug, Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
    // Aborts the purge task when the last handle is dropped; the task holds only a weak reference.
    _purger: Option<Arc<AbortOnDropHandle<()>>>,
}

/// How often the store drops expired entries.
pub const PURGE_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug)]
struct Shared {
    // A std Mutex, not tokio's: no critical section awaits, each is a few map operations, and a
    // std lock is cheaper on this hot path (as mini-redis argues for its `Db`).
    table: Mutex<Table>,
}

/// Slots by expiry.
type Index = BTreeSet<(Instant, ScopedKey)>;

#[derive(Debug, Default)]
struct Table {
    map: HashMap<ScopedKey, Slot>,
    // Sum of the slots' weights, kept in step with `map`.
    bytes: u64,
    // The slots by expiry, claims and completed records apart (each slot that expires in one of
    // the two, kept in step with `map`; a record kept forever in neither): purging pops the
    // fronts, making room pops the records' front, so no operation scans the map under the lock
    // that every worker shares.
    claims: Index,
    records: Index,
    // Where records evicted for room are counted.
    evictions: Evictions,
    // Most slots kept.
    max_entries: usize,
    // Most bytes of stored responses kept.
    max_bytes: u64,
}

#[derive(Debug)]
struct Slot {
    // The token of the claim that wrote this slot; fences complete/release/renew.
    token: Token,
    // The entry as the state machine sees it.
    entry: Entry,
    // When the slot stops existing (lease end for a claim, TTL end for a completed record);
    // `None` for a record kept forever, which only an eviction removes.
    expires_at: Option<Instant>,
}

/// What an entry costs besides its response: its map bucket and its place in the expiry index
/// (checked against the types' sizes by a test).
const SLOT_OVERHEAD: u64 = 224;

impl Slot {
    /// Whether the slot is live at `now`: not past its lease or ttl.
    fn live(&self, now: Instant) -> bool {
        self.expires_at.is_none_or(|at| at > now)
    }

    /// How long it has left after `now` (`None`: kept forever).
    fn left(&self, now: Instant) -> Option<Duration> {
        self.expires_at.map(|at| at - now)
    }

    /// What the slot costs, roughly: a fixed overhead plus the stored response.
    fn weight(&self) -> u64 {
        let response = match &self.entry.state {
            EntryState::Completed(r) => {
                r.body.len()
                    + r.headers
                        .iter()
                        .map(|(n, v)| n.as_str().len() + v.len() + 16)
                        .sum::<usize>()
            }
            _ => 0,
        };
        SLOT_OVERHEAD + response as u64
    }
}

impl Table {
    /// The index a slot is in, with its row; none for a record kept forever.
    fn index(&mut self, key: ScopedKey, slot: &Slot) -> Option<(&mut Index, (Instant, ScopedKey))> {
        let row = (slot.expires_at?, key);
        match slot.entry.state {
            EntryState::InFlight => Some((&mut self.claims, row)),
            _ => Some((&mut self.records, row)),
        }
    }

    fn insert(&mut self, key: ScopedKey, slot: Slot) {
        self.remove(&key);
        self.bytes += slot.weight();
        if let Some((index, row)) = self.index(key, &slot) {
            index.insert(row);
        }
        self.map.insert(key, slot);
    }

    fn remove(&mut self, key: &ScopedKey) -> Option<Slot> {
        let slot = self.map.remove(key)?;
        self.bytes -= slot.weight();
        if let Some((index, row)) = self.index(*key, &slot) {
            index.remove(&row);
        }
        Some(slot)
    }

    /// Move a slot's expiry (a renewed lease), in the index too.
    fn extend(&mut self, key: &ScopedKey, expires_at: Instant) {
        if let Some(mut slot) = self.remove(key) {
            slot.expires_at = Some(expires_at);
            self.insert(*key, slot);
        }
    }

    /// The live slot of `key`: not past its lease or ttl.
    fn live(&self, key: &ScopedKey, now: Instant) -> Option<&Slot> {
        self.map.get(key).filter(|s| s.live(now))
    }

    /// Whether `key` is a live in-flight claim made with `token`.
    fn claimed_by(&self, key: &ScopedKey, token: &Token, now: Instant) -> bool {
        matches!(self.live(key, now), Some(s) if s.token == *token && matches!(s.entry.state, EntryState::InFlight))
    }

    fn purge_expired(&mut self, now: Instant) {
        while let Some(&(at, key)) = self.claims.first() {
            if at > now {
                break;
            }
            self.remove(&key);
        }
        while let Some(&(at, key)) = self.records.first() {
            if at > now {
                break;
            }
            self.remove(&key);
        }
    }

    /// Bring the table under both bounds (leaving room for one more entry when `adding`):
    /// expired slots first, then the completed records closest to expiry (never a claim or a
    /// record kept forever). A claim is refused when the table stays over a bound.
    fn make_room(&mut self, adding: bool, now: Instant) -> Result<(), StoreError> {
        let (max_entries, max_bytes) = (self.max_entries, self.max_bytes);
        let over =
            |t: &Table| t.map.len() + usize::from(adding) > max_entries || t.bytes > max_bytes;
        if !over(self) {
            return Ok(());
        }
        self.purge_expired(now);
        let mut evicted = 0;
        while over(self) {
            let Some(&(_, key)) = self.records.first() else {
                break;
            };
            let for_entries = self.map.len() + usize::from(adding) > max_entries;
            let gone = self.remove(&key);
            // A record evicted before its ttl takes its tombstone along: its key was not
            // expired, so a retry runs again rather than being refused as expired.
            if gone.is_some_and(|slot| !matches!(slot.entry.state, EntryState::Expired(_))) {
                self.remove(&key.tombstone());
            }
            self.evictions.count(for_entries, 1);
            evicted += 1;
        }
        if evicted > 0 {
            tracing::debug!(
                evicted,
                "memory store at its bounds; evicted completed records"
            );
        }
        if adding && over(self) {
            return Err(StoreError::Full);
        }
        Ok(())
    }
}

/// When an entry written at `now` for `d` ends: `d` in whole milliseconds, at least one, as
/// every other store reckons it (so a zero lease or ttl lives a millisecond here too).
fn until(now: Instant, d: Duration) -> Instant {
    time::after(now, Duration::from_millis(time::millis(d)))
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::with_limits(DEFAULT_MAX_ENTRIES, DEFAULT_MAX_BYTES)
    }
}

impl MemoryStore {
    /// An empty store with the default bounds ([`DEFAULT_MAX_ENTRIES`], [`DEFAULT_MAX_BYTES`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store holding at most `max_entries` entries and `max_bytes` of responses.
    pub fn with_limits(max_entries: usize, max_bytes: u64) -> Self {
        Self::with_limits_counted(max_entries, max_bytes, Evictions::default())
    }

    /// [`with_limits`](Self::with_limits), counting the records it evicts for room into
    /// `evictions` (the gateway's `idemgate_store_evictions_total`).
    pub fn with_limits_counted(max_entries: usize, max_bytes: u64, evictions: Evictions) -> Self {
        let shared = Arc::new(Shared {
            // Sized for the bound up front (up to a million slots): growing by doubling would
            // rehash the whole map under the lock every worker shares. Untouched pages cost
            // address space only.
            table: Mutex::new(Table {
                map: HashMap::with_capacity(max_entries.clamp(1, 1 << 20)),
                evictions,
                max_entries: max_entries.max(1),
                max_bytes: max_bytes.max(1),
                ..Table::default()
            }),
        });
        let purger = tokio::runtime::Handle::try_current().ok().map(|rt| {
            let weak = Arc::downgrade(&shared);
            Arc::new(AbortOnDropHandle::new(rt.spawn(async move {
                let mut tick = tokio::time::interval(PURGE_EVERY);
                loop {
                    tick.tick().await;
                    let Some(shared) = weak.upgrade() else { return };
                    MemoryStore::lock_table(&shared).purge_expired(Instant::now());
                }
            })))
        });
        MemoryStore {
            shared,
            _purger: purger,
        }
    }

    /// Drop every expired slot. Expired slots are also ignored on access, so this only bounds
    /// memory; the store's own task calls it every [`PURGE_EVERY`].
    pub fn purge_expired(&self) {
        self.lock().purge_expired(Instant::now());
    }

    /// Drop every slot (the admin API's emergency switch, and tests).
    pub fn purge_all(&self) -> usize {
        let mut t = self.lock();
        let n = t.map.len();
        t.map.clear();
        t.claims.clear();
        t.records.clear();
        t.bytes = 0;
        n
    }

    /// Drop one slot, whatever its state; whether there was one.
    pub fn remove(&self, key: &ScopedKey) -> bool {
        self.lock().remove(key).is_some()
    }

    /// The live entry of `key` and how long it has left (`None`: kept forever).
    pub fn get(&self, key: &ScopedKey) -> Option<(Entry, Option<Duration>)> {
        let now = Instant::now();
        let t = self.lock();
        let slot = t.live(key, now)?;
        Some((slot.entry.clone(), slot.left(now)))
    }

    /// Number of slots, live or not yet purged.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Bytes the slots weigh.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// Whether the store holds no slot.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        Self::lock_table(&self.shared)
    }

    fn lock_table(shared: &Shared) -> std::sync::MutexGuard<'_, Table> {
        // Every operation leaves the table consistent before it could panic, so a poisoned lock
        // is safe to keep using.
        shared.table.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl super::Inspect for MemoryStore {
    async fn ping(&self) -> StoreResult<()> {
        Ok(())
    }

    async fn inspect(&self, key: &ScopedKey) -> StoreResult<Option<super::Inspected>> {
        let now = Instant::now();
        let t = self.lock();
        Ok(t.live(key, now)
            .or_else(|| t.live(&key.tombstone(), now))
            .map(|s| super::Inspected {
                entry: s.entry.clone(),
                expires_in: s.left(now),
                stored_bytes: s.weight() as usize,
            }))
    }

    async fn evict(&self, key: &ScopedKey) -> StoreResult<bool> {
        let now = Instant::now();
        let mut t = self.lock();
        // A lapsed slot not purged yet goes too, but was as good as absent.
        let live = |slot: Option<Slot>| slot.is_some_and(|s| s.live(now));
        let record = live(t.remove(key));
        Ok(live(t.remove(&key.tombstone())) || record)
    }

    async fn evict_all(&self) -> StoreResult<u64> {
        Ok(self.purge_all() as u64)
    }
}

impl Store for MemoryStore {
    async fn claim(&self, who: &Claimant, terms: ClaimTerms) -> StoreResult<Claim> {
        let now = Instant::now();
        let mut t = self.lock();
        let tombstone = (terms.after_expiry == AfterExpiry::Refuse).then(|| who.key.tombstone());
        for at in std::iter::once(&who.key).chain(tombstone.as_ref()) {
            if let Some(slot) = t.live(at, now) {
                let mut entry = slot.entry.clone();
                entry.expires_in = slot.left(now);
                return Ok(Claim::decide(
                    entry,
                    &slot.token,
                    &who.fingerprint,
                    &who.token,
                ));
            }
        }
        t.make_room(true, now)?;
        t.insert(
            who.key,
            Slot {
                token: who.token,
                entry: Entry {
                    fingerprint: who.fingerprint,
                    state: EntryState::InFlight,
                    expires_in: None,
                    written_ms: now_ms(),
                },
                expires_at: Some(until(now, terms.lease)),
            },
        );
        Ok(Claim::Claimed)
    }

    async fn complete(&self, who: &Claimant, state: &EntryState, keep: Keep) -> StoreResult<bool> {
        let tombstone = keep.tombstone_of(&who.fingerprint, state);
        // Kept in memory: detached from the upstream connection's read buffers, so the record
        // holds only its own bytes. Copied before the lock is taken, not while every worker
        // waits on it.
        let state = match state {
            EntryState::Completed(r) => EntryState::Completed(r.detached()),
            other => other.clone(),
        };
        let now = Instant::now();
        let mut t = self.lock();
        match t.live(&who.key, now) {
            Some(s) if s.token != who.token => return Ok(false),
            // Our own completion, already there.
            Some(s) if !matches!(s.entry.state, EntryState::InFlight) => return Ok(true),
            Some(_) => {}
            // Our lease ran out and nobody claimed the key since; a live tombstone means that
            // another record was there.
            None if keep.tombstone.is_some() && t.live(&who.key.tombstone(), now).is_some() => {
                return Ok(false)
            }
            None => {}
        }
        let slot = Slot {
            token: who.token,
            entry: Entry {
                fingerprint: who.fingerprint,
                state,
                expires_in: None,
                written_ms: now_ms(),
            },
            expires_at: keep.ttl.finite().map(|ttl| until(now, ttl)),
        };
        t.insert(who.key, slot);
        if let Some((entry, lives)) = tombstone {
            let token = Token([0; 16]);
            let expires_at = Some(until(now, lives));
            t.insert(
                who.key.tombstone(),
                Slot {
                    token,
                    entry,
                    expires_at,
                },
            );
        }
        t.make_room(false, now)?;
        Ok(true)
    }

    async fn release(&self, who: &Claimant) -> StoreResult<bool> {
        let mut t = self.lock();
        let ours = t.claimed_by(&who.key, &who.token, Instant::now());
        if ours {
            t.remove(&who.key);
        }
        Ok(ours)
    }

    async fn renew(&self, who: &Claimant, lease: Duration) -> StoreResult<bool> {
        let now = Instant::now();
        let mut t = self.lock();
        let ours = t.claimed_by(&who.key, &who.token, now);
        if ours {
            t.extend(&who.key, until(now, lease));
        }
        Ok(ours)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::fingerprint::Fingerprint;

    fn key(i: u32) -> ScopedKey {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&i.to_be_bytes());
        ScopedKey(k)
    }

    #[tokio::test]
    async fn evicts_completed_records_never_claims() {
        let evictions = Evictions::default();
        let store = MemoryStore::with_limits_counted(10, u64::MAX, evictions.clone());
        let fp = Fingerprint([0; 32]);
        let lease = Duration::from_secs(60);
        // Five claims stay in flight, five complete.
        for i in 0..10 {
            let t = Token([i as u8; 16]);
            assert!(matches!(
                store
                    .claim(&Claimant::new(key(i), fp, t), ClaimTerms::lease(lease))
                    .await
                    .unwrap(),
                Claim::Claimed
            ));
            if i >= 5 {
                assert!(store
                    .complete(
                        &Claimant::new(key(i), fp, t),
                        &EntryState::NotReplayable,
                        lease.into()
                    )
                    .await
                    .unwrap());
            }
        }
        // Past the bound, completed records make room; claims survive.
        for i in 10..15 {
            let t = Token([i as u8; 16]);
            assert!(matches!(
                store
                    .claim(&Claimant::new(key(i), fp, t), ClaimTerms::lease(lease))
                    .await
                    .unwrap(),
                Claim::Claimed
            ));
            assert!(store.len() <= 10);
        }
        for i in 0..5 {
            let again = store
                .claim(
                    &Claimant::new(key(i), fp, Token([99; 16])),
                    ClaimTerms::lease(lease),
                )
                .await
                .unwrap();
            assert!(matches!(again, Claim::InFlight), "claim {i} was evicted");
        }
        assert_eq!(evictions.max_entries.get(), 5, "the five records, counted");
        assert_eq!(evictions.max_bytes.get(), 0);
        // Only claims left: a new claim is refused rather than growing without bound.
        assert!(matches!(
            store
                .claim(
                    &Claimant::new(key(100), fp, Token([1; 16])),
                    ClaimTerms::lease(lease)
                )
                .await,
            Err(StoreError::Full)
        ));
    }

    #[tokio::test]
    async fn bounded_by_bytes() {
        let store = MemoryStore::with_limits(1000, 20_000);
        let fp = Fingerprint([0; 32]);
        let lease = Duration::from_secs(60);
        let body = crate::record::StoredResponse {
            status: http::StatusCode::OK,
            headers: vec![],
            body: bytes::Bytes::from(vec![0u8; 4000]),
            trailers: Vec::new(),
            traceparent: None,
            key_source: None,
        };
        let state = EntryState::Completed(Arc::new(body));
        for i in 0..20 {
            let t = Token([i as u8; 16]);
            store
                .claim(&Claimant::new(key(i), fp, t), ClaimTerms::lease(lease))
                .await
                .unwrap();
            assert!(store
                .complete(&Claimant::new(key(i), fp, t), &state, lease.into())
                .await
                .unwrap());
            assert!(store.bytes() <= 20_000, "{} bytes after {i}", store.bytes());
        }
        assert!(store.len() < 20);
        // The newest records are the ones kept.
        assert!(store.get(&key(19)).is_some());
        assert!(store.get(&key(0)).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn expired_entries_are_purged() {
        let store = MemoryStore::new();
        let fp = Fingerprint([0; 32]);
        store
            .claim(
                &Claimant::new(key(1), fp, Token([1; 16])),
                ClaimTerms::lease(Duration::from_secs(1)),
            )
            .await
            .unwrap();
        store.purge_expired();
        assert_eq!(store.len(), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        store.purge_expired();
        assert!(store.is_empty());
    }

    #[test]
    fn the_fixed_weight_covers_a_slot_and_its_index_entry() {
        // A map bucket (key and slot, at hashbrown's 7/8 load) plus the expiry index's entry
        // (with B-tree node overhead, about a tenth).
        let bucket = (std::mem::size_of::<ScopedKey>() + std::mem::size_of::<Slot>()) * 8 / 7;
        let index = std::mem::size_of::<(Instant, ScopedKey)>() * 11 / 10;
        assert!(
            (bucket + index) as u64 <= SLOT_OVERHEAD,
            "{bucket} + {index} > {SLOT_OVERHEAD}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewed_claim_is_purged_at_its_new_expiry_not_its_first() {
        let store = MemoryStore::new();
        let (fp, t) = (Fingerprint([0; 32]), Token([1; 16]));
        let lease = Duration::from_secs(10);
        store
            .claim(&Claimant::new(key(1), fp, t), ClaimTerms::lease(lease))
            .await
            .unwrap();
        tokio::time::advance(Duration::from_secs(8)).await;
        assert!(store
            .renew(&Claimant::new(key(1), fp, t), lease)
            .await
            .unwrap());
        tokio::time::advance(Duration::from_secs(5)).await;
        store.purge_expired();
        assert_eq!(store.len(), 1, "purged at the first lease's end");
        tokio::time::advance(Duration::from_secs(6)).await;
        store.purge_expired();
        assert!(store.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_expiry_index_stays_in_step_with_the_map() {
        let store = MemoryStore::with_limits(50, u64::MAX);
        let fp = Fingerprint([0; 32]);
        let lease = Duration::from_secs(5);
        for i in 0..400u32 {
            let t = Token([(i % 251) as u8; 16]);
            store
                .claim(&Claimant::new(key(i % 97), fp, t), ClaimTerms::lease(lease))
                .await
                .ok();
            match i % 4 {
                0 => {
                    store
                        .complete(
                            &Claimant::new(key(i % 97), fp, t),
                            &EntryState::NotReplayable,
                            (lease * (1 + i % 3)).into(),
                        )
                        .await
                        .unwrap();
                }
                1 => {
                    store
                        .release(&Claimant::new(key(i % 97), fp, t))
                        .await
                        .unwrap();
                }
                2 => {
                    store
                        .renew(&Claimant::new(key(i % 97), fp, t), lease * 2)
                        .await
                        .unwrap();
                }
                _ => {}
            }
            if i % 50 == 0 {
                tokio::time::advance(Duration::from_secs(3)).await;
                store.purge_expired();
            }
            let t = store.lock();
            let forever = t.map.values().filter(|s| s.expires_at.is_none()).count();
            assert_eq!(
                t.map.len(),
                t.claims.len() + t.records.len() + forever,
                "after step {i}"
            );
            assert!(t.map.len() <= 50);
            for (at, k) in t.claims.iter().chain(t.records.iter()) {
                assert_eq!(t.map[k].expires_at, Some(*at), "after step {i}");
            }
        }
    }
}
