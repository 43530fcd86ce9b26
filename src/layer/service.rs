//! The service: admission decided in `call`.

use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};

use http::header::HeaderName;
use http::{Request, Response};
use tokio_util::sync::CancellationToken;
use tower_service::Service;

use super::body::TollgateBody;
use super::config::{Price, Shared};
use super::deferred::{ChargeCell, PendingCharge};
use super::future::{CancelOnDrop, HandOver, LeaseWait, ResponseFuture};
use super::key_memo;
use crate::admission::{LeaseSlot, RequestContext};
use crate::store::ApiKey;
use crate::{AccountId, CostUnits, DenyReason, KeyHash, KeyId, RequestId};

/// The header that carries a request's id, the idempotency key of its
/// usage event (I8).
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-tollgate-request-id");

/// What admission decided about a request, inserted into its extensions
/// before the inner service sees it.
///
/// `Clone` but neither `Copy` nor `Eq`: it may carry the request's
/// cancellation token.
#[derive(Debug, Clone)]
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
    /// Whether cancellation was requested: cancelled once nobody waits for
    /// the response any more (its client disconnected, or a timeout outside
    /// the layer gave up) before the response was complete, that is before
    /// the server had its whole body (a body still streaming counts as
    /// incomplete; bytes the server has but not yet written do not).
    /// `None` unless the layer was built with
    /// [`track_cancellation`](super::TollgateBuilder::track_cancellation).
    ///
    /// The handler's own future is dropped at that moment, so this is for
    /// work it handed to other tasks, such as one feeding a streamed body:
    /// they can watch the token and stop work nobody will read. The charge
    /// is not affected: a request whose handler started pays in full (I3).
    pub cancellation: Option<CancellationToken>,
}

/// Meters the requests of `S`; built by
/// [`TollgateLayer`](super::TollgateLayer).
///
/// Ready unless its inner service failed; `call` decides admission (see
/// [`poll_ready`](Self::poll_ready)). Clones share the layer's state and
/// so its leases.
#[derive(Clone, Debug)]
pub struct Tollgate<S> {
    inner: S,
    shared: Arc<Shared>,
    /// Whether the inner service failed its readiness at the last
    /// hand-over: until it is ready again, readiness is its to answer.
    failed: bool,
}

impl<S> Tollgate<S> {
    pub(super) fn new(inner: S, shared: Arc<Shared>) -> Self {
        Self {
            inner,
            shared,
            failed: false,
        }
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
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: http_body::Body,
{
    type Response = Response<TollgateBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, Request<ReqBody>, S::Future, S::Error>;

    /// Ready: admission happens in `call`, at the outer edge, so a request
    /// without funds is refused at once instead of waiting for a limit
    /// inside the layer. An admitted request that finds the inner service
    /// not ready waits for it in its [`ResponseFuture`], holding its
    /// reservation.
    ///
    /// Once the inner service has failed its readiness (that request got
    /// the error), this answers the inner service's readiness until it is
    /// ready again: tower's contract is that the caller drops a failed
    /// service, so the failure is the caller's to see, not the next
    /// admitted request's to wait on. The layer cannot hand that error on
    /// a second time (it has only the inner service's error type, and the
    /// request took the error), so it asks the inner service again: tower's
    /// own services keep answering with an error once failed (a buffer
    /// whose worker is gone), and that error is returned.
    /// An inner service that could not be polled after failing would leave
    /// this pending.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if self.failed {
            ready!(self.inner.poll_ready(cx))?;
            self.failed = false;
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (parts, body) = request.into_parts();
        let shared = &self.shared;
        // One span per admission, built only when a subscriber wants it: a
        // disabled span still costs a call per field recorded (more with
        // tracing's `log` feature), so its fields are recorded only into a
        // live one. The events below go out either way.
        let span = if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug_span!(
                "tollgate.admission",
                route = route_of(&parts),
                key_prefix = tracing::field::Empty,
                account = tracing::field::Empty,
                units = tracing::field::Empty,
                request_id = tracing::field::Empty,
                outcome = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        let traced = !span.is_none();
        let _entered = span.enter();
        let key = match shared.extractor.extract(&parts.headers) {
            Ok(key) => {
                // Only the visible prefix a store keeps anyway, never the
                // secret part (I16).
                if traced && let Some(prefix) = visible_prefix(key) {
                    span.record("key_prefix", prefix);
                }
                // Hashed at once: the plaintext is borrowed from the headers
                // and never leaves this statement but for the memo (see
                // `key_memo`).
                key_memo::key_hash(key)
            }
            Err(reason) => {
                if traced {
                    span.record("outcome", reason.code());
                }
                tracing::debug!("tollgate admission denied");
                // Counted with the engine's denials, so every refusal shows
                // under its code in the metrics.
                shared.handle.engine().counters().denied(reason);
                let close = leaves_body_unread(parts.version, &parts.headers);
                return ResponseFuture::denied(shared, reason, None, close);
            }
        };
        let price = (shared.price)(&parts);
        if traced {
            span.record("units", price.units.get());
        }
        let now = shared.handle.clock().now();
        let waits = !shared.lease_wait.is_zero();
        let admission = if waits {
            // The last answer is counted, after any wait.
            shared
                .handle
                .begin_by_key_uncounted(&key, price.required, price.units, now)
        } else {
            shared
                .handle
                .begin_by_key(&key, price.required, price.units, now)
        };
        match admission {
            Ok(context) => admit(
                shared,
                &mut self.inner,
                &mut self.failed,
                Request::from_parts(parts, body),
                context,
                &span,
            ),
            Err(reason) if waits && waits_out(reason) && lease_coming(shared, &key).is_some() => {
                shared.handle.engine().counters().lease_wait();
                tracing::debug!(
                    outcome = reason.code(),
                    "tollgate admission waits for a lease"
                );
                let wait = lease_wait(Arc::clone(shared), key, price, span.clone());
                // A clone of its own, as a request waiting for the inner
                // service's readiness has: `self.inner` serves the next
                // request meanwhile.
                ResponseFuture::waiting_for_lease(
                    wait,
                    self.inner.clone(),
                    Request::from_parts(parts, body),
                )
            }
            Err(reason) => {
                if waits {
                    shared.handle.engine().counters().denied(reason);
                }
                deny(
                    shared,
                    reason,
                    &span,
                    leaves_body_unread(parts.version, &parts.headers),
                )
            }
        }
    }
}

/// Hands an admitted request on: records what admission decided in its
/// extensions and hands it to `inner` (see [`hand_over`]), or, committing
/// in the handler, gives it its pending charge. In `call`, and for a
/// request admitted after waiting for a lease, on the clone it waited with.
pub(super) fn admit<S, ReqBody, ResBody>(
    shared: &Arc<Shared>,
    inner: &mut S,
    failed: &mut bool,
    request: Request<ReqBody>,
    mut context: RequestContext,
    span: &tracing::Span,
) -> ResponseFuture<S, Request<ReqBody>, S::Future, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: http_body::Body,
{
    let (mut parts, body) = request.into_parts();
    let close_connection = leaves_body_unread(parts.version, &parts.headers);
    if let Some(revision) = shared.policy_revision {
        context.set_policy_revision(revision);
    }
    // Opt-in: the token allocates, beside the `Admitted` extension and the
    // request-id header every admitted request costs (see the README).
    let cancellation = shared.track_cancellation.then(CancellationToken::new);
    let cancel_on_drop = cancellation
        .clone()
        .map(|token| CancelOnDrop::new(token, &parts.method));
    let admitted = Admitted {
        units: context.units(),
        account_id: context.account_id(),
        key_id: context.key_id(),
        request_id: context.request_id(),
        cancellation,
    };
    if !span.is_none() {
        span.record("account", admitted.account_id.get());
        span.record("request_id", tracing::field::display(admitted.request_id));
        span.record("outcome", "admitted");
    }
    tracing::debug!("tollgate admission admitted");
    parts.extensions.insert(admitted);
    if shared.deferred {
        let request_id = context.request_id();
        let cell = Arc::new(ChargeCell::new(
            context,
            Arc::clone(shared),
            close_connection,
        ));
        parts.extensions.insert(PendingCharge(Arc::clone(&cell)));
        let version = parts.version;
        return ResponseFuture::deferred(cell, request_id, cancel_on_drop, version, || {
            hand_over(inner, failed, Request::from_parts(parts, body))
        });
    }
    ResponseFuture::admitted(
        context,
        Arc::clone(shared),
        cancel_on_drop,
        parts.version,
        close_connection,
        || hand_over(inner, failed, Request::from_parts(parts, body)),
    )
}

/// Answers a request refused at admission (after any wait);
/// `close_connection` as [`leaves_body_unread`] says.
pub(super) fn deny<S, R, F, E>(
    shared: &Shared,
    reason: DenyReason,
    span: &tracing::Span,
    close_connection: bool,
) -> ResponseFuture<S, R, F, E> {
    // A caller the runtime identified gets a request id to quote (it keys
    // no usage event: nothing was charged); one that presented no usable
    // key gets none.
    let request_id = identified(reason).then(|| shared.denial_ids.next());
    if !span.is_none() {
        if let Some(request_id) = request_id {
            span.record("request_id", tracing::field::display(request_id));
        }
        span.record("outcome", reason.code());
    }
    tracing::debug!("tollgate admission denied");
    ResponseFuture::denied(shared, reason, request_id, close_connection)
}

/// Whether a refused HTTP/1 request sent or announced a body that nobody
/// will read: its denial then says `Connection: close`. After answering,
/// hyper drains an unread body only as far as it has already arrived, and
/// otherwise drops the connection without saying so; said in the response,
/// a keep-alive client opens a new connection for its next request instead
/// of writing it into a closed one. That costs a reconnection after every
/// such denial, even where hyper could have drained the body, which is
/// cheaper than a client's request failing on a closed connection. (HTTP/2
/// has streams, not connections, to close, and forbids the header.)
pub(super) fn leaves_body_unread(version: http::Version, headers: &http::HeaderMap) -> bool {
    matches!(version, http::Version::HTTP_10 | http::Version::HTTP_11)
        && (headers.contains_key(http::header::TRANSFER_ENCODING)
            || headers
                .get(http::header::CONTENT_LENGTH)
                .is_some_and(|length| {
                    length
                        .to_str()
                        .ok()
                        .and_then(|length| length.trim().parse::<u64>().ok())
                        != Some(0)
                }))
}

/// Whether `reason` is a shortage the account's lease manager is already
/// curing, so a request may wait for it (I36; see
/// [`TollgateBuilder::wait_for_lease`](super::TollgateBuilder::wait_for_lease)).
fn waits_out(reason: DenyReason) -> bool {
    matches!(
        reason,
        DenyReason::LeaseUnavailable | DenyReason::LeaseExhausted | DenyReason::LeaseExpired
    )
}

/// The slot of the account the key pays from, unless its store left the
/// lease manager's last grant call unanswered: then no lease is coming
/// within a wait, and a request is answered at once (I36).
fn lease_coming(shared: &Shared, key: &KeyHash) -> Option<Arc<LeaseSlot>> {
    let handle = &shared.handle;
    handle
        .engine()
        .slot_by_key(key, handle.clock().now())
        .filter(|slot| !slot.allocator_unreachable())
}

/// Waits up to the layer's lease wait for admission to stop refusing for a
/// lease shortage, trying it again at each change the account's lease
/// manager makes to its slot; yields what the wait ended with, and what
/// the response future needs to go on. Every way out is a fresh try's
/// answer: at the deadline, once the store stops answering, or once the key
/// no longer leads to a slot, admission is tried once more, so the request
/// gets what one arriving then would (I36). Nothing is reserved until a try
/// admits, so dropping the wait holds and charges nothing.
fn lease_wait(shared: Arc<Shared>, key: KeyHash, price: Price, span: tracing::Span) -> LeaseWait {
    Box::pin(async move {
        let deadline = tokio::time::Instant::now() + shared.lease_wait;
        let handle = &shared.handle;
        let admit_once = || {
            handle.begin_by_key_uncounted(&key, price.required, price.units, handle.clock().now())
        };
        let outcome = loop {
            let Some(slot) = handle.engine().slot_by_key(&key, handle.clock().now()) else {
                break admit_once();
            };
            // Enabled before the slot is read and admission tried, so a
            // change made in between wakes this wait rather than being
            // missed.
            let mut changed = std::pin::pin!(Arc::clone(slot.changes()).notified_owned());
            changed.as_mut().enable();
            match admit_once() {
                // The store did not answer the lease manager's last grant
                // call: no lease is coming within a wait.
                Err(reason) if waits_out(reason) && !slot.allocator_unreachable() => {}
                settled => break settled,
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                break admit_once();
            }
        };
        (shared, span, outcome)
    })
}

/// Hands an admitted request to `inner` if it is ready now, as it is
/// unless something inside the layer makes requests wait. Otherwise the
/// request waits for it in its response future, on the service as it
/// stands (with whatever wait `poll_ready` has begun), and `inner` becomes
/// a fresh clone for the next request. A service that fails is not polled
/// again for this request: its error is the request's answer, and `failed`
/// is set, so the caller sees the failure in the layer's readiness.
fn hand_over<S, R>(
    inner: &mut S,
    failed: &mut bool,
    request: R,
) -> HandOver<S, R, S::Future, S::Error>
where
    S: Service<R> + Clone,
{
    let mut cx = Context::from_waker(Waker::noop());
    match inner.poll_ready(&mut cx) {
        Poll::Ready(Ok(())) => HandOver::Done(inner.call(request)),
        Poll::Ready(Err(error)) => {
            *failed = true;
            HandOver::Failed(error)
        }
        Poll::Pending => {
            let fresh = inner.clone();
            HandOver::Waiting(std::mem::replace(inner, fresh), request)
        }
    }
}

/// Whether a denial at admission came after the key was identified: every
/// reason but those of a key that is absent, malformed, unknown, revoked or
/// not yet loaded, and a shutdown, which refuses before the key is looked
/// up.
fn identified(reason: DenyReason) -> bool {
    !matches!(
        reason,
        DenyReason::MissingCredential
            | DenyReason::MalformedCredential
            | DenyReason::UnknownPrincipal
            | DenyReason::KeyRevoked
            | DenyReason::SnapshotUnavailable
            | DenyReason::ShuttingDown
    )
}

/// The part of a presented key that is safe to log: the visible prefix a
/// store keeps for tollgate's own keys ([`crate::store::KeyPrefix`]), and
/// nothing of any other credential.
fn visible_prefix(key: &[u8]) -> Option<&str> {
    let prefix = key.get(..KEY_PREFIX_BYTES)?;
    if !prefix.starts_with(ApiKey::PREFIX.as_bytes()) {
        return None;
    }
    std::str::from_utf8(prefix).ok()
}

/// `tg_` and eight characters, as [`ApiKey::prefix`] keeps them.
const KEY_PREFIX_BYTES: usize = ApiKey::PREFIX.len() + 8;

/// The route the request matched: axum's route template when the request
/// went through an axum router (bounded, unlike the raw path), else the
/// path.
fn route_of(parts: &http::request::Parts) -> &str {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return matched.as_str();
    }
    parts.uri.path()
}
