//! Principals' policy snapshots, published for lock-free reads.

use std::cell::Cell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use arc_swap::ArcSwap;
use crossbeam_queue::ArrayQueue;
use jiff::{SignedDuration, Timestamp};
use rustc_hash::FxBuildHasher;

use crate::admission::{LeaseSlot, SlotRegistry};
use crate::model::{AccountId, DenyReason, KeyHash, PolicyRevision, Principal, PrincipalSnapshot};

/// How the snapshot map bounds what it holds and trusts. No defaults (I17).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotMapConfig {
    /// A snapshot is refused once this long has passed since it (or the whole
    /// map) was last confirmed current by the source (I24). Longer tolerates
    /// longer source outages; shorter bounds how long a revoked key works.
    pub max_staleness: SignedDuration,
    /// Principals remembered as unknown (I24). At least 1 and at most
    /// [`MAX_NEGATIVE_CAPACITY`](Self::MAX_NEGATIVE_CAPACITY). A record
    /// answers for no longer than `max_staleness` after the source said so.
    pub negative_capacity: usize,
    /// Snapshots kept per principal for inspection, newest first (I24). At
    /// least 1 and at most [`MAX_HISTORY_DEPTH`](Self::MAX_HISTORY_DEPTH).
    pub history_depth: usize,
    /// Unknown principals queued for the snapshot manager to look up. At
    /// least 1 and at most
    /// [`MAX_LOOKUP_QUEUE_CAPACITY`](Self::MAX_LOOKUP_QUEUE_CAPACITY); the
    /// queue is allocated up front.
    pub lookup_queue_capacity: usize,
}

/// The first rule a [`SnapshotMapConfig`] breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SnapshotMapConfigError {
    /// `max_staleness` must be positive.
    MaxStalenessNotPositive,
    /// `negative_capacity` must be at least one.
    NegativeCapacityZero,
    /// `negative_capacity` is above
    /// [`SnapshotMapConfig::MAX_NEGATIVE_CAPACITY`].
    NegativeCapacityAboveMax,
    /// `history_depth` must be at least one.
    HistoryDepthZero,
    /// `history_depth` is above [`SnapshotMapConfig::MAX_HISTORY_DEPTH`].
    HistoryDepthAboveMax,
    /// `lookup_queue_capacity` must be at least one.
    LookupQueueCapacityZero,
    /// `lookup_queue_capacity` is above
    /// [`SnapshotMapConfig::MAX_LOOKUP_QUEUE_CAPACITY`].
    LookupQueueCapacityAboveMax,
}

impl fmt::Display for SnapshotMapConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (field, rule) = match self {
            Self::MaxStalenessNotPositive => ("max_staleness", "be positive"),
            Self::NegativeCapacityZero => ("negative_capacity", "be at least 1"),
            Self::HistoryDepthZero => ("history_depth", "be at least 1"),
            Self::LookupQueueCapacityZero => ("lookup_queue_capacity", "be at least 1"),
            Self::NegativeCapacityAboveMax => {
                return at_most(
                    f,
                    "negative_capacity",
                    SnapshotMapConfig::MAX_NEGATIVE_CAPACITY,
                );
            }
            Self::HistoryDepthAboveMax => {
                return at_most(f, "history_depth", SnapshotMapConfig::MAX_HISTORY_DEPTH);
            }
            Self::LookupQueueCapacityAboveMax => {
                return at_most(
                    f,
                    "lookup_queue_capacity",
                    SnapshotMapConfig::MAX_LOOKUP_QUEUE_CAPACITY,
                );
            }
        };
        write!(f, "snapshot map: {field} must {rule}")
    }
}

fn at_most(f: &mut fmt::Formatter<'_>, field: &str, max: usize) -> fmt::Result {
    write!(f, "snapshot map: {field} must be at most {max}")
}

impl std::error::Error for SnapshotMapConfigError {}

impl SnapshotMapConfig {
    /// The most principals the negative cache may remember: 2²⁰. The cache
    /// is what keeps a flood of made-up principals from reaching the
    /// source; its bound is what keeps the flood from growing memory
    /// instead (I24).
    pub const MAX_NEGATIVE_CAPACITY: usize = 1 << 20;

    /// The most snapshots kept per principal. History is for inspection; a
    /// deeper one multiplies the map's memory by every principal.
    pub const MAX_HISTORY_DEPTH: usize = 64;

    /// The most places in the lookup queue: 2²⁰. The queue is allocated
    /// when the map is built.
    pub const MAX_LOOKUP_QUEUE_CAPACITY: usize = 1 << 20;

    /// Checks every rule in field order and names the first one broken.
    ///
    /// # Errors
    ///
    /// The first broken rule.
    pub fn validate(&self) -> Result<(), SnapshotMapConfigError> {
        use SnapshotMapConfigError as Broken;
        let rules = [
            (
                self.max_staleness.is_positive(),
                Broken::MaxStalenessNotPositive,
            ),
            (self.negative_capacity > 0, Broken::NegativeCapacityZero),
            (
                self.negative_capacity <= Self::MAX_NEGATIVE_CAPACITY,
                Broken::NegativeCapacityAboveMax,
            ),
            (self.history_depth > 0, Broken::HistoryDepthZero),
            (
                self.history_depth <= Self::MAX_HISTORY_DEPTH,
                Broken::HistoryDepthAboveMax,
            ),
            (
                self.lookup_queue_capacity > 0,
                Broken::LookupQueueCapacityZero,
            ),
            (
                self.lookup_queue_capacity <= Self::MAX_LOOKUP_QUEUE_CAPACITY,
                Broken::LookupQueueCapacityAboveMax,
            ),
        ];
        rules
            .into_iter()
            .find_map(|(holds, broken)| (!holds).then_some(broken))
            .map_or(Ok(()), Err)
    }
}

/// Principal → snapshot, published with arc-swap so requests read it without
/// a lock, plus a bounded negative cache of principals known not to exist.
///
/// Every published entry is bound to its account's [`LeaseSlot`], so one
/// lookup gives a request both its policy and its funding.
pub struct ArcSwapSnapshotMap {
    published: ArcSwap<Published>,
    /// Which map this is, for the per-thread cache of the published
    /// generation: unique for the life of the process.
    id: u64,
    /// Bumped after every store to `published`, so a thread whose cached
    /// generation still matches holds the current one (see
    /// [`pin`](Self::pin)).
    generation: AtomicU64,
    config: SnapshotMapConfig,
    registry: Arc<SlotRegistry>,
    /// When the source last confirmed every published snapshot current, in
    /// nanoseconds since the epoch; `i64::MIN` before the first time.
    verified_at: AtomicI64,
    lookups: ArrayQueue<Principal>,
    /// Principals queued for lookup and not yet drained, one per cell by
    /// a hash of the principal, each as its id plus one (zero is empty): a
    /// principal asked for again is not queued again, so one hot unknown
    /// principal cannot fill the queue and crowd out the others. Cells
    /// collide, and two requests may queue one principal at once; either
    /// costs a duplicate the snapshot manager drops, never a lost lookup.
    queued: Box<[AtomicU64]>,
    writer: Mutex<Writer>,
}

/// One generation of an [`ArcSwapSnapshotMap`], for reading many
/// snapshots at once (see [`ArcSwapSnapshotMap::snapshots`]).
pub struct Snapshots(Arc<Published>);

impl Snapshots {
    /// `principal`'s snapshot in this generation, if it has one.
    #[must_use]
    pub fn get(&self, principal: Principal) -> Option<&PrincipalSnapshot> {
        self.0.entry(principal).map(|entry| &*entry.snapshot)
    }
}

impl fmt::Debug for Snapshots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Snapshots")
            .field("principals", &self.0.len())
            .finish()
    }
}

/// How many shards each index of a generation is split into. A publication
/// copies only the shards it changes, so one change to a map of N principals
/// copies about N / `SHARDS` entries, not N.
const SHARDS: usize = 64;

type EntryShard = HashMap<Principal, Entry, FxBuildHasher>;
type KeyShard = HashMap<KeyHash, Principal, FxBuildHasher>;

/// What requests read: one immutable generation. Generations share the
/// shards neither has changed.
#[derive(Clone)]
struct Published {
    entries: [Arc<EntryShard>; SHARDS],
    /// Principals remembered as unknown, with when the source said so
    /// (nanoseconds since the epoch, saturated like `verified_at`).
    unknown: Arc<HashMap<Principal, i64, FxBuildHasher>>,
    /// Principals by the hash of their API key. Keys are SHA-256 digests, so
    /// a caller cannot choose which bucket (or shard) its guesses land in.
    by_key: [Arc<KeyShard>; SHARDS],
}

impl Default for Published {
    fn default() -> Self {
        Self {
            entries: std::array::from_fn(|_| Arc::default()),
            unknown: Arc::default(),
            by_key: std::array::from_fn(|_| Arc::default()),
        }
    }
}

/// The shard of `principal`'s entry: the top bits of a multiplicative hash,
/// so consecutive ids spread over every shard.
#[allow(
    clippy::inline_always,
    reason = "part of the request path's first lookup"
)]
#[inline(always)]
fn principal_shard(principal: Principal) -> usize {
    let spread = principal.get().wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58;
    // Six bits: below `SHARDS` on every target.
    usize::from(u8::try_from(spread).unwrap_or(0))
}

/// The shard of a key hash: its first byte's low six bits, uniform because
/// the hash is a SHA-256 digest.
#[allow(
    clippy::inline_always,
    reason = "part of the request path's first lookup"
)]
#[inline(always)]
fn key_shard(hash: &KeyHash) -> usize {
    usize::from(hash.0[0]) % SHARDS
}

impl Published {
    #[allow(clippy::inline_always, reason = "the request path's lookup")]
    #[inline(always)]
    fn entry(&self, principal: Principal) -> Option<&Entry> {
        self.entries[principal_shard(principal)].get(&principal)
    }

    #[allow(clippy::inline_always, reason = "the request path's lookup")]
    #[inline(always)]
    fn principal_by_key(&self, hash: &KeyHash) -> Option<Principal> {
        self.by_key[key_shard(hash)].get(hash).copied()
    }

    fn len(&self) -> usize {
        self.entries.iter().map(|shard| shard.len()).sum()
    }

    fn values(&self) -> impl Iterator<Item = &Entry> {
        self.entries.iter().flat_map(|shard| shard.values())
    }

    /// The shard holding `principal`'s entry, copied first if another
    /// generation shares it.
    fn entries_mut(&mut self, principal: Principal) -> &mut EntryShard {
        Arc::make_mut(&mut self.entries[principal_shard(principal)])
    }

    /// The shard holding `hash`, copied first if another generation shares
    /// it.
    fn keys_mut(&mut self, hash: &KeyHash) -> &mut KeyShard {
        Arc::make_mut(&mut self.by_key[key_shard(hash)])
    }

    /// Forgets `principal`'s key `hash` if it still leads to `principal`.
    fn forget_key(&mut self, hash: &KeyHash, principal: Principal) {
        if self.principal_by_key(hash) == Some(principal) {
            self.keys_mut(hash).remove(hash);
        }
    }
}

#[derive(Clone)]
pub(crate) struct Entry {
    pub(crate) snapshot: Arc<PrincipalSnapshot>,
    pub(crate) slot: Arc<LeaseSlot>,
    /// `fetched_at + max_staleness`: until then the snapshot is fresh on its
    /// own, whatever the map's verification says (I24), so the request path
    /// decides the common case with one comparison.
    fresh_until: Timestamp,
}

/// A generation of the map pinned for the reads of one admission: the
/// request path's view of the map (I24).
///
/// Entries borrow from it, so the admission built from them is the caller's
/// last expression and lands where the caller wants it. Dropping it puts the
/// generation back in the thread's cache, also when the reader unwinds.
pub(crate) struct Pinned<'map> {
    map: &'map ArcSwapSnapshotMap,
    /// The map's verification, read before the generation: a refresh
    /// publishes and then verifies, so this never vouches for more than
    /// the pinned generation holds (I24).
    verified_at: i64,
    generation: u64,
    /// `Some` until the drop hands it back to the cache.
    published: Option<Arc<Published>>,
}

impl Pinned<'_> {
    /// `principal`'s entry, or why there is none:
    /// [`DenyReason::UnknownPrincipal`] for a principal the source said does
    /// not exist, no longer than the maximum staleness ago (I24), and
    /// [`DenyReason::SnapshotUnavailable`] otherwise, queueing the principal
    /// for the snapshot manager to look up: for one not loaded yet, and for
    /// one whose record has aged out, since the source may have created it
    /// meanwhile.
    #[allow(
        clippy::inline_always,
        reason = "inlined so the admitted context is built in place, not copied out of a call"
    )]
    #[inline(always)]
    pub(crate) fn entry(&self, principal: Principal, now: Timestamp) -> Result<&Entry, DenyReason> {
        let published = self.published()?;
        match published.entry(principal) {
            Some(entry) => Ok(entry),
            None => Err(self.map.missing(published, principal, now)),
        }
    }

    /// The entry of the principal whose API key hashes to `hash`: the HTTP
    /// layer's read. A key issued since the last refresh is known after the
    /// next one.
    ///
    /// A key no published principal has is [`DenyReason::UnknownPrincipal`]
    /// only while the map can vouch for its set of keys: after a complete
    /// refresh, and no longer than the maximum staleness after the last
    /// one. Before the first, or once the source has been out of reach that
    /// long, the key may be one the map has not heard of yet, and the
    /// denial is [`DenyReason::SnapshotUnavailable`] (I24).
    #[allow(
        clippy::inline_always,
        reason = "inlined so the admitted context is built in place, not copied out of a call"
    )]
    #[inline(always)]
    pub(crate) fn entry_by_key(
        &self,
        hash: &KeyHash,
        now: Timestamp,
    ) -> Result<&Entry, DenyReason> {
        let published = self.published()?;
        published
            .principal_by_key(hash)
            .and_then(|principal| published.entry(principal))
            .ok_or_else(|| self.map.missing_key(self.verified_at, now))
    }

    /// Refuses a snapshot that has not been confirmed current within the
    /// maximum staleness (I24), by the verification pinned with the
    /// generation it came from.
    ///
    /// # Errors
    ///
    /// [`DenyReason::SnapshotStale`].
    #[inline]
    pub(crate) fn check_fresh(&self, entry: &Entry, now: Timestamp) -> Result<(), DenyReason> {
        // I24: fresh on its own fetch time; `now − fetched_at ≤ max_staleness`
        // implies `now − max(fetched_at, verified) ≤ max_staleness`.
        if now <= entry.fresh_until {
            return Ok(());
        }
        self.map
            .check_verified(&entry.snapshot, self.verified_at, now)
    }

    /// The pinned generation. Missing only once the drop has taken it, which
    /// no reader can see; a read fails closed on it all the same rather
    /// than panic.
    #[allow(clippy::inline_always, reason = "the request path's first step")]
    #[inline(always)]
    fn published(&self) -> Result<&Published, DenyReason> {
        self.published
            .as_deref()
            .ok_or(DenyReason::SnapshotUnavailable)
    }
}

impl Drop for Pinned<'_> {
    #[inline]
    fn drop(&mut self) {
        let Some(published) = self.published.take() else {
            return;
        };
        // A thread being torn down simply drops it. What the cache held was
        // taken by `pin`, so nothing is dropped here otherwise.
        let _ = CACHED_AT.try_with(|at| at.set((self.map.id, self.generation)));
        let _ = CACHED.try_with(|cache| cache.set(Some(published)));
    }
}

/// `at` in nanoseconds since the epoch, saturating toward the sentinel: an
/// instant before 1677 reads as never said, not as said for ever.
fn saturated_nanos(at: Timestamp) -> i64 {
    let nanos = at.as_nanosecond();
    i64::try_from(nanos).unwrap_or(if nanos < 0 { i64::MIN } else { i64::MAX })
}

/// Source of [`ArcSwapSnapshotMap::id`].
static NEXT_MAP_ID: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The generation this thread last read, from the last map it read.
    ///
    /// I24: bounded at one generation per thread. It holds no lease: entries
    /// name slots, and a slot's lease is read through the slot at admission,
    /// so a cached generation never keeps a lease from quiescing (I26). A
    /// generation of a dropped map is freed when the thread next reads
    /// another map, or exits.
    static CACHED: Cell<Option<Arc<Published>>> = const { Cell::new(None) };
    /// Which generation [`CACHED`] is: the map's id and the generation
    /// number it was read at. Kept apart so that checking it moves no
    /// reference count and needs no destructor.
    static CACHED_AT: Cell<(u64, u64)> = const { Cell::new((u64::MAX, u64::MAX)) };
}

/// Bookkeeping only the publisher touches.
#[derive(Default)]
struct Writer {
    /// The principals remembered as unknown, oldest first, and the same
    /// principals as a map, so membership costs one lookup, not a scan of
    /// up to the negative capacity. The map keeps the last policy revision
    /// each was published at, if any: a floor for its return (I34).
    unknown_order: VecDeque<Principal>,
    unknown_members: HashMap<Principal, Option<PolicyRevision>, FxBuildHasher>,
    history: HashMap<Principal, VecDeque<Arc<PrincipalSnapshot>>, FxBuildHasher>,
}

impl ArcSwapSnapshotMap {
    /// An empty map whose entries bind to slots from `registry`.
    ///
    /// # Errors
    ///
    /// The first rule `config` breaks.
    pub fn new(
        config: SnapshotMapConfig,
        registry: Arc<SlotRegistry>,
    ) -> Result<Self, SnapshotMapConfigError> {
        config.validate()?;
        Ok(Self {
            published: ArcSwap::from_pointee(Published::default()),
            id: NEXT_MAP_ID.fetch_add(1, Ordering::Relaxed),
            generation: AtomicU64::new(0),
            config,
            registry,
            verified_at: AtomicI64::new(i64::MIN),
            lookups: ArrayQueue::new(config.lookup_queue_capacity),
            queued: (0..config.lookup_queue_capacity.next_power_of_two())
                .map(|_| AtomicU64::new(0))
                .collect(),
            writer: Mutex::new(Writer::default()),
        })
    }

    /// The configuration in force.
    #[must_use]
    pub fn config(&self) -> &SnapshotMapConfig {
        &self.config
    }

    /// The registry entries bind to.
    #[must_use]
    pub fn registry(&self) -> &Arc<SlotRegistry> {
        &self.registry
    }

    /// Why a principal with no entry is refused (see [`Pinned::entry`]).
    #[cold]
    fn missing(&self, published: &Published, principal: Principal, now: Timestamp) -> DenyReason {
        if let Some(&learned) = published.unknown.get(&principal)
            && self.vouches(learned, now)
        {
            return DenyReason::UnknownPrincipal;
        }
        // Not loaded, or the source's word that it does not exist is too
        // old to stand: the source may have created it since (I24). A hint
        // for the snapshot manager, queued once until it drains it; a full
        // queue holds that many other principals to look up first.
        // Marked before it is queued: marked after, a drain in between
        // would find no mark to clear, and the mark left behind would keep
        // the principal from being queued again.
        let (cell, tag) = self.queued_cell(principal);
        if tag == 0 {
            // `Principal(u64::MAX)`, whose mark would read as none: queued
            // unmarked, at every ask.
            let _ = self.lookups.push(principal);
        } else if cell.load(Ordering::Acquire) != tag
            && cell.swap(tag, Ordering::AcqRel) != tag
            && self.lookups.push(principal).is_err()
        {
            let _ = cell.compare_exchange(tag, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
        DenyReason::SnapshotUnavailable
    }

    /// The cell of `queued` that records `principal`, and the value that
    /// records it there.
    fn queued_cell(&self, principal: Principal) -> (&AtomicU64, u64) {
        // A multiplicative hash's high bits, masked to the power-of-two
        // table.
        let mixed = principal.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let index = usize::try_from(mixed).unwrap_or(0) & (self.queued.len() - 1);
        (&self.queued[index], principal.0.wrapping_add(1))
    }

    /// Why a key no published principal has is refused (see
    /// [`Pinned::entry_by_key`]).
    #[cold]
    fn missing_key(&self, verified: i64, now: Timestamp) -> DenyReason {
        if self.vouches(verified, now) {
            DenyReason::UnknownPrincipal
        } else {
            DenyReason::SnapshotUnavailable
        }
    }

    /// I24: whether the source's word at `said` (a complete refresh, or an
    /// answer that a principal does not exist) still stands at `now`.
    fn vouches(&self, said: i64, now: Timestamp) -> bool {
        said != i64::MIN
            && now.as_nanosecond() - i128::from(said) <= self.config.max_staleness.as_nanos()
    }

    /// The principal whose API key hashes to `hash`, if one is published.
    #[must_use]
    pub fn principal_for_key(&self, hash: &KeyHash) -> Option<Principal> {
        self.published.load().principal_by_key(hash)
    }

    /// The current generation, from this thread's cache when its number
    /// still matches.
    ///
    /// Each thread keeps the generation it last read with the number it was
    /// read at. Every store to `published` is followed by a release bump of
    /// `generation`, and the cached generation was loaded *after* its number
    /// was read, so while the number still matches the cache is no older
    /// than what a fresh load would give: a publish that happens before this
    /// read (in the happens-before sense, such as an earlier publish on this
    /// thread) is always seen (I24).
    #[allow(clippy::inline_always, reason = "the request path's first step")]
    #[inline(always)]
    pub(crate) fn pin(&self) -> Pinned<'_> {
        // Verification first: read after the generation, it could vouch
        // for a refresh whose publication the pinned generation predates,
        // freshening a stale snapshot or calling a just-published key
        // unknown.
        let verified_at = self.verified_at.load(Ordering::Acquire);
        let generation = self.generation.load(Ordering::Acquire);
        // Moved out while pinned, so a nested read finds no cache and loads
        // afresh rather than conflict. A thread being torn down has none.
        let cached = CACHED.try_with(Cell::take).ok().flatten();
        let at = CACHED_AT.try_with(Cell::get).ok();
        let published = match cached {
            Some(published) if at == Some((self.id, generation)) => published,
            _ => self.published.load_full(),
        };
        Pinned {
            map: self,
            verified_at,
            generation,
            published: Some(published),
        }
    }

    /// Stores a new generation and then announces it (see
    /// [`pin`](Self::pin)).
    fn publish_generation(&self, update: impl FnMut(&Arc<Published>) -> Published) {
        self.published.rcu(update);
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// The slow half of [`Pinned::check_fresh`]: `snapshot` is stale on its
    /// own fetch time, and only a verification at `verified` (the map's,
    /// as pinned) can still vouch for it.
    #[cold]
    fn check_verified(
        &self,
        snapshot: &PrincipalSnapshot,
        verified: i64,
        now: Timestamp,
    ) -> Result<(), DenyReason> {
        let verified = i128::from(verified);
        let confirmed = snapshot.fetched_at.as_nanosecond().max(verified);
        if now.as_nanosecond() - confirmed > self.config.max_staleness.as_nanos() {
            return Err(DenyReason::SnapshotStale);
        }
        Ok(())
    }

    /// The current generation, for reading many snapshots: one load for
    /// all of them, and no reference count per read. It holds that
    /// generation, so keep it only for the reads at hand.
    #[must_use]
    pub fn snapshots(&self) -> Snapshots {
        Snapshots(self.published.load_full())
    }

    /// The current snapshot of `principal`, if one is published.
    #[must_use]
    pub fn get(&self, principal: Principal) -> Option<Arc<PrincipalSnapshot>> {
        self.published
            .load()
            .entry(principal)
            .map(|entry| Arc::clone(&entry.snapshot))
    }

    /// Whether `principal` is remembered as unknown, however long ago the
    /// source said so.
    #[must_use]
    pub fn is_known_unknown(&self, principal: Principal) -> bool {
        self.published.load().unknown.contains_key(&principal)
    }

    /// Whether `principal` is remembered as unknown on the source's word of
    /// no longer than the maximum staleness before `now`: what admission
    /// answers as unknown rather than asking the source again (I24).
    #[must_use]
    pub fn is_unknown_at(&self, principal: Principal, now: Timestamp) -> bool {
        self.published
            .load()
            .unknown
            .get(&principal)
            .is_some_and(|&learned| self.vouches(learned, now))
    }

    /// How many principals have snapshots.
    #[must_use]
    pub fn len(&self) -> usize {
        self.published.load().len()
    }

    /// Whether no principal has a snapshot.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The snapshots kept for `principal`, newest first.
    #[must_use]
    pub fn history(&self, principal: Principal) -> Vec<Arc<PrincipalSnapshot>> {
        self.lock_writer()
            .history
            .get(&principal)
            .map(|kept| kept.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Publishes fresh snapshots, binding each to its account's slot (made if
    /// missing). A principal published here stops being unknown.
    ///
    /// A snapshot of an older policy revision than one already published or
    /// earlier in `snapshots` for its principal is dropped and logged (I34):
    /// revisions only grow, so it is a stale read, and publishing it could
    /// bring back a key that was revoked. Returns how many were dropped, so
    /// that a refresh which read them does not vouch for the map.
    ///
    /// Under a running [`InstanceRuntime`](crate::runtime::InstanceRuntime)
    /// its snapshot manager is the map's only writer, and keeps its account
    /// bindings by what it publishes; publish through a
    /// [`SnapshotSource`](crate::store::SnapshotSource) instead.
    pub fn publish(&self, snapshots: impl IntoIterator<Item = PrincipalSnapshot>) -> usize {
        let mut snapshots: Vec<PrincipalSnapshot> = snapshots.into_iter().collect();
        if snapshots.is_empty() {
            return 0;
        }
        let mut writer = self.lock_writer();
        let stale = self.drop_stale(&writer, &mut snapshots);
        if stale > 0 {
            tracing::warn!(
                stale,
                "snapshot map: dropped snapshots older than a revision already published \
                 for their principal (I34)"
            );
        }
        if snapshots.is_empty() {
            return stale;
        }
        // Slots only for what is kept: a dropped stale read naming another
        // account must not leave that account a slot.
        let accounts: Vec<AccountId> = snapshots.iter().map(|s| s.account_id).collect();
        let slots = self.registry.ensure_many(&accounts);
        let fresh: Vec<Entry> = snapshots
            .into_iter()
            .zip(slots)
            .map(|(snapshot, slot)| Entry {
                slot,
                // Past the representable range it can only be checked the
                // long way.
                fresh_until: snapshot
                    .fetched_at
                    .checked_add(self.config.max_staleness)
                    .unwrap_or(snapshot.fetched_at),
                snapshot: Arc::new(snapshot),
            })
            .collect();
        let depth = self.config.history_depth;
        for entry in &fresh {
            let kept = writer.history.entry(entry.snapshot.principal).or_default();
            // A refresh that reads the same revision again replaces its
            // record: history is of revisions, and repeats would push the
            // older ones out.
            if kept
                .front()
                .is_some_and(|newest| newest.policy_revision == entry.snapshot.policy_revision)
            {
                kept.pop_front();
            }
            kept.push_front(Arc::clone(&entry.snapshot));
            kept.truncate(depth);
        }
        let known_again: HashSet<Principal> = fresh
            .iter()
            .map(|entry| entry.snapshot.principal)
            .filter(|principal| writer.unknown_members.contains_key(principal))
            .collect();
        if !known_again.is_empty() {
            writer
                .unknown_order
                .retain(|principal| !known_again.contains(principal));
            writer
                .unknown_members
                .retain(|principal, _| !known_again.contains(principal));
        }
        self.publish_generation(|current| {
            // Shares every shard with `current` until one is written.
            let mut next = Published::clone(current);
            if fresh
                .iter()
                .any(|entry| next.unknown.contains_key(&entry.snapshot.principal))
            {
                let unknown = Arc::make_mut(&mut next.unknown);
                for entry in &fresh {
                    unknown.remove(&entry.snapshot.principal);
                }
            }
            for entry in &fresh {
                let principal = entry.snapshot.principal;
                let hash = entry.snapshot.key_hash;
                // A principal whose key changed (rotated, or withdrawn) must
                // not stay reachable through the old one, which would read
                // the new key's policy.
                if let Some(old) = next.entry(principal).and_then(|e| e.snapshot.key_hash)
                    && Some(old) != hash
                {
                    next.forget_key(&old, principal);
                }
                if let Some(hash) = hash
                    && next.principal_by_key(&hash) != Some(principal)
                {
                    next.keys_mut(&hash).insert(hash, principal);
                }
                next.entries_mut(principal).insert(principal, entry.clone());
            }
            next
        });
        stale
    }

    /// Drops the snapshots older than a revision already published or
    /// offered before them for their principal (I34), and returns how many.
    /// Called under the writer lock: the published map is the one the next
    /// is made from.
    fn drop_stale(&self, writer: &Writer, snapshots: &mut Vec<PrincipalSnapshot>) -> usize {
        let published = self.published.load();
        let mut newest: HashMap<Principal, PolicyRevision> = HashMap::new();
        let offered = snapshots.len();
        snapshots.retain(|snapshot| {
            let (principal, revision) = (snapshot.principal, snapshot.policy_revision);
            // The floor is the newest revision offered so far, else the one
            // published, else the one a principal remembered as unknown was
            // last published at: a lagging source that disowned it and
            // then catches up part way must not bring back an older policy.
            let seen = newest.get(&principal).copied().or_else(|| {
                published
                    .entry(principal)
                    .map(|held| held.snapshot.policy_revision)
                    .or_else(|| writer.unknown_members.get(&principal).copied().flatten())
            });
            if seen.is_some_and(|seen| revision < seen) {
                return false;
            }
            newest.insert(principal, revision);
            true
        });
        offered - snapshots.len()
    }

    /// Records that the source said at `learned_at` that it does not know
    /// these principals: their snapshots are withdrawn, and requests naming
    /// them are denied as unknown until the maximum staleness after
    /// `learned_at`, then looked up again (I24). Marking a principal again
    /// renews its record but keeps its place in the eviction order: past
    /// the negative capacity, the records first made are forgotten first. A record keeps the revision its principal was
    /// last published at, and a later publication of an older revision is
    /// dropped as stale (I34). Like [`publish`](Self::publish), for a map no
    /// running snapshot manager writes.
    pub fn mark_unknown(
        &self,
        principals: impl IntoIterator<Item = Principal>,
        learned_at: Timestamp,
    ) {
        let mut writer = self.lock_writer();
        let capacity = self.config.negative_capacity;
        let learned = saturated_nanos(learned_at);
        let published = self.published.load();
        let mut added = Vec::new();
        for principal in principals {
            writer.history.remove(&principal);
            let withdrawn = published
                .entry(principal)
                .map(|held| held.snapshot.policy_revision);
            // Once per principal, so eviction forgets the oldest record and
            // not a copy of a newer one.
            match writer.unknown_members.entry(principal) {
                std::collections::hash_map::Entry::Occupied(mut record) => {
                    let floor = (*record.get()).max(withdrawn);
                    record.insert(floor);
                }
                std::collections::hash_map::Entry::Vacant(record) => {
                    record.insert(withdrawn);
                    writer.unknown_order.push_back(principal);
                }
            }
            added.push(principal);
        }
        drop(published);
        let mut evicted = Vec::new();
        while writer.unknown_order.len() > capacity {
            if let Some(oldest) = writer.unknown_order.pop_front() {
                writer.unknown_members.remove(&oldest);
                evicted.push(oldest);
            }
        }
        self.publish_generation(|current| {
            let mut next = Published::clone(current);
            for principal in &added {
                // The hash leads elsewhere if another principal was
                // published with it since; that one keeps it.
                let withdrawn = next.entry(*principal).map(|entry| entry.snapshot.key_hash);
                if let Some(key_hash) = withdrawn {
                    next.entries_mut(*principal).remove(principal);
                    if let Some(hash) = key_hash {
                        next.forget_key(&hash, *principal);
                    }
                }
            }
            let unknown = Arc::make_mut(&mut next.unknown);
            for principal in &added {
                unknown.insert(*principal, learned);
            }
            for principal in &evicted {
                unknown.remove(principal);
            }
            next
        });
    }

    /// Records that the source confirmed every published snapshot current as
    /// of `now` (a complete refresh), which resets their staleness.
    pub fn mark_verified(&self, now: Timestamp) {
        self.verified_at
            .fetch_max(saturated_nanos(now), Ordering::AcqRel);
    }

    /// Moves the principals requests asked about into `out`.
    pub fn drain_lookups(&self, out: &mut Vec<Principal>) {
        while let Some(principal) = self.lookups.pop() {
            // Drained, so a request may queue it again: the lookup about to
            // run may miss what the source does after it.
            let (cell, tag) = self.queued_cell(principal);
            let _ = cell.compare_exchange(tag, 0, Ordering::AcqRel, Ordering::Relaxed);
            out.push(principal);
        }
    }

    /// The accounts bound to at least one published principal.
    #[must_use]
    pub fn bound_accounts(&self) -> HashSet<crate::model::AccountId> {
        self.published
            .load()
            .values()
            .map(|entry| entry.snapshot.account_id)
            .collect()
    }

    fn lock_writer(&self) -> MutexGuard<'_, Writer> {
        // Nothing under the lock panics but an allocation failure, which
        // aborts; a poisoned lock could only come from a bug, and failing
        // every later publish for it would stop policy updates for good.
        self.writer.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for ArcSwapSnapshotMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let published = self.published.load();
        f.debug_struct("ArcSwapSnapshotMap")
            .field("principals", &published.len())
            .field("unknown", &published.unknown.len())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use jiff::SignedDuration;

    use super::*;
    use crate::model::{
        AccountId, AccountStatus, EnforcementMode, KeyId, KeyStatus, LocalSharding, PermissionBits,
        PolicyRevision,
    };

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + second).expect("in range")
    }

    type BrokenCase = (
        fn(&mut SnapshotMapConfig),
        SnapshotMapConfigError,
        &'static str,
    );

    /// I17: every rule is named, in field order, with its message; the
    /// bounds refuse a configuration that would otherwise fail its
    /// allocation (the lookup queue is built up front) or let the negative
    /// cache and history grow without limit.
    #[test]
    fn validation_names_the_first_broken_rule() {
        use SnapshotMapConfigError as Broken;
        let valid = SnapshotMapConfig {
            max_staleness: SignedDuration::from_secs(30),
            negative_capacity: SnapshotMapConfig::MAX_NEGATIVE_CAPACITY,
            history_depth: SnapshotMapConfig::MAX_HISTORY_DEPTH,
            lookup_queue_capacity: SnapshotMapConfig::MAX_LOOKUP_QUEUE_CAPACITY,
        };
        assert_eq!(valid.validate(), Ok(()));
        let registry = || Arc::new(SlotRegistry::new(LocalSharding::Single));
        assert!(ArcSwapSnapshotMap::new(valid, registry()).is_ok());
        let cases: [BrokenCase; 7] = [
            (
                |c| c.max_staleness = SignedDuration::ZERO,
                Broken::MaxStalenessNotPositive,
                "snapshot map: max_staleness must be positive",
            ),
            (
                |c| c.negative_capacity = 0,
                Broken::NegativeCapacityZero,
                "snapshot map: negative_capacity must be at least 1",
            ),
            (
                |c| c.negative_capacity = SnapshotMapConfig::MAX_NEGATIVE_CAPACITY + 1,
                Broken::NegativeCapacityAboveMax,
                "snapshot map: negative_capacity must be at most 1048576",
            ),
            (
                |c| c.history_depth = 0,
                Broken::HistoryDepthZero,
                "snapshot map: history_depth must be at least 1",
            ),
            (
                |c| c.history_depth = SnapshotMapConfig::MAX_HISTORY_DEPTH + 1,
                Broken::HistoryDepthAboveMax,
                "snapshot map: history_depth must be at most 64",
            ),
            (
                |c| c.lookup_queue_capacity = 0,
                Broken::LookupQueueCapacityZero,
                "snapshot map: lookup_queue_capacity must be at least 1",
            ),
            (
                |c| c.lookup_queue_capacity = usize::MAX,
                Broken::LookupQueueCapacityAboveMax,
                "snapshot map: lookup_queue_capacity must be at most 1048576",
            ),
        ];
        for (break_it, broken, message) in cases {
            let mut config = valid;
            break_it(&mut config);
            assert_eq!(config.validate(), Err(broken));
            assert_eq!(broken.to_string(), message);
            // Refused before anything is allocated: no panic, no abort.
            assert_eq!(
                ArcSwapSnapshotMap::new(config, registry()).err(),
                Some(broken)
            );
        }
        // Field order: with every count hostile, the first field's rule.
        let hostile = SnapshotMapConfig {
            negative_capacity: usize::MAX,
            history_depth: usize::MAX,
            lookup_queue_capacity: usize::MAX,
            ..valid
        };
        assert_eq!(hostile.validate(), Err(Broken::NegativeCapacityAboveMax));
    }

    fn map(negative_capacity: usize, lookup_queue_capacity: usize) -> ArcSwapSnapshotMap {
        ArcSwapSnapshotMap::new(
            SnapshotMapConfig {
                max_staleness: SignedDuration::from_secs(30),
                negative_capacity,
                history_depth: 2,
                lookup_queue_capacity,
            },
            Arc::new(SlotRegistry::new(LocalSharding::Single)),
        )
        .expect("valid")
    }

    fn snapshot(principal: u64, key: &str, revision: u64) -> PrincipalSnapshot {
        PrincipalSnapshot {
            principal: Principal(principal),
            account_id: AccountId(1),
            key_id: Some(KeyId(principal)),
            key_hash: Some(KeyHash::of(key.as_bytes())),
            permissions: PermissionBits::ALL,
            key_status: KeyStatus::Active,
            account_status: AccountStatus::Active,
            mode: EnforcementMode::Strict,
            policy_revision: PolicyRevision(revision),
            fetched_at: at(0),
        }
    }

    /// I24: a reader judges staleness and unknown keys by the verification
    /// that stood when it pinned its generation, not one a refresh made
    /// after publishing what that generation lacks. Played in order on one
    /// thread: pin, then the refresh's publish and verify, then the reads.
    #[test]
    fn a_pinned_generation_is_judged_by_the_verification_pinned_with_it() {
        let map = map(4, 4);
        // Before the first refresh: a key the next refresh brings is not yet
        // unknown to a reader pinned before it.
        {
            let pinned = map.pin();
            map.publish([snapshot(1, "tg_new", 1)]);
            map.mark_verified(at(1));
            assert_eq!(
                pinned.entry_by_key(&KeyHash::of(b"tg_new"), at(1)).err(),
                Some(DenyReason::SnapshotUnavailable),
                "the pinned generation predates the key and its verification"
            );
        }
        assert_eq!(
            map.pin()
                .entry_by_key(&KeyHash::of(b"tg_other"), at(1))
                .err(),
            Some(DenyReason::UnknownPrincipal),
            "a fresh pin sees the verification"
        );
        // A stale map: a reader pinned before the refresh that replaces the
        // stale snapshot does not have it freshened by that refresh.
        let late = at(100);
        let pinned = map.pin();
        map.publish([PrincipalSnapshot {
            key_status: KeyStatus::Revoked,
            fetched_at: late,
            ..snapshot(1, "tg_new", 2)
        }]);
        map.mark_verified(late);
        let stale = pinned
            .entry(Principal(1), late)
            .expect("pinned before the refresh");
        assert_eq!(stale.snapshot.policy_revision.get(), 1);
        assert_eq!(
            pinned.check_fresh(stale, late),
            Err(DenyReason::SnapshotStale)
        );
        drop(pinned);
        let current = map.pin();
        let entry = current.entry(Principal(1), late).expect("published");
        assert_eq!(entry.snapshot.policy_revision.get(), 2);
        assert_eq!(current.check_fresh(entry, late), Ok(()));
    }

    /// I24: an instant before 1677, beyond the nanosecond counter, reads
    /// as never verified, not as verified for ever.
    #[test]
    fn a_verification_before_the_counter_s_range_vouches_for_nothing() {
        let map = map(4, 4);
        map.publish([snapshot(1, "tg_one", 1)]);
        let ancient = Timestamp::from_second(-10_000_000_000).expect("in range");
        map.mark_verified(ancient);
        let pinned = map.pin();
        assert_eq!(
            pinned.entry_by_key(&KeyHash::of(b"tg_none"), at(0)).err(),
            Some(DenyReason::SnapshotUnavailable)
        );
        let entry = pinned.entry(Principal(1), at(1)).expect("published");
        assert_eq!(
            pinned.check_fresh(entry, at(3_600)),
            Err(DenyReason::SnapshotStale)
        );
    }

    /// I34: a stale read dropped by publication leaves nothing behind, not
    /// even a slot for the account it names.
    #[test]
    fn a_dropped_stale_read_creates_no_slot_for_its_account() {
        let map = map(4, 4);
        map.publish([snapshot(1, "tg_one", 5)]);
        let lagging = PrincipalSnapshot {
            account_id: AccountId(7),
            ..snapshot(1, "tg_one", 4)
        };
        assert_eq!(map.publish([lagging]), 1, "dropped");
        assert_eq!(map.registry().accounts(), vec![AccountId(1)]);
        assert_eq!(entry(&map, 1), Ok(5));
    }

    /// I24: history is of revisions; reading the current one again (as a
    /// fixed list's every refresh does) does not push the older ones out.
    #[test]
    fn history_does_not_repeat_a_revision_read_again() {
        let map = map(4, 4);
        map.publish([snapshot(1, "tg_one", 5)]);
        map.publish([snapshot(1, "tg_one", 6)]);
        map.publish([PrincipalSnapshot {
            fetched_at: at(10),
            ..snapshot(1, "tg_one", 6)
        }]);
        let kept: Vec<(u64, Timestamp)> = map
            .history(Principal(1))
            .iter()
            .map(|snapshot| (snapshot.policy_revision.get(), snapshot.fetched_at))
            .collect();
        assert_eq!(kept, vec![(6, at(10)), (5, at(0))]);
    }

    fn entry(map: &ArcSwapSnapshotMap, principal: u64) -> Result<u64, DenyReason> {
        let pinned = map.pin();
        pinned
            .entry(Principal(principal), at(1))
            .map(|entry| entry.snapshot.policy_revision.get())
    }

    /// I24: the negative cache keeps the most recent records up to its
    /// capacity, forgetting the oldest first, and a principal published
    /// later stops being unknown.
    #[test]
    fn the_negative_cache_forgets_its_oldest_records_past_its_capacity() {
        let map = map(2, 8);
        map.mark_unknown([Principal(1), Principal(2), Principal(3)], at(0));
        assert!(!map.is_known_unknown(Principal(1)), "the oldest went");
        assert!(map.is_known_unknown(Principal(2)) && map.is_known_unknown(Principal(3)));
        map.mark_verified(at(0));
        assert_eq!(entry(&map, 3), Err(DenyReason::UnknownPrincipal));
        map.publish([snapshot(3, "tg_three", 1)]);
        assert!(!map.is_known_unknown(Principal(3)));
        assert_eq!(entry(&map, 3), Ok(1));
    }

    /// I34: a principal the source disowned keeps the revision it was last
    /// published at. A lagging source that disowned it and then catches up
    /// part way cannot bring back an older policy, such as an active key
    /// that was since revoked.
    #[test]
    fn a_disowned_principal_cannot_come_back_at_an_older_revision() {
        let map = map(2, 8);
        map.publish([snapshot(1, "tg_one", 5)]);
        map.mark_unknown([Principal(1)], at(0));
        assert_eq!(
            map.publish([snapshot(1, "tg_one", 3)]),
            1,
            "dropped as stale"
        );
        assert_eq!(entry(&map, 1), Err(DenyReason::UnknownPrincipal));
        // Marked again, it keeps the floor.
        map.mark_unknown([Principal(1)], at(1));
        assert_eq!(map.publish([snapshot(1, "tg_one", 4)]), 1);
        assert_eq!(map.publish([snapshot(1, "tg_one", 5)]), 0);
        assert_eq!(entry(&map, 1), Ok(5));
        assert!(!map.is_known_unknown(Principal(1)));
    }

    /// A principal published again leaves the negative cache's order too,
    /// and one marked twice holds one place: eviction still takes the
    /// oldest remaining record.
    #[test]
    fn the_negative_cache_order_follows_publication_and_repeats() {
        let map = map(2, 8);
        map.mark_unknown([Principal(1), Principal(2)], at(0));
        map.publish([snapshot(2, "tg_two", 1)]);
        map.mark_unknown([Principal(3)], at(0));
        map.mark_unknown([Principal(1)], at(0));
        map.mark_unknown([Principal(4)], at(0));
        let unknown: Vec<bool> = (1..=4)
            .map(|p| map.is_known_unknown(Principal(p)))
            .collect();
        assert_eq!(unknown, [false, false, true, true], "1 was the oldest");
        assert_eq!(entry(&map, 2), Ok(1));
        // 2, withdrawn after its publication, is the newest record again.
        map.mark_unknown([Principal(2)], at(0));
        let unknown: Vec<bool> = (1..=4)
            .map(|p| map.is_known_unknown(Principal(p)))
            .collect();
        assert_eq!(unknown, [false, true, false, true], "3 was the oldest");
    }

    /// A principal nobody has published is queued for the snapshot manager
    /// to look up, at most the queue's capacity at a time; the requests
    /// past it are refused all the same.
    #[test]
    fn lookups_of_missing_principals_are_queued_up_to_the_capacity() {
        let map = map(2, 2);
        for principal in 10..15 {
            assert_eq!(entry(&map, principal), Err(DenyReason::SnapshotUnavailable));
        }
        let mut asked = Vec::new();
        map.drain_lookups(&mut asked);
        assert_eq!(asked, vec![Principal(10), Principal(11)]);
    }

    /// A principal asked for again before the snapshot manager drains the
    /// queue is queued once, so a hot one leaves room for the others; once
    /// drained, it is queued again when asked for.
    #[test]
    fn a_principal_asked_for_again_is_queued_once_until_drained() {
        let map = map(2, 2);
        for principal in [10, 10, 10, 11, 10] {
            assert_eq!(entry(&map, principal), Err(DenyReason::SnapshotUnavailable));
        }
        let mut asked = Vec::new();
        map.drain_lookups(&mut asked);
        assert_eq!(asked, vec![Principal(10), Principal(11)]);
        asked.clear();
        assert_eq!(entry(&map, 10), Err(DenyReason::SnapshotUnavailable));
        map.drain_lookups(&mut asked);
        assert_eq!(asked, vec![Principal(10)], "queued again once drained");
    }

    /// A principal the full queue refused is not marked as queued: asked
    /// for once there is room, it is queued.
    #[test]
    fn a_principal_refused_by_a_full_queue_is_queued_when_there_is_room() {
        let map = map(2, 2);
        for principal in [10, 11, 12] {
            assert_eq!(entry(&map, principal), Err(DenyReason::SnapshotUnavailable));
        }
        let mut asked = Vec::new();
        map.drain_lookups(&mut asked);
        assert_eq!(asked, vec![Principal(10), Principal(11)]);
        asked.clear();
        assert_eq!(entry(&map, 12), Err(DenyReason::SnapshotUnavailable));
        map.drain_lookups(&mut asked);
        assert_eq!(asked, vec![Principal(12)]);
    }

    /// The largest principal, whose mark would read as no mark, is queued
    /// all the same.
    #[test]
    fn the_largest_principal_is_queued_for_lookup() {
        let map = map(2, 2);
        assert_eq!(entry(&map, u64::MAX), Err(DenyReason::SnapshotUnavailable));
        let mut asked = Vec::new();
        map.drain_lookups(&mut asked);
        assert_eq!(asked, vec![Principal(u64::MAX)]);
    }

    /// I24: history keeps the newest snapshots, up to its depth.
    #[test]
    fn history_keeps_the_newest_snapshots_up_to_its_depth() {
        let map = map(2, 8);
        for revision in 1..=3 {
            map.publish([snapshot(1, "tg_one", revision)]);
        }
        let kept: Vec<u64> = map
            .history(Principal(1))
            .iter()
            .map(|snapshot| snapshot.policy_revision.get())
            .collect();
        assert_eq!(kept, vec![3, 2], "newest first, two deep");
    }

    /// A publication copies only the shards it changes: one changed
    /// principal shares every other shard of both indexes with the
    /// generation before it, and every principal stays reachable.
    #[test]
    fn a_publication_copies_only_the_shards_it_changes() {
        let map = map(2, 8);
        map.publish((1..=1_000).map(|p| snapshot(p, &format!("tg_{p}"), 1)));
        let before = map.published.load_full();
        map.publish([snapshot(7, "tg_7", 2)]);
        let after = map.published.load_full();
        let shared = |a: &[Arc<EntryShard>], b: &[Arc<EntryShard>]| {
            a.iter().zip(b).filter(|(a, b)| Arc::ptr_eq(a, b)).count()
        };
        assert_eq!(shared(&before.entries, &after.entries), SHARDS - 1);
        let shared_keys = before
            .by_key
            .iter()
            .zip(&after.by_key)
            .filter(|(a, b)| Arc::ptr_eq(a, b))
            .count();
        assert_eq!(shared_keys, SHARDS, "the same key: its index is unchanged");
        assert!(Arc::ptr_eq(&before.unknown, &after.unknown));
        assert_eq!(after.len(), 1_000);
        assert!(
            before.entries.iter().all(|shard| !shard.is_empty()),
            "a thousand principals reach every shard"
        );
        for p in [1, 7, 500, 1_000] {
            let expected = if p == 7 { 2 } else { 1 };
            assert_eq!(entry(&map, p), Ok(expected));
            assert_eq!(
                map.principal_for_key(&KeyHash::of(format!("tg_{p}").as_bytes())),
                Some(Principal(p))
            );
        }
    }

    /// A generation read for many snapshots keeps answering from that
    /// generation; a later publication is seen by the next one.
    #[test]
    fn a_generation_read_for_many_snapshots_answers_as_of_its_load() {
        let map = map(2, 8);
        map.publish([snapshot(1, "tg_one", 1), snapshot(2, "tg_two", 1)]);
        let first = map.snapshots();
        map.publish([snapshot(1, "tg_one", 2)]);
        map.mark_unknown([Principal(2)], at(0));
        let revision = |s: &Snapshots, p: u64| s.get(Principal(p)).map(|s| s.policy_revision.get());
        assert_eq!(
            (revision(&first, 1), revision(&first, 2)),
            (Some(1), Some(1))
        );
        let second = map.snapshots();
        assert_eq!(
            (revision(&second, 1), revision(&second, 2)),
            (Some(2), None)
        );
    }

    /// I34: a stale read of an older revision, published after a newer
    /// one, does not bring back the key the newer one revoked, whether it
    /// comes in a later publication or later in the same one. The same
    /// revision read again renews the snapshot's freshness.
    #[test]
    fn an_older_revision_never_replaces_a_newer_one() {
        let map = map(2, 8);
        let revoked = PrincipalSnapshot {
            key_status: KeyStatus::Revoked,
            ..snapshot(1, "tg_one", 6)
        };
        map.publish([revoked]);
        map.publish([snapshot(1, "tg_one", 5)]);
        assert_eq!(entry(&map, 1), Ok(6));
        assert_eq!(
            map.get(Principal(1)).map(|s| s.key_status),
            Some(KeyStatus::Revoked)
        );

        // Within one publication: the older after the newer is dropped, the
        // newer after the older replaces it, and history keeps what stood.
        map.publish([
            snapshot(2, "tg_two", 3),
            snapshot(2, "tg_two", 4),
            snapshot(2, "tg_two", 1),
        ]);
        assert_eq!(entry(&map, 2), Ok(4));
        let kept: Vec<u64> = map
            .history(Principal(2))
            .iter()
            .map(|snapshot| snapshot.policy_revision.get())
            .collect();
        assert_eq!(kept, vec![4, 3]);

        let renewed = PrincipalSnapshot {
            fetched_at: at(25),
            ..revoked
        };
        map.publish([renewed]);
        let pinned = map.pin();
        let entry = pinned.entry(Principal(1), at(1)).expect("published");
        assert_eq!(
            pinned.check_fresh(entry, at(40)),
            Ok(()),
            "fresh for 30 s from the re-read at 25 s"
        );
    }

    /// Withdrawing a principal withdraws its key's hash only while the hash
    /// still leads to it: a principal published with that hash since keeps
    /// it.
    #[test]
    fn withdrawing_a_principal_leaves_a_hash_another_now_holds() {
        let map = map(2, 8);
        map.publish([snapshot(1, "tg_shared", 1)]);
        map.publish([snapshot(2, "tg_shared", 2)]);
        map.mark_unknown([Principal(1)], at(0));
        assert_eq!(
            map.principal_for_key(&KeyHash::of(b"tg_shared")),
            Some(Principal(2))
        );
    }

    /// A rotated key reaches its principal only by its new hash; a key
    /// withdrawn by `mark_unknown` reaches nobody.
    #[test]
    fn a_rotated_or_withdrawn_key_no_longer_resolves() {
        let map = map(2, 8);
        map.publish([snapshot(1, "tg_old", 1)]);
        map.publish([snapshot(1, "tg_new", 2)]);
        assert_eq!(map.principal_for_key(&KeyHash::of(b"tg_old")), None);
        assert_eq!(
            map.principal_for_key(&KeyHash::of(b"tg_new")),
            Some(Principal(1))
        );
        map.mark_unknown([Principal(1)], at(0));
        assert_eq!(map.principal_for_key(&KeyHash::of(b"tg_new")), None);
        assert!(map.history(Principal(1)).is_empty());
    }
}
