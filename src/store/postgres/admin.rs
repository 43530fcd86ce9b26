//! The operator's operations on a [`PostgresStore`]: async mirrors of the
//! memory store's, plus idempotent balance movements and the journal.

use jiff::Timestamp;
use sqlx::PgConnection;
use sqlx::postgres::PgRow;

use crate::model::{
    AccountId, AccountStatus, CostUnits, EnforcementMode, FencingToken, KeyId, LeaseId,
    PermissionBits, PolicyRevision, RequestId, UsageEvent, UsageSource,
};
use crate::store::postgres::convert::{
    advisory_key, amount, get, get_at, get_opt_at, id, micros, micros_up, parse_uuid, storage,
    to_i64, to_pg, units,
};
use crate::store::postgres::ledger::{ACCOUNT_COLUMNS, AccountRow, Entry, UNITS_MAX};
use crate::store::postgres::snapshots::{
    key_status, permissions_from, permissions_to, principal_of,
};
use crate::store::postgres::tx::{Caller, begin, finish};
use crate::store::postgres::{
    BalanceChange, JournalEntry, JournalKind, Movement, Page, PageCursor, PostgresStore,
};
use crate::store::rules;
use crate::store::{
    AccountSpec, AccountView, AdminError, ApiKey, IssuedKey, KeyInfo, KeyPrefix, RefillSchedule,
    StoreError,
};

/// The longest idempotency key or reason a movement may carry.
const MOVEMENT_TEXT_LEN_MAX: usize = 200;

fn admin_storage(error: &AdminError) -> bool {
    matches!(error, AdminError::Storage(_))
}

/// The page size of [`PostgresStore::usage`] and [`PostgresStore::history`].
const LISTING_PAGE: usize = 10_000;

/// A page size as `LIMIT` takes it: at least one row, so a listing always
/// moves on.
fn page_limit(limit: usize) -> i64 {
    i64::try_from(limit.max(1)).unwrap_or(i64::MAX)
}

/// The `seq` a page starts after: numbers start at one, so the first page
/// starts after zero. A plain bound, so that each page is a range scan of
/// the account's `(account_id, seq)` index, not a scan from its start.
fn after(from: Option<PageCursor>) -> i64 {
    from.map_or(0, |cursor| cursor.0)
}

/// Where the page after `rows` starts: after the last row's `seq`, unless
/// the page came back short and so ended the listing.
fn next_page(rows: &[PgRow], limit: usize) -> Result<Option<PageCursor>, StoreError> {
    match rows.last() {
        Some(last) if rows.len() >= limit.max(1) => Ok(Some(PageCursor(get(last, "seq")?))),
        _ => Ok(None),
    }
}

fn first_period_end(schedule: RefillSchedule, now: Timestamp) -> Result<Timestamp, AdminError> {
    // PostgreSQL keeps microseconds, so a period must be a whole number of
    // them for its ends to be stored exactly.
    if schedule.interval.subsec_nanos() % 1_000 != 0 {
        return Err(AdminError::InvalidRefill);
    }
    rules::first_period_end(schedule, now)
}

/// A refill schedule as the account row stores it.
#[derive(Debug, Default)]
struct RefillColumns {
    amount: Option<i64>,
    interval_us: Option<i64>,
    period_end: Option<sqlx::types::time::OffsetDateTime>,
}

fn refill_columns(
    refill: Option<(RefillSchedule, Timestamp)>,
) -> Result<RefillColumns, AdminError> {
    let Some((schedule, end)) = refill else {
        return Ok(RefillColumns::default());
    };
    let interval =
        i64::try_from(schedule.interval.as_micros()).map_err(|_| AdminError::InvalidRefill)?;
    Ok(RefillColumns {
        amount: Some(amount(schedule.amount.get(), "refill amount")?),
        interval_us: Some(interval),
        period_end: Some(to_pg(end)?),
    })
}

/// A change to what an account's keys' snapshots show.
#[derive(Debug, Clone, Copy)]
enum AccountChange {
    Status(AccountStatus),
    Mode(EnforcementMode),
}

fn mode_columns(mode: EnforcementMode) -> Result<(&'static str, Option<i64>), AdminError> {
    rules::check_mode(mode)?;
    Ok(match mode.overage_cap() {
        None => ("strict", None),
        // `check_mode` refused a cap no bigint holds.
        Some(cap) => ("elastic", to_i64(cap.get())),
    })
}

fn status_label(status: AccountStatus) -> &'static str {
    match status {
        AccountStatus::Active => "active",
        AccountStatus::Suspended => "suspended",
    }
}

fn check_movement(movement: &Movement<'_>) -> Result<(), AdminError> {
    for (what, text) in [
        ("idempotency key", movement.idempotency_key),
        ("reason", movement.reason),
    ] {
        if text.is_empty() || text.len() > MOVEMENT_TEXT_LEN_MAX {
            return Err(AdminError::Invalid(format!(
                "the {what} must be 1 to {MOVEMENT_TEXT_LEN_MAX} bytes"
            )));
        }
    }
    Ok(())
}

/// Parses a sum `PostgreSQL` computed as numeric text. Each lease is within
/// the ledger's range, but top-ups let an account hold several near its top
/// at once: a sum past `u64::MAX` shows as that, as the memory store's view
/// does, rather than fail the view (and every listing that includes it).
fn sum(row: &PgRow, column: &str) -> Result<u64, StoreError> {
    let text: String = get(row, column)?;
    text.parse::<u128>()
        .map(|sum| u64::try_from(sum).unwrap_or(u64::MAX))
        .map_err(|_| StoreError::new(format!("postgres: {column} {text} is not a unit count")))
}

impl PostgresStore {
    /// Opens an account, journalling its opening balance.
    ///
    /// # Errors
    ///
    /// [`AdminError::InvalidRefill`] for a bad refill schedule (including an
    /// interval that is not a whole number of microseconds),
    /// [`AdminError::BalanceOverflow`] for an opening balance above
    /// `i64::MAX`, [`AdminError::Invalid`] for an overage cap above it.
    pub async fn create_account(
        &self,
        spec: AccountSpec,
        now: Timestamp,
    ) -> Result<AccountId, AdminError> {
        let now = micros(now);
        let refill = match spec.refill {
            Some(schedule) => Some((schedule, first_period_end(schedule, now)?)),
            None => None,
        };
        let balance = to_i64(spec.balance.get()).ok_or(AdminError::BalanceOverflow)?;
        let (mode, cap) = mode_columns(spec.mode)?;
        let refill = refill_columns(refill)?;
        let mut tx = begin(self).await?;
        let sql = self.sql(
            "INSERT INTO {schema}.accounts (status, balance, mode, overage_cap, refill_amount, \
             refill_interval_us, period_end, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING id",
        );
        let account_id: i64 = sqlx::query_scalar(&sql)
            .bind(status_label(spec.status))
            .bind(balance)
            .bind(mode)
            .bind(cap)
            .bind(refill.amount)
            .bind(refill.interval_us)
            .bind(refill.period_end)
            .bind(to_pg(now)?)
            .fetch_one(&mut *tx)
            .await
            .map_err(|error| storage("creating an account", &error))?;
        let account = AccountId(id(account_id, "account id")?);
        self.journal(
            &mut tx,
            Entry {
                account,
                kind: JournalKind::Open,
                delta: balance,
                balance_after: spec.balance.get(),
                lease_id: None,
                at: now,
                reason: None,
                idempotency_key: None,
            },
        )
        .await?;
        tx.commit()
            .await
            .map_err(|error| storage("committing", &error))?;
        Ok(account)
    }

    /// Adds `units` to an account's balance, once per idempotency key. It
    /// takes effect on the next grant.
    ///
    /// # Errors
    ///
    /// [`AdminError::Invalid`] for a bad movement, [`AdminError::UnknownAccount`],
    /// [`AdminError::IdempotencyConflict`] when the key was used for another
    /// movement, or [`AdminError::BalanceOverflow`] (nothing is applied).
    pub async fn top_up(
        &self,
        account: AccountId,
        units: CostUnits,
        movement: &Movement<'_>,
        now: Timestamp,
    ) -> Result<BalanceChange, AdminError> {
        let delta = i128::from(units.get());
        self.move_balance(account, JournalKind::TopUp, delta, movement, now)
            .await
    }

    /// Adds `delta` (which may be negative) to an account's balance, once
    /// per idempotency key.
    ///
    /// # Errors
    ///
    /// As [`top_up`](Self::top_up), and [`AdminError::BalanceUnderflow`] when
    /// the balance would go below zero.
    pub async fn adjust(
        &self,
        account: AccountId,
        delta: i64,
        movement: &Movement<'_>,
        now: Timestamp,
    ) -> Result<BalanceChange, AdminError> {
        self.move_balance(
            account,
            JournalKind::Adjustment,
            i128::from(delta),
            movement,
            now,
        )
        .await
    }

    async fn move_balance(
        &self,
        account: AccountId,
        kind: JournalKind,
        delta: i128,
        movement: &Movement<'_>,
        now: Timestamp,
    ) -> Result<BalanceChange, AdminError> {
        let now = micros(now);
        check_movement(movement)?;
        if to_i64(account.get()).is_none() {
            return Err(AdminError::UnknownAccount);
        }
        let mut tx = begin(self).await?;
        let outcome = self
            .move_balance_in(&mut tx, account, kind, delta, movement, now)
            .await;
        finish(tx, outcome, &mut Caller::inline(), admin_storage).await
    }

    async fn move_balance_in(
        &self,
        conn: &mut PgConnection,
        account: AccountId,
        kind: JournalKind,
        delta: i128,
        movement: &Movement<'_>,
        now: Timestamp,
    ) -> Result<BalanceChange, AdminError> {
        let entry = self
            .lock_account(conn, account, now)
            .await?
            .ok_or(AdminError::UnknownAccount)?;
        // The same key on this account is serialized by the account's row
        // lock, so a replay sees the first movement here.
        let sql = self.sql(
            "SELECT account_id, kind, delta, balance_after FROM {schema}.journal \
             WHERE idempotency_key = $1",
        );
        let seen = sqlx::query(&sql)
            .bind(movement.idempotency_key)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|error| storage("reading an idempotency key", &error))?;
        if let Some(row) = seen {
            let same = get::<i64>(&row, "account_id")? == amount(account.get(), "account id")?
                && get::<String>(&row, "kind")? == kind.label()
                && i128::from(get::<i64>(&row, "delta")?) == delta;
            if !same {
                return Err(AdminError::IdempotencyConflict);
            }
            return Ok(BalanceChange {
                balance: CostUnits(units(get(&row, "balance_after")?, "balance")?),
                applied: false,
            });
        }
        let balance = i128::from(entry.balance) + delta;
        if balance < 0 {
            return Err(AdminError::BalanceUnderflow);
        }
        let balance = u64::try_from(balance)
            .ok()
            .filter(|balance| *balance <= UNITS_MAX)
            .ok_or(AdminError::BalanceOverflow)?;
        let delta = i64::try_from(delta).map_err(|_| AdminError::BalanceOverflow)?;
        // The journal row goes first: if another account's movement took the
        // key meanwhile, nothing has changed yet.
        let sql = self.sql(
            "INSERT INTO {schema}.journal \
             (account_id, kind, delta, balance_after, occurred_at, reason, idempotency_key) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) \
             ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING",
        );
        let inserted = sqlx::query(&sql)
            .bind(amount(account.get(), "account id")?)
            .bind(kind.label())
            .bind(delta)
            .bind(amount(balance, "balance")?)
            .bind(to_pg(now)?)
            .bind(movement.reason)
            .bind(movement.idempotency_key)
            .execute(&mut *conn)
            .await
            .map_err(|error| storage("journalling a movement", &error))?;
        if inserted.rows_affected() == 0 {
            return Err(AdminError::IdempotencyConflict);
        }
        self.set_balance(conn, account, balance).await?;
        Ok(BalanceChange {
            balance: CostUnits(balance),
            applied: true,
        })
    }

    /// Suspends or resumes an account. Its keys' snapshots change with it.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`].
    pub async fn set_status(
        &self,
        account: AccountId,
        status: AccountStatus,
    ) -> Result<(), AdminError> {
        self.change_account(account, AccountChange::Status(status))
            .await
    }

    /// Changes an account's enforcement mode. Its keys' snapshots change
    /// with it.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`], or [`AdminError::Invalid`] for an
    /// overage cap above `i64::MAX`.
    pub async fn set_mode(
        &self,
        account: AccountId,
        mode: EnforcementMode,
    ) -> Result<(), AdminError> {
        mode_columns(mode)?;
        self.change_account(account, AccountChange::Mode(mode))
            .await
    }

    /// Sets columns of an account that its keys' snapshots show, and gives
    /// each of its keys a new revision.
    async fn change_account(
        &self,
        account: AccountId,
        change: AccountChange,
    ) -> Result<(), AdminError> {
        let Some(account_id) = to_i64(account.get()) else {
            return Err(AdminError::UnknownAccount);
        };
        let mut tx = begin(self).await?;
        self.revision_lock(&mut tx).await?;
        // Locked, but no refill is applied: as in the memory store, a
        // status or mode change leaves the balance and its period alone.
        let exists = self.sql("SELECT 1 FROM {schema}.accounts WHERE id = $1 FOR NO KEY UPDATE");
        sqlx::query(&exists)
            .bind(account_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|error| storage("locking an account", &error))?
            .ok_or(AdminError::UnknownAccount)?;
        let status_sql = self.sql("UPDATE {schema}.accounts SET status = $2 WHERE id = $1");
        let mode_sql =
            self.sql("UPDATE {schema}.accounts SET mode = $2, overage_cap = $3 WHERE id = $1");
        let query = match change {
            AccountChange::Status(status) => sqlx::query(&status_sql)
                .bind(account_id)
                .bind(status_label(status)),
            AccountChange::Mode(mode) => {
                let (mode, cap) = mode_columns(mode)?;
                sqlx::query(&mode_sql).bind(account_id).bind(mode).bind(cap)
            }
        };
        query
            .execute(&mut *tx)
            .await
            .map_err(|error| storage("changing an account", &error))?;
        // Each key gets its own revision, in key order, as the memory store
        // numbers them.
        let sql = self.sql(
            "UPDATE {schema}.keys k SET revision = r.revision \
             FROM (SELECT key_id, nextval('{schema}.revisions') AS revision \
                   FROM (SELECT key_id FROM {schema}.keys WHERE account_id = $1 \
                         ORDER BY key_id) ordered) r \
             WHERE k.key_id = r.key_id",
        );
        sqlx::query(&sql)
            .bind(account_id)
            .execute(&mut *tx)
            .await
            .map_err(|error| storage("bumping key revisions", &error))?;
        tx.commit()
            .await
            .map_err(|error| storage("committing", &error))?;
        Ok(())
    }

    /// Takes the transaction-scoped lock every revision change takes first,
    /// so revisions commit in number order and paging by revision never
    /// skips one (I32).
    async fn revision_lock(&self, conn: &mut PgConnection) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(advisory_key("revisions", &self.schema))
            .execute(conn)
            .await
            .map_err(|error| storage("taking the revision lock", &error))?;
        Ok(())
    }

    /// Sets (or with `None`, removes) an account's periodic refill. A new
    /// schedule's first period ends one interval after `now`; a period that
    /// ended under the old schedule is applied first.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`] or [`AdminError::InvalidRefill`].
    pub async fn configure_refill(
        &self,
        account: AccountId,
        refill: Option<RefillSchedule>,
        now: Timestamp,
    ) -> Result<(), AdminError> {
        let now = micros(now);
        let refill = match refill {
            Some(schedule) => Some((schedule, first_period_end(schedule, now)?)),
            None => None,
        };
        let refill = refill_columns(refill)?;
        if to_i64(account.get()).is_none() {
            return Err(AdminError::UnknownAccount);
        }
        let mut tx = begin(self).await?;
        self.lock_account(&mut tx, account, now)
            .await?
            .ok_or(AdminError::UnknownAccount)?;
        let sql = self.sql(
            "UPDATE {schema}.accounts SET refill_amount = $2, refill_interval_us = $3, \
             period_end = $4 WHERE id = $1",
        );
        sqlx::query(&sql)
            .bind(amount(account.get(), "account id")?)
            .bind(refill.amount)
            .bind(refill.interval_us)
            .bind(refill.period_end)
            .execute(&mut *tx)
            .await
            .map_err(|error| storage("configuring a refill", &error))?;
        tx.commit()
            .await
            .map_err(|error| storage("committing", &error))?;
        Ok(())
    }

    /// Issues a key for `account`. The returned plaintext is the only copy;
    /// the store keeps its hash and prefix (I16).
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`] or [`AdminError::Randomness`].
    pub async fn issue_key(
        &self,
        account: AccountId,
        permissions: PermissionBits,
        now: Timestamp,
    ) -> Result<IssuedKey, AdminError> {
        let now = micros(now);
        let key = ApiKey::generate().map_err(|_| AdminError::Randomness)?;
        let Some(account_id) = to_i64(account.get()) else {
            return Err(AdminError::UnknownAccount);
        };
        let mut tx = begin(self).await?;
        self.revision_lock(&mut tx).await?;
        if !self.account_exists(&mut tx, account_id).await? {
            return Err(AdminError::UnknownAccount);
        }
        let sql = self.sql(
            "INSERT INTO {schema}.keys \
             (hash, prefix, account_id, permissions, status, created_at, revision) \
             VALUES ($1, $2, $3, $4, 'active', $5, nextval('{schema}.revisions')) \
             RETURNING key_id",
        );
        let key_id: i64 = sqlx::query_scalar(&sql)
            .bind(key.hash().0.as_slice())
            .bind(key.prefix().as_str())
            .bind(account_id)
            .bind(permissions_to(permissions))
            .bind(to_pg(now)?)
            .fetch_one(&mut *tx)
            .await
            .map_err(|error| storage("issuing a key", &error))?;
        let key_id = KeyId(id(key_id, "key id")?);
        tx.commit()
            .await
            .map_err(|error| storage("committing", &error))?;
        Ok(IssuedKey {
            key,
            key_id,
            principal: principal_of(key_id),
        })
    }

    /// Revokes a key for good. Revoking a revoked key changes nothing.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownKey`].
    pub async fn revoke_key(&self, key_id: KeyId, now: Timestamp) -> Result<(), AdminError> {
        let now = micros(now);
        let Some(key) = to_i64(key_id.get()) else {
            return Err(AdminError::UnknownKey);
        };
        let mut tx = begin(self).await?;
        self.revision_lock(&mut tx).await?;
        let sql = self.sql("SELECT status FROM {schema}.keys WHERE key_id = $1 FOR UPDATE");
        let status: Option<String> = sqlx::query_scalar(&sql)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|error| storage("locking a key", &error))?;
        match status.as_deref() {
            None => return Err(AdminError::UnknownKey),
            Some("active") => {
                let sql = self.sql(
                    "UPDATE {schema}.keys SET status = 'revoked', revoked_at = $2, \
                     revision = nextval('{schema}.revisions') WHERE key_id = $1",
                );
                sqlx::query(&sql)
                    .bind(key)
                    .bind(to_pg(now)?)
                    .execute(&mut *tx)
                    .await
                    .map_err(|error| storage("revoking a key", &error))?;
            }
            Some(_) => {}
        }
        tx.commit()
            .await
            .map_err(|error| storage("committing", &error))?;
        Ok(())
    }

    /// The keys of an account, oldest first.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`].
    pub async fn list_keys(&self, account: AccountId) -> Result<Vec<KeyInfo>, AdminError> {
        let account_id = self.known_account(account).await?;
        let sql = self.sql(
            "SELECT key_id, prefix, account_id, permissions, status, created_at, revoked_at \
             FROM {schema}.keys WHERE account_id = $1 ORDER BY key_id",
        );
        let rows = sqlx::query(&sql)
            .bind(account_id)
            .fetch_all(&self.pool)
            .await
            .map_err(|error| storage("listing keys", &error))?;
        let mut keys = Vec::with_capacity(rows.len());
        for row in &rows {
            let key_id = KeyId(id(get(row, "key_id")?, "key id")?);
            keys.push(KeyInfo {
                key_id,
                principal: principal_of(key_id),
                account_id: AccountId(id(get(row, "account_id")?, "account id")?),
                prefix: KeyPrefix::from_stored(get(row, "prefix")?),
                permissions: permissions_from(get(row, "permissions")?),
                status: key_status(row, "status")?,
                created_at: get_at(row, "created_at")?,
                revoked_at: get_opt_at(row, "revoked_at")?,
            });
        }
        Ok(keys)
    }

    /// An account as of `now`. A refill period that ended by `now` is
    /// applied first, and recorded in the account's history, as any call
    /// that reads the balance does: `now` should come from a clock the
    /// gateways agree with, since an early one refills early.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`].
    pub async fn account(
        &self,
        account: AccountId,
        now: Timestamp,
    ) -> Result<AccountView, AdminError> {
        let Some(account_id) = to_i64(account.get()) else {
            return Err(AdminError::UnknownAccount);
        };
        self.account_views(Some(account_id), now)
            .await?
            .pop()
            .ok_or(AdminError::UnknownAccount)
    }

    /// Every account as of `now`, by id.
    ///
    /// # Errors
    ///
    /// [`AdminError::Storage`].
    pub async fn accounts(&self, now: Timestamp) -> Result<Vec<AccountView>, AdminError> {
        self.account_views(None, now).await
    }

    async fn account_views(
        &self,
        only: Option<i64>,
        now: Timestamp,
    ) -> Result<Vec<AccountView>, AdminError> {
        let now = micros(now);
        self.apply_due_refills(only, now).await?;
        let sql = self.sql(&format!(
            "SELECT {ACCOUNT_COLUMNS}, \
             coalesce((SELECT sum(l.granted) FROM {{schema}}.leases l \
                       WHERE l.account_id = a.id AND l.state = 'active'), 0)::text AS leased, \
             coalesce((SELECT sum(l.granted::numeric - l.credited - l.used) \
                       FROM {{schema}}.leases l \
                       WHERE l.account_id = a.id AND l.state = 'settled'), 0)::text \
                 AS settled_unbilled \
             FROM {{schema}}.accounts a WHERE $1::bigint IS NULL OR a.id = $1 ORDER BY a.id"
        ));
        let rows = sqlx::query(&sql)
            .bind(only)
            .fetch_all(&self.pool)
            .await
            .map_err(|error| storage("reading accounts", &error))?;
        let mut views = Vec::with_capacity(rows.len());
        for row in &rows {
            let mut entry = AccountRow::from_row(row)?;
            entry.apply_refill(now)?;
            views.push(AccountView {
                id: entry.id,
                status: entry.status,
                balance: CostUnits(entry.balance),
                mode: entry.mode,
                refill: entry.refill.map(|(schedule, _)| schedule),
                period_end: entry.period_end(),
                leased: CostUnits(sum(row, "leased")?),
                overage_debt: CostUnits(entry.overage_debt),
                settled_unbilled: CostUnits(sum(row, "settled_unbilled")?),
            });
        }
        Ok(views)
    }

    /// Applies, and journals, every refill period that ended by `now` on
    /// the accounts a view will show: as in the memory store, looking at an
    /// account at or after its period end is when the refill happens, so a
    /// later call with an earlier clock (another instance's) sees it too.
    async fn apply_due_refills(&self, only: Option<i64>, now: Timestamp) -> Result<(), AdminError> {
        let sql = self.sql(
            "SELECT id FROM {schema}.accounts \
             WHERE period_end <= $2 AND ($1::bigint IS NULL OR id = $1) ORDER BY id",
        );
        let due: Vec<i64> = sqlx::query_scalar(&sql)
            .bind(only)
            .bind(to_pg(now)?)
            .fetch_all(&self.pool)
            .await
            .map_err(|error| storage("finding due refills", &error))?;
        if due.is_empty() {
            return Ok(());
        }
        let mut tx = begin(self).await?;
        for account in due {
            let account = AccountId(u64::try_from(account).map_err(|_| {
                StoreError::new(format!("postgres: account id {account} is not positive"))
            })?);
            self.lock_account(&mut tx, account, now).await?;
        }
        tx.commit()
            .await
            .map_err(|error| storage("committing refills", &error))?;
        Ok(())
    }

    /// The usage events recorded for an account, in the order they arrived;
    /// only those at or after `since` and before `until`, when given. All
    /// of them in memory at once: a long-lived account's are better read
    /// a page at a time ([`usage_page`](Self::usage_page)).
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`].
    pub async fn usage(
        &self,
        account: AccountId,
        since: Option<Timestamp>,
        until: Option<Timestamp>,
    ) -> Result<Vec<UsageEvent>, AdminError> {
        let mut events = Vec::new();
        let mut from = None;
        loop {
            let page = self
                .usage_page(account, since, until, from, LISTING_PAGE)
                .await?;
            events.extend(page.items);
            match page.next {
                Some(next) => from = Some(next),
                None => return Ok(events),
            }
        }
    }

    /// At most `limit` of [`usage`](Self::usage)'s events, from `from` (the
    /// previous page's `next`; `None` for the first page). Each page is a
    /// query of its own, using the account's index, so a listing holds no
    /// transaction and at most a page in memory.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`].
    pub async fn usage_page(
        &self,
        account: AccountId,
        since: Option<Timestamp>,
        until: Option<Timestamp>,
        from: Option<PageCursor>,
        limit: usize,
    ) -> Result<Page<UsageEvent>, AdminError> {
        let account_id = self.known_account(account).await?;
        // Rounded up: stored instants are whole microseconds (see
        // `micros_up`).
        let bound = |at: Option<Timestamp>| at.map(|at| to_pg(micros_up(at))).transpose();
        let sql = self.sql(
            "SELECT seq, request_id::text AS request_id, account_id, lease_id, fencing_token, \
             units, occurred_at, policy_revision, key_id FROM {schema}.usage_events \
             WHERE account_id = $1 \
             AND ($2::timestamptz IS NULL OR occurred_at >= $2) \
             AND ($3::timestamptz IS NULL OR occurred_at < $3) \
             AND seq > $4 \
             ORDER BY seq LIMIT $5",
        );
        let rows = sqlx::query(&sql)
            .bind(account_id)
            .bind(bound(since)?)
            .bind(bound(until)?)
            .bind(after(from))
            .bind(page_limit(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(|error| storage("reading usage", &error))?;
        let mut events = Vec::with_capacity(rows.len());
        for row in &rows {
            let source = match (
                get::<Option<i64>>(row, "lease_id")?,
                get::<Option<i64>>(row, "fencing_token")?,
            ) {
                (None, None) => UsageSource::Overage,
                (Some(lease), Some(token)) => UsageSource::Leased {
                    lease_id: LeaseId(id(lease, "lease id")?),
                    fencing_token: FencingToken(id(token, "fencing token")?),
                },
                _ => return Err(StoreError::new("postgres: a usage event is half leased").into()),
            };
            events.push(UsageEvent {
                request_id: RequestId(parse_uuid(&get::<String>(row, "request_id")?)?),
                account_id: AccountId(id(get(row, "account_id")?, "account id")?),
                source,
                units: CostUnits(units(get(row, "units")?, "units")?),
                at: get_at(row, "occurred_at")?,
                policy_revision: PolicyRevision(units(
                    get(row, "policy_revision")?,
                    "policy revision",
                )?),
                key_id: get::<Option<i64>>(row, "key_id")?
                    .map(|key| units(key, "key id").map(KeyId))
                    .transpose()?,
            });
        }
        Ok(Page {
            next: next_page(&rows, limit)?,
            items: events,
        })
    }

    /// Every movement of an account's balance, in order. All of them in
    /// memory at once: a long-lived account's are better read a page at a
    /// time ([`history_page`](Self::history_page)).
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`].
    pub async fn history(&self, account: AccountId) -> Result<Vec<JournalEntry>, AdminError> {
        let mut entries = Vec::new();
        let mut from = None;
        loop {
            let page = self.history_page(account, from, LISTING_PAGE).await?;
            entries.extend(page.items);
            match page.next {
                Some(next) => from = Some(next),
                None => return Ok(entries),
            }
        }
    }

    /// At most `limit` of [`history`](Self::history)'s movements, from
    /// `from` (the previous page's `next`; `None` for the first page), as
    /// [`usage_page`](Self::usage_page) pages usage.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`].
    pub async fn history_page(
        &self,
        account: AccountId,
        from: Option<PageCursor>,
        limit: usize,
    ) -> Result<Page<JournalEntry>, AdminError> {
        let account_id = self.known_account(account).await?;
        let sql = self.sql(
            "SELECT seq, account_id, kind, delta, balance_after, lease_id, occurred_at, reason, \
             idempotency_key FROM {schema}.journal WHERE account_id = $1 \
             AND seq > $2 ORDER BY seq LIMIT $3",
        );
        let rows = sqlx::query(&sql)
            .bind(account_id)
            .bind(after(from))
            .bind(page_limit(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(|error| storage("reading the journal", &error))?;
        let mut entries = Vec::with_capacity(rows.len());
        for row in &rows {
            let label: String = get(row, "kind")?;
            let kind = JournalKind::from_label(&label).ok_or_else(|| {
                StoreError::new(format!("postgres: unknown journal kind {label:?}"))
            })?;
            entries.push(JournalEntry {
                seq: id(get(row, "seq")?, "journal seq")?,
                account_id: AccountId(id(get(row, "account_id")?, "account id")?),
                kind,
                delta: get(row, "delta")?,
                balance_after: CostUnits(units(get(row, "balance_after")?, "balance")?),
                lease_id: get::<Option<i64>>(row, "lease_id")?
                    .map(|lease| id(lease, "lease id").map(LeaseId))
                    .transpose()?,
                at: get_at(row, "occurred_at")?,
                reason: get(row, "reason")?,
                idempotency_key: get(row, "idempotency_key")?,
            });
        }
        Ok(Page {
            next: next_page(&rows, limit)?,
            items: entries,
        })
    }

    /// The account's id as a bigint, when the account exists.
    async fn known_account(&self, account: AccountId) -> Result<i64, AdminError> {
        let Some(account_id) = to_i64(account.get()) else {
            return Err(AdminError::UnknownAccount);
        };
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|error| storage("acquiring a connection", &error))?;
        if self.account_exists(&mut conn, account_id).await? {
            Ok(account_id)
        } else {
            Err(AdminError::UnknownAccount)
        }
    }

    async fn account_exists(
        &self,
        conn: &mut PgConnection,
        account_id: i64,
    ) -> Result<bool, StoreError> {
        let sql = self.sql("SELECT EXISTS (SELECT 1 FROM {schema}.accounts WHERE id = $1)");
        sqlx::query_scalar(&sql)
            .bind(account_id)
            .fetch_one(conn)
            .await
            .map_err(|error| storage("finding an account", &error))
    }
}
