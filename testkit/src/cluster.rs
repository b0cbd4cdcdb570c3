//! A Redis Cluster and a Redis Sentinel set as child processes, for the `redis-cluster` and
//! `redis-sentinel` stores. Every process is killed on drop.
//!
//! ```ignore
//! let cluster = RedisCluster::start().await; // 3 primaries, 1 replica each
//! let killed = cluster.kill9_primary_of("test:{ab12}").await;
//! cluster.wait_for_failover(killed).await; // its replica now owns its slots
//! cluster.restart(killed).await; // back, as a replica of the promoted one
//!
//! let set = RedisSentinelSet::start().await; // 1 primary, 1 replica, 3 sentinels
//! let killed = set.kill9_primary().await;
//! set.wait_for_failover(killed).await; // the sentinels name the replica
//! set.restart_as_replica(killed).await; // what a supervisor does
//! ```
//!
//! Failover is quick by configuration, not by luck: `cluster-node-timeout 1000` and
//! `down-after-milliseconds 1000`; replicas sync at once (`repl-diskless-sync-delay 0`).
//!
//! Like [`RedisServer`](crate::RedisServer), every process also listens on a unix socket in its
//! own directory; that socket answering PING is how a start is known to be this process's (a
//! redis-server exits when it cannot bind its ports, including a cluster node's bus port).

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use redis::{FromRedisValue, IntoConnectionInfo};

use crate::process::ChildProcess;
use crate::redis::{run_server, socket_in, ATTEMPTS};
use crate::{free_port, wait_until};

/// How long a cluster or Sentinel set may take to settle (form, fail over, take a node back).
const SETTLE: Duration = Duration::from_secs(15);

/// How long one administrative command may take before the node counts as not answering.
const QUERY: Duration = Duration::from_secs(1);

/// The service name the sentinels monitor (`master_name` in the gateway's config).
pub const MASTER_NAME: &str = "idemgate";

/// A Redis Cluster of six nodes on loopback ports: three primaries with one replica each,
/// created by `redis-cli --cluster create`. A node is named by its index in `0..6`, which stays
/// the same across kills and restarts, whatever its role.
pub struct RedisCluster {
    nodes: Vec<Node>,
}

impl RedisCluster {
    /// Start six cluster-enabled redis-servers, join them (`--cluster-replicas 1`), and wait until
    /// the cluster is [healthy](RedisCluster::wait_until_healthy).
    pub async fn start() -> Self {
        let mut nodes = Vec::new();
        for _ in 0..6 {
            nodes.push(Node::start(Role::ClusterNode).await);
        }
        let cluster = RedisCluster { nodes };
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let out = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli must be installed (scripts/test installs redis-tools)");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.wait_until_healthy().await;
        cluster
    }

    /// `redis://127.0.0.1:PORT` of every node: the seeds (`store.urls`). A client needs only
    /// one that answers; the others are discovered.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Node::url).collect()
    }

    /// The port of node `node`.
    pub fn port(&self, node: usize) -> u16 {
        self.nodes[node].port
    }

    /// The port of every node, in the order of their indexes.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The process id of node `node`, while it runs (for its CPU time).
    pub fn pid(&self, node: usize) -> Option<u32> {
        self.nodes[node].pid()
    }

    /// The process ids of the running nodes.
    pub fn pids(&self) -> Vec<u32> {
        self.nodes.iter().filter_map(Node::pid).collect()
    }

    /// The nodes that own slots now, as a running node sees it (sorted).
    pub async fn primaries(&self) -> Vec<usize> {
        let view = self.view_from_any().await;
        let mut primaries: Vec<usize> = view
            .iter()
            .filter(|n| n.is_primary() && !n.failed() && !n.slots.is_empty())
            .map(|n| self.index_of(n.port))
            .collect();
        primaries.sort_unstable();
        primaries
    }

    /// The node that owns the slot of `redis_key` (`test:{ab12…}`) now.
    pub async fn primary_of(&self, redis_key: &str) -> usize {
        let node = self.any_running();
        let slot: u16 = node
            .query(redis::cmd("CLUSTER").arg("KEYSLOT").arg(redis_key))
            .await
            .expect("CLUSTER KEYSLOT");
        let view = self.view_from_any().await;
        let owner = view
            .iter()
            .find(|n| !n.failed() && n.slots.iter().any(|r| r.contains(&slot)))
            .unwrap_or_else(|| panic!("no node owns slot {slot}"));
        self.index_of(owner.port)
    }

    /// SIGKILL node `node` (no shutdown, nothing saved).
    pub fn kill9(&self, node: usize) {
        self.nodes[node].kill9();
    }

    /// SIGKILL the primary that owns the slot of `redis_key`; returns which node it was.
    pub async fn kill9_primary_of(&self, redis_key: &str) -> usize {
        let node = self.primary_of(redis_key).await;
        self.kill9(node);
        node
    }

    /// Wait until the cluster has failed over from the killed primary `killed`: every running
    /// node flags it `fail`, it owns no slot, and the cluster state is ok. Returns how long
    /// that took.
    pub async fn wait_for_failover(&self, killed: usize) -> Duration {
        let port = self.nodes[killed].port;
        let what = format!("the cluster has failed over from node {killed} (port {port})");
        settle(&what, self.describe(), async || {
            for node in self.running() {
                let Some((ok, view)) = node.cluster_state().await else {
                    return false;
                };
                let gone = view
                    .iter()
                    .any(|n| n.port == port && n.failed() && n.slots.is_empty());
                let covered = view
                    .iter()
                    .filter(|n| n.is_primary() && !n.failed() && !n.slots.is_empty())
                    .count()
                    == 3;
                if !(ok && gone && covered) {
                    return false;
                }
            }
            true
        })
        .await
    }

    /// Start the killed node `node` again with its directory and `nodes.conf`, as a supervisor
    /// would. A primary that was failed over from rejoins as a replica of the promoted one.
    /// Waits until the cluster is healthy again (the node's replication link is up); returns
    /// how long that took.
    pub async fn restart(&self, node: usize) -> Duration {
        let started = std::time::Instant::now();
        self.start_again(node).await;
        self.wait_until_healthy().await;
        started.elapsed()
    }

    /// Start the killed node `node` again with its directory and `nodes.conf`; returns once it
    /// answers, before it has rejoined.
    pub(crate) async fn start_again(&self, node: usize) {
        let n = &self.nodes[node];
        assert!(
            n.spawn(&Role::ClusterNode).await,
            "cluster node {node} did not come back on port {}",
            n.port
        );
    }

    /// Wait until all six nodes run and agree: cluster state ok, six nodes known, none flagged
    /// failing, three primaries owning every slot, each streaming to its replica.
    pub async fn wait_until_healthy(&self) -> Duration {
        settle("the cluster is healthy", self.describe(), async || {
            let mut roles = None;
            for node in &self.nodes {
                let Some((ok, view)) = node.cluster_state().await else {
                    return false;
                };
                let primaries = view
                    .iter()
                    .filter(|n| n.is_primary() && !n.slots.is_empty())
                    .count();
                let sound = ok
                    && view.len() == 6
                    && primaries == 3
                    && view.iter().all(|n| !n.failed() && !n.handshake());
                if !sound {
                    return false;
                }
                // Every node sees the same primaries and replicas.
                let mine: Vec<(u16, bool)> = {
                    let mut v: Vec<_> = view.iter().map(|n| (n.port, n.is_primary())).collect();
                    v.sort_unstable();
                    v
                };
                if roles.get_or_insert_with(|| mine.clone()) != &mine {
                    return false;
                }
                let me = view.iter().find(|n| n.myself).expect("myself");
                let replicating = if me.is_primary() {
                    node.online_replicas().await == 1
                } else {
                    node.replication_link_up().await
                };
                if !replicating {
                    return false;
                }
            }
            true
        })
        .await
    }

    /// Every key matching `pattern` on every primary, as (primary, key).
    pub async fn keys(&self, pattern: &str) -> Vec<(usize, String)> {
        let mut found = Vec::new();
        for primary in self.primaries().await {
            for key in self.nodes[primary].scan(pattern).await {
                found.push((primary, key));
            }
        }
        found
    }

    /// A cluster client over the seeds, for assertions.
    pub async fn connection(&self) -> redis::cluster_async::ClusterConnection {
        redis::cluster::ClusterClient::new(self.urls())
            .unwrap()
            .get_async_connection()
            .await
            .unwrap()
    }

    /// What every node says now: its cluster state and how it sees each node (for a failure
    /// message).
    async fn describe(&self) -> String {
        let mut out = String::new();
        for (i, node) in self.nodes.iter().enumerate() {
            if !node.running() {
                out += &format!("\n  node {i} (port {}): killed", node.port);
                continue;
            }
            match node.cluster_state().await {
                None => out += &format!("\n  node {i} (port {}): no answer", node.port),
                Some((ok, view)) => {
                    let state = if ok { "ok" } else { "not ok" };
                    out += &format!("\n  node {i} (port {}): {state}; sees", node.port);
                    for n in view {
                        out += &format!(" {}:{}", n.port, n.flags.join(","));
                    }
                }
            }
        }
        out
    }

    fn running(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|n| n.running())
    }

    fn any_running(&self) -> &Node {
        self.running().next().expect("a running cluster node")
    }

    /// `CLUSTER NODES` as the first running node that answers sees it.
    async fn view_from_any(&self) -> Vec<NodeLine> {
        for node in self.running() {
            if let Some((_, view)) = node.cluster_state().await {
                return view;
            }
        }
        panic!("no cluster node answers CLUSTER NODES");
    }

    fn index_of(&self, port: u16) -> usize {
        self.nodes
            .iter()
            .position(|n| n.port == port)
            .unwrap_or_else(|| panic!("no node on port {port}"))
    }
}

/// A Sentinel-monitored primary with one replica, and three sentinels (quorum 2) monitoring it
/// as [`MASTER_NAME`]. The two data nodes are named `0` (the first primary) and `1`.
pub struct RedisSentinelSet {
    data: Vec<Node>,
    sentinels: Vec<Node>,
}

impl RedisSentinelSet {
    /// Start the primary, its replica (`--replicaof`) and three sentinels, and wait until every
    /// sentinel knows the replica and the two other sentinels (a failover needs them).
    pub async fn start() -> Self {
        let primary = Node::start(Role::Data { replica_of: None }).await;
        let replica = Node::start(Role::Data {
            replica_of: Some(primary.port),
        })
        .await;
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            sentinels.push(
                Node::start(Role::Sentinel {
                    primary: primary.port,
                })
                .await,
            );
        }
        let set = RedisSentinelSet {
            data: vec![primary, replica],
            sentinels,
        };
        set.wait_until_healthy(Some(0)).await;
        set
    }

    /// `redis://127.0.0.1:PORT` of every sentinel (`store.urls`).
    pub fn urls(&self) -> Vec<String> {
        self.sentinels.iter().map(Node::url).collect()
    }

    /// `redis://127.0.0.1:PORT` of data node `node`.
    pub fn url(&self, node: usize) -> String {
        self.data[node].url()
    }

    /// The port of each data node: `0` (the first primary), then `1`.
    pub fn ports(&self) -> Vec<u16> {
        self.data.iter().map(|n| n.port).collect()
    }

    /// The process ids of the running data nodes.
    pub fn pids(&self) -> Vec<u32> {
        self.data.iter().filter_map(Node::pid).collect()
    }

    /// The data node the sentinels name as the primary now (the first sentinel that answers).
    pub async fn primary(&self) -> usize {
        for sentinel in self.sentinels.iter() {
            if let Some(port) = sentinel.primary_port().await {
                return self.index_of(port);
            }
        }
        panic!("no sentinel names a primary");
    }

    /// SIGKILL data node `node`.
    pub fn kill9(&self, node: usize) {
        self.data[node].kill9();
    }

    /// SIGKILL the current primary; returns which node it was.
    pub async fn kill9_primary(&self) -> usize {
        let node = self.primary().await;
        self.kill9(node);
        node
    }

    /// Wait until every sentinel names the other data node as the primary, and that node says it
    /// is one. Returns how long that took.
    pub async fn wait_for_failover(&self, killed: usize) -> Duration {
        let promoted = 1 - killed;
        let port = self.data[promoted].port;
        let what = format!("the sentinels promoted node {promoted} (port {port})");
        settle(&what, self.describe(), async || {
            for sentinel in &self.sentinels {
                if sentinel.primary_port().await != Some(port) {
                    return false;
                }
            }
            self.data[promoted].role().await.as_deref() == Some("master")
        })
        .await
    }

    /// Start the killed data node `node` again as a replica of the current primary, as a
    /// supervisor does (`--replicaof HOST PORT`). Waits until its replication link is up and
    /// the primary counts it; returns how long that took.
    pub async fn restart_as_replica(&self, node: usize) -> Duration {
        let started = std::time::Instant::now();
        self.start_as_replica(node).await;
        self.wait_until_healthy(None).await;
        started.elapsed()
    }

    /// Start the killed data node `node` again with `--replicaof` the other one; returns once it
    /// answers, before its replication link is up.
    pub(crate) async fn start_as_replica(&self, node: usize) {
        let primary = self.data[1 - node].port;
        let n = &self.data[node];
        let role = Role::Data {
            replica_of: Some(primary),
        };
        assert!(
            n.spawn(&role).await,
            "redis-server {node} did not come back on port {}",
            n.port
        );
    }

    /// Wait until data node `primary` (or, with `None`, whichever the sentinels name: a loaded
    /// machine can make them fail over once more) is the primary streaming to the other one, and
    /// every sentinel names it, knows a replica and the two other sentinels.
    pub(crate) async fn wait_until_healthy(&self, primary: Option<usize>) -> Duration {
        settle("the Sentinel set is healthy", self.describe(), async || {
            let mut named = None;
            for sentinel in &self.sentinels {
                let Ok(fields) = sentinel
                    .query::<HashMap<String, String>>(
                        redis::cmd("SENTINEL").arg("MASTER").arg(MASTER_NAME),
                    )
                    .await
                else {
                    return false;
                };
                let field = |name: &str| fields.get(name).map(String::as_str);
                let port = field("port").and_then(|p| p.parse::<u16>().ok());
                if *named.get_or_insert(port) != port {
                    return false;
                }
                let sound = field("flags") == Some("master")
                    && field("num-other-sentinels") == Some("2")
                    && field("num-slaves").is_some_and(|n| n != "0");
                if !sound {
                    return false;
                }
            }
            let Some(primary) = self
                .data
                .iter()
                .position(|d| Some(Some(d.port)) == named)
                .filter(|p| primary.is_none_or(|wanted| wanted == *p))
            else {
                return false;
            };
            let (p, r) = (&self.data[primary], &self.data[1 - primary]);
            p.role().await.as_deref() == Some("master")
                && p.online_replicas().await == 1
                && r.replication_link_up().await
        })
        .await
    }

    /// What the sentinels and the data nodes say now (for a failure message).
    async fn describe(&self) -> String {
        let mut out = String::new();
        for sentinel in &self.sentinels {
            let fields = sentinel
                .query::<HashMap<String, String>>(
                    redis::cmd("SENTINEL").arg("MASTER").arg(MASTER_NAME),
                )
                .await
                .unwrap_or_default();
            let field = |name: &str| fields.get(name).map_or("?", String::as_str);
            out += &format!(
                "\n  sentinel {}: primary {} ({}), {} other sentinels, {} replicas",
                sentinel.port,
                field("port"),
                field("flags"),
                field("num-other-sentinels"),
                field("num-slaves")
            );
        }
        for (i, node) in self.data.iter().enumerate() {
            out += &format!(
                "\n  node {i} (port {}): {:?}, link {}, {} online replicas",
                node.port,
                node.role().await,
                node.replication_link_up().await,
                node.online_replicas().await
            );
        }
        out
    }

    fn index_of(&self, port: u16) -> usize {
        self.data
            .iter()
            .position(|n| n.port == port)
            .unwrap_or_else(|| panic!("no data node on port {port}"))
    }
}

/// What a [`Node`] runs as; decides its arguments at each (re)start.
enum Role {
    /// A cluster-enabled redis-server (its bus on a port of its own).
    ClusterNode,
    /// A plain redis-server, replicating from the port given.
    Data { replica_of: Option<u16> },
    /// A sentinel monitoring the primary on the port given (at its first start; a sentinel keeps
    /// what it learns in its `sentinel.conf`).
    Sentinel { primary: u16 },
}

/// One redis-server process in its own temporary directory, on a port (and for a cluster node
/// a bus port) of its own; killed on drop.
struct Node {
    /// The process; first, so that it is killed before its directory goes.
    child: ChildProcess,
    port: u16,
    bus_port: u16,
    dir: tempfile::TempDir,
}

impl Node {
    /// Start as `role` on free ports.
    async fn start(role: Role) -> Self {
        for _ in 0..ATTEMPTS {
            let node = Node {
                child: ChildProcess::none(),
                port: free_port(),
                bus_port: free_port(),
                dir: tempfile::tempdir().unwrap(),
            };
            if node.spawn(&role).await {
                return node;
            }
        }
        panic!("redis-server did not start on any of {ATTEMPTS} free ports");
    }

    /// Start the process and wait until it answers; `false` when it exited first.
    async fn spawn(&self, role: &Role) -> bool {
        let dir = self.dir.path();
        let mut cmd = Command::new("redis-server");
        match role {
            Role::Sentinel { primary } => {
                let conf = dir.join("sentinel.conf");
                // A restarted sentinel keeps what it wrote to its file.
                if !conf.exists() {
                    std::fs::write(
                        &conf,
                        format!(
                            "port {port}\nbind 127.0.0.1\ndir {dir}\nunixsocket {socket}\n\
                             sentinel resolve-hostnames no\n\
                             sentinel monitor {MASTER_NAME} 127.0.0.1 {primary} 2\n\
                             sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
                             sentinel failover-timeout {MASTER_NAME} 3000\n",
                            port = self.port,
                            dir = dir.display(),
                            socket = socket_in(dir).display(),
                        ),
                    )
                    .unwrap();
                }
                cmd.arg(&conf).arg("--sentinel");
            }
            Role::ClusterNode | Role::Data { .. } => {
                cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
                    .arg("--unixsocket")
                    .arg(socket_in(dir))
                    .arg("--dir")
                    .arg(dir)
                    .args(["--save", "", "--appendonly", "no"])
                    .args(["--maxmemory-policy", "noeviction"])
                    .args(["--repl-diskless-sync", "yes"])
                    .args(["--repl-diskless-sync-delay", "0"]);
            }
        }
        match role {
            Role::ClusterNode => {
                cmd.args(["--cluster-enabled", "yes"])
                    .args(["--cluster-config-file", "nodes.conf"])
                    .args(["--cluster-port", &self.bus_port.to_string()])
                    .args(["--cluster-node-timeout", "1000"])
                    // A replica takes over however long its link was down.
                    .args(["--cluster-replica-validity-factor", "0"]);
            }
            Role::Data {
                replica_of: Some(primary),
            } => {
                cmd.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
            }
            _ => {}
        }
        run_server(&mut cmd, &self.child, dir).await
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn running(&self) -> bool {
        self.child.held()
    }

    fn pid(&self) -> Option<u32> {
        self.child.pid()
    }

    fn kill9(&self) {
        self.child.kill9();
    }

    /// One command on a fresh connection (see [`query`]).
    async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        query(self.port, cmd).await
    }

    /// Field `name` of `INFO section`.
    async fn info(&self, section: &str, name: &str) -> Option<String> {
        let info: String = self.query(redis::cmd("INFO").arg(section)).await.ok()?;
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    }

    /// `master` or `slave`, from `INFO replication`.
    async fn role(&self) -> Option<String> {
        self.info("replication", "role").await
    }

    /// Whether this replica's link to its primary is up.
    async fn replication_link_up(&self) -> bool {
        self.info("replication", "master_link_status")
            .await
            .as_deref()
            == Some("up")
    }

    /// How many replicas this primary streams to (`state=online` in `INFO replication`: synced,
    /// and counted by `WAIT`).
    async fn online_replicas(&self) -> usize {
        let Ok(info) = self
            .query::<String>(redis::cmd("INFO").arg("replication"))
            .await
        else {
            return 0;
        };
        info.lines()
            .filter(|l| l.starts_with("slave") && l.contains("state=online"))
            .count()
    }

    /// Whether `CLUSTER INFO` says the state is ok, and `CLUSTER NODES`; `None` when the node
    /// does not answer.
    async fn cluster_state(&self) -> Option<(bool, Vec<NodeLine>)> {
        let info: String = self.query(redis::cmd("CLUSTER").arg("INFO")).await.ok()?;
        let nodes: String = self.query(redis::cmd("CLUSTER").arg("NODES")).await.ok()?;
        let ok = info.lines().any(|l| l.trim() == "cluster_state:ok");
        Some((ok, nodes.lines().filter_map(NodeLine::parse).collect()))
    }

    /// For a sentinel: the port of the primary it names.
    async fn primary_port(&self) -> Option<u16> {
        let (_host, port): (String, String) = self
            .query(
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(MASTER_NAME),
            )
            .await
            .ok()?;
        port.parse().ok()
    }

    /// Every key matching `pattern` (SCAN, never KEYS).
    async fn scan(&self, pattern: &str) -> Vec<String> {
        let mut keys = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = self
                .query(
                    redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(pattern)
                        .arg("COUNT")
                        .arg(1000),
                )
                .await
                .expect("SCAN");
            keys.extend(batch);
            if next == 0 {
                return keys;
            }
            cursor = next;
        }
    }
}

/// One line of `CLUSTER NODES`:
/// `<id> <ip:port@cport> <flags> <primary id|-> <ping> <pong> <epoch> <link> <slot ranges…>`.
struct NodeLine {
    port: u16,
    myself: bool,
    flags: Vec<String>,
    slots: Vec<std::ops::RangeInclusive<u16>>,
}

impl NodeLine {
    fn parse(line: &str) -> Option<Self> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let addr = fields.get(1)?;
        let port = addr
            .split(['@', ','])
            .next()?
            .rsplit_once(':')?
            .1
            .parse()
            .ok()?;
        let flags: Vec<String> = fields.get(2)?.split(',').map(str::to_string).collect();
        let slots = fields
            .iter()
            .skip(8)
            // `[slot->-id]` marks a slot being migrated: not owned yet.
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((a, b)) => Some(a.parse().ok()?..=b.parse().ok()?),
                None => {
                    let slot = s.parse().ok()?;
                    Some(slot..=slot)
                }
            })
            .collect();
        Some(NodeLine {
            port,
            myself: flags.iter().any(|f| f == "myself"),
            flags,
            slots,
        })
    }

    fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    fn is_primary(&self) -> bool {
        self.has("master")
    }

    /// Flagged failing by this node (`fail?`) or by the cluster (`fail`).
    fn failed(&self) -> bool {
        self.has("fail") || self.has("fail?")
    }

    fn handshake(&self) -> bool {
        self.has("handshake") || self.has("noaddr")
    }
}

/// One command to the node on `127.0.0.1:port`, on a fresh connection; an error when it does not
/// answer within `QUERY`. Without the client's `CLIENT SETINFO`, which Redis 7.0 answers with an
/// error that would count in the node's `INFO errorstats`.
pub async fn query<T: FromRedisValue>(port: u16, cmd: &redis::Cmd) -> redis::RedisResult<T> {
    let info = format!("redis://127.0.0.1:{port}").into_connection_info()?;
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    let client = redis::Client::open(info.set_redis_settings(settings))?;
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(QUERY))
        .set_response_timeout(Some(QUERY));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    cmd.query_async(&mut conn).await
}

/// Wait until `condition` holds, for at most [`SETTLE`]; when it does not, the panic says what
/// `describe` finds then.
async fn settle(
    what: &str,
    describe: impl std::future::Future<Output = String>,
    condition: impl AsyncFnMut() -> bool,
) -> Duration {
    match tokio::time::timeout(SETTLE, wait_until(2 * SETTLE, what, condition)).await {
        Ok(took) => took,
        Err(_) => panic!("{what}: not within {SETTLE:?}; now:{}", describe.await),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RedisServer;

    /// The fixtures' own queries leave no error reply behind (no `CLIENT SETINFO`, which Redis
    /// 7.0 refuses): the benchmark counts every error reply of the nodes as the gateways' doing.
    #[tokio::test]
    async fn queries_leave_no_error_reply_behind() {
        let redis = RedisServer::start().await;
        for _ in 0..3 {
            let _: String = query(redis.port, redis::cmd("INFO").arg("replication"))
                .await
                .unwrap();
        }
        let errors: String = query(redis.port, redis::cmd("INFO").arg("errorstats"))
            .await
            .unwrap();
        let errors: Vec<&str> = errors
            .lines()
            .filter(|l| l.starts_with("errorstat_"))
            .collect();
        assert!(errors.is_empty(), "{errors:?}");
    }
}
