//! The billing record of one committed charge.

use jiff::Timestamp;

use crate::model::{AccountId, CostUnits, FencingToken, KeyId, LeaseId, PolicyRevision, RequestId};

/// What funded a committed charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageSource {
    /// Units of a granted lease. The sink checks the capability: an event
    /// naming a settled lease is rejected, because settlement already
    /// credited the lease's remainder and the units would count twice.
    Leased {
        /// The lease that funded the charge.
        lease_id: LeaseId,
        /// The capability of that lease.
        fencing_token: FencingToken,
    },
    /// Unfunded units of an Elastic account, recorded as its debt.
    Overage,
}

impl UsageSource {
    /// The funding lease, if any.
    #[must_use]
    pub const fn lease_id(&self) -> Option<LeaseId> {
        match self {
            Self::Leased { lease_id, .. } => Some(*lease_id),
            Self::Overage => None,
        }
    }

    /// The funding lease's capability, if any.
    #[must_use]
    pub const fn fencing_token(&self) -> Option<FencingToken> {
        match self {
            Self::Leased { fencing_token, .. } => Some(*fencing_token),
            Self::Overage => None,
        }
    }
}

/// One committed charge, keyed by its request id (I8): delivering it twice is
/// harmless downstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageEvent {
    /// The idempotency key.
    pub request_id: RequestId,
    /// The account charged.
    pub account_id: AccountId,
    /// What funded the charge.
    pub source: UsageSource,
    /// The units charged: the full quote.
    pub units: CostUnits,
    /// When the charge was committed.
    pub at: Timestamp,
    /// The pricing policy that priced the request.
    pub policy_revision: PolicyRevision,
    /// The key that made the request, when the principal has one.
    pub key_id: Option<KeyId>,
}
