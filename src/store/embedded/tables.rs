//! The redb tables: entries by key, claims and completed records by expiry, the byte count;
//! rows read and written in one write transaction.

use std::time::Duration;

use bytes::Bytes;
use redb::{ReadableTable, ReadableTableMetadata, TableDefinition};

use crate::record::key::ScopedKey;
use crate::record::policy::Ttl;
use crate::record::Token;
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

/// An entry's expiry and encoding.
pub(super) fn split(value: &[u8]) -> Option<(u64, Bytes)> {
    let (at, encoding) = value.split_first_chunk::<8>()?;
    Some((u64::from_be_bytes(*at), Bytes::copy_from_slice(encoding)))
}

/// An index row: expiry then key, so rows sort by expiry.
pub(super) fn index_key(at: u64, key: &[u8; 32]) -> [u8; 40] {
    let mut row = [0u8; 40];
    row[..8].copy_from_slice(&at.to_be_bytes());
    row[8..].copy_from_slice(key);
    row
}

/// The expiry of a record kept forever: past every clock, so never purged or evicted first.
pub(super) const FOREVER: u64 = u64::MAX;

/// When an entry written at `now` for `ttl` expires.
pub(super) fn expiry(now: u64, ttl: Ttl) -> u64 {
    ttl.finite()
        .map_or(FOREVER, |ttl| time::after_ms(now, ttl).min(FOREVER - 1))
}

/// How long an entry expiring at `at` lives after `now` (forever: `None`).
pub(super) fn lives(at: u64, now: u64) -> Option<Duration> {
    (at != FOREVER).then(|| Duration::from_millis(at.saturating_sub(now)))
}

/// The tables of one write transaction, and the byte count kept in step with them.
pub(super) struct Tables<'txn> {
    pub(super) entries: redb::Table<'txn, &'static [u8; 32], &'static [u8]>,
    pub(super) claims: redb::Table<'txn, &'static [u8; 40], ()>,
    pub(super) records: redb::Table<'txn, &'static [u8; 40], ()>,
    pub(super) meta: redb::Table<'txn, &'static str, u64>,
    pub(super) bytes: u64,
    // Records evicted for room in this transaction: for the entry bound, for the byte bound.
    pub(super) evicted: (u64, u64),
}

/// A storage failure inside a transaction.
pub(super) type Result2<T> = Result<T, redb::Error>;

impl<'txn> Tables<'txn> {
    pub(super) fn open(txn: &'txn redb::WriteTransaction) -> Result2<Self> {
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

    pub(super) fn save(&mut self) -> Result2<()> {
        self.meta.insert("bytes", self.bytes)?;
        Ok(())
    }

    /// The entry of `key`, expired or not.
    pub(super) fn held(&self, key: &ScopedKey) -> Result2<Option<(u64, Bytes)>> {
        Ok(self.entries.get(&key.0)?.and_then(|v| split(v.value())))
    }

    /// The live entry of `key`: not past its lease or ttl.
    pub(super) fn live(&self, key: &ScopedKey, now: u64) -> Result2<Option<(u64, Bytes)>> {
        Ok(self.held(key)?.filter(|(at, _)| *at > now))
    }

    /// Whether `key` is a live in-flight claim made with `token`.
    pub(super) fn claimed_by(&self, key: &ScopedKey, token: &Token, now: u64) -> Result2<bool> {
        Ok(self.live(key, now)?.is_some_and(|(_, v)| holds(&v, token)))
    }

    /// Write `key`'s entry (replacing any), its index row and its weight.
    pub(super) fn put(&mut self, key: &ScopedKey, at: u64, value: &[u8]) -> Result2<()> {
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
    pub(super) fn remove(&mut self, key: &ScopedKey) -> Result2<bool> {
        let Some((at, value)) = self.entries.remove(&key.0)?.and_then(|v| split(v.value())) else {
            return Ok(false);
        };
        self.index(&value).remove(&index_key(at, &key.0))?;
        self.bytes = self.bytes.saturating_sub(weight(&value));
        Ok(true)
    }

    pub(super) fn index(&mut self, value: &[u8]) -> &mut redb::Table<'txn, &'static [u8; 40], ()> {
        match value.get(codec::STATE_AT) {
            Some(&codec::IN_FLIGHT) => &mut self.claims,
            _ => &mut self.records,
        }
    }

    pub(super) fn remove_all(&mut self) -> Result2<u64> {
        let n = self.entries.len()?;
        self.entries.retain(|_, _| false)?;
        self.claims.retain(|_, _| false)?;
        self.records.retain(|_, _| false)?;
        self.bytes = 0;
        Ok(n)
    }

    /// The first row of an index: its expiry and key.
    pub(super) fn first(
        index: &redb::Table<'txn, &'static [u8; 40], ()>,
    ) -> Result2<Option<(u64, ScopedKey)>> {
        Ok(index.first()?.map(|(row, _)| {
            let [a, b, c, d, e, f, g, h, key @ ..] = *row.value();
            (u64::from_be_bytes([a, b, c, d, e, f, g, h]), ScopedKey(key))
        }))
    }
}

/// Whether an encoded entry is an in-flight claim made with `token`.
pub(super) fn holds(value: &[u8], token: &Token) -> bool {
    is_claim(value) && has_token(value, token)
}

/// Whether an encoded entry is an in-flight claim.
pub(super) fn is_claim(value: &[u8]) -> bool {
    value.get(codec::STATE_AT) == Some(&codec::IN_FLIGHT)
}

/// Whether an encoded entry was written by the claim whose token is `token`.
pub(super) fn has_token(value: &[u8], token: &Token) -> bool {
    value.get(codec::TOKEN_AT..codec::WRITTEN_AT) == Some(&token.0[..])
}

/// What an entry costs: its encoding and a fixed overhead.
pub(super) fn weight(value: &[u8]) -> u64 {
    ENTRY_OVERHEAD + value.len() as u64
}
