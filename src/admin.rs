//! The admin listener, apart from traffic: `GET /healthz` (the process answers), `GET /readyz`
//! (the store answers; 503 otherwise), `GET /metrics` (Prometheus text), and the key API:
//! `GET /keys/{key}` and `DELETE /keys/{key}` (the caller's scope given as query parameters named
//! after the route's scope headers), `DELETE /keys?confirm=all`. The key API needs
//! `Authorization: Bearer <admin_token>` and is off when no token is configured.

// Handlers here return a ready refusal as their error; the admin API is no hot path, so the size
// of `Result<_, Response>` does not matter.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use base64::Engine;
use serde_json::{json, Value};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::sensitive_headers::SetSensitiveRequestHeadersLayer;
use tower_http::trace::{
    DefaultMakeSpan, DefaultOnFailure, DefaultOnRequest, DefaultOnResponse, HttpMakeClassifier,
    TraceLayer,
};
use tracing::Level;

use crate::error::Problem;
use crate::idempotency::Routes;
use crate::metrics::Metrics;
use crate::record::key::{hex, IdempotencyKey};
use crate::record::EntryState;
use crate::store::{Inspect, StoreError};

/// What the admin handlers share.
pub struct AdminState<S> {
    store: S,
    metrics: Metrics,
    // The key API's bearer token; none: the key API is off.
    admin_token: Box<dyn Fn() -> Option<String> + Send + Sync>,
    // The routes in force now (a reload may change them).
    routes: Box<dyn Fn() -> Routes + Send + Sync>,
}

/// The admin router over `store`; the key API answers requests that carry the token
/// `admin_token` gives, and scopes a key by the policy `routes` gives (each called per request:
/// the settings in force).
pub fn router<S: Inspect>(
    store: S,
    metrics: Metrics,
    admin_token: impl Fn() -> Option<String> + Send + Sync + 'static,
    routes: impl Fn() -> Routes + Send + Sync + 'static,
) -> Router {
    let state = Arc::new(AdminState {
        store,
        metrics,
        admin_token: Box::new(admin_token),
        routes: Box::new(routes),
    });
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz::<S>))
        .route("/metrics", get(metrics_text::<S>))
        .route("/keys/{key}", get(inspect::<S>).delete(evict::<S>))
        .route("/keys", axum::routing::delete(evict_all::<S>))
        .with_state(state)
        .layer(
            tower::ServiceBuilder::new()
                // The admin token travels in Authorization: never in a log line.
                .layer(SetSensitiveRequestHeadersLayer::new([
                    header::AUTHORIZATION,
                ]))
                .layer(trace_layer())
                .layer(CatchPanicLayer::custom(|_| {
                    problem(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "internal",
                        "the admin request failed; see the gateway's log",
                    )
                })),
        )
}

async fn readyz<S: Inspect>(State(s): State<Arc<AdminState<S>>>) -> Response {
    match tokio::time::timeout(Duration::from_secs(2), s.store.ping()).await {
        Ok(Ok(())) => (StatusCode::OK, "ready\n").into_response(),
        Ok(Err(e)) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            &format!("store: {e}"),
        ),
        Err(_) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            "the store did not answer in 2 s",
        ),
    }
}

async fn metrics_text<S: Inspect>(State(s): State<Arc<AdminState<S>>>) -> Response {
    if let Some((entries, bytes)) = s.store.local_cache_size() {
        s.metrics
            .families::<crate::store::StoreMetrics>()
            .local_cache_size(entries, bytes);
    }
    let mut resp = s.metrics.encode().into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    resp
}

fn problem(status: StatusCode, kind: &'static str, detail: &str) -> Response {
    Problem::new(status, kind, detail).into_response()
}

/// `Ok` when the request carries the admin token; the refusal otherwise.
fn authorize<S>(s: &AdminState<S>, headers: &HeaderMap) -> Result<(), Response> {
    let Some(expected) = (s.admin_token)() else {
        return Err(problem(
            StatusCode::NOT_FOUND,
            "admin-disabled",
            "the key API is off: set [admin] admin_token (or IDEMGATE_ADMIN_TOKEN) to turn it on",
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .unwrap_or("");
    if constant_time_eq(given.as_bytes(), expected.as_bytes()) {
        Ok(())
    } else {
        let mut resp = problem(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid admin bearer token is required",
        );
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"idemgate-admin\""),
        );
        Err(resp)
    }
}

/// The credentials of a `Bearer` authorization: the scheme is case-insensitive and may be
/// followed by several spaces (RFC 9110 section 11.1 and 11.4).
fn bearer_token(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start_matches(' '))
}

/// Compare without an early exit, so timing does not reveal how much of the token matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() != b.len()) as u8;
    for (i, x) in b.iter().enumerate() {
        diff |= x ^ a.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// The store address of `key` for the scope the query gives: `route` (a request path, to pick
/// the route's policy; default: no route) and one parameter per scope header of that policy.
fn scoped<S>(
    s: &AdminState<S>,
    key: &str,
    query: &HashMap<String, String>,
) -> Result<crate::record::key::ScopedKey, Response> {
    let routes = (s.routes)();
    let route = routes.policy_for(query.get("route").map(String::as_str).unwrap_or("/"));
    let key = IdempotencyKey::parse(key.as_bytes(), route.key_max_len)
        .map_err(|e| problem(StatusCode::BAD_REQUEST, "invalid-key", &e.to_string()))?;
    // The route's scope as requests have it (with Repeatable Requests' client id).
    let (_, scope_headers) = crate::idempotency::repeatability::key_headers(route);
    let mut scope = HeaderMap::new();
    for name in &scope_headers {
        if let Some(v) = query.get(name.as_str()) {
            let v = HeaderValue::from_str(v).map_err(|_| {
                problem(
                    StatusCode::BAD_REQUEST,
                    "invalid-scope",
                    &format!("bad value for {name}"),
                )
            })?;
            scope.insert(name.clone(), v);
        }
    }
    // Scope cookies come as `cookie.NAME=VALUE` parameters.
    let jar: Vec<String> = route
        .scope_cookies
        .iter()
        .filter_map(|name| {
            query
                .get(&format!("cookie.{name}"))
                .map(|v| format!("{name}={v}"))
        })
        .collect();
    if !jar.is_empty() {
        let v = HeaderValue::from_str(&jar.join("; ")).map_err(|_| {
            problem(
                StatusCode::BAD_REQUEST,
                "invalid-scope",
                "bad value for a scope cookie",
            )
        })?;
        scope.insert(header::COOKIE, v);
    }
    Ok(key.scoped(&scope, &scope_headers, &route.scope_cookies))
}

/// The store address of `key` for a caller holding the admin token; the refusal otherwise.
fn authorized_key<S>(
    s: &AdminState<S>,
    headers: &HeaderMap,
    key: &str,
    query: &HashMap<String, String>,
) -> Result<crate::record::key::ScopedKey, Response> {
    authorize(s, headers)?;
    scoped(s, key, query)
}

async fn inspect<S: Inspect>(
    State(s): State<Arc<AdminState<S>>>,
    Path(key): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let scoped = match authorized_key(&s, &headers, &key, &query) {
        Ok(k) => k,
        Err(refused) => return refused,
    };
    let found = match s.store.inspect(&scoped).await {
        Ok(found) => found,
        Err(e) => {
            let (status, kind) = match e {
                StoreError::Unreadable(_) => {
                    (StatusCode::INTERNAL_SERVER_ERROR, "record-unreadable")
                }
                StoreError::Decode(_) => (StatusCode::INTERNAL_SERVER_ERROR, "corrupt-record"),
                _ => (StatusCode::SERVICE_UNAVAILABLE, "store-unavailable"),
            };
            return problem(status, kind, &e.to_string());
        }
    };
    let Some(found) = found else {
        return problem(
            StatusCode::NOT_FOUND,
            "no-such-key",
            "no record for this key and scope",
        );
    };
    let with_body = query.get("body").is_some_and(|v| v == "1" || v == "true");
    let entry = &found.entry;
    let mut fields = serde_json::Map::new();
    for (name, value) in [
        ("store_key", Value::from(scoped.store_name())),
        ("fingerprint", hex(&entry.fingerprint.0).into()),
        ("written_at", rfc3339_ms(entry.written_ms).into()),
        (
            "expires_in_ms",
            found.expires_in.map(|d| d.as_millis() as u64).into(),
        ),
        ("stored_bytes", found.stored_bytes.into()),
    ] {
        fields.insert(name.into(), value);
    }
    match &entry.state {
        EntryState::InFlight => {
            fields.insert("state".into(), "in_flight".into());
        }
        EntryState::NotReplayable => {
            fields.insert("state".into(), "not_replayable".into());
        }
        EntryState::Expired(t) => {
            fields.insert("state".into(), "expired".into());
            let status = t.status.map(|s| s.as_u16());
            fields.insert("status".into(), status.map_or(Value::Null, Value::from));
            fields.insert("expired_at".into(), rfc3339_ms(t.expired_ms).into());
        }
        EntryState::Completed(r) => {
            fields.insert("state".into(), "completed".into());
            fields.insert("status".into(), r.status.as_u16().into());
            let header_bytes: usize = r
                .headers
                .iter()
                .map(|(n, v)| n.as_str().len() + v.len())
                .sum();
            fields.insert("header_bytes".into(), header_bytes.into());
            // Names only: values such as Set-Cookie are the caller's secrets.
            let names: Vec<&str> = r.headers.iter().map(|(n, _)| n.as_str()).collect();
            fields.insert("header_names".into(), names.into());
            let trailers: Vec<&str> = r.trailers.iter().map(|(n, _)| n.as_str()).collect();
            fields.insert("trailer_names".into(), trailers.into());
            fields.insert("body_bytes".into(), r.body.len().into());
            let trace = r.traceparent.as_ref().and_then(|t| t.to_str().ok());
            fields.insert("traceparent".into(), trace.map_or(Value::Null, Value::from));
            let source = r.key_source.map(|s| s.as_str());
            fields.insert("key_source".into(), source.map_or(Value::Null, Value::from));
            if with_body {
                fields.insert(
                    "body_base64".into(),
                    base64::engine::general_purpose::STANDARD
                        .encode(&r.body)
                        .into(),
                );
            }
        }
    }
    Json(fields).into_response()
}

async fn evict<S: Inspect>(
    State(s): State<Arc<AdminState<S>>>,
    Path(key): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let scoped = match authorized_key(&s, &headers, &key, &query) {
        Ok(k) => k,
        Err(refused) => return refused,
    };
    match s.store.evict(&scoped).await {
        Ok(true) => {
            tracing::warn!(store_key = %scoped.store_name(), "admin evicted one record");
            Json(json!({ "evicted": 1 })).into_response()
        }
        Ok(false) => problem(
            StatusCode::NOT_FOUND,
            "no-such-key",
            "no record for this key and scope",
        ),
        Err(e) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            &e.to_string(),
        ),
    }
}

async fn evict_all<S: Inspect>(
    State(s): State<Arc<AdminState<S>>>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = authorize(&s, &headers) {
        return refused;
    }
    if query.get("confirm").map(String::as_str) != Some("all") {
        return problem(
            StatusCode::BAD_REQUEST,
            "confirmation-required",
            "evicting every record needs ?confirm=all",
        );
    }
    match s.store.evict_all().await {
        Ok(n) => {
            tracing::warn!(evicted = n, "admin evicted every record");
            Json(json!({ "evicted": n })).into_response()
        }
        Err(e) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            &e.to_string(),
        ),
    }
}

/// A stored time as RFC 3339; one past year 9999 (a damaged record) as its milliseconds.
fn rfc3339_ms(ms: u64) -> String {
    crate::time::rfc3339_ms(ms).unwrap_or_else(|| format!("{ms} ms after the Unix epoch"))
}

/// Request tracing: a span per request at debug level (method, URI, version, and the headers,
/// those marked sensitive shown as such), and the response's status and latency. At the default
/// `info` level it costs a level check per request.
fn trace_layer() -> TraceLayer<HttpMakeClassifier> {
    TraceLayer::new_for_http()
        .make_span_with(
            DefaultMakeSpan::new()
                .level(Level::DEBUG)
                .include_headers(true),
        )
        .on_request(DefaultOnRequest::new().level(Level::DEBUG))
        .on_response(DefaultOnResponse::new().level(Level::DEBUG))
        // An upstream's 5xx is its own business; the gateway logs its own failures itself.
        .on_failure(DefaultOnFailure::new().level(Level::DEBUG))
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"secret-token-123", b"secret-token-123"));
        assert!(!constant_time_eq(b"secret-token-124", b"secret-token-123"));
        assert!(!constant_time_eq(b"secret", b"secret-token-123"));
        assert!(!constant_time_eq(b"secret-token-1234", b"secret-token-123"));
        assert!(!constant_time_eq(b"", b"secret-token-123"));
    }
}
