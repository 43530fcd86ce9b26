//! The `PostgreSQL` store against a real server, in what only it can get
//! wrong: migrations and the schema check, the journal, ids and balances at
//! the bigint limit, microsecond instants, idempotent operator movements,
//! key storage, usage ingest (checked event for event against the memory
//! store), and concurrency across pools, with the ledger audited after every
//! scenario. The store contract itself (every allocator path and refusal,
//! reclaim, refills, ingest outcomes, keys and snapshots) is the shared
//! behavioural suite in `tests/store_memory.rs`, which also runs against
//! this store.
//!
//! The server comes from `TOLLGATE_TEST_DATABASE_URL`. Without it the tests
//! print a loud `SKIPPED` line and pass, except under CI (`CI` set), where
//! they fail. Each test works in its own schema, so they run in parallel.
#![cfg(feature = "postgres")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use support::postgres::{database_url, unique_schema};
use tollgate::store::{
    AccountSpec, AdminError, AllocateError, Allocation, GrantPolicy, IngestOutcome, JournalKind,
    KeyHash, LeaseAllocator, LedgerViolation, MemoryStore, Movement, PostgresConfig, PostgresError,
    PostgresStore, RefillSchedule, RejectReason, SchemaStatus, SnapshotCursor, SnapshotSource,
    TailSharing, UsageSink,
};
use tollgate::{
    AccountId, AccountStatus, CostUnits, EnforcementMode, FencingToken, KeyId, KeyStatus, LeaseId,
    PermissionBits, PolicyRevision, Principal, RequestId, UsageEvent, UsageSource,
};

fn at(second: i64) -> Timestamp {
    Timestamp::from_second(second).expect("test instants are in range")
}

fn secs(n: i64) -> SignedDuration {
    SignedDuration::from_secs(n)
}

const TTL: SignedDuration = SignedDuration::from_secs(30);

/// How long the stores' calls wait for a row lock.
const LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

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

/// A store over a fresh schema of the test's own, not yet migrated.
async fn fresh(test: &str, instances: u64) -> Option<PostgresStore> {
    let url = database_url(test)?;
    let store = PostgresStore::connect(
        &url,
        PostgresConfig {
            schema: unique_schema(test),
            policy: policy(instances),
            lock_timeout: LOCK_TIMEOUT,
            queue_timeout: LOCK_TIMEOUT,
        },
    )
    .await
    .expect("the test server is reachable");
    Some(store)
}

/// Pages `changed_since` from `cursor` until a page says it is complete,
/// handing each page to `each`; returns the cursor after the last.
async fn page_to_the_end(
    store: &PostgresStore,
    mut cursor: SnapshotCursor,
    limit: usize,
    now: Timestamp,
    mut each: impl FnMut(&tollgate::store::SnapshotPage),
) -> SnapshotCursor {
    loop {
        let page = store.changed_since(cursor, limit, now).await.unwrap();
        each(&page);
        cursor = page.next;
        if page.complete {
            return cursor;
        }
    }
}

/// Another store (its own pool) over the same schema.
async fn sibling(store: &PostgresStore) -> PostgresStore {
    PostgresStore::connect(
        &database_url("sibling").expect("the first store found a url"),
        PostgresConfig {
            schema: store.schema().to_owned(),
            policy: *store.policy(),
            lock_timeout: LOCK_TIMEOUT,
            queue_timeout: LOCK_TIMEOUT,
        },
    )
    .await
    .expect("the test server is reachable")
}

/// A migrated store over a fresh schema.
async fn store(test: &str, instances: u64) -> Option<PostgresStore> {
    let store = fresh(test, instances).await?;
    store.migrate().await.expect("migrating a fresh schema");
    Some(store)
}

async fn account(store: &PostgresStore, balance: u64) -> AccountId {
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

async fn balance(store: &PostgresStore, account: AccountId, now: Timestamp) -> u64 {
    store.account(account, now).await.unwrap().balance.get()
}

async fn audited(store: &PostgresStore) {
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

fn movement(key: &str) -> Movement<'_> {
    Movement {
        idempotency_key: key,
        reason: "test",
    }
}

// ---- setup and migrations ---------------------------------------------------

#[tokio::test]
async fn a_bad_schema_name_policy_lock_or_queue_timeout_is_refused_before_connecting() {
    use std::time::Duration;
    let mut bad_policy = policy(1);
    bad_policy.max_ttl = SignedDuration::ZERO;
    let config = |schema: &str, policy, lock_timeout, queue_timeout| PostgresConfig {
        schema: schema.to_owned(),
        policy,
        lock_timeout,
        queue_timeout,
    };
    let under_a_milli = Duration::from_micros(999);
    let part_of_a_milli = Duration::from_micros(1_999);
    let too_long_a_lock = PostgresConfig::LOCK_TIMEOUT_MAX + Duration::from_millis(1);
    let too_long_a_queue = PostgresConfig::QUEUE_TIMEOUT_MAX + Duration::from_millis(1);
    for (config, expected) in [
        (
            config("Tollgate; drop", policy(1), LOCK_TIMEOUT, LOCK_TIMEOUT),
            Some(PostgresError::InvalidSchemaName(
                "Tollgate; drop".to_owned(),
            )),
        ),
        (
            config("tollgate", bad_policy, LOCK_TIMEOUT, LOCK_TIMEOUT),
            Some(PostgresError::Policy(
                tollgate::store::GrantPolicyError::MaxTtlNotPositive,
            )),
        ),
        (
            config("tollgate", policy(1), under_a_milli, LOCK_TIMEOUT),
            Some(PostgresError::InvalidLockTimeout(under_a_milli)),
        ),
        (
            config("tollgate", policy(1), too_long_a_lock, LOCK_TIMEOUT),
            Some(PostgresError::InvalidLockTimeout(too_long_a_lock)),
        ),
        // PostgreSQL keeps whole milliseconds: refused, not cut to 1ms.
        (
            config("tollgate", policy(1), part_of_a_milli, LOCK_TIMEOUT),
            Some(PostgresError::InvalidLockTimeout(part_of_a_milli)),
        ),
        (
            config("tollgate", policy(1), LOCK_TIMEOUT, under_a_milli),
            Some(PostgresError::InvalidQueueTimeout(under_a_milli)),
        ),
        (
            config("tollgate", policy(1), LOCK_TIMEOUT, too_long_a_queue),
            Some(PostgresError::InvalidQueueTimeout(too_long_a_queue)),
        ),
        // Within bounds, the next thing to fail is the connection.
        (
            config(
                "tollgate",
                policy(1),
                PostgresConfig::LOCK_TIMEOUT_MAX,
                PostgresConfig::QUEUE_TIMEOUT_MAX,
            ),
            None,
        ),
    ] {
        let refused = PostgresStore::connect("postgres://nobody@127.0.0.1:1/none", config).await;
        match expected {
            Some(expected) => assert_eq!(refused.err(), Some(expected)),
            None => assert!(matches!(refused, Err(PostgresError::Connect(_)))),
        }
    }
}

/// A role that owns its schema but may not create schemas in the database
/// (the default for a role that does not own the database) migrates, and
/// migrates again with nothing to apply: `PostgreSQL` checks the privilege
/// to create a schema before `IF NOT EXISTS`, so the runner must not ask
/// for one that exists.
#[tokio::test]
async fn a_role_that_owns_its_schema_but_cannot_create_schemas_migrates_and_migrates_again() {
    let Some(admin) = fresh("migrate_owner", 1).await else {
        return;
    };
    let schema = admin.schema().to_owned();
    let role = unique_schema("role");
    sqlx::raw_sql(&format!(
        r#"CREATE ROLE "{role}" LOGIN PASSWORD 'tollgate-test'; CREATE SCHEMA "{schema}" AUTHORIZATION "{role}""#
    ))
    .execute(admin.pool())
    .await
    .unwrap();
    let options = database_url("migrate_owner")
        .expect("the first store found a url")
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap()
        .username(&role)
        .password("tollgate-test");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .expect("the role logs in");
    let owner = PostgresStore::with_pool(
        pool,
        PostgresConfig {
            schema: schema.clone(),
            policy: policy(1),
            lock_timeout: LOCK_TIMEOUT,
            queue_timeout: LOCK_TIMEOUT,
        },
    )
    .unwrap();
    let cannot_create = sqlx::raw_sql(&format!(r#"CREATE SCHEMA "{schema}_other""#))
        .execute(owner.pool())
        .await;
    assert!(
        cannot_create.is_err(),
        "the role may not create schemas in the database"
    );

    let first = owner.migrate().await.expect("the owner creates its tables");
    assert_eq!((first.applied, first.current), (vec![1, 2], 2));
    let second = owner.migrate().await.expect("nothing to create or apply");
    assert_eq!((second.applied, second.current), (vec![], 2));
    let account = account(&owner, 10).await;
    assert_eq!(
        owner.account(account, at(0)).await.unwrap().balance,
        CostUnits(10)
    );
    // Roles outlive the database's schemas: this one goes with its schema.
    owner.pool().close().await;
    sqlx::raw_sql(&format!(
        r#"DROP SCHEMA "{schema}" CASCADE; DROP ROLE "{role}""#
    ))
    .execute(admin.pool())
    .await
    .unwrap();
}

#[tokio::test]
async fn migrating_twice_applies_nothing_the_second_time_and_the_check_says_so() {
    let Some(store) = fresh("migrate_twice", 1).await else {
        return;
    };
    assert_eq!(store.check_schema().await.unwrap(), SchemaStatus::Missing);
    let first = store.migrate().await.unwrap();
    assert_eq!((first.applied, first.current), (vec![1, 2], 2));
    let second = store.migrate().await.unwrap();
    assert_eq!((second.applied, second.current), (vec![], 2));
    assert_eq!(
        store.check_schema().await.unwrap(),
        SchemaStatus::Current { version: 2 }
    );

    // A database an older build migrated is behind, and migrating brings
    // it up to date.
    let table = format!("{}.schema_migrations", store.schema());
    sqlx::raw_sql(&format!("DELETE FROM {table} WHERE version = 2"))
        .execute(store.pool())
        .await
        .unwrap();
    assert_eq!(
        store.check_schema().await.unwrap(),
        SchemaStatus::Behind {
            applied: 1,
            shipped: 2
        }
    );
    let upgrade = store.migrate().await.unwrap();
    assert_eq!((upgrade.applied, upgrade.current), (vec![2], 2));
    assert_eq!(
        store.check_schema().await.unwrap(),
        SchemaStatus::Current { version: 2 }
    );

    sqlx::raw_sql(&format!(
        "UPDATE {table} SET checksum = '\\x00'::bytea WHERE version = 1"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    assert_eq!(
        store.check_schema().await.unwrap(),
        SchemaStatus::Modified { version: 1 }
    );
    assert!(matches!(
        store.migrate().await,
        Err(PostgresError::Migration { version: 1, .. })
    ));
    sqlx::raw_sql(&format!(
        "DELETE FROM {table}; INSERT INTO {table} VALUES (7, '\\x00'::bytea, now())"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    assert_eq!(
        store.check_schema().await.unwrap(),
        SchemaStatus::Ahead {
            applied: 7,
            shipped: 2
        }
    );
}

/// A schema named by one of `PostgreSQL`'s reserved words is a schema like
/// any other: created, migrated, checked and used.
#[tokio::test]
async fn a_schema_named_by_a_reserved_word_migrates_and_serves() {
    let Some(url) = database_url("reserved_word_schema") else {
        return;
    };
    let store = PostgresStore::connect(
        &url,
        PostgresConfig {
            schema: "order".to_owned(),
            policy: policy(1),
            lock_timeout: LOCK_TIMEOUT,
            queue_timeout: LOCK_TIMEOUT,
        },
    )
    .await
    .expect("the test server is reachable");
    // The one test that uses this name. A schema of that name left by an
    // earlier run is tollgate's and starts afresh; any other is not this
    // test's to drop.
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'order')")
            .fetch_one(store.pool())
            .await
            .unwrap();
    if exists {
        let status = store.check_schema().await;
        assert!(
            matches!(
                status,
                Ok(SchemaStatus::Current { .. } | SchemaStatus::Behind { .. })
            ),
            "this server has a schema named \"order\" that is not tollgate's ({status:?}); \
             run the tests against a server of their own"
        );
        drop_order_schema(&store).await;
    }
    assert_eq!(store.check_schema().await.unwrap(), SchemaStatus::Missing);
    assert_eq!(store.migrate().await.unwrap().current, 2);
    assert_eq!(
        store.check_schema().await.unwrap(),
        SchemaStatus::Current { version: 2 }
    );
    let acct = account(&store, 100).await;
    let key = store
        .issue_key(acct, PermissionBits::ALL, at(0))
        .await
        .unwrap();
    let granted = store
        .acquire(acct, CostUnits(40), TTL, at(0))
        .await
        .unwrap();
    assert_eq!(granted.grant.units, CostUnits(40));
    assert_eq!(balance(&store, acct, at(0)).await, 60);
    let changed = store
        .changed_since(SnapshotCursor::START, 10, at(0))
        .await
        .unwrap();
    assert_eq!(
        changed
            .snapshots
            .iter()
            .map(|s| s.principal)
            .collect::<Vec<_>>(),
        vec![key.principal]
    );
    audited(&store).await;
    drop_order_schema(&store).await;
}

async fn drop_order_schema(store: &PostgresStore) {
    sqlx::raw_sql(r#"DROP SCHEMA "order" CASCADE"#)
        .execute(store.pool())
        .await
        .unwrap();
}

/// I33: three instances migrating one database at once apply each version
/// exactly once between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_pools_migrating_at_once_apply_the_schema_once() {
    let Some(first) = fresh("migrate_race", 1).await else {
        return;
    };
    let second = sibling(&first).await;
    let third = sibling(&first).await;
    let (a, b, c) = tokio::join!(first.migrate(), second.migrate(), third.migrate());
    let mut applied: Vec<u32> = [a, b, c]
        .into_iter()
        .flat_map(|report| report.unwrap().applied)
        .collect();
    applied.sort_unstable();
    assert_eq!(
        applied,
        vec![1, 2],
        "exactly one instance applied each version"
    );
    assert_eq!(
        second.check_schema().await.unwrap(),
        SchemaStatus::Current { version: 2 }
    );
    audited(&third).await;
}

/// I33: an instance that starts while another runs a migration longer than
/// the pool's lock timeout (five seconds) waits for it, rather than fail
/// to start. The other instance's migration is played by a session that
/// holds the migration lock for six seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_waits_out_another_instances_long_one() {
    use sha2::{Digest, Sha256};
    let Some(store) = fresh("migrate_wait", 1).await else {
        return;
    };
    let digest = Sha256::digest(format!("tollgate:migrate:{}", store.schema()).as_bytes());
    let key = i64::from_be_bytes(digest[..8].try_into().unwrap());
    let mut other = store.pool().begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(key)
        .execute(&mut *other)
        .await
        .unwrap();
    let waiting = sibling(&store).await;
    let migrating = tokio::spawn(async move { waiting.migrate().await });
    // Timed from the moment the migration is seen waiting on the lock, so
    // it outwaits the pool's five-second lock timeout whenever it started.
    // A bigint advisory key shows as its high and low halves.
    let seen_waiting = "SELECT count(*) FROM pg_locks \
                        WHERE locktype = 'advisory' AND NOT granted AND objsubid = 1 \
                        AND classid = (($1 >> 32) & 4294967295)::oid \
                        AND objid = ($1 & 4294967295)::oid";
    let give_up = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>(seen_waiting)
        .bind(key)
        .fetch_one(store.pool())
        .await
        .unwrap()
        == 0
    {
        assert!(
            tokio::time::Instant::now() < give_up,
            "the migration never waited on the lock"
        );
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    assert!(!migrating.is_finished(), "it waits for the lock");
    other.commit().await.unwrap();
    let report = migrating
        .await
        .unwrap()
        .expect("migrated once the lock was free");
    assert_eq!(report.applied, vec![1, 2]);
}

// ---- the journal, bigint ids and microseconds ------------------------------------

/// I30: every balance movement leaves a journal row with its delta, and the
/// deltas add up to the balance.
#[tokio::test]
async fn every_movement_is_journalled_with_its_delta() {
    let Some(store) = store("journal", 4).await else {
        return;
    };
    let acct = account(&store, 200).await;
    let old = store
        .acquire(acct, CostUnits(50), TTL, at(0))
        .await
        .unwrap()
        .grant;
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
        .unwrap()
        .grant;
    // I19: the new lease expires at 31 and is due at 41.
    let reclaimed = store.reclaim_expired_batch(at(41), 10).await.unwrap();
    assert_eq!(reclaimed.reclaimed.len(), 1);
    let history = store.history(acct).await.unwrap();
    let rows: Vec<_> = history
        .iter()
        .map(|entry| {
            (
                entry.kind,
                entry.delta,
                entry.balance_after.get(),
                entry.lease_id,
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (JournalKind::Open, 200, 200, None),
            (JournalKind::Grant, -50, 150, Some(old.lease_id)),
            (JournalKind::Consolidation, 30, 180, Some(old.lease_id)),
            (JournalKind::Grant, -120, 60, Some(fresh.lease_id)),
            (JournalKind::Reclaim, 120, 180, Some(fresh.lease_id)),
        ]
    );
    assert_eq!(balance(&store, acct, at(41)).await, 180);
    audited(&store).await;
}

/// Usage and the journal read a page at a time give the same rows, in the
/// same order, as the whole listing: each page at most the size asked,
/// the last one ending the listing, also when the rows fill it exactly.
#[tokio::test]
async fn usage_and_the_journal_read_by_page_are_the_whole_listing() {
    let Some(store) = store("pages", 4).await else {
        return;
    };
    let acct = account(&store, 200).await;
    let allocation = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    let events: Vec<_> = (1..=5).map(|id| leased(id, acct, &allocation, 1)).collect();
    assert_eq!(
        store.ingest(&events).await.unwrap(),
        [IngestOutcome::Accepted; 5]
    );
    let whole = store.usage(acct, None, None).await.unwrap();
    assert_eq!(whole.len(), 5);
    let history = store.history(acct).await.unwrap();
    assert_eq!(history.len(), 2, "opened, then granted");
    for limit in [1, 2, 5, 6] {
        let (mut read, mut from, mut pages) = (Vec::new(), None, 0);
        loop {
            let page = store
                .usage_page(acct, None, None, from, limit)
                .await
                .unwrap();
            assert!(page.items.len() <= limit);
            read.extend(page.items);
            pages += 1;
            match page.next {
                Some(next) => from = Some(next),
                None => break,
            }
        }
        assert_eq!(read, whole, "pages of {limit}");
        // A page that fills up cannot know it is the last: one more, empty.
        assert_eq!(pages, 5 / limit + 1, "pages of {limit}");
    }
    // A window applies to every page: the events are at 1.
    let windowed = store
        .usage_page(acct, Some(at(1)), Some(at(2)), None, 2)
        .await
        .unwrap();
    assert_eq!(windowed.items, whole[..2]);
    let next = store
        .usage_page(acct, Some(at(1)), Some(at(2)), windowed.next, 10)
        .await
        .unwrap();
    assert_eq!(next.items, whole[2..]);
    assert_eq!(next.next, None);
    let outside = store
        .usage_page(acct, Some(at(2)), None, None, 10)
        .await
        .unwrap();
    assert_eq!((outside.items.len(), outside.next), (0, None));
    // Bounds finer than the stored microseconds are exact: a nanosecond
    // past the events' instant is after them, as a lower bound and as an
    // upper one.
    let just_after = at(1) + SignedDuration::from_nanos(1);
    let since = store
        .usage_page(acct, Some(just_after), None, None, 10)
        .await
        .unwrap();
    assert_eq!(since.items, [], "at or after 1 s + 1 ns: none");
    let until = store
        .usage_page(acct, None, Some(just_after), None, 10)
        .await
        .unwrap();
    assert_eq!(until.items, whole, "before 1 s + 1 ns: all");
    let first = store.history_page(acct, None, 1).await.unwrap();
    let rest = store.history_page(acct, first.next, 1).await.unwrap();
    let last = store.history_page(acct, rest.next, 1).await.unwrap();
    assert_eq!([first.items, rest.items].concat(), history);
    assert_eq!((last.items.len(), last.next), (0, None));
    assert_eq!(
        store.usage_page(AccountId(999), None, None, None, 1).await,
        Err(AdminError::UnknownAccount)
    );
}

#[tokio::test]
async fn ids_past_the_largest_bigint_are_unknown_never_an_error() {
    let Some(store) = store("far_ids", 1).await else {
        return;
    };
    let acct = account(&store, 100).await;
    let g = store
        .acquire(acct, CostUnits(10), TTL, at(0))
        .await
        .unwrap()
        .grant;
    let far = AccountId(u64::MAX);
    assert_eq!(
        store.acquire(far, CostUnits(10), TTL, at(0)).await,
        Err(AllocateError::UnknownAccount)
    );
    assert_eq!(
        store
            .acquire(far, CostUnits(10), SignedDuration::ZERO, at(0))
            .await,
        Err(AllocateError::InvalidTtl),
        "the ttl is judged before the account"
    );
    assert_eq!(
        store
            .release(LeaseId(u64::MAX), g.fencing_token, CostUnits(1), at(1))
            .await,
        Err(AllocateError::UnknownLease)
    );
    assert_eq!(
        store
            .release(g.lease_id, FencingToken(u64::MAX), CostUnits(10), at(1))
            .await,
        Err(AllocateError::Fenced)
    );
    for lease in [LeaseId(g.lease_id.get() + 1_000), LeaseId(u64::MAX)] {
        assert_eq!(
            store
                .consolidate(
                    lease,
                    g.fencing_token,
                    CostUnits(5),
                    CostUnits(10),
                    CostUnits(5),
                    TTL,
                    at(1)
                )
                .await,
            Err(AllocateError::UnknownLease)
        );
    }
    for account in [AccountId(acct.get() + 1_000), far] {
        assert_eq!(
            store.set_mode(account, EnforcementMode::Strict).await,
            Err(AdminError::UnknownAccount)
        );
    }
    let issued = store
        .issue_key(acct, PermissionBits::ALL, at(0))
        .await
        .unwrap();
    let fetched = store
        .fetch(&[issued.principal, Principal(u64::MAX)], at(1))
        .await
        .unwrap();
    assert_eq!(fetched.len(), 1, "unknown principals are left out");
    let beyond = store
        .changed_since(SnapshotCursor(u64::MAX), 3, at(1))
        .await
        .unwrap();
    assert!(beyond.snapshots.is_empty() && beyond.complete);
    assert_eq!(balance(&store, acct, at(1)).await, 90);
    audited(&store).await;
}

#[tokio::test]
async fn instants_are_kept_to_the_microsecond_and_returned_as_stored() {
    let Some(store) = store("micros", 1).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let now = at(5) + SignedDuration::from_nanos(1_234_567);
    let grant = store
        .acquire(
            acct,
            CostUnits(1),
            SignedDuration::from_nanos(30_000_000_999),
            now,
        )
        .await
        .unwrap()
        .grant;
    assert_eq!(
        grant.expires_at,
        at(35) + SignedDuration::from_micros(1_234),
        "now and the expiry are truncated to the microsecond"
    );
    let history = store.history(acct).await.unwrap();
    assert_eq!(history[1].at, at(5) + SignedDuration::from_micros(1_234));
    // The last instant there is, nanoseconds and all: a lease from it would
    // expire past the end of time.
    assert_eq!(
        store
            .acquire(acct, CostUnits(10), TTL, Timestamp::MAX)
            .await,
        Err(AllocateError::InvalidTtl)
    );
    assert_eq!(balance(&store, acct, at(5)).await, 999);
}

/// What keeping microseconds means beside the memory store: a refill
/// period must be a whole number of them (its ends are stored exactly), and
/// two events under one request id that differ only below the microsecond
/// are the same event, a duplicate, not a conflicting one.
#[tokio::test]
async fn below_the_microsecond_refills_are_refused_and_events_are_the_same() {
    let Some(store) = store("sub_micros", 1).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let uneven = RefillSchedule {
        amount: CostUnits(10),
        interval: SignedDuration::from_nanos(1_500),
    };
    assert!(matches!(
        store.configure_refill(acct, Some(uneven), at(0)).await,
        Err(AdminError::InvalidRefill)
    ));
    let granted = store
        .acquire(acct, CostUnits(10), TTL, at(0))
        .await
        .unwrap();
    let event = leased(1, acct, &granted, 2);
    let nearly = UsageEvent {
        at: event.at + SignedDuration::from_nanos(500),
        ..event
    };
    assert_eq!(
        store.ingest(&[event, nearly]).await.unwrap(),
        [IngestOutcome::Accepted, IngestOutcome::Duplicate]
    );
    audited(&store).await;
}

/// The memory store's boundary is exact to the nanosecond; this store keeps
/// microseconds, so its boundary is exact to the microsecond.
#[tokio::test]
async fn reclaim_is_due_not_a_microsecond_early() {
    let Some(store) = store("reclaim_micros", 1).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let g = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap()
        .grant;
    // A batch of none reclaims nothing but says more are due.
    let zero = store.reclaim_expired_batch(at(40), 0).await.unwrap();
    assert_eq!((zero.reclaimed.len(), zero.more), (0, true));
    // I19: expires at 30, grace 10: due at 40, not a microsecond before.
    let just_before = at(40) - SignedDuration::from_micros(1);
    let early = store.reclaim_expired_batch(just_before, 10).await.unwrap();
    assert!(early.reclaimed.is_empty() && !early.more);
    let batch = store.reclaim_expired_batch(at(40), 10).await.unwrap();
    assert_eq!(batch.reclaimed.len(), 1);
    assert_eq!(batch.reclaimed[0].lease_id, g.lease_id);
    assert_eq!(batch.reclaimed[0].account_id, acct);
    assert_eq!(balance(&store, acct, at(40)).await, 1_000);
    audited(&store).await;
}

/// An instant `PostgreSQL` holds but tollgate cannot (`infinity`, or a year
/// past 9999), written into a row by hand, is a storage error on every path
/// that reads the row: never a panic in the task reading it.
#[tokio::test]
async fn an_instant_past_the_representable_range_is_a_storage_error() {
    let Some(store) = store("instant_range", 1).await else {
        return;
    };
    let acct = account(&store, 100).await;
    let granted = store
        .acquire(acct, CostUnits(10), TTL, at(0))
        .await
        .unwrap();
    for instant in ["infinity", "12000-01-01 00:00:00+00", "-infinity"] {
        sqlx::query(&format!(
            "UPDATE {}.accounts SET refill_amount = 0, refill_interval_us = 1000000, \
             period_end = '{instant}' WHERE id = $1",
            store.schema()
        ))
        .bind(i64::try_from(acct.get()).unwrap())
        .execute(store.pool())
        .await
        .unwrap();
        let read = tokio::spawn({
            let store = sibling(&store).await;
            async move { store.account(acct, at(1)).await }
        })
        .await
        .expect("reading the row does not panic");
        assert!(
            matches!(read, Err(AdminError::Storage(_))),
            "{instant}: {read:?}"
        );
        let acquired = tokio::spawn({
            let store = sibling(&store).await;
            async move { store.acquire(acct, CostUnits(10), TTL, at(1)).await }
        })
        .await
        .expect("the allocator does not panic");
        assert!(
            matches!(acquired, Err(AllocateError::Storage(_))),
            "{instant}: {acquired:?}"
        );
    }
    // The row put right, the account serves again.
    sqlx::query(&format!(
        "UPDATE {}.accounts SET refill_amount = NULL, refill_interval_us = NULL, \
         period_end = NULL WHERE id = $1",
        store.schema()
    ))
    .bind(i64::try_from(acct.get()).unwrap())
    .execute(store.pool())
    .await
    .unwrap();
    assert_eq!(balance(&store, acct, at(1)).await, 90);
    let released = store
        .release(
            granted.grant.lease_id,
            granted.grant.fencing_token,
            CostUnits(10),
            at(1),
        )
        .await;
    assert!(released.is_ok(), "{released:?}");
    assert_eq!(balance(&store, acct, at(1)).await, 100);
}

// ---- reclaim -------------------------------------------------------------------------

/// I19: reclaimers on three pools of their own, started together over the
/// same due leases, settle each lease once between them. The pools are
/// opened before any reclaimer starts, and the three start behind one
/// barrier, so none has drained the backlog before the others connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_concurrent_reclaimers_settle_each_lease_exactly_once() {
    let Some(store) = store("reclaim_race", 1).await else {
        return;
    };
    let accounts = [
        account(&store, 100_000).await,
        account(&store, 100_000).await,
        account(&store, 100_000).await,
    ];
    let mut granted = 0;
    for round in 0..150 {
        granted += store
            .acquire(accounts[round % 3], CostUnits(7), TTL, at(0))
            .await
            .unwrap()
            .grant
            .units
            .get();
    }
    let mut pools = Vec::new();
    for _ in 0..3 {
        let reclaimer = sibling(&store).await;
        // A connection of its own already open, so no reclaimer's first
        // call waits to connect while the others work.
        drop(reclaimer.pool().acquire().await.unwrap());
        pools.push(reclaimer);
    }
    let start = Arc::new(tokio::sync::Barrier::new(pools.len()));
    let mut reclaimers = Vec::new();
    for reclaimer in pools {
        let start = Arc::clone(&start);
        reclaimers.push(tokio::spawn(async move {
            start.wait().await;
            let mut mine = Vec::new();
            loop {
                let batch = reclaimer.reclaim_expired_batch(at(100), 4).await.unwrap();
                if batch.reclaimed.is_empty() && !batch.more {
                    return mine;
                }
                mine.extend(batch.reclaimed);
            }
        }));
    }
    let mut all = Vec::new();
    for reclaimer in reclaimers {
        all.extend(reclaimer.await.unwrap());
    }
    let credited: u64 = all.iter().map(|lease| lease.credited.get()).sum();
    // Exactly once: as many reclaims as leases, and no lease twice.
    assert_eq!(all.len(), 150, "I19: one reclaim per lease");
    all.sort_by_key(|lease| lease.lease_id);
    all.dedup_by_key(|lease| lease.lease_id);
    assert_eq!(all.len(), 150, "I19: every lease reclaimed exactly once");
    assert_eq!(credited, granted);
    for acct in accounts {
        assert_eq!(balance(&store, acct, at(100)).await, 100_000);
    }
    audited(&store).await;
}

// ---- refills and operator movements ------------------------------------------------

#[tokio::test]
async fn a_refill_is_journalled_as_the_units_it_restored_and_stops_when_removed() {
    let Some(store) = store("refill", 1).await else {
        return;
    };
    let acct = store
        .create_account(
            AccountSpec {
                balance: CostUnits(50),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: Some(RefillSchedule {
                    amount: CostUnits(200),
                    interval: secs(100),
                }),
            },
            at(0),
        )
        .await
        .unwrap();
    store
        .acquire(acct, CostUnits(50), TTL, at(1))
        .await
        .unwrap();
    store
        .acquire(acct, CostUnits(10), TTL, at(100))
        .await
        .unwrap();
    // Three periods later: one reset, from 190 back to 200.
    assert_eq!(balance(&store, acct, at(450)).await, 200);
    store
        .top_up(acct, CostUnits(5), &movement("refill-top-up"), at(450))
        .await
        .unwrap();
    let refills: Vec<_> = store
        .history(acct)
        .await
        .unwrap()
        .into_iter()
        .filter(|entry| entry.kind == JournalKind::Refill)
        .map(|entry| (entry.delta, entry.at))
        .collect();
    assert_eq!(refills, vec![(200, at(100)), (10, at(450))]);
    assert_eq!(balance(&store, acct, at(450)).await, 205);
    store.configure_refill(acct, None, at(450)).await.unwrap();
    assert_eq!(balance(&store, acct, at(10_000)).await, 205);
    audited(&store).await;
}

#[tokio::test]
async fn a_top_up_is_applied_once_per_idempotency_key() {
    let Some(store) = store("top_up", 1).await else {
        return;
    };
    let acct = account(&store, 0).await;
    let other = account(&store, 0).await;
    assert!(matches!(
        store.acquire(acct, CostUnits(10), TTL, at(0)).await,
        Err(AllocateError::BalanceExhausted(_))
    ));
    let first = store
        .top_up(acct, CostUnits(25), &movement("invoice-1"), at(1))
        .await
        .unwrap();
    assert_eq!((first.balance, first.applied), (CostUnits(25), true));
    store
        .acquire(acct, CostUnits(10), TTL, at(1))
        .await
        .unwrap();
    let replay = store
        .top_up(acct, CostUnits(25), &movement("invoice-1"), at(2))
        .await
        .unwrap();
    assert_eq!(
        (replay.balance, replay.applied),
        (CostUnits(25), false),
        "the first outcome, nothing applied"
    );
    assert_eq!(balance(&store, acct, at(2)).await, 15);
    for (account, units, expected) in [
        (acct, 26, AdminError::IdempotencyConflict),
        (other, 25, AdminError::IdempotencyConflict),
    ] {
        assert_eq!(
            store
                .top_up(account, CostUnits(units), &movement("invoice-1"), at(2))
                .await,
            Err(expected)
        );
    }
    assert_eq!(
        store.adjust(acct, 25, &movement("invoice-1"), at(2)).await,
        Err(AdminError::IdempotencyConflict),
        "an adjustment is a different movement"
    );
    assert_eq!(
        store
            .top_up(AccountId(77), CostUnits(1), &movement("x"), at(1))
            .await,
        Err(AdminError::UnknownAccount)
    );
    assert_eq!(
        store
            .top_up(acct, CostUnits(u64::MAX), &movement("huge"), at(1))
            .await,
        Err(AdminError::BalanceOverflow)
    );
    let long = "k".repeat(201);
    for bad in [
        Movement {
            idempotency_key: "",
            reason: "r",
        },
        Movement {
            idempotency_key: &long,
            reason: "r",
        },
        Movement {
            idempotency_key: "k",
            reason: "",
        },
    ] {
        assert!(matches!(
            store.top_up(acct, CostUnits(1), &bad, at(1)).await,
            Err(AdminError::Invalid(_))
        ));
    }
    let journal = store.history(acct).await.unwrap();
    let top_up = journal
        .iter()
        .find(|entry| entry.kind == JournalKind::TopUp)
        .unwrap();
    assert_eq!(top_up.idempotency_key.as_deref(), Some("invoice-1"));
    assert_eq!(top_up.reason.as_deref(), Some("test"));
    assert_eq!(balance(&store, acct, at(2)).await, 15);
    assert_eq!(balance(&store, other, at(2)).await, 0);
    audited(&store).await;
}

#[tokio::test]
async fn an_adjustment_may_take_units_away_but_never_below_zero() {
    let Some(store) = store("adjust", 1).await else {
        return;
    };
    let acct = account(&store, 100).await;
    let down = store
        .adjust(acct, -40, &movement("credit-note-1"), at(1))
        .await
        .unwrap();
    assert_eq!((down.balance, down.applied), (CostUnits(60), true));
    assert_eq!(
        store
            .adjust(acct, -61, &movement("credit-note-2"), at(1))
            .await,
        Err(AdminError::BalanceUnderflow)
    );
    assert_eq!(
        store
            .adjust(acct, i64::MIN, &movement("credit-note-3"), at(1))
            .await,
        Err(AdminError::BalanceUnderflow)
    );
    assert_eq!(
        store
            .adjust(acct, i64::MAX, &movement("credit-note-4"), at(1))
            .await,
        Err(AdminError::BalanceOverflow)
    );
    // A refused movement did not consume its key.
    let up = store
        .adjust(acct, 5, &movement("credit-note-2"), at(1))
        .await
        .unwrap();
    assert_eq!(up.balance, CostUnits(65));
    assert_eq!(balance(&store, acct, at(1)).await, 65);
    audited(&store).await;
}

// ---- usage ingest -----------------------------------------------------------------------

/// The edges a bigint sets, answered exactly as the memory store answers
/// them. The ordinary outcomes, event by event, are the shared suite's
/// (`tests/store_memory.rs`), which runs on this store too.
#[tokio::test]
async fn ids_and_units_past_the_bigint_range_are_answered_as_the_memory_store_answers() {
    let Some(store) = store("ingest", 1).await else {
        return;
    };
    let memory = MemoryStore::new(policy(1)).unwrap();
    let acct = account(&store, 1_000).await;
    memory
        .create_account(
            AccountSpec {
                balance: CostUnits(1_000),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            at(0),
        )
        .unwrap();
    let a = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    assert_eq!(
        memory.acquire(acct, CostUnits(100), TTL, at(0)).await,
        Ok(a)
    );
    // One leased and one overage event to collide with.
    let ok = leased(1, acct, &a, 40);
    let overage = UsageEvent {
        source: UsageSource::Overage,
        ..leased(7, acct, &a, 15)
    };
    for sink in [&store as &dyn UsageSink, &memory] {
        assert_eq!(
            sink.ingest(&[ok, overage]).await.unwrap(),
            [IngestOutcome::Accepted; 2]
        );
    }

    // Ids no bigint can hold are answered as the memory store answers them.
    let mut far_account = leased(20, acct, &a, 1);
    far_account.account_id = AccountId(u64::MAX);
    let mut far_lease = leased(21, acct, &a, 1);
    far_lease.source = UsageSource::Leased {
        lease_id: LeaseId(u64::MAX),
        fencing_token: a.grant.fencing_token,
    };
    let mut far_token = leased(22, acct, &a, 1);
    far_token.source = UsageSource::Leased {
        lease_id: a.grant.lease_id,
        fencing_token: FencingToken(u64::MAX),
    };
    let mut far_units_duplicate = ok;
    far_units_duplicate.units = CostUnits(u64::MAX);
    let mut overflowing_debt = overage;
    overflowing_debt.request_id = RequestId(u128::MAX);
    overflowing_debt.units = CostUnits(i64::MAX as u64);
    let mut far_revision = leased(23, acct, &a, 1);
    far_revision.policy_revision = PolicyRevision(u64::MAX);
    let mut far_key = leased(24, acct, &a, 1);
    far_key.key_id = Some(KeyId(u64::MAX));
    let edge = [
        far_account,
        far_lease,
        far_token,
        far_units_duplicate,
        overflowing_debt,
        far_revision,
        far_key,
    ];
    let outcomes = store.ingest(&edge).await.unwrap();
    assert_eq!(
        outcomes,
        vec![
            IngestOutcome::Rejected(RejectReason::UnknownAccount),
            IngestOutcome::Rejected(RejectReason::UnknownLease),
            IngestOutcome::Rejected(RejectReason::FencingMismatch),
            IngestOutcome::Rejected(RejectReason::ConflictingDuplicate),
            IngestOutcome::Rejected(RejectReason::Malformed),
            IngestOutcome::Rejected(RejectReason::Malformed),
            IngestOutcome::Rejected(RejectReason::Malformed),
        ]
    );
    assert_eq!(memory.ingest(&edge).await.unwrap(), outcomes);

    assert_eq!(
        store.usage(acct, None, None).await.unwrap(),
        memory.usage(acct).unwrap(),
        "arrival order"
    );
    assert_eq!(
        store.account(acct, at(1)).await.unwrap(),
        memory.account(acct, at(1)).unwrap()
    );
    assert!(
        store
            .usage(acct, Some(at(2)), None)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store.usage(AccountId(999), None, None).await,
        Err(AdminError::UnknownAccount)
    );
    audited(&store).await;
}

/// An instant before `PostgreSQL`'s earliest (4714 BC) would fail the whole
/// statement, and the usage writer retries a failed batch unchanged: one
/// such event would hold up every event behind it for good. It is answered
/// malformed, and the rest of its batch is recorded.
#[tokio::test]
async fn an_instant_postgres_cannot_store_is_malformed_and_holds_up_nothing() {
    let Some(store) = store("ingest_instant", 1).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let a = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    let ancient = UsageEvent {
        at: Timestamp::MIN,
        ..leased(1, acct, &a, 5)
    };
    let earliest = UsageEvent {
        at: Timestamp::from_second(-210_866_803_200).unwrap(),
        ..leased(2, acct, &a, 3)
    };
    // A nanosecond before the earliest: its seconds, rounded toward zero,
    // are the earliest's.
    let just_before = UsageEvent {
        at: earliest.at - SignedDuration::from_nanos(1),
        ..leased(4, acct, &a, 6)
    };
    let batch = [ancient, earliest, leased(3, acct, &a, 4), just_before];
    assert_eq!(
        store.ingest(&batch).await.unwrap(),
        [
            IngestOutcome::Rejected(RejectReason::Malformed),
            IngestOutcome::Accepted,
            IngestOutcome::Accepted,
            IngestOutcome::Rejected(RejectReason::Malformed),
        ]
    );
    let billed: Vec<u64> = store
        .usage(acct, None, None)
        .await
        .unwrap()
        .iter()
        .map(|event| event.units.get())
        .collect();
    assert_eq!(billed, [3, 4]);
    audited(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_batch_from_two_instances_at_once_is_recorded_once() {
    let Some(store) = store("ingest_race", 1).await else {
        return;
    };
    let acct = account(&store, 1_000).await;
    let a = store
        .acquire(acct, CostUnits(100), TTL, at(0))
        .await
        .unwrap();
    let batch: Vec<_> = (1..=50).map(|n| leased(n, acct, &a, 1)).collect();
    let twin = sibling(&store).await;
    let (left, right) = tokio::join!(store.ingest(&batch), twin.ingest(&batch));
    let (left, right) = (left.unwrap(), right.unwrap());
    for (l, r) in left.iter().zip(&right) {
        let mut pair = [*l, *r];
        pair.sort_by_key(|outcome| *outcome == IngestOutcome::Duplicate);
        assert_eq!(pair, [IngestOutcome::Accepted, IngestOutcome::Duplicate]);
    }
    assert_eq!(store.usage(acct, None, None).await.unwrap().len(), 50);
    audited(&store).await;
}

// ---- keys and snapshots -------------------------------------------------------------------

#[tokio::test]
async fn a_key_keeps_all_64_permission_bits_and_its_hash_but_never_its_secret() {
    let Some(store) = store("keys", 1).await else {
        return;
    };
    let acct = account(&store, 10).await;
    let issued = store
        .issue_key(acct, PermissionBits::bit(0), at(3))
        .await
        .unwrap();
    let hash = KeyHash::of(issued.key.expose().as_bytes());
    let snapshot = store.lookup_key(&hash, at(4)).await.unwrap().unwrap();
    assert_eq!(snapshot.key_hash, Some(hash));
    let all = store
        .issue_key(acct, PermissionBits::ALL, at(3))
        .await
        .unwrap();
    let fetched = store.fetch(&[all.principal], at(4)).await.unwrap();
    assert_eq!(fetched[0].permissions, PermissionBits::ALL, "all 64 bits");
    assert_eq!(store.list_keys(acct).await.unwrap()[0].created_at, at(3));
    store.revoke_key(issued.key_id, at(5)).await.unwrap();
    store.revoke_key(issued.key_id, at(6)).await.unwrap();
    let listed = store.list_keys(acct).await.unwrap();
    assert_eq!(listed[0].status, KeyStatus::Revoked);
    assert_eq!(
        listed[0].revoked_at,
        Some(at(5)),
        "revoking again is a no-op"
    );
    // I16: the store holds the hash and the prefix, never the secret, in
    // any of its tables (the keys table, the journal, or one added later).
    let (visible, secret) = issued.key.expose().split_at(11);
    let visible = &visible[3..];
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1",
    )
    .bind(store.schema())
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert!(tables.iter().any(|table| table == "keys"), "{tables:?}");
    let mut prefix_seen = false;
    for table in &tables {
        let rows: Vec<String> =
            sqlx::query_scalar(&format!("SELECT t::text FROM {}.{table} t", store.schema()))
                .fetch_all(store.pool())
                .await
                .unwrap();
        assert!(
            rows.iter().all(|row| !row.contains(secret)),
            "{table} holds the secret"
        );
        prefix_seen |= rows.iter().any(|row| row.contains(visible));
    }
    assert!(prefix_seen, "the visible prefix is kept");
    audited(&store).await;
}

#[tokio::test]
async fn an_account_change_reaches_its_keys_in_key_order() {
    let Some(store) = store("changes_order", 1).await else {
        return;
    };
    let acct = account(&store, 10).await;
    let other = account(&store, 10).await;
    let mut keys = Vec::new();
    for owner in [acct, other, acct, acct] {
        keys.push(
            store
                .issue_key(owner, PermissionBits::ALL, at(0))
                .await
                .unwrap()
                .principal,
        );
    }
    let cursor = store
        .changed_since(SnapshotCursor::START, 10, at(1))
        .await
        .unwrap()
        .next;
    store
        .set_mode(
            acct,
            EnforcementMode::Elastic {
                overage_cap: CostUnits(5),
            },
        )
        .await
        .unwrap();
    let changed = store.changed_since(cursor, 10, at(2)).await.unwrap();
    let principals: Vec<_> = changed.snapshots.iter().map(|s| s.principal).collect();
    assert_eq!(principals, vec![keys[0], keys[2], keys[3]]);
}

/// A reader paging by revision while keys are issued one after another
/// never skips one. (One writer commits in number order anyway; the racing
/// writers below are what test I32's lock.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paging_by_revision_never_skips_a_change_made_concurrently() {
    let Some(store) = store("changes_race", 1).await else {
        return;
    };
    let acct = account(&store, 10).await;
    let writer = sibling(&store).await;
    // The writer issues half its keys, then waits until the reader has paged
    // through some, so reading and issuing overlap on any machine.
    let (reading, read_some) = tokio::sync::oneshot::channel::<()>();
    let issuing = tokio::spawn(async move {
        let mut issued = Vec::new();
        let mut read_some = Some(read_some);
        for n in 0..60 {
            if n == 30 {
                read_some.take().unwrap().await.unwrap();
            }
            issued.push(
                writer
                    .issue_key(acct, PermissionBits::ALL, at(0))
                    .await
                    .unwrap()
                    .principal,
            );
        }
        issued
    });
    let mut seen = Vec::new();
    let mut cursor = SnapshotCursor::START;
    let mut reading = Some(reading);
    while !issuing.is_finished() {
        let page = store.changed_since(cursor, 7, at(1)).await.unwrap();
        seen.extend(page.snapshots.iter().map(|s| s.principal));
        cursor = page.next;
        if !seen.is_empty()
            && let Some(reading) = reading.take()
        {
            reading.send(()).unwrap();
        }
    }
    assert!(reading.is_none(), "pages were read while keys were issued");
    let issued = issuing.await.unwrap();
    page_to_the_end(&store, cursor, 7, at(1), |page| {
        seen.extend(page.snapshots.iter().map(|s| s.principal));
    })
    .await;
    assert_eq!(seen, issued, "every key seen once, in issue order");
}

/// I32 where it can break: writers on different accounts draw revisions
/// at once, so without the revision lock a later revision can commit
/// before an earlier one and a reader's cursor passes the earlier one for
/// good. Every key issued must be paged exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paging_by_revision_never_skips_a_change_among_racing_writers() {
    const WRITERS: usize = 4;
    const KEYS_EACH: usize = 40;
    let Some(store) = store("changes_racing_writers", 1).await else {
        return;
    };
    // Each writer its own account, so no account lock orders them, and
    // its own pool, as separate instances would have.
    let mut writers = Vec::new();
    for _ in 0..WRITERS {
        let pool = sibling(&store).await;
        let acct = account(&pool, 10).await;
        writers.push((pool, acct));
    }
    let start = Arc::new(tokio::sync::Barrier::new(WRITERS + 1));
    let issuing: Vec<_> = writers
        .into_iter()
        .map(|(pool, acct)| {
            let start = Arc::clone(&start);
            tokio::spawn(async move {
                start.wait().await;
                let mut issued = Vec::new();
                for _ in 0..KEYS_EACH {
                    let key = pool.issue_key(acct, PermissionBits::ALL, at(0)).await;
                    issued.push(key.unwrap().principal);
                }
                issued
            })
        })
        .collect();
    start.wait().await;
    let mut seen = Vec::new();
    let mut cursor = SnapshotCursor::START;
    let mut pages_during = 0;
    while !issuing.iter().all(tokio::task::JoinHandle::is_finished) {
        let page = store.changed_since(cursor, 3, at(1)).await.unwrap();
        seen.extend(page.snapshots.iter().map(|s| s.principal));
        cursor = page.next;
        pages_during += 1;
    }
    let mut issued = Vec::new();
    for writer in issuing {
        issued.extend(writer.await.unwrap());
    }
    page_to_the_end(&store, cursor, 3, at(1), |page| {
        seen.extend(page.snapshots.iter().map(|s| s.principal));
    })
    .await;
    assert!(pages_during > 1, "pages were read while keys were issued");
    assert_eq!(issued.len(), WRITERS * KEYS_EACH);
    let missed: Vec<_> = issued.iter().filter(|p| !seen.contains(p)).collect();
    assert!(missed.is_empty(), "I32: the reader skipped {missed:?}");
    seen.sort_unstable();
    issued.sort_unstable();
    assert_eq!(seen, issued, "every key seen exactly once");
}

/// I32 for revocations: revocations racing on different accounts must not
/// let a reader's cursor pass one for good, or the revoked key would keep
/// its active policy on every instance (fail open).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paging_by_revision_never_skips_a_revocation_among_racing_writers() {
    race_revision_writers("changes_racing_revokes", Change::Revoke).await;
}

/// I32 for account status: status changes racing on different accounts
/// must not let a reader's cursor pass one for good, or a suspended account
/// would keep admitting on every instance (fail open).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paging_by_revision_never_skips_a_status_change_among_racing_writers() {
    race_revision_writers("changes_racing_statuses", Change::Status).await;
}

/// What the racing writers of [`race_revision_writers`] do.
#[derive(Clone, Copy)]
enum Change {
    /// Revoke each key in turn.
    Revoke,
    /// Suspend each key's account in turn.
    Status,
}

/// Writers on accounts of their own make `change`s at once while a reader
/// pages by revision from past every key's issue; the last snapshot the
/// reader sees of each key must show the writers' last word on it. (A status
/// change republishes every key of its account, so the kinds race apart:
/// mixed, a later status change would hide a skipped revocation.)
async fn race_revision_writers(name: &str, change: Change) {
    const WRITERS: usize = 4;
    const KEYS_EACH: usize = 30;
    let Some(store) = store(name, 1).await else {
        return;
    };
    // Each key on an account of its own, so each change is the last word on
    // the keys it touches.
    let mut writers = Vec::new();
    for _ in 0..WRITERS {
        let pool = sibling(&store).await;
        let mut keys = Vec::new();
        for _ in 0..KEYS_EACH {
            let acct = account(&pool, 10).await;
            let key = pool.issue_key(acct, PermissionBits::ALL, at(0)).await;
            keys.push((acct, key.unwrap()));
        }
        writers.push((pool, keys));
    }
    // The reader starts past every issue, so what it pages next is the
    // racing writers' work.
    let mut cursor = page_to_the_end(&store, SnapshotCursor::START, 50, at(1), |_| {}).await;
    let start = Arc::new(tokio::sync::Barrier::new(WRITERS + 1));
    let changing: Vec<_> = writers
        .into_iter()
        .map(|(pool, keys)| {
            let start = Arc::clone(&start);
            tokio::spawn(async move {
                start.wait().await;
                for (acct, key) in &keys {
                    match change {
                        Change::Revoke => pool.revoke_key(key.key_id, at(2)).await.unwrap(),
                        Change::Status => {
                            pool.set_status(*acct, AccountStatus::Suspended)
                                .await
                                .unwrap();
                        }
                    }
                }
                let expected = match change {
                    Change::Revoke => (KeyStatus::Revoked, AccountStatus::Active),
                    Change::Status => (KeyStatus::Active, AccountStatus::Suspended),
                };
                keys.into_iter()
                    .map(|(_, key)| (key.principal, expected))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    start.wait().await;
    let mut last = std::collections::HashMap::new();
    let mut pages_during = 0;
    let mut record = |page: &tollgate::store::SnapshotPage| {
        for snapshot in &page.snapshots {
            last.insert(
                snapshot.principal,
                (snapshot.key_status, snapshot.account_status),
            );
        }
    };
    while !changing.iter().all(tokio::task::JoinHandle::is_finished) {
        let page = store.changed_since(cursor, 3, at(3)).await.unwrap();
        record(&page);
        cursor = page.next;
        pages_during += 1;
    }
    let mut expected = Vec::new();
    for writer in changing {
        expected.extend(writer.await.unwrap());
    }
    page_to_the_end(&store, cursor, 3, at(3), &mut record).await;
    assert!(pages_during > 1, "pages were read while the writers ran");
    assert_eq!(expected.len(), WRITERS * KEYS_EACH);
    let stale: Vec<_> = expected
        .iter()
        .filter(|(principal, expected)| last.get(principal) != Some(expected))
        .collect();
    assert!(
        stale.is_empty(),
        "I32: the reader's last word is stale for {stale:?}"
    );
}

// ---- concurrency and failure --------------------------------------------------------------

/// I8 across racing batches that lock different rows: two batches, each on
/// its own account, claim one request id between them. Their locks do not
/// order them, so it is the timing that decides how the second meets the
/// first's claim: already committed when it checks, so it judges its events
/// one by one from the start, or only as it inserts, so it falls back to
/// judging them one by one and takes back what it inserted (the next test
/// forces that case). Either way, every round exactly one of the two claims
/// is accepted, every other event is accepted once, and the debt booked is
/// exactly the units accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_batches_claiming_one_request_id_book_it_once() {
    const ROUNDS: u64 = 60;
    let Some(store) = store("ingest_claim_race", 1).await else {
        return;
    };
    let accounts = [account(&store, 0).await, account(&store, 0).await];
    let pools = [Arc::new(sibling(&store).await), Arc::new(store)];
    let overage = |request: RequestId, account: AccountId, units: u64| UsageEvent {
        request_id: request,
        account_id: account,
        source: UsageSource::Overage,
        units: CostUnits(units),
        at: at(1),
        policy_revision: PolicyRevision(1),
        key_id: None,
    };
    let mut booked = [0_u64; 2];
    for round in 0..ROUNDS {
        let claimed = RequestId::from_parts(round, 0);
        let start = Arc::new(tokio::sync::Barrier::new(2));
        let racers: Vec<_> = (0..2_usize)
            .map(|side| {
                let pool = Arc::clone(&pools[side]);
                let start = Arc::clone(&start);
                let account = accounts[side];
                // Units differ by side, so the loser's claim conflicts.
                let side_units = 1 + side as u64;
                let batch = [
                    overage(RequestId::from_parts(round, 1 + side as u64), account, 10),
                    overage(claimed, account, side_units),
                    overage(RequestId::from_parts(round, 3 + side as u64), account, 100),
                ];
                tokio::spawn(async move {
                    start.wait().await;
                    pool.ingest(&batch).await.unwrap()
                })
            })
            .collect();
        let mut outcomes = Vec::new();
        for racer in racers {
            outcomes.push(racer.await.unwrap());
        }
        let accepted = |side: usize| IngestOutcome::Accepted == outcomes[side][1];
        assert!(
            accepted(0) != accepted(1),
            "I8: round {round}: exactly one claim of the id is accepted: {outcomes:?}"
        );
        for (side, outcome) in outcomes.iter().enumerate() {
            assert_eq!(
                [outcome[0], outcome[2]],
                [IngestOutcome::Accepted; 2],
                "round {round}: the batch's own events are accepted whatever the claim met"
            );
            if !accepted(side) {
                assert_eq!(
                    outcome[1],
                    IngestOutcome::Rejected(RejectReason::ConflictingDuplicate)
                );
            }
            booked[side] += 110 + if accepted(side) { 1 + side as u64 } else { 0 };
        }
    }
    for (side, account) in accounts.into_iter().enumerate() {
        let view = pools[1].account(account, at(2)).await.unwrap();
        assert_eq!(
            view.overage_debt.get(),
            booked[side],
            "every accepted event booked once, nothing else"
        );
    }
    audited(&pools[1]).await;
}

/// I8 when a batch finds its claimed request id taken only as it inserts:
/// another batch, on another account (so no lock of the first's orders
/// them), has recorded the id but not yet committed. The first batch's
/// check cannot see that row, so it takes the all-new path and waits at its
/// insert on the other's uncommitted entry in the request-id index. Once
/// the other commits, the insert skips the id, and the batch must take back
/// the events it inserted and judge them one by one: the claim is a
/// conflicting duplicate, its other events are accepted, and each is booked
/// once. The interleaving is forced, not raced for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines, reason = "one scenario, read top to bottom")]
async fn a_batch_that_finds_its_claim_taken_at_insert_judges_its_events_one_by_one() {
    let Some(store) = store("ingest_claim_fallback", 1).await else {
        return;
    };
    let accounts = [account(&store, 0).await, account(&store, 0).await];
    let claimed = RequestId::from_parts(7, 0);
    let schema = store.schema().to_owned();
    // The other batch: the store's own ingest function, called by a session
    // that keeps its transaction open.
    let mut other = store.pool().begin().await.unwrap();
    let other_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *other)
        .await
        .unwrap();
    let recorded: String = sqlx::query_scalar(&format!(
        "SELECT outcome FROM {schema}.ingest_usage(ARRAY[$1::uuid], ARRAY[$2::bigint], \
         ARRAY[NULL::bigint], ARRAY[NULL::bigint], ARRAY[$3::bigint], ARRAY[to_timestamp(1)], \
         ARRAY[1::bigint], ARRAY[NULL::bigint])"
    ))
    .bind(format!("{:032x}", claimed.get()))
    .bind(i64::try_from(accounts[1].get()).unwrap())
    .bind(2_i64)
    .fetch_one(&mut *other)
    .await
    .unwrap();
    assert_eq!(recorded, "accepted");

    let overage = |request: RequestId, units: u64| UsageEvent {
        request_id: request,
        account_id: accounts[0],
        source: UsageSource::Overage,
        units: CostUnits(units),
        at: at(1),
        policy_revision: PolicyRevision(1),
        key_id: None,
    };
    let batch = [
        overage(RequestId::from_parts(7, 1), 10),
        overage(claimed, 1),
        overage(RequestId::from_parts(7, 3), 100),
    ];
    let ingesting = tokio::spawn({
        let store = sibling(&store).await;
        async move { store.ingest(&batch).await }
    });
    // Wait until the batch waits on the other's transaction: the only thing
    // of the other's it can wait on is the index entry of the claimed id,
    // since the other locked only its own account's row.
    let seen_waiting = "SELECT count(*) FROM pg_locks l \
                        JOIN pg_stat_activity a ON a.backend_xid = l.transactionid \
                        WHERE l.locktype = 'transactionid' AND NOT l.granted AND a.pid = $1";
    let give_up = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>(seen_waiting)
        .bind(other_pid)
        .fetch_one(store.pool())
        .await
        .unwrap()
        == 0
    {
        assert!(
            !ingesting.is_finished(),
            "the batch ended without waiting: {:?}",
            ingesting.await
        );
        assert!(
            tokio::time::Instant::now() < give_up,
            "the batch never waited on the other's claim"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    other.commit().await.unwrap();
    let outcomes = ingesting.await.unwrap().unwrap();
    assert_eq!(
        outcomes,
        vec![
            IngestOutcome::Accepted,
            IngestOutcome::Rejected(RejectReason::ConflictingDuplicate),
            IngestOutcome::Accepted,
        ],
        "I8: the claim meets the other's record; the batch's own events are accepted"
    );
    let debts = [
        store
            .account(accounts[0], at(2))
            .await
            .unwrap()
            .overage_debt,
        store
            .account(accounts[1], at(2))
            .await
            .unwrap()
            .overage_debt,
    ];
    assert_eq!(
        debts,
        [CostUnits(110), CostUnits(2)],
        "every accepted event booked once, the taken-back ones not at all"
    );
    let ids = |events: Vec<UsageEvent>| -> Vec<RequestId> {
        events.iter().map(|event| event.request_id).collect()
    };
    let mut first = ids(store.usage(accounts[0], None, None).await.unwrap());
    first.sort_unstable();
    assert_eq!(
        first,
        vec![RequestId::from_parts(7, 1), RequestId::from_parts(7, 3)]
    );
    assert_eq!(
        ids(store.usage(accounts[1], None, None).await.unwrap()),
        vec![claimed]
    );
    audited(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_acquirers_on_one_account_never_over_grant() {
    let Some(store) = store("acquire_race", 4).await else {
        return;
    };
    let acct = account(&store, 5_000).await;
    // One pool holds ten connections: two pools let all sixteen acquirers
    // be inside a transaction at once, as sixteen instances would be.
    let pools = [Arc::new(sibling(&store).await), Arc::new(store)];
    let store = Arc::clone(&pools[1]);
    let tasks: Vec<_> = (0..16_u128)
        .map(|task| {
            let store = Arc::clone(&pools[usize::from(task % 2 == 0)]);
            tokio::spawn(async move {
                let mut kept = 0_u64;
                for round in 0..40_u128 {
                    let allocation = match store.acquire(acct, CostUnits(40), TTL, at(0)).await {
                        Ok(allocation) => allocation,
                        // The balance ran out: a refusal, as it should be.
                        Err(
                            AllocateError::BalanceExhausted(_)
                            | AllocateError::BalanceInsufficient(_)
                            | AllocateError::InsufficientBalance,
                        ) => continue,
                        Err(error) => panic!("a race is no storage error: {error}"),
                    };
                    let g = allocation.grant;
                    let spend = g.units.get() / 2;
                    let event = leased(task * 1_000 + round, acct, &allocation, spend);
                    assert_eq!(
                        store.ingest(&[event]).await.unwrap(),
                        vec![IngestOutcome::Accepted]
                    );
                    // Every third lease is kept: its units stay granted.
                    if round % 3 == 0 {
                        kept += g.units.get();
                    } else {
                        store
                            .release(
                                g.lease_id,
                                g.fencing_token,
                                CostUnits(g.units.get() - spend),
                                at(1),
                            )
                            .await
                            .unwrap();
                    }
                }
                kept
            })
        })
        .collect();
    let mut kept = 0;
    for task in tasks {
        kept += task.await.unwrap();
    }
    let view = store.account(acct, at(2)).await.unwrap();
    assert_eq!(view.leased.get(), kept, "exactly the kept leases are out");
    let billed: u64 = store
        .usage(acct, None, None)
        .await
        .unwrap()
        .iter()
        .map(|e| e.units.get())
        .sum();
    // Every released lease was released with exactly its unspent remainder
    // (its grant less the one event billed against it), so settlement left
    // nothing unbilled (I15). Adding `settled_unbilled` to the sum below
    // would hide a release that credits the wrong amount: it absorbs
    // whatever a release failed to credit.
    assert_eq!(
        view.settled_unbilled,
        CostUnits::ZERO,
        "I15: a lease released with its exact remainder leaves nothing unbilled"
    );
    // I14: every unit is in the balance, on a held lease, or billed;
    // nothing was granted twice and nothing went missing.
    assert_eq!(
        view.balance.get() + view.leased.get() + billed - used_on_held(&store, acct).await,
        5_000
    );
    assert!(view.leased.get() <= 5_000);
    audited(&store).await;
}

/// Units billed against leases still active (they are inside `leased`).
async fn used_on_held(store: &PostgresStore, acct: AccountId) -> u64 {
    let used: Option<i64> = sqlx::query_scalar(&format!(
        "SELECT sum(used)::bigint FROM {}.leases WHERE account_id = $1 AND state = 'active'",
        store.schema()
    ))
    .bind(i64::try_from(acct.get()).unwrap())
    .fetch_one(store.pool())
    .await
    .unwrap();
    u64::try_from(used.unwrap_or(0)).unwrap()
}

/// On the pool `connect` builds, the server ends a transaction left idle
/// after ten seconds, and transactions default to read committed, even
/// where the URL (or the server) asks for a stricter level: the store's
/// statements are written for read committed.
#[tokio::test]
async fn connections_end_idle_transactions_and_default_to_read_committed() {
    let Some(store) = store("server_bounds", 1).await else {
        return;
    };
    let setting = |name: &'static str| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, String>(&format!("SHOW {name}"))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(setting("idle_in_transaction_session_timeout").await, "10s");
    assert_eq!(
        setting("default_transaction_isolation").await,
        "read committed"
    );
    let url = database_url("server_bounds").expect("checked above");
    let separator = if url.contains('?') { '&' } else { '?' };
    let stricter = PostgresStore::connect(
        &format!(
            "{url}{separator}options=-c%20default_transaction_isolation%3Drepeatable%5C%20read"
        ),
        PostgresConfig {
            schema: unique_schema("server_bounds"),
            policy: policy(1),
            lock_timeout: LOCK_TIMEOUT,
            queue_timeout: LOCK_TIMEOUT,
        },
    )
    .await
    .expect("the test server is reachable");
    let isolation: String = sqlx::query_scalar("SHOW default_transaction_isolation")
        .fetch_one(stricter.pool())
        .await
        .unwrap();
    assert_eq!(isolation, "read committed");
}

/// A row of `table` held by another session, until the transaction
/// returned is rolled back.
async fn hold_row(
    store: &PostgresStore,
    table: &str,
    id: u64,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holder = store.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {}.{table} WHERE id = $1 FOR UPDATE",
        store.schema()
    ))
    .bind(i64::try_from(id).unwrap())
    .execute(&mut *holder)
    .await
    .unwrap();
    holder
}

/// A call its caller gave up on must not hold an account's locks: every
/// transaction the store opens, a usage batch's included, bounds its lock
/// waits by the configured `lock_timeout`, whatever the pool's connections
/// say. The blocked calls are timed: they wait the configured timeout,
/// neither less (no lock wait at all, or a shorter bound) nor much more
/// (the server's default, or the five seconds of the store's other pools).
#[tokio::test]
async fn lock_waits_are_bounded_and_an_abandoned_call_changes_nothing() {
    const CONFIGURED: std::time::Duration = std::time::Duration::from_millis(300);
    // The server counts the timeout from when the wait starts, after the
    // call has begun its transaction, so a call cannot end sooner; the
    // tolerance only absorbs timer rounding.
    const AT_LEAST: std::time::Duration = std::time::Duration::from_millis(290);
    // Generous for a loaded machine, and still short of LOCK_TIMEOUT, the
    // five seconds this test's other store waits.
    const BELOW: std::time::Duration = std::time::Duration::from_secs(5);
    let Some(store) = store("lock_waits", 1).await else {
        return;
    };
    let url = database_url("lock_waits").expect("checked above");
    // Another session holds the account's row. Even over a pool of the
    // caller's, whose connections would wait for it forever, the grant
    // waits no longer than the configured lock timeout, and fails as a
    // storage error.
    let plain = sqlx::PgPool::connect(&url).await.unwrap();
    let bounded = PostgresStore::with_pool(
        plain,
        PostgresConfig {
            schema: store.schema().to_owned(),
            policy: *store.policy(),
            lock_timeout: CONFIGURED,
            queue_timeout: LOCK_TIMEOUT,
        },
    )
    .unwrap();
    let acct = account(&store, 100).await;
    let holder = hold_row(&store, "accounts", acct.get()).await;
    let started = std::time::Instant::now();
    let blocked = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        bounded.acquire(acct, CostUnits(10), TTL, at(0)),
    )
    .await
    .expect("the wait for the lock is bounded");
    let waited = started.elapsed();
    assert!(
        matches!(blocked, Err(AllocateError::Storage(_))),
        "{blocked:?}"
    );
    assert!(
        (AT_LEAST..BELOW).contains(&waited),
        "the grant waited the configured {CONFIGURED:?} for the lock, not {waited:?}"
    );
    // A call its caller gives up on while it waits changes nothing, and
    // leaves the store usable once the row is free.
    let abandoned = tokio::time::timeout(
        std::time::Duration::from_millis(50),
        bounded.acquire(acct, CostUnits(10), TTL, at(0)),
    )
    .await;
    assert!(abandoned.is_err(), "cut off while it waits");
    holder.rollback().await.unwrap();
    assert_eq!(
        balance(&store, acct, at(0)).await,
        100,
        "nothing was granted"
    );
    let granted = bounded
        .acquire(acct, CostUnits(10), TTL, at(0))
        .await
        .expect("the row is free again");
    assert_eq!(granted.grant.units, CostUnits(10));
    assert_eq!(balance(&store, acct, at(0)).await, 90);
    // The same for a usage batch whose lease another session holds.
    let holder = hold_row(&store, "leases", granted.grant.lease_id.get()).await;
    let started = std::time::Instant::now();
    let blocked = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        bounded.ingest(&[leased(1, acct, &granted, 4)]),
    )
    .await
    .expect("the wait for the lock is bounded");
    let waited = started.elapsed();
    assert!(blocked.is_err(), "a storage error: {blocked:?}");
    assert!(
        (AT_LEAST..BELOW).contains(&waited),
        "the batch waited the configured {CONFIGURED:?} for the lock, not {waited:?}"
    );
    holder.rollback().await.unwrap();
    assert_eq!(
        bounded
            .ingest(&[leased(1, acct, &granted, 4)])
            .await
            .unwrap(),
        vec![IngestOutcome::Accepted],
        "the timed-out batch recorded nothing"
    );
    audited(&store).await;
}

// ---- turns (I35) --------------------------------------------------------------

/// A pool of at most `max` connections whose sessions carry an application
/// name of their own, and the count of connections it has opened.
async fn counting_pool(url: &str, max: u32) -> (sqlx::PgPool, Arc<AtomicUsize>, String) {
    let name = unique_schema("pool");
    let opened = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&opened);
    let options = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap()
        .application_name(&name);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .after_connect(move |_, _| {
            counter.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(()) })
        })
        .connect_with(options)
        .await
        .expect("the test server is reachable");
    (pool, opened, name)
}

/// A store over `store`'s schema and `pool`, waiting `queue_timeout` for a
/// turn.
fn over(store: &PostgresStore, pool: sqlx::PgPool, queue_timeout: Duration) -> PostgresStore {
    PostgresStore::with_pool(
        pool,
        PostgresConfig {
            schema: store.schema().to_owned(),
            policy: *store.policy(),
            lock_timeout: LOCK_TIMEOUT,
            queue_timeout,
        },
    )
    .unwrap()
}

/// How many sessions named `name` are in `state` (`'idle'`, `'active'`, …)
/// and how many of them wait for a lock.
async fn sessions(store: &PostgresStore, name: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state <> 'idle'), \
                count(*) FILTER (WHERE wait_event_type = 'Lock') \
         FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(name)
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// Polls `done` every 10 ms for up to ten seconds; says `what` on failure.
async fn eventually<F: Future<Output = bool>>(what: &str, mut done: impl FnMut() -> F) {
    for _ in 0..1_000 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
}

/// I35: a storm of calls cut off by their callers mid-flight (the runtime
/// cuts every store call off at its timeout) costs the pool none of its
/// connections, and leaves the server no session abandoned: each call that
/// got its turn, the connects its pool makes for it included, runs to its
/// end and hands its connection back. Cut off mid-connect or mid-statement,
/// calls leave sessions the server sees abandoned and connections to open
/// again; after an outage, when every connection must be opened anew, that
/// alone can keep every call timing out. The storm runs in a database of
/// its own, so the server's count of abandoned sessions is the test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_cut_off_by_their_callers_abandon_no_session() {
    const CONNECTIONS: u32 = 4;
    let Some(store) = store("cut_off_calls", 1).await else {
        return;
    };
    let url = database_url("cut_off_calls").expect("checked above");
    let database = unique_schema("cut_off_calls");
    sqlx::query(&format!("CREATE DATABASE \"{database}\""))
        .execute(store.pool())
        .await
        .unwrap();
    let options = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap()
        .database(&database);
    let setup = over(
        &store,
        sqlx::PgPool::connect_with(options.clone()).await.unwrap(),
        LOCK_TIMEOUT,
    );
    setup.migrate().await.unwrap();
    let mut accounts = Vec::new();
    for _ in 0..20 {
        accounts.push(account(&setup, 1_000_000).await);
    }
    // No connection yet: the first calls connect.
    let opened = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&opened);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(CONNECTIONS)
        .after_connect(move |_, _| {
            counter.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(()) })
        })
        .connect_lazy_with(options);
    let cut_short = over(&setup, pool.clone(), LOCK_TIMEOUT);
    let (mut answered, mut cut) = (0, 0);
    for _ in 0..10 {
        let mut calls = tokio::task::JoinSet::new();
        for (i, &acct) in accounts.iter().enumerate() {
            let store = cut_short.clone();
            let limit = Duration::from_millis(1 + 2 * (i as u64 % 8));
            calls.spawn(async move {
                let call = store.acquire(acct, CostUnits(10), TTL, at(0));
                tokio::time::timeout(limit, call).await.is_ok()
            });
        }
        while let Some(call) = calls.join_next().await {
            if call.unwrap() {
                answered += 1;
            } else {
                cut += 1;
            }
        }
    }
    assert!(cut > 0, "the storm cut calls off ({answered} answered)");
    eventually("every call that got its turn ends", || async {
        pool.num_idle() == pool.size() as usize
    })
    .await;
    cut_short
        .acquire(accounts[0], CostUnits(10), TTL, at(0))
        .await
        .expect("the pool serves after the storm");
    // Every grant made is an active lease the books account for.
    audited(&setup).await;
    let opened = opened.load(Ordering::SeqCst);
    pool.close().await;
    setup.pool().close().await;
    // Sessions report their end as they exit.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let abandoned: i64 =
        sqlx::query_scalar("SELECT sessions_abandoned FROM pg_stat_database WHERE datname = $1")
            .bind(&database)
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(
        (abandoned, opened <= CONNECTIONS as usize),
        (0, true),
        "{cut} calls cut off: {abandoned} sessions abandoned, {opened} connections opened for \
         a pool of {CONNECTIONS}"
    );
    sqlx::query(&format!("DROP DATABASE \"{database}\" WITH (FORCE)"))
        .execute(store.pool())
        .await
        .unwrap();
}

/// A grant by `queued` on `account` whose row another session holds: it
/// waits for the row on a turn (its sessions are named `name`) until the
/// returned holder lets go, and then answers through the handle.
async fn grant_waiting_on_its_row(
    store: &PostgresStore,
    queued: &PostgresStore,
    name: &str,
    account: AccountId,
) -> (
    sqlx::Transaction<'static, sqlx::Postgres>,
    tokio::task::JoinHandle<Result<Allocation, AllocateError>>,
) {
    let holder = hold_row(store, "accounts", account.get()).await;
    let blocked = tokio::spawn({
        let queued = queued.clone();
        async move { queued.acquire(account, CostUnits(10), TTL, at(0)).await }
    });
    eventually("the grant waits for its row on a turn", || async {
        sessions(store, name).await.1 == 1
    })
    .await;
    (holder, blocked)
}

/// Asserts that `answer` is the failure of a call that got no turn.
#[track_caller]
fn no_turn<T: std::fmt::Debug>(answer: &Result<T, AllocateError>) {
    assert!(
        matches!(answer, Err(AllocateError::Storage(error))
            if error.made_no_call() && error.to_string().contains("no connection was free")),
        "a call that got no turn: {answer:?}"
    );
}

/// I35: a call that waits `queue_timeout` without a turn fails having made
/// no call, while the call holding the only turn goes on; the turn comes
/// back when that call ends.
#[tokio::test]
async fn a_call_without_a_turn_within_the_queue_timeout_makes_no_call() {
    let Some(store) = store("no_turn", 1).await else {
        return;
    };
    let url = database_url("no_turn").expect("checked above");
    let (pool, _, name) = counting_pool(&url, 1).await;
    let queued = over(&store, pool, Duration::from_millis(100));
    let (first, second) = (account(&store, 100).await, account(&store, 100).await);
    let (holder, blocked) = grant_waiting_on_its_row(&store, &queued, &name, first).await;
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        queued.acquire(second, CostUnits(10), TTL, at(0)),
    )
    .await
    .expect("the wait for a turn is bounded");
    no_turn(&refused);
    assert_eq!(
        balance(&store, second, at(0)).await,
        100,
        "no call was made"
    );
    holder.rollback().await.unwrap();
    let granted = blocked.await.unwrap().expect("the row is free");
    assert_eq!(granted.grant.units, CostUnits(10));
    let granted = queued
        .acquire(second, CostUnits(10), TTL, at(0))
        .await
        .expect("the turn came back");
    assert_eq!(granted.grant.units, CostUnits(10));
    assert_eq!(balance(&store, second, at(0)).await, 90);
    audited(&store).await;
}

/// I35: the allocator's calls may hold every turn but one, so a usage
/// batch or a snapshot read (what billing and readiness wait on) finds a
/// turn while grants and releases queue for theirs.
#[tokio::test]
async fn usage_and_snapshot_calls_keep_a_turn_the_allocator_cannot_take() {
    let Some(store) = store("priority_turn", 1).await else {
        return;
    };
    let url = database_url("priority_turn").expect("checked above");
    let (pool, _, name) = counting_pool(&url, 2).await;
    let queued = over(&store, pool, Duration::from_millis(100));
    let (held, other, billed) = (
        account(&store, 100).await,
        account(&store, 100).await,
        account(&store, 100).await,
    );
    let lease = store
        .acquire(billed, CostUnits(10), TTL, at(0))
        .await
        .unwrap();
    let (holder, blocked) = grant_waiting_on_its_row(&store, &queued, &name, held).await;
    // The allocator's share is taken; one turn is free.
    no_turn(&queued.acquire(other, CostUnits(10), TTL, at(0)).await);
    assert_eq!(
        queued
            .ingest(&[leased(1, billed, &lease, 4)])
            .await
            .unwrap(),
        vec![IngestOutcome::Accepted],
        "the usage batch takes the last turn"
    );
    assert_eq!(
        queued
            .lookup_key(&KeyHash([7; 32]), at(0))
            .await
            .expect("a snapshot read takes the last turn"),
        None
    );
    holder.rollback().await.unwrap();
    let granted = blocked.await.unwrap().expect("the row is free");
    assert_eq!(granted.grant.units, CostUnits(10));
    assert_eq!(balance(&store, other, at(0)).await, 100, "no call was made");
    audited(&store).await;
}

/// I35: a call whose caller gave up goes on waiting for its row on its
/// turn, then rolls back rather than commit a grant nobody holds, and
/// hands its connection back to the pool.
#[tokio::test]
async fn a_call_given_up_on_finishes_by_rolling_back_on_its_connection() {
    let Some(store) = store("given_up", 1).await else {
        return;
    };
    let url = database_url("given_up").expect("checked above");
    let (pool, opened, name) = counting_pool(&url, 2).await;
    let given_up = over(&store, pool.clone(), LOCK_TIMEOUT);
    let acct = account(&store, 100).await;
    let holder = hold_row(&store, "accounts", acct.get()).await;
    let cut = tokio::time::timeout(
        Duration::from_millis(100),
        given_up.acquire(acct, CostUnits(10), TTL, at(0)),
    )
    .await;
    assert!(cut.is_err(), "cut off before the row is free");
    // It holds the row's lock wait for up to LOCK_TIMEOUT.
    eventually(
        "the call waits for the row after its caller gave up",
        || async { sessions(&store, &name).await.1 == 1 },
    )
    .await;
    holder.rollback().await.unwrap();
    eventually("the call ends and its connection is idle", || async {
        pool.num_idle() == pool.size() as usize && sessions(&store, &name).await.0 == 0
    })
    .await;
    assert_eq!(
        balance(&store, acct, at(0)).await,
        100,
        "nothing was granted"
    );
    let leases: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {}.leases WHERE account_id = $1",
        store.schema()
    ))
    .bind(i64::try_from(acct.get()).unwrap())
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(leases, 0, "no lease row was left");
    assert_eq!(opened.load(Ordering::SeqCst), 1, "the connection was kept");
    audited(&store).await;
}

#[tokio::test]
async fn a_closed_pool_is_a_storage_error_never_a_refusal() {
    let Some(store) = store("closed", 1).await else {
        return;
    };
    let acct = account(&store, 100).await;
    let granted = store
        .acquire(acct, CostUnits(10), TTL, at(0))
        .await
        .unwrap();
    store.pool().close().await;
    assert!(matches!(
        store.acquire(acct, CostUnits(1), TTL, at(0)).await,
        Err(AllocateError::Storage(_))
    ));
    assert!(matches!(
        store
            .release(LeaseId(1), FencingToken(1), CostUnits(1), at(0))
            .await,
        Err(AllocateError::Storage(_))
    ));
    assert!(
        store.ingest(&[]).await.unwrap().is_empty(),
        "nothing to send"
    );
    assert!(
        store.ingest(&[leased(1, acct, &granted, 1)]).await.is_err(),
        "an event is never answered as rejected for want of a connection"
    );
    assert!(store.reclaim_expired_batch(at(100), 1).await.is_err());
    assert!(
        store
            .changed_since(SnapshotCursor::START, 1, at(0))
            .await
            .is_err()
    );
    assert!(matches!(
        store.account(acct, at(0)).await,
        Err(AdminError::Storage(_))
    ));
    assert!(store.audit().await.is_err());
}

#[tokio::test]
async fn the_audit_finds_books_changed_behind_the_store() {
    let Some(store) = store("audit", 1).await else {
        return;
    };
    let acct = account(&store, 100).await;
    let a = store
        .acquire(acct, CostUnits(40), TTL, at(0))
        .await
        .unwrap();
    audited(&store).await;
    let schema = store.schema();
    sqlx::raw_sql(&format!(
        "UPDATE {schema}.accounts SET balance = balance + 1, overage_debt = 2; \
         UPDATE {schema}.leases SET used = 41"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let violations = store.audit().await.unwrap();
    assert_eq!(
        violations,
        vec![
            LedgerViolation::LeaseOverdrawn {
                lease_id: a.grant.lease_id,
                granted: CostUnits(40),
                used: CostUnits(41),
                credited: CostUnits::ZERO,
            },
            LedgerViolation::LeaseUsageMismatch {
                lease_id: a.grant.lease_id,
                counter: CostUnits(41),
                recorded: CostUnits::ZERO,
            },
            LedgerViolation::JournalMismatch {
                account_id: acct,
                balance: CostUnits(61),
                journal: 60,
            },
            LedgerViolation::AccountImbalance {
                account_id: acct,
                credited_in: 100,
                accounted_for: 101,
            },
            LedgerViolation::OverageDebtMismatch {
                account_id: acct,
                debt: CostUnits(2),
                recorded: CostUnits::ZERO,
            },
        ]
    );
}

// ---- the memory store as the oracle ----------------------------------------------------------

/// A small deterministic generator, so a failing walk can be replayed.
struct Walk(u64);

impl Walk {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[usize::try_from(self.below(items.len() as u64)).unwrap()]
    }
}

/// Drives the memory store and the `PostgreSQL` store through the same random
/// walk of calls and requires the same answer to every call, refusal for
/// refusal, and the same account views throughout.
#[tokio::test]
#[allow(
    clippy::too_many_lines,
    reason = "one walk over every operation, compared call by call"
)]
async fn a_random_walk_gets_the_memory_stores_answer_to_every_call() {
    let Some(store) = store("oracle", 3).await else {
        return;
    };
    let memory = MemoryStore::new(policy(3)).unwrap();
    let mut accounts = Vec::new();
    for (balance, refill) in [(500, None), (80, Some(secs(40))), (0, Some(secs(25)))] {
        let spec = AccountSpec {
            balance: CostUnits(balance),
            mode: EnforcementMode::Strict,
            status: AccountStatus::Active,
            refill: refill.map(|interval| RefillSchedule {
                amount: CostUnits(120),
                interval,
            }),
        };
        let id = store.create_account(spec, at(0)).await.unwrap();
        assert_eq!(memory.create_account(spec, at(0)).unwrap(), id);
        accounts.push(id);
    }
    let unknown = AccountId(99);
    let mut leases: Vec<tollgate::LeaseGrant> = Vec::new();
    // Replay another walk with TOLLGATE_TEST_WALK_SEED.
    let seed = std::env::var("TOLLGATE_TEST_WALK_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(0x5eed_1234_abcd_0001_u64);
    let mut walk = Walk(seed | 1);
    let mut now = 0_i64;
    let mut request = 0_u128;
    for step in 0..400 {
        now += i64::try_from(walk.below(4)).unwrap();
        let t = at(now);
        let acct = walk.pick(&[accounts[0], accounts[1], accounts[2], accounts[0], unknown]);
        let ttl = walk.pick(&[secs(0), secs(10), secs(30), secs(300)]);
        match walk.below(9) {
            0 | 1 => {
                let requested = CostUnits(walk.below(60));
                let pg = store.acquire(acct, requested, ttl, t).await;
                if std::env::var_os("TOLLGATE_TEST_WALK_TRACE").is_some() {
                    eprintln!("acquire {pg:?}");
                }
                assert_eq!(
                    pg,
                    memory.acquire(acct, requested, ttl, t).await,
                    "step {step}"
                );
                if let Ok(allocation) = pg {
                    leases.push(allocation.grant);
                }
            }
            2 if !leases.is_empty() => {
                let lease = walk.pick(&leases);
                let token = walk.pick(&[lease.fencing_token, FencingToken(12_345)]);
                let unspent = CostUnits(walk.below(lease.units.get() + 2));
                assert_eq!(
                    store.release(lease.lease_id, token, unspent, t).await,
                    memory.release(lease.lease_id, token, unspent, t).await,
                    "step {step}"
                );
            }
            3 if !leases.is_empty() => {
                let lease = walk.pick(&leases);
                let unspent = CostUnits(walk.below(lease.units.get() + 1));
                let (requested, needed) = (CostUnits(walk.below(80)), CostUnits(walk.below(150)));
                let pg = store
                    .consolidate(
                        lease.lease_id,
                        lease.fencing_token,
                        unspent,
                        requested,
                        needed,
                        ttl,
                        t,
                    )
                    .await;
                let oracle = memory
                    .consolidate(
                        lease.lease_id,
                        lease.fencing_token,
                        unspent,
                        requested,
                        needed,
                        ttl,
                        t,
                    )
                    .await;
                assert_eq!(pg, oracle, "step {step}");
                if let Ok(allocation) = pg {
                    leases.push(allocation.grant);
                }
            }
            4 if !leases.is_empty() => {
                let mut batch = Vec::new();
                for _ in 0..walk.below(6) {
                    let lease = walk.pick(&leases);
                    request += 1;
                    let id = if walk.below(5) == 0 {
                        request - 1
                    } else {
                        request
                    };
                    let source = if walk.below(4) == 0 {
                        UsageSource::Overage
                    } else {
                        UsageSource::Leased {
                            lease_id: lease.lease_id,
                            fencing_token: lease.fencing_token,
                        }
                    };
                    batch.push(UsageEvent {
                        request_id: RequestId(id),
                        account_id: walk.pick(&[lease.account_id, lease.account_id, acct]),
                        source,
                        units: CostUnits(walk.below(30)),
                        at: t,
                        policy_revision: PolicyRevision(walk.below(3)),
                        key_id: walk.pick(&[None, Some(KeyId(1))]),
                    });
                }
                let outcomes = store.ingest(&batch).await.unwrap();
                if std::env::var_os("TOLLGATE_TEST_WALK_TRACE").is_some() {
                    eprintln!("ingest {outcomes:?}");
                }
                assert_eq!(
                    outcomes,
                    memory.ingest(&batch).await.unwrap(),
                    "step {step}: {batch:?}"
                );
            }
            5 => {
                let limit = usize::try_from(walk.below(4)).unwrap();
                assert_eq!(
                    store.reclaim_expired_batch(t, limit).await.unwrap(),
                    memory.reclaim_expired_batch(t, limit).await.unwrap(),
                    "step {step}"
                );
            }
            6 => {
                let units = CostUnits(walk.below(100));
                let key = format!("walk-{step}");
                assert_eq!(
                    store
                        .top_up(acct, units, &movement(&key), t)
                        .await
                        .map(|change| change.balance),
                    memory.top_up(acct, units, t),
                    "step {step}"
                );
            }
            7 => {
                let status = walk.pick(&[AccountStatus::Active, AccountStatus::Suspended]);
                assert_eq!(
                    store.set_status(acct, status).await,
                    memory.set_status(acct, status),
                    "step {step}"
                );
            }
            _ => {
                let refill = walk.pick(&[
                    None,
                    Some(RefillSchedule {
                        amount: CostUnits(90),
                        interval: secs(30),
                    }),
                ]);
                assert_eq!(
                    store.configure_refill(acct, refill, t).await,
                    memory.configure_refill(acct, refill, t),
                    "step {step}"
                );
            }
        }
        for id in &accounts {
            assert_eq!(
                store.account(*id, t).await.unwrap(),
                memory.account(*id, t).unwrap(),
                "step {step}: {id}"
            );
        }
    }
    for id in &accounts {
        assert_eq!(
            store.usage(*id, None, None).await.unwrap(),
            memory.usage(*id).unwrap()
        );
    }
    assert_eq!(memory.audit().unwrap(), vec![]);
    audited(&store).await;
}

/// What one worker of `mixed_traffic_from_many_pools_never_deadlocks` was
/// told by the store: every grant, every settlement, and every event
/// accepted. The books are checked against these answers, not against the
/// store's own audit alone.
#[derive(Default)]
struct Answers {
    /// Every lease granted (acquired, or granted by a consolidation): its
    /// account and units.
    granted: std::collections::HashMap<LeaseId, (AccountId, u64)>,
    /// Every settlement answered: the lease, the units credited, and
    /// whether a reclaim settled it (rather than a release or a
    /// consolidation, which credit the zero units claimed here).
    settled: Vec<(LeaseId, u64, bool)>,
    /// Units of accepted leased events, by lease.
    used: std::collections::HashMap<LeaseId, u64>,
    /// Units of accepted overage events, by account.
    overage: std::collections::HashMap<AccountId, u64>,
}

impl Answers {
    fn merge(&mut self, other: Self) {
        for (lease, grant) in other.granted {
            assert!(
                self.granted.insert(lease, grant).is_none(),
                "{lease} granted twice"
            );
        }
        self.settled.extend(other.settled);
        for (lease, units) in other.used {
            *self.used.entry(lease).or_default() += units;
        }
        for (account, units) in other.overage {
            *self.overage.entry(account).or_default() += units;
        }
    }

    /// Checks the store's books against these answers, the workers' all
    /// merged; each account started with `initial` units.
    async fn check(&self, store: &PostgresStore, accounts: &[AccountId], initial: u64) {
        // I15: a lease settles once, and only a lease that was granted.
        let mut settled = std::collections::HashMap::new();
        for (lease, credited, reclaimed) in &self.settled {
            assert!(
                self.granted.contains_key(lease),
                "{lease} settled but never granted"
            );
            assert!(
                settled.insert(*lease, *credited).is_none(),
                "I15: {lease} settled twice"
            );
            let used = self.used.get(lease).copied().unwrap_or(0);
            if *reclaimed {
                // I19: a reclaim credits everything not billed; no event is
                // accepted after it, since those units now count as credited.
                assert_eq!(
                    *credited,
                    self.granted[lease].1 - used,
                    "I19: {lease} reclaimed for its grant less its billed usage"
                );
            } else {
                assert_eq!(
                    *credited, 0,
                    "{lease}: a release or consolidation credits the zero units it claimed"
                );
            }
        }
        for &acct in accounts {
            let (mut granted, mut credited, mut leased, mut unbilled, mut used) = (0, 0, 0, 0, 0);
            for (lease, &(owner, units)) in &self.granted {
                if owner != acct {
                    continue;
                }
                let billed = self.used.get(lease).copied().unwrap_or(0);
                granted += units;
                used += billed;
                match settled.get(lease) {
                    Some(&credit) => {
                        credited += credit;
                        unbilled += units - credit - billed;
                    }
                    None => leased += units,
                }
            }
            let overage = self.overage.get(&acct).copied().unwrap_or(0);
            let view = store.account(acct, at(100)).await.unwrap();
            assert_eq!(
                (
                    view.balance.get(),
                    view.leased.get(),
                    view.settled_unbilled.get(),
                    view.overage_debt.get()
                ),
                (initial - granted + credited, leased, unbilled, overage),
                "I14: {acct}'s balance, leased units, unbilled remainder and debt are what \
                 the answers add up to"
            );
            let billed: u64 = store
                .usage(acct, None, None)
                .await
                .unwrap()
                .iter()
                .map(|event| event.units.get())
                .sum();
            assert_eq!(billed, used + overage, "every accepted event billed once");
        }
    }
}

/// Acquire, ingest (leased and overage events across accounts in one
/// batch), release, consolidate and reclaim, all at once from several pools
/// over the same accounts: the one lock order means no call ever fails with
/// a deadlock (I31), and the books balance at the end, by the store's audit
/// and by the store's own answers: each account's balance, leased units,
/// overage debt and unbilled remainder are what its grants, settlements
/// and accepted events add up to (I14, I15), and a reclaim credits exactly
/// what was granted and not billed (I19).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(clippy::too_many_lines, reason = "one scenario, read top to bottom")]
async fn mixed_traffic_from_many_pools_never_deadlocks() {
    const INITIAL: u64 = 20_000;
    let Some(store) = store("mixed", 2).await else {
        return;
    };
    let mut accounts = Vec::new();
    for _ in 0..3 {
        accounts.push(account(&store, INITIAL).await);
    }
    let accounts = Arc::new(accounts);
    let mut tasks = Vec::new();
    for task in 0..6_u64 {
        let worker = sibling(&store).await;
        let accounts = Arc::clone(&accounts);
        tasks.push(tokio::spawn(async move {
            let mut answers = Answers::default();
            let mut walk = Walk(0x9e37_79b9_7f4a_7c15 ^ (task + 1));
            let mut held: Vec<tollgate::LeaseGrant> = Vec::new();
            for round in 0..60_u64 {
                let acct = walk.pick(&accounts);
                let now = at(i64::try_from(round).unwrap());
                // A refusal (a short balance) is an answer; a storage error,
                // such as a deadlock PostgreSQL broke, is not.
                match worker.acquire(acct, CostUnits(30), secs(5), now).await {
                    Ok(allocation) => {
                        let grant = allocation.grant;
                        answers
                            .granted
                            .insert(grant.lease_id, (grant.account_id, grant.units.get()));
                        held.push(grant);
                    }
                    Err(AllocateError::Storage(error)) => panic!("acquire: {error}"),
                    Err(_) => {}
                }
                // One batch naming several leases and overage accounts, in
                // no particular order.
                let batch: Vec<UsageEvent> = held
                    .iter()
                    .rev()
                    .take(3)
                    .enumerate()
                    .map(|(n, grant)| UsageEvent {
                        request_id: RequestId::from_parts(task, round * 10 + n as u64),
                        account_id: grant.account_id,
                        source: if n == 1 {
                            UsageSource::Overage
                        } else {
                            UsageSource::Leased {
                                lease_id: grant.lease_id,
                                fencing_token: grant.fencing_token,
                            }
                        },
                        units: CostUnits(1),
                        at: now,
                        policy_revision: PolicyRevision(1),
                        key_id: None,
                    })
                    .collect();
                let outcomes = worker.ingest(&batch).await.expect("no deadlock in ingest");
                for (event, outcome) in batch.iter().zip(outcomes) {
                    if outcome != IngestOutcome::Accepted {
                        continue;
                    }
                    match event.source.lease_id() {
                        Some(lease) => *answers.used.entry(lease).or_default() += 1,
                        None => *answers.overage.entry(event.account_id).or_default() += 1,
                    }
                }
                if held.len() > 2 {
                    let grant = held.remove(0);
                    let outcome = if round % 2 == 0 {
                        worker
                            .release(grant.lease_id, grant.fencing_token, CostUnits::ZERO, now)
                            .await
                            .map(|released| {
                                answers.settled.push((
                                    grant.lease_id,
                                    released.credited.get(),
                                    false,
                                ));
                            })
                    } else {
                        worker
                            .consolidate(
                                grant.lease_id,
                                grant.fencing_token,
                                CostUnits::ZERO,
                                CostUnits(20),
                                CostUnits(5),
                                secs(5),
                                now,
                            )
                            .await
                            .map(|allocation| {
                                // The old lease is settled with the zero
                                // units claimed.
                                answers.settled.push((grant.lease_id, 0, false));
                                let new = allocation.grant;
                                answers
                                    .granted
                                    .insert(new.lease_id, (new.account_id, new.units.get()));
                                held.push(new);
                            })
                    };
                    assert!(
                        !matches!(outcome, Err(AllocateError::Storage(_))),
                        "{outcome:?}"
                    );
                }
                let reclaimed = worker
                    .reclaim_expired_batch(now, 5)
                    .await
                    .expect("no deadlock in reclaim");
                for lease in reclaimed.reclaimed {
                    answers
                        .settled
                        .push((lease.lease_id, lease.credited.get(), true));
                }
            }
            answers
        }));
    }
    let mut answers = Answers::default();
    for task in tasks {
        answers.merge(task.await.unwrap());
    }
    audited(&store).await;
    // The audit checks the store by its own rows; these check it by what
    // it answered.
    answers.check(&store, &accounts, INITIAL).await;
}
