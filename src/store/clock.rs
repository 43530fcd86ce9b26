//! Where the runtime gets `now` from. Stores never read a clock themselves
//! (I13); the runtime reads one of these and passes the instant along.

use std::fmt;
use std::sync::Mutex;

use jiff::{SignedDuration, Timestamp};

/// A source of the current time.
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current instant.
    fn now(&self) -> Timestamp;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock that moves only when told to. For tests and simulations.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<Timestamp>,
}

impl ManualClock {
    /// A clock reading `start`.
    #[must_use]
    pub fn new(start: Timestamp) -> Self {
        Self {
            now: Mutex::new(start),
        }
    }

    /// Moves the clock by `by`, which may be negative: clocks do jump back.
    ///
    /// # Panics
    ///
    /// When the result is outside jiff's timestamp range.
    pub fn advance(&self, by: SignedDuration) {
        let mut now = self.lock();
        *now = now
            .checked_add(by)
            .expect("a manual clock stays within the timestamp range");
    }

    /// Sets the clock to `to`.
    pub fn set(&self, to: Timestamp) {
        *self.lock() = to;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Timestamp> {
        // A timestamp cannot be left half-written, so a poisoned lock still
        // holds a valid reading.
        self.now
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        *self.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let start = Timestamp::from_second(100).unwrap();
        let clock = ManualClock::new(start);
        assert_eq!(clock.now(), start);
        clock.advance(SignedDuration::from_secs(5));
        assert_eq!(clock.now(), Timestamp::from_second(105).unwrap());
        clock.advance(SignedDuration::from_secs(-10));
        assert_eq!(clock.now(), Timestamp::from_second(95).unwrap());
        clock.set(start);
        assert_eq!(clock.now(), start);
    }
}
