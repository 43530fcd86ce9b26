//! A lease's units on this instance: the counter the request path debits.

use std::fmt;
use std::sync::{Arc, Weak};

use jiff::{SignedDuration, Timestamp};

use crate::model::sharding::{CachePadded, split_evenly};
use crate::model::{
    AccountId, AccountOverage, CostUnits, DenyReason, FencingToken, LeaseId, LocalSharding,
    Locality, ShardOccupancy,
};
use crate::sync::{AtomicBool, AtomicU64, Ordering};

/// Units the allocator moved from an account's balance to this instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseGrant {
    /// The lease's identity in the store.
    pub lease_id: LeaseId,
    /// The account whose balance funded it.
    pub account_id: AccountId,
    /// The capability every release, consolidation and usage event naming
    /// this lease must present.
    pub fencing_token: FencingToken,
    /// How many units were granted.
    pub units: CostUnits,
    /// When the allocator stops honouring the lease. After this plus its
    /// reclaim grace the allocator may return the remainder to the balance.
    pub expires_at: Timestamp,
}

/// The doorbell a lease rings when it needs the refill task's attention.
///
/// Implementations run on the request path, inside a debit: they must not
/// block, lock, allocate or do I/O (I5). Waking a task through an
/// `AtomicWaker` is the intended shape.
pub trait RefillSignal: Send + Sync {
    /// Ask for the lease to be replaced or consolidated.
    fn request_refill(&self);
}

/// What the refill task should do about a lease, from
/// [`LocalLease::refill_due_or_rearm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefillVerdict {
    /// Nothing to do; any premature doorbell has been re-armed.
    Idle,
    /// The lease is at or below its low-water mark, or one of its shards
    /// is below its share of the mark (I7): acquire a replacement while it
    /// keeps serving.
    Draining,
    /// The lease refused a debit. Fold its unspent units and the largest
    /// refused quote into one new grant, so a quote the account can fund is
    /// not refused for want of a bigger lease. Unless the lease is also
    /// draining, its doorbells have been re-armed as for `Idle`.
    Refused,
}

/// The instance-local view of one [`LeaseGrant`]: its remaining units as
/// atomics, optionally split across shards.
///
/// # Invariants
///
/// - Units only move between the shards and the debits taken from them, so
///   once the lease is quiescent `remaining() == granted − committed` exactly
///   (I6).
/// - No debit succeeds at or after [`usable_until`](Self::usable_until)
///   (I2).
/// - The low-water doorbell rings at most once per shard between two calls
///   of [`refill_due_or_rearm`](Self::refill_due_or_rearm); a refusal rings
///   it when the refusal record goes from empty to set, and a forget that
///   finds a larger quote recorded rings it again (I7).
///
/// A lease is *quiescent* when the caller holds the only `Arc` to it and
/// [`is_only_local_view`](Self::is_only_local_view) is true: then no request
/// can debit or credit it, and its remaining count is final.
pub struct LocalLease {
    terms: LeaseTerms,
    low_water: CostUnits,
    shards: Box<[Arc<CachePadded<Shard>>]>,
    refused: CachePadded<AtomicU64>,
    /// The largest quote refused for want of units that admission did not
    /// record in `refused`, because the allocator's last word on the
    /// account ruled it out (see [`note_ruled_out`](Self::note_ruled_out)).
    /// Rings nothing: it asks the refill task to check that word again at
    /// its next poll, not at once.
    ruled_out: AtomicU64,
    /// Whether the lease ever refused a quote for want of units, recorded
    /// or not; never cleared (see [`has_refused`](Self::has_refused)).
    refused_any: AtomicBool,
    /// Moves of units between shards (a spread, a gather): the moves
    /// started, in the high half, and those under way, in the low half. A
    /// reading of every shard that this word did not see change found no
    /// units between two of them (see `settled_remaining`).
    transit: CachePadded<AtomicU64>,
    refill: Option<Arc<dyn RefillSignal>>,
}

/// The top bit of every shard's `remaining` word: set while the lease is
/// out of its slot ([`LocalLease::retire`]), so a debit through a cached
/// [`ShardView`] refuses it (I26). Units never reach it: no store grants
/// more than `i64::MAX` (see [`LocalLease::with_sharding`]), and units only
/// move between a lease's shards and its debits. Every reader of a count
/// masks it off; debits through the slot's guard, credits, spreads and
/// gathers leave it as they found it.
const RETIRED: u64 = 1 << 63;

/// One move started: added to [`LocalLease::transit`] as a move begins.
const MOVE_STARTED: u64 = (1 << 32) + 1;

/// The moves under way, in [`LocalLease::transit`].
const MOVES_UNDER_WAY: u64 = (1 << 32) - 1;

/// Marks units of a lease as between its shards until dropped.
struct Moving<'a>(&'a AtomicU64);

impl<'a> Moving<'a> {
    fn start(transit: &'a AtomicU64) -> Self {
        // A reader that sees what the move takes from a shard sees this
        // first (the take is a release after it).
        transit.fetch_add(MOVE_STARTED, Ordering::AcqRel);
        Self(transit)
    }
}

impl Drop for Moving<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A successful debit: which shard's counter gave the units, and how many.
///
/// Holding one keeps a view of that shard alive, which is what makes the lease
/// non-quiescent while any reservation on it exists. Crediting it returns the
/// units to the same shard; dropping it without a credit leaves them spent.
pub struct LeaseDebit {
    /// The shard knows its own index, so a debit is two words: it is moved
    /// with every reservation on the request path.
    shard: Arc<CachePadded<Shard>>,
    units: CostUnits,
}

/// What keeps a lease from being quiescent after a charge against it
/// committed: the view of the shard that funded it. Dropping it lets the
/// lease quiesce (I26).
pub(crate) struct LeaseHold {
    _view: Arc<CachePadded<Shard>>,
}

/// The grant and its local usability window, copied into every shard so a
/// debit can answer for its lease without touching the lease's shared lines.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaseTerms {
    pub(crate) grant: LeaseGrant,
    pub(crate) usable_until: Timestamp,
}

/// How many times a quote spread over several shards is gathered before it
/// is refused, while the lease as a whole still holds it.
const GATHER_ATTEMPTS: usize = 2;

struct Shard {
    remaining: AtomicU64,
    /// This shard's place in its lease.
    index: usize,
    /// This shard's part of the lease's low-water mark; the parts add up to
    /// the whole mark, so when the lease is at or below it some shard is too.
    low_water: u64,
    rung: AtomicBool,
    contended: AtomicU64,
    terms: LeaseTerms,
    /// The account's overage counter, for an Elastic charge whose window
    /// lapses before it commits; see [`LocalLease::with_overage`].
    overage: Option<Arc<AccountOverage>>,
    /// The lease's doorbell (see [`LocalLease::with_refill`]), so a debit
    /// through a [`ShardView`] rings without the lease (I7).
    refill: Option<Arc<dyn RefillSignal>>,
}

impl fmt::Debug for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shard")
            .field("remaining", &self.remaining)
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

/// A weak view of one shard of a lease, kept in a per-thread cache so a
/// request reaches the lease its slot serves without the slot's arc-swap
/// guard (admission's fast path).
///
/// Holding one keeps neither the lease nor its units alive (only the
/// shard's allocation), and does not count as a view of the shard for
/// quiescence; a debit through it does, like any debit (I26).
///
/// # Why a cached debit cannot slip past a quiescence check (I26)
///
/// The debit first upgrades the view, taking a strong count on the shard
/// (the count [`LeaseDebit`] then keeps, so it costs no extra
/// read-modify-write), and then takes its units with a compare-exchange on
/// the shard's `remaining` word that refuses the word while [`RETIRED`] is
/// set. The lease manager sets that bit with a read-modify-write of the
/// same word as the lease leaves its slot, before it tests quiescence. The
/// two read-modify-writes are ordered in the word's modification order:
///
/// - the debit first: the retire reads its value (or a later one in its
///   release sequence, which every read-modify-write continues) and
///   acquires it, so the manager's later reading of the shard's strong
///   count sees the upgrade, and the lease is not quiescent while the
///   debit holds its view;
/// - the retire first: the debit's exchange sees the bit and the debit
///   backs out, taking nothing.
///
/// Either way no debit lands in a lease found quiescent. Debits through
/// the slot's guard ignore the bit: they are counted as today, through the
/// lease's own reference count.
#[derive(Clone)]
pub(crate) struct ShardView(Weak<CachePadded<Shard>>);

/// Why a debit through a [`ShardView`] did not take units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ViewMiss {
    /// No view, or one of a lease that is gone or out of its slot: the
    /// caller goes through the slot, and caches a view of what it serves.
    Stale,
    /// The view is current, but the shard is short or the window closed:
    /// the caller goes through the slot, which answers as before.
    Declined,
}

impl ShardView {
    /// Debits `units` from the viewed shard, unless its lease is gone or
    /// retired ([`ViewMiss::Stale`]), or its window closed or the shard is
    /// short ([`ViewMiss::Declined`]). Rings at low water as
    /// [`LocalLease::try_reserve_at`] does (I7).
    #[allow(clippy::inline_always, reason = "the request path's debit")]
    #[inline(always)]
    pub(crate) fn debit(&self, units: CostUnits, now: Timestamp) -> Result<LeaseDebit, ViewMiss> {
        let shard = self.0.upgrade().ok_or(ViewMiss::Stale)?;
        if now >= shard.terms.usable_until {
            return Err(ViewMiss::Declined);
        }
        let left = shard.take_live(units.get())?;
        if !units.is_zero() {
            shard.ring_if_low(left);
        }
        Ok(LeaseDebit { shard, units })
    }

    /// Whether the viewed shard still belongs to a live lease (a plain
    /// load: a cache decides on it whether to keep the view).
    pub(crate) fn is_live(&self) -> bool {
        self.0.strong_count() > 0
    }

    /// Whether this is the view [`LocalLease::view_at`] would give for
    /// `lease` and `locality`, without taking one.
    pub(crate) fn is_of(&self, lease: &LocalLease, locality: Locality) -> bool {
        let home = &lease.shards[locality.shard_of(lease.shards.len())];
        std::ptr::eq(self.0.as_ptr(), Arc::as_ptr(home))
    }
}

impl LocalLease {
    /// A single-counter lease usable until the grant expires.
    #[must_use]
    pub fn new(grant: LeaseGrant, low_water: CostUnits) -> Self {
        Self::with_safety_margin(grant, low_water, SignedDuration::ZERO)
    }

    /// A single-counter lease that stops accepting debits and commits
    /// `margin` before the grant expires.
    ///
    /// # Panics
    ///
    /// When `margin` is negative: that would extend spending past the point
    /// where the allocator may reclaim the units.
    #[must_use]
    pub fn with_safety_margin(
        grant: LeaseGrant,
        low_water: CostUnits,
        margin: SignedDuration,
    ) -> Self {
        Self::with_sharding(grant, low_water, margin, LocalSharding::Single)
    }

    /// A lease whose units and low-water mark are split evenly across the
    /// shards of `sharding`.
    ///
    /// # Panics
    ///
    /// When `margin` is negative (see [`with_safety_margin`](Self::with_safety_margin)),
    /// or the grant is above `i64::MAX` units, which no store grants: the
    /// top bit of a shard's count marks a lease out of its slot (I26).
    #[must_use]
    pub fn with_sharding(
        grant: LeaseGrant,
        low_water: CostUnits,
        margin: SignedDuration,
        sharding: LocalSharding,
    ) -> Self {
        assert!(
            !margin.is_negative(),
            "a lease's safety margin must not be negative"
        );
        assert!(
            grant.units.get() & RETIRED == 0,
            "a lease holds at most i64::MAX units"
        );
        // I2: the window closes `margin` early, so a charge committed inside
        // it is still inside the allocator's view of the lease.
        let usable_until = grant
            .expires_at
            .checked_sub(margin)
            .unwrap_or(Timestamp::MIN);
        let terms = LeaseTerms {
            grant,
            usable_until,
        };
        let count = sharding.count();
        let shards = (0..count)
            .map(|index| {
                Arc::new(CachePadded(Shard {
                    remaining: AtomicU64::new(split_evenly(grant.units.get(), count, index)),
                    index,
                    low_water: split_evenly(low_water.get(), count, index),
                    rung: AtomicBool::new(false),
                    contended: AtomicU64::new(0),
                    terms,
                    overage: None,
                    refill: None,
                }))
            })
            .collect();
        Self {
            terms,
            low_water,
            shards,
            refused: CachePadded(AtomicU64::new(0)),
            ruled_out: AtomicU64::new(0),
            refused_any: AtomicBool::new(false),
            transit: CachePadded(AtomicU64::new(0)),
            refill: None,
        }
    }

    /// Installs the doorbell rung at low water and on the first refusal.
    /// Each shard keeps a copy, so a debit through a per-thread cached
    /// view of the shard rings without the lease (I7).
    ///
    /// # Panics
    ///
    /// When the lease has already funded a debit (as
    /// [`with_overage`](Self::with_overage)).
    #[must_use]
    pub fn with_refill(mut self, signal: Arc<dyn RefillSignal>) -> Self {
        for shard in &mut self.shards[..] {
            Arc::get_mut(shard)
                .expect("a lease gets its doorbell before it funds a debit")
                .0
                .refill = Some(Arc::clone(&signal));
        }
        self.refill = Some(signal);
        self
    }

    /// Attaches the account's overage counter, which an Elastic charge on
    /// this lease falls back to if the lease's window closes before the
    /// charge commits. Admission then reaches the counter through the
    /// charge itself, rather than taking a reference count on the counter,
    /// which every request of the account shares, for every request.
    ///
    /// # Panics
    ///
    /// When `overage` is another account's counter, or the lease has
    /// already funded a debit.
    #[must_use]
    pub fn with_overage(mut self, overage: &Arc<AccountOverage>) -> Self {
        assert_eq!(
            overage.account_id(),
            self.terms.grant.account_id,
            "a lease falls back to its own account's overage"
        );
        for shard in &mut self.shards[..] {
            Arc::get_mut(shard)
                .expect("a lease gets its overage counter before it funds a debit")
                .0
                .overage = Some(Arc::clone(overage));
        }
        self
    }

    /// The grant this lease spends.
    #[must_use]
    pub fn grant(&self) -> &LeaseGrant {
        &self.terms.grant
    }

    /// The low-water mark below which the lease asks to be replaced.
    #[must_use]
    pub fn low_water(&self) -> CostUnits {
        self.low_water
    }

    /// The last instant (exclusive) at which the lease accepts debits and
    /// commits: `expires_at − margin`.
    #[must_use]
    pub fn usable_until(&self) -> Timestamp {
        self.terms.usable_until
    }

    /// Debits `units` at the calling thread's locality.
    ///
    /// # Errors
    ///
    /// [`DenyReason::LeaseExpired`] at or after
    /// [`usable_until`](Self::usable_until), and
    /// [`DenyReason::LeaseExhausted`] when the lease cannot fund `units`.
    #[inline]
    pub fn try_debit(&self, units: CostUnits, now: Timestamp) -> Result<LeaseDebit, DenyReason> {
        self.try_reserve_at(units, now, Locality::current())
    }

    /// Debits `units`, preferring the shard of `locality`.
    ///
    /// The home shard is tried first; if it is short, the other shards are
    /// tried in turn, and then the quote is gathered from all of them, so a
    /// quote the whole lease can fund is not refused because its units sit
    /// in other shards. Under contention that holds only in the end: two
    /// gathers racing each other may each hold part of what the other needs
    /// and both be refused, as a momentary shortage the refill task then
    /// folds away. A refusal is recorded for
    /// [`largest_refused_quote`](Self::largest_refused_quote).
    ///
    /// # Errors
    ///
    /// As for [`try_debit`](Self::try_debit).
    #[allow(
        clippy::inline_always,
        reason = "inlining the debit into the caller's admission halves reserve+commit in benches/model.rs"
    )]
    #[inline(always)]
    pub fn try_reserve_at(
        &self,
        units: CostUnits,
        now: Timestamp,
        locality: Locality,
    ) -> Result<LeaseDebit, DenyReason> {
        self.try_reserve_unrecorded(units, now, locality)
            .inspect_err(|refusal| {
                if *refusal == DenyReason::LeaseExhausted {
                    self.note_refused(units);
                }
            })
    }

    /// [`try_reserve_at`](Self::try_reserve_at) without recording a
    /// refusal: admission records one itself once it knows the account
    /// could fund the quote ([`note_refused`](Self::note_refused)), so a
    /// quote the allocator has ruled out does not set the refill task
    /// chasing it.
    #[allow(clippy::inline_always, reason = "the request path's debit")]
    #[inline(always)]
    pub(crate) fn try_reserve_unrecorded(
        &self,
        units: CostUnits,
        now: Timestamp,
        locality: Locality,
    ) -> Result<LeaseDebit, DenyReason> {
        // I2: no debit at or past the end of the usability window.
        if now >= self.terms.usable_until {
            return Err(DenyReason::LeaseExpired);
        }
        let home = locality.shard_of(self.shards.len());
        match self.shards[home].take(units.get()) {
            Some(left) => Ok(self.debited(home, left, units)),
            None => self.debit_elsewhere(home, units),
        }
    }

    /// Forgets the refused quote `seen`, the largest recorded when the
    /// refill task read it: the task's answer to a quote the allocator has
    /// ruled out, so that the record does not hide a smaller, fundable quote
    /// refused after it (I27).
    ///
    /// A larger quote recorded since the read stays recorded, to be judged
    /// on its own, and rings: recorded over `seen`, it rang nothing, and
    /// the task, past its read, would otherwise find it only at its next
    /// poll (I28). A smaller one refused in between is forgotten with
    /// `seen` (the record keeps only the largest); its request was denied
    /// as a momentary shortage, and a retry records it afresh and rings.
    pub(crate) fn forget_refusal(&self, seen: CostUnits) {
        let forgotten =
            self.refused
                .compare_exchange(seen.get(), 0, Ordering::AcqRel, Ordering::Acquire);
        if forgotten.is_err_and(|recorded| recorded > seen.get()) {
            self.ring();
        }
    }

    /// Records a quote this lease refused for want of units, so the refill
    /// task folds the lease into one that funds it, and rings for the
    /// first one (I7).
    #[cold]
    pub(crate) fn note_refused(&self, units: CostUnits) {
        self.refused_any.store(true, Ordering::Release);
        if self.refused.fetch_max(units.get(), Ordering::AcqRel) == 0 {
            self.ring();
        }
    }

    /// Records a quote this lease refused for want of units that the
    /// allocator's last word on the account rules out: admission does not
    /// chase it (it may answer it as final, or fund it from overage), but
    /// that word may be out of date (a top-up, a refill or another
    /// instance's release since), so the refill task asks the store again
    /// at its next poll rather than trust it for the rest of the lease's
    /// life (I28). Rings nothing: a quote nobody can fund would otherwise
    /// cost a store call per request.
    #[cold]
    pub(crate) fn note_ruled_out(&self, units: CostUnits) {
        self.refused_any.store(true, Ordering::Release);
        self.ruled_out.fetch_max(units.get(), Ordering::AcqRel);
    }

    /// Whether the lease ever refused a quote for want of units, whatever
    /// became of the record since (a fold, a recheck or a forget answers
    /// the record, not the demand it showed): when such a lease lapses
    /// unused, the lease manager waits before fetching another, so another
    /// instance refusing the same quote can fold its units first (I28).
    #[must_use]
    pub fn has_refused(&self) -> bool {
        self.refused_any.load(Ordering::Acquire)
    }

    /// The largest quote refused since the refill task last took the
    /// record, whose refusal the allocator's evidence ruled out (so it was
    /// not recorded for a fold), or zero.
    #[must_use]
    pub fn largest_ruled_out_quote(&self) -> CostUnits {
        CostUnits(self.ruled_out.load(Ordering::Acquire))
    }

    /// Takes the record of [`note_ruled_out`](Self::note_ruled_out), leaving
    /// it empty: the refill task's check of the quote against the store
    /// answers it, and only a quote refused after that asks again.
    pub(crate) fn take_ruled_out(&self) -> CostUnits {
        CostUnits(self.ruled_out.swap(0, Ordering::AcqRel))
    }

    /// Forgets the quote ruled out `seen`, if it is still the largest
    /// recorded: one recorded since is judged on its own.
    pub(crate) fn forget_ruled_out(&self, seen: CostUnits) {
        let _ = self
            .ruled_out
            .compare_exchange(seen.get(), 0, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Returns a debit's units to the shard they came from, consuming the
    /// debit so it cannot be credited twice.
    #[allow(
        clippy::needless_pass_by_value,
        reason = "taken by value so that a debit cannot be credited twice"
    )]
    #[inline]
    pub fn credit(&self, debit: LeaseDebit) {
        debug_assert!(
            self.shards
                .get(debit.shard.index)
                .is_some_and(|shard| Arc::ptr_eq(shard, &debit.shard)),
            "a debit must be credited to the lease it came from"
        );
        debit.refund();
    }

    /// The units left across all shards.
    ///
    /// Exact only when the lease is quiescent (see the type's docs); while
    /// requests run it is a momentary reading, which may even count units
    /// twice that a gather moves between shards during the read (hence the
    /// saturation: a quiescent lease's shards never hold more than the
    /// grant between them).
    #[must_use]
    pub fn remaining(&self) -> CostUnits {
        let total = self
            .shards
            .iter()
            .map(|shard| shard.units())
            .fold(0_u64, u64::saturating_add);
        CostUnits(total)
    }

    /// [`remaining`](Self::remaining), when it is a total the lease held at
    /// some moment; `None` when it may be short of every moment's total.
    /// A refusal answered with a reading that may be short is no ground for
    /// telling the client the account cannot fund its quote (I23).
    ///
    /// Shards are read one after another, so two kinds of change while
    /// they are read can make the sum short: units a spread or a gather
    /// moves between two shards (counted by the transit word), and a credit
    /// to a shard already read beside a debit from one read after it. The
    /// shards are therefore read twice, and the reading counts only if both
    /// passes agree shard by shard, with no move started meanwhile. (A
    /// shard that went up and back down between its two reads still
    /// agrees: that takes changes to it that cancel out, and more beside,
    /// inside the few loads of one reading.)
    pub(crate) fn settled_remaining(&self) -> Option<CostUnits> {
        let before = self.transit.load(Ordering::Acquire);
        if before & MOVES_UNDER_WAY != 0 {
            return None;
        }
        let mut first = [0_u64; LocalSharding::MAX_SHARDS];
        for (read, shard) in first.iter_mut().zip(self.shards.iter()) {
            *read = shard.units();
        }
        let mut total = 0_u64;
        for (read, shard) in first.iter().zip(self.shards.iter()) {
            let again = shard.units();
            if again != *read {
                return None;
            }
            total = total.saturating_add(again);
        }
        // Read after every shard: a move that took from one of them before
        // it was read started before this load, so this load sees it.
        (self.transit.load(Ordering::Acquire) == before).then_some(CostUnits(total))
    }

    /// A view of the shard a request at `locality` debits first, for a
    /// per-thread cache (see [`ShardView`]).
    pub(crate) fn view_at(&self, locality: Locality) -> ShardView {
        ShardView(Arc::downgrade(
            &self.shards[locality.shard_of(self.shards.len())],
        ))
    }

    /// Marks every shard retired: from now on a debit through a
    /// [`ShardView`] refuses it (I26). The slot calls it as the lease
    /// leaves, before the lease manager can test the lease for quiescence;
    /// see [`ShardView`] for why no such debit can then land unseen.
    pub(crate) fn retire(&self) {
        for shard in &self.shards[..] {
            shard.remaining.fetch_or(RETIRED, Ordering::AcqRel);
        }
    }

    /// Undoes [`retire`](Self::retire), as the lease is put (back) in a
    /// slot: views of it debit again.
    pub(crate) fn unretire(&self) {
        for shard in &self.shards[..] {
            shard.remaining.fetch_and(!RETIRED, Ordering::AcqRel);
        }
    }

    /// Whether no debit holds a view of any shard.
    ///
    /// Together with holding the only `Arc` to the lease, this is the
    /// quiescence predicate: no request can still debit or credit it.
    #[must_use]
    pub fn is_only_local_view(&self) -> bool {
        let only = self
            .shards
            .iter()
            .all(|shard| Arc::strong_count(shard) == 1);
        // The last debit dropped its view with a release decrement after its
        // credit; this fence makes that credit visible to `remaining()`.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        only
    }

    /// The largest quote this lease refused for want of units, or zero.
    #[must_use]
    pub fn largest_refused_quote(&self) -> CostUnits {
        CostUnits(self.refused.load(Ordering::Acquire))
    }

    /// How many debit attempts lost a compare-exchange to another thread.
    /// A steadily rising count on a single-counter lease says it is worth
    /// sharding.
    #[must_use]
    pub fn contended_debits(&self) -> u64 {
        self.shards
            .iter()
            .map(|shard| shard.contended.load(Ordering::Relaxed))
            .fold(0_u64, u64::saturating_add)
    }

    /// How the units sit across the shards right now.
    #[must_use]
    pub fn occupancy(&self) -> ShardOccupancy {
        let mut occupancy = ShardOccupancy {
            shards: self.shards.len(),
            remaining_min: CostUnits::MAX,
            remaining_max: CostUnits::ZERO,
            below_low_water: 0,
            views_outstanding: 0,
        };
        for shard in &self.shards[..] {
            let remaining = CostUnits(shard.units());
            occupancy.remaining_min = occupancy.remaining_min.min(remaining);
            occupancy.remaining_max = occupancy.remaining_max.max(remaining);
            occupancy.below_low_water += usize::from(remaining.get() <= shard.low_water);
            occupancy.views_outstanding += Arc::strong_count(shard) - 1;
        }
        occupancy
    }

    /// The refill task's question: should this lease be replaced,
    /// consolidated, or left alone?
    ///
    /// A refusal wins over draining, because replacing a lease that refused
    /// work with a same-sized one would refuse the same quote again. When
    /// neither applies, any shard that rang early (its own share ran low while
    /// the lease as a whole did not) is re-armed so it can ring again (I7).
    ///
    /// A shard that holds less than its share of the mark has rung already
    /// and may never be debited again (its thread moved on, or a gather
    /// emptied it), so the lease could fall to its mark with no shard left
    /// to cross its share and ring. Before re-arming, such a lease's units
    /// are spread evenly over its shards again (I7).
    pub fn refill_due_or_rearm(&self) -> RefillVerdict {
        let refused = self.refused.load(Ordering::Acquire) > 0;
        // Draining is answered without re-arming: a shard that rang stays
        // quiet while the replacement is sought, so a failing grant call is
        // retried at the poll, not at every debit.
        if self.remaining() <= self.low_water {
            return if refused {
                RefillVerdict::Refused
            } else {
                RefillVerdict::Draining
            };
        }
        // A debit can drain a shard again while the units are spread; one
        // more round settles that, so a lease far above its mark is not
        // rotated over a race.
        let mut rounds = 0;
        let (settled, below_share) = loop {
            rounds += 1;
            if self.shards.len() > 1
                && self
                    .shards
                    .iter()
                    .any(|shard| shard.units() < shard.low_water)
            {
                self.rebalance();
            }
            // A refused lease is re-armed too: its refusal may be one the
            // refill task does not act on (a quote the account cannot fund),
            // and the lease must still ring when it runs low afterwards (I7).
            for shard in &self.shards[..] {
                shard.rung.store(false, Ordering::Release);
            }
            // A debit that reached the mark while the flags were being
            // cleared may have seen its shard's flag still set and stayed
            // silent. Reading the counters again with read-modify-writes
            // closes that gap (I7): each one reads the latest count, so
            // either it sees that debit, or the debit's compare-exchange read
            // from it, acquired the cleared flag and rang.
            let mut settled = 0_u64;
            let mut below_share = false;
            for shard in &self.shards[..] {
                let left = shard.remaining.fetch_add(0, Ordering::AcqRel) & !RETIRED;
                settled = settled.saturating_add(left);
                below_share |= left < shard.low_water;
            }
            if !below_share || settled <= self.low_water.get() || rounds == 2 {
                break (settled, below_share);
            }
        };
        if refused {
            return RefillVerdict::Refused;
        }
        // I7: idle only if every shard holds at least its share and the
        // lease more than its mark. Then a later fall to the mark takes some
        // shard to its share by a debit or gather made after this read, and
        // that one rings. (A shard below its share here was drained while
        // the units were being spread; the next check spreads them again.)
        if below_share || settled <= self.low_water.get() {
            return RefillVerdict::Draining;
        }
        RefillVerdict::Idle
    }

    /// Spreads the lease's units evenly over its shards, as a fresh lease
    /// has them: each shard below its even part is topped up from those
    /// above theirs, one transfer at a time, each given on as soon as it is
    /// taken. Off the request path. A transfer's units are out of every
    /// shard for the moment between its two steps, as a gather's are, so a
    /// debit or a reading racing it may miss them; none is lost or made
    /// (I6).
    fn rebalance(&self) {
        let _moving = Moving::start(&self.transit);
        let total = self.remaining().get();
        let count = self.shards.len();
        let even = |index| split_evenly(total, count, index);
        for (to, short) in self.shards.iter().enumerate() {
            let mut wanted = even(to).saturating_sub(short.units());
            for (from, rich) in self.shards.iter().enumerate() {
                if wanted == 0 {
                    break;
                }
                let surplus = rich.units().saturating_sub(even(from));
                let moving = surplus.min(wanted);
                if moving == 0 {
                    continue;
                }
                let (taken, _) = rich.take_up_to(moving);
                short.remaining.fetch_add(taken, Ordering::AcqRel);
                wanted -= taken;
            }
        }
    }

    #[allow(clippy::inline_always, reason = "part of the inlined debit fast path")]
    #[inline(always)]
    fn debited(&self, index: usize, left: u64, units: CostUnits) -> LeaseDebit {
        // A debit of nothing moves nothing, so it cannot take a shard to
        // its mark (I7); ringing for it would wake the refill task on every
        // free request to a shard already at a mark of zero.
        if !units.is_zero() {
            self.ring_if_low(index, left);
        }
        LeaseDebit {
            shard: Arc::clone(&self.shards[index]),
            units,
        }
    }

    /// I7: see [`Shard::ring_if_low`].
    #[allow(clippy::inline_always, reason = "part of the inlined debit fast path")]
    #[inline(always)]
    fn ring_if_low(&self, index: usize, left: u64) {
        self.shards[index].ring_if_low(left);
    }

    /// Tries the other shards whole, then gathers the quote from all of
    /// them.
    #[cold]
    fn debit_elsewhere(&self, home: usize, units: CostUnits) -> Result<LeaseDebit, DenyReason> {
        let count = self.shards.len();
        for offset in 1..count {
            let index = (home + offset) % count;
            if let Some(left) = self.shards[index].take(units.get()) {
                return Ok(self.debited(index, left, units));
            }
        }
        if count > 1 {
            // Spread over the shards, the units may still be enough. A
            // gather that loses units to racing debits is tried once more
            // while the lease as a whole still holds the quote.
            for _ in 0..GATHER_ATTEMPTS {
                if self.remaining() < units {
                    break;
                }
                if let Some(left) = self.gather(home, units.get()) {
                    return Ok(self.debited(home, left, units));
                }
            }
        }
        Err(DenyReason::LeaseExhausted)
    }

    /// Takes `units` from the shards, home first, as one debit of the home
    /// shard (its credit returns them there), and returns what home holds
    /// after. What it takes stays in its hands until it has all of it, so
    /// a racing debit cannot take gathered units from under it. When it
    /// cannot get all of it, what it took goes to the home shard (units
    /// moved are still the lease's) and the answer is `None`.
    fn gather(&self, home: usize, units: u64) -> Option<u64> {
        let _moving = Moving::start(&self.transit);
        let count = self.shards.len();
        let mut gathered = 0;
        for offset in 0..count {
            let index = (home + offset) % count;
            let (taken, left) = self.shards[index].take_up_to(units - gathered);
            if taken > 0 {
                // A shard a gather empties rings like one a debit empties:
                // the units it held may never come back to it (I7).
                self.ring_if_low(index, left);
            }
            gathered += taken;
            if gathered == units {
                return Some(self.shards[home].units());
            }
        }
        if gathered > 0 {
            self.shards[home]
                .remaining
                .fetch_add(gathered, Ordering::AcqRel);
        }
        None
    }

    fn ring(&self) {
        if let Some(signal) = &self.refill {
            signal.request_refill();
        }
    }
}

impl fmt::Debug for LocalLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalLease")
            .field("grant", &self.terms.grant)
            .field("usable_until", &self.terms.usable_until)
            .field("low_water", &self.low_water)
            .field("shards", &self.shards.len())
            .field("remaining", &self.remaining())
            .field("largest_refused_quote", &self.largest_refused_quote())
            .field("largest_ruled_out_quote", &self.largest_ruled_out_quote())
            .field("refill", &self.refill.is_some())
            .finish_non_exhaustive()
    }
}

impl Shard {
    /// The units this shard holds, without the retired mark.
    #[inline]
    fn units(&self) -> u64 {
        self.remaining.load(Ordering::Acquire) & !RETIRED
    }

    /// I7: rings once when a debit or gather leaves this shard holding
    /// `left`, at or below its share of the mark. The plain load keeps the
    /// common below-water case off the read-modify-write.
    #[allow(clippy::inline_always, reason = "part of the inlined debit fast path")]
    #[inline(always)]
    fn ring_if_low(&self, left: u64) {
        if left <= self.low_water
            && !self.rung.load(Ordering::Acquire)
            && !self.rung.swap(true, Ordering::AcqRel)
            && let Some(signal) = &self.refill
        {
            signal.request_refill();
        }
    }

    /// [`take`](Self::take) for a debit through a [`ShardView`]: refuses a
    /// retired shard, whatever it holds. The check is part of the same
    /// compare-exchange that takes the units, which is what orders the
    /// debit against the lease manager's retire (I26, see [`ShardView`]).
    #[allow(clippy::inline_always, reason = "part of the inlined debit fast path")]
    #[inline(always)]
    fn take_live(&self, units: u64) -> Result<u64, ViewMiss> {
        let mut current = self.remaining.load(Ordering::Acquire);
        loop {
            if current & RETIRED != 0 {
                return Err(ViewMiss::Stale);
            }
            let left = current.checked_sub(units).ok_or(ViewMiss::Declined)?;
            match self.remaining.compare_exchange_weak(
                current,
                left,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(left),
                Err(actual) => {
                    if actual != current {
                        self.contended.fetch_add(1, Ordering::Relaxed);
                    }
                    current = actual;
                }
            }
        }
    }

    /// Takes exactly `units` or nothing; returns what is left on success.
    /// The debit of a request that read the lease in its slot: it ignores
    /// the retired mark, and keeps it (I26).
    #[allow(clippy::inline_always, reason = "part of the inlined debit fast path")]
    #[inline(always)]
    fn take(&self, units: u64) -> Option<u64> {
        let mut current = self.remaining.load(Ordering::Acquire);
        loop {
            let left = (current & !RETIRED).checked_sub(units)?;
            // Acquire pairs with the re-arm's read-modify-write in
            // `refill_due_or_rearm` (I7); release publishes the debit.
            match self.remaining.compare_exchange_weak(
                current,
                left | (current & RETIRED),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(left),
                Err(actual) => {
                    // A weak exchange may fail with nothing changed (on
                    // load-linked/store-conditional CPUs); only a changed
                    // count is another thread's doing.
                    if actual != current {
                        self.contended.fetch_add(1, Ordering::Relaxed);
                    }
                    current = actual;
                }
            }
        }
    }

    /// Takes as much as it can, up to `units`; returns how much it took
    /// and what it left. Keeps the retired mark (I26).
    fn take_up_to(&self, units: u64) -> (u64, u64) {
        let mut current = self.remaining.load(Ordering::Acquire);
        loop {
            let held = current & !RETIRED;
            let taken = held.min(units);
            if taken == 0 {
                return (0, held);
            }
            match self.remaining.compare_exchange_weak(
                current,
                current - taken,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return (taken, held - taken),
                Err(actual) => current = actual,
            }
        }
    }
}

impl LeaseDebit {
    /// The units debited.
    #[must_use]
    pub fn units(&self) -> CostUnits {
        self.units
    }

    /// Which shard gave the units; a credit returns them there.
    #[must_use]
    pub fn shard(&self) -> usize {
        self.shard.index
    }

    /// The grant of the lease the units came from.
    #[must_use]
    pub fn grant(&self) -> &LeaseGrant {
        &self.shard.terms.grant
    }

    pub(crate) fn terms(&self) -> &LeaseTerms {
        &self.shard.terms
    }

    /// The overage counter attached to the lease, if any (see
    /// [`LocalLease::with_overage`]).
    pub(crate) fn overage(&self) -> Option<&Arc<AccountOverage>> {
        self.shard.overage.as_ref()
    }

    /// Keeps only the view of the shard, for a charge that has committed.
    pub(crate) fn into_hold(self) -> LeaseHold {
        LeaseHold { _view: self.shard }
    }

    #[inline]
    pub(crate) fn refund(&self) {
        let before = self
            .shard
            .remaining
            .fetch_add(self.units.get(), Ordering::AcqRel);
        debug_assert!(
            before.checked_add(self.units.get()).is_some(),
            "a credit can only return units that were debited"
        );
    }
}

impl fmt::Debug for LeaseDebit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseDebit")
            .field("lease_id", &self.shard.terms.grant.lease_id)
            .field("shard", &self.shard.index)
            .field("units", &self.units)
            .finish()
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).expect("test instants are in range")
    }

    fn grant(units: u64) -> LeaseGrant {
        LeaseGrant {
            lease_id: LeaseId(11),
            account_id: AccountId(1),
            fencing_token: FencingToken(5),
            units: CostUnits(units),
            expires_at: at(1_000),
        }
    }

    #[derive(Default)]
    struct Doorbell(AtomicUsize);

    impl Doorbell {
        fn rings(&self) -> usize {
            self.0.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    impl RefillSignal for Doorbell {
        fn request_refill(&self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn lease_with_doorbell(lease: LocalLease) -> (LocalLease, Arc<Doorbell>) {
        let bell = Arc::new(Doorbell::default());
        (
            lease.with_refill(Arc::clone(&bell) as Arc<dyn RefillSignal>),
            bell,
        )
    }

    #[test]
    fn the_window_closes_a_margin_before_expiry() {
        let lease = LocalLease::with_safety_margin(
            grant(100),
            CostUnits::ZERO,
            SignedDuration::from_secs(10),
        );
        assert_eq!(lease.usable_until(), at(990));
        // I2: at the boundary the lease refuses, one nanosecond before it debits.
        assert_eq!(
            lease.try_debit(CostUnits(1), at(990)).unwrap_err(),
            DenyReason::LeaseExpired
        );
        let just_inside = at(990) - SignedDuration::from_nanos(1);
        assert_eq!(
            lease.try_debit(CostUnits(1), just_inside).unwrap().units(),
            CostUnits(1)
        );
        assert_eq!(lease.remaining(), CostUnits(99));
    }

    #[test]
    fn an_expired_lease_refuses_without_recording_a_refused_quote() {
        let (lease, bell) = lease_with_doorbell(LocalLease::new(grant(100), CostUnits::ZERO));
        assert_eq!(
            lease.try_debit(CostUnits(1), at(1_000)).unwrap_err(),
            DenyReason::LeaseExpired
        );
        assert_eq!(lease.largest_refused_quote(), CostUnits::ZERO);
        assert_eq!(
            bell.rings(),
            0,
            "expiry is the refill task's own check, not a refusal"
        );
        assert_eq!(lease.remaining(), CostUnits(100));
    }

    #[test]
    #[should_panic(expected = "safety margin must not be negative")]
    fn a_negative_margin_is_refused() {
        let _ = LocalLease::with_safety_margin(
            grant(1),
            CostUnits::ZERO,
            SignedDuration::from_secs(-1),
        );
    }

    /// I7: a debit of nothing moves nothing, so it does not ring, even on a
    /// shard already at a mark of zero whose flag an inspection re-armed:
    /// free requests on a drained shard of a tail lease (one with no mark)
    /// would otherwise wake the refill task one by one.
    #[test]
    fn a_debit_of_nothing_never_rings() {
        let (lease, bell) = lease_with_doorbell(LocalLease::with_sharding(
            grant(4),
            CostUnits::ZERO,
            SignedDuration::ZERO,
            LocalSharding::shards(2).unwrap(),
        ));
        // Home shard 0 holds 2: draining it rings; the lease still holds 2.
        let _spent = lease
            .try_reserve_at(CostUnits(2), at(0), Locality::new(0))
            .unwrap();
        assert_eq!(bell.rings(), 1, "the shard reaching its mark rang");
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Idle);
        for _ in 0..3 {
            let _free = lease
                .try_reserve_at(CostUnits::ZERO, at(0), Locality::new(0))
                .unwrap();
        }
        assert_eq!(
            bell.rings(),
            1,
            "free requests moved nothing and rang nothing"
        );
        let _last = lease
            .try_reserve_at(CostUnits(2), at(0), Locality::new(1))
            .unwrap();
        assert_eq!(bell.rings(), 2, "I7: the debit that drains the lease rings");
    }

    #[test]
    fn the_doorbell_rings_once_per_rotation_and_rearms_only_above_low_water() {
        let (lease, bell) = lease_with_doorbell(LocalLease::new(grant(100), CostUnits(20)));
        let mut kept = Vec::new();
        for _ in 0..7 {
            kept.push(lease.try_debit(CostUnits(10), at(0)).unwrap());
        }
        assert_eq!(lease.remaining(), CostUnits(30));
        assert_eq!(bell.rings(), 0, "above low water nothing rings");
        kept.push(lease.try_debit(CostUnits(10), at(0)).unwrap());
        assert_eq!(bell.rings(), 1, "I7: the debit reaching low water rings");
        kept.push(lease.try_debit(CostUnits(10), at(0)).unwrap());
        kept.push(lease.try_debit(CostUnits(5), at(0)).unwrap());
        assert_eq!(
            bell.rings(),
            1,
            "I7: further debits below the mark stay silent"
        );

        // Draining: no re-arm, so the bell stays quiet until the rotation.
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Draining);
        kept.push(lease.try_debit(CostUnits(1), at(0)).unwrap());
        assert_eq!(bell.rings(), 1);

        // Releases lift the lease back above the mark: the verdict is Idle and
        // the shard is re-armed, so the next crossing rings again.
        for debit in kept.drain(..4) {
            lease.credit(debit);
        }
        assert_eq!(lease.remaining(), CostUnits(44));
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Idle);
        kept.push(lease.try_debit(CostUnits(24), at(0)).unwrap());
        assert_eq!(bell.rings(), 2);
    }

    #[test]
    fn each_shard_rings_at_most_once_until_rearmed() {
        let (lease, bell) = lease_with_doorbell(LocalLease::with_sharding(
            grant(100),
            CostUnits(20),
            SignedDuration::ZERO,
            LocalSharding::shards(2).unwrap(),
        ));
        let zero = Locality::new(0);
        let one = Locality::new(1);
        // Shard 0 holds 50 with a share of 10 of the mark.
        let _a = lease.try_reserve_at(CostUnits(40), at(0), zero).unwrap();
        assert_eq!(bell.rings(), 1, "shard 0 reached its share");
        let b = lease.try_reserve_at(CostUnits(5), at(0), zero).unwrap();
        assert_eq!(bell.rings(), 1, "I7: shard 0 rang already");
        lease.credit(b);
        // The lease as a whole holds 60 and shard 0 its share: the early
        // ring was premature.
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Idle);
        let _c = lease.try_reserve_at(CostUnits(1), at(0), zero).unwrap();
        assert_eq!(bell.rings(), 2, "re-armed, shard 0 rings again");
        let _d = lease.try_reserve_at(CostUnits(40), at(0), one).unwrap();
        assert_eq!(bell.rings(), 3, "shard 1 has its own flag");
        assert_eq!(lease.remaining(), CostUnits(19));
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Draining);
    }

    #[test]
    fn a_shard_below_its_share_is_evened_out_so_the_lease_still_rings_at_its_mark() {
        let (lease, bell) = lease_with_doorbell(LocalLease::with_sharding(
            grant(100),
            CostUnits(40),
            SignedDuration::ZERO,
            LocalSharding::shards(2).unwrap(),
        ));
        let zero = Locality::new(0);
        // Each shard holds 50 with a share of 20 of the mark.
        let _a = lease.try_reserve_at(CostUnits(30), at(0), zero).unwrap();
        assert_eq!(bell.rings(), 1);
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Idle);
        let _b = lease.try_reserve_at(CostUnits(20), at(0), zero).unwrap();
        assert_eq!(bell.rings(), 2, "re-armed, shard 0 rings on emptying");
        // The lease holds 50, above its mark, but shard 0 is empty and will
        // not ring again; shard 1 would ring only at 20 of its own, with the
        // lease at 20. The check spreads the 50 evenly instead of replacing
        // a lease that is half full.
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Idle);
        let spread = lease.occupancy();
        assert_eq!(
            (spread.remaining_min, spread.remaining_max),
            (CostUnits(25), CostUnits(25))
        );
        assert_eq!(lease.remaining(), CostUnits(50), "I6: moved, not lost");
        // I7: the fall to the mark rings, wherever it happens.
        let _c = lease
            .try_reserve_at(CostUnits(10), at(0), Locality::new(1))
            .unwrap();
        assert_eq!(lease.remaining(), CostUnits(40));
        assert_eq!(bell.rings(), 3);
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Draining);
    }

    #[test]
    fn forgetting_a_refusal_keeps_a_larger_one_recorded_since() {
        let lease = LocalLease::new(grant(10), CostUnits::ZERO);
        assert!(lease.try_debit(CostUnits(20), at(0)).is_err());
        let seen = lease.largest_refused_quote();
        assert!(lease.try_debit(CostUnits(30), at(0)).is_err());
        lease.forget_refusal(seen);
        assert_eq!(
            lease.largest_refused_quote(),
            CostUnits(30),
            "I27: only the quote the refill task judged is forgotten"
        );
        lease.forget_refusal(CostUnits(30));
        assert_eq!(lease.largest_refused_quote(), CostUnits::ZERO);
    }

    #[test]
    fn a_draining_answer_leaves_the_shards_that_rang_quiet() {
        let (lease, bell) = lease_with_doorbell(LocalLease::with_sharding(
            grant(100),
            CostUnits(40),
            SignedDuration::ZERO,
            LocalSharding::shards(2).unwrap(),
        ));
        let _a = lease
            .try_reserve_at(CostUnits(30), at(0), Locality::new(0))
            .unwrap();
        let _b = lease
            .try_reserve_at(CostUnits(30), at(0), Locality::new(1))
            .unwrap();
        assert_eq!(bell.rings(), 2);
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Draining);
        // Not re-armed: while the replacement is sought (and perhaps
        // refused), further debits do not wake the refill task each time.
        for locality in [0, 1, 0, 1, 0] {
            let _more = lease
                .try_reserve_at(CostUnits(1), at(0), Locality::new(locality))
                .unwrap();
        }
        assert_eq!(bell.rings(), 2, "I7: the poll retries, not every debit");
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Draining);
    }

    #[test]
    fn a_gather_rings_for_each_shard_it_leaves_at_or_below_its_share() {
        let (lease, bell) = lease_with_doorbell(LocalLease::with_sharding(
            grant(30),
            CostUnits(6),
            SignedDuration::ZERO,
            LocalSharding::shards(3).unwrap(),
        ));
        // Each shard holds 10 with a share of 2. Gathering 25 from home 1
        // empties shards 1 and 2 and leaves shard 0 at 5.
        let _gathered = lease
            .try_reserve_at(CostUnits(25), at(0), Locality::new(1))
            .unwrap();
        assert_eq!(
            bell.rings(),
            2,
            "I7: the emptied shard 2 rings as well as home, and home once"
        );
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Draining);
    }

    #[test]
    fn a_refusal_records_the_largest_quote_and_rings_once() {
        let (lease, bell) = lease_with_doorbell(LocalLease::new(grant(100), CostUnits::ZERO));
        let _held = lease.try_debit(CostUnits(90), at(0)).unwrap();
        assert_eq!(bell.rings(), 0);
        assert_eq!(
            lease.try_debit(CostUnits(30), at(0)).unwrap_err(),
            DenyReason::LeaseExhausted
        );
        assert_eq!(lease.largest_refused_quote(), CostUnits(30));
        assert!(lease.has_refused());
        assert_eq!(bell.rings(), 1);
        assert_eq!(
            lease.try_debit(CostUnits(50), at(0)).unwrap_err(),
            DenyReason::LeaseExhausted
        );
        assert_eq!(
            lease.try_debit(CostUnits(20), at(0)).unwrap_err(),
            DenyReason::LeaseExhausted
        );
        assert_eq!(
            lease.largest_refused_quote(),
            CostUnits(50),
            "the largest is kept"
        );
        assert_eq!(bell.rings(), 1, "I7: one ring per lease for refusals");
        assert_eq!(lease.remaining(), CostUnits(10), "a refusal takes nothing");
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Refused);
    }

    /// I28: a quote ruled out is kept apart from the refusals the refill
    /// task folds for: it rings nothing and leaves the verdict idle, keeps
    /// the largest, and is answered once, by the take or by a forget of the
    /// quote judged.
    #[test]
    fn a_quote_ruled_out_rings_nothing_and_is_taken_once() {
        let (lease, bell) = lease_with_doorbell(LocalLease::new(grant(100), CostUnits::ZERO));
        let _held = lease.try_debit(CostUnits(90), at(0)).unwrap();
        assert!(!lease.has_refused());
        lease.note_ruled_out(CostUnits(30));
        assert!(lease.has_refused());
        lease.note_ruled_out(CostUnits(50));
        lease.note_ruled_out(CostUnits(20));
        assert_eq!(bell.rings(), 0);
        assert_eq!(lease.largest_refused_quote(), CostUnits::ZERO);
        assert_eq!(lease.largest_ruled_out_quote(), CostUnits(50));
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Idle);
        assert_eq!(lease.take_ruled_out(), CostUnits(50));
        assert_eq!(lease.largest_ruled_out_quote(), CostUnits::ZERO);
        assert_eq!(lease.take_ruled_out(), CostUnits::ZERO);
        // Forgetting a quote judged keeps a larger one recorded since.
        lease.note_ruled_out(CostUnits(30));
        lease.note_ruled_out(CostUnits(40));
        lease.forget_ruled_out(CostUnits(30));
        assert_eq!(lease.largest_ruled_out_quote(), CostUnits(40));
        lease.forget_ruled_out(CostUnits(40));
        assert_eq!(lease.largest_ruled_out_quote(), CostUnits::ZERO);
        assert!(
            lease.has_refused(),
            "answered records leave the demand they showed"
        );
    }

    /// I7: a refusal the refill task does not act on (say, a quote the
    /// account cannot fund) must not leave the lease silent: an inspection
    /// re-arms its shards, so a shard that rang before still rings when it
    /// runs low again.
    #[test]
    fn a_refused_lease_is_re_armed_and_rings_when_it_runs_low_again() {
        let (lease, bell) = lease_with_doorbell(LocalLease::with_sharding(
            grant(100),
            CostUnits(20),
            SignedDuration::ZERO,
            LocalSharding::shards(2).unwrap(),
        ));
        let home = Locality::new(0);
        // Shard 0 (50) falls to its share of the mark (10) and rings.
        let first = lease.try_reserve_at(CostUnits(40), at(0), home).unwrap();
        assert_eq!(bell.rings(), 1);
        // A quote larger than the whole lease is refused, and rings.
        assert!(lease.try_reserve_at(CostUnits(500), at(0), home).is_err());
        assert_eq!(bell.rings(), 2);
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Refused);
        // The first request is released, and the next takes shard 0 down
        // to its share again.
        lease.credit(first);
        let _second = lease.try_reserve_at(CostUnits(40), at(0), home).unwrap();
        assert_eq!(bell.rings(), 3, "I7: the re-armed shard rang again");
    }

    #[test]
    fn a_refusal_outranks_draining() {
        let lease = LocalLease::new(grant(10), CostUnits(5));
        let _held = lease.try_debit(CostUnits(8), at(0)).unwrap();
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Draining);
        assert!(lease.try_debit(CostUnits(3), at(0)).is_err());
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Refused);
    }

    #[test]
    fn a_quote_larger_than_the_grant_is_refused_and_remembered() {
        let lease = LocalLease::new(grant(10), CostUnits::ZERO);
        assert_eq!(
            lease.try_debit(CostUnits(11), at(0)).unwrap_err(),
            DenyReason::LeaseExhausted
        );
        assert_eq!(lease.largest_refused_quote(), CostUnits(11));
        assert_eq!(lease.remaining(), CostUnits(10));
    }

    #[test]
    fn a_sharded_debit_is_credited_back_to_its_own_shard() {
        let lease = LocalLease::with_sharding(
            grant(100),
            CostUnits::ZERO,
            SignedDuration::ZERO,
            LocalSharding::shards(4).unwrap(),
        );
        let debit = lease
            .try_reserve_at(CostUnits(7), at(0), Locality::new(6))
            .unwrap();
        assert_eq!(debit.shard(), 2, "locality 6 maps to shard 6 mod 4");
        let occupancy = lease.occupancy();
        assert_eq!(occupancy.remaining_min, CostUnits(18));
        assert_eq!(occupancy.remaining_max, CostUnits(25));
        assert_eq!(occupancy.views_outstanding, 1);
        lease.credit(debit);
        let occupancy = lease.occupancy();
        assert_eq!(
            occupancy.remaining_min,
            CostUnits(25),
            "shard 2 is whole again"
        );
        assert_eq!(occupancy.remaining_max, CostUnits(25));
        assert_eq!(occupancy.views_outstanding, 0);
        assert_eq!(lease.remaining(), CostUnits(100));
    }

    #[test]
    fn an_empty_home_shard_borrows_from_another() {
        let lease = LocalLease::with_sharding(
            grant(20),
            CostUnits::ZERO,
            SignedDuration::ZERO,
            LocalSharding::shards(2).unwrap(),
        );
        let zero = Locality::new(0);
        let first = lease.try_reserve_at(CostUnits(10), at(0), zero).unwrap();
        assert_eq!(first.shard(), 0);
        let second = lease.try_reserve_at(CostUnits(10), at(0), zero).unwrap();
        assert_eq!(second.shard(), 1, "shard 0 is empty, shard 1 funds it");
        assert_eq!(lease.remaining(), CostUnits::ZERO);
        lease.credit(second);
        assert_eq!(lease.remaining(), CostUnits(10));
        // The credit went back to shard 1: a debit homed there finds it.
        let again = lease
            .try_reserve_at(CostUnits(10), at(0), Locality::new(1))
            .unwrap();
        assert_eq!(again.shard(), 1, "returned to the shard it came from");
    }

    #[test]
    fn a_quote_spread_over_shards_is_gathered_not_refused() {
        let lease = LocalLease::with_sharding(
            grant(30),
            CostUnits::ZERO,
            SignedDuration::ZERO,
            LocalSharding::shards(3).unwrap(),
        );
        // Each shard holds 10; the quote needs 25 of the 30.
        let debit = lease
            .try_reserve_at(CostUnits(25), at(0), Locality::new(1))
            .unwrap();
        assert_eq!(debit.shard(), 1);
        assert_eq!(lease.remaining(), CostUnits(5));
        assert_eq!(lease.largest_refused_quote(), CostUnits::ZERO);
        lease.credit(debit);
        assert_eq!(
            lease.remaining(),
            CostUnits(30),
            "I6: gathering moved units, lost none"
        );
        // More than the whole lease is still a refusal.
        assert!(
            lease
                .try_reserve_at(CostUnits(31), at(0), Locality::new(0))
                .is_err()
        );
        assert_eq!(lease.remaining(), CostUnits(30));
        assert_eq!(lease.largest_refused_quote(), CostUnits(31));
    }

    /// I23: a reading taken while units move between shards may have
    /// missed them, so it is not settled; one taken with no move started
    /// or under way is. (The loom model races a spread against it.)
    #[test]
    fn a_reading_is_settled_only_with_no_units_between_shards() {
        let lease = LocalLease::with_sharding(
            grant(30),
            CostUnits::ZERO,
            SignedDuration::ZERO,
            LocalSharding::shards(3).unwrap(),
        );
        assert_eq!(lease.settled_remaining(), Some(CostUnits(30)));
        let moving = Moving::start(&lease.transit);
        assert_eq!(lease.settled_remaining(), None, "a move under way");
        let second = Moving::start(&lease.transit);
        drop(moving);
        assert_eq!(lease.settled_remaining(), None, "another still under way");
        drop(second);
        assert_eq!(lease.settled_remaining(), Some(CostUnits(30)));
        // A gather and a spread each count as a move, and end.
        let debit = lease
            .try_reserve_at(CostUnits(25), at(0), Locality::new(1))
            .unwrap();
        lease.credit(debit);
        assert_eq!(lease.transit.load(Ordering::Acquire) >> 32, 3);
        assert_eq!(lease.settled_remaining(), Some(CostUnits(30)));
    }

    #[test]
    fn a_lease_is_quiescent_only_when_no_debit_holds_a_shard() {
        let lease = Arc::new(LocalLease::with_sharding(
            grant(100),
            CostUnits::ZERO,
            SignedDuration::ZERO,
            LocalSharding::shards(2).unwrap(),
        ));
        assert!(lease.is_only_local_view());
        let debit = lease
            .try_reserve_at(CostUnits(30), at(0), Locality::new(1))
            .unwrap();
        assert!(
            !lease.is_only_local_view(),
            "a committed-but-held debit pins the shard"
        );
        let inspector = Arc::clone(&lease);
        assert_eq!(Arc::strong_count(&lease), 2);
        drop(inspector);
        drop(debit);
        assert!(lease.is_only_local_view());
        assert_eq!(Arc::strong_count(&lease), 1);
        // I6: quiescent, so exact: 100 granted, 30 kept by the dropped debit.
        assert_eq!(lease.remaining(), CostUnits(70));
    }

    #[test]
    fn an_uncontended_debit_never_counts_as_contended() {
        let lease = LocalLease::new(grant(100), CostUnits::ZERO);
        for _ in 0..50 {
            let debit = lease.try_debit(CostUnits(1), at(0)).unwrap();
            lease.credit(debit);
        }
        assert_eq!(lease.contended_debits(), 0);
    }

    #[test]
    fn racing_debits_on_one_counter_conserve_units() {
        let lease = LocalLease::new(grant(1_000_000), CostUnits::ZERO);
        let kept = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        let mut kept = 0_u64;
                        for round in 0..20_000_u64 {
                            let debit = lease.try_debit(CostUnits(1), at(0)).unwrap();
                            if round % 3 == 0 {
                                lease.credit(debit);
                            } else {
                                kept += 1;
                            }
                        }
                        kept
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum::<u64>()
        });
        // I6: every unit is either back in the lease or kept by a debit.
        assert_eq!(lease.remaining(), CostUnits(1_000_000 - kept));
    }

    /// The raw word of shard `index`, retired mark included.
    fn word(lease: &LocalLease, index: usize) -> u64 {
        lease.shards[index].remaining.load(Ordering::Acquire)
    }

    /// I26: a view debits the lease while it is live, refuses it once
    /// retired (taking nothing, whatever it holds), and debits again once
    /// the lease is put back.
    #[test]
    fn a_view_refuses_a_retired_lease_and_debits_it_once_live_again() {
        let lease = LocalLease::new(grant(10), CostUnits::ZERO);
        let view = lease.view_at(Locality::new(0));
        let debit = view.debit(CostUnits(3), at(0)).expect("live");
        assert_eq!((debit.units(), debit.shard()), (CostUnits(3), 0));
        assert!(!lease.is_only_local_view(), "a cached debit holds a view");
        drop(debit);
        assert!(lease.is_only_local_view(), "a cached view itself does not");

        lease.retire();
        assert_eq!(
            view.debit(CostUnits(1), at(0)).unwrap_err(),
            ViewMiss::Stale
        );
        assert!(lease.is_only_local_view(), "the refused debit let go");
        assert_eq!(lease.remaining(), CostUnits(7), "a refusal takes nothing");

        lease.unretire();
        assert_eq!(word(&lease, 0), 7, "no mark left");
        view.debit(CostUnits(7), at(0)).expect("live again");
        assert_eq!(lease.remaining(), CostUnits::ZERO);
    }

    /// A view declines what the lease must answer itself (a short home
    /// shard, a closed window), taking nothing, and a view of a lease that
    /// is gone is stale.
    #[test]
    fn a_view_declines_what_the_lease_answers_and_outlives_its_lease() {
        let lease = LocalLease::with_sharding(
            grant(4),
            CostUnits::ZERO,
            SignedDuration::ZERO,
            LocalSharding::shards(2).unwrap(),
        );
        let view = lease.view_at(Locality::new(1));
        assert_eq!(
            view.debit(CostUnits(3), at(0)).unwrap_err(),
            ViewMiss::Declined,
            "shard 1 holds 2; the lease decides whether to gather"
        );
        assert_eq!(
            view.debit(CostUnits(1), at(1_000)).unwrap_err(),
            ViewMiss::Declined,
            "I2: the window has closed"
        );
        assert_eq!(lease.remaining(), CostUnits(4));
        assert!(view.is_live());
        drop(lease);
        assert!(!view.is_live());
        assert_eq!(
            view.debit(CostUnits(1), at(0)).unwrap_err(),
            ViewMiss::Stale
        );
    }

    /// I7: a debit through a view rings at low water as one through the
    /// lease does, once until the refill task re-arms.
    #[test]
    fn a_debit_through_a_view_rings_at_low_water() {
        let (lease, bell) = lease_with_doorbell(LocalLease::new(grant(10), CostUnits(5)));
        let view = lease.view_at(Locality::new(0));
        drop(view.debit(CostUnits(4), at(0)).unwrap());
        assert_eq!(bell.rings(), 0, "6 left, above the mark");
        drop(view.debit(CostUnits(1), at(0)).unwrap());
        assert_eq!(bell.rings(), 1, "5 left, at the mark");
        drop(view.debit(CostUnits(1), at(0)).unwrap());
        assert_eq!(bell.rings(), 1, "rung once");
    }

    /// I26, I6: with the retired mark set, every reading of the lease
    /// counts units only, a debit through the slot's guard is refused
    /// exactly when the lease is short and keeps the mark when it is not,
    /// and credits, gathers and spreads keep it too, so views stay refused
    /// until the lease is put back.
    #[test]
    fn a_retired_lease_counts_and_debits_through_its_slot_as_before() {
        let (lease, bell) = lease_with_doorbell(LocalLease::with_sharding(
            grant(10),
            CostUnits(4),
            SignedDuration::ZERO,
            LocalSharding::shards(2).unwrap(),
        ));
        lease.retire();
        assert_eq!(lease.remaining(), CostUnits(10));
        assert_eq!(lease.settled_remaining(), Some(CostUnits(10)));
        let occupancy = lease.occupancy();
        assert_eq!(
            (occupancy.remaining_min, occupancy.remaining_max),
            (CostUnits(5), CostUnits(5))
        );
        assert_eq!(occupancy.below_low_water, 0);
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Idle);

        // Short: refused, however large the marked word is.
        assert_eq!(
            lease
                .try_reserve_at(CostUnits(11), at(0), Locality::new(0))
                .unwrap_err(),
            DenyReason::LeaseExhausted
        );
        assert_eq!(lease.remaining(), CostUnits(10));
        // A gather of 7 from both shards, then a credit.
        let gathered = lease
            .try_reserve_at(CostUnits(7), at(0), Locality::new(0))
            .expect("the lease holds 10");
        assert_eq!(lease.remaining(), CostUnits(3));
        assert!(bell.rings() > 0, "I7: a gather that empties a shard rings");
        assert_eq!(word(&lease, 0) & RETIRED, RETIRED);
        assert_eq!(word(&lease, 1) & RETIRED, RETIRED);
        lease.credit(gathered);
        assert_eq!(lease.remaining(), CostUnits(10));
        // Drain shard 1 and let the check spread the units again.
        let spent = lease
            .try_reserve_at(CostUnits(5), at(0), Locality::new(1))
            .unwrap();
        drop(spent);
        assert_eq!(
            lease.refill_due_or_rearm(),
            RefillVerdict::Refused,
            "the quote of 11 refused above"
        );
        assert_eq!(lease.occupancy().remaining_min, CostUnits(2));
        assert_eq!(lease.occupancy().remaining_max, CostUnits(3));
        for index in 0..2 {
            assert_eq!(word(&lease, index) & RETIRED, RETIRED, "shard {index}");
            assert_eq!(
                lease
                    .view_at(Locality::new(index))
                    .debit(CostUnits(1), at(0))
                    .unwrap_err(),
                ViewMiss::Stale
            );
        }
        assert!(lease.is_only_local_view());
        assert_eq!(lease.remaining(), CostUnits(5), "I6: exact once quiescent");
        lease.unretire();
        assert_eq!(word(&lease, 0) + word(&lease, 1), 5);
    }

    /// The retired mark is the top bit of a shard's count, so a lease
    /// holds at most `i64::MAX` units, as every store grants.
    #[test]
    #[should_panic(expected = "at most i64::MAX units")]
    fn a_lease_above_i64_max_is_refused() {
        let _ = LocalLease::new(grant(1 << 63), CostUnits::ZERO);
    }

    #[test]
    fn the_largest_lease_holds_i64_max() {
        let largest = i64::MAX.unsigned_abs();
        let lease = LocalLease::new(grant(largest), CostUnits::ZERO);
        lease.retire();
        assert_eq!(lease.remaining(), CostUnits(largest));
        let debit = lease.try_debit(CostUnits(largest), at(0)).unwrap();
        assert_eq!(lease.remaining(), CostUnits::ZERO);
        lease.credit(debit);
        assert_eq!(lease.remaining(), CostUnits(largest));
        assert_eq!(word(&lease, 0), u64::MAX, "units and the mark");
    }
}
