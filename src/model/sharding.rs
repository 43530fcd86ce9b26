//! How a lease's units are spread over cache lines, and which line a thread
//! uses.
//!
//! A single shared counter is cheap while one core debits it; with several
//! cores each debit has to pull the cache line over first, and the cost grows
//! with the number of cores contending. Sharding splits a lease into counters
//! on separate lines and lets each thread debit "its" counter, so threads
//! serving one account stop contending.

use std::cell::Cell;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::model::CostUnits;

/// How many counters a [`LocalLease`](crate::LocalLease) spreads its units
/// over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalSharding {
    /// One counter. Best when a handful of threads serve the account.
    Single,
    /// `n` counters on separate cache lines, at most
    /// [`LocalSharding::MAX_SHARDS`]; made with
    /// [`LocalSharding::shards`].
    Shards(ShardCount),
}

/// A number of shards from 1 to [`LocalSharding::MAX_SHARDS`]. Only
/// [`LocalSharding::shards`] makes one, so no layout can ask for more
/// counters than a lease may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardCount(NonZeroUsize);

impl ShardCount {
    /// The number of shards.
    #[must_use]
    pub const fn get(self) -> usize {
        self.0.get()
    }
}

impl LocalSharding {
    /// The largest number of shards a lease may have.
    pub const MAX_SHARDS: usize = 64;

    /// `n` shards, or `None` when `n` is zero or above
    /// [`MAX_SHARDS`](Self::MAX_SHARDS).
    #[must_use]
    pub const fn shards(n: usize) -> Option<Self> {
        if n > Self::MAX_SHARDS {
            return None;
        }
        match NonZeroUsize::new(n) {
            Some(n) => Some(Self::Shards(ShardCount(n))),
            None => None,
        }
    }

    /// One shard per available core, capped at
    /// [`MAX_SHARDS`](Self::MAX_SHARDS).
    #[must_use]
    pub fn per_core() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
        Self::shards(cores.min(Self::MAX_SHARDS)).unwrap_or(Self::Single)
    }

    /// The number of counters this layout creates.
    #[must_use]
    pub const fn count(self) -> usize {
        match self {
            Self::Single => 1,
            Self::Shards(n) => n.get(),
        }
    }
}

/// The calling thread's preferred shard, resolved once per thread.
///
/// Threads are numbered in the order they first ask, so the worker threads of
/// a runtime land on consecutive shards. The mapping is a hint for cache
/// locality only; correctness never depends on which shard a thread uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Locality(usize);

impl Locality {
    /// The calling thread's locality: one thread-local read after the first
    /// call on a thread.
    #[inline]
    #[must_use]
    pub fn current() -> Self {
        thread_local! {
            static INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
        }
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        INDEX.with(|index| {
            let mut value = index.get();
            if value == usize::MAX {
                // A counter, not a modulus: two threads never share an index, so
                // they share a shard only when there are fewer shards than
                // threads.
                value = NEXT.fetch_add(1, Ordering::Relaxed);
                index.set(value);
            }
            Self(value)
        })
    }

    /// A fixed locality, for callers that pin work to shards themselves.
    #[must_use]
    pub const fn new(index: usize) -> Self {
        Self(index)
    }

    /// The thread number itself. Numbers from [`current`](Self::current)
    /// are never shared by two threads.
    #[inline]
    pub(crate) const fn index(self) -> usize {
        self.0
    }

    /// The shard this locality maps to among `shards` shards.
    ///
    /// Shard and stripe counts are small and usually a power of two (one
    /// counter, or one per core), so the common cases are a mask rather than
    /// a division, which costs tens of cycles on the request path.
    #[inline]
    pub(crate) const fn shard_of(self, shards: usize) -> usize {
        if shards.is_power_of_two() {
            self.0 & (shards - 1)
        } else {
            self.0 % shards
        }
    }
}

/// A point-in-time reading of how a lease's units sit across its shards.
///
/// Each field is read without stopping debits, so under load the fields may
/// describe slightly different instants; it is for metrics and diagnostics,
/// never for accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardOccupancy {
    /// How many shards the lease has.
    pub shards: usize,
    /// The least any shard held.
    pub remaining_min: CostUnits,
    /// The most any shard held.
    pub remaining_max: CostUnits,
    /// Shards at or below their share of the low-water mark.
    pub below_low_water: usize,
    /// Outstanding debits (pending or committed reservations not yet dropped)
    /// holding a view of some shard.
    pub views_outstanding: usize,
}

/// Splits `total` into `parts` amounts that differ by at most one and add up
/// to `total` exactly; the first shards take the remainder.
pub(crate) fn split_evenly(total: u64, parts: usize, index: usize) -> u64 {
    let parts = parts as u64;
    let index = index as u64;
    total / parts + u64::from(index < total % parts)
}

/// Aligns its contents to a cache-line pair so two values never share one.
/// 128 bytes covers the adjacent-line prefetcher on x86 and the 128-byte
/// lines of some ARM cores.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct CachePadded<T>(pub(crate) T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_even_split_adds_up_to_the_whole() {
        for total in [0, 1, 7, 100, 101, u64::MAX] {
            for parts in 1..=9 {
                let parts_sum: u128 = (0..parts)
                    .map(|index| u128::from(split_evenly(total, parts, index)))
                    .sum();
                assert_eq!(parts_sum, u128::from(total), "total {total} in {parts}");
                let largest = split_evenly(total, parts, 0);
                let smallest = split_evenly(total, parts, parts - 1);
                assert!(largest - smallest <= 1);
            }
        }
    }

    #[test]
    fn shard_counts_are_bounded() {
        assert_eq!(LocalSharding::shards(0), None);
        assert_eq!(LocalSharding::shards(LocalSharding::MAX_SHARDS + 1), None);
        assert_eq!(LocalSharding::shards(4).map(LocalSharding::count), Some(4));
        assert_eq!(LocalSharding::Single.count(), 1);
        assert!(LocalSharding::per_core().count() <= LocalSharding::MAX_SHARDS);
    }

    #[test]
    fn a_thread_keeps_its_locality() {
        let first = Locality::current();
        assert_eq!(Locality::current(), first);
        let other = std::thread::spawn(Locality::current).join().unwrap();
        assert_ne!(other, first, "a new thread takes the next index");
    }

    #[test]
    fn a_locality_maps_into_range() {
        for shards in 1..=8 {
            for index in 0..100 {
                assert!(Locality::new(index).shard_of(shards) < shards);
            }
        }
    }
}
