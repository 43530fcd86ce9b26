//! The tollgate layer in a real axum server on 127.0.0.1, with real time
//! and raw TCP clients, so disconnects happen exactly where a test puts
//! them: every served request is charged exactly once (I8, I25), a client
//! that leaves after its handler started pays in full (I3), and one that
//! leaves while its request waits in a concurrency limit outside tollgate
//! was never admitted, so pays nothing. (A limit inside the layer, where a
//! request is admitted and then released for zero under I4, is
//! `tests/layer_deferred.rs`.)

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::routing::get;
use axum::{Extension, Router};
use support::http::{TestServer, eventually, priced_by_path, wait_started};
use tokio::sync::mpsc;
use tollgate::layer::Admitted;
use tower::limit::GlobalConcurrencyLimitLayer;

const INITIAL: u64 = 10_000;
/// The price of `/work`.
const WORK_PRICE: u64 = 3;
/// The price of `/slow`.
const SLOW_PRICE: u64 = 11;

/// Counts up when dropped: when the server is done with a request, whether
/// its future finished or was dropped.
struct CountOnDrop(Arc<AtomicUsize>);

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Counts of requests taken outside the concurrency limit.
#[derive(Default)]
struct Traffic {
    /// Requests that reached the server.
    arrived: AtomicUsize,
    /// Requests the server is done with (answered, or dropped when their
    /// client left).
    done: Arc<AtomicUsize>,
}

/// A store, a runtime over it (ready), and an axum app on 127.0.0.1:0:
/// `/work` and `/slow` behind tollgate, behind one global concurrency limit
/// of one request placed OUTSIDE tollgate, so a queued request has not been
/// admitted; one message each time `/slow` starts running; and the traffic
/// counted outside the limit.
async fn serve() -> (TestServer, mpsc::UnboundedReceiver<()>, Arc<Traffic>) {
    let world = support::runtime::start_real_time(INITIAL).await;
    let layer = priced_by_path(&world.handle, |path| {
        if path == "/slow" {
            SLOW_PRICE
        } else {
            WORK_PRICE
        }
    })
    .build()
    .unwrap();
    let (started, slow_started) = mpsc::unbounded_channel();
    let traffic = Arc::new(Traffic::default());
    let app = Router::new()
        .route(
            "/work",
            get(|Extension(admitted): Extension<Admitted>| async move {
                admitted.units.get().to_string()
            }),
        )
        .route(
            "/slow",
            get(move || async move {
                started.send(()).unwrap();
                // Until its client leaves: no outcome may depend on how
                // fast a loaded machine gets through the test's steps.
                std::future::pending::<()>().await;
                "slow"
            }),
        )
        .layer(layer)
        // Requests wait here before tollgate.
        .layer(GlobalConcurrencyLimitLayer::new(1))
        // Added last, so outermost: every request that arrives is counted,
        // and again when the server is done with it.
        .layer(axum::middleware::from_fn({
            let traffic = Arc::clone(&traffic);
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                traffic.arrived.fetch_add(1, Ordering::SeqCst);
                let done = CountOnDrop(Arc::clone(&traffic.done));
                async move {
                    let _done = done;
                    next.run(request).await
                }
            }
        }));
    (
        TestServer::serve(world, INITIAL, app).await,
        slow_started,
        traffic,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_served_request_is_charged_exactly_once() {
    const N: u64 = 20;
    let (server, _slow_started, _traffic) = serve().await;
    let mut request_ids = Vec::new();
    for _ in 0..N {
        let response = server.get("/work").await;
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(
            response.ends_with(&WORK_PRICE.to_string()),
            "the handler saw its Admitted price: {response}"
        );
        let id = response
            .lines()
            .find_map(|line| line.strip_prefix("x-tollgate-request-id: "))
            .expect("an admitted response names its request id")
            .to_owned();
        request_ids.push(id);
    }
    request_ids.sort();
    request_ids.dedup();
    assert_eq!(request_ids.len(), 20, "I8: each request has its own id");
    assert_eq!(server.handle.counters().admitted, N);

    // `finish` checks every lease went back, the balance is INITIAL minus
    // the events' units (so INITIAL - N * WORK_PRICE here) and the audit is
    // clean.
    assert_eq!(
        server.finish().await,
        vec![WORK_PRICE; 20],
        "I8: one event per request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_after_its_handler_started_pays_in_full_and_one_that_leaves_while_queued_pays_nothing()
 {
    let (server, mut slow_started, traffic) = serve().await;

    // A: admitted, committed, its handler running and holding the limit.
    let first = server.send("/slow");
    wait_started(&mut slow_started, "the slow handler starts").await;
    assert_eq!(server.handle.counters().admitted, 1);

    // B: waits in the concurrency limit, outside tollgate, so it has not
    // been admitted; then its client leaves.
    let queued = server.send("/slow");
    eventually("the queued request reaches the server", || {
        traffic.arrived.load(Ordering::SeqCst) == 2
    })
    .await;
    assert_eq!(
        server.handle.counters().admitted,
        1,
        "a queued request is not admitted yet"
    );
    drop(queued);
    eventually("the server drops the request whose client left", || {
        traffic.done.load(Ordering::SeqCst) == 1
    })
    .await;

    // A's client leaves while its handler runs.
    drop(first);
    // Had B's request still waited in the limit, A's end would have let it
    // through to admission.
    eventually("the server is done with the running request", || {
        traffic.done.load(Ordering::SeqCst) == 2
    })
    .await;
    assert_eq!(
        server.handle.counters().admitted,
        1,
        "the queued request never reached admission (a limit inside the \
         layer, where it is admitted and then released, is tests/layer_deferred.rs)"
    );
    assert!(
        slow_started.try_recv().is_err(),
        "the queued request's handler never started"
    );

    // The limit was released: a fresh request is served.
    let response = server.get("/work").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");

    // `finish` checks every lease went back, the balance is INITIAL minus
    // the events' units (so INITIAL - SLOW_PRICE - WORK_PRICE here) and the
    // audit is clean.
    // Events from different queue stripes may be written in either order.
    let mut paid = server.finish().await;
    paid.sort_unstable();
    assert_eq!(
        paid,
        vec![WORK_PRICE, SLOW_PRICE],
        "the started request paid in full, the queued one nothing"
    );
}
