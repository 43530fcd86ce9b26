//! Shared by the integration tests that need it.
#![allow(
    dead_code,
    reason = "each test crate uses only part of the support code"
)]

pub(crate) mod counting_allocator;
pub(crate) mod http;
pub(crate) mod logs;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
pub(crate) mod runtime;
pub(crate) mod stores;
pub(crate) mod yields;
