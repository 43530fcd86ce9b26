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
