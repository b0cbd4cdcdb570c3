//! HTTP/2 clients: h2c with prior knowledge on the plain listener, and ALPN `h2` on a TLS one.
//! The protocol is the same as over HTTP/1.1: replays, conflicts, exactly one execution.

use crate::common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    send, Backend, CountingUpstream, GatewayConfig, InProcessGateway, Seen, TestCa, TestEnv,
    Validity,
};
use http_body_util::{BodyExt, Full};

on_both_backends!(
    h2c_clients_get_first_call_replay_mismatch_and_in_flight,
    a_replay_is_the_same_over_http2_and_http1,
    http2_over_tls_by_alpn,
    concurrent_duplicates_on_one_http2_connection_run_once,
);

/// A client that speaks HTTP/2 with prior knowledge (h2c).
fn h2c() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .unwrap()
}

async fn h2c_clients_get_first_call_replay_mismatch_and_in_flight(b: Backend) {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(300));
    let env = TestEnv::start_with(b, upstream, GatewayConfig::new()).await;
    let client = h2c();
    let post = |key: &str, body: &'static str| {
        client
            .post(env.url("/v1/p"))
            .header("idempotency-key", key)
            .body(body)
    };
    let first = post("h2-1", "a").send().await.unwrap();
    assert_eq!(first.version(), http::Version::HTTP_2);
    let first = Seen::of(first).await;
    assert_eq!(first.status, 201);
    let again = send(post("h2-1", "a")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    let other = send(post("h2-1", "b")).await;
    assert_eq!(other.problem_type(), "urn:idemgate:problem:mismatch");
    let slow = tokio::spawn(send(post("h2-2", "a")));
    env.upstream.wait_for_calls(2).await;
    let dup = send(post("h2-2", "a")).await;
    assert_eq!(dup.problem_type(), "urn:idemgate:problem:in-flight");
    assert_eq!(slow.await.unwrap().status, 201);
    assert_eq!(env.upstream.calls(), 2);
}

async fn a_replay_is_the_same_over_http2_and_http1(b: Backend) {
    let env = TestEnv::start(b, GatewayConfig::new()).await;
    // Recorded from an HTTP/1.1 client, replayed to an HTTP/2 one and back: the fingerprint
    // does not depend on the client's version, and neither does the replay.
    let first = send(env.post_keyed("/v1/p", "both").body("x")).await;
    let over_h2 = send(
        h2c()
            .post(env.url("/v1/p"))
            .header("idempotency-key", "both")
            .body("x"),
    )
    .await;
    let over_h1 = send(env.post_keyed("/v1/p", "both").body("x")).await;
    assert!(over_h2.replayed() && over_h1.replayed(), "{over_h2:?}");
    assert_eq!(over_h2.status, first.status);
    assert_eq!(over_h2.body, first.body);
    assert_eq!(
        over_h2.headers_without_marker(),
        over_h1.headers_without_marker()
    );
    // The first answer's headers, but for Set-Cookie (never replayed by default).
    let first_headers: Vec<_> = first
        .headers_without_marker()
        .into_iter()
        .filter(|(n, _)| n != "set-cookie")
        .collect();
    assert_eq!(over_h2.headers_without_marker(), first_headers);
    assert_eq!(env.upstream.calls(), 1);
}

async fn http2_over_tls_by_alpn(b: Backend) {
    let ca = TestCa::new();
    let cert = ca.server("gateway", &["127.0.0.1", "localhost"], Validity::Now);
    let env = TestEnv::start(
        b,
        GatewayConfig::new()
            .set("tls.cert_file", cert.cert())
            .set("tls.key_file", cert.key_path()),
    )
    .await;
    let client = ca.client_trusting();
    let url = format!("https://localhost:{}/v1/p", env.gateway.addr.port());
    let post = || {
        client
            .post(&url)
            .header("idempotency-key", "alpn")
            .body("x")
    };
    let first = post().send().await.unwrap();
    assert_eq!(first.version(), http::Version::HTTP_2, "ALPN chose h2");
    let first = Seen::of(first).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = send(post()).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(env.upstream.last_headers()["x-forwarded-proto"], "https");
    // An HTTP/1.1-only client is served on the same port.
    let h1 = reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .use_rustls_tls()
        .add_root_certificate(
            reqwest::Certificate::from_pem(&std::fs::read(&ca.ca_file).unwrap()).unwrap(),
        )
        .build()
        .unwrap();
    let resp = h1
        .post(&url)
        .header("idempotency-key", "alpn")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_11);
    assert!(Seen::of(resp).await.replayed());
    assert_eq!(env.upstream.calls(), 1);
}

/// Many streams on ONE HTTP/2 connection, all with one key, sent at once: the upstream runs
/// once; every other stream gets 409 in flight or the replay.
async fn concurrent_duplicates_on_one_http2_connection_run_once(b: Backend) {
    let upstream = CountingUpstream::start()
        .await
        .delay(Duration::from_millis(300));
    let env = TestEnv::start_with(b, upstream, GatewayConfig::new()).await;
    let tcp = tokio::net::TcpStream::connect(env.gateway.addr)
        .await
        .unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let mut streams = Vec::new();
    for _ in 0..32 {
        let mut sender = sender.clone();
        let req = http::Request::post(format!("http://{}/v1/p", env.gateway.addr))
            .header("idempotency-key", "one-connection")
            .body(Full::new(Bytes::from_static(b"x")))
            .unwrap();
        streams.push(tokio::spawn(async move {
            let resp = sender.send_request(req).await.unwrap();
            let status = resp.status().as_u16();
            let replayed = resp.headers().contains_key("idempotent-replayed");
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, replayed, body)
        }));
    }
    let mut created = 0;
    for s in streams {
        let (status, replayed, body) = s.await.unwrap();
        match status {
            201 if !replayed => created += 1,
            201 => {}
            409 => assert!(String::from_utf8_lossy(&body).contains("in-flight")),
            other => panic!("unexpected {other}: {body:?}"),
        }
    }
    assert_eq!(created, 1, "exactly one stream ran the request");
    assert_eq!(env.upstream.calls(), 1);
    assert_eq!(env.upstream.connections(), 1);
}

/// Over HTTP/2, a body trickled below `client_min_body_rate` (3 B/s under 100 B/s) gets `408
/// body-too-slow` on its stream once the grace has passed; the connection goes on, and its next
/// stream is answered.
#[tokio::test]
async fn a_stream_whose_body_trickles_below_the_min_rate_gets_408_and_the_connection_goes_on() {
    let upstream = CountingUpstream::start().await;
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .set("client_min_body_rate", "100B/s")
        .set("client_min_body_rate_grace", "1s")
        .set("admin.listen", "127.0.0.1:0");
    let gateway = InProcessGateway::start(&config).await;
    let tcp = tokio::net::TcpStream::connect(gateway.addr).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(conn);
    let post = |key: &str| {
        http::Request::post(format!("http://{}/v1/p", gateway.addr))
            .header("idempotency-key", key)
            .body(())
            .unwrap()
    };
    let mut sender = h2.clone().ready().await.unwrap();
    let (resp, mut body) = sender.send_request(post("trickled"), false).unwrap();
    let started = Instant::now();
    let trickle = tokio::spawn(async move {
        for _ in 0..50 {
            if body.send_data(Bytes::from_static(b"x"), false).is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        std::future::pending::<()>().await;
    });
    let resp = resp.await.unwrap();
    let took = started.elapsed();
    assert_eq!(resp.status(), 408);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "answered after {took:?}"
    );
    let mut answer = resp.into_body();
    let mut problem = Vec::new();
    while let Some(data) = answer.data().await {
        problem.extend_from_slice(&data.unwrap());
    }
    let problem = String::from_utf8_lossy(&problem);
    assert!(
        problem.contains("urn:idemgate:problem:body-too-slow"),
        "{problem}"
    );
    // The stream was reset: the client's next DATA frame is refused.
    tokio::time::timeout(Duration::from_secs(2), trickle)
        .await
        .expect("the stream was reset")
        .unwrap();
    // The connection goes on.
    let mut sender = h2.ready().await.unwrap();
    let (resp, _) = sender.send_request(post("after"), true).unwrap();
    assert_eq!(resp.await.unwrap().status(), 201);
    assert!(!conn.is_finished());
    assert_eq!(upstream.calls(), 1);
    assert_eq!(
        gateway
            .metric("idemgate_client_bodies_too_slow_total")
            .await,
        1.0
    );
}
