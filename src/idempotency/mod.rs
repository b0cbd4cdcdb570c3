//! The idempotency engine: a tower [`IdempotencyLayer`] whose [`Idempotency`] service runs the
//! state machine of one keyed request around any inner service, plus its parts: the key
//! ([`key`]), the request fingerprint ([`fingerprint`]), the stored record and its encoding
//! ([`record`]), the policy of a route ([`policy`]), and the route table ([`Routes`]).

mod body;
pub mod fingerprint;
pub(crate) mod grpc;
mod inner;
pub(crate) mod json;
pub mod key;
mod layer;
mod lease;
mod live;
pub mod policy;
pub mod record;
pub mod repeatability;
mod response;
mod routes;
mod service;
mod shared;
mod sse;
mod streamed;
pub(crate) mod trace;
mod wait;

pub(crate) use body::with_trailers;
pub use inner::{Deadline, NotSent};
pub use json::Pointer;
pub use layer::IdempotencyLayer;
pub use policy::{
    AfterExpiry, ErrorFormat, FingerprintMode, KeySecret, OnInFlight, OnStoreError, Policy,
    PolicyBuilder, Ttl, DEFAULT_UPSTREAM,
};
pub use response::{IDEMPOTENCY_CONTROL, IDEMPOTENT_REPLAYED, TRACEPARENT};
pub use routes::Routes;
pub use service::Idempotency;

#[cfg(test)]
mod tests;
