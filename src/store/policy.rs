//! How an allocator sizes grants and how long they live.

use std::fmt;

use jiff::SignedDuration;

use crate::model::CostUnits;

/// The rules every grant follows. There is no `Default`: each value decides
/// how much balance an instance may hold and for how long, so the operator
/// states it, and [`validate`](Self::validate) checks it before the store
/// uses it (I17).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantPolicy {
    /// The longest lease the store grants. A longer requested ttl is clamped
    /// to this, which bounds how long a crashed instance can strand units.
    /// At least a microsecond and at most [`GrantPolicy::LONGEST`].
    pub max_ttl: SignedDuration,
    /// How long after `expires_at` a lease is still its holder's to release.
    /// Reclaim waits this long, so a holder whose clock runs slightly behind
    /// the store's still commits inside its window (I2). Must be positive
    /// and at most [`GrantPolicy::LONGEST`].
    pub reclaim_grace: SignedDuration,
    /// How grants shrink near the end of a balance.
    pub tail: TailSharing,
}

/// How grants shrink when the balance runs low, so that one instance does not
/// take the whole tail of an account while others go without.
///
/// While the balance could fund `instances` full requests, a request gets
/// what it asked for. Below that, a grant is at most the balance divided by
/// `instances` (rounded up), but never less than `min_grant` (or the request
/// or the whole balance, if smaller), so grants do not shrink to slivers
/// that rotate for every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TailSharing {
    /// How many instances are expected to share an account's tail; at least
    /// one. One means no sharing: a request takes all it can.
    pub instances: u64,
    /// The smallest grant tail sharing produces; at least one unit.
    pub min_grant: CostUnits,
}

/// The first rule a [`GrantPolicy`] breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GrantPolicyError {
    /// `max_ttl` must be at least a microsecond (the shortest lease a store
    /// grants).
    MaxTtlNotPositive,
    /// `max_ttl` must not exceed [`GrantPolicy::LONGEST`].
    MaxTtlTooLong,
    /// `reclaim_grace` must be positive.
    ReclaimGraceNotPositive,
    /// `reclaim_grace` must not exceed [`GrantPolicy::LONGEST`].
    ReclaimGraceTooLong,
    /// `tail.instances` must be at least one.
    TailInstancesZero,
    /// `tail.min_grant` must be at least one unit.
    TailMinGrantZero,
}

impl fmt::Display for GrantPolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::MaxTtlNotPositive => "grant policy: max_ttl must be at least a microsecond",
            Self::MaxTtlTooLong => "grant policy: max_ttl must not exceed a year",
            Self::ReclaimGraceNotPositive => "grant policy: reclaim_grace must be positive",
            Self::ReclaimGraceTooLong => "grant policy: reclaim_grace must not exceed a year",
            Self::TailInstancesZero => "grant policy: tail.instances must be at least 1",
            Self::TailMinGrantZero => "grant policy: tail.min_grant must be at least 1 unit",
        })
    }
}

impl std::error::Error for GrantPolicyError {}

impl GrantPolicy {
    /// The longest `max_ttl` and `reclaim_grace`: a year. A lease meant to
    /// outlive a crashed instance by longer strands its units for good, and
    /// far longer ones take instants past the range a store keeps, so every
    /// grant would be refused or reclaim would silently find nothing.
    pub const LONGEST: SignedDuration = SignedDuration::from_hours(24 * 366);

    /// Checks every rule, in order, and names the first one broken.
    ///
    /// # Errors
    ///
    /// The first broken rule.
    pub fn validate(&self) -> Result<(), GrantPolicyError> {
        // A shorter lease would be refused (see `lease_ttl`).
        if self.max_ttl < SignedDuration::from_micros(1) {
            return Err(GrantPolicyError::MaxTtlNotPositive);
        }
        if self.max_ttl > Self::LONGEST {
            return Err(GrantPolicyError::MaxTtlTooLong);
        }
        if !self.reclaim_grace.is_positive() {
            return Err(GrantPolicyError::ReclaimGraceNotPositive);
        }
        if self.reclaim_grace > Self::LONGEST {
            return Err(GrantPolicyError::ReclaimGraceTooLong);
        }
        if self.tail.instances == 0 {
            return Err(GrantPolicyError::TailInstancesZero);
        }
        if self.tail.min_grant.is_zero() {
            return Err(GrantPolicyError::TailMinGrantZero);
        }
        Ok(())
    }

    /// The ttl a lease gets for a requested `ttl`: clamped to `max_ttl`, or
    /// `None` when that is under a microsecond. A store keeping
    /// microseconds (`PostgreSQL`) would grant a shorter lease already
    /// expired; both stores refuse it alike.
    #[must_use]
    pub fn lease_ttl(&self, ttl: SignedDuration) -> Option<SignedDuration> {
        let ttl = ttl.min(self.max_ttl);
        (ttl >= SignedDuration::from_micros(1)).then_some(ttl)
    }

    /// The grant for a request of `requested` units against `available`
    /// units of balance: at most both, and positive when both are.
    #[must_use]
    pub fn grant_size(&self, requested: CostUnits, available: CostUnits) -> CostUnits {
        let size = requested.min(available);
        let instances = self.tail.instances.max(1);
        let plenty = requested
            .checked_mul(instances)
            .is_some_and(|wide| available >= wide);
        if plenty {
            return size;
        }
        let share = CostUnits(available.get().div_ceil(instances));
        size.min(share.max(self.tail.min_grant.min(available)))
    }

    /// The grant for a consolidation that needs at least `needed` units and
    /// would like `requested`, against `available` units (the balance plus
    /// the consolidated lease's unspent units). `None` when `available`
    /// cannot cover `needed`.
    #[must_use]
    pub fn consolidation_size(
        &self,
        requested: CostUnits,
        needed: CostUnits,
        available: CostUnits,
    ) -> Option<CostUnits> {
        if needed > available {
            return None;
        }
        // The floor: a consolidation exists to fund `needed`, so tail
        // sharing never shrinks it below that.
        Some(
            self.grant_size(requested.max(needed), available)
                .max(needed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(instances: u64, min_grant: u64) -> GrantPolicy {
        GrantPolicy {
            max_ttl: SignedDuration::from_secs(60),
            reclaim_grace: SignedDuration::from_secs(5),
            tail: TailSharing {
                instances,
                min_grant: CostUnits(min_grant),
            },
        }
    }

    #[test]
    fn validate_names_the_first_broken_rule() {
        assert_eq!(policy(1, 1).validate(), Ok(()));
        let mut bad = policy(0, 0);
        bad.max_ttl = SignedDuration::ZERO;
        assert_eq!(bad.validate(), Err(GrantPolicyError::MaxTtlNotPositive));
        // Every grant under it would be refused (see `lease_ttl`).
        bad.max_ttl = SignedDuration::from_nanos(999);
        assert_eq!(bad.validate(), Err(GrantPolicyError::MaxTtlNotPositive));
        let mut shortest = policy(1, 1);
        shortest.max_ttl = SignedDuration::from_micros(1);
        assert_eq!(shortest.validate(), Ok(()), "a microsecond is enough");
        bad.max_ttl = GrantPolicy::LONGEST + SignedDuration::from_nanos(1);
        assert_eq!(bad.validate(), Err(GrantPolicyError::MaxTtlTooLong));
        bad.max_ttl = GrantPolicy::LONGEST;
        bad.reclaim_grace = SignedDuration::from_secs(-1);
        assert_eq!(
            bad.validate(),
            Err(GrantPolicyError::ReclaimGraceNotPositive)
        );
        bad.reclaim_grace = SignedDuration::MAX;
        assert_eq!(bad.validate(), Err(GrantPolicyError::ReclaimGraceTooLong));
        assert_eq!(
            GrantPolicyError::ReclaimGraceTooLong.to_string(),
            "grant policy: reclaim_grace must not exceed a year"
        );
        bad.reclaim_grace = GrantPolicy::LONGEST;
        assert_eq!(bad.validate(), Err(GrantPolicyError::TailInstancesZero));
        bad.tail.instances = 2;
        assert_eq!(bad.validate(), Err(GrantPolicyError::TailMinGrantZero));
        assert_eq!(
            GrantPolicyError::TailMinGrantZero.to_string(),
            "grant policy: tail.min_grant must be at least 1 unit"
        );
    }

    #[test]
    fn ttl_is_clamped_and_must_be_at_least_a_microsecond() {
        let p = policy(1, 1);
        assert_eq!(
            p.lease_ttl(SignedDuration::from_secs(10)),
            Some(SignedDuration::from_secs(10))
        );
        assert_eq!(
            p.lease_ttl(SignedDuration::from_secs(600)),
            Some(SignedDuration::from_secs(60))
        );
        assert_eq!(p.lease_ttl(SignedDuration::ZERO), None);
        assert_eq!(p.lease_ttl(SignedDuration::from_secs(-1)), None);
        assert_eq!(p.lease_ttl(SignedDuration::from_nanos(999)), None);
        assert_eq!(
            p.lease_ttl(SignedDuration::from_micros(1)),
            Some(SignedDuration::from_micros(1))
        );
    }

    #[track_caller]
    fn check(p: GrantPolicy, requested: u64, available: u64, granted: u64) {
        assert_eq!(
            p.grant_size(CostUnits(requested), CostUnits(available)),
            CostUnits(granted),
            "request {requested} against {available}"
        );
    }

    #[test]
    fn grants_shrink_only_in_the_tail() {
        let p = policy(4, 10);
        check(p, 100, 1_000, 100); // plenty: four full grants fit
        check(p, 100, 400, 100);
        check(p, 100, 399, 100); // tail: a quarter, rounded up, is 100
        check(p, 100, 300, 75);
        check(p, 100, 30, 10); // a quarter is 8, below the minimum grant
        check(p, 100, 5, 5); // the whole balance is below the minimum
        check(p, 100, 0, 0);
        check(p, 3, 5, 3); // never more than asked
        check(p, u64::MAX, u64::MAX, u64::MAX / 4 + 1); // no overflow
        check(policy(1, 1), 100, 30, 30); // no sharing: take what is there
    }

    #[test]
    fn a_consolidation_grants_at_least_what_is_needed_when_it_can() {
        let p = policy(4, 10);
        let size = |requested, needed, available| {
            p.consolidation_size(
                CostUnits(requested),
                CostUnits(needed),
                CostUnits(available),
            )
        };
        assert_eq!(size(100, 40, 1_000), Some(CostUnits(100)));
        assert_eq!(
            size(100, 250, 1_000),
            Some(CostUnits(250)),
            "larger of the two"
        );
        // Tail sharing would give 25; the floor raises it to what is needed.
        assert_eq!(size(100, 90, 100), Some(CostUnits(90)));
        assert_eq!(size(100, 101, 100), None);
        assert_eq!(size(100, 0, 0), Some(CostUnits(0)));
    }
}
