//! A real axum server on 127.0.0.1 over a [`RealTimeWorld`], with raw TCP
//! clients, for the end-to-end layer tests. A blocking std stream (tokio's
//! `io-util` is not enabled here): connecting to and writing a few bytes to
//! a local socket does not block in practice, and dropping it closes the
//! connection at once, so disconnects happen exactly where a test puts them.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::Router;
use axum::body::{Body, Bytes};
use http_body::Frame;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tollgate::layer::{Price, TollgateBuilder, TollgateLayer};
use tollgate::runtime::{InstanceRuntime, RuntimeHandle};
use tollgate::store::{Clock, MemoryStore, SystemClock};
use tollgate::{AccountId, CostUnits, PermissionBits};

use super::runtime::{RealTimeWorld, ms};

/// A [`RealTimeWorld`] serving a router on 127.0.0.1.
pub(crate) struct TestServer {
    pub(crate) clock: Arc<SystemClock>,
    pub(crate) store: Arc<MemoryStore>,
    pub(crate) account: AccountId,
    /// The key's plaintext, sent with every request.
    pub(crate) key: String,
    pub(crate) runtime: InstanceRuntime,
    pub(crate) handle: RuntimeHandle,
    pub(crate) address: SocketAddr,
    pub(crate) serving: JoinHandle<()>,
    /// The account's balance when `world` was started.
    pub(crate) initial: u64,
}

impl TestServer {
    /// Binds 127.0.0.1:0 and serves `router` over `world`, whose account
    /// was opened with `initial` units.
    pub(crate) async fn serve(world: RealTimeWorld, initial: u64, router: Router) -> Self {
        Self::listen(world, initial, |listener| async move {
            axum::serve(listener, router).await.unwrap();
        })
        .await
    }

    /// Binds 127.0.0.1:0 and runs `serve` on the listener, over `world`.
    async fn listen<F: Future<Output = ()> + Send + 'static>(
        world: RealTimeWorld,
        initial: u64,
        serve: impl FnOnce(TcpListener) -> F,
    ) -> Self {
        let RealTimeWorld {
            clock,
            store,
            account,
            key,
            runtime,
            handle,
        } = world;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let serving = tokio::spawn(serve(listener));
        Self {
            clock,
            store,
            account,
            key,
            runtime,
            handle,
            address,
            serving,
            initial,
        }
    }

    /// Opens a connection and sends `method path` with the key and `body`.
    pub(crate) fn send_with(&self, method: &str, path: &str, body: &str) -> TcpStream {
        let mut stream = TcpStream::connect(self.address).unwrap();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.key,
            body.len(),
        );
        stream.write_all(request.as_bytes()).unwrap();
        stream
    }

    /// Opens a connection and sends `GET path` with the key.
    pub(crate) fn send(&self, path: &str) -> TcpStream {
        self.send_with("GET", path, "")
    }

    /// Reads the whole response from `stream`.
    pub(crate) async fn read(mut stream: TcpStream) -> String {
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

    /// Sends `method path` with `body` and reads the whole response.
    pub(crate) async fn request(&self, method: &str, path: &str, body: &str) -> String {
        Self::read(self.send_with(method, path, body)).await
    }

    /// Sends `GET path` and reads the whole response.
    pub(crate) async fn get(&self, path: &str) -> String {
        self.request("GET", path, "").await
    }

    /// The units left in this instance's lease for the account.
    pub(crate) fn remaining(&self) -> u64 {
        self.handle
            .account_reports()
            .into_iter()
            .find(|report| report.account == self.account)
            .and_then(|report| report.remaining)
            .expect("the account has a lease")
            .get()
    }

    /// Stops serving, shuts the runtime down, and returns the units of
    /// every usage event the store received, after checking the balance
    /// adds up to them and the audit is clean.
    pub(crate) async fn finish(self) -> Vec<u64> {
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
            CostUnits(self.initial - units.iter().sum::<u64>()),
            "balance + usage add up to the initial balance exactly"
        );
        assert!(self.store.audit().unwrap().is_empty());
        units
    }
}

/// A tollgate layer builder over `handle` that prices each request at
/// `price(path)` units and requires no permission.
pub(crate) fn priced_by_path(
    handle: &RuntimeHandle,
    price: impl Fn(&str) -> u64 + Send + Sync + 'static,
) -> TollgateBuilder {
    TollgateLayer::builder(handle.clone()).price(move |parts: &http::request::Parts| Price {
        units: CostUnits(price(parts.uri.path())),
        required: PermissionBits::NONE,
    })
}

/// Waits (at most five seconds) for the next message on `started`, which a
/// test's handler sends each time it starts running.
pub(crate) async fn wait_started(
    started: &mut tokio::sync::mpsc::UnboundedReceiver<()>,
    expectation: &str,
) {
    tokio::time::timeout(ms(5_000), started.recv())
        .await
        .expect(expectation)
        .unwrap();
}

/// Waits (at most five seconds, looking every few milliseconds) until
/// `holds` says yes; panics naming `what` if it never does. For what a
/// server does in its own time, which a fixed sleep would only guess.
pub(crate) async fn eventually(what: &str, mut holds: impl FnMut() -> bool) {
    let give_up = tokio::time::Instant::now() + ms(5_000);
    while !holds() {
        assert!(
            tokio::time::Instant::now() < give_up,
            "never happened: {what}"
        );
        tokio::time::sleep(ms(5)).await;
    }
}

impl TestServer {
    /// As [`serve`](Self::serve), but each connection is served by
    /// hyper-util's auto builder, which speaks HTTP/2 to a client that opens
    /// with the HTTP/2 preface (prior-knowledge h2c) and HTTP/1.1 to any
    /// other, as a server behind an h2c load balancer does. Every
    /// connection is served on a task of its own: `finish` stops accepting,
    /// and a connection still open is served until its client leaves.
    pub(crate) async fn serve_h2c(world: RealTimeWorld, initial: u64, router: Router) -> Self {
        use hyper_util::rt::{TokioExecutor, TokioIo};
        use hyper_util::server::conn::auto;
        use hyper_util::service::TowerToHyperService;

        Self::listen(world, initial, |listener| async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let service = TowerToHyperService::new(router.clone());
                tokio::spawn(async move {
                    // A connection's end (its client left, or reset it) is
                    // the test's to see through the server's counts.
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        })
        .await
    }
}

/// Wrapped around each response body outside the layer: says when the
/// server drops it, after dropping the layer's body inside, so whatever
/// that drop does has been done when the message arrives.
pub(crate) struct SignalsDrop {
    pub(crate) inner: Option<Body>,
    pub(crate) dropped: mpsc::UnboundedSender<()>,
}

impl http_body::Body for SignalsDrop {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner
            .as_ref()
            .is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.as_ref().map_or_else(
            || http_body::SizeHint::with_exact(0),
            http_body::Body::size_hint,
        )
    }
}

impl Drop for SignalsDrop {
    fn drop(&mut self) {
        drop(self.inner.take());
        let _ = self.dropped.send(());
    }
}
