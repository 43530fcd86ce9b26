//! Several threads admitting, committing and dropping against one account:
//! every unit is accounted for and every commit queued exactly one event.

use std::sync::{Arc, Barrier};

use jiff::{SignedDuration, Timestamp};
use tollgate::admission::{
    AdmissionEngine, ArcSwapSnapshotMap, RequestIds, SlotRegistry, SnapshotMapConfig, UsageRecorder,
};
use tollgate::{
    AccountId, AccountStatus, CostUnits, DenyReason, EnforcementMode, FencingToken, KeyId,
    KeyStatus, LeaseGrant, LeaseId, LocalLease, LocalSharding, PermissionBits, PolicyRevision,
    Principal, PrincipalSnapshot,
};

const THREADS: usize = 4;
const GRANTED: u64 = 3_000;
/// Quotes run from 1 to this; the threads' committed demand (about 4,270
/// units) is well over [`GRANTED`], so the lease runs dry.
const MAX_QUOTE: u64 = 7;

fn at(second: i64) -> Timestamp {
    Timestamp::from_second(second).expect("test instants are in range")
}

fn run(sharding: LocalSharding) {
    for round in 0..50 {
        let registry = Arc::new(SlotRegistry::new(sharding));
        let map = Arc::new(
            ArcSwapSnapshotMap::new(
                SnapshotMapConfig {
                    max_staleness: SignedDuration::from_secs(3_600),
                    negative_capacity: 4,
                    history_depth: 1,
                    lookup_queue_capacity: 4,
                },
                Arc::clone(&registry),
            )
            .unwrap(),
        );
        let principals: Vec<Principal> = (1..=THREADS as u64).map(Principal).collect();
        map.publish(principals.iter().map(|principal| PrincipalSnapshot {
            principal: *principal,
            account_id: AccountId(1),
            key_id: Some(KeyId(principal.get())),
            key_hash: None,
            permissions: PermissionBits::ALL,
            key_status: KeyStatus::Active,
            account_status: AccountStatus::Active,
            mode: EnforcementMode::Strict,
            policy_revision: PolicyRevision(1),
            fetched_at: at(0),
        }));
        let lease = Arc::new(LocalLease::with_sharding(
            LeaseGrant {
                lease_id: LeaseId(1),
                account_id: AccountId(1),
                fencing_token: FencingToken(1),
                units: CostUnits(GRANTED),
                expires_at: at(1_000),
            },
            CostUnits::ZERO,
            SignedDuration::ZERO,
            sharding,
        ));
        registry
            .get(AccountId(1))
            .unwrap()
            .replace(Arc::clone(&lease));
        let recorder = UsageRecorder::with_capacity(100_000, 100_000);
        let engine = AdmissionEngine::new(map, recorder.clone(), RequestIds::with_prefix(1));
        let start = Barrier::new(THREADS);
        let (committed, commits): (u64, usize) = std::thread::scope(|scope| {
            let workers: Vec<_> = principals
                .iter()
                .map(|principal| {
                    let (engine, start, lease) = (&engine, &start, &lease);
                    scope.spawn(move || {
                        start.wait();
                        let (mut units, mut commits) = (0, 0);
                        for op in 0..400_u64 {
                            let quote = CostUnits(1 + op % MAX_QUOTE);
                            let mut context = match engine.begin(
                                *principal,
                                PermissionBits::NONE,
                                quote,
                                at(1),
                            ) {
                                Ok(context) => context,
                                Err(DenyReason::LeaseExhausted) => {
                                    if sharding == LocalSharding::Single {
                                        assert_refused_short(lease, quote);
                                    }
                                    continue;
                                }
                                Err(other) => panic!("unexpected denial {other:?}"),
                            };
                            if op % 3 != 0 {
                                context.commit(at(2)).unwrap();
                                units += quote.get();
                                commits += 1;
                            }
                        }
                        (units, commits)
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap())
                .fold((0, 0), |(u, c), (wu, wc)| (u + wu, c + wc))
        });
        drop(engine);
        // I8, I20: one queued event per commit, no more, no less.
        assert_eq!(recorder.queued(), commits, "round {round}");
        // I26: until their events leave the process, the commits hold the
        // lease that funded them, so it cannot be released yet.
        assert_eq!(lease.is_only_local_view(), commits == 0, "round {round}");
        let mut delivered = Vec::new();
        assert_eq!(recorder.take_recorded(&mut delivered, usize::MAX), commits);
        assert!(lease.is_only_local_view(), "round {round}");
        // I6: remaining + committed == granted, exactly.
        assert_eq!(
            lease.remaining().get() + committed,
            GRANTED,
            "round {round}"
        );
        let billed: u64 = delivered.iter().map(|event| event.units.get()).sum();
        assert_eq!(billed, committed, "round {round}");
    }
}

/// A refusal of `quote` by an unsharded lease is a true shortage: the lease
/// held less than `quote` when it refused, and since then it can have got
/// back only what the other threads had in flight then (each holds at most
/// one charge, of at most [`MAX_QUOTE`]); any charge taken later is paid
/// for before it can be given back. A debit refused while the lease could
/// fund it, such as a lost exchange taken for want of units, leaves more.
fn assert_refused_short(lease: &LocalLease, quote: CostUnits) {
    let left = lease.remaining().get();
    let bound = (quote.get() - 1) + MAX_QUOTE * (THREADS as u64 - 1);
    assert!(
        left <= bound,
        "a quote of {quote:?} refused with {left} units left"
    );
}

#[test]
fn four_threads_on_one_unsharded_account_queue_one_event_per_commit() {
    run(LocalSharding::Single);
}

#[test]
fn four_threads_on_one_sharded_account_queue_one_event_per_commit() {
    run(LocalSharding::shards(4).unwrap());
}

/// A warm engine for one account: `principals` published, a lease of
/// `GRANTED` units installed.
fn warm(principals: u64) -> (AdmissionEngine, Arc<ArcSwapSnapshotMap>, Arc<SlotRegistry>) {
    let registry = Arc::new(SlotRegistry::new(LocalSharding::Single));
    let map = Arc::new(
        ArcSwapSnapshotMap::new(
            SnapshotMapConfig {
                max_staleness: SignedDuration::from_secs(3_600),
                negative_capacity: 4,
                history_depth: 1,
                lookup_queue_capacity: 4,
            },
            Arc::clone(&registry),
        )
        .unwrap(),
    );
    map.publish((1..=principals).map(|principal| snapshot(principal, KeyStatus::Active)));
    registry
        .get(AccountId(1))
        .unwrap()
        .replace(Arc::new(lease(1)));
    let engine = AdmissionEngine::new(
        Arc::clone(&map),
        UsageRecorder::with_capacity(100_000, 100_000),
        RequestIds::with_prefix(1),
    );
    (engine, map, registry)
}

fn snapshot(principal: u64, key_status: KeyStatus) -> PrincipalSnapshot {
    PrincipalSnapshot {
        principal: Principal(principal),
        account_id: AccountId(1),
        key_id: Some(KeyId(principal)),
        key_hash: None,
        permissions: PermissionBits::ALL,
        key_status,
        account_status: AccountStatus::Active,
        mode: EnforcementMode::Strict,
        policy_revision: PolicyRevision(1),
        fetched_at: at(0),
    }
}

fn lease(id: u64) -> LocalLease {
    LocalLease::new(
        LeaseGrant {
            lease_id: LeaseId(id),
            account_id: AccountId(1),
            fencing_token: FencingToken(id),
            units: CostUnits(GRANTED * 1_000),
            expires_at: at(1_000),
        },
        CostUnits::ZERO,
    )
}

/// I23, I24: each thread reads policy through its cached generation of the
/// snapshot map, and a publish that happened before an admission (here: the
/// publisher's flag, read with acquire) is always seen by it, on every
/// thread, however warm its cache. The publisher moves on only once every
/// thread has checked an admission against the generation just published,
/// so every generation is checked on every thread.
#[test]
fn a_publish_is_seen_by_every_thread_that_admits_after_it() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    const ROUNDS: u64 = 40;
    let (engine, map, _registry) = warm(THREADS as u64);
    // A sequence: `2r - 1` while round `r` is being published, `2r` once it
    // has been. Odd rounds revoke the keys, even rounds reinstate them.
    let sequence = AtomicU64::new(0);
    // Per thread, the sequence its last checked admission ran in.
    let checked: Vec<AtomicU64> = (0..THREADS).map(|_| AtomicU64::new(u64::MAX)).collect();
    let done = AtomicBool::new(false);
    let start = Barrier::new(THREADS + 1);
    std::thread::scope(|scope| {
        for (index, principal) in (1..=THREADS as u64).enumerate() {
            let (engine, sequence, start) = (&engine, &sequence, &start);
            let (checked, done) = (&checked[index], &done);
            scope.spawn(move || {
                start.wait();
                while !done.load(Ordering::Acquire) {
                    let before = sequence.load(Ordering::Acquire);
                    let outcome = engine.begin(
                        Principal(principal),
                        PermissionBits::NONE,
                        CostUnits(1),
                        at(1),
                    );
                    // Only an admission that ran wholly between two
                    // publishes is checked: it must see the earlier one.
                    let after = sequence.load(Ordering::Acquire);
                    if before != after || before % 2 == 1 {
                        continue;
                    }
                    let revoked = (before / 2) % 2 == 1;
                    match (revoked, outcome) {
                        (false, Ok(_)) | (true, Err(DenyReason::KeyRevoked)) => {}
                        // Admitted after a revocation it was told of, or
                        // refused after a reinstatement: a stale cache.
                        (revoked, outcome) => panic!(
                            "revoked {revoked} at {before}: {:?}",
                            outcome.map(|context| context.request_id())
                        ),
                    }
                    checked.store(before, Ordering::Release);
                }
            });
        }
        start.wait();
        for round in 1..=ROUNDS {
            let status = if round % 2 == 1 {
                KeyStatus::Revoked
            } else {
                KeyStatus::Active
            };
            sequence.store(2 * round - 1, Ordering::Release);
            map.publish((1..=THREADS as u64).map(|principal| snapshot(principal, status)));
            sequence.store(2 * round, Ordering::Release);
            // Bounded, so a thread that panicked fails the test, not hangs it.
            let give_up = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while checked
                .iter()
                .any(|thread| thread.load(Ordering::Acquire) != 2 * round)
            {
                if std::time::Instant::now() > give_up {
                    done.store(true, Ordering::Release);
                    panic!("not every thread checked generation {}", 2 * round);
                }
                std::thread::yield_now();
            }
        }
        done.store(true, Ordering::Release);
    });
}

/// I26: a thread's cached snapshot generation holds no lease, so once its
/// requests' events are delivered a superseded lease is quiescent even
/// though the threads that used it are alive and have not admitted since.
#[test]
fn a_cached_generation_never_keeps_a_superseded_lease_busy() {
    let (engine, _map, registry) = warm(THREADS as u64);
    let slot = registry.get(AccountId(1)).unwrap();
    let admitted = Barrier::new(THREADS + 1);
    let checked = Barrier::new(THREADS + 1);
    std::thread::scope(|scope| {
        for principal in 1..=THREADS as u64 {
            let (engine, admitted, checked) = (&engine, &admitted, &checked);
            scope.spawn(move || {
                for _ in 0..100 {
                    let mut context = engine
                        .begin(
                            Principal(principal),
                            PermissionBits::NONE,
                            CostUnits(1),
                            at(1),
                        )
                        .unwrap();
                    context.commit(at(2)).unwrap();
                }
                admitted.wait();
                // Stay alive, cache warm, until the lease has been checked.
                checked.wait();
            });
        }
        admitted.wait();
        let old = slot.replace(Arc::new(lease(2))).unwrap();
        assert!(!old.is_only_local_view(), "undelivered events hold it");
        let mut delivered = Vec::new();
        engine.recorder().take_recorded(&mut delivered, usize::MAX);
        assert_eq!(delivered.len(), 100 * THREADS);
        assert_eq!(Arc::strong_count(&old), 1, "no thread holds the lease");
        assert!(old.is_only_local_view(), "I26: quiescent");
        assert_eq!(
            old.remaining().get(),
            GRANTED * 1_000 - 100 * THREADS as u64
        );
        checked.wait();
    });
}

/// Admission counts are exact however many threads admit: the first
/// threads count on stripes of their own, later ones share.
#[test]
fn admission_counts_are_exact_across_many_threads() {
    const MANY: u64 = 160;
    let (engine, _map, _registry) = warm(1);
    // All started before any admits, so the counting overlaps.
    let start = Barrier::new(usize::try_from(MANY).unwrap());
    std::thread::scope(|scope| {
        for _ in 0..MANY {
            let (engine, start) = (&engine, &start);
            scope.spawn(move || {
                start.wait();
                for _ in 0..50 {
                    engine
                        .begin(Principal(1), PermissionBits::NONE, CostUnits(1), at(1))
                        .unwrap();
                }
                // One denial each, counted on the same stripe: a principal
                // the map has not loaded, while no refresh vouches for it.
                let denied = engine.begin(Principal(99), PermissionBits::NONE, CostUnits(1), at(1));
                assert_eq!(denied.err(), Some(DenyReason::SnapshotUnavailable));
            });
        }
    });
    let stats = engine.counters().read();
    assert_eq!(stats.admitted, MANY * 50);
    assert_eq!(stats.denied_total(), MANY);
    assert_eq!(stats.denied_for(DenyReason::SnapshotUnavailable), MANY);
}
