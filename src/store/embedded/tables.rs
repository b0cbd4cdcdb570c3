//! The redb tables: entries by key, claims and completed records by expiry, the byte count;
//! rows read and written in one write transaction.

use std::time::Duration;

use bytes::Bytes;
use redb::{ReadableTable, ReadableTableMetadata, TableDefinition};

use crate::record::key::ScopedKey;
use crate::record::policy::Ttl;
use crate::record::{now_ms, Token};
use crate::store::codec;
use crate::time;

/// Entries by key: expiry (u64 big-endian ms) then the encoded entry.
pub(super) const ENTRIES: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new("entries");
/// In-flight claims by expiry: expiry (big-endian) then key.
pub(super) const CLAIMS: TableDefinition<&[u8; 40], ()> = TableDefinition::new("claims_by_expiry");
/// Completed records by expiry: expiry (big-endian) then key.
pub(super) const RECORDS: TableDefinition<&[u8; 40], ()> =
    TableDefinition::new("records_by_expiry");
/// Counters kept in step with the entries: the bytes they weigh.
pub(super) const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// What an entry weighs besides its encoding: its key, its index row and B-tree overhead.
const ENTRY_OVERHEAD: u64 = 128;

/// The expiry of a record kept forever: past every clock, so never purged or evicted first.
pub(super) const FOREVER: u64 = u64::MAX;

/// A storage failure inside a transaction.
pub(super) type RedbResult<T> = Result<T, redb::Error>;

/// One index by expiry (claims, or completed records): rows of expiry then key.
type Index<'txn> = redb::Table<'txn, &'static [u8; 40], ()>;

/// An entry as the entries table keeps it.
#[derive(Debug, Clone)]
pub(super) struct Row {
    /// When it expires, in ms since the Unix epoch ([`FOREVER`]: kept forever).
    pub(super) expires_at: u64,
    /// The record codec's encoding of the entry.
    pub(super) encoding: Bytes,
}

impl Row {
    /// The row stored as `value`: its expiry (big-endian), then its encoding.
    pub(super) fn read(value: &[u8]) -> Option<Self> {
        let (at, encoding) = value.split_first_chunk::<8>()?;
        Some(Row {
            expires_at: u64::from_be_bytes(*at),
            encoding: Bytes::copy_from_slice(encoding),
        })
    }

    /// Whether the entry is live at `now`: not past its lease or ttl.
    pub(super) fn live_at(&self, now: u64) -> bool {
        self.expires_at > now
    }

    /// How long the entry lives from now (forever: `None`).
    pub(super) fn lives(&self) -> Option<Duration> {
        let now = now_ms();
        (self.expires_at != FOREVER)
            .then(|| Duration::from_millis(self.expires_at.saturating_sub(now)))
    }

    /// Whether the entry is an in-flight claim.
    pub(super) fn is_claim(&self) -> bool {
        is_claim(&self.encoding)
    }

    /// Whether the entry was written by the claim whose token is `token`.
    pub(super) fn written_by(&self, token: &Token) -> bool {
        self.encoding.get(codec::TOKEN_AT..codec::WRITTEN_AT) == Some(&token.0[..])
    }

    /// Whether the entry is an in-flight claim made with `token`.
    pub(super) fn claimed_by(&self, token: &Token) -> bool {
        self.is_claim() && self.written_by(token)
    }

    /// Whether the entry is the tombstone of an expired record.
    pub(super) fn is_tombstone(&self) -> bool {
        self.encoding.get(codec::STATE_AT) == Some(&codec::EXPIRED)
    }
}

/// Whether an encoding is an in-flight claim's.
fn is_claim(encoding: &[u8]) -> bool {
    encoding.get(codec::STATE_AT) == Some(&codec::IN_FLIGHT)
}

/// When an entry written at `now` for `ttl` expires.
pub(super) fn expiry(now: u64, ttl: Ttl) -> u64 {
    ttl.finite()
        .map_or(FOREVER, |ttl| time::after_ms(now, ttl).min(FOREVER - 1))
}

/// An index row: expiry then key, so rows sort by expiry.
fn index_key(at: u64, key: &[u8; 32]) -> [u8; 40] {
    let mut row = [0u8; 40];
    row[..8].copy_from_slice(&at.to_be_bytes());
    row[8..].copy_from_slice(key);
    row
}

/// What an entry costs: its encoding and a fixed overhead.
fn weight(encoding: &[u8]) -> u64 {
    ENTRY_OVERHEAD + encoding.len() as u64
}

/// The store's bounds (`max_entries`, `max_bytes`), each at least 1.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bounds {
    pub(super) max_entries: u64,
    pub(super) max_bytes: u64,
}

/// The tables of one write transaction, the byte count kept in step with them, and the time
/// the transaction reckons with.
pub(super) struct Tables<'txn> {
    pub(super) entries: redb::Table<'txn, &'static [u8; 32], &'static [u8]>,
    pub(super) claims: Index<'txn>,
    pub(super) records: Index<'txn>,
    meta: redb::Table<'txn, &'static str, u64>,
    pub(super) bytes: u64,
    // Records evicted for room in this transaction: for the entry bound, for the byte bound.
    pub(super) evicted: (u64, u64),
    // Now, in ms since the Unix epoch: what is live and when what is written expires.
    pub(super) now: u64,
    pub(super) bounds: Bounds,
}

impl<'txn> Tables<'txn> {
    /// The tables of `txn`, kept within `bounds`.
    pub(super) fn open(txn: &'txn redb::WriteTransaction, bounds: Bounds) -> RedbResult<Self> {
        let meta = txn.open_table(META)?;
        let bytes = meta.get("bytes")?.map_or(0, |v| v.value());
        Ok(Tables {
            entries: txn.open_table(ENTRIES)?,
            claims: txn.open_table(CLAIMS)?,
            records: txn.open_table(RECORDS)?,
            meta,
            bytes,
            evicted: (0, 0),
            now: now_ms(),
            bounds,
        })
    }

    /// Keep the byte count, before the transaction commits.
    pub(super) fn save(&mut self) -> RedbResult<()> {
        self.meta.insert("bytes", self.bytes)?;
        Ok(())
    }

    /// The entry of `key`, expired or not.
    pub(super) fn held(&self, key: &ScopedKey) -> RedbResult<Option<Row>> {
        Ok(self.entries.get(&key.0)?.and_then(|v| Row::read(v.value())))
    }

    /// The live entry of `key`: not past its lease or ttl.
    pub(super) fn live(&self, key: &ScopedKey) -> RedbResult<Option<Row>> {
        Ok(self.held(key)?.filter(|row| row.live_at(self.now)))
    }

    /// Whether `key` is a live in-flight claim made with `token`.
    pub(super) fn claimed_by(&self, key: &ScopedKey, token: &Token) -> RedbResult<bool> {
        Ok(self.live(key)?.is_some_and(|row| row.claimed_by(token)))
    }

    /// Write `key`'s entry (replacing any), expiring at `expires_at`, its index row and its
    /// weight.
    pub(super) fn put(
        &mut self,
        key: &ScopedKey,
        expires_at: u64,
        encoding: &[u8],
    ) -> RedbResult<()> {
        self.remove(key)?;
        let mut stored = Vec::with_capacity(8 + encoding.len());
        stored.extend_from_slice(&expires_at.to_be_bytes());
        stored.extend_from_slice(encoding);
        self.entries.insert(&key.0, stored.as_slice())?;
        self.index(encoding)
            .insert(&index_key(expires_at, &key.0), ())?;
        self.bytes += weight(encoding);
        Ok(())
    }

    /// Delete `key`'s entry and index row; whether there was one.
    pub(super) fn remove(&mut self, key: &ScopedKey) -> RedbResult<bool> {
        let removed = self.entries.remove(&key.0)?;
        let Some(row) = removed.and_then(|v| Row::read(v.value())) else {
            return Ok(false);
        };
        self.index(&row.encoding)
            .remove(&index_key(row.expires_at, &key.0))?;
        self.bytes = self.bytes.saturating_sub(weight(&row.encoding));
        Ok(true)
    }

    /// The index an entry of `encoding` is in: claims, or completed records.
    fn index(&mut self, encoding: &[u8]) -> &mut Index<'txn> {
        match is_claim(encoding) {
            true => &mut self.claims,
            false => &mut self.records,
        }
    }

    /// Delete every entry; how many there were.
    pub(super) fn remove_all(&mut self) -> RedbResult<u64> {
        let n = self.entries.len()?;
        self.entries.retain(|_, _| false)?;
        self.claims.retain(|_, _| false)?;
        self.records.retain(|_, _| false)?;
        self.bytes = 0;
        Ok(n)
    }

    /// The first row of an index: its expiry and key.
    pub(super) fn first(index: &Index<'txn>) -> RedbResult<Option<(u64, ScopedKey)>> {
        Ok(index.first()?.map(|(row, _)| {
            let [a, b, c, d, e, f, g, h, key @ ..] = *row.value();
            (u64::from_be_bytes([a, b, c, d, e, f, g, h]), ScopedKey(key))
        }))
    }
}
