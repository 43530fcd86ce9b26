//! One request's charge: pending, then committed at execution start or
//! released for zero.
//!
//! ```text
//!   PENDING_LEASE ───┬──► COMMITTED_LEASE
//!                    ├──► COMMITTED_OVERAGE   (Elastic, window lapsed at start)
//!                    └──► RELEASED
//!   PENDING_OVERAGE ─┬──► COMMITTED_OVERAGE
//!                    └──► RELEASED
//! ```
//!
//! Every arrow is one compare-exchange on one word, so a commit and a cancel
//! racing for the same reservation can never both win (I3). The terminal
//! phase, not the funding the reservation was admitted on, says what pays for
//! the charge.

use std::sync::Arc;

use jiff::Timestamp;

use crate::model::{
    AccountId, AccountOverage, CostUnits, DenyReason, EnforcementMode, KeyId, LeaseDebit,
    LeaseHold, LocalLease, Locality, PolicyRevision, RequestId, UsageEvent, UsageSource,
};
use crate::sync::{AtomicBool, AtomicU64, Ordering, with_exclusive};

const PENDING_LEASE: u64 = 0;
const PENDING_OVERAGE: u64 = 1;
const COMMITTED_LEASE: u64 = 2;
const COMMITTED_OVERAGE: u64 = 3;
const RELEASED: u64 = 4;

/// What [`Reservation::cancel`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The reservation is released (now or earlier): nothing is charged.
    ZeroCharged,
    /// Execution had started: the full quote stands.
    AlreadyCommitted {
        /// The units charged.
        units: CostUnits,
    },
}

/// Why [`Reservation::commit_at_execution_start`] did not commit. In every
/// case the caller must not run the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitError {
    /// The funding could not stand at execution start, or (for an admitted
    /// request's context) the instance can no longer start its handler:
    /// its shutdown began, or its usage writer gave up
    /// ([`ShuttingDown`](DenyReason::ShuttingDown)). The reservation was
    /// released for zero. The reason keeps its own retry class: a lapsed
    /// lease is [`FundingExpiredAtStart`](DenyReason::FundingExpiredAtStart)
    /// under Strict, and under Elastic when the overage cap is spent too (a
    /// retry is admitted on the replacement lease, I12); the overage
    /// fallback's other refusals are reported as they were given.
    Denied(DenyReason),
    /// A cancel ([`Reservation::cancel`], or [`CancelHandle::cancel`] on a
    /// split charge) released the reservation first. Dropping a
    /// [`CancelHandle`] does not cancel.
    AlreadyReleased,
    /// The reservation was committed before. Committing twice is a caller
    /// bug, reported rather than charged twice.
    AlreadyCommitted,
}

/// What a reservation may settle against at execution start.
///
/// Passed to the commit rather than stored in the reservation: the overage
/// counter is shared by every request of the account, and holding a
/// reference to it in every reservation would put a shared reference count on
/// the request path for a fallback most requests never use.
#[derive(Debug, Clone, Copy)]
pub enum CommitFunding<'a> {
    /// Strict: a lapsed lease releases for zero.
    LeaseOnly,
    /// Elastic: a lapsed lease may settle against the account's overage,
    /// bounded by `cap`.
    OverageFallback {
        /// The account's overage counter. It must be the counter of the
        /// account that funded the reservation.
        overage: &'a AccountOverage,
        /// The overage cap in force for this request.
        cap: CostUnits,
    },
}

impl<'a> CommitFunding<'a> {
    /// The commit funding an enforcement mode allows.
    #[inline]
    #[must_use]
    pub fn from_mode(mode: EnforcementMode, counter: &'a AccountOverage) -> Self {
        match mode.overage_cap() {
            None => Self::LeaseOnly,
            Some(cap) => Self::OverageFallback {
                overage: counter,
                cap,
            },
        }
    }
}

/// One request's debited-but-uncommitted units.
///
/// Opened by [`reserve`](Self::reserve) (or
/// [`reserve_overage`](Self::reserve_overage)) and resolved exactly once: by
/// [`commit_at_execution_start`](Self::commit_at_execution_start), by
/// [`cancel`](Self::cancel), or by `Drop`, which releases a reservation still
/// pending (I4).
///
/// # Invariants
///
/// - The phase moves out of pending at most once, by compare-exchange (I3).
/// - A release returns the units to the counter they came from, exactly once
///   (I4, I6).
/// - No commit against a lease at or after its usability window (I2).
#[derive(Debug)]
pub struct Reservation {
    funding: Funding,
    units: CostUnits,
    /// A whole word for a handful of values: with a byte, the seven bytes
    /// after it are padding the reservation shares with the denial in
    /// `Result<Reservation, DenyReason>`, and moving that result out of
    /// admission copied them as two overlapping four-byte halves whose
    /// re-read stalled the CPU's store forwarding (about 4 ns a request,
    /// `benches/admission.rs`).
    phase: AtomicU64,
}

/// Where the units were debited, and so where a release returns them.
#[derive(Debug)]
enum Funding {
    Lease(LeaseDebit),
    Overage(Arc<AccountOverage>),
    /// A committed charge whose lease view was handed on with its usage
    /// event; nothing is left to refund.
    HandedOn,
}

impl Funding {
    /// The pending phase for this funding. Derived, never stored, so the
    /// value every transition compares against cannot drift.
    const fn pending(&self) -> u64 {
        match self {
            Self::Lease(_) | Self::HandedOn => PENDING_LEASE,
            Self::Overage(_) => PENDING_OVERAGE,
        }
    }
}

impl Reservation {
    /// Debits `units` from `lease` at the calling thread's locality.
    ///
    /// # Errors
    ///
    /// [`DenyReason::LeaseExpired`] or [`DenyReason::LeaseExhausted`].
    #[inline]
    pub fn reserve(
        lease: &LocalLease,
        units: CostUnits,
        now: Timestamp,
    ) -> Result<Self, DenyReason> {
        Self::reserve_at_locality(lease, units, now, Locality::current())
    }

    /// Debits `units` from `lease`, preferring the shard of `locality`.
    ///
    /// # Errors
    ///
    /// As [`reserve`](Self::reserve).
    #[inline]
    pub fn reserve_at_locality(
        lease: &LocalLease,
        units: CostUnits,
        now: Timestamp,
        locality: Locality,
    ) -> Result<Self, DenyReason> {
        let debit = lease.try_reserve_at(units, now, locality)?;
        Ok(Self::leased(debit, units))
    }

    /// [`reserve_at_locality`](Self::reserve_at_locality) without recording
    /// a refusal on the lease: admission records the refusals it finds
    /// fundable itself (I27).
    #[inline]
    pub(crate) fn reserve_unrecorded(
        lease: &LocalLease,
        units: CostUnits,
        now: Timestamp,
        locality: Locality,
    ) -> Result<Self, DenyReason> {
        let debit = lease.try_reserve_unrecorded(units, now, locality)?;
        Ok(Self::leased(debit, units))
    }

    #[inline]
    pub(crate) fn leased(debit: LeaseDebit, units: CostUnits) -> Self {
        Self {
            funding: Funding::Lease(debit),
            units,
            phase: AtomicU64::new(PENDING_LEASE),
        }
    }

    /// Extends `units` of overage against `cap`, for an Elastic account whose
    /// lease cannot fund the quote.
    ///
    /// There is no `now`: overage is never granted, so it has no window that
    /// could lapse.
    ///
    /// # Errors
    ///
    /// One of the three overage refusals (I11).
    // Inlined like the leased path: an out-of-line call returns the
    // reservation through memory, which keeps a caller choosing between the
    // two from holding the result in registers, leased requests included.
    #[inline]
    pub fn reserve_overage(
        overage: &Arc<AccountOverage>,
        units: CostUnits,
        cap: CostUnits,
    ) -> Result<Self, DenyReason> {
        overage.try_debit(units, cap)?;
        Ok(Self {
            funding: Funding::Overage(Arc::clone(overage)),
            units,
            phase: AtomicU64::new(PENDING_OVERAGE),
        })
    }

    /// The units this reservation charges if it commits.
    #[inline]
    #[must_use]
    pub fn units(&self) -> CostUnits {
        self.units
    }

    /// The account the units are charged to.
    #[must_use]
    pub fn account_id(&self) -> AccountId {
        match &self.funding {
            Funding::Lease(debit) => debit.grant().account_id,
            Funding::Overage(overage) => overage.account_id(),
            // Only the request context hands a charge on (`take_hold`, after
            // building its event), and it keeps its own copy of the account;
            // the event the hold rides with names it too.
            Funding::HandedOn => AccountId(0),
        }
    }

    /// Whether a commit that falls back to overage can find `counter`
    /// through this reservation alone: it is funded by `counter`, or by a
    /// lease that carries it (see [`LocalLease::with_overage`]).
    pub(crate) fn reaches_overage(&self, counter: &Arc<AccountOverage>) -> bool {
        match &self.funding {
            Funding::Lease(debit) => debit
                .overage()
                .is_some_and(|attached| Arc::ptr_eq(attached, counter)),
            Funding::Overage(funded) => Arc::ptr_eq(funded, counter),
            Funding::HandedOn => false,
        }
    }

    /// The overage counter a commit at `now` falls back to: the one the
    /// funding lease carries, once its window has closed. `None` while the
    /// window is open, for a lease without one, and for overage funding,
    /// whose commit needs no fallback.
    pub(crate) fn lapsed_fallback(&self, now: Timestamp) -> Option<&Arc<AccountOverage>> {
        match &self.funding {
            Funding::Lease(debit) if now >= debit.terms().usable_until => debit.overage(),
            _ => None,
        }
    }

    /// Whether admission funded this reservation from overage. A leased
    /// reservation that fell back to overage at commit is still `false`
    /// here; [`usage_event`](Self::usage_event) says what paid.
    #[must_use]
    pub fn admitted_as_overage(&self) -> bool {
        matches!(self.funding, Funding::Overage(_))
    }

    /// Whether the charge stands.
    #[must_use]
    pub fn is_committed(&self) -> bool {
        matches!(
            self.phase.load(Ordering::Acquire),
            COMMITTED_LEASE | COMMITTED_OVERAGE
        )
    }

    /// Whether the reservation was released for zero.
    #[must_use]
    pub fn is_released(&self) -> bool {
        self.phase.load(Ordering::Acquire) == RELEASED
    }

    /// Commits the full quote because execution is starting; from here the
    /// charge stands however execution ends.
    ///
    /// A leased reservation whose usability window has closed cannot commit
    /// against the lease (I2): under [`CommitFunding::LeaseOnly`] it is
    /// released for zero; under [`CommitFunding::OverageFallback`] it settles
    /// against overage in the same single transition, or, if overage refuses,
    /// is released for zero with that refusal.
    ///
    /// # Errors
    ///
    /// See [`CommitError`]; on any error the work must not run.
    #[inline]
    pub fn commit_at_execution_start(
        &self,
        now: Timestamp,
        funding: CommitFunding<'_>,
    ) -> Result<CostUnits, CommitError> {
        let claimed = match &self.funding {
            Funding::Lease(debit) => {
                if now >= debit.terms().usable_until {
                    return self.commit_after_lapse(debit, funding);
                }
                self.transition(PENDING_LEASE, COMMITTED_LEASE)
            }
            // The units are already pending in the counter; publishing the
            // claim only marks them irrevocable.
            Funding::Overage(overage) => overage.publish_claim(self.units, || {
                self.transition(PENDING_OVERAGE, COMMITTED_OVERAGE)
            }),
            // Handed on only after it committed.
            Funding::HandedOn => Err(COMMITTED_LEASE),
        };
        match claimed {
            Ok(_) => Ok(self.units),
            Err(phase) => Err(Self::lost_to(phase)),
        }
    }

    /// Commits a reservation this caller owns outright: the same rules as
    /// [`commit_at_execution_start`](Self::commit_at_execution_start), and the
    /// same outcome.
    ///
    /// `&mut self` proves no cancel can race the commit (a reservation that a
    /// waiter may cancel is [`split`](Self::split) and committed through its
    /// shared reference), so the common case (a lease inside its window) is
    /// a plain write rather than a compare-exchange. This is what the request
    /// path uses.
    ///
    /// # Errors
    ///
    /// See [`CommitError`]; on any error the work must not run.
    #[inline]
    pub fn commit_owned(
        &mut self,
        now: Timestamp,
        funding: CommitFunding<'_>,
    ) -> Result<CostUnits, CommitError> {
        if let Funding::Lease(debit) = &self.funding
            && now < debit.terms().usable_until
        {
            // I3: exclusive access, so reading pending and writing committed
            // cannot be interleaved with another resolution.
            return with_exclusive(&mut self.phase, |phase| match *phase {
                PENDING_LEASE => {
                    *phase = COMMITTED_LEASE;
                    Ok(self.units)
                }
                other => Err(Self::lost_to(other)),
            });
        }
        // A lapsed window or an overage receipt: the shared path handles both.
        self.commit_at_execution_start(now, funding)
    }

    /// Releases the reservation for zero if it is still pending.
    ///
    /// Idempotent: a second cancel, or a cancel after a release, returns
    /// [`CancelOutcome::ZeroCharged`] without crediting twice.
    #[inline]
    pub fn cancel(&self) -> CancelOutcome {
        match self.release() {
            Ok(()) | Err(RELEASED) => CancelOutcome::ZeroCharged,
            Err(_) => CancelOutcome::AlreadyCommitted { units: self.units },
        }
    }

    /// The billing record, once committed; `None` otherwise.
    ///
    /// The source comes from the terminal phase: a leased reservation that
    /// fell back to overage bills as overage, because its lease lapsed and
    /// may already be reclaimed, and an event naming it would be rejected.
    /// `request_id` is the event's idempotency key (I8).
    #[inline]
    #[must_use]
    pub fn usage_event(
        &self,
        request_id: RequestId,
        now: Timestamp,
        policy_revision: PolicyRevision,
        key_id: Option<KeyId>,
    ) -> Option<UsageEvent> {
        let source = match (self.phase.load(Ordering::Acquire), &self.funding) {
            (COMMITTED_LEASE, Funding::Lease(debit)) => {
                let grant = debit.grant();
                UsageSource::Leased {
                    lease_id: grant.lease_id,
                    fencing_token: grant.fencing_token,
                }
            }
            (COMMITTED_OVERAGE, _) => UsageSource::Overage,
            _ => return None,
        };
        Some(UsageEvent {
            request_id,
            account_id: self.account_id(),
            source,
            units: self.units,
            at: now,
            policy_revision,
            key_id,
        })
    }

    /// Moves the reservation into a shared charge, returning it and a cancel
    /// handle for a waiter that races the worker.
    ///
    /// The one allocation the model makes, and only for callers that ask.
    #[must_use]
    pub fn split(self) -> (Arc<SharedCharge>, CancelHandle) {
        let shared = Arc::new(SharedCharge {
            reservation: self,
            cancel_requested: AtomicBool::new(false),
        });
        let handle = CancelHandle(Arc::clone(&shared));
        (shared, handle)
    }

    /// The lapsed-window commit. Cold: it runs at most once per lease window
    /// edge.
    #[cold]
    fn commit_after_lapse(
        &self,
        debit: &LeaseDebit,
        funding: CommitFunding<'_>,
    ) -> Result<CostUnits, CommitError> {
        // I9: zero units need no funds, so a closed window cannot refuse
        // them. They bill as zero units of overage, since the lease may
        // already be reclaimed.
        if self.units.is_zero() {
            return self
                .transition(PENDING_LEASE, COMMITTED_OVERAGE)
                .map(|_| self.units)
                .map_err(Self::lost_to);
        }
        let CommitFunding::OverageFallback { overage, cap } = funding else {
            return self.release_denied(DenyReason::FundingExpiredAtStart);
        };
        if overage.account_id() != debit.grant().account_id {
            debug_assert!(
                false,
                "the overage fallback must use the reservation's account"
            );
            return self.release_denied(DenyReason::FundingExpiredAtStart);
        }
        // Not required for correctness (the claim below decides), but it
        // spares a debit that would be handed straight back.
        if self.phase.load(Ordering::Acquire) != PENDING_LEASE {
            return self.release_denied(DenyReason::FundingExpiredAtStart);
        }
        // The overage is funded before the claim, so a won claim never names
        // units the counter does not hold (I3, I10).
        let tentative = match overage.debit_before_claim(self.units, cap) {
            Ok(tentative) => tentative,
            // The request was admitted on a funded lease that lapsed while
            // it waited; a retry is admitted on the replacement lease, so
            // the truthful answer is the transient one, not "the cap is
            // spent, never retry" (I12).
            Err(DenyReason::OverageCapExhausted { .. }) => {
                return self.release_denied(DenyReason::FundingExpiredAtStart);
            }
            Err(refusal) => return self.release_denied(refusal),
        };
        match tentative.publish_commit(|| self.transition(PENDING_LEASE, COMMITTED_OVERAGE)) {
            Ok(_) => {
                // Only the winner of the phase returns the lease's units; a
                // canceller that won instead has returned them itself.
                debit.refund();
                Ok(self.units)
            }
            // The tentative debit went back when its guard dropped.
            Err(phase) => Err(Self::lost_to(phase)),
        }
    }

    #[cold]
    fn release_denied(&self, reason: DenyReason) -> Result<CostUnits, CommitError> {
        match self.release() {
            Ok(()) => Err(CommitError::Denied(reason)),
            Err(phase) => Err(Self::lost_to(phase)),
        }
    }

    /// Pending → released, refunding the units. `Err` carries the phase that
    /// was found instead.
    #[inline]
    fn release(&self) -> Result<(), u64> {
        self.transition(self.funding.pending(), RELEASED)?;
        self.refund();
        Ok(())
    }

    /// Returns the units to the counter they came from. Called only by the
    /// one resolution that moved the phase to released (I4).
    #[inline]
    fn refund(&self) {
        match &self.funding {
            Funding::Lease(debit) => debit.refund(),
            Funding::Overage(overage) => overage.credit(self.units),
            // Only committed charges are handed on; they refund nothing.
            Funding::HandedOn => {}
        }
    }

    /// Takes from a committed charge what must outlive it until its usage
    /// event leaves the process: the view of the lease that funded it (I26).
    /// An overage charge holds no lease.
    ///
    /// The charge stays committed, with nothing left to release: it is
    /// taken in place so the caller need not move it.
    ///
    /// # Panics
    ///
    /// In debug builds, when the charge is not committed.
    #[inline]
    pub(crate) fn take_hold(&mut self) -> Option<LeaseHold> {
        debug_assert!(self.is_committed(), "only a committed charge is handed on");
        match std::mem::replace(&mut self.funding, Funding::HandedOn) {
            Funding::Lease(debit) => Some(debit.into_hold()),
            Funding::Overage(_) | Funding::HandedOn => None,
        }
    }

    /// I3: the one compare-exchange every resolution goes through.
    #[inline]
    fn transition(&self, from: u64, to: u64) -> Result<u64, u64> {
        self.phase
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
    }

    fn lost_to(phase: u64) -> CommitError {
        if phase == RELEASED {
            CommitError::AlreadyReleased
        } else {
            CommitError::AlreadyCommitted
        }
    }
}

impl Drop for Reservation {
    #[inline]
    fn drop(&mut self) {
        // I4: a reservation abandoned while pending charges nothing; a
        // resolved one is left as it is. Dropping needs `&mut self`, so no
        // other thread can be resolving it: a plain read and write suffice.
        let pending = self.funding.pending();
        let released = with_exclusive(&mut self.phase, |phase| {
            let was_pending = *phase == pending;
            if was_pending {
                *phase = RELEASED;
            }
            was_pending
        });
        if released {
            self.refund();
        }
    }
}

/// A reservation shared by a worker that will commit it and a waiter that
/// may cancel it first (for example on timeout or disconnect).
///
/// The reservation's phase still decides the charge. The extra flag records
/// only that cancellation was *asked for*, which a worker that already
/// committed may use to stop work nobody waits for.
#[derive(Debug)]
pub struct SharedCharge {
    reservation: Reservation,
    cancel_requested: AtomicBool,
}

impl SharedCharge {
    /// The shared reservation: commit it from the worker.
    #[must_use]
    pub fn reservation(&self) -> &Reservation {
        &self.reservation
    }

    /// Whether any handle asked to cancel, whether or not that changed the
    /// charge.
    #[must_use]
    pub fn cancel_requested(&self) -> bool {
        self.cancel_requested.load(Ordering::Acquire)
    }

    /// Another cancel handle to this charge.
    #[must_use]
    pub fn cancel_handle(self: &Arc<Self>) -> CancelHandle {
        CancelHandle(Arc::clone(self))
    }
}

/// The waiter's half of a [`SharedCharge`]: it can cancel and observe, never
/// commit.
#[derive(Debug, Clone)]
pub struct CancelHandle(Arc<SharedCharge>);

impl CancelHandle {
    /// Asks to cancel and reports whether the charge stands.
    ///
    /// The request is recorded before the phase is tried, so a worker whose
    /// commit loses to this cancel sees
    /// [`cancel_requested`](SharedCharge::cancel_requested) set. A worker
    /// whose commit wins may or may not see it: it won before the cancel
    /// took effect, and the request charges in full either way.
    pub fn cancel(&self) -> CancelOutcome {
        self.0.cancel_requested.store(true, Ordering::Release);
        self.0.reservation.cancel()
    }

    /// Whether cancellation was asked for through any handle.
    #[must_use]
    pub fn is_cancelled(&self) -> bool {
        self.0.cancel_requested()
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use jiff::SignedDuration;

    use super::*;
    use crate::model::{FencingToken, LeaseGrant, LeaseId, Retry};
    use CancelOutcome::ZeroCharged;
    use CommitError::AlreadyReleased;

    const ACCOUNT: AccountId = AccountId(1);
    const CAP: CostUnits = CostUnits(100);

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).expect("test instants are in range")
    }

    /// A 100-unit lease usable until t=1000.
    fn lease() -> LocalLease {
        LocalLease::new(
            LeaseGrant {
                lease_id: LeaseId(7),
                account_id: ACCOUNT,
                fencing_token: FencingToken(3),
                units: CostUnits(100),
                expires_at: at(1_000),
            },
            CostUnits::ZERO,
        )
    }

    fn overage() -> Arc<AccountOverage> {
        Arc::new(AccountOverage::new(ACCOUNT))
    }

    fn event(r: &Reservation, second: i64) -> Option<UsageEvent> {
        r.usage_event(RequestId(42), at(second), PolicyRevision(9), Some(KeyId(5)))
    }

    fn fallback(o: &AccountOverage) -> CommitFunding<'_> {
        CommitFunding::OverageFallback {
            overage: o,
            cap: CAP,
        }
    }

    // ---- lease-funded reservations -------------------------------------

    #[test]
    fn a_commit_keeps_the_units_and_bills_the_lease() {
        let l = lease();
        let r = Reservation::reserve(&l, CostUnits(30), at(0)).unwrap();
        assert_eq!(l.remaining(), CostUnits(70), "the debit is the quote");
        assert_eq!(
            r.commit_at_execution_start(at(1), CommitFunding::LeaseOnly),
            Ok(CostUnits(30))
        );
        assert!(r.is_committed());
        let billed = event(&r, 2).expect("I8: a committed reservation bills");
        assert_eq!(
            billed,
            UsageEvent {
                request_id: RequestId(42),
                account_id: ACCOUNT,
                source: UsageSource::Leased {
                    lease_id: LeaseId(7),
                    fencing_token: FencingToken(3)
                },
                units: CostUnits(30),
                at: at(2),
                policy_revision: PolicyRevision(9),
                key_id: Some(KeyId(5)),
            }
        );
        drop(r);
        assert_eq!(
            l.remaining(),
            CostUnits(70),
            "dropping a committed charge refunds nothing"
        );
    }

    #[test]
    fn units_reports_what_is_debited_committed_and_billed() {
        let l = lease();
        let r = Reservation::reserve(&l, CostUnits(17), at(0)).unwrap();
        assert_eq!(r.units(), CostUnits(17));
        assert_eq!(l.remaining(), CostUnits(100 - 17));
        assert_eq!(
            r.commit_at_execution_start(at(0), CommitFunding::LeaseOnly),
            Ok(r.units())
        );
        assert_eq!(event(&r, 0).unwrap().units, r.units());
        assert_eq!(r.account_id(), ACCOUNT);
    }

    #[test]
    fn a_cancel_charges_zero_once_however_often_it_is_called() {
        let l = lease();
        let r = Reservation::reserve(&l, CostUnits(30), at(0)).unwrap();
        assert_eq!(r.cancel(), CancelOutcome::ZeroCharged);
        assert_eq!(l.remaining(), CostUnits(100));
        assert_eq!(r.cancel(), CancelOutcome::ZeroCharged);
        drop(r);
        assert_eq!(l.remaining(), CostUnits(100), "I4: one refund, not three");
    }

    #[test]
    fn a_dropped_pending_reservation_is_released() {
        let l = lease();
        let r = Reservation::reserve(&l, CostUnits(30), at(0)).unwrap();
        assert_eq!(l.remaining(), CostUnits(70));
        drop(r);
        assert_eq!(l.remaining(), CostUnits(100), "I4");
    }

    #[test]
    fn a_cancel_after_commit_reports_the_full_charge() {
        let l = lease();
        let r = Reservation::reserve(&l, CostUnits(30), at(0)).unwrap();
        r.commit_at_execution_start(at(0), CommitFunding::LeaseOnly)
            .unwrap();
        assert_eq!(
            r.cancel(),
            CancelOutcome::AlreadyCommitted {
                units: CostUnits(30)
            }
        );
        assert_eq!(l.remaining(), CostUnits(70));
    }

    #[test]
    fn a_commit_after_cancel_is_refused_and_bills_nothing() {
        let l = lease();
        let r = Reservation::reserve(&l, CostUnits(30), at(0)).unwrap();
        r.cancel();
        assert_eq!(
            r.commit_at_execution_start(at(0), CommitFunding::LeaseOnly),
            Err(CommitError::AlreadyReleased)
        );
        assert!(r.is_released());
        assert_eq!(event(&r, 0), None, "I8: no event without a commit");
        assert_eq!(l.remaining(), CostUnits(100));
    }

    #[test]
    fn a_second_commit_is_an_error_not_a_second_charge() {
        let l = lease();
        let r = Reservation::reserve(&l, CostUnits(30), at(0)).unwrap();
        r.commit_at_execution_start(at(0), CommitFunding::LeaseOnly)
            .unwrap();
        assert_eq!(
            r.commit_at_execution_start(at(0), CommitFunding::LeaseOnly),
            Err(CommitError::AlreadyCommitted)
        );
        assert_eq!(l.remaining(), CostUnits(70));
    }

    #[test]
    fn a_window_that_closes_before_execution_releases_for_zero() {
        let l = lease();
        let r = Reservation::reserve(&l, CostUnits(30), at(999)).unwrap();
        // I2, I9: the window closed between admission and execution start.
        assert_eq!(
            r.commit_at_execution_start(at(1_000), CommitFunding::LeaseOnly),
            Err(CommitError::Denied(DenyReason::FundingExpiredAtStart))
        );
        assert_eq!(l.remaining(), CostUnits(100));
        assert_eq!(event(&r, 1_000), None);
        assert_eq!(
            r.commit_at_execution_start(at(999), CommitFunding::LeaseOnly),
            Err(CommitError::AlreadyReleased),
            "a released reservation stays released"
        );
    }

    #[test]
    fn the_safety_margin_closes_reserve_and_commit_early() {
        let l = LocalLease::with_safety_margin(
            *lease().grant(),
            CostUnits::ZERO,
            SignedDuration::from_secs(10),
        );
        assert_eq!(
            Reservation::reserve(&l, CostUnits(1), at(990)).unwrap_err(),
            DenyReason::LeaseExpired
        );
        let r = Reservation::reserve(&l, CostUnits(1), at(989)).unwrap();
        assert_eq!(
            r.commit_at_execution_start(at(990), CommitFunding::LeaseOnly),
            Err(CommitError::Denied(DenyReason::FundingExpiredAtStart))
        );
        assert_eq!(l.remaining(), CostUnits(100));
    }

    #[test]
    fn an_owned_commit_follows_the_same_rules_as_a_shared_one() {
        let l = lease();
        let o = overage();
        let mut r = Reservation::reserve(&l, CostUnits(30), at(0)).unwrap();
        assert_eq!(
            r.commit_owned(at(1), CommitFunding::LeaseOnly),
            Ok(CostUnits(30))
        );
        assert!(r.is_committed());
        assert_eq!(
            r.commit_owned(at(1), CommitFunding::LeaseOnly),
            Err(CommitError::AlreadyCommitted)
        );
        assert_eq!(event(&r, 1).unwrap().source.lease_id(), Some(LeaseId(7)));
        drop(r);
        assert_eq!(l.remaining(), CostUnits(70));

        let mut cancelled = Reservation::reserve(&l, CostUnits(5), at(0)).unwrap();
        cancelled.cancel();
        assert_eq!(
            cancelled.commit_owned(at(1), CommitFunding::LeaseOnly),
            Err(CommitError::AlreadyReleased)
        );

        // I2, I9: a lapsed window releases for zero under Strict...
        let mut lapsed = Reservation::reserve(&l, CostUnits(10), at(999)).unwrap();
        assert_eq!(
            lapsed.commit_owned(at(1_000), CommitFunding::LeaseOnly),
            Err(CommitError::Denied(DenyReason::FundingExpiredAtStart))
        );
        // ...and falls back to overage under Elastic.
        let mut elastic = Reservation::reserve(&l, CostUnits(10), at(999)).unwrap();
        assert_eq!(
            elastic.commit_owned(at(1_000), fallback(&o)),
            Ok(CostUnits(10))
        );
        assert_eq!(event(&elastic, 1_000).unwrap().source, UsageSource::Overage);
        drop((lapsed, elastic, cancelled));
        assert_eq!(
            l.remaining(),
            CostUnits(70),
            "only the first commit kept units"
        );
        assert_eq!(o.spent(), CostUnits(10));

        let mut native = Reservation::reserve_overage(&o, CostUnits(4), CAP).unwrap();
        assert_eq!(
            native.commit_owned(at(5), CommitFunding::LeaseOnly),
            Ok(CostUnits(4))
        );
        assert_eq!(o.committed(), CostUnits(14));
    }

    // ---- overage-funded reservations -----------------------------------

    #[test]
    fn a_committed_overage_bills_no_lease() {
        let o = overage();
        let r = Reservation::reserve_overage(&o, CostUnits(30), CAP).unwrap();
        assert!(r.admitted_as_overage());
        assert_eq!(o.spent(), CostUnits(30));
        assert_eq!(
            r.commit_at_execution_start(at(1), CommitFunding::LeaseOnly),
            Ok(CostUnits(30))
        );
        assert_eq!(o.committed(), CostUnits(30));
        let billed = event(&r, 1).unwrap();
        assert_eq!(billed.source, UsageSource::Overage);
        assert_eq!(billed.source.lease_id(), None);
        assert_eq!(billed.source.fencing_token(), None);
        assert_eq!(billed.account_id, ACCOUNT);
        assert_eq!(billed.units, CostUnits(30));
    }

    #[test]
    fn a_cancelled_or_dropped_overage_returns_its_units() {
        let o = overage();
        let r = Reservation::reserve_overage(&o, CostUnits(30), CAP).unwrap();
        assert_eq!(r.cancel(), CancelOutcome::ZeroCharged);
        assert_eq!(o.spent(), CostUnits::ZERO);
        assert_eq!(event(&r, 0), None);
        drop(Reservation::reserve_overage(&o, CostUnits(30), CAP).unwrap());
        assert_eq!(o.spent(), CostUnits::ZERO, "I4");
    }

    #[test]
    fn overage_has_no_window_to_lapse() {
        let o = overage();
        let r = Reservation::reserve_overage(&o, CostUnits(30), CAP).unwrap();
        assert_eq!(
            r.commit_at_execution_start(at(1_000_000), CommitFunding::LeaseOnly),
            Ok(CostUnits(30))
        );
        assert_eq!(o.spent(), CostUnits(30));
    }

    #[test]
    fn an_overage_above_the_cap_is_refused_and_takes_nothing() {
        let o = overage();
        assert_eq!(
            Reservation::reserve_overage(&o, CostUnits(101), CAP).unwrap_err(),
            DenyReason::OverageCapExhausted {
                spent: CostUnits::ZERO,
                overage_cap: CAP
            }
        );
        assert_eq!(o.spent(), CostUnits::ZERO);
    }

    #[test]
    fn a_native_overage_takes_one_debit_even_with_a_fallback_offered() {
        let o = overage();
        let r = Reservation::reserve_overage(&o, CostUnits(30), CAP).unwrap();
        assert_eq!(
            r.commit_at_execution_start(at(9_999), fallback(&o)),
            Ok(CostUnits(30))
        );
        assert_eq!(o.spent(), CostUnits(30), "one debit, taken at admission");
        assert_eq!(event(&r, 9_999).unwrap().source, UsageSource::Overage);
    }

    // ---- the Elastic commit-time fallback --------------------------------

    #[test]
    fn an_elastic_lapse_settles_as_overage_and_bills_no_lease() {
        let l = lease();
        let o = overage();
        let r = Reservation::reserve(&l, CostUnits(30), at(999)).unwrap();
        assert!(!r.admitted_as_overage());
        assert_eq!(
            r.commit_at_execution_start(at(1_000), fallback(&o)),
            Ok(CostUnits(30))
        );
        // I3: one funding term. The lease got its units back; overage holds
        // the charge as committed.
        assert_eq!(l.remaining(), CostUnits(100));
        assert_eq!(o.spent(), CostUnits(30));
        assert_eq!(o.committed(), CostUnits(30));
        let billed = event(&r, 1_000).unwrap();
        assert_eq!(
            billed.source,
            UsageSource::Overage,
            "the lapsed lease may be reclaimed"
        );
        assert_eq!(billed.units, CostUnits(30));
        assert!(!r.admitted_as_overage(), "admission's funding is unchanged");
    }

    #[test]
    fn a_strict_lapse_touches_no_overage() {
        let l = lease();
        let o = overage();
        let r = Reservation::reserve(&l, CostUnits(30), at(999)).unwrap();
        let strict = CommitFunding::from_mode(EnforcementMode::Strict, &o);
        assert_eq!(
            r.commit_at_execution_start(at(1_000), strict),
            Err(CommitError::Denied(DenyReason::FundingExpiredAtStart))
        );
        assert_eq!(l.remaining(), CostUnits(100));
        assert_eq!(o.spent(), CostUnits::ZERO, "I9");
        assert_eq!(event(&r, 1_000), None);
    }

    #[test]
    fn from_mode_offers_the_fallback_only_to_elastic_accounts() {
        let o = overage();
        assert!(matches!(
            CommitFunding::from_mode(EnforcementMode::Strict, &o),
            CommitFunding::LeaseOnly
        ));
        assert!(matches!(
            CommitFunding::from_mode(
                EnforcementMode::Elastic {
                    overage_cap: CostUnits(8)
                },
                &o
            ),
            CommitFunding::OverageFallback {
                cap: CostUnits(8),
                ..
            }
        ));
    }

    #[test]
    fn a_fallback_with_no_committed_headroom_releases_and_says_to_retry() {
        let l = lease();
        let o = overage();
        let full = Reservation::reserve_overage(&o, CAP, CAP).unwrap();
        full.commit_at_execution_start(at(0), CommitFunding::LeaseOnly)
            .unwrap();
        let r = Reservation::reserve(&l, CostUnits(30), at(999)).unwrap();
        let refused = r.commit_at_execution_start(at(1_000), fallback(&o));
        // Admitted on a funded lease that lapsed while it waited: a retry is
        // admitted on the replacement, so the answer is transient (I12).
        assert_eq!(
            refused,
            Err(CommitError::Denied(DenyReason::FundingExpiredAtStart))
        );
        assert_eq!(l.remaining(), CostUnits(100));
        assert_eq!(o.spent(), CAP, "the refused debit took nothing");
        assert_eq!(event(&r, 1_000), None);
    }

    #[test]
    fn a_fallback_blocked_by_refundable_overage_is_transient() {
        let l = lease();
        let o = overage();
        let _pending = Reservation::reserve_overage(&o, CAP, CAP).unwrap();
        let r = Reservation::reserve(&l, CostUnits(30), at(999)).unwrap();
        let Err(CommitError::Denied(reason)) = r.commit_at_execution_start(at(1_000), fallback(&o))
        else {
            panic!("the fallback must be denied");
        };
        assert_eq!(
            reason,
            DenyReason::OverageCapTemporarilyExhausted {
                spent: CAP,
                overage_cap: CAP
            }
        );
        assert_eq!(reason.retry(), Retry::Transient);
        assert_eq!(l.remaining(), CostUnits(100));
    }

    #[test]
    fn a_fallback_during_a_sibling_publication_waits_for_it() {
        let l = lease();
        let o = overage();
        let sibling = Reservation::reserve_overage(&o, CAP, CAP).unwrap();
        let r = Reservation::reserve(&l, CostUnits(30), at(999)).unwrap();
        // Hold the sibling's publication open: its claim has won, and the
        // fallback runs before the counter shows the units as committed.
        let reason = o
            .publish_claim(sibling.units(), || {
                sibling
                    .transition(PENDING_OVERAGE, COMMITTED_OVERAGE)
                    .expect("the sibling wins its own claim");
                match r.commit_at_execution_start(at(1_000), fallback(&o)) {
                    Err(CommitError::Denied(reason)) => Ok::<_, ()>(reason),
                    other => panic!("expected a denial, got {other:?}"),
                }
            })
            .unwrap();
        // I11: irrevocable units are never called refundable.
        assert_eq!(
            reason,
            DenyReason::OverageCommitInProgress {
                spent: CAP,
                overage_cap: CAP
            }
        );
        assert_eq!(reason.retry(), Retry::AfterInFlight);
        assert_eq!(l.remaining(), CostUnits(100));
        assert_eq!(o.spent(), CAP);
        assert!(matches!(
            Reservation::reserve_overage(&o, CostUnits(1), CAP).unwrap_err(),
            DenyReason::OverageCapExhausted { .. }
        ));
    }

    #[test]
    fn a_won_fallback_returns_the_lease_units_exactly_once() {
        let l = lease();
        let o = overage();
        let r = Reservation::reserve(&l, CostUnits(30), at(999)).unwrap();
        r.commit_at_execution_start(at(1_000), fallback(&o))
            .unwrap();
        assert_eq!(
            r.cancel(),
            CancelOutcome::AlreadyCommitted {
                units: CostUnits(30)
            }
        );
        assert_eq!(
            r.commit_at_execution_start(at(1_000), fallback(&o)),
            Err(CommitError::AlreadyCommitted)
        );
        drop(r);
        assert_eq!(l.remaining(), CostUnits(100));
        assert_eq!(o.spent(), CostUnits(30));
    }

    #[test]
    fn a_fallback_that_lost_to_cancel_strands_no_overage() {
        let l = lease();
        let o = overage();
        let r = Reservation::reserve(&l, CostUnits(30), at(999)).unwrap();
        assert_eq!(r.cancel(), CancelOutcome::ZeroCharged);
        assert_eq!(
            r.commit_at_execution_start(at(1_000), fallback(&o)),
            Err(CommitError::AlreadyReleased)
        );
        assert_eq!(o.spent(), CostUnits::ZERO);
        assert_eq!(
            l.remaining(),
            CostUnits(100),
            "credited once, by the cancel"
        );
        drop(Reservation::reserve_overage(&o, CAP, CAP).expect("the whole cap is free"));
    }

    // ---- split charges --------------------------------------------------

    #[test]
    fn a_handle_cancel_before_the_worker_starts_charges_zero() {
        let l = lease();
        let (shared, handle) = Reservation::reserve(&l, CostUnits(30), at(0))
            .unwrap()
            .split();
        assert!(!handle.is_cancelled());
        assert_eq!(handle.cancel(), CancelOutcome::ZeroCharged);
        assert!(handle.is_cancelled());
        assert!(shared.cancel_requested());
        assert_eq!(l.remaining(), CostUnits(100));
        assert_eq!(
            shared
                .reservation()
                .commit_at_execution_start(at(0), CommitFunding::LeaseOnly),
            Err(CommitError::AlreadyReleased)
        );
        assert_eq!(event(shared.reservation(), 0), None);
    }

    #[test]
    fn a_late_cancel_keeps_the_charge_but_records_the_request() {
        let l = lease();
        let (shared, handle) = Reservation::reserve(&l, CostUnits(30), at(0))
            .unwrap()
            .split();
        shared
            .reservation()
            .commit_at_execution_start(at(0), CommitFunding::LeaseOnly)
            .unwrap();
        assert_eq!(
            handle.cancel(),
            CancelOutcome::AlreadyCommitted {
                units: CostUnits(30)
            }
        );
        assert_eq!(l.remaining(), CostUnits(70));
        assert!(
            shared.cancel_requested(),
            "the worker can learn nobody waits"
        );
        assert!(event(shared.reservation(), 0).is_some());
    }

    #[test]
    fn every_handle_resolves_the_same_charge() {
        let l = lease();
        let (shared, first) = Reservation::reserve(&l, CostUnits(30), at(0))
            .unwrap()
            .split();
        let second = shared.cancel_handle();
        assert_eq!(first.cancel(), CancelOutcome::ZeroCharged);
        assert_eq!(second.cancel(), CancelOutcome::ZeroCharged);
        assert!(second.is_cancelled());
        drop((shared, first, second));
        assert_eq!(l.remaining(), CostUnits(100), "one refund");
    }

    // ---- real races -----------------------------------------------------

    /// Runs `commit` and `cancel` on two threads at once.
    fn race<C, X>(commit: C, cancel: X) -> (Result<CostUnits, CommitError>, CancelOutcome)
    where
        C: FnOnce() -> Result<CostUnits, CommitError> + Send,
        X: FnOnce() -> CancelOutcome + Send,
    {
        let start = std::sync::Barrier::new(2);
        std::thread::scope(|scope| {
            let committer = scope.spawn(|| {
                start.wait();
                commit()
            });
            let canceller = scope.spawn(|| {
                start.wait();
                cancel()
            });
            (committer.join().unwrap(), canceller.join().unwrap())
        })
    }

    #[test]
    fn commit_and_cancel_racing_have_exactly_one_winner() {
        for _ in 0..500 {
            let l = lease();
            let r = Reservation::reserve(&l, CostUnits(10), at(0)).unwrap();
            let outcome = race(
                || r.commit_at_execution_start(at(0), CommitFunding::LeaseOnly),
                || r.cancel(),
            );
            drop(r);
            match outcome {
                (Ok(charged), CancelOutcome::AlreadyCommitted { units: reported }) => {
                    assert_eq!(charged, reported);
                    assert_eq!(l.remaining(), CostUnits(90));
                }
                (Err(AlreadyReleased), ZeroCharged) => {
                    assert_eq!(l.remaining(), CostUnits(100));
                }
                other => panic!("I3: both or neither won: {other:?}"),
            }
        }
    }

    #[test]
    fn a_racing_fallback_and_cancel_leave_exactly_one_funding_term() {
        for _ in 0..500 {
            let l = lease();
            let o = overage();
            let r = Reservation::reserve(&l, CostUnits(10), at(999)).unwrap();
            let outcome = race(
                || r.commit_at_execution_start(at(1_000), fallback(&o)),
                || r.cancel(),
            );
            // Either way the lease is whole: the winner returned its units.
            assert_eq!(l.remaining(), CostUnits(100));
            match outcome {
                (Ok(_), CancelOutcome::AlreadyCommitted { .. }) => {
                    assert_eq!(o.spent(), CostUnits(10));
                    assert_eq!(event(&r, 1_000).unwrap().source, UsageSource::Overage);
                }
                (Err(AlreadyReleased), ZeroCharged) => {
                    assert_eq!(o.spent(), CostUnits::ZERO, "I10: the lost debit came back");
                    assert_eq!(event(&r, 1_000), None);
                }
                other => panic!("I3: both or neither won: {other:?}"),
            }
        }
    }

    #[test]
    fn racing_fallbacks_never_pass_the_overage_cap() {
        for _ in 0..100 {
            let o = overage();
            let cap = CostUnits(60);
            let leases: Vec<_> = (0..10).map(|_| lease()).collect();
            let reservations: Vec<_> = leases
                .iter()
                .map(|l| Reservation::reserve(l, CostUnits(10), at(999)).unwrap())
                .collect();
            let committed = std::thread::scope(|scope| {
                let workers: Vec<_> = reservations
                    .chunks(3)
                    .map(|chunk| {
                        let o = &o;
                        scope.spawn(move || {
                            chunk
                                .iter()
                                .filter(|r| {
                                    r.commit_at_execution_start(
                                        at(1_000),
                                        CommitFunding::OverageFallback { overage: o, cap },
                                    )
                                    .is_ok()
                                })
                                .count()
                        })
                    })
                    .collect();
                workers
                    .into_iter()
                    .map(|w| w.join().unwrap())
                    .sum::<usize>()
            });
            // I10: exactly six ten-unit charges fit in sixty; the rest were
            // refused and released.
            assert_eq!(committed, 6);
            assert_eq!(o.spent(), cap);
            drop(reservations);
            for l in &leases {
                assert_eq!(l.remaining(), CostUnits(100));
            }
        }
    }

    #[test]
    fn a_split_worker_and_its_waiter_have_exactly_one_winner() {
        for _ in 0..500 {
            let l = lease();
            let (shared, handle) = Reservation::reserve(&l, CostUnits(10), at(0))
                .unwrap()
                .split();
            let outcome = race(
                || {
                    shared
                        .reservation()
                        .commit_at_execution_start(at(0), CommitFunding::LeaseOnly)
                },
                || handle.cancel(),
            );
            match outcome {
                (Ok(_), CancelOutcome::AlreadyCommitted { .. }) => {
                    assert_eq!(l.remaining(), CostUnits(90));
                }
                (Err(AlreadyReleased), ZeroCharged) => {
                    assert_eq!(l.remaining(), CostUnits(100));
                }
                other => panic!("I3: both or neither won: {other:?}"),
            }
            assert!(shared.cancel_requested());
        }
    }

    #[test]
    fn a_split_fallback_and_its_waiter_leave_one_funding_term() {
        for _ in 0..200 {
            let l = lease();
            let o = overage();
            let (shared, handle) = Reservation::reserve(&l, CostUnits(10), at(999))
                .unwrap()
                .split();
            let outcome = race(
                || {
                    shared
                        .reservation()
                        .commit_at_execution_start(at(1_000), fallback(&o))
                },
                || handle.cancel(),
            );
            assert_eq!(l.remaining(), CostUnits(100));
            match outcome {
                (Ok(_), CancelOutcome::AlreadyCommitted { .. }) => {
                    assert_eq!(o.spent(), CostUnits(10));
                }
                (Err(AlreadyReleased), ZeroCharged) => {
                    assert_eq!(o.spent(), CostUnits::ZERO);
                }
                other => panic!("I3: both or neither won: {other:?}"),
            }
        }
    }

    /// A cap that one reservation fills exactly.
    const WHOLE_CAP: CostUnits = CostUnits(10);

    #[test]
    fn an_overage_commit_racing_cancel_leaves_the_right_refusal_behind() {
        for _ in 0..500 {
            let o = overage();
            let pending = Reservation::reserve_overage(&o, WHOLE_CAP, WHOLE_CAP).unwrap();
            let outcome = race(
                || pending.commit_at_execution_start(at(0), CommitFunding::LeaseOnly),
                || pending.cancel(),
            );
            match outcome {
                (Ok(_), CancelOutcome::AlreadyCommitted { .. }) => {
                    assert_eq!(o.spent(), CostUnits(10));
                    // I11: committed occupancy is exhaustion, never "soon".
                    let refused =
                        Reservation::reserve_overage(&o, CostUnits(1), WHOLE_CAP).unwrap_err();
                    assert!(matches!(refused, DenyReason::OverageCapExhausted { .. }));
                    assert_eq!(refused.retry(), Retry::Never);
                }
                (Err(AlreadyReleased), ZeroCharged) => {
                    assert_eq!(o.spent(), CostUnits::ZERO);
                    drop(
                        Reservation::reserve_overage(&o, WHOLE_CAP, WHOLE_CAP)
                            .expect("a cancelled overage is reusable at once"),
                    );
                }
                other => panic!("I3: both or neither won: {other:?}"),
            }
        }
    }
}
