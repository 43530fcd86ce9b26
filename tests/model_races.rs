//! Real races on one lease: several threads reserving, committing,
//! cancelling and dropping at once, checked for exact unit conservation after
//! every round.

use std::sync::{Arc, Barrier};

use jiff::{SignedDuration, Timestamp};
use tollgate::{
    AccountId, AccountOverage, CancelOutcome, CommitFunding, CostUnits, DenyReason, FencingToken,
    LeaseGrant, LeaseId, LocalLease, LocalSharding, Locality, Reservation,
};

const THREADS: usize = 4;
const ROUNDS: usize = 200;
const OPS_PER_THREAD: u64 = 150;
/// Less than the threads would spend if every reservation committed, so
/// every round also runs the lease into refusals.
const GRANTED: u64 = 600;

fn at(second: i64) -> Timestamp {
    Timestamp::from_second(second).expect("test instants are in range")
}

fn lease(sharding: LocalSharding) -> LocalLease {
    LocalLease::with_sharding(
        LeaseGrant {
            lease_id: LeaseId(1),
            account_id: AccountId(1),
            fencing_token: FencingToken(1),
            units: CostUnits(GRANTED),
            expires_at: at(1_000),
        },
        CostUnits(100),
        SignedDuration::ZERO,
        sharding,
    )
}

/// What one thread did, in units.
#[derive(Default)]
struct Tally {
    committed_lease: u64,
    committed_overage: u64,
    refused: u64,
    /// Refusals because overage filled the cap (committed or pending).
    cap_refused: u64,
    /// Split charges whose waiter's cancel beat the commit.
    split_lost: u64,
}

/// One thread's share of a round: reserve a small quote, then resolve it one
/// of five ways, chosen by the operation number so every thread mixes them.
fn worker(
    lease: &LocalLease,
    overage: Option<&Arc<AccountOverage>>,
    cap: CostUnits,
    seed: u64,
) -> Tally {
    let mut tally = Tally::default();
    for op in 0..OPS_PER_THREAD {
        let quote = CostUnits(1 + (op * 7 + seed) % 5);
        let funded = match Reservation::reserve(lease, quote, at(0)) {
            Err(DenyReason::LeaseExhausted) => match overage {
                None => None,
                Some(overage) => match Reservation::reserve_overage(overage, quote, cap) {
                    Ok(reservation) => Some(reservation),
                    // I11: only the overage refusals.
                    Err(
                        DenyReason::OverageCapExhausted { overage_cap, .. }
                        | DenyReason::OverageCapTemporarilyExhausted { overage_cap, .. },
                    ) => {
                        assert_eq!(overage_cap, cap);
                        tally.cap_refused += 1;
                        None
                    }
                    Err(DenyReason::OverageCommitInProgress { .. }) => None,
                    Err(other) => panic!("unexpected overage refusal {other:?}"),
                },
            },
            Err(other) => panic!("unexpected denial {other:?}"),
            Ok(reservation) => Some(reservation),
        };
        let Some(reservation) = funded else {
            tally.refused += 1;
            continue;
        };
        let source_is_overage = reservation.admitted_as_overage();
        let committed = match (op + seed) % 5 {
            0 | 1 => {
                // Unshared and inside the window: nothing may refuse it.
                assert_eq!(
                    reservation.commit_at_execution_start(at(0), CommitFunding::LeaseOnly),
                    Ok(quote)
                );
                true
            }
            2 => {
                assert_eq!(reservation.cancel(), CancelOutcome::ZeroCharged);
                false
            }
            3 => {
                drop(reservation);
                continue;
            }
            _ => {
                // A split charge whose waiter cancels while this thread
                // commits: exactly one of them wins.
                let (shared, handle) = reservation.split();
                let both = Arc::new(Barrier::new(2));
                let waiter = {
                    let both = Arc::clone(&both);
                    std::thread::spawn(move || {
                        both.wait();
                        handle.cancel()
                    })
                };
                both.wait();
                let won = shared
                    .reservation()
                    .commit_at_execution_start(at(0), CommitFunding::LeaseOnly)
                    .is_ok();
                let cancelled = waiter.join().expect("the waiter does not panic");
                assert_eq!(
                    won,
                    matches!(cancelled, CancelOutcome::AlreadyCommitted { .. })
                );
                tally.split_lost += u64::from(!won);
                won
            }
        };
        if committed {
            if source_is_overage {
                tally.committed_overage += quote.get();
            } else {
                tally.committed_lease += quote.get();
            }
        }
    }
    tally
}

/// What all rounds of a run did, for checking that the run reached the
/// paths it names.
#[derive(Default)]
struct RunTally {
    committed_overage: u64,
    cap_refused: u64,
    split_commits_lost: u64,
}

fn run_rounds(sharding: LocalSharding, overage_cap: Option<CostUnits>) -> RunTally {
    let mut run = RunTally::default();
    for round in 0..ROUNDS {
        let lease = lease(sharding);
        let overage = overage_cap.map(|_| Arc::new(AccountOverage::new(AccountId(1))));
        let cap = overage_cap.unwrap_or(CostUnits::ZERO);
        let start = Barrier::new(THREADS);
        let tallies: Vec<Tally> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..THREADS)
                .map(|thread| {
                    let (lease, overage, start) = (&lease, overage.as_ref(), &start);
                    scope.spawn(move || {
                        start.wait();
                        worker(lease, overage, cap, thread as u64)
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        let committed_lease: u64 = tallies.iter().map(|t| t.committed_lease).sum();
        let committed_overage: u64 = tallies.iter().map(|t| t.committed_overage).sum();
        run.committed_overage += committed_overage;
        run.cap_refused += tallies.iter().map(|t| t.cap_refused).sum::<u64>();
        run.split_commits_lost += tallies.iter().map(|t| t.split_lost).sum::<u64>();
        // I6: quiescent now, so the count is exact.
        assert!(lease.is_only_local_view());
        assert_eq!(
            lease.remaining(),
            CostUnits(GRANTED - committed_lease),
            "round {round}: remaining must be granted minus committed"
        );
        if let Some(overage) = &overage {
            // I10: the cap holds, and pending overage all came back.
            assert!(
                overage.spent() <= cap,
                "round {round}: overage past its cap"
            );
            assert_eq!(overage.spent(), CostUnits(committed_overage));
            assert_eq!(overage.committed(), CostUnits(committed_overage));
        }
        // The lease was oversubscribed, so demand really did meet refusal.
        assert!(
            overage_cap.is_some()
                || tallies.iter().any(|t| t.refused > 0)
                || committed_lease == GRANTED,
            "round {round}: the lease never ran dry"
        );
    }
    assert!(
        run.split_commits_lost > 0,
        "no split charge's cancel ever beat its commit: the race went one way"
    );
    run
}

#[test]
fn four_threads_on_one_unsharded_lease_conserve_every_unit() {
    run_rounds(LocalSharding::Single, None);
}

#[test]
fn four_threads_on_one_sharded_lease_conserve_every_unit() {
    run_rounds(LocalSharding::shards(4).unwrap(), None);
}

#[test]
fn four_threads_spilling_into_overage_never_pass_the_cap() {
    let run = run_rounds(LocalSharding::shards(2).unwrap(), Some(CostUnits(40)));
    assert!(run.committed_overage > 0, "overage was never spent");
    assert!(run.cap_refused > 0, "the cap never refused anything");
}

#[test]
fn threads_pinned_to_shards_keep_their_debits_on_their_own_shard() {
    const EACH: u64 = 100;
    let lease = lease(LocalSharding::shards(4).unwrap());
    let start = std::sync::Barrier::new(4);
    // Each thread holds its reservations, so where the units came from is
    // still visible when they have all run.
    let held: Vec<Vec<Reservation>> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..4)
            .map(|shard| {
                let (lease, start) = (&lease, &start);
                scope.spawn(move || {
                    start.wait();
                    (0..EACH)
                        .map(|_| {
                            Reservation::reserve_at_locality(
                                lease,
                                CostUnits(1),
                                at(0),
                                Locality::new(shard),
                            )
                            .unwrap()
                        })
                        .collect()
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let occupancy = lease.occupancy();
    assert_eq!(
        (occupancy.remaining_min, occupancy.remaining_max),
        (CostUnits(GRANTED / 4 - EACH), CostUnits(GRANTED / 4 - EACH)),
        "every shard gave exactly its own thread's units"
    );
    assert_eq!(lease.contended_debits(), 0, "no two threads shared a shard");
    drop(held);
    assert_eq!(lease.remaining(), CostUnits(GRANTED));
    assert_eq!(lease.occupancy().remaining_min, CostUnits(GRANTED / 4));
}
