//! A chaos property of the whole instance runtime on the memory store:
//! units are conserved end to end, whatever the allocator and the usage
//! sink answer.
//!
//! Each case starts one or two [`InstanceRuntime`]s over one account
//! (Strict, or Elastic with an overage cap), under tokio's paused clock
//! and a [`ManualClock`] moved in step with it; each instance reads that
//! clock up to 1.2 s behind, as far as its safety margin allows (I2).
//! Every store call the runtime makes in the background (acquire,
//! consolidate, release, the reclaimer's reclaim, and usage ingest) goes
//! through a wrapper that gives it a generated fate: answered normally;
//! failed with a storage error before the store saw it, or after the store
//! applied it (the answer lost); or hung past the call's timeout, before or
//! after applying. Outages, in which every call fails or hangs for up to
//! six seconds, come on top.
//! Traffic is generated alongside: requests admitted and committed,
//! admitted and dropped, admitted and held across later steps (then
//! committed late, or dropped); zero-unit quotes; time passing from under a
//! poll to past a lease's usable window; top-ups; suspensions and
//! resumptions of the account; mode changes; crashes (a runtime dropped
//! without shutdown) and orderly shutdowns that run on while traffic goes
//! to the fresh instance started in its place (no sooner than the
//! reclaimer's outage hold after an outage, as I19 asks).
//!
//! After the steps the faults stop, and every instance with no request
//! pending must serve again (I22, I29). Then every instance is shut down
//! or dropped, time passes every lease's expiry plus the reclaim grace,
//! and a reclaim pass settles what is left. Then:
//!
//! 1. the store's `audit()` finds nothing (I14, I15);
//! 2. with every lease settled, the ledger equation (I14) reads: opening
//!    balance plus top-ups equals the balance, plus the units billed
//!    against leases, plus the units of settled leases neither credited
//!    nor billed (`settled_unbilled`); those are only ever charges an
//!    orderly shutdown's drain gave up on (I21, I25), since reclaim
//!    credits back what a crash lost (I19), and overage is billed as debt,
//!    never from the balance;
//! 3. every commit the test saw succeed is billed once, under its request
//!    id and with its units (I8), except those the instance that made them
//!    counted lost; an orderly shutdown loses none while the sink answers;
//!    nothing else is billed, and a request released for zero never is
//!    (I4); the store rejects no event;
//! 4. no instance billed more against leases than it was granted (I9), nor
//!    more overage than the largest cap it was given (I10); no integrity
//!    fault was raised and no plane died: storage errors and timeouts are
//!    retried, never taken for refusals (I22, I26); every orderly shutdown
//!    stayed inside its deadline (I25).
//!
//! The hand-written tests each cover one fault at one moment; this one
//! lets them fall anywhere among rotations, folds, releases, reclaims,
//! retirements and restarts.

mod support;

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use jiff::{SignedDuration, Timestamp};
use proptest::prelude::*;
use tokio::task::JoinHandle;
use tollgate::admission::RequestContext;
use tollgate::runtime::{
    InstanceRuntime, InstanceRuntimeConfig, ReclaimerConfig, RuntimeHandle, RuntimeShutdownReport,
    WriterStats,
};
use tollgate::store::{
    AccountSpec, AllocateError, Allocation, Clock, GrantPolicy, IngestOutcome, LeaseAllocator,
    ManualClock, MemoryStore, ReclaimBatch, Released, StoreError, TailSharing, UsageSink,
};
use tollgate::{
    AccountId, AccountStatus, CostUnits, EnforcementMode, FencingToken, LeaseId, PermissionBits,
    Principal, RequestId, UsageEvent, UsageSource,
};

use support::runtime::{Pace, config, ms};

/// How long every lease lives: short, so a step can outlast a window.
const TTL: SignedDuration = SignedDuration::from_secs(8);
/// How long before expiry a lease stops serving (I2). It covers the usage
/// delivery time of the shared configuration (0.7 s).
const MARGIN: SignedDuration = SignedDuration::from_secs(2);
/// How long after expiry a lease may be reclaimed (I19).
const GRACE: SignedDuration = SignedDuration::from_secs(2);
/// The step in which both clocks move together.
const TICK: Duration = Duration::from_millis(10);
/// A hung call waits this long: far past every store call timeout.
const HANG: Duration = Duration::from_secs(3_600);

/// What becomes of one store call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// The store's own answer.
    Answer,
    /// A storage error; the store was never asked.
    FailBefore,
    /// The store applied the call, then the answer was lost.
    FailAfter,
    /// No answer within any timeout; the store was never asked.
    HangBefore,
    /// The store applied the call, then no answer within any timeout.
    HangAfter,
}

fn fate() -> impl Strategy<Value = Fate> {
    prop_oneof![
        4 => Just(Fate::Answer),
        1 => Just(Fate::FailBefore),
        1 => Just(Fate::FailAfter),
        1 => Just(Fate::HangBefore),
        1 => Just(Fate::HangAfter),
    ]
}

/// The store calls a fate can be given, in [`Faults`] order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Acquire,
    Consolidate,
    Release,
    Reclaim,
    Ingest,
}

/// The fates of the first calls of each kind, in call order, across every
/// instance, indexed by [`Call`]; later calls are answered normally.
///
/// Each kind gets at most eight. For the sink the bound matters: eight
/// failed calls in a row take two seconds, so a charge still reaches the
/// store inside the lease's margin plus the reclaim grace, and none is
/// refused as settled. A longer run of failures is an outage, which the
/// reclaimers see and hold off for (I19).
#[derive(Debug, Clone)]
struct Faults([Vec<Fate>; 5]);

fn faults() -> impl Strategy<Value = Faults> {
    let script = |most: usize| proptest::collection::vec(fate(), 0..=most);
    (script(8), script(8), script(8), script(8), script(8))
        .prop_map(|(a, c, r, m, i)| Faults([a, c, r, m, i]))
}

/// One step of traffic or of the world around it. `instance` picks a live
/// instance, modulo how many there are.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// Admit and commit `count` requests of `units` each.
    Spend {
        instance: usize,
        units: u64,
        count: u8,
    },
    /// Admit a request and drop it: released for zero (I4).
    Abandon { instance: usize, units: u64 },
    /// Admit a request and keep it pending for a later `Finish`.
    Hold { instance: usize, units: u64 },
    /// Commit (or drop) the oldest held request, now.
    Finish { commit: bool },
    /// Move both clocks on.
    Advance { millis: u64 },
    /// Top the account up through the store.
    TopUp { units: u64 },
    /// Drop the instance without shutdown, and start a fresh one.
    Crash { instance: usize },
    /// Begin shutting the instance down in order, and start a fresh one;
    /// the shutdown runs on while the next steps do.
    Restart { instance: usize },
    /// Suspend or resume the account: a suspended account's manager retires
    /// after the linger, and a resumed one gets a new manager (I29).
    Status { active: bool },
    /// Make the account Strict (`None`) or Elastic with this cap.
    Mode { cap: Option<u64> },
    /// The store is out of reach for this long: every background call
    /// fails at once, or hangs.
    Outage { millis: u64, hang: bool },
}

/// A quote: now and then zero (admitted whatever the funds, I9), mostly
/// up to a little over a lease.
fn quote() -> impl Strategy<Value = u64> {
    prop_oneof![1 => Just(0_u64), 12 => 1..=80_u64]
}

/// Strict, or Elastic with a small cap.
fn mode() -> impl Strategy<Value = Option<u64>> {
    prop_oneof![2 => Just(None), 1 => (0..=40_u64).prop_map(Some)]
}

fn step() -> impl Strategy<Value = Step> {
    let instance = || 0..2_usize;
    prop_oneof![
        6 => (instance(), quote(), 1..=6_u8)
            .prop_map(|(instance, units, count)| Step::Spend { instance, units, count }),
        1 => (instance(), quote()).prop_map(|(instance, units)| Step::Abandon { instance, units }),
        1 => (instance(), quote()).prop_map(|(instance, units)| Step::Hold { instance, units }),
        1 => any::<bool>().prop_map(|commit| Step::Finish { commit }),
        5 => prop_oneof![
            // Under a poll, a few polls, past a lease's usable window.
            1..100_u64,
            100..1_000_u64,
            5_000..9_000_u64,
        ]
        .prop_map(|millis| Step::Advance { millis }),
        1 => (1..=200_u64).prop_map(|units| Step::TopUp { units }),
        1 => instance().prop_map(|instance| Step::Crash { instance }),
        1 => instance().prop_map(|instance| Step::Restart { instance }),
        1 => any::<bool>().prop_map(|active| Step::Status { active }),
        1 => mode().prop_map(|cap| Step::Mode { cap }),
        1 => (100..6_000_u64, any::<bool>())
            .prop_map(|(millis, hang)| Step::Outage { millis, hang }),
    ]
}

/// One generated case.
#[derive(Debug, Clone)]
struct Scenario {
    /// Instances running at once.
    instances: usize,
    /// The account's opening balance.
    balance: u64,
    /// The account's opening mode: Strict, or Elastic with this cap.
    cap: Option<u64>,
    /// Units each acquire asks for, and the low-water mark below it.
    target_grant: u64,
    low_water: u64,
    /// Whether every instance also runs a reclaimer (through the faults).
    reclaimer: bool,
    /// How far behind each instance's clock reads, in milliseconds, by
    /// generation (cycled).
    lags: Vec<u64>,
    /// Whether the last instances shut down in order (or are dropped).
    graceful_end: bool,
    faults: Faults,
    steps: Vec<Step>,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    let grants = (2..=100_u64).prop_flat_map(|target| (Just(target), 1..target));
    let shape = (1..=2_usize, 0..=600_u64, mode(), grants);
    let lag = prop_oneof![1 => Just(0_u64), 2 => 0..=1_200_u64];
    let running = (
        any::<bool>(),
        proptest::collection::vec(lag, 1..4),
        any::<bool>(),
    );
    let steps = proptest::collection::vec(step(), 1..40);
    (shape, running, faults(), steps).prop_map(
        |(
            (instances, balance, cap, (target_grant, low_water)),
            (reclaimer, lags, graceful_end),
            faults,
            steps,
        )| Scenario {
            instances,
            balance,
            cap,
            target_grant,
            low_water,
            reclaimer,
            lags,
            graceful_end,
            faults,
            steps,
        },
    )
}

fn enforcement(cap: Option<u64>) -> EnforcementMode {
    cap.map_or(EnforcementMode::Strict, |cap| EnforcementMode::Elastic {
        overage_cap: CostUnits(cap),
    })
}

/// A [`LeaseAllocator`] and [`UsageSink`] around the memory store that
/// gives each call the next fate scripted for its kind, and logs what it
/// did.
struct Faulty {
    store: Arc<MemoryStore>,
    script: Mutex<[VecDeque<Fate>; 5]>,
    /// During an outage, the fate of every call, whatever its script says.
    outage: Mutex<Option<Fate>>,
    log: Mutex<Vec<String>>,
}

impl Faulty {
    fn new(store: &Arc<MemoryStore>, faults: &Faults) -> Self {
        Self {
            store: Arc::clone(store),
            script: Mutex::new(faults.0.clone().map(VecDeque::from)),
            outage: Mutex::new(None),
            log: Mutex::new(Vec::new()),
        }
    }

    /// The fate of the next call of this kind.
    fn next(&self, call: Call) -> Fate {
        if let Some(fate) = *self.outage.lock().unwrap() {
            return fate;
        }
        self.script.lock().unwrap()[call as usize]
            .pop_front()
            .unwrap_or(Fate::Answer)
    }

    /// Every later call is answered.
    fn calm(&self) {
        self.script
            .lock()
            .unwrap()
            .iter_mut()
            .for_each(VecDeque::clear);
    }

    fn note(&self, line: String) {
        self.log.lock().unwrap().push(line);
    }

    /// Runs `call` (the store's own future, not yet polled) under the next
    /// fate of its kind. A future not yet polled has not touched the store,
    /// so a hang before it, cut off, leaves the store untouched.
    async fn under<T, E>(
        &self,
        kind: Call,
        what: String,
        call: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E>
    where
        T: std::fmt::Debug,
        E: std::fmt::Debug + From<StoreError>,
    {
        let fate = self.next(kind);
        let what = format!("{what} [{fate:?}]");
        let lost = || E::from(StoreError::new("injected: the answer was lost"));
        match fate {
            Fate::Answer => {
                let answer = call.await;
                self.note(format!("{what}: {answer:?}"));
                answer
            }
            Fate::FailBefore => {
                self.note(format!("{what}: failed before the store"));
                Err(lost())
            }
            Fate::FailAfter => {
                let answer = call.await;
                self.note(format!("{what}: applied {answer:?}, answer lost"));
                Err(lost())
            }
            Fate::HangBefore => {
                self.note(format!("{what}: hangs before the store"));
                tokio::time::sleep(HANG).await;
                let answer = call.await;
                self.note(format!("{what}: answered after the hang: {answer:?}"));
                answer
            }
            Fate::HangAfter => {
                let answer = call.await;
                self.note(format!("{what}: applied {answer:?}, then hangs"));
                tokio::time::sleep(HANG).await;
                Err(lost())
            }
        }
    }
}

#[async_trait]
impl LeaseAllocator for Faulty {
    async fn acquire_at_least(
        &self,
        account: AccountId,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        let what = format!("{now} acquire {requested}");
        let call = self
            .store
            .acquire_at_least(account, requested, needed, ttl, now);
        self.under(Call::Acquire, what, call).await
    }

    async fn release(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        now: Timestamp,
    ) -> Result<Released, AllocateError> {
        let what = format!("{now} release {lease_id} unspent {unspent}");
        let call = self.store.release(lease_id, fencing_token, unspent, now);
        self.under(Call::Release, what, call).await
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
        let what = format!(
            "{now} consolidate {lease_id} unspent {unspent} requested {requested} needed {needed}"
        );
        let call = self.store.consolidate(
            lease_id,
            fencing_token,
            unspent,
            requested,
            needed,
            ttl,
            now,
        );
        self.under(Call::Consolidate, what, call).await
    }

    async fn reclaim_expired_batch(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> Result<ReclaimBatch, StoreError> {
        let what = format!("{now} reclaim {limit}");
        let call = self.store.reclaim_expired_batch(now, limit);
        self.under(Call::Reclaim, what, call).await
    }

    fn shares_tails(&self) -> bool {
        self.store.shares_tails()
    }
}

#[async_trait]
impl UsageSink for Faulty {
    async fn ingest(&self, batch: &[UsageEvent]) -> Result<Vec<IngestOutcome>, StoreError> {
        let ids: Vec<String> = batch
            .iter()
            .map(|event| event.request_id.to_string())
            .collect();
        let what = format!("ingest {ids:?}");
        self.under(Call::Ingest, what, self.store.ingest(batch))
            .await
    }
}

/// Moves the manual clock and tokio's paused clock on together, one
/// [`TICK`] at a time, so the background planes run at the instants the
/// store is told about.
async fn pass(clock: &ManualClock, by: Duration) {
    let mut left = by;
    while !left.is_zero() {
        let tick = left.min(TICK);
        clock.advance(SignedDuration::try_from(tick).expect("a tick is short"));
        tokio::time::sleep(tick).await;
        left -= tick;
    }
}

/// How far behind the true time an instance's clock may read: the most
/// the margin allows beside the usage delivery time (I2).
const LAG_BOUND: Duration = Duration::from_millis(1_200);

/// An instance's clock: the shared manual clock, read `lag` behind (the
/// instance's clock skew), vouching for [`LAG_BOUND`].
#[derive(Debug)]
struct Lagging {
    clock: Arc<ManualClock>,
    lag: SignedDuration,
}

impl Clock for Lagging {
    fn now(&self) -> Timestamp {
        self.clock.now() - self.lag
    }

    fn staleness_bound(&self) -> Duration {
        LAG_BOUND
    }
}

/// The shared paused configuration, with leases short enough to lapse
/// within a case, a linger that ends within one too, and optionally a
/// reclaimer.
fn instance_config(scenario: &Scenario) -> InstanceRuntimeConfig {
    let mut config = config(Pace::Paused);
    config.leases.target_grant = CostUnits(scenario.target_grant);
    config.leases.low_water = CostUnits(scenario.low_water);
    config.leases.lease_ttl = TTL;
    config.leases.expiry_safety_margin = MARGIN;
    config.account_linger = ms(2_000);
    // Its interval is shorter than the grace plus the margin less the
    // usage delivery time, and its hold longer than that delivery (I19).
    config.reclaimer = scenario.reclaimer.then_some(ReclaimerConfig {
        interval: ms(1_000),
        batch_limit: 4,
        store_call_timeout: ms(200),
        outage_hold: ms(1_000),
    });
    config
}

/// How an instance ended, as far as the test knows.
#[derive(Debug)]
enum Ending {
    Running,
    Crashed,
    ShutDown(Box<RuntimeShutdownReport>),
}

/// Every instance ever started in a case, with what the test saw it do.
struct Generation {
    handle: RuntimeHandle,
    ending: Ending,
    /// Commits answered `Ok`: request id and units.
    committed: Vec<(RequestId, u64)>,
    /// Requests admitted and then released for zero.
    released: Vec<RequestId>,
    /// The writer's failed deliveries (storage errors and timeouts) when
    /// an orderly shutdown began, if one did.
    sink_failures_at_stop: Option<u64>,
}

/// A running instance and the generation it is.
struct Live {
    runtime: InstanceRuntime,
    generation: usize,
}

/// A request admitted and kept pending.
struct Held {
    generation: usize,
    context: RequestContext,
}

/// One case's world.
struct World {
    clock: Arc<ManualClock>,
    store: Arc<MemoryStore>,
    faulty: Arc<Faulty>,
    account: AccountId,
    principal: Principal,
    config: InstanceRuntimeConfig,
    live: Vec<Live>,
    generations: Vec<Generation>,
    held: VecDeque<Held>,
    /// Orderly shutdowns under way, by generation.
    draining: Vec<(usize, JoinHandle<RuntimeShutdownReport>)>,
    /// The opening balance, and the top-ups since (I14's left side).
    opening: u64,
    top_ups: u64,
    /// The largest overage cap the account ever had (zero while Strict).
    largest_cap: u64,
    /// See [`Scenario::lags`].
    lags: Vec<u64>,
    /// When the last outage ended.
    outage_ended: Option<Timestamp>,
    trace: String,
}

impl World {
    fn new(scenario: &Scenario) -> Self {
        let start = Timestamp::from_second(1_700_000_000).unwrap();
        let clock = Arc::new(ManualClock::new(start));
        let policy = GrantPolicy {
            max_ttl: TTL,
            reclaim_grace: GRACE,
            tail: TailSharing {
                instances: 2,
                min_grant: CostUnits(5),
            },
        };
        let store = Arc::new(MemoryStore::new(policy).unwrap());
        let spec = AccountSpec {
            balance: CostUnits(scenario.balance),
            mode: enforcement(scenario.cap),
            status: AccountStatus::Active,
            refill: None,
        };
        let account = store.create_account(spec, start).unwrap();
        let principal = store
            .issue_key(account, PermissionBits::ALL, start)
            .unwrap()
            .principal;
        let mut world = Self {
            clock,
            faulty: Arc::new(Faulty::new(&store, &scenario.faults)),
            store,
            account,
            principal,
            config: instance_config(scenario),
            live: Vec::new(),
            generations: Vec::new(),
            held: VecDeque::new(),
            draining: Vec::new(),
            opening: scenario.balance,
            top_ups: 0,
            largest_cap: scenario.cap.unwrap_or(0),
            lags: scenario.lags.clone(),
            outage_ended: None,
            trace: String::new(),
        };
        for _ in 0..scenario.instances {
            let fresh = world.start();
            world.live.push(fresh);
        }
        world
    }

    /// Starts a fresh instance whose background calls all go through the
    /// faults (snapshots come from the store itself), on a clock of its own
    /// that may read behind.
    fn start(&mut self) -> Live {
        let lag = self.lags[self.generations.len() % self.lags.len()];
        let clock = Lagging {
            clock: Arc::clone(&self.clock),
            lag: SignedDuration::from_millis(i64::try_from(lag).unwrap()),
        };
        let (runtime, handle) = InstanceRuntime::spawn(
            Arc::clone(&self.store) as _,
            Arc::clone(&self.faulty) as _,
            Arc::clone(&self.faulty) as _,
            Arc::new(clock),
            self.config.clone(),
        )
        .expect("the chaos configuration is valid");
        self.generations.push(Generation {
            handle,
            ending: Ending::Running,
            committed: Vec::new(),
            released: Vec::new(),
            sink_failures_at_stop: None,
        });
        Live {
            runtime,
            generation: self.generations.len() - 1,
        }
    }

    fn note(&mut self, line: impl std::fmt::Display) {
        let _ = writeln!(self.trace, "{} {line}", self.clock.now());
    }

    /// Admits a request of `units` on the live instance `instance`.
    fn admit(&mut self, instance: usize, units: u64) -> Option<Held> {
        let generation = self.live[instance % self.live.len()].generation;
        let handle = &self.generations[generation].handle;
        let admitted = handle.begin(
            self.principal,
            PermissionBits::NONE,
            CostUnits(units),
            handle.clock().now(),
        );
        match admitted {
            Ok(context) => Some(Held {
                generation,
                context,
            }),
            Err(denied) => {
                self.note(format_args!("g{generation} denied {units}: {denied:?}"));
                None
            }
        }
    }

    /// Commits `held` now, recording the outcome against its generation.
    fn commit(&mut self, mut held: Held) {
        let id = held.context.request_id();
        let generation = &mut self.generations[held.generation];
        let outcome = held.context.commit(generation.handle.clock().now());
        match outcome {
            Ok(units) => generation.committed.push((id, units.get())),
            Err(_) => generation.released.push(id),
        }
        self.note(format_args!(
            "g{} commit {id}: {outcome:?}",
            held.generation
        ));
    }

    /// Drops `held` uncommitted: released for zero.
    fn release(&mut self, held: Held) {
        let Held {
            generation,
            context,
        } = held;
        let id = context.request_id();
        drop(context);
        self.generations[generation].released.push(id);
        self.note(format_args!("g{generation} dropped {id}"));
    }

    /// Admits and commits `count` requests; a denied client comes back a
    /// moment later, as the refill task works.
    async fn spend(&mut self, instance: usize, units: u64, count: u8) {
        for _ in 0..count {
            if let Some(held) = self.admit(instance, units) {
                self.commit(held);
                tokio::task::yield_now().await;
            } else {
                pass(&self.clock, TICK).await;
            }
        }
    }

    /// Replaces the live instance `instance` with a fresh one, returning
    /// the old. A fresh reclaimer knows nothing of an outage before it, so
    /// it starts no sooner than `outage_hold` after the last one ended, as
    /// I19 asks of an operator.
    async fn replace(&mut self, instance: usize) -> Live {
        if let (Some(ended), Some(reclaimer)) = (self.outage_ended, self.config.reclaimer) {
            let hold = SignedDuration::try_from(reclaimer.outage_hold).unwrap();
            let wait = (ended + hold).duration_since(self.clock.now());
            if let Ok(wait) = Duration::try_from(wait) {
                pass(&self.clock, wait).await;
            }
        }
        let index = instance % self.live.len();
        let fresh = self.start();
        std::mem::replace(&mut self.live[index], fresh)
    }

    async fn run(&mut self, step: Step) {
        self.note(format_args!("step {step:?}"));
        match step {
            Step::Spend {
                instance,
                units,
                count,
            } => self.spend(instance, units, count).await,
            Step::Abandon { instance, units } => {
                if let Some(held) = self.admit(instance, units) {
                    self.release(held);
                }
            }
            Step::Hold { instance, units } => {
                if let Some(held) = self.admit(instance, units) {
                    self.held.push_back(held);
                }
            }
            Step::Finish { commit } => match self.held.pop_front() {
                Some(held) if commit => self.commit(held),
                Some(held) => self.release(held),
                None => {}
            },
            Step::Advance { millis } => pass(&self.clock, ms(millis)).await,
            Step::TopUp { units } => {
                let now = self.clock.now();
                self.store
                    .top_up(self.account, CostUnits(units), now)
                    .unwrap();
                self.top_ups += units;
            }
            Step::Crash { instance } => {
                let old = self.replace(instance).await;
                self.generations[old.generation].ending = Ending::Crashed;
                drop(old.runtime);
            }
            Step::Restart { instance } => {
                let old = self.replace(instance).await;
                self.note_stop(old.generation);
                let shutdown = tokio::spawn(old.runtime.shutdown());
                self.draining.push((old.generation, shutdown));
                tokio::task::yield_now().await;
            }
            Step::Status { active } => {
                let status = if active {
                    AccountStatus::Active
                } else {
                    AccountStatus::Suspended
                };
                self.store.set_status(self.account, status).unwrap();
            }
            Step::Mode { cap } => {
                self.largest_cap = self.largest_cap.max(cap.unwrap_or(0));
                self.store.set_mode(self.account, enforcement(cap)).unwrap();
            }
            Step::Outage { millis, hang } => {
                let fate = if hang {
                    Fate::HangBefore
                } else {
                    Fate::FailBefore
                };
                *self.faulty.outage.lock().unwrap() = Some(fate);
                pass(&self.clock, ms(millis)).await;
                *self.faulty.outage.lock().unwrap() = None;
                self.outage_ended = Some(self.clock.now());
            }
        }
        self.collect_shutdowns().await;
    }

    /// Records how often the sink had failed `generation`'s writer as its
    /// orderly shutdown begins.
    fn note_stop(&mut self, generation: usize) {
        let ended = &mut self.generations[generation];
        ended.sink_failures_at_stop = Some(sink_failures(&ended.handle.report().writer));
    }

    /// Records the orderly shutdowns that have finished.
    async fn collect_shutdowns(&mut self) {
        let (done, running) = std::mem::take(&mut self.draining)
            .into_iter()
            .partition(|(_, shutdown)| shutdown.is_finished());
        self.draining = running;
        for (generation, shutdown) in done {
            let report = shutdown.await.expect("shutdown does not panic");
            self.note(format_args!("g{generation} shut down: {report:?}"));
            self.generations[generation].ending = Ending::ShutDown(Box::new(report));
        }
    }

    /// Ends the faults: every later call is answered, and the account is
    /// active. Then long enough passes for every backoff (eight polls),
    /// outage hold and snapshot refresh to run out.
    async fn calm(&mut self) {
        self.faulty.calm();
        self.store
            .set_status(self.account, AccountStatus::Active)
            .unwrap();
        self.note("calm");
        pass(&self.clock, ms(3_000)).await;
        self.collect_shutdowns().await;
    }

    /// Ends every instance, finishes held requests late, and lets reclaim
    /// settle every lease left.
    async fn finish(&mut self, graceful: bool) {
        for live in std::mem::take(&mut self.live) {
            if graceful {
                self.note_stop(live.generation);
                let shutdown = tokio::spawn(live.runtime.shutdown());
                self.draining.push((live.generation, shutdown));
            } else {
                self.generations[live.generation].ending = Ending::Crashed;
                drop(live.runtime);
            }
        }
        // I22, I25: every store call is bounded, so every shutdown ends
        // inside its deadline; one that hangs fails the case, not the run.
        let mut waited = Duration::ZERO;
        while !self.draining.is_empty() && waited <= self.config.shutdown_deadline {
            pass(&self.clock, TICK).await;
            waited += TICK;
            self.collect_shutdowns().await;
        }
        for (generation, shutdown) in std::mem::take(&mut self.draining) {
            shutdown.abort();
            self.note(format_args!("g{generation} never finished its shutdown"));
        }
        // Commits after their instance stopped: refused, or lost and
        // counted so (I21).
        while let Some(held) = self.held.pop_front() {
            self.commit(held);
        }
        // Past every lease's expiry and grace (I19).
        self.clock
            .advance(TTL + GRACE + SignedDuration::from_secs(1));
        loop {
            let batch = self
                .store
                .reclaim_expired_batch(self.clock.now(), 100)
                .await
                .expect("the memory store answers");
            self.note(format_args!("final reclaim: {batch:?}"));
            if !batch.more {
                break;
            }
        }
    }

    /// What happened, for a failure message.
    fn story(&self) -> String {
        let calls = self.faulty.log.lock().unwrap().join("\n");
        format!("--- steps\n{}--- store calls\n{calls}", self.trace)
    }
}

/// Once the store answers again, every running instance serves: it holds
/// a lease, or knows from the allocator that the account has nothing left
/// (I22: backoffs end at the first answer; I29: readiness). An instance
/// with a request still pending is left out: the reservation keeps its
/// lease parked (I26), and the parked units count as coming back, not as
/// spent (I23), so with the balance otherwise empty the account is
/// rightly neither funded nor known to be empty.
fn check_recovered(world: &World) -> Result<(), TestCaseError> {
    let pending: HashSet<usize> = world.held.iter().map(|held| held.generation).collect();
    for live in &world.live {
        if pending.contains(&live.generation) {
            continue;
        }
        let handle = &world.generations[live.generation].handle;
        let report = handle.report();
        prop_assert!(
            report.ready,
            "g{} is not ready once the store answers: {:?}\n{:?}\n{}",
            live.generation,
            report,
            handle.account_reports(),
            world.story()
        );
    }
    Ok(())
}

/// What the store billed, by request id: units and whether as overage.
fn billed(world: &World) -> Result<HashMap<RequestId, (u64, bool)>, TestCaseError> {
    let mut billed = HashMap::new();
    for event in world.store.usage(world.account).unwrap() {
        let overage = matches!(event.source, UsageSource::Overage);
        let first = billed.insert(event.request_id, (event.units.get(), overage));
        prop_assert!(first.is_none(), "I8: billed twice: {event:?}");
    }
    Ok(billed)
}

/// Checks every commit against the usage the store billed (point 3), and
/// returns the units of commits that instances shut down in order lost.
fn check_usage(
    world: &World,
    billed: &HashMap<RequestId, (u64, bool)>,
) -> Result<u64, TestCaseError> {
    let story = || world.story();
    let committed: HashMap<RequestId, u64> = world
        .generations
        .iter()
        .flat_map(|generation| generation.committed.iter().copied())
        .collect();
    let released: HashSet<RequestId> = world
        .generations
        .iter()
        .flat_map(|generation| generation.released.iter().copied())
        .collect();
    for (id, (units, _)) in billed {
        prop_assert!(
            !released.contains(id),
            "I4: {id}, released for zero, was billed\n{}",
            story()
        );
        prop_assert_eq!(
            committed.get(id),
            Some(units),
            "{} billed as committed\n{}",
            id,
            story()
        );
    }
    let mut lost_in_order = 0;
    for (index, generation) in world.generations.iter().enumerate() {
        let writer = generation.handle.report().writer;
        let (missing, missing_units) = generation
            .committed
            .iter()
            .filter(|(id, _)| !billed.contains_key(id))
            .fold((0_u64, 0_u64), |(n, sum), (_, units)| (n + 1, sum + units));
        prop_assert_eq!(writer.rejected, 0, "g{}: usage refused\n{}", index, story());
        prop_assert!(
            missing <= writer.lost,
            "I21: g{index} lost {missing} commits, counted {} lost\n{}",
            writer.lost,
            story()
        );
        if let Ending::ShutDown(report) = &generation.ending {
            let drained = report.usage.as_ref().expect("the writer ran");
            prop_assert!(!drained.task_died, "g{index}: the writer died\n{}", story());
            // I25: an orderly shutdown drains everything, unless the sink
            // failed it during the drain (failures before it are excused
            // only by what they make the drain retry).
            let sink_failed = generation
                .sink_failures_at_stop
                .is_none_or(|before| sink_failures(&writer) > before);
            prop_assert!(
                (missing, drained.lost) == (0, 0) || sink_failed,
                "I25: g{index} shut down in order and lost {missing} commits\n{}",
                story()
            );
            lost_in_order += missing_units;
        }
    }
    Ok(lost_in_order)
}

/// The deliveries a writer's sink failed: storage errors and timeouts.
fn sink_failures(writer: &WriterStats) -> u64 {
    writer.storage_errors + writer.ingest_timeouts
}

/// Checks the store's books (points 1 and 2), given what the store billed
/// and the units of commits that orderly shutdowns lost.
fn check_ledger(
    world: &World,
    billed: &HashMap<RequestId, (u64, bool)>,
    lost_in_order: u64,
) -> Result<(), TestCaseError> {
    let story = || world.story();
    let violations = world.store.audit().unwrap();
    prop_assert!(
        violations.is_empty(),
        "I14, I15: {violations:?}\n{}",
        story()
    );
    let view = world
        .store
        .account(world.account, world.clock.now())
        .unwrap();
    prop_assert_eq!(
        view.leased,
        CostUnits::ZERO,
        "every lease settled\n{}",
        story()
    );
    let (mut leased, mut overage) = (0, 0);
    for (units, as_overage) in billed.values() {
        *(if *as_overage {
            &mut overage
        } else {
            &mut leased
        }) += units;
    }
    prop_assert_eq!(view.overage_debt.get(), overage, "overage billed as debt");
    prop_assert_eq!(
        world.opening + world.top_ups,
        view.balance.get() + leased + view.settled_unbilled.get(),
        "I14: opening + top-ups = balance + billed + settled unbilled\n{}",
        story()
    );
    // Only a drain cut off by its deadline releases a lease with charges
    // unbilled; reclaim credits back what a crash lost.
    prop_assert!(
        view.settled_unbilled.get() <= lost_in_order,
        "settled unbilled {} > {lost_in_order} lost by orderly shutdowns\n{}",
        view.settled_unbilled,
        story()
    );
    Ok(())
}

/// Checks each instance's spending and health (point 4).
fn check_instances(
    world: &World,
    billed: &HashMap<RequestId, (u64, bool)>,
) -> Result<(), TestCaseError> {
    let story = || world.story();
    let deadline = world.config.shutdown_deadline;
    for (index, generation) in world.generations.iter().enumerate() {
        let report = generation.handle.report();
        let granted = report.leases.expect("no overflow").acquired_units;
        // Lost or not, what an instance commits is funded by its leases or
        // by overage under the cap (I9, I10).
        let committed: u64 = generation.committed.iter().map(|(_, units)| units).sum();
        prop_assert!(
            committed <= granted + world.largest_cap,
            "I9: g{index} committed {committed} on grants of {granted}\n{}",
            story()
        );
        let (mut leased, mut overage) = (0, 0);
        for (units, as_overage) in generation
            .committed
            .iter()
            .filter_map(|(id, _)| billed.get(id))
        {
            *(if *as_overage {
                &mut overage
            } else {
                &mut leased
            }) += units;
        }
        prop_assert!(
            leased <= granted,
            "I9: g{index} billed {leased} on grants of {granted}\n{}",
            story()
        );
        prop_assert!(
            overage <= world.largest_cap,
            "I10: g{index} billed {overage} of overage, cap {}\n{}",
            world.largest_cap,
            story()
        );
        prop_assert!(
            !matches!(generation.ending, Ending::Running),
            "I25: g{index}'s shutdown never finished\n{}",
            story()
        );
        prop_assert!(!report.faulted, "g{index}: integrity fault\n{}", story());
        prop_assert_eq!(report.manager_restarts, 0, "g{}: a manager died", index);
        if let Ending::ShutDown(shutdown) = &generation.ending {
            prop_assert!(
                shutdown.elapsed <= deadline + TICK,
                "I25: g{index} shut down in {:?}\n{}",
                shutdown.elapsed,
                story()
            );
            prop_assert!(
                shutdown.leases.iter().all(|(_, lease)| !lease.task_died),
                "g{index}: a manager died\n{}",
                story()
            );
        }
    }
    Ok(())
}

async fn run(scenario: Scenario) -> Result<(), TestCaseError> {
    let mut world = World::new(&scenario);
    // Snapshots load and first leases arrive (or their calls fail).
    pass(&world.clock, ms(300)).await;
    for step in &scenario.steps {
        world.run(*step).await;
    }
    world.calm().await;
    check_recovered(&world)?;
    world.finish(scenario.graceful_end).await;
    let billed = billed(&world)?;
    let lost_in_order = check_usage(&world, &billed)?;
    check_ledger(&world, &billed, lost_in_order)?;
    check_instances(&world, &billed)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        ..ProptestConfig::default()
    })]

    /// See the module docs.
    #[test]
    fn units_are_conserved_end_to_end_whatever_the_store_answers(scenario in scenario()) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(run(scenario))?;
    }
}
