//! The writer thread and its group commit: every operation waiting on the queue applied in one
//! transaction, committed once, then each answered; and what each operation does to the
//! tables.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use prometheus_client::metrics::counter::Counter;
use redb::{Database, Durability};
use tokio::sync::{mpsc, oneshot};

use super::file::StoreFile;
use super::purge::PURGE_BATCH;
use super::tables::{expiry, Bounds, RedbResult, Row, Tables};
use super::{BACKEND, DURABLE_EVERY};
use crate::record::key::ScopedKey;
use crate::record::policy::AfterExpiry;
use crate::record::EntryState;
use crate::store::codec;
use crate::store::Evictions;
use crate::store::{ClaimTerms, Claimant, Keep, StoreError};
use crate::time;

/// After a failed write, the file is reopened at most this often until it opens.
const REOPEN_EVERY: Duration = Duration::from_secs(1);

/// Most operations one transaction takes from the queue.
const MAX_BATCH: usize = 4096;

/// Operations waiting for the writer at most; past it, callers wait for room.
pub(super) const QUEUE: usize = 8192;

/// A write for the writer, with where its answer goes.
#[derive(Debug)]
pub(super) struct Op {
    pub(super) what: Write,
    pub(super) reply: oneshot::Sender<Result<Done, StoreError>>,
}

/// What the writer is asked to do.
#[derive(Debug)]
pub(super) enum Write {
    Claim { who: Claimant, terms: ClaimTerms },
    Complete(Completion),
    Release(Claimant),
    Renew { who: Claimant, lease: Duration },
    Evict(ScopedKey),
    EvictAll,
    Purge,
}

/// A completion, encoded for the writer.
#[derive(Debug)]
pub(super) struct Completion {
    pub(super) who: Claimant,
    /// The record, encoded (and sealed) by the handle, off the writer's thread.
    pub(super) record: Bytes,
    pub(super) keep: Keep,
    /// The tombstone the record leaves, encoded, and how long it lives.
    pub(super) tombstone: Option<(Bytes, Duration)>,
}

/// A write's answer.
#[derive(Debug)]
pub(super) enum Done {
    /// The claim's answer: claimed (`None`), or the live entry that decides.
    Claim(Option<Row>),
    /// Whether the write did what it asked: written, released, renewed, or (an eviction)
    /// found something live.
    Did(bool),
    /// How many entries went.
    Count(u64),
}

/// What a claim found.
enum Claimed {
    /// The key was free: it is now the claim's.
    Taken,
    /// The live entry (or, on a route that refuses after expiry, the live tombstone) that
    /// decides.
    Held(Row),
    /// No room for the claim: the store holds only claims and records kept forever.
    NoRoom,
}

/// The writer thread: the file it writes, how, and what it counts.
pub(super) struct Writer {
    pub(super) file: Arc<StoreFile>,
    pub(super) queue: mpsc::Receiver<Op>,
    pub(super) bounds: Bounds,
    /// Every batch of requests committed with an fsync.
    pub(super) fsync: bool,
    /// Durable commits (`idemgate_store_commits_total`).
    pub(super) commits: Counter,
    /// Records evicted for room (`idemgate_store_evictions_total`).
    pub(super) evictions: Evictions,
}

impl Writer {
    /// One transaction per batch of waiting operations, answered once committed; until every
    /// sender is gone.
    pub(super) fn run(mut self) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let mut last_durable = Instant::now();
        // When the file was last reopened (or tried), after a failed write.
        let mut reopened: Option<Instant> = None;
        while let Some(op) = self.queue.blocking_recv() {
            batch.push(op);
            while batch.len() < MAX_BATCH {
                match self.queue.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(_) => break,
                }
            }
            // With fsync, every batch of requests is durable (purges alone wait for the next
            // one); without, one at least every DURABLE_EVERY (the purge's tick makes one when
            // idle).
            let durable = match self.fsync {
                true => !batch.iter().all(|op| matches!(op.what, Write::Purge)),
                false => last_durable.elapsed() >= DURABLE_EVERY,
            };
            // Closed by a reopening that failed: try again first, this batch may then succeed.
            if !self.file.is_open() && reopen_due(&mut reopened) {
                self.file.reopen();
            }
            if self.commit(&mut batch, durable) {
                if durable {
                    last_durable = Instant::now();
                }
            } else if reopen_due(&mut reopened) {
                // redb refuses everything after an I/O error until the file is reopened.
                self.file.reopen();
            }
        }
    }

    /// Apply `batch` in one transaction, commit it (`durable` or not) and answer each of its
    /// operations, emptying it; whether it was committed.
    fn commit(&self, batch: &mut Vec<Op>, durable: bool) -> bool {
        let mut outcomes = Vec::with_capacity(batch.len());
        let applied = self.file.with(|open| {
            apply_batch(open, batch, durable, self.bounds, &mut outcomes)
                .map_err(|e| StoreError::failed(BACKEND, e))
        });
        match applied {
            Ok(evicted) => {
                self.evictions.count(true, evicted.0);
                self.evictions.count(false, evicted.1);
                if durable {
                    self.commits.inc();
                }
                for (op, answer) in batch.drain(..).zip(outcomes) {
                    let _ = op.reply.send(answer);
                }
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "embedded store: a write failed; nothing of its batch was written");
                for op in batch.drain(..) {
                    let _ = op.reply.send(Err(e.clone()));
                }
                false
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
    bounds: Bounds,
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
        let mut t = Tables::open(&txn, bounds).map_err(|e| fail("write", &e))?;
        for op in batch {
            outcomes.push(t.apply(&op.what).map_err(|e| fail("write", &e))?);
        }
        t.save().map_err(|e| fail("write", &e))?;
        evicted = t.evicted;
    }
    txn.commit().map_err(|e| fail("commit", &e))?;
    Ok(evicted)
}

impl Tables<'_> {
    /// One operation; a refused one (a full store) is its own answer, not the batch's failure.
    fn apply(&mut self, what: &Write) -> RedbResult<Result<Done, StoreError>> {
        Ok(Ok(match what {
            Write::Claim { who, terms } => match self.claim(who, *terms)? {
                Claimed::Taken => Done::Claim(None),
                Claimed::Held(row) => Done::Claim(Some(row)),
                Claimed::NoRoom => return Ok(Err(StoreError::Full)),
            },
            Write::Complete(completion) => Done::Did(self.complete(completion)?),
            Write::Release(who) => Done::Did(self.release(who)?),
            Write::Renew { who, lease } => Done::Did(self.renew(who, *lease)?),
            Write::Evict(key) => Done::Did(self.evict(key)?),
            Write::EvictAll => Done::Count(self.remove_all()?),
            Write::Purge => Done::Count(self.purge(PURGE_BATCH)?),
        }))
    }

    /// Claim the key for `who` on `terms` if it is free.
    fn claim(&mut self, who: &Claimant, terms: ClaimTerms) -> RedbResult<Claimed> {
        let key = &who.key;
        if let Some(row) = self.held(key)? {
            if row.live_at(self.now) {
                return Ok(Claimed::Held(row));
            }
            self.remove(key)?;
        }
        if terms.after_expiry == AfterExpiry::Refuse {
            if let Some(tombstone) = self.live(&key.tombstone())? {
                return Ok(Claimed::Held(tombstone));
            }
        }
        if !self.make_room(true)? {
            return Ok(Claimed::NoRoom);
        }
        let claim = codec::encode(&who.fingerprint, &who.token, &EntryState::InFlight);
        self.put(key, time::after_ms(self.now, terms.lease), &claim)?;
        Ok(Claimed::Taken)
    }

    /// Record the completion where the key holds `who`'s claim, or nothing live (unless a live
    /// tombstone says another record was there); whether it is written.
    fn complete(&mut self, c: &Completion) -> RedbResult<bool> {
        let key = &c.who.key;
        let written = match self.live(key)? {
            Some(row) if !row.written_by(&c.who.token) => false,
            // Our own completion, already there.
            Some(row) if !row.is_claim() => return Ok(true),
            Some(_) => true,
            // Our lease ran out and nobody claimed the key since; on a route that keeps
            // tombstones, a live one means another record was there.
            None => c.keep.tombstone.is_none() || self.live(&key.tombstone())?.is_none(),
        };
        if written {
            self.put(key, expiry(self.now, c.keep.ttl), &c.record)?;
            if let Some((tombstone, lives)) = &c.tombstone {
                let at = time::after_ms(self.now, *lives);
                self.put(&key.tombstone(), at, tombstone)?;
            }
            // Nothing is added, so nothing is refused.
            self.make_room(false)?;
        }
        Ok(written)
    }

    /// Delete `who`'s live claim; whether there was one.
    fn release(&mut self, who: &Claimant) -> RedbResult<bool> {
        let ours = self.claimed_by(&who.key, &who.token)?;
        if ours {
            self.remove(&who.key)?;
        }
        Ok(ours)
    }

    /// Extend `who`'s live claim to `lease` from now; whether there was one.
    fn renew(&mut self, who: &Claimant, lease: Duration) -> RedbResult<bool> {
        let ours = self.claimed_by(&who.key, &who.token)?;
        if let (true, Some(row)) = (ours, self.held(&who.key)?) {
            self.put(&who.key, time::after_ms(self.now, lease), &row.encoding)?;
        }
        Ok(ours)
    }

    /// Delete `key` and its tombstone; whether either was live.
    fn evict(&mut self, key: &ScopedKey) -> RedbResult<bool> {
        // A lapsed entry not purged yet goes too, but was as good as absent.
        let record = self.live(key)?.is_some();
        let tombstone = self.live(&key.tombstone())?.is_some();
        self.remove(key)?;
        self.remove(&key.tombstone())?;
        Ok(record || tombstone)
    }
}
