//! The ops surface: liveness, readiness and Prometheus-format metrics.
//!
//! The library depends only on the [`metrics`] facade, never on an
//! exporter, so it cannot render Prometheus text by itself. The caller
//! installs a recorder (for example `metrics-exporter-prometheus`) and hands
//! [`ops_router`] a function that renders it; on every scrape the router
//! first publishes the current [`RuntimeReport`] into the facade
//! ([`publish_metrics`]) and then returns what that function renders.
//!
//! Every label is drawn from a fixed set (deny reason codes, allocator
//! refusal names, writer states): no account id, key or request id ever
//! becomes a label, so the number of series is bounded whatever the traffic.

use std::fmt::Write as _;
use std::sync::{Mutex, PoisonError};

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use jiff::Timestamp;

use crate::model::DenyReason;
use crate::runtime::{LeaseStats, ReclaimStats, RuntimeHandle, RuntimeReport, WriterHealth};
use crate::store::AllocateError;

/// The content type of the Prometheus text exposition format.
const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// An axum router serving the instance's ops endpoints:
///
/// - `GET /livez`: `200 ok` whenever the process can answer at all.
/// - `GET /readyz`: `200` when the instance should receive traffic
///   ([`RuntimeHandle::readiness`]), `503` otherwise; the body is a small
///   JSON object describing the readiness report:
///
///   ```json
///   {"ready":true,"admitting":true,"faulted":false,
///    "writer":{"health":"healthy"},
///    "snapshots":{"last_success":"2023-11-14T22:13:20Z"},
///    "accounts":1,"unserved_accounts":0,"first_unserved":[],
///    "manager_restarts":0}
///   ```
///
///   `writer.health` is `healthy`, `stopped`, or `retrying` with `since`
///   and `attempts`; `snapshots.last_success` is `null` until a refresh
///   completes; `unserved_accounts` counts the accounts that keep the
///   instance unready for want of a lease, and `first_unserved` names the
///   first five of them by id.
/// - `GET /metrics`: publishes the current report through the [`metrics`]
///   facade ([`publish_metrics`]) and answers with `render()`, as
///   `text/plain; version=0.0.4`.
///
/// `render` produces the Prometheus exposition text of the recorder the
/// caller installed; with `metrics-exporter-prometheus` that is
/// `move || prometheus_handle.render()`. It runs on the async executor, so
/// it should not block for long.
///
/// ```no_run
/// # async fn serve(handle: tollgate::runtime::RuntimeHandle) -> std::io::Result<()> {
/// use metrics_exporter_prometheus::PrometheusBuilder;
///
/// let recorder = PrometheusBuilder::new().build_recorder();
/// let prometheus = recorder.handle();
/// metrics::set_global_recorder(recorder).expect("no other recorder is installed");
///
/// let ops = tollgate::layer::ops_router(handle, move || prometheus.render());
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:9090").await?;
/// axum::serve(listener, ops).await
/// # }
/// ```
///
/// Mount it on a separate listener (or behind an auth layer): it reports
/// operational state, not anything about callers, but it is not meant for
/// the public.
pub fn ops_router<R>(handle: RuntimeHandle, render: R) -> Router
where
    R: Fn() -> String + Clone + Send + Sync + 'static,
{
    let ready_handle = handle.clone();
    Router::new()
        .route("/livez", get(|| std::future::ready("ok")))
        .route(
            "/readyz",
            get(move || std::future::ready(readyz(&ready_handle))),
        )
        .route(
            "/metrics",
            get(move || std::future::ready(metrics_text(&handle, &render))),
        )
}

/// Publishes every counter and level of `report` through the [`metrics`]
/// facade, to whatever recorder is installed. Call it at scrape time;
/// [`ops_router`]'s `/metrics` does, one scrape at a time. A caller that
/// publishes from several tasks serializes its publish-and-render the same
/// way: two publishes at once leave the recorder with some of each.
///
/// Monotonic counts become counters set with `absolute` and named
/// `tollgate_..._total`; levels become gauges:
///
/// | metric | kind | labels |
/// |---|---|---|
/// | `tollgate_ready`, `tollgate_admitting`, `tollgate_faulted` | gauge 0/1 | |
/// | `tollgate_accounts` | gauge | |
/// | `tollgate_admitted_total`, `tollgate_admitted_overage_total`, `tollgate_released_total` (admitted, then released for zero: ended before the handler started or, committing in the handler, answered without reaching its commit point; a commit the instance refused counts under `tollgate_denied_total` with its code instead) | counter | |
/// | `tollgate_lease_waits_total` (requests held for a lease by [`wait_for_lease`](crate::layer::TollgateBuilder::wait_for_lease), counted as each wait begins) | counter | |
/// | `tollgate_denied_total` | counter | `code` ([`DenyReason::code`]) |
/// | `tollgate_writer_{accepted,duplicate,rejected,lost,batches,retries,ingest_timeouts,storage_errors}_total` | counter | |
/// | `tollgate_writer_queued`, `tollgate_writer_in_flight` | gauge | |
/// | `tollgate_usage_places_reserved` (held by requests admitted and not yet started) | gauge | |
/// | `tollgate_writer_state` | gauge 0/1 | `state` (`healthy`, `retrying`, `stopped`) |
/// | `tollgate_writer_retry_attempts` | gauge | |
/// | `tollgate_snapshot_{refreshes,failures,timeouts,published,unknown,lookups}_total` | counter | |
/// | `tollgate_snapshot_last_success_timestamp_seconds` | gauge | |
/// | `tollgate_lease_{acquired,acquired_units,acquire_timeouts,uncertain_acquires,released,released_units,release_timeouts,abandoned,consolidated,consolidations_deferred}_total` | counter | |
/// | `tollgate_lease_refused_total`, `tollgate_lease_release_refused_total` | counter | `reason` ([`AllocateError::NAMES`]) |
/// | `tollgate_reclaim_{passes,held,reclaimed_leases,reclaimed_units,errors,timeouts}_total` | counter | |
/// | `tollgate_reclaim_blocked_leases` | gauge | |
/// | `tollgate_manager_restarts_total` | counter | |
/// | `tollgate_unrecovered_grants_total` (leases held by managers that died, left to TTL reclaim) | counter | |
///
/// Every deny reason and every refusal name has its own series from the
/// first scrape, at zero until it happens. When the lease sum overflowed
/// (`report.leases` is `None`) the lease series keep their last values, and
/// the reclaim series appear only on instances that run a reclaimer. The
/// hottest accounts are not published: their ids would be unbounded labels.
///
/// A counter set with `absolute` never goes back in the exporters the
/// `metrics` ecosystem ships (they keep the largest value set): publish one
/// runtime per recorder. A runtime started in place of another in the same
/// process counts from zero, and its `_total` series stand still until they
/// pass the first runtime's, as if nothing happened meanwhile: restart the
/// process with the runtime.
pub fn publish_metrics(report: &RuntimeReport) {
    flag("tollgate_ready", report.ready);
    flag("tollgate_admitting", report.admitting);
    flag("tollgate_faulted", report.faulted);
    level(
        "tollgate_accounts",
        u64::try_from(report.accounts).unwrap_or(u64::MAX),
    );
    metrics::counter!("tollgate_manager_restarts_total").absolute(report.manager_restarts);
    metrics::counter!("tollgate_unrecovered_grants_total").absolute(report.unrecovered_grants);
    publish_admission(report);
    publish_writer(report);
    publish_snapshots(report);
    if let Some(leases) = &report.leases {
        publish_leases(leases);
    }
    if let Some(reclaimer) = &report.reclaimer {
        publish_reclaimer(reclaimer);
    }
}

fn readyz(handle: &RuntimeHandle) -> Response {
    // One reading decides both the status and the body, so they agree.
    let report = handle.report();
    let status = if report.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        readiness_json(&report),
    )
        .into_response()
}

fn metrics_text<R: Fn() -> String>(handle: &RuntimeHandle, render: &R) -> Response {
    // One scrape at a time publishes and renders: two at once (a pair of
    // Prometheus replicas) would interleave their readings in the shared
    // recorder, and a scrape could render one writer state from each, or
    // none at 1. Both steps are quick and never await.
    static SCRAPE: Mutex<()> = Mutex::new(());
    let text = {
        let _one_at_a_time = SCRAPE.lock().unwrap_or_else(PoisonError::into_inner);
        publish_metrics(&handle.report());
        render()
    };
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE),
            (header::CACHE_CONTROL, "no-store"),
        ],
        text,
    )
        .into_response()
}

/// The readiness report as JSON, written by hand: the library carries no
/// serializer for one small object.
fn readiness_json(report: &RuntimeReport) -> String {
    let mut out = String::with_capacity(256);
    let _ = write!(
        out,
        "{{\"ready\":{},\"admitting\":{},\"faulted\":{},\"writer\":{{\"health\":",
        report.ready, report.admitting, report.faulted
    );
    match report.writer_health {
        WriterHealth::Healthy => json_string(&mut out, "healthy"),
        WriterHealth::Stopped => json_string(&mut out, "stopped"),
        WriterHealth::Retrying { since, attempts } => {
            json_string(&mut out, "retrying");
            out.push_str(",\"since\":");
            json_timestamp(&mut out, Some(since));
            let _ = write!(out, ",\"attempts\":{attempts}");
        }
    }
    out.push_str("},\"snapshots\":{\"last_success\":");
    json_timestamp(&mut out, report.snapshots.last_success);
    let _ = write!(
        out,
        "}},\"accounts\":{},\"unserved_accounts\":{},\"first_unserved\":[",
        report.accounts, report.unserved_count
    );
    for (index, account) in report.unserved_accounts.iter().enumerate() {
        if index > 0 {
            out.push(',');
        }
        json_string(&mut out, &account.to_string());
    }
    let _ = write!(out, "],\"manager_restarts\":{}}}", report.manager_restarts);
    out
}

fn json_timestamp(out: &mut String, at: Option<Timestamp>) {
    match at {
        Some(at) => json_string(out, &at.to_string()),
        None => out.push_str("null"),
    }
}

/// Writes `value` as a JSON string literal (RFC 8259 §7).
fn json_string(out: &mut String, value: &str) {
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c < '\u{20}' => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn publish_admission(report: &RuntimeReport) {
    let admission = &report.admission;
    metrics::counter!("tollgate_admitted_total").absolute(admission.admitted);
    metrics::counter!("tollgate_admitted_overage_total").absolute(admission.admitted_overage);
    metrics::counter!("tollgate_released_total").absolute(admission.released);
    metrics::counter!("tollgate_lease_waits_total").absolute(admission.lease_waits);
    for reason in DenyReason::ALL {
        metrics::counter!("tollgate_denied_total", "code" => reason.code())
            .absolute(admission.denied_for(reason));
    }
}

fn publish_writer(report: &RuntimeReport) {
    let writer = &report.writer;
    metrics::counter!("tollgate_writer_accepted_total").absolute(writer.accepted);
    metrics::counter!("tollgate_writer_duplicate_total").absolute(writer.duplicate);
    metrics::counter!("tollgate_writer_rejected_total").absolute(writer.rejected);
    metrics::counter!("tollgate_writer_lost_total").absolute(writer.lost);
    metrics::counter!("tollgate_writer_batches_total").absolute(writer.batches);
    metrics::counter!("tollgate_writer_retries_total").absolute(writer.retries);
    metrics::counter!("tollgate_writer_ingest_timeouts_total").absolute(writer.ingest_timeouts);
    metrics::counter!("tollgate_writer_storage_errors_total").absolute(writer.storage_errors);
    level("tollgate_writer_queued", writer.queued);
    level("tollgate_writer_in_flight", writer.in_flight);
    level(
        "tollgate_usage_places_reserved",
        report.usage_places_reserved,
    );
    let (state, attempts) = match report.writer_health {
        WriterHealth::Healthy => ("healthy", 0),
        WriterHealth::Retrying { attempts, .. } => ("retrying", attempts),
        WriterHealth::Stopped => ("stopped", 0),
    };
    // One series per state, exactly one of them at 1, so a dashboard can
    // alert on `tollgate_writer_state{state="stopped"} == 1`.
    for candidate in ["healthy", "retrying", "stopped"] {
        metrics::gauge!("tollgate_writer_state", "state" => candidate).set(if candidate == state {
            1.0
        } else {
            0.0
        });
    }
    level("tollgate_writer_retry_attempts", attempts);
}

fn publish_snapshots(report: &RuntimeReport) {
    let snapshots = &report.snapshots;
    metrics::counter!("tollgate_snapshot_refreshes_total").absolute(snapshots.refreshes);
    metrics::counter!("tollgate_snapshot_failures_total").absolute(snapshots.failures);
    metrics::counter!("tollgate_snapshot_timeouts_total").absolute(snapshots.timeouts);
    metrics::counter!("tollgate_snapshot_published_total").absolute(snapshots.published);
    metrics::counter!("tollgate_snapshot_unknown_total").absolute(snapshots.unknown);
    metrics::counter!("tollgate_snapshot_lookups_total").absolute(snapshots.lookups);
    if let Some(at) = snapshots.last_success {
        metrics::gauge!("tollgate_snapshot_last_success_timestamp_seconds")
            .set(seconds_since_epoch(at));
    }
}

fn publish_leases(leases: &LeaseStats) {
    metrics::counter!("tollgate_lease_acquired_total").absolute(leases.acquired);
    metrics::counter!("tollgate_lease_acquired_units_total").absolute(leases.acquired_units);
    metrics::counter!("tollgate_lease_acquire_timeouts_total").absolute(leases.acquire_timeouts);
    metrics::counter!("tollgate_lease_uncertain_acquires_total")
        .absolute(leases.uncertain_acquires);
    metrics::counter!("tollgate_lease_released_total").absolute(leases.released);
    metrics::counter!("tollgate_lease_released_units_total").absolute(leases.released_units);
    metrics::counter!("tollgate_lease_release_timeouts_total").absolute(leases.release_timeouts);
    metrics::counter!("tollgate_lease_abandoned_total").absolute(leases.abandoned);
    metrics::counter!("tollgate_lease_consolidated_total").absolute(leases.consolidated);
    metrics::counter!("tollgate_lease_consolidations_deferred_total")
        .absolute(leases.consolidations_deferred);
    for (name, (refused, release_refused)) in AllocateError::NAMES
        .iter()
        .zip(leases.refused.iter().zip(&leases.release_refused))
    {
        metrics::counter!("tollgate_lease_refused_total", "reason" => *name).absolute(*refused);
        metrics::counter!("tollgate_lease_release_refused_total", "reason" => *name)
            .absolute(*release_refused);
    }
}

fn publish_reclaimer(reclaimer: &ReclaimStats) {
    metrics::counter!("tollgate_reclaim_passes_total").absolute(reclaimer.passes);
    metrics::counter!("tollgate_reclaim_held_total").absolute(reclaimer.held);
    metrics::counter!("tollgate_reclaim_reclaimed_leases_total")
        .absolute(reclaimer.reclaimed_leases);
    metrics::counter!("tollgate_reclaim_reclaimed_units_total").absolute(reclaimer.reclaimed_units);
    metrics::counter!("tollgate_reclaim_errors_total").absolute(reclaimer.errors);
    metrics::counter!("tollgate_reclaim_timeouts_total").absolute(reclaimer.timeouts);
    level("tollgate_reclaim_blocked_leases", reclaimer.blocked_leases);
}

fn flag(name: &'static str, value: bool) {
    metrics::gauge!(name).set(if value { 1.0 } else { 0.0 });
}

#[allow(
    clippy::cast_precision_loss,
    reason = "a gauge is an f64; levels above 2^53 lose only low digits"
)]
fn level(name: &'static str, value: u64) {
    metrics::gauge!(name).set(value as f64);
}

#[allow(
    clippy::cast_precision_loss,
    reason = "milliseconds since 1970 stay far below 2^53"
)]
fn seconds_since_epoch(at: Timestamp) -> f64 {
    at.as_millisecond() as f64 / 1_000.0
}

#[cfg(test)]
mod tests {
    use super::{json_string, readiness_json};
    use crate::AccountId;
    use crate::admission::AdmissionStats;
    use crate::runtime::{RuntimeReport, WriterHealth};

    #[test]
    fn an_unready_report_names_the_accounts_that_keep_it_so() {
        let report = RuntimeReport {
            ready: false,
            admitting: true,
            faulted: false,
            admission: AdmissionStats {
                admitted: 0,
                admitted_overage: 0,
                released: 0,
                lease_waits: 0,
                denied: [0; crate::DenyReason::ALL.len()],
            },
            writer: crate::runtime::WriterStats::default(),
            writer_health: WriterHealth::Healthy,
            snapshots: crate::runtime::SnapshotStats::default(),
            leases: None,
            reclaimer: None,
            accounts: 9,
            manager_restarts: 0,
            unrecovered_grants: 0,
            hottest_accounts: Vec::new(),
            unserved_count: 7,
            unserved_accounts: vec![AccountId(2), AccountId(40)],
            usage_places_reserved: 0,
        };
        let json = readiness_json(&report);
        assert!(
            json.contains(
                "\"accounts\":9,\"unserved_accounts\":7,\"first_unserved\":[\"acct_2\",\"acct_40\"],\"manager_restarts\":0}"
            ),
            "{json}"
        );
    }

    #[test]
    fn json_strings_escape_quotes_backslashes_and_control_characters() {
        let mut out = String::new();
        json_string(&mut out, "a\"b\\c\nd\u{1}é");
        assert_eq!(out, "\"a\\\"b\\\\c\\nd\\u0001é\"");
    }
}
