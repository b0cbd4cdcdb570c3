//! JSON-RPC 2.0 and MCP routes (`protocol = "jsonrpc"` or `"mcp"`): the body of a POST is read
//! as JSON-RPC, and only a call (a request with an `id`) of one of `keyed_methods` that carries a
//! key runs the keyed path; notifications, responses, other methods and batches without a keyed
//! call pass through untouched. The call's fingerprint is its method and params without what a
//! retry changes (`id`, `_meta`, an MRTR continuation's `inputResponses` and `requestState`).
//!
//! - this file: reading a POST body into a [`Reading`] (before the claim), the call it names.
//! - `answer.rs`: what an upstream's answer comes to (its terminal response, from JSON or an
//!   event stream), recorded, released or passed on.
//! - `reply.rs`: replays with the retry's own id and the gateway's own refusals as JSON-RPC
//!   errors.
//! - `cancel.rs`: the claimed calls of this process, whose `notifications/cancelled` are not
//!   passed on.
//! - `metrics.rs`: `idemgate_jsonrpc_calls`, by method and (bounded) tool.

mod answer;
mod cancel;
pub(super) mod metrics;
mod reply;

use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderName, Response, StatusCode};
use sha2::{Digest, Sha256};

use super::grpc;
use super::metrics::Outcome;
use super::outcome::Finished;
use crate::error::{ErrorFormat, GatewayError};
use crate::record::fingerprint::Fingerprint;
use crate::record::json::{self, hash_canonical, Json, Pointer};
use crate::record::key::{write_field, IdempotencyKey, KeySource};
use crate::record::policy::{Policy, Protocol};
use crate::record::MCP_SESSION_ID;

pub(super) use answer::{read_answer, JsonRpcStream, StreamTail};
pub(super) use cancel::Claimed;
pub(super) use reply::{refused, replayed, with_id};

/// The header MCP 2026-07-28 clients send with the JSON-RPC method of the body.
const MCP_METHOD: HeaderName = HeaderName::from_static("mcp-method");
/// The header MCP 2026-07-28 clients send with the name a call's params carry (a tool's name).
const MCP_NAME: HeaderName = HeaderName::from_static("mcp-name");
/// The header of the MCP protocol version a request speaks.
const MCP_PROTOCOL_VERSION: HeaderName = HeaderName::from_static("mcp-protocol-version");

/// What a fingerprint leaves out of a call: its id, and what a retry of it may change.
const NOT_FINGERPRINTED: [&str; 5] = [
    "/id",
    "/jsonrpc",
    "/params/_meta",
    "/params/inputResponses",
    "/params/requestState",
];

/// One keyed JSON-RPC call, as its answers need it.
#[derive(Debug)]
pub(crate) struct Call {
    // The request's own id, as sent (a string or a number): every answer to it carries it.
    pub(super) id: serde_json::Value,
    // Its method, and the tool (or other named thing) it names, for traces and metrics.
    pub(super) method: String,
    pub(super) name: Option<String>,
    // An MCP route: MCP's marker in a replayed result, and its protocol versions.
    pub(super) mcp: bool,
    // The MCP protocol version the request speaks (`MCP-Protocol-Version`), if it says.
    pub(super) version: Option<String>,
    // Whether the client takes `application/json` (else only an event stream).
    pub(super) takes_json: bool,
    // While the call is claimed in this process: its `notifications/cancelled` are not passed on.
    pub(super) _claimed: Option<Claimed>,
}

/// What a POST body on a JSON-RPC route comes to, before any claim.
pub(super) enum Reading {
    /// Not a keyed call: forwarded untouched.
    Pass,
    /// A `notifications/cancelled` for a call this process has claimed: answered 202, not
    /// passed on.
    Swallowed,
    /// Refused: the error, and the id of the request when known.
    Refused(GatewayError, Option<serde_json::Value>),
    /// A keyed call.
    Keyed(Keyed),
}

/// A keyed call: its key, where it came from, its fingerprint, and the call.
pub(super) struct Keyed {
    pub(super) key: IdempotencyKey,
    pub(super) source: KeySource,
    pub(super) fingerprint: Fingerprint,
    pub(super) call: Arc<Call>,
}

/// Read a POST `body` on a JSON-RPC route: a keyed call (its key from `key`, a header's, or from
/// the body's `key_from_body`), something to pass on, or a refusal.
pub(super) fn read(
    policy: &Policy,
    parts: &Parts,
    body: &Bytes,
    key: Option<IdempotencyKey>,
) -> Reading {
    // A body that is not JSON is the upstream's to answer (a parse error).
    let Ok(doc) = json::parse(body) else {
        return Reading::Pass;
    };
    let Json::Object(_) = &doc else {
        return batch(policy, &doc);
    };
    let Some(method) = string_at(&doc, "/method") else {
        // A response (to a server's request) or no JSON-RPC at all.
        return Reading::Pass;
    };
    let Some(id) = id_of(&doc) else {
        return notification(&method, &doc, &parts.headers);
    };
    if !is_keyed(policy, &method) {
        return Reading::Pass;
    }
    let mcp = policy.protocol == Protocol::Mcp;
    let name = mcp.then(|| name_of(&method, &doc)).flatten();
    if mcp {
        if let Err(e) = headers_agree(&parts.headers, &method, name.as_deref()) {
            return Reading::Refused(e, Some(id));
        }
    }
    let found = match key.map_or_else(
        || body_key(policy, &doc),
        |k| Ok(Some((k, KeySource::Header))),
    ) {
        Ok(found) => found,
        Err(e) => return Reading::Refused(e, Some(id)),
    };
    let Some((key, source)) = found else {
        return match policy.require_key {
            true => Reading::Refused(GatewayError::MissingKey, Some(id)),
            false => Reading::Pass,
        };
    };
    Reading::Keyed(Keyed {
        key,
        source,
        fingerprint: fingerprint(parts, &doc),
        call: Arc::new(Call::new(&parts.headers, id, method, name, mcp)),
    })
}

impl Call {
    /// The call `id` of `method` (naming `name`), as its request's `headers` show it; an MCP
    /// call is registered for the cancellations that name it.
    fn new(
        headers: &HeaderMap,
        id: serde_json::Value,
        method: String,
        name: Option<String>,
        mcp: bool,
    ) -> Self {
        Call {
            _claimed: mcp.then(|| Claimed::register(headers, &id)).flatten(),
            id,
            name,
            mcp,
            version: header(headers, &MCP_PROTOCOL_VERSION),
            takes_json: takes_json(headers),
            method,
        }
    }

    /// Name the call's method and tool in the request's span.
    pub(super) fn traced(&self, span: &tracing::Span) {
        span.record("jsonrpc.method", self.method.as_str());
        if let Some(name) = &self.name {
            let cut = name
                .char_indices()
                .nth(TRACED_NAME)
                .map_or(name.len(), |(at, _)| at);
            span.record("jsonrpc.name", name.get(..cut).unwrap_or_default());
        }
    }
}

/// The shape of the gateway's own answers on `policy`'s route: JSON-RPC errors on a JSON-RPC
/// route, else as [`grpc::error_format`] says.
pub(super) fn error_format(policy: &Policy, grpc: bool) -> ErrorFormat {
    match policy.protocol.is_jsonrpc() && !grpc {
        true => ErrorFormat::JsonRpc,
        false => grpc::error_format(grpc, policy.error_format),
    }
}

/// The answer to a `notifications/cancelled` not passed on: 202 Accepted, as the server answers
/// a notification.
pub(super) fn swallowed<E>() -> Finished<E> {
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = StatusCode::ACCEPTED;
    Finished::answered(Outcome::passthrough, resp)
}

/// A batch: refused when it holds a keyed call (keyed calls go one per request), else passed on.
fn batch(policy: &Policy, doc: &Json<'_>) -> Reading {
    let Json::Array(items) = doc else {
        return Reading::Pass;
    };
    let keyed = items.iter().any(|item| {
        let method = string_at(item, "/method");
        id_of(item).is_some() && method.is_some_and(|m| is_keyed(policy, &m))
    });
    match keyed {
        true => Reading::Refused(GatewayError::KeyedCallInBatch, None),
        false => Reading::Pass,
    }
}

/// A notification: a cancellation of a call claimed here is not passed on (the call runs to
/// its end for its retry); any other goes on.
fn notification(method: &str, doc: &Json<'_>, headers: &HeaderMap) -> Reading {
    if method != "notifications/cancelled" {
        return Reading::Pass;
    }
    let Some(id) = value_at(doc, "/params/requestId") else {
        return Reading::Pass;
    };
    match cancel::is_claimed(headers, &id) {
        true => Reading::Swallowed,
        false => Reading::Pass,
    }
}

/// Whether calls of `method` are keyed on this route (no `keyed_methods`: every method).
fn is_keyed(policy: &Policy, method: &str) -> bool {
    policy.keyed_methods.is_empty() || policy.keyed_methods.iter().any(|m| m == method)
}

/// The key in the body: the first of `key_from_body` present.
fn body_key(
    policy: &Policy,
    doc: &Json<'_>,
) -> Result<Option<(IdempotencyKey, KeySource)>, GatewayError> {
    for pointer in &policy.key_from_body {
        if let Some(key) = IdempotencyKey::from_json(doc, pointer, policy.key_max_len)? {
            return Ok(Some((key, KeySource::Body)));
        }
    }
    Ok(None)
}

/// MCP 2026-07-28's routing headers, where sent, say what the body says; an intermediary
/// refuses them otherwise (HeaderMismatch).
fn headers_agree(
    headers: &HeaderMap,
    method: &str,
    name: Option<&str>,
) -> Result<(), GatewayError> {
    let differs = |header: &HeaderName, body: Option<&str>| {
        headers
            .get(header)
            .is_some_and(|v| Some(v.as_bytes()) != body.map(str::as_bytes))
    };
    if differs(&MCP_METHOD, Some(method)) {
        return Err(GatewayError::HeaderMismatch("Mcp-Method"));
    }
    if differs(&MCP_NAME, name) {
        return Err(GatewayError::HeaderMismatch("Mcp-Name"));
    }
    Ok(())
}

/// The name an MCP call's params carry, which `Mcp-Name` mirrors: a tool's or a prompt's
/// `name`, a resource's `uri`.
fn name_of(method: &str, doc: &Json<'_>) -> Option<String> {
    let at = match method {
        "tools/call" | "prompts/get" => "/params/name",
        "resources/read" => "/params/uri",
        _ => return None,
    };
    string_at(doc, at)
}

/// At most this many characters of a name go into a trace.
const TRACED_NAME: usize = 128;

/// The fingerprint of a call: the route's path, and the call's canonical JSON without its id
/// and what a retry may change.
fn fingerprint(parts: &Parts, doc: &Json<'_>) -> Fingerprint {
    #[expect(clippy::expect_used, reason = "constant pointers, each valid")]
    let ignore: Vec<Pointer> = NOT_FINGERPRINTED
        .iter()
        .map(|p| Pointer::parse(p).expect("a valid pointer"))
        .collect();
    let mut h = Sha256::new();
    write_field(&mut h, b"jsonrpc");
    write_field(&mut h, parts.uri.path().as_bytes());
    hash_canonical(doc, &ignore, &mut h);
    Fingerprint(h.finalize().into())
}

/// A JSON-RPC request's id: a string or a number (`null` and anything else: none).
fn id_of(doc: &Json<'_>) -> Option<serde_json::Value> {
    match value_at(doc, "/id")? {
        id @ (serde_json::Value::String(_) | serde_json::Value::Number(_)) => Some(id),
        _ => None,
    }
}

/// The string at `at` in `doc`.
fn string_at(doc: &Json<'_>, at: &str) -> Option<String> {
    match Pointer::parse(at).ok()?.get(doc)? {
        Json::String(s) => Some(s.value().into_owned()),
        _ => None,
    }
}

/// The string or number at `at` in `doc`, as serde_json holds it (a number as written).
fn value_at(doc: &Json<'_>, at: &str) -> Option<serde_json::Value> {
    match Pointer::parse(at).ok()?.get(doc)? {
        Json::String(s) => Some(serde_json::Value::String(s.value().into_owned())),
        Json::Number(n) => serde_json::from_str(n.as_str()).ok(),
        _ => None,
    }
}

/// A header's value as text.
fn header(headers: &HeaderMap, name: &HeaderName) -> Option<String> {
    headers.get(name)?.to_str().ok().map(str::to_string)
}

/// Whether a request's `Accept` takes `application/json` (no `Accept`: anything).
fn takes_json(headers: &HeaderMap) -> bool {
    let mut accepts = headers.get_all(http::header::ACCEPT).iter().peekable();
    if accepts.peek().is_none() {
        return true;
    }
    accepts.any(|v| {
        v.to_str().unwrap_or("").split(',').any(|t| {
            let t = t.split(';').next().unwrap_or("").trim();
            t.eq_ignore_ascii_case("application/json")
                || t == "*/*"
                || t.eq_ignore_ascii_case("application/*")
        })
    })
}

#[cfg(test)]
mod tests;
