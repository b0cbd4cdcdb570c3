//! The durable embedded store: records in a [redb](https://docs.rs/redb) file in a directory the
//! gateway owns, kept across restarts and crashes.
//!
//! Every write goes through one writer thread (redb allows one write transaction at a time):
//! it takes every operation waiting on its queue, applies them in one transaction and commits
//! once, with one fsync when `fsync` is on (group commit), and only then answers each. A request
//! proceeds once its batch is durable. Reads that change nothing (a claim that finds a record or
//! another's claim, inspect) read a snapshot without queueing.
//!
//! Each entry is the record codec's encoding (`codec.rs`) behind its expiry time (ms since the
//! Unix epoch, big-endian). Two indexes by expiry, claims and completed records apart, let the
//! background purge and the bounds (`max_entries`, `max_bytes`, as in the memory store: the
//! completed records closest to expiry go first, claims never) find entries without a scan.
//!
//! A failed commit (a full disk) leaves redb refusing everything, so the writer closes the file
//! and opens it again, which recovers the last durable commit.

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use prometheus_client::metrics::counter::Counter;
use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
};
use tokio::sync::{mpsc, oneshot};
use tokio_util::task::AbortOnDropHandle;

use super::codec::{self, Codec};
use super::{Claim, ClaimTerms, Claimant, Inspected, Keep, Store, StoreError};
use crate::metrics::Evictions;
use crate::record::key::ScopedKey;
use crate::record::policy::AfterExpiry;
use crate::record::policy::Ttl;
use crate::record::{now_ms, EntryState, Token};
use crate::time;

mod settings;

pub use self::settings::EmbeddedSettings;

/// Entries by key: expiry (u64 big-endian ms) then the encoded entry.
const ENTRIES: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new("entries");
/// In-flight claims by expiry: expiry (big-endian) then key.
const CLAIMS: TableDefinition<&[u8; 40], ()> = TableDefinition::new("claims_by_expiry");
/// Completed records by expiry: expiry (big-endian) then key.
const RECORDS: TableDefinition<&[u8; 40], ()> = TableDefinition::new("records_by_expiry");
/// Counters kept in step with the entries: the bytes they weigh.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// The file in the store's directory.
pub const FILE_NAME: &str = "idemgate.redb";

/// How often expired entries are purged.
pub const PURGE_EVERY: Duration = Duration::from_secs(1);

/// Without `fsync`, a commit at least this long after the last durable one is made durable:
/// redb keeps a non-durable commit in its own memory, so this bounds what a crash of the
/// process, or of the machine, loses.
pub const DURABLE_EVERY: Duration = Duration::from_secs(1);

/// After a failed write, the file is reopened at most this often until it opens.
const REOPEN_EVERY: Duration = Duration::from_secs(1);

/// Most expired entries one purge transaction deletes (more follow at once when there are).
const PURGE_BATCH: usize = 1000;

/// Most operations one transaction takes from the queue.
const MAX_BATCH: usize = 4096;

/// Operations waiting for the writer at most; past it, callers wait for room.
const QUEUE: usize = 8192;

/// What an entry weighs besides its encoding: its key, its index row and B-tree overhead.
const ENTRY_OVERHEAD: u64 = 128;

/// A handle to the embedded store; clones share one file and one writer. The writer thread and
/// the purge task stop when the last handle goes, and the file's lock with them.
#[derive(Debug, Clone)]
pub struct EmbeddedStore {
    db: Arc<Slot>,
    // The writer's queue; the thread ends when every sender is gone.
    writer: mpsc::Sender<Op>,
    // How long an operation waits for its batch.
    timeout: Duration,
    // Aborts the purge task when the last handle is dropped; it holds only a weak sender.
    _purger: Option<Arc<AbortOnDropHandle<()>>>,
    // Durable commits so far: the fsyncs.
    commits: Counter,
    // How records are written and read (sealed or not).
    codec: Codec,
}

/// The open database, shared by the handles and the writer; none between a failed write (after
/// which redb refuses every operation until the file is reopened) and its reopening. Reads hold
/// the lock for their whole read, so that the writer can close the file.
#[derive(Debug)]
struct Slot {
    db: RwLock<Option<Database>>,
    file: PathBuf,
}

impl Slot {
    /// `f` on the open database, or a store error while it is being reopened.
    fn with<T>(&self, f: impl FnOnce(&Database) -> Result<T, StoreError>) -> Result<T, StoreError> {
        let db = self.db.read().unwrap_or_else(PoisonError::into_inner);
        match db.as_ref() {
            Some(db) => f(db),
            None => Err(StoreError::Embedded(format!(
                "{} is being reopened after a write failed",
                self.file.display()
            ))),
        }
    }

    fn is_open(&self) -> bool {
        self.db
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Close the file and open it again (redb recovers the last durable commit); when it will
    /// not open, the store stays closed until the next try.
    /// The lock is held only to take the old database out and to put the new one in: opening a
    /// file (recovering it) takes seconds, and requests on the worker threads, which read under
    /// this lock, get a store error meanwhile instead of stalling every connection.
    fn reopen(&self) {
        let old = self
            .db
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(old);
        match open_file(&self.file).and_then(|reopened| init(&reopened).map(|()| reopened)) {
            Ok(reopened) => {
                tracing::warn!(file = %self.file.display(), "embedded store reopened after a failed write");
                *self.db.write().unwrap_or_else(PoisonError::into_inner) = Some(reopened);
            }
            Err(e) => {
                tracing::error!(error = %e, "embedded store: cannot reopen the file after a failed write; trying again with the next write");
            }
        }
    }
}

/// A write for the writer, with where its answer goes.
#[derive(Debug)]
struct Op {
    what: Write,
    reply: oneshot::Sender<Result<Done, StoreError>>,
}

#[derive(Debug)]
enum Write {
    Claim {
        who: Claimant,
        lease: Duration,
        // Whether a live tombstone keeps the key from being claimed.
        tombstones: bool,
    },
    Complete {
        who: Claimant,
        value: Bytes,
        ttl: Ttl,
        // Whether the route keeps tombstones: a live one then keeps a late completion out.
        refuses: bool,
        // The tombstone the record leaves, and how long it lives.
        tombstone: Option<(Bytes, Duration)>,
    },
    Release(Claimant),
    Renew {
        who: Claimant,
        lease: Duration,
    },
    Evict(ScopedKey),
    EvictAll,
    Purge,
}

/// A write's answer.
#[derive(Debug)]
enum Done {
    // The claim's answer: claimed (`None`), or the live entry that decides, with its expiry.
    Claim(Option<(u64, Bytes)>),
    Yes(bool),
    Count(u64),
}

/// A writer's answer of the wrong kind, as an error rather than a panic.
fn unexpected(what: &str, answer: Done) -> StoreError {
    StoreError::Embedded(format!("{what} got the answer {answer:?}"))
}

/// A storage failure as the store's error.
fn failed(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Embedded(format!("{what}: {e}"))
}

impl EmbeddedStore {
    /// Open (or create) the store in `settings.path`. Fails when the directory cannot be made,
    /// the file is unreadable, or another process holds it.
    pub fn open(settings: &EmbeddedSettings) -> Result<Self, StoreError> {
        Self::open_counted(settings, Counter::default(), Evictions::default())
    }

    /// [`open`](Self::open), counting its durable commits into `commits` (the gateway's
    /// `idemgate_store_commits_total`) and the records it evicts for room into `evictions`
    /// (`idemgate_store_evictions_total`), once their transaction is committed.
    pub fn open_counted(
        settings: &EmbeddedSettings,
        commits: Counter,
        evictions: Evictions,
    ) -> Result<Self, StoreError> {
        let dir = &settings.path;
        std::fs::create_dir_all(dir).map_err(|e| failed(&dir.display().to_string(), e))?;
        let file = dir.join(FILE_NAME);
        let db = open_file(&file)?;
        init(&db)?;
        let db = Arc::new(Slot {
            db: RwLock::new(Some(db)),
            file,
        });
        let (writer, queue) = mpsc::channel(QUEUE);
        let limits = Limits {
            max_entries: settings.max_entries.max(1) as u64,
            max_bytes: settings.max_bytes.max(1),
            fsync: settings.fsync,
        };
        let for_writer = db.clone();
        let counted = commits.clone();
        std::thread::Builder::new()
            .name("idemgate-store".into())
            .spawn(move || write_loop(&for_writer, queue, limits, (&counted, &evictions)))
            .map_err(|e| failed("writer thread", e))?;
        let purger = tokio::runtime::Handle::try_current().ok().map(|rt| {
            let weak = writer.downgrade();
            Arc::new(AbortOnDropHandle::new(rt.spawn(purge_loop(weak))))
        });
        Ok(EmbeddedStore {
            db,
            writer,
            timeout: settings.timeout,
            codec: Codec::new(false, settings.seal.clone()),
            _purger: purger,
            commits,
        })
    }

    /// Durable commits this store has made: its fsyncs (with `fsync`, one per batch of requests;
    /// without, about one every [`DURABLE_EVERY`]). Read beside the claims served, it gives
    /// fsyncs per claim.
    pub fn commits(&self) -> u64 {
        self.commits.get()
    }

    /// Queue `what` for the writer and wait until its batch is committed.
    async fn write(&self, what: Write) -> Result<Done, StoreError> {
        let (reply, answer) = oneshot::channel();
        let queued = async {
            self.writer
                .send(Op { what, reply })
                .await
                .map_err(|_| StoreError::Embedded("the writer has stopped".into()))?;
            answer
                .await
                .map_err(|_| StoreError::Embedded("the writer has stopped".into()))?
        };
        match tokio::time::timeout(self.timeout, queued).await {
            Ok(done) => done,
            Err(_) => Err(StoreError::Embedded(format!(
                "no commit within {} (store.timeout)",
                humantime::format_duration(self.timeout)
            ))),
        }
    }

    /// What `key` holds now, unexpired: its expiry (ms) and encoding; else, with `tombstone`,
    /// its live tombstone. Both from one snapshot.
    fn read(&self, key: &ScopedKey, tombstone: bool) -> Result<Option<(u64, Bytes)>, StoreError> {
        self.db.with(|db| {
            let txn = db.begin_read().map_err(|e| failed("read", e))?;
            let table = txn.open_table(ENTRIES).map_err(|e| failed("read", e))?;
            let now = now_ms();
            let live = |at: &ScopedKey| -> Result<Option<(u64, Bytes)>, StoreError> {
                let value = table.get(&at.0).map_err(|e| failed("read", e))?;
                Ok(value
                    .and_then(|v| split(v.value()))
                    .filter(|(at, _)| *at > now))
            };
            match live(key)? {
                Some(found) => Ok(Some(found)),
                None if tombstone => live(&key.tombstone()),
                None => Ok(None),
            }
        })
    }

    /// Purge expired entries now (the background task does it every [`PURGE_EVERY`]); how
    /// many went.
    pub async fn purge_expired(&self) -> Result<u64, StoreError> {
        match self.write(Write::Purge).await? {
            Done::Count(n) => Ok(n),
            other => Err(unexpected("a purge", other)),
        }
    }

    async fn yes(&self, what: Write) -> Result<bool, StoreError> {
        match self.write(what).await? {
            Done::Yes(b) => Ok(b),
            other => Err(unexpected("a fenced write", other)),
        }
    }
}

/// Open (or create) the database file; refused when another process holds it.
fn open_file(file: &Path) -> Result<Database, StoreError> {
    Database::create(file).map_err(|e| match e {
        redb::DatabaseError::DatabaseAlreadyOpen => StoreError::Embedded(format!(
            "{} is held by another process (one gateway per store.path)",
            file.display()
        )),
        e => failed(&file.display().to_string(), e),
    })
}

/// Create the tables when they are missing, so that reads find them.
fn init(db: &Database) -> Result<(), StoreError> {
    let txn = db.begin_write().map_err(|e| failed("init", e))?;
    {
        txn.open_table(ENTRIES).map_err(|e| failed("init", e))?;
        txn.open_table(CLAIMS).map_err(|e| failed("init", e))?;
        txn.open_table(RECORDS).map_err(|e| failed("init", e))?;
        txn.open_table(META).map_err(|e| failed("init", e))?;
    }
    txn.commit().map_err(|e| failed("init", e))
}

/// An entry's expiry and encoding.
fn split(value: &[u8]) -> Option<(u64, Bytes)> {
    let (at, encoding) = value.split_first_chunk::<8>()?;
    Some((u64::from_be_bytes(*at), Bytes::copy_from_slice(encoding)))
}

/// An index row: expiry then key, so rows sort by expiry.
fn index_key(at: u64, key: &[u8; 32]) -> [u8; 40] {
    let mut row = [0u8; 40];
    row[..8].copy_from_slice(&at.to_be_bytes());
    row[8..].copy_from_slice(key);
    row
}

/// The expiry of a record kept forever: past every clock, so never purged or evicted first.
const FOREVER: u64 = u64::MAX;

/// When an entry written at `now` for `ttl` expires.
fn expiry(now: u64, ttl: Ttl) -> u64 {
    ttl.finite()
        .map_or(FOREVER, |ttl| time::after_ms(now, ttl).min(FOREVER - 1))
}

/// How long an entry expiring at `at` lives after `now` (forever: `None`).
fn lives(at: u64, now: u64) -> Option<Duration> {
    (at != FOREVER).then(|| Duration::from_millis(at.saturating_sub(now)))
}

/// Purge expired entries every [`PURGE_EVERY`] while the store lives.
async fn purge_loop(writer: mpsc::WeakSender<Op>) {
    let mut tick = tokio::time::interval(PURGE_EVERY);
    loop {
        tick.tick().await;
        loop {
            let Some(writer) = writer.upgrade() else {
                return;
            };
            let (reply, answer) = oneshot::channel();
            if writer
                .send(Op {
                    what: Write::Purge,
                    reply,
                })
                .await
                .is_err()
            {
                return;
            }
            drop(writer);
            match answer.await {
                // A full batch: more may be waiting.
                Ok(Ok(Done::Count(n))) if n as usize >= PURGE_BATCH => continue,
                Ok(Err(e)) => tracing::warn!(error = %e, "embedded store: purge failed"),
                _ => {}
            }
            break;
        }
    }
}

/// The writer's fixed settings.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_entries: u64,
    max_bytes: u64,
    // Commit batches of requests with an fsync.
    fsync: bool,
}

/// The writer thread: one transaction per batch of waiting operations, answered once committed.
fn write_loop(
    db: &Slot,
    mut queue: mpsc::Receiver<Op>,
    limits: Limits,
    (commits, evictions): (&Counter, &Evictions),
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut last_durable = Instant::now();
    // When the file was last reopened (or tried), after a failed write.
    let mut reopened: Option<Instant> = None;
    while let Some(op) = queue.blocking_recv() {
        batch.push(op);
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        // With fsync, every batch of requests is durable (purges alone wait for the next one);
        // without, one at least every DURABLE_EVERY (the purge's tick makes one when idle).
        let durable = match limits.fsync {
            true => !batch.iter().all(|op| matches!(op.what, Write::Purge)),
            false => last_durable.elapsed() >= DURABLE_EVERY,
        };
        // Closed by a reopening that failed: try again first, this batch may then succeed.
        if !db.is_open() && reopen_due(&mut reopened) {
            db.reopen();
        }
        let mut outcomes = Vec::with_capacity(batch.len());
        let applied = db.with(|open| {
            apply_batch(open, &batch, durable, limits, &mut outcomes).map_err(StoreError::Embedded)
        });
        match applied {
            Ok(evicted) => {
                evictions.count(true, evicted.0);
                evictions.count(false, evicted.1);
                if durable {
                    commits.inc();
                    last_durable = Instant::now();
                }
                for (op, answer) in batch.drain(..).zip(outcomes) {
                    let _ = op.reply.send(answer);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "embedded store: a write failed; nothing of its batch was written");
                let message = match e {
                    StoreError::Embedded(m) => m,
                    other => other.to_string(),
                };
                for op in batch.drain(..) {
                    let _ = op.reply.send(Err(StoreError::Embedded(message.clone())));
                }
                // redb refuses everything after an I/O error until the file is reopened.
                if reopen_due(&mut reopened) {
                    db.reopen();
                }
            }
        }
    }
}

/// Whether a reopening may be tried now (none within [`REOPEN_EVERY`] of the last); if so, now
/// is noted in `last`.
fn reopen_due(last: &mut Option<Instant>) -> bool {
    let due = last.is_none_or(|t| t.elapsed() >= REOPEN_EVERY);
    if due {
        *last = Some(Instant::now());
    }
    due
}

/// Apply `batch` in one transaction and commit it, `durable` or not; each operation's answer in
/// `outcomes`, and the records evicted for room (for the entry bound, for the byte bound). On a
/// failure nothing is written and the error is every operation's.
fn apply_batch(
    db: &Database,
    batch: &[Op],
    durable: bool,
    limits: Limits,
    outcomes: &mut Vec<Result<Done, StoreError>>,
) -> Result<(u64, u64), String> {
    let fail = |what: &str, e: &dyn std::fmt::Display| format!("{what}: {e}");
    let mut txn = db.begin_write().map_err(|e| fail("write", &e))?;
    let durability = match durable {
        true => Durability::Immediate,
        false => Durability::None,
    };
    txn.set_durability(durability)
        .map_err(|e| fail("write", &e))?;
    let evicted;
    {
        let mut t = Tables::open(&txn).map_err(|e| fail("write", &e))?;
        let now = now_ms();
        for op in batch {
            outcomes.push(
                t.apply(&op.what, now, limits)
                    .map_err(|e| fail("write", &e))?,
            );
        }
        t.save().map_err(|e| fail("write", &e))?;
        evicted = t.evicted;
    }
    txn.commit().map_err(|e| fail("commit", &e))?;
    Ok(evicted)
}

/// The tables of one write transaction, and the byte count kept in step with them.
struct Tables<'txn> {
    entries: redb::Table<'txn, &'static [u8; 32], &'static [u8]>,
    claims: redb::Table<'txn, &'static [u8; 40], ()>,
    records: redb::Table<'txn, &'static [u8; 40], ()>,
    meta: redb::Table<'txn, &'static str, u64>,
    bytes: u64,
    // Records evicted for room in this transaction: for the entry bound, for the byte bound.
    evicted: (u64, u64),
}

/// A storage failure inside a transaction.
type Result2<T> = Result<T, redb::Error>;

impl<'txn> Tables<'txn> {
    fn open(txn: &'txn redb::WriteTransaction) -> Result2<Self> {
        let meta = txn.open_table(META)?;
        let bytes = meta.get("bytes")?.map_or(0, |v| v.value());
        Ok(Tables {
            entries: txn.open_table(ENTRIES)?,
            claims: txn.open_table(CLAIMS)?,
            records: txn.open_table(RECORDS)?,
            meta,
            bytes,
            evicted: (0, 0),
        })
    }

    fn save(&mut self) -> Result2<()> {
        self.meta.insert("bytes", self.bytes)?;
        Ok(())
    }

    /// One operation; a refused one (a full store) is its own answer, not the batch's failure.
    fn apply(
        &mut self,
        what: &Write,
        now: u64,
        limits: Limits,
    ) -> Result2<Result<Done, StoreError>> {
        Ok(Ok(match what {
            Write::Claim {
                who,
                lease,
                tombstones,
            } => {
                let expires = time::after_ms(now, *lease);
                match self.claim(who, expires, *tombstones, now, limits)? {
                    Ok(held) => Done::Claim(held),
                    Err(e) => return Ok(Err(e)),
                }
            }
            Write::Complete {
                who,
                value,
                ttl,
                refuses,
                tombstone,
            } => {
                let key = &who.key;
                let written = match self.held(key)?.filter(|(at, _)| *at > now) {
                    Some((_, v)) if !has_token(&v, &who.token) => false,
                    // Our own completion, already there.
                    Some((_, v)) if !is_claim(&v) => return Ok(Ok(Done::Yes(true))),
                    Some(_) => true,
                    // Our lease ran out and nobody claimed the key since; a live tombstone
                    // means another record was there.
                    None => !refuses || self.live(&key.tombstone(), now)?.is_none(),
                };
                if written {
                    self.put(key, expiry(now, *ttl), value)?;
                    if let Some((tombstone, lives)) = tombstone {
                        let at = time::after_ms(now, *lives);
                        self.put(&key.tombstone(), at, tombstone)?;
                    }
                    // Never refused: nothing is added.
                    let _ = self.make_room(limits, false, now)?;
                }
                Done::Yes(written)
            }
            Write::Release(who) => {
                let ours = self.claimed_by(&who.key, &who.token, now)?;
                if ours {
                    self.remove(&who.key)?;
                }
                Done::Yes(ours)
            }
            Write::Renew { who, lease } => {
                let ours = self.claimed_by(&who.key, &who.token, now)?;
                if let (true, Some((_, value))) = (ours, self.held(&who.key)?) {
                    self.put(&who.key, time::after_ms(now, *lease), &value)?;
                }
                Done::Yes(ours)
            }
            Write::Evict(key) => {
                // A lapsed entry not purged yet goes too, but was as good as absent.
                let record = self.live(key, now)?.is_some();
                let tombstone = self.live(&key.tombstone(), now)?.is_some();
                self.remove(key)?;
                self.remove(&key.tombstone())?;
                Done::Yes(record || tombstone)
            }
            Write::EvictAll => Done::Count(self.remove_all()?),
            Write::Purge => Done::Count(self.purge(now, PURGE_BATCH)?),
        }))
    }

    fn claim(
        &mut self,
        who: &Claimant,
        expires: u64,
        tombstones: bool,
        now: u64,
        limits: Limits,
    ) -> Result2<Result<Option<(u64, Bytes)>, StoreError>> {
        let key = &who.key;
        if let Some((at, value)) = self.held(key)? {
            if at > now {
                return Ok(Ok(Some((at, value))));
            }
            self.remove(key)?;
        }
        if tombstones {
            if let Some(held) = self.live(&key.tombstone(), now)? {
                return Ok(Ok(Some(held)));
            }
        }
        if let Err(e) = self.make_room(limits, true, now)? {
            return Ok(Err(e));
        }
        let value = codec::encode(&who.fingerprint, &who.token, &EntryState::InFlight);
        self.put(key, expires, &value)?;
        Ok(Ok(None))
    }

    /// The entry of `key`, expired or not.
    fn held(&self, key: &ScopedKey) -> Result2<Option<(u64, Bytes)>> {
        Ok(self.entries.get(&key.0)?.and_then(|v| split(v.value())))
    }

    /// The live entry of `key`: not past its lease or ttl.
    fn live(&self, key: &ScopedKey, now: u64) -> Result2<Option<(u64, Bytes)>> {
        Ok(self.held(key)?.filter(|(at, _)| *at > now))
    }

    /// Whether `key` is a live in-flight claim made with `token`.
    fn claimed_by(&self, key: &ScopedKey, token: &Token, now: u64) -> Result2<bool> {
        Ok(self.live(key, now)?.is_some_and(|(_, v)| holds(&v, token)))
    }

    /// Write `key`'s entry (replacing any), its index row and its weight.
    fn put(&mut self, key: &ScopedKey, at: u64, value: &[u8]) -> Result2<()> {
        self.remove(key)?;
        let mut stored = Vec::with_capacity(8 + value.len());
        stored.extend_from_slice(&at.to_be_bytes());
        stored.extend_from_slice(value);
        self.entries.insert(&key.0, stored.as_slice())?;
        self.index(value).insert(&index_key(at, &key.0), ())?;
        self.bytes += weight(value);
        Ok(())
    }

    /// Delete `key`'s entry and index row; whether there was one.
    fn remove(&mut self, key: &ScopedKey) -> Result2<bool> {
        let Some((at, value)) = self.entries.remove(&key.0)?.and_then(|v| split(v.value())) else {
            return Ok(false);
        };
        self.index(&value).remove(&index_key(at, &key.0))?;
        self.bytes = self.bytes.saturating_sub(weight(&value));
        Ok(true)
    }

    fn index(&mut self, value: &[u8]) -> &mut redb::Table<'txn, &'static [u8; 40], ()> {
        match value.get(codec::STATE_AT) {
            Some(&codec::IN_FLIGHT) => &mut self.claims,
            _ => &mut self.records,
        }
    }

    fn remove_all(&mut self) -> Result2<u64> {
        let n = self.entries.len()?;
        self.entries.retain(|_, _| false)?;
        self.claims.retain(|_, _| false)?;
        self.records.retain(|_, _| false)?;
        self.bytes = 0;
        Ok(n)
    }

    /// The first row of an index: its expiry and key.
    fn first(
        index: &redb::Table<'txn, &'static [u8; 40], ()>,
    ) -> Result2<Option<(u64, ScopedKey)>> {
        Ok(index.first()?.map(|(row, _)| {
            let [a, b, c, d, e, f, g, h, key @ ..] = *row.value();
            (u64::from_be_bytes([a, b, c, d, e, f, g, h]), ScopedKey(key))
        }))
    }

    /// Delete up to `most` expired entries, claims and records; how many.
    fn purge(&mut self, now: u64, most: usize) -> Result2<u64> {
        let mut n = 0;
        for claims in [true, false] {
            while (n as usize) < most {
                let index = if claims { &self.claims } else { &self.records };
                match Self::first(index)? {
                    Some((at, key)) if at <= now => {
                        self.remove(&key)?;
                        n += 1;
                    }
                    _ => break,
                }
            }
        }
        Ok(n)
    }

    /// Bring the store under both bounds (leaving room for one more entry when `adding`):
    /// expired entries first, then the completed records closest to expiry; a claim is refused
    /// when only claims and records kept forever are left.
    fn make_room(
        &mut self,
        limits: Limits,
        adding: bool,
        now: u64,
    ) -> Result2<Result<(), StoreError>> {
        let over = |t: &Self| -> Result2<bool> {
            Ok(t.entries.len()? + u64::from(adding) > limits.max_entries
                || t.bytes > limits.max_bytes)
        };
        if !over(self)? {
            return Ok(Ok(()));
        }
        self.purge(now, usize::MAX)?;
        let mut evicted = 0;
        // Records kept forever are never evicted: past them, new claims are refused (full).
        while over(self)? {
            let Some((_, key)) = Self::first(&self.records)?.filter(|(at, _)| *at != FOREVER)
            else {
                break;
            };
            match self.entries.len()? + u64::from(adding) > limits.max_entries {
                true => self.evicted.0 += 1,
                false => self.evicted.1 += 1,
            }
            // A record evicted before its ttl takes its tombstone along: its key was not
            // expired, so a retry runs again rather than being refused as expired.
            if let Some((_, value)) = self.held(&key)? {
                if value.get(codec::STATE_AT) != Some(&codec::EXPIRED) {
                    self.remove(&key.tombstone())?;
                }
            }
            self.remove(&key)?;
            evicted += 1;
        }
        if evicted > 0 {
            tracing::debug!(
                evicted,
                "embedded store at its bounds; evicted completed records"
            );
        }
        if adding && over(self)? {
            return Ok(Err(StoreError::Full));
        }
        Ok(Ok(()))
    }
}

/// Whether an encoded entry is an in-flight claim made with `token`.
fn holds(value: &[u8], token: &Token) -> bool {
    is_claim(value) && has_token(value, token)
}

/// Whether an encoded entry is an in-flight claim.
fn is_claim(value: &[u8]) -> bool {
    value.get(codec::STATE_AT) == Some(&codec::IN_FLIGHT)
}

/// Whether an encoded entry was written by the claim whose token is `token`.
fn has_token(value: &[u8], token: &Token) -> bool {
    value.get(codec::TOKEN_AT..codec::WRITTEN_AT) == Some(&token.0[..])
}

/// What an entry costs: its encoding and a fixed overhead.
fn weight(value: &[u8]) -> u64 {
    ENTRY_OVERHEAD + value.len() as u64
}

impl EmbeddedStore {
    /// The claim's answer from the live entry (or tombstone) expiring at `at`.
    fn decided(&self, who: &Claimant, (at, value): (u64, Bytes)) -> Result<Claim, StoreError> {
        let (mut entry, holder) = self.codec.decode(&who.key, value)?;
        entry.expires_in = lives(at, now_ms());
        Ok(Claim::decide(entry, &holder, &who.fingerprint, &who.token))
    }
}

impl Store for EmbeddedStore {
    async fn claim(&self, who: &Claimant, terms: ClaimTerms) -> Result<Claim, StoreError> {
        let tombstones = terms.after_expiry == AfterExpiry::Refuse;
        // A live entry that is not our own claim decides without a write (a replay, a claim in
        // flight, a mismatch, a tombstone); the writer checks again before it claims.
        match self.read(&who.key, tombstones)? {
            Some(held) if !holds(&held.1, &who.token) => return self.decided(who, held),
            _ => {}
        }
        let what = Write::Claim {
            who: *who,
            lease: terms.lease,
            tombstones,
        };
        match self.write(what).await? {
            Done::Claim(None) => Ok(Claim::Claimed),
            Done::Claim(Some(held)) => self.decided(who, held),
            other => Err(unexpected("a claim", other)),
        }
    }

    async fn complete(
        &self,
        who: &Claimant,
        state: &EntryState,
        keep: Keep,
    ) -> Result<bool, StoreError> {
        let (key, fingerprint) = (&who.key, &who.fingerprint);
        let value = self
            .codec
            .record(key, fingerprint, &who.token, state)
            .into_bytes();
        let tombstone = self.codec.tombstone(key, keep, fingerprint, state);
        self.yes(Write::Complete {
            who: *who,
            value,
            ttl: keep.ttl,
            refuses: keep.tombstone.is_some(),
            tombstone,
        })
        .await
    }

    async fn release(&self, who: &Claimant) -> Result<bool, StoreError> {
        self.yes(Write::Release(*who)).await
    }

    async fn renew(&self, who: &Claimant, lease: Duration) -> Result<bool, StoreError> {
        self.yes(Write::Renew { who: *who, lease }).await
    }
}

impl super::Inspect for EmbeddedStore {
    async fn ping(&self) -> Result<(), StoreError> {
        self.db
            .with(|db| db.begin_read().map(drop).map_err(|e| failed("read", e)))
    }

    async fn inspect(&self, key: &ScopedKey) -> Result<Option<Inspected>, StoreError> {
        // The record, or its tombstone once it has expired.
        let found = self.read(key, true)?;
        let Some((at, value)) = found else {
            return Ok(None);
        };
        let stored_bytes = value.len();
        let (entry, _) = self.codec.decode(key, value)?;
        Ok(Some(Inspected {
            entry,
            expires_in: lives(at, now_ms()),
            stored_bytes,
        }))
    }

    async fn evict(&self, key: &ScopedKey) -> Result<bool, StoreError> {
        self.yes(Write::Evict(*key)).await
    }

    async fn evict_all(&self) -> Result<u64, StoreError> {
        match self.write(Write::EvictAll).await? {
            Done::Count(n) => Ok(n),
            other => Err(unexpected("evict-all", other)),
        }
    }
}
