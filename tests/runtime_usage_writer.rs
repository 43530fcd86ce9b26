//! The usage writer against a scripted sink, on paused tokio time: batching,
//! the flush interval, retries through outages and hangs, rejections,
//! bounded shutdown, and the accounting identity that says nothing is lost
//! silently (I20, I21, I22).

mod support;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use jiff::{SignedDuration, Timestamp};
use tokio::time::{Instant, sleep};
use tollgate::admission::UsageRecorder;
use tollgate::runtime::{
    UsageWriter, UsageWriterConfig, UsageWriterConfigError, WriterHealth, WriterStats,
};
use tollgate::store::{IngestOutcome, ManualClock, RejectReason, StoreError, UsageSink};
use tollgate::{
    AccountId, CostUnits, DenyReason, LocalSharding, PolicyRevision, RequestId, UsageEvent,
    UsageSource,
};

use support::logs::Logs;

const MAX_BATCH: usize = 4;
const FLUSH_MS: u64 = 100;
const FLUSH: Duration = Duration::from_millis(FLUSH_MS);
const BACKOFF: Duration = Duration::from_millis(50);
const INGEST_TIMEOUT: Duration = Duration::from_millis(200);
const DRAIN: Duration = Duration::from_secs(1);

fn config() -> UsageWriterConfig {
    UsageWriterConfig {
        queue_capacity: 64,
        queue_stripes: LocalSharding::Single,
        max_batch: MAX_BATCH,
        flush_interval: FLUSH,
        retry_backoff: BACKOFF,
        ingest_timeout: INGEST_TIMEOUT,
        shutdown_drain_deadline: DRAIN,
    }
}

fn start() -> Timestamp {
    Timestamp::from_second(1_700_000_000).expect("a test instant is in range")
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn event(id: u128) -> UsageEvent {
    UsageEvent {
        request_id: RequestId(id),
        account_id: AccountId(1),
        source: UsageSource::Overage,
        units: CostUnits(1),
        at: start(),
        policy_revision: PolicyRevision::UNSTATED,
        key_id: None,
    }
}

/// One planned answer of the scripted sink.
#[derive(Debug, Clone)]
enum Answer {
    AcceptAll,
    Fail,
    Hang,
    /// The sink panics, killing the writer's task.
    Panic,
    Outcomes(Vec<IngestOutcome>),
    DuplicateAll,
    RejectFirst,
    WrongCount,
}

/// A sink that records every batch it is handed, in order, and answers from
/// its script; once the script runs out it answers `then`.
#[derive(Debug)]
struct ScriptedSink {
    script: Mutex<VecDeque<Answer>>,
    then: Answer,
    received: Mutex<Vec<Vec<u128>>>,
    accepted: Mutex<Vec<u128>>,
    answered: Mutex<Vec<u128>>,
}

impl ScriptedSink {
    fn new(script: impl IntoIterator<Item = Answer>) -> Arc<Self> {
        Self::then(script, Answer::AcceptAll)
    }

    fn then(script: impl IntoIterator<Item = Answer>, then: Answer) -> Arc<Self> {
        Arc::new(Self {
            script: Mutex::new(script.into_iter().collect()),
            then,
            received: Mutex::new(Vec::new()),
            accepted: Mutex::new(Vec::new()),
            answered: Mutex::new(Vec::new()),
        })
    }

    fn plan(&self, answers: impl IntoIterator<Item = Answer>) {
        lock(&self.script).extend(answers);
    }

    /// Every batch handed over, as request ids, in the order received.
    fn received(&self) -> Vec<Vec<u128>> {
        lock(&self.received).clone()
    }

    /// The ids of events answered `Accepted`, in the order answered.
    fn accepted(&self) -> Vec<u128> {
        lock(&self.accepted).clone()
    }

    /// The ids of events the sink gave any outcome for, in the order
    /// answered.
    fn answered(&self) -> Vec<u128> {
        lock(&self.answered).clone()
    }

    fn next_answer(&self, batch: &[UsageEvent]) -> Answer {
        lock(&self.received).push(batch.iter().map(|e| e.request_id.get()).collect());
        lock(&self.script)
            .pop_front()
            .unwrap_or_else(|| self.then.clone())
    }

    fn note_answered(&self, batch: &[UsageEvent], outcomes: &[IngestOutcome]) {
        let (mut accepted, mut answered) = (lock(&self.accepted), lock(&self.answered));
        for (event, outcome) in batch.iter().zip(outcomes) {
            answered.push(event.request_id.get());
            if *outcome == IngestOutcome::Accepted {
                accepted.push(event.request_id.get());
            }
        }
    }
}

#[async_trait]
impl UsageSink for ScriptedSink {
    async fn ingest(&self, batch: &[UsageEvent]) -> Result<Vec<IngestOutcome>, StoreError> {
        let outcomes = match self.next_answer(batch) {
            Answer::AcceptAll => vec![IngestOutcome::Accepted; batch.len()],
            Answer::Outcomes(outcomes) => outcomes,
            Answer::DuplicateAll => vec![IngestOutcome::Duplicate; batch.len()],
            Answer::RejectFirst => {
                let mut outcomes = vec![IngestOutcome::Accepted; batch.len()];
                outcomes[0] = IngestOutcome::Rejected(RejectReason::Malformed);
                outcomes
            }
            Answer::WrongCount => vec![IngestOutcome::Accepted; batch.len() + 1],
            Answer::Fail => return Err(StoreError::new("scripted outage")),
            Answer::Hang => std::future::pending().await,
            Answer::Panic => panic!("scripted sink panic"),
        };
        if outcomes.len() == batch.len() {
            self.note_answered(batch, &outcomes);
        }
        Ok(outcomes)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

struct Harness {
    sink: Arc<ScriptedSink>,
    clock: Arc<ManualClock>,
    recorder: UsageRecorder,
    writer: UsageWriter,
    recorded: u64,
}

impl Harness {
    fn new(sink: Arc<ScriptedSink>) -> Self {
        Self::with_config(sink, config())
    }

    fn with_config(sink: Arc<ScriptedSink>, config: UsageWriterConfig) -> Self {
        let clock = Arc::new(ManualClock::new(start()));
        let (recorder, writer) = UsageWriter::spawn(sink.clone(), clock.clone(), config)
            .expect("the test configuration is valid");
        Self {
            sink,
            clock,
            recorder,
            writer,
            recorded: 0,
        }
    }

    /// Records one event per id, each through its own permit.
    #[track_caller]
    fn record(&mut self, ids: impl IntoIterator<Item = u128>) {
        for id in ids {
            let permit = self
                .recorder
                .try_permit()
                .expect("the test never fills the queue");
            permit.record(event(id));
            self.recorded += 1;
        }
    }

    fn stats(&self) -> WriterStats {
        self.writer.stats()
    }
}

fn ids(range: std::ops::Range<u128>) -> Vec<u128> {
    range.collect()
}

/// I21: every recorded event is exactly one of accepted, duplicate,
/// rejected, lost, queued or in flight.
#[track_caller]
fn assert_accounted(stats: &WriterStats, recorded: u64) {
    let sum = stats.accepted
        + stats.duplicate
        + stats.rejected
        + stats.lost
        + stats.queued
        + stats.in_flight;
    assert_eq!(
        sum, recorded,
        "I21: every recorded event is accounted for: {stats:?}"
    );
}

/// I21: a batch's worth wakes the writer at once; it does not wait for the
/// flush interval.
#[tokio::test(start_paused = true)]
async fn a_full_batch_is_delivered_without_waiting_for_the_flush_interval() {
    let mut h = Harness::new(ScriptedSink::new([]));
    h.record(0..4);
    sleep(ms(1)).await;
    assert_eq!(h.sink.received(), vec![ids(0..4)]);
    assert_eq!(h.stats().accepted, 4);
    assert_eq!(h.stats().batches, 1);
    assert_accounted(&h.stats(), h.recorded);
}

/// I20: a queue taken up by permits of requests in flight and a few
/// events, less than a batch, refuses admission; the refusal wakes the
/// writer, which delivers those few at once rather than at the flush
/// interval, and the places they held come back.
#[tokio::test(start_paused = true)]
async fn a_full_queue_with_less_than_a_batch_is_drained_at_once() {
    let mut h = Harness::with_config(
        ScriptedSink::new([]),
        UsageWriterConfig {
            queue_capacity: MAX_BATCH,
            ..config()
        },
    );
    // The writer is waiting before the queue fills: taking a place wakes
    // nobody, and two events are no batch.
    sleep(ms(1)).await;
    h.record(0..2);
    let in_flight: Vec<_> = (0..MAX_BATCH - 2)
        .map(|_| h.recorder.try_permit().expect("a free place"))
        .collect();
    sleep(ms(1)).await;
    assert!(h.sink.received().is_empty(), "nothing woke the writer yet");
    assert_eq!(
        h.recorder.try_permit().unwrap_err(),
        DenyReason::AccountingBackpressure
    );
    sleep(ms(1)).await;
    assert_eq!(
        h.sink.received(),
        vec![ids(0..2)],
        "delivered on the refusal, well before the flush interval"
    );
    assert_eq!(h.recorder.available(), 2, "their places came back");
    drop(in_flight);
    assert_accounted(&h.stats(), h.recorded);
}

/// I21: a partial batch waits for the flush interval, and no longer.
#[tokio::test(start_paused = true)]
async fn a_partial_batch_waits_for_the_flush_interval_and_no_longer() {
    let mut h = Harness::new(ScriptedSink::new([]));
    h.record(0..3);
    sleep(ms(FLUSH_MS - 1)).await;
    assert_eq!(
        h.sink.received(),
        Vec::<Vec<u128>>::new(),
        "not before the interval"
    );
    assert_eq!(h.stats().queued, 3);
    sleep(ms(2)).await;
    assert_eq!(h.sink.received(), vec![ids(0..3)], "at the interval");
    assert_eq!(h.stats().queued, 0);
    assert_accounted(&h.stats(), h.recorded);
}

/// Records `per_thread` events from each of `threads` threads of their
/// own, which the striped queue spreads over its stripes.
fn record_from_threads(h: &mut Harness, threads: u128, per_thread: u128) {
    let recorder = &h.recorder;
    std::thread::scope(|scope| {
        for thread in 0..threads {
            scope.spawn(move || {
                for id in 0..per_thread {
                    let permit = recorder.try_permit().expect("the queue has room");
                    permit.record(event(thread * 1_000 + id));
                }
            });
        }
    });
    h.recorded += u64::try_from(threads * per_thread).expect("small");
}

/// Several batches' worth spread over the stripes goes out by the flush
/// interval, batch after batch, not one batch per interval. (Where each
/// thread's events land depends on its number; a stripe that gets a whole
/// batch wakes the writer sooner. The library's unit tests place events in
/// chosen stripes.)
#[tokio::test(start_paused = true)]
async fn batches_spread_over_stripes_all_go_out_at_the_flush_interval() {
    let mut h = Harness::with_config(
        ScriptedSink::new([]),
        UsageWriterConfig {
            queue_stripes: LocalSharding::shards(4).expect("four stripes are within the limit"),
            ..config()
        },
    );
    // Three batches' worth, three events per thread: a thread alone never
    // fills a batch.
    record_from_threads(&mut h, 4, 3);
    sleep(FLUSH + ms(1)).await;
    let stats = h.stats();
    assert_eq!(stats.accepted, 12, "all of it at the interval: {stats:?}");
    assert_eq!(stats.batches, 3, "in whole batches");
    assert!(
        h.sink
            .received()
            .iter()
            .all(|batch| batch.len() == MAX_BATCH)
    );
    assert_accounted(&stats, h.recorded);
}

/// I21: an outage of many flush intervals loses nothing; the same batch is
/// retried until the sink recovers, and everything is accepted in recording
/// order.
#[tokio::test(start_paused = true)]
async fn a_long_sink_outage_loses_nothing_and_delivers_in_recording_order() {
    let mut h = Harness::new(ScriptedSink::new(vec![Answer::Fail; 20]));
    h.record(0..10);
    // Attempts fail at 0, 50, …, 950 ms; the twenty-first, at 1000 ms, succeeds.
    sleep(ms(25)).await;
    h.clock.advance(SignedDuration::from_secs(3600));
    let retrying_since_start = |attempts| WriterHealth::Retrying {
        since: start(),
        attempts,
    };
    assert_eq!(h.writer.health(), retrying_since_start(1));
    sleep(ms(500)).await;
    assert_eq!(h.writer.health(), retrying_since_start(11));
    assert_accounted(&h.stats(), h.recorded);
    sleep(ms(500)).await;
    assert_eq!(h.writer.health(), WriterHealth::Healthy);
    sleep(FLUSH * 2).await;

    let mut expected = vec![ids(0..4); 21];
    expected.extend([ids(4..8), ids(8..10)]);
    assert_eq!(
        h.sink.received(),
        expected,
        "the same batch, unchanged, until it lands"
    );
    assert_eq!(h.sink.accepted(), ids(0..10));
    let stats = h.stats();
    assert_eq!((stats.retries, stats.storage_errors), (20, 20));
    assert_eq!((stats.accepted, stats.lost, stats.batches), (10, 0, 3));
    assert_accounted(&stats, h.recorded);
}

/// I20, I21: on a striped queue a thread whose stripe fills borrows places
/// from the others, and an outage still loses nothing: each batch is retried
/// unchanged, every event is accepted exactly once and every place comes
/// back. Across stripes the order is not kept, so only the set is checked.
#[tokio::test(start_paused = true)]
async fn a_striped_queue_loses_nothing_through_an_outage() {
    let striped = UsageWriterConfig {
        queue_capacity: 16,
        queue_stripes: LocalSharding::shards(4).expect("four stripes are within the limit"),
        ..config()
    };
    let mut h = Harness::with_config(ScriptedSink::new(vec![Answer::Fail; 5]), striped);
    // Four stripes of four places: ten events fill this thread's stripe and
    // borrow six places from the others.
    h.record(0..10);
    assert_eq!(h.recorder.available(), 6);
    sleep(BACKOFF * 5 + FLUSH * 4).await;

    let received = h.sink.received();
    assert!(
        received[..6].iter().all(|batch| *batch == received[0]),
        "the failed batch, unchanged, until it lands: {received:?}"
    );
    let mut accepted = h.sink.accepted();
    accepted.sort_unstable();
    assert_eq!(accepted, ids(0..10), "each event accepted exactly once");
    let stats = h.stats();
    assert_eq!(
        (stats.accepted, stats.storage_errors, stats.lost),
        (10, 5, 0)
    );
    assert_eq!((stats.queued, stats.in_flight), (0, 0));
    assert_eq!(h.recorder.available(), 16, "I20: every place is free again");
    assert_accounted(&stats, h.recorded);
}

/// I22: a sink that never answers is cut off by the ingest timeout, once per
/// attempt, and the batch is retried until it lands.
#[tokio::test(start_paused = true)]
async fn a_hanging_sink_is_cut_off_by_the_ingest_timeout_and_the_batch_retried() {
    let mut h = Harness::new(ScriptedSink::new([Answer::Hang, Answer::Hang]));
    h.record(0..4);
    // Attempts at 0 and 250 ms hang until 200 and 450 ms; the one at 500 lands.
    sleep(ms(300)).await;
    let stats = h.stats();
    assert_eq!(
        (stats.ingest_timeouts, stats.retries, stats.in_flight),
        (1, 1, 4)
    );
    assert!(matches!(
        h.writer.health(),
        WriterHealth::Retrying { attempts: 1, .. }
    ));
    assert_accounted(&stats, h.recorded);
    sleep(ms(300)).await;
    let stats = h.stats();
    assert_eq!((stats.ingest_timeouts, stats.retries), (2, 2));
    assert_eq!(
        (stats.storage_errors, stats.accepted, stats.in_flight),
        (0, 4, 0)
    );
    assert_eq!(h.sink.received(), vec![ids(0..4); 3]);
    assert_eq!(h.writer.health(), WriterHealth::Healthy);
}

/// I22: an attempt that failed may have written the batch after all (a
/// timeout, a connection lost after the commit); the retry then finds the
/// events recorded. They are this writer's own, and count as accepted, not
/// as duplicates someone else delivered.
#[tokio::test(start_paused = true)]
async fn a_retry_that_finds_its_own_failed_attempt_recorded_counts_it_accepted() {
    let mut h = Harness::new(ScriptedSink::new([Answer::Hang, Answer::DuplicateAll]));
    h.record(0..4);
    sleep(DRAIN * 5).await;
    let stats = h.stats();
    assert_eq!((stats.accepted, stats.duplicate), (4, 0));
    assert_eq!(
        (stats.ingest_timeouts, stats.retries, stats.batches),
        (1, 1, 1)
    );
    // On a first attempt, a duplicate is someone else's delivery.
    h.sink.plan([Answer::DuplicateAll]);
    h.record(4..8);
    sleep(DRAIN * 5).await;
    let stats = h.stats();
    assert_eq!((stats.accepted, stats.duplicate), (4, 4));
    assert_accounted(&stats, h.recorded);
}

/// I21: duplicates count as delivered; a rejected event is counted and never
/// handed to the sink again.
#[tokio::test(start_paused = true)]
async fn duplicates_are_counted_and_rejections_are_never_retried() {
    let sink = ScriptedSink::new([Answer::Outcomes(vec![
        IngestOutcome::Accepted,
        IngestOutcome::Duplicate,
        IngestOutcome::Rejected(RejectReason::ExceedsLease),
        IngestOutcome::Duplicate,
    ])]);
    // The test's runtime runs the writer on this thread, so a subscriber
    // set here hears it.
    let (logs, _capture) = Logs::capture();
    let mut h = Harness::new(sink);
    h.record(0..4);
    sleep(DRAIN * 5).await;
    let rejections = logs.lines_with("the sink rejected a usage event");
    assert_eq!(rejections.len(), 1, "the rejection is logged once");
    assert!(
        rejections[0].contains(&RequestId(2).to_string())
            && rejections[0].contains("exceeds_lease"),
        "the log names the event and the reason: {}",
        rejections[0]
    );
    let stats = h.stats();
    assert_eq!((stats.accepted, stats.duplicate, stats.rejected), (1, 2, 1));
    assert_eq!((stats.retries, stats.batches), (0, 1));
    let rejected_seen = h
        .sink
        .received()
        .concat()
        .iter()
        .filter(|&&id| id == 2)
        .count();
    assert_eq!(
        rejected_seen, 1,
        "the rejected event is handed over exactly once"
    );
    assert_eq!(
        h.recorder.available(),
        h.recorder.capacity(),
        "I20: every place is free"
    );
    assert_accounted(&stats, h.recorded);
}

/// I21: an answer with the wrong number of outcomes says nothing about any
/// one event, so it is a storage error and the batch is retried.
#[tokio::test(start_paused = true)]
async fn an_answer_with_the_wrong_number_of_outcomes_is_retried_as_a_storage_error() {
    let mut h = Harness::new(ScriptedSink::new([Answer::WrongCount]));
    h.record(0..4);
    sleep(BACKOFF * 2).await;
    let stats = h.stats();
    assert_eq!(
        (stats.storage_errors, stats.retries, stats.accepted),
        (1, 1, 4)
    );
    assert_eq!(h.sink.received(), vec![ids(0..4); 2]);
    assert_eq!(h.sink.accepted(), ids(0..4));
}

/// I21: with a dead sink, shutdown returns at the drain deadline and reports
/// exactly the undelivered events as lost; I20: the queue then refuses new
/// permits and every place given up is free again.
#[tokio::test(start_paused = true)]
async fn shutdown_with_a_dead_sink_returns_at_the_deadline_and_reports_the_loss() {
    let mut h = Harness::new(ScriptedSink::then([], Answer::Fail));
    h.record(0..6);
    sleep(ms(300)).await;
    let begun = Instant::now();
    let report = h.writer.shutdown().await;
    assert_eq!(begun.elapsed(), DRAIN, "neither early nor late");
    assert_eq!(
        report.lost, 6,
        "the in-flight batch of four and the two queued"
    );
    assert_eq!((report.stats.lost, report.stats.accepted), (6, 0));
    assert!(!report.task_died);
    assert_accounted(&report.stats, h.recorded);
    assert_eq!(
        h.recorder.try_permit().unwrap_err(),
        DenyReason::ShuttingDown
    );
    assert_eq!(h.recorder.available(), h.recorder.capacity());
}

/// I21, I22: an ingest that hangs past the drain deadline does not hold
/// shutdown past it, even though its own timeout is later.
#[tokio::test(start_paused = true)]
async fn a_hanging_ingest_cannot_hold_shutdown_past_the_drain_deadline() {
    let slow_timeout = UsageWriterConfig {
        ingest_timeout: DRAIN * 10,
        ..config()
    };
    let mut h = Harness::with_config(ScriptedSink::then([], Answer::Hang), slow_timeout);
    h.record(0..2);
    sleep(FLUSH + ms(1)).await;
    assert_eq!(h.stats().in_flight, 2);
    let begun = Instant::now();
    let report = h.writer.shutdown().await;
    assert_eq!(begun.elapsed(), DRAIN);
    assert_eq!((report.lost, report.stats.ingest_timeouts), (2, 0));
}

/// I21: a stop deadline later than the configured drain budget is capped by
/// the budget.
#[tokio::test(start_paused = true)]
async fn a_stop_deadline_is_capped_by_the_drain_budget() {
    let mut h = Harness::new(ScriptedSink::then([], Answer::Fail));
    h.record(0..1);
    let begun = Instant::now();
    h.writer.stop_at(begun + DRAIN * 10);
    let report = h.writer.shutdown().await;
    assert_eq!(begun.elapsed(), DRAIN);
    assert_eq!(report.lost, 1);
}

/// I21: a second `stop_at` can bring the deadline forward, even while the
/// writer is backing off.
#[tokio::test(start_paused = true)]
async fn an_earlier_stop_deadline_replaces_a_later_one() {
    let mut h = Harness::new(ScriptedSink::then([], Answer::Fail));
    h.record(0..1);
    let begun = Instant::now();
    h.writer.stop_at(begun + DRAIN);
    sleep(ms(225)).await;
    h.writer.stop_at(Instant::now() + ms(100));
    let report = h.writer.shutdown().await;
    assert_eq!(begun.elapsed(), ms(325), "the earlier deadline wins");
    // Attempts at 0, 50, …, 300 ms; the one due at 350 never starts.
    assert_eq!((report.lost, report.stats.storage_errors), (1, 7));
}

/// I20, I21: a healthy shutdown delivers everything queued, waits for a
/// permit taken before the stop to record, and loses nothing.
#[tokio::test(start_paused = true)]
async fn shutdown_with_a_healthy_sink_delivers_everything_including_late_permits() {
    let mut h = Harness::new(ScriptedSink::new([]));
    h.record(0..3);
    let late = h.recorder.try_permit().expect("the queue has room");
    h.writer.stop_at(Instant::now() + DRAIN);
    assert_eq!(
        h.recorder.try_permit().unwrap_err(),
        DenyReason::ShuttingDown
    );
    // Well inside the flush interval: the stop itself starts the drain.
    sleep(ms(1)).await;
    assert_eq!(
        h.sink.received(),
        vec![ids(0..3)],
        "queued events go out at once"
    );
    late.record(event(3));
    h.recorded += 1;
    let begun = Instant::now();
    let report = h.writer.shutdown().await;
    assert!(
        begun.elapsed() < DRAIN,
        "finished once drained, not at the deadline"
    );
    assert_eq!(h.sink.received(), vec![ids(0..3), ids(3..4)]);
    assert_eq!((report.lost, report.stats.accepted), (0, 4));
    assert!(!report.task_died);
    assert_accounted(&report.stats, h.recorded);
    assert_eq!(h.recorder.available(), h.recorder.capacity());
}

/// I21: once stopped, the writer waits for the events of permits still out
/// by being woken as each is recorded, not by its flush interval, which may
/// be longer than the whole drain deadline: an event recorded in time is
/// delivered at once instead of being given up at the deadline.
#[tokio::test(start_paused = true)]
async fn an_event_recorded_after_the_stop_is_delivered_at_once_whatever_the_flush_interval() {
    let slow_flush = UsageWriterConfig {
        flush_interval: DRAIN * 2,
        ..config()
    };
    let mut h = Harness::with_config(ScriptedSink::new([]), slow_flush);
    let late = h.recorder.try_permit().expect("the queue has room");
    h.writer.stop_at(Instant::now() + DRAIN);
    sleep(ms(15)).await;
    late.record(event(7));
    h.recorded += 1;
    let recorded_at = Instant::now();
    let report = h.writer.shutdown().await;
    assert_eq!(
        recorded_at.elapsed(),
        Duration::ZERO,
        "delivered when recorded, not at the next poll, tick or deadline"
    );
    assert_eq!(h.sink.received(), vec![vec![7]]);
    assert_eq!((report.lost, report.stats.accepted), (0, 1));
    assert_accounted(&report.stats, h.recorded);
}

/// I21: a permit given back after the stop wakes the writer, which then has
/// nothing left to wait for and finishes at once.
#[tokio::test(start_paused = true)]
async fn a_permit_given_back_after_the_stop_lets_the_writer_finish_at_once() {
    let slow_flush = UsageWriterConfig {
        flush_interval: DRAIN * 2,
        ..config()
    };
    let h = Harness::with_config(ScriptedSink::new([]), slow_flush);
    let unused = h.recorder.try_permit().expect("the queue has room");
    h.writer.stop_at(Instant::now() + DRAIN);
    sleep(ms(15)).await;
    drop(unused);
    let returned_at = Instant::now();
    let report = h.writer.shutdown().await;
    assert_eq!(returned_at.elapsed(), Duration::ZERO);
    assert_eq!((report.lost, report.outstanding_permits), (0, 0));
}

/// The recorder a writer drains refuses to be drained by anyone else: the
/// writer frees the places of the events it took in the order it took them,
/// and events taken from under it would have it free the wrong ones.
#[tokio::test]
#[should_panic(expected = "take_recorded on a recorder a UsageWriter drains")]
async fn the_recorder_a_writer_drains_cannot_be_drained_by_hand() {
    let h = Harness::new(ScriptedSink::new([]));
    h.recorder.take_recorded(&mut Vec::new(), usize::MAX);
}

/// I21: a permit still outstanding when the writer gives up is reported as
/// cut off, not lost: the queue is abandoned, so new permits are refused
/// (and a request context's commit on such a permit is refused, see
/// `tests/runtime_instance.rs`).
#[tokio::test(start_paused = true)]
async fn a_permit_outstanding_at_the_deadline_is_reported_cut_off() {
    let mut h = Harness::new(ScriptedSink::new([]));
    h.record(0..2);
    let outstanding = h.recorder.try_permit().expect("the queue has room");
    let Harness {
        sink,
        recorder,
        writer,
        ..
    } = h;
    let report = writer.shutdown().await;
    assert_eq!(sink.received(), vec![ids(0..2)]);
    assert_eq!(
        (report.stats.accepted, report.stats.lost, report.lost),
        (2, 0, 0)
    );
    assert_eq!(report.outstanding_permits, 1);
    assert!(!report.task_died);
    assert_eq!(recorder.try_permit().unwrap_err(), DenyReason::ShuttingDown);
    drop(outstanding);
    assert_eq!(
        recorder.available(),
        recorder.capacity(),
        "every place is back"
    );
}

/// I21: a writer whose task dies (here: the sink panics) abandons the queue
/// as it goes, so admission stops at once instead of filling the queue with
/// events nobody will write, logs what it leaves undelivered, and the
/// report counts the lost batch.
#[tokio::test(start_paused = true)]
async fn a_writer_whose_sink_panics_stops_admission_and_reports_its_loss() {
    let (logs, _capture) = Logs::capture();
    let mut h = Harness::new(ScriptedSink::new([Answer::Panic]));
    h.record(0..MAX_BATCH as u128);
    sleep(DRAIN).await;
    assert_eq!(h.writer.health(), WriterHealth::Stopped);
    // Said as it dies, whether or not its handle is ever asked.
    let said = logs.lines_with("the task panicked");
    assert_eq!(said.len(), 1, "{}", logs.text());
    assert!(
        said[0].contains(&format!("undelivered={MAX_BATCH}")),
        "{}",
        said[0]
    );
    assert_eq!(
        h.recorder.try_permit().unwrap_err(),
        DenyReason::ShuttingDown,
        "no place is handed out for events nobody will write"
    );
    let live = h.writer.stats();
    assert_eq!(
        (live.lost, live.in_flight, live.queued),
        (MAX_BATCH as u64, 0, 0),
        "the live statistics show the loss before any shutdown"
    );
    assert_accounted(&live, h.recorded);
    let report = h.writer.shutdown().await;
    assert!(report.task_died);
    assert_eq!(report.lost, MAX_BATCH as u64, "the batch it was delivering");
    assert_eq!(
        report.stats.lost, report.lost,
        "the statistics count it too"
    );
    assert_accounted(&report.stats, h.recorded);
    assert_eq!(report.outstanding_permits, 0);
}

/// I21: whatever the interleaving of recordings, failures, hangs,
/// duplicates and rejections, every recorded event is accounted for at every
/// step, and each one gets exactly one final answer, in recording order.
#[tokio::test(start_paused = true)]
async fn every_recorded_event_is_accounted_for_through_interleaved_failures() {
    let roomy = UsageWriterConfig {
        queue_capacity: 1024,
        ..config()
    };
    let mut h = Harness::with_config(ScriptedSink::new([]), roomy);
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next_id: u128 = 0;
    for _ in 0..300 {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let roll = seed >> 33;
        match roll % 10 {
            0 => h.sink.plan([Answer::Fail]),
            1 => h.sink.plan([Answer::Hang]),
            2 => h.sink.plan([Answer::DuplicateAll]),
            3 => h.sink.plan([Answer::RejectFirst]),
            _ => {}
        }
        let count = u128::from(roll % 4);
        h.record(next_id..next_id + count);
        next_id += count;
        sleep(ms(roll % 130)).await;
        assert_accounted(&h.stats(), h.recorded);
    }
    let report = h.writer.shutdown().await;
    let stats = report.stats;
    assert_eq!(
        (report.lost, stats.lost, stats.queued, stats.in_flight),
        (0, 0, 0, 0)
    );
    assert!(stats.storage_errors > 0 && stats.ingest_timeouts > 0 && stats.rejected > 0);
    assert_eq!(
        stats.accepted + stats.duplicate + stats.rejected,
        h.recorded
    );
    assert_accounted(&stats, h.recorded);
    assert_eq!(
        h.sink.answered(),
        ids(0..next_id),
        "I21: one answer each, in order (one stripe keeps recording order)"
    );
}

/// Dropping the handle without shutdown aborts the task: nothing more
/// reaches the sink however long we wait, and the queue refuses new permits.
#[tokio::test(start_paused = true)]
async fn dropping_the_writer_without_shutdown_aborts_the_task() {
    let mut h = Harness::new(ScriptedSink::new([]));
    h.record(0..4);
    sleep(ms(1)).await;
    assert_eq!(h.sink.received(), vec![ids(0..4)]);
    h.record(4..6);
    let Harness {
        sink,
        recorder,
        writer,
        ..
    } = h;
    drop(writer);
    sleep(FLUSH * 20).await;
    assert_eq!(
        sink.received(),
        vec![ids(0..4)],
        "the aborted task delivers nothing more"
    );
    assert_eq!(recorder.queued(), 2);
    assert_eq!(recorder.try_permit().unwrap_err(), DenyReason::ShuttingDown);
}

/// I17: an invalid configuration is refused before anything starts.
#[tokio::test(start_paused = true)]
async fn spawning_with_an_invalid_configuration_starts_nothing() {
    let sink = ScriptedSink::new([]);
    let clock = Arc::new(ManualClock::new(start()));
    let broken = UsageWriterConfig {
        max_batch: 0,
        ..config()
    };
    let refused = UsageWriter::spawn(sink, clock, broken).unwrap_err();
    assert_eq!(refused, UsageWriterConfigError::MaxBatchZero);
}

/// I17: a queue too large to allocate is refused by name. Without the
/// bound, `spawn` allocated every place up front and the failed allocation
/// aborted the process.
#[tokio::test(start_paused = true)]
async fn spawning_with_a_hostile_queue_capacity_is_refused_not_aborted() {
    let sink = ScriptedSink::new([]);
    let clock = Arc::new(ManualClock::new(start()));
    let hostile = UsageWriterConfig {
        queue_capacity: usize::MAX,
        max_batch: usize::MAX,
        ..config()
    };
    let refused = UsageWriter::spawn(sink, clock, hostile).unwrap_err();
    assert_eq!(refused, UsageWriterConfigError::QueueCapacityAboveMax);
}

/// I17: `validate` names the first broken rule, in field order.
/// I17: the timer keeps whole milliseconds; one is enough for each wait.
#[test]
fn a_millisecond_is_enough_for_every_wait() {
    let a_milli = Duration::from_millis(1);
    let config = UsageWriterConfig {
        flush_interval: a_milli,
        retry_backoff: a_milli,
        ingest_timeout: a_milli,
        ..config()
    };
    assert_eq!(config.validate(), Ok(()));
}

#[test]
fn validate_names_the_first_broken_rule_in_field_order() {
    use UsageWriterConfigError as Broken;

    #[track_caller]
    fn check(edit: impl FnOnce(&mut UsageWriterConfig), expected: Option<(Broken, &str)>) {
        let mut config = config();
        edit(&mut config);
        let got = config.validate();
        match expected {
            None => assert_eq!(got, Ok(())),
            Some((broken, message)) => {
                assert_eq!(got, Err(broken));
                assert_eq!(broken.to_string(), message);
            }
        }
    }

    check(|_| {}, None);
    check(|c| c.max_batch = c.queue_capacity, None);
    check(
        |c| c.queue_capacity = 0,
        Some((
            Broken::QueueCapacityZero,
            "usage writer: queue_capacity must be positive",
        )),
    );
    check(|c| c.queue_capacity = UsageRecorder::MAX_CAPACITY, None);
    check(
        |c| c.queue_capacity = UsageRecorder::MAX_CAPACITY + 1,
        Some((
            Broken::QueueCapacityAboveMax,
            "usage writer: queue_capacity must be at most 4194304",
        )),
    );
    check(
        |c| c.max_batch = 0,
        Some((
            Broken::MaxBatchZero,
            "usage writer: max_batch must be positive",
        )),
    );
    check(
        |c| c.max_batch = c.queue_capacity + 1,
        Some((
            Broken::MaxBatchAboveQueueCapacity,
            "usage writer: max_batch must not exceed queue_capacity",
        )),
    );
    check(
        |c| c.flush_interval = Duration::from_micros(999),
        Some((
            Broken::FlushIntervalBelowTimerResolution,
            "usage writer: flush_interval must be at least one millisecond (the timer's resolution)",
        )),
    );
    check(
        |c| c.retry_backoff = Duration::from_micros(999),
        Some((
            Broken::RetryBackoffBelowTimerResolution,
            "usage writer: retry_backoff must be at least one millisecond (the timer's resolution)",
        )),
    );
    check(
        |c| c.ingest_timeout = Duration::from_micros(999),
        Some((
            Broken::IngestTimeoutBelowTimerResolution,
            "usage writer: ingest_timeout must be at least one millisecond (the timer's resolution)",
        )),
    );
    check(
        |c| c.shutdown_drain_deadline = Duration::ZERO,
        Some((
            Broken::ShutdownDrainDeadlineZero,
            "usage writer: shutdown_drain_deadline must be positive",
        )),
    );
    check(
        |c| {
            c.queue_capacity = 0;
            c.max_batch = 0;
            c.shutdown_drain_deadline = Duration::ZERO;
        },
        Some((
            Broken::QueueCapacityZero,
            "usage writer: queue_capacity must be positive",
        )),
    );
    check(
        |c| {
            c.max_batch = c.queue_capacity + 1;
            c.flush_interval = Duration::ZERO;
        },
        Some((
            Broken::MaxBatchAboveQueueCapacity,
            "usage writer: max_batch must not exceed queue_capacity",
        )),
    );
}
