//! The memory store's settings (`backend = "memory"`): its two bounds.

/// Most entries kept when no bound is given.
pub const DEFAULT_MAX_ENTRIES: usize = 100_000;

/// Most bytes of stored responses kept when no bound is given.
pub const DEFAULT_MAX_BYTES: u64 = 256 * 1024 * 1024;

/// `backend = "memory"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemorySettings {
    /// Most records kept; past it completed records are evicted (never in-flight ones).
    pub max_entries: usize,
    /// Most bytes of stored responses kept, evicting likewise.
    pub max_bytes: u64,
}

impl Default for MemorySettings {
    fn default() -> Self {
        MemorySettings {
            max_entries: DEFAULT_MAX_ENTRIES,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }
}
