//! The chaos clients: each sends keyed payments through a gateway picked at random and retries
//! the same key with the same body on a timeout, a 5xx, a 409 or a broken connection until a
//! 2xx; some attempts hang up on purpose, mid-body or after sending. Every attempt is recorded
//! with what it got. After the run, [`settle`] retries every key until it replays. One client
//! in four is a webhook sender instead: its keys (`w...`) are Stripe events posted to the
//! gateway's `webhook = "stripe"` route, each attempt signed again as it is sent; the gateway
//! keys them by the event id and forwards their headers unchanged, so the upstream logs them by
//! the `Idempotency-Key` they carry too, and the check is the same: each event reaches it once.
//! One in four is a JSON-RPC caller: its keys (`m...`) are `tools/call`s posted to the
//! gateway's `protocol = "jsonrpc"` route, each attempt under an id of its own as agents retry;
//! its answer counts as the call's `result` when it carries the attempt's own id (a wrong id is
//! a wrong body), and a JSON-RPC refusal by the problem type in its `data`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::check::{Attempt, Outcome, Phase};

/// The path the clients post to (the gateway adds its process's prefix upstream).
const PATH: &str = "/v1/payments";

/// The gateway's webhook route, where the webhook senders post.
pub const HOOKS: &str = "/hooks/stripe";

/// The gateway's JSON-RPC route, where the JSON-RPC callers post.
pub const RPC: &str = "/rpc";

/// Whether `key` is a webhook sender's event.
fn is_event(key: &str) -> bool {
    key.starts_with('w')
}

/// Whether `key` is a JSON-RPC caller's call.
fn is_call(key: &str) -> bool {
    key.starts_with('m')
}

/// One attempt of `key` as sent: its path, its extra header (a delivery's signature, made
/// now), its body (a JSON-RPC call wraps the payment in a `tools/call` of a fresh id) and that id.
struct Addressed {
    path: &'static str,
    signature: Option<String>,
    body: Bytes,
    id: Option<u64>,
}

fn addressed(key: &str, body: &Bytes) -> Addressed {
    if is_event(key) {
        let signature = Some(crate::load::stripe_signature(body));
        return Addressed {
            path: HOOKS,
            signature,
            body: body.clone(),
            id: None,
        };
    }
    if is_call(key) {
        let id = fastrand::u64(..1 << 52);
        let call = format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":{id},\"method\":\"tools/call\",\"params\":{{\"name\":\"charge\",\"arguments\":{}}}}}",
            String::from_utf8_lossy(body)
        );
        return Addressed {
            path: RPC,
            signature: None,
            body: Bytes::from(call),
            id: Some(id),
        };
    }
    Addressed {
        path: PATH,
        signature: None,
        body: body.clone(),
        id: None,
    }
}

/// A JSON-RPC call's answer as the check reads it: the `result` when the answer carries the
/// attempt's own id, else the answer itself marked as the wrong id.
fn result_of(id: u64, body: Bytes) -> Bytes {
    let Ok(answer) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return body;
    };
    if answer.get("id").and_then(|v| v.as_u64()) != Some(id) {
        return Bytes::from(format!("wrong id (sent {id}): {answer}"));
    }
    match answer.get("result") {
        Some(result) => Bytes::from(serde_json::to_vec(result).unwrap_or_default()),
        None => body,
    }
}

/// What the clients share: the gateways, the clock, and what they recorded.
pub struct Clients {
    pub start: Instant,
    /// Each gateway slot's address, and the incarnation running there now.
    pub addrs: Vec<SocketAddr>,
    pub incarnations: Arc<[AtomicU32]>,
    pub stop: AtomicBool,
    /// The client's own timeout for one attempt.
    pub timeout: Duration,
    /// Every key sent, with its body.
    pub keys: Mutex<Vec<(String, Bytes)>>,
    pub attempts: Mutex<Vec<Attempt>>,
}

/// How one attempt is sent.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Manner {
    Whole,
    /// The head and half the body, then the socket closed.
    HangUpMidBody,
    /// The whole request, then the socket closed before (or while) the answer comes.
    HangUpAfterSending(Duration),
}

impl Clients {
    /// Client `i` until [`Clients::stop`]: key after key, each retried until a 2xx.
    pub async fn run(self: Arc<Self>, i: usize, seed: u64) {
        let mut rng =
            fastrand::Rng::with_seed(seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut n = 0;
        let sender = match i % 4 {
            3 => "w",
            2 => "m",
            _ => "c",
        };
        while !self.stop.load(Ordering::SeqCst) {
            let key = format!("{sender}{i}-{n}");
            n += 1;
            let body = Bytes::from(format!(
                "{{\"amount\":{},\"currency\":\"eur\",\"customer\":\"cus_{key}\"}}",
                rng.u32(100..100_000)
            ));
            let body = match is_event(&key) {
                true => crate::load::stripe_event(&key, &body),
                false => body,
            };
            self.keys.lock().unwrap().push((key.clone(), body.clone()));
            while !self.stop.load(Ordering::SeqCst) {
                let manner = match rng.u32(0..100) {
                    0..3 => Manner::HangUpMidBody,
                    3..6 => Manner::HangUpAfterSending(Duration::from_millis(rng.u64(0..1500))),
                    _ => Manner::Whole,
                };
                let slot = rng.usize(..self.addrs.len());
                let outcome = self.attempt(slot, &key, &body, manner, Phase::Run).await;
                if outcome.succeeded() {
                    break;
                }
                // A 409 says the key is in flight and to come back in a second.
                let backoff = match outcome {
                    Outcome::Answered { status: 409, .. } => rng.u64(500..1000),
                    _ => rng.u64(50..250),
                };
                tokio::time::sleep(Duration::from_millis(backoff)).await;
            }
            tokio::time::sleep(Duration::from_millis(rng.u64(0..30))).await;
        }
    }

    /// Send `key` once to gateway `slot`, record what came of it, and return that.
    async fn attempt(
        &self,
        slot: usize,
        key: &str,
        body: &Bytes,
        manner: Manner,
        phase: Phase,
    ) -> Outcome {
        let process = self.incarnations[slot].load(Ordering::SeqCst);
        let start = self.start.elapsed();
        let addr = self.addrs[slot];
        let outcome = match manner {
            Manner::Whole => exchange(addr, key, body.clone(), self.timeout).await,
            Manner::HangUpMidBody => hang_up(addr, key, body, body.len() / 2, Duration::ZERO).await,
            Manner::HangUpAfterSending(after) => hang_up(addr, key, body, body.len(), after).await,
        };
        self.attempts.lock().unwrap().push(Attempt {
            key: key.to_string(),
            process,
            start,
            end: self.start.elapsed(),
            phase,
            outcome: outcome.clone(),
        });
        outcome
    }
}

/// After the run: every key sent, retried through the gateways in turn until it replays, 16 at
/// a time, each for at most `patience` from its first try. Keys that never replay are the
/// checker's stuck keys.
pub async fn settle(clients: Arc<Clients>, patience: Duration) {
    let keys = clients.keys.lock().unwrap().clone();
    let next = Arc::new(Mutex::new(keys.into_iter().enumerate()));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (clients, next) = (clients.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let Some((i, (key, body))) = next.lock().unwrap().next() else {
                    return;
                };
                let mut slot = i;
                let deadline = Instant::now() + patience;
                while Instant::now() < deadline {
                    slot = (slot + 1) % clients.addrs.len();
                    let outcome = clients
                        .attempt(slot, &key, &body, Manner::Whole, Phase::Settle)
                        .await;
                    if outcome.replayed() {
                        break;
                    }
                    if !outcome.succeeded() {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// A keyed POST of `body` on a connection of its own, read whole within `timeout`.
async fn exchange(addr: SocketAddr, key: &str, body: Bytes, timeout: Duration) -> Outcome {
    let exchange = async {
        let stream = TcpStream::connect(addr).await?;
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream)).await?;
        // Dropped with this future: a timeout closes the socket.
        let conn = AbortOnDrop(tokio::spawn(conn));
        let sent = addressed(key, &body);
        let mut req = http::Request::post(sent.path)
            .header("host", "chaos")
            .header("idempotency-key", key)
            .header("content-type", "application/json");
        if let Some(signature) = sent.signature {
            req = req.header("stripe-signature", signature);
        }
        let req = req.body(Full::new(sent.body)).unwrap();
        let resp = sender.send_request(req).await?;
        let (parts, body) = resp.into_parts();
        let mut body = body.collect().await?.to_bytes();
        drop(conn);
        // The gateway's own answers: problem+json, or on the JSON-RPC route an error whose
        // `data` is the problem.
        let refused = parts
            .headers
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"))
            || sent.id.is_some()
                && parts.status.as_u16() >= 400
                && body.windows(21).any(|w| w == b"urn:idemgate:problem:");
        let problem = refused.then(|| problem_type(&body));
        if let (Some(id), true) = (sent.id, parts.status.is_success()) {
            body = result_of(id, body);
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Outcome::Answered {
            status: parts.status.as_u16(),
            replayed: parts
                .headers
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true"),
            problem,
            body,
        })
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(_)) => Outcome::Broken,
        Err(_) => Outcome::TimedOut,
    }
}

/// Send the head and the first `bytes` of `body`, wait `after`, and close the socket.
async fn hang_up(
    addr: SocketAddr,
    key: &str,
    body: &Bytes,
    bytes: usize,
    after: Duration,
) -> Outcome {
    let Ok(mut stream) = TcpStream::connect(addr).await else {
        return Outcome::Broken;
    };
    let Addressed {
        path,
        signature,
        body,
        ..
    } = addressed(key, body);
    let signature = signature.map_or(String::new(), |s| format!("stripe-signature: {s}\r\n"));
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: chaos\r\nidempotency-key: {key}\r\n{signature}content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let sent = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(&body[..bytes.min(body.len())]).await?;
        stream.flush().await
    };
    if sent.await.is_err() {
        return Outcome::Broken;
    }
    tokio::time::sleep(after).await;
    Outcome::HungUp
}

/// The `type` of a gateway's problem+json, after `urn:idemgate:problem:` (or whole).
fn problem_type(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    text.split("\"type\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .map(|t| {
            t.strip_prefix(idemgate::error::PROBLEM_TYPE_BASE)
                .unwrap_or(t)
                .to_string()
        })
        .unwrap_or_else(|| "unreadable".into())
}

/// A task aborted when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<Result<(), hyper::Error>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_type_of_a_problem() {
        let body = br#"{"type":"urn:idemgate:problem:in-flight","title":"Request in flight","status":409}"#;
        assert_eq!(problem_type(body), "in-flight");
        assert_eq!(problem_type(b"{}"), "unreadable");
    }
}
