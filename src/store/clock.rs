//! Where the runtime gets `now` from. Stores never read a clock themselves
//! (I13); the runtime reads one of these and passes the instant along.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

/// A source of the current time.
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current instant.
    fn now(&self) -> Timestamp;

    /// How far behind the true time [`now`](Self::now) may read. Leases'
    /// safety margins must exceed it, or a request could commit against a
    /// lease the allocator already treats as expired (I2).
    fn staleness_bound(&self) -> Duration {
        Duration::ZERO
    }
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock for the request path: a timestamp refreshed by a background
/// ticker and read with one atomic load, instead of a system call per
/// request (reading the system clock costs about as much as a whole
/// admission).
///
/// It reads at most two ticks behind ([`staleness_bound`](Clock::staleness_bound)),
/// which the runtime checks against the leases' safety margin, as long as
/// its ticker task gets to run every tick: run it on a multi-threaded
/// runtime whose workers no handler blocks. A runtime stalled longer than
/// the margin's slack (a blocking handler on a current-thread runtime, a
/// paused process) lets it fall behind by the whole stall, and a request
/// admitted then may commit against a lease past its window by that much.
/// Dropping the last handle stops the ticker.
pub struct CoarseClock {
    nanos: Arc<AtomicI64>,
    tick: Duration,
    ticker: tokio::task::JoinHandle<()>,
}

/// Why a [`CoarseClock`] could not start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CoarseClockError {
    /// The tick must be positive.
    TickZero,
    /// The tick is shorter than tokio's timer resolution (one
    /// millisecond): the ticker would refresh only once a millisecond, and
    /// the clock would lag more than the two ticks it vouches for.
    TickBelowTimerResolution,
}

impl fmt::Display for CoarseClockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::TickZero => "coarse clock: tick must be positive",
            Self::TickBelowTimerResolution => {
                "coarse clock: tick must be at least one millisecond (the timer's resolution)"
            }
        })
    }
}

impl std::error::Error for CoarseClockError {}

impl CoarseClock {
    /// Starts a clock refreshed every `tick`.
    ///
    /// # Errors
    ///
    /// [`CoarseClockError::TickZero`], then
    /// [`CoarseClockError::TickBelowTimerResolution`].
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn start(tick: Duration) -> Result<Self, CoarseClockError> {
        if tick.is_zero() {
            return Err(CoarseClockError::TickZero);
        }
        if tick < crate::runtime::TIMER_RESOLUTION {
            return Err(CoarseClockError::TickBelowTimerResolution);
        }
        let nanos = Arc::new(AtomicI64::new(system_nanos()));
        let written = Arc::clone(&nanos);
        let ticker = tokio::spawn(async move {
            let mut interval = tokio::time::interval(tick);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                interval.tick().await;
                written.store(system_nanos(), Ordering::Relaxed);
            }
        });
        Ok(Self {
            nanos,
            tick,
            ticker,
        })
    }
}

fn system_nanos() -> i64 {
    // Saturates in the year 2262; jiff's range is wider than an i64.
    i64::try_from(Timestamp::now().as_nanosecond()).unwrap_or(i64::MAX)
}

impl Clock for CoarseClock {
    #[inline]
    fn now(&self) -> Timestamp {
        Timestamp::from_nanosecond(i128::from(self.nanos.load(Ordering::Relaxed)))
            .unwrap_or(Timestamp::MAX)
    }

    fn staleness_bound(&self) -> Duration {
        self.tick.saturating_mul(2)
    }
}

impl Drop for CoarseClock {
    fn drop(&mut self) {
        self.ticker.abort();
    }
}

impl fmt::Debug for CoarseClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CoarseClock")
            .field("tick", &self.tick)
            .field("now", &self.now())
            .finish_non_exhaustive()
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

    #[tokio::test]
    async fn a_coarse_clock_moves_forward_and_never_reads_ahead_of_the_system_clock() {
        assert_eq!(
            CoarseClock::start(Duration::ZERO).unwrap_err(),
            CoarseClockError::TickZero
        );
        assert_eq!(
            CoarseClock::start(Duration::from_micros(999)).unwrap_err(),
            CoarseClockError::TickBelowTimerResolution,
            "a tick the timer cannot keep would lag more than it vouches for"
        );
        let clock = CoarseClock::start(Duration::from_millis(1)).unwrap();
        assert_eq!(clock.staleness_bound(), Duration::from_millis(2));
        let first = clock.now();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let later = clock.now();
        assert!(later > first, "the ticker moves it forward");
        assert!(
            later <= Timestamp::now(),
            "it never reads ahead of the system clock"
        );
    }

    /// The staleness bound rests on the ticker's cadence: one refresh per
    /// tick, none between. Tokio's paused clock drives the ticks; the system
    /// clock is the real one, so each refresh must land on a later reading.
    #[tokio::test(start_paused = true)]
    async fn a_coarse_clock_refreshes_once_a_tick_and_never_reads_ahead() {
        async fn let_the_ticker_run() {
            for _ in 0..8 {
                tokio::task::yield_now().await;
            }
        }
        let tick = Duration::from_secs(3_600);
        let clock = CoarseClock::start(tick).unwrap();
        assert_eq!(clock.staleness_bound(), tick * 2);
        let_the_ticker_run().await;
        let first = clock.now();
        // The system clock moves past the value held, so a refresh shows.
        while Timestamp::now() <= first {
            std::hint::spin_loop();
        }
        let just_short = Duration::from_secs(3_599);
        tokio::time::advance(just_short).await;
        let_the_ticker_run().await;
        assert_eq!(clock.now(), first, "no refresh before the tick");
        tokio::time::advance(Duration::from_secs(1)).await;
        let_the_ticker_run().await;
        let refreshed = clock.now();
        assert!(refreshed > first, "the tick refreshed it");
        assert!(
            refreshed <= Timestamp::now(),
            "it never reads ahead of the system clock"
        );
    }

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
