//! Property tests: any sequence of reserve / commit / cancel / drop on a
//! lease, at any localities and shard counts, keeps the lease's books exact
//! against a plain reference count, and a lease never falls to its
//! low-water mark without its doorbell ringing.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use jiff::{SignedDuration, Timestamp};
use proptest::prelude::*;
use tollgate::{
    AccountId, CancelOutcome, CommitError, CommitFunding, CostUnits, DenyReason, FencingToken,
    LeaseGrant, LeaseId, LocalLease, LocalSharding, Locality, RefillSignal, RefillVerdict,
    Reservation,
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

/// A lease of `granted` units over `shards` shards, usable until `at(1_000)`.
fn lease(granted: u64, low_water: CostUnits, shards: usize) -> LocalLease {
    LocalLease::with_sharding(
        LeaseGrant {
            lease_id: LeaseId(1),
            account_id: AccountId(1),
            fencing_token: FencingToken(1),
            units: CostUnits(granted),
            expires_at: at(1_000),
        },
        low_water,
        SignedDuration::ZERO,
        LocalSharding::shards(shards).unwrap(),
    )
}

proptest! {
    #[test]
    fn the_lease_always_holds_granted_minus_committed_minus_pending(
        granted in 0..300_u64,
        shards in 1..6_usize,
        ops in proptest::collection::vec(op(), 0..120),
    ) {
        let lease = lease(granted, CostUnits(granted / 4), shards);
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

/// Counts the lease's rings.
#[derive(Default)]
struct Doorbell(AtomicUsize);

impl RefillSignal for Doorbell {
    fn request_refill(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[derive(Debug, Clone)]
enum Step {
    /// Reserve `units` from the shard of `locality` and keep it pending.
    Reserve { units: u64, locality: usize },
    /// Commit the pending reservation at this position (modulo the count).
    Commit(usize),
    /// Drop it, releasing it if still pending.
    Drop(usize),
    /// The refill task's check.
    Check,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (1..30_u64, 0..8_usize).prop_map(|(units, locality)| Step::Reserve { units, locality }),
        2 => any::<usize>().prop_map(Step::Commit),
        1 => any::<usize>().prop_map(Step::Drop),
        2 => Just(Step::Check),
    ]
}

proptest! {
    /// I7: once the refill check has called a lease idle, the lease cannot
    /// reach its low-water mark without ringing, however its units sit
    /// across the shards.
    #[test]
    fn a_lease_never_falls_to_its_mark_unheard(
        granted in 1..400_u64,
        mark_per_mille in 0..900_u64,
        shards in 1..6_usize,
        steps in proptest::collection::vec(step(), 0..150),
    ) {
        let bell = Arc::new(Doorbell::default());
        let low_water = CostUnits(granted * mark_per_mille / 1000);
        let lease = lease(granted, low_water, shards)
        .with_refill(Arc::clone(&bell) as Arc<dyn RefillSignal>);
        let mut held: Vec<Reservation> = Vec::new();
        // A fresh lease is armed: nothing has rung, and nothing needs to.
        let mut rings_when_idled = Some(0);
        for step in steps {
            match step {
                Step::Reserve { units, locality } => {
                    if let Ok(r) = Reservation::reserve_at_locality(
                        &lease, CostUnits(units), at(0), Locality::new(locality),
                    ) {
                        held.push(r);
                    }
                }
                Step::Commit(i) if !held.is_empty() => {
                    let _ = held[i % held.len()].commit_at_execution_start(at(0), CommitFunding::LeaseOnly);
                }
                Step::Drop(i) if !held.is_empty() => {
                    let index = i % held.len();
                    drop(held.swap_remove(index));
                }
                Step::Check => {
                    let verdict = lease.refill_due_or_rearm();
                    rings_when_idled = (verdict == RefillVerdict::Idle)
                        .then(|| bell.0.load(Ordering::SeqCst));
                }
                _ => {}
            }
            if let Some(rings) = rings_when_idled && lease.remaining() <= low_water {
                prop_assert!(
                    bell.0.load(Ordering::SeqCst) > rings,
                    "at {:?} of {} with a mark of {:?}, idle and silent",
                    lease.remaining(), granted, low_water,
                );
            }
        }
    }
}
