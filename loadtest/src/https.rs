//! Section `https`: an https upstream with mutual TLS, through nginx and through the gateway.

use std::net::SocketAddr;
use std::path::Path;

use crate::bench::{phase, Bench};
use crate::load::{Keys, Report};
use crate::metrics::scrape;
use crate::{procs, tls};

/// An https upstream that requires a client certificate (mutual TLS), 1 KiB: nginx proxying to
/// it (`proxy_pass https://`, keep-alive, the same client certificate) against the gateway's
/// pass-through and miss; and how many connections (TLS handshakes) the gateway opened per
/// 1000 requests.
pub async fn run(b: &mut Bench, dir: &Path) {
    b.size = 1024;
    let files = tls::write(&dir.join("tls"));
    let up = procs::upstream_tls(b.size, &dir.join("tls"));
    let nginx = procs::nginx_tls(dir, up.addr, &files);
    let path = |p: &Path| p.display().to_string();
    let config = procs::config(up.addr)
        .upstream(&format!("https://{}", up.addr))
        .set("upstreams.default.server_name", tls::UPSTREAM_NAME)
        .set("upstreams.default.ca_file", path(&files.ca))
        .set(
            "upstreams.default.client_cert_file",
            path(&files.client_cert),
        )
        .set("upstreams.default.client_key_file", path(&files.client_key));
    let gw = procs::gateway(&config).await;
    b.upstream_pids = up.pids();
    let (nginx_pids, gw_pids) = (nginx.pids(), gw.pids());
    let before = upstream_counters(gw.admin.unwrap());
    let nginx_r = phase(
        b,
        "nginx proxy, https upstream",
        nginx.addr,
        &nginx_pids,
        Keys::None,
        None,
    )
    .await;
    let pass = phase(
        b,
        "gateway pass-through, https upstream",
        gw.addr,
        &gw_pids,
        Keys::None,
        None,
    )
    .await;
    let miss = phase(
        b,
        "gateway miss (memory), https upstream",
        gw.addr,
        &gw_pids,
        Keys::Unique(String::new()),
        None,
    )
    .await;
    let after = upstream_counters(gw.admin.unwrap());
    let (opened, requests) = (after.0 - before.0, after.1 - before.1);
    let cpu = |r: &Report| r.cpu.map_or(0.0, |c| c.all());
    b.notes.push(format!(
        "https upstream with mutual TLS (1 KiB): pass-through / nginx = {:.2} [CPU {:.2}], miss (memory) / nginx = {:.2} [CPU {:.2}]; the gateway opened {opened} connections for {requests} requests ({:.2} per 1000 requests: pooled, no handshake per request)",
        pass.rps() / nginx_r.rps(),
        cpu(&nginx_r) / cpu(&pass).max(f64::MIN_POSITIVE),
        miss.rps() / nginx_r.rps(),
        cpu(&nginx_r) / cpu(&miss).max(f64::MIN_POSITIVE),
        opened as f64 * 1000.0 / requests.max(1) as f64,
    ));
    drop((up, nginx, gw));
}

/// Connections opened and responses received, summed over the gateway's upstreams.
fn upstream_counters(admin: SocketAddr) -> (u64, u64) {
    let text = scrape(admin);
    let sum = |prefix: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    (
        sum("idemgate_upstream_connections_opened_total"),
        sum("idemgate_upstream_requests_total{upstream=\"default\",result=\"response\"}"),
    )
}
