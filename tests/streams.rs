//! Streamed answers (`stream = true`) over sockets, on Redis and on the embedded store: the
//! client reads events as the upstream sends them, a duplicate attaches to the live answer, a
//! client that hangs up does not stop the recording, an answer past `max_body` is delivered once,
//! an SSE retry with `Last-Event-ID` resumes after that event, and trailers reach every reader.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::upstream::sse_event;
use common::{send, Backend, CountingUpstream, GatewayConfig, Seen, TestEnv};
use http::HeaderMap;
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use toml::toml;

/// The admin API's token, where a test reads a record.
const ADMIN_TOKEN: &str = "streams-admin-token-0123456789";

/// Events 300 ms apart: an answer that takes 0.9 s to end.
const EVENTS: &str = "?events=4&gap_ms=300";

fn config() -> GatewayConfig {
    GatewayConfig::new()
        .set("admin.listen", "127.0.0.1:0")
        .route(
            "/live/events",
            toml! { stream = true
            on_in_flight = "wait"
            wait_timeout = "2s" },
        )
        .route(
            "/small/events",
            toml! { stream = true
            max_body = 64 },
        )
}

/// The whole answer of the upstream's call `call`: events `from..4`.
fn events(call: usize, from: usize) -> String {
    (from..4).map(|i| sse_event(call, i)).collect()
}

/// `so_far`, then the rest of `resp`.
async fn rest(mut resp: reqwest::Response, mut so_far: Vec<u8>) -> Vec<u8> {
    while let Some(chunk) = resp.chunk().await.unwrap() {
        so_far.extend_from_slice(&chunk);
    }
    so_far
}

async fn each_backend(test: impl AsyncFn(TestEnv)) {
    for backend in [Backend::Redis, Backend::Embedded] {
        test(TestEnv::start(backend, config()).await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_event_arrives_before_the_answer_ends_and_replays_whole() {
    each_backend(async |env| {
        let started = Instant::now();
        let mut streamed = env
            .post_keyed(&format!("/live/events{EVENTS}"), "s-1")
            .send()
            .await
            .unwrap();
        let first = streamed.chunk().await.unwrap().unwrap();
        let streamed_first = started.elapsed();
        let streamed_body = rest(streamed, first.to_vec()).await;
        assert_eq!(String::from_utf8(streamed_body).unwrap(), events(1, 0));

        let started = Instant::now();
        let mut buffered = env
            .post_keyed(&format!("/buffered/events{EVENTS}"), "b-1")
            .send()
            .await
            .unwrap();
        buffered.chunk().await.unwrap().unwrap();
        let buffered_first = started.elapsed();
        assert!(
            streamed_first < Duration::from_millis(600) && buffered_first >= Duration::from_millis(850),
            "{:?}: first event streamed after {streamed_first:?}, buffered after {buffered_first:?}",
            env.backend
        );

        let replay = send(env.post_keyed(&format!("/live/events{EVENTS}"), "s-1")).await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.header("content-type"), Some("text/event-stream"));
        assert_eq!(String::from_utf8_lossy(&replay.body), events(1, 0));
        assert_eq!(env.upstream.calls(), 2, "one call per key");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_attaches_to_the_live_answer_and_resumes_after_its_last_event_id() {
    each_backend(async |env| {
        // Events a second apart: what was sent so far must come well before the next one.
        let path = "/live/events?events=4&gap_ms=1000";
        let mut original = env.post_keyed(path, "a-1").send().await.unwrap();
        let first = original.chunk().await.unwrap().unwrap();
        assert_eq!(String::from_utf8_lossy(&first), sse_event(1, 0));

        let attached_at = Instant::now();
        let mut attached = env.post_keyed(path, "a-1").send().await.unwrap();
        assert_eq!(attached.status(), 201);
        assert_eq!(attached.headers()["idempotent-replayed"], "true");
        let so_far = attached.chunk().await.unwrap().unwrap();
        assert!(
            attached_at.elapsed() < Duration::from_millis(700),
            "what was sent so far arrives at once: {:?}",
            attached_at.elapsed()
        );
        assert!(so_far.starts_with(sse_event(1, 0).as_bytes()));
        let mut resumed = env
            .post_keyed(path, "a-1")
            .header("last-event-id", "0")
            .send()
            .await
            .unwrap();
        assert_eq!(resumed.headers()["idempotent-replayed"], "true");
        let resumed_first = resumed.chunk().await.unwrap().unwrap();

        let original = rest(original, first.to_vec()).await;
        let attached = rest(attached, so_far.to_vec()).await;
        let resumed = rest(resumed, resumed_first.to_vec()).await;
        assert_eq!(String::from_utf8(original).unwrap(), events(1, 0));
        assert_eq!(String::from_utf8(attached).unwrap(), events(1, 0));
        assert_eq!(String::from_utf8(resumed).unwrap(), events(1, 1));
        assert_eq!(env.upstream.calls(), 1, "the upstream is called once");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_that_arrives_before_the_head_attaches_as_the_head_arrives() {
    each_backend(async |env| {
        // The head comes 400 ms after the call: the duplicate, sent as the call starts, has
        // been waiting long enough for its looks at the store to be 100 ms apart.
        let path = format!("/live/events{EVENTS}&delay_ms=400");
        let head = |request: reqwest::RequestBuilder| {
            tokio::spawn(async move {
                let response = request.send().await.unwrap();
                (Instant::now(), response)
            })
        };
        // Three tries, the best counted: a loaded machine may delay one, a duplicate that
        // waits for its next look at the store is late every time (by 50 ms and more).
        let mut lates = Vec::new();
        for call in 1..=3 {
            let key = format!("h-{call}");
            let original = head(env.post_keyed(&path, &key));
            env.upstream.wait_for_calls(call).await;
            let duplicate = head(env.post_keyed(&path, &key));
            let (original_head, original) = original.await.unwrap();
            let (duplicate_head, duplicate) = duplicate.await.unwrap();
            assert_eq!(duplicate.headers()["idempotent-replayed"], "true");
            lates.push(duplicate_head.saturating_duration_since(original_head));
            let original = rest(original, Vec::new()).await;
            let duplicate = rest(duplicate, Vec::new()).await;
            assert_eq!(String::from_utf8(original).unwrap(), events(call, 0));
            assert_eq!(String::from_utf8(duplicate).unwrap(), events(call, 0));
        }
        assert!(
            lates.iter().min().unwrap() < &Duration::from_millis(40),
            "{:?}: the duplicate's head came {lates:?} after the original's",
            env.backend
        );
        assert_eq!(
            env.upstream.calls(),
            3,
            "the upstream is called once per key"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_mid_stream_leaves_the_whole_answer_recorded() {
    each_backend(async |env| {
        let path = format!("/live/events{EVENTS}");
        let mut gone = env.post_keyed(&path, "d-1").send().await.unwrap();
        gone.chunk().await.unwrap().unwrap();
        drop(gone);
        // Past the answer's end: the retry is a replay from the record, not an attach.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let replay = send(env.post_keyed(&path, "d-1")).await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(String::from_utf8_lossy(&replay.body), events(1, 0));
        assert_eq!(env.upstream.calls(), 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_past_max_body_is_delivered_whole_once_and_never_run_again() {
    each_backend(async |env| {
        let path = format!("/small/events{EVENTS}");
        let once = send(env.post_keyed(&path, "m-1")).await;
        assert_eq!(once.status, 201);
        assert!(once.body.len() > 64);
        assert_eq!(String::from_utf8_lossy(&once.body), events(1, 0));
        let again = send(env.post_keyed(&path, "m-1")).await;
        assert_eq!(again.status, 409, "{again:?}");
        assert_eq!(again.problem_type(), "urn:idemgate:problem:not-replayable");
        assert_eq!(env.upstream.calls(), 1);
        let recorded = r#"idemgate_records_not_replayable_total{route="/small/events"}"#;
        assert_eq!(env.gateway.metric(recorded).await, 1.0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_event_stream_resumes_after_the_last_event_id() {
    each_backend(async |env| {
        let path = format!("/live/events{EVENTS}");
        let whole = send(env.post_keyed(&path, "r-1")).await;
        assert_eq!(String::from_utf8_lossy(&whole.body), events(1, 0));
        let resume = |id: &str| {
            let req = env.post_keyed(&path, "r-1").header("last-event-id", id);
            async move { send(req).await }
        };
        let after_1: Seen = resume("1").await;
        assert!(after_1.replayed());
        assert_eq!(String::from_utf8_lossy(&after_1.body), events(1, 2));
        let after_last = resume("3").await;
        assert_eq!(after_last.body.len(), 0, "nothing after the last event");
        let unknown = resume("no-such-event").await;
        assert_eq!(String::from_utf8_lossy(&unknown.body), events(1, 0));
        assert_eq!(env.upstream.calls(), 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_breaks_off_ends_in_an_error_and_keeps_the_key_claimed() {
    each_backend(async |env| {
        let path = "/live/events?events=4&gap_ms=100&fail_after=2";
        let mut cut = env.post_keyed(path, "c-1").send().await.unwrap();
        assert_eq!(cut.status(), 201);
        let mut got = Vec::new();
        let ended = loop {
            match cut.chunk().await {
                Ok(Some(chunk)) => got.extend_from_slice(&chunk),
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        assert!(ended.is_err(), "a cut answer never ends cleanly: {got:?}");
        assert_eq!(
            String::from_utf8(got).unwrap(),
            events(1, 0)[..sse_event(1, 0).len() * 2]
        );
        // The upstream may have done the work: the key stays claimed until its lease ends.
        let retry = send(env.post_keyed(path, "c-1")).await;
        assert_eq!(retry.status, 409, "{retry:?}");
        assert_eq!(retry.problem_type(), "urn:idemgate:problem:in-flight");
        assert_eq!(env.upstream.calls(), 1);
        let unsettled = r#"idemgate_calls_unsettled_total{route="/live/events",reason="failed"}"#;
        assert_eq!(env.gateway.metric(unsettled).await, 1.0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_streamed_answer_is_passed_on_and_releases_the_key() {
    each_backend(async |env| {
        let path = "/live/events?events=2&status=503";
        let failed = send(env.post_keyed(path, "f-1")).await;
        assert_eq!(failed.status, 503);
        assert_eq!(
            String::from_utf8_lossy(&failed.body),
            events(1, 0)[..sse_event(1, 0).len() * 2]
        );
        let again = send(env.post_keyed(path, "f-1")).await;
        assert_eq!((again.status, again.replayed()), (503, false), "runs again");
        assert_eq!(env.upstream.calls(), 2);
    })
    .await;
}

/// A keyed POST that accepts trailers (`te: trailers`), over HTTP/2 (prior knowledge) or
/// HTTP/1.1: the answer's head, body and trailers.
async fn post_taking_trailers(
    env: &TestEnv,
    (path, key): (&str, &str),
    http2: bool,
) -> (http::response::Parts, Bytes, Option<HeaderMap>) {
    let tcp = tokio::net::TcpStream::connect(env.gateway.addr)
        .await
        .unwrap();
    let io = hyper_util::rt::TokioIo::new(tcp);
    let req = |target: String| {
        http::Request::post(target)
            .header("idempotency-key", key)
            .header("te", "trailers")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let resp = if http2 {
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                .await
                .unwrap();
        tokio::spawn(conn);
        sender.send_request(req(env.url(path))).await.unwrap()
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(conn);
        let mut req = req(path.to_string());
        let host = env.gateway.addr.to_string().parse().unwrap();
        req.headers_mut().insert("host", host);
        sender.send_request(req).await.unwrap()
    };
    let (head, body) = resp.into_parts();
    let all = body.collect().await.unwrap();
    let trailers = all.trailers().cloned();
    (head, all.to_bytes(), trailers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_reach_the_client_an_attached_duplicate_and_the_replay() {
    for backend in [Backend::Redis, Backend::Embedded] {
        let upstream = CountingUpstream::start().await;
        let config = config()
            .set("admin.admin_token", ADMIN_TOKEN)
            .set("upstreams.h2.url", upstream.url())
            .set("upstreams.h2.http2", true)
            .route(
                "/h2/events",
                toml! { stream = true
                on_in_flight = "wait"
                upstream = "h2" },
            );
        let env = TestEnv::start_with(backend, upstream, config).await;
        let path = format!("/h2/events{EVENTS}&trailers=true");
        // The first call and its attached duplicate over HTTP/2; replays over both versions (an
        // HTTP/1.1 client gets the trailers the head names, in chunked coding).
        let (first, attached) =
            tokio::join!(post_taking_trailers(&env, (&path, "t-1"), true), async {
                env.upstream.wait_for_calls(1).await;
                post_taking_trailers(&env, (&path, "t-1"), true).await
            });
        let replay = post_taking_trailers(&env, (&path, "t-1"), true).await;
        let replay_h1 = post_taking_trailers(&env, (&path, "t-1"), false).await;
        let first_h1 = post_taking_trailers(&env, (&path, "t-2"), false).await;
        assert!(!first.0.headers.contains_key("idempotent-replayed"));
        for (who, (head, body, trailers)) in [
            ("first", first),
            ("attached", attached),
            ("replay", replay),
            ("replay over HTTP/1.1", replay_h1),
        ] {
            assert_eq!(
                String::from_utf8_lossy(&body),
                events(1, 0),
                "{backend:?} {who}"
            );
            let trailers = trailers.unwrap_or_else(|| panic!("{backend:?} {who}: no trailers"));
            assert_eq!(trailers["x-call"], "1", "{backend:?} {who}");
            assert_eq!(head.headers["trailer"], "x-call", "{backend:?} {who}");
            if who != "first" {
                assert_eq!(
                    head.headers["idempotent-replayed"], "true",
                    "{backend:?} {who}"
                );
            }
        }
        let (_, body, trailers) = first_h1;
        assert_eq!(String::from_utf8_lossy(&body), events(2, 0), "{backend:?}");
        assert_eq!(trailers.expect("trailers over HTTP/1.1")["x-call"], "2");
        assert_eq!(
            env.upstream.calls(),
            2,
            "{backend:?}: the upstream is called once per key"
        );
        // The key API names the recorded trailers.
        let admin = env.gateway.admin.expect("an admin listener");
        let record: serde_json::Value = env
            .client
            .get(format!("http://{admin}/keys/t-1"))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            record["trailer_names"],
            serde_json::json!(["x-call"]),
            "{record}"
        );
    }
}
