//! The billing record of one committed charge.

use jiff::Timestamp;

use crate::model::{AccountId, CostUnits, FencingToken, KeyId, LeaseId, PolicyRevision, RequestId};

/// What funded a committed charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageSource {
    /// Units of a granted lease. The sink checks the capability, and the
    /// grant: an event naming a settled lease is accepted only while the
    /// usage accepted for it plus what its settlement credited stays within
    /// the grant, so no unit counts twice (I15). A released lease takes the
    /// trailing events of charges committed before its release; a reclaimed
    /// one, nothing more.
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
    /// The policy generation behind the charge: the application's pricing
    /// revision when the layer was built with one
    /// (`TollgateBuilder::policy_revision`), otherwise the revision of the
    /// principal's snapshot, which moves whenever its key or account
    /// changes.
    pub policy_revision: PolicyRevision,
    /// The key that made the request, when the principal has one.
    pub key_id: Option<KeyId>,
}
