//! The one place production code takes its atomics from.
//!
//! Under `--cfg tollgate_loom` the same code runs against loom's model-checked
//! atomics; otherwise these are the standard library's. The cfg is tollgate's
//! own on purpose: a global `--cfg loom` would switch tokio into its loom mode
//! too, and every crate built on tokio's networking would stop compiling.
//!
//! `Arc` is deliberately not routed through here. The models check the phase
//! and counter protocols, and the usage queue's word of free places; reference counts only decide when a lease is
//! quiescent, which the lease manager reads from a single task.

#[cfg(not(tollgate_loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

#[cfg(tollgate_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Runs `f` on the value of an atomic the caller holds exclusively. With
/// `&mut` no other thread can race, so this is a plain memory access; loom
/// spells it differently from the standard library.
#[cfg(not(tollgate_loom))]
#[inline]
pub(crate) fn with_exclusive<R>(atomic: &mut AtomicU64, f: impl FnOnce(&mut u64) -> R) -> R {
    f(atomic.get_mut())
}

#[cfg(tollgate_loom)]
pub(crate) fn with_exclusive<R>(atomic: &mut AtomicU64, f: impl FnOnce(&mut u64) -> R) -> R {
    atomic.with_mut(f)
}
