//! The ports tollgate talks to, and the stores behind them.
//!
//! Three traits make up a store, and everything above this module uses them
//! only as `Arc<dyn …>`:
//!
//! - [`LeaseAllocator`] moves units between an account's balance and leases:
//!   grants, releases, consolidations, and the TTL reclaim of leases whose
//!   holder never came back.
//! - [`UsageSink`] records committed charges, idempotently by request id.
//! - [`SnapshotSource`] serves principals' policy snapshots and resolves API
//!   keys by their hash.
//!
//! Every call takes the caller's `now` and a store never reads a clock of its
//! own (I13), so tests and simulations drive time explicitly and many
//! instances agree on what "now" meant for each call. Every call is
//! cancellable: dropping its future before it completes leaves the store as
//! if the call had not been made, or as if it had completed, never in
//! between.
//!
//! # The ledger equation
//!
//! Every store keeps, for every account at every committed instant (I14):
//!
//! ```text
//! initial balance + top-ups + net refills
//!   = balance + Σ active leases' granted + Σ settled leases' (granted − credited at settlement)
//! ```
//!
//! and for every lease `accepted leased usage + credited ≤ granted` (I15).
//! [`MemoryStore::audit`] checks both.
//!
//! With the `postgres` feature, `PostgresStore` keeps the same books in
//! `PostgreSQL`, for many instances sharing accounts.

mod clock;
mod keys;
mod memory;
mod policy;
#[cfg(feature = "postgres")]
mod postgres;
mod rules;

use std::fmt;

use async_trait::async_trait;
use jiff::{SignedDuration, Timestamp};

use crate::model::{
    AccountId, BalanceExhaustion, BalanceShortfall, CostUnits, FencingToken, LeaseGrant, LeaseId,
    Principal, PrincipalSnapshot, UsageEvent,
};

pub use crate::model::KeyHash;
pub use clock::{Clock, CoarseClock, CoarseClockError, ManualClock, SystemClock};
pub use keys::{ApiKey, KeyPrefix};
pub use memory::{
    AccountSpec, AccountView, AdminError, IssuedKey, KeyInfo, LedgerViolation, MemoryStore,
    RefillSchedule,
};
pub use policy::{GrantPolicy, GrantPolicyError, TailSharing};
#[cfg(feature = "postgres")]
pub use postgres::{
    BalanceChange, JournalEntry, JournalKind, MigrationReport, Movement, Page, PageCursor,
    PostgresConfig, PostgresError, PostgresStore, SchemaStatus,
};

/// Moves units between account balances and leases.
///
/// Each call is one atomic step in the store: it happens entirely or not at
/// all. A [`AllocateError::Storage`] answer is the exception the caller must
/// plan for: the step may or may not have happened.
#[async_trait]
pub trait LeaseAllocator: Send + Sync {
    /// Grants a new lease of up to `requested` units from `account`'s
    /// balance, living `ttl` (clamped to the policy's maximum) from `now`.
    ///
    /// The grant may be smaller than asked near the end of the balance, so
    /// several instances can share the tail; when the balance left after the
    /// grant could not fund another such request, the allocation carries that
    /// evidence. [`acquire_at_least`](Self::acquire_at_least) with a floor
    /// of zero.
    async fn acquire(
        &self,
        account: AccountId,
        requested: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        self.acquire_at_least(account, requested, CostUnits::ZERO, ttl, now)
            .await
    }

    /// [`acquire`](Self::acquire), granting no fewer than `needed` units:
    /// at least `needed` whenever the balance holds that many (tail sharing
    /// never shrinks the grant below it, as for
    /// [`consolidate`](Self::consolidate)), and otherwise nothing.
    ///
    /// # Implementors
    ///
    /// A balance short of a positive `needed` must be refused with
    /// [`AllocateError::BalanceInsufficient`] naming the balance (or
    /// `BalanceExhausted` when it is empty), never granted short. The lease
    /// manager asks with a floor when it acquires beside a busy lease for
    /// one refused quote (I27): a short grant could not fund the quote, and
    /// would move as much of the balance as it was asked for onto one
    /// instance, where other instances cannot reach it.
    async fn acquire_at_least(
        &self,
        account: AccountId,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError>;

    /// Settles a lease, crediting its `unspent` units back to the balance.
    ///
    /// # Implementors
    ///
    /// The lease manager acts on the answer (I26), so it must mean this:
    /// - `Ok` credits exactly `unspent` (`Released::credited == unspent`);
    ///   any other amount is an integrity fault that takes the instance out
    ///   of service for good;
    /// - a lease already settled (an earlier release whose answer was lost,
    ///   or TTL reclaim) is `UnknownLease` or `LeaseNotActive`, never `Ok`;
    /// - a capability the store does not recognise is `Fenced`;
    /// - a failure whose outcome is unknown is `Storage` (it is retried);
    /// - a balance with no room for the units yet is `BalanceOverflow`;
    /// - anything else (a refusal for a suspended account included) is an
    ///   integrity fault: a release draws no grant, so nothing about the
    ///   account may refuse it.
    async fn release(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        now: Timestamp,
    ) -> Result<Released, AllocateError>;

    /// In one step, settles a lease (crediting `unspent`) and grants a new
    /// one of up to `requested` units but at least `needed` whenever the
    /// account, counting the credited units, can fund it. A refusal leaves
    /// the old lease active and untouched.
    ///
    /// # Implementors
    ///
    /// As for [`release`](Self::release), with these differences: `Ok` means
    /// the old lease was settled with exactly `unspent` credited (the answer
    /// carries no amount to check); a refusal about the account or the
    /// grant (`BalanceExhausted`, `BalanceInsufficient`,
    /// `InsufficientBalance`, `AccountInactive`, `UnknownAccount`,
    /// `InvalidTtl`, `InvalidRequest`, `BalanceOverflow`) must have rolled
    /// everything back; `Storage` is not retried as a fold, the old lease is
    /// parked and released instead; and an over-claimed `unspent`
    /// (`InvalidRelease`) is an integrity fault.
    #[allow(clippy::too_many_arguments)]
    async fn consolidate(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError>;

    /// Settles up to `limit` active leases whose `expires_at + reclaim_grace`
    /// is at or before `now`, crediting each one's remainder net of accepted
    /// usage. Safe to run from many processes at once: each lease is settled
    /// once. A lease whose credit would overflow its account's balance is
    /// passed over and reported in [`ReclaimBatch::blocked`], so one account
    /// never holds up the others (I19). A `limit` of zero settles nothing;
    /// `more` then says whether a lease that could be settled now is due
    /// (blocked leases, and in `PostgreSQL` leases another reclaimer holds,
    /// do not count), so a caller paging on `more` must ask for at least
    /// one.
    async fn reclaim_expired_batch(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> Result<ReclaimBatch, StoreError>;

    /// Whether grants shrink near the end of a balance so that several
    /// instances share its tail ([`TailSharing::instances`] above one). The
    /// lease manager then lets a share it has no use for lapse rather than
    /// renew it, so another instance can fold its units (I28). `false`
    /// unless the store says otherwise: an allocator that wraps a store
    /// passes the store's answer on.
    fn shares_tails(&self) -> bool {
        false
    }
}

/// Records committed charges.
///
/// A leased event is accepted while the lease's accepted usage plus what its
/// settlement credited back stays within its grant (I15), so the usage of
/// charges committed just before a lease's release is still billed when it
/// arrives after the release.
#[async_trait]
pub trait UsageSink: Send + Sync {
    /// Records a batch of events and says, per event and in order, what
    /// became of it. The call as a whole fails only on a storage error, in
    /// which case any part of the batch may have been recorded; delivering it
    /// again is safe, because events are idempotent by request id (I8).
    async fn ingest(&self, batch: &[UsageEvent]) -> Result<Vec<IngestOutcome>, StoreError>;
}

/// Serves principals' policy snapshots.
///
/// The revisions a source gives one principal never decrease: a change gets
/// a larger [`PolicyRevision`](crate::PolicyRevision) than the state it
/// replaces (the stores number every change from one sequence, I32). The
/// snapshot map drops an answer older than what it holds (I34), so a source
/// whose revisions go back is treated as a stale read, not obeyed.
#[async_trait]
pub trait SnapshotSource: Send + Sync {
    /// The current snapshots of the named principals. Unknown principals are
    /// left out.
    async fn fetch(
        &self,
        principals: &[Principal],
        now: Timestamp,
    ) -> Result<Vec<PrincipalSnapshot>, StoreError>;

    /// Principals whose policy changed after `since`, oldest change first,
    /// at most `limit` of them. Start from [`SnapshotCursor::START`]; pass
    /// each page's `next` to the following call.
    ///
    /// A principal, once reported, is never left out of later pages by
    /// deletion: taking it away is a change like any other (a revoked key
    /// or a suspended account at a new revision). A page cannot report a
    /// principal that is gone, so a runtime enumerating every principal
    /// would keep serving the last snapshot it read of one.
    async fn changed_since(
        &self,
        since: SnapshotCursor,
        limit: usize,
        now: Timestamp,
    ) -> Result<SnapshotPage, StoreError>;

    /// The principal an active API key resolves to, by the key's hash. A
    /// revoked key no longer resolves; [`fetch`](Self::fetch) and
    /// [`changed_since`](Self::changed_since) still report it, revoked, so
    /// caches drop it. For embedders that resolve keys one at a time: the
    /// runtime resolves them from the snapshots it has loaded and never
    /// calls this.
    async fn lookup_key(
        &self,
        hash: &KeyHash,
        now: Timestamp,
    ) -> Result<Option<PrincipalSnapshot>, StoreError>;
}

/// A successful grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// The new lease.
    pub grant: LeaseGrant,
    /// Present when the balance left after this grant could not fund
    /// another request of the same size: what is left, and until when.
    pub funding: Option<BalanceShortfall>,
}

/// A settled release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// The units credited back to the balance.
    pub credited: CostUnits,
}

/// One page of reclaimed leases.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReclaimBatch {
    /// The leases this call settled.
    pub reclaimed: Vec<ReclaimedLease>,
    /// Whether leases that can be settled may still be due: the call
    /// stopped at `limit`. A store may also stop early (answering `false`)
    /// when a lease it selected turned out blocked; the next pass goes on.
    pub more: bool,
    /// Due leases left active because crediting their remainder would take
    /// their account's balance past the ledger's range (`i64::MAX` units).
    /// On a call that answers `more: false` (the last of a pass) these are
    /// the first `limit` of them by expiry, as balances stand after the
    /// call's credits; a call that answers `true` may name fewer or none.
    /// They neither count against `limit` nor hold up other leases, and
    /// settle on a later call once their account's balance has room.
    pub blocked: Vec<BlockedLease>,
}

/// A due lease reclaim could not settle: crediting its remainder would
/// overflow its account's balance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockedLease {
    /// The lease.
    pub lease_id: LeaseId,
    /// Its account.
    pub account_id: AccountId,
    /// The remainder waiting to be credited: granted minus accepted usage.
    pub remainder: CostUnits,
}

/// A lease settled by TTL reclaim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimedLease {
    /// The lease.
    pub lease_id: LeaseId,
    /// Its account.
    pub account_id: AccountId,
    /// The remainder credited back: granted minus accepted usage.
    pub credited: CostUnits,
}

/// What became of one usage event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngestOutcome {
    /// Recorded now.
    Accepted,
    /// The same event was recorded before; nothing changed.
    Duplicate,
    /// Not recorded, for this reason. Retrying cannot help.
    Rejected(RejectReason),
}

/// Why a usage event was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectReason {
    /// The event names a lease the store does not know.
    UnknownLease,
    /// The event's fencing token is not the lease's.
    FencingMismatch,
    /// The lease was settled and what its settlement credited back leaves no
    /// room for these units: they would count twice (a reclaimed lease
    /// accepts no more units; a released one accepts only the charges
    /// committed before its release). An event of zero units takes no room
    /// and is accepted.
    LeaseSettled,
    /// The lease cannot hold this much more usage.
    ExceedsLease,
    /// The event names an account the store does not know.
    UnknownAccount,
    /// The event's account is not its lease's account.
    AccountMismatch,
    /// An event with this request id but a different payload was recorded.
    ConflictingDuplicate,
    /// The event is malformed: a value the ledger cannot hold (units, a
    /// policy revision or a key id above `i64::MAX`, or overage debt that
    /// would pass it; the `PostgreSQL` store, whose instants are
    /// `timestamptz`, also an instant before 4714 BC). A zero-unit event (a
    /// request priced at nothing) is well formed and accepted.
    Malformed,
}

impl RejectReason {
    /// A stable lowercase label for logs and metrics.
    #[must_use]
    pub const fn label(self) -> &'static str {
        match self {
            Self::UnknownLease => "unknown_lease",
            Self::FencingMismatch => "fencing_mismatch",
            Self::LeaseSettled => "lease_settled",
            Self::ExceedsLease => "exceeds_lease",
            Self::UnknownAccount => "unknown_account",
            Self::AccountMismatch => "account_mismatch",
            Self::ConflictingDuplicate => "conflicting_duplicate",
            Self::Malformed => "malformed",
        }
    }
}

/// Where an incremental snapshot enumeration stands: the store's policy
/// revision last seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SnapshotCursor(pub u64);

impl SnapshotCursor {
    /// Before every change.
    pub const START: Self = Self(0);
}

/// One page of changed principals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotPage {
    /// The current snapshots of principals changed since the cursor.
    pub snapshots: Vec<PrincipalSnapshot>,
    /// The cursor for the next call.
    pub next: SnapshotCursor,
    /// Whether this page reached the latest change.
    pub complete: bool,
}

/// Why an allocator call was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AllocateError {
    /// No such account.
    UnknownAccount,
    /// The account is suspended.
    AccountInactive,
    /// The account cannot fund the request, and the store offers no evidence
    /// of how much it can. Stores that can say should answer
    /// [`BalanceInsufficient`](Self::BalanceInsufficient) instead.
    InsufficientBalance,
    /// The account's balance is empty.
    BalanceExhausted(BalanceExhaustion),
    /// The account cannot fund what was needed; the evidence says how much
    /// it can.
    BalanceInsufficient(BalanceShortfall),
    /// Crediting the units would overflow the balance: a top-up or refill
    /// filled it while they were out on a lease. Nothing was applied; the
    /// units can come back once the balance has room.
    BalanceOverflow,
    /// No such lease.
    UnknownLease,
    /// The lease was already settled.
    LeaseNotActive,
    /// The fencing token is not the lease's.
    Fenced,
    /// The release claims more unspent units than the lease can still hold:
    /// an accounting fault on the caller's side.
    InvalidRelease,
    /// The lifetime requested (clamped to the policy's maximum) is under a
    /// microsecond, or the lease would expire past the end of time.
    InvalidTtl,
    /// A request for zero units.
    InvalidRequest,
    /// The store could not answer. The call may or may not have taken
    /// effect.
    Storage(StoreError),
}

impl AllocateError {
    /// The number of variants.
    pub const COUNT: usize = 13;

    /// Stable lowercase labels, indexed by [`index`](Self::index).
    pub const NAMES: [&'static str; Self::COUNT] = [
        "unknown_account",
        "account_inactive",
        "insufficient_balance",
        "balance_exhausted",
        "balance_insufficient",
        "balance_overflow",
        "unknown_lease",
        "lease_not_active",
        "fenced",
        "invalid_release",
        "invalid_ttl",
        "invalid_request",
        "storage",
    ];

    /// This variant's position in [`NAMES`](Self::NAMES).
    #[must_use]
    pub const fn index(&self) -> usize {
        match self {
            Self::UnknownAccount => 0,
            Self::AccountInactive => 1,
            Self::InsufficientBalance => 2,
            Self::BalanceExhausted(_) => 3,
            Self::BalanceInsufficient(_) => 4,
            Self::BalanceOverflow => 5,
            Self::UnknownLease => 6,
            Self::LeaseNotActive => 7,
            Self::Fenced => 8,
            Self::InvalidRelease => 9,
            Self::InvalidTtl => 10,
            Self::InvalidRequest => 11,
            Self::Storage(_) => 12,
        }
    }

    /// This variant's label.
    #[must_use]
    pub const fn name(&self) -> &'static str {
        Self::NAMES[self.index()]
    }

    /// What the refusal says about the account's funds, if anything.
    #[must_use]
    pub fn evidence(&self) -> Option<BalanceShortfall> {
        match self {
            Self::BalanceExhausted(exhaustion) => Some(BalanceShortfall {
                remaining: CostUnits::ZERO,
                period_end: exhaustion.period_end,
            }),
            Self::BalanceInsufficient(shortfall) => Some(*shortfall),
            _ => None,
        }
    }
}

impl fmt::Display for AllocateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownAccount => f.write_str("unknown account"),
            Self::AccountInactive => f.write_str("account is suspended"),
            Self::InsufficientBalance => f.write_str("insufficient balance"),
            Self::BalanceExhausted(_) => f.write_str("balance exhausted"),
            Self::BalanceInsufficient(shortfall) => {
                write!(f, "balance insufficient: {} remaining", shortfall.remaining)
            }
            Self::BalanceOverflow => f.write_str("crediting would overflow the balance"),
            Self::UnknownLease => f.write_str("unknown lease"),
            Self::LeaseNotActive => f.write_str("lease already settled"),
            Self::Fenced => f.write_str("fencing token does not match the lease"),
            Self::InvalidRelease => {
                f.write_str("release claims more unspent units than the lease can hold")
            }
            Self::InvalidTtl => {
                f.write_str("lease ttl must be at least a microsecond and representable")
            }
            Self::InvalidRequest => f.write_str("a grant must request at least one unit"),
            Self::Storage(error) => write!(f, "storage error: {error}"),
        }
    }
}

impl std::error::Error for AllocateError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Storage(error) => Some(error),
            _ => None,
        }
    }
}

impl From<StoreError> for AllocateError {
    fn from(error: StoreError) -> Self {
        Self::Storage(error)
    }
}

/// A store that could not answer: unreachable, timed out, failed mid-call.
/// The call may or may not have taken effect, unless the store says it
/// never made it ([`made_no_call`](Self::made_no_call)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreError {
    message: String,
    made_no_call: bool,
}

impl StoreError {
    /// An error described by `message`: the call may have taken effect.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            made_no_call: false,
        }
    }

    /// An error described by `message` for a call the store never made
    /// (for example, no connection was free in time): it took no effect,
    /// and left nothing behind for reclaim to find.
    pub fn not_made(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            made_no_call: true,
        }
    }

    /// Whether the store never made the call, so it certainly took no
    /// effect.
    #[must_use]
    pub fn made_no_call(&self) -> bool {
        self.made_no_call
    }

    /// What went wrong.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for StoreError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_allocate_error_has_its_own_label() {
        let all = [
            AllocateError::UnknownAccount,
            AllocateError::AccountInactive,
            AllocateError::InsufficientBalance,
            AllocateError::BalanceExhausted(BalanceExhaustion { period_end: None }),
            AllocateError::BalanceInsufficient(BalanceShortfall {
                remaining: CostUnits(1),
                period_end: None,
            }),
            AllocateError::BalanceOverflow,
            AllocateError::UnknownLease,
            AllocateError::LeaseNotActive,
            AllocateError::Fenced,
            AllocateError::InvalidRelease,
            AllocateError::InvalidTtl,
            AllocateError::InvalidRequest,
            AllocateError::Storage(StoreError::new("down")),
        ];
        assert_eq!(all.len(), AllocateError::COUNT);
        for (position, error) in all.iter().enumerate() {
            assert_eq!(error.index(), position);
            assert_eq!(error.name(), AllocateError::NAMES[position]);
        }
        let mut names = AllocateError::NAMES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), AllocateError::COUNT);
    }

    #[test]
    fn only_balance_refusals_carry_evidence() {
        assert_eq!(
            AllocateError::BalanceExhausted(BalanceExhaustion { period_end: None }).evidence(),
            Some(BalanceShortfall {
                remaining: CostUnits::ZERO,
                period_end: None
            })
        );
        assert_eq!(AllocateError::InsufficientBalance.evidence(), None);
        assert_eq!(AllocateError::Fenced.evidence(), None);
    }
}
