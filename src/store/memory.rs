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
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    // A std Mutex, not tokio's: no critical section awaits, each is a few map operations, and a
    // std lock is cheaper on this hot path (as mini-redis argues for its `Db`).
    entries: Mutex<HashMap<ScopedKey, Slot>>,
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
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Drop every expired slot. Expired slots are also ignored on access, so this only bounds
    /// memory; `app::run` calls it periodically.
    pub fn purge_expired(&self) {
        let now = Instant::now();
        self.lock().retain(|_, s| s.expires_at > now);
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
                return Ok(Claim::Existing(slot.entry.clone()));
            }
        }
        map.insert(
            *key,
            Slot {
                token: *token,
                entry: Entry {
                    fingerprint: *fingerprint,
                    state: EntryState::InFlight,
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
                state: state.clone(),
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
