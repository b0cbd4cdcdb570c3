//! The records table: its shape, the version it carries, and the statements run on it.
//!
//! One row per key. The record itself is the record codec's encoding (`store/codec.rs`), the
//! bytes the embedded and Redis stores keep too, so a replay is decoded by one function; the
//! columns beside it are what the statements' conditions read:
//!
//! ```sql
//! CREATE TABLE idemgate_records (
//!     key        bytea PRIMARY KEY,     -- the scoped key (32 bytes)
//!     token      bytea NOT NULL,        -- the claim's fencing token
//!     in_flight  boolean NOT NULL,      -- claimed, not yet completed
//!     record     bytea NOT NULL,        -- the encoded entry
//!     expires_at timestamptz NOT NULL   -- lease end for a claim, TTL end for a record
//! ) WITH (fillfactor = 80);
//! -- what the reaper reads; records kept forever ('infinity') are not in it
//! CREATE INDEX idemgate_records_expiring ON idemgate_records (expires_at)
//!     WHERE expires_at <> 'infinity';
//! COMMENT ON TABLE idemgate_records IS 'idemgate schema 2';
//! ```
//!
//! Versions: 1 indexed every row's `expires_at`; 2 leaves out the rows kept forever, which the
//! reaper never deletes (an audit table of millions of them would otherwise carry an index of
//! millions of entries nobody reads). A table of version 1 is served as it is (the statements
//! do not depend on the index) while one gateway migrates it in the background ([`migrate`]).
//!
//! Time is the server's (`now()`), so gateways whose clocks disagree still agree on expiry.

use std::time::Duration;

use deadpool_postgres::Client;
use tokio_postgres::GenericClient;

use super::PostgresError;

/// The schema version this build writes and reads.
pub(crate) const VERSION: u32 = 2;

/// The expiry index's name after the table's, and its definition: what the reaper reads;
/// records kept forever (`'infinity'`) are not in it.
const EXPIRING: &str = "expiring";
const EXPIRING_ON: &str = "(expires_at) WHERE expires_at <> 'infinity'";

/// What brings a table of version N-1 to version N: an index built concurrently (writers go
/// on meanwhile), then statements run one at a time outside a transaction, with `{t}` the
/// table's name.
struct Migration {
    /// The index's name after the table's (`{t}_expiring`).
    index: &'static str,
    /// What follows `ON "{t}"` in its `CREATE INDEX`.
    on: &'static str,
    /// Run once the index is valid.
    then: &'static [&'static str],
}

/// The migrations in order from version 2.
const MIGRATIONS: [Migration; 1] = [
    // 1 -> 2: the expiry index without the rows kept forever, in place of the one of every row.
    Migration {
        index: EXPIRING,
        on: EXPIRING_ON,
        then: &["DROP INDEX CONCURRENTLY IF EXISTS \"{t}_expires_at\""],
    },
];

/// What the table's comment says before its version number.
const MARK: &str = "idemgate schema ";

/// The statements, with the table's name filled in.
#[derive(Debug)]
pub(super) struct Sql {
    pub(super) claim: String,
    pub(super) claim_unless_expired: String,
    pub(super) complete: String,
    pub(super) complete_unless_expired: String,
    pub(super) complete_with_tombstone: String,
    pub(super) release: String,
    pub(super) renew: String,
    pub(super) inspect: String,
    pub(super) evict: String,
    pub(super) evict_all: String,
    pub(super) reap: String,
}

/// Milliseconds left until `expires_at`, as the statements return them; NULL for a record kept
/// forever (`expires_at` is `'infinity'`, which the reaper never reaches).
const LEFT_MS: &str = "CASE WHEN expires_at = 'infinity' THEN NULL \
     ELSE (extract(epoch FROM expires_at - now()) * 1000)::bigint END";

/// An interval of `$n` milliseconds.
fn ms(n: u8) -> String {
    format!("(${n}::bigint * interval '1 millisecond')")
}

impl Sql {
    /// The statements on table `t`, the reaper deleting at most `reap_batch` rows at a time.
    pub(super) fn for_table(t: &str, reap_batch: u32) -> Self {
        let ours = "key = $1 AND token = $2 AND in_flight AND expires_at > now()";
        Sql {
            claim: claim(t, false),
            claim_unless_expired: claim(t, true),
            complete: format!("WITH {} {}", record(t, false), written(t)),
            complete_unless_expired: format!("WITH {} {}", record(t, true), written(t)),
            complete_with_tombstone: complete_with_tombstone(t),
            release: format!("DELETE FROM \"{t}\" WHERE {ours}"),
            renew: format!(
                "UPDATE \"{t}\" SET expires_at = now() + {} WHERE {ours}",
                ms(3)
            ),
            // The record at $1, or else its tombstone at $2.
            inspect: format!(
                "SELECT record, {LEFT_MS} FROM \"{t}\" WHERE key IN ($1, $2) \
                 AND expires_at > now() ORDER BY key = $1 DESC LIMIT 1"
            ),
            evict: evict(t),
            evict_all: evict_all(t),
            // A batch of expired rows, skipping any a statement holds: row locks only, never
            // the table's.
            reap: format!(
                "DELETE FROM \"{t}\" WHERE key IN (SELECT key FROM \"{t}\" \
                 WHERE expires_at <= now() AND expires_at <> 'infinity' \
                 LIMIT {reap_batch} FOR UPDATE SKIP LOCKED)"
            ),
        }
    }
}

/// The claim, one statement: a live row (claim or record) is read from the statement's
/// snapshot and left alone (a replay writes nothing and takes no lock); otherwise insert, or
/// take over a row that has expired, deciding on its latest version under its lock. When a
/// concurrent claimant won after the snapshot, neither part returns a row: the caller runs the
/// statement again, whose new snapshot sees the winner's row. With `tombstone`, a free key
/// whose tombstone (at $5) lives is not taken: the tombstone is returned instead.
fn claim(t: &str, tombstone: bool) -> String {
    let (tomb, unmarked) = match tombstone {
        true => (
            format!(
                ", tomb AS (\
                     SELECT record, {LEFT_MS} AS left_ms FROM \"{t}\" \
                     WHERE key = $5 AND expires_at > now() AND NOT EXISTS (SELECT 1 FROM live)\
                 )"
            ),
            " AND NOT EXISTS (SELECT 1 FROM tomb)",
        ),
        false => (String::new(), ""),
    };
    let from_tomb = match tombstone {
        true => " UNION ALL SELECT record, left_ms FROM tomb",
        false => "",
    };
    format!(
        "WITH live AS (\
             SELECT record, {LEFT_MS} AS left_ms FROM \"{t}\" \
             WHERE key = $1 AND expires_at > now()\
         ){tomb}, taken AS (\
             INSERT INTO \"{t}\" AS r (key, token, in_flight, record, expires_at) \
             SELECT $1::bytea, $2::bytea, true, $3::bytea, now() + {lease} \
             WHERE NOT EXISTS (SELECT 1 FROM live){unmarked} \
             ON CONFLICT (key) DO UPDATE SET token = excluded.token, in_flight = true, \
             record = excluded.record, expires_at = excluded.expires_at \
             WHERE r.expires_at <= now() \
             RETURNING record, {LEFT_MS} AS left_ms\
         ) \
         SELECT record, left_ms FROM taken UNION ALL SELECT record, left_ms FROM live{from_tomb}",
        lease = ms(4),
    )
}

/// The completion's writes, as `WITH` queries ending in `done` (a row when it wrote): the
/// record, kept for `$4` milliseconds (NULL: forever), an update of our claim (its lease
/// running, or run out), or else an insert where no live row is (our lease ran out and nobody
/// claimed the key since). On a route that keeps tombstones (at $5), neither writes where no
/// live row is while that tombstone lives (another record was there).
fn record(t: &str, tombstone: bool) -> String {
    let unmarked =
        format!("NOT EXISTS (SELECT 1 FROM \"{t}\" WHERE key = $5 AND expires_at > now())");
    let (lapsed, free) = match tombstone {
        true => (
            format!(" AND (expires_at > now() OR {unmarked})"),
            format!(" AND {unmarked}"),
        ),
        false => (String::new(), String::new()),
    };
    format!(
        "upd AS (UPDATE \"{t}\" SET record = $3, expires_at = COALESCE(now() + {ttl}, 'infinity'), \
         in_flight = false WHERE key = $1 AND token = $2 AND in_flight{lapsed} RETURNING 1), \
         ins AS (INSERT INTO \"{t}\" AS r (key, token, in_flight, record, expires_at) \
         SELECT $1::bytea, $2::bytea, false, $3::bytea, COALESCE(now() + {ttl}, 'infinity') \
         WHERE NOT EXISTS (SELECT 1 FROM upd){free} \
         ON CONFLICT (key) DO UPDATE SET token = excluded.token, in_flight = false, \
         record = excluded.record, expires_at = excluded.expires_at \
         WHERE r.expires_at <= now() RETURNING 1), \
         done AS (SELECT 1 FROM upd UNION ALL SELECT 1 FROM ins)",
        ttl = ms(4),
    )
}

/// The completion's answer: whether it wrote, or found our own completion already there (it
/// is left as it is and counts as written).
fn written(t: &str) -> String {
    format!(
        "SELECT EXISTS (SELECT 1 FROM done) OR EXISTS (SELECT 1 FROM \"{t}\" WHERE key = $1 \
         AND token = $2 AND NOT in_flight AND expires_at > now())"
    )
}

/// The completion on a route that keeps tombstones, and the tombstone it leaves at $5 (record
/// $6, kept $7 ms) once it is done.
fn complete_with_tombstone(t: &str) -> String {
    format!(
        "WITH {}, tomb AS (\
             INSERT INTO \"{t}\" AS r (key, token, in_flight, record, expires_at) \
             SELECT $5, '\\x00000000000000000000000000000000'::bytea, false, $6, now() + {lives} \
             FROM done \
             ON CONFLICT (key) DO UPDATE SET token = excluded.token, in_flight = false, \
             record = excluded.record, expires_at = excluded.expires_at\
         ) {}",
        record(t, true),
        written(t),
        lives = ms(7),
    )
}

/// The record at $1 and its tombstone at $2 deleted. Every gateway listening on the table hears
/// of it once the deletion commits (listen.rs), whether a row was there or not.
fn evict(t: &str) -> String {
    let channel = super::listen::channel(t);
    format!(
        "WITH gone AS (DELETE FROM \"{t}\" WHERE key IN ($1, $2) RETURNING expires_at > now() AS live) \
         SELECT coalesce(bool_or(live), false), pg_notify('{channel}', encode($1, 'hex')) FROM gone"
    )
}

/// Every row deleted, and every gateway listening on the table told.
fn evict_all(t: &str) -> String {
    let channel = super::listen::channel(t);
    format!(
        "WITH gone AS (DELETE FROM \"{t}\" RETURNING 1) \
         SELECT count(*), pg_notify('{channel}', '{all}') FROM gone",
        all = super::listen::ALL,
    )
}

/// What the check of the table found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Found {
    /// At this build's version (created just now, or already there).
    Current,
    /// At an older version this build serves as it is, until [`migrate`] brings it up.
    Older(u32),
}

/// The table's existence and version, read without a lock.
async fn version(client: &impl GenericClient, table: &str) -> Result<Option<u32>, PostgresError> {
    let row = client
        .query_one(
            "SELECT to_regclass($1::text) IS NOT NULL, obj_description(to_regclass($1::text), 'pg_class')",
            &[&table],
        )
        .await?;
    let (exists, comment): (bool, Option<String>) = (row.get(0), row.get(1));
    match exists {
        true => check_version(table, comment.as_deref()).map(Some),
        false => Ok(None),
    }
}

/// Check the table's version, or create the table (with its index) when it is missing: short
/// statements, run under the store's timeout on a pooled connection. A table of an older version
/// is only reported: it is migrated apart ([`migrate`]), and served meanwhile. Gateways creating
/// the table together take turns (an advisory lock for the creating transaction).
pub(super) async fn check(client: &mut Client, table: &str) -> Result<Found, PostgresError> {
    if let Some(found) = version(&***client, table).await? {
        return Ok(found_at(found));
    }
    let tx = client.transaction().await?;
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtext('idemgate schema ' || $1::text))",
        &[&table],
    )
    .await?;
    // Made meanwhile by a gateway that held the lock before us.
    if let Some(found) = version(&*tx, table).await? {
        return Ok(found_at(found));
    }
    tx.batch_execute(&format!(
        "CREATE TABLE \"{table}\" (\
             key bytea PRIMARY KEY, \
             token bytea NOT NULL, \
             in_flight boolean NOT NULL, \
             record bytea NOT NULL, \
             expires_at timestamptz NOT NULL\
         ) WITH (fillfactor = 80); \
         CREATE INDEX \"{table}_{EXPIRING}\" ON \"{table}\" {EXPIRING_ON}; \
         COMMENT ON TABLE \"{table}\" IS '{MARK}{VERSION}';"
    ))
    .await?;
    tx.commit().await?;
    tracing::info!(
        table,
        version = VERSION,
        "created the PostgreSQL records table"
    );
    Ok(Found::Current)
}

/// What a table at `version` (one this build serves) is to it.
fn found_at(version: u32) -> Found {
    match version {
        VERSION => Found::Current,
        older => Found::Older(older),
    }
}

/// What a call of [`migrate`] came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Migrated {
    /// This process brought the table from `from` to [`VERSION`].
    From(u32),
    /// The table is at [`VERSION`] already (another process migrated it).
    Already,
    /// Another process holds the migration lock: it is migrating (or its last statement is
    /// still running on the server after that process went away).
    Elsewhere,
}

/// Bring the table to [`VERSION`] without blocking its writers, on a connection of its own
/// outside any transaction (`CONCURRENTLY` cannot run in one), holding a session-level advisory
/// lock so that one process at a time migrates a table; each statement waited for at most
/// `wait`. The version comment changes last, once every index is built and valid: a migration
/// interrupted anywhere is taken up again by the next call, an index left invalid by an
/// interrupted concurrent build dropped and built again.
pub(super) async fn migrate(
    client: &tokio_postgres::Client,
    table: &str,
    wait: Duration,
) -> Result<Migrated, PostgresError> {
    let lock = "hashtext('idemgate migration ' || $1::text)";
    let locked = within(wait, async {
        let row = client
            .query_one(&format!("SELECT pg_try_advisory_lock({lock})"), &[&table])
            .await?;
        Ok::<_, tokio_postgres::Error>(row.get::<_, bool>(0))
    })
    .await?;
    let migrated = match within(wait, version(client, table)).await? {
        Some(VERSION) => Migrated::Already,
        _ if !locked => Migrated::Elsewhere,
        Some(from) => Migrated::From(from),
        None => {
            return Err(PostgresError::Migration(format!(
                "table {table:?} was dropped"
            )))
        }
    };
    if let Migrated::From(from) = migrated {
        migrate_from(client, table, from, wait).await?;
    }
    if locked {
        within(wait, async {
            client
                .execute(&format!("SELECT pg_advisory_unlock({lock})"), &[&table])
                .await
        })
        .await?;
    }
    Ok(migrated)
}

/// The steps from version `from` to [`VERSION`], under the migration lock, then the version
/// comment; each statement waited for at most `wait`.
async fn migrate_from(
    client: &tokio_postgres::Client,
    table: &str,
    from: u32,
    wait: Duration,
) -> Result<(), PostgresError> {
    let run = |sql: String| within(wait, async move { client.batch_execute(&sql).await });
    // Versions run from 1: the steps from the one found on.
    for step in MIGRATIONS.iter().skip((from as usize).saturating_sub(1)) {
        let index = format!("{table}_{}", step.index);
        if within(wait, invalid(client, &index)).await? {
            tracing::info!(
                table,
                index,
                "dropping the invalid index an interrupted build left, to build it again"
            );
            run(format!("DROP INDEX CONCURRENTLY IF EXISTS \"{index}\"")).await?;
        }
        run(format!(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS \"{index}\" ON \"{table}\" {}",
            step.on
        ))
        .await?;
        // One of that name made by hand meanwhile: the version never changes over an index
        // that is not valid.
        if within(wait, invalid(client, &index)).await? {
            return Err(PostgresError::Migration(format!(
                "index {index:?} is invalid after it was built"
            )));
        }
        for sql in step.then {
            run(sql.replace("{t}", table)).await?;
        }
    }
    run(format!("COMMENT ON TABLE \"{table}\" IS '{MARK}{VERSION}'")).await
}

/// `work` within `wait`, or [`PostgresError::MigrationTimeout`].
async fn within<T, E: Into<PostgresError>>(
    wait: Duration,
    work: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, PostgresError> {
    match tokio::time::timeout(wait, work).await {
        Ok(done) => done.map_err(Into::into),
        Err(_) => Err(PostgresError::MigrationTimeout(wait)),
    }
}

/// Whether `index` exists and is invalid (`pg_index.indisvalid` false): what a concurrent build
/// leaves when it is cancelled or fails, and what it is while it runs.
async fn invalid(client: &tokio_postgres::Client, index: &str) -> Result<bool, PostgresError> {
    let row = client
        .query_opt(
            "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1::text)",
            &[&index],
        )
        .await?;
    Ok(row.is_some_and(|r| r.get(0)))
}

/// The version of a table whose comment is `comment`, when this build can use it (as it is, or
/// once migrated).
fn check_version(table: &str, comment: Option<&str>) -> Result<u32, PostgresError> {
    let found = comment
        .and_then(|c| c.strip_prefix(MARK))
        .and_then(|v| v.trim().parse::<u32>().ok());
    match found {
        Some(found @ 1..=VERSION) => Ok(found),
        Some(found) if found > VERSION => Err(PostgresError::SchemaTooNew {
            table: table.to_string(),
            found,
        }),
        // Version 1 is the first: anything else (0 included) is not a table of ours.
        _ => Err(PostgresError::NotOurs {
            table: table.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_the_comment() {
        assert_eq!(check_version("t", Some("idemgate schema 1")).ok(), Some(1));
        assert_eq!(check_version("t", Some("idemgate schema 2")).ok(), Some(2));
        assert_eq!(
            MIGRATIONS.len() as u32,
            VERSION - 1,
            "one migration per version"
        );
        assert!(matches!(
            check_version("t", Some("idemgate schema 3")),
            Err(PostgresError::SchemaTooNew { found: 3, .. })
        ));
        assert!(matches!(
            check_version("t", Some("idemgate schema 0")),
            Err(PostgresError::NotOurs { .. })
        ));
        assert!(matches!(
            check_version("t", Some("payments ledger")),
            Err(PostgresError::NotOurs { .. })
        ));
        assert!(matches!(
            check_version("t", None),
            Err(PostgresError::NotOurs { .. })
        ));
    }
}
