//! The Redis store: shared by every gateway replica. Each operation is one Lua script, so one
//! round trip and atomic on the server (`EVALSHA`, falling back to `EVAL` once per script load).
//!
//! One Redis string per key, `prefix + hex(scoped key)`, holding the entry encoded by
//! [`crate::idempotency::record`]; its Redis TTL is the lease (in flight) or the record's `ttl`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;

use super::{Claim, Store, StoreError};
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::ScopedKey;
use crate::idempotency::record::{self, EntryState, Token};

/// A handle to the Redis store; clones share one multiplexed connection.
#[derive(Clone)]
pub struct RedisStore {
    // Multiplexed and self-reconnecting: one TCP connection carries every request's commands.
    conn: ConnectionManager,
    // Key prefix, so several deployments can share one Redis.
    prefix: Arc<str>,
    scripts: Arc<Scripts>,
}

struct Scripts {
    claim: Script,
    complete: Script,
    release: Script,
    renew: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connect to `url` (`redis://[user:password@]host:port/db`, `rediss://` for TLS).
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_with_config(client, config).await?;
        Ok(RedisStore {
            conn,
            prefix: prefix.into(),
            scripts: Arc::new(Scripts {
                claim: Script::new(include_str!("lua/claim.lua")),
                complete: Script::new(include_str!("lua/complete.lua")),
                release: Script::new(include_str!("lua/release.lua")),
                renew: Script::new(include_str!("lua/renew.lua")),
            }),
        })
    }

    /// The Redis key of a scoped key.
    pub fn redis_key(&self, key: &ScopedKey) -> String {
        format!("{}{}", self.prefix, key.to_hex())
    }

    /// A clone of the connection, for callers that need raw commands (tests, admin).
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }
}

fn millis(d: Duration) -> u64 {
    d.as_millis().clamp(1, u64::MAX as u128) as u64
}

impl Store for RedisStore {
    async fn claim(
        &self,
        key: &ScopedKey,
        fingerprint: &Fingerprint,
        token: &Token,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let entry = record::encode(fingerprint, token, &EntryState::InFlight);
        let existing: Option<Vec<u8>> = self
            .scripts
            .claim
            .key(self.redis_key(key))
            .arg(entry.as_ref())
            .arg(millis(lease))
            .invoke_async(&mut self.conn.clone())
            .await?;
        match existing {
            None => Ok(Claim::Claimed),
            Some(raw) => Ok(Claim::Existing(record::decode(Bytes::from(raw))?.0)),
        }
    }

    async fn complete(
        &self,
        key: &ScopedKey,
        fingerprint: &Fingerprint,
        token: &Token,
        state: &EntryState,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let entry = record::encode(fingerprint, token, state);
        let done: i64 = self
            .scripts
            .complete
            .key(self.redis_key(key))
            .arg(&token.0[..])
            .arg(entry.as_ref())
            .arg(millis(ttl))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(done == 1)
    }

    async fn release(&self, key: &ScopedKey, token: &Token) -> Result<bool, StoreError> {
        let done: i64 = self
            .scripts
            .release
            .key(self.redis_key(key))
            .arg(&token.0[..])
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(done == 1)
    }

    async fn renew(
        &self,
        key: &ScopedKey,
        token: &Token,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let done: i64 = self
            .scripts
            .renew
            .key(self.redis_key(key))
            .arg(&token.0[..])
            .arg(millis(lease))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(done == 1)
    }
}
