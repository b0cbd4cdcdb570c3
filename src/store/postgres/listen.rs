//! Admin evictions heard from every gateway on the table: each process keeps one connection of
//! its own, beside the pool, that `LISTEN`s on the table's channel; an eviction `NOTIFY`s it in
//! the statement that deletes, so every process's local cache drops the key once it commits.
//!
//! A notification sent while a process was not listening is lost, so each time the connection
//! is (re)made the cache is emptied: what was evicted meanwhile is forgotten too. A connection
//! that stops answering is noticed by a query every [`CHECK_EVERY`] bounded by the store's
//! timeout.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::OptionFuture;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_postgres::{AsyncMessage, Client, Connection};

use super::Connector;
use crate::record::key::ScopedKey;
use crate::store::Evicted;

/// What hears the evictions.
pub(super) type OnEvict = Arc<dyn Fn(Evicted) + Send + Sync>;

/// The channel evictions of `table`'s keys are sent on.
pub(super) fn channel(table: &str) -> String {
    format!("{table}_evicted")
}

/// The payload of an eviction of every key; one key's is its 64 hex digits.
pub(super) const ALL: &str = "all";

/// How often the connection is checked, and tried again while it is down.
pub(super) const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Listen for ever, connecting again after each failure; `listening` is set once the first
/// connection listens.
pub(super) async fn listen(
    connector: Connector,
    channel: String,
    on_evict: OnEvict,
    listening: tokio::sync::watch::Sender<bool>,
) {
    let mut failures = 0u64;
    loop {
        let session = Session {
            channel: &channel,
            timeout: connector.timeout,
            on_evict: &on_evict,
            listening: &listening,
        };
        let why = match &connector.tls {
            None => match connector.config.connect(tokio_postgres::NoTls).await {
                Ok((client, conn)) => session.run(client, conn).await,
                Err(e) => super::describe(&e),
            },
            Some(tls) => match connector.config.connect(tls.clone()).await {
                Ok((client, conn)) => session.run(client, conn).await,
                Err(e) => super::describe(&e),
            },
        };
        failures += 1;
        match failures {
            1 => {
                tracing::warn!(error = %why, "not listening for other gateways' evictions; trying again every second (until then they reach this local cache when its entries expire)")
            }
            _ => tracing::debug!(error = %why, "still not listening for evictions"),
        }
        tokio::time::sleep(CHECK_EVERY).await;
    }
}

/// One connection's listening.
struct Session<'a> {
    channel: &'a str,
    timeout: Duration,
    on_evict: &'a OnEvict,
    listening: &'a tokio::sync::watch::Sender<bool>,
}

type Pending<'c> = Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'c>>;

/// `sql` on `client`, within `timeout`.
fn ask(client: &Client, sql: String, timeout: Duration) -> Pending<'_> {
    Box::pin(async move {
        match tokio::time::timeout(timeout, client.batch_execute(&sql)).await {
            Ok(done) => done.map_err(|e| super::describe(&e)),
            Err(_) => Err(format!("no answer within {timeout:?} (store.timeout)")),
        }
    })
}

impl Session<'_> {
    /// Drive the connection, delivering its notifications, until it fails; why it did.
    async fn run<S, T>(&self, client: Client, mut conn: Connection<S, T>) -> String
    where
        S: AsyncRead + AsyncWrite + Unpin,
        T: AsyncRead + AsyncWrite + Unpin,
    {
        // One query at a time: the LISTEN first, then the checks.
        let mut pending = Some(ask(
            &client,
            format!("LISTEN \"{}\"", self.channel),
            self.timeout,
        ));
        let mut listening = false;
        let mut check = tokio::time::interval(CHECK_EVERY);
        loop {
            tokio::select! {
                message = poll_fn(|cx| conn.poll_message(cx)) => match message {
                    Some(Ok(AsyncMessage::Notification(n))) => self.deliver(n.payload()),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return super::describe(&e),
                    None => return "the connection closed".into(),
                },
                Some(done) = OptionFuture::from(pending.as_mut()), if pending.is_some() => {
                    pending = None;
                    if let Err(why) = done {
                        return why;
                    }
                    if !listening {
                        listening = true;
                        // Whatever was evicted while no one listened is forgotten too.
                        (self.on_evict)(Evicted::All);
                        self.listening.send_replace(true);
                        tracing::debug!(channel = self.channel, "listening for evictions");
                    }
                }
                _ = check.tick(), if pending.is_none() => {
                    pending = Some(ask(&client, "SELECT 1".into(), self.timeout));
                }
            }
        }
    }

    fn deliver(&self, payload: &str) {
        if payload == ALL {
            return (self.on_evict)(Evicted::All);
        }
        let mut key = [0u8; 32];
        let hex = payload.as_bytes();
        if hex.len() != 64 {
            return;
        }
        for (byte, pair) in key.iter_mut().zip(hex.chunks_exact(2)) {
            match std::str::from_utf8(pair)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                Some(b) => *byte = b,
                None => return,
            }
        }
        (self.on_evict)(Evicted::Key(ScopedKey(key)));
    }
}
