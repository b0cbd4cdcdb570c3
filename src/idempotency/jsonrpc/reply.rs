//! What a JSON-RPC call gets from the gateway itself: a replay of its recorded response with its
//! own id (in the shape its MCP protocol version reads, for its `Accept`), and the gateway's
//! refusals as JSON-RPC errors carrying its id.

use std::time::Duration;

use axum::body::Body;
use http::header::{self, HeaderValue};
use http::Response;
use serde_json::{Map, Value};

use super::Call;
use crate::error::{ErrorFormat, GatewayError, JsonRpcError};
use crate::idempotency::outcome::Finished;
use crate::idempotency::response::IDEMPOTENT_REPLAYED;
use crate::record::policy::Policy;
use crate::record::StoredResponse;

/// The `_meta` member MCP results replayed by the gateway carry (`true`): an SDK user sees it
/// as `result.meta["io.idemgate/replayed"]`.
pub(crate) const REPLAYED_META: &str = "io.idemgate/replayed";

/// The MCP revision whose results carry `resultType`, and the first to.
const RESULT_TYPE_SINCE: &str = "2026-07-28";

/// The gateway's own JSON-RPC error answers in `finished` with the call's `id` put in (they are
/// built with a null one).
pub(crate) fn with_id<E>(id: &Value, mut finished: Finished<E>) -> Finished<E> {
    if let Ok(resp) = &mut finished.answer {
        if let Some(JsonRpcError(error)) = resp.extensions_mut().remove::<JsonRpcError>() {
            let body = serde_json::json!({ "jsonrpc": "2.0", "id": id, "error": error });
            let len = body.to_string();
            resp.headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from(len.len()));
            *resp.body_mut() = Body::from(len);
        }
    }
    finished
}

/// A refusal of a request on a JSON-RPC route, with its `id` when it has one.
pub(crate) fn refused<E>(
    outcome: super::super::metrics::Outcome,
    e: GatewayError,
    id: Option<&Value>,
) -> Finished<E> {
    let finished = Finished::refused(outcome, e, ErrorFormat::JsonRpc);
    with_id(id.unwrap_or(&Value::Null), finished)
}

/// The replay of `stored` (a call's terminal JSON-RPC response) to `call`: its id, the
/// replayed marker (`Idempotent-Replayed`, and in an MCP result's `_meta`), in the shape the
/// call's MCP version reads, as JSON or as one event of a stream as its `Accept` says; an error
/// when no faithful shape exists. `None` when `stored` is no JSON-RPC message (an upstream's
/// answer in another shape, replayed as it is).
pub(crate) fn replayed(
    call: &Call,
    stored: &StoredResponse,
    policy: &Policy,
    lives: Option<Duration>,
) -> Option<Result<Response<Body>, GatewayError>> {
    let Ok(Value::Object(mut message)) = serde_json::from_slice::<Value>(&stored.body) else {
        return None;
    };
    Some(reply(call, &mut message, stored, policy, lives))
}

fn reply(
    call: &Call,
    message: &mut Map<String, Value>,
    stored: &StoredResponse,
    policy: &Policy,
    lives: Option<Duration>,
) -> Result<Response<Body>, GatewayError> {
    message.insert("id".to_string(), call.id.clone());
    if call.mcp {
        if let Some(Value::Object(result)) = message.get_mut("result") {
            in_version(result, call.version.as_deref())?;
            let meta = result
                .entry("_meta")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(meta) = meta {
                meta.insert(REPLAYED_META.to_string(), Value::Bool(true));
            }
        }
    }
    let text = Value::Object(std::mem::take(message)).to_string();
    let (content_type, body) = match call.takes_json {
        true => ("application/json", text),
        false => (
            "text/event-stream",
            format!("event: message\ndata: {text}\n\n"),
        ),
    };
    let mut resp = Response::new(Body::from(body.clone()));
    *resp.status_mut() = stored.status;
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if let Some(name) = policy.expiry_header.clone() {
        if let Some(value) = crate::time::expiry_date(lives) {
            headers.insert(name, value);
        }
    }
    Ok(resp)
}

/// A recorded MCP `result` in the shape the protocol `version` reads: since 2026-07-28 a result
/// says its `resultType` (absent: `"complete"`); before, it has none, and a result that is not
/// complete (a task) has no faithful form there.
fn in_version(result: &mut Map<String, Value>, version: Option<&str>) -> Result<(), GatewayError> {
    let modern = version.is_some_and(|v| v >= RESULT_TYPE_SINCE);
    match (modern, result.get("resultType").and_then(Value::as_str)) {
        (true, Some(_)) | (false, None) => Ok(()),
        (true, None) => {
            result.insert("resultType".into(), Value::String("complete".into()));
            Ok(())
        }
        (false, Some("complete")) => {
            result.remove("resultType");
            Ok(())
        }
        (false, Some("task")) => Err(GatewayError::ReplayUntranslatable("a task")),
        (false, Some(_)) => Err(GatewayError::ReplayUntranslatable(
            "a result of another type",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_take_the_shape_of_the_retrys_version() {
        let mut old = Map::new();
        old.insert("content".into(), Value::Array(vec![]));
        let mut modern = old.clone();
        in_version(&mut modern, Some("2026-07-28")).unwrap();
        assert_eq!(modern["resultType"], "complete");
        let mut back = modern.clone();
        in_version(&mut back, Some("2025-11-25")).unwrap();
        assert_eq!(back, old);
        let mut task = Map::new();
        task.insert("resultType".into(), "task".into());
        assert!(in_version(&mut task.clone(), Some("2026-07-28")).is_ok());
        let e = in_version(&mut task, None).unwrap_err();
        assert_eq!(e.jsonrpc_code(), -31007);
    }
}
