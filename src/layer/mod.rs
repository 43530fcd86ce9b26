//! The HTTP surface: a tower [`Layer`](tower_layer::Layer) that meters every
//! request against a prepaid balance.
//!
//! [`TollgateLayer`] wraps a service in a [`Tollgate`]. For each request the
//! service, inside `call`:
//!
//! 1. identifies the caller with a [`KeyExtractor`] (by default
//!    [`BearerOrApiKey`]) and hashes the presented key with
//!    [`KeyHash::of`](crate::KeyHash::of), exactly as the stores do; the
//!    plaintext key is never logged or written anywhere, and is held only
//!    in process memory by a per-thread memo of recent keys (I16);
//! 2. prices the request from its [`http::request::Parts`] with the pricing
//!    function given to [`TollgateBuilder::price`];
//! 3. reserves the price through
//!    [`RuntimeHandle::begin_by_key`](crate::runtime::RuntimeHandle::begin_by_key),
//!    and on success inserts an [`Admitted`] value into the request's
//!    extensions; on denial it answers with the [`DenyRenderer`]'s response
//!    (by default [`ProblemJson`], RFC 9457) without calling the inner
//!    service. A denial is a response, never a service error, so an
//!    `Infallible` router stays `Infallible`.
//!
//! A [`Tollgate`] is ready (unless its inner service failed at a hand-over,
//! below): admission happens at the outer edge, so a request without a
//! usable key or funds is refused at once. An admitted
//! request is handed to the inner service at once if it is ready;
//! otherwise (a `ConcurrencyLimitLayer` inside the layer is full) it waits
//! for it in its [`ResponseFuture`], holding its reservation, and the layer
//! keeps a fresh clone of the service for the next request. An inner
//! service that fails its readiness answers that request with its error,
//! uncharged; failed at the hand-over (not in a request's wait, on a clone
//! of its own), it also fails the layer's readiness until it is ready
//! again.
//!
//! # The default commit point
//!
//! The charge is committed at that hand-over, when the inner service's
//! future is first polled (after `call` has built it, before it runs), or
//! at the next poll for a request that waited or came over HTTP/2 (I37). That
//! is exact when nothing queues between the layer and the handler other than
//! in the inner service's readiness: a limit that waits
//! in `poll_ready`, like tower's concurrency limit composed directly inside
//! the layer, may sit inside it, but buffers, timeouts and anything else
//! that waits inside the inner future need the deferred commit point below,
//! or must sit *outside* `TollgateLayer`, where a request waiting in them
//! has not been admitted yet. Under axum every limit is of the second kind:
//! a route is always ready, and the layers a router applies run inside the
//! route's future. The default point also assumes the inner service's
//! `call` does no work of its own before its future is polled. A future dropped before the hand-over (the client left while the
//! request waited, or before it was polled) drops its reservation, which
//! releases it for zero (I4). If the commit itself fails (the lease's window
//! closed before the start, the instance is shutting down) the denial is
//! rendered and the inner future is dropped without being polled (I2, I9).
//!
//! # The deferred commit point
//!
//! When a limit, timeout or queue must sit *inside* the layer, or the
//! handler should be charged only once its input is valid, build the layer
//! with [`TollgateBuilder::commit_in_handler`]. Admission still reserves in
//! the layer; the response future no longer commits, and the request
//! carries its pending charge to a commit point further in:
//!
//! ```text
//! request ──► TollgateLayer (admit: reserve) ──► limit / timeout / queue ──► CommitMarkerLayer (commit) ──► handler
//!                                                                          or Charged<T> (commit after T)
//! ```
//!
//! - [`CommitMarkerLayer`], placed innermost, commits as the request
//!   reaches the route: a request waiting in the limit holds its
//!   reservation and is charged in full once it gets through (I3), or
//!   nothing if its client leaves first (I4). With axum, put it on the
//!   handlers with `MethodRouter::route_layer` (`get(h).route_layer(..)`):
//!   a marker added with `Router::layer` also wraps axum's 404 fallback and
//!   its 405 answers, and would charge them. Later calls are outer, so the
//!   marker goes on first, then any limit, then the tollgate layer.
//! - [`Charged<T>`](Charged) (feature `axum`) commits after the extractor
//!   `T` succeeds, so a request rejected for bad input pays nothing.
//!
//! A refused commit answers with the layer's denial and the handler does
//! not run (I2, I9). A charge that no commit point took by the time the
//! request ends is released for zero, so in deferred mode every metered
//! route needs a commit point. Use the default (the hand-over) when nothing
//! queues between the layer and the handler; use the deferred mode when
//! something must.
//!
//! # Waiting for a lease
//!
//! A request refused because its account's lease is missing, drained or
//! closed is refused for a shortage the lease manager is already curing.
//! With [`TollgateBuilder::wait_for_lease`] it waits, bounded, in its
//! response future for the manager to change the account's slot, and tries
//! admission again at each change (I36). It holds nothing meanwhile: a
//! client that leaves pays nothing.
//!
//! Time comes from the runtime's clock
//! ([`RuntimeHandle::clock`](crate::runtime::RuntimeHandle::clock)), read once
//! at admission and once at commit (wherever the commit point is).
//!
//! # Clones share one budget
//!
//! Every clone of a [`TollgateLayer`] and of the [`Tollgate`] services it
//! builds holds the same `Arc` to one shared state and one runtime handle,
//! so all of them draw down the same leases. There is no per-clone budget.
//!
//! # Response bodies
//!
//! The service's response body is [`TollgateBody<B>`]: either the inner
//! service's body `B`, untouched, or a rendered denial. Its data type is
//! `B::Data` (denials are converted from a `Vec<u8>`), so with axum's body it
//! is `Bytes`, and the layer works with `axum::Router::layer` as tower-http's
//! middleware does.
//!
//! # Headers
//!
//! Admitted responses carry `x-tollgate-request-id`, the id that keys the
//! request's usage event (I8). A denial carries one too once the caller's
//! key was identified (a 402, 403, 429 or 503 after lookup, or a refused
//! commit), so the caller has something to quote; a caller whose key is
//! missing, malformed, unknown or revoked gets none. Staleness is checked
//! before key status (I23), so a revoked key whose policy has gone stale is
//! answered `503 snapshot_stale`, with an id, like any other stale key.
//!
//! A 402 that states what the account's balance can still fund carries the
//! IETF draft `RateLimit` field, `"balance";r=<units>`, with `;t=<seconds>`
//! until the balance refills when a refill is scheduled. No other response
//! carries it: an instance knows its own lease, not the account's balance,
//! so any other figure would not be true. `RateLimit-Policy` is not sent,
//! because its quota is a refill amount the request path does not know.
//!
//! # Tracing
//!
//! Each admission is one `debug` span, `tollgate.admission`, with the
//! route (axum's route template when the request went through an axum
//! router, else the path), the key's visible prefix (`tg_` and eight
//! characters, as stores keep it; nothing of any other credential), the
//! account, the units, the request id and the outcome (`admitted` or the
//! deny code). The key itself is never recorded.
//!
//! # Example
//!
//! ```no_run
//! # fn example(handle: tollgate::runtime::RuntimeHandle) {
//! use tollgate::layer::{Price, TollgateLayer};
//! use tollgate::{CostUnits, PermissionBits};
//!
//! let layer = TollgateLayer::builder(handle)
//!     .price(|parts: &http::request::Parts| Price {
//!         units: if parts.method == http::Method::POST { CostUnits(5) } else { CostUnits(1) },
//!         required: PermissionBits::bit(0),
//!     })
//!     .build()
//!     .expect("pricing was given");
//! # let _ = layer;
//! # }
//! ```

mod body;
mod config;
mod credential;
mod deferred;
mod deny;
mod future;
mod key_memo;
mod service;

pub use body::{DenyBody, TollgateBody};
pub use config::{LayerConfigError, Price, TollgateBuilder, TollgateLayer};
pub use credential::{BearerOrApiKey, KeyExtractor, MAX_KEY_BYTES};
pub use deferred::{CommitMarker, CommitMarkerFuture, CommitMarkerLayer};
pub use deny::{DenyRenderer, ProblemJson, deny_status};
pub use future::ResponseFuture;
pub use service::{Admitted, REQUEST_ID_HEADER, Tollgate};

#[cfg(feature = "axum")]
mod extract;
#[cfg(feature = "axum")]
pub use extract::{Charged, ChargedRejection, MissingAdmission};
#[cfg(feature = "axum")]
mod ops;
#[cfg(feature = "axum")]
mod routes;
#[cfg(feature = "axum")]
pub use ops::{ops_router, publish_metrics};
#[cfg(feature = "axum")]
pub use routes::RouteTable;
