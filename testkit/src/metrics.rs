//! What a test or the benchmark reads from the processes it runs: a gateway's `/metrics`, and a
//! Redis's `INFO` counters (commands run, error replies).
//!
//! ```ignore
//! let text = scrape(gateway.admin()).await?;
//! let unsettled = sum_of(&text, "idemgate_calls_unsettled_total"); // every label summed
//! let before = commandstats(&mut conn, "calls").await;
//! // ... load ...
//! let note = per_request(&before, &commandstats(&mut conn, "calls").await, requests);
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

/// How long a scrape may take to connect, and then to read.
const SCRAPE: Duration = Duration::from_secs(10);

/// `GET /metrics` from the admin listener at `admin`: the body of a 200, as text.
pub async fn scrape(admin: SocketAddr) -> std::io::Result<String> {
    tokio::task::spawn_blocking(move || scrape_blocking(admin))
        .await
        .map_err(std::io::Error::other)?
}

/// [`scrape`] on this thread, for a caller that must not yield in between (a read of the last
/// count before a `kill -9`) or that has no runtime at hand.
pub fn scrape_blocking(admin: SocketAddr) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&admin, SCRAPE)?;
    s.set_read_timeout(Some(SCRAPE))?;
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    match answer.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => {
            Ok(body.to_string())
        }
        _ => Err(std::io::Error::other(format!(
            "/metrics answered {:.80}",
            answer
        ))),
    }
}

/// The value of one series at `admin`'s `/metrics`, named as it is exposed, labels and all:
/// `idemgate_client_connections`, `idemgate_records_unreadable_total{reason="tampered"}`.
/// Panics when the scrape fails or the series is not there.
pub async fn metric(admin: SocketAddr, series: &str) -> f64 {
    let text = scrape(admin).await.unwrap();
    value_of(&text, series).unwrap_or_else(|| panic!("{series} not in {text}"))
}

/// The value of the series named `series` (labels and all) in the OpenMetrics `text`.
pub fn value_of(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))?
        .trim()
        .parse()
        .ok()
}

/// The sum of every series of `family` in the OpenMetrics `text`: its lines `family value` and
/// `family{labels} value`.
pub fn sum_of(text: &str, family: &str) -> f64 {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(family)?;
            let value = match rest.as_bytes().first() {
                Some(b' ') => rest,
                Some(b'{') => &rest[rest.find("} ")? + 1..],
                _ => return None,
            };
            value.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

/// `INFO commandstats` of the Redis behind `conn`: `field` (`calls`; `usec`, µs spent in the
/// command, for `evalsha` those of the commands its script ran included) by command.
pub async fn commandstats(
    conn: &mut impl redis::aio::ConnectionLike,
    field: &str,
) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    counts_in(&info, "cmdstat_", field)
}

/// `INFO <section>` of each node (by its port), its `<prefix><name>:...,<field>=<n>,...` lines
/// summed by name; a node that does not answer counts nothing.
pub async fn info_counts(
    ports: &[u16],
    section: &str,
    prefix: &str,
    field: &str,
) -> HashMap<String, u64> {
    let mut sum = HashMap::new();
    for &port in ports {
        let Ok(text) = crate::query::<String>(port, redis::cmd("INFO").arg(section)).await else {
            continue;
        };
        for (name, n) in counts_in(&text, prefix, field) {
            *sum.entry(name).or_default() += n;
        }
    }
    sum
}

/// The `<prefix><name>:...,<field>=<n>,...` lines of an `INFO` answer, as `n` by name (0 where
/// the field is missing).
fn counts_in(info: &str, prefix: &str, field: &str) -> HashMap<String, u64> {
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix(prefix)?.split_once(':')?;
            let n = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix(field)?.strip_prefix('='))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            Some((name.to_string(), n))
        })
        .collect()
}

/// `name n, ...` of the commands run per request between two [`commandstats`] (or
/// [`info_counts`]), most first; `none` when there were none. The harness's own `INFO` and
/// `PING` are left out.
pub fn per_request(
    before: &HashMap<String, u64>,
    after: &HashMap<String, u64>,
    requests: u64,
) -> String {
    let mut parts: Vec<(&String, f64)> = after
        .iter()
        .map(|(k, v)| {
            let d = v.saturating_sub(before.get(k).copied().unwrap_or(0));
            (k, d as f64 / requests.max(1) as f64)
        })
        .filter(|(k, v)| *v > 0.001 && !matches!(k.as_str(), "info" | "ping"))
        .collect();
    parts.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    listed(parts.iter().map(|(k, v)| format!("{k} {v:.2}")).collect())
}

/// Error replies by their first word (MOVED, ASK, CLUSTERDOWN, ...), of each node.
pub async fn errorstats(ports: &[u16]) -> Vec<HashMap<String, u64>> {
    let mut each = Vec::new();
    for &port in ports {
        each.push(info_counts(&[port], "errorstats", "errorstat_", "count").await);
    }
    each
}

/// Commands answered with an error, by command, of each node: `<command> rejected` (refused
/// before running: a redirection, READONLY, CLUSTERDOWN) and `<command> failed` (an error
/// while running).
pub async fn failed_commands(ports: &[u16]) -> Vec<HashMap<String, u64>> {
    let mut each = Vec::new();
    for &port in ports {
        let mut m = HashMap::new();
        for field in ["rejected", "failed"] {
            let calls = info_counts(
                &[port],
                "commandstats",
                "cmdstat_",
                &format!("{field}_calls"),
            )
            .await;
            m.extend(calls.into_iter().map(|(k, v)| (format!("{k} {field}"), v)));
        }
        each.push(m);
    }
    each
}

/// The error replies of [`errorstats`] `after` less `before`, summed over the nodes. A count
/// lower than before is a node started again (its counts start from 0): all of it is new.
pub fn since(
    before: &[HashMap<String, u64>],
    after: Vec<HashMap<String, u64>>,
) -> HashMap<String, u64> {
    let mut sum: HashMap<String, u64> = HashMap::new();
    for (b, a) in before.iter().zip(after) {
        for (k, v) in a {
            let was = b.get(&k).copied().unwrap_or(0);
            *sum.entry(k).or_default() += if v >= was { v - was } else { v };
        }
    }
    sum
}

/// `KIND n, ...` of the error replies counted, or `none`.
pub fn errors_text(errors: &HashMap<String, u64>) -> String {
    let mut e: Vec<String> = errors
        .iter()
        .filter(|(_, &n)| n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    e.sort();
    listed(e)
}

/// `parts` joined with commas, or `none`.
fn listed(parts: Vec<String>) -> String {
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_every_series_of_a_family_and_no_other() {
        let text = "# TYPE idemgate_calls_unsettled counter\n\
            idemgate_calls_unsettled_total{route=\"default\",reason=\"timeout\"} 3\n\
            idemgate_calls_unsettled_total{route=\"default\",reason=\"failed\"} 2\n\
            idemgate_calls_unsettled_total_extra 100\n\
            idemgate_calls_unsettled_created{route=\"default\"} 1.7e9\n\
            idemgate_other_total 7\n";
        assert_eq!(sum_of(text, "idemgate_calls_unsettled_total"), 5.0);
        assert_eq!(sum_of(text, "idemgate_other_total"), 7.0);
        assert_eq!(sum_of(text, "idemgate_missing_total"), 0.0);
        assert_eq!(value_of(text, "idemgate_other_total"), Some(7.0));
        assert_eq!(value_of(text, "idemgate_calls_unsettled_total"), None);
    }

    #[test]
    fn reads_commands_per_request_from_two_commandstats() {
        let info = "# Commandstats\r\n\
            cmdstat_evalsha:calls=300,usec=900,usec_per_call=3.00,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_info:calls=9,usec=90,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_get:calls=100,usec=100,usec_per_call=1.00,rejected_calls=2,failed_calls=0\r\n";
        let after = counts_in(info, "cmdstat_", "calls");
        assert_eq!(after["evalsha"], 300);
        assert_eq!(counts_in(info, "cmdstat_", "rejected_calls")["get"], 2);
        let before = HashMap::from([("evalsha".to_string(), 100)]);
        assert_eq!(per_request(&before, &after, 100), "evalsha 2.00, get 1.00");
        assert_eq!(per_request(&after, &after, 100), "none");
    }
}
