//! A metered API on the embedded store: `cargo run --example gateway`.
//!
//! Two demo accounts — one Strict, one Elastic with an overage cap — get a
//! key each, printed at start with ready-to-paste `curl` lines. The routes
//! are priced: a cheap read, an expensive write that needs the write
//! permission, and a slow route behind a concurrency limit, where a request
//! admitted and waiting its turn pays nothing if its client leaves (eight
//! at a time in all, one running and seven waiting; more are turned away
//! at once, unpaid). A second
//! listener, for operators only, serves `/admin/accounts`, which shows the
//! money move, and the ops endpoints `/livez`, `/readyz` and `/metrics`.
//! Ctrl-C shuts down in order (stop admitting, drain usage, return leases)
//! and prints what happened.
//!
//! With `--store postgres://…` (build with `--features postgres`) the
//! gateway uses a shared PostgreSQL store instead, so several gateway
//! processes can serve the same accounts; accounts and keys then come from
//! the `tollgate` operator command, and `--migrate` creates the schema.
#![allow(
    clippy::doc_markdown,
    reason = "the argument docs are the --help text, read without markdown"
)]

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::error_handling::HandleErrorLayer;
use axum::extract::State;
use axum::http::{Method, StatusCode, request::Parts};
use axum::routing::{get, post};
use clap::Parser;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use jiff::SignedDuration;
use metrics_exporter_prometheus::PrometheusBuilder;
use tokio_util::sync::CancellationToken;
use tollgate::admission::SnapshotMapConfig;
use tollgate::layer::{Admitted, CommitMarkerLayer, Price, TollgateLayer, ops_router};
use tollgate::runtime::{
    AccountLeaseConfig, InstanceRuntime, InstanceRuntimeConfig, PrincipalSelection,
    ReclaimerConfig, SnapshotManagerConfig, UsageWriterConfig,
};
use tollgate::store::{AccountSpec, Clock, CoarseClock, GrantPolicy, MemoryStore, TailSharing};
use tollgate::{
    AccountId, AccountStatus, CostUnits, EnforcementMode, LocalSharding, PermissionBits,
};
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::load_shed::LoadShedLayer;
use tower::{BoxError, ServiceBuilder};

/// The permission a key needs to read.
const READ: PermissionBits = PermissionBits::bit(0);
/// The permission a key needs to write.
const WRITE: PermissionBits = PermissionBits::bit(1);

/// How long open connections get to finish once a stop is asked for,
/// before the runtime shuts down without them.
const HTTP_DRAIN: Duration = Duration::from_secs(5);

/// How long a client gets to send a request's headers, on a new connection
/// or between two requests on one that is kept alive.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Parser)]
#[command(about = "A metered API on tollgate's embedded store, or on a shared PostgreSQL store")]
struct Args {
    /// The address the metered API listens on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// The address of the operators' listener: /livez, /readyz, /metrics
    /// and /admin/accounts. Every account's balance is visible there, so it
    /// never shares the API's listener; keep it off the public network.
    #[arg(long, default_value = "127.0.0.1:9000")]
    ops_listen: SocketAddr,
    /// The starting balance of both demo accounts, in cost units [embedded
    /// store only; default 1000].
    #[arg(long)]
    balance: Option<u64>,
    /// `memory` for the embedded store with two demo accounts, or a
    /// `postgres://` URL for a store shared by several gateways.
    #[arg(long, default_value = "memory")]
    store: String,
    /// With a PostgreSQL store: create or upgrade the schema first.
    #[arg(long)]
    migrate: bool,
    /// With a PostgreSQL store: the schema tollgate's tables live in
    /// [default: tollgate].
    #[arg(long)]
    schema: Option<String>,
}

impl Args {
    /// Refuses flags that mean nothing for the chosen store, rather than
    /// let them be ignored.
    fn check(&self) -> Result<(), String> {
        let embedded = self.store == "memory";
        if embedded && (self.migrate || self.schema.is_some()) {
            return Err(
                "--migrate and --schema apply to a PostgreSQL store, not --store memory".into(),
            );
        }
        if !embedded && self.balance.is_some() {
            return Err(
                "--balance seeds the embedded store's demo accounts; on a PostgreSQL \
                        store create accounts with `tollgate account create`"
                    .into(),
            );
        }
        Ok(())
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// How grants are sized and how long they live, for `instances` gateways
/// sharing an account's tail. On a shared store every gateway and the
/// operator command's `reclaim` must agree on it.
fn grant_policy(instances: u64) -> GrantPolicy {
    GrantPolicy {
        max_ttl: SignedDuration::from_secs(60),
        reclaim_grace: SignedDuration::from_secs(10),
        tail: TailSharing {
            instances,
            min_grant: CostUnits(10),
        },
    }
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
            queue_stripes: LocalSharding::per_core(),
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
            // The writers' backlog after an outage drains within seconds.
            outage_hold: ms(30_000),
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
        // HEAD runs the GET handler, so it is priced as one.
        (&Method::GET | &Method::HEAD, "/v1/read") => (1, READ),
        (&Method::POST, "/v1/write") => (10, WRITE),
        (&Method::GET | &Method::HEAD, "/v1/slow") => (5, READ),
        // No handler runs for anything else (a 404 or a 405), so no commit
        // point is reached and the reservation is released for zero.
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

/// Requests that may be in `/v1/slow` at once, running or waiting: at two
/// seconds each, the last waits well within a lease's window.
const SLOW_AT_ONCE: usize = 8;

async fn slow(admitted: Admitted) -> String {
    tokio::time::sleep(Duration::from_secs(2)).await;
    format!("slow ok: charged {}\n", admitted.units)
}

/// Where the accounts live.
#[derive(Clone)]
enum Backend {
    Memory(Arc<MemoryStore>),
    #[cfg(feature = "postgres")]
    Postgres(Arc<tollgate::store::PostgresStore>),
}

impl Backend {
    async fn open(args: &Args) -> Result<Self, Box<dyn std::error::Error>> {
        if args.store == "memory" {
            return Ok(Self::Memory(Arc::new(MemoryStore::new(grant_policy(1))?)));
        }
        if !args.store.starts_with("postgres://") && !args.store.starts_with("postgresql://") {
            // A URL is named by its scheme only: a mistyped one may carry a
            // password.
            let given = match args.store.split_once(':') {
                Some((scheme, _)) => format!("a {scheme}: URL"),
                None => format!("{:?}", args.store),
            };
            return Err(format!("--store takes `memory` or a postgres:// URL, not {given}").into());
        }
        Self::postgres(args).await
    }

    #[cfg(feature = "postgres")]
    async fn postgres(args: &Args) -> Result<Self, Box<dyn std::error::Error>> {
        use tollgate::store::{PostgresConfig, PostgresStore, SchemaStatus};
        let store = PostgresStore::connect(
            &args.store,
            PostgresConfig {
                schema: args.schema.clone().unwrap_or_else(|| "tollgate".to_owned()),
                // Up to three gateways share a database in the README's
                // walk-through.
                policy: grant_policy(3),
                // A call that waited its longest for a turn and then for
                // its rows (a release or a fold locks two, one after the
                // other) still answers within the runtime's one second for
                // a store call (below): 250 + 2 × 350 ms.
                lock_timeout: ms(350),
                queue_timeout: ms(250),
            },
        )
        .await?;
        if args.migrate {
            store.migrate().await?;
        }
        match store.check_schema().await? {
            SchemaStatus::Current { .. } => Ok(Self::Postgres(Arc::new(store))),
            // Only a schema this build can migrate is worth the hint:
            // migrating refuses one a newer build migrated, or one whose
            // applied migrations were changed.
            status @ (SchemaStatus::Missing | SchemaStatus::Behind { .. }) => Err(format!(
                "schema {schema} is not ready ({status:?}): run with --migrate, or \
                 `tollgate migrate --schema {schema}`",
                schema = store.schema()
            )
            .into()),
            status => Err(format!(
                "schema {schema} is not one this build can serve or migrate ({status:?}): \
                 run the tollgate version that migrated it",
                schema = store.schema()
            )
            .into()),
        }
    }

    #[cfg(not(feature = "postgres"))]
    #[allow(
        clippy::unused_async,
        reason = "the same shape as the PostgreSQL build's"
    )]
    async fn postgres(_: &Args) -> Result<Self, Box<dyn std::error::Error>> {
        Err("this build has no PostgreSQL store: run with `--features postgres`".into())
    }

    fn spawn(
        &self,
        clock: &Arc<dyn Clock>,
    ) -> Result<(InstanceRuntime, tollgate::runtime::RuntimeHandle), Box<dyn std::error::Error>>
    {
        let spawned = match self {
            Self::Memory(store) => InstanceRuntime::spawn(
                Arc::clone(store) as _,
                Arc::clone(store) as _,
                Arc::clone(store) as _,
                Arc::clone(clock),
                runtime_config(),
            ),
            #[cfg(feature = "postgres")]
            Self::Postgres(store) => InstanceRuntime::spawn(
                Arc::clone(store) as _,
                Arc::clone(store) as _,
                Arc::clone(store) as _,
                Arc::clone(clock),
                runtime_config(),
            ),
        };
        Ok(spawned?)
    }

    /// One line per account: balance, leased units, billed usage, debt.
    #[cfg_attr(
        not(feature = "postgres"),
        allow(
            clippy::unused_async,
            reason = "only the PostgreSQL store is asked over the network"
        )
    )]
    async fn report(&self, now: jiff::Timestamp) -> String {
        let mut out = String::new();
        match self {
            Self::Memory(store) => {
                for account in 1.. {
                    let account = AccountId(account);
                    let Ok(view) = store.account(account, now) else {
                        break;
                    };
                    let billed: u64 = store
                        .usage(account)
                        .map_or(0, |events| events.iter().map(|e| e.units.get()).sum());
                    let _ = writeln!(
                        out,
                        "{account} ({}): balance {} · granted to open leases {} · billed {billed} units · overage debt {}",
                        mode_name(view.mode),
                        view.balance.get(),
                        view.leased.get(),
                        view.overage_debt.get()
                    );
                }
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(store) => match store.accounts(now).await {
                Ok(views) => {
                    for view in views {
                        let _ = writeln!(
                            out,
                            "{} ({}): balance {} · granted to open leases {} · overage debt {}",
                            view.id,
                            mode_name(view.mode),
                            view.balance.get(),
                            view.leased.get(),
                            view.overage_debt.get()
                        );
                    }
                }
                Err(error) => {
                    let _ = writeln!(out, "the store did not answer: {error}");
                }
            },
        }
        out
    }
}

fn mode_name(mode: EnforcementMode) -> &'static str {
    match mode {
        EnforcementMode::Strict => "strict",
        EnforcementMode::Elastic { .. } => "elastic",
    }
}

#[derive(Clone)]
struct Demo {
    backend: Backend,
    clock: Arc<dyn Clock>,
}

/// Balance, leased units and billed usage of each account.
async fn accounts(State(demo): State<Demo>) -> String {
    demo.backend.report(demo.clock.now()).await
}

/// A demo account's key, as printed at start.
struct DemoKey {
    label: &'static str,
    key: String,
    write_too: bool,
}

/// Opens the two demo accounts of the embedded store and returns their keys.
fn open_demo_accounts(
    store: &MemoryStore,
    balance: u64,
    now: jiff::Timestamp,
) -> Result<Vec<DemoKey>, Box<dyn std::error::Error>> {
    let open = |mode| AccountSpec {
        balance: CostUnits(balance),
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
    Ok(vec![
        DemoKey {
            label: "Strict account (reads and writes; never spends past its balance)",
            key: strict_key.key.expose().to_owned(),
            write_too: true,
        },
        DemoKey {
            label: "Elastic account (reads; may run 50 units into overage)",
            key: elastic_key.key.expose().to_owned(),
            write_too: false,
        },
    ])
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // Errors are printed for a person to read, not in their debug form.
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("gateway: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    args.check()?;
    // tollgate reports trouble it handles on its own (a store call timed
    // out and retried, a lease abandoned at shutdown, an integrity fault)
    // as `tracing` warnings and errors: print them.
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(std::io::stderr)
        .init();
    // The request path reads time with one atomic load; the ticker keeps it
    // within two milliseconds, far inside the leases' safety margin.
    let clock: Arc<dyn Clock> = Arc::new(CoarseClock::start(Duration::from_millis(1))?);
    let backend = Backend::open(&args).await?;
    let demo_keys = match &backend {
        Backend::Memory(store) => {
            open_demo_accounts(store, args.balance.unwrap_or(1_000), clock.now())?
        }
        #[cfg(feature = "postgres")]
        Backend::Postgres(_) => Vec::new(),
    };

    // Both ports are taken before the runtime starts: a port in use then
    // fails the start with nothing acquired, rather than leave the leases
    // the runtime took at startup to be reclaimed by TTL.
    let listener = bind("--listen", args.listen).await?;
    let bound = listener.local_addr()?;
    let ops_listener = bind("--ops-listen", args.ops_listen).await?;
    let ops_bound = ops_listener.local_addr()?;

    let prometheus = PrometheusBuilder::new().install_recorder()?;
    let (runtime, handle) = backend.spawn(&clock)?;
    // Admission at the outer edge, the commit where each handler starts: a
    // request waiting for the slow route holds its reservation, pays in
    // full once it runs and nothing if its client leaves first, and one
    // without a usable key is refused at once instead of queueing. A
    // request that finds its account's lease missing or drained while the
    // lease manager fetches the next waits a quarter second for it (I36).
    let tollgate = TollgateLayer::builder(handle.clone())
        .price(price)
        .commit_in_handler()
        .wait_for_lease(Duration::from_millis(250))
        .build()?;

    let demo = Demo {
        backend: backend.clone(),
        clock: Arc::clone(&clock),
    };
    // `route_layer` wraps only a matched method's handler, so a 404 or a
    // 405 reaches no commit point. On the slow route the limit sits between
    // tollgate and the commit; later layers are outer. Each request waiting
    // its turn holds a place in the usage queue, which every account
    // shares, so at most `SLOW_AT_ONCE` may be in the route, running or
    // waiting: past that a request is answered 503 at once (its commit
    // point not reached, it pays nothing), and one client cannot fill the
    // queue for everyone.
    let metered = Router::new()
        .route("/v1/read", get(read).route_layer(CommitMarkerLayer::new()))
        .route(
            "/v1/write",
            post(write).route_layer(CommitMarkerLayer::new()),
        )
        .route(
            "/v1/slow",
            get(slow)
                .route_layer(CommitMarkerLayer::new())
                .route_layer(GlobalConcurrencyLimitLayer::new(1))
                .route_layer(
                    ServiceBuilder::new()
                        .layer(HandleErrorLayer::new(|_: BoxError| async {
                            (
                                StatusCode::SERVICE_UNAVAILABLE,
                                "too many requests wait for /v1/slow; try again\n",
                            )
                        }))
                        .layer(LoadShedLayer::new())
                        .layer(GlobalConcurrencyLimitLayer::new(SLOW_AT_ONCE)),
                ),
        )
        .layer(tollgate);
    let ops = Router::new()
        .route("/admin/accounts", get(accounts).with_state(demo))
        .merge(ops_router(handle.clone(), move || prometheus.render()));

    println!("tollgate demo gateway on http://{bound}\n");
    for DemoKey {
        label,
        key,
        write_too,
    } in &demo_keys
    {
        println!("{label}\n  key: {key}");
        println!("  curl -i -H 'Authorization: Bearer {key}' http://{bound}/v1/read");
        if *write_too {
            println!("  curl -i -X POST -H 'Authorization: Bearer {key}' http://{bound}/v1/write");
        }
        println!("  curl -i -H 'x-api-key: {key}' http://{bound}/v1/slow\n");
    }
    if demo_keys.is_empty() {
        println!("Shared store: issue keys with `tollgate key issue <account> --permissions all`,");
        println!("then: curl -i -H 'Authorization: Bearer <key>' http://{bound}/v1/read\n");
    }
    println!("Watch the money: curl http://{ops_bound}/admin/accounts");
    println!(
        "Ops: http://{ops_bound}/livez  http://{ops_bound}/readyz  http://{ops_bound}/metrics\n"
    );

    let served = serve_until_stopped((listener, metered), (ops_listener, ops), &handle).await;

    let report = runtime.shutdown().await;
    println!(
        "shut down in {:?}: {} usage events lost, {} leases returned, {} abandoned to reclaim",
        report.elapsed,
        report.lost_events(),
        report.released(),
        report.abandoned()
    );
    print!("{}", backend.report(clock.now()).await);
    served?;
    Ok(())
}

/// Serves the API and the ops routes until a stop is asked for or a
/// listener fails. A stop closes admission at once (so /readyz turns 503
/// and new requests are refused) and starts no more handlers (a request
/// still queued for the slow route's limit is answered 503 and pays
/// nothing), then gives open connections one bounded drain: the API's
/// first, while the ops listener still answers /readyz, then the ops
/// listener's in what is left of it. A client that never
/// finishes its request cannot hold the shutdown: past the drain it is
/// dropped with the process.
async fn serve_until_stopped(
    (listener, metered): (tokio::net::TcpListener, Router),
    (ops_listener, ops): (tokio::net::TcpListener, Router),
    handle: &tollgate::runtime::RuntimeHandle,
) -> std::io::Result<()> {
    let stop_api = CancellationToken::new();
    let stop_ops = CancellationToken::new();
    let api = serve(listener, metered, stop_api.clone());
    let ops = serve(ops_listener, ops, stop_ops.clone());
    tokio::pin!(api, ops);
    let (mut api_done, mut ops_done) = (None, None);
    tokio::select! {
        served = &mut api => api_done = Some(served),
        served = &mut ops => ops_done = Some(served),
        () = stop_requested() => {}
    }
    // A listener that fails still ends in an orderly shutdown: the usage
    // recorded so far is written and the leases go back before the error is
    // reported.
    if let Some(Err(error)) = api_done.as_ref().or(ops_done.as_ref()) {
        eprintln!("serving stopped: {error}");
    }
    handle.request_shutdown();
    let drained_by = tokio::time::Instant::now() + HTTP_DRAIN;
    stop_api.cancel();
    if api_done.is_none() {
        // The ops listener is driven meanwhile: its accept loop runs only
        // while its future is polled, and a probe of /readyz (503 now) or
        // a scrape of /metrics must be answered during the drain.
        tokio::select! {
            drained = tokio::time::timeout_at(drained_by, &mut api) => api_done = drained.ok(),
            served = &mut ops, if ops_done.is_none() => {
                ops_done = Some(served);
                api_done = tokio::time::timeout_at(drained_by, &mut api).await.ok();
            }
        }
    }
    stop_ops.cancel();
    if ops_done.is_none() {
        ops_done = tokio::time::timeout_at(drained_by, &mut ops).await.ok();
    }
    if api_done.is_none() || ops_done.is_none() {
        eprintln!("connections still open after {HTTP_DRAIN:?}; shutting down without them");
    }
    api_done.unwrap_or(Ok(())).and(ops_done.unwrap_or(Ok(())))
}

/// Serves `app` on `listener` until `stop`, then waits for the open
/// connections to finish their requests in flight; a connection idle
/// between requests is closed at once. What `axum::serve` with a graceful
/// shutdown does, plus a limit on how long a client may take to send a
/// request's headers: hyper enforces one only when it is given a timer, and
/// `axum::serve` gives it none, so connections that never finish a request
/// would otherwise be kept until file descriptors ran out.
async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let connections = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors, say: retrying at once would spin.
                Err(error) => {
                    eprintln!("accept failed: {error}; retrying in a second");
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                        () = stop.cancelled() => break,
                    }
                }
            },
            () = stop.cancelled() => break,
        };
        let connection = connections.watch(
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone())),
        );
        tokio::spawn(async move {
            // A client that resets or times out ends its own connection;
            // there is no one to tell.
            let _ = connection.await;
        });
    }
    // The port closes now: a client connecting during the drain is refused
    // rather than left waiting.
    drop(listener);
    connections.shutdown().await;
    Ok(())
}

/// Binds the listener of `flag`, naming it in the error.
async fn bind(flag: &str, addr: SocketAddr) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|error| format!("{flag} {addr}: {error}"))
}

/// Resolves on Ctrl-C, or on SIGTERM where there is one: what a terminal,
/// systemd and Kubernetes each send to ask for a graceful stop. Either way
/// the gateway stops admitting, drains usage and returns its leases.
async fn stop_requested() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = terminate.recv() => {}
                }
                return;
            }
            Err(error) => eprintln!("no SIGTERM handler ({error}); stop with Ctrl-C"),
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
