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

use std::time::{Duration, Instant};

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

    /// [`Failover::wait_for_failover`], then [`Failover::restart_as_replica`].
    pub async fn supervise(&mut self) {
        self.wait_for_failover().await;
        self.restart_as_replica().await;
    }
}
