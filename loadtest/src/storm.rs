//! Section `storm`: many clients on few keys through a slow upstream, on both stores.

use std::net::SocketAddr;

use crate::bench::{Bench, Row};
use crate::load::{self, Keys, Pace};
use crate::metrics::get_text;
use crate::procs;

/// Many clients, few keys, a slow upstream: every key must run exactly once.
pub async fn run(b: &mut Bench, redis_url: &str) {
    let up = procs::upstream(1024, 20);
    for label in ["memory", "redis"] {
        let config = match label {
            "memory" => procs::config(up.addr),
            _ => procs::config(up.addr).redis_url(redis_url).prefix("bench:"),
        };
        let gw = procs::gateway(&config).await;
        let before = upstream_count(up.addr).await;
        let prefix = b.prefix("storm");
        let r = load::run(
            gw.addr,
            "/v1/payments",
            Keys::Storm(prefix, 64),
            64,
            b.secs,
            Pace::Closed,
        )
        .await;
        let executions = upstream_count(up.addr).await - before;
        let keys = r.requests.div_ceil(64);
        b.check(&format!("duplicate storm, {label}"), &r, true);
        if executions > keys {
            b.insane.push(format!(
                "duplicate storm, {label}: {executions} executions for {keys} keys"
            ));
        }
        b.notes.push(format!(
            "duplicate storm, {label} (64 connections, 64 requests per key, upstream 20 ms): {} requests, {keys} keys, {executions} upstream executions, {} answered 409 in flight, {:.0} req/s",
            r.requests,
            r.conflicts,
            r.rps()
        ));
        eprintln!(
            "  duplicate storm, {label:<20} {:>9.0} req/s  {executions} executions / {keys} keys",
            r.rps()
        );
        b.rows.push(Row {
            scenario: format!("duplicate storm, {label}"),
            body: 1024,
            closed: r.clone(),
            samples: vec![r],
            at_rate: None,
        });
    }
}

async fn upstream_count(addr: SocketAddr) -> u64 {
    get_text(addr, "/__count").await.parse().unwrap()
}
