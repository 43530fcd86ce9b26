//! An immutable view of one principal's policy.

use jiff::Timestamp;

use crate::model::{
    AccountId, CostUnits, KeyHash, KeyId, PermissionBits, PolicyRevision, Principal,
};

/// How an account may spend beyond its leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnforcementMode {
    /// Never spend more than the leases granted (I9).
    Strict,
    /// When no lease can fund a request, spend into overage up to the cap on
    /// this instance, billed as the account's debt.
    Elastic {
        /// The most overage this instance may extend to the account.
        overage_cap: CostUnits,
    },
}

impl EnforcementMode {
    /// The overage cap, or `None` under [`Strict`](Self::Strict).
    #[must_use]
    pub const fn overage_cap(self) -> Option<CostUnits> {
        match self {
            Self::Strict => None,
            Self::Elastic { overage_cap } => Some(overage_cap),
        }
    }
}

/// Whether an account may spend at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccountStatus {
    /// The account may spend.
    Active,
    /// An operator suspended the account; every request is denied.
    Suspended,
}

/// Whether a key may be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyStatus {
    /// The key works.
    Active,
    /// The key was revoked; it is never accepted again.
    Revoked,
}

/// One principal's policy as of `fetched_at`.
///
/// Admission pins one snapshot for a request's whole life, so every decision
/// about the request (permissions, mode, the revision stamped on its usage
/// event) comes from the same generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrincipalSnapshot {
    /// Who calls.
    pub principal: Principal,
    /// Who pays.
    pub account_id: AccountId,
    /// The key's identity, recorded on usage events.
    pub key_id: Option<KeyId>,
    /// The hash of the principal's API key, by which the HTTP layer finds
    /// it; `None` for principals identified some other way.
    pub key_hash: Option<KeyHash>,
    /// What the principal may do.
    pub permissions: PermissionBits,
    /// Whether the key may be used.
    pub key_status: KeyStatus,
    /// Whether the account may spend.
    pub account_status: AccountStatus,
    /// How the account may spend beyond its leases.
    pub mode: EnforcementMode,
    /// The policy generation this snapshot reflects. A source never gives
    /// a principal a smaller one than it gave before (I34).
    pub policy_revision: PolicyRevision,
    /// When the source produced this snapshot; staleness is measured from
    /// here. A source stamps the `now` it was asked at (both stores do); the
    /// snapshot manager trusts a later stamp only from that `now` (I24).
    pub fetched_at: Timestamp,
}
