//! The request path: everything between "this caller wants to spend" and
//! "the charge is committed and its usage event queued".
//!
//! Nothing here performs I/O, takes a lock, or allocates on the path a warm
//! request takes (I5). Policy comes from a snapshot map published by the
//! background snapshot manager; funding comes from the account's lease slot,
//! stocked by the background lease manager; usage goes into a bounded queue
//! drained by the background usage writer.

mod engine;
mod request_id;
mod slot;
mod snapshot_map;
mod usage;

pub use engine::{AdmissionCounters, AdmissionEngine, AdmissionStats, RequestContext};
pub use request_id::RequestIds;
pub use slot::{LeaseSlot, SlotRegistry};
pub use snapshot_map::{ArcSwapSnapshotMap, SnapshotMapConfig, SnapshotMapConfigError, Snapshots};
pub(crate) use usage::UsageQueue;
pub use usage::{UsagePermit, UsageRecorder};
