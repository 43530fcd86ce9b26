//! The `PostgreSQL` store under load: acquire+release round trips from one
//! and from eight concurrent clients, usage ingest in batches of 1,000, and
//! how many store transactions a running `InstanceRuntime` spends per 1,000
//! admitted requests at grant 1,000 and price 1.
//!
//! Every store call is one transaction, so a round trip is two and an
//! ingested batch one. The last figure is counted, not timed: it is what
//! sizes a database for a fleet of gateways.
//!
//! It runs against `TOLLGATE_TEST_DATABASE_URL` when that is set, and
//! otherwise starts a throwaway cluster of its own with
//! `scripts/pg-cluster`, which needs the `PostgreSQL` server binaries.
//!
//! ```sh
//! cargo bench --features postgres --bench store_postgres
//! ```

#[allow(dead_code, reason = "the benchmark uses part of the test support")]
#[path = "../tests/support/postgres.rs"]
mod postgres;
#[allow(dead_code, reason = "the benchmark uses part of the test support")]
#[path = "../tests/support/runtime.rs"]
mod runtime_config;

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use criterion::{BatchSize, Criterion, Throughput};
use jiff::{SignedDuration, Timestamp};
use postgres::{Cluster, URL_VARIABLE, unique_schema};
use runtime_config::{Pace, config};
use tokio::runtime::Runtime;
use tollgate::runtime::InstanceRuntime;
use tollgate::store::{
    AccountSpec, AllocateError, Allocation, Clock, GrantPolicy, IngestOutcome, LeaseAllocator,
    PostgresConfig, PostgresStore, ReclaimBatch, Released, SnapshotCursor, SnapshotPage,
    SnapshotSource, StoreError, SystemClock, TailSharing, UsageSink,
};
use tollgate::{
    AccountId, AccountStatus, CostUnits, EnforcementMode, FencingToken, KeyHash, LeaseId,
    PermissionBits, PolicyRevision, Principal, PrincipalSnapshot, RequestId, UsageEvent,
    UsageSource,
};

const BATCH: usize = 1_000;
const GRANT: CostUnits = CostUnits(1_000);
const TTL: SignedDuration = SignedDuration::from_secs(30);

fn now() -> Timestamp {
    Timestamp::from_second(1_700_000_000).expect("in range")
}

async fn connect(url: &str) -> Arc<PostgresStore> {
    let store = PostgresStore::connect(
        url,
        PostgresConfig {
            schema: unique_schema("bench"),
            policy: GrantPolicy {
                max_ttl: SignedDuration::from_secs(60),
                reclaim_grace: SignedDuration::from_secs(10),
                tail: TailSharing {
                    instances: 1,
                    min_grant: CostUnits(1),
                },
            },
            lock_timeout: std::time::Duration::from_secs(5),
            queue_timeout: std::time::Duration::from_secs(5),
        },
    )
    .await
    .expect("the server accepts connections");
    store.migrate().await.expect("the schema migrates");
    Arc::new(store)
}

async fn open_account(store: &PostgresStore, balance: u64) -> AccountId {
    store
        .create_account(
            AccountSpec {
                balance: CostUnits(balance),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            now(),
        )
        .await
        .expect("the account opens")
}

/// Runs `iters` acquire+release round trips spread over one client per
/// entry of `accounts`, each on its entry's account; returns the wall time.
async fn round_trips(store: &Arc<PostgresStore>, accounts: &[AccountId], iters: u64) -> Duration {
    let clients = accounts.len() as u64;
    let started = Instant::now();
    let tasks: Vec<_> = accounts
        .iter()
        .enumerate()
        .map(|(index, &account)| {
            let store = Arc::clone(store);
            let share = iters / clients + u64::from((index as u64) < iters % clients);
            tokio::spawn(async move {
                for _ in 0..share {
                    let grant = store
                        .acquire(account, GRANT, TTL, now())
                        .await
                        .expect("the account is funded")
                        .grant;
                    let released = store
                        .release(grant.lease_id, grant.fencing_token, grant.units, now())
                        .await
                        .expect("the lease is active");
                    black_box(released);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a client ran to the end");
    }
    started.elapsed()
}

fn throughput(criterion: &mut Criterion, runtime: &Runtime, url: &str) {
    let store = runtime.block_on(connect(url));
    let mut group = criterion.benchmark_group("postgres");
    // One round trip per iteration: criterion's elements per second are
    // round trips per second, each two transactions.
    group.throughput(Throughput::Elements(1));
    let own: Vec<AccountId> = runtime.block_on(async { open_accounts(&store, 8, 1 << 50).await });
    for (name, accounts) in [
        ("acquire_release/1_client", vec![own[0]]),
        ("acquire_release/8_clients_8_accounts", own.clone()),
        ("acquire_release/8_clients_1_account", vec![own[0]; 8]),
    ] {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| runtime.block_on(round_trips(&store, &accounts, iters)));
        });
    }

    let lease = runtime
        .block_on(store.acquire(own[0], CostUnits(1 << 40), TTL, now()))
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
                            account_id: own[0],
                            source: UsageSource::Leased {
                                lease_id: lease.lease_id,
                                fencing_token: lease.fencing_token,
                            },
                            units: CostUnits(1),
                            at: now(),
                            policy_revision: PolicyRevision(1),
                            key_id: None,
                        }
                    })
                    .collect::<Vec<_>>()
            },
            |batch| {
                let outcomes = runtime
                    .block_on(store.ingest(&batch))
                    .expect("the server answers");
                assert!(outcomes.iter().all(|o| *o == IngestOutcome::Accepted));
            },
            BatchSize::LargeInput,
        );
    });
    group.finish();
}

/// Opens `count` accounts of `balance` each.
async fn open_accounts(store: &PostgresStore, count: usize, balance: u64) -> Vec<AccountId> {
    let mut accounts = Vec::with_capacity(count);
    for _ in 0..count {
        accounts.push(open_account(store, balance).await);
    }
    accounts
}

/// The store with a tally of calls, each one transaction.
struct Counted {
    inner: Arc<PostgresStore>,
    calls: [AtomicU64; CALLS.len()],
}

/// The calls tallied, in the order reported.
const CALLS: [&str; 8] = [
    "acquire",
    "release",
    "consolidate",
    "reclaim",
    "ingest",
    "fetch",
    "changed_since",
    "lookup_key",
];

impl Counted {
    fn count(&self, call: &str) {
        let index = CALLS
            .iter()
            .position(|name| *name == call)
            .expect("every counted call is listed");
        self.calls[index].fetch_add(1, Ordering::Relaxed);
    }

    fn tally(&self) -> Vec<(&'static str, u64)> {
        CALLS
            .iter()
            .zip(&self.calls)
            .map(|(name, calls)| (*name, calls.load(Ordering::Relaxed)))
            .collect()
    }
}

#[async_trait]
impl LeaseAllocator for Counted {
    async fn acquire_at_least(
        &self,
        account: AccountId,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        self.count("acquire");
        self.inner
            .acquire_at_least(account, requested, needed, ttl, now)
            .await
    }

    async fn release(
        &self,
        lease: LeaseId,
        token: FencingToken,
        unspent: CostUnits,
        now: Timestamp,
    ) -> Result<Released, AllocateError> {
        self.count("release");
        self.inner.release(lease, token, unspent, now).await
    }

    #[allow(clippy::too_many_arguments, reason = "the trait's signature")]
    async fn consolidate(
        &self,
        lease: LeaseId,
        token: FencingToken,
        unspent: CostUnits,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        self.count("consolidate");
        self.inner
            .consolidate(lease, token, unspent, requested, needed, ttl, now)
            .await
    }

    async fn reclaim_expired_batch(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> Result<ReclaimBatch, StoreError> {
        self.count("reclaim");
        self.inner.reclaim_expired_batch(now, limit).await
    }
}

#[async_trait]
impl UsageSink for Counted {
    async fn ingest(&self, batch: &[UsageEvent]) -> Result<Vec<IngestOutcome>, StoreError> {
        self.count("ingest");
        self.inner.ingest(batch).await
    }
}

#[async_trait]
impl SnapshotSource for Counted {
    async fn fetch(
        &self,
        principals: &[Principal],
        now: Timestamp,
    ) -> Result<Vec<PrincipalSnapshot>, StoreError> {
        self.count("fetch");
        self.inner.fetch(principals, now).await
    }

    async fn changed_since(
        &self,
        since: SnapshotCursor,
        limit: usize,
        now: Timestamp,
    ) -> Result<SnapshotPage, StoreError> {
        self.count("changed_since");
        self.inner.changed_since(since, limit, now).await
    }

    async fn lookup_key(
        &self,
        hash: &KeyHash,
        now: Timestamp,
    ) -> Result<Option<PrincipalSnapshot>, StoreError> {
        self.count("lookup_key");
        self.inner.lookup_key(hash, now).await
    }
}

/// Admits and commits `requests` one-unit requests through a runtime on
/// `url`, `per_millisecond` at a time (as fast as it can when `None`), then
/// shuts the runtime down and prints the store transactions per 1,000
/// admitted requests, the shutdown's release and final ingest included.
async fn transactions_per_thousand(url: &str, requests: u64, per_millisecond: Option<u64>) {
    let store = connect(url).await;
    let account = open_account(&store, 1 << 40).await;
    let principal = store
        .issue_key(account, PermissionBits::ALL, now())
        .await
        .expect("a key is issued")
        .principal;
    let counted = Arc::new(Counted {
        inner: store,
        calls: Default::default(),
    });
    let mut config = config(Pace::RealTime);
    config.leases.target_grant = GRANT;
    config.leases.low_water = CostUnits(GRANT.get() / 4);
    config.usage.flush_interval = Duration::from_millis(50);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let (runtime, handle) = InstanceRuntime::spawn(
        Arc::clone(&counted) as _,
        Arc::clone(&counted) as _,
        Arc::clone(&counted) as _,
        Arc::clone(&clock),
        config,
    )
    .expect("the configuration is valid");
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let started = Instant::now();
    let mut admitted = 0;
    while admitted < requests {
        if let Some(n) = per_millisecond
            && admitted % n == 0
        {
            tick.tick().await;
        }
        match handle.begin(principal, PermissionBits::NONE, CostUnits(1), clock.now()) {
            Ok(mut context) => {
                context
                    .commit(clock.now())
                    .expect("inside the lease window");
                admitted += 1;
            }
            // Not ready yet, or the lease is being restocked.
            Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
    let elapsed = started.elapsed();
    let report = runtime.shutdown().await;
    assert_eq!(report.lost_events(), 0, "a graceful shutdown loses nothing");
    let tally = counted.tally();
    let total: u64 = tally.iter().map(|(_, calls)| calls).sum();
    let pace = per_millisecond.map_or_else(
        || "as fast as one task admits".to_owned(),
        |n| format!("{} requests/s", n * 1_000),
    );
    let hundredths = total * 100_000 / admitted;
    println!(
        "postgres/transactions_per_1000_requests ({pace}): {admitted} admitted in {:.2} s; \
         {}.{:02} store transactions per 1,000 requests",
        elapsed.as_secs_f64(),
        hundredths / 100,
        hundredths % 100
    );
    let calls: Vec<String> = tally
        .iter()
        .filter(|(_, calls)| *calls > 0)
        .map(|(name, calls)| format!("{name} {calls}"))
        .collect();
    println!("    calls: {}", calls.join(", "));
}

fn main() {
    let cluster;
    let url = match std::env::var(URL_VARIABLE) {
        Ok(url) if !url.is_empty() => url,
        _ => {
            cluster = Cluster::start("store_postgres_bench");
            cluster.url.clone()
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime builds");
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5))
        .configure_from_args();
    throughput(&mut criterion, &runtime, &url);
    runtime.block_on(transactions_per_thousand(&url, 20_000, None));
    runtime.block_on(transactions_per_thousand(&url, 10_000, Some(5)));
    criterion.final_summary();
}
