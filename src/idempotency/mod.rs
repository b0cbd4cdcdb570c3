//! The idempotency engine: a tower [`IdempotencyLayer`] whose [`Idempotency`] service runs the
//! state machine of one keyed request around any inner service, and the route table
//! ([`Routes`]). The words it speaks (key, fingerprint, record, policy) are the floor below,
//! [`crate::record`], shared with the store; they are re-exported here under their old paths.

mod admit;
mod body;
mod claimed;
pub(crate) mod grpc;
mod inner;
pub(crate) mod jsonrpc;
mod keyed;
mod layer;
mod lease;
mod live;
mod metrics;
mod outcome;
pub mod repeatability;
mod request_body;
mod response;
mod routes;
mod service;
mod shared;
mod sse;
mod streamed;
pub(crate) mod trace;
mod wait;
pub(crate) mod webhook;

pub use crate::record::json::Pointer;
pub use crate::record::policy::{
    AfterExpiry, ErrorFormat, FingerprintMode, KeySecret, OnInFlight, OnStoreError, Policy,
    PolicyBuilder, Protocol, Ttl, DEFAULT_UPSTREAM,
};
pub use crate::record::{self as record, fingerprint, key, policy};
pub(crate) use body::with_trailers;
pub use inner::{Deadline, NotSent};
pub use layer::IdempotencyLayer;
pub use response::{IDEMPOTENCY_CONTROL, IDEMPOTENT_REPLAYED, TRACEPARENT};
pub(crate) use routes::LiveTable;
pub use routes::Routes;
pub use service::Idempotency;
pub use webhook::WEBHOOK_VERIFIED;

#[cfg(test)]
mod tests;
