//! The embedded store: every port in one process, behind one lock.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::ops::Bound::{Excluded, Unbounded};
use std::sync::{Mutex, MutexGuard};

use async_trait::async_trait;
use jiff::{SignedDuration, Timestamp};
use rustc_hash::FxHashMap;

use crate::model::{
    AccountId, AccountStatus, CostUnits, EnforcementMode, FencingToken, KeyId, KeyStatus,
    LeaseGrant, LeaseId, PermissionBits, PolicyRevision, Principal, PrincipalSnapshot, RequestId,
    UsageEvent, UsageSource,
};
use crate::store::rules::{
    UNITS_MAX, check_mode, credited_balance, first_period_end, next_period_end, plan_acquire,
    plan_consolidation,
};
use crate::store::{
    AllocateError, Allocation, ApiKey, BlockedLease, GrantPolicy, GrantPolicyError, IngestOutcome,
    KeyHash, KeyPrefix, LeaseAllocator, ReclaimBatch, ReclaimedLease, RejectReason, Released,
    SnapshotCursor, SnapshotPage, SnapshotSource, StoreError, UsageSink,
};

/// An in-memory store implementing [`LeaseAllocator`], [`UsageSink`] and
/// [`SnapshotSource`], plus the operations an operator needs.
///
/// Each call validates everything first and then applies its changes under
/// one lock, so every call is atomic and the ledger equation (I14) holds
/// between any two calls, whatever their interleaving. The lock is held only
/// for in-memory work, never across an await.
///
/// The store keeps no clock: every call takes `now` (I13). Periodic refills
/// are applied lazily, on the first call at or after a period's end, exactly
/// as if they had happened at that instant.
pub struct MemoryStore {
    policy: GrantPolicy,
    ledger: Mutex<Ledger>,
}

/// What an account starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountSpec {
    /// The opening balance.
    pub balance: CostUnits,
    /// Strict or Elastic.
    pub mode: EnforcementMode,
    /// Whether the account may spend.
    pub status: AccountStatus,
    /// A periodic refill, if any. The first period ends one interval after
    /// the account is created.
    pub refill: Option<RefillSchedule>,
}

/// A periodic refill: at the end of each period the balance is *reset* to
/// `amount` (units left over are not carried forward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefillSchedule {
    /// The balance each period starts with.
    pub amount: CostUnits,
    /// The length of a period; must be positive.
    pub interval: SignedDuration,
}

/// An account as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountView {
    /// The account.
    pub id: AccountId,
    /// Whether it may spend.
    pub status: AccountStatus,
    /// Units not leased to any instance.
    pub balance: CostUnits,
    /// Strict or Elastic.
    pub mode: EnforcementMode,
    /// The refill schedule, if any.
    pub refill: Option<RefillSchedule>,
    /// When the current refill period ends.
    pub period_end: Option<Timestamp>,
    /// The grants of active leases, in full: the units instances hold for
    /// the account, counting what they have already spent against them
    /// (and whose usage the store may already have billed). Until a lease
    /// settles, a unit it spent is counted here and, once billed, in the
    /// account's usage too.
    pub leased: CostUnits,
    /// Overage billed and not yet paid.
    pub overage_debt: CostUnits,
    /// Units of released leases that were neither credited nor billed:
    /// charges an instance committed whose usage never reached the store
    /// before it released the lease (a shutdown whose drain deadline
    /// passed). Zero when every committed charge was delivered. A lease
    /// settled by reclaim is credited everything not billed, so charges
    /// lost with a crashed instance do not show here; they are among the
    /// units the reclaimer reports it credited back.
    pub settled_unbilled: CostUnits,
}

/// A key, at the one moment its plaintext exists.
#[derive(Debug, Clone)]
pub struct IssuedKey {
    /// The plaintext. Show it to its owner once; the store does not keep it.
    pub key: ApiKey,
    /// The key's identity.
    pub key_id: KeyId,
    /// The principal the key resolves to.
    pub principal: Principal,
}

/// A key as an operator sees it: never its plaintext or hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    /// The key's identity.
    pub key_id: KeyId,
    /// The principal it resolves to.
    pub principal: Principal,
    /// The account it spends from.
    pub account_id: AccountId,
    /// Its visible prefix.
    pub prefix: KeyPrefix,
    /// What it may do.
    pub permissions: PermissionBits,
    /// Whether it works.
    pub status: KeyStatus,
    /// When it was issued.
    pub created_at: Timestamp,
    /// When it was revoked, if it was.
    pub revoked_at: Option<Timestamp>,
}

/// Why an operator's request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AdminError {
    /// No such account.
    UnknownAccount,
    /// No such key.
    UnknownKey,
    /// The opening balance, a top-up or an adjustment would take the balance
    /// above the most units the ledger holds (`i64::MAX`, what `PostgreSQL`
    /// can store).
    BalanceOverflow,
    /// A refill's amount must be at most the most units the ledger holds
    /// (`i64::MAX`), and its interval positive (on `PostgreSQL`, a whole
    /// number of microseconds) with a period that ends within the
    /// representable time range.
    InvalidRefill,
    /// The operating system could not supply randomness for a key.
    Randomness,
    /// The adjustment would take the balance below zero.
    BalanceUnderflow,
    /// The idempotency key was already used for a different movement.
    IdempotencyConflict,
    /// The request is malformed; the message says how.
    Invalid(String),
    /// The store could not answer.
    Storage(StoreError),
}

impl fmt::Display for AdminError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownAccount => f.write_str("unknown account"),
            Self::UnknownKey => f.write_str("unknown key"),
            Self::BalanceOverflow => {
                f.write_str("the balance would exceed the most units the ledger holds")
            }
            Self::InvalidRefill => f.write_str(
                "a refill needs an amount of at most 9223372036854775807 units and a \
                     positive interval (whole microseconds on PostgreSQL) whose period ends \
                     within the time range",
            ),
            Self::Randomness => f.write_str("the operating system supplied no randomness"),
            Self::BalanceUnderflow => {
                f.write_str("the adjustment would take the balance below zero")
            }
            Self::IdempotencyConflict => {
                f.write_str("the idempotency key was already used for a different movement")
            }
            Self::Invalid(message) => write!(f, "invalid request: {message}"),
            Self::Storage(error) => write!(f, "storage error: {error}"),
        }
    }
}

impl std::error::Error for AdminError {}

impl From<StoreError> for AdminError {
    fn from(error: StoreError) -> Self {
        Self::Storage(error)
    }
}

/// One way the books failed to balance, found by [`MemoryStore::audit`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LedgerViolation {
    /// I14: what was credited into the account is not what the account's
    /// balance and leases account for.
    AccountImbalance {
        /// The account.
        account_id: AccountId,
        /// Opening balance plus top-ups plus net refills.
        credited_in: i128,
        /// Balance plus active grants plus settled leases' net spend.
        accounted_for: i128,
    },
    /// I15: a lease's accepted usage and settlement credit exceed its grant.
    LeaseOverdrawn {
        /// The lease.
        lease_id: LeaseId,
        /// Its grant.
        granted: CostUnits,
        /// Accepted leased usage naming it.
        used: CostUnits,
        /// Credited back at settlement (zero while active).
        credited: CostUnits,
    },
    /// The usage recorded against a lease does not match its counter.
    LeaseUsageMismatch {
        /// The lease.
        lease_id: LeaseId,
        /// The lease's own counter.
        counter: CostUnits,
        /// The sum of recorded events naming it.
        recorded: CostUnits,
    },
    /// The overage recorded against an account does not match its debt.
    OverageDebtMismatch {
        /// The account.
        account_id: AccountId,
        /// The account's debt.
        debt: CostUnits,
        /// The sum of recorded overage events.
        recorded: CostUnits,
    },
    /// A lease names an account the store does not have.
    OrphanLease {
        /// The lease.
        lease_id: LeaseId,
    },
    /// An account's balance is not the sum of the balance movements its
    /// journal records (stores that keep a journal).
    JournalMismatch {
        /// The account.
        account_id: AccountId,
        /// The balance.
        balance: CostUnits,
        /// The sum of the journal's movements.
        journal: i128,
    },
}

impl fmt::Display for LedgerViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AccountImbalance {
                account_id,
                credited_in,
                accounted_for,
            } => write!(
                f,
                "{account_id}: {credited_in} units credited in but {accounted_for} accounted for"
            ),
            Self::LeaseOverdrawn {
                lease_id,
                granted,
                used,
                credited,
            } => write!(
                f,
                "{lease_id}: used {used} plus credited {credited} exceed granted {granted}"
            ),
            Self::LeaseUsageMismatch {
                lease_id,
                counter,
                recorded,
            } => write!(
                f,
                "{lease_id}: counter says {counter}, events say {recorded}"
            ),
            Self::OverageDebtMismatch {
                account_id,
                debt,
                recorded,
            } => write!(f, "{account_id}: debt {debt}, overage events {recorded}"),
            Self::OrphanLease { lease_id } => write!(f, "{lease_id}: names no known account"),
            Self::JournalMismatch {
                account_id,
                balance,
                journal,
            } => write!(
                f,
                "{account_id}: balance {balance}, journal movements sum to {journal}"
            ),
        }
    }
}

#[derive(Debug, Default)]
struct Ledger {
    accounts: BTreeMap<AccountId, Account>,
    leases: BTreeMap<LeaseId, Lease>,
    /// Active leases by expiry, for reclaim.
    expiring: BTreeSet<(Timestamp, LeaseId)>,
    // Ids are minted by the instances, never chosen by a caller, so a fast
    // unkeyed hash is safe here.
    usage: FxHashMap<RequestId, UsageEvent>,
    usage_by_account: FxHashMap<AccountId, Vec<RequestId>>,
    keys_by_hash: HashMap<KeyHash, KeyId>,
    keys: BTreeMap<KeyId, KeyRecord>,
    /// Every key by its current revision (each revision names one key), so
    /// paging by revision reads one page, not every key.
    keys_by_revision: BTreeMap<u64, KeyId>,
    last_account: u64,
    last_lease: u64,
    last_fencing: u64,
    last_key: u64,
    /// Bumped for every principal whose snapshot changes; each change gets
    /// its own number so paging by revision never splits one.
    revision: u64,
}

#[derive(Debug)]
struct Account {
    status: AccountStatus,
    balance: u64,
    mode: EnforcementMode,
    refill: Option<(RefillSchedule, Timestamp)>,
    overage_debt: u64,
    /// Opening balance + top-ups + net refills: the left side of I14.
    credited_in: i128,
}

#[derive(Debug)]
struct Lease {
    account_id: AccountId,
    fencing_token: FencingToken,
    granted: u64,
    expires_at: Timestamp,
    used: u64,
    settlement: Option<Settlement>,
}

#[derive(Debug, Clone, Copy)]
struct Settlement {
    credited: u64,
}

#[derive(Debug)]
struct KeyRecord {
    hash: KeyHash,
    prefix: KeyPrefix,
    account_id: AccountId,
    permissions: PermissionBits,
    status: KeyStatus,
    created_at: Timestamp,
    revoked_at: Option<Timestamp>,
    revision: u64,
}

impl MemoryStore {
    /// An empty store following `policy`.
    ///
    /// # Errors
    ///
    /// The first rule `policy` breaks.
    pub fn new(policy: GrantPolicy) -> Result<Self, GrantPolicyError> {
        policy.validate()?;
        Ok(Self {
            policy,
            ledger: Mutex::new(Ledger::default()),
        })
    }

    /// The grant policy in force.
    #[must_use]
    pub fn policy(&self) -> &GrantPolicy {
        &self.policy
    }

    /// Opens an account.
    ///
    /// # Errors
    ///
    /// The first of: [`AdminError::InvalidRefill`] for a bad refill
    /// schedule, [`AdminError::BalanceOverflow`] for an opening balance above
    /// `i64::MAX`, [`AdminError::Invalid`] for an overage cap above it.
    pub fn create_account(
        &self,
        spec: AccountSpec,
        now: Timestamp,
    ) -> Result<AccountId, AdminError> {
        // In the PostgreSQL store's order, so both name the same refusal:
        // the refill schedule, the balance, the mode.
        let refill = match spec.refill {
            Some(schedule) => Some((schedule, first_period_end(schedule, now)?)),
            None => None,
        };
        // The ledger's range, as every later movement checks it: a balance
        // above it could be spent but never credited back.
        if spec.balance.get() > UNITS_MAX {
            return Err(AdminError::BalanceOverflow);
        }
        check_mode(spec.mode)?;
        let mut ledger = self.lock()?;
        ledger.last_account += 1;
        let id = AccountId(ledger.last_account);
        ledger.accounts.insert(
            id,
            Account {
                status: spec.status,
                balance: spec.balance.get(),
                mode: spec.mode,
                refill,
                overage_debt: 0,
                credited_in: i128::from(spec.balance.get()),
            },
        );
        Ok(id)
    }

    /// Adds `units` to an account's balance; returns the new balance. It
    /// takes effect on the next grant.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`], or [`AdminError::BalanceOverflow`]
    /// (nothing is applied).
    pub fn top_up(
        &self,
        account: AccountId,
        units: CostUnits,
        now: Timestamp,
    ) -> Result<CostUnits, AdminError> {
        let mut ledger = self.lock()?;
        let entry = ledger
            .account_at(account, now)
            .ok_or(AdminError::UnknownAccount)??;
        let balance = entry
            .balance
            .checked_add(units.get())
            .filter(|balance| *balance <= UNITS_MAX)
            .ok_or(AdminError::BalanceOverflow)?;
        entry.balance = balance;
        entry.credited_in += i128::from(units.get());
        Ok(CostUnits(balance))
    }

    /// Suspends or resumes an account. Its keys' snapshots change with it.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`].
    pub fn set_status(&self, account: AccountId, status: AccountStatus) -> Result<(), AdminError> {
        let mut ledger = self.lock()?;
        ledger
            .accounts
            .get_mut(&account)
            .ok_or(AdminError::UnknownAccount)?
            .status = status;
        ledger.touch_account_keys(account);
        Ok(())
    }

    /// Changes an account's enforcement mode. Its keys' snapshots change with
    /// it.
    ///
    /// # Errors
    ///
    /// [`AdminError::Invalid`] for an overage cap no store can hold (above
    /// `i64::MAX`), then [`AdminError::UnknownAccount`].
    pub fn set_mode(&self, account: AccountId, mode: EnforcementMode) -> Result<(), AdminError> {
        check_mode(mode)?;
        let mut ledger = self.lock()?;
        ledger
            .accounts
            .get_mut(&account)
            .ok_or(AdminError::UnknownAccount)?
            .mode = mode;
        ledger.touch_account_keys(account);
        Ok(())
    }

    /// Sets (or with `None`, removes) an account's periodic refill. A new
    /// schedule's first period ends one interval after `now`.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`] or [`AdminError::InvalidRefill`].
    pub fn configure_refill(
        &self,
        account: AccountId,
        refill: Option<RefillSchedule>,
        now: Timestamp,
    ) -> Result<(), AdminError> {
        let refill = match refill {
            Some(schedule) => Some((schedule, first_period_end(schedule, now)?)),
            None => None,
        };
        let mut ledger = self.lock()?;
        // Settle any period that already ended under the old schedule first.
        let entry = ledger
            .account_at(account, now)
            .ok_or(AdminError::UnknownAccount)??;
        entry.refill = refill;
        Ok(())
    }

    /// Issues a key for `account`. The returned plaintext is the only copy.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`] or [`AdminError::Randomness`].
    pub fn issue_key(
        &self,
        account: AccountId,
        permissions: PermissionBits,
        now: Timestamp,
    ) -> Result<IssuedKey, AdminError> {
        let key = ApiKey::generate().map_err(|_| AdminError::Randomness)?;
        let mut ledger = self.lock()?;
        if !ledger.accounts.contains_key(&account) {
            return Err(AdminError::UnknownAccount);
        }
        ledger.last_key += 1;
        let key_id = KeyId(ledger.last_key);
        ledger.revision += 1;
        let record = KeyRecord {
            hash: key.hash(),
            prefix: key.prefix(),
            account_id: account,
            permissions,
            status: KeyStatus::Active,
            created_at: now,
            revoked_at: None,
            revision: ledger.revision,
        };
        ledger.keys_by_hash.insert(record.hash, key_id);
        ledger.keys_by_revision.insert(record.revision, key_id);
        ledger.keys.insert(key_id, record);
        Ok(IssuedKey {
            key,
            key_id,
            principal: principal_of(key_id),
        })
    }

    /// Revokes a key for good. Revoking a revoked key changes nothing.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownKey`].
    pub fn revoke_key(&self, key_id: KeyId, now: Timestamp) -> Result<(), AdminError> {
        let mut ledger = self.lock()?;
        let ledger = &mut *ledger;
        let record = ledger.keys.get_mut(&key_id).ok_or(AdminError::UnknownKey)?;
        if record.status == KeyStatus::Active {
            // A revision only for a change, as in the PostgreSQL store, so
            // both number the same calls alike.
            ledger.revision += 1;
            let revision = ledger.revision;
            record.status = KeyStatus::Revoked;
            record.revoked_at = Some(now);
            ledger.keys_by_revision.remove(&record.revision);
            ledger.keys_by_revision.insert(revision, key_id);
            record.revision = revision;
        }
        Ok(())
    }

    /// The keys of an account, oldest first.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`].
    pub fn list_keys(&self, account: AccountId) -> Result<Vec<KeyInfo>, AdminError> {
        let ledger = self.lock()?;
        if !ledger.accounts.contains_key(&account) {
            return Err(AdminError::UnknownAccount);
        }
        Ok(ledger
            .keys
            .iter()
            .filter(|(_, record)| record.account_id == account)
            .map(|(key_id, record)| KeyInfo {
                key_id: *key_id,
                principal: principal_of(*key_id),
                account_id: record.account_id,
                prefix: record.prefix.clone(),
                permissions: record.permissions,
                status: record.status,
                created_at: record.created_at,
                revoked_at: record.revoked_at,
            })
            .collect())
    }

    /// The usage events recorded for an account, in the order they arrived.
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`].
    pub fn usage(&self, account: AccountId) -> Result<Vec<UsageEvent>, AdminError> {
        let ledger = self.lock()?;
        if !ledger.accounts.contains_key(&account) {
            return Err(AdminError::UnknownAccount);
        }
        Ok(ledger
            .usage_by_account
            .get(&account)
            .map(|ids| ids.iter().map(|id| ledger.usage[id]).collect())
            .unwrap_or_default())
    }

    /// An account as of `now` (a refill period that ended is applied).
    ///
    /// # Errors
    ///
    /// [`AdminError::UnknownAccount`].
    pub fn account(&self, account: AccountId, now: Timestamp) -> Result<AccountView, AdminError> {
        let mut ledger = self.lock()?;
        ledger
            .account_at(account, now)
            .ok_or(AdminError::UnknownAccount)??;
        let entry = &ledger.accounts[&account];
        let mut leased = 0_u64;
        let mut settled_unbilled = 0_u64;
        for lease in ledger
            .leases
            .values()
            .filter(|lease| lease.account_id == account)
        {
            // Each lease is within the ledger's range, but top-ups let an
            // account hold several near its top at once: a view that cannot
            // show the sum shows the most it can, rather than panic and
            // poison the store for every caller.
            match lease.settlement {
                None => leased = leased.saturating_add(lease.granted),
                Some(settlement) => {
                    settled_unbilled = settled_unbilled
                        .saturating_add(lease.granted - settlement.credited - lease.used);
                }
            }
        }
        Ok(AccountView {
            id: account,
            status: entry.status,
            balance: CostUnits(entry.balance),
            mode: entry.mode,
            refill: entry.refill.map(|(schedule, _)| schedule),
            period_end: entry.refill.map(|(_, end)| end),
            leased: CostUnits(leased),
            overage_debt: CostUnits(entry.overage_debt),
            settled_unbilled: CostUnits(settled_unbilled),
        })
    }

    /// Checks the ledger equation for every account and the usage bound for
    /// every lease (I14, I15), and returns every violation found; empty when
    /// the books balance.
    ///
    /// # Errors
    ///
    /// When the store's lock was poisoned by a panic.
    pub fn audit(&self) -> Result<Vec<LedgerViolation>, StoreError> {
        let ledger = self.lock()?;
        Ok(ledger.audit())
    }

    fn lock(&self) -> Result<MutexGuard<'_, Ledger>, StoreError> {
        // Every call validates before it mutates, so a panic can only come
        // from a bug; fail closed rather than serve books it may have left
        // half-written.
        self.ledger
            .lock()
            .map_err(|_| StoreError::new("memory store poisoned by an earlier panic"))
    }

    /// When a lease granted at `now` for a requested `ttl` expires: the ttl
    /// clamped to the policy's maximum, refused if under a microsecond or past the
    /// end of time.
    fn expiry(&self, ttl: SignedDuration, now: Timestamp) -> Result<Timestamp, AllocateError> {
        let ttl = self
            .policy
            .lease_ttl(ttl)
            .ok_or(AllocateError::InvalidTtl)?;
        now.checked_add(ttl).map_err(|_| AllocateError::InvalidTtl)
    }

    fn acquire_now(
        &self,
        account: AccountId,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        let expires_at = self.expiry(ttl, now)?;
        if requested.max(needed).is_zero() {
            return Err(AllocateError::InvalidRequest);
        }
        let mut ledger = self.lock()?;
        let entry = ledger
            .account_at(account, now)
            .ok_or(AllocateError::UnknownAccount)??;
        let planned = plan_acquire(
            &self.policy,
            entry.status,
            entry.balance,
            entry.refill,
            requested,
            needed,
        )?;
        entry.balance = planned.left;
        let grant = ledger.open_lease(account, planned.size, expires_at);
        Ok(Allocation {
            grant,
            funding: planned.funding,
        })
    }

    fn release_now(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        now: Timestamp,
    ) -> Result<Released, AllocateError> {
        let mut ledger = self.lock()?;
        let account = ledger.settleable(lease_id, fencing_token, unspent)?;
        let entry = ledger
            .account_at(account, now)
            .ok_or(AllocateError::UnknownAccount)??;
        entry.balance = credited_balance(entry.balance, unspent.get())?;
        ledger.settle(lease_id, unspent.get());
        Ok(Released { credited: unspent })
    }

    #[allow(clippy::too_many_arguments)]
    fn consolidate_now(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        let expires_at = self.expiry(ttl, now)?;
        if requested.max(needed).is_zero() {
            return Err(AllocateError::InvalidRequest);
        }
        let mut ledger = self.lock()?;
        let account = ledger.settleable(lease_id, fencing_token, unspent)?;
        let entry = ledger
            .account_at(account, now)
            .ok_or(AllocateError::UnknownAccount)??;
        let planned = plan_consolidation(
            &self.policy,
            entry.status,
            entry.balance,
            entry.refill,
            unspent,
            requested,
            needed,
        )?;
        // I18: everything is checked; settle the old lease and grant the new
        // one as one step (the lock is held throughout).
        entry.balance = planned.left;
        ledger.settle(lease_id, unspent.get());
        let grant = ledger.open_lease(account, planned.size, expires_at);
        Ok(Allocation {
            grant,
            funding: planned.funding,
        })
    }

    fn reclaim_now(&self, now: Timestamp, limit: usize) -> Result<ReclaimBatch, StoreError> {
        // I19: a lease is due only once `expires_at + reclaim_grace <= now`.
        let Ok(cutoff) = now.checked_sub(self.policy.reclaim_grace) else {
            return Ok(ReclaimBatch::default());
        };
        let mut ledger = self.lock()?;
        let mut batch = ReclaimBatch::default();
        // Walked in expiry order from just past the last lease looked at:
        // settling removes a lease from the order, a blocked one stays and
        // is passed over. Each lease is judged once, after every credit
        // before it; later credits only raise balances, so a lease judged
        // blocked stays blocked for the rest of the call.
        let mut after = None;
        while let Some((lease_id, credit)) = ledger.next_due(&mut after, cutoff, now)? {
            let Some((account, remainder, balance)) = credit else {
                if batch.blocked.len() < limit {
                    let lease = &ledger.leases[&lease_id];
                    batch.blocked.push(BlockedLease {
                        lease_id,
                        account_id: lease.account_id,
                        remainder: CostUnits(lease.granted - lease.used),
                    });
                }
                continue;
            };
            if batch.reclaimed.len() == limit {
                batch.more = true;
                break;
            }
            ledger.credit_reclaimed(account, balance)?;
            ledger.settle(lease_id, remainder);
            batch.reclaimed.push(ReclaimedLease {
                lease_id,
                account_id: account,
                credited: CostUnits(remainder),
            });
        }
        Ok(batch)
    }

    fn ingest_now(&self, batch: &[UsageEvent]) -> Result<Vec<IngestOutcome>, StoreError> {
        let mut ledger = self.lock()?;
        Ok(batch.iter().map(|event| ledger.ingest(event)).collect())
    }

    fn snapshots_of(
        &self,
        principals: &[Principal],
        now: Timestamp,
    ) -> Result<Vec<PrincipalSnapshot>, StoreError> {
        let ledger = self.lock()?;
        Ok(principals
            .iter()
            .filter_map(|principal| ledger.snapshot(KeyId(principal.get()), now))
            .collect())
    }

    fn changed_since_now(
        &self,
        since: SnapshotCursor,
        limit: usize,
        now: Timestamp,
    ) -> Result<SnapshotPage, StoreError> {
        let ledger = self.lock()?;
        // One past the page says whether the page is the last.
        let mut changed: Vec<(u64, KeyId)> = ledger
            .keys_by_revision
            .range((Excluded(since.0), Unbounded))
            .map(|(revision, key_id)| (*revision, *key_id))
            .take(limit.saturating_add(1))
            .collect();
        let complete = changed.len() <= limit;
        changed.truncate(limit);
        let next = changed
            .last()
            .map_or(since, |(revision, _)| SnapshotCursor(*revision));
        let snapshots = changed
            .into_iter()
            .filter_map(|(_, key_id)| ledger.snapshot(key_id, now))
            .collect();
        Ok(SnapshotPage {
            snapshots,
            next,
            complete,
        })
    }

    fn lookup_now(
        &self,
        hash: &KeyHash,
        now: Timestamp,
    ) -> Result<Option<PrincipalSnapshot>, StoreError> {
        let ledger = self.lock()?;
        Ok(ledger
            .keys_by_hash
            .get(hash)
            .filter(|key_id| ledger.keys[key_id].status == KeyStatus::Active)
            .and_then(|key_id| ledger.snapshot(*key_id, now)))
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Ledger {
    /// The account, with any refill period that ended by `now` applied.
    /// `None` for an unknown account; `Some(Err)` when the next period end
    /// is past the end of time.
    fn account_at(
        &mut self,
        account: AccountId,
        now: Timestamp,
    ) -> Option<Result<&mut Account, StoreError>> {
        let entry = self.accounts.get_mut(&account)?;
        Some(entry.apply_refill(now).map(|()| entry))
    }

    /// Checks a release or consolidation claim against the lease, returning
    /// its account. Nothing is changed.
    fn settleable(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
    ) -> Result<AccountId, AllocateError> {
        let lease = self
            .leases
            .get(&lease_id)
            .ok_or(AllocateError::UnknownLease)?;
        if lease.fencing_token != fencing_token {
            return Err(AllocateError::Fenced);
        }
        if lease.settlement.is_some() {
            return Err(AllocateError::LeaseNotActive);
        }
        // I15: the lease cannot hold more than its grant less what was
        // billed against it.
        if unspent.get() > lease.granted - lease.used {
            return Err(AllocateError::InvalidRelease);
        }
        Ok(lease.account_id)
    }

    fn open_lease(
        &mut self,
        account_id: AccountId,
        units: u64,
        expires_at: Timestamp,
    ) -> LeaseGrant {
        self.last_lease += 1;
        self.last_fencing += 1;
        let lease_id = LeaseId(self.last_lease);
        let fencing_token = FencingToken(self.last_fencing);
        self.leases.insert(
            lease_id,
            Lease {
                account_id,
                fencing_token,
                granted: units,
                expires_at,
                used: 0,
                settlement: None,
            },
        );
        self.expiring.insert((expires_at, lease_id));
        LeaseGrant {
            lease_id,
            account_id,
            fencing_token,
            units: CostUnits(units),
            expires_at,
        }
    }

    /// The next due lease after `after` in expiry order (advancing
    /// `after`), with what settling it would do: its account, remainder and
    /// the balance after the credit, or `None` when the balance (after any
    /// refill due by `now`) has no room for the remainder.
    #[allow(clippy::type_complexity, reason = "a private step of one walk")]
    fn next_due(
        &mut self,
        after: &mut Option<(Timestamp, LeaseId)>,
        cutoff: Timestamp,
        now: Timestamp,
    ) -> Result<Option<(LeaseId, Option<(AccountId, u64, u64)>)>, StoreError> {
        let next = match *after {
            None => self.expiring.first(),
            Some(key) => self.expiring.range((Excluded(key), Unbounded)).next(),
        };
        let Some(&key) = next.filter(|(expires_at, _)| *expires_at <= cutoff) else {
            return Ok(None);
        };
        *after = Some(key);
        let lease_id = key.1;
        let lease = &self.leases[&lease_id];
        let (account, remainder) = (lease.account_id, lease.granted - lease.used);
        let Some(entry) = self.account_at(account, now) else {
            return Err(StoreError::new(format!(
                "{lease_id} names a missing account"
            )));
        };
        let credit = credited_balance(entry?.balance, remainder)
            .ok()
            .map(|balance| (account, remainder, balance));
        Ok(Some((lease_id, credit)))
    }

    /// Sets the balance of `account` to `balance`, a reclaim's credit.
    fn credit_reclaimed(&mut self, account: AccountId, balance: u64) -> Result<(), StoreError> {
        self.accounts
            .get_mut(&account)
            .ok_or_else(|| StoreError::new(format!("{account} went missing")))?
            .balance = balance;
        Ok(())
    }

    /// Marks a lease settled with `credited` units returned. The caller has
    /// already credited the balance. A lease leaves the active state once.
    fn settle(&mut self, lease_id: LeaseId, credited: u64) {
        let lease = self
            .leases
            .get_mut(&lease_id)
            .expect("settle is only called on a lease just checked to exist");
        debug_assert!(lease.settlement.is_none(), "a lease settles once");
        lease.settlement = Some(Settlement { credited });
        self.expiring.remove(&(lease.expires_at, lease_id));
    }

    fn ingest(&mut self, event: &UsageEvent) -> IngestOutcome {
        if let Some(recorded) = self.usage.get(&event.request_id) {
            // I8: the request id is the idempotency key.
            return if recorded == event {
                IngestOutcome::Duplicate
            } else {
                IngestOutcome::Rejected(RejectReason::ConflictingDuplicate)
            };
        }
        match self.admit(event) {
            Ok(()) => {
                self.usage.insert(event.request_id, *event);
                self.usage_by_account
                    .entry(event.account_id)
                    .or_default()
                    .push(event.request_id);
                IngestOutcome::Accepted
            }
            Err(reason) => IngestOutcome::Rejected(reason),
        }
    }

    /// Checks one event and applies its units to its lease or debt.
    fn admit(&mut self, event: &UsageEvent) -> Result<(), RejectReason> {
        // The bounds of the ledger's columns, as the PostgreSQL store has
        // them, so a value it would refuse is refused here too.
        if event.units.get() > UNITS_MAX
            || event.policy_revision > PolicyRevision::MAX
            || event.key_id.is_some_and(|key| key.get() > UNITS_MAX)
        {
            return Err(RejectReason::Malformed);
        }
        let account = self
            .accounts
            .get_mut(&event.account_id)
            .ok_or(RejectReason::UnknownAccount)?;
        match event.source {
            UsageSource::Overage => {
                account.overage_debt = account
                    .overage_debt
                    .checked_add(event.units.get())
                    .filter(|debt| *debt <= UNITS_MAX)
                    .ok_or(RejectReason::Malformed)?;
            }
            UsageSource::Leased {
                lease_id,
                fencing_token,
            } => {
                let lease = self
                    .leases
                    .get_mut(&lease_id)
                    .ok_or(RejectReason::UnknownLease)?;
                if lease.account_id != event.account_id {
                    return Err(RejectReason::AccountMismatch);
                }
                if lease.fencing_token != fencing_token {
                    return Err(RejectReason::FencingMismatch);
                }
                // I15: usage plus what settlement credited back never exceeds
                // the grant. A lease released with its exact remainder still
                // bills the charges committed before the release (their events
                // may trail it through the usage pipeline); a reclaimed lease,
                // whose settlement credited everything not yet billed, bills
                // nothing more: those units would count twice.
                let credited = lease.settlement.map_or(0, |settlement| settlement.credited);
                let used = lease.used + event.units.get();
                if u128::from(used) + u128::from(credited) > u128::from(lease.granted) {
                    return Err(if lease.settlement.is_some() {
                        RejectReason::LeaseSettled
                    } else {
                        RejectReason::ExceedsLease
                    });
                }
                lease.used = used;
            }
        }
        Ok(())
    }

    /// Bumps the revision of every key of `account`, whose snapshots embed
    /// the account's status and mode.
    fn touch_account_keys(&mut self, account: AccountId) {
        for (key_id, record) in self
            .keys
            .iter_mut()
            .filter(|(_, record)| record.account_id == account)
        {
            self.revision += 1;
            self.keys_by_revision.remove(&record.revision);
            self.keys_by_revision.insert(self.revision, *key_id);
            record.revision = self.revision;
        }
    }

    fn snapshot(&self, key_id: KeyId, now: Timestamp) -> Option<PrincipalSnapshot> {
        let record = self.keys.get(&key_id)?;
        let account = self.accounts.get(&record.account_id)?;
        Some(PrincipalSnapshot {
            principal: principal_of(key_id),
            account_id: record.account_id,
            key_id: Some(key_id),
            key_hash: Some(record.hash),
            permissions: record.permissions,
            key_status: record.status,
            account_status: account.status,
            mode: account.mode,
            policy_revision: PolicyRevision(record.revision),
            fetched_at: now,
        })
    }

    fn audit(&self) -> Vec<LedgerViolation> {
        let mut violations = Vec::new();
        let mut accounted: BTreeMap<AccountId, i128> = self
            .accounts
            .iter()
            .map(|(id, account)| (*id, i128::from(account.balance)))
            .collect();
        let mut leased_usage: HashMap<LeaseId, u64> = HashMap::new();
        let mut overage_usage: HashMap<AccountId, u64> = HashMap::new();
        for event in self.usage.values() {
            match event.source {
                UsageSource::Leased { lease_id, .. } => {
                    *leased_usage.entry(lease_id).or_default() += event.units.get();
                }
                UsageSource::Overage => {
                    *overage_usage.entry(event.account_id).or_default() += event.units.get();
                }
            }
        }
        for (lease_id, lease) in &self.leases {
            let credited = lease.settlement.map_or(0, |settlement| settlement.credited);
            match accounted.get_mut(&lease.account_id) {
                // I14: an active lease holds its whole grant; a settled one
                // keeps what was not credited back.
                Some(sum) => *sum += i128::from(lease.granted) - i128::from(credited),
                None => violations.push(LedgerViolation::OrphanLease {
                    lease_id: *lease_id,
                }),
            }
            if u128::from(lease.used) + u128::from(credited) > u128::from(lease.granted) {
                violations.push(LedgerViolation::LeaseOverdrawn {
                    lease_id: *lease_id,
                    granted: CostUnits(lease.granted),
                    used: CostUnits(lease.used),
                    credited: CostUnits(credited),
                });
            }
            let recorded = leased_usage.get(lease_id).copied().unwrap_or(0);
            if recorded != lease.used {
                violations.push(LedgerViolation::LeaseUsageMismatch {
                    lease_id: *lease_id,
                    counter: CostUnits(lease.used),
                    recorded: CostUnits(recorded),
                });
            }
        }
        for (account_id, account) in &self.accounts {
            let accounted_for = accounted[account_id];
            if account.credited_in != accounted_for {
                violations.push(LedgerViolation::AccountImbalance {
                    account_id: *account_id,
                    credited_in: account.credited_in,
                    accounted_for,
                });
            }
            let recorded = overage_usage.get(account_id).copied().unwrap_or(0);
            if recorded != account.overage_debt {
                violations.push(LedgerViolation::OverageDebtMismatch {
                    account_id: *account_id,
                    debt: CostUnits(account.overage_debt),
                    recorded: CostUnits(recorded),
                });
            }
        }
        violations
    }
}

impl Account {
    /// Applies every refill period that ended at or before `now`: the
    /// balance is reset to the refill amount, and the difference is booked
    /// as a net refill (I14). Several missed periods collapse into one
    /// reset, which is what they would have amounted to.
    fn apply_refill(&mut self, now: Timestamp) -> Result<(), StoreError> {
        let Some((schedule, end)) = self.refill else {
            return Ok(());
        };
        let Some(next_end) = next_period_end(schedule, end, now)? else {
            return Ok(());
        };
        self.credited_in += i128::from(schedule.amount.get()) - i128::from(self.balance);
        self.balance = schedule.amount.get();
        self.refill = Some((schedule, next_end));
        Ok(())
    }
}

/// Every key is its own principal, numbered like the key.
fn principal_of(key_id: KeyId) -> Principal {
    Principal(key_id.get())
}

#[async_trait]
impl LeaseAllocator for MemoryStore {
    fn shares_tails(&self) -> bool {
        self.policy.tail.instances > 1
    }

    async fn acquire_at_least(
        &self,
        account: AccountId,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        self.acquire_now(account, requested, needed, ttl, now)
    }

    async fn release(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        now: Timestamp,
    ) -> Result<Released, AllocateError> {
        self.release_now(lease_id, fencing_token, unspent, now)
    }

    async fn consolidate(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        self.consolidate_now(
            lease_id,
            fencing_token,
            unspent,
            requested,
            needed,
            ttl,
            now,
        )
    }

    async fn reclaim_expired_batch(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> Result<ReclaimBatch, StoreError> {
        self.reclaim_now(now, limit)
    }
}

#[async_trait]
impl UsageSink for MemoryStore {
    async fn ingest(&self, batch: &[UsageEvent]) -> Result<Vec<IngestOutcome>, StoreError> {
        self.ingest_now(batch)
    }
}

#[async_trait]
impl SnapshotSource for MemoryStore {
    async fn fetch(
        &self,
        principals: &[Principal],
        now: Timestamp,
    ) -> Result<Vec<PrincipalSnapshot>, StoreError> {
        self.snapshots_of(principals, now)
    }

    async fn changed_since(
        &self,
        since: SnapshotCursor,
        limit: usize,
        now: Timestamp,
    ) -> Result<SnapshotPage, StoreError> {
        self.changed_since_now(since, limit, now)
    }

    async fn lookup_key(
        &self,
        hash: &KeyHash,
        now: Timestamp,
    ) -> Result<Option<PrincipalSnapshot>, StoreError> {
        self.lookup_now(hash, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::TailSharing;

    fn store() -> MemoryStore {
        MemoryStore::new(GrantPolicy {
            max_ttl: SignedDuration::from_secs(60),
            reclaim_grace: SignedDuration::from_secs(1),
            tail: TailSharing {
                instances: 1,
                min_grant: CostUnits(1),
            },
        })
        .unwrap()
    }

    fn funded(store: &MemoryStore) -> AccountId {
        store
            .create_account(
                AccountSpec {
                    balance: CostUnits(100),
                    mode: EnforcementMode::Strict,
                    status: AccountStatus::Active,
                    refill: None,
                },
                Timestamp::UNIX_EPOCH,
            )
            .unwrap()
    }

    #[test]
    fn the_plaintext_key_is_never_stored() {
        let store = store();
        let account = funded(&store);
        let issued = store
            .issue_key(account, PermissionBits::ALL, Timestamp::UNIX_EPOCH)
            .unwrap();
        let secret = &issued.key.expose()[ApiKey::PREFIX.len()..];
        // I16: everything the store holds, printed, contains only the prefix.
        let ledger = store.lock().unwrap();
        let held = format!("{:?}", *ledger);
        assert!(!held.contains(secret), "the store holds the secret");
        assert!(held.contains(&secret[..8]), "the visible prefix is kept");
        // Printing shows only what `Debug` shows, so the record is also
        // taken apart field by field: a field added to it must be judged
        // here before this compiles again.
        let KeyRecord {
            hash,
            prefix,
            account_id,
            permissions: _,
            status: _,
            created_at: _,
            revoked_at: _,
            revision: _,
        } = &ledger.keys[&issued.key_id];
        assert_eq!(*hash, KeyHash::of(issued.key.expose().as_bytes()));
        assert_eq!(*prefix, issued.key.prefix());
        assert_eq!(*account_id, account);
        assert_eq!(
            ledger.keys_by_hash[hash], issued.key_id,
            "found by hash only"
        );
    }

    /// The revision index names every key once, at its current revision,
    /// through issues, revocations and account changes; paging by revision
    /// reads it in order.
    #[test]
    fn the_revision_index_follows_every_change_of_a_key() {
        let store = store();
        let (a, b) = (funded(&store), funded(&store));
        let now = Timestamp::UNIX_EPOCH;
        let keys: Vec<KeyId> = [a, b, a, b]
            .into_iter()
            .map(|account| {
                store
                    .issue_key(account, PermissionBits::ALL, now)
                    .unwrap()
                    .key_id
            })
            .collect();
        store.revoke_key(keys[1], now).unwrap();
        store.revoke_key(keys[1], now).unwrap();
        store.set_status(a, AccountStatus::Suspended).unwrap();
        {
            let ledger = store.lock().unwrap();
            assert_eq!(ledger.keys_by_revision.len(), ledger.keys.len());
            for (key_id, record) in &ledger.keys {
                assert_eq!(ledger.keys_by_revision.get(&record.revision), Some(key_id));
            }
        }
        let mut cursor = SnapshotCursor::START;
        let mut paged = Vec::new();
        loop {
            let page = store.changed_since_now(cursor, 3, now).unwrap();
            paged.extend(page.snapshots.iter().map(|s| s.principal.get()));
            cursor = page.next;
            if page.complete {
                break;
            }
        }
        // Key 3 was issued last but b's revocation and a's suspension came
        // after: 4, then 2, then a's keys 1 and 3.
        assert_eq!(paged, [4, 2, 1, 3]);
    }

    #[test]
    fn audit_finds_each_kind_of_broken_book() {
        let store = store();
        let account = funded(&store);
        let grant = store
            .acquire_now(
                account,
                CostUnits(40),
                CostUnits::ZERO,
                SignedDuration::from_secs(5),
                Timestamp::UNIX_EPOCH,
            )
            .unwrap()
            .grant;
        assert_eq!(store.audit().unwrap(), vec![]);
        {
            let mut ledger = store.lock().unwrap();
            ledger.accounts.get_mut(&account).unwrap().balance += 1;
            ledger.leases.get_mut(&grant.lease_id).unwrap().used = 41;
            ledger.accounts.get_mut(&account).unwrap().overage_debt = 2;
        }
        let violations = store.audit().unwrap();
        assert_eq!(
            violations,
            vec![
                LedgerViolation::LeaseOverdrawn {
                    lease_id: grant.lease_id,
                    granted: CostUnits(40),
                    used: CostUnits(41),
                    credited: CostUnits::ZERO,
                },
                LedgerViolation::LeaseUsageMismatch {
                    lease_id: grant.lease_id,
                    counter: CostUnits(41),
                    recorded: CostUnits::ZERO,
                },
                LedgerViolation::AccountImbalance {
                    account_id: account,
                    credited_in: 100,
                    accounted_for: 101,
                },
                LedgerViolation::OverageDebtMismatch {
                    account_id: account,
                    debt: CostUnits(2),
                    recorded: CostUnits::ZERO,
                },
            ]
        );
        assert!(violations[2].to_string().contains("100 units credited in"));
    }

    #[test]
    fn a_poisoned_store_fails_closed() {
        let store = std::sync::Arc::new(store());
        let account = funded(&store);
        let poisoner = std::sync::Arc::clone(&store);
        let _ = std::thread::spawn(move || {
            let _guard = poisoner.ledger.lock().unwrap();
            panic!("a bug while holding the lock");
        })
        .join();
        assert!(matches!(
            store.acquire_now(
                account,
                CostUnits(1),
                CostUnits::ZERO,
                SignedDuration::from_secs(5),
                Timestamp::UNIX_EPOCH
            ),
            Err(AllocateError::Storage(_))
        ));
        assert!(store.audit().is_err());
    }
}
