//! The ledger audit of a [`PostgresStore`], in SQL.

use sqlx::postgres::PgRow;

use crate::model::{AccountId, CostUnits, LeaseId};
use crate::store::postgres::PostgresStore;
use crate::store::postgres::convert::{get, id, storage};
use crate::store::{LedgerViolation, StoreError};

/// I14 per account, against the journal too: external movements (opening
/// balance, top-ups, refills, adjustments) on one side, the balance plus
/// what leases hold or kept on the other; and the balance against the sum
/// of every journalled movement.
const ACCOUNTS: &str = "\
    SELECT a.id, a.balance::text AS balance, a.overage_debt::text AS overage_debt, \
      coalesce(j.external, 0)::text AS credited_in, \
      coalesce(j.total, 0)::text AS journal, \
      (a.balance + coalesce(l.held, 0))::text AS accounted_for, \
      coalesce(o.recorded, 0)::text AS overage_recorded \
    FROM {schema}.accounts a \
    LEFT JOIN (SELECT account_id, sum(delta) AS total, \
                 sum(delta) FILTER (WHERE kind IN ('open', 'top_up', 'refill', 'adjustment')) \
                   AS external \
               FROM {schema}.journal GROUP BY account_id) j ON j.account_id = a.id \
    LEFT JOIN (SELECT account_id, \
                 sum(CASE WHEN state = 'active' THEN granted::numeric \
                          ELSE granted::numeric - credited END) AS held \
               FROM {schema}.leases GROUP BY account_id) l ON l.account_id = a.id \
    LEFT JOIN (SELECT account_id, sum(units) AS recorded FROM {schema}.usage_events \
               WHERE lease_id IS NULL GROUP BY account_id) o ON o.account_id = a.id \
    ORDER BY a.id";

/// I15 per lease, and its counter against its recorded events.
const LEASES: &str = "\
    SELECT l.id, l.granted::text AS granted, l.used::text AS used, \
      coalesce(l.credited, 0)::text AS credited, coalesce(e.recorded, 0)::text AS recorded \
    FROM {schema}.leases l \
    LEFT JOIN (SELECT lease_id, sum(units) AS recorded FROM {schema}.usage_events \
               WHERE lease_id IS NOT NULL GROUP BY lease_id) e ON e.lease_id = l.id \
    WHERE l.used::numeric + coalesce(l.credited, 0) > l.granted \
       OR l.used <> coalesce(e.recorded, 0) \
    ORDER BY l.id";

fn number(row: &PgRow, column: &str) -> Result<i128, StoreError> {
    let text: String = get(row, column)?;
    text.parse()
        .map_err(|_| StoreError::new(format!("postgres: audit {column} {text} is not a number")))
}

fn units(row: &PgRow, column: &str) -> Result<CostUnits, StoreError> {
    u64::try_from(number(row, column)?)
        .map(CostUnits)
        .map_err(|_| StoreError::new(format!("postgres: audit {column} is not a unit count")))
}

impl PostgresStore {
    /// Checks the ledger equation for every account (I14), the usage bound
    /// for every lease (I15), every lease's counter and every account's
    /// overage debt against the recorded events, and every balance against
    /// its journal; returns every violation found, empty when the books
    /// balance. Reads one consistent snapshot and changes nothing.
    ///
    /// # Errors
    ///
    /// When the database fails.
    pub async fn audit(&self) -> Result<Vec<LedgerViolation>, StoreError> {
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(|error| storage("starting the audit", &error))?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await
            .map_err(|error| storage("starting the audit", &error))?;
        let leases = sqlx::query(&self.sql(LEASES))
            .fetch_all(&mut *tx)
            .await
            .map_err(|error| storage("auditing leases", &error))?;
        let accounts = sqlx::query(&self.sql(ACCOUNTS))
            .fetch_all(&mut *tx)
            .await
            .map_err(|error| storage("auditing accounts", &error))?;
        tx.commit()
            .await
            .map_err(|error| storage("ending the audit", &error))?;
        let mut violations = Vec::new();
        for row in &leases {
            let lease_id = LeaseId(id(get(row, "id")?, "lease id")?);
            let (granted, used, credited) = (
                units(row, "granted")?,
                units(row, "used")?,
                units(row, "credited")?,
            );
            if u128::from(used.get()) + u128::from(credited.get()) > u128::from(granted.get()) {
                violations.push(LedgerViolation::LeaseOverdrawn {
                    lease_id,
                    granted,
                    used,
                    credited,
                });
            }
            let recorded = units(row, "recorded")?;
            if recorded != used {
                violations.push(LedgerViolation::LeaseUsageMismatch {
                    lease_id,
                    counter: used,
                    recorded,
                });
            }
        }
        for row in &accounts {
            let account_id = AccountId(id(get(row, "id")?, "account id")?);
            let balance = units(row, "balance")?;
            let journal = number(row, "journal")?;
            if journal != i128::from(balance.get()) {
                violations.push(LedgerViolation::JournalMismatch {
                    account_id,
                    balance,
                    journal,
                });
            }
            let credited_in = number(row, "credited_in")?;
            let accounted_for = number(row, "accounted_for")?;
            if credited_in != accounted_for {
                violations.push(LedgerViolation::AccountImbalance {
                    account_id,
                    credited_in,
                    accounted_for,
                });
            }
            let (debt, recorded) = (units(row, "overage_debt")?, units(row, "overage_recorded")?);
            if debt != recorded {
                violations.push(LedgerViolation::OverageDebtMismatch {
                    account_id,
                    debt,
                    recorded,
                });
            }
        }
        Ok(violations)
    }
}
