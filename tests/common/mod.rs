//! Shared fixtures of the integration tests: real processes and real sockets, nothing mocked.
//!
//! One test's world is a [`TestEnv`]: a [`CountingUpstream`], a [`RedisServer`] on the Redis
//! backend, and an [`InProcessGateway`] between them and the test's HTTP client.
//!
//! ```ignore
//! let env = TestEnv::start(backend, GatewayConfig::new().set("defaults.ttl", "1s")).await;
//! let first = send(env.post_keyed("/v1/p", "k").body("x")).await;
//! assert!(send(env.post_keyed("/v1/p", "k").body("x")).await.replayed());
//! assert_eq!(env.upstream.calls(), 1);
//! env.redis().kill();
//! ```
//!
//! The fixtures, by module (the stores, the gateway's config and process, metrics, ports and
//! waiting from `testkit`, which the benchmark shares):
//! - [`config`]: [`GatewayConfig`] (testkit's), the gateway's TOML config built in
//!   code (`GatewayConfig::new().upstream(&url).redis(&server).set("workers", 1)`).
//! - [`redis`]: [`RedisServer`], a redis-server child process that a test can `kill()`,
//!   `pause()`, `resume()` and `restart()`; [`TlsRedisServer`], one that speaks only TLS.
//! - [`cluster`]: [`RedisCluster`] (three primaries, one replica each) and [`RedisSentinelSet`]
//!   (a primary, a replica, three sentinels), whose primaries a test can `kill9` and fail over;
//!   `testkit::Replicated` kills a primary as a failover run does and times each step, and
//!   runs a failover under load (`under_load`) as the benchmark does.
//! - [`upstream`]: [`CountingUpstream`], an HTTP upstream that counts its calls and answers by
//!   query string (`?status=503`, `?delay_ms=400`, `?read_delay_ms=N`, `/echo`, `/big?bytes=N`).
//! - [`gateway`]: [`InProcessGateway`], the gateway on a socket of this process;
//!   [`binary`], the `idemgate` binary to start as a [`GatewayProcess`] (for `kill9()` and
//!   SIGTERM); [`TestEnv`], the three together.
//! - [`metrics`]: a gateway's `/metrics` and a Redis's `INFO` counters, read.
//! - [`client`]: [`send`] a request and read it whole as [`Seen`] (`seen.replayed()`,
//!   `seen.problem_type()`).
//! - [`raw`]: raw sockets on both sides, for framing tests.
//! - [`ports`] and [`wait`]: [`free_port`], [`ReservedPort`], and [`wait_until`], which polls a
//!   condition instead of sleeping for a guessed time.
//!
//! A behavioural test is an `async fn(Backend)` listed in [`on_both_backends!`], which makes one
//! test per store (memory, Redis, embedded).

// The fixtures are `pub` for the test modules, in a binary that exports nothing.
#![allow(unreachable_pub)]

pub mod client;
pub mod gateway;
pub mod raw;
pub mod tls;
pub mod upstream;

// The fixture modules named above; the tests use their items through the re-exports below.
#[allow(unused_imports)]
pub use testkit::{cluster, config, metrics, ports, postgres, redis, wait};

pub use self::client::{client, send, Seen};
pub use self::gateway::{binary, InProcessGateway, TestEnv};
pub use self::tls::{TestCa, Validity};
pub use self::upstream::CountingUpstream;
/// The gateway's config, built in code.
pub use testkit::GatewayConfig;
pub use testkit::{
    free_port, wait_until, Backend, GatewayProcess, PostgresServer, RedisCluster, RedisSentinelSet,
    RedisServer, ReservedPort, StoreServer, TlsRedisServer,
};

/// Generate one test per backend (memory, Redis, embedded) for each named `async fn(Backend)`.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod on_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::common::Backend::Memory).await
                }
            )*
        }
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::common::Backend::Redis).await
                }
            )*
        }
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::common::Backend::Postgres).await
                }
            )*
        }
        mod on_embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::common::Backend::Embedded).await
                }
            )*
        }
    };
}
