//! The allocator's evidence about what an account can still fund.

use jiff::Timestamp;

use crate::model::{CostUnits, DenyReason};

/// The allocator's evidence that an account cannot fund more than
/// `remaining` until `period_end`.
///
/// Admission uses it to tell a caller the truth: a quote above `remaining`
/// will not become fundable by waiting a moment, so it is denied as
/// insufficient (with the period end to retry at) rather than as a transient
/// shortage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BalanceShortfall {
    /// The most the account can fund, counting what it still has unleased.
    pub remaining: CostUnits,
    /// When a periodic refill resets the balance above `remaining`, so that
    /// asking again may find more; `None` without a refill, or when the
    /// reset would leave no more than `remaining` (I14: leftover units are
    /// not carried forward).
    pub period_end: Option<Timestamp>,
}

impl BalanceShortfall {
    /// This evidence if it still holds at `now`: once its period has ended
    /// it says nothing any more, since the refill has happened.
    #[must_use]
    pub fn in_force(self, now: Timestamp) -> Option<Self> {
        match self.period_end {
            Some(end) if end <= now => None,
            _ => Some(self),
        }
    }

    /// Whether the evidence rules out funding `quote`.
    #[must_use]
    pub fn rules_out(&self, quote: CostUnits) -> bool {
        quote > self.remaining
    }

    /// The denial for a quote this evidence rules out.
    #[must_use]
    pub fn deny(&self) -> DenyReason {
        if self.remaining.is_zero() {
            DenyReason::BalanceExhausted {
                period_end: self.period_end,
            }
        } else {
            DenyReason::BalanceInsufficient {
                remaining: self.remaining,
                period_end: self.period_end,
            }
        }
    }
}

/// The allocator's refusal for an account with nothing left to grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BalanceExhaustion {
    /// When a periodic refill restores some balance; `None` without a
    /// refill, or with a refill to nothing.
    pub period_end: Option<Timestamp>,
}

impl BalanceExhaustion {
    /// The denial admission gives while this holds.
    #[must_use]
    pub fn deny(&self) -> DenyReason {
        DenyReason::BalanceExhausted {
            period_end: self.period_end,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shortfall_denies_only_what_it_cannot_fund() {
        let end = Timestamp::from_second(60).unwrap();
        let short = BalanceShortfall {
            remaining: CostUnits(5),
            period_end: Some(end),
        };
        assert!(!short.rules_out(CostUnits(5)));
        assert!(short.rules_out(CostUnits(6)));
        assert_eq!(
            short.deny(),
            DenyReason::BalanceInsufficient {
                remaining: CostUnits(5),
                period_end: Some(end)
            }
        );
        let empty = BalanceShortfall {
            remaining: CostUnits::ZERO,
            period_end: None,
        };
        assert_eq!(
            empty.deny(),
            DenyReason::BalanceExhausted { period_end: None }
        );
    }
}
