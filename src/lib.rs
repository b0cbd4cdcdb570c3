//! idemgate: an HTTP idempotency gateway.
//!
//! Clients retry with the same `Idempotency-Key`; the gateway runs the upstream once per key and
//! replays the stored response to every retry, byte for byte, marked `Idempotent-Replayed: true`.
//!
//! # Layout
//! - [`config`]: the TOML schema users write, validated into per-route [`config::Policy`]s.
//! - [`idempotency`]: the key ([`idempotency::key`]), the request fingerprint
//!   ([`idempotency::fingerprint`]), the stored record and its binary encoding
//!   ([`idempotency::record`]), and the tower service running the state machine of one request
//!   ([`idempotency::service`]).
//! - [`store`]: the [`store::Store`] trait and its backends, [`store::MemoryStore`] (embedded) and
//!   [`store::RedisStore`] (Lua scripts in `src/store/lua/`).
//! - [`proxy`]: the pooled upstream client and hop-by-hop header handling.
//! - [`error`]: the gateway's own answers as RFC 9457 problem+json.
//! - [`metrics`]: Prometheus metrics (prometheus-client).
//! - [`admin`]: the admin listener: health, readiness, metrics, key inspection and eviction.
//! - [`app`]: wiring a [`config::Config`] into a server: `app::run(listener, config, shutdown)`.
//! - [`demo`]: a small example payments upstream for the quick start.

pub mod admin;
pub mod app;
pub mod config;
pub mod demo;
pub mod error;
pub mod idempotency;
pub mod metrics;
pub mod proxy;
pub mod store;
