//! The deferred commit point: the charge cell the outer layer leaves in the
//! request, and the [`CommitMarkerLayer`] that commits it innermost.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::body::{DenyBody, TollgateBody};
use super::config::Shared;
use super::future::{closing, commit, render};
use super::service::Admitted;
use crate::admission::RequestContext;
use crate::{DenyReason, RequestId};

/// The admitted request's uncommitted charge, shared between the outer
/// [`Tollgate`](super::Tollgate) future and whichever commit point the
/// request reaches first.
pub(super) struct ChargeCell {
    charge: Mutex<Charge>,
    shared: Arc<Shared>,
    request_id: RequestId,
    /// Whether a refused commit's denial says `Connection: close` (see
    /// [`leaves_body_unread`](super::service::leaves_body_unread)).
    close_connection: bool,
    /// Whether a commit point yields once before it commits, so that the
    /// server can see whether the client is still there first: the request
    /// came over HTTP/2, or the outer future has waited with the charge
    /// pending (I37; see [`ResponseFuture`](super::ResponseFuture)'s
    /// `YieldFirst`).
    yield_owed: AtomicBool,
}

/// Where a deferred charge stands.
enum Charge {
    Pending(RequestContext),
    /// Committed at a commit point.
    Committed,
    /// Released for zero: the request ended before a commit point, or one
    /// refused the commit.
    Released,
}

impl ChargeCell {
    /// The pending charge of `context`; `close_connection` for a request
    /// whose refused commit leaves its body unread.
    pub(super) fn new(
        context: RequestContext,
        shared: Arc<Shared>,
        close_connection: bool,
    ) -> Self {
        let request_id = context.request_id();
        Self {
            charge: Mutex::new(Charge::Pending(context)),
            shared,
            request_id,
            close_connection,
            yield_owed: AtomicBool::new(false),
        }
    }

    /// Notes that a commit point owes a yield: the request came over
    /// HTTP/2, or the outer future is waiting.
    pub(super) fn owe_yield(&self) {
        // Relaxed: a hint for the commit point, which reads it in a later
        // poll of the same request; nothing else is published with it.
        self.yield_owed.store(true, Ordering::Relaxed);
    }

    /// Whether a commit point should yield once before committing: one is
    /// owed and the charge is still pending (a commit point reached after
    /// another committed has nothing to commit, so nothing to yield for).
    pub(super) fn yield_owed(&self) -> bool {
        self.yield_owed.load(Ordering::Relaxed) && matches!(*self.lock(), Charge::Pending(_))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Charge> {
        self.charge.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Commits the charge at the runtime's current time, if it is still
    /// pending. Returns the rendered denial if the commit was refused, or if
    /// the charge was already released: a handler must never run unpaid
    /// (I9). `None` when it committed now, or had committed before.
    pub(super) fn commit(&self) -> Option<Response<DenyBody>> {
        // Held across the commit: a second commit point on the same cell
        // (reached through cloned extensions) waits for this one's answer
        // rather than read "committed" before the charge is, and run its
        // handler unpaid if the commit is then refused (I9). The commit
        // is atomics only and never calls back into the cell.
        let mut charge = self.lock();
        let reason = match std::mem::replace(&mut *charge, Charge::Released) {
            Charge::Pending(context) => match commit(context, &self.shared, self.request_id) {
                None => {
                    *charge = Charge::Committed;
                    return None;
                }
                Some(refused) => refused,
            },
            Charge::Committed => {
                *charge = Charge::Committed;
                return None;
            }
            // The request ended (its response future completed or was
            // dropped) before this commit point was reached: a buffer that
            // called it late, or work that carried the request on. Counted
            // once, as released, when it was released.
            Charge::Released => DenyReason::FundingExpiredAtStart,
        };
        drop(charge);
        Some(closing(
            render(&self.shared, reason, Some(self.request_id)),
            self.close_connection,
        ))
    }

    /// Drops the charge if no commit point took it: released for zero (I4).
    pub(super) fn release(&self) {
        let mut charge = self.lock();
        if !matches!(*charge, Charge::Pending(_)) {
            return;
        }
        let pending = std::mem::replace(&mut *charge, Charge::Released);
        drop(charge);
        self.shared.handle.engine().counters().released();
        tracing::debug!(
            request_id = %self.request_id,
            "tollgate: the request ended before its commit point; released for zero",
        );
        drop(pending);
    }
}

impl fmt::Debug for ChargeCell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChargeCell")
            .field("request_id", &self.request_id)
            .finish_non_exhaustive()
    }
}

/// Put in a deferred-mode request's extensions by the outer layer; taken by
/// [`CommitMarker`] or [`Charged`](super::Charged).
#[derive(Clone, Debug)]
pub(super) struct PendingCharge(pub(super) Arc<ChargeCell>);

/// Releases a deferred charge nobody committed when the outer future
/// completes or is dropped.
#[derive(Debug)]
pub(super) struct ReleaseOnDrop(pub(super) Arc<ChargeCell>);

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Commits the request's deferred charge where it is placed: innermost,
/// inside any concurrency limit, timeout or queue, just before the handler.
///
/// Use it with [`TollgateBuilder::commit_in_handler`](super::TollgateBuilder::commit_in_handler).
/// A request without a pending charge (the layer commits at the hand-over, or
/// the charge was already committed) passes straight through; one no
/// tollgate layer admitted at all (a route outside the layer) is answered
/// 500, as the [`Admitted`](super::Admitted) extractor answers it, and its
/// handler does not run. See the [module docs](super) for the ordering.
#[derive(Clone, Copy, Debug, Default)]
#[must_use]
pub struct CommitMarkerLayer;

impl CommitMarkerLayer {
    /// The layer.
    pub fn new() -> Self {
        Self
    }
}

impl<S> Layer<S> for CommitMarkerLayer {
    type Service = CommitMarker<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CommitMarker { inner }
    }
}

/// The service [`CommitMarkerLayer`] builds: it commits the request's
/// pending charge when its future is first polled (the next poll for a
/// request that waited or came over HTTP/2, I37), after the inner service
/// has built its future and before that future runs, and on a refused
/// commit answers with the layer's denial without ever polling the inner
/// future (I2, I9).
///
/// Not in `call`: a future dropped between `call` and its first poll (a
/// caller that gave up, or a buffer whose worker calls the marker for a
/// request whose client then left) never started its handler, so it must
/// pay nothing (I4).
#[derive(Clone, Debug)]
pub struct CommitMarker<S> {
    inner: S,
}

impl<S> CommitMarker<S> {
    /// The wrapped service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for CommitMarker<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<TollgateBody<ResBody>>;
    type Error = S::Error;
    type Future = CommitMarkerFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        // Moved, not cloned: this marker is where the charge commits, and a
        // commit point further in finds it committed either way.
        let charge = request
            .extensions_mut()
            .remove::<PendingCharge>()
            .map(|PendingCharge(cell)| cell);
        if charge.is_none() && request.extensions().get::<Admitted>().is_none() {
            // No tollgate layer admitted it (the route is not behind one):
            // the handler would run unmetered, so it does not run at all.
            return CommitMarkerFuture {
                charge: None,
                yielded: false,
                state: MarkerState::Denied {
                    response: Some(not_admitted()),
                },
            };
        }
        CommitMarkerFuture {
            charge,
            yielded: false,
            state: MarkerState::Inner {
                future: self.inner.call(request),
            },
        }
    }
}

/// Completes at its second poll, having woken its task at the first: the
/// yield a commit point takes for a request that owes one (see
/// [`ChargeCell::yield_owed`]).
pub(super) fn yield_once() -> impl Future<Output = ()> {
    let mut yielded = false;
    std::future::poll_fn(move |cx| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
}

/// What a commit point answers for a request no tollgate layer admitted:
/// the route is not behind the layer, a server misconfiguration, so 500,
/// saying which.
pub(super) fn not_admitted() -> Response<DenyBody> {
    let mut response = Response::new(DenyBody::new(NOT_ADMITTED));
    *response.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Why a route that reads or commits tollgate's admission answers 500.
pub(super) const NOT_ADMITTED: &str =
    "this route reads tollgate's admission but is not behind a TollgateLayer";

pin_project! {
    /// The future a [`CommitMarker`] returns: the inner service's, or a
    /// refused commit's denial (or, for a request no tollgate layer
    /// admitted, a 500).
    pub struct CommitMarkerFuture<F> {
        // The request's pending charge, until a poll commits it.
        charge: Option<Arc<ChargeCell>>,
        // Whether this marker has taken the yield its request owed.
        yielded: bool,
        #[pin]
        state: MarkerState<F>,
    }
}

pin_project! {
    #[project = MarkerProj]
    enum MarkerState<F> {
        Inner { #[pin] future: F },
        Denied { response: Option<Response<DenyBody>> },
    }
}

impl<F, B, E> Future for CommitMarkerFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<TollgateBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // I4, I37: a request that came over HTTP/2 or waited on its way
        // here (for a limit's place, say) yields once first, so that a
        // server which polls it before looking for its client's reset can
        // drop it unpaid.
        if !*this.yielded && this.charge.as_ref().is_some_and(|cell| cell.yield_owed()) {
            *this.yielded = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        // I3: the handler starts now, so the full price is charged now.
        if let Some(denial) = this.charge.take().and_then(|cell| cell.commit()) {
            // I2, I9: refused, so the handler's future is dropped unpolled.
            this.state.set(MarkerState::Denied {
                response: Some(denial),
            });
        }
        match this.state.project() {
            MarkerProj::Inner { future } => future
                .poll(cx)
                .map(|result| result.map(|response| response.map(TollgateBody::inner))),
            MarkerProj::Denied { response } => {
                let response = response
                    .take()
                    .expect("a commit marker future is not polled after it completed");
                Poll::Ready(Ok(response.map(TollgateBody::denial)))
            }
        }
    }
}

impl<F> fmt::Debug for CommitMarkerFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            MarkerState::Inner { .. } => f.write_str("CommitMarkerFuture::Inner"),
            MarkerState::Denied { .. } => f.write_str("CommitMarkerFuture::Denied"),
        }
    }
}
