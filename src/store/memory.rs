//! The embedded store: a map in this process. Zero setup; lost when the process exits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::{Claim, Store, StoreError};
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::ScopedKey;
use crate::idempotency::record::{Entry, EntryState, Token};

/// A handle to the embedded store; clones share one map.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    // A std Mutex, not tokio's: no critical section awaits, each is a few map operations, and a
    // std lock is cheaper on this hot path (as mini-redis argues for its `Db`).
    entries: Mutex<HashMap<ScopedKey, Slot>>,
    // Bound on the number of slots; completed records are evicted past it, claims never are.
    max_entries: usize,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::with_max_entries(100_000)
    }
}

#[derive(Debug)]
struct Slot {
    // The token of the claim that wrote this slot; fences complete/release/renew.
    token: Token,
    // The entry as the state machine sees it.
    entry: Entry,
    // When the slot stops existing (lease end for a claim, TTL end for a completed record).
    expires_at: Instant,
}

impl MemoryStore {
    /// An empty store with the default bound (100,000 entries).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store holding at most `max_entries` entries.
    pub fn with_max_entries(max_entries: usize) -> Self {
        MemoryStore {
            shared: Arc::new(Shared {
                entries: Mutex::new(HashMap::new()),
                max_entries: max_entries.max(1),
            }),
        }
    }

    /// Drop every expired slot. Expired slots are also ignored on access, so this only bounds
    /// memory; `app::run` calls it periodically.
    pub fn purge_expired(&self) {
        let now = Instant::now();
        self.lock().retain(|_, s| s.expires_at > now);
    }

    /// Drop every slot (the admin API's emergency switch, and tests).
    pub fn purge_all(&self) {
        self.lock().clear();
    }

    /// Number of slots, live or not yet purged.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the store holds no slot.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ScopedKey, Slot>> {
        // A panic while holding the lock leaves the map consistent (every operation is a single
        // insert/remove), so a poisoned lock is safe to keep using.
        self.shared
            .entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Apply `f` to the live slot of `key` held by `token`, if any.
    fn with_own_slot(
        &self,
        key: &ScopedKey,
        token: &Token,
        f: impl FnOnce(&mut Slot, Instant),
    ) -> bool {
        let now = Instant::now();
        let mut map = self.lock();
        match map.get_mut(key) {
            Some(slot)
                if slot.expires_at > now
                    && slot.token == *token
                    && matches!(slot.entry.state, EntryState::InFlight) =>
            {
                f(slot, now);
                true
            }
            _ => false,
        }
    }
}

/// Bring the map under `max` by dropping expired slots, then the completed records closest to
/// expiry (about a tenth of `max` at once, so the scan is amortised). In-flight claims are never
/// evicted: when only they remain, the new claim is refused.
fn make_room(
    map: &mut HashMap<ScopedKey, Slot>,
    max: usize,
    now: Instant,
) -> Result<(), StoreError> {
    map.retain(|_, s| s.expires_at > now);
    if map.len() < max {
        return Ok(());
    }
    let mut completed: Vec<(Instant, ScopedKey)> = map
        .iter()
        .filter(|(_, s)| !matches!(s.entry.state, EntryState::InFlight))
        .map(|(k, s)| (s.expires_at, *k))
        .collect();
    if completed.is_empty() {
        return Err(StoreError::Full);
    }
    let evict = (map.len() + 1 - max).max(max / 10).min(completed.len());
    if evict < completed.len() {
        completed.select_nth_unstable_by_key(evict, |(expires_at, _)| *expires_at);
    }
    for (_, k) in &completed[..evict] {
        map.remove(k);
    }
    tracing::debug!(
        evicted = evict,
        "memory store at max_entries; evicted completed records"
    );
    Ok(())
}

impl Store for MemoryStore {
    async fn claim(
        &self,
        key: &ScopedKey,
        fingerprint: &Fingerprint,
        token: &Token,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut map = self.lock();
        if let Some(slot) = map.get(key) {
            if slot.expires_at > now {
                let mut entry = slot.entry.clone();
                entry.expires_in = Some(slot.expires_at - now);
                return Ok(Claim::Existing(entry));
            }
        } else if map.len() >= self.shared.max_entries {
            make_room(&mut map, self.shared.max_entries, now)?;
        }
        map.insert(
            *key,
            Slot {
                token: *token,
                entry: Entry {
                    fingerprint: *fingerprint,
                    state: EntryState::InFlight,
                    expires_in: None,
                },
                expires_at: now + lease,
            },
        );
        Ok(Claim::Claimed)
    }

    async fn complete(
        &self,
        key: &ScopedKey,
        fingerprint: &Fingerprint,
        token: &Token,
        state: &EntryState,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.with_own_slot(key, token, |slot, now| {
            slot.entry = Entry {
                fingerprint: *fingerprint,
                state: state.compacted(),
                expires_in: None,
            };
            slot.expires_at = now + ttl;
        }))
    }

    async fn release(&self, key: &ScopedKey, token: &Token) -> Result<bool, StoreError> {
        let mut map = self.lock();
        let ours = matches!(map.get(key), Some(s) if s.token == *token && matches!(s.entry.state, EntryState::InFlight));
        if ours {
            map.remove(key);
        }
        Ok(ours)
    }

    async fn renew(
        &self,
        key: &ScopedKey,
        token: &Token,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.with_own_slot(key, token, |slot, now| slot.expires_at = now + lease))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> ScopedKey {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&i.to_be_bytes());
        ScopedKey(k)
    }

    #[tokio::test]
    async fn evicts_completed_records_never_claims() {
        let store = MemoryStore::with_max_entries(10);
        let fp = Fingerprint([0; 32]);
        let lease = Duration::from_secs(60);
        // Five claims stay in flight, five complete.
        for i in 0..10 {
            let t = Token([i as u8; 16]);
            assert!(matches!(
                store.claim(&key(i), &fp, &t, lease).await.unwrap(),
                Claim::Claimed
            ));
            if i >= 5 {
                assert!(store
                    .complete(&key(i), &fp, &t, &EntryState::NotReplayable, lease)
                    .await
                    .unwrap());
            }
        }
        // Past the bound, completed records make room; claims survive.
        for i in 10..15 {
            let t = Token([i as u8; 16]);
            assert!(matches!(
                store.claim(&key(i), &fp, &t, lease).await.unwrap(),
                Claim::Claimed
            ));
            assert!(store.len() <= 10);
        }
        for i in 0..5 {
            let again = store
                .claim(&key(i), &fp, &Token([99; 16]), lease)
                .await
                .unwrap();
            assert!(
                matches!(
                    again,
                    Claim::Existing(Entry {
                        state: EntryState::InFlight,
                        ..
                    })
                ),
                "claim {i} was evicted"
            );
        }
        // Only claims left: a new claim is refused rather than growing without bound.
        assert!(matches!(
            store.claim(&key(100), &fp, &Token([1; 16]), lease).await,
            Err(StoreError::Full)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn expired_entries_are_purged() {
        let store = MemoryStore::new();
        let fp = Fingerprint([0; 32]);
        store
            .claim(&key(1), &fp, &Token([1; 16]), Duration::from_secs(1))
            .await
            .unwrap();
        store.purge_expired();
        assert_eq!(store.len(), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        store.purge_expired();
        assert!(store.is_empty());
    }
}
