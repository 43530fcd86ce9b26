//! The ledger's decisions, shared by every store: what a grant or a
//! consolidation may take and why it is refused, when a refill period ends,
//! and the largest amount a store keeps. Each store only reads its rows,
//! asks here, and writes the answer, so both stores refuse the same calls in
//! the same order (I18).

use jiff::Timestamp;

use crate::model::{
    AccountStatus, BalanceExhaustion, BalanceShortfall, CostUnits, EnforcementMode,
};
use crate::store::{AdminError, AllocateError, GrantPolicy, RefillSchedule, StoreError};

/// The largest units a stored amount may hold, so every store (including
/// `PostgreSQL`'s signed 64-bit integers) accepts the same events.
pub(crate) const UNITS_MAX: u64 = i64::MAX as u64;

/// Refuses an enforcement mode the ledger cannot hold: an overage cap above
/// [`UNITS_MAX`], which no store could settle as debt. Both stores ask here
/// before an account is opened or its mode changed, so both refuse the same
/// cap and leave its keys' snapshots untouched.
pub(crate) fn check_mode(mode: EnforcementMode) -> Result<(), AdminError> {
    match mode.overage_cap() {
        Some(cap) if cap.get() > UNITS_MAX => Err(AdminError::Invalid(format!(
            "overage cap {cap} exceeds {UNITS_MAX}"
        ))),
        _ => Ok(()),
    }
}

/// A grant the ledger allows: its size, the balance left after it, and the
/// evidence to hand back when that balance could not fund another such
/// request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    pub(crate) size: u64,
    pub(crate) left: u64,
    pub(crate) funding: Option<BalanceShortfall>,
}

/// The grant an account with `balance` units and `refill` (its schedule and
/// the end of its current period) may give for `requested` units, but no
/// fewer than `needed` (zero: any grant), or why not: suspended, then
/// empty, then not enough for `needed`. A floor the balance cannot meet is
/// refused with the balance as evidence rather than granted short: the
/// caller wants the units for one quote, and a grant below it would only
/// move the balance onto its lease.
pub(crate) fn plan_acquire(
    policy: &GrantPolicy,
    status: AccountStatus,
    balance: u64,
    refill: Option<(RefillSchedule, Timestamp)>,
    requested: CostUnits,
    needed: CostUnits,
) -> Result<Grant, AllocateError> {
    // A consolidation that settles nothing: a stored balance is at most
    // `UNITS_MAX`, so crediting no units cannot overflow.
    plan_consolidation(
        policy,
        status,
        balance,
        refill,
        CostUnits::ZERO,
        requested,
        needed,
    )
}

/// The grant a consolidation may give, counting the `unspent` units the
/// settled lease returns, or why not: suspended, an overflowing credit,
/// nothing at all, then not enough for `needed`. Nothing is applied on a
/// refusal (I18).
pub(crate) fn plan_consolidation(
    policy: &GrantPolicy,
    status: AccountStatus,
    balance: u64,
    refill: Option<(RefillSchedule, Timestamp)>,
    unspent: CostUnits,
    requested: CostUnits,
    needed: CostUnits,
) -> Result<Grant, AllocateError> {
    if status == AccountStatus::Suspended {
        return Err(AllocateError::AccountInactive);
    }
    let available = credited_balance(balance, unspent.get())?;
    if available == 0 {
        return Err(AllocateError::BalanceExhausted(BalanceExhaustion {
            period_end: refill_above(refill, 0),
        }));
    }
    let size = policy
        .consolidation_size(requested, needed, CostUnits(available))
        .ok_or(AllocateError::BalanceInsufficient(BalanceShortfall {
            remaining: CostUnits(available),
            // The fold is refused, so the lease keeps its unspent units
            // through a reset (I14): the reset brings more than is here
            // if it brings more than the balance alone.
            period_end: refill_above(refill, balance),
        }))?
        .get();
    Ok(grant(size, available - size, requested.max(needed), refill))
}

fn grant(
    size: u64,
    left: u64,
    wanted: CostUnits,
    refill: Option<(RefillSchedule, Timestamp)>,
) -> Grant {
    Grant {
        size,
        left,
        funding: (left < wanted.get()).then_some(BalanceShortfall {
            remaining: CostUnits(left),
            period_end: refill_above(refill, left),
        }),
    }
}

/// The end of the current period, if the refill then resets the balance
/// above `left`: the instant asking again may find more units. A reset to
/// `left` or less (I14: leftover units are not carried forward) funds
/// nothing refused now, so a refusal or evidence then names no retry time.
fn refill_above(refill: Option<(RefillSchedule, Timestamp)>, left: u64) -> Option<Timestamp> {
    refill.and_then(|(schedule, end)| (schedule.amount.get() > left).then_some(end))
}

/// `balance` with `units` credited back, within [`UNITS_MAX`]. An overflow
/// means a top-up or refill filled the balance while the units were out on
/// a lease; they can come back once it has room.
pub(crate) fn credited_balance(balance: u64, units: u64) -> Result<u64, AllocateError> {
    balance
        .checked_add(units)
        .filter(|balance| *balance <= UNITS_MAX)
        .ok_or(AllocateError::BalanceOverflow)
}

/// When a new refill schedule's first period ends: one interval after
/// `now`. The interval must be positive and the amount storable.
pub(crate) fn first_period_end(
    schedule: RefillSchedule,
    now: Timestamp,
) -> Result<Timestamp, AdminError> {
    if !schedule.interval.is_positive() || schedule.amount.get() > UNITS_MAX {
        return Err(AdminError::InvalidRefill);
    }
    now.checked_add(schedule.interval)
        .map_err(|_| AdminError::InvalidRefill)
}

/// The end of the period `now` falls in, for a schedule whose current
/// period ends at `end`; `None` while `now` is still before `end`. Several
/// missed periods collapse into one reset, which is what they would have
/// amounted to (I14).
pub(crate) fn next_period_end(
    schedule: RefillSchedule,
    end: Timestamp,
    now: Timestamp,
) -> Result<Option<Timestamp>, StoreError> {
    if now < end {
        return Ok(None);
    }
    let interval = schedule.interval.as_nanos();
    let behind = now.as_nanosecond() - end.as_nanosecond();
    let periods = behind / interval + 1;
    periods
        .checked_mul(interval)
        .and_then(|advance| end.as_nanosecond().checked_add(advance))
        .and_then(|nanos| Timestamp::from_nanosecond(nanos).ok())
        .map(Some)
        .ok_or_else(|| StoreError::new("the next refill period ends past the end of time"))
}

#[cfg(test)]
mod tests {
    use jiff::SignedDuration;

    use super::*;
    use crate::store::TailSharing;

    const POLICY: GrantPolicy = GrantPolicy {
        max_ttl: SignedDuration::from_secs(60),
        reclaim_grace: SignedDuration::from_secs(10),
        tail: TailSharing {
            instances: 1,
            min_grant: CostUnits(1),
        },
    };

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).unwrap()
    }

    /// A refill to `amount` units at 100 s.
    fn refill_to(amount: u64) -> (RefillSchedule, Timestamp) {
        (
            RefillSchedule {
                amount: CostUnits(amount),
                interval: SignedDuration::from_secs(100),
            },
            at(100),
        )
    }

    #[test]
    fn refusals_come_in_one_order() {
        let end = Some(at(100));
        let refill = Some(refill_to(50));
        let active = AccountStatus::Active;
        assert_eq!(
            plan_acquire(
                &POLICY,
                AccountStatus::Suspended,
                0,
                refill,
                CostUnits(5),
                CostUnits::ZERO
            ),
            Err(AllocateError::AccountInactive),
            "suspension before emptiness"
        );
        assert_eq!(
            plan_acquire(&POLICY, active, 0, refill, CostUnits(5), CostUnits::ZERO),
            Err(AllocateError::BalanceExhausted(BalanceExhaustion {
                period_end: end
            }))
        );
        assert_eq!(
            plan_consolidation(
                &POLICY,
                active,
                UNITS_MAX,
                refill,
                CostUnits(1),
                CostUnits(5),
                CostUnits(5)
            ),
            Err(AllocateError::BalanceOverflow)
        );
        assert_eq!(
            plan_consolidation(
                &POLICY,
                active,
                2,
                refill,
                CostUnits(1),
                CostUnits(9),
                CostUnits(4)
            ),
            Err(AllocateError::BalanceInsufficient(BalanceShortfall {
                remaining: CostUnits(3),
                period_end: end
            }))
        );
    }

    /// I14: a reset to no more than what is left funds nothing refused
    /// now, so a refusal or evidence names the period end only when the
    /// refill resets the balance above it.
    #[test]
    fn a_retry_time_is_named_only_when_the_refill_brings_more() {
        let active = AccountStatus::Active;
        let empty = plan_acquire(
            &POLICY,
            active,
            0,
            Some(refill_to(50)),
            CostUnits(5),
            CostUnits::ZERO,
        );
        assert_eq!(
            empty,
            Err(AllocateError::BalanceExhausted(BalanceExhaustion {
                period_end: Some(at(100))
            }))
        );
        assert_eq!(
            plan_acquire(
                &POLICY,
                active,
                0,
                Some(refill_to(0)),
                CostUnits(5),
                CostUnits::ZERO
            ),
            Err(AllocateError::BalanceExhausted(BalanceExhaustion {
                period_end: None
            })),
            "a refill to nothing brings nothing"
        );
        // A refused fold's lease keeps its unspent units through the reset,
        // so only the balance is compared with the refill. 59 on the
        // balance, which the refill resets to 50: waiting loses units.
        let above = plan_consolidation(
            &POLICY,
            active,
            59,
            Some(refill_to(50)),
            CostUnits(30),
            CostUnits(100),
            CostUnits(100),
        );
        assert_eq!(
            above,
            Err(AllocateError::BalanceInsufficient(BalanceShortfall {
                remaining: CostUnits(89),
                period_end: None
            }))
        );
        // 40 on the balance and 30 on the lease: after the reset, 50 and
        // the lease's 30, more than the 70 now.
        let below = plan_consolidation(
            &POLICY,
            active,
            40,
            Some(refill_to(50)),
            CostUnits(30),
            CostUnits(100),
            CostUnits(100),
        );
        assert_eq!(
            below,
            Err(AllocateError::BalanceInsufficient(BalanceShortfall {
                remaining: CostUnits(70),
                period_end: Some(at(100))
            }))
        );
        // The evidence a grant hands back follows the same rule.
        let evidence = |balance| {
            plan_acquire(
                &POLICY,
                active,
                balance,
                Some(refill_to(50)),
                CostUnits(60),
                CostUnits::ZERO,
            )
            .map(|grant| grant.funding)
        };
        assert_eq!(
            evidence(70),
            Ok(Some(BalanceShortfall {
                remaining: CostUnits(10),
                period_end: Some(at(100))
            })),
            "10 left, the reset brings 50"
        );
        assert_eq!(
            evidence(115),
            Ok(Some(BalanceShortfall {
                remaining: CostUnits(55),
                period_end: None
            })),
            "55 left, the reset brings 50"
        );
    }

    #[test]
    fn an_acquire_with_a_floor_is_refused_rather_than_granted_short() {
        let active = AccountStatus::Active;
        // Asked for more than the balance with no floor, the tail is
        // granted; with a floor above the balance, nothing is, and the
        // refusal names the balance.
        assert_eq!(
            plan_acquire(
                &POLICY,
                active,
                1_000,
                None,
                CostUnits(1_041),
                CostUnits::ZERO
            )
            .map(|grant| grant.size),
            Ok(1_000)
        );
        assert_eq!(
            plan_acquire(
                &POLICY,
                active,
                1_000,
                None,
                CostUnits(1_041),
                CostUnits(1_001)
            ),
            Err(AllocateError::BalanceInsufficient(BalanceShortfall {
                remaining: CostUnits(1_000),
                period_end: None,
            }))
        );
        // A floor the balance meets is granted whole, even where tail
        // sharing would give a smaller share.
        let shared = GrantPolicy {
            tail: TailSharing {
                instances: 4,
                min_grant: CostUnits(1),
            },
            ..POLICY
        };
        assert_eq!(
            plan_acquire(&shared, active, 100, None, CostUnits(90), CostUnits::ZERO)
                .map(|grant| grant.size),
            Ok(25)
        );
        assert_eq!(
            plan_acquire(&shared, active, 100, None, CostUnits(90), CostUnits(60)),
            Ok(Grant {
                size: 60,
                left: 40,
                funding: Some(BalanceShortfall {
                    remaining: CostUnits(40),
                    period_end: None,
                }),
            })
        );
        // Suspension and an empty balance are refused first, as always.
        assert_eq!(
            plan_acquire(&POLICY, active, 0, None, CostUnits(5), CostUnits(5)),
            Err(AllocateError::BalanceExhausted(BalanceExhaustion {
                period_end: None
            }))
        );
    }

    #[test]
    fn a_grant_says_what_is_left_when_it_could_not_fund_another() {
        let plenty = plan_acquire(
            &POLICY,
            AccountStatus::Active,
            100,
            None,
            CostUnits(40),
            CostUnits::ZERO,
        );
        assert_eq!(
            plenty,
            Ok(Grant {
                size: 40,
                left: 60,
                funding: None
            })
        );
        let tail = plan_acquire(
            &POLICY,
            AccountStatus::Active,
            50,
            None,
            CostUnits(40),
            CostUnits::ZERO,
        );
        assert_eq!(
            tail,
            Ok(Grant {
                size: 40,
                left: 10,
                funding: Some(BalanceShortfall {
                    remaining: CostUnits(10),
                    period_end: None
                })
            })
        );
        // The unspent units count, and the evidence compares with the larger
        // of requested and needed.
        let folded = plan_consolidation(
            &POLICY,
            AccountStatus::Active,
            5,
            None,
            CostUnits(5),
            CostUnits(2),
            CostUnits(8),
        );
        assert_eq!(
            folded,
            Ok(Grant {
                size: 8,
                left: 2,
                funding: Some(BalanceShortfall {
                    remaining: CostUnits(2),
                    period_end: None
                })
            })
        );
    }

    #[test]
    fn missed_periods_collapse_into_one_reset() {
        let schedule = RefillSchedule {
            amount: CostUnits(10),
            interval: SignedDuration::from_secs(100),
        };
        assert_eq!(next_period_end(schedule, at(100), at(99)), Ok(None));
        assert_eq!(
            next_period_end(schedule, at(100), at(100)),
            Ok(Some(at(200)))
        );
        assert_eq!(
            next_period_end(schedule, at(100), at(450)),
            Ok(Some(at(500)))
        );
        assert_eq!(first_period_end(schedule, at(7)), Ok(at(107)));
    }
}
