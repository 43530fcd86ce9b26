//! [`SnapshotSource`] for [`PostgresStore`]: principals' snapshots, read as
//! the memory store builds them.

use std::collections::HashMap;

use async_trait::async_trait;
use jiff::Timestamp;
use sqlx::postgres::PgRow;

use crate::model::{
    AccountId, AccountStatus, CostUnits, EnforcementMode, KeyHash, KeyId, KeyStatus,
    PermissionBits, PolicyRevision, Principal, PrincipalSnapshot,
};
use crate::store::postgres::PostgresStore;
use crate::store::postgres::convert::{get, id, storage, to_i64, units};
use crate::store::postgres::tx::{Lane, on_a_turn};
use crate::store::{SnapshotCursor, SnapshotPage, SnapshotSource, StoreError};

/// The join every snapshot query reads: a key and its account.
const SNAPSHOT_SELECT: &str = "SELECT k.key_id, k.hash, k.permissions, k.status AS key_status, \
     k.revision, k.account_id, a.status AS account_status, a.mode, a.overage_cap \
     FROM {schema}.keys k JOIN {schema}.accounts a ON a.id = k.account_id";

/// Every key is its own principal, numbered like the key.
pub(super) fn principal_of(key_id: KeyId) -> Principal {
    Principal(key_id.get())
}

/// A stored permission set: the 64 bits as a signed bigint.
pub(super) fn permissions_from(stored: i64) -> PermissionBits {
    PermissionBits(u64::from_ne_bytes(stored.to_ne_bytes()))
}

/// A permission set as stored.
pub(super) fn permissions_to(bits: PermissionBits) -> i64 {
    i64::from_ne_bytes(bits.0.to_ne_bytes())
}

pub(super) fn key_status(row: &PgRow, column: &str) -> Result<KeyStatus, StoreError> {
    match get::<String>(row, column)?.as_str() {
        "active" => Ok(KeyStatus::Active),
        "revoked" => Ok(KeyStatus::Revoked),
        other => Err(StoreError::new(format!(
            "postgres: a key has unknown status {other:?}"
        ))),
    }
}

fn snapshot(row: &PgRow, now: Timestamp) -> Result<PrincipalSnapshot, StoreError> {
    let key_id = KeyId(id(get(row, "key_id")?, "key id")?);
    let hash: Vec<u8> = get(row, "hash")?;
    let hash: [u8; 32] = hash
        .try_into()
        .map_err(|_| StoreError::new(format!("postgres: {key_id} has a hash of the wrong size")))?;
    let account_status = match get::<String>(row, "account_status")?.as_str() {
        "active" => AccountStatus::Active,
        "suspended" => AccountStatus::Suspended,
        other => {
            return Err(StoreError::new(format!(
                "postgres: an account has unknown status {other:?}"
            )));
        }
    };
    let mode = match (
        get::<String>(row, "mode")?.as_str(),
        get::<Option<i64>>(row, "overage_cap")?,
    ) {
        ("strict", None) => EnforcementMode::Strict,
        ("elastic", Some(cap)) => EnforcementMode::Elastic {
            overage_cap: CostUnits(units(cap, "overage cap")?),
        },
        (other, _) => {
            return Err(StoreError::new(format!(
                "postgres: an account has unknown mode {other:?}"
            )));
        }
    };
    Ok(PrincipalSnapshot {
        principal: principal_of(key_id),
        account_id: AccountId(id(get(row, "account_id")?, "account id")?),
        key_id: Some(key_id),
        key_hash: Some(KeyHash(hash)),
        permissions: permissions_from(get(row, "permissions")?),
        key_status: key_status(row, "key_status")?,
        account_status,
        mode,
        policy_revision: PolicyRevision(id(get(row, "revision")?, "revision")?),
        fetched_at: now,
    })
}

#[async_trait]
impl SnapshotSource for PostgresStore {
    async fn fetch(
        &self,
        principals: &[Principal],
        now: Timestamp,
    ) -> Result<Vec<PrincipalSnapshot>, StoreError> {
        let ids: Vec<i64> = principals
            .iter()
            .filter_map(|principal| to_i64(principal.get()))
            .collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let sql = self.sql(&format!("{SNAPSHOT_SELECT} WHERE k.key_id = ANY($1)"));
        let pool = self.pool.clone();
        let rows = on_a_turn(self, Lane::Priority, |_| async move {
            sqlx::query(&sql)
                .bind(&ids)
                .fetch_all(&pool)
                .await
                .map_err(|error| storage("fetching snapshots", &error))
        })
        .await?;
        let mut found = HashMap::with_capacity(rows.len());
        for row in &rows {
            let snapshot = snapshot(row, now)?;
            found.insert(snapshot.principal, snapshot);
        }
        // In the order asked, unknown principals left out, as the memory
        // store answers.
        Ok(principals
            .iter()
            .filter_map(|principal| found.get(principal).copied())
            .collect())
    }

    async fn changed_since(
        &self,
        since: SnapshotCursor,
        limit: usize,
        now: Timestamp,
    ) -> Result<SnapshotPage, StoreError> {
        let Some(cursor) = to_i64(since.0) else {
            // No stored revision is past the largest bigint.
            return Ok(SnapshotPage {
                snapshots: Vec::new(),
                next: since,
                complete: true,
            });
        };
        // Revisions commit in number order (every writer takes the revision
        // lock first), so a page read now never skips one committed later.
        let fetch = i64::try_from(limit.saturating_add(1)).unwrap_or(i64::MAX);
        let sql = self.sql(&format!(
            "{SNAPSHOT_SELECT} WHERE k.revision > $1 ORDER BY k.revision LIMIT $2"
        ));
        let pool = self.pool.clone();
        let rows = on_a_turn(self, Lane::Priority, |_| async move {
            sqlx::query(&sql)
                .bind(cursor)
                .bind(fetch)
                .fetch_all(&pool)
                .await
                .map_err(|error| storage("enumerating changed snapshots", &error))
        })
        .await?;
        let complete = rows.len() <= limit;
        let snapshots = rows
            .iter()
            .take(limit)
            .map(|row| snapshot(row, now))
            .collect::<Result<Vec<_>, _>>()?;
        let next = snapshots
            .last()
            .map_or(since, |last| SnapshotCursor(last.policy_revision.get()));
        Ok(SnapshotPage {
            snapshots,
            next,
            complete,
        })
    }

    async fn lookup_key(
        &self,
        hash: &KeyHash,
        now: Timestamp,
    ) -> Result<Option<PrincipalSnapshot>, StoreError> {
        let sql = self.sql(&format!(
            "{SNAPSHOT_SELECT} WHERE k.hash = $1 AND k.status = 'active'"
        ));
        let pool = self.pool.clone();
        let hash = hash.0;
        on_a_turn(self, Lane::Priority, |_| async move {
            sqlx::query(&sql)
                .bind(hash.as_slice())
                .fetch_optional(&pool)
                .await
                .map_err(|error| storage("looking up a key", &error))
        })
        .await?
        .as_ref()
        .map(|row| snapshot(row, now))
        .transpose()
    }
}
