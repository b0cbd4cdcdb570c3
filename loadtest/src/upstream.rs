//! The fast fixed-response upstream: answers every request with the same body (after an
//! optional delay) and counts executions; `GET /__count` tells the count without counting itself.
//! With `count_keys`, it also counts executions per `Idempotency-Key` (the gateway forwards the
//! header), and `GET /__keys` tells `<keys> <executions> <keys executed more than once>`.
//!
//! The body looks like a payments API's JSON (a list of payment objects with random ids, amounts
//! and customers), so that what the Redis store's compression does to it is what it would do in
//! production: LZ4 roughly halves it. `/incompressible` answers random bytes of the same size
//! instead, for the worst case of the stored-bytes figure.

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

/// Serve forever on `addr`; with `tls`, over TLS (mutual: a client certificate is required).
pub async fn serve(
    addr: SocketAddr,
    body_size: usize,
    delay: Duration,
    tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    count_keys: bool,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    let body = Bytes::from(json_body(body_size));
    let noise = Bytes::from(random_bytes(body_size, 0x5eed));
    let count = Arc::new(AtomicU64::new(0));
    let per_key: Option<Arc<PerKey>> = count_keys.then(Default::default);
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let (body, noise, count, tls, per_key) = (
            body.clone(),
            noise.clone(),
            count.clone(),
            tls.clone(),
            per_key.clone(),
        );
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let (body, noise, count, per_key) =
                    (body.clone(), noise.clone(), count.clone(), per_key.clone());
                async move {
                    if req.uri().path() == "/__count" {
                        let n = count.load(Ordering::SeqCst).to_string();
                        return Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(n))));
                    }
                    if req.uri().path() == "/__keys" {
                        let text = per_key.as_deref().map_or(String::new(), PerKey::summary);
                        return Ok(Response::new(Full::new(Bytes::from(text))));
                    }
                    count.fetch_add(1, Ordering::SeqCst);
                    if let (Some(per_key), Some(key)) =
                        (&per_key, req.headers().get("idempotency-key"))
                    {
                        per_key.executed(key.as_bytes());
                    }
                    let path = req.uri().path().to_string();
                    // Read the request body so the connection can be reused.
                    let _ = req.into_body().collect().await;
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    let (body, content_type) = if req_path_is_incompressible(&path) {
                        (noise, "application/octet-stream")
                    } else {
                        (body, "application/json")
                    };
                    let mut resp = Response::new(Full::new(body));
                    resp.headers_mut()
                        .insert("content-type", http::HeaderValue::from_static(content_type));
                    Ok(resp)
                }
            });
            let mut http = http1::Builder::new();
            http.keep_alive(true);
            match tls {
                None => {
                    let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                }
                Some(acceptor) => {
                    if let Ok(stream) = acceptor.accept(stream).await {
                        let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                    }
                }
            }
        });
    }
}

/// Executions per `Idempotency-Key`.
#[derive(Default)]
struct PerKey(std::sync::Mutex<std::collections::HashMap<Vec<u8>, u32>>);

impl PerKey {
    fn executed(&self, key: &[u8]) {
        *self.0.lock().unwrap().entry(key.to_vec()).or_default() += 1;
    }

    /// `<keys> <executions> <keys executed more than once>`.
    fn summary(&self) -> String {
        let map = self.0.lock().unwrap();
        let executions: u64 = map.values().map(|&n| n as u64).sum();
        let twice = map.values().filter(|&&n| n > 1).count();
        format!("{} {executions} {twice}", map.len())
    }
}

fn req_path_is_incompressible(path: &str) -> bool {
    path.starts_with("/incompressible")
}

/// Deterministic pseudo-random bytes (xorshift64).
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// `size` bytes of JSON in the shape of a payments API's list response, with random ids,
/// amounts, customers and times, padded to the exact size.
pub fn json_body(size: usize) -> Vec<u8> {
    const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let r = random_bytes(size * 2 + 64, 0x9e37_79b9_7f4a_7c15);
    let mut ri = r.iter().copied().cycle();
    let mut id = |n: usize| -> String {
        (0..n)
            .map(|_| ALNUM[ri.next().unwrap() as usize % ALNUM.len()] as char)
            .collect()
    };
    let currencies = ["eur", "usd", "gbp", "chf"];
    let mut out = String::from("{\"object\":\"list\",\"data\":[");
    let mut i = 0u64;
    loop {
        let seed = id(8)
            .bytes()
            .fold(0u64, |a, b| a.wrapping_mul(31).wrapping_add(b as u64));
        let item = format!(
            "{{\"id\":\"pi_{}\",\"object\":\"payment_intent\",\"amount\":{},\"currency\":\"{}\",\"status\":\"succeeded\",\"created\":{},\"customer\":\"cus_{}\",\"description\":\"Order {}\",\"metadata\":{{\"order_id\":\"{}\"}}}}",
            id(24),
            100 + seed % 500_000,
            currencies[(seed % 4) as usize],
            1_764_000_000 + seed % 1_000_000,
            id(14),
            seed % 100_000,
            seed % 10_000_000,
        );
        // Room for this item, its comma and the closing `],"pad":""}`.
        if out.len() + item.len() + 1 + 12 > size {
            break;
        }
        if i > 0 {
            out.push(',');
        }
        out.push_str(&item);
        i += 1;
    }
    out.push_str("],\"pad\":\"");
    let pad = size.saturating_sub(out.len() + 2);
    out.push_str(&id(pad));
    out.push_str("\"}");
    let mut bytes = out.into_bytes();
    bytes.truncate(size);
    bytes
}
