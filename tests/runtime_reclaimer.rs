//! The reclaimer on paused tokio time with a manual clock moved in
//! lockstep: the grace, batches that say more, exact counts, outages and
//! hangs, concurrent reclaimers and shutdown — against a scripted allocator
//! and end to end on the memory store, audited after every scenario (I14,
//! I15, I19, I22).

mod support;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use jiff::{SignedDuration, Timestamp};
use tokio::sync::Notify;
use tokio::time::Instant;
use tollgate::runtime::{ReclaimStats, Reclaimer, ReclaimerConfig, ReclaimerConfigError};
use tollgate::store::{
    AccountSpec, AllocateError, Allocation, BlockedLease, Clock, GrantPolicy, IngestOutcome,
    LeaseAllocator, ManualClock, MemoryStore, ReclaimBatch, ReclaimedLease, Released, StoreError,
    TailSharing, UsageSink,
};
use tollgate::{
    AccountId, AccountStatus, CostUnits, EnforcementMode, FencingToken, LeaseGrant, LeaseId,
    PolicyRevision, RequestId, UsageEvent, UsageSource,
};

use support::logs::Logs;

const GRACE: SignedDuration = SignedDuration::from_secs(2);
const TTL: SignedDuration = SignedDuration::from_secs(5);

fn start() -> Timestamp {
    Timestamp::from_second(1_700_000_000).expect("a test instant is in range")
}

/// How long the store must answer after a failure before anything is
/// settled again.
const OUTAGE_HOLD: Duration = Duration::from_secs(3);

/// The Unix epoch in the calls' record (seconds after `start()`): what a
/// held reclaimer asks as of.
const EPOCH: i64 = -1_700_000_000;

fn config(interval_secs: u64, batch_limit: usize, timeout_secs: u64) -> ReclaimerConfig {
    ReclaimerConfig {
        interval: Duration::from_secs(interval_secs),
        batch_limit,
        store_call_timeout: Duration::from_secs(timeout_secs),
        outage_hold: OUTAGE_HOLD,
    }
}

/// Lets every task that is ready run until it waits again.
async fn settle() {
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}

/// Moves the manual clock and tokio's time forward together, one second at
/// a time, letting the reclaimers act at each second.
async fn run_for(clock: &ManualClock, seconds: u64) {
    for _ in 0..seconds {
        clock.advance(SignedDuration::from_secs(1));
        tokio::time::advance(Duration::from_secs(1)).await;
        settle().await;
    }
}

fn stats(passes: u64, reclaimed_leases: u64, reclaimed_units: u64) -> ReclaimStats {
    ReclaimStats {
        passes,
        reclaimed_leases,
        reclaimed_units,
        ..ReclaimStats::default()
    }
}

/// One planned answer to `reclaim_expired_batch`.
#[derive(Debug, Clone)]
enum Answer {
    /// These leases (id, units credited), and whether more are due.
    Batch(Vec<(u64, u64)>, bool),
    /// One lease settled (id, units), these leases named blocked, and
    /// whether more are due.
    Blocked((u64, u64), Vec<u64>, bool),
    Fail,
    Hang,
    /// A bug in the store client.
    Panic,
}

/// An allocator whose reclaim answers from a script, then from a backlog
/// of due leases (then: nothing due), and records each call's `now`
/// (seconds after `start()`) and limit.
#[derive(Debug, Default)]
struct ScriptedAllocator {
    script: Mutex<VecDeque<Answer>>,
    calls: Mutex<Vec<(i64, usize)>>,
    /// Due leases left after the script, each worth one unit.
    backlog: Mutex<u64>,
    /// How long settling each lease of a backlog batch takes, as a store's
    /// transaction grows with its batch.
    per_lease: Duration,
    /// Told as each answer leaves the store, before the caller sees it.
    answering: Arc<Notify>,
}

impl ScriptedAllocator {
    fn new(script: impl IntoIterator<Item = Answer>) -> Arc<Self> {
        Arc::new(Self {
            script: Mutex::new(script.into_iter().collect()),
            ..Self::default()
        })
    }

    fn with_backlog(leases: u64, per_lease: Duration) -> Arc<Self> {
        Arc::new(Self {
            backlog: Mutex::new(leases),
            per_lease,
            ..Self::default()
        })
    }

    fn calls(&self) -> Vec<(i64, usize)> {
        lock(&self.calls).clone()
    }
}

#[async_trait]
impl LeaseAllocator for ScriptedAllocator {
    async fn acquire_at_least(
        &self,
        _account: AccountId,
        _requested: CostUnits,
        _needed: CostUnits,
        _ttl: SignedDuration,
        _now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        unreachable!("the reclaimer only reclaims")
    }

    async fn release(
        &self,
        _lease_id: LeaseId,
        _fencing_token: FencingToken,
        _unspent: CostUnits,
        _now: Timestamp,
    ) -> Result<Released, AllocateError> {
        unreachable!("the reclaimer only reclaims")
    }

    async fn consolidate(
        &self,
        _lease_id: LeaseId,
        _fencing_token: FencingToken,
        _unspent: CostUnits,
        _requested: CostUnits,
        _needed: CostUnits,
        _ttl: SignedDuration,
        _now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        unreachable!("the reclaimer only reclaims")
    }

    async fn reclaim_expired_batch(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> Result<ReclaimBatch, StoreError> {
        lock(&self.calls).push((now.duration_since(start()).as_secs(), limit));
        let scripted = lock(&self.script).pop_front();
        let answer = match scripted {
            Some(answer) => answer,
            // A held reclaimer's probe: nothing the backlog holds came
            // due as early as the epoch.
            None if now < start() => Answer::Batch(Vec::new(), false),
            None => self.settle_backlog(limit).await,
        };
        self.answering.notify_waiters();
        match answer {
            Answer::Batch(leases, more) => Ok(ReclaimBatch {
                reclaimed: leases
                    .into_iter()
                    .map(|(lease, units)| ReclaimedLease {
                        lease_id: LeaseId(lease),
                        account_id: AccountId(1),
                        credited: CostUnits(units),
                    })
                    .collect(),
                more,
                ..ReclaimBatch::default()
            }),
            Answer::Blocked((lease, units), blocked, more) => Ok(ReclaimBatch {
                reclaimed: vec![ReclaimedLease {
                    lease_id: LeaseId(lease),
                    account_id: AccountId(1),
                    credited: CostUnits(units),
                }],
                blocked: blocked
                    .into_iter()
                    .map(|lease| BlockedLease {
                        lease_id: LeaseId(lease),
                        account_id: AccountId(2),
                        remainder: CostUnits(lease * 100),
                    })
                    .collect(),
                more,
            }),
            Answer::Fail => Err(StoreError::new("scripted outage")),
            Answer::Hang => std::future::pending().await,
            Answer::Panic => panic!("a bug in the store client"),
        }
    }
}

impl ScriptedAllocator {
    /// Settles up to `limit` backlog leases, taking `per_lease` for each
    /// before anything is settled: a call cut off settles nothing, as a
    /// rolled-back transaction.
    async fn settle_backlog(&self, limit: usize) -> Answer {
        let due = *lock(&self.backlog);
        let count = due.min(u64::try_from(limit).expect("fits"));
        tokio::time::sleep(self.per_lease * u32::try_from(count).expect("fits")).await;
        let mut backlog = lock(&self.backlog);
        *backlog -= count;
        let first = due - count;
        Answer::Batch((first..due).map(|lease| (lease, 1)).collect(), *backlog > 0)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn spawn(
    allocator: Arc<dyn LeaseAllocator>,
    clock: &Arc<ManualClock>,
    config: ReclaimerConfig,
) -> Reclaimer {
    Reclaimer::spawn(allocator, Arc::clone(clock) as _, config)
        .expect("the test configuration is valid")
}

fn store() -> Arc<MemoryStore> {
    Arc::new(
        MemoryStore::new(GrantPolicy {
            max_ttl: SignedDuration::from_secs(60),
            reclaim_grace: GRACE,
            tail: TailSharing {
                instances: 1,
                min_grant: CostUnits(1),
            },
        })
        .expect("the test policy is valid"),
    )
}

fn open_account(store: &MemoryStore, balance: u64) -> AccountId {
    store
        .create_account(
            AccountSpec {
                balance: CostUnits(balance),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            start(),
        )
        .expect("opening an account succeeds")
}

/// Grants a lease of `units` living `TTL` from `start()`: expired at
/// start + 5s, reclaimable at start + 7s.
async fn lease(store: &MemoryStore, account: AccountId, units: u64) -> LeaseGrant {
    store
        .acquire(account, CostUnits(units), TTL, start())
        .await
        .expect("the account can fund the lease")
        .grant
}

/// Bills `units` against `grant`, as an instance would before it crashed.
async fn bill(store: &MemoryStore, request: u128, grant: &LeaseGrant, units: u64) {
    let event = UsageEvent {
        request_id: RequestId(request),
        account_id: grant.account_id,
        source: UsageSource::Leased {
            lease_id: grant.lease_id,
            fencing_token: grant.fencing_token,
        },
        units: CostUnits(units),
        at: start(),
        policy_revision: PolicyRevision::UNSTATED,
        key_id: None,
    };
    assert_eq!(
        store.ingest(&[event]).await,
        Ok(vec![IngestOutcome::Accepted])
    );
}

#[track_caller]
fn balance(store: &MemoryStore, account: AccountId) -> u64 {
    store
        .account(account, start())
        .expect("the account exists")
        .balance
        .get()
}

#[track_caller]
fn audited(store: &MemoryStore) {
    assert_eq!(
        store.audit().expect("the store answers"),
        vec![],
        "I14, I15: the books balance"
    );
}

/// I19: a lease is reclaimed only once `expires_at + reclaim_grace` has
/// passed, crediting its grant net of billed usage; the first pass runs at
/// once and one runs every interval.
#[tokio::test(start_paused = true)]
async fn an_expired_lease_is_reclaimed_only_once_its_grace_has_passed() {
    let store = store();
    let clock = Arc::new(ManualClock::new(start()));
    let account = open_account(&store, 100);
    let grant = lease(&store, account, 30).await;
    bill(&store, 1, &grant, 4).await;
    let reclaimer = spawn(store.clone(), &clock, config(1, 10, 1));
    settle().await;
    assert_eq!(
        reclaimer.stats(),
        stats(1, 0, 0),
        "the first pass ran at once"
    );

    run_for(&clock, 6).await;
    assert_eq!(
        reclaimer.stats(),
        stats(7, 0, 0),
        "expired, but within the grace"
    );
    assert_eq!(balance(&store, account), 70);

    run_for(&clock, 1).await;
    assert_eq!(reclaimer.stats(), stats(8, 1, 26), "30 granted, 4 billed");
    assert_eq!(balance(&store, account), 96);
    let view = store.account(account, clock.now()).expect("exists");
    assert_eq!(
        (view.leased, view.settled_unbilled),
        (CostUnits::ZERO, CostUnits::ZERO)
    );
    audited(&store);

    run_for(&clock, 3).await;
    assert_eq!(reclaimer.stats(), stats(11, 1, 26), "settled once");
    assert_eq!(reclaimer.shutdown().await, stats(11, 1, 26));
}

/// I19: an expired lease whose remainder its account's balance has no room
/// for (below the ledger's `i64::MAX`) is passed over and reported, not an
/// error: a smaller account's lease due at the same time is still
/// reclaimed in the same pass, and the blocked one settles once its
/// account has room.
#[tokio::test(start_paused = true)]
async fn a_lease_that_cannot_be_credited_is_reported_and_holds_up_no_other() {
    const TOP: u64 = i64::MAX as u64;
    let store = store();
    let clock = Arc::new(ManualClock::new(start()));
    let full = open_account(&store, TOP - 10);
    let blocked = lease(&store, full, 100).await;
    store
        .top_up(full, CostUnits(100), start())
        .expect("the balance alone stays in range");
    let small = open_account(&store, 50);
    lease(&store, small, 30).await;
    let reclaimer = spawn(store.clone(), &clock, config(1, 10, 1));
    settle().await;
    run_for(&clock, 7).await;
    assert_eq!(
        reclaimer.stats(),
        ReclaimStats {
            blocked_leases: 1,
            ..stats(8, 1, 30)
        },
        "the small account's lease is reclaimed past the blocked one"
    );
    assert_eq!(balance(&store, small), 50);
    assert_eq!(balance(&store, full), TOP - 10, "nothing credited");
    audited(&store);

    // The account spends: a new lease takes 200 units out of the balance,
    // and they are billed. Now the blocked remainder fits.
    let spent = store
        .acquire(full, CostUnits(200), TTL, clock.now())
        .await
        .expect("funded")
        .grant;
    bill(&store, 1, &spent, 200).await;
    run_for(&clock, 1).await;
    assert_eq!(
        reclaimer.stats(),
        ReclaimStats {
            blocked_leases: 0,
            ..stats(9, 2, 130)
        }
    );
    assert_eq!(balance(&store, full), TOP - 110);
    let view = store.account(full, clock.now()).expect("exists");
    assert_eq!(view.leased, CostUnits(200), "only the spent lease is out");
    assert_ne!(blocked.lease_id, spent.lease_id);
    audited(&store);
    reclaimer.shutdown().await;
}

/// While a batch says more leases are due, the reclaimer asks again at once,
/// within the same instant, instead of waiting an interval; units are
/// counted exactly.
#[tokio::test(start_paused = true)]
async fn a_batch_that_says_more_is_followed_at_once_not_after_an_interval() {
    let allocator = ScriptedAllocator::new([
        Answer::Batch(vec![(1, 10), (2, 20), (3, 30)], true),
        Answer::Batch(vec![(4, 5)], true),
        Answer::Batch(vec![(5, 7)], false),
    ]);
    let clock = Arc::new(ManualClock::new(start()));
    let reclaimer = spawn(allocator.clone(), &clock, config(10, 3, 1));
    settle().await;
    assert_eq!(allocator.calls(), vec![(0, 3), (0, 3), (0, 3)]);
    assert_eq!(reclaimer.stats(), stats(1, 5, 72));

    run_for(&clock, 9).await;
    assert_eq!(allocator.calls().len(), 3);
    run_for(&clock, 1).await;
    assert_eq!(allocator.calls(), vec![(0, 3), (0, 3), (0, 3), (10, 3)]);
    assert_eq!(reclaimer.shutdown().await, stats(2, 5, 72));
}

/// I19: every batch of a pass names the leases still blocked, but each is
/// logged once a pass, not once a batch; the next pass names them again,
/// and the gauge holds what the call that ended the pass named.
#[tokio::test(start_paused = true)]
async fn a_blocked_lease_is_logged_once_a_pass_however_many_batches_name_it() {
    const BLOCKED: &str = "an expired lease cannot be settled yet";
    let allocator = ScriptedAllocator::new([
        Answer::Blocked((1, 10), vec![7], true),
        Answer::Blocked((2, 10), vec![7, 8], true),
        Answer::Blocked((3, 10), vec![7, 8], false),
        Answer::Blocked((4, 10), vec![8], false),
    ]);
    let clock = Arc::new(ManualClock::new(start()));
    let (logs, _capture) = Logs::capture();
    let reclaimer = spawn(allocator.clone(), &clock, config(10, 3, 1));
    settle().await;
    assert_eq!(allocator.calls().len(), 3, "one pass of three batches");
    let first_pass = logs.lines_with(BLOCKED);
    assert_eq!(
        first_pass.len(),
        2,
        "two leases, each named once: {first_pass:#?}"
    );
    for (line, lease) in first_pass.iter().zip([7, 8]) {
        assert!(line.contains(&LeaseId(lease).to_string()), "{line}");
    }
    assert_eq!(
        reclaimer.stats(),
        ReclaimStats {
            blocked_leases: 2,
            ..stats(1, 3, 30)
        }
    );

    run_for(&clock, 10).await;
    let both_passes = logs.lines_with(BLOCKED);
    assert_eq!(both_passes.len(), 3, "the next pass names lease 8 again");
    assert!(
        both_passes[2].contains(&LeaseId(8).to_string()),
        "{}",
        both_passes[2]
    );
    assert_eq!(
        reclaimer.shutdown().await,
        ReclaimStats {
            blocked_leases: 1,
            ..stats(2, 4, 40)
        }
    );
}

/// I19: every due lease is settled in one pass of several batches, and the
/// ledger balances afterwards.
#[tokio::test(start_paused = true)]
async fn every_due_lease_is_settled_in_one_pass_of_several_batches() {
    let store = store();
    let clock = Arc::new(ManualClock::new(start()));
    let account = open_account(&store, 1_000);
    for units in (1..=7).map(|n| n * 10) {
        lease(&store, account, units).await;
    }
    assert_eq!(balance(&store, account), 720);
    let reclaimer = spawn(store.clone(), &clock, config(10, 3, 1));
    settle().await;
    assert_eq!(reclaimer.stats(), stats(1, 0, 0));

    run_for(&clock, 10).await;
    assert_eq!(reclaimer.stats(), stats(2, 7, 280));
    assert_eq!(balance(&store, account), 1_000);
    audited(&store);
    reclaimer.shutdown().await;
}

/// I22: a storage error and a hang (cut off by `store_call_timeout`) are
/// counted and end their pass; the next pass comes at the next interval. A
/// store that says more is due but settles nothing is not asked again at
/// once.
#[tokio::test(start_paused = true)]
async fn storage_errors_and_hangs_are_counted_and_never_fatal() {
    // After each failure the next pass is a probe (it asks as of the
    // epoch and settles nothing), answered, which holds reclaim for the
    // outage hold (3 s) and so until the pass after.
    let allocator = ScriptedAllocator::new([
        Answer::Fail,
        Answer::Batch(Vec::new(), false),
        Answer::Hang,
        Answer::Batch(Vec::new(), false),
        Answer::Batch(vec![(1, 9)], false),
        Answer::Batch(Vec::new(), true),
    ]);
    let clock = Arc::new(ManualClock::new(start()));
    let reclaimer = spawn(allocator.clone(), &clock, config(5, 4, 1));
    settle().await;
    assert_eq!(
        reclaimer.stats(),
        ReclaimStats {
            errors: 1,
            ..ReclaimStats::default()
        }
    );

    run_for(&clock, 5).await;
    assert_eq!(reclaimer.stats().held, 1, "the probe at t=5 is answered");
    run_for(&clock, 5).await;
    assert_eq!(reclaimer.stats().timeouts, 0, "the call at t=10 hangs");
    run_for(&clock, 1).await;
    assert_eq!(reclaimer.stats().timeouts, 1, "cut off at t=11");

    run_for(&clock, 9).await;
    assert_eq!(
        reclaimer.stats(),
        ReclaimStats {
            errors: 1,
            timeouts: 1,
            held: 2,
            ..stats(1, 1, 9)
        }
    );

    run_for(&clock, 5).await;
    // Halved after the timeout (a probe leaves the size alone), then grown
    // back by one lease per batch.
    assert_eq!(
        allocator.calls(),
        vec![(0, 4), (EPOCH, 4), (10, 4), (EPOCH, 2), (20, 2), (25, 3)]
    );
    assert_eq!(
        reclaimer.shutdown().await,
        ReclaimStats {
            errors: 2,
            timeouts: 1,
            held: 2,
            ..stats(1, 1, 9)
        }
    );
}

/// I19, for I15: after an outage the usage writers deliver what queued
/// up, naming leases that may have come due meanwhile. The reclaimer
/// settles nothing after a failed call until the store has answered for
/// `outage_hold`, so that usage is accepted rather than refused as settled,
/// its units going back unbilled. Meanwhile it asks as of the epoch, which
/// settles nothing and writes nothing but finds out whether the store
/// answers. A failure during the hold starts it again.
#[tokio::test(start_paused = true)]
async fn after_an_outage_nothing_due_since_is_reclaimed_until_the_store_has_answered_a_while() {
    let allocator = ScriptedAllocator::new([
        Answer::Batch(Vec::new(), false),
        Answer::Fail,
        Answer::Fail,
        // Due as early as the epoch: a probe that does settle a lease
        // reports it like any settlement.
        Answer::Batch(vec![(1, 5)], false),
        Answer::Fail,
        Answer::Batch(Vec::new(), false),
    ]);
    let clock = Arc::new(ManualClock::new(start()));
    let reclaimer = spawn(allocator.clone(), &clock, config(1, 4, 1));
    settle().await;
    // 0: answered. 1: the store is down; the hold begins. 2: down.
    run_for(&clock, 2).await;
    // 3: answered; the hold now lasts until 6.
    // 4: fails again: the hold waits for the next answer.
    // 5: answered; the hold lasts until 8.
    run_for(&clock, 3).await;
    // 6, 7: still held. 8: the hold is over.
    run_for(&clock, 4).await;
    let asked: Vec<i64> = allocator.calls().iter().map(|&(at, _)| at).collect();
    assert_eq!(
        asked,
        vec![0, 1, EPOCH, EPOCH, EPOCH, EPOCH, EPOCH, EPOCH, 8, 9]
    );
    let stats = reclaimer.shutdown().await;
    assert_eq!(
        (stats.errors, stats.held, stats.passes),
        (3, 4, 3),
        "probes at 3, 5, 6 and 7; real passes at 0, 8 and 9"
    );
    assert_eq!((stats.reclaimed_leases, stats.reclaimed_units), (1, 5));
}

/// A probe settles nothing, so its timeout says nothing of whether a batch
/// of this size fits the timeout: the batch stands, and a long outage of
/// hanging calls does not leave the backlog to drain a lease at a time.
#[tokio::test(start_paused = true)]
async fn a_probe_that_times_out_leaves_the_batch_size_alone() {
    let allocator = ScriptedAllocator::new([
        Answer::Fail,
        Answer::Hang,
        Answer::Hang,
        Answer::Batch(Vec::new(), false),
    ]);
    let clock = Arc::new(ManualClock::new(start()));
    let reclaimer = spawn(allocator.clone(), &clock, config(5, 4, 1));
    settle().await;
    // 0: fails. 5, 10: probes hang and are cut off. 15: a probe is
    // answered; the hold lasts until 18. 20: reclaiming again.
    run_for(&clock, 20).await;
    assert_eq!(
        allocator.calls(),
        vec![(0, 4), (EPOCH, 4), (EPOCH, 4), (EPOCH, 4), (20, 4)]
    );
    let stats = reclaimer.shutdown().await;
    assert_eq!(
        (stats.errors, stats.timeouts, stats.held, stats.passes),
        (1, 2, 1, 1)
    );
}

/// A call whose answer is in when the stop comes is reported, not thrown
/// away: what the store settled shows in the counts `shutdown` returns, and
/// no call follows the stop, though the answer said more leases are due.
#[tokio::test(start_paused = true)]
async fn an_answer_already_in_when_the_stop_comes_is_reported() {
    let allocator = ScriptedAllocator::new([Answer::Batch(vec![(1, 9)], true)]);
    let clock = Arc::new(ManualClock::new(start()));
    let reclaimer = spawn(allocator.clone(), &clock, config(5, 4, 1));
    // Told as the store answers, this task runs before the reclaimer task
    // the answer wakes, and so stops it before it has read the answer.
    let answering = Arc::clone(&allocator.answering);
    let stopper = tokio::spawn(async move {
        answering.notified().await;
        reclaimer.shutdown().await
    });
    let stats = stopper.await.expect("the shutdown completes");
    assert_eq!((stats.reclaimed_leases, stats.reclaimed_units), (1, 9));
    assert_eq!(allocator.calls(), vec![(0, 4)], "no call after the stop");
}

/// A store client that panics fails that pass, counted as an error; the
/// reclaimer goes on, since crashed instances' leases are settled nowhere
/// else.
#[tokio::test(start_paused = true)]
async fn a_store_call_that_panics_fails_one_pass_and_the_reclaimer_goes_on() {
    let allocator = ScriptedAllocator::new([
        Answer::Panic,
        Answer::Batch(Vec::new(), false),
        Answer::Batch(vec![(1, 9)], false),
    ]);
    let clock = Arc::new(ManualClock::new(start()));
    let reclaimer = spawn(allocator.clone(), &clock, config(5, 4, 1));
    settle().await;
    assert_eq!(
        reclaimer.stats(),
        ReclaimStats {
            errors: 1,
            ..ReclaimStats::default()
        }
    );
    // 5: a probe, answered (the outage hold); 10: reclaiming again.
    run_for(&clock, 10).await;
    assert_eq!(allocator.calls(), vec![(0, 4), (EPOCH, 4), (10, 4)]);
    assert_eq!(
        reclaimer.shutdown().await,
        ReclaimStats {
            errors: 1,
            held: 1,
            ..stats(1, 1, 9)
        }
    );
}

/// I19, I22: a batch too large to settle within the call's timeout would
/// time out on every pass and nothing would ever be reclaimed. After a
/// timeout the reclaimer asks for half as many, and grows back by an eighth
/// per batch settled, so the backlog drains.
#[tokio::test(start_paused = true)]
async fn a_batch_too_large_for_the_timeout_shrinks_until_the_backlog_drains() {
    // 150 ms a lease against a one-second timeout: six leases fit a call.
    let allocator = ScriptedAllocator::with_backlog(40, Duration::from_millis(150));
    let clock = Arc::new(ManualClock::new(start()));
    let reclaimer = spawn(allocator.clone(), &clock, config(5, 64, 1));
    // Each timeout also holds reclaim for a probe's pass (the outage hold).
    run_for(&clock, 180).await;
    let stats = reclaimer.shutdown().await;
    assert_eq!(
        (stats.reclaimed_leases, stats.reclaimed_units),
        (40, 40),
        "the whole backlog is settled"
    );
    let limits: Vec<usize> = allocator
        .calls()
        .iter()
        .filter(|&&(at, _)| at != EPOCH)
        .map(|&(_, limit)| limit)
        .collect();
    assert_eq!(
        &limits[..5],
        [64, 32, 16, 8, 4],
        "halved after each timeout until a batch fits"
    );
    assert!(stats.timeouts >= 4, "{stats:?}");
    assert!(limits.iter().all(|&limit| limit <= 64));
}

/// I19: two reclaimers taking turns on one store settle each lease exactly
/// once: their counts add up to the leases that expired, and the ledger
/// balances. On paused time and one thread they interleave between batches,
/// never with calls in flight together; the store's own answer to that race
/// is `concurrent_reclaimers_settle_each_lease_once` in the store tests,
/// on four threads against both stores.
#[tokio::test(start_paused = true)]
async fn two_reclaimers_taking_turns_on_one_store_settle_each_lease_once() {
    let store = store();
    let clock = Arc::new(ManualClock::new(start()));
    let accounts = [open_account(&store, 1_000), open_account(&store, 1_000)];
    let mut grants = Vec::new();
    for account in accounts {
        for units in 1..=10 {
            grants.push(lease(&store, account, units).await);
        }
    }
    bill(&store, 1, &grants[0], 1).await;
    bill(&store, 2, &grants[19], 6).await;
    let first = spawn(store.clone(), &clock, config(1, 3, 1));
    let second = spawn(store.clone(), &clock, config(1, 3, 1));

    run_for(&clock, 8).await;
    let (first, second) = (first.shutdown().await, second.shutdown().await);
    assert_eq!(
        first.reclaimed_leases + second.reclaimed_leases,
        20,
        "I19: each expired lease settled once"
    );
    assert_eq!(
        first.reclaimed_units + second.reclaimed_units,
        110 - 1 - 6,
        "granted minus billed"
    );
    assert_eq!((first.errors, second.errors), (0, 0));
    assert!(
        first.reclaimed_leases > 0 && second.reclaimed_leases > 0,
        "both reclaimers took part: {first:?} {second:?}"
    );
    assert_eq!(balance(&store, accounts[0]), 999);
    assert_eq!(balance(&store, accounts[1]), 994);
    audited(&store);
}

/// Shutdown returns at once even while a reclaim call hangs, and the task
/// lets go of the allocator.
#[tokio::test(start_paused = true)]
async fn shutdown_is_prompt_while_a_reclaim_call_hangs() {
    let allocator = ScriptedAllocator::new([Answer::Hang]);
    let clock = Arc::new(ManualClock::new(start()));
    let reclaimer = spawn(allocator.clone(), &clock, config(1, 3, 60));
    settle().await;
    run_for(&clock, 1).await;
    assert_eq!(allocator.calls(), vec![(0, 3)], "still hanging");

    let begun = Instant::now();
    assert_eq!(reclaimer.shutdown().await, ReclaimStats::default());
    assert_eq!(begun.elapsed(), Duration::ZERO);
    assert_eq!(Arc::strong_count(&allocator), 1);
}

/// Any positive interval is valid, `Duration::MAX` included: the task runs
/// its first pass and then waits, rather than dying on timer arithmetic
/// (tokio's interval caps the period; this holds it to that).
#[tokio::test(start_paused = true)]
async fn the_longest_interval_runs_a_pass_and_then_waits() {
    let allocator = ScriptedAllocator::new([]);
    let clock = Arc::new(ManualClock::new(start()));
    let longest = ReclaimerConfig {
        interval: Duration::MAX,
        ..config(1, 3, 1)
    };
    let reclaimer = spawn(allocator.clone(), &clock, longest);
    settle().await;
    run_for(&clock, 3).await;
    assert_eq!(allocator.calls(), vec![(0, 3)], "one pass, then a wait");
    assert_eq!(reclaimer.shutdown().await, stats(1, 0, 0));
}

/// Dropping the handle aborts the task.
#[tokio::test(start_paused = true)]
async fn dropping_the_reclaimer_aborts_its_task() {
    let allocator = ScriptedAllocator::new([]);
    let clock = Arc::new(ManualClock::new(start()));
    let reclaimer = spawn(allocator.clone(), &clock, config(1, 3, 1));
    settle().await;
    assert_eq!(allocator.calls().len(), 1);
    drop(reclaimer);
    settle().await;
    assert_eq!(Arc::strong_count(&allocator), 1, "the task is gone");
    run_for(&clock, 3).await;
    assert_eq!(allocator.calls().len(), 1, "no pass after the abort");
}

/// A configuration and the first rule it breaks, if any.
#[track_caller]
fn check(config: ReclaimerConfig, expected: Result<(), ReclaimerConfigError>) {
    assert_eq!(config.validate(), expected, "{config:?}");
}

/// I17: every rule is checked, in field order, and the first one broken is
/// named; an invalid configuration starts nothing.
#[tokio::test(start_paused = true)]
async fn every_configuration_rule_is_checked_in_field_order() {
    use ReclaimerConfigError as Broken;
    check(config(1, 1, 1), Ok(()));
    check(config(0, 0, 0), Err(Broken::IntervalBelowTimerResolution));
    check(config(1, 0, 0), Err(Broken::BatchLimitZero));
    check(
        config(1, 1, 0),
        Err(Broken::StoreCallTimeoutBelowTimerResolution),
    );
    check(
        ReclaimerConfig {
            outage_hold: Duration::ZERO,
            ..config(1, 1, 1)
        },
        Err(Broken::OutageHoldBelowTimerResolution),
    );
    // I17: an interval under the timer's millisecond would run passes back
    // to back; a call bound or hold that short would not be kept either.
    let under_a_milli = Duration::from_micros(999);
    let a_milli = Duration::from_millis(1);
    check(
        ReclaimerConfig {
            interval: under_a_milli,
            ..config(1, 1, 1)
        },
        Err(Broken::IntervalBelowTimerResolution),
    );
    check(
        ReclaimerConfig {
            store_call_timeout: under_a_milli,
            ..config(1, 1, 1)
        },
        Err(Broken::StoreCallTimeoutBelowTimerResolution),
    );
    check(
        ReclaimerConfig {
            outage_hold: under_a_milli,
            ..config(1, 1, 1)
        },
        Err(Broken::OutageHoldBelowTimerResolution),
    );
    check(
        ReclaimerConfig {
            interval: a_milli,
            batch_limit: 1,
            store_call_timeout: a_milli,
            outage_hold: a_milli,
        },
        Ok(()),
    );
    for broken in [
        Broken::IntervalBelowTimerResolution,
        Broken::BatchLimitZero,
        Broken::StoreCallTimeoutBelowTimerResolution,
        Broken::OutageHoldBelowTimerResolution,
    ] {
        let message = broken.to_string();
        assert!(message.starts_with("reclaimer: "), "{message}");
        assert_eq!(message, message.to_lowercase(), "lowercase: {message}");
    }

    let allocator = ScriptedAllocator::new([]);
    let refused = Reclaimer::spawn(
        allocator.clone(),
        Arc::new(ManualClock::new(start())),
        config(1, 0, 1),
    );
    assert_eq!(refused.map(|_| ()).unwrap_err(), Broken::BatchLimitZero);
    settle().await;
    assert_eq!(allocator.calls(), vec![]);
}
