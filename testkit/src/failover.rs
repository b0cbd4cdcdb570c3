//! A failover injected for real: a primary killed with SIGKILL, the store failing over, and the
//! killed node started again as a replica, as a supervisor (systemd, Kubernetes) would. Each step
//! is timed, so that a test can assert on what happens in between and the benchmark can print
//! when each was seen.
//!
//! ```ignore
//! let mut failover = Replicated::Sentinel(&set).kill9_primary(None).await;
//! let took = failover.wait_for_failover().await; // the sentinels name the replica
//! failover.restart_as_replica().await; // back as its replica, the set healthy again
//! ```
//!
//! Under load, the tests and the benchmark run it the same way: their clients from the start
//! until `stop`, and beside them the supervisor, step by step:
//!
//! ```ignore
//! let steps = Steps {
//!     under_way: async || wait_until(limit, "keys succeed", async || done() >= 20).await,
//!     failed_over: async || {}, // what to see before the restart
//!     recovered: async |run: &Supervision<'_>| wait_until(limit, "keys succeed again", ...).await,
//! };
//! let (seen, run) = store.under_load(Some("test:*"), clients, &stop, steps).await;
//! ```

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::FutureExt;

use crate::{RedisCluster, RedisSentinelSet};

/// A replicated store, whose primary a failover kills.
#[derive(Clone, Copy)]
pub enum Replicated<'a> {
    /// A Redis Cluster: one of its three primaries is killed.
    Cluster(&'a RedisCluster),
    /// A Sentinel set: its primary is killed.
    Sentinel(&'a RedisSentinelSet),
}

impl<'a> Replicated<'a> {
    /// SIGKILL a primary and start timing the failover. On a cluster, the primary that owns the
    /// slot of `redis_key`, or without one the first primary (the first seed a gateway is given);
    /// on a Sentinel set, the primary the sentinels name.
    pub async fn kill9_primary(self, redis_key: Option<&str>) -> Failover<'a> {
        let killed = match (self, redis_key) {
            (Replicated::Cluster(cluster), Some(key)) => cluster.kill9_primary_of(key).await,
            (Replicated::Cluster(cluster), None) => {
                let node = cluster.primaries().await[0];
                cluster.kill9(node);
                node
            }
            (Replicated::Sentinel(set), _) => set.kill9_primary().await,
        };
        Failover {
            store: self,
            killed,
            killed_at: Instant::now(),
            failed_over_at: None,
            restarted_at: None,
            healthy_at: None,
        }
    }

    /// SIGKILL a primary that holds records: on a cluster, the one that owns the first key
    /// matching `pattern` (`test:*`; there must be one); on a Sentinel set, its primary.
    pub async fn kill9_primary_holding(self, pattern: &str) -> Failover<'a> {
        let key = match self {
            Replicated::Cluster(cluster) => {
                let keys = cluster.keys(pattern).await;
                let (_, key) = keys.first().expect("records before the kill").clone();
                Some(key)
            }
            Replicated::Sentinel(_) => None,
        };
        self.kill9_primary(key.as_deref()).await
    }

    /// A failover under load: `clients` run from the start and stop once `stop` is set; beside
    /// them the supervisor waits until the load is [under way](Steps::under_way), kills a
    /// primary (the one [holding](Replicated::kill9_primary_holding) a key matching `victim`, or
    /// without one the [first](Replicated::kill9_primary)), waits for the failover, runs
    /// [`failed_over`](Steps::failed_over), starts the killed node again as a replica and waits
    /// until the store is healthy; then, once the load has [`recovered`](Steps::recovered), it
    /// sets `stop`. A step of the supervisor's that fails (panics) ends the supervision: its
    /// message is in [`Supervision::error`], and the load still runs until `recovered`.
    pub async fn under_load<T>(
        self,
        victim: Option<&str>,
        clients: impl Future<Output = T>,
        stop: &AtomicBool,
        mut steps: Steps<impl AsyncFnMut(), impl AsyncFnMut(), impl AsyncFnMut(&Supervision<'a>)>,
    ) -> (T, Supervision<'a>) {
        let supervisor = async {
            (steps.under_way)().await;
            let mut failover = None;
            let supervised = AssertUnwindSafe(async {
                let killed = match victim {
                    Some(pattern) => self.kill9_primary_holding(pattern).await,
                    None => self.kill9_primary(None).await,
                };
                let failover = failover.insert(killed);
                failover.wait_for_failover().await;
                (steps.failed_over)().await;
                failover.restart_as_replica().await;
            })
            .catch_unwind()
            .await;
            let supervision = Supervision {
                failover,
                error: supervised.err().map(|e| panic_text(&*e)),
            };
            (steps.recovered)(&supervision).await;
            stop.store(true, Ordering::SeqCst);
            supervision
        };
        tokio::join!(clients, supervisor)
    }

    /// The port of every node that holds data (all six of a cluster, both of a Sentinel set).
    pub fn data_ports(self) -> Vec<u16> {
        match self {
            Replicated::Cluster(cluster) => cluster.ports(),
            Replicated::Sentinel(set) => set.ports(),
        }
    }
}

/// One primary killed, and when each step of the recovery was seen.
pub struct Failover<'a> {
    store: Replicated<'a>,
    /// The node killed: its index in the cluster or among the set's data nodes.
    pub killed: usize,
    /// When it was killed.
    pub killed_at: Instant,
    /// When the store was seen failed over (see [`Failover::wait_for_failover`]).
    pub failed_over_at: Option<Instant>,
    /// When the killed node answered again, started as a replica.
    pub restarted_at: Option<Instant>,
    /// When the store was healthy again, the restarted node replicating.
    pub healthy_at: Option<Instant>,
}

impl Failover<'_> {
    /// The port of the killed node.
    pub fn killed_port(&self) -> u16 {
        self.store.data_ports()[self.killed]
    }

    /// Wait until the store has failed over: on a cluster, every node flags the killed one
    /// failing and three primaries own every slot; on a Sentinel set, every sentinel names the
    /// replica and it says it is the primary. Returns how long the wait took.
    pub async fn wait_for_failover(&mut self) -> Duration {
        let took = match self.store {
            Replicated::Cluster(cluster) => cluster.wait_for_failover(self.killed).await,
            Replicated::Sentinel(set) => set.wait_for_failover(self.killed).await,
        };
        self.failed_over_at = Some(Instant::now());
        took
    }

    /// The supervisor: start the killed node again as a replica of the promoted one (a cluster
    /// node with its `nodes.conf`, a Sentinel set's with `--replicaof`), and wait until the
    /// store is healthy again. Returns how long that took.
    pub async fn restart_as_replica(&mut self) -> Duration {
        let started = Instant::now();
        match self.store {
            Replicated::Cluster(cluster) => cluster.start_again(self.killed).await,
            Replicated::Sentinel(set) => set.start_as_replica(self.killed).await,
        }
        self.restarted_at = Some(Instant::now());
        match self.store {
            Replicated::Cluster(cluster) => cluster.wait_until_healthy().await,
            Replicated::Sentinel(set) => set.wait_until_healthy(None).await,
        };
        self.healthy_at = Some(Instant::now());
        started.elapsed()
    }
}

/// What the supervisor of [`Replicated::under_load`] waits for and does, step by step.
pub struct Steps<U, F, R> {
    /// Returns once the load is under way: the kill comes next.
    pub under_way: U,
    /// Runs once the store has failed over, before the killed node is started again (a test's
    /// look at the store without its old primary; `async || {}` for none).
    pub failed_over: F,
    /// Returns once the load has recovered, after the supervision (failed or not): the clients
    /// are stopped next.
    pub recovered: R,
}

/// What the supervisor of [`Replicated::under_load`] did.
pub struct Supervision<'a> {
    /// The failover, each step timed as it was seen; none when the kill itself failed.
    pub failover: Option<Failover<'a>>,
    /// The message of the step that failed (a fixture's panic), if one did.
    pub error: Option<String>,
}

/// A panic's message: what a fixture that failed says (caught to be reported, not to end a
/// benchmark run).
pub fn panic_text(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panicked".into())
}
