//! The binary's backend dispatch: whichever store the configuration names, as one type.

use std::time::Duration;

use tracing::{error, info, warn};

use super::StoreMetrics;
use super::{
    CachedStore, Claim, ClaimTerms, Claimant, EmbeddedStore, Evicted, Inspect, Inspected, Keep,
    LocalCache, LocalCacheSettings, MemoryStore, PostgresStore, RedisStore, Store, StoreConfig,
    StoreError, StoreResult, Watch,
};
use crate::metrics::Metrics;
use crate::record::key::ScopedKey;
use crate::record::EntryState;

/// The configured store: in memory, embedded, or a shared one (Redis, PostgreSQL) with the
/// process's local cache in front.
#[derive(Clone, Debug)]
pub enum AnyStore {
    /// The in-process memory store.
    Memory(MemoryStore),
    /// Redis, with the process's local cache in front.
    Redis(CachedStore<RedisStore>),
    /// A PostgreSQL table, with the process's local cache in front.
    Postgres(CachedStore<PostgresStore>),
    /// The durable embedded store.
    Embedded(EmbeddedStore),
}

impl AnyStore {
    /// Open the store `settings` describe (for Redis: connect, and warn when its settings could
    /// lose records). Fails when the store is misconfigured or refuses; an unreachable Redis or
    /// PostgreSQL is picked up later.
    pub async fn open(settings: &StoreConfig, metrics: &Metrics) -> Result<Self, StoreError> {
        let metrics = &*metrics.families::<StoreMetrics>();
        let settings = match settings {
            StoreConfig::Memory(m) => {
                return Ok(AnyStore::Memory(MemoryStore::with_limits_counted(
                    m.max_entries,
                    m.max_bytes,
                    metrics.evictions(),
                )));
            }
            StoreConfig::Embedded(e) => {
                let store =
                    EmbeddedStore::open_counted(e, metrics.commits.clone(), metrics.evictions())?;
                return Ok(AnyStore::Embedded(store));
            }
            StoreConfig::Redis(settings) => settings,
            StoreConfig::Postgres(settings) => return Self::open_postgres(settings, metrics).await,
        };
        let redis = match RedisStore::connect(settings).await {
            Ok(store) => store,
            // Unreachable (not misconfigured): start anyway, as if Redis had gone down while
            // running. Keyed requests follow on_store_error until it answers; unkeyed ones flow.
            Err(e) if e.is_unreachable() => {
                error!(error = %e, "Redis is unreachable at start-up; starting anyway (keyed requests follow on_store_error until it answers)");
                RedisStore::lazy(settings)?
            }
            Err(e) => return Err(e),
        };
        match redis.durability_warnings().await {
            Ok(warnings) => warnings.iter().for_each(|w| warn!("{w}")),
            Err(e) => {
                info!(error = %e, "could not read the Redis configuration (CONFIG GET refused?)")
            }
        }
        let (cache, forget) = local_cache(&settings.local_cache, metrics);
        redis.on_evicted(forget).await;
        Ok(AnyStore::Redis(CachedStore::new(redis, cache)))
    }

    /// Connect to PostgreSQL and check its table. Unreachable, as for Redis: start anyway and
    /// check the table once it answers; refused (password, TLS, schema): fail.
    async fn open_postgres(
        settings: &super::PostgresSettings,
        metrics: &StoreMetrics,
    ) -> Result<Self, StoreError> {
        let store = match PostgresStore::connect(settings).await {
            Ok(store) => store,
            Err(e) if e.is_unreachable() => {
                error!(error = %e, "PostgreSQL is unreachable at start-up; starting anyway (keyed requests follow on_store_error until it answers)");
                PostgresStore::lazy(settings)?
            }
            Err(e) => return Err(e),
        };
        let (cache, forget) = local_cache(&settings.local_cache, metrics);
        store.on_evicted(forget).await;
        Ok(AnyStore::Postgres(CachedStore::new(store, cache)))
    }

    /// The handle one of `workers` worker threads uses. With Redis, a connection of its own,
    /// so that its commands stay on its thread; a worker that cannot connect (Redis went away
    /// since start-up) shares the first handle, which reconnects by itself. With PostgreSQL, a
    /// pool of its own, its share of `pool_size`, for the same reason.
    pub async fn for_worker(&self, workers: usize) -> Self {
        match self {
            AnyStore::Memory(_) | AnyStore::Embedded(_) => self.clone(),
            AnyStore::Redis(shared) => match shared.inner().sibling().await {
                Ok(own) => AnyStore::Redis(CachedStore::new(own, shared.cache().clone())),
                Err(e) => {
                    warn!(error = %e, "worker could not open its own Redis connection; sharing the first");
                    self.clone()
                }
            },
            AnyStore::Postgres(shared) => match shared.inner().for_worker(workers) {
                Ok(own) => AnyStore::Postgres(CachedStore::new(own, shared.cache().clone())),
                Err(e) => {
                    warn!(error = %e, "worker could not make its own PostgreSQL pool; sharing the first");
                    self.clone()
                }
            },
        }
    }
}

/// `$call` on whichever store `$self` is.
macro_rules! on_store {
    ($self:ident, $s:ident => $call:expr) => {
        match $self {
            AnyStore::Memory($s) => $call,
            AnyStore::Redis($s) => $call,
            AnyStore::Postgres($s) => $call,
            AnyStore::Embedded($s) => $call,
        }
    };
}

/// One local cache of completed records for the whole process, as `settings` say, and what
/// drops its entries when any gateway evicts: the shared stores tell it of every eviction.
fn local_cache(
    settings: &LocalCacheSettings,
    metrics: &StoreMetrics,
) -> (LocalCache, impl Fn(Evicted) + Send + Sync + 'static) {
    let cache = LocalCache::new(settings.bytes, settings.ttl)
        .counting_hits(metrics.local_cache_hits.clone());
    let evicted = cache.clone();
    let forget = move |what| match what {
        Evicted::Key(key) => evicted.invalidate(&key),
        Evicted::All => evicted.clear(),
    };
    (cache, forget)
}

impl Store for AnyStore {
    async fn claim(&self, who: &Claimant, terms: ClaimTerms) -> StoreResult<Claim> {
        on_store!(self, s => s.claim(who, terms).await)
    }

    async fn complete(&self, who: &Claimant, state: &EntryState, keep: Keep) -> StoreResult<bool> {
        on_store!(self, s => s.complete(who, state, keep).await)
    }

    async fn release(&self, who: &Claimant) -> StoreResult<bool> {
        on_store!(self, s => s.release(who).await)
    }

    async fn renew(&self, who: &Claimant, lease: Duration) -> StoreResult<bool> {
        on_store!(self, s => s.renew(who, lease).await)
    }

    async fn watch(&self, key: &ScopedKey) -> Option<Watch> {
        on_store!(self, s => s.watch(key).await)
    }
}

impl Inspect for AnyStore {
    async fn ping(&self) -> StoreResult<()> {
        on_store!(self, s => s.ping().await)
    }

    async fn inspect(&self, key: &ScopedKey) -> StoreResult<Option<Inspected>> {
        on_store!(self, s => s.inspect(key).await)
    }

    async fn evict(&self, key: &ScopedKey) -> StoreResult<bool> {
        on_store!(self, s => s.evict(key).await)
    }

    async fn evict_all(&self) -> StoreResult<u64> {
        on_store!(self, s => s.evict_all().await)
    }

    fn local_cache_size(&self) -> Option<(u64, u64)> {
        on_store!(self, s => s.local_cache_size())
    }
}
