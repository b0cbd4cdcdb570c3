//! The chaos upstream, in the harness's process: it logs every execution (the key, the gateway
//! process that sent it, when, and the exact bytes it answered) and misbehaves on a seeded
//! draw per execution: slower than the gateway's `upstream_timeout`, a reset mid-body, a 503,
//! and now and then an `Idempotency-Control: max-age` of the largest value it can be written
//! with (the gateway keeps such a record for its `max_ttl`).
//!
//! Each gateway process is configured with `upstream = "http://ADDR/pN"`, its incarnation
//! number `N`, so the path tells which process sent a request. Every answer is unique to its
//! execution (`{"chaos":KEY,"n":N,"by":"pP",...}`), so an answer a client got names the one
//! execution it came from.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::check::{Act, Execution};
use super::Regime;

/// The upstream's log and its behaviour.
pub struct Upstream {
    pub addr: SocketAddr,
    log: Arc<Log>,
    task: tokio::task::JoinHandle<()>,
}

struct Log {
    start: Instant,
    seed: u64,
    regime: Regime,
    /// Faults off: every execution answers at once (the settle phase).
    calm: AtomicBool,
    executions: Mutex<Vec<Execution>>,
    /// Executions so far per key: the draw of each is seeded by the key and its number.
    per_key: Mutex<HashMap<String, u32>>,
}

impl Upstream {
    /// Serve on a free loopback port; times in the log count from `start`.
    pub async fn start(start: Instant, seed: u64, regime: Regime) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let log = Arc::new(Log {
            start,
            seed,
            regime,
            calm: AtomicBool::new(false),
            executions: Mutex::new(Vec::new()),
            per_key: Mutex::new(HashMap::new()),
        });
        let task = tokio::spawn(serve(listener, log.clone()));
        Upstream { addr, log, task }
    }

    /// Stop misbehaving: every execution from now on answers in full, at once.
    pub fn calm(&self) {
        self.log.calm.store(true, Ordering::SeqCst);
    }

    /// Every execution so far.
    pub fn executions(&self) -> Vec<Execution> {
        self.log.executions.lock().unwrap().clone()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(listener: TcpListener, log: Arc<Log>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let log = log.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| execute(req, log.clone()));
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// One execution: logged as it arrives, answered after its delay as drawn.
async fn execute(req: Request<Incoming>, log: Arc<Log>) -> Result<Response<Answer>, Infallible> {
    let process = req
        .uri()
        .path()
        .strip_prefix("/p")
        .and_then(|p| p.split('/').next()?.parse::<u32>().ok())
        .unwrap_or(u32::MAX);
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    // A JSON-RPC call (the gateway's JSON-RPC route, under the process's prefix).
    let rpc = req.uri().path().ends_with(super::client::RPC);
    // The whole request first: an execution is a request the upstream received.
    let request = req.into_body().collect().await.map(|b| b.to_bytes());
    let Draw {
        index,
        act,
        delay,
        status,
        body,
        max_age,
    } = log.begin(&key, process);
    // Ends the execution when its answer is due, or when the gateway hangs up first (hyper
    // drops this future then): killed, or given up on the call.
    let _end = End {
        log: &log,
        index,
        due: delay,
    };
    tokio::time::sleep(delay).await;
    // A call's success is its JSON-RPC response, the logged body as its `result`.
    let body = match (rpc, (200..300).contains(&status), request) {
        (true, true, Ok(request)) => jsonrpc_response(&request, &body),
        _ => body,
    };
    let cut = (act == Act::Reset).then_some(body.len() / 2);
    let mut resp = Response::new(Answer {
        body: Some(body.clone()),
        cut,
    });
    *resp.status_mut() = http::StatusCode::from_u16(status).unwrap();
    let headers = resp.headers_mut();
    headers.insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    headers.insert(http::header::CONTENT_LENGTH, body.len().into());
    if max_age {
        headers.insert(
            "idempotency-control",
            http::HeaderValue::from_static("max-age=18446744073709551615"),
        );
    }
    Ok(resp)
}

/// Sets an execution's end when dropped: its answer given (the delay past), or its gateway gone
/// before that (`cut_short`).
struct End<'a> {
    log: &'a Log,
    index: usize,
    due: Duration,
}

impl Drop for End<'_> {
    fn drop(&mut self) {
        let now = self.log.start.elapsed();
        let e = &mut self.log.executions.lock().unwrap()[self.index];
        e.end = now;
        e.cut_short = now < e.start + self.due;
    }
}

/// What one execution does, as drawn.
struct Draw {
    /// Its place in the log.
    index: usize,
    act: Act,
    delay: Duration,
    status: u16,
    body: Bytes,
    /// With `Idempotency-Control: max-age=` the largest `u64`.
    max_age: bool,
}

impl Log {
    /// Draw what execution `n` of `key` does, and log it.
    fn begin(&self, key: &str, process: u32) -> Draw {
        let n = {
            let mut per_key = self.per_key.lock().unwrap();
            let n = per_key.entry(key.to_string()).or_default();
            *n += 1;
            *n - 1
        };
        let mut rng = fastrand::Rng::with_seed(self.seed ^ fnv(key) ^ (u64::from(n) << 48));
        let r = &self.regime;
        let act = match rng.u32(0..100) {
            _ if self.calm.load(Ordering::SeqCst) => Act::Answer,
            0..5 => Act::Unavailable,
            5..8 => Act::Slow,
            8..11 => Act::Reset,
            _ => Act::Answer,
        };
        let delay = match act {
            _ if self.calm.load(Ordering::SeqCst) => Duration::ZERO,
            Act::Slow => r.upstream_timeout + Duration::from_millis(600),
            _ => r.work.0 + (r.work.1 - r.work.0).mul_f64(rng.f64()),
        };
        let status = if act == Act::Unavailable { 503 } else { 201 };
        // One answer in ten of 16 to 96 KiB: a record that needs new pages on disk, and on
        // Redis the staged write of a large entry.
        let size = if rng.u32(0..10) == 0 {
            rng.usize(16 << 10..96 << 10)
        } else {
            rng.usize(200..2000)
        };
        let body = answer(key, n, process, status, size, &mut rng);
        let max_age = act == Act::Answer && rng.u32(0..100) < 3;
        let start = self.start.elapsed();
        let mut executions = self.executions.lock().unwrap();
        executions.push(Execution {
            key: key.to_string(),
            process,
            start,
            end: start,
            cut_short: false,
            act,
            status,
            body: body.clone(),
        });
        Draw {
            index: executions.len() - 1,
            act,
            delay,
            status,
            body,
            max_age,
        }
    }
}

/// Execution `n` of `key` by process `process`, as JSON of about `size` bytes.
fn answer(
    key: &str,
    n: u32,
    process: u32,
    status: u16,
    size: usize,
    rng: &mut fastrand::Rng,
) -> Bytes {
    // Keys in order and no space, as serde_json writes it: a JSON-RPC caller compares the
    // `result` it got, written again, with these bytes.
    let head = format!("{{\"by\":\"p{process}\",\"chaos\":\"{key}\",\"n\":{n},\"pad\":\"");
    let tail = format!("\",\"status\":{status}}}");
    let pad: String = (0..size.saturating_sub(head.len() + tail.len()))
        .map(|_| rng.alphanumeric())
        .collect();
    Bytes::from(format!("{head}{pad}{tail}"))
}

/// The JSON-RPC response to `request` (a call) whose `result` is `result`.
fn jsonrpc_response(request: &[u8], result: &[u8]) -> Bytes {
    let id = serde_json::from_slice::<serde_json::Value>(request)
        .ok()
        .and_then(|call| call.get("id").cloned())
        .unwrap_or(serde_json::Value::Null);
    let mut out = format!("{{\"jsonrpc\":\"2.0\",\"id\":{id},\"result\":").into_bytes();
    out.extend_from_slice(result);
    out.push(b'}');
    Bytes::from(out)
}

/// FNV-1a: a hash of the key that is the same in every run (the seed's draws must be).
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// An answer's body: whole, or (`cut`) its first bytes and then an error, on which hyper drops
/// the connection mid-body.
pub struct Answer {
    body: Option<Bytes>,
    cut: Option<usize>,
}

impl hyper::body::Body for Answer {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let Some(body) = self.body.take() else {
            let cut = self.cut.take();
            return Poll::Ready(cut.map(|_| Err(std::io::Error::other("reset mid-body"))));
        };
        Poll::Ready(Some(Ok(Frame::data(match self.cut {
            Some(at) => body.slice(..at),
            None => body,
        }))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_draws_are_the_seeds_and_the_answers_unique() {
        let regime = Regime::long();
        let a = Log {
            start: Instant::now(),
            seed: 7,
            regime,
            calm: AtomicBool::new(false),
            executions: Mutex::new(Vec::new()),
            per_key: Mutex::new(HashMap::new()),
        };
        let b = Log {
            executions: Mutex::new(Vec::new()),
            per_key: Mutex::new(HashMap::new()),
            calm: AtomicBool::new(false),
            ..a
        };
        let mut acts = HashMap::new();
        for i in 0..400 {
            let key = format!("k{i}");
            let x = a.begin(&key, 1);
            let y = b.begin(&key, 2);
            assert_eq!(
                (x.act, x.delay, x.max_age),
                (y.act, y.delay, y.max_age),
                "the same draw for the same seed"
            );
            assert_ne!(x.body, y.body, "an answer names its process");
            assert_eq!(x.status == 503, x.act == Act::Unavailable);
            assert!(x
                .body
                .starts_with(format!("{{\"by\":\"p1\",\"chaos\":\"{key}\",\"n\":0,").as_bytes()));
            // Written as serde_json writes it, which a JSON-RPC caller compares it with.
            let parsed: serde_json::Value = serde_json::from_slice(&x.body).unwrap();
            assert_eq!(serde_json::to_vec(&parsed).unwrap(), x.body);
            *acts.entry(format!("{:?}", x.act)).or_insert(0) += 1;
            *acts.entry(format!("max-age {}", x.max_age)).or_insert(0) += 1;
            assert_ne!(
                x.body,
                a.begin(&key, 1).body,
                "the next execution answers other bytes"
            );
        }
        assert_eq!(acts.len(), 6, "every act drawn: {acts:?}");
        a.calm.store(true, Ordering::SeqCst);
        assert_eq!(a.begin("k0", 1).act, Act::Answer);
    }
}
