//! The upstream behind the gateway: a real HTTP server that counts its executions, so that a
//! test can say `assert_eq!(env.upstream.calls(), 1)`.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use http_body::Frame;
use tokio::net::TcpListener;

use super::wait_until;

/// An HTTP upstream that counts its executions. Behaviour per request, by query string:
/// `status=NNN` answers that status, `delay_ms=N` sleeps first, `read_delay_ms=N` sleeps before
/// reading the body (the gateway's writes back up meanwhile), `control=V` adds
/// `Idempotency-Control: V` (`no-store`, `max-age=N`) to the answer; path `/echo` answers the request
/// body as-is; path `/big` answers `bytes=N` bytes. Every other path answers a JSON description
/// of the request with the execution number, so two executions never answer the same bytes.
#[derive(Clone)]
pub struct CountingUpstream {
    pub addr: SocketAddr,
    state: Arc<UpstreamState>,
}

#[derive(Default)]
struct UpstreamState {
    calls: AtomicUsize,
    // The client addresses seen: one per connection.
    peers: Mutex<HashSet<SocketAddr>>,
    delay: Mutex<Duration>,
    last_headers: Mutex<Option<HeaderMap>>,
    last_version: Mutex<Option<axum::http::Version>>,
    // The certificate the client presented on the last request's connection (over TLS).
    last_client_cert: Mutex<Option<Vec<u8>>>,
}

impl CountingUpstream {
    /// Start on a free loopback port.
    pub async fn start() -> Self {
        Self::start_on(TcpListener::bind("127.0.0.1:0").await.unwrap()).await
    }

    /// Start on a free port of the IPv6 loopback address.
    pub async fn start_v6() -> Self {
        Self::start_on(TcpListener::bind("[::1]:0").await.unwrap()).await
    }

    /// Start on a listener the test bound (e.g. [`ReservedPort::listen`](super::ReservedPort),
    /// to bring the upstream up where the gateway already points).
    pub async fn start_on(listener: TcpListener) -> Self {
        let state = Arc::new(UpstreamState::default());
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(state.clone());
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
        });
        CountingUpstream { addr, state }
    }

    /// Start on a free loopback port, speaking TLS with `config` (HTTP/2 or HTTP/1.1, as ALPN
    /// agrees). A client whose handshake fails (an untrusted certificate, a missing client
    /// certificate) gets no request through: `calls()` stays as it was.
    pub async fn start_tls(config: Arc<rustls::ServerConfig>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(UpstreamState::default());
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(state.clone());
        super::tls::serve_tls(listener, config, app);
        CountingUpstream { addr, state }
    }

    /// Every request waits this long before answering.
    pub fn delay(self, d: Duration) -> Self {
        *self.state.delay.lock().unwrap() = d;
        self
    }

    /// How many requests reached the upstream (counted as each arrives, before any delay).
    pub fn calls(&self) -> usize {
        self.state.calls.load(Ordering::SeqCst)
    }

    /// Wait until `n` requests have reached the upstream (a request sent by another task has
    /// been claimed and forwarded, say); panics after 5 s.
    pub async fn wait_for_calls(&self, n: usize) {
        let what = format!("the upstream has been called {n} time(s)");
        wait_until(Duration::from_secs(5), &what, async || self.calls() >= n).await;
    }

    /// How many connections requests came on.
    pub fn connections(&self) -> usize {
        self.state.peers.lock().unwrap().len()
    }

    /// The HTTP version of the last request that reached the upstream.
    pub fn last_version(&self) -> axum::http::Version {
        self.state
            .last_version
            .lock()
            .unwrap()
            .expect("no request reached the upstream")
    }

    /// The certificate (DER) the gateway presented on the connection of the last request that
    /// reached the upstream; none over plain HTTP or without one.
    pub fn last_client_cert(&self) -> Option<Vec<u8>> {
        self.state.last_client_cert.lock().unwrap().clone()
    }

    /// `https://127.0.0.1:PORT`, for an upstream started with [`CountingUpstream::start_tls`].
    pub fn https_url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// The headers of the last request that reached the upstream.
    pub fn last_headers(&self) -> HeaderMap {
        self.state
            .last_headers
            .lock()
            .unwrap()
            .clone()
            .expect("no request reached the upstream")
    }

    pub fn url(&self) -> String {
        // `SocketAddr`'s display brackets an IPv6 address, as a URL wants.
        format!("http://{}", self.addr)
    }
}

#[derive(serde::Deserialize)]
struct Knobs {
    status: Option<u16>,
    delay_ms: Option<u64>,
    read_delay_ms: Option<u64>,
    bytes: Option<usize>,
    control: Option<String>,
    events: Option<usize>,
    gap_ms: Option<u64>,
    fail_after: Option<usize>,
    trailers: Option<bool>,
}

async fn handle(
    State(state): State<Arc<UpstreamState>>,
    Query(knobs): Query<Knobs>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
) -> Response {
    let n = state.calls.fetch_add(1, Ordering::SeqCst) + 1;
    state.peers.lock().unwrap().insert(peer);
    let presented = req.extensions().get::<super::tls::PeerCertificate>();
    *state.last_client_cert.lock().unwrap() =
        presented.and_then(|p| p.0.as_ref()).map(|c| c.to_vec());
    let (parts, body) = req.into_parts();
    *state.last_headers.lock().unwrap() = Some(parts.headers.clone());
    *state.last_version.lock().unwrap() = Some(parts.version);
    if let Some(ms) = knobs.read_delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let body: Bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let delay = knobs
        .delay_ms
        .map(Duration::from_millis)
        .unwrap_or_else(|| *state.delay.lock().unwrap());
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let status = StatusCode::from_u16(knobs.status.unwrap_or(201)).unwrap();
    let call = [("x-call", n.to_string())];
    let mut resp = match parts.uri.path() {
        "/echo" => (
            status,
            call,
            [("content-type", "application/octet-stream")],
            body,
        )
            .into_response(),
        path if path.ends_with("/events") => events(
            n,
            status,
            (knobs.events.unwrap_or(4), knobs.fail_after),
            Duration::from_millis(knobs.gap_ms.unwrap_or(0)),
            knobs.trailers.unwrap_or(false),
        ),
        "/big" => {
            let bytes: Vec<u8> = (0..knobs.bytes.unwrap_or(0))
                .map(|i| (i % 251) as u8)
                .collect();
            (status, call, bytes).into_response()
        }
        path => {
            let key = parts
                .headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok());
            let json = serde_json::json!({
                "call": n,
                "method": parts.method.as_str(),
                "path": path,
                "idempotency_key": key,
                "body_len": body.len(),
            });
            let mut resp = (status, call, axum::Json(json)).into_response();
            resp.headers_mut()
                .append("set-cookie", "a=1".parse().unwrap());
            resp.headers_mut()
                .append("set-cookie", "b=2".parse().unwrap());
            resp
        }
    };
    if let Some(control) = knobs.control {
        resp.headers_mut()
            .insert("idempotency-control", control.parse().unwrap());
    }
    resp
}

/// A server-sent-events answer of `count` events, `gap` apart, each with its `id` and the call's
/// number: `id: 0\ndata: call 1 event 0\n\n`...; with `fail_after`, the body fails (the
/// connection is cut) after that many events; with `trailers`, the events are followed by the
/// trailer `x-call`, which the head announces (`trailer: x-call`).
fn events(
    call: usize,
    status: StatusCode,
    (count, fail_after): (usize, Option<usize>),
    gap: Duration,
    trailers: bool,
) -> Response {
    let events = futures_util::stream::unfold(0, move |i| async move {
        if i == count {
            return None;
        }
        if i > 0 && !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
        if fail_after == Some(i) {
            return Some((Err(std::io::Error::other("cut midway")), count));
        }
        Some((Ok(Frame::data(Bytes::from(sse_event(call, i)))), i + 1))
    });
    let trailers = trailers.then(|| {
        let mut map = HeaderMap::new();
        map.insert("x-call", call.into());
        Ok(Frame::trailers(map))
    });
    let mut headers = HeaderMap::new();
    headers.insert("x-call", call.into());
    headers.insert("content-type", "text/event-stream".parse().unwrap());
    if trailers.is_some() {
        headers.insert("trailer", "x-call".parse().unwrap());
    }
    let frames = events.chain(futures_util::stream::iter(trailers));
    let body = axum::body::Body::new(http_body_util::StreamBody::new(frames));
    (status, headers, body).into_response()
}

/// Event `i` of the `/events` answer to call `call`.
pub fn sse_event(call: usize, i: usize) -> String {
    format!("id: {i}\ndata: call {call} event {i}\n\n")
}
