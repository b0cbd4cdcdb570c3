//! A keyed request's body as the keyed path reads it before the claim: read whole (within
//! `max_body`), and the key found in a header or in the body (`key_from_body`, `derived_key`).

use axum::body::Body;
use bytes::Bytes;
use http::header;
use http::request::Parts;

use super::body::{collect_capped, replay_then_rest, Collected};
use super::grpc;
use crate::error::GatewayError;
use crate::record::json::{self, Json};
use crate::record::key::{IdempotencyKey, KeySource};
use crate::record::policy::{FingerprintMode, Policy};

/// A keyed request's `body` read whole (a gRPC call's as the unary rule reads it), or what
/// becomes of it instead: passed on without idempotency (a streaming gRPC call; a body too large
/// to look for a key in when no header carried one), or refused.
pub(super) async fn whole_body(
    body: Body,
    grpc: bool,
    has_key: bool,
    policy: &Policy,
) -> Result<Bytes, Result<Body, GatewayError>> {
    let collected = if grpc {
        match grpc::collect_call(body, policy.max_body).await {
            Ok(grpc::Call::Unary(collected)) => Ok(collected),
            Ok(grpc::Call::Streaming { read, rest }) => {
                return Err(Ok(replay_then_rest(read, rest)))
            }
            Err(e) => Err(e),
        }
    } else {
        collect_capped(body, policy.max_body).await
    };
    match collected {
        Ok(Collected::Whole(body, _)) => Ok(body),
        Ok(Collected::TooLarge { read, rest }) if !has_key && !policy.require_key => {
            Err(Ok(replay_then_rest(read, rest)))
        }
        Ok(Collected::TooLarge { .. }) => Err(Err(GatewayError::BodyTooLarge {
            limit: policy.max_body,
        })),
        Err(_) => Err(Err(GatewayError::InvalidBody)),
    }
}

/// A keyed request's body as the protocol reads it before the claim.
pub(super) struct Found<'b> {
    // The body parsed as JSON, when something needs it: a canonical fingerprint, or a key that
    // no header carried.
    pub(super) doc: Option<Json<'b>>,
    // The key and where it came from; none when neither a header nor the body carries one.
    pub(super) key: Option<(IdempotencyKey, KeySource)>,
}

/// The key of a request, from `key` (a header's) or else from its `body`; refused when the body
/// does not parse as the JSON its type says, or when the route requires a key and there is none.
pub(super) fn find_key<'b>(
    policy: &Policy,
    parts: &Parts,
    body: &'b [u8],
    key: Option<IdempotencyKey>,
) -> Result<Found<'b>, GatewayError> {
    let json_typed = parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|ct| json::is_json_type(ct.as_bytes()));
    let doc = if json_typed && (policy.fingerprint == FingerprintMode::Json || key.is_none()) {
        Some(json::parse(body).map_err(|e| GatewayError::InvalidJson(e.0))?)
    } else {
        None
    };
    let key = match key {
        Some(key) => Some((key, KeySource::Header)),
        None => match body_key(policy, doc.as_ref())? {
            None if policy.require_key => return Err(GatewayError::MissingKey),
            found => found,
        },
    };
    Ok(Found { doc, key })
}

/// The key a JSON body carries (`key_from_body`), or else the one derived from its fields
/// (`derived_key`); `None` when neither is there (or the body is not JSON).
fn body_key(
    policy: &Policy,
    doc: Option<&Json<'_>>,
) -> Result<Option<(IdempotencyKey, KeySource)>, GatewayError> {
    let Some(doc) = doc else { return Ok(None) };
    for pointer in &policy.key_from_body {
        if let Some(key) = IdempotencyKey::from_json(doc, pointer, policy.key_max_len)? {
            return Ok(Some((key, KeySource::Body)));
        }
    }
    if let Some(secret) = &policy.key_secret {
        if let Some(key) = IdempotencyKey::derived(doc, &policy.derived_key, secret) {
            return Ok(Some((key, KeySource::Derived)));
        }
    }
    Ok(None)
}
