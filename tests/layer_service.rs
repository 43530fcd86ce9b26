//! The tollgate tower layer over a real instance runtime on the memory
//! store, driven with `ServiceExt::oneshot` and `service_fn` inner services:
//! admission, the commit at first poll, every deny path's status and
//! headers, hostile credentials, and clones sharing one lease (I2, I3, I4,
//! I5, I8, I9, I20, I25).

mod support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use jiff::{SignedDuration, Timestamp};
use proptest::prelude::*;
use tollgate::layer::{
    Admitted, BearerOrApiKey, CommitMarkerLayer, DenyBody, KeyExtractor, LayerConfigError,
    MAX_KEY_BYTES, Price, REQUEST_ID_HEADER, TollgateLayer,
};
use tollgate::runtime::{InstanceRuntime, InstanceRuntimeConfig, RuntimeHandle};
use tollgate::store::{
    AccountSpec, Clock, GrantPolicy, ManualClock, MemoryStore, RefillSchedule, SnapshotCursor,
    SnapshotPage, SnapshotSource, StoreError, TailSharing,
};
use tollgate::{
    AccountId, AccountStatus, CostUnits, DenyReason, EnforcementMode, PermissionBits,
    PolicyRevision, UsageSource,
};
use tower::{Layer, Service, ServiceExt, service_fn};
use tracing_subscriber::layer::SubscriberExt as _;

#[global_allocator]
static GLOBAL: support::counting_allocator::CountingAllocator =
    support::counting_allocator::CountingAllocator;

const RATE_LIMIT: http::HeaderName = http::HeaderName::from_static("ratelimit");

const PRICE: u64 = 7;
const INITIAL: u64 = 10_000;
const READ: PermissionBits = PermissionBits::bit(0);
const WRITE: PermissionBits = PermissionBits::bit(1);
const REVISION: PolicyRevision = PolicyRevision(42);
const LEASE_TTL: SignedDuration = SignedDuration::from_secs(60);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn config() -> InstanceRuntimeConfig {
    support::runtime::config(support::runtime::Pace::Paused)
}

struct World {
    clock: Arc<ManualClock>,
    store: Arc<MemoryStore>,
    account: AccountId,
    /// The plaintext key, holding `READ` only.
    key: String,
    runtime: Option<InstanceRuntime>,
    handle: RuntimeHandle,
}

/// A store with one account of `balance` units and one `READ` key, and a
/// runtime over it that has had time to load its snapshots and lease.
async fn world(balance: u64) -> World {
    world_with(balance, |store| store as _).await
}

/// [`world`], with the runtime reading policy from what `snapshots` makes
/// of the store.
async fn world_with(
    balance: u64,
    snapshots: impl FnOnce(Arc<MemoryStore>) -> Arc<dyn SnapshotSource>,
) -> World {
    let start = Timestamp::from_second(1_700_000_000).unwrap();
    let clock = Arc::new(ManualClock::new(start));
    let store = Arc::new(
        MemoryStore::new(GrantPolicy {
            max_ttl: LEASE_TTL,
            reclaim_grace: SignedDuration::from_secs(10),
            tail: TailSharing {
                instances: 1,
                min_grant: CostUnits(1),
            },
        })
        .unwrap(),
    );
    let account = store
        .create_account(
            AccountSpec {
                balance: CostUnits(balance),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            start,
        )
        .unwrap();
    let key = store
        .issue_key(account, READ, start)
        .unwrap()
        .key
        .expose()
        .to_owned();
    let (runtime, handle) = InstanceRuntime::spawn(
        snapshots(Arc::clone(&store)),
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        Arc::clone(&clock) as Arc<dyn Clock>,
        config(),
    )
    .unwrap();
    // Paused time: the snapshot and lease tasks run to completion.
    tokio::time::sleep(ms(200)).await;
    World {
        clock,
        store,
        account,
        key,
        runtime: Some(runtime),
        handle,
    }
}

impl World {
    /// `PRICE` units per request; `/write` needs `WRITE`, anything else
    /// `READ`.
    fn layer(&self) -> TollgateLayer {
        TollgateLayer::builder(self.handle.clone())
            .price(|parts: &http::request::Parts| Price {
                units: CostUnits(PRICE),
                required: if parts.uri.path() == "/write" {
                    WRITE
                } else {
                    READ
                },
            })
            .policy_revision(REVISION)
            .build()
            .unwrap()
    }

    /// [`layer`](Self::layer), committing in the handler.
    fn deferred_layer(&self) -> TollgateLayer {
        TollgateLayer::builder(self.handle.clone())
            .price(|_: &http::request::Parts| Price {
                units: CostUnits(PRICE),
                required: READ,
            })
            .policy_revision(REVISION)
            .commit_in_handler()
            .build()
            .unwrap()
    }

    /// Units left on the account's serving lease (a quiescent reading).
    fn remaining(&self) -> u64 {
        let reports = self.handle.account_reports();
        assert_eq!(reports.len(), 1, "one account is served");
        reports[0]
            .remaining
            .expect("the account holds a lease")
            .get()
    }

    fn bearer(&self, path: &str) -> Request<String> {
        request(
            path,
            &[(AUTHORIZATION, format!("Bearer {}", self.key).as_bytes())],
        )
    }

    /// Shuts the runtime down and returns the units of every usage event.
    async fn shutdown_and_usage(&mut self) -> Vec<u64> {
        let report = self.runtime.take().unwrap().shutdown().await;
        assert_eq!(report.lost_events(), 0, "I25: no usage lost at shutdown");
        assert_eq!(report.abandoned(), 0);
        let events = self.store.usage(self.account).unwrap();
        assert!(
            events.iter().all(|event| event.policy_revision == REVISION),
            "every event carries the layer's policy revision"
        );
        events.iter().map(|event| event.units.get()).collect()
    }
}

fn request(path: &str, headers: &[(http::HeaderName, &[u8])]) -> Request<String> {
    let mut request = Request::builder().uri(path).body(String::new()).unwrap();
    for (name, value) in headers {
        request
            .headers_mut()
            .append(name.clone(), HeaderValue::from_bytes(value).unwrap());
    }
    request
}

/// An inner service that answers with what admission told it.
async fn echo_admission(request: Request<String>) -> Result<Response<String>, Infallible> {
    let admitted = request
        .extensions()
        .get::<Admitted>()
        .expect("an admitted request carries Admitted");
    Ok(Response::new(format!(
        "{} {} {}",
        admitted.units.get(),
        admitted.account_id,
        admitted.request_id
    )))
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

async fn answer<B>(response: Response<B>) -> Answer
where
    B: hyper::body::Body,
    B::Error: std::fmt::Debug,
{
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8(bytes.to_vec()).unwrap(),
    }
}

async fn send(w: &World, request: Request<String>) -> Answer {
    let service = w.layer().layer(service_fn(echo_admission));
    answer(service.oneshot(request).await.unwrap()).await
}

#[track_caller]
fn check_denial(answer: &Answer, status: StatusCode, code: &str) {
    assert_eq!(answer.status, status, "{}", answer.body);
    assert_eq!(answer.headers[CONTENT_TYPE], "application/problem+json");
    assert!(
        answer.body.contains(&format!("\"code\":\"{code}\"")),
        "{}",
        answer.body
    );
    assert!(
        answer
            .body
            .contains(&format!("\"status\":{}", status.as_u16())),
        "{}",
        answer.body
    );
    assert!(answer.body.contains("\"type\":\"about:blank\""));
}

#[tokio::test(start_paused = true)]
async fn an_admitted_request_reaches_the_handler_and_is_charged_its_price_exactly_once() {
    let mut w = world(INITIAL).await;
    let before = w.remaining();
    let answer = send(&w, w.bearer("/read")).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(
        answer
            .body
            .starts_with(&format!("{PRICE} {} req_", w.account)),
        "the handler saw Admitted: {}",
        answer.body
    );
    let request_id = answer.headers[REQUEST_ID_HEADER].to_str().unwrap();
    assert!(answer.body.ends_with(request_id), "one id in both places");
    assert_eq!(
        w.remaining(),
        before - PRICE,
        "I6: the lease paid the price"
    );
    assert_eq!(w.handle.counters().admitted, 1);

    for _ in 1..5 {
        assert_eq!(send(&w, w.bearer("/read")).await.status, StatusCode::OK);
    }
    let units = w.shutdown_and_usage().await;
    assert_eq!(
        units,
        vec![PRICE; 5],
        "I8: one event of the price per request"
    );
    let view = w.store.account(w.account, w.clock.now()).unwrap();
    assert_eq!(view.balance, CostUnits(INITIAL - 5 * PRICE));
    assert_eq!(view.leased, CostUnits::ZERO);
    assert!(w.store.audit().unwrap().is_empty());
}

/// A successful `CONNECT` response is complete with its headers: the
/// connection becomes a tunnel, and the server drops any body unsent. So
/// dropping that body must not cancel the request's token, which a tunnel
/// task may be watching; a `GET` response dropped with its body unsent
/// does cancel (the client left mid-stream).
#[tokio::test(start_paused = true)]
async fn a_tunnel_opened_by_connect_is_not_cancelled_when_its_unsent_body_drops() {
    let w = world(INITIAL).await;
    let layer = TollgateLayer::builder(w.handle.clone())
        .price(|_: &http::request::Parts| Price {
            units: CostUnits(PRICE),
            required: READ,
        })
        .track_cancellation()
        .build()
        .unwrap();
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&tokens);
    let mut service = layer.layer(service_fn(move |request: Request<String>| {
        let admitted = request.extensions().get::<Admitted>().expect("admitted");
        seen.lock()
            .unwrap()
            .push(admitted.cancellation.clone().expect("tracking is on"));
        std::future::ready(Ok::<_, Infallible>(Response::new("tunnel".to_owned())))
    }));
    for method in [http::Method::CONNECT, http::Method::GET] {
        let mut request = w.bearer("/read");
        *request.method_mut() = method.clone();
        let response = serve_now(&mut service, request);
        assert_eq!(response.status(), StatusCode::OK, "{method}");
        drop(response);
    }
    let tokens = tokens.lock().unwrap();
    assert!(!tokens[0].is_cancelled(), "CONNECT: the tunnel stays up");
    assert!(
        tokens[1].is_cancelled(),
        "GET: the body never reached the client"
    );
}

/// An inner service whose `call` panics.
#[derive(Clone)]
struct PanicsInCall;

impl Service<Request<String>> for PanicsInCall {
    type Response = Response<String>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<String>, Infallible>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _request: Request<String>) -> Self::Future {
        panic!("the inner service's call panics");
    }
}

/// I4: an inner service that panics in `call`, which the layer makes from
/// inside its own `call`, takes the admitted request down with it: the
/// charge is released for zero and the release counted, in either commit
/// mode, so admissions still add up to outcomes.
#[tokio::test(start_paused = true)]
async fn a_panic_in_the_inner_call_releases_the_charge_and_counts_it() {
    let w = world(INITIAL).await;
    let before = w.remaining();
    for (mode, layer) in [("default", w.layer()), ("deferred", w.deferred_layer())] {
        let mut service = layer.layer(PanicsInCall);
        let request = w.bearer("/read");
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            drop(service.call(request));
        }));
        assert!(outcome.is_err(), "{mode}: the panic reached the caller");
        assert_eq!(w.remaining(), before, "{mode}: I4, released for zero");
    }
    let counters = w.handle.counters();
    assert_eq!(
        (counters.admitted, counters.released),
        (2, 2),
        "each admission's release was counted"
    );
}

/// An inner service that fails its readiness once and, polled again after
/// that, never becomes ready: tower's contract says a failed service is
/// not polled again, and this one would hang whoever does.
#[derive(Clone, Default)]
struct FailsOnce {
    polls: Arc<AtomicUsize>,
    calls: Arc<AtomicUsize>,
}

impl Service<Request<String>> for FailsOnce {
    type Response = Response<String>;
    type Error = &'static str;
    type Future = std::future::Ready<Result<Response<String>, &'static str>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), &'static str>> {
        if self.polls.fetch_add(1, Ordering::SeqCst) == 0 {
            std::task::Poll::Ready(Err("the inner service failed"))
        } else {
            std::task::Poll::Pending
        }
    }

    fn call(&mut self, _request: Request<String>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(Response::new(String::new())))
    }
}

/// I4: an inner service that fails its readiness at the hand-over answers
/// the request with its error at the first poll, in either commit mode.
/// It is not polled again (a failed service may never be ready), the
/// handler never runs, and the charge is released for zero and counted.
#[tokio::test(start_paused = true)]
async fn an_inner_service_that_fails_its_readiness_answers_with_its_error_uncharged() {
    let w = world(INITIAL).await;
    let before = w.remaining();
    for (mode, layer) in [("default", w.layer()), ("deferred", w.deferred_layer())] {
        let inner = FailsOnce::default();
        let mut service = layer.layer(inner.clone());
        let future = std::pin::pin!(service.call(w.bearer("/read")));
        match futures_poll_once(future).await {
            Some(Err(error)) => assert_eq!(error, "the inner service failed", "{mode}"),
            Some(Ok(response)) => panic!("{mode}: answered {}", response.status()),
            None => panic!("{mode}: the request waits on a failed service"),
        }
        assert_eq!(inner.polls.load(Ordering::SeqCst), 1, "{mode}: polled once");
        assert_eq!(
            inner.calls.load(Ordering::SeqCst),
            0,
            "{mode}: never called"
        );
        assert_eq!(w.remaining(), before, "{mode}: I4, released for zero");
    }
    let counters = w.handle.counters();
    assert_eq!(
        (counters.admitted, counters.released),
        (2, 2),
        "each admission's release was counted"
    );
}

/// An inner service not ready for its first `pending` polls (waking its
/// caller at once), failed at every poll after.
#[derive(Clone)]
struct FailsAfter {
    pending: usize,
    polls: Arc<AtomicUsize>,
}

impl FailsAfter {
    fn new(pending: usize) -> Self {
        Self {
            pending,
            polls: Arc::default(),
        }
    }
}

impl Service<Request<String>> for FailsAfter {
    type Response = Response<String>;
    type Error = &'static str;
    type Future = std::future::Ready<Result<Response<String>, &'static str>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), &'static str>> {
        if self.polls.fetch_add(1, Ordering::SeqCst) < self.pending {
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(Err("the inner service failed"))
        }
    }

    fn call(&mut self, _request: Request<String>) -> Self::Future {
        unreachable!("a failed service is never called")
    }
}

/// I4: a request waiting for its inner service, which then fails, gets the
/// error with its charge released as the error is returned (not when its
/// future is dropped), and the release counted once. Once the service has
/// failed at a hand-over, the layer's own readiness answers with the
/// failure, so the caller drops the service (tower's contract) rather
/// than admit another request to wait on it.
#[tokio::test(start_paused = true)]
async fn a_failed_inner_service_fails_the_layers_readiness_and_a_waiting_request_uncharged() {
    let w = world(INITIAL).await;
    let before = w.remaining();
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());

    // Not ready at the hand-over: the request waits, then gets the error.
    let mut service = w.layer().layer(FailsAfter::new(1));
    let mut future = std::pin::pin!(service.call(w.bearer("/read")));
    match future.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(Err(error)) => assert_eq!(error, "the inner service failed"),
        other => panic!("the waiting request gets the error: {:?}", other.is_ready()),
    }
    assert_eq!(w.remaining(), before, "I4: released as the error returned");
    assert_eq!(w.handle.counters().released, 1);

    // Failed at the hand-over: the next poll_ready says so.
    let mut service = w.layer().layer(FailsAfter::new(0));
    assert!(
        service.poll_ready(&mut cx).is_ready(),
        "ready until it fails"
    );
    let failed = std::pin::pin!(service.call(w.bearer("/read")));
    assert!(matches!(
        futures_poll_once(failed).await,
        Some(Err("the inner service failed"))
    ));
    assert!(
        matches!(
            service.poll_ready(&mut cx),
            std::task::Poll::Ready(Err("the inner service failed"))
        ),
        "the failure is the caller's to see"
    );
    assert_eq!(w.remaining(), before);
    assert_eq!(w.handle.counters().released, 2);
}

/// Drives `service` through one request on this thread, without yielding
/// to the runtime: ready, call, and one poll of a response future whose
/// inner service answers at once.
fn serve_now<S, B>(service: &mut S, request: Request<String>) -> Response<B>
where
    S: Service<Request<String>, Response = Response<B>, Error = Infallible>,
{
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(service.poll_ready(&mut cx).is_ready());
    let future = std::pin::pin!(service.call(request));
    match future.poll(&mut cx) {
        std::task::Poll::Ready(Ok(response)) => response,
        std::task::Poll::Ready(Err(never)) => match never {},
        std::task::Poll::Pending => panic!("the inner service answers at once"),
    }
}

/// I5 at the HTTP layer: the engine's admission and commit allocate
/// nothing, and the layer around them only for what the README lists for
/// an admitted request: its `Admitted` extension and its request-id header.
/// A new allocation on this path fails here rather than slipping in.
#[tokio::test(start_paused = true)]
async fn an_admitted_request_allocates_only_its_extension_and_request_id_header() {
    // Within one lease (500 units), since nothing here lets its manager run.
    const N: u64 = 30;
    let mut w = world(INITIAL).await;
    let mut service = w.layer().layer(service_fn(|_request: Request<String>| {
        std::future::ready(Ok::<_, Infallible>(Response::new(String::new())))
    }));
    // Warm this thread: its locality, request-id counter and key memo.
    let warm = serve_now(&mut service, w.bearer("/read"));
    assert_eq!(warm.status(), StatusCode::OK);
    let requests: Vec<Request<String>> = (0..N).map(|_| w.bearer("/read")).collect();
    let mut responses = Vec::with_capacity(requests.len());
    let counted = support::counting_allocator::allocations_during(|| {
        for request in requests {
            responses.push(serve_now(&mut service, request));
        }
    });
    let statuses: Vec<u16> = responses.iter().map(|r| r.status().as_u16()).collect();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    // The `Admitted` extension: the request's extension map (its box and
    // its table) and the boxed value. The request-id header: its value's
    // bytes, and the response's header map (its index and entry storage),
    // empty until then.
    assert_eq!(counted, N * 6, "allocations per admitted request");
    drop(responses);

    // A response with a header of its own: its map grows to take the
    // request id, as an empty one is first allocated.
    let mut service = w.layer().layer(service_fn(|_request: Request<String>| {
        let mut response = Response::new(String::new());
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        std::future::ready(Ok::<_, Infallible>(response))
    }));
    let requests: Vec<Request<String>> = (0..N).map(|_| w.bearer("/read")).collect();
    let mut responses = Vec::with_capacity(requests.len());
    let counted = support::counting_allocator::allocations_during(|| {
        for request in requests {
            responses.push(serve_now(&mut service, request));
        }
    });
    assert!(
        responses
            .iter()
            .all(|response| response.status() == StatusCode::OK)
    );
    assert_eq!(counted, N * 6, "allocations per admitted request");
    drop(responses);
    assert_eq!(w.shutdown_and_usage().await, vec![PRICE; 61]);
}

/// I4: a response future dropped before its first poll never started its
/// handler, so it pays nothing, whichever commit point the layer uses: the
/// default one, or a commit marker (here behind a concurrency limit with
/// room, which calls the marker from inside the layer's own `call`).
#[tokio::test(start_paused = true)]
async fn a_future_dropped_before_its_first_poll_charges_nothing() {
    for deferred in [false, true] {
        let w = world(INITIAL).await;
        let handler_ran = Arc::new(AtomicBool::new(false));
        let ran = Arc::clone(&handler_ran);
        let handler = service_fn(move |request: Request<String>| {
            let ran = Arc::clone(&ran);
            async move {
                ran.store(true, Ordering::SeqCst);
                echo_admission(request).await
            }
        });
        if deferred {
            let layer = w.deferred_layer();
            let service = tower::ServiceBuilder::new()
                .layer(layer)
                .layer(tower::limit::ConcurrencyLimitLayer::new(1))
                .layer(tollgate::layer::CommitMarkerLayer::new())
                .service(handler);
            dropped_before_its_first_poll(w, service, &handler_ran).await;
        } else {
            let service = w.layer().layer(handler);
            dropped_before_its_first_poll(w, service, &handler_ran).await;
        }
    }
}

async fn dropped_before_its_first_poll<S>(mut w: World, mut service: S, handler_ran: &AtomicBool)
where
    S: Service<Request<String>>,
    S::Error: std::fmt::Debug,
{
    let before = w.remaining();
    let future = service.ready().await.unwrap().call(w.bearer("/read"));
    assert_eq!(
        w.remaining(),
        before - PRICE,
        "admission reserved the price"
    );
    drop(future);
    assert_eq!(
        w.remaining(),
        before,
        "I4: dropping before the handler started returns the units"
    );
    assert!(!handler_ran.load(Ordering::SeqCst));
    let counted = w.handle.counters();
    assert_eq!(
        (counted.admitted, counted.released),
        (1, 1),
        "the release is counted"
    );
    assert_eq!(
        w.shutdown_and_usage().await,
        Vec::<u64>::new(),
        "I8: no event"
    );
    let view = w.store.account(w.account, w.clock.now()).unwrap();
    assert_eq!(view.balance, CostUnits(INITIAL));
}

/// I4, I9: in deferred mode, a request that reaches its commit marker only
/// after it ended (its response future dropped, so its charge was released;
/// here the request is carried on by hand, as a buffer's worker or spawned
/// work might) is refused there: its handler does not run unpaid.
#[tokio::test(start_paused = true)]
async fn a_commit_marker_reached_after_release_refuses_and_the_handler_does_not_run() {
    let mut w = world(INITIAL).await;
    let before = w.remaining();
    let stash: Arc<Mutex<Option<Request<String>>>> = Arc::default();
    let stashed = Arc::clone(&stash);
    let mut outer = w
        .deferred_layer()
        .layer(service_fn(move |request: Request<String>| {
            *stashed.lock().unwrap() = Some(request);
            std::future::pending::<Result<Response<String>, Infallible>>()
        }));
    let future = outer.ready().await.unwrap().call(w.bearer("/read"));
    let mut future = Box::pin(future);
    assert!(
        futures_poll_once(future.as_mut()).await.is_none(),
        "it waits"
    );
    drop(future);
    assert_eq!(w.remaining(), before, "I4: released when the request ended");

    let handler_ran = Arc::new(AtomicBool::new(false));
    let ran = Arc::clone(&handler_ran);
    let request = stash
        .lock()
        .unwrap()
        .take()
        .expect("the request was carried on");
    let late = tollgate::layer::CommitMarkerLayer::new()
        .layer(service_fn(move |request: Request<String>| {
            let ran = Arc::clone(&ran);
            async move {
                ran.store(true, Ordering::SeqCst);
                echo_admission(request).await
            }
        }))
        .oneshot(request)
        .await
        .unwrap();
    let late = answer(late).await;
    check_denial(
        &late,
        StatusCode::SERVICE_UNAVAILABLE,
        "funding_expired_at_start",
    );
    assert!(!handler_ran.load(Ordering::SeqCst), "I9: no unpaid handler");
    assert_eq!(w.remaining(), before);
    let counted = w.handle.counters();
    assert_eq!(
        (counted.admitted, counted.released, counted.denied_total()),
        (1, 1, 0),
        "one request, counted once: released, not also denied"
    );
    assert_eq!(
        w.shutdown_and_usage().await,
        Vec::<u64>::new(),
        "I8: no event"
    );
}

/// Polls `future` once; `Some` if it completed.
async fn futures_poll_once<F: std::future::Future + ?Sized>(
    future: std::pin::Pin<&mut F>,
) -> Option<F::Output> {
    let mut future = Some(future);
    std::future::poll_fn(move |cx| {
        let polled = future.take().expect("polled once").poll(cx);
        std::task::Poll::Ready(match polled {
            std::task::Poll::Ready(output) => Some(output),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

/// I4, I23: with `tower::ServiceBuilder` and a concurrency limit inside the
/// layer, admission still happens at the outer edge. A request without a
/// usable key is refused at once, not after the limit frees up; a funded
/// one waits for the limit already admitted, holding its reservation; one
/// given up while it waits pays nothing, and one that gets through pays in
/// full. The same in the default commit mode and with a commit marker.
#[tokio::test(start_paused = true)]
async fn under_service_builder_a_limit_inside_the_layer_queues_only_admitted_requests() {
    for deferred in [false, true] {
        let mut w = world(INITIAL).await;
        let before = w.remaining();
        let (release, released) = tokio::sync::watch::channel(false);
        let handler = service_fn(move |request: Request<String>| {
            let mut released = released.clone();
            async move {
                // The first request holds the limit until released.
                if request.uri().path() == "/hold" {
                    released.wait_for(|go| *go).await.unwrap();
                }
                echo_admission(request).await
            }
        });
        let layer = if deferred {
            w.deferred_layer()
        } else {
            w.layer()
        };
        let service = tower::ServiceBuilder::new()
            .layer(layer)
            .layer(tower::limit::ConcurrencyLimitLayer::new(1))
            .layer(tollgate::layer::CommitMarkerLayer::new())
            .service(handler);

        let holder = tokio::spawn(service.clone().oneshot(w.bearer("/hold")));
        tokio::time::sleep(ms(10)).await;
        let mut queued = tokio::spawn(service.clone().oneshot(w.bearer("/read")));
        tokio::time::sleep(ms(10)).await;
        assert!(
            !queued.is_finished(),
            "the second request waits for the limit"
        );
        assert_eq!(
            w.handle.counters().admitted,
            2,
            "deferred: {deferred}: it waits admitted"
        );
        assert_eq!(w.remaining(), before - 2 * PRICE, "both hold their price");

        // A bad key does not wait behind the limit.
        let refused = tokio::time::timeout(
            ms(1),
            service
                .clone()
                .oneshot(request("/read", &[(AUTHORIZATION, b"Bearer tg_unknown")])),
        )
        .await
        .expect("refused without waiting")
        .unwrap();
        check_denial(
            &answer(refused).await,
            StatusCode::UNAUTHORIZED,
            "unknown_principal",
        );

        // Given up while it waits: its price comes back.
        queued.abort();
        let _ = (&mut queued).await;
        assert_eq!(
            w.remaining(),
            before - PRICE,
            "I4: the queued request paid nothing"
        );

        // Another one waits, then gets through once the holder finishes.
        let waiting = tokio::spawn(service.clone().oneshot(w.bearer("/read")));
        tokio::time::sleep(ms(10)).await;
        release.send(true).unwrap();
        assert_eq!(
            answer(holder.await.unwrap().unwrap()).await.status,
            StatusCode::OK
        );
        assert_eq!(
            answer(waiting.await.unwrap().unwrap()).await.status,
            StatusCode::OK
        );
        assert_eq!(
            w.shutdown_and_usage().await,
            vec![PRICE, PRICE],
            "deferred: {deferred}: the two that ran paid once each"
        );
    }
}

/// I37: a request yields once (pending, having woken its own task) before
/// its charge commits if it waited (here, for a concurrency limit inside the
/// layer) or came over HTTP/2, so the server can look at its client first;
/// one that did neither commits and runs at its first poll. Dropped during
/// the yield it pays nothing. The same in the default commit mode and with
/// a commit marker. Polled by hand, to count every pending poll.
#[tokio::test(start_paused = true)]
async fn a_request_yields_once_before_its_commit_only_if_it_waited_or_came_over_http2() {
    use support::yields::poll_by_hand;
    for deferred in [false, true] {
        let mut w = world(INITIAL).await;
        let ran = Arc::new(AtomicUsize::new(0));
        let (release, released) = tokio::sync::watch::channel(false);
        let handler = {
            let ran = Arc::clone(&ran);
            service_fn(move |request: Request<String>| {
                let (ran, mut released) = (Arc::clone(&ran), released.clone());
                async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    if request.uri().path() == "/hold" {
                        released.wait_for(|go| *go).await.unwrap();
                    }
                    echo_admission(request).await
                }
            })
        };
        let layer = if deferred {
            w.deferred_layer()
        } else {
            w.layer()
        };
        let service = tower::ServiceBuilder::new()
            .layer(layer)
            .layer(tower::limit::ConcurrencyLimitLayer::new(1))
            .layer(tollgate::layer::CommitMarkerLayer::new())
            .service(handler);
        let ran = || ran.load(Ordering::SeqCst);

        // HTTP/1.1, never waiting: committed and run at the first poll.
        let mut plain = std::pin::pin!(service.clone().oneshot(w.bearer("/read")));
        let (answered, wakes) = poll_by_hand(plain.as_mut());
        assert!(answered.is_some(), "deferred: {deferred}: done at once");
        assert_eq!((wakes, ran()), (0, 1), "deferred: {deferred}: no yield");

        // HTTP/2: one yield first, then the commit and the handler.
        let mut http2 = w.bearer("/read");
        *http2.version_mut() = http::Version::HTTP_2;
        let mut http2 = std::pin::pin!(service.clone().oneshot(http2));
        let (answered, wakes) = poll_by_hand(http2.as_mut());
        assert!(answered.is_none(), "deferred: {deferred}: HTTP/2 yields");
        assert_eq!((wakes, ran()), (1, 1), "deferred: {deferred}: not run yet");
        let (answered, wakes) = poll_by_hand(http2.as_mut());
        assert!(answered.is_some());
        assert_eq!((wakes, ran()), (0, 2), "deferred: {deferred}: then runs");

        // HTTP/1.1 waiting for the limit: no yield while it waits, one
        // once the limit lets it through, then the commit.
        let mut holder = std::pin::pin!(service.clone().oneshot(w.bearer("/hold")));
        assert_eq!(poll_by_hand(holder.as_mut()).1, 0);
        assert_eq!(ran(), 3, "deferred: {deferred}: the holder runs");
        let mut waiting = std::pin::pin!(service.clone().oneshot(w.bearer("/read")));
        let (answered, wakes) = poll_by_hand(waiting.as_mut());
        assert!(answered.is_none());
        assert_eq!(
            (wakes, ran()),
            (0, 3),
            "deferred: {deferred}: waits quietly"
        );
        release.send(true).unwrap();
        assert!(poll_by_hand(holder.as_mut()).0.is_some(), "the holder ends");
        let (answered, wakes) = poll_by_hand(waiting.as_mut());
        assert!(
            answered.is_none(),
            "deferred: {deferred}: it waited, so yields"
        );
        assert_eq!((wakes, ran()), (1, 3), "deferred: {deferred}: not run yet");
        let (answered, wakes) = poll_by_hand(waiting.as_mut());
        assert!(answered.is_some());
        assert_eq!((wakes, ran()), (0, 4), "deferred: {deferred}: then runs");

        // Dropped during its yield: released, unpaid, its handler never run.
        let mut http2 = w.bearer("/read");
        *http2.version_mut() = http::Version::HTTP_2;
        let mut dropped = Box::pin(service.clone().oneshot(http2));
        assert_eq!(poll_by_hand(dropped.as_mut()).1, 1);
        drop(dropped);
        assert_eq!(ran(), 4, "deferred: {deferred}: never run");
        let counters = w.handle.counters();
        assert_eq!((counters.admitted, counters.released), (5, 1));
        assert_eq!(
            w.shutdown_and_usage().await,
            vec![PRICE; 4],
            "deferred: {deferred}: the four that ran paid once each"
        );
    }
}

/// An extractor that waits for a permit from its gate before it succeeds:
/// a per-route limit taken as an extractor.
struct GatedExtractor;

/// [`GatedExtractor`]'s gate; each test that uses it adds exactly the permits it
/// takes.
static GATE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

impl<S: Send + Sync> axum::extract::FromRequest<S> for GatedExtractor {
    type Rejection = StatusCode;

    async fn from_request(_: axum::extract::Request, _: &S) -> Result<Self, StatusCode> {
        GATE.acquire().await.unwrap().forget();
        Ok(Self)
    }
}

/// I37 at a `Charged` extractor: a request whose wrapped extractor waits
/// (for a gate here) yields once after the extractor succeeds and before the
/// charge commits, over HTTP/1.1 as over HTTP/2; the handler runs, and the
/// request pays, only at the poll after the yield. Polled by hand.
#[tokio::test(start_paused = true)]
async fn a_charged_extractor_that_waited_yields_once_before_its_commit() {
    use support::yields::poll_by_hand;
    use tollgate::layer::Charged;
    for version in [http::Version::HTTP_11, http::Version::HTTP_2] {
        let mut w = world(INITIAL).await;
        let ran = Arc::new(AtomicUsize::new(0));
        let layer = w.deferred_layer();
        let app = axum::Router::new()
            .route(
                "/read",
                axum::routing::get({
                    let ran = Arc::clone(&ran);
                    move |Charged(GatedExtractor): Charged<GatedExtractor>| async move {
                        ran.fetch_add(1, Ordering::SeqCst);
                        "ran"
                    }
                }),
            )
            .layer(layer);
        let mut request = w.bearer("/read").map(axum::body::Body::from);
        *request.version_mut() = version;
        let mut future = Box::pin(app.oneshot(request));
        let ran = || ran.load(Ordering::SeqCst);

        let (answered, wakes) = poll_by_hand(future.as_mut());
        assert!(answered.is_none(), "{version:?}: the extractor waits");
        assert_eq!(wakes, 0, "{version:?}: no yield before the extractor");
        GATE.add_permits(1);
        let (answered, wakes) = poll_by_hand(future.as_mut());
        assert!(answered.is_none(), "{version:?}: it waited, so it yields");
        assert_eq!((wakes, ran()), (1, 0), "{version:?}: not committed yet");
        let (answered, wakes) = poll_by_hand(future.as_mut());
        assert_eq!(answered.unwrap().unwrap().status(), StatusCode::OK);
        assert_eq!((wakes, ran()), (0, 1), "{version:?}: then it runs");
        assert_eq!(
            w.shutdown_and_usage().await,
            vec![PRICE],
            "{version:?}: and pays once"
        );
    }
}

/// I25: once shutdown begins, no handler starts. A request admitted before
/// it and waiting for a concurrency limit inside the layer is refused where
/// it would have been charged (the hand-over in the default commit mode,
/// the marker in the deferred one) with `503 shutting_down`, naming its id,
/// and pays nothing; the request already running finishes and pays once.
#[tokio::test(start_paused = true)]
async fn a_request_waiting_inside_the_layer_when_shutdown_begins_never_starts() {
    for deferred in [false, true] {
        let mut w = world(INITIAL).await;
        let before = w.remaining();
        let (release, released) = tokio::sync::watch::channel(false);
        let started = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&started);
        let handler = service_fn(move |request: Request<String>| {
            let mut released = released.clone();
            let counted = Arc::clone(&counted);
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                released.wait_for(|go| *go).await.unwrap();
                echo_admission(request).await
            }
        });
        let layer = if deferred {
            w.deferred_layer()
        } else {
            w.layer()
        };
        let service = tower::ServiceBuilder::new()
            .layer(layer)
            .layer(tower::limit::ConcurrencyLimitLayer::new(1))
            .layer(tollgate::layer::CommitMarkerLayer::new())
            .service(handler);
        let running = tokio::spawn(service.clone().oneshot(w.bearer("/read")));
        tokio::time::sleep(ms(10)).await;
        let waiting = tokio::spawn(service.clone().oneshot(w.bearer("/read")));
        tokio::time::sleep(ms(10)).await;
        assert_eq!(started.load(Ordering::SeqCst), 1, "deferred: {deferred}");
        assert_eq!(w.remaining(), before - 2 * PRICE, "both were admitted");
        assert_eq!(
            w.handle.report().usage_places_reserved,
            1,
            "the waiting request holds its event's place"
        );

        w.handle.request_shutdown();
        release.send(true).unwrap();
        let running = answer(running.await.unwrap().unwrap()).await;
        assert_eq!(running.status, StatusCode::OK, "deferred: {deferred}");
        let refused = answer(waiting.await.unwrap().unwrap()).await;
        check_denial(&refused, StatusCode::SERVICE_UNAVAILABLE, "shutting_down");
        assert_eq!(refused.headers[RETRY_AFTER], "1");
        assert!(
            refused.headers.contains_key(REQUEST_ID_HEADER),
            "an admitted request's refusal names its id"
        );
        assert_eq!(
            started.load(Ordering::SeqCst),
            1,
            "deferred: {deferred}: the waiting handler never started"
        );
        assert_eq!(w.remaining(), before - PRICE, "its price came back");
        assert_eq!(w.handle.report().usage_places_reserved, 0, "and its place");
        let counters = w.handle.counters();
        assert_eq!(
            (
                counters.admitted,
                counters.denied_for(DenyReason::ShuttingDown),
                counters.released
            ),
            (2, 1, 0),
            "deferred: {deferred}: admitted twice, refused once at its commit point"
        );
        assert_eq!(
            w.shutdown_and_usage().await,
            vec![PRICE],
            "deferred: {deferred}: only the running request paid"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_lease_that_expires_between_admission_and_start_denies_without_running_the_handler() {
    let mut w = world(INITIAL).await;
    let handler_ran = Arc::new(AtomicBool::new(false));
    let ran = Arc::clone(&handler_ran);
    let mut service = w.layer().layer(service_fn(move |request: Request<String>| {
        let ran = Arc::clone(&ran);
        async move {
            ran.store(true, Ordering::SeqCst);
            echo_admission(request).await
        }
    }));
    let future = service.ready().await.unwrap().call(w.bearer("/read"));
    // The lease's usable window closes before the first poll.
    w.clock.advance(LEASE_TTL);
    let answer = answer(future.await.unwrap()).await;
    check_denial(
        &answer,
        StatusCode::SERVICE_UNAVAILABLE,
        "funding_expired_at_start",
    );
    assert_eq!(answer.headers[RETRY_AFTER], "1");
    assert!(
        answer.headers.contains_key(REQUEST_ID_HEADER),
        "an admitted request's denial names its id"
    );
    assert!(
        !handler_ran.load(Ordering::SeqCst),
        "I2, I9: the handler never starts on expired funding"
    );
    let counters = w.handle.counters();
    assert_eq!(counters.admitted, 1, "admitted, then refused at start");
    assert_eq!(
        counters.denied_for(tollgate::DenyReason::FundingExpiredAtStart),
        1
    );
    assert_eq!(
        w.shutdown_and_usage().await,
        Vec::<u64>::new(),
        "I8: no event"
    );
}

/// A service's clones (one per connection, under hyper) are one layer: the
/// same pricing, the same policy revision on the events, and request ids
/// that never repeat between them (I8).
#[tokio::test(start_paused = true)]
async fn clones_of_the_service_price_alike_and_never_repeat_a_request_id() {
    let mut w = world(INITIAL).await;
    let before = w.remaining();
    let service = w.layer().layer(service_fn(echo_admission));
    let mut bodies = Vec::new();
    for clone in [service.clone(), service.clone(), service] {
        let answered = answer(clone.oneshot(w.bearer("/read")).await.unwrap()).await;
        assert_eq!(answered.status, StatusCode::OK, "{}", answered.body);
        bodies.push(answered.body);
    }
    let fields: Vec<Vec<&str>> = bodies
        .iter()
        .map(|body| body.split(' ').collect())
        .collect();
    assert!(
        fields.iter().all(|f| f[0] == PRICE.to_string()),
        "{bodies:?}"
    );
    let ids: std::collections::HashSet<&str> = fields.iter().map(|f| f[2]).collect();
    assert_eq!(ids.len(), 3, "distinct request ids: {bodies:?}");
    assert_eq!(w.remaining(), before - 3 * PRICE);
    // `shutdown_and_usage` checks every event carries the layer's revision.
    assert_eq!(w.shutdown_and_usage().await, vec![PRICE; 3]);
    let billed: std::collections::HashSet<String> = w
        .store
        .usage(w.account)
        .unwrap()
        .iter()
        .map(|event| tollgate::RequestId::get(event.request_id).to_string())
        .collect();
    assert_eq!(billed.len(), 3, "one event per request id");
}

#[tokio::test(start_paused = true)]
async fn requests_without_a_usable_key_get_401_with_a_bearer_challenge() {
    let w = world(INITIAL).await;
    let oversized = format!("Bearer {}", "k".repeat(MAX_KEY_BYTES + 1));
    let cases: Vec<(Request<String>, &str)> = vec![
        (request("/read", &[]), "missing_credential"),
        (
            request("/read", &[(AUTHORIZATION, b"Basic dXNlcjpwYXNz")]),
            "malformed_credential",
        ),
        (
            request("/read", &[(AUTHORIZATION, b"Bearer ")]),
            "malformed_credential",
        ),
        (
            request("/read", &[(AUTHORIZATION, oversized.as_bytes())]),
            "malformed_credential",
        ),
        (
            request("/read", &[(AUTHORIZATION, b"Bearer tg_\xff\xfe\x80")]),
            "malformed_credential",
        ),
        (
            request(
                "/read",
                &[
                    (AUTHORIZATION, format!("Bearer {}", w.key).as_bytes()),
                    (AUTHORIZATION, b"Bearer tg_other"),
                ],
            ),
            "malformed_credential",
        ),
        (
            request("/read", &[(AUTHORIZATION, b"Bearer tg_not_a_real_key")]),
            "unknown_principal",
        ),
        (
            request(
                "/read",
                &[(http::HeaderName::from_static("x-api-key"), b"tg_nope")],
            ),
            "unknown_principal",
        ),
    ];
    for (request, code) in cases {
        let answer = send(&w, request).await;
        check_denial(&answer, StatusCode::UNAUTHORIZED, code);
        assert_eq!(
            answer.headers[WWW_AUTHENTICATE],
            "Bearer realm=\"tollgate\""
        );
        assert!(
            !answer.headers.contains_key(REQUEST_ID_HEADER),
            "no request id for a caller that was not identified"
        );
        assert!(
            !answer.headers.contains_key(RATE_LIMIT),
            "no balance figure for an unauthenticated caller"
        );
    }
    let counters = w.handle.counters();
    assert_eq!(counters.admitted, 0);
    // Refusals the layer decides itself are counted with the engine's.
    assert_eq!(
        counters.denied_for(tollgate::DenyReason::MissingCredential),
        1
    );
    assert_eq!(
        counters.denied_for(tollgate::DenyReason::MalformedCredential),
        5
    );
    assert_eq!(
        counters.denied_for(tollgate::DenyReason::UnknownPrincipal),
        2
    );
}

#[tokio::test(start_paused = true)]
async fn the_api_key_header_is_accepted_when_there_is_no_authorization() {
    let w = world(INITIAL).await;
    let answer = send(
        &w,
        request(
            "/read",
            &[(http::HeaderName::from_static("x-api-key"), w.key.as_bytes())],
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
}

/// A refused HTTP/1 request with a body the layer will not read is told
/// the connection closes, so a keep-alive client does not write its next
/// request into a connection the server drops; a request without a body,
/// an admitted one, or an HTTP/2 one is not.
#[tokio::test(start_paused = true)]
async fn a_refused_request_with_an_unread_body_is_told_the_connection_closes() {
    let w = world(INITIAL).await;
    let post = |version: http::Version, key: Option<&str>, framing: (&str, &str)| {
        let mut request = Request::builder()
            .method("POST")
            .uri("/write")
            .version(version)
            .header(framing.0, framing.1)
            .body("hello".to_owned())
            .unwrap();
        if let Some(key) = key {
            request.headers_mut().insert(
                AUTHORIZATION,
                HeaderValue::from_str(&format!("Bearer {key}")).unwrap(),
            );
        }
        request
    };
    let closes = |answer: &Answer| {
        answer
            .headers
            .get(http::header::CONNECTION)
            .map(|value| value.to_str().unwrap().to_owned())
    };
    let close = Some("close".to_owned());
    let length = ("content-length", "5");
    let chunked = ("transfer-encoding", "chunked");
    for version in [http::Version::HTTP_10, http::Version::HTTP_11] {
        // Refused before the key is looked up, and after (403: `/write`
        // needs a permission the key lacks).
        let answer = send(&w, post(version, None, length)).await;
        check_denial(&answer, StatusCode::UNAUTHORIZED, "missing_credential");
        assert_eq!(closes(&answer), close, "{version:?}");
        let answer = send(&w, post(version, Some(&w.key), chunked)).await;
        check_denial(&answer, StatusCode::FORBIDDEN, "permission_denied");
        assert_eq!(closes(&answer), close, "{version:?}");
    }
    let answer = send(
        &w,
        post(http::Version::HTTP_11, None, ("content-length", "0")),
    )
    .await;
    assert_eq!(closes(&answer), None, "no body");
    let answer = send(&w, request("/read", &[])).await;
    check_denial(&answer, StatusCode::UNAUTHORIZED, "missing_credential");
    assert_eq!(closes(&answer), None, "no body");
    let answer = send(&w, post(http::Version::HTTP_2, None, length)).await;
    check_denial(&answer, StatusCode::UNAUTHORIZED, "missing_credential");
    assert_eq!(closes(&answer), None, "HTTP/2 closes no connection");
    let mut admitted = post(http::Version::HTTP_11, Some(&w.key), length);
    *admitted.uri_mut() = "/read".parse().unwrap();
    let answer = send(&w, admitted).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(closes(&answer), None, "admitted: the handler has the body");

    // A commit refused at the hand-over, and at a deferred commit point:
    // admitted, then the instance begins to shut down.
    let mut at_hand_over = w.layer().layer(service_fn(echo_admission));
    let mut deferred = w
        .deferred_layer()
        .layer(CommitMarkerLayer::new().layer(service_fn(echo_admission)));
    let read = |key: &str| {
        let mut request = post(http::Version::HTTP_11, Some(key), length);
        *request.uri_mut() = "/read".parse().unwrap();
        request
    };
    let refused_at_hand_over = at_hand_over.ready().await.unwrap().call(read(&w.key));
    let refused_in_handler = deferred.ready().await.unwrap().call(read(&w.key));
    w.handle.request_shutdown();
    for refused in [
        crate::answer(refused_at_hand_over.await.unwrap()).await,
        crate::answer(refused_in_handler.await.unwrap()).await,
    ] {
        check_denial(&refused, StatusCode::SERVICE_UNAVAILABLE, "shutting_down");
        assert_eq!(closes(&refused), close, "a refused commit");
    }
}

#[tokio::test(start_paused = true)]
async fn a_key_without_the_route_permission_gets_403_and_pays_nothing() {
    let w = world(INITIAL).await;
    let before = w.remaining();
    let answer = send(&w, w.bearer("/write")).await;
    check_denial(&answer, StatusCode::FORBIDDEN, "permission_denied");
    assert_eq!(w.remaining(), before);
    identified_denial(&answer);
    assert!(!answer.headers.contains_key(RATE_LIMIT));
}

/// A denial after the key was identified carries a request id to quote, in
/// the header and in the problem document alike.
#[track_caller]
fn identified_denial(answer: &Answer) {
    let id = answer.headers[REQUEST_ID_HEADER].to_str().unwrap();
    assert!(id.starts_with("req_"), "{id}");
    assert!(
        answer.body.contains(&format!("\"request_id\":\"{id}\"")),
        "{}",
        answer.body
    );
}

#[tokio::test(start_paused = true)]
async fn an_account_with_no_balance_gets_402_that_is_not_cached() {
    let w = world(0).await;
    let answer = send(&w, w.bearer("/read")).await;
    check_denial(&answer, StatusCode::PAYMENT_REQUIRED, "balance_exhausted");
    assert_eq!(answer.headers[CACHE_CONTROL], "no-store");
    assert!(
        !answer.headers.contains_key(RETRY_AFTER),
        "no refill schedule, so no date to retry at"
    );
    identified_denial(&answer);
    // The one true number: nothing is left, and no refill is scheduled.
    assert_eq!(answer.headers[RATE_LIMIT], "\"balance\";r=0");
}

#[tokio::test(start_paused = true)]
async fn an_empty_balance_that_refills_says_when_in_retry_after_and_ratelimit() {
    let w = world(0).await;
    let refill = RefillSchedule {
        amount: CostUnits(500),
        interval: SignedDuration::from_secs(3_600),
    };
    let now = w.clock.now();
    w.store
        .configure_refill(w.account, Some(refill), now)
        .unwrap();
    // The lease manager's next acquire brings the allocator's evidence,
    // which names the period end.
    tokio::time::sleep(ms(20_000)).await;
    // Ten seconds into the period on the runtime's clock.
    w.clock
        .set(now.checked_add(SignedDuration::from_secs(10)).unwrap());
    let answer = send(&w, w.bearer("/read")).await;
    check_denial(&answer, StatusCode::PAYMENT_REQUIRED, "balance_exhausted");
    let period_end = now.checked_add(refill.interval).unwrap();
    assert_eq!(
        answer.headers[RETRY_AFTER].to_str().unwrap(),
        jiff::fmt::rfc2822::DateTimePrinter::new()
            .timestamp_to_rfc9110_string(&period_end)
            .unwrap()
    );
    assert_eq!(answer.headers[RATE_LIMIT], "\"balance\";r=0;t=3590");
    identified_denial(&answer);
}

#[tokio::test(start_paused = true)]
async fn each_admission_is_one_span_with_route_key_prefix_and_outcome_never_the_key() {
    let w = world(INITIAL).await;
    let spans = SpanLog::default();
    let _subscriber =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let admitted = send(&w, w.bearer("/read")).await;
    assert_eq!(admitted.status, StatusCode::OK);
    let denied = send(&w, w.bearer("/write")).await;
    assert_eq!(denied.status, StatusCode::FORBIDDEN);
    let anonymous = send(&w, request("/read", &[])).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);

    let spans = spans.0.lock().unwrap().clone();
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let prefix = &w.key[..11];
    let first = &spans[0];
    assert_eq!(first["route"], "/read");
    assert_eq!(first["key_prefix"], prefix);
    assert_eq!(first["account"], w.account.get().to_string());
    assert_eq!(first["units"], PRICE.to_string());
    assert_eq!(first["outcome"], "admitted");
    assert_eq!(
        first["request_id"],
        admitted.headers[REQUEST_ID_HEADER].to_str().unwrap()
    );
    assert_eq!(spans[1]["route"], "/write");
    assert_eq!(spans[1]["outcome"], "permission_denied");
    assert_eq!(
        spans[1]["request_id"],
        denied.headers[REQUEST_ID_HEADER].to_str().unwrap()
    );
    assert_eq!(spans[2]["outcome"], "missing_credential");
    assert!(!spans[2].contains_key("key_prefix"));
    for span in &spans {
        assert!(
            span.values().all(|value| !value.contains(&w.key)),
            "the key never reaches a span: {span:?}"
        );
    }
}

/// I16: at every level, in every event and span the layer and the runtime
/// behind it emit, an API key appears at most as its public prefix: never
/// whole, and never its secret part.
#[tokio::test(start_paused = true)]
async fn no_event_or_span_at_any_level_carries_the_key() {
    let w = world(INITIAL).await;
    let logs = support::logs::Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::FULL)
        .finish();
    let guard = tracing::subscriber::set_default(subscriber);
    assert_eq!(send(&w, w.bearer("/read")).await.status, StatusCode::OK);
    assert_eq!(
        send(&w, w.bearer("/write")).await.status,
        StatusCode::FORBIDDEN
    );
    let unknown = format!("{}x", &w.key[..w.key.len() - 1]);
    let bearer = format!("Bearer {unknown}");
    let refused = send(&w, request("/read", &[(AUTHORIZATION, bearer.as_bytes())])).await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    drop(guard);

    let text = logs.text();
    assert!(
        text.contains("tollgate.admission"),
        "the capture heard the layer: {text}"
    );
    let secret = &w.key[11..];
    // As it would print if logged as bytes rather than text: their debug
    // list (without its brackets, so a part of a key matches too) and hex.
    let bytes = |text: &str| {
        let listed = format!("{:?}", text.as_bytes());
        listed[1..listed.len() - 1].to_owned()
    };
    let hex = |text: &str| {
        text.bytes().fold(String::new(), |mut hex, byte| {
            let _ = write!(hex, "{byte:02x}");
            hex
        })
    };
    for (what, needle) in [
        ("the key", w.key.clone()),
        ("its secret part", secret.to_owned()),
        ("an unknown key", unknown.clone()),
        ("an unknown key's secret part", unknown[11..].to_owned()),
        ("its secret part's bytes", bytes(secret)),
        ("its secret part in hex", hex(secret)),
        ("an unknown key's bytes", bytes(&unknown[11..])),
    ] {
        assert!(
            !text.contains(&needle),
            "I16: {what} reached the logs: {}",
            support::logs::Logs::lines(&text, &needle).join("\n")
        );
    }
}

/// Records the fields of every `tollgate.admission` span.
#[derive(Clone, Default)]
struct SpanLog(Arc<Mutex<Vec<BTreeMap<String, String>>>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S> tracing_subscriber::Layer<S> for SpanLog
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() != "tollgate.admission" {
            return;
        }
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        fields.insert("#id".to_owned(), id.into_u64().to_string());
        self.0.lock().unwrap().push(fields);
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut spans = self.0.lock().unwrap();
        let id = id.into_u64().to_string();
        if let Some(fields) = spans.iter_mut().rev().find(|fields| fields["#id"] == id) {
            values.record(&mut Fields(fields));
        }
    }
}

/// A shutting-down instance refuses before it looks the key up, so a valid
/// key and a made-up one get the same answer, with no request id, and both
/// refusals are counted.
#[tokio::test(start_paused = true)]
async fn a_shutting_down_instance_answers_503_with_retry_after() {
    let mut w = world(INITIAL).await;
    w.handle.request_shutdown();
    let made_up = request(
        "/read",
        &[(AUTHORIZATION, b"Bearer tg_not_a_real_key".as_slice())],
    );
    for request in [w.bearer("/read"), made_up] {
        let answer = send(&w, request).await;
        check_denial(&answer, StatusCode::SERVICE_UNAVAILABLE, "shutting_down");
        assert_eq!(answer.headers[RETRY_AFTER], "1");
        assert!(!answer.headers.contains_key(REQUEST_ID_HEADER));
    }
    let counters = w.handle.counters();
    assert_eq!(counters.denied_for(tollgate::DenyReason::ShuttingDown), 2);
    assert_eq!(counters.denied_total(), 2);
    assert_eq!(w.shutdown_and_usage().await, Vec::<u64>::new());
}

/// Policy the source has not yet answered for: every lookup waits for the
/// gate to open.
struct Gated {
    store: Arc<MemoryStore>,
    open: tokio::sync::watch::Receiver<bool>,
}

impl Gated {
    async fn opened(&self) {
        let mut open = self.open.clone();
        open.wait_for(|open| *open).await.unwrap();
    }
}

#[async_trait::async_trait]
impl SnapshotSource for Gated {
    async fn fetch(
        &self,
        principals: &[tollgate::Principal],
        now: Timestamp,
    ) -> Result<Vec<tollgate::PrincipalSnapshot>, StoreError> {
        self.opened().await;
        self.store.fetch(principals, now).await
    }

    async fn changed_since(
        &self,
        since: SnapshotCursor,
        limit: usize,
        now: Timestamp,
    ) -> Result<SnapshotPage, StoreError> {
        self.opened().await;
        self.store.changed_since(since, limit, now).await
    }

    async fn lookup_key(
        &self,
        hash: &tollgate::KeyHash,
        now: Timestamp,
    ) -> Result<Option<tollgate::PrincipalSnapshot>, StoreError> {
        self.opened().await;
        self.store.lookup_key(hash, now).await
    }
}

/// A revoked key is refused as such (401, `key_revoked`, never to be
/// retried), charged nothing, and, not being an identified caller, gets no
/// request id and no balance figure.
#[tokio::test(start_paused = true)]
async fn a_revoked_key_is_refused_without_a_request_id() {
    let mut w = world(INITIAL).await;
    let now = w.clock.now();
    let issued = w.store.issue_key(w.account, READ, now).unwrap();
    let bearer = format!("Bearer {}", issued.key.expose());
    let with_key = || request("/read", &[(AUTHORIZATION, bearer.as_bytes())]);
    // The next refresh brings the key.
    tokio::time::sleep(ms(1_100)).await;
    assert_eq!(send(&w, with_key()).await.status, StatusCode::OK);
    w.store.revoke_key(issued.key_id, now).unwrap();
    tokio::time::sleep(ms(1_100)).await;
    let before = w.remaining();

    let answer = send(&w, with_key()).await;
    check_denial(&answer, StatusCode::UNAUTHORIZED, "key_revoked");
    assert!(!answer.headers.contains_key(REQUEST_ID_HEADER));
    assert!(!answer.headers.contains_key(RATE_LIMIT));
    assert!(
        !answer.headers.contains_key(RETRY_AFTER),
        "never to be retried"
    );
    assert_eq!(w.remaining(), before, "nothing charged");
    assert_eq!(
        w.handle
            .counters()
            .denied_for(tollgate::DenyReason::KeyRevoked),
        1
    );
    assert_eq!(w.shutdown_and_usage().await, vec![PRICE]);
}

/// I24: before the first complete load of policy, a key the instance has
/// not heard of may be a valid one: it is refused as not loaded yet (503,
/// retry), never as unknown (401, which tells a client its key is bad).
/// Once policy is loaded, the same key is admitted and a made-up one is
/// unknown.
#[tokio::test(start_paused = true)]
async fn a_valid_key_before_policy_is_loaded_gets_503_not_401() {
    let (open, gate) = tokio::sync::watch::channel(false);
    let mut w = world_with(INITIAL, |store| Arc::new(Gated { store, open: gate })).await;
    let made_up = || {
        request(
            "/read",
            &[(AUTHORIZATION, b"Bearer tg_not_a_real_key".as_slice())],
        )
    };
    for request in [w.bearer("/read"), made_up()] {
        let answer = send(&w, request).await;
        check_denial(
            &answer,
            StatusCode::SERVICE_UNAVAILABLE,
            "snapshot_unavailable",
        );
        assert!(answer.headers.contains_key(RETRY_AFTER));
        assert!(!answer.headers.contains_key(WWW_AUTHENTICATE));
        assert!(
            !answer.headers.contains_key(REQUEST_ID_HEADER),
            "the key was not identified"
        );
    }
    assert_eq!(
        w.handle
            .counters()
            .denied_for(tollgate::DenyReason::SnapshotUnavailable),
        2
    );

    open.send(true).unwrap();
    tokio::time::sleep(ms(200)).await;
    let admitted = send(&w, w.bearer("/read")).await;
    assert_eq!(admitted.status, StatusCode::OK, "{}", admitted.body);
    let unknown = send(&w, made_up()).await;
    check_denial(&unknown, StatusCode::UNAUTHORIZED, "unknown_principal");
    assert_eq!(w.shutdown_and_usage().await, vec![PRICE]);
}

#[tokio::test(start_paused = true)]
async fn building_a_layer_without_pricing_is_a_named_error() {
    let w = world(INITIAL).await;
    let error = TollgateLayer::builder(w.handle.clone())
        .build()
        .unwrap_err();
    assert_eq!(error, LayerConfigError::MissingPricing);
    assert_eq!(error.to_string(), "layer: no pricing function was given");
}

/// I4: committing in the handler, a route with no commit point runs free
/// (its charge is released when the request ends); the release is counted,
/// so an operator sees admitted requests that were never charged. A
/// charged request counts no release.
#[tokio::test(start_paused = true)]
async fn a_handler_that_answers_without_reaching_its_commit_point_counts_a_release() {
    let mut w = world(INITIAL).await;
    let layer = w.deferred_layer();
    let unmarked = answer(
        layer
            .layer(service_fn(echo_admission))
            .oneshot(w.bearer("/read"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(unmarked.status, StatusCode::OK, "{}", unmarked.body);
    let marked = answer(
        tower::ServiceBuilder::new()
            .layer(layer)
            .layer(tollgate::layer::CommitMarkerLayer::new())
            .service(service_fn(echo_admission))
            .oneshot(w.bearer("/read"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(marked.status, StatusCode::OK, "{}", marked.body);
    let counted = w.handle.counters();
    assert_eq!((counted.admitted, counted.released), (2, 1));
    assert_eq!(w.shutdown_and_usage().await, vec![PRICE], "one charge");
}

/// I17: a policy revision no store can record would get every usage event
/// rejected as malformed, and every charge would run unbilled; the builder
/// refuses it by name. The largest recordable one is accepted.
#[tokio::test(start_paused = true)]
async fn a_policy_revision_no_store_can_record_is_a_named_error() {
    let w = world(INITIAL).await;
    let build = |revision| {
        TollgateLayer::builder(w.handle.clone())
            .price(|_: &http::request::Parts| Price {
                units: CostUnits(PRICE),
                required: READ,
            })
            .policy_revision(revision)
            .build()
            .err()
    };
    assert_eq!(
        build(PolicyRevision(u64::MAX)),
        Some(LayerConfigError::PolicyRevisionTooLarge)
    );
    assert_eq!(
        build(PolicyRevision(PolicyRevision::MAX.get() + 1)),
        Some(LayerConfigError::PolicyRevisionTooLarge)
    );
    assert_eq!(build(PolicyRevision::MAX), None);
}

/// Reads the key from `x-custom-key` only.
struct CustomHeader;

impl KeyExtractor for CustomHeader {
    fn extract<'a>(&self, headers: &'a HeaderMap) -> Result<&'a [u8], tollgate::DenyReason> {
        headers
            .get("x-custom-key")
            .map(HeaderValue::as_bytes)
            .ok_or(tollgate::DenyReason::MissingCredential)
    }
}

#[tokio::test(start_paused = true)]
async fn a_custom_extractor_and_a_closure_renderer_replace_the_defaults() {
    let w = world(INITIAL).await;
    let layer = TollgateLayer::builder(w.handle.clone())
        .price(|_: &http::request::Parts| Price {
            units: CostUnits(PRICE),
            required: READ,
        })
        .identify(CustomHeader)
        .deny_renderer(
            |reason: tollgate::DenyReason, _: Option<tollgate::RequestId>| {
                let mut response = Response::new(DenyBody::new(reason.code()));
                *response.status_mut() = StatusCode::IM_A_TEAPOT;
                response
            },
        )
        .build()
        .unwrap();
    let service = layer.layer(service_fn(echo_admission));
    let denied = answer(service.clone().oneshot(w.bearer("/read")).await.unwrap()).await;
    assert_eq!(denied.status, StatusCode::IM_A_TEAPOT);
    assert_eq!(
        denied.body, "missing_credential",
        "Authorization is not read"
    );
    let admitted = request(
        "/read",
        &[(
            http::HeaderName::from_static("x-custom-key"),
            w.key.as_bytes(),
        )],
    );
    let answer = answer(service.oneshot(admitted).await.unwrap()).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
}

/// The default extractor's rules written out plainly, for the property
/// below to hold the extractor to: duplicates of either header are
/// malformed, `Authorization` wins and must be `Bearer` (any case) and a
/// space, leading spaces before the token are skipped, and a key is 1 to
/// `MAX_KEY_BYTES` visible ASCII bytes.
fn extraction_model(headers: &[(http::HeaderName, Vec<u8>)]) -> Result<Vec<u8>, DenyReason> {
    let values = |name: &http::HeaderName| -> Vec<&Vec<u8>> {
        headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v)
            .collect()
    };
    let (authorization, api_key) = (values(&AUTHORIZATION), values(&X_API_KEY));
    if authorization.len() > 1 || api_key.len() > 1 {
        return Err(DenyReason::MalformedCredential);
    }
    let key: Vec<u8> = match (authorization.first(), api_key.first()) {
        (Some(value), _) => {
            let lower = value.to_ascii_lowercase();
            if !(lower.len() > 7 && lower.starts_with(b"bearer ")) {
                return Err(DenyReason::MalformedCredential);
            }
            value[6..]
                .iter()
                .copied()
                .skip_while(|b| *b == b' ')
                .collect()
        }
        (None, Some(value)) => (*value).clone(),
        (None, None) => return Err(DenyReason::MissingCredential),
    };
    let visible = key.iter().all(|b| (0x21..=0x7E).contains(b));
    if key.is_empty() || key.len() > MAX_KEY_BYTES || !visible {
        return Err(DenyReason::MalformedCredential);
    }
    Ok(key)
}

const X_API_KEY: http::HeaderName = http::HeaderName::from_static("x-api-key");

/// A header as clients send them, right and wrong: its name (0
/// `Authorization`, 1 `x-api-key`, 2 one the extractor ignores) and a value
/// that is mostly what that header should carry, now and then not.
fn header() -> impl Strategy<Value = (u8, Vec<u8>)> {
    let bearer = prop_oneof![
        6 => Just(b"Bearer ".to_vec()),
        2 => Just(b"bEaReR   ".to_vec()),
        1 => Just(b"Bearer".to_vec()),
        1 => Just(b"Basic ".to_vec()),
        1 => Just(Vec::new()),
    ];
    let bare = prop_oneof![
        8 => Just(Vec::new()),
        1 => Just(b"Bearer ".to_vec()),
        1 => Just(b" ".to_vec()),
    ];
    let byte = prop_oneof![
        20 => 0x21_u8..=0x7E,
        1 => Just(b' '),
        1 => any::<u8>(),
    ];
    let body = prop_oneof![
        6 => prop::collection::vec(0x21_u8..=0x7E, 1..64),
        // Around the length limit.
        1 => prop::collection::vec(0x21_u8..=0x7E, 250..260),
        3 => prop::collection::vec(byte, 0..300),
    ];
    let value = |scheme: BoxedStrategy<Vec<u8>>| {
        (scheme, body.clone()).prop_map(|(mut scheme, body)| {
            scheme.extend(body);
            scheme
        })
    };
    prop_oneof![
        2 => value(bearer.clone().boxed()).prop_map(|value| (0_u8, value)),
        2 => value(bare.boxed()).prop_map(|value| (1_u8, value)),
        1 => value(bearer.boxed()).prop_map(|value| (2_u8, value)),
    ]
}

proptest! {
    /// Whatever the headers, the extractor answers as the model does, and
    /// never panics.
    #[test]
    fn extracting_a_key_from_arbitrary_headers_follows_the_documented_rules(
        headers in prop::collection::vec(header(), 0..3)
    ) {
        let mut map = HeaderMap::new();
        let mut sent = Vec::new();
        for (name, value) in headers {
            let name = match name {
                0 => AUTHORIZATION,
                1 => X_API_KEY,
                _ => http::HeaderName::from_static("x-other"),
            };
            // What HTTP cannot carry never reaches the extractor.
            if let Ok(header) = HeaderValue::from_bytes(&value) {
                map.append(name.clone(), header);
                sent.push((name, value));
            }
        }
        let extracted = BearerOrApiKey.extract(&map).map(<[u8]>::to_vec);
        prop_assert_eq!(extracted, extraction_model(&sent));
    }
}

/// The property above reaches every answer, not only the refusals.
#[test]
fn the_extraction_property_draws_keys_it_accepts() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = prop::collection::vec(header(), 0..3);
    let mut accepted = 0;
    for _ in 0..256 {
        let headers = strategy.new_tree(&mut runner).unwrap().current();
        let named: Vec<_> = headers
            .into_iter()
            // As the property sends them: what HTTP cannot carry is left out.
            .filter(|(_, value)| HeaderValue::from_bytes(value).is_ok())
            .map(|(name, value)| match name {
                0 => (AUTHORIZATION, value),
                1 => (X_API_KEY, value),
                _ => (http::HeaderName::from_static("x-other"), value),
            })
            .collect();
        accepted += usize::from(extraction_model(&named).is_ok());
    }
    assert!(
        accepted > 64,
        "only {accepted} of 256 cases drew a usable key"
    );
}

#[tokio::test(start_paused = true)]
async fn an_axum_handler_reads_its_admission_and_a_route_outside_the_layer_is_a_500() {
    use axum::body::Body;
    use axum::routing::get;

    async fn charged(admitted: Admitted) -> String {
        format!("{} {}", admitted.units.get(), admitted.request_id)
    }
    let w = world(INITIAL).await;
    let metered = axum::Router::new()
        .route("/read", get(charged))
        .layer(w.layer());
    let bearer = w.bearer("/read");
    let (parts, _) = bearer.into_parts();
    let response = metered
        .oneshot(Request::from_parts(parts, Body::empty()))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let id = response.headers()[REQUEST_ID_HEADER]
        .to_str()
        .unwrap()
        .to_owned();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(String::from_utf8_lossy(&body), format!("7 {id}"));

    let unmetered = axum::Router::new().route("/read", get(charged));
    let response = unmetered
        .oneshot(Request::get("/read").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("not behind a TollgateLayer"));
}

/// I3: tower-http's `Timeout` composed outside the layer the plain
/// `ServiceBuilder` way. It answers a request that ran too long with a
/// response of its own, built on a default body of the service's type, so
/// the layer's body provides one. A handler that started pays in full
/// even though the timeout answers for it; a fast request on the same
/// stack is served as usual.
#[tokio::test(start_paused = true)]
async fn a_timeout_composed_outside_the_layer_answers_and_the_started_handler_pays() {
    use axum::body::Body;
    use axum::routing::get;
    use tower_http::timeout::TimeoutLayer;

    let mut w = world(INITIAL).await;
    let started = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&started);
    let router = axum::Router::new().route(
        "/read",
        get(move |request: Request<Body>| async move {
            counted.fetch_add(1, Ordering::SeqCst);
            if request.uri().query() == Some("slow") {
                tokio::time::sleep(Duration::from_secs(10)).await;
            }
            "done"
        }),
    );
    let service = tower::ServiceBuilder::new()
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            ms(100),
        ))
        .layer(w.layer())
        .service(router);
    let call = |path: &str| {
        let (parts, _) = w.bearer(path).into_parts();
        service
            .clone()
            .oneshot(Request::from_parts(parts, Body::empty()))
    };

    let slow = call("/read?slow").await.unwrap();
    assert_eq!(slow.status(), StatusCode::REQUEST_TIMEOUT);
    let fast = call("/read").await.unwrap();
    assert_eq!(fast.status(), StatusCode::OK);
    assert!(fast.headers().contains_key(REQUEST_ID_HEADER));
    let body = fast.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"done");

    assert_eq!(started.load(Ordering::SeqCst), 2);
    assert_eq!(
        w.shutdown_and_usage().await,
        vec![PRICE, PRICE],
        "both handlers started, so both pay"
    );
    assert!(w.store.audit().unwrap().is_empty());
}

/// I9: a route priced at nothing serves a key whose account has no funds and
/// no lease, and bills it as zero units of overage (I8: its one event); the
/// same key on a priced route is told the truth, 402, and bills nothing.
#[tokio::test(start_paused = true)]
async fn a_free_route_serves_an_account_with_no_funds() {
    let mut w = world(0).await;
    let layer = TollgateLayer::builder(w.handle.clone())
        .price(|parts: &http::request::Parts| Price {
            units: CostUnits(u64::from(parts.uri.path() != "/free")),
            required: READ,
        })
        .build()
        .unwrap();
    let free = answer(
        layer
            .layer(service_fn(echo_admission))
            .oneshot(w.bearer("/free"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(free.status, StatusCode::OK, "{}", free.body);
    assert!(free.body.starts_with("0 "), "{}", free.body);
    let priced = answer(
        layer
            .layer(service_fn(echo_admission))
            .oneshot(w.bearer("/paid"))
            .await
            .unwrap(),
    )
    .await;
    check_denial(&priced, StatusCode::PAYMENT_REQUIRED, "balance_exhausted");
    let report = w.runtime.take().unwrap().shutdown().await;
    assert_eq!(report.lost_events(), 0);
    let events = w.store.usage(w.account).unwrap();
    assert_eq!(events.len(), 1, "one event, the free request's: {events:?}");
    assert_eq!(
        (events[0].units, events[0].source),
        (CostUnits::ZERO, UsageSource::Overage),
        "no lease served it"
    );
    assert_eq!(
        w.handle
            .counters()
            .denied_for(DenyReason::BalanceExhausted { period_end: None }),
        1
    );
}
