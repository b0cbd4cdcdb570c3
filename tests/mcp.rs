//! MCP and JSON-RPC routes (`protocol = "mcp"`, `"jsonrpc"`): the official MCP Python SDK
//! (`mcp` from PyPI, in a venv of the tests' own) calls tools through the gateway, in front of
//! an MCP server of the same SDK whose tools count their executions; raw JSON-RPC for what an
//! SDK does not send (batches, disagreeing headers, numeric ids), and a small plain JSON-RPC
//! upstream.

use crate::common;

use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{
    client, free_port, send, wait_until, Backend, GatewayConfig, InProcessGateway, StoreServer,
};
use serde_json::{json, Value};
use testkit::PythonEnv;
use toml::toml;

/// The MCP SDK release the tests drive the gateway with (client and server).
const MCP: &str = "mcp==2.3.0";

const SERVER: &str = include_str!("mcp/server.py");
const CLIENT: &str = include_str!("mcp/client.py");

/// The venv with the MCP SDK, made once for every test of this binary.
async fn python() -> PythonEnv {
    tokio::task::spawn_blocking(|| {
        PythonEnv::with_packages(env!("CARGO_TARGET_TMPDIR").as_ref(), "mcp", &[MCP])
    })
    .await
    .unwrap()
}

/// The MCP server as a child process, killed when the test ends (or fails).
struct McpServer {
    _child: tokio::process::Child,
    port: u16,
}

impl McpServer {
    /// Its tools answer as event streams, or as JSON when `json`.
    async fn start(python: &PythonEnv, json: bool) -> Self {
        let port = free_port();
        let mut cmd = tokio::process::Command::from(python.command(SERVER));
        cmd.arg(port.to_string())
            .arg(if json { "json" } else { "sse" });
        cmd.stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let child = cmd.spawn().expect("the MCP server starts");
        wait_until(
            Duration::from_secs(30),
            "the MCP server listens",
            async || {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
            },
        )
        .await;
        McpServer {
            _child: child,
            port,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// A gateway on `backend` in front of an MCP server, `/mcp` an MCP route.
struct World {
    python: PythonEnv,
    server: McpServer,
    gateway: InProcessGateway,
    _store: Option<StoreServer>,
    _dir: Option<tempfile::TempDir>,
}

impl World {
    async fn start(backend: Backend, json: bool) -> Self {
        let route = toml! { protocol = "mcp" stream = true on_in_flight = "wait" };
        Self::start_with(backend, json, route).await
    }

    async fn start_with(backend: Backend, json: bool, route: toml::Table) -> Self {
        let python = python().await;
        let server = McpServer::start(&python, json).await;
        let store = StoreServer::for_backend(backend).await;
        let dir = (backend == Backend::Embedded).then(|| tempfile::tempdir().unwrap());
        let config = GatewayConfig::new()
            .upstream(&server.url())
            .admin()
            .route("/mcp", route);
        let config = match &dir {
            Some(dir) => config.embedded(dir.path()),
            None => config.store(store.as_ref()),
        };
        let gateway = InProcessGateway::start(&config).await;
        World {
            python,
            server,
            gateway,
            _store: store,
            _dir: dir,
        }
    }

    /// Run `plan` with the SDK's client (see tests/mcp/client.py): each step's result, and
    /// how many times each tool ran.
    async fn run(&self, plan: Value) -> (Vec<Value>, Value) {
        let script = self.python.command(CLIENT);
        let mut cmd = tokio::process::Command::from(script);
        cmd.arg(self.gateway.url("/mcp"))
            .arg(format!("{}/mcp", self.server.url()))
            .arg(plan.to_string());
        let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
            .await
            .expect("the client finishes")
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout.lines().last().unwrap_or_default();
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            panic!(
                "the client's output: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        (
            v["results"].as_array().unwrap().clone(),
            v["counts"].clone(),
        )
    }
}

fn count(counts: &Value, tool: &str) -> u64 {
    counts[tool].as_u64().unwrap_or(0)
}

/// A retry with the same key (on a new session, as a retry may be) runs the tool once and gets
/// its result, marked as replayed; the key on other arguments or another tool is the mismatch
/// error, as the SDK's `MCPError` with the gateway's code; unkeyed calls run every time.
async fn a_retried_tool_call_runs_once(backend: Backend) {
    for json in [false, true] {
        let world = World::start(backend, json).await;
        let mail = |to: &str, key: Option<&str>| json!({"tool": "send_mail", "args": {"to": to}, "key": key});
        let (results, counts) = world
            .run(json!([
                mail("a@example.com", Some("k1")),
                mail("a@example.com", Some("k1")),
                mail("b@example.com", Some("k1")),
                {"tool": "slow", "args": {"ms": 1}, "key": "k1"},
                mail("c@example.com", None),
                mail("c@example.com", None),
            ]))
            .await;
        assert_eq!(results[0]["replayed"], false, "{results:?}");
        assert_eq!(results[1]["replayed"], true, "{results:?}");
        assert_eq!(results[1]["text"], results[0]["text"]);
        for mismatch in &results[2..4] {
            assert_eq!(mismatch["code"], -31002, "{results:?}");
            assert_eq!(mismatch["data"]["type"], "urn:idemgate:problem:mismatch");
            let instance = mismatch["data"]["instance"].as_str().unwrap_or_default();
            assert!(instance.starts_with("urn:uuid:"), "{results:?}");
        }
        assert_ne!(
            results[2]["data"]["instance"],
            results[3]["data"]["instance"]
        );
        assert_eq!(results[5]["replayed"], false);
        assert_eq!(
            count(&counts, "send_mail"),
            3,
            "once for k1, twice unkeyed: {counts}"
        );
        assert_eq!(count(&counts, "slow"), 0);
    }
}

/// A tool that sends progress before its result: the first caller gets the stream, a
/// client that gave up midway leaves the call running, and its retry gets the result; duplicates
/// sent at once wait for the one call.
async fn streamed_calls_survive_a_disconnect_and_serve_duplicates(backend: Backend) {
    let world = World::start(backend, false).await;
    let slow = |ms: u64, key: &str| json!({"tool": "slow", "args": {"ms": ms}, "key": key, "mode": "legacy"});
    let mut gone = slow(1500, "s1");
    gone["cancel_after"] = json!(0.3);
    let (results, counts) = world
        .run(json!([
            gone,
            slow(1500, "s1"),
            [slow(800, "s2"), slow(800, "s2"), slow(800, "s2")],
        ]))
        .await;
    assert_eq!(results[0]["cancelled"], true, "{results:?}");
    assert!(
        results[1]["text"]
            .as_str()
            .unwrap()
            .starts_with("slow done"),
        "{results:?}"
    );
    let together = results[2].as_array().unwrap();
    assert!(
        together.iter().all(|r| r["text"] == together[0]["text"]),
        "{together:?}"
    );
    let replays = together.iter().filter(|r| r["replayed"] == true).count();
    assert_eq!(replays, 2, "{together:?}");
    assert_eq!(count(&counts, "slow"), 2, "once per key: {counts}");
}

/// -32602 is the answer the same call gets again: recorded. -32603 is the server's failure:
/// the key is released and the retry runs.
async fn invalid_params_are_recorded_and_internal_errors_released(backend: Backend) {
    let world = World::start(backend, true).await;
    let fail =
        |code: i64| json!({"tool": "fail", "args": {"code": code}, "key": format!("f{code}")});
    let (results, counts) = world
        .run(json!([
            fail(-32602),
            fail(-32602),
            fail(-32603),
            fail(-32603)
        ]))
        .await;
    for (result, code) in results.iter().zip([-32602, -32602, -32603, -32603]) {
        assert_eq!(result["code"], code, "{results:?}");
    }
    assert_eq!(
        count(&counts, "fail"),
        3,
        "-32602 once, -32603 twice: {counts}"
    );
}

/// A call made under 2025-11-25 replayed to a 2026-07-28 client, and the other way round: each
/// gets a result its version reads.
async fn a_retry_under_another_protocol_version_reads_its_replay(backend: Backend) {
    let world = World::start(backend, true).await;
    let mail = |key: &str, mode: &str| json!({"tool": "send_mail", "args": {"to": "v"}, "key": key, "mode": mode});
    let (results, counts) = world
        .run(json!([
            mail("v1", "legacy"),
            mail("v1", "auto"),
            mail("v2", "auto"),
            mail("v2", "legacy"),
        ]))
        .await;
    for pair in results.chunks(2) {
        assert_eq!(pair[1]["replayed"], true, "{results:?}");
        assert_eq!(pair[1]["text"], pair[0]["text"], "{results:?}");
    }
    assert_eq!(count(&counts, "send_mail"), 2, "{counts}");
}

/// On a route that does not wait, a duplicate of a call still running gets the in-flight
/// refusal as the SDK's `MCPError` with its code (HTTP 409, `application/json`): the SDK reads
/// the gateway's own answers as protocol errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_is_an_sdk_error() {
    let world = World::start_with(Backend::Memory, true, toml! { protocol = "mcp" }).await;
    let slow = json!({"tool": "slow", "args": {"ms": 2000}, "key": "busy"});
    let (results, counts) = world.run(json!([[slow, slow]])).await;
    let both = results[0].as_array().unwrap();
    let refused: Vec<&Value> = both.iter().filter(|r| r["code"] == -31001).collect();
    assert_eq!(refused.len(), 1, "{both:?}");
    assert_eq!(refused[0]["data"]["status"], 409);
    assert!(both.iter().any(|r| r["text"].is_string()), "{both:?}");
    assert_eq!(count(&counts, "slow"), 1, "{counts}");
}

on_both_backends!(
    a_retried_tool_call_runs_once,
    streamed_calls_survive_a_disconnect_and_serve_duplicates,
    invalid_params_are_recorded_and_internal_errors_released,
    a_retry_under_another_protocol_version_reads_its_replay,
);

/// A 2026-07-28 tools/call as sent on the wire, with `id`, its key in `_meta`.
fn modern_call(id: Value, tool: &str, args: Value, key: &str) -> Value {
    json!({
        "jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": tool, "arguments": args, "_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {},
            "idempotencyKey": key,
        }},
    })
}

/// A 2026-07-28 POST of `body`, with the routing headers that revision sends (`Mcp-Method`,
/// and `Mcp-Name` for a call) as the body says.
fn post_mcp(url: &str, body: &Value) -> reqwest::RequestBuilder {
    let method = body["method"].as_str().unwrap_or_default();
    post_routed(url, body, method, body["params"]["name"].as_str())
}

/// A 2026-07-28 POST of `body` with the routing headers `method` and `name`.
fn post_routed(
    url: &str,
    body: &Value,
    method: &str,
    name: Option<&str>,
) -> reqwest::RequestBuilder {
    let mut req = client()
        .post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2026-07-28");
    if !method.is_empty() {
        req = req.header("mcp-method", method);
    }
    if let Some(name) = name {
        req = req.header("mcp-name", name);
    }
    req.body(body.to_string())
}

/// The JSON of an answer, checked to be `application/json`.
fn json_of(seen: &common::Seen) -> Value {
    assert_eq!(
        seen.header("content-type"),
        Some("application/json"),
        "{seen:?}"
    );
    serde_json::from_slice(&seen.body).unwrap()
}

/// On the wire: a replay carries the retry's own id as sent (string or number); a batch holding
/// a keyed call is refused whole, one without passes; routing headers that disagree with the
/// body are refused with -32020; a notification passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wire_ids_batches_and_headers() {
    let world = World::start(Backend::Memory, true).await;
    let url = world.gateway.url("/mcp");
    let call = |id: Value| modern_call(id, "send_mail", json!({"to": "w"}), "wire-1");

    let first = send(post_mcp(&url, &call(json!("abc")))).await;
    assert_eq!(json_of(&first)["id"], "abc");
    let numeric = send(post_mcp(&url, &call(json!(7)))).await;
    assert!(numeric.replayed(), "{numeric:?}");
    let replay = json_of(&numeric);
    assert_eq!(replay["id"], json!(7), "a number stays a number: {replay}");
    assert_eq!(replay["result"]["_meta"]["io.idemgate/replayed"], true);
    assert_eq!(
        replay["result"]["content"],
        json_of(&first)["result"]["content"]
    );

    let batch = json!([call(json!(1)), {"jsonrpc": "2.0", "method": "notifications/initialized"}]);
    let refused = send(post_mcp(&url, &batch)).await;
    assert_eq!(refused.status, 400);
    assert_eq!(json_of(&refused)["error"]["code"], -32600);

    let routed = |id: i64, method: &str, name: &str| {
        send(post_routed(&url, &call(json!(id)), method, Some(name)))
    };
    let mismatch = routed(2, "tools/list", "send_mail").await;
    assert_eq!(mismatch.status, 400);
    let error = json_of(&mismatch);
    assert_eq!(
        (error["id"].clone(), error["error"]["code"].clone()),
        (json!(2), json!(-32020))
    );
    let name = routed(3, "tools/call", "other").await;
    assert_eq!(json_of(&name)["error"]["code"], -32020);

    let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let passed = send(post_mcp(&url, &note)).await;
    assert!(!passed.replayed());
    assert_ne!(passed.status, 400, "{passed:?}");

    let (_, counts) = world.run(json!([])).await;
    assert_eq!(count(&counts, "send_mail"), 1, "{counts}");
    let metrics = world.gateway.metrics().await;
    let replayed = r#"idemgate_jsonrpc_calls_total{route="/mcp",method="tools/call",tool="send_mail",outcome="replayed"} 1"#;
    assert!(metrics.contains(replayed), "{metrics}");
}

/// The streamed case over HTTP/2: the first caller gets the event stream with its progress, the
/// retry the terminal response alone as JSON, with its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_call_over_http2() {
    let world = World::start(Backend::Memory, false).await;
    let url = world.gateway.url("/mcp");
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let mut call = modern_call(json!(1), "slow", json!({"ms": 200}), "h2-1");
    call["params"]["_meta"]["progressToken"] = json!("p1");
    let post = |body: &Value| {
        h2.post(&url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2026-07-28")
            .header("mcp-method", "tools/call")
            .header("mcp-name", "slow")
            .body(body.to_string())
    };
    let first = send(post(&call)).await;
    let text = String::from_utf8_lossy(&first.body).to_string();
    assert!(
        first
            .header("content-type")
            .unwrap()
            .starts_with("text/event-stream"),
        "{first:?}"
    );
    assert!(text.contains("notifications/progress"), "{text}");
    assert!(text.contains("slow done"), "{text}");
    call["id"] = json!("second");
    let retry = send(post(&call)).await;
    assert!(retry.replayed(), "{retry:?}");
    let replay = json_of(&retry);
    assert_eq!(replay["id"], "second");
    assert!(replay["result"]["content"][0]["text"]
        .as_str()
        .unwrap()
        .starts_with("slow done"));
    assert!(!String::from_utf8_lossy(&retry.body).contains("progress"));
    let (_, counts) = world.run(json!([])).await;
    assert_eq!(count(&counts, "slow"), 1, "{counts}");
}

/// A small plain JSON-RPC 2.0 upstream: counts its calls; `input` asks for input first
/// (`resultType: "input_required"`) unless the params carry `inputResponses`.
async fn jsonrpc_upstream() -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let app = axum::Router::new().route(
        "/rpc",
        axum::routing::post(move |body: axum::body::Bytes| {
            let calls = counted.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                if req["params"]["name"] == "slow" {
                    tokio::time::sleep(Duration::from_millis(600)).await;
                }
                let result = match req["method"].as_str() {
                    Some("input") if req["params"]["inputResponses"].is_null() => {
                        json!({"resultType": "input_required", "requestState": "s"})
                    }
                    _ => json!({"n": n}),
                };
                axum::Json(json!({"jsonrpc": "2.0", "id": req["id"], "result": result}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, calls)
}

/// `protocol = "jsonrpc"`: every method is keyed (by a header here); a notification passes;
/// `input_required` is never recorded, and the continuation (other `inputResponses`) is the
/// same call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_jsonrpc() {
    let (upstream, calls) = jsonrpc_upstream().await;
    let config = GatewayConfig::new()
        .upstream(&upstream)
        .route("/rpc", toml! { protocol = "jsonrpc" });
    let gateway = InProcessGateway::start(&config).await;
    let url = gateway.url("/rpc");
    let rpc = |id: Value, method: &str, params: Value, key: &str| {
        let body = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        client()
            .post(&url)
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(body.to_string())
    };
    let first = json_of(&send(rpc(json!(1), "pay", json!({"a": 1}), "p")).await);
    let again = send(rpc(json!("x"), "pay", json!({"a": 1}), "p")).await;
    assert!(again.replayed());
    let again = json_of(&again);
    assert_eq!(again["id"], "x");
    assert_eq!(
        again["result"], first["result"],
        "no MCP marker on plain JSON-RPC"
    );
    let other = json_of(&send(rpc(json!(2), "pay", json!({"a": 2}), "p")).await);
    assert_eq!(other["error"]["code"], -31002);
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let asks = json_of(&send(rpc(json!(3), "input", json!({}), "i")).await);
    assert_eq!(asks["result"]["resultType"], "input_required");
    let answered = rpc(
        json!(4),
        "input",
        json!({"inputResponses": {"a": 1}, "requestState": "s"}),
        "i",
    );
    let done = json_of(&send(answered).await);
    assert!(
        done["result"]["n"].is_number(),
        "the continuation ran: {done}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3);

    let note = json!({"jsonrpc": "2.0", "method": "pay", "params": {}});
    let body = note.to_string();
    for _ in 0..2 {
        let req = client()
            .post(&url)
            .header("content-type", "application/json")
            .header("idempotency-key", "n")
            .body(body.clone());
        assert!(!send(req).await.replayed());
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        5,
        "notifications pass every time"
    );
}

/// A `notifications/cancelled` naming a keyed call this gateway has claimed (in the same
/// session) is not passed on: the call runs to its end for its retry. One naming any other
/// request goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_of_a_claimed_call_is_not_passed_on() {
    let (upstream, calls) = jsonrpc_upstream().await;
    let config = GatewayConfig::new()
        .upstream(&upstream)
        .route("/rpc", toml! { protocol = "mcp" });
    let gateway = InProcessGateway::start(&config).await;
    let url = gateway.url("/rpc");
    let post = |body: Value| {
        client()
            .post(&url)
            .header("content-type", "application/json")
            .header("mcp-session-id", "session-1")
            .body(body.to_string())
    };
    let call = json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
        "params": {"name": "slow", "arguments": {}, "_meta": {"idempotencyKey": "c1"}}});
    let running = tokio::spawn(send(post(call)));
    wait_until(Duration::from_secs(5), "the call is upstream", async || {
        calls.load(Ordering::SeqCst) == 1
    })
    .await;
    let cancel = |id: i64| json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": id}});
    let held = send(post(cancel(5))).await;
    assert_eq!(held.status, 202, "{held:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "not passed on");
    let done = running.await.unwrap();
    assert!(json_of(&done)["result"]["n"].is_number(), "{done:?}");
    send(post(cancel(6))).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "another request's cancellation goes on"
    );
}
