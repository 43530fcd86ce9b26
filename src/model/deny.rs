//! Every way admission or commit says no, and when asking again can help.

use std::fmt;

use jiff::Timestamp;

use crate::model::{CostUnits, PermissionBits};

/// Why a request was not admitted, or not allowed to start.
///
/// Each reason has a stable [`code`](Self::code) for response bodies and
/// metric labels, and a [`retry`](Self::retry) class that the HTTP layer turns
/// into a status and a `Retry-After`. Reasons are `Copy` and carry only
/// numbers, so denying allocates nothing (I5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DenyReason {
    /// No credential was presented.
    MissingCredential,
    /// A credential was presented but is not well formed (oversized,
    /// non-visible characters, duplicated, wrong scheme).
    MalformedCredential,
    /// The credential names no known principal.
    UnknownPrincipal,
    /// The key was revoked.
    KeyRevoked,
    /// The account is suspended.
    AccountInactive,
    /// The principal lacks permissions the route requires.
    PermissionDenied {
        /// The required bits the principal does not hold.
        missing: PermissionBits,
    },
    /// No policy snapshot of the principal has been loaded yet.
    SnapshotUnavailable,
    /// The principal's snapshot is older than the configured maximum
    /// staleness; admitting on it could honour a revoked key.
    SnapshotStale,
    /// The account has no usable lease on this instance right now: none is
    /// installed, or the installed one cannot fund the quote while the
    /// allocator does not answer, so it will not be restocked soon.
    LeaseUnavailable,
    /// The account's lease cannot fund the quote right now.
    LeaseExhausted,
    /// The account's lease has passed its usability window.
    LeaseExpired,
    /// The lease's usability window closed between admission and execution
    /// start; the request was released for zero and must not run.
    FundingExpiredAtStart,
    /// The account's balance is empty.
    BalanceExhausted {
        /// When the balance is next refilled, if a refill brings any units.
        period_end: Option<Timestamp>,
    },
    /// The account's balance cannot fund this quote.
    BalanceInsufficient {
        /// What the account can still fund.
        remaining: CostUnits,
        /// When the balance is next refilled, if that refill brings it
        /// above `remaining`.
        period_end: Option<Timestamp>,
    },
    /// Committed overage leaves the cap too little room for this quote: no
    /// refund on this instance can make more.
    OverageCapExhausted {
        /// Overage spent when refused.
        spent: CostUnits,
        /// The cap in force.
        overage_cap: CostUnits,
    },
    /// Overage spent (part of it pending, and so refundable) leaves the cap
    /// too little room for this quote for now.
    OverageCapTemporarilyExhausted {
        /// Overage spent when refused.
        spent: CostUnits,
        /// The cap in force.
        overage_cap: CostUnits,
    },
    /// A commit of overage was being published; once it lands the cap is
    /// known to be committed or free.
    OverageCommitInProgress {
        /// Overage spent when refused.
        spent: CostUnits,
        /// The cap in force.
        overage_cap: CostUnits,
    },
    /// The usage queue is full: a charge admitted now might not be recorded.
    AccountingBackpressure,
    /// The instance is shutting down: it admits nothing new, and starts no
    /// handler of a request admitted before (refused at its commit, charged
    /// nothing).
    ShuttingDown,
}

/// When asking again can succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Not without a change only an operator or the caller can make.
    Never,
    /// Not before this instant.
    At(Timestamp),
    /// Soon: the condition clears by itself in the background.
    Transient,
    /// Once a commit being published right now has landed.
    AfterInFlight,
}

impl DenyReason {
    /// The stable, lowercase code of this reason.
    #[must_use]
    pub const fn code(&self) -> &'static str {
        match self {
            Self::MissingCredential => "missing_credential",
            Self::MalformedCredential => "malformed_credential",
            Self::UnknownPrincipal => "unknown_principal",
            Self::KeyRevoked => "key_revoked",
            Self::AccountInactive => "account_inactive",
            Self::PermissionDenied { .. } => "permission_denied",
            Self::SnapshotUnavailable => "snapshot_unavailable",
            Self::SnapshotStale => "snapshot_stale",
            Self::LeaseUnavailable => "lease_unavailable",
            Self::LeaseExhausted => "lease_exhausted",
            Self::LeaseExpired => "lease_expired",
            Self::FundingExpiredAtStart => "funding_expired_at_start",
            Self::BalanceExhausted { .. } => "balance_exhausted",
            Self::BalanceInsufficient { .. } => "balance_insufficient",
            Self::OverageCapExhausted { .. } => "overage_cap_exhausted",
            Self::OverageCapTemporarilyExhausted { .. } => "overage_cap_temporarily_exhausted",
            Self::OverageCommitInProgress { .. } => "overage_commit_in_progress",
            Self::AccountingBackpressure => "accounting_backpressure",
            Self::ShuttingDown => "shutting_down",
        }
    }

    /// When a retry of the same request can succeed.
    #[must_use]
    pub const fn retry(&self) -> Retry {
        match self {
            Self::MissingCredential
            | Self::MalformedCredential
            | Self::UnknownPrincipal
            | Self::KeyRevoked
            | Self::AccountInactive
            | Self::PermissionDenied { .. }
            | Self::OverageCapExhausted { .. } => Retry::Never,
            Self::BalanceExhausted { period_end }
            | Self::BalanceInsufficient { period_end, .. } => match period_end {
                Some(at) => Retry::At(*at),
                None => Retry::Never,
            },
            Self::SnapshotUnavailable
            | Self::SnapshotStale
            | Self::LeaseUnavailable
            | Self::LeaseExhausted
            | Self::LeaseExpired
            | Self::FundingExpiredAtStart
            | Self::OverageCapTemporarilyExhausted { .. }
            | Self::AccountingBackpressure
            | Self::ShuttingDown => Retry::Transient,
            Self::OverageCommitInProgress { .. } => Retry::AfterInFlight,
        }
    }

    /// Every reason, with placeholder payloads. For tables that must cover
    /// them all: metric label sets, documentation, exhaustive tests.
    pub const ALL: [Self; 19] = [
        Self::MissingCredential,
        Self::MalformedCredential,
        Self::UnknownPrincipal,
        Self::KeyRevoked,
        Self::AccountInactive,
        Self::PermissionDenied {
            missing: PermissionBits::NONE,
        },
        Self::SnapshotUnavailable,
        Self::SnapshotStale,
        Self::LeaseUnavailable,
        Self::LeaseExhausted,
        Self::LeaseExpired,
        Self::FundingExpiredAtStart,
        Self::BalanceExhausted { period_end: None },
        Self::BalanceInsufficient {
            remaining: CostUnits::ZERO,
            period_end: None,
        },
        Self::OverageCapExhausted {
            spent: CostUnits::ZERO,
            overage_cap: CostUnits::ZERO,
        },
        Self::OverageCapTemporarilyExhausted {
            spent: CostUnits::ZERO,
            overage_cap: CostUnits::ZERO,
        },
        Self::OverageCommitInProgress {
            spent: CostUnits::ZERO,
            overage_cap: CostUnits::ZERO,
        },
        Self::AccountingBackpressure,
        Self::ShuttingDown,
    ];

    /// This reason's position in [`ALL`](Self::ALL), for per-reason counter
    /// arrays.
    #[must_use]
    pub const fn index(&self) -> usize {
        match self {
            Self::MissingCredential => 0,
            Self::MalformedCredential => 1,
            Self::UnknownPrincipal => 2,
            Self::KeyRevoked => 3,
            Self::AccountInactive => 4,
            Self::PermissionDenied { .. } => 5,
            Self::SnapshotUnavailable => 6,
            Self::SnapshotStale => 7,
            Self::LeaseUnavailable => 8,
            Self::LeaseExhausted => 9,
            Self::LeaseExpired => 10,
            Self::FundingExpiredAtStart => 11,
            Self::BalanceExhausted { .. } => 12,
            Self::BalanceInsufficient { .. } => 13,
            Self::OverageCapExhausted { .. } => 14,
            Self::OverageCapTemporarilyExhausted { .. } => 15,
            Self::OverageCommitInProgress { .. } => 16,
            Self::AccountingBackpressure => 17,
            Self::ShuttingDown => 18,
        }
    }
}

impl fmt::Display for DenyReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingCredential => f.write_str("no credential was presented"),
            Self::MalformedCredential => f.write_str("the credential is malformed"),
            Self::UnknownPrincipal => f.write_str("the credential is not recognised"),
            Self::KeyRevoked => f.write_str("the key has been revoked"),
            Self::AccountInactive => f.write_str("the account is suspended"),
            Self::PermissionDenied { missing } => {
                write!(f, "the key lacks required permissions {missing}")
            }
            Self::SnapshotUnavailable => f.write_str("the key's policy is not loaded yet"),
            Self::SnapshotStale => f.write_str("the key's policy could not be refreshed in time"),
            Self::LeaseUnavailable => f.write_str("no balance is leased to this instance yet"),
            Self::LeaseExhausted => f.write_str("the leased balance cannot fund this request now"),
            Self::LeaseExpired => f.write_str("the leased balance expired and is being renewed"),
            Self::FundingExpiredAtStart => {
                f.write_str("the leased balance expired before the request started")
            }
            Self::BalanceExhausted { .. } => f.write_str("the account balance is exhausted"),
            Self::BalanceInsufficient { remaining, .. } => {
                write!(f, "the account balance can fund only {remaining}")
            }
            Self::OverageCapExhausted { spent, overage_cap } => {
                write!(
                    f,
                    "committed overage of {spent} leaves too little of the cap of {overage_cap}"
                )
            }
            Self::OverageCapTemporarilyExhausted { spent, overage_cap } => write!(
                f,
                "overage of {spent}, partly pending, leaves too little of the cap of \
                 {overage_cap} for now"
            ),
            Self::OverageCommitInProgress { spent, overage_cap } => write!(
                f,
                "overage of {spent} against a cap of {overage_cap} is being committed"
            ),
            Self::AccountingBackpressure => f.write_str("usage accounting is backed up"),
            Self::ShuttingDown => f.write_str("this instance is shutting down"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_a_distinct_code_and_index() {
        let mut codes: Vec<_> = DenyReason::ALL.iter().map(DenyReason::code).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), DenyReason::ALL.len());
        for (position, reason) in DenyReason::ALL.iter().enumerate() {
            assert_eq!(reason.index(), position, "{reason:?}");
            assert!(
                reason
                    .code()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_')
            );
        }
    }

    #[track_caller]
    fn check(reason: DenyReason, retry: Retry) {
        assert_eq!(reason.retry(), retry, "{reason:?}");
    }

    #[test]
    fn each_reason_says_when_a_retry_can_help() {
        let end = Timestamp::from_second(1_000).unwrap();
        let (spent, overage_cap) = (CostUnits(5), CostUnits(5));
        check(DenyReason::MissingCredential, Retry::Never);
        check(DenyReason::KeyRevoked, Retry::Never);
        check(DenyReason::AccountInactive, Retry::Never);
        check(DenyReason::SnapshotStale, Retry::Transient);
        check(DenyReason::LeaseExhausted, Retry::Transient);
        check(
            DenyReason::BalanceExhausted {
                period_end: Some(end),
            },
            Retry::At(end),
        );
        check(
            DenyReason::BalanceExhausted { period_end: None },
            Retry::Never,
        );
        check(
            DenyReason::BalanceInsufficient {
                remaining: CostUnits(3),
                period_end: Some(end),
            },
            Retry::At(end),
        );
        // I11: the three overage refusals never share a retry class.
        check(
            DenyReason::OverageCapExhausted { spent, overage_cap },
            Retry::Never,
        );
        check(
            DenyReason::OverageCapTemporarilyExhausted { spent, overage_cap },
            Retry::Transient,
        );
        check(
            DenyReason::OverageCommitInProgress { spent, overage_cap },
            Retry::AfterInFlight,
        );
        check(DenyReason::AccountingBackpressure, Retry::Transient);
        check(DenyReason::ShuttingDown, Retry::Transient);
    }
}
