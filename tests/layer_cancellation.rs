//! Whether cancellation was requested, as a handler sees it through
//! [`Admitted::cancellation`], in a real axum server on 127.0.0.1 with raw
//! TCP clients: a client that disconnects while its handler runs, or while
//! its response body streams, cancels the request's token (and still pays
//! in full, I3); a request whose response the server had complete never does; a
//! layer built without tracking gives no token.

mod support;

use std::io::Read as _;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::routing::{MethodRouter, get};
use http_body::Frame;
use support::http::{SignalsDrop, TestServer, priced_by_path};
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

/// One message each time the server drops a response body.
type Drops = mpsc::UnboundedReceiver<()>;

/// A response body of one-byte chunks: `Some(n)` sends n more and ends;
/// `None` sends one and then waits forever without ending.
struct Chunks {
    left: Option<u32>,
    sent: bool,
}

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let chunk = Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"x")))));
        match self.left {
            Some(0) => Poll::Ready(None),
            Some(n) => {
                self.left = Some(n - 1);
                chunk
            }
            None if self.sent => Poll::Pending,
            None => {
                self.sent = true;
                chunk
            }
        }
    }
}

/// A response body of one data frame and then trailers.
struct Trailing {
    step: u8,
}

impl http_body::Body for Trailing {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.step += 1;
        Poll::Ready(match self.step {
            1 => Some(Ok(Frame::data(Bytes::from_static(b"x")))),
            2 => Some(Ok(Frame::trailers(http::HeaderMap::new()))),
            _ => None,
        })
    }
}

/// A server whose `/hang` handler hands its cancellation token to the test
/// and then never answers, whose `/quick` handler hands it over and
/// answers at once, and whose `/stream` and `/chunks` handlers hand it over
/// and answer with a body that never ends or ends after three chunks.
async fn serve(setup: Setup) -> (TestServer, Tokens, Drops) {
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
    let (dropped, drops) = mpsc::unbounded_channel();
    let quick_tokens = tokens.clone();
    let stream_tokens = tokens.clone();
    let chunk_tokens = tokens.clone();
    let length_tokens = tokens.clone();
    let trailer_tokens = tokens.clone();
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
        .route(
            "/stream",
            committed_in_handler(get(move |admitted: Admitted| async move {
                stream_tokens.send(admitted.cancellation).unwrap();
                Body::new(Chunks {
                    left: None,
                    sent: false,
                })
            })),
        )
        .route(
            "/chunks",
            committed_in_handler(get(move |admitted: Admitted| async move {
                chunk_tokens.send(admitted.cancellation).unwrap();
                Body::new(Chunks {
                    left: Some(3),
                    sent: false,
                })
            })),
        )
        .route(
            "/length",
            committed_in_handler(get(move |admitted: Admitted| async move {
                length_tokens.send(admitted.cancellation).unwrap();
                let body = Body::new(Chunks {
                    left: Some(3),
                    sent: false,
                });
                ([(http::header::CONTENT_LENGTH, "3")], body)
            })),
        )
        .route(
            "/trailers",
            committed_in_handler(get(move |admitted: Admitted| async move {
                trailer_tokens.send(admitted.cancellation).unwrap();
                Body::new(Trailing { step: 0 })
            })),
        )
        .layer(layer)
        .layer(axum::middleware::map_response(
            move |response: axum::response::Response| {
                let dropped = dropped.clone();
                async move {
                    response.map(|inner| {
                        Body::new(SignalsDrop {
                            inner: Some(inner),
                            dropped,
                        })
                    })
                }
            },
        ));
    (
        TestServer::serve(world, INITIAL, app).await,
        received,
        drops,
    )
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
    let (server, mut received, _drops) = serve(setup).await;
    let client = server.send("/hang");
    let token = next_token(&mut received)
        .await
        .expect("a tracking layer gives every admitted request a token");
    assert!(
        !token.is_cancelled(),
        "nobody has given up on the request yet"
    );

    drop(client);
    cancelled_and_charged(server, &token).await;
}

/// Waits (at most five seconds) for `token` to be cancelled by a client
/// that left, then checks the request still paid in full (I3): `finish`
/// checks the balance is INITIAL minus exactly this event, and the audit.
async fn cancelled_and_charged(server: TestServer, token: &CancellationToken) {
    tokio::time::timeout(ms(5_000), token.cancelled())
        .await
        .expect("the client leaving cancels the token within five seconds");
    assert_eq!(server.finish().await, vec![PRICE]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_built_without_tracking_gives_no_token() {
    let (server, mut received, _drops) = serve(Setup::Untracked).await;
    let response = server.get("/quick").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(
        next_token(&mut received).await.is_none(),
        "tracking is opt-in"
    );
    assert_eq!(server.finish().await, vec![PRICE]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_cancels_the_token() {
    let (server, mut received, _drops) = serve(Setup::Tracked).await;
    let mut client = server.send("/stream");
    let token = next_token(&mut received).await.expect("tracking is on");
    // The headers and the first chunk arrive: the handler has returned,
    // but the body is still being sent.
    let mut seen = Vec::new();
    let mut buffer = [0_u8; 512];
    client.set_read_timeout(Some(ms(5_000))).unwrap();
    while !String::from_utf8_lossy(&seen).contains("\r\n\r\n1\r\nx") {
        let read = client
            .read(&mut buffer)
            .expect("the server sends the first chunk");
        assert_ne!(read, 0, "the server keeps the stream open");
        seen.extend_from_slice(&buffer[..read]);
    }
    assert!(!token.is_cancelled(), "the body is still streaming");

    drop(client);
    cancelled_and_charged(server, &token).await;
}

/// Each way a response can be sent complete, the connection then closing
/// (`Connection: close`): a plain body, a chunked stream polled to its
/// end, and those whose body the server stops reading before its end: a
/// declared length, a trailers frame, a `HEAD` request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_sent_complete_is_never_cancelled() {
    let (server, mut received, mut drops) = serve(Setup::Tracked).await;
    let cases: [(&str, &str, &str); 5] = [
        ("GET", "/quick", "\r\n\r\ndone"),
        ("GET", "/chunks", "1\r\nx\r\n0\r\n\r\n"),
        ("GET", "/length", "\r\n\r\nxxx"),
        ("GET", "/trailers", "1\r\nx\r\n0\r\n\r\n"),
        ("HEAD", "/quick", "\r\n\r\n"),
    ];
    let mut tokens = Vec::new();
    for (method, path, ending) in cases {
        let response = server.request(method, path, "").await;
        assert!(
            response.starts_with("HTTP/1.1 200"),
            "{method} {path}: {response}"
        );
        assert!(response.ends_with(ending), "{method} {path}: {response:?}");
        let token = next_token(&mut received).await.expect("tracking is on");
        tokens.push((method, path, token));
    }
    // Every response body dropped, the layer's with it: a cancellation
    // that drop set off has happened by now.
    for (method, path, _) in &tokens {
        tokio::time::timeout(ms(5_000), drops.recv())
            .await
            .unwrap_or_else(|_| panic!("{method} {path}: the server drops its body"))
            .expect("the server is running");
    }
    for (method, path, token) in tokens {
        assert!(
            !token.is_cancelled(),
            "{method} {path}: a response sent complete completes the request"
        );
    }
    assert_eq!(server.finish().await, vec![PRICE; 5]);
}
