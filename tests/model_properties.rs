//! Property tests: any sequence of reserve / commit / cancel / drop on a
//! lease, at any localities and shard counts, keeps the lease's books exact
//! against a plain reference count.

use jiff::{SignedDuration, Timestamp};
use proptest::prelude::*;
use tollgate::{
    AccountId, CancelOutcome, CommitError, CommitFunding, CostUnits, DenyReason, FencingToken,
    LeaseGrant, LeaseId, LocalLease, LocalSharding, Locality, Reservation,
};

#[derive(Debug, Clone)]
enum Op {
    /// Reserve `units` from the shard of `locality`.
    Reserve { units: u64, locality: usize },
    /// Commit the pending reservation at this position (modulo the count).
    Commit(usize),
    /// Cancel it.
    Cancel(usize),
    /// Drop it, whatever its state.
    Drop(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..40_u64, 0..8_usize).prop_map(|(units, locality)| Op::Reserve { units, locality }),
        2 => any::<usize>().prop_map(Op::Commit),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => any::<usize>().prop_map(Op::Drop),
    ]
}

fn at(second: i64) -> Timestamp {
    Timestamp::from_second(second).expect("test instants are in range")
}

proptest! {
    #[test]
    fn the_lease_always_holds_granted_minus_committed_minus_pending(
        granted in 0..300_u64,
        shards in 1..6_usize,
        ops in proptest::collection::vec(op(), 0..120),
    ) {
        let lease = LocalLease::with_sharding(
            LeaseGrant {
                lease_id: LeaseId(1),
                account_id: AccountId(1),
                fencing_token: FencingToken(1),
                units: CostUnits(granted),
                expires_at: at(1_000),
            },
            CostUnits(granted / 4),
            SignedDuration::ZERO,
            LocalSharding::shards(shards).unwrap(),
        );
        let mut held: Vec<Reservation> = Vec::new();
        let mut committed = 0_u64;
        let mut largest_refused = 0_u64;
        for op in ops {
            match op {
                Op::Reserve { units, locality } => {
                    let pending: u64 = held
                        .iter()
                        .filter(|r| !r.is_committed() && !r.is_released())
                        .map(|r| r.units().get())
                        .sum();
                    let available = granted - committed - pending;
                    match Reservation::reserve_at_locality(&lease, CostUnits(units), at(0), Locality::new(locality)) {
                        Ok(r) => {
                            prop_assert!(units <= available, "funded {} from {}", units, available);
                            held.push(r);
                        }
                        Err(reason) => {
                            // Single-threaded, so gathering always succeeds
                            // when the lease as a whole can fund the quote.
                            prop_assert_eq!(reason, DenyReason::LeaseExhausted);
                            prop_assert!(units > available, "refused {} with {} left", units, available);
                            largest_refused = largest_refused.max(units);
                        }
                    }
                }
                Op::Commit(i) if !held.is_empty() => {
                    let r = &held[i % held.len()];
                    let was_pending = !r.is_committed() && !r.is_released();
                    match r.commit_at_execution_start(at(0), CommitFunding::LeaseOnly) {
                        Ok(units) => {
                            prop_assert!(was_pending);
                            committed += units.get();
                        }
                        Err(CommitError::AlreadyCommitted | CommitError::AlreadyReleased) => {
                            prop_assert!(!was_pending);
                        }
                        Err(other) => prop_assert!(false, "unexpected {:?}", other),
                    }
                }
                Op::Cancel(i) if !held.is_empty() => {
                    let r = &held[i % held.len()];
                    let outcome = r.cancel();
                    prop_assert_eq!(
                        matches!(outcome, CancelOutcome::AlreadyCommitted { .. }),
                        r.is_committed()
                    );
                }
                Op::Drop(i) if !held.is_empty() => {
                    let index = i % held.len();
                    drop(held.swap_remove(index));
                }
                _ => {}
            }
            let pending: u64 = held
                .iter()
                .filter(|r| !r.is_committed() && !r.is_released())
                .map(|r| r.units().get())
                .sum();
            // I6: with one thread the reading is exact after every step.
            prop_assert_eq!(lease.remaining(), CostUnits(granted - committed - pending));
            prop_assert_eq!(lease.largest_refused_quote(), CostUnits(largest_refused));
        }
        drop(held);
        prop_assert!(lease.is_only_local_view());
        prop_assert_eq!(lease.remaining(), CostUnits(granted - committed));
    }
}
