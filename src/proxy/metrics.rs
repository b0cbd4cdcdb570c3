//! The proxy's metric families: requests sent to each upstream by what became of them, and the
//! connections opened.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::metrics::{registered, Families};

/// What became of a request the proxy sent, as counted by
/// `idemgate_upstream_requests_total{upstream, result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum UpstreamResult {
    /// A response head came back.
    response,
    /// No connection could be made: nothing was sent.
    not_sent,
    /// The TLS handshake failed (or was refused): nothing was processed.
    tls_failed,
    /// Failed after the request may have been sent.
    failed,
    /// No response head within the route's `upstream_timeout`.
    timeout,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct UpstreamLabels {
    upstream: String,
    result: UpstreamResult,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct UpstreamName {
    upstream: String,
}

/// The proxy's families.
#[derive(Debug)]
pub struct ProxyMetrics {
    requests: Family<UpstreamLabels, Counter>,
    connections: Family<UpstreamName, Counter>,
}

impl Families for ProxyMetrics {
    fn register(registry: &mut Registry) -> Self {
        ProxyMetrics {
            requests: registered(
                registry,
                "idemgate_upstream_requests",
                "Requests the proxy sent, by upstream and what became of them",
                Family::default(),
            ),
            connections: registered(
                registry,
                "idemgate_upstream_connections_opened",
                "Connections opened to each upstream (TCP, and the TLS handshake for https)",
                Family::default(),
            ),
        }
    }
}

impl ProxyMetrics {
    /// The counters of one upstream, resolved now.
    pub fn upstream(&self, upstream: &str) -> UpstreamCounters {
        let result = |result| {
            self.requests
                .get_or_create(&UpstreamLabels {
                    upstream: upstream.to_string(),
                    result,
                })
                .clone()
        };
        UpstreamCounters {
            response: result(UpstreamResult::response),
            not_sent: result(UpstreamResult::not_sent),
            tls_failed: result(UpstreamResult::tls_failed),
            failed: result(UpstreamResult::failed),
            timeout: result(UpstreamResult::timeout),
            opened: self
                .connections
                .get_or_create(&UpstreamName {
                    upstream: upstream.to_string(),
                })
                .clone(),
        }
    }
}

/// One upstream's counters.
#[derive(Clone, Debug)]
pub struct UpstreamCounters {
    response: Counter,
    not_sent: Counter,
    tls_failed: Counter,
    failed: Counter,
    timeout: Counter,
    opened: Counter,
}

impl UpstreamCounters {
    /// Count one request with `result`.
    pub fn count(&self, result: UpstreamResult) {
        match result {
            UpstreamResult::response => &self.response,
            UpstreamResult::not_sent => &self.not_sent,
            UpstreamResult::tls_failed => &self.tls_failed,
            UpstreamResult::failed => &self.failed,
            UpstreamResult::timeout => &self.timeout,
        }
        .inc();
    }

    /// Count one connection opened.
    pub fn opened(&self) {
        self.opened.inc();
    }
}
