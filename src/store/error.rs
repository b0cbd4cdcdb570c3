//! What a store operation fails with, by kind, whichever backend answered: each backend turns
//! its own errors into these (`From` its error type, in its folder).

use std::error::Error;
use std::sync::Arc;

use super::Unreadable;

/// What a store operation answers: its result, or a [`StoreError`].
pub type StoreResult<T> = Result<T, StoreError>;

/// A store failure: the store could not be reached, did not answer in time, refused or failed,
/// had no room, or returned something unreadable.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The backend could not be reached: a connection refused or broken, no primary named, a
    /// cluster down, no pooled connection, the embedded store's file being reopened.
    #[error(transparent)]
    Unavailable(BackendError),
    /// The backend did not answer within `store.timeout`.
    #[error(transparent)]
    Timeout(BackendError),
    /// The backend was reached and refused or failed what was asked: a wrong password, a TLS
    /// setup that cannot work, a table that is not idemgate's, a file held by another process
    /// or on a full disk.
    #[error(transparent)]
    Failed(BackendError),
    /// An in-process store is at `max_entries` or `max_bytes` and holds nothing it may evict
    /// (in-flight claims, and records kept forever).
    #[error("the store is full of in-flight claims or records kept forever (store.max_entries, store.max_bytes)")]
    Full,
    /// Fewer replicas than `wait_replicas` acknowledged a write within the timeout: a failover
    /// now could lose it.
    #[error("{acked} of {wanted} replicas acknowledged the write in time (store.wait_replicas)")]
    NotAcknowledged {
        /// Replicas that acknowledged.
        acked: i64,
        /// Replicas wanted.
        wanted: u32,
    },
    /// A stored record could not be decoded.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// A stored record could not be opened (sealing): never replayed, never run again.
    #[error(transparent)]
    Unreadable(#[from] Unreadable),
}

/// A backend's own error, with the backend it came from; shown as `backend: error`.
#[derive(Debug, Clone)]
pub struct BackendError {
    backend: &'static str,
    // Shared, so that one failure can be every answer of a batch (the embedded store's).
    error: Arc<dyn Error + Send + Sync>,
}

impl BackendError {
    fn new(backend: &'static str, error: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        BackendError {
            backend,
            error: Arc::from(error.into()),
        }
    }

    /// The backend, as the logs name it: `redis`, `postgres`, `embedded store`.
    pub fn backend(&self) -> &'static str {
        self.backend
    }
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.backend, self.error)
    }
}

impl Error for BackendError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.error)
    }
}

impl StoreError {
    /// `backend` could not be reached: `error` says why.
    pub(crate) fn unavailable(
        backend: &'static str,
        error: impl Into<Box<dyn Error + Send + Sync>>,
    ) -> Self {
        StoreError::Unavailable(BackendError::new(backend, error))
    }

    /// `backend` did not answer in time: `error` says what it was waited for.
    pub(crate) fn timeout(
        backend: &'static str,
        error: impl Into<Box<dyn Error + Send + Sync>>,
    ) -> Self {
        StoreError::Timeout(BackendError::new(backend, error))
    }

    /// `backend` refused or failed: `error` says why.
    pub(crate) fn failed(
        backend: &'static str,
        error: impl Into<Box<dyn Error + Send + Sync>>,
    ) -> Self {
        StoreError::Failed(BackendError::new(backend, error))
    }

    /// Whether the store could not be reached or answered too late, as opposed to refusing
    /// what was asked (a gateway starts anyway when its store is unreachable, and not when it
    /// is misconfigured).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Timeout(_))
    }

    /// The backend's own error, when this is one of type `E` (a [`PostgresError`] or a
    /// `redis::RedisError`, say).
    ///
    /// [`PostgresError`]: super::postgres::PostgresError
    pub fn backend_error<E: Error + 'static>(&self) -> Option<&E> {
        match self {
            StoreError::Unavailable(e) | StoreError::Timeout(e) | StoreError::Failed(e) => {
                e.error.downcast_ref()
            }
            _ => None,
        }
    }
}

/// Why bytes from the store could not be read as an entry.
#[derive(Debug, Clone, thiserror::Error)]
#[error("corrupt or unknown record encoding: {0}")]
pub struct DecodeError(pub(crate) &'static str);
