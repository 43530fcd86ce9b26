//! The background planes: the tasks that keep leases stocked, policy fresh
//! and usage written, off the request path, and the [`InstanceRuntime`]
//! that supervises them.

mod instance;
mod lease_manager;
mod reclaimer;
mod snapshot_manager;
mod usage_writer;

pub use instance::{
    AccountReport, InstanceRuntime, InstanceRuntimeConfig, InstanceRuntimeConfigError,
    RuntimeHandle, RuntimeReport, RuntimeShutdownReport,
};
pub use lease_manager::*;
pub use reclaimer::*;
pub use snapshot_manager::*;
pub use usage_writer::{
    UsageWriter, UsageWriterConfig, UsageWriterConfigError, WriterHealth, WriterReport, WriterStats,
};

/// The shortest wait tokio's timer can tell apart from zero: it keeps time in
/// whole milliseconds, so a sleep, an interval or a timeout shorter than this
/// ends at the next millisecond, or, for an interval, fires back to back.
/// Every interval, backoff and call timeout of the planes must be at least
/// this long (I17): a configuration asking for less is refused rather than
/// run at a rate it did not ask for.
pub(crate) const TIMER_RESOLUTION: std::time::Duration = std::time::Duration::from_millis(1);

/// Adds `by` to a shared count, saturating: a count that cannot grow says
/// "at least this many" rather than wrapping to a small, false number.
fn bump(counter: &std::sync::atomic::AtomicU64, by: u64) {
    use std::sync::atomic::Ordering;
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |current| {
        Some(current.saturating_add(by))
    });
}

/// `from + wait`, with waits beyond thirty years treated as thirty years.
///
/// Every deadline the planes compute goes through here: `Instant`
/// arithmetic panics on overflow, so a configured wait as long as
/// `Duration::MAX` (which validation accepts: any positive wait is a valid
/// choice) must not reach it, and a wait of thirty years never ends in
/// practice either way, as tokio's own timers assume.
fn after(from: tokio::time::Instant, wait: std::time::Duration) -> tokio::time::Instant {
    const FAR_FUTURE: std::time::Duration = std::time::Duration::from_secs(86_400 * 365 * 30);
    from + wait.min(FAR_FUTURE)
}
