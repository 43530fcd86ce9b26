//! Request ids that no two requests share, on any instance, with no
//! coordination and no shared counter on the request path.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::model::RequestId;

/// Mints request ids: a random 64-bit prefix per process, then a thread
/// number and a per-thread counter (I8).
///
/// Two processes collide only if the prefixes they use do: with random
/// prefixes, one chance in 2⁶⁴ per pair of eras in use (see below), and a
/// process rarely leaves its first era. Within a process every thread
/// numbers its own requests, so minting touches no shared memory.
///
/// The low half has room for 2²⁴ thread numbers. A process that outlives
/// them (a blocking pool that starts and retires threads for months) moves
/// on to a new *era*: the same thread numbers again, under the prefix
/// shifted by an odd stride per era. Distinct eras therefore never share a
/// prefix, and no id repeats however many threads come and go.
#[derive(Debug, Clone, Copy)]
pub struct RequestIds {
    prefix: u64,
}

/// Bits of the low half given to the per-thread counter; the rest number
/// the thread.
const COUNTER_BITS: u32 = 40;

/// Thread numbers one era holds.
const THREADS_PER_ERA: u64 = 1 << (u64::BITS - COUNTER_BITS);

/// How far each era moves the prefix. Odd, so `era × stride` takes a
/// different value for every era below 2⁶⁴.
const ERA_STRIDE: u64 = 0x9e37_79b9_7f4a_7c15;

/// The next thread number to hand out, counting across eras.
static NEXT_THREAD: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's place: its era's prefix offset, its thread number
    /// shifted into place, and its next counter value.
    static LOCAL: Cell<Option<Place>> = const { Cell::new(None) };
}

#[derive(Clone, Copy)]
struct Place {
    prefix_offset: u64,
    thread: u64,
    counter: u64,
}

impl Place {
    /// The place of the `number`th thread number handed out, counter at 0.
    const fn new(number: u64) -> Self {
        Self {
            prefix_offset: (number / THREADS_PER_ERA).wrapping_mul(ERA_STRIDE),
            thread: (number % THREADS_PER_ERA) << COUNTER_BITS,
            counter: 0,
        }
    }
}

impl RequestIds {
    /// Ids under a fresh random prefix.
    ///
    /// # Errors
    ///
    /// When the operating system cannot supply randomness.
    pub fn random() -> Result<Self, getrandom::Error> {
        let mut bytes = [0_u8; 8];
        getrandom::fill(&mut bytes)?;
        Ok(Self::with_prefix(u64::from_le_bytes(bytes)))
    }

    /// Ids under a given prefix, for tests and for deployments with a
    /// source of prefixes that never repeats.
    ///
    /// A prefix must never be used by two processes, and that includes a
    /// later run of the same instance: thread numbers and counters start
    /// again from zero in every process, so a restarted instance with a
    /// fixed prefix mints the ids of its previous run again. The store then
    /// rejects their usage events as conflicting duplicates, and those
    /// charges are never billed. An instance number alone is therefore not
    /// a prefix; prefer [`random`](Self::random).
    #[must_use]
    pub const fn with_prefix(prefix: u64) -> Self {
        Self { prefix }
    }

    /// The next id.
    #[inline]
    #[must_use]
    pub fn next(&self) -> RequestId {
        let (prefix, low) = self.next_parts();
        RequestId::from_parts(prefix, low)
    }

    /// The next id as its prefix and counter halves, for
    /// [`RequestId::from_parts`].
    #[inline]
    pub(crate) fn next_parts(self) -> (u64, u64) {
        self.next_parts_numbered_by(&NEXT_THREAD)
    }

    /// [`next_parts`](Self::next_parts), taking thread numbers from
    /// `threads`: tests give it a counter of their own.
    #[inline]
    fn next_parts_numbered_by(self, threads: &AtomicU64) -> (u64, u64) {
        let place = LOCAL.with(|local| {
            let place = match local.get() {
                Some(place) if place.counter < 1 << COUNTER_BITS => place,
                // First use on this thread, or its counter ran out: take a
                // new thread number.
                _ => Place::new(threads.fetch_add(1, Ordering::Relaxed)),
            };
            local.set(Some(Place {
                counter: place.counter + 1,
                ..place
            }));
            place
        });
        (
            self.prefix.wrapping_add(place.prefix_offset),
            place.thread | place.counter,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn ids_are_unique_across_threads() {
        let ids = RequestIds::with_prefix(7);
        let minted: Vec<RequestId> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| (0..10_000).map(|_| ids.next()).collect::<Vec<_>>()))
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap())
                .collect()
        });
        let distinct: HashSet<_> = minted.iter().copied().collect();
        assert_eq!(distinct.len(), 40_000, "I8: every request id is distinct");
        assert!(minted.iter().all(|id| id.get() >> 64 == 7));
    }

    /// Mints `n` ids on a new thread, numbered by `threads`.
    fn minted_on_a_new_thread(threads: &'static AtomicU64, n: usize) -> Vec<(u64, u64)> {
        let ids = RequestIds::with_prefix(11);
        std::thread::spawn(move || {
            (0..n)
                .map(|_| ids.next_parts_numbered_by(threads))
                .collect()
        })
        .join()
        .unwrap()
    }

    /// I8: a thread that gets an earlier thread's number an era later mints
    /// ids the earlier one never did.
    #[test]
    fn a_thread_number_reused_in_a_later_era_mints_new_ids() {
        static THREADS: AtomicU64 = AtomicU64::new(0);
        let first = minted_on_a_new_thread(&THREADS, 3);
        THREADS.store(THREADS_PER_ERA, Ordering::Relaxed);
        let later = minted_on_a_new_thread(&THREADS, 3);
        assert_eq!(
            later.iter().map(|&(_, low)| low).collect::<Vec<_>>(),
            first.iter().map(|&(_, low)| low).collect::<Vec<_>>(),
            "the same thread number and counters"
        );
        assert!(first.iter().all(|&(prefix, _)| prefix == 11));
        assert!(
            later
                .iter()
                .all(|&(prefix, _)| prefix == 11_u64.wrapping_add(ERA_STRIDE)),
            "I8: the later era mints under a prefix of its own"
        );
    }

    #[test]
    fn eras_shift_the_prefix_by_distinct_offsets() {
        let places: Vec<Place> = [
            0,
            1,
            THREADS_PER_ERA - 1,
            THREADS_PER_ERA,
            5 * THREADS_PER_ERA + 1,
        ]
        .into_iter()
        .map(Place::new)
        .collect();
        let keys: HashSet<(u64, u64)> = places
            .iter()
            .map(|place| (place.prefix_offset, place.thread))
            .collect();
        assert_eq!(
            keys.len(),
            places.len(),
            "every thread number has its own place"
        );
        assert_eq!(places[0].prefix_offset, 0, "the first era keeps the prefix");
        assert_eq!(
            places[0].thread, places[3].thread,
            "an era later, the same thread bits"
        );
        assert_ne!(places[0].prefix_offset, places[3].prefix_offset);
    }

    #[test]
    fn different_prefixes_never_collide() {
        let a = RequestIds::with_prefix(1).next();
        let b = RequestIds::with_prefix(2).next();
        assert_ne!(a, b);
        assert_ne!(
            RequestIds::random().unwrap().next().get() >> 64,
            RequestIds::random().unwrap().next().get() >> 64
        );
    }
}
