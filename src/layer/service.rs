//! The service: admission decided in `call`.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::header::HeaderName;
use http::{Request, Response};
use tower_service::Service;

use super::body::TollgateBody;
use super::config::Shared;
use super::deferred::{ChargeCell, PendingCharge};
use super::future::ResponseFuture;
use crate::{AccountId, CostUnits, KeyHash, KeyId, RequestId};

/// The header that carries a request's id, the idempotency key of its
/// usage event (I8).
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-tollgate-request-id");

/// What admission decided about a request, inserted into its extensions
/// before the inner service sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Admitted {
    /// The units reserved, charged when the handler starts.
    pub units: CostUnits,
    /// The account that pays.
    pub account_id: AccountId,
    /// The key the request presented, if the principal is a key.
    pub key_id: Option<KeyId>,
    /// The request's id, also sent as `x-tollgate-request-id`.
    pub request_id: RequestId,
}

/// Meters the requests of `S`; built by
/// [`TollgateLayer`](super::TollgateLayer).
///
/// `poll_ready` forwards to the inner service; `call` decides admission.
/// Clones share the layer's state and so its leases.
#[derive(Clone, Debug)]
pub struct Tollgate<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> Tollgate<S> {
    pub(super) fn new(inner: S, shared: Arc<Shared>) -> Self {
        Self { inner, shared }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Tollgate<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<TollgateBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        let shared = &self.shared;
        let key = match shared.extractor.extract(&parts.headers) {
            // Hashed at once: the plaintext is borrowed from the headers and
            // never leaves this statement.
            Ok(key) => KeyHash::of(key),
            Err(reason) => {
                log_denial(&parts, reason);
                // Counted with the engine's denials, so every refusal shows
                // under its code in the metrics.
                shared.handle.engine().counters().denied(reason);
                return ResponseFuture::denied(shared, reason, None);
            }
        };
        let price = (shared.price)(&parts);
        let now = shared.handle.clock().now();
        match shared
            .handle
            .begin_by_key(&key, price.required, price.units, now)
        {
            Ok(mut context) => {
                if let Some(revision) = shared.policy_revision {
                    context.set_policy_revision(revision);
                }
                let admitted = Admitted {
                    units: context.units(),
                    account_id: context.account_id(),
                    key_id: context.key_id(),
                    request_id: context.request_id(),
                };
                tracing::debug!(
                    path = parts.uri.path(),
                    account = %admitted.account_id,
                    key_id = admitted.key_id.map(KeyId::get),
                    units = admitted.units.get(),
                    request_id = %admitted.request_id,
                    outcome = "admitted",
                    "tollgate admission",
                );
                parts.extensions.insert(admitted);
                if shared.deferred {
                    let request_id = context.request_id();
                    let cell = Arc::new(ChargeCell::new(context, Arc::clone(shared)));
                    parts.extensions.insert(PendingCharge(Arc::clone(&cell)));
                    let future = self.inner.call(Request::from_parts(parts, body));
                    return ResponseFuture::deferred(future, cell, request_id);
                }
                let future = self.inner.call(Request::from_parts(parts, body));
                ResponseFuture::admitted(future, context, Arc::clone(shared))
            }
            Err(reason) => {
                tracing::debug!(
                    path = parts.uri.path(),
                    units = price.units.get(),
                    outcome = reason.code(),
                    "tollgate admission",
                );
                ResponseFuture::denied(shared, reason, None)
            }
        }
    }
}

/// A denial before the key is known: no account, no key id, and never the
/// credential itself.
fn log_denial(parts: &http::request::Parts, reason: crate::DenyReason) {
    tracing::debug!(
        path = parts.uri.path(),
        outcome = reason.code(),
        "tollgate admission",
    );
}
