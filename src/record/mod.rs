//! The vocabulary the engine and the store share, on the floor below both: the key ([`key`]),
//! the request's fingerprint ([`fingerprint`]), a route's policy ([`policy`]), strict and
//! canonical JSON (`json`, crate-private), and what the store keeps per key (this module): the
//! claim's token, the recorded response, the entry's state. Each backend stores a record its own
//! way (Redis, PostgreSQL and the embedded store through `store/codec.rs`, memory as it is).

pub mod fingerprint;
pub(crate) mod json;
pub mod key;
pub mod policy;
pub mod webhook;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

use self::fingerprint::Fingerprint;
use self::key::KeySource;

/// The random token of one claim. Whoever completes or releases a key must present the token of
/// the claim it holds, so a holder whose lease expired cannot clobber a newer holder's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(pub [u8; 16]);

impl Token {
    /// A fresh random token.
    pub fn random() -> Self {
        Token(rand::random())
    }
}

/// A response as stored for replay: status, end-to-end headers, the whole body, and its trailers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The upstream's status code.
    pub status: StatusCode,
    /// End-to-end headers in the upstream's order (hop-by-hop ones already removed).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, byte for byte.
    pub body: Bytes,
    /// The trailers after the body, in order (a gRPC answer's status is there); empty for most.
    pub trailers: Vec<(HeaderName, HeaderValue)>,
    /// The W3C `traceparent` of the request that produced it, so a replay can name the trace of
    /// the original execution.
    pub traceparent: Option<HeaderValue>,
    /// Where the request's key came from (unknown for records written before it was kept).
    pub key_source: Option<KeySource>,
}

/// Where a key stands.
#[derive(Debug, Clone)]
pub enum EntryState {
    /// Claimed by a request that is still running.
    InFlight,
    /// Completed, with the response to replay.
    Completed(Arc<StoredResponse>),
    /// Completed, but the response was too large to keep: never run again, never replayed.
    NotReplayable,
    /// A tombstone: the key's record has expired, and the route refuses a retry after expiry
    /// (`after_expiry = "refuse"`). Never the response; the entry's `written_ms` is when the
    /// record was written.
    Expired(Tombstone),
}

/// What a tombstone remembers of an expired record (tens of bytes, never the response).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tombstone {
    /// The recorded response's status (`None`: the response was too large to keep).
    pub status: Option<StatusCode>,
    /// When the record expired, in ms since the Unix epoch.
    pub expired_ms: u64,
}

impl Tombstone {
    /// The tombstone a record in `state`, kept `ttl_ms` from `now_ms`, leaves; `None` for a
    /// claim or a tombstone.
    pub fn of(state: &EntryState, now_ms: u64, ttl_ms: u64) -> Option<Self> {
        let status = match state {
            EntryState::Completed(r) => Some(r.status),
            EntryState::NotReplayable => None,
            EntryState::InFlight | EntryState::Expired(_) => return None,
        };
        Some(Tombstone {
            status,
            expired_ms: now_ms.saturating_add(ttl_ms),
        })
    }
}

/// The header naming an MCP session (streamable HTTP), never stored.
pub(crate) const MCP_SESSION_ID: http::HeaderName = http::HeaderName::from_static("mcp-session-id");

impl StoredResponse {
    /// What is stored of a response: its status, its end-to-end headers in order (hop-by-hop ones
    /// never are, nor `Mcp-Session-Id`: an MCP session belongs to the client that opened it, and
    /// a retry may come on another), its whole body and trailers, and the `traceparent` of the
    /// request that produced it.
    pub fn new(
        mut head: http::response::Parts,
        (body, trailers): (Bytes, Option<http::HeaderMap>),
        traceparent: Option<HeaderValue>,
        key_source: KeySource,
    ) -> Self {
        crate::headers::strip_hop_by_hop(&mut head.headers);
        head.headers.remove(&MCP_SESSION_ID);
        StoredResponse {
            status: head.status,
            headers: in_order(head.headers),
            body,
            trailers: trailers.map(in_order).unwrap_or_default(),
            traceparent,
            key_source: Some(key_source),
        }
    }

    /// The record of a streamed answer whose head this is, once its body and trailers are in.
    pub(super) fn completed(&self, (body, trailers): (Bytes, Option<http::HeaderMap>)) -> Self {
        StoredResponse {
            body,
            trailers: trailers.map(in_order).unwrap_or_default(),
            ..self.clone()
        }
    }

    /// The trailers, as a map to send after the body (`None`: there are none).
    pub fn trailer_map(&self) -> Option<http::HeaderMap> {
        if self.trailers.is_empty() {
            return None;
        }
        let mut map = http::HeaderMap::with_capacity(self.trailers.len());
        for (n, v) in &self.trailers {
            map.append(n.clone(), v.clone());
        }
        Some(map)
    }

    /// The `Content-Length` values it declares.
    pub fn lengths(&self) -> impl Iterator<Item = &HeaderValue> {
        self.headers
            .iter()
            .filter(|(n, _)| n == http::header::CONTENT_LENGTH)
            .map(|(_, v)| v)
    }

    /// A copy in allocations of its own, to keep in memory. A response fresh from the upstream
    /// holds slices of the connection's read buffer; keeping those would pin a whole buffer per
    /// record.
    pub fn detached(&self) -> Arc<StoredResponse> {
        Arc::new(StoredResponse {
            status: self.status,
            headers: detached(&self.headers),
            body: Bytes::copy_from_slice(&self.body),
            trailers: detached(&self.trailers),
            traceparent: self.traceparent.clone(),
            key_source: self.key_source,
        })
    }
}

/// The fields of `map` in order, each value of a repeated name after the first one.
fn in_order(map: http::HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    let mut fields = Vec::with_capacity(map.len());
    for name in map.keys() {
        fields.extend(map.get_all(name).iter().map(|v| (name.clone(), v.clone())));
    }
    fields
}

/// Fields in values of their own (not slices of a connection's buffer).
fn detached(fields: &[(HeaderName, HeaderValue)]) -> Vec<(HeaderName, HeaderValue)> {
    fields
        .iter()
        .map(|(n, v)| {
            // A value that was valid is again; should one not be, it is kept as it is.
            let v = HeaderValue::from_bytes(v.as_bytes()).unwrap_or_else(|_| v.clone());
            (n.clone(), v)
        })
        .collect()
}

/// A stored entry: the state and the fingerprint of the request that claimed the key.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The fingerprint of the request that owns this key.
    pub fingerprint: Fingerprint,
    /// Its state.
    pub state: EntryState,
    /// How much longer the store keeps it, when the store said (not part of the encoding).
    pub expires_in: Option<Duration>,
    /// When it was written (claimed, or completed), in ms since the Unix epoch.
    pub written_ms: u64,
}

pub use crate::time::now_ms;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neither_hop_by_hop_headers_nor_an_mcp_session_are_stored() {
        let resp = http::Response::builder()
            .header("content-type", "application/json")
            .header("connection", "keep-alive")
            .header("Mcp-Session-Id", "session-of-the-first-caller")
            .header("x-request-id", "r1")
            .body(())
            .unwrap();
        let (head, ()) = resp.into_parts();
        let stored = StoredResponse::new(head, (Bytes::new(), None), None, KeySource::Header);
        let names: Vec<_> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "x-request-id"]);
    }
}
