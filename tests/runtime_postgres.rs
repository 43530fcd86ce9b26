//! Instance runtimes on a real `PostgreSQL` server: three instances sharing
//! one account under concurrent load, one of them crashing (I14, I19, I25,
//! I9); and the server stopped mid-load and restarted, with requests served
//! from held leases, then refused, then served again, and no accepted usage
//! lost (I5, I25).
#![cfg(feature = "postgres")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use jiff::{SignedDuration, Timestamp};
use support::postgres::{Cluster, database_url, unique_schema};
use support::runtime::{LEASE_TTL, Pace, config, ms};
use tollgate::layer::deny_status;
use tollgate::runtime::{InstanceRuntime, RuntimeHandle};
use tollgate::store::{
    AccountSpec, AllocateError, Allocation, Clock, GrantPolicy, LeaseAllocator, ManualClock,
    PostgresConfig, PostgresStore, ReclaimBatch, Released, StoreError, TailSharing,
};
use tollgate::{
    AccountId, AccountStatus, CostUnits, DenyReason, EnforcementMode, FencingToken, LeaseId,
    PermissionBits, Principal,
};

const GRACE: SignedDuration = SignedDuration::from_secs(10);

fn policy(instances: u64) -> GrantPolicy {
    GrantPolicy {
        max_ttl: LEASE_TTL,
        reclaim_grace: GRACE,
        tail: TailSharing {
            instances,
            min_grant: CostUnits(20),
        },
    }
}

async fn connect(url: &str, schema: &str, instances: u64) -> Arc<PostgresStore> {
    let store = PostgresStore::connect(
        url,
        PostgresConfig {
            schema: schema.to_owned(),
            policy: policy(instances),
            lock_timeout: std::time::Duration::from_secs(5),
            queue_timeout: std::time::Duration::from_secs(5),
        },
    )
    .await
    .expect("the test server accepts connections");
    store.migrate().await.expect("the schema migrates");
    Arc::new(store)
}

fn spawn(store: &Arc<PostgresStore>, clock: &Arc<ManualClock>) -> (InstanceRuntime, RuntimeHandle) {
    InstanceRuntime::spawn(
        Arc::clone(store) as _,
        Arc::clone(store) as _,
        Arc::clone(store) as _,
        Arc::clone(clock) as Arc<dyn Clock>,
        config(Pace::RealTime),
    )
    .expect("the test configuration is valid")
}

async fn ready(handle: &RuntimeHandle) {
    for _ in 0..500 {
        if handle.readiness() {
            return;
        }
        tokio::time::sleep(ms(10)).await;
    }
    panic!("the runtime was not ready within five seconds");
}

/// Admits and commits until the account is out of funds or `stop` is set;
/// returns the units this task committed.
async fn spend(
    handle: RuntimeHandle,
    principal: Principal,
    clock: Arc<ManualClock>,
    stop: Arc<AtomicBool>,
) -> u64 {
    let mut committed = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    for attempt in 0_u64.. {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let quote = CostUnits(1 + attempt % 9);
        match handle.begin(principal, PermissionBits::NONE, quote, clock.now()) {
            Ok(mut context) => {
                // The manual clock stands still inside the lease's window:
                // an admitted request always commits.
                assert_eq!(context.commit(clock.now()), Ok(quote));
                committed += quote.get();
                tokio::task::yield_now().await;
            }
            Err(DenyReason::BalanceExhausted { .. }) => break,
            // A quote larger than the tail, a refill under way: wait for
            // the lease manager.
            Err(_) => tokio::time::sleep(ms(2)).await,
        }
        assert!(Instant::now() < deadline, "the balance never ran out");
    }
    committed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(clippy::too_many_lines, reason = "one scenario, read top to bottom")]
async fn three_instances_on_one_database_spend_exactly_even_when_one_crashes() {
    const INITIAL: u64 = 30_000;
    let test = "three_instances_on_one_database";
    let Some(url) = database_url(test) else {
        return;
    };
    let schema = unique_schema(test);
    let start = Timestamp::from_second(1_700_000_000).unwrap();
    let clock = Arc::new(ManualClock::new(start));
    let admin = connect(&url, &schema, 3).await;
    let account = admin
        .create_account(
            AccountSpec {
                balance: CostUnits(INITIAL),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            start,
        )
        .await
        .unwrap();
    let mut principals = Vec::new();
    for _ in 0..3 {
        let key = admin
            .issue_key(account, PermissionBits::ALL, start)
            .await
            .unwrap();
        principals.push(key.principal);
    }

    // Three instances, each with its own pool, as three processes would.
    let mut runtimes = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..3 {
        let store = connect(&url, &schema, 3).await;
        let (runtime, handle) = spawn(&store, &clock);
        runtimes.push(Some(runtime));
        handles.push(handle);
    }
    for handle in &handles {
        ready(handle).await;
    }

    let stops: Vec<Arc<AtomicBool>> = (0..3).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let mut spenders = Vec::new();
    for (index, handle) in handles.iter().enumerate() {
        for task in 0..4 {
            spenders.push((
                index,
                tokio::spawn(spend(
                    handle.clone(),
                    principals[(index + task) % 3],
                    Arc::clone(&clock),
                    Arc::clone(&stops[index]),
                )),
            ));
        }
    }
    // Mid-load, the third instance dies: its requests stop with it, and its
    // runtime is dropped without a shutdown.
    for _ in 0..500 {
        if handles[2].counters().admitted >= 100 {
            break;
        }
        tokio::time::sleep(ms(10)).await;
    }
    stops[2].store(true, Ordering::Relaxed);
    let mut committed_by = [0_u64; 3];
    let mut survivors = Vec::new();
    for (index, spender) in spenders {
        if index == 2 {
            committed_by[2] += spender.await.unwrap();
        } else {
            survivors.push((index, spender));
        }
    }
    let granted_to =
        |handle: &RuntimeHandle| handle.report().leases.expect("no overflow").acquired_units;
    // The crash strands what the instance still holds: its lease's
    // remainder and any usage not yet delivered.
    // Its lease manager restocks the lease its spenders drained.
    let mut held = 0;
    for _ in 0..200 {
        held = handles[2].account_reports()[0]
            .remaining
            .map_or(0, CostUnits::get);
        if held > 0 {
            break;
        }
        tokio::time::sleep(ms(10)).await;
    }
    assert!(held > 0, "the crashed instance held a stocked lease");
    // Read before the crash: a dropped runtime's lease managers are gone.
    let mut granted = [0_u64; 3];
    granted[2] = granted_to(&handles[2]);
    drop(runtimes[2].take());
    for (index, spender) in survivors {
        committed_by[index] += spender.await.unwrap();
    }
    granted[0] = granted_to(&handles[0]);
    granted[1] = granted_to(&handles[1]);
    let committed: u64 = committed_by.iter().sum();
    assert!(
        committed_by[2] > 0,
        "the crashed instance served before it died"
    );
    assert!(committed <= INITIAL, "I9: never more than the balance");
    for index in 0..3 {
        assert!(
            committed_by[index] <= granted[index],
            "I9: instance {index} committed {} of {} granted",
            committed_by[index],
            granted[index]
        );
    }

    // The two survivors shut down gracefully and lose nothing.
    for runtime in runtimes.iter_mut().take(2) {
        let report = runtime.take().unwrap().shutdown().await;
        assert_eq!(
            report.lost_events(),
            0,
            "I25: a graceful shutdown loses no usage"
        );
        assert_eq!(report.abandoned(), 0);
    }
    let billed = |usage: &[tollgate::UsageEvent]| usage.iter().map(|e| e.units.get()).sum::<u64>();
    let before = admin.account(account, clock.now()).await.unwrap();
    let billed_before = billed(&admin.usage(account, None, None).await.unwrap());
    assert!(
        billed_before >= committed_by[0] + committed_by[1],
        "everything the graceful instances committed is billed"
    );
    assert!(billed_before <= committed, "nothing is billed twice");
    // The crash exposure: units the crashed instance still held. The ledger
    // equation (I14) counts them until reclaim settles them.
    let exposure = INITIAL - before.balance.get() - billed_before;
    assert!(
        exposure >= held,
        "the exposure ({exposure}) covers the crashed lease's remainder ({held})"
    );

    // Past every lease's expiry and grace, any process may reclaim (I19).
    clock.advance(LEASE_TTL + GRACE + SignedDuration::from_secs(1));
    let reclaimer = connect(&url, &schema, 3).await;
    let mut credited = 0;
    loop {
        let batch = reclaimer
            .reclaim_expired_batch(clock.now(), 2)
            .await
            .unwrap();
        credited += batch
            .reclaimed
            .iter()
            .map(|lease| lease.credited.get())
            .sum::<u64>();
        if !batch.more {
            break;
        }
    }
    assert_eq!(credited, exposure, "reclaim returns exactly the exposure");
    let after = admin.account(account, clock.now()).await.unwrap();
    let billed_after = billed(&admin.usage(account, None, None).await.unwrap());
    assert_eq!(billed_after, billed_before);
    assert_eq!(after.leased, CostUnits::ZERO, "every lease settled");
    assert_eq!(
        after.balance.get() + billed_after,
        INITIAL,
        "I14: every unit is back in the balance or billed"
    );
    let violations = admin.audit().await.unwrap();
    assert!(violations.is_empty(), "I14, I15: {violations:#?}");
}

// ---- the server goes away and comes back ---------------------------------

/// The allocator with a stopwatch: the longest any call ran before it
/// completed or was abandoned by its caller.
struct Timed {
    inner: Arc<PostgresStore>,
    longest_us: AtomicU64,
}

struct Stopwatch<'a>(&'a AtomicU64, Instant);

impl Drop for Stopwatch<'_> {
    fn drop(&mut self) {
        let us = u64::try_from(self.1.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.0.fetch_max(us, Ordering::Relaxed);
    }
}

#[async_trait]
impl LeaseAllocator for Timed {
    async fn acquire_at_least(
        &self,
        account: AccountId,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        let _watch = Stopwatch(&self.longest_us, Instant::now());
        self.inner
            .acquire_at_least(account, requested, needed, ttl, now)
            .await
    }

    async fn release(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        now: Timestamp,
    ) -> Result<Released, AllocateError> {
        let _watch = Stopwatch(&self.longest_us, Instant::now());
        self.inner
            .release(lease_id, fencing_token, unspent, now)
            .await
    }

    async fn consolidate(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        let _watch = Stopwatch(&self.longest_us, Instant::now());
        self.inner
            .consolidate(
                lease_id,
                fencing_token,
                unspent,
                requested,
                needed,
                ttl,
                now,
            )
            .await
    }

    async fn reclaim_expired_batch(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> Result<ReclaimBatch, StoreError> {
        let _watch = Stopwatch(&self.longest_us, Instant::now());
        self.inner.reclaim_expired_batch(now, limit).await
    }
}

/// One request every millisecond until `stop`; counts what was admitted and
/// committed, and every denial by reason.
async fn steady_load(
    handle: RuntimeHandle,
    principal: Principal,
    clock: Arc<ManualClock>,
    (stop, held): (Arc<AtomicBool>, Arc<AtomicBool>),
    committed: Arc<AtomicU64>,
    denied: Arc<std::sync::Mutex<Vec<DenyReason>>>,
) {
    while !stop.load(Ordering::Relaxed) {
        if held.load(Ordering::Relaxed) {
            tokio::time::sleep(ms(1)).await;
            continue;
        }
        match handle.begin(principal, PermissionBits::NONE, CostUnits(1), clock.now()) {
            Ok(mut context) => {
                context
                    .commit(clock.now())
                    .expect("a fresh admission commits");
                committed.fetch_add(1, Ordering::Relaxed);
            }
            Err(reason) => denied.lock().unwrap().push(reason),
        }
        tokio::time::sleep(ms(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines, reason = "one scenario, read top to bottom")]
async fn a_server_outage_serves_from_held_leases_then_fails_closed_then_recovers() {
    let test = "server_outage";
    let Some(cluster) = Cluster::start_or_skip(test) else {
        return;
    };
    let schema = unique_schema(test);
    let start = Timestamp::from_second(1_700_000_000).unwrap();
    let clock = Arc::new(ManualClock::new(start));
    let store = connect(&cluster.url, &schema, 1).await;
    let account = store
        .create_account(
            AccountSpec {
                balance: CostUnits(1_000_000),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            start,
        )
        .await
        .unwrap();
    let principal = store
        .issue_key(account, PermissionBits::ALL, start)
        .await
        .unwrap()
        .principal;
    let timed = Arc::new(Timed {
        inner: Arc::clone(&store),
        longest_us: AtomicU64::new(0),
    });
    let mut runtime_config = config(Pace::RealTime);
    // The drain at the end must deliver everything the recovered load
    // committed, to a server just restarted, on a machine that may be busy
    // with other tests: a budget that long is no part of what this test
    // checks, so it is generous.
    runtime_config.usage.shutdown_drain_deadline = Duration::from_secs(10);
    runtime_config.shutdown_deadline = Duration::from_secs(12);
    let store_call_timeout = runtime_config.leases.store_call_timeout;
    let (runtime, handle) = InstanceRuntime::spawn(
        Arc::clone(&store) as _,
        Arc::clone(&timed) as _,
        Arc::clone(&store) as _,
        Arc::clone(&clock) as Arc<dyn Clock>,
        runtime_config,
    )
    .unwrap();
    ready(&handle).await;

    let stop = Arc::new(AtomicBool::new(false));
    // Held while the server is being stopped, which takes a while: a lease
    // drained meanwhile would leave nothing to serve once it is down.
    let held = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(AtomicU64::new(0));
    let denied = Arc::new(std::sync::Mutex::new(Vec::new()));
    let load = tokio::spawn(steady_load(
        handle.clone(),
        principal,
        Arc::clone(&clock),
        (Arc::clone(&stop), Arc::clone(&held)),
        Arc::clone(&committed),
        Arc::clone(&denied),
    ));
    tokio::time::sleep(ms(300)).await;
    assert!(
        denied.lock().unwrap().is_empty(),
        "a healthy server denies nothing"
    );

    // The server goes away. The held lease keeps serving until it drains.
    held.store(true, Ordering::Relaxed);
    cluster.pause();
    let at_outage = committed.load(Ordering::Relaxed);
    held.store(false, Ordering::Relaxed);
    let mut drained_at = None;
    for _ in 0..2_000 {
        tokio::time::sleep(ms(5)).await;
        if !denied.lock().unwrap().is_empty() {
            drained_at = Some(committed.load(Ordering::Relaxed));
            break;
        }
    }
    let drained_at = drained_at.expect("the held lease drained within ten seconds");
    assert!(
        drained_at > at_outage,
        "requests were served from the held lease during the outage"
    );
    // Then it fails closed: once a grant call has gone unanswered, the
    // drained lease is reported unavailable (503), not a momentary
    // shortage (429), and nothing more is admitted for as long as the
    // server is away (I5).
    let mut closed = false;
    for _ in 0..2_000 {
        if denied.lock().unwrap().last() == Some(&DenyReason::LeaseUnavailable) {
            closed = true;
            break;
        }
        tokio::time::sleep(ms(5)).await;
    }
    assert!(closed, "I5: the drained lease is reported unavailable");
    // I29: and the instance says it serves nobody, at its manager's next
    // inspection, not when the drained lease's window closes.
    let mut unready = false;
    for _ in 0..2_000 {
        if !handle.readiness() {
            unready = true;
            break;
        }
        tokio::time::sleep(ms(5)).await;
    }
    assert!(
        unready,
        "I29: a drained lease with no allocator is not ready"
    );
    denied.lock().unwrap().clear();
    let during = committed.load(Ordering::Relaxed);
    // Watched for half a second at least, and until the load has been
    // refused a hundred times: how long that takes depends on how finely
    // this machine's timers pace the load, not on the runtime, so the
    // deadline is generous. The manual clock does not move meanwhile, so
    // no snapshot goes stale however long the wait.
    let watched = Instant::now();
    loop {
        tokio::time::sleep(ms(50)).await;
        let refused = denied.lock().unwrap().len();
        if refused >= 100 && watched.elapsed() >= ms(500) {
            break;
        }
        assert!(
            watched.elapsed() < Duration::from_secs(30),
            "the load kept coming: only {refused} denials in thirty seconds"
        );
    }
    assert_eq!(
        committed.load(Ordering::Relaxed),
        during,
        "I5: nothing is admitted without funding"
    );
    {
        let denied = denied.lock().unwrap();
        assert!(
            denied
                .iter()
                .all(|reason| *reason == DenyReason::LeaseUnavailable
                    && deny_status(*reason) == http::StatusCode::SERVICE_UNAVAILABLE),
            "denials while the server is away fail closed with 503: {denied:?}"
        );
    }

    // The server comes back; the lease manager's next call gets a grant.
    cluster.resume();
    let resumed = committed.load(Ordering::Relaxed);
    let mut recovered = false;
    for _ in 0..1_000 {
        tokio::time::sleep(ms(10)).await;
        if committed.load(Ordering::Relaxed) > resumed + 50 {
            recovered = true;
            break;
        }
    }
    assert!(recovered, "requests are admitted again after the restart");
    assert!(handle.readiness(), "ready again with a grant");
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();

    let report = runtime.shutdown().await;
    assert_eq!(report.lost_events(), 0, "I25: no accepted usage event lost");
    assert_eq!(report.abandoned(), 0);
    let billed: u64 = store
        .usage(account, None, None)
        .await
        .unwrap()
        .iter()
        .map(|event| event.units.get())
        .sum();
    assert_eq!(
        billed,
        committed.load(Ordering::Relaxed),
        "every committed charge is billed exactly once"
    );
    // I22: a call to the stopped server is cut off at store_call_timeout
    // (200 ms here). Uncut, it would wait out the pool's five-second
    // acquire timeout, or never end at all on a connection already open.
    // The slack, for a loaded machine to get round to dropping the
    // abandoned call's future, is generous and still far short of that.
    assert!(
        store_call_timeout <= ms(500),
        "the bound below assumes a short store_call_timeout, not {store_call_timeout:?}"
    );
    let longest = Duration::from_micros(timed.longest_us.load(Ordering::Relaxed));
    assert!(
        longest <= store_call_timeout + Duration::from_secs(2),
        "allocator calls stayed bounded by store_call_timeout ({store_call_timeout:?}): the longest took {longest:?}"
    );
    let violations = store.audit().await.unwrap();
    assert!(violations.is_empty(), "I14, I15: {violations:#?}");
}

/// Every operation's future can be spawned: an operator task or a gateway
/// migrating at start runs them on a multi-threaded runtime.
#[allow(
    dead_code,
    reason = "compiled, never run: the check is the type system's"
)]
fn every_store_future_is_send(store: &'static PostgresStore) {
    fn spawnable<T: Send>(_: T) {}
    let now = Timestamp::UNIX_EPOCH;
    spawnable(store.migrate());
    spawnable(store.check_schema());
    spawnable(store.audit());
    spawnable(store.accounts(now));
    spawnable(store.account(AccountId(1), now));
    spawnable(store.usage(AccountId(1), None, None));
    spawnable(store.history(AccountId(1)));
    spawnable(store.list_keys(AccountId(1)));
    spawnable(store.issue_key(AccountId(1), PermissionBits::ALL, now));
    spawnable(store.revoke_key(tollgate::KeyId(1), now));
    spawnable(store.set_status(AccountId(1), AccountStatus::Active));
    spawnable(store.set_mode(AccountId(1), EnforcementMode::Strict));
    spawnable(store.configure_refill(AccountId(1), None, now));
    let movement = tollgate::store::Movement {
        idempotency_key: "k",
        reason: "r",
    };
    spawnable(store.top_up(AccountId(1), CostUnits(1), &movement, now));
    spawnable(store.adjust(AccountId(1), 1, &movement, now));
}
