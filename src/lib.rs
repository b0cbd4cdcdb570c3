//! idemgate: HTTP idempotency, as a gateway in front of any API or as a tower layer inside a
//! Rust service, with the same engine.
//!
//! Clients retry with the same `Idempotency-Key`. The first request claims the key in a store
//! and runs; its whole response is recorded with a fingerprint of the request. A retry gets that
//! response again, byte for byte and marked `Idempotent-Replayed: true`, without running again;
//! the same key with another request, or while the first is in flight, gets `409`
//! problem+json.
//!
//! # As a layer in your service
//!
//! [`IdempotencyLayer`] wraps any tower `Service` whose responses can be buffered: an axum
//! router or route, a hyper service, a client. Choose a store ([`MemoryStore`] in the process,
//! [`RedisStore`] shared by replicas) and a [`Policy`] (or [`Routes`], a policy per path):
//!
//! ```no_run
//! use axum::{routing::post, Router};
//! use idemgate::{IdempotencyLayer, MemoryStore, Policy};
//!
//! async fn charge() -> (http::StatusCode, &'static str) {
//!     (http::StatusCode::CREATED, "{\"status\":\"succeeded\"}")
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let policy = Policy::builder().require_key(true).build()?;
//! let layer = IdempotencyLayer::new(MemoryStore::new(), policy);
//! let app = Router::new().route("/v1/payments", post(charge)).layer(layer.clone());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await?;
//! // On shutdown, let claimed calls whose clients went away finish and be recorded:
//! layer.tasks().close();
//! layer.tasks().wait().await;
//! # Ok(()) }
//! ```
//!
//! Once a request has claimed its key, the inner call and its recording run in a task the layer
//! owns, so a client that hangs up does not cancel them. An inner service tells the layer that a
//! request was certainly not processed (and its key may be released at once) with an error that
//! carries [`NotSent`]. `examples/axum_payments.rs` is a complete payments API built this way.
//!
//! # As a gateway
//!
//! The `idemgate` binary runs the same layer over [`proxy::Proxy`], in front of an upstream the
//! team does not want to change, configured in TOML ([`config::Config`]); see the README.
//!
//! # Layout
//! - [`idempotency`]: the layer and its service, the policy, the key, the fingerprint, the
//!   stored record, the routes.
//! - [`store`]: the [`Store`] trait and its backends: [`MemoryStore`] (embedded),
//!   [`RedisStore`] (Lua scripts in `src/store/lua/`), and [`store::CachedStore`] (a local
//!   cache of completed records in front of another store), with their settings
//!   ([`store::RedisSettings`], [`Topology`]).
//! - [`config`]: the TOML and `IDEMGATE_` environment users write, read into the engine's
//!   [`Policy`]s and the store's settings, each value checked as it is read.
//! - [`proxy`]: the upstream as a tower service, with its connection pool.
//! - [`error`]: the answers the gateway gives itself, as RFC 9457 problem+json.
//! - [`metrics`]: Prometheus metrics.
//! - [`admin`]: the admin listener: health, readiness, metrics, key inspection and eviction.
//! - `listener`: client connections: the accept loop under `max_client_connections`, each
//!   connection's watchdog (`client_header_timeout`, `client_idle_timeout`), and the service
//!   that admits a request and adds the forwarding headers.
//! - [`app`]: the binary's wiring: `app::run(listener, config, shutdown)`.
//! - [`demo`]: a small example payments upstream for the quick start.

#![warn(missing_docs)]

pub mod admin;
mod app;
pub mod config;
pub mod error;
mod headers;
pub mod idempotency;
mod listener;
pub mod metrics;
pub mod proxy;
pub mod store;
mod tls;

pub use app::{run, App, AppError};
pub use error::ConfigError;
pub use idempotency::{
    FingerprintMode, Idempotency, IdempotencyLayer, KeySecret, NotSent, OnInFlight, OnStoreError,
    Policy, PolicyBuilder, Routes, IDEMPOTENT_REPLAYED,
};
pub use metrics::Metrics;
pub use store::{MemoryStore, RedisStore, Store, StoreError, Topology};
