//! The store's file: opened (or created) with its tables, shared by the handles and the
//! writer, and reopened after a failed write.

use std::path::{Path, PathBuf};
use std::sync::{PoisonError, RwLock};

use redb::Database;

use super::tables::{CLAIMS, ENTRIES, META, RECORDS};
use super::{failed, BACKEND};
use crate::store::StoreError;

/// The store's file and its open database, shared by the handles and the writer; no database
/// between a failed write (after which redb refuses every operation until the file is
/// reopened) and its reopening. Reads hold the lock for their whole read, so that the writer
/// can close the file.
#[derive(Debug)]
pub(super) struct StoreFile {
    db: RwLock<Option<Database>>,
    file: PathBuf,
}

impl StoreFile {
    /// Open (or create) `file` with its tables; refused when another process holds it.
    pub(super) fn open(file: PathBuf) -> Result<Self, StoreError> {
        let db = open_database(&file)?;
        Ok(StoreFile {
            db: RwLock::new(Some(db)),
            file,
        })
    }

    /// `f` on the open database, or a store error while it is being reopened.
    pub(super) fn with<T>(
        &self,
        f: impl FnOnce(&Database) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let db = self.db.read().unwrap_or_else(PoisonError::into_inner);
        match db.as_ref() {
            Some(db) => f(db),
            None => Err(StoreError::unavailable(
                BACKEND,
                format!(
                    "{} is being reopened after a write failed",
                    self.file.display()
                ),
            )),
        }
    }

    /// Whether the database is open (not closed by a reopening that failed).
    pub(super) fn is_open(&self) -> bool {
        self.db
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Close the file and open it again (redb recovers the last durable commit); when it will
    /// not open, the store stays closed until the next try.
    /// The lock is held only to take the old database out and to put the new one in: opening a
    /// file (recovering it) takes seconds, and requests on the worker threads, which read under
    /// this lock, get a store error meanwhile instead of stalling every connection.
    pub(super) fn reopen(&self) {
        let old = self
            .db
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(old);
        match open_database(&self.file) {
            Ok(reopened) => {
                tracing::warn!(file = %self.file.display(), "embedded store reopened after a failed write");
                *self.db.write().unwrap_or_else(PoisonError::into_inner) = Some(reopened);
            }
            Err(e) => {
                tracing::error!(error = %e, "embedded store: cannot reopen the file after a failed write; trying again with the next write");
            }
        }
    }
}

/// Open (or create) the database file, with its tables; refused when another process holds it.
fn open_database(file: &Path) -> Result<Database, StoreError> {
    let db = Database::create(file).map_err(|e| match e {
        redb::DatabaseError::DatabaseAlreadyOpen => StoreError::failed(
            BACKEND,
            format!(
                "{} is held by another process (one gateway per store.path)",
                file.display()
            ),
        ),
        e => failed(&file.display().to_string(), e),
    })?;
    init(&db)?;
    Ok(db)
}

/// Create the tables when they are missing, so that reads find them.
fn init(db: &Database) -> Result<(), StoreError> {
    let txn = db.begin_write().map_err(|e| failed("init", e))?;
    {
        txn.open_table(ENTRIES).map_err(|e| failed("init", e))?;
        txn.open_table(CLAIMS).map_err(|e| failed("init", e))?;
        txn.open_table(RECORDS).map_err(|e| failed("init", e))?;
        txn.open_table(META).map_err(|e| failed("init", e))?;
    }
    txn.commit().map_err(|e| failed("init", e))
}
