//! A metered API on the embedded store: `cargo run --example gateway`.
//!
//! Two demo accounts — one Strict, one Elastic with an overage cap — get a
//! key each, printed at start with ready-to-paste `curl` lines. The routes
//! are priced: a cheap read, an expensive write that needs the write
//! permission, and a slow route behind a concurrency limit. `/admin/accounts`
//! shows the money move; `/livez`, `/readyz` and `/metrics` are the ops
//! endpoints. Ctrl-C shuts down in order (stop admitting, drain usage,
//! return leases) and prints what happened.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{Method, request::Parts};
use axum::routing::{get, post};
use clap::Parser;
use jiff::SignedDuration;
use metrics_exporter_prometheus::PrometheusBuilder;
use tollgate::admission::SnapshotMapConfig;
use tollgate::layer::{Admitted, Price, TollgateLayer, ops_router};
use tollgate::runtime::{
    AccountLeaseConfig, InstanceRuntime, InstanceRuntimeConfig, PrincipalSelection,
    ReclaimerConfig, SnapshotManagerConfig, UsageWriterConfig,
};
use tollgate::store::{AccountSpec, Clock, CoarseClock, GrantPolicy, MemoryStore, TailSharing};
use tollgate::{
    AccountId, AccountStatus, CostUnits, EnforcementMode, LocalSharding, PermissionBits,
};
use tower::limit::GlobalConcurrencyLimitLayer;

/// The permission a key needs to read.
const READ: PermissionBits = PermissionBits::bit(0);
/// The permission a key needs to write.
const WRITE: PermissionBits = PermissionBits::bit(1);

#[derive(Debug, Parser)]
#[command(about = "A metered API on tollgate's embedded store")]
struct Args {
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// The starting balance of both demo accounts, in cost units.
    #[arg(long, default_value_t = 1_000)]
    balance: u64,
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Every setting stated, as tollgate requires; these suit a demo on one
/// machine.
fn runtime_config() -> InstanceRuntimeConfig {
    InstanceRuntimeConfig {
        snapshot_map: SnapshotMapConfig {
            max_staleness: SignedDuration::from_secs(30),
            negative_capacity: 1_024,
            history_depth: 4,
            lookup_queue_capacity: 256,
        },
        snapshots: SnapshotManagerConfig {
            principals: PrincipalSelection::All { page_size: 500 },
            refresh_interval: ms(1_000),
            retry_backoff: ms(500),
            fetch_timeout: ms(1_000),
            enumeration_timeout: ms(1_000),
            max_staleness: SignedDuration::from_secs(30),
        },
        leases: AccountLeaseConfig {
            target_grant: CostUnits(100),
            low_water: CostUnits(20),
            lease_ttl: SignedDuration::from_secs(30),
            expiry_safety_margin: SignedDuration::from_secs(5),
            poll_interval: ms(500),
            store_call_timeout: ms(1_000),
            shutdown_release_deadline: ms(2_000),
        },
        sharding: LocalSharding::per_core(),
        usage: UsageWriterConfig {
            queue_capacity: 8_192,
            max_batch: 256,
            flush_interval: ms(200),
            retry_backoff: ms(200),
            ingest_timeout: ms(1_000),
            shutdown_drain_deadline: ms(2_000),
        },
        reclaimer: Some(ReclaimerConfig {
            interval: ms(5_000),
            batch_limit: 100,
            store_call_timeout: ms(1_000),
        }),
        supervisor_interval: ms(500),
        account_linger: ms(60_000),
        manager_restart_backoff: ms(1_000),
        shutdown_deadline: ms(5_000),
    }
}

/// What each route costs and needs.
fn price(parts: &Parts) -> Price {
    let (units, required) = match (&parts.method, parts.uri.path()) {
        (&Method::GET, "/v1/read") => (1, READ),
        (&Method::POST, "/v1/write") => (10, WRITE),
        (&Method::GET, "/v1/slow") => (5, READ),
        // Anything else costs nothing but still needs a valid key.
        _ => (0, PermissionBits::NONE),
    };
    Price {
        units: CostUnits(units),
        required,
    }
}

async fn read(admitted: Admitted) -> String {
    format!(
        "read ok: charged {} to {} (request {})\n",
        admitted.units, admitted.account_id, admitted.request_id
    )
}

async fn write(admitted: Admitted) -> String {
    format!("write ok: charged {}\n", admitted.units)
}

async fn slow(admitted: Admitted) -> String {
    tokio::time::sleep(Duration::from_secs(2)).await;
    format!("slow ok: charged {}\n", admitted.units)
}

#[derive(Clone)]
struct Demo {
    store: Arc<MemoryStore>,
    clock: Arc<dyn Clock>,
    accounts: [(AccountId, &'static str); 2],
}

/// Balance, leased units and billed usage of each demo account.
async fn accounts(State(demo): State<Demo>) -> String {
    let mut out = String::new();
    for (account, label) in demo.accounts {
        let Ok(view) = demo.store.account(account, demo.clock.now()) else {
            continue;
        };
        let billed: u64 = demo
            .store
            .usage(account)
            .map_or(0, |events| events.iter().map(|e| e.units.get()).sum());
        let _ = writeln!(
            out,
            "{label} {account}: balance {} · leased {} · billed {billed} units · overage debt {}",
            view.balance.get(),
            view.leased.get(),
            view.overage_debt.get()
        );
    }
    out
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    // The request path reads time with one atomic load; the ticker keeps it
    // within two milliseconds, far inside the leases' safety margin.
    let clock: Arc<dyn Clock> = Arc::new(CoarseClock::start(Duration::from_millis(1))?);
    let store = Arc::new(MemoryStore::new(GrantPolicy {
        max_ttl: SignedDuration::from_secs(60),
        reclaim_grace: SignedDuration::from_secs(10),
        tail: TailSharing {
            instances: 2,
            min_grant: CostUnits(10),
        },
    })?);
    let now = clock.now();
    let open = |mode| AccountSpec {
        balance: CostUnits(args.balance),
        mode,
        status: AccountStatus::Active,
        refill: None,
    };
    let strict = store.create_account(open(EnforcementMode::Strict), now)?;
    let elastic = store.create_account(
        open(EnforcementMode::Elastic {
            overage_cap: CostUnits(50),
        }),
        now,
    )?;
    let strict_key = store.issue_key(strict, READ.union(WRITE), now)?;
    let elastic_key = store.issue_key(elastic, READ, now)?;

    let prometheus = PrometheusBuilder::new().install_recorder()?;
    let (runtime, handle) = InstanceRuntime::spawn(
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        Arc::clone(&clock),
        runtime_config(),
    )?;
    let tollgate = TollgateLayer::builder(handle.clone())
        .price(price)
        .build()?;

    let demo = Demo {
        store: Arc::clone(&store),
        clock: Arc::clone(&clock),
        accounts: [(strict, "strict "), (elastic, "elastic")],
    };
    let metered = Router::new()
        .route("/v1/read", get(read))
        .route("/v1/write", post(write))
        .route("/v1/slow", get(slow))
        .layer(tollgate)
        // Outside tollgate: a request waiting here is not admitted yet, so
        // one abandoned while it waits costs nothing. Global, because axum
        // applies a layer to each route separately and a per-route limit
        // would not make requests wait for one another.
        .layer(GlobalConcurrencyLimitLayer::new(1));
    let app = Router::new()
        .merge(metered)
        .route("/admin/accounts", get(accounts).with_state(demo))
        .merge(ops_router(handle.clone(), move || prometheus.render()));

    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let bound = listener.local_addr()?;
    println!("tollgate demo gateway on http://{bound}\n");
    for (label, key, write_too) in [
        (
            "Strict account (reads and writes; never spends past its balance)",
            &strict_key,
            true,
        ),
        (
            "Elastic account (reads; may run 50 units into overage)",
            &elastic_key,
            false,
        ),
    ] {
        let key = key.key.expose();
        println!("{label}\n  key: {key}");
        println!("  curl -i -H 'Authorization: Bearer {key}' http://{bound}/v1/read");
        if write_too {
            println!("  curl -i -X POST -H 'Authorization: Bearer {key}' http://{bound}/v1/write");
        }
        println!("  curl -i -H 'x-api-key: {key}' http://{bound}/v1/slow\n");
    }
    println!("Watch the money: curl http://{bound}/admin/accounts");
    println!("Ops: http://{bound}/livez  http://{bound}/readyz  http://{bound}/metrics\n");

    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;

    let report = runtime.shutdown().await;
    println!(
        "shut down in {:?}: {} usage events lost, {} leases returned, {} abandoned to reclaim",
        report.elapsed,
        report.lost_events(),
        report.released(),
        report.abandoned()
    );
    let demo_now = clock.now();
    for (account, label) in [(strict, "strict"), (elastic, "elastic")] {
        let view = store.account(account, demo_now)?;
        println!(
            "{label} {account}: balance {} · leased {}",
            view.balance.get(),
            view.leased.get()
        );
    }
    Ok(())
}
