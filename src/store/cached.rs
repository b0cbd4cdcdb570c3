//! A bounded local cache of *completed* records in front of a shared store (Redis,
//! PostgreSQL): memory first, the durable store behind it.
//!
//! Completed records never change, so a replica may replay one from its own memory without
//! asking the store: after the first replay through a process, the next ones cost no round
//! trip. (Records enter the cache when first read back, not when written: most keys are never
//! retried.) Everything that can change (claims, in-flight and mismatch decisions) always goes
//! to the store underneath. An entry lives at most as long as the record in the store and at
//! most `max_age`, and the cache holds at most `max_bytes` of responses (cold entries first out:
//! quick_cache's CLOCK-Pro).

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::time::Instant;

use super::{Claim, ClaimTerms, Claimant, Keep, Replay, Store, StoreResult};
use crate::record::fingerprint::Fingerprint;
use crate::record::key::ScopedKey;
use crate::record::{EntryState, StoredResponse};

/// Bytes of responses a process keeps when no bound is given.
pub const DEFAULT_BYTES: u64 = 64 * 1024 * 1024;

/// The longest an entry is kept when no bound is given.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(60);

/// The cache itself, shared by the workers of one process.
#[derive(Clone)]
pub struct LocalCache {
    cache: Arc<quick_cache::sync::Cache<ScopedKey, Cached, ByBytes>>,
    // No entry is kept longer than this, whatever its record's TTL.
    max_age: Duration,
    // False when configured with zero bytes: every call goes to the store.
    enabled: bool,
    // Counts the reads it answered (`idemgate_local_cache_hits_total`).
    hits: Counter,
}

#[derive(Clone)]
struct Cached {
    fingerprint: Fingerprint,
    response: Arc<StoredResponse>,
    // When this entry leaves the cache: the record's expiry or `max_age`, whichever is first.
    expires_at: Instant,
    // When the record leaves the store, told to clients in the expiry header (`None`: kept
    // forever).
    record_expires_at: Option<Instant>,
}

/// Weighs an entry by the bytes it holds, so the bound is on memory, not on a count.
#[derive(Clone)]
struct ByBytes;

impl quick_cache::Weighter<ScopedKey, Cached> for ByBytes {
    fn weight(&self, _: &ScopedKey, v: &Cached) -> u64 {
        let headers: usize = v
            .response
            .headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len())
            .sum();
        (128 + headers + v.response.body.len()) as u64
    }
}

impl std::fmt::Debug for LocalCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCache")
            .field("entries", &self.cache.len())
            .field("bytes", &self.cache.weight())
            .finish()
    }
}

impl LocalCache {
    /// A cache of at most `max_bytes` of responses, each kept at most `max_age`; zero bytes or
    /// a zero age turns it off.
    pub fn new(max_bytes: u64, max_age: Duration) -> Self {
        let estimated_items = (max_bytes / 2048).clamp(16, 1 << 20) as usize;
        LocalCache {
            cache: Arc::new(quick_cache::sync::Cache::with_weighter(
                estimated_items,
                max_bytes.max(1),
                ByBytes,
            )),
            max_age,
            enabled: max_bytes > 0 && !max_age.is_zero(),
            hits: Counter::default(),
        }
    }

    /// Count the reads this cache answers into `hits`.
    pub fn counting_hits(mut self, hits: Counter) -> Self {
        self.hits = hits;
        self
    }

    /// Forget `key` (after an eviction through the admin API, say).
    pub fn invalidate(&self, key: &ScopedKey) {
        self.cache.remove(key);
    }

    /// Forget everything.
    pub fn clear(&self) {
        self.cache.clear();
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Bytes held now, as the cache weighs them (responses plus 128 bytes each).
    pub fn bytes(&self) -> u64 {
        self.cache.weight()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.cache.len() == 0
    }

    fn get(&self, key: &ScopedKey, fingerprint: &Fingerprint) -> Option<Replay> {
        if !self.enabled {
            return None;
        }
        let hit = self.cache.get(key)?;
        let now = Instant::now();
        if hit.expires_at <= now {
            self.cache.remove(key);
            return None;
        }
        if hit.fingerprint != *fingerprint {
            return None;
        }
        self.hits.inc();
        Some(Replay {
            response: hit.response,
            expires_in: hit.record_expires_at.map(|at| at - now),
        })
    }

    /// Keep `response`, which the store said at `asked` (or later) lives `lives` more: reckoned
    /// from `asked`, so that the cache never says it lives longer than it does.
    fn put(
        &self,
        key: &ScopedKey,
        fingerprint: &Fingerprint,
        response: &Arc<StoredResponse>,
        (asked, lives): (Instant, Option<Duration>),
    ) {
        if !self.enabled {
            return;
        }
        let kept = lives.unwrap_or(self.max_age).min(self.max_age);
        self.cache.insert(
            *key,
            Cached {
                fingerprint: *fingerprint,
                response: response.clone(),
                expires_at: crate::time::after(asked, kept),
                record_expires_at: lives.map(|lives| crate::time::after(asked, lives)),
            },
        );
    }
}

/// `inner` with a [`LocalCache`] in front of its completed records.
#[derive(Clone, Debug)]
pub struct CachedStore<S> {
    inner: S,
    cache: LocalCache,
}

impl<S: Store> CachedStore<S> {
    /// Put `cache` in front of `inner`.
    pub fn new(inner: S, cache: LocalCache) -> Self {
        CachedStore { inner, cache }
    }

    /// The store underneath.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The cache in front.
    pub fn cache(&self) -> &LocalCache {
        &self.cache
    }

    /// `claim`, asked of the store at `asked`, after keeping the record it replays for the next
    /// replays.
    fn cached(&self, who: &Claimant, asked: Instant, claim: Claim) -> Claim {
        if let Claim::Replay(Replay {
            response,
            expires_in,
        }) = &claim
        {
            let lives = (asked, *expires_in);
            self.cache.put(&who.key, &who.fingerprint, response, lives);
        }
        claim
    }
}

/// The store underneath is asked through a box: its futures wait on the network and run to a
/// kilobyte or more, and unboxed, they would set the size of every future above the store, each
/// copied whole whenever it is moved (several times a request), where a box costs one
/// allocation. A cached replay asks nothing underneath, and allocates nothing.
impl<S: Store> Store for CachedStore<S> {
    async fn claim(&self, who: &Claimant, terms: ClaimTerms) -> StoreResult<Claim> {
        // A cached record is live (it never outlives its record), so it wins over a tombstone
        // as in the store.
        if let Some(replay) = self.cache.get(&who.key, &who.fingerprint) {
            return Ok(Claim::Replay(replay));
        }
        let asked = Instant::now();
        let claim = Box::pin(self.inner.claim(who, terms)).await?;
        Ok(self.cached(who, asked, claim))
    }

    async fn complete(&self, who: &Claimant, state: &EntryState, keep: Keep) -> StoreResult<bool> {
        // Not cached here: most keys are never retried, so a record enters the cache when it is
        // first read back (a replay), not when it is written.
        Box::pin(self.inner.complete(who, state, keep)).await
    }

    async fn release(&self, who: &Claimant) -> StoreResult<bool> {
        Box::pin(self.inner.release(who)).await
    }

    async fn renew(&self, who: &Claimant, lease: Duration) -> StoreResult<bool> {
        Box::pin(self.inner.renew(who, lease)).await
    }

    async fn watch(&self, key: &ScopedKey) -> Option<super::Watch> {
        Box::pin(self.inner.watch(key)).await
    }
}

impl<S: super::Inspect> super::Inspect for CachedStore<S> {
    async fn ping(&self) -> StoreResult<()> {
        self.inner.ping().await
    }

    async fn inspect(&self, key: &ScopedKey) -> StoreResult<Option<super::Inspected>> {
        self.inner.inspect(key).await
    }

    async fn evict(&self, key: &ScopedKey) -> StoreResult<bool> {
        // This process forgets at once; other replicas within `local_cache_ttl`.
        self.cache.invalidate(key);
        self.inner.evict(key).await
    }

    async fn evict_all(&self) -> StoreResult<u64> {
        self.cache.clear();
        self.inner.evict_all().await
    }

    fn local_cache_size(&self) -> Option<(u64, u64)> {
        Some((self.cache.len() as u64, self.cache.bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Token;
    use crate::store::MemoryStore;
    use bytes::Bytes;
    use http::StatusCode;

    fn response(body: &'static [u8]) -> EntryState {
        EntryState::Completed(Arc::new(StoredResponse {
            status: StatusCode::OK,
            headers: vec![],
            body: Bytes::from_static(body),
            trailers: Vec::new(),
            traceparent: None,
            key_source: None,
        }))
    }

    #[tokio::test(start_paused = true)]
    async fn replays_from_memory_and_expires() {
        let inner = MemoryStore::new();
        let store = CachedStore::new(
            inner.clone(),
            LocalCache::new(1 << 20, Duration::from_secs(60)),
        );
        let (k, fp, t) = (ScopedKey([1; 32]), Fingerprint([2; 32]), Token([3; 16]));
        assert!(matches!(
            store
                .claim(
                    &Claimant::new(k, fp, t),
                    ClaimTerms::lease(Duration::from_secs(5))
                )
                .await
                .unwrap(),
            Claim::Claimed
        ));
        assert!(store
            .complete(
                &Claimant::new(k, fp, t),
                &response(b"ok"),
                Duration::from_secs(10).into()
            )
            .await
            .unwrap());
        assert_eq!(store.cache().len(), 0, "written records are not cached");
        // The first replay reads the store and fills the cache...
        let first = store
            .claim(
                &Claimant::new(k, fp, Token([6; 16])),
                ClaimTerms::lease(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        assert!(matches!(first, Claim::Replay(_)));
        assert_eq!(store.cache().len(), 1);
        // ...so even with the record gone underneath, the cache answers the next replay...
        inner.purge_all();
        tokio::time::advance(Duration::from_secs(3)).await;
        let hit = store
            .claim(
                &Claimant::new(k, fp, Token([4; 16])),
                ClaimTerms::lease(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        let Claim::Replay(hit) = hit else {
            panic!("expected a replay from the cache")
        };
        // ...and tells when the record expires in the store, not when the entry leaves the cache.
        assert_eq!(hit.expires_in, Some(Duration::from_secs(7)));
        // ...but a different request always asks the store underneath.
        let other = Fingerprint([9; 32]);
        let miss = store
            .claim(
                &Claimant::new(k, other, Token([5; 16])),
                ClaimTerms::lease(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        assert!(matches!(miss, Claim::Claimed));
        // No entry outlives its record's TTL.
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(store.cache().get(&k, &fp).is_none());
    }

    #[test]
    fn bounded_by_bytes() {
        let cache = LocalCache::new(10_000, Duration::from_secs(60));
        let big = Arc::new(StoredResponse {
            status: StatusCode::OK,
            headers: vec![],
            body: Bytes::from(vec![0u8; 1000]),
            trailers: Vec::new(),
            traceparent: None,
            key_source: None,
        });
        for i in 0..100u8 {
            cache.put(
                &ScopedKey([i; 32]),
                &Fingerprint([0; 32]),
                &big,
                (Instant::now(), Some(Duration::from_secs(60))),
            );
        }
        assert!(cache.cache.weight() <= 10_000);
        assert!(cache.len() < 100);
    }
}
