//! The reclaimer: the background task that settles leases their holders
//! never came back for.
//!
//! An instance that crashes (or loses its store connection past a lease's
//! expiry) leaves its leases active in the store. Once a lease is past
//! `expires_at + reclaim_grace`, the allocator may settle it, crediting its
//! remainder net of accepted usage back to the balance (I19). The reclaimer
//! asks it to, every `interval`, in batches of at most `batch_limit`; while a
//! batch says more leases are due it asks again at once, yielding between
//! batches, rather than waiting another interval. The first pass runs as soon
//! as the task starts, so a restarted instance settles its predecessor's
//! leases promptly.
//!
//! The store settles each lease once however many reclaimers ask (I19), so
//! it is safe to run one on every instance, or in a separate process.
//!
//! Every call is bounded by `store_call_timeout` (I22). An error, a timeout
//! or a panic in the store client ends the pass, is counted and logged, and
//! the next pass comes at the next interval: the reclaimer never gives up.
//! A store settles a batch in one transaction whose length grows with the
//! batch, so a batch too large to
//! settle within the timeout would time out on every pass and nothing would
//! ever be reclaimed: after a settling call times out the reclaimer halves
//! the batches it asks for (a probe's timeout, below, says nothing of the
//! batch), and grows them back by an eighth (at least one lease) after
//! every batch that settles in time, up to `batch_limit`. Every lease a call
//! reports settled is logged at info level with its units, because a reclaim
//! is the crash exposure of the ledger being settled (units a dead instance
//! may have spent and never billed), which must be reported, never silent.
//! A call cut off by the timeout or a stop may still commit on the store's
//! side, so what it settled is never reported to this process: its warning
//! says so, and the store's journal (`reclaim` entries) is the full record.
//!
//! After a store outage every instance's usage writer has a backlog to
//! deliver, naming leases that may have come due meanwhile; settled first,
//! such a lease would take its holder's usage as settled and refuse it, and
//! those served units would go back to the balance unbilled (I15). So once
//! a call fails, times out or panics, the reclaimer settles nothing until
//! the store has answered again for `outage_hold`; meanwhile its calls ask
//! as of the Unix epoch, which settles nothing granted since (and reports
//! anything it does settle like any pass) and only finds out whether
//! the store answers. A reclaimer started after an outage (or a one-off
//! `tollgate reclaim`) knows nothing of it: start it `outage_hold` after
//! the store is back.
//!
//! [`Reclaimer::shutdown`] stops the task at once, abandoning a call in
//! flight (store calls are cancellable); a call whose answer is already in
//! is reported first. Dropping the [`Reclaimer`] instead
//! aborts the task and logs it.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{MissedTickBehavior, interval, timeout};
use tokio_util::task::AbortOnDropHandle;

use super::bump;

use super::TIMER_RESOLUTION;
use crate::model::LeaseId;
use crate::store::{Clock, LeaseAllocator, ReclaimBatch};

/// How often and how much the reclaimer settles.
///
/// There is no `Default` (I17): these values decide when stranded units come
/// back, so the caller states every one, and [`validate`](Self::validate)
/// checks them before the task starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimerConfig {
    /// The time between the starts of two passes. At least one millisecond,
    /// the timer's resolution.
    ///
    /// The reclaimer learns of a store outage only through its own calls,
    /// so this must be shorter than the allocator's reclaim grace plus the
    /// leases' expiry safety margin, less the usage writers' delivery time
    /// (flush interval, retry backoff and three ingest timeouts): usage can
    /// be left undelivered when its lease comes due only by an outage that
    /// long, which then spans a call and starts the outage hold. Longer,
    /// an outage between two calls goes unseen, and a lease it left with
    /// undelivered usage is settled as soon as the store answers.
    pub interval: Duration,
    /// The most leases one call settles. Must be positive. After a settling
    /// call (not an outage probe) times out, calls ask for half as many,
    /// growing back by an eighth per
    /// batch settled up to this, so a batch too long to settle within
    /// `store_call_timeout` does not stall reclaim for good.
    pub batch_limit: usize,
    /// The bound on every reclaim call (I22). At least one millisecond, the
    /// timer's resolution.
    pub store_call_timeout: Duration,
    /// How long after a failed, cut-off or panicked call the store must
    /// answer again before anything is settled (see the module docs).
    /// Longer than the usage writers take to deliver what queued up during
    /// an outage: an [`InstanceRuntime`](crate::runtime::InstanceRuntime)
    /// refuses one no longer than its writer's delivery time for one batch.
    /// At least one millisecond, the timer's resolution.
    pub outage_hold: Duration,
}

/// The first rule a [`ReclaimerConfig`] breaks, in field order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReclaimerConfigError {
    /// `interval` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    IntervalBelowTimerResolution,
    /// `batch_limit` is zero.
    BatchLimitZero,
    /// `store_call_timeout` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    StoreCallTimeoutBelowTimerResolution,
    /// `outage_hold` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    OutageHoldBelowTimerResolution,
}

impl ReclaimerConfig {
    /// Checks every rule, in field order.
    ///
    /// # Errors
    ///
    /// The first rule broken.
    pub fn validate(&self) -> Result<(), ReclaimerConfigError> {
        use ReclaimerConfigError as Broken;
        let rules = [
            (
                self.interval >= TIMER_RESOLUTION,
                Broken::IntervalBelowTimerResolution,
            ),
            (self.batch_limit > 0, Broken::BatchLimitZero),
            (
                self.store_call_timeout >= TIMER_RESOLUTION,
                Broken::StoreCallTimeoutBelowTimerResolution,
            ),
            (
                self.outage_hold >= TIMER_RESOLUTION,
                Broken::OutageHoldBelowTimerResolution,
            ),
        ];
        rules
            .into_iter()
            .find_map(|(holds, broken)| (!holds).then_some(broken))
            .map_or(Ok(()), Err)
    }
}

impl fmt::Display for ReclaimerConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::IntervalBelowTimerResolution => {
                "reclaimer: interval must be at least one millisecond \
                 (the timer's resolution)"
            }
            Self::BatchLimitZero => "reclaimer: batch_limit must be positive",
            Self::StoreCallTimeoutBelowTimerResolution => {
                "reclaimer: store_call_timeout must be at least one millisecond \
                 (the timer's resolution)"
            }
            Self::OutageHoldBelowTimerResolution => {
                "reclaimer: outage_hold must be at least one millisecond \
                 (the timer's resolution)"
            }
        })
    }
}

impl std::error::Error for ReclaimerConfigError {}

/// What the reclaimer has done so far.
///
/// Every pass ends exactly one way: counted in `passes` (the store said
/// nothing more is due), in `held` (a probe during an outage hold), in
/// `errors`, in `timeouts`, or cut short by shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReclaimStats {
    /// Passes that ran until the store said nothing more was due.
    pub passes: u64,
    /// Leases settled by reclaim.
    pub reclaimed_leases: u64,
    /// Units those settlements credited back to balances.
    pub reclaimed_units: u64,
    /// Passes ended by a storage error (or a store that said more leases
    /// were due but settled none).
    pub errors: u64,
    /// Passes ended by a call cut off by `store_call_timeout` (I22).
    pub timeouts: u64,
    /// Due leases the last completed pass found blocked because their
    /// account's balance has no room for their remainder
    /// ([`BlockedLease`](crate::store::BlockedLease)): a level, not a
    /// count, and at most `batch_limit`. They are retried on every pass and
    /// logged once a pass.
    pub blocked_leases: u64,
    /// Passes that asked as of the Unix epoch, settling nothing granted
    /// since on purpose, only finding out whether the
    /// store answers, while an outage hold lasted (see the module docs).
    pub held: u64,
}

/// The owner's handle on the reclaimer task.
///
/// Call [`shutdown`](Self::shutdown) to stop it; dropping the handle instead
/// aborts the task and logs it.
pub struct Reclaimer {
    counters: Arc<Counters>,
    stop: watch::Sender<bool>,
    /// `None` only once `shutdown` or `drop` has taken it.
    task: Option<JoinHandle<()>>,
}

impl Reclaimer {
    /// Validates `config` and starts the reclaimer on the current tokio
    /// runtime. The first pass starts at once.
    ///
    /// # Errors
    ///
    /// The first rule `config` breaks; nothing is started then.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn spawn(
        allocator: Arc<dyn LeaseAllocator>,
        clock: Arc<dyn Clock>,
        config: ReclaimerConfig,
    ) -> Result<Self, ReclaimerConfigError> {
        config.validate()?;
        let counters = Arc::new(Counters::default());
        let (stop, stop_rx) = watch::channel(false);
        let task = Task {
            allocator,
            clock,
            config,
            batch: config.batch_limit,
            held: None,
            counters: Arc::clone(&counters),
            stop: stop_rx,
        };
        Ok(Self {
            counters,
            stop,
            task: Some(tokio::spawn(task.run())),
        })
    }

    /// The counters as they stand now.
    pub fn stats(&self) -> ReclaimStats {
        self.counters.read()
    }

    /// A view of the counters that outlives this handle, for a report read
    /// while the handle's owner awaits [`shutdown`](Self::shutdown).
    pub(crate) fn view(&self) -> ReclaimView {
        ReclaimView(Arc::clone(&self.counters))
    }

    /// Stops the reclaimer, abandoning any call in flight, and reports what
    /// it did.
    ///
    /// # Panics
    ///
    /// Never in practice: the task handle is present until this method or
    /// `drop` consumes the reclaimer.
    pub async fn shutdown(mut self) -> ReclaimStats {
        self.stop.send_replace(true);
        let task = self.task.take().expect(
            "the task handle is taken only by shutdown or drop, which consume the reclaimer",
        );
        if let Err(error) = task.await {
            tracing::error!(%error, "reclaimer: the task died before it was stopped");
        }
        self.stats()
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        if !task.is_finished() {
            task.abort();
            tracing::warn!(
                stats = ?self.stats(),
                "reclaimer: handle dropped without shutdown; the task is aborted"
            );
        }
    }
}

impl fmt::Debug for Reclaimer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reclaimer")
            .field("stats", &self.stats())
            .field(
                "running",
                &self.task.as_ref().is_some_and(|t| !t.is_finished()),
            )
            .finish_non_exhaustive()
    }
}

/// A reclaimer's counters, read while it stops (see [`Reclaimer::view`]).
pub(crate) struct ReclaimView(Arc<Counters>);

impl ReclaimView {
    /// The counters as they stand now.
    pub(crate) fn stats(&self) -> ReclaimStats {
        self.0.read()
    }
}

/// The task's counters; plain `Relaxed` atomics, since nothing else in
/// memory is ordered by them.
#[derive(Default)]
struct Counters {
    passes: AtomicU64,
    reclaimed_leases: AtomicU64,
    reclaimed_units: AtomicU64,
    errors: AtomicU64,
    timeouts: AtomicU64,
    blocked_leases: AtomicU64,
    held: AtomicU64,
}

impl Counters {
    fn read(&self) -> ReclaimStats {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        ReclaimStats {
            passes: read(&self.passes),
            reclaimed_leases: read(&self.reclaimed_leases),
            reclaimed_units: read(&self.reclaimed_units),
            errors: read(&self.errors),
            timeouts: read(&self.timeouts),
            blocked_leases: read(&self.blocked_leases),
            held: read(&self.held),
        }
    }
}

/// The task was told to stop (or its handle is gone).
struct Stopped;

/// The reclaimer settling nothing after a failed call.
#[derive(Clone, Copy)]
struct Hold {
    /// When the hold ends: `outage_hold` after the first call the store
    /// answered since the last failure; `None` until it answers.
    until: Option<tokio::time::Instant>,
}

/// What the reclaimer should do after one batch.
enum Next {
    /// More leases are due: ask again at once.
    Continue,
    /// The pass is over, one way or another.
    Done,
}

struct Task {
    allocator: Arc<dyn LeaseAllocator>,
    clock: Arc<dyn Clock>,
    config: ReclaimerConfig,
    /// The batch the next call asks for: `batch_limit`, less after
    /// timeouts.
    batch: usize,
    /// Set by a failed call: settle nothing that came due after it.
    held: Option<Hold>,
    counters: Arc<Counters>,
    stop: watch::Receiver<bool>,
}

impl Task {
    async fn run(mut self) {
        // The first tick completes at once; a pass that overruns delays the
        // next rather than bunching passes up.
        let mut ticks = interval(self.config.interval);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            if until_stopped(&mut self.stop, ticks.tick()).await.is_err()
                || self.pass().await.is_err()
            {
                tracing::debug!("reclaimer: stopped");
                return;
            }
        }
    }

    /// The time the next call settles leases at: the clock's, or, while a
    /// hold lasts, the Unix epoch. No lease granted since comes due that
    /// early, so such a call settles nothing and writes nothing (no journal
    /// entry, no refill applied at an old time): it only finds out whether
    /// the store answers.
    fn reclaim_time(&mut self) -> jiff::Timestamp {
        match self.held {
            Some(Hold { until: Some(until) }) if tokio::time::Instant::now() >= until => {
                self.held = None;
                tracing::info!(
                    "reclaimer: the store has answered for the outage hold; settling what is due"
                );
                self.clock.now()
            }
            Some(_) => jiff::Timestamp::UNIX_EPOCH,
            None => self.clock.now(),
        }
    }

    /// A call failed, timed out or panicked: settle nothing until the store
    /// has answered again for `outage_hold`.
    fn hold_after_failure(&mut self) {
        if self.held.is_none() {
            tracing::warn!(
                hold = ?self.config.outage_hold,
                "reclaimer: settling nothing until the store has answered for the outage \
                 hold, so usage queued meanwhile is delivered first"
            );
        }
        self.held = Some(Hold { until: None });
    }

    /// The store answered: a hold's time starts now, if it has not yet.
    fn answered(&mut self) {
        if let Some(hold) = &mut self.held
            && hold.until.is_none()
        {
            hold.until = Some(crate::runtime::after(
                tokio::time::Instant::now(),
                self.config.outage_hold,
            ));
        }
    }

    /// Settles batches until the store says nothing more is due, or a call
    /// fails.
    async fn pass(&mut self) -> Result<(), Stopped> {
        // Every batch names the blocked leases again; each is logged once a
        // pass.
        let mut named = HashSet::new();
        loop {
            // A stop that came with the last answer: no call after it.
            if *self.stop.borrow() {
                return Err(Stopped);
            }
            let now = self.reclaim_time();
            // A held call only finds out whether the store answers.
            let probe = self.held.is_some();
            let limit = self.config.store_call_timeout;
            // I22: the call is bounded; a stop abandons it (store calls are
            // cancellable, and the store settles each lease once, I19).
            // The call runs as a task of its own, aborted if it is cut off
            // or the reclaimer stops: a store client that panics then fails
            // one pass, not the reclaimer for the rest of the process.
            let allocator = Arc::clone(&self.allocator);
            let batch = self.batch;
            let call = AbortOnDropHandle::new(tokio::spawn(async move {
                allocator.reclaim_expired_batch(now, batch).await
            }));
            let answer = tokio::select! {
                biased;
                // An answer already in is taken even with a stop beside it,
                // so what it settled is reported.
                answer = timeout(limit, call) => answer,
                _ = self.stop.wait_for(|stopping| *stopping) => {
                    tracing::info!(
                        "reclaimer: stopped with a reclaim call in flight; it may still settle \
                         leases, which only the store's journal (reclaim entries) will show"
                    );
                    return Err(Stopped);
                }
            };
            let next = match answer {
                Ok(Err(panicked)) => {
                    bump(&self.counters.errors, 1);
                    self.hold_after_failure();
                    tracing::error!(
                        error = %panicked,
                        "reclaimer: the store call panicked; trying again next interval"
                    );
                    Next::Done
                }
                Ok(Ok(Ok(batch))) if probe => {
                    // It settles nothing (a lease due as early as the epoch
                    // would be reported all the same), so it says nothing of
                    // whether a batch this size fits the timeout, nor of
                    // blocked leases: the batch and the blocked count stand.
                    self.answered();
                    bump(&self.counters.held, 1);
                    self.report_reclaimed(&batch);
                    Next::Done
                }
                Ok(Ok(Ok(batch))) => {
                    self.answered();
                    self.batch = self
                        .batch
                        .saturating_add((self.batch / 8).max(1))
                        .min(self.config.batch_limit);
                    self.settle(&batch, &mut named)
                }
                Ok(Ok(Err(error))) => {
                    bump(&self.counters.errors, 1);
                    self.hold_after_failure();
                    tracing::warn!(%error, "reclaimer: the store failed; trying again next interval");
                    Next::Done
                }
                Err(_) => {
                    bump(&self.counters.timeouts, 1);
                    self.hold_after_failure();
                    // The store may be slow for other reasons, but a batch
                    // too long for one call would otherwise never settle.
                    // A probe settles nothing, so its timeout says nothing
                    // of the batch.
                    if !probe {
                        self.batch = (self.batch / 2).max(1);
                    }
                    tracing::warn!(
                        timeout = ?limit,
                        next_batch = self.batch,
                        "reclaimer: the store timed out; the call cut off may still settle \
                         leases, which only the store's journal (reclaim entries) will show; \
                         trying again next interval with a smaller batch"
                    );
                    Next::Done
                }
            };
            match next {
                Next::Continue => tokio::task::yield_now().await,
                Next::Done => return Ok(()),
            }
        }
    }

    /// Logs and counts every lease `batch` says was settled: the crash
    /// exposure of the ledger being settled, reported, never silent.
    fn report_reclaimed(&self, batch: &ReclaimBatch) {
        for lease in &batch.reclaimed {
            // The crash exposure is reported here, as the most it can be:
            // the store cannot tell the units the holder never spent from
            // those of charges it committed and never delivered, so both are
            // credited back, and the latter go unbilled.
            tracing::warn!(
                lease_id = %lease.lease_id,
                account_id = %lease.account_id,
                units = lease.credited.get(),
                "reclaimer: settled an expired lease its holder never released; \
                 its remainder is credited back, including the units of any charge \
                 the holder committed but never delivered, which go unbilled"
            );
            bump(&self.counters.reclaimed_leases, 1);
            bump(&self.counters.reclaimed_units, lease.credited.get());
        }
    }

    /// Counts and reports one batch, and says whether the pass goes on.
    fn settle(&self, batch: &ReclaimBatch, named: &mut HashSet<LeaseId>) -> Next {
        self.report_reclaimed(batch);
        for lease in batch
            .blocked
            .iter()
            .filter(|lease| named.insert(lease.lease_id))
        {
            tracing::warn!(
                lease_id = %lease.lease_id,
                account_id = %lease.account_id,
                units = lease.remainder.get(),
                "reclaimer: an expired lease cannot be settled yet: its account's balance \
                 has no room for its remainder below the ledger's range; retrying every pass"
            );
        }
        if !batch.more {
            // The call that ends a pass names what is blocked.
            self.counters.blocked_leases.store(
                u64::try_from(batch.blocked.len()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
            bump(&self.counters.passes, 1);
            return Next::Done;
        }
        if batch.reclaimed.is_empty() {
            // Asking again at once would spin: the store says leases are
            // due but settles none of them.
            bump(&self.counters.errors, 1);
            tracing::error!(
                "reclaimer: the store said more leases are due but settled none; \
                 trying again next interval"
            );
            return Next::Done;
        }
        Next::Continue
    }
}

/// Runs `work` unless a stop comes first.
async fn until_stopped<F: Future>(
    stop: &mut watch::Receiver<bool>,
    work: F,
) -> Result<F::Output, Stopped> {
    tokio::select! {
        biased;
        // A dropped handle also stops the task: nobody could stop it later.
        _ = stop.wait_for(|stopping| *stopping) => Err(Stopped),
        output = work => Ok(output),
    }
}
