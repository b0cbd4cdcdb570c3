//! The fast fixed-response upstream: answers every request with the same body (after an
//! optional delay) and counts executions; `GET /__count` tells the count without counting itself.
//! With `count_keys`, it also counts executions per `Idempotency-Key` (the gateway forwards the
//! header), and `GET /__keys` tells `<keys> <executions> <keys executed more than once>`.
//!
//! The body looks like a payments API's JSON (a list of payment objects with random ids, amounts
//! and customers), so that what the Redis store's compression does to it is what it would do in
//! production: LZ4 roughly halves it. `/incompressible` answers random bytes of the same size
//! instead, for the worst case of the stored-bytes figure.
//!
//! `?size=N&events=E&gap_ms=G` on any path answers a server-sent-events stream instead (the
//! `stream` section): `text/event-stream`, chunked (no `Content-Length`), `E` events of `N`
//! bytes in all, one chunk each, the first with the head at once and each next one `G` ms after
//! ([`sse_events`] makes them, so that the harness knows the bytes to expect).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Either, Full};
use hyper::body::{Frame, Incoming};
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
    let tool_result = Bytes::from(tool_result(body_size));
    let count = Arc::new(AtomicU64::new(0));
    let per_key: Option<Arc<PerKey>> = count_keys.then(Default::default);
    let streams = Arc::new(Streams::default());
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let (body, noise, tool_result, count, tls, per_key, streams) = (
            body.clone(),
            noise.clone(),
            tool_result.clone(),
            count.clone(),
            tls.clone(),
            per_key.clone(),
            streams.clone(),
        );
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let (body, noise, tool_result, count, per_key, streams) = (
                    body.clone(),
                    noise.clone(),
                    tool_result.clone(),
                    count.clone(),
                    per_key.clone(),
                    streams.clone(),
                );
                async move {
                    let text = |t: String| Response::new(Either::Left(Full::new(Bytes::from(t))));
                    if req.uri().path() == "/__count" {
                        let n = count.load(Ordering::SeqCst).to_string();
                        return Ok::<_, Infallible>(text(n));
                    }
                    if req.uri().path() == "/__keys" {
                        return Ok(text(
                            per_key.as_deref().map_or(String::new(), PerKey::summary),
                        ));
                    }
                    count.fetch_add(1, Ordering::SeqCst);
                    if let (Some(per_key), Some(key)) =
                        (&per_key, req.headers().get("idempotency-key"))
                    {
                        per_key.executed(key.as_bytes());
                    }
                    let path = req.uri().path().to_string();
                    let events = req.uri().query().and_then(EventsQuery::parse);
                    // Read the request body so the connection can be reused.
                    let _ = req.into_body().collect().await;
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    if let Some(q) = events {
                        return Ok(streams.answer(q));
                    }
                    let (body, content_type) = if req_path_is_incompressible(&path) {
                        (noise, "application/octet-stream")
                    } else if path.starts_with("/mcp") {
                        (tool_result, "application/json")
                    } else {
                        (body, "application/json")
                    };
                    let mut resp = Response::new(Either::Left(Full::new(body)));
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

/// The query of an event stream: `size=N&events=E&gap_ms=G`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct EventsQuery {
    size: usize,
    events: usize,
    gap_ms: u64,
}

impl EventsQuery {
    /// `None` unless `size` is there (any other query is no event stream).
    fn parse(query: &str) -> Option<EventsQuery> {
        let field = |name: &str| {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse::<u64>().ok())
        };
        Some(EventsQuery {
            size: field("size")? as usize,
            events: field("events").unwrap_or(1).max(1) as usize,
            gap_ms: field("gap_ms").unwrap_or(0),
        })
    }
}

/// An event stream's chunks, by its size and number of events.
type ByShape = HashMap<(usize, usize), Arc<[Bytes]>>;

/// The event streams answered so far, made once each.
#[derive(Default)]
struct Streams(Mutex<ByShape>);

impl Streams {
    fn answer(&self, q: EventsQuery) -> Response<Either<Full<Bytes>, Events>> {
        let chunks = self
            .0
            .lock()
            .unwrap()
            .entry((q.size, q.events))
            .or_insert_with(|| sse_events(q.size, q.events).into())
            .clone();
        let mut resp = Response::new(Either::Right(Events {
            chunks,
            next: 0,
            gap: Duration::from_millis(q.gap_ms),
            sleep: None,
        }));
        resp.headers_mut().insert(
            "content-type",
            http::HeaderValue::from_static("text/event-stream"),
        );
        resp
    }
}

/// `size` bytes of server-sent events in `events` events (`id: I`, then one `data:` line of the
/// payments JSON), one chunk each.
pub fn sse_events(size: usize, events: usize) -> Vec<Bytes> {
    let json = json_body(size);
    let heads: Vec<String> = (0..events).map(|i| format!("id: {i}\ndata: ")).collect();
    let overhead: usize = heads.iter().map(|h| h.len() + 2).sum();
    let data = size.saturating_sub(overhead).max(events);
    let mut from = 0;
    heads
        .iter()
        .enumerate()
        .map(|(i, head)| {
            // An even share, the last event taking what is left.
            let to = if i + 1 == events {
                data
            } else {
                data * (i + 1) / events
            };
            let mut event = head.clone().into_bytes();
            event.extend(json.iter().cycle().skip(from).take(to - from));
            event.extend_from_slice(b"\n\n");
            from = to;
            Bytes::from(event)
        })
        .collect()
}

/// An event stream's body: the first chunk at once, each next one `gap` after the one before.
struct Events {
    chunks: Arc<[Bytes]>,
    next: usize,
    gap: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl hyper::body::Body for Events {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        if this.next > 0 && !this.gap.is_zero() && this.next < this.chunks.len() {
            let gap = this.gap;
            let sleep = this
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(gap)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.sleep = None;
        }
        let chunk = this.chunks.get(this.next).cloned();
        this.next += 1;
        Poll::Ready(chunk.map(|c| Ok(Frame::data(c))))
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

/// The answer to a POST under `/mcp` (the `mcp` section): an MCP `tools/call` result of about
/// `size` bytes, its text the padding, as a JSON-RPC response to id 1.
pub fn tool_result(size: usize) -> String {
    let head = r#"{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":""#;
    let tail = r#""}],"isError":false}}"#;
    let text = "x".repeat(size.saturating_sub(head.len() + tail.len()));
    format!("{head}{text}{tail}")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_stream_is_its_size_in_its_events() {
        for (size, events) in [(1024, 4), (65536, 16), (1024, 2)] {
            let chunks = sse_events(size, events);
            assert_eq!(chunks.len(), events);
            assert_eq!(chunks.iter().map(Bytes::len).sum::<usize>(), size);
            for (i, c) in chunks.iter().enumerate() {
                let text = std::str::from_utf8(c).unwrap();
                assert!(text.starts_with(&format!("id: {i}\ndata: ")), "{text:.20}");
                assert!(text.ends_with("\n\n") && text.matches('\n').count() == 3);
            }
        }
        let q = EventsQuery::parse("size=65536&events=16&gap_ms=5").unwrap();
        assert_eq!((q.size, q.events, q.gap_ms), (65536, 16, 5));
        assert!(EventsQuery::parse("events=16").is_none());
    }
}
