//! Message framing against buggy or hostile peers, with raw sockets on both sides: what the
//! client reads byte for byte and what the upstream receives. A framing error on a reused
//! connection would let one response (or request) bleed into the next.

use crate::common;

use common::raw::{RawClient, RawUpstream};
use common::{Backend, GatewayConfig, InProcessGateway, StoreServer};

on_both_backends!(
    a_stale_content_length_beside_chunked_never_reaches_the_client,
    request_codings_the_gateway_does_not_decode_are_refused,
    a_request_content_length_beside_chunked_is_not_forwarded,
    connect_is_answered_by_the_gateway,
);

/// A raw upstream and a gateway in front of it (with its Redis, for that backend).
struct Setup {
    upstream: RawUpstream,
    gateway: InProcessGateway,
    _redis: Option<StoreServer>,
}

async fn setup(b: Backend, upstream_answers: &'static [u8]) -> Setup {
    let upstream = RawUpstream::answering(upstream_answers).await;
    let redis = StoreServer::for_backend(b).await;
    let config = GatewayConfig::new()
        .upstream(&upstream.url())
        .store(redis.as_ref());
    let gateway = InProcessGateway::start(&config).await;
    Setup {
        upstream,
        gateway,
        _redis: redis,
    }
}

const OK: &[u8] = b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok";

fn keyed(key: &str) -> String {
    format!(
        "POST /v1/p HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-length: 1\r\n\r\nx"
    )
}

async fn a_stale_content_length_beside_chunked_never_reaches_the_client(b: Backend) {
    // RFC 9112 section 6.3: with Transfer-Encoding the length comes from the chunked framing,
    // and the Content-Length beside it is wrong (here 5 for a 20-byte body).
    let s = setup(
        b,
        b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n14\r\nhello world, chunked\r\n0\r\n\r\n",
    )
    .await;
    // One client connection, reused as a front proxy would: a fresh keyed answer, its replay,
    // a pass-through, and a last request to show the connection is still in step.
    let mut client = RawClient::connect(s.gateway.addr).await;
    for (what, request) in [
        ("fresh", keyed("split")),
        ("replay", keyed("split")),
        (
            "pass-through",
            "POST /v1/p HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\nx".to_string(),
        ),
        ("next", "GET /v1/p HTTP/1.1\r\nhost: x\r\n\r\n".to_string()),
    ] {
        let resp = client.send(request.as_bytes()).await.response().await;
        let resp = resp.unwrap_or_else(|| panic!("{what}: no response"));
        assert_eq!(resp.status(), 201, "{what}: {resp:?}");
        assert_eq!(resp.body, b"hello world, chunked", "{what}: {resp:?}");
        resp.assert_consistent_framing();
        if what == "replay" {
            assert_eq!(resp.header("idempotent-replayed"), Some("true"));
        }
    }
    assert_eq!(
        s.upstream.requests().len(),
        3,
        "the replay did not reach it"
    );
}

async fn request_codings_the_gateway_does_not_decode_are_refused(b: Backend) {
    let s = setup(b, OK).await;
    // RFC 9112 section 6.1: chunked at most once (400), and a coding the gateway does not
    // decode is not silently relabelled (501). Keyed and unkeyed alike.
    let cases = [
        ("chunked, chunked", 400, "6\r\n1\r\nx\r\n\r\n0\r\n\r\n"),
        ("gzip, chunked", 501, "3\r\nabc\r\n0\r\n\r\n"),
        (
            "chunked\r\nTransfer-Encoding: chunked",
            400,
            "1\r\nx\r\n0\r\n\r\n",
        ),
    ];
    for (codings, status, body) in cases {
        for key in ["", "idempotency-key: coded\r\n"] {
            let mut client = RawClient::connect(s.gateway.addr).await;
            let req = format!(
                "POST /v1/p HTTP/1.1\r\nhost: x\r\n{key}Transfer-Encoding: {codings}\r\n\r\n{body}"
            );
            let resp = client.send(req.as_bytes()).await.response().await.unwrap();
            assert_eq!(resp.status(), status, "{codings:?} {key:?}: {resp:?}");
            assert_eq!(
                resp.header("content-type"),
                Some("application/problem+json")
            );
            resp.assert_consistent_framing();
        }
    }
    assert!(
        s.upstream.requests().is_empty(),
        "nothing reached the upstream: {:?}",
        s.upstream.requests()
    );
}

async fn a_request_content_length_beside_chunked_is_not_forwarded(b: Backend) {
    let s = setup(b, OK).await;
    let mut forwarded = 0;
    for key in ["", "idempotency-key: smuggle\r\n"] {
        let mut client = RawClient::connect(s.gateway.addr).await;
        let req = format!(
            "POST /v1/p HTTP/1.1\r\nhost: x\r\n{key}Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\nb\r\nhello world\r\n0\r\n\r\n"
        );
        let resp = client.send(req.as_bytes()).await.response().await.unwrap();
        // Either refused outright, or forwarded with one framing that matches the body.
        if resp.status() == 400 {
            assert_eq!(
                resp.header("content-type"),
                Some("application/problem+json")
            );
        } else {
            assert_eq!(resp.status(), 201, "{resp:?}");
            forwarded += 1;
        }
    }
    assert_eq!(s.upstream.requests().len(), forwarded);
    for req in s.upstream.requests() {
        req.assert_consistent_framing();
        assert_eq!(req.body, b"hello world", "{req:?}");
    }
}

async fn connect_is_answered_by_the_gateway(b: Backend) {
    let s = setup(b, OK).await;
    let mut client = RawClient::connect(s.gateway.addr).await;
    let resp = client
        .send(b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n")
        .await
        .response()
        .await
        .expect("an answer, not a closed connection");
    assert_eq!(resp.status(), 501, "{resp:?}");
    assert_eq!(
        resp.header("content-type"),
        Some("application/problem+json")
    );
    assert!(s.upstream.requests().is_empty());
}

/// A record cut short in Redis (by hand, or by a bug) is refused, never sent with the longer
/// length it declares, and the request is not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_record_is_refused_not_sent() {
    let s = setup(
        Backend::Redis,
        b"HTTP/1.1 201 Created\r\ncontent-length: 11\r\n\r\nhello world",
    )
    .await;
    let mut client = RawClient::connect(s.gateway.addr).await;
    let first = client
        .send(keyed("cut").as_bytes())
        .await
        .response()
        .await
        .unwrap();
    assert_eq!(first.body, b"hello world");
    let mut conn = s._redis.as_ref().unwrap().redis().connection().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("test:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    let value: Vec<u8> = redis::cmd("GET")
        .arg(&keys[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(&keys[0])
        .arg(&value[..value.len() - 4])
        .arg("KEEPTTL")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut client = RawClient::connect(s.gateway.addr).await;
    let retry = client
        .send(keyed("cut").as_bytes())
        .await
        .response()
        .await
        .unwrap();
    assert_eq!(retry.status(), 500, "{retry:?}");
    assert_eq!(
        retry.header("content-type"),
        Some("application/problem+json")
    );
    retry.assert_consistent_framing();
    assert_eq!(s.upstream.requests().len(), 1, "not run again");
}
