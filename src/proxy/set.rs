//! The upstreams in force, replaced whole by a reload, and each worker's pools built for them.

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::metrics::ProxyMetrics;
use super::settings::UpstreamConfig;
use super::upstream::Upstream;

/// The upstreams the gateway forwards to, shared by every worker's [`Proxy`](super::Proxy) and
/// replaced whole by a reload: each proxy opens pools for the new set at its next request, and
/// requests in flight finish on the connections they took.
#[derive(Clone, Default)]
pub struct UpstreamSet(Arc<ArcSwap<Vec<Arc<UpstreamConfig>>>>);

impl std::fmt::Debug for UpstreamSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.0.load().iter().map(|u| u.name.clone()).collect();
        f.debug_tuple("UpstreamSet").field(&names).finish()
    }
}

impl UpstreamSet {
    /// `upstreams`, in force until replaced.
    pub fn new<'a>(upstreams: impl IntoIterator<Item = &'a Arc<UpstreamConfig>>) -> Self {
        UpstreamSet(Arc::new(ArcSwap::from_pointee(
            upstreams.into_iter().cloned().collect(),
        )))
    }

    /// Forward the requests that come next to `upstreams`.
    pub fn replace<'a>(&self, upstreams: impl IntoIterator<Item = &'a Arc<UpstreamConfig>>) {
        self.0
            .store(Arc::new(upstreams.into_iter().cloned().collect()));
    }

    fn load(&self) -> Arc<Vec<Arc<UpstreamConfig>>> {
        self.0.load_full()
    }
}

/// One worker's upstreams (their pools), and the set they were built from.
#[derive(Debug)]
pub(super) struct Built {
    from: Arc<Vec<Arc<UpstreamConfig>>>,
    pub(super) upstreams: Vec<Upstream>,
}

impl Built {
    fn new(from: Arc<Vec<Arc<UpstreamConfig>>>, metrics: &ProxyMetrics) -> Self {
        let upstreams = from.iter().map(|u| Upstream::new(u, metrics)).collect();
        Built { from, upstreams }
    }
}

/// A proxy's upstreams: built once, or following an [`UpstreamSet`].
#[derive(Debug)]
pub(super) struct Upstreams {
    source: UpstreamSet,
    built: ArcSwap<Built>,
    metrics: Arc<ProxyMetrics>,
}

impl Upstreams {
    pub(super) fn new(source: UpstreamSet, metrics: Arc<ProxyMetrics>) -> Self {
        let built = Built::new(source.load(), &metrics);
        Upstreams {
            source,
            built: ArcSwap::from_pointee(built),
            metrics,
        }
    }

    /// The upstreams in force, their pools built now if the set was replaced since the last
    /// request. A request holds what this returns until it is done.
    pub(super) fn current(&self) -> Arc<Built> {
        let built = self.built.load_full();
        let set = self.source.0.load();
        if Arc::ptr_eq(&built.from, &set) {
            return built;
        }
        let fresh = Arc::new(Built::new(Arc::clone(&set), &self.metrics));
        self.built.store(fresh.clone());
        fresh
    }
}
