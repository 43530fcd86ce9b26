//! The layer's lease wait (`TollgateBuilder::wait_for_lease`): a request
//! refused for a lease shortage the account's lease manager is curing waits
//! for the cure, bounded, holding nothing, instead of being answered 503 or
//! 429 at once (I36). Over a real instance runtime on the memory store,
//! under tokio's paused clock.

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use http::header::AUTHORIZATION;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use jiff::{SignedDuration, Timestamp};
use tokio::time::Instant;
use tollgate::layer::{
    Admitted, CommitMarkerLayer, LayerConfigError, Price, TollgateBuilder, TollgateLayer,
};
use tollgate::runtime::{InstanceRuntime, RuntimeHandle};
use tollgate::store::{
    AccountSpec, AllocateError, Allocation, Clock, GrantPolicy, LeaseAllocator, ManualClock,
    MemoryStore, ReclaimBatch, Released, StoreError, TailSharing,
};
use tollgate::{
    AccountId, AccountStatus, CostUnits, DenyReason, EnforcementMode, FencingToken, LeaseId,
    PermissionBits,
};
use tower::{Layer, ServiceExt, service_fn};

use support::runtime::{LEASE_TTL, Pace, config, ms};
use support::yields::counting_yields;

const READ: PermissionBits = PermissionBits::bit(0);

/// The memory store's allocator, with every grant call taking a delay
/// first: a store a round trip away, or one that stopped answering.
struct Distant {
    store: Arc<MemoryStore>,
    delay_ms: AtomicU64,
    acquires: AtomicU32,
}

impl Distant {
    fn delay(&self) -> Duration {
        ms(self.delay_ms.load(Ordering::SeqCst))
    }
}

#[async_trait]
impl LeaseAllocator for Distant {
    async fn acquire_at_least(
        &self,
        account: AccountId,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        self.acquires.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.delay()).await;
        self.store
            .acquire_at_least(account, requested, needed, ttl, now)
            .await
    }

    async fn release(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        now: Timestamp,
    ) -> Result<Released, AllocateError> {
        self.store
            .release(lease_id, fencing_token, unspent, now)
            .await
    }

    async fn consolidate(
        &self,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        unspent: CostUnits,
        requested: CostUnits,
        needed: CostUnits,
        ttl: SignedDuration,
        now: Timestamp,
    ) -> Result<Allocation, AllocateError> {
        tokio::time::sleep(self.delay()).await;
        self.store
            .consolidate(
                lease_id,
                fencing_token,
                unspent,
                requested,
                needed,
                ttl,
                now,
            )
            .await
    }

    async fn reclaim_expired_batch(
        &self,
        now: Timestamp,
        limit: usize,
    ) -> Result<ReclaimBatch, StoreError> {
        self.store.reclaim_expired_batch(now, limit).await
    }

    fn shares_tails(&self) -> bool {
        self.store.shares_tails()
    }
}

struct World {
    clock: Arc<ManualClock>,
    store: Arc<MemoryStore>,
    allocator: Arc<Distant>,
    account: AccountId,
    key: String,
    runtime: Option<InstanceRuntime>,
    handle: RuntimeHandle,
}

/// One account of `balance` units with a `READ` key, on a store that
/// shares a short balance's tail between two instances, and a runtime
/// whose acquires take `delay`, given time to load and lease.
async fn world(balance: u64, delay: Duration) -> World {
    let start = Timestamp::from_second(1_700_000_000).unwrap();
    let clock = Arc::new(ManualClock::new(start));
    let store = Arc::new(
        MemoryStore::new(GrantPolicy {
            max_ttl: LEASE_TTL,
            reclaim_grace: SignedDuration::from_secs(10),
            tail: TailSharing {
                instances: 2,
                min_grant: CostUnits(5),
            },
        })
        .unwrap(),
    );
    let account = store
        .create_account(
            AccountSpec {
                balance: CostUnits(balance),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            start,
        )
        .unwrap();
    let key = store
        .issue_key(account, READ, start)
        .unwrap()
        .key
        .expose()
        .to_owned();
    let allocator = Arc::new(Distant {
        store: Arc::clone(&store),
        delay_ms: AtomicU64::new(u64::try_from(delay.as_millis()).unwrap()),
        acquires: AtomicU32::new(0),
    });
    let (runtime, handle) = InstanceRuntime::spawn(
        Arc::clone(&store) as _,
        Arc::clone(&allocator) as _,
        Arc::clone(&store) as _,
        Arc::clone(&clock) as Arc<dyn Clock>,
        config(Pace::Paused),
    )
    .unwrap();
    tokio::time::sleep(ms(500)).await;
    World {
        clock,
        store,
        allocator,
        account,
        key,
        runtime: Some(runtime),
        handle,
    }
}

impl World {
    /// A layer pricing every request at `price`, waiting up to `wait`.
    fn layer(&self, price: u64, wait: Duration) -> TollgateLayer {
        TollgateLayer::builder(self.handle.clone())
            .price(move |_: &http::request::Parts| Price {
                units: CostUnits(price),
                required: READ,
            })
            .wait_for_lease(wait)
            .build()
            .unwrap()
    }

    /// Sends one request through `layer` to a handler that answers with
    /// the units it was admitted for; returns the status, the denial's
    /// code or the handler's answer, and how long the answer took.
    async fn send(&self, layer: &TollgateLayer) -> (StatusCode, String, Duration) {
        let (status, answer, took, _) = self.send_counting_yields(layer).await;
        (status, answer, took)
    }

    /// [`send`](Self::send), also counting the yields the request took
    /// (I37).
    async fn send_counting_yields(
        &self,
        layer: &TollgateLayer,
    ) -> (StatusCode, String, Duration, usize) {
        let service = layer.layer(service_fn(|request: Request<String>| async move {
            let admitted = request
                .extensions()
                .get::<Admitted>()
                .expect("an admitted request carries its admission");
            Ok::<_, Infallible>(Response::new(format!("units {}", admitted.units.get())))
        }));
        let request = Request::builder()
            .uri("/")
            .header(AUTHORIZATION, format!("Bearer {}", self.key))
            .body(String::new())
            .unwrap();
        let started = Instant::now();
        let yields = Arc::new(AtomicUsize::new(0));
        let response = counting_yields(service.oneshot(request), Arc::clone(&yields))
            .await
            .unwrap();
        let took = started.elapsed();
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8(body.to_vec()).unwrap();
        let answer = if status.is_success() {
            body
        } else {
            let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
            problem["code"].as_str().unwrap().to_owned()
        };
        (status, answer, took, yields.load(Ordering::SeqCst))
    }

    /// Advances both clocks by `steps` tenths of a second.
    async fn run_for(&self, steps: u32) {
        for _ in 0..steps {
            self.clock.advance(SignedDuration::from_millis(100));
            tokio::time::sleep(ms(100)).await;
        }
    }

    /// Lets the account's share lapse unused (I28): released at its
    /// window's end and not replaced, the slot left idle.
    async fn lapse(&self) {
        self.run_for(700).await;
        let view = self.store.account(self.account, self.clock.now()).unwrap();
        assert_eq!(view.leased, CostUnits::ZERO, "the unused share lapsed");
    }

    fn denied(&self, reason: DenyReason) -> u64 {
        self.handle.counters().denied_for(reason)
    }

    /// Shuts down and returns the units of every usage event.
    async fn shutdown_and_billed(&mut self) -> Vec<u64> {
        let report = self.runtime.take().unwrap().shutdown().await;
        assert_eq!(report.lost_events(), 0);
        assert!(self.store.audit().unwrap().is_empty());
        self.store
            .usage(self.account)
            .unwrap()
            .iter()
            .map(|event| event.units.get())
            .collect()
    }
}

/// I36, I28: a short balance's share lapses unused, and the next request
/// finds no lease. Without a wait it is answered `503 lease_unavailable`
/// (and asks for the lease); with one, it waits for the lease its asking
/// fetches, is served and pays once. Its wait is counted; its refusals
/// while waiting are not.
#[tokio::test(start_paused = true)]
async fn a_request_that_finds_its_share_lapsed_waits_for_it_and_is_served() {
    let mut w = world(20, ms(30)).await;
    w.lapse().await;
    let (status, code, took, yields) = w.send_counting_yields(&w.layer(3, Duration::ZERO)).await;
    assert_eq!(
        yields, 0,
        "a denial at admission has no commit to yield before"
    );
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "lease_unavailable")
    );
    assert_eq!(took, Duration::ZERO, "answered at once");
    assert_eq!(w.denied(DenyReason::LeaseUnavailable), 1);

    // The lease that request asked for goes unused too, and lapses.
    w.lapse().await;
    let acquires = w.allocator.acquires.load(Ordering::SeqCst);
    let (status, answer, took, yields) = w.send_counting_yields(&w.layer(3, ms(1_000))).await;
    assert_eq!((status, answer.as_str()), (StatusCode::OK, "units 3"));
    assert_eq!(
        yields, 1,
        "I37: having waited, it yields once before its commit"
    );
    assert!(
        took >= ms(30) && took < ms(40),
        "served once the acquire answered: {took:?}"
    );
    assert_eq!(w.allocator.acquires.load(Ordering::SeqCst), acquires + 1);
    let counters = w.handle.counters();
    assert_eq!(counters.lease_waits, 1);
    assert_eq!(counters.admitted, 1);
    assert_eq!(
        w.denied(DenyReason::LeaseUnavailable),
        1,
        "the waiting request's refusals are not counted"
    );
    assert_eq!(w.shutdown_and_billed().await, [3]);
}

/// I36: the wait is bounded. A lease that comes after it is over leaves the
/// request answered with the refusal it waited on, counted once, and
/// charged nothing; the lease serves the next request at once.
#[tokio::test(start_paused = true)]
async fn a_wait_that_ends_before_the_lease_comes_answers_with_its_refusal() {
    let mut w = world(20, ms(150)).await;
    w.lapse().await;
    let layer = w.layer(3, ms(50));
    let (status, code, took) = w.send(&layer).await;
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "lease_unavailable")
    );
    assert!(took >= ms(50) && took < ms(60), "{took:?}");
    let counters = w.handle.counters();
    assert_eq!(
        (counters.lease_waits, counters.admitted),
        (1, 0),
        "waited, not admitted"
    );
    assert_eq!(w.denied(DenyReason::LeaseUnavailable), 1);

    tokio::time::sleep(ms(150)).await;
    let (status, answer, took) = w.send(&layer).await;
    assert_eq!((status, answer.as_str()), (StatusCode::OK, "units 3"));
    assert_eq!(took, Duration::ZERO, "the lease was there: no wait");
    assert_eq!(w.handle.counters().lease_waits, 1);
    assert_eq!(w.shutdown_and_billed().await, [3]);
}

/// I36: no wait outlasts the store's silence. An acquire the store does not
/// answer is cut off at the store call timeout (200 ms here); the waiting
/// request is answered then, not at the end of its 5 s wait, and while the
/// store is known unreachable a request does not wait at all.
#[tokio::test(start_paused = true)]
async fn requests_do_not_wait_on_a_store_that_does_not_answer() {
    let mut w = world(20, ms(10)).await;
    w.lapse().await;
    w.allocator.delay_ms.store(60_000, Ordering::SeqCst);
    let layer = w.layer(3, ms(5_000));
    let (status, code, took) = w.send(&layer).await;
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "lease_unavailable")
    );
    assert!(
        took >= ms(200) && took < ms(210),
        "answered as the acquire was cut off: {took:?}"
    );
    assert_eq!(w.handle.counters().lease_waits, 1);
    let (status, code, took) = w.send(&layer).await;
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "lease_unavailable")
    );
    assert_eq!(took, Duration::ZERO, "no wait on a silent store");
    assert_eq!(w.handle.counters().lease_waits, 1);
    assert_eq!(w.denied(DenyReason::LeaseUnavailable), 2);
    assert_eq!(w.shutdown_and_billed().await, Vec::<u64>::new());
}

/// I36, I25: a request waiting for a lease when shutdown begins is refused
/// at once, not at the end of its wait, and charged nothing.
#[tokio::test(start_paused = true)]
async fn a_request_waiting_when_shutdown_begins_is_refused_at_once() {
    let mut w = world(20, ms(150)).await;
    w.lapse().await;
    let layer = w.layer(3, ms(1_000));
    let handle = w.handle.clone();
    tokio::spawn(async move {
        tokio::time::sleep(ms(10)).await;
        handle.request_shutdown();
    });
    let (status, code, took) = w.send(&layer).await;
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "shutting_down")
    );
    assert_eq!(took, ms(10), "answered as the shutdown began");
    assert_eq!(w.denied(DenyReason::ShuttingDown), 1);
    assert_eq!(w.handle.counters().lease_waits, 1);
    assert_eq!(
        w.denied(DenyReason::LeaseUnavailable),
        0,
        "the refusal it waited on is not counted"
    );
    assert_eq!(w.shutdown_and_billed().await, Vec::<u64>::new());
}

/// I36, I4: a client that leaves while its request waits holds nothing and
/// pays nothing: the handler never runs, and the lease that comes serves
/// others whole.
#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_while_waiting_pays_nothing() {
    let mut w = world(20, ms(30)).await;
    w.lapse().await;
    let layer = w.layer(3, ms(1_000));
    let service = layer.layer(service_fn(|_: Request<String>| async {
        panic!("the handler of a request whose client left must not run");
        #[allow(unreachable_code)]
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    let request = Request::builder()
        .uri("/")
        .header(AUTHORIZATION, format!("Bearer {}", w.key))
        .body(String::new())
        .unwrap();
    let left = tokio::time::timeout(ms(10), service.oneshot(request)).await;
    assert!(left.is_err(), "still waiting when the client left");
    tokio::time::sleep(ms(100)).await;
    let view = w.store.account(w.account, w.clock.now()).unwrap();
    let held = view.leased;
    assert!(held > CostUnits::ZERO, "the asked-for lease came");
    let report = &w.handle.account_reports()[0];
    assert_eq!(
        report.remaining,
        Some(held),
        "and nothing is reserved on it"
    );
    assert_eq!(w.handle.counters().admitted, 0);
    assert_eq!(w.shutdown_and_billed().await, Vec::<u64>::new());
}

/// I36, I27: a lease left with less than a price above the low-water mark
/// refuses it (`429 lease_exhausted`) while the lease manager folds it into
/// one that funds it; a request allowed to wait is served by the fold.
#[tokio::test(start_paused = true)]
async fn a_request_refused_by_a_drained_lease_waits_for_its_fold() {
    let price = config(Pace::Paused).leases.target_grant.get() - 50;
    let mut w = world(100_000, ms(20)).await;
    let hasty = w.layer(price, Duration::ZERO);
    let patient = w.layer(price, ms(1_000));
    let (status, _, _) = w.send(&hasty).await;
    assert_eq!(status, StatusCode::OK);
    let (status, code, _) = w.send(&hasty).await;
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::TOO_MANY_REQUESTS, "lease_exhausted")
    );
    // Back to back, the patient requests keep outrunning the replacements
    // (each takes 20 ms to come): every one that finds its lease short
    // waits for the next, and none is refused.
    tokio::time::sleep(ms(100)).await;
    let mut waits = 0;
    for _ in 0..10 {
        let (status, _, took) = w.send(&patient).await;
        assert_eq!(status, StatusCode::OK, "every patient request is served");
        if took > Duration::ZERO {
            assert!(took <= ms(40), "waited one or two round trips: {took:?}");
            waits += 1;
        }
    }
    assert!(waits > 0, "some request met a short lease");
    let counters = w.handle.counters();
    assert_eq!(counters.lease_waits, waits, "each wait is counted once");
    assert_eq!(counters.denied_for(DenyReason::LeaseExhausted), 1);
    assert_eq!(counters.admitted, 11);
    assert_eq!(w.shutdown_and_billed().await, vec![price; 11]);
}

/// I36: a request waiting on a drained lease whose replacement the store
/// does not answer is answered once the call is cut off (at the store call
/// timeout, 200 ms), with what a request arriving then is answered, not
/// with the refusal it waited on. While it waits it holds nothing: the
/// lease keeps its units and the usage queue its places.
#[tokio::test(start_paused = true)]
async fn a_wait_ends_with_a_fresh_answer_when_the_store_stops_answering() {
    let price = config(Pace::Paused).leases.target_grant.get() - 50;
    let mut w = world(100_000, ms(20)).await;
    w.allocator.delay_ms.store(60_000, Ordering::SeqCst);
    // Drains the lease below the mark: its replacement is asked for now,
    // and cut off 200 ms on.
    let asked_at = Instant::now();
    let (status, _, _) = w.send(&w.layer(price, Duration::ZERO)).await;
    assert_eq!(status, StatusCode::OK);
    // Its event written, every usage place is free.
    tokio::time::sleep(ms(100)).await;
    let places = w.handle.recorder().capacity();
    assert_eq!(w.handle.recorder().available(), places);
    let left = w.handle.account_reports()[0].remaining;
    let waiting = {
        let service = w
            .layer(price, ms(5_000))
            .layer(service_fn(|_: Request<String>| async {
                Ok::<_, Infallible>(Response::new(String::new()))
            }));
        let request = Request::builder()
            .uri("/")
            .header(AUTHORIZATION, format!("Bearer {}", w.key))
            .body(String::new())
            .unwrap();
        tokio::spawn(service.oneshot(request))
    };
    tokio::time::sleep(ms(5)).await;
    assert_eq!(w.handle.counters().lease_waits, 1, "it waits");
    assert_eq!(w.handle.recorder().available(), places, "no place held");
    assert_eq!(
        w.handle.account_reports()[0].remaining,
        left,
        "no units held"
    );
    let response = waiting.await.unwrap().unwrap();
    let answered_after = asked_at.elapsed();
    assert!(
        answered_after >= ms(200) && answered_after < ms(210),
        "answered as the call was cut off: {answered_after:?}"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let (status, code, _) = w.send(&w.layer(price, Duration::ZERO)).await;
    assert_eq!(
        (status, code.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "lease_unavailable"),
        "a request arriving then"
    );
    assert_eq!(problem["code"], "lease_unavailable", "the waiter's answer");
    assert_eq!(w.shutdown_and_billed().await, [price]);
}

/// I36, I3: committing in the handler, a request admitted after its wait
/// carries its pending charge to the commit point and pays once there.
#[tokio::test(start_paused = true)]
async fn a_request_admitted_after_a_wait_commits_in_its_handler() {
    let mut w = world(20, ms(30)).await;
    w.lapse().await;
    let layer = TollgateLayer::builder(w.handle.clone())
        .price(|_: &http::request::Parts| Price {
            units: CostUnits(3),
            required: READ,
        })
        .commit_in_handler()
        .wait_for_lease(ms(1_000))
        .build()
        .unwrap();
    let service = layer.layer(CommitMarkerLayer::new().layer(service_fn(
        |request: Request<String>| async move {
            let units = request.extensions().get::<Admitted>().unwrap().units;
            Ok::<_, Infallible>(Response::new(format!("units {}", units.get())))
        },
    )));
    let request = Request::builder()
        .uri("/")
        .header(AUTHORIZATION, format!("Bearer {}", w.key))
        .body(String::new())
        .unwrap();
    let response = service.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"units 3");
    assert_eq!(w.handle.counters().lease_waits, 1);
    assert_eq!(w.shutdown_and_billed().await, [3]);
}

/// I17: a lease wait longer than the bound is refused by name; the bound
/// itself is accepted.
#[tokio::test(start_paused = true)]
async fn a_lease_wait_above_the_bound_is_a_named_error() {
    let w = world(20, ms(0)).await;
    let build = |wait: Duration| {
        TollgateLayer::builder(w.handle.clone())
            .price(|_: &http::request::Parts| Price {
                units: CostUnits(1),
                required: READ,
            })
            .wait_for_lease(wait)
            .build()
            .map(|_| ())
    };
    assert_eq!(build(TollgateBuilder::MAX_LEASE_WAIT), Ok(()));
    assert_eq!(
        build(TollgateBuilder::MAX_LEASE_WAIT + Duration::from_millis(1)),
        Err(LayerConfigError::LeaseWaitTooLong)
    );
}
