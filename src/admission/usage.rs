//! The request path's half of the usage pipeline: a bounded queue whose
//! places are reserved at admission, so a committed charge can always be
//! recorded without waiting or failing.
//!
//! The queue is striped: each stripe has its own places, its own counter and
//! its own event ring, on its own cache lines, and a thread takes places from
//! the stripe of its locality. Threads serving requests in parallel therefore
//! do not contend on one counter, one reference count or one ring tail. A
//! thread whose stripe is full borrows a place from another stripe, so the
//! queue's capacity is shared by all.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Waker;

use atomic_waker::AtomicWaker;
use crossbeam_queue::ArrayQueue;

use crate::model::sharding::split_evenly;
use jiff::Timestamp;

use crate::model::{
    CachePadded, DenyReason, KeyId, LeaseHold, LocalSharding, Locality, PolicyRevision, RequestId,
    Reservation, UsageEvent,
};
// The places' word is what the loom models check here (see `CLOSED`).
use crate::sync::AtomicUsize;

/// Hands usage events to the writer. Cheap to clone; every clone feeds the
/// same queue.
#[derive(Clone)]
pub struct UsageRecorder {
    queue: Arc<UsageQueue>,
}

/// A reserved place in the usage queue, taken at admission.
///
/// Turning it into an event with [`record`](Self::record) never fails and
/// never waits: the place was set aside when the permit was taken (I20).
/// Dropping it unused gives the place back.
#[must_use = "a permit holds a place in the usage queue until it is recorded or dropped"]
pub struct UsagePermit {
    /// The stripe whose place this is; `None` once the place holds an event.
    stripe: Option<Arc<CachePadded<Stripe>>>,
}

/// The queue itself, shared by the recorder's clones and the writer.
///
/// # Invariants
///
/// For every stripe, `available + outstanding permits + events not yet
/// delivered = the stripe's capacity`, and the stripes' capacities add up to
/// the queue's (I20). An event keeps its place until the writer reports it
/// delivered (accepted, duplicate or rejected) or lost, so the capacity
/// bounds everything this process has committed but not yet written.
pub(crate) struct UsageQueue {
    stripes: Box<[Arc<CachePadded<Stripe>>]>,
    hub: Arc<Hub>,
    /// For each event the writer has taken and not yet released, in the
    /// order taken: the stripe it came from and the charge it holds. Only
    /// the writer touches it, never the request path.
    taken: Mutex<VecDeque<(usize, Option<LeaseHold>)>>,
    /// The stripe the next [`take_into`](Self::take_into) starts at: each
    /// take starts one stripe further, so a stripe that refills as fast as
    /// it is emptied cannot keep the others waiting. Only the writer
    /// touches it.
    take_from: AtomicUsize,
}

/// One recorded event, and the hold of the committed charge that produced
/// it.
///
/// The hold travels with its event and is dropped only when the event
/// leaves the process. Until then it keeps a view of the lease that funded
/// the charge, so the lease is not quiescent and cannot be released while
/// usage naming it is still on its way to the sink (I26): its release then
/// claims an exact remainder with every charge against it already billed.
struct Recorded {
    event: UsageEvent,
    hold: Option<LeaseHold>,
}

struct Stripe {
    /// Free places, with [`CLOSED`], [`ABANDONED`] and [`STOPPING`] in its
    /// top bits.
    available: AtomicUsize,
    events: ArrayQueue<Recorded>,
    capacity: usize,
    /// Events in this stripe at which a recording wakes the writer.
    wake_at: usize,
    hub: Arc<Hub>,
}

/// Set in every stripe's `available` when the queue closes.
///
/// Taking a place and closing then change the same word, so they are ordered
/// by it: a place is either taken before the close, and the writer, which
/// reads the word after closing it, waits for it; or the take sees the bit
/// and is refused. A separate flag read before the take would let a permit
/// slip in after the writer had found every place free and finished (I21).
const CLOSED: usize = 1 << (usize::BITS - 1);

/// Set in every stripe's `available` when the writer gives up: nothing will
/// deliver what is recorded from then on, so a commit is refused rather
/// than let a handler run whose charge can never be billed.
const ABANDONED: usize = 1 << (usize::BITS - 2);

/// Set in every stripe's `available`, with [`CLOSED`], when the instance
/// stops starting handlers (its shutdown began): a commit is refused, and
/// its charge released, so no handler starts that the shutdown may cut off
/// after charging for it (I25). Events already recorded are delivered as
/// usual.
const STOPPING: usize = 1 << (usize::BITS - 3);

/// The count of free places in an `available` word.
const PLACES: usize = STOPPING - 1;

/// The bits that refuse a commit.
const REFUSE_COMMITS: usize = ABANDONED | STOPPING;

/// What every stripe shares: read on the request path, written rarely.
struct Hub {
    capacity: usize,
    waker: AtomicWaker,
    /// Whether a [`UsageWriter`](crate::runtime::UsageWriter) drains the
    /// queue, so that nothing else may take from it.
    writer_owned: AtomicBool,
    /// Events whose push failed; impossible while I20 holds, counted so a
    /// broken invariant is loud rather than silent.
    overflowed: AtomicU64,
}

impl UsageRecorder {
    /// The most places a usage queue may have: 2²², about four million.
    ///
    /// Every place is allocated when the queue is built (a little over a
    /// hundred bytes each, so about half a gibibyte at this size), and each
    /// is a charge the process may hold committed but not yet billed. A
    /// larger queue is a misconfiguration, refused by name (I17) rather
    /// than left to abort the process when the allocation fails.
    pub const MAX_CAPACITY: usize = 1 << 22;

    /// A recorder over a new queue of `capacity` places that wakes its
    /// reader once `wake_at` events wait in one stripe (or a stripe is full).
    ///
    /// [`UsageWriter::spawn`](crate::runtime::UsageWriter::spawn) makes the
    /// recorder a deployment uses, with the writer draining it. A recorder
    /// made here has no writer: once its places are taken it denies every
    /// admission, which is what tests of the request path want.
    ///
    /// The queue has a stripe per core; see [`striped`](Self::striped).
    ///
    /// # Panics
    ///
    /// When `capacity` is zero or above [`MAX_CAPACITY`](Self::MAX_CAPACITY),
    /// or `wake_at` is zero.
    #[must_use]
    pub fn with_capacity(capacity: usize, wake_at: usize) -> Self {
        Self::striped(capacity, wake_at, LocalSharding::per_core())
    }

    /// [`with_capacity`](Self::with_capacity), with the queue split into
    /// `stripes` (never more stripes than places).
    ///
    /// Events recorded into one stripe leave it in the order recorded. The
    /// queue keeps no order between stripes, and a thread whose stripe is
    /// full records into the stripe it borrowed a place from, so with more
    /// than one stripe even one thread's events may reach the sink out of
    /// order. Nothing depends on that order: every event is keyed by its
    /// request id (I8). [`LocalSharding::Single`] keeps every event in
    /// recording order.
    ///
    /// # Panics
    ///
    /// When `capacity` is zero or above [`MAX_CAPACITY`](Self::MAX_CAPACITY),
    /// or `wake_at` is zero.
    #[must_use]
    pub fn striped(capacity: usize, wake_at: usize, stripes: LocalSharding) -> Self {
        assert!(capacity > 0, "a usage queue needs at least one place");
        assert!(
            capacity <= Self::MAX_CAPACITY,
            "a usage queue has at most {} places, not {capacity}",
            Self::MAX_CAPACITY
        );
        assert!(
            wake_at > 0,
            "a usage queue wakes its reader at one event or more"
        );
        let count = stripes.count().min(capacity);
        let hub = Arc::new(Hub {
            capacity,
            waker: AtomicWaker::new(),
            writer_owned: AtomicBool::new(false),
            overflowed: AtomicU64::new(0),
        });
        // Each stripe wakes the writer at a whole batch (or when full, if it
        // is smaller), so a partial batch waits for the flush interval
        // however the threads that recorded it were spread.
        let stripes = (0..count)
            .map(|index| {
                let places = usize::try_from(split_evenly(capacity as u64, count, index))
                    .expect("a part of a usize fits a usize");
                Arc::new(CachePadded(Stripe {
                    available: AtomicUsize::new(places),
                    events: ArrayQueue::new(places),
                    capacity: places,
                    wake_at: wake_at.min(places),
                    hub: Arc::clone(&hub),
                }))
            })
            .collect();
        Self {
            queue: Arc::new(UsageQueue {
                stripes,
                hub,
                taken: Mutex::new(VecDeque::new()),
                take_from: AtomicUsize::new(0),
            }),
        }
    }

    /// Reserves a place for one future usage event, preferring the calling
    /// thread's stripe.
    ///
    /// # Errors
    ///
    /// [`DenyReason::AccountingBackpressure`] when every place is taken, and
    /// [`DenyReason::ShuttingDown`] once the queue is closed: the writer has
    /// been told to stop, or the instance's shutdown has begun.
    #[inline]
    pub fn try_permit(&self) -> Result<UsagePermit, DenyReason> {
        self.try_permit_at(Locality::current())
    }

    /// [`try_permit`](Self::try_permit), preferring the stripe of
    /// `locality`: admission reads the thread's locality once for all its
    /// striped state.
    #[inline]
    pub(crate) fn try_permit_at(&self, locality: Locality) -> Result<UsagePermit, DenyReason> {
        let queue = &*self.queue;
        let count = queue.stripes.len();
        let home = locality.shard_of(count);
        // Home first, then the others in turn, without a division per step.
        let (before_home, from_home) = queue.stripes.split_at(home);
        for stripe in from_home.iter().chain(before_home) {
            // I20: a place is taken only if one is free, and (I21) only
            // while the queue is open, decided in the same read-modify-write
            // (see `CLOSED`).
            match stripe
                .available
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |free| {
                    if free & CLOSED == 0 {
                        free.checked_sub(1)
                    } else {
                        None
                    }
                }) {
                Ok(_) => {
                    return Ok(UsagePermit {
                        stripe: Some(Arc::clone(stripe)),
                    });
                }
                Err(free) if free & CLOSED != 0 => return Err(DenyReason::ShuttingDown),
                Err(_) => {}
            }
        }
        queue.full()
    }

    /// Places not reserved and not holding an undelivered event.
    #[must_use]
    pub fn available(&self) -> usize {
        self.queue
            .stripes
            .iter()
            .map(|stripe| stripe.available.load(Ordering::Acquire) & PLACES)
            .sum()
    }

    /// The queue's size.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.queue.hub.capacity
    }

    /// Events recorded and not yet taken by the writer.
    #[must_use]
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Takes up to `max` recorded events out of the queue into `out`, and
    /// frees their places: delivering them is now the caller's job. Returns
    /// how many were taken. Events from one thread come out in the order it
    /// recorded them while its stripe had room.
    ///
    /// [`UsageWriter`](crate::runtime::UsageWriter) does this itself; use it
    /// only on a recorder made with [`with_capacity`](Self::with_capacity)
    /// that no writer drains, such as in tests or an embedding that delivers
    /// usage its own way. The charges' holds are dropped as their events
    /// are taken, so a lease they name may be released before such an
    /// embedding has delivered them (I26): deliver before the lease
    /// manager's next release pass, or expect the sink to reject them.
    ///
    /// # Panics
    ///
    /// On the recorder [`UsageWriter::spawn`](crate::runtime::UsageWriter::spawn)
    /// returns: taking from under the writer would free the places of its
    /// batch in flight and leave it freeing the places of these events.
    pub fn take_recorded(&self, out: &mut Vec<UsageEvent>, max: usize) -> usize {
        assert!(
            !self.queue.hub.writer_owned.load(Ordering::Relaxed),
            "take_recorded on a recorder a UsageWriter drains: the writer's own \
             bookkeeping would free the wrong places"
        );
        let taken = self.queue.take_into(out, max);
        self.queue.release(taken);
        taken
    }

    pub(crate) fn queue(&self) -> &Arc<UsageQueue> {
        &self.queue
    }
}

impl fmt::Debug for UsageRecorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UsageRecorder")
            .field("capacity", &self.capacity())
            .field("stripes", &self.queue.stripes.len())
            .field("available", &self.available())
            .field("queued", &self.queued())
            .field("closed", &self.queue.is_closed())
            .finish()
    }
}

impl UsagePermit {
    /// Queues `event` in the place this permit reserved. Never blocks and
    /// never fails (I20).
    #[inline]
    pub fn record(self, event: UsageEvent) {
        self.record_entry(event, None);
    }

    /// Queues the usage event of `charge`, which has committed, with the
    /// charge's hold: the hold is dropped when the event leaves the process
    /// (see [`Recorded`], I26). The entry is built in the call that queues
    /// it, so the event is written once before the queue copies it in, and
    /// the charge is read and emptied where it lies rather than moved.
    #[inline]
    pub(crate) fn record_committed(
        self,
        charge: &mut Reservation,
        request_id: RequestId,
        now: Timestamp,
        policy_revision: PolicyRevision,
        key_id: Option<KeyId>,
    ) {
        let Some(event) = charge.usage_event(request_id, now, policy_revision, key_id) else {
            // I8: a pending or released charge yields no event; the permit
            // is dropped and its place comes back.
            debug_assert!(false, "I8: only a committed charge is recorded");
            return;
        };
        let hold = charge.take_hold();
        self.record_entry(event, hold);
    }

    /// Queues an event with its hold. Takes the parts rather than a built
    /// entry: the entry is then assembled where the queue reads it, instead
    /// of being stored once and copied again on the request path.
    #[inline]
    fn record_entry(mut self, event: UsageEvent, hold: Option<LeaseHold>) {
        // The place now belongs to the queued event; it comes back when the
        // writer delivers it, so dropping the permit must not return it.
        let Some(stripe) = self.stripe.take() else {
            return;
        };
        if stripe.events.push(Recorded { event, hold }).is_err() {
            // Unreachable while I20 holds: the permit's place is free.
            stripe.hub.overflowed.fetch_add(1, Ordering::Relaxed);
            debug_assert!(false, "I20: a permit's place was taken");
        }
        // Once the queue is closed the writer is draining for a deadline,
        // and waits for every event, not for a batch's worth. The places in
        // use (permits, events waiting, events being written) bound the
        // events waiting from above, so the queue's length, which reads
        // the writer's end of it, is read only when they could reach a
        // batch.
        let available = stripe.available.load(Ordering::Acquire);
        if available & CLOSED != 0
            || (stripe.capacity.saturating_sub(available & PLACES) >= stripe.wake_at
                && stripe.events.len() >= stripe.wake_at)
        {
            stripe.hub.waker.wake();
        }
    }
}

impl UsagePermit {
    /// Whether a commit must be refused: the writer has given up, so that
    /// an event recorded now would never be delivered (I21), or the
    /// instance has stopped starting handlers (I25). A commit checks it
    /// first and is refused rather than let a handler run unbilled, or be
    /// charged for work the shutdown may cut off.
    ///
    /// A commit that passes the check just before the writer gives up
    /// records into the abandoned queue; the writer's report finds the
    /// event there and counts it lost, so the charge is never lost silently.
    #[inline]
    pub(crate) fn refuses_commits(&self) -> bool {
        self.stripe
            .as_ref()
            .is_some_and(|stripe| stripe.available.load(Ordering::Relaxed) & REFUSE_COMMITS != 0)
    }

    /// Moves the place out, leaving this permit empty (dropping it then
    /// frees nothing).
    #[inline]
    pub(crate) fn take_place(&mut self) -> Option<Self> {
        self.stripe.take().map(|stripe| Self {
            stripe: Some(stripe),
        })
    }
}

impl Drop for UsagePermit {
    /// Inlined: every recorded permit is dropped empty on the request path,
    /// and that check should not cost a call.
    #[inline]
    fn drop(&mut self) {
        if let Some(stripe) = self.stripe.take() {
            give_back(&stripe);
        }
    }
}

/// Returns an unused permit's place to `stripe`.
#[cold]
fn give_back(stripe: &Stripe) {
    let before = stripe.available.fetch_add(1, Ordering::AcqRel);
    // A draining writer may be waiting for this place only.
    if before & CLOSED != 0 {
        stripe.hub.waker.wake();
    }
}

impl fmt::Debug for UsagePermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UsagePermit")
    }
}

impl UsageQueue {
    /// Moves up to `max` queued events into `batch`, stripe by stripe, each
    /// stripe's oldest first; returns how many. Their places stay taken until
    /// [`release`](Self::release).
    ///
    /// A take that fills up in some stripe leaves the next one to start at
    /// the stripe after it, so a backlog spread over the stripes goes out in
    /// one sweep; one that empties the queue leaves the next to start one
    /// stripe further than it did. Either way, a stripe that refills as fast
    /// as it is emptied cannot keep the others waiting.
    pub(crate) fn take_into(&self, batch: &mut Vec<UsageEvent>, max: usize) -> usize {
        let mut taken = self.lock_taken();
        let mut total = 0;
        let count = self.stripes.len();
        let start = self.take_from.load(Ordering::Relaxed) % count;
        let mut next = (start + 1) % count;
        for index in (start..count).chain(0..start) {
            let stripe = &self.stripes[index];
            while total < max {
                let Some(Recorded { event, hold }) = stripe.events.pop() else {
                    break;
                };
                batch.push(event);
                taken.push_back((index, hold));
                total += 1;
            }
            if total == max {
                next = (index + 1) % count;
                break;
            }
        }
        self.take_from.store(next, Ordering::Relaxed);
        total
    }

    /// Frees the places of the `delivered` events taken longest ago, and
    /// drops the charges they held: they left this process (written,
    /// rejected, or given up as lost).
    pub(crate) fn release(&self, delivered: usize) {
        let mut freed = Vec::with_capacity(delivered.min(self.hub.capacity));
        {
            let mut taken = self.lock_taken();
            for _ in 0..delivered {
                let Some(entry) = taken.pop_front() else {
                    debug_assert!(false, "I20: more places freed than were taken");
                    break;
                };
                freed.push(entry);
            }
        }
        for (index, hold) in freed {
            // The charge goes first, so a lease it held is quiescent by the
            // time the place is seen free.
            drop(hold);
            let stripe = &self.stripes[index];
            let before = stripe.available.fetch_add(1, Ordering::AcqRel) & PLACES;
            debug_assert!(
                before < stripe.capacity,
                "I20: more places freed than the stripe has"
            );
        }
    }

    /// Registers the writer to be woken when a batch's worth is waiting.
    pub(crate) fn register(&self, waker: &Waker) {
        self.hub.waker.register(waker);
    }

    /// Whether some stripe holds a batch's worth, or no stripe has a free
    /// place left and some event could free one; once the queue is closed,
    /// whether any event waits.
    pub(crate) fn batch_ready(&self) -> bool {
        let (mut waiting_anywhere, mut all_full) = (false, true);
        for stripe in &self.stripes[..] {
            let waiting = stripe.events.len();
            let available = stripe.available.load(Ordering::Acquire);
            if waiting >= stripe.wake_at || (waiting > 0 && available & CLOSED != 0) {
                return true;
            }
            waiting_anywhere |= waiting > 0;
            all_full &= available & PLACES == 0;
        }
        // Permits of requests in flight and a few events, less than a
        // batch, can take every place: admission is then refused (see
        // `full`), and delivering those few is what gives places back. One
        // full stripe alone is not that: admission borrows from the others.
        waiting_anywhere && all_full
    }

    /// Denies a permit because every place is taken, and wakes the writer:
    /// a stripe full of events and permits may hold less than a batch's
    /// worth of events, which alone would not wake it.
    #[cold]
    fn full(&self) -> Result<UsagePermit, DenyReason> {
        self.hub.waker.wake();
        Err(DenyReason::AccountingBackpressure)
    }

    /// Marks the queue as drained by a writer: from now on
    /// [`UsageRecorder::take_recorded`] refuses to take from it.
    pub(crate) fn own_by_writer(&self) {
        self.hub.writer_owned.store(true, Ordering::Relaxed);
    }

    /// Events waiting to be taken.
    pub(crate) fn len(&self) -> usize {
        self.stripes.iter().map(|stripe| stripe.events.len()).sum()
    }

    /// Events recorded and not yet released: queued, or taken by the writer
    /// and not yet answered for. The rest of the places in use are held by
    /// permits.
    pub(crate) fn undelivered(&self) -> usize {
        self.len() + self.lock_taken().len()
    }

    /// Whether the writer has given up on the queue: nothing recorded in
    /// it will be delivered.
    pub(crate) fn is_abandoned(&self) -> bool {
        self.stripes
            .iter()
            .all(|stripe| stripe.available.load(Ordering::Acquire) & ABANDONED != 0)
    }

    /// Whether the queue refuses new permits.
    pub(crate) fn is_closed(&self) -> bool {
        self.stripes
            .iter()
            .all(|stripe| stripe.available.load(Ordering::Acquire) & CLOSED != 0)
    }

    /// Records that nothing will deliver events from now on: commits of
    /// permits still outstanding are refused (see [`ABANDONED`]). The queue
    /// is closed too.
    pub(crate) fn abandon(&self) {
        for stripe in &self.stripes[..] {
            stripe
                .available
                .fetch_or(CLOSED | ABANDONED, Ordering::AcqRel);
        }
    }

    /// Refuses new permits and commits from now on: the instance's shutdown
    /// began, and no handler may start (see [`STOPPING`]). What is recorded
    /// is delivered as usual; permits still out come back as their requests
    /// end.
    pub(crate) fn stop_commits(&self) {
        for stripe in &self.stripes[..] {
            stripe
                .available
                .fetch_or(CLOSED | STOPPING, Ordering::AcqRel);
        }
        self.hub.waker.wake();
    }

    /// Refuses new permits from now on. Permits already taken still record.
    pub(crate) fn close(&self) {
        for stripe in &self.stripes[..] {
            stripe.available.fetch_or(CLOSED, Ordering::AcqRel);
        }
        self.hub.waker.wake();
    }

    /// Events lost because a permit found its place taken (always zero
    /// while I20 holds).
    pub(crate) fn overflowed(&self) -> u64 {
        self.hub.overflowed.load(Ordering::Relaxed)
    }

    /// Places held by outstanding permits and undelivered events.
    pub(crate) fn in_use(&self) -> usize {
        self.stripes
            .iter()
            .map(|stripe| stripe.capacity - (stripe.available.load(Ordering::Acquire) & PLACES))
            .sum()
    }

    fn lock_taken(&self) -> std::sync::MutexGuard<'_, VecDeque<(usize, Option<LeaseHold>)>> {
        // A list of entries cannot be left half-written by a panic.
        self.taken.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use jiff::Timestamp;

    use super::*;
    use crate::model::{AccountId, CostUnits, PolicyRevision, RequestId, UsageSource};

    fn event(id: u128) -> UsageEvent {
        UsageEvent {
            request_id: RequestId(id),
            account_id: AccountId(1),
            source: UsageSource::Overage,
            units: CostUnits(1),
            at: Timestamp::UNIX_EPOCH,
            policy_revision: PolicyRevision::UNSTATED,
            key_id: None,
        }
    }

    /// I17: a queue past the bound is refused with its reason before any
    /// place is allocated, rather than aborting on a failed allocation.
    #[test]
    #[should_panic(expected = "a usage queue has at most 4194304 places")]
    fn a_queue_past_the_bound_is_refused_before_allocating() {
        let _ = UsageRecorder::with_capacity(usize::MAX, 1);
    }

    /// I17: a wake threshold of zero is refused, not taken as one.
    #[test]
    #[should_panic(expected = "wakes its reader at one event or more")]
    fn a_queue_that_would_wake_at_no_event_is_refused() {
        let _ = UsageRecorder::with_capacity(4, 0);
    }

    #[test]
    fn a_full_queue_denies_with_backpressure_and_a_dropped_permit_frees_its_place() {
        let recorder = UsageRecorder::with_capacity(2, 2);
        let first = recorder.try_permit().unwrap();
        let second = recorder.try_permit().unwrap();
        assert_eq!(
            recorder.try_permit().unwrap_err(),
            DenyReason::AccountingBackpressure
        );
        drop(first);
        assert_eq!(recorder.available(), 1);
        second.record(event(1));
        let third = recorder.try_permit().unwrap();
        // I20: one queued event and one permit hold the two places.
        assert_eq!(recorder.available(), 0);
        assert_eq!(recorder.queued(), 1);
        drop(third);
    }

    #[test]
    fn a_recorded_event_keeps_its_place_until_delivered() {
        let recorder = UsageRecorder::with_capacity(3, 3);
        for id in 0..3 {
            recorder.try_permit().unwrap().record(event(id));
        }
        let queue = recorder.queue();
        let mut batch = Vec::new();
        assert_eq!(queue.take_into(&mut batch, 2), 2);
        assert_eq!(recorder.available(), 0, "taken is not yet delivered");
        queue.release(2);
        // I20: the two delivered places are free, the queued event holds one.
        assert_eq!(recorder.available(), 2);
        assert_eq!(queue.in_use(), 1);
        assert_eq!(queue.take_into(&mut batch, 2), 1);
        let mut ids: Vec<u128> = batch.iter().map(|e| e.request_id.get()).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![0, 1, 2], "every event comes out once");
        queue.release(1);
        assert_eq!(recorder.available(), 3);
    }

    #[test]
    fn one_threads_events_come_out_in_the_order_it_recorded_them() {
        let recorder = UsageRecorder::with_capacity(64, 64);
        for id in 0..5 {
            recorder.try_permit().unwrap().record(event(id));
        }
        let mut out = Vec::new();
        assert_eq!(recorder.take_recorded(&mut out, usize::MAX), 5);
        let ids: Vec<u128> = out.iter().map(|e| e.request_id.get()).collect();
        assert_eq!(ids, vec![0, 1, 2, 3, 4]);
        assert_eq!(recorder.available(), 64);
    }

    fn two_stripes(capacity: usize) -> UsageRecorder {
        UsageRecorder::striped(capacity, capacity, LocalSharding::shards(2).unwrap())
    }

    /// Free places per stripe.
    fn free_by_stripe(recorder: &UsageRecorder) -> Vec<usize> {
        recorder
            .queue()
            .stripes
            .iter()
            .map(|stripe| stripe.available.load(Ordering::Acquire) & PLACES)
            .collect()
    }

    #[test]
    fn a_thread_whose_stripe_is_full_borrows_a_place_from_another() {
        let recorder = two_stripes(4);
        let home = Locality::new(0);
        let held: Vec<_> = (0..2)
            .map(|_| recorder.try_permit_at(home).unwrap())
            .collect();
        assert_eq!(free_by_stripe(&recorder), vec![0, 2], "home first");
        // I20: the queue's capacity is shared: a full home stripe borrows.
        let borrowed = recorder.try_permit_at(home).unwrap();
        assert_eq!(free_by_stripe(&recorder), vec![0, 1]);
        borrowed.record(event(1));
        assert_eq!(
            recorder.queue().stripes[1].events.len(),
            1,
            "recorded in the stripe its place is in"
        );
        let last = recorder.try_permit_at(home).unwrap();
        assert_eq!(
            recorder.try_permit_at(home).unwrap_err(),
            DenyReason::AccountingBackpressure
        );
        drop((held, last));
        assert_eq!(free_by_stripe(&recorder), vec![2, 1]);
    }

    /// A stripe refilled as fast as the writer empties it must not keep the
    /// others' events (and the lease holds riding with them) waiting: each
    /// take starts one stripe further.
    #[test]
    fn takes_start_at_each_stripe_in_turn() {
        let recorder = two_stripes(8);
        for (id, locality) in [(0, 0), (1, 0), (10, 1), (11, 1)] {
            let permit = recorder.try_permit_at(Locality::new(locality)).unwrap();
            permit.record(event(id));
        }
        let queue = recorder.queue();
        let mut taken = Vec::new();
        for _ in 0..4 {
            let mut batch = Vec::new();
            assert_eq!(queue.take_into(&mut batch, 1), 1);
            queue.release(1);
            taken.push(batch[0].request_id.get());
            // The first stripe refills at once, as under steady load.
            if batch[0].request_id.get() < 10 {
                let permit = recorder.try_permit_at(Locality::new(0)).unwrap();
                permit.record(event(2 + taken.len() as u128));
            }
        }
        assert_eq!(taken, vec![0, 10, 1, 11], "the stripes alternate");
    }

    /// A take that fills up part-way through the stripes leaves the next
    /// one to start at the stripe after the one it stopped in, so a backlog
    /// spread over the stripes goes out in one sweep: the stripe the first
    /// take did not reach comes first in the second.
    #[test]
    fn a_take_that_fills_up_leaves_the_next_to_start_past_it() {
        let recorder = UsageRecorder::striped(12, 12, LocalSharding::shards(3).unwrap());
        for stripe in 0..3_u128 {
            for id in 0..3 {
                let permit = recorder
                    .try_permit_at(Locality::new(usize::try_from(stripe).unwrap()))
                    .unwrap();
                permit.record(event(stripe * 10 + id));
            }
        }
        let queue = recorder.queue();
        let mut takes = Vec::new();
        for _ in 0..3 {
            let mut batch = Vec::new();
            queue.take_into(&mut batch, 4);
            queue.release(batch.len());
            takes.push(batch.iter().map(|e| e.request_id.get()).collect::<Vec<_>>());
        }
        assert_eq!(
            takes,
            vec![vec![0, 1, 2, 10], vec![20, 21, 22, 11], vec![12]],
            "the third stripe goes before the rest of the second"
        );
    }

    /// A few events with every place taken make the queue ready to drain;
    /// one full stripe alone does not, as admission borrows from the others.
    #[test]
    fn a_full_queue_is_ready_to_drain_and_one_full_stripe_is_not() {
        let recorder = UsageRecorder::striped(4, 4, LocalSharding::shards(2).unwrap());
        let at = Locality::new;
        // Stripe 0: one event and one permit, full.
        recorder.try_permit_at(at(0)).unwrap().record(event(1));
        let _held = recorder.try_permit_at(at(0)).unwrap();
        assert_eq!(free_by_stripe(&recorder), vec![0, 2]);
        assert!(!recorder.queue().batch_ready(), "stripe 1 still has room");
        // Stripe 1 fills with permits: nothing is free anywhere.
        let _more = [
            recorder.try_permit_at(at(1)).unwrap(),
            recorder.try_permit_at(at(1)).unwrap(),
        ];
        assert!(recorder.queue().batch_ready());
    }

    /// A queue full of events and permits may hold less than a batch's worth
    /// of events; the denial wakes the writer so the places come back before
    /// its next flush tick.
    #[test]
    fn a_denial_for_backpressure_wakes_the_writer() {
        struct Count(std::sync::atomic::AtomicUsize);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let recorder = UsageRecorder::striped(2, 2, LocalSharding::Single);
        let count = Arc::new(Count(std::sync::atomic::AtomicUsize::new(0)));
        recorder.queue().register(&Waker::from(Arc::clone(&count)));
        recorder.try_permit().unwrap().record(event(1));
        let _held = recorder.try_permit().unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 0, "one event is no batch");
        assert_eq!(
            recorder.try_permit().unwrap_err(),
            DenyReason::AccountingBackpressure
        );
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_closed_queue_refuses_new_permits_but_records_outstanding_ones() {
        let recorder = UsageRecorder::with_capacity(4, 4);
        let outstanding = recorder.try_permit().unwrap();
        recorder.queue().close();
        assert_eq!(recorder.try_permit().unwrap_err(), DenyReason::ShuttingDown);
        outstanding.record(event(9));
        assert_eq!(recorder.queued(), 1);
        assert_eq!(recorder.queue().overflowed(), 0);
    }

    /// I20: four threads released at once take places until refused, each
    /// round on a fresh queue. Exactly the capacity is handed out, whoever
    /// wins, and every permit's event is queued.
    #[test]
    fn racing_permits_never_exceed_the_capacity() {
        const CAPACITY: usize = 64;
        const RACERS: usize = 4;
        let mut shared_rounds = 0;
        for round in 0..200_u128 {
            let recorder = UsageRecorder::with_capacity(CAPACITY, CAPACITY);
            let start = std::sync::Barrier::new(RACERS);
            let counts: Vec<usize> = std::thread::scope(|scope| {
                let racers: Vec<_> = (0..RACERS as u128)
                    .map(|racer| {
                        let (recorder, start) = (recorder.clone(), &start);
                        scope.spawn(move || {
                            start.wait();
                            let mut held = Vec::new();
                            while let Ok(permit) = recorder.try_permit() {
                                held.push(permit);
                            }
                            let count = held.len();
                            for (i, permit) in held.into_iter().enumerate() {
                                permit.record(event(round << 32 | racer << 16 | i as u128));
                            }
                            count
                        })
                    })
                    .collect();
                racers.into_iter().map(|r| r.join().unwrap()).collect()
            });
            assert_eq!(counts.iter().sum::<usize>(), CAPACITY, "round {round}");
            assert_eq!(recorder.queued(), CAPACITY);
            assert_eq!(recorder.queue().overflowed(), 0);
            if counts.iter().filter(|&&count| count > 0).count() > 1 {
                shared_rounds += 1;
            }
        }
        assert!(
            shared_rounds > 0,
            "no round had two threads taking places at once"
        );
    }
}
