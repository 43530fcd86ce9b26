//! The store contract, call by call: every refusal, every settlement path,
//! reclaim, refills, usage ingest and keys, with exact balances and the
//! ledger audited after every scenario. The suite runs against every store:
//! each test is an `async fn name<S: TestStore>()`, instantiated once per
//! store by the `store_tests!` call at the bottom. The one check only the
//! memory store can answer (a nanosecond boundary) stands apart above it.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use jiff::{SignedDuration, Timestamp};
use support::stores::{TestStore, store_tests};
#[cfg(feature = "postgres")]
use tollgate::store::PostgresStore;
use tollgate::store::{
    AccountSpec, AdminError, AllocateError, Allocation, BlockedLease, GrantPolicy, IngestOutcome,
    KeyHash, LeaseAllocator, MemoryStore, ReclaimBatch, RefillSchedule, RejectReason,
    SnapshotCursor, TailSharing,
};
use tollgate::{
    AccountId, AccountStatus, BalanceExhaustion, BalanceShortfall, CostUnits, EnforcementMode,
    FencingToken, KeyId, KeyStatus, LeaseId, PermissionBits, PolicyRevision, Principal, RequestId,
    UsageEvent, UsageSource,
};

fn at(second: i64) -> Timestamp {
    Timestamp::from_second(second).expect("test instants are in range")
}

fn secs(n: i64) -> SignedDuration {
    SignedDuration::from_secs(n)
}

const TTL: SignedDuration = SignedDuration::from_secs(30);

/// How far past an id a store issued to look for one it never issued: ids
/// only grow, and no scenario issues this many of anything after it.
const NEVER_ISSUED: u64 = 1_000;

fn policy(instances: u64) -> GrantPolicy {
    GrantPolicy {
        max_ttl: secs(60),
        reclaim_grace: secs(10),
        tail: TailSharing {
            instances,
            min_grant: CostUnits(10),
        },
    }
}

async fn account<S: TestStore>(store: &S, balance: u64) -> AccountId {
    store
        .create_account(
            AccountSpec {
                balance: CostUnits(balance),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            at(0),
        )
        .await
        .unwrap()
}

/// A Strict account opened at 0 with `balance` units and a refill to
/// `amount` every 100 s.
async fn refilled_account<S: TestStore>(store: &S, balance: u64, amount: u64) -> AccountId {
    store
        .create_account(
            AccountSpec {
                balance: CostUnits(balance),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: Some(RefillSchedule {
                    amount: CostUnits(amount),
                    interval: secs(100),
                }),
            },
            at(0),
        )
        .await
        .unwrap()
}

async fn balance<S: TestStore>(store: &S, account: AccountId, now: Timestamp) -> u64 {
    store.account(account, now).await.unwrap().balance.get()
}

async fn audited<S: TestStore>(store: &S) {
    let violations = store.audit().await.unwrap();
    assert!(violations.is_empty(), "I14/I15 violated: {violations:#?}");
}

fn leased(request: u128, account: AccountId, allocation: &Allocation, units: u64) -> UsageEvent {
    UsageEvent {
        request_id: RequestId(request),
        account_id: account,
        source: UsageSource::Leased {
            lease_id: allocation.grant.lease_id,
            fencing_token: allocation.grant.fencing_token,
        },
        units: CostUnits(units),
        at: at(1),
        policy_revision: PolicyRevision(1),
        key_id: None,
    }
}

// ---- acquire ------------------------------------------------------------

async fn acquire_moves_units_from_the_balance_to_a_lease<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let allocation = store
        .acquire(acct, CostUnits(100), TTL, at(5))
        .await
        .unwrap();
    assert_eq!(allocation.grant.units, CostUnits(100));
    assert_eq!(allocation.grant.account_id, acct);
    assert_eq!(allocation.grant.expires_at, at(35));
    assert_eq!(allocation.funding, None, "900 left funds another 100");
    assert_eq!(balance(&store, acct, at(5)).await, 900);
    assert_eq!(
        store.account(acct, at(5)).await.unwrap().leased,
        CostUnits(100)
    );
    let second = store
        .acquire(acct, CostUnits(100), TTL, at(5))
        .await
        .unwrap();
    assert_ne!(second.grant.lease_id, allocation.grant.lease_id);
    assert_ne!(second.grant.fencing_token, allocation.grant.fencing_token);
    audited(&store).await;
}

async fn a_long_ttl_is_clamped_to_the_policy_maximum<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let allocation = store
        .acquire(acct, CostUnits(1), secs(3_600), at(0))
        .await
        .unwrap();
    assert_eq!(allocation.grant.expires_at, at(60));
    audited(&store).await;
}

async fn acquire_refuses_each_invalid_request_without_touching_the_balance<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 100).await;
    let suspended = account(&store, 100).await;
    store
        .set_status(suspended, AccountStatus::Suspended, at(0))
        .await
        .unwrap();
    let empty = account(&store, 0).await;
    let cases = [
        (
            AccountId(empty.get() + NEVER_ISSUED),
            CostUnits(10),
            TTL,
            AllocateError::UnknownAccount,
        ),
        (
            suspended,
            CostUnits(10),
            TTL,
            AllocateError::AccountInactive,
        ),
        (
            empty,
            CostUnits(10),
            TTL,
            AllocateError::BalanceExhausted(BalanceExhaustion { period_end: None }),
        ),
        (
            acct,
            CostUnits(10),
            SignedDuration::ZERO,
            AllocateError::InvalidTtl,
        ),
        (acct, CostUnits(10), secs(-5), AllocateError::InvalidTtl),
        // PostgreSQL keeps microseconds: shorter, a lease would be granted
        // expired there.
        (
            acct,
            CostUnits(10),
            SignedDuration::from_nanos(999),
            AllocateError::InvalidTtl,
        ),
        (acct, CostUnits::ZERO, TTL, AllocateError::InvalidRequest),
    ];
    for (account, requested, ttl, expected) in cases {
        assert_eq!(
            store.acquire(account, requested, ttl, at(0)).await,
            Err(expected.clone()),
            "{expected}"
        );
    }
    // A lease that would expire past the end of time.
    let last_second = Timestamp::from_second(Timestamp::MAX.as_second()).unwrap();
    assert_eq!(
        store.acquire(acct, CostUnits(10), TTL, last_second).await,
        Err(AllocateError::InvalidTtl)
    );
    assert_eq!(balance(&store, acct, at(0)).await, 100);
    assert_eq!(balance(&store, suspended, at(0)).await, 100);
    audited(&store).await;
}

async fn grants_shrink_in_the_tail_and_say_what_is_left<S: TestStore>() {
    let Some(store) = S::fresh(policy(4)).await else {
        return;
    };
    let acct = account(&store, 300).await;
    // 300 cannot fund four 100-unit grants: a quarter each, rounded up.
    let first = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    assert_eq!(first.grant.units, CostUnits(75));
    assert_eq!(first.funding, None, "225 left still funds a request of 100");
    let second = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    assert_eq!(second.grant.units, CostUnits(57));
    let mut left = 300 - 75 - 57;
    while left > 0 {
        let next = store
            .acquire(acct, CostUnits(100), TTL, at(0))
            .await
            .unwrap();
        left -= next.grant.units.get();
        if left < 100 {
            assert_eq!(
                next.funding,
                Some(BalanceShortfall {
                    remaining: CostUnits(left),
                    period_end: None
                })
            );
        }
    }
    assert_eq!(
        store.acquire(acct, CostUnits(100), TTL, at(0)).await,
        Err(AllocateError::BalanceExhausted(BalanceExhaustion {
            period_end: None
        }))
    );
    audited(&store).await;
}

// ---- release --------------------------------------------------------------

/// A floor is granted whole, even where tail sharing would give less, and a
/// balance short of it is refused, naming the balance, with nothing moved:
/// the lease manager chases a single quote this way (I27), and a grant
/// short of the quote would only move the balance onto one instance.
async fn an_acquire_with_a_floor_grants_at_least_it_or_nothing<S: TestStore>() {
    let Some(store) = S::fresh(policy(4)).await else {
        return;
    };
    let acct = account(&store, 300).await;
    let floored = store
        .acquire_at_least(acct, CostUnits(100), CostUnits(90), TTL, at(0))
        .await
        .unwrap();
    assert_eq!(floored.grant.units, CostUnits(90), "not the tail's 75");
    assert_eq!(floored.funding, None, "210 left funds another 100");
    assert_eq!(
        store
            .acquire_at_least(acct, CostUnits(100), CostUnits(211), TTL, at(0))
            .await,
        Err(AllocateError::BalanceInsufficient(BalanceShortfall {
            remaining: CostUnits(210),
            period_end: None,
        }))
    );
    assert_eq!(balance(&store, acct, at(0)).await, 210, "nothing moved");
    let whole = store
        .acquire_at_least(acct, CostUnits(10), CostUnits(210), TTL, at(0))
        .await
        .unwrap();
    assert_eq!(whole.grant.units, CostUnits(210));
    assert_eq!(
        whole.funding,
        Some(BalanceShortfall {
            remaining: CostUnits::ZERO,
            period_end: None,
        }),
        "judged against the floor, the larger of the two"
    );
    assert_eq!(
        store
            .acquire_at_least(acct, CostUnits(10), CostUnits(1), TTL, at(0))
            .await,
        Err(AllocateError::BalanceExhausted(BalanceExhaustion {
            period_end: None
        }))
    );
    // A refill that resets the balance above what is left names its period
    // end as the time to ask again.
    let refilled = refilled_account(&store, 50, 500).await;
    assert_eq!(
        store
            .acquire_at_least(refilled, CostUnits(100), CostUnits(100), TTL, at(0))
            .await,
        Err(AllocateError::BalanceInsufficient(BalanceShortfall {
            remaining: CostUnits(50),
            period_end: Some(at(100)),
        }))
    );
    assert_eq!(balance(&store, refilled, at(0)).await, 50);
    audited(&store).await;
}

async fn release_credits_the_unspent_units_and_settles_once<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let a = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    let g = a.grant;
    let released = store
        .release(g.lease_id, g.fencing_token, CostUnits(60), at(1))
        .await
        .unwrap();
    assert_eq!(released.credited, CostUnits(60));
    assert_eq!(balance(&store, acct, at(1)).await, 960);
    assert_eq!(
        store
            .release(g.lease_id, g.fencing_token, CostUnits(0), at(1))
            .await,
        Err(AllocateError::LeaseNotActive)
    );
    assert_eq!(
        balance(&store, acct, at(1)).await,
        960,
        "a second release credits nothing"
    );
    // The forty units neither credited nor billed are the crash exposure.
    assert_eq!(
        store.account(acct, at(1)).await.unwrap().settled_unbilled,
        CostUnits(40)
    );
    audited(&store).await;
}

async fn a_fenced_release_changes_nothing_and_the_holder_can_still_release<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let g = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap()
        .grant;
    assert_eq!(
        store
            .release(
                g.lease_id,
                FencingToken(g.fencing_token.get() + 100),
                CostUnits(100),
                at(1)
            )
            .await,
        Err(AllocateError::Fenced)
    );
    assert_eq!(balance(&store, acct, at(1)).await, 900);
    store
        .release(g.lease_id, g.fencing_token, CostUnits(100), at(1))
        .await
        .unwrap();
    assert_eq!(balance(&store, acct, at(1)).await, 1_000);
    assert_eq!(
        store
            .release(
                LeaseId(g.lease_id.get() + NEVER_ISSUED),
                g.fencing_token,
                CostUnits(1),
                at(1)
            )
            .await,
        Err(AllocateError::UnknownLease)
    );
    audited(&store).await;
}

async fn a_release_claiming_more_than_the_lease_can_hold_is_refused<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let a = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    let outcome = store.ingest(&[leased(1, acct, &a, 30)]).await.unwrap();
    assert_eq!(outcome, vec![IngestOutcome::Accepted]);
    let g = a.grant;
    // Thirty were billed, so at most seventy can come back.
    assert_eq!(
        store
            .release(g.lease_id, g.fencing_token, CostUnits(71), at(1))
            .await,
        Err(AllocateError::InvalidRelease)
    );
    assert_eq!(balance(&store, acct, at(1)).await, 900);
    store
        .release(g.lease_id, g.fencing_token, CostUnits(70), at(1))
        .await
        .unwrap();
    assert_eq!(balance(&store, acct, at(1)).await, 970);
    assert_eq!(
        store.account(acct, at(1)).await.unwrap().settled_unbilled,
        CostUnits::ZERO
    );
    audited(&store).await;
}

async fn a_release_to_a_suspended_account_still_returns_its_units<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 100).await;
    let g = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap()
        .grant;
    store
        .set_status(acct, AccountStatus::Suspended, at(1))
        .await
        .unwrap();
    store
        .release(g.lease_id, g.fencing_token, CostUnits(100), at(1))
        .await
        .unwrap();
    assert_eq!(balance(&store, acct, at(1)).await, 100);
    audited(&store).await;
}

// ---- consolidate ------------------------------------------------------------

async fn a_consolidation_settles_the_old_lease_and_grants_what_is_needed_in_one_step<
    S: TestStore,
>() {
    let Some(store) = S::fresh(policy(4)).await else {
        return;
    };
    let acct = account(&store, 200).await;
    let old = store
        .acquire(acct, CostUnits(50), TTL, at(0))
        .await
        .unwrap()
        .grant;
    assert_eq!(old.units, CostUnits(50));
    // 20 of the old lease's units were spent; 30 come back, and a quote of
    // 120 was refused. 150 + 30 = 180 available.
    let fresh = store
        .consolidate(
            old.lease_id,
            old.fencing_token,
            CostUnits(30),
            CostUnits(50),
            CostUnits(120),
            TTL,
            at(1),
        )
        .await
        .unwrap();
    assert_eq!(
        fresh.grant.units,
        CostUnits(120),
        "the floor beats tail sharing"
    );
    assert_eq!(fresh.grant.expires_at, at(31));
    assert_eq!(balance(&store, acct, at(1)).await, 60);
    assert_eq!(
        fresh.funding,
        Some(BalanceShortfall {
            remaining: CostUnits(60),
            period_end: None
        })
    );
    // I15, I18: the old lease settled in the same step; it can never be
    // released again.
    assert_eq!(
        store
            .release(old.lease_id, old.fencing_token, CostUnits(30), at(2))
            .await,
        Err(AllocateError::LeaseNotActive)
    );
    assert_eq!(balance(&store, acct, at(2)).await, 60);
    audited(&store).await;
}

async fn a_refused_consolidation_leaves_the_old_lease_active_and_releasable<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 100).await;
    let old = store
        .acquire(acct, CostUnits(60), TTL, at(0))
        .await
        .unwrap()
        .grant;
    // 40 in the balance + 50 unspent = 90 < 95 needed.
    let refused = store
        .consolidate(
            old.lease_id,
            old.fencing_token,
            CostUnits(50),
            CostUnits(60),
            CostUnits(95),
            TTL,
            at(1),
        )
        .await;
    assert_eq!(
        refused,
        Err(AllocateError::BalanceInsufficient(BalanceShortfall {
            remaining: CostUnits(90),
            period_end: None
        }))
    );
    assert_eq!(balance(&store, acct, at(1)).await, 40, "I18: rolled back");
    let stale = FencingToken(old.fencing_token.get() + NEVER_ISSUED);
    for (token, unspent, requested, needed, ttl, expected) in [
        (stale, 50, 60, 10, TTL, AllocateError::Fenced),
        (
            old.fencing_token,
            61,
            60,
            10,
            TTL,
            AllocateError::InvalidRelease,
        ),
        (
            old.fencing_token,
            50,
            60,
            10,
            SignedDuration::ZERO,
            AllocateError::InvalidTtl,
        ),
        (
            old.fencing_token,
            50,
            0,
            0,
            TTL,
            AllocateError::InvalidRequest,
        ),
    ] {
        let outcome = store
            .consolidate(
                old.lease_id,
                token,
                CostUnits(unspent),
                CostUnits(requested),
                CostUnits(needed),
                ttl,
                at(1),
            )
            .await;
        assert_eq!(outcome, Err(expected.clone()), "{expected}");
    }
    store
        .set_status(acct, AccountStatus::Suspended, at(1))
        .await
        .unwrap();
    assert_eq!(
        store
            .consolidate(
                old.lease_id,
                old.fencing_token,
                CostUnits(50),
                CostUnits(60),
                CostUnits(10),
                TTL,
                at(1)
            )
            .await,
        Err(AllocateError::AccountInactive)
    );
    assert_eq!(balance(&store, acct, at(1)).await, 40);
    // Still active: its holder releases it normally.
    store
        .release(old.lease_id, old.fencing_token, CostUnits(50), at(2))
        .await
        .unwrap();
    assert_eq!(balance(&store, acct, at(2)).await, 90);
    audited(&store).await;
}

async fn consolidating_an_empty_account_with_nothing_unspent_is_exhaustion<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 10).await;
    let old = store
        .acquire(acct, CostUnits(10), TTL, at(0))
        .await
        .unwrap()
        .grant;
    assert_eq!(
        store
            .consolidate(
                old.lease_id,
                old.fencing_token,
                CostUnits(0),
                CostUnits(10),
                CostUnits(5),
                TTL,
                at(1)
            )
            .await,
        Err(AllocateError::BalanceExhausted(BalanceExhaustion {
            period_end: None
        }))
    );
    audited(&store).await;
}

// ---- reclaim --------------------------------------------------------------

async fn reclaim_waits_for_the_grace_and_credits_the_remainder_net_of_usage<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let a = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    store.ingest(&[leased(1, acct, &a, 25)]).await.unwrap();
    // I19: expires at 30, grace 10: due at 40, not a millisecond before
    // (the memory store's own test below goes down to the nanosecond).
    // I13: these instants are seconds after 1970; a store that read a clock
    // of its own would find the lease long expired, or not yet granted.
    let just_before = at(40) - SignedDuration::from_millis(1);
    let early = store.reclaim_expired_batch(just_before, 10).await.unwrap();
    assert!(early.reclaimed.is_empty());
    assert!(!early.more);
    // A limit of zero settles nothing and says whether anything is due.
    let none_due = store.reclaim_expired_batch(just_before, 0).await.unwrap();
    assert_eq!(none_due, ReclaimBatch::default());
    let one_due = store.reclaim_expired_batch(at(40), 0).await.unwrap();
    assert_eq!(
        one_due,
        ReclaimBatch {
            more: true,
            ..ReclaimBatch::default()
        }
    );
    let batch = store.reclaim_expired_batch(at(40), 10).await.unwrap();
    assert_eq!(batch.reclaimed.len(), 1);
    assert_eq!(batch.reclaimed[0].lease_id, a.grant.lease_id);
    assert_eq!(batch.reclaimed[0].credited, CostUnits(75));
    assert_eq!(balance(&store, acct, at(40)).await, 975);
    // A late event for the reclaimed lease would count its units twice.
    assert_eq!(
        store.ingest(&[leased(2, acct, &a, 5)]).await.unwrap(),
        vec![IngestOutcome::Rejected(RejectReason::LeaseSettled)]
    );
    let g = a.grant;
    assert_eq!(
        store
            .release(g.lease_id, g.fencing_token, CostUnits(75), at(41))
            .await,
        Err(AllocateError::LeaseNotActive)
    );
    assert!(
        store
            .reclaim_expired_batch(at(100), 10)
            .await
            .unwrap()
            .reclaimed
            .is_empty()
    );
    audited(&store).await;
}

async fn reclaim_pages_through_due_leases<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    for _ in 0..5 {
        store
            .acquire(acct, CostUnits(10), TTL, at(0))
            .await
            .unwrap();
    }
    let first = store.reclaim_expired_batch(at(40), 2).await.unwrap();
    assert_eq!((first.reclaimed.len(), first.more), (2, true));
    let second = store.reclaim_expired_batch(at(40), 2).await.unwrap();
    assert_eq!((second.reclaimed.len(), second.more), (2, true));
    let third = store.reclaim_expired_batch(at(40), 2).await.unwrap();
    assert_eq!((third.reclaimed.len(), third.more), (1, false));
    assert_eq!(balance(&store, acct, at(40)).await, 1_000);
    audited(&store).await;
}

const TOP: u64 = i64::MAX as u64;

/// An account whose balance is `TOP - 10` with a lease of 100 units out
/// since `granted_at`: the lease's remainder has no room to come back.
async fn full_account<S: TestStore>(store: &S, granted_at: i64) -> (AccountId, Allocation) {
    let acct = account(store, TOP - 10).await;
    let lease = store
        .acquire(acct, CostUnits(100), TTL, at(granted_at))
        .await
        .unwrap();
    store
        .top_up(acct, CostUnits(100), at(granted_at))
        .await
        .unwrap();
    (acct, lease)
}

fn blocked(account: AccountId, lease: &Allocation) -> BlockedLease {
    BlockedLease {
        lease_id: lease.grant.lease_id,
        account_id: account,
        remainder: CostUnits(100),
    }
}

/// I19: a due lease whose remainder its account's balance has no room for
/// (below `i64::MAX`) is passed over and reported, never an error: it
/// counts against no limit, the leases behind it are settled and paged as
/// usual, the first `limit` blocked leases by expiry are named by the call
/// that ends each pass, and a blocked lease settles once its account has
/// room.
async fn a_lease_reclaim_cannot_credit_is_reported_and_holds_up_no_other<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let small = account(&store, 1_000).await;
    let (full, a) = full_account(&store, 0).await;
    let b = store
        .acquire(small, CostUnits(10), TTL, at(1))
        .await
        .unwrap();
    let (other, c) = full_account(&store, 2).await;
    let d = store
        .acquire(small, CostUnits(10), TTL, at(3))
        .await
        .unwrap();

    let all_blocked = vec![blocked(full, &a), blocked(other, &c)];
    let first = store.reclaim_expired_batch(at(50), 1).await.unwrap();
    assert_eq!(first.reclaimed.len(), 1);
    assert_eq!(first.reclaimed[0].lease_id, b.grant.lease_id);
    assert!(first.more, "d can still be settled");
    assert!(
        all_blocked.starts_with(&first.blocked),
        "a call that goes on may name some, by expiry: {:?}",
        first.blocked
    );
    let second = store.reclaim_expired_batch(at(50), 1).await.unwrap();
    assert_eq!(second.reclaimed.len(), 1);
    assert_eq!(second.reclaimed[0].lease_id, d.grant.lease_id);
    assert!(!second.more);
    assert_eq!(
        second.blocked,
        all_blocked[..1],
        "the call that ends the pass names the first `limit` by expiry"
    );
    let third = store.reclaim_expired_batch(at(50), 2).await.unwrap();
    assert!(third.reclaimed.is_empty());
    assert!(!third.more);
    // With only blocked leases due, a limit of zero says none can be
    // settled now.
    let none = store.reclaim_expired_batch(at(50), 0).await.unwrap();
    assert!(none.reclaimed.is_empty() && !none.more, "{none:?}");
    assert_eq!(third.blocked, all_blocked, "named again on every pass");
    assert_eq!(balance(&store, small, at(50)).await, 1_000);
    assert_eq!(balance(&store, full, at(50)).await, TOP - 10);
    audited(&store).await;

    // The account spends 200 units; now its remainder fits.
    let spent = store
        .acquire(full, CostUnits(200), TTL, at(50))
        .await
        .unwrap();
    store.ingest(&[leased(1, full, &spent, 200)]).await.unwrap();
    let last = store.reclaim_expired_batch(at(50), 2).await.unwrap();
    assert_eq!(last.reclaimed.len(), 1);
    assert_eq!(last.reclaimed[0].lease_id, a.grant.lease_id);
    assert_eq!(last.reclaimed[0].credited, CostUnits(100));
    assert_eq!(last.blocked, vec![blocked(other, &c)]);
    assert_eq!(balance(&store, full, at(50)).await, TOP - 110);
    audited(&store).await;
}

/// I19, I14: room is judged on the balance an account has at the reclaim,
/// after any refill due by then, and after the credits the same batch made:
/// of two leases that each fit alone, the second is reported blocked.
async fn reclaim_judges_room_after_refills_and_its_own_credits<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    // A refill of 100 every 100 s; balance topped up near the top after a
    // lease went out. The refill at 100 resets the balance to 100.
    let refilled = refilled_account(&store, 100, 100).await;
    let r = store
        .acquire(refilled, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    store
        .top_up(refilled, CostUnits(TOP - 10), at(0))
        .await
        .unwrap();
    // Two leases of 100 and 100 units of room: one of them comes back.
    let twice = account(&store, TOP - 210).await;
    let x = store
        .acquire(twice, CostUnits(100), TTL, at(1))
        .await
        .unwrap();
    let y = store
        .acquire(twice, CostUnits(100), TTL, at(2))
        .await
        .unwrap();
    store.top_up(twice, CostUnits(300), at(2)).await.unwrap();

    let batch = store.reclaim_expired_batch(at(150), 10).await.unwrap();
    let settled: Vec<LeaseId> = batch.reclaimed.iter().map(|l| l.lease_id).collect();
    assert_eq!(settled, vec![r.grant.lease_id, x.grant.lease_id]);
    assert!(!batch.more);
    assert_eq!(batch.blocked, vec![blocked(twice, &y)]);
    assert_eq!(balance(&store, refilled, at(150)).await, 200);
    assert_eq!(balance(&store, twice, at(150)).await, TOP - 10);
    audited(&store).await;
}

async fn concurrent_reclaimers_settle_each_lease_once<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 100_000).await;
    let store = Arc::new(store);
    let mut granted = 0;
    for _ in 0..200 {
        granted += store
            .acquire(acct, CostUnits(7), TTL, at(0))
            .await
            .unwrap()
            .grant
            .units
            .get();
    }
    // Started together, on four worker threads (see the test list).
    let start = Arc::new(tokio::sync::Barrier::new(4));
    let reclaimers: Vec<_> = (0..4)
        .map(|_| {
            let (store, start) = (Arc::clone(&store), Arc::clone(&start));
            tokio::spawn(async move {
                let mut mine = Vec::new();
                start.wait().await;
                loop {
                    let batch = store.reclaim_expired_batch(at(100), 3).await.unwrap();
                    if batch.reclaimed.is_empty() {
                        return mine;
                    }
                    mine.extend(batch.reclaimed);
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for reclaimer in reclaimers {
        all.extend(reclaimer.await.unwrap());
    }
    let credited: u64 = all.iter().map(|lease| lease.credited.get()).sum();
    // Exactly once: as many reclaims as leases, and no lease twice.
    assert_eq!(all.len(), 200, "I19: one reclaim per lease");
    all.sort_by_key(|lease| lease.lease_id);
    all.dedup_by_key(|lease| lease.lease_id);
    assert_eq!(all.len(), 200, "I19: every lease reclaimed exactly once");
    assert_eq!(credited, granted);
    assert_eq!(balance(&*store, acct, at(100)).await, 100_000);
    audited(&*store).await;
}

// ---- refills and top-ups ------------------------------------------------------

async fn a_refill_resets_the_balance_at_each_period_end<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = refilled_account(&store, 50, 200).await;
    let first = store
        .acquire(acct, CostUnits(50), TTL, at(1))
        .await
        .unwrap();
    assert_eq!(
        store.acquire(acct, CostUnits(10), TTL, at(2)).await,
        Err(AllocateError::BalanceExhausted(BalanceExhaustion {
            period_end: Some(at(100))
        })),
        "exhaustion says when the balance comes back"
    );
    assert_eq!(first.funding.unwrap().period_end, Some(at(100)));
    // At the period end the balance is the refill amount.
    let refilled = store
        .acquire(acct, CostUnits(10), TTL, at(100))
        .await
        .unwrap();
    assert_eq!(refilled.grant.units, CostUnits(10));
    assert_eq!(balance(&store, acct, at(100)).await, 190);
    assert_eq!(
        store.account(acct, at(100)).await.unwrap().period_end,
        Some(at(200))
    );
    // Three periods later: one reset, not three, and the next end follows.
    assert_eq!(balance(&store, acct, at(450)).await, 200);
    assert_eq!(
        store.account(acct, at(450)).await.unwrap().period_end,
        Some(at(500))
    );
    audited(&store).await;
}

/// I12, I14: a refusal names the period end as when to retry only when the
/// refill then resets the balance above what is left: a quote larger than
/// the refill amount is not funded by waiting for it, and a client told to
/// retry then would be refused again every period.
async fn a_refusal_names_the_period_end_only_when_the_refill_brings_more<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    // A balance of 500 the refill resets to 300: waiting loses units.
    let shrinking = refilled_account(&store, 500, 300).await;
    let lease = store
        .acquire(shrinking, CostUnits(100), TTL, at(1))
        .await
        .unwrap();
    assert_eq!(lease.funding, None, "400 left");
    // A fold for a quote of 1000: 500 with the lease's 100 back.
    let fold_for = |lease: &Allocation, needed: u64| {
        store.consolidate(
            lease.grant.lease_id,
            lease.grant.fencing_token,
            CostUnits(100),
            CostUnits(100),
            CostUnits(needed),
            TTL,
            at(2),
        )
    };
    assert_eq!(
        fold_for(&lease, 1_000).await,
        Err(AllocateError::BalanceInsufficient(BalanceShortfall {
            remaining: CostUnits(500),
            period_end: None
        })),
        "after the reset: 300 and the lease's 100, less than the 500 now"
    );
    let spent = store
        .acquire(shrinking, CostUnits(350), TTL, at(3))
        .await
        .unwrap();
    assert_eq!(
        spent.funding,
        Some(BalanceShortfall {
            remaining: CostUnits(50),
            period_end: Some(at(100))
        }),
        "50 left, and the reset brings 300"
    );

    // A balance of 400 the refill resets to 500: the refused fold's lease
    // keeps its 100 through the reset, so waiting brings 600 in all.
    let growing = refilled_account(&store, 500, 500).await;
    let lease = store
        .acquire(growing, CostUnits(100), TTL, at(1))
        .await
        .unwrap();
    assert_eq!(
        fold_for(&lease, 550).await,
        Err(AllocateError::BalanceInsufficient(BalanceShortfall {
            remaining: CostUnits(500),
            period_end: Some(at(100))
        })),
        "after the reset: 500 and the lease's 100, enough for 550"
    );
    audited(&store).await;
}

/// I14: a refill resets the balance, not the units out on leases: what a
/// lease leased before the reset does not spend is credited to the new
/// period when it comes back.
async fn units_leased_at_a_reset_come_back_to_the_new_period<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = refilled_account(&store, 100, 100).await;
    let lease = store
        .acquire(acct, CostUnits(60), secs(60), at(50))
        .await
        .unwrap();
    store.ingest(&[leased(1, acct, &lease, 20)]).await.unwrap();
    // The 40 units left in the balance are not carried forward...
    assert_eq!(balance(&store, acct, at(100)).await, 100);
    // ...but the 40 the lease did not spend are.
    let g = lease.grant;
    store
        .release(g.lease_id, g.fencing_token, CostUnits(40), at(100))
        .await
        .unwrap();
    assert_eq!(balance(&store, acct, at(100)).await, 140);
    audited(&store).await;
}

async fn a_top_up_funds_the_next_acquire<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 0).await;
    assert!(matches!(
        store.acquire(acct, CostUnits(10), TTL, at(0)).await,
        Err(AllocateError::BalanceExhausted(_))
    ));
    assert_eq!(
        store.top_up(acct, CostUnits(25), at(1)).await.unwrap(),
        CostUnits(25)
    );
    assert_eq!(
        store
            .acquire(acct, CostUnits(10), TTL, at(1))
            .await
            .unwrap()
            .grant
            .units,
        CostUnits(10)
    );
    assert_eq!(
        store
            .top_up(AccountId(acct.get() + NEVER_ISSUED), CostUnits(1), at(1))
            .await,
        Err(AdminError::UnknownAccount)
    );
    assert_eq!(
        store.top_up(acct, CostUnits(u64::MAX), at(1)).await,
        Err(AdminError::BalanceOverflow)
    );
    assert_eq!(balance(&store, acct, at(1)).await, 15);
    // Nor can an account open above the ledger's range: it could spend
    // units no release could ever credit back.
    let spec = |balance| AccountSpec {
        balance: CostUnits(balance),
        mode: EnforcementMode::Strict,
        status: AccountStatus::Active,
        refill: None,
    };
    let largest = i64::MAX.unsigned_abs();
    assert_eq!(
        store.create_account(spec(largest + 1), at(1)).await,
        Err(AdminError::BalanceOverflow)
    );
    let roomy = store.create_account(spec(largest), at(1)).await.unwrap();
    let lease = store
        .acquire(roomy, CostUnits(1_000), TTL, at(1))
        .await
        .unwrap()
        .grant;
    store
        .release(lease.lease_id, lease.fencing_token, lease.units, at(1))
        .await
        .expect("the largest balance takes its units back");
    assert_eq!(balance(&store, roomy, at(1)).await, largest);
    audited(&store).await;
}

async fn a_refill_interval_must_be_positive<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 0).await;
    let bad = RefillSchedule {
        amount: CostUnits(1),
        interval: SignedDuration::ZERO,
    };
    assert_eq!(
        store.configure_refill(acct, Some(bad), at(0)).await,
        Err(AdminError::InvalidRefill)
    );
    audited(&store).await;
}

// ---- usage ingest ------------------------------------------------------------

/// I15: a batch is judged event by event, in order, however a store records
/// it. A batch that fits its leases exactly is all accepted; one whose
/// total does not fit accepts what fits in order, so a small event after a
/// refused large one still lands; overage in the same batch adds to the
/// debt.
async fn a_batch_is_judged_in_order_even_when_it_could_be_recorded_at_once<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let full = store
        .acquire(acct, CostUnits(30), TTL, at(0))
        .await
        .unwrap();
    let tight = store
        .acquire(acct, CostUnits(10), TTL, at(0))
        .await
        .unwrap();
    let overage = |request, units| UsageEvent {
        source: UsageSource::Overage,
        ..leased(request, acct, &full, units)
    };
    let exact = [
        leased(1, acct, &full, 10),
        overage(2, 4),
        leased(3, acct, &full, 20),
    ];
    assert_eq!(
        store.ingest(&exact).await.unwrap(),
        vec![IngestOutcome::Accepted; 3],
        "a batch that fills its lease exactly fits"
    );
    let over = [
        leased(4, acct, &tight, 8),
        leased(5, acct, &tight, 5),
        overage(6, 1),
        leased(7, acct, &tight, 2),
    ];
    assert_eq!(
        store.ingest(&over).await.unwrap(),
        vec![
            IngestOutcome::Accepted,
            IngestOutcome::Rejected(RejectReason::ExceedsLease),
            IngestOutcome::Accepted,
            IngestOutcome::Accepted,
        ]
    );
    let billed: Vec<u128> = store
        .usage(acct)
        .await
        .unwrap()
        .iter()
        .map(|event| event.request_id.get())
        .collect();
    assert_eq!(billed, vec![1, 2, 3, 4, 6, 7]);
    assert_eq!(
        store.account(acct, at(1)).await.unwrap().overage_debt,
        CostUnits(5)
    );
    audited(&store).await;
}

/// I14, I18: a release or fold whose credit would take the balance past
/// the largest a store holds is refused and changes nothing; the units can
/// come back once spending makes room. (The check runs before the lease is
/// settled: settled first, the lease would be gone with its units never
/// credited.)
async fn crediting_past_the_largest_balance_is_refused_and_changes_nothing<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let largest = i64::MAX.unsigned_abs();
    let acct = account(&store, largest).await;
    let g = store
        .acquire(acct, CostUnits(10), TTL, at(0))
        .await
        .unwrap()
        .grant;
    store.top_up(acct, CostUnits(10), at(0)).await.unwrap();
    assert_eq!(
        store
            .release(g.lease_id, g.fencing_token, CostUnits(10), at(1))
            .await,
        Err(AllocateError::BalanceOverflow)
    );
    assert_eq!(
        store
            .consolidate(
                g.lease_id,
                g.fencing_token,
                CostUnits(10),
                CostUnits(5),
                CostUnits(5),
                TTL,
                at(1)
            )
            .await,
        Err(AllocateError::BalanceOverflow)
    );
    assert_eq!(
        store
            .create_account(
                AccountSpec {
                    balance: CostUnits(largest + 1),
                    mode: EnforcementMode::Strict,
                    status: AccountStatus::Active,
                    refill: None,
                },
                at(0)
            )
            .await,
        Err(AdminError::BalanceOverflow),
        "a store holds at most i64::MAX units"
    );
    assert_eq!(balance(&store, acct, at(1)).await, largest);
    let view = store.account(acct, at(1)).await.unwrap();
    assert_eq!(view.leased, CostUnits(10), "the lease is still active");
    // Spent units make room: the lease can still come back.
    store
        .release(g.lease_id, g.fencing_token, CostUnits::ZERO, at(1))
        .await
        .unwrap();
    audited(&store).await;
}

/// I9, I15: a lease released with its exact remainder still takes the
/// trailing events of charges committed before the release, up to what it
/// granted, and a reclaimed lease still takes an event of zero units (a
/// free request whose lease was reclaimed before its event arrived); any
/// unit more is refused as settled.
async fn a_settled_lease_takes_its_trailing_and_zero_unit_events<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let released = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    // 40 committed: 25 delivered before the release, 15 after it.
    assert_eq!(
        store
            .ingest(&[leased(1, acct, &released, 25)])
            .await
            .unwrap(),
        [IngestOutcome::Accepted]
    );
    store
        .release(
            released.grant.lease_id,
            released.grant.fencing_token,
            CostUnits(60),
            at(1),
        )
        .await
        .unwrap();
    assert_eq!(
        store
            .ingest(&[
                leased(2, acct, &released, 15),
                leased(3, acct, &released, 1),
                leased(4, acct, &released, 0),
            ])
            .await
            .unwrap(),
        [
            IngestOutcome::Accepted,
            IngestOutcome::Rejected(RejectReason::LeaseSettled),
            IngestOutcome::Accepted,
        ]
    );

    let reclaimed = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    let batch = store.reclaim_expired_batch(at(100), 10).await.unwrap();
    assert_eq!(
        batch
            .reclaimed
            .iter()
            .map(|lease| lease.lease_id)
            .collect::<Vec<_>>(),
        [reclaimed.grant.lease_id]
    );
    assert_eq!(
        store
            .ingest(&[
                leased(5, acct, &reclaimed, 0),
                leased(6, acct, &reclaimed, 1),
            ])
            .await
            .unwrap(),
        [
            IngestOutcome::Accepted,
            IngestOutcome::Rejected(RejectReason::LeaseSettled),
        ]
    );
    assert_eq!(balance(&store, acct, at(100)).await, 1_000 - 40);
    audited(&store).await;
}

#[allow(
    clippy::too_many_lines,
    reason = "one batch exercising every outcome, read top to bottom"
)]
async fn ingest_reports_every_outcome_per_event_in_order<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let other = account(&store, 1_000).await;
    let a = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    let settled = store
        .acquire(acct, CostUnits(10), TTL, at(0))
        .await
        .unwrap();
    store
        .release(
            settled.grant.lease_id,
            settled.grant.fencing_token,
            CostUnits(10),
            at(0),
        )
        .await
        .unwrap();
    let ok = leased(1, acct, &a, 40);
    let mut changed = ok;
    changed.units = CostUnits(41);
    let mut stale = leased(3, acct, &a, 1);
    stale.source = UsageSource::Leased {
        lease_id: a.grant.lease_id,
        fencing_token: FencingToken(a.grant.fencing_token.get() + NEVER_ISSUED),
    };
    let mut missing_lease = leased(4, acct, &a, 1);
    missing_lease.source = UsageSource::Leased {
        lease_id: LeaseId(settled.grant.lease_id.get() + NEVER_ISSUED),
        fencing_token: a.grant.fencing_token,
    };
    let mut wrong_account = leased(5, other, &a, 1);
    wrong_account.account_id = other;
    let never_issued = AccountId(other.get() + NEVER_ISSUED);
    let mut unknown_account = leased(6, never_issued, &a, 1);
    unknown_account.account_id = never_issued;
    let overage = UsageEvent {
        source: UsageSource::Overage,
        ..leased(7, acct, &a, 15)
    };
    let huge = leased(8, acct, &a, u64::MAX);
    let batch = [
        ok,
        ok,
        changed,
        stale,
        missing_lease,
        wrong_account,
        unknown_account,
        leased(9, acct, &settled, 1),
        leased(10, acct, &a, 61),
        overage,
        huge,
        leased(11, acct, &a, 60),
    ];
    let outcomes = store.ingest(&batch).await.unwrap();
    assert_eq!(
        outcomes,
        vec![
            IngestOutcome::Accepted,
            IngestOutcome::Duplicate,
            IngestOutcome::Rejected(RejectReason::ConflictingDuplicate),
            IngestOutcome::Rejected(RejectReason::FencingMismatch),
            IngestOutcome::Rejected(RejectReason::UnknownLease),
            IngestOutcome::Rejected(RejectReason::AccountMismatch),
            IngestOutcome::Rejected(RejectReason::UnknownAccount),
            IngestOutcome::Rejected(RejectReason::LeaseSettled),
            IngestOutcome::Rejected(RejectReason::ExceedsLease),
            IngestOutcome::Accepted,
            IngestOutcome::Rejected(RejectReason::Malformed),
            IngestOutcome::Accepted,
        ]
    );
    let recorded = store.usage(acct).await.unwrap();
    assert_eq!(
        recorded
            .iter()
            .map(|event| event.request_id.get())
            .collect::<Vec<_>>(),
        vec![1, 7, 11]
    );
    assert_eq!(
        store.account(acct, at(1)).await.unwrap().overage_debt,
        CostUnits(15)
    );
    // The lease is now fully billed: nothing can come back.
    let g = a.grant;
    assert_eq!(
        store
            .release(g.lease_id, g.fencing_token, CostUnits(1), at(2))
            .await,
        Err(AllocateError::InvalidRelease)
    );
    store
        .release(g.lease_id, g.fencing_token, CostUnits(0), at(2))
        .await
        .unwrap();
    // A re-delivery after settlement is still recognised as a duplicate.
    assert_eq!(
        store.ingest(&[ok]).await.unwrap(),
        vec![IngestOutcome::Duplicate]
    );
    audited(&store).await;
}

// ---- keys and snapshots ---------------------------------------------------------

async fn a_key_resolves_by_its_hash_until_revoked<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 10).await;
    let read = PermissionBits::bit(0);
    let issued = store.issue_key(acct, read, at(3)).await.unwrap();
    let hash = KeyHash::of(issued.key.expose().as_bytes());
    let snapshot = store
        .lookup_key(&hash, at(4))
        .await
        .unwrap()
        .expect("resolves");
    assert_eq!(snapshot.principal, issued.principal);
    assert_eq!(snapshot.account_id, acct);
    assert_eq!(snapshot.key_id, Some(issued.key_id));
    assert_eq!(snapshot.permissions, read);
    assert_eq!(snapshot.key_status, KeyStatus::Active);
    assert_eq!(snapshot.fetched_at, at(4));
    assert_eq!(
        store
            .lookup_key(&KeyHash::of(b"tg_not_a_key"), at(4))
            .await
            .unwrap(),
        None
    );

    let listed = store.list_keys(acct).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].prefix, issued.key.prefix());
    assert_eq!(listed[0].status, KeyStatus::Active);

    store.revoke_key(issued.key_id, at(5)).await.unwrap();
    assert_eq!(
        store.lookup_key(&hash, at(6)).await.unwrap(),
        None,
        "a revoked key no longer resolves"
    );
    let fetched = store.fetch(&[issued.principal], at(6)).await.unwrap();
    assert_eq!(
        fetched[0].key_status,
        KeyStatus::Revoked,
        "caches learn of the revocation"
    );
    assert_eq!(
        store.list_keys(acct).await.unwrap()[0].revoked_at,
        Some(at(5))
    );
    assert_eq!(
        store
            .revoke_key(KeyId(issued.key_id.get() + NEVER_ISSUED), at(5))
            .await,
        Err(AdminError::UnknownKey)
    );
    assert!(matches!(
        store
            .issue_key(AccountId(acct.get() + NEVER_ISSUED), read, at(5))
            .await,
        Err(AdminError::UnknownAccount)
    ));
    audited(&store).await;
}

/// A revocation reaches `changed_since` as the key's next revision. A
/// call that changes nothing (revoking a revoked or unknown key, or asking
/// for an overage cap the ledger cannot hold) uses up no revision and
/// delivers nothing, so both stores number the same calls alike.
async fn a_revocation_is_enumerated_and_a_refused_change_is_not<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 10).await;
    let first = store
        .issue_key(acct, PermissionBits::ALL, at(0))
        .await
        .unwrap();
    let issued = store
        .changed_since(SnapshotCursor::START, 10, at(1))
        .await
        .unwrap();
    assert_eq!(issued.snapshots.len(), 1);
    let issued_at = issued.snapshots[0].policy_revision.get();

    store.revoke_key(first.key_id, at(1)).await.unwrap();
    let revoked = store.changed_since(issued.next, 10, at(1)).await.unwrap();
    assert_eq!(revoked.snapshots.len(), 1);
    let snapshot = &revoked.snapshots[0];
    assert_eq!(snapshot.principal, first.principal);
    assert_eq!(snapshot.key_status, KeyStatus::Revoked);
    assert_eq!(snapshot.policy_revision.get(), issued_at + 1);

    store.revoke_key(first.key_id, at(2)).await.unwrap();
    assert_eq!(
        store.revoke_key(KeyId(9_999), at(2)).await,
        Err(AdminError::UnknownKey)
    );
    let huge_cap = EnforcementMode::Elastic {
        overage_cap: CostUnits(u64::MAX),
    };
    assert!(matches!(
        store.set_mode(acct, huge_cap, at(2)).await,
        Err(AdminError::Invalid(_))
    ));
    let opened = store
        .create_account(
            AccountSpec {
                balance: CostUnits(10),
                mode: huge_cap,
                status: AccountStatus::Active,
                refill: None,
            },
            at(2),
        )
        .await;
    assert!(matches!(opened, Err(AdminError::Invalid(_))), "{opened:?}");
    // Both stores name the same first refusal of a spec broken three ways.
    let broken = store
        .create_account(
            AccountSpec {
                balance: CostUnits(u64::MAX),
                mode: huge_cap,
                status: AccountStatus::Active,
                refill: Some(RefillSchedule {
                    amount: CostUnits(1),
                    interval: SignedDuration::ZERO,
                }),
            },
            at(2),
        )
        .await;
    assert_eq!(broken, Err(AdminError::InvalidRefill));
    let broken = store
        .create_account(
            AccountSpec {
                balance: CostUnits(u64::MAX),
                mode: huge_cap,
                status: AccountStatus::Active,
                refill: None,
            },
            at(2),
        )
        .await;
    assert_eq!(broken, Err(AdminError::BalanceOverflow));
    let quiet = store.changed_since(revoked.next, 10, at(2)).await.unwrap();
    assert!(quiet.snapshots.is_empty() && quiet.complete, "{quiet:?}");
    assert_eq!(
        store.fetch(&[first.principal], at(2)).await.unwrap()[0].mode,
        EnforcementMode::Strict,
        "the refused cap left the account alone"
    );

    let second = store
        .issue_key(acct, PermissionBits::ALL, at(3))
        .await
        .unwrap();
    let next = store.changed_since(revoked.next, 10, at(3)).await.unwrap();
    assert_eq!(next.snapshots.len(), 1);
    assert_eq!(next.snapshots[0].principal, second.principal);
    assert_eq!(
        next.snapshots[0].policy_revision.get(),
        issued_at + 2,
        "no revision was spent on the calls that changed nothing"
    );
}

async fn changes_are_enumerated_incrementally_by_revision<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let acct = account(&store, 10).await;
    let other = account(&store, 10).await;
    let mut keys = Vec::new();
    for _ in 0..3 {
        keys.push(
            store
                .issue_key(acct, PermissionBits::ALL, at(0))
                .await
                .unwrap(),
        );
    }
    let lone = store
        .issue_key(other, PermissionBits::ALL, at(0))
        .await
        .unwrap();

    let first = store
        .changed_since(SnapshotCursor::START, 3, at(1))
        .await
        .unwrap();
    assert_eq!(first.snapshots.len(), 3);
    assert!(!first.complete);
    let second = store.changed_since(first.next, 3, at(1)).await.unwrap();
    assert_eq!(second.snapshots.len(), 1);
    assert_eq!(second.snapshots[0].principal, lone.principal);
    assert!(second.complete);
    let idle = store.changed_since(second.next, 3, at(1)).await.unwrap();
    assert!(idle.snapshots.is_empty() && idle.complete);
    assert_eq!(idle.next, second.next);

    // A change to the account reaches every one of its keys, and only them.
    store
        .set_mode(
            acct,
            EnforcementMode::Elastic {
                overage_cap: CostUnits(5),
            },
            at(2),
        )
        .await
        .unwrap();
    let changed = store.changed_since(second.next, 10, at(2)).await.unwrap();
    let mut principals: Vec<_> = changed.snapshots.iter().map(|s| s.principal).collect();
    principals.sort();
    assert_eq!(
        principals,
        keys.iter().map(|k| k.principal).collect::<Vec<_>>()
    );
    assert!(changed.snapshots.iter().all(|s| s.mode
        == EnforcementMode::Elastic {
            overage_cap: CostUnits(5)
        }));
    store
        .set_status(acct, AccountStatus::Suspended, at(2))
        .await
        .unwrap();
    let fetched = store
        .fetch(
            &[
                keys[0].principal,
                Principal(lone.principal.get() + NEVER_ISSUED),
            ],
            at(3),
        )
        .await
        .unwrap();
    assert_eq!(fetched.len(), 1, "unknown principals are left out");
    assert_eq!(fetched[0].account_status, AccountStatus::Suspended);
    assert!(fetched[0].policy_revision > changed.snapshots[0].policy_revision);
    audited(&store).await;
}

// ---- concurrency ---------------------------------------------------------------

/// Units on active leases (`out`: raised once a grant is in hand, lowered
/// before the call that settles it, so no unit counts twice) and units
/// billed on settled leases, gone for good (`gone`: raised once the
/// settlement is done, so the bound is never tighter than the truth).
#[derive(Default)]
struct Outstanding {
    out: AtomicU64,
    gone: AtomicU64,
}

impl Outstanding {
    const INITIAL: u64 = 200;

    #[track_caller]
    fn granted(&self, units: u64) {
        let gone = self.gone.load(Ordering::SeqCst);
        let out = self.out.fetch_add(units, Ordering::SeqCst) + units;
        assert!(
            out <= Self::INITIAL - gone,
            "over-granted: {out} units out of {} less {gone} billed",
            Self::INITIAL
        );
    }

    fn settling(&self, units: u64) {
        self.out.fetch_sub(units, Ordering::SeqCst);
    }

    fn settled(&self, billed: u64) {
        self.gone.fetch_add(billed, Ordering::SeqCst);
    }
}

/// One task's rounds: acquire, bill now and then, hold across a yield, then
/// release or consolidate. Returns the units it was granted and the folds
/// that succeeded.
async fn churn<S: TestStore>(
    store: &S,
    acct: AccountId,
    task: u128,
    ledger: &Outstanding,
) -> (u64, u64) {
    let mut held = 0_u64;
    let mut folds = 0_u64;
    for round in 0..200_u128 {
        // A refusal (the balance is short) is an answer; a storage error,
        // such as a serialization failure, is not.
        let allocation = match store.acquire(acct, CostUnits(40), TTL, at(0)).await {
            Ok(allocation) => allocation,
            Err(AllocateError::Storage(error)) => panic!("acquire: {error}"),
            Err(_) => {
                tokio::task::yield_now().await;
                continue;
            }
        };
        let g = allocation.grant;
        ledger.granted(g.units.get());
        held += g.units.get();
        // Billing one unit now and then keeps the account scarce to the end
        // instead of draining it.
        let spend = u64::from(round % 5 == 0).min(g.units.get());
        if spend > 0 {
            let event = leased(task * 1_000 + round, acct, &allocation, spend);
            assert_eq!(
                store.ingest(&[event]).await.unwrap(),
                vec![IngestOutcome::Accepted]
            );
        }
        // Held across a yield, so leases overlap.
        tokio::task::yield_now().await;
        let unspent = CostUnits(g.units.get() - spend);
        ledger.settling(g.units.get());
        let folded = if round % 2 == 0 {
            Err(())
        } else {
            store
                .consolidate(
                    g.lease_id,
                    g.fencing_token,
                    unspent,
                    CostUnits(40),
                    CostUnits(30),
                    TTL,
                    at(1),
                )
                .await
                .map_err(|error| {
                    // Short of balance is an answer; a storage error is not.
                    if let AllocateError::Storage(error) = error {
                        panic!("consolidate: {error}");
                    }
                })
        };
        if let Ok(next) = folded {
            folds += 1;
            ledger.settled(spend);
            let n = next.grant;
            ledger.granted(n.units.get());
            held += n.units.get();
            tokio::task::yield_now().await;
            ledger.settling(n.units.get());
            store
                .release(n.lease_id, n.fencing_token, n.units, at(1))
                .await
                .unwrap();
        } else {
            // Not folded (or the fold rolled back): the old lease is still
            // ours to release.
            store
                .release(g.lease_id, g.fencing_token, unspent, at(1))
                .await
                .unwrap();
            ledger.settled(spend);
        }
    }
    (held, folds)
}

/// I14, I15: eight tasks on four threads acquire, bill, hold across a yield,
/// then release or consolidate, on an account too small for all of them at
/// once, so the store's "is the balance enough?" check is raced. The units
/// out on active leases never exceed what the account has left, and at the
/// end every unit is in the balance or billed.
async fn eight_tasks_on_one_account_never_over_grant<S: TestStore>() {
    let Some(store) = S::fresh(policy(4)).await else {
        return;
    };
    let acct = account(&store, Outstanding::INITIAL).await;
    let store = Arc::new(store);
    let ledger = Arc::new(Outstanding::default());
    let tasks: Vec<_> = (0..8_u128)
        .map(|task| {
            let (store, ledger) = (Arc::clone(&store), Arc::clone(&ledger));
            tokio::spawn(async move { churn(&*store, acct, task, &ledger).await })
        })
        .collect();
    let (mut held, mut folds) = (0, 0);
    for task in tasks {
        let (task_held, task_folds) = task.await.unwrap();
        held += task_held;
        folds += task_folds;
    }
    assert!(folds > 0, "the release-or-fold race had folds in it");
    let view = store.account(acct, at(2)).await.unwrap();
    let billed: u64 = store
        .usage(acct)
        .await
        .unwrap()
        .iter()
        .map(|e| e.units.get())
        .sum();
    assert!(
        billed > 0 && held >= billed,
        "leases were granted and billed"
    );
    // I14: every unit is either in the balance or billed; none over-granted.
    assert_eq!(view.leased, CostUnits::ZERO);
    assert_eq!(view.balance.get() + billed, Outstanding::INITIAL);
    audited(&*store).await;
}

// ---- the memory store only ----------------------------------------------------

/// The memory store keeps nanoseconds, so its reclaim boundary is exact to
/// the nanosecond; stores that keep less are held to the millisecond above.
#[tokio::test]
async fn memory_reclaim_is_due_not_a_nanosecond_early() {
    let store = MemoryStore::new(policy(1)).unwrap();
    let acct = account(&store, 1_000).await;
    let a = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    // I19: expires at 30, grace 10: due at 40, not a nanosecond before.
    let just_before = at(40) - SignedDuration::from_nanos(1);
    let early = store.reclaim_expired_batch(just_before, 10).await.unwrap();
    assert!(early.reclaimed.is_empty());
    assert!(!early.more);
    let batch = store.reclaim_expired_batch(at(40), 10).await.unwrap();
    assert_eq!(batch.reclaimed.len(), 1);
    assert_eq!(batch.reclaimed[0].lease_id, a.grant.lease_id);
    audited(&store).await;
}

/// Top-ups let one account hold several leases near the ledger's top at
/// once. The operator view of such an account shows the most it can rather
/// than overflow, and the store keeps answering.
async fn an_account_holding_leases_beyond_one_balance_can_still_be_viewed<S: TestStore>() {
    let Some(store) = S::fresh(policy(1)).await else {
        return;
    };
    let largest = i64::MAX.unsigned_abs();
    let acct = account(&store, largest).await;
    for _ in 0..3 {
        store
            .acquire(acct, CostUnits(largest), TTL, at(0))
            .await
            .unwrap();
        store.top_up(acct, CostUnits(largest), at(0)).await.unwrap();
    }
    let view = store.account(acct, at(0)).await.unwrap();
    assert_eq!(view.leased, CostUnits(u64::MAX), "three near-top leases");
    assert_eq!(view.balance, CostUnits(largest));
    store
        .acquire(acct, CostUnits(1), TTL, at(0))
        .await
        .expect("the store still answers");
    audited(&store).await;
}

// ---- every store ------------------------------------------------------------------

store_tests! {
    stores {
        memory: MemoryStore,
        #[cfg(feature = "postgres")]
        postgres: PostgresStore,
    }
    tests {
        #[tokio::test] {
            acquire_moves_units_from_the_balance_to_a_lease,
            an_account_holding_leases_beyond_one_balance_can_still_be_viewed,
            a_long_ttl_is_clamped_to_the_policy_maximum,
            acquire_refuses_each_invalid_request_without_touching_the_balance,
            grants_shrink_in_the_tail_and_say_what_is_left,
            an_acquire_with_a_floor_grants_at_least_it_or_nothing,
            release_credits_the_unspent_units_and_settles_once,
            a_fenced_release_changes_nothing_and_the_holder_can_still_release,
            a_release_claiming_more_than_the_lease_can_hold_is_refused,
            a_release_to_a_suspended_account_still_returns_its_units,
            a_consolidation_settles_the_old_lease_and_grants_what_is_needed_in_one_step,
            a_refused_consolidation_leaves_the_old_lease_active_and_releasable,
            consolidating_an_empty_account_with_nothing_unspent_is_exhaustion,
            reclaim_waits_for_the_grace_and_credits_the_remainder_net_of_usage,
            reclaim_pages_through_due_leases,
            a_lease_reclaim_cannot_credit_is_reported_and_holds_up_no_other,
            reclaim_judges_room_after_refills_and_its_own_credits,
            a_refill_resets_the_balance_at_each_period_end,
            a_refusal_names_the_period_end_only_when_the_refill_brings_more,
            units_leased_at_a_reset_come_back_to_the_new_period,
            a_top_up_funds_the_next_acquire,
            a_refill_interval_must_be_positive,
            ingest_reports_every_outcome_per_event_in_order,
            crediting_past_the_largest_balance_is_refused_and_changes_nothing,
            a_settled_lease_takes_its_trailing_and_zero_unit_events,
            a_batch_is_judged_in_order_even_when_it_could_be_recorded_at_once,
            a_key_resolves_by_its_hash_until_revoked,
            changes_are_enumerated_incrementally_by_revision,
            a_revocation_is_enumerated_and_a_refused_change_is_not,
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)] {
            concurrent_reclaimers_settle_each_lease_once,
            eight_tasks_on_one_account_never_over_grant,
        }
    }
}
