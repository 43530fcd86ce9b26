//! Calls and transactions: how a call gets its turn, and how every call
//! opens and ends a transaction.

use std::convert::Infallible;
use std::sync::Arc;

use sqlx::{Postgres, Transaction};
use tokio::sync::oneshot::{self, error::TryRecvError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::store::StoreError;
use crate::store::postgres::PostgresStore;
use crate::store::postgres::convert::storage;

/// The store's turns (I35): one per connection the pool may open. The
/// allocator's calls may hold all but one of them, so usage batches and
/// snapshot reads, which readiness and billing wait on, always find one
/// within a call's time however many accounts renew at once. (A pool of
/// one connection has nothing to spare, and shares it.)
#[derive(Clone)]
pub(super) struct Turns {
    all: Arc<Semaphore>,
    allocator: Option<Arc<Semaphore>>,
}

impl Turns {
    /// The turns of a pool of `connections` connections.
    pub(super) fn new(connections: u32) -> Self {
        let connections = usize::try_from(connections)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        Self {
            all: Arc::new(Semaphore::new(connections)),
            allocator: (connections > 1).then(|| Arc::new(Semaphore::new(connections - 1))),
        }
    }

    /// Waits for a turn for a call of `lane`.
    async fn take(&self, lane: Lane) -> Turn {
        // The allocator's share first, then a connection's turn: calls of
        // the other lane take only the second, so no wait closes a cycle.
        let share = match (&self.allocator, lane) {
            (Some(share), Lane::Allocator) => Arc::clone(share).acquire_owned().await.ok(),
            _ => None,
        };
        let turn = Arc::clone(&self.all).acquire_owned().await.ok();
        Turn {
            _share: share,
            _turn: turn,
        }
    }
}

/// Who a call is for: the lanes share the turns, but the allocator's calls
/// may not take the last one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lane {
    /// Grants, releases, folds and reclaim.
    Allocator,
    /// Usage batches and snapshot reads.
    Priority,
}

/// A call's turn, handed back when dropped. (The semaphores are never
/// closed, so both permits are always there.)
struct Turn {
    _share: Option<OwnedSemaphorePermit>,
    _turn: Option<OwnedSemaphorePermit>,
}

/// Runs `work`, a call's database work for `lane`, on a turn of its own
/// (I35).
///
/// Waiting for the turn is the only part a caller giving up cancels; once
/// it has one, `work` runs in a task of its own to its end, and the turn
/// is handed back when it ends. `work` is told, through its [`Caller`],
/// whether anyone still waits for its answer.
///
/// # Errors
///
/// A storage error when no turn came within the store's `queue_timeout`
/// (no call was made) or the task was cancelled (the runtime is shutting
/// down; the call may have been made); otherwise whatever `work` answers.
pub(super) async fn on_a_turn<T, E, F, W>(
    store: &PostgresStore,
    lane: Lane,
    work: W,
) -> Result<T, E>
where
    T: Send + 'static,
    E: From<StoreError> + Send + 'static,
    F: Future<Output = Result<T, E>> + Send + 'static,
    W: FnOnce(Caller) -> F,
{
    let waited = tokio::time::timeout(store.queue_timeout, store.turns.take(lane));
    let Ok(turn) = waited.await else {
        return Err(E::from(StoreError::not_made(format!(
            "postgres: no connection was free within the queue timeout ({:?}); the call was \
             not made",
            store.queue_timeout
        ))));
    };
    // Held until the answer is read, or dropped with this future when the
    // caller gives up.
    let (_waiting, caller) = oneshot::channel::<Infallible>();
    let work = work(Caller(Some(caller)));
    let task = tokio::spawn(async move {
        let answer = work.await;
        drop(turn);
        answer
    });
    match task.await {
        Ok(answer) => answer,
        Err(ended) => match ended.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(ended) => Err(E::from(StoreError::new(format!(
                "postgres: the call's task ended before answering ({ended}); the call may have \
                 been made"
            )))),
        },
    }
}

/// Whether the caller of a call still waits for its answer.
pub(super) struct Caller(Option<oneshot::Receiver<Infallible>>);

impl Caller {
    /// The caller of a call made in its own future, not on a turn (the
    /// operator's): giving up drops the transaction itself.
    pub(super) fn inline() -> Self {
        Self(None)
    }

    /// Whether the caller has stopped waiting (dropped the call).
    fn gave_up(&mut self) -> bool {
        self.0
            .as_mut()
            .is_some_and(|waiting| matches!(waiting.try_recv(), Err(TryRecvError::Closed)))
    }
}

/// Opens a transaction at read committed, whatever the server's default
/// (the statements are written for it: one that waited for a row lock goes
/// on with the row as it now stands), with the configured lock timeout.
pub(super) async fn begin(store: &PostgresStore) -> Result<Transaction<'_, Postgres>, StoreError> {
    store
        .pool
        .begin_with(store.begin_sql.to_string())
        .await
        .map_err(|error| storage("starting a transaction", &error))
}

/// Ends a transaction with `outcome`. A success or a domain refusal commits
/// (a refusal has changed nothing but, possibly, a due refill, which the
/// memory store keeps too) while the caller still waits for it; a storage
/// error rolls back, and so does anything once the caller has given up:
/// nobody would act on the answer, and a grant nobody holds would keep its
/// units from the balance until reclaim. (A caller that gives up while the
/// commit is on its way may still find it made: its timeout is an unknown
/// outcome, I22.)
pub(super) async fn finish<T, E: From<StoreError>>(
    tx: Transaction<'_, Postgres>,
    outcome: Result<T, E>,
    caller: &mut Caller,
    is_storage: fn(&E) -> bool,
) -> Result<T, E> {
    if outcome.as_ref().is_err_and(is_storage) {
        // Dropping the transaction rolls it back.
        return outcome;
    }
    if caller.gave_up() {
        tx.rollback()
            .await
            .map_err(|error| E::from(storage("rolling back a call given up on", &error)))?;
        return Err(E::from(StoreError::new(
            "postgres: rolled back: the caller stopped waiting before the commit",
        )));
    }
    tx.commit()
        .await
        .map_err(|error| E::from(storage("committing", &error)))?;
    outcome
}
