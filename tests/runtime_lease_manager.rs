//! The lease manager on paused tokio time, against a scripted allocator that
//! grants, refuses, fails, hangs or panics on cue and records every call, and
//! against the memory store end to end: cold start, the low-water doorbell,
//! rotation with quiescent release, consolidation, the per-variant handling
//! of release refusals, fail-closed refusals, time bounds on every store call
//! and on shutdown, and the ledger after a run (I2, I5, I6, I7, I14, I15,
//! I17, I18, I22, I25, I26, I27, I28).

mod support;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use jiff::{SignedDuration, Timestamp};
use tokio::sync::{Notify, watch};
use tokio::time::{Instant, sleep};
use tollgate::admission::LeaseSlot;
use tollgate::runtime::{
    AccountLeaseConfig, LeaseHealth, LeaseManager, LeaseManagerConfig, LeaseManagerConfigError,
    LeaseManagerReport, LeaseStats,
};
use tollgate::store::{
    AccountSpec, AllocateError, Allocation, Clock, GrantPolicy, LeaseAllocator, ManualClock,
    MemoryStore, ReclaimBatch, Released, StoreError, TailSharing, UsageSink,
};
use tollgate::{
    AccountId, AccountStatus, BalanceExhaustion, BalanceShortfall, CommitFunding, CostUnits,
    DenyReason, EnforcementMode, FencingToken, LeaseGrant, LeaseId, LocalLease, LocalSharding,
    PolicyRevision, RequestId, Reservation,
};

const ACCOUNT: AccountId = AccountId(1);
const TARGET: u64 = 100;
const LOW_WATER: u64 = 20;
const TTL: SignedDuration = SignedDuration::from_secs(60);
const MARGIN: SignedDuration = SignedDuration::from_secs(5);
const POLL: Duration = Duration::from_secs(10);
const CALL_TIMEOUT: Duration = Duration::from_millis(500);
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(3);

fn config() -> LeaseManagerConfig {
    LeaseManagerConfig {
        account: ACCOUNT,
        target_grant: CostUnits(TARGET),
        low_water: CostUnits(LOW_WATER),
        lease_ttl: TTL,
        expiry_safety_margin: MARGIN,
        poll_interval: POLL,
        store_call_timeout: CALL_TIMEOUT,
        shutdown_release_deadline: SHUTDOWN_DEADLINE,
    }
}

fn start() -> Timestamp {
    Timestamp::from_second(1_700_000_000).expect("a test instant is in range")
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn storage_error() -> AllocateError {
    AllocateError::Storage(StoreError::new("scripted outage"))
}

/// An acquire refused because the balance is spent until `period_end`.
fn exhausted(period_end: Option<Timestamp>) -> Reply {
    Reply::Refuse(AllocateError::BalanceExhausted(BalanceExhaustion {
        period_end,
    }))
}

/// One allocator call as the scripted allocator saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    /// A grant of up to `requested`, and at least `needed`.
    Acquire {
        requested: u64,
        needed: u64,
    },
    Release {
        lease: u64,
        unspent: u64,
    },
    Consolidate {
        lease: u64,
        unspent: u64,
        requested: u64,
        needed: u64,
    },
}

fn acquire() -> Call {
    Call::Acquire {
        requested: TARGET,
        needed: 0,
    }
}

fn release(lease: u64, unspent: u64) -> Call {
    Call::Release { lease, unspent }
}

/// One planned answer.
#[derive(Debug, Clone)]
enum Reply {
    /// Grant a new lease of this many units (the next lease id), or, for a
    /// release, settle it.
    Grant(u64),
    /// Grant with funding evidence attached.
    GrantShort(u64, BalanceShortfall),
    /// Grant a lease of another account: a store bug.
    GrantElsewhere(u64),
    Refuse(AllocateError),
    /// Settle a release, crediting this many units whatever was claimed.
    Credit(u64),
    /// Never answer: a wedged backend.
    Hang,
    /// Wait for the gate to open, then answer.
    Gated(Arc<Notify>, Box<Reply>),
    Panic,
    /// Install a lease with this id into the slot, as a concurrent
    /// publisher would, then answer.
    PublishThen(u64, Box<Reply>),
}

/// Answers from per-method scripts and records every call with the paused
/// time it arrived at. When a script runs out: acquires and consolidations
/// grant `TARGET` units, releases settle.
struct Scripted {
    acquire: Mutex<VecDeque<Reply>>,
    consolidate: Mutex<VecDeque<Reply>>,
    release: Mutex<HashMap<u64, VecDeque<Reply>>>,
    next_lease: AtomicU64,
    calls: Mutex<Vec<(Duration, Call)>>,
    count: watch::Sender<usize>,
    began: Instant,
    slot: Mutex<Option<Arc<LeaseSlot>>>,
    /// For each call, the remainder the slot's evidence showed as it came
    /// (with a slot to watch).
    shown_at_calls: Mutex<Vec<Option<u64>>>,
}

impl Scripted {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            acquire: Mutex::new(VecDeque::new()),
            consolidate: Mutex::new(VecDeque::new()),
            release: Mutex::new(HashMap::new()),
            next_lease: AtomicU64::new(1),
            calls: Mutex::new(Vec::new()),
            count: watch::Sender::new(0),
            began: Instant::now(),
            slot: Mutex::new(None),
            shown_at_calls: Mutex::new(Vec::new()),
        })
    }

    fn plan_acquires(&self, replies: impl IntoIterator<Item = Reply>) {
        lock(&self.acquire).extend(replies);
    }

    fn plan_consolidations(&self, replies: impl IntoIterator<Item = Reply>) {
        lock(&self.consolidate).extend(replies);
    }

    fn plan_releases(&self, lease: u64, replies: impl IntoIterator<Item = Reply>) {
        lock(&self.release)
            .entry(lease)
            .or_default()
            .extend(replies);
    }

    fn calls(&self) -> Vec<Call> {
        lock(&self.calls)
            .iter()
            .map(|(_, call)| call.clone())
            .collect()
    }

    /// Every call with the paused time since the allocator was made.
    fn timed_calls(&self) -> Vec<(Duration, Call)> {
        lock(&self.calls).clone()
    }

    /// When each call arrived, since the harness started.
    fn call_times(&self) -> Vec<Duration> {
        lock(&self.calls).iter().map(|(at, _)| *at).collect()
    }

    /// Waits (letting paused time run) until `n` calls have arrived.
    async fn calls_reach(&self, n: usize) {
        let mut count = self.count.subscribe();
        tokio::time::timeout(secs(3_600), count.wait_for(|seen| *seen >= n))
            .await
            .unwrap_or_else(|_| panic!("call {n} never came; calls: {:?}", self.calls()))
            .expect("the allocator owns the sender");
    }

    fn record(&self, call: Call) {
        let shown = lock(&self.slot)
            .as_ref()
            .and_then(|slot| slot.published_funding())
            .map(|evidence| evidence.remaining.get());
        lock(&self.shown_at_calls).push(shown);
        lock(&self.calls).push((self.began.elapsed(), call));
        self.count.send_modify(|count| *count += 1);
    }

    fn grant(&self, units: u64, ttl: SignedDuration, now: Timestamp) -> LeaseGrant {
        let id = self.next_lease.fetch_add(1, Ordering::SeqCst);
        LeaseGrant {
            lease_id: LeaseId(id),
            account_id: ACCOUNT,
            fencing_token: FencingToken(id + 500),
            units: CostUnits(units),
            expires_at: now + ttl,
        }
    }

    async fn allocation(
        &self,
        reply: Reply,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        match self.resolve(reply).await {
            Reply::Grant(units) => Ok(Allocation {
                grant: self.grant(units, ttl, now),
                funding: None,
            }),
            Reply::GrantShort(units, funding) => Ok(Allocation {
                grant: self.grant(units, ttl, now),
                funding: Some(funding),
            }),
            Reply::GrantElsewhere(units) => Ok(Allocation {
                grant: LeaseGrant {
                    account_id: AccountId(ACCOUNT.get() + 1),
                    ..self.grant(units, ttl, now)
                },
                funding: None,
            }),
            Reply::Refuse(error) => Err(error),
            other => unreachable!("resolved replies are answers, not {other:?}"),
        }
    }

    /// Acts out hangs, panics and publications; returns the answer left.
    async fn resolve(&self, reply: Reply) -> Reply {
        match reply {
            Reply::Hang => std::future::pending().await,
            Reply::Panic => panic!("scripted allocator panic"),
            Reply::Gated(gate, then) => {
                gate.notified().await;
                Box::pin(self.resolve(*then)).await
            }
            Reply::PublishThen(lease, then) => {
                let slot = lock(&self.slot).clone().expect("publish needs a slot");
                let published = LocalLease::new(
                    LeaseGrant {
                        lease_id: LeaseId(lease),
                        account_id: ACCOUNT,
                        fencing_token: FencingToken(lease + 500),
                        units: CostUnits(TARGET),
                        expires_at: start() + TTL,
                    },
                    CostUnits(LOW_WATER),
                );
                assert!(
                    slot.replace(Arc::new(published)).is_none(),
                    "the scripts publish only into an emptied slot"
                );
                Box::pin(self.resolve(*then)).await
            }
            answer => answer,
        }
    }
}

#[async_trait]
impl LeaseAllocator for Scripted {
    async fn acquire_at_least(
        &self,
        _account: AccountId,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        self.record(Call::Acquire {
            requested: requested.get(),
            needed: needed.get(),
        });
        let reply = lock(&self.acquire)
            .pop_front()
            .unwrap_or(Reply::Grant(TARGET));
        self.allocation(reply, ttl, now).await
    }

    async fn release(
        &self,
        lease_id: LeaseId,
        _fencing_token: FencingToken,
        unspent: CostUnits,
        _now: Timestamp,
    ) -> Result<Released, AllocateError> {
        self.record(Call::Release {
            lease: lease_id.get(),
            unspent: unspent.get(),
        });
        let reply = lock(&self.release)
            .get_mut(&lease_id.get())
            .and_then(VecDeque::pop_front)
            .unwrap_or(Reply::Grant(0));
        match self.resolve(reply).await {
            Reply::Grant(_) => Ok(Released { credited: unspent }),
            Reply::Credit(units) => Ok(Released {
                credited: CostUnits(units),
            }),
            Reply::Refuse(error) => Err(error),
            other => unreachable!("a release answers a grant or a refusal, not {other:?}"),
        }
    }

    async fn consolidate(
        &self,
        lease_id: LeaseId,
        _fencing_token: FencingToken,
        unspent: CostUnits,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        self.record(Call::Consolidate {
            lease: lease_id.get(),
            unspent: unspent.get(),
            requested: requested.get(),
            needed: needed.get(),
        });
        let reply = lock(&self.consolidate)
            .pop_front()
            .unwrap_or(Reply::Grant(TARGET));
        self.allocation(reply, ttl, now).await
    }

    async fn reclaim_expired_batch(
        &self,
        _now: Timestamp,
        _limit: usize,
    ) -> Result<ReclaimBatch, StoreError> {
        unreachable!("the lease manager never reclaims")
    }
}

struct Harness {
    allocator: Arc<Scripted>,
    slot: Arc<LeaseSlot>,
    clock: Arc<ManualClock>,
    manager: Option<LeaseManager>,
}

impl Harness {
    fn start(allocator: Arc<Scripted>) -> Self {
        Self::start_with(allocator, config())
    }

    /// [`start`](Self::start) with another configuration.
    fn start_with(allocator: Arc<Scripted>, config: LeaseManagerConfig) -> Self {
        let slot = Arc::new(LeaseSlot::new(ACCOUNT, LocalSharding::Single));
        *lock(&allocator.slot) = Some(Arc::clone(&slot));
        let clock = Arc::new(ManualClock::new(start()));
        let manager = LeaseManager::spawn(
            Arc::clone(&allocator) as Arc<dyn LeaseAllocator>,
            Arc::clone(&slot),
            Arc::clone(&clock) as Arc<dyn Clock>,
            config,
        )
        .expect("the test configuration is valid");
        Self {
            allocator,
            slot,
            clock,
            manager: Some(manager),
        }
    }

    /// Starts, and waits for the cold-start acquire to be answered.
    async fn started(allocator: Arc<Scripted>) -> Self {
        Self::started_with(allocator, config()).await
    }

    /// [`started`](Self::started) with another configuration.
    async fn started_with(allocator: Arc<Scripted>, config: LeaseManagerConfig) -> Self {
        let harness = Self::start_with(allocator, config);
        harness.allocator.calls_reach(1).await;
        settle().await;
        harness
    }

    fn manager(&self) -> &LeaseManager {
        self.manager.as_ref().expect("the manager is running")
    }

    async fn shutdown(&mut self) -> LeaseManagerReport {
        self.manager
            .take()
            .expect("shut down once")
            .shutdown()
            .await
    }

    fn now(&self) -> Timestamp {
        self.clock.now()
    }

    /// Moves the manual clock and tokio's time forward together, a second
    /// at a time, letting the manager act at each second.
    async fn run_for(&self, seconds: u64) {
        for _ in 0..seconds {
            self.clock.advance(SignedDuration::from_secs(1));
            tokio::time::advance(secs(1)).await;
            settle().await;
        }
    }

    /// The serving lease's id and remaining units.
    fn serving(&self) -> Option<(u64, u64)> {
        self.slot
            .load_observed()
            .map(|lease| (lease.grant().lease_id.get(), lease.remaining().get()))
    }

    fn ready(&self) -> bool {
        *self.manager().readiness().borrow()
    }

    fn stats(&self) -> LeaseStats {
        self.manager().stats()
    }

    /// A pending reservation on the serving lease, as an admitted request
    /// holds one.
    #[track_caller]
    fn reserve(&self, units: u64) -> Reservation {
        let now = self.now();
        self.slot
            .with_lease(|lease| {
                Reservation::reserve(lease.expect("a lease serves"), CostUnits(units), now)
            })
            .expect("the serving lease funds the reservation")
    }

    /// A request that runs: reserved, committed, done.
    #[track_caller]
    fn spend(&self, units: u64) {
        let mut reservation = self.reserve(units);
        reservation
            .commit_owned(self.now(), CommitFunding::LeaseOnly)
            .expect("commits inside the window");
    }

    /// Spends the serving lease down to 30 units, has it refuse a quote of
    /// 50, and waits for the fold that asks for (the allocator's second
    /// call) to be made.
    async fn fold_a_refused_quote(&self) {
        self.spend(70);
        self.refused(50);
        self.allocator.calls_reach(2).await;
        settle().await;
    }

    /// A quote the serving lease cannot fund.
    #[track_caller]
    fn refused(&self, units: u64) {
        let now = self.now();
        let refusal = self
            .slot
            .with_lease(|lease| {
                Reservation::reserve(lease.expect("a lease serves"), CostUnits(units), now)
            })
            .expect_err("the quote is more than the lease holds");
        assert_eq!(refusal, DenyReason::LeaseExhausted);
    }
}

/// Lets the manager task run whatever is ready, without moving paused time.
async fn settle() {
    for _ in 0..32 {
        tokio::task::yield_now().await;
    }
}

/// Lease 1 is drained to low water (keeping `held` of it reserved) so the
/// manager rotates to lease 2 and parks lease 1.
async fn rotate_once(h: &Harness, spent: u64) {
    let before = h.allocator.calls().len();
    h.spend(spent);
    h.allocator.calls_reach(before + 1).await;
    settle().await;
}

// ---------------------------------------------------------------- refill

/// The first inspection runs at spawn: no poll interval passes before the
/// cold slot is stocked.
#[tokio::test(start_paused = true)]
async fn a_cold_start_acquires_at_once_without_waiting_for_a_poll() {
    let h = Harness::started(Scripted::new()).await;

    assert_eq!(h.allocator.timed_calls(), [(Duration::ZERO, acquire())]);
    assert_eq!(h.serving(), Some((1, 100)));
    assert!(h.ready());
    assert_eq!(h.manager().health(), LeaseHealth::Serving);
    assert_eq!(h.manager().account(), ACCOUNT);
    let stats = h.stats();
    assert_eq!((stats.acquired, stats.acquired_units), (1, 100));

    let lease = h.slot.load_observed().expect("installed");
    assert_eq!(lease.low_water(), CostUnits(LOW_WATER));
    // I2: the window closes a margin before the grant expires.
    assert_eq!(lease.usable_until(), start() + TTL - MARGIN);
    drop(lease);

    sleep(POLL * 3).await;
    assert_eq!(
        h.allocator.calls(),
        [acquire()],
        "an idle lease costs no calls"
    );
}

/// I7, I28: a grant at or below the low-water mark (the allocator shrank it
/// near the end of a balance) gets no mark: with the configured one it
/// would be due for replacement as soon as it was installed, and with any
/// mark inside it, a debit or two would order the next slice and park its
/// remainder, stranded until it quiesced, while the account still has the
/// units. It serves until drained, and the debit that drains it rings at
/// once.
#[tokio::test(start_paused = true)]
async fn a_grant_at_or_below_the_low_water_mark_serves_until_drained() {
    for granted in [LOW_WATER - 5, LOW_WATER] {
        let allocator = Scripted::new();
        allocator.plan_acquires([Reply::Grant(granted)]);
        let h = Harness::started(allocator).await;
        assert_eq!(h.serving(), Some((1, granted)), "{granted}");
        let lease = h.slot.load_observed().expect("installed");
        assert_eq!(lease.low_water(), CostUnits::ZERO, "{granted}");
        drop(lease);

        sleep(POLL * 3).await;
        h.spend(granted - 1);
        sleep(POLL).await;
        assert_eq!(
            h.allocator.calls(),
            [acquire()],
            "{granted}: with a unit left it is not replaced, so nothing is parked"
        );
        h.spend(1);
        h.allocator.calls_reach(2).await;
        settle().await;
        assert_eq!(
            h.allocator.timed_calls(),
            [(Duration::ZERO, acquire()), (POLL * 4, acquire())],
            "{granted}: the debit that drains it rings"
        );
        assert_eq!(h.serving(), Some((2, TARGET)), "{granted}");
    }
}

/// I7, I28: the debit that reaches low water rings the doorbell, and the
/// replacement is acquired at that instant, not at the next poll.
#[tokio::test(start_paused = true)]
async fn a_debit_reaching_low_water_rings_for_a_replacement_before_the_poll() {
    let h = Harness::started(Scripted::new()).await;

    sleep(secs(1)).await;
    h.spend(80);
    h.allocator.calls_reach(2).await;
    settle().await;

    assert_eq!(
        h.allocator.timed_calls(),
        [(Duration::ZERO, acquire()), (secs(1), acquire())],
        "the ring at 1s is answered at 1s; the poll would have come at 10s"
    );
    assert_eq!(h.serving(), Some((2, 100)));

    // The superseded lease is quiescent, so the next poll returns its
    // exact remainder (I6).
    h.allocator.calls_reach(3).await;
    assert_eq!(h.allocator.timed_calls()[2], (secs(11), release(1, 20)));
    let stats = h.stats();
    assert_eq!((stats.released, stats.released_units), (1, 20));
}

/// Expiry rings no doorbell: the poll notices it, parks the lease, returns
/// its remainder while the allocator still holds it, then acquires (I2).
#[tokio::test(start_paused = true)]
async fn an_expired_lease_is_retired_at_the_next_poll_and_released_before_the_replacement() {
    let h = Harness::started(Scripted::new()).await;
    h.spend(30);
    h.clock.advance(TTL - MARGIN);
    assert_eq!(
        h.manager().health(),
        LeaseHealth::Unfunded,
        "health reads the window live"
    );

    h.allocator.calls_reach(3).await;
    settle().await;

    assert_eq!(
        h.allocator.timed_calls(),
        [
            (Duration::ZERO, acquire()),
            (POLL, release(1, 70)),
            (POLL, acquire()),
        ]
    );
    assert_eq!(h.serving(), Some((2, 100)));
    assert!(h.ready());
}

/// I23: while an expired serving lease is parked, the evidence read
/// against the empty slot counts its units, which its release returns to
/// the balance: left out, the evidence would rule out a quote they fund
/// (402, never retry).
#[tokio::test(start_paused = true)]
async fn an_expired_lease_is_parked_with_its_units_counted_in_the_evidence() {
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::GrantShort(
        TARGET,
        BalanceShortfall {
            remaining: CostUnits(5),
            period_end: None,
        },
    )]);
    let Watched {
        slot: _,
        clock,
        watching,
        manager,
    } = Watched::started(&allocator).await;
    clock.advance(TTL - MARGIN);
    watching.armed.store(true, Ordering::SeqCst);
    allocator.calls_reach(3).await;
    settle().await;
    assert_eq!(allocator.calls()[1], release(1, 100));
    assert!(
        watching.saw_empty.load(Ordering::SeqCst),
        "the clock was read while the slot was empty"
    );
    assert_eq!(
        lock(&allocator.shown_at_calls)[1],
        Some(105),
        "shown as soon as the lease was parked: the balance's 5 and its 100"
    );
    assert_eq!(
        watching.least_evidence_without_lease.load(Ordering::SeqCst),
        105,
        "the same after its release"
    );
    drop(manager);
}

/// I23, I27: a fold refused for a reason that brings no evidence (a
/// suspended account) changed nothing the withdrawn evidence described, so
/// that evidence is published again with the lease.
#[tokio::test(start_paused = true)]
async fn a_fold_refused_without_evidence_puts_the_withdrawn_evidence_back() {
    let shown = BalanceShortfall {
        remaining: CostUnits(500),
        period_end: None,
    };
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::GrantShort(TARGET, shown)]);
    allocator.plan_consolidations([Reply::Refuse(AllocateError::AccountInactive)]);
    let h = Harness::started(allocator).await;
    assert_eq!(h.slot.funding_evidence(h.now()), Some(shown));
    h.fold_a_refused_quote().await;
    assert!(matches!(h.allocator.calls()[1], Call::Consolidate { .. }));
    assert_eq!(h.serving(), Some((1, 30)), "the lease is back");
    assert_eq!(h.slot.funding_evidence(h.now()), Some(shown));
}

/// I28: expiry rings no doorbell, so a lease whose window would close
/// before the next poll (plus one store call) is replaced at this poll,
/// while it still serves: requests never meet a lapsed lease in between.
#[tokio::test(start_paused = true)]
async fn a_lease_near_the_end_of_its_window_is_replaced_before_it_closes() {
    let h = Harness::started(Scripted::new()).await;
    h.spend(30);
    // At the next poll the window has one poll interval left (the store's
    // clock is not tokio's): by the poll after, it would have closed.
    h.clock
        .advance(TTL - MARGIN - SignedDuration::try_from(POLL).unwrap());
    h.allocator.calls_reach(3).await;
    settle().await;
    assert_eq!(
        h.allocator.timed_calls(),
        [
            (Duration::ZERO, acquire()),
            (POLL, acquire()),
            (POLL * 2, release(1, 70)),
        ],
        "replaced, then released with its exact remainder at the next pass"
    );
    assert_eq!(h.serving(), Some((2, 100)));
    assert!(h.ready());
}

/// I28: leases granted together are not replaced together. Each is
/// replaced up to a quarter of its slack (its window before the
/// replacement lead) early, by a share its id decides, so the leases every
/// account took at start, or after an outage, are not all renewed at the
/// same moment, one lease's life later and at every life after.
#[tokio::test(start_paused = true)]
async fn leases_are_replaced_early_by_a_share_of_their_slack_their_ids_decide() {
    let config = LeaseManagerConfig {
        poll_interval: secs(1),
        ..config()
    };
    let lead = config.replacement_lead();
    let h = Harness::started_with(Scripted::new(), config).await;
    // Whole seconds: the manager looks once a second.
    let window = (TTL - MARGIN).as_secs_f64();
    let slack = window - lead.as_secs_f64();
    let (mut serving, mut since, mut ages) = (1, 0_u32, Vec::new());
    for second in 1..=600_u32 {
        h.run_for(1).await;
        let (id, _) = h.serving().expect("a lease always serves");
        if id != serving {
            ages.push(second - since);
            (serving, since) = (id, second);
        }
    }
    assert!(ages.len() >= 10, "{ages:?}");
    for &age in &ages {
        let early = slack - f64::from(age);
        assert!(
            (-1.0..=slack / 4.0).contains(&early),
            "replaced at {age} s of a {window} s window: {ages:?}"
        );
    }
    let (first, last) = (ages.iter().min().unwrap(), ages.iter().max().unwrap());
    assert!(
        f64::from(last - first) >= slack / 8.0,
        "replaced at ages {ages:?}: not spread over the slack of {slack} s"
    );
}

/// I28: an early replacement the store refuses with an answer (the account
/// is spent) is not asked again at every poll of the spread: the store
/// would answer the same, each time on the account's row lock. The lease
/// is replaced, or let close, from the plain replacement lead, as before
/// the spread.
#[tokio::test(start_paused = true)]
async fn a_refused_early_replacement_waits_for_the_plain_lead() {
    let config = LeaseManagerConfig {
        poll_interval: secs(1),
        ..config()
    };
    let allocator = Scripted::new();
    // Lease 3 comes due some twelve seconds early (see the test above).
    allocator.next_lease.store(3, Ordering::SeqCst);
    allocator.plan_acquires([Reply::Grant(TARGET)]);
    allocator.plan_acquires((0..40).map(|_| exhausted(None)));
    let h = Harness::started_with(allocator, config).await;
    h.run_for(40).await;
    assert_eq!(h.allocator.calls(), [acquire()], "not due yet");
    h.run_for(14).await;
    let asked = h.allocator.calls().len() - 1;
    assert!(
        (1..=3).contains(&asked),
        "refused replacements asked in the window's last 14 s: {asked}"
    );
}

/// A replaced lease keeps serving the reservations taken on it; it is
/// released only once the last one resolves, with exactly what is left
/// (I6, I15, I26).
#[tokio::test(start_paused = true)]
async fn a_replaced_lease_serves_its_reservations_and_is_released_with_its_exact_remainder_after() {
    let h = Harness::started(Scripted::new()).await;
    let mut committing = h.reserve(30);
    let cancelled = h.reserve(10);
    rotate_once(&h, 45).await;
    assert_eq!(h.serving(), Some((2, 100)), "rotated at low water");

    // The request holding 30 starts executing after the rotation: its
    // lease, though parked, still commits it.
    committing
        .commit_owned(h.now(), CommitFunding::LeaseOnly)
        .expect("a parked lease inside its window still commits");
    sleep(POLL * 3 + secs(1)).await;
    assert_eq!(
        h.allocator.calls(),
        [acquire(), acquire()],
        "I26: never released while a reservation holds it"
    );
    assert_eq!(h.stats().released, 0);

    drop(committing);
    drop(cancelled);
    h.allocator.calls_reach(3).await;
    // 100 granted, 45 + 30 committed, 10 released for zero.
    assert_eq!(h.allocator.calls()[2], release(1, 25));
    assert_eq!(h.stats().released_units, 25);
}

/// I26: a request that has read the serving lease but not yet debited it
/// holds only the lease itself, no shard: a lease rotated out meanwhile is
/// not released until it lets go, or its debit could land after the
/// release claimed the remainder.
#[tokio::test(start_paused = true)]
async fn a_request_holding_the_lease_before_its_debit_keeps_it_from_release() {
    let h = Harness::started(Scripted::new()).await;
    let reading = h.slot.load_observed().expect("a lease serves");
    rotate_once(&h, 85).await;
    assert_eq!(h.serving(), Some((2, 100)), "rotated at low water");
    sleep(POLL * 3 + secs(1)).await;
    assert_eq!(
        h.allocator.calls(),
        [acquire(), acquire()],
        "I26: never released while a request holds the lease"
    );
    drop(reading);
    h.allocator.calls_reach(3).await;
    assert_eq!(h.allocator.calls()[2], release(1, 15));
}

// --------------------------------------------------------- consolidation

/// A refused quote rings; the lease's unspent units and the quote go to the
/// allocator in one consolidation, and the larger grant serves (I18, I27).
#[tokio::test(start_paused = true)]
async fn a_refused_quote_folds_the_unspent_units_into_one_grant_large_enough_for_it() {
    let allocator = Scripted::new();
    allocator.plan_consolidations([Reply::Grant(150)]);
    let h = Harness::started(allocator).await;
    h.spend(70);
    sleep(secs(1)).await;
    h.refused(50);
    h.refused(40);
    h.allocator.calls_reach(2).await;
    settle().await;

    assert_eq!(
        h.allocator.timed_calls(),
        [
            (Duration::ZERO, acquire()),
            (
                secs(1),
                Call::Consolidate {
                    lease: 1,
                    unspent: 30,
                    requested: 130,
                    needed: 50,
                }
            ),
        ]
    );
    assert_eq!(h.serving(), Some((2, 150)));
    let stats = h.stats();
    assert_eq!(stats.consolidated, 1);
    assert_eq!((stats.acquired, stats.acquired_units), (2, 250));
    assert_eq!((stats.released, stats.released_units), (1, 30));
    let lease = h.slot.load_observed().expect("installed");
    assert_eq!(
        lease.low_water(),
        CostUnits(50),
        "marked for the quote it was folded for"
    );
    drop(lease);
    h.spend(90);

    sleep(POLL * 3).await;
    assert_eq!(
        h.allocator.calls().len(),
        2,
        "the folded lease was settled by the consolidation; it is never released"
    );
}

/// I27, I28: while a fold waits on a reservation in flight, and the
/// allocator's last word rules the refused quote out, the lease is not
/// rotated for the quote; but once it drains below low water it is still
/// replaced, so one long request and one unfundable quote cannot starve the
/// account.
#[tokio::test(start_paused = true)]
async fn a_waiting_consolidation_still_replaces_a_draining_lease() {
    // Ten units beyond the lease: the lease and the balance together could
    // fund the quote, the balance alone cannot, so it is kept but not
    // chased.
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::GrantShort(
        TARGET,
        BalanceShortfall {
            remaining: CostUnits(10),
            period_end: None,
        },
    )]);
    let h = Harness::started(allocator).await;
    let held = h.reserve(10);
    h.refused(95);
    settle().await;
    assert_eq!(h.stats().consolidations_deferred, 1);
    assert_eq!(h.allocator.calls(), [acquire()], "no grant chased for it");
    assert_eq!(h.serving(), Some((1, 90)));

    // Below low water: the doorbell rings, the fold waits again, and a
    // replacement is acquired at once instead of at the held request's end.
    h.spend(75);
    settle().await;
    assert_eq!(h.stats().consolidations_deferred, 2);
    assert_eq!(h.allocator.calls(), [acquire(), acquire()]);
    assert_eq!(h.serving(), Some((2, TARGET)), "a fresh lease serves");
    h.spend(50);

    // The old lease, parked, is released once its last request lets go;
    // that request ended unexecuted, so its 10 units come back too (I4).
    drop(held);
    h.allocator.calls_reach(3).await;
    assert_eq!(h.allocator.calls()[2], release(1, 25));
}

/// I6, I27, I28: a lease with a reservation in flight has no exact unspent
/// count, so it cannot be folded; rather than refuse the quote until the
/// lease is quiet (under steady traffic it never is), the manager acquires a
/// replacement large enough for the quote beside it, and releases the old
/// lease, with its exact remainder, once its last request lets go.
#[tokio::test(start_paused = true)]
async fn a_consolidation_deferred_by_a_reservation_in_flight_rotates_instead() {
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::Grant(TARGET), Reply::Grant(175)]);
    let h = Harness::started(allocator).await;
    let held = h.reserve(10);
    h.refused(95);
    settle().await;

    assert_eq!(
        h.allocator.calls(),
        [
            acquire(),
            Call::Acquire {
                requested: 175,
                needed: 95
            }
        ],
        "no fold on an inexact count: a replacement instead, sized for the \
         quote (I27)"
    );
    assert_eq!(h.stats().consolidations_deferred, 1);
    assert_eq!(h.stats().consolidated, 0);
    assert_eq!(
        h.serving(),
        Some((2, 175)),
        "the replacement serves, and funds the quote"
    );
    drop(h.reserve(95));

    sleep(POLL + secs(1)).await;
    let released_first = |calls: &[Call]| calls.contains(&release(1, 100));
    assert!(
        !released_first(&h.allocator.calls()),
        "the old lease is still held"
    );
    drop(held);
    sleep(POLL + secs(1)).await;
    assert!(
        released_first(&h.allocator.calls()),
        "its 90 unspent and the 10 the unexecuted request gave back: {:?}",
        h.allocator.calls()
    );
}

/// I27, I28: a refused quote larger than the target grant is chased with a
/// replacement sized for the quote, not the target: the quote, and the
/// configured span between rotations above it.
#[tokio::test(start_paused = true)]
async fn a_rotation_for_a_refused_quote_asks_for_the_quote() {
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::Grant(TARGET), Reply::Grant(150)]);
    let h = Harness::started(allocator).await;
    let held = h.reserve(10);
    h.refused(150);
    settle().await;
    assert_eq!(
        h.allocator.calls(),
        [
            acquire(),
            Call::Acquire {
                requested: 230,
                needed: 150
            }
        ]
    );
    assert_eq!(h.serving(), Some((2, 150)));
    drop(h.reserve(150));
    drop(held);
}

/// I27, I28: a replacement for a refused quote that comes back smaller than
/// the quote (from an allocator that ignores the floor it was asked for) is
/// used, but the quote is not chased again: the next deferred fold waits for
/// the lease to quiesce and folds it, instead of splitting the account's
/// funds into ever smaller leases.
#[tokio::test(start_paused = true)]
async fn a_rotation_that_falls_short_of_the_quote_is_not_repeated() {
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::Grant(TARGET), Reply::Grant(60)]);
    let h = Harness::started(allocator).await;
    let first = h.reserve(10);
    h.refused(150);
    settle().await;
    assert_eq!(
        h.allocator.calls(),
        [
            acquire(),
            Call::Acquire {
                requested: 230,
                needed: 150
            }
        ]
    );
    assert_eq!(h.serving(), Some((2, 60)), "the short grant serves");

    let second = h.reserve(5);
    h.refused(150);
    settle().await;
    sleep(POLL * 2).await;
    assert_eq!(h.allocator.calls().len(), 2, "no second chase");
    assert!(h.stats().consolidations_deferred >= 2);

    drop(second);
    h.allocator.calls_reach(3).await;
    assert_eq!(
        h.allocator.calls()[2],
        Call::Consolidate {
            lease: 2,
            unspent: 60,
            requested: 230,
            needed: 150,
        }
    );
    drop(first);
}

/// I27: a quote a lease refused sizes later leases only once a grant
/// covers it. A replacement chased for it that comes back short (from an
/// allocator that ignores the floor) leaves leases sized as configured; once
/// one covers it, every later lease is marked at the quote, ringing once
/// it may no longer fund one, and asks for the mark and the configured
/// span between rotations.
#[tokio::test(start_paused = true)]
async fn only_a_grant_that_covers_a_chased_quote_marks_later_leases_for_it() {
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::Grant(TARGET), Reply::Grant(40)]);
    let h = Harness::started(allocator).await;
    let mark = || h.slot.load_observed().map(|lease| lease.low_water().get());

    h.spend(45);
    let first = h.reserve(10);
    h.refused(60);
    settle().await;
    assert_eq!(h.serving(), Some((2, 40)), "the short grant serves");
    assert_eq!(mark(), Some(LOW_WATER), "not learnt: the grant fell short");
    // Drained, it is replaced by a plain grant, marked as configured.
    h.spend(40);
    settle().await;
    assert_eq!(h.serving(), Some((3, TARGET)));
    assert_eq!(mark(), Some(LOW_WATER));

    // That grant showed no shortfall, so the quote is chased again, and
    // this time covered.
    h.spend(35);
    let second = h.reserve(10);
    h.refused(60);
    settle().await;
    assert_eq!(h.serving(), Some((4, TARGET)));
    assert_eq!(mark(), Some(60), "learnt: the grant covers it");
    // Every later lease is marked alike: at 60 left it rings.
    h.spend(40);
    settle().await;
    assert_eq!(h.serving(), Some((5, TARGET)));
    assert_eq!(mark(), Some(60));
    let acquires: Vec<_> = h
        .allocator
        .calls()
        .into_iter()
        .filter(|call| matches!(call, Call::Acquire { .. }))
        .collect();
    assert_eq!(
        acquires,
        [
            Call::Acquire {
                requested: 100,
                needed: 0
            },
            Call::Acquire {
                requested: 140,
                needed: 60
            },
            Call::Acquire {
                requested: 100,
                needed: 0
            },
            Call::Acquire {
                requested: 140,
                needed: 60
            },
            Call::Acquire {
                requested: 140,
                needed: 0
            },
        ],
        "a chase, and once learnt every grant, asks for the quote and the \
         configured span between rotations (80)"
    );
    drop((first, second));
}

/// I27: a busy lease refused a quote the balance alone cannot fund, but
/// the balance and the lease's own units together can. It is not chased
/// (a replacement comes from the balance alone), nor forgotten (admission
/// would record it again at every request): it waits for a fold at the
/// lease's first quiet moment.
#[tokio::test(start_paused = true)]
async fn a_quote_the_lease_and_the_balance_fund_together_waits_for_a_fold() {
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::GrantShort(
        TARGET,
        BalanceShortfall {
            remaining: CostUnits(30),
            period_end: None,
        },
    )]);
    let h = Harness::started(allocator).await;
    h.spend(40);
    let busy = h.reserve(10);
    h.refused(70);
    settle().await;
    assert_eq!(h.stats().consolidations_deferred, 1);
    assert_eq!(h.allocator.calls(), [acquire()], "not chased");
    let lease = h.slot.load_observed().expect("serving");
    assert_eq!(
        lease.largest_refused_quote(),
        CostUnits(70),
        "not forgotten"
    );
    drop(lease);
    drop(busy);
    h.allocator.calls_reach(2).await;
    assert_eq!(
        h.allocator.calls()[1],
        Call::Consolidate {
            lease: 1,
            unspent: 60,
            requested: 150,
            needed: 70,
        }
    );
}

/// I27: a replacement that fell short of a quote stops the chase only
/// until the account shows funds again: a grant that covers all it was
/// asked for (after a top-up, say) lets the next refusal be chased.
#[tokio::test(start_paused = true)]
async fn a_grant_that_shows_funds_again_lets_a_short_rotation_be_retried() {
    let allocator = Scripted::new();
    let tail = BalanceShortfall {
        remaining: CostUnits::ZERO,
        period_end: None,
    };
    allocator.plan_acquires([
        Reply::Grant(TARGET),
        Reply::GrantShort(60, tail),
        Reply::Grant(TARGET),
    ]);
    let h = Harness::started(allocator).await;
    let busy = h.reserve(10);
    h.refused(150);
    settle().await;
    assert_eq!(h.serving(), Some((2, 60)), "the short grant serves");

    // The account is topped up; a plain replacement shows it.
    h.spend(45);
    settle().await;
    assert_eq!(h.serving(), Some((3, TARGET)));
    assert_eq!(h.slot.funding_evidence(h.now()), None);

    let busy_again = h.reserve(10);
    h.refused(150);
    settle().await;
    let chases = h
        .allocator
        .calls()
        .into_iter()
        .filter(|call| {
            *call
                == Call::Acquire {
                    requested: 230,
                    needed: 150,
                }
        })
        .count();
    assert_eq!(chases, 2, "chased again: {:?}", h.allocator.calls());
    drop((busy, busy_again));
}

/// I18, I27: a domain refusal rolled the consolidation back, so the old lease is
/// still active and ours: it goes back into the slot, the refusal's evidence
/// is published, and the fold is tried again at the next poll.
#[tokio::test(start_paused = true)]
async fn a_domain_refusal_of_a_consolidation_puts_the_old_lease_back_and_publishes_evidence() {
    let period_end = start() + SignedDuration::from_hours(1);
    for error in [
        // What the fold could have granted: 7 on the balance and the 30 the
        // lease would have returned.
        AllocateError::BalanceInsufficient(BalanceShortfall {
            remaining: CostUnits(37),
            period_end: Some(period_end),
        }),
        AllocateError::BalanceExhausted(BalanceExhaustion { period_end: None }),
        AllocateError::InsufficientBalance,
        AllocateError::AccountInactive,
        AllocateError::UnknownAccount,
        AllocateError::InvalidTtl,
    ] {
        let allocator = Scripted::new();
        allocator.plan_consolidations([Reply::Refuse(error.clone())]);
        let h = Harness::started(allocator).await;
        h.fold_a_refused_quote().await;

        assert_eq!(h.serving(), Some((1, 30)), "{error}: the lease is back");
        // The lease goes back to serving with its 30 units, so the balance
        // beyond it is what the store counted less those (admission adds
        // what the lease holds itself).
        assert_eq!(
            h.slot.funding_evidence(h.now()),
            error.evidence().map(|evidence| BalanceShortfall {
                remaining: evidence.remaining.saturating_sub(CostUnits(30)),
                ..evidence
            }),
            "{error}"
        );
        assert!(h.ready(), "{error}: a refusal is not a fault");
        assert_eq!(h.manager().health(), LeaseHealth::Serving, "{error}");
        assert_eq!(h.stats().refused_for(&error), 1, "{error}");

        // Sized for the quote: marked at it, with the configured span
        // between rotations above the mark (I27).
        let fold = |needed: u64| Call::Consolidate {
            lease: 1,
            unspent: 30,
            requested: needed.max(LOW_WATER) + TARGET - LOW_WATER,
            needed,
        };
        if error
            .evidence()
            .is_some_and(|evidence| evidence.rules_out(CostUnits(50)))
        {
            // I27: the refusal says the account cannot fund the quote, so
            // the lease forgets it instead of refolding for it every poll,
            // and a smaller quote refused later is folded for at once
            // rather than hidden behind it. At once means at its ring (I7,
            // I28): the quote comes halfway between two polls, so a ring
            // lost after the forget would leave the fold to the poll after.
            let refused_at = POLL * 3 + POLL / 2;
            sleep(refused_at).await;
            assert_eq!(
                h.allocator.calls(),
                [acquire(), fold(50)],
                "{error}: not retried"
            );
            h.refused(35);
            if error
                .evidence()
                .is_some_and(|e| !e.rules_out(CostUnits(35)))
            {
                h.allocator.calls_reach(3).await;
                assert_eq!(
                    h.allocator.timed_calls()[2],
                    (refused_at, fold(35)),
                    "{error}: the smaller quote is not hidden behind the other, \
                     and its ring is answered at once"
                );
            } else {
                // Ruled out too (admission would not record it): a fold
                // the store would refuse is not made, and the record is
                // forgotten, so it cannot hide a smaller, fundable quote.
                sleep(POLL * 3).await;
                assert_eq!(h.allocator.calls().len(), 2, "{error}: not folded");
                let kept = h.slot.load_observed().map(|l| l.largest_refused_quote());
                assert_eq!(kept, Some(CostUnits::ZERO), "{error}: forgotten");
            }
            continue;
        }
        h.allocator.calls_reach(3).await;
        settle().await;
        assert_eq!(
            h.allocator.timed_calls(),
            [
                (Duration::ZERO, acquire()),
                (Duration::ZERO, fold(50)),
                (POLL, fold(50)),
            ],
            "{error}: the refusal mark stays, so the fold is retried by the poll"
        );
        assert_eq!(h.serving(), Some((2, 100)), "{error}");
    }
}

/// One quote the account cannot fund must not starve the smaller ones: a
/// refused fold of a lease that is also at low water is followed by an
/// ordinary replacement.
#[tokio::test(start_paused = true)]
async fn a_refused_fold_of_a_draining_lease_is_followed_by_a_plain_replacement() {
    let allocator = Scripted::new();
    let shortfall = BalanceShortfall {
        remaining: CostUnits(40),
        period_end: None,
    };
    allocator.plan_consolidations([Reply::Refuse(AllocateError::BalanceInsufficient(shortfall))]);
    let tail = BalanceShortfall {
        remaining: CostUnits::ZERO,
        period_end: None,
    };
    allocator.plan_acquires([Reply::Grant(TARGET), Reply::GrantShort(40, tail)]);
    let h = Harness::started(allocator).await;
    h.spend(85);
    h.refused(50);
    h.allocator.calls_reach(3).await;
    settle().await;

    assert_eq!(
        h.allocator.calls(),
        [
            acquire(),
            Call::Consolidate {
                lease: 1,
                unspent: 15,
                requested: 130,
                needed: 50,
            },
            acquire(),
        ]
    );
    assert_eq!(h.serving(), Some((2, 40)));
    assert_eq!(
        h.slot.funding_evidence(h.now()),
        Some(BalanceShortfall {
            remaining: CostUnits(15),
            ..tail
        }),
        "lease 1, parked, holds 15 units its release returns to the balance"
    );
    h.allocator.calls_reach(4).await;
    settle().await;
    assert_eq!(h.allocator.calls()[3], release(1, 15));
    assert_eq!(
        h.slot.funding_evidence(h.now()),
        Some(BalanceShortfall {
            remaining: CostUnits(15),
            ..tail
        }),
        "the newest word on the account's funds, with lease 1's units back"
    );
}

/// A consolidation that may have committed: the old lease must not serve
/// (its units may be credited back) nor be dropped (they may not). It is
/// parked, and the next release pass finds out which (I27).
#[tokio::test(start_paused = true)]
async fn an_unanswered_consolidation_parks_the_old_lease_for_the_release_pass() {
    struct Case {
        reply: Reply,
        release_answer: Reply,
        /// How long after the call its end (answer or timeout) came.
        answered_after: Duration,
        released_units: u64,
        timeouts: u64,
    }
    for case in [
        // The store failed after committing: the release finds it settled.
        Case {
            reply: Reply::Refuse(storage_error()),
            release_answer: Reply::Refuse(AllocateError::LeaseNotActive),
            answered_after: Duration::ZERO,
            released_units: 0,
            timeouts: 0,
        },
        // The store hung before committing: the release settles it.
        Case {
            reply: Reply::Hang,
            release_answer: Reply::Grant(0),
            answered_after: CALL_TIMEOUT,
            released_units: 30,
            timeouts: 1,
        },
    ] {
        let allocator = Scripted::new();
        allocator.plan_consolidations([case.reply.clone()]);
        allocator.plan_releases(1, [case.release_answer.clone()]);
        let h = Harness::started(allocator).await;
        h.spend(70);
        sleep(secs(1)).await;
        h.refused(50);
        h.allocator.calls_reach(2).await;
        sleep(case.answered_after).await;
        settle().await;

        assert_eq!(
            h.serving(),
            None,
            "{case:?}: fails closed (I5)",
            case = case.reply
        );
        assert!(!h.ready());
        assert_eq!(h.manager().health(), LeaseHealth::Unfunded);
        let stats = h.stats();
        assert_eq!(stats.uncertain_acquires, 1);
        assert_eq!(stats.acquire_timeouts, case.timeouts);

        h.allocator.calls_reach(4).await;
        settle().await;
        let next_tick = secs(1) + case.answered_after + POLL;
        assert_eq!(
            h.allocator.timed_calls(),
            [
                (Duration::ZERO, acquire()),
                (
                    secs(1),
                    Call::Consolidate {
                        lease: 1,
                        unspent: 30,
                        requested: 130,
                        needed: 50,
                    }
                ),
                (next_tick, release(1, 30)),
                (next_tick, acquire()),
            ]
        );
        assert_eq!(h.serving(), Some((2, 100)));
        let stats = h.stats();
        assert_eq!(
            (stats.released, stats.released_units),
            (1, case.released_units)
        );
    }
}

/// A consolidation answered "not ours any more": the old lease is dropped
/// (nothing to spend, nothing to claim) and a fresh lease is acquired at
/// once. A lease published into the slot during the call is parked and
/// released, never lost: the fresh grant replaces it (on a fence it is
/// taken out of the slot first; see
/// `a_fenced_fold_empties_the_slot_even_when_no_grant_follows`).
#[tokio::test(start_paused = true)]
async fn a_consolidation_of_a_lease_the_store_no_longer_holds_drops_it_and_acquires() {
    for error in [
        AllocateError::UnknownLease,
        AllocateError::LeaseNotActive,
        AllocateError::Fenced,
    ] {
        let allocator = Scripted::new();
        allocator.plan_consolidations([Reply::PublishThen(
            77,
            Box::new(Reply::Refuse(error.clone())),
        )]);
        let h = Harness::started(allocator).await;
        h.spend(70);
        h.refused(50);
        h.allocator.calls_reach(3).await;
        settle().await;

        assert_eq!(h.serving(), Some((2, 100)), "{error}");
        // Counted as settled, but what the store credited for it is the
        // store's to say: its 30 unspent units are not claimed here.
        let stats = h.stats();
        assert_eq!((stats.released, stats.released_units), (1, 0), "{error}");
        h.allocator.calls_reach(4).await;
        assert_eq!(
            h.allocator.timed_calls(),
            [
                (Duration::ZERO, acquire()),
                (
                    Duration::ZERO,
                    Call::Consolidate {
                        lease: 1,
                        unspent: 30,
                        requested: 130,
                        needed: 50,
                    }
                ),
                (Duration::ZERO, acquire()),
                (POLL, release(77, 100)),
            ],
            "{error}: lease 1 is never claimed; the published lease is returned"
        );
    }
}

/// I26: a fold answered "fenced" puts the instance's view of its leases in
/// doubt, so whatever serves in the slot stops serving (parked, never
/// dropped) whether or not a fresh grant follows; answered "settled"
/// (unknown or not active), only the folded lease is gone and the slot is
/// left alone. The acquire after the fold fails here, so what the answer
/// itself did to the slot shows: with a grant, it would replace the
/// published lease (77) either way.
#[tokio::test(start_paused = true)]
async fn a_fenced_fold_empties_the_slot_even_when_no_grant_follows() {
    for error in [
        AllocateError::UnknownLease,
        AllocateError::LeaseNotActive,
        AllocateError::Fenced,
    ] {
        let fenced = matches!(error, AllocateError::Fenced);
        let allocator = Scripted::new();
        allocator.plan_consolidations([Reply::PublishThen(
            77,
            Box::new(Reply::Refuse(error.clone())),
        )]);
        allocator.plan_acquires([Reply::Grant(TARGET), Reply::Refuse(storage_error())]);
        let h = Harness::started(allocator).await;
        h.spend(70);
        h.refused(50);
        h.allocator.calls_reach(3).await;
        settle().await;

        assert!(
            matches!(
                h.allocator.calls()[1..],
                [Call::Consolidate { .. }, Call::Acquire { .. }]
            ),
            "{error}: {:?}",
            h.allocator.calls()
        );
        if fenced {
            assert_eq!(h.serving(), None, "{error}: lease 77 left the slot");
            assert!(!h.ready(), "{error}");
            // Parked, it is returned with all its units at the next pass.
            h.allocator.calls_reach(4).await;
            assert_eq!(h.allocator.timed_calls()[3], (POLL, release(77, 100)));
        } else {
            assert_eq!(h.serving(), Some((77, 100)), "{error}: lease 77 serves");
            assert!(h.ready(), "{error}");
        }
    }
}

/// How a fold ends while a lease (77) published meanwhile is in the slot,
/// and where that lease and the folded one (1, holding 30) go.
struct FoldBesidePublished {
    /// The fold's answer once lease 77 is in the slot.
    reply: Reply,
    /// Whether shutdown is asked for while the call runs.
    stop_in_flight: bool,
    /// The lease serving once the fold has ended.
    serving: Option<(u64, u64)>,
    /// Every call after the fold, wind-down's releases included.
    after_fold: Vec<Call>,
    /// The leases and units shutdown abandons.
    abandoned: (u64, u64),
}

/// Every end of a fold that the lease manager treats in a way of its own.
fn folds_beside_a_published_lease() -> Vec<FoldBesidePublished> {
    let case = |reply, serving, after_fold: &[Call]| FoldBesidePublished {
        reply,
        stop_in_flight: false,
        serving,
        after_fold: after_fold.to_vec(),
        abandoned: (0, 0),
    };
    // A grant settles lease 1 and parks 77 as a rotation does.
    let granted = [release(77, 100), release(2, 150)];
    // Rolled back: lease 1 serves again and 77 is parked.
    let rolled_back = [release(77, 100), release(1, 30)];
    // Gone: lease 1 is dropped and a fresh lease acquired; 77 is parked,
    // replaced by it or, on a fence, taken out of the slot before.
    let gone = [acquire(), release(77, 100), release(2, TARGET)];
    // No answer: lease 1 is parked and 77 keeps serving.
    let unanswered = [release(1, 30), release(77, 100)];
    let shortfall = AllocateError::BalanceInsufficient(BalanceShortfall {
        remaining: CostUnits(37),
        period_end: None,
    });
    vec![
        case(Reply::Grant(150), Some((2, 150)), &granted),
        case(
            Reply::Refuse(AllocateError::InsufficientBalance),
            Some((1, 30)),
            &rolled_back,
        ),
        case(Reply::Refuse(shortfall), Some((1, 30)), &rolled_back),
        case(
            Reply::Refuse(AllocateError::LeaseNotActive),
            Some((2, TARGET)),
            &gone,
        ),
        case(
            Reply::Refuse(AllocateError::Fenced),
            Some((2, TARGET)),
            &gone,
        ),
        case(Reply::Refuse(storage_error()), Some((77, 100)), &unanswered),
        case(Reply::Hang, Some((77, 100)), &unanswered),
        FoldBesidePublished {
            stop_in_flight: true,
            ..case(Reply::Hang, Some((77, 100)), &unanswered)
        },
        // An accounting fault withholds lease 1 and empties the slot.
        FoldBesidePublished {
            abandoned: (1, 30),
            ..case(
                Reply::Refuse(AllocateError::InvalidRelease),
                None,
                &[release(77, 100)],
            )
        },
    ]
}

/// I26, I27: a lease published into the slot while the serving one is out
/// of it to be folded (as a concurrent publisher would) is never lost,
/// whatever the fold's end: a grant, or an answer that the folded lease is
/// gone, parks it (the new lease replaces it, or a fence takes it out
/// first); a rolled-back fold parks it and
/// serves the old lease again; a fold that got no answer (an error, a
/// timeout, a shutdown) leaves it serving and parks the old lease; an
/// accounting fault takes it out of the slot. Each way it is released once,
/// with all its units, and only the faulted fold's own lease is abandoned.
#[tokio::test(start_paused = true)]
async fn a_lease_published_during_a_fold_is_kept_whatever_the_fold_answers() {
    for case in folds_beside_a_published_lease() {
        let label = format!(
            "{:?}{}",
            case.reply,
            if case.stop_in_flight { ", stopped" } else { "" }
        );
        let allocator = Scripted::new();
        allocator.plan_consolidations([Reply::PublishThen(77, Box::new(case.reply.clone()))]);
        let mut h = Harness::started(allocator).await;
        h.spend(70);
        h.refused(50);
        h.allocator.calls_reach(2).await;
        if matches!(case.reply, Reply::Hang) && !case.stop_in_flight {
            sleep(CALL_TIMEOUT).await;
        }
        settle().await;
        assert_eq!(h.serving(), case.serving, "{label}");

        let report = h.shutdown().await;

        let calls = h.allocator.calls();
        assert_eq!(
            calls[1],
            Call::Consolidate {
                lease: 1,
                unspent: 30,
                requested: 130,
                needed: 50,
            },
            "{label}"
        );
        assert_eq!(calls[2..], case.after_fold, "{label}");
        let released: Vec<u64> = case
            .after_fold
            .iter()
            .filter_map(|call| match call {
                Call::Release { unspent, .. } => Some(*unspent),
                _ => None,
            })
            .collect();
        assert_eq!(
            (report.released, report.released_units),
            (released.len() as u64, released.iter().sum()),
            "{label}"
        );
        assert_eq!(
            (report.abandoned, report.abandoned_units),
            case.abandoned,
            "{label}"
        );
    }
}

/// A consolidation refused as an over-claim is the same accounting fault as
/// a refused release: the old lease does not serve again, readiness is
/// withdrawn for good, and shutdown abandons the lease to TTL reclaim
/// (I15, I18).
#[tokio::test(start_paused = true)]
async fn a_consolidation_refused_as_an_over_claim_faults_and_stops_spending() {
    let allocator = Scripted::new();
    allocator.plan_consolidations([Reply::Refuse(AllocateError::InvalidRelease)]);
    let mut h = Harness::started(allocator).await;
    h.fold_a_refused_quote().await;

    assert_eq!(h.manager().health(), LeaseHealth::Faulted);
    assert!(!h.ready());
    assert_eq!(h.serving(), None);
    sleep(POLL * 3).await;
    assert_eq!(
        h.allocator.calls().len(),
        2,
        "nothing is acquired or claimed again"
    );

    let report = h.shutdown().await;
    assert_eq!((report.released, report.abandoned), (0, 1));
    assert_eq!(report.abandoned_units, 30);
    assert_eq!(report.stats.refused_for(&AllocateError::InvalidRelease), 1);
}

/// I26: a store that settles a release with another amount than claimed
/// disagrees with the instance about the books (units counted twice or
/// lost): an integrity fault, not a log line while the account keeps being
/// served.
#[tokio::test(start_paused = true)]
async fn a_release_credited_with_another_amount_than_claimed_faults() {
    let allocator = Scripted::new();
    allocator.plan_releases(1, [Reply::Credit(25)]);
    allocator.plan_acquires([
        Reply::Grant(TARGET),
        Reply::GrantShort(
            TARGET,
            BalanceShortfall {
                remaining: CostUnits(5),
                period_end: None,
            },
        ),
    ]);
    let mut h = Harness::started(allocator).await;
    rotate_once(&h, 80).await;
    assert_eq!(h.serving(), Some((2, 100)));
    sleep(POLL).await;
    settle().await;
    assert!(
        h.allocator.calls().contains(&release(1, 20)),
        "{:?}",
        h.allocator.calls()
    );

    assert_eq!(h.manager().health(), LeaseHealth::Faulted);
    assert!(!h.ready());
    assert_eq!(h.serving(), None, "the account is no longer served");
    assert_eq!(
        h.slot.published_funding(),
        None,
        "no evidence is read against the emptied slot, even once the leases \
         it held are released"
    );
    assert_eq!(
        h.stats().released_units,
        25 + 100,
        "what the store credited for lease 1, and lease 2 returned whole once \
         the fault took it out of the slot"
    );
    let report = h.shutdown().await;
    assert!(report.faulted);
}

/// I23, I26: a lease found settled already (an earlier release whose
/// answer was lost, or reclaim) put at least its unspent units back in the
/// balance at a moment nobody knows, so the published evidence, which may
/// or may not count them, is withdrawn: left as it was, it would rule out
/// quotes those units fund (402, never retry).
#[tokio::test(start_paused = true)]
async fn a_lease_found_settled_withdraws_the_evidence() {
    let allocator = Scripted::new();
    let spent = BalanceShortfall {
        remaining: CostUnits::ZERO,
        period_end: None,
    };
    allocator.plan_acquires([Reply::Grant(TARGET), Reply::GrantShort(TARGET, spent)]);
    allocator.plan_releases(1, [Reply::Refuse(AllocateError::LeaseNotActive)]);
    let h = Harness::started(allocator).await;
    rotate_once(&h, 80).await;
    assert_eq!(h.serving(), Some((2, 100)));
    // The manager's own evidence: nothing in the balance, and the parked
    // lease's 20.
    assert_eq!(
        h.slot.funding_evidence(h.now()),
        Some(BalanceShortfall {
            remaining: CostUnits(20),
            period_end: None,
        })
    );
    sleep(POLL).await;
    settle().await;
    assert!(
        h.allocator.calls().contains(&release(1, 20)),
        "{:?}",
        h.allocator.calls()
    );
    assert_eq!(h.stats().released, 1);
    assert_eq!(h.slot.funding_evidence(h.now()), None);
}

/// I23: a fold that finds its lease settled already (reclaimed, say)
/// forgets the allocator's evidence: the store credited the lease's units
/// back at a moment nobody knows, so that word may or may not count them.
/// With the acquire after it unanswered, nothing is shown until a grant
/// call answers, not even once the release pass finds nothing parked.
#[tokio::test(start_paused = true)]
async fn a_fold_that_finds_its_lease_settled_forgets_the_evidence() {
    let allocator = Scripted::new();
    allocator.plan_acquires([
        Reply::GrantShort(
            TARGET,
            BalanceShortfall {
                remaining: CostUnits(5),
                period_end: None,
            },
        ),
        Reply::Refuse(storage_error()),
        Reply::Hang,
    ]);
    allocator.plan_consolidations([Reply::Refuse(AllocateError::LeaseNotActive)]);
    let h = Harness::started(allocator).await;
    assert!(h.slot.published_funding().is_some());
    h.spend(70);
    // 30 on the lease and 5 in the balance fund it; the store says the
    // lease is gone.
    h.refused(35);
    h.allocator.calls_reach(3).await;
    settle().await;
    assert_eq!(h.serving(), None, "the settled lease is gone");
    // The next inspection's release pass, then an acquire that hangs.
    h.allocator.calls_reach(4).await;
    settle().await;
    assert_eq!(
        h.allocator.calls(),
        [
            acquire(),
            Call::Consolidate {
                lease: 1,
                unspent: 30,
                requested: 115,
                needed: 35,
            },
            acquire(),
            acquire(),
        ]
    );
    assert_eq!(h.slot.published_funding(), None);
}

/// I23, I27: while a rotated-out lease is parked, the evidence counts what
/// it holds (its release returns it to the balance), and a quote that the
/// balance, the parked lease and the serving one cannot fund together is
/// not chased with a grant call at every poll.
#[tokio::test(start_paused = true)]
async fn a_quote_ruled_out_is_not_chased_while_a_lease_is_parked() {
    let allocator = Scripted::new();
    allocator.plan_acquires([
        Reply::Grant(TARGET),
        Reply::GrantShort(
            TARGET,
            BalanceShortfall {
                remaining: CostUnits::ZERO,
                period_end: None,
            },
        ),
    ]);
    let h = Harness::started(allocator).await;
    // Lease 1 runs low and is replaced; its request keeps it parked.
    let parked = h.reserve(85);
    h.allocator.calls_reach(2).await;
    settle().await;
    assert_eq!(h.serving(), Some((2, TARGET)));
    assert_eq!(
        h.slot.published_funding(),
        Some(BalanceShortfall {
            remaining: CostUnits(15),
            period_end: None,
        }),
        "none left in the balance, and the 15 lease 1 still holds"
    );
    // Lease 2, busy, refuses a quote the balance and both leases together
    // cannot fund.
    let busy = h.reserve(10);
    h.refused(150);
    sleep(POLL * 2).await;
    settle().await;
    assert_eq!(
        h.allocator.calls(),
        [acquire(), acquire()],
        "no grant call chased it"
    );
    drop((parked, busy));
}

/// I23, I29: an exhausted account whose last lease closes with a request
/// still on it is known at once to have nothing left beyond that lease (the
/// evidence counts what the parked lease holds, here nothing), so readiness
/// can tell it from an account it cannot serve. Admission answers no quote
/// as final on that figure while the request runs: released for nothing,
/// it gives its units back to the parked lease, and the account can be
/// funded again once the lease is released.
#[tokio::test(start_paused = true)]
async fn an_exhausted_account_whose_last_lease_is_parked_busy_is_known_empty_but_not_final() {
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::Grant(TARGET), exhausted(None), exhausted(None)]);
    let h = Harness::started(allocator).await;
    // Every unit reserved by a request that is still running.
    let running = h.reserve(TARGET);
    h.allocator.calls_reach(2).await;
    settle().await;
    h.clock.advance(TTL - MARGIN);
    h.allocator.calls_reach(3).await;
    settle().await;
    assert_eq!(h.serving(), None, "the closed lease is parked");
    let nothing_left = Some(BalanceShortfall {
        remaining: CostUnits::ZERO,
        period_end: None,
    });
    assert_eq!(h.slot.funding_estimate(h.now()), nothing_left);
    assert_eq!(
        h.slot.funding_evidence(h.now()),
        None,
        "no final answer while the parked lease may get units back"
    );
    // The request ends before its handler: its units go back to lease 1,
    // whose release returns them to the balance, which funds a lease again.
    drop(running);
    h.allocator.calls_reach(5).await;
    settle().await;
    assert_eq!(h.allocator.calls()[3], release(1, TARGET));
    assert_eq!(h.serving(), Some((2, TARGET)));
}

/// I27: after a refused fold, the record of the quote is judged on the
/// figure admission reads: the store's balance and what a parked lease
/// holds, beside the lease. A quote those fund together is kept, and folded
/// for once the parked lease's units are in the balance: not before, since
/// the store folds from the balance alone and would refuse (with the slot
/// empty during each call). Forgotten on the balance alone, admission would
/// record it again at the next refusal, and each would cost a fold.
#[tokio::test(start_paused = true)]
async fn a_refused_fold_keeps_a_quote_the_parked_lease_and_the_balance_fund_together() {
    let allocator = Scripted::new();
    allocator.plan_acquires([
        Reply::Grant(TARGET),
        Reply::GrantShort(
            30,
            BalanceShortfall {
                remaining: CostUnits(10),
                period_end: None,
            },
        ),
    ]);
    // Another instance took the 10 meanwhile: the store counts only the
    // folded lease's 30.
    allocator.plan_consolidations([Reply::Refuse(AllocateError::BalanceInsufficient(
        BalanceShortfall {
            remaining: CostUnits(30),
            period_end: None,
        },
    ))]);
    let h = Harness::started(allocator).await;
    // Lease 1 is replaced with 15 left and a request still on it.
    let running = h.reserve(50);
    h.spend(35);
    h.allocator.calls_reach(2).await;
    settle().await;
    assert_eq!(h.serving(), Some((2, 30)));
    // Lease 2 refuses 40: its 30 and the balance's 10 would fund it.
    h.refused(40);
    h.allocator.calls_reach(3).await;
    settle().await;
    assert!(matches!(
        h.allocator.calls()[2],
        Call::Consolidate { needed: 40, .. }
    ));
    let lease = h.slot.load_observed().expect("lease 2 serves again");
    assert_eq!(
        lease.largest_refused_quote(),
        CostUnits(40),
        "kept: its 30 and lease 1's 15 fund it"
    );
    drop(lease);
    sleep(POLL * 3).await;
    settle().await;
    assert_eq!(
        h.allocator.calls().len(),
        3,
        "no fold the balance alone rules out: {:?}",
        h.allocator.calls()
    );
    assert_eq!(h.serving(), Some((2, 30)));
    drop(running);
    h.allocator.calls_reach(5).await;
    settle().await;
    let calls = h.allocator.calls();
    assert_eq!(calls[3], release(1, 65), "its 15 and the request's 50");
    assert!(
        matches!(calls[4], Call::Consolidate { needed: 40, .. }),
        "{calls:?}"
    );
}

/// I15, I29: a grant of another account is an integrity fault, not a
/// panic: the manager stops spending, withdraws readiness for good, and
/// hands the grant back rather than serve it.
#[tokio::test(start_paused = true)]
async fn a_grant_of_another_account_faults_and_is_never_served() {
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::GrantElsewhere(TARGET)]);
    let mut h = Harness::started(allocator).await;
    settle().await;
    assert_eq!(h.manager().health(), LeaseHealth::Faulted);
    assert!(!h.ready());
    assert_eq!(h.serving(), None);
    sleep(POLL * 3).await;
    let report = h.shutdown().await;
    assert!(report.faulted);
    assert_eq!(
        (report.stats.released, report.stats.released_units),
        (1, TARGET),
        "the grant went straight back"
    );
}

// ------------------------------------------------------ release refusals

/// I26: a release answered "settled already" drops the lease: it is not
/// retried and nothing else changes.
#[tokio::test(start_paused = true)]
async fn a_parked_lease_the_store_already_settled_is_dropped() {
    for error in [AllocateError::LeaseNotActive, AllocateError::UnknownLease] {
        let allocator = Scripted::new();
        allocator.plan_releases(1, [Reply::Refuse(error.clone())]);
        let h = Harness::started(allocator).await;
        rotate_once(&h, 80).await;
        sleep(POLL * 4).await;

        assert_eq!(
            h.allocator.timed_calls(),
            [
                (Duration::ZERO, acquire()),
                (Duration::ZERO, acquire()),
                (POLL, release(1, 20)),
            ],
            "{error}: not retried"
        );
        let stats = h.stats();
        assert_eq!((stats.released, stats.released_units), (1, 0), "{error}");
        assert_eq!(stats.release_refused_for(&error), 1, "{error}");
        assert_eq!(
            h.serving(),
            Some((2, 100)),
            "{error}: the slot is untouched"
        );
        assert!(h.ready(), "{error}");
    }
}

/// I26: a fenced release drops the lease and takes the serving lease out of the
/// slot: it is parked and released (never dropped, it may still be ours), and
/// a fresh grant takes its place.
#[tokio::test(start_paused = true)]
async fn a_fenced_release_drops_the_lease_and_replaces_the_serving_one_without_losing_it() {
    let allocator = Scripted::new();
    allocator.plan_releases(1, [Reply::Refuse(AllocateError::Fenced)]);
    let h = Harness::started(allocator).await;
    rotate_once(&h, 80).await;
    h.spend(10);
    h.allocator.calls_reach(5).await;
    settle().await;

    assert_eq!(
        h.allocator.timed_calls(),
        [
            (Duration::ZERO, acquire()),
            (Duration::ZERO, acquire()),
            (POLL, release(1, 20)),
            (POLL, release(2, 90)),
            (POLL, acquire()),
        ]
    );
    assert_eq!(h.serving(), Some((3, 100)));
    assert!(h.ready());
    let stats = h.stats();
    assert_eq!(stats.release_refused_for(&AllocateError::Fenced), 1);
    assert_eq!((stats.released, stats.released_units), (2, 90));
    sleep(POLL * 2).await;
    assert_eq!(h.allocator.calls().len(), 5, "lease 1 is not retried");
}

/// I22, I26: a release that failed may or may not have settled, and one
/// the balance has no room for yet (a top-up filled it while the lease was
/// out) settled nothing: either way the lease stays parked, the next pass
/// asks again, and neither is an accounting fault.
#[tokio::test(start_paused = true)]
async fn a_release_that_failed_or_found_no_room_is_retried_on_the_next_pass() {
    for error in [storage_error(), AllocateError::BalanceOverflow] {
        let allocator = Scripted::new();
        allocator.plan_releases(1, [Reply::Refuse(error.clone())]);
        let h = Harness::started(allocator).await;
        rotate_once(&h, 80).await;
        h.allocator.calls_reach(4).await;

        assert_eq!(
            h.allocator.timed_calls(),
            [
                (Duration::ZERO, acquire()),
                (Duration::ZERO, acquire()),
                (POLL, release(1, 20)),
                (POLL * 2, release(1, 20)),
            ],
            "{error}"
        );
        settle().await;
        let stats = h.stats();
        assert_eq!(stats.release_refused_for(&error), 1, "{error}");
        assert_eq!((stats.released, stats.released_units), (1, 20), "{error}");
        assert_eq!(h.manager().health(), LeaseHealth::Serving, "{error}");
        assert!(h.ready(), "{error}: not a fault");
    }
}

/// A release refused as an accounting fault withdraws readiness for good
/// and stops spending: the slot is emptied, its lease returned, nothing is
/// acquired again, and the refused lease is never claimed again; shutdown
/// reports it abandoned (I5, I15, I26).
#[tokio::test(start_paused = true)]
async fn an_integrity_refusal_withdraws_readiness_for_good_and_stops_spending() {
    for error in [
        AllocateError::InvalidRelease,
        AllocateError::AccountInactive,
    ] {
        let allocator = Scripted::new();
        allocator.plan_releases(1, [Reply::Refuse(error.clone())]);
        let mut h = Harness::started(allocator).await;
        let mut readiness = h.manager().readiness();
        rotate_once(&h, 80).await;
        assert!(*readiness.borrow_and_update());
        h.allocator.calls_reach(4).await;
        settle().await;

        assert_eq!(h.manager().health(), LeaseHealth::Faulted, "{error}");
        assert!(!*readiness.borrow_and_update(), "{error}");
        assert_eq!(h.serving(), None, "{error}: no more spending");
        sleep(POLL * 5).await;
        assert_eq!(
            h.allocator.calls(),
            [acquire(), acquire(), release(1, 20), release(2, 100)],
            "{error}: the serving lease is returned; nothing is acquired or re-claimed"
        );
        assert!(
            !readiness.has_changed().expect("the task runs"),
            "{error}: for good"
        );

        let report = h.shutdown().await;
        assert_eq!(
            (report.released, report.abandoned, report.abandoned_units),
            (0, 1, 20),
            "{error}"
        );
        assert!(!report.task_died);
        assert_eq!(report.stats.release_refused_for(&error), 1, "{error}");
        assert_eq!(report.stats.abandoned, 1, "{error}");
    }
}

// ----------------------------------------------------------- fail closed

/// I5: with no lease to spend, a refusal leaves the slot empty (requests are
/// denied) while every poll tries again; balance refusals publish their
/// evidence, and a grant clears it.
#[tokio::test(start_paused = true)]
async fn a_refusal_with_an_empty_slot_keeps_it_empty_retries_each_poll_and_publishes_evidence() {
    let period_end = start() + SignedDuration::from_hours(1);
    let allocator = Scripted::new();
    allocator.plan_acquires([
        Reply::Refuse(AllocateError::BalanceExhausted(BalanceExhaustion {
            period_end: Some(period_end),
        })),
        Reply::Refuse(AllocateError::BalanceInsufficient(BalanceShortfall {
            remaining: CostUnits(3),
            period_end: None,
        })),
        Reply::Refuse(AllocateError::AccountInactive),
    ]);
    let h = Harness::started(allocator).await;

    assert_eq!(h.serving(), None);
    assert!(!h.ready());
    assert_eq!(h.manager().health(), LeaseHealth::Unfunded);
    assert_eq!(
        h.slot.funding_evidence(h.now()),
        Some(BalanceShortfall {
            remaining: CostUnits::ZERO,
            period_end: Some(period_end),
        })
    );

    h.allocator.calls_reach(2).await;
    settle().await;
    let three_left = Some(BalanceShortfall {
        remaining: CostUnits(3),
        period_end: None,
    });
    assert_eq!(h.slot.funding_evidence(h.now()), three_left);
    assert_eq!(h.serving(), None);

    h.allocator.calls_reach(3).await;
    settle().await;
    assert_eq!(
        h.slot.funding_evidence(h.now()),
        three_left,
        "a refusal that says nothing about funds leaves the evidence alone"
    );

    h.allocator.calls_reach(4).await;
    settle().await;
    assert_eq!(
        h.allocator.timed_calls(),
        [
            (Duration::ZERO, acquire()),
            (POLL, acquire()),
            (POLL * 2, acquire()),
            (POLL * 3, acquire()),
        ]
    );
    assert_eq!(h.serving(), Some((1, 100)));
    assert_eq!(h.slot.funding_evidence(h.now()), None, "a grant clears it");
    assert!(h.ready());
    let stats = h.stats();
    assert_eq!(
        stats.refused_for(&AllocateError::BalanceExhausted(BalanceExhaustion {
            period_end: None
        })),
        1
    );
    assert_eq!(stats.refused_for(&AllocateError::AccountInactive), 1);
    assert_eq!(stats.refused.iter().sum::<u64>(), 3);
    assert_eq!(stats.uncertain_acquires, 0, "domain refusals are certain");
}

/// Every acquire that got no answer may have left a grant nobody holds
/// until reclaim. While the store keeps failing, acquires back off from
/// the second miss in a row (one poll, two, four, eight) rather than
/// strand a grant every poll, and the first answer puts the cadence back.
/// Each is made when its wait is over, not a poll later.
#[tokio::test(start_paused = true)]
async fn unanswered_acquires_back_off_until_the_store_answers() {
    let allocator = Scripted::new();
    allocator.plan_acquires(
        std::iter::repeat_n(Reply::Refuse(storage_error()), 6).chain([Reply::Grant(TARGET)]),
    );
    let h = Harness::started(allocator).await;
    sleep(POLL * 40).await;
    settle().await;
    let at = h.allocator.call_times();
    assert_eq!(
        at,
        [0, 1, 2, 4, 8, 16, 24].map(|polls| POLL * polls).to_vec(),
        "the next poll, then one poll, two, four, eight, eight; then answered"
    );
    assert_eq!(h.serving(), Some((1, 100)));
    assert_eq!(h.stats().uncertain_acquires, 6);
}

/// I22, I35: an acquire the store says it never made (no connection was
/// free in time) left no grant behind, so it is retried at every poll
/// rather than backed off: while thousands of accounts wait for turns,
/// backing off would leave the store idle between their tries. Nor does
/// it put the cadence back after calls that did go unanswered.
#[tokio::test(start_paused = true)]
async fn acquires_the_store_never_made_are_retried_at_every_poll() {
    let not_made = || {
        Reply::Refuse(AllocateError::Storage(StoreError::not_made(
            "no connection was free",
        )))
    };
    let allocator = Scripted::new();
    allocator.plan_acquires(
        std::iter::repeat_n(not_made(), 4)
            .chain(std::iter::repeat_n(Reply::Refuse(storage_error()), 2))
            .chain([
                not_made(),
                Reply::Refuse(storage_error()),
                Reply::Grant(TARGET),
            ]),
    );
    let h = Harness::started(allocator).await;
    sleep(POLL * 40).await;
    settle().await;
    let at = h.allocator.call_times();
    assert_eq!(
        at,
        [0, 1, 2, 3, 4, 5, 6, 7, 9]
            .map(|polls| POLL * polls)
            .to_vec(),
        "every poll while calls are not made; then two misses, a call not made that \
         changes nothing, and a third miss that waits two polls"
    );
    assert_eq!(h.serving(), Some((1, 100)));
}

/// Any answer from the store ends the backoff, not only an acquire's: a
/// superseded lease's release answered while acquires back off puts the
/// cadence back, so the next acquire comes at that inspection rather than
/// when the wait would have been over.
#[tokio::test(start_paused = true)]
async fn a_release_answered_during_the_backoff_puts_the_acquire_cadence_back() {
    let allocator = Scripted::new();
    allocator.plan_acquires([
        Reply::Grant(TARGET),
        Reply::Grant(TARGET),
        Reply::Refuse(storage_error()),
        Reply::Refuse(storage_error()),
        Reply::Refuse(storage_error()),
    ]);
    let h = Harness::started(allocator).await;
    // Lease 1 runs low and is replaced at once; the reservation keeps it
    // from being released.
    let first = h.reserve(85);
    h.allocator.calls_reach(2).await;
    settle().await;
    assert_eq!(h.serving(), Some((2, 100)));
    // Lease 2 runs low; three acquires in a row go unanswered, so the
    // next would wait two polls.
    let second = h.reserve(85);
    h.allocator.calls_reach(5).await;
    settle().await;
    // Lease 1 goes quiet, its reservation released for nothing; its
    // release is answered at the next inspection.
    drop(first);
    h.allocator.calls_reach(7).await;
    settle().await;
    let calls = h.allocator.timed_calls();
    assert_eq!(
        calls
            .iter()
            .map(|(_, call)| call.clone())
            .collect::<Vec<_>>(),
        [
            acquire(),
            acquire(),
            acquire(),
            acquire(),
            acquire(),
            release(1, 100),
            acquire(),
        ]
    );
    let (missed_last, _) = calls[4];
    let (released_at, _) = calls[5];
    let (acquired_at, _) = calls[6];
    assert_eq!(
        released_at,
        missed_last + POLL,
        "released at the next inspection"
    );
    assert_eq!(
        acquired_at, released_at,
        "the release's answer ended the wait of two polls"
    );
    assert_eq!(h.serving(), Some((3, 100)));
    drop(second);
}

/// A fold is a grant call too: while acquires back off it waits, the lease
/// serving what it can, and is made when the wait is over. Its answer then
/// puts the cadence back, so a later miss is retried at the next poll, not
/// after the four polls a fourth miss in a row would wait.
#[tokio::test(start_paused = true)]
async fn a_fold_waits_out_the_backoff_and_its_answer_puts_the_cadence_back() {
    let allocator = Scripted::new();
    allocator.plan_acquires([
        Reply::Grant(TARGET),
        Reply::Refuse(storage_error()),
        Reply::Refuse(storage_error()),
        Reply::Refuse(storage_error()),
        Reply::Refuse(storage_error()),
    ]);
    // Small enough to have no mark: the debit that drains it rings.
    allocator.plan_consolidations([Reply::Grant(LOW_WATER)]);
    let h = Harness::started(allocator).await;
    h.spend(85);
    h.allocator.calls_reach(4).await;
    settle().await;
    sleep(POLL / 2).await;
    // 15 left: a quote of 20 is refused and recorded; the fold waits.
    h.refused(20);
    settle().await;
    assert_eq!(h.allocator.calls().len(), 4, "no fold during the backoff");
    assert_eq!(h.serving(), Some((1, 15)), "the lease keeps serving");
    h.allocator.calls_reach(5).await;
    settle().await;
    assert_eq!(h.serving(), Some((2, LOW_WATER)));
    // Drained, it rings: an acquire, missed, is retried a poll later.
    h.spend(LOW_WATER);
    h.allocator.calls_reach(7).await;
    settle().await;
    let calls = h.allocator.timed_calls();
    assert_eq!(
        calls
            .iter()
            .map(|(_, call)| call.clone())
            .collect::<Vec<_>>(),
        [
            acquire(),
            acquire(),
            acquire(),
            acquire(),
            Call::Consolidate {
                lease: 1,
                unspent: 15,
                requested: TARGET,
                needed: 20,
            },
            acquire(),
            acquire(),
        ]
    );
    let (missed_last, _) = calls[3];
    let (folded_at, _) = calls[4];
    let (missed_again, _) = calls[5];
    let (retried_at, _) = calls[6];
    assert_eq!(
        folded_at,
        missed_last + POLL * 2,
        "folded when the wait of two polls was over"
    );
    assert_eq!(missed_again, folded_at, "rung, acquired");
    assert_eq!(
        retried_at,
        missed_again + POLL,
        "the fold's answer put the cadence back"
    );
    assert_eq!(h.serving(), Some((3, TARGET)));
}

/// A fold waiting out the backoff still forgets a record the evidence rules
/// out beside the lease (I27): kept, it would hide a smaller quote the
/// account can fund, refused after it, until the wait was over and a fold
/// the store must refuse had been tried. The smaller one is then recorded
/// and folded when the wait is over.
#[tokio::test(start_paused = true)]
async fn a_fold_waiting_out_the_backoff_forgets_a_record_the_evidence_rules_out() {
    let allocator = Scripted::new();
    let shown = BalanceShortfall {
        remaining: CostUnits(10),
        period_end: None,
    };
    allocator.plan_acquires([
        Reply::GrantShort(TARGET, shown),
        Reply::Refuse(storage_error()),
        Reply::Refuse(storage_error()),
        Reply::Refuse(storage_error()),
        Reply::Refuse(storage_error()),
    ]);
    let h = Harness::started(allocator).await;
    h.spend(85);
    h.allocator.calls_reach(4).await;
    settle().await;
    sleep(POLL / 2).await;
    let recorded = || {
        h.slot
            .load_observed()
            .map(|lease| lease.largest_refused_quote().get())
    };
    // 15 left and 10 in the balance: 30 is out of reach.
    h.refused(30);
    settle().await;
    assert_eq!(recorded(), Some(0), "forgotten while the fold waits");
    // 20 is within reach: recorded, and folded once the wait is over.
    h.refused(20);
    settle().await;
    assert_eq!(recorded(), Some(20), "a fundable quote stays recorded");
    assert_eq!(h.allocator.calls().len(), 4, "no fold during the backoff");
    h.allocator.calls_reach(5).await;
    assert_eq!(
        h.allocator.calls()[4],
        Call::Consolidate {
            lease: 1,
            unspent: 15,
            requested: TARGET,
            needed: 20,
        }
    );
}

/// Grants that arrive unable to serve (as from a store whose `max_ttl` is
/// no longer than the safety margin) are returned, and the acquires that
/// get them back off like unanswered ones, although their releases are
/// answered: one poll, then two, four and eight. Asked every poll, every
/// instance would journal a grant and its release per account and poll.
/// A grant that serves ends the wait (I22).
#[tokio::test(start_paused = true)]
async fn acquires_answered_with_unusable_grants_back_off() {
    let allocator = Scripted::new();
    // Empty grants; then the script runs out and grants serve again.
    allocator.plan_acquires((0..5).map(|_| Reply::Grant(0)));
    let h = Harness::started(allocator).await;
    while h.serving().is_none() {
        h.allocator.calls_reach(h.allocator.calls().len() + 1).await;
        settle().await;
    }
    let calls = h.allocator.timed_calls();
    let acquired: Vec<Duration> = calls
        .iter()
        .filter(|(_, call)| *call == acquire())
        .map(|(at, _)| at.saturating_sub(calls[0].0))
        .collect();
    assert_eq!(
        acquired,
        [0, 1, 3, 7, 15, 23].map(|polls| POLL * polls),
        "{calls:?}"
    );
    assert_eq!(
        calls
            .iter()
            .filter(|(_, call)| matches!(call, Call::Release { unspent: 0, .. }))
            .count(),
        5,
        "every unusable grant went back: {calls:?}"
    );
    assert_eq!(h.serving(), Some((6, TARGET)));
}

/// I27: a quote refused by a lease whose window is about to close is
/// chased by its replacement, not forgotten with it: the replacement is
/// asked for enough to fund it, so the client's retry is admitted instead
/// of being refused again and folded.
#[tokio::test(start_paused = true)]
async fn a_quote_refused_as_the_window_closes_is_chased_by_the_replacement() {
    let allocator = Scripted::new();
    // The replacement made at the poll at 50 s, within a poll and a call
    // of the window's close at 55 s, goes unanswered, so lease 1 still
    // serves when the quote comes.
    allocator.plan_acquires([
        Reply::Grant(TARGET),
        Reply::Refuse(storage_error()),
        Reply::Grant(150),
    ]);
    let h = Harness::started(allocator).await;
    h.run_for(51).await;
    assert_eq!(h.allocator.calls(), [acquire(), acquire()]);
    assert_eq!(h.serving(), Some((1, 100)), "still serving, 4 s to go");
    h.refused(150);
    h.allocator.calls_reach(3).await;
    settle().await;
    assert_eq!(
        h.allocator.calls(),
        [
            acquire(),
            acquire(),
            Call::Acquire {
                requested: 230,
                needed: 150
            },
        ]
    );
    assert_eq!(h.serving(), Some((2, 150)), "the retry is funded");
}

/// I23, I28: an account refused for an exhausted balance is told to retry at
/// the period end, when the refill brings more. With no lease, nothing
/// rings for it, so the manager wakes then and acquires, rather than leave
/// the account refused (and the instance unready) until the next poll.
#[tokio::test(start_paused = true)]
async fn an_exhausted_account_is_funded_again_at_its_period_end_not_the_next_poll() {
    let period_end = start() + SignedDuration::from_secs(25);
    let allocator = Scripted::new();
    allocator.plan_acquires(std::iter::repeat_n(exhausted(Some(period_end)), 3));
    let h = Harness::started(allocator).await;
    assert_eq!(h.serving(), None);
    h.run_for(26).await;
    let at = h.allocator.call_times();
    assert_eq!(at, [0, 10, 20, 25].map(secs).to_vec());
    assert_eq!(h.serving(), Some((1, 100)));
    assert!(h.ready());
}

/// The period end's wake-up comes once: with a clock that stands still a
/// millisecond before it, the manager does not wake (and ask the store)
/// every millisecond, but at the period end once and then at each poll.
#[tokio::test(start_paused = true)]
async fn a_clock_that_reads_behind_does_not_turn_the_refill_wake_up_into_a_loop() {
    let period_end = start() + SignedDuration::from_millis(1);
    let allocator = Scripted::new();
    allocator.plan_acquires(std::iter::repeat_n(exhausted(Some(period_end)), 64));
    let h = Harness::started(allocator).await;
    sleep(secs(60)).await;
    let acquires = h.allocator.calls().len();
    // The cold start, the wake-up, and a poll every 10 s after it.
    assert_eq!(acquires, 1 + 1 + 5, "{:?}", h.allocator.timed_calls());
}

/// A backoff whose wait is over while no lease is wanted (here the lease
/// went back above its mark as a reservation was released) is no reason
/// to wake: the task sleeps until the next poll instead of spinning on a
/// deadline in the past. (A spinning task never lets paused time move, so
/// a watchdog on real time turns that hang into a failure.)
#[tokio::test(start_paused = true)]
async fn a_backoff_that_ran_out_while_no_lease_is_wanted_does_not_spin() {
    // Told the test ended however it ended, so only a hang aborts.
    let (ended, watched) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
            watched.recv_timeout(Duration::from_secs(60))
        {
            eprintln!("the lease manager spins on a past deadline");
            std::process::abort();
        }
    });
    let _ended = ended;
    let allocator = Scripted::new();
    allocator.plan_acquires([
        Reply::Grant(TARGET),
        Reply::Refuse(storage_error()),
        Reply::Refuse(storage_error()),
    ]);
    let h = Harness::started(allocator).await;
    let pending = h.reserve(85);
    h.allocator.calls_reach(2).await;
    sleep(POLL).await;
    h.allocator.calls_reach(3).await;
    settle().await;
    // Two misses in a row: the next acquire waits a poll. The reservation
    // goes back, and the lease with it above its mark.
    drop(pending);
    sleep(POLL * 5).await;
    settle().await;
    assert_eq!(
        h.allocator.calls().len(),
        3,
        "no acquire once the lease is whole again: {:?}",
        h.allocator.calls()
    );
    assert_eq!(h.serving(), Some((1, 100)));
}

// ------------------------------------------------------------ time bounds

/// I22: a hung acquire is cut off after the store call timeout and the task
/// goes on polling; a timeout and a storage error each leave the outcome
/// uncertain. (Two misses in a row are retried at the usual cadence; the
/// backoff starts after the second.)
#[tokio::test(start_paused = true)]
async fn a_hanging_allocator_is_cut_off_by_the_store_call_timeout_and_the_task_keeps_ticking() {
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::Hang, Reply::Refuse(storage_error())]);
    let h = Harness::start(allocator);
    h.allocator.calls_reach(3).await;
    settle().await;

    let second = CALL_TIMEOUT + POLL;
    assert_eq!(
        h.allocator.timed_calls(),
        [
            (Duration::ZERO, acquire()),
            (second, acquire()),
            (second + POLL, acquire()),
        ]
    );
    assert_eq!(h.serving(), Some((1, 100)));
    let stats = h.stats();
    assert_eq!(stats.acquire_timeouts, 1);
    assert_eq!(stats.refused_for(&storage_error()), 1);
    assert_eq!(stats.uncertain_acquires, 2);
}

#[tokio::test(start_paused = true)]
async fn an_unanswered_grant_call_marks_the_allocator_unreachable_until_the_next_answer() {
    let allocator = Scripted::new();
    allocator.plan_acquires([
        Reply::Refuse(AllocateError::AccountInactive),
        Reply::Hang,
        Reply::Refuse(storage_error()),
    ]);
    let h = Harness::start(allocator);
    // A refusal is an answer: the allocator is there, the account is not
    // fundable.
    h.allocator.calls_reach(1).await;
    settle().await;
    assert!(!h.slot.allocator_unreachable());
    // A hang cut off by the call timeout (I22) is no answer...
    h.allocator.calls_reach(2).await;
    tokio::time::sleep(CALL_TIMEOUT + ms(1)).await;
    assert!(h.slot.allocator_unreachable());
    // ...nor is a storage error.
    h.allocator.calls_reach(3).await;
    settle().await;
    assert!(h.slot.allocator_unreachable());
    // A grant is.
    h.allocator.calls_reach(4).await;
    settle().await;
    assert!(!h.slot.allocator_unreachable());
    assert_eq!(h.serving(), Some((1, 100)));
}

/// Parks leases 1, 2 and 3 behind reservations, rotating to lease 4, then
/// lets the reservations go.
async fn three_parked_leases(h: &Harness) {
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(h.reserve(5));
        rotate_once(h, 75).await;
    }
    assert_eq!(h.serving(), Some((4, 100)));
    assert_eq!(h.allocator.calls().len(), 4);
    drop(held);
}

/// I22: one release pass spends at most one store call timeout, however many
/// parked leases hang, and the lease that spent it goes to the back.
#[tokio::test(start_paused = true)]
async fn a_release_pass_costs_one_call_timeout_however_many_parked_leases_hang() {
    let allocator = Scripted::new();
    for lease in 1..=3 {
        allocator.plan_releases(lease, vec![Reply::Hang; 4]);
    }
    let h = Harness::started(allocator).await;
    three_parked_leases(&h).await;
    h.allocator.calls_reach(8).await;

    let pass = CALL_TIMEOUT + POLL;
    assert_eq!(
        h.allocator.timed_calls()[4..],
        [
            (POLL, release(1, 25)),
            (POLL + pass, release(2, 25)),
            (POLL + pass * 2, release(3, 25)),
            (POLL + pass * 3, release(1, 25)),
        ],
        "each pass is one timeout long and starts with the lease the last one did not reach"
    );
    settle().await;
    assert_eq!(h.stats().release_timeouts, 3);
}

/// I22: a lease whose release eats the pass budget yields the front of the
/// queue, so the leases behind it are released on the next pass.
#[tokio::test(start_paused = true)]
async fn a_lease_whose_release_eats_the_budget_goes_behind_the_others() {
    let allocator = Scripted::new();
    allocator.plan_releases(1, vec![Reply::Hang; 4]);
    let h = Harness::started(allocator).await;
    three_parked_leases(&h).await;
    h.allocator.calls_reach(9).await;

    let second_pass = POLL + CALL_TIMEOUT + POLL;
    assert_eq!(
        h.allocator.timed_calls()[4..],
        [
            (POLL, release(1, 25)),
            (second_pass, release(2, 25)),
            (second_pass, release(3, 25)),
            (second_pass, release(1, 25)),
            (second_pass + CALL_TIMEOUT + POLL, release(1, 25)),
        ]
    );
    settle().await;
    let stats = h.stats();
    assert_eq!((stats.released, stats.released_units), (2, 50));
}

/// I22, I26: a storage error releasing one parked lease leaves that lease
/// parked without ending the pass: the leases behind it are released at the
/// same poll, and the one that failed is asked again at the next pass.
#[tokio::test(start_paused = true)]
async fn a_release_that_fails_does_not_hold_up_the_parked_leases_behind_it() {
    let allocator = Scripted::new();
    allocator.plan_releases(1, [Reply::Refuse(storage_error())]);
    let h = Harness::started(allocator).await;
    three_parked_leases(&h).await;
    h.allocator.calls_reach(8).await;
    settle().await;

    assert_eq!(
        h.allocator.timed_calls()[4..],
        [
            (POLL, release(1, 25)),
            (POLL, release(2, 25)),
            (POLL, release(3, 25)),
            (POLL * 2, release(1, 25)),
        ],
        "one pass reaches every lease; the failed one is retried at the next"
    );
    let stats = h.stats();
    assert_eq!(stats.release_refused_for(&storage_error()), 1);
    assert_eq!(
        (stats.released, stats.released_units),
        (3, 75),
        "lease 1 settled by its retry"
    );
    assert_eq!(h.serving(), Some((4, 100)));
    assert!(h.ready(), "not a fault");
}

// --------------------------------------------------------------- shutdown

/// I25: shutdown returns every quiescent lease at once and abandons, never
/// releases, one a request still holds at the deadline.
#[tokio::test(start_paused = true)]
async fn shutdown_releases_quiescent_leases_and_abandons_a_held_one_at_the_deadline() {
    let mut h = Harness::started(Scripted::new()).await;
    let held = h.reserve(10);
    rotate_once(&h, 75).await;
    h.spend(5);
    let counters = Arc::clone(h.manager().counters());
    let mut readiness = h.manager().readiness();
    let calls_before = h.allocator.calls().len();
    // Shut down a second after the calls before, and well before the next
    // poll, so each call's instant says whether shutdown made it and when.
    sleep(secs(1)).await;

    let began = Instant::now();
    let since = began.duration_since(h.allocator.began);
    let report = h.shutdown().await;

    assert_eq!(
        began.elapsed(),
        SHUTDOWN_DEADLINE,
        "bounded by the deadline"
    );
    assert_eq!(report.released, 1);
    assert_eq!(report.released_units, 95);
    assert_eq!(report.abandoned, 1);
    assert_eq!(report.abandoned_units, 15, "100 - 75 spent - 10 still held");
    assert!(!report.task_died);
    assert_eq!(report.stats, counters.stats());
    assert_eq!(report.stats.abandoned, 1);
    assert_eq!(
        h.allocator.timed_calls()[calls_before..],
        [(since, release(2, 95))],
        "the quiescent lease is released as the shutdown starts; the held one never"
    );
    assert_eq!(h.serving(), None, "requests are denied once stopped");
    assert!(!*readiness.borrow_and_update());
    drop(held);
}

/// A lease whose last request ends inside the deadline is released then,
/// with its exact remainder; shutdown returns as soon as nothing is left
/// (I25, I26).
#[tokio::test(start_paused = true)]
async fn shutdown_waits_for_a_held_lease_to_quiesce_and_then_releases_it() {
    let mut h = Harness::started(Scripted::new()).await;
    let held = h.reserve(10);
    rotate_once(&h, 75).await;
    let calls_before = h.allocator.calls().len();
    // Shut down a second after the calls before, and well before the next
    // poll, so each call's instant says whether shutdown made it and when.
    sleep(secs(1)).await;
    // The request lets go between two of wind-down's looks at the lease
    // (every 5 ms), so the look that finds it quiet is not a tie with the
    // let-go.
    let lets_go = secs(1) + ms(2);
    let quiet_seen = secs(1) + ms(5);
    let ends_later = tokio::spawn(async move {
        sleep(lets_go).await;
        drop(held);
    });

    let began = Instant::now();
    let since = began.duration_since(h.allocator.began);
    let report = h.shutdown().await;
    let elapsed = began.elapsed();
    ends_later.await.expect("the request task ends");

    assert_eq!(
        elapsed, quiet_seen,
        "returns once the held lease is released, not at the deadline"
    );
    assert_eq!(
        h.allocator.timed_calls()[calls_before..],
        [
            (since, release(2, 100)),
            (since + quiet_seen, release(1, 25)),
        ],
        "the quiescent lease at once; the held one at the first look after its request let go"
    );
    assert_eq!((report.released, report.released_units), (2, 125));
    assert_eq!((report.abandoned, report.abandoned_units), (0, 0));
}

/// I22, I25: a release that hangs at shutdown cannot stretch it past the
/// deadline. Cut off at its timeout, it is tried once more a call's
/// timeout before the deadline, hangs again, and the lease is abandoned to
/// TTL reclaim and reported.
#[tokio::test(start_paused = true)]
async fn a_hung_release_cannot_stretch_shutdown_past_its_deadline() {
    let allocator = Scripted::new();
    allocator.plan_releases(1, vec![Reply::Hang; 8]);
    let mut h = Harness::started(allocator).await;

    let began = Instant::now();
    let report = h.shutdown().await;

    assert_eq!(began.elapsed(), SHUTDOWN_DEADLINE);
    assert_eq!(
        h.allocator.timed_calls()[1..],
        [
            (Duration::ZERO, release(1, 100)),
            (
                SHUTDOWN_DEADLINE.saturating_sub(CALL_TIMEOUT),
                release(1, 100)
            ),
        ]
    );
    assert_eq!((report.released, report.abandoned), (0, 1));
    assert_eq!(report.abandoned_units, 100);
    // The second's timeout falls on the deadline itself, so it is counted
    // as timed out or cut off, as the two timers are polled.
    assert!(
        (1..=2).contains(&report.stats.release_timeouts),
        "{:?}",
        report.stats
    );
}

/// I22, I25, I26: a shutdown that arrives while a steady-state release
/// hangs cuts that call short at once, not after its timeout, and the lease
/// goes back to the front of the parked list, never dropped: the call may
/// or may not have settled it, so wind-down asks again, then returns the
/// other parked leases and the serving one. None is abandoned.
#[tokio::test(start_paused = true)]
async fn a_shutdown_during_a_hung_release_asks_again_and_returns_every_lease() {
    let allocator = Scripted::new();
    allocator.plan_releases(1, [Reply::Hang, Reply::Grant(0)]);
    let mut h = Harness::started(allocator).await;
    three_parked_leases(&h).await;
    h.allocator.calls_reach(5).await;
    settle().await;
    assert_eq!(h.allocator.timed_calls()[4], (POLL, release(1, 25)));

    let began = Instant::now();
    let report = h.shutdown().await;

    assert_eq!(
        began.elapsed(),
        Duration::ZERO,
        "the hung call is not waited for"
    );
    assert_eq!(
        h.allocator.timed_calls()[4..],
        [
            (POLL, release(1, 25)),
            (POLL, release(1, 25)),
            (POLL, release(2, 25)),
            (POLL, release(3, 25)),
            (POLL, release(4, 100)),
        ],
        "lease 1 keeps its turn, then the others and the serving lease"
    );
    assert_eq!((report.released, report.released_units), (4, 175));
    assert_eq!((report.abandoned, report.abandoned_units), (0, 0));
    assert_eq!(report.stats.release_timeouts, 0, "cut short, not timed out");
    assert!(!report.faulted);
    assert!(!report.task_died);
}

/// I25, I26: a lease whose release at shutdown is answered "settled
/// already" or "fenced" is done with: counted released (it left the books
/// settled or disowned), asked once, neither abandoned nor a fault, and
/// shutdown returns at once rather than wait out its deadline.
#[tokio::test(start_paused = true)]
async fn a_release_refused_as_settled_or_fenced_at_shutdown_is_done_with_at_once() {
    for error in [
        AllocateError::LeaseNotActive,
        AllocateError::UnknownLease,
        AllocateError::Fenced,
    ] {
        let allocator = Scripted::new();
        allocator.plan_releases(1, [Reply::Refuse(error.clone())]);
        let mut h = Harness::started(allocator).await;
        h.spend(30);

        let began = Instant::now();
        let report = h.shutdown().await;

        assert_eq!(began.elapsed(), Duration::ZERO, "{error}");
        assert_eq!(
            h.allocator.calls(),
            [acquire(), release(1, 70)],
            "{error}: not asked again"
        );
        assert_eq!((report.released, report.released_units), (1, 0), "{error}");
        assert_eq!(
            (report.abandoned, report.abandoned_units),
            (0, 0),
            "{error}"
        );
        assert!(!report.faulted, "{error}");
        assert_eq!(report.stats.release_refused_for(&error), 1, "{error}");
    }
}

/// I22, I25, I26: a release that fails at shutdown may or may not have
/// settled, so the lease is kept and asked again once the store has had the
/// poll interval to recover, for as long as the deadline allows: an answer
/// then returns it; a store still failing at the deadline leaves it
/// abandoned to TTL reclaim, never dropped as if settled. When the next poll
/// would come later than one call's timeout before the deadline, the last
/// try comes then instead, so a poll as long as the deadline (the default
/// here) still leaves a retry, and one with its full timeout.
#[tokio::test(start_paused = true)]
async fn a_release_that_fails_at_shutdown_is_retried_until_the_deadline() {
    let second = Duration::from_secs(1);
    let last_try = SHUTDOWN_DEADLINE.saturating_sub(CALL_TIMEOUT);
    let recovers = || vec![Reply::Refuse(storage_error()), Reply::Grant(0)];
    let keeps_failing = vec![Reply::Refuse(storage_error()); 8];
    // The poll, the store's answers, when releases are asked, how many of
    // them fail, how long shutdown takes, and the (released, abandoned)
    // counts.
    let cases = [
        (
            "recovers",
            second,
            recovers(),
            vec![Duration::ZERO, second],
            1,
            second,
            (1, 0),
        ),
        (
            "keeps failing",
            second,
            keeps_failing,
            vec![Duration::ZERO, second, second * 2, last_try],
            4,
            SHUTDOWN_DEADLINE,
            (0, 1),
        ),
        (
            "recovers, polling past the deadline",
            POLL,
            recovers(),
            vec![Duration::ZERO, last_try],
            1,
            last_try,
            (1, 0),
        ),
        // A poll landing less than a call's timeout before the deadline
        // would leave the retry a short call.
        (
            "recovers, polling just before the deadline",
            SHUTDOWN_DEADLINE.saturating_sub(CALL_TIMEOUT / 2),
            recovers(),
            vec![Duration::ZERO, last_try],
            1,
            last_try,
            (1, 0),
        ),
    ];
    for (label, poll, replies, asked_at, failed, took, (released, abandoned)) in cases {
        let allocator = Scripted::new();
        allocator.plan_releases(1, replies);
        let mut h = Harness::started_with(
            allocator,
            LeaseManagerConfig {
                poll_interval: poll,
                ..config()
            },
        )
        .await;
        h.spend(30);

        let began = Instant::now();
        let report = h.shutdown().await;

        assert_eq!(began.elapsed(), took, "{label}");
        let asked: Vec<_> = asked_at.iter().map(|at| (*at, release(1, 70))).collect();
        assert_eq!(h.allocator.timed_calls()[1..], asked, "{label}");
        assert_eq!(
            report.stats.release_refused_for(&storage_error()),
            failed,
            "{label}"
        );
        assert_eq!(
            (report.released, report.abandoned),
            (released, abandoned),
            "{label}"
        );
        assert_eq!(
            report.released_units + report.abandoned_units,
            70,
            "{label}: the lease's units, returned or left to reclaim"
        );
        assert!(!report.faulted, "{label}");
    }
}

/// No grant call starts once shutdown is asked for, even when the stop
/// arrives together with the answer of the release pass that comes first:
/// the answer counts, and the empty slot is not refilled. A grant cut off
/// after it was sent would strand its lease until reclaim.
#[tokio::test(start_paused = true)]
async fn a_stop_that_arrives_with_a_release_answer_starts_no_grant() {
    let allocator = Scripted::new();
    let gate = Arc::new(Notify::new());
    allocator.plan_releases(
        1,
        [Reply::Gated(Arc::clone(&gate), Box::new(Reply::Grant(0)))],
    );
    let mut h = Harness::started(allocator).await;
    h.spend(30);
    // The lease lapses: the next poll empties the slot and releases it,
    // and the release waits at the gate.
    h.clock.advance(TTL - MARGIN);
    h.allocator.calls_reach(2).await;
    settle().await;
    assert_eq!(h.serving(), None, "the lapsed lease left the slot");

    // The answer and the stop are both ready before the task runs again.
    gate.notify_one();
    let report = h.shutdown().await;

    assert_eq!(
        h.allocator.calls(),
        [acquire(), release(1, 70)],
        "no grant call after the stop"
    );
    assert_eq!(report.stats.released, 1, "the release's answer counted");
    assert_eq!(report.stats.acquired, 1, "only the cold start");
    assert_eq!((report.abandoned, report.stats.uncertain_acquires), (0, 0));
    assert_eq!(h.serving(), None);
}

/// I27: the same holds when the step after the release pass would be a
/// fold, which is a grant call too (a fold cut off after it was sent may
/// have granted a lease nobody holds) and has no check of its own before
/// it is sent: the stop that arrives with the pass's answer is acted on
/// before the serving lease is taken out to be folded.
#[tokio::test(start_paused = true)]
async fn a_stop_that_arrives_with_a_release_answer_starts_no_fold() {
    let allocator = Scripted::new();
    let gate = Arc::new(Notify::new());
    allocator.plan_releases(
        1,
        [Reply::Gated(Arc::clone(&gate), Box::new(Reply::Grant(0)))],
    );
    let mut h = Harness::started(allocator).await;
    // Lease 1 is replaced at low water and parked, quiet, with 20 left.
    rotate_once(&h, 80).await;
    assert_eq!(h.serving(), Some((2, TARGET)));
    // Lease 2, quiet, refuses a quote no evidence rules out: its ring
    // starts an inspection whose release pass waits at the gate, with a
    // fold to follow.
    h.refused(150);
    h.allocator.calls_reach(3).await;
    settle().await;
    assert_eq!(h.allocator.calls()[2], release(1, 20));

    // The answer and the stop are both ready before the task runs again.
    gate.notify_one();
    let report = h.shutdown().await;

    assert_eq!(
        h.allocator.calls(),
        [acquire(), acquire(), release(1, 20), release(2, TARGET)],
        "no fold after the stop: lease 2 is released whole at wind-down"
    );
    assert_eq!(report.stats.released, 2, "the release's answer counted");
    assert_eq!(report.stats.consolidated, 0);
    assert_eq!((report.abandoned, report.stats.uncertain_acquires), (0, 0));
}

/// The same holds for the grant call that follows a fold in one inspection:
/// a fold answered "the lease is gone" together with the stop leaves the
/// slot empty rather than start an acquire.
#[tokio::test(start_paused = true)]
async fn a_stop_that_arrives_with_a_fold_answer_starts_no_grant() {
    let allocator = Scripted::new();
    let gate = Arc::new(Notify::new());
    allocator.plan_consolidations([Reply::Gated(
        Arc::clone(&gate),
        Box::new(Reply::Refuse(AllocateError::LeaseNotActive)),
    )]);
    let mut h = Harness::started(allocator).await;
    h.fold_a_refused_quote().await;
    assert!(matches!(h.allocator.calls()[1], Call::Consolidate { .. }));

    gate.notify_one();
    let report = h.shutdown().await;

    assert_eq!(h.allocator.calls().len(), 2, "no grant call after the stop");
    assert_eq!(report.stats.acquired, 1, "only the cold start");
    assert_eq!(report.stats.uncertain_acquires, 0);
    assert_eq!(h.serving(), None);
}

/// Shutdown is acted on inside a hung acquire, not after its timeout; the
/// grant that call may have made is counted uncertain.
#[tokio::test(start_paused = true)]
async fn shutdown_cuts_a_hanging_acquire_short_at_once() {
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::Hang]);
    let mut h = Harness::started(allocator).await;

    let began = Instant::now();
    let report = h.shutdown().await;

    assert_eq!(began.elapsed(), Duration::ZERO);
    assert_eq!((report.released, report.abandoned), (0, 0));
    assert!(!report.task_died);
    assert_eq!(report.stats.uncertain_acquires, 1);
    assert_eq!(report.stats.acquire_timeouts, 0);
}

/// I25, I26: shutdown is acted on inside a hung fold too, not after its
/// timeout. The fold may have committed, so it counts as uncertain (not as
/// a timeout), and the folded lease is parked, never dropped: wind-down
/// releases it with its exact unspent units (a fold that had committed
/// would be answered "not active" there).
#[tokio::test(start_paused = true)]
async fn shutdown_cuts_a_hanging_fold_short_and_releases_the_folded_lease() {
    let allocator = Scripted::new();
    allocator.plan_consolidations([Reply::Hang]);
    let mut h = Harness::started(allocator).await;
    h.fold_a_refused_quote().await;
    assert_eq!(h.serving(), None, "out of the slot while it is folded");

    let began = Instant::now();
    let report = h.shutdown().await;

    assert_eq!(began.elapsed(), Duration::ZERO);
    assert_eq!(
        h.allocator.calls(),
        [
            acquire(),
            Call::Consolidate {
                lease: 1,
                unspent: 30,
                requested: 130,
                needed: 50,
            },
            release(1, 30),
        ]
    );
    assert_eq!((report.released, report.released_units), (1, 30));
    assert_eq!((report.abandoned, report.abandoned_units), (0, 0));
    assert!(!report.task_died);
    assert_eq!(report.stats.uncertain_acquires, 1);
    assert_eq!(report.stats.acquire_timeouts, 0);
    assert_eq!(report.stats.consolidated, 0);
}

/// Dropping the handle aborts the task: readiness falls, no further call is
/// made, and the serving lease is left to its window and TTL reclaim.
#[tokio::test(start_paused = true)]
async fn dropping_the_handle_aborts_the_task() {
    let mut h = Harness::started(Scripted::new()).await;
    let readiness = h.manager().readiness();
    assert!(*readiness.borrow());

    drop(h.manager.take());
    settle().await;

    assert!(!*readiness.borrow(), "an aborted task withdraws readiness");
    h.spend(90);
    sleep(POLL * 5).await;
    assert_eq!(h.allocator.calls(), [acquire()], "nothing runs any more");
    assert_eq!(h.serving(), Some((1, 10)));
}

/// A task that dies says so: the report is flagged, and the grant request
/// it died in is counted uncertain.
#[tokio::test(start_paused = true)]
async fn a_task_that_panics_is_reported_dead() {
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::Panic]);
    let mut h = Harness::start(allocator);
    h.allocator.calls_reach(1).await;
    settle().await;

    assert!(h.manager().is_finished());
    assert_eq!(h.manager().health(), LeaseHealth::Stopped);
    assert!(!h.ready());
    let report = h.shutdown().await;
    assert!(report.task_died);
    assert_eq!((report.released, report.abandoned), (0, 0));
    assert_eq!(report.stats.uncertain_acquires, 1);
}

/// A task that dies while it folds a lease (here: the allocator panics in
/// the call) reports that lease abandoned: it was in neither the slot nor
/// the parked list, but it settles at reclaim all the same.
#[tokio::test(start_paused = true)]
async fn a_task_that_dies_folding_a_lease_reports_it_abandoned() {
    let allocator = Scripted::new();
    allocator.plan_consolidations([Reply::Panic]);
    let mut h = Harness::started(allocator).await;
    h.fold_a_refused_quote().await;
    assert!(h.manager().is_finished());
    let report = h.shutdown().await;
    assert!(report.task_died);
    assert_eq!((report.abandoned, report.abandoned_units), (1, 30));
}

// ------------------------------------------------------ stats and config

/// I1: totals across accounts never wrap. Every field, the per-variant
/// arrays' every entry included, holds a value of its own on each side, so
/// a sum that adds a field to itself or to its neighbour shows up against
/// the whole expected total.
#[test]
fn lease_stats_add_field_by_field_and_refuse_to_wrap() {
    let index = |i: usize| u64::try_from(i).expect("a small index");
    let one = LeaseStats {
        acquired: 1,
        acquired_units: 2,
        acquire_timeouts: 3,
        uncertain_acquires: 4,
        refused: std::array::from_fn(|i| 100 + index(i)),
        released: 5,
        released_units: 6,
        release_timeouts: 7,
        release_refused: std::array::from_fn(|i| 200 + index(i)),
        abandoned: 8,
        consolidated: 9,
        consolidations_deferred: 10,
    };
    let other = LeaseStats {
        acquired: 1_000,
        acquired_units: 2_000,
        acquire_timeouts: 3_000,
        uncertain_acquires: 4_000,
        refused: std::array::from_fn(|i| 300 + 2 * index(i)),
        released: 5_000,
        released_units: 6_000,
        release_timeouts: 7_000,
        release_refused: std::array::from_fn(|i| 500 + 2 * index(i)),
        abandoned: 8_000,
        consolidated: 9_000,
        consolidations_deferred: 10_000,
    };

    let sum = one.checked_add(&other).expect("small sums fit");
    assert_eq!(
        sum,
        LeaseStats {
            acquired: 1_001,
            acquired_units: 2_002,
            acquire_timeouts: 3_003,
            uncertain_acquires: 4_004,
            refused: std::array::from_fn(|i| 400 + 3 * index(i)),
            released: 5_005,
            released_units: 6_006,
            release_timeouts: 7_007,
            release_refused: std::array::from_fn(|i| 700 + 3 * index(i)),
            abandoned: 8_008,
            consolidated: 9_009,
            consolidations_deferred: 10_010,
        },
        "field by field"
    );
    assert_eq!(
        sum.refused_for(&AllocateError::Fenced),
        400 + 3 * index(AllocateError::Fenced.index())
    );

    let full = LeaseStats {
        acquired_units: u64::MAX,
        ..LeaseStats::default()
    };
    assert_eq!(full.checked_add(&one), None);
    let mut full = LeaseStats::default();
    full.release_refused[0] = u64::MAX;
    let mut one_more = LeaseStats::default();
    one_more.release_refused[0] = 1;
    assert_eq!(full.checked_add(&one_more), None);
    assert_eq!(full.checked_add(&LeaseStats::default()), Some(full));
}

#[track_caller]
fn check(
    change: impl FnOnce(&mut LeaseManagerConfig),
    expected: Result<(), LeaseManagerConfigError>,
) {
    let mut config = config();
    change(&mut config);
    assert_eq!(config.validate(), expected);
    if let Err(broken) = expected {
        assert!(broken.to_string().starts_with("lease manager: "));
    }
}

/// I17: validation names the first broken rule, in field order.
#[test]
fn validate_names_the_first_broken_rule() {
    use LeaseManagerConfigError as Broken;
    check(|_| {}, Ok(()));
    check(
        |c| c.target_grant = CostUnits::ZERO,
        Err(Broken::TargetGrantZero),
    );
    check(
        |c| {
            c.target_grant = CostUnits::ZERO;
            c.lease_ttl = SignedDuration::ZERO;
        },
        Err(Broken::TargetGrantZero),
    );
    check(
        |c| c.low_water = CostUnits(TARGET),
        Err(Broken::LowWaterNotBelowTargetGrant),
    );
    check(|c| c.low_water = CostUnits(TARGET - 1), Ok(()));
    check(
        |c| c.lease_ttl = SignedDuration::ZERO,
        Err(Broken::LeaseTtlNotPositive),
    );
    check(
        |c| c.lease_ttl = SignedDuration::from_secs(-1),
        Err(Broken::LeaseTtlNotPositive),
    );
    // Every store refuses a lease shorter than a microsecond.
    check(
        |c| c.lease_ttl = SignedDuration::from_nanos(999),
        Err(Broken::LeaseTtlNotPositive),
    );
    check(
        |c| c.expiry_safety_margin = SignedDuration::from_nanos(-1),
        Err(Broken::ExpirySafetyMarginNegative),
    );
    check(|c| c.expiry_safety_margin = SignedDuration::ZERO, Ok(()));
    check(
        |c| c.expiry_safety_margin = TTL,
        Err(Broken::ExpirySafetyMarginNotBelowLeaseTtl),
    );
    check(
        |c| c.poll_interval = Duration::ZERO,
        Err(Broken::PollIntervalBelowTimerResolution),
    );
    // I17: a poll or a call bound under the timer's millisecond would not
    // be kept (a release pass would end before its first call).
    check(
        |c| c.poll_interval = Duration::from_micros(999),
        Err(Broken::PollIntervalBelowTimerResolution),
    );
    check(
        |c| c.store_call_timeout = Duration::from_micros(999),
        Err(Broken::StoreCallTimeoutBelowTimerResolution),
    );
    check(
        |c| {
            c.poll_interval = ms(1);
            c.store_call_timeout = ms(1);
        },
        Ok(()),
    );
    check(
        |c| {
            c.poll_interval = Duration::ZERO;
            c.shutdown_release_deadline = Duration::ZERO;
        },
        Err(Broken::PollIntervalBelowTimerResolution),
    );
    check(
        |c| c.store_call_timeout = Duration::ZERO,
        Err(Broken::StoreCallTimeoutBelowTimerResolution),
    );
    // TTL 60 s less a 5 s margin: the poll and one 500 ms call must fit
    // in the 55 s window.
    check(
        |c| c.poll_interval = ms(54_500),
        Err(Broken::ReplacementLeadNotBelowUsableWindow),
    );
    check(|c| c.poll_interval = ms(54_499), Ok(()));
    check(
        |c| c.expiry_safety_margin = SignedDuration::MIN,
        Err(Broken::ExpirySafetyMarginNegative),
    );
    check(
        |c| c.shutdown_release_deadline = Duration::ZERO,
        Err(Broken::ShutdownReleaseDeadlineZero),
    );
    assert_eq!(
        Broken::LowWaterNotBelowTargetGrant.to_string(),
        "lease manager: low_water must be below target_grant"
    );
}

/// The per-instance settings give every account the same complete config.
#[test]
fn account_settings_complete_to_the_same_config_for_each_account() {
    let full = config();
    let shared = AccountLeaseConfig {
        target_grant: full.target_grant,
        low_water: full.low_water,
        lease_ttl: full.lease_ttl,
        expiry_safety_margin: full.expiry_safety_margin,
        poll_interval: full.poll_interval,
        store_call_timeout: full.store_call_timeout,
        shutdown_release_deadline: full.shutdown_release_deadline,
    };
    assert_eq!(shared.for_account(ACCOUNT), full);
    assert_eq!(shared.for_account(AccountId(9)).account, AccountId(9));
    assert_eq!(shared.validate(), Ok(()));
    let broken = AccountLeaseConfig {
        low_water: CostUnits(TARGET),
        ..shared
    };
    assert_eq!(
        broken.validate(),
        Err(LeaseManagerConfigError::LowWaterNotBelowTargetGrant)
    );
}

/// I17: an invalid config starts nothing.
#[tokio::test(start_paused = true)]
async fn spawn_refuses_an_invalid_config_and_calls_nothing() {
    let allocator = Scripted::new();
    let refused = LeaseManager::spawn(
        Arc::clone(&allocator) as Arc<dyn LeaseAllocator>,
        Arc::new(LeaseSlot::new(ACCOUNT, LocalSharding::Single)),
        Arc::new(ManualClock::new(start())),
        LeaseManagerConfig {
            poll_interval: Duration::ZERO,
            ..config()
        },
    );
    assert_eq!(
        refused.err(),
        Some(LeaseManagerConfigError::PollIntervalBelowTimerResolution)
    );
    sleep(POLL).await;
    assert!(allocator.calls().is_empty());
}

/// A clock that may read up to `staleness` behind the true time.
#[derive(Debug)]
struct LaggingClock {
    staleness: Duration,
}

impl Clock for LaggingClock {
    fn now(&self) -> Timestamp {
        start()
    }

    fn staleness_bound(&self) -> Duration {
        self.staleness
    }
}

/// I2: the margin closes a lease's window before the grant expires even on
/// a clock reading behind; spawn refuses one shorter than the clock's
/// staleness bound, whoever spawns the manager, and accepts one equal to it.
#[tokio::test(start_paused = true)]
async fn spawn_refuses_a_margin_shorter_than_the_clock_may_lag() {
    let allocator = Scripted::new();
    let spawn = |staleness| {
        LeaseManager::spawn(
            Arc::clone(&allocator) as Arc<dyn LeaseAllocator>,
            Arc::new(LeaseSlot::new(ACCOUNT, LocalSharding::Single)),
            Arc::new(LaggingClock { staleness }),
            config(),
        )
    };
    let margin = Duration::try_from(MARGIN).expect("a positive margin");
    assert_eq!(
        spawn(margin + ms(1)).err(),
        Some(LeaseManagerConfigError::ExpirySafetyMarginBelowClockStaleness)
    );
    sleep(POLL).await;
    assert!(allocator.calls().is_empty(), "nothing was started");
    let manager = spawn(margin).expect("a margin equal to the lag suffices");
    allocator.calls_reach(1).await;
    drop(manager);
}

// ------------------------------------------------------- the memory store

fn memory_store(balance: u64, now: Timestamp) -> (Arc<MemoryStore>, AccountId) {
    memory_store_with(SignedDuration::from_hours(1), balance, now)
}

/// [`memory_store`], granting leases for at most `max_ttl`.
fn memory_store_with(
    max_ttl: SignedDuration,
    balance: u64,
    now: Timestamp,
) -> (Arc<MemoryStore>, AccountId) {
    let store = MemoryStore::new(GrantPolicy {
        max_ttl,
        reclaim_grace: SignedDuration::from_mins(1),
        tail: TailSharing {
            instances: 1,
            min_grant: CostUnits(1),
        },
    })
    .expect("the test policy is valid");
    let account = store
        .create_account(
            AccountSpec {
                balance: CostUnits(balance),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            now,
        )
        .expect("the account opens");
    (Arc::new(store), account)
}

fn spawn_on(store: &Arc<MemoryStore>, account: AccountId) -> (LeaseManager, Arc<LeaseSlot>) {
    let slot = Arc::new(LeaseSlot::new(
        account,
        LocalSharding::shards(4).expect("four shards"),
    ));
    let manager = LeaseManager::spawn(
        Arc::clone(store) as Arc<dyn LeaseAllocator>,
        Arc::clone(&slot),
        Arc::new(ManualClock::new(start())),
        LeaseManagerConfig {
            account,
            ..config()
        },
    )
    .expect("the test configuration is valid");
    (manager, slot)
}

/// Runs one request through the slot: reserve, commit, bill. Returns the
/// units charged.
async fn serve_request(
    store: &MemoryStore,
    slot: &LeaseSlot,
    request: u128,
    quote: u64,
) -> Option<u64> {
    let now = start();
    let mut reservation = slot
        .with_lease(|lease| lease.map(|lease| Reservation::reserve(lease, CostUnits(quote), now)))?
        .ok()?;
    reservation
        .commit_owned(now, CommitFunding::LeaseOnly)
        .expect("commits inside the window");
    let event = reservation
        .usage_event(RequestId(request), now, PolicyRevision::UNSTATED, None)
        .expect("a committed reservation bills");
    let outcomes = store
        .ingest(&[event])
        .await
        .expect("the memory store answers");
    assert_eq!(outcomes, [tollgate::store::IngestOutcome::Accepted]);
    Some(quote)
}

/// I14, I15: a run with rotations, cancellations and a consolidation, then a
/// graceful shutdown, leaves the books balanced: every unit is either spent
/// and billed or back in the balance.
#[tokio::test(start_paused = true)]
async fn on_a_memory_store_spending_rotation_and_shutdown_leave_the_ledger_balanced() {
    const INITIAL: u64 = 2_000;
    let (store, account) = memory_store(INITIAL, start());
    let (manager, slot) = spawn_on(&store, account);
    settle().await;

    let mut committed = 0;
    let mut request = 0;
    for round in 0..60_u64 {
        request += 1;
        let quote = 3 + round % 11;
        // The balance covers every quote, and the lease is restocked
        // between rounds: every request is served.
        committed += serve_request(&store, &slot, request, quote)
            .await
            .unwrap_or_else(|| panic!("round {round}: the request is funded"));
        // A request that leaves before execution pays nothing (I4).
        let cancelled = slot.with_lease(|lease| {
            Reservation::reserve(lease.expect("a lease serves"), CostUnits(2), start())
        });
        drop(cancelled.expect("the cancelled request was admitted"));
        if round == 30 {
            // More than any lease holds: refused, then folded (I18).
            let refused = slot.with_lease(|lease| {
                Reservation::reserve(lease.expect("a lease serves"), CostUnits(150), start())
                    .map(|_| ())
            });
            assert_eq!(refused, Err(DenyReason::LeaseExhausted));
            settle().await;
            request += 1;
            committed += serve_request(&store, &slot, request, 150)
                .await
                .expect("the folded grant funds the large quote");
        }
        settle().await;
        if round % 20 == 19 {
            sleep(POLL).await;
        }
    }
    let report = manager.shutdown().await;

    assert!(!report.task_died);
    assert_eq!(report.abandoned, 0, "nothing was held at shutdown");
    assert_eq!(report.stats.consolidated, 1);
    assert!(report.stats.acquired >= 4, "it rotated: {:?}", report.stats);
    assert_eq!(
        report.stats.acquired_units - report.stats.released_units,
        committed,
        "granted minus credited back is exactly what was spent"
    );
    assert_eq!(store.audit().expect("the store answers"), []);
    let view = store.account(account, start()).expect("the account exists");
    assert_eq!(view.balance.get() + committed, INITIAL);
    assert_eq!(view.leased, CostUnits::ZERO, "every lease was settled");
    assert_eq!(
        view.settled_unbilled,
        CostUnits::ZERO,
        "every charge was billed"
    );
    assert_eq!(
        slot.load_observed().map(|lease| lease.grant().lease_id),
        None
    );
}

/// A store whose `max_ttl` leaves a grant usable for no longer than the
/// replacement lead makes every poll replace the lease; the manager says so,
/// once, naming the likely cause.
#[tokio::test(start_paused = true)]
async fn a_grant_too_short_to_outlast_the_replacement_lead_is_reported_once() {
    let (logs, _guard) = support::logs::Logs::capture();
    // Usable for 15 s − the 5 s margin = 10 s: within the 10.5 s replacement
    // lead (poll + store call).
    let (store, account) = memory_store_with(SignedDuration::from_secs(15), 100_000, start());
    let (manager, slot) = spawn_on(&store, account);
    settle().await;
    let first = slot
        .load_observed()
        .expect("a lease serves")
        .grant()
        .lease_id;
    for _ in 0..3 {
        sleep(POLL).await;
        settle().await;
    }
    let serving = slot
        .load_observed()
        .expect("a lease serves")
        .grant()
        .lease_id;
    assert_ne!(serving, first, "the short-lived lease was replaced");
    let warnings = logs.lines_with("no longer than the replacement lead");
    assert_eq!(warnings.len(), 1, "{}", logs.text());
    assert!(warnings[0].contains("max_ttl"), "{}", warnings[0]);
    let report = manager.shutdown().await;
    assert_eq!(report.abandoned, 0, "every lease went back: {report:?}");
}

/// An account out of funds is the customer's state, answered 402 and
/// counted: its refused acquires, one a poll, log nothing at warning
/// level. An allocator that does not answer is the operator's to see: that
/// warns, naming the account.
#[tokio::test(start_paused = true)]
async fn an_account_out_of_funds_is_not_a_warning_and_an_outage_is() {
    let (logs, _guard) = support::logs::Logs::capture();
    let allocator = Scripted::new();
    allocator.plan_acquires([
        exhausted(None),
        exhausted(None),
        exhausted(None),
        Reply::Refuse(storage_error()),
    ]);
    let h = Harness::started(allocator).await;
    h.allocator.calls_reach(3).await;
    settle().await;
    assert_eq!(h.serving(), None);
    assert!(
        logs.lines_with("WARN").is_empty(),
        "out of funds, polled three times: {}",
        logs.text()
    );
    h.allocator.calls_reach(4).await;
    settle().await;
    let warnings = logs.lines_with("WARN");
    assert_eq!(warnings.len(), 1, "{}", logs.text());
    assert!(
        warnings[0].contains("requests on this account are denied")
            && warnings[0].contains(&format!("account={}", h.slot.account())),
        "{}",
        warnings[0]
    );
}

/// An outage warns once per account and spell without a lease that
/// serves, not at every retry: over thousands of accounts, a warning per
/// retry wrote tens of megabytes a minute while the store was away. Once
/// a grant serves, the next spell warns again.
#[tokio::test(start_paused = true)]
async fn an_outage_warns_once_per_spell_not_at_every_retry() {
    let (logs, _guard) = support::logs::Logs::capture();
    let denied = |logs: &support::logs::Logs| {
        logs.lines_with("WARN")
            .iter()
            .filter(|line| line.contains("requests on this account are denied"))
            .count()
    };
    let allocator = Scripted::new();
    let outage = || Reply::Refuse(storage_error());
    allocator.plan_acquires([outage(), outage(), outage(), outage(), Reply::Grant(TARGET)]);
    allocator.plan_acquires([outage(), outage(), outage()]);
    let h = Harness::started(allocator).await;
    h.allocator.calls_reach(4).await;
    settle().await;
    assert_eq!(h.serving(), None);
    assert_eq!(
        denied(&logs),
        1,
        "four failures, one spell: {}",
        logs.text()
    );
    h.allocator.calls_reach(5).await;
    settle().await;
    assert_eq!(h.serving(), Some((1, TARGET)));
    // The lease's window closes with the store away again: a new spell.
    h.clock.advance(TTL);
    h.allocator.calls_reach(8).await;
    settle().await;
    assert_eq!(h.serving(), None);
    assert_eq!(
        denied(&logs),
        2,
        "a second spell warns once: {}",
        logs.text()
    );
}

/// I29: a lease whose replacement keeps failing is retired as its window
/// closes, not at the next poll, so readiness stops saying it serves the
/// moment it stops serving. Before, the last attempt one store call before
/// the close left the next inspection a whole poll later.
#[tokio::test(start_paused = true)]
async fn readiness_falls_as_a_lease_closes_after_its_replacement_failed() {
    let allocator = Scripted::new();
    allocator.plan_acquires(
        std::iter::once(Reply::Grant(TARGET))
            .chain(std::iter::repeat_n(Reply::Refuse(storage_error()), 16)),
    );
    let h = Harness::started(allocator).await;
    let window = Duration::try_from(TTL - MARGIN).expect("positive");
    let step = ms(100);
    let mut elapsed = Duration::ZERO;
    while elapsed < window + secs(1) {
        h.clock
            .advance(SignedDuration::try_from(step).expect("small"));
        tokio::time::advance(step).await;
        settle().await;
        elapsed += step;
        assert_eq!(h.ready(), elapsed < window, "at {elapsed:?}");
    }
    assert_eq!(h.serving(), None, "the closed lease left the slot");
    let acquires = h
        .allocator
        .calls()
        .iter()
        .filter(|call| matches!(call, Call::Acquire { .. }))
        .count();
    assert!(acquires >= 2, "its replacement was tried and failed");
}

/// I5, I29: a lease drained while the allocator cannot be reached serves
/// nobody (admission answers `LeaseUnavailable`), so readiness falls then,
/// not only when its window closes, and comes back with the next grant.
/// With units left it stays ready, though its replacement failed: it still
/// serves what they cover.
#[tokio::test(start_paused = true)]
async fn readiness_falls_when_the_lease_drains_while_the_allocator_is_away() {
    let allocator = Scripted::new();
    allocator.plan_acquires([
        Reply::Grant(TARGET),
        Reply::Refuse(storage_error()),
        Reply::Refuse(storage_error()),
        Reply::Grant(TARGET),
    ]);
    let h = Harness::started(allocator).await;
    assert!(h.ready());
    // Past low water: the ring asks for a replacement, which fails.
    h.spend(TARGET - LOW_WATER + 1);
    h.allocator.calls_reach(2).await;
    settle().await;
    assert!(h.ready(), "units left: the lease still serves");
    // Drained: the next inspection finds nothing left and nobody to ask.
    h.spend(LOW_WATER - 1);
    sleep(POLL).await;
    settle().await;
    assert_eq!(
        h.serving(),
        Some((1, 0)),
        "the drained lease is still in the slot"
    );
    assert!(
        !h.ready(),
        "I29: a drained lease with no allocator serves nobody"
    );
    // The allocator answers again: the next attempt's grant serves.
    h.run_for(60).await;
    assert_eq!(
        h.serving().map(|(_, units)| units),
        Some(TARGET),
        "a new grant serves"
    );
    assert!(h.ready(), "ready again with the grant");
}

/// A lease's early wake-ups come once each: with a clock that reads behind
/// tokio's time (here, one that stands still), a lease inside its last
/// store call before the close whose replacement keeps failing is retried
/// at the poll, not every time the stale reading says the close is near.
#[tokio::test(start_paused = true)]
async fn a_clock_that_reads_behind_does_not_turn_early_wake_ups_into_a_loop() {
    let allocator = Scripted::new();
    // Refused, not unanswered, so no backoff spaces the attempts out: each
    // inspection makes one, and counting them counts the wake-ups.
    allocator.plan_acquires(
        std::iter::once(Reply::Grant(TARGET)).chain(std::iter::repeat_n(
            Reply::Refuse(AllocateError::AccountInactive),
            64,
        )),
    );
    let h = Harness::started(allocator).await;
    // 0.4 s of the window left, less than one store call; the clock then
    // stands still while a minute of tokio time passes.
    h.clock
        .advance(TTL - MARGIN - SignedDuration::from_millis(400));
    sleep(secs(60)).await;
    let at: Vec<Duration> = h
        .allocator
        .timed_calls()
        .iter()
        .map(|(at, call)| {
            assert_eq!(*call, acquire(), "only acquires are made");
            *at
        })
        .collect();
    // The cold start; the poll at 10 s, which finds 0.4 s of the window
    // left, less than a store call, so the one early wake-up left is the
    // close's; that wake-up 0.4 s later, once, although the clock still
    // reads 0.4 s before the close; then a poll every 10 s from there.
    let close = secs(10) + ms(400);
    assert_eq!(
        at,
        [
            Duration::ZERO,
            secs(10),
            close,
            close + POLL,
            close + POLL * 2,
            close + POLL * 3,
            close + POLL * 4,
        ],
        "{} acquires in a minute",
        at.len()
    );
}

/// A clock that reads tokio's (paused) time, so the store, the manager and
/// the test see time pass together.
#[derive(Debug)]
struct TokioClock {
    base: Instant,
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        let elapsed = SignedDuration::try_from(self.base.elapsed()).expect("a short test");
        start() + elapsed
    }
}

/// I28: a grant usable for less than a poll interval (the store's `max_ttl`
/// cuts the lease short) is replaced one store call before its window
/// closes, not at the next poll: the account is served throughout. Before,
/// each lease closed halfway between two polls and every request in the
/// other half was denied.
#[tokio::test(start_paused = true)]
async fn a_lease_shorter_than_the_poll_is_replaced_as_its_window_closes() {
    let clock = Arc::new(TokioClock {
        base: Instant::now(),
    });
    // Usable for 10 s − the 5 s margin = 5 s; the poll is 10 s.
    let (store, account) = memory_store_with(SignedDuration::from_secs(10), 100_000, clock.now());
    let slot = Arc::new(LeaseSlot::new(account, LocalSharding::Single));
    let manager = LeaseManager::spawn(
        Arc::clone(&store) as Arc<dyn LeaseAllocator>,
        Arc::clone(&slot),
        Arc::clone(&clock) as Arc<dyn Clock>,
        LeaseManagerConfig {
            account,
            ..config()
        },
    )
    .expect("the test configuration is valid");
    settle().await;

    let span = Duration::from_secs(60);
    let began = Instant::now();
    let mut probes = 0;
    let lead = SignedDuration::try_from(CALL_TIMEOUT).expect("a short timeout");
    while began.elapsed() < span {
        let now = clock.now();
        // Replaced as the window comes within one store call of closing,
        // never later: the lease serving has more than that left.
        let left =
            slot.with_lease(|lease| lease.map(|lease| lease.usable_until().duration_since(now)));
        assert!(
            left.is_some_and(|left| left > lead),
            "{left:?} of the window left at {:?}",
            began.elapsed()
        );
        probes += 1;
        sleep(ms(100)).await;
        settle().await;
    }
    assert_eq!(probes, 600);
    // One grant per 4.5 s (the 5 s window less one 0.5 s store call), not
    // one per probe: at 0 s, 4.5 s, ... 58.5 s.
    let acquired = manager.stats().acquired;
    assert_eq!(acquired, 14, "grants in 60 s");
    let report = manager.shutdown().await;
    assert_eq!(report.abandoned, 0, "every lease went back: {report:?}");
}

/// Near the end of a balance the store shrinks grants and says what is
/// left; the manager publishes that word, returns a parked lease's remainder
/// before asking for the next grant (so the tail is granted again), and
/// keeps the empty balance's refusal as evidence (I14, I23).
#[tokio::test(start_paused = true)]
async fn on_a_memory_store_the_tail_of_a_balance_is_regranted_and_its_evidence_published() {
    let (store, account) = memory_store(150, start());
    let (manager, slot) = spawn_on(&store, account);
    settle().await;
    let serving_units = || slot.load_observed().map(|lease| lease.grant().units.get());
    let nothing_left = Some(BalanceShortfall {
        remaining: CostUnits::ZERO,
        period_end: None,
    });
    assert_eq!(
        slot.funding_evidence(start()),
        Some(BalanceShortfall {
            remaining: CostUnits(50),
            period_end: None,
        }),
        "the first grant left 50, less than another request"
    );

    assert_eq!(serve_request(&store, &slot, 1, 80).await, Some(80));
    settle().await;
    assert_eq!(serving_units(), Some(50), "the tail grant is what is left");
    assert_eq!(
        slot.funding_evidence(start()),
        Some(BalanceShortfall {
            remaining: CostUnits(20),
            period_end: None,
        }),
        "none left in the balance, and the 20 units lease 1 holds, parked"
    );

    assert_eq!(serve_request(&store, &slot, 2, 50).await, Some(50));
    settle().await;
    assert_eq!(
        serving_units(),
        Some(20),
        "lease 1's 20 units went back before the acquire, which granted them again"
    );
    let stats = manager.stats();
    assert_eq!((stats.released, stats.released_units), (1, 20));

    assert_eq!(serve_request(&store, &slot, 3, 20).await, Some(20));
    settle().await;
    let exhausted = AllocateError::BalanceExhausted(BalanceExhaustion { period_end: None });
    assert_eq!(manager.stats().refused_for(&exhausted), 1);
    assert_eq!(slot.funding_evidence(start()), nothing_left);
    assert_eq!(
        serve_request(&store, &slot, 4, 1).await,
        None,
        "nothing is left to spend"
    );

    let report = manager.shutdown().await;
    assert_eq!((report.released, report.released_units), (1, 0));
    assert_eq!(report.abandoned, 0);
    assert_eq!(report.stats.released, 3);
    assert_eq!(store.audit().expect("the store answers"), []);
    let view = store.account(account, start()).expect("the account exists");
    assert_eq!(view.balance, CostUnits::ZERO, "150 granted, 150 spent");
    assert_eq!(view.leased, CostUnits::ZERO);
    assert_eq!(view.settled_unbilled, CostUnits::ZERO);
}

/// I26, I23: while a lease is parked its units are in neither the balance
/// the allocator's evidence describes nor the slot, so the evidence counts
/// what the parked lease holds; its release returns them to the balance,
/// which the evidence then counts instead. Without them it would rule out
/// a quote the account can fund (402, never retry) until the next grant
/// call, which an idle serving lease does not make.
#[tokio::test(start_paused = true)]
async fn a_release_adds_the_units_it_returns_to_the_published_evidence() {
    let (store, account) = memory_store(150, start());
    let (manager, slot) = spawn_on(&store, account);
    settle().await;
    assert_eq!(serve_request(&store, &slot, 1, 80).await, Some(80));
    settle().await;
    let evidence = |remaining| {
        Some(BalanceShortfall {
            remaining: CostUnits(remaining),
            period_end: None,
        })
    };
    // The tail grant took all that was left (0), but lease 1 is parked
    // with 20 units: without them, that word would rule out a quote of 60
    // that lease 2's 50 and those 20 fund.
    assert_eq!(
        slot.funding_evidence(start()),
        evidence(20),
        "the 20 units lease 1 holds, parked, count"
    );
    let serving = slot.load_observed().expect("lease 2 serves");
    let serving_units = serving.remaining();
    drop(serving);
    assert_eq!(serving_units, CostUnits(50));

    // The next poll releases lease 1; lease 2 is above its mark, so no grant
    // call is made.
    sleep(POLL).await;
    settle().await;
    let stats = manager.stats();
    assert_eq!((stats.released, stats.released_units), (1, 20));
    assert_eq!(stats.acquired, 2, "no grant call since the tail grant");
    assert_eq!(
        slot.funding_evidence(start()),
        evidence(20),
        "lease 1's 20 units are back in the balance"
    );
    let view = store.account(account, start()).expect("the account exists");
    assert_eq!(view.balance, CostUnits(20));

    let report = manager.shutdown().await;
    assert_eq!(report.abandoned, 0);
}

// ------------------------------------------------- what an ended task left

/// I25, I29: a task that ends in a store call reports exactly the leases it
/// still held then. Here a fenced release takes the serving lease out of
/// the slot and parks it, and the task dies releasing it: that lease, not
/// none, is what it left.
#[tokio::test(start_paused = true)]
async fn a_task_that_dies_after_a_fence_reports_the_serving_lease_it_parked() {
    let allocator = Scripted::new();
    allocator.plan_releases(1, [Reply::Refuse(AllocateError::Fenced)]);
    allocator.plan_releases(2, [Reply::Panic]);
    let mut h = Harness::started(allocator).await;
    rotate_once(&h, 80).await;
    h.spend(10);
    h.allocator.calls_reach(4).await;
    settle().await;
    assert!(h.manager().is_finished(), "the release of lease 2 panicked");
    let report = h.shutdown().await;
    assert!(report.task_died);
    assert_eq!((report.abandoned, report.abandoned_units), (1, 90));
}

/// I25: at shutdown, a lease whose release is refused as a fault stays
/// held (withheld), and a task that then dies reports it beside the one it
/// died releasing.
#[tokio::test(start_paused = true)]
async fn a_task_that_dies_after_withholding_a_lease_at_shutdown_reports_both() {
    let allocator = Scripted::new();
    allocator.plan_releases(1, [Reply::Refuse(AllocateError::InvalidRelease)]);
    allocator.plan_releases(2, [Reply::Panic]);
    let mut h = Harness::started(allocator).await;
    rotate_once(&h, 80).await;
    h.spend(10);
    let report = h.shutdown().await;
    assert!(report.task_died);
    assert_eq!((report.abandoned, report.abandoned_units), (2, 110));
}

/// I29: a fold refused and rolled back puts the lease back in the slot; a
/// task that dies in the acquire that follows reports that lease once.
#[tokio::test(start_paused = true)]
async fn a_task_that_dies_acquiring_after_a_rolled_back_fold_counts_the_lease_once() {
    let allocator = Scripted::new();
    allocator.plan_consolidations([Reply::Refuse(AllocateError::InsufficientBalance)]);
    allocator.plan_acquires([Reply::Grant(TARGET), Reply::Panic]);
    let mut h = Harness::started(allocator).await;
    h.spend(85);
    h.refused(50);
    h.allocator.calls_reach(3).await;
    settle().await;
    let report = h.shutdown().await;
    assert!(report.task_died);
    assert_eq!((report.abandoned, report.abandoned_units), (1, 15));
}

/// I29: a fold answered "gone" means the store settled the lease; a task
/// that dies in the acquire that follows left nothing behind.
#[tokio::test(start_paused = true)]
async fn a_task_that_dies_acquiring_after_a_gone_fold_reports_nothing_abandoned() {
    let allocator = Scripted::new();
    allocator.plan_consolidations([Reply::Refuse(AllocateError::LeaseNotActive)]);
    allocator.plan_acquires([Reply::Grant(TARGET), Reply::Panic]);
    let mut h = Harness::started(allocator).await;
    h.spend(70);
    h.refused(50);
    h.allocator.calls_reach(3).await;
    settle().await;
    let report = h.shutdown().await;
    assert!(report.task_died);
    assert_eq!((report.abandoned, report.abandoned_units), (0, 0));
}

/// I23, I27: while a quiescent lease is folded it is out of the slot, and
/// the evidence does not count its units; read against that evidence, a
/// quote the lease funded would be ruled out (402, never retry). The
/// evidence is withdrawn for the fold, so a request meanwhile is answered
/// transiently, and the fold's grant publishes evidence again.
#[tokio::test(start_paused = true)]
async fn no_evidence_rules_a_quote_out_while_a_lease_is_folded() {
    let tail = BalanceShortfall {
        remaining: CostUnits(50),
        period_end: None,
    };
    let allocator = Scripted::new();
    allocator.plan_acquires([Reply::GrantShort(TARGET, tail)]);
    let gate = Arc::new(Notify::new());
    allocator.plan_consolidations([Reply::Gated(
        Arc::clone(&gate),
        Box::new(Reply::GrantShort(
            150,
            BalanceShortfall {
                remaining: CostUnits(0),
                period_end: None,
            },
        )),
    )]);
    let h = Harness::started(allocator).await;
    assert_eq!(h.slot.funding_evidence(h.now()), Some(tail));
    h.refused(120);
    h.allocator.calls_reach(2).await;
    settle().await;
    assert!(matches!(h.allocator.calls()[1], Call::Consolidate { .. }));
    assert_eq!(h.serving(), None, "out of the slot while it is folded");
    assert_eq!(
        h.slot.funding_evidence(h.now()),
        None,
        "no evidence that leaves the folded units out"
    );
    gate.notify_one();
    settle().await;
    assert_eq!(h.serving(), Some((2, 150)));
    assert_eq!(
        h.slot.funding_evidence(h.now()).map(|e| e.remaining),
        Some(CostUnits(0))
    );
}

/// A clock that notes, once armed, whether the slot was empty whenever it
/// is read, and whether it was empty with evidence published. Every store
/// call takes the clock's reading, so a slot left empty across one is
/// seen; a lease taken out and put back with nothing read in between (to
/// test it for quiescence, say) is not. A clean record says the clock never
/// found the slot empty, not that it never was.
#[derive(Debug)]
struct SlotWatchingClock {
    clock: Arc<ManualClock>,
    slot: Arc<LeaseSlot>,
    armed: std::sync::atomic::AtomicBool,
    saw_empty: std::sync::atomic::AtomicBool,
    saw_evidence_without_lease: std::sync::atomic::AtomicBool,
    /// The least remainder evidence read with the slot empty said.
    least_evidence_without_lease: AtomicU64,
}

impl SlotWatchingClock {
    fn new(clock: &Arc<ManualClock>, slot: &Arc<LeaseSlot>) -> Arc<Self> {
        Arc::new(Self {
            clock: Arc::clone(clock),
            slot: Arc::clone(slot),
            armed: std::sync::atomic::AtomicBool::new(false),
            saw_empty: std::sync::atomic::AtomicBool::new(false),
            saw_evidence_without_lease: std::sync::atomic::AtomicBool::new(false),
            least_evidence_without_lease: AtomicU64::new(u64::MAX),
        })
    }
}

impl Clock for SlotWatchingClock {
    fn now(&self) -> Timestamp {
        if self.armed.load(Ordering::SeqCst) && self.slot.load_observed().is_none() {
            self.saw_empty.store(true, Ordering::SeqCst);
            if let Some(evidence) = self.slot.published_funding() {
                self.saw_evidence_without_lease
                    .store(true, Ordering::SeqCst);
                self.least_evidence_without_lease
                    .fetch_min(evidence.remaining.get(), Ordering::SeqCst);
            }
        }
        self.clock.now()
    }
}

/// A manager on a single-shard slot whose clock watches that slot.
struct Watched {
    slot: Arc<LeaseSlot>,
    clock: Arc<ManualClock>,
    watching: Arc<SlotWatchingClock>,
    manager: LeaseManager,
}

impl Watched {
    /// Spawns the manager over `allocator`, and waits for its cold-start
    /// acquire to be answered.
    async fn started(allocator: &Arc<Scripted>) -> Self {
        let slot = Arc::new(LeaseSlot::new(ACCOUNT, LocalSharding::Single));
        *lock(&allocator.slot) = Some(Arc::clone(&slot));
        let clock = Arc::new(ManualClock::new(start()));
        let watching = SlotWatchingClock::new(&clock, &slot);
        let manager = LeaseManager::spawn(
            Arc::clone(allocator) as Arc<dyn LeaseAllocator>,
            Arc::clone(&slot),
            Arc::clone(&watching) as Arc<dyn Clock>,
            config(),
        )
        .expect("the test configuration is valid");
        allocator.calls_reach(1).await;
        settle().await;
        Self {
            slot,
            clock,
            watching,
            manager,
        }
    }
}

/// I23, I27: while a quiet lease is out of the slot to be folded, no
/// evidence is published. Read against an empty slot, evidence leaves out
/// the lease's units and rules out a quote the lease funds (402, never
/// retry). Here the fold is refused and rolled back: the lease goes back,
/// and only then is the refusal's evidence published.
#[tokio::test(start_paused = true)]
async fn no_evidence_is_published_while_a_folded_lease_is_out_of_the_slot() {
    let allocator = Scripted::new();
    let plenty = BalanceShortfall {
        remaining: CostUnits(500),
        period_end: None,
    };
    allocator.plan_acquires([Reply::GrantShort(TARGET, plenty)]);
    allocator.plan_consolidations([Reply::Refuse(AllocateError::BalanceInsufficient(
        BalanceShortfall {
            remaining: CostUnits(137),
            period_end: None,
        },
    ))]);
    let Watched {
        slot,
        clock,
        watching,
        manager,
    } = Watched::started(&allocator).await;
    assert_eq!(
        slot.funding_evidence(clock.now()),
        Some(plenty),
        "the manager's own evidence, shown beside its lease"
    );
    watching.armed.store(true, Ordering::SeqCst);
    let now = clock.now();
    let refusal = slot
        .with_lease(|lease| {
            Reservation::reserve(lease.expect("a lease serves"), CostUnits(120), now)
        })
        .expect_err("more than the lease holds");
    assert_eq!(refusal, DenyReason::LeaseExhausted);
    allocator.calls_reach(2).await;
    settle().await;
    assert!(
        matches!(allocator.calls()[1], Call::Consolidate { needed: 120, .. }),
        "the quiet lease is folded: {:?}",
        allocator.calls()
    );
    assert!(
        watching.saw_empty.load(Ordering::SeqCst),
        "the clock was read while the lease was out of the slot"
    );
    assert!(
        !watching.saw_evidence_without_lease.load(Ordering::SeqCst),
        "evidence was published while the slot was empty"
    );
    assert_eq!(
        slot.funding_evidence(now),
        Some(BalanceShortfall {
            remaining: CostUnits(37),
            period_end: None,
        }),
        "the refusal's evidence, less the lease's own 100, once it serves again"
    );
    drop(manager);
}

/// I27: a lease a request holds is found busy where it serves, before
/// anything else about its fold is weighed: the fold it refused is put off
/// (and counted so), and at no point is the slot left empty for the
/// account's requests to be denied. A quote the evidence rules out even
/// beside the lease is forgotten without a grant call; one the balance
/// funds is chased with a replacement.
///
/// A take and put-back with no store call between cannot be seen from a
/// single-threaded test (see `SlotWatchingClock`). What shows the lease
/// was judged busy in place is the count: taken out to be tested, it
/// would first meet the fold's own waits, and a quote the evidence rules
/// out would stop it there, never counted as put off by its request.
#[tokio::test(start_paused = true)]
async fn a_busy_lease_that_refused_a_quote_never_leaves_the_slot() {
    let allocator = Scripted::new();
    allocator.plan_acquires([
        Reply::GrantShort(
            TARGET,
            BalanceShortfall {
                remaining: CostUnits(150),
                period_end: None,
            },
        ),
        Reply::Grant(120),
    ]);
    let Watched {
        slot,
        clock,
        watching,
        manager,
    } = Watched::started(&allocator).await;
    let now = clock.now();
    let reserve = |units| {
        slot.with_lease(|lease| {
            Reservation::reserve(lease.expect("a lease serves"), CostUnits(units), now)
        })
    };
    let busy = reserve(10).expect("funded");
    watching.armed.store(true, Ordering::SeqCst);

    // 300 is more than the balance's 150 and the lease's 90 together.
    assert_eq!(reserve(300).err(), Some(DenyReason::LeaseExhausted));
    settle().await;
    assert_eq!(manager.stats().consolidations_deferred, 1, "put off");
    assert_eq!(allocator.calls(), [acquire()], "not chased");
    let kept = slot
        .load_observed()
        .map(|lease| lease.largest_refused_quote());
    assert_eq!(kept, Some(CostUnits::ZERO), "forgotten");

    // 120 the balance alone funds.
    assert_eq!(reserve(120).err(), Some(DenyReason::LeaseExhausted));
    allocator.calls_reach(2).await;
    settle().await;
    assert_eq!(manager.stats().consolidations_deferred, 2, "put off");
    assert_eq!(
        allocator.calls()[1],
        Call::Acquire {
            requested: 200,
            needed: 120
        },
        "a replacement is chased, sized for the quote"
    );
    assert_eq!(
        slot.load_observed().map(|lease| lease.grant().units),
        Some(CostUnits(120))
    );
    assert!(
        !watching.saw_empty.load(Ordering::SeqCst),
        "the clock never found the slot empty"
    );
    drop(busy);
    drop(manager);
}
