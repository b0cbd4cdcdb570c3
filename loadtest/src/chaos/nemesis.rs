//! The system under test (a store and the gateway processes on it) and the nemesis: faults
//! drawn from the seed one after another, each undone before the next.
//!
//! | backend       | gateways | faults |
//! |---------------|----------|--------|
//! | memory        | 1        | the gateway paused (SIGSTOP, SIGCONT) |
//! | embedded      | 1        | `kill -9` of the gateway and a start on the same file; the disk full |
//! | redis         | 3        | `kill -9` of a gateway; Redis killed and started again on its AOF (`appendfsync always`); Redis paused |
//! | redis-cluster | 3        | `kill -9` of a gateway; `kill -9` of a primary, its replica promoted (`wait_replicas = 1`) and the node back as a replica |
//! | postgres      | 3        | `kill -9` of a gateway; PostgreSQL restarted `-m immediate`; PostgreSQL paused (the postmaster and its backends) |
//!
//! The memory store is never killed: a killed memory gateway loses its records by design.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use testkit::{
    panic_text, GatewayConfig, GatewayProcess, PostgresServer, RedisCluster, RedisServer, Tmpfs,
};

use super::check::{Fault, Process};
use super::Regime;
use crate::procs::gateway_bin;

/// The stores a chaos run can be on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Embedded,
    Redis,
    Cluster,
    Postgres,
}

impl Backend {
    pub const ALL: [Backend; 5] = [
        Backend::Memory,
        Backend::Embedded,
        Backend::Redis,
        Backend::Cluster,
        Backend::Postgres,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Embedded => "embedded",
            Backend::Redis => "redis",
            Backend::Cluster => "redis-cluster",
            Backend::Postgres => "postgres",
        }
    }

    pub fn parse(name: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.name() == name)
    }

    /// Gateway processes on one store: one for the stores of one process.
    pub fn gateways(self) -> usize {
        match self {
            Backend::Memory | Backend::Embedded => 1,
            Backend::Redis | Backend::Cluster | Backend::Postgres => 3,
        }
    }

    /// The faults the nemesis draws from.
    fn faults(self) -> &'static [Kind] {
        match self {
            Backend::Memory => &[Kind::PauseGateway, Kind::Reload],
            Backend::Embedded => &[Kind::KillGateway, Kind::DiskFull, Kind::Reload],
            Backend::Redis | Backend::Postgres => &[
                Kind::KillGateway,
                Kind::RestartStore,
                Kind::PauseStore,
                Kind::Reload,
            ],
            Backend::Cluster => &[Kind::KillGateway, Kind::FailOver, Kind::Reload],
        }
    }
}

/// A fault the nemesis injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    KillGateway,
    PauseGateway,
    RestartStore,
    PauseStore,
    FailOver,
    DiskFull,
    /// A SIGHUP with the config file rewritten: a new route table and upstream set put in force
    /// under load (or, one time in four, a change only a restart can make, refused). Excuses
    /// nothing: every call keeps its promise across it.
    Reload,
}

impl Kind {
    /// Whether the store is what the fault takes away (not a gateway process).
    fn hits_store(self) -> bool {
        !matches!(self, Kind::KillGateway | Kind::PauseGateway | Kind::Reload)
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::KillGateway => "kill -9 gateway",
            Kind::PauseGateway => "pause gateway",
            Kind::RestartStore => "restart store",
            Kind::PauseStore => "pause store",
            Kind::FailOver => "fail over primary",
            Kind::DiskFull => "disk full",
            Kind::Reload => "reload (SIGHUP)",
        }
    }
}

/// The server behind the gateways.
enum Store {
    Memory,
    Embedded(Tmpfs),
    Redis(RedisServer),
    Cluster(RedisCluster),
    Postgres(PostgresServer),
}

impl Store {
    async fn start(backend: Backend) -> Store {
        match backend {
            Backend::Memory => Store::Memory,
            // Room for every record of a long run, and little enough to fill in a moment.
            Backend::Embedded => Store::Embedded(Tmpfs::mount("256m").await),
            Backend::Redis => Store::Redis(RedisServer::start_durable().await),
            Backend::Cluster => Store::Cluster(RedisCluster::start().await),
            Backend::Postgres => Store::Postgres(PostgresServer::start().await),
        }
    }

    /// `config` on this store.
    fn config(&self, config: GatewayConfig) -> GatewayConfig {
        match self {
            Store::Memory => config,
            Store::Embedded(disk) => config
                .embedded(&disk.path().join("store"))
                .set("store.fsync", true),
            Store::Redis(redis) => config.redis_url(&redis.url()).prefix("chaos:"),
            Store::Cluster(cluster) => config
                .redis_cluster_seeds(cluster.urls())
                .prefix("chaos:")
                .set("store.wait_replicas", 1),
            Store::Postgres(pg) => config.postgres(pg),
        }
    }
}

/// A store and its gateway processes, with what became of each process.
pub struct System {
    pub backend: Backend,
    regime: Regime,
    store: Store,
    upstream: std::net::SocketAddr,
    gateways: Vec<GatewayProcess>,
    /// The incarnation each slot runs now (shared with the clients).
    pub incarnations: Arc<[AtomicU32]>,
    /// Every process started, by incarnation number.
    processes: Vec<Process>,
    start: Instant,
    /// Harness failures (a fixture that did not come back, a scrape that failed).
    pub errors: Vec<String>,
}

impl System {
    /// The store and its gateways, each logging to `dir`.
    pub async fn start(
        backend: Backend,
        regime: Regime,
        upstream: std::net::SocketAddr,
        dir: &Path,
        start: Instant,
    ) -> System {
        let store = Store::start(backend).await;
        let mut system = System {
            backend,
            regime,
            store,
            upstream,
            gateways: Vec::new(),
            incarnations: (0..backend.gateways()).map(|_| AtomicU32::new(0)).collect(),
            processes: Vec::new(),
            start,
            errors: Vec::new(),
        };
        for slot in 0..backend.gateways() {
            let id = system.new_process(slot);
            let mut launch = GatewayProcess::binary(gateway_bin())
                .env("RUST_LOG", "info")
                .env("NO_COLOR", "1")
                .log_to(&log_file(dir, slot));
            if let Store::Embedded(disk) = &system.store {
                launch = launch.via(&disk.enter());
            }
            let gateway = launch.start(&system.config(id)).await;
            gateway.wait_for_admin(ADMIN).await;
            system.gateways.push(gateway);
        }
        system
    }

    /// The config of incarnation `id`: its upstream path names it.
    fn config(&self, id: u32) -> GatewayConfig {
        let r = self.regime;
        let config = GatewayConfig::new()
            .upstream(&format!("http://{}/p{id}", self.upstream))
            .set("shutdown_grace", "2s")
            .set("defaults.methods", vec!["POST"])
            .set("defaults.lock_ttl", format!("{}ms", r.lease.as_millis()))
            .set(
                "defaults.upstream_timeout",
                format!("{}ms", r.upstream_timeout.as_millis()),
            )
            .route(
                super::client::HOOKS,
                toml::toml! { webhook = "stripe" webhook_secret_env = "CHAOS_WEBHOOK_SECRET" },
            )
            .route(
                super::client::RPC,
                toml::toml! { protocol = "jsonrpc" keyed_methods = ["tools/call"] },
            )
            .env("CHAOS_WEBHOOK_SECRET", crate::load::WEBHOOK_SECRET)
            .admin();
        self.store.config(config)
    }

    /// A new incarnation for `slot`; its number.
    fn new_process(&mut self, slot: usize) -> u32 {
        let id = self.processes.len() as u32;
        self.processes.push(Process {
            id,
            killed: None,
            unsettled: 0,
        });
        self.incarnations[slot].store(id, Ordering::SeqCst);
        id
    }

    pub fn addrs(&self) -> Vec<std::net::SocketAddr> {
        self.gateways.iter().map(GatewayProcess::addr).collect()
    }

    /// Faults drawn from `rng`, one after another with a pause between, until `until`; each
    /// undone before the next. Returns when the last is over.
    pub async fn nemesis(&mut self, until: Instant, rng: &mut fastrand::Rng) -> Vec<Fault> {
        let mut faults = Vec::new();
        let kinds = self.backend.faults();
        tokio::time::sleep(Duration::from_secs(1)).await;
        while Instant::now() < until && self.errors.is_empty() {
            let kind = kinds[rng.usize(..kinds.len())];
            let start = self.start.elapsed();
            let injected = AssertUnwindSafe(self.inject(kind, rng))
                .catch_unwind()
                .await;
            if let Err(e) = injected {
                self.errors
                    .push(format!("{}: {}", kind.name(), panic_text(&*e)));
            }
            faults.push(Fault {
                kind: kind.name(),
                store: kind.hits_store(),
                start,
                end: self.start.elapsed(),
            });
            let gap = Duration::from_millis(rng.u64(500..2500));
            tokio::time::sleep(gap.min(until.saturating_duration_since(Instant::now()))).await;
        }
        faults
    }

    /// Inject one fault of `kind`, and undo it.
    async fn inject(&mut self, kind: Kind, rng: &mut fastrand::Rng) {
        let r = self.regime;
        let stall = r.stall.0 + (r.stall.1 - r.stall.0).mul_f64(rng.f64());
        match (kind, &self.store) {
            (Kind::KillGateway, _) => {
                let slot = rng.usize(..self.gateways.len());
                let down = r.down.0 + (r.down.1 - r.down.0).mul_f64(rng.f64());
                self.kill9(slot);
                tokio::time::sleep(down).await;
                let id = self.new_process(slot);
                let config = self.config(id);
                self.gateways[slot].start_again(&config).await;
                // Its count can be read before it is killed again.
                self.gateways[slot].wait_for_admin(ADMIN).await;
            }
            (Kind::PauseGateway, _) => {
                let slot = rng.usize(..self.gateways.len());
                self.gateways[slot].pause();
                tokio::time::sleep(stall).await;
                self.gateways[slot].resume();
            }
            (Kind::RestartStore, Store::Redis(redis)) => redis.restart().await,
            // The server is waited for with psql, which blocks: this thread only.
            (Kind::RestartStore, Store::Postgres(pg)) => tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(pg.restart_immediate())
            }),
            (Kind::PauseStore, Store::Redis(redis)) => {
                redis.pause();
                tokio::time::sleep(stall).await;
                redis.resume();
            }
            (Kind::PauseStore, Store::Postgres(pg)) => {
                pg.pause();
                tokio::time::sleep(stall).await;
                pg.resume();
            }
            (Kind::FailOver, Store::Cluster(cluster)) => {
                let primaries = cluster.primaries().await;
                let node = primaries[rng.usize(..primaries.len())];
                cluster.kill9(node);
                // The node comes back empty (the cluster's nodes keep nothing on disk): started
                // again before its replica took over, it would own its slots with none of their
                // records. A loaded machine gets 60 s for the failover; past that the node is
                // started all the same and the run's verdict is void.
                let mut seen = AssertUnwindSafe(cluster.wait_for_failover(node))
                    .catch_unwind()
                    .await;
                for _ in 0..3 {
                    if seen.is_ok() {
                        break;
                    }
                    seen = AssertUnwindSafe(cluster.wait_for_failover(node))
                        .catch_unwind()
                        .await;
                }
                // A loaded machine can take longer than the fixture's 15 s to heal: 60 s in all.
                let mut healed = AssertUnwindSafe(cluster.restart(node)).catch_unwind().await;
                for _ in 0..3 {
                    if healed.is_ok() {
                        break;
                    }
                    healed = AssertUnwindSafe(cluster.wait_until_healthy())
                        .catch_unwind()
                        .await;
                }
                if let Err(e) = healed {
                    std::panic::resume_unwind(e);
                }
                if let Err(e) = seen {
                    self.errors.push(format!(
                        "at {:.1} s: {}, in 60 s; the node was started again without its replica taking over, empty: the records of its slots are lost by design and this run judges nothing",
                        self.start.elapsed().as_secs_f64(),
                        panic_text(&*e).lines().next().unwrap_or_default()
                    ));
                }
            }
            (Kind::DiskFull, Store::Embedded(disk)) => {
                tokio::task::block_in_place(|| disk.fill());
                tokio::time::sleep(stall).await;
                disk.free();
            }
            (Kind::Reload, _) => {
                let slot = rng.usize(..self.gateways.len());
                // The incarnation it runs: the upstream path that names it stays.
                let id = self.incarnations[slot].load(Ordering::SeqCst);
                let config = match rng.u8(..4) {
                    // The running process has one worker per core: another count is refused.
                    0 => self.config(id).set("workers", (cores() + 1) as i64),
                    1 => self.config(id),
                    _ => self.config(id).route(
                        "/chaos/reloaded",
                        toml::toml! { ttl = "1m" require_key = true },
                    ),
                };
                let reloads = "idemgate_config_reloads_total";
                let gateway = &self.gateways[slot];
                let before = gateway.metric_sum(reloads).await.unwrap_or(f64::NAN);
                gateway.reload(&config);
                // Applied or refused, the process counts it: a signal it never took is a fault
                // of the harness (or of the reload), and the run judges nothing.
                let counted = tokio::time::timeout(Duration::from_secs(10), async {
                    while gateway.metric_sum(reloads).await.unwrap_or(before) <= before {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                });
                if counted.await.is_err() {
                    let at = self.start.elapsed().as_secs_f64();
                    self.errors.push(format!(
                        "at {at:.1} s: a reload of gateway {slot} was not counted in 10 s"
                    ));
                }
            }
            (kind, _) => panic!("{} is not a fault of {}", kind.name(), self.backend.name()),
        }
    }

    /// `kill -9` the gateway in `slot`, its unsettled calls read at once before, nothing
    /// scheduled in between (a count made after the read would be lost with the process).
    fn kill9(&mut self, slot: usize) {
        let id = self.incarnations[slot].load(Ordering::SeqCst) as usize;
        let gateway = &mut self.gateways[slot];
        let counted = tokio::task::block_in_place(|| gateway.kill9_counting(UNSETTLED));
        let (unsettled, killed) = counted.unwrap_or_else(|e| {
            self.errors
                .push(format!("p{id}: {UNSETTLED} unread before its kill: {e}"));
            let killed = Instant::now();
            gateway.kill9();
            (0.0, killed)
        });
        let p = &mut self.processes[id];
        p.killed = Some(killed.saturating_duration_since(self.start));
        p.unsettled = unsettled as u64;
    }

    /// The unsettled calls the gateway in `slot` counted (every reason).
    async fn unsettled(&mut self, slot: usize) -> u64 {
        let id = self.incarnations[slot].load(Ordering::SeqCst);
        match self.gateways[slot].metric_sum(UNSETTLED).await {
            Ok(n) => n as u64,
            Err(e) => {
                self.errors.push(format!("p{id}: {UNSETTLED} unread: {e}"));
                0
            }
        }
    }

    /// At the end: every running process's unsettled calls, and the processes that ended by
    /// themselves (a crash the nemesis did not cause).
    pub async fn finish(&mut self) -> (Vec<Process>, Vec<String>) {
        let mut crashed = Vec::new();
        for slot in 0..self.gateways.len() {
            let id = self.incarnations[slot].load(Ordering::SeqCst) as usize;
            if !self.gateways[slot].running() {
                crashed.push(format!(
                    "p{id} ({} gateway {slot}) exited by itself",
                    self.backend.name()
                ));
                continue;
            }
            self.processes[id].unsettled = self.unsettled(slot).await;
        }
        (self.processes.clone(), crashed)
    }
}

/// The gateway's count of calls whose outcome it does not know, every `reason` summed.
const UNSETTLED: &str = "idemgate_calls_unsettled_total";

/// How long a gateway's admin listener may take to answer after a start (its store opened).
const ADMIN: Duration = Duration::from_secs(30);

/// Where gateway `slot` logs (every incarnation's after the last).
pub fn log_file(dir: &Path, slot: usize) -> PathBuf {
    dir.join(format!("gateway-{slot}.log"))
}

/// The cores of this machine: a gateway without `workers` runs one worker per core.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
