//! The instance-runtime configuration the end-to-end tests share.

use std::time::Duration;

use jiff::SignedDuration;
use tollgate::admission::SnapshotMapConfig;
use tollgate::runtime::{
    AccountLeaseConfig, InstanceRuntimeConfig, PrincipalSelection, SnapshotManagerConfig,
    UsageWriterConfig,
};
use tollgate::{CostUnits, LocalSharding};

/// How long every lease lives.
pub(crate) const LEASE_TTL: SignedDuration = SignedDuration::from_secs(60);

/// How fast the background planes tick.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pace {
    /// For tests under tokio's paused clock: round numbers, easy to step.
    Paused,
    /// For tests against a real server in real time: short waits, so they
    /// finish in about a second.
    RealTime,
}

pub(crate) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// One account's worth of everything a runtime needs, at `pace`.
pub(crate) fn config(pace: Pace) -> InstanceRuntimeConfig {
    // (snapshot retry, lease poll, usage flush, usage retry, supervisor, restart)
    let (snapshot_retry, poll, flush, usage_retry, supervisor, restart) = match pace {
        Pace::Paused => (200, 100, 50, 50, 100, 200),
        Pace::RealTime => (20, 20, 10, 20, 20, 50),
    };
    InstanceRuntimeConfig {
        snapshot_map: SnapshotMapConfig {
            max_staleness: SignedDuration::from_secs(30),
            negative_capacity: 64,
            history_depth: 2,
            lookup_queue_capacity: 64,
        },
        snapshots: SnapshotManagerConfig {
            principals: PrincipalSelection::All { page_size: 100 },
            refresh_interval: ms(1_000),
            retry_backoff: ms(snapshot_retry),
            fetch_timeout: ms(500),
            enumeration_timeout: ms(500),
            max_staleness: SignedDuration::from_secs(30),
        },
        leases: AccountLeaseConfig {
            target_grant: CostUnits(500),
            low_water: CostUnits(100),
            lease_ttl: LEASE_TTL,
            expiry_safety_margin: SignedDuration::from_secs(5),
            poll_interval: ms(poll),
            store_call_timeout: ms(200),
            shutdown_release_deadline: ms(1_000),
        },
        sharding: LocalSharding::shards(2).expect("two shards are within the limit"),
        usage: UsageWriterConfig {
            queue_capacity: 4_096,
            queue_stripes: LocalSharding::shards(2).expect("two stripes are within the limit"),
            max_batch: 256,
            flush_interval: ms(flush),
            retry_backoff: ms(usage_retry),
            ingest_timeout: ms(200),
            shutdown_drain_deadline: ms(1_000),
        },
        reclaimer: None,
        supervisor_interval: ms(supervisor),
        account_linger: ms(10_000),
        manager_restart_backoff: ms(restart),
        shutdown_deadline: ms(3_000),
    }
}

/// A memory store holding one Strict account of `balance` units with one
/// all-permission key, and a ready runtime over it, in real time.
pub(crate) struct RealTimeWorld {
    pub(crate) clock: std::sync::Arc<tollgate::store::SystemClock>,
    pub(crate) store: std::sync::Arc<tollgate::store::MemoryStore>,
    pub(crate) account: tollgate::AccountId,
    /// The key's plaintext, as a caller presents it.
    pub(crate) key: String,
    pub(crate) runtime: tollgate::runtime::InstanceRuntime,
    pub(crate) handle: tollgate::runtime::RuntimeHandle,
}

/// Starts a [`RealTimeWorld`] and waits (at most three seconds) until its
/// runtime is ready.
pub(crate) async fn start_real_time(balance: u64) -> RealTimeWorld {
    use std::sync::Arc;

    use tollgate::runtime::InstanceRuntime;
    use tollgate::store::{AccountSpec, Clock, GrantPolicy, MemoryStore, SystemClock, TailSharing};
    use tollgate::{AccountStatus, EnforcementMode, PermissionBits};

    let clock = Arc::new(SystemClock);
    let now = clock.now();
    let store = Arc::new(
        MemoryStore::new(GrantPolicy {
            max_ttl: LEASE_TTL,
            reclaim_grace: SignedDuration::from_secs(10),
            tail: TailSharing {
                instances: 1,
                min_grant: CostUnits(1),
            },
        })
        .expect("the test grant policy is valid"),
    );
    let account = store
        .create_account(
            AccountSpec {
                balance: CostUnits(balance),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            now,
        )
        .expect("a fresh store opens accounts");
    let key = store
        .issue_key(account, PermissionBits::ALL, now)
        .expect("the account exists")
        .key
        .expose()
        .to_owned();
    let (runtime, handle) = InstanceRuntime::spawn(
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        Arc::clone(&clock) as Arc<dyn Clock>,
        config(Pace::RealTime),
    )
    .expect("the test configuration is valid");
    for _ in 0..300 {
        if handle.readiness() {
            break;
        }
        tokio::time::sleep(ms(10)).await;
    }
    assert!(handle.readiness(), "the runtime loads within three seconds");
    RealTimeWorld {
        clock,
        store,
        account,
        key,
        runtime,
        handle,
    }
}
