//! Whether cancellation was requested, as a handler sees it through
//! [`Admitted::cancellation`], in a real axum server on 127.0.0.1 with raw
//! TCP clients: a client that disconnects while its handler runs cancels
//! the request's token (and still pays in full, I3); a request that
//! completes never does; a layer built without tracking gives no token.

mod support;

use axum::Router;
use axum::routing::{MethodRouter, get};
use support::http::{TestServer, priced_by_path};
use support::runtime::ms;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tollgate::layer::{Admitted, CommitMarkerLayer};

const INITIAL: u64 = 10_000;
const PRICE: u64 = 7;

/// How the server under test is built.
#[derive(Clone, Copy)]
enum Setup {
    Untracked,
    Tracked,
    /// Tracked, with the commit deferred to a marker on each handler.
    TrackedDeferred,
}

/// What each handler hands the test: its request's token, if any.
type Tokens = mpsc::UnboundedReceiver<Option<CancellationToken>>;

/// A server whose `/hang` handler hands its cancellation token to the test
/// and then never answers, and whose `/quick` handler hands it over and
/// answers at once.
async fn serve(setup: Setup) -> (TestServer, Tokens) {
    let world = support::runtime::start_real_time(INITIAL).await;
    let mut builder = priced_by_path(&world.handle, |_| PRICE);
    if !matches!(setup, Setup::Untracked) {
        builder = builder.track_cancellation();
    }
    let deferred = matches!(setup, Setup::TrackedDeferred);
    if deferred {
        builder = builder.commit_in_handler();
    }
    let layer = builder.build().unwrap();
    let (tokens, received) = mpsc::unbounded_channel();
    let quick_tokens = tokens.clone();
    let committed_in_handler = |route: MethodRouter| {
        if deferred {
            route.route_layer(CommitMarkerLayer::new())
        } else {
            route
        }
    };
    let app = Router::new()
        .route(
            "/hang",
            committed_in_handler(get(move |admitted: Admitted| async move {
                tokens.send(admitted.cancellation).unwrap();
                std::future::pending::<()>().await;
            })),
        )
        .route(
            "/quick",
            committed_in_handler(get(move |admitted: Admitted| async move {
                quick_tokens.send(admitted.cancellation).unwrap();
                "done"
            })),
        )
        .layer(layer);
    (TestServer::serve(world, INITIAL, app).await, received)
}

async fn next_token(received: &mut Tokens) -> Option<CancellationToken> {
    tokio::time::timeout(ms(5_000), received.recv())
        .await
        .expect("the handler starts within five seconds")
        .expect("the server is running")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_while_its_handler_runs_cancels_its_token_and_pays_in_full() {
    disconnect_while_running(Setup::Tracked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_deferred_commit_a_disconnect_while_the_handler_runs_cancels_too() {
    disconnect_while_running(Setup::TrackedDeferred).await;
}

async fn disconnect_while_running(setup: Setup) {
    let (server, mut received) = serve(setup).await;
    let client = server.send("/hang");
    let token = next_token(&mut received)
        .await
        .expect("a tracking layer gives every admitted request a token");
    assert!(
        !token.is_cancelled(),
        "nobody has given up on the request yet"
    );

    drop(client);
    tokio::time::timeout(ms(5_000), token.cancelled())
        .await
        .expect("the disconnect cancels the token within five seconds");

    // I3: the handler had started, so the charge stands. `finish` checks
    // the balance is INITIAL minus exactly this event and the audit.
    assert_eq!(server.finish().await, vec![PRICE]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_completes_is_never_cancelled() {
    let (server, mut received) = serve(Setup::Tracked).await;
    let response = server.get("/quick").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("done"), "{response}");
    let token = next_token(&mut received).await.expect("tracking is on");

    // The response was read and the connection closed (`Connection:
    // close`): the future completed before anything was dropped.
    tokio::time::sleep(ms(200)).await;
    assert!(
        !token.is_cancelled(),
        "a completed request's token stays uncancelled"
    );
    assert_eq!(server.finish().await, vec![PRICE]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_built_without_tracking_gives_no_token() {
    let (server, mut received) = serve(Setup::Untracked).await;
    let response = server.get("/quick").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(
        next_token(&mut received).await.is_none(),
        "tracking is opt-in"
    );
    assert_eq!(server.finish().await, vec![PRICE]);
}
