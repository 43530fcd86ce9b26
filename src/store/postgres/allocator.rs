//! [`LeaseAllocator`] for [`PostgresStore`]: each call one short transaction.
//!
//! Lock order, everywhere in the store (I31): lease rows (by id) before
//! account rows (by id). Acquire locks only its account; release and consolidate
//! lock the lease, then its account; reclaim locks its leases (oldest expiry
//! first, skipping any another transaction holds, so it never waits on one),
//! then their accounts in id order. Rows are locked `FOR NO KEY UPDATE`: writers of the
//! same row still exclude each other, while the foreign-key checks of
//! concurrent inserts (which take `KEY SHARE`) are not blocked by them.

use async_trait::async_trait;
use jiff::{SignedDuration, Timestamp};
use sqlx::PgConnection;
use sqlx::postgres::PgRow;

use crate::model::{AccountId, CostUnits, FencingToken, LeaseGrant, LeaseId};
use crate::store::postgres::JournalKind;
use crate::store::postgres::PostgresStore;
use crate::store::postgres::convert::{amount, get, id, micros, storage, to_i64, to_pg, units};
use crate::store::postgres::ledger::Entry;
use crate::store::postgres::tx::{Lane, begin, finish, on_a_turn};
use crate::store::rules::{UNITS_MAX, credited_balance, plan_acquire, plan_consolidation};
use crate::store::{
    AllocateError, Allocation, BlockedLease, LeaseAllocator, ReclaimBatch, ReclaimedLease,
    Released, StoreError,
};

/// A lease row, locked by the caller.
#[derive(Debug, Clone, Copy)]
struct LeaseRow {
    id: LeaseId,
    account_id: AccountId,
    fencing_token: FencingToken,
    granted: u64,
    used: u64,
    settled: bool,
}

const LEASE_COLUMNS: &str = "id, account_id, fencing_token, granted, used, state";

impl LeaseRow {
    fn from_row(row: &PgRow) -> Result<Self, StoreError> {
        let lease_id = LeaseId(id(get(row, "id")?, "lease id")?);
        let settled = match get::<String>(row, "state")?.as_str() {
            "active" => false,
            "settled" => true,
            other => {
                return Err(StoreError::new(format!(
                    "postgres: {lease_id} has unknown state {other:?}"
                )));
            }
        };
        Ok(Self {
            id: lease_id,
            account_id: AccountId(id(get(row, "account_id")?, "account id")?),
            fencing_token: FencingToken(id(get(row, "fencing_token")?, "fencing token")?),
            granted: units(get(row, "granted")?, "granted")?,
            used: units(get(row, "used")?, "used")?,
            settled,
        })
    }
}

fn allocate_storage(error: &AllocateError) -> bool {
    matches!(error, AllocateError::Storage(_))
}

impl PostgresStore {
    /// When a lease granted at `now` for a requested `ttl` expires: the ttl
    /// clamped to the policy's maximum, refused if under a microsecond or past the
    /// end of time, truncated to what `PostgreSQL` stores.
    fn expiry(&self, ttl: SignedDuration, now: Timestamp) -> Result<Timestamp, AllocateError> {
        let ttl = self
            .policy
            .lease_ttl(ttl)
            .ok_or(AllocateError::InvalidTtl)?;
        now.checked_add(ttl)
            .map(micros)
            .map_err(|_| AllocateError::InvalidTtl)
    }

    async fn lock_lease(
        &self,
        conn: &mut PgConnection,
        lease_id: LeaseId,
    ) -> Result<Option<LeaseRow>, StoreError> {
        let Some(lease) = to_i64(lease_id.get()) else {
            return Ok(None);
        };
        let sql = self.sql(&format!(
            "SELECT {LEASE_COLUMNS} FROM {{schema}}.leases WHERE id = $1 FOR NO KEY UPDATE"
        ));
        sqlx::query(&sql)
            .bind(lease)
            .fetch_optional(conn)
            .await
            .map_err(|error| storage("locking a lease", &error))?
            .as_ref()
            .map(LeaseRow::from_row)
            .transpose()
    }

    /// Locks a lease and checks a release or consolidation claim against
    /// it, in the memory store's order. Nothing is changed.
    async fn settleable(
        &self,
        conn: &mut PgConnection,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
    ) -> Result<LeaseRow, AllocateError> {
        let lease = self
            .lock_lease(conn, lease_id)
            .await?
            .ok_or(AllocateError::UnknownLease)?;
        if lease.fencing_token != fencing_token {
            return Err(AllocateError::Fenced);
        }
        if lease.settled {
            return Err(AllocateError::LeaseNotActive);
        }
        // I15: the lease cannot hold more than its grant less what was
        // billed against it.
        if unspent.get() > lease.granted.saturating_sub(lease.used) {
            return Err(AllocateError::InvalidRelease);
        }
        Ok(lease)
    }

    /// Inserts a new active lease and journals its grant. The caller has
    /// already taken `units` off the balance, leaving `left`.
    async fn open_lease(
        &self,
        conn: &mut PgConnection,
        account: AccountId,
        units_granted: u64,
        left: u64,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<LeaseGrant, StoreError> {
        let sql = self.sql(
            "INSERT INTO {schema}.leases (account_id, granted, granted_at, expires_at) \
             VALUES ($1, $2, $3, $4) RETURNING id, fencing_token",
        );
        let row = sqlx::query(&sql)
            .bind(amount(account.get(), "account id")?)
            .bind(amount(units_granted, "grant")?)
            .bind(to_pg(now)?)
            .bind(to_pg(expires_at)?)
            .fetch_one(&mut *conn)
            .await
            .map_err(|error| storage("inserting a lease", &error))?;
        let lease_id = LeaseId(id(get(&row, "id")?, "lease id")?);
        let fencing_token = FencingToken(id(get(&row, "fencing_token")?, "fencing token")?);
        self.journal(
            conn,
            Entry {
                account,
                kind: JournalKind::Grant,
                delta: -amount(units_granted, "grant")?,
                balance_after: left,
                lease_id: Some(lease_id),
                at: now,
                reason: None,
                idempotency_key: None,
            },
        )
        .await?;
        Ok(LeaseGrant {
            lease_id,
            account_id: account,
            fencing_token,
            units: CostUnits(units_granted),
            expires_at,
        })
    }

    /// Marks a lease settled with `credited` units returned, and journals
    /// the credit. The caller has already credited the balance, leaving
    /// `balance_after`. A lease leaves the active state once (I15).
    async fn settle(
        &self,
        conn: &mut PgConnection,
        lease: &LeaseRow,
        credited: u64,
        balance_after: u64,
        kind: JournalKind,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let sql = self.sql(
            "UPDATE {schema}.leases SET state = 'settled', credited = $2, settled_at = $3 \
             WHERE id = $1 AND state = 'active'",
        );
        let settled = sqlx::query(&sql)
            .bind(amount(lease.id.get(), "lease id")?)
            .bind(amount(credited, "credit")?)
            .bind(to_pg(now)?)
            .execute(&mut *conn)
            .await
            .map_err(|error| storage("settling a lease", &error))?;
        if settled.rows_affected() != 1 {
            return Err(StoreError::new(format!(
                "postgres: {} was not active when settled",
                lease.id
            )));
        }
        self.journal(
            conn,
            Entry {
                account: lease.account_id,
                kind,
                delta: amount(credited, "credit")?,
                balance_after,
                lease_id: Some(lease.id),
                at: now,
                reason: None,
                idempotency_key: None,
            },
        )
        .await
    }

    async fn acquire_in(
        &self,
        conn: &mut PgConnection,
        account: AccountId,
        requested: CostUnits,
        needed: CostUnits,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        let entry = self
            .lock_account(conn, account, now)
            .await?
            .ok_or(AllocateError::UnknownAccount)?;
        let planned = plan_acquire(
            &self.policy,
            entry.status,
            entry.balance,
            entry.refill,
            requested,
            needed,
        )?;
        self.set_balance(conn, account, planned.left).await?;
        let grant = self
            .open_lease(conn, account, planned.size, planned.left, expires_at, now)
            .await?;
        Ok(Allocation {
            grant,
            funding: planned.funding,
        })
    }

    async fn release_in(
        &self,
        conn: &mut PgConnection,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        now: Timestamp,
    ) -> Result<Released, AllocateError> {
        let lease = self
            .settleable(conn, lease_id, fencing_token, unspent)
            .await?;
        let entry = self
            .lock_account(conn, lease.account_id, now)
            .await?
            .ok_or(AllocateError::UnknownAccount)?;
        let balance = credited_balance(entry.balance, unspent.get())?;
        self.set_balance(conn, entry.id, balance).await?;
        self.settle(
            conn,
            &lease,
            unspent.get(),
            balance,
            JournalKind::Release,
            now,
        )
        .await?;
        Ok(Released { credited: unspent })
    }

    #[allow(clippy::too_many_arguments)]
    async fn consolidate_in(
        &self,
        conn: &mut PgConnection,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        requested: CostUnits,
        needed: CostUnits,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        let lease = self
            .settleable(conn, lease_id, fencing_token, unspent)
            .await?;
        let entry = self
            .lock_account(conn, lease.account_id, now)
            .await?
            .ok_or(AllocateError::UnknownAccount)?;
        let planned = plan_consolidation(
            &self.policy,
            entry.status,
            entry.balance,
            entry.refill,
            unspent,
            requested,
            needed,
        )?;
        // The balance once the old lease's unspent units are credited, as
        // the journal records the consolidation's credit.
        let available = planned.left + planned.size;
        // I18: everything is checked; settle the old lease and grant the new
        // one in this one transaction.
        let (size, left) = (planned.size, planned.left);
        self.set_balance(conn, entry.id, left).await?;
        self.settle(
            conn,
            &lease,
            unspent.get(),
            available,
            JournalKind::Consolidation,
            now,
        )
        .await?;
        let grant = self
            .open_lease(conn, entry.id, size, left, expires_at, now)
            .await?;
        Ok(Allocation {
            grant,
            funding: planned.funding,
        })
    }

    async fn reclaim_in(
        &self,
        conn: &mut PgConnection,
        cutoff: Timestamp,
        limit: usize,
        now: Timestamp,
    ) -> Result<ReclaimBatch, StoreError> {
        // I19: due once `expires_at + reclaim_grace <= now`. Leases another
        // reclaimer holds are skipped (I31), so concurrent reclaimers split
        // the work and settle each lease once. A lease whose remainder its
        // account's balance has no room for is left out here, so it cannot
        // hold up the leases behind it, and reported below.
        let fetch = i64::try_from(limit.saturating_add(1)).unwrap_or(i64::MAX);
        let sql = self.sql(&format!(
            "SELECT {LEASE_COLUMNS} FROM {{schema}}.leases l \
             WHERE state = 'active' AND expires_at <= $1 AND {ROOM_FOR_REMAINDER} \
             ORDER BY expires_at, id LIMIT $2 FOR NO KEY UPDATE SKIP LOCKED"
        ));
        let rows = sqlx::query(&sql)
            .bind(to_pg(cutoff)?)
            .bind(fetch)
            .bind(amount(UNITS_MAX, "the ledger's range")?)
            .bind(to_pg(now)?)
            .fetch_all(&mut *conn)
            .await
            .map_err(|error| storage("selecting due leases", &error))?;
        let extra = rows.len() > limit;
        let due = rows
            .iter()
            .take(limit)
            .map(LeaseRow::from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let mut accounts: Vec<AccountId> = due.iter().map(|lease| lease.account_id).collect();
        accounts.sort_unstable();
        accounts.dedup();
        // Accounts after leases, in id order: the store's one lock order (I31).
        let mut balances = Vec::with_capacity(accounts.len());
        for account in accounts {
            let entry = self
                .lock_account(conn, account, now)
                .await?
                .ok_or_else(|| {
                    StoreError::new(format!(
                        "postgres: a lease names {account}, which is missing"
                    ))
                })?;
            balances.push((account, entry.balance));
        }
        let mut batch = ReclaimBatch {
            reclaimed: Vec::with_capacity(due.len()),
            more: false,
            blocked: Vec::new(),
        };
        for lease in &due {
            let remainder = lease.granted.saturating_sub(lease.used);
            let slot = balances
                .iter_mut()
                .find(|(account, _)| *account == lease.account_id)
                .ok_or_else(|| {
                    StoreError::new("postgres: a reclaimed lease's account was not locked")
                })?;
            // The filter above read the balance before the lock, and two
            // leases of one account can each fit alone: checked again here.
            // A lease that no longer fits is reported with the others below.
            let Ok(balance) = credited_balance(slot.1, remainder) else {
                continue;
            };
            slot.1 = balance;
            self.set_balance(conn, lease.account_id, balance).await?;
            self.settle(conn, lease, remainder, balance, JournalKind::Reclaim, now)
                .await?;
            batch.reclaimed.push(ReclaimedLease {
                lease_id: lease.id,
                account_id: lease.account_id,
                credited: CostUnits(remainder),
            });
        }
        // More is claimed only after a full batch: a selected lease that
        // turned out blocked ends the pass, and the next one goes on.
        batch.more = extra && batch.reclaimed.len() == due.len();
        // Named by the call that ends a pass, when what is still due is
        // what could not be settled: the query filters rather than seeks,
        // so it reads every due lease.
        if !batch.more {
            batch.blocked = self.blocked_in(conn, cutoff, limit, now).await?;
        }
        Ok(batch)
    }

    /// The first `limit` due leases, oldest expiry first, whose account's
    /// balance (after this transaction's credits, and after any refill due
    /// by `now`) has no room for their remainder. Read without locks: a
    /// report, not a settlement.
    async fn blocked_in(
        &self,
        conn: &mut PgConnection,
        cutoff: Timestamp,
        limit: usize,
        now: Timestamp,
    ) -> Result<Vec<BlockedLease>, StoreError> {
        let sql = self.sql(&format!(
            "SELECT id, account_id, granted - used AS remainder FROM {{schema}}.leases l \
             WHERE state = 'active' AND expires_at <= $1 AND NOT {ROOM_FOR_REMAINDER} \
             ORDER BY expires_at, id LIMIT $2"
        ));
        let rows = sqlx::query(&sql)
            .bind(to_pg(cutoff)?)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(amount(UNITS_MAX, "the ledger's range")?)
            .bind(to_pg(now)?)
            .fetch_all(&mut *conn)
            .await
            .map_err(|error| storage("selecting blocked leases", &error))?;
        rows.iter()
            .map(|row| {
                Ok(BlockedLease {
                    lease_id: LeaseId(id(get(row, "id")?, "lease id")?),
                    account_id: AccountId(id(get(row, "account_id")?, "account id")?),
                    remainder: CostUnits(units(get(row, "remainder")?, "remainder")?),
                })
            })
            .collect()
    }
}

/// Whether the balance of lease `l`'s account has room for the lease's
/// remainder below the ledger's range (`$3`). The balance is the one the
/// account has at `$4`: a refill period that has ended resets it to the
/// refill amount, as locking the account would (I14).
const ROOM_FOR_REMAINDER: &str = "(granted - used <= $3 - \
     (SELECT CASE WHEN a.period_end <= $4 THEN a.refill_amount ELSE a.balance END \
      FROM {schema}.accounts a WHERE a.id = l.account_id))";

#[async_trait]
impl LeaseAllocator for PostgresStore {
    fn shares_tails(&self) -> bool {
        self.policy.tail.instances > 1
    }

    async fn acquire_at_least(
        &self,
        account: AccountId,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        let now = micros(now);
        let expires_at = self.expiry(ttl, now)?;
        if requested.max(needed).is_zero() {
            return Err(AllocateError::InvalidRequest);
        }
        if to_i64(account.get()).is_none() {
            return Err(AllocateError::UnknownAccount);
        }
        let store = self.clone();
        on_a_turn(self, Lane::Allocator, |mut caller| async move {
            let mut tx = begin(&store).await?;
            let outcome = store
                .acquire_in(&mut tx, account, requested, needed, expires_at, now)
                .await;
            finish(tx, outcome, &mut caller, allocate_storage).await
        })
        .await
    }

    async fn release(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        now: Timestamp,
    ) -> Result<Released, AllocateError> {
        let now = micros(now);
        if to_i64(lease_id.get()).is_none() {
            return Err(AllocateError::UnknownLease);
        }
        let store = self.clone();
        on_a_turn(self, Lane::Allocator, |mut caller| async move {
            let mut tx = begin(&store).await?;
            let outcome = store
                .release_in(&mut tx, lease_id, fencing_token, unspent, now)
                .await;
            finish(tx, outcome, &mut caller, allocate_storage).await
        })
        .await
    }

    async fn consolidate(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        let now = micros(now);
        let expires_at = self.expiry(ttl, now)?;
        if requested.max(needed).is_zero() {
            return Err(AllocateError::InvalidRequest);
        }
        if to_i64(lease_id.get()).is_none() {
            return Err(AllocateError::UnknownLease);
        }
        let store = self.clone();
        on_a_turn(self, Lane::Allocator, |mut caller| async move {
            let mut tx = begin(&store).await?;
            let outcome = store
                .consolidate_in(
                    &mut tx,
                    lease_id,
                    fencing_token,
                    unspent,
                    requested,
                    needed,
                    expires_at,
                    now,
                )
                .await;
            finish(tx, outcome, &mut caller, allocate_storage).await
        })
        .await
    }

    async fn reclaim_expired_batch(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> Result<ReclaimBatch, StoreError> {
        let now = micros(now);
        let Ok(cutoff) = now.checked_sub(self.policy.reclaim_grace) else {
            return Ok(ReclaimBatch::default());
        };
        let store = self.clone();
        on_a_turn(self, Lane::Allocator, |mut caller| async move {
            let mut tx = begin(&store).await?;
            let outcome = store.reclaim_in(&mut tx, cutoff, limit, now).await;
            // Every error here is a storage error: roll back.
            finish(tx, outcome, &mut caller, |_| true).await
        })
        .await
    }
}
