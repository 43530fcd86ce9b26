//! The stores the store-generic suites run against, behind one trait, and the
//! macro that instantiates a generic suite once per store.

use async_trait::async_trait;
use jiff::Timestamp;
use tollgate::store::{
    AccountSpec, AccountView, AdminError, GrantPolicy, IssuedKey, KeyInfo, LeaseAllocator,
    LedgerViolation, MemoryStore, RefillSchedule, SnapshotSource, StoreError, UsageSink,
};
use tollgate::{
    AccountId, AccountStatus, CostUnits, EnforcementMode, KeyId, PermissionBits, UsageEvent,
};

/// A store the generic suites can drive: the three traits the runtime calls,
/// plus the operator operations the tests use to set a store up and inspect
/// it. Every operation answers as [`MemoryStore`]'s inherent method of the
/// same name does; an implementation adapts its store's own signatures
/// (extra arguments, richer results) to these.
#[async_trait]
pub(crate) trait TestStore:
    LeaseAllocator + UsageSink + SnapshotSource + Sized + Send + Sync + 'static
{
    /// A fresh, empty store following `policy`, or `None` when this kind of
    /// store is unavailable here, in which case the test passes without
    /// running (the implementation says why on stderr).
    async fn fresh(policy: GrantPolicy) -> Option<Self>;

    async fn create_account(
        &self,
        spec: AccountSpec,
        now: Timestamp,
    ) -> Result<AccountId, AdminError>;

    /// Returns the new balance.
    async fn top_up(
        &self,
        account: AccountId,
        units: CostUnits,
        now: Timestamp,
    ) -> Result<CostUnits, AdminError>;

    async fn set_status(
        &self,
        account: AccountId,
        status: AccountStatus,
        now: Timestamp,
    ) -> Result<(), AdminError>;

    async fn set_mode(
        &self,
        account: AccountId,
        mode: EnforcementMode,
        now: Timestamp,
    ) -> Result<(), AdminError>;

    async fn configure_refill(
        &self,
        account: AccountId,
        refill: Option<RefillSchedule>,
        now: Timestamp,
    ) -> Result<(), AdminError>;

    async fn issue_key(
        &self,
        account: AccountId,
        permissions: PermissionBits,
        now: Timestamp,
    ) -> Result<IssuedKey, AdminError>;

    async fn revoke_key(&self, key_id: KeyId, now: Timestamp) -> Result<(), AdminError>;

    /// Oldest first.
    async fn list_keys(&self, account: AccountId) -> Result<Vec<KeyInfo>, AdminError>;

    /// As of `now`: a refill period that ended is applied.
    async fn account(&self, account: AccountId, now: Timestamp) -> Result<AccountView, AdminError>;

    /// Every usage event recorded for the account, in the order they arrived.
    async fn usage(&self, account: AccountId) -> Result<Vec<UsageEvent>, AdminError>;

    /// Every violation of I14 and I15 in the whole store; empty when the
    /// books balance.
    async fn audit(&self) -> Result<Vec<LedgerViolation>, StoreError>;
}

#[async_trait]
impl TestStore for MemoryStore {
    async fn fresh(policy: GrantPolicy) -> Option<Self> {
        Some(MemoryStore::new(policy).expect("test policies are valid"))
    }

    async fn create_account(
        &self,
        spec: AccountSpec,
        now: Timestamp,
    ) -> Result<AccountId, AdminError> {
        MemoryStore::create_account(self, spec, now)
    }

    async fn top_up(
        &self,
        account: AccountId,
        units: CostUnits,
        now: Timestamp,
    ) -> Result<CostUnits, AdminError> {
        MemoryStore::top_up(self, account, units, now)
    }

    async fn set_status(
        &self,
        account: AccountId,
        status: AccountStatus,
        _now: Timestamp,
    ) -> Result<(), AdminError> {
        MemoryStore::set_status(self, account, status)
    }

    async fn set_mode(
        &self,
        account: AccountId,
        mode: EnforcementMode,
        _now: Timestamp,
    ) -> Result<(), AdminError> {
        MemoryStore::set_mode(self, account, mode)
    }

    async fn configure_refill(
        &self,
        account: AccountId,
        refill: Option<RefillSchedule>,
        now: Timestamp,
    ) -> Result<(), AdminError> {
        MemoryStore::configure_refill(self, account, refill, now)
    }

    async fn issue_key(
        &self,
        account: AccountId,
        permissions: PermissionBits,
        now: Timestamp,
    ) -> Result<IssuedKey, AdminError> {
        MemoryStore::issue_key(self, account, permissions, now)
    }

    async fn revoke_key(&self, key_id: KeyId, now: Timestamp) -> Result<(), AdminError> {
        MemoryStore::revoke_key(self, key_id, now)
    }

    async fn list_keys(&self, account: AccountId) -> Result<Vec<KeyInfo>, AdminError> {
        MemoryStore::list_keys(self, account)
    }

    async fn account(&self, account: AccountId, now: Timestamp) -> Result<AccountView, AdminError> {
        MemoryStore::account(self, account, now)
    }

    async fn usage(&self, account: AccountId) -> Result<Vec<UsageEvent>, AdminError> {
        MemoryStore::usage(self, account)
    }

    async fn audit(&self) -> Result<Vec<LedgerViolation>, StoreError> {
        MemoryStore::audit(self)
    }
}

/// Instantiates store-generic tests once per store: for each store a module
/// named after it, holding one test per generic test function, which runs
/// that function with the store's type.
///
/// ```ignore
/// store_tests! {
///     stores {
///         memory: MemoryStore,
///         #[cfg(feature = "postgres")]
///         postgres: PostgresStore,
///     }
///     tests {
///         #[tokio::test] { a_test, another_test }
///         #[tokio::test(flavor = "multi_thread", worker_threads = 4)] { a_racy_test }
///     }
/// }
/// ```
///
/// makes `memory::a_test`, `postgres::a_test` and so on, where `a_test` is
/// an `async fn a_test<S: TestStore>()` in the calling module. Each store is a
/// type name in scope there; the attributes before it (a `cfg`, say) go on its
/// module. Each group of tests carries the attribute its tests run under.
#[allow(
    unused_macros,
    reason = "each test crate uses only part of the support code"
)]
macro_rules! store_tests {
    (
        stores { $($(#[$store_attr:meta])* $store:ident: $ty:ident),+ $(,)? }
        tests $tests:tt
    ) => {
        $(
            $crate::support::stores::store_tests!(
                @store [$(#[$store_attr])*] $store, $ty, $tests
            );
        )+
    };
    (
        @store [$($store_attr:tt)*] $store:ident, $ty:ident,
        { $(#[$attr:meta] { $($test:ident),* $(,)? })* }
    ) => {
        $($store_attr)*
        mod $store {
            $($(
                #[$attr]
                async fn $test() {
                    super::$test::<super::$ty>().await;
                }
            )*)*
        }
    };
}

#[allow(
    unused_imports,
    reason = "each test crate uses only part of the support code"
)]
pub(crate) use store_tests;

#[cfg(feature = "postgres")]
mod postgres {
    use std::sync::atomic::{AtomicU64, Ordering};

    use async_trait::async_trait;
    use jiff::Timestamp;
    use tollgate::store::{
        AccountSpec, AccountView, AdminError, GrantPolicy, IssuedKey, KeyInfo, LedgerViolation,
        Movement, PostgresConfig, PostgresStore, RefillSchedule, StoreError,
    };
    use tollgate::{
        AccountId, AccountStatus, CostUnits, EnforcementMode, KeyId, PermissionBits, UsageEvent,
    };

    use super::TestStore;
    use crate::support::postgres::{database_url, unique_schema};

    /// Each top-up through the generic interface is its own movement.
    static TOP_UPS: AtomicU64 = AtomicU64::new(0);

    #[async_trait]
    impl TestStore for PostgresStore {
        async fn fresh(policy: GrantPolicy) -> Option<Self> {
            let url = database_url("store-generic suite (PostgreSQL)")?;
            let store = PostgresStore::connect(
                &url,
                PostgresConfig {
                    schema: unique_schema("generic"),
                    policy,
                    lock_timeout: std::time::Duration::from_secs(5),
                    queue_timeout: std::time::Duration::from_secs(5),
                },
            )
            .await
            .expect("the test server accepts connections");
            store.migrate().await.expect("a fresh schema migrates");
            Some(store)
        }

        async fn create_account(
            &self,
            spec: AccountSpec,
            now: Timestamp,
        ) -> Result<AccountId, AdminError> {
            PostgresStore::create_account(self, spec, now).await
        }

        async fn top_up(
            &self,
            account: AccountId,
            units: CostUnits,
            now: Timestamp,
        ) -> Result<CostUnits, AdminError> {
            let key = format!("generic-{}", TOP_UPS.fetch_add(1, Ordering::Relaxed));
            let movement = Movement {
                idempotency_key: &key,
                reason: "store-generic suite",
            };
            PostgresStore::top_up(self, account, units, &movement, now)
                .await
                .map(|change| change.balance)
        }

        async fn set_status(
            &self,
            account: AccountId,
            status: AccountStatus,
            _now: Timestamp,
        ) -> Result<(), AdminError> {
            PostgresStore::set_status(self, account, status).await
        }

        async fn set_mode(
            &self,
            account: AccountId,
            mode: EnforcementMode,
            _now: Timestamp,
        ) -> Result<(), AdminError> {
            PostgresStore::set_mode(self, account, mode).await
        }

        async fn configure_refill(
            &self,
            account: AccountId,
            refill: Option<RefillSchedule>,
            now: Timestamp,
        ) -> Result<(), AdminError> {
            PostgresStore::configure_refill(self, account, refill, now).await
        }

        async fn issue_key(
            &self,
            account: AccountId,
            permissions: PermissionBits,
            now: Timestamp,
        ) -> Result<IssuedKey, AdminError> {
            PostgresStore::issue_key(self, account, permissions, now).await
        }

        async fn revoke_key(&self, key_id: KeyId, now: Timestamp) -> Result<(), AdminError> {
            PostgresStore::revoke_key(self, key_id, now).await
        }

        async fn list_keys(&self, account: AccountId) -> Result<Vec<KeyInfo>, AdminError> {
            PostgresStore::list_keys(self, account).await
        }

        async fn account(
            &self,
            account: AccountId,
            now: Timestamp,
        ) -> Result<AccountView, AdminError> {
            PostgresStore::account(self, account, now).await
        }

        async fn usage(&self, account: AccountId) -> Result<Vec<UsageEvent>, AdminError> {
            PostgresStore::usage(self, account, None, None).await
        }

        async fn audit(&self) -> Result<Vec<LedgerViolation>, StoreError> {
            PostgresStore::audit(self).await
        }
    }
}
