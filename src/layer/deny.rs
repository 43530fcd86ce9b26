//! Turning a [`DenyReason`] into an HTTP response.

use std::fmt::Write as _;

use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Response, StatusCode};
use jiff::Timestamp;
use jiff::fmt::rfc2822::DateTimePrinter;

use super::body::DenyBody;
use crate::{DenyReason, RequestId, Retry};

/// Renders a denial as a response.
///
/// The layer adds the `x-tollgate-request-id` header itself when
/// `request_id` is known, so a renderer need not.
pub trait DenyRenderer: Send + Sync + 'static {
    /// The response for `reason`. `request_id` is `Some` once the caller's
    /// key was identified: a denial at admission after the lookup, or a
    /// refused commit.
    fn render(&self, reason: DenyReason, request_id: Option<RequestId>) -> Response<DenyBody>;
}

impl<F> DenyRenderer for F
where
    F: Fn(DenyReason, Option<RequestId>) -> Response<DenyBody> + Send + Sync + 'static,
{
    fn render(&self, reason: DenyReason, request_id: Option<RequestId>) -> Response<DenyBody> {
        self(reason, request_id)
    }
}

/// The default [`DenyRenderer`]: an RFC 9457 `application/problem+json`
/// document.
///
/// The document's `type` is `about:blank`, so its `title` is the status's
/// reason phrase (RFC 9457 §4.2.1); the reason itself is in the extension
/// member `code` ([`DenyReason::code`]), and `detail` is its `Display`
/// text. `request_id` is added when known. The status is [`deny_status`];
/// the headers follow it:
///
/// - 401: `WWW-Authenticate: Bearer realm="tollgate"`;
/// - 402: `Cache-Control: no-store`, and `Retry-After` as an HTTP-date when
///   the balance refills at a known instant ([`Retry::At`]);
/// - 429 and 503: `Retry-After: 1`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProblemJson;

impl DenyRenderer for ProblemJson {
    fn render(&self, reason: DenyReason, request_id: Option<RequestId>) -> Response<DenyBody> {
        let status = deny_status(reason);
        let mut response =
            Response::new(DenyBody::new(problem_document(status, reason, request_id)));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        match status {
            StatusCode::UNAUTHORIZED => {
                headers.insert(
                    WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"tollgate\""),
                );
            }
            StatusCode::PAYMENT_REQUIRED => {
                headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
                if let Some(date) = retry_date(reason) {
                    headers.insert(RETRY_AFTER, date);
                }
            }
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                headers.insert(RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        response
    }
}

/// The status each denial is answered with: the one table every renderer
/// should follow.
///
/// - 401 Unauthorized: no usable key (missing, malformed, unknown, revoked);
/// - 403 Forbidden: the key lacks a permission, or its account is inactive;
/// - 402 Payment Required: the balance, or the overage cap, is spent;
/// - 429 Too Many Requests: a momentary shortage a retry soon will clear;
/// - 503 Service Unavailable: the instance fails closed (I5) because it
///   cannot vouch for the funding right now.
pub const fn deny_status(reason: DenyReason) -> StatusCode {
    match reason {
        DenyReason::MissingCredential
        | DenyReason::MalformedCredential
        | DenyReason::UnknownPrincipal
        | DenyReason::KeyRevoked => StatusCode::UNAUTHORIZED,
        DenyReason::PermissionDenied { .. } | DenyReason::AccountInactive => StatusCode::FORBIDDEN,
        DenyReason::BalanceExhausted { .. }
        | DenyReason::BalanceInsufficient { .. }
        | DenyReason::OverageCapExhausted { .. } => StatusCode::PAYMENT_REQUIRED,
        DenyReason::LeaseExhausted
        | DenyReason::LeaseExpired
        | DenyReason::OverageCapTemporarilyExhausted { .. }
        | DenyReason::OverageCommitInProgress { .. } => StatusCode::TOO_MANY_REQUESTS,
        DenyReason::LeaseUnavailable
        | DenyReason::SnapshotUnavailable
        | DenyReason::SnapshotStale
        | DenyReason::AccountingBackpressure
        | DenyReason::FundingExpiredAtStart
        | DenyReason::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The `Retry-After` HTTP-date (RFC 9110 IMF-fixdate) for a reason that
/// names the instant the balance refills.
fn retry_date(reason: DenyReason) -> Option<HeaderValue> {
    let Retry::At(at) = reason.retry() else {
        return None;
    };
    // An HTTP-date has whole seconds: the refill's instant rounded down
    // would name a second before it, and a client that obeys would come
    // back too early and be refused again. Rounded up, it never is.
    let at = if at.subsec_nanosecond() > 0 {
        Timestamp::from_second(at.as_second().checked_add(1)?).ok()?
    } else {
        at
    };
    let date = DateTimePrinter::new()
        .timestamp_to_rfc9110_string(&at)
        .ok()?;
    HeaderValue::from_str(&date).ok()
}

fn problem_document(
    status: StatusCode,
    reason: DenyReason,
    request_id: Option<RequestId>,
) -> String {
    let mut json = String::with_capacity(256);
    json.push_str("{\"type\":\"about:blank\",\"title\":");
    push_json_string(&mut json, status.canonical_reason().unwrap_or("Error"));
    let _ = write!(json, ",\"status\":{},\"detail\":", status.as_u16());
    push_json_string(&mut json, &reason.to_string());
    json.push_str(",\"code\":");
    push_json_string(&mut json, reason.code());
    if let Some(request_id) = request_id {
        json.push_str(",\"request_id\":");
        push_json_string(&mut json, &request_id.to_string());
    }
    json.push('}');
    json
}

/// Appends `text` as a JSON string literal (RFC 8259 §7).
fn push_json_string(json: &mut String, text: &str) {
    json.push('"');
    for ch in text.chars() {
        match ch {
            '"' => json.push_str("\\\""),
            '\\' => json.push_str("\\\\"),
            '\n' => json.push_str("\\n"),
            '\r' => json.push_str("\\r"),
            '\t' => json.push_str("\\t"),
            ch if u32::from(ch) < 0x20 => {
                let _ = write!(json, "\\u{:04x}", u32::from(ch));
            }
            ch => json.push(ch),
        }
    }
    json.push('"');
}

#[cfg(test)]
mod tests {
    use jiff::SignedDuration;

    use super::*;

    #[test]
    fn json_strings_escape_quotes_backslashes_and_controls() {
        let mut json = String::new();
        push_json_string(&mut json, "a\"b\\c\nd\u{1}é");
        assert_eq!(json, "\"a\\\"b\\\\c\\nd\\u0001é\"");
    }

    #[test]
    fn an_exhausted_balance_with_a_period_end_says_when_as_an_http_date() {
        let at = Timestamp::from_second(784_111_777).unwrap();
        let response = ProblemJson.render(
            DenyReason::BalanceExhausted {
                period_end: Some(at),
            },
            None,
        );
        assert_eq!(response.status(), StatusCode::PAYMENT_REQUIRED);
        assert_eq!(
            response.headers()[RETRY_AFTER],
            "Sun, 06 Nov 1994 08:49:37 GMT"
        );
        assert_eq!(response.headers()[CACHE_CONTROL], "no-store");
        // A period end inside a second is named by the second after it,
        // never by one before the refill.
        let inside = ProblemJson.render(
            DenyReason::BalanceExhausted {
                period_end: Some(at + SignedDuration::from_millis(969)),
            },
            None,
        );
        assert_eq!(
            inside.headers()[RETRY_AFTER],
            "Sun, 06 Nov 1994 08:49:38 GMT"
        );
    }

    /// I12: the codes, statuses and retry classes callers and dashboards
    /// depend on, written out rather than derived, so renaming a code or
    /// moving a reason to another status fails here.
    #[test]
    fn every_reason_keeps_its_published_code_status_and_retry_class() {
        use crate::CostUnits;
        use StatusCode as S;

        #[track_caller]
        fn check(reason: DenyReason, code: &str, status: StatusCode, retry: Retry) {
            assert_eq!(reason.code(), code, "{reason:?}");
            assert_eq!(deny_status(reason), status, "{reason:?}");
            assert_eq!(reason.retry(), retry, "{reason:?}");
        }

        let never = Retry::Never;
        let soon = Retry::Transient;
        let table = [
            ("missing_credential", S::UNAUTHORIZED, never),
            ("malformed_credential", S::UNAUTHORIZED, never),
            ("unknown_principal", S::UNAUTHORIZED, never),
            ("key_revoked", S::UNAUTHORIZED, never),
            ("account_inactive", S::FORBIDDEN, never),
            ("permission_denied", S::FORBIDDEN, never),
            ("snapshot_unavailable", S::SERVICE_UNAVAILABLE, soon),
            ("snapshot_stale", S::SERVICE_UNAVAILABLE, soon),
            ("lease_unavailable", S::SERVICE_UNAVAILABLE, soon),
            ("lease_exhausted", S::TOO_MANY_REQUESTS, soon),
            ("lease_expired", S::TOO_MANY_REQUESTS, soon),
            ("funding_expired_at_start", S::SERVICE_UNAVAILABLE, soon),
            // The period end is unknown in `ALL`'s placeholders.
            ("balance_exhausted", S::PAYMENT_REQUIRED, never),
            ("balance_insufficient", S::PAYMENT_REQUIRED, never),
            ("overage_cap_exhausted", S::PAYMENT_REQUIRED, never),
            (
                "overage_cap_temporarily_exhausted",
                S::TOO_MANY_REQUESTS,
                soon,
            ),
            (
                "overage_commit_in_progress",
                S::TOO_MANY_REQUESTS,
                Retry::AfterInFlight,
            ),
            ("accounting_backpressure", S::SERVICE_UNAVAILABLE, soon),
            ("shutting_down", S::SERVICE_UNAVAILABLE, soon),
        ];
        assert_eq!(table.len(), DenyReason::ALL.len());
        for (reason, (code, status, retry)) in DenyReason::ALL.into_iter().zip(table) {
            check(reason, code, status, retry);
        }
        // A known period end makes the balance denials retryable at it.
        let at = Timestamp::from_second(1_000).unwrap();
        check(
            DenyReason::BalanceExhausted {
                period_end: Some(at),
            },
            "balance_exhausted",
            S::PAYMENT_REQUIRED,
            Retry::At(at),
        );
        check(
            DenyReason::BalanceInsufficient {
                remaining: CostUnits(3),
                period_end: Some(at),
            },
            "balance_insufficient",
            S::PAYMENT_REQUIRED,
            Retry::At(at),
        );
    }

    #[test]
    fn every_reason_renders_a_problem_document_with_its_code_and_status() {
        for reason in DenyReason::ALL {
            let response = ProblemJson.render(reason, Some(RequestId(7)));
            let body = String::from_utf8(response.body().as_bytes().to_vec()).unwrap();
            let status = response.status();
            assert_eq!(status, deny_status(reason));
            assert!(
                body.contains(&format!("\"code\":\"{}\"", reason.code())),
                "{body}"
            );
            assert!(body.contains(&format!("\"status\":{}", status.as_u16())));
            assert!(body.contains("\"request_id\":\"req_00000000000000000000000000000007\""));
            assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
        }
    }
}
