//! The load generator: HTTP/1.1 keep-alive connections over hyper, closed loop (as fast as the
//! server answers) or open loop at a fixed rate, with latencies in an HDR histogram. In the open
//! loop, a request the server made late is measured from its scheduled time, so a stalled server
//! is charged for the requests it delayed (no coordinated omission). Beside the whole answer's
//! latency, each request's time to its first byte of body (of its head, for an empty body) goes
//! in a histogram of its own: for a streamed answer the two differ.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Which `Idempotency-Key` each request carries.
#[derive(Clone, Debug)]
pub enum Keys {
    /// No key: the pass-through path.
    None,
    /// A fresh key per request: the miss path.
    Unique(String),
    /// Cycling over `n` keys that were already used: the replay path.
    Hot(String, u64),
    /// `per_key` consecutive requests share a key: duplicates arriving together.
    Storm(String, u64),
    /// Stripe webhook deliveries: no `Idempotency-Key`; the body is a Stripe event whose id is
    /// the inner keys' (`evt_<key>`) around the request body, signed as it is sent with
    /// [`WEBHOOK_SECRET`] (a duplicate is signed again, with its own timestamp).
    Stripe(Box<Keys>),
}

/// The secret the benchmark's Stripe deliveries are signed with.
pub const WEBHOOK_SECRET: &str = "whsec_loadtest_0123456789abcdef";

impl Keys {
    fn key(&self, i: u64) -> Option<String> {
        match self {
            Keys::None => None,
            Keys::Unique(p) => Some(format!("{p}-{i}")),
            Keys::Hot(p, n) => Some(format!("{p}-{}", i % n)),
            Keys::Storm(p, per) => Some(format!("{p}-{}", i / per)),
            Keys::Stripe(inner) => inner.key(i),
        }
    }

    /// Request `i`: a POST of `body` to `path` with its key, or the Stripe delivery of its
    /// event.
    fn request(&self, path: &str, body: &Bytes, i: u64) -> http::Request<Full<Bytes>> {
        match self {
            Keys::Stripe(_) => stripe_delivery(path, body, &self.key(i).unwrap_or_default()),
            _ => post(path, body, self.key(i)),
        }
    }
}

/// The Stripe delivery of event `evt_<id>` wrapping `data` (JSON), signed now.
fn stripe_delivery(path: &str, data: &Bytes, id: &str) -> http::Request<Full<Bytes>> {
    let event = stripe_event(id, data);
    http::Request::post(path)
        .header("host", "bench")
        .header("content-type", "application/json")
        .header("stripe-signature", stripe_signature(&event))
        .body(Full::new(event))
        .unwrap()
}

/// The body of Stripe event `evt_<id>` wrapping `data` (JSON).
pub fn stripe_event(id: &str, data: &[u8]) -> Bytes {
    Bytes::from(format!(
        "{{\"id\":\"evt_{id}\",\"object\":\"event\",\"type\":\"payment_intent.succeeded\",\"data\":{}}}",
        String::from_utf8_lossy(data)
    ))
}

/// The `Stripe-Signature` of `body` signed now with [`WEBHOOK_SECRET`], as Stripe signs it:
/// `t=<now>,v1=<HMAC-SHA256 of "t.body">`.
pub fn stripe_signature(body: &[u8]) -> String {
    use hmac::{Hmac, KeyInit, Mac};
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(WEBHOOK_SECRET.as_bytes()).unwrap();
    mac.update(format!("{t}.").as_bytes());
    mac.update(body);
    let sig: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("t={t},v1={sig}")
}

/// How to pace the requests.
#[derive(Clone, Copy, Debug)]
pub enum Pace {
    /// As fast as the server answers.
    Closed,
    /// This many requests per second in all, spread over the connections.
    Rate(f64),
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct Report {
    pub requests: u64,
    pub ok: u64,
    pub conflicts: u64,
    pub errors: u64,
    pub elapsed: Duration,
    /// Latency to the answer's end, µs.
    pub hist: Histogram<u64>,
    /// Latency to the answer's first byte of body (its head, for an empty body), µs.
    pub first_byte: Histogram<u64>,
    /// CPU time per request of the processes involved, when the harness measured it.
    pub cpu: Option<CpuPerRequest>,
}

/// CPU time per request, in µs, of each process in a phase (from the scheduler's exact
/// accounting, see `procs::cpu_ns`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuPerRequest {
    /// The proxy under test: the gateway, or nginx's workers (0 for direct).
    pub proxy: f64,
    pub upstream: f64,
    pub redis: f64,
    /// The load generator (the harness process).
    pub load: f64,
}

impl CpuPerRequest {
    /// All four together: what one request costs the machine.
    pub fn all(&self) -> f64 {
        self.proxy + self.upstream + self.redis + self.load
    }
}

impl Report {
    /// No request yet.
    pub fn empty() -> Self {
        Report {
            requests: 0,
            ok: 0,
            conflicts: 0,
            errors: 0,
            elapsed: Duration::ZERO,
            hist: Histogram::new_with_bounds(1, 60_000_000, 3).unwrap(),
            first_byte: Histogram::new_with_bounds(1, 60_000_000, 3).unwrap(),
            cpu: None,
        }
    }

    pub fn rps(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
    /// Latency at quantile `q`, in milliseconds.
    pub fn ms(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }
    /// Time to the first byte at quantile `q`, in milliseconds.
    pub fn first_byte_ms(&self, q: f64) -> f64 {
        self.first_byte.value_at_quantile(q) as f64 / 1000.0
    }
}

/// The request body every scenario sends unless it says otherwise: a small payment.
pub fn small_request() -> Bytes {
    Bytes::from_static(b"{\"amount\":1000,\"currency\":\"eur\"}")
}

/// A JSON request body of about `bytes` bytes (at least the small payment), shaped like a
/// payments API's order: an amount, a customer, a request id, and line items with a client
/// timestamp each, the kind of document `fingerprint = "json"` canonicalises.
pub fn json_request(bytes: usize) -> Bytes {
    if bytes <= small_request().len() {
        return small_request();
    }
    let mut doc = String::from(
        "{\"amount\": 129900, \"currency\": \"eur\", \"customer\": \"cus_9s6XKzkNRiz8i3\", \"request_id\": \"req_4f1c2d9e8a7b\", \"metadata\": {\"channel\": \"web\", \"order\": \"ord_2026_11_0042\"}, \"items\": [",
    );
    let mut i = 0u64;
    while doc.len() + 3 < bytes {
        if i > 0 {
            doc.push_str(", ");
        }
        // A cheap deterministic spread of values (an LCG), so items differ.
        let r = i
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407)
            >> 33;
        doc.push_str(&format!(
            "{{\"sku\": \"sku_{:08x}\", \"quantity\": {}, \"unit_amount\": {}.{:02}, \"description\": \"Line item {i} \\u00e9t\\u00e9\", \"client_ts\": \"2026-11-26T09:{:02}:{:02}.{:03}Z\"}}",
            r & 0xffff_ffff,
            1 + r % 5,
            r % 10_000,
            r % 100,
            r % 60,
            (r / 60) % 60,
            r % 1000
        ));
        i += 1;
    }
    doc.push_str("]}");
    Bytes::from(doc)
}

/// Run `connections` connections against `addr` for `duration`, each request with the small
/// payment as its body.
pub async fn run(
    addr: SocketAddr,
    path: &str,
    keys: Keys,
    connections: usize,
    duration: Duration,
    pace: Pace,
) -> Report {
    run_with_body(
        addr,
        path,
        small_request(),
        keys,
        connections,
        duration,
        pace,
    )
    .await
}

/// [`run`] with `body` as every request's body.
pub async fn run_with_body(
    addr: SocketAddr,
    path: &str,
    body: Bytes,
    keys: Keys,
    connections: usize,
    duration: Duration,
    pace: Pace,
) -> Report {
    run_spread(&[addr], path, body, keys, connections, duration, pace).await
}

/// [`run_with_body`] against several replicas: connection `c` goes to `addrs[c % len]`.
pub async fn run_spread(
    addrs: &[SocketAddr],
    path: &str,
    body: Bytes,
    keys: Keys,
    connections: usize,
    duration: Duration,
    pace: Pace,
) -> Report {
    let counter = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::new();
    for c in 0..connections {
        let (keys, counter, path, body) = (
            keys.clone(),
            counter.clone(),
            path.to_string(),
            body.clone(),
        );
        let interval = match pace {
            Pace::Closed => None,
            Pace::Rate(r) => Some(Duration::from_secs_f64(connections as f64 / r)),
        };
        // Stagger open-loop connections so their requests interleave evenly.
        let offset = interval.map(|i| i.mul_f64(c as f64 / connections as f64));
        let addr = addrs[c % addrs.len()];
        tasks.push(tokio::spawn(async move {
            connection(addr, &path, body, keys, counter, deadline, interval, offset).await
        }));
    }
    let mut report = Report::empty();
    for t in tasks {
        let r = t.await.unwrap();
        report.requests += r.requests;
        report.ok += r.ok;
        report.conflicts += r.conflicts;
        report.errors += r.errors;
        report.hist.add(&r.hist).unwrap();
        report.first_byte.add(&r.first_byte).unwrap();
    }
    report.elapsed = start.elapsed();
    report
}

#[allow(clippy::too_many_arguments)]
async fn connection(
    addr: SocketAddr,
    path: &str,
    body: Bytes,
    keys: Keys,
    counter: Arc<AtomicU64>,
    deadline: Instant,
    interval: Option<Duration>,
    offset: Option<Duration>,
) -> Report {
    let mut r = Report::empty();
    let mut sender = None;
    let mut next = Instant::now() + offset.unwrap_or_default();
    let mut prev_done = Instant::now();
    while Instant::now() < deadline {
        if sender.is_none() {
            match connect(addr).await {
                Some(s) => sender = Some(s),
                None => {
                    r.errors += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            }
        }
        let scheduled = match interval {
            Some(i) => {
                let at = next;
                next += i;
                if at > Instant::now() {
                    tokio::time::sleep_until(at.into()).await;
                }
                at
            }
            None => Instant::now(),
        };
        if scheduled >= deadline {
            break;
        }
        // Charge the server from the scheduled time only when it made us late (the previous
        // request on this connection ended after this one was due); the timer's own lateness
        // (tokio's 1 ms granularity) is the generator's and is not counted.
        let start = if prev_done > scheduled {
            scheduled
        } else {
            Instant::now()
        };
        let i = counter.fetch_add(1, Ordering::Relaxed);
        let req = keys.request(path, &body, i);
        let result = exchange(sender.as_mut().unwrap(), req).await;
        prev_done = Instant::now();
        let latency = prev_done - start;
        r.requests += 1;
        if let Some((_, first)) = result {
            let first = first.unwrap_or(prev_done) - start;
            r.first_byte
                .saturating_record(first.as_micros().max(1) as u64);
        }
        match result.map(|(status, _)| status) {
            Some(200..=299) => r.ok += 1,
            Some(409) => r.conflicts += 1,
            Some(_) => r.errors += 1,
            None => {
                r.errors += 1;
                sender = None;
            }
        }
        r.hist.saturating_record(latency.as_micros().max(1) as u64);
    }
    r
}

/// Send one request for each of the hot keys `{prefix}-0` to `{prefix}-{n - 1}` (`keys`, hot or
/// Stripe deliveries of hot events) until it is answered other than `409` (recorded, or run
/// now), over a few connections: after it, every request with these keys is a replay.
pub async fn record_each(addr: SocketAddr, path: &str, body: Bytes, keys: &Keys, n: u64) {
    const CONNECTIONS: u64 = 8;
    let give_up = Instant::now() + Duration::from_secs(30);
    let tasks: Vec<_> = (0..CONNECTIONS)
        .map(|c| {
            let (path, body, keys) = (path.to_string(), body.clone(), keys.clone());
            tokio::spawn(async move {
                let mut sender = None;
                let mut i = c;
                while i < n && Instant::now() < give_up {
                    if sender.is_none() {
                        sender = connect(addr).await;
                    }
                    let Some(s) = sender.as_mut() else {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    };
                    let req = keys.request(&path, &body, i);
                    match exchange(s, req).await.map(|(status, _)| status) {
                        Some(409) => tokio::time::sleep(Duration::from_millis(5)).await,
                        Some(_) => i += CONNECTIONS,
                        None => sender = None,
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
}

/// A POST of `body` to `path`, with `key` as its `Idempotency-Key` when there is one.
fn post(path: &str, body: &Bytes, key: Option<String>) -> http::Request<Full<Bytes>> {
    let mut req = http::Request::post(path)
        .header("host", "bench")
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    req.body(Full::new(body.clone())).unwrap()
}

/// Send `req` on `s` and read its answer whole: its status, and when its first byte of data
/// came. `None` when the exchange failed.
async fn exchange(
    s: &mut http1::SendRequest<Full<Bytes>>,
    req: http::Request<Full<Bytes>>,
) -> Option<(u16, Option<Instant>)> {
    s.ready().await.ok()?;
    let resp = s.send_request(req).await.ok()?;
    let status = resp.status().as_u16();
    let first = read_body(resp.into_body()).await?;
    Some((status, first))
}

/// Read `body` to its end; when its first byte of data came (`None`: it had none). `None` when
/// it failed.
async fn read_body(mut body: hyper::body::Incoming) -> Option<Option<Instant>> {
    let mut first = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.ok()?;
        if first.is_none() && frame.data_ref().is_some_and(|d| !d.is_empty()) {
            first = Some(Instant::now());
        }
    }
    Some(first)
}

async fn connect(addr: SocketAddr) -> Option<http1::SendRequest<Full<Bytes>>> {
    let stream = TcpStream::connect(addr).await.ok()?;
    stream.set_nodelay(true).ok()?;
    let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.ok()?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Some(sender)
}

/// One request of a [`run_retrying`] client.
#[derive(Debug, Clone, Copy)]
pub struct Attempt {
    /// When it was sent and when its answer ended, from the run's start.
    pub start: Duration,
    pub end: Duration,
    /// The status, 0 when no answer came (connection refused or closed, or the client's 10 s
    /// timeout).
    pub status: u16,
    /// A retry after a 2xx, sent to another replica: the client that did not get its answer.
    pub confirm: bool,
    /// Which of the addresses it went to.
    pub replica: usize,
}

impl Attempt {
    /// An answer the client retries: the store down (503), in flight (409), the gateway's
    /// upstream errors (502, 504) or no answer at all.
    pub fn refused(&self) -> bool {
        matches!(self.status, 0 | 409 | 502 | 503 | 504)
    }
}

/// What the clients of [`run_retrying`] share while it runs.
pub struct Live {
    pub start: Instant,
    pub stop: std::sync::atomic::AtomicBool,
    /// When the last refused answer ended, in ms from `start` (0: none yet).
    pub last_refusal_ms: AtomicU64,
    /// Keys answered 2xx so far (their first 2xx).
    pub succeeded: AtomicU64,
}

impl Live {
    pub fn new() -> Arc<Live> {
        Arc::new(Live {
            start: Instant::now(),
            stop: Default::default(),
            last_refusal_ms: AtomicU64::new(0),
            succeeded: AtomicU64::new(0),
        })
    }
}

/// What the retrying clients saw.
#[derive(Debug, Default)]
pub struct RetryReport {
    /// Keys answered 2xx, and then 2xx again by another replica.
    pub keys: u64,
    /// Keys still being retried when the run stopped.
    pub unfinished: u64,
    /// Keys given up on: an answer that is neither 2xx nor retried (a 4xx other than 409, a 500).
    pub given_up: u64,
    pub attempts: Vec<Attempt>,
}

/// Clients that each send one key at a time, retrying it until a 2xx: keyed requests as a
/// careful client sends them while the store fails over. Each key goes to the replicas in
/// turn, starting with one of them, and is retried on the next one after `backoff` on 503,
/// 409, 502, 504 or no answer; after its 2xx it is sent once more, to another replica, again
/// until a 2xx (the client whose answer was lost and who retries: what it gets must be the
/// replay, not a second execution). Runs until `live.stop`.
pub async fn run_retrying(
    addrs: Vec<SocketAddr>,
    prefix: String,
    connections: usize,
    backoff: Duration,
    live: Arc<Live>,
) -> RetryReport {
    let counter = Arc::new(AtomicU64::new(0));
    let addrs: Arc<[SocketAddr]> = addrs.into();
    let mut tasks = Vec::new();
    for c in 0..connections {
        let (addrs, prefix, counter, live) =
            (addrs.clone(), prefix.clone(), counter.clone(), live.clone());
        tasks.push(tokio::spawn(async move {
            retrying_client(c, &addrs, &prefix, &counter, backoff, &live).await
        }));
    }
    let mut report = RetryReport::default();
    for t in tasks {
        let r = t.await.unwrap();
        report.keys += r.keys;
        report.unfinished += r.unfinished;
        report.given_up += r.given_up;
        report.attempts.extend(r.attempts);
    }
    report.attempts.sort_by_key(|a| a.start);
    report
}

async fn retrying_client(
    c: usize,
    addrs: &[SocketAddr],
    prefix: &str,
    counter: &AtomicU64,
    backoff: Duration,
    live: &Live,
) -> RetryReport {
    let mut r = RetryReport::default();
    let mut senders: Vec<Option<http1::SendRequest<Full<Bytes>>>> =
        addrs.iter().map(|_| None).collect();
    let body = small_request();
    'keys: while !live.stop.load(Ordering::Relaxed) {
        let i = counter.fetch_add(1, Ordering::Relaxed);
        let key = format!("{prefix}-{i}");
        let mut replica = (c + i as usize) % addrs.len();
        for confirm in [false, true] {
            loop {
                if live.stop.load(Ordering::Relaxed) {
                    r.unfinished += 1;
                    break 'keys;
                }
                let start = live.start.elapsed();
                let status = send_once(&mut senders[replica], addrs[replica], &key, &body).await;
                let a = Attempt {
                    start,
                    end: live.start.elapsed(),
                    status,
                    confirm,
                    replica,
                };
                r.attempts.push(a);
                // The next attempt (a retry, or the confirmation) goes to another replica.
                replica = (replica + 1) % addrs.len();
                if (200..300).contains(&status) {
                    if !confirm {
                        live.succeeded.fetch_add(1, Ordering::Relaxed);
                    }
                    break;
                }
                if !a.refused() {
                    r.given_up += 1;
                    continue 'keys;
                }
                live.last_refusal_ms
                    .fetch_max(a.end.as_millis() as u64, Ordering::Relaxed);
                tokio::time::sleep(backoff).await;
            }
        }
        r.keys += 1;
    }
    r
}

/// One POST with `key`, on the kept connection or a new one; its status, or 0 without an answer.
pub async fn send_once(
    sender: &mut Option<http1::SendRequest<Full<Bytes>>>,
    addr: SocketAddr,
    key: &str,
    body: &Bytes,
) -> u16 {
    if sender.is_none() {
        *sender = connect(addr).await;
    }
    let Some(s) = sender.as_mut() else {
        return 0;
    };
    let req = http::Request::post("/v1/payments")
        .header("host", "bench")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Full::new(body.clone()))
        .unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), async {
        s.ready().await.ok()?;
        let resp = s.send_request(req).await.ok()?;
        let status = resp.status().as_u16();
        resp.into_body().collect().await.ok()?;
        Some(status)
    })
    .await;
    match result {
        Ok(Some(status)) => status,
        _ => {
            *sender = None;
            0
        }
    }
}

/// The `load` subcommand: load on `target` with `keys` (`none`, `unique` or `hot`), the result
/// printed (for profiling one scenario by hand).
pub async fn by_hand(
    target: SocketAddr,
    keys: &str,
    secs: Duration,
    connections: usize,
    rate: Option<f64>,
    request_bytes: Option<usize>,
) {
    let keys = match keys {
        "unique" => Keys::Unique(format!("manual-{}", std::process::id())),
        "hot" => Keys::Hot("manual-hot".into(), 1000),
        _ => Keys::None,
    };
    let body = request_bytes.map_or_else(small_request, json_request);
    let r = run_with_body(
        target,
        "/v1/payments",
        body,
        keys,
        connections,
        secs,
        rate.map_or(Pace::Closed, Pace::Rate),
    )
    .await;
    println!(
        "{} requests, {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms, max {:.2} ms, {} 409s, {} errors",
        r.requests,
        r.rps(),
        r.ms(0.5),
        r.ms(0.99),
        r.ms(0.999),
        r.ms(1.0),
        r.conflicts,
        r.errors
    );
}
