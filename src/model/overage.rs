//! Unfunded units an Elastic account may spend on this instance, up to a cap.

use crate::model::sharding::CachePadded;
use crate::model::{AccountId, CostUnits, DenyReason};
use crate::sync::{AtomicU64, Ordering};

/// Units this instance has extended to one account beyond its leases.
///
/// Three counters, each on its own cache line:
///
/// - `spent`: pending plus committed overage. Every debit is a
///   compare-exchange against the cap on this one word, so the cap holds
///   however many threads race (I10).
/// - `committed`: the part of `spent` that is irrevocable.
/// - `publishing`: units whose reservation has claimed (or is claiming) its
///   commit but which `committed` does not show yet.
///
/// A refused debit is classified from them, because each refusal tells the
/// caller something different about when to retry (I11):
/// [`OverageCapExhausted`](DenyReason::OverageCapExhausted) when committed
/// units alone leave no room, [`OverageCommitInProgress`](DenyReason::OverageCommitInProgress)
/// while a commit is being published, and
/// [`OverageCapTemporarilyExhausted`](DenyReason::OverageCapTemporarilyExhausted)
/// when pending units that may still be refunded fill the cap.
///
/// # Invariants
///
/// - `spent ≤ cap` for the cap of every successful debit (I10).
/// - Units claimed by a commit are counted in `publishing` before the claim
///   and in `committed` before they leave `publishing`, so a refusal observed
///   after a claim won never calls them refundable (I11).
#[derive(Debug)]
pub struct AccountOverage {
    account_id: AccountId,
    spent: CachePadded<AtomicU64>,
    committed: CachePadded<AtomicU64>,
    publishing: CachePadded<AtomicU64>,
}

/// An overage debit taken on behalf of a commit that has not yet won its
/// claim. Dropping it unpublished returns the units.
#[derive(Debug)]
#[must_use = "dropping a tentative debit returns its units"]
pub struct TentativeOverage<'a> {
    overage: &'a AccountOverage,
    units: u64,
    settled: bool,
}

impl AccountOverage {
    /// An account with nothing spent into overage.
    #[must_use]
    pub fn new(account_id: AccountId) -> Self {
        Self {
            account_id,
            spent: CachePadded(AtomicU64::new(0)),
            committed: CachePadded(AtomicU64::new(0)),
            publishing: CachePadded(AtomicU64::new(0)),
        }
    }

    /// The account this counter belongs to.
    #[must_use]
    pub fn account_id(&self) -> AccountId {
        self.account_id
    }

    /// Pending plus committed overage.
    #[must_use]
    pub fn spent(&self) -> CostUnits {
        CostUnits(self.spent.load(Ordering::Acquire))
    }

    /// The irrevocable part of [`spent`](Self::spent).
    #[must_use]
    pub fn committed(&self) -> CostUnits {
        CostUnits(self.committed.load(Ordering::Acquire))
    }

    /// Extends `units` of pending overage if `spent + units ≤ cap`.
    ///
    /// # Errors
    ///
    /// One of the three overage refusals, classified as the type's docs
    /// describe.
    pub fn try_debit(&self, units: CostUnits, cap: CostUnits) -> Result<(), DenyReason> {
        let units = units.get();
        let mut current = self.spent.load(Ordering::Acquire);
        loop {
            let next = match current.checked_add(units) {
                Some(next) if next <= cap.get() => next,
                _ => return Err(self.classify_refusal(units, cap, current)),
            };
            match self.spent.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(actual) => current = actual,
            }
        }
    }

    /// Returns pending units: a reservation released before execution.
    pub(crate) fn credit(&self, units: CostUnits) {
        let before = self.spent.fetch_sub(units.get(), Ordering::AcqRel);
        debug_assert!(
            before >= units.get(),
            "credited more overage than was spent"
        );
    }

    /// Takes a debit for a commit-time fallback: the units are funded before
    /// the claim is attempted, and handed back if the claim loses.
    ///
    /// # Errors
    ///
    /// As [`try_debit`](Self::try_debit).
    pub fn debit_before_claim(
        &self,
        units: CostUnits,
        cap: CostUnits,
    ) -> Result<TentativeOverage<'_>, DenyReason> {
        self.try_debit(units, cap)?;
        Ok(TentativeOverage {
            overage: self,
            units: units.get(),
            settled: false,
        })
    }

    /// Publishes the commit of `units` that are already pending in
    /// [`spent`](Self::spent): runs `claim` (the reservation's phase
    /// transition) and, if it wins, moves the units to committed.
    ///
    /// A losing claim leaves the units pending; whoever won owns their
    /// refund.
    ///
    /// # Errors
    ///
    /// Whatever `claim` returns when it loses.
    pub(crate) fn publish_claim<T, E>(
        &self,
        units: CostUnits,
        claim: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        let units = units.get();
        // I11: in `publishing` before the claim can win.
        self.publishing.fetch_add(units, Ordering::AcqRel);
        let outcome = claim();
        if outcome.is_ok() {
            // I11: in `committed` before leaving `publishing`.
            self.committed.fetch_add(units, Ordering::AcqRel);
        }
        self.publishing.fetch_sub(units, Ordering::AcqRel);
        outcome
    }

    /// Sorts a refusal into its retry class. Reads `publishing` before
    /// `committed`: a reader that sees a publication finished also sees the
    /// committed units it added (I11).
    #[cold]
    fn classify_refusal(&self, units: u64, cap: CostUnits, spent: u64) -> DenyReason {
        let publishing = self.publishing.load(Ordering::Acquire);
        let committed = self.committed.load(Ordering::Acquire);
        let spent = CostUnits(spent);
        let overage_cap = cap;
        if committed
            .checked_add(units)
            .is_none_or(|needed| needed > cap.get())
        {
            DenyReason::OverageCapExhausted { spent, overage_cap }
        } else if publishing > 0 {
            DenyReason::OverageCommitInProgress { spent, overage_cap }
        } else {
            DenyReason::OverageCapTemporarilyExhausted { spent, overage_cap }
        }
    }
}

impl TentativeOverage<'_> {
    /// Runs `claim`; a win makes the debit committed overage, a loss returns
    /// it.
    ///
    /// # Errors
    ///
    /// Whatever `claim` returns when it loses.
    pub fn publish_commit<T, E>(mut self, claim: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let outcome = self.overage.publish_claim(CostUnits(self.units), claim);
        // A won claim keeps the units spent; a lost one drops them below.
        self.settled = outcome.is_ok();
        outcome
    }
}

impl Drop for TentativeOverage<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.overage.credit(CostUnits(self.units));
        }
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use super::*;

    fn overage() -> AccountOverage {
        AccountOverage::new(AccountId(3))
    }

    const CAP: CostUnits = CostUnits(100);

    #[test]
    fn debits_fit_under_the_cap_and_credits_return_them() {
        let o = overage();
        o.try_debit(CostUnits(60), CAP).unwrap();
        o.try_debit(CostUnits(40), CAP).unwrap();
        assert_eq!(o.spent(), CostUnits(100));
        o.credit(CostUnits(40));
        assert_eq!(o.spent(), CostUnits(60));
        assert_eq!(o.committed(), CostUnits::ZERO, "nothing was committed");
    }

    #[test]
    fn a_cap_full_of_pending_units_is_only_temporarily_exhausted() {
        let o = overage();
        o.try_debit(CostUnits(90), CAP).unwrap();
        let refused = o.try_debit(CostUnits(20), CAP).unwrap_err();
        assert_eq!(
            refused,
            DenyReason::OverageCapTemporarilyExhausted {
                spent: CostUnits(90),
                overage_cap: CAP
            }
        );
        assert_eq!(o.spent(), CostUnits(90), "a refusal takes nothing");
    }

    #[test]
    fn a_cap_full_of_committed_units_is_exhausted() {
        let o = overage();
        o.try_debit(CostUnits(90), CAP).unwrap();
        o.publish_claim(CostUnits(90), || Ok::<(), ()>(())).unwrap();
        assert_eq!(o.committed(), CostUnits(90));
        // I11: 90 committed + 20 can never fit, whatever is refunded.
        assert_eq!(
            o.try_debit(CostUnits(20), CAP).unwrap_err(),
            DenyReason::OverageCapExhausted {
                spent: CostUnits(90),
                overage_cap: CAP
            }
        );
        // But 10 still fits.
        o.try_debit(CostUnits(10), CAP).unwrap();
        assert_eq!(o.spent(), CAP);
    }

    #[test]
    fn a_quote_above_the_cap_or_overflowing_is_exhausted_not_a_panic() {
        let o = overage();
        assert!(matches!(
            o.try_debit(CostUnits(101), CAP).unwrap_err(),
            DenyReason::OverageCapExhausted { .. }
        ));
        o.try_debit(CostUnits(1), CostUnits::MAX).unwrap();
        // 1 + MAX overflows: refused, and since refunding the pending unit
        // would make room, only for now.
        assert!(matches!(
            o.try_debit(CostUnits::MAX, CostUnits::MAX).unwrap_err(),
            DenyReason::OverageCapTemporarilyExhausted { .. }
        ));
        assert_eq!(o.spent(), CostUnits(1));
    }

    #[test]
    fn a_publication_in_flight_is_reported_as_such() {
        let o = overage();
        o.try_debit(CostUnits(100), CAP).unwrap();
        let seen = o
            .publish_claim(CostUnits(100), || {
                Ok::<_, ()>(o.try_debit(CostUnits(1), CAP))
            })
            .unwrap();
        assert_eq!(
            seen.unwrap_err(),
            DenyReason::OverageCommitInProgress {
                spent: CostUnits(100),
                overage_cap: CAP
            }
        );
        assert!(matches!(
            o.try_debit(CostUnits(1), CAP).unwrap_err(),
            DenyReason::OverageCapExhausted { .. }
        ));
    }

    #[test]
    fn a_lost_claim_leaves_the_units_pending_for_their_owner_to_refund() {
        let o = overage();
        o.try_debit(CostUnits(30), CAP).unwrap();
        assert_eq!(
            o.publish_claim(CostUnits(30), || Err::<(), _>("lost")),
            Err("lost")
        );
        assert_eq!(o.committed(), CostUnits::ZERO);
        assert_eq!(o.spent(), CostUnits(30));
        assert!(matches!(
            o.try_debit(CostUnits(80), CAP).unwrap_err(),
            DenyReason::OverageCapTemporarilyExhausted { .. }
        ));
    }

    #[test]
    fn a_tentative_debit_returns_its_units_unless_its_claim_wins() {
        let o = overage();
        drop(o.debit_before_claim(CostUnits(40), CAP).unwrap());
        assert_eq!(o.spent(), CostUnits::ZERO, "dropped unpublished: returned");

        let lost = o.debit_before_claim(CostUnits(40), CAP).unwrap();
        assert_eq!(o.spent(), CostUnits(40));
        assert_eq!(lost.publish_commit(|| Err::<(), _>(())), Err(()));
        assert_eq!(o.spent(), CostUnits::ZERO, "a lost claim returns the debit");

        let won = o.debit_before_claim(CostUnits(40), CAP).unwrap();
        won.publish_commit(|| Ok::<_, ()>(())).unwrap();
        assert_eq!(o.spent(), CostUnits(40));
        assert_eq!(o.committed(), CostUnits(40));
    }

    #[test]
    fn racing_debits_never_pass_the_cap() {
        for _ in 0..200 {
            let o = overage();
            let won: u64 = std::thread::scope(|scope| {
                let racers: Vec<_> = (0..4)
                    .map(|_| {
                        scope.spawn(|| {
                            (0..10)
                                .filter(|_| o.try_debit(CostUnits(7), CAP).is_ok())
                                .count() as u64
                        })
                    })
                    .collect();
                racers.into_iter().map(|r| r.join().unwrap()).sum()
            });
            // I10: fourteen sevens fit in a hundred, and the count is exact.
            assert_eq!(won, 14);
            assert_eq!(o.spent(), CostUnits(98));
        }
    }
}
