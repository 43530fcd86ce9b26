//! The deferred commit point in a real axum server on 127.0.0.1, with real
//! time and raw TCP clients: with `TollgateBuilder::commit_in_handler`,
//! admission reserves in the outer layer, a request queued in a concurrency
//! limit *inside* it holds its reservation, and the charge is committed only
//! where the request reaches a `CommitMarkerLayer` or a `Charged` extractor
//! (I3); a request that ends before that is released for zero (I4).

mod support;

use std::sync::Arc;

use axum::Router;
use axum::extract::{FromRequest, Request};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::StatusCode;
use support::http::{TestServer, eventually, priced_by_path, wait_started};
use tokio::sync::{Semaphore, mpsc};
use tollgate::layer::{Charged, CommitMarkerLayer};
use tower::limit::GlobalConcurrencyLimitLayer;

const INITIAL: u64 = 10_000;
/// The price of `/work` and `/validate`.
const WORK_PRICE: u64 = 3;
/// The price of `/slow`.
const SLOW_PRICE: u64 = 11;

/// Which app the server runs.
#[derive(Clone, Copy)]
enum App {
    /// `/work` and `/slow`: tollgate (deferred) outermost, a global
    /// concurrency limit of one inside it, the commit marker innermost.
    LimitInside,
    /// `POST /validate`, committing through `Charged<Validated>`.
    ChargedExtractor,
    /// `GET /work` with the commit marker on its handler only, through
    /// `MethodRouter::route_layer`.
    MarkerOnHandler,
}

/// An extractor that accepts only the body `ok`.
struct Validated;

impl<S: Send + Sync> FromRequest<S> for Validated {
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let body = String::from_request(request, state)
            .await
            .map_err(IntoResponse::into_response)?;
        if body == "ok" {
            Ok(Self)
        } else {
            Err((StatusCode::UNPROCESSABLE_ENTITY, "invalid body").into_response())
        }
    }
}

/// The server running `app`; one message each time `/slow` starts running;
/// and the gate `/slow` waits at once started: it answers when the test
/// adds a permit, so a request holds the limit exactly as long as the test
/// needs, however loaded the machine.
async fn serve(app: App) -> (TestServer, mpsc::UnboundedReceiver<()>, Arc<Semaphore>) {
    let world = support::runtime::start_real_time(INITIAL).await;
    let layer = priced_by_path(&world.handle, |path| {
        if path == "/slow" {
            SLOW_PRICE
        } else {
            WORK_PRICE
        }
    })
    .commit_in_handler()
    .build()
    .unwrap();
    let (started, slow_started) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let slow_gate = Arc::clone(&gate);
    let router = match app {
        App::LimitInside => Router::new()
            .route("/work", get(|| async { "work" }))
            .route(
                "/slow",
                get(move || async move {
                    started.send(()).unwrap();
                    slow_gate.acquire().await.unwrap().forget();
                    "slow"
                }),
            )
            // Later `.layer` calls are outer: the marker is innermost, the
            // limit between it and tollgate, tollgate outermost.
            .layer(CommitMarkerLayer::new())
            .layer(GlobalConcurrencyLimitLayer::new(1))
            .layer(layer),
        App::MarkerOnHandler => Router::new()
            .route(
                "/work",
                get(|| async { "work" }).route_layer(CommitMarkerLayer::new()),
            )
            .layer(layer),
        App::ChargedExtractor => Router::new()
            .route(
                "/validate",
                post(|Charged(Validated): Charged<Validated>| async { "valid" }),
            )
            .layer(layer),
    };
    (
        TestServer::serve(world, INITIAL, router).await,
        slow_started,
        gate,
    )
}

async fn started(slow_started: &mut mpsc::UnboundedReceiver<()>) {
    wait_started(slow_started, "the slow handler starts").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_inside_the_layer_holds_its_reservation_and_pays_nothing_if_its_client_leaves()
 {
    let (server, mut slow_started, gate) = serve(App::LimitInside).await;

    // A: admitted, committed at the marker, its handler holding the limit.
    let first = server.send("/slow");
    started(&mut slow_started).await;
    let before_queued = server.remaining();

    // B: admitted by tollgate, then queued in the limit inside it.
    let queued = server.send("/slow");
    eventually("the queued request was admitted before it queued", || {
        server.handle.counters().admitted == 2
    })
    .await;
    assert_eq!(
        server.remaining(),
        before_queued - SLOW_PRICE,
        "the queued request holds its reservation while it waits"
    );

    // B's client leaves while B waits: B never reached the commit point.
    drop(queued);
    eventually(
        "I4: the queued request's reservation was released for zero",
        || server.remaining() == before_queued,
    )
    .await;

    gate.add_permits(1);
    let response = TestServer::read(first).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(
        slow_started.try_recv().is_err(),
        "the queued request's handler never started"
    );
    let response = server.get("/work").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");

    // Events from different queue stripes may be written in either order.
    let mut paid = server.finish().await;
    paid.sort_unstable();
    assert_eq!(
        paid,
        vec![WORK_PRICE, SLOW_PRICE],
        "I3, I4: the started request paid in full, the abandoned queued one nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_inside_the_layer_that_then_runs_is_charged_in_full_once() {
    let (server, mut slow_started, gate) = serve(App::LimitInside).await;

    let first = server.send("/slow");
    started(&mut slow_started).await;
    let second = server.send("/slow");
    eventually("the second request was admitted", || {
        server.handle.counters().admitted == 2
    })
    .await;
    assert!(
        slow_started.try_recv().is_err(),
        "the second request waits in the limit"
    );

    gate.add_permits(2);
    let (first, second) = tokio::join!(TestServer::read(first), TestServer::read(second));
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(second.starts_with("HTTP/1.1 200"), "{second}");
    started(&mut slow_started).await;

    assert_eq!(
        server.finish().await,
        vec![SLOW_PRICE, SLOW_PRICE],
        "I3: the queued request was charged its full price when its handler started"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charged_extractor_charges_nothing_when_its_input_is_rejected_and_once_when_accepted() {
    let (server, _slow_started, _gate) = serve(App::ChargedExtractor).await;

    let rejected = server.request("POST", "/validate", "bad").await;
    assert!(rejected.starts_with("HTTP/1.1 422"), "{rejected}");
    let accepted = server.request("POST", "/validate", "ok").await;
    assert!(accepted.starts_with("HTTP/1.1 200"), "{accepted}");
    assert!(accepted.ends_with("valid"), "{accepted}");
    assert_eq!(server.handle.counters().admitted, 2, "both were admitted");

    assert_eq!(
        server.finish().await,
        vec![WORK_PRICE],
        "I4: the rejected request was released for zero; I3: the accepted one paid once"
    );
}

/// I4: with the marker on each handler (`route_layer`), a request no
/// handler answers (axum's 404 fallback, or its 405 for a method the route
/// lacks) reaches no commit point and is released for zero. A marker added
/// with `Router::layer` would wrap those fallbacks too, and charge them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_on_the_handlers_leaves_unrouted_requests_uncharged() {
    let (server, _slow_started, _gate) = serve(App::MarkerOnHandler).await;

    let missing = server.request("GET", "/nope", "").await;
    assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
    let wrong_method = server.request("DELETE", "/work", "").await;
    assert!(wrong_method.starts_with("HTTP/1.1 405"), "{wrong_method}");
    let answered = server.request("GET", "/work", "").await;
    assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
    assert_eq!(
        server.handle.counters().admitted,
        3,
        "all three were admitted"
    );

    assert_eq!(
        server.finish().await,
        vec![WORK_PRICE],
        "only the request a handler served paid"
    );
}

/// I9, I23, fail closed: a commit point on a route no tollgate layer admitted
/// (as happens to routes added after `Router::layer`, which wraps only the
/// routes before it; here there is no layer at all, which the commit point
/// cannot tell apart) does not let its handler run unmetered: the
/// marker and the `Charged` extractor each answer 500 naming the cause,
/// and the handler never runs.
#[tokio::test]
async fn a_commit_point_on_a_route_outside_the_layer_answers_500_and_runs_nothing() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tower::ServiceExt as _;
    let ran = Arc::new(AtomicUsize::new(0));
    let (marked, charged) = (Arc::clone(&ran), Arc::clone(&ran));
    let app: Router = Router::new()
        .route(
            "/marked",
            get(move || async move {
                marked.fetch_add(1, Ordering::SeqCst);
                "ran"
            })
            .route_layer(CommitMarkerLayer::new()),
        )
        .route(
            "/charged",
            post(move |Charged(body): Charged<String>| async move {
                charged.fetch_add(1, Ordering::SeqCst);
                body
            }),
        );
    for (method, path) in [("GET", "/marked"), ("POST", "/charged")] {
        let request = http::Request::builder()
            .method(method)
            .uri(path)
            .body(axum::body::Body::from("input"))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(
            response.status(),
            StatusCode::INTERNAL_SERVER_ERROR,
            "{path}"
        );
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        assert!(
            String::from_utf8_lossy(&body).contains("not behind a TollgateLayer"),
            "{path}"
        );
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "no handler ran");
}

/// I25: once shutdown begins, no handler starts. A request admitted before
/// it and still queued for the limit is refused where it would have been
/// charged, with `503 shutting_down`, and pays nothing; the handler already
/// running finishes and pays in full. So a server's connection drain only
/// has to outlast the handlers running at the stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_when_shutdown_begins_is_refused_at_its_commit_and_pays_nothing() {
    let (server, mut slow_started, gate) = serve(App::LimitInside).await;

    let first = server.send("/slow");
    started(&mut slow_started).await;
    let queued = server.send("/slow");
    eventually("the queued request was admitted before it queued", || {
        server.handle.counters().admitted == 2
    })
    .await;

    server.handle.request_shutdown();
    gate.add_permits(2);
    let (first, queued) = tokio::join!(TestServer::read(first), TestServer::read(queued));
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(queued.starts_with("HTTP/1.1 503"), "{queued}");
    assert!(queued.contains("shutting_down"), "{queued}");
    assert!(
        queued.contains("x-tollgate-request-id"),
        "an admitted request's refusal names its id: {queued}"
    );
    assert!(
        slow_started.try_recv().is_err(),
        "the queued request's handler never started"
    );

    assert_eq!(
        server.finish().await,
        vec![SLOW_PRICE],
        "I3, I25: the running request paid in full, the one refused at the stop nothing"
    );
}
