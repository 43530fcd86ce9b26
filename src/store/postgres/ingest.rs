//! [`UsageSink`] for [`PostgresStore`]: one statement per batch.
//!
//! The batch goes to the `ingest_usage` function the migration creates, as
//! one array per field; it locks the leases the batch names (by id), then
//! the accounts its overage events name (by id), and judges the events in
//! order with the memory store's rules. Fields `PostgreSQL` cannot hold are
//! settled here first, by mapping them to values no stored row has, so the
//! function gives the answer the memory store would, with two documented
//! exceptions: a value the memory store can hold but a column cannot (see
//! [`RejectReason::Malformed`]) is malformed here, and instants are kept to
//! the microsecond, so two events under one request id whose instants
//! differ by less than one are duplicates here and conflicting in memory.

use async_trait::async_trait;
use jiff::Timestamp;
use sqlx::postgres::PgRow;
use sqlx::types::time::OffsetDateTime;

use crate::model::UsageEvent;
use crate::store::postgres::PostgresStore;
use crate::store::postgres::convert::{get, micros, storage, to_i64, to_pg, uuid_text};
use crate::store::postgres::tx::{Lane, begin, finish, on_a_turn};
use crate::store::{IngestOutcome, RejectReason, StoreError, UsageSink};

/// Stands for an id or token no bigint can hold: ids, tokens and accounts
/// are positive, so no stored row has it, and the function answers as the
/// memory store would for an id it does not know.
const UNREPRESENTABLE_ID: i64 = -1;
/// Marks an event whose units, key id, policy revision or instant
/// `PostgreSQL` cannot hold: the function answers `malformed` unless the
/// request id was seen.
const UNREPRESENTABLE_UNITS: i64 = -1;

/// `PostgreSQL`'s earliest `timestamptz`, 4714-11-24 BC, in seconds since
/// the epoch. An earlier instant fails the whole statement, and a batch
/// that always fails would hold up every event behind it; it is answered
/// `malformed` instead, and sent as this instant.
const EARLIEST_SECOND: i64 = -210_866_803_200;

/// The batch as columns, ready to bind.
#[derive(Debug, Default)]
struct Columns {
    request_ids: Vec<String>,
    account_ids: Vec<i64>,
    lease_ids: Vec<Option<i64>>,
    fencing_tokens: Vec<Option<i64>>,
    units: Vec<i64>,
    ats: Vec<OffsetDateTime>,
    revisions: Vec<i64>,
    key_ids: Vec<Option<i64>>,
}

impl Columns {
    fn of(batch: &[UsageEvent]) -> Result<Self, StoreError> {
        let earliest = Timestamp::from_second(EARLIEST_SECOND).map_err(|_| {
            StoreError::new("postgres: the earliest instant is out of jiff's range")
        })?;
        let mut columns = Self::default();
        for event in batch {
            let id = |value: u64| to_i64(value).unwrap_or(UNREPRESENTABLE_ID);
            let revision = to_i64(event.policy_revision.get());
            let key_id = event.key_id.map(|key| to_i64(key.get()));
            // The whole instant, not its seconds, which round toward zero
            // and would pass one up to a second before the earliest.
            let storable_at = event.at >= earliest;
            let representable = revision.is_some() && !matches!(key_id, Some(None)) && storable_at;
            let units = to_i64(event.units.get())
                .filter(|_| representable)
                .unwrap_or(UNREPRESENTABLE_UNITS);
            columns.request_ids.push(uuid_text(event.request_id.get()));
            columns.account_ids.push(id(event.account_id.get()));
            columns
                .lease_ids
                .push(event.source.lease_id().map(|lease| id(lease.get())));
            columns
                .fencing_tokens
                .push(event.source.fencing_token().map(|token| id(token.get())));
            columns.units.push(units);
            let at = if storable_at {
                micros(event.at)
            } else {
                earliest
            };
            columns.ats.push(to_pg(at)?);
            columns.revisions.push(revision.unwrap_or(0));
            columns.key_ids.push(key_id.map(|key| key.unwrap_or(0)));
        }
        Ok(columns)
    }
}

fn outcome(label: &str) -> Result<IngestOutcome, StoreError> {
    Ok(match label {
        "accepted" => IngestOutcome::Accepted,
        "duplicate" => IngestOutcome::Duplicate,
        "unknown_lease" => IngestOutcome::Rejected(RejectReason::UnknownLease),
        "fencing_mismatch" => IngestOutcome::Rejected(RejectReason::FencingMismatch),
        "lease_settled" => IngestOutcome::Rejected(RejectReason::LeaseSettled),
        "exceeds_lease" => IngestOutcome::Rejected(RejectReason::ExceedsLease),
        "unknown_account" => IngestOutcome::Rejected(RejectReason::UnknownAccount),
        "account_mismatch" => IngestOutcome::Rejected(RejectReason::AccountMismatch),
        "conflicting_duplicate" => IngestOutcome::Rejected(RejectReason::ConflictingDuplicate),
        "malformed" => IngestOutcome::Rejected(RejectReason::Malformed),
        other => {
            return Err(StoreError::new(format!(
                "postgres: ingest answered an unknown outcome {other:?}"
            )));
        }
    })
}

#[async_trait]
impl UsageSink for PostgresStore {
    async fn ingest(&self, batch: &[UsageEvent]) -> Result<Vec<IngestOutcome>, StoreError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let columns = Columns::of(batch)?;
        let sql = self.sql(
            "SELECT ord, outcome FROM {schema}.ingest_usage(\
             $1::text[]::uuid[], $2, $3, $4, $5, $6, $7, $8) ORDER BY ord",
        );
        // In a transaction of the store's own, like every other call: read
        // committed, and lock waits bounded by the configured timeout. An
        // answer that does not add up rolls the batch back.
        let len = batch.len();
        let store = self.clone();
        on_a_turn(self, Lane::Priority, |mut caller| async move {
            let mut tx = begin(&store).await?;
            let answer = async {
                let rows = sqlx::query(&sql)
                    .bind(&columns.request_ids)
                    .bind(&columns.account_ids)
                    .bind(&columns.lease_ids)
                    .bind(&columns.fencing_tokens)
                    .bind(&columns.units)
                    .bind(&columns.ats)
                    .bind(&columns.revisions)
                    .bind(&columns.key_ids)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(|error| storage("ingesting usage", &error))?;
                outcomes(&rows, len)
            }
            .await;
            finish(tx, answer, &mut caller, |_| true).await
        })
        .await
    }
}

/// The outcomes `rows` answer for a batch of `len` events, one per event in
/// order, or why they do not.
fn outcomes(rows: &[PgRow], len: usize) -> Result<Vec<IngestOutcome>, StoreError> {
    if rows.len() != len {
        return Err(StoreError::new(format!(
            "postgres: ingest answered {} outcomes for {len} events",
            rows.len()
        )));
    }
    let mut outcomes = Vec::with_capacity(len);
    for (position, row) in rows.iter().enumerate() {
        let ord: i32 = get(row, "ord")?;
        if usize::try_from(ord).ok() != Some(position) {
            return Err(StoreError::new(format!(
                "postgres: ingest answered event {ord} in place {position}"
            )));
        }
        outcomes.push(outcome(&get::<String>(row, "outcome")?)?);
    }
    Ok(outcomes)
}
