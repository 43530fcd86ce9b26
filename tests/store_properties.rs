//! A state-machine property test of every store against a reference model:
//! random acquires, releases with any claim, consolidations, usage
//! (including re-deliveries and stale fencing tokens), reclaims across clock
//! jumps, top-ups and periodic refills. After every step the store must
//! agree with the model and `audit()` must find nothing (I14, I15). The
//! runner is generic over [`TestStore`]; each store gets one test at the
//! bottom, with its own case count, and each case starts from an empty store.

mod support;

use jiff::{SignedDuration, Timestamp};
use proptest::prelude::*;
use proptest::test_runner::{TestRunner, contextualize_config};
use support::stores::TestStore;
use tollgate::store::{
    AccountSpec, AllocateError, GrantPolicy, IngestOutcome, MemoryStore, RefillSchedule,
    RejectReason, TailSharing,
};
use tollgate::{
    AccountId, AccountStatus, BalanceExhaustion, BalanceShortfall, CostUnits, EnforcementMode,
    FencingToken, LeaseId, PolicyRevision, RequestId, UsageEvent, UsageSource,
};

const REFILL: RefillSchedule = RefillSchedule {
    amount: CostUnits(300),
    interval: SignedDuration::from_secs(100),
};

#[derive(Debug, Clone)]
enum Op {
    Acquire {
        requested: u64,
        ttl_secs: i64,
    },
    Release {
        lease: usize,
        claim: u64,
        stale: bool,
    },
    Consolidate {
        lease: usize,
        claim: u64,
        requested: u64,
        needed: u64,
        stale: bool,
        ttl_secs: i64,
    },
    Ingest {
        lease: usize,
        units: u64,
        stale: bool,
    },
    IngestOverage {
        units: u64,
    },
    Redeliver {
        event: usize,
    },
    Advance {
        secs: i64,
    },
    Reclaim {
        limit: usize,
    },
    TopUp {
        units: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1..150_u64, -5..90_i64).prop_map(|(requested, ttl_secs)| Op::Acquire { requested, ttl_secs }),
        2 => (any::<usize>(), 0..160_u64, prop::bool::weighted(0.1))
            .prop_map(|(lease, claim, stale)| Op::Release { lease, claim, stale }),
        2 => (any::<usize>(), 0..160_u64, 0..150_u64, 0..200_u64, prop::bool::weighted(0.1), -5..90_i64)
            .prop_map(|(lease, claim, requested, needed, stale, ttl_secs)| Op::Consolidate { lease, claim, requested, needed, stale, ttl_secs }),
        3 => (any::<usize>(), 0..60_u64, prop::bool::weighted(0.1))
            .prop_map(|(lease, units, stale)| Op::Ingest { lease, units, stale }),
        1 => (0..40_u64).prop_map(|units| Op::IngestOverage { units }),
        1 => any::<usize>().prop_map(|event| Op::Redeliver { event }),
        2 => (-20..120_i64).prop_map(|secs| Op::Advance { secs }),
        1 => (0..4_usize).prop_map(|limit| Op::Reclaim { limit }),
        1 => (0..200_u64).prop_map(|units| Op::TopUp { units }),
    ]
}

fn policy() -> GrantPolicy {
    GrantPolicy {
        max_ttl: SignedDuration::from_secs(60),
        reclaim_grace: SignedDuration::from_secs(10),
        tail: TailSharing {
            instances: 3,
            min_grant: CostUnits(5),
        },
    }
}

/// The grant for `requested` units out of `balance`, computed from
/// [`TailSharing`]'s documented rule for `policy()`'s three instances and
/// five-unit floor rather than by the library: the whole request while the
/// balance could fund three of them, else a third of the balance (rounded
/// up) but no less than five units, and never more than was asked for or
/// is there.
fn tail_grant(requested: u64, balance: u64) -> u64 {
    if u128::from(balance) >= u128::from(requested) * 3 {
        return requested;
    }
    let floor = 5.min(requested).min(balance);
    balance.div_ceil(3).max(floor).min(requested).min(balance)
}

/// A consolidation's grant: as [`tail_grant`] for the larger of what it
/// asks for and what it needs, and never less than what it needs.
fn consolidation_grant(requested: u64, needed: u64, available: u64) -> u64 {
    tail_grant(requested.max(needed), available).max(needed)
}

#[derive(Debug, Clone, Copy)]
struct ModelLease {
    id: LeaseId,
    token: FencingToken,
    granted: u64,
    used: u64,
    expires_at: Timestamp,
    settled: bool,
    /// Credited back at settlement.
    credited: u64,
}

/// What the store should hold, computed the plain way.
struct Model {
    account: AccountId,
    now: Timestamp,
    balance: u64,
    period_end: Timestamp,
    leases: Vec<ModelLease>,
    accepted: Vec<UsageEvent>,
    debt: u64,
    next_request: u128,
}

impl ModelLease {
    /// The lease's token, or a stale one that fences the caller out.
    fn token(&self, stale: bool) -> FencingToken {
        if stale {
            FencingToken(self.token.get() + 1_000)
        } else {
            self.token
        }
    }
}

impl Model {
    fn refill(&mut self) {
        if self.now >= self.period_end {
            self.balance = REFILL.amount.get();
            while self.period_end <= self.now {
                self.period_end += REFILL.interval;
            }
        }
    }

    fn pick(&self, index: usize) -> Option<usize> {
        (!self.leases.is_empty()).then(|| index % self.leases.len())
    }

    fn shortfall(&self, left: u64, wanted: u64) -> Option<BalanceShortfall> {
        (left < wanted).then_some(BalanceShortfall {
            remaining: CostUnits(left),
            period_end: Some(self.period_end),
        })
    }

    fn event(&mut self, source: UsageSource, units: u64) -> UsageEvent {
        self.next_request += 1;
        UsageEvent {
            request_id: RequestId(self.next_request),
            account_id: self.account,
            source,
            units: CostUnits(units),
            at: self.now,
            policy_revision: PolicyRevision(1),
            key_id: None,
        }
    }
}

/// Runs `cases` random scenarios against fresh stores of kind `S`, driving
/// each case's async calls on one current-thread runtime. Passes without
/// running when `S` is unavailable here.
fn check<S: TestStore>(cases: u32) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    if runtime.block_on(S::fresh(policy())).is_none() {
        return;
    }
    let mut config = contextualize_config(ProptestConfig::with_cases(cases));
    config.source_file = Some(file!());
    let mut runner = TestRunner::new(config);
    let ops = proptest::collection::vec(op(), 1..80);
    if let Err(failure) = runner.run(&ops, |ops| runtime.block_on(run::<S>(ops))) {
        panic!("{failure}\n{runner}");
    }
}

async fn run<S: TestStore>(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let store = S::fresh(policy())
        .await
        .expect("the store was available for the first case");
    let start = Timestamp::from_second(1_000).unwrap();
    let account = store
        .create_account(
            AccountSpec {
                balance: CostUnits(500),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: Some(REFILL),
            },
            start,
        )
        .await
        .unwrap();
    let mut model = Model {
        account,
        now: start,
        balance: 500,
        period_end: start + REFILL.interval,
        leases: Vec::new(),
        accepted: Vec::new(),
        debt: 0,
        next_request: 0,
    };
    for op in ops {
        model.refill();
        step(&store, &mut model, op).await?;
        // Reading the account applies a period that ended, as any call does.
        model.refill();
        let view = store.account(account, model.now).await.unwrap();
        prop_assert_eq!(view.balance, CostUnits(model.balance));
        let leased: u64 = model
            .leases
            .iter()
            .filter(|l| !l.settled)
            .map(|l| l.granted)
            .sum();
        prop_assert_eq!(view.leased, CostUnits(leased));
        prop_assert_eq!(view.overage_debt, CostUnits(model.debt));
        prop_assert_eq!(view.period_end, Some(model.period_end));
        let violations = store.audit().await.unwrap();
        prop_assert!(violations.is_empty(), "{:#?}", violations);
    }
    Ok(())
}

#[allow(clippy::too_many_lines)]
async fn step<S: TestStore>(store: &S, model: &mut Model, op: Op) -> Result<(), TestCaseError> {
    let now = model.now;
    match op {
        Op::Acquire {
            requested,
            ttl_secs,
        } => {
            let ttl = SignedDuration::from_secs(ttl_secs);
            let outcome = store
                .acquire(model.account, CostUnits(requested), ttl, now)
                .await;
            if ttl_secs <= 0 {
                prop_assert_eq!(outcome, Err(AllocateError::InvalidTtl));
            } else if model.balance == 0 {
                let exhausted = BalanceExhaustion {
                    period_end: Some(model.period_end),
                };
                prop_assert_eq!(outcome, Err(AllocateError::BalanceExhausted(exhausted)));
            } else {
                let allocation = outcome.expect("a funded acquire succeeds");
                let size = CostUnits(tail_grant(requested, model.balance));
                prop_assert_eq!(allocation.grant.units, size);
                prop_assert_eq!(
                    allocation.grant.expires_at,
                    now + ttl.min(SignedDuration::from_secs(60))
                );
                model.balance -= size.get();
                prop_assert_eq!(
                    allocation.funding,
                    model.shortfall(model.balance, requested)
                );
                model.leases.push(ModelLease {
                    id: allocation.grant.lease_id,
                    token: allocation.grant.fencing_token,
                    granted: size.get(),
                    used: 0,
                    expires_at: allocation.grant.expires_at,
                    settled: false,
                    credited: 0,
                });
            }
        }
        Op::Release {
            lease,
            claim,
            stale,
        } => {
            let Some(index) = model.pick(lease) else {
                return Ok(());
            };
            let l = model.leases[index];
            let outcome = store
                .release(l.id, l.token(stale), CostUnits(claim), now)
                .await;
            if stale {
                prop_assert_eq!(outcome, Err(AllocateError::Fenced));
            } else if l.settled {
                prop_assert_eq!(
                    outcome,
                    Err(AllocateError::LeaseNotActive),
                    "a lease settles once"
                );
            } else if claim > l.granted - l.used {
                prop_assert_eq!(outcome, Err(AllocateError::InvalidRelease));
            } else {
                prop_assert_eq!(outcome.map(|r| r.credited), Ok(CostUnits(claim)));
                model.balance += claim;
                model.leases[index].settled = true;
                model.leases[index].credited = claim;
            }
        }
        Op::Consolidate {
            lease,
            claim,
            requested,
            needed,
            stale,
            ttl_secs,
        } => {
            let Some(index) = model.pick(lease) else {
                return Ok(());
            };
            let l = model.leases[index];
            let ttl = SignedDuration::from_secs(ttl_secs);
            let outcome = store
                .consolidate(
                    l.id,
                    l.token(stale),
                    CostUnits(claim),
                    CostUnits(requested),
                    CostUnits(needed),
                    ttl,
                    now,
                )
                .await;
            let available = model.balance + claim;
            if ttl_secs <= 0 {
                prop_assert_eq!(outcome, Err(AllocateError::InvalidTtl));
            } else if requested.max(needed) == 0 {
                prop_assert_eq!(outcome, Err(AllocateError::InvalidRequest));
            } else if stale {
                prop_assert_eq!(outcome, Err(AllocateError::Fenced));
            } else if l.settled {
                prop_assert_eq!(outcome, Err(AllocateError::LeaseNotActive));
            } else if claim > l.granted - l.used {
                prop_assert_eq!(outcome, Err(AllocateError::InvalidRelease));
            } else if available == 0 {
                let exhausted = BalanceExhaustion {
                    period_end: Some(model.period_end),
                };
                prop_assert_eq!(outcome, Err(AllocateError::BalanceExhausted(exhausted)));
            } else if needed > available {
                let shortfall = BalanceShortfall {
                    remaining: CostUnits(available),
                    period_end: Some(model.period_end),
                };
                prop_assert_eq!(outcome, Err(AllocateError::BalanceInsufficient(shortfall)));
            } else {
                let allocation = outcome.expect("a fundable consolidation succeeds");
                prop_assert!(
                    allocation.grant.units >= CostUnits(needed),
                    "the floor holds"
                );
                let size = CostUnits(consolidation_grant(requested, needed, available));
                prop_assert_eq!(allocation.grant.units, size);
                // The new lease's window, as an acquire's: what was asked,
                // cut to the policy's max_ttl.
                prop_assert_eq!(
                    allocation.grant.expires_at,
                    now + ttl.min(SignedDuration::from_secs(60))
                );
                model.leases[index].settled = true;
                model.leases[index].credited = claim;
                model.balance = available - size.get();
                prop_assert_eq!(
                    allocation.funding,
                    model.shortfall(model.balance, requested.max(needed))
                );
                model.leases.push(ModelLease {
                    id: allocation.grant.lease_id,
                    token: allocation.grant.fencing_token,
                    granted: size.get(),
                    used: 0,
                    expires_at: allocation.grant.expires_at,
                    settled: false,
                    credited: 0,
                });
            }
        }
        Op::Ingest {
            lease,
            units,
            stale,
        } => {
            let Some(index) = model.pick(lease) else {
                return Ok(());
            };
            let l = model.leases[index];
            let source = UsageSource::Leased {
                lease_id: l.id,
                fencing_token: l.token(stale),
            };
            let event = model.event(source, units);
            let outcome = store.ingest(&[event]).await.unwrap();
            let expected = if stale {
                IngestOutcome::Rejected(RejectReason::FencingMismatch)
            } else if l.used + units + l.credited > l.granted {
                // I15: nothing past the grant, counting what settlement
                // credited back.
                IngestOutcome::Rejected(if l.settled {
                    RejectReason::LeaseSettled
                } else {
                    RejectReason::ExceedsLease
                })
            } else {
                model.leases[index].used += units;
                model.accepted.push(event);
                IngestOutcome::Accepted
            };
            prop_assert_eq!(outcome, vec![expected]);
        }
        Op::IngestOverage { units } => {
            let event = model.event(UsageSource::Overage, units);
            prop_assert_eq!(
                store.ingest(&[event]).await.unwrap(),
                vec![IngestOutcome::Accepted]
            );
            model.debt += units;
            model.accepted.push(event);
        }
        Op::Redeliver { event } => {
            if model.accepted.is_empty() {
                return Ok(());
            }
            let again = model.accepted[event % model.accepted.len()];
            prop_assert_eq!(
                store.ingest(&[again]).await.unwrap(),
                vec![IngestOutcome::Duplicate]
            );
        }
        Op::Advance { secs } => {
            model.now = now + SignedDuration::from_secs(secs);
        }
        Op::Reclaim { limit } => {
            let cutoff = now - SignedDuration::from_secs(10);
            let mut due: Vec<usize> = (0..model.leases.len())
                .filter(|i| !model.leases[*i].settled && model.leases[*i].expires_at <= cutoff)
                .collect();
            due.sort_by_key(|i| (model.leases[*i].expires_at, model.leases[*i].id));
            let batch = store.reclaim_expired_batch(now, limit).await.unwrap();
            prop_assert_eq!(batch.more, due.len() > limit);
            prop_assert_eq!(batch.reclaimed.len(), due.len().min(limit));
            for (reclaimed, index) in batch.reclaimed.iter().zip(due) {
                let l = &mut model.leases[index];
                prop_assert_eq!(reclaimed.lease_id, l.id);
                prop_assert_eq!(reclaimed.credited, CostUnits(l.granted - l.used));
                model.balance += l.granted - l.used;
                l.credited = l.granted - l.used;
                l.settled = true;
            }
        }
        Op::TopUp { units } => {
            let balance = store
                .top_up(model.account, CostUnits(units), now)
                .await
                .unwrap();
            model.balance += units;
            prop_assert_eq!(balance, CostUnits(model.balance));
        }
    }
    Ok(())
}

#[test]
fn the_memory_store_matches_its_model_and_its_books_balance() {
    check::<MemoryStore>(256);
}

/// Fewer cases: each one is a fresh schema on a real server.
#[cfg(feature = "postgres")]
#[test]
fn the_postgres_store_matches_its_model_and_its_books_balance() {
    check::<tollgate::store::PostgresStore>(24);
}
