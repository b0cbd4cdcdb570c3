//! Section `mcp`: an MCP `tools/call` on a `protocol = "mcp"` route: its miss (the body read as
//! JSON-RPC, its fingerprint without `id` and `_meta`, the terminal response classified and
//! recorded) and its replay (the record with the retry's id and the replayed marker), beside the
//! same call through nginx, on the memory store.

use std::path::Path;

use bytes::Bytes;

use crate::bench::{phase, Bench, PAYMENTS};
use crate::load::{self, Keys, Report};
use crate::procs;

/// The path of the MCP route (the upstream answers a tools/call result under it).
const MCP: &str = "/mcp";

/// A 2026-07-28 `tools/call` as an agent sends it, its key in the `Idempotency-Key` header the
/// load generator sets.
fn tools_call() -> Bytes {
    Bytes::from_static(
        br#"{"jsonrpc":"2.0","id":17,"method":"tools/call","params":{"name":"send_invoice","arguments":{"customer":"cus_9s6XKzkNRiz8i3","amount":129900,"currency":"eur"},"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","progressToken":"p-17"}}}"#,
    )
}

/// Nginx, the gateway's miss and its replay of one tools/call answered with 1 KiB, `b.rounds`
/// rounds interleaved; the medians side by side in a note.
pub async fn run(b: &mut Bench, dir: &Path) {
    let up = procs::upstream(1024, 0);
    let nginx = procs::nginx(dir, up.addr);
    let route = toml::toml! { protocol = "mcp" };
    let gw = procs::gateway(&procs::config(up.addr).route(MCP, route)).await;
    b.upstream_pids = up.pids();
    b.redis_pids = Vec::new();
    b.path = MCP.to_string();
    b.request = tools_call();
    b.size = 1024;
    let (nginx_pids, gw_pids) = (nginx.pids(), gw.pids());
    let start = b.rows.len();
    let scenarios = [
        (
            "nginx proxy, MCP tools/call",
            nginx.addr,
            &nginx_pids,
            "none",
        ),
        ("gateway miss, MCP tools/call", gw.addr, &gw_pids, "miss"),
        (
            "gateway replay, MCP tools/call",
            gw.addr,
            &gw_pids,
            "replay",
        ),
    ];
    let keys = |b: &mut Bench, kind: &str| match kind {
        "miss" => Keys::Unique(b.prefix("mcp-miss")),
        "replay" => Keys::Hot("mcp-hot".to_string(), 1000),
        _ => Keys::None,
    };
    for (name, addr, pids, kind) in scenarios {
        let k = keys(b, kind);
        phase(b, name, addr, pids, k, None).await;
    }
    for round in 1..b.rounds {
        for (i, (name, addr, pids, kind)) in scenarios.iter().enumerate() {
            let k = keys(b, kind);
            let r = b.closed(*addr, k, pids).await;
            b.check(&format!("{name} (round {})", round + 1), &r, false);
            b.rows[start + i].samples.push(r);
        }
    }
    let median = |samples: &[Report], f: &dyn Fn(&Report) -> f64| {
        let mut v: Vec<f64> = samples.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for row in &mut b.rows[start..] {
        let mut samples = row.samples.clone();
        samples.sort_by(|x, y| x.rps().total_cmp(&y.rps()));
        row.closed = samples[samples.len() / 2].clone();
    }
    let rows = &b.rows[start..start + 3];
    let rps: Vec<f64> = rows
        .iter()
        .map(|r| median(&r.samples, &Report::rps))
        .collect();
    let p50: Vec<f64> = rows.iter().map(|r| r.closed.ms(0.5)).collect();
    b.notes.push(format!(
        "mcp (tools/call, 1 KiB result, memory store, {} rounds): req/s nginx {:.0}, gateway miss {:.0}, replay {:.0}; p50 ms nginx {:.2}, miss {:.2}, replay {:.2}",
        b.rounds.max(1), rps[0], rps[1], rps[2], p50[0], p50[1], p50[2],
    ));
    b.path = PAYMENTS.to_string();
    b.request = load::small_request();
    drop((up, nginx, gw));
}
