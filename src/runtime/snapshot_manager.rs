//! The snapshot manager: the background task that keeps the snapshot map
//! current from a [`SnapshotSource`].
//!
//! # Refresh
//!
//! The first refresh runs as soon as the task starts; after a refresh that
//! succeeded the next one starts `refresh_interval` after it began, or when
//! it (and any lookup made meanwhile) ends, if that is later. What a
//! refresh reads depends on the [`PrincipalSelection`]:
//!
//! - `Fixed`: one `fetch` of the listed principals (plus any principal
//!   admission asked about that the source turned out to know, see below),
//!   bounded by `fetch_timeout`. What comes back is published; a principal
//!   asked for and not returned is marked unknown, which withdraws its
//!   snapshot. Then the map is marked verified as of the refresh.
//! - `All`: an incremental enumeration with `changed_since`, starting from
//!   [`SnapshotCursor::START`] and resuming from the last page's cursor, one
//!   page at a time, each bounded by `enumeration_timeout`. Pages are
//!   published in batches at least as large as the map (a first
//!   enumeration would otherwise copy the map once per page), except that a
//!   snapshot taking something away from a published principal (its key
//!   revoked or changed, its account suspended or changed, permissions or
//!   overage withdrawn) is published as its page arrives; the map is
//!   marked verified only once a page says the enumeration is complete,
//!   because only then has the source confirmed that nothing else changed.
//!
//! Revoked keys and suspended accounts are published as they are, so
//! admission denies them by name rather than as unknown.
//!
//! # Lookups
//!
//! Admission queues the principals it was asked about and found no snapshot
//! for. Every tick the manager drains that queue and fetches them (bounded by
//! `fetch_timeout`): found ones are published, the rest are marked unknown.
//! Under `Fixed`, a principal found this way is *adopted*: every later
//! refresh fetches it with the list, so marking the map verified never
//! vouches for a snapshot the refresh did not read. Only principals the
//! source knows are adopted, so they are bounded by the source's principals,
//! as the map is.
//!
//! A principal marked unknown is denied as unknown only while the source's
//! word is no older than the maximum staleness; then admission queues it
//! again and the next lookup renews or overturns that word (I24). A lookup
//! that times out is retried with half as many principals, doubling again
//! as lookups are answered, so a queue too long to fetch within
//! `fetch_timeout` still drains; principals left for a later batch are
//! asked at the retry backoff (with the refresh that every tick runs).
//!
//! # Failure
//!
//! A refresh whose answers go back in policy revision (I34) vouches for
//! nothing: the map keeps the newer snapshots and the refresh counts as a
//! failure. Under `Fixed` every refresh reads every principal again, so a
//! source that stays behind leaves the map to go stale. An enumeration
//! moves its cursor on past what it read, so only the refresh that read the
//! older answer fails; and a source restored to an earlier state is not
//! seen at all (its revisions are behind the cursor): restart the instances
//! after restoring a database.
//!
//! A call that fails or times out (I22) is counted and logged, and the next
//! tick comes `retry_backoff` after the failed one ended; after a success
//! the normal interval resumes. A failure never withdraws what was
//! published: the last good snapshots keep serving until the map's own
//! maximum staleness refuses them (I24).
//!
//! # Readiness and bindings
//!
//! Readiness turns true when a complete refresh first succeeds and false
//! again once no complete refresh has succeeded within `max_staleness`, by
//! which time the map refuses those snapshots as stale anyway. It is false
//! once the task ends, however it ends, and its channel closes then, so a
//! supervisor can tell a stopped manager from a quiet one.
//!
//! The manager keeps, as it publishes and withdraws, which accounts have a
//! usable principal (key and account both active) and when each was last
//! seen so, and lists them after every tick. It is the map's only writer:
//! its counts follow what it published, so a snapshot published or
//! withdrawn behind its back is not reflected until the principal is read
//! again. An account that lost its last usable principal stays listed, not
//! usable, with the time it was last seen usable, so a supervisor can
//! linger before retiring it; it is forgotten once its slot leaves the
//! registry.
//!
//! # Shutdown
//!
//! Every wait (a source call, the pause between ticks) is raced against
//! [`SnapshotManager::shutdown`], so shutdown returns promptly even while the
//! source hangs. Dropping the [`SnapshotManager`] instead aborts the task
//! and logs it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::error::Elapsed;
use tokio::time::{Instant, sleep_until, timeout};

use super::TIMER_RESOLUTION;
use super::{after, bump};
use crate::admission::ArcSwapSnapshotMap;
use crate::model::{
    AccountId, AccountStatus, CostUnits, KeyStatus, PolicyRevision, Principal, PrincipalSnapshot,
};
use crate::store::{Clock, SnapshotCursor, SnapshotSource, StoreError};

/// Which principals the snapshot manager keeps loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrincipalSelection {
    /// Exactly these principals, fetched in full on every refresh (in
    /// ascending order, each once). For instances that serve a known set of
    /// callers. Must not be empty.
    ///
    /// Principals outside the list are adopted only when admission asks
    /// about them by principal ([`AdmissionEngine::begin`]). The HTTP layer
    /// admits by key, which names no principal and adopts nothing: a key of
    /// a principal outside the list is answered as unknown.
    ///
    /// [`AdmissionEngine::begin`]: crate::admission::AdmissionEngine::begin
    Fixed(Vec<Principal>),
    /// Every principal the source knows, enumerated incrementally: the first
    /// refresh reads everything, later ones only what changed.
    All {
        /// The most principals asked for in one `changed_since` call. Must be
        /// positive.
        page_size: usize,
    },
}

/// How the snapshot manager refreshes and when it stops vouching for what it
/// published.
///
/// There is no `Default` (I17): these values decide how long a revoked key
/// keeps working and how long an outage is tolerated, so the caller states
/// every one, and [`validate`](Self::validate) checks them before the task
/// starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotManagerConfig {
    /// Which principals to keep loaded.
    pub principals: PrincipalSelection,
    /// The time from the start of one successful refresh to the start of the
    /// next, unless the refresh, or a lookup of principals admission asked
    /// about (a `Fixed` list), is still running then: the next starts when
    /// they end. With calls shorter than the interval and no lookups, the
    /// longest a change in the source takes to reach admission while the
    /// source is healthy. At least one millisecond, the timer's resolution.
    pub refresh_interval: Duration,
    /// The pause after a failed or timed-out call before the next attempt.
    /// At least one millisecond, the timer's resolution; it may be longer
    /// than `refresh_interval`.
    ///
    /// Snapshots age through the pause: for one failed refresh not to
    /// deny requests (`SnapshotStale`, readiness down), `max_staleness`
    /// should exceed `refresh_interval` plus the pause plus the timeouts
    /// of the calls made meanwhile: the failed refresh's and the retry's
    /// (one per page of an enumeration), and a lookup of principals not
    /// yet loaded between them. Not enforced, since a deployment may rather
    /// deny than retry sooner.
    pub retry_backoff: Duration,
    /// The bound on every `fetch` call (I22). At least one millisecond, the
    /// timer's resolution.
    pub fetch_timeout: Duration,
    /// The bound on every `changed_since` call (I22). At least one
    /// millisecond, the timer's resolution.
    pub enumeration_timeout: Duration,
    /// How long after the last successful refresh readiness stays true.
    /// Must exceed the longer of `refresh_interval` and the timeout of a
    /// refresh's call, plus that timeout, so that a healthy refresh that
    /// takes its whole timeout does not take the instance out of service;
    /// that is a minimum, and an enumeration of many pages, or lookups
    /// answered between refreshes (see `refresh_interval`), take longer; set
    /// it to the snapshot map's own `max_staleness`, the point where
    /// admission refuses the snapshots anyway.
    pub max_staleness: SignedDuration,
}

/// The first rule a [`SnapshotManagerConfig`] breaks, in field order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SnapshotManagerConfigError {
    /// `principals` is `Fixed` with an empty list.
    FixedPrincipalsEmpty,
    /// `principals` is `All` with a `page_size` of zero.
    PageSizeZero,
    /// `refresh_interval` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    RefreshIntervalBelowTimerResolution,
    /// `retry_backoff` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    RetryBackoffBelowTimerResolution,
    /// `fetch_timeout` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    FetchTimeoutBelowTimerResolution,
    /// `enumeration_timeout` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    EnumerationTimeoutBelowTimerResolution,
    /// `max_staleness` is not longer than `refresh_interval`.
    MaxStalenessNotAboveRefreshInterval,
    /// `max_staleness` is not longer than the longer of `refresh_interval`
    /// and the timeout of the call a refresh makes (`fetch_timeout` for a
    /// fixed list, `enumeration_timeout` for an enumeration), plus that
    /// timeout: a refresh vouches for the instant it started only once it
    /// ends, and one that outlasts the interval delays the next to its end,
    /// so a healthy one that takes its whole timeout would leave the
    /// snapshots stale in every interval.
    MaxStalenessNotAboveRefreshAndCall,
    /// `max_staleness` is longer than the snapshot map's (checked by
    /// [`SnapshotManager::spawn`]): readiness would outlive the snapshots
    /// admission accepts.
    MaxStalenessAboveMap,
}

impl SnapshotManagerConfig {
    /// Checks every rule, in field order.
    ///
    /// # Errors
    ///
    /// The first rule broken.
    pub fn validate(&self) -> Result<(), SnapshotManagerConfigError> {
        use SnapshotManagerConfigError as Broken;
        let (listed, paged) = match &self.principals {
            PrincipalSelection::Fixed(principals) => (!principals.is_empty(), true),
            PrincipalSelection::All { page_size } => (true, *page_size > 0),
        };
        // An interval too long to be a `SignedDuration` cannot be exceeded.
        let staleness_covers_a_refresh = SignedDuration::try_from(self.refresh_interval)
            .is_ok_and(|interval| self.max_staleness > interval);
        // The bound on the call a refresh makes under this plan.
        let refresh_call = match &self.principals {
            PrincipalSelection::Fixed(_) => self.fetch_timeout,
            PrincipalSelection::All { .. } => self.enumeration_timeout,
        };
        // A refresh that outlasts the interval delays the next one to its
        // end, so just before a verification the map's age is the longer of
        // the two plus the call.
        let staleness_covers_a_slow_refresh = self
            .refresh_interval
            .max(refresh_call)
            .checked_add(refresh_call)
            .and_then(|span| SignedDuration::try_from(span).ok())
            .is_some_and(|span| self.max_staleness > span);
        let rules = [
            (listed, Broken::FixedPrincipalsEmpty),
            (paged, Broken::PageSizeZero),
            (
                self.refresh_interval >= TIMER_RESOLUTION,
                Broken::RefreshIntervalBelowTimerResolution,
            ),
            (
                self.retry_backoff >= TIMER_RESOLUTION,
                Broken::RetryBackoffBelowTimerResolution,
            ),
            (
                self.fetch_timeout >= TIMER_RESOLUTION,
                Broken::FetchTimeoutBelowTimerResolution,
            ),
            (
                self.enumeration_timeout >= TIMER_RESOLUTION,
                Broken::EnumerationTimeoutBelowTimerResolution,
            ),
            (
                staleness_covers_a_refresh,
                Broken::MaxStalenessNotAboveRefreshInterval,
            ),
            (
                staleness_covers_a_slow_refresh,
                Broken::MaxStalenessNotAboveRefreshAndCall,
            ),
        ];
        rules
            .into_iter()
            .find_map(|(holds, broken)| (!holds).then_some(broken))
            .map_or(Ok(()), Err)
    }
}

impl fmt::Display for SnapshotManagerConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::FixedPrincipalsEmpty => {
                "snapshot manager: a fixed principal list must not be empty"
            }
            Self::PageSizeZero => "snapshot manager: page_size must be positive",
            Self::RefreshIntervalBelowTimerResolution => {
                "snapshot manager: refresh_interval must be at least one millisecond \
                 (the timer's resolution)"
            }
            Self::RetryBackoffBelowTimerResolution => {
                "snapshot manager: retry_backoff must be at least one millisecond \
                 (the timer's resolution)"
            }
            Self::FetchTimeoutBelowTimerResolution => {
                "snapshot manager: fetch_timeout must be at least one millisecond \
                 (the timer's resolution)"
            }
            Self::EnumerationTimeoutBelowTimerResolution => {
                "snapshot manager: enumeration_timeout must be at least one millisecond \
                 (the timer's resolution)"
            }
            Self::MaxStalenessNotAboveRefreshInterval => {
                "snapshot manager: max_staleness must exceed refresh_interval"
            }
            Self::MaxStalenessNotAboveRefreshAndCall => {
                "snapshot manager: max_staleness must exceed the longer of refresh_interval and \
                 the timeout of a refresh's call (fetch_timeout for a fixed list, \
                 enumeration_timeout for an enumeration), plus that timeout, since a refresh \
                 vouches only once it ends and a long one delays the next"
            }
            Self::MaxStalenessAboveMap => {
                "snapshot manager: max_staleness must not be longer than the snapshot map's \
                 (readiness would outlive the snapshots admission accepts)"
            }
        })
    }
}

impl std::error::Error for SnapshotManagerConfigError {}

/// The owner's handle on the snapshot manager task.
///
/// Keep it for the life of the instance and call
/// [`shutdown`](Self::shutdown) to stop; dropping it instead aborts the task
/// and logs it.
pub struct SnapshotManager {
    counters: Arc<SnapshotCounters>,
    readiness: watch::Receiver<bool>,
    bindings: watch::Receiver<Arc<AccountBindings>>,
    stop: watch::Sender<bool>,
    /// `None` only once `shutdown` or `drop` has taken it.
    task: Option<JoinHandle<()>>,
}

/// Which accounts have at least one usable principal (key active, account
/// active), and when each account was last seen so.
///
/// # Invariants
///
/// 1. Every listed account was usable at its `last_seen_usable` instant, by
///    the clock of the manager that published it.
/// 2. An account's `last_seen_usable` never moves backwards.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AccountBindings {
    accounts: BTreeMap<AccountId, AccountBinding>,
}

/// One account's entry in [`AccountBindings`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountBinding {
    /// The account.
    pub account: AccountId,
    /// Whether the account has a usable principal now.
    pub usable: bool,
    /// The last time a refresh (or a lookup) saw the account with a usable
    /// principal, by the manager's clock.
    pub last_seen_usable: Timestamp,
}

impl AccountBindings {
    /// Every listed account, usable or lingering, in ascending order.
    pub fn accounts(&self) -> impl Iterator<Item = AccountBinding> + '_ {
        self.accounts.values().copied()
    }

    /// The accounts that have a usable principal now, in ascending order.
    pub fn usable_accounts(&self) -> impl Iterator<Item = AccountId> + '_ {
        self.accounts
            .values()
            .filter(|binding| binding.usable)
            .map(|binding| binding.account)
    }

    /// The entry of `account`, if it is listed.
    #[must_use]
    pub fn get(&self, account: AccountId) -> Option<AccountBinding> {
        self.accounts.get(&account).copied()
    }

    /// When `account` was last seen with a usable principal, if ever (and
    /// not yet forgotten).
    #[must_use]
    pub fn last_seen(&self, account: AccountId) -> Option<Timestamp> {
        self.accounts
            .get(&account)
            .map(|binding| binding.last_seen_usable)
    }

    /// Whether `account` has a usable principal now.
    #[must_use]
    pub fn is_usable(&self, account: AccountId) -> bool {
        self.accounts
            .get(&account)
            .is_some_and(|binding| binding.usable)
    }

    /// How many accounts are listed.
    #[must_use]
    pub fn len(&self) -> usize {
        self.accounts.len()
    }

    /// Whether no account is listed.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.accounts.is_empty()
    }
}

/// What the snapshot manager has done so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SnapshotStats {
    /// Complete refreshes that vouched for the map: a fixed fetch, or an
    /// enumeration that reached its last page, with no answer older than
    /// what the map held (I34).
    pub refreshes: u64,
    /// Source calls that answered with an error (or, for an enumeration,
    /// with a page that made no progress), and complete refreshes that went
    /// back in revision.
    pub failures: u64,
    /// Source calls cut off by their timeout (I22).
    pub timeouts: u64,
    /// Snapshots handed to the map, including any it dropped as older than
    /// what it held.
    pub published: u64,
    /// Principals marked unknown: not returned by the source when asked for.
    pub unknown: u64,
    /// Principals fetched on admission's request, counted per attempt.
    pub lookups: u64,
    /// When the last complete refresh started, by the manager's clock.
    pub last_success: Option<Timestamp>,
}

/// The snapshot manager's counters, shared between the task (the only
/// writer) and whoever holds the handle. Each value is read on its own, so a
/// reading taken mid-refresh may be off by that refresh.
#[derive(Debug, Default)]
pub struct SnapshotCounters {
    refreshes: AtomicU64,
    failures: AtomicU64,
    timeouts: AtomicU64,
    published: AtomicU64,
    unknown: AtomicU64,
    lookups: AtomicU64,
    last_success: Mutex<Option<Timestamp>>,
}

impl SnapshotCounters {
    /// The counters as they stand now.
    pub fn read(&self) -> SnapshotStats {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        SnapshotStats {
            refreshes: read(&self.refreshes),
            failures: read(&self.failures),
            timeouts: read(&self.timeouts),
            published: read(&self.published),
            unknown: read(&self.unknown),
            lookups: read(&self.lookups),
            last_success: *self.last_success(),
        }
    }

    fn last_success(&self) -> MutexGuard<'_, Option<Timestamp>> {
        // A timestamp cannot be left half-written, so a poisoned lock still
        // holds a valid reading.
        self.last_success
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// What a shutdown found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotManagerReport {
    /// The final counters.
    pub stats: SnapshotStats,
    /// The task panicked or was aborted instead of stopping when told.
    pub task_died: bool,
}

impl SnapshotManager {
    /// Validates `config` and starts the manager on the current tokio
    /// runtime, publishing into `map`. The first refresh starts at once.
    ///
    /// # Errors
    ///
    /// The first rule `config` breaks, or
    /// [`SnapshotManagerConfigError::MaxStalenessAboveMap`]; nothing is
    /// started then.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn spawn(
        source: Arc<dyn SnapshotSource>,
        map: Arc<ArcSwapSnapshotMap>,
        clock: Arc<dyn Clock>,
        config: SnapshotManagerConfig,
    ) -> Result<Self, SnapshotManagerConfigError> {
        config.validate()?;
        if config.max_staleness > map.config().max_staleness {
            return Err(SnapshotManagerConfigError::MaxStalenessAboveMap);
        }
        let counters = Arc::new(SnapshotCounters::default());
        let (readiness_tx, readiness) = watch::channel(false);
        let (bindings_tx, bindings) = watch::channel(Arc::new(AccountBindings::default()));
        let (stop, stop_rx) = watch::channel(false);
        let plan = match &config.principals {
            PrincipalSelection::Fixed(principals) => Plan::Fixed {
                listed: principals.iter().copied().collect(),
                adopted: BTreeSet::new(),
            },
            PrincipalSelection::All { page_size } => Plan::All {
                page_size: *page_size,
                cursor: SnapshotCursor::START,
            },
        };
        let task = Task {
            source,
            lookup_capacity: map.config().lookup_queue_capacity,
            lookup_batch: map.config().lookup_queue_capacity,
            map,
            counters: Arc::clone(&counters),
            vigil: Vigil {
                stop: stop_rx,
                readiness: Readiness(readiness_tx),
                clock,
                max_staleness: config.max_staleness,
                last_success: None,
            },
            bindings: bindings_tx,
            config,
            plan,
            tracked: HashMap::new(),
            usable_accounts: HashMap::new(),
            pending_lookups: Vec::new(),
            verified_at: None,
            went_back: 0,
        };
        Ok(Self {
            counters,
            readiness,
            bindings,
            stop,
            task: Some(tokio::spawn(task.run())),
        })
    }

    /// A receiver of the manager's readiness: true while the last complete
    /// refresh is within `max_staleness`; false before the first one, after
    /// a lapse, and once the task has ended (its channel is closed then).
    pub fn readiness(&self) -> watch::Receiver<bool> {
        self.readiness.clone()
    }

    /// A receiver of the account bindings, updated after every tick that
    /// changed them.
    pub fn bindings(&self) -> watch::Receiver<Arc<AccountBindings>> {
        self.bindings.clone()
    }

    /// The counters as they stand now.
    pub fn stats(&self) -> SnapshotStats {
        self.counters.read()
    }

    /// The live counters, for a supervisor that outlives this handle's
    /// borrow.
    pub fn counters(&self) -> &Arc<SnapshotCounters> {
        &self.counters
    }

    /// Stops the manager, waits for the task to end, and reports what it
    /// did. Returns promptly: the task races every wait, including a hanging
    /// source call, against the stop.
    ///
    /// # Panics
    ///
    /// Never in practice: the task handle is present until this method or
    /// `drop` consumes the manager.
    pub async fn shutdown(mut self) -> SnapshotManagerReport {
        self.stop.send_replace(true);
        let task = self
            .task
            .take()
            .expect("the task handle is taken only by shutdown or drop, which consume the manager");
        let task_died = match task.await {
            Ok(()) => false,
            Err(error) => {
                tracing::error!(
                    %error,
                    "snapshot manager: the task died before it was stopped; \
                     the map was left as it last published it"
                );
                true
            }
        };
        SnapshotManagerReport {
            stats: self.stats(),
            task_died,
        }
    }
}

impl Drop for SnapshotManager {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        if !task.is_finished() {
            task.abort();
            tracing::warn!(
                "snapshot manager: handle dropped without shutdown; the task is aborted and \
                 the map will go stale"
            );
        }
    }
}

impl fmt::Debug for SnapshotManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SnapshotManager")
            .field("ready", &*self.readiness.borrow())
            .field("stats", &self.stats())
            .field(
                "running",
                &self.task.as_ref().is_some_and(|t| !t.is_finished()),
            )
            .finish_non_exhaustive()
    }
}

/// The task was told to stop (or its handle is gone).
struct Stopped;

/// Why a source call gave no answer.
enum Failure {
    Storage(StoreError),
    TimedOut(Duration),
    /// An enumeration page that is not the last but does not move the
    /// cursor forward: following it would loop forever.
    NoProgress(SnapshotCursor),
    /// The source answered for this many principals with revisions older
    /// than the map's (I34).
    WentBack(usize),
}

/// What a refresh reads, and where an enumeration stands.
enum Plan {
    Fixed {
        /// The configured principals.
        listed: BTreeSet<Principal>,
        /// Principals outside the list that admission asked about and the
        /// source knows; fetched with the list from then on.
        adopted: BTreeSet<Principal>,
    },
    All {
        page_size: usize,
        /// Where the next enumeration call starts: the last page's `next`.
        cursor: SnapshotCursor,
    },
}

/// The manager task.
///
/// # Invariants
///
/// 1. `tracked` holds every principal this task published and has not
///    withdrawn, with the account and usability the map holds for it; and
///    `usable_accounts` counts, per account, the tracked principals that
///    are usable, with the latest time one was seen so. Bindings are built
///    from the counts, so a tick costs the accounts, not the principals.
/// 2. `verified_at` is the start of the last complete refresh, and the map
///    was marked verified at that instant.
/// 3. `pending_lookups` holds at most `lookup_capacity` principals.
struct Task {
    source: Arc<dyn SnapshotSource>,
    map: Arc<ArcSwapSnapshotMap>,
    counters: Arc<SnapshotCounters>,
    vigil: Vigil,
    bindings: watch::Sender<Arc<AccountBindings>>,
    config: SnapshotManagerConfig,
    plan: Plan,
    tracked: HashMap<Principal, Tracked>,
    usable_accounts: HashMap<AccountId, UsableAccount>,
    pending_lookups: Vec<Principal>,
    lookup_capacity: usize,
    /// The most principals one lookup asks for: `lookup_capacity`, halved
    /// after each lookup that timed out and doubled (up to the capacity)
    /// after each that was answered, so a batch too large to answer within
    /// `fetch_timeout` does not fail for ever, and a source that recovers
    /// is soon asked for whole batches again.
    lookup_batch: usize,
    verified_at: Option<Timestamp>,
    /// Snapshots the map dropped during the current refresh because they
    /// were older than what it had published (I34).
    went_back: usize,
}

/// What the map holds for a tracked principal.
#[derive(Clone, Copy)]
struct Tracked {
    account: AccountId,
    usable: bool,
}

/// An account with at least one usable tracked principal.
struct UsableAccount {
    principals: usize,
    /// The latest time a usable principal of the account was fetched, or
    /// confirmed by a complete refresh.
    last_seen: Timestamp,
}

impl Task {
    async fn run(mut self) {
        // The only way out is a stop; readiness turns false when the vigil
        // is dropped with the task, however it ends.
        let Err(Stopped) = self.serve().await;
        tracing::debug!("snapshot manager: stopped");
    }

    async fn serve(&mut self) -> Result<std::convert::Infallible, Stopped> {
        loop {
            let began = Instant::now();
            let refreshed = self.refresh().await?;
            let looked_up = self.answer_lookups().await?;
            self.rebind();
            // The next refresh keeps its interval while refreshes succeed:
            // a failed lookup (whose principals are asked again) must not
            // put off the refresh that keeps every snapshot fresh.
            let next = if refreshed {
                let due = after(began, self.config.refresh_interval);
                if looked_up {
                    due
                } else {
                    due.min(after(Instant::now(), self.config.retry_backoff))
                }
            } else {
                after(Instant::now(), self.config.retry_backoff)
            };
            self.vigil.wait(sleep_until(next)).await?;
        }
    }

    /// One refresh; true when it completed.
    async fn refresh(&mut self) -> Result<bool, Stopped> {
        let now = self.vigil.clock.now();
        self.went_back = 0;
        let completed = match &self.plan {
            Plan::Fixed { .. } => self.refresh_fixed(now).await?,
            Plan::All { .. } => self.refresh_all(now).await?,
        };
        if !completed {
            return Ok(false);
        }
        // I34: a source that went back in revision cannot vouch for the map:
        // a lagging replica is behind what was published, and a restored
        // database disowns it.
        if self.went_back > 0 {
            self.note_failure("refresh", Failure::WentBack(self.went_back));
            return Ok(false);
        }
        self.verify(now);
        Ok(true)
    }

    async fn refresh_fixed(&mut self, now: Timestamp) -> Result<bool, Stopped> {
        let Plan::Fixed { listed, adopted } = &self.plan else {
            unreachable!("refresh_fixed runs only under a fixed plan");
        };
        let asked: Vec<Principal> = listed.union(adopted).copied().collect();
        let limit = self.config.fetch_timeout;
        let answer = self
            .vigil
            .wait(timeout(limit, self.source.fetch(&asked, now)))
            .await?;
        let mut snapshots = match judge(answer, limit) {
            Ok(snapshots) => snapshots,
            Err(failure) => {
                self.note_failure("refresh fetch", failure);
                return Ok(false);
            }
        };
        trusted_from_the_ask(&mut snapshots, now);
        let missing = self.publish_answer(&asked, snapshots, now);
        if let Plan::Fixed { adopted, .. } = &mut self.plan {
            adopted.retain(|principal| !missing.contains(principal));
        }
        Ok(true)
    }

    async fn refresh_all(&mut self, now: Timestamp) -> Result<bool, Stopped> {
        let Plan::All {
            page_size,
            mut cursor,
        } = self.plan
        else {
            unreachable!("refresh_all runs only under an enumeration plan");
        };
        let limit = self.config.enumeration_timeout;
        // Every publication copies the shards it changes, and a page of a
        // first enumeration changes nearly all of them, so pages are
        // published in batches at least as large as the map: a first
        // enumeration of N principals then copies O(N) entries in all, not
        // O(N²/page).
        let mut unpublished = Vec::new();
        loop {
            let answer = self
                .vigil
                .wait(timeout(
                    limit,
                    self.source.changed_since(cursor, page_size, now),
                ))
                .await?;
            let page = match judge(answer, limit) {
                Ok(page) if !page.complete && page.next <= cursor => {
                    Err(Failure::NoProgress(page.next))
                }
                other => other,
            };
            let mut page = match page {
                Ok(page) => page,
                Err(failure) => {
                    // What was read is published, and the cursor kept, so
                    // the next refresh resumes after it.
                    self.publish_through(&mut unpublished, page_size, cursor);
                    self.note_failure("enumeration", failure);
                    return Ok(false);
                }
            };
            // A change that takes something away is published with its
            // page, not held for the batch, so it reaches admission within a
            // refresh interval of the source's word (I23, I24). Only those
            // snapshots: a mass suspension must not copy the map per page.
            // The cursor moves only with the batch, so a refresh that fails
            // reads them again.
            trusted_from_the_ask(&mut page.snapshots, now);
            let (restricting, mut rest) = split_restrictions(&self.map, page.snapshots);
            if !restricting.is_empty() {
                // What a restriction supersedes is dropped wherever it is
                // held: from earlier pages, or from this one when a source
                // carries a principal twice in it.
                drop_superseded(&mut unpublished, &restricting);
                drop_superseded(&mut rest, &restricting);
                self.publish(restricting);
            }
            unpublished.extend(rest);
            cursor = page.next;
            if page.complete {
                self.publish_through(&mut unpublished, page_size, cursor);
                return Ok(true);
            }
            if unpublished.len() >= self.map.len().max(page_size) {
                self.publish_through(&mut unpublished, page_size, cursor);
            }
            // A long enumeration shares the runtime.
            tokio::task::yield_now().await;
        }
    }

    /// Publishes the snapshots read so far and keeps the cursor after them.
    fn publish_through(
        &mut self,
        unpublished: &mut Vec<PrincipalSnapshot>,
        page_size: usize,
        cursor: SnapshotCursor,
    ) {
        self.publish(std::mem::take(unpublished));
        self.plan = Plan::All { page_size, cursor };
    }

    /// Fetches the principals admission asked about; true when none is left
    /// waiting: false when the fetch failed (its principals are kept for
    /// the next tick) or left some for a later batch.
    async fn answer_lookups(&mut self) -> Result<bool, Stopped> {
        self.map.drain_lookups(&mut self.pending_lookups);
        self.pending_lookups.sort_unstable();
        self.pending_lookups.dedup();
        let now = self.vigil.clock.now();
        let map = &self.map;
        // A principal published since it was queued, or found unknown on
        // the source's recent word, needs no lookup; one whose record has
        // aged out is asked about again (I24).
        self.pending_lookups.retain(|principal| {
            map.get(*principal).is_none() && !map.is_unknown_at(*principal, now)
        });
        if self.pending_lookups.is_empty() {
            return Ok(true);
        }
        // Invariant 3: admission queues a principal again when it asks about
        // it again, so what is cut here is not lost for good.
        self.pending_lookups.truncate(self.lookup_capacity);
        let rest = self
            .pending_lookups
            .split_off(self.lookup_batch.min(self.pending_lookups.len()));
        let asked = std::mem::replace(&mut self.pending_lookups, rest);
        bump(&self.counters.lookups, asked.len() as u64);
        let limit = self.config.fetch_timeout;
        let answer = self
            .vigil
            .wait(timeout(limit, self.source.fetch(&asked, now)))
            .await?;
        match judge(answer, limit) {
            Ok(mut snapshots) => {
                trusted_from_the_ask(&mut snapshots, now);
                if let Plan::Fixed { listed, adopted } = &mut self.plan {
                    // Adopted principals are fetched with every refresh, so
                    // marking the map verified never vouches for one the
                    // refresh did not read. `asked` is sorted, so a lookup
                    // answer of N is adopted in N log N, not N².
                    adopted.extend(
                        snapshots
                            .iter()
                            .map(|snapshot| snapshot.principal)
                            .filter(|principal| asked.binary_search(principal).is_ok())
                            .filter(|principal| !listed.contains(principal)),
                    );
                }
                self.publish_answer(&asked, snapshots, now);
                self.lookup_batch = self
                    .lookup_batch
                    .saturating_mul(2)
                    .min(self.lookup_capacity);
                // Principals left for a later batch are asked at the retry
                // cadence, not a whole refresh interval later.
                Ok(self.pending_lookups.is_empty())
            }
            Err(failure) => {
                if matches!(failure, Failure::TimedOut(_)) {
                    self.lookup_batch = (self.lookup_batch / 2).max(1);
                }
                self.note_failure("lookup fetch", failure);
                let rest = std::mem::replace(&mut self.pending_lookups, asked);
                self.pending_lookups.extend(rest);
                Ok(false)
            }
        }
    }

    /// Publishes a fetch's answer and withdraws the principals asked for
    /// that it left out, which it returns.
    fn publish_answer(
        &mut self,
        asked: &[Principal],
        mut snapshots: Vec<PrincipalSnapshot>,
        now: Timestamp,
    ) -> HashSet<Principal> {
        // A principal the source volunteered was not asked for, so no later
        // refresh reads it; published, it would stay vouched for by every
        // refresh whatever became of it (I24).
        let before = snapshots.len();
        let asked_set: HashSet<Principal> = asked.iter().copied().collect();
        snapshots.retain(|snapshot| asked_set.contains(&snapshot.principal));
        if snapshots.len() < before {
            tracing::warn!(
                unasked = before - snapshots.len(),
                "snapshot manager: the source answered for principals it was not asked \
                 for; ignored"
            );
        }
        let returned: HashSet<Principal> = snapshots
            .iter()
            .map(|snapshot| snapshot.principal)
            .collect();
        self.publish(snapshots);
        let missing: HashSet<Principal> = asked
            .iter()
            .copied()
            .filter(|principal| !returned.contains(principal))
            .collect();
        self.withdraw(&missing, now);
        missing
    }

    fn publish(&mut self, snapshots: Vec<PrincipalSnapshot>) {
        if snapshots.is_empty() {
            return;
        }
        bump(&self.counters.published, snapshots.len() as u64);
        let principals: Vec<Principal> = snapshots.iter().map(|s| s.principal).collect();
        // Revoked keys and suspended accounts are published as they are:
        // admission denies them by name (I23).
        self.went_back += self.map.publish(snapshots);
        // What the map holds now, which is not what was offered where it
        // kept a newer revision (I34).
        let held = self.map.snapshots();
        for principal in principals {
            let now_held = held.get(principal).map(|snapshot| {
                let seen = self
                    .verified_at
                    .map_or(snapshot.fetched_at, |v| v.max(snapshot.fetched_at));
                (
                    Tracked {
                        account: snapshot.account_id,
                        usable: usable(snapshot),
                    },
                    seen,
                )
            });
            self.retrack(principal, now_held);
        }
    }

    /// Records what the map now holds for `principal` (`None`: nothing),
    /// moving it between the usable counts.
    fn retrack(&mut self, principal: Principal, held: Option<(Tracked, Timestamp)>) {
        let before = match held {
            Some((tracked, _)) => self.tracked.insert(principal, tracked),
            None => self.tracked.remove(&principal),
        };
        if let Some(before) = before.filter(|before| before.usable)
            && let Some(account) = self.usable_accounts.get_mut(&before.account)
        {
            account.principals -= 1;
            if account.principals == 0 {
                self.usable_accounts.remove(&before.account);
            }
        }
        if let Some((tracked, seen)) = held.filter(|(tracked, _)| tracked.usable) {
            let account = self
                .usable_accounts
                .entry(tracked.account)
                .or_insert(UsableAccount {
                    principals: 0,
                    last_seen: seen,
                });
            account.principals += 1;
            account.last_seen = account.last_seen.max(seen);
        }
    }

    /// Withdraws the principals a fetch issued at `now` left out.
    fn withdraw(&mut self, principals: &HashSet<Principal>, now: Timestamp) {
        for principal in principals {
            self.retrack(*principal, None);
        }
        // A principal remembered as unknown on the source's recent word is
        // not marked again, so a refresh that learns nothing new leaves the
        // map's generation alone; one whose record would age out before the
        // next refresh could renew it is marked again now, so a listed
        // principal the source keeps disowning stays unknown without a gap
        // (I24). `unknown` counts what the source newly disowned.
        // The next refresh starts a refresh interval after this one, or
        // once this tick's fetch and lookup have each run to their timeout,
        // and answers within one more.
        let fetch = self.config.fetch_timeout;
        let next_refresh = self
            .config
            .refresh_interval
            .max(fetch.saturating_mul(2))
            .saturating_add(fetch);
        let renew_by = SignedDuration::try_from(next_refresh)
            .ok()
            .and_then(|ahead| now.checked_add(ahead).ok())
            .unwrap_or(Timestamp::MAX);
        let map = &self.map;
        let mut newly = 0;
        let marked: Vec<Principal> = principals
            .iter()
            .copied()
            .filter(|principal| !map.is_unknown_at(*principal, renew_by))
            .inspect(|principal| newly += usize::from(!map.is_known_unknown(*principal)))
            .collect();
        if marked.is_empty() {
            return;
        }
        bump(&self.counters.unknown, newly as u64);
        if newly > 0 {
            tracing::debug!(
                count = newly,
                "snapshot manager: principals the source does not know are now denied as unknown"
            );
        }
        self.map.mark_unknown(marked, now);
    }

    /// Records a complete refresh that started at `now`.
    fn verify(&mut self, now: Timestamp) {
        // I24: the staleness of every published snapshot is measured from
        // here, which is honest because the refresh just read every one of
        // them (fixed) or confirmed that none else changed (enumeration).
        self.map.mark_verified(now);
        let verified_at = self.verified_at.map_or(now, |before| before.max(now));
        self.verified_at = Some(verified_at);
        // Every usable principal is confirmed as of the refresh.
        for account in self.usable_accounts.values_mut() {
            account.last_seen = account.last_seen.max(verified_at);
        }
        bump(&self.counters.refreshes, 1);
        *self.counters.last_success() = Some(now);
        // I29: the accounts this refresh found go out before readiness
        // does, so whoever sees the manager ready also sees every account
        // the instance must fund.
        self.rebind();
        let recovered = self.vigil.succeeded(now);
        if recovered {
            tracing::info!(%now, "snapshot manager: a complete refresh succeeded; ready");
        }
    }

    fn note_failure(&self, call: &'static str, failure: Failure) {
        match failure {
            Failure::Storage(error) => {
                bump(&self.counters.failures, 1);
                tracing::warn!(
                    call,
                    %error,
                    retry_in = ?self.config.retry_backoff,
                    "snapshot manager: the source failed; keeping the last snapshots"
                );
            }
            Failure::NoProgress(next) => {
                bump(&self.counters.failures, 1);
                tracing::error!(
                    call,
                    next = next.0,
                    "snapshot manager: the source returned an incomplete page that does not \
                     advance the cursor; keeping the last snapshots"
                );
            }
            Failure::WentBack(stale) => {
                bump(&self.counters.failures, 1);
                tracing::error!(
                    call,
                    stale,
                    "snapshot manager: the source answered with policy revisions older than \
                     the ones published (a lagging replica, or a restored database); the \
                     refresh does not vouch for the map, which goes stale unless the source \
                     catches up. After restoring the database, restart the instances"
                );
            }
            Failure::TimedOut(limit) => {
                // I22: a call that ran past its bound is abandoned.
                bump(&self.counters.timeouts, 1);
                tracing::warn!(
                    call,
                    timeout = ?limit,
                    retry_in = ?self.config.retry_backoff,
                    "snapshot manager: the source timed out; keeping the last snapshots"
                );
            }
        }
    }

    /// Recomputes the account bindings from the map and publishes them if
    /// they changed.
    fn rebind(&mut self) {
        // A snapshot is as recent as its fetch, or the last complete
        // refresh that confirmed it, whichever is later: `last_seen` keeps
        // the latest of those over the account's usable principals.
        let previous = Arc::clone(&self.bindings.borrow());
        let mut accounts: BTreeMap<AccountId, AccountBinding> = self
            .usable_accounts
            .iter()
            .map(|(account, usable)| (*account, usable.last_seen))
            .map(|(account, at)| {
                // Invariant 2: never backwards, even if the clock is.
                let last_seen_usable = previous.last_seen(account).map_or(at, |p| p.max(at));
                let binding = AccountBinding {
                    account,
                    usable: true,
                    last_seen_usable,
                };
                (account, binding)
            })
            .collect();
        let registry = self.map.registry();
        for binding in previous.accounts() {
            // An account that lost its usable principals lingers, with the
            // time it was last seen usable, until its slot is retired.
            if !accounts.contains_key(&binding.account) && registry.get(binding.account).is_some() {
                let lingering = AccountBinding {
                    usable: false,
                    ..binding
                };
                accounts.insert(binding.account, lingering);
            }
        }
        let next = AccountBindings { accounts };
        self.bindings.send_if_modified(|current| {
            if **current == next {
                return false;
            }
            *current = Arc::new(next);
            true
        });
    }
}

/// The part of the task that every wait goes through: it answers a stop at
/// once and keeps readiness honest while the task waits.
struct Vigil {
    stop: watch::Receiver<bool>,
    readiness: Readiness,
    clock: Arc<dyn Clock>,
    max_staleness: SignedDuration,
    last_success: Option<Timestamp>,
}

impl Vigil {
    /// Runs `work` unless a stop comes first, withdrawing readiness the
    /// moment the last success grows older than `max_staleness` meanwhile.
    async fn wait<F: Future>(&mut self, work: F) -> Result<F::Output, Stopped> {
        let mut work = std::pin::pin!(work);
        loop {
            self.judge();
            let lapse_at = self.lapse_in().map(|wait| after(Instant::now(), wait));
            tokio::select! {
                biased;
                () = stop_requested(&mut self.stop) => return Err(Stopped),
                output = &mut work => return Ok(output),
                () = sleep_until(lapse_at.unwrap_or_else(Instant::now)), if lapse_at.is_some() => {}
            }
        }
    }

    /// Records a complete refresh; true when it made the manager ready.
    fn succeeded(&mut self, now: Timestamp) -> bool {
        self.last_success = Some(self.last_success.map_or(now, |before| before.max(now)));
        let was_ready = *self.readiness.0.borrow();
        self.judge();
        !was_ready && *self.readiness.0.borrow()
    }

    /// Sets readiness from the clock: ready while the last success is at
    /// most `max_staleness` old, as the map judges its snapshots (I24).
    fn judge(&self) {
        let now = self.clock.now();
        let ready = self
            .last_success
            .is_some_and(|at| now.duration_since(at) <= self.max_staleness);
        let changed = self.readiness.0.send_if_modified(|current| {
            let changed = *current != ready;
            *current = ready;
            changed
        });
        if changed && !ready {
            tracing::warn!(
                last_success = ?self.last_success,
                max_staleness = %self.max_staleness,
                "snapshot manager: no complete refresh within max_staleness; not ready"
            );
        }
    }

    /// While ready, how long until readiness lapses by the clock, with a
    /// floor so that a clock standing at the edge does not make the task
    /// spin.
    fn lapse_in(&self) -> Option<Duration> {
        const RECHECK_FLOOR: Duration = Duration::from_millis(1);
        if !*self.readiness.0.borrow() {
            return None;
        }
        let at = self.last_success?;
        // Checked: a maximum staleness near `SignedDuration::MAX` and a
        // clock stepped back would overflow; that is no lapse at all.
        let left = self
            .max_staleness
            .checked_sub(self.clock.now().duration_since(at))
            .unwrap_or(SignedDuration::MAX);
        let left = Duration::try_from(left).unwrap_or(Duration::ZERO);
        Some(left.max(RECHECK_FLOOR))
    }
}

/// The task's end of the readiness channel. However the task ends
/// (stopped, panicked or aborted) this is dropped with it, saying not ready
/// and closing the channel.
struct Readiness(watch::Sender<bool>);

impl Drop for Readiness {
    fn drop(&mut self) {
        self.0.send_replace(false);
    }
}

/// Whether a snapshot lets its account spend.
fn usable(snapshot: &PrincipalSnapshot) -> bool {
    snapshot.key_status == KeyStatus::Active && snapshot.account_status == AccountStatus::Active
}

/// Sorts a bounded call's outcome into an answer or a failure.
fn judge<T>(answer: Result<Result<T, StoreError>, Elapsed>, limit: Duration) -> Result<T, Failure> {
    match answer {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(Failure::Storage(error)),
        Err(_) => Err(Failure::TimedOut(limit)),
    }
}

/// Resolves once a stop is requested, or the handle that could request one
/// is gone.
async fn stop_requested(stop: &mut watch::Receiver<bool>) {
    // An error means the sender is gone: nobody can stop the task any more,
    // so it stops now rather than run unowned.
    let _ = stop.wait_for(|stopping| *stopping).await;
}

/// I24: a snapshot is trusted from when this instance asked for it, never
/// from later. A source that stamps `fetched_at` by its own clock, running
/// ahead of this instance's, would otherwise keep a snapshot fresh (and a
/// key revoked meanwhile admitted) for that lead beyond `max_staleness`
/// once the source went quiet. A stamp at or before the ask is kept.
fn trusted_from_the_ask(snapshots: &mut [PrincipalSnapshot], asked_at: Timestamp) {
    let mut ahead = 0_usize;
    for snapshot in snapshots
        .iter_mut()
        .filter(|snapshot| snapshot.fetched_at > asked_at)
    {
        snapshot.fetched_at = asked_at;
        ahead += 1;
    }
    if ahead > 0 {
        tracing::debug!(
            ahead,
            "snapshot manager: snapshots stamped after the ask are trusted from the ask"
        );
    }
}

/// Drops the held snapshots that `restricting`, published ahead of them in
/// the same enumeration, supersedes: a principal that changed between two
/// pages is read in both, and publishing its older snapshot after the newer
/// one would be refused as the source going back (I34), failing a refresh
/// that read nothing wrong.
fn drop_superseded(held: &mut Vec<PrincipalSnapshot>, restricting: &[PrincipalSnapshot]) {
    let mut newest: HashMap<Principal, PolicyRevision> = HashMap::new();
    for snapshot in restricting {
        let revision = newest
            .entry(snapshot.principal)
            .or_insert(snapshot.policy_revision);
        *revision = (*revision).max(snapshot.policy_revision);
    }
    held.retain(|snapshot| {
        newest
            .get(&snapshot.principal)
            .is_none_or(|&newer| snapshot.policy_revision > newer)
    });
}

/// Splits `snapshots` into those that take away something `map` now
/// allows, and the rest (see [`restricts`]).
fn split_restrictions(
    map: &ArcSwapSnapshotMap,
    snapshots: Vec<PrincipalSnapshot>,
) -> (Vec<PrincipalSnapshot>, Vec<PrincipalSnapshot>) {
    let current = map.snapshots();
    snapshots.into_iter().partition(|snapshot| {
        current
            .get(snapshot.principal)
            .is_some_and(|published| restricts(published, snapshot))
    })
}

/// Whether `next` allows less than `published`: its key revoked or
/// changed, its account suspended or changed, permissions withdrawn, or
/// less (or no) overage.
fn restricts(published: &PrincipalSnapshot, next: &PrincipalSnapshot) -> bool {
    let cap = |snapshot: &PrincipalSnapshot| snapshot.mode.overage_cap().unwrap_or(CostUnits::ZERO);
    (next.key_status == KeyStatus::Revoked && published.key_status != KeyStatus::Revoked)
        || (next.account_status == AccountStatus::Suspended
            && published.account_status != AccountStatus::Suspended)
        || !next.permissions.contains(published.permissions)
        || cap(next) < cap(published)
        || (published.key_hash.is_some() && next.key_hash != published.key_hash)
        || next.account_id != published.account_id
}
