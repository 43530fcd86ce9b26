//! The usage writer: the background task that drains the usage queue into a
//! [`UsageSink`].
//!
//! Admission reserves a place in the bounded queue before it admits, and
//! recording a committed charge fills that place (I20). The writer takes the
//! events out oldest first, in batches of at most `max_batch`, and hands each
//! batch to the sink. A place is freed only when the sink has said what became
//! of its event, or when the writer gives the event up at its shutdown
//! deadline and reports it lost (I21).
//!
//! # Delivery
//!
//! The writer wakes when a batch's worth is queued in one stripe of the
//! queue (or every place is taken), when the flush interval passes with at
//! least one event queued, or when it is told to stop. Woken by a stripe,
//! it delivers batch after batch while a whole batch is queued across all
//! the stripes; woken by the flush interval, it delivers everything queued,
//! the partial batch last. Events spread thinly over many stripes, none
//! holding a batch, can therefore wait up to the flush interval even when
//! they add up to several batches, and then go out together. Every
//! ingest call is bounded by `ingest_timeout` (I22). A storage error, a
//! timeout or an answer with the wrong number of outcomes is a failed attempt:
//! the writer waits `retry_backoff` and delivers the *same* batch again, in
//! the same order, with nothing added. Re-delivery is harmless because events
//! are idempotent by request id (I8). An event the sink rejects is counted,
//! logged and never retried, because retrying cannot help.
//!
//! # Shutdown
//!
//! [`UsageWriter::stop_at`] closes the queue, so admission denies with
//! `ShuttingDown`, and sets a deadline. The writer keeps delivering until the
//! queue is empty and no permit is outstanding, or until the deadline. Every
//! wait it makes after that (an ingest, a backoff, waiting for a permit to
//! record) is raced against the deadline, so [`UsageWriter::shutdown`]
//! returns by then. What the writer could not deliver is counted as lost,
//! logged and reported in the [`WriterReport`].
//!
//! Dropping the [`UsageWriter`] without calling `shutdown` aborts the task,
//! closes the queue and logs how many events were left undelivered.

use std::fmt;
use std::future::{Future, poll_fn};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Poll;
use std::time::Duration;

use jiff::Timestamp;
use tokio::sync::watch;
use tokio::task::{JoinError, JoinHandle};
use tokio::time::error::Elapsed;
use tokio::time::{Instant, sleep, sleep_until, timeout};

use super::TIMER_RESOLUTION;
use super::{after, bump};
use crate::admission::{UsageQueue, UsageRecorder};
use crate::model::{LocalSharding, UsageEvent};
use crate::store::{Clock, IngestOutcome, StoreError, UsageSink};

/// How the usage writer batches, retries and stops.
///
/// There is no `Default` (I17): these limits decide how many charges may wait
/// unbilled and for how long, so the caller states every one, and
/// [`validate`](Self::validate) checks them before the writer starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageWriterConfig {
    /// Places in the usage queue: the most charges this process may hold
    /// committed but not yet written, together with the requests admitted
    /// and still waiting for their handler to start (each holds the place
    /// its event will take, I20). Size it above both: a backlog of events
    /// while the sink is slow, plus every request that can wait admitted
    /// (a concurrency limit's queue inside the layer, bodies a deferred
    /// commit point is still reading); once it is full, every admission on
    /// the instance is denied (`accounting_backpressure`), whichever account
    /// it is for. Must be positive and at most
    /// [`UsageRecorder::MAX_CAPACITY`]; every place is allocated up front.
    pub queue_capacity: usize,
    /// How the queue is split so threads recording in parallel do not
    /// contend: [`LocalSharding::per_core`] for a server. With more than one
    /// stripe the sink may receive events out of recording order (see
    /// [`UsageRecorder::striped`]); [`LocalSharding::Single`] keeps that
    /// order.
    pub queue_stripes: LocalSharding,
    /// The most events in one ingest call, and the number waiting in one
    /// stripe that wakes the writer before the flush interval (as does a
    /// full stripe). Must be positive and at most `queue_capacity`.
    pub max_batch: usize,
    /// The longest an idle writer lets a partial batch wait. At least one
    /// millisecond, the timer's resolution.
    pub flush_interval: Duration,
    /// The pause after a failed ingest before the same batch is delivered
    /// again. At least one millisecond, the timer's resolution.
    pub retry_backoff: Duration,
    /// The bound on every ingest call (I22). At least one millisecond, the
    /// timer's resolution.
    pub ingest_timeout: Duration,
    /// How long a shutdown may spend draining the queue. Must be positive.
    pub shutdown_drain_deadline: Duration,
}

/// The first rule a [`UsageWriterConfig`] breaks, in field order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum UsageWriterConfigError {
    /// `queue_capacity` is zero.
    QueueCapacityZero,
    /// `queue_capacity` is above [`UsageRecorder::MAX_CAPACITY`].
    QueueCapacityAboveMax,
    /// `max_batch` is zero.
    MaxBatchZero,
    /// `max_batch` is larger than `queue_capacity`.
    MaxBatchAboveQueueCapacity,
    /// `flush_interval` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    FlushIntervalBelowTimerResolution,
    /// `retry_backoff` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    RetryBackoffBelowTimerResolution,
    /// `ingest_timeout` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    IngestTimeoutBelowTimerResolution,
    /// `shutdown_drain_deadline` is zero.
    ShutdownDrainDeadlineZero,
}

/// The owner's handle on the usage writer task.
///
/// Keep it for the life of the service and call [`shutdown`](Self::shutdown)
/// to drain; dropping it instead aborts the task and logs what was left
/// undelivered.
pub struct UsageWriter {
    shared: Arc<Shared>,
    queue: Arc<UsageQueue>,
    shutdown_drain_deadline: Duration,
    /// `None` only once `shutdown` or `drop` has taken it.
    task: Option<JoinHandle<()>>,
}

/// What the writer has done so far.
///
/// Every event ever recorded is exactly one of `accepted`, `duplicate`,
/// `rejected`, `lost`, `queued` or `in_flight` whenever the writer is between
/// steps (I21: nothing is lost silently). The fields are read one at a time,
/// not as one snapshot: a reading taken while the writer delivers may be off
/// by every event it moved during the reading (several batches, if the
/// reader is descheduled), so the identity holds for the report
/// [`shutdown`](UsageWriter::shutdown) returns and for readings of an idle
/// writer, not for each live reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriterStats {
    /// Events the sink recorded, including those a failed attempt recorded
    /// after all (its retry then finds them recorded). Every event of a
    /// retried batch that the sink answers `Duplicate` is counted here: the
    /// writer cannot tell its own failed attempt's write from an earlier
    /// one.
    pub accepted: u64,
    /// Events the sink answered `Duplicate` the first time this writer
    /// offered them: recorded before, by another writer with the same
    /// request ids.
    pub duplicate: u64,
    /// Events the sink refused; never retried.
    pub rejected: u64,
    /// Events given up: at the shutdown deadline, or undelivered when the
    /// task died (counted from then on, not only in the final report).
    pub lost: u64,
    /// Events waiting in the queue.
    pub queued: u64,
    /// Events in the batch being delivered.
    pub in_flight: u64,
    /// Batches the sink answered for.
    pub batches: u64,
    /// Re-deliveries of a batch after a failed attempt.
    pub retries: u64,
    /// Ingest calls cut off by `ingest_timeout`.
    pub ingest_timeouts: u64,
    /// Ingest calls that failed, or answered with the wrong number of
    /// outcomes.
    pub storage_errors: u64,
}

/// Whether the writer is delivering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriterHealth {
    /// The last delivery succeeded, or none has failed yet.
    Healthy,
    /// The current batch has failed and is being retried.
    Retrying {
        /// When the first failure of this streak happened, by the writer's
        /// clock.
        since: Timestamp,
        /// Failed attempts in this streak.
        attempts: u64,
    },
    /// The task has ended.
    Stopped,
}

/// What a shutdown found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterReport {
    /// The final statistics. Nothing is queued or in flight once the
    /// writer has ended (`queued` and `in_flight` are zero): what was is
    /// counted in `lost`.
    pub stats: WriterStats,
    /// Events given up, the same as `stats.lost`: the in-flight batch and
    /// everything still queued at the deadline (or when the task died),
    /// plus any event recorded after the writer gave up by a commit that
    /// raced it, which nobody will write.
    ///
    /// Given up means not confirmed: an ingest cut off by the deadline may
    /// have written its batch after all (I22). The store's ledger is the
    /// record of what was billed. A writer that gives its events up at its
    /// deadline drops the holds of their charges, so the leases they name
    /// are released at shutdown with the units those charges committed
    /// counted as spent: unless a cut-off ingest did record them, the store
    /// shows them as settled but unbilled (`AccountView::settled_unbilled`).
    /// A writer whose task died drops nothing: its events' leases stay
    /// held, are abandoned at shutdown, and settle at TTL reclaim.
    pub lost: u64,
    /// Places still held, when this report is made, by permits whose
    /// requests had not committed. Once the writer has given up, a commit is
    /// refused (the handler does not run and nothing is charged), so these
    /// count the admitted requests the shutdown cut off that were still
    /// waiting then; one refused and dropped before the report gave its
    /// place back and is not counted.
    ///
    /// The exception is a commit already past that check as the writer gave
    /// up: its event goes into the abandoned queue and its handler runs. If
    /// it records before this report is made, its event is counted in
    /// `lost`; if after, its permit is counted here. Either way the event is
    /// never written, and the charge it holds keeps its lease from being
    /// released, so the lease comes back by reclaim and the account is not
    /// charged for that request.
    pub outstanding_permits: u64,
    /// The task panicked or was aborted instead of finishing; `lost` then
    /// counts every event it had not answered for.
    pub task_died: bool,
}

impl UsageWriterConfig {
    /// Checks every rule, in field order.
    ///
    /// # Errors
    ///
    /// The first rule broken.
    pub fn validate(&self) -> Result<(), UsageWriterConfigError> {
        use UsageWriterConfigError as Broken;
        let rules = [
            (self.queue_capacity > 0, Broken::QueueCapacityZero),
            (
                self.queue_capacity <= UsageRecorder::MAX_CAPACITY,
                Broken::QueueCapacityAboveMax,
            ),
            (self.max_batch > 0, Broken::MaxBatchZero),
            (
                self.max_batch <= self.queue_capacity,
                Broken::MaxBatchAboveQueueCapacity,
            ),
            (
                self.flush_interval >= TIMER_RESOLUTION,
                Broken::FlushIntervalBelowTimerResolution,
            ),
            (
                self.retry_backoff >= TIMER_RESOLUTION,
                Broken::RetryBackoffBelowTimerResolution,
            ),
            (
                self.ingest_timeout >= TIMER_RESOLUTION,
                Broken::IngestTimeoutBelowTimerResolution,
            ),
            (
                !self.shutdown_drain_deadline.is_zero(),
                Broken::ShutdownDrainDeadlineZero,
            ),
        ];
        rules
            .into_iter()
            .find_map(|(holds, broken)| (!holds).then_some(broken))
            .map_or(Ok(()), Err)
    }
}

impl fmt::Display for UsageWriterConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::QueueCapacityZero => "usage writer: queue_capacity must be positive",
            Self::QueueCapacityAboveMax => {
                return write!(
                    f,
                    "usage writer: queue_capacity must be at most {}",
                    UsageRecorder::MAX_CAPACITY
                );
            }
            Self::MaxBatchZero => "usage writer: max_batch must be positive",
            Self::MaxBatchAboveQueueCapacity => {
                "usage writer: max_batch must not exceed queue_capacity"
            }
            Self::FlushIntervalBelowTimerResolution => {
                "usage writer: flush_interval must be at least one millisecond \
                 (the timer's resolution)"
            }
            Self::RetryBackoffBelowTimerResolution => {
                "usage writer: retry_backoff must be at least one millisecond \
                 (the timer's resolution)"
            }
            Self::IngestTimeoutBelowTimerResolution => {
                "usage writer: ingest_timeout must be at least one millisecond \
                 (the timer's resolution)"
            }
            Self::ShutdownDrainDeadlineZero => {
                "usage writer: shutdown_drain_deadline must be positive"
            }
        })
    }
}

impl std::error::Error for UsageWriterConfigError {}

impl UsageWriter {
    /// Validates `config`, builds the usage queue and starts the writer on
    /// the current tokio runtime. The recorder feeds admission; the writer is
    /// the owner's handle.
    ///
    /// # Errors
    ///
    /// The first rule `config` breaks; nothing is started then.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn spawn(
        sink: Arc<dyn UsageSink>,
        clock: Arc<dyn Clock>,
        config: UsageWriterConfig,
    ) -> Result<(UsageRecorder, Self), UsageWriterConfigError> {
        config.validate()?;
        let recorder = UsageRecorder::striped(
            config.queue_capacity,
            config.max_batch,
            config.queue_stripes,
        );
        let queue = Arc::clone(recorder.queue());
        queue.own_by_writer();
        let (stop, stop_rx) = watch::channel(None);
        let shared = Arc::new(Shared {
            counters: Counters::default(),
            health: Mutex::new(WriterHealth::Healthy),
            stop,
        });
        let task = Task {
            queue: Arc::clone(&queue),
            sink,
            clock,
            shared: Arc::clone(&shared),
            stop: stop_rx,
            config,
            batch: Vec::with_capacity(config.max_batch),
        };
        let writer = Self {
            shared,
            queue,
            shutdown_drain_deadline: config.shutdown_drain_deadline,
            task: Some(tokio::spawn(task.run())),
        };
        Ok((recorder, writer))
    }

    /// The counters as they stand now. Once the task has ended (a writer
    /// that died, or one that finished its drain), what it left queued or
    /// in flight is counted lost here already, as the final report counts
    /// it: nothing will deliver it.
    pub fn stats(&self) -> WriterStats {
        if !self.task.as_ref().is_none_or(JoinHandle::is_finished) {
            return self.counted();
        }
        self.left_behind()
    }

    /// Aborts the task and gives up on the queue, as dropping the handle
    /// does, and returns the counters with everything left undelivered
    /// counted lost. The queue is abandoned before the count, so no commit
    /// can add an event after it (I21); a batch the sink answers as the
    /// task is aborted may be counted both accepted and lost.
    pub(crate) fn abandon(self) -> WriterStats {
        if let Some(task) = &self.task {
            task.abort();
        }
        self.queue.abandon();
        self.left_behind()
    }

    /// The counters with everything undelivered counted lost: what the
    /// writer leaves behind once its task has ended.
    fn left_behind(&self) -> WriterStats {
        left_behind(&self.shared, &self.queue)
    }

    /// The counters as the task left them.
    fn counted(&self) -> WriterStats {
        counted(&self.shared, &self.queue)
    }

    /// A view of the counters and health that outlives this handle, for a
    /// report read while the handle's owner awaits
    /// [`shutdown`](Self::shutdown).
    pub(crate) fn view(&self) -> WriterView {
        WriterView {
            shared: Arc::clone(&self.shared),
            queue: Arc::clone(&self.queue),
        }
    }

    /// Whether the writer is delivering, retrying, or has ended.
    pub fn health(&self) -> WriterHealth {
        // A task that panicked never wrote `Stopped` itself.
        if self.task.as_ref().is_none_or(JoinHandle::is_finished) {
            return WriterHealth::Stopped;
        }
        *self.shared.health()
    }

    /// Closes the queue to new permits and tells the writer to drain until
    /// `deadline`, or until `shutdown_drain_deadline` from now if that is
    /// earlier. Calling it again can bring the deadline forward, never push
    /// it back.
    pub fn stop_at(&self, deadline: Instant) {
        let deadline = deadline.min(after(Instant::now(), self.shutdown_drain_deadline));
        // I20: a closed queue denies new permits with `ShuttingDown`; permits
        // already taken still record, and the writer waits for them. The
        // close comes first: a task that saw the stop before it could find
        // every place free, finish, and leave a permit taken just after
        // with nobody to deliver its event (I21).
        self.queue.close();
        self.shared.stop.send_modify(|current| {
            *current = Some(current.map_or(deadline, |earlier| earlier.min(deadline)));
        });
    }

    /// Stops the writer (with `shutdown_drain_deadline` unless
    /// [`stop_at`](Self::stop_at) already set a deadline), waits for it to
    /// drain, and reports what it delivered and what it gave up.
    ///
    /// Returns by the deadline, give or take scheduling: the task races
    /// every wait against it (I21).
    ///
    /// # Panics
    ///
    /// Never in practice: the task handle is present until this method or
    /// `drop` consumes the writer.
    pub async fn shutdown(mut self) -> WriterReport {
        if self.shared.stop.borrow().is_none() {
            self.stop_at(after(Instant::now(), self.shutdown_drain_deadline));
        }
        let task = self
            .task
            .take()
            .expect("the task handle is taken only by shutdown or drop, which consume the writer");
        let ending = task.await;
        self.report(ending)
    }

    fn report(&self, ending: Result<(), JoinError>) -> WriterReport {
        // The task's exit guard has done this already; a task that died
        // before it ran the guard leaves it to here.
        self.queue.abandon();
        let stats = self.counted();
        // The queue is abandoned by now (the task's last act, or its exit
        // guard): whatever is recorded in it will not be written, and the
        // permits still out will be refused at commit.
        let undelivered = self.queue.undelivered() as u64;
        let outstanding_permits = (self.queue.in_use() as u64).saturating_sub(undelivered);
        // What is still queued or in flight is lost, and counted there: the
        // final statistics add up to every event recorded (I21). A task
        // that gave up released everything it held, so what is found now
        // was recorded after it did; one that died released nothing.
        let lost = stats.lost.saturating_add(undelivered);
        let stats = WriterStats {
            queued: 0,
            in_flight: 0,
            lost,
            ..stats
        };
        let task_died = ending.is_err();
        if let Err(error) = ending {
            tracing::error!(
                %error,
                lost = undelivered,
                "usage writer: the task died before draining; its undelivered events are lost"
            );
        }
        WriterReport {
            stats,
            lost,
            outstanding_permits,
            task_died,
        }
    }
}

impl Drop for UsageWriter {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        // Nothing will write what admission records from now on, so admission
        // must stop (I20: a closed queue denies with `ShuttingDown`), and so
        // must commits of permits already taken (I21).
        self.queue.abandon();
        if !task.is_finished() {
            task.abort();
            tracing::warn!(
                undelivered = self.queue.undelivered(),
                "usage writer: handle dropped without shutdown; the task is aborted and \
                 its undelivered events will not be written"
            );
        }
    }
}

impl fmt::Debug for UsageWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UsageWriter")
            .field("health", &self.health())
            .field("stats", &self.stats())
            .field("stop_deadline", &*self.shared.stop.borrow())
            .finish_non_exhaustive()
    }
}

/// A writer's counters and health, read while it drains (see
/// [`UsageWriter::view`]). It cannot tell a task that panicked from one
/// still draining, so it is read only until the shutdown's report is in;
/// but once the queue is given up on (the writer's deadline passed, or its
/// handle was dropped with the shutdown cancelled) it reads as stopped,
/// with what is left undelivered counted lost.
pub(crate) struct WriterView {
    shared: Arc<Shared>,
    queue: Arc<UsageQueue>,
}

impl WriterView {
    /// The counters as they stand now.
    pub(crate) fn stats(&self) -> WriterStats {
        if self.queue.is_abandoned() {
            return left_behind(&self.shared, &self.queue);
        }
        counted(&self.shared, &self.queue)
    }

    /// The health the task last wrote, or stopped once the queue is given
    /// up on.
    pub(crate) fn health(&self) -> WriterHealth {
        if self.queue.is_abandoned() {
            return WriterHealth::Stopped;
        }
        *self.shared.health()
    }
}

/// The counters with everything undelivered counted lost: nothing will
/// deliver it once the task has ended or the queue is given up on.
fn left_behind(shared: &Shared, queue: &UsageQueue) -> WriterStats {
    let stats = counted(shared, queue);
    WriterStats {
        queued: 0,
        in_flight: 0,
        lost: stats.lost.saturating_add(queue.undelivered() as u64),
        ..stats
    }
}

/// The counters as the task left them, with the queue's length.
fn counted(shared: &Shared, queue: &UsageQueue) -> WriterStats {
    let counters = &shared.counters;
    let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    WriterStats {
        accepted: read(&counters.accepted),
        duplicate: read(&counters.duplicate),
        rejected: read(&counters.rejected),
        lost: read(&counters.lost),
        queued: queue.len() as u64,
        in_flight: read(&counters.in_flight),
        batches: read(&counters.batches),
        retries: read(&counters.retries),
        ingest_timeouts: read(&counters.ingest_timeouts),
        storage_errors: read(&counters.storage_errors),
    }
}

/// What the handle and the task share.
struct Shared {
    /// Written only by the task.
    counters: Counters,
    /// Written only by the task; read by the handle.
    health: Mutex<WriterHealth>,
    /// The stop deadline, once one is requested. The sender lives here, so
    /// the task's receiver stays open for as long as the task runs.
    stop: watch::Sender<Option<Instant>>,
}

/// The task's statistics. Plain `std` atomics rather than the loom facade:
/// nothing orders other memory by them, so there is no protocol for loom to
/// check, and `Relaxed` suffices.
#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    duplicate: AtomicU64,
    rejected: AtomicU64,
    lost: AtomicU64,
    in_flight: AtomicU64,
    batches: AtomicU64,
    retries: AtomicU64,
    ingest_timeouts: AtomicU64,
    storage_errors: AtomicU64,
}

impl Shared {
    fn health(&self) -> MutexGuard<'_, WriterHealth> {
        // A health value cannot be left half-written, so a poisoned lock
        // still holds a valid reading.
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The writer task.
///
/// # Invariants
///
/// 1. `batch` holds events taken from the queue, in queue order, whose places
///    are not yet released; it is emptied only after the sink answered for
///    every one of them, or at the deadline when they are counted lost (I21).
/// 2. Between steps, `counters.in_flight == batch.len()`.
struct Task {
    queue: Arc<UsageQueue>,
    sink: Arc<dyn UsageSink>,
    clock: Arc<dyn Clock>,
    shared: Arc<Shared>,
    stop: watch::Receiver<Option<Instant>>,
    config: UsageWriterConfig,
    batch: Vec<UsageEvent>,
}

/// What the task should do after waiting.
enum Wait {
    /// Take batches and deliver them.
    Work(Drain),
    /// Stopped, and either drained or out of time.
    Finish,
}

/// How much a wake-up delivers before the task waits again.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Drain {
    /// A batch's worth is queued in one stripe: deliver batches while a
    /// whole one is queued, and leave a partial one for the flush interval.
    FullBatches,
    /// The flush interval passed, or the writer is stopping: deliver
    /// everything queued, partial batch included, since it has waited as
    /// long as it may.
    Everything,
}

/// The stop deadline passed before the awaited work finished.
struct DeadlinePassed;

/// After a stop, the longest the task sleeps while permits are out.
///
/// Recording an event into a closed queue, or returning a place to it, wakes
/// the task; this bounds how late a wake-up lost in the race with the close
/// is made up for. It costs a timer tick per poll, and only while stopping.
const STOPPED_POLL: Duration = Duration::from_millis(10);

impl Task {
    /// Delivers batches until stopped, then gives up whatever is left.
    async fn run(mut self) {
        // However the task ends (given up, panicked in the sink, aborted),
        // nothing will write what is recorded from then on (I21).
        let _abandon = AbandonOnExit(Arc::clone(&self.queue));
        while let Wait::Work(drain) = self.wait_for_work().await {
            if self.drain(drain).await.is_err() {
                break;
            }
        }
        self.give_up();
    }

    /// Delivers batch after batch until `drain` is done. Batches queued
    /// over many stripes, none of which holds one alone, go out one after
    /// another rather than one per flush interval.
    async fn drain(&mut self, drain: Drain) -> Result<(), DeadlinePassed> {
        let max = self.config.max_batch;
        let mut first = true;
        loop {
            let taken = self.queue.take_into(&mut self.batch, max);
            if taken == 0 {
                debug_assert!(
                    !first,
                    "the task is the queue's only reader, and it was told events are waiting"
                );
                return Ok(());
            }
            first = false;
            self.shared
                .counters
                .in_flight
                .store(taken as u64, Ordering::Relaxed);
            self.deliver().await?;
            // A whole batch queued goes now; after a flush, so does what
            // was queued at the flush (a full take may have left some).
            let more = self.queue.len() >= max || (drain == Drain::Everything && taken == max);
            if !more {
                return Ok(());
            }
            // A sink that answers without waiting, under recordings as fast
            // as its answers, would otherwise keep the task from yielding.
            tokio::task::consume_budget().await;
        }
    }

    /// Waits until a batch should be taken, or until the writer should end.
    async fn wait_for_work(&mut self) -> Wait {
        let mut flush_at = after(Instant::now(), self.config.flush_interval);
        loop {
            let deadline = *self.stop.borrow_and_update();
            if let Some(deadline) = deadline
                && let Some(next) = self.next_after_stop(deadline)
            {
                return next;
            }
            // Once stopped, a permit's recording or return wakes the task
            // (see `next_after_stop`); the poll covers a wake-up missed in
            // the race with the close.
            let wake_at = deadline.map_or(flush_at, |deadline| {
                deadline
                    .min(flush_at)
                    .min(after(Instant::now(), STOPPED_POLL))
            });
            tokio::select! {
                () = queue_changed(&self.queue, deadline.is_some()) => {
                    // Stopped, any change is looked at: `next_after_stop`
                    // decides.
                    if deadline.is_none() {
                        return Wait::Work(Drain::FullBatches);
                    }
                }
                () = sleep_until(wake_at) => {
                    if self.queue.len() > 0 {
                        return Wait::Work(Drain::Everything);
                    }
                    // Counted from now, not from the passed deadline: a
                    // flush interval below the timer's millisecond would
                    // otherwise take a lap per interval to catch up, and
                    // one short enough would never catch up at all.
                    let now = Instant::now();
                    if now >= flush_at {
                        flush_at = after(now, self.config.flush_interval);
                    }
                }
                () = stop_changed(&mut self.stop) => {}
            }
        }
    }

    /// I21: once stopped, the writer ends when no place is held (queue
    /// empty, no permit outstanding) or the deadline has passed; until then
    /// whatever is queued goes out at once. `None` means wait: a permit may
    /// still record.
    fn next_after_stop(&self, deadline: Instant) -> Option<Wait> {
        if self.queue.in_use() == 0 || Instant::now() >= deadline {
            Some(Wait::Finish)
        } else if self.queue.len() > 0 {
            Some(Wait::Work(Drain::Everything))
        } else {
            // Permits are out. Once the queue is closed, recording an event
            // or returning a place wakes the task, so it drains as soon as
            // there is something to drain, or finishes as soon as there is
            // nothing left to wait for.
            None
        }
    }

    /// Delivers the batch, retrying the same events after each failure,
    /// until the sink answers for all of them or the stop deadline passes.
    async fn deliver(&mut self) -> Result<(), DeadlinePassed> {
        let mut attempts: u64 = 0;
        loop {
            if attempts > 0 {
                bump(&self.shared.counters.retries, 1);
            }
            attempts += 1;
            // I22: the ingest is bounded by the timeout; a stop deadline
            // that comes sooner cuts it off too.
            let call = timeout(self.config.ingest_timeout, self.sink.ingest(&self.batch));
            let answer = before_deadline(&mut self.stop, call).await?;
            if let Some(outcomes) = self.judge(answer) {
                self.settle(&outcomes, attempts > 1);
                return Ok(());
            }
            self.note_failure();
            // I21: the batch is kept as it is (same events, same order,
            // nothing appended) and delivered again after the backoff;
            // re-delivery is safe because events are idempotent (I8).
            before_deadline(&mut self.stop, sleep(self.config.retry_backoff)).await?;
        }
    }

    /// The outcomes of an attempt that succeeded, or `None` after counting
    /// and logging a failed one.
    fn judge(
        &self,
        answer: Result<Result<Vec<IngestOutcome>, StoreError>, Elapsed>,
    ) -> Option<Vec<IngestOutcome>> {
        let counters = &self.shared.counters;
        let size = self.batch.len();
        match answer {
            Ok(Ok(outcomes)) if outcomes.len() == size => Some(outcomes),
            Ok(Ok(outcomes)) => {
                bump(&counters.storage_errors, 1);
                tracing::error!(
                    batch = size,
                    outcomes = outcomes.len(),
                    "usage writer: the sink answered for the wrong number of events; \
                     retrying the batch"
                );
                None
            }
            Ok(Err(error)) => {
                bump(&counters.storage_errors, 1);
                tracing::warn!(%error, batch = size, "usage writer: ingest failed; retrying the batch");
                None
            }
            Err(_) => {
                // I22: a timed-out call may have taken effect; retrying is
                // safe by I8.
                bump(&counters.ingest_timeouts, 1);
                tracing::warn!(
                    timeout = ?self.config.ingest_timeout,
                    batch = size,
                    "usage writer: ingest timed out; retrying the batch"
                );
                None
            }
        }
    }

    /// Counts the sink's answer for every event of the batch and frees their
    /// places. After a failed attempt (`retried`), which may have taken
    /// effect (I22), a duplicate is this writer's own earlier write of the
    /// event, and counts as accepted.
    fn settle(&mut self, outcomes: &[IngestOutcome], retried: bool) {
        let (mut accepted, mut duplicate, mut rejected) = (0, 0, 0);
        for (event, outcome) in self.batch.iter().zip(outcomes) {
            match outcome {
                IngestOutcome::Accepted => accepted += 1,
                IngestOutcome::Duplicate if retried => accepted += 1,
                IngestOutcome::Duplicate => duplicate += 1,
                IngestOutcome::Rejected(reason) => {
                    // I21: a rejection is final; it is counted and logged,
                    // never retried.
                    rejected += 1;
                    tracing::warn!(
                        request_id = %event.request_id,
                        reason = reason.label(),
                        "usage writer: the sink rejected a usage event"
                    );
                }
            }
        }
        let counters = &self.shared.counters;
        bump(&counters.accepted, accepted);
        bump(&counters.duplicate, duplicate);
        bump(&counters.rejected, rejected);
        bump(&counters.batches, 1);
        counters.in_flight.store(0, Ordering::Relaxed);
        // I20: these events have left the process; their places are free.
        self.queue.release(self.batch.len());
        self.batch.clear();
        self.note_success();
    }

    fn note_failure(&self) {
        let mut health = self.shared.health();
        *health = match *health {
            WriterHealth::Retrying { since, attempts } => WriterHealth::Retrying {
                since,
                attempts: attempts + 1,
            },
            WriterHealth::Healthy | WriterHealth::Stopped => WriterHealth::Retrying {
                since: self.clock.now(),
                attempts: 1,
            },
        };
    }

    fn note_success(&self) {
        let mut health = self.shared.health();
        if let WriterHealth::Retrying { since, attempts } = *health {
            tracing::info!(%since, attempts, "usage writer: the sink recovered");
        }
        *health = WriterHealth::Healthy;
    }

    /// I21: at the end, whatever the writer still holds or finds queued is
    /// counted lost and logged, never dropped silently. Returns the places
    /// still held by outstanding permits.
    fn give_up(&mut self) {
        // First, so that a permit counted below as held either commits
        // before this (and is counted lost) or is refused at commit.
        self.queue.abandon();
        self.queue.take_into(&mut self.batch, usize::MAX);
        let abandoned = self.batch.len() as u64;
        // I20: given-up events leave the process, so their places are freed.
        // Places held by outstanding permits still belong to those permits,
        // which free them when dropped; releasing them here would free them
        // twice.
        self.queue.release(self.batch.len());
        self.batch.clear();
        let counters = &self.shared.counters;
        bump(&counters.lost, abandoned);
        counters.in_flight.store(0, Ordering::Relaxed);
        if abandoned > 0 {
            tracing::error!(
                lost = abandoned,
                "usage writer: shutdown deadline passed; undelivered usage events are lost"
            );
        }
        let outstanding_permits = self.queue.in_use();
        if outstanding_permits > 0 {
            tracing::warn!(
                outstanding_permits,
                "usage writer: admitted requests that have not started will be refused at commit"
            );
        }
        let overflowed = self.queue.overflowed();
        if overflowed > 0 {
            tracing::error!(
                overflowed,
                "usage writer: events were dropped because their permit's place was taken (I20 broken)"
            );
        }
        *self.shared.health() = WriterHealth::Stopped;
    }
}

/// Abandons the queue when the task ends, however it ends.
struct AbandonOnExit(Arc<UsageQueue>);

impl Drop for AbandonOnExit {
    fn drop(&mut self) {
        self.0.abandon();
        // A task that ends normally reports what it could not deliver; one
        // that panics (a sink's panic, say) says it here, since its handle
        // may be dropped, or never asked, afterwards (I21).
        if std::thread::panicking() {
            tracing::error!(
                undelivered = self.0.undelivered(),
                "usage writer: the task panicked; its undelivered events will not be written"
            );
        }
    }
}

/// Resolves once a batch's worth is queued.
/// Resolves when a batch is ready; once `stopped`, also when the queue wakes
/// the task for any other reason (an event recorded, a permit returned).
async fn queue_changed(queue: &UsageQueue, stopped: bool) {
    let mut polled = false;
    poll_fn(|cx| {
        if stopped && polled {
            return Poll::Ready(());
        }
        queue.register(cx.waker());
        // Checked after registering: a recording that lands between the
        // check and the registration would otherwise wake nobody.
        if queue.batch_ready() {
            Poll::Ready(())
        } else {
            polled = true;
            Poll::Pending
        }
    })
    .await;
}

/// Runs `work` unless the stop deadline passes first. Before a stop is
/// requested there is no deadline, but a stop requested while `work` runs
/// starts one, so no wait outlives it (I21).
async fn before_deadline<F: Future>(
    stop: &mut watch::Receiver<Option<Instant>>,
    work: F,
) -> Result<F::Output, DeadlinePassed> {
    tokio::select! {
        // An answer that is ready at the deadline still counts.
        biased;
        output = work => Ok(output),
        () = deadline_passed(stop) => Err(DeadlinePassed),
    }
}

/// Resolves when the stop deadline (the earliest requested) has passed.
async fn deadline_passed(stop: &mut watch::Receiver<Option<Instant>>) {
    loop {
        let requested = *stop.borrow_and_update();
        match requested {
            Some(deadline) => tokio::select! {
                () = sleep_until(deadline) => return,
                // A later `stop_at` may have brought the deadline forward.
                () = stop_changed(stop) => {}
            },
            None => stop_changed(stop).await,
        }
    }
}

/// Resolves when a stop is requested or its deadline changes.
async fn stop_changed(stop: &mut watch::Receiver<Option<Instant>>) {
    if stop.changed().await.is_err() {
        // Unreachable: the sender lives in `Shared`, which the task holds.
        // Waiting forever beats spinning on a closed channel.
        std::future::pending::<()>().await;
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use async_trait::async_trait;

    use super::*;
    use crate::model::{AccountId, CostUnits, Locality, PolicyRevision, RequestId, UsageSource};
    use crate::store::ManualClock;

    /// Accepts everything at once, noting each batch's size.
    #[derive(Default)]
    struct Sizes(Mutex<Vec<usize>>);

    fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
        mutex.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[async_trait]
    impl UsageSink for Sizes {
        async fn ingest(&self, batch: &[UsageEvent]) -> Result<Vec<IngestOutcome>, StoreError> {
            lock(&self.0).push(batch.len());
            Ok(vec![IngestOutcome::Accepted; batch.len()])
        }
    }

    fn event(id: u128) -> UsageEvent {
        UsageEvent {
            request_id: RequestId(id),
            account_id: AccountId(1),
            source: UsageSource::Overage,
            units: CostUnits(1),
            at: Timestamp::UNIX_EPOCH,
            policy_revision: PolicyRevision(1),
            key_id: None,
        }
    }

    /// Two and a half batches' worth queued over four stripes, none holding
    /// a batch: nothing wakes the writer before the flush interval, and the
    /// flush delivers all of it, whole batches first and the partial one
    /// after, so nothing recorded before a flush waits for the next.
    #[tokio::test(start_paused = true)]
    async fn a_flush_delivers_everything_queued_over_the_stripes() {
        const FLUSH: Duration = Duration::from_millis(100);
        let sink = Arc::new(Sizes::default());
        let (recorder, writer) = UsageWriter::spawn(
            Arc::clone(&sink) as Arc<dyn UsageSink>,
            Arc::new(ManualClock::new(Timestamp::UNIX_EPOCH)),
            UsageWriterConfig {
                queue_capacity: 64,
                queue_stripes: LocalSharding::shards(4).expect("within the limit"),
                max_batch: 4,
                flush_interval: FLUSH,
                retry_backoff: Duration::from_millis(50),
                ingest_timeout: Duration::from_millis(200),
                shutdown_drain_deadline: Duration::from_secs(1),
            },
        )
        .expect("a valid configuration");
        for (stripe, events) in [3, 3, 2, 2].into_iter().enumerate() {
            for id in 0..events {
                let permit = recorder.try_permit_at(Locality::new(stripe)).expect("room");
                permit.record(event(id));
            }
        }
        sleep(Duration::from_millis(99)).await;
        assert!(lock(&sink.0).is_empty(), "no stripe holds a batch");
        sleep(Duration::from_millis(2)).await;
        assert_eq!(*lock(&sink.0), [4, 4, 2]);
        assert_eq!(writer.stats().queued, 0);
    }
}
