//! The request path end to end: `begin` + `commit` + usage hand-off on a warm
//! account, against the model's bare reserve+commit and, as a peer anchor,
//! `governor`'s keyed `check_key` on one hot key (with its default clock,
//! which reads the CPU's counter per check, and with a coarse clock kept
//! current by a background thread, like the one tollgate's layer reads:
//! tollgate itself is handed `now`). Single-threaded and with
//! two threads, all in one run so the ratios mean something. `begin` + drop
//! (a request that ends before its handler) splits the end-to-end figure
//! into admission and commit + hand-off, and one uncontended atomic
//! read-modify-write is the unit the design states the hot path's budget in.
//!
//! The `many_accounts` group spreads the same requests over 32 and 256
//! accounts, against governor over as many keys.
//!
//! The `anatomy` group takes the end-to-end figure apart. It writes the
//! request path's essential work out by hand, with none of tollgate's engine
//! types in the way, in five steps: all in one call; split at the handler's
//! start into an admission that returns a context and a commit that hands
//! the event off; with the shared, replaceable state a running server needs
//! (a policy map and a lease behind arc-swap, the context owning reference
//! counts on what it must give back); with that state read the cheapest
//! safe way known, through per-thread caches, so that a request takes one
//! reference count, its lease's, on a queue that is never freed; and the
//! same with the reference count on the queue that a library, which cannot
//! know its queue outlives every request, must take. The steps show how
//! much of the figure the contract itself costs, how much its safe
//! ownership does, and how low a safe library can go.
//!
//! ```sh
//! cargo bench --bench admission
//! ```

use std::collections::HashMap;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, criterion_group, criterion_main};
use crossbeam_queue::ArrayQueue;
use governor::clock::QuantaUpkeepClock;
use governor::{Quota, RateLimiter};
use jiff::{SignedDuration, Timestamp};
use rustc_hash::FxBuildHasher;
use tollgate::admission::{
    AdmissionEngine, ArcSwapSnapshotMap, RequestContext, RequestIds, SlotRegistry,
    SnapshotMapConfig, UsageRecorder,
};
use tollgate::{
    AccountId, AccountStatus, CommitError, CommitFunding, CostUnits, DenyReason, EnforcementMode,
    FencingToken, KeyId, KeyStatus, LeaseGrant, LeaseId, LocalLease, LocalSharding, Locality,
    PermissionBits, PolicyRevision, Principal, PrincipalSnapshot, RequestId, Reservation,
    UsageEvent, UsageSource,
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
    lease_of(AccountId(1), sharding)
}

fn lease_of(account_id: AccountId, sharding: LocalSharding) -> Arc<LocalLease> {
    Arc::new(LocalLease::with_sharding(
        LeaseGrant {
            lease_id: LeaseId(account_id.0),
            account_id,
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
/// installed, and a usage queue with room for `queue_capacity` events in
/// every stripe.
fn engine(sharding: LocalSharding, queue_capacity: u64) -> AdmissionEngine {
    engine_for(sharding, queue_capacity, &[(0, 1), (1, 1)])
}

/// An engine for `principals`, each `(principal, account)`, every account
/// with a warm lease.
fn engine_for(
    sharding: LocalSharding,
    queue_capacity: u64,
    principals: &[(u64, u64)],
) -> AdmissionEngine {
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
    map.publish(
        principals
            .iter()
            .map(|&(principal, account)| PrincipalSnapshot {
                principal: Principal(principal),
                account_id: AccountId(account),
                key_id: Some(KeyId(principal)),
                key_hash: None,
                permissions: PermissionBits::ALL,
                key_status: KeyStatus::Active,
                account_status: AccountStatus::Active,
                mode: EnforcementMode::Strict,
                policy_revision: PolicyRevision(1),
                fetched_at: now(),
            }),
    );
    for &(_, account) in principals {
        let slot = registry.get(AccountId(account)).expect("published");
        if slot.load_observed().is_none() {
            slot.replace(lease_of(AccountId(account), sharding));
        }
    }
    // The queue is striped per core and each thread records into its own
    // stripe: every stripe gets the room asked for, so no admission probes
    // a full stripe before the drain, whatever the core count.
    let stripes = LocalSharding::per_core();
    let capacity = usize::try_from(queue_capacity).expect("fits") * stripes.count();
    AdmissionEngine::new(
        map,
        UsageRecorder::striped(capacity, capacity, stripes),
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
    black_box(context.commit(black_box(now())).expect("inside the window"));
}

/// Times `iters` runs of `op`, calling `drain` (untimed) after every chunk.
fn timed_in_chunks(iters: u64, mut op: impl FnMut(), mut drain: impl FnMut()) -> Duration {
    let mut elapsed = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let chunk = left.min(CHUNK);
        let start = Instant::now();
        for _ in 0..chunk {
            op();
        }
        elapsed += start.elapsed();
        drain();
        left -= chunk;
    }
    elapsed
}

/// Times `iters` admissions on one thread, draining the usage queue
/// (untimed) whenever it fills.
fn timed_admissions(engine: &AdmissionEngine, iters: u64, principal: Principal) -> Duration {
    let mut drained = Vec::with_capacity(usize::try_from(CHUNK).expect("fits"));
    timed_in_chunks(
        iters,
        || admit(engine, principal),
        || {
            drained.clear();
            engine.recorder().take_recorded(&mut drained, usize::MAX);
        },
    )
}

/// A request that ends before its handler starts: admitted, then dropped,
/// which releases the charge for zero and gives the usage place back.
fn admit_and_release(engine: &AdmissionEngine, principal: Principal) {
    drop(black_box(begin(engine, principal)));
}

fn bare_reserve_commit(lease: &LocalLease, counter: u64, locality: Locality) {
    let mut reservation = Reservation::reserve_at_locality(
        black_box(lease),
        black_box(CostUnits(1)),
        black_box(now()),
        locality,
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
            bare_reserve_commit(&bare, counter, Locality::new(0));
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
    // governor's default clock reads the CPU's counter on every check, while
    // tollgate is handed `now`: with a clock a background thread keeps
    // current, as tollgate's layer uses, the peer does the same work.
    let upkeep = QuantaUpkeepClock::from_interval(Duration::from_millis(1))
        .expect("the clock's upkeep thread starts");
    let coarse = RateLimiter::dashmap_with_clock(Quota::per_second(NonZeroU32::MAX), upkeep);
    group.bench_function("governor_check_key_coarse_clock", |b| {
        b.iter(|| black_box(coarse.check_key(black_box(&1_u64))));
    });
    group.finish();
}

/// Requests spread round-robin over many accounts, one principal each, on
/// one thread, against governor's keyed check over as many keys: what the
/// single-account figure leaves out is that each request reads another
/// account's entry, slot and lease, which fall out of the CPU's caches as
/// their number grows.
fn many_accounts(c: &mut Criterion) {
    let mut group = c.benchmark_group("many_accounts");
    for accounts in [32_u64, 256] {
        let principals: Vec<_> = (0..accounts).map(|p| (p, p + 1)).collect();
        let warm = engine_for(LocalSharding::Single, CHUNK, &principals);
        let mut next = 0;
        let mut drained = Vec::with_capacity(usize::try_from(CHUNK).expect("fits"));
        group.bench_function(format!("begin_commit_handoff_{accounts}"), |b| {
            b.iter_custom(|iters| {
                timed_in_chunks(
                    iters,
                    || {
                        next = (next + 1) % accounts;
                        admit(&warm, Principal(next));
                    },
                    || {
                        drained.clear();
                        warm.recorder().take_recorded(&mut drained, usize::MAX);
                    },
                )
            });
        });
        let limiter = RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX));
        let mut key = 0;
        group.bench_function(format!("governor_check_key_{accounts}"), |b| {
            b.iter(|| {
                key = (key + 1) % accounts;
                black_box(limiter.check_key(black_box(&key)))
            });
        });
    }
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
    for (name, sharding) in [
        ("model_reserve_commit_unsharded", LocalSharding::Single),
        (
            "model_reserve_commit_sharded",
            LocalSharding::shards(2).expect("two"),
        ),
    ] {
        let bare = lease(sharding);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                on_two_threads(iters, |thread, n| {
                    let locality = Locality::new(thread);
                    let start = Instant::now();
                    for counter in 0..n {
                        bare_reserve_commit(&bare, counter, locality);
                    }
                    start.elapsed()
                })
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

/// The request path's essential work, written out by hand for the `anatomy`
/// group: what any implementation of the contract must do, without the
/// mechanisms that make tollgate's version safe to share and replace.
mod anatomy {
    use super::{
        AccountId, Arc, ArcSwap, ArrayQueue, AtomicU64, AtomicUsize, CHUNK, CommitError, CostUnits,
        DenyReason, FencingToken, FxBuildHasher, HashMap, KeyId, LeaseId, Ordering, PermissionBits,
        PolicyRevision, Principal, RequestId, RequestIds, SignedDuration, Timestamp, UsageEvent,
        UsageSource, black_box, now,
    };
    use std::cell::Cell;
    use std::ops::Deref;
    use std::sync::Weak;

    /// One principal's policy, as admission reads it.
    pub(super) struct Policy {
        stamp: Stamp,
        permissions: PermissionBits,
        fresh_until: Timestamp,
    }

    /// What a usage event takes from the policy.
    #[derive(Clone, Copy)]
    struct Stamp {
        account_id: AccountId,
        key_id: KeyId,
        revision: PolicyRevision,
    }

    pub(super) type Policies = HashMap<Principal, Policy, FxBuildHasher>;

    /// A lease: one counter and its window.
    pub(super) struct Lease {
        remaining: AtomicU64,
        usable_until: Timestamp,
        id: LeaseId,
        token: FencingToken,
    }

    /// The usage queue: places reserved at admission, events handed off at
    /// commit, each event with whatever it must keep alive until written.
    pub(super) struct Usage<H> {
        free: AtomicUsize,
        events: ArrayQueue<(UsageEvent, H)>,
    }

    pub(super) fn policies() -> Policies {
        let mut policies = Policies::default();
        policies.insert(
            Principal(0),
            Policy {
                stamp: Stamp {
                    account_id: AccountId(1),
                    key_id: KeyId(0),
                    revision: PolicyRevision(1),
                },
                permissions: PermissionBits::ALL,
                fresh_until: now() + SignedDuration::from_hours(24),
            },
        );
        policies
    }

    pub(super) fn lease() -> Lease {
        Lease {
            remaining: AtomicU64::new(u64::MAX / 4),
            usable_until: now() + SignedDuration::from_hours(24),
            id: LeaseId(1),
            token: FencingToken(1),
        }
    }

    pub(super) fn usage<H>() -> Usage<H> {
        let capacity = usize::try_from(CHUNK).expect("fits");
        Usage {
            free: AtomicUsize::new(capacity),
            events: ArrayQueue::new(capacity),
        }
    }

    impl<H> Usage<H> {
        /// The writer's part, off the timed path: empty the queue and free
        /// the places.
        pub(super) fn drain(&self) {
            let mut freed = 0;
            while self.events.pop().is_some() {
                freed += 1;
            }
            self.free.fetch_add(freed, Ordering::AcqRel);
        }

        fn take_place(&self) -> bool {
            self.free
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |free| {
                    free.checked_sub(1)
                })
                .is_ok()
        }
    }

    impl Lease {
        fn debit(&self, units: CostUnits) -> bool {
            self.remaining
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                    left.checked_sub(units.get())
                })
                .is_ok()
        }
    }

    /// The policy checks: known, fresh, permitted.
    #[inline]
    fn check(
        policies: &Policies,
        principal: Principal,
        required: PermissionBits,
        now: Timestamp,
    ) -> Result<&Policy, DenyReason> {
        let policy = policies
            .get(&principal)
            .ok_or(DenyReason::UnknownPrincipal)?;
        if now > policy.fresh_until {
            return Err(DenyReason::SnapshotStale);
        }
        if !policy.permissions.contains(required) {
            return Err(DenyReason::PermissionDenied {
                missing: policy.permissions.missing(required),
            });
        }
        Ok(policy)
    }

    /// The lease's window, the debit and the usage place; the debit is
    /// returned if no place is free.
    #[inline]
    fn reserve<H>(
        lease: &Lease,
        usage: &Usage<H>,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<(), DenyReason> {
        if now >= lease.usable_until {
            return Err(DenyReason::LeaseExpired);
        }
        if !lease.debit(quote) {
            return Err(DenyReason::LeaseExhausted);
        }
        if !usage.take_place() {
            lease.remaining.fetch_add(quote.get(), Ordering::AcqRel);
            return Err(DenyReason::AccountingBackpressure);
        }
        Ok(())
    }

    fn event(
        stamp: Stamp,
        lease: &Lease,
        request_id: RequestId,
        units: CostUnits,
        at: Timestamp,
    ) -> UsageEvent {
        UsageEvent {
            request_id,
            account_id: stamp.account_id,
            source: UsageSource::Leased {
                lease_id: lease.id,
                fencing_token: lease.token,
            },
            units,
            at,
            policy_revision: stamp.revision,
            key_id: Some(stamp.key_id),
        }
    }

    /// Everything in one call: the least any implementation does.
    #[inline(never)]
    pub(super) fn in_one_call(
        policies: &Policies,
        lease: &Lease,
        usage: &Usage<()>,
        ids: RequestIds,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<CostUnits, DenyReason> {
        let policy = check(policies, Principal(0), PermissionBits::bit(0), now)?;
        reserve(lease, usage, quote, now)?;
        let request_id = ids.next();
        let committed_at = black_box(now);
        let _ = usage.events.push((
            event(policy.stamp, lease, request_id, quote, committed_at),
            (),
        ));
        Ok(quote)
    }

    /// An admitted request between admission and its handler's start, on
    /// borrowed state.
    pub(super) struct Borrowed<'a> {
        policy: &'a Policy,
        lease: &'a Lease,
        usage: &'a Usage<()>,
        request_id: RequestId,
        units: CostUnits,
        committed: bool,
    }

    /// Admission as its own call, returning the context.
    #[inline(never)]
    pub(super) fn begin_borrowed<'a>(
        policies: &'a Policies,
        lease: &'a Lease,
        usage: &'a Usage<()>,
        ids: RequestIds,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<Borrowed<'a>, DenyReason> {
        let policy = check(policies, Principal(0), PermissionBits::bit(0), now)?;
        reserve(lease, usage, quote, now)?;
        Ok(Borrowed {
            policy,
            lease,
            usage,
            request_id: ids.next(),
            units: quote,
            committed: false,
        })
    }

    impl Borrowed<'_> {
        #[inline]
        pub(super) fn commit(&mut self, now: Timestamp) -> Result<CostUnits, CommitError> {
            if self.committed {
                return Err(CommitError::AlreadyCommitted);
            }
            if now >= self.lease.usable_until {
                return Err(CommitError::Denied(DenyReason::FundingExpiredAtStart));
            }
            self.committed = true;
            let event = event(
                self.policy.stamp,
                self.lease,
                self.request_id,
                self.units,
                now,
            );
            let _ = self.usage.events.push((event, ()));
            Ok(self.units)
        }
    }

    impl Drop for Borrowed<'_> {
        fn drop(&mut self) {
            if !self.committed {
                self.lease
                    .remaining
                    .fetch_add(self.units.get(), Ordering::AcqRel);
                self.usage.free.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    /// What a running server shares: a policy map and a lease that
    /// background tasks replace, read through arc-swap.
    pub(super) struct Shared {
        pub(super) policies: ArcSwap<Policies>,
        pub(super) lease: ArcSwap<Lease>,
        pub(super) usage: Arc<Queue>,
    }

    /// An admitted request that owns what it must give back, as a context
    /// stored in a request's future must: a reference count on its lease,
    /// which also keeps the lease from being released under it, and a way
    /// to the usage queue its place is in (`U`).
    pub(super) struct Owned<U: Deref<Target = Queue>> {
        /// Taken at commit, when the lease rides on with the event.
        lease: Option<Arc<Lease>>,
        usage: U,
        stamp: Stamp,
        request_id: RequestId,
        units: CostUnits,
    }

    /// The queue that holds an owned context's place.
    type Queue = Usage<Arc<Lease>>;

    #[inline(never)]
    pub(super) fn begin_owned(
        shared: &Shared,
        ids: RequestIds,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<Owned<Arc<Queue>>, DenyReason> {
        let policies = shared.policies.load();
        let policy = check(&policies, Principal(0), PermissionBits::bit(0), now)?;
        let lease = shared.lease.load();
        reserve(&lease, &shared.usage, quote, now)?;
        Ok(Owned {
            lease: Some(Arc::clone(&lease)),
            usage: Arc::clone(&shared.usage),
            stamp: policy.stamp,
            request_id: ids.next(),
            units: quote,
        })
    }

    impl<U: Deref<Target = Queue>> Owned<U> {
        #[inline]
        pub(super) fn commit(&mut self, now: Timestamp) -> Result<CostUnits, CommitError> {
            let Some(lease) = self.lease.take() else {
                return Err(CommitError::AlreadyCommitted);
            };
            if now >= lease.usable_until {
                // Dropping a pending context returns its charge and place.
                self.lease = Some(lease);
                return Err(CommitError::Denied(DenyReason::FundingExpiredAtStart));
            }
            let event = event(self.stamp, &lease, self.request_id, self.units, now);
            // The event keeps the lease alive until it is written.
            let _ = self.usage.events.push((event, lease));
            Ok(self.units)
        }
    }

    impl<U: Deref<Target = Queue>> Drop for Owned<U> {
        fn drop(&mut self) {
            if let Some(lease) = &self.lease {
                lease
                    .remaining
                    .fetch_add(self.units.get(), Ordering::AcqRel);
                self.usage.free.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    /// The same shared state read the cheapest safe way known: through
    /// per-thread caches checked against a generation the writer bumps, so
    /// a request touches one reference count, the lease's, which is also
    /// its hold (I26). The queue is reached without a count because it
    /// lives for the whole run; a library cannot assume that.
    pub(super) struct Cached {
        policies: ArcSwap<Policies>,
        policies_generation: AtomicU64,
        lease: ArcSwap<Lease>,
        lease_generation: AtomicU64,
        pub(super) usage: &'static Queue,
    }

    thread_local! {
        // One `Cached` per run, so the caches need not name it.
        static POLICIES: Cell<Option<(u64, Arc<Policies>)>> = const { Cell::new(None) };
        static LEASE: Cell<Option<(u64, Weak<Lease>)>> = const { Cell::new(None) };
    }

    pub(super) fn cached() -> Cached {
        Cached {
            policies: ArcSwap::from_pointee(policies()),
            policies_generation: AtomicU64::new(0),
            lease: ArcSwap::from_pointee(lease()),
            lease_generation: AtomicU64::new(0),
            usage: Box::leak(Box::new(usage())),
        }
    }

    impl Cached {
        /// The policy checks on this thread's copy of the map, taken out of
        /// its cell while in use.
        fn check(
            &self,
            principal: Principal,
            required: PermissionBits,
            now: Timestamp,
        ) -> Result<Stamp, DenyReason> {
            let generation = self.policies_generation.load(Ordering::Acquire);
            let policies = match POLICIES.take() {
                Some((seen, policies)) if seen == generation => policies,
                _ => self.policies.load_full(),
            };
            let checked = check(&policies, principal, required, now).map(|policy| policy.stamp);
            POLICIES.set(Some((generation, policies)));
            checked
        }

        /// The serving lease, upgraded from this thread's weak copy. The
        /// upgrade is the request's one reference count. A lease replaced
        /// after the generation was read may still be upgraded; whoever
        /// retires it would wait for `Arc::try_unwrap`, which fails while
        /// any request holds it and stops every later upgrade.
        fn lease(&self) -> Option<Arc<Lease>> {
            let generation = self.lease_generation.load(Ordering::Acquire);
            let cached = LEASE.take();
            if let Some((seen, weak)) = &cached
                && *seen == generation
            {
                let lease = weak.upgrade();
                LEASE.set(cached);
                return lease;
            }
            let lease = self.lease.load_full();
            LEASE.set(Some((generation, Arc::downgrade(&lease))));
            Some(lease)
        }
    }

    /// Admission on the cached state: the context's one reference count
    /// is its lease's.
    #[inline(never)]
    pub(super) fn begin_one_reference(
        shared: &Cached,
        ids: RequestIds,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<Owned<&'static Queue>, DenyReason> {
        let stamp = shared.check(Principal(0), PermissionBits::bit(0), now)?;
        let lease = shared.lease().ok_or(DenyReason::LeaseUnavailable)?;
        reserve(&lease, shared.usage, quote, now)?;
        Ok(Owned {
            lease: Some(lease),
            usage: shared.usage,
            stamp,
            request_id: ids.next(),
            units: quote,
        })
    }

    /// [`begin_one_reference`] as a library must write it: the queue is
    /// not known to outlive the context, so the context counts a reference
    /// on it too, taken here and given up when the context drops.
    #[inline(never)]
    pub(super) fn begin_counted_queue(
        shared: &Cached,
        usage: &Arc<Queue>,
        ids: RequestIds,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<Owned<Arc<Queue>>, DenyReason> {
        let stamp = shared.check(Principal(0), PermissionBits::bit(0), now)?;
        let lease = shared.lease().ok_or(DenyReason::LeaseUnavailable)?;
        reserve(&lease, usage, quote, now)?;
        Ok(Owned {
            lease: Some(lease),
            usage: Arc::clone(usage),
            stamp,
            request_id: ids.next(),
            units: quote,
        })
    }
}

/// Benchmarks `op` as `name`, calling `drain` (untimed) after every chunk.
fn bench_in_chunks(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    mut op: impl FnMut(),
    mut drain: impl FnMut(),
) {
    group.bench_function(name, |b| {
        b.iter_custom(|iters| timed_in_chunks(iters, &mut op, &mut drain));
    });
}

fn anatomy(c: &mut Criterion) {
    let mut group = c.benchmark_group("anatomy");
    let ids = RequestIds::with_prefix(1);
    let policies = anatomy::policies();
    let lease = anatomy::lease();
    let usage = anatomy::usage();
    let quote = || black_box(CostUnits(1));
    bench_in_chunks(
        &mut group,
        "in_one_call",
        || {
            let units =
                anatomy::in_one_call(&policies, &lease, &usage, ids, quote(), black_box(now()));
            black_box(units).expect("admitted");
        },
        || usage.drain(),
    );
    bench_in_chunks(
        &mut group,
        "split_at_handler_start",
        || {
            let mut context =
                anatomy::begin_borrowed(&policies, &lease, &usage, ids, quote(), black_box(now()))
                    .expect("admitted");
            black_box(context.commit(black_box(now()))).expect("committed");
        },
        || usage.drain(),
    );
    let shared = anatomy::Shared {
        policies: ArcSwap::from_pointee(anatomy::policies()),
        lease: ArcSwap::from_pointee(anatomy::lease()),
        usage: Arc::new(anatomy::usage()),
    };
    bench_in_chunks(
        &mut group,
        "split_with_owned_shared_state",
        || {
            let mut context =
                anatomy::begin_owned(&shared, ids, quote(), black_box(now())).expect("admitted");
            black_box(context.commit(black_box(now()))).expect("committed");
        },
        || shared.usage.drain(),
    );
    let cached = anatomy::cached();
    bench_in_chunks(
        &mut group,
        "split_with_one_reference",
        || {
            let mut context = anatomy::begin_one_reference(&cached, ids, quote(), black_box(now()))
                .expect("admitted");
            black_box(context.commit(black_box(now()))).expect("committed");
        },
        || cached.usage.drain(),
    );
    let counted = Arc::new(anatomy::usage());
    bench_in_chunks(
        &mut group,
        "split_with_one_reference_and_counted_queue",
        || {
            let mut context =
                anatomy::begin_counted_queue(&cached, &counted, ids, quote(), black_box(now()))
                    .expect("admitted");
            black_box(context.commit(black_box(now()))).expect("committed");
        },
        || counted.drain(),
    );
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = single, many_accounts, anatomy, two_threads
}
criterion_main!(benches);
