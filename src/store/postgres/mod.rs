//! The PostgreSQL store: one row per key in a table of the user's database, shared by every
//! gateway that points at it, durable as far as PostgreSQL is (a claim or a record counts once
//! its statement has committed).
//!
//! Each step is one statement (`schema.rs`): a claim is one `INSERT ... ON CONFLICT ...
//! RETURNING` that also takes over an expired claim, behind a read that leaves a live row as it
//! is (run again when a concurrent claimant won the key meanwhile); completing, releasing and renewing are one
//! `UPDATE`/`DELETE ... WHERE key = $1 AND token = $2`. Expired rows are ignored by every
//! statement and deleted in the background by a reaper, in bounded batches, every
//! [`REAP_EVERY`]. Every operation (pool checkout, connecting when needed, the statement) is
//! bounded by `timeout` as a whole, and the server gives up on the statement when the gateway
//! does (`statement_timeout`, set on every connection whatever the URL says, and shortened for
//! a statement that starts late), so that a statement the gateway gave up on does not commit
//! later. Admin evictions are notified to every process
//! on the table (`listen.rs`), for the local caches in front. A table of an older schema is
//! served as it is while one process migrates it in the background (`schema.rs`).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::time::Instant;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;
use tokio_util::task::AbortOnDropHandle;

use super::codec::Codec;
use super::watch::{Local, Signals};
use super::{
    Claim, ClaimTerms, Claimant, Inspect, Inspected, Keep, Store, StoreError, StoreResult, Watch,
};
use crate::record::key::ScopedKey;
use crate::record::policy::AfterExpiry;
use crate::record::{EntryState, Token};

mod listen;
mod schema;
mod settings;

use self::schema::Sql;
pub use self::settings::{
    PostgresSettings, DEFAULT_MIGRATION_TIMEOUT, DEFAULT_POOL_SIZE, DEFAULT_TABLE,
};
use super::Evicted;

/// How often each gateway deletes expired rows: an expired row is gone at most this long (plus
/// the time to delete its batch) after it expired.
pub const REAP_EVERY: Duration = Duration::from_secs(2);

/// Rows one reaper statement deletes at most; it goes on while batches come back full.
pub const REAP_BATCH: u32 = 1000;

/// How many times a claim runs its statement when concurrent claimants keep winning the key
/// between its snapshot and its insert.
const CLAIM_RUNS: usize = 4;

/// How long a process waits before it looks again at a migration another process runs, or
/// tries again after its own failed; doubled after each failure, up to
/// [`MIGRATION_RETRY_MAX`].
const MIGRATION_RETRY: Duration = Duration::from_secs(5);
const MIGRATION_RETRY_MAX: Duration = Duration::from_secs(300);

/// How late a statement may start within its operation's timeout and run under the
/// connection's own `statement_timeout` (the whole timeout): the server may then run it this
/// much longer than the gateway waits, a moment the engine's take-back of a claim whose answer
/// was lost covers. A statement that starts later has its bound set to the time left.
const LATE_START: Duration = Duration::from_millis(50);

/// PostgreSQL's longest `statement_timeout` (`INT_MAX` milliseconds, about 24.8 days): longer
/// bounds count as this.
const MAX_STATEMENT_TIMEOUT_MS: u64 = i32::MAX as u64;

/// Why PostgreSQL could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum PostgresError {
    /// The server answered with an error, or the connection failed.
    #[error("{}", describe(.0))]
    Db(#[from] tokio_postgres::Error),
    /// No connection within the timeout, or the pool could not make one.
    #[error("no connection: {0}")]
    Pool(String),
    /// No answer within `store.timeout`.
    #[error("no answer within {0:?} (store.timeout)")]
    Timeout(Duration),
    /// Concurrent claimants took the key from under every run of a claim.
    #[error("the claim lost the key to concurrent claimants {CLAIM_RUNS} times in a row")]
    Contended,
    /// The URL or the TLS setup cannot work.
    #[error("{0}")]
    Config(String),
    /// The table was written by a newer idemgate.
    #[error("table {table:?} has schema version {found}, newer than the {known} this idemgate knows: upgrade idemgate, or use another store.table", known = schema::VERSION)]
    SchemaTooNew {
        /// The table.
        table: String,
        /// Its version.
        found: u32,
    },
    /// A schema migration's statement got no answer within `store.migration_timeout`.
    #[error("no answer within {0:?} (store.migration_timeout)")]
    MigrationTimeout(Duration),
    /// A schema migration found the table in a state it cannot finish from.
    #[error("the migration cannot finish: {0}")]
    Migration(String),
    /// The table exists and is not an idemgate records table.
    #[error("table {table:?} exists and is not an idemgate records table (no \"idemgate schema N\" comment): choose another store.table")]
    NotOurs {
        /// The table.
        table: String,
    },
}

/// The backend's name in errors.
const BACKEND: &str = "postgres";

/// A PostgreSQL error as the store's: no answer in time; unreachable
/// ([`PostgresError::unreachable`]); or a refusal or failure.
impl From<PostgresError> for StoreError {
    fn from(e: PostgresError) -> Self {
        match e {
            PostgresError::Timeout(_) => StoreError::timeout(BACKEND, e),
            _ if e.unreachable() => StoreError::unavailable(BACKEND, e),
            _ => StoreError::failed(BACKEND, e),
        }
    }
}

/// An error with its causes: the server's message, the I/O error or the TLS alert.
fn describe(e: &tokio_postgres::Error) -> String {
    let mut out = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

impl PostgresError {
    /// Whether the server could not be reached (or answered too late), as opposed to refusing
    /// what was asked: a wrong password, a TLS setup that cannot work, a table that is not ours.
    pub fn unreachable(&self) -> bool {
        match self {
            PostgresError::Timeout(_) | PostgresError::Pool(_) => true,
            PostgresError::Db(e) => {
                // A socket that failed (refused, reset, timed out, name not found), not a TLS
                // handshake (tokio-postgres has no public error kind: told by its message).
                let mut causes =
                    std::iter::successors(std::error::Error::source(e), |c| c.source());
                let io = causes.any(|c| c.is::<std::io::Error>());
                (io || e.is_closed()) && !e.to_string().contains("TLS")
            }
            _ => false,
        }
    }
}

/// A handle to the PostgreSQL store; clones share one pool, and [`PostgresStore::for_worker`]
/// gives a worker thread a pool of its own. The reaper runs on the runtime the store was made
/// on, while a handle lives.
#[derive(Clone)]
pub struct PostgresStore {
    shared: Arc<Shared>,
    // Its connections' tasks run on the runtime that made them: the pool's users' own, so that
    // a statement's answer wakes no other thread.
    pool: Pool,
    // Stops the reaper when the last handle goes; the task holds only a weak reference. None
    // when made outside a tokio runtime: expired rows are then only ignored, not deleted.
    _reaper: Option<Arc<AbortOnDropHandle<()>>>,
}

struct Shared {
    connector: Connector,
    pool_size: usize,
    // This process's requests waiting on a key, woken by its completions and releases.
    waiters: Arc<Signals>,
    // Hears other gateways' evictions, once asked to (`on_evicted`); stops with the store.
    listener: std::sync::OnceLock<AbortOnDropHandle<()>>,
    sql: Sql,
    // How records are written and read (sealed or not).
    codec: Codec,
    table: String,
    timeout: Duration,
    // Set once the table is known to be there at a version this build serves; until then each
    // operation checks first (a store opened while PostgreSQL was down).
    ready: tokio::sync::OnceCell<()>,
    // The migration's connections: every statement bounded by `migration_timeout`.
    migrator: Connector,
    migration_timeout: Duration,
    // The migration of a table found at an older version; stops with the store.
    migration: std::sync::OnceLock<AbortOnDropHandle<()>>,
    // The runtime the store was made on (the reaper's), for the migration's task.
    runtime: Option<tokio::runtime::Handle>,
}

impl Shared {
    /// Migrate the table from version `from` in the background, once per store.
    fn migrate(&self, from: u32) {
        self.migration.get_or_init(|| {
            tracing::info!(
                table = self.table,
                from,
                to = schema::VERSION,
                "the PostgreSQL records table is at an older schema: serving it as it is while it is migrated in the background (indexes built concurrently, writers never blocked)"
            );
            let wait = self.migration_timeout.saturating_add(self.timeout);
            let task = migration(self.migrator.clone(), self.table.clone(), wait);
            let runtime = self
                .runtime
                .clone()
                .unwrap_or_else(tokio::runtime::Handle::current);
            AbortOnDropHandle::new(runtime.spawn(task))
        });
    }
}

/// Migrate `table` until it is at this build's version, looking again every
/// [`MIGRATION_RETRY`] while another process migrates it, and trying again after a failure,
/// each statement waited for at most `wait`. Each attempt has a connection of its own, closed
/// with it: the session's advisory lock goes with it whatever happened.
async fn migration(connector: Connector, table: String, wait: Duration) {
    let (mut retry, mut told) = (MIGRATION_RETRY, false);
    loop {
        let started = Instant::now();
        let attempt = async {
            let client = connector.connect().await?;
            schema::migrate(&client, &table, wait).await
        };
        match attempt.await {
            Ok(schema::Migrated::From(from)) => {
                let took = started.elapsed();
                tracing::info!(
                    table,
                    from,
                    to = schema::VERSION,
                    ?took,
                    "migrated the PostgreSQL records table"
                );
                return;
            }
            Ok(schema::Migrated::Already) => {
                tracing::info!(
                    table,
                    "the PostgreSQL records table was migrated by another process"
                );
                return;
            }
            Ok(schema::Migrated::Elsewhere) => {
                if !told {
                    told = true;
                    tracing::info!(table, "another process is migrating the PostgreSQL records table; serving it as it is meanwhile");
                }
                tokio::time::sleep(MIGRATION_RETRY).await;
            }
            // Not ours to migrate any more (a newer idemgate did, or the table was replaced).
            Err(e @ (PostgresError::SchemaTooNew { .. } | PostgresError::NotOurs { .. })) => {
                tracing::warn!(table, error = %e, "stopped migrating the PostgreSQL records table");
                return;
            }
            Err(e) => {
                tracing::warn!(table, error = %e, retry_in = ?retry, "could not migrate the PostgreSQL records table; serving it as it is meanwhile, and trying again (a statement past store.migration_timeout is cancelled, and an index it left invalid built again)");
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(MIGRATION_RETRY_MAX);
            }
        }
    }
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.shared.table)
            .finish_non_exhaustive()
    }
}

/// The connection settings of `url`. Errors never show the URL (it may hold a password).
pub(crate) fn connect_config(url: &str) -> Result<tokio_postgres::Config, String> {
    // tokio-postgres knows disable, prefer and require; the certificate is always verified
    // (rustls), so verify-ca and verify-full are require.
    let url = url
        .replace("sslmode=verify-full", "sslmode=require")
        .replace("sslmode=verify-ca", "sslmode=require");
    url.parse::<tokio_postgres::Config>()
        .map_err(|e| format!("not a PostgreSQL connection URL: {}", describe(&e)))
}

/// The two statements of a miss on `table`: the claim's and the completion's, with their
/// parameters `$1` key, `$2` token, `$3` record and `$4` lease or TTL in milliseconds. For
/// benchmarks that run them without the gateway (loadtest's pgbench script).
pub fn miss_statements(table: &str) -> [String; 2] {
    let sql = Sql::for_table(table, REAP_BATCH);
    [sql.claim, sql.complete]
}

/// How to open a connection: the pool's, the eviction listener's and the migration's.
#[derive(Clone)]
struct Connector {
    // The URL's settings, with the statement bound appended to its options.
    config: tokio_postgres::Config,
    // The URL's own `options`, which the statement bound follows (and so wins over).
    options: Option<String>,
    // None with sslmode=disable.
    tls: Option<tokio_postgres_rustls::MakeRustlsConnect>,
    timeout: Duration,
}

/// `bound` as PostgreSQL's `statement_timeout` in milliseconds: at least 1 (0 would turn it
/// off), at most [`MAX_STATEMENT_TIMEOUT_MS`].
fn statement_timeout_ms(bound: Duration) -> u64 {
    crate::time::millis(bound).min(MAX_STATEMENT_TIMEOUT_MS)
}

impl Connector {
    /// The connections `settings` describe.
    fn new(settings: &PostgresSettings) -> Result<Self, PostgresError> {
        let mut config = connect_config(&settings.url)
            .map_err(|why| PostgresError::Config(format!("store.url: {why}")))?;
        config.connect_timeout(settings.timeout);
        let options = config.get_options().map(str::to_string);
        if config.get_application_name().is_none() {
            config.application_name("idemgate");
        }
        let tls = match config.get_ssl_mode() {
            tokio_postgres::config::SslMode::Disable => None,
            _ => {
                let (ca, client) = (settings.tls.ca_file.as_deref(), settings.tls.client_pair());
                let tls = crate::tls::client_config(ca, client, &[]).map_err(|(file, why)| {
                    PostgresError::Config(format!("store.{}: {why}", super::tls_field(file)))
                })?;
                Some(tokio_postgres_rustls::MakeRustlsConnect::new(tls))
            }
        };
        // The server, too, gives up on a statement the gateway stopped waiting for.
        Ok(Connector {
            config,
            options,
            tls,
            timeout: settings.timeout,
        }
        .bounding(settings.timeout))
    }

    /// These connections, with every statement cancelled by the server `bound` after it began
    /// (unless set otherwise for one statement):
    /// `-c statement_timeout` after the URL's own options, so that it wins over a
    /// `statement_timeout` set there (or for the role or the database).
    fn bounding(mut self, bound: Duration) -> Self {
        let ours = format!("-c statement_timeout={}", statement_timeout_ms(bound));
        let options = match &self.options {
            Some(theirs) if !theirs.trim().is_empty() => format!("{theirs} {ours}"),
            _ => ours,
        };
        self.config.options(options);
        self
    }

    /// One connection apart from the pool, driven by a task of its own until the client is
    /// dropped; connecting and logging in within `timeout`.
    async fn connect(&self) -> Result<tokio_postgres::Client, PostgresError> {
        let connected = async {
            match &self.tls {
                None => {
                    let (client, conn) = self.config.connect(tokio_postgres::NoTls).await?;
                    tokio::spawn(conn);
                    Ok(client)
                }
                Some(tls) => {
                    let (client, conn) = self.config.connect(tls.clone()).await?;
                    tokio::spawn(conn);
                    Ok(client)
                }
            }
        };
        let deadline = crate::time::after(Instant::now(), self.timeout);
        bounded(deadline, self.timeout, connected).await
    }

    /// A pool of up to `size` connections; nothing is connected yet.
    fn pool(&self, size: usize) -> Result<Pool, PostgresError> {
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let config = self.config.clone();
        let manager = match &self.tls {
            None => Manager::from_config(config, tokio_postgres::NoTls, manager_config),
            Some(tls) => Manager::from_config(config, tls.clone(), manager_config),
        };
        Pool::builder(manager)
            .max_size(size.max(1))
            .wait_timeout(Some(self.timeout))
            .create_timeout(Some(self.timeout))
            .recycle_timeout(Some(self.timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| PostgresError::Config(e.to_string()))
    }
}

impl PostgresStore {
    /// Connect, create the table when it is missing (or check its version, and start migrating
    /// an older one in the background), and start the reaper. Fails when PostgreSQL cannot be
    /// reached or refuses.
    pub async fn connect(settings: &PostgresSettings) -> Result<Self, StoreError> {
        let store = Self::lazy(settings)?;
        store.ready().await?;
        Ok(store)
    }

    /// The store without connecting: the table is checked by the first operation that reaches
    /// PostgreSQL. For a server that is down at start-up.
    pub fn lazy(settings: &PostgresSettings) -> Result<Self, StoreError> {
        let connector = Connector::new(settings)?;
        let pool = connector.pool(settings.pool_size)?;
        let runtime = tokio::runtime::Handle::try_current().ok();
        let shared = Arc::new(Shared {
            migrator: connector.clone().bounding(settings.migration_timeout),
            migration_timeout: settings.migration_timeout,
            migration: std::sync::OnceLock::new(),
            runtime: runtime.clone(),
            connector,
            pool_size: settings.pool_size,
            waiters: Arc::default(),
            listener: std::sync::OnceLock::new(),
            sql: Sql::for_table(&settings.table, REAP_BATCH),
            codec: Codec::new(false, settings.seal.clone()),
            table: settings.table.clone(),
            timeout: settings.timeout,
            ready: tokio::sync::OnceCell::new(),
        });
        let (weak, reaping) = (Arc::downgrade(&shared), pool.clone());
        let reaper = runtime.map(|rt| rt.spawn(async move {
            let mut tick = tokio::time::interval(REAP_EVERY);
            loop {
                tick.tick().await;
                let Some(shared) = weak.upgrade() else { return };
                let store = Handle { shared: &shared, pool: &reaping };
                if let Err(e) = store.reap().await {
                    tracing::debug!(error = %e, "the PostgreSQL reaper could not delete expired rows");
                }
            }
        }));
        Ok(PostgresStore {
            shared,
            pool,
            _reaper: reaper.map(|task| Arc::new(AbortOnDropHandle::new(task))),
        })
    }

    /// The handle one of `workers` worker threads uses: this store with a pool of its own of
    /// `pool_size / workers` connections (rounded up), made and driven on the calling thread's
    /// runtime. Waiters, the table check and the reaper stay shared.
    pub fn for_worker(&self, workers: usize) -> Result<Self, StoreError> {
        let size = self.shared.pool_size.div_ceil(workers.max(1));
        Ok(PostgresStore {
            shared: self.shared.clone(),
            pool: self.shared.connector.pool(size)?,
            _reaper: self._reaper.clone(),
        })
    }

    /// How to run statements on this store's pool.
    fn handle(&self) -> Handle<'_> {
        Handle {
            shared: &self.shared,
            pool: &self.pool,
        }
    }

    /// The table exists at our version (checked once per store, then remembered).
    async fn ready(&self) -> Result<(), StoreError> {
        self.handle().ready().await
    }

    /// Delete expired rows, a batch at a time; how many (the reaper's step, public for tests).
    pub async fn reap(&self) -> Result<u64, StoreError> {
        self.handle().reap().await
    }

    /// Hear of evictions from now on, from this process and every other on the table, over a
    /// connection of its own (kept until the store is dropped; made again when it fails). Each
    /// time it is made, `f` first hears [`Evicted::All`]. Returns once it listens, or after the
    /// timeout (at once when the store has not reached PostgreSQL yet). The first call wins;
    /// outside a tokio runtime, nothing is heard.
    pub async fn on_evicted(&self, f: impl Fn(Evicted) + Send + Sync + 'static) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let shared = &self.shared;
        let (tx, mut listening) = tokio::sync::watch::channel(false);
        let mut first = false;
        shared.listener.get_or_init(|| {
            first = true;
            let (connector, channel) = (shared.connector.clone(), listen::channel(&shared.table));
            let task = listen::listen(connector, channel, Arc::new(f), tx);
            AbortOnDropHandle::new(rt.spawn(task))
        });
        if first && shared.ready.initialized() {
            let _ = tokio::time::timeout(shared.timeout, listening.wait_for(|l| *l)).await;
        }
    }

    /// The table the records are in.
    pub fn table(&self) -> &str {
        &self.shared.table
    }
}

/// The shared state and a pool, borrowed: what the reaper task and the handles run statements
/// with.
struct Handle<'a> {
    shared: &'a Shared,
    pool: &'a Pool,
}

impl Handle<'_> {
    async fn ready(&self) -> Result<(), StoreError> {
        let shared = self.shared;
        shared
            .ready
            .get_or_try_init(|| async {
                let deadline = crate::time::after(Instant::now(), shared.timeout);
                let mut client = self.checkout(deadline).await?;
                let checked = schema::check(&mut client, &shared.table);
                let found = match tokio::time::timeout_at(deadline, checked).await {
                    Ok(found) => found?,
                    Err(_) => {
                        // Not handed back to the pool inside a transaction.
                        drop(deadpool_postgres::Object::take(client));
                        return Err(PostgresError::Timeout(shared.timeout));
                    }
                };
                if let schema::Found::Older(from) = found {
                    shared.migrate(from);
                }
                Ok(())
            })
            .await?;
        Ok(())
    }

    async fn checkout(
        &self,
        deadline: Instant,
    ) -> Result<deadpool_postgres::Client, PostgresError> {
        let timeout = self.shared.timeout;
        bounded(deadline, timeout, async {
            self.pool.get().await.map_err(|e| match e {
                deadpool_postgres::PoolError::Backend(e) => PostgresError::Db(e),
                deadpool_postgres::PoolError::Timeout(_) => PostgresError::Timeout(timeout),
                other => PostgresError::Pool(other.to_string()),
            })
        })
        .await
    }

    /// The rows `statement` returns with `params`.
    #[expect(clippy::unreachable, reason = "run answers rows when asked for rows")]
    async fn query(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        match self.run(statement, params, true).await? {
            Answer::Rows(rows) => Ok(rows),
            Answer::Count(_) => unreachable!("asked for rows"),
        }
    }

    /// How many rows `statement` touched with `params`.
    #[expect(clippy::unreachable, reason = "run answers a count when asked for one")]
    async fn execute(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        match self.run(statement, params, false).await? {
            Answer::Count(n) => Ok(n),
            Answer::Rows(_) => unreachable!("asked for a count"),
        }
    }

    /// Run `statement` on a pooled connection (prepared once per connection), the whole within
    /// the timeout. The server gives up on the statement when the gateway does: the
    /// connection's `statement_timeout` is the whole timeout, counted from the statement's
    /// start, so a statement that starts late (after a wait for a connection) is preceded by
    /// `SET statement_timeout` to the time left, and followed by one setting it back, in the
    /// same round trip. A connection whose answer is late is dropped, not handed to the next
    /// caller behind it.
    async fn run(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
        rows: bool,
    ) -> Result<Answer, StoreError> {
        self.ready().await?;
        let timeout = self.shared.timeout;
        let deadline = crate::time::after(Instant::now(), timeout);
        let client = self.checkout(deadline).await?;
        let prepared = tokio::time::timeout_at(deadline, client.prepare_cached(statement)).await;
        let prepared = match prepared {
            Ok(prepared) => prepared.map_err(PostgresError::Db)?,
            Err(_) => return Err(late(client, timeout)),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let statement = async {
            Ok(match rows {
                true => Answer::Rows(client.query(&prepared, params).await?),
                false => Answer::Count(client.execute(&prepared, params).await?),
            })
        };
        let answer = tokio::time::timeout_at(deadline, async {
            if timeout.saturating_sub(left) <= LATE_START {
                return (statement.await, true);
            }
            let bound = |d| format!("SET statement_timeout = {}", statement_timeout_ms(d));
            let (shortened, restored) = (bound(left), bound(timeout));
            let (set, answer, reset) = tokio::join!(
                client.batch_execute(&shortened),
                statement,
                client.batch_execute(&restored),
            );
            (answer, set.is_ok() && reset.is_ok())
        })
        .await;
        match answer {
            Ok((answer, bound_again)) => {
                if !bound_again {
                    // Its statement_timeout is not known: not handed to the next caller.
                    drop(deadpool_postgres::Object::take(client));
                }
                Ok(answer.map_err(PostgresError::Db)?)
            }
            Err(_) => Err(late(client, timeout)),
        }
    }

    async fn reap(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let n = self.execute(&self.shared.sql.reap, &[]).await?;
            total += n;
            if n < u64::from(REAP_BATCH) {
                return Ok(total);
            }
        }
    }
}

/// The error of a statement not answered within `timeout` on `client`, which is closed rather
/// than handed to the next caller behind the late answer.
fn late(client: deadpool_postgres::Client, timeout: Duration) -> StoreError {
    drop(deadpool_postgres::Object::take(client));
    PostgresError::Timeout(timeout).into()
}

/// What a statement gave back.
enum Answer {
    Rows(Vec<Row>),
    Count(u64),
}

/// `work` within `deadline`, or [`PostgresError::Timeout`].
async fn bounded<T>(
    deadline: Instant,
    timeout: Duration,
    work: impl std::future::Future<Output = Result<T, PostgresError>>,
) -> Result<T, PostgresError> {
    tokio::time::timeout_at(deadline, work)
        .await
        .unwrap_or(Err(PostgresError::Timeout(timeout)))
}

/// Milliseconds for a statement's interval parameter: bounded by MAX_DURATION, whose
/// milliseconds PostgreSQL's interval holds (an interval of i64::MAX ms is out of range).
fn millis(d: Duration) -> i64 {
    i64::try_from(crate::time::millis(d)).unwrap_or(i64::MAX)
}

/// The entry a returned row of `key`'s record holds (`record`, milliseconds left: NULL when kept
/// forever).
fn entry_of(
    codec: &Codec,
    key: &ScopedKey,
    row: &Row,
) -> Result<(crate::record::Entry, Token), StoreError> {
    let raw: Vec<u8> = row.get(0);
    let left: Option<i64> = row.get(1);
    let (mut entry, holder) = codec.decode(key, Bytes::from(raw))?;
    entry.expires_in = left.map(|left| Duration::from_millis(left.max(0) as u64));
    Ok((entry, holder))
}

impl Store for PostgresStore {
    /// One statement: the key's live row decides; else, with [`AfterExpiry::Refuse`], its live
    /// tombstone; else the key is taken.
    async fn claim(&self, who: &Claimant, terms: ClaimTerms) -> StoreResult<Claim> {
        let (key, fingerprint, token) = (&who.key, &who.fingerprint, &who.token);
        let record = self.shared.codec.claim(fingerprint, token);
        let s = self.handle();
        let (lease, at) = (millis(terms.lease), key.tombstone());
        let (k, t, r, a) = (&key.0[..], &token.0[..], &record[..], &at.0[..]);
        // The tombstone's key ($5) only for the statement that reads it.
        let params: [&(dyn ToSql + Sync); 5] = [&k, &t, &r, &lease, &a];
        let (sql, params) = match terms.after_expiry {
            AfterExpiry::Refuse => (&self.shared.sql.claim_unless_expired, &params[..]),
            AfterExpiry::Run => (&self.shared.sql.claim, &params[..4]),
        };
        // No row: another claimant won the key after this statement's snapshot was taken; the
        // next run sees its row. Each lost race means the key changed hands in between.
        for _ in 0..CLAIM_RUNS {
            let rows = s.query(sql, params).await?;
            if let Some(row) = rows.first() {
                let (held, holder) = entry_of(&self.shared.codec, key, row)?;
                return Ok(Claim::decide(held, &holder, fingerprint, token));
            }
        }
        Err(PostgresError::Contended.into())
    }

    async fn complete(&self, who: &Claimant, state: &EntryState, keep: Keep) -> StoreResult<bool> {
        let (key, fingerprint) = (&who.key, &who.fingerprint);
        let codec = &self.shared.codec;
        let record = codec
            .record(key, fingerprint, &who.token, state)
            .into_bytes();
        let s = self.handle();
        let ttl = keep.ttl.finite().map(millis);
        let at = key.tombstone();
        let (k, t) = (&&key.0[..], &&who.token.0[..]);
        let rows = match codec.tombstone(key, keep, fingerprint, state) {
            None if keep.tombstone.is_none() => {
                let sql = &self.shared.sql.complete;
                s.query(sql, &[k, t, &&record[..], &ttl]).await?
            }
            // A record kept forever leaves no tombstone, but a live one keeps it out.
            None => {
                let sql = &self.shared.sql.complete_unless_expired;
                s.query(sql, &[k, t, &&record[..], &ttl, &&at.0[..]])
                    .await?
            }
            Some((tombstone, lives)) => {
                let (at, lives) = (&&at.0[..], millis(lives));
                let sql = &self.shared.sql.complete_with_tombstone;
                let params: [&(dyn ToSql + Sync); 7] =
                    [k, t, &&record[..], &ttl, at, &&tombstone[..], &lives];
                s.query(sql, &params).await?
            }
        };
        self.shared.waiters.wake(&key.0);
        Ok(rows.first().is_some_and(|row| row.get::<_, bool>(0)))
    }

    async fn release(&self, who: &Claimant) -> StoreResult<bool> {
        let (key, token) = (&who.key, &who.token);
        let s = self.handle();
        let n = s
            .execute(&self.shared.sql.release, &[&&key.0[..], &&token.0[..]])
            .await?;
        self.shared.waiters.wake(&key.0);
        Ok(n == 1)
    }

    /// Wakes the waiters of this process when this process completes or releases the key;
    /// waiters on another gateway's request poll (a `NOTIFY` per completion would serialise
    /// the commits of every gateway on the server: it holds a server-wide lock until commit).
    async fn watch(&self, key: &ScopedKey) -> Option<Watch> {
        Some(Local::watch(&self.shared.waiters, &key.0))
    }

    async fn renew(&self, who: &Claimant, lease: Duration) -> StoreResult<bool> {
        let (key, token) = (&who.key, &who.token);
        let s = self.handle();
        let n = s
            .execute(
                &self.shared.sql.renew,
                &[&&key.0[..], &&token.0[..], &millis(lease)],
            )
            .await?;
        Ok(n == 1)
    }
}

impl Inspect for PostgresStore {
    async fn ping(&self) -> StoreResult<()> {
        self.handle().query("SELECT 1", &[]).await.map(drop)
    }

    async fn inspect(&self, key: &ScopedKey) -> StoreResult<Option<Inspected>> {
        let at = key.tombstone();
        let rows = self
            .handle()
            .query(&self.shared.sql.inspect, &[&&key.0[..], &&at.0[..]])
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let stored_bytes = row.get::<_, &[u8]>(0).len();
        let (entry, _) = entry_of(&self.shared.codec, key, row)?;
        Ok(Some(Inspected {
            expires_in: entry.expires_in,
            entry,
            stored_bytes,
        }))
    }

    async fn evict(&self, key: &ScopedKey) -> StoreResult<bool> {
        let rows = self
            .handle()
            .query(
                &self.shared.sql.evict,
                &[&&key.0[..], &&key.tombstone().0[..]],
            )
            .await?;
        Ok(rows.iter().any(|r| r.get::<_, bool>(0)))
    }

    async fn evict_all(&self) -> StoreResult<u64> {
        let rows = self.handle().query(&self.shared.sql.evict_all, &[]).await?;
        Ok(rows.first().map_or(0, |r| r.get::<_, i64>(0).max(0) as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::MAX_DURATION;

    #[test]
    fn every_connection_bounds_its_statements_after_the_urls_own_options() {
        let url = "postgres://gw@db/pay?sslmode=disable&options=-c%20statement_timeout%3D0%20-c%20search_path%3Dpay";
        let ours = Connector::new(&PostgresSettings::new(url).timeout(Duration::from_millis(250)))
            .unwrap();
        assert_eq!(
            ours.config.get_options(),
            Some("-c statement_timeout=0 -c search_path=pay -c statement_timeout=250")
        );
        // The migration's connections: the URL's options, then their own bound.
        let migrating = ours.clone().bounding(Duration::from_secs(60));
        assert_eq!(
            migrating.config.get_options(),
            Some("-c statement_timeout=0 -c search_path=pay -c statement_timeout=60000")
        );
        let plain = Connector::new(&PostgresSettings::new(
            "postgres://gw@db/pay?sslmode=disable",
        ))
        .unwrap();
        assert_eq!(
            plain.config.get_options(),
            Some("-c statement_timeout=2000")
        );
    }

    #[test]
    fn statement_timeouts_stay_within_what_postgresql_takes() {
        // 0 would turn the bound off; past INT_MAX ms the server refuses the connection.
        assert_eq!(statement_timeout_ms(Duration::from_nanos(1)), 1);
        assert_eq!(statement_timeout_ms(Duration::from_millis(1)), 1);
        assert_eq!(statement_timeout_ms(Duration::from_millis(1500)), 1500);
        assert_eq!(statement_timeout_ms(MAX_DURATION), i32::MAX as u64);
        assert_eq!(statement_timeout_ms(Duration::MAX), i32::MAX as u64);
    }
}
