//! Loom models of the model's atomics. See `scripts/test` for the command.
//!
//! Each model explores every interleaving (within the preemption bound the
//! test script sets) of a few threads racing on one reservation, lease or
//! overage counter, and checks the `INVARIANTS.md` rules the racing code
//! enforces. The rule a check proves is cited next to it (`// I3`).
//!
//! Everything an atomic lives in is built inside `loom::model`, so each
//! execution starts fresh. `Arc` is std's, as in the library: the models
//! reach quiescence by joining the threads, never by reading reference
//! counts concurrently, except the two cached-view models (I26), which
//! shadow one shard's strong count in a loom atomic with std's orderings
//! ([`ShardCount`]). Debits name their locality explicitly, because loom
//! runs its threads on one OS thread and `Locality::current` would hand them
//! all the same shard.
//!
//! Unit counts are tiny on purpose: they only need to put a counter on either
//! side of a cap or a low-water mark, and every extra step multiplies the
//! interleavings to explore.

use std::sync::Arc;

use CancelOutcome::ZeroCharged;
use CommitError::AlreadyReleased;
use jiff::{SignedDuration, Timestamp};
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
use loom::thread;

use crate::admission::{UsagePermit, UsageRecorder};
use crate::model::{
    AccountId, AccountOverage, CancelOutcome, CommitError, CommitFunding, CostUnits, DenyReason,
    FencingToken, LeaseGrant, LeaseId, LocalLease, LocalSharding, Locality, PolicyRevision,
    RefillSignal, RefillVerdict, RequestId, Reservation, UsageEvent, UsageSource, ViewMiss,
};

const ACCOUNT: AccountId = AccountId(7);
const ONE: CostUnits = CostUnits(1);
const TWO: CostUnits = CostUnits(2);

/// When every lease in these models expires. With no safety margin it is also
/// the first instant at which the lease is no longer usable (I2).
fn expires_at() -> Timestamp {
    Timestamp::from_second(1_900_000_000).expect("a timestamp in range")
}

/// An instant inside every lease's usability window.
fn inside_window() -> Timestamp {
    expires_at()
        .checked_sub(SignedDuration::from_secs(1))
        .expect("a timestamp in range")
}

fn grant(units: u64) -> LeaseGrant {
    LeaseGrant {
        lease_id: LeaseId(1),
        account_id: ACCOUNT,
        fencing_token: FencingToken(1),
        units: CostUnits(units),
        expires_at: expires_at(),
    }
}

/// A doorbell that only counts its rings, in a loom atomic so the count is
/// part of the model.
#[derive(Debug)]
struct CountingDoorbell {
    rings: AtomicUsize,
}

impl CountingDoorbell {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            rings: AtomicUsize::new(0),
        })
    }

    fn rings(&self) -> usize {
        self.rings.load(Ordering::SeqCst)
    }
}

impl RefillSignal for CountingDoorbell {
    fn request_refill(&self) {
        self.rings.fetch_add(1, Ordering::SeqCst);
    }
}

/// A lease of `granted` units over two shards, ringing a counting doorbell.
fn two_shard_lease(granted: u64, low_water: CostUnits) -> (Arc<LocalLease>, Arc<CountingDoorbell>) {
    let doorbell = CountingDoorbell::new();
    let sharding = LocalSharding::shards(2).expect("two shards are allowed");
    let lease = Arc::new(
        LocalLease::with_sharding(grant(granted), low_water, SignedDuration::ZERO, sharding)
            .with_refill(Arc::clone(&doorbell) as Arc<dyn RefillSignal>),
    );
    (lease, doorbell)
}

/// Waits for a model thread, whose panic is the model's failure.
fn join<T: 'static>(handle: thread::JoinHandle<T>) -> T {
    handle.join().expect("a model thread panicked")
}

/// A usage event of one unit of overage, as a commit records one.
fn event(request: u64) -> UsageEvent {
    UsageEvent {
        request_id: RequestId::from_parts(1, request),
        account_id: ACCOUNT,
        source: UsageSource::Overage,
        units: ONE,
        at: inside_window(),
        policy_revision: PolicyRevision::UNSTATED,
        key_id: None,
    }
}

/// Takes back the only handle to a reservation once every thread that shared
/// it has been joined, and drops it, as a request ends.
fn end_request(reservation: Arc<Reservation>) {
    let reservation =
        Arc::try_unwrap(reservation).expect("every thread sharing the reservation was joined");
    drop(reservation);
}

/// I3, I4, I6: a commit at execution start and a cancel race for one leased
/// reservation. Exactly one wins, and once the lease is quiescent it holds
/// the grant less what the winner kept.
#[test]
fn a_commit_and_a_cancel_racing_on_one_leased_reservation_settle_it_exactly_once() {
    const GRANTED: u64 = 3;
    loom::model(|| {
        let lease = LocalLease::new(grant(GRANTED), CostUnits::ZERO);
        let reservation = Arc::new(
            Reservation::reserve_at_locality(&lease, TWO, inside_window(), Locality::new(0))
                .expect("the lease funds the quote"),
        );

        let commit_thread = {
            let reservation = Arc::clone(&reservation);
            thread::spawn(move || {
                reservation.commit_at_execution_start(inside_window(), CommitFunding::LeaseOnly)
            })
        };
        let cancel_thread = {
            let reservation = Arc::clone(&reservation);
            thread::spawn(move || reservation.cancel())
        };
        let commit_outcome = join(commit_thread);
        let cancel_outcome = join(cancel_thread);

        let event = reservation.usage_event(
            RequestId::from_parts(1, 1),
            inside_window(),
            PolicyRevision::UNSTATED,
            None,
        );
        let kept = match (commit_outcome, cancel_outcome) {
            (Ok(units), CancelOutcome::AlreadyCommitted { units: charged }) => {
                // I3: the commit won; the cancel reports the charge standing.
                assert_eq!(units, TWO);
                assert_eq!(charged, TWO);
                assert!(reservation.is_committed() && !reservation.is_released());
                // I8: a committed reservation yields its one event.
                let event = event.expect("I8: a committed reservation yields a usage event");
                assert_eq!(event.source.lease_id(), Some(LeaseId(1)));
                assert_eq!(event.units, TWO);
                TWO.get()
            }
            (Err(AlreadyReleased), ZeroCharged) => {
                // I3, I4: the cancel won and charged nothing.
                assert!(reservation.is_released() && !reservation.is_committed());
                assert_eq!(event, None, "I8: a released reservation yields no event");
                0
            }
            other => panic!("I3: exactly one of commit and cancel must win, got {other:?}"),
        };

        end_request(reservation);
        assert!(lease.is_only_local_view(), "I6: no debit holds a shard");
        // I4, I6: the loser returned nothing twice and the winner's units
        // are exactly where they belong.
        assert_eq!(lease.remaining(), CostUnits(GRANTED - kept));
    });
}

/// I3, I4, I10: a leased reservation whose window lapsed before execution
/// start commits through the Elastic overage fallback while a cancel races
/// it. The fallback is one transition, so exactly one funding term survives:
/// either the overage holds the quote, or it holds nothing; the lease gets
/// its units back either way, exactly once.
#[test]
fn an_elastic_fallback_commit_racing_a_cancel_keeps_exactly_one_funding_term() {
    const GRANTED: u64 = 3;
    loom::model(|| {
        let lease = LocalLease::new(grant(GRANTED), CostUnits::ZERO);
        let overage = Arc::new(AccountOverage::new(ACCOUNT));
        let reservation = Arc::new(
            Reservation::reserve_at_locality(&lease, TWO, inside_window(), Locality::new(0))
                .expect("the lease funds the quote"),
        );

        let commit_thread = {
            let reservation = Arc::clone(&reservation);
            let overage = Arc::clone(&overage);
            thread::spawn(move || {
                // I2: at `expires_at` the window has closed, so only the
                // fallback can fund the commit.
                reservation.commit_at_execution_start(
                    expires_at(),
                    CommitFunding::OverageFallback {
                        overage: &overage,
                        cap: TWO,
                    },
                )
            })
        };
        let cancel_thread = {
            let reservation = Arc::clone(&reservation);
            thread::spawn(move || reservation.cancel())
        };
        let commit_outcome = join(commit_thread);
        let cancel_outcome = join(cancel_thread);

        let event = reservation.usage_event(
            RequestId::from_parts(1, 1),
            expires_at(),
            PolicyRevision::UNSTATED,
            None,
        );
        match (commit_outcome, cancel_outcome) {
            (Ok(units), CancelOutcome::AlreadyCommitted { units: charged }) => {
                assert_eq!(units, TWO);
                assert_eq!(charged, TWO);
                assert!(reservation.is_committed());
                // I3, I10: the won claim names overage the counter holds, as
                // committed units.
                assert_eq!(overage.spent(), TWO, "I10: the fallback's overage stands");
                assert_eq!(overage.committed(), TWO);
                // I3: the terminal phase, not the admission, names what pays.
                let event = event.expect("I8: a committed reservation yields a usage event");
                assert_eq!(event.source, UsageSource::Overage);
            }
            (Err(AlreadyReleased), ZeroCharged) => {
                assert!(reservation.is_released());
                // I10: a lost claim strands no overage.
                assert_eq!(overage.spent(), CostUnits::ZERO, "I10: no overage stranded");
                assert_eq!(overage.committed(), CostUnits::ZERO);
                assert_eq!(event, None, "I8: a released reservation yields no event");
            }
            other => panic!("I3: exactly one of fallback and cancel must win, got {other:?}"),
        }

        end_request(reservation);
        assert!(lease.is_only_local_view(), "I6: no debit holds a shard");
        // I4, I6: whichever resolution won returned the lease's units, once.
        assert_eq!(lease.remaining(), CostUnits(GRANTED));
    });
}

/// I6, I7: on a single-counter lease, one request debits and releases, a
/// second debits and commits (its debit goes without a credit), and the
/// refill task checks the lease meanwhile.
///
/// Units are conserved exactly, and a lease that ends at its low-water mark
/// is never left silent: a check that answered `Idle` is followed by a ring.
#[test]
fn racing_debits_and_a_refill_check_conserve_units_and_leave_no_drained_lease_silent() {
    const GRANTED: u64 = 3;
    const LOW_WATER: CostUnits = CostUnits(2);
    loom::model(|| {
        let doorbell = CountingDoorbell::new();
        let lease = Arc::new(
            LocalLease::new(grant(GRANTED), LOW_WATER)
                .with_refill(Arc::clone(&doorbell) as Arc<dyn RefillSignal>),
        );

        let releaser = {
            let lease = Arc::clone(&lease);
            thread::spawn(move || {
                let debit = lease
                    .try_reserve_at(ONE, inside_window(), Locality::new(0))
                    .expect("I6: the lease funds both quotes");
                lease.credit(debit);
            })
        };
        let keeper = {
            let lease = Arc::clone(&lease);
            thread::spawn(move || {
                let debit = lease
                    .try_reserve_at(ONE, inside_window(), Locality::new(1))
                    .expect("I6: the lease funds both quotes");
                // A commit keeps the units: the debit is dropped uncredited.
                drop(debit);
            })
        };
        // The refill task: everything it is woken for from here on reaches it.
        let rings_before_check = doorbell.rings();
        let verdict = lease.refill_due_or_rearm();
        join(releaser);
        join(keeper);

        assert_ne!(verdict, RefillVerdict::Refused, "no debit was refused");
        assert_eq!(Arc::strong_count(&lease), 1);
        assert!(lease.is_only_local_view(), "I6: the lease is quiescent");
        // I6: granted − committed, exactly.
        assert_eq!(lease.remaining(), CostUnits(GRANTED - ONE.get()));

        // I7's "at most once between re-arms" cannot be told apart here (two
        // debits, and a check that may re-arm between them); the next model
        // shows it without a check.
        let rings = doorbell.rings();

        // I7: the lease ends at its mark, and the refill task hears of it.
        assert!(lease.remaining() <= LOW_WATER);
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Draining);
        if verdict == RefillVerdict::Idle {
            // The check re-armed and saw the lease above its mark, so the
            // debit that took it down must have rung after the check began.
            assert!(
                rings > rings_before_check,
                "I7: an Idle check left a drained lease silent"
            );
        }
    });
}

/// I7 on a sharded lease: a debit empties one shard while the refill task
/// checks the lease, and later debits take the lease to its mark from the
/// other shard, which stays above its own share. Had the check answered
/// `Idle`, the emptied shard could not ring again and the fall to the mark
/// would go unheard; so a check that answers `Idle` must have been rung
/// after it began.
#[test]
fn a_check_racing_a_debit_that_empties_a_shard_leaves_no_drained_lease_silent() {
    const GRANTED: u64 = 6;
    const LOW_WATER: CostUnits = CostUnits(2);
    loom::model(|| {
        // Each shard holds 3 with a share of 1 of the mark.
        let (lease, doorbell) = two_shard_lease(GRANTED, LOW_WATER);
        let emptier = {
            let lease = Arc::clone(&lease);
            thread::spawn(move || {
                // Committed: dropped uncredited.
                drop(
                    lease
                        .try_reserve_at(CostUnits(3), inside_window(), Locality::new(0))
                        .expect("I6: shard 0 funds it"),
                );
            })
        };
        let rings_before_check = doorbell.rings();
        let verdict = lease.refill_due_or_rearm();
        join(emptier);
        // Shard 1 falls from 3 to 2, above its share: the lease is at its
        // mark with no shard crossing one.
        drop(
            lease
                .try_reserve_at(ONE, inside_window(), Locality::new(1))
                .expect("I6: shard 1 funds it"),
        );
        assert_eq!(lease.remaining(), LOW_WATER);
        if verdict == RefillVerdict::Idle {
            assert!(
                doorbell.rings() > rings_before_check,
                "I7: an Idle check left a lease at its mark silent"
            );
        }
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Draining);
    });
}

/// I6: the refill check spreads a sharded lease's units evenly again while
/// requests debit and release on both shards. Units are only moved, never
/// lost or made: once quiescent the lease holds exactly what was not
/// committed, whatever a racing debit saw while units were being moved.
#[test]
fn spreading_a_lease_evenly_while_requests_debit_and_release_conserves_units() {
    const GRANTED: u64 = 6;
    const LOW_WATER: CostUnits = CostUnits(2);
    loom::model(|| {
        // Each shard holds 3 with a share of 1; shard 0 is emptied first,
        // leaving the lease above its mark, so the check has units to move.
        let (lease, _doorbell) = two_shard_lease(GRANTED, LOW_WATER);
        drop(
            lease
                .try_reserve_at(CostUnits(3), inside_window(), Locality::new(0))
                .expect("I6: shard 0 funds it"),
        );
        let requests: Vec<_> = (0..2)
            .map(|thread| {
                let lease = Arc::clone(&lease);
                thread::spawn(move || {
                    // A debit racing the move may be refused; one that is
                    // funded is released.
                    if let Ok(debit) =
                        lease.try_reserve_at(ONE, inside_window(), Locality::new(thread))
                    {
                        lease.credit(debit);
                    }
                })
            })
            .collect();
        let verdict = lease.refill_due_or_rearm();
        requests.into_iter().for_each(join);

        assert_ne!(verdict, RefillVerdict::Refused);
        assert_eq!(Arc::strong_count(&lease), 1);
        assert!(lease.is_only_local_view(), "I6: the lease is quiescent");
        assert_eq!(lease.remaining(), CostUnits(3), "I6: granted − committed");
    });
}

/// I23: a settled reading of a lease whose units are being spread evenly
/// counts every unit: units in transit between two shards make it
/// unsettled rather than short, so a refusal is never answered as final
/// on a reading that missed them.
#[test]
fn a_settled_reading_racing_a_spread_counts_every_unit() {
    const GRANTED: u64 = 6;
    const LOW_WATER: CostUnits = CostUnits(2);
    loom::model(|| {
        // Shard 0 spent, below its share of the mark while the lease is
        // above it: the check moves units over from shard 1.
        let (lease, _doorbell) = two_shard_lease(GRANTED, LOW_WATER);
        let spent = lease
            .try_reserve_at(CostUnits(3), inside_window(), Locality::new(0))
            .expect("I6: shard 0 funds it");
        drop(spent);
        let reader = {
            let lease = Arc::clone(&lease);
            thread::spawn(move || lease.settled_remaining())
        };
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Idle);
        if let Some(read) = join(reader) {
            assert_eq!(read, CostUnits(3), "I23: a settled reading misses nothing");
        }
    });
}

/// I23: a credit to one shard followed by a debit from the other, both
/// while a reading runs, cannot make a settled reading short of every
/// moment's total. Read once, the sum could take the credited shard
/// before its credit and the debited one after its debit: 2 units, when
/// the lease held 5, then 8, then 5 again.
#[test]
fn a_settled_reading_racing_a_credit_then_a_debit_is_a_total_the_lease_held() {
    const GRANTED: u64 = 8;
    loom::model(|| {
        // Shards of 4 each; a request holds 3 of shard 0's.
        let (lease, _doorbell) = two_shard_lease(GRANTED, CostUnits::ZERO);
        let pending = lease
            .try_reserve_at(CostUnits(3), inside_window(), Locality::new(0))
            .expect("I6: shard 0 funds it");
        let reader = {
            let lease = Arc::clone(&lease);
            thread::spawn(move || lease.settled_remaining())
        };
        // Released for zero, then another request debits shard 1.
        lease.credit(pending);
        let spent = lease
            .try_reserve_at(CostUnits(3), inside_window(), Locality::new(1))
            .expect("I6: shard 1 funds it");
        drop(spent);
        if let Some(read) = join(reader) {
            assert!(
                [CostUnits(5), CostUnits(8)].contains(&read),
                "I23: a settled reading is a total the lease held, not {read:?}"
            );
        }
    });
}

/// I7: with no re-arm in between, two racing debits that both leave the
/// lease at or below its mark ring once between them, not once each.
#[test]
fn two_debits_below_the_mark_ring_once_without_a_rearm() {
    const GRANTED: u64 = 3;
    const LOW_WATER: CostUnits = CostUnits(2);
    loom::model(|| {
        let doorbell = CountingDoorbell::new();
        let lease = Arc::new(
            LocalLease::new(grant(GRANTED), LOW_WATER)
                .with_refill(Arc::clone(&doorbell) as Arc<dyn RefillSignal>),
        );
        let racers: Vec<_> = (0..2)
            .map(|thread| {
                let lease = Arc::clone(&lease);
                thread::spawn(move || {
                    // Committed: the debit goes without a credit.
                    drop(
                        lease
                            .try_reserve_at(ONE, inside_window(), Locality::new(thread))
                            .expect("I6: the lease funds both"),
                    );
                })
            })
            .collect();
        racers.into_iter().for_each(join);
        assert_eq!(lease.remaining(), CostUnits(GRANTED - 2));
        assert_eq!(doorbell.rings(), 1, "I7: once, not once per debit");
    });
}

/// I6, I7: on a two-shard lease, a debit larger than its home shard gathers
/// the rest from the other shard while a request on that shard debits and
/// releases. The lease funds both, conserves units, and each shard rings at
/// most once with no re-arm in between.
#[test]
fn a_debit_gathering_from_the_other_shard_conserves_units_and_rings_each_shard_once() {
    const GRANTED: u64 = 4;
    const LOW_WATER: CostUnits = CostUnits(2);
    const GATHERED: CostUnits = CostUnits(3);
    loom::model(|| {
        let (lease, doorbell) = two_shard_lease(GRANTED, LOW_WATER);

        let gatherer = {
            let lease = Arc::clone(&lease);
            thread::spawn(move || {
                // Shard 0 holds 2 of the 3 units; the third sits on shard 1.
                let debit = lease
                    .try_reserve_at(GATHERED, inside_window(), Locality::new(0))
                    .expect("I6: a quote the whole lease funds is not refused");
                assert_eq!(debit.shard(), 0, "gathered units are taken at home");
                // Committed: dropped uncredited.
            })
        };
        let releaser = {
            let lease = Arc::clone(&lease);
            thread::spawn(move || {
                let debit = lease
                    .try_reserve_at(ONE, inside_window(), Locality::new(1))
                    .expect("I6: the lease funds both quotes");
                lease.credit(debit);
            })
        };
        join(gatherer);
        join(releaser);

        assert_eq!(Arc::strong_count(&lease), 1);
        assert!(lease.is_only_local_view(), "I6: the lease is quiescent");
        // I6: units moved between shards are still the lease's.
        assert_eq!(lease.remaining(), CostUnits(GRANTED - GATHERED.get()));
        assert_eq!(lease.largest_refused_quote(), CostUnits::ZERO);

        // I7: both shards went to their share of the mark, and neither rang
        // twice.
        assert_eq!(doorbell.rings(), 2, "I7: one ring per shard");
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Draining);
    });
}

/// I6: a debit that may need to gather races the refill check spreading
/// the lease's units evenly. Units are only moved: whether the debit was
/// funded (whole from one shard, or gathered from both as the spread left
/// them) or refused while units were in transit, the lease ends holding
/// exactly what was not committed.
#[test]
fn a_gathering_debit_racing_a_spread_conserves_units() {
    const GRANTED: u64 = 8;
    const LOW_WATER: CostUnits = CostUnits(2);
    const QUOTE: CostUnits = CostUnits(3);
    loom::model(|| {
        // Shard 0 spent, shard 1 holding the remaining 4: the check moves
        // two of them back, after which no shard holds the quote alone.
        let (lease, _doorbell) = two_shard_lease(GRANTED, LOW_WATER);
        drop(
            lease
                .try_reserve_at(CostUnits(4), inside_window(), Locality::new(0))
                .expect("I6: shard 0 funds it"),
        );
        let debit = {
            let lease = Arc::clone(&lease);
            thread::spawn(move || {
                lease
                    .try_reserve_at(QUOTE, inside_window(), Locality::new(0))
                    .map(drop)
            })
        };
        lease.refill_due_or_rearm();
        let funded = join(debit);
        assert_eq!(Arc::strong_count(&lease), 1);
        assert!(lease.is_only_local_view(), "I6: the lease is quiescent");
        let committed = if funded.is_ok() { QUOTE.get() } else { 0 };
        assert_eq!(
            lease.remaining(),
            CostUnits(4 - committed),
            "I6: granted − committed"
        );
    });
}

/// I6: a debit gathering a quote from both shards races a debit homed on
/// the same shard. The lease holds exactly both quotes, so both are funded
/// in every order: units the gatherer has collected are never left where the
/// other debit can take them first and leave the gatherer short.
#[test]
fn a_gathering_debit_and_a_debit_on_its_home_shard_are_both_funded() {
    const GRANTED: u64 = 4;
    const GATHERED: CostUnits = CostUnits(3);
    loom::model(|| {
        let sharding = LocalSharding::shards(2).expect("two shards are allowed");
        let lease = Arc::new(LocalLease::with_sharding(
            grant(GRANTED),
            CostUnits::ZERO,
            SignedDuration::ZERO,
            sharding,
        ));
        let ask = |quote: CostUnits, locality: usize| {
            let lease = Arc::clone(&lease);
            thread::spawn(move || {
                // Committed: the debit goes without a credit.
                lease
                    .try_reserve_at(quote, inside_window(), Locality::new(locality))
                    .map(drop)
            })
        };
        // Localities 0 and 2 both map to shard 0.
        let gatherer = ask(GATHERED, 0);
        let neighbour = ask(ONE, 2);
        assert_eq!(join(gatherer), Ok(()), "I6: the lease funds the gather");
        assert_eq!(join(neighbour), Ok(()), "I6: and the neighbour");
        assert_eq!(lease.remaining(), CostUnits::ZERO);
        assert_eq!(lease.largest_refused_quote(), CostUnits::ZERO);
    });
}

/// Races two debits of `QUOTE` on a two-shard lease of four units with a
/// low-water mark of two, homed at `homes`, and checks what a pair of
/// gathers promises (I6, I7). Each shard holds 2 with a share of 1 of the
/// mark, so each quote needs both shards, and the lease funds one of the
/// two quotes, never both; with `one_funded`, exactly one.
fn race_two_gathers(homes: [usize; 2], one_funded: bool) {
    const GRANTED: u64 = 4;
    const LOW_WATER: CostUnits = CostUnits(2);
    const QUOTE: CostUnits = CostUnits(3);
    loom::model(move || {
        let (lease, doorbell) = two_shard_lease(GRANTED, LOW_WATER);
        let ask = |locality: usize| {
            let lease = Arc::clone(&lease);
            thread::spawn(move || {
                lease
                    .try_reserve_at(QUOTE, inside_window(), Locality::new(locality))
                    .map(|debit| {
                        // Locality 2 maps to shard 0, as 0 does.
                        assert_eq!(
                            debit.shard(),
                            locality % 2,
                            "gathered units are taken at home"
                        );
                        // Committed: dropped uncredited.
                    })
            })
        };
        let first = ask(homes[0]);
        let second = ask(homes[1]);
        let outcomes = [join(first), join(second)];

        let funded = outcomes.iter().filter(|outcome| outcome.is_ok()).count();
        assert!(funded <= 1, "I6: the lease cannot fund both quotes");
        if one_funded {
            assert_eq!(funded, 1, "the retried gather funds one quote");
        }
        for outcome in outcomes {
            if let Err(refusal) = outcome {
                assert_eq!(refusal, DenyReason::LeaseExhausted);
            }
        }
        assert_eq!(Arc::strong_count(&lease), 1);
        assert!(lease.is_only_local_view(), "I6: the lease is quiescent");
        // I6: a gather that came up short handed what it took to its home
        // shard, so nothing is lost in transit, whoever was refused.
        let committed = if funded == 1 { QUOTE.get() } else { 0 };
        assert_eq!(
            lease.remaining(),
            CostUnits(GRANTED - committed),
            "I6: granted − committed"
        );
        // At least one quote was refused, and the record keeps it.
        assert_eq!(lease.largest_refused_quote(), QUOTE);
        let rings = doorbell.rings();
        if funded == 1 {
            // Both shards end below their share, each fell there by a take
            // that rang unless the shard had rung already; and the refusal
            // rang. With no re-arm, nothing rang twice.
            assert_eq!(rings, 3, "I7: once per shard, and once for the refusal");
        } else {
            // Failed gathers may or may not have left a shard at its share
            // on the way; the first refusal rang either way.
            assert!(
                (1..=3).contains(&rings),
                "I7: the refusal rang, and nothing twice (rang {rings})"
            );
        }
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Refused);
    });
}

/// I6, I7: two debits homed on different shards each need more than either
/// shard holds, so each gathers, starting with the shard the other gathers
/// last. At most one is funded; units are conserved whatever the order;
/// the refusal is recorded and rings once, and no shard rings twice.
///
/// Neither is promised to be funded: each gather may hold part of what the
/// other needs when the other looks, and a gather is retried once, and only
/// while a reading of the whole lease still shows the quote, so both may be
/// refused as a momentary shortage (see `LocalLease::try_reserve_at`; loom
/// finds such an order with four preemptions). The model claims no more.
#[test]
fn two_gathering_debits_homed_on_different_shards_fund_at_most_one_and_conserve_units() {
    race_two_gathers([0, 1], false);
}

/// I6, I7: as above, with both gathering debits homed on the same shard, so
/// a gather that comes up short hands its units to the shard the other
/// gather starts from, and the retry (a gather that lost units to a racing
/// debit is tried once more while the lease still holds the quote) finds
/// them there: one quote is funded in every order.
#[test]
fn two_gathering_debits_homed_on_one_shard_fund_exactly_one_and_conserve_units() {
    race_two_gathers([0, 2], true);
}

/// I7: two quotes the lease cannot fund are refused concurrently. The lease
/// keeps the larger quote for the refill task to consolidate, and its
/// doorbell rings once for the pair, not once per refusal.
#[test]
fn concurrent_refusals_keep_the_largest_quote_and_ring_once_per_lease() {
    const GRANTED: u64 = 2;
    loom::model(|| {
        let doorbell = CountingDoorbell::new();
        let lease = Arc::new(
            LocalLease::new(grant(GRANTED), CostUnits::ZERO)
                .with_refill(Arc::clone(&doorbell) as Arc<dyn RefillSignal>),
        );
        let ask = |quote: u64| {
            let lease = Arc::clone(&lease);
            thread::spawn(move || {
                lease
                    .try_reserve_at(CostUnits(quote), inside_window(), Locality::new(0))
                    .map(|debit| debit.units())
            })
        };
        let smaller = ask(GRANTED + 1);
        let larger = ask(GRANTED + 2);
        assert_eq!(join(smaller), Err(DenyReason::LeaseExhausted));
        assert_eq!(join(larger), Err(DenyReason::LeaseExhausted));

        // I7: the largest refused quote is kept, whatever order the two
        // recorded theirs in.
        assert_eq!(lease.largest_refused_quote(), CostUnits(GRANTED + 2));
        assert_eq!(doorbell.rings(), 1, "I7: a refusal rings once per lease");
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Refused);
        // I6: a refusal moves no units.
        assert_eq!(lease.remaining(), CostUnits(GRANTED));
    });
}

/// A one-unit, single-counter lease that has refused `first` units and rung
/// for it, racing the refill task, which forgets the quote it read, against
/// a request refused `later` units. Returns the lease and its doorbell once
/// both are done.
fn forget_racing_a_refusal(
    first: CostUnits,
    later: CostUnits,
) -> (Arc<LocalLease>, Arc<CountingDoorbell>) {
    let doorbell = CountingDoorbell::new();
    let lease = Arc::new(
        LocalLease::new(grant(1), CostUnits::ZERO)
            .with_refill(Arc::clone(&doorbell) as Arc<dyn RefillSignal>),
    );
    let refuse = |lease: &LocalLease, quote| {
        lease
            .try_reserve_at(quote, inside_window(), Locality::new(0))
            .map(drop)
    };
    assert_eq!(refuse(&lease, first), Err(DenyReason::LeaseExhausted));
    assert_eq!(doorbell.rings(), 1, "I7: the first refusal rings");
    // The refill task reads the record, and later forgets what it read.
    let seen = lease.largest_refused_quote();
    assert_eq!(seen, first);
    let request = {
        let lease = Arc::clone(&lease);
        thread::spawn(move || refuse(&lease, later))
    };
    lease.forget_refusal(seen);
    assert_eq!(join(request), Err(DenyReason::LeaseExhausted));
    (lease, doorbell)
}

/// I27, I28: the refill task forgets the refused quote it read while a
/// request is refused a larger one. The larger quote stays recorded in
/// every order, to be judged on its own, and the task is woken for it in
/// every order: by the refusal, when the forget came first (the record
/// rose from zero), or else by the forget, which finds it recorded over
/// the quote the task read (the refusal then rang nothing).
#[test]
fn a_larger_quote_refused_as_the_last_one_is_forgotten_stays_recorded() {
    loom::model(|| {
        let (lease, doorbell) = forget_racing_a_refusal(CostUnits(3), CostUnits(4));
        assert_eq!(
            lease.largest_refused_quote(),
            CostUnits(4),
            "I27: a larger quote recorded since the read stays recorded"
        );
        assert_eq!(
            doorbell.rings(),
            2,
            "I28: the larger quote woke the task, whichever came first"
        );
        assert_eq!(lease.refill_due_or_rearm(), RefillVerdict::Refused);
    });
}

/// I7, I27: the refill task forgets the refused quote it read while a
/// request is refused a smaller one. Either the smaller quote was recorded
/// while the first stood, rang nothing and is forgotten with it (a retry
/// records it afresh and rings), or it was recorded after the forget and
/// rang afresh. A quote left recorded has always woken the refill task
/// since the task's read, and the quote forgotten never comes back.
#[test]
fn a_smaller_quote_refused_as_the_last_one_is_forgotten_goes_with_it_or_rings() {
    loom::model(|| {
        let (lease, doorbell) = forget_racing_a_refusal(CostUnits(3), TWO);
        match lease.largest_refused_quote() {
            CostUnits::ZERO => {
                assert_eq!(
                    doorbell.rings(),
                    1,
                    "I7: recorded while the first quote stood, it rang nothing"
                );
                // The request's retry, refused again, is heard.
                assert!(
                    lease
                        .try_reserve_at(TWO, inside_window(), Locality::new(0))
                        .is_err()
                );
                assert_eq!(lease.largest_refused_quote(), TWO);
                assert_eq!(doorbell.rings(), 2, "I7: the retry rings afresh");
            }
            TWO => assert_eq!(
                doorbell.rings(),
                2,
                "I7: a refusal left recorded after the forget rang afresh"
            ),
            other => panic!("I27: the forgotten quote came back as {other:?}"),
        }
    });
}

/// I10, I11: an overage reservation holding the whole cap commits while
/// another request asks the same counter for more. The cap holds, and once
/// the observer has seen the commit's claim won (through the reservation's
/// phase or a flag the committing thread raises after the commit returned), its
/// refusal never calls the cap's units refundable.
#[test]
fn a_debit_after_an_observed_overage_commit_is_never_refused_as_temporary() {
    const CAP: CostUnits = TWO;
    loom::model(|| {
        let overage = Arc::new(AccountOverage::new(ACCOUNT));
        let reservation =
            Arc::new(Reservation::reserve_overage(&overage, CAP, CAP).expect("the cap is free"));
        let published = Arc::new(AtomicBool::new(false));

        let commit_thread = {
            let reservation = Arc::clone(&reservation);
            let published = Arc::clone(&published);
            thread::spawn(move || {
                let outcome = reservation
                    .commit_at_execution_start(inside_window(), CommitFunding::LeaseOnly);
                if outcome.is_ok() {
                    published.store(true, Ordering::Release);
                }
                outcome
            })
        };
        let observer = {
            let reservation = Arc::clone(&reservation);
            let overage = Arc::clone(&overage);
            let published = Arc::clone(&published);
            thread::spawn(move || {
                let saw_published = published.load(Ordering::Acquire);
                let saw_claim = reservation.is_committed();
                let debit = overage.try_debit(ONE, CAP);
                (saw_published, saw_claim, debit)
            })
        };
        let commit_outcome = join(commit_thread);
        let (saw_published, saw_claim, debit) = join(observer);

        assert_eq!(
            commit_outcome,
            Ok(CAP),
            "nothing else resolves the reservation"
        );
        // I10: the cap was full of the reservation's units throughout.
        let refusal = debit.expect_err("I10: a debit past the cap is refused");
        assert_eq!(overage.spent(), CAP, "I10: spent never exceeds the cap");
        assert_eq!(overage.committed(), CAP);
        if saw_published || saw_claim {
            // I11: the claim had won before the debit began.
            assert!(
                matches!(
                    refusal,
                    DenyReason::OverageCapExhausted { .. }
                        | DenyReason::OverageCommitInProgress { .. }
                ),
                "I11: refused as {refusal:?} after the commit was observed \
                 (flag {saw_published}, phase {saw_claim})"
            );
        }

        end_request(reservation);
        assert_eq!(overage.spent(), CAP, "I4: a committed charge stands");
    });
}

/// I3, I10, I11: a lapsed leased reservation commits through the Elastic
/// fallback while another request debits the same overage counter, and the
/// cap fits only one of them. Exactly one is funded, `spent` is what the
/// winners hold, each refusal names its retry class truthfully, and the lease
/// gets its units back whichever way the commit went.
#[test]
fn an_elastic_fallback_and_a_racing_overage_debit_share_the_cap_truthfully() {
    const GRANTED: u64 = 2;
    const CAP: CostUnits = TWO;
    loom::model(|| {
        let lease = LocalLease::new(grant(GRANTED), CostUnits::ZERO);
        let overage = Arc::new(AccountOverage::new(ACCOUNT));
        let reservation = Arc::new(
            Reservation::reserve_at_locality(&lease, TWO, inside_window(), Locality::new(0))
                .expect("the lease funds the quote"),
        );

        let commit_thread = {
            let reservation = Arc::clone(&reservation);
            let overage = Arc::clone(&overage);
            thread::spawn(move || {
                reservation.commit_at_execution_start(
                    expires_at(),
                    CommitFunding::OverageFallback {
                        overage: &overage,
                        cap: CAP,
                    },
                )
            })
        };
        let observer = {
            let reservation = Arc::clone(&reservation);
            let overage = Arc::clone(&overage);
            thread::spawn(move || {
                let saw_claim = reservation.is_committed();
                (saw_claim, overage.try_debit(ONE, CAP))
            })
        };
        let commit_outcome = join(commit_thread);
        let (saw_claim, debit) = join(observer);

        // I10: never past the cap, and spent is exactly what was funded.
        let fallback_held = match commit_outcome {
            Ok(units) => units,
            Err(CommitError::Denied(refusal)) => {
                // I11: the cap was full of the observer's pending units.
                assert!(
                    matches!(refusal, DenyReason::OverageCapTemporarilyExhausted { .. }),
                    "I11: the fallback was refused as {refusal:?} by pending units"
                );
                CostUnits::ZERO
            }
            Err(other) => panic!("nothing else resolves the reservation, got {other:?}"),
        };
        let observer_held = match debit {
            Ok(()) => ONE,
            Err(refusal) => {
                if saw_claim {
                    // I11: the claim had won before the debit began.
                    assert!(
                        matches!(
                            refusal,
                            DenyReason::OverageCapExhausted { .. }
                                | DenyReason::OverageCommitInProgress { .. }
                        ),
                        "I11: refused as {refusal:?} after the claim was observed"
                    );
                }
                CostUnits::ZERO
            }
        };
        assert!(
            fallback_held.is_zero() != observer_held.is_zero(),
            "I10: exactly one of {fallback_held:?} and {observer_held:?} fits the cap"
        );
        let held = fallback_held
            .checked_add(observer_held)
            .expect("small amounts");
        assert_eq!(overage.spent(), held, "I10: spent is what the winners hold");
        assert!(overage.spent() <= CAP);
        assert_eq!(
            overage.committed(),
            fallback_held,
            "I3: only a won claim commits"
        );

        end_request(reservation);
        assert!(lease.is_only_local_view(), "I6: no debit holds a shard");
        // I4, I6: the lease's units came back exactly once either way.
        assert_eq!(lease.remaining(), CostUnits(GRANTED));
        if !observer_held.is_zero() {
            overage.credit(observer_held);
        }
        assert_eq!(overage.spent(), overage.committed());
    });
}

/// I10, I11: two overage reservations race for a cap that fits only one.
/// Exactly one succeeds, `spent` is what the successes hold, and the loser is
/// told the cap is only temporarily full, since nothing is committed.
#[test]
fn racing_overage_reservations_never_exceed_the_cap() {
    const CAP: CostUnits = CostUnits(3);
    loom::model(|| {
        let overage = Arc::new(AccountOverage::new(ACCOUNT));
        let reserve = || {
            let overage = Arc::clone(&overage);
            thread::spawn(move || Reservation::reserve_overage(&overage, TWO, CAP))
        };
        let first = reserve();
        let second = reserve();
        let outcomes = [join(first), join(second)];

        // I10: never past the cap, and spent is exactly what succeeded.
        assert!(overage.spent() <= CAP, "I10: spent {:?}", overage.spent());
        let held = outcomes
            .iter()
            .filter_map(|outcome| outcome.as_ref().ok())
            .map(Reservation::units)
            .try_fold(CostUnits::ZERO, CostUnits::checked_add)
            .expect("two small quotes never overflow");
        assert_eq!(overage.spent(), held);
        assert_eq!(held, TWO, "I10: exactly one of the two fits");
        for outcome in &outcomes {
            if let Err(refusal) = outcome {
                // I11: only pending, refundable units fill the cap.
                assert!(
                    matches!(refusal, DenyReason::OverageCapTemporarilyExhausted { .. }),
                    "I11: refused as {refusal:?} with nothing committed"
                );
            }
        }

        drop(outcomes);
        // I4: the pending reservation ends for zero.
        assert_eq!(overage.spent(), CostUnits::ZERO);
    });
}

/// I20, I21: a usage place taken while the writer closes the queue. Both
/// change the same word of free places, so either the writer, reading it
/// after the close, sees the place held and waits for its event, or the
/// take is refused: never a permit taken behind the writer's back, whose
/// event nobody would deliver.
#[test]
fn a_place_taken_as_the_queue_closes_is_seen_by_the_writer_or_refused() {
    loom::model(|| {
        let recorder = UsageRecorder::striped(2, 1, LocalSharding::Single);
        let queue = Arc::clone(recorder.queue());
        let taker = thread::spawn(move || recorder.try_permit());
        queue.close();
        let held_when_seen = queue.in_use();
        match join(taker) {
            Ok(permit) => {
                assert_eq!(held_when_seen, 1, "I21: the writer saw the place taken");
                drop(permit);
            }
            Err(reason) => {
                assert_eq!(reason, DenyReason::ShuttingDown);
                assert_eq!(held_when_seen, 0, "a refused take holds nothing");
            }
        }
        assert_eq!(queue.in_use(), 0);
    });
}

/// I21 across stripes: a thread whose own stripe is full borrows a place
/// from the next one while the queue closes stripe by stripe. The close may
/// reach the borrowed stripe before or after the take, and the take may find
/// its home stripe full or already closed; in every order the writer, reading
/// the places after closing them all, counts the borrowed place, or the take
/// is refused as shutting down.
#[test]
fn a_place_borrowed_from_another_stripe_as_the_queue_closes_is_seen_or_refused() {
    loom::model(|| {
        // One place per stripe; the home stripe's is held before the race.
        let recorder = UsageRecorder::striped(2, 1, LocalSharding::shards(2).expect("two"));
        let home = Locality::new(0);
        let held = recorder
            .try_permit_at(home)
            .expect("the home stripe's place");
        let queue = Arc::clone(recorder.queue());
        let taker = thread::spawn(move || recorder.try_permit_at(home));
        queue.close();
        let held_when_seen = queue.in_use();
        match join(taker) {
            Ok(borrowed) => {
                assert_eq!(held_when_seen, 2, "I21: the writer saw the borrowed place");
                drop(borrowed);
            }
            Err(reason) => {
                assert_eq!(reason, DenyReason::ShuttingDown, "I21: refused, not full");
                assert_eq!(held_when_seen, 1, "a refused take holds nothing");
            }
        }
        drop(held);
        assert_eq!(queue.in_use(), 0, "I20: every place came back");
    });
}

/// A thread that commits on `permit` as a request context does: refused
/// if the queue refuses commits (the handler does not run), recorded
/// otherwise. It first reads `happened`, which the other side sets after
/// the change that refuses commits; a commit that saw it must be refused
/// (`rule`). Returns whether it recorded.
fn committing(
    permit: UsagePermit,
    happened: &Arc<AtomicBool>,
    rule: &'static str,
) -> thread::JoinHandle<bool> {
    let happened = Arc::clone(happened);
    thread::spawn(move || {
        let after = happened.load(Ordering::Acquire);
        if permit.refuses_commits() {
            drop(permit);
            return false;
        }
        assert!(!after, "{rule}");
        permit.record(event(1));
        true
    })
}

/// I21: a commit racing the writer's give-up. The commit checks whether the
/// writer is gone, and records if not; the writer abandons the queue, takes
/// and frees what is queued, then counts what is still recorded and the
/// places permits still hold. A recorded event is counted exactly once (taken,
/// found queued, or its place still held when the writer looked); an event
/// not recorded is in neither count, so nothing is lost silently. And a
/// commit that comes after the give-up (the committer saw it happen) is
/// refused: nothing would deliver its event.
#[test]
fn a_commit_racing_the_writers_give_up_is_counted_once_or_refused() {
    loom::model(|| {
        let recorder = UsageRecorder::striped(1, 1, LocalSharding::Single);
        let queue = Arc::clone(recorder.queue());
        let permit = recorder.try_permit().expect("a free place");
        let gave_up = Arc::new(AtomicBool::new(false));
        let committer = committing(
            permit,
            &gave_up,
            "I21: a commit after the give-up is refused",
        );
        queue.abandon();
        gave_up.store(true, Ordering::Release);
        let mut taken = Vec::new();
        let given_up = queue.take_into(&mut taken, usize::MAX);
        queue.release(given_up);
        let undelivered = queue.undelivered();
        let outstanding = queue.in_use().saturating_sub(undelivered);
        let recorded = join(committer);
        if recorded {
            assert_eq!(
                given_up + undelivered + outstanding,
                1,
                "I21: the recorded event is counted once"
            );
        } else {
            assert_eq!(given_up + undelivered, 0, "nothing was recorded");
        }
        assert_eq!(queue.overflowed(), 0, "I20: the event had its place");
    });
}

/// I25: a commit racing the instance's stop. A commit that comes after the
/// stop (the committer saw it happen) is refused and gives its place back;
/// one that comes before records as usual. Either way every place is
/// accounted for, and a permit asked for after the stop is refused as
/// shutting down without touching the count of places.
#[test]
fn a_commit_racing_the_stop_is_refused_after_it_and_recorded_before_it() {
    loom::model(|| {
        let recorder = UsageRecorder::striped(2, 2, LocalSharding::Single);
        let queue = Arc::clone(recorder.queue());
        let permit = recorder.try_permit().expect("a free place");
        let stopped = Arc::new(AtomicBool::new(false));
        let committer = committing(permit, &stopped, "I25: a commit after the stop is refused");
        queue.stop_commits();
        stopped.store(true, Ordering::Release);
        assert_eq!(
            recorder.try_permit().map(|_| ()),
            Err(DenyReason::ShuttingDown),
            "no permit after the stop"
        );
        let recorded = join(committer);
        assert_eq!(
            queue.in_use(),
            usize::from(recorded),
            "I20: a place per event"
        );
        assert_eq!(queue.len(), usize::from(recorded));
        assert_eq!(queue.overflowed(), 0);
    });
}

/// A shared charge's worker whose commit loses to a cancel sees the cancel
/// requested: the request is recorded before the phase is tried.
#[test]
fn a_worker_whose_commit_loses_to_a_cancel_sees_it_requested() {
    loom::model(|| {
        let lease = LocalLease::new(grant(1), CostUnits::ZERO);
        let reservation =
            Reservation::reserve_at_locality(&lease, ONE, inside_window(), Locality::new(0))
                .expect("the lease funds the quote");
        let (shared, handle) = reservation.split();
        let canceller = thread::spawn(move || handle.cancel());
        let committed = shared
            .reservation()
            .commit_at_execution_start(inside_window(), CommitFunding::LeaseOnly);
        // Read by the worker, as it decides whether to run, before the
        // canceller is known to be done.
        let seen_requested = shared.cancel_requested();
        let cancelled = join(canceller);
        match (committed, cancelled) {
            (Err(AlreadyReleased), ZeroCharged) => assert!(
                seen_requested,
                "a commit that lost to a cancel sees it requested"
            ),
            (Ok(units), CancelOutcome::AlreadyCommitted { units: charged }) => {
                assert_eq!((units, charged), (ONE, ONE));
            }
            other => panic!("I3: exactly one of commit and cancel must win, got {other:?}"),
        }
    });
}

/// The strong count of one shard as std's `Arc` keeps it, shadowed in a
/// loom atomic so that its orderings are part of the model (the library's
/// own counts are std's, which loom does not see; see the module's docs).
/// Each method mirrors one std operation, with std's orderings.
struct ShardCount(AtomicUsize);

impl ShardCount {
    /// The lease's own reference to the shard.
    fn new() -> Self {
        Self(AtomicUsize::new(1))
    }

    /// `Weak::upgrade`: an increment unless zero, acquire on success.
    fn upgrade(&self) -> bool {
        let mut count = self.0.load(Ordering::Relaxed);
        loop {
            if count == 0 {
                return false;
            }
            match self.0.compare_exchange_weak(
                count,
                count + 1,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(actual) => count = actual,
            }
        }
    }

    /// Dropping an `Arc` that is not the last: a release decrement.
    fn let_go(&self) {
        self.0.fetch_sub(1, Ordering::Release);
    }

    /// `Arc::strong_count(shard) == 1` (a relaxed load, the weakest std has
    /// used) and the acquire fence after it in `is_only_local_view`.
    fn is_only(&self) -> bool {
        let only = self.0.load(Ordering::Relaxed) == 1;
        fence(Ordering::Acquire);
        only
    }
}

/// How a request in [`view_debit_racing_a_take`] ends.
#[derive(Clone, Copy)]
enum RequestEnd {
    /// Committed: the units stay spent.
    Commit,
    /// Ended before its handler: the units go back to the shard.
    Release,
}

/// One request debiting through its cached view of a lease (admission's
/// fast path, no slot guard) and ending as `end`, while the lease manager
/// takes the lease out of its slot (the retire mark) and tests it for
/// quiescence, putting it back if it is busy, as a fold does.
///
/// A lease found quiescent is never debited or credited after: the count
/// the manager reads then is final, so the `unspent` it would release is
/// exact (I26, I6).
fn view_debit_racing_a_take(end: RequestEnd) {
    const GRANTED: u64 = 1;
    loom::model(move || {
        let lease = Arc::new(LocalLease::new(grant(GRANTED), CostUnits::ZERO));
        let count = Arc::new(ShardCount::new());
        // Cached by the request's thread while the lease served.
        let view = lease.view_at(Locality::new(0));
        let request = {
            let count = Arc::clone(&count);
            thread::spawn(move || {
                // `ShardView::debit` upgrades, then takes the units.
                if !count.upgrade() {
                    return 0;
                }
                let kept = match view.debit(ONE, inside_window()) {
                    Ok(debit) => match end {
                        RequestEnd::Commit => {
                            drop(debit);
                            ONE.get()
                        }
                        RequestEnd::Release => {
                            debit.refund();
                            drop(debit);
                            0
                        }
                    },
                    Err(miss) => {
                        assert_eq!(miss, ViewMiss::Stale, "the lease funds the quote");
                        0
                    }
                };
                count.let_go();
                kept
            })
        };

        // The lease manager: the slot's `take_counted`, then `is_quiescent`
        // (its own `Arc` to the lease is the only one: the request holds
        // none).
        lease.retire();
        let kept = if count.is_only() {
            let unspent = lease.remaining();
            let kept = join(request);
            // I26: what a release would claim is what the lease holds.
            assert_eq!(
                lease.remaining(),
                unspent,
                "I26: a lease found quiescent was debited or credited after"
            );
            kept
        } else {
            // Busy: put back in the slot, as a fold that finds it busy does.
            lease.unretire();
            join(request)
        };
        // I6: granted − committed, exactly.
        assert_eq!(lease.remaining(), CostUnits(GRANTED - kept));
    });
}

/// I26, I6: a request that debits through a cached view and commits
/// cannot land in a lease its manager found quiescent. This rests on the
/// retired check in the view's compare-exchange: without it the debit
/// may upgrade its view after the manager read the shard's count, and
/// spend units the manager has already counted as unspent.
#[test]
fn a_cached_view_cannot_debit_a_lease_found_quiescent() {
    view_debit_racing_a_take(RequestEnd::Commit);
}

/// I26, I6: a request that debits through a cached view before the lease
/// is retired, and releases after, is seen by the manager's quiescence
/// test: the retire's read-modify-write acquires the debit's exchange,
/// and with it the upgrade before it, so the manager's reading of the
/// shard's count cannot miss the view and call the lease quiescent while
/// a credit is still to come.
#[test]
fn a_cached_view_debited_before_the_retire_is_seen_by_the_quiescence_test() {
    view_debit_racing_a_take(RequestEnd::Release);
}
