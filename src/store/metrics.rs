//! The store's own metric families: the local cache, the embedded store's commits, and the
//! records the in-process stores evicted for room. (The latency of store operations, and the
//! records found unreadable, are counted by the engine, which waits on them.)

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::{registered, Families, ReasonLabels};

/// Where an in-process store (memory, embedded) counts the completed records it evicted before
/// their TTL to stay within a bound: a retry of such a record runs again. (Expired records are
/// not counted: their purge loses nothing.)
#[derive(Debug, Clone, Default)]
pub struct Evictions {
    /// Records evicted because the store held `max_entries`.
    pub max_entries: Counter,
    /// Records evicted because the store held `max_bytes`.
    pub max_bytes: Counter,
}

impl Evictions {
    /// Count `n` evictions, made for the entry bound when `for_entries`, else for the byte bound.
    pub(crate) fn count(&self, for_entries: bool, n: u64) {
        if n > 0 {
            match for_entries {
                true => self.max_entries.inc_by(n),
                false => self.max_bytes.inc_by(n),
            };
        }
    }
}

/// The store's families.
#[derive(Debug)]
pub struct StoreMetrics {
    /// Replays served from the local cache (given to the cache to count into).
    pub local_cache_hits: Counter,
    local_cache_entries: Gauge,
    local_cache_bytes: Gauge,
    /// The embedded store's durable commits (given to the store to count into).
    pub commits: Counter,
    evictions: Family<ReasonLabels, Counter>,
}

impl Families for StoreMetrics {
    fn register(registry: &mut Registry) -> Self {
        let metrics = StoreMetrics {
            local_cache_hits: registered(
                registry,
                "idemgate_local_cache_hits",
                "Replays served from this process's local cache of completed records, with no store round trip (Redis and PostgreSQL)",
                Counter::default(),
            ),
            local_cache_entries: registered(
                registry,
                "idemgate_local_cache_entries",
                "Completed records in this process's local cache (Redis and PostgreSQL; read when scraped)",
                Gauge::default(),
            ),
            local_cache_bytes: registered(
                registry,
                "idemgate_local_cache_bytes",
                "Bytes in this process's local cache, responses plus 128 per entry (Redis and PostgreSQL; read when scraped)",
                Gauge::default(),
            ),
            commits: registered(
                registry,
                "idemgate_store_commits",
                "Durable commits (fsyncs) of the embedded store; divided by the misses, fsyncs per miss (embedded only)",
                Counter::default(),
            ),
            evictions: registered(
                registry,
                "idemgate_store_evictions",
                "Completed records the memory or embedded store evicted before their TTL to stay within a bound (reason: max_entries, max_bytes); a retry of one runs again",
                Family::default(),
            ),
        };
        for reason in ["max_entries", "max_bytes"] {
            drop(metrics.evictions.get_or_create(&ReasonLabels { reason }));
        }
        metrics
    }
}

impl StoreMetrics {
    /// The counters the memory and the embedded store count their evictions for room into.
    pub fn evictions(&self) -> Evictions {
        let of = |reason| {
            self.evictions
                .get_or_create(&ReasonLabels { reason })
                .clone()
        };
        Evictions {
            max_entries: of("max_entries"),
            max_bytes: of("max_bytes"),
        }
    }

    /// Record the local cache's size (entries, bytes), just before a scrape.
    pub fn local_cache_size(&self, entries: u64, bytes: u64) {
        let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.local_cache_entries.set(clamp(entries));
        self.local_cache_bytes.set(clamp(bytes));
    }
}
