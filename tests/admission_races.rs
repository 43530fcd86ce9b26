//! Several threads admitting, committing and dropping against one account:
//! every unit is accounted for and every commit queued exactly one event.

use std::sync::{Arc, Barrier};

use jiff::{SignedDuration, Timestamp};
use tollgate::admission::{
    AdmissionEngine, ArcSwapSnapshotMap, LeaseSlot, RequestIds, SlotRegistry, SnapshotMapConfig,
    UsageRecorder,
};
use tollgate::{
    AccountId, AccountOverage, AccountStatus, CostUnits, DenyReason, EnforcementMode, FencingToken,
    KeyId, KeyStatus, LeaseGrant, LeaseId, LocalLease, LocalSharding, PermissionBits,
    PolicyRevision, Principal, PrincipalSnapshot, UsageSource,
};

const THREADS: usize = 4;
const GRANTED: u64 = 3_000;
/// Quotes run from 1 to this; the threads' committed demand (about 4,270
/// units) is well over [`GRANTED`], so the lease runs dry.
const MAX_QUOTE: u64 = 7;

fn at(second: i64) -> Timestamp {
    Timestamp::from_second(second).expect("test instants are in range")
}

/// A fresh engine for one round of a race: one account, [`THREADS`]
/// principals published on it, and a lease installed in its slot.
struct Round {
    engine: AdmissionEngine,
    recorder: UsageRecorder,
    lease: Arc<LocalLease>,
    slot: Arc<LeaseSlot>,
    principals: Vec<Principal>,
}

/// A [`Round`] whose principals are published under `mode`, with a lease of
/// `granted` units.
fn one_account(sharding: LocalSharding, mode: EnforcementMode, granted: u64) -> Round {
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
        mode,
        policy_revision: PolicyRevision(1),
        fetched_at: at(0),
    }));
    let lease = Arc::new(LocalLease::with_sharding(
        LeaseGrant {
            lease_id: LeaseId(1),
            account_id: AccountId(1),
            fencing_token: FencingToken(1),
            units: CostUnits(granted),
            expires_at: at(1_000),
        },
        CostUnits::ZERO,
        SignedDuration::ZERO,
        sharding,
    ));
    let slot = registry.get(AccountId(1)).unwrap();
    slot.replace(Arc::clone(&lease));
    let recorder = UsageRecorder::with_capacity(100_000, 100_000);
    let engine = AdmissionEngine::new(map, recorder.clone(), RequestIds::with_prefix(1));
    Round {
        engine,
        recorder,
        lease,
        slot,
        principals,
    }
}

fn run(sharding: LocalSharding) {
    for round in 0..50 {
        let Round {
            engine,
            recorder,
            lease,
            principals,
            ..
        } = one_account(sharding, EnforcementMode::Strict, GRANTED);
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

/// The Elastic race's lease: small, so most of the demand spills into
/// overage.
const ELASTIC_GRANTED: u64 = 300;
/// The Elastic race's overage cap. The threads' committed demand (about
/// 4,270 units, as in [`run`]) is well over [`ELASTIC_GRANTED`] plus this,
/// so the lease runs dry, overage funds the next charges, and the cap then
/// refuses some in every round.
const CAP: u64 = 1_000;

/// What the Elastic race's threads saw, one thread's or all together.
#[derive(Default)]
struct Tally {
    lease_units: u64,
    lease_commits: usize,
    lease_drops: usize,
    overage_units: u64,
    overage_commits: usize,
    overage_drops: usize,
    denials: usize,
}

impl std::ops::Add for Tally {
    type Output = Self;

    fn add(mut self, other: Self) -> Self {
        self.lease_units += other.lease_units;
        self.lease_commits += other.lease_commits;
        self.lease_drops += other.lease_drops;
        self.overage_units += other.overage_units;
        self.overage_commits += other.overage_commits;
        self.overage_drops += other.overage_drops;
        self.denials += other.denials;
        self
    }
}

/// One thread of the Elastic race: the operations of [`run`]'s threads,
/// tallied by what funded each admitted charge and how it ended.
fn elastic_worker(
    engine: &AdmissionEngine,
    overage: &AccountOverage,
    principal: Principal,
) -> Tally {
    let mut tally = Tally::default();
    for op in 0..400_u64 {
        let quote = CostUnits(1 + op % MAX_QUOTE);
        // Committed overage only grows: read before the admission, it
        // bounds what a refusal saw.
        let committed_before = overage.committed();
        let outcome = engine.begin(principal, PermissionBits::NONE, quote, at(1));
        // I10: however the threads interleave, the cap holds at every
        // moment, pending units included.
        assert!(overage.spent().get() <= CAP, "I10: past the cap");
        let mut context = match outcome {
            Ok(context) => context,
            Err(refusal) => {
                assert_cap_refusal(overage, committed_before, quote, refusal);
                tally.denials += 1;
                continue;
            }
        };
        let from_overage = context.admitted_as_overage();
        if op % 3 == 0 {
            // Dropped before its handler starts (I4).
            drop(context);
            if from_overage {
                tally.overage_drops += 1;
            } else {
                tally.lease_drops += 1;
            }
            continue;
        }
        // Inside the lease's window: no fallback, so the admission's
        // funding is what pays (I3).
        assert_eq!(context.commit(at(2)), Ok(quote));
        if from_overage {
            tally.overage_units += quote.get();
            tally.overage_commits += 1;
        } else {
            tally.lease_units += quote.get();
            tally.lease_commits += 1;
        }
    }
    tally
}

/// The race of [`run`] against an Elastic account: charges the lease cannot
/// fund are admitted on overage under the cap, and both kinds are committed
/// or dropped while the other threads race them.
fn run_elastic(sharding: LocalSharding) {
    let mode = EnforcementMode::Elastic {
        overage_cap: CostUnits(CAP),
    };
    for round in 0..50 {
        let Round {
            engine,
            recorder,
            lease,
            slot,
            principals,
        } = one_account(sharding, mode, ELASTIC_GRANTED);
        let overage = slot.overage();
        let start = Barrier::new(THREADS);
        let tally = std::thread::scope(|scope| {
            let workers: Vec<_> = principals
                .iter()
                .map(|principal| {
                    let (engine, start) = (&engine, &start);
                    scope.spawn(move || {
                        start.wait();
                        elastic_worker(engine, overage, *principal)
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap())
                .fold(Tally::default(), std::ops::Add::add)
        });
        // Both fundings, both endings and the cap's refusals all happened,
        // so none of the checks below holds vacuously.
        assert!(tally.lease_commits > 0, "round {round}: no leased commit");
        assert!(
            tally.overage_commits > 0,
            "round {round}: no overage commit"
        );
        assert!(tally.lease_drops > 0, "round {round}: no leased drop");
        assert!(tally.overage_drops > 0, "round {round}: no overage drop");
        assert!(tally.denials > 0, "round {round}: the cap refused nothing");
        let stats = engine.counters().read();
        assert_eq!(
            stats.admitted_overage,
            (tally.overage_commits + tally.overage_drops) as u64,
            "round {round}"
        );
        assert_eq!(stats.denied_total(), tally.denials as u64, "round {round}");
        drop(engine);
        let commits = tally.lease_commits + tally.overage_commits;
        // I8, I20: one queued event per commit, no more, no less.
        assert_eq!(recorder.queued(), commits, "I8: round {round}");
        // I26: the leased commits' events hold the lease until delivered.
        assert!(!lease.is_only_local_view(), "I26: round {round}");
        let mut delivered = Vec::new();
        assert_eq!(recorder.take_recorded(&mut delivered, usize::MAX), commits);
        assert!(lease.is_only_local_view(), "I26: round {round}");
        // I20: every place is free again, whether its charge was dropped
        // or its event delivered.
        assert_eq!(
            recorder.available(),
            recorder.capacity(),
            "I20: round {round}"
        );
        let (mut leased, mut overage_billed) = ((0_usize, 0_u64), (0_usize, 0_u64));
        for event in &delivered {
            let kind = match event.source {
                UsageSource::Leased { lease_id, .. } => {
                    assert_eq!(lease_id, LeaseId(1), "round {round}");
                    &mut leased
                }
                UsageSource::Overage => &mut overage_billed,
            };
            kind.0 += 1;
            kind.1 += event.units.get();
        }
        // I3, I8: each commit billed what its funding was, once.
        assert_eq!(
            leased,
            (tally.lease_commits, tally.lease_units),
            "I8: round {round}"
        );
        assert_eq!(
            overage_billed,
            (tally.overage_commits, tally.overage_units),
            "I8: round {round}"
        );
        // I6: remaining + committed == granted, exactly, with every dropped
        // leased charge's units back.
        assert_eq!(
            lease.remaining().get() + leased.1,
            ELASTIC_GRANTED,
            "I6: round {round}"
        );
        // I10: the counter's committed overage is exactly what was billed as
        // overage, and within the cap.
        assert_eq!(
            overage.committed().get(),
            overage_billed.1,
            "I10: round {round}"
        );
        assert!(overage_billed.1 <= CAP, "I10: round {round}");
        // I4: every dropped overage charge handed its units back, so the
        // committed units explain all the counter still holds.
        assert_eq!(overage.spent(), overage.committed(), "I4: round {round}");
    }
}

/// A refusal in the Elastic race: the lease could not fund `quote` and nor
/// could the cap. Which answer it is depends on what filled the cap (I11);
/// anything else (the lease's own refusals included) is a bug.
/// `committed_before` is the committed overage read before the admission.
fn assert_cap_refusal(
    overage: &AccountOverage,
    committed_before: CostUnits,
    quote: CostUnits,
    refusal: DenyReason,
) {
    match refusal {
        // A cap full of committed units, with no allocator evidence that
        // rules the quote out: the lease's transient refusal is the
        // truthful answer, never `OverageCapExhausted` (I11). Committed
        // overage only grows, so it still leaves no room.
        DenyReason::LeaseExhausted => assert!(
            overage.committed().get() + quote.get() > CAP,
            "I11: {quote:?} refused by the lease with {:?} committed",
            overage.committed()
        ),
        // Pending (refundable) or publishing units fill the cap, but the
        // committed ones alone left room when the admission began (I11).
        DenyReason::OverageCapTemporarilyExhausted { spent, overage_cap }
        | DenyReason::OverageCommitInProgress { spent, overage_cap } => {
            assert_eq!(overage_cap, CostUnits(CAP), "the cap admission read");
            assert!(
                spent.get() <= CAP && spent.get() + quote.get() > CAP,
                "I10: {quote:?} refused with {spent:?} spent"
            );
            assert!(
                committed_before.get() + quote.get() <= CAP,
                "I11: {refusal:?} of {quote:?} with {committed_before:?} committed"
            );
        }
        other => panic!("unexpected denial {other:?} of {quote:?}"),
    }
}

/// I6, I10, I4, I8 under Elastic funding, on an unsharded lease.
#[test]
fn four_threads_on_one_unsharded_elastic_account_conserve_lease_and_overage() {
    run_elastic(LocalSharding::Single);
}

/// I6, I10, I4, I8 under Elastic funding, on a sharded lease.
#[test]
fn four_threads_on_one_sharded_elastic_account_conserve_lease_and_overage() {
    run_elastic(LocalSharding::shards(4).unwrap());
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
        let held_by_events = !old.is_only_local_view();
        let mut delivered = Vec::new();
        engine.recorder().take_recorded(&mut delivered, usize::MAX);
        // Read while the threads are alive and their caches warm; asserted
        // once they are let go, so a failure fails rather than hangs.
        let observed = (
            delivered.len(),
            Arc::strong_count(&old),
            old.is_only_local_view(),
            old.remaining().get(),
        );
        checked.wait();
        assert!(held_by_events, "undelivered events hold it");
        let (delivered, references, quiescent, remaining) = observed;
        assert_eq!(delivered, 100 * THREADS);
        assert_eq!(references, 1, "no thread holds the lease");
        assert!(quiescent, "I26: quiescent");
        assert_eq!(remaining, GRANTED * 1_000 - 100 * THREADS as u64);
    });
}

/// I26 under rotation: while threads admit, commit and drop on one account,
/// the lease manager's part replaces the serving lease again and again.
/// A request racing a replacement lands on a lease, the one it read or the
/// new one (none is refused for want of one), and each superseded lease,
/// once its events are delivered, is quiescent with exactly its grant less
/// the charges committed against it (I6), one event per commit (I8).
#[test]
fn requests_racing_lease_replacements_are_funded_and_every_lease_balances() {
    /// Per thread: half commit, so the events stay within the queue.
    const REQUESTS: u64 = 40_000;
    let (engine, _map, registry) = warm(THREADS as u64);
    let slot = registry.get(AccountId(1)).unwrap();
    let start = Barrier::new(THREADS + 1);
    let mut superseded = Vec::new();
    let admitted = std::thread::scope(|scope| {
        let workers: Vec<_> = (1..=THREADS as u64)
            .map(|principal| {
                let (engine, start) = (&engine, &start);
                scope.spawn(move || {
                    start.wait();
                    let mut count = 0_u64;
                    while count < REQUESTS {
                        let mut context = engine
                            .begin(
                                Principal(principal),
                                PermissionBits::NONE,
                                CostUnits(1),
                                at(1),
                            )
                            .expect("I26: a lease serves throughout");
                        // Every other request ends before its handler.
                        if count.is_multiple_of(2) {
                            context.commit(at(2)).unwrap();
                        }
                        count += 1;
                    }
                    count
                })
            })
            .collect();
        start.wait();
        let mut id = 1;
        while !workers
            .iter()
            .all(std::thread::ScopedJoinHandle::is_finished)
        {
            id += 1;
            superseded.push(slot.replace(Arc::new(lease(id))).unwrap());
            // A few requests' time, without giving up the core.
            for _ in 0..1_000 {
                std::hint::spin_loop();
            }
        }
        assert!(id > 2, "the leases were replaced while requests ran");
        workers
            .into_iter()
            .map(|worker| worker.join().unwrap())
            .collect::<Vec<_>>()
    });
    let commits: u64 = admitted.iter().map(|count| count.div_ceil(2)).sum();
    let mut delivered = Vec::new();
    engine.recorder().take_recorded(&mut delivered, usize::MAX);
    assert_eq!(delivered.len() as u64, commits, "I8: one event per commit");
    let serving = slot.take().unwrap();
    superseded.push(serving);
    let mut charged = std::collections::HashMap::new();
    for event in &delivered {
        let lease = event.source.lease_id().expect("a Strict charge is leased");
        *charged.entry(lease).or_insert(0_u64) += event.units.get();
    }
    for lease in &superseded {
        assert_eq!(Arc::strong_count(lease), 1, "I26: no thread holds it");
        assert!(lease.is_only_local_view(), "I26");
        let id = lease.grant().lease_id;
        let charged = charged.remove(&id).unwrap_or(0);
        assert_eq!(
            lease.remaining().get() + charged,
            GRANTED * 1_000,
            "I6: lease {id:?}"
        );
    }
    assert!(charged.is_empty(), "every charge names a lease of the slot");
    assert_eq!(
        delivered.iter().map(|event| event.units.get()).sum::<u64>(),
        commits
    );
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
