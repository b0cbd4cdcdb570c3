//! A small axum app with one handler, for the library's figure: the same app with and without
//! idemgate's layer on its route, so that a library user sees what the layer costs in-process.

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Bytes;
use axum::routing::post;
use axum::Router;
use idemgate::{IdempotencyLayer, MemoryStore, Policy};

/// Serve forever on `addr`: `POST /v1/payments` answers the JSON body of `body_size` bytes the
/// upstream answers; with `layer`, through idemgate's layer on the memory store.
pub async fn serve(addr: SocketAddr, body_size: usize, layer: bool) -> std::io::Result<()> {
    let body = Bytes::from(crate::upstream::json_body(body_size));
    let handler = post(move |_request: Bytes| {
        let body = body.clone();
        async move {
            (
                http::StatusCode::CREATED,
                [(http::header::CONTENT_TYPE, "application/json")],
                body,
            )
        }
    });
    let route = if layer {
        let policy = Policy::builder()
            .ttl(Duration::from_secs(3600))
            .build()
            .expect("a valid policy");
        handler.layer(IdempotencyLayer::new(MemoryStore::new(), policy))
    } else {
        handler
    };
    let app = Router::new().route("/v1/payments", route);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app).await
}
