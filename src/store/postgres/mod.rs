//! The `PostgreSQL` store: every port over one shared database, so many
//! gateway instances can share accounts.
//!
//! [`PostgresStore`] implements [`LeaseAllocator`](crate::store::LeaseAllocator),
//! [`UsageSink`](crate::store::UsageSink) and
//! [`SnapshotSource`](crate::store::SnapshotSource) plus the operator's
//! operations, and behaves exactly like the
//! [`MemoryStore`](crate::store::MemoryStore): the same grants, the same
//! refusals in the same order, the same ingest outcomes. Grant sizes and
//! refills are computed in Rust by the same [`GrantPolicy`] code; `PostgreSQL`
//! only keeps the books.
//!
//! # Schema and migrations
//!
//! Everything lives in one schema of tollgate's own (named by
//! [`PostgresConfig::schema`]; the CLI and the example gateway use
//! `tollgate` unless told otherwise), including its migration table
//! `{schema}.schema_migrations`,
//! which it never shares with the host application. The migrations ship in
//! the crate and [`PostgresStore::migrate`] applies them under a
//! transaction-scoped advisory lock, so instances starting together migrate
//! exactly once. [`PostgresStore::check_schema`] reports a schema that is
//! missing, behind, ahead or modified instead of guessing.
//!
//! # Transactions and locks
//!
//! Each allocator call is one short transaction that row-locks what it
//! changes. Every call takes its locks in one order — lease rows (by id)
//! before account rows (by id) — so calls never deadlock each other on row
//! locks. (Two usage batches that give one request id to events of
//! different leases, which I8 rules out, can wait on each other's inserts
//! of it; `PostgreSQL` then fails one as a deadlock, a storage error its
//! writer retries.) Reclaim
//! skips leases another reclaimer holds (`FOR NO KEY UPDATE SKIP LOCKED`), so any
//! number of processes can reclaim at once (I19). A usage batch is recorded
//! by one statement. Every balance movement is journalled in the transaction
//! that makes it, and [`PostgresStore::audit`] checks the ledger equation
//! (I14), the lease bound (I15) and the journal against the balances.
//!
//! # Time
//!
//! The store reads no clock (I13): every instant comes from the caller.
//! `PostgreSQL` keeps microseconds, so every incoming `now` and event `at` is
//! truncated to the microsecond before use; what the store returns (lease
//! expiries, period ends, event instants) is what it stored. Two usage
//! events that differ only below the microsecond are the same event.
//!
//! # Errors
//!
//! A lost connection, a pool timeout, a serialization failure or a deadlock
//! is a storage error (the call may or may not have taken effect), never a
//! domain refusal. A row that does not map back to the domain (a negative
//! id, an unknown status) is a storage error naming it; the store never
//! panics on what it reads.

mod admin;
mod allocator;
mod audit;
mod convert;
mod ingest;
mod ledger;
mod migrate;
mod snapshots;
mod tx;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{Connection as _, PgPool};
use tx::Turns;

use crate::model::{AccountId, CostUnits, LeaseId};
use crate::store::{GrantPolicy, GrantPolicyError, StoreError};

pub use migrate::{MigrationReport, SchemaStatus};

/// How a [`PostgresStore`] is set up. There is no `Default`: the policy
/// decides how much balance an instance may hold and for how long (I17).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresConfig {
    /// The schema every table lives in, for example `"tollgate"`: a lowercase
    /// identifier matching `^[a-z_][a-z0-9_]{0,62}$`, not starting with
    /// `pg_` (`PostgreSQL` reserves that prefix).
    pub schema: String,
    /// The rules every grant follows.
    pub policy: GrantPolicy,
    /// How long a store call's statement waits for a row lock before the
    /// call fails as a storage error (set on every allocator, usage and
    /// admin transaction, and on a migration's own statements). A call
    /// its caller gave up on goes on waiting (see
    /// [`queue_timeout`](Self::queue_timeout)), holding its connection and
    /// any lock it took already, so keep twice this plus `queue_timeout`
    /// within the shortest timeout the store's callers put on a call (the
    /// runtime's `store_call_timeout`, `ingest_timeout`, `fetch_timeout`
    /// and `enumeration_timeout`). A whole number of milliseconds
    /// (`PostgreSQL` keeps no less), at least one and at most
    /// [`PostgresConfig::LOCK_TIMEOUT_MAX`].
    pub lock_timeout: Duration,
    /// How long an allocator, usage or snapshot call waits for its turn at
    /// one of the pool's connections before failing as a storage error
    /// that made no call at all. A call that got its turn runs to its end
    /// even if its caller gave up on it meanwhile (see
    /// [`PostgresStore`]), so keep `queue_timeout` plus the time a call
    /// takes (a release or a fold waits for two row locks, one after the
    /// other, each bounded by `lock_timeout`) within the shortest timeout
    /// the store's callers put on a call: an answer that comes after its
    /// caller gave up is wasted work (a call that has not committed by
    /// then rolls back). At least a millisecond and at most
    /// [`PostgresConfig::QUEUE_TIMEOUT_MAX`].
    pub queue_timeout: Duration,
}

impl PostgresConfig {
    /// The longest [`lock_timeout`](Self::lock_timeout): a transaction
    /// left idle this long is ended by the server (see
    /// [`PostgresStore::connect`]), and no call should wait longer for a
    /// lock than an abandoned holder keeps it.
    pub const LOCK_TIMEOUT_MAX: Duration = Duration::from_secs(10);

    /// The longest [`queue_timeout`](Self::queue_timeout): a call that
    /// waits longer for a connection has outlived any caller's timeout
    /// that makes sense for the request path's background work.
    pub const QUEUE_TIMEOUT_MAX: Duration = Duration::from_secs(10);
}

/// The `PostgreSQL` store.
///
/// Cheap to clone; clones share the pool and its turns.
///
/// # Turns (I35)
///
/// An allocator, usage or snapshot call first waits for a *turn*: there
/// are as many as the pool has connections, so a call with a turn waits
/// in the pool at most for a connection being handed back, or one the
/// operator's calls (which take no turn) hold. The wait is the caller's and costs the server
/// nothing, so a caller may give up on it at any moment (the runtime cuts
/// every call off at its timeout); one that waits `queue_timeout` without
/// a turn fails having made no call. Once a call has its turn, its
/// database work runs in a task of its own to the end, whether or not its
/// caller is still waiting. Cutting a call off mid-statement or
/// mid-connect would cost the pool that connection, and the server a
/// session process to replace it; with thousands of accounts calling at
/// once after an outage, that churn kept every call timing out and the
/// gateways unready long after the database was back. The allocator's
/// calls may hold all turns but one, which usage batches and snapshot
/// reads (what billing and readiness wait on) can always take. The
/// operator's calls (accounts, keys, movements, the audit, migrations)
/// take no turn.
///
/// # Invariants
///
/// 1. The schema name is a validated identifier, so it can be spliced into
///    SQL text. It is spliced quoted, so a name that is also a keyword
///    (`user`, `order`) means the schema, not the keyword.
/// 2. The policy passed [`GrantPolicy::validate`].
/// 3. Every instant the store writes is truncated to the microsecond first.
/// 4. At most as many calls hold a turn as the pool may open connections.
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    /// One per connection the pool may open (invariant 4).
    turns: Turns,
    /// The longest a call waits for a turn.
    queue_timeout: Duration,
    schema: Arc<str>,
    policy: GrantPolicy,
    /// What opens every transaction: read committed, which the statements
    /// are written for, and the configured lock timeout.
    begin_sql: Arc<str>,
    /// The configured lock timeout, as `PostgreSQL` reads it.
    lock_timeout: Arc<str>,
}

/// The attribution of an operator's balance movement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Movement<'a> {
    /// Makes the movement idempotent: a second movement with the same key
    /// and the same account, kind and amount changes nothing and reports
    /// the first one's outcome (with anything else different it is refused
    /// as a conflict). Non-empty, at most 200 bytes.
    pub idempotency_key: &'a str,
    /// Why the balance moved, for the journal. Non-empty, at most 200 bytes.
    pub reason: &'a str,
}

/// The outcome of an operator's balance movement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BalanceChange {
    /// The balance right after the movement.
    pub balance: CostUnits,
    /// `false` when the idempotency key had been used for this same movement
    /// before: nothing changed, and `balance` is the first outcome.
    pub applied: bool,
}

/// Where the next page of a listing starts
/// ([`PostgresStore::usage_page`], [`PostgresStore::history_page`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCursor(pub(crate) i64);

/// Part of a listing, in its order, and where the rest starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T> {
    /// At most the page size asked for.
    pub items: Vec<T>,
    /// Where the next page starts; `None` once this page ends the listing.
    pub next: Option<PageCursor>,
}

/// One balance movement, as the journal recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalEntry {
    /// The journal's order.
    pub seq: u64,
    /// The account whose balance moved.
    pub account_id: AccountId,
    /// What moved it.
    pub kind: JournalKind,
    /// The change to the balance.
    pub delta: i64,
    /// The balance right after.
    pub balance_after: CostUnits,
    /// The lease granted from or credited back, if any.
    pub lease_id: Option<LeaseId>,
    /// When, by the caller's clock.
    pub at: Timestamp,
    /// The operator's reason, for operator movements.
    pub reason: Option<String>,
    /// The operator's idempotency key, for operator movements.
    pub idempotency_key: Option<String>,
}

/// What moved an account's balance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum JournalKind {
    /// The opening balance.
    Open,
    /// Units granted to a lease (negative).
    Grant,
    /// Units a release credited back.
    Release,
    /// Units a consolidation credited back (its new grant is a `Grant`).
    Consolidation,
    /// Units a TTL reclaim credited back.
    Reclaim,
    /// An operator's top-up.
    TopUp,
    /// A periodic refill's reset of the balance (may be negative).
    Refill,
    /// An operator's adjustment (may be negative).
    Adjustment,
}

impl JournalKind {
    /// Every kind, in declaration order.
    pub const ALL: [Self; 8] = [
        Self::Open,
        Self::Grant,
        Self::Release,
        Self::Consolidation,
        Self::Reclaim,
        Self::TopUp,
        Self::Refill,
        Self::Adjustment,
    ];

    /// A stable lowercase label, as the journal stores it.
    #[must_use]
    pub const fn label(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Grant => "grant",
            Self::Release => "release",
            Self::Consolidation => "consolidation",
            Self::Reclaim => "reclaim",
            Self::TopUp => "top_up",
            Self::Refill => "refill",
            Self::Adjustment => "adjustment",
        }
    }

    /// The kind a label names.
    fn from_label(label: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.label() == label)
    }
}

impl fmt::Display for JournalKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// Why the `PostgreSQL` store could not be set up or migrated.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PostgresError {
    /// The schema name is not a lowercase identifier of at most 63 bytes, or
    /// starts with `pg_`.
    InvalidSchemaName(String),
    /// The grant policy breaks a rule.
    Policy(GrantPolicyError),
    /// `lock_timeout` is not a whole number of milliseconds (`PostgreSQL`
    /// counts no less), is under one, or is longer than
    /// [`PostgresConfig::LOCK_TIMEOUT_MAX`].
    InvalidLockTimeout(Duration),
    /// `queue_timeout` is under a millisecond or longer than
    /// [`PostgresConfig::QUEUE_TIMEOUT_MAX`].
    InvalidQueueTimeout(Duration),
    /// The database could not be reached.
    Connect(StoreError),
    /// A migration could not be applied, or the database disagrees with the
    /// migrations this build ships.
    Migration {
        /// The migration.
        version: u32,
        /// What went wrong.
        message: String,
    },
    /// The database failed mid-call.
    Storage(StoreError),
}

impl fmt::Display for PostgresError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidSchemaName(name) => write!(
                f,
                "invalid schema name {name:?}: expected a lowercase identifier of at most 63 \
                 bytes, not starting with pg_"
            ),
            Self::Policy(error) => write!(f, "{error}"),
            Self::InvalidLockTimeout(timeout) => write!(
                f,
                "lock_timeout must be a whole number of milliseconds, at least 1ms and at most {:?}, not {timeout:?}",
                PostgresConfig::LOCK_TIMEOUT_MAX
            ),
            Self::InvalidQueueTimeout(timeout) => write!(
                f,
                "queue_timeout must be at least 1ms and at most {:?}, not {timeout:?}",
                PostgresConfig::QUEUE_TIMEOUT_MAX
            ),
            Self::Connect(error) => write!(f, "cannot connect to postgres: {error}"),
            Self::Migration { version, message } => write!(f, "migration {version}: {message}"),
            Self::Storage(error) => write!(f, "storage error: {error}"),
        }
    }
}

impl std::error::Error for PostgresError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Policy(error) => Some(error),
            Self::Connect(error) | Self::Storage(error) => Some(error),
            _ => None,
        }
    }
}

impl From<StoreError> for PostgresError {
    fn from(error: StoreError) -> Self {
        Self::Storage(error)
    }
}

/// The most connections [`PostgresStore::connect`] opens.
const POOL_CONNECTIONS_MAX: u32 = 10;
/// The longest a call waits for a pooled connection before failing as a
/// storage error.
const POOL_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long [`PostgresStore::connect`] spends after the pool gave up, on one
/// direct attempt that names why it could not connect.
const CAUSE_TIMEOUT: Duration = Duration::from_secs(1);
/// Server-side bounds on every connection [`PostgresStore::connect`] opens.
///
/// The runtime's calls run to their end on a turn (I35), but an operator's
/// call runs in its caller's future: a caller that gives up on it drops
/// it, and the server does not know. A backend waiting for a row lock
/// would keep waiting (every transaction the store opens bounds that wait
/// by the configured `lock_timeout`), and one left idle inside a
/// transaction would keep its locks, stalling every later call on the
/// same account. The server ends the idle one itself.
/// Neither bound touches a statement that is running rather than waiting,
/// so a long audit is not cut short.
const SERVER_BOUNDS: [(&str, &str); 2] = [
    // A transaction idle this long has been abandoned: the session ends
    // and its locks go with it. `PostgresConfig::LOCK_TIMEOUT_MAX`.
    ("idle_in_transaction_session_timeout", "10s"),
    // The store's statements are written for read committed: one that
    // waited for a row lock goes on with the row as it now stands. Under a
    // database default of repeatable read or serializable, every such wait
    // would fail as a storage error instead, on exactly the busiest
    // accounts. (The space is escaped: startup options split on spaces.)
    ("default_transaction_isolation", "read\\ committed"),
];
/// The longest a schema name may be: `PostgreSQL`'s identifier limit.
const SCHEMA_NAME_LEN_MAX: usize = 63;

impl PostgresStore {
    /// Connects a pool of at most ten connections to `url` (waiting at most
    /// five seconds for a connection, and one more to name the cause when
    /// none came) and builds a store on it. Does not migrate.
    ///
    /// Each connection has the server end a transaction left idle for ten
    /// seconds, so a call its caller gave up on cannot hold an account's
    /// locks for long (and every transaction bounds its lock waits by the
    /// configured `lock_timeout`), and defaults to `read committed`
    /// whatever the server's default is. These two settings win over the
    /// same ones in the URL's `options`; build the pool yourself and use
    /// [`with_pool`](Self::with_pool) to choose them.
    ///
    /// # Errors
    ///
    /// An invalid schema name, policy, lock timeout or queue timeout, or
    /// [`PostgresError::Connect`].
    pub async fn connect(url: &str, config: PostgresConfig) -> Result<Self, PostgresError> {
        validate(&config)?;
        let connect_error =
            |error: sqlx::Error| PostgresError::Connect(StoreError::new(error.to_string()));
        let options = url
            .parse::<PgConnectOptions>()
            .map_err(connect_error)?
            .options(SERVER_BOUNDS);
        let pool = match PgPoolOptions::new()
            .max_connections(POOL_CONNECTIONS_MAX)
            .acquire_timeout(POOL_ACQUIRE_TIMEOUT)
            .connect_with(options.clone())
            .await
        {
            Ok(pool) => pool,
            // The pool retries a refused connection (or a server that is
            // starting up or full) until its acquire timeout and then says
            // only that it timed out: one short direct attempt names the
            // cause for whoever reads the error. (An unknown host or a bad
            // password comes back from the pool as it is.)
            Err(sqlx::Error::PoolTimedOut) => {
                let direct =
                    tokio::time::timeout(CAUSE_TIMEOUT, PgConnection::connect_with(&options)).await;
                let cause = match direct {
                    Ok(Err(error)) => error,
                    _ => sqlx::Error::PoolTimedOut,
                };
                return Err(connect_error(cause));
            }
            Err(error) => return Err(connect_error(error)),
        };
        Self::with_pool(pool, config)
    }

    /// A store over an existing pool. Does not migrate.
    ///
    /// The pool is the caller's, and so are its connections' settings: set
    /// `idle_in_transaction_session_timeout` on it as
    /// [`connect`](Self::connect) does, or an operator's call abandoned on
    /// a timeout can leave its locks held. (The store's own transactions, a
    /// migration's included, set their isolation level and lock timeout
    /// themselves; the audit reads at repeatable read.) The store takes one
    /// turn per connection the pool may open (I35); other users of the
    /// pool make the store's calls wait for connections with their turns.
    ///
    /// # Errors
    ///
    /// [`PostgresError::InvalidSchemaName`], [`PostgresError::Policy`],
    /// [`PostgresError::InvalidLockTimeout`] or
    /// [`PostgresError::InvalidQueueTimeout`].
    pub fn with_pool(pool: PgPool, config: PostgresConfig) -> Result<Self, PostgresError> {
        validate(&config)?;
        let lock_timeout = format!("{}ms", config.lock_timeout.as_millis());
        Ok(Self {
            turns: Turns::new(pool.options().get_max_connections()),
            queue_timeout: config.queue_timeout,
            pool,
            schema: config.schema.into(),
            policy: config.policy,
            begin_sql: format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = '{lock_timeout}'"
            )
            .into(),
            lock_timeout: lock_timeout.into(),
        })
    }

    /// The pool the store uses.
    #[must_use]
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema the store's tables live in.
    #[must_use]
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The grant policy in force.
    #[must_use]
    pub fn policy(&self) -> &GrantPolicy {
        &self.policy
    }

    /// `template` with every `{schema}` replaced by the store's schema name
    /// (a validated identifier, invariant 1), quoted.
    fn sql(&self, template: &str) -> String {
        template.replace("{schema}", &self.quoted_schema())
    }

    /// The schema name as a quoted identifier. Quoting a lowercase name
    /// names the same schema as leaving it bare, so schemas created before
    /// names were quoted are found as they were.
    fn quoted_schema(&self) -> String {
        format!("\"{}\"", self.schema)
    }
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("schema", &self.schema)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

fn validate(config: &PostgresConfig) -> Result<(), PostgresError> {
    if !valid_schema_name(&config.schema) {
        return Err(PostgresError::InvalidSchemaName(config.schema.clone()));
    }
    config.policy.validate().map_err(PostgresError::Policy)?;
    // Refused rather than cut to whole milliseconds as it is set (I17).
    if config.lock_timeout < Duration::from_millis(1)
        || config.lock_timeout > PostgresConfig::LOCK_TIMEOUT_MAX
        || !config.lock_timeout.subsec_nanos().is_multiple_of(1_000_000)
    {
        return Err(PostgresError::InvalidLockTimeout(config.lock_timeout));
    }
    if config.queue_timeout < Duration::from_millis(1)
        || config.queue_timeout > PostgresConfig::QUEUE_TIMEOUT_MAX
    {
        return Err(PostgresError::InvalidQueueTimeout(config.queue_timeout));
    }
    Ok(())
}

/// Whether `name` matches `^[a-z_][a-z0-9_]{0,62}$` and does not start with
/// `pg_`: safe to splice into SQL between double quotes, never folded or
/// truncated by `PostgreSQL`, and not in the prefix it reserves for its own
/// schemas (which it refuses to create).
fn valid_schema_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    let Some(first) = bytes.next() else {
        return false;
    };
    name.len() <= SCHEMA_NAME_LEN_MAX
        && !name.starts_with("pg_")
        && (first.is_ascii_lowercase() || first == b'_')
        && bytes.all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_lowercase_identifiers_are_schema_names() {
        for good in [
            "tollgate",
            "_t",
            "a1_b2",
            "pgtollgate",
            "p_g",
            &"a".repeat(63),
        ] {
            assert!(valid_schema_name(good), "{good}");
        }
        for bad in [
            "",
            "1abc",
            "Tollgate",
            "toll-gate",
            "toll gate",
            "a;drop",
            "\"x\"",
            "é",
            &"a".repeat(64),
            "pg_tollgate",
            "pg_catalog",
            "pg_temp",
        ] {
            assert!(!valid_schema_name(bad), "{bad}");
        }
    }

    #[test]
    fn journal_labels_round_trip() {
        for kind in JournalKind::ALL {
            assert_eq!(JournalKind::from_label(kind.label()), Some(kind));
        }
        assert_eq!(JournalKind::from_label("gift"), None);
    }
}
