//! Request ids that no two requests share, on any instance, with no
//! coordination and no shared counter on the request path.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::model::RequestId;

/// Mints request ids: a random 64-bit prefix per process, then a thread
/// number and a per-thread counter (I8).
///
/// Two processes collide only if their random prefixes do (one chance in
/// 2⁶⁴ per pair). Within a process every thread numbers its own requests, so
/// minting touches no shared memory.
#[derive(Debug, Clone, Copy)]
pub struct RequestIds {
    prefix: u64,
}

/// Bits of the low half given to the per-thread counter; the rest number
/// the thread.
const COUNTER_BITS: u32 = 40;

static NEXT_THREAD: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's number (shifted into place) and next counter value.
    static LOCAL: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
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

    /// Ids under a given prefix, for tests and for deployments that assign
    /// instance numbers themselves.
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
        let low = LOCAL.with(|local| {
            let (thread, counter) = match local.get() {
                Some((thread, counter)) if counter < 1 << COUNTER_BITS => (thread, counter),
                // First use on this thread, or its counter ran out: take a
                // new thread number.
                _ => (
                    NEXT_THREAD.fetch_add(1, Ordering::Relaxed) << COUNTER_BITS,
                    0,
                ),
            };
            local.set(Some((thread, counter + 1)));
            thread | counter
        });
        (self.prefix, low)
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
