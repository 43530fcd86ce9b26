//! The background planes: the tasks that keep leases stocked, policy fresh
//! and usage written, off the request path.

mod usage_writer;

pub use usage_writer::{
    UsageWriter, UsageWriterConfig, UsageWriterConfigError, WriterHealth, WriterReport, WriterStats,
};
