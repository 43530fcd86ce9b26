//! The tollgate layer served over real HTTP/2: prior-knowledge h2c on
//! 127.0.0.1 through hyper-util's auto builder, with hyper's HTTP/2 client
//! multiplexing every request of a test as streams of one connection, as a
//! load balancer or a gRPC-style client does. What is checked is money, not
//! only statuses: every stream whose handler started pays exactly once (I3,
//! I8), every stream that ends before its handler starts (reset by its
//! client with `RST_STREAM`, or cut off with its whole connection) is
//! released for zero and counted as released (I4), denials leave the
//! connection serving, and nothing the layer answers over HTTP/2 carries
//! the connection-specific `Connection` header HTTP/2 forbids.
//!
//! Each scenario runs with both commit points: at the hand-over (requests
//! held in a concurrency limit composed directly inside the layer with
//! `ServiceBuilder`), and in the handler (`commit_in_handler`, the limit a
//! route layer outside each handler's `CommitMarkerLayer`).

mod support;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use axum::{Extension, Router};
use http::{HeaderMap, Method, StatusCode, Version, header};
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Empty, Full};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::http::{SignalsDrop, TestServer, eventually, priced_by_path};
use support::runtime::ms;
use tokio::sync::{Barrier, Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tollgate::DenyReason;
use tollgate::layer::{Admitted, Charged, CommitMarkerLayer, Tollgate, TollgateLayer};
use tower::ServiceBuilder;
use tower::limit::{ConcurrencyLimit, GlobalConcurrencyLimitLayer};

const INITIAL: u64 = 10_000;
/// The price of `GET /work`, which answers at once.
const WORK_PRICE: u64 = 3;
/// The price of `GET /slow`, held in a concurrency limit inside the layer
/// before its handler, and answering when the test opens its gate.
const SLOW_PRICE: u64 = 11;
/// The price of `POST /upload`, which reads its whole body.
const UPLOAD_PRICE: u64 = 5;
/// The price of `GET /stream`, whose response body never ends.
const STREAM_PRICE: u64 = 7;
/// The price of `GET /together`, which answers once all [`STREAMS`] of
/// them run at once.
const TOGETHER_PRICE: u64 = 2;
/// The price of `POST /grpc`, answered gRPC-style: a data frame, then
/// trailers.
const GRPC_PRICE: u64 = 13;
/// How many streams share the connection in the concurrency test.
const STREAMS: usize = 50;
/// A well-formed key the store never issued.
const UNKNOWN_KEY: &str = "tg_NotAKeyThisStoreEverIssued000000000000000";

fn price_of(path: &str) -> u64 {
    match path {
        "/work" => WORK_PRICE,
        "/slow" | "/slow-charged" | "/slow-outside" => SLOW_PRICE,
        "/upload" => UPLOAD_PRICE,
        "/stream" => STREAM_PRICE,
        "/together" => TOGETHER_PRICE,
        "/grpc" => GRPC_PRICE,
        _ => 1,
    }
}

/// Where the charge commits.
#[derive(Clone, Copy, Debug)]
enum Commit {
    /// The layer's default: at the hand-over to the inner service. `/slow`
    /// is `ServiceBuilder::new().layer(tollgate).layer(limit)`, so a
    /// request waits for the limit in the layer's response future, admitted
    /// and not yet charged.
    AtHandOver,
    /// `commit_in_handler`: each handler commits through a
    /// `CommitMarkerLayer` route layer (`/upload` and `/slow-charged`
    /// through `Charged<T>`), and `/slow`'s limit is a route layer outside
    /// its marker (`/slow-charged`'s, outside its handler).
    InHandler,
}

/// The responses that left the layer (seen by a middleware outside it, so
/// before hyper strips connection-specific headers from an HTTP/2
/// response) carrying a `Connection` header, by the request's version.
#[derive(Default)]
struct ConnectionHeaders {
    http2: AtomicUsize,
    http1: AtomicUsize,
    /// Every response the middleware saw over HTTP/2.
    http2_responses: AtomicUsize,
}

/// The server, and what its handlers tell the test.
struct App {
    server: TestServer,
    /// The cancellation token of each request whose `/slow`, `/stream` or
    /// `/grpc` handler started, sent as it starts (the layer tracks
    /// cancellation).
    started: mpsc::UnboundedReceiver<Option<CancellationToken>>,
    /// `/slow` answers once per permit added here.
    gate: Arc<Semaphore>,
    /// The cancellation token of each request whose `/upload` body
    /// extractor starts reading.
    reading: mpsc::UnboundedReceiver<Option<CancellationToken>>,
    /// One message each time the server drops a `/grpc` response body,
    /// after the layer's body inside it was dropped.
    grpc_dropped: mpsc::UnboundedReceiver<()>,
    headers: Arc<ConnectionHeaders>,
    /// Requests that reached `/slow-outside`'s limit, counted once each
    /// after its first readiness check.
    arrived: Arc<AtomicUsize>,
    /// The places of the limit every `/slow` route shares. A waiting
    /// request is handed a place as one frees, so all are free only once
    /// no request waits.
    limit: Arc<Semaphore>,
}

impl App {
    /// The next started handler's token.
    async fn started(&mut self) -> CancellationToken {
        tokio::time::timeout(ms(5_000), self.started.recv())
            .await
            .expect("the handler starts within five seconds")
            .expect("the server is running")
            .expect("the layer tracks cancellation")
    }

    fn counters(&self) -> tollgate::admission::AdmissionStats {
        self.server.handle.counters()
    }
}

/// Serves the app over h2c, committing at `commit`, with `slots` places in
/// `/slow`'s concurrency limit.
async fn serve(commit: Commit, slots: usize) -> App {
    let world = support::runtime::start_real_time(INITIAL).await;
    let deferred = matches!(commit, Commit::InHandler);
    let mut builder = priced_by_path(&world.handle, price_of).track_cancellation();
    if deferred {
        builder = builder.commit_in_handler();
    }
    let layer = builder.build().unwrap();

    let (started_tx, started) = mpsc::unbounded_channel();
    let (reading_tx, reading) = mpsc::unbounded_channel();
    let (grpc_dropped_tx, grpc_dropped) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let together = Arc::new(Barrier::new(STREAMS));
    let places = Arc::new(Semaphore::new(slots));
    let limit = GlobalConcurrencyLimitLayer::with_semaphore(Arc::clone(&places));
    let headers = Arc::new(ConnectionHeaders::default());
    let marked = |route: MethodRouter| {
        if deferred {
            route.route_layer(CommitMarkerLayer::new())
        } else {
            route
        }
    };

    let (slow, slow_charged) = slow_routes(&started_tx, &gate);
    let stream = {
        let started = started_tx.clone();
        get(move |admitted: Admitted| async move {
            started.send(admitted.cancellation).unwrap();
            Body::new(Endless { sent: false })
        })
    };
    let grpc = post(move |admitted: Admitted| async move {
        started_tx.send(admitted.cancellation).unwrap();
        (
            [(header::CONTENT_TYPE, "application/grpc")],
            Body::new(Trailing { step: 0 }),
        )
    });
    let upload = if deferred {
        post(|Charged(Reading(body)): Charged<Reading>| async move { body.len().to_string() })
    } else {
        post(|Reading(body): Reading| async move { body.len().to_string() })
    };
    let router = Router::new()
        .route(
            "/work",
            marked(get(|admitted: Admitted| async move {
                admitted.units.get().to_string()
            })),
        )
        .route(
            "/together",
            marked(get(move || async move {
                together.wait().await;
                "together"
            })),
        )
        .route("/stream", marked(stream))
        .route("/grpc", marked(grpc))
        .route(
            "/upload",
            upload.route_layer(Extension(ReadingSignal(reading_tx))),
        );
    let arrived = Arc::new(AtomicUsize::new(0));
    let outside = behind_outer_limit(marked(slow.clone()), &layer, &limit, Arc::clone(&arrived));
    let router = match commit {
        Commit::AtHandOver => router.layer(layer.clone()).route_service(
            "/slow",
            ServiceBuilder::new()
                .layer(layer)
                .layer(limit)
                .service(slow),
        ),
        Commit::InHandler => router
            .route("/slow", marked(slow).route_layer(limit.clone()))
            .route("/slow-charged", slow_charged.route_layer(limit))
            .layer(layer),
    };
    let router = observed(
        router.route_service("/slow-outside", outside),
        Arc::clone(&headers),
        grpc_dropped_tx,
    );
    App {
        server: TestServer::serve_h2c(world, INITIAL, router).await,
        started,
        gate,
        reading,
        grpc_dropped,
        headers,
        arrived,
        limit: places,
    }
}

/// `/slow-outside`: `slow` behind `limit` *outside* `layer`, where axum
/// needs a limit to be, each request counted in `arrived` as it reaches the
/// limit.
fn behind_outer_limit(
    slow: MethodRouter,
    layer: &TollgateLayer,
    limit: &GlobalConcurrencyLimitLayer,
    arrived: Arc<AtomicUsize>,
) -> Arrivals<ConcurrencyLimit<Tollgate<MethodRouter>>> {
    ServiceBuilder::new()
        .layer_fn(move |inner| Arrivals {
            inner,
            arrived: Arc::clone(&arrived),
            counted: false,
        })
        .layer(limit.clone())
        .layer(layer.clone())
        .service(slow)
}

/// Counts each request (each clone axum makes of the route's service) once,
/// after its first readiness check of the service inside: a request counted
/// is waiting at the limit inside, or past it.
#[derive(Clone)]
struct Arrivals<S> {
    inner: S,
    arrived: Arc<AtomicUsize>,
    counted: bool,
}

impl<S: tower::Service<Request>> tower::Service<Request> for Arrivals<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        let ready = self.inner.poll_ready(cx);
        if !self.counted {
            self.counted = true;
            self.arrived.fetch_add(1, Ordering::SeqCst);
        }
        ready
    }

    fn call(&mut self, request: Request) -> Self::Future {
        self.inner.call(request)
    }
}

/// `/slow`: sends its request's token on `started`, then answers once
/// `gate` gives it a permit. Also the same handler committed by its
/// `Charged` extractor rather than a marker, for `/slow-charged`. The
/// extractor inside takes the request whole, reading nothing: one that
/// reads the body fails when the stream is gone, and commits nothing
/// anyway.
fn slow_routes(
    started: &mpsc::UnboundedSender<Option<CancellationToken>>,
    gate: &Arc<Semaphore>,
) -> (MethodRouter, MethodRouter) {
    let slow = {
        let (started, gate) = (started.clone(), Arc::clone(gate));
        get(move |admitted: Admitted| hold(started, gate, admitted))
    };
    let slow_charged = {
        let (started, gate) = (started.clone(), Arc::clone(gate));
        get(move |admitted: Admitted, Charged(_): Charged<Request>| hold(started, gate, admitted))
    };
    (slow, slow_charged)
}

/// The `/slow` handlers' body.
async fn hold(
    started: mpsc::UnboundedSender<Option<CancellationToken>>,
    gate: Arc<Semaphore>,
    admitted: Admitted,
) -> &'static str {
    started.send(admitted.cancellation).unwrap();
    gate.acquire().await.unwrap().forget();
    "slow"
}

/// `router` under an outermost middleware that sees every response as the
/// layer (or the route around it) produced it, before hyper writes it:
/// counts into `headers` those carrying `Connection`, and wraps each
/// `/grpc` response body to say on `grpc_dropped` when the server drops it.
fn observed(
    router: Router,
    headers: Arc<ConnectionHeaders>,
    grpc_dropped: mpsc::UnboundedSender<()>,
) -> Router {
    router.layer(axum::middleware::from_fn(
        move |request: Request, next: axum::middleware::Next| {
            let seen = Arc::clone(&headers);
            let grpc_dropped = grpc_dropped.clone();
            async move {
                let version = request.version();
                let grpc = request.uri().path() == "/grpc";
                let response = next.run(request).await;
                let closing = response.headers().contains_key(header::CONNECTION);
                match version {
                    Version::HTTP_2 => {
                        seen.http2_responses.fetch_add(1, Ordering::SeqCst);
                        if closing {
                            seen.http2.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    _ if closing => {
                        seen.http1.fetch_add(1, Ordering::SeqCst);
                    }
                    _ => {}
                }
                if grpc {
                    response.map(|inner| {
                        Body::new(SignalsDrop {
                            inner: Some(inner),
                            dropped: grpc_dropped,
                        })
                    })
                } else {
                    response
                }
            }
        },
    ))
}

/// Put in `/upload`'s requests by a route layer: [`Reading`] sends the
/// request's cancellation token through it when it starts reading the
/// body.
#[derive(Clone)]
struct ReadingSignal(mpsc::UnboundedSender<Option<CancellationToken>>);

/// The whole request body, after saying it starts reading it.
struct Reading(Bytes);

impl<S: Send + Sync> FromRequest<S> for Reading {
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        if let Some(ReadingSignal(reading)) = request.extensions().get::<ReadingSignal>() {
            let token = request
                .extensions()
                .get::<Admitted>()
                .and_then(|admitted| admitted.cancellation.clone());
            reading.send(token).unwrap();
        }
        Bytes::from_request(request, state)
            .await
            .map(Self)
            .map_err(IntoResponse::into_response)
    }
}

/// A response body of one byte that then never ends.
struct Endless {
    sent: bool,
}

impl http_body::Body for Endless {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.sent {
            return Poll::Pending;
        }
        self.sent = true;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"x")))))
    }
}

/// A gRPC-style response body: one data frame, then `grpc-status: 0`
/// trailers.
struct Trailing {
    step: u8,
}

impl http_body::Body for Trailing {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.step += 1;
        Poll::Ready(match self.step {
            1 => Some(Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\0")))),
            2 => {
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                Some(Ok(Frame::trailers(trailers)))
            }
            _ => None,
        })
    }
}

type ClientBody = BoxBody<Bytes, Infallible>;

/// A request sent on its own stream, its response still to come.
type Pending = JoinHandle<hyper::Result<Response<Incoming>>>;

/// A request body the test feeds chunk by chunk; it ends when its sender
/// is dropped, and its sender's sends fail once the client dropped it.
struct Upload(mpsc::Receiver<Bytes>);

impl http_body::Body for Upload {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|chunk| Ok(Frame::data(chunk))))
    }
}

/// A streamed request body and what feeds it.
fn upload() -> (mpsc::Sender<Bytes>, ClientBody) {
    let (sender, receiver) = mpsc::channel(1);
    (sender, Upload(receiver).boxed())
}

/// One HTTP/2 connection (prior knowledge) to the server: every request
/// sent through it is a stream of that connection.
struct Client {
    send: SendRequest<ClientBody>,
    /// The connection's socket, to cut it off under every stream (hyper
    /// keeps it open while any stream is in flight, even with every
    /// handle to the connection dropped).
    socket: std::net::TcpStream,
    key: String,
}

/// A request's answer, read whole.
struct Answer {
    version: Version,
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn request_id(&self) -> Option<&str> {
        self.headers
            .get("x-tollgate-request-id")
            .map(|id| id.to_str().unwrap())
    }

    /// An HTTP/2 answer with `status`, and no connection-specific header.
    fn expect(&self, status: StatusCode, what: &str) {
        assert_eq!(self.version, Version::HTTP_2, "{what}: served over HTTP/2");
        assert_eq!(self.status, status, "{what}: {}", self.body);
        assert!(
            !self.headers.contains_key(header::CONNECTION),
            "{what}: HTTP/2 forbids `Connection`: {:?}",
            self.headers
        );
    }
}

fn empty() -> ClientBody {
    Empty::new().boxed()
}

fn full(bytes: impl Into<Bytes>) -> ClientBody {
    Full::new(bytes.into()).boxed()
}

impl Client {
    async fn connect(server: &TestServer) -> Self {
        // Connecting to a local socket does not block in practice.
        let tcp = std::net::TcpStream::connect(server.address).unwrap();
        tcp.set_nonblocking(true).unwrap();
        let socket = tcp.try_clone().unwrap();
        let tcp = tokio::net::TcpStream::from_std(tcp).unwrap();
        let (send, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        tokio::spawn(async move {
            // Ends with the socket.
            let _ = connection.await;
        });
        Self {
            send,
            socket,
            key: server.key.clone(),
        }
    }

    /// Cuts the connection off: its socket is shut down both ways, so the
    /// server reads its end under every open stream.
    fn cut(self) {
        self.socket.shutdown(std::net::Shutdown::Both).unwrap();
    }

    /// `method path` with `key` (none if `None`) and `body`.
    fn request_as(
        key: Option<&str>,
        method: Method,
        path: &str,
        body: ClientBody,
    ) -> http::Request<ClientBody> {
        let mut request = http::Request::builder()
            .method(method)
            .uri(format!("http://localhost{path}"));
        if let Some(key) = key {
            request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        request.body(body).unwrap()
    }

    /// `method path` with the account's key and `body`.
    fn request(&self, method: Method, path: &str, body: ClientBody) -> http::Request<ClientBody> {
        Self::request_as(Some(&self.key), method, path, body)
    }

    /// Sends `request` on a new stream of this connection. Aborting the
    /// task drops the response future, and hyper resets the stream
    /// (`RST_STREAM`) if it is still open.
    fn start(&self, request: http::Request<ClientBody>) -> Pending {
        let mut send = self.send.clone();
        tokio::spawn(async move { send.send_request(request).await })
    }

    /// Sends `request` and reads the whole answer.
    async fn call(&self, request: http::Request<ClientBody>) -> Answer {
        answered(self.start(request)).await
    }

    /// `GET path` with the account's key, read whole.
    async fn get(&self, path: &str) -> Answer {
        self.call(self.request(Method::GET, path, empty())).await
    }
}

/// The response of a started request, waited for (at most five seconds).
async fn response(pending: Pending) -> Response<Incoming> {
    tokio::time::timeout(ms(5_000), pending)
        .await
        .expect("the server answers within five seconds")
        .expect("the request task does not panic")
        .expect("the stream is answered")
}

/// The whole answer of a started request (at most five seconds each for
/// its head and its body).
async fn answered(pending: Pending) -> Answer {
    let (parts, body) = response(pending).await.into_parts();
    let body = tokio::time::timeout(ms(5_000), body.collect())
        .await
        .expect("the body arrives within five seconds")
        .expect("the body arrives whole")
        .to_bytes();
    Answer {
        version: parts.version,
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// Stops the server and returns the units of every usage event written,
/// sorted (events from different queue stripes are written in either
/// order). `finish` checks the balance is INITIAL minus exactly these, that
/// every lease went back and that the audit is clean.
async fn billed(app: App) -> Vec<u64> {
    let mut units = app.server.finish().await;
    units.sort_unstable();
    units
}

// 1. Many streams on one connection.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_streams_on_one_connection_are_each_charged_once_committing_at_hand_over() {
    many_concurrent_streams(Commit::AtHandOver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_streams_on_one_connection_are_each_charged_once_committing_in_handler() {
    many_concurrent_streams(Commit::InHandler).await;
}

/// I3, I8: fifty streams in flight at once on one connection (their
/// handlers wait for one another at a barrier, so none answers until all
/// fifty run) are each admitted, charged once and billed once, each under
/// its own request id.
async fn many_concurrent_streams(commit: Commit) {
    let app = serve(commit, 1).await;
    let client = Client::connect(&app.server).await;
    let pending: Vec<_> = (0..STREAMS)
        .map(|_| client.start(client.request(Method::GET, "/together", empty())))
        .collect();
    let mut ids = Vec::new();
    for pending in pending {
        let answer = answered(pending).await;
        answer.expect(StatusCode::OK, "GET /together");
        assert_eq!(answer.body, "together");
        ids.push(
            answer
                .request_id()
                .expect("an admitted response names its request id")
                .to_owned(),
        );
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), STREAMS, "I8: each stream has its own request id");
    let counters = app.counters();
    assert_eq!(counters.admitted, STREAMS as u64);
    assert_eq!(counters.released, 0, "every stream's handler started");
    assert_eq!(counters.denied_total(), 0);
    assert_eq!(app.headers.http2.load(Ordering::SeqCst), 0);
    assert_eq!(
        billed(app).await,
        vec![TOGETHER_PRICE; STREAMS],
        "I3, I8: exactly one event of the full price per stream"
    );
}

// 2. A stream reset while held before its handler.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reset_while_held_before_its_handler_pays_nothing_committing_at_hand_over() {
    reset_while_held(Commit::AtHandOver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reset_while_held_before_its_handler_pays_nothing_committing_in_handler() {
    reset_while_held(Commit::InHandler).await;
}

/// I4: a stream admitted and waiting in the concurrency limit inside the
/// layer, reset by its client (`RST_STREAM`), is released for zero and
/// counted as released, while other streams on the same connection are
/// served and charged meanwhile and after.
async fn reset_while_held(commit: Commit) {
    let mut app = serve(commit, 1).await;
    let client = Client::connect(&app.server).await;

    // A: its handler runs, holding the limit's one place.
    let first = client.start(client.request(Method::GET, "/slow", empty()));
    app.started().await;
    let before = app.server.remaining();

    // B: admitted, then held in the limit, its handler not started.
    let held = client.start(client.request(Method::GET, "/slow", empty()));
    eventually("the held stream is admitted", || {
        app.counters().admitted == 2
    })
    .await;
    assert_eq!(
        app.server.remaining(),
        before - SLOW_PRICE,
        "the held stream holds its reservation"
    );

    // Another stream on the same connection is served while B is held.
    let work = client.get("/work").await;
    work.expect(StatusCode::OK, "GET /work beside a held stream");
    assert_eq!(work.body, WORK_PRICE.to_string());

    // B's client gives up: hyper resets the stream.
    held.abort();
    eventually("I4: the reset stream is released", || {
        app.counters().released == 1
    })
    .await;
    // Counted as it is released: its units may reach the lease a moment
    // later.
    eventually("I4: the reset stream's units are back in the lease", || {
        app.server.remaining() == before - WORK_PRICE
    })
    .await;

    // A finishes; the limit's place goes to the next stream, not to B.
    app.gate.add_permits(1);
    let first = answered(first).await;
    first.expect(StatusCode::OK, "the running stream");
    assert!(
        app.started.try_recv().is_err(),
        "the reset stream's handler never started"
    );
    let next = client.start(client.request(Method::GET, "/slow", empty()));
    app.started().await;
    app.gate.add_permits(1);
    answered(next)
        .await
        .expect(StatusCode::OK, "a later stream through the limit");

    let counters = app.counters();
    assert_eq!(counters.admitted, 4);
    assert_eq!(counters.released, 1, "only the reset stream was released");
    assert_eq!(app.headers.http2.load(Ordering::SeqCst), 0);
    assert_eq!(
        billed(app).await,
        vec![WORK_PRICE, SLOW_PRICE, SLOW_PRICE],
        "I3, I4: the started streams paid in full, the reset held one nothing"
    );
}

// 3. A stream reset after its handler started.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reset_after_its_handler_started_pays_once_committing_at_hand_over() {
    reset_while_running(Commit::AtHandOver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reset_after_its_handler_started_pays_once_committing_in_handler() {
    reset_while_running(Commit::InHandler).await;
}

/// I3: a stream reset while its handler runs pays its full price once;
/// the server drops the handler (its cancellation token is cancelled),
/// nothing is released, and the connection goes on serving.
async fn reset_while_running(commit: Commit) {
    let mut app = serve(commit, 1).await;
    let client = Client::connect(&app.server).await;
    let running = client.start(client.request(Method::GET, "/slow", empty()));
    let token = app.started().await;
    assert!(!token.is_cancelled());

    running.abort();
    tokio::time::timeout(ms(5_000), token.cancelled())
        .await
        .expect("the reset reaches the server, which drops the handler");

    let work = client.get("/work").await;
    work.expect(StatusCode::OK, "GET /work after a reset");
    let counters = app.counters();
    assert_eq!(counters.admitted, 2);
    assert_eq!(
        counters.released, 0,
        "a started handler's charge is never released"
    );
    assert_eq!(
        billed(app).await,
        vec![WORK_PRICE, SLOW_PRICE],
        "I3: the reset stream paid its full price, once"
    );
}

// 4. The whole connection dropped.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_connection_releases_every_held_stream_committing_at_hand_over() {
    connection_dropped(Commit::AtHandOver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_connection_releases_every_held_stream_committing_in_handler() {
    connection_dropped(Commit::InHandler).await;
}

/// I3, I4: a connection cut off (its socket closed) with one stream
/// streaming its response and five held before their handlers (in a limit
/// with no place free): the five are released for zero and counted, the
/// started one pays once, and a new connection is served.
async fn connection_dropped(commit: Commit) {
    const HELD: u64 = 5;
    let mut app = serve(commit, 0).await;
    let client = Client::connect(&app.server).await;
    let streaming = client.start(client.request(Method::GET, "/stream", empty()));
    let token = app.started().await;
    let mut body = response(streaming).await.into_body();
    let first = tokio::time::timeout(ms(5_000), body.frame())
        .await
        .expect("the first chunk arrives")
        .expect("the body has a first frame")
        .expect("the first frame is whole");
    assert_eq!(first.into_data().unwrap(), "x");
    let held: Vec<_> = (0..HELD)
        .map(|_| client.start(client.request(Method::GET, "/slow", empty())))
        .collect();
    eventually("every held stream is admitted", || {
        app.counters().admitted == 1 + HELD
    })
    .await;

    // The whole connection goes: the socket closes under every stream.
    client.cut();
    drop(body);
    eventually("I4: every held stream is released", || {
        app.counters().released == HELD
    })
    .await;
    tokio::time::timeout(ms(5_000), token.cancelled())
        .await
        .expect("the server drops the streaming response");
    for held in held {
        let outcome = tokio::time::timeout(ms(5_000), held)
            .await
            .expect("the client sees its connection end")
            .expect("the request task does not panic");
        assert!(outcome.is_err(), "a held stream got no answer");
    }

    // A new connection is served as ever.
    let client = Client::connect(&app.server).await;
    client
        .get("/work")
        .await
        .expect(StatusCode::OK, "GET /work on a new connection");
    assert_eq!(app.counters().released, HELD);
    assert_eq!(
        billed(app).await,
        vec![WORK_PRICE, STREAM_PRICE],
        "I3, I4: the started streams paid once, the held ones nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_connection_while_the_limit_is_held_charges_no_waiting_stream_committing_at_hand_over()
 {
    connection_dropped_while_limit_held(Commit::AtHandOver, "/slow").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_connection_while_the_limit_is_held_charges_no_waiting_stream_committing_in_handler()
 {
    connection_dropped_while_limit_held(Commit::InHandler, "/slow").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_connection_while_the_limit_is_held_charges_no_waiting_stream_committing_in_its_extractor()
 {
    connection_dropped_while_limit_held(Commit::InHandler, "/slow-charged").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_connection_while_a_limit_outside_the_layer_is_held_charges_no_waiting_stream_committing_at_hand_over()
 {
    connection_dropped_while_outer_limit_held(Commit::AtHandOver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_connection_while_a_limit_outside_the_layer_is_held_charges_no_waiting_stream_committing_in_handler()
 {
    connection_dropped_while_outer_limit_held(Commit::InHandler).await;
}

/// I4, I37: as below, with the limit outside the layer, where axum routers
/// need it. The waiting streams are not admitted yet; one handed the freed
/// place is admitted, handed over and polled by hyper in the same poll,
/// before hyper looks at its stream, so every HTTP/2 request yields once
/// before it commits, waited or not.
async fn connection_dropped_while_outer_limit_held(commit: Commit) {
    const ROUNDS: usize = 3;
    const HELD: usize = 8;
    let mut app = serve(commit, 1).await;
    let mut late = 0;
    for _ in 0..ROUNDS {
        let arrived_before = app.arrived.load(Ordering::SeqCst);
        let admitted_before = app.counters().admitted;
        let client = Client::connect(&app.server).await;
        let _running = client.start(client.request(Method::GET, "/slow-outside", empty()));
        let token = app.started().await;
        let _held: Vec<_> = (0..HELD)
            .map(|_| client.start(client.request(Method::GET, "/slow-outside", empty())))
            .collect();
        eventually("every held stream waits at the limit", || {
            app.arrived.load(Ordering::SeqCst) - arrived_before == 1 + HELD
        })
        .await;
        assert_eq!(
            app.counters().admitted - admitted_before,
            1,
            "only the running stream is past the limit"
        );

        client.cut();
        tokio::time::timeout(ms(5_000), token.cancelled())
            .await
            .expect("the server drops the running handler");
        // The place freed goes from held stream to held stream until none
        // is left: each is dropped (its connection gone) whether it was
        // still waiting or had been let in, admitted, and released.
        eventually("the limit's place is free again", || {
            app.limit.available_permits() == 1
        })
        .await;
        while let Ok(token) = app.started.try_recv() {
            drop(token);
            late += 1;
        }
    }
    let counters = app.counters();
    let paid = billed(app).await;
    assert_eq!(
        (late, counters.admitted - counters.released, paid),
        (0, ROUNDS as u64, vec![SLOW_PRICE; ROUNDS]),
        "I4, I37: only the streams whose handlers ran before their connection \
         went pay (handlers started after, admitted less released, units billed)"
    );
}

/// I4: as above, but the limit's one place is held by a stream of the same
/// connection whose handler runs. When the connection goes, the server
/// drops that handler, which frees the place: a held stream of the gone
/// connection must not take it, start its handler after its client left,
/// and pay. Three rounds of eight held streams, each on a connection of
/// its own, so an ordering that lets a held stream through shows.
///
/// hyper's HTTP/2 server polls a stream's service future before it looks
/// for the stream's reset or its connection's end. A held stream woken by
/// the freed place would be handed over, committed and its handler started
/// in that one poll (then dropped), and pay, and the place it freed would
/// go to the next held stream. So a request that waited yields once before
/// its commit.
async fn connection_dropped_while_limit_held(commit: Commit, path: &str) {
    const ROUNDS: usize = 3;
    const HELD: u64 = 8;
    let mut app = serve(commit, 1).await;
    let mut late = 0;
    for round in 0..ROUNDS {
        let released_before = app.counters().released;
        let client = Client::connect(&app.server).await;
        let _running = client.start(client.request(Method::GET, path, empty()));
        let token = app.started().await;
        let _held: Vec<_> = (0..HELD)
            .map(|_| client.start(client.request(Method::GET, path, empty())))
            .collect();
        eventually("every held stream is admitted", || {
            app.counters().admitted == (round as u64 + 1) * (1 + HELD)
        })
        .await;

        client.cut();
        tokio::time::timeout(ms(5_000), token.cancelled())
            .await
            .expect("the server drops the running handler");
        // Each held stream ends one way or the other: released, or
        // handed the freed place, its handler started (the token it
        // sends is how the test knows), and then dropped with its
        // connection.
        let mut started = Vec::new();
        eventually("every held stream has ended, released or started", || {
            while let Ok(token) = app.started.try_recv() {
                started.push(token.expect("the layer tracks cancellation"));
            }
            app.server.handle.counters().released - released_before + started.len() as u64 == HELD
        })
        .await;
        for token in &started {
            tokio::time::timeout(ms(5_000), token.cancelled())
                .await
                .expect("a handler started after its connection went is dropped");
        }
        late += started.len() as u64;
    }
    let released = app.counters().released;
    let paid = billed(app).await;
    assert_eq!(
        (released, late, paid),
        (ROUNDS as u64 * HELD, 0, vec![SLOW_PRICE; ROUNDS]),
        "I4: every stream held when its connection went is released for zero; \
         only the streams whose handlers ran before it went pay \
         (released, handlers started after their connection went, units billed)"
    );
}

// 5. Denials.

/// Denials over HTTP/2 are answered on their stream and leave the
/// connection serving: an unknown key and a missing one get 401 with
/// `WWW-Authenticate`, forty denied POSTs each carrying 64 KiB the layer
/// never reads (2.5 MiB in all, more than the connection's flow-control
/// window, so unread bodies that kept their share of it would stall the
/// connection) are all answered, and then an admitted upload and an
/// admitted GET on the same connection are served and charged. No response
/// leaving the layer for an HTTP/2 request carries `Connection` (seen
/// outside the layer, before hyper would strip it); the same denied POST
/// over HTTP/1.1 does say `Connection: close`, which shows the observer
/// sees it when it is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denials_leave_the_connection_serving_and_carry_no_connection_header() {
    const DENIED_UPLOADS: usize = 40;
    const UPLOAD: usize = 64 * 1024;
    let app = serve(Commit::AtHandOver, 1).await;
    let client = Client::connect(&app.server).await;

    let unknown = client
        .call(Client::request_as(
            Some(UNKNOWN_KEY),
            Method::GET,
            "/work",
            empty(),
        ))
        .await;
    unknown.expect(StatusCode::UNAUTHORIZED, "an unknown key");
    assert!(
        unknown.body.contains("unknown_principal"),
        "{}",
        unknown.body
    );
    assert_eq!(
        unknown.headers[header::WWW_AUTHENTICATE],
        "Bearer realm=\"tollgate\""
    );
    assert_eq!(
        unknown.headers[header::CONTENT_TYPE],
        "application/problem+json"
    );
    assert!(
        unknown.request_id().is_none(),
        "an unidentified caller gets no request id"
    );

    let missing = client
        .call(Client::request_as(None, Method::GET, "/work", empty()))
        .await;
    missing.expect(StatusCode::UNAUTHORIZED, "no key");
    assert!(
        missing.body.contains("missing_credential"),
        "{}",
        missing.body
    );

    for n in 0..DENIED_UPLOADS {
        let denied = client
            .call(Client::request_as(
                Some(UNKNOWN_KEY),
                Method::POST,
                "/upload",
                full(vec![b'x'; UPLOAD]),
            ))
            .await;
        denied.expect(StatusCode::UNAUTHORIZED, &format!("denied POST {n}"));
        assert!(denied.body.contains("unknown_principal"), "{}", denied.body);
    }

    let upload = client
        .call(client.request(Method::POST, "/upload", full(vec![b'y'; UPLOAD])))
        .await;
    upload.expect(StatusCode::OK, "an admitted upload after the denials");
    assert_eq!(upload.body, UPLOAD.to_string(), "the handler read it whole");
    let work = client.get("/work").await;
    work.expect(StatusCode::OK, "GET /work after the denials");
    assert!(
        !client.send.is_closed(),
        "every stream went over the one connection"
    );

    assert_eq!(
        app.headers.http2.load(Ordering::SeqCst),
        0,
        "no response to an HTTP/2 request left the layer with `Connection`"
    );
    assert_eq!(
        app.headers.http2_responses.load(Ordering::SeqCst),
        DENIED_UPLOADS + 4,
        "the observer saw every HTTP/2 response"
    );

    // The control: over HTTP/1.1 the same denial says `Connection: close`.
    let http1 = http1_denied_upload(&app.server).await;
    assert!(http1.starts_with("HTTP/1.1 401"), "{http1}");
    assert!(
        http1.to_ascii_lowercase().contains("connection: close"),
        "{http1}"
    );
    assert_eq!(app.headers.http1.load(Ordering::SeqCst), 1);

    let counters = app.counters();
    assert_eq!(
        counters.denied_for(DenyReason::UnknownPrincipal),
        DENIED_UPLOADS as u64 + 2
    );
    assert_eq!(counters.denied_for(DenyReason::MissingCredential), 1);
    assert_eq!(counters.admitted, 2);
    assert_eq!(counters.released, 0);
    assert_eq!(
        billed(app).await,
        vec![WORK_PRICE, UPLOAD_PRICE],
        "denials charge nothing; the admitted streams after them paid once"
    );
}

/// A POST of a five-byte body with an unknown key over HTTP/1.1, on a
/// connection of its own: the whole response.
async fn http1_denied_upload(server: &TestServer) -> String {
    use std::io::Write as _;
    let mut stream = std::net::TcpStream::connect(server.address).unwrap();
    write!(
        stream,
        "POST /upload HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {UNKNOWN_KEY}\r\nContent-Length: 5\r\n\r\nhello"
    )
    .unwrap();
    TestServer::read(stream).await
}

// 6. More of what HTTP/2 clients do.

/// A POST refused while its body is still streaming (the client has sent
/// part of it and holds the rest) is answered at once, without waiting for
/// the body; the client then stops uploading (the server reset the rest of
/// the stream), and the connection goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_denied_while_its_body_streams_is_answered_at_once_and_the_connection_goes_on() {
    let app = serve(Commit::AtHandOver, 1).await;
    let client = Client::connect(&app.server).await;
    let (body, receiving) = upload();
    let pending = client.start(Client::request_as(
        Some(UNKNOWN_KEY),
        Method::POST,
        "/upload",
        receiving,
    ));
    // The denial needs only the head, so it may come (and the client stop
    // reading this body) before the first chunk is taken: whether it is
    // does not matter. What does is that the body is still open, its
    // sender alive, when the answer arrives.
    let _ = body.send(Bytes::from(vec![b'x'; 16 * 1024])).await;

    let denied = answered(pending).await;
    denied.expect(StatusCode::UNAUTHORIZED, "denied mid-upload");
    assert!(denied.body.contains("unknown_principal"), "{}", denied.body);
    uploading_stops(&body).await;

    let work = client.get("/work").await;
    work.expect(StatusCode::OK, "GET /work after a denial mid-upload");
    assert_eq!(app.headers.http2.load(Ordering::SeqCst), 0);
    assert_eq!(app.counters().denied_for(DenyReason::UnknownPrincipal), 1);
    assert_eq!(billed(app).await, vec![WORK_PRICE]);
}

/// Sends on `body` until nobody reads it any more (at most five seconds).
async fn uploading_stops(body: &mpsc::Sender<Bytes>) {
    tokio::time::timeout(ms(5_000), async {
        while body.send(Bytes::from_static(b"more")).await.is_ok() {}
    })
    .await
    .expect("the client stops sending the body of a stream that ended");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reset_mid_upload_pays_once_its_handler_started_committing_at_hand_over() {
    reset_mid_upload(Commit::AtHandOver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reset_mid_upload_before_its_charged_extractor_succeeded_pays_nothing() {
    reset_mid_upload(Commit::InHandler).await;
}

/// An admitted upload whose client resets the stream while the handler's
/// extractor is still reading the body: committing at the hand-over the
/// handler had started, so it pays in full, once (I3); committing through
/// `Charged<T>`, the extractor never succeeded, so it is released for zero
/// and counted (I4). The connection goes on serving either way.
async fn reset_mid_upload(commit: Commit) {
    let mut app = serve(commit, 1).await;
    let client = Client::connect(&app.server).await;
    let (body, receiving) = upload();
    let pending = client.start(client.request(Method::POST, "/upload", receiving));
    body.send(Bytes::from(vec![b'x'; 1024])).await.unwrap();
    let token = tokio::time::timeout(ms(5_000), app.reading.recv())
        .await
        .expect("the extractor starts reading within five seconds")
        .expect("the server is running")
        .expect("the layer tracks cancellation");

    // The body is still open (its sender lives): the client resets.
    pending.abort();
    tokio::time::timeout(ms(5_000), token.cancelled())
        .await
        .expect("the reset reaches the server, which drops the request");
    uploading_stops(&body).await;

    let work = client.get("/work").await;
    work.expect(StatusCode::OK, "GET /work after a reset mid-upload");
    let counters = app.counters();
    assert_eq!(counters.admitted, 2);
    match commit {
        Commit::AtHandOver => {
            assert_eq!(counters.released, 0, "the handler had started");
            assert_eq!(
                billed(app).await,
                vec![WORK_PRICE, UPLOAD_PRICE],
                "I3: the upload paid in full, once"
            );
        }
        Commit::InHandler => {
            assert_eq!(counters.released, 1, "I4: the upload was released");
            assert_eq!(
                billed(app).await,
                vec![WORK_PRICE],
                "I4: the upload whose input never arrived paid nothing"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reset_mid_response_cancels_its_token_and_pays_once_committing_at_hand_over() {
    reset_mid_response(Commit::AtHandOver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reset_mid_response_cancels_its_token_and_pays_once_committing_in_handler() {
    reset_mid_response(Commit::InHandler).await;
}

/// A client that resets the stream while the response body streams (it
/// drops the body after the first chunk) cancels the request's token, so
/// work feeding the body can stop, and pays in full, once (I3).
async fn reset_mid_response(commit: Commit) {
    let mut app = serve(commit, 1).await;
    let client = Client::connect(&app.server).await;
    let pending = client.start(client.request(Method::GET, "/stream", empty()));
    let token = app.started().await;
    let response = response(pending).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = tokio::time::timeout(ms(5_000), body.frame())
        .await
        .expect("the first chunk arrives")
        .expect("the body has a first frame")
        .expect("the first frame is whole");
    assert_eq!(first.into_data().unwrap(), "x");
    assert!(!token.is_cancelled(), "the body is still streaming");

    drop(body);
    tokio::time::timeout(ms(5_000), token.cancelled())
        .await
        .expect("the reset cancels the token within five seconds");
    client
        .get("/work")
        .await
        .expect(StatusCode::OK, "GET /work after a reset mid-response");
    assert_eq!(app.counters().released, 0);
    assert_eq!(
        billed(app).await,
        vec![WORK_PRICE, STREAM_PRICE],
        "I3: the reset stream paid in full, once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_style_response_with_trailers_completes_and_pays_once_committing_at_hand_over() {
    grpc_trailers(Commit::AtHandOver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_style_response_with_trailers_completes_and_pays_once_committing_in_handler() {
    grpc_trailers(Commit::InHandler).await;
}

/// A gRPC-style exchange (POST, `te: trailers`, a response of one data
/// frame ended by `grpc-status` trailers) reaches the client whole, counts
/// as complete (the token is never cancelled, even once the server dropped
/// the body), and pays once.
async fn grpc_trailers(commit: Commit) {
    let mut app = serve(commit, 1).await;
    let client = Client::connect(&app.server).await;
    let mut request = client.request(Method::POST, "/grpc", full(&b"\0\0\0\0\0"[..]));
    request.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    request
        .headers_mut()
        .insert(header::TE, http::HeaderValue::from_static("trailers"));
    let pending = client.start(request);
    let token = app.started().await;
    let response = response(pending).await;
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers().contains_key("x-tollgate-request-id"));
    let collected = tokio::time::timeout(ms(5_000), response.into_body().collect())
        .await
        .expect("the body arrives within five seconds")
        .expect("the body arrives whole");
    let trailers = collected.trailers().cloned().expect("trailers arrive");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(collected.to_bytes().len(), 5);

    tokio::time::timeout(ms(5_000), app.grpc_dropped.recv())
        .await
        .expect("the server drops the response body")
        .expect("the server is running");
    assert!(
        !token.is_cancelled(),
        "a response sent whole, trailers and all, is complete"
    );
    assert_eq!(billed(app).await, vec![GRPC_PRICE]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_held_when_shutdown_begins_is_refused_at_its_commit_committing_at_hand_over() {
    held_at_shutdown(Commit::AtHandOver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_held_when_shutdown_begins_is_refused_at_its_commit_committing_in_handler() {
    held_at_shutdown(Commit::InHandler).await;
}

/// I25: a stream admitted and held before its handler when shutdown
/// begins is refused where it would have been charged, `503
/// shutting_down` naming its request id, on its stream of the still open
/// connection (and, being HTTP/2, with no `Connection` header), and pays
/// nothing; the stream already running finishes and pays in full.
async fn held_at_shutdown(commit: Commit) {
    let mut app = serve(commit, 1).await;
    let client = Client::connect(&app.server).await;
    let running = client.start(client.request(Method::GET, "/slow", empty()));
    app.started().await;
    let held = client.start(client.request(Method::GET, "/slow", empty()));
    eventually("the held stream is admitted", || {
        app.counters().admitted == 2
    })
    .await;

    app.server.handle.request_shutdown();
    app.gate.add_permits(1);
    answered(running)
        .await
        .expect(StatusCode::OK, "the running stream");
    let refused = answered(held).await;
    refused.expect(StatusCode::SERVICE_UNAVAILABLE, "the held stream");
    assert!(refused.body.contains("shutting_down"), "{}", refused.body);
    assert!(
        refused.request_id().is_some(),
        "an admitted request's refusal names its id"
    );
    assert!(
        app.started.try_recv().is_err(),
        "the held stream's handler never started"
    );
    assert_eq!(app.headers.http2.load(Ordering::SeqCst), 0);
    let counters = app.counters();
    assert_eq!(counters.denied_for(DenyReason::ShuttingDown), 1);
    assert_eq!(counters.released, 0, "a refused commit counts as a denial");
    assert_eq!(
        billed(app).await,
        vec![SLOW_PRICE],
        "I3, I25: the running stream paid in full, the refused one nothing"
    );
}
