//! The instance runtime: one validated configuration, every background plane
//! spawned and supervised, and the ordered shutdown.
//!
//! ```text
//!   SnapshotManager ──publishes──► ArcSwapSnapshotMap ──binds──► SlotRegistry
//!          │ bindings                                                 │
//!          ▼                                                          ▼
//!     supervisor ──starts/retires/restarts──► LeaseManager per account ──► LeaseSlot
//!                                                                     ▲
//!   RuntimeHandle::begin ─► AdmissionEngine ─reads───────────────────┘
//!          │ commit
//!          ▼
//!     usage queue ──► UsageWriter ──► UsageSink
//! ```
//!
//! Shutdown runs in a fixed order inside one deadline (I25): stop admitting,
//! drain usage, then release leases. Releasing first would settle leases that
//! honest usage events still name, and the sink would reject them.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, sleep};

use super::TIMER_RESOLUTION;
use super::{after, bump};
use crate::admission::{
    AdmissionEngine, AdmissionStats, ArcSwapSnapshotMap, RequestContext, RequestIds, SlotRegistry,
    SnapshotMapConfig, SnapshotMapConfigError, UsageRecorder,
};
use crate::model::{
    AccountId, BalanceShortfall, CostUnits, DenyReason, KeyHash, LocalSharding, PermissionBits,
    Principal, ShardOccupancy,
};
use crate::runtime::reclaimer::ReclaimView;
use crate::runtime::usage_writer::WriterView;
use crate::runtime::{
    AccountBindings, AccountLeaseConfig, LeaseHealth, LeaseManager, LeaseManagerConfigError,
    LeaseManagerReport, LeaseStats, ReclaimStats, Reclaimer, ReclaimerConfig, ReclaimerConfigError,
    SnapshotCounters, SnapshotManager, SnapshotManagerConfig, SnapshotManagerConfigError,
    SnapshotStats, UsageWriter, UsageWriterConfig, UsageWriterConfigError, WriterHealth,
    WriterReport, WriterStats,
};
use crate::store::{Clock, LeaseAllocator, SnapshotSource, UsageSink};

/// Everything an instance needs to run. No defaults (I17): every value
/// here decides what may be spent, how long policy is trusted, or how long
/// shutdown may take.
#[derive(Debug, Clone)]
pub struct InstanceRuntimeConfig {
    /// How snapshots are cached and how stale they may get.
    pub snapshot_map: SnapshotMapConfig,
    /// Which principals to load and how often to refresh them.
    pub snapshots: SnapshotManagerConfig,
    /// How each account's lease is sized, kept and returned.
    pub leases: AccountLeaseConfig,
    /// How each account's leases are spread over cache lines.
    pub sharding: LocalSharding,
    /// How usage is queued, batched and drained.
    pub usage: UsageWriterConfig,
    /// Whether this instance also reclaims expired leases, and how.
    pub reclaimer: Option<ReclaimerConfig>,
    /// How often the supervisor checks its lease managers. At least one
    /// millisecond, the timer's resolution.
    pub supervisor_interval: Duration,
    /// How long an account with no usable principal keeps its lease before
    /// the supervisor returns it. At least one millisecond, the timer's
    /// resolution.
    pub account_linger: Duration,
    /// How long the supervisor waits before restarting a lease manager that
    /// died. At least one millisecond, the timer's resolution.
    pub manager_restart_backoff: Duration,
    /// The one budget for the whole shutdown; the usage drain and the lease
    /// release budgets must fit inside it together.
    pub shutdown_deadline: Duration,
}

/// The first rule an [`InstanceRuntimeConfig`] breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InstanceRuntimeConfigError {
    /// The snapshot map's configuration.
    SnapshotMap(SnapshotMapConfigError),
    /// The snapshot manager's configuration.
    Snapshots(SnapshotManagerConfigError),
    /// The lease managers' configuration.
    Leases(LeaseManagerConfigError),
    /// The usage writer's configuration.
    Usage(UsageWriterConfigError),
    /// The reclaimer's configuration.
    Reclaimer(ReclaimerConfigError),
    /// `usage.flush_interval` plus `usage.retry_backoff` plus three times
    /// `usage.ingest_timeout` must be shorter than
    /// `leases.expiry_safety_margin`: a charge committed as its lease's
    /// window closes must reach the store before the lease expires, even
    /// when one delivery fails. The worst case is a charge committed just
    /// after a batch was taken: that batch's failed call, the backoff, its
    /// retry, then the charge's own flush interval and call. Otherwise, at
    /// low traffic, it can wait out the lease, be reclaimed unbilled, and
    /// then be rejected as settled. The rule covers one batch ahead of the
    /// charge: a backlog of several batches (a queue far larger than
    /// `max_batch` filled behind a slow store) delivers later, and is
    /// covered only by the allocator's reclaim grace, which should exceed
    /// how long the queue takes to drain.
    UsageDeliveryOutlastsLeaseMargin,
    /// `reclaimer.outage_hold` must be longer than the usage delivery time
    /// of [`UsageDeliveryOutlastsLeaseMargin`](Self::UsageDeliveryOutlastsLeaseMargin):
    /// after an outage, the usage queued meanwhile must reach the store
    /// before the reclaimer settles the leases it names (I19). A backlog of
    /// several batches takes longer; the hold should cover how long the
    /// queue takes to drain.
    OutageHoldWithinUsageDelivery,
    /// The snapshot manager's and the snapshot map's `max_staleness` must be
    /// the same limit: readiness and admission must agree on when policy is
    /// too old.
    StalenessMismatch,
    /// `supervisor_interval` must be at least the timer's resolution, one millisecond.
    SupervisorIntervalBelowTimerResolution,
    /// `account_linger` must be at least the timer's resolution, one millisecond.
    AccountLingerBelowTimerResolution,
    /// `manager_restart_backoff` must be at least the timer's resolution, one millisecond.
    ManagerRestartBackoffBelowTimerResolution,
    /// `shutdown_deadline` must cover the usage drain plus the lease release.
    PhaseBudgetsExceedShutdownDeadline,
    /// The operating system supplied no randomness for request ids.
    Randomness,
    /// `leases.expiry_safety_margin` must exceed how far behind the clock
    /// may read (I2) plus the usage delivery time of
    /// [`UsageDeliveryOutlastsLeaseMargin`](Self::UsageDeliveryOutlastsLeaseMargin):
    /// a clock that reads behind commits that much later than it says, and
    /// the charge must still reach the store before its lease expires.
    /// Checked by [`InstanceRuntime::spawn`], which has the clock.
    SafetyMarginBelowClockStaleness,
}

impl fmt::Display for InstanceRuntimeConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SnapshotMap(error) => error.fmt(f),
            Self::Snapshots(error) => error.fmt(f),
            Self::Leases(error) => error.fmt(f),
            Self::Usage(error) => error.fmt(f),
            Self::Reclaimer(error) => error.fmt(f),
            Self::StalenessMismatch => f.write_str(
                "instance runtime: snapshots.max_staleness must equal snapshot_map.max_staleness",
            ),
            Self::UsageDeliveryOutlastsLeaseMargin => f.write_str(
                "instance runtime: usage.flush_interval plus usage.retry_backoff plus three times \
                 usage.ingest_timeout must be shorter than leases.expiry_safety_margin (a charge \
                 must reach the store before its lease expires, even after one failed delivery)",
            ),
            Self::OutageHoldWithinUsageDelivery => f.write_str(
                "instance runtime: reclaimer.outage_hold must be longer than usage.flush_interval \
                 plus usage.retry_backoff plus three times usage.ingest_timeout (usage queued \
                 during an outage must be delivered before its leases are reclaimed)",
            ),
            Self::SupervisorIntervalBelowTimerResolution => {
                f.write_str(
                    "instance runtime: supervisor_interval must be at least one millisecond \
                     (the timer's resolution)",
                )
            }
            Self::AccountLingerBelowTimerResolution => f.write_str(
                "instance runtime: account_linger must be at least one millisecond (the timer's \
                 resolution)",
            ),
            Self::ManagerRestartBackoffBelowTimerResolution => {
                f.write_str(
                    "instance runtime: manager_restart_backoff must be at least one millisecond \
                     (the timer's resolution)",
                )
            }
            Self::PhaseBudgetsExceedShutdownDeadline => f.write_str(
                "instance runtime: shutdown_deadline must cover usage.shutdown_drain_deadline plus leases.shutdown_release_deadline",
            ),
            Self::Randomness => f.write_str("instance runtime: no randomness for request ids"),
            Self::SafetyMarginBelowClockStaleness => f.write_str(
                "instance runtime: leases.expiry_safety_margin must exceed the clock's staleness \
                 bound plus the usage delivery time (usage.flush_interval plus usage.retry_backoff \
                 plus three times usage.ingest_timeout)",
            ),
        }
    }
}

impl std::error::Error for InstanceRuntimeConfigError {}

impl InstanceRuntimeConfig {
    /// Checks every rule, in field order, and names the first one broken:
    /// every rule but
    /// [`SafetyMarginBelowClockStaleness`](InstanceRuntimeConfigError::SafetyMarginBelowClockStaleness),
    /// which needs the clock and is checked by [`InstanceRuntime::spawn`].
    ///
    /// # Errors
    ///
    /// The first broken rule.
    pub fn validate(&self) -> Result<(), InstanceRuntimeConfigError> {
        use InstanceRuntimeConfigError as E;
        self.snapshot_map.validate().map_err(E::SnapshotMap)?;
        self.snapshots.validate().map_err(E::Snapshots)?;
        if self.snapshots.max_staleness != self.snapshot_map.max_staleness {
            return Err(E::StalenessMismatch);
        }
        self.leases
            .for_account(AccountId(0))
            .validate()
            .map_err(E::Leases)?;
        self.usage.validate().map_err(E::Usage)?;
        if let Some(reclaimer) = &self.reclaimer {
            reclaimer.validate().map_err(E::Reclaimer)?;
        }
        // The batch ahead's failed call, the backoff and its retry, then the
        // charge's own flush interval and call.
        let delivery = self.usage_delivery();
        let margin = Duration::try_from(self.leases.expiry_safety_margin).ok();
        if !matches!((delivery, margin), (Some(delivery), Some(margin)) if delivery < margin) {
            return Err(E::UsageDeliveryOutlastsLeaseMargin);
        }
        if let (Some(reclaimer), Some(delivery)) = (&self.reclaimer, delivery)
            && reclaimer.outage_hold <= delivery
        {
            return Err(E::OutageHoldWithinUsageDelivery);
        }
        if self.supervisor_interval < TIMER_RESOLUTION {
            return Err(E::SupervisorIntervalBelowTimerResolution);
        }
        if self.account_linger < TIMER_RESOLUTION {
            return Err(E::AccountLingerBelowTimerResolution);
        }
        if self.manager_restart_backoff < TIMER_RESOLUTION {
            return Err(E::ManagerRestartBackoffBelowTimerResolution);
        }
        let phases = self
            .usage
            .shutdown_drain_deadline
            .checked_add(self.leases.shutdown_release_deadline);
        if phases.is_none_or(|phases| phases > self.shutdown_deadline) {
            return Err(E::PhaseBudgetsExceedShutdownDeadline);
        }
        Ok(())
    }

    /// The longest a charge committed as its lease's window closes may take
    /// to reach the store: the batch ahead's failed call, the backoff and its
    /// retry, then the charge's own flush interval and call. `None` past
    /// `Duration::MAX`.
    fn usage_delivery(&self) -> Option<Duration> {
        let usage = &self.usage;
        usage
            .ingest_timeout
            .checked_mul(3)
            .and_then(|calls| calls.checked_add(usage.retry_backoff))
            .and_then(|wait| wait.checked_add(usage.flush_interval))
    }
}

/// The running instance: owns every background task. Keep it for the
/// process's life and call [`shutdown`](Self::shutdown) to stop; dropping it
/// aborts everything and leaves held leases to TTL reclaim.
pub struct InstanceRuntime {
    shared: Arc<Shared>,
    supervisor: Option<JoinHandle<()>>,
}

/// What the serving side holds: cheap to clone, shared by every clone of the
/// HTTP layer.
#[derive(Clone)]
pub struct RuntimeHandle {
    shared: Arc<Shared>,
}

struct Shared {
    engine: AdmissionEngine,
    registry: Arc<SlotRegistry>,
    allocator: Arc<dyn LeaseAllocator>,
    clock: Arc<dyn Clock>,
    config: InstanceRuntimeConfig,
    /// Cleared once shutdown begins: admission denies from then on.
    admitting: AtomicBool,
    /// Set when a plane reported an integrity fault: readiness is withdrawn
    /// for good, so the instance is taken out of service. (The faulted
    /// account's own lease is withdrawn by its manager; other accounts
    /// answer whatever traffic still reaches them from the leases they
    /// hold, but take no new ones.)
    faulted: AtomicBool,
    shutdown: watch::Sender<bool>,
    snapshots_ready: watch::Receiver<bool>,
    /// The accounts the published policy binds, as the supervisor sees
    /// them: readiness answers for every one in use, including those the
    /// supervisor has not started a manager for yet.
    bindings: watch::Receiver<Arc<AccountBindings>>,
    restarts: AtomicU64,
    /// Grants held by lease managers that died, left to TTL reclaim.
    unrecovered: AtomicU64,
    planes: Mutex<Planes>,
}

/// The background tasks other than the supervisor, behind one lock that is
/// never held across an await.
struct Planes {
    writer: Option<UsageWriter>,
    snapshots: Option<SnapshotManager>,
    reclaimer: Option<Reclaimer>,
    accounts: BTreeMap<AccountId, ManagedAccount>,
    /// Stats of lease managers that have left (retired or dead), so totals
    /// never go down; `None` once the sum overflowed.
    retired: Option<LeaseStats>,
    /// The shutdowns of managers that have left, owned here so the
    /// runtime's shutdown waits for them and dropping the runtime aborts
    /// them.
    departures: JoinSet<()>,
    /// How many of those are still running, by account.
    departing: BTreeMap<AccountId, usize>,
    /// What the planes shutdown takes off the books had counted, so the
    /// report's totals never go down while and after it runs.
    stopped: StoppedPlanes,
}

/// The planes a shutdown takes off the books, to stop one by one.
struct Winding {
    writer: Option<UsageWriter>,
    snapshots: Option<SnapshotManager>,
    reclaimer: Option<Reclaimer>,
    /// Each running manager, with what it had counted when taken.
    managers: Vec<(AccountId, LeaseManager, LeaseStats)>,
    departures: JoinSet<()>,
}

impl Planes {
    /// Takes every plane off the books for a shutdown. What each has
    /// counted stays in the report's totals as it leaves, as a retired
    /// manager's does, and the report reads the others live until their
    /// own shutdowns report.
    fn wind_down(&mut self) -> Winding {
        let mut managers = Vec::new();
        for (account, managed) in std::mem::take(&mut self.accounts) {
            if let Some(manager) = managed.manager {
                let counted = manager.stats();
                self.retired = self.retired.and_then(|sum| sum.checked_add(&counted));
                managers.push((account, manager, counted));
            }
        }
        let stopped = &mut self.stopped;
        stopped.draining_writer = self.writer.as_ref().map(UsageWriter::view);
        stopped.draining_snapshots = self
            .snapshots
            .as_ref()
            .map(|manager| Arc::clone(manager.counters()));
        stopped.draining_reclaimer = self.reclaimer.as_ref().map(Reclaimer::view);
        Winding {
            writer: self.writer.take(),
            snapshots: self.snapshots.take(),
            reclaimer: self.reclaimer.take(),
            managers,
            departures: std::mem::take(&mut self.departures),
        }
    }

    /// Stops every running lease manager asking for grants.
    fn hold_grants(&self) {
        for manager in self
            .accounts
            .values()
            .filter_map(|managed| managed.manager.as_ref())
        {
            manager.hold_grants();
        }
    }
}

/// The planes a shutdown has taken: read live while each winds down, so
/// an operator watches the drain, then their last counts.
#[derive(Default)]
struct StoppedPlanes {
    writer: WriterStats,
    snapshots: SnapshotStats,
    reclaimer: Option<ReclaimStats>,
    draining_writer: Option<WriterView>,
    draining_snapshots: Option<Arc<SnapshotCounters>>,
    draining_reclaimer: Option<ReclaimView>,
}

impl StoppedPlanes {
    fn writer(&self) -> WriterStats {
        self.draining_writer
            .as_ref()
            .map_or(self.writer, WriterView::stats)
    }

    fn writer_health(&self) -> WriterHealth {
        self.draining_writer
            .as_ref()
            .map_or(WriterHealth::Stopped, WriterView::health)
    }

    fn snapshots(&self) -> SnapshotStats {
        self.draining_snapshots
            .as_ref()
            .map_or(self.snapshots, |counters| counters.read())
    }

    fn reclaimer(&self) -> Option<ReclaimStats> {
        self.draining_reclaimer
            .as_ref()
            .map(ReclaimView::stats)
            .or(self.reclaimer)
    }
}

struct ManagedAccount {
    manager: Option<LeaseManager>,
    /// When a dead manager may be started again.
    restart_at: Option<Instant>,
}

/// How one account is served on this instance.
#[derive(Debug, Clone)]
pub struct AccountReport {
    /// The account.
    pub account: AccountId,
    /// The lease manager's state, or `None` while the account has none:
    /// waiting out a restart backoff, or for a retiring predecessor to
    /// finish with the slot, or not started (the instance is out of
    /// service, or the manager refused its configuration).
    pub health: Option<LeaseHealth>,
    /// The counters of the account's current manager: a manager restarted
    /// (or started again for a returning account) counts from zero, while
    /// the instance's totals in [`RuntimeReport`] keep what every manager
    /// counted.
    pub stats: LeaseStats,
    /// Units left on the serving lease, if any (a momentary reading).
    pub remaining: Option<CostUnits>,
    /// How the serving lease's units sit across its shards.
    pub occupancy: Option<ShardOccupancy>,
    /// What the instance knows of the account's funds beyond its serving
    /// lease (see [`LeaseSlot::funding_estimate`](crate::admission::LeaseSlot::funding_estimate)).
    pub funding: Option<BalanceShortfall>,
    /// Debit attempts that lost a race to another thread, over every lease.
    pub contended_exchanges: u64,
}

/// A reading of the whole instance.
#[derive(Debug, Clone)]
pub struct RuntimeReport {
    /// Whether the instance should receive traffic.
    pub ready: bool,
    /// Whether admission is open (false once shutdown began).
    pub admitting: bool,
    /// Whether a plane reported an integrity fault.
    pub faulted: bool,
    /// Admissions and denials.
    pub admission: AdmissionStats,
    /// The usage writer's counters.
    pub writer: WriterStats,
    /// The usage writer's state.
    pub writer_health: WriterHealth,
    /// The snapshot manager's counters.
    pub snapshots: SnapshotStats,
    /// Every lease manager's counters, summed, including retired ones; `None`
    /// if the sum overflowed.
    pub leases: Option<LeaseStats>,
    /// The reclaimer's counters, if this instance runs one.
    pub reclaimer: Option<ReclaimStats>,
    /// Accounts the instance serves, with or without a running lease
    /// manager (see [`AccountReport::health`]).
    pub accounts: usize,
    /// Lease managers restarted after dying.
    pub manager_restarts: u64,
    /// Grants held by lease managers that died; they settle at TTL reclaim.
    pub unrecovered_grants: u64,
    /// The accounts whose debits contend most, hottest first (at most five).
    pub hottest_accounts: Vec<(AccountId, u64)>,
    /// How many accounts keep the instance unready: a usable principal is
    /// bound to each, and neither a lease that serves it nor the
    /// allocator's word that it has nothing left answers for it (see
    /// [`RuntimeHandle::readiness`]).
    pub unserved_count: usize,
    /// The first of those accounts by id (at most five), so a `/readyz`
    /// that says no also says where to look.
    pub unserved_accounts: Vec<AccountId>,
    /// Usage-queue places held by requests admitted and not yet committed
    /// or released: those waiting for their handler to start (queued for a
    /// concurrency limit, or for a deferred commit point). They share the
    /// queue with undelivered events, so a queue they fill denies every
    /// admission with `accounting_backpressure`; size the queue for them
    /// (see [`UsageWriterConfig::queue_capacity`](crate::runtime::UsageWriterConfig::queue_capacity)).
    /// Read from the queue in two steps, so off by a batch while the writer
    /// moves one.
    pub usage_places_reserved: u64,
}

/// What a shutdown did.
#[derive(Debug, Clone)]
pub struct RuntimeShutdownReport {
    /// The usage writer's drain.
    pub usage: Option<WriterReport>,
    /// Each account's lease release.
    pub leases: Vec<(AccountId, LeaseManagerReport)>,
    /// Accounts with no report in [`leases`](Self::leases): a manager
    /// retired before the shutdown still returning leases at the deadline,
    /// or one whose shutdown panicked. Their leases are left to TTL reclaim.
    /// (A serving account's manager is cut off at the deadline and reports
    /// what it abandoned there.)
    pub unfinished_accounts: Vec<AccountId>,
    /// The snapshot manager's counters at the end.
    pub snapshots: Option<SnapshotStats>,
    /// How long the shutdown took.
    pub elapsed: Duration,
}

impl RuntimeShutdownReport {
    /// Leases returned to the allocator during the shutdown, or found
    /// settled (or disowned) by it.
    #[must_use]
    pub fn released(&self) -> u64 {
        self.leases.iter().map(|(_, report)| report.released).sum()
    }

    /// Leases left to TTL reclaim: still held by a request at the deadline,
    /// left unanswered by the store, or withheld after an integrity fault.
    #[must_use]
    pub fn abandoned(&self) -> u64 {
        self.leases.iter().map(|(_, report)| report.abandoned).sum()
    }

    /// Usage events that could not be delivered.
    #[must_use]
    pub fn lost_events(&self) -> u64 {
        self.usage.as_ref().map_or(0, |usage| usage.lost)
    }

    /// Admitted requests whose handlers had not started when the usage
    /// writer gave up: their commits are refused, so they are charged
    /// nothing and their handlers do not run. A commit already under way
    /// as the writer gave up is the exception; see
    /// [`WriterReport::outstanding_permits`](crate::runtime::WriterReport::outstanding_permits).
    #[must_use]
    pub fn cut_off_requests(&self) -> u64 {
        self.usage
            .as_ref()
            .map_or(0, |usage| usage.outstanding_permits)
    }
}

impl InstanceRuntime {
    /// Validates `config` and starts every plane: the usage writer, the
    /// snapshot manager, the optional reclaimer, and the supervisor that
    /// runs one lease manager per account in use.
    ///
    /// # Errors
    ///
    /// The first rule `config` breaks, then
    /// [`InstanceRuntimeConfigError::SafetyMarginBelowClockStaleness`] (the
    /// one rule that needs the clock) and
    /// [`InstanceRuntimeConfigError::Randomness`].
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn spawn(
        source: Arc<dyn SnapshotSource>,
        allocator: Arc<dyn LeaseAllocator>,
        sink: Arc<dyn UsageSink>,
        clock: Arc<dyn Clock>,
        config: InstanceRuntimeConfig,
    ) -> Result<(InstanceRuntime, RuntimeHandle), InstanceRuntimeConfigError> {
        use InstanceRuntimeConfigError as E;
        config.validate()?;
        // I2: the margin closes a lease's window early enough that a clock
        // reading behind the true time still commits inside it, and the
        // charge then still reaches the store before the lease expires.
        let margin = Duration::try_from(config.leases.expiry_safety_margin).unwrap_or_default();
        let needed = config
            .usage_delivery()
            .and_then(|delivery| delivery.checked_add(clock.staleness_bound()));
        if needed.is_none_or(|needed| margin <= needed) {
            return Err(E::SafetyMarginBelowClockStaleness);
        }
        let ids = RequestIds::random().map_err(|_| E::Randomness)?;
        let registry = Arc::new(SlotRegistry::new(config.sharding));
        let map = Arc::new(
            ArcSwapSnapshotMap::new(config.snapshot_map, Arc::clone(&registry))
                .map_err(E::SnapshotMap)?,
        );
        let (recorder, writer) =
            UsageWriter::spawn(sink, Arc::clone(&clock), config.usage).map_err(E::Usage)?;
        let snapshots = SnapshotManager::spawn(
            source,
            Arc::clone(&map),
            Arc::clone(&clock),
            config.snapshots.clone(),
        )
        .map_err(E::Snapshots)?;
        let reclaimer = match &config.reclaimer {
            Some(reclaimer) => Some(
                Reclaimer::spawn(Arc::clone(&allocator), Arc::clone(&clock), *reclaimer)
                    .map_err(E::Reclaimer)?,
            ),
            None => None,
        };
        let bindings = snapshots.bindings();
        let shared = Arc::new(Shared {
            engine: AdmissionEngine::new(Arc::clone(&map), recorder, ids),
            snapshots_ready: snapshots.readiness(),
            bindings: bindings.clone(),
            registry,
            allocator,
            clock,
            config,
            admitting: AtomicBool::new(true),
            faulted: AtomicBool::new(false),
            shutdown: watch::Sender::new(false),
            restarts: AtomicU64::new(0),
            unrecovered: AtomicU64::new(0),
            planes: Mutex::new(Planes {
                writer: Some(writer),
                snapshots: Some(snapshots),
                reclaimer,
                accounts: BTreeMap::new(),
                retired: Some(LeaseStats::default()),
                departures: JoinSet::new(),
                departing: BTreeMap::new(),
                stopped: StoppedPlanes::default(),
            }),
        });
        let supervisor = tokio::spawn(supervise(Arc::clone(&shared), bindings));
        let handle = RuntimeHandle {
            shared: Arc::clone(&shared),
        };
        Ok((
            Self {
                shared,
                supervisor: Some(supervisor),
            },
            handle,
        ))
    }

    /// A handle for the serving side.
    #[must_use]
    pub fn handle(&self) -> RuntimeHandle {
        RuntimeHandle {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Stops the instance in order, inside one `shutdown_deadline` (I25):
    /// stop admitting and starting handlers (see
    /// [`RuntimeHandle::request_shutdown`]), drain usage, release leases. A
    /// lease still held by a
    /// request at its deadline is abandoned to TTL reclaim, never released.
    ///
    /// Dropping the returned future before it completes cuts the shutdown
    /// short where it stands: a usage drain under way goes on in the
    /// background to its own deadline, and the lease managers are aborted,
    /// their leases left to TTL reclaim.
    pub async fn shutdown(mut self) -> RuntimeShutdownReport {
        let started = Instant::now();
        let deadline = after(started, self.shared.config.shutdown_deadline);
        self.shared.begin_shutdown();
        if let Some(supervisor) = self.supervisor.take() {
            // The supervisor only starts and retires managers; it is told to
            // stop and given until the deadline.
            let _ = tokio::time::timeout_at(deadline, supervisor).await;
        }
        let Winding {
            writer,
            snapshots,
            reclaimer,
            managers,
            mut departures,
        } = self.shared.lock_planes().wind_down();
        // 1. Admission is closed (begin_shutdown). 2. Drain usage.
        let usage = match writer {
            Some(writer) => {
                let drain = self.shared.config.usage.shutdown_drain_deadline;
                writer.stop_at(after(Instant::now(), drain).min(deadline));
                let report = writer.shutdown().await;
                let stopped = &mut self.shared.lock_planes().stopped;
                stopped.writer = report.stats;
                stopped.draining_writer = None;
                Some(report)
            }
            None => None,
        };
        // 3. Release leases, every account at once, inside what is left,
        // while managers that left before shutdown finish theirs. Each
        // manager is cut off at the deadline itself and reports what it
        // abandoned then, so the join needs no deadline of its own.
        let mut releases = JoinSet::new();
        let mut unfinished: std::collections::BTreeSet<AccountId> =
            managers.iter().map(|(account, _, _)| *account).collect();
        for (account, manager, counted) in managers {
            releases.spawn(async move { (account, manager.shutdown_by(deadline).await, counted) });
        }
        let mut leases = Vec::new();
        while let Some(joined) = releases.join_next().await {
            if let Ok((account, report, counted)) = joined {
                unfinished.remove(&account);
                if report.faulted {
                    // I29: a fault found while returning leases counts as
                    // much as one found while serving.
                    self.shared.faulted.store(true, Ordering::Release);
                }
                if report.task_died {
                    // I29: a manager that died before the shutdown reached
                    // it left its grants to TTL reclaim, as one found dead
                    // while serving does.
                    bump(&self.shared.unrecovered, report.abandoned);
                }
                let mut planes = self.shared.lock_planes();
                planes.retired = planes
                    .retired
                    .and_then(|sum| sum.checked_add(&report.stats.since(&counted)));
                drop(planes);
                leases.push((account, report));
            }
        }
        while let Ok(Some(_)) = tokio::time::timeout_at(deadline, departures.join_next()).await {}
        departures.abort_all();
        unfinished.extend(self.shared.lock_planes().departing.keys());
        let unfinished_accounts: Vec<AccountId> = unfinished.into_iter().collect();
        if !unfinished_accounts.is_empty() {
            tracing::error!(
                accounts = ?unfinished_accounts,
                "shutdown deadline passed before these accounts' leases were returned; they settle at TTL reclaim"
            );
        }
        let snapshots = match snapshots {
            Some(manager) => {
                let stats = manager.shutdown().await.stats;
                let stopped = &mut self.shared.lock_planes().stopped;
                stopped.snapshots = stats;
                stopped.draining_snapshots = None;
                Some(stats)
            }
            None => None,
        };
        if let Some(reclaimer) = reclaimer {
            let stats = reclaimer.shutdown().await;
            let stopped = &mut self.shared.lock_planes().stopped;
            stopped.reclaimer = Some(stats);
            stopped.draining_reclaimer = None;
        }
        RuntimeShutdownReport {
            usage,
            leases,
            unfinished_accounts,
            snapshots,
            elapsed: started.elapsed(),
        }
    }
}

impl Drop for InstanceRuntime {
    fn drop(&mut self) {
        let Some(supervisor) = self.supervisor.take() else {
            return;
        };
        supervisor.abort();
        self.shared.begin_shutdown();
        let mut planes = self.shared.lock_planes();
        let planes = &mut *planes;
        let accounts: Vec<AccountId> = planes.accounts.keys().copied().collect();
        // What each plane counted stays in the totals a handle still
        // reports; the usage left undelivered is counted lost (I21), and
        // the leases left to TTL reclaim unrecovered (I29).
        for manager in planes.accounts.values().filter_map(|m| m.manager.as_ref()) {
            planes.retired = planes
                .retired
                .and_then(|sum| sum.checked_add(&manager.stats()));
            bump(&self.shared.unrecovered, manager.leases_held());
        }
        let stopped = &mut planes.stopped;
        if let Some(writer) = planes.writer.take() {
            stopped.writer = writer.abandon();
        }
        if let Some(snapshots) = &planes.snapshots {
            stopped.snapshots = snapshots.stats();
        }
        if let Some(reclaimer) = &planes.reclaimer {
            stopped.reclaimer = Some(reclaimer.stats());
        }
        // Dropping each plane's handle aborts its task.
        planes.accounts.clear();
        planes.departures.abort_all();
        planes.snapshots = None;
        planes.reclaimer = None;
        tracing::warn!(
            accounts = ?accounts,
            "instance runtime dropped without shutdown: queued usage is lost and held leases settle at TTL reclaim"
        );
    }
}

impl fmt::Debug for InstanceRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InstanceRuntime")
            .field("running", &self.supervisor.is_some())
            .finish_non_exhaustive()
    }
}

impl RuntimeHandle {
    /// Admits a request (see [`AdmissionEngine::begin`]), or denies it with
    /// [`DenyReason::ShuttingDown`] once shutdown has begun.
    ///
    /// # Errors
    ///
    /// Why the request was not admitted.
    #[inline]
    pub fn begin(
        &self,
        principal: Principal,
        required: PermissionBits,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<RequestContext, DenyReason> {
        if !self.shared.admitting.load(Ordering::Acquire) {
            return Err(self.shutting_down());
        }
        self.shared.engine.begin(principal, required, quote, now)
    }

    /// Admits a request by the hash of the API key it presented (see
    /// [`AdmissionEngine::begin_by_key`]), or denies it with
    /// [`DenyReason::ShuttingDown`] once shutdown has begun.
    ///
    /// # Errors
    ///
    /// Why the request was not admitted.
    #[inline]
    pub fn begin_by_key(
        &self,
        key: &KeyHash,
        required: PermissionBits,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<RequestContext, DenyReason> {
        if !self.shared.admitting.load(Ordering::Acquire) {
            return Err(self.shutting_down());
        }
        self.shared.engine.begin_by_key(key, required, quote, now)
    }

    /// [`begin_by_key`](Self::begin_by_key) leaving a denial uncounted:
    /// the caller tries again, and counts only its last answer.
    pub(crate) fn begin_by_key_uncounted(
        &self,
        key: &KeyHash,
        required: PermissionBits,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<RequestContext, DenyReason> {
        if !self.shared.admitting.load(Ordering::Acquire) {
            return Err(DenyReason::ShuttingDown);
        }
        self.shared
            .engine
            .begin_by_key_uncounted(key, required, quote, now)
    }

    /// A refusal decided before the engine runs, counted with the engine's
    /// so that it shows under its code in the metrics.
    #[cold]
    fn shutting_down(&self) -> DenyReason {
        self.shared
            .engine
            .counters()
            .denied(DenyReason::ShuttingDown);
        DenyReason::ShuttingDown
    }

    /// The admission engine, for its counters and snapshot map.
    #[must_use]
    pub fn engine(&self) -> &AdmissionEngine {
        &self.shared.engine
    }

    /// The usage recorder admission takes places from.
    #[must_use]
    pub fn recorder(&self) -> &UsageRecorder {
        self.shared.engine.recorder()
    }

    /// The admission counters.
    #[must_use]
    pub fn counters(&self) -> AdmissionStats {
        self.shared.engine.counters().read()
    }

    /// The clock the runtime reads.
    #[must_use]
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.shared.clock
    }

    /// Whether the instance should receive traffic: admission open, no
    /// fault, snapshots loaded and fresh, the usage writer running and not
    /// stuck behind a full queue (retrying a failing sink with every place
    /// holding an event it has not delivered), and every account a usable principal is bound to either funded by its
    /// live lease manager or known by the allocator's evidence to be out of
    /// funds (so it answers truthfully). An account kept only for its
    /// linger serves nobody, so its manager does not count.
    #[must_use]
    pub fn readiness(&self) -> bool {
        self.report().ready
    }

    /// Starts the shutdown from the serving side (for example, on a signal):
    /// admission closes at once, and so does every commit point: a request
    /// admitted earlier whose handler has not started is refused there
    /// ([`DenyReason::ShuttingDown`]) and charged nothing, so the handlers
    /// that run are the ones already running (I25). The owner's
    /// [`InstanceRuntime::shutdown`] performs the rest.
    pub fn request_shutdown(&self) {
        self.shared.begin_shutdown();
    }

    /// What this instance knows of `account`'s funds beyond its serving
    /// lease, in force at `now` (see [`LeaseSlot::funding_estimate`](crate::admission::LeaseSlot::funding_estimate)).
    #[must_use]
    pub fn funding(&self, account: AccountId, now: Timestamp) -> Option<BalanceShortfall> {
        self.shared.registry.get(account)?.funding_estimate(now)
    }

    /// A reading of every account this instance serves.
    #[must_use]
    pub fn account_reports(&self) -> Vec<AccountReport> {
        let now = self.shared.clock.now();
        self.account_reports_of(&self.shared.lock_planes(), now)
    }

    /// The account reports of `planes`, read under the caller's lock.
    fn account_reports_of(&self, planes: &Planes, now: Timestamp) -> Vec<AccountReport> {
        planes
            .accounts
            .iter()
            .map(|(account, managed)| {
                let slot = self.shared.registry.get(*account);
                // Read in place: an owned reference, held by a scrape, would
                // make the lease look busy to a fold deciding whether it is
                // quiet, and split the balance over a needless replacement.
                let (remaining, occupancy) = slot
                    .as_ref()
                    .and_then(|slot| {
                        slot.with_lease(|lease| {
                            lease.map(|lease| (lease.remaining(), lease.occupancy()))
                        })
                    })
                    .unzip();
                AccountReport {
                    account: *account,
                    health: managed.manager.as_ref().map(LeaseManager::health),
                    stats: managed
                        .manager
                        .as_ref()
                        .map(LeaseManager::stats)
                        .unwrap_or_default(),
                    remaining,
                    occupancy,
                    funding: slot.as_ref().and_then(|slot| slot.funding_estimate(now)),
                    contended_exchanges: slot.as_ref().map_or(0, |slot| slot.contended_exchanges()),
                }
            })
            .collect()
    }

    /// A reading of the whole instance.
    #[must_use]
    pub fn report(&self) -> RuntimeReport {
        let shared = &self.shared;
        let now = shared.clock.now();
        // Readiness first, then the bindings: the snapshot manager
        // publishes them the other way round, so bindings read after a
        // ready policy name every account it found. Both before the planes'
        // lock, which the supervisor takes after reading the bindings.
        let snapshots_ready = *shared.snapshots_ready.borrow();
        let bound = Arc::clone(&shared.bindings.borrow());
        let planes = shared.lock_planes();
        // Under the same lock as the retired totals below, so a manager
        // retired in between is counted once.
        let accounts = self.account_reports_of(&planes, now);
        let admitting = shared.admitting.load(Ordering::Acquire);
        let faulted = shared.faulted.load(Ordering::Acquire)
            || accounts
                .iter()
                .any(|account| account.health == Some(LeaseHealth::Faulted));
        // The counts first, then the health: read the other way round, a
        // retry that succeeds in between, its places refilled at once,
        // would read as a jammed queue behind a failing sink.
        let writer = planes
            .writer
            .as_ref()
            .map_or_else(|| planes.stopped.writer(), UsageWriter::stats);
        let writer_health = planes
            .writer
            .as_ref()
            .map_or_else(|| planes.stopped.writer_health(), UsageWriter::health);
        // I29: every account a usable principal is bound to counts from
        // the moment the policy names it, not from the supervisor's next
        // pass: until its manager has a lease, nothing funds its requests.
        let refill_grace = shared
            .clock
            .staleness_bound()
            .saturating_add(shared.config.leases.store_call_timeout);
        let refill_grace_start = SignedDuration::try_from(refill_grace)
            .ok()
            .and_then(|grace| now.checked_sub(grace).ok())
            .unwrap_or(Timestamp::MIN);
        let answers_for = |account: &AccountId| {
            let funded = planes
                .accounts
                .get(account)
                .and_then(|managed| managed.manager.as_ref())
                .is_some_and(|manager| *manager.readiness().borrow());
            // An account the allocator says has nothing left is answered
            // truthfully without a lease (402, balance exhausted, or a
            // transient answer while a parked lease may yet get units back).
            // Evidence of a smaller remainder is not enough: without a lease
            // every quote it could still fund is denied as unavailable.
            // Evidence whose period ended within `refill_grace` still
            // counts: its manager asks for a lease at the period end (once
            // its clock must show it), and the account is not unserved for
            // want of care while that one call is answered.
            let known_empty = shared
                .registry
                .get(*account)
                .and_then(|slot| slot.funding_estimate(refill_grace_start))
                .is_some_and(|evidence| evidence.remaining.is_zero());
            funded || known_empty
        };
        // Only accounts a usable principal is bound to: one kept for its
        // linger (its keys revoked, its account suspended) serves nobody,
        // and its lease may be refused for good.
        let mut unserved_count = 0;
        let mut unserved_accounts = Vec::new();
        for account in bound
            .usable_accounts()
            .filter(|account| !answers_for(account))
        {
            unserved_count += 1;
            if unserved_accounts.len() < UNSERVED_REPORTED {
                unserved_accounts.push(account);
            }
        }
        let accounts_ready = unserved_count == 0;
        // Every place holding an event the writer cannot deliver, its sink
        // failing: each admission is denied (503) until the sink answers.
        // Places merely reserved by requests in flight come back as they
        // end, so a busy queue is not counted, nor does readiness flicker
        // as they do.
        let undelivered = writer.queued.saturating_add(writer.in_flight);
        let backlogged = matches!(writer_health, WriterHealth::Retrying { .. })
            && undelivered >= shared.engine.recorder().capacity() as u64;
        let ready = admitting
            && !faulted
            && snapshots_ready
            && writer_health != WriterHealth::Stopped
            && !backlogged
            && accounts_ready;
        let leases = planes.retired.and_then(|retired| {
            accounts
                .iter()
                .try_fold(retired, |sum, account| sum.checked_add(&account.stats))
        });
        let hottest = hottest_accounts(
            accounts
                .iter()
                .map(|account| (account.account, account.contended_exchanges)),
        );
        RuntimeReport {
            ready,
            admitting,
            faulted,
            admission: shared.engine.counters().read(),
            writer,
            writer_health,
            snapshots: planes
                .snapshots
                .as_ref()
                .map_or_else(|| planes.stopped.snapshots(), SnapshotManager::stats),
            leases,
            reclaimer: planes
                .reclaimer
                .as_ref()
                .map(Reclaimer::stats)
                .or_else(|| planes.stopped.reclaimer()),
            accounts: planes.accounts.len(),
            manager_restarts: shared.restarts.load(Ordering::Relaxed),
            unrecovered_grants: shared.unrecovered.load(Ordering::Relaxed),
            hottest_accounts: hottest,
            unserved_count,
            unserved_accounts,
            usage_places_reserved: places_reserved(shared.engine.recorder()),
        }
    }
}

impl fmt::Debug for RuntimeHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuntimeHandle")
            .field("admitting", &self.shared.admitting.load(Ordering::Acquire))
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn begin_shutdown(&self) {
        // I25: stop admitting first, and starting handlers: a request
        // admitted before now but not yet started is refused at its commit
        // and charged nothing, rather than started where the shutdown may
        // cut it off after charging.
        self.admitting.store(false, Ordering::Release);
        self.engine.recorder().queue().stop_commits();
        // I36: a request waiting for a lease is refused now, not at the end
        // of its wait.
        self.registry.wake_lease_waits();
        self.shutdown.send_replace(true);
        // Requests still in flight hold their reservations; no new lease is
        // needed, and one being acquired when the release phase stops its
        // manager could be left to reclaim.
        self.lock_planes().hold_grants();
    }

    fn lock_planes(&self) -> MutexGuard<'_, Planes> {
        // Only handles and counters live here; a panic cannot leave them
        // half-updated in a way a reader could misuse.
        self.planes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One supervision pass: start managers for accounts in use, restart
    /// dead ones after the backoff, retire accounts idle past the linger.
    fn supervise_once(self: &Arc<Self>, bindings: &AccountBindings) {
        let now = self.clock.now();
        let instant = Instant::now();
        let linger = jiff::SignedDuration::try_from(self.config.account_linger)
            .unwrap_or(jiff::SignedDuration::MAX);
        let mut planes = self.lock_planes();
        // Checked under the lock shutdown and `Drop` take the managers
        // under: a pass that began before either must not start managers
        // after they have emptied the books, where nothing would stop them.
        if *self.shutdown.borrow() {
            return;
        }
        let planes = &mut *planes;
        // Out of service for good (faulted books, or a usage writer that
        // stopped, so no commit can be billed): no lease is worth taking
        // any more. Running managers stop acquiring, their serving leases
        // go back as their windows close, and the units return to the
        // balance the instances still in service draw on.
        let writer_stopped = planes
            .writer
            .as_ref()
            .is_some_and(|writer| writer.health() == WriterHealth::Stopped);
        let out_of_service = writer_stopped || self.faulted.load(Ordering::Acquire);
        if out_of_service {
            planes.hold_grants();
        }
        let mut known = std::collections::BTreeSet::new();
        for binding in bindings.accounts() {
            let account = binding.account;
            known.insert(account);
            // I29: an account keeps its lease while it has a usable principal,
            // and for a linger after its last one went away.
            let in_use = binding.usable || now.duration_since(binding.last_seen_usable) < linger;
            if in_use {
                // A manager still winding down (retired, or dead and
                // reporting) works on the account's slot: it takes the
                // serving lease out, so a new one must not install one
                // until it is done.
                let departing = planes.departing.contains_key(&account);
                let managed = planes.accounts.entry(account).or_insert(ManagedAccount {
                    manager: None,
                    restart_at: None,
                });
                let may_start = !departing && !out_of_service;
                if let Some(dead) = self.keep_running(account, managed, instant, may_start) {
                    self.depart(planes, account, dead, true);
                }
            } else if let Some(manager) = planes
                .accounts
                .remove(&account)
                .and_then(|managed| managed.manager)
            {
                self.depart(planes, account, manager, false);
            }
        }
        // Accounts the bindings no longer mention at all are retired too.
        let gone: Vec<AccountId> = planes
            .accounts
            .keys()
            .filter(|account| !known.contains(account))
            .copied()
            .collect();
        for account in gone {
            if let Some(manager) = planes
                .accounts
                .remove(&account)
                .and_then(|managed| managed.manager)
            {
                self.depart(planes, account, manager, false);
            }
        }
        // A fault booked during this pass holds every manager now, not a
        // pass later.
        if !out_of_service && self.faulted.load(Ordering::Acquire) {
            planes.hold_grants();
        }
        // Finished departures have reported through `departed`.
        while planes.departures.try_join_next().is_some() {}
    }

    /// Takes a lease manager off the books: retired with its idle account,
    /// or dead. What it has counted joins the retired totals at once, so
    /// they never drop. Its shutdown (returning the account's lease, or
    /// for a dead task reporting what it stranded) runs beside the
    /// supervisor, so one slow release holds up nothing else. The slot
    /// stays registered: published snapshots still point at it, and a
    /// returning account is served from it again.
    fn depart(
        self: &Arc<Self>,
        planes: &mut Planes,
        account: AccountId,
        manager: LeaseManager,
        died: bool,
    ) {
        if manager.is_faulted() {
            // I29: a fault found as the account leaves is booked now, not
            // only once its wind-down reports: readiness must not come
            // back meanwhile, nor another manager start on faulted books.
            self.faulted.store(true, Ordering::Release);
        }
        let counted = manager.stats();
        planes.retired = planes.retired.and_then(|sum| sum.checked_add(&counted));
        *planes.departing.entry(account).or_default() += 1;
        let shared = Arc::clone(self);
        planes.departures.spawn(async move {
            let report = manager.shutdown().await;
            shared.departed(account, &counted, &report, died);
        });
    }

    /// Books what a departed manager's shutdown added after it left.
    fn departed(
        &self,
        account: AccountId,
        counted: &LeaseStats,
        report: &LeaseManagerReport,
        died: bool,
    ) {
        if report.faulted {
            // I29: a fault found while the account was retiring counts as
            // much as one found while it served.
            self.faulted.store(true, Ordering::Release);
        }
        // A manager retired with its account may have died meanwhile.
        if died || report.task_died {
            // I29: the grants a dead task held settle at TTL reclaim.
            bump(&self.unrecovered, report.abandoned);
        } else {
            tracing::info!(%account, released = report.released, abandoned = report.abandoned, "retired idle account");
        }
        let mut planes = self.lock_planes();
        planes.retired = planes
            .retired
            .and_then(|sum| sum.checked_add(&report.stats.since(counted)));
        if let Some(running) = planes.departing.get_mut(&account) {
            *running -= 1;
            if *running == 0 {
                planes.departing.remove(&account);
            }
        }
    }

    /// Keeps `account`'s manager running: starts one, or restarts a dead
    /// one after the backoff, if `may_start` (no predecessor still winding
    /// down on the slot, and the instance in service). Returns a manager
    /// found dead, for the caller to take off the books.
    fn keep_running(
        &self,
        account: AccountId,
        managed: &mut ManagedAccount,
        now: Instant,
        may_start: bool,
    ) -> Option<LeaseManager> {
        if let Some(manager) = &managed.manager {
            // Whether it ended, read before whether it faulted: a task that
            // faults and then dies does both before it ends, so a manager
            // seen ended is also seen faulted if it was, and a faulted
            // manager whose task died is not restarted into spending on the
            // faulted books.
            let finished = manager.is_finished();
            if manager.is_faulted() {
                // I29: books that disagree with the store are no basis for
                // spending; the instance is taken out of service for good.
                self.faulted.store(true, Ordering::Release);
                return None;
            }
            if !finished {
                return None;
            }
            tracing::error!(%account, "lease manager died; restarting after backoff");
            managed.restart_at = Some(after(now, self.config.manager_restart_backoff));
            return managed.manager.take();
        }
        // I29: once any manager faulted, the instance is out of service for
        // good, and no manager starts again to spend on its books (nor
        // once its usage writer stopped, when nothing could be billed).
        if !may_start
            || managed.restart_at.is_some_and(|at| now < at)
            || self.faulted.load(Ordering::Acquire)
        {
            return None;
        }
        let slot = self.registry.ensure(account);
        match LeaseManager::spawn(
            Arc::clone(&self.allocator),
            slot,
            Arc::clone(&self.clock),
            self.config.leases.for_account(account),
        ) {
            Ok(started) => {
                if managed.restart_at.take().is_some() {
                    bump(&self.restarts, 1);
                }
                managed.manager = Some(started);
            }
            Err(error) => {
                // Validated at spawn; unreachable unless the config changed.
                tracing::error!(%account, %error, "lease manager refused its configuration");
                self.faulted.store(true, Ordering::Release);
            }
        }
        None
    }
}

/// How many accounts a report ranks by contention.
const HOTTEST_REPORTED: usize = 5;

/// How many unserved accounts a [`RuntimeReport`] names.
const UNSERVED_REPORTED: usize = 5;

/// The places permits hold (I20: free places, permits and undelivered
/// events add up to the capacity), read from the queue itself: a writer
/// that died no longer counts what it left undelivered as queued, though
/// those events still hold their places.
fn places_reserved(recorder: &UsageRecorder) -> u64 {
    let queue = recorder.queue();
    queue.in_use().saturating_sub(queue.undelivered()) as u64
}

/// The accounts whose debits lost the most races, hottest first, ties by
/// account id; accounts with none are left out. Sharding those accounts'
/// leases is what takes the heat off.
fn hottest_accounts(contention: impl Iterator<Item = (AccountId, u64)>) -> Vec<(AccountId, u64)> {
    let mut hottest: Vec<(AccountId, u64)> = contention.filter(|(_, lost)| *lost > 0).collect();
    hottest.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    hottest.truncate(HOTTEST_REPORTED);
    hottest
}

/// The supervisor task.
async fn supervise(shared: Arc<Shared>, mut bindings: watch::Receiver<Arc<AccountBindings>>) {
    let mut shutdown = shared.shutdown.subscribe();
    // Cleared once the snapshot manager is gone: supervision goes on, on
    // the interval, with the last bindings. Every wait stays raced against
    // shutdown, which waits for this task.
    let mut bindings_open = true;
    loop {
        if *shutdown.borrow() {
            return;
        }
        let current = Arc::clone(&bindings.borrow_and_update());
        shared.supervise_once(&current);
        tokio::select! {
            () = sleep(shared.config.supervisor_interval) => {}
            changed = bindings.changed(), if bindings_open => {
                bindings_open = changed.is_ok();
            }
            _ = shutdown.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_contention_ranking_lists_the_hottest_five_first() {
        let ranked = hottest_accounts(
            [
                (1, 5),
                (2, 0),
                (3, 90),
                (4, 5),
                (5, 12),
                (6, 7),
                (7, 1),
                (8, 3),
            ]
            .into_iter()
            .map(|(account, lost)| (AccountId(account), lost)),
        );
        assert_eq!(
            ranked,
            vec![
                (AccountId(3), 90),
                (AccountId(5), 12),
                (AccountId(6), 7),
                (AccountId(1), 5),
                (AccountId(4), 5),
            ]
        );
        assert!(hottest_accounts(std::iter::once((AccountId(9), 0))).is_empty());
    }
}
