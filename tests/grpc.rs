//! gRPC through the gateway, between a real gRPC client and server: grpcio (installed from PyPI
//! into a venv of the tests' own), whose server refuses a call without `te: trailers`, on an
//! upstream with `http2 = true`. Calls carry raw bytes through grpcio's generic handlers, so no
//! code is generated. docs/behaviour.md, "gRPC", is what these tests hold the gateway to.

use crate::common;

use std::process::Stdio;

use common::{Backend, CountingUpstream, GatewayConfig, TestEnv};
use serde_json::{json, Value};
use testkit::PythonEnv;
use tokio::io::AsyncBufReadExt;
use toml::toml;

/// The grpcio release the tests drive the gateway with.
const GRPCIO: &str = "grpcio==1.85.1";

/// A gRPC server on a free port, printed on its first line. `*/Echo` answers
/// `call-N:MESSAGE` with the trailing metadata `x-trail: call-N` (N counts the calls to Echo
/// and Collect); a message `status:C` ends the call with status code C instead (trailers-only),
/// `late:C` the same after its headers (the status in trailers), `sleep:S` sleeps S seconds
/// first. `*/Collect` (client streaming) joins its messages with commas, `*/Chat`
/// (bidirectional) answers each message with `pong:MESSAGE`, `*/Ticks` (server streaming) takes
/// `COUNT:GAP_MS[:CODE]` and answers `call-N:tick-I` COUNT times, GAP_MS apart, then ends with
/// status CODE if given (all three counted too); `*/Count` says how many calls there were.
const SERVER: &str = r#"
import sys, time, threading, grpc
from concurrent import futures
calls = 0
lock = threading.Lock()
def counted():
    global calls
    with lock:
        calls += 1
        return calls
def echo(req, ctx):
    n = counted()
    msg = req.decode()
    ctx.set_trailing_metadata((("x-trail", "call-%d" % n),))
    if msg.startswith("sleep:"):
        time.sleep(float(msg.split(":")[1]))
    if msg.startswith("late:"):
        ctx.send_initial_metadata((("x-early", "1"),))
    if msg.startswith(("status:", "late:")):
        code = int(msg.split(":")[1])
        ctx.abort(next(c for c in grpc.StatusCode if c.value[0] == code), "upstream says " + msg)
    return ("call-%d:%s" % (n, msg)).encode()
def collect(it, ctx):
    counted()
    return b",".join(it)
def chat(it, ctx):
    counted()
    for m in it:
        yield b"pong:" + m
def ticks(req, ctx):
    n = counted()
    parts = req.decode().split(":")
    ctx.set_trailing_metadata((("x-trail", "call-%d" % n),))
    for i in range(int(parts[0])):
        if i:
            time.sleep(float(parts[1]) / 1000)
        yield ("call-%d:tick-%d" % (n, i)).encode()
    if len(parts) > 2:
        code = int(parts[2])
        ctx.abort(next(c for c in grpc.StatusCode if c.value[0] == code), "upstream says " + parts[2])
def count(req, ctx):
    return str(calls).encode()
class Handler(grpc.GenericRpcHandler):
    def service(self, details):
        method = details.method.rsplit("/", 1)[-1]
        if method == "Echo":
            return grpc.unary_unary_rpc_method_handler(echo)
        if method == "Collect":
            return grpc.stream_unary_rpc_method_handler(collect)
        if method == "Chat":
            return grpc.stream_stream_rpc_method_handler(chat)
        if method == "Ticks":
            return grpc.unary_stream_rpc_method_handler(ticks)
        if method == "Count":
            return grpc.unary_unary_rpc_method_handler(count)
        return None
server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
server.add_generic_rpc_handlers((Handler(),))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
server.wait_for_termination()
"#;

/// Run a plan of calls: argv is the gateway's address, the server's, and the plan in JSON, a
/// list of steps run one after the other, each a list of calls run at once on one channel (one
/// HTTP/2 connection). A call: `path`, `msg` (comma-separated messages for a `stream` call,
/// or a `pingpong` one, which sends each message only once the answer to the one before came;
/// a `ticks` call reads a server stream, its messages joined with commas, and says when the first
/// and the last came), `key` (the `idempotency-key` metadata), `at_ms` (a delay before it
/// starts), `direct` (to the server, not through the gateway). Prints each call's code, details,
/// response and metadata, as JSON.
const CLIENT: &str = r#"
import sys, json, time, threading, queue, grpc
gateway, server, plan = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
options = [("grpc.enable_http_proxy", 0), ("grpc.enable_retries", 0)]
channels = {False: grpc.insecure_channel(gateway, options=options),
            True: grpc.insecure_channel(server, options=options)}
def md(m):
    return {k: v if isinstance(v, str) else v.decode() for k, v in (m or ())}
def ticks(channel, c, meta):
    started = time.time()
    rpc = channel.unary_stream(c["path"])(c["msg"].encode(), metadata=meta, timeout=10)
    got, first = [], None
    code, details = "OK", ""
    try:
        for r in rpc:
            first = first or time.time() - started
            got.append(r.decode())
    except grpc.RpcError as e:
        code, details = e.code().name, e.details() or ""
    return {"code": code, "details": details, "body": ",".join(got),
            "initial": md(rpc.initial_metadata()), "trailing": md(rpc.trailing_metadata()),
            "first_ms": int((first or 0) * 1000), "total_ms": int((time.time() - started) * 1000)}
def call(c):
    time.sleep(c.get("at_ms", 0) / 1000)
    channel = channels[c.get("direct", False)]
    meta = [("idempotency-key", c["key"])] if c.get("key") else []
    if c.get("ticks"):
        return ticks(channel, c, meta)
    try:
        if c.get("pingpong"):
            answered = queue.Queue()
            def messages():
                for m in c["msg"].split(","):
                    yield m.encode()
                    answered.get(timeout=10)
            got = []
            for r in channel.stream_stream(c["path"])(messages(), metadata=meta, timeout=10):
                got.append(r.decode())
                answered.put(1)
            return {"code": "OK", "details": "", "body": ",".join(got), "initial": {}, "trailing": {}}
        if c.get("stream"):
            msgs = iter([m.encode() for m in c["msg"].split(",")])
            body, rpc = channel.stream_unary(c["path"]).with_call(msgs, metadata=meta, timeout=10)
        else:
            body, rpc = channel.unary_unary(c["path"]).with_call(c["msg"].encode(), metadata=meta, timeout=10)
        return {"code": "OK", "details": "", "body": body.decode(),
                "initial": md(rpc.initial_metadata()), "trailing": md(rpc.trailing_metadata())}
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": e.details() or "", "body": None,
                "initial": md(e.initial_metadata()), "trailing": md(e.trailing_metadata())}
out = []
for step in plan:
    results = [None] * len(step)
    def run(i, c):
        results[i] = call(c)
    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(step)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.append(results)
print(json.dumps(out))
"#;

/// The venv with grpcio, made once for every test of this binary.
async fn python() -> PythonEnv {
    tokio::task::spawn_blocking(|| {
        PythonEnv::with_packages(env!("CARGO_TARGET_TMPDIR").as_ref(), "grpcio", &[GRPCIO])
    })
    .await
    .unwrap()
}

/// The gRPC server as a child process, killed when the test ends (or fails).
struct GrpcServer {
    _child: tokio::process::Child,
    port: u16,
}

impl GrpcServer {
    async fn start(python: &PythonEnv) -> Self {
        let mut cmd = tokio::process::Command::from(python.command(SERVER));
        cmd.stdout(Stdio::piped()).kill_on_drop(true);
        let mut child = cmd.spawn().expect("the gRPC server starts");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        tokio::io::BufReader::new(stdout)
            .read_line(&mut line)
            .await
            .unwrap();
        let port = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("a port: {line:?}"));
        GrpcServer {
            _child: child,
            port,
        }
    }
}

/// The gateway in front of `server` (`http2 = true`): `/test.Svc/*` with the default policy,
/// `/wait.Svc/*` waiting for an in-flight duplicate, `/required.Svc/*` requiring a key,
/// `/small.Svc/*` taking messages of 11 bytes at most (`max_body = 16`), `/stream.Svc/*`
/// streaming answers (`stream = true`, waiting for an in-flight duplicate), `/down.Svc/*` to an
/// upstream that is not there.
async fn gateway(backend: Backend, server: &GrpcServer) -> TestEnv {
    let config = GatewayConfig::new()
        .set("admin.listen", "127.0.0.1:0")
        .set(
            "upstreams.grpc.url",
            format!("http://127.0.0.1:{}", server.port),
        )
        .set("upstreams.grpc.http2", true)
        .set("defaults.upstream", "grpc")
        .route("/wait.Svc/{m}", toml! { on_in_flight = "wait" })
        .route("/required.Svc/{m}", toml! { require_key = true })
        .route("/small.Svc/{m}", toml! { max_body = 16 })
        .route(
            "/stream.Svc/{m}",
            toml! { stream = true
            on_in_flight = "wait" },
        )
        .set(
            "upstreams.down.url",
            format!("http://127.0.0.1:{}", common::free_port()),
        )
        .set("upstreams.down.http2", true)
        .route("/down.Svc/{m}", toml! { upstream = "down" });
    TestEnv::start_with(backend, CountingUpstream::start().await, config).await
}

/// Run `plan` ([`CLIENT`]) against the gateway of `env` and `server`; each step's results.
async fn run(python: &PythonEnv, env: &TestEnv, server: &GrpcServer, plan: Value) -> Vec<Value> {
    let gateway = env
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let server = format!("127.0.0.1:{}", server.port);
    let plan = plan.to_string();
    let out = python.run(CLIENT, &[&gateway, &server, &plan]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str::<Vec<Value>>(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// One call of a plan.
fn echo(msg: &str, key: Option<&str>) -> Value {
    json!({"path": "/test.Svc/Echo", "msg": msg, "key": key})
}

/// A call's code, its trailing `x-trail` and its response, to compare at once.
fn seen(call: &Value) -> (String, String, Value) {
    (
        call["code"].as_str().unwrap().to_string(),
        call["trailing"]["x-trail"]
            .as_str()
            .unwrap_or("")
            .to_string(),
        call["body"].clone(),
    )
}

fn expect(call: &Value, code: &str, trail: &str, body: Value) {
    assert_eq!(
        seen(call),
        (code.to_string(), trail.to_string(), body),
        "{call}"
    );
}

/// A refusal of the gateway's own: its code, and a message that names what happened.
fn refused(call: &Value, code: &str, kind: &str) {
    assert_eq!(call["code"], code, "{call}");
    let details = call["details"].as_str().unwrap();
    assert!(details.starts_with(&format!("{kind}: ")), "{call}");
    assert!(
        details.len() > kind.len() + 20,
        "a message to act on: {call}"
    );
}

/// Everything a unary call can come to, and a streaming call passed on.
async fn grpc_calls(backend: Backend) {
    let python = python().await;
    let server = GrpcServer::start(&python).await;
    let env = gateway(backend, &server).await;
    let slow = json!({"path": "/test.Svc/Echo", "msg": "sleep:1.5", "key": "k4"});
    let mut slow_again = slow.clone();
    slow_again["at_ms"] = json!(400);
    let waits = json!({"path": "/wait.Svc/Echo", "msg": "sleep:1", "key": "k5"});
    let mut waits_again = waits.clone();
    waits_again["at_ms"] = json!(300);
    let stream = json!({"path": "/test.Svc/Collect", "msg": "a,b,c", "key": "k6", "stream": true});
    let plan = json!([
        [echo("hi", None)],
        [echo("pay", Some("k1"))],
        [echo("pay", Some("k1"))],
        [echo("other", Some("k1"))],
        [echo("status:14", Some("k2"))],
        [echo("status:14", Some("k2"))],
        [echo("status:5", Some("k3"))],
        [echo("status:5", Some("k3"))],
        [slow, slow_again],
        [{"path": "/required.Svc/Echo", "msg": "x"}],
        [waits, waits_again],
        [stream],
        [stream],
        [echo("late:14", Some("k7"))],
        [echo("late:14", Some("k7"))],
        [echo("late:9", Some("k8"))],
        [echo("late:9", Some("k8"))],
        [echo("x", Some(&"k".repeat(300)))],
        [{"path": "/small.Svc/Echo", "msg": "x".repeat(40), "key": "k9"}],
        [{"path": "/test.Svc/Chat", "msg": "a,b", "key": "k10", "pingpong": true}],
        [{"path": "/test.Svc/Count", "msg": "", "direct": true}],
        [{"path": "/down.Svc/Echo", "msg": "x"}],
        [{"path": "/down.Svc/Echo", "msg": "x", "key": "k11"}],
    ]);
    let steps = run(&python, &env, &server, plan).await;
    let one = |i: usize| &steps[i][0];

    // Without a key, as if the gateway were not there: te: trailers reached the server (grpcio
    // refuses a call without it), and the status and trailing metadata came back.
    expect(one(0), "OK", "call-1", json!("call-1:hi"));
    // Keyed: run once, replayed with its trailers (grpc-status, custom trailing metadata).
    expect(one(1), "OK", "call-2", json!("call-2:pay"));
    expect(one(2), "OK", "call-2", json!("call-2:pay"));
    assert_eq!(
        one(2)["initial"]["idempotent-replayed"],
        "true",
        "{}",
        one(2)
    );
    assert!(one(1)["initial"].get("idempotent-replayed").is_none());
    // The key with another message.
    refused(one(3), "FAILED_PRECONDITION", "mismatch");
    // UNAVAILABLE releases the key: the retry runs again.
    expect(one(4), "UNAVAILABLE", "call-3", Value::Null);
    expect(one(5), "UNAVAILABLE", "call-4", Value::Null);
    // NOT_FOUND is recorded, and replayed with its message.
    expect(one(6), "NOT_FOUND", "call-5", Value::Null);
    expect(one(7), "NOT_FOUND", "call-5", Value::Null);
    assert_eq!(one(7)["details"], "upstream says status:5");
    // A duplicate while the first runs.
    expect(&steps[8][0], "OK", "call-6", json!("call-6:sleep:1.5"));
    refused(&steps[8][1], "ABORTED", "in-flight");
    refused(one(9), "INVALID_ARGUMENT", "missing-key");
    // Concurrent duplicates on one HTTP/2 connection: one call, the same answer twice.
    expect(&steps[10][0], "OK", "call-7", json!("call-7:sleep:1"));
    expect(&steps[10][1], "OK", "call-7", json!("call-7:sleep:1"));
    // A client-streaming call passes on without idempotency: it runs each time.
    expect(one(11), "OK", "", json!("a,b,c"));
    expect(one(12), "OK", "", json!("a,b,c"));
    // The same, the status coming in trailers after the headers: released, or recorded and
    // replayed with its headers and trailers.
    expect(one(13), "UNAVAILABLE", "call-10", Value::Null);
    expect(one(14), "UNAVAILABLE", "call-11", Value::Null);
    expect(one(15), "FAILED_PRECONDITION", "call-12", Value::Null);
    expect(one(16), "FAILED_PRECONDITION", "call-12", Value::Null);
    assert_eq!(one(16)["details"], "upstream says late:9");
    assert_eq!(one(16)["initial"]["x-early"], "1", "{}", one(16));
    assert_eq!(one(16)["initial"]["idempotent-replayed"], "true");
    refused(one(17), "INVALID_ARGUMENT", "invalid-key");
    refused(one(18), "RESOURCE_EXHAUSTED", "body-too-large");
    // A bidirectional call that waits for each answer before its next message: passed on once
    // the stream stays open after its first message, never held for its end.
    expect(one(19), "OK", "", json!("pong:a,pong:b"));
    // The three keyed streaming calls are counted: their keys were not applied.
    let series = r#"idemgate_grpc_streaming_keyed_total{route="defaults"}"#;
    assert_eq!(env.gateway.metric(series).await, 3.0);
    assert_eq!(one(20)["body"], "13", "calls the server saw");
    // The upstream's failure, unkeyed (the listener's answer) or keyed (the engine's).
    refused(one(21), "UNAVAILABLE", "upstream-unavailable");
    refused(one(22), "UNAVAILABLE", "upstream-unavailable");
}

// The memory store keeps responses as they are; Redis holds them encoded, trailers included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_on_memory() {
    grpc_calls(Backend::Memory).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_on_redis() {
    grpc_calls(Backend::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_on_postgres() {
    grpc_calls(Backend::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_on_embedded() {
    grpc_calls(Backend::Embedded).await
}

/// A keyed server-streaming call (`*/Ticks`, `COUNT:GAP_MS[:CODE]`).
fn ticks(path: &str, msg: &str, key: &str) -> Value {
    json!({"path": path, "msg": msg, "key": key, "ticks": true})
}

/// A server-streaming call on a `stream = true` route: its messages reach the client as they
/// come, a duplicate attaches to them, and its status decides at its end whether it is
/// recorded (and replayed with its trailers) or its key released; on another route, it is read
/// whole first.
async fn server_streams(backend: Backend) {
    let python = python().await;
    let server = GrpcServer::start(&python).await;
    let env = gateway(backend, &server).await;
    let live = "/stream.Svc/Ticks";
    let mut attaching = ticks(live, "4:400", "s1");
    attaching["at_ms"] = json!(150);
    let plan = json!([
        [ticks(live, "4:400", "s1"), attaching],
        [ticks(live, "4:400", "s1")],
        [ticks(live, "2:100:14", "s2")],
        [ticks(live, "2:100:14", "s2")],
        [ticks(live, "2:100:5", "s3")],
        [ticks(live, "2:100:5", "s3")],
        [ticks("/test.Svc/Ticks", "4:400", "s4")],
        [{"path": "/test.Svc/Count", "msg": "", "direct": true}],
    ]);
    let steps = run(&python, &env, &server, plan).await;
    let one = |i: usize| &steps[i][0];
    let all = json!("call-1:tick-0,call-1:tick-1,call-1:tick-2,call-1:tick-3");
    // The first message came long before the last (1.2 s later); the duplicate attached.
    let (first, attached) = (&steps[0][0], &steps[0][1]);
    expect(first, "OK", "call-1", all.clone());
    assert!(first["first_ms"].as_u64().unwrap() < 700, "{first}");
    assert!(first["total_ms"].as_u64().unwrap() >= 1200, "{first}");
    expect(attached, "OK", "call-1", all.clone());
    assert_eq!(
        attached["initial"]["idempotent-replayed"], "true",
        "{attached}"
    );
    // Recorded with its trailers, and replayed.
    expect(one(1), "OK", "call-1", all);
    assert_eq!(one(1)["initial"]["idempotent-replayed"], "true");
    // UNAVAILABLE at the end: the messages went on, and the key is released.
    expect(
        one(2),
        "UNAVAILABLE",
        "call-2",
        json!("call-2:tick-0,call-2:tick-1"),
    );
    expect(
        one(3),
        "UNAVAILABLE",
        "call-3",
        json!("call-3:tick-0,call-3:tick-1"),
    );
    // NOT_FOUND at the end: recorded with its messages, and replayed.
    expect(
        one(4),
        "NOT_FOUND",
        "call-4",
        json!("call-4:tick-0,call-4:tick-1"),
    );
    expect(
        one(5),
        "NOT_FOUND",
        "call-4",
        json!("call-4:tick-0,call-4:tick-1"),
    );
    assert_eq!(one(5)["details"], "upstream says 5");
    // Elsewhere the messages come when the call has ended.
    assert!(one(6)["first_ms"].as_u64().unwrap() >= 1200, "{}", one(6));
    assert_eq!(one(7)["body"], "5", "calls the server saw");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_streams_on_redis() {
    server_streams(Backend::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_streams_on_embedded() {
    server_streams(Backend::Embedded).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_is_unavailable_and_a_call_without_key_still_passes() {
    let python = python().await;
    let server = GrpcServer::start(&python).await;
    let env = gateway(Backend::Redis, &server).await;
    env.redis().kill();
    let plan = json!([[echo("pay", Some("k"))], [echo("free", None)]]);
    let steps = run(&python, &env, &server, plan).await;
    refused(&steps[0][0], "UNAVAILABLE", "store-unavailable");
    expect(&steps[1][0], "OK", "call-1", json!("call-1:free"));
}
