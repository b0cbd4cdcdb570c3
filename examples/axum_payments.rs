//! A small payments API in axum with idemgate's layer on `POST /v1/payments`: a retry with the
//! same `Idempotency-Key` gets the first charge's response back, byte for byte, instead of
//! charging twice.
//!
//! ```sh
//! cargo run --example axum_payments                 # on 127.0.0.1:3000, records in memory
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example axum_payments   # records in Redis
//! curl -i -X POST localhost:3000/v1/payments -H 'Idempotency-Key: order-1' \
//!      -H 'Content-Type: application/json' -d '{"amount":1000,"currency":"eur"}'
//! ```
//!
//! Send the curl line twice: the second answer carries `idempotent-replayed: true` and the same
//! payment id. Change the amount with the same key: `409` mismatch. `GET /v1/payments/count`
//! tells how many charges really ran.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "an example: it stops on a bad setup at start, and its tests fail by panicking"
)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use idemgate::{IdempotencyLayer, MemoryStore, Policy, RedisStore, Store};
use serde_json::{json, Value};

/// Charges that really ran.
#[derive(Clone, Default)]
struct Charges(Arc<AtomicU64>);

/// The API: idempotency on the one route that must never run twice.
fn app<St: Store>(layer: IdempotencyLayer<St>, charges: Charges) -> Router {
    Router::new()
        .route("/v1/payments", post(charge).layer(layer))
        .route("/v1/payments/count", get(count))
        .with_state(charges)
}

/// Every payment needs a key; a completed payment is replayed for a day.
fn policy() -> Policy {
    Policy::builder()
        .methods([http::Method::POST])
        .require_key(true)
        .ttl(Duration::from_secs(24 * 3600))
        .build()
        .expect("a valid policy")
}

/// "Charges the card": slowly, as a card network does.
async fn charge(
    State(charges): State<Charges>,
    Json(req): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let Some(amount) = req["amount"].as_u64().filter(|a| *a > 0) else {
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({ "error": "amount must be a positive integer" })),
        );
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let n = charges.0.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        Json(json!({ "id": format!("pay_{n:06}"), "amount": amount, "status": "succeeded" })),
    )
}

async fn count(State(charges): State<Charges>) -> Json<Value> {
    Json(json!({ "charges": charges.0.load(Ordering::SeqCst) }))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("payments API on http://{}", listener.local_addr()?);
    match std::env::var("REDIS_URL") {
        Ok(url) => {
            let store = RedisStore::connect(&idemgate::RedisSettings::new(url)).await?;
            serve(listener, IdempotencyLayer::new(store, policy())).await
        }
        Err(_) => {
            serve(
                listener,
                IdempotencyLayer::new(MemoryStore::new(), policy()),
            )
            .await
        }
    }
}

async fn serve<St: Store>(
    listener: tokio::net::TcpListener,
    layer: IdempotencyLayer<St>,
) -> Result<(), Box<dyn std::error::Error>> {
    axum::serve(listener, app(layer.clone(), Charges::default()))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Charges whose clients hung up are still running: let them finish and be recorded.
    layer.tasks().close();
    layer.tasks().wait().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    struct Api {
        router: Router,
        charges: Charges,
    }

    impl Api {
        fn new() -> Self {
            let charges = Charges::default();
            let layer = IdempotencyLayer::new(MemoryStore::new(), policy());
            Api {
                router: app(layer, charges.clone()),
                charges,
            }
        }

        /// `POST /v1/payments` with `key` and `body`: status, replayed or not, and the JSON.
        async fn pay(&self, key: &str, body: &str) -> (StatusCode, bool, Value) {
            let req = Request::post("/v1/payments")
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .unwrap();
            let resp = self.router.clone().oneshot(req).await.unwrap();
            let replayed = resp.headers().contains_key("idempotent-replayed");
            let status = resp.status();
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            (status, replayed, serde_json::from_slice(&bytes).unwrap())
        }

        fn charges(&self) -> u64 {
            self.charges.0.load(Ordering::SeqCst)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_is_replayed_not_charged_again() {
        let api = Api::new();
        let (status, replayed, first) = api.pay("order-1", r#"{"amount":1000}"#).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, false));
        let (status, replayed, again) = api.pay("order-1", r#"{"amount":1000}"#).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, true));
        assert_eq!(again, first);
        assert_eq!(api.charges(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_key_with_another_payment_is_a_mismatch() {
        let api = Api::new();
        api.pay("order-2", r#"{"amount":1000}"#).await;
        let (status, _, problem) = api.pay("order-2", r#"{"amount":9999}"#).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(problem["type"], "urn:idemgate:problem:mismatch");
        assert_eq!(api.charges(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_duplicate_while_charging_is_told_to_retry() {
        let api = Api::new();
        let router = api.router.clone();
        let first = tokio::spawn(async move {
            let req = Request::post("/v1/payments")
                .header("idempotency-key", "order-3")
                .header("content-type", "application/json")
                .body(Body::from(r#"{"amount":500}"#))
                .unwrap();
            router.oneshot(req).await.unwrap().status()
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (status, _, problem) = api.pay("order-3", r#"{"amount":500}"#).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(problem["type"], "urn:idemgate:problem:in-flight");
        assert_eq!(first.await.unwrap(), StatusCode::CREATED);
        assert_eq!(api.charges(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_payment_without_a_key_is_refused() {
        let api = Api::new();
        let req = Request::post("/v1/payments")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"amount":500}"#))
            .unwrap();
        let resp = api.router.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
        assert_eq!(api.charges(), 0);
    }
}
