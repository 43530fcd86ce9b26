//! The tollgate layer in a real axum server on 127.0.0.1, with real time
//! and raw TCP clients, so disconnects happen exactly where a test puts
//! them: every served request is charged exactly once, a client that leaves
//! after its handler started pays in full, and one that leaves while its
//! request waits in a concurrency limit outside tollgate pays nothing (I4,
//! I8, I25).

mod support;

use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::{Extension, Router};
use std::io::{Read as _, Write as _};
use std::net::TcpStream;

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tollgate::layer::{Admitted, Price, TollgateLayer};
use tollgate::runtime::{InstanceRuntime, RuntimeHandle};
use tollgate::store::{Clock, MemoryStore, SystemClock};
use tollgate::{AccountId, CostUnits, PermissionBits};
use tower::limit::GlobalConcurrencyLimitLayer;

const INITIAL: u64 = 10_000;
/// The price of `/work`.
const WORK_PRICE: u64 = 3;
/// The price of `/slow`.
const SLOW_PRICE: u64 = 11;
/// How long `/slow` runs once started.
const SLOW_FOR: Duration = Duration::from_millis(600);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
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

/// A store, a runtime over it (ready), and an axum app on 127.0.0.1:0:
/// `/work` and `/slow` behind tollgate, behind one global concurrency limit
/// of one request placed OUTSIDE tollgate, so a queued request has not been
/// admitted.
async fn serve() -> Server {
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
        .build()
        .unwrap();
    let (started, slow_started) = mpsc::unbounded_channel();
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
                tokio::time::sleep(SLOW_FOR).await;
                "slow"
            }),
        )
        .layer(layer)
        // Added last, so outermost: requests wait here before tollgate.
        .layer(GlobalConcurrencyLimitLayer::new(1));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let serving = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
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
    /// Opens a connection and sends `GET path` with the key. A blocking
    /// std stream (tokio's `io-util` is not enabled here): connecting to
    /// and writing a few bytes to a local socket does not block in
    /// practice, and dropping it closes the connection at once.
    fn send(&self, path: &str) -> TcpStream {
        let mut stream = TcpStream::connect(self.address).unwrap();
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
            self.key
        );
        stream.write_all(request.as_bytes()).unwrap();
        stream
    }

    /// Sends `GET path` and reads the whole response.
    async fn get(&self, path: &str) -> String {
        let mut stream = self.send(path);
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

    /// Stops serving, shuts the runtime down, and returns the units of
    /// every usage event the store received.
    async fn finish(self) -> (Vec<u64>, Arc<MemoryStore>, AccountId, Arc<SystemClock>) {
        self.serving.abort();
        let report = self.runtime.shutdown().await;
        assert_eq!(report.lost_events(), 0, "I25: no usage lost at shutdown");
        assert_eq!(report.abandoned(), 0, "no request held a lease");
        let units = self
            .store
            .usage(self.account)
            .unwrap()
            .iter()
            .map(|event| event.units.get())
            .collect();
        (units, self.store, self.account, self.clock)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_served_request_is_charged_exactly_once() {
    const N: u64 = 20;
    let server = serve().await;
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

    let (units, store, account, clock) = server.finish().await;
    assert_eq!(units, vec![WORK_PRICE; 20], "I8: one event per request");
    let view = store.account(account, clock.now()).unwrap();
    assert_eq!(view.leased, CostUnits::ZERO, "every lease went back");
    assert_eq!(
        view.balance,
        CostUnits(INITIAL - N * WORK_PRICE),
        "balance + usage add up to the initial balance exactly"
    );
    assert!(store.audit().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_after_its_handler_started_pays_in_full_and_one_that_leaves_while_queued_pays_nothing()
 {
    let mut server = serve().await;

    // A: admitted, committed, its handler running and holding the limit.
    let first = server.send("/slow");
    tokio::time::timeout(ms(5_000), server.slow_started.recv())
        .await
        .expect("the slow handler starts")
        .unwrap();
    assert_eq!(server.handle.counters().admitted, 1);

    // B: waits in the concurrency limit, outside tollgate, so it has not
    // been admitted; then its client leaves.
    let queued = server.send("/slow");
    tokio::time::sleep(ms(100)).await;
    assert_eq!(
        server.handle.counters().admitted,
        1,
        "a queued request is not admitted yet"
    );
    drop(queued);
    tokio::time::sleep(ms(100)).await;

    // A's client leaves while its handler runs.
    drop(first);
    // Long enough for A's handler to have ended either way.
    tokio::time::sleep(SLOW_FOR + ms(200)).await;
    assert_eq!(
        server.handle.counters().admitted,
        1,
        "I4: the queued request never reached admission"
    );
    assert!(
        server.slow_started.try_recv().is_err(),
        "the queued request's handler never started"
    );

    // The limit was released: a fresh request is served.
    let response = server.get("/work").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");

    let (units, store, account, clock) = server.finish().await;
    assert_eq!(
        units,
        vec![SLOW_PRICE, WORK_PRICE],
        "the started request paid in full, the queued one nothing"
    );
    let view = store.account(account, clock.now()).unwrap();
    assert_eq!(view.balance, CostUnits(INITIAL - SLOW_PRICE - WORK_PRICE));
    assert_eq!(view.leased, CostUnits::ZERO);
    assert!(store.audit().unwrap().is_empty());
}
