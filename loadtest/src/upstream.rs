//! The fast fixed-response upstream: answers every request with the same body (after an
//! optional delay) and counts executions; `GET /__count` tells the count without counting itself.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// Serve forever on `addr`.
pub async fn serve(addr: SocketAddr, body_size: usize, delay: Duration) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    let body = Bytes::from(
        (0..body_size)
            .map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789"[i % 36])
            .collect::<Vec<u8>>(),
    );
    let count = Arc::new(AtomicU64::new(0));
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let (body, count) = (body.clone(), count.clone());
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let (body, count) = (body.clone(), count.clone());
                async move {
                    if req.uri().path() == "/__count" {
                        let n = count.load(Ordering::SeqCst).to_string();
                        return Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(n))));
                    }
                    count.fetch_add(1, Ordering::SeqCst);
                    // Read the request body so the connection can be reused.
                    let _ = req.into_body().collect().await;
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    let mut resp = Response::new(Full::new(body));
                    resp.headers_mut().insert(
                        "content-type",
                        http::HeaderValue::from_static("application/json"),
                    );
                    Ok(resp)
                }
            });
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
