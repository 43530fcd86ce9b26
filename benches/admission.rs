//! The request path end to end: `begin` + `commit` + usage hand-off on a warm
//! account, against the model's bare reserve+commit and, as a peer anchor,
//! `governor`'s keyed `check_key` on one hot key. Single-threaded and with
//! two threads, all in one run so the ratios mean something. `begin` + drop
//! (a request that ends before its handler) splits the end-to-end figure
//! into admission and commit + hand-off, and one uncontended atomic
//! read-modify-write is the unit the design states the hot path's budget in.
//!
//! ```sh
//! cargo bench --bench admission
//! ```

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use governor::{Quota, RateLimiter};
use jiff::{SignedDuration, Timestamp};
use tollgate::admission::{
    AdmissionEngine, ArcSwapSnapshotMap, RequestContext, RequestIds, SlotRegistry,
    SnapshotMapConfig, UsageRecorder,
};
use tollgate::{
    AccountId, AccountStatus, CommitFunding, CostUnits, EnforcementMode, FencingToken, KeyId,
    KeyStatus, LeaseGrant, LeaseId, LocalLease, LocalSharding, Locality, PermissionBits,
    PolicyRevision, Principal, PrincipalSnapshot, RequestId, Reservation,
};

/// Requests between two drains of the usage queue. The drain stands in for
/// the usage writer, which empties the queue off the request path; it runs
/// outside the timed region, and reusing one queue keeps its memory warm as a
/// running writer does.
const CHUNK: u64 = 1 << 10;

/// Per-thread requests between drains when two threads share an engine:
/// large enough that starting the pair of threads is noise.
const PAIR_CHUNK: u64 = 1 << 14;

fn now() -> Timestamp {
    Timestamp::from_second(1_700_000_000).expect("in range")
}

fn lease(sharding: LocalSharding) -> Arc<LocalLease> {
    Arc::new(LocalLease::with_sharding(
        LeaseGrant {
            lease_id: LeaseId(1),
            account_id: AccountId(1),
            fencing_token: FencingToken(1),
            units: CostUnits(u64::MAX / 4),
            expires_at: now() + SignedDuration::from_hours(24),
        },
        CostUnits::ZERO,
        SignedDuration::ZERO,
        sharding,
    ))
}

/// A warm engine: two principals of one account published, a lease
/// installed, and a usage queue with room for one chunk.
fn engine(sharding: LocalSharding, queue_capacity: u64) -> AdmissionEngine {
    let registry = Arc::new(SlotRegistry::new(sharding));
    let map = Arc::new(
        ArcSwapSnapshotMap::new(
            SnapshotMapConfig {
                max_staleness: SignedDuration::from_hours(24),
                negative_capacity: 16,
                history_depth: 1,
                lookup_queue_capacity: 16,
            },
            Arc::clone(&registry),
        )
        .expect("valid"),
    );
    map.publish((0..2).map(|principal| PrincipalSnapshot {
        principal: Principal(principal),
        account_id: AccountId(1),
        key_id: Some(KeyId(principal)),
        key_hash: None,
        permissions: PermissionBits::ALL,
        key_status: KeyStatus::Active,
        account_status: AccountStatus::Active,
        mode: EnforcementMode::Strict,
        policy_revision: PolicyRevision(1),
        fetched_at: now(),
    }));
    registry
        .get(AccountId(1))
        .expect("published")
        .replace(lease(sharding));
    let capacity = usize::try_from(queue_capacity).expect("fits");
    AdmissionEngine::new(
        map,
        UsageRecorder::with_capacity(capacity, capacity),
        RequestIds::with_prefix(1),
    )
}

/// One unit for `principal` on the warm account.
fn begin(engine: &AdmissionEngine, principal: Principal) -> RequestContext {
    engine
        .begin(
            principal,
            PermissionBits::bit(0),
            black_box(CostUnits(1)),
            black_box(now()),
        )
        .expect("a warm account admits")
}

fn admit(engine: &AdmissionEngine, principal: Principal) {
    let mut context = begin(engine, principal);
    black_box(context.commit(black_box(now()))).expect("inside the window");
}

/// Times `iters` admissions on one thread, draining the usage queue
/// (untimed) whenever it fills.
fn timed_admissions(engine: &AdmissionEngine, iters: u64, principal: Principal) -> Duration {
    let mut drained = Vec::with_capacity(usize::try_from(CHUNK).expect("fits"));
    let mut elapsed = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let chunk = left.min(CHUNK);
        let start = Instant::now();
        for _ in 0..chunk {
            admit(engine, principal);
        }
        elapsed += start.elapsed();
        drained.clear();
        engine.recorder().take_recorded(&mut drained, usize::MAX);
        left -= chunk;
    }
    elapsed
}

/// A request that ends before its handler starts: admitted, then dropped,
/// which releases the charge for zero and gives the usage place back.
fn admit_and_release(engine: &AdmissionEngine, principal: Principal) {
    drop(black_box(begin(engine, principal)));
}

fn bare_reserve_commit(lease: &LocalLease, counter: u64) {
    let mut reservation = Reservation::reserve_at_locality(
        black_box(lease),
        black_box(CostUnits(1)),
        black_box(now()),
        Locality::new(0),
    )
    .expect("a huge lease");
    black_box(reservation.commit_owned(now(), CommitFunding::LeaseOnly)).expect("inside");
    black_box(reservation.usage_event(
        RequestId::from_parts(1, counter),
        now(),
        PolicyRevision::UNSTATED,
        None,
    ));
}

fn single(c: &mut Criterion) {
    let mut group = c.benchmark_group("single");
    let warm = engine(LocalSharding::Single, CHUNK);
    group.bench_function("begin_commit_handoff", |b| {
        b.iter_custom(|iters| timed_admissions(&warm, iters, Principal(0)));
    });
    // Nothing is queued, so nothing needs draining.
    group.bench_function("begin_release", |b| {
        b.iter(|| admit_and_release(&warm, Principal(0)));
    });
    let bare = lease(LocalSharding::Single);
    let mut counter = 0;
    group.bench_function("model_reserve_commit", |b| {
        b.iter(|| {
            counter += 1;
            bare_reserve_commit(&bare, counter);
        });
    });
    // The unit of the design's budget: one read-modify-write on a line no
    // other thread touches, as every lease debit and queue place costs.
    let word = AtomicU64::new(0);
    group.bench_function("uncontended_rmw", |b| {
        b.iter(|| black_box(&word).fetch_add(1, Ordering::AcqRel));
    });
    let limiter = RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX));
    group.bench_function("governor_check_key", |b| {
        b.iter(|| black_box(limiter.check_key(black_box(&1_u64))));
    });
    group.finish();
}

/// Runs `op` `iters` times on each of two threads started together; returns
/// the slower thread's time, so the figure is per operation per thread.
fn on_two_threads(iters: u64, op: impl Fn(usize, u64) -> Duration + Sync) -> Duration {
    let start = Barrier::new(2);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..2)
            .map(|thread| {
                let (op, start) = (&op, &start);
                scope.spawn(move || {
                    start.wait();
                    op(thread, iters)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().expect("bench thread"))
            .max()
            .unwrap_or_default()
    })
}

fn two_threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("two_threads");
    for (name, sharding) in [
        ("begin_commit_handoff_unsharded", LocalSharding::Single),
        (
            "begin_commit_handoff_sharded",
            LocalSharding::shards(2).expect("two"),
        ),
    ] {
        // One engine shared by both threads, as a server shares one; the
        // queue holds both threads' chunks between drains.
        let shared = engine(sharding, 2 * PAIR_CHUNK);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut drained = Vec::new();
                let mut elapsed = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let chunk = left.min(PAIR_CHUNK);
                    elapsed += on_two_threads(chunk, |thread, n| {
                        let principal = Principal(thread as u64);
                        let start = Instant::now();
                        for _ in 0..n {
                            admit(&shared, principal);
                        }
                        start.elapsed()
                    });
                    drained.clear();
                    shared.recorder().take_recorded(&mut drained, usize::MAX);
                    left -= chunk;
                }
                elapsed
            });
        });
    }
    let limiter = RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX));
    group.bench_function("governor_check_key_one_hot_key", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, |_, n| {
                let start = Instant::now();
                for _ in 0..n {
                    black_box(limiter.check_key(black_box(&1_u64))).ok();
                }
                start.elapsed()
            })
        });
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = single, two_threads
}
criterion_main!(benches);
