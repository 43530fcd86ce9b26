//! Transactions: how every call opens and ends one.

use sqlx::{Postgres, Transaction};

use crate::store::StoreError;
use crate::store::postgres::PostgresStore;
use crate::store::postgres::convert::storage;

/// Opens a transaction at read committed, whatever the server's default
/// (the statements are written for it: one that waited for a row lock goes
/// on with the row as it now stands), with the configured lock timeout.
pub(super) async fn begin(store: &PostgresStore) -> Result<Transaction<'_, Postgres>, StoreError> {
    store
        .pool
        .begin_with(store.begin_sql.clone())
        .await
        .map_err(|error| storage("starting a transaction", &error))
}

/// Ends a transaction with `outcome`. A success or a domain refusal commits
/// (a refusal has changed nothing but, possibly, a due refill, which the
/// memory store keeps too); a storage error rolls back.
pub(super) async fn finish<T, E: From<StoreError>>(
    tx: Transaction<'_, Postgres>,
    outcome: Result<T, E>,
    is_storage: fn(&E) -> bool,
) -> Result<T, E> {
    if outcome.as_ref().is_err_and(is_storage) {
        // Dropping the transaction rolls it back.
        return outcome;
    }
    tx.commit()
        .await
        .map_err(|error| E::from(storage("committing", &error)))?;
    outcome
}
