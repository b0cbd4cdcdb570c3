//! The protocol without sockets: every branch of the state machine, with `tower::service_fn`
//! inner services, the embedded store and paused time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures_util::StreamExt;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tower::{Layer, Service, ServiceExt};

use super::{IdempotencyLayer, NotSent, IDEMPOTENT_REPLAYED};
use crate::record::policy::{FingerprintMode, KeySecret, OnInFlight, Policy, PolicyBuilder};
use crate::store::MemoryStore;

/// How the inner service fails, when it does.
#[derive(Debug, thiserror::Error)]
enum InnerError {
    #[error("connection refused")]
    Refused(#[source] NotSent),
    #[error("connection reset after the request was written")]
    Reset,
}

/// What the inner service does with a request: answers from its path and query.
/// `/ok` 201 with the call number, `/status/NNN`, `/slow?ms=N` (then 201), `/big` (2 KiB),
/// `/refused` (NotSent), `/reset` (another error), `/panic` (a defect).
async fn behave(calls: Arc<AtomicUsize>, req: Request<Body>) -> Result<Response<Body>, InnerError> {
    let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let answer = |status: u16, body: String| {
        Response::builder()
            .status(status)
            .header("x-call", n)
            .body(Body::from(body))
            .unwrap()
    };
    match path.as_str() {
        "/refused" => Err(InnerError::Refused(NotSent::new("connection refused"))),
        "/reset" => Err(InnerError::Reset),
        "/panic" => panic!("a defect in the inner service"),
        // Gives up at the deadline itself, as the proxy does with its own upstream_timeout.
        "/gives-up" => {
            let deadline = req.extensions().get::<super::Deadline>().map(|d| d.0);
            if let Some(deadline) = deadline {
                tokio::time::sleep_until(deadline).await;
            }
            Err(InnerError::Reset)
        }
        "/big" => Ok(answer(201, "x".repeat(2048))),
        // A streamed answer's head late in a renewal period, its body broken off soon after.
        "/late-break" => {
            tokio::time::sleep(Duration::from_millis(29)).await;
            let broken = futures_util::stream::once(async {
                tokio::time::sleep(Duration::from_millis(6)).await;
                Err::<Bytes, _>(std::io::Error::other("reset mid-body"))
            });
            Ok(Response::new(Body::from_stream(broken)))
        }
        "/panics-midway" => {
            let first = futures_util::stream::iter([Ok(Bytes::from_static(b"ab"))]);
            let frames = first.chain(futures_util::stream::once(a_defect_midway()));
            Ok(Response::new(Body::from_stream(frames)))
        }
        "/slow" => {
            let ms: u64 = query.trim_start_matches("ms=").parse().unwrap();
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(answer(201, format!("call {n}")))
        }
        p if p.starts_with("/status/") => Ok(answer(p[8..].parse().unwrap(), format!("call {n}"))),
        _ => Ok(answer(201, format!("call {n}"))),
    }
}

/// A body's chunk that never comes: the inner service's defect, midway through its body.
async fn a_defect_midway() -> Result<Bytes, std::io::Error> {
    panic!("a defect in the inner service's body")
}

/// The layer with `policy` (built from the defaults by `f`) over the behaving inner service,
/// and its call counter.
struct Setup {
    layer: IdempotencyLayer<MemoryStore>,
    calls: Arc<AtomicUsize>,
}

impl Setup {
    fn new(f: impl FnOnce(PolicyBuilder) -> PolicyBuilder) -> Self {
        let policy = f(Policy::builder().max_body(1024)).build().unwrap();
        Setup {
            layer: IdempotencyLayer::new(MemoryStore::new(), policy),
            calls: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn service(
        &self,
    ) -> impl Service<
        Request<Body>,
        Response = Response<Body>,
        Error = InnerError,
        Future = impl Send + 'static,
    > + Clone
           + Send
           + 'static {
        let calls = self.calls.clone();
        self.layer
            .layer(tower::service_fn(move |req| behave(calls.clone(), req)))
    }

    /// Send `POST path` with `key` and `body` and read the answer whole.
    async fn post(&self, path: &str, key: &str, body: &str) -> Result<Seen, InnerError> {
        let req = keyed(path, key, body);
        let resp = self.service().oneshot(req).await?;
        Ok(Seen::of(resp).await)
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

fn keyed(path: &str, key: &str, body: &str) -> Request<Body> {
    let mut req = Request::post(path);
    if !key.is_empty() {
        req = req.header("idempotency-key", key);
    }
    req.body(Body::from(body.to_string())).unwrap()
}

/// A response read whole.
#[derive(Debug)]
struct Seen {
    status: StatusCode,
    replayed: bool,
    problem: Option<String>,
    body: Bytes,
}

impl Seen {
    async fn of(resp: Response<Body>) -> Self {
        let status = resp.status();
        let replayed = resp.headers().get(IDEMPOTENT_REPLAYED).is_some();
        let is_problem = resp
            .headers()
            .get("content-type")
            .is_some_and(|v| v == "application/problem+json");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let problem = is_problem.then(|| {
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            v["type"]
                .as_str()
                .unwrap()
                .trim_start_matches("urn:idemgate:problem:")
                .to_string()
        });
        Seen {
            status,
            replayed,
            problem,
            body,
        }
    }

    fn problem(&self) -> &str {
        self.problem.as_deref().unwrap_or("(not a problem)")
    }
}

#[tokio::test(start_paused = true)]
async fn a_stored_response_is_replayed_without_a_second_call() {
    let s = Setup::new(|p| p);
    let first = s.post("/ok", "k", "a").await.unwrap();
    assert_eq!((first.status, first.replayed), (StatusCode::CREATED, false));
    let again = s.post("/ok", "k", "a").await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.body, first.body);
    assert_eq!(s.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn another_request_with_the_key_is_a_mismatch() {
    let s = Setup::new(|p| p.mismatch_status(StatusCode::UNPROCESSABLE_ENTITY));
    s.post("/ok", "k", "a").await.unwrap();
    let other = s.post("/ok", "k", "b").await.unwrap();
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.problem(), "mismatch");
    assert_eq!(s.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn answers_that_say_try_again_release_the_key() {
    for status in ["500", "503", "408", "429"] {
        let s = Setup::new(|p| p);
        let path = format!("/status/{status}");
        let first = s.post(&path, "k", "a").await.unwrap();
        assert_eq!(first.status.as_str(), status);
        let again = s.post(&path, "k", "a").await.unwrap();
        assert!(!again.replayed, "{status} was stored");
        assert_eq!(s.calls(), 2, "{status}: the retry ran again");
    }
    let s = Setup::new(|p| p.cache_server_errors(true));
    s.post("/status/500", "k", "a").await.unwrap();
    assert!(s.post("/status/500", "k", "a").await.unwrap().replayed);
}

#[tokio::test(start_paused = true)]
async fn a_request_not_sent_releases_the_key_and_returns_the_error() {
    let s = Setup::new(|p| p);
    let e = s.post("/refused", "k", "a").await.unwrap_err();
    assert!(matches!(e, InnerError::Refused(_)));
    // Released: the retry runs (and fails the same way) rather than meeting a claim.
    assert!(matches!(
        s.post("/refused", "k", "a").await.unwrap_err(),
        InnerError::Refused(_)
    ));
    assert_eq!(s.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_failure_after_sending_keeps_the_claim_until_the_lease_ends() {
    let s = Setup::new(|p| p.lock_ttl(Duration::from_secs(10)));
    assert!(matches!(
        s.post("/reset", "k", "a").await.unwrap_err(),
        InnerError::Reset
    ));
    let retry = s.post("/reset", "k", "a").await.unwrap();
    assert_eq!(retry.problem(), "in-flight", "it may have been processed");
    tokio::time::advance(Duration::from_secs(11)).await;
    assert!(
        s.post("/reset", "k", "a").await.is_err(),
        "the lease ended: it runs again"
    );
    assert_eq!(s.calls(), 2);
}

/// A claimed call's task that fails in any way settles its key and its gauges: the client gets
/// a 500 (not a closed connection), the in-flight gauge comes back down, the call is counted
/// as unsettled, and the key is left to its lease (whether the call ran is unknown), then runs.
#[tokio::test(start_paused = true)]
async fn a_panicking_call_answers_500_and_leaves_its_key_to_the_lease() {
    let s = Setup::new(|p| p.lock_ttl(Duration::from_secs(10)));
    let first = s.post("/panic", "k", "a").await.unwrap();
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(first.problem(), "internal");
    s.layer.tasks().close();
    s.layer.tasks().wait().await;
    let metrics = s.layer.metrics().encode();
    assert!(
        metrics.contains("idemgate_in_flight_claims 0\n"),
        "{metrics}"
    );
    assert!(
        metrics
            .contains("idemgate_calls_unsettled_total{route=\"defaults\",reason=\"failed\"} 1\n"),
        "{metrics}"
    );
    let retry = s.post("/panic", "k", "a").await.unwrap();
    assert_eq!(retry.problem(), "in-flight");
    tokio::time::advance(Duration::from_secs(11)).await;
    assert_eq!(
        s.post("/ok", "k2", "a").await.unwrap().status,
        StatusCode::CREATED
    );
    assert_eq!(
        s.post("/panic", "k", "a").await.unwrap().problem(),
        "internal"
    );
    assert_eq!(s.calls(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_streamed_answer_whose_recording_panics_ends_its_reader_with_an_error() {
    let s = Setup::new(|p| p.stream(true).lock_ttl(Duration::from_secs(10)));
    let resp = s
        .service()
        .oneshot(keyed("/panics-midway", "k", "a"))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    // Read from the tape the claimed call's task records onto: that task panicked midway.
    let body = tokio::time::timeout(Duration::from_secs(60), resp.into_body().collect())
        .await
        .expect("the body ends rather than waiting for the chunk that never comes");
    assert!(body.is_err(), "ended with an error, never a clean end");
    // Nobody knows what the call did: its key stays claimed until its lease ends.
    let retry = s.post("/panics-midway", "k", "a").await.unwrap();
    assert_eq!(retry.problem(), "in-flight");
    assert_eq!(s.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_lease_keeps_its_renewal_period_from_the_head_to_the_body() {
    // Claimed at 0 with a 30 ms lease: renewed at 10 and 20; the head comes at 29, the body
    // breaks off at 35. The body's hold renews at 30, a period after the last renewal, so the
    // key is claimed until 60; begun anew at the head, its first renewal would have come at
    // 39, after the break, and the lease taken at 20 ended at 50.
    let start = tokio::time::Instant::now();
    let s = Setup::new(|p| p.stream(true).lock_ttl(Duration::from_millis(30)));
    let resp = s
        .service()
        .oneshot(keyed("/late-break", "k", "a"))
        .await
        .unwrap();
    assert!(resp.into_body().collect().await.is_err(), "broken off");
    tokio::time::sleep_until(start + Duration::from_millis(51)).await;
    let retry = s.post("/late-break", "k", "a").await.unwrap();
    assert_eq!(retry.problem(), "in-flight");
    assert_eq!(s.calls(), 1);
    tokio::time::sleep_until(start + Duration::from_millis(61)).await;
    let later = s
        .service()
        .oneshot(keyed("/late-break", "k", "a"))
        .await
        .unwrap();
    assert_eq!(later.status(), StatusCode::OK, "the lease ended");
    assert_eq!(s.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn an_answer_with_no_final_status_is_a_502_that_keeps_the_claim() {
    let s = Setup::new(|p| p.lock_ttl(Duration::from_secs(10)));
    for (key, status) in [("k101", "101"), ("k600", "600")] {
        let path = format!("/status/{status}");
        let first = s.post(&path, key, "a").await.unwrap();
        assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{status}");
        assert_eq!(first.problem(), "upstream-invalid-response");
        let retry = s.post(&path, key, "a").await.unwrap();
        assert_eq!(
            retry.problem(),
            "in-flight",
            "{status}: it may have been processed"
        );
    }
    assert_eq!(s.calls(), 2);
    tokio::time::advance(Duration::from_secs(11)).await;
    let after = s.post("/status/101", "k101", "a").await.unwrap();
    assert_eq!(
        after.problem(),
        "upstream-invalid-response",
        "the lease ended: it runs again"
    );
    assert_eq!(s.calls(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_timeout_answers_504_and_keeps_the_claim() {
    let s = Setup::new(|p| {
        p.upstream_timeout(Duration::from_secs(1))
            .lock_ttl(Duration::from_secs(10))
    });
    let timed_out = s.post("/slow?ms=5000", "k", "a").await.unwrap();
    assert_eq!(timed_out.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(timed_out.problem(), "upstream-timeout");
    let retry = s.post("/slow?ms=5000", "k", "a").await.unwrap();
    assert_eq!(retry.problem(), "in-flight");
    assert_eq!(s.calls(), 1);
}

/// A call the inner service gave up on at the deadline (the proxy's own timeout) timed out:
/// counted and logged as a timeout, not as a failure after sending.
#[tokio::test(start_paused = true)]
async fn a_call_given_up_at_its_deadline_is_logged_and_counted_as_a_timeout() {
    let log = Log::default();
    let _quiet = tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_writer(log.clone())
            .with_ansi(false)
            .finish(),
    );
    let s = Setup::new(|p| p.upstream_timeout(Duration::from_secs(1)));
    let first = s.service().oneshot(keyed("/gives-up", "k", "a")).await;
    assert!(matches!(first, Err(InnerError::Reset)));
    s.layer.tasks().close();
    s.layer.tasks().wait().await;
    let text = log.text();
    assert!(text.contains("upstream timed out"), "{text}");
    assert!(
        !text.contains("failed after the request may have been sent"),
        "{text}"
    );
    let metrics = s.layer.metrics().encode();
    let timeout = "idemgate_calls_unsettled_total{route=\"defaults\",reason=\"timeout\"} 1\n";
    assert!(metrics.contains(timeout), "{metrics}");
}

/// What the gateway logged, for a test to read.
#[derive(Clone, Default)]
struct Log(Arc<std::sync::Mutex<Vec<u8>>>);

impl Log {
    fn text(&self) -> String {
        let bytes = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut log = self.0.lock().unwrap_or_else(|p| p.into_inner());
        log.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Log {
    type Writer = Log;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[tokio::test(start_paused = true)]
async fn an_oversized_response_is_delivered_once_and_not_replayed() {
    let s = Setup::new(|p| p);
    let first = s.post("/big", "k", "a").await.unwrap();
    assert_eq!(first.body.len(), 2048, "delivered whole");
    let again = s.post("/big", "k", "a").await.unwrap();
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(again.problem(), "not-replayable");
    assert_eq!(s.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn an_oversized_or_keyless_request_is_refused_before_the_store() {
    let s = Setup::new(|p| p.require_key(true));
    let big = s.post("/ok", "k", &"x".repeat(2000)).await.unwrap();
    assert_eq!(big.status, StatusCode::PAYLOAD_TOO_LARGE);
    let keyless = s.post("/ok", "", "a").await.unwrap();
    assert_eq!(keyless.problem(), "missing-key");
    let bad = s.post("/ok", "a b", "a").await.unwrap();
    assert_eq!(bad.problem(), "invalid-key");
    assert_eq!(s.calls(), 0);
}

#[tokio::test(start_paused = true)]
async fn requests_idempotency_does_not_apply_to_are_the_inner_service_alone() {
    let s = Setup::new(|p| p);
    let get = Request::get("/ok")
        .header("idempotency-key", "k")
        .body(Body::empty())
        .unwrap();
    for _ in 0..2 {
        let seen = Seen::of(s.service().oneshot(get_clone(&get)).await.unwrap()).await;
        assert!(!seen.replayed);
    }
    for _ in 0..2 {
        assert!(!s.post("/ok", "", "a").await.unwrap().replayed);
    }
    assert_eq!(s.calls(), 4);
}

fn get_clone(req: &Request<Body>) -> Request<Body> {
    let mut r = Request::get(req.uri().clone()).body(Body::empty()).unwrap();
    *r.headers_mut() = req.headers().clone();
    r
}

#[tokio::test(start_paused = true)]
async fn the_lease_is_renewed_while_the_call_runs() {
    let s = Setup::new(|p| {
        p.lock_ttl(Duration::from_secs(3))
            .upstream_timeout(Duration::from_secs(60))
    });
    let svc = s.service();
    let first = tokio::spawn(svc.oneshot(keyed("/slow?ms=10000", "k", "a")));
    // Well past three leases, the key is still held: no second execution.
    tokio::time::sleep(Duration::from_secs(9)).await;
    let dup = s.post("/slow?ms=10000", "k", "a").await.unwrap();
    assert_eq!(dup.problem(), "in-flight");
    let first = Seen::of(first.await.unwrap().unwrap()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(s.post("/slow?ms=10000", "k", "a").await.unwrap().replayed);
    assert_eq!(s.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_stale_holder_cannot_record_over_a_newer_claim() {
    let s = Setup::new(|p| p.upstream_timeout(Duration::from_secs(60)));
    let stale = tokio::spawn(s.service().oneshot(keyed("/slow?ms=5000", "k", "a")));
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The key is evicted under the first holder (an operator, or a lost lease), and claimed anew.
    assert_eq!(s.layer.store().purge_all(), 1);
    let fresh = s.post("/ok", "k", "a").await.unwrap();
    assert_eq!(fresh.body, "call 2");
    // The stale holder's answer still reaches its client, but is not recorded.
    let stale = Seen::of(stale.await.unwrap().unwrap()).await;
    assert_eq!(stale.body, "call 1");
    let replay = s.post("/ok", "k", "a").await.unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.body, "call 2", "the newer record stands");
}

#[tokio::test(start_paused = true)]
async fn waiting_duplicates_get_the_replay_within_their_bounds() {
    let s = Setup::new(|p| {
        p.on_in_flight(OnInFlight::Wait)
            .wait_timeout(Duration::from_secs(5))
            .max_waiters(1)
            .upstream_timeout(Duration::from_secs(60))
    });
    let first = tokio::spawn(s.service().oneshot(keyed("/slow?ms=2000", "k", "a")));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let waiter = tokio::spawn(s.service().oneshot(keyed("/slow?ms=2000", "k", "a")));
    tokio::time::sleep(Duration::from_millis(10)).await;
    // One may wait; the next is refused at once.
    let over = s.post("/slow?ms=2000", "k", "a").await.unwrap();
    assert_eq!(over.problem(), "in-flight");
    let waited = Seen::of(waiter.await.unwrap().unwrap()).await;
    assert!(waited.replayed);
    assert_eq!(
        Seen::of(first.await.unwrap().unwrap()).await.body,
        waited.body
    );
    assert_eq!(s.calls(), 1);

    // Past wait_timeout, a waiter gets the 409.
    let slow = tokio::spawn(s.service().oneshot(keyed("/slow?ms=20000", "k2", "a")));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let started = tokio::time::Instant::now();
    let gave_up = s.post("/slow?ms=20000", "k2", "a").await.unwrap();
    assert_eq!(gave_up.problem(), "in-flight");
    assert!(started.elapsed() >= Duration::from_secs(5));
    slow.abort();
}

#[tokio::test(start_paused = true)]
async fn durations_set_in_code_past_any_deadline_are_bounded() {
    let mut policy = Policy::builder()
        .on_in_flight(OnInFlight::Wait)
        .build()
        .unwrap();
    // Set on the fields, past what the builder and the config clamp to.
    policy.upstream_timeout = Duration::MAX;
    policy.wait_timeout = Duration::MAX;
    let s = Setup {
        layer: IdempotencyLayer::new(MemoryStore::new(), policy),
        calls: Arc::new(AtomicUsize::new(0)),
    };
    let first = tokio::spawn(s.service().oneshot(keyed("/slow?ms=2000", "k", "a")));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let waited = s.post("/slow?ms=2000", "k", "a").await.unwrap();
    assert!(waited.replayed);
    let first = Seen::of(first.await.unwrap().unwrap()).await;
    assert_eq!(
        (first.status, first.body),
        (StatusCode::CREATED, waited.body)
    );
    assert_eq!(s.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_goes_away_does_not_cancel_the_claimed_call() {
    let s = Setup::new(|p| p.upstream_timeout(Duration::from_secs(60)));
    let caller = tokio::spawn(s.service().oneshot(keyed("/slow?ms=1000", "k", "a")));
    tokio::time::sleep(Duration::from_millis(100)).await;
    caller.abort();
    assert!(caller.await.unwrap_err().is_cancelled());
    // The claimed call runs to its end in the layer's own task and is recorded.
    let tasks = s.layer.tasks();
    tasks.close();
    tasks.wait().await;
    let retry = s.post("/slow?ms=1000", "k", "a").await.unwrap();
    assert!(retry.replayed);
    assert_eq!(s.calls(), 1);
}

/// `POST /ok` with a JSON body and no key header.
fn json_without_key(body: &str) -> Request<Body> {
    Request::post("/ok")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_derived_key_and_a_canonical_fingerprint_make_a_reserialised_payment_a_retry() {
    let secret = KeySecret::new("a-secret-of-the-service-0123").unwrap();
    let s = Setup::new(|p| {
        p.derived_key(["/merchant", "/amount"], secret)
            .fingerprint(FingerprintMode::Json)
            .fingerprint_ignore(["/sent_at"])
    });
    let send = |body: &'static str| async {
        Seen::of(s.service().oneshot(json_without_key(body)).await.unwrap()).await
    };
    let first = send(r#"{"merchant":"m","amount":100,"sent_at":1}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send("{ \"sent_at\": 2, \"amount\": 1.0e2, \"merchant\": \"m\" }").await;
    assert!(again.replayed, "{again:?}");
    assert_eq!(again.body, first.body);
    let other = send(r#"{"merchant":"m","amount":101}"#).await;
    assert!(!other.replayed);
    assert_eq!(s.calls(), 2);
    let broken = send(r#"{"merchant":"m","amount":100"#).await;
    assert_eq!(broken.problem(), "invalid-json");
    assert_eq!(s.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_4xx_lives_for_failure_ttl_and_a_2xx_for_ttl() {
    let s = Setup::new(|p| {
        p.ttl(Duration::from_secs(3600))
            .failure_ttl(Duration::from_secs(300))
    });
    s.post("/status/400", "bad", "a").await.unwrap();
    s.post("/ok", "good", "a").await.unwrap();
    tokio::time::advance(Duration::from_secs(299)).await;
    assert!(s.post("/status/400", "bad", "a").await.unwrap().replayed);
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(
        !s.post("/status/400", "bad", "a").await.unwrap().replayed,
        "expired"
    );
    assert!(s.post("/ok", "good", "a").await.unwrap().replayed);
    assert_eq!(s.calls(), 3);
}
