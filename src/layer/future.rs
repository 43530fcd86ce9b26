//! The response future: commits the charge at its first poll.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use std::fmt::Write as _;

use http::header::HeaderName;
use http::{HeaderValue, Response};
use jiff::Timestamp;
use pin_project_lite::pin_project;

use super::body::{DenyBody, TollgateBody};
use super::config::Shared;
use super::deferred::{ChargeCell, ReleaseOnDrop};
use super::service::REQUEST_ID_HEADER;
use crate::admission::RequestContext;
use crate::{CommitError, CostUnits, DenyReason, RequestId};

pin_project! {
    /// The future a [`Tollgate`](super::Tollgate) returns.
    ///
    /// For an admitted request it commits the charge at its first poll,
    /// before polling the inner future (the default commit point); dropped
    /// before that poll, it drops the reservation, which charges zero (I4).
    /// Nothing on this path is boxed.
    ///
    /// In deferred mode
    /// ([`TollgateBuilder::commit_in_handler`](super::TollgateBuilder::commit_in_handler))
    /// it only polls the inner future; a charge no commit point took by the
    /// time it completes or is dropped is released for zero (I4).
    pub struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    #[project_replace = StateReplace]
    enum State<F> {
        Admitted {
            #[pin]
            future: F,
            // `Some` until the first poll commits it.
            context: Option<RequestContext>,
            shared: Arc<Shared>,
            request_id: RequestId,
        },
        Deferred {
            #[pin]
            future: F,
            // Dropped when the request ends: releases an uncommitted charge.
            guard: Option<ReleaseOnDrop>,
            request_id: RequestId,
        },
        Denied {
            response: Option<Response<DenyBody>>,
        },
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn admitted(future: F, context: RequestContext, shared: Arc<Shared>) -> Self {
        let request_id = context.request_id();
        Self {
            state: State::Admitted {
                future,
                context: Some(context),
                shared,
                request_id,
            },
        }
    }

    pub(super) fn deferred(future: F, cell: Arc<ChargeCell>, request_id: RequestId) -> Self {
        Self {
            state: State::Deferred {
                future,
                guard: Some(ReleaseOnDrop(cell)),
                request_id,
            },
        }
    }

    pub(super) fn denied(
        shared: &Shared,
        reason: DenyReason,
        request_id: Option<RequestId>,
    ) -> Self {
        Self {
            state: State::Denied {
                response: Some(render(shared, reason, request_id)),
            },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<TollgateBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        let refused = match state.as_mut().project() {
            StateProj::Admitted {
                context,
                shared,
                request_id,
                ..
            } => context
                .take()
                .and_then(|context| commit(context, shared, *request_id))
                .map(|reason| render(shared, reason, Some(*request_id))),
            StateProj::Deferred {
                future,
                guard,
                request_id,
            } => {
                let result = ready!(future.poll(cx));
                // I4: the request is over; a charge no commit point took is
                // released for zero.
                drop(guard.take());
                let mut response = result?;
                insert_request_id(&mut response, *request_id);
                return Poll::Ready(Ok(response.map(TollgateBody::inner)));
            }
            StateProj::Denied { response } => {
                let response = response
                    .take()
                    .expect("a tollgate response future is not polled after it completed");
                return Poll::Ready(Ok(response.map(TollgateBody::denial)));
            }
        };
        if let Some(response) = refused {
            // I2, I9: the commit was refused, so the handler must not run:
            // its future is dropped here without ever being polled.
            state.project_replace(State::Denied { response: None });
            return Poll::Ready(Ok(response.map(TollgateBody::denial)));
        }
        // Committed (now or at an earlier poll): the handler runs.
        let StateProj::Admitted {
            future, request_id, ..
        } = state.project()
        else {
            unreachable!("only an admitted state reaches the inner future");
        };
        let mut response = ready!(future.poll(cx))?;
        insert_request_id(&mut response, *request_id);
        Poll::Ready(Ok(response.map(TollgateBody::inner)))
    }
}

/// Commits `context` at the runtime's current time; returns why not, if
/// the commit was refused.
pub(super) fn commit(
    mut context: RequestContext,
    shared: &Shared,
    request_id: RequestId,
) -> Option<DenyReason> {
    let now = shared.handle.clock().now();
    // I3: this commit and the release a dropped context performs are one
    // compare-exchange apart, so the request is charged once or not at all.
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

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            State::Admitted {
                context,
                request_id,
                ..
            } => f
                .debug_struct("ResponseFuture::Admitted")
                .field("request_id", request_id)
                .field("committed", &context.is_none())
                .finish_non_exhaustive(),
            State::Deferred { request_id, .. } => f
                .debug_struct("ResponseFuture::Deferred")
                .field("request_id", request_id)
                .finish_non_exhaustive(),
            State::Denied { response } => f
                .debug_struct("ResponseFuture::Denied")
                .field("status", &response.as_ref().map(Response::status))
                .finish(),
        }
    }
}
