//! The writer thread and its group commit: every operation waiting on the queue applied in one
//! transaction, committed once, then each answered.

use std::time::{Duration, Instant};

use bytes::Bytes;
use prometheus_client::metrics::counter::Counter;
use redb::{Database, Durability};
use tokio::sync::{mpsc, oneshot};

use super::file::Slot;
use super::purge::PURGE_BATCH;
use super::tables::{expiry, has_token, is_claim, Result2, Tables};
use super::DURABLE_EVERY;
use crate::metrics::Evictions;
use crate::record::key::ScopedKey;
use crate::record::policy::Ttl;
use crate::record::{now_ms, EntryState};
use crate::store::codec;
use crate::store::{Claimant, StoreError};
use crate::time;

/// After a failed write, the file is reopened at most this often until it opens.
const REOPEN_EVERY: Duration = Duration::from_secs(1);

/// Most operations one transaction takes from the queue.
pub(super) const MAX_BATCH: usize = 4096;

/// Operations waiting for the writer at most; past it, callers wait for room.
pub(super) const QUEUE: usize = 8192;

/// A write for the writer, with where its answer goes.
#[derive(Debug)]
pub(super) struct Op {
    pub(super) what: Write,
    pub(super) reply: oneshot::Sender<Result<Done, StoreError>>,
}

#[derive(Debug)]
pub(super) enum Write {
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
pub(super) enum Done {
    // The claim's answer: claimed (`None`), or the live entry that decides, with its expiry.
    Claim(Option<(u64, Bytes)>),
    Yes(bool),
    Count(u64),
}

/// A writer's answer of the wrong kind, as an error rather than a panic.
pub(super) fn unexpected(what: &str, answer: Done) -> StoreError {
    StoreError::Embedded(format!("{what} got the answer {answer:?}"))
}

/// The writer's fixed settings.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) max_entries: u64,
    pub(super) max_bytes: u64,
    // Commit batches of requests with an fsync.
    pub(super) fsync: bool,
}

/// The writer thread: one transaction per batch of waiting operations, answered once committed.
pub(super) fn write_loop(
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

impl Tables<'_> {
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
}
