//! The Redis store: shared by every gateway replica, on one server, a Redis Cluster or a
//! Sentinel-managed primary (see `topology.rs`). Each operation is one round trip and atomic
//! on the server. A claim is Redis's own `SET key entry NX PX lease GET` (Redis >= 7.0), pipelined
//! with a `PTTL` of the key; on an older server, which refuses that combination, the claim falls
//! back to a Lua script for good. Completing, releasing and renewing are Lua scripts fenced by
//! the claim's token (`EVALSHA`; when Redis lost its script cache, the script is loaded again
//! and the command resent).
//!
//! One Redis string per key, `prefix + ScopedKey::store_name()` (in a cluster the name is a hash
//! tag, `prefix{name}`, so that a record's keys and channel share its slot), holding the entry
//! encoded by `codec.rs`; its Redis TTL is the lease (in flight) or the
//! record's `ttl`. Completing and releasing publish on the key's `done` channel
//! (`events.rs`), which wakes requests waiting for it.
//!
//! With `wait_replicas = N`, a claim and a completion are followed by `WAIT N timeout` in the
//! same pipeline (so on the same connection, to the key's primary): fewer acknowledgements are
//! [`StoreError::NotAcknowledged`], and a claim that was not acknowledged is released first.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use redis::{RedisResult, Script};

use super::codec;

mod events;
mod settings;
mod topology;

use self::events::Events;
pub use self::events::Evicted;
pub use self::settings::{Compression, NodeAuth, RedisSettings, Topology, DEFAULT_PREFIX};
use self::topology::{Conn, Opening};
pub use super::settings::DEFAULT_TIMEOUT;
use super::Watch;
use super::{Claim, ClaimTerms, Claimant, Keep, Store, StoreError, StoreResult};
use crate::record::key::ScopedKey;
use crate::record::policy::AfterExpiry;
use crate::record::EntryState;

/// A handle to the Redis store; clones share one multiplexed connection.
#[derive(Clone)]
pub struct RedisStore {
    // Multiplexed and self-reconnecting: one TCP connection (per node) carries every request's
    // commands.
    conn: Conn,
    // Pub/sub of the process, shared by every handle (see `sibling`).
    events: Arc<Events>,
    // Record names are hash tags (a cluster).
    tagged: bool,
    // `WAIT` after claims and completions, and the connections those writes go on (shared by
    // every handle of the process); none when `wait_replicas` is 0.
    wait: Option<Arc<WaitPool>>,
    // The prefix, the compression and how to open more connections.
    options: Arc<RedisSettings>,
    scripts: Arc<Scripts>,
    // How records are written and read (compressed, sealed).
    codec: codec::Codec,
    // Whether claims use `SET NX GET`; cleared for good when the server refuses it (Redis < 7).
    native_claim: Arc<AtomicBool>,
}

struct Scripts {
    claim: Script,
    claim_unless_expired: Script,
    complete: Script,
    complete_staged: Script,
    release: Script,
    renew: Script,
}

impl Scripts {
    /// The scripts in `lua/`, with the record layout they read filled in from the codec's
    /// definitions (`codec.rs`; Lua strings count from 1), and how they publish (`SPUBLISH` on
    /// a cluster's shard channels).
    fn load(sharded: bool) -> Self {
        let publish = if sharded { "SPUBLISH" } else { "PUBLISH" };
        let fill = |source: &str| {
            source
                .replace("@PUBLISH@", publish)
                .replace("@DONE@", DONE_SUFFIX)
                .replace("@STATE@", &(codec::STATE_AT + 1).to_string())
                .replace("@TOKEN_FROM@", &(codec::TOKEN_AT + 1).to_string())
                .replace("@TOKEN_TO@", &codec::WRITTEN_AT.to_string())
                .replace("@IN_FLIGHT@", &char::from(codec::IN_FLIGHT).to_string())
        };
        Scripts {
            claim: Script::new(&fill(include_str!("lua/claim.lua"))),
            claim_unless_expired: Script::new(&fill(include_str!("lua/claim_unless_expired.lua"))),
            complete: Script::new(&fill(include_str!("lua/complete.lua"))),
            complete_staged: Script::new(&fill(include_str!("lua/complete_staged.lua"))),
            release: Script::new(&fill(include_str!("lua/release.lua"))),
            renew: Script::new(&fill(include_str!("lua/renew.lua"))),
        }
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.options.prefix)
            .finish_non_exhaustive()
    }
}

/// Connections for the writes followed by `WAIT`, each taken by one write at a time: a `WAIT`
/// blocks its connection inside Redis until the replicas answer (or its timeout passes), and
/// must not hold up the commands of other requests.
struct WaitPool {
    // `WAIT replicas timeout_ms`.
    replicas: u32,
    timeout_ms: u64,
    conns: Vec<tokio::sync::Mutex<Conn>>,
    next: std::sync::atomic::AtomicUsize,
}

/// How many writes per process can wait for replicas at once; more queue for a connection.
const WAIT_CONNECTIONS: usize = 16;

impl WaitPool {
    /// The pool's connections, opened lazily; an answer may take the `WAIT`'s whole timeout
    /// before it is sent, so they wait twice the store's.
    fn open(options: &RedisSettings) -> Result<Self, StoreError> {
        let opening = Opening {
            timeout: options.timeout * 2,
            ..RedisStore::opening(options)
        };
        let conns = (0..WAIT_CONNECTIONS)
            .map(|_| Conn::open(&opening).map(tokio::sync::Mutex::new))
            .collect::<Result<_, _>>()?;
        Ok(WaitPool {
            replicas: options.wait_replicas,
            timeout_ms: millis(options.timeout),
            conns,
            next: Default::default(),
        })
    }

    /// A connection no other write is using; the next in turn when all are taken.
    #[expect(
        clippy::indexing_slicing,
        reason = "the pool holds WAIT_CONNECTIONS connections, indexed modulo their number"
    )]
    async fn get(&self) -> tokio::sync::MutexGuard<'_, Conn> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let n = self.conns.len();
        for i in 0..n {
            if let Ok(conn) = self.conns[(start + i) % n].try_lock() {
                return conn;
            }
        }
        self.conns[start % n].lock().await
    }
}

/// The channel of a record key, after its name, on which completing and releasing it publish.
const DONE_SUFFIX: &str = ":done";

impl RedisStore {
    /// Connect, and check that Redis answers.
    pub async fn connect(options: &RedisSettings) -> Result<Self, StoreError> {
        let store = Self::lazy(options)?;
        store.ping_now().await?;
        Ok(store)
    }

    /// A handle that connects on first use (and reconnects by itself after), for starting while
    /// Redis is unreachable: until it answers, every operation fails as a store error.
    pub fn lazy(options: &RedisSettings) -> Result<Self, StoreError> {
        let options = options.with_files_read()?;
        let events = Events::open(&Self::opening(&options), &options.prefix)?;
        let wait = match options.wait_replicas {
            0 => None,
            _ => Some(Arc::new(WaitPool::open(&options)?)),
        };
        Self::with_shared(Arc::new(options), events, wait)
    }

    /// Another handle with a connection of its own (for another worker thread), sharing this
    /// one's subscriptions and wait pool; connected and checked.
    pub async fn sibling(&self) -> Result<Self, StoreError> {
        let store =
            Self::with_shared(self.options.clone(), self.events.clone(), self.wait.clone())?;
        store.ping_now().await?;
        Ok(store)
    }

    fn opening(options: &RedisSettings) -> Opening<'_> {
        Opening {
            topology: &options.topology,
            timeout: options.timeout,
            certs: options.certificates(),
            node_auth: options.node_auth.clone(),
            push: None,
        }
    }

    fn with_shared(
        options: Arc<RedisSettings>,
        events: Arc<Events>,
        wait: Option<Arc<WaitPool>>,
    ) -> Result<Self, StoreError> {
        let tagged = matches!(options.topology, Topology::Cluster { .. });
        let codec = codec::Codec::new(
            options.compression == Compression::Lz4,
            options.seal.clone(),
        );
        Ok(RedisStore {
            conn: Conn::open(&Self::opening(&options))?,
            events,
            tagged,
            wait,
            options,
            scripts: Arc::new(Scripts::load(tagged)),
            codec,
            native_claim: Arc::new(AtomicBool::new(true)),
        })
    }

    async fn ping_now(&self) -> Result<(), StoreError> {
        let _: String = redis::cmd("PING")
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// Call `f` whenever an eviction is published (by any gateway on this Redis), so that a
    /// local cache forgets what was evicted.
    pub async fn on_evicted(&self, f: impl Fn(Evicted) + Send + Sync + 'static) {
        self.events.on_evicted(Box::new(f)).await;
    }

    /// Why the connected Redis could lose records, if it could: an eviction policy other than
    /// `noeviction` with a `maxmemory` set (eviction would silently drop in-flight locks and
    /// stored responses), or no persistence at all (a restart loses every record). `Ok(vec![])`
    /// when it is configured as the guarantee needs; CONFIG may be refused by managed Redis, in
    /// which case nothing can be said.
    pub async fn durability_warnings(&self) -> Result<Vec<String>, StoreError> {
        // In a cluster, one primary speaks for all (they are configured alike).
        let node = self.conn.clone().primaries().await?.into_iter().next();
        let node = node.unwrap_or(None);
        let get = |param: &'static str| {
            let mut conn = self.conn.clone();
            let node = node.clone();
            async move {
                let value = conn
                    .on_node(&node, redis::cmd("CONFIG").arg("GET").arg(param))
                    .await?;
                let pair: Vec<String> = parse(Some(value))?;
                Ok::<_, StoreError>(pair.get(1).cloned().unwrap_or_default())
            }
        };
        let policy = get("maxmemory-policy").await?;
        let maxmemory: u64 = get("maxmemory").await?.parse().unwrap_or(0);
        let appendonly = get("appendonly").await?;
        let save = get("save").await?;
        let mut warnings = Vec::new();
        if maxmemory > 0 && policy != "noeviction" {
            warnings.push(format!(
                "Redis maxmemory-policy is {policy:?} with maxmemory {maxmemory}: under memory pressure \
                 Redis would evict in-flight locks and stored responses, and a retry would run the \
                 upstream again; set maxmemory-policy noeviction"
            ));
        }
        if appendonly != "yes" && save.trim().is_empty() {
            warnings.push(
                "Redis has no persistence (appendonly no, save \"\"): a Redis restart loses every \
                 record and lock; enable appendonly yes for the exactly-once guarantee across restarts"
                    .to_string(),
            );
        }
        Ok(warnings)
    }

    /// The Redis key of a scoped key: a hash tag in a cluster, so that the record, its staging
    /// key and its channel share one slot.
    pub fn redis_key(&self, key: &ScopedKey) -> String {
        if self.tagged {
            format!("{}{{{}}}", self.options.prefix, key.store_name())
        } else {
            format!("{}{}", self.options.prefix, key.store_name())
        }
    }

    /// The Redis key of a record's tombstone: beside the record, in its hash slot.
    pub fn tombstone_key(record_key: &str) -> String {
        format!("{record_key}:tomb")
    }
}

impl RedisStore {
    /// Run a script invocation, retrying once when the connection dropped (for example after a
    /// Redis restart: the first command on a dead connection fails and triggers the reconnect).
    /// Every script is safe to run twice: claims recognise their own token, and complete,
    /// release and renew are fenced by it.
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        call: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let answer = within(self.options.timeout, async {
            match call.invoke_async(&mut self.conn.clone()).await {
                Err(e) if reconnects(&e) => call.invoke_async(&mut self.conn.clone()).await,
                result => result,
            }
        });
        Ok(answer.await?)
    }

    /// [`RedisStore::invoke`] for a pipeline of plain commands (sent in one write). A pipeline
    /// ended by `WAIT` goes on a connection of the wait pool, which it has to itself.
    async fn query<T: redis::FromRedisValue>(&self, pipe: &redis::Pipeline) -> RedisResult<T> {
        let (mut conn, _exclusive, budget) = match &self.wait {
            Some(pool) => {
                let guard = pool.get().await;
                (guard.clone(), Some(guard), self.options.timeout * 2)
            }
            None => (self.conn.clone(), None, self.options.timeout),
        };
        within(budget, async {
            match pipe.query_async(&mut conn).await {
                Err(e) if reconnects(&e) => pipe.query_async(&mut conn).await,
                result => result,
            }
        })
        .await
    }

    /// [`RedisStore::query`] for a pipeline that runs `script` by its hash: when Redis lost its
    /// script cache (a restart, SCRIPT FLUSH), the script is loaded and the pipeline sent again.
    async fn query_scripted<T: redis::FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
        script: &Script,
        key: &str,
    ) -> RedisResult<T> {
        match self.query(pipe).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                // In a cluster the script is loaded on the key's node, where it runs.
                let mut load = script.prepare_invoke();
                load.key(key);
                load.load_async(&mut self.conn.clone()).await?;
                self.query(pipe).await
            }
            result => result,
        }
    }

    /// End `pipe` with `WAIT replicas timeout` when acknowledgements are wanted; its answer is
    /// the pipeline's last value, for [`RedisStore::acknowledged`].
    fn then_wait(&self, pipe: &mut redis::Pipeline) {
        if let Some(pool) = &self.wait {
            pipe.cmd("WAIT").arg(pool.replicas).arg(pool.timeout_ms);
        }
    }

    /// Read the answer of the `WAIT` that [`RedisStore::then_wait`] added (none when no
    /// acknowledgement is wanted): an error when fewer replicas than wanted acknowledged.
    fn acknowledged(
        &self,
        answer: Option<redis::Value>,
    ) -> Result<Result<(), StoreError>, StoreError> {
        let Some(pool) = &self.wait else {
            return Ok(Ok(()));
        };
        let acked: i64 = parse(answer)?;
        Ok(if acked < i64::from(pool.replicas) {
            Err(StoreError::NotAcknowledged {
                acked,
                wanted: pool.replicas,
            })
        } else {
            Ok(())
        })
    }

    /// Send a completion pipeline (a fenced script, then the `WAIT` when wanted): whether it was
    /// written, and an error when it was written but not acknowledged.
    async fn write_completion(
        &self,
        mut pipe: redis::Pipeline,
        script: &Script,
        key: &str,
    ) -> Result<bool, StoreError> {
        self.then_wait(&mut pipe);
        let values: Vec<redis::Value> = self.query_scripted(&pipe, script, key).await?;
        let mut values = values.into_iter();
        let written = parse::<i64>(values.next())? == 1;
        let acked = self.acknowledged(values.next())?;
        if written {
            acked?;
        }
        Ok(written)
    }

    /// What `key` held when our claim was tried (with its remaining time to live in ms), or
    /// `None` when the claim took it; and whether the replicas acknowledged.
    /// With `tombstone`, the key of the record's tombstone: a free key whose tombstone lives is
    /// not claimed, and the tombstone is returned instead (always through a script).
    async fn try_claim(
        &self,
        key: &str,
        entry: &[u8],
        lease: Duration,
        tombstone: Option<&str>,
    ) -> Result<(Option<(Vec<u8>, i64)>, Result<(), StoreError>), StoreError> {
        if tombstone.is_none() && self.native_claim.load(Ordering::Relaxed) {
            let mut pipe = redis::pipe();
            pipe.cmd("SET")
                .arg(key)
                .arg(entry)
                .arg("NX")
                .arg("PX")
                .arg(millis(lease))
                .arg("GET")
                .cmd("PTTL")
                .arg(key);
            self.then_wait(&mut pipe);
            match self.query::<Vec<redis::Value>>(&pipe).await {
                Ok(values) => {
                    let mut values = values.into_iter();
                    let held: Option<Vec<u8>> = parse(values.next())?;
                    let pttl: i64 = parse(values.next())?;
                    let acked = self.acknowledged(values.next())?;
                    return Ok((held.map(|v| (v, pttl)), acked));
                }
                // Redis before 7.0 refuses NX together with GET ("ERR syntax error"): use the
                // script from now on. Nothing was written.
                Err(e)
                    if e.code() == Some("ERR")
                        && e.detail().is_some_and(|d| d.contains("syntax error")) =>
                {
                    tracing::warn!(error = %e, "this Redis refuses SET NX GET (before 7.0); claims use a Lua script instead");
                    self.native_claim.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e.into()),
            }
        }
        let script = match tombstone {
            None => &self.scripts.claim,
            Some(_) => &self.scripts.claim_unless_expired,
        };
        let mut pipe = redis::pipe();
        pipe.cmd("EVALSHA")
            .arg(script.get_hash())
            .arg(1 + usize::from(tombstone.is_some()))
            .arg(key);
        if let Some(tombstone) = tombstone {
            pipe.arg(tombstone);
        }
        pipe.arg(entry).arg(millis(lease));
        self.then_wait(&mut pipe);
        let values: Vec<redis::Value> = self.query_scripted(&pipe, script, key).await?;
        let mut values = values.into_iter();
        let held = parse(values.next())?;
        Ok((held, self.acknowledged(values.next())?))
    }

    /// Complete with a large entry: a plain `SET` of it to a staging key and the fenced script
    /// that renames it into place, pipelined (one round trip). Through Lua the entry would be
    /// copied twice more on the server; at 64 KiB that halves Redis's write rate.
    async fn complete_staged(
        &self,
        who: &Claimant,
        entry: &codec::Encoded<'_>,
        keep: Keep,
        tombstone: Option<(Bytes, Duration)>,
    ) -> Result<bool, StoreError> {
        use redis::RedisWrite;
        use std::io::Write;
        let (record_key, token) = (self.redis_key(&who.key), &who.token);
        // Unique per claim; under the prefix, so evicting everything also takes stray ones.
        let staged = format!("{record_key}:staged:{}", crate::record::key::hex(&token.0));
        let script = &self.scripts.complete_staged;
        // The entry is written straight into the command, sized up front: one copy of the body.
        let mut set = redis::Cmd::with_capacity(5, entry.len() + staged.len() + 16);
        set.arg("SET").arg(&staged);
        #[expect(clippy::expect_used, reason = "the command's buffer is in memory")]
        {
            let mut w = set.writer_for_next_arg();
            w.write_all(&entry.head).expect("writing to memory");
            w.write_all(&entry.body).expect("writing to memory");
        }
        // The staged entry lives only as long as a lease would: if the script never runs (the
        // gateway died between), it goes away by itself.
        set.arg("PX").arg(STAGED_TTL_MS);
        let mut pipe = redis::Pipeline::with_capacity(3);
        pipe.add_command(set)
            .ignore()
            .cmd("EVALSHA")
            .arg(script.get_hash())
            .arg(2 + usize::from(keep.tombstone.is_some()))
            .arg(&record_key)
            .arg(&staged);
        // On a route that keeps tombstones, a live one keeps a late completion out.
        if keep.tombstone.is_some() {
            pipe.arg(Self::tombstone_key(&record_key));
        }
        pipe.arg(&token.0[..]).arg(millis(keep.ttl.clamped()));
        if let Some((tombstone, lives)) = &tombstone {
            pipe.arg(tombstone.as_ref()).arg(millis(*lives));
        }
        self.write_completion(pipe, script, &record_key).await
    }

    /// Make claims use the Lua script, as on a Redis older than 7.0 (for tests of that path).
    pub fn claim_with_script(self) -> Self {
        self.native_claim.store(false, Ordering::Relaxed);
        self
    }
}

/// `call` (a command and its one retry on a fresh connection) bounded by `budget` as a whole:
/// redis-rs bounds each response, but a connection opened on the way (after a reconnect, to a
/// server that accepts and never answers) adds its own timeouts.
async fn within<T>(
    budget: Duration,
    call: impl std::future::Future<Output = RedisResult<T>>,
) -> RedisResult<T> {
    match tokio::time::timeout(budget, call).await {
        Ok(result) => result,
        Err(_) => Err(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no answer within store.timeout",
        ))),
    }
}

/// Whether `e` means the connection broke (or, behind Sentinel, the node is no longer the
/// primary), so that one retry on a fresh connection is worth it.
fn reconnects(e: &redis::RedisError) -> bool {
    // A timeout is not a broken connection: sent again, it would wait the timeout twice.
    !e.is_timeout()
        && (e.is_connection_dropped()
            || e.is_io_error()
            || e.is_connection_refusal()
            || e.code() == Some("READONLY"))
}

/// Whether `e` says Redis could not be reached (rather than that it refused us: a wrong password,
/// a TLS or configuration error): a cluster with no node up, no primary named by the sentinels,
/// a cluster that is down.
fn unreachable(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::MasterNameNotFoundBySentinel
                | ErrorKind::NoValidReplicasFoundBySentinel
                | ErrorKind::Server(ServerErrorKind::ClusterDown)
                | ErrorKind::Server(ServerErrorKind::MasterDown)
        )
}

/// Entries from this size on are completed through a staging key (see `complete_staged`).
const STAGE_FROM: usize = 16 * 1024;

/// How long a staged entry lives if the script that moves it never runs.
const STAGED_TTL_MS: u64 = 60_000;

/// One value of an answer, as `T` (a missing one reads as nil).
fn parse<T: redis::FromRedisValue>(value: Option<redis::Value>) -> Result<T, StoreError> {
    redis::from_redis_value(value.unwrap_or(redis::Value::Nil))
        .map_err(|e| redis::RedisError::from(e).into())
}

/// The backend's name in errors.
const BACKEND: &str = "redis";

/// A Redis error as the store's: a timeout; unreachable ([`unreachable`]); or a refusal or
/// failure.
impl From<redis::RedisError> for StoreError {
    fn from(e: redis::RedisError) -> Self {
        if e.is_timeout() {
            StoreError::timeout(BACKEND, e)
        } else if unreachable(&e) {
            StoreError::unavailable(BACKEND, e)
        } else {
            StoreError::failed(BACKEND, e)
        }
    }
}

use crate::time::millis;

impl super::Inspect for RedisStore {
    async fn ping(&self) -> StoreResult<()> {
        let _: String = redis::cmd("PING")
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    async fn inspect(&self, key: &ScopedKey) -> StoreResult<Option<super::Inspected>> {
        let record = self.redis_key(key);
        let tombstone = Self::tombstone_key(&record);
        let (raw, pttl, tomb, tomb_pttl): (Option<Vec<u8>>, i64, Option<Vec<u8>>, i64) =
            redis::pipe()
                .get(&record)
                .pttl(&record)
                .get(&tombstone)
                .pttl(&tombstone)
                .query_async(&mut self.conn.clone())
                .await?;
        // The record, or its tombstone once it has expired.
        let Some((raw, pttl)) = raw.map(|r| (r, pttl)).or(tomb.map(|t| (t, tomb_pttl))) else {
            return Ok(None);
        };
        let stored_bytes = raw.len();
        let (entry, _) = self.codec.decode(key, Bytes::from(raw))?;
        Ok(Some(super::Inspected {
            entry,
            expires_in: u64::try_from(pttl).ok().map(Duration::from_millis),
            stored_bytes,
        }))
    }

    async fn evict(&self, key: &ScopedKey) -> StoreResult<bool> {
        let record = self.redis_key(key);
        let n: i64 = redis::cmd("DEL")
            .arg(Self::tombstone_key(&record))
            .arg(&record)
            .query_async(&mut self.conn.clone())
            .await?;
        self.publish_eviction(&key.0).await;
        Ok(n > 0)
    }

    async fn evict_all(&self) -> StoreResult<u64> {
        // SCAN each primary in batches (never KEYS, which blocks Redis), UNLINK each batch.
        let mut conn = self.conn.clone();
        let pattern = format!("{}*", self.options.prefix);
        let mut evicted = 0;
        for node in conn.primaries().await? {
            let mut cursor: u64 = 0;
            loop {
                let mut scan = redis::cmd("SCAN");
                scan.arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(1000);
                let (next, keys): (u64, Vec<Vec<u8>>) =
                    parse(Some(conn.on_node(&node, &scan).await?))?;
                if !keys.is_empty() {
                    // A cluster client splits the keys by slot.
                    let n: u64 = redis::cmd("UNLINK")
                        .arg(&keys)
                        .query_async(&mut conn)
                        .await?;
                    evicted += n;
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        self.publish_eviction(b"").await;
        Ok(evicted)
    }
}

impl RedisStore {
    /// Tell every gateway's local cache that `key` (empty: everything) was evicted.
    async fn publish_eviction(&self, key: &[u8]) {
        let published: Result<i64, _> = redis::cmd("PUBLISH")
            .arg(self.events.evict_channel())
            .arg(key)
            .query_async(&mut self.conn.clone())
            .await;
        if let Err(e) = published {
            tracing::warn!(error = %e, "could not publish the eviction; other gateways' local caches forget it when their entries expire");
        }
    }
}

impl Store for RedisStore {
    async fn claim(&self, who: &Claimant, terms: ClaimTerms) -> StoreResult<Claim> {
        let entry = self.codec.claim(&who.fingerprint, &who.token);
        let redis_key = self.redis_key(&who.key);
        let tombstones = terms.after_expiry == AfterExpiry::Refuse;
        let tombstone = tombstones.then(|| Self::tombstone_key(&redis_key));
        let tried = self.try_claim(&redis_key, &entry, terms.lease, tombstone.as_deref());
        match tried.await? {
            (None, Ok(())) => Ok(Claim::Claimed),
            (None, Err(not_acknowledged)) => {
                // A failover could lose this claim: take it back before answering, so that it
                // neither runs unprotected nor sits in flight for a lease.
                if let Err(e) = self.release(who).await {
                    tracing::warn!(error = %e, "could not release a claim the replicas did not acknowledge; it ends with its lease");
                }
                Err(not_acknowledged)
            }
            (Some((raw, pttl)), _) => {
                let (mut held, holder) = self.codec.decode(&who.key, Bytes::from(raw))?;
                held.expires_in = u64::try_from(pttl).ok().map(Duration::from_millis);
                Ok(Claim::decide(held, &holder, &who.fingerprint, &who.token))
            }
        }
    }

    async fn complete(&self, who: &Claimant, state: &EntryState, keep: Keep) -> StoreResult<bool> {
        let (key, token) = (&who.key, &who.token);
        let parts = self.codec.record(key, &who.fingerprint, token, state);
        let tombstone = self.codec.tombstone(key, keep, &who.fingerprint, state);
        if parts.len() >= STAGE_FROM {
            return self.complete_staged(who, &parts, keep, tombstone).await;
        }
        let entry = parts.into_bytes();
        let redis_key = self.redis_key(key);
        let script = &self.scripts.complete;
        let mut pipe = redis::pipe();
        pipe.cmd("EVALSHA")
            .arg(script.get_hash())
            .arg(1 + usize::from(keep.tombstone.is_some()))
            .arg(&redis_key);
        // On a route that keeps tombstones, a live one keeps a late completion out.
        if keep.tombstone.is_some() {
            pipe.arg(Self::tombstone_key(&redis_key));
        }
        pipe.arg(&token.0[..])
            .arg(entry.as_ref())
            .arg(millis(keep.ttl.clamped()));
        if let Some((tombstone, lives)) = &tombstone {
            pipe.arg(tombstone.as_ref()).arg(millis(*lives));
        }
        self.write_completion(pipe, script, &redis_key).await
    }

    async fn release(&self, who: &Claimant) -> StoreResult<bool> {
        let mut call = self.scripts.release.prepare_invoke();
        call.key(self.redis_key(&who.key)).arg(&who.token.0[..]);
        Ok(self.invoke::<i64>(&call).await? == 1)
    }

    async fn renew(&self, who: &Claimant, lease: Duration) -> StoreResult<bool> {
        let mut call = self.scripts.renew.prepare_invoke();
        call.key(self.redis_key(&who.key))
            .arg(&who.token.0[..])
            .arg(millis(lease));
        Ok(self.invoke::<i64>(&call).await? == 1)
    }

    async fn watch(&self, key: &ScopedKey) -> Option<Watch> {
        let channel = format!("{}{DONE_SUFFIX}", self.redis_key(key));
        Some(self.events.watch(channel).await)
    }
}
