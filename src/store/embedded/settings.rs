//! The embedded store's settings (`backend = "embedded"`): where its file is, how it is
//! written, its bounds.

use std::path::PathBuf;
use std::time::Duration;

use crate::store::memory::{DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES};
use crate::store::settings::DEFAULT_TIMEOUT;
use crate::store::Seal;

/// Where the embedded store keeps its file when `[store]` names no `path` (or no `[store]` is
/// written at all): a directory of that name in the working directory (in the container image,
/// its volume `/var/lib/idemgate`).
pub const DEFAULT_PATH: &str = "idemgate-data";

/// `backend = "embedded"`: where the file is and how it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddedSettings {
    /// The directory the gateway owns (created if missing); the file is [`FILE_NAME`](super::FILE_NAME) in it.
    pub path: PathBuf,
    /// Commit each batch to disk (fsync) before it counts. Off: one durable commit a second at
    /// most, and a crash of the process or of the machine may lose the last two seconds of writes.
    pub fsync: bool,
    /// Most entries kept; past it completed records are evicted (never in-flight claims).
    pub max_entries: usize,
    /// Most bytes of entries kept, evicting likewise.
    pub max_bytes: u64,
    /// How long one operation may wait for its batch before the store counts as down.
    pub timeout: Duration,
    /// How records are sealed at rest.
    pub seal: Seal,
}

impl EmbeddedSettings {
    /// The store in `path`, every other setting at its default.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        EmbeddedSettings {
            path: path.into(),
            fsync: true,
            max_entries: DEFAULT_MAX_ENTRIES,
            max_bytes: DEFAULT_MAX_BYTES,
            timeout: DEFAULT_TIMEOUT,
            seal: Seal::default(),
        }
    }

    /// Seal records as `seal` says.
    pub fn seal(mut self, seal: Seal) -> Self {
        self.seal = seal;
        self
    }
}
