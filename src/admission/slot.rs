//! One account's lease slot, and the registry of slots.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use arc_swap::{ArcSwap, ArcSwapOption};
use jiff::Timestamp;
use rustc_hash::FxBuildHasher;
use tokio::sync::{Notify, watch};

use crate::model::{
    AccountId, AccountOverage, BalanceShortfall, CostUnits, LeaseDebit, LeaseId, LocalLease,
    LocalSharding, Locality, RefillSignal, ShardView, ViewMiss,
};

/// Entries in each thread's cache of shard views: a power of two. Slot
/// ids are handed out in order, so up to this many slots a thread serves
/// in turn never share an entry (`benches/admission.rs` round-robins 256).
const VIEW_CACHE: usize = 256;

/// Misses of another slot's live view an entry takes before it is handed
/// over: slots sharing an entry in turn would otherwise each pay a
/// downgrade (two read-modify-writes, with the old view's drop) at every
/// request.
const EVICT_AFTER: u8 = 4;

/// Slot ids start at 1: 0 marks an empty cache entry.
static NEXT_SLOT_ID: AtomicU64 = AtomicU64::new(1);

/// One entry of a thread's view cache.
struct CachedView {
    /// The slot the view was taken for; 0 for none.
    slot: u64,
    view: Option<ShardView>,
    /// Misses by other slots since the view was cached.
    conflicts: u8,
}

thread_local! {
    /// Per thread, direct-mapped by slot id: a weak view of this thread's
    /// first shard of the lease the slot served when the view was taken
    /// (see [`LeaseSlot::debit_cached`]).
    static VIEWS: RefCell<[CachedView; VIEW_CACHE]> = const {
        RefCell::new(
            [const {
                CachedView {
                    slot: 0,
                    view: None,
                    conflicts: 0,
                }
            }; VIEW_CACHE],
        )
    };
}

/// The cache entry of slot `id`.
#[inline]
fn entry_of(id: u64) -> usize {
    #[allow(clippy::cast_possible_truncation, reason = "masked to the cache size")]
    let low = id as usize;
    low & (VIEW_CACHE - 1)
}

/// The one place per account that holds the lease currently serving
/// requests, with the account's overage counter and what the instance knows
/// of its funds beyond that lease.
///
/// Requests read it without locking; the lease manager is its only writer.
pub struct LeaseSlot {
    /// Process-unique, never reused (unlike the slot's address): keys the
    /// per-thread view caches.
    id: u64,
    account: AccountId,
    lease: ArcSwapOption<LocalLease>,
    overage: Arc<AccountOverage>,
    evidence: ArcSwapOption<Shown>,
    /// Whether the lease manager's last grant call failed without an answer
    /// (a storage error or a timeout).
    allocator_unreachable: AtomicBool,
    sharding: LocalSharding,
    /// Lost debit races of leases no longer in the slot.
    retired_contention: AtomicU64,
    /// Set while the slot is empty because its last lease lapsed unused:
    /// the lease manager acquires again only once a request asks (I28).
    idle: ArcSwapOption<Idle>,
    /// Set by a request that found the slot without a lease; taken by the
    /// lease manager, which asks the store about a spent account at every
    /// poll only while requests want it.
    wanted: AtomicBool,
    /// Wakes requests waiting for a lease (see
    /// [`TollgateBuilder::wait_for_lease`](crate::layer::TollgateBuilder::wait_for_lease))
    /// whenever the lease manager changes what admission would answer: a
    /// lease installed, different evidence published, the allocator's
    /// reachability changed (and at shutdown). Only the runtime notifies,
    /// never the request path.
    changes: Arc<Notify>,
}

/// How a request wakes the lease manager of a slot left empty for want of
/// use.
struct Idle {
    bell: Arc<dyn RefillSignal>,
    asked: AtomicBool,
}

/// Funding evidence as published, and whether admission may answer on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shown {
    shortfall: BalanceShortfall,
    settled: bool,
    /// The lease the slot served when it was published: the evidence
    /// counts every unit beside that lease's, so a request that read
    /// another (or none) answers no quote as final on it.
    serving: Option<LeaseId>,
}

impl LeaseSlot {
    /// An empty slot for `account` whose leases use `sharding`.
    #[must_use]
    pub fn new(account: AccountId, sharding: LocalSharding) -> Self {
        Self {
            id: NEXT_SLOT_ID.fetch_add(1, Ordering::Relaxed),
            account,
            lease: ArcSwapOption::empty(),
            overage: Arc::new(AccountOverage::new(account)),
            evidence: ArcSwapOption::empty(),
            allocator_unreachable: AtomicBool::new(false),
            sharding,
            retired_contention: AtomicU64::new(0),
            idle: ArcSwapOption::empty(),
            wanted: AtomicBool::new(false),
            changes: Arc::new(Notify::new()),
        }
    }

    /// What wakes a request waiting for this slot's lease manager to change
    /// what admission answers (see the field). Enable the notification
    /// before trying admission again, so a change in between is not missed.
    pub(crate) fn changes(&self) -> &Arc<Notify> {
        &self.changes
    }

    /// Marks the slot as left empty for want of use, by the lease manager
    /// that lets its last lease lapse: a request that finds it empty rings
    /// `bell` ([`ask_for_lease`](Self::ask_for_lease)) rather than wait
    /// for a poll, since none will acquire (I28).
    pub(crate) fn idle_until_asked(&self, bell: Arc<dyn RefillSignal>) {
        self.idle.store(Some(Arc::new(Idle {
            bell,
            asked: AtomicBool::new(false),
        })));
    }

    /// Ends [`idle_until_asked`](Self::idle_until_asked): the lease manager
    /// acquires as usual again.
    pub(crate) fn end_idle(&self) {
        self.idle.store(None);
    }

    /// Whether the slot was left empty for want of use and waits for a
    /// request to ask for a lease (I28). Readiness counts such an account
    /// as served once the lapsed lease is released: its units are then in
    /// the balance, fetched at the first request (I29).
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.idle.load().is_some()
    }

    /// Whether a request found the slot without a lease since the last
    /// call, clearing the mark.
    pub(crate) fn take_wanted(&self) -> bool {
        self.wanted.swap(false, Ordering::Relaxed)
    }

    /// Whether a request asked for a lease since the slot was left idle.
    pub(crate) fn lease_asked_for(&self) -> bool {
        self.idle
            .load()
            .as_ref()
            .is_some_and(|idle| idle.asked.load(Ordering::Acquire))
    }

    /// A request found the slot without a lease: if the slot is idle, asks
    /// its lease manager for one and returns true. Off the fast path (the
    /// request is denied either way), and lock-free (I5).
    #[cold]
    pub(crate) fn ask_for_lease(&self) -> bool {
        self.wanted.store(true, Ordering::Relaxed);
        let idle = self.idle.load();
        let Some(idle) = idle.as_ref() else {
            return false;
        };
        // Set before the ring, so the woken manager finds it. Rung once
        // per spell of idleness: the manager reads the mark at every poll,
        // and one holding off for another instance (I28) would otherwise
        // be woken by every request, and a request waiting for its lease
        // (I36) would ring it again at each wake.
        if !idle.asked.swap(true, Ordering::AcqRel) {
            idle.bell.request_refill();
        }
        true
    }

    /// The account this slot serves.
    #[must_use]
    pub fn account(&self) -> AccountId {
        self.account
    }

    /// The layout the lease manager installs leases in.
    #[must_use]
    pub fn sharding(&self) -> LocalSharding {
        self.sharding
    }

    /// Runs `f` on the serving lease, if any, without taking a reference
    /// count: the request path's read.
    #[inline]
    pub fn with_lease<R>(&self, f: impl FnOnce(Option<&LocalLease>) -> R) -> R {
        let guard = self.lease.load();
        f(guard.as_deref())
    }

    /// Debits `units` from the serving lease through the calling thread's
    /// cached view of its first shard, without the arc-swap guard of
    /// [`with_lease`](Self::with_lease): the request path's first try,
    /// which saves the guard's two locked instructions.
    ///
    /// A view of a lease that left the slot is refused by the retired mark
    /// [`take_counted`](Self::take_counted) and [`replace`](Self::replace)
    /// set, so a debit through it cannot land in a lease the lease manager
    /// found quiescent (I26; see [`ShardView`] for why). Returns
    /// [`ViewMiss::Stale`] when the thread holds no live view for this
    /// slot (then [`recache`](Self::recache) after reading the slot), and
    /// [`ViewMiss::Declined`] when the lease must answer itself (short
    /// home shard, closed window): either way the caller goes through
    /// [`with_lease`](Self::with_lease).
    #[inline]
    pub(crate) fn debit_cached(
        &self,
        units: CostUnits,
        now: Timestamp,
    ) -> Result<LeaseDebit, ViewMiss> {
        let id = self.id;
        VIEWS
            .try_with(|views| {
                // Nothing reached from a debit admits again, so the cache is
                // never borrowed twice; if it were, the slot answers.
                let views = views.try_borrow().map_err(|_| ViewMiss::Declined)?;
                let entry = &views[entry_of(id)];
                match &entry.view {
                    Some(view) if entry.slot == id => view.debit(units, now),
                    _ => Err(ViewMiss::Stale),
                }
            })
            // The thread's cache is gone (a thread-local destructor admits).
            .unwrap_or(Err(ViewMiss::Declined))
    }

    /// Caches, for the calling thread, a view of `serving` (the lease a
    /// request read in the slot after [`debit_cached`](Self::debit_cached)
    /// found no live view), or forgets this slot's view when the slot is
    /// empty, so that a view of a lease out of the slot is tried once per
    /// thread, not at every request: each try takes a strong count the
    /// lease manager may find while testing the lease for quiescence. Off
    /// the fast path; allocates nothing (I5).
    #[cold]
    pub(crate) fn recache(&self, serving: Option<&LocalLease>, locality: Locality) {
        let id = self.id;
        let _ = VIEWS.try_with(|views| {
            let Ok(mut views) = views.try_borrow_mut() else {
                return;
            };
            let entry = &mut views[entry_of(id)];
            let Some(serving) = serving else {
                if entry.slot == id {
                    *entry = CachedView {
                        slot: 0,
                        view: None,
                        conflicts: 0,
                    };
                }
                return;
            };
            if entry.slot == id {
                if entry
                    .view
                    .as_ref()
                    .is_some_and(|view| view.is_of(serving, locality))
                {
                    return;
                }
            } else if entry.view.as_ref().is_some_and(ShardView::is_live) {
                // Another slot's view of a live lease: handed over only
                // after a few misses (see `EVICT_AFTER`).
                entry.conflicts = entry.conflicts.saturating_add(1);
                if entry.conflicts < EVICT_AFTER {
                    return;
                }
            }
            // The only read-modify-writes here: the downgrade, and the
            // drop of the view it replaces.
            *entry = CachedView {
                slot: id,
                view: Some(serving.view_at(locality)),
                conflicts: 0,
            };
        });
    }

    /// The serving lease, as an owned reference: the lease manager's read.
    /// Holding it makes the lease look busy, so drop it before testing
    /// quiescence.
    #[must_use]
    pub fn load_observed(&self) -> Option<Arc<LocalLease>> {
        self.lease.load_full()
    }

    /// Empties the slot and returns what it held. Requests deny until a
    /// lease is installed again.
    pub fn take(&self) -> Option<Arc<LocalLease>> {
        self.take_counted().map(|(lease, _)| lease)
    }

    /// [`take`](Self::take), with the lost debit races it counted as
    /// retired: what [`reinstate`](Self::reinstate) uncounts.
    pub(crate) fn take_counted(&self) -> Option<(Arc<LocalLease>, u64)> {
        let previous = self.lease.swap(None)?;
        let counted = self.retire(Some(&previous));
        Some((previous, counted))
    }

    /// Installs `lease` and returns the one it replaces, which may still be
    /// referenced by requests in flight.
    pub fn replace(&self, lease: Arc<LocalLease>) -> Option<Arc<LocalLease>> {
        debug_assert_eq!(
            lease.grant().account_id,
            self.account,
            "a slot serves one account"
        );
        // Live before it is installed: a view of it (it may be coming
        // back, see `reinstate`) debits again once a request can read it.
        lease.unretire();
        let installed = Arc::as_ptr(&lease);
        let previous = self.lease.swap(Some(lease));
        // A lease put in again in its own place stays live.
        self.retire(
            previous
                .as_deref()
                .filter(|previous| !std::ptr::eq(*previous, installed)),
        );
        self.changes.notify_waiters();
        previous
    }

    /// Puts back a lease [`take_counted`](Self::take_counted) took out,
    /// returning what it replaces. `counted` (the lost debit races its take
    /// counted as retired) is uncounted, so they are not counted twice when
    /// it is retired for good. Installed first and uncounted after, so a
    /// reading between the two counts them twice rather than not at all.
    /// (A reading that straddles a take or a put-back may still miss a
    /// lease's races for a moment: the count is for diagnostics.)
    pub(crate) fn reinstate(
        &self,
        lease: Arc<LocalLease>,
        counted: u64,
    ) -> Option<Arc<LocalLease>> {
        let replaced = self.replace(lease);
        self.retired_contention
            .fetch_sub(counted, Ordering::Relaxed);
        replaced
    }

    /// The account's overage counter on this instance.
    #[must_use]
    pub fn overage(&self) -> &Arc<AccountOverage> {
        &self.overage
    }

    /// Records what the account can fund beyond the serving lease, for
    /// admission to answer on: `Some` when the allocator's last word showed
    /// the account short, counting every unit the instance holds for the
    /// account outside the serving lease (units released since, and those
    /// parked leases hold); `None` when the word showed funds, or when the
    /// instance cannot vouch for it (a lease is out of the slot to be
    /// folded, or the books are in doubt), so a request is answered
    /// transiently (I23). Evidence that misses units the account has makes
    /// admission refuse quotes it can fund as final (402, never retry).
    pub fn publish_funding(&self, evidence: Option<BalanceShortfall>) {
        self.publish(evidence, true);
    }

    /// Records evidence that may still understate the account's funds (a
    /// parked lease with requests on it may yet get units back from them):
    /// readiness and reports read it, and admission decides on it whether a
    /// refusal is worth recording for a fold, but answers no quote as final
    /// on it. (A quote it understates is answered transiently and recorded
    /// once the lease manager shows the parked lease's units again, at its
    /// next inspection.)
    pub fn publish_unsettled_funding(&self, evidence: Option<BalanceShortfall>) {
        self.publish(evidence, false);
    }

    fn publish(&self, evidence: Option<BalanceShortfall>, settled: bool) {
        let serving = self.serving();
        let shown = evidence.map(|shortfall| Shown {
            shortfall,
            settled,
            serving,
        });
        let previous = self.evidence.swap(shown.map(Arc::new));
        // The lease manager shows its evidence at every inspection; only a
        // change can change an answer (I36).
        if previous.as_deref().copied() != shown {
            self.changes.notify_waiters();
        }
    }

    /// The id of the lease the slot serves, if any.
    fn serving(&self) -> Option<LeaseId> {
        self.with_lease(|lease| lease.map(|lease| lease.grant().lease_id))
    }

    /// The evidence as last published, settled or not, whether or not its
    /// period has ended.
    #[must_use]
    pub fn published_funding(&self) -> Option<BalanceShortfall> {
        self.evidence.load().as_deref().map(|shown| shown.shortfall)
    }

    /// Records whether the allocator answered the lease manager's last
    /// grant call: `false` after a storage error or a timeout, `true` after
    /// any answer, a refusal included.
    pub fn publish_allocator_reachable(&self, reachable: bool) {
        let was_unreachable = self
            .allocator_unreachable
            .swap(!reachable, Ordering::Relaxed);
        if was_unreachable == reachable {
            self.changes.notify_waiters();
        }
    }

    /// Whether the lease manager's last grant call went unanswered, so a
    /// drained lease cannot be restocked now: the instance cannot vouch for
    /// the account's funds, and fails closed (I5) rather than calling it a
    /// momentary shortage.
    #[must_use]
    pub fn allocator_unreachable(&self) -> bool {
        self.allocator_unreachable.load(Ordering::Relaxed)
    }

    /// The settled evidence in force at `now`, published beside the lease
    /// the slot serves now: what admission answers on. Evidence whose period
    /// has ended says nothing any more: the refill has happened.
    #[must_use]
    pub fn funding_evidence(&self, now: Timestamp) -> Option<BalanceShortfall> {
        self.funding_evidence_beside(self.serving(), now)
    }

    /// [`funding_evidence`](Self::funding_evidence) for a request that read
    /// `serving` in the slot: `None` unless the evidence was published
    /// beside that same lease. The request reads the lease and the evidence
    /// at two moments; in between, the lease manager may install a lease
    /// (or take one out) and publish evidence that counts everything but
    /// the new lease's units, which that request never saw (I23).
    #[must_use]
    pub(crate) fn funding_evidence_beside(
        &self,
        serving: Option<LeaseId>,
        now: Timestamp,
    ) -> Option<BalanceShortfall> {
        self.funding_beside(serving, now)
            .filter(|&(_, settled)| settled)
            .map(|(evidence, _)| evidence)
    }

    /// The evidence in force at `now` published beside `serving`, the lease
    /// a request read in the slot, and whether it is settled, from one
    /// reading: settled or not, it decides whether a refusal is worth
    /// recording for a fold, as the lease manager decides whether to keep
    /// one; settled, it may answer the refusal finally.
    #[must_use]
    pub(crate) fn funding_beside(
        &self,
        serving: Option<LeaseId>,
        now: Timestamp,
    ) -> Option<(BalanceShortfall, bool)> {
        let shown = *self.evidence.load().as_deref()?;
        if shown.serving != serving {
            return None;
        }
        Some((shown.shortfall.in_force(now)?, shown.settled))
    }

    /// The evidence in force at `now`, settled or not: what readiness and
    /// reports read.
    #[must_use]
    pub fn funding_estimate(&self, now: Timestamp) -> Option<BalanceShortfall> {
        self.published_funding()?.in_force(now)
    }

    /// Debit attempts that lost a compare-exchange to another thread, over
    /// every lease this slot has served.
    #[must_use]
    pub fn contended_exchanges(&self) -> u64 {
        let serving = self.with_lease(|lease| lease.map_or(0, LocalLease::contended_debits));
        self.retired_contention
            .load(Ordering::Relaxed)
            .saturating_add(serving)
    }

    /// Retires `lease`, just taken out of the slot: marks it so that views
    /// of it cached by request threads debit it no more (I26), before the
    /// lease manager can test it for quiescence; and counts its lost debit
    /// races as retired, returning how many.
    fn retire(&self, lease: Option<&LocalLease>) -> u64 {
        let Some(lease) = lease else {
            return 0;
        };
        lease.retire();
        let counted = lease.contended_debits();
        self.retired_contention
            .fetch_add(counted, Ordering::Relaxed);
        counted
    }
}

impl fmt::Debug for LeaseSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseSlot")
            .field("account", &self.account)
            .field(
                "lease",
                &self.load_observed().map(|lease| lease.grant().lease_id),
            )
            .field("overage_spent", &self.overage.spent())
            .field("sharding", &self.sharding)
            .field("idle", &self.is_idle())
            .finish_non_exhaustive()
    }
}

/// Every account's slot on this instance, with a change signal so the
/// runtime can start and retire lease managers as accounts come and go.
pub struct SlotRegistry {
    slots: ArcSwap<HashMap<AccountId, Arc<LeaseSlot>, FxBuildHasher>>,
    sharding: LocalSharding,
    changes: watch::Sender<u64>,
}

impl SlotRegistry {
    /// An empty registry whose slots use `sharding`.
    #[must_use]
    pub fn new(sharding: LocalSharding) -> Self {
        Self {
            slots: ArcSwap::from_pointee(HashMap::default()),
            sharding,
            changes: watch::Sender::new(0),
        }
    }

    /// Wakes every request waiting for a lease (I36) to try admission
    /// again: the instance has stopped admitting, and a waiting request is
    /// answered now rather than at the end of its wait.
    pub(crate) fn wake_lease_waits(&self) {
        for slot in self.slots.load().values() {
            slot.changes.notify_waiters();
        }
    }

    /// The slot of `account`, if it has one.
    #[must_use]
    pub fn get(&self, account: AccountId) -> Option<Arc<LeaseSlot>> {
        self.slots.load().get(&account).cloned()
    }

    /// The slot of `account`, created empty if it has none.
    ///
    /// # Panics
    ///
    /// Never: the update closure runs at least once and always leaves the
    /// account's slot in the map.
    pub fn ensure(&self, account: AccountId) -> Arc<LeaseSlot> {
        if let Some(slot) = self.get(account) {
            return slot;
        }
        let mut created = None;
        let mut added = false;
        self.slots.rcu(|slots| {
            let mut slots = HashMap::clone(slots);
            // The update may run again after losing a race; what counts is
            // its last run, the one stored.
            added = !slots.contains_key(&account);
            let slot = slots
                .entry(account)
                .or_insert_with(|| Arc::new(LeaseSlot::new(account, self.sharding)));
            created = Some(Arc::clone(slot));
            slots
        });
        // Another caller may have added it first: subscribers hear only of
        // slots added.
        if added {
            self.changes.send_modify(|version| *version += 1);
        }
        created.expect("rcu runs its update at least once")
    }

    /// The slots of `accounts`, in order, creating the missing ones in one
    /// update: a first publication of many accounts copies the registry
    /// once, not once per account.
    pub fn ensure_many(&self, accounts: &[AccountId]) -> Vec<Arc<LeaseSlot>> {
        let current = self.slots.load();
        if let Some(found) = accounts
            .iter()
            .map(|account| current.get(account).cloned())
            .collect::<Option<Vec<_>>>()
        {
            return found;
        }
        drop(current);
        let mut ensured: HashMap<AccountId, Arc<LeaseSlot>, FxBuildHasher> = HashMap::default();
        let mut added = false;
        self.slots.rcu(|slots| {
            let mut slots = HashMap::clone(slots);
            ensured.clear();
            added = false;
            for &account in accounts {
                added |= !slots.contains_key(&account);
                let slot = slots
                    .entry(account)
                    .or_insert_with(|| Arc::new(LeaseSlot::new(account, self.sharding)));
                ensured.insert(account, Arc::clone(slot));
            }
            slots
        });
        if added {
            self.changes.send_modify(|version| *version += 1);
        }
        accounts
            .iter()
            .filter_map(|account| ensured.get(account).cloned())
            .collect()
    }

    /// Drops the slots of accounts `keep` rejects, returning them so the
    /// caller can release their leases.
    pub fn retain(&self, mut keep: impl FnMut(AccountId) -> bool) -> Vec<Arc<LeaseSlot>> {
        let mut removed = Vec::new();
        self.slots.rcu(|slots| {
            removed.clear();
            let mut kept = HashMap::with_capacity_and_hasher(slots.len(), FxBuildHasher);
            for (account, slot) in slots.iter() {
                if keep(*account) {
                    kept.insert(*account, Arc::clone(slot));
                } else {
                    removed.push(Arc::clone(slot));
                }
            }
            kept
        });
        if !removed.is_empty() {
            self.changes.send_modify(|version| *version += 1);
        }
        removed
    }

    /// The accounts that have slots.
    #[must_use]
    pub fn accounts(&self) -> Vec<AccountId> {
        let mut accounts: Vec<_> = self.slots.load().keys().copied().collect();
        accounts.sort_unstable();
        accounts
    }

    /// A receiver that changes whenever a slot is added or removed.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

impl fmt::Debug for SlotRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotRegistry")
            .field("accounts", &self.accounts())
            .field("sharding", &self.sharding)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CostUnits, FencingToken, LeaseGrant, LeaseId, Reservation};

    const ACCOUNT: AccountId = AccountId(4);

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).expect("test instants are in range")
    }

    fn lease(id: u64) -> Arc<LocalLease> {
        Arc::new(LocalLease::new(
            LeaseGrant {
                lease_id: LeaseId(id),
                account_id: ACCOUNT,
                fencing_token: FencingToken(id),
                units: CostUnits(1 << 40),
                expires_at: at(1_000),
            },
            CostUnits::ZERO,
        ))
    }

    /// Counts the rings it gets.
    #[derive(Default)]
    struct Bell(AtomicU64);

    impl RefillSignal for Bell {
        fn request_refill(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// I28, I36: requests finding an idle slot all ask for a lease, and
    /// the lease manager is rung once per spell of idleness: it reads the
    /// mark at every poll, and requests waiting for their lease ask again
    /// at every wake.
    #[test]
    fn an_idle_slot_rings_its_manager_once_however_often_it_is_asked() {
        let slot = LeaseSlot::new(ACCOUNT, LocalSharding::Single);
        let bell = Arc::new(Bell::default());
        assert!(!slot.ask_for_lease(), "not idle: nothing to ask");
        slot.idle_until_asked(Arc::clone(&bell) as Arc<dyn RefillSignal>);
        for _ in 0..5 {
            assert!(slot.ask_for_lease());
        }
        assert!(slot.lease_asked_for());
        assert_eq!(bell.0.load(Ordering::Relaxed), 1);
        // A new spell rings again.
        slot.end_idle();
        slot.idle_until_asked(Arc::clone(&bell) as Arc<dyn RefillSignal>);
        assert!(slot.ask_for_lease());
        assert_eq!(bell.0.load(Ordering::Relaxed), 2);
    }

    /// I36: requests waiting for a lease are woken by what can change their
    /// answer (a lease installed, different evidence, the store's
    /// reachability changing) and not by the same evidence shown again,
    /// which the lease manager does at every inspection.
    #[test]
    fn waiting_requests_are_woken_only_by_changes() {
        let slot = LeaseSlot::new(ACCOUNT, LocalSharding::Single);
        let woken = |change: &dyn Fn()| {
            let notified = Arc::clone(slot.changes()).notified_owned();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            change();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            notified.as_mut().poll(&mut cx).is_ready()
        };
        let short = BalanceShortfall {
            remaining: CostUnits(3),
            period_end: None,
        };
        assert!(woken(&|| slot.publish_funding(Some(short))));
        assert!(!woken(&|| slot.publish_funding(Some(short))), "shown again");
        assert!(woken(&|| slot.publish_unsettled_funding(Some(short))));
        assert!(woken(&|| slot.publish_funding(None)));
        assert!(!woken(&|| slot.publish_allocator_reachable(true)), "as was");
        assert!(woken(&|| slot.publish_allocator_reachable(false)));
        assert!(!woken(&|| slot.publish_allocator_reachable(false)));
        assert!(woken(&|| {
            slot.replace(lease(1));
        }));
    }

    /// Many accounts are ensured in one registry update, in the order
    /// asked, reusing the slots that exist; with all present, none.
    #[test]
    fn ensuring_many_accounts_creates_the_missing_in_one_update() {
        let registry = SlotRegistry::new(LocalSharding::Single);
        let existing = registry.ensure(AccountId(2));
        let changes = registry.subscribe();
        let before = *changes.borrow();
        let asked = [AccountId(1), AccountId(2), AccountId(3), AccountId(1)];
        let slots = registry.ensure_many(&asked);
        assert_eq!(
            slots.iter().map(|slot| slot.account()).collect::<Vec<_>>(),
            asked
        );
        assert!(
            Arc::ptr_eq(&slots[1], &existing),
            "an existing slot is kept"
        );
        assert!(Arc::ptr_eq(&slots[0], &slots[3]), "one slot per account");
        assert_eq!(*changes.borrow() - before, 1, "one update for all");
        assert_eq!(
            registry.accounts(),
            [AccountId(1), AccountId(2), AccountId(3)]
        );
        let again = registry.ensure_many(&[AccountId(3)]);
        assert!(Arc::ptr_eq(&again[0], &slots[2]));
        assert_eq!(*changes.borrow() - before, 1, "nothing new, no update");
    }

    /// Races four threads debiting and releasing the slot's lease until at
    /// least one debit has lost a race; returns how many have.
    fn race_until_contended(slot: &LeaseSlot) -> u64 {
        for _ in 0..200 {
            std::thread::scope(|scope| {
                for _ in 0..4 {
                    scope.spawn(|| {
                        for _ in 0..5_000 {
                            slot.with_lease(|lease| {
                                let lease = lease.expect("a lease is installed");
                                drop(Reservation::reserve(lease, CostUnits(1), at(0)).unwrap());
                            });
                        }
                    });
                }
            });
            let lost = slot.with_lease(|lease| lease.map_or(0, LocalLease::contended_debits));
            if lost > 0 {
                return lost;
            }
        }
        panic!("four racing threads never lost a debit race");
    }

    /// The slot's count of lost debit races covers the serving lease and
    /// every lease it served before, so replacing or taking a lease does not
    /// hide contention.
    #[test]
    fn contention_is_counted_across_the_leases_a_slot_has_served() {
        let slot = LeaseSlot::new(ACCOUNT, LocalSharding::Single);
        assert_eq!(slot.contended_exchanges(), 0);
        slot.replace(lease(1));
        let first = race_until_contended(&slot);
        assert_eq!(slot.contended_exchanges(), first);

        let replaced = slot.replace(lease(2)).expect("the first lease was serving");
        assert_eq!(replaced.contended_debits(), first);
        assert_eq!(slot.contended_exchanges(), first, "kept past the replace");
        let second = race_until_contended(&slot);
        assert_eq!(slot.contended_exchanges(), first + second);

        let (taken, counted) = slot.take_counted().expect("the second lease was serving");
        assert_eq!(
            slot.contended_exchanges(),
            first + second,
            "kept past the take"
        );
        assert!(slot.with_lease(|lease| lease.is_none()));

        // Taken out to be folded, and put back when the fold is refused:
        // still counted once, and once more after it is retired for good.
        assert_eq!(counted, second);
        assert!(slot.reinstate(taken, counted).is_none());
        assert_eq!(slot.contended_exchanges(), first + second);
        slot.take().expect("reinstated");
        assert_eq!(slot.contended_exchanges(), first + second);
    }

    /// Subscribers hear of every slot added or removed, and of nothing
    /// else: asking for an existing slot changes nothing.
    #[test]
    fn the_registry_announces_slots_added_and_removed() {
        let registry = SlotRegistry::new(LocalSharding::Single);
        let mut changes = registry.subscribe();
        let first = registry.ensure(ACCOUNT);
        assert!(changes.has_changed().unwrap(), "a new slot is announced");
        changes.borrow_and_update();
        assert!(Arc::ptr_eq(&first, &registry.ensure(ACCOUNT)));
        assert!(!changes.has_changed().unwrap(), "an existing slot is not");

        let other = AccountId(9);
        registry.ensure(other);
        assert!(changes.has_changed().unwrap());
        changes.borrow_and_update();
        assert_eq!(registry.accounts(), vec![ACCOUNT, other]);

        let removed = registry.retain(|account| account == ACCOUNT);
        assert_eq!(removed.len(), 1);
        assert_eq!(removed[0].account(), other);
        assert!(changes.has_changed().unwrap(), "a removal is announced");
        changes.borrow_and_update();
        assert!(registry.retain(|_| true).is_empty());
        assert!(!changes.has_changed().unwrap(), "keeping everything is not");
        assert_eq!(registry.accounts(), vec![ACCOUNT]);
    }

    /// Callers racing to add the same slot all get it, and it is announced
    /// once: a caller whose update found it added says nothing.
    #[test]
    fn racing_callers_add_and_announce_a_slot_once() {
        for _ in 0..500 {
            let registry = SlotRegistry::new(LocalSharding::Single);
            let start = std::sync::Barrier::new(4);
            let slots: Vec<Arc<LeaseSlot>> = std::thread::scope(|scope| {
                let callers: Vec<_> = (0..4)
                    .map(|caller| {
                        let (registry, start) = (&registry, &start);
                        scope.spawn(move || {
                            start.wait();
                            if caller % 2 == 0 {
                                registry.ensure(ACCOUNT)
                            } else {
                                registry.ensure_many(&[ACCOUNT]).remove(0)
                            }
                        })
                    })
                    .collect();
                callers.into_iter().map(|c| c.join().unwrap()).collect()
            });
            assert!(slots.iter().all(|slot| Arc::ptr_eq(slot, &slots[0])));
            assert_eq!(*registry.subscribe().borrow(), 1, "announced once");
        }
    }

    /// The lease manager's quiescence test (`is_quiescent` in
    /// `runtime/lease_manager.rs`), for a lease the caller took out.
    fn quiescent(lease: &Arc<LocalLease>) -> bool {
        Arc::strong_count(lease) == 1 && lease.is_only_local_view()
    }

    /// What a request does: the cached view first, and on a stale one the
    /// slot, caching what it serves. Returns the lease debited, if any.
    fn debit_one(slot: &LeaseSlot) -> Option<LeaseId> {
        let here = Locality::new(0);
        match slot.debit_cached(CostUnits(1), at(0)) {
            Ok(debit) => return Some(debit.grant().lease_id),
            Err(ViewMiss::Stale) => {}
            Err(ViewMiss::Declined) => panic!("the test leases are large and open"),
        }
        slot.with_lease(|serving| {
            slot.recache(serving, here);
            serving.map(|lease| {
                lease
                    .try_reserve_at(CostUnits(1), at(0), here)
                    .unwrap()
                    .grant()
                    .lease_id
            })
        })
    }

    /// Whether the calling thread holds a view for `slot`.
    fn cached(slot: &LeaseSlot) -> bool {
        VIEWS.with(|views| views.borrow()[entry_of(slot.id)].slot == slot.id)
    }

    /// I26: a thread's cached view debits the lease its slot serves, and
    /// never one taken out of it: taken out to be folded, replaced, or
    /// with the slot emptied, the lease refuses the view, is quiescent
    /// once its debits are dropped, and keeps its count; put back, it
    /// debits through the view again.
    #[test]
    fn a_cached_view_debits_the_serving_lease_and_never_one_taken_out() {
        let slot = LeaseSlot::new(ACCOUNT, LocalSharding::Single);
        assert_eq!(
            slot.debit_cached(CostUnits(1), at(0)).unwrap_err(),
            ViewMiss::Stale,
            "nothing cached yet"
        );
        slot.replace(lease(1));
        assert_eq!(debit_one(&slot), Some(LeaseId(1)), "through the slot");
        assert!(cached(&slot));
        let debit = slot.debit_cached(CostUnits(1), at(0)).expect("cached");
        assert_eq!(debit.grant().lease_id, LeaseId(1));
        drop(debit);

        let (taken, counted) = slot.take_counted().expect("serving");
        let held = taken.remaining();
        assert_eq!(
            slot.debit_cached(CostUnits(1), at(0)).unwrap_err(),
            ViewMiss::Stale
        );
        assert!(quiescent(&taken), "a cached view keeps no lease busy");
        assert_eq!(taken.remaining(), held);
        assert!(slot.reinstate(taken, counted).is_none());
        slot.debit_cached(CostUnits(1), at(0))
            .expect("put back, live again");

        let old = slot.replace(lease(2)).expect("the first lease");
        assert_eq!(
            slot.debit_cached(CostUnits(1), at(0)).unwrap_err(),
            ViewMiss::Stale
        );
        assert_eq!(debit_one(&slot), Some(LeaseId(2)), "recached");
        assert_eq!(
            slot.debit_cached(CostUnits(1), at(0))
                .unwrap()
                .grant()
                .lease_id,
            LeaseId(2)
        );
        assert!(quiescent(&old));
        let old_held = old.remaining();

        let last = slot.take().expect("the second lease");
        assert_eq!(debit_one(&slot), None, "the slot is empty");
        assert!(
            !cached(&slot),
            "the view of a lease out of the slot is dropped"
        );
        assert!(quiescent(&last) && quiescent(&old));
        assert_eq!(old.remaining(), old_held, "no view debited it");
    }

    /// Put in again in its own place, a lease stays live: views of it go on
    /// debiting it, and its races are not counted as retired.
    #[test]
    fn a_lease_installed_over_itself_stays_live() {
        let slot = LeaseSlot::new(ACCOUNT, LocalSharding::Single);
        let serving = lease(1);
        slot.replace(Arc::clone(&serving));
        debit_one(&slot);
        let replaced = slot.replace(Arc::clone(&serving)).expect("itself");
        assert!(Arc::ptr_eq(&replaced, &serving));
        slot.debit_cached(CostUnits(1), at(0))
            .expect("still the slot's lease");
    }

    /// Slots whose ids share a cache entry both admit; a view of a live
    /// lease is handed over only after a few misses, a dead one at once.
    #[test]
    fn slots_sharing_a_cache_entry_take_it_over_sparingly() {
        let first = LeaseSlot::new(ACCOUNT, LocalSharding::Single);
        // Other tests create slots meanwhile, so look for a sharer.
        let second = std::iter::repeat_with(|| LeaseSlot::new(ACCOUNT, LocalSharding::Single))
            .take(VIEW_CACHE * 64)
            .find(|slot| entry_of(slot.id) == entry_of(first.id))
            .expect("ids are handed out in order");
        first.replace(lease(1));
        second.replace(lease(2));
        assert_eq!(debit_one(&first), Some(LeaseId(1)));
        assert!(cached(&first));
        for _ in 1..EVICT_AFTER {
            assert_eq!(debit_one(&second), Some(LeaseId(2)));
            assert!(cached(&first), "kept");
        }
        assert_eq!(debit_one(&second), Some(LeaseId(2)));
        assert!(cached(&second), "handed over");
        assert_eq!(debit_one(&first), Some(LeaseId(1)));
        assert!(cached(&second), "the count starts again");
        // The second slot's lease goes away: its view is dead, and handed
        // over at the next miss.
        drop(second.take());
        assert_eq!(debit_one(&first), Some(LeaseId(1)));
        assert!(cached(&first));
    }
}
