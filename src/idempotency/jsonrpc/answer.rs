//! What an upstream's answer to a keyed JSON-RPC call comes to. Its terminal response decides:
//! a `result` is recorded (a tool error, `isError: true`, and a task handle too), except
//! `resultType: "input_required"`, which releases the key (the continuation is the same call);
//! an `error` with -32700, -32600, -32601 or -32602 is recorded as a failure (`failure_ttl`);
//! -32603 and -32000..-32099 release the key as a 5xx does (`cache_server_errors` applies).
//! An event-stream answer goes to the first client as it comes; only its terminal response is
//! recorded (progress and other messages are not).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::Response;
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::sync::mpsc;
use tracing::warn;

use super::super::metrics::Unsettled;
use super::Call;
use crate::headers::media_type;
use crate::idempotency::body::{collect_capped, with_trailers, Collected};
use crate::idempotency::claimed::Called;
use crate::idempotency::lease::Lease;
use crate::idempotency::response;
use crate::idempotency::shared::Shared;
use crate::record::policy::Policy;
use crate::record::{EntryState, StoredResponse};
use crate::store::{Keep, Store};

/// What a terminal JSON-RPC response says of its call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// A result: the call completed (a tool error or a task handle as well).
    Complete,
    /// An error the same call would get again: recorded as a failure.
    Failure,
    /// An error of the server's (-32603, -32000..-32099): released as a 5xx.
    ServerError,
    /// The call needs input first: never recorded.
    InputRequired,
}

/// The class of a JSON-RPC response, or `None` when `message` is none.
fn classify(message: &Value) -> Option<Class> {
    if let Some(result) = message.get("result") {
        return Some(match result.get("resultType").and_then(Value::as_str) {
            Some("input_required") => Class::InputRequired,
            _ => Class::Complete,
        });
    }
    let code = message.get("error")?.get("code")?.as_i64()?;
    Some(match code {
        -32603 | -32099..=-32000 => Class::ServerError,
        _ => Class::Failure,
    })
}

/// How a response of `class` is kept, given how its HTTP head would be (`keep`): a failure for
/// `failure_ttl`, leaving no tombstone, as a 4xx.
fn keep_for(class: Class, keep: Keep, policy: &Policy) -> Option<Keep> {
    let failure = Keep {
        ttl: policy.failure_ttl,
        tombstone: None,
    };
    match class {
        Class::Complete => Some(keep),
        Class::Failure => Some(failure),
        Class::ServerError if policy.cache_server_errors => Some(failure),
        Class::ServerError | Class::InputRequired => None,
    }
}

/// An answer in an event stream, its head in hand: sent on as it comes, its terminal response
/// recorded.
pub(crate) struct JsonRpcStream {
    pub(crate) head: http::response::Parts,
    pub(crate) body: Body,
    pub(crate) keep: Keep,
}

/// An event stream whose head is answered: its body still to relay and record.
pub(crate) struct StreamTail {
    body: Body,
    keep: Keep,
    to_client: mpsc::Sender<Bytes>,
    traceparent: Option<HeaderValue>,
}

impl JsonRpcStream {
    /// The first client's answer (the stream as it comes), and what is left to relay and record.
    pub(crate) fn start(self, traceparent: Option<HeaderValue>) -> (Response<Body>, StreamTail) {
        let (tx, rx) = mpsc::channel::<Bytes>(32);
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
        });
        let mut head = self.head;
        head.headers.remove(header::CONTENT_LENGTH);
        let first = Response::from_parts(head, Body::from_stream(stream));
        let tail = StreamTail {
            body: self.body,
            keep: self.keep,
            to_client: tx,
            traceparent,
        };
        (first, tail)
    }
}

/// The answer to a keyed call, its head final: released at once when its status says so, an
/// event stream to relay, or read whole and judged by its terminal response.
pub(crate) async fn read_answer<E>(
    policy: &Policy,
    mut head: http::response::Parts,
    body: Body,
) -> Called<E> {
    let Some(keep) = response::recorded_for(&mut head, None, false, policy) else {
        return Called::Transient(Response::from_parts(head, body));
    };
    if is_event_stream(&head.headers) {
        return Called::JsonRpcStream(JsonRpcStream { head, body, keep });
    }
    match collect_capped(body, policy.max_body).await {
        Ok(Collected::Whole(bytes, trailers)) => {
            let class = serde_json::from_slice::<Value>(&bytes)
                .ok()
                .and_then(|m| classify(&m));
            // Not a JSON-RPC response: kept as its HTTP status says.
            match class.map_or(Some(keep), |class| keep_for(class, keep, policy)) {
                Some(keep) => Called::Whole(head, (bytes, trailers), keep),
                None => {
                    Called::Transient(Response::from_parts(head, with_trailers(bytes, trailers)))
                }
            }
        }
        Ok(Collected::TooLarge { read, rest }) => Called::TooLarge(head, read, rest, keep),
        Err(_) => Called::BodyFailed,
    }
}

/// Whether a head says `text/event-stream`.
fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| media_type(v.as_bytes()))
        .is_some_and(|t| t.eq_ignore_ascii_case("text/event-stream"))
}

/// How an event stream ended, as far as its recording goes.
enum Relayed {
    /// Its terminal response (the message's text), and the rest of the stream.
    Terminal(Bytes),
    /// Ended, or broke off, without one.
    Broken,
    /// An event larger than `max_body`: the call completed, but nothing is kept to replay.
    TooLarge,
}

impl<St: Store> Shared<St> {
    /// Relay an event stream to the first client (if still there) while looking for the call's
    /// terminal response, holding the lease; record it (or release the key, as its class says),
    /// then relay the rest. A stream that ends without one leaves the key claimed until its
    /// lease ends, as any answer broken midway does.
    pub(in crate::idempotency) async fn record_jsonrpc(
        &self,
        lease: &Lease<St>,
        mut tail: StreamTail,
    ) {
        let (held, policy) = (&*lease.held, &*lease.held.policy);
        let Some(call) = held.jsonrpc.clone() else {
            return;
        };
        let relayed = tokio::select! {
            biased;
            relayed = relay(&mut tail, &call, policy) => relayed,
            never = lease.hold() => match never {},
        };
        match relayed {
            Relayed::Terminal(message) => {
                let class = serde_json::from_slice::<Value>(&message)
                    .ok()
                    .and_then(|m| classify(&m));
                match class.and_then(|class| keep_for(class, tail.keep, policy)) {
                    Some(keep) => {
                        let stored = recorded(message, tail.traceparent.take(), held.source);
                        lease
                            .complete(&EntryState::Completed(Arc::new(stored)), keep)
                            .await;
                    }
                    None => lease.release().await,
                }
                // The rest goes on to the first client; nothing of it is kept.
                relay_rest(&mut tail, policy).await;
            }
            Relayed::TooLarge => {
                lease.complete(&EntryState::NotReplayable, tail.keep).await;
                relay_rest(&mut tail, policy).await;
            }
            Relayed::Broken => {
                warn!(route = %policy.route, key = %held.tag(), "event stream ended without the call's response; key stays claimed until its lease ends");
                self.metrics.unsettled(&policy.route, Unsettled::failed);
            }
        }
    }
}

/// The record of a terminal response: as JSON, with no header of the upstream's (a session id
/// is no retry's).
fn recorded(
    message: Bytes,
    traceparent: Option<HeaderValue>,
    source: crate::record::key::KeySource,
) -> StoredResponse {
    let mut head = Response::new(()).into_parts().0;
    head.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    head.headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(message.len()));
    StoredResponse::new(head, (message, None), traceparent, source)
}

/// The stream's next chunk of data; `None` at its end, when it fails, or when none comes within
/// `upstream_timeout` (which bounds each wait, as on any streamed route).
async fn next_chunk(body: &mut Body, policy: &Policy) -> Option<Bytes> {
    loop {
        let frame = tokio::time::timeout(policy.upstream_timeout, body.frame()).await;
        match frame {
            Ok(Some(Ok(frame))) => {
                if let Ok(chunk) = frame.into_data() {
                    return Some(chunk);
                }
            }
            _ => return None,
        }
    }
}

/// Relay the stream's chunks until the event carrying the call's response (by its id), or its
/// end.
async fn relay(tail: &mut StreamTail, call: &Call, policy: &Policy) -> Relayed {
    let mut events = Events::default();
    let max = usize::try_from(policy.max_body).unwrap_or(usize::MAX);
    loop {
        let Some(chunk) = next_chunk(&mut tail.body, policy).await else {
            return Relayed::Broken;
        };
        events.push(&chunk);
        // The client may have gone: the call goes on for its retry all the same.
        let _ = tail.to_client.send(chunk).await;
        while let Some(data) = events.next() {
            if is_response_to(&data, call) {
                return Relayed::Terminal(Bytes::from(data));
            }
        }
        if events.pending() > max {
            return Relayed::TooLarge;
        }
    }
}

/// Relay what is left of the stream after its terminal response.
async fn relay_rest(tail: &mut StreamTail, policy: &Policy) {
    while let Some(chunk) = next_chunk(&mut tail.body, policy).await {
        let _ = tail.to_client.send(chunk).await;
    }
}

/// Whether an event's data is the response to `call` (its id, as forwarded).
fn is_response_to(data: &[u8], call: &Call) -> bool {
    let Ok(message) = serde_json::from_slice::<Value>(data) else {
        return false;
    };
    message.get("id") == Some(&call.id) && classify(&message).is_some()
}

/// The events of a server-sent-events stream, parsed as its bytes come: each event's data
/// lines, joined.
#[derive(Default)]
struct Events {
    // Bytes received; those before `start` are parsed.
    buf: Vec<u8>,
    start: usize,
    // The data of the event being read.
    data: Vec<u8>,
    // Whether the event being read has a data line.
    has_data: bool,
}

impl Events {
    fn push(&mut self, chunk: &[u8]) {
        // What was parsed goes once per chunk (not once per line or event: a chunk of many
        // costs its length).
        self.buf.drain(..self.start.min(self.buf.len()));
        self.start = 0;
        self.buf.extend_from_slice(chunk);
    }

    /// Bytes held for events not yet complete.
    fn pending(&self) -> usize {
        self.buf
            .len()
            .saturating_sub(self.start)
            .saturating_add(self.data.len())
    }

    /// The data of the next complete event, if one is.
    fn next(&mut self) -> Option<Vec<u8>> {
        let mut at = self.start;
        let mut found = None;
        while let Some(rest) = self.buf.get(at..) {
            let Some(end) = rest.iter().position(|&b| b == b'\n') else {
                break;
            };
            let line = rest.get(..end).unwrap_or_default();
            at += end + 1;
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                if std::mem::take(&mut self.has_data) {
                    found = Some(std::mem::take(&mut self.data));
                    break;
                }
                continue;
            }
            let (field, value) = match line.iter().position(|&b| b == b':') {
                Some(colon) => line.split_at(colon),
                None => (line, &b""[..]),
            };
            let value = value.strip_prefix(b":").unwrap_or(value);
            let value = value.strip_prefix(b" ").unwrap_or(value);
            if field == b"data" {
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
        }
        self.start = at;
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_classed_as_the_spec_says() {
        let class = |v: Value| classify(&v);
        assert_eq!(
            class(serde_json::json!({"result": {"isError": true}})),
            Some(Class::Complete)
        );
        assert_eq!(
            class(serde_json::json!({"result": {"resultType": "task"}})),
            Some(Class::Complete)
        );
        assert_eq!(
            class(serde_json::json!({"result": {"resultType": "input_required"}})),
            Some(Class::InputRequired)
        );
        for code in [-32700, -32600, -32601, -32602] {
            assert_eq!(
                class(serde_json::json!({"error": {"code": code}})),
                Some(Class::Failure)
            );
        }
        for code in [-32603, -32000, -32099, -32050] {
            assert_eq!(
                class(serde_json::json!({"error": {"code": code}})),
                Some(Class::ServerError)
            );
        }
        assert_eq!(class(serde_json::json!({"method": "x"})), None);
    }

    #[test]
    fn events_are_read_across_chunks() {
        let mut events = Events::default();
        events.push(b"event: message\r\ndata: {\"a\":");
        assert_eq!(events.next(), None);
        events.push(b"1}\r\n\r\n: comment\n\ndata: x\ndata: y\n\n");
        assert_eq!(events.next().unwrap(), b"{\"a\":1}");
        assert_eq!(events.next().unwrap(), b"x\ny");
        assert_eq!(events.next(), None);
        assert_eq!(events.pending(), 0);
        let many: Vec<u8> = (0..1000)
            .flat_map(|i| format!("data: {i}\n\n").into_bytes())
            .collect();
        events.push(&many);
        let read: Vec<Vec<u8>> = std::iter::from_fn(|| events.next()).collect();
        assert_eq!(read.len(), 1000);
        assert_eq!(read[999], b"999");
        events.push(b"data: tail");
        assert_eq!((events.next(), events.pending()), (None, 10));
    }
}
