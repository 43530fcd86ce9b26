//! The layer, its builder and the state every clone shares.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::credential::{BearerOrApiKey, KeyExtractor};
use super::deny::{DenyRenderer, ProblemJson};
use super::service::Tollgate;
use crate::admission::RequestIds;
use crate::runtime::RuntimeHandle;
use crate::{CostUnits, PermissionBits, PolicyRevision};

/// What a request costs and which permissions it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Price {
    /// The units reserved at admission and charged at commit.
    pub units: CostUnits,
    /// Every permission bit the key must hold.
    pub required: PermissionBits,
}

/// The first rule a [`TollgateBuilder`] breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayerConfigError {
    /// No pricing function was given: what a request costs decides what is
    /// spent, so it has no default.
    MissingPricing,
    /// The operating system supplied no randomness for the prefix of the
    /// request ids given to denied callers.
    Randomness,
    /// The policy revision is above [`PolicyRevision::MAX`]: the stores
    /// would reject every usage event stamped with it, and every charge
    /// would go unbilled.
    PolicyRevisionTooLarge,
    /// The lease wait is above [`TollgateBuilder::MAX_LEASE_WAIT`]: a lease
    /// that has not come by then is not coming soon, and every request
    /// held that long ties up its connection for nothing.
    LeaseWaitTooLong,
}

impl fmt::Display for LayerConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingPricing => f.write_str("layer: no pricing function was given"),
            Self::Randomness => f.write_str("layer: the operating system supplied no randomness"),
            Self::PolicyRevisionTooLarge => {
                f.write_str("layer: the policy revision is above PolicyRevision::MAX (i64::MAX)")
            }
            Self::LeaseWaitTooLong => write!(
                f,
                "layer: the lease wait is above {} ms",
                TollgateBuilder::MAX_LEASE_WAIT.as_millis()
            ),
        }
    }
}

impl std::error::Error for LayerConfigError {}

type PriceFn = dyn Fn(&http::request::Parts) -> Price + Send + Sync + 'static;

/// What every clone of a layer and its services shares.
pub(super) struct Shared {
    pub(super) handle: RuntimeHandle,
    pub(super) price: Box<PriceFn>,
    pub(super) extractor: Box<dyn KeyExtractor>,
    pub(super) renderer: Box<dyn DenyRenderer>,
    pub(super) policy_revision: Option<PolicyRevision>,
    /// Whether the charge is committed by a commit point inside the inner
    /// service rather than at the hand-over to the inner service.
    pub(super) deferred: bool,
    /// Whether admitted requests carry a cancellation token.
    pub(super) track_cancellation: bool,
    /// How long a request refused for a transient lease shortage waits for
    /// the lease manager before it is answered; zero answers at once.
    pub(super) lease_wait: Duration,
    /// Ids for callers denied after identification: something to quote in
    /// a support request, keying no usage event.
    pub(super) denial_ids: RequestIds,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("handle", &self.handle)
            .field("policy_revision", &self.policy_revision)
            .field("deferred", &self.deferred)
            .field("track_cancellation", &self.track_cancellation)
            .field("lease_wait", &self.lease_wait)
            .finish_non_exhaustive()
    }
}

/// Meters every request of the services it wraps against prepaid balances.
///
/// Cheap to clone; every clone, and every [`Tollgate`] service built from
/// any clone, draws on the same runtime and the same leases. See the
/// [module docs](super) for the request path.
#[derive(Clone, Debug)]
#[must_use]
pub struct TollgateLayer {
    shared: Arc<Shared>,
}

impl TollgateLayer {
    /// Starts a builder over `handle`. Pricing must be given with
    /// [`TollgateBuilder::price`] before [`TollgateBuilder::build`].
    pub fn builder(handle: RuntimeHandle) -> TollgateBuilder {
        TollgateBuilder {
            handle,
            price: None,
            extractor: Box::new(BearerOrApiKey),
            renderer: Box::new(ProblemJson),
            policy_revision: None,
            deferred: false,
            track_cancellation: false,
            lease_wait: Duration::ZERO,
        }
    }
}

impl<S> Layer<S> for TollgateLayer {
    type Service = Tollgate<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Tollgate::new(inner, Arc::clone(&self.shared))
    }
}

/// Configures a [`TollgateLayer`]. Pricing has no default; the key
/// extractor defaults to [`BearerOrApiKey`] and the renderer to
/// [`ProblemJson`].
#[must_use]
pub struct TollgateBuilder {
    handle: RuntimeHandle,
    price: Option<Box<PriceFn>>,
    extractor: Box<dyn KeyExtractor>,
    renderer: Box<dyn DenyRenderer>,
    policy_revision: Option<PolicyRevision>,
    deferred: bool,
    track_cancellation: bool,
    lease_wait: Duration,
}

impl TollgateBuilder {
    /// The longest [`wait_for_lease`](Self::wait_for_lease) accepted.
    pub const MAX_LEASE_WAIT: Duration = Duration::from_secs(10);

    /// Prices each request from its method, URI, headers and extensions.
    /// Called once per request that presents a well-formed key, before the
    /// key is looked up: admission needs the price and the key's policy in
    /// one step. Keep it cheap and free of side effects, since callers with
    /// unknown keys are priced too (and charged nothing).
    pub fn price<F>(mut self, price: F) -> Self
    where
        F: Fn(&http::request::Parts) -> Price + Send + Sync + 'static,
    {
        self.price = Some(Box::new(price));
        self
    }

    /// Finds the key in the request headers (default: [`BearerOrApiKey`]).
    pub fn identify(mut self, extractor: impl KeyExtractor) -> Self {
        self.extractor = Box::new(extractor);
        self
    }

    /// Renders denials (default: [`ProblemJson`]).
    pub fn deny_renderer(mut self, renderer: impl DenyRenderer) -> Self {
        self.renderer = Box::new(renderer);
        self
    }

    /// Stamps every usage event with the pricing policy's revision instead
    /// of the snapshot's. At most [`PolicyRevision::MAX`] (a hash of a
    /// price table needs its top bit cleared).
    pub fn policy_revision(mut self, revision: PolicyRevision) -> Self {
        self.policy_revision = Some(revision);
        self
    }

    /// Defers the commit from the hand-over to the inner service to a commit
    /// point inside the inner service: a [`CommitMarkerLayer`] placed
    /// innermost, or a [`Charged`](super::Charged) extractor (feature
    /// `axum`).
    ///
    /// Admission still reserves in the layer, so a request waiting in a
    /// limit, timeout or queue *inside* the layer holds its reservation;
    /// it is charged in full when it reaches the commit point (I3), and
    /// released for zero if it ends before that (I4). A route with no
    /// commit point therefore runs free: put one on every route.
    ///
    /// [`CommitMarkerLayer`]: super::CommitMarkerLayer
    pub fn commit_in_handler(mut self) -> Self {
        self.deferred = true;
        self
    }

    /// Gives every admitted request a cancellation token, in
    /// [`Admitted::cancellation`](super::Admitted::cancellation), cancelled
    /// when the request ends before the server had its whole response: its
    /// client disconnected (while the handler ran, or while the body
    /// streamed), or a timeout outside the layer gave up.
    ///
    /// Off by default because the token is an allocation per admitted
    /// request, which the default commit point otherwise does without.
    /// [`commit_in_handler`](Self::commit_in_handler) allocates one shared
    /// cell per admitted request in any case.
    pub fn track_cancellation(mut self) -> Self {
        self.track_cancellation = true;
        self
    }

    /// Lets a request refused for a transient lease shortage wait up to
    /// `wait` for its account's lease manager, instead of being answered
    /// `503 lease_unavailable` or `429 lease_exhausted` at once (default:
    /// zero, no wait; at most [`MAX_LEASE_WAIT`](Self::MAX_LEASE_WAIT)).
    ///
    /// The shortages waited out are those the lease manager is already
    /// curing: no lease yet (the account's first, or a lapsed share
    /// fetched again, I28), or a lease drained or closed while its
    /// replacement is on its way (I7). The request holds nothing while it
    /// waits, no units and no usage place, so a client that leaves pays
    /// nothing and costs nothing; it tries admission again each time the
    /// lease manager changes the account's lease or evidence, and once more
    /// when `wait` is over, answering with what that last try says. It does
    /// not wait while the store is unreachable (the lease manager's last
    /// grant call went unanswered): that refusal is not going to end within
    /// a wait; and a shutdown refuses every waiting request at once.
    ///
    /// Waiting uses tokio's timer, so the layer must then run inside a
    /// tokio runtime with time enabled, as servers built on hyper do.
    /// Waits are counted in
    /// [`AdmissionStats::lease_waits`](crate::admission::AdmissionStats::lease_waits).
    pub fn wait_for_lease(mut self, wait: Duration) -> Self {
        self.lease_wait = wait;
        self
    }

    /// The layer.
    ///
    /// # Errors
    ///
    /// [`LayerConfigError::MissingPricing`] when no pricing was given;
    /// [`LayerConfigError::PolicyRevisionTooLarge`] for a policy revision
    /// no store can record; [`LayerConfigError::LeaseWaitTooLong`] for a
    /// lease wait above [`MAX_LEASE_WAIT`](Self::MAX_LEASE_WAIT);
    /// [`LayerConfigError::Randomness`] when the operating system supplied
    /// no randomness.
    pub fn build(self) -> Result<TollgateLayer, LayerConfigError> {
        let price = self.price.ok_or(LayerConfigError::MissingPricing)?;
        if self
            .policy_revision
            .is_some_and(|revision| revision > PolicyRevision::MAX)
        {
            return Err(LayerConfigError::PolicyRevisionTooLarge);
        }
        if self.lease_wait > Self::MAX_LEASE_WAIT {
            return Err(LayerConfigError::LeaseWaitTooLong);
        }
        let denial_ids = RequestIds::random().map_err(|_| LayerConfigError::Randomness)?;
        Ok(TollgateLayer {
            shared: Arc::new(Shared {
                handle: self.handle,
                price,
                extractor: self.extractor,
                renderer: self.renderer,
                policy_revision: self.policy_revision,
                deferred: self.deferred,
                track_cancellation: self.track_cancellation,
                lease_wait: self.lease_wait,
                denial_ids,
            }),
        })
    }
}

impl fmt::Debug for TollgateBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TollgateBuilder")
            .field("handle", &self.handle)
            .field("price", &self.price.as_ref().map(|_| "fn"))
            .field("policy_revision", &self.policy_revision)
            .field("deferred", &self.deferred)
            .field("track_cancellation", &self.track_cancellation)
            .field("lease_wait", &self.lease_wait)
            .finish_non_exhaustive()
    }
}
