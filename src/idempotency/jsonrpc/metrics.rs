//! The JSON-RPC routes' own metric family: keyed calls by route, method, tool and outcome, the
//! tool's name bounded so that a client cannot grow the series without end.

use std::collections::HashSet;
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::super::metrics::Outcome;
use crate::metrics::Families;

/// The most tool names labelled per process; later ones count as `other`.
const MAX_NAMES: usize = 100;
/// The longest tool name labelled; a longer one counts as `other`.
const MAX_NAME_LEN: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CallLabels {
    route: String,
    method: String,
    tool: String,
    outcome: Outcome,
}

/// `idemgate_jsonrpc_calls`.
#[derive(Debug, Default)]
pub(crate) struct JsonRpcMetrics {
    calls: Family<CallLabels, Counter>,
    // The tool names labelled so far (at most MAX_NAMES).
    names: Mutex<HashSet<String>>,
}

impl Families for JsonRpcMetrics {
    fn register(registry: &mut Registry) -> Self {
        let metrics = JsonRpcMetrics::default();
        registry.register(
            "idemgate_jsonrpc_calls",
            "Keyed JSON-RPC calls (protocol = \"jsonrpc\" or \"mcp\") by route, method, tool (the first 100 names seen, others as \"other\") and outcome",
            metrics.calls.clone(),
        );
        metrics
    }
}

impl JsonRpcMetrics {
    /// Start the series of a JSON-RPC route's keyed methods at zero (misses, no tool named
    /// yet): a rule's `increase()` then sees the first call.
    pub(in crate::idempotency) fn start_at_zero(&self, route: &str, methods: &[String]) {
        for method in methods {
            let labels = CallLabels {
                route: route.to_string(),
                method: self.bounded(Some(method)),
                tool: String::new(),
                outcome: Outcome::miss,
            };
            drop(self.calls.get_or_create(&labels));
        }
    }

    /// Count a keyed call of `method` (naming the tool, prompt or resource `name`) on `route`
    /// that came to `outcome`.
    pub(in crate::idempotency) fn count(
        &self,
        route: &str,
        method: &str,
        name: Option<&str>,
        outcome: Outcome,
    ) {
        let labels = CallLabels {
            route: route.to_string(),
            method: self.bounded(Some(method)),
            tool: self.bounded(name),
            outcome,
        };
        self.calls.get_or_create(&labels).inc();
    }

    /// `name` as a label: itself while the process has labelled fewer than MAX_NAMES, else
    /// `other`; empty for none.
    fn bounded(&self, name: Option<&str>) -> String {
        let Some(name) = name else {
            return String::new();
        };
        if name.len() > MAX_NAME_LEN {
            return "other".to_string();
        }
        // A std Mutex: held for a set lookup, never across an await.
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        if names.contains(name) || names.len() < MAX_NAMES && names.insert(name.to_string()) {
            return name.to_string();
        }
        "other".to_string()
    }
}
