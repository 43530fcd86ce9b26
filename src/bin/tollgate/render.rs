//! How the command prints what it found: one line per thing, `key=value`
//! pairs after the id, so the output reads well and greps well.

use std::fmt::Write as _;

use jiff::SignedDuration;
use jiff::fmt::friendly::{Spacing, SpanPrinter};
use tollgate::store::{AccountView, BalanceChange, JournalEntry, KeyInfo, SchemaStatus};
use tollgate::{AccountId, AccountStatus, EnforcementMode, KeyStatus, UsageEvent, UsageSource};

pub(crate) fn mode(mode: EnforcementMode) -> String {
    match mode {
        EnforcementMode::Strict => "strict".to_owned(),
        EnforcementMode::Elastic { overage_cap } => {
            format!("elastic overage_cap={}", overage_cap.get())
        }
    }
}

pub(crate) fn account(view: &AccountView) -> String {
    let mut line = format!(
        "{} status={} balance={} leased={} mode={} overage_debt={} settled_unbilled={}",
        view.id,
        match view.status {
            AccountStatus::Active => "active",
            AccountStatus::Suspended => "suspended",
        },
        view.balance.get(),
        view.leased.get(),
        mode(view.mode),
        view.overage_debt.get(),
        view.settled_unbilled.get(),
    );
    if let Some(refill) = view.refill {
        let _ = write!(
            line,
            " refill={}/{}",
            refill.amount.get(),
            duration(refill.interval)
        );
    }
    if let Some(end) = view.period_end {
        let _ = write!(line, " period_end={end}");
    }
    line
}

/// A duration as one word (`1ms500µs`, not `1ms 500µs`), so a value never
/// splits its `key=value` pair; the command's duration flags read it back.
fn duration(duration: SignedDuration) -> String {
    SpanPrinter::new()
        .spacing(Spacing::None)
        .duration_to_string(&duration)
}

pub(crate) fn balance_change(account: AccountId, change: &BalanceChange) -> String {
    if change.applied {
        format!("{account} balance={}", change.balance.get())
    } else {
        format!(
            "{account} balance={} (already applied under this idempotency key; nothing changed)",
            change.balance.get()
        )
    }
}

pub(crate) fn journal_entry(entry: &JournalEntry) -> String {
    let mut line = format!(
        "{} {} {} {:+} balance_after={}",
        entry.seq,
        entry.at,
        entry.kind.label(),
        entry.delta,
        entry.balance_after.get()
    );
    if let Some(lease) = entry.lease_id {
        let _ = write!(line, " lease={lease}");
    }
    if let Some(key) = &entry.idempotency_key {
        let _ = write!(line, " idempotency_key={key:?}");
    }
    if let Some(reason) = &entry.reason {
        let _ = write!(line, " reason={reason:?}");
    }
    line
}

pub(crate) fn key(info: &KeyInfo) -> String {
    let mut line = format!(
        "{} prefix={} account={} permissions={} status={} created_at={}",
        info.key_id,
        info.prefix,
        info.account_id,
        info.permissions,
        match info.status {
            KeyStatus::Active => "active",
            KeyStatus::Revoked => "revoked",
        },
        info.created_at
    );
    if let Some(at) = info.revoked_at {
        let _ = write!(line, " revoked_at={at}");
    }
    line
}

pub(crate) fn usage_event(event: &UsageEvent) -> String {
    let source = match event.source {
        UsageSource::Leased { lease_id, .. } => lease_id.to_string(),
        UsageSource::Overage => "overage".to_owned(),
    };
    let mut line = format!(
        "{} {} {} units={} source={source} {}",
        event.request_id,
        event.at,
        event.account_id,
        event.units.get(),
        event.policy_revision
    );
    if let Some(key) = event.key_id {
        let _ = write!(line, " {key}");
    }
    line
}

pub(crate) fn schema_status(schema: &str, status: &SchemaStatus) -> String {
    match status {
        SchemaStatus::Current { version } => {
            format!("schema {schema} is current (version {version})")
        }
        SchemaStatus::Missing => {
            format!("schema {schema} has no tollgate tables: run `tollgate migrate`")
        }
        SchemaStatus::Behind { applied, shipped } => format!(
            "schema {schema} is at version {applied}, this build ships {shipped}: run `tollgate migrate`"
        ),
        SchemaStatus::Ahead { applied, shipped } => format!(
            "schema {schema} is at version {applied}, newer than this build's {shipped}: upgrade tollgate"
        ),
        SchemaStatus::Modified { version } => {
            format!("schema {schema}: migration {version} differs from the one this build ships")
        }
        other => format!("schema {schema}: {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_is_one_word_the_flags_read_back() {
        for duration in [
            SignedDuration::from_micros(1_500),
            SignedDuration::from_secs(90),
            SignedDuration::from_hours(24 * 30) + SignedDuration::from_micros(1),
        ] {
            let printed = super::duration(duration);
            assert!(!printed.contains(' '), "{printed}");
            assert_eq!(crate::parse::duration(&printed), Ok(duration), "{printed}");
        }
    }
}
