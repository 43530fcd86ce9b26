//! The books every call shares: account rows (with their lazy refills), the
//! balance, and the journal.

use jiff::{SignedDuration, Timestamp};
use sqlx::PgConnection;
use sqlx::postgres::PgRow;

use crate::model::{AccountId, AccountStatus, CostUnits, EnforcementMode, LeaseId};
use crate::store::postgres::convert::{amount, get, get_opt_at, id, storage, to_i64, to_pg, units};
use crate::store::postgres::{JournalKind, PostgresStore};
use crate::store::rules::next_period_end;
use crate::store::{RefillSchedule, StoreError};

pub(super) use crate::store::rules::UNITS_MAX;

/// The columns [`AccountRow::from_row`] reads.
pub(super) const ACCOUNT_COLUMNS: &str = "id, status, balance, mode, overage_cap, refill_amount, \
     refill_interval_us, period_end, overage_debt";

/// One account, as read (and possibly refilled) inside a transaction.
#[derive(Debug, Clone, Copy)]
pub(super) struct AccountRow {
    pub(super) id: AccountId,
    pub(super) status: AccountStatus,
    pub(super) balance: u64,
    pub(super) mode: EnforcementMode,
    pub(super) refill: Option<(RefillSchedule, Timestamp)>,
    pub(super) overage_debt: u64,
}

/// A movement to journal.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry<'a> {
    pub(super) account: AccountId,
    pub(super) kind: JournalKind,
    pub(super) delta: i64,
    pub(super) balance_after: u64,
    pub(super) lease_id: Option<LeaseId>,
    pub(super) at: Timestamp,
    pub(super) reason: Option<&'a str>,
    pub(super) idempotency_key: Option<&'a str>,
}

impl AccountRow {
    pub(super) fn from_row(row: &PgRow) -> Result<Self, StoreError> {
        let account = AccountId(id(get(row, "id")?, "account id")?);
        let status = match get::<String>(row, "status")?.as_str() {
            "active" => AccountStatus::Active,
            "suspended" => AccountStatus::Suspended,
            other => {
                return Err(StoreError::new(format!(
                    "postgres: {account} has unknown status {other:?}"
                )));
            }
        };
        let cap = get::<Option<i64>>(row, "overage_cap")?;
        let mode = match (get::<String>(row, "mode")?.as_str(), cap) {
            ("strict", None) => EnforcementMode::Strict,
            ("elastic", Some(cap)) => EnforcementMode::Elastic {
                overage_cap: CostUnits(units(cap, "overage cap")?),
            },
            (other, _) => {
                return Err(StoreError::new(format!(
                    "postgres: {account} has an unknown mode {other:?}"
                )));
            }
        };
        let refill = match (
            get::<Option<i64>>(row, "refill_amount")?,
            get::<Option<i64>>(row, "refill_interval_us")?,
            get_opt_at(row, "period_end")?,
        ) {
            (None, None, None) => None,
            (Some(refill_amount), Some(interval), Some(end)) if interval > 0 => Some((
                RefillSchedule {
                    amount: CostUnits(units(refill_amount, "refill amount")?),
                    interval: SignedDuration::from_micros(interval),
                },
                end,
            )),
            _ => {
                return Err(StoreError::new(format!(
                    "postgres: {account} has an incomplete refill schedule"
                )));
            }
        };
        Ok(Self {
            id: account,
            status,
            balance: units(get(row, "balance")?, "balance")?,
            mode,
            refill,
            overage_debt: units(get(row, "overage_debt")?, "overage debt")?,
        })
    }

    pub(super) fn period_end(&self) -> Option<Timestamp> {
        self.refill.map(|(_, end)| end)
    }

    /// Applies every refill period that ended at or before `now`, exactly as
    /// the memory store does: the balance is reset to the refill amount and
    /// several missed periods collapse into one reset (I14: the difference is
    /// a net refill). Returns the change to the balance when a reset
    /// happened.
    pub(super) fn apply_refill(&mut self, now: Timestamp) -> Result<Option<i64>, StoreError> {
        let Some((schedule, end)) = self.refill else {
            return Ok(None);
        };
        let Some(next_end) = next_period_end(schedule, end, now)? else {
            return Ok(None);
        };
        // Both are at most UNITS_MAX, so the difference fits.
        let delta =
            amount(schedule.amount.get(), "refill amount")? - amount(self.balance, "balance")?;
        self.balance = schedule.amount.get();
        self.refill = Some((schedule, next_end));
        Ok(Some(delta))
    }
}

impl PostgresStore {
    /// Locks an account's row (`None` when there is no such account) and
    /// applies, and journals, any refill period that ended by `now`.
    pub(super) async fn lock_account(
        &self,
        conn: &mut PgConnection,
        account: AccountId,
        now: Timestamp,
    ) -> Result<Option<AccountRow>, StoreError> {
        let Some(account_id) = to_i64(account.get()) else {
            return Ok(None);
        };
        let sql = self.sql(&format!(
            "SELECT {ACCOUNT_COLUMNS} FROM {{schema}}.accounts WHERE id = $1 FOR NO KEY UPDATE"
        ));
        let Some(row) = sqlx::query(&sql)
            .bind(account_id)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|error| storage("locking an account", &error))?
        else {
            return Ok(None);
        };
        let mut entry = AccountRow::from_row(&row)?;
        if let Some(delta) = entry.apply_refill(now)? {
            let sql = self
                .sql("UPDATE {schema}.accounts SET balance = $2, period_end = $3 WHERE id = $1");
            sqlx::query(&sql)
                .bind(account_id)
                .bind(amount(entry.balance, "balance")?)
                .bind(entry.period_end().map(to_pg).transpose()?)
                .execute(&mut *conn)
                .await
                .map_err(|error| storage("refilling an account", &error))?;
            self.journal(
                conn,
                Entry {
                    account,
                    kind: JournalKind::Refill,
                    delta,
                    balance_after: entry.balance,
                    lease_id: None,
                    at: now,
                    reason: None,
                    idempotency_key: None,
                },
            )
            .await?;
        }
        Ok(Some(entry))
    }

    /// Sets an account's balance, which the caller holds locked.
    pub(super) async fn set_balance(
        &self,
        conn: &mut PgConnection,
        account: AccountId,
        balance: u64,
    ) -> Result<(), StoreError> {
        let sql = self.sql("UPDATE {schema}.accounts SET balance = $2 WHERE id = $1");
        sqlx::query(&sql)
            .bind(amount(account.get(), "account id")?)
            .bind(amount(balance, "balance")?)
            .execute(conn)
            .await
            .map_err(|error| storage("updating a balance", &error))?;
        Ok(())
    }

    /// Journals one balance movement, in the caller's transaction, so the
    /// balance is always the sum of the journal's deltas (I30).
    pub(super) async fn journal(
        &self,
        conn: &mut PgConnection,
        entry: Entry<'_>,
    ) -> Result<(), StoreError> {
        let sql = self.sql(
            "INSERT INTO {schema}.journal \
             (account_id, kind, delta, balance_after, lease_id, occurred_at, reason, idempotency_key) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        );
        sqlx::query(&sql)
            .bind(amount(entry.account.get(), "account id")?)
            .bind(entry.kind.label())
            .bind(entry.delta)
            .bind(amount(entry.balance_after, "balance")?)
            .bind(
                entry
                    .lease_id
                    .map(|lease| amount(lease.get(), "lease id"))
                    .transpose()?,
            )
            .bind(to_pg(entry.at)?)
            .bind(entry.reason)
            .bind(entry.idempotency_key)
            .execute(conn)
            .await
            .map_err(|error| storage("journalling a movement", &error))?;
        Ok(())
    }
}
