//! tollgate around a plain hyper 1.x service, no axum:
//! `cargo run --example hyper_service`.
//!
//! One account, one key (printed at start), every request priced at one
//! unit. The layer wraps a `tower::service_fn`, and hyper serves it through
//! `hyper_util`'s tower adapter.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use jiff::SignedDuration;
use tollgate::admission::SnapshotMapConfig;
use tollgate::layer::{Admitted, Price, TollgateLayer};
use tollgate::runtime::{
    AccountLeaseConfig, InstanceRuntime, InstanceRuntimeConfig, PrincipalSelection,
    SnapshotManagerConfig, UsageWriterConfig,
};
use tollgate::store::{AccountSpec, Clock, CoarseClock, GrantPolicy, MemoryStore, TailSharing};
use tollgate::{AccountStatus, CostUnits, EnforcementMode, LocalSharding, PermissionBits};
use tower::{Layer, service_fn};

/// How long a client has to send a request's headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Parser)]
#[command(about = "tollgate around a plain hyper service")]
struct Args {
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1:3001")]
    listen: SocketAddr,
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn config() -> InstanceRuntimeConfig {
    InstanceRuntimeConfig {
        snapshot_map: SnapshotMapConfig {
            max_staleness: SignedDuration::from_secs(30),
            negative_capacity: 256,
            history_depth: 2,
            lookup_queue_capacity: 64,
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
            queue_capacity: 4_096,
            queue_stripes: LocalSharding::per_core(),
            max_batch: 256,
            flush_interval: ms(200),
            retry_backoff: ms(200),
            ingest_timeout: ms(1_000),
            shutdown_drain_deadline: ms(2_000),
        },
        reclaimer: None,
        supervisor_interval: ms(500),
        account_linger: ms(60_000),
        manager_restart_backoff: ms(1_000),
        shutdown_deadline: ms(5_000),
    }
}

/// The service being metered: it answers with what it was charged.
async fn hello(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let charged = request
        .extensions()
        .get::<Admitted>()
        .map_or(0, |admitted| admitted.units.get());
    Ok(Response::new(Full::new(Bytes::from(format!(
        "hello; charged {charged} unit(s)\n"
    )))))
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
            instances: 1,
            min_grant: CostUnits(10),
        },
    })?);
    let account = store.create_account(
        AccountSpec {
            balance: CostUnits(100),
            mode: EnforcementMode::Strict,
            status: AccountStatus::Active,
            refill: None,
        },
        clock.now(),
    )?;
    let key = store.issue_key(account, PermissionBits::ALL, clock.now())?;
    // The port is taken before the runtime starts, so a port in use stops
    // the program before anything is acquired.
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|error| format!("--listen {}: {error}", args.listen))?;
    let bound = listener.local_addr()?;
    let (runtime, handle) = InstanceRuntime::spawn(
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        Arc::clone(&clock),
        config(),
    )?;
    let layer = TollgateLayer::builder(handle)
        .price(|_: &http::request::Parts| Price {
            units: CostUnits(1),
            required: PermissionBits::NONE,
        })
        .build()?;
    let service = layer.layer(service_fn(hello));

    println!("metered hyper service on http://{bound}");
    println!(
        "  curl -i -H 'Authorization: Bearer {}' http://{bound}/",
        key.key.expose()
    );
    // The listener lives in the serving loop, so the port closes with it:
    // connections made during the shutdown are refused, not left waiting.
    let serve = async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                // Out of file descriptors, say: retrying at once would spin.
                Err(error) => {
                    eprintln!("accept failed: {error}; retrying in a second");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    continue;
                }
            };
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                // hyper times out a client that never finishes its headers
                // only when it has a timer; without one, stalled
                // connections would pile up until file descriptors ran out.
                let _ = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_READ_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    };
    tokio::select! {
        () = serve => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    let report = runtime.shutdown().await;
    println!(
        "shut down: {} usage events lost, {} leases returned; balance now {}",
        report.lost_events(),
        report.released(),
        store.account(account, clock.now())?.balance.get()
    );
    Ok(())
}
