//! The staged admission engine and the context an admitted request carries.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use jiff::Timestamp;

use crate::admission::snapshot_map::{Entry, Pinned};
use crate::admission::{ArcSwapSnapshotMap, LeaseSlot, RequestIds, UsagePermit, UsageRecorder};
use crate::model::{
    AccountId, AccountOverage, AccountStatus, BalanceShortfall, CachePadded, CommitError,
    CommitFunding, CostUnits, DenyReason, KeyHash, KeyId, KeyStatus, LeaseId, LocalLease,
    LocalSharding, Locality, PermissionBits, PolicyRevision, Principal, PrincipalSnapshot,
    RequestId, Reservation, Retry, ViewMiss,
};

/// Admits requests: policy, permissions, funding and a usage place, with no
/// I/O, no lock and no allocation (I5).
pub struct AdmissionEngine {
    snapshots: Arc<ArcSwapSnapshotMap>,
    recorder: UsageRecorder,
    ids: RequestIds,
    counters: AdmissionCounters,
}

/// One admitted request: its pinned policy, its pending charge, its place in
/// the usage queue and its id.
///
/// [`commit`](Self::commit) when the handler starts. Dropping the context
/// before that releases the charge for zero and gives the queue place back
/// (I4, I20).
pub struct RequestContext {
    // Kept small (120 bytes): the context is moved into the caller's result
    // and on into its future, and every byte is copied at each move.
    /// The charge. Once committed, the hold of the lease that funded it
    /// travels with its usage event (see [`UsagePermit`]), and what stays
    /// here only remembers the commit.
    reservation: Reservation,
    /// The place reserved at admission; empty once its event is recorded.
    /// Not an `Option`: the permit has its own empty state, and a second
    /// one would add a word.
    permit: UsagePermit,
    /// The overage cap of an Elastic account, whose commit may fall back
    /// to overage; meaningful when `flags` has [`ELASTIC`].
    overage_cap: CostUnits,
    /// The account's overage counter, held only for an Elastic charge that
    /// cannot reach it through its own funding (see
    /// [`LocalLease::with_overage`]): the counter is shared by every
    /// request of the account, so its reference count is left alone when
    /// it can be.
    overage: Option<Arc<AccountOverage>>,
    account_id: AccountId,
    /// The request id's prefix and counter halves: two words rather than a
    /// `u128`, whose alignment would pad the context.
    request_id: (u64, u64),
    // What the request needs of its pinned snapshot, copied at admission so
    // every later decision uses the generation admission read.
    principal: Principal,
    policy_revision: PolicyRevision,
    /// The key's id, meaningful when `flags` has [`HAS_KEY`].
    key_id: KeyId,
    flags: u8,
}

/// [`RequestContext::flags`]: the principal has a key.
const HAS_KEY: u8 = 1;
/// [`RequestContext::flags`]: admission funded the request from overage.
const ADMITTED_AS_OVERAGE: u8 = 2;
/// [`RequestContext::flags`]: the account is Elastic.
const ELASTIC: u8 = 4;

impl AdmissionEngine {
    /// An engine reading policy from `snapshots`, queueing usage through
    /// `recorder`, and minting ids from `ids`.
    #[must_use]
    pub fn new(
        snapshots: Arc<ArcSwapSnapshotMap>,
        recorder: UsageRecorder,
        ids: RequestIds,
    ) -> Self {
        Self {
            snapshots,
            recorder,
            ids,
            counters: AdmissionCounters::new(),
        }
    }

    /// Decides whether `principal` may spend `quote` on a route requiring
    /// `required`, and if so reserves it.
    ///
    /// The checks run in a fixed order (I23): snapshot, staleness, key and
    /// account status, permissions, funding, usage place. `now` is the
    /// caller's: reading the system clock here would cost as much as the
    /// rest of admission.
    ///
    /// # Errors
    ///
    /// The first check that fails, as a [`DenyReason`].
    #[inline]
    pub fn begin(
        &self,
        principal: Principal,
        required: PermissionBits,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<RequestContext, DenyReason> {
        // The admission is the tail, built where the caller receives it; the
        // pin is given back after.
        let pinned = self.snapshots.pin();
        self.admit::<true>(&pinned, pinned.entry(principal, now), required, quote, now)
    }

    /// [`begin`](Self::begin) for the principal whose API key hashes to
    /// `key`: how the HTTP layer admits, one lookup for both the key and the
    /// policy.
    ///
    /// # Errors
    ///
    /// For a key no published principal has,
    /// [`DenyReason::UnknownPrincipal`] while the map can vouch for its keys
    /// and [`DenyReason::SnapshotUnavailable`] before its first complete
    /// refresh or once it is stale (I24); then as [`begin`](Self::begin).
    #[inline]
    pub fn begin_by_key(
        &self,
        key: &KeyHash,
        required: PermissionBits,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<RequestContext, DenyReason> {
        let pinned = self.snapshots.pin();
        self.admit::<true>(&pinned, pinned.entry_by_key(key, now), required, quote, now)
    }

    /// [`begin_by_key`](Self::begin_by_key) that leaves a denial uncounted,
    /// for a caller that may try again and counts only the last answer: the
    /// HTTP layer waiting out a lease shortage.
    pub(crate) fn begin_by_key_uncounted(
        &self,
        key: &KeyHash,
        required: PermissionBits,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<RequestContext, DenyReason> {
        let pinned = self.snapshots.pin();
        self.admit::<false>(&pinned, pinned.entry_by_key(key, now), required, quote, now)
    }

    /// The lease slot of the account whose principal holds the key hashing
    /// to `key`, if the map has it.
    pub(crate) fn slot_by_key(&self, key: &KeyHash, now: Timestamp) -> Option<Arc<LeaseSlot>> {
        let pinned = self.snapshots.pin();
        pinned
            .entry_by_key(key, now)
            .ok()
            .map(|entry| Arc::clone(&entry.slot))
    }

    /// The admission counters.
    #[must_use]
    pub fn counters(&self) -> &AdmissionCounters {
        &self.counters
    }

    /// The snapshot map admission reads.
    #[must_use]
    pub fn snapshots(&self) -> &Arc<ArcSwapSnapshotMap> {
        &self.snapshots
    }

    /// The usage recorder admission takes places from.
    #[must_use]
    pub fn recorder(&self) -> &UsageRecorder {
        &self.recorder
    }

    #[allow(
        clippy::inline_always,
        reason = "inlined so the admitted context is built in place, not copied out of a call"
    )]
    #[inline(always)]
    fn admit<const COUNT_DENIALS: bool>(
        &self,
        pinned: &Pinned<'_>,
        entry: Result<&Entry, DenyReason>,
        required: PermissionBits,
        quote: CostUnits,
        now: Timestamp,
    ) -> Result<RequestContext, DenyReason> {
        // The caller's thread's locality, read once for the lease shard, the
        // usage stripe and the counter stripe.
        let locality = Locality::current();
        // Each refusal is counted where it is decided, and the admitted
        // context is counted before it is built, so it is written once,
        // straight into the caller's result.
        let entry = match entry {
            Ok(entry) => entry,
            Err(reason) => return Err(self.deny::<COUNT_DENIALS>(locality, reason)),
        };
        // Read in place; what the request keeps of the snapshot is copied
        // into its context, so the snapshot's reference count is not
        // touched.
        let snapshot = &*entry.snapshot;
        if let Err(reason) = Self::check_policy(pinned, entry, required, now) {
            return Err(self.deny::<COUNT_DENIALS>(locality, reason));
        }
        let reservation = match fund(&entry.slot, snapshot, quote, now, locality) {
            Ok(reservation) => reservation,
            Err(reason) => return Err(self.deny::<COUNT_DENIALS>(locality, reason)),
        };
        // A refused place drops the reservation, which releases it (I4).
        let permit = match self.recorder.try_permit_at(locality) {
            Ok(permit) => permit,
            Err(reason) => return Err(self.deny::<COUNT_DENIALS>(locality, reason)),
        };
        // A free request funded by the overage counter spent no overage.
        let admitted_as_overage = reservation.admitted_as_overage() && !quote.is_zero();
        self.counters.admitted(locality, admitted_as_overage);
        let mut flags = 0;
        if admitted_as_overage {
            flags |= ADMITTED_AS_OVERAGE;
        }
        let (overage_cap, overage) = match snapshot.mode.overage_cap() {
            Some(cap) => {
                flags |= ELASTIC;
                let counter = entry.slot.overage();
                (
                    cap,
                    (!reservation.reaches_overage(counter)).then(|| Arc::clone(counter)),
                )
            }
            None => (CostUnits::ZERO, None),
        };
        if snapshot.key_id.is_some() {
            flags |= HAS_KEY;
        }
        Ok(RequestContext {
            account_id: reservation.account_id(),
            reservation,
            permit,
            request_id: self.ids.next_parts(),
            overage_cap,
            overage,
            principal: snapshot.principal,
            key_id: snapshot.key_id.unwrap_or(KeyId(0)),
            policy_revision: snapshot.policy_revision,
            flags,
        })
    }

    /// A denial decided in admission, counted unless the caller counts it.
    #[inline]
    fn deny<const COUNT: bool>(&self, locality: Locality, reason: DenyReason) -> DenyReason {
        if COUNT {
            self.counters.denied_at(locality, reason)
        } else {
            reason
        }
    }

    /// The policy checks, in their fixed order (I23): staleness, key and
    /// account status, permissions. Funding and the usage place follow.
    #[allow(clippy::inline_always, reason = "part of the inlined admission")]
    #[inline(always)]
    fn check_policy(
        pinned: &Pinned<'_>,
        entry: &Entry,
        required: PermissionBits,
        now: Timestamp,
    ) -> Result<(), DenyReason> {
        let snapshot = &*entry.snapshot;
        pinned.check_fresh(entry, now)?;
        if snapshot.key_status == KeyStatus::Revoked {
            return Err(DenyReason::KeyRevoked);
        }
        if snapshot.account_status == AccountStatus::Suspended {
            return Err(DenyReason::AccountInactive);
        }
        if !snapshot.permissions.contains(required) {
            return Err(DenyReason::PermissionDenied {
                missing: snapshot.permissions.missing(required),
            });
        }
        Ok(())
    }
}

/// Reserves `quote` for the account of `snapshot`: from the lease if it can,
/// else from overage if the account is Elastic, else a denial that tells the
/// truth about the account's funds (I23).
#[inline]
fn fund(
    slot: &LeaseSlot,
    snapshot: &PrincipalSnapshot,
    quote: CostUnits,
    now: Timestamp,
    locality: Locality,
) -> Result<Reservation, DenyReason> {
    // First through the thread's cached view of the lease, which skips
    // the slot's guard; a lease out of the slot refuses it (I26).
    let miss = match slot.debit_cached(quote, now) {
        Ok(debit) => return Ok(Reservation::leased(debit, quote)),
        Err(miss) => miss,
    };
    let leased = slot.with_lease(|lease| {
        if miss == ViewMiss::Stale {
            slot.recache(lease, locality);
        }
        match lease {
            Some(lease) => Reservation::reserve_unrecorded(lease, quote, now, locality)
                .map_err(|refusal| refused(slot, lease, refusal, quote, now)),
            None => Err(Refusal {
                reason: DenyReason::LeaseUnavailable,
                held: CostUnits::ZERO,
                serving: None,
                evidence: Evidence::Unread,
            }),
        }
    });
    let refusal = match leased {
        Ok(reservation) => return Ok(reservation),
        Err(refusal) => refusal,
    };
    // A quote of nothing spends nothing, so it is admitted whatever the
    // lease, the allocator or the balance says (I9). A lease that serves
    // takes it (its event touches only that lease's row in the store);
    // without one, the overage counter funds it: a debit of zero units
    // changes nothing under any cap, and its event records zero units of
    // overage. (A leased one whose window closes before its handler starts
    // commits all the same, as zero units of overage.)
    if quote.is_zero() {
        return Reservation::reserve_overage(slot.overage(), quote, CostUnits::MAX);
    }
    // A slot left empty because its last lease lapsed unused (I28) has its
    // account's units back in the balance: its manager acquires now, and
    // the request is answered transiently meanwhile, neither funded from
    // overage nor refused on what this instance last knew of the balance.
    if refusal.serving.is_none() && slot.ask_for_lease() {
        return Err(DenyReason::LeaseUnavailable);
    }
    // The allocator's evidence, read once: where the refusal's record was
    // decided on it, that reading; otherwise read now, and only when the
    // answer depends on it.
    let shortfall = || match refusal.evidence {
        Evidence::Read(shortfall) => shortfall,
        Evidence::Unread => shortfall_denial(slot, quote, refusal.held, refusal.serving, now),
    };
    if let Some(cap) = snapshot.mode.overage_cap() {
        return match Reservation::reserve_overage(slot.overage(), quote, cap) {
            // With the cap spent, the balance decides what a retry meets
            // (I12, I23). A lease refusal the allocator's evidence does not
            // back is transient: the refill task folds or replaces the
            // lease. A quote the evidence rules out waits for the period's
            // refill, if one is due, and says when; without one, the spent
            // cap is final.
            Err(spent @ DenyReason::OverageCapExhausted { .. }) => Err(match shortfall() {
                Some(refill) if matches!(refill.retry(), Retry::At(_)) => refill,
                Some(_) => spent,
                None => unreachable_denial(slot, refusal.reason),
            }),
            funded_or_refused => funded_or_refused,
        };
    }
    Err(shortfall().unwrap_or_else(|| unreachable_denial(slot, refusal.reason)))
}

/// Why the lease did not fund a quote.
struct Refusal {
    reason: DenyReason,
    /// The units the lease held when it refused.
    held: CostUnits,
    /// The lease that refused, if any.
    serving: Option<LeaseId>,
    evidence: Evidence,
}

/// Whether the allocator's evidence was read to decide whether to record
/// a refusal, and if so the exhaustion denial it gives for the quote.
enum Evidence {
    Unread,
    Read(Option<DenyReason>),
}

/// A lease's refusal of `quote`.
///
/// A refusal for want of units that the allocator's evidence does not rule
/// out is recorded on the lease, so the refill task folds it into one that
/// funds the quote (I7, I27). One the evidence rules out is not: chasing it
/// would be refused, and its record would hide a smaller, fundable quote
/// refused after it. It is noted apart instead, for the refill task to check
/// with the store at its next poll, since the evidence may predate a top-up
/// (I28). The evidence read to decide is kept, so the answer agrees with
/// the record.
#[cold]
fn refused(
    slot: &LeaseSlot,
    lease: &LocalLease,
    reason: DenyReason,
    quote: CostUnits,
    now: Timestamp,
) -> Refusal {
    let held = lease.remaining();
    let serving = Some(lease.grant().lease_id);
    let evidence = match reason {
        DenyReason::LeaseExhausted => {
            let settled = lease.settled_remaining();
            let reading = settled.unwrap_or(held);
            // Recorded for a fold unless the instance's estimate rules it
            // out, settled or not, as the lease manager decides whether to
            // keep a record: a record it forgets at once would only ring
            // again at the next refusal.
            // One reading of the evidence decides both, so the answer
            // agrees with the record.
            let shown = slot.funding_beside(serving, now);
            if ruled_out(shown.map(|(estimate, _)| estimate), quote, reading).is_none() {
                lease.note_refused(quote);
            } else {
                // Not chased, but the evidence may be out of date: the
                // refill task checks it with the store at its next poll.
                lease.note_ruled_out(quote);
            }
            // Answered as final only on settled evidence and a reading that
            // missed no units moving between the lease's shards.
            let evidence = shown
                .filter(|&(_, settled_evidence)| settled_evidence && settled.is_some())
                .map(|(evidence, _)| evidence);
            Evidence::Read(ruled_out(evidence, quote, reading))
        }
        // A lease whose window has closed still has requests that will give
        // their units back to it (a pending charge cannot commit on it any
        // more), which no reading counts yet: no final answer until the
        // lease manager retires it and counts what it holds.
        DenyReason::LeaseExpired => Evidence::Read(None),
        _ => Evidence::Unread,
    };
    Refusal {
        reason,
        held,
        serving,
        evidence,
    }
}

/// A lease that cannot fund the quote while the allocator cannot be
/// reached will not be restocked soon: that is the instance failing closed
/// (`LeaseUnavailable`, answered 503), not a momentary shortage (I5).
#[cold]
fn unreachable_denial(slot: &LeaseSlot, refusal: DenyReason) -> DenyReason {
    match refusal {
        DenyReason::LeaseExhausted | DenyReason::LeaseExpired if slot.allocator_unreachable() => {
            DenyReason::LeaseUnavailable
        }
        other => other,
    }
}

/// The exhaustion denial for a quote the allocator's evidence rules out:
/// more than the lease still holds plus what the account has left to grant.
#[cold]
fn shortfall_denial(
    slot: &LeaseSlot,
    quote: CostUnits,
    held: CostUnits,
    serving: Option<LeaseId>,
    now: Timestamp,
) -> Option<DenyReason> {
    ruled_out(slot.funding_evidence_beside(serving, now), quote, held)
}

/// The exhaustion denial `evidence` gives `quote`, beside a lease that
/// holds `held`: `None` when there is no evidence, or the two together
/// could fund it.
fn ruled_out(
    evidence: Option<BalanceShortfall>,
    quote: CostUnits,
    held: CostUnits,
) -> Option<DenyReason> {
    let evidence = evidence?;
    let fundable = BalanceShortfall {
        remaining: evidence
            .remaining
            .checked_add(held)
            .unwrap_or(CostUnits::MAX),
        period_end: evidence.period_end,
    };
    fundable.rules_out(quote).then(|| fundable.deny())
}

impl RequestContext {
    /// Commits the charge because the handler is starting, and hands the
    /// usage event to the queue place reserved at admission (I20).
    ///
    /// # Errors
    ///
    /// See [`CommitError`]; on any error the handler must not run. After
    /// [`CommitError::AlreadyCommitted`] the first commit's charge stands;
    /// after any other error the charge is zero. Once the instance's
    /// shutdown has begun (or its usage writer has given up), every commit
    /// is refused with [`DenyReason::ShuttingDown`] (I21, I25).
    #[inline]
    pub fn commit(&mut self, now: Timestamp) -> Result<CostUnits, CommitError> {
        // I21: with nothing left to deliver its event, the handler must not
        // run; I25: nor once the instance's shutdown began, which may cut it
        // off after charging. The charge is released now, as `Denied` says.
        if self.permit.refuses_commits() {
            return Err(self.deny_for_stopped());
        }
        // Elastic: a lease whose window has closed falls back to the
        // account's overage, reached through the lease when it carries the
        // counter. The clone is taken only then, at a window's edge.
        let lapsed;
        let funding = match (self.flags & ELASTIC != 0, &self.overage) {
            (false, _) => CommitFunding::LeaseOnly,
            (true, Some(overage)) => CommitFunding::OverageFallback {
                overage,
                cap: self.overage_cap,
            },
            (true, None) => {
                lapsed = self.reservation.lapsed_fallback(now).cloned();
                match &lapsed {
                    Some(overage) => CommitFunding::OverageFallback {
                        overage,
                        cap: self.overage_cap,
                    },
                    // Inside the window, or funded from overage: the commit
                    // needs no fallback.
                    None => CommitFunding::LeaseOnly,
                }
            }
        };
        // A second commit is refused by the reservation, committed and
        // handed on (I3).
        let units = self.reservation.commit_owned(now, funding)?;
        // I8: one committed charge, one event, in the place reserved at
        // admission (I20). I26: the committed charge's hold rides with its
        // event, keeping the lease that funded it from being released
        // before the event is written.
        let (request_id, key_id) = (self.request_id(), self.key_id());
        match self.permit.take_place() {
            Some(permit) => permit.record_committed(
                &mut self.reservation,
                request_id,
                now,
                self.policy_revision,
                key_id,
            ),
            None => debug_assert!(false, "I8: a first successful commit has a place"),
        }
        Ok(units)
    }

    /// The commit's answer once the instance stopped starting handlers or
    /// its usage writer gave up: the charge is released for zero, or, if it
    /// was resolved already, says how.
    #[cold]
    fn deny_for_stopped(&self) -> CommitError {
        if self.reservation.is_committed() {
            return CommitError::AlreadyCommitted;
        }
        if self.reservation.is_released() {
            return CommitError::AlreadyReleased;
        }
        // Exclusive access: nothing else can resolve it in between.
        let _ = self.reservation.cancel();
        CommitError::Denied(DenyReason::ShuttingDown)
    }

    /// Stamps usage events with the pricing policy's revision instead of the
    /// snapshot's. At most [`PolicyRevision::MAX`]: the stores reject an
    /// event stamped with a larger one as malformed.
    pub fn set_policy_revision(&mut self, revision: PolicyRevision) {
        self.policy_revision = revision;
    }

    /// The units this request is charged if it commits.
    #[must_use]
    pub fn units(&self) -> CostUnits {
        self.reservation.units()
    }

    /// The account charged.
    #[must_use]
    pub fn account_id(&self) -> AccountId {
        self.account_id
    }

    /// The principal that made the request.
    #[must_use]
    pub fn principal(&self) -> Principal {
        self.principal
    }

    /// The key that made the request, if the principal has one.
    #[must_use]
    pub fn key_id(&self) -> Option<KeyId> {
        (self.flags & HAS_KEY != 0).then_some(self.key_id)
    }

    /// The revision stamped on this request's usage event.
    #[must_use]
    pub fn policy_revision(&self) -> PolicyRevision {
        self.policy_revision
    }

    /// The request's id: its usage event's idempotency key.
    #[must_use]
    pub fn request_id(&self) -> RequestId {
        RequestId::from_parts(self.request_id.0, self.request_id.1)
    }

    /// Whether admission funded the request from overage.
    #[must_use]
    pub fn admitted_as_overage(&self) -> bool {
        self.flags & ADMITTED_AS_OVERAGE != 0
    }

    /// Whether the charge has been committed.
    #[must_use]
    pub fn is_committed(&self) -> bool {
        self.reservation.is_committed()
    }
}

impl fmt::Debug for RequestContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestContext")
            .field("request_id", &self.request_id())
            .field("principal", &self.principal)
            .field("account", &self.account_id())
            .field("units", &self.units())
            .field("committed", &self.is_committed())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for AdmissionEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdmissionEngine")
            .field("snapshots", &self.snapshots)
            .field("recorder", &self.recorder)
            .field("counters", &self.counters.read())
            .finish_non_exhaustive()
    }
}

const REASONS: usize = DenyReason::ALL.len();

/// Admissions and denials, counted per thread stripe so that counting never
/// contends, and summed when read.
///
/// The threads with the lowest [`Locality`] numbers each own a stripe.
/// Localities are numbered once per thread, process-wide, in the order
/// threads first ask for one for any reason (a lease debit, a usage place,
/// another engine), and never reused. Only the owning thread ever
/// writes it, so it counts an admission with a plain load and store rather
/// than a read-modify-write. Later threads share the remaining stripes and
/// count with read-modify-writes. Either way every count is exact.
pub struct AdmissionCounters {
    stripes: Box<[CachePadded<Stripe>]>,
    /// Stripes `0..owned` belong to the threads of those localities.
    owned: usize,
}

/// Threads that get a stripe of their own: at least this many, and at least
/// two per core.
const OWNED_STRIPES_MIN: usize = 64;

struct Stripe {
    admitted: AtomicU64,
    admitted_overage: AtomicU64,
    released: AtomicU64,
    lease_waits: AtomicU64,
    denied: [AtomicU64; REASONS],
}

/// A reading of [`AdmissionCounters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionStats {
    /// Requests admitted, however funded.
    pub admitted: u64,
    /// Of those, requests funded from overage at admission.
    pub admitted_overage: u64,
    /// Of those, requests the HTTP layer released for zero because they
    /// ended before their handler started: the client left, a timeout or
    /// limit gave up, or (committing in the handler) the handler answered
    /// without reaching its commit point. A refused commit counts as a
    /// denial instead. An embedding that drops contexts itself counts its
    /// own.
    pub released: u64,
    /// Requests the HTTP layer held for a lease after a transient shortage
    /// (see
    /// [`TollgateBuilder::wait_for_lease`](crate::layer::TollgateBuilder::wait_for_lease)),
    /// counted as each wait begins: each is also counted once, when the
    /// wait ends, as admitted or under its denial (unless its client left
    /// first, when it is counted only here).
    pub lease_waits: u64,
    /// Denials, indexed by [`DenyReason::index`].
    pub denied: [u64; REASONS],
}

impl AdmissionStats {
    /// Denials for `reason` (its payload is ignored).
    #[must_use]
    pub fn denied_for(&self, reason: DenyReason) -> u64 {
        self.denied[reason.index()]
    }

    /// All denials.
    #[must_use]
    pub fn denied_total(&self) -> u64 {
        self.denied.iter().copied().fold(0, u64::saturating_add)
    }
}

impl AdmissionCounters {
    fn new() -> Self {
        let shared = LocalSharding::per_core().count();
        let owned = (2 * shared).max(OWNED_STRIPES_MIN);
        Self {
            owned,
            stripes: (0..owned + shared)
                .map(|_| {
                    CachePadded(Stripe {
                        admitted: AtomicU64::new(0),
                        admitted_overage: AtomicU64::new(0),
                        released: AtomicU64::new(0),
                        lease_waits: AtomicU64::new(0),
                        denied: std::array::from_fn(|_| AtomicU64::new(0)),
                    })
                })
                .collect(),
        }
    }

    /// The stripe of `locality`, and whether that thread owns it.
    /// `locality` must be the calling thread's own ([`Locality::current`]),
    /// never a fixed one: ownership rests on thread numbers being unique.
    #[inline]
    fn stripe(&self, locality: Locality) -> (&Stripe, bool) {
        let index = locality.index();
        if index < self.owned {
            return (&self.stripes[index], true);
        }
        let shared = &self.stripes[self.owned..];
        (&shared[locality.shard_of(shared.len())], false)
    }

    #[inline]
    fn admitted(&self, locality: Locality, overage: bool) {
        let (stripe, owned) = self.stripe(locality);
        if owned {
            // Only this thread writes its stripe, so a load and a store
            // cannot lose a count; readers see each count whole.
            bump_owned(&stripe.admitted);
            if overage {
                bump_owned(&stripe.admitted_overage);
            }
        } else {
            stripe.admitted.fetch_add(1, Ordering::Relaxed);
            if overage {
                stripe.admitted_overage.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Counts a denial decided outside the engine: a credential the HTTP
    /// layer refused before admission, or a commit refused at handler start.
    #[cold]
    pub(crate) fn denied(&self, reason: DenyReason) {
        self.denied_at(Locality::current(), reason);
    }

    /// Counts an admitted request released for zero before its handler
    /// started (see [`AdmissionStats::released`]).
    #[cold]
    pub(crate) fn released(&self) {
        // A read-modify-write, as for denials.
        self.stripe(Locality::current())
            .0
            .released
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request the HTTP layer holds for a lease.
    #[cold]
    pub(crate) fn lease_wait(&self) {
        self.stripe(Locality::current())
            .0
            .lease_waits
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a denial and hands it back.
    #[cold]
    fn denied_at(&self, locality: Locality, reason: DenyReason) -> DenyReason {
        // A read-modify-write whether owned or shared: on an owned stripe
        // the only writer is this thread, so it mixes safely with the plain
        // stores of `admitted`.
        self.stripe(locality).0.denied[reason.index()].fetch_add(1, Ordering::Relaxed);
        reason
    }

    /// Sums the stripes. Each count is exact; counts read while requests run
    /// may come from slightly different instants.
    #[must_use]
    pub fn read(&self) -> AdmissionStats {
        let mut stats = AdmissionStats {
            admitted: 0,
            admitted_overage: 0,
            released: 0,
            lease_waits: 0,
            denied: [0; REASONS],
        };
        for stripe in &self.stripes[..] {
            stats.admitted += stripe.admitted.load(Ordering::Relaxed);
            stats.admitted_overage += stripe.admitted_overage.load(Ordering::Relaxed);
            stats.released += stripe.released.load(Ordering::Relaxed);
            stats.lease_waits += stripe.lease_waits.load(Ordering::Relaxed);
            for (total, count) in stats.denied.iter_mut().zip(&stripe.denied) {
                *total += count.load(Ordering::Relaxed);
            }
        }
        stats
    }
}

/// Adds one to a counter only the calling thread writes.
#[inline]
fn bump_owned(counter: &AtomicU64) {
    counter.store(
        counter.load(Ordering::Relaxed).wrapping_add(1),
        Ordering::Relaxed,
    );
}

impl fmt::Debug for AdmissionCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.read().fmt(f)
    }
}

#[cfg(all(test, not(tollgate_loom)))]
mod tests {
    use jiff::SignedDuration;

    use super::*;
    use crate::admission::{SlotRegistry, SnapshotMapConfig};
    use crate::model::{
        EnforcementMode, FencingToken, LeaseGrant, LeaseId, LocalLease, UsageEvent, UsageSource,
    };

    const ACCOUNT: AccountId = AccountId(3);
    const ALICE: Principal = Principal(1);
    const READ: PermissionBits = PermissionBits::bit(0);
    const WRITE: PermissionBits = PermissionBits::bit(1);

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).expect("test instants are in range")
    }

    struct Fixture {
        engine: AdmissionEngine,
        map: Arc<ArcSwapSnapshotMap>,
        recorder: UsageRecorder,
    }

    fn fixture(queue_capacity: usize) -> Fixture {
        let registry = Arc::new(SlotRegistry::new(LocalSharding::Single));
        let map = Arc::new(
            ArcSwapSnapshotMap::new(
                SnapshotMapConfig {
                    max_staleness: SignedDuration::from_secs(600),
                    negative_capacity: 2,
                    history_depth: 3,
                    lookup_queue_capacity: 8,
                },
                registry,
            )
            .unwrap(),
        );
        let recorder = UsageRecorder::with_capacity(queue_capacity, queue_capacity);
        Fixture {
            engine: AdmissionEngine::new(
                Arc::clone(&map),
                recorder.clone(),
                RequestIds::with_prefix(9),
            ),
            map,
            recorder,
        }
    }

    fn snapshot(mode: EnforcementMode, permissions: PermissionBits) -> PrincipalSnapshot {
        PrincipalSnapshot {
            principal: ALICE,
            account_id: ACCOUNT,
            key_id: Some(KeyId(77)),
            key_hash: None,
            permissions,
            key_status: KeyStatus::Active,
            account_status: AccountStatus::Active,
            mode,
            policy_revision: PolicyRevision(4),
            fetched_at: at(0),
        }
    }

    impl Fixture {
        fn slot(&self) -> Arc<LeaseSlot> {
            self.map
                .registry()
                .get(ACCOUNT)
                .expect("published principals have slots")
        }

        /// Installs a lease of `units` usable until t=100.
        fn lease(&self, units: u64) -> Arc<LocalLease> {
            let lease = Arc::new(LocalLease::new(
                LeaseGrant {
                    lease_id: LeaseId(5),
                    account_id: ACCOUNT,
                    fencing_token: FencingToken(6),
                    units: CostUnits(units),
                    expires_at: at(100),
                },
                CostUnits::ZERO,
            ));
            self.slot().replace(Arc::clone(&lease));
            lease
        }

        fn begin(&self, quote: u64, now: i64) -> Result<RequestContext, DenyReason> {
            self.engine.begin(ALICE, READ, CostUnits(quote), at(now))
        }

        fn queued(&self) -> Vec<UsageEvent> {
            let mut events = Vec::new();
            self.recorder.queue().take_into(&mut events, usize::MAX);
            events
        }
    }

    /// A fixture whose principal is on an Elastic account with `cap`.
    fn elastic(cap: CostUnits) -> Fixture {
        let f = fixture(8);
        f.map.publish([snapshot(
            EnforcementMode::Elastic { overage_cap: cap },
            READ,
        )]);
        f
    }

    #[track_caller]
    fn denied(outcome: Result<RequestContext, DenyReason>, expected: DenyReason) {
        match outcome {
            Err(reason) => assert_eq!(reason, expected),
            Ok(context) => panic!("expected {expected:?}, admitted {context:?}"),
        }
    }

    #[test]
    fn a_context_stays_within_120_bytes() {
        // Moved on every admission, and every byte is copied at each move:
        // `benches/admission.rs` pays about 8 ns per extra 64 bytes (I5's
        // budget).
        assert!(std::mem::size_of::<RequestContext>() <= 120);
    }

    /// I24: a thread's cached generation belongs to one map. A thread that
    /// admits through two engines in turn reads each one's own policy and
    /// funds, and a publish on one is seen by its next read on the same
    /// thread while the other keeps its own.
    #[test]
    fn one_thread_reading_two_maps_in_turn_keeps_them_apart() {
        let (a, b) = (fixture(8), fixture(8));
        for f in [&a, &b] {
            f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        }
        let (lease_a, lease_b) = (a.lease(10), b.lease(100));
        for round in 0..3 {
            a.begin(1, 1).unwrap().commit(at(1)).unwrap();
            b.begin(2, 1).unwrap().commit(at(1)).unwrap();
            assert_eq!(lease_a.remaining(), CostUnits(10 - (round + 1)));
            assert_eq!(lease_b.remaining(), CostUnits(100 - 2 * (round + 1)));
        }
        b.map.publish([PrincipalSnapshot {
            key_status: KeyStatus::Revoked,
            ..snapshot(EnforcementMode::Strict, READ)
        }]);
        denied(b.begin(2, 1), DenyReason::KeyRevoked);
        a.begin(1, 1).unwrap().commit(at(1)).unwrap();
        denied(b.begin(2, 1), DenyReason::KeyRevoked);
        assert_eq!(lease_a.remaining(), CostUnits(6));
        assert_eq!(lease_b.remaining(), CostUnits(94));
        let units =
            |events: Vec<UsageEvent>| events.iter().map(|e| e.units.get()).collect::<Vec<_>>();
        assert_eq!(units(a.queued()), vec![1; 4]);
        assert_eq!(units(b.queued()), vec![2; 3]);
    }

    #[test]
    fn a_principal_not_loaded_is_unavailable_and_queued_for_lookup() {
        let f = fixture(4);
        denied(f.begin(1, 0), DenyReason::SnapshotUnavailable);
        let mut asked = Vec::new();
        f.map.drain_lookups(&mut asked);
        assert_eq!(asked, vec![ALICE]);
    }

    #[test]
    fn an_unknown_principal_is_cached_negatively_within_its_capacity() {
        let f = fixture(4);
        f.map.mark_unknown([ALICE], at(0));
        denied(f.begin(1, 600), DenyReason::UnknownPrincipal);
        let mut asked = Vec::new();
        f.map.drain_lookups(&mut asked);
        assert!(
            asked.is_empty(),
            "a known-unknown principal is not looked up again"
        );
        // I24: past the maximum staleness the source's word no longer
        // stands, however fresh the map: it may have created the principal
        // since. The principal is looked up again.
        f.map.mark_verified(at(601));
        denied(f.begin(1, 601), DenyReason::SnapshotUnavailable);
        f.map.drain_lookups(&mut asked);
        assert_eq!(asked, vec![ALICE]);
        assert!(f.map.is_known_unknown(ALICE) && !f.map.is_unknown_at(ALICE, at(601)));
        // Said again, the record stands again.
        f.map.mark_unknown([ALICE], at(601));
        denied(f.begin(1, 601), DenyReason::UnknownPrincipal);
        // I24: two more unknowns push the oldest out of a capacity of two.
        f.map.mark_unknown([Principal(2), Principal(3)], at(0));
        assert!(!f.map.is_known_unknown(ALICE));
        denied(f.begin(1, 0), DenyReason::SnapshotUnavailable);
        // Publishing a principal makes it known again.
        f.map.mark_unknown([ALICE], at(0));
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        assert!(!f.map.is_known_unknown(ALICE));
        denied(f.begin(1, 0), DenyReason::LeaseUnavailable);
    }

    #[test]
    fn a_stale_snapshot_is_refused_until_the_source_confirms_it() {
        let f = fixture(4);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        // No lease is installed: a fresh snapshot gets as far as funding, a
        // stale one is refused before it (I23).
        denied(f.begin(1, 600), DenyReason::LeaseUnavailable);
        denied(f.begin(1, 601), DenyReason::SnapshotStale);
        f.map.mark_verified(at(50));
        denied(f.begin(1, 601), DenyReason::LeaseUnavailable);
        denied(f.begin(1, 651), DenyReason::SnapshotStale);
    }

    #[test]
    fn status_and_permissions_are_checked_in_order() {
        let f = fixture(4);
        let mut revoked = snapshot(EnforcementMode::Strict, PermissionBits::NONE);
        revoked.key_status = KeyStatus::Revoked;
        revoked.account_status = AccountStatus::Suspended;
        // Each change comes with the next revision, as a store gives it (I32).
        let revision = |n: u64| PolicyRevision(10 + n);
        revoked.policy_revision = revision(0);
        f.map.publish([revoked]);
        f.lease(100);
        denied(f.begin(1, 0), DenyReason::KeyRevoked);
        revoked.key_status = KeyStatus::Active;
        revoked.policy_revision = revision(1);
        f.map.publish([revoked]);
        denied(f.begin(1, 0), DenyReason::AccountInactive);
        revoked.account_status = AccountStatus::Active;
        revoked.policy_revision = revision(2);
        f.map.publish([revoked]);
        denied(
            f.begin(1, 0),
            DenyReason::PermissionDenied { missing: READ },
        );
        f.map.publish([PrincipalSnapshot {
            policy_revision: revision(3),
            ..snapshot(EnforcementMode::Strict, READ)
        }]);
        denied(
            f.engine
                .begin(ALICE, READ.union(WRITE), CostUnits(1), at(0)),
            DenyReason::PermissionDenied { missing: WRITE },
        );
        f.map.publish([PrincipalSnapshot {
            policy_revision: revision(4),
            ..snapshot(
                EnforcementMode::Strict,
                READ.union(WRITE).union(PermissionBits::bit(5)),
            )
        }]);
        let admitted = f
            .engine
            .begin(ALICE, READ.union(WRITE), CostUnits(1), at(0))
            .expect("holding more than the route requires admits");
        assert_eq!(
            (admitted.units(), admitted.admitted_as_overage()),
            (CostUnits(1), false)
        );
        assert_eq!(f.slot().load_observed().unwrap().remaining(), CostUnits(99));
        assert_eq!(f.map.history(ALICE).len(), 3, "I24: history is bounded");
        assert_eq!(
            f.map.history(ALICE)[0].permissions.0,
            0b10_0011,
            "newest first"
        );
    }

    #[test]
    fn a_drained_lease_the_allocator_cannot_restock_fails_closed() {
        let f = fixture(8);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        f.lease(3);
        denied(f.begin(5, 0), DenyReason::LeaseExhausted);
        // The lease manager's grant call went unanswered (I5).
        f.slot().publish_allocator_reachable(false);
        denied(f.begin(5, 0), DenyReason::LeaseUnavailable);
        denied(f.begin(1, 100), DenyReason::LeaseUnavailable);
        let spent = f
            .begin(3, 0)
            .expect("what the lease holds is still spent while the allocator is away");
        // Any answer, even a refusal, means the allocator is back.
        f.slot().publish_allocator_reachable(true);
        denied(f.begin(1, 0), DenyReason::LeaseExhausted);
        drop(spent);
    }

    /// I21: a usage writer that gives up while the instance serves (its
    /// task ended) leaves nothing to deliver an event, so a context admitted
    /// before is refused at its commit: its handler must not run unbilled.
    /// Its charge and its place come back, and nothing is queued.
    #[test]
    fn a_commit_after_the_writer_gave_up_is_refused_and_charges_nothing() {
        let f = fixture(4);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        let lease = f.lease(10);
        let mut context = f.begin(4, 0).expect("the lease funds it");
        assert_eq!(lease.remaining(), CostUnits(6));
        f.recorder.queue().abandon();
        assert_eq!(
            context.commit(at(1)),
            Err(CommitError::Denied(DenyReason::ShuttingDown))
        );
        assert!(!context.is_committed(), "released, not committed");
        assert_eq!(lease.remaining(), CostUnits(10), "I4: the units came back");
        drop(context);
        assert_eq!(f.recorder.available(), 4, "the place came back");
        assert!(f.queued().is_empty(), "I8: no event");
    }

    #[test]
    fn strict_funding_denies_each_shortage_for_what_it_is() {
        let f = fixture(8);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        denied(f.begin(1, 0), DenyReason::LeaseUnavailable);
        let lease = f.lease(3);
        denied(f.begin(5, 0), DenyReason::LeaseExhausted);
        assert_eq!(
            lease.largest_refused_quote(),
            CostUnits(5),
            "the refusal is remembered"
        );
        denied(f.begin(1, 100), DenyReason::LeaseExpired);

        // The allocator says five more units exist: eight in all can be funded.
        f.slot().publish_funding(Some(BalanceShortfall {
            remaining: CostUnits(5),
            period_end: Some(at(500)),
        }));
        denied(f.begin(8, 0), DenyReason::LeaseExhausted);
        assert_eq!(
            lease.largest_refused_quote(),
            CostUnits(8),
            "a quote the account can fund is chased"
        );
        denied(
            f.begin(9, 0),
            DenyReason::BalanceInsufficient {
                remaining: CostUnits(8),
                period_end: Some(at(500)),
            },
        );
        assert_eq!(
            lease.largest_refused_quote(),
            CostUnits(8),
            "I27: one the evidence rules out is not, so it cannot hide the fundable one"
        );
        // With the lease gone and nothing left, it is exhaustion until the period ends.
        f.slot().take();
        f.slot().publish_funding(Some(BalanceShortfall {
            remaining: CostUnits::ZERO,
            period_end: Some(at(500)),
        }));
        denied(
            f.begin(1, 0),
            DenyReason::BalanceExhausted {
                period_end: Some(at(500)),
            },
        );
        assert_eq!(
            DenyReason::BalanceExhausted {
                period_end: Some(at(500))
            }
            .retry(),
            crate::model::Retry::At(at(500))
        );
        // Once the period has ended the evidence says nothing.
        denied(f.begin(1, 500), DenyReason::LeaseUnavailable);
        // A later grant that shows funds clears it.
        f.slot().publish_funding(None);
        denied(f.begin(1, 0), DenyReason::LeaseUnavailable);
        assert_eq!(lease.remaining(), CostUnits(3), "no denial took a unit");
    }

    /// I23: the evidence counts every unit beside the lease the slot served
    /// when it was published. A request that read another lease, or none
    /// (the lease manager installed or took one out in between), answers
    /// no quote as final on it; nor does a request whose lease's window has
    /// closed, since that lease's pending charges will give their units
    /// back to it.
    #[test]
    fn evidence_is_final_only_beside_the_lease_it_was_published_with() {
        let f = fixture(8);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        let nothing_left = Some(BalanceShortfall {
            remaining: CostUnits::ZERO,
            period_end: None,
        });
        // Published with the slot empty, read beside a lease installed since.
        f.slot().publish_funding(nothing_left);
        let lease = f.lease(3);
        denied(f.begin(5, 0), DenyReason::LeaseExhausted);
        // Published beside the lease: final.
        f.slot().publish_funding(nothing_left);
        denied(
            f.begin(5, 0),
            DenyReason::BalanceInsufficient {
                remaining: CostUnits(3),
                period_end: None,
            },
        );
        // The lease's window has closed: no final answer on its reading.
        denied(f.begin(5, 100), DenyReason::LeaseExpired);
        // The lease taken out since: read with the slot empty.
        f.slot().take();
        denied(f.begin(5, 0), DenyReason::LeaseUnavailable);
        assert_eq!(lease.remaining(), CostUnits(3));
    }

    /// I23, I27: unsettled evidence (a parked lease may still get units
    /// back) gives no final answer, but a quote it rules out is not
    /// recorded for a fold either: the lease manager would forget the
    /// record on the same figure, and the next refusal would ring again.
    #[test]
    fn unsettled_evidence_neither_answers_finally_nor_records_what_it_rules_out() {
        let f = fixture(8);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        let lease = f.lease(3);
        f.slot().publish_unsettled_funding(Some(BalanceShortfall {
            remaining: CostUnits(1),
            period_end: None,
        }));
        denied(f.begin(5, 0), DenyReason::LeaseExhausted);
        assert_eq!(lease.largest_refused_quote(), CostUnits::ZERO);
        // One the estimate does not rule out is recorded.
        denied(f.begin(4, 0), DenyReason::LeaseExhausted);
        assert_eq!(lease.largest_refused_quote(), CostUnits(4));
    }

    /// I9: a request priced at nothing needs no funds. It is admitted with
    /// no lease, with the allocator out of reach, with the balance spent and
    /// with an Elastic cap full, where a priced one is refused; and it
    /// records zero units, as overage, counted as no overage admission.
    #[test]
    fn a_free_request_is_admitted_whatever_funds_the_account_has() {
        let f = fixture(8);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        f.slot().publish_allocator_reachable(false);
        denied(f.begin(1, 0), DenyReason::LeaseUnavailable);
        let mut free = f.begin(0, 0).expect("no lease, nothing to fund");
        assert!(!free.admitted_as_overage());
        assert_eq!(free.commit(at(1)), Ok(CostUnits::ZERO));
        f.slot().publish_funding(Some(BalanceShortfall {
            remaining: CostUnits::ZERO,
            period_end: None,
        }));
        denied(
            f.begin(1, 0),
            DenyReason::BalanceExhausted { period_end: None },
        );
        let lease = f.lease(5);
        let expired = f.begin(0, 100).expect("the lease's window closed");
        assert_eq!(expired.account_id(), ACCOUNT);
        drop(expired);
        let mut leased = f.begin(0, 1).expect("a serving lease takes it");
        assert_eq!(leased.commit(at(1)), Ok(CostUnits::ZERO));
        assert_eq!(lease.remaining(), CostUnits(5));
        let stats = f.engine.counters().read();
        assert_eq!((stats.admitted, stats.admitted_overage), (3, 0));
        let events = f.queued();
        assert_eq!(events.len(), 2, "I8: one event per commit");
        assert_eq!(
            (events[0].source, events[0].units),
            (UsageSource::Overage, CostUnits::ZERO),
            "no lease: zero units of overage"
        );
        assert_eq!(
            (events[1].source, events[1].units),
            (
                UsageSource::Leased {
                    lease_id: LeaseId(5),
                    fencing_token: FencingToken(6)
                },
                CostUnits::ZERO
            ),
            "a serving lease: the event touches only that lease"
        );

        let elastic = elastic(CostUnits(4));
        let mut spent = elastic.begin(4, 0).expect("overage funds it");
        spent.commit(at(1)).unwrap();
        let mut free = elastic.begin(0, 0).expect("a full cap holds nothing back");
        assert_eq!(free.commit(at(1)), Ok(CostUnits::ZERO));
    }

    /// I9: a free request admitted on a serving lease commits even if the
    /// lease's window closes before its handler starts: zero units need no
    /// funds, and bill as zero units of overage.
    #[test]
    fn a_free_request_whose_lease_lapses_before_its_handler_still_runs() {
        let f = fixture(4);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        let lease = f.lease(10);
        let mut free = f.begin(0, 99).expect("admitted");
        assert_eq!(free.commit(at(100)), Ok(CostUnits::ZERO));
        assert_eq!(lease.remaining(), CostUnits(10));
        let events = f.queued();
        assert_eq!(events.len(), 1, "I8: one zero-unit event");
        assert_eq!(
            (events[0].source, events[0].units),
            (UsageSource::Overage, CostUnits::ZERO)
        );
    }

    #[test]
    fn elastic_funding_falls_back_to_overage_up_to_the_cap() {
        let f = elastic(CostUnits(10));
        let mut first = f.begin(6, 0).expect("no lease: overage funds it");
        assert!(first.admitted_as_overage());
        denied(
            f.begin(6, 0),
            DenyReason::OverageCapTemporarilyExhausted {
                spent: CostUnits(6),
                overage_cap: CostUnits(10),
            },
        );
        first.commit(at(1)).unwrap();
        assert!(first.is_committed());
        assert_eq!(first.units(), CostUnits(6));
        assert_eq!(
            first.commit(at(1)),
            Err(CommitError::AlreadyCommitted),
            "I3: an overage charge commits once"
        );
        // No lease yet, and nothing says the account has no funds: one may
        // be granted, so the spent cap is not the final word.
        denied(f.begin(6, 0), DenyReason::LeaseUnavailable);
        f.slot().publish_funding(Some(BalanceShortfall {
            remaining: CostUnits::ZERO,
            period_end: None,
        }));
        denied(
            f.begin(6, 0),
            DenyReason::OverageCapExhausted {
                spent: CostUnits(6),
                overage_cap: CostUnits(10),
            },
        );
        let lease = f.lease(10);
        let leased = f.begin(6, 0).expect("the lease funds it");
        assert!(!leased.admitted_as_overage());
        assert_eq!(lease.remaining(), CostUnits(4));
        let stats = f.engine.counters().read();
        assert_eq!((stats.admitted, stats.admitted_overage), (2, 1));
        assert_eq!(stats.denied_total(), 3);
        let events = f.queued();
        assert_eq!(events.len(), 1, "I8: one commit, one event");
        assert_eq!(events[0].source, UsageSource::Overage);
        assert_eq!(events[0].units, CostUnits(6));
    }

    /// An Elastic charge on a lease that carries the account's overage
    /// counter (as the lease manager's leases do) takes no reference count
    /// on the counter, which every request of the account shares, and still
    /// falls back to it when the lease's window closes before the handler
    /// starts. On a lease without it, the context holds the counter itself.
    #[test]
    fn an_elastic_charge_reaches_overage_through_a_lease_that_carries_it() {
        let f = elastic(CostUnits(10));
        let slot = f.slot();
        let lease = Arc::new(
            LocalLease::new(
                LeaseGrant {
                    lease_id: LeaseId(5),
                    account_id: ACCOUNT,
                    fencing_token: FencingToken(6),
                    units: CostUnits(10),
                    expires_at: at(100),
                },
                CostUnits::ZERO,
            )
            .with_overage(slot.overage()),
        );
        slot.replace(Arc::clone(&lease));
        let shared = Arc::strong_count(slot.overage());
        let mut on_time = f.begin(3, 0).expect("the lease funds it");
        let mut late = f.begin(4, 99).expect("the lease funds it");
        assert_eq!(
            Arc::strong_count(slot.overage()),
            shared,
            "no reference count per request"
        );
        assert_eq!(on_time.commit(at(1)), Ok(CostUnits(3)));
        assert_eq!(
            late.commit(at(100)),
            Ok(CostUnits(4)),
            "I3, I10: the fallback"
        );
        assert_eq!(slot.overage().spent(), CostUnits(4));
        drop((on_time, late));
        assert_eq!(
            lease.remaining(),
            CostUnits(7),
            "the lapsed charge went back"
        );
        let sources: Vec<_> = f.queued().iter().map(|e| (e.source, e.units)).collect();
        assert_eq!(
            sources,
            vec![
                (
                    UsageSource::Leased {
                        lease_id: LeaseId(5),
                        fencing_token: FencingToken(6)
                    },
                    CostUnits(3)
                ),
                (UsageSource::Overage, CostUnits(4)),
            ]
        );
        f.lease(10);
        let bare = f.begin(1, 0).expect("the lease funds it");
        assert_eq!(Arc::strong_count(slot.overage()), shared + 1);
        drop(bare);
        assert_eq!(Arc::strong_count(slot.overage()), shared);
    }

    /// I10: a late commit falls back to overage under the cap the request
    /// was admitted under. Strict mode, or a lower cap, published between
    /// admission and the handler's start changes nothing for it, while the
    /// next admission reads the new policy.
    #[test]
    fn a_late_commit_falls_back_under_the_cap_it_was_admitted_under() {
        for later in [
            EnforcementMode::Strict,
            EnforcementMode::Elastic {
                overage_cap: CostUnits(1),
            },
        ] {
            let f = elastic(CostUnits(10));
            f.lease(10);
            let mut late = f.begin(4, 99).expect("the lease funds it");
            f.map.publish([PrincipalSnapshot {
                policy_revision: PolicyRevision(5),
                ..snapshot(later, READ)
            }]);
            assert_eq!(late.commit(at(100)), Ok(CostUnits(4)), "{later:?}");
            assert_eq!(f.slot().overage().spent(), CostUnits(4), "{later:?}");
            let sources: Vec<_> = f.queued().iter().map(|e| (e.source, e.units)).collect();
            assert_eq!(sources, [(UsageSource::Overage, CostUnits(4))], "{later:?}");
            // The next request is judged under the new policy, which
            // refuses what the old cap's 6 left would have funded: Strict
            // funds nothing from overage, and the cap of 1 is spent. The
            // lease's window has closed and nothing says the account is out
            // of funds, so it is told the lease's refusal, which a
            // replacement lease ends (I23).
            let next = f.begin(5, 100).map(|context| context.units());
            assert_eq!(next, Err(DenyReason::LeaseExpired), "{later:?}");
        }
    }

    /// An Elastic account falls back to overage whenever its lease cannot
    /// fund the quote, not only when it has no lease, and the lease keeps
    /// what it holds.
    #[test]
    fn elastic_funding_covers_an_exhausted_or_expired_lease_from_overage() {
        let f = elastic(CostUnits(10));
        let lease = f.lease(3);
        let mut short = f.begin(5, 0).expect("the lease is short: overage funds it");
        assert!(short.admitted_as_overage());
        let mut late = f
            .begin(2, 100)
            .expect("the lease has expired: overage funds it");
        assert!(late.admitted_as_overage());
        assert_eq!(lease.remaining(), CostUnits(3), "the lease gave nothing");
        assert_eq!(f.slot().overage().spent(), CostUnits(7));
        assert_eq!(short.commit(at(1)), Ok(CostUnits(5)));
        assert_eq!(late.commit(at(101)), Ok(CostUnits(2)));
        let sources: Vec<_> = f.queued().iter().map(|e| (e.source, e.units)).collect();
        assert_eq!(
            sources,
            vec![
                (UsageSource::Overage, CostUnits(5)),
                (UsageSource::Overage, CostUnits(2))
            ]
        );
        // The cap has 3 left and the lease 3: neither funds 4 now. Nothing
        // says the account is out of funds, so the lease's refusal stands:
        // the refill task folds it, and a retry is admitted (I12, I23).
        denied(f.begin(4, 0), DenyReason::LeaseExhausted);
        // Once the allocator says the account cannot fund it either, and no
        // refill is due, the spent cap is the truth, and final.
        f.slot().publish_funding(Some(BalanceShortfall {
            remaining: CostUnits::ZERO,
            period_end: None,
        }));
        denied(
            f.begin(4, 0),
            DenyReason::OverageCapExhausted {
                spent: CostUnits(7),
                overage_cap: CostUnits(10),
            },
        );
        // With a refill due, the request can be funded then: it is told
        // when, as a Strict account would be.
        f.slot().publish_funding(Some(BalanceShortfall {
            remaining: CostUnits::ZERO,
            period_end: Some(at(500)),
        }));
        denied(
            f.begin(4, 0),
            DenyReason::BalanceInsufficient {
                remaining: CostUnits(3),
                period_end: Some(at(500)),
            },
        );
        let stats = f.engine.counters().read();
        assert_eq!((stats.admitted, stats.admitted_overage), (2, 2));
    }

    /// While another request's overage commit is being published, a quote
    /// the cap could hold once it lands is refused as in progress, not as
    /// exhausted.
    #[test]
    fn an_overage_commit_in_flight_is_reported_as_such() {
        let cap = CostUnits(10);
        let f = elastic(cap);
        let slot = f.slot();
        let tentative = slot
            .overage()
            .debit_before_claim(CostUnits(6), cap)
            .unwrap();
        let published: Result<(), ()> = tentative.publish_commit(|| {
            denied(
                f.begin(6, 0),
                DenyReason::OverageCommitInProgress {
                    spent: CostUnits(6),
                    overage_cap: cap,
                },
            );
            Ok(())
        });
        published.unwrap();
        // The account has nothing left to lease, so the spent cap is final.
        slot.publish_funding(Some(BalanceShortfall {
            remaining: CostUnits::ZERO,
            period_end: None,
        }));
        denied(
            f.begin(6, 0),
            DenyReason::OverageCapExhausted {
                spent: CostUnits(6),
                overage_cap: cap,
            },
        );
        let stats = f.engine.counters().read();
        assert_eq!(
            stats.denied_for(DenyReason::OverageCommitInProgress {
                spent: CostUnits(6),
                overage_cap: cap,
            }),
            1
        );
    }

    /// I23: once the usage queue is closed for shutdown, admission denies
    /// last, at the usage place, and the reservation it had made is
    /// released.
    #[test]
    fn a_closed_usage_queue_denies_as_shutting_down_and_releases_the_reservation() {
        let f = fixture(4);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        let lease = f.lease(10);
        f.recorder.queue().close();
        denied(f.begin(2, 0), DenyReason::ShuttingDown);
        assert_eq!(
            lease.remaining(),
            CostUnits(10),
            "I4: the denial holds nothing"
        );
        assert_eq!(f.recorder.available(), 4);
        let stats = f.engine.counters().read();
        assert_eq!(
            (stats.admitted, stats.denied_for(DenyReason::ShuttingDown)),
            (0, 1)
        );
    }

    #[test]
    fn a_full_usage_queue_denies_and_releases_the_reservation() {
        let f = fixture(1);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        let lease = f.lease(10);
        let held = f.begin(2, 0).unwrap();
        denied(f.begin(3, 0), DenyReason::AccountingBackpressure);
        assert_eq!(
            lease.remaining(),
            CostUnits(8),
            "I4: the denied request holds nothing"
        );
        drop(held);
        assert_eq!(lease.remaining(), CostUnits(10));
        assert_eq!(f.recorder.available(), 1, "I20: the place came back");
        let stats = f.engine.counters().read();
        assert_eq!(stats.denied_for(DenyReason::AccountingBackpressure), 1);
    }

    #[test]
    fn a_commit_queues_exactly_one_event_and_a_drop_queues_none() {
        let f = fixture(4);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        let lease = f.lease(10);
        let mut context = f.begin(4, 0).unwrap();
        assert_eq!(context.units(), CostUnits(4));
        assert_eq!(context.account_id(), ACCOUNT);
        assert_eq!(context.key_id(), Some(KeyId(77)));
        assert_eq!(context.principal(), ALICE);
        assert_eq!(context.commit(at(2)), Ok(CostUnits(4)));
        assert!(context.is_committed());
        assert_eq!(context.commit(at(2)), Err(CommitError::AlreadyCommitted));
        let request_id = context.request_id();
        drop(context);
        drop(f.begin(3, 0).unwrap());
        assert_eq!(
            lease.remaining(),
            CostUnits(6),
            "the dropped request paid nothing"
        );
        let events = f.queued();
        assert_eq!(
            events,
            vec![UsageEvent {
                request_id,
                account_id: ACCOUNT,
                source: UsageSource::Leased {
                    lease_id: LeaseId(5),
                    fencing_token: FencingToken(6),
                },
                units: CostUnits(4),
                at: at(2),
                policy_revision: PolicyRevision(4),
                key_id: Some(KeyId(77)),
            }]
        );
        assert_eq!(
            request_id.get() >> 64,
            9,
            "minted under the engine's prefix"
        );
        // The delivered event still holds its place until the writer frees it.
        assert_eq!(f.recorder.available(), 3);
    }

    /// I26: requests on a thread that cached a view of the serving lease
    /// (every request after its thread's first) debit it without the
    /// slot's guard, yet never a lease taken out of the slot: the lease
    /// manager finds it quiescent with its count final, and once it is put
    /// back the requests debit it again.
    #[test]
    fn a_lease_out_of_its_slot_funds_no_request_that_cached_it() {
        let f = fixture(8);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        let lease = f.lease(10);
        for _ in 0..3 {
            assert_eq!(f.begin(1, 0).unwrap().commit(at(0)), Ok(CostUnits(1)));
        }
        assert_eq!(lease.remaining(), CostUnits(7));
        drop(lease);
        // The writer takes the events, and with them their holds on the
        // lease.
        let mut events = Vec::new();
        assert_eq!(f.recorder.take_recorded(&mut events, usize::MAX), 3);
        let (taken, counted) = f.slot().take_counted().expect("serving");
        denied(f.begin(1, 0), DenyReason::LeaseUnavailable);
        assert_eq!(Arc::strong_count(&taken), 1);
        assert!(taken.is_only_local_view(), "quiescent");
        assert_eq!(taken.remaining(), CostUnits(7), "final");
        assert!(f.slot().reinstate(taken, counted).is_none());
        let mut context = f.begin(2, 0).expect("put back");
        assert_eq!(context.commit(at(0)), Ok(CostUnits(2)));
        drop(context);
        let serving = f.slot().load_observed().expect("serving");
        assert_eq!(serving.remaining(), CostUnits(5));
    }

    /// A source that rotates a principal's key (or withdraws it) takes the
    /// old key with it: the old hash must not keep reaching the principal
    /// and its new key's policy.
    #[test]
    fn a_rotated_key_no_longer_admits() {
        let f = fixture(4);
        let (old, new) = (KeyHash::of(b"tg_old_key"), KeyHash::of(b"tg_new_key"));
        let mut keyed = snapshot(EnforcementMode::Strict, READ);
        keyed.key_hash = Some(old);
        f.map.publish([keyed]);
        f.map.mark_verified(at(0));
        let _lease = f.lease(10);
        drop(
            f.engine
                .begin_by_key(&old, READ, CostUnits(1), at(0))
                .unwrap(),
        );
        keyed.key_hash = Some(new);
        f.map.publish([keyed]);
        denied(
            f.engine.begin_by_key(&old, READ, CostUnits(1), at(0)),
            DenyReason::UnknownPrincipal,
        );
        drop(
            f.engine
                .begin_by_key(&new, READ, CostUnits(1), at(0))
                .unwrap(),
        );
        keyed.key_hash = None;
        f.map.publish([keyed]);
        denied(
            f.engine.begin_by_key(&new, READ, CostUnits(1), at(0)),
            DenyReason::UnknownPrincipal,
        );
    }

    #[test]
    fn a_request_is_admitted_by_the_hash_of_its_key() {
        let f = fixture(4);
        let key = KeyHash::of(b"tg_example_key");
        let mut keyed = snapshot(EnforcementMode::Strict, READ);
        keyed.key_hash = Some(key);
        f.map.publish([keyed]);
        let lease = f.lease(10);
        assert_eq!(f.map.principal_for_key(&key), Some(ALICE));
        let context = f
            .engine
            .begin_by_key(&key, READ, CostUnits(3), at(0))
            .unwrap();
        assert_eq!(context.principal(), ALICE);
        assert_eq!(lease.remaining(), CostUnits(7));
        // I24: until a complete refresh vouches for the map's keys, a key it
        // lacks may be one it has not loaded yet.
        let guess = KeyHash::of(b"tg_guess");
        denied(
            f.engine.begin_by_key(&guess, READ, CostUnits(1), at(0)),
            DenyReason::SnapshotUnavailable,
        );
        f.map.mark_verified(at(0));
        denied(
            f.engine.begin_by_key(&guess, READ, CostUnits(1), at(0)),
            DenyReason::UnknownPrincipal,
        );
        let stale = at(0) + f.map.config().max_staleness + SignedDuration::from_nanos(1);
        denied(
            f.engine.begin_by_key(&guess, READ, CostUnits(1), stale),
            DenyReason::SnapshotUnavailable,
        );
        keyed.key_status = KeyStatus::Revoked;
        f.map.publish([keyed]);
        denied(
            f.engine.begin_by_key(&key, READ, CostUnits(1), at(0)),
            DenyReason::KeyRevoked,
        );
        // A principal the source disowns takes its key with it.
        f.map.mark_unknown([ALICE], at(0));
        assert_eq!(f.map.principal_for_key(&key), None);
        denied(
            f.engine.begin_by_key(&key, READ, CostUnits(1), at(0)),
            DenyReason::UnknownPrincipal,
        );
        let stats = f.engine.counters().read();
        assert_eq!((stats.admitted, stats.denied_total()), (1, 5));
    }

    #[test]
    fn a_lapse_before_the_handler_starts_depends_on_the_mode() {
        let f = fixture(4);
        f.map.publish([snapshot(EnforcementMode::Strict, READ)]);
        let lease = f.lease(10);
        let mut strict = f.begin(4, 99).unwrap();
        assert_eq!(
            strict.commit(at(100)),
            Err(CommitError::Denied(DenyReason::FundingExpiredAtStart))
        );
        drop(strict);
        assert!(f.queued().is_empty(), "I9: nothing billed");
        assert_eq!(f.recorder.available(), 4);

        let mode = EnforcementMode::Elastic {
            overage_cap: CostUnits(10),
        };
        f.map.publish([snapshot(mode, READ)]);
        let mut elastic = f.begin(4, 99).unwrap();
        let policy = PolicyRevision(12);
        elastic.set_policy_revision(policy);
        assert_eq!(elastic.commit(at(100)), Ok(CostUnits(4)));
        let events = f.queued();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].source, UsageSource::Overage);
        assert_eq!(events[0].policy_revision, policy);
        drop(elastic);
        assert_eq!(
            lease.remaining(),
            CostUnits(10),
            "the lease got its units back"
        );
        assert_eq!(f.slot().overage().committed(), CostUnits(4));
    }
}
