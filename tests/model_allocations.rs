//! I5: the request path allocates nothing. A counting global allocator
//! watches the calling thread while it reserves, commits, builds the usage
//! event and drops, and while it reserves and drops.

mod support;

use std::sync::Arc;

use jiff::{SignedDuration, Timestamp};
use support::counting_allocator::{CountingAllocator, allocations_during, assert_counter_works};
use tollgate::{
    AccountId, AccountOverage, CommitFunding, CostUnits, DenyReason, EnforcementMode, FencingToken,
    KeyId, LeaseGrant, LeaseId, LocalLease, LocalSharding, PolicyRevision, RequestId, Reservation,
};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

fn at(second: i64) -> Timestamp {
    Timestamp::from_second(second).expect("test instants are in range")
}

fn lease(sharding: LocalSharding) -> LocalLease {
    LocalLease::with_sharding(
        LeaseGrant {
            lease_id: LeaseId(1),
            account_id: AccountId(1),
            fencing_token: FencingToken(1),
            units: CostUnits(1_000_000),
            expires_at: at(1_000),
        },
        CostUnits(10),
        SignedDuration::from_secs(5),
        sharding,
    )
}

#[test]
fn the_allocator_sees_allocations_on_this_thread() {
    assert_counter_works();
}

#[test]
fn reserve_commit_and_usage_event_allocate_nothing() {
    for sharding in [LocalSharding::Single, LocalSharding::shards(4).unwrap()] {
        let lease = lease(sharding);
        let overage = AccountOverage::new(AccountId(1));
        let mode = EnforcementMode::Elastic {
            overage_cap: CostUnits(50),
        };
        // Warm the thread-local locality so the measurement sees steady state.
        drop(Reservation::reserve(&lease, CostUnits(1), at(0)).unwrap());
        let counted = allocations_during(|| {
            for request in 0..1_000_u64 {
                let mut r = Reservation::reserve(&lease, CostUnits(3), at(1)).unwrap();
                let funding = CommitFunding::from_mode(mode, &overage);
                // Both commits: the owned one the request path uses, and the
                // shared one a split charge's worker uses.
                let units = if request % 2 == 0 {
                    r.commit_owned(at(2), funding)
                } else {
                    r.commit_at_execution_start(at(2), funding)
                }
                .unwrap();
                assert_eq!(units, CostUnits(3));
                let event = r
                    .usage_event(
                        RequestId(u128::from(request)),
                        at(2),
                        PolicyRevision(1),
                        Some(KeyId(1)),
                    )
                    .expect("committed");
                std::hint::black_box(event);
            }
        });
        assert_eq!(counted, 0, "I5: the hot path allocated ({sharding:?})");
        assert_eq!(lease.remaining(), CostUnits(1_000_000 - 3_000));
    }
}

#[test]
fn reserve_and_drop_allocate_nothing() {
    for sharding in [LocalSharding::Single, LocalSharding::shards(4).unwrap()] {
        let lease = lease(sharding);
        drop(Reservation::reserve(&lease, CostUnits(1), at(0)).unwrap());
        let counted = allocations_during(|| {
            for _ in 0..1_000 {
                drop(Reservation::reserve(&lease, CostUnits(3), at(1)).unwrap());
            }
        });
        assert_eq!(counted, 0, "I5: reserve + drop allocated ({sharding:?})");
        assert_eq!(lease.remaining(), CostUnits(1_000_000));
    }
}

#[test]
fn denials_allocate_nothing() {
    let lease = lease(LocalSharding::shards(2).unwrap());
    let overage = Arc::new(AccountOverage::new(AccountId(1)));
    drop(Reservation::reserve(&lease, CostUnits(1), at(0)).unwrap());
    let counted = allocations_during(|| {
        for _ in 0..100 {
            // Exhausted, expired, and an overage past its cap.
            assert_eq!(
                Reservation::reserve(&lease, CostUnits(2_000_000), at(1)).unwrap_err(),
                DenyReason::LeaseExhausted
            );
            assert_eq!(
                Reservation::reserve(&lease, CostUnits(1), at(995)).unwrap_err(),
                DenyReason::LeaseExpired
            );
            assert!(matches!(
                Reservation::reserve_overage(&overage, CostUnits(9), CostUnits(8)).unwrap_err(),
                DenyReason::OverageCapExhausted { .. }
            ));
        }
    });
    assert_eq!(counted, 0, "I5: a denial allocated");
}

#[test]
fn split_is_the_one_allocation() {
    let lease = lease(LocalSharding::Single);
    let r = Reservation::reserve(&lease, CostUnits(1), at(0)).unwrap();
    let counted = allocations_during(|| drop(std::hint::black_box(r.split())));
    assert_eq!(counted, 1);
}
