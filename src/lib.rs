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
//!
//! The one map of the source, floors from the top: the binary and its wiring; the
//! configuration, the client side and the admin listener; the proxy; the engine; the store;
//! the record vocabulary (key, fingerprint, policy, record) that the engine and the store
//! share; and at the bottom the helpers every floor uses (errors, headers, time). Nothing
//! imports what stands above it: the configuration reads TOML into the types of the floors
//! below, and the store knows records, never the engine.
//! Paths are under `src/`.
//!
//! - `main.rs`: the binary: the command line, logging, signals, `check-config`; `demo.rs`, the
//!   quick start's example payments API (the binary's own module).
//! - `app.rs`: the gateway's wiring ([`App`], [`run`]): the store, the layer over the proxy on
//!   worker threads, the admin listener, graceful shutdown; `reload.rs` ([`Reloader`]): a new
//!   configuration checked against the running one and its routes and upstreams put in force,
//!   or refused whole, and the reloads' metric family.
//! - [`config`]: the TOML and `IDEMGATE_` environment users write, read into the engine's and
//!   the store's own types, each value checked as it is read: `config/mod.rs` (the file, the
//!   top-level fields, the environment overlay), `config/checked.rs` (a value read through its
//!   rule, errors naming the field as written), `config/policy.rs` (`[defaults]` and
//!   `[[routes]]`: the table made from the policy's one list of fields, merged over the
//!   built-in policy), `config/store.rs`
//!   (`[store]`, one table per backend), `config/upstream.rs` (`[upstreams.NAME]`, `[tls]`),
//!   `config/telemetry.rs` (`[telemetry]`), `config/human.rs` (durations and sizes as people
//!   write them), `config/webhook.rs` (a webhook route's secrets read from its variable, its
//!   `ttl` covering the senders' retries), `config/written.rs` (each value in the form its
//!   reader reads back) and `config/effective.rs` (the configuration in force as TOML, with
//!   where each value came from: what `check-config` prints).
//! - [`telemetry`] (`telemetry.rs`): the gateway's OpenTelemetry traces: which requests are
//!   sampled, the layer that records their spans, the OTLP export that never blocks.
//! - `listener/`: client connections: `listener/mod.rs` (the accept loop under
//!   `max_client_connections`, one connection served with HTTP/1.1 or HTTP/2, the service that
//!   admits a request and adds the forwarding headers), `listener/watch.rs` (each connection's
//!   watchdog: `client_header_timeout`, `client_idle_timeout`, stalled clients),
//!   `listener/rate.rs` (`client_min_body_rate`: a request body that arrives too slowly, cut),
//!   `listener/cap.rs` (`max_client_connections`, the cap a reload resizes),
//!   `listener/metrics.rs` (its metric families: connections open and closed, the cap).
//! - [`proxy`]: the upstreams as a tower service: `proxy/mod.rs` (routing to a named upstream,
//!   its errors), `proxy/settings.rs` (one upstream's settings, [`proxy::UpstreamConfig`]),
//!   `proxy/upstream.rs` (one upstream's HTTP/1.1 pool or HTTP/2 connection), `proxy/set.rs`
//!   (the upstreams in force, [`proxy::UpstreamSet`], and each worker's pools built for them),
//!   `proxy/connect.rs` (TCP and TLS connections, and which failures mean "not sent"),
//!   `proxy/metrics.rs` (requests and connections counted per upstream).
//! - [`admin`] (`admin.rs`): the admin listener: health, readiness, metrics, the key API.
//! - [`store`]: `store/mod.rs` (the [`Store`] trait, `Inspect`), `store/error.rs`
//!   ([`StoreError`]: a failure by kind, whichever backend it came from), `store/settings.rs`
//!   ([`store::StoreConfig`], the backend chosen with its settings, and what the backends'
//!   settings share: TLS files, the local cache), `store/any.rs` (the binary's dispatch over the
//!   configured backend), `store/cached.rs` (a local cache of completed records in front of
//!   another store), `store/watch.rs` (wake-ups for requests waiting on an in-flight key),
//!   `store/codec.rs` (the record's binary encoding, written by the embedded, Redis and
//!   PostgreSQL stores, whose offsets the scripts in `store/redis/lua/` read), `store/seal.rs`
//!   (records sealed at rest with AES-256-GCM: [`Seal`], the keys), `store/metrics.rs` (the
//!   store's metric families: the local cache, the embedded commits, evictions). One folder per backend,
//!   each with its `settings.rs`: `store/memory/mod.rs` ([`MemoryStore`], in the process and
//!   bounded) and `store/memory/settings.rs`; the embedded store: `store/embedded/mod.rs`
//!   ([`store::EmbeddedStore`]: durable, in-process, on redb), `store/embedded/settings.rs`,
//!   `store/embedded/writer.rs` (the writer thread's group commit, and what each write does),
//!   `store/embedded/tables.rs` (the redb tables, rows read and written),
//!   `store/embedded/purge.rs` (expired entries purged, records evicted for the bounds),
//!   `store/embedded/file.rs` (the file opened, and reopened after a failed write); the Redis
//!   backend: `store/redis/mod.rs` ([`RedisStore`]), `store/redis/settings.rs`
//!   ([`store::RedisSettings`], [`Topology`]), `store/redis/topology.rs` (one server, Cluster or
//!   Sentinel), `store/redis/events.rs` (pub/sub: waiters woken, local caches told of
//!   evictions); the PostgreSQL backend: `store/postgres/mod.rs` ([`store::PostgresStore`], its
//!   pool and reaper), `store/postgres/settings.rs` ([`store::PostgresSettings`]),
//!   `store/postgres/schema.rs` (the table, its version and migration, the statements),
//!   `store/postgres/listen.rs` (evictions heard by `LISTEN`, for the local caches).
//! - [`idempotency`]: the engine: `idempotency/mod.rs`, `idempotency/layer.rs`
//!   ([`IdempotencyLayer`]), `idempotency/service.rs` (the service: admit, then run),
//!   `idempotency/outcome.rs` (what a request came to, and how it is counted),
//!   `idempotency/metrics.rs` (the engine's metric families: outcomes, unsettled calls, store
//!   operations' latency, records it could not use),
//!   `idempotency/admit.rs` (every decision taken before the first await),
//!   `idempotency/keyed.rs` (the keyed path: body, key, fingerprint, claim, and what the
//!   store's answer says), `idempotency/request_body.rs` (a keyed request's body read whole,
//!   its key found in a header or the body), `idempotency/claimed.rs` (the claimed call, in a
//!   task of its own), `idempotency/inner.rs` (the inner service's bound, [`NotSent`],
//!   `Deadline`), `idempotency/lease.rs` (a claim's life cycle: renew, complete, release, take
//!   back), `idempotency/response.rs` (what is stored and replayed),
//!   `idempotency/wait.rs` (a duplicate waiting for the replay), `idempotency/streamed.rs` (a
//!   claimed call's streamed answer: its first answer, the recording of the rest),
//!   `idempotency/live.rs` (a streamed answer's tape, and duplicates attached to it),
//!   `idempotency/sse.rs` (resuming an
//!   event stream after `Last-Event-ID`), `idempotency/shared.rs` (what
//!   the layer's clones share),
//!   `idempotency/routes.rs` ([`Routes`]), `idempotency/trace.rs` (W3C `traceparent`, and
//!   what the engine's spans carry as OTel spans),
//!   `idempotency/repeatability.rs` (OASIS Repeatable Requests), `idempotency/grpc.rs` (gRPC
//!   calls: the unary rule, recorded statuses, refusals as gRPC statuses),
//!   `idempotency/jsonrpc/mod.rs` (JSON-RPC and MCP routes: a POST body read into a keyed call
//!   or passed on, its fingerprint), `idempotency/jsonrpc/answer.rs` (the terminal response of
//!   a call, from JSON or an event stream, recorded or released),
//!   `idempotency/jsonrpc/reply.rs` (replays with the retry's id, refusals as JSON-RPC errors),
//!   `idempotency/jsonrpc/cancel.rs` (the claimed calls whose cancellation is not passed on),
//!   `idempotency/jsonrpc/metrics.rs` (their metric family), `idempotency/jsonrpc/tests.rs`,
//!   `idempotency/webhook.rs` (webhook deliveries: signatures checked, the event id as key, the
//!   rejections' metric family), `idempotency/body.rs` (the capped body collector), and
//!   `idempotency/tests.rs` (every
//!   branch of the protocol without sockets).
//! - [`record`]: the vocabulary of the engine and the store: `record/mod.rs` (what a record
//!   holds: token, stored response, entry state), `record/key.rs` (the key, read, derived and
//!   scoped), `record/fingerprint.rs`, `record/webhook.rs` (a webhook route's sender, secrets
//!   and rejections), `record/policy.rs` ([`Policy`]: the one list of its fields, from which the struct, its
//!   defaults, its builder and the TOML table come, and their rules),
//!   `record/json/mod.rs` with `record/json/parse.rs`, `record/json/canonical.rs` and
//!   `record/json/pointer.rs` (strict JSON, its canonical form, RFC 6901 pointers;
//!   `record/json/differential.rs`: their property tests against serde_json and an exact
//!   oracle).
//! - `headers.rs` (hop-by-hop headers, framing, what the gateway admits), [`error`]
//!   (`error.rs`: problem+json, Stripe-shaped and gRPC answers, `ConfigError`),
//!   `grpc_status.rs` (gRPC's status codes, the trailers that carry them, a trailers-only
//!   answer), [`metrics`] (`metrics.rs`: the registry in which each subsystem
//!   registers the families it counts, and its encoding), `tls.rs` (certificates, keys, rustls configurations, the listener's pair in force),
//!   [`time`] (`time.rs`: every duration from outside bounded, every deadline, expiry and date
//!   made without overflow or panic).
//! - `fuzzing.rs`: the parsers' entry points for the fuzz targets in `fuzz/` (the key, the
//!   record decoder, the configuration, JSON), built with the `fuzzing` feature and in tests,
//!   which replay the fuzz corpus through them.
//! - `lib.rs`: this page.
//!
//! Beside `src/`: `tests/` (integration tests over real sockets, real `redis-server`s and
//! upstreams; fixtures in `tests/common/`), `testkit/` (the Redis, PostgreSQL, gateway process,
//! tmpfs and Python SDK fixtures `tests/` and the benchmark share), `examples/axum_payments.rs` (the layer in an axum app), `loadtest/` (the
//! benchmark; every measured figure is in its README), `docs/` (the reference, one page per
//! topic), `config/` (example configurations), `scripts/test` (the test command) and
//! `.ci/run` (CI, which calls it).

#![warn(missing_docs)]

pub mod admin;
mod app;
pub mod config;
pub mod error;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod grpc_status;
mod headers;
pub mod idempotency;
mod listener;
pub mod metrics;
pub mod proxy;
pub mod record;
mod reload;
pub mod store;
pub mod telemetry;
pub mod time;
mod tls;

pub use app::{run, App, AppError};
pub use error::ConfigError;
pub use idempotency::{
    AfterExpiry, ErrorFormat, FingerprintMode, Idempotency, IdempotencyLayer, KeySecret, NotSent,
    OnInFlight, OnStoreError, Policy, PolicyBuilder, Protocol, Routes, Ttl, IDEMPOTENT_REPLAYED,
};
pub use metrics::{Families, Metrics};
pub use record::webhook::{Sender, WebhookSecrets};
pub use reload::{ReloadError, Reloader};
pub use store::{
    CachedStore, EmbeddedSettings, EmbeddedStore, Evictions, LocalCache, MemoryStore,
    PostgresSettings, PostgresStore, RedisSettings, RedisStore, Seal, SealKeys, SealMode, Store,
    StoreError, Topology,
};
