//! The processes a benchmark run measures: the upstream, nginx, the axum app, and the gateway
//! (testkit's [`GatewayProcess`], configured with a [`GatewayConfig`], as in the tests). Each
//! is stopped when its handle drops.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use testkit::process::children;
use testkit::{free_addr, GatewayConfig, GatewayProcess};

/// A child process, stopped on drop: SIGTERM, then SIGKILL 3 s later.
pub struct Proc {
    pub addr: SocketAddr,
    /// The gateway's admin listener (metrics).
    pub admin: Option<SocketAddr>,
    child: Running,
}

/// What a [`Proc`] runs.
enum Running {
    /// One of the benchmark's own processes, or nginx.
    Child(Child),
    /// The gateway.
    Gateway(Box<GatewayProcess>),
}

impl Proc {
    pub fn pid(&self) -> u32 {
        match &self.child {
            Running::Child(child) => child.id(),
            Running::Gateway(gateway) => gateway.pid().expect("the gateway runs"),
        }
    }

    /// Whether it still runs.
    fn running(&mut self) -> bool {
        match &mut self.child {
            Running::Child(child) => matches!(child.try_wait(), Ok(None)),
            Running::Gateway(gateway) => gateway.running(),
        }
    }

    /// This process and its direct children (nginx's workers).
    pub fn pids(&self) -> Vec<u32> {
        with_children(self.pid())
    }

    /// Resident set size in KiB (the main process only).
    pub fn rss_kib(&self) -> u64 {
        rss_kib(self.pid())
    }
}

/// `pid` and its direct children (nginx's workers, PostgreSQL's backends).
pub fn with_children(pid: u32) -> Vec<u32> {
    std::iter::once(pid).chain(children(pid)).collect()
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Already gone: its pid may be reused by now.
        if !self.running() {
            return;
        }
        // SIGTERM first, so that a master process (nginx) stops its workers too; a SIGKILLed
        // nginx master leaves its workers running, still listening.
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if !self.running() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // The gateway is killed as its handle drops.
        if let Running::Child(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|v| v.parse().unwrap_or(0)))
        })
        .unwrap_or(0)
}

/// CPU time in ns the scheduler has charged to `pids`, all their threads included: the first
/// field of `/proc/<pid>/task/<tid>/schedstat`. It is exact, where the `utime`/`stime` of
/// `/proc/<pid>/stat` are sampled at each timer tick and, for a process that runs in bursts
/// shorter than a tick (nginx's workers), can be off by a factor of two. A process gone or
/// unreadable counts 0.
pub fn cpu_ns(pids: &[u32]) -> u64 {
    let mut total = 0;
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            if let Some(ns) = std::fs::read_to_string(task.path().join("schedstat"))
                .ok()
                .and_then(|s| {
                    s.split_whitespace()
                        .next()
                        .and_then(|v| v.parse::<u64>().ok())
                })
            {
                total += ns;
            }
        }
    }
    total
}

/// How many times the threads of `pids` have gone to sleep waiting (for a socket, a timer, a
/// lock): `voluntary_ctxt_switches` of `/proc/<pid>/task/<tid>/status`. Per request, how much
/// work each wake-up found.
pub fn sleeps(pids: &[u32]) -> u64 {
    let mut total = 0;
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
            total += status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    total
}

fn spawn(name: &str, cmd: &mut Command, addr: SocketAddr) -> Proc {
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
    let proc = Proc {
        addr,
        admin: None,
        child: Running::Child(child),
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "{name} did not start listening on {addr}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    proc
}

/// The telemetry section's OTLP sink collector.
pub fn collector() -> Proc {
    let addr = free_addr();
    let me = std::env::current_exe().unwrap();
    spawn(
        "collector",
        Command::new(me)
            .arg("collector")
            .args(["--listen", &addr.to_string()]),
        addr,
    )
}

pub fn upstream(body: usize, delay_ms: u64) -> Proc {
    upstream_with(body, delay_ms, false)
}

/// The upstream, counting executions per `Idempotency-Key` when `count_keys`.
pub fn upstream_with(body: usize, delay_ms: u64, count_keys: bool) -> Proc {
    let addr = free_addr();
    let me = std::env::current_exe().unwrap();
    let mut cmd = Command::new(me);
    cmd.arg("upstream")
        .args(["--listen", &addr.to_string()])
        .args([
            "--body",
            &body.to_string(),
            "--delay-ms",
            &delay_ms.to_string(),
        ]);
    if count_keys {
        cmd.arg("--count-keys");
    }
    spawn("upstream", &mut cmd, addr)
}

/// The upstream over TLS with the certificates in `tls_dir` (a client certificate required).
pub fn upstream_tls(body: usize, tls_dir: &Path) -> Proc {
    let addr = free_addr();
    let me = std::env::current_exe().unwrap();
    spawn(
        "upstream (TLS)",
        Command::new(me)
            .arg("upstream")
            .args(["--listen", &addr.to_string()])
            .args(["--body", &body.to_string()])
            .arg("--tls-dir")
            .arg(tls_dir),
        addr,
    )
}

/// nginx proxying to an https upstream: keep-alive connections, the upstream's certificate
/// verified against the CA, the client certificate presented, TLS sessions reused.
pub fn nginx_tls(dir: &Path, upstream: SocketAddr, files: &crate::tls::Files) -> Proc {
    let location = format!(
        r#"
            proxy_pass https://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering on;
            proxy_buffers 16 16k;
            proxy_ssl_verify on;
            proxy_ssl_trusted_certificate {ca};
            proxy_ssl_name {name};
            proxy_ssl_server_name on;
            proxy_ssl_certificate {cert};
            proxy_ssl_certificate_key {key};
            proxy_ssl_session_reuse on;"#,
        ca = files.ca.display(),
        name = crate::tls::UPSTREAM_NAME,
        cert = files.client_cert.display(),
        key = files.client_key.display(),
    );
    nginx_with(dir, upstream, &location)
}

/// The axum app of `app.rs`, with or without idemgate's layer.
pub fn app(body: usize, layer: bool) -> Proc {
    let addr = free_addr();
    let me = std::env::current_exe().unwrap();
    let mut cmd = Command::new(me);
    cmd.arg("app")
        .args(["--listen", &addr.to_string()])
        .args(["--body", &body.to_string()]);
    if layer {
        cmd.arg("--layer");
    }
    spawn(if layer { "app with layer" } else { "app" }, &mut cmd, addr)
}

pub fn nginx(dir: &Path, upstream: SocketAddr) -> Proc {
    let location = r#"
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering on;
            proxy_buffers 16 16k;"#;
    nginx_with(dir, upstream, location)
}

/// [`nginx`] passing the upstream's answer on as it arrives (`proxy_buffering off`), as nginx is
/// set up in front of event streams.
pub fn nginx_unbuffered(dir: &Path, upstream: SocketAddr) -> Proc {
    let location = r#"
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;"#;
    nginx_with(dir, upstream, location)
}

/// nginx as a reverse proxy to `upstream` with `location` as its one location's directives.
fn nginx_with(dir: &Path, upstream: SocketAddr, location: &str) -> Proc {
    let addr = free_addr();
    let d = dir.join(format!("nginx-{}", addr.port()));
    std::fs::create_dir_all(&d).unwrap();
    let conf = format!(
        r#"
worker_processes auto;
daemon off;
master_process on;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    upstream app {{ server {upstream}; keepalive 256; keepalive_requests 1000000; }}
    server {{
        listen {addr};
        keepalive_requests 1000000;
        location / {{{location}
        }}
    }}
}}
"#,
        d = d.display()
    );
    let conf_path = d.join("nginx.conf");
    std::fs::write(&conf_path, conf).unwrap();
    spawn(
        "nginx",
        Command::new(nginx_bin())
            .arg("-c")
            .arg(&conf_path)
            .arg("-p")
            .arg(&d),
        addr,
    )
}

fn nginx_bin() -> PathBuf {
    for p in ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"] {
        if Path::new(p).exists() {
            return PathBuf::from(p);
        }
    }
    PathBuf::from("nginx")
}

/// The gateway binary next to this one (both built by `cargo build --workspace` in one profile).
pub fn gateway_bin() -> PathBuf {
    let me = std::env::current_exe().unwrap();
    me.with_file_name("idemgate")
}

/// The benchmark's gateway in front of `upstream`: POST requests keyed, records in memory (the
/// store methods of [`GatewayConfig`] change that), an admin listener for its metrics.
pub fn config(upstream: SocketAddr) -> GatewayConfig {
    GatewayConfig::new()
        .upstream(&format!("http://{upstream}"))
        .set("defaults.methods", vec!["POST"])
        .admin()
}

/// The gateway with `config`, logging at `info` to nowhere: [`gateway_bin`] started, its
/// listener accepting.
pub async fn gateway(config: &GatewayConfig) -> Proc {
    let process = GatewayProcess::binary(gateway_bin())
        .env("RUST_LOG", "info")
        .quiet()
        .start(config)
        .await;
    Proc {
        addr: process.addr(),
        admin: config.get("admin.listen").map(|_| process.admin()),
        child: Running::Gateway(Box::new(process)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_cpu_time_of_a_process() {
        let me = std::process::id();
        assert_eq!(with_children(me).first(), Some(&me));
        assert!(cpu_ns(&[me]) > 0);
    }
}
