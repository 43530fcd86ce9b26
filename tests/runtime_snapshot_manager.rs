//! The snapshot manager on paused tokio time with a manual clock moved in
//! lockstep: the first refresh, readiness, fixed and enumerated selections,
//! lookups on admission's behalf, outages and hangs, account bindings and
//! shutdown — against a scripted source and end to end on the memory store
//! (I22, I23, I24).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use jiff::{SignedDuration, Timestamp};
use tokio::time::Instant;
use tollgate::admission::{
    AdmissionEngine, ArcSwapSnapshotMap, RequestIds, SlotRegistry, SnapshotMapConfig, UsageRecorder,
};
use tollgate::runtime::{
    AccountBinding, PrincipalSelection, SnapshotManager, SnapshotManagerConfig,
    SnapshotManagerConfigError, SnapshotManagerReport, SnapshotStats,
};
use tollgate::store::{
    AccountSpec, Clock, GrantPolicy, IssuedKey, KeyHash, ManualClock, MemoryStore, SnapshotCursor,
    SnapshotPage, SnapshotSource, StoreError, TailSharing,
};
use tollgate::{
    AccountId, AccountStatus, CostUnits, DenyReason, EnforcementMode, KeyStatus, LocalSharding,
    PermissionBits, PolicyRevision, Principal, PrincipalSnapshot,
};

const REFRESH: Duration = Duration::from_secs(10);
const RETRY: Duration = Duration::from_secs(3);
const FETCH_TIMEOUT: Duration = Duration::from_secs(2);
const ENUMERATION_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_STALENESS: SignedDuration = SignedDuration::from_secs(25);
const ALPHA: AccountId = AccountId(1);

fn start() -> Timestamp {
    Timestamp::from_second(1_700_000_000).expect("a test instant is in range")
}

/// `start()` plus `n` seconds.
fn t(n: i64) -> Timestamp {
    start() + SignedDuration::from_secs(n)
}

fn p(n: u64) -> Principal {
    Principal(n)
}

fn config(principals: PrincipalSelection) -> SnapshotManagerConfig {
    SnapshotManagerConfig {
        principals,
        refresh_interval: REFRESH,
        retry_backoff: RETRY,
        fetch_timeout: FETCH_TIMEOUT,
        enumeration_timeout: ENUMERATION_TIMEOUT,
        max_staleness: MAX_STALENESS,
    }
}

fn fixed(principals: impl IntoIterator<Item = u64>) -> PrincipalSelection {
    PrincipalSelection::Fixed(principals.into_iter().map(Principal).collect())
}

/// An active principal of `account`, as a source would describe it.
fn active(principal: u64, account: AccountId) -> PrincipalSnapshot {
    PrincipalSnapshot {
        principal: Principal(principal),
        account_id: account,
        key_id: None,
        key_hash: None,
        permissions: PermissionBits::ALL,
        key_status: KeyStatus::Active,
        account_status: AccountStatus::Active,
        mode: EnforcementMode::Strict,
        policy_revision: PolicyRevision(1),
        fetched_at: start(),
    }
}

/// One planned answer to a `fetch`.
#[derive(Debug, Clone, Copy)]
enum Fetch {
    /// The directory's snapshots of the principals asked for.
    Answer,
    /// Those, and the snapshot of this principal too, unasked: a source
    /// that breaks its contract.
    Volunteer(u64),
    Fail,
    Hang,
}

/// One planned answer to a `changed_since`.
#[derive(Debug, Clone)]
enum Page {
    Of {
        principals: Vec<u64>,
        next: u64,
        complete: bool,
    },
    /// That page, after which the directory changes: a change that lands
    /// between two pages of one enumeration.
    ThenSet(Box<Page>, Box<PrincipalSnapshot>),
    /// These snapshots as they are, whatever the directory holds: a page
    /// built from a change log, which may carry one principal twice.
    Exactly {
        snapshots: Vec<PrincipalSnapshot>,
        next: u64,
        complete: bool,
    },
    Fail,
    Hang,
}

/// A source call, as recorded: what was asked, and when by the caller's
/// clock, in seconds after `start()`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Fetch { principals: Vec<u64>, at: i64 },
    ChangedSince { since: u64, limit: usize, at: i64 },
}

fn fetched(principals: impl IntoIterator<Item = u64>, at: i64) -> Call {
    Call::Fetch {
        principals: principals.into_iter().collect(),
        at,
    }
}

fn paged(since: u64, at: i64) -> Call {
    Call::ChangedSince {
        since,
        limit: PAGE_SIZE,
        at,
    }
}

const PAGE_SIZE: usize = 2;

/// A source that answers from a directory of snapshots, following a script
/// of answers per call kind (then answering normally), and records every
/// call.
#[derive(Debug, Default)]
struct ScriptedSource {
    directory: Mutex<BTreeMap<Principal, PrincipalSnapshot>>,
    fetches: Mutex<VecDeque<Fetch>>,
    pages: Mutex<VecDeque<Page>>,
    calls: Mutex<Vec<Call>>,
    /// How long a fetch takes for each principal it has not answered for
    /// before, as a source with a cache; zero by default.
    cold_cost: Mutex<Duration>,
    warm: Mutex<BTreeSet<Principal>>,
    /// How far ahead of the `now` it is asked at the source's own clock
    /// stamps its snapshots; zero by default.
    lead: Mutex<SignedDuration>,
}

impl ScriptedSource {
    fn new(directory: impl IntoIterator<Item = PrincipalSnapshot>) -> Arc<Self> {
        let source = Self::default();
        for snapshot in directory {
            source.set(snapshot);
        }
        Arc::new(source)
    }

    fn set(&self, snapshot: PrincipalSnapshot) {
        lock(&self.directory).insert(snapshot.principal, snapshot);
    }

    /// The source stops knowing `principal`.
    fn remove(&self, principal: u64) {
        lock(&self.directory).remove(&Principal(principal));
    }

    fn cost_cold_principals(&self, each: Duration) {
        *lock(&self.cold_cost) = each;
    }

    fn plan_fetches(&self, answers: impl IntoIterator<Item = Fetch>) {
        lock(&self.fetches).extend(answers);
    }

    fn plan_pages(&self, answers: impl IntoIterator<Item = Page>) {
        lock(&self.pages).extend(answers);
    }

    fn calls(&self) -> Vec<Call> {
        lock(&self.calls).clone()
    }

    fn snapshots(&self, principals: &[Principal], now: Timestamp) -> Vec<PrincipalSnapshot> {
        let directory = lock(&self.directory);
        principals
            .iter()
            .filter_map(|principal| directory.get(principal))
            .map(|snapshot| PrincipalSnapshot {
                fetched_at: now + *lock(&self.lead),
                ..*snapshot
            })
            .collect()
    }
}

fn seconds_since_start(now: Timestamp) -> i64 {
    now.duration_since(start()).as_secs()
}

#[async_trait]
impl SnapshotSource for ScriptedSource {
    async fn fetch(
        &self,
        principals: &[Principal],
        now: Timestamp,
    ) -> Result<Vec<PrincipalSnapshot>, StoreError> {
        lock(&self.calls).push(Call::Fetch {
            principals: principals.iter().map(|p| p.get()).collect(),
            at: seconds_since_start(now),
        });
        let answer = lock(&self.fetches).pop_front().unwrap_or(Fetch::Answer);
        let cold = principals
            .iter()
            .filter(|principal| !lock(&self.warm).contains(principal))
            .count();
        let cost = *lock(&self.cold_cost) * u32::try_from(cold).expect("few");
        tokio::time::sleep(cost).await;
        // Only a fetch that finishes warms the cache.
        lock(&self.warm).extend(principals.iter().copied());
        match answer {
            Fetch::Answer => Ok(self.snapshots(principals, now)),
            Fetch::Volunteer(extra) => {
                let mut asked = principals.to_vec();
                asked.push(Principal(extra));
                Ok(self.snapshots(&asked, now))
            }
            Fetch::Fail => Err(StoreError::new("scripted outage")),
            Fetch::Hang => std::future::pending().await,
        }
    }

    async fn changed_since(
        &self,
        since: SnapshotCursor,
        limit: usize,
        now: Timestamp,
    ) -> Result<SnapshotPage, StoreError> {
        lock(&self.calls).push(Call::ChangedSince {
            since: since.0,
            limit,
            at: seconds_since_start(now),
        });
        let mut answer = lock(&self.pages).pop_front().unwrap_or(Page::Of {
            principals: Vec::new(),
            next: since.0,
            complete: true,
        });
        let mut then = None;
        if let Page::ThenSet(page, snapshot) = answer {
            answer = *page;
            then = Some(*snapshot);
        }
        let answer = match answer {
            Page::Of {
                principals,
                next,
                complete,
            } => {
                let principals: Vec<Principal> = principals.into_iter().map(Principal).collect();
                Ok(SnapshotPage {
                    snapshots: self.snapshots(&principals, now),
                    next: SnapshotCursor(next),
                    complete,
                })
            }
            Page::Exactly {
                snapshots,
                next,
                complete,
            } => Ok(SnapshotPage {
                snapshots,
                next: SnapshotCursor(next),
                complete,
            }),
            Page::Fail => Err(StoreError::new("scripted outage")),
            Page::Hang => std::future::pending().await,
            Page::ThenSet(..) => unreachable!("one change per page"),
        };
        if let Some(snapshot) = then {
            self.set(snapshot);
        }
        answer
    }

    async fn lookup_key(
        &self,
        _hash: &KeyHash,
        _now: Timestamp,
    ) -> Result<Option<PrincipalSnapshot>, StoreError> {
        unreachable!("the snapshot manager never resolves keys")
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Lets every task that is ready run until it waits again.
async fn settle() {
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}

/// A manager over a fresh map, with an admission engine reading the same map
/// and a manual clock the test moves in lockstep with tokio's paused time.
struct Harness {
    clock: Arc<ManualClock>,
    map: Arc<ArcSwapSnapshotMap>,
    engine: AdmissionEngine,
    manager: SnapshotManager,
}

impl Harness {
    fn new(source: Arc<dyn SnapshotSource>, principals: PrincipalSelection) -> Self {
        Self::with_clock(source, principals, Arc::new(ManualClock::new(start())))
    }

    fn with_clock(
        source: Arc<dyn SnapshotSource>,
        principals: PrincipalSelection,
        clock: Arc<ManualClock>,
    ) -> Self {
        Self::with_config(source, config(principals), clock)
    }

    fn with_config(
        source: Arc<dyn SnapshotSource>,
        config: SnapshotManagerConfig,
        clock: Arc<ManualClock>,
    ) -> Self {
        let registry = Arc::new(SlotRegistry::new(LocalSharding::Single));
        let map = Arc::new(
            ArcSwapSnapshotMap::new(
                SnapshotMapConfig {
                    max_staleness: MAX_STALENESS,
                    negative_capacity: 2,
                    history_depth: 2,
                    lookup_queue_capacity: 8,
                },
                registry,
            )
            .expect("the test map configuration is valid"),
        );
        let engine = AdmissionEngine::new(
            Arc::clone(&map),
            UsageRecorder::with_capacity(8, 8),
            RequestIds::with_prefix(1),
        );
        let manager =
            SnapshotManager::spawn(source, Arc::clone(&map), Arc::clone(&clock) as _, config)
                .expect("the test configuration is valid");
        Self {
            clock,
            map,
            engine,
            manager,
        }
    }

    /// Moves the manual clock and tokio's time forward together, one second
    /// at a time, letting the manager act at each second.
    async fn run_for(&self, seconds: u64) {
        for _ in 0..seconds {
            self.clock.advance(SignedDuration::from_secs(1));
            tokio::time::advance(Duration::from_secs(1)).await;
            settle().await;
        }
    }

    /// What admission says to `principal` now. No lease is ever installed,
    /// so a principal whose snapshot passes every check is refused at
    /// funding (`LeaseUnavailable`): that is the verdict of a fresh,
    /// usable snapshot.
    #[track_caller]
    fn verdict(&self, principal: Principal) -> DenyReason {
        match self.engine.begin(
            principal,
            PermissionBits::NONE,
            CostUnits(1),
            self.clock.now(),
        ) {
            Err(reason) => reason,
            Ok(context) => panic!("admitted without a lease: {context:?}"),
        }
    }

    fn ready(&self) -> bool {
        *self.manager.readiness().borrow()
    }
}

fn stats(refreshes: u64, published: u64, last_success: Option<Timestamp>) -> SnapshotStats {
    SnapshotStats {
        refreshes,
        published,
        last_success,
        ..SnapshotStats::default()
    }
}

/// The first refresh runs as soon as the manager starts, and readiness turns
/// true with it, not before.
#[tokio::test(start_paused = true)]
async fn the_first_refresh_runs_at_once_and_readiness_turns_true_only_after_it() {
    let source = ScriptedSource::new([active(1, ALPHA), active(2, ALPHA)]);
    let h = Harness::new(source.clone(), fixed([1, 2]));
    let mut readiness = h.manager.readiness();
    assert!(!*readiness.borrow_and_update(), "not ready before it ran");
    assert_eq!(source.calls(), vec![]);

    settle().await;
    assert_eq!(source.calls(), vec![fetched([1, 2], 0)], "at once, at t=0");
    assert!(readiness.has_changed().expect("the manager is running"));
    assert!(*readiness.borrow_and_update());
    assert_eq!(h.manager.stats(), stats(1, 2, Some(start())));
    assert_eq!(h.map.get(p(1)).map(|s| s.fetched_at), Some(start()));
    assert_eq!(h.verdict(p(1)), DenyReason::LeaseUnavailable);

    h.run_for(9).await;
    assert_eq!(source.calls().len(), 1, "nothing before the interval");
    h.run_for(1).await;
    assert_eq!(
        source.calls(),
        vec![fetched([1, 2], 0), fetched([1, 2], 10)]
    );
    assert!(
        !readiness.has_changed().expect("the manager is running"),
        "a refresh that keeps it ready does not wake watchers"
    );
}

/// I22: a fetch that never answers is cut off at `fetch_timeout`, counted,
/// and retried `retry_backoff` later; readiness waits for the refresh that
/// succeeds.
#[tokio::test(start_paused = true)]
async fn a_hanging_fetch_is_cut_off_by_the_fetch_timeout_and_retried_after_the_backoff() {
    let source = ScriptedSource::new([active(1, ALPHA)]);
    source.plan_fetches([Fetch::Hang]);
    let h = Harness::new(source.clone(), fixed([1]));
    settle().await;
    assert_eq!(source.calls(), vec![fetched([1], 0)]);

    h.run_for(1).await;
    assert_eq!(h.manager.stats().timeouts, 0, "still within the timeout");
    h.run_for(1).await;
    assert_eq!(h.manager.stats().timeouts, 1, "cut off at t=2");
    assert!(!h.ready());
    assert!(h.map.is_empty());
    assert_eq!(h.verdict(p(1)), DenyReason::SnapshotUnavailable);

    h.run_for(2).await;
    assert_eq!(source.calls().len(), 1, "the backoff runs from the cut-off");
    h.run_for(1).await;
    assert_eq!(source.calls(), vec![fetched([1], 0), fetched([1], 5)]);
    assert!(h.ready());
    assert_eq!(
        h.manager.stats(),
        SnapshotStats {
            timeouts: 1,
            ..stats(1, 1, Some(t(5)))
        }
    );
    assert_eq!(h.verdict(p(1)), DenyReason::LeaseUnavailable);

    h.run_for(10).await;
    assert_eq!(
        source.calls().last(),
        Some(&fetched([1], 15)),
        "after a success the normal interval resumes"
    );
}

/// I34: a source that answers with an older revision than the map holds
/// (a lagging replica, a restored database) does not take back a
/// revocation, and the refresh that read it does not vouch for the map: it
/// counts as failed and is retried after the backoff, and if the source
/// keeps going back the map goes stale and admission refuses.
#[tokio::test(start_paused = true)]
async fn a_source_that_goes_back_in_revision_neither_unrevokes_nor_vouches() {
    let revoked = PrincipalSnapshot {
        key_status: KeyStatus::Revoked,
        policy_revision: PolicyRevision(5),
        ..active(1, ALPHA)
    };
    let source = ScriptedSource::new([revoked]);
    let h = Harness::new(source.clone(), fixed([1]));
    settle().await;
    assert!(h.ready());
    assert_eq!(h.verdict(p(1)), DenyReason::KeyRevoked);

    // The source now says revision 3, active.
    source.set(PrincipalSnapshot {
        policy_revision: PolicyRevision(3),
        ..active(1, ALPHA)
    });
    h.run_for(10).await;
    assert_eq!(source.calls(), vec![fetched([1], 0), fetched([1], 10)]);
    assert_eq!(h.verdict(p(1)), DenyReason::KeyRevoked, "still revoked");
    let after_regression = h.manager.stats();
    assert_eq!(after_regression.failures, 1);
    assert_eq!(after_regression.refreshes, 1, "only the first vouched");
    h.run_for(3).await;
    assert_eq!(
        source.calls().last(),
        Some(&fetched([1], 13)),
        "retried after the backoff"
    );

    // Still going back: nothing vouches for the map past the staleness.
    h.run_for(13).await;
    assert!(!h.ready(), "I24: unverified past max_staleness");
    assert_eq!(h.verdict(p(1)), DenyReason::SnapshotStale);

    // The source catches up past what was published: served again.
    source.set(PrincipalSnapshot {
        policy_revision: PolicyRevision(6),
        ..active(1, ALPHA)
    });
    h.run_for(3).await;
    assert!(h.ready());
    assert_eq!(h.verdict(p(1)), DenyReason::LeaseUnavailable, "usable");
}

/// I24: a listed principal the source keeps disowning stays unknown without
/// a gap: its record is renewed by the refresh before the one it would age
/// out after, not once it has.
#[tokio::test(start_paused = true)]
async fn a_listed_principal_the_source_keeps_disowning_stays_unknown_without_a_gap() {
    let source = ScriptedSource::new([active(1, ALPHA)]);
    let h = Harness::new(source.clone(), fixed([1, 2]));
    settle().await;
    for second in 0..60 {
        assert_eq!(
            h.verdict(p(2)),
            DenyReason::UnknownPrincipal,
            "at t={second}"
        );
        h.run_for(1).await;
    }
}

/// I24: under a fixed selection nothing asks the source again about a
/// principal it once said does not exist, so that word stands for no longer
/// than the maximum staleness. A principal created after its lookup is then
/// looked up again and served, not refused as unknown for good.
#[tokio::test(start_paused = true)]
async fn a_principal_created_after_it_was_found_unknown_is_served_once_that_word_ages_out() {
    let source = ScriptedSource::new([active(1, ALPHA)]);
    let h = Harness::new(source.clone(), fixed([1]));
    settle().await;
    h.run_for(1).await;
    assert_eq!(h.verdict(p(7)), DenyReason::SnapshotUnavailable);
    h.run_for(10).await;
    assert_eq!(
        h.verdict(p(7)),
        DenyReason::UnknownPrincipal,
        "looked up at t=10"
    );

    source.set(active(7, ALPHA));
    h.run_for(19).await;
    assert_eq!(
        h.verdict(p(7)),
        DenyReason::UnknownPrincipal,
        "the source's word at t=10 stands until t=35"
    );
    h.run_for(6).await;
    assert_eq!(
        h.verdict(p(7)),
        DenyReason::SnapshotUnavailable,
        "aged out: asked again"
    );
    h.run_for(4).await;
    assert_eq!(h.verdict(p(7)), DenyReason::LeaseUnavailable, "served");
    assert!(
        source.calls().contains(&fetched([7], 40)),
        "{:?}",
        source.calls()
    );
}

/// I23, I24: a listed principal the source does not return is marked
/// unknown and denied as such; refreshing again keeps it (and every other
/// unknown principal) in the bounded negative cache, and once the source
/// knows it, it is published.
#[tokio::test(start_paused = true)]
async fn fixed_principals_the_source_does_not_know_are_marked_unknown() {
    let source = ScriptedSource::new([active(1, ALPHA)]);
    let h = Harness::new(source.clone(), fixed([1, 2, 3]));
    settle().await;
    assert!(h.map.is_known_unknown(p(2)));
    assert!(h.map.is_known_unknown(p(3)));
    assert!(!h.map.is_known_unknown(p(1)));
    assert_eq!(h.verdict(p(2)), DenyReason::UnknownPrincipal);
    assert_eq!(h.manager.stats().unknown, 2);

    h.run_for(10).await;
    assert_eq!(
        source.calls(),
        vec![fetched([1, 2, 3], 0), fetched([1, 2, 3], 10)]
    );
    assert!(
        h.map.is_known_unknown(p(2)) && h.map.is_known_unknown(p(3)),
        "I24: refreshing again does not evict them from a cache of two"
    );
    assert_eq!(h.manager.stats().unknown, 2, "already known unknown");
    assert!(h.ready(), "unknown principals do not make a refresh fail");

    source.set(active(2, ALPHA));
    h.run_for(10).await;
    assert!(!h.map.is_known_unknown(p(2)));
    assert_eq!(h.map.get(p(2)).map(|s| s.fetched_at), Some(t(20)));
    assert_eq!(h.verdict(p(2)), DenyReason::LeaseUnavailable);
    assert_eq!(h.verdict(p(3)), DenyReason::UnknownPrincipal);
}

/// An enumeration pages with each page's cursor until a page says it is
/// complete, all within one refresh, and the next refresh resumes from the
/// last cursor.
#[tokio::test(start_paused = true)]
async fn all_principals_are_paged_with_the_cursor_passed_along() {
    let source = ScriptedSource::new((1..=5).map(|n| active(n, ALPHA)));
    source.plan_pages([
        Page::Of {
            principals: vec![1, 2],
            next: 2,
            complete: false,
        },
        Page::Of {
            principals: vec![3, 4],
            next: 4,
            complete: false,
        },
        Page::Of {
            principals: vec![5],
            next: 7,
            complete: true,
        },
    ]);
    let h = Harness::new(
        source.clone(),
        PrincipalSelection::All {
            page_size: PAGE_SIZE,
        },
    );
    settle().await;
    assert_eq!(source.calls(), vec![paged(0, 0), paged(2, 0), paged(4, 0)]);
    assert_eq!(h.map.len(), 5);
    assert!(h.ready());
    assert_eq!(h.manager.stats(), stats(1, 5, Some(start())));

    h.run_for(10).await;
    assert_eq!(source.calls().last(), Some(&paged(7, 10)));
    assert_eq!(h.manager.stats(), stats(2, 5, Some(t(10))));
}

/// A change that takes something away (here a revoked key, and an overage
/// cap withdrawn) is published with its page, not held back for the rest of
/// the enumeration, so it reaches admission within a refresh interval even
/// while a later page hangs. The rest of the page (here a new principal)
/// still waits for the batch, so a mass change does not copy the map per
/// page.
#[tokio::test(start_paused = true)]
async fn a_restriction_is_published_with_its_page_while_the_enumeration_goes_on() {
    let elastic = |principal, revision| PrincipalSnapshot {
        mode: EnforcementMode::Elastic {
            overage_cap: CostUnits(10),
        },
        policy_revision: PolicyRevision(revision),
        ..active(principal, ALPHA)
    };
    let source = ScriptedSource::new([active(1, ALPHA), elastic(2, 1), active(3, ALPHA)]);
    source.plan_pages([Page::Of {
        principals: vec![1, 2, 3],
        next: 3,
        complete: true,
    }]);
    let h = Harness::new(
        source.clone(),
        PrincipalSelection::All {
            page_size: PAGE_SIZE,
        },
    );
    settle().await;
    assert_eq!(h.verdict(p(1)), DenyReason::LeaseUnavailable);
    source.set(PrincipalSnapshot {
        key_status: KeyStatus::Revoked,
        policy_revision: PolicyRevision(2),
        ..active(1, ALPHA)
    });
    source.set(PrincipalSnapshot {
        policy_revision: PolicyRevision(2),
        ..active(2, ALPHA)
    });
    source.set(PrincipalSnapshot {
        policy_revision: PolicyRevision(2),
        ..active(4, ALPHA)
    });
    source.plan_pages([
        Page::Of {
            principals: vec![4, 1],
            next: 4,
            complete: false,
        },
        Page::Of {
            principals: vec![2],
            next: 5,
            complete: false,
        },
        Page::Hang,
    ]);
    // t=10: two pages, then a page that hangs until t=12.
    h.run_for(11).await;
    assert_eq!(
        h.verdict(p(1)),
        DenyReason::KeyRevoked,
        "published with its page"
    );
    assert_eq!(
        h.map.get(p(2)).map(|snapshot| snapshot.mode),
        Some(EnforcementMode::Strict),
        "the overage cap is withdrawn at once too"
    );
    assert_eq!(
        h.verdict(p(4)),
        DenyReason::SnapshotUnavailable,
        "a new principal waits for the batch"
    );
    h.run_for(2).await;
    assert_eq!(
        h.verdict(p(4)),
        DenyReason::LeaseUnavailable,
        "the batch goes out when the page fails"
    );
}

/// I34: a principal that changes during an enumeration can appear in two
/// of its pages: first with a change held for the batch, then (at a later
/// revision) with a restriction published at once. The held snapshot is
/// superseded, not the source going back: the refresh succeeds and vouches
/// for the map, and the restriction stands.
#[tokio::test(start_paused = true)]
async fn a_held_snapshot_superseded_by_a_restriction_in_the_same_enumeration_is_not_a_regression() {
    let source = ScriptedSource::new([active(1, ALPHA), active(2, ALPHA)]);
    source.plan_pages([Page::Of {
        principals: vec![1, 2],
        next: 2,
        complete: true,
    }]);
    let h = Harness::new(
        source.clone(),
        PrincipalSelection::All {
            page_size: PAGE_SIZE,
        },
    );
    settle().await;
    assert_eq!(h.verdict(p(1)), DenyReason::LeaseUnavailable);
    // Principal 1 gains a permission (revision 2, held for the batch), and
    // its key is revoked (revision 3) as the first page is read.
    source.set(PrincipalSnapshot {
        policy_revision: PolicyRevision(2),
        ..active(1, ALPHA)
    });
    source.plan_pages([
        Page::ThenSet(
            Box::new(Page::Of {
                principals: vec![1],
                next: 3,
                complete: false,
            }),
            Box::new(PrincipalSnapshot {
                key_status: KeyStatus::Revoked,
                policy_revision: PolicyRevision(3),
                ..active(1, ALPHA)
            }),
        ),
        Page::Of {
            principals: vec![1],
            next: 4,
            complete: true,
        },
    ]);
    h.run_for(10).await;
    assert_eq!(h.verdict(p(1)), DenyReason::KeyRevoked);
    assert_eq!(
        h.map.get(p(1)).map(|snapshot| snapshot.policy_revision),
        Some(PolicyRevision(3))
    );
    let stats = h.manager.stats();
    assert_eq!((stats.refreshes, stats.failures), (2, 0), "{stats:?}");
}

/// I34: a page that carries one principal twice, the later copy a
/// restriction published at once, does not hold the earlier copy for the
/// batch, where it would be older than the map's and count the refresh as
/// gone back: the restriction stands and the refresh succeeds.
#[tokio::test(start_paused = true)]
async fn a_page_carrying_a_principal_twice_is_not_a_regression() {
    let source = ScriptedSource::new([active(1, ALPHA)]);
    source.plan_pages([Page::Of {
        principals: vec![1],
        next: 1,
        complete: true,
    }]);
    let h = Harness::new(
        source.clone(),
        PrincipalSelection::All {
            page_size: PAGE_SIZE,
        },
    );
    settle().await;
    assert_eq!(h.verdict(p(1)), DenyReason::LeaseUnavailable);
    // Revision 5 takes nothing away and is held for the batch; revision 7
    // suspends the account and is published as the page is read.
    source.plan_pages([Page::Exactly {
        snapshots: vec![
            PrincipalSnapshot {
                policy_revision: PolicyRevision(5),
                ..active(1, ALPHA)
            },
            PrincipalSnapshot {
                account_status: AccountStatus::Suspended,
                policy_revision: PolicyRevision(7),
                ..active(1, ALPHA)
            },
        ],
        next: 7,
        complete: true,
    }]);
    h.run_for(10).await;
    assert_eq!(h.verdict(p(1)), DenyReason::AccountInactive);
    assert_eq!(
        h.map.get(p(1)).map(|snapshot| snapshot.policy_revision),
        Some(PolicyRevision(7))
    );
    let stats = h.manager.stats();
    assert_eq!((stats.refreshes, stats.failures), (2, 0), "{stats:?}");
}

/// I24: an enumeration confirms the published snapshots only when it
/// completes. Pages of an unfinished one are published, but the snapshots
/// they did not touch age from the last complete refresh and are refused as
/// stale past `max_staleness`, until an enumeration completes again. A
/// hanging page is cut off by `enumeration_timeout` (I22), and retries resume
/// from the last good cursor.
#[tokio::test(start_paused = true)]
async fn the_map_is_marked_verified_only_when_an_enumeration_completes() {
    let source = ScriptedSource::new([active(1, ALPHA), active(2, ALPHA)]);
    source.plan_pages([Page::Of {
        principals: vec![1],
        next: 1,
        complete: true,
    }]);
    let h = Harness::new(
        source.clone(),
        PrincipalSelection::All {
            page_size: PAGE_SIZE,
        },
    );
    settle().await;
    source.plan_pages([
        Page::Of {
            principals: vec![2],
            next: 2,
            complete: false,
        },
        Page::Hang,
        Page::Fail,
        Page::Fail,
        Page::Fail,
        Page::Fail,
        Page::Fail,
    ]);
    // t=10: a page, then a hang cut off at t=12; failures at 15, 18, 21,
    // 24 and 27; the enumeration completes at t=30.
    h.run_for(12).await;
    assert_eq!(h.manager.stats().timeouts, 1);
    assert_eq!(h.map.get(p(2)).map(|s| s.fetched_at), Some(t(10)));

    h.run_for(13).await;
    assert_eq!(
        h.verdict(p(1)),
        DenyReason::LeaseUnavailable,
        "25s old: fresh"
    );
    assert!(h.ready());
    h.run_for(1).await;
    assert_eq!(
        h.verdict(p(1)),
        DenyReason::SnapshotStale,
        "I24: the incomplete enumeration did not confirm it"
    );
    assert_eq!(
        h.verdict(p(2)),
        DenyReason::LeaseUnavailable,
        "the page that carried it is 16s old"
    );
    assert!(!h.ready(), "no complete refresh within max_staleness");

    h.run_for(4).await;
    assert_eq!(
        h.verdict(p(1)),
        DenyReason::LeaseUnavailable,
        "confirmed at t=30"
    );
    assert!(h.ready());
    assert_eq!(
        source.calls(),
        vec![
            paged(0, 0),
            paged(1, 10),
            paged(2, 10),
            paged(2, 15),
            paged(2, 18),
            paged(2, 21),
            paged(2, 24),
            paged(2, 27),
            paged(2, 30),
        ]
    );
    assert_eq!(
        h.manager.stats(),
        SnapshotStats {
            failures: 5,
            timeouts: 1,
            ..stats(2, 2, Some(t(30)))
        }
    );
}

/// I24: a failing source never clears what was published: the last good
/// snapshot keeps serving, retries come every `retry_backoff`, readiness
/// drops once no refresh has succeeded within `max_staleness` (when the map
/// refuses the snapshot too), and both come back with the first success.
#[tokio::test(start_paused = true)]
async fn a_failing_source_keeps_the_last_snapshots_and_readiness_lapses_after_max_staleness() {
    let source = ScriptedSource::new([active(1, ALPHA)]);
    source.plan_fetches([Fetch::Answer]);
    source.plan_fetches([Fetch::Fail; 7]);
    let h = Harness::new(source.clone(), fixed([1]));
    settle().await;

    h.run_for(25).await;
    assert_eq!(h.map.get(p(1)).map(|s| s.fetched_at), Some(start()));
    assert_eq!(h.verdict(p(1)), DenyReason::LeaseUnavailable);
    assert!(h.ready(), "exactly max_staleness old is still fresh");

    h.run_for(1).await;
    assert!(!h.ready());
    assert_eq!(h.verdict(p(1)), DenyReason::SnapshotStale);
    assert_eq!(
        h.map.get(p(1)).map(|s| s.fetched_at),
        Some(start()),
        "the stale snapshot is kept, not withdrawn"
    );

    h.run_for(5).await;
    assert!(h.ready());
    assert_eq!(h.verdict(p(1)), DenyReason::LeaseUnavailable);
    let times: Vec<i64> = source
        .calls()
        .iter()
        .map(|call| match call {
            Call::Fetch { at, .. } => *at,
            Call::ChangedSince { .. } => unreachable!("a fixed selection never enumerates"),
        })
        .collect();
    assert_eq!(times, vec![0, 10, 13, 16, 19, 22, 25, 28, 31]);
    assert_eq!(
        h.manager.stats(),
        SnapshotStats {
            failures: 7,
            ..stats(2, 2, Some(t(31)))
        }
    );
}

/// I24: a source whose clock runs ahead stamps its snapshots in the future.
/// Trust runs from when the manager asked, so once the source fails the
/// snapshot goes stale `max_staleness` after the last ask, not that plus the
/// source's lead (during which a key revoked meanwhile would be admitted).
#[tokio::test(start_paused = true)]
async fn a_source_clock_running_ahead_does_not_stretch_how_long_a_snapshot_is_trusted() {
    let source = ScriptedSource::new([active(1, ALPHA)]);
    *lock(&source.lead) = SignedDuration::from_mins(10);
    source.plan_fetches([Fetch::Answer]);
    source.plan_fetches([Fetch::Fail; 16]);
    let h = Harness::new(source.clone(), fixed([1]));
    settle().await;
    assert_eq!(
        h.map.get(p(1)).map(|s| s.fetched_at),
        Some(start()),
        "trusted from the ask, not from the source's stamp ten minutes on"
    );

    h.run_for(25).await;
    assert_eq!(h.verdict(p(1)), DenyReason::LeaseUnavailable);
    h.run_for(1).await;
    assert_eq!(h.verdict(p(1)), DenyReason::SnapshotStale);
    assert!(!h.ready());
}

/// A principal admission asked about and found no snapshot for is looked up
/// at the next tick: published if the source knows it, remembered as unknown
/// if not. A failed lookup is retried after the backoff, and under a fixed
/// selection a principal found this way is fetched with the list from then
/// on.
#[tokio::test(start_paused = true)]
async fn a_lookup_that_fails_is_retried_after_the_backoff_and_then_refreshed_with_the_list() {
    let source = ScriptedSource::new([active(1, ALPHA), active(2, ALPHA)]);
    source.plan_fetches([Fetch::Answer, Fetch::Answer, Fetch::Fail]);
    let h = Harness::new(source.clone(), fixed([1]));
    settle().await;
    h.run_for(5).await;
    assert_eq!(h.verdict(p(2)), DenyReason::SnapshotUnavailable);
    assert_eq!(h.verdict(p(2)), DenyReason::SnapshotUnavailable);

    h.run_for(5).await;
    assert_eq!(
        h.verdict(p(2)),
        DenyReason::SnapshotUnavailable,
        "the lookup failed"
    );
    h.run_for(3).await;
    assert_eq!(h.verdict(p(2)), DenyReason::LeaseUnavailable);
    h.run_for(10).await;
    assert_eq!(
        source.calls(),
        vec![
            fetched([1], 0),
            fetched([1], 10),
            fetched([2], 10),
            fetched([1], 13),
            fetched([2], 13),
            fetched([1, 2], 23),
        ]
    );
    assert_eq!(
        h.manager.stats(),
        SnapshotStats {
            failures: 1,
            lookups: 2,
            ..stats(4, 6, Some(t(23)))
        }
    );
}

/// A lookup too large to answer within the fetch timeout would time out on
/// every tick, and no principal admission asks about would ever be
/// published. After a timeout the lookups ask for half as many, and grow
/// back as they are answered, until every principal asked about is served.
#[tokio::test(start_paused = true)]
async fn a_lookup_too_large_for_the_timeout_shrinks_until_it_is_answered() {
    let source = ScriptedSource::new((1..=9).map(|principal| active(principal, ALPHA)));
    // 600 ms for each principal the source has not answered for before,
    // against a fetch timeout of 2 s: at most three new ones fit.
    source.cost_cold_principals(Duration::from_millis(600));
    let h = Harness::new(source.clone(), fixed([1]));
    h.run_for(3).await;
    for principal in 2..=9 {
        assert_eq!(h.verdict(p(principal)), DenyReason::SnapshotUnavailable);
    }
    h.run_for(60).await;
    for principal in 2..=9 {
        assert_eq!(
            h.verdict(p(principal)),
            DenyReason::LeaseUnavailable,
            "principal {principal} is served"
        );
    }
    let lookups: Vec<usize> = source
        .calls()
        .iter()
        .filter_map(|call| match call {
            Call::Fetch { principals, .. } if !principals.contains(&1) => Some(principals.len()),
            _ => None,
        })
        .collect();
    // Halved after each timeout, doubled after each answer: four new
    // principals cost 2.4 s, so every lookup of four times out and the two
    // after it are answered, until the last two are asked together.
    assert_eq!(
        lookups,
        [8, 4, 2, 4, 2, 4, 2, 2],
        "halved after each timeout, grown back after each answer"
    );
}

/// I24: a failed lookup does not put off the next refresh, even with a
/// retry backoff longer than the staleness allows: the snapshots already
/// published stay fresh, and the lookup is asked again with the refresh.
#[tokio::test(start_paused = true)]
async fn a_failed_lookup_does_not_put_off_the_next_refresh() {
    let source = ScriptedSource::new([active(1, ALPHA), active(2, ALPHA)]);
    source.plan_fetches([Fetch::Answer, Fetch::Answer, Fetch::Fail]);
    let slow_retry = SnapshotManagerConfig {
        retry_backoff: REFRESH * 6,
        ..config(fixed([1]))
    };
    let h = Harness::with_config(
        source.clone(),
        slow_retry,
        Arc::new(ManualClock::new(start())),
    );
    settle().await;
    h.run_for(5).await;
    assert_eq!(h.verdict(p(2)), DenyReason::SnapshotUnavailable);
    h.run_for(25).await;
    assert_eq!(
        source.calls(),
        vec![
            fetched([1], 0),
            fetched([1], 10),
            fetched([2], 10),
            fetched([1], 20),
            fetched([2], 20),
            fetched([1, 2], 30),
        ],
        "the refresh kept its interval; the lookup went with it"
    );
    assert_eq!(h.verdict(p(1)), DenyReason::LeaseUnavailable, "fresh");
    assert!(h.ready());
}

/// I24: a source that answers for a principal it was not asked about is
/// not believed: nothing would refresh that snapshot later, yet every
/// refresh would vouch for it.
#[tokio::test(start_paused = true)]
async fn a_snapshot_the_source_volunteers_is_not_published() {
    let source = ScriptedSource::new([active(1, ALPHA), active(2, ALPHA)]);
    source.plan_fetches([Fetch::Volunteer(2)]);
    let h = Harness::new(source.clone(), fixed([1]));
    settle().await;
    assert!(h.map.get(p(1)).is_some());
    assert!(h.map.get(p(2)).is_none(), "not asked, not published");
    assert_eq!(h.verdict(p(2)), DenyReason::SnapshotUnavailable);
}

/// Shutdown returns at once even while a fetch hangs, reports the counts,
/// and leaves readiness false with its channel closed.
#[tokio::test(start_paused = true)]
async fn shutdown_is_prompt_while_a_call_hangs_and_reports_the_counts() {
    let source = ScriptedSource::new([active(1, ALPHA)]);
    source.plan_fetches([Fetch::Answer, Fetch::Hang]);
    let h = Harness::new(source.clone(), fixed([1]));
    settle().await;
    h.run_for(11).await;
    assert_eq!(source.calls().len(), 2, "the second fetch is hanging");
    let readiness = h.manager.readiness();
    assert!(*readiness.borrow());

    let begun = Instant::now();
    let report = h.manager.shutdown().await;
    assert_eq!(begun.elapsed(), Duration::ZERO);
    assert_eq!(
        report,
        SnapshotManagerReport {
            stats: stats(1, 1, Some(start())),
            task_died: false,
        }
    );
    assert!(!*readiness.borrow(), "not ready after shutdown");
    assert!(readiness.has_changed().is_err(), "the channel is closed");
    assert_eq!(
        Arc::strong_count(&source),
        1,
        "the task let go of the source"
    );
    assert_eq!(
        h.map.get(p(1)).map(|s| s.fetched_at),
        Some(start()),
        "the map keeps what was published"
    );
}

/// Dropping the handle aborts the task, which withdraws readiness.
#[tokio::test(start_paused = true)]
async fn dropping_the_manager_aborts_its_task_and_withdraws_readiness() {
    let source = ScriptedSource::new([active(1, ALPHA)]);
    let h = Harness::new(source.clone(), fixed([1]));
    settle().await;
    let readiness = h.manager.readiness();
    assert!(*readiness.borrow());

    drop(h.manager);
    settle().await;
    assert!(!*readiness.borrow());
    assert!(readiness.has_changed().is_err(), "the channel is closed");
    assert_eq!(Arc::strong_count(&source), 1, "the task is gone");
}

fn store() -> Arc<MemoryStore> {
    Arc::new(
        MemoryStore::new(GrantPolicy {
            max_ttl: SignedDuration::from_secs(60),
            reclaim_grace: SignedDuration::from_secs(5),
            tail: TailSharing {
                instances: 1,
                min_grant: CostUnits(1),
            },
        })
        .expect("the test policy is valid"),
    )
}

fn open_account(store: &MemoryStore) -> AccountId {
    store
        .create_account(
            AccountSpec {
                balance: CostUnits(100),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            start(),
        )
        .expect("opening an account succeeds")
}

fn issue(store: &MemoryStore, account: AccountId, now: Timestamp) -> IssuedKey {
    store
        .issue_key(account, PermissionBits::ALL, now)
        .expect("issuing a key succeeds")
}

/// I16, I23: a key revoked in the store is published revoked by the next
/// (incremental) refresh, and admission denies it from then on.
#[tokio::test(start_paused = true)]
async fn a_revocation_in_the_store_reaches_the_map_on_the_next_refresh() {
    let store = store();
    let account = open_account(&store);
    let key = issue(&store, account, start());
    let h = Harness::new(store.clone(), PrincipalSelection::All { page_size: 10 });
    settle().await;
    assert_eq!(h.verdict(key.principal), DenyReason::LeaseUnavailable);

    h.run_for(5).await;
    store
        .revoke_key(key.key_id, h.clock.now())
        .expect("the key exists");
    h.run_for(4).await;
    assert_eq!(
        h.verdict(key.principal),
        DenyReason::LeaseUnavailable,
        "not before the next refresh"
    );
    h.run_for(1).await;
    let published = h.map.get(key.principal).expect("still published");
    assert_eq!(published.key_status, KeyStatus::Revoked);
    assert_eq!(published.fetched_at, t(10));
    assert_eq!(h.verdict(key.principal), DenyReason::KeyRevoked);
}

/// I23: an account suspended in the store is published suspended by the
/// next fixed refresh, and its principals are denied as inactive.
#[tokio::test(start_paused = true)]
async fn a_suspension_in_the_store_reaches_the_map_on_the_next_fixed_refresh() {
    let store = store();
    let account = open_account(&store);
    let key = issue(&store, account, start());
    let h = Harness::new(store.clone(), fixed([key.principal.get()]));
    settle().await;
    assert_eq!(h.verdict(key.principal), DenyReason::LeaseUnavailable);

    h.run_for(3).await;
    store
        .set_status(account, AccountStatus::Suspended)
        .expect("the account exists");
    h.run_for(7).await;
    assert_eq!(h.verdict(key.principal), DenyReason::AccountInactive);
}

/// A principal admission asked about (denied `SnapshotUnavailable` and
/// queued) is fetched and published within one tick; one the source does not
/// know is then denied as unknown. Under a fixed selection the looked-up
/// principal is refreshed with the list, so its later revocation is seen too.
#[tokio::test(start_paused = true)]
async fn principals_admission_asked_about_are_fetched_and_published_within_one_tick() {
    let store = store();
    let account = open_account(&store);
    let listed = issue(&store, account, start());
    let h = Harness::new(store.clone(), fixed([listed.principal.get()]));
    settle().await;

    h.run_for(1).await;
    let newcomer = issue(&store, account, h.clock.now());
    let stranger = Principal(999);
    assert_eq!(
        h.verdict(newcomer.principal),
        DenyReason::SnapshotUnavailable
    );
    assert_eq!(
        h.verdict(newcomer.principal),
        DenyReason::SnapshotUnavailable
    );
    assert_eq!(h.verdict(stranger), DenyReason::SnapshotUnavailable);

    h.run_for(9).await;
    assert_eq!(h.verdict(newcomer.principal), DenyReason::LeaseUnavailable);
    assert_eq!(h.verdict(stranger), DenyReason::UnknownPrincipal);
    let stats = h.manager.stats();
    assert_eq!(
        (stats.lookups, stats.unknown),
        (2, 1),
        "each principal once"
    );

    h.run_for(2).await;
    store
        .revoke_key(newcomer.key_id, h.clock.now())
        .expect("the key exists");
    h.run_for(8).await;
    assert_eq!(
        h.verdict(newcomer.principal),
        DenyReason::KeyRevoked,
        "the looked-up principal is refreshed with the list"
    );
}

fn binding(account: AccountId, usable: bool, last_seen_usable: i64) -> AccountBinding {
    AccountBinding {
        account,
        usable,
        last_seen_usable: t(last_seen_usable),
    }
}

/// Bindings list the accounts with a usable principal and when each was
/// last seen so; an account whose key is revoked or which is suspended stays
/// listed, not usable, with its last-seen time, until its slot is retired;
/// an account never usable is never listed.
#[tokio::test(start_paused = true)]
async fn bindings_list_usable_accounts_and_keep_the_last_seen_time_of_those_that_lost_them() {
    let store = store();
    let (a, b, c) = (
        open_account(&store),
        open_account(&store),
        open_account(&store),
    );
    issue(&store, a, start());
    let b_key = issue(&store, b, start());
    let c_key = issue(&store, c, start());
    store
        .revoke_key(c_key.key_id, start())
        .expect("the key exists");
    let h = Harness::new(store.clone(), PrincipalSelection::All { page_size: 10 });
    let mut bindings = h.manager.bindings();
    let listed = |bindings: &tokio::sync::watch::Receiver<
        Arc<tollgate::runtime::AccountBindings>,
    >| { bindings.borrow().accounts().collect::<Vec<_>>() };
    settle().await;
    assert!(bindings.has_changed().expect("the manager is running"));
    assert_eq!(
        listed(&bindings),
        vec![binding(a, true, 0), binding(b, true, 0)]
    );
    assert!(!bindings.borrow().is_usable(c));
    assert_eq!(bindings.borrow().last_seen(c), None);

    h.run_for(10).await;
    assert_eq!(
        listed(&bindings),
        vec![binding(a, true, 10), binding(b, true, 10)]
    );

    h.run_for(2).await;
    store
        .revoke_key(b_key.key_id, h.clock.now())
        .expect("the key exists");
    h.run_for(8).await;
    assert_eq!(
        listed(&bindings),
        vec![binding(a, true, 20), binding(b, false, 10)]
    );

    h.run_for(1).await;
    store
        .set_status(a, AccountStatus::Suspended)
        .expect("the account exists");
    h.run_for(9).await;
    let current = Arc::clone(&bindings.borrow_and_update());
    assert_eq!(
        current.accounts().collect::<Vec<_>>(),
        vec![binding(a, false, 20), binding(b, false, 10)]
    );
    assert_eq!(current.usable_accounts().count(), 0);
    assert_eq!(current.get(b), Some(binding(b, false, 10)));

    // The supervisor retires b after its linger; the bindings forget it.
    let retired = h.map.registry().retain(|account| account != b);
    assert_eq!(retired.len(), 1);
    h.run_for(10).await;
    assert_eq!(listed(&bindings), vec![binding(a, false, 20)]);

    store
        .set_status(a, AccountStatus::Active)
        .expect("the account exists");
    h.run_for(10).await;
    assert_eq!(listed(&bindings), vec![binding(a, true, 50)]);
    assert_eq!(bindings.borrow().len(), 1);
}

/// Bindings follow principals that move between accounts or that the
/// source stops knowing: an account left without a usable principal either
/// way stays listed, not usable, from the last time it had one. A stale read
/// naming another account is dropped (I34) and binds nothing.
#[tokio::test(start_paused = true)]
async fn bindings_follow_principals_that_move_or_disappear_and_ignore_stale_reads() {
    let (a, b, c) = (AccountId(1), AccountId(2), AccountId(3));
    let source = ScriptedSource::new([active(1, a), active(2, b)]);
    let h = Harness::new(source.clone(), fixed([1, 2]));
    let bindings = h.manager.bindings();
    let listed = || bindings.borrow().accounts().collect::<Vec<_>>();
    settle().await;
    assert_eq!(listed(), vec![binding(a, true, 0), binding(b, true, 0)]);

    // p1 moves from a to b: a has no usable principal left.
    source.set(PrincipalSnapshot {
        policy_revision: PolicyRevision(2),
        ..active(1, b)
    });
    h.run_for(10).await;
    assert_eq!(listed(), vec![binding(a, false, 0), binding(b, true, 10)]);

    // A read of p2 older than the one held, naming c, is dropped: c is
    // never bound, and b keeps p2 (and p1, read fresh at 20).
    source.set(PrincipalSnapshot {
        policy_revision: PolicyRevision(0),
        ..active(2, c)
    });
    h.run_for(10).await;
    assert_eq!(listed(), vec![binding(a, false, 0), binding(b, true, 20)]);
    assert!(!bindings.borrow().is_usable(c));
    assert!(h.map.registry().get(c).is_none(), "no slot for c either");

    // The source forgets p1 and puts p2 back as it was. The refresh that
    // read the stale p2 failed, so the next comes after the retry backoff,
    // at 23: b keeps p2.
    source.remove(1);
    source.set(active(2, b));
    h.run_for(10).await;
    assert_eq!(listed(), vec![binding(a, false, 0), binding(b, true, 23)]);
    assert!(h.map.is_known_unknown(p(1)));

    // Then p2 as well: at the refresh at 33, b has none left, and stays
    // listed from the last time it had one.
    source.remove(2);
    h.run_for(10).await;
    assert_eq!(listed(), vec![binding(a, false, 0), binding(b, false, 23)]);
    assert_eq!(bindings.borrow().usable_accounts().count(), 0);
}

/// A configuration and the first rule it breaks, if any.
#[track_caller]
fn check(config: &SnapshotManagerConfig, expected: Result<(), SnapshotManagerConfigError>) {
    assert_eq!(config.validate(), expected, "{config:?}");
}

/// I17: every rule is checked, in field order, and the first one broken is
/// named; `retry_backoff` may exceed `refresh_interval`.
#[test]
#[allow(
    clippy::too_many_lines,
    reason = "one rule after another, read top to bottom"
)]
fn every_configuration_rule_is_checked_in_field_order() {
    use SnapshotManagerConfigError as Broken;
    let valid = config(fixed([1]));
    let all = config(PrincipalSelection::All { page_size: 1 });
    let zero = Duration::ZERO;
    check(&valid, Ok(()));
    check(&all, Ok(()));
    check(
        &SnapshotManagerConfig {
            retry_backoff: REFRESH * 2,
            ..valid.clone()
        },
        Ok(()),
    );
    check(
        &SnapshotManagerConfig {
            principals: fixed([]),
            refresh_interval: zero,
            ..valid.clone()
        },
        Err(Broken::FixedPrincipalsEmpty),
    );
    check(
        &SnapshotManagerConfig {
            principals: PrincipalSelection::All { page_size: 0 },
            refresh_interval: zero,
            ..valid.clone()
        },
        Err(Broken::PageSizeZero),
    );
    check(
        &SnapshotManagerConfig {
            refresh_interval: zero,
            retry_backoff: zero,
            ..valid.clone()
        },
        Err(Broken::RefreshIntervalBelowTimerResolution),
    );
    check(
        &SnapshotManagerConfig {
            retry_backoff: zero,
            fetch_timeout: zero,
            ..valid.clone()
        },
        Err(Broken::RetryBackoffBelowTimerResolution),
    );
    check(
        &SnapshotManagerConfig {
            fetch_timeout: zero,
            enumeration_timeout: zero,
            ..all.clone()
        },
        Err(Broken::FetchTimeoutBelowTimerResolution),
    );
    check(
        &SnapshotManagerConfig {
            enumeration_timeout: zero,
            max_staleness: SignedDuration::ZERO,
            ..valid.clone()
        },
        Err(Broken::EnumerationTimeoutBelowTimerResolution),
    );
    // I17: each interval, backoff and timeout is at least the timer's
    // millisecond; one is enough.
    let under_a_milli = Duration::from_micros(999);
    check(
        &SnapshotManagerConfig {
            refresh_interval: under_a_milli,
            ..valid.clone()
        },
        Err(Broken::RefreshIntervalBelowTimerResolution),
    );
    check(
        &SnapshotManagerConfig {
            retry_backoff: under_a_milli,
            ..valid.clone()
        },
        Err(Broken::RetryBackoffBelowTimerResolution),
    );
    check(
        &SnapshotManagerConfig {
            fetch_timeout: under_a_milli,
            ..valid.clone()
        },
        Err(Broken::FetchTimeoutBelowTimerResolution),
    );
    check(
        &SnapshotManagerConfig {
            enumeration_timeout: under_a_milli,
            ..all.clone()
        },
        Err(Broken::EnumerationTimeoutBelowTimerResolution),
    );
    let a_milli = Duration::from_millis(1);
    check(
        &SnapshotManagerConfig {
            refresh_interval: a_milli,
            retry_backoff: a_milli,
            fetch_timeout: a_milli,
            enumeration_timeout: a_milli,
            ..all.clone()
        },
        Ok(()),
    );
    check(
        &SnapshotManagerConfig {
            max_staleness: SignedDuration::from_secs(10),
            ..valid.clone()
        },
        Err(Broken::MaxStalenessNotAboveRefreshInterval),
    );
    check(
        &SnapshotManagerConfig {
            max_staleness: SignedDuration::from_secs(-30),
            ..valid.clone()
        },
        Err(Broken::MaxStalenessNotAboveRefreshInterval),
    );
    check(
        &SnapshotManagerConfig {
            refresh_interval: Duration::MAX,
            ..valid.clone()
        },
        Err(Broken::MaxStalenessNotAboveRefreshInterval),
    );
    // Above the interval, but not above the interval and a slow call.
    let within_a_slow_refresh = SignedDuration::try_from(REFRESH + FETCH_TIMEOUT).unwrap();
    check(
        &SnapshotManagerConfig {
            max_staleness: within_a_slow_refresh,
            ..valid.clone()
        },
        Err(Broken::MaxStalenessNotAboveRefreshAndCall),
    );
    check(
        &SnapshotManagerConfig {
            max_staleness: within_a_slow_refresh,
            fetch_timeout: Duration::from_millis(1_999),
            enumeration_timeout: Duration::from_millis(1_999),
            ..valid.clone()
        },
        Ok(()),
    );
    // A call longer than the interval delays the next refresh to its end:
    // the map is then as old as two calls just before it is verified.
    let slow_call = Duration::from_secs(2);
    let one_interval = Duration::from_secs(1);
    check(
        &SnapshotManagerConfig {
            refresh_interval: one_interval,
            fetch_timeout: slow_call,
            // Above the interval and one call (3 s), not above two calls.
            max_staleness: SignedDuration::try_from(slow_call * 2).unwrap(),
            ..valid.clone()
        },
        Err(Broken::MaxStalenessNotAboveRefreshAndCall),
    );
    check(
        &SnapshotManagerConfig {
            refresh_interval: one_interval,
            fetch_timeout: slow_call,
            max_staleness: SignedDuration::try_from(slow_call * 2).unwrap()
                + SignedDuration::from_millis(1),
            ..valid.clone()
        },
        Ok(()),
    );
    // Each plan is held to the timeout of the call its refresh makes.
    check(
        &SnapshotManagerConfig {
            enumeration_timeout: Duration::MAX,
            ..valid
        },
        Ok(()),
    );
    check(
        &SnapshotManagerConfig {
            enumeration_timeout: Duration::MAX,
            ..all.clone()
        },
        Err(Broken::MaxStalenessNotAboveRefreshAndCall),
    );
    check(
        &SnapshotManagerConfig {
            fetch_timeout: Duration::MAX,
            ..all
        },
        Ok(()),
    );
    for broken in [
        Broken::FixedPrincipalsEmpty,
        Broken::PageSizeZero,
        Broken::RefreshIntervalBelowTimerResolution,
        Broken::RetryBackoffBelowTimerResolution,
        Broken::FetchTimeoutBelowTimerResolution,
        Broken::EnumerationTimeoutBelowTimerResolution,
        Broken::MaxStalenessNotAboveRefreshInterval,
        Broken::MaxStalenessNotAboveRefreshAndCall,
    ] {
        let message = broken.to_string();
        assert!(message.starts_with("snapshot manager: "), "{message}");
        assert_eq!(message, message.to_lowercase(), "lowercase: {message}");
    }
}

/// I17: an invalid configuration starts nothing.
#[tokio::test(start_paused = true)]
async fn spawn_refuses_an_invalid_configuration_and_starts_nothing() {
    let source = ScriptedSource::new([]);
    let map = Arc::new(
        ArcSwapSnapshotMap::new(
            SnapshotMapConfig {
                max_staleness: MAX_STALENESS,
                negative_capacity: 1,
                history_depth: 1,
                lookup_queue_capacity: 1,
            },
            Arc::new(SlotRegistry::new(LocalSharding::Single)),
        )
        .expect("the test map configuration is valid"),
    );
    let refused = SnapshotManager::spawn(
        source.clone(),
        Arc::clone(&map),
        Arc::new(ManualClock::new(start())),
        config(fixed([])),
    );
    assert_eq!(
        refused.map(|_| ()).unwrap_err(),
        SnapshotManagerConfigError::FixedPrincipalsEmpty
    );
    // I17: readiness that would outlive what admission accepts is refused,
    // not warned about.
    let outliving = SnapshotManagerConfig {
        max_staleness: MAX_STALENESS + SignedDuration::from_secs(1),
        ..config(fixed([1]))
    };
    let refused = SnapshotManager::spawn(
        source.clone(),
        map,
        Arc::new(ManualClock::new(start())),
        outliving,
    );
    assert_eq!(
        refused.map(|_| ()).unwrap_err(),
        SnapshotManagerConfigError::MaxStalenessAboveMap
    );
    settle().await;
    assert_eq!(source.calls(), vec![]);
    assert_eq!(Arc::strong_count(&source), 1);
}
