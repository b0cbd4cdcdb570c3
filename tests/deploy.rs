//! What `deploy/` ships for operators: the Grafana dashboard and the Prometheus alert rules
//! query only metrics a running gateway exports, every panel and rule is described in the
//! operations docs, and the rules pass `promtool check rules` and their own `promtool test
//! rules` (promtool from Debian's `prometheus` package, which scripts/test installs). The
//! Kubernetes manifests have their own module, [`kubernetes`].

mod kubernetes;

use crate::common;

use std::collections::BTreeSet;
use std::process::Command;

use common::{send, Backend, GatewayConfig, TestEnv};

const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/idemgate.json");
const ALERTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus/alerts.yml");
const ALERT_TESTS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/prometheus/alerts.test.yml"
);
const OPERATING: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operating.md");

/// Every `idemgate_...` metric name in `text` (a PromQL expression, or a whole file of them).
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("idemgate_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.insert(name);
    }
    names
}

/// The sample names a Prometheus scrape of `exposition` can hold: a counter's `_total`, a
/// histogram's `_bucket`, `_sum` and `_count`, a gauge's own name.
fn exported(exposition: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').unwrap();
        match kind {
            "counter" => {
                names.insert(format!("{name}_total"));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                names.insert(name.to_string());
            }
        }
    }
    names
}

fn dashboard() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap()).unwrap()
}

/// The dashboard's panels (rows aside) and the expressions of each.
fn panels() -> Vec<(String, Vec<String>)> {
    let d = dashboard();
    d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] != "row")
        .map(|p| {
            let exprs = p["targets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["expr"].as_str().unwrap().to_string())
                .collect();
            (p["title"].as_str().unwrap().to_string(), exprs)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_the_rules_query_only_exported_metrics() {
    let env = TestEnv::start(
        Backend::Redis,
        GatewayConfig::new().set("admin.listen", "127.0.0.1:0"),
    )
    .await;
    // A miss and a replay, so that the families with labels hold a series too.
    send(env.post_keyed("/v1/p", "k").body("x")).await;
    send(env.post_keyed("/v1/p", "k").body("x")).await;
    let mut scraped = exported(&env.gateway.metrics().await);
    assert!(scraped.contains("idemgate_requests_total"), "{scraped:?}");
    // And a gateway in which the families of TLS, webhook and MCP routes hold series too.
    scraped.extend(exported(&common::gateway::every_family_scraped().await));

    let mut queried = BTreeSet::new();
    for (title, exprs) in panels() {
        assert!(!exprs.is_empty(), "panel {title:?} has no query");
        for expr in exprs {
            queried.extend(metric_names(&expr));
        }
    }
    let rules = std::fs::read_to_string(ALERTS).unwrap();
    queried.extend(metric_names(&rules));
    let missing: Vec<_> = queried.difference(&scraped).collect();
    assert!(
        missing.is_empty(),
        "queried but not exported: {missing:?}\nexported: {scraped:?}"
    );
    assert!(queried.len() >= 15, "{queried:?}");
}

#[test]
fn the_dashboard_has_a_datasource_variable_and_every_panel_is_described() {
    let d = dashboard();
    let vars = d["templating"]["list"].as_array().unwrap();
    assert!(vars
        .iter()
        .any(|v| v["name"] == "datasource" && v["type"] == "datasource"));
    let docs = std::fs::read_to_string(OPERATING).unwrap();
    for p in d["panels"].as_array().unwrap() {
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        let title = p["title"].as_str().unwrap();
        assert!(
            docs.contains(&format!("**{title}**")),
            "panel {title:?} is not described in docs/operating.md"
        );
    }
}

#[test]
fn every_alert_has_a_runbook_in_the_docs() {
    let rules = std::fs::read_to_string(ALERTS).unwrap();
    let docs = std::fs::read_to_string(OPERATING).unwrap();
    let names: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(names.len() >= 5, "{names:?}");
    for name in names {
        assert!(
            docs.contains(&format!("### {name}\n")),
            "no runbook heading for {name} in docs/operating.md"
        );
        assert!(
            rules.contains(&format!(
                "runbook_url: \"docs/operating.md#{}\"",
                name.to_lowercase()
            )),
            "{name}'s runbook_url"
        );
    }
}

#[test]
fn promtool_checks_the_rules_and_their_tests_pass() {
    for args in [
        vec!["check", "rules", ALERTS],
        vec!["test", "rules", ALERT_TESTS],
    ] {
        let out = Command::new("promtool")
            .args(&args)
            .output()
            .unwrap_or_else(|e| {
                panic!("promtool ({e}): install Debian's prometheus package (scripts/test does)")
            });
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
