//! tollgate's own migration runner and schema check.
//!
//! The migrations ship in the crate as SQL with a `{schema}` placeholder.
//! The runner keeps its own table, `{schema}.schema_migrations`, in
//! tollgate's schema (never shared with the host application), and applies
//! every pending migration in one transaction holding a transaction-scoped
//! advisory lock derived from the schema name, so instances that start
//! together migrate exactly once and a failed migration leaves nothing
//! behind (I33).

use sha2::{Digest, Sha256};
use sqlx::{Executor, PgConnection, Postgres, Transaction};

use crate::store::StoreError;
use crate::store::postgres::convert::{advisory_key, get, storage};
use crate::store::postgres::{PostgresError, PostgresStore};

/// What [`PostgresStore::migrate`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// The versions this call applied, in order; empty when the schema was
    /// already current.
    pub applied: Vec<u32>,
    /// The schema's version afterwards.
    pub current: u32,
}

/// How the database's schema compares with the migrations this build ships.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemaStatus {
    /// Every shipped migration is applied, unchanged.
    Current {
        /// The schema's version.
        version: u32,
    },
    /// No migration was ever applied in the schema.
    Missing,
    /// Some shipped migrations are not applied yet: run
    /// [`PostgresStore::migrate`].
    Behind {
        /// The newest applied version.
        applied: u32,
        /// The newest shipped version.
        shipped: u32,
    },
    /// The database has migrations this build does not know: a newer
    /// tollgate migrated it.
    Ahead {
        /// The newest applied version.
        applied: u32,
        /// The newest shipped version.
        shipped: u32,
    },
    /// An applied migration's checksum differs from the shipped one.
    Modified {
        /// The first such migration.
        version: u32,
    },
}

/// One shipped migration.
#[derive(Debug)]
struct Migration {
    version: u32,
    sql: &'static str,
}

/// Every migration this build ships, oldest first.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sql: include_str!("migrations/0001_init.sql"),
    },
    Migration {
        version: 2,
        sql: include_str!("migrations/0002_set_based_ingest.sql"),
    },
];

impl Migration {
    /// The SHA-256 of the shipped SQL, before the schema name is spliced in.
    fn checksum(&self) -> Vec<u8> {
        Sha256::digest(self.sql.as_bytes()).to_vec()
    }
}

/// The longest [`PostgresStore::migrate`] waits for another instance's
/// migration to finish.
const MIGRATION_LOCK_WAIT: &str = "10min";

/// How often [`PostgresStore::migrate`] starts over after finding the
/// catalog changed under it.
const MIGRATION_ATTEMPTS_MAX: u32 = 3;

/// Whether `error` says the catalog changed since this backend last looked:
/// an object it did not see exists, or one it saw does not.
fn stale_catalog(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(error) = error else {
        return false;
    };
    // unique_violation, duplicate_schema, duplicate_table, duplicate_object,
    // undefined_table, invalid_schema_name.
    matches!(
        error.code().as_deref(),
        Some("23505" | "42P06" | "42P07" | "42710" | "42P01" | "3F000")
    )
}

fn shipped() -> u32 {
    MIGRATIONS.last().map_or(0, |migration| migration.version)
}

/// Compares what the database applied with what this build ships.
fn compare(applied: &[(u32, Vec<u8>)]) -> SchemaStatus {
    let newest_shipped = shipped();
    let Some(newest) = applied.iter().map(|(version, _)| *version).max() else {
        return SchemaStatus::Missing;
    };
    if newest > newest_shipped {
        return SchemaStatus::Ahead {
            applied: newest,
            shipped: newest_shipped,
        };
    }
    for (version, checksum) in applied {
        let matches = MIGRATIONS
            .iter()
            .find(|migration| migration.version == *version)
            .is_some_and(|migration| migration.checksum() == *checksum);
        if !matches {
            return SchemaStatus::Modified { version: *version };
        }
    }
    if newest < newest_shipped {
        SchemaStatus::Behind {
            applied: newest,
            shipped: newest_shipped,
        }
    } else {
        SchemaStatus::Current { version: newest }
    }
}

impl PostgresStore {
    /// Applies every shipped migration the schema lacks, creating the schema
    /// first if needed. Safe to call from many instances at once: they
    /// serialize on an advisory lock and the migrations are applied once.
    ///
    /// # Errors
    ///
    /// [`PostgresError::Migration`] when a migration fails or the database
    /// disagrees with the shipped migrations (ahead, or modified): nothing is
    /// applied then. [`PostgresError::Storage`] when the database fails.
    pub async fn migrate(&self) -> Result<MigrationReport, PostgresError> {
        let mut attempt = 1;
        loop {
            // Read committed whatever the pool's default: after waiting for
            // another instance's migration, a snapshot taken before the wait
            // would miss the versions that one recorded and apply them again.
            let mut tx = self
                .pool
                .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await
                .map_err(|error| storage("starting the migration", &error))?;
            match self.prepare(&mut tx).await {
                Ok(()) => return self.apply(tx).await,
                // A backend caches catalog lookups and refreshes its cache
                // when a transaction starts, not when an advisory lock is
                // granted: after waiting for another instance's migration,
                // it may not see the schema that instance created. A new
                // transaction sees it.
                Err(error) if attempt < MIGRATION_ATTEMPTS_MAX && stale_catalog(&error) => {
                    attempt += 1;
                }
                Err(error) => return Err(storage("preparing the migration", &error).into()),
            }
        }
    }

    /// Takes the migration lock, then creates the schema and the migration
    /// table if they are missing.
    async fn prepare(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        // The store's lock timeout (a second or so, for the request-serving
        // calls) would also end the wait for the migration lock, so an
        // instance started beside one running a long migration would fail
        // to start. Only that wait is longer: the migration's own
        // statements are back under the store's lock timeout, so one that
        // needs a table the serving calls use gives up in seconds rather
        // than queue every call behind it for minutes.
        sqlx::query(&format!("SET LOCAL lock_timeout = '{MIGRATION_LOCK_WAIT}'"))
            .execute(&mut *conn)
            .await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(advisory_key("migrate", &self.schema))
            .execute(&mut *conn)
            .await?;
        sqlx::query(&format!("SET LOCAL lock_timeout = '{}'", self.lock_timeout))
            .execute(&mut *conn)
            .await?;
        // Only what is missing is created. `PostgreSQL` checks the privilege
        // to create before it looks at `IF NOT EXISTS`, so an unconditional
        // `CREATE SCHEMA IF NOT EXISTS` would refuse every run of a role
        // that owns its schema but may not create schemas in the database,
        // even one with nothing to apply.
        let (schema_exists, table_exists): (bool, bool) =
            sqlx::query_as("SELECT to_regnamespace($1) IS NOT NULL, to_regclass($2) IS NOT NULL")
                .bind(self.sql("{schema}"))
                .bind(self.sql("{schema}.schema_migrations"))
                .fetch_one(&mut *conn)
                .await?;
        let mut create = String::new();
        if !schema_exists {
            create.push_str(&self.sql("CREATE SCHEMA {schema};"));
        }
        if !table_exists {
            create.push_str(&self.sql(
                "CREATE TABLE {schema}.schema_migrations ( \
                     version    int         PRIMARY KEY, \
                     checksum   bytea       NOT NULL, \
                     applied_at timestamptz NOT NULL)",
            ));
        }
        if !create.is_empty() {
            // Through the executor: `RawSql::execute` is an `async fn`
            // generic over its executor, whose future is not `Send` for
            // every lifetime (so `migrate()` could not be spawned); the
            // executor's own method returns a boxed `Send` future.
            Executor::execute(&mut *conn, sqlx::raw_sql(&create)).await?;
        }
        Ok(())
    }

    /// Applies the pending migrations in the prepared transaction, which
    /// holds the migration lock.
    async fn apply(
        &self,
        mut tx: Transaction<'_, Postgres>,
    ) -> Result<MigrationReport, PostgresError> {
        let applied = self.applied(&mut tx).await?;
        match compare(&applied) {
            SchemaStatus::Ahead { applied, .. } => {
                return Err(PostgresError::Migration {
                    version: applied,
                    message: format!(
                        "the database is at version {applied}, newer than this build's {}",
                        shipped()
                    ),
                });
            }
            SchemaStatus::Modified { version } => {
                return Err(PostgresError::Migration {
                    version,
                    message: "the applied migration differs from the shipped one".to_owned(),
                });
            }
            _ => {}
        }
        let mut report = MigrationReport {
            applied: Vec::new(),
            current: applied
                .iter()
                .map(|(version, _)| *version)
                .max()
                .unwrap_or(0),
        };
        // Collected first: an iterator adapter holding a closure across the
        // awaits below would keep this future from being `Send` for every
        // lifetime, and so from `tokio::spawn` (rust-lang/rust#64552).
        let pending: Vec<&Migration> = MIGRATIONS
            .iter()
            .filter(|migration| {
                !applied
                    .iter()
                    .any(|(version, _)| *version == migration.version)
            })
            .collect();
        for migration in pending {
            let sql = self.sql(migration.sql);
            Executor::execute(&mut *tx, sqlx::raw_sql(&sql))
                .await
                .map_err(|error| PostgresError::Migration {
                    version: migration.version,
                    message: error.to_string(),
                })?;
            // The applied instant is bookkeeping, not the ledger, so it is
            // the server's clock (I13 governs the ledger's instants).
            sqlx::query(&self.sql(
                "INSERT INTO {schema}.schema_migrations (version, checksum, applied_at) \
                 VALUES ($1, $2, now())",
            ))
            .bind(i32::try_from(migration.version).unwrap_or(i32::MAX))
            .bind(migration.checksum())
            .execute(&mut *tx)
            .await
            .map_err(|error| storage("recording a migration", &error))?;
            report.applied.push(migration.version);
            report.current = migration.version;
        }
        tx.commit()
            .await
            .map_err(|error| storage("committing the migration", &error))?;
        Ok(report)
    }

    /// How the schema compares with the shipped migrations. Changes
    /// nothing.
    ///
    /// # Errors
    ///
    /// [`PostgresError::Storage`] when the database fails.
    pub async fn check_schema(&self) -> Result<SchemaStatus, PostgresError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|error| storage("acquiring a connection", &error))?;
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(self.sql("{schema}.schema_migrations"))
            .fetch_one(&mut *conn)
            .await
            .map_err(|error| storage("finding the migration table", &error))?;
        if !exists {
            return Ok(SchemaStatus::Missing);
        }
        Ok(compare(&self.applied(&mut conn).await?))
    }

    async fn applied(&self, conn: &mut PgConnection) -> Result<Vec<(u32, Vec<u8>)>, StoreError> {
        let rows = sqlx::query(
            &self.sql("SELECT version, checksum FROM {schema}.schema_migrations ORDER BY version"),
        )
        .fetch_all(conn)
        .await
        .map_err(|error| storage("reading applied migrations", &error))?;
        rows.iter()
            .map(|row| {
                let version: i32 = get(row, "version")?;
                let version = u32::try_from(version).map_err(|_| {
                    StoreError::new(format!("postgres: migration version {version} is negative"))
                })?;
                Ok((version, get(row, "checksum")?))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_numbered_from_one_without_gaps() {
        for (position, migration) in MIGRATIONS.iter().enumerate() {
            assert_eq!(migration.version as usize, position + 1);
            assert!(migration.sql.contains("{schema}"));
        }
    }

    #[test]
    fn the_schema_check_says_what_differs() {
        let good: Vec<(u32, Vec<u8>)> = MIGRATIONS
            .iter()
            .map(|migration| (migration.version, migration.checksum()))
            .collect();
        assert_eq!(compare(&[]), SchemaStatus::Missing);
        assert_eq!(compare(&good), SchemaStatus::Current { version: 2 });
        assert_eq!(
            compare(&good[..1]),
            SchemaStatus::Behind {
                applied: 1,
                shipped: 2
            }
        );
        assert_eq!(
            compare(&[(1, vec![0; 32]), good[1].clone()]),
            SchemaStatus::Modified { version: 1 }
        );
        assert_eq!(
            compare(&[good[0].clone(), good[1].clone(), (3, vec![0; 32])]),
            SchemaStatus::Ahead {
                applied: 3,
                shipped: 2
            }
        );
    }
}
