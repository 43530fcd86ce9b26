//! The deferred commit point in a real axum server on 127.0.0.1, with real
//! time and raw TCP clients: with `TollgateBuilder::commit_in_handler`,
//! admission reserves in the outer layer, a request queued in a concurrency
//! limit *inside* it holds its reservation, and the charge is committed only
//! where the request reaches a `CommitMarkerLayer` or a `Charged` extractor
//! (I3); a request that ends before that is released for zero (I4).

mod support;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{FromRequest, Request};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::StatusCode;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tollgate::layer::{Charged, CommitMarkerLayer, Price, TollgateLayer};
use tollgate::runtime::{InstanceRuntime, RuntimeHandle};
use tollgate::store::{Clock, MemoryStore, SystemClock};
use tollgate::{AccountId, CostUnits, PermissionBits};
use tower::limit::GlobalConcurrencyLimitLayer;

const INITIAL: u64 = 10_000;
/// The price of `/work` and `/validate`.
const WORK_PRICE: u64 = 3;
/// The price of `/slow`.
const SLOW_PRICE: u64 = 11;
/// How long `/slow` runs once started.
const SLOW_FOR: Duration = Duration::from_millis(600);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Which app the server runs.
#[derive(Clone, Copy)]
enum App {
    /// `/work` and `/slow`: tollgate (deferred) outermost, a global
    /// concurrency limit of one inside it, the commit marker innermost.
    LimitInside,
    /// `POST /validate`, committing through `Charged<Validated>`.
    ChargedExtractor,
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

struct Server {
    store: Arc<MemoryStore>,
    clock: Arc<SystemClock>,
    account: AccountId,
    key: String,
    runtime: InstanceRuntime,
    handle: RuntimeHandle,
    address: std::net::SocketAddr,
    serving: JoinHandle<()>,
    /// One message each time `/slow` starts running.
    slow_started: mpsc::UnboundedReceiver<()>,
}

async fn serve(app: App) -> Server {
    let support::runtime::RealTimeWorld {
        clock,
        store,
        account,
        key,
        runtime,
        handle,
    } = support::runtime::start_real_time(INITIAL).await;

    let layer = TollgateLayer::builder(handle.clone())
        .price(|parts: &http::request::Parts| Price {
            units: CostUnits(if parts.uri.path() == "/slow" {
                SLOW_PRICE
            } else {
                WORK_PRICE
            }),
            required: PermissionBits::NONE,
        })
        .commit_in_handler()
        .build()
        .unwrap();
    let (started, slow_started) = mpsc::unbounded_channel();
    let router = match app {
        App::LimitInside => Router::new()
            .route("/work", get(|| async { "work" }))
            .route(
                "/slow",
                get(move || async move {
                    started.send(()).unwrap();
                    tokio::time::sleep(SLOW_FOR).await;
                    "slow"
                }),
            )
            // Later `.layer` calls are outer: the marker is innermost, the
            // limit between it and tollgate, tollgate outermost.
            .layer(CommitMarkerLayer::new())
            .layer(GlobalConcurrencyLimitLayer::new(1))
            .layer(layer),
        App::ChargedExtractor => Router::new()
            .route(
                "/validate",
                post(|Charged(Validated): Charged<Validated>| async { "valid" }),
            )
            .layer(layer),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let serving = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    Server {
        store,
        clock,
        account,
        key,
        runtime,
        handle,
        address,
        serving,
        slow_started,
    }
}

impl Server {
    /// Opens a connection and sends `method path` with the key and `body`.
    fn send_with(&self, method: &str, path: &str, body: &str) -> TcpStream {
        let mut stream = TcpStream::connect(self.address).unwrap();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.key,
            body.len(),
        );
        stream.write_all(request.as_bytes()).unwrap();
        stream
    }

    fn send(&self, path: &str) -> TcpStream {
        self.send_with("GET", path, "")
    }

    /// Reads the whole response from `stream`.
    async fn read(mut stream: TcpStream) -> String {
        stream.set_read_timeout(Some(ms(5_000))).unwrap();
        tokio::task::spawn_blocking(move || {
            let mut response = String::new();
            stream
                .read_to_string(&mut response)
                .expect("the server answers within five seconds");
            response
        })
        .await
        .unwrap()
    }

    async fn request(&self, method: &str, path: &str, body: &str) -> String {
        Self::read(self.send_with(method, path, body)).await
    }

    /// The units left in this instance's lease for the account.
    fn remaining(&self) -> u64 {
        self.handle
            .account_reports()
            .into_iter()
            .find(|report| report.account == self.account)
            .and_then(|report| report.remaining)
            .expect("the account has a lease")
            .get()
    }

    async fn started(&mut self) {
        tokio::time::timeout(ms(5_000), self.slow_started.recv())
            .await
            .expect("the slow handler starts")
            .unwrap();
    }

    /// Stops serving, shuts the runtime down, and returns the units of
    /// every usage event the store received, after checking the balance
    /// adds up to them and the audit is clean.
    async fn finish(self) -> Vec<u64> {
        self.serving.abort();
        let report = self.runtime.shutdown().await;
        assert_eq!(report.lost_events(), 0, "I25: no usage lost at shutdown");
        assert_eq!(report.abandoned(), 0, "no request held a lease");
        let units: Vec<u64> = self
            .store
            .usage(self.account)
            .unwrap()
            .iter()
            .map(|event| event.units.get())
            .collect();
        let view = self.store.account(self.account, self.clock.now()).unwrap();
        assert_eq!(view.leased, CostUnits::ZERO, "every lease went back");
        assert_eq!(
            view.balance,
            CostUnits(INITIAL - units.iter().sum::<u64>()),
            "balance + usage add up to the initial balance exactly"
        );
        assert!(self.store.audit().unwrap().is_empty());
        units
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_inside_the_layer_holds_its_reservation_and_pays_nothing_if_its_client_leaves()
 {
    let mut server = serve(App::LimitInside).await;

    // A: admitted, committed at the marker, its handler holding the limit.
    let first = server.send("/slow");
    server.started().await;
    let before_queued = server.remaining();

    // B: admitted by tollgate, then queued in the limit inside it.
    let queued = server.send("/slow");
    tokio::time::sleep(ms(150)).await;
    assert_eq!(
        server.handle.counters().admitted,
        2,
        "the queued request was admitted before it queued"
    );
    assert_eq!(
        server.remaining(),
        before_queued - SLOW_PRICE,
        "the queued request holds its reservation while it waits"
    );

    // B's client leaves while B waits: B never reached the commit point.
    drop(queued);
    tokio::time::sleep(ms(150)).await;
    assert_eq!(
        server.remaining(),
        before_queued,
        "I4: the queued request's reservation was released for zero"
    );

    let response = Server::read(first).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(
        server.slow_started.try_recv().is_err(),
        "the queued request's handler never started"
    );
    let response = server.request("GET", "/work", "").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");

    assert_eq!(
        server.finish().await,
        vec![SLOW_PRICE, WORK_PRICE],
        "I3, I4: the started request paid in full, the abandoned queued one nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_inside_the_layer_that_then_runs_is_charged_in_full_once() {
    let mut server = serve(App::LimitInside).await;

    let first = server.send("/slow");
    server.started().await;
    let second = server.send("/slow");
    tokio::time::sleep(ms(150)).await;
    assert_eq!(server.handle.counters().admitted, 2);

    let (first, second) = tokio::join!(Server::read(first), Server::read(second));
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(second.starts_with("HTTP/1.1 200"), "{second}");
    server.started().await;

    assert_eq!(
        server.finish().await,
        vec![SLOW_PRICE, SLOW_PRICE],
        "I3: the queued request was charged its full price when its handler started"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charged_extractor_charges_nothing_when_its_input_is_rejected_and_once_when_accepted() {
    let server = serve(App::ChargedExtractor).await;

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
