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
                    let (engine, start) = (&engine, &start);
                    scope.spawn(move || {
                        start.wait();
                        let (mut units, mut commits) = (0, 0);
                        for op in 0..400_u64 {
                            let quote = CostUnits(1 + op % 7);
                            let mut context = match engine.begin(
                                *principal,
                                PermissionBits::NONE,
                                quote,
                                at(1),
                            ) {
                                Ok(context) => context,
                                Err(DenyReason::LeaseExhausted) => continue,
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

#[test]
fn four_threads_on_one_unsharded_account_queue_one_event_per_commit() {
    run(LocalSharding::Single);
}

#[test]
fn four_threads_on_one_sharded_account_queue_one_event_per_commit() {
    run(LocalSharding::shards(4).unwrap());
}
