//! Idempotency: the key, the fingerprint, the stored record, and the service that runs the state
//! machine of one keyed request ([`service`]).

pub mod fingerprint;
pub mod key;
pub mod record;
pub mod service;

pub use service::{Gateway, RouteTable, IDEMPOTENT_REPLAYED};
