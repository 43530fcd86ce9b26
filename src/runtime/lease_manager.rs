//! The lease manager: one background task per account that keeps the
//! account's [`LeaseSlot`] stocked with a lease from the [`LeaseAllocator`],
//! and hands back what it no longer needs.
//!
//! The request path spends the slot's lease with atomics and never talks to
//! the store (I5). Everything that does talk to the store on the account's
//! behalf happens here, off the request path.
//!
//! # When the task looks at the slot
//!
//! Right after [`LeaseManager::spawn`], then whenever a lease rings its
//! doorbell, and otherwise every `poll_interval`. A lease rings when a debit
//! leaves it at or below its low-water mark, or when it refuses a debit for
//! want of units (I7); the doorbell is a flag and a waker, so ringing it is
//! two atomic operations on the request path (I28). The poll is the backstop
//! for what no debit announces: a cold start with no lease, a lease reaching
//! the end of its usability window (replaced a little earlier than it must
//! be, by a share of its window its id decides, so leases granted together
//! are not all renewed together), and an attempt that failed and must be
//! made again. A lease whose window would close before the next poll gets up
//! to two wake-ups of its own: one store call before the close, to replace
//! it, and at the close, to retire it, so the account is not left unserved,
//! nor reported ready, until the poll. A grant usable for no longer than one
//! store call (an allocator `max_ttl` barely above the margin) gets neither:
//! it is replaced at polls and rings, as a misconfiguration the task warns
//! about, rather than churned once per window. An account with no lease
//! whose balance is spent until a period end, when its refill brings more,
//! gets a wake-up then: nothing rings for an empty slot, and its clients
//! were told to retry at that moment.
//!
//! # One inspection
//!
//! 1. A lease in the slot whose usability window has closed is taken out and
//!    parked. The allocator may still hold it open (its window closes
//!    `expiry_safety_margin` before `expires_at`), so its remainder can still
//!    go back to the balance.
//! 2. A *release pass* over the parked leases returns those that have gone
//!    quiet.
//! 3. The slot is examined. Empty: acquire a lease. Serving and above low
//!    water: nothing. At or below low water: acquire a replacement while the
//!    old lease keeps serving, install it, park the old one. (A grant no
//!    larger than its mark, the tail of a balance, has a mark of zero: it
//!    is replaced once drained, and requests meet the round trip.) The lease refused
//!    a quote: *consolidate* it, or, if its window is about to close,
//!    replace it with one large enough for the quote. A fold the store
//!    would refuse (the quote needs units a parked lease still holds) waits
//!    until they are back in the balance. The lease refused a quote only
//!    because the allocator's last word ruled it out: that word may be out
//!    of date, so once per spell of such refusals, with the lease quiet and
//!    the store answering, it is folded for the quote anyway; the store
//!    either funds it now or refuses, and the lease goes back to serving
//!    with the evidence brought up to date. Where the store shares tails
//!    between instances, a lease from a short balance that served nothing
//!    through its window is let lapse, not replaced, so another instance
//!    can fold its units; the slot then stays *idle*, acquiring only when
//!    a request asks (two polls later if the lease refused quotes). An
//!    empty slot of a spent account that no request wanted for a lease's
//!    life is asked about once a lease's life instead of at every poll.
//!
//! # Parked leases and quiescence
//!
//! A lease taken out of the slot may still be held by requests that
//! reserved on it a moment earlier. Its remaining count is final only once it
//! is *quiescent*: the manager holds the only `Arc` to it and no debit holds a
//! view of any of its shards (I6, I26). Only then is it released, claiming
//! exactly `remaining()` as unspent; releasing earlier could credit units that
//! a running request then commits, and the store would refuse that request's
//! usage event because the lease is settled (I15).
//!
//! # Consolidation
//!
//! A lease that refused a quote the account might fund is folded, in one
//! allocator call, into a new grant of at least that quote (I18, I27); from
//! then on the account's leases are sized and marked for the largest such
//! quote, so they stop refusing it (see [`Task::sizing`]). Folding needs an
//! exact unspent count, so the lease is taken out of the slot and tested
//! for quiescence. If a reservation is still in flight, or a committed
//! charge's event is still on its way (under steady traffic one always is),
//! it goes straight back and a replacement large enough for the quote is
//! acquired beside it instead, unless the allocator's last word rules the
//! quote out, or an earlier replacement for it came back short; the old
//! lease is released once quiescent, like any replaced one. The replacement
//! is asked for with the quote as its floor
//! ([`LeaseAllocator::acquire_at_least`]): a balance short of it is refused
//! with the allocator's word on the balance, which rules the quote out,
//! rather than granted short, which would move as much of the balance as
//! was asked for onto this instance for a quote it still cannot fund.
//! Otherwise (the lease is quiescent, and folded) the account's requests
//! are denied for the length of that one call. The answer decides where the
//! old lease goes: a grant settles it (it is dropped); a domain refusal
//! rolled back (it returns to the slot); a lease the store no longer holds
//! for us is dropped; an answer that never came may or may not have
//! committed, so the lease is parked and the release pass finds out which.
//!
//! # Release refusals
//!
//! Each refusal means something different (I26):
//!
//! - unknown lease or not active: someone settled it already (an earlier
//!   release whose answer was lost, or TTL reclaim); it is dropped;
//! - fenced: the store does not recognise the capability this instance holds
//!   for the lease, so the instance's idea of its own leases is in doubt. The
//!   lease is dropped, and the serving lease is taken out of the slot and
//!   parked (never dropped: it may well still be ours, and its units must go
//!   back) until a fresh grant replaces it;
//! - storage error or timeout: unknown outcome; the lease stays parked and is
//!   released again on the next pass (a second release of a lease that was in
//!   fact settled is answered "not active" and dropped);
//! - a balance overflow: the balance has no room for the unspent units now
//!   (a top-up or refill filled it while they were out); the lease stays
//!   parked and is released again on the next pass;
//! - anything else (an invalid release), or a release credited with another
//!   amount than claimed: the store and this instance disagree about the
//!   books. That is an *integrity fault*:
//!   readiness is withdrawn for good, the slot is emptied and no further lease
//!   is acquired, and the lease is kept on the books but never claimed again;
//!   at shutdown it is reported abandoned and settles at TTL reclaim.
//!
//! # Time limits
//!
//! Every allocator call is cut off after `store_call_timeout` (I22). An
//! acquire or fold without an answer (cut off, or a storage error) may
//! have left a grant nobody holds until reclaim, so from the second such
//! call in a row acquires and folds back off: one poll, then two, four and
//! eight, back to the usual cadence at the store's first answer to any
//! call. A call the store says it never made (no connection was free in
//! time) left nothing behind: it is retried at the next inspection, and
//! neither backs off nor puts the cadence back. A grant that arrives
//! unable to serve a debit (empty, or usable for no time: the store's
//! `max_ttl` is no longer than the safety margin) is returned, and
//! acquires and folds wait the same way after each, until a grant serves.
//! A release pass shares one such budget across all parked
//! leases, each call capped by what is left of it, so a store that hangs
//! costs one timeout per pass however many leases are parked; a lease whose
//! call used up the budget goes to the back of the queue so the others get
//! their turn next pass.
//!
//! # Shutdown
//!
//! [`LeaseManager::shutdown`] asks the task to stop; every wait the task is in
//! (an allocator call, the poll) is raced against that request, so it acts on
//! it at once. The task stops acquiring, takes the serving lease out of the
//! slot, and until `shutdown_release_deadline` releases each parked lease as
//! soon as it is quiescent. After a release the store fails, the next pass
//! comes after the poll interval, and starts no later than one call's
//! timeout before the deadline. A lease still held by a request at the
//! deadline is
//! *abandoned*, never released: the request may still commit against it
//! (I25). The embedding service should stop admitting and drain its usage
//! before shutting the manager down, so that nothing is still held. Abandoned leases
//! come back at TTL reclaim and are counted in the [`LeaseManagerReport`].
//!
//! Dropping the [`LeaseManager`] instead aborts the task; the leases it held
//! are left to TTL reclaim, and a warning says how many.

use std::collections::VecDeque;
use std::fmt;
use std::future::{Future, poll_fn};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

use atomic_waker::AtomicWaker;
use jiff::{SignedDuration, Timestamp};
use tokio::sync::watch;
use tokio::task::{JoinError, JoinHandle};
use tokio::time::{Instant, sleep_until, timeout_at};
use tracing::Instrument as _;

use super::TIMER_RESOLUTION;
use super::after;
use crate::admission::LeaseSlot;
use crate::model::{
    AccountId, BalanceShortfall, CostUnits, LeaseGrant, LeaseId, LocalLease, RefillSignal,
    RefillVerdict,
};
use crate::store::{AllocateError, Allocation, Clock, LeaseAllocator, Released};

/// How one account's lease manager sizes, times and returns its leases.
///
/// There is no `Default` (I17): these values decide how much of the balance
/// one instance holds, for how long, and how long the store may be waited
/// on. [`validate`](Self::validate) checks them before the task starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseManagerConfig {
    /// The account whose slot is stocked and whose balance pays.
    pub account: AccountId,
    /// Units asked for in each acquire: `low_water` and the span between
    /// rotations above it, raised with the mark once the account's quotes
    /// outgrow `low_water` (see there). The allocator may grant less near
    /// the end of the balance. Larger grants mean fewer store calls but more
    /// balance held by one instance (and left to TTL reclaim if it crashes).
    /// Must be positive.
    pub target_grant: CostUnits,
    /// The mark at or below which a lease asks to be replaced while it keeps
    /// serving. Size it to what the account spends during one refill (an
    /// allocator round trip) at its peak rate. Must be below `target_grant`.
    /// A grant no larger than its mark (the allocator's tail of a balance)
    /// gets none: it serves until drained or until it refuses a quote, since
    /// replacing it early would strand its units on a parked lease.
    ///
    /// Keep it at least the largest price: a lease left with less refuses
    /// the request. A quote above it that a lease refuses and a fold or
    /// replacement then funds becomes the account's mark for the rest of
    /// the manager's life, and grants ask for that mark and the same span
    /// above it, `target_grant - low_water` (I27). A warning names the
    /// quote.
    pub low_water: CostUnits,
    /// The lifetime asked for each lease. The allocator may clamp it. Must be
    /// positive and longer than `expiry_safety_margin`.
    pub lease_ttl: SignedDuration,
    /// How long before `expires_at` a lease stops accepting debits and
    /// commits (I2). It must cover the clock skew between this instance and
    /// the store plus the longest request the service runs. Must not be
    /// negative.
    pub expiry_safety_margin: SignedDuration,
    /// How long after one inspection ends the next one starts when no lease
    /// rings. Bounds how long a parked lease that went quiet waits, and is
    /// the pause before a failed call is retried (acquires and folds that
    /// keep getting no answer wait longer: one poll, two, four, eight; see
    /// the module docs). Expiry rings no doorbell,
    /// so a lease is replaced `poll_interval + store_call_timeout` before
    /// its usable window closes ([`replacement_lead`](Self::replacement_lead)),
    /// which must be shorter than that window, and earlier still by up to a
    /// quarter of the rest of the window, spread by lease id (I28). (A
    /// grant the allocator cuts shorter is replaced one store call before
    /// its window closes, whatever the poll.) At least one millisecond, the
    /// timer's resolution.
    pub poll_interval: Duration,
    /// The longest any allocator call may take (I22), and the budget of one
    /// release pass over every parked lease. A call cut off by it is treated
    /// as a storage error: it may have taken effect. At least one
    /// millisecond, the timer's resolution.
    pub store_call_timeout: Duration,
    /// How long a shutdown may spend returning leases, waiting for them to
    /// quiesce included. Must be positive.
    pub shutdown_release_deadline: Duration,
}

/// The first rule a [`LeaseManagerConfig`] breaks, in field order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseManagerConfigError {
    /// `target_grant` is zero.
    TargetGrantZero,
    /// `low_water` is not below `target_grant`.
    LowWaterNotBelowTargetGrant,
    /// `lease_ttl` is shorter than a microsecond, the shortest lease a
    /// store grants (zero and negative included).
    LeaseTtlNotPositive,
    /// `expiry_safety_margin` is negative.
    ExpirySafetyMarginNegative,
    /// `expiry_safety_margin` is not shorter than `lease_ttl`.
    ExpirySafetyMarginNotBelowLeaseTtl,
    /// `poll_interval` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    PollIntervalBelowTimerResolution,
    /// `store_call_timeout` is shorter than the timer's resolution, one millisecond
    /// (zero included).
    StoreCallTimeoutBelowTimerResolution,
    /// `poll_interval + store_call_timeout` is not shorter than a lease's
    /// usable window (`lease_ttl − expiry_safety_margin`): a lease is
    /// replaced that long before its window closes, so every lease would be
    /// replaced as soon as it was installed.
    ReplacementLeadNotBelowUsableWindow,
    /// `shutdown_release_deadline` is zero.
    ShutdownReleaseDeadlineZero,
    /// `expiry_safety_margin` is shorter than how far behind the clock the
    /// manager was given may read ([`Clock::staleness_bound`]): a request
    /// could then debit the lease after it expired (I2). Checked by
    /// [`LeaseManager::spawn`], which has the clock.
    ExpirySafetyMarginBelowClockStaleness,
}

/// The lease settings an instance applies to every account it serves: a
/// [`LeaseManagerConfig`] without the account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountLeaseConfig {
    /// See [`LeaseManagerConfig::target_grant`].
    pub target_grant: CostUnits,
    /// See [`LeaseManagerConfig::low_water`].
    pub low_water: CostUnits,
    /// See [`LeaseManagerConfig::lease_ttl`].
    pub lease_ttl: SignedDuration,
    /// See [`LeaseManagerConfig::expiry_safety_margin`].
    pub expiry_safety_margin: SignedDuration,
    /// See [`LeaseManagerConfig::poll_interval`].
    pub poll_interval: Duration,
    /// See [`LeaseManagerConfig::store_call_timeout`].
    pub store_call_timeout: Duration,
    /// See [`LeaseManagerConfig::shutdown_release_deadline`]. Each account's
    /// manager has its own; managers shut down concurrently.
    pub shutdown_release_deadline: Duration,
}

/// The owner's handle on one account's lease manager task.
///
/// Keep it while the account is served, and call
/// [`shutdown`](Self::shutdown) to return the leases; dropping it aborts the
/// task and leaves its leases to TTL reclaim.
pub struct LeaseManager {
    account: AccountId,
    slot: Arc<LeaseSlot>,
    clock: Arc<dyn Clock>,
    shared: Arc<Shared>,
    stop: watch::Sender<Option<Instant>>,
    shutdown_release_deadline: Duration,
    /// `None` once `shutdown` has joined the task.
    task: Option<JoinHandle<LeaseManagerReport>>,
}

/// Whether the account can be served from this instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseHealth {
    /// The slot holds a lease inside its usability window, with units left
    /// or an allocator that answers.
    Serving,
    /// The slot is empty, its lease has expired, or its lease is drained
    /// while the allocator does not answer; requests are denied while the
    /// task keeps trying to acquire (a spent account nobody wants, once a
    /// lease's life: see I28).
    Unfunded,
    /// The slot is empty because its last lease lapsed unused (I28): the
    /// task acquires when a request asks (answering that request
    /// transiently) or a refill is due. Readiness counts the account as
    /// served once the lapsed lease is released.
    Idle,
    /// The store refused a claim as an accounting fault. The task no longer
    /// acquires and the slot stays empty; readiness is withdrawn for good.
    Faulted,
    /// The task has ended.
    Stopped,
}

/// What a shutdown did with the leases the task still held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseManagerReport {
    /// Leases returned to the allocator during the shutdown, or found settled
    /// by it.
    pub released: u64,
    /// The units those releases credited back.
    pub released_units: u64,
    /// Leases not returned: still held by a request at the deadline, left
    /// unanswered by the store, or withheld after an integrity fault. They
    /// settle at TTL reclaim.
    pub abandoned: u64,
    /// The units the abandoned leases held at the deadline. For a lease still
    /// held by a request this is a momentary reading.
    pub abandoned_units: u64,
    /// The task panicked or was aborted instead of shutting down. The counts
    /// above are then what the handle could still see: the slot's lease and
    /// the leases the task last said it held.
    pub task_died: bool,
    /// The manager found the books disagreeing with the store (an integrity
    /// fault, I15) at some point in its life, shutdown included.
    pub faulted: bool,
    /// The task's counters at the end.
    pub stats: LeaseStats,
}

impl LeaseManagerReport {
    /// The report of a shutdown that ended with `stats`, having released
    /// what `before` does not count and abandoned `abandoned` (leases,
    /// units).
    fn since(
        before: &LeaseStats,
        stats: &LeaseStats,
        (abandoned, abandoned_units): (u64, u64),
        faulted: bool,
    ) -> Self {
        let stats = *stats;
        Self {
            released: stats.released.saturating_sub(before.released),
            released_units: stats.released_units.saturating_sub(before.released_units),
            abandoned,
            abandoned_units,
            task_died: false,
            faulted,
            stats,
        }
    }
}

/// What the task has done: cumulative counters, written only by the task.
///
/// Plain `Relaxed` atomics: nothing else is ordered by them, and with a
/// single writer they cannot contend.
#[derive(Default)]
pub struct LeaseCounters {
    acquired: AtomicU64,
    acquired_units: AtomicU64,
    acquire_timeouts: AtomicU64,
    uncertain_acquires: AtomicU64,
    refused: [AtomicU64; AllocateError::COUNT],
    released: AtomicU64,
    released_units: AtomicU64,
    release_timeouts: AtomicU64,
    release_refused: [AtomicU64; AllocateError::COUNT],
    abandoned: AtomicU64,
    consolidated: AtomicU64,
    consolidations_deferred: AtomicU64,
}

/// A reading of [`LeaseCounters`]. Each field is read on its own, so a
/// reading taken while the task works may be off by the step in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LeaseStats {
    /// Grants received, by acquire or by consolidation.
    pub acquired: u64,
    /// The units of those grants.
    pub acquired_units: u64,
    /// Acquires and consolidations cut off by `store_call_timeout`.
    pub acquire_timeouts: u64,
    /// Acquires and consolidations whose outcome is not known here: timed
    /// out, answered with a storage error, or cut off by shutdown. Each may
    /// have created a grant nobody holds, which comes back at TTL reclaim;
    /// an upper bound, since a storage error can also mean the call never
    /// reached the store (no connection to be had, say).
    pub uncertain_acquires: u64,
    /// Refusals of acquires and consolidations, by [`AllocateError::index`].
    pub refused: [u64; AllocateError::COUNT],
    /// Leases that left this manager's books settled: released, folded into
    /// a consolidation, or found settled or disowned (fenced) by the store.
    pub released: u64,
    /// The units credited back by releases and consolidations the store
    /// answered. A lease found settled already (an earlier release whose
    /// answer was lost, or reclaim) counts in `released` but adds nothing
    /// here: what it credited is the store's to say.
    pub released_units: u64,
    /// Releases cut off by `store_call_timeout` or a pass budget.
    pub release_timeouts: u64,
    /// Refusals of releases, by [`AllocateError::index`].
    pub release_refused: [u64; AllocateError::COUNT],
    /// Leases given up at shutdown; they settle at TTL reclaim.
    pub abandoned: u64,
    /// Refused leases folded into a new grant: about one for each larger
    /// quote above the mark (leases are then sized for it, see
    /// [`LeaseManagerConfig::low_water`]), and more near the end of a
    /// balance, where grants come short.
    pub consolidated: u64,
    /// Attempts to fold a refused lease that were put off because a
    /// reservation or an undelivered event still held it. A refusal stays
    /// recorded until a fold, so one quote is counted at every poll or ring
    /// while the lease stays busy: a steadily rising count says folds keep
    /// meeting a busy lease. An attempt is answered with a replacement large
    /// enough for the quote while the allocator might fund it and the last
    /// such chase did not fall short, with a plain replacement if the lease
    /// is low, and otherwise waits for a quiet moment.
    pub consolidations_deferred: u64,
}

impl LeaseManagerConfig {
    /// How long before its window closes a lease is replaced: one poll
    /// interval, so no inspection comes too late, plus one store call, so
    /// the replacement is in place before the window closes (I28).
    #[must_use]
    pub fn replacement_lead(&self) -> SignedDuration {
        let lead = self.poll_interval.saturating_add(self.store_call_timeout);
        SignedDuration::try_from(lead).unwrap_or(SignedDuration::MAX)
    }

    /// Checks every rule, in field order.
    ///
    /// # Errors
    ///
    /// The first rule broken.
    pub fn validate(&self) -> Result<(), LeaseManagerConfigError> {
        use LeaseManagerConfigError as Broken;
        // I17: nothing is repaired; the first broken rule is named.
        let rules = [
            (!self.target_grant.is_zero(), Broken::TargetGrantZero),
            (
                self.low_water < self.target_grant,
                Broken::LowWaterNotBelowTargetGrant,
            ),
            // Stores keep microseconds and refuse a shorter lease, every
            // acquire alike.
            (
                self.lease_ttl >= SignedDuration::from_micros(1),
                Broken::LeaseTtlNotPositive,
            ),
            (
                !self.expiry_safety_margin.is_negative(),
                Broken::ExpirySafetyMarginNegative,
            ),
            (
                self.expiry_safety_margin < self.lease_ttl,
                Broken::ExpirySafetyMarginNotBelowLeaseTtl,
            ),
            (
                self.poll_interval >= TIMER_RESOLUTION,
                Broken::PollIntervalBelowTimerResolution,
            ),
            (
                self.store_call_timeout >= TIMER_RESOLUTION,
                Broken::StoreCallTimeoutBelowTimerResolution,
            ),
            (
                self.lease_ttl
                    .checked_sub(self.expiry_safety_margin)
                    .is_some_and(|window| self.replacement_lead() < window),
                Broken::ReplacementLeadNotBelowUsableWindow,
            ),
            (
                !self.shutdown_release_deadline.is_zero(),
                Broken::ShutdownReleaseDeadlineZero,
            ),
        ];
        rules
            .into_iter()
            .find_map(|(holds, broken)| (!holds).then_some(broken))
            .map_or(Ok(()), Err)
    }
}

impl fmt::Display for LeaseManagerConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::TargetGrantZero => "lease manager: target_grant must be positive",
            Self::LowWaterNotBelowTargetGrant => {
                "lease manager: low_water must be below target_grant"
            }
            Self::LeaseTtlNotPositive => "lease manager: lease_ttl must be at least a microsecond",
            Self::ExpirySafetyMarginNegative => {
                "lease manager: expiry_safety_margin must not be negative"
            }
            Self::ExpirySafetyMarginNotBelowLeaseTtl => {
                "lease manager: expiry_safety_margin must be shorter than lease_ttl"
            }
            Self::PollIntervalBelowTimerResolution => {
                "lease manager: poll_interval must be at least one millisecond \
                 (the timer's resolution)"
            }
            Self::StoreCallTimeoutBelowTimerResolution => {
                "lease manager: store_call_timeout must be at least one millisecond \
                 (the timer's resolution)"
            }
            Self::ReplacementLeadNotBelowUsableWindow => {
                "lease manager: poll_interval + store_call_timeout must be shorter than \
                 lease_ttl - expiry_safety_margin (a lease is replaced that long before \
                 its window closes)"
            }
            Self::ShutdownReleaseDeadlineZero => {
                "lease manager: shutdown_release_deadline must be positive"
            }
            Self::ExpirySafetyMarginBelowClockStaleness => {
                "lease manager: expiry_safety_margin must be at least the clock's staleness \
                 bound (how far behind the true time it may read)"
            }
        })
    }
}

impl std::error::Error for LeaseManagerConfigError {}

impl AccountLeaseConfig {
    /// The complete configuration for `account`'s manager.
    #[must_use]
    pub fn for_account(&self, account: AccountId) -> LeaseManagerConfig {
        LeaseManagerConfig {
            account,
            target_grant: self.target_grant,
            low_water: self.low_water,
            lease_ttl: self.lease_ttl,
            expiry_safety_margin: self.expiry_safety_margin,
            poll_interval: self.poll_interval,
            store_call_timeout: self.store_call_timeout,
            shutdown_release_deadline: self.shutdown_release_deadline,
        }
    }

    /// Checks the rules of [`LeaseManagerConfig::validate`], which do not
    /// depend on the account, before any manager is started.
    ///
    /// # Errors
    ///
    /// The first rule broken.
    pub fn validate(&self) -> Result<(), LeaseManagerConfigError> {
        // No rule looks at the account, so any one will do.
        let placeholder = AccountId(0);
        self.for_account(placeholder).validate()
    }
}

impl LeaseManager {
    /// Validates `config` and starts the task that stocks `slot` from
    /// `allocator` on the current tokio runtime. The first inspection (and
    /// so the first acquire into an empty slot) runs at once.
    ///
    /// `slot` should be the account's one slot: the task is meant to be its
    /// only writer. A slot of another account is refused by a debug
    /// assertion here, and in release builds by an integrity fault on the
    /// first grant, before anything is spent.
    ///
    /// # Errors
    ///
    /// The first rule `config` breaks, then
    /// [`LeaseManagerConfigError::ExpirySafetyMarginBelowClockStaleness`];
    /// nothing is started then.
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn spawn(
        allocator: Arc<dyn LeaseAllocator>,
        slot: Arc<LeaseSlot>,
        clock: Arc<dyn Clock>,
        config: LeaseManagerConfig,
    ) -> Result<Self, LeaseManagerConfigError> {
        config.validate()?;
        // I2: a clock reading up to its staleness behind the true time still
        // closes the window before the grant expires. (An instance runtime
        // asks more of the margin: the delivery of the last charges too.)
        let margin = Duration::try_from(config.expiry_safety_margin).unwrap_or_default();
        if margin < clock.staleness_bound() {
            return Err(LeaseManagerConfigError::ExpirySafetyMarginBelowClockStaleness);
        }
        debug_assert_eq!(
            slot.account(),
            config.account,
            "a lease manager stocks its own account's slot"
        );
        let (stop, stop_rx) = watch::channel(None);
        let shared = Arc::new(Shared {
            counters: Arc::new(LeaseCounters::default()),
            readiness: watch::Sender::new(false),
            faulted: AtomicBool::new(false),
            grant_call_in_flight: AtomicBool::new(false),
            held_leases: AtomicU64::new(0),
            held_units: AtomicU64::new(0),
            grants_held: AtomicBool::new(false),
        });
        let task = Task {
            allocator,
            slot: Arc::clone(&slot),
            clock: Arc::clone(&clock),
            config,
            shared: Arc::clone(&shared),
            doorbell: Arc::new(Doorbell::default()),
            stop: stop_rx,
            parked: VecDeque::new(),
            withheld: Vec::new(),
            rotation_fell_short: false,
            largest_quote: CostUnits::ZERO,
            chasing: CostUnits::ZERO,
            warned_short_window: false,
            renew_early: None,
            warned_unserved: false,
            unanswered_acquires: 0,
            acquire_after: None,
            unusable_grants: 0,
            unusable_until: None,
            early_wakes: EarlyWakes::default(),
            refill_woken: None,
            evidence: None,
            lapsing: None,
            lapsed: None,
            idle_yield_until: None,
            last_wanted: Instant::now(),
            last_acquire: None,
        };
        // A manager starts by acquiring, whatever the one before it left.
        slot.end_idle();
        let span = tracing::info_span!("lease_manager", account = %config.account);
        Ok(Self {
            account: config.account,
            slot,
            clock,
            shared,
            stop,
            shutdown_release_deadline: config.shutdown_release_deadline,
            task: Some(tokio::spawn(task.run().instrument(span))),
        })
    }

    /// The account this manager serves.
    pub fn account(&self) -> AccountId {
        self.account
    }

    /// The counters as they stand now.
    pub fn stats(&self) -> LeaseStats {
        self.shared.counters.stats()
    }

    /// The task's counters, shared: they can be kept after the handle moves
    /// on, and stay readable after the task ends.
    pub fn counters(&self) -> &Arc<LeaseCounters> {
        &self.shared.counters
    }

    /// Whether the account is served, waiting for funds, faulted or stopped,
    /// judged now from the slot and the task.
    pub fn health(&self) -> LeaseHealth {
        if self.is_finished() {
            return LeaseHealth::Stopped;
        }
        if self.shared.is_faulted() {
            return LeaseHealth::Faulted;
        }
        if serving(&self.slot, self.clock.as_ref()) {
            LeaseHealth::Serving
        } else if self.slot.is_idle() {
            LeaseHealth::Idle
        } else {
            LeaseHealth::Unfunded
        }
    }

    /// `true` while the slot holds a usable lease, or is idle with its last
    /// lease released (see [`LeaseHealth::Idle`]), and no integrity fault has
    /// been seen; updated by the task after every inspection, one of which
    /// comes as the lease's window closes, so a lease that expires shows here
    /// then (or, with a clock that reads behind, by its staleness bound; for
    /// a grant usable no longer than one store call, by the next poll).
    /// `false` for good after a fault, and once the task ends however it
    /// ends.
    pub fn readiness(&self) -> watch::Receiver<bool> {
        self.shared.readiness.subscribe()
    }

    /// Whether the task has ended: stopped, panicked or aborted.
    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Whether the task saw an integrity fault (I15), whether or not it is
    /// still running: a faulted manager that later died is still faulted.
    pub(crate) fn is_faulted(&self) -> bool {
        self.shared.is_faulted()
    }

    /// Stops the task and reports what it returned and what it left to TTL
    /// reclaim.
    ///
    /// The task stops acquiring at once, takes the serving lease out of the
    /// slot (requests on this account are denied from then on) and releases
    /// every lease as it quiesces, until `shutdown_release_deadline` from
    /// this call; it returns by then, give or take scheduling. Stop admitting
    /// and drain usage first, so no request still holds a lease.
    ///
    /// Dropping the returned future before it completes aborts the task, as
    /// dropping the handle does.
    pub async fn shutdown(self) -> LeaseManagerReport {
        let deadline = after(Instant::now(), self.shutdown_release_deadline);
        self.shutdown_by(deadline).await
    }

    /// [`shutdown`](Self::shutdown) inside an enclosing budget that ends at
    /// `latest`: the release deadline is brought forward to it if it falls
    /// earlier, and a task still running then is cut off, what it held
    /// reported abandoned (I25). The instance's shutdown gives every account
    /// what is left of its one deadline this way, so an account's report is
    /// in hand when the deadline passes rather than lost with the task.
    pub(crate) async fn shutdown_by(mut self, latest: Instant) -> LeaseManagerReport {
        let deadline = after(Instant::now(), self.shutdown_release_deadline).min(latest);
        let before = self.shared.counters.stats();
        self.stop.send_if_modified(|requested| {
            let first = requested.is_none();
            if first {
                *requested = Some(deadline);
            }
            first
        });
        let Some(task) = self.task.as_mut() else {
            return self.report_death(None);
        };
        let ending = if let Ok(ending) = tokio::time::timeout_at(deadline, &mut *task).await {
            ending
        } else {
            // Past its deadline the task only abandons what it holds; one
            // that has not returned yet is stopped where it is, and its
            // holdings are what it leaves.
            task.abort();
            match task.await {
                Err(error) if error.is_cancelled() => {
                    self.task = None;
                    return self.report_cut_off(&before);
                }
                ending => ending,
            }
        };
        self.task = None;
        match ending {
            Ok(report) => report,
            Err(error) => self.report_death(Some(&error)),
        }
    }

    /// Stops new grant calls, leaving the serving lease in place: the
    /// instance's shutdown asks this as it stops admitting, so no lease is
    /// acquired or folded for requests that can no longer come, and none is
    /// left stranded by the stop that follows (I25).
    pub(crate) fn hold_grants(&self) {
        self.shared.grants_held.store(true, Ordering::Release);
    }

    /// The report of a task cut off at its shutdown deadline: it returned
    /// what [`before`] does not count, and abandons the leases it held.
    fn report_cut_off(&self, before: &LeaseStats) -> LeaseManagerReport {
        let (abandoned, abandoned_units) = self.leftovers();
        bump(&self.shared.counters.abandoned, abandoned);
        tracing::warn!(
            account = %self.account,
            abandoned,
            abandoned_units,
            "lease manager: cut off at the shutdown deadline; its leases settle at TTL reclaim"
        );
        LeaseManagerReport::since(
            before,
            &self.stats_at_end(),
            (abandoned, abandoned_units),
            self.shared.is_faulted(),
        )
    }

    /// The counters of a task that ended without returning: a grant request
    /// it was awaiting may have created a lease nobody holds.
    fn stats_at_end(&self) -> LeaseStats {
        let mut stats = self.shared.counters.stats();
        if self.shared.grant_call_in_flight.load(Ordering::Acquire) {
            stats.uncertain_acquires = stats.uncertain_acquires.saturating_add(1);
        }
        stats
    }

    /// The leases an abort would leave to TTL reclaim: those the task held
    /// outside the slot as of its last count, and the serving one.
    pub(crate) fn leases_held(&self) -> u64 {
        let serving = self.slot.load_observed().is_some();
        self.shared
            .held_leases
            .load(Ordering::Relaxed)
            .saturating_add(u64::from(serving))
    }

    /// What an ended task leaves behind: the leases it held outside the
    /// slot as of its last count, and the serving lease, taken out of the
    /// slot so requests stop spending on an account nobody manages any
    /// more. Counted as leases and units.
    fn leftovers(&self) -> (u64, u64) {
        // Nothing manages the account's units now: no evidence vouches for
        // them, and the serving lease's come back only at TTL reclaim.
        self.slot.publish_funding(None);
        let stranded = self.slot.take();
        let serving_units = stranded.as_ref().map_or(0, |lease| lease.remaining().get());
        let held = self.shared.held_leases.load(Ordering::Relaxed);
        (
            held.saturating_add(u64::from(stranded.is_some())),
            self.shared
                .held_units
                .load(Ordering::Relaxed)
                .saturating_add(serving_units),
        )
    }

    /// The report of a task that did not finish its own shutdown. What it
    /// held is lost with it; the serving lease is taken out of the slot so
    /// requests stop spending on an account nobody manages any more.
    fn report_death(&self, error: Option<&JoinError>) -> LeaseManagerReport {
        let (abandoned, abandoned_units) = self.leftovers();
        let stats = self.stats_at_end();
        tracing::error!(
            account = %self.account,
            error = error.map(tracing::field::display),
            abandoned,
            abandoned_units,
            "lease manager: the task died; its leases settle at TTL reclaim"
        );
        LeaseManagerReport {
            released: 0,
            released_units: 0,
            abandoned,
            abandoned_units,
            task_died: true,
            faulted: self.shared.is_faulted(),
            stats,
        }
    }
}

impl Drop for LeaseManager {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        if task.is_finished() {
            return;
        }
        task.abort();
        let serving = self.slot.load_observed();
        tracing::warn!(
            account = %self.account,
            parked = self.shared.held_leases.load(Ordering::Relaxed),
            parked_units = self.shared.held_units.load(Ordering::Relaxed),
            serving = serving.as_ref().map(|lease| tracing::field::display(lease.grant().lease_id)),
            serving_units = serving.as_ref().map(|lease| lease.remaining().get()),
            "lease manager: handle dropped without shutdown; the task is aborted and its \
             leases settle at TTL reclaim"
        );
    }
}

impl fmt::Debug for LeaseManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseManager")
            .field("account", &self.account)
            .field("health", &self.health())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl LeaseCounters {
    /// Reads every counter.
    pub fn stats(&self) -> LeaseStats {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        LeaseStats {
            acquired: read(&self.acquired),
            acquired_units: read(&self.acquired_units),
            acquire_timeouts: read(&self.acquire_timeouts),
            uncertain_acquires: read(&self.uncertain_acquires),
            refused: std::array::from_fn(|index| read(&self.refused[index])),
            released: read(&self.released),
            released_units: read(&self.released_units),
            release_timeouts: read(&self.release_timeouts),
            release_refused: std::array::from_fn(|index| read(&self.release_refused[index])),
            abandoned: read(&self.abandoned),
            consolidated: read(&self.consolidated),
            consolidations_deferred: read(&self.consolidations_deferred),
        }
    }

    fn granted(&self, grant: &LeaseGrant) {
        bump(&self.acquired, 1);
        bump(&self.acquired_units, grant.units.get());
    }

    fn settled(&self, credited: CostUnits) {
        bump(&self.released, 1);
        bump(&self.released_units, credited.get());
    }

    fn grant_refused(&self, error: &AllocateError) {
        bump(&self.refused[error.index()], 1);
        if matches!(error, AllocateError::Storage(_)) {
            bump(&self.uncertain_acquires, 1);
        }
    }

    fn grant_timed_out(&self) {
        bump(&self.acquire_timeouts, 1);
        bump(&self.uncertain_acquires, 1);
    }
}

impl fmt::Debug for LeaseCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("LeaseCounters").field(&self.stats()).finish()
    }
}

impl LeaseStats {
    /// The field-by-field sum, for totals across accounts; `None` if any sum
    /// would overflow (I1: counters never wrap).
    #[must_use]
    pub fn checked_add(&self, other: &LeaseStats) -> Option<LeaseStats> {
        let (a, b) = (self, other);
        Some(LeaseStats {
            acquired: sum(a.acquired, b.acquired)?,
            acquired_units: sum(a.acquired_units, b.acquired_units)?,
            acquire_timeouts: sum(a.acquire_timeouts, b.acquire_timeouts)?,
            uncertain_acquires: sum(a.uncertain_acquires, b.uncertain_acquires)?,
            refused: add_each(&a.refused, &b.refused)?,
            released: sum(a.released, b.released)?,
            released_units: sum(a.released_units, b.released_units)?,
            release_timeouts: sum(a.release_timeouts, b.release_timeouts)?,
            release_refused: add_each(&a.release_refused, &b.release_refused)?,
            abandoned: sum(a.abandoned, b.abandoned)?,
            consolidated: sum(a.consolidated, b.consolidated)?,
            consolidations_deferred: sum(a.consolidations_deferred, b.consolidations_deferred)?,
        })
    }

    /// What the counters added after `earlier`, a reading of the same
    /// manager taken before this one: every counter only grows.
    #[must_use]
    pub(crate) fn since(&self, earlier: &LeaseStats) -> LeaseStats {
        let (a, b) = (self, earlier);
        LeaseStats {
            acquired: a.acquired.saturating_sub(b.acquired),
            acquired_units: a.acquired_units.saturating_sub(b.acquired_units),
            acquire_timeouts: a.acquire_timeouts.saturating_sub(b.acquire_timeouts),
            uncertain_acquires: a.uncertain_acquires.saturating_sub(b.uncertain_acquires),
            refused: sub_each(&a.refused, &b.refused),
            released: a.released.saturating_sub(b.released),
            released_units: a.released_units.saturating_sub(b.released_units),
            release_timeouts: a.release_timeouts.saturating_sub(b.release_timeouts),
            release_refused: sub_each(&a.release_refused, &b.release_refused),
            abandoned: a.abandoned.saturating_sub(b.abandoned),
            consolidated: a.consolidated.saturating_sub(b.consolidated),
            consolidations_deferred: a
                .consolidations_deferred
                .saturating_sub(b.consolidations_deferred),
        }
    }

    /// How many acquires and consolidations were refused with `error`'s
    /// variant.
    #[must_use]
    pub fn refused_for(&self, error: &AllocateError) -> u64 {
        self.refused[error.index()]
    }

    /// How many releases were refused with `error`'s variant.
    #[must_use]
    pub fn release_refused_for(&self, error: &AllocateError) -> u64 {
        self.release_refused[error.index()]
    }
}

fn sum(a: u64, b: u64) -> Option<u64> {
    a.checked_add(b)
}

fn sub_each<const N: usize>(left: &[u64; N], right: &[u64; N]) -> [u64; N] {
    let mut rest = [0; N];
    for ((rest, a), b) in rest.iter_mut().zip(left).zip(right) {
        *rest = a.saturating_sub(*b);
    }
    rest
}

fn add_each<const N: usize>(left: &[u64; N], right: &[u64; N]) -> Option<[u64; N]> {
    let mut totals = [0; N];
    for ((total, a), b) in totals.iter_mut().zip(left).zip(right) {
        *total = sum(*a, *b)?;
    }
    Some(totals)
}

/// A counter update by the only writer: a load and a store, saturating
/// rather than wrapping (I1).
fn bump(counter: &AtomicU64, by: u64) {
    let current = counter.load(Ordering::Relaxed);
    counter.store(current.saturating_add(by), Ordering::Relaxed);
}

/// What the handle and the task share.
struct Shared {
    counters: Arc<LeaseCounters>,
    readiness: watch::Sender<bool>,
    /// Set once, by the task, on an integrity fault; never cleared.
    faulted: AtomicBool,
    /// Whether the task is awaiting an acquire or a consolidation, so the
    /// handle can count it as uncertain if the task dies meanwhile.
    grant_call_in_flight: AtomicBool,
    /// How many leases the task holds outside the slot, and their units, as
    /// of its last inspection: what a dead task leaves to TTL reclaim.
    held_leases: AtomicU64,
    held_units: AtomicU64,
    /// Set when the instance stops admitting: no grant call starts from
    /// then on (see [`LeaseManager::hold_grants`]).
    grants_held: AtomicBool,
}

impl Shared {
    fn is_faulted(&self) -> bool {
        self.faulted.load(Ordering::Acquire)
    }
}

/// Withdraws readiness when the task ends, however it ends: a return, a
/// panic, or an abort that drops the task's future.
struct ReadinessOnExit(Arc<Shared>);

impl Drop for ReadinessOnExit {
    fn drop(&mut self) {
        self.0.readiness.send_replace(false);
    }
}

/// The doorbell every installed lease rings (I7, I28).
///
/// `request_refill` runs inside a debit on the request path, so it is a flag
/// store and a waker hand-off, both lock-free (I5); what `Waker::wake` does
/// inside the runtime's scheduler is the runtime's business.
#[derive(Default)]
struct Doorbell {
    rung: AtomicBool,
    waker: AtomicWaker,
}

impl RefillSignal for Doorbell {
    fn request_refill(&self) {
        // Set before the wake, so the woken task finds it.
        self.rung.store(true, Ordering::Release);
        self.waker.wake();
    }
}

impl Doorbell {
    /// Resolves once the bell has rung since it was last answered, and
    /// answers it. Safe to drop unresolved in a `select!`: the ring is
    /// consumed only when this resolves.
    fn answer(&self) -> impl Future<Output = ()> + '_ {
        poll_fn(|cx| {
            if self.rung.swap(false, Ordering::AcqRel) {
                return Poll::Ready(());
            }
            self.waker.register(cx.waker());
            // A ring between the first look and the registration woke nobody;
            // looking again after registering catches it.
            if self.rung.swap(false, Ordering::AcqRel) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
    }
}

/// Between steps, pause this long while waiting at shutdown for leases to
/// quiesce. Requests let go of a lease without telling anyone, so the task
/// looks again; a short pause against a deadline of seconds.
const QUIESCENCE_POLL: Duration = Duration::from_millis(5);

/// The lease manager task.
///
/// # Invariants
///
/// 1. Every lease this task received from the allocator and has not seen
///    settled is in exactly one place: the slot, `parked`, or `withheld`
///    (or a local of the step in progress, which puts it in one of them
///    before it next awaits anything other than the call about it).
/// 2. A lease is released only when quiescent, claiming its exact
///    `remaining()` (I6, I15).
/// 3. Once `faulted` is set the task installs nothing into the slot.
struct Task {
    allocator: Arc<dyn LeaseAllocator>,
    slot: Arc<LeaseSlot>,
    clock: Arc<dyn Clock>,
    config: LeaseManagerConfig,
    shared: Arc<Shared>,
    doorbell: Arc<Doorbell>,
    stop: watch::Receiver<Option<Instant>>,
    /// Leases out of the slot waiting to quiesce and be released; the front
    /// has its turn first.
    parked: VecDeque<Arc<LocalLease>>,
    /// Leases whose release the store refused as an accounting fault. They
    /// are never claimed again, and are reported abandoned at shutdown.
    withheld: Vec<Arc<LocalLease>>,
    /// A replacement acquired for a refused quote came back smaller than
    /// the quote, which an allocator that honours the floor it is asked
    /// for never grants.
    /// Until a fold succeeds or a grant shows no shortfall, a deferred fold
    /// no longer chases the quote, so one quote cannot split the account's
    /// funds into ever smaller leases.
    rotation_fell_short: bool,
    /// The largest quote a lease of this account refused that a fold or a
    /// replacement then funded: the account's requests come that large, so
    /// every later grant is sized and marked for it (see
    /// [`Task::sizing`]).
    largest_quote: CostUnits,
    /// The quote the acquire under way chases, zero otherwise: the grant
    /// is marked for it, and it is learnt if the grant covers it.
    chasing: CostUnits,
    /// Whether a grant too short-lived to outlast the replacement lead has
    /// been reported; once per task, as every later grant is the same.
    warned_short_window: bool,
    /// Grant calls in a row that got no answer (timed out, or a storage
    /// error), and when the next acquire or fold may be made. Each may have
    /// created a grant nobody holds until reclaim, so while the store does
    /// not answer, grant calls back off: after the second miss in a row one
    /// poll, then two, four and eight, rather than strand a grant every
    /// poll of a slow spell. Any answer from the store (to an acquire, a
    /// fold or a release) puts the cadence back.
    unanswered_acquires: u32,
    acquire_after: Option<Instant>,
    /// Grants in a row that arrived unable to serve a debit (a store whose
    /// `max_ttl` is no longer than the safety margin grants nothing else),
    /// and until when they hold the next acquire back: one poll, then two,
    /// four and eight. Answers do not end this wait, since the store did
    /// answer; a grant that serves does. Asked every poll, such a store
    /// would journal a grant and its release per account and poll for as
    /// long as the instance runs.
    unusable_grants: u32,
    unusable_until: Option<Instant>,
    /// The wake-ups before the next poll already spent on the serving lease
    /// (see [`Task::early_wake`]).
    early_wakes: EarlyWakes,
    /// The period end the last refill wake-up came for: each comes once,
    /// so a clock that reads behind cannot turn it into a loop.
    refill_woken: Option<Timestamp>,
    /// The allocator's last word on the account's funds, raised by what
    /// releases returned since (the slot shows it with the parked leases'
    /// units added: see [`Task::evidence_with_parked`]).
    evidence: Option<BalanceShortfall>,
    /// The serving lease, unused, that is let lapse rather than replaced
    /// (see [`Task::lets_lapse`]).
    lapsing: Option<LeaseId>,
    /// The last lease that lapsed, leaving the slot idle: readiness waits
    /// for its release.
    lapsed: Option<LeaseId>,
    /// Until when an idle slot whose lapsed lease had refused quotes waits
    /// before it acquires, even for a request that asks: the time another
    /// instance refusing the same quote needs to fold the units back (see
    /// [`Task::lets_lapse`]).
    idle_yield_until: Option<Instant>,
    /// When a request last found the slot without a lease (or the task
    /// started): a spent account nobody has wanted for a lease's life is
    /// asked about once a lease's life rather than at every poll.
    last_wanted: Instant,
    /// When the last acquire call was made.
    last_acquire: Option<Instant>,
    /// How much earlier than the replacement lead the serving lease is
    /// replaced (see [`renewal_spread`]), fixed when it was installed.
    renew_early: Option<(LeaseId, SignedDuration)>,
    /// Whether the spell without a lease that serves, for want of an
    /// answer or for a refusal an operator should see, has been warned
    /// about: once a spell, until a grant serves again. Every retry would
    /// otherwise warn again, and an outage over thousands of accounts
    /// would write tens of megabytes of the same line.
    warned_unserved: bool,
}

/// Which of its early wake-ups a lease has had: each at most once, so a
/// clock that reads behind tokio's time (a coarse clock between ticks, a
/// manual one in tests) cannot turn them into a loop of store calls.
#[derive(Debug, Clone, Copy, Default)]
struct EarlyWakes {
    lease: Option<LeaseId>,
    /// Whether the lease's window, when first seen, was longer than one
    /// store call. A shorter one is unusable in practice (the allocator's
    /// `max_ttl` barely exceeds the margin); it is replaced at polls and
    /// rings as before, rather than churned once per window.
    eligible: bool,
    replace: bool,
    close: bool,
}

impl EarlyWakes {
    fn spend(&mut self, kind: EarlyWake) {
        match kind {
            EarlyWake::Replace => self.replace = true,
            EarlyWake::Close => self.close = true,
        }
    }
}

/// An early wake-up the serve loop may schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EarlyWake {
    /// One store call before the window closes: replace the lease.
    Replace,
    /// At the close (plus the clock's staleness bound): retire it, so
    /// readiness stops saying it serves.
    Close,
}

/// Shutdown was requested; the deadline it set.
struct Stopped(Instant);

/// Why the serving lease is folded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fold {
    /// It refused a quote the account might fund.
    Refused,
    /// It refused a quote the allocator's last word ruled out; the store is
    /// asked again.
    Recheck,
}

/// What one inspection of the slot calls for.
enum Step {
    Idle,
    Acquire,
    /// Replace a lease whose window is about to close with one large
    /// enough for the quote it refused.
    Chase(CostUnits),
    Consolidate,
    /// Ask the store again about a quote the serving lease refused and the
    /// allocator's last word ruled out: by folding the lease, which the
    /// store refuses, changing nothing, unless the account can fund the
    /// quote now.
    Recheck,
}

/// How an allocator call ended.
enum CallEnd<T> {
    Answered(T),
    TimedOut,
    Stopped(Instant),
}

/// What a release refusal means for the lease.
enum ReleaseRefusal {
    /// It was settled already; drop it.
    Settled,
    /// The store does not recognise our capability for it.
    Fenced,
    /// The outcome is unknown; try again.
    Retry,
    /// The balance has no room for the units yet (a top-up or refill filled
    /// it while they were out); try again once it has.
    NoRoom,
    /// The store and this instance disagree about the books.
    Integrity,
}

/// What became of a lease after its release call.
enum Judged {
    /// Settled, disowned or withheld: no longer parked.
    Done,
    /// The outcome is unknown; it stays parked.
    Keep(Arc<LocalLease>),
    /// Shutdown cut the call short; it stays parked.
    Stopped(Arc<LocalLease>, Instant),
}

/// What a refused consolidation means for the old lease.
enum FoldRefusal {
    /// A domain refusal: the call rolled back and the lease is still ours
    /// (I18).
    RolledBack,
    /// The store no longer holds the lease for us.
    Gone { fenced: bool },
    /// The call may have committed.
    Ambiguous,
    /// The store and this instance disagree about the books.
    Integrity,
}

impl Task {
    async fn run(mut self) -> LeaseManagerReport {
        let _exit = ReadinessOnExit(Arc::clone(&self.shared));
        let Stopped(deadline) = self.serve().await;
        self.wind_down(deadline).await
    }

    /// Inspects the slot at once, then after every ring or poll, until a
    /// shutdown is requested.
    async fn serve(&mut self) -> Stopped {
        loop {
            if let Err(stopped) = self.inspect().await {
                return stopped;
            }
            self.note_holdings();
            self.publish_readiness();
            let next_poll = after(Instant::now(), self.config.poll_interval);
            let early = self.early_wake().filter(|(at, _)| *at < next_poll);
            // A backed-off acquire is tried when its wait is over, not a
            // poll after whichever inspection last skipped it. A wait
            // already over is no reason to wake: the inspection just made
            // either called, or wanted no lease.
            let backoff_ends = self
                .acquire_after
                .filter(|at| *at > Instant::now())
                .unwrap_or(next_poll);
            let refill = self.refill_wake();
            let wake = early
                .map_or(next_poll, |(at, _)| at)
                .min(backoff_ends)
                .min(refill.map_or(next_poll, |(at, _)| at));
            tokio::select! {
                biased;
                deadline = stop_requested(&mut self.stop) => return Stopped(deadline),
                // I28: a ring is answered at once; the poll is the backstop.
                () = self.doorbell.answer() => {}
                () = sleep_until(wake) => {
                    // Spent only if it is the wake-up that came.
                    if let Some((at, kind)) = early
                        && at <= wake
                    {
                        self.early_wakes.spend(kind);
                    }
                    if let Some((at, period_end)) = refill
                        && at <= wake
                    {
                        self.refill_woken = Some(period_end);
                        // The refill is due: an idle slot acquires now, as
                        // any empty one does, and is asked about at each
                        // poll again until nobody wants it.
                        self.slot.end_idle();
                        self.last_wanted = Instant::now();
                    }
                }
            }
        }
    }

    /// How long before its usable window closes `lease` is replaced: the
    /// replacement lead, plus the spread it was given when installed.
    fn renewal_lead(&self, lease: &LocalLease) -> SignedDuration {
        let lead = self.config.replacement_lead();
        match self.renew_early {
            Some((id, early)) if id == lease.grant().lease_id => lead.saturating_add(early),
            _ => lead,
        }
    }

    /// When the serving lease needs an inspection before the next poll, and
    /// why: one store call before its window closes, to replace it (I28),
    /// and at the close, to retire it, each at most once per lease.
    ///
    /// Expiry rings no doorbell. A lease usable for less than the
    /// replacement lead (a store whose `max_ttl` is shorter than
    /// `lease_ttl`) would otherwise close between two polls and leave the
    /// account denied until the next one; and a lease whose replacement
    /// failed would close with the readiness published at the last
    /// inspection still saying it serves (I29). The close is awaited for the
    /// clock's staleness bound past it, so a clock that reads behind still
    /// shows it closed. `None` when there is no lease, or nothing is left to
    /// wake for.
    fn early_wake(&mut self) -> Option<(Instant, EarlyWake)> {
        let (lease, usable_until) = self.slot.with_lease(|lease| {
            lease.map(|lease| (lease.grant().lease_id, lease.usable_until()))
        })?;
        let left = Duration::try_from(usable_until.duration_since(self.clock.now())).ok()?;
        let call = self.config.store_call_timeout;
        if self.early_wakes.lease != Some(lease) {
            self.early_wakes = EarlyWakes {
                lease: Some(lease),
                eligible: left > call,
                replace: false,
                close: false,
            };
        }
        let wakes = self.early_wakes;
        if !wakes.eligible {
            return None;
        }
        let (wait, kind) = if left > call && !wakes.replace {
            (left.saturating_sub(call), EarlyWake::Replace)
        } else if !wakes.close {
            (
                left.saturating_add(self.clock.staleness_bound()),
                EarlyWake::Close,
            )
        } else {
            return None;
        };
        Some((after(Instant::now(), wait), kind))
    }

    /// When an account without a lease may be funded again: the period
    /// end its evidence names, by when the refill brings more than is left
    /// (I23, I28). Clients are told to retry then, and an empty slot rings no
    /// doorbell: without this wake-up they would be refused, and readiness
    /// withdrawn, from then until the next poll. Awaited for the clock's
    /// staleness bound past it, as a lease's close is, and once per period
    /// end.
    fn refill_wake(&self) -> Option<(Instant, Timestamp)> {
        if self.slot.with_lease(|lease| lease.is_some()) {
            return None;
        }
        let now = self.clock.now();
        let period_end = self.evidence?.in_force(now)?.period_end?;
        if self.refill_woken == Some(period_end) {
            return None;
        }
        let left = Duration::try_from(period_end.duration_since(now)).ok()?;
        let at = after(
            Instant::now(),
            left.saturating_add(self.clock.staleness_bound()),
        );
        Some((at, period_end))
    }

    async fn inspect(&mut self) -> Result<(), Stopped> {
        self.retire_expired();
        let budget_end = after(Instant::now(), self.config.store_call_timeout);
        let pass = self.release_pass(budget_end, true).await?;
        // Invariant 3: after an integrity fault nothing is installed again.
        if self.shared.is_faulted() {
            return Ok(());
        }
        self.no_grant_call_after_stop()?;
        if self.grants_held() {
            return Ok(());
        }
        match self.next_step() {
            Step::Idle => Ok(()),
            Step::Acquire => self.acquire().await,
            Step::Chase(needed) => self.chase(needed).await,
            Step::Consolidate => self.consolidate().await,
            Step::Recheck => self.recheck(pass.store_failed).await,
        }
    }

    fn next_step(&mut self) -> Step {
        let verdict = {
            // A lease in the slot serves the account's requests, refused
            // ones included: the account is wanted until it leaves.
            if self.slot.take_wanted() || self.slot.with_lease(|lease| lease.is_some()) {
                self.last_wanted = Instant::now();
            }
            let Some(lease) = self.slot.load_observed() else {
                // Left empty for want of use: acquired for the request that
                // asks, not at every poll (I28). The slot stays idle until
                // the acquire is answered (see `acquire_sized`), so requests
                // meanwhile are not funded from overage either.
                if self.slot.is_idle()
                    && (!self.slot.lease_asked_for()
                        || self
                            .idle_yield_until
                            .is_some_and(|until| Instant::now() < until))
                {
                    return Step::Idle;
                }
                if self.spent_and_unwanted() {
                    return Step::Idle;
                }
                return Step::Acquire;
            };
            let now = self.clock.now();
            if now >= lease.usable_until() {
                None
            } else if lease.usable_until().duration_since(now) <= self.renewal_lead(&lease) {
                // Expiry rings no doorbell. A lease whose window closes
                // before the next inspection could have a replacement in
                // place is replaced now, while it still serves (I28); by
                // one large enough for a quote it refused, since folding it
                // would only replace it again as its window closes (I27).
                let needed = lease.largest_refused_quote();
                if !needed.is_zero() {
                    return Step::Chase(needed);
                }
                if self.lets_lapse(&lease) {
                    self.lapsing = Some(lease.grant().lease_id);
                    return Step::Idle;
                }
                // Used since an earlier inspection decided to let it lapse:
                // replaced after all.
                self.lapsing = None;
                Some(RefillVerdict::Draining)
            } else {
                match lease.refill_due_or_rearm() {
                    RefillVerdict::Idle if Self::recheck_due(&lease) => return Step::Recheck,
                    verdict => Some(verdict),
                }
            }
            // The observed `Arc` is dropped here: held any longer it would
            // make the lease look busy to the quiescence test.
        };
        match verdict {
            // It expired during the release pass.
            None => {
                self.retire_expired();
                if self.slot.is_idle() {
                    Step::Idle
                } else {
                    Step::Acquire
                }
            }
            Some(RefillVerdict::Idle) => Step::Idle,
            Some(RefillVerdict::Draining) => Step::Acquire,
            // Replacing a lease that refused a quote with one of the same
            // size would refuse it again; fold it into a bigger one.
            Some(RefillVerdict::Refused) => Step::Consolidate,
        }
    }

    /// Whether `lease`, otherwise idle, refused a quote on the allocator's
    /// last word that it still cannot fund: the word may predate a top-up,
    /// a refill or another instance's release, and nothing else would ask
    /// the store again before the lease runs dry or its window nears its
    /// end, up to a lease's life later (I28). A record of a quote the lease
    /// can fund now (units given back by requests released since) is
    /// dropped: there is nothing to ask.
    fn recheck_due(lease: &LocalLease) -> bool {
        let quote = lease.largest_ruled_out_quote();
        if quote.is_zero() {
            return false;
        }
        if quote <= lease.remaining() {
            // Only the record judged: a larger quote ruled out since stays.
            lease.forget_ruled_out(quote);
            return false;
        }
        true
    }

    /// Whether the serving lease, near the end of its window, is let lapse
    /// rather than replaced: the store shares tails between instances, the
    /// allocator said the balance could not fund another such grant, and
    /// the lease served nothing. The account's last units would otherwise
    /// stay with an instance that cannot use them, at every window, while
    /// another instance refuses quotes they would fund together with its
    /// own lease (tail sharing splits a short balance between instances,
    /// and a fold takes only what the balance holds). Once it lapses and is
    /// released, the slot stays empty until a request asks for a lease
    /// (I28). A lease that refused quotes it could not fund lapses too, and
    /// its slot then waits two polls before acquiring even for a request:
    /// another instance refusing the same quote checks it with the store
    /// within a poll, and folds the released units with its own; both
    /// renewing their shares at once, neither would ever fund it.
    ///
    /// Decided when the lease comes due for replacement (see
    /// [`renewal_lead`](Self::renewal_lead)): a lease first used after
    /// that is replaced only as it closes, so requests meet the round trip
    /// then.
    fn lets_lapse(&self, lease: &LocalLease) -> bool {
        self.allocator.shares_tails()
            && self.balance_in_force().is_some()
            && lease.remaining() == lease.grant().units
    }

    /// Whether the empty slot of a spent account skips this poll's acquire:
    /// the allocator last said nothing is left (and no release has returned
    /// units since), no request has found the slot empty, nor a lease
    /// served it, for a lease's life, and the store answered an acquire
    /// less than a lease's life ago. Asked
    /// about at every poll, each such account would cost a store call per
    /// poll per instance for as long as it stays spent; asked once a
    /// lease's life, a 402 is answered on evidence no older than that, the
    /// bound a top-up already has (I28). A request that finds the slot
    /// empty puts the poll back at the next inspection, and a refill due
    /// still wakes the task at its period end.
    fn spent_and_unwanted(&self) -> bool {
        let quiet_for = Duration::try_from(self.config.lease_ttl).unwrap_or(Duration::MAX);
        let now = Instant::now();
        self.balance_in_force()
            .is_some_and(|balance| balance.remaining.is_zero())
            && now.saturating_duration_since(self.last_wanted) >= quiet_for
            && self
                .last_acquire
                .is_some_and(|at| now.saturating_duration_since(at) < quiet_for)
    }

    /// Takes a lease whose usability window has closed out of the slot and
    /// parks it: no request can debit it any more (I2), but the allocator
    /// may still take its remainder back.
    fn retire_expired(&mut self) {
        let now = self.clock.now();
        let expired = self
            .slot
            .with_lease(|lease| lease.is_some_and(|lease| now >= lease.usable_until()));
        if !expired {
            return;
        }
        // Read between the take and the park, the evidence would leave out
        // the lease's units (I23): withdrawn first, shown again with the
        // lease counted once it is parked.
        self.slot.publish_funding(None);
        if let Some(lease) = self.slot.take() {
            tracing::debug!(
                lease = %lease.grant().lease_id,
                usable_until = %lease.usable_until(),
                "lease manager: the serving lease expired; parking it"
            );
            // Still unused as its window closed: no replacement until a
            // request asks for one.
            if self.lapsing == Some(lease.grant().lease_id)
                && lease.remaining() == lease.grant().units
            {
                self.slot
                    .idle_until_asked(Arc::clone(&self.doorbell) as Arc<dyn RefillSignal>);
                self.lapsed = Some(lease.grant().lease_id);
                self.idle_yield_until = lease
                    .has_refused()
                    .then(|| after(Instant::now(), self.config.poll_interval.saturating_mul(2)));
            }
            self.park(lease);
        }
        self.lapsing = None;
        self.show_evidence();
    }

    async fn acquire(&mut self) -> Result<(), Stopped> {
        self.acquire_sized(self.sizing(CostUnits::ZERO).request, CostUnits::ZERO)
            .await
            .map(drop)
    }

    /// How much to ask for, and where to mark the lease, for an account
    /// whose requests come as large as `quote` (or as the largest quote
    /// learnt so far, if larger). The mark is at least the quote, so a
    /// lease rings for its replacement once it may no longer fund one (a
    /// request at that price during the replacement's round trip is
    /// refused, as any larger than `low_water` is), and the grant asked for
    /// is the mark plus the configured span between rotations
    /// (`target_grant - low_water`), so what a lease serves between
    /// rotations, and what the store is asked per unit spent, stay as
    /// configured. A grant no larger than its mark is then one the
    /// allocator shrank (I28). For quotes no larger than `low_water` these
    /// are the configured `target_grant` and `low_water` (I27).
    fn sizing(&self, quote: CostUnits) -> Sizing {
        let mark = self.config.low_water.max(quote).max(self.largest_quote);
        // `validate` keeps `low_water` below `target_grant`.
        let span = self
            .config
            .target_grant
            .saturating_sub(self.config.low_water);
        Sizing {
            request: mark.checked_add(span).unwrap_or(CostUnits::MAX),
            mark,
        }
    }

    /// Sizes later grants for `quote`, which a lease refused and a fold or
    /// a replacement then funded (see [`sizing`](Self::sizing)), for the
    /// rest of the task's life. Said once per larger quote above
    /// `low_water`: the configuration is the cheaper place for it, sparing
    /// each instance the first refusal (and, for a quote larger than
    /// the span between rotations, a store call per such request).
    fn learn_quote(&mut self, quote: CostUnits) {
        if quote <= self.largest_quote || quote <= self.config.low_water {
            return;
        }
        self.largest_quote = quote;
        let sizing = self.sizing(quote);
        tracing::warn!(
            quote = quote.get(),
            low_water = self.config.low_water.get(),
            target_grant = self.config.target_grant.get(),
            requested = sizing.request.get(),
            mark = sizing.mark.get(),
            "lease manager: a lease refused a quote above low_water; the account's \
             leases are sized for it from now on (configure low_water at least the \
             largest price and target_grant several times it)"
        );
    }

    /// No grant call starts once shutdown is asked for: one cut off after
    /// it was sent may have granted a lease nobody holds, stranded until
    /// reclaim. (A stop that arrives while a call runs still cuts it off,
    /// and the call is then counted uncertain.) Checked before every grant
    /// call, including a second one in the same inspection.
    fn no_grant_call_after_stop(&self) -> Result<(), Stopped> {
        match *self.stop.borrow() {
            Some(deadline) => Err(Stopped(deadline)),
            None => Ok(()),
        }
    }

    /// Whether the instance has stopped admitting (see
    /// [`LeaseManager::hold_grants`]): the serving lease is all the
    /// requests still in flight need.
    fn grants_held(&self) -> bool {
        self.shared.grants_held.load(Ordering::Acquire)
    }

    /// Acquires a lease of `requested` units, and at least `needed`, and
    /// installs it, parking what it replaces. Returns the units granted,
    /// which may be fewer than requested (fewer than `needed` only from an
    /// allocator that breaks its contract), or `None` when nothing was.
    async fn acquire_sized(
        &mut self,
        requested: CostUnits,
        needed: CostUnits,
    ) -> Result<Option<CostUnits>, Stopped> {
        self.no_grant_call_after_stop()?;
        if self.grants_held()
            || self
                .acquire_after
                .is_some_and(|after| Instant::now() < after)
        {
            return Ok(None);
        }
        // A lease parked earlier in this inspection (one that expired) is
        // counted before the call the task may end in.
        self.note_holdings();
        let config = &self.config;
        let asked_at = Instant::now();
        let call = self.allocator.acquire_at_least(
            config.account,
            requested,
            needed,
            config.lease_ttl,
            self.clock.now(),
        );
        let give_up_at = after(Instant::now(), config.store_call_timeout);
        self.shared
            .grant_call_in_flight
            .store(true, Ordering::Release);
        let end = bounded(Some(&mut self.stop), give_up_at, call).await;
        self.shared
            .grant_call_in_flight
            .store(false, Ordering::Release);
        let counters = Arc::clone(&self.shared.counters);
        let answered = self.note_grant_call(&end);
        // Only an answer brings the evidence up to date.
        if answered {
            self.last_acquire = Some(asked_at);
        }
        // An idle slot's acquire has ended: the slot is served as any other
        // from now on. A grant ends idleness once it is installed (or found
        // unusable), so no request between the two is funded from overage.
        if !matches!(end, CallEnd::Stopped(_) | CallEnd::Answered(Ok(_))) {
            self.slot.end_idle();
        }
        match end {
            CallEnd::Answered(Ok(allocation)) => {
                let granted = allocation.grant.units;
                self.install(allocation);
                return Ok(Some(granted));
            }
            CallEnd::Answered(Err(error)) => {
                self.slot
                    .publish_allocator_reachable(!matches!(error, AllocateError::Storage(_)));
                counters.grant_refused(&error);
                // An account out of funds is the customer's state, answered
                // 402 and counted; not something for an operator to act on.
                let out_of_funds = error.evidence().is_some()
                    || matches!(error, AllocateError::InsufficientBalance);
                if let Some(evidence) = error.evidence() {
                    self.evidence = Some(evidence);
                    self.show_evidence();
                }
                if !matches!(error, AllocateError::Storage(_)) {
                    // The store will answer the same until something
                    // changes: the serving lease's replacement waits for
                    // the plain lead rather than ask at every poll of its
                    // spread (I28).
                    self.renew_early = None;
                }
                self.log_unfunded(&error, out_of_funds);
            }
            CallEnd::TimedOut => {
                // I22: cut off, and treated as a storage error: a grant may
                // exist that nobody holds; it comes back at TTL reclaim.
                self.slot.publish_allocator_reachable(false);
                counters.grant_timed_out();
                self.log_unfunded(&"the allocator did not answer in time", false);
            }
            CallEnd::Stopped(deadline) => {
                bump(&counters.uncertain_acquires, 1);
                tracing::debug!("lease manager: shutdown cut an acquire short");
                return Err(Stopped(deadline));
            }
        }
        Ok(None)
    }

    /// Books how a grant call (an acquire or a fold) ended, and says
    /// whether the store answered it. A call the store never made counts
    /// neither way (I22).
    fn note_grant_call(&mut self, end: &CallEnd<Result<Allocation, AllocateError>>) -> bool {
        let answered = match end {
            CallEnd::Answered(answer) => !matches!(answer, Err(AllocateError::Storage(_))),
            CallEnd::TimedOut | CallEnd::Stopped(_) => false,
        };
        if !made_no_call(end) {
            self.note_acquire_answered(answered);
        }
        answered
    }

    /// Books whether an acquire got an answer; without one, the next waits
    /// (see `unanswered_acquires`).
    fn note_acquire_answered(&mut self, answered: bool) {
        if answered {
            self.unanswered_acquires = 0;
            self.acquire_after = self.unusable_until.filter(|at| Instant::now() < *at);
            return;
        }
        self.unanswered_acquires = self.unanswered_acquires.saturating_add(1);
        // One miss is retried at the next inspection, as any failure is (a
        // lease near its window's end gets its last try then); from the
        // second in a row, one poll, two, four, eight.
        let missed = (self.unanswered_acquires > 1).then(|| {
            let polls = 1_u32 << (self.unanswered_acquires - 2).min(3);
            after(
                Instant::now(),
                self.config.poll_interval.saturating_mul(polls),
            )
        });
        self.acquire_after = missed.max(self.unusable_until);
    }

    /// Books a grant that arrived unable to serve (see `unusable_grants`).
    fn note_unusable_grant(&mut self) {
        self.unusable_grants = self.unusable_grants.saturating_add(1);
        let polls = 1_u32 << (self.unusable_grants - 1).min(3);
        let until = after(
            Instant::now(),
            self.config.poll_interval.saturating_mul(polls),
        );
        self.unusable_until = Some(until);
        self.acquire_after = self.acquire_after.max(Some(until));
    }

    /// Logs a failed acquire at the level of its consequence: routine while
    /// a lease still serves, or when the account is simply out of funds
    /// (every poll would repeat it); a warning when the account is denied
    /// for want of an answer or for a refusal an operator should see.
    fn log_unfunded(&mut self, reason: &dyn fmt::Display, out_of_funds: bool) {
        let account = self.config.account;
        if serving(&self.slot, self.clock.as_ref()) {
            tracing::debug!(
                %account,
                %reason,
                "lease manager: no replacement lease; still serving"
            );
        } else if out_of_funds {
            tracing::debug!(
                %account,
                %reason,
                "lease manager: the account is out of funds; its requests are denied"
            );
        } else if self.warned_unserved {
            tracing::debug!(
                %account,
                %reason,
                "lease manager: still no lease that serves; requests on this account are denied"
            );
        } else {
            // I5: no lease that serves (the slot is empty, or its lease is
            // closed or drained) and requests are denied while the task
            // retries (backing off while the store does not answer).
            self.warned_unserved = true;
            tracing::warn!(
                %account,
                %reason,
                "lease manager: no lease that serves; requests on this account are denied \
                 (said once until a lease serves again)"
            );
        }
    }

    /// Installs a fresh grant into the slot, parking what it replaces.
    fn install(&mut self, allocation: Allocation) {
        let grant = allocation.grant;
        self.shared.counters.granted(&grant);
        let lease = Arc::new(self.local_lease(grant));
        if !self.serves(&grant) {
            // The allocator answered for another account, or the slot serves
            // one this manager does not ask for. Releasing the grant is safe
            // (the store checks every claim); spending it here is not.
            tracing::error!(
                lease = %grant.lease_id,
                granted_to = %grant.account_id,
                "lease manager: the allocator granted a lease of another account"
            );
            self.park(lease);
            self.fault();
            self.slot.end_idle();
            return;
        }
        let now = self.clock.now();
        if grant.units.is_zero() || now >= lease.usable_until() {
            // A grant that cannot serve a single debit: an empty one, or a
            // ttl clamped to less than the safety margin. It goes back.
            tracing::error!(
                lease = %grant.lease_id,
                units = grant.units.get(),
                usable_until = %lease.usable_until(),
                "lease manager: the grant is unusable on arrival (is the allocator's \
                 max_ttl shorter than expiry_safety_margin?); returning it"
            );
            // The grant left the balance all the same: the evidence says
            // what remains without it (none: at least what was asked for),
            // and its release adds it back.
            self.evidence = allocation.funding;
            self.park(lease);
            self.show_evidence();
            self.note_unusable_grant();
            self.slot.end_idle();
            return;
        }
        // The store answered with a grant that serves: no wait is left,
        // and the next spell without one is worth a warning again.
        self.warned_unserved = false;
        self.unusable_grants = 0;
        self.unusable_until = None;
        self.acquire_after = None;
        let window = lease.usable_until().duration_since(now);
        self.renew_early = Some((
            grant.lease_id,
            renewal_spread(
                grant.lease_id,
                window.saturating_sub(self.config.replacement_lead()),
            ),
        ));
        if window <= self.config.replacement_lead() && !self.warned_short_window {
            self.warned_short_window = true;
            tracing::warn!(
                lease = %grant.lease_id,
                usable_for = %window,
                replacement_lead = %self.config.replacement_lead(),
                "lease manager: the grant is usable for no longer than the replacement lead \
                 (poll_interval + store_call_timeout), so each lease is replaced one store \
                 call before its window closes, and every ring replaces it (is the \
                 allocator's max_ttl shorter than lease_ttl?)"
            );
        }
        if allocation.funding.is_none() {
            // The account showed more than was asked for: a replacement
            // that once fell short of a quote says nothing any more.
            self.rotation_fell_short = false;
        }
        self.slot.publish_allocator_reachable(true);
        // The lease and the evidence cannot change together, so the old
        // evidence goes first and the new comes after the lease: a request
        // between them reads no evidence and answers transiently, never
        // rules out a quote by evidence that counts neither the granted
        // units nor the old lease's (I23).
        self.slot.publish_funding(None);
        if let Some(previous) = self.slot.replace(lease) {
            // I28: rotation. The old lease keeps serving the requests that
            // hold it, and is released once they let go (I26).
            self.park(previous);
        }
        self.slot.end_idle();
        self.evidence = allocation.funding;
        self.show_evidence();
        tracing::debug!(
            lease = %grant.lease_id,
            units = grant.units.get(),
            "lease manager: installed a lease"
        );
    }

    /// Whether `grant` is of the account this manager asks for and its slot
    /// serves.
    fn serves(&self, grant: &LeaseGrant) -> bool {
        grant.account_id == self.config.account && grant.account_id == self.slot.account()
    }

    fn local_lease(&self, grant: LeaseGrant) -> LocalLease {
        // A grant no larger than the mark is the balance's tail (the
        // allocator shrank it). Replaced at a mark inside it, it would ask
        // for the next slice after a debit or two, and every replacement
        // would strand its remainder on a parked lease until that lease
        // quiesced: the serving lease would run dry beside units the
        // account still has, and an Elastic account would be billed
        // overage for them. It serves until drained, or until it refuses a
        // quote, which folds it (I27).
        // A grant that covers the quote chased is marked for it, as it is
        // learnt; one that falls short, as before.
        let chased = if grant.units >= self.chasing {
            self.chasing
        } else {
            CostUnits::ZERO
        };
        let mark = self.sizing(chased).mark;
        let low_water = if grant.units <= mark {
            CostUnits::ZERO
        } else {
            mark
        };
        let lease = LocalLease::with_sharding(
            grant,
            low_water,
            self.config.expiry_safety_margin,
            self.slot.sharding(),
        )
        .with_refill(Arc::clone(&self.doorbell) as Arc<dyn RefillSignal>);
        // A grant of another account is only ever released, never spent:
        // it gets no overage counter, whose account would not match.
        if self.serves(&grant) {
            lease.with_overage(self.slot.overage())
        } else {
            lease
        }
    }

    /// I27: the unspent count of a lease a reservation is in flight on, or
    /// a committed charge's event is still on its way from (I26), is not
    /// final. Under steady traffic one always is, so waiting for a quiet
    /// moment could refuse the quote for good. Instead the lease keeps
    /// serving and a replacement large enough for the quote is acquired
    /// beside it (a rotation, I28); the old lease is released once
    /// quiescent, returning its unspent units. A quote the account's last
    /// known funds rule out is not chased (the replacement is asked for
    /// with the quote as its floor, so a balance short of it is refused and
    /// rules it out from then on), nor one an earlier replacement came back
    /// short of: then the lease is replaced only if
    /// it is also low, as after a refused fold, so one unfundable quote
    /// neither drains the account's lease, nor churns grants, nor splits the
    /// balance into ever smaller leases.
    ///
    /// Whether to chase is decided on the balance alone
    /// ([`might_fund`](Self::might_fund)); whether to keep the record, on
    /// everything the instance holds beside the lease
    /// ([`evidence_in_force`](Self::evidence_in_force)), as admission
    /// decides whether to record it.
    fn defer_fold(&mut self, live: &LocalLease) -> DeferredFold {
        bump(&self.shared.counters.consolidations_deferred, 1);
        let needed = live.largest_refused_quote();
        let chase = !self.rotation_fell_short && self.might_fund(needed);
        let draining = live.remaining() <= live.low_water();
        if rules_out_beside(self.evidence_in_force(), needed, live.remaining()) {
            // Admission no longer records this quote; the record made
            // before the evidence came would hide a fundable one. A quote
            // the lease and the balance together could fund is kept, and
            // folded at the first quiet moment.
            live.forget_refusal(needed);
        }
        DeferredFold {
            needed,
            chase,
            draining,
        }
    }

    /// Replaces a lease whose window is about to close and which refused a
    /// quote of `needed`: chased as a deferred fold's quote is, unless the
    /// allocator's evidence rules it out or a replacement already fell
    /// short of it.
    async fn chase(&mut self, needed: CostUnits) -> Result<(), Stopped> {
        self.rotate_for(DeferredFold {
            needed,
            chase: !self.rotation_fell_short && self.might_fund(needed),
            draining: true,
        })
        .await
    }

    /// Whether a grant of `needed` might be had: yes unless the balance
    /// alone, as the allocator last described it (raised by what releases
    /// returned since), rules it out. Units on a busy or parked lease do
    /// not count: they return to the balance only once it is released.
    fn might_fund(&self, needed: CostUnits) -> bool {
        self.balance_in_force()
            .is_none_or(|evidence| !evidence.rules_out(needed))
    }

    /// Whether the fold of the serving lease waits: `Some` while grant
    /// calls back off (then `false`: an acquire would wait as well) or
    /// while the store would refuse the fold (then whether the lease is
    /// also low, to be replaced meanwhile).
    ///
    /// A fold is a grant call too, and one cut off may have granted a
    /// lease nobody holds: while grant calls back off (I22), the lease
    /// keeps serving what it can, its refusal recorded for the fold when
    /// the wait is over. (Folded and cut off, it would be parked, leaving
    /// the slot empty for the rest of the slow spell.) And the store folds
    /// from the balance and the lease's own units: units a parked lease
    /// holds reach the balance only with its release, so the fold waits
    /// until they have, rather than be refused at every poll.
    ///
    /// Either way, a record that the evidence shown to requests now rules
    /// out beside the lease (the lease spent down while the fold waited) is
    /// forgotten, as admission would no longer make it: kept, it would hide
    /// a smaller, fundable quote refused after it (I27).
    fn fold_waits(&self) -> Option<bool> {
        let backing_off = self
            .acquire_after
            .is_some_and(|after| Instant::now() < after);
        // Both figures at one instant: a period ending between two readings
        // would forget the record and then fold without it.
        let now = self.clock.now();
        let shown = self.evidence_with_parked().and_then(|e| e.in_force(now));
        let balance = self.evidence.and_then(|e| e.in_force(now));
        self.slot.with_lease(|lease| {
            let lease = lease?;
            let (needed, held) = (lease.largest_refused_quote(), lease.remaining());
            if rules_out_beside(shown, needed, held) {
                lease.forget_refusal(needed);
            }
            if backing_off {
                return Some(false);
            }
            rules_out_beside(balance, needed, held).then(|| held <= lease.low_water())
        })
    }

    /// The balance as the allocator last described it, raised by what
    /// releases returned since, while in force: what a grant or a fold is
    /// made from, without the units parked leases still hold.
    fn balance_in_force(&self) -> Option<BalanceShortfall> {
        let now = self.clock.now();
        self.evidence.and_then(|evidence| evidence.in_force(now))
    }

    /// Acts on a deferred fold: chases its quote with a replacement, or
    /// replaces a lease that is also low.
    async fn rotate_for(&mut self, deferred: DeferredFold) -> Result<(), Stopped> {
        let DeferredFold {
            needed,
            chase,
            draining,
        } = deferred;
        if chase {
            self.chasing = needed;
            // Sized for the quote, which is learnt once a grant covers it,
            // and no smaller than it: a balance short of the quote is
            // refused with its evidence, which rules the quote out from then
            // on, rather than granted short onto this instance.
            let granted = self
                .acquire_sized(self.sizing(needed).request, needed)
                .await;
            self.chasing = CostUnits::ZERO;
            let granted = granted?;
            self.rotation_fell_short = granted.is_some_and(|units| units < needed);
            if granted.is_some_and(|units| units >= needed) {
                self.learn_quote(needed);
            }
            return Ok(());
        }
        if draining {
            return self.acquire().await;
        }
        Ok(())
    }

    /// Folds the serving lease, which refused a quote, into one grant large
    /// enough for that quote.
    async fn consolidate(&mut self) -> Result<(), Stopped> {
        // A lease a request holds is found busy where it serves: taken out
        // of the slot to find that out, it would leave the slot empty, and
        // the account's requests denied, for a moment.
        let busy = match self.slot.load_observed() {
            None => return self.acquire().await,
            Some(lease) => (!lease.is_only_local_view()).then_some(lease),
        };
        if let Some(live) = busy {
            let deferred = self.defer_fold(&live);
            // Held any longer, the observed `Arc` would keep the lease from
            // quiescing once it is replaced.
            drop(live);
            return self.rotate_for(deferred).await;
        }
        // Meanwhile the lease keeps serving (replaced if it is also low).
        if let Some(draining) = self.fold_waits() {
            return if draining {
                self.acquire().await
            } else {
                Ok(())
            };
        }
        self.fold(Fold::Refused).await
    }

    /// Answers [`Step::Recheck`]: folds the serving lease into one that
    /// funds the quotes it refused, ruled out included, so the store says
    /// whether the account can fund them now. A refusal puts the lease back
    /// and brings the evidence up to date; each record asks once, so an
    /// account out of funds costs a store call per poll only while requests
    /// keep being refused. The lease is out of the slot for the call, as
    /// for any fold, and a fold cut off is parked until a release says
    /// whether it committed: a lease that serves is not staked on that
    /// while the store is known not to answer (its last call failed, or
    /// this inspection's release pass did) or grant calls back off (I22).
    /// Nor while a request holds the lease (a fold needs it quiescent).
    /// Skipped, the record stays, and the next inspection asks again.
    async fn recheck(&mut self, store_failed: bool) -> Result<(), Stopped> {
        if store_failed
            || self.slot.allocator_unreachable()
            || self
                .acquire_after
                .is_some_and(|after| Instant::now() < after)
        {
            return Ok(());
        }
        let quiet = self
            .slot
            .load_observed()
            .is_some_and(|lease| lease.is_only_local_view());
        if !quiet {
            return Ok(());
        }
        self.fold(Fold::Recheck).await
    }

    /// Folds the serving lease (see [`consolidate`](Self::consolidate) and
    /// [`recheck`](Self::recheck)).
    async fn fold(&mut self, mut kind: Fold) -> Result<(), Stopped> {
        // The evidence is withdrawn before the lease leaves the slot, and
        // stays withdrawn while the lease is out: read with the slot empty,
        // it would leave out the lease's units and rule out a quote the
        // lease funds (402, never retry). Without evidence a request
        // meanwhile is answered transiently (I23).
        self.slot.publish_funding(None);
        let Some((live, counted)) = self.slot.take_counted() else {
            self.show_evidence();
            return self.acquire().await;
        };
        if !is_quiescent(&live) {
            // A request took it in between. Put back and the evidence shown
            // before the record is judged, as after a refused fold.
            let lease = Arc::clone(&live);
            self.reinstate(live, counted);
            self.show_evidence();
            if kind == Fold::Recheck {
                // Asked again at the next inspection.
                return Ok(());
            }
            let deferred = self.defer_fold(&lease);
            drop(lease);
            return self.rotate_for(deferred).await;
        }
        let grant = *live.grant();
        // I6: quiescent, so every reading is final. A recheck asks for the
        // quote ruled out, and answers its record; a fold for a quote the
        // account might fund leaves that record alone, since asking for
        // more than that quote could get the fold refused. A quote recorded
        // as refused since the recheck was decided is folded for in its
        // stead, the record ruled out kept for a later poll.
        let unspent = live.remaining();
        if kind == Fold::Recheck && !live.largest_refused_quote().is_zero() {
            kind = Fold::Refused;
        }
        let needed = match kind {
            Fold::Refused => live.largest_refused_quote(),
            Fold::Recheck => live.take_ruled_out(),
        };
        if kind == Fold::Recheck && needed <= unspent {
            // Requests released since gave the lease units enough: there is
            // nothing to ask the store.
            self.reinstate(live, counted);
            self.show_evidence();
            return Ok(());
        }
        // Sized for the quote. A refused quote is learnt once the store
        // grants it (below), so the new lease is marked for it too; a
        // rechecked one is not learnt.
        let requested = self.sizing(needed).request;
        let config = &self.config;
        let call = self.allocator.consolidate(
            grant.lease_id,
            grant.fencing_token,
            unspent,
            requested,
            needed,
            config.lease_ttl,
            self.clock.now(),
        );
        let give_up_at = after(Instant::now(), config.store_call_timeout);
        self.shared
            .grant_call_in_flight
            .store(true, Ordering::Release);
        // The lease is in neither the slot nor the parked list while the
        // fold runs: counted as held meanwhile, so a task that dies or is
        // cut off in the call still reports it.
        self.count_holdings([&live]);
        // The evidence stays withdrawn (see above) until the fold's answer,
        // or the next grant call's, publishes it again.
        let end = bounded(Some(&mut self.stop), give_up_at, call).await;
        self.shared
            .grant_call_in_flight
            .store(false, Ordering::Release);
        let counters = Arc::clone(&self.shared.counters);
        self.note_grant_call(&end);
        let error = match end {
            CallEnd::Answered(Ok(allocation)) => {
                // The store settled the old lease in the same step (I18):
                // releasing it again would claim credited units twice.
                drop(live);
                counters.settled(unspent);
                bump(&counters.consolidated, 1);
                self.rotation_fell_short = false;
                tracing::debug!(
                    folded = %grant.lease_id,
                    unspent = unspent.get(),
                    needed = needed.get(),
                    "lease manager: consolidated a lease that refused a quote"
                );
                // The account funded the quote: the new lease, and every
                // later one, is sized for it. Not a quote a recheck asked
                // about: it was answered as final (402), and no request
                // has been served at that price.
                if kind == Fold::Refused {
                    self.learn_quote(needed);
                }
                self.install(allocation);
                return Ok(());
            }
            CallEnd::Answered(Err(error)) => {
                self.slot
                    .publish_allocator_reachable(!matches!(error, AllocateError::Storage(_)));
                error
            }
            CallEnd::TimedOut => {
                self.slot.publish_allocator_reachable(false);
                counters.grant_timed_out();
                tracing::warn!(
                    lease = %grant.lease_id,
                    "lease manager: consolidation timed out; parking the lease until a \
                     release says whether it was settled"
                );
                self.park(live);
                return Ok(());
            }
            CallEnd::Stopped(deadline) => {
                bump(&counters.uncertain_acquires, 1);
                self.park(live);
                return Err(Stopped(deadline));
            }
        };
        counters.grant_refused(&error);
        self.after_refused_fold(live, counted, unspent, &error)
            .await
    }

    /// Acts on a refused consolidation of `live`, by what the refusal says
    /// about the old lease. The evidence withdrawn for the fold is shown
    /// again, replaced by the refusal's own if it brings any.
    async fn after_refused_fold(
        &mut self,
        live: Arc<LocalLease>,
        counted: u64,
        unspent: CostUnits,
        error: &AllocateError,
    ) -> Result<(), Stopped> {
        let lease_id = live.grant().lease_id;
        // I27: a refused fold puts the still-active lease back; an ambiguous
        // one parks it for the release pass.
        match fold_refusal(error) {
            FoldRefusal::RolledBack => {
                // The store counted the folded lease's unspent units in what
                // it could grant; the lease goes back to serving with them,
                // so the balance beyond it is that much less (admission adds
                // what the lease holds itself). Published once the lease
                // serves again, so no request reads it against an empty slot.
                let evidence = error.evidence().map(|evidence| BalanceShortfall {
                    remaining: evidence.remaining.saturating_sub(unspent),
                    ..evidence
                });
                tracing::debug!(
                    lease = %lease_id,
                    %error,
                    "lease manager: consolidation refused; the lease keeps serving"
                );
                // A refusal without evidence (a suspended account, say)
                // changed nothing the withdrawn evidence described.
                if evidence.is_some() {
                    self.evidence = evidence;
                }
                let needed = live.largest_refused_quote();
                let draining = live.remaining() <= live.low_water();
                let lease = Arc::clone(&live);
                self.reinstate(live, counted);
                self.show_evidence();
                // A quote the evidence now shown rules out, beside what the
                // lease holds, is forgotten: admission no longer records it,
                // deciding on the same figure, and its record would hide a
                // smaller, fundable quote refused after it. Otherwise the
                // refusal mark stays, so the fold is tried again on the next
                // poll. Forgotten only once that evidence is shown: before,
                // a refusal would find none and record the quote again. If
                // the lease is also low, replace it meanwhile, or one quote
                // the account cannot fund would starve every smaller one
                // until the lease runs dry.
                if rules_out_beside(self.evidence_in_force(), needed, lease.remaining()) {
                    lease.forget_refusal(needed);
                }
                // A quote ruled out by older evidence that the store's answer
                // just now rules out as well has been answered: checked
                // again at the next poll, it would be refused again.
                let ruled_out = lease.largest_ruled_out_quote();
                if evidence.is_some()
                    && rules_out_beside(self.evidence_in_force(), ruled_out, lease.remaining())
                {
                    lease.forget_ruled_out(ruled_out);
                }
                drop(lease);
                if draining {
                    return self.acquire().await;
                }
            }
            FoldRefusal::Gone { fenced } => {
                // Settled: its remainder is no longer ours to spend or claim.
                drop(live);
                bump(&self.shared.counters.released, 1);
                tracing::warn!(
                    lease = %lease_id,
                    %error,
                    "lease manager: the store no longer holds the refused lease for us"
                );
                // It was settled (reclaimed, say) at a moment nobody knows,
                // its unspent units credited back: the evidence, which may
                // or may not count them, is forgotten until a grant call,
                // as for a release found settled.
                self.evidence = None;
                if fenced {
                    self.clear_slot_after_fence();
                }
                return self.acquire().await;
            }
            FoldRefusal::Ambiguous => {
                tracing::warn!(
                    lease = %lease_id,
                    %error,
                    "lease manager: consolidation failed and may have committed; parking \
                     the lease until a release says which"
                );
                self.park(live);
            }
            FoldRefusal::Integrity => {
                tracing::error!(
                    lease = %lease_id,
                    unspent = live.remaining().get(),
                    %error,
                    "lease manager: the store refused the consolidation as an accounting fault"
                );
                self.withheld.push(live);
                self.fault();
            }
        }
        Ok(())
    }

    /// Puts a lease that is still ours back into the slot, with what its
    /// take counted (see [`LeaseSlot::reinstate`]). Anything that was
    /// published there meanwhile is parked, not dropped.
    fn reinstate(&mut self, lease: Arc<LocalLease>, counted: u64) {
        if let Some(other) = self.slot.reinstate(lease, counted) {
            self.park(other);
        }
    }

    /// One pass over the parked leases: each quiescent one is released, the
    /// others keep their place. The whole pass ends by `budget_end` (I22).
    /// With `interruptible`, a shutdown request cuts the call in flight short
    /// and ends the pass with every lease still parked.
    async fn release_pass(
        &mut self,
        budget_end: Instant,
        interruptible: bool,
    ) -> Result<PassOutcome, Stopped> {
        let mut outcome = PassOutcome {
            store_failed: false,
        };
        // Examined but still ours: they go behind the leases this pass did
        // not reach, so a lease that eats the budget does not keep the front.
        let mut unsettled = Vec::new();
        let ended = loop {
            let Some(lease) = self.parked.pop_front() else {
                break Ok(outcome);
            };
            if Instant::now() >= budget_end {
                self.parked.push_front(lease);
                break Ok(outcome);
            }
            // I26: only a quiescent lease is released.
            if !is_quiescent(&lease) {
                unsettled.push(lease);
                continue;
            }
            let grant = *lease.grant();
            // I6: quiescent, so exact.
            let unspent = lease.remaining();
            // Everything still held, this lease included, as the call may
            // be the task's last step.
            self.count_holdings(unsettled.iter().chain([&lease]));
            let call = self.allocator.release(
                grant.lease_id,
                grant.fencing_token,
                unspent,
                self.clock.now(),
            );
            let give_up_at = budget_end.min(after(Instant::now(), self.config.store_call_timeout));
            let stop = interruptible.then_some(&mut self.stop);
            let end = bounded(stop, give_up_at, call).await;
            match self.judge_release(lease, unspent, end) {
                Judged::Done => {}
                Judged::Keep(lease) => {
                    outcome.store_failed = true;
                    unsettled.push(lease);
                }
                Judged::Stopped(lease, deadline) => {
                    self.parked.push_front(lease);
                    break Err(Stopped(deadline));
                }
            }
        };
        self.parked.extend(unsettled);
        // What the pass released is in the evidence now instead of in the
        // parked leases it counts.
        self.show_evidence();
        ended
    }

    /// Acts on the end of one release call: I26, each refusal by what it
    /// means (see the module docs).
    fn judge_release(
        &mut self,
        lease: Arc<LocalLease>,
        unspent: CostUnits,
        end: CallEnd<Result<Released, AllocateError>>,
    ) -> Judged {
        let lease_id = lease.grant().lease_id;
        let counters = Arc::clone(&self.shared.counters);
        let error = match end {
            CallEnd::Answered(Ok(released)) => {
                self.note_acquire_answered(true);
                counters.settled(released.credited);
                // The credited units are back in the balance the published
                // evidence describes: without them, a quote the account can
                // now fund would be ruled out (402, never retry) until the
                // next grant call, which an idle serving lease may not make
                // for minutes.
                if lease.grant().account_id == self.slot.account()
                    && let Some(evidence) = &mut self.evidence
                {
                    evidence.remaining = evidence
                        .remaining
                        .checked_add(released.credited)
                        .unwrap_or(CostUnits::MAX);
                }
                if released.credited != unspent {
                    // The books disagree: units were counted twice or lost.
                    tracing::error!(
                        lease = %lease_id,
                        claimed = unspent.get(),
                        credited = released.credited.get(),
                        "lease manager: the store credited another amount than claimed"
                    );
                    self.fault();
                }
                tracing::debug!(
                    lease = %lease_id,
                    unspent = unspent.get(),
                    "lease manager: released a lease"
                );
                return Judged::Done;
            }
            CallEnd::Answered(Err(error)) => {
                if !matches!(error, AllocateError::Storage(_)) {
                    self.note_acquire_answered(true);
                }
                error
            }
            CallEnd::TimedOut => {
                // I22: it may have settled; the next attempt finds out.
                bump(&counters.release_timeouts, 1);
                tracing::debug!(
                    lease = %lease_id,
                    "lease manager: release timed out; trying again next pass"
                );
                return Judged::Keep(lease);
            }
            CallEnd::Stopped(deadline) => return Judged::Stopped(lease, deadline),
        };
        bump(&counters.release_refused[error.index()], 1);
        match release_refusal(&error) {
            ReleaseRefusal::Settled => {
                bump(&counters.released, 1);
                // Settled by an earlier release whose answer was lost, or by
                // reclaim: either put at least the unspent units back in the
                // balance, but when is unknown, so evidence published since
                // may count them already. Withdrawn rather than raised: a
                // request meanwhile is answered transiently, and the next
                // grant call publishes the store's word again.
                if lease.grant().account_id == self.slot.account() {
                    self.evidence = None;
                    self.slot.publish_funding(None);
                }
                tracing::debug!(
                    lease = %lease_id,
                    %error,
                    "lease manager: the lease was settled already"
                );
            }
            ReleaseRefusal::Fenced => {
                bump(&counters.released, 1);
                tracing::error!(
                    lease = %lease_id,
                    "lease manager: the store fenced a release; dropping the lease and \
                     taking the serving one out of the slot"
                );
                self.clear_slot_after_fence();
            }
            ReleaseRefusal::Retry => {
                // Counted, and logged as a timeout is: the lease is
                // retried at every pass, and an outage would repeat this
                // for every parked lease of every account.
                tracing::debug!(
                    lease = %lease_id,
                    %error,
                    "lease manager: release failed; trying again next pass"
                );
                return Judged::Keep(lease);
            }
            ReleaseRefusal::NoRoom => {
                tracing::warn!(
                    lease = %lease_id,
                    unspent = unspent.get(),
                    %error,
                    "lease manager: the balance has no room for the lease's unspent units; \
                     trying again next pass"
                );
                return Judged::Keep(lease);
            }
            ReleaseRefusal::Integrity => {
                tracing::error!(
                    lease = %lease_id,
                    unspent = unspent.get(),
                    %error,
                    "lease manager: the store refused a release as an accounting fault"
                );
                self.withheld.push(lease);
                self.fault();
            }
        }
        Judged::Done
    }

    /// I26: after a fenced answer the instance's view of its leases is in doubt,
    /// so the serving lease stops serving until a fresh grant replaces it. It
    /// is parked, never dropped: it may well still be ours, and a release
    /// either returns its units or says it is not.
    fn clear_slot_after_fence(&mut self) {
        // As when an expired lease is parked (see `retire_expired`), and
        // the books are in doubt: nothing is shown until a grant call.
        self.evidence = None;
        self.slot.publish_funding(None);
        if let Some(serving) = self.slot.take() {
            self.park(serving);
        }
    }

    /// Withdraws readiness for good and stops spending: the slot's lease is
    /// parked and nothing is installed again (invariant 3).
    fn fault(&mut self) {
        if !self.shared.faulted.swap(true, Ordering::AcqRel) {
            tracing::error!(
                "lease manager: integrity fault; readiness withdrawn for good and this \
                 account is no longer served"
            );
        }
        // As when an expired lease is parked (see `retire_expired`): and
        // nothing is installed again, so a request meets a transient
        // refusal for the faulted account, not a 402 on evidence that
        // leaves the parked lease out, nor one on evidence shown again once
        // it is released.
        self.evidence = None;
        self.slot.publish_funding(None);
        if let Some(serving) = self.slot.take() {
            self.park(serving);
        }
        self.publish_readiness();
    }

    fn park(&mut self, lease: Arc<LocalLease>) {
        self.parked.push_back(lease);
    }

    /// The allocator's last word on the account's funds, counting every
    /// unit of this manager's but the serving lease's (which admission adds
    /// itself): the balance the store described, raised by what releases
    /// returned since and by what the parked leases hold. Those are in
    /// neither that balance nor the slot until their release returns them;
    /// left out, the evidence would rule out quotes the account can fund
    /// (402, never retry). A parked lease's count is what it holds now: a
    /// reservation on it released later only adds to it, so the evidence
    /// never overstates what its release returns.
    fn evidence_with_parked(&self) -> Option<BalanceShortfall> {
        let evidence = self.evidence?;
        let account = self.slot.account();
        let parked = self
            .parked
            .iter()
            .filter(|lease| lease.grant().account_id == account)
            .fold(CostUnits::ZERO, |held, lease| {
                held.checked_add(lease.remaining())
                    .unwrap_or(CostUnits::MAX)
            });
        Some(BalanceShortfall {
            remaining: evidence
                .remaining
                .checked_add(parked)
                .unwrap_or(CostUnits::MAX),
            ..evidence
        })
    }

    /// [`evidence_with_parked`](Self::evidence_with_parked) while in force:
    /// what decides whether a refused quote is worth keeping for a fold.
    fn evidence_in_force(&self) -> Option<BalanceShortfall> {
        self.evidence_with_parked()
            .and_then(|evidence| evidence.in_force(self.clock.now()))
    }

    /// Publishes [`evidence_with_parked`](Self::evidence_with_parked): as
    /// settled while every parked lease is quiescent (what it holds is
    /// final), otherwise as unsettled, since a request on a parked lease
    /// released for nothing gives it units back after the figure was taken,
    /// and the slot's evidence is not shown again until the next inspection.
    /// Admission answers no quote as final on unsettled evidence; readiness
    /// still reads it (I23).
    fn show_evidence(&self) {
        // Quiescence first: a lease quiet then stays quiet, so what it holds
        // when counted next is final. Counted first, a request released for
        // nothing in between would give it units the count missed.
        let settled = self.parked.iter().all(is_quiescent);
        let evidence = self.evidence_with_parked();
        if settled {
            self.slot.publish_funding(evidence);
        } else {
            self.slot.publish_unsettled_funding(evidence);
        }
    }

    /// Returns what it can until `deadline`, then abandons the rest (I25).
    async fn wind_down(mut self, deadline: Instant) -> LeaseManagerReport {
        // As when an expired lease is parked (see `retire_expired`); the
        // release pass shows it again with the lease counted.
        self.slot.publish_funding(None);
        if let Some(serving) = self.slot.take() {
            self.park(serving);
        }
        self.note_holdings();
        self.publish_readiness();
        let before = self.shared.counters.stats();
        loop {
            // Not interruptible, so the pass cannot end with `Stopped`.
            let store_failed = self
                .release_pass(deadline, false)
                .await
                .is_ok_and(|pass| pass.store_failed);
            // What a cut-off at the deadline reports as abandoned.
            self.note_holdings();
            let now = Instant::now();
            if self.parked.is_empty() || now >= deadline {
                break;
            }
            // A lease a request still holds is looked at again shortly. A
            // store that just failed is given the poll interval to recover,
            // but the next pass starts no later than one call's timeout
            // before the deadline, so one failure does not abandon a lease
            // with most of the budget left, nor leave the first lease it
            // tries a short call.
            let wake = if store_failed {
                let next_poll = after(now, self.config.poll_interval);
                deadline
                    .checked_sub(self.config.store_call_timeout)
                    .filter(|last_try| *last_try > now)
                    .map_or(next_poll, |last_try| next_poll.min(last_try))
            } else {
                after(now, QUIESCENCE_POLL)
            };
            sleep_until(deadline.min(wake)).await;
        }
        self.abandon_rest(&before)
    }

    fn abandon_rest(&mut self, before: &LeaseStats) -> LeaseManagerReport {
        // What the abandoned leases hold comes back only at TTL reclaim,
        // and a later manager's evidence is its own.
        self.slot.publish_funding(None);
        let counters = &self.shared.counters;
        let mut abandoned = 0_u64;
        let mut abandoned_units = 0_u64;
        for lease in self.parked.drain(..).chain(self.withheld.drain(..)) {
            // I25: never released: a request may still commit against it, or
            // the store refused its claim. TTL reclaim settles it.
            let units = lease.remaining().get();
            tracing::warn!(
                lease = %lease.grant().lease_id,
                units,
                quiescent = is_quiescent(&lease),
                "lease manager: lease abandoned at shutdown; it settles at TTL reclaim"
            );
            abandoned += 1;
            abandoned_units = abandoned_units.saturating_add(units);
        }
        bump(&counters.abandoned, abandoned);
        self.note_holdings();
        LeaseManagerReport::since(
            before,
            &counters.stats(),
            (abandoned, abandoned_units),
            self.shared.is_faulted(),
        )
    }

    fn publish_readiness(&self) {
        // I29: an idle slot's account is served once the lapsed lease's
        // units are back in the balance: the first request fetches them.
        let lapsed_released = !self
            .parked
            .iter()
            .any(|lease| Some(lease.grant().lease_id) == self.lapsed);
        let ready = !self.shared.is_faulted()
            && (serving(&self.slot, self.clock.as_ref())
                || (self.slot.is_idle() && lapsed_released));
        self.shared.readiness.send_if_modified(|current| {
            let changed = *current != ready;
            *current = ready;
            changed
        });
    }

    /// Counts the leases the task holds outside the slot, and their units:
    /// what a task that dies or is cut off reports it left (see
    /// [`LeaseManager::leftovers`]). Taken before every store call, the
    /// awaits a task can end at, and between inspections.
    fn note_holdings(&self) {
        self.count_holdings([]);
    }

    /// [`note_holdings`](Self::note_holdings), with `also` held outside
    /// both the slot and the parked list (a lease being released or
    /// folded, those a release pass has looked at).
    fn count_holdings<'a>(&self, also: impl IntoIterator<Item = &'a Arc<LocalLease>>) {
        let (mut leases, mut units) = (0_u64, 0_u64);
        let mut count = |lease: &Arc<LocalLease>| {
            leases += 1;
            units = units.saturating_add(lease.remaining().get());
        };
        self.parked
            .iter()
            .chain(&self.withheld)
            .for_each(&mut count);
        also.into_iter().for_each(count);
        self.shared.held_leases.store(leases, Ordering::Relaxed);
        self.shared.held_units.store(units, Ordering::Relaxed);
    }
}

/// A grant's size and mark, from [`Task::sizing`].
#[derive(Debug, Clone, Copy)]
struct Sizing {
    /// The units asked for: at least `target_grant`.
    request: CostUnits,
    /// The low-water mark of a grant larger than it.
    mark: CostUnits,
}

/// What [`Task::defer_fold`] decided for a lease that refused a quote
/// while busy.
struct DeferredFold {
    /// The quote it refused.
    needed: CostUnits,
    /// Whether to acquire a replacement large enough for it.
    chase: bool,
    /// Whether the lease is low anyway, and is replaced if not chased.
    draining: bool,
}

/// What a release pass ran into.
struct PassOutcome {
    /// A release failed with a storage error or a timeout.
    store_failed: bool,
}

fn release_refusal(error: &AllocateError) -> ReleaseRefusal {
    match error {
        AllocateError::UnknownLease | AllocateError::LeaseNotActive => ReleaseRefusal::Settled,
        AllocateError::Fenced => ReleaseRefusal::Fenced,
        AllocateError::Storage(_) => ReleaseRefusal::Retry,
        AllocateError::BalanceOverflow => ReleaseRefusal::NoRoom,
        // A release draws no grant, so a balance or account refusal is as
        // much a contract breach as an over-claim (I15).
        _ => ReleaseRefusal::Integrity,
    }
}

fn fold_refusal(error: &AllocateError) -> FoldRefusal {
    match error {
        // The account cannot add what the quote needs, or cannot be granted
        // to at all: I18, the step rolled back and the old lease is active.
        AllocateError::BalanceExhausted(_)
        | AllocateError::BalanceInsufficient(_)
        | AllocateError::InsufficientBalance
        | AllocateError::AccountInactive
        | AllocateError::UnknownAccount
        | AllocateError::InvalidTtl
        | AllocateError::InvalidRequest
        // No room yet for the unspent units: refused before anything moved.
        | AllocateError::BalanceOverflow => FoldRefusal::RolledBack,
        AllocateError::UnknownLease | AllocateError::LeaseNotActive => {
            FoldRefusal::Gone { fenced: false }
        }
        AllocateError::Fenced => FoldRefusal::Gone { fenced: true },
        AllocateError::Storage(_) => FoldRefusal::Ambiguous,
        // An over-claimed unspent count, or a variant this code does not
        // know: the books disagree.
        _ => FoldRefusal::Integrity,
    }
}

/// Whether `evidence` rules `needed` out even counting the `held` units of
/// the account's lease: admission's rule for which refusals it records
/// (I27). Given the evidence shown to requests
/// ([`Task::evidence_in_force`]), a quote forgotten by this rule is not
/// recorded again while that evidence stands.
fn rules_out_beside(
    evidence: Option<BalanceShortfall>,
    needed: CostUnits,
    held: CostUnits,
) -> bool {
    evidence.is_some_and(|evidence| {
        BalanceShortfall {
            remaining: evidence
                .remaining
                .checked_add(held)
                .unwrap_or(CostUnits::MAX),
            ..evidence
        }
        .rules_out(needed)
    })
}

/// Whether no request can debit or credit `lease` any more, so its
/// `remaining()` is final (I6). The caller's own `Arc` must be the only one.
fn is_quiescent(lease: &Arc<LocalLease>) -> bool {
    if Arc::strong_count(lease) != 1 {
        return false;
    }
    // A request debits while it holds the lease and lets go of the lease
    // (a release decrement) after. This fence orders the shard views read
    // next after that count: without it a weakly ordered CPU may read a
    // shard's count from before the debit and the lease's from after the
    // let-go, and call a lease with a debit in flight quiescent.
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    lease.is_only_local_view()
}

/// Whether the slot holds a lease that serves: inside its usability
/// window, and not drained while the allocator cannot be reached. A lease
/// with nothing left while the allocator does not answer serves nobody:
/// admission answers every quote above zero `LeaseUnavailable` (I5), and
/// the instance is not ready until a grant comes (I29). In normal running a
/// drained lease is refilled within a store call, so this does not flap. A
/// lease with a few units left still serves the quotes they cover, so it
/// counts as serving whatever larger quotes it refuses.
fn serving(slot: &LeaseSlot, clock: &dyn Clock) -> bool {
    let now = clock.now();
    let unreachable = slot.allocator_unreachable();
    slot.with_lease(|lease| {
        lease.is_some_and(|lease| {
            now < lease.usable_until() && !(unreachable && lease.remaining().is_zero())
        })
    })
}

/// How much of `slack`, the part of a lease's usable window before its
/// replacement lead, is given up to replace it earlier: up to a quarter,
/// spread by the lease's id. Leases granted together (every account's at
/// start, or after an outage) would otherwise all be replaced together,
/// one lease's life later and at every life after, in bursts the store
/// must answer within a call's timeout; spread, each generation is
/// replaced over a wider span than the last (I28). The id decides, so the
/// spread needs no randomness and is the same on every run.
fn renewal_spread(lease: LeaseId, slack: SignedDuration) -> SignedDuration {
    if !slack.is_positive() {
        return SignedDuration::ZERO;
    }
    // SplitMix64's finaliser: consecutive ids land far apart.
    let mut mixed = lease.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
    mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    mixed ^= mixed >> 31;
    // A fraction of a quarter of the slack, in 1/1024ths.
    let share = i32::try_from(mixed % 1024).unwrap_or(0);
    slack / 4 / 1024 * share
}

/// Whether a grant call ended with the store saying it never made it (no
/// connection was free): it left no grant behind, so it neither counts as
/// a call without an answer nor puts the cadence back (I22).
fn made_no_call<T>(end: &CallEnd<Result<T, AllocateError>>) -> bool {
    matches!(end, CallEnd::Answered(Err(AllocateError::Storage(error))) if error.made_no_call())
}

/// Runs an allocator call until `give_up_at` (I22) and, when `stop` is
/// given, until a shutdown is requested, whichever comes first. An answer
/// ready together with the request still counts.
async fn bounded<T>(
    stop: Option<&mut watch::Receiver<Option<Instant>>>,
    give_up_at: Instant,
    call: impl Future<Output = T>,
) -> CallEnd<T> {
    let call = timeout_at(give_up_at, call);
    let Some(stop) = stop else {
        return call.await.map_or(CallEnd::TimedOut, CallEnd::Answered);
    };
    tokio::select! {
        biased;
        answer = call => answer.map_or(CallEnd::TimedOut, CallEnd::Answered),
        deadline = stop_requested(stop) => CallEnd::Stopped(deadline),
    }
}

/// Resolves with the shutdown deadline once a shutdown has been requested.
async fn stop_requested(stop: &mut watch::Receiver<Option<Instant>>) -> Instant {
    loop {
        if let Some(deadline) = *stop.borrow_and_update() {
            return deadline;
        }
        if stop.changed().await.is_err() {
            // The handle is gone without a request; its `Drop` aborts this
            // task. Waiting beats spinning on a closed channel.
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_ring_before_the_wait_is_answered_at_once() {
        let bell = Doorbell::default();
        bell.request_refill();
        tokio::time::timeout(Duration::from_secs(1), bell.answer())
            .await
            .expect("a ring that came first is kept until answered");
    }

    #[tokio::test(start_paused = true)]
    async fn a_ring_during_the_wait_wakes_the_waiter() {
        let bell = Arc::new(Doorbell::default());
        let ringer = Arc::clone(&bell);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(3)).await;
            ringer.request_refill();
        });
        let began = Instant::now();
        tokio::time::timeout(Duration::from_secs(1), bell.answer())
            .await
            .expect("the ring wakes the waiting task");
        assert_eq!(began.elapsed(), Duration::from_millis(3));
    }

    #[tokio::test(start_paused = true)]
    async fn many_rings_before_an_answer_are_one_wake() {
        let bell = Doorbell::default();
        for _ in 0..5 {
            bell.request_refill();
        }
        bell.answer().await;
        assert!(
            tokio::time::timeout(Duration::from_secs(1), bell.answer())
                .await
                .is_err(),
            "the answered ring is consumed; waiting again blocks"
        );
    }

    /// I25: a task still running when the enclosing deadline passes is cut
    /// off, and the report names what it held as abandoned, counted where
    /// the metrics read it, rather than losing it with the task.
    #[tokio::test(start_paused = true)]
    async fn a_manager_cut_off_at_the_deadline_reports_what_it_held() {
        use crate::model::{AccountStatus, EnforcementMode, LocalSharding};
        use crate::store::{AccountSpec, GrantPolicy, ManualClock, MemoryStore, TailSharing};
        use jiff::Timestamp;
        let now = Timestamp::from_second(1_700_000_000).expect("in range");
        let store = Arc::new(
            MemoryStore::new(GrantPolicy {
                max_ttl: SignedDuration::from_secs(60),
                reclaim_grace: SignedDuration::from_secs(10),
                tail: TailSharing {
                    instances: 1,
                    min_grant: CostUnits(1),
                },
            })
            .expect("a valid policy"),
        );
        let account = store
            .create_account(
                AccountSpec {
                    balance: CostUnits(1_000),
                    mode: EnforcementMode::Strict,
                    status: AccountStatus::Active,
                    refill: None,
                },
                now,
            )
            .expect("created");
        let slot = Arc::new(LeaseSlot::new(account, LocalSharding::Single));
        let manager = LeaseManager::spawn(
            Arc::clone(&store) as Arc<dyn LeaseAllocator>,
            Arc::clone(&slot),
            Arc::new(ManualClock::new(now)),
            LeaseManagerConfig {
                account,
                target_grant: CostUnits(300),
                low_water: CostUnits(50),
                lease_ttl: SignedDuration::from_secs(60),
                expiry_safety_margin: SignedDuration::from_secs(5),
                poll_interval: Duration::from_millis(100),
                store_call_timeout: Duration::from_millis(200),
                shutdown_release_deadline: Duration::from_secs(1),
            },
        )
        .expect("a valid configuration");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(slot.load_observed().is_some(), "a lease serves");
        // The enclosing budget is already spent: the task gets no turn.
        let report = manager.shutdown_by(Instant::now()).await;
        assert_eq!((report.released, report.abandoned), (0, 1));
        assert_eq!(report.abandoned_units, 300);
        assert!(!report.task_died, "cut off, not dead");
        assert_eq!(report.stats.abandoned, 1);
        assert!(slot.load_observed().is_none(), "no one serves from it now");
        let view = store.account(account, now).expect("known");
        assert_eq!(view.leased, CostUnits(300), "left for TTL reclaim");
    }

    #[test]
    fn a_release_refusal_is_judged_by_its_variant() {
        use crate::store::StoreError;
        let judged = |error: AllocateError| match release_refusal(&error) {
            ReleaseRefusal::Settled => "settled",
            ReleaseRefusal::Fenced => "fenced",
            ReleaseRefusal::Retry => "retry",
            ReleaseRefusal::NoRoom => "no room",
            ReleaseRefusal::Integrity => "integrity",
        };
        assert_eq!(judged(AllocateError::UnknownLease), "settled");
        assert_eq!(judged(AllocateError::LeaseNotActive), "settled");
        assert_eq!(judged(AllocateError::Fenced), "fenced");
        assert_eq!(
            judged(AllocateError::Storage(StoreError::new("x"))),
            "retry"
        );
        assert_eq!(judged(AllocateError::InvalidRelease), "integrity");
        assert_eq!(judged(AllocateError::BalanceOverflow), "no room");
        assert_eq!(judged(AllocateError::AccountInactive), "integrity");
    }

    #[test]
    fn a_consolidation_refusal_is_judged_by_what_it_says_of_the_old_lease() {
        use crate::model::BalanceExhaustion;
        use crate::store::StoreError;
        let judged = |error: AllocateError| match fold_refusal(&error) {
            FoldRefusal::RolledBack => "rolled back",
            FoldRefusal::Gone { fenced: false } => "gone",
            FoldRefusal::Gone { fenced: true } => "fenced",
            FoldRefusal::Ambiguous => "ambiguous",
            FoldRefusal::Integrity => "integrity",
        };
        let exhausted = AllocateError::BalanceExhausted(BalanceExhaustion { period_end: None });
        assert_eq!(judged(exhausted), "rolled back");
        assert_eq!(judged(AllocateError::InsufficientBalance), "rolled back");
        assert_eq!(judged(AllocateError::AccountInactive), "rolled back");
        assert_eq!(judged(AllocateError::InvalidRequest), "rolled back");
        assert_eq!(judged(AllocateError::LeaseNotActive), "gone");
        assert_eq!(judged(AllocateError::UnknownLease), "gone");
        assert_eq!(judged(AllocateError::Fenced), "fenced");
        assert_eq!(
            judged(AllocateError::Storage(StoreError::new("x"))),
            "ambiguous"
        );
        assert_eq!(judged(AllocateError::InvalidRelease), "integrity");
        assert_eq!(judged(AllocateError::BalanceOverflow), "rolled back");
    }
}
