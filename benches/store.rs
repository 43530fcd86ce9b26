//! The memory store's cost per allocator round trip and per ingested batch.
//!
//! ```sh
//! cargo bench --bench store
//! ```

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use jiff::{SignedDuration, Timestamp};
use tollgate::store::{
    AccountSpec, GrantPolicy, LeaseAllocator, MemoryStore, TailSharing, UsageSink,
};
use tollgate::{
    AccountStatus, CostUnits, EnforcementMode, PolicyRevision, RequestId, UsageEvent, UsageSource,
};

const BATCH: usize = 1_000;

fn store() -> MemoryStore {
    MemoryStore::new(GrantPolicy {
        max_ttl: SignedDuration::from_secs(60),
        reclaim_grace: SignedDuration::from_secs(10),
        tail: TailSharing {
            instances: 1,
            min_grant: CostUnits(1),
        },
    })
    .expect("the bench policy is valid")
}

fn bench_store(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime builds");
    let now = Timestamp::from_second(1_700_000_000).expect("in range");
    let ttl = SignedDuration::from_secs(30);
    let store = store();
    let account = store
        .create_account(
            AccountSpec {
                balance: CostUnits(1 << 60),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            now,
        )
        .expect("account opens");

    let mut group = c.benchmark_group("memory_store");
    group.bench_function("acquire_release_round_trip", |b| {
        b.iter(|| {
            runtime.block_on(async {
                let grant = store
                    .acquire(account, CostUnits(1_000), ttl, now)
                    .await
                    .expect("funded")
                    .grant;
                let released = store
                    .release(grant.lease_id, grant.fencing_token, grant.units, now)
                    .await
                    .expect("active");
                black_box(released);
            });
        });
    });

    let lease = runtime
        .block_on(store.acquire(account, CostUnits(1 << 50), ttl, now))
        .expect("funded")
        .grant;
    let mut next_request = 0_u128;
    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function("ingest_1000_leased_events", |b| {
        b.iter_batched(
            || {
                (0..BATCH)
                    .map(|_| {
                        next_request += 1;
                        UsageEvent {
                            request_id: RequestId(next_request),
                            account_id: account,
                            source: UsageSource::Leased {
                                lease_id: lease.lease_id,
                                fencing_token: lease.fencing_token,
                            },
                            units: CostUnits(1),
                            at: now,
                            policy_revision: PolicyRevision(1),
                            key_id: None,
                        }
                    })
                    .collect::<Vec<_>>()
            },
            |batch| {
                let outcomes = runtime
                    .block_on(store.ingest(&batch))
                    .expect("the memory store answers");
                black_box(outcomes);
            },
            BatchSize::LargeInput,
        );
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench_store
}
criterion_main!(benches);
