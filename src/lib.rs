//! Meter and gate HTTP APIs on prepaid balances.
//!
//! tollgate admits each request by reserving its price against a locally
//! *leased* slice of the caller's account balance, commits the charge when the
//! handler starts, and releases it for zero when the request ends before
//! execution. The engine's admission and commit use atomics only: no I/O, no
//! lock and no heap allocation. (The HTTP layer adds a few small allocations
//! per admitted request, for its request extension and request-id header;
//! its deferred commit point, two more and an uncontended lock.)
//!
//! The crate is layered; each module depends only on the ones listed before
//! it:
//!
//! - [`model`]: the pure accounting types and their atomics. No tokio, no I/O.
//! - [`store`]: the ports the system talks to (allocator, usage sink,
//!   snapshot source) and the embedded [`MemoryStore`](store::MemoryStore).
//! - [`admission`]: the request path — snapshot map, lease slots, the
//!   admission engine and the usage queue.
//! - [`runtime`]: the background planes and the
//!   [`InstanceRuntime`](runtime::InstanceRuntime) that supervises them.
//! - [`layer`]: the tower layer, denials, and the ops router.
//!
//! The numbered rules the code enforces live in `INVARIANTS.md` at the root of
//! the repository; comments and tests cite them as `I<n>`.
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod admission;
pub mod layer;
pub mod model;
pub mod runtime;
pub mod store;
mod sync;

pub use model::{
    AccountId, AccountOverage, AccountStatus, BalanceExhaustion, BalanceShortfall, CancelHandle,
    CancelOutcome, CommitError, CommitFunding, CostUnits, DenyReason, EnforcementMode,
    FencingToken, KeyHash, KeyId, KeyStatus, LeaseDebit, LeaseGrant, LeaseId, LocalLease,
    LocalSharding, Locality, PermissionBits, PolicyRevision, Principal, PrincipalSnapshot,
    RefillSignal, RefillVerdict, RequestId, Reservation, Retry, ShardCount, ShardOccupancy,
    SharedCharge, UsageEvent, UsageSource,
};

/// Compiles and runs the README's examples as doctests, so the first code a
/// newcomer reads cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
