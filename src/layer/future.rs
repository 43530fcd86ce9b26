//! The response future: waits for the inner service, then commits the
//! charge as it hands the request over.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use std::fmt::Write as _;

use http::header::HeaderName;
use http::{HeaderValue, Request, Response};
use jiff::Timestamp;
use pin_project_lite::pin_project;
use tokio_util::sync::{CancellationToken, DropGuard};
use tower_service::Service;

use super::body::{DenyBody, TollgateBody};
use super::config::Shared;
use super::deferred::{ChargeCell, ReleaseOnDrop};
use super::service::{REQUEST_ID_HEADER, admit, deny, leaves_body_unread};
use crate::admission::RequestContext;
use crate::{CommitError, CostUnits, DenyReason, RequestId};

pin_project! {
    /// The future a [`Tollgate`](super::Tollgate) returns.
    ///
    /// An admitted request is handed to the inner service at once when the
    /// service is ready; otherwise it waits here for the service, already
    /// admitted (a concurrency limit inside the layer makes it wait), and
    /// is handed over when it is. By default the charge commits at the
    /// first poll after the hand-over (the next one for a request that
    /// waited or came over HTTP/2, I37), just before the inner future is
    /// polled; dropped before that, the future drops the reservation, which
    /// charges zero (I4). An inner service that fails its readiness is not
    /// polled again: the request gets its error (`E`), and the charge is
    /// released for zero as the error is returned. Nothing on this path is
    /// boxed.
    ///
    /// In deferred mode
    /// ([`TollgateBuilder::commit_in_handler`](super::TollgateBuilder::commit_in_handler))
    /// it commits nothing itself; a charge no commit point took by the time
    /// the inner future completes with a response, or this future is
    /// dropped (after an error, say), is released for zero (I4).
    pub struct ResponseFuture<S, R, F, E> {
        // The inner service's future, once it has taken the request.
        #[pin]
        future: Option<F>,
        // The inner service and the request, until the service is ready.
        waiting: Option<(S, R)>,
        // The inner service's readiness error at the hand-over, answered
        // at the first poll: a failed service is not polled again.
        failed: Option<E>,
        charge: Charge,
        // Cancels the request's token if this future is dropped before it
        // completes. On completion it is disarmed, or handed to a response
        // body that is still to stream.
        cancel_on_drop: Option<CancelOnDrop>,
        // A request refused for a lease shortage, waiting for its lease
        // (`TollgateBuilder::wait_for_lease`); its service and request
        // wait in `waiting`.
        lease_wait: Option<LeaseWait>,
        // Whether this future yields once before its charge commits.
        yield_first: YieldFirst,
    }
}

/// Whether a request owes one yield before its charge commits, and if so
/// whether it has taken it (I37).
///
/// A request yields once before it commits, so that the server can see
/// whether its client is still there, if it waited (for its service, a
/// lease, or its way to a commit point further in) or came over HTTP/2. A
/// server may poll a woken request before it looks at its client: hyper's
/// HTTP/2 server polls a stream's future first and looks for a
/// `RST_STREAM` only when the future is pending. When a connection drops,
/// its running request is dropped, which frees a concurrency limit's
/// place, and the next request of the connection waiting for that place is
/// woken. Had it committed in that poll, it would pay for a handler started
/// for a client already gone, and the next would do the same in turn. Over
/// HTTP/2 the layer cannot tell whether a request waited before it reached
/// the layer (a limit outside the layer, as axum routers need), so every
/// HTTP/2 request owes the yield.
#[derive(Clone, Copy, PartialEq, Eq)]
enum YieldFirst {
    NotOwed,
    Owed,
    Taken,
}

impl YieldFirst {
    /// What a request owes from the start: nothing yet over HTTP/1, the
    /// yield over HTTP/2 and anything later (multiplexed streams).
    fn at_admission(version: http::Version) -> Self {
        if matches!(
            version,
            http::Version::HTTP_09 | http::Version::HTTP_10 | http::Version::HTTP_11
        ) {
            Self::NotOwed
        } else {
            Self::Owed
        }
    }
}

/// A request's wait for its lease: admission tried again at each change of
/// the account's slot until it admits, refuses for another reason, or the
/// wait is over. Yields the layer's state and the request's span with the
/// outcome, for the response future to go on with. Boxed: it exists only
/// for a request that waits, and keeps every other response future small.
pub(super) type LeaseWait = Pin<
    Box<
        dyn Future<
                Output = (
                    Arc<Shared>,
                    tracing::Span,
                    Result<RequestContext, DenyReason>,
                ),
            > + Send,
    >,
>;

/// What the request owes, and when it settles.
enum Charge {
    /// The default commit point: the hand-over to the inner service.
    AtHandOver {
        // `Some` until the hand-over commits it.
        context: Option<RequestContext>,
        shared: Arc<Shared>,
        request_id: RequestId,
        // Whether a refused commit's denial says `Connection: close`.
        close_connection: bool,
    },
    /// A commit point further in takes it.
    Deferred {
        // Dropped when the request ends: releases an uncommitted charge.
        guard: Option<ReleaseOnDrop>,
        request_id: RequestId,
    },
    /// Refused at admission or at commit.
    Denied {
        response: Option<Response<DenyBody>>,
    },
    /// Waiting for a lease: nothing reserved, nothing owed.
    WaitingForLease,
}

impl Drop for Charge {
    fn drop(&mut self) {
        // I4: a context never handed over is released for zero as it drops
        // with this; the release is counted where operators can see it.
        self.release();
    }
}

impl Charge {
    /// Releases a charge not committed (yet) for zero, and counts the
    /// release: the request ended before its handler ran, or (deferred)
    /// without reaching its commit point. A committed charge stands.
    fn release(&mut self) {
        match self {
            Self::AtHandOver {
                context, shared, ..
            } => {
                if context.take().is_some() {
                    shared.handle.engine().counters().released();
                }
            }
            Self::Deferred { guard, .. } => drop(guard.take()),
            Self::Denied { .. } | Self::WaitingForLease => {}
        }
    }
}

/// How an admitted request reaches the inner service.
pub(super) enum HandOver<S, R, F, E> {
    /// The service was ready at admission and has taken the request.
    Done(F),
    /// The service was not ready: the request waits for it.
    Waiting(S, R),
    /// The service failed: the request gets its error, uncharged.
    Failed(E),
}

impl<S, R, F, E> ResponseFuture<S, R, F, E> {
    /// An admitted request of HTTP `version` committing at the hand-over
    /// `hand_over` performs. The charge is built first, so if the inner
    /// service's `poll_ready` or `call` panics in `hand_over`, its drop
    /// still releases the context and counts the release.
    pub(super) fn admitted(
        context: RequestContext,
        shared: Arc<Shared>,
        cancellation: Option<CancelOnDrop>,
        version: http::Version,
        close_connection: bool,
        hand_over: impl FnOnce() -> HandOver<S, R, F, E>,
    ) -> Self {
        let request_id = context.request_id();
        let charge = Charge::AtHandOver {
            context: Some(context),
            shared,
            request_id,
            close_connection,
        };
        let yield_first = YieldFirst::at_admission(version);
        Self::started(hand_over(), charge, cancellation, yield_first)
    }

    /// An admitted request a commit point further in commits, as for
    /// [`admitted`](Self::admitted).
    pub(super) fn deferred(
        cell: Arc<ChargeCell>,
        request_id: RequestId,
        cancellation: Option<CancelOnDrop>,
        version: http::Version,
        hand_over: impl FnOnce() -> HandOver<S, R, F, E>,
    ) -> Self {
        let yield_first = YieldFirst::at_admission(version);
        if yield_first == YieldFirst::Owed {
            cell.owe_yield();
        }
        let charge = Charge::Deferred {
            guard: Some(ReleaseOnDrop(cell)),
            request_id,
        };
        Self::started(hand_over(), charge, cancellation, yield_first)
    }

    /// A request refused at admission. `close_connection` for one whose
    /// body was sent or announced and will not be read (see
    /// [`leaves_body_unread`](super::service::leaves_body_unread)).
    pub(super) fn denied(
        shared: &Shared,
        reason: DenyReason,
        request_id: Option<RequestId>,
        close_connection: bool,
    ) -> Self {
        let response = closing(render(shared, reason, request_id), close_connection);
        Self {
            future: None,
            waiting: None,
            failed: None,
            charge: Charge::Denied {
                response: Some(response),
            },
            cancel_on_drop: None,
            lease_wait: None,
            yield_first: YieldFirst::NotOwed,
        }
    }

    /// A request refused for a lease shortage that waits for its lease with
    /// `service`, a clone of its own, before admission is tried again.
    pub(super) fn waiting_for_lease(wait: LeaseWait, service: S, request: R) -> Self {
        Self {
            future: None,
            waiting: Some((service, request)),
            failed: None,
            charge: Charge::WaitingForLease,
            cancel_on_drop: None,
            lease_wait: Some(wait),
            yield_first: YieldFirst::NotOwed,
        }
    }

    fn started(
        hand_over: HandOver<S, R, F, E>,
        charge: Charge,
        cancel_on_drop: Option<CancelOnDrop>,
        yield_first: YieldFirst,
    ) -> Self {
        let (future, waiting, failed) = match hand_over {
            HandOver::Done(future) => (Some(future), None, None),
            HandOver::Waiting(service, request) => (None, Some((service, request)), None),
            HandOver::Failed(error) => (None, None, Some(error)),
        };
        Self {
            future,
            waiting,
            failed,
            charge,
            cancel_on_drop,
            lease_wait: None,
            yield_first,
        }
    }
}

impl<S, ReqBody, B> ResponseFuture<S, Request<ReqBody>, S::Future, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<B>> + Clone,
    B: http_body::Body,
{
    /// Waits out a lease wait, if the request is in one, and turns this
    /// future into the admitted or refused request's.
    fn poll_lease_wait(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.as_mut().project();
        let Some(wait) = this.lease_wait.as_mut() else {
            return Poll::Ready(());
        };
        let (shared, span, outcome) = ready!(wait.as_mut().poll(cx));
        let (mut service, request) = this
            .waiting
            .take()
            .expect("a request waiting for its lease holds its service");
        let _entered = span.enter();
        let next = match outcome {
            // Handed over on the clone it waited with: a readiness failure
            // there is this request's answer, as for any request that
            // waits for its service.
            Ok(context) => admit(&shared, &mut service, &mut false, request, context, &span),
            Err(reason) => {
                shared.handle.engine().counters().denied(reason);
                deny(
                    &shared,
                    reason,
                    &span,
                    leaves_body_unread(request.version(), request.headers()),
                )
            }
        };
        self.set(next);
        // A wait's end is a wake like any other: the admitted request
        // yields once before it commits, as one that waited for its service.
        self.note_wait();
        Poll::Ready(())
    }

    /// Notes that this future is about to wait, or has just waited: a
    /// charge not committed yet owes a yield (see [`YieldFirst`]). Called
    /// at every pending poll; once the charge has committed it changes
    /// nothing that matters.
    fn note_wait(self: Pin<&mut Self>) {
        let this = self.project();
        if *this.yield_first == YieldFirst::NotOwed {
            *this.yield_first = YieldFirst::Owed;
        }
        // A commit point further in yields for it.
        if let Charge::Deferred {
            guard: Some(ReleaseOnDrop(cell)),
            ..
        } = this.charge
        {
            cell.owe_yield();
        }
    }
}

impl<S, ReqBody, B> Future for ResponseFuture<S, Request<ReqBody>, S::Future, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<B>> + Clone,
    B: http_body::Body,
{
    type Output = Result<Response<TollgateBody<B>>, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let polled = self.as_mut().poll_request(cx);
        if polled.is_pending() {
            self.note_wait();
        }
        polled
    }
}

impl<S, ReqBody, B> ResponseFuture<S, Request<ReqBody>, S::Future, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<B>> + Clone,
    B: http_body::Body,
{
    fn poll_request(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<<Self as Future>::Output> {
        ready!(self.as_mut().poll_lease_wait(cx));
        let mut this = self.project();
        if let Charge::Denied { response } = this.charge {
            let response = response
                .take()
                .expect("a tollgate response future is not polled after it completed");
            return Poll::Ready(Ok(response.map(TollgateBody::denial)));
        }
        if this.future.is_none() {
            // A failed service drops the request, never handed over: its
            // charge is released for zero now, not when this future is
            // dropped (I4).
            if let Some(error) = this.failed.take() {
                this.charge.release();
                disarm(this.cancel_on_drop);
                return Poll::Ready(Err(error));
            }
            let (service, _) = this
                .waiting
                .as_mut()
                .expect("an admitted request waits for its service until it is handed over");
            if let Err(error) = ready!(service.poll_ready(cx)) {
                this.waiting.take();
                this.charge.release();
                disarm(this.cancel_on_drop);
                return Poll::Ready(Err(error));
            }
            let (mut service, request) = this.waiting.take().expect("checked above");
            this.future.set(Some(service.call(request)));
        }
        if let Charge::AtHandOver {
            context: Some(_), ..
        } = this.charge
            && *this.yield_first == YieldFirst::Owed
        {
            // Not committed yet: the server gets its look at the client
            // first, and a client found gone drops this future unpaid.
            *this.yield_first = YieldFirst::Taken;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if let Charge::AtHandOver {
            context,
            shared,
            request_id,
            close_connection,
        } = this.charge
            && let Some(reason) = context
                .take()
                .and_then(|context| commit(context, shared, *request_id))
        {
            // I2, I9: the commit was refused, so the handler must not run:
            // its future is dropped here without ever being polled.
            this.future.set(None);
            disarm(this.cancel_on_drop);
            let response = closing(render(shared, reason, Some(*request_id)), *close_connection);
            return Poll::Ready(Ok(response.map(TollgateBody::denial)));
        }
        let future = this
            .future
            .as_pin_mut()
            .expect("the inner service has taken the request");
        let outcome = ready!(future.poll(cx));
        // The handler is done. The request is complete once its body has
        // been sent: a body still to stream carries the token's guard, so
        // a client leaving mid-stream still cancels.
        let streaming = match (this.cancel_on_drop.take(), &outcome) {
            (Some(cancel), Ok(response)) if cancel.sends_body(response) => {
                Some((cancel.guard, declared_length(response)))
            }
            (Some(cancel), _) => {
                cancel.guard.disarm();
                None
            }
            (None, _) => None,
        };
        // I4: the request is over; a deferred charge no commit point took
        // is released for zero, whether the handler answered or failed.
        this.charge.release();
        let mut response = outcome?;
        let request_id = match this.charge {
            Charge::AtHandOver { request_id, .. } | Charge::Deferred { request_id, .. } => {
                *request_id
            }
            Charge::Denied { .. } | Charge::WaitingForLease => {
                unreachable!("a denied or waiting request has no inner future")
            }
        };
        insert_request_id(&mut response, request_id);
        Poll::Ready(Ok(response.map(|body| match streaming {
            Some((guard, length)) => TollgateBody::streaming(body, guard, length),
            None => TollgateBody::inner(body),
        })))
    }
}

/// Lets the request's cancellation token live on uncancelled: its response
/// future completed.
fn disarm(cancel_on_drop: &mut Option<CancelOnDrop>) {
    if let Some(cancel) = cancel_on_drop.take() {
        cancel.guard.disarm();
    }
}

/// The hold on an admitted request's cancellation token.
pub(super) struct CancelOnDrop {
    guard: DropGuard,
    /// Whether the response may have a body: false for `HEAD`, whose
    /// response is complete with its headers.
    bodied: bool,
    /// Whether the request is a `CONNECT`, whose successful response is
    /// complete with its headers too: the connection then becomes a
    /// tunnel, and the server drops any body unsent.
    connect: bool,
}

impl CancelOnDrop {
    pub(super) fn new(token: CancellationToken, method: &http::Method) -> Self {
        Self {
            guard: token.drop_guard(),
            bodied: method != http::Method::HEAD,
            connect: method == http::Method::CONNECT,
        }
    }

    /// Whether `response` still has a body to send for this request.
    fn sends_body<B: http_body::Body>(&self, response: &Response<B>) -> bool {
        self.bodied && !(self.connect && response.status().is_success()) && streams(response)
    }
}

/// Whether `response` still has a body to send: a server sends none with
/// 1xx, 204 or 304, and none for a declared length of zero.
fn streams<B: http_body::Body>(response: &Response<B>) -> bool {
    let status = response.status();
    !(status.is_informational()
        || status == http::StatusCode::NO_CONTENT
        || status == http::StatusCode::NOT_MODIFIED
        || response.body().is_end_stream()
        || declared_length(response) == Some(0))
}

/// The body length `response` declares: its `Content-Length`, else its
/// body's exact size. A server stops reading the body after that many
/// bytes, without waiting for its end.
fn declared_length<B: http_body::Body>(response: &Response<B>) -> Option<u64> {
    response
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse().ok())
        .or_else(|| response.body().size_hint().exact())
}

/// Commits `context` at the runtime's current time; returns why not, if
/// the commit was refused.
pub(super) fn commit(
    mut context: RequestContext,
    shared: &Shared,
    request_id: RequestId,
) -> Option<DenyReason> {
    let now = shared.handle.clock().now();
    // I3: the context is owned here, so this commit and the release a
    // dropped context performs are exclusive writes, and the first decides:
    // the request is charged once or not at all.
    match context.commit(now) {
        Ok(units) => {
            tracing::trace!(%request_id, units = units.get(), "tollgate commit");
            None
        }
        Err(error) => {
            let reason = match error {
                CommitError::Denied(reason) => reason,
                // The context was taken from its `Option` exactly once, so
                // nothing else resolved it; fail closed (I5) all the same.
                CommitError::AlreadyReleased | CommitError::AlreadyCommitted => {
                    debug_assert!(false, "a fresh context is resolved only here: {error:?}");
                    DenyReason::FundingExpiredAtStart
                }
            };
            tracing::debug!(%request_id, outcome = reason.code(), "tollgate commit refused");
            shared.handle.engine().counters().denied(reason);
            Some(reason)
        }
    }
}

/// `response`, saying `Connection: close` if `close` (see
/// [`leaves_body_unread`](super::service::leaves_body_unread)).
pub(super) fn closing(mut response: Response<DenyBody>, close: bool) -> Response<DenyBody> {
    if close {
        response
            .headers_mut()
            .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

pub(super) fn render(
    shared: &Shared,
    reason: DenyReason,
    request_id: Option<RequestId>,
) -> Response<DenyBody> {
    let mut response = shared.renderer.render(reason, request_id);
    if let Some(request_id) = request_id {
        insert_request_id(&mut response, request_id);
    }
    if let Some(value) = balance_rate_limit(reason, || shared.handle.clock().now()) {
        response.headers_mut().insert(RATE_LIMIT, value);
    }
    response
}

/// The `RateLimit` field (draft-ietf-httpapi-ratelimit-headers) of a denial
/// that states what the account's balance can still fund: `r` is those
/// units and `t` the seconds until the balance refills, when it does.
///
/// Only these denials carry a true number: an admitted request knows its
/// instance's lease, not the account's balance, and a shortage on one
/// instance says nothing of the others. `RateLimit-Policy` is never sent,
/// because its quota (`q`) is a refill amount the request path does not
/// know. Both reasons come after the key was identified, so the field never
/// reaches an unauthenticated caller.
fn balance_rate_limit(reason: DenyReason, now: impl FnOnce() -> Timestamp) -> Option<HeaderValue> {
    let (remaining, period_end) = match reason {
        DenyReason::BalanceExhausted { period_end } => (CostUnits::ZERO, period_end),
        DenyReason::BalanceInsufficient {
            remaining,
            period_end,
        } => (remaining, period_end),
        _ => return None,
    };
    let mut field = format!("\"balance\";r={}", remaining.get());
    if let Some(end) = period_end {
        // Whole seconds, rounded up, so a client waiting `t` is never early.
        let nanos = u128::try_from(end.as_nanosecond() - now().as_nanosecond()).unwrap_or(0);
        let _ = write!(field, ";t={}", nanos.div_ceil(1_000_000_000));
    }
    HeaderValue::from_str(&field).ok()
}

/// The `RateLimit` response field's name.
pub(super) const RATE_LIMIT: HeaderName = HeaderName::from_static("ratelimit");

fn insert_request_id<B>(response: &mut Response<B>, request_id: RequestId) {
    let value = HeaderValue::from_bytes(&request_id.to_ascii())
        .expect("a request id displays as visible ASCII");
    response.headers_mut().insert(REQUEST_ID_HEADER, value);
}

impl<S, R, F, E> fmt::Debug for ResponseFuture<S, R, F, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.charge {
            Charge::AtHandOver {
                context,
                request_id,
                ..
            } => f
                .debug_struct("ResponseFuture::Admitted")
                .field("request_id", request_id)
                .field("committed", &context.is_none())
                .field("handed_over", &self.future.is_some())
                .finish_non_exhaustive(),
            Charge::Deferred { request_id, .. } => f
                .debug_struct("ResponseFuture::Deferred")
                .field("request_id", request_id)
                .field("handed_over", &self.future.is_some())
                .finish_non_exhaustive(),
            Charge::Denied { response } => f
                .debug_struct("ResponseFuture::Denied")
                .field("status", &response.as_ref().map(Response::status))
                .finish(),
            Charge::WaitingForLease => f.write_str("ResponseFuture::WaitingForLease"),
        }
    }
}
