//! Making room: expired entries purged (in the background and when room is needed), and the
//! completed records closest to expiry evicted when the store is at its bounds.

use redb::ReadableTableMetadata;
use tokio::sync::{mpsc, oneshot};

use super::tables::{Result2, Tables, FOREVER};
use super::writer::{Done, Limits, Op, Write};
use super::PURGE_EVERY;
use crate::store::codec;
use crate::store::StoreError;

/// Most expired entries one purge transaction deletes (more follow at once when there are).
pub(super) const PURGE_BATCH: usize = 1000;

/// Purge expired entries every [`PURGE_EVERY`] while the store lives.
pub(super) async fn purge_loop(writer: mpsc::WeakSender<Op>) {
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

impl Tables<'_> {
    /// Delete up to `most` expired entries, claims and records; how many.
    pub(super) fn purge(&mut self, now: u64, most: usize) -> Result2<u64> {
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
    pub(super) fn make_room(
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
