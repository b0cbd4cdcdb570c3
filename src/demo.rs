//! `idemgate demo`: the gateway on the in-memory store in front of a small example payments API,
//! so the quick start shows the behaviour with nothing else installed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

/// The example upstream: `POST /v1/payments` "charges" (slowly, like a card network) and counts
/// every execution; `GET /v1/payments/executions` tells how many charges really ran.
pub(crate) fn payments_api() -> Router {
    let executions = Arc::new(AtomicU64::new(0));
    Router::new()
        .route("/v1/payments", post(charge))
        .route("/v1/payments/executions", get(count))
        .with_state(executions)
}

async fn charge(
    State(executions): State<Arc<AtomicU64>>,
    body: Option<Json<Value>>,
) -> (StatusCode, Json<Value>) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
    let amount = body
        .and_then(|Json(b)| b.get("amount").cloned())
        .unwrap_or(Value::Null);
    (
        StatusCode::CREATED,
        Json(json!({ "id": format!("pay_{n:06}"), "status": "succeeded", "amount": amount })),
    )
}

async fn count(State(executions): State<Arc<AtomicU64>>) -> Json<Value> {
    Json(json!({ "executions": executions.load(Ordering::SeqCst) }))
}

/// The gateway config the demo runs: `/v1/payments` requires a key, everything else defaults.
pub(crate) fn config_toml(listen: &str, upstream: &str) -> String {
    format!(
        r#"
listen = "{listen}"
upstream = "{upstream}"

[store]
backend = "memory"

[[routes]]
path = "/v1/payments"
methods = ["POST"]
require_key = true
ttl = "1h"
"#
    )
}

/// The curl lines printed for the user to try.
pub(crate) fn instructions(listen: &str) -> String {
    format!(
        r#"idemgate demo: gateway on http://{listen} (in-memory store) in front of an example payments API.

Try, in another terminal:
  # 1. charge once (runs the upstream, 201)
  curl -i -X POST http://{listen}/v1/payments -H 'Idempotency-Key: order-42' -H 'content-type: application/json' -d '{{"amount":1000}}'
  # 2. retry: the same response, replayed (Idempotent-Replayed: true), the upstream is not called
  curl -i -X POST http://{listen}/v1/payments -H 'Idempotency-Key: order-42' -H 'content-type: application/json' -d '{{"amount":1000}}'
  # 3. same key, different amount: 409 problem+json (mismatch)
  curl -i -X POST http://{listen}/v1/payments -H 'Idempotency-Key: order-42' -H 'content-type: application/json' -d '{{"amount":9999}}'
  # 4. no key on this route: 400
  curl -i -X POST http://{listen}/v1/payments -d '{{"amount":1}}'
  # 5. how many charges really ran
  curl -s http://{listen}/v1/payments/executions

Ctrl-C to stop."#
    )
}
