//! Reading POST bodies on JSON-RPC routes: what is keyed, what passes, what is refused, and
//! what the fingerprint leaves out.

use super::*;
use crate::record::StoredResponse;

fn mcp() -> Policy {
    Policy::builder().protocol(Protocol::Mcp).build().unwrap()
}

fn parts(headers: &[(&str, &str)]) -> Parts {
    let mut req = http::Request::post("/mcp");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.body(()).unwrap().into_parts().0
}

fn read_body(policy: &Policy, headers: &[(&str, &str)], body: Value) -> Reading {
    let body = Bytes::from(body.to_string());
    read(policy, &parts(headers), &body, None)
}

use serde_json::{json, Value};

fn call(id: Value, tool: &str, args: Value, meta: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": tool, "arguments": args, "_meta": meta}})
}

fn keyed(reading: Reading) -> Keyed {
    match reading {
        Reading::Keyed(keyed) => keyed,
        Reading::Pass => panic!("passed"),
        Reading::Swallowed => panic!("swallowed"),
        Reading::Refused(e, _) => panic!("refused: {e}"),
    }
}

#[test]
fn mcp_defaults_key_tool_calls_from_meta_or_arguments() {
    let policy = mcp();
    let by_meta = keyed(read_body(
        &policy,
        &[],
        call(json!(1), "t", json!({}), json!({"idempotencyKey": "k"})),
    ));
    assert_eq!(by_meta.key.as_str(), "k");
    assert_eq!(by_meta.call.id, json!(1));
    assert_eq!(by_meta.call.name.as_deref(), Some("t"));
    let by_arg = call(json!("a"), "t", json!({"idempotency_key": "k2"}), json!({}));
    assert_eq!(keyed(read_body(&policy, &[], by_arg)).key.as_str(), "k2");
    let by_header = read_body(&policy, &[], call(json!(1), "t", json!({}), json!({})));
    assert!(matches!(by_header, Reading::Pass), "no key: passed on");
}

#[test]
fn only_calls_of_keyed_methods_are_keyed() {
    let policy = mcp();
    let meta = json!({"idempotencyKey": "k"});
    let list =
        json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": meta}});
    assert!(matches!(read_body(&policy, &[], list), Reading::Pass));
    let note =
        json!({"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "t", "_meta": meta}});
    assert!(
        matches!(read_body(&policy, &[], note), Reading::Pass),
        "a notification"
    );
    let response = json!({"jsonrpc": "2.0", "id": 1, "result": {}});
    assert!(matches!(read_body(&policy, &[], response), Reading::Pass));
    let garbage = Bytes::from_static(b"{not json");
    assert!(matches!(
        read(&policy, &parts(&[]), &garbage, None),
        Reading::Pass
    ));
    // On a plain JSON-RPC route, every method is keyed (here by its header's key).
    let plain = Policy::builder()
        .protocol(Protocol::Jsonrpc)
        .build()
        .unwrap();
    let key = IdempotencyKey::parse(b"h", 16).unwrap();
    let any = Bytes::from(json!({"jsonrpc": "2.0", "id": 1, "method": "pay"}).to_string());
    assert!(matches!(
        read(&plain, &parts(&[]), &any, Some(key)),
        Reading::Keyed(_)
    ));
}

#[test]
fn a_batch_with_a_keyed_call_is_refused_and_one_without_passes() {
    let policy = mcp();
    let tool = call(json!(1), "t", json!({}), json!({}));
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    match read_body(&policy, &[], json!([list, tool])) {
        Reading::Refused(e, None) => assert_eq!(e.jsonrpc_code(), -32600),
        _ => panic!("a keyed call in a batch"),
    }
    assert!(matches!(
        read_body(&policy, &[], json!([list, list])),
        Reading::Pass
    ));
}

#[test]
fn routing_headers_must_agree_with_the_body() {
    let policy = mcp();
    let body = || call(json!(9), "t", json!({}), json!({"idempotencyKey": "k"}));
    for headers in [
        [("mcp-method", "tools/list"), ("mcp-name", "t")],
        [("mcp-method", "tools/call"), ("mcp-name", "u")],
    ] {
        match read_body(&policy, &headers, body()) {
            Reading::Refused(e, Some(id)) => {
                assert_eq!((e.jsonrpc_code(), id), (-32020, json!(9)));
                assert_eq!(e.status(), http::StatusCode::BAD_REQUEST);
            }
            _ => panic!("{headers:?}"),
        }
    }
    let agree = [("mcp-method", "tools/call"), ("mcp-name", "t")];
    assert!(matches!(
        read_body(&policy, &agree, body()),
        Reading::Keyed(_)
    ));
}

#[test]
fn a_required_key_is_refused_only_on_keyed_calls() {
    let policy = Policy::builder()
        .protocol(Protocol::Mcp)
        .require_key(true)
        .build()
        .unwrap();
    match read_body(&policy, &[], call(json!(1), "t", json!({}), json!({}))) {
        Reading::Refused(e, Some(_)) => assert_eq!(e.jsonrpc_code(), -31004),
        _ => panic!("no key on a keyed call"),
    }
    let list = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"});
    assert!(matches!(read_body(&policy, &[], list), Reading::Pass));
}

#[test]
fn the_fingerprint_leaves_out_what_a_retry_changes() {
    let policy = mcp();
    let fp = |body: Value| keyed(read_body(&policy, &[], body)).fingerprint;
    let base = fp(call(
        json!(1),
        "t",
        json!({"a": 1}),
        json!({"idempotencyKey": "k"}),
    ));
    let mut retry = call(
        json!("x"),
        "t",
        json!({"a": 1.0}),
        json!({"idempotencyKey": "k", "progressToken": 3}),
    );
    retry["params"]["inputResponses"] = json!({"q": {"name": "ada"}});
    retry["params"]["requestState"] = json!("opaque");
    assert_eq!(
        base,
        fp(retry),
        "id, _meta, inputResponses and requestState left out"
    );
    assert_ne!(
        base,
        fp(call(
            json!(1),
            "t",
            json!({"a": 2}),
            json!({"idempotencyKey": "k"})
        ))
    );
    assert_ne!(
        base,
        fp(call(
            json!(1),
            "u",
            json!({"a": 1}),
            json!({"idempotencyKey": "k"})
        ))
    );
}

#[test]
fn replies_carry_the_calls_id_as_sent() {
    let policy = mcp();
    let body = call(json!(42), "t", json!({}), json!({"idempotencyKey": "k"}));
    let call = keyed(read_body(
        &policy,
        &[("mcp-protocol-version", "2026-07-28")],
        body,
    ))
    .call;
    let stored = StoredResponse::new(
        http::Response::new(()).into_parts().0,
        (
            Bytes::from(r#"{"jsonrpc":"2.0","id":"first","result":{"content":[]}}"#),
            None,
        ),
        None,
        KeySource::Body,
    );
    let resp = replayed(&call, &stored, &policy, None).unwrap().unwrap();
    assert_eq!(resp.headers()["idempotent-replayed"], "true");
    assert_eq!(resp.headers()["content-type"], "application/json");
    let refused = refused::<()>(
        Outcome::mismatch,
        GatewayError::InFlight {
            retry_after: std::time::Duration::from_secs(1),
        },
        Some(&call.id),
    );
    let resp = refused.answer.unwrap();
    assert_eq!(resp.status(), http::StatusCode::CONFLICT);
    assert_eq!(resp.headers()["content-type"], "application/json");
}

#[test]
fn a_client_that_takes_only_an_event_stream_gets_its_replay_as_one_event() {
    let policy = mcp();
    let body = call(json!(1), "t", json!({}), json!({"idempotencyKey": "k"}));
    let headers = [("accept", "text/event-stream")];
    let call = keyed(read_body(&policy, &headers, body)).call;
    assert!(!call.takes_json);
    let stored = StoredResponse::new(
        http::Response::new(()).into_parts().0,
        (Bytes::from(r#"{"jsonrpc":"2.0","id":0,"result":{}}"#), None),
        None,
        KeySource::Body,
    );
    let resp = replayed(&call, &stored, &policy, None).unwrap().unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let len: usize = resp.headers()["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(len > "event: message\ndata: {}\n\n".len());
    for accept in [
        "application/json, text/event-stream",
        "*/*",
        "application/json;q=0.9",
    ] {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "t", "_meta": {"idempotencyKey": "k"}}});
        assert!(
            keyed(read_body(&policy, &[("accept", accept)], body))
                .call
                .takes_json,
            "{accept}"
        );
    }
}
