//! Redis pub/sub for one gateway process: wake-ups for requests waiting on an in-flight key, and
//! admin evictions that every process's local cache must hear of.
//!
//! The scripts that complete or release a key publish on the key's `done` channel (sharded, on
//! the key's own node, in a cluster: keyspace notifications fire only on the node that holds the
//! key). A waiter subscribes to that channel while it waits and polls as before, so a lost
//! message costs latency, never correctness. Evictions are published on one plain channel per
//! prefix, which a cluster delivers to every node.

use std::sync::{Arc, OnceLock};

use redis::{PushInfo, PushKind, Value};

use super::topology::{Conn, Opening, PushFn};
use crate::record::key::ScopedKey;
use crate::store::watch::{Signals, Watch};

/// What an eviction message names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evicted {
    /// One key.
    Key(ScopedKey),
    /// Every key.
    All,
}

type OnEvict = Box<dyn Fn(Evicted) + Send + Sync>;

/// One process's subscriptions, shared by its store handles.
pub(crate) struct Events {
    shared: Arc<Shared>,
    conn: Conn,
    // Shard channels in a cluster.
    sharded: bool,
    evict_channel: String,
}

#[derive(Default)]
struct Shared {
    // Channels waited on.
    signals: Signals,
    evict_channel: Vec<u8>,
    on_evict: OnceLock<OnEvict>,
}

impl Shared {
    fn deliver(&self, info: PushInfo) {
        if !matches!(info.kind, PushKind::Message | PushKind::SMessage) {
            return;
        }
        let mut data = info.data.into_iter();
        let (Some(Value::BulkString(channel)), Some(Value::BulkString(message))) =
            (data.next(), data.next())
        else {
            return;
        };
        if channel == self.evict_channel {
            if let Some(on_evict) = self.on_evict.get() {
                match <[u8; 32]>::try_from(message.as_slice()) {
                    Ok(key) => on_evict(Evicted::Key(ScopedKey(key))),
                    Err(_) => on_evict(Evicted::All),
                }
            }
        } else {
            self.signals.wake(&channel);
        }
    }
}

impl Events {
    /// Subscriptions over a connection of their own (opened lazily, like the store's).
    pub(crate) fn open(o: &Opening<'_>, prefix: &str) -> redis::RedisResult<Arc<Self>> {
        let evict_channel = format!("{prefix}{EVICTED}");
        let shared = Arc::new(Shared {
            evict_channel: evict_channel.clone().into_bytes(),
            ..Shared::default()
        });
        let receiver = Arc::downgrade(&shared);
        let push: PushFn = Arc::new(move |info| {
            if let Some(shared) = receiver.upgrade() {
                shared.deliver(info);
            }
        });
        let conn = Conn::open(&Opening {
            topology: o.topology,
            timeout: o.timeout,
            certs: o.certs.clone(),
            node_auth: o.node_auth.clone(),
            push: Some(push),
        })?;
        if matches!(o.topology, super::Topology::Sentinel { .. }) {
            keep_following(&conn, &shared);
        }
        Ok(Arc::new(Events {
            shared,
            conn,
            sharded: matches!(o.topology, super::Topology::Cluster { .. }),
            evict_channel,
        }))
    }

    /// The channel evictions are published on.
    pub(crate) fn evict_channel(&self) -> &str {
        &self.evict_channel
    }

    /// Hear of evictions from now on (from this process and every other); the first call wins.
    /// While Redis is unreachable the subscription is tried again every second, in the
    /// background.
    pub(crate) async fn on_evicted(&self, f: OnEvict) {
        if self.shared.on_evict.set(f).is_err() {
            return;
        }
        let (mut conn, channel) = (self.conn.clone(), self.evict_channel.clone());
        if let Err(e) = conn.subscribe(&channel, false).await {
            tracing::warn!(error = %e, "could not subscribe to evictions yet; trying again every second (until then, other gateways' evictions reach this local cache when its entries expire)");
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    if conn.subscribe(&channel, false).await.is_ok() {
                        tracing::info!("subscribed to evictions");
                        return;
                    }
                }
            });
        }
    }

    /// Watch `channel` until the returned [`Watch`] is dropped.
    pub(crate) async fn watch(self: &Arc<Self>, channel: String) -> Watch {
        let channel = channel.into_bytes();
        let (rx, first) = self.shared.signals.subscribe(&channel);
        if first {
            let name = String::from_utf8_lossy(&channel).into_owned();
            if let Err(e) = self.conn.clone().subscribe(&name, self.sharded).await {
                tracing::debug!(error = %e, "could not subscribe; the waiter polls");
            }
        }
        let guard = Subscribed {
            channel,
            events: self.clone(),
        };
        Watch::new(rx, guard)
    }
}

/// Behind Sentinel, a subscriber connection carries no commands that would notice a failover:
/// ping the primary every second, so that a lost primary makes the connection ask the sentinels
/// and subscribe again on the new one. Ends with the process's subscriptions.
fn keep_following(conn: &Conn, shared: &Arc<Shared>) {
    let (mut conn, alive) = (conn.clone(), Arc::downgrade(shared));
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(async move {
            while alive.strong_count() > 0 {
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                let _: Result<(), _> = redis::cmd("PING").query_async(&mut conn).await;
            }
        });
    }
}

/// The channel suffix, after the prefix, of admin evictions.
const EVICTED: &str = "evicted";

/// A waiter's subscription to a channel; the last one to go unsubscribes.
struct Subscribed {
    channel: Vec<u8>,
    events: Arc<Events>,
}

impl Drop for Subscribed {
    fn drop(&mut self) {
        if self.events.shared.signals.unsubscribe(&self.channel) {
            let events = self.events.clone();
            let name = String::from_utf8_lossy(&self.channel).into_owned();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = events.conn.clone().unsubscribe(&name, events.sharded).await;
                });
            }
        }
    }
}
