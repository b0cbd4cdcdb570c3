//! The processes a benchmark run needs: redis-server, the upstream, nginx and the gateway. Each
//! is killed when its handle drops.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed on drop.
pub struct Proc {
    pub addr: SocketAddr,
    /// The gateway's admin listener (metrics).
    pub admin: Option<SocketAddr>,
    child: Child,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// This process and its direct children (nginx's workers).
    pub fn pids(&self) -> Vec<u32> {
        let pid = self.pid();
        let mut pids = vec![pid];
        match std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
            Ok(children) => pids.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            ),
            // A kernel without CONFIG_PROC_CHILDREN: find them by their parent.
            Err(_) => pids.extend(children_by_ppid(pid)),
        }
        pids
    }

    /// Resident set size in KiB (the main process only).
    pub fn rss_kib(&self) -> u64 {
        rss_kib(self.pid())
    }

    /// `kill -9`: no shutdown of any kind, as a crash or an OOM kill would end it.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Already gone (killed with SIGKILL by [`Proc::kill9`]): its pid may be reused by now.
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        // SIGTERM first, so that a master process (nginx) stops its workers too; a SIGKILLed
        // nginx master leaves its workers running, still listening.
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn children_by_ppid(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // Field 4 of /proc/<pid>/stat, after the parenthesised command name.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    let rest = &s[s.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
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

pub fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
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
        child,
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

pub fn redis(dir: &Path) -> Proc {
    let addr = free_addr();
    spawn(
        "redis-server",
        Command::new("redis-server").args(redis_args(addr, dir)),
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

/// The gateway binary next to this one (both built by `cargo build --release --workspace`).
pub fn gateway_bin() -> PathBuf {
    let me = std::env::current_exe().unwrap();
    me.with_file_name("idemgate")
}

/// Start the gateway with `store` ("memory" or a redis URL) in front of `upstream`.
pub fn gateway(dir: &Path, store: &str, upstream: SocketAddr, extra: &str) -> Proc {
    gateway_with_prefix(dir, store, upstream, extra, "bench:")
}

/// The gateway with `store` and `upstream`, the TOML of its upstream (the top-level `upstream`
/// and any `[upstreams.default]` table).
pub fn gateway_to(dir: &Path, store: &str, upstream: &str) -> Proc {
    gateway_config(dir, store, upstream, "", "bench:")
}

/// [`gateway`] with Redis keys under `prefix`.
pub fn gateway_with_prefix(
    dir: &Path,
    store: &str,
    upstream: SocketAddr,
    extra: &str,
    prefix: &str,
) -> Proc {
    gateway_config(
        dir,
        store,
        &format!("upstream = \"http://{upstream}\"\n"),
        extra,
        prefix,
    )
}

fn gateway_config(dir: &Path, store: &str, upstream: &str, extra: &str, prefix: &str) -> Proc {
    let addr = free_addr();
    // "memory", a Redis URL, or the `[store]` table's body as written (`backend = ...` first).
    let store_toml = if store == "memory" {
        "backend = \"memory\"".to_string()
    } else if store.starts_with("backend") {
        format!("{store}\nprefix = \"{prefix}\"")
    } else {
        format!("backend = \"redis\"\nurl = \"{store}\"\nprefix = \"{prefix}\"")
    };
    let admin = free_addr();
    let conf = format!(
        "listen = \"{addr}\"\n{upstream}\n[store]\n{store_toml}\n{extra}\n\n[defaults]\nmethods = [\"POST\"]\n\n[admin]\nlisten = \"{admin}\"\n"
    );
    let path = dir.join(format!("gateway-{}.toml", addr.port()));
    std::fs::write(&path, conf).unwrap();
    let name = if store == "memory" {
        "gateway (memory)"
    } else {
        "gateway (redis)"
    };
    let mut proc = spawn(
        name,
        Command::new(gateway_bin())
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", "info"),
        addr,
    );
    proc.admin = Some(admin);
    proc
}

// === Redis Cluster and Sentinel ===

/// A redis-server that can be killed with SIGKILL and started again on the same port, with the
/// same directory (a cluster node's `nodes.conf`) and arguments.
pub struct RedisNode {
    pub addr: SocketAddr,
    args: Vec<String>,
    proc: Option<Proc>,
}

impl RedisNode {
    fn start(addr: SocketAddr, args: Vec<String>) -> RedisNode {
        let mut node = RedisNode {
            addr,
            args,
            proc: None,
        };
        node.restart(&[]);
        node
    }

    /// Start it again (after [`RedisNode::kill9`]) with its arguments and `extra`.
    pub fn restart(&mut self, extra: &[String]) {
        assert!(self.proc.is_none(), "{} is still running", self.addr);
        self.proc = Some(spawn(
            "redis-server",
            Command::new("redis-server").args(&self.args).args(extra),
            self.addr,
        ));
    }

    pub fn kill9(&mut self) {
        if let Some(p) = self.proc.take() {
            p.kill9();
        }
    }

    pub fn is_running(&self) -> bool {
        self.proc.is_some()
    }

    pub fn pids(&self) -> Vec<u32> {
        self.proc.iter().map(Proc::pid).collect()
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// One command on a fresh connection, with a short timeout (the node may be down).
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        query(self.addr, cmd)
    }

    /// `INFO <section>` as `field -> value`.
    pub fn info(&self, section: &str) -> Option<std::collections::HashMap<String, String>> {
        let text: String = self.query(redis::cmd("INFO").arg(section)).ok()?;
        Some(
            text.lines()
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.to_string(), v.trim().to_string()))
                .collect(),
        )
    }

    /// Whether it is a primary (`role:master`); None when it does not answer.
    pub fn is_primary(&self) -> Option<bool> {
        Some(self.info("replication")?.get("role")? == "master")
    }
}

/// One command to `addr` on a fresh connection, with a 1 s timeout. Without the client's
/// `CLIENT SETINFO` (Redis 7.0 answers it with an error, which would count in `INFO errorstats`).
pub fn query<T: redis::FromRedisValue>(
    addr: SocketAddr,
    cmd: &redis::Cmd,
) -> redis::RedisResult<T> {
    use redis::IntoConnectionInfo;
    let info = format!("redis://{addr}").into_connection_info()?;
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    let client = redis::Client::open(info.set_redis_settings(settings))?;
    let mut conn = client.get_connection_with_timeout(Duration::from_secs(1))?;
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    cmd.query(&mut conn)
}

/// The arguments every benchmark redis-server gets: loopback, no persistence, `noeviction`.
fn redis_args(addr: SocketAddr, dir: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "--bind",
        "127.0.0.1",
        "--port",
        &addr.port().to_string(),
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory-policy",
        "noeviction",
        "--dir",
    ]
    .map(String::from)
    .to_vec();
    args.push(dir.display().to_string());
    args
}

/// [`redis_args`] for a node with replicas: a full sync starts at once instead of waiting 5 s
/// (`repl-diskless-sync-delay`) for more replicas to share it.
fn replicated_args(addr: SocketAddr, dir: &Path) -> Vec<String> {
    let mut args = redis_args(addr, dir);
    args.extend(["--repl-diskless-sync-delay", "0"].map(String::from));
    args
}

/// Poll `ready` every 50 ms for up to `secs` seconds.
pub fn wait_until(what: &str, secs: u64, mut ready: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ready() {
        if Instant::now() > deadline {
            return Err(format!("{what}: not after {secs} s"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A Redis Cluster on loopback: `primaries` primaries with one replica each, joined by
/// `redis-cli --cluster create ... --cluster-replicas 1`. The cluster bus of each node is on a
/// free port of its own (`--cluster-port`), and `cluster-node-timeout` is 1000 ms, so that a
/// failover takes seconds, not the default's 15+.
pub struct Cluster {
    pub nodes: Vec<RedisNode>,
}

pub const CLUSTER_NODE_TIMEOUT_MS: u64 = 1000;

impl Cluster {
    pub fn start(dir: &Path, primaries: usize) -> Result<Cluster, String> {
        let mut nodes = Vec::new();
        for _ in 0..primaries * 2 {
            let addr = free_addr();
            let d = dir.join(format!("cluster-{}", addr.port()));
            std::fs::create_dir_all(&d).unwrap();
            let mut args = replicated_args(addr, &d);
            args.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    &CLUSTER_NODE_TIMEOUT_MS.to_string(),
                    "--cluster-port",
                    &free_addr().port().to_string(),
                ]
                .map(String::from),
            );
            nodes.push(RedisNode::start(addr, args));
        }
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(nodes.iter().map(|n| n.addr.to_string()))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .map_err(|e| format!("redis-cli: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let cluster = Cluster { nodes };
        cluster.wait_healthy(30)?;
        Ok(cluster)
    }

    /// Until every running node says `cluster_state:ok` and every primary has a replica
    /// online and in sync.
    pub fn wait_healthy(&self, secs: u64) -> Result<(), String> {
        wait_until("cluster state ok on every node", secs, || {
            self.nodes.iter().filter(|n| n.is_running()).all(|n| {
                n.query::<String>(redis::cmd("CLUSTER").arg("INFO"))
                    .is_ok_and(|s| s.contains("cluster_state:ok"))
            })
        })?;
        wait_until("a replica online on every primary", secs, || {
            self.primaries().iter().all(|&i| {
                self.nodes[i].info("replication").is_some_and(|r| {
                    r.get("connected_slaves").is_some_and(|v| v != "0")
                        && r.iter()
                            .any(|(k, v)| k.starts_with("slave") && v.contains("state=online"))
                })
            })
        })
    }

    /// The indexes of the running nodes that are primaries now.
    pub fn primaries(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].is_running() && self.nodes[i].is_primary() == Some(true))
            .collect()
    }

    /// The index of the node replicating node `primary` (from its `INFO replication`).
    pub fn replica_of(&self, primary: usize) -> Option<usize> {
        let port = self.nodes[primary].addr.port().to_string();
        (0..self.nodes.len()).find(|&i| {
            i != primary
                && self.nodes[i]
                    .info("replication")
                    .is_some_and(|r| r.get("master_port") == Some(&port))
        })
    }

    pub fn pids(&self) -> Vec<u32> {
        self.nodes.iter().flat_map(RedisNode::pids).collect()
    }

    /// The `[store]` table of a gateway on this cluster, two primaries as its seed nodes.
    pub fn store_toml(&self) -> String {
        let seeds: Vec<String> = self
            .primaries()
            .iter()
            .take(2)
            .map(|&i| format!("\"{}\"", self.nodes[i].url()))
            .collect();
        format!("backend = \"redis-cluster\"\nurls = [{}]", seeds.join(", "))
    }
}

/// A Sentinel set: one primary, one replica, three sentinels (quorum 2) watching them with
/// `down-after-milliseconds` 1000 and `failover-timeout` 3000.
pub struct SentinelSet {
    /// The primary and the replica, in the order they started (not their roles now).
    pub nodes: Vec<RedisNode>,
    pub sentinels: Vec<Proc>,
}

pub const MASTER_NAME: &str = "idemgate";

impl SentinelSet {
    pub fn start(dir: &Path) -> Result<SentinelSet, String> {
        let mut nodes = Vec::new();
        for i in 0..2 {
            let addr = free_addr();
            let d = dir.join(format!("sentinel-data-{}", addr.port()));
            std::fs::create_dir_all(&d).unwrap();
            let mut args = replicated_args(addr, &d);
            if i == 1 {
                let primary: &RedisNode = &nodes[0];
                args.extend(
                    ["--replicaof", "127.0.0.1", &primary.addr.port().to_string()]
                        .map(String::from),
                );
            }
            nodes.push(RedisNode::start(addr, args));
        }
        let primary = nodes[0].addr;
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            let addr = free_addr();
            let d = dir.join(format!("sentinel-{}", addr.port()));
            std::fs::create_dir_all(&d).unwrap();
            let conf = d.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "bind 127.0.0.1\nport {port}\ndir {dir}\nsentinel monitor {MASTER_NAME} 127.0.0.1 {pport} 2\nsentinel down-after-milliseconds {MASTER_NAME} 1000\nsentinel failover-timeout {MASTER_NAME} 3000\nsentinel parallel-syncs {MASTER_NAME} 1\n",
                    port = addr.port(),
                    dir = d.display(),
                    pport = primary.port(),
                ),
            )
            .unwrap();
            sentinels.push(spawn(
                "redis-sentinel",
                Command::new("redis-server").arg(&conf).arg("--sentinel"),
                addr,
            ));
        }
        let set = SentinelSet { nodes, sentinels };
        set.wait_healthy(30)?;
        Ok(set)
    }

    /// Until the replica is in sync and every sentinel knows the replica and the two other
    /// sentinels (they find each other through the primary, every 2 s).
    pub fn wait_healthy(&self, secs: u64) -> Result<(), String> {
        wait_until("the replica in sync", secs, || {
            self.nodes.iter().filter(|n| n.is_running()).any(|n| {
                n.info("replication")
                    .is_some_and(|r| r.get("master_link_status").is_some_and(|v| v == "up"))
            })
        })?;
        wait_until(
            "every sentinel knowing the replica and the others",
            secs,
            || {
                self.sentinels.iter().all(|s| {
                    let master: redis::RedisResult<Vec<String>> = query(
                        s.addr,
                        redis::cmd("SENTINEL").arg("MASTER").arg(MASTER_NAME),
                    );
                    master.is_ok_and(|kv| {
                        let get = |k: &str| {
                            kv.iter()
                                .position(|x| x == k)
                                .and_then(|i| kv.get(i + 1))
                                .map(String::as_str)
                        };
                        get("num-slaves") == Some("1") && get("num-other-sentinels") == Some("2")
                    })
                })
            },
        )
    }

    /// The primary's address as the first sentinel that answers tells it.
    pub fn primary_addr(&self) -> Option<SocketAddr> {
        self.sentinels.iter().find_map(|s| {
            let (host, port): (String, u16) = query(
                s.addr,
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(MASTER_NAME),
            )
            .ok()?;
            format!("{host}:{port}").parse().ok()
        })
    }

    /// The `[store]` table of a gateway on this set.
    pub fn store_toml(&self) -> String {
        let urls: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("\"redis://{}\"", s.addr))
            .collect();
        format!(
            "backend = \"redis-sentinel\"\nurls = [{}]\nmaster_name = \"{MASTER_NAME}\"",
            urls.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_children_by_their_parent_as_the_kernel_lists_them() {
        let mut sh = Command::new("sh")
            .args(["-c", "sleep 5 & sleep 5 & wait"])
            .spawn()
            .unwrap();
        let pid = sh.id();
        std::thread::sleep(Duration::from_millis(300));
        let mut by_ppid = children_by_ppid(pid);
        by_ppid.sort();
        assert_eq!(by_ppid.len(), 2, "{by_ppid:?}");
        if let Ok(listed) = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
            let mut listed: Vec<u32> = listed
                .split_whitespace()
                .map(|c| c.parse().unwrap())
                .collect();
            listed.sort();
            assert_eq!(by_ppid, listed);
        }
        for child in &by_ppid {
            let _ = Command::new("kill").arg(child.to_string()).status();
        }
        sh.wait().unwrap();
        assert!(cpu_ns(&[std::process::id()]) > 0);
    }
}

/// The cluster and Sentinel harness on its own (no gateway): start, kill -9 a primary, see the
/// failover, restart the node as a replica, see it in sync (a few seconds of failure detection
/// each).
#[cfg(test)]
mod failover_tests {
    use super::*;

    #[test]
    fn a_cluster_fails_over_and_takes_its_killed_primary_back_as_a_replica() {
        let dir = tempfile::tempdir().unwrap();
        let mut cluster = Cluster::start(dir.path(), 3).unwrap();
        assert_eq!(cluster.primaries().len(), 3);
        let key_slot_owner = cluster.primaries()[0];
        let replica = cluster.replica_of(key_slot_owner).unwrap();
        cluster.nodes[key_slot_owner].kill9();
        let t = Instant::now();
        wait_until("promoted", 30, || {
            cluster.nodes[replica].is_primary() == Some(true)
        })
        .unwrap();
        eprintln!("cluster failover after {:?}", t.elapsed());
        cluster.nodes[key_slot_owner].restart(&[]);
        cluster.wait_healthy(30).unwrap();
        assert_eq!(cluster.nodes[key_slot_owner].is_primary(), Some(false));
        assert_eq!(cluster.replica_of(replica), Some(key_slot_owner));
        eprintln!("cluster healthy again after {:?}", t.elapsed());
        // The harness's own queries leave no error reply behind (no CLIENT SETINFO on 7.0):
        // the one error is redis-cli's `CLUSTER REPLICATE` sent before the node knew its
        // primary, which it then sends again.
        let errors: String = cluster.nodes[replica]
            .query(redis::cmd("INFO").arg("errorstats"))
            .unwrap();
        let errors: Vec<&str> = errors
            .lines()
            .filter(|l| l.starts_with("errorstat_") && !l.starts_with("errorstat_ERR:count=1"))
            .collect();
        assert!(errors.is_empty(), "{errors:?}");
    }

    #[test]
    fn a_sentinel_set_fails_over_and_takes_its_killed_primary_back_as_a_replica() {
        let dir = tempfile::tempdir().unwrap();
        let mut set = SentinelSet::start(dir.path()).unwrap();
        let primary = set.primary_addr().unwrap();
        assert_eq!(primary, set.nodes[0].addr);
        let other = set.nodes[1].addr;
        set.nodes[0].kill9();
        let t = Instant::now();
        wait_until("failover", 30, || set.primary_addr() == Some(other)).unwrap();
        eprintln!("sentinel failover after {:?}", t.elapsed());
        set.nodes[0].restart(&[
            "--replicaof".into(),
            "127.0.0.1".into(),
            other.port().to_string(),
        ]);
        set.wait_healthy(30).unwrap();
        assert_eq!(set.nodes[0].is_primary(), Some(false));
        assert_eq!(set.nodes[1].is_primary(), Some(true));
        eprintln!("sentinel set healthy again after {:?}", t.elapsed());
    }
}
