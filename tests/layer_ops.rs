//! The ops router over a real runtime on the memory store: liveness,
//! readiness that follows the runtime through start and shutdown, and
//! Prometheus metrics that carry the runtime's exact counts.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use jiff::{SignedDuration, Timestamp};
use metrics_exporter_prometheus::PrometheusBuilder;
use tollgate::layer::ops_router;
use tollgate::runtime::{InstanceRuntime, InstanceRuntimeConfig, RuntimeHandle};
use tollgate::store::{
    AccountSpec, AllocateError, Clock, GrantPolicy, IssuedKey, ManualClock, MemoryStore,
    TailSharing,
};
use tollgate::{AccountStatus, CostUnits, DenyReason, EnforcementMode, KeyHash, PermissionBits};
use tower::ServiceExt;

const LEASE_TTL: SignedDuration = SignedDuration::from_secs(60);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn config() -> InstanceRuntimeConfig {
    support::runtime::config(support::runtime::Pace::Paused)
}

struct World {
    clock: Arc<ManualClock>,
    runtime: InstanceRuntime,
    handle: RuntimeHandle,
    issued: IssuedKey,
}

fn world() -> World {
    let start = Timestamp::from_second(1_700_000_000).unwrap();
    let clock = Arc::new(ManualClock::new(start));
    let store = Arc::new(
        MemoryStore::new(GrantPolicy {
            max_ttl: LEASE_TTL,
            reclaim_grace: SignedDuration::from_secs(10),
            tail: TailSharing {
                instances: 1,
                min_grant: CostUnits(1),
            },
        })
        .unwrap(),
    );
    let account = store
        .create_account(
            AccountSpec {
                balance: CostUnits(10_000),
                mode: EnforcementMode::Strict,
                status: AccountStatus::Active,
                refill: None,
            },
            start,
        )
        .unwrap();
    let issued = store
        .issue_key(account, PermissionBits::ALL, start)
        .unwrap();
    let (runtime, handle) = InstanceRuntime::spawn(
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        Arc::clone(&store) as _,
        Arc::clone(&clock) as Arc<dyn Clock>,
        config(),
    )
    .unwrap();
    World {
        clock,
        runtime,
        handle,
        issued,
    }
}

struct Answer {
    status: StatusCode,
    content_type: String,
    body: String,
}

async fn get(router: &Router, path: &str) -> Answer {
    let response = router
        .clone()
        .oneshot(Request::get(path).body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|value| value.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        content_type,
        body: String::from_utf8(bytes.to_vec()).unwrap(),
    }
}

/// Parses Prometheus text: every line is a comment, blank, or
/// `name{labels} value` / `name value` with a numeric value. Returns each
/// series (name with its label set, as written) and its value.
fn parse_prometheus(text: &str) -> BTreeMap<String, f64> {
    let mut series = BTreeMap::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value on line {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("value is not a number on line {line:?}"));
        let name = key.split('{').next().unwrap();
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name on line {line:?}"
        );
        if let Some(labels) = key.strip_prefix(name) {
            assert!(
                labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')),
                "bad labels on line {line:?}"
            );
        }
        assert!(
            series.insert(key.to_owned(), value).is_none(),
            "series {key} appears twice"
        );
    }
    series
}

#[track_caller]
fn check_series(series: &BTreeMap<String, f64>, key: &str, expected: f64) {
    assert_eq!(
        series.get(key).copied(),
        Some(expected),
        "series {key} in {series:#?}"
    );
}

fn readiness(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|error| panic!("{error}: {body}"))
}

#[tokio::test(start_paused = true)]
async fn liveness_answers_ok_even_before_the_runtime_is_ready() {
    let w = world();
    let router = ops_router(w.handle.clone(), String::new);
    assert!(!w.handle.readiness(), "nothing has loaded yet");
    let answer = get(&router, "/livez").await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(
        !w.handle.readiness(),
        "still not ready when liveness answered"
    );
    assert_eq!(answer.body, "ok");
    drop(w.runtime.shutdown().await);
}

#[tokio::test(start_paused = true)]
async fn readiness_follows_the_runtime_from_start_through_shutdown() {
    let w = world();
    let router = ops_router(w.handle.clone(), String::new);

    let before = get(&router, "/readyz").await;
    assert_eq!(before.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(before.content_type, "application/json");
    let report = readiness(&before.body);
    assert_eq!(report["ready"], false);

    tokio::time::sleep(ms(200)).await;
    let ready = get(&router, "/readyz").await;
    assert_eq!(ready.status, StatusCode::OK, "{}", ready.body);
    let report = readiness(&ready.body);
    assert_eq!(report["ready"], true);
    assert_eq!(report["admitting"], true);
    assert_eq!(report["faulted"], false);
    assert_eq!(report["writer"]["health"], "healthy");
    assert_eq!(report["accounts"], 1);
    assert_eq!(report["unserved_accounts"], 0);
    assert_eq!(report["first_unserved"], serde_json::json!([]));
    assert_eq!(report["manager_restarts"], 0);
    let last_success: Timestamp = report["snapshots"]["last_success"]
        .as_str()
        .expect("a refresh has completed")
        .parse()
        .unwrap();
    assert!(last_success <= w.clock.now());

    w.handle.request_shutdown();
    let stopping = get(&router, "/readyz").await;
    assert_eq!(stopping.status, StatusCode::SERVICE_UNAVAILABLE);
    let report = readiness(&stopping.body);
    assert_eq!(report["ready"], false);
    assert_eq!(report["admitting"], false);
    drop(w.runtime.shutdown().await);
}

#[tokio::test(start_paused = true)]
async fn metrics_publish_the_exact_admission_counts_as_prometheus_text() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let prometheus = recorder.handle();
    // The test runtime is single-threaded, so the handlers run on this
    // thread and see the local recorder.
    let _guard = metrics::set_default_local_recorder(&recorder);

    let w = world();
    let router = ops_router(w.handle.clone(), move || prometheus.render());
    tokio::time::sleep(ms(200)).await;
    assert!(w.handle.readiness());

    let key = KeyHash::of(w.issued.key.expose().as_bytes());
    let unknown = KeyHash::of(b"tg_not-a-key-anyone-was-given");
    let mut admitted = 0_u64;
    let mut denied: BTreeMap<&'static str, u64> = BTreeMap::new();
    let attempts = [
        (key, CostUnits(3)),
        (key, CostUnits(4)),
        (unknown, CostUnits(1)),
        (key, CostUnits(1_000_000)),
        (key, CostUnits(5)),
    ];
    for (hash, quote) in attempts {
        match w
            .handle
            .begin_by_key(&hash, PermissionBits::NONE, quote, w.clock.now())
        {
            Ok(mut context) => {
                context.commit(w.clock.now()).unwrap();
                admitted += 1;
            }
            Err(reason) => *denied.entry(reason.code()).or_default() += 1,
        }
    }
    assert_eq!(admitted, 3, "three funded quotes on a known key");
    // The unknown key, and the quote past the lease before the allocator
    // has said anything of the balance (a transient refusal, I23).
    assert_eq!(
        denied,
        BTreeMap::from([("lease_exhausted", 1), ("unknown_principal", 1)])
    );

    let answer = get(&router, "/metrics").await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(
        answer.content_type.starts_with("text/plain; version=0.0.4"),
        "{}",
        answer.content_type
    );
    let series = parse_prometheus(&answer.body);

    #[allow(clippy::cast_precision_loss, reason = "small test counts")]
    let count = |n: u64| n as f64;
    check_series(&series, "tollgate_admitted_total", count(admitted));
    check_series(&series, "tollgate_admitted_overage_total", 0.0);
    check_series(&series, "tollgate_released_total", 0.0);
    check_series(&series, "tollgate_lease_waits_total", 0.0);
    for reason in DenyReason::ALL {
        let code = reason.code();
        let expected = denied.get(code).copied().unwrap_or(0);
        check_series(
            &series,
            &format!("tollgate_denied_total{{code=\"{code}\"}}"),
            count(expected),
        );
    }
    for name in AllocateError::NAMES {
        check_series(
            &series,
            &format!("tollgate_lease_refused_total{{reason=\"{name}\"}}"),
            0.0,
        );
    }
    check_series(&series, "tollgate_ready", 1.0);
    check_series(&series, "tollgate_faulted", 0.0);
    check_series(&series, "tollgate_accounts", 1.0);
    check_series(&series, "tollgate_writer_state{state=\"healthy\"}", 1.0);
    check_series(&series, "tollgate_writer_state{state=\"stopped\"}", 0.0);
    check_series(&series, "tollgate_manager_restarts_total", 0.0);
    check_series(&series, "tollgate_unrecovered_grants_total", 0.0);
    check_series(&series, "tollgate_usage_places_reserved", 0.0);
    assert!(
        series["tollgate_lease_acquired_total"] >= 1.0,
        "the account holds a lease"
    );
    assert!(
        series.keys().all(|key| key.starts_with("tollgate_")),
        "only tollgate series"
    );
    for key in series.keys() {
        if let Some((_, labels)) = key.split_once('{') {
            let label = labels.split('=').next().unwrap();
            assert!(
                ["code", "reason", "state"].contains(&label),
                "only bounded labels, not {key}"
            );
        }
    }

    // Usage reaches the sink and the next scrape says so.
    tokio::time::sleep(ms(200)).await;
    let later = parse_prometheus(&get(&router, "/metrics").await.body);
    check_series(&later, "tollgate_writer_accepted_total", count(admitted));

    w.handle.request_shutdown();
    let stopping = parse_prometheus(&get(&router, "/metrics").await.body);
    check_series(&stopping, "tollgate_ready", 0.0);
    check_series(&stopping, "tollgate_admitting", 0.0);
    drop(w.runtime.shutdown().await);
}
