//! The accounting model: cost units, leases, overage, reservations, and the
//! reasons to deny.
//!
//! # Architecture invariant
//!
//! Nothing in this module performs I/O, spawns, sleeps, locks or reads a
//! clock. Time arrives as a `now` argument; concurrency is atomics only,
//! taken through the crate's one facade so the same code runs under loom.
//! Everything above it (stores, admission, the runtime, the layer) builds on
//! these types, and nothing here knows those exist.
//!
//! # The charging rules
//!
//! - Admission *reserves* the quote: a [`Reservation`] debits a
//!   [`LocalLease`] (or, for an Elastic account with no lease funding,
//!   [`AccountOverage`]). The charge is pending.
//! - Execution start *commits* the full quote
//!   ([`Reservation::commit_at_execution_start`]); it stands however the
//!   work ends.
//! - Anything that ends the request before execution releases the units for
//!   zero: [`Reservation::cancel`], or simply dropping the reservation.
//! - Commit and cancel race on one compare-exchange; exactly one wins.
//! - A committed reservation yields exactly one [`UsageEvent`], keyed by its
//!   [`RequestId`].

mod deny;
mod funding;
mod ids;
mod key_hash;
mod lease;
mod overage;
mod reservation;
pub(crate) mod sharding;
mod snapshot;
mod units;
mod usage;

pub use deny::{DenyReason, Retry};
pub use funding::{BalanceExhaustion, BalanceShortfall};
pub use ids::{AccountId, FencingToken, KeyId, LeaseId, PolicyRevision, Principal, RequestId};
pub use key_hash::KeyHash;
pub use lease::{LeaseDebit, LeaseGrant, LocalLease, RefillSignal, RefillVerdict};
pub(crate) use lease::{LeaseHold, ShardView, ViewMiss};
pub use overage::{AccountOverage, TentativeOverage};
pub use reservation::{
    CancelHandle, CancelOutcome, CommitError, CommitFunding, Reservation, SharedCharge,
};
pub(crate) use sharding::CachePadded;
pub use sharding::{LocalSharding, Locality, ShardCount, ShardOccupancy};
pub use snapshot::{AccountStatus, EnforcementMode, KeyStatus, PrincipalSnapshot};
pub use units::{CostUnits, PermissionBits};
pub use usage::{UsageEvent, UsageSource};

#[cfg(all(test, tollgate_loom))]
mod loom_models;
