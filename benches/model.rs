//! The request path's cost against reference points, measured in one run so
//! the ratios between them mean something.
//!
//! - `single/*`: one thread on a warm lease (or counter, or limiter).
//!   - `atomic_fetch_sub`: one bare `fetch_sub` on an uncontended word, the
//!     floor for anything that debits a counter.
//!   - `governor_check`: `governor`'s `check()` on a direct limiter that always
//!     admits, an external reference point.
//!   - `reserve_commit`: reserve, commit at execution start, build the usage
//!     event, drop.
//!   - `reserve_drop`: reserve and drop, which releases for zero.
//! - `two_threads/*`: two threads, each running the operation in a loop; the
//!   reported time is the slower thread's wall time per operation, so it reads
//!   as "per operation per thread" and compares directly with `single/*`.
//!   - `atomic_fetch_sub_private`: each thread on its own word, on its own
//!     cache lines. The control: it should match `single/atomic_fetch_sub`;
//!     when it does not, something else on the machine (another process, SMT
//!     siblings on the host) is inflating every `two_threads` number.
//!   - `atomic_fetch_sub_shared`: both threads on one word, the cost of a
//!     single contended cache line.
//!   - `reserve_commit_unsharded`: both threads on a single-counter lease.
//!   - `reserve_commit_sharded`: both threads on a two-shard lease, each pinned
//!     to its own shard with `Locality::new`.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use governor::{Quota, RateLimiter};
use jiff::{SignedDuration, Timestamp};
use tollgate::{
    AccountId, CommitFunding, CostUnits, FencingToken, LeaseGrant, LeaseId, LocalLease,
    LocalSharding, Locality, PolicyRevision, RequestId, Reservation,
};

/// A counter alone on its cache-line pair, so two of them never share a line.
#[repr(align(128))]
struct Padded(AtomicU64);

/// The fixed instant every operation runs at: well inside the lease window.
fn now() -> Timestamp {
    Timestamp::from_second(1_700_000_000).expect("a valid timestamp")
}

/// A lease that never runs out, never expires during the run and never rings
/// its low-water doorbell.
fn huge_lease(sharding: LocalSharding) -> LocalLease {
    let grant = LeaseGrant {
        lease_id: LeaseId(7),
        account_id: AccountId(42),
        fencing_token: FencingToken(3),
        units: CostUnits(u64::MAX / 2),
        expires_at: Timestamp::from_second(4_000_000_000).expect("a valid timestamp"),
    };
    LocalLease::with_sharding(grant, CostUnits::ZERO, SignedDuration::ZERO, sharding)
}

/// Reserve one unit, commit it, build its usage event, drop the reservation.
#[inline]
fn reserve_commit(lease: &LocalLease, now: Timestamp, locality: Locality, counter: u64) {
    let mut reservation =
        Reservation::reserve_at_locality(black_box(lease), black_box(CostUnits(1)), now, locality)
            .expect("the lease never runs out");
    // The request path owns its reservation, so it commits without a CAS.
    let committed = reservation.commit_owned(now, CommitFunding::LeaseOnly);
    black_box(committed).expect("the lease is inside its window");
    let event = reservation.usage_event(
        RequestId::from_parts(1, counter),
        now,
        PolicyRevision::UNSTATED,
        None,
    );
    black_box(event);
}

/// The same, committed through a shared reference: the compare-exchange a
/// split charge's worker pays to race its waiter.
fn reserve_commit_shared(lease: &LocalLease, now: Timestamp, counter: u64) {
    let reservation = Reservation::reserve_at_locality(
        black_box(lease),
        black_box(CostUnits(1)),
        now,
        Locality::new(0),
    )
    .expect("the lease never runs out");
    let committed = reservation.commit_at_execution_start(now, CommitFunding::LeaseOnly);
    black_box(committed).expect("the lease is inside its window");
    let event = reservation.usage_event(
        RequestId::from_parts(1, counter),
        now,
        PolicyRevision::UNSTATED,
        None,
    );
    black_box(event);
}

/// Runs `op(thread, iteration)` `iters` times on each of two threads started
/// together, and returns the slower thread's elapsed wall time.
fn on_two_threads<F>(iters: u64, op: F) -> Duration
where
    F: Fn(usize, u64) + Sync,
{
    let barrier = Barrier::new(2);
    thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|thread| {
                let barrier = &barrier;
                let op = &op;
                scope.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    for iteration in 0..iters {
                        op(thread, iteration);
                    }
                    start.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("a bench thread panicked"))
            .max()
            .unwrap_or_default()
    })
}

fn single(c: &mut Criterion) {
    let mut group = c.benchmark_group("single");
    let now = now();

    let counter = AtomicU64::new(u64::MAX);
    group.bench_function("atomic_fetch_sub", |b| {
        b.iter(|| black_box(black_box(&counter).fetch_sub(1, Ordering::AcqRel)));
    });

    let limiter = RateLimiter::direct(Quota::per_second(NonZeroU32::MAX));
    group.bench_function("governor_check", |b| {
        b.iter(|| black_box(black_box(&limiter).check()));
    });

    let lease = huge_lease(LocalSharding::Single);
    let mut request = 0_u64;
    group.bench_function("reserve_commit", |b| {
        b.iter(|| {
            request = request.wrapping_add(1);
            reserve_commit(&lease, black_box(now), Locality::new(0), request);
        });
    });

    group.bench_function("reserve_commit_shared", |b| {
        b.iter(|| {
            request = request.wrapping_add(1);
            reserve_commit_shared(&lease, black_box(now), request);
        });
    });

    group.bench_function("reserve_drop", |b| {
        b.iter(|| {
            let reservation = Reservation::reserve_at_locality(
                black_box(&lease),
                black_box(CostUnits(1)),
                black_box(now),
                Locality::new(0),
            )
            .expect("the lease never runs out");
            drop(reservation);
        });
    });
    group.finish();
}

fn two_threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("two_threads");
    let now = now();

    let private = [
        Padded(AtomicU64::new(u64::MAX)),
        Padded(AtomicU64::new(u64::MAX)),
    ];
    group.bench_function("atomic_fetch_sub_private", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, |thread, _| {
                black_box(black_box(&private[thread].0).fetch_sub(1, Ordering::AcqRel));
            })
        });
    });

    let counter = AtomicU64::new(u64::MAX);
    group.bench_function("atomic_fetch_sub_shared", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, |_, _| {
                black_box(black_box(&counter).fetch_sub(1, Ordering::AcqRel));
            })
        });
    });

    let unsharded = huge_lease(LocalSharding::Single);
    group.bench_function("reserve_commit_unsharded", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, |thread, iteration| {
                reserve_commit(&unsharded, black_box(now), Locality::new(thread), iteration);
            })
        });
    });

    let sharded = huge_lease(LocalSharding::shards(2).expect("two shards are allowed"));
    group.bench_function("reserve_commit_sharded", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, |thread, iteration| {
                reserve_commit(&sharded, black_box(now), Locality::new(thread), iteration);
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
