//! The keyed MCP calls claimed in this process, by session and request id: a client's
//! `notifications/cancelled` naming one is not passed on, since the call runs to its end once
//! and its retry gets its result (a cancelled call would leave its retry nothing to replay).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

use http::HeaderMap;

use super::MCP_SESSION_ID;

/// A call's place in the registry: its session and its id as JSON text.
type Slot = (String, String);

/// How many calls of each slot are claimed (two sessions may reuse an id; a session may reuse
/// one for a call that follows).
fn registry() -> MutexGuard<'static, HashMap<Slot, usize>> {
    static CLAIMED: OnceLock<Mutex<HashMap<Slot, usize>>> = OnceLock::new();
    // A std Mutex: held for a map update, never across an await.
    CLAIMED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// The slot of the request with `headers` and `id`: only within a session (cancellation names
/// a request id, which is unique only within one).
fn slot(headers: &HeaderMap, id: &serde_json::Value) -> Option<Slot> {
    let session = headers.get(MCP_SESSION_ID)?.to_str().ok()?;
    Some((session.to_string(), id.to_string()))
}

/// Whether the call `id` of the session in `headers` is claimed here.
pub(super) fn is_claimed(headers: &HeaderMap, id: &serde_json::Value) -> bool {
    slot(headers, id).is_some_and(|slot| registry().contains_key(&slot))
}

/// A claimed call's entry in the registry, removed when dropped (with the claim's lease, once
/// the call is recorded or released).
#[derive(Debug)]
pub(crate) struct Claimed(Slot);

impl Claimed {
    /// Register the call `id` of the session in `headers`; none without a session.
    pub(super) fn register(headers: &HeaderMap, id: &serde_json::Value) -> Option<Self> {
        let slot = slot(headers, id)?;
        *registry().entry(slot.clone()).or_default() += 1;
        Some(Claimed(slot))
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        let mut registry = registry();
        if let Some(count) = registry.get_mut(&self.0) {
            *count -= 1;
            if *count == 0 {
                registry.remove(&self.0);
            }
        }
    }
}
