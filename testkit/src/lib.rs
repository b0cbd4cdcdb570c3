//! Fixtures shared by idemgate's integration tests (`tests/`) and its benchmark (`loadtest/`):
//! real processes on real sockets, each killed when its handle drops.
//!
//! ```ignore
//! let redis = RedisServer::start().await;
//! redis.kill();
//! redis.restart().await;
//!
//! let cluster = RedisCluster::start().await; // 3 primaries, 1 replica each
//! let mut failover = Replicated::Cluster(&cluster).kill9_primary(None).await;
//! failover.wait_for_failover().await; // its replica owns its slots
//! failover.restart_as_replica().await; // back, and the cluster healthy again
//!
//! let config = GatewayConfig::new().upstream(&url).redis_cluster(&cluster).admin();
//! let gateway = GatewayProcess::binary(path).start(&config).await;
//! let text = metrics::scrape(gateway.admin()).await?;
//! ```
//!
//! # Layout
//! - [`redis`]: [`RedisServer`], a redis-server that can be `kill()`ed, `pause()`d, `resume()`d
//!   and `restart()`ed; [`TlsRedisServer`], one that speaks only TLS; [`Backend`].
//! - [`cluster`]: [`RedisCluster`] (three primaries, one replica each) and [`RedisSentinelSet`]
//!   (a primary, a replica, three sentinels), and [`query`], one command to a node.
//! - [`config`]: [`GatewayConfig`], the gateway's config built in code and rendered to TOML.
//! - [`failover`]: [`Replicated`] and [`Failover`], a primary killed with SIGKILL and the store's
//!   recovery driven as a supervisor would, each step timed; [`Replicated::under_load`], the
//!   failover under load the tests and the benchmark run.
//! - [`gateway`]: [`GatewayProcess`], the `idemgate` binary as child processes on ports each keeps
//!   across `kill9()` and `start_again()`, `pause()`d and `resume()`d, its metrics scraped.
//! - [`metrics`]: a gateway's `/metrics` ([`metrics::scrape`], [`metrics::sum_of`]) and a
//!   Redis's `INFO` counters ([`metrics::commandstats`], [`metrics::per_request`]).
//! - [`postgres`]: [`PostgresServer`], a private PostgreSQL server (`initdb` on a free port) that
//!   can be `stop()`ped, `kill()`ed, started again, `restart()`ed and `restart_immediate()`d.
//! - [`ports`]: [`free_port`], [`free_addr`] and [`ReservedPort`].
//! - [`process`]: what every fixture's child process shares (held, signalled, killed on drop),
//!   and [`process::children`], the processes one started.
//! - [`python`]: [`PythonEnv`], a Python virtual environment with client SDKs from PyPI.
//! - [`store`]: [`StoreServer`], the server a behavioural test's backend needs.
//! - [`tmpfs`]: [`Tmpfs`], a small tmpfs in a mount namespace of its own, to `fill()` and
//!   `free()`.
//! - [`wait`]: [`wait_until`], which polls a condition instead of sleeping for a guessed time.

pub mod cluster;
pub mod config;
pub mod failover;
pub mod gateway;
pub mod metrics;
pub mod ports;
pub mod postgres;
pub mod process;
pub mod python;
pub mod redis;
pub mod store;
pub mod tmpfs;
pub mod wait;

pub use self::cluster::{query, RedisCluster, RedisSentinelSet, MASTER_NAME};
pub use self::config::GatewayConfig;
pub use self::failover::{panic_text, Failover, Replicated, Steps, Supervision};
pub use self::gateway::{GatewayProcess, Launch, Ports};
pub use self::ports::{free_addr, free_port, ReservedPort};
pub use self::postgres::PostgresServer;
pub use self::python::PythonEnv;
pub use self::redis::{Backend, RedisServer, TlsRedisServer};
pub use self::store::StoreServer;
pub use self::tmpfs::Tmpfs;
pub use self::wait::wait_until;
