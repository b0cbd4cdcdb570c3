//! Wake-ups for requests waiting on an in-flight key (`on_in_flight = "wait"`): one signal per
//! channel (a key, or the Redis channel it is announced on), which waiters hold while they wait
//! and the store fires when the key is completed or released.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

/// A channel's signal, and how many waiters hold it.
type Signal = (watch::Sender<()>, usize);

/// The signals of one process's waiters, by channel.
#[derive(Default)]
pub(crate) struct Signals {
    waiting: Mutex<HashMap<Vec<u8>, Signal>>,
}

impl Signals {
    /// One more waiter on `channel`: its receiver, and whether it is the channel's first.
    pub(crate) fn subscribe(&self, channel: &[u8]) -> (watch::Receiver<()>, bool) {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = waiting
            .entry(channel.to_vec())
            .or_insert_with(|| (watch::Sender::new(()), 0));
        entry.1 += 1;
        (entry.0.subscribe(), entry.1 == 1)
    }

    /// One waiter fewer on `channel`: whether it was the last.
    pub(crate) fn unsubscribe(&self, channel: &[u8]) -> bool {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        match waiting.get_mut(channel) {
            Some(entry) if entry.1 > 1 => {
                entry.1 -= 1;
                false
            }
            Some(_) => {
                waiting.remove(channel);
                true
            }
            None => false,
        }
    }

    /// Wake every waiter on `channel`, if any.
    pub(crate) fn wake(&self, channel: &[u8]) {
        if let Some((tx, _)) = self
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(channel)
        {
            tx.send_replace(());
        }
    }
}

/// A waiter's subscription: [`Watch::changed`] resolves when its key was completed or released
/// (or may have been: callers look again). Dropping it unsubscribes.
pub struct Watch {
    rx: watch::Receiver<()>,
    // Unsubscribes when dropped.
    _guard: Box<dyn Send + Sync>,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch").finish_non_exhaustive()
    }
}

impl Watch {
    /// A subscription through `rx`, ended by dropping `guard`.
    pub(crate) fn new(rx: watch::Receiver<()>, guard: impl Send + Sync + 'static) -> Self {
        Watch {
            rx,
            _guard: Box::new(guard),
        }
    }

    /// Resolves at the next signal since the last call.
    pub async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Waiting on one key of a store that signals only its own process's completions: subscribed
/// while held.
pub(crate) struct Local {
    signals: Arc<Signals>,
    channel: Vec<u8>,
}

impl Local {
    /// A waiter on `channel` of `signals`.
    pub(crate) fn watch(signals: &Arc<Signals>, channel: &[u8]) -> Watch {
        let (rx, _) = signals.subscribe(channel);
        let guard = Local {
            signals: signals.clone(),
            channel: channel.to_vec(),
        };
        Watch::new(rx, guard)
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        self.signals.unsubscribe(&self.channel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waiters_are_woken_and_counted() {
        let signals = Arc::new(Signals::default());
        let mut a = Local::watch(&signals, b"k");
        let b = Local::watch(&signals, b"k");
        signals.wake(b"other");
        signals.wake(b"k");
        a.changed().await;
        drop(b);
        assert!(signals.waiting.lock().unwrap().contains_key(&b"k"[..]));
        drop(a);
        assert!(signals.waiting.lock().unwrap().is_empty());
    }
}
