//! I5: a warm admission allocates nothing. With the snapshot published and a
//! lease installed, `begin` + `commit` + the usage hand-off, and `begin` +
//! drop, make no heap allocation on the calling thread.

mod support;

use std::sync::Arc;

use jiff::{SignedDuration, Timestamp};
use support::counting_allocator::{CountingAllocator, allocations_during, assert_counter_works};
use tollgate::admission::{
    AdmissionEngine, ArcSwapSnapshotMap, RequestIds, SlotRegistry, SnapshotMapConfig, UsageRecorder,
};
use tollgate::{
    AccountId, AccountStatus, CostUnits, DenyReason, EnforcementMode, FencingToken, KeyId,
    KeyStatus, LeaseGrant, LeaseId, LocalLease, LocalSharding, PermissionBits, PolicyRevision,
    Principal, PrincipalSnapshot,
};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

const ALICE: Principal = Principal(1);
const ACCOUNT: AccountId = AccountId(1);

fn at(second: i64) -> Timestamp {
    Timestamp::from_second(second).expect("test instants are in range")
}

fn warm_engine(
    mode: EnforcementMode,
    sharding: LocalSharding,
) -> (AdmissionEngine, Arc<LocalLease>) {
    let registry = Arc::new(SlotRegistry::new(sharding));
    let map = Arc::new(
        ArcSwapSnapshotMap::new(
            SnapshotMapConfig {
                max_staleness: SignedDuration::from_secs(3_600),
                negative_capacity: 16,
                history_depth: 2,
                lookup_queue_capacity: 16,
            },
            Arc::clone(&registry),
        )
        .unwrap(),
    );
    map.publish([PrincipalSnapshot {
        principal: ALICE,
        account_id: ACCOUNT,
        key_id: Some(KeyId(1)),
        key_hash: None,
        permissions: PermissionBits::ALL,
        key_status: KeyStatus::Active,
        account_status: AccountStatus::Active,
        mode,
        policy_revision: PolicyRevision(1),
        fetched_at: at(0),
    }]);
    let lease = Arc::new(LocalLease::with_sharding(
        LeaseGrant {
            lease_id: LeaseId(1),
            account_id: ACCOUNT,
            fencing_token: FencingToken(1),
            units: CostUnits(1_000_000),
            expires_at: at(1_000),
        },
        CostUnits::ZERO,
        SignedDuration::ZERO,
        sharding,
    ));
    registry.get(ACCOUNT).unwrap().replace(Arc::clone(&lease));
    let recorder = UsageRecorder::with_capacity(4_096, 4_096);
    let engine = AdmissionEngine::new(map, recorder, RequestIds::with_prefix(1));
    // Warm the thread: its locality, request-id counter and arc-swap slot.
    drop(
        engine
            .begin(ALICE, PermissionBits::NONE, CostUnits(1), at(1))
            .unwrap(),
    );
    (engine, lease)
}

#[test]
fn the_allocator_sees_allocations_on_this_thread() {
    assert_counter_works();
}

#[test]
fn begin_commit_and_usage_hand_off_allocate_nothing() {
    for mode in [
        EnforcementMode::Strict,
        EnforcementMode::Elastic {
            overage_cap: CostUnits(10),
        },
    ] {
        for sharding in [LocalSharding::Single, LocalSharding::shards(4).unwrap()] {
            let (engine, lease) = warm_engine(mode, sharding);
            let counted = allocations_during(|| {
                for _ in 0..1_000 {
                    let mut context = engine
                        .begin(ALICE, PermissionBits::bit(0), CostUnits(2), at(1))
                        .unwrap();
                    assert_eq!(context.commit(at(2)), Ok(CostUnits(2)));
                }
            });
            assert_eq!(
                counted, 0,
                "I5: a warm admission allocated ({mode:?}, {sharding:?})"
            );
            assert_eq!(engine.recorder().queued(), 1_000);
            assert_eq!(lease.remaining(), CostUnits(1_000_000 - 2_000));
        }
    }
}

/// I5 on the Elastic paths: a quote the lease cannot fund, admitted on
/// overage, and a leased charge whose window closes before its commit,
/// which falls back to overage there.
#[test]
fn elastic_overage_admissions_and_lapsed_commits_allocate_nothing() {
    let mode = EnforcementMode::Elastic {
        overage_cap: CostUnits(1_000_000_000),
    };
    let (engine, lease) = warm_engine(mode, LocalSharding::Single);
    let beyond_the_lease = CostUnits(2_000_000);
    let counted = allocations_during(|| {
        for _ in 0..100 {
            let mut context = engine
                .begin(ALICE, PermissionBits::bit(0), beyond_the_lease, at(1))
                .unwrap();
            assert_eq!(context.commit(at(2)), Ok(beyond_the_lease));
        }
    });
    assert_eq!(counted, 0, "I5: an overage admission allocated");
    assert_eq!(
        lease.remaining(),
        CostUnits(1_000_000),
        "the lease funded none"
    );
    assert_eq!(engine.counters().read().admitted_overage, 100);

    let counted = allocations_during(|| {
        for _ in 0..100 {
            let mut context = engine
                .begin(ALICE, PermissionBits::bit(0), CostUnits(2), at(999))
                .unwrap();
            // The lease's window closed at 1 000 (no margin).
            assert_eq!(context.commit(at(1_000)), Ok(CostUnits(2)));
        }
    });
    assert_eq!(
        counted, 0,
        "I5: a lapsed commit's overage fallback allocated"
    );
    assert_eq!(
        lease.remaining(),
        CostUnits(1_000_000),
        "each lapse gave its units back"
    );
    assert_eq!(engine.recorder().queued(), 200);
}

/// I5, I4: a pending charge dropped before its handler starts allocates
/// nothing, in either mode and either sharding, and leaves nothing behind:
/// its units back in the lease, no event, its usage place free again.
#[test]
fn begin_and_drop_allocate_nothing() {
    for mode in [
        EnforcementMode::Strict,
        EnforcementMode::Elastic {
            overage_cap: CostUnits(10),
        },
    ] {
        for sharding in [LocalSharding::Single, LocalSharding::shards(4).unwrap()] {
            let (engine, lease) = warm_engine(mode, sharding);
            let counted = allocations_during(|| {
                for _ in 0..1_000 {
                    drop(
                        engine
                            .begin(ALICE, PermissionBits::bit(0), CostUnits(2), at(1))
                            .unwrap(),
                    );
                }
            });
            assert_eq!(
                counted, 0,
                "I5: begin + drop allocated ({mode:?}, {sharding:?})"
            );
            assert_eq!(
                lease.remaining(),
                CostUnits(1_000_000),
                "I4, I6: a drop returns its units to the lease ({mode:?}, {sharding:?})"
            );
            assert_eq!(
                engine.recorder().queued(),
                0,
                "I8: a released charge yields no event ({mode:?}, {sharding:?})"
            );
            assert_eq!(
                engine.recorder().available(),
                engine.recorder().capacity(),
                "I20: a dropped permit frees its place ({mode:?}, {sharding:?})"
            );
        }
    }
}

/// I5, I4 on the Elastic overage path: a quote the lease cannot fund,
/// admitted on overage and dropped before its handler starts, allocates
/// nothing and hands its overage back. The cap holds exactly one such
/// quote, so each admission after the first is only possible because the
/// drop before it returned the overage.
#[test]
fn elastic_begin_on_overage_and_drop_allocate_nothing() {
    let beyond_the_lease = CostUnits(2_000_000);
    let mode = EnforcementMode::Elastic {
        overage_cap: beyond_the_lease,
    };
    for sharding in [LocalSharding::Single, LocalSharding::shards(4).unwrap()] {
        let (engine, lease) = warm_engine(mode, sharding);
        let slot = engine.snapshots().registry().get(ACCOUNT).unwrap();
        let overage = slot.overage();
        let counted = allocations_during(|| {
            for _ in 0..1_000 {
                let context = engine
                    .begin(ALICE, PermissionBits::bit(0), beyond_the_lease, at(1))
                    .unwrap();
                assert!(context.admitted_as_overage());
                drop(context);
            }
        });
        assert_eq!(
            counted, 0,
            "I5: an overage admission + drop allocated ({sharding:?})"
        );
        assert_eq!(engine.counters().read().admitted_overage, 1_000);
        assert_eq!(
            (overage.spent(), overage.committed()),
            (CostUnits::ZERO, CostUnits::ZERO),
            "I4: a dropped overage charge hands its units back ({sharding:?})"
        );
        assert_eq!(
            lease.remaining(),
            CostUnits(1_000_000),
            "I6: the lease funded none ({sharding:?})"
        );
        assert_eq!(
            engine.recorder().queued(),
            0,
            "I8: a released charge yields no event ({sharding:?})"
        );
        assert_eq!(
            engine.recorder().available(),
            engine.recorder().capacity(),
            "I20: a dropped permit frees its place ({sharding:?})"
        );
    }
}

#[test]
fn denials_allocate_nothing() {
    let (engine, _lease) = warm_engine(EnforcementMode::Strict, LocalSharding::Single);
    let counted = allocations_during(|| {
        for _ in 0..100 {
            assert_eq!(
                engine
                    .begin(ALICE, PermissionBits::ALL, CostUnits(2_000_000), at(1))
                    .unwrap_err(),
                DenyReason::LeaseExhausted
            );
            assert_eq!(
                engine
                    .begin(ALICE, PermissionBits::NONE, CostUnits(1), at(10_000))
                    .unwrap_err(),
                DenyReason::SnapshotStale
            );
        }
    });
    assert_eq!(counted, 0, "I5: a denial allocated");
}
