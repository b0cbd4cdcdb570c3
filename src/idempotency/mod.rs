//! The idempotency engine: a tower [`IdempotencyLayer`] whose [`Idempotency`] service runs the
//! state machine of one keyed request around any inner service, plus its parts: the key
//! ([`key`]), the request fingerprint ([`fingerprint`]), the stored record and its encoding
//! ([`record`]), the policy of a route ([`policy`]), and the route table ([`Routes`]).

mod body;
pub mod fingerprint;
pub mod json;
pub mod key;
mod layer;
pub mod policy;
pub mod record;
mod routes;
mod service;

pub use layer::IdempotencyLayer;
pub use policy::{
    FingerprintMode, KeySecret, OnInFlight, OnStoreError, Policy, PolicyBuilder, DEFAULT_UPSTREAM,
};
pub use routes::Routes;
pub use service::{
    Deadline, Idempotency, NotSent, IDEMPOTENCY_CONTROL, IDEMPOTENT_REPLAYED, TRACEPARENT,
};

#[cfg(test)]
mod tests;
