//! The load generator: HTTP/1.1 keep-alive connections over hyper, closed loop (as fast as the
//! server answers) or open loop at a fixed rate, with latencies in an HDR histogram. In the open
//! loop, a request the server made late is measured from its scheduled time, so a stalled server
//! is charged for the requests it delayed (no coordinated omission).

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
}

impl Keys {
    fn key(&self, i: u64) -> Option<String> {
        match self {
            Keys::None => None,
            Keys::Unique(p) => Some(format!("{p}-{i}")),
            Keys::Hot(p, n) => Some(format!("{p}-{}", i % n)),
            Keys::Storm(p, per) => Some(format!("{p}-{}", i / per)),
        }
    }
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
    pub hist: Histogram<u64>,
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
    fn empty() -> Self {
        Report {
            requests: 0,
            ok: 0,
            conflicts: 0,
            errors: 0,
            elapsed: Duration::ZERO,
            hist: Histogram::new_with_bounds(1, 60_000_000, 3).unwrap(),
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
        let mut req = http::Request::post(path)
            .header("host", "bench")
            .header("content-type", "application/json");
        if let Some(k) = keys.key(i) {
            req = req.header("idempotency-key", k);
        }
        let req = req.body(Full::new(body.clone())).unwrap();
        let s = sender.as_mut().unwrap();
        let result = async {
            s.ready().await.ok()?;
            let resp = s.send_request(req).await.ok()?;
            let status = resp.status().as_u16();
            resp.into_body().collect().await.ok()?;
            Some(status)
        }
        .await;
        prev_done = Instant::now();
        let latency = prev_done - start;
        r.requests += 1;
        match result {
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

async fn connect(addr: SocketAddr) -> Option<http1::SendRequest<Full<Bytes>>> {
    let stream = TcpStream::connect(addr).await.ok()?;
    stream.set_nodelay(true).ok()?;
    let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.ok()?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Some(sender)
}
