//! One request through `TollgateLayer` around a ready `service_fn` handler,
//! against the same handler with no layer, and what the yield an HTTP/2
//! request takes before its charge commits (I37) adds to it:
//!
//! - `bare`: the handler alone, the floor;
//! - `http1`: an HTTP/1.1 request through the layer, admitted, committed at
//!   its first poll and its usage event queued;
//! - `http2`: the same request marked HTTP/2, which returns pending once,
//!   having woken its own task, before it commits;
//! - `http1_marker`, `http2_marker`: the same two with the layer committing
//!   in the handler (`commit_in_handler`) at a `CommitMarkerLayer` around
//!   the handler, where the HTTP/2 request yields instead.
//!
//! The layer runs over an `InstanceRuntime` on a `MemoryStore` with one
//! Strict account of a huge balance, price 1, the coarse clock the examples
//! use and a warm lease installed before anything is measured; its
//! background planes run on the same tokio runtime as the requests. The
//! usage writer delivers to a sink that counts the events and keeps none:
//! tens of millions of events in the memory store's maps would grow them
//! for the whole run, and their rehashes would land in random samples.
//! Before measuring, one request of each kind must be answered 200, be
//! counted admitted and yield as often as I37 says (HTTP/2 once, HTTP/1.1
//! never); afterwards, every metered request must have been
//! admitted and reached the handler, none denied or released, and every
//! usage event delivered, so no figure can be a denial's.
//!
//! Requests go one after another, each as a server hands it over: the
//! service cloned, then `oneshot`. They run inside one spawned task per
//! sample, timed inside the task, so a yield goes through the scheduler's
//! run queue as it does for a server's request task (a future `block_on`
//! polls itself would be re-polled without one) and starting the task is
//! paid once per sample, not per request. Every 64 requests, in every
//! variant, the task yields as well, as a server's task does when it reads
//! its next request: the usage writer, woken from the request's task, runs
//! on that worker only once the task yields, so a task that never yielded
//! would keep the writer (and its cost) out of the HTTP/1.1 figures, fill
//! the usage queue and measure denials.
//!
//! Two runtimes, each with its own tollgate runtime:
//!
//! - `layer`: the multi-thread runtime `#[tokio::main]` builds (a worker per
//!   core), as a server behind hyper usually runs. A task that yields there
//!   wakes a sleeping worker to look for work unless one already is, so on
//!   a lightly loaded server a yield can cost a thread wake-up as well as a
//!   pass through the run queue, and the other worker may steal the task. Which worker runs the
//!   task, and how often it moves, varies, and on a small machine the whole
//!   request's time varies between runs by more than a yield costs;
//! - `layer_current_thread`: one current-thread runtime, where a yield is a
//!   pass through the run queue and nothing else: the yield's cost on a
//!   worker that has work anyway, steady enough between runs to resolve.
//!
//! The figure that matters is `http2` − `http1` (and its ratio to `http1`),
//! each against the others measured in the same run.
//!
//! ```sh
//! cargo bench --bench layer
//! ```

use std::convert::Infallible;
use std::future::{Future, ready};
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, criterion_group, criterion_main};
use http::header::AUTHORIZATION;
use http::{HeaderValue, Request, Response, StatusCode, Version};
use http_body_util::{Empty, Full};
use jiff::SignedDuration;
use tollgate::admission::SnapshotMapConfig;
use tollgate::layer::{CommitMarkerLayer, Price, TollgateLayer};
use tollgate::runtime::{
    AccountLeaseConfig, InstanceRuntime, InstanceRuntimeConfig, PrincipalSelection, RuntimeHandle,
    SnapshotManagerConfig, UsageWriterConfig,
};
use tollgate::store::{
    AccountSpec, Clock, CoarseClock, GrantPolicy, IngestOutcome, MemoryStore, StoreError,
    TailSharing, UsageSink,
};
use tollgate::{
    AccountStatus, CostUnits, EnforcementMode, LocalSharding, PermissionBits, UsageEvent,
};
use tower::{Layer, Service, ServiceExt, service_fn};

/// Requests between two yields of the measuring task in every variant.
const YIELD_EVERY: u64 = 64;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A usage sink that accepts every event and keeps only their number.
#[derive(Debug, Default)]
struct CountingSink {
    events: AtomicU64,
}

#[async_trait]
impl UsageSink for CountingSink {
    async fn ingest(&self, batch: &[UsageEvent]) -> Result<Vec<IngestOutcome>, StoreError> {
        self.events.fetch_add(batch.len() as u64, Ordering::Relaxed);
        Ok(vec![IngestOutcome::Accepted; batch.len()])
    }
}

/// `benches/http_hello.rs`'s runtime settings, with a usage queue large
/// enough that the writer keeps up without any admission waiting for it,
/// and leases so large the whole run spends from the first one.
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
            queue_capacity: 1 << 17,
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

/// A store with one funded Strict account and one key, a ready runtime over
/// it with a lease installed, and the sink its usage goes to.
struct World {
    runtime: InstanceRuntime,
    handle: RuntimeHandle,
    sink: Arc<CountingSink>,
    /// `Bearer <key>`.
    credential: HeaderValue,
}

/// Starts the world on the runtime this is polled on.
async fn start() -> World {
    let clock: Arc<dyn Clock> = Arc::new(CoarseClock::start(ms(1)).expect("a 1 ms tick is valid"));
    let store = Arc::new(
        MemoryStore::new(GrantPolicy {
            max_ttl: SignedDuration::from_hours(1),
            reclaim_grace: SignedDuration::from_secs(10),
            tail: TailSharing {
                instances: 1,
                min_grant: CostUnits(1),
            },
        })
        .expect("the grant policy is valid"),
    );
    let now = clock.now();
    let account = store
        .create_account(
            AccountSpec {
                balance: CostUnits(1 << 50),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            now,
        )
        .expect("the account is created");
    let key = store
        .issue_key(account, PermissionBits::ALL, now)
        .expect("the key is issued");
    let credential = HeaderValue::from_str(&format!("Bearer {}", key.key.expose()))
        .expect("a key is a valid header value");
    let sink = Arc::new(CountingSink::default());
    let (runtime, handle) = InstanceRuntime::spawn(
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        Arc::clone(&sink) as _,
        clock,
        runtime_config(),
    )
    .expect("the runtime config is valid");
    // Ready means policy loaded; the lease must be in its slot too.
    for _ in 0..1_000 {
        let leased = handle
            .account_reports()
            .iter()
            .any(|report| report.remaining.is_some_and(|units| !units.is_zero()));
        if handle.readiness() && leased {
            return World {
                runtime,
                handle,
                sink,
                credential,
            };
        }
        tokio::time::sleep(ms(10)).await;
    }
    panic!("the tollgate runtime did not become ready with a lease in 10 s");
}

/// The handler: always ready, answers `hello`, counts what it served.
fn handler(
    served: Arc<AtomicU64>,
) -> impl Service<
    Request<Empty<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send,
> + Clone
+ Send
+ 'static {
    service_fn(move |_: Request<Empty<Bytes>>| {
        served.fetch_add(1, Ordering::Relaxed);
        ready(Ok(Response::new(Full::new(Bytes::from_static(b"hello")))))
    })
}

/// The layer: price 1, no permissions required; committing in the handler
/// when `deferred`.
fn layer(handle: &RuntimeHandle, deferred: bool) -> TollgateLayer {
    let builder = TollgateLayer::builder(handle.clone()).price(|_: &http::request::Parts| Price {
        units: CostUnits(1),
        required: PermissionBits::NONE,
    });
    let builder = if deferred {
        builder.commit_in_handler()
    } else {
        builder
    };
    builder.build().expect("pricing was given")
}

fn request(credential: &HeaderValue, version: Version) -> Request<Empty<Bytes>> {
    let mut request = Request::new(Empty::new());
    *request.version_mut() = version;
    request
        .headers_mut()
        .insert(AUTHORIZATION, credential.clone());
    request
}

/// Returns pending once, having woken its task: a pass through the
/// scheduler.
fn yield_once() -> impl Future<Output = ()> {
    let mut yielded = false;
    std::future::poll_fn(move |cx| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
}

/// Counts the wakes it is asked for.
#[derive(Debug, Default)]
struct CountingWaker {
    wakes: AtomicUsize,
}

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::Relaxed);
    }
}

/// Polls `future`, which waits for nothing, until it completes; also how
/// many times it returned pending having woken its task.
fn yields_to_complete<F: Future>(future: F) -> (F::Output, usize) {
    let counting = Arc::new(CountingWaker::default());
    let waker = Waker::from(Arc::clone(&counting));
    let mut cx = Context::from_waker(&waker);
    let mut future = pin!(future);
    for pending in 0..8 {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return (output, pending);
        }
        assert_eq!(
            counting.wakes.load(Ordering::Relaxed),
            pending + 1,
            "a pending request woke its task"
        );
    }
    panic!("a request through a ready handler did not complete in 8 polls");
}

/// Sends `iters` requests of `version` through `service`, one after
/// another, and returns the time they took.
async fn drive<S, B>(service: S, credential: HeaderValue, version: Version, iters: u64) -> Duration
where
    S: Service<Request<Empty<Bytes>>, Response = Response<B>, Error = Infallible> + Clone,
{
    let start = Instant::now();
    for i in 1..=iters {
        let response = service
            .clone()
            .oneshot(request(&credential, version))
            .await
            .expect("the handler is infallible");
        drop(response);
        if i % YIELD_EVERY == 0 {
            yield_once().await;
        }
    }
    start.elapsed()
}

/// Measures requests through `service`, one benchmark per named HTTP
/// version, `iters` requests in one task spawned on `rt` per sample.
fn bench_requests<S, B>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    rt: &tokio::runtime::Runtime,
    credential: &HeaderValue,
    service: &S,
    variants: &[(&str, Version)],
) where
    S: Service<Request<Empty<Bytes>>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    for &(name, version) in variants {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let task = rt.spawn(drive(service.clone(), credential.clone(), version, iters));
                rt.block_on(task).expect("the measuring task completes")
            });
        });
    }
}

/// The `group` benchmarks on `rt`, with a tollgate runtime of their own.
fn run(c: &mut Criterion, group: &str, rt: &tokio::runtime::Runtime) {
    let world = rt.block_on(start());
    let bare_served = Arc::new(AtomicU64::new(0));
    let metered_served = Arc::new(AtomicU64::new(0));
    let bare = handler(Arc::clone(&bare_served));
    let at_hand_over = layer(&world.handle, false).layer(handler(Arc::clone(&metered_served)));
    let marker = layer(&world.handle, true)
        .layer(CommitMarkerLayer::new().layer(handler(Arc::clone(&metered_served))));

    // Once, before measuring: each kind of request is answered by the
    // handler, counted admitted, and yields as often as it should (HTTP/2
    // once, HTTP/1.1 never).
    rt.block_on(async {
        let before = world.handle.counters();
        for (version, yields) in [(Version::HTTP_11, 0), (Version::HTTP_2, 1)] {
            let sent = at_hand_over
                .clone()
                .oneshot(request(&world.credential, version));
            let (response, taken) = yields_to_complete(sent);
            let response = response.expect("the handler is infallible");
            assert_eq!(response.status(), StatusCode::OK, "{version:?}");
            assert_eq!(taken, yields, "{version:?}: yields before the commit");
            let sent = marker.clone().oneshot(request(&world.credential, version));
            let (response, taken) = yields_to_complete(sent);
            let response = response.expect("the handler is infallible");
            assert_eq!(response.status(), StatusCode::OK, "{version:?}, marker");
            assert_eq!(
                taken, yields,
                "{version:?}, marker: yields before the commit"
            );
        }
        let after = world.handle.counters();
        assert_eq!(
            after.admitted - before.admitted,
            4,
            "every request admitted"
        );
        assert_eq!(after.denied_total(), 0, "no request denied");
    });

    let credential = &world.credential;
    let mut g = c.benchmark_group(group);
    let (http1, http2) = (Version::HTTP_11, Version::HTTP_2);
    bench_requests(&mut g, rt, credential, &bare, &[("bare", http1)]);
    let variants = [("http1", http1), ("http2", http2)];
    bench_requests(&mut g, rt, credential, &at_hand_over, &variants);
    let variants = [("http1_marker", http1), ("http2_marker", http2)];
    bench_requests(&mut g, rt, credential, &marker, &variants);
    g.finish();

    // Every metered request measured was admitted and served, and its
    // usage delivered.
    let stats = world.handle.counters();
    assert_eq!(stats.denied_total(), 0, "no request denied");
    assert_eq!(stats.released, 0, "no request released");
    assert_eq!(
        stats.admitted,
        metered_served.load(Ordering::Relaxed),
        "every admitted request reached the handler, and only those"
    );
    let report = rt.block_on(world.runtime.shutdown());
    assert_eq!(report.lost_events(), 0, "no usage event lost");
    assert_eq!(
        world.sink.events.load(Ordering::Relaxed),
        stats.admitted,
        "every admitted request's usage event delivered"
    );
}

fn multi_thread(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    run(c, "layer", &rt);
}

fn current_thread(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    run(c, "layer_current_thread", &rt);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = multi_thread, current_thread
}
criterion_main!(benches);
