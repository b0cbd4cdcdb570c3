//! The PostgreSQL store's settings (`backend = "postgres"`): the server, the table, the pool
//! and its bounds.

use std::fmt;
use std::time::Duration;

use crate::store::settings::DEFAULT_TIMEOUT;
use crate::store::{redact_url, LocalCacheSettings, Seal, TlsFiles};

/// Table used when none is given.
pub const DEFAULT_TABLE: &str = "idemgate_records";

/// Connections each gateway keeps when no pool size is given.
pub const DEFAULT_POOL_SIZE: usize = 16;

/// How long one statement of a schema migration (an index built concurrently) may run when no
/// `migration_timeout` is given.
pub const DEFAULT_MIGRATION_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// How to reach PostgreSQL and where to keep the records (`backend = "postgres"`).
#[derive(Clone, PartialEq, Eq)]
pub struct PostgresSettings {
    /// `postgres://user:password@host:port/db?sslmode=...`; its password is never printed.
    pub url: String,
    /// The records table (created with its index when missing).
    pub table: String,
    /// Most connections this gateway opens.
    pub pool_size: usize,
    /// How long one operation (checkout, connect, statement) may take before the store counts
    /// as down for that request; the server cancels the statement then too.
    pub timeout: Duration,
    /// How long one statement of a schema migration may run (on a connection of its own, in
    /// the background).
    pub migration_timeout: Duration,
    /// For TLS (`sslmode=prefer`, `require`, `verify-ca`, `verify-full`): the CA(s) to trust,
    /// and the certificate to present to a server that asks for one (`clientcert` in
    /// `pg_hba.conf`).
    pub tls: TlsFiles,
    /// The local cache of completed records in front of PostgreSQL.
    pub local_cache: LocalCacheSettings,
    /// How records are sealed at rest.
    pub seal: Seal,
}

impl PostgresSettings {
    /// PostgreSQL at `url`, every other setting at its default.
    pub fn new(url: impl Into<String>) -> Self {
        PostgresSettings {
            url: url.into(),
            table: DEFAULT_TABLE.to_string(),
            pool_size: DEFAULT_POOL_SIZE,
            timeout: DEFAULT_TIMEOUT,
            migration_timeout: DEFAULT_MIGRATION_TIMEOUT,
            tls: TlsFiles::default(),
            local_cache: LocalCacheSettings::default(),
            seal: Seal::default(),
        }
    }

    /// Seal records as `seal` says.
    pub fn seal(mut self, seal: Seal) -> Self {
        self.seal = seal;
        self
    }

    /// Keep the records in `table`.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Past `timeout` without a connection or an answer, the store counts as down.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// One statement of a schema migration runs at most `timeout`.
    pub fn migration_timeout(mut self, timeout: Duration) -> Self {
        self.migration_timeout = timeout;
        self
    }
}

impl fmt::Debug for PostgresSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL's password is never printed.
        let mut d = f.debug_struct("PostgresSettings");
        d.field("url", &redact_url(&self.url))
            .field("table", &self.table)
            .field("pool_size", &self.pool_size)
            .field(
                "timeout",
                &format_args!("{}", humantime::format_duration(self.timeout)),
            )
            .field(
                "migration_timeout",
                &format_args!("{}", humantime::format_duration(self.migration_timeout)),
            );
        self.tls.debug_fields(&mut d);
        self.local_cache.debug_fields(&mut d);
        d.field("seal", &self.seal).finish()
    }
}
