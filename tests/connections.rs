//! Client connections as an attacker would hold them: silent, half-sent, idle, never reading,
//! by the hundred; an upstream that answers `101`; a request whose `Host` and `:authority`
//! disagree. Raw bytes and raw HTTP/2 frames (the `h2` crate) where a polite client would not do.

use crate::common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::raw::RawUpstream;
use common::{
    client, send, wait_until, Backend, CountingUpstream, GatewayConfig, InProcessGateway,
    StoreServer, TestEnv,
};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

on_both_backends!(
    an_unsolicited_101_keeps_the_key_claimed,
    a_client_that_stops_reading_is_closed_within_the_idle_timeout,
);

const HEADER_TIMEOUT: Duration = Duration::from_secs(1);
const IDLE_TIMEOUT: Duration = Duration::from_secs(3);

/// Short client timeouts, and an admin listener to read the metrics from.
fn timeouts() -> GatewayConfig {
    GatewayConfig::new()
        .set("client_header_timeout", "1s")
        .set("client_idle_timeout", "3s")
        .set("admin.listen", "127.0.0.1:0")
}

/// How many connections the gateway says it closed for `reason`.
async fn closed(gateway: &InProcessGateway, reason: &str) -> u64 {
    let series = format!("idemgate_client_connections_closed_total{{reason=\"{reason}\"}}");
    gateway.metric(&series).await as u64
}

/// Read (and drop) whatever the gateway sends until it closes the connection; how long that took.
async fn time_until_closed(mut stream: impl AsyncRead + Unpin, limit: Duration) -> Duration {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at((started + limit).into(), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => {}
            Err(_) => panic!("the connection was still open after {limit:?}"),
        }
    }
}

/// Raw HTTP/2 frames, written as the slowest or most hostile client would.
mod frames {
    pub(crate) const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    pub(crate) const DATA: u8 = 0x0;
    pub(crate) const HEADERS: u8 = 0x1;
    pub(crate) const SETTINGS: u8 = 0x4;
    pub(crate) const PING: u8 = 0x6;
    pub(crate) const GOAWAY: u8 = 0x7;
    pub(crate) const END_STREAM: u8 = 0x1;
    pub(crate) const END_HEADERS: u8 = 0x4;

    pub(crate) fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// A header block (HPACK, literals without Huffman coding) for `GET path` at `authority`.
    pub(crate) fn get(path: &str, authority: &str) -> Vec<u8> {
        // :method GET and :scheme http from the static table, :path and :authority as literals
        // with indexed names.
        let mut block = vec![0x82, 0x86];
        for (index, value) in [(0x04, path), (0x01, authority)] {
            block.push(index);
            block.push(value.len() as u8);
            block.extend_from_slice(value.as_bytes());
        }
        block
    }

    /// The preface and an empty SETTINGS frame: a connection that has said hello.
    pub(crate) fn hello() -> Vec<u8> {
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(SETTINGS, 0, 0, &[]));
        bytes
    }

    /// Read frames (acknowledging SETTINGS and PING) until one ends a stream: an answer.
    pub(crate) async fn read_an_answer(stream: &mut tokio::net::TcpStream) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            let mut head = [0u8; 9];
            stream.read_exact(&mut head).await.unwrap();
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            stream.read_exact(&mut payload).await.unwrap();
            let (kind, flags) = (head[3], head[4]);
            let ack = match kind {
                SETTINGS if flags & 0x1 == 0 => frame(SETTINGS, 0x1, 0, &[]),
                PING if flags & 0x1 == 0 => frame(PING, 0x1, 0, &payload),
                _ => vec![],
            };
            stream.write_all(&ack).await.unwrap();
            if (kind == DATA || kind == HEADERS) && flags & END_STREAM != 0 {
                return;
            }
        }
    }
}

#[tokio::test]
async fn silent_connections_are_closed_within_the_header_timeout() {
    let upstream = CountingUpstream::start().await;
    let gateway = InProcessGateway::start(&timeouts().upstream(&upstream.url())).await;
    let partial_headers = {
        let mut bytes = frames::hello();
        // A HEADERS frame without END_HEADERS: the block awaits a CONTINUATION that never comes.
        bytes.extend(frames::frame(
            frames::HEADERS,
            frames::END_STREAM,
            1,
            &frames::get("/v1/p", "gw")[..3],
        ));
        bytes
    };
    let shapes: [(&str, Vec<u8>); 5] = [
        ("no byte at all", vec![]),
        (
            "16 bytes of the HTTP/2 preface",
            frames::PREFACE[..16].to_vec(),
        ),
        ("HTTP/2 without a stream", frames::hello()),
        ("HEADERS without END_HEADERS", partial_headers),
        (
            "half an HTTP/1.1 head",
            b"POST /v1/p HTTP/1.1\r\nhost: gw\r\nidem".to_vec(),
        ),
    ];
    let mut waits = Vec::new();
    for (what, bytes) in shapes {
        let mut stream = TcpStream::connect(gateway.addr).await.unwrap();
        stream.write_all(&bytes).await.unwrap();
        waits.push(async move {
            let took = time_until_closed(stream, HEADER_TIMEOUT * 4).await;
            (what, took)
        });
    }
    for (what, took) in futures_util::future::join_all(waits).await {
        assert!(
            took >= HEADER_TIMEOUT - Duration::from_millis(100) && took < HEADER_TIMEOUT * 5 / 2,
            "{what}: closed after {took:?}"
        );
    }
    assert_eq!(closed(&gateway, "header_timeout").await, 5);
    assert_eq!(upstream.calls(), 0);
}

/// An HTTP/2 header block whose frames say END_HEADERS but whose payload trickles, a byte every
/// 200 ms, is no head until its last byte: cut at `client_header_timeout`, on a new connection
/// and on one that has been answered before.
#[tokio::test]
async fn a_trickled_http2_header_block_gets_the_header_timeout() {
    let upstream = CountingUpstream::start().await;
    let gateway = InProcessGateway::start(&timeouts().upstream(&upstream.url())).await;
    // Long enough to trickle past the idle timeout: 80 bytes, 16 s.
    let block = frames::get(&format!("/v1/p?{}", "x".repeat(60)), "gw");
    let headers = |stream: u32| {
        let flags = frames::END_HEADERS | frames::END_STREAM;
        frames::frame(frames::HEADERS, flags, stream, &block)
    };
    for answered_before in [false, true] {
        let mut stream = TcpStream::connect(gateway.addr).await.unwrap();
        stream.write_all(&frames::hello()).await.unwrap();
        let mut id = 1;
        if answered_before {
            stream.write_all(&headers(id)).await.unwrap();
            frames::read_an_answer(&mut stream).await;
            id += 2;
        }
        let (read, mut write) = stream.into_split();
        let frame = headers(id);
        let trickle = tokio::spawn(async move {
            write.write_all(&frame[..10]).await?;
            for b in &frame[10..] {
                tokio::time::sleep(Duration::from_millis(200)).await;
                write.write_all(std::slice::from_ref(b)).await?;
            }
            Ok::<_, std::io::Error>(())
        });
        let took = time_until_closed(read, IDLE_TIMEOUT * 2).await;
        assert!(
            took >= HEADER_TIMEOUT - Duration::from_millis(100) && took < HEADER_TIMEOUT * 5 / 2,
            "answered before: {answered_before}: closed after {took:?}"
        );
        trickle.abort();
    }
    assert_eq!(closed(&gateway, "header_timeout").await, 2);
    assert_eq!(upstream.calls(), 1);
}

#[tokio::test]
async fn a_later_request_head_gets_the_header_timeout_and_a_quiet_connection_the_idle_one() {
    let upstream = CountingUpstream::start().await;
    let gateway = InProcessGateway::start(&timeouts().upstream(&upstream.url())).await;
    let get = b"GET /v1/p HTTP/1.1\r\nhost: gw\r\n\r\n";
    // A keep-alive connection that starts its second request head and stops: the header timeout
    // (1 s), not the idle one (3 s), counted from the first byte of the head.
    let mut started_late = TcpStream::connect(gateway.addr).await.unwrap();
    started_late.write_all(get).await.unwrap();
    let mut buf = [0u8; 4096];
    assert!(started_late.read(&mut buf).await.unwrap() > 0);
    // Half a second into the idle time: the idle timeout would close it 2.5 s later, the header
    // timeout 1 s later.
    tokio::time::sleep(Duration::from_millis(500)).await;
    started_late
        .write_all(b"GET /v1/p HTTP/1.1\r\nho")
        .await
        .unwrap();
    let took = time_until_closed(started_late, IDLE_TIMEOUT * 2).await;
    assert!(
        took >= HEADER_TIMEOUT - Duration::from_millis(100) && took < Duration::from_secs(2),
        "a late head closed after {took:?}"
    );
    // A keep-alive connection that sends nothing more: the idle timeout.
    let mut quiet = TcpStream::connect(gateway.addr).await.unwrap();
    quiet.write_all(get).await.unwrap();
    assert!(quiet.read(&mut buf).await.unwrap() > 0);
    let took = time_until_closed(quiet, IDLE_TIMEOUT * 2).await;
    assert!(
        took >= IDLE_TIMEOUT - Duration::from_millis(200) && took < IDLE_TIMEOUT * 2,
        "an idle keep-alive connection closed after {took:?}"
    );
    assert_eq!(closed(&gateway, "header_timeout").await, 1);
    assert_eq!(closed(&gateway, "idle_timeout").await, 1);
}

#[tokio::test]
async fn an_idle_http2_connection_gets_goaway_after_the_idle_timeout() {
    let upstream = CountingUpstream::start().await;
    let gateway = InProcessGateway::start(&timeouts().upstream(&upstream.url())).await;
    let mut stream = TcpStream::connect(gateway.addr).await.unwrap();
    let mut hello = frames::hello();
    hello.extend(frames::frame(
        frames::HEADERS,
        frames::END_HEADERS | frames::END_STREAM,
        1,
        &frames::get("/v1/p", "gw"),
    ));
    stream.write_all(&hello).await.unwrap();
    // Frames until the answer ends; then, after the idle timeout, GOAWAY and the close.
    let mut answered = None;
    let mut goaway = None;
    loop {
        let mut head = [0u8; 9];
        if stream.read_exact(&mut head).await.is_err() {
            break;
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        stream.read_exact(&mut payload).await.unwrap();
        let (kind, flags) = (head[3], head[4]);
        if kind == frames::SETTINGS && flags & 0x1 == 0 {
            stream
                .write_all(&frames::frame(frames::SETTINGS, 0x1, 0, &[]))
                .await
                .unwrap();
        }
        if kind == frames::PING && flags & 0x1 == 0 {
            stream
                .write_all(&frames::frame(frames::PING, 0x1, 0, &payload))
                .await
                .unwrap();
        }
        if (kind == frames::DATA || kind == frames::HEADERS) && flags & frames::END_STREAM != 0 {
            answered = Some(Instant::now());
        }
        if kind == frames::GOAWAY {
            let code = u32::from_be_bytes(payload[4..8].try_into().unwrap());
            assert_eq!(code, 0, "GOAWAY with NO_ERROR");
            goaway.get_or_insert_with(Instant::now);
        }
    }
    let answered = answered.expect("the request was answered");
    let after = goaway.expect("a GOAWAY before the close") - answered;
    assert!(
        after >= IDLE_TIMEOUT - Duration::from_millis(200) && after < IDLE_TIMEOUT * 2,
        "GOAWAY {after:?} after the answer"
    );
    assert_eq!(closed(&gateway, "idle_timeout").await, 1);
    assert_eq!(upstream.calls(), 1);
}

#[tokio::test]
async fn the_connection_cap_holds_silent_connections_back_while_a_client_is_served() {
    let upstream = CountingUpstream::start().await;
    let config = timeouts()
        .upstream(&upstream.url())
        .set("max_client_connections", 50)
        .set("workers", 2);
    let gateway = InProcessGateway::start(&config).await;
    let mut silent = Vec::new();
    for _ in 0..300 {
        silent.push(TcpStream::connect(gateway.addr).await.unwrap());
    }
    wait_until(
        Duration::from_secs(5),
        "the gateway accepted up to its cap",
        async || gateway.metric("idemgate_client_connections").await >= 50.0,
    )
    .await;
    // Behind 250 silent connections in the backlog, each batch of 50 closed after 1 s.
    let started = Instant::now();
    let served = send(
        client()
            .post(gateway.url("/v1/p"))
            .header("idempotency-key", "behind-the-crowd")
            .body("x"),
    );
    let mut most = 0.0f64;
    tokio::pin!(served);
    let seen = loop {
        tokio::select! {
            seen = &mut served => break seen,
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                most = most.max(gateway.metric("idemgate_client_connections").await);
            }
        }
    };
    assert_eq!(seen.status, 201);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "served after {:?}",
        started.elapsed()
    );
    assert!(most <= 50.0, "{most} connections open at once");
    assert!(
        gateway
            .metric("idemgate_client_connections_at_cap_seconds_total")
            .await
            > 1.0
    );
    assert!(closed(&gateway, "header_timeout").await >= 250);
    drop(silent);
}

async fn a_client_that_stops_reading_is_closed_within_the_idle_timeout(b: Backend) {
    // A keyed answer of 32 MiB, recorded whole, that the client takes slowly and then stops
    // taking: more than the socket buffers hold, so the gateway's writes stop.
    let env = TestEnv::start(b, timeouts().set("defaults.max_body", "64MiB")).await;
    let request = "POST /big?bytes=33554432 HTTP/1.1\r\nhost: gw\r\nidempotency-key: never-read\r\ncontent-length: 1\r\n\r\nx";
    let mut stream = TcpStream::connect(env.gateway.addr).await.unwrap();
    let connected = Instant::now();
    stream.write_all(request.as_bytes()).await.unwrap();
    // It takes 64 KiB every 10 ms (so that the gateway's socket buffer drains and its writes
    // go on), and stops a second after a whole number of idle timeouts since it connected (and
    // after the answer's first byte): the worst moment for a watchdog that would look only
    // once every idle timeout, which would close it nearly two idle timeouts later.
    stream.peek(&mut [0u8; 1]).await.unwrap();
    let first_byte = Instant::now();
    let mut stop = connected + IDLE_TIMEOUT + Duration::from_secs(1);
    while stop < Instant::now() + Duration::from_millis(500) {
        stop += IDLE_TIMEOUT;
    }
    let mut buf = vec![0u8; 64 << 10];
    while Instant::now() < stop {
        assert!(stream.read(&mut buf).await.unwrap() > 0, "the answer ended");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stopped = Instant::now();
    // The gateway's last write came between the answer's first byte and the stop (how long
    // before it, the time its socket buffer takes to drain by half says): closed no sooner
    // than the idle timeout after the first, and within it and its slack (one second, and half
    // as much again for a loaded machine) after the second.
    wait_until(
        IDLE_TIMEOUT * 3,
        "the gateway closes a connection whose client stopped reading",
        async || closed(&env.gateway, "stalled").await == 1,
    )
    .await;
    let (since_first, since_stop) = (first_byte.elapsed(), stopped.elapsed());
    assert!(
        since_first >= IDLE_TIMEOUT - Duration::from_millis(100)
            && since_stop < IDLE_TIMEOUT + Duration::from_millis(1500),
        "HTTP/1.1: closed {since_stop:?} after the client stopped reading"
    );
    drop(stream);
    // Over HTTP/2, a client whose stream window stays 0: the answer's head comes, no DATA can.
    let tcp = TcpStream::connect(env.gateway.addr).await.unwrap();
    let (mut h2, conn) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, Bytes>(tcp)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let req = http::Request::post(format!("http://{}/big?bytes=1000", env.gateway.addr))
        .header("idempotency-key", "window-zero")
        .body(())
        .unwrap();
    let (resp, mut body) = h2.send_request(req, false).unwrap();
    body.send_data(Bytes::from_static(b"x"), true).unwrap();
    let resp = resp.await.unwrap();
    assert_eq!(resp.status(), 201);
    // The answer's head came; its first DATA waits on the window from then.
    let started = Instant::now();
    let _ = tokio::time::timeout(IDLE_TIMEOUT * 3, conn)
        .await
        .expect("the gateway closed the connection");
    let took = started.elapsed();
    assert!(
        took >= IDLE_TIMEOUT - Duration::from_millis(200)
            && took < IDLE_TIMEOUT + Duration::from_millis(1500),
        "HTTP/2: closed {took:?} after the answer's head"
    );
    assert_eq!(closed(&env.gateway, "stalled").await, 2);
    // Both answers were recorded all the same: their retries are replays.
    for (path, key, len) in [
        ("/big?bytes=33554432", "never-read", 33554432),
        ("/big?bytes=1000", "window-zero", 1000),
    ] {
        let again = send(env.post_keyed(path, key).body("x")).await;
        assert!(again.replayed(), "{key}: {}", again.status);
        assert_eq!(again.body.len(), len);
    }
    assert_eq!(env.upstream.calls(), 2);
}

/// A client that stops sending the body it announced, a second after a whole number of idle
/// timeouts since it connected: closed one idle timeout after its last byte, not at the next of
/// looks an idle timeout apart (which would be nearly two idle timeouts later).
#[tokio::test]
async fn a_client_that_stops_sending_its_body_is_closed_within_the_idle_timeout() {
    let upstream = CountingUpstream::start().await;
    let config = timeouts()
        .upstream(&upstream.url())
        .set("client_min_body_rate", "off");
    let gateway = InProcessGateway::start(&config).await;
    let stream = TcpStream::connect(gateway.addr).await.unwrap();
    let connected = Instant::now();
    let (read, mut write) = stream.into_split();
    let head = "POST /v1/p HTTP/1.1\r\nhost: gw\r\nidempotency-key: half-sent\r\ncontent-length: 100\r\n\r\n";
    write.write_all(head.as_bytes()).await.unwrap();
    let stop = connected + IDLE_TIMEOUT + Duration::from_secs(1);
    while Instant::now() < stop {
        write.write_all(b"x").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = time_until_closed(read, IDLE_TIMEOUT * 3).await;
    assert!(
        took >= IDLE_TIMEOUT - Duration::from_millis(200)
            && took < IDLE_TIMEOUT + Duration::from_millis(1500),
        "closed {took:?} after the last byte of the body"
    );
    assert_eq!(closed(&gateway, "stalled").await, 1);
    assert_eq!(upstream.calls(), 0);
    drop(write);
}

async fn an_unsolicited_101_keeps_the_key_claimed(b: Backend) {
    for answer in [
        &b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"[..],
        b"HTTP/1.1 600 Beyond\r\ncontent-length: 0\r\n\r\n",
    ] {
        let upstream = RawUpstream::answering(answer).await;
        let redis = StoreServer::for_backend(b).await;
        let config = GatewayConfig::new()
            .upstream(&upstream.url())
            .store(redis.as_ref())
            .set("defaults.lock_ttl", "1s");
        let gateway = InProcessGateway::start(&config).await;
        let h2c = reqwest::Client::builder()
            .no_proxy()
            .http2_prior_knowledge()
            .build()
            .unwrap();
        for (version, client) in [("HTTP/1.1", client()), ("HTTP/2", h2c)] {
            let key = format!("switch-{version}");
            let post = || {
                client
                    .post(gateway.url("/v1/p"))
                    .header("idempotency-key", &key)
                    .body("x")
            };
            let before = upstream.requests().len();
            let first = send(post()).await;
            assert_eq!(first.status, 502, "{version}: {first:?}");
            assert_eq!(
                first.problem_type(),
                "urn:idemgate:problem:upstream-invalid-response"
            );
            // The request was sent and may have run: the key stays claimed for its lease.
            let retry = send(post()).await;
            assert_eq!(retry.problem_type(), "urn:idemgate:problem:in-flight");
            assert_eq!(upstream.requests().len(), before + 1, "{version}");
            tokio::time::sleep(Duration::from_millis(1200)).await;
            let after_lease = send(post()).await;
            assert_eq!(after_lease.status, 502);
            assert_eq!(upstream.requests().len(), before + 2, "{version}");
        }
        // Unkeyed, the client gets the same problem, not a bare 101.
        let plain = send(client().post(gateway.url("/v1/p")).body("x")).await;
        assert_eq!(plain.status, 502);
    }
}

#[tokio::test]
async fn host_must_name_the_authority_and_userinfo_is_refused() {
    let upstream =
        RawUpstream::answering(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok").await;
    let gateway = InProcessGateway::start(&GatewayConfig::new().upstream(&upstream.url())).await;
    let tcp = TcpStream::connect(gateway.addr).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let status = |authority: &str, host: Option<&str>| {
        let mut h2 = h2.clone();
        let mut req = http::Request::post(format!("http://{authority}/v1/p"));
        if let Some(host) = host {
            req = req.header("host", host);
        }
        let req = req.body(()).unwrap();
        async move {
            let (resp, _) = h2.send_request(req, true).unwrap();
            resp.await.unwrap().status().as_u16()
        }
    };
    assert_eq!(status("api.example", Some("other.example")).await, 400);
    assert_eq!(status("user:secret@api.example", None).await, 400);
    assert_eq!(
        status("api.example", Some("user:secret@api.example")).await,
        400
    );
    assert!(upstream.requests().is_empty(), "nothing forwarded");
    assert_eq!(status("api.example", Some("API.example")).await, 201);
    assert_eq!(status("api.example", None).await, 201);
    let forwarded = upstream.requests();
    assert_eq!(forwarded.len(), 2);
    for req in &forwarded {
        assert_eq!(req.header("x-forwarded-host"), Some("api.example"));
    }
    // HTTP/1.1: an absolute-form target with userinfo, and one whose Host disagrees.
    for head in [
        "POST http://user:secret@api.example/v1/p HTTP/1.1\r\nhost: api.example\r\n",
        "POST http://api.example/v1/p HTTP/1.1\r\nhost: other.example\r\n",
    ] {
        let mut c = common::raw::RawClient::connect(gateway.addr).await;
        let resp = c
            .send(format!("{head}content-length: 0\r\n\r\n").as_bytes())
            .await
            .response()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{head}");
        assert!(String::from_utf8_lossy(&resp.body).contains("invalid-authority"));
    }
    assert_eq!(upstream.requests().len(), 2);
}

/// The client timeouts, with a least body rate of 100 B/s after a grace of 1 s.
fn min_rate() -> GatewayConfig {
    timeouts()
        .set("client_min_body_rate", "100B/s")
        .set("client_min_body_rate_grace", "1s")
}

/// Write `head`, then `body` in pieces of `piece` bytes, `every` apart; the write half is kept
/// (and the trickle stopped) until the task is aborted.
fn trickle(
    mut write: tokio::net::tcp::OwnedWriteHalf,
    head: String,
    body: Vec<u8>,
    (piece, every): (usize, Duration),
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    tokio::spawn(async move {
        write.write_all(head.as_bytes()).await?;
        for part in body.chunks(piece) {
            write.write_all(part).await?;
            tokio::time::sleep(every).await;
        }
        std::future::pending::<()>().await;
        Ok(())
    })
}

/// A keyed POST whose body trickles at 3 B/s, under 100 B/s: once the grace has passed, `408
/// body-too-slow`, the connection closed after it, nothing forwarded, and the key free for the
/// retry. A body at 200 B/s, slower than the idle timeout lets nothing move but above the rate,
/// goes through.
#[tokio::test]
async fn a_body_below_the_min_rate_is_cut_with_408_one_above_it_goes_through() {
    let upstream = CountingUpstream::start().await;
    let gateway = InProcessGateway::start(&min_rate().upstream(&upstream.url())).await;
    let post = |key: &str, len: usize| {
        format!("POST /v1/p HTTP/1.1\r\nhost: gw\r\nidempotency-key: {key}\r\ncontent-length: {len}\r\n\r\n")
    };
    let stream = TcpStream::connect(gateway.addr).await.unwrap();
    let (read, write) = stream.into_split();
    let started = Instant::now();
    let slow = trickle(
        write,
        post("trickled", 50),
        vec![b'x'; 50],
        (1, Duration::from_millis(300)),
    );
    let mut read = tokio::io::BufReader::new(read);
    let mut head = String::new();
    let mut line = String::new();
    while read.read_line(&mut line).await.unwrap() > 2 {
        head.push_str(&line);
        line.clear();
    }
    let took = started.elapsed();
    assert!(head.starts_with("HTTP/1.1 408 "), "{head}");
    assert!(
        head.contains("content-type: application/problem+json"),
        "{head}"
    );
    assert!(head.contains("connection: close"), "{head}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "answered after {took:?}"
    );
    let mut body = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), read.read_to_end(&mut body))
        .await
        .expect("the connection closed after the answer")
        .unwrap();
    let body = String::from_utf8_lossy(&body);
    assert!(
        body.contains("urn:idemgate:problem:body-too-slow"),
        "{body}"
    );
    slow.abort();
    assert_eq!(upstream.calls(), 0);
    // The key was never claimed: the retry runs.
    let retry = send(
        client()
            .post(gateway.url("/v1/p"))
            .header("idempotency-key", "trickled")
            .body(vec![b'x'; 50]),
    )
    .await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    // 40 bytes every 200 ms: twice the rate, for three times the grace.
    let (read, write) = TcpStream::connect(gateway.addr).await.unwrap().into_split();
    let steady = trickle(
        write,
        post("steady", 600),
        vec![b'y'; 600],
        (40, Duration::from_millis(200)),
    );
    let mut read = tokio::io::BufReader::new(read);
    let mut status = String::new();
    read.read_line(&mut status).await.unwrap();
    assert!(status.starts_with("HTTP/1.1 201 "), "{status}");
    steady.abort();
    assert_eq!(upstream.calls(), 2);
    assert_eq!(
        gateway
            .metric("idemgate_client_bodies_too_slow_total")
            .await,
        1.0
    );
}

/// A large upload at the client's full speed, to an upstream that reads nothing for 3 s and then
/// all of it: the rate counts only the time the gateway waits on the client, so neither is cut
/// (counting the upstream's 3 s would cut it at 32 MiB/s).
#[tokio::test]
async fn a_large_upload_and_an_upstream_that_reads_slowly_are_not_cut() {
    let upstream = CountingUpstream::start().await;
    let config = timeouts()
        .upstream(&upstream.url())
        .set("client_min_body_rate", "32MiB/s")
        .set("client_min_body_rate_grace", "1s");
    let gateway = InProcessGateway::start(&config).await;
    let body = vec![b'z'; 64 << 20];
    for path in ["/v1/upload", "/v1/upload?read_delay_ms=3000"] {
        let seen = send(client().post(gateway.url(path)).body(body.clone())).await;
        assert_eq!(seen.status, 201, "{path}: {seen:?}");
        let json: serde_json::Value = serde_json::from_slice(&seen.body).unwrap();
        assert_eq!(json["body_len"], 64 << 20, "{path}");
    }
    assert_eq!(
        gateway
            .metric("idemgate_client_bodies_too_slow_total")
            .await,
        0.0
    );
}
