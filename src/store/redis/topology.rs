//! How the Redis store reaches its nodes: one server, a Redis Cluster, or the primary that
//! Sentinel names. [`Conn`] is one handle over the three; the store's commands go through it
//! unchanged.
//!
//! - One server: redis-rs's `ConnectionManager` (multiplexed, reconnects by itself).
//! - Cluster: redis-rs's own async cluster client, which follows MOVED/ASK and refreshes the
//!   slot map after a failover. Every key of one record shares a hash tag, so each command and
//!   script runs on the key's primary.
//! - Sentinel: a `ConnectionManager` to the primary the sentinels name; when it stops answering
//!   or says it is a replica (READONLY), the sentinels are asked again and the new primary used.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    Client, Cmd, IntoConnectionInfo, ProtocolVersion, PushInfo, RedisConnectionInfo, RedisError,
    RedisFuture, RedisResult, TlsCertificates, Value,
};

use crate::store::{NodeAuth, Topology};

/// Receives pub/sub messages on a subscriber connection.
pub(crate) type PushFn = Arc<dyn Fn(PushInfo) + Send + Sync>;

/// How to open a connection.
pub(crate) struct Opening<'a> {
    pub topology: &'a Topology,
    pub timeout: Duration,
    /// For `rediss://`: the CA(s) to trust and the certificate to present, when not the
    /// system's roots alone.
    pub certs: Option<TlsCertificates>,
    /// For Sentinel: the data nodes' own user and password, when not the sentinels'.
    pub node_auth: Option<NodeAuth>,
    /// For a subscriber connection: RESP3, with messages handed to this function.
    pub push: Option<PushFn>,
}

/// A connection to the store's Redis, whatever its topology. Clones share it.
#[derive(Clone)]
pub(crate) enum Conn {
    /// One server.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
    /// The primary Sentinel names.
    Sentinel(SentinelConn),
}

impl Conn {
    /// A handle that connects on first use (and reconnects by itself after): opening never
    /// waits for Redis, so the gateway starts while it is unreachable.
    pub(crate) fn open(o: &Opening<'_>) -> RedisResult<Self> {
        match o.topology {
            Topology::Single { url } => {
                let client = client(url, o.certs.clone(), o.push.is_some())?;
                Ok(Conn::Single(ConnectionManager::new_lazy_with_config(
                    client,
                    manager_config(o),
                )?))
            }
            Topology::Cluster { urls } => {
                let mut builder = ClusterClientBuilder::new(urls.clone())
                    .connection_timeout(o.timeout)
                    .response_timeout(o.timeout)
                    .retries(2)
                    .min_retry_wait(50)
                    .max_retry_wait(500);
                if let Some(certs) = o.certs.clone() {
                    builder = builder.certs(certs);
                }
                let mut config = ClusterConfig::new()
                    .set_connection_timeout(o.timeout)
                    .set_response_timeout(o.timeout);
                if let Some(push) = &o.push {
                    builder = builder.use_protocol(ProtocolVersion::RESP3);
                    let push = push.clone();
                    config = config.set_push_sender(move |info: PushInfo| {
                        push(info);
                        Ok::<(), std::convert::Infallible>(())
                    });
                }
                let client = builder.build()?;
                Ok(Conn::Cluster(
                    client.get_pending_async_connection_with_config(config),
                ))
            }
            Topology::Sentinel { urls, master_name } => {
                Ok(Conn::Sentinel(SentinelConn::new(urls, master_name, o)?))
            }
        }
    }

    /// Subscribe to `channel`: a shard channel (`SSUBSCRIBE`, on the node of its hash slot) in
    /// a cluster, a plain one elsewhere. Only on a connection opened with `push`.
    pub(crate) async fn subscribe(&mut self, channel: &str, sharded: bool) -> RedisResult<()> {
        match self {
            Conn::Single(c) => c.subscribe(channel).await,
            Conn::Cluster(c) if sharded => c.ssubscribe(channel).await,
            Conn::Cluster(c) => c.subscribe(channel).await,
            Conn::Sentinel(c) => c.subscribe(channel).await,
        }
    }

    /// Undo [`Conn::subscribe`].
    pub(crate) async fn unsubscribe(&mut self, channel: &str, sharded: bool) -> RedisResult<()> {
        match self {
            Conn::Single(c) => c.unsubscribe(channel).await,
            Conn::Cluster(c) if sharded => c.sunsubscribe(channel).await,
            Conn::Cluster(c) => c.unsubscribe(channel).await,
            Conn::Sentinel(c) => c.unsubscribe(channel).await,
        }
    }

    /// The nodes that hold keys: every primary of a cluster (`None` for the one server of the
    /// other topologies). Each is scanned separately, since SCAN sees one node's keys.
    pub(crate) async fn primaries(&mut self) -> RedisResult<Vec<Option<(String, u16)>>> {
        let Conn::Cluster(c) = self else {
            return Ok(vec![None]);
        };
        let nodes = c
            .route_command(
                redis::cmd("CLUSTER").arg("NODES").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
            )
            .await?;
        let text: String = redis::from_redis_value(nodes)?;
        Ok(cluster_primaries(&text).into_iter().map(Some).collect())
    }

    /// Run `cmd` on one node of [`Conn::primaries`].
    pub(crate) async fn on_node(
        &mut self,
        node: &Option<(String, u16)>,
        cmd: &Cmd,
    ) -> RedisResult<Value> {
        match (self, node) {
            (Conn::Cluster(c), Some((host, port))) => {
                c.route_command(
                    cmd.clone(),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port: *port,
                    }),
                )
                .await
            }
            (conn, _) => cmd.query_async(conn).await,
        }
    }
}

/// The primaries serving slots, from `CLUSTER NODES` (`id host:port@bus flags master ...
/// slots`), as (host, port).
fn cluster_primaries(nodes: &str) -> Vec<(String, u16)> {
    nodes
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields.get(2)?;
            let serves_slots = fields.len() > 8;
            if !flags.split(',').any(|f| f == "master") || flags.contains("fail") || !serves_slots {
                return None;
            }
            let addr = fields.get(1)?.split('@').next()?;
            let (host, port) = addr.rsplit_once(':')?;
            Some((host.to_string(), port.parse().ok()?))
        })
        .collect()
}

/// A client for `url`, with `certs` for `rediss://`; speaking RESP3 for a subscriber.
fn client(url: &str, certs: Option<TlsCertificates>, resp3: bool) -> RedisResult<Client> {
    let mut info = url.into_connection_info()?;
    if resp3 {
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        info = info.set_redis_settings(settings);
    }
    if url.starts_with("rediss://") {
        // One process-wide TLS provider; a second install is refused harmlessly.
        let _ = rustls::crypto::ring::default_provider().install_default();
        if let Some(certs) = certs {
            return Client::build_with_tls(info, certs);
        }
    }
    Client::open(info)
}

/// Reconnects happen in the background after a failure; a request never waits for more than
/// `timeout` on a dead server, and a restarted server is picked up on the next command.
fn manager_config(o: &Opening<'_>) -> ConnectionManagerConfig {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(o.timeout))
        .set_response_timeout(Some(o.timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(200));
    match &o.push {
        Some(push) => {
            let push = push.clone();
            config
                .set_push_sender(move |info: PushInfo| {
                    push(info);
                    Ok::<(), std::convert::Infallible>(())
                })
                .set_automatic_resubscription()
        }
        None => config,
    }
}

/// Whether `e` says the node is gone or no longer the primary, so that it is time to ask the
/// sentinels again.
fn primary_lost(e: &RedisError) -> bool {
    e.is_connection_dropped()
        || e.is_io_error()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.code().is_some_and(demoted)
}

/// Error codes of a node that is not (or not yet) a writable primary.
fn demoted(code: &str) -> bool {
    matches!(code, "READONLY" | "MASTERDOWN" | "LOADING")
}

/// Whether an answer carries such an error: Redis's own errors come back as values (one per
/// command of a pipeline), not as a failed call.
fn answers_demoted(value: &Value) -> bool {
    match value {
        Value::ServerError(e) => demoted(e.code()),
        Value::Array(values) => values.iter().any(answers_demoted),
        _ => false,
    }
}

/// What a command's answer says of the primary.
trait Answer {
    fn demoted(&self) -> bool;
}

impl Answer for Value {
    fn demoted(&self) -> bool {
        answers_demoted(self)
    }
}

impl Answer for Vec<Value> {
    fn demoted(&self) -> bool {
        self.iter().any(answers_demoted)
    }
}

/// The primary that the sentinels name, asked again when it fails.
#[derive(Clone)]
pub(crate) struct SentinelConn(Arc<SentinelShared>);

struct SentinelShared {
    // One question to the sentinels at a time.
    sentinel: tokio::sync::Mutex<SentinelClient>,
    // The primary's connection and its generation (bumped on every switch).
    current: Mutex<Option<(u64, ConnectionManager)>>,
    last_asked: Mutex<Option<Instant>>,
    config: ConnectionManagerConfig,
    timeout: Duration,
    // Subscribed channels, subscribed again on a new primary.
    channels: Mutex<Vec<String>>,
}

/// The sentinels are asked at most this often while the primary is failing.
const REASK_EVERY: Duration = Duration::from_millis(100);

/// `builder` logging in to the sentinels as their URL says (`sentinel`), and to the data nodes
/// on its database, as `node_auth` says or else as to the sentinels (the data nodes are reached
/// with the sentinels' TLS setting too).
fn logged_in(
    mut builder: SentinelClientBuilder,
    sentinel: &RedisConnectionInfo,
    node_auth: Option<&NodeAuth>,
) -> SentinelClientBuilder {
    let (node_user, node_password) = match node_auth {
        Some(auth) => (auth.username.as_deref(), auth.password.as_deref()),
        None => (sentinel.username(), sentinel.password()),
    };
    if let Some(user) = sentinel.username() {
        builder = builder.set_client_to_sentinel_username(user);
    }
    if let Some(password) = sentinel.password() {
        builder = builder.set_client_to_sentinel_password(password);
    }
    if let Some(user) = node_user {
        builder = builder.set_client_to_redis_username(user);
    }
    if let Some(password) = node_password {
        builder = builder.set_client_to_redis_password(password);
    }
    builder.set_client_to_redis_db(sentinel.db())
}

impl SentinelConn {
    fn new(urls: &[String], master_name: &str, o: &Opening<'_>) -> RedisResult<Self> {
        let infos = urls
            .iter()
            .map(|u| u.as_str().into_connection_info())
            .collect::<RedisResult<Vec<_>>>()?;
        let Some(first) = infos.first().map(|i| i.redis_settings().clone()) else {
            return Err(RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "no sentinel to ask",
            )));
        };
        let tls = urls.first().is_some_and(|u| u.starts_with("rediss://"));
        if tls {
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let mut builder = SentinelClientBuilder::new(
            infos.iter().map(|i| i.addr().clone()),
            master_name,
            SentinelServerType::Master,
        )?;
        builder = logged_in(builder, &first, o.node_auth.as_ref());
        if tls {
            builder = builder
                .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
            if let Some(certs) = o.certs.clone() {
                builder = builder
                    .set_client_to_redis_certificates(certs.clone())
                    .set_client_to_sentinel_certificates(certs);
            }
        }
        if o.push.is_some() {
            builder = builder.set_client_to_redis_protocol(ProtocolVersion::RESP3);
        }
        Ok(SentinelConn(Arc::new(SentinelShared {
            sentinel: tokio::sync::Mutex::new(builder.build()?),
            current: Mutex::new(None),
            last_asked: Mutex::new(None),
            config: manager_config(o),
            timeout: o.timeout,
            channels: Mutex::new(Vec::new()),
        })))
    }

    /// The primary's connection, asking the sentinels when there is none yet.
    async fn current(&self) -> RedisResult<(u64, ConnectionManager)> {
        if let Some(c) = self
            .0
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            return Ok(c);
        }
        self.switch(None).await
    }

    /// Ask the sentinels for the primary and connect to it, unless another caller already
    /// switched away from generation `seen`, or asked a moment ago.
    async fn switch(&self, seen: Option<u64>) -> RedisResult<(u64, ConnectionManager)> {
        let mut sentinel = self.0.sentinel.lock().await;
        let current = self
            .0
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some((generation, conn)) = &current {
            let recent = self
                .0
                .last_asked
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_some_and(|t| t.elapsed() < REASK_EVERY);
            if Some(*generation) != seen || recent {
                return Ok((*generation, conn.clone()));
            }
        }
        *self
            .0
            .last_asked
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        let client = tokio::time::timeout(self.0.timeout, sentinel.async_get_client())
            .await
            .map_err(|_| {
                RedisError::from((
                    redis::ErrorKind::Io,
                    "no sentinel named the primary in time",
                ))
            })??;
        drop(sentinel);
        let conn = ConnectionManager::new_lazy_with_config(client, self.0.config.clone())?;
        let generation = current.map_or(0, |(g, _)| g + 1);
        *self
            .0
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some((generation, conn.clone()));
        let channels = self
            .0
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if !channels.is_empty() {
            let mut c = conn.clone();
            tokio::spawn(async move {
                for channel in channels {
                    let _ = c.subscribe(channel).await;
                }
            });
        }
        Ok((generation, conn))
    }

    /// Run `f` on the primary; when the primary is lost, ask the sentinels before answering
    /// (the caller's retry then goes to the new one).
    async fn run<'a, T: Answer>(
        &'a self,
        f: impl FnOnce(ConnectionManager) -> RedisFuture<'a, T>,
    ) -> RedisResult<T> {
        let (generation, conn) = self.current().await?;
        let result = f(conn).await;
        let lost = match &result {
            Err(e) => primary_lost(e),
            Ok(answer) => answer.demoted(),
        };
        if lost {
            if let Err(ask) = self.switch(Some(generation)).await {
                tracing::debug!(error = %ask, "sentinels did not name a primary");
            }
        }
        result
    }

    async fn subscribe(&self, channel: &str) -> RedisResult<()> {
        self.0
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(channel.to_string());
        let (_, mut conn) = self.current().await?;
        conn.subscribe(channel).await
    }

    async fn unsubscribe(&self, channel: &str) -> RedisResult<()> {
        self.0
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|c| c != channel);
        let (_, mut conn) = self.current().await?;
        conn.unsubscribe(channel).await
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Sentinel(s) => Box::pin(async move {
                s.run(|mut c| Box::pin(async move { c.req_packed_command(cmd).await }))
                    .await
            }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(s) => Box::pin(async move {
                s.run(|mut c| {
                    Box::pin(async move { c.req_packed_commands(pipeline, offset, count).await })
                })
                .await
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Sentinel(_) => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primaries_are_read_from_cluster_nodes() {
        let nodes = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7002@17002 master - 0 0 2 connected 5461-10922
c3 127.0.0.1:7003@17003 master,fail - 0 0 3 connected 10923-16383
d4 127.0.0.1:7004@17004 slave a1 0 0 1 connected
e5 127.0.0.1:7005@17005 master - 0 0 5 connected
";
        assert_eq!(
            cluster_primaries(nodes),
            vec![
                ("127.0.0.1".to_string(), 7001),
                ("127.0.0.1".to_string(), 7002)
            ]
        );
    }
}
