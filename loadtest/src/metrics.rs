//! What the harness reads from the processes it runs, on top of testkit's readers of a
//! gateway's `/metrics` and a Redis's `INFO`: the gateway's round trips and store operations,
//! and the upstream's counters (over HTTP).

use std::collections::HashMap;
use std::net::SocketAddr;

use testkit::metrics::{scrape_blocking, sum_of};

/// The gateway's metrics, as text; panics when it does not answer.
pub fn scrape(admin: SocketAddr) -> String {
    scrape_blocking(admin).unwrap()
}

/// The gateway's own count of Redis round trips so far: its store operations (each one round
/// trip) minus the reads its local cache answered. From its `/metrics`.
pub fn round_trips(admin: SocketAddr) -> u64 {
    let text = scrape(admin);
    let ops = sum_of(&text, "idemgate_store_operation_seconds_count") as u64;
    ops - sum_of(&text, "idemgate_local_cache_hits_total") as u64
}

/// The gateway's store operations so far by operation (`claim`, `complete`, ...), from the
/// counts of `idemgate_store_operation_seconds` in its `/metrics`.
pub fn store_operations(admin: SocketAddr) -> HashMap<String, u64> {
    operations_in(&scrape(admin))
}

fn operations_in(text: &str) -> HashMap<String, u64> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("idemgate_store_operation_seconds_count{")?;
            let (labels, value) = rest.split_once("} ")?;
            let op = labels
                .split(',')
                .find_map(|kv| kv.strip_prefix("operation=\""))?
                .trim_end_matches('"');
            Some((op.to_string(), value.trim().parse::<f64>().ok()? as u64))
        })
        .collect()
}

/// `after` less `before`, by name (counters: a name missing before counts from 0).
pub fn moved(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> HashMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0).min(*v)))
        .collect()
}

/// The harness upstream's executions so far (`GET /__count`).
pub async fn executions(upstream: SocketAddr) -> u64 {
    get_text(upstream, "/__count")
        .await
        .trim()
        .parse()
        .unwrap_or(0)
}

/// The harness upstream's `GET /__keys`: keys executed, executions, keys executed more than
/// once (all 0 when it does not answer so).
pub async fn executions_per_key(upstream: SocketAddr) -> (u64, u64, u64) {
    let text = get_text(upstream, "/__keys").await;
    let v: Vec<u64> = text
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    match v[..] {
        [k, e, t] => (k, e, t),
        _ => (0, 0, 0),
    }
}

/// `GET path` from `addr`, the body as text.
pub async fn get_text(addr: SocketAddr, path: &str) -> String {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut s, conn) = hyper::client::conn::http1::handshake::<
        _,
        http_body_util::Empty<bytes::Bytes>,
    >(hyper_util::rt::TokioIo::new(stream))
    .await
    .unwrap();
    tokio::spawn(conn);
    let resp = s
        .send_request(
            http::Request::get(path)
                .header("host", "u")
                .body(http_body_util::Empty::new())
                .unwrap(),
        )
        .await
        .unwrap();
    use http_body_util::BodyExt;
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_store_operations_of_a_scrape() {
        let text = "# TYPE idemgate_store_operation_seconds histogram\nidemgate_store_operation_seconds_sum{operation=\"claim\"} 0.5\nidemgate_store_operation_seconds_count{operation=\"claim\"} 100\nidemgate_store_operation_seconds_bucket{operation=\"claim\",le=\"0.001\"} 90\nidemgate_store_operation_seconds_count{operation=\"complete\"} 99\n";
        let ops = operations_in(text);
        assert_eq!(ops.len(), 2);
        assert_eq!(ops["claim"], 100);
        assert_eq!(ops["complete"], 99);
        let before = HashMap::from([("claim".to_string(), 40)]);
        let m = moved(&before, &ops);
        assert_eq!((m["claim"], m["complete"]), (60, 99));
    }
}
