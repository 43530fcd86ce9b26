//! A timeout *inside* a deferred-mode tollgate layer, in a real axum server
//! on 127.0.0.1 with real time and raw TCP clients. The stack, outermost
//! first: tollgate (`commit_in_handler`), tower-http's `TimeoutLayer`, a
//! global concurrency limit of one, `CommitMarkerLayer`, the handler.
//!
//! A request the timeout answers while it waits in the limit never reached
//! the commit point, so it is released for zero (I4); a request whose
//! handler had started when the timeout fired was committed at the marker
//! and pays in full (I3).
//!
//! The routes carry their own timeout around the one shared limit: `/slow` a
//! long one, so it holds the limit to the end, and `/work` and `/stuck` a
//! short one (2 s). With one timeout for all, the request holding the
//! limit would always time out first (its deadline started earlier), free
//! the limit, and race the queued request's deadline. `/slow` runs until the
//! test opens its gate and `/stuck` never ends, so no outcome depends on how
//! fast a loaded machine runs: only the short timeout must fire, and it
//! fires eventually.

mod support;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::response::IntoResponse;
use axum::routing::get;
use http::StatusCode;
use support::http::{TestServer, eventually, priced_by_path, wait_started};
use tokio::sync::{Semaphore, mpsc};
use tollgate::layer::CommitMarkerLayer;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::util::MapResponseLayer;
use tower_http::timeout::TimeoutLayer;

const INITIAL: u64 = 10_000;
/// The price of `/work`.
const WORK_PRICE: u64 = 3;
/// The price of `/slow`.
const SLOW_PRICE: u64 = 11;
/// The price of `/stuck`.
const STUCK_PRICE: u64 = 7;
/// The timeout on `/work` and `/stuck`: long enough for the test's checks
/// between a request's admission and its timeout on a loaded machine.
const SHORT_TIMEOUT: Duration = Duration::from_secs(2);
/// The timeout on `/slow`: longer than any test waits for its gate, so
/// `/slow` completes while it holds the limit.
const LONG_TIMEOUT: Duration = Duration::from_secs(300);
/// The status the timeout layer answers with.
const TIMED_OUT: StatusCode = StatusCode::REQUEST_TIMEOUT;

/// The routes under tollgate: `/slow` with the long timeout, `/work` and
/// `/stuck` with the short one, all sharing one limit. `started` gets one
/// message each time `/slow` or `/stuck` starts; `/slow` then waits for a
/// permit of `gate`, and `/stuck` waits for ever.
fn app(started: mpsc::UnboundedSender<()>, gate: Arc<Semaphore>) -> Router {
    let stuck_started = started.clone();
    // One limit shared by every route (a global limit's clones share one
    // semaphore), inside each route's timeout.
    let limit = GlobalConcurrencyLimitLayer::new(1);
    // Later `.layer` calls are outer: the marker innermost, then the limit,
    // then the timeout, with tollgate (deferred) outermost over the merge.
    // `TimeoutLayer` needs a `Default` body, so the inner response is turned
    // into axum's between the limit and the timeout.
    let stack = |router: Router, timeout: Duration| {
        router
            .layer(CommitMarkerLayer::new())
            .layer(limit.clone())
            .layer(MapResponseLayer::new(IntoResponse::into_response))
            .layer(TimeoutLayer::with_status_code(TIMED_OUT, timeout))
    };
    let slow = stack(
        Router::new().route(
            "/slow",
            get(move || async move {
                started.send(()).unwrap();
                gate.acquire().await.expect("the gate stays open").forget();
                "slow"
            }),
        ),
        LONG_TIMEOUT,
    );
    let short = stack(
        Router::new()
            .route("/work", get(|| async { "work" }))
            .route(
                "/stuck",
                get(move || async move {
                    stuck_started.send(()).unwrap();
                    std::future::pending::<()>().await;
                    "stuck"
                }),
            ),
        SHORT_TIMEOUT,
    );
    Router::new().merge(slow).merge(short)
}

/// The server running [`app`] under tollgate, one message each time `/slow`
/// or `/stuck` starts running, and the gate `/slow` waits at.
async fn serve() -> (TestServer, mpsc::UnboundedReceiver<()>, Arc<Semaphore>) {
    let world = support::runtime::start_real_time(INITIAL).await;
    let layer = priced_by_path(&world.handle, |path| match path {
        "/slow" => SLOW_PRICE,
        "/stuck" => STUCK_PRICE,
        _ => WORK_PRICE,
    })
    .commit_in_handler()
    .build()
    .unwrap();
    let (started, slow_started) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let router = app(started, Arc::clone(&gate)).layer(layer);
    (
        TestServer::serve(world, INITIAL, router).await,
        slow_started,
        gate,
    )
}

async fn started(slow_started: &mut mpsc::UnboundedReceiver<()>) {
    wait_started(slow_started, "a slow handler starts").await;
}

fn status(response: &str) -> &str {
    response.split(' ').nth(1).unwrap_or(response)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_times_out_while_queued_inside_the_layer_pays_nothing() {
    let (server, mut slow_started, gate) = serve().await;

    // A: admitted, committed at the marker, its handler holding the limit
    // until the gate opens.
    let slow = server.send("/slow");
    started(&mut slow_started).await;
    let before_queued = server.remaining();

    // B: admitted by tollgate, its short timeout started, then queued in
    // the limit behind A.
    let queued = server.send("/work");
    eventually("the queued request was admitted before it queued", || {
        server.handle.counters().admitted == 2
    })
    .await;
    assert_eq!(
        server.remaining(),
        before_queued - WORK_PRICE,
        "the queued request holds its reservation while it waits"
    );

    // B's timeout fires while A still holds the limit.
    let timed_out = TestServer::read(queued).await;
    assert_eq!(status(&timed_out), TIMED_OUT.as_str(), "{timed_out}");
    assert_eq!(
        server.remaining(),
        before_queued,
        "I4: the timed-out queued request was released for zero"
    );

    gate.add_permits(1);
    let response = TestServer::read(slow).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("slow"), "{response}");

    assert_eq!(
        server.finish().await,
        vec![SLOW_PRICE],
        "I3, I4: the running request paid in full, the one timed out in the queue nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_handler_started_before_the_timeout_pays_in_full() {
    let (server, mut slow_started, _gate) = serve().await;
    // A first request takes the account's lease.
    let response = server.get("/work").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    let before = server.remaining();

    // `/stuck` reaches the marker at once, starts, and runs until its short
    // timeout drops it.
    let stuck = server.send("/stuck");
    started(&mut slow_started).await;
    assert_eq!(
        server.remaining(),
        before - STUCK_PRICE,
        "I3: committed when its handler started"
    );
    let timed_out = TestServer::read(stuck).await;
    assert_eq!(status(&timed_out), TIMED_OUT.as_str(), "{timed_out}");
    assert_eq!(
        server.remaining(),
        before - STUCK_PRICE,
        "the timeout does not undo a committed charge"
    );

    // The timeout dropped the handler and freed the limit: the next
    // request runs.
    let response = server.get("/work").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("work"), "{response}");

    // Usage arrives through two shards, so compare the events unordered.
    let mut units = server.finish().await;
    units.sort_unstable();
    assert_eq!(
        units,
        vec![WORK_PRICE, WORK_PRICE, STUCK_PRICE],
        "I3: the timed-out request whose handler started paid its full price, once"
    );
}
