//! Making room: expired entries purged (a batch at a time for the background task, all of them
//! when room is needed), and the completed records closest to expiry evicted when the store is
//! at its bounds.

use redb::ReadableTableMetadata;

use super::tables::{RedbResult, Tables, FOREVER};

/// Most expired entries one purge transaction deletes (more follow at once when there are).
pub(super) const PURGE_BATCH: usize = 1000;

impl Tables<'_> {
    /// Delete up to `most` expired entries, claims and records; how many.
    pub(super) fn purge(&mut self, most: usize) -> RedbResult<u64> {
        let mut n = 0;
        for claims in [true, false] {
            while (n as usize) < most {
                let index = if claims { &self.claims } else { &self.records };
                match Self::first(index)? {
                    Some((at, key)) if at <= self.now => {
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
    /// expired entries first, then the completed records closest to expiry. Whether there is
    /// room: not when `adding` and only claims and records kept forever are left (the claim is
    /// then refused).
    pub(super) fn make_room(&mut self, adding: bool) -> RedbResult<bool> {
        let bounds = self.bounds;
        let too_many = |t: &Self| -> RedbResult<bool> {
            Ok(t.entries.len()? + u64::from(adding) > bounds.max_entries)
        };
        let over =
            |t: &Self| -> RedbResult<bool> { Ok(too_many(t)? || t.bytes > bounds.max_bytes) };
        if !over(self)? {
            return Ok(true);
        }
        self.purge(usize::MAX)?;
        let mut evicted = 0;
        // Records kept forever are never evicted: past them, new claims are refused (full).
        while over(self)? {
            let Some((_, key)) = Self::first(&self.records)?.filter(|(at, _)| *at != FOREVER)
            else {
                break;
            };
            match too_many(self)? {
                true => self.evicted.0 += 1,
                false => self.evicted.1 += 1,
            }
            // A record evicted before its ttl takes its tombstone along: its key was not
            // expired, so a retry runs again rather than being refused as expired.
            if self.held(&key)?.is_some_and(|row| !row.is_tombstone()) {
                self.remove(&key.tombstone())?;
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
        Ok(!(adding && over(self)?))
    }
}
