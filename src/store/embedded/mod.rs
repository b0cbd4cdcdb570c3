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

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use redb::ReadableDatabase;
use tokio::sync::{mpsc, oneshot};
use tokio_util::task::AbortOnDropHandle;

use super::codec::Codec;
use super::{Claim, ClaimTerms, Claimant, Inspected, Keep, Store, StoreError, StoreResult};
use crate::record::key::ScopedKey;
use crate::record::policy::AfterExpiry;
use crate::record::{now_ms, EntryState};
use crate::store::Evictions;

mod file;
mod purge;
mod settings;
mod tables;
mod writer;

use self::file::StoreFile;
use self::purge::PURGE_BATCH;
pub use self::settings::{EmbeddedSettings, DEFAULT_PATH};
use self::tables::{Bounds, Row, ENTRIES};
use self::writer::{Completion, Done, Op, Write, Writer, QUEUE};

/// The file in the store's directory.
pub const FILE_NAME: &str = "idemgate.redb";

/// How often expired entries are purged.
pub const PURGE_EVERY: Duration = Duration::from_secs(1);

/// Without `fsync`, a commit at least this long after the last durable one is made durable:
/// redb keeps a non-durable commit in its own memory, so this bounds what a crash of the
/// process, or of the machine, loses.
pub const DURABLE_EVERY: Duration = Duration::from_secs(1);

/// A handle to the embedded store; clones share one file and one writer. The writer thread and
/// the purge task stop when the last handle goes, and the file's lock with them.
#[derive(Debug, Clone)]
pub struct EmbeddedStore {
    file: Arc<StoreFile>,
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

/// The backend's name in errors.
const BACKEND: &str = "embedded store";

/// A storage failure as the store's error.
fn failed(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::failed(BACKEND, format!("{what}: {e}"))
}

/// A writer's answer of the wrong kind, as an error rather than a panic.
fn unexpected(what: &str, answer: Done) -> StoreError {
    StoreError::failed(BACKEND, format!("{what} got the answer {answer:?}"))
}

/// The writer thread gone (it ends only with the last handle, or by a panic).
fn stopped() -> StoreError {
    StoreError::unavailable(BACKEND, "the writer has stopped")
}

/// Purge expired entries every [`PURGE_EVERY`] while the store lives: a batch at a time, the
/// next at once after a full one.
async fn purge_loop(writer: mpsc::WeakSender<Op>) {
    let mut tick = tokio::time::interval(PURGE_EVERY);
    loop {
        tick.tick().await;
        loop {
            let Some(writer) = writer.upgrade() else {
                return;
            };
            let (reply, answer) = oneshot::channel();
            let what = Write::Purge;
            if writer.send(Op { what, reply }).await.is_err() {
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
        let file = Arc::new(StoreFile::open(dir.join(FILE_NAME))?);
        let (writer, queue) = mpsc::channel(QUEUE);
        let thread = Writer {
            file: file.clone(),
            queue,
            bounds: Bounds {
                max_entries: settings.max_entries.max(1) as u64,
                max_bytes: settings.max_bytes.max(1),
            },
            fsync: settings.fsync,
            commits: commits.clone(),
            evictions,
        };
        std::thread::Builder::new()
            .name("idemgate-store".into())
            .spawn(move || thread.run())
            .map_err(|e| failed("writer thread", e))?;
        let purger = tokio::runtime::Handle::try_current().ok().map(|rt| {
            let weak = writer.downgrade();
            Arc::new(AbortOnDropHandle::new(rt.spawn(purge_loop(weak))))
        });
        Ok(EmbeddedStore {
            file,
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

    /// Queue `what` for the writer and wait until its batch is committed. Its callers await it
    /// boxed: the send, the reply and the timeout run to a kilobyte, which unboxed would set the
    /// size of every future above the store, each copied whole whenever it is moved.
    async fn write(&self, what: Write) -> Result<Done, StoreError> {
        let (reply, answer) = oneshot::channel();
        let queued = async {
            self.writer
                .send(Op { what, reply })
                .await
                .map_err(|_| stopped())?;
            answer.await.map_err(|_| stopped())?
        };
        match tokio::time::timeout(self.timeout, queued).await {
            Ok(done) => done,
            Err(_) => Err(StoreError::timeout(
                BACKEND,
                format!(
                    "no commit within {} (store.timeout)",
                    humantime::format_duration(self.timeout)
                ),
            )),
        }
    }

    /// What `key` holds now, unexpired; else, `with_tombstone`, its live tombstone. Both from
    /// one snapshot.
    fn read(&self, key: &ScopedKey, with_tombstone: bool) -> Result<Option<Row>, StoreError> {
        self.file.with(|db| {
            let txn = db.begin_read().map_err(|e| failed("read", e))?;
            let table = txn.open_table(ENTRIES).map_err(|e| failed("read", e))?;
            let now = now_ms();
            let live = |at: &ScopedKey| -> Result<Option<Row>, StoreError> {
                let value = table.get(&at.0).map_err(|e| failed("read", e))?;
                Ok(value
                    .and_then(|v| Row::read(v.value()))
                    .filter(|row| row.live_at(now)))
            };
            match live(key)? {
                Some(found) => Ok(Some(found)),
                None if with_tombstone => live(&key.tombstone()),
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

    /// Queue `what` and answer whether it did what it asked.
    async fn did(&self, what: Write) -> Result<bool, StoreError> {
        match Box::pin(self.write(what)).await? {
            Done::Did(did) => Ok(did),
            other => Err(unexpected("a fenced write", other)),
        }
    }
}

impl EmbeddedStore {
    /// The claim's answer from the live entry (or tombstone) `held`.
    fn decided(&self, who: &Claimant, held: Row) -> Result<Claim, StoreError> {
        let (mut entry, holder) = self.codec.decode(&who.key, held.encoding.clone())?;
        entry.expires_in = held.lives();
        Ok(Claim::decide(entry, &holder, &who.fingerprint, &who.token))
    }
}

impl Store for EmbeddedStore {
    async fn claim(&self, who: &Claimant, terms: ClaimTerms) -> StoreResult<Claim> {
        let with_tombstone = terms.after_expiry == AfterExpiry::Refuse;
        // A live entry that is not our own claim decides without a write (a replay, a claim in
        // flight, a mismatch, a tombstone); the writer checks again before it claims.
        match self.read(&who.key, with_tombstone)? {
            Some(held) if !held.claimed_by(&who.token) => return self.decided(who, held),
            _ => {}
        }
        let what = Write::Claim { who: *who, terms };
        match Box::pin(self.write(what)).await? {
            Done::Claim(None) => Ok(Claim::Claimed),
            Done::Claim(Some(held)) => self.decided(who, held),
            other => Err(unexpected("a claim", other)),
        }
    }

    async fn complete(&self, who: &Claimant, state: &EntryState, keep: Keep) -> StoreResult<bool> {
        let (key, fingerprint) = (&who.key, &who.fingerprint);
        let record = self.codec.record(key, fingerprint, &who.token, state);
        let completion = Completion {
            who: *who,
            record: record.into_bytes(),
            keep,
            tombstone: self.codec.tombstone(key, keep, fingerprint, state),
        };
        self.did(Write::Complete(completion)).await
    }

    async fn release(&self, who: &Claimant) -> StoreResult<bool> {
        self.did(Write::Release(*who)).await
    }

    async fn renew(&self, who: &Claimant, lease: Duration) -> StoreResult<bool> {
        self.did(Write::Renew { who: *who, lease }).await
    }
}

impl super::Inspect for EmbeddedStore {
    async fn ping(&self) -> StoreResult<()> {
        self.file
            .with(|db| db.begin_read().map(drop).map_err(|e| failed("read", e)))
    }

    async fn inspect(&self, key: &ScopedKey) -> StoreResult<Option<Inspected>> {
        // The record, or its tombstone once it has expired.
        let Some(found) = self.read(key, true)? else {
            return Ok(None);
        };
        let stored_bytes = found.encoding.len();
        let (entry, _) = self.codec.decode(key, found.encoding.clone())?;
        Ok(Some(Inspected {
            entry,
            expires_in: found.lives(),
            stored_bytes,
        }))
    }

    async fn evict(&self, key: &ScopedKey) -> StoreResult<bool> {
        self.did(Write::Evict(*key)).await
    }

    async fn evict_all(&self) -> StoreResult<u64> {
        match self.write(Write::EvictAll).await? {
            Done::Count(n) => Ok(n),
            other => Err(unexpected("evict-all", other)),
        }
    }
}
