//! A tiny axum server for the HTTP-level overhead benchmark
//! (`benches/http_instructions.sh`): one route, `GET /` → `"hello"`, with one
//! of four layers added by `Router::layer`:
//!
//! - `bare`: no layer;
//! - `noop`: a pass-through tower `Layer`/`Service` (the floor any layer pays);
//! - `floor`: a layer doing only the HTTP-side work tollgate's surface
//!   requires, with no accounting: find the key header, put a 48-byte
//!   admission record in the request's extensions (what handlers read), and
//!   add a 36-character request id to the response;
//! - `tollgate`: `TollgateLayer` over a `MemoryStore` runtime, one Strict
//!   account with a huge balance, price 1, a warm lease installed before the
//!   server listens (the runtime's background planes keep running);
//! - `governor`: `tower_governor`'s `GovernorLayer` with one global key and
//!   limits nothing reaches.
//!
//! It prints the bound address on stdout (one line), then `key=<plaintext>`
//! for the tollgate variant, and `served=<n>` when it exits. With
//! `--requests N` it shuts down gracefully once its handler has served N
//! requests; `--requests 0` starts, becomes ready and exits (the idle run,
//! optionally held open for `--hold-ms`). Without `--requests` it serves until
//! Ctrl-C. One current-thread tokio runtime runs everything, so callgrind's
//! counts are stable.
//!
//! ```sh
//! cargo bench --bench http_hello -- --variant tollgate --requests 1000
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use clap::{Parser, ValueEnum};
use jiff::SignedDuration;
use tokio::sync::Notify;
use tollgate::admission::SnapshotMapConfig;
use tollgate::layer::{Price, TollgateLayer};
use tollgate::runtime::{
    AccountLeaseConfig, InstanceRuntime, InstanceRuntimeConfig, PrincipalSelection, RuntimeHandle,
    SnapshotManagerConfig, UsageWriterConfig,
};
use tollgate::store::{
    AccountSpec, Clock, CoarseClock, GrantPolicy, MemoryStore, SystemClock, TailSharing,
};
use tollgate::{AccountStatus, CostUnits, EnforcementMode, LocalSharding, PermissionBits};
use tower::{Layer, Service};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::GlobalKeyExtractor;

/// How the one route is wrapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Variant {
    /// No layer.
    Bare,
    /// A pass-through layer.
    Noop,
    /// Key header read, extension inserted, request-id header added.
    Floor,
    /// `TollgateLayer` on a warm memory-store runtime.
    Tollgate,
    /// `tower_governor` with one global key and a limit nothing reaches.
    Governor,
}

/// Which clock the tollgate runtime reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ClockKind {
    /// `SystemClock`: one system call per clock read, no background ticker.
    System,
    /// `CoarseClock` ticking every millisecond, as the examples use: the
    /// default. Its ticker's cost grows with wall time, which callgrind
    /// stretches about fifty-fold, so the instruction script holds each
    /// idle run open as long as its loaded run to cancel it out.
    Coarse,
}

#[derive(Debug, Parser)]
#[command(about = "GET / -> \"hello\", bare or behind one layer, for HTTP overhead benchmarks")]
struct Args {
    /// Which layer wraps the route.
    #[arg(long, value_enum)]
    variant: Variant,
    /// The address to listen on; the bound address is printed on stdout.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Shut down gracefully after serving this many requests (0: start,
    /// become ready and exit). Without it, serve until Ctrl-C.
    #[arg(long)]
    requests: Option<u64>,
    /// With `--requests 0`: stay up (serving nothing) this long before
    /// exiting, so an idle run can last as long as a loaded one.
    #[arg(long, default_value_t = 0)]
    hold_ms: u64,
    /// The tollgate runtime's clock.
    #[arg(long, value_enum, default_value = "coarse")]
    clock: ClockKind,
    /// Accepted and ignored, so `cargo bench --bench http_hello` works.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Counts handled requests and rings when the target is reached.
#[derive(Debug)]
struct Served {
    count: AtomicU64,
    target: Option<u64>,
    done: Notify,
}

impl Served {
    fn one(&self) {
        let served = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        if Some(served) == self.target {
            self.done.notify_one();
        }
    }
}

async fn hello(State(served): State<Arc<Served>>) -> &'static str {
    served.one();
    "hello"
}

/// A layer that adds a pass-through service, nothing else.
#[derive(Debug, Clone, Copy)]
struct NoopLayer;

impl<S> Layer<S> for NoopLayer {
    type Service = Noop<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Noop { inner }
    }
}

/// Forwards `poll_ready` and `call` to the inner service.
#[derive(Debug, Clone)]
struct Noop<S> {
    inner: S,
}

impl<S, R> Service<R> for Noop<S>
where
    S: Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.inner.call(request)
    }
}

/// What the floor layer puts in a request's extensions: the size of
/// tollgate's `Admitted`.
#[derive(Debug, Clone, Copy)]
struct FloorRecord {
    _units: u64,
    _account: u64,
    _key: Option<u64>,
    _request_id: u128,
}

/// The floor layer: the HTTP-side work of a metering layer with tollgate's
/// surface, and nothing else.
#[derive(Debug, Clone)]
struct FloorLayer {
    next: Arc<AtomicU64>,
}

impl<S> Layer<S> for FloorLayer {
    type Service = Floor<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Floor {
            inner,
            next: Arc::clone(&self.next),
        }
    }
}

#[derive(Debug, Clone)]
struct Floor<S> {
    inner: S,
    next: Arc<AtomicU64>,
}

const FLOOR_KEY: http::HeaderName = http::HeaderName::from_static("x-api-key");
const FLOOR_ID: http::HeaderName = http::HeaderName::from_static("x-tollgate-request-id");

impl<S, B, ResBody> Service<http::Request<B>> for Floor<S>
where
    S: Service<http::Request<B>, Response = http::Response<ResBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = FloorFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let key = request
            .headers()
            .get(FLOOR_KEY)
            .map_or(0, |value| value.as_bytes().len() as u64);
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        request.extensions_mut().insert(FloorRecord {
            _units: 1,
            _account: key,
            _key: Some(key),
            _request_id: u128::from(id),
        });
        FloorFuture {
            future: self.inner.call(request),
            id,
        }
    }
}

pin_project_lite::pin_project! {
    struct FloorFuture<F> {
        #[pin]
        future: F,
        id: u64,
    }
}

impl<F, ResBody, E> Future for FloorFuture<F>
where
    F: Future<Output = Result<http::Response<ResBody>, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut response = std::task::ready!(this.future.poll(cx))?;
        let mut text = [b'0'; 36];
        text[..4].copy_from_slice(b"req_");
        let mut id = *this.id;
        for digit in text[4..].iter_mut().rev() {
            *digit = b"0123456789abcdef"[(id & 15) as usize];
            id >>= 4;
        }
        let value = http::HeaderValue::from_bytes(&text).expect("hex is visible ASCII");
        response.headers_mut().insert(FLOOR_ID, value);
        Poll::Ready(Ok(response))
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The gateway example's cadence, with leases large enough that the whole
/// run spends from the first one: refills are rare, but every background
/// plane still runs.
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
            target_grant: CostUnits(1 << 40),
            low_water: CostUnits(1 << 20),
            lease_ttl: SignedDuration::from_hours(1),
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
        reclaimer: None,
        supervisor_interval: ms(500),
        account_linger: ms(60_000),
        manager_restart_backoff: ms(1_000),
        shutdown_deadline: ms(5_000),
    }
}

/// The tollgate variant's world: a store with one funded Strict account and
/// one key, and a ready runtime over it with a lease installed.
struct Metered {
    runtime: InstanceRuntime,
    handle: RuntimeHandle,
    key: String,
}

async fn start_tollgate(clock: ClockKind) -> Result<Metered, Box<dyn std::error::Error>> {
    let clock: Arc<dyn Clock> = match clock {
        ClockKind::System => Arc::new(SystemClock),
        ClockKind::Coarse => Arc::new(CoarseClock::start(ms(1))?),
    };
    let store = Arc::new(MemoryStore::new(GrantPolicy {
        max_ttl: SignedDuration::from_hours(1),
        reclaim_grace: SignedDuration::from_secs(10),
        tail: TailSharing {
            instances: 1,
            min_grant: CostUnits(1),
        },
    })?);
    let now = clock.now();
    let account = store.create_account(
        AccountSpec {
            balance: CostUnits(1 << 50),
            mode: EnforcementMode::Strict,
            status: AccountStatus::Active,
            refill: None,
        },
        now,
    )?;
    let key = store
        .issue_key(account, PermissionBits::ALL, now)?
        .key
        .expose()
        .to_owned();
    let (runtime, handle) = InstanceRuntime::spawn(
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        clock,
        runtime_config(),
    )?;
    // Ready means policy loaded and every account in use funded: the lease
    // is in its slot before the first request arrives.
    for _ in 0..1_000 {
        let leased = handle
            .account_reports()
            .iter()
            .any(|report| report.remaining.is_some_and(|units| !units.is_zero()));
        if handle.readiness() && leased {
            return Ok(Metered {
                runtime,
                handle,
                key,
            });
        }
        tokio::time::sleep(ms(10)).await;
    }
    Err("the tollgate runtime did not become ready with a lease in 10 s".into())
}

fn app(variant: Variant, served: Arc<Served>, handle: Option<&RuntimeHandle>) -> Router {
    let router = Router::new().route("/", get(hello)).with_state(served);
    match variant {
        Variant::Bare => router,
        Variant::Noop => router.layer(NoopLayer),
        Variant::Floor => router.layer(FloorLayer {
            next: Arc::new(AtomicU64::new(0)),
        }),
        Variant::Tollgate => {
            let handle = handle.expect("the tollgate variant starts a runtime");
            let layer = TollgateLayer::builder(handle.clone())
                .price(|_: &http::request::Parts| Price {
                    units: CostUnits(1),
                    required: PermissionBits::NONE,
                })
                .build()
                .expect("pricing was given");
            router.layer(layer)
        }
        Variant::Governor => {
            let config = GovernorConfigBuilder::default()
                .key_extractor(GlobalKeyExtractor)
                .per_nanosecond(1)
                .burst_size(u32::MAX)
                .finish()
                .expect("period and burst are positive");
            router.layer(GovernorLayer::new(config))
        }
    }
}

/// Resolves when the server should stop: the target was served, at once for
/// an idle run (after the hold), or on Ctrl-C when there is no target.
fn stop_signal(served: Arc<Served>, hold: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    match served.target {
        Some(0) => Box::pin(tokio::time::sleep(hold)),
        Some(_) => Box::pin(async move { served.done.notified().await }),
        None => Box::pin(async {
            let _ = tokio::signal::ctrl_c().await;
        }),
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let metered = match args.variant {
        Variant::Tollgate => Some(start_tollgate(args.clock).await?),
        _ => None,
    };
    let served = Arc::new(Served {
        count: AtomicU64::new(0),
        target: args.requests,
        done: Notify::new(),
    });
    let app = app(
        args.variant,
        Arc::clone(&served),
        metered.as_ref().map(|metered| &metered.handle),
    );

    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!("{}", listener.local_addr()?);
    if let Some(metered) = &metered {
        println!("key={}", metered.key);
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(stop_signal(Arc::clone(&served), ms(args.hold_ms)))
        .await?;

    println!("served={}", served.count.load(Ordering::Relaxed));
    if let Some(Metered {
        runtime, handle, ..
    }) = metered
    {
        let counters = handle.counters();
        let report = runtime.shutdown().await;
        println!(
            "admitted={} denied={} lost_events={}",
            counters.admitted,
            counters.denied_total(),
            report.lost_events()
        );
        if counters.denied_total() != 0 || report.lost_events() != 0 {
            return Err("tollgate denied requests or lost usage events".into());
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}
