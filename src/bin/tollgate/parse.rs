//! Parsing the command line's values, with messages that say what was
//! expected.

use jiff::{SignedDuration, Timestamp};
use tollgate::{AccountId, KeyId, PermissionBits};

/// An enforcement mode's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mode {
    /// Never beyond the balance.
    Strict,
    /// Overage up to a cap, billed as debt.
    Elastic,
}

/// `acct_7` or `7`.
pub(crate) fn account_id(text: &str) -> Result<AccountId, String> {
    id(text, "acct_").map(AccountId)
}

/// `key_3` or `3`.
pub(crate) fn key_id(text: &str) -> Result<KeyId, String> {
    id(text, "key_").map(KeyId)
}

fn id(text: &str, prefix: &str) -> Result<u64, String> {
    let digits = text.strip_prefix(prefix).unwrap_or(text);
    match digits.parse::<u64>() {
        Ok(0) | Err(_) => Err(format!("expected {prefix}N or N with N a positive integer")),
        Ok(n) => Ok(n),
    }
}

/// `all`, `none`, a hexadecimal mask (`0x3`), or comma-separated bit
/// indices below 64 (`0,1`).
pub(crate) fn permissions(text: &str) -> Result<PermissionBits, String> {
    let expected = "expected all, none, a mask like 0x3, or bit indices like 0,1";
    match text {
        "all" => return Ok(PermissionBits::ALL),
        "none" => return Ok(PermissionBits::NONE),
        _ => {}
    }
    if let Some(hex) = text.strip_prefix("0x") {
        return u64::from_str_radix(hex, 16)
            .map(PermissionBits)
            .map_err(|_| expected.to_owned());
    }
    text.split(',')
        .try_fold(PermissionBits::NONE, |bits, index| {
            match index.trim().parse::<u32>() {
                Ok(index) if index < 64 => Ok(bits.union(PermissionBits::bit(index))),
                _ => Err(expected.to_owned()),
            }
        })
}

/// A positive duration such as `30s`, `1h 30m`, `30d` or `P30D`; a day is
/// 24 hours (refill periods are lengths of time, not calendar dates).
pub(crate) fn duration(text: &str) -> Result<SignedDuration, String> {
    let expected = || format!("expected a duration like 30s, 1h or 30d, got {text:?}");
    let span: jiff::Span = text.parse().map_err(|_| expected())?;
    let parsed = span
        .to_duration(jiff::SpanRelativeTo::days_are_24_hours())
        .map_err(|_| expected())?;
    if parsed.is_positive() {
        Ok(parsed)
    } else {
        Err(format!("expected a positive duration, got {text:?}"))
    }
}

/// A refill period: a [`duration`] that is a whole number of microseconds,
/// since the store keeps period ends to the microsecond and refuses one
/// that would be rounded.
pub(crate) fn period(text: &str) -> Result<SignedDuration, String> {
    let parsed = duration(text)?;
    if parsed.subsec_nanos() % 1_000 == 0 {
        Ok(parsed)
    } else {
        Err(format!(
            "expected a whole number of microseconds, got {text:?}"
        ))
    }
}

/// A count of at least one.
pub(crate) fn positive_count(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("expected at least 1, got 0".to_owned()),
        Ok(count) => Ok(count),
        Err(_) => Err(format!(
            "expected a whole number of at least 1, got {text:?}"
        )),
    }
}

/// An RFC 3339 instant, e.g. `2026-11-30T00:00:00Z`.
pub(crate) fn timestamp(text: &str) -> Result<Timestamp, String> {
    text.parse().map_err(|error| {
        format!("expected an RFC 3339 instant like 2026-11-30T00:00:00Z, got {text:?} ({error})")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refill_period_is_a_whole_number_of_microseconds() {
        assert_eq!(period("1d"), Ok(SignedDuration::from_hours(24)));
        assert_eq!(period("1500us"), Ok(SignedDuration::from_micros(1_500)));
        assert!(
            period("1ns")
                .unwrap_err()
                .contains("whole number of microseconds")
        );
        assert!(period("0s").unwrap_err().contains("positive"));
    }

    #[test]
    fn a_count_is_a_whole_number_of_at_least_one() {
        assert_eq!(positive_count("100"), Ok(100));
        assert!(positive_count("0").is_err());
        assert!(positive_count("-1").is_err());
        assert!(positive_count("ten").is_err());
    }

    #[test]
    fn ids_take_their_prefix_or_a_bare_number_and_never_zero() {
        assert_eq!(account_id("acct_7"), Ok(AccountId(7)));
        assert_eq!(account_id("7"), Ok(AccountId(7)));
        assert!(account_id("0").is_err());
        assert!(account_id("key_7").is_err());
        assert!(account_id("-1").is_err());
        assert_eq!(key_id("key_3"), Ok(KeyId(3)));
    }

    #[test]
    fn permissions_are_names_masks_or_indices() {
        assert_eq!(permissions("all"), Ok(PermissionBits::ALL));
        assert_eq!(permissions("none"), Ok(PermissionBits::NONE));
        assert_eq!(permissions("0x5"), Ok(PermissionBits(5)));
        assert_eq!(permissions("0,2"), Ok(PermissionBits(5)));
        assert!(permissions("64").is_err());
        assert!(permissions("read").is_err());
        assert!(permissions("0x").is_err());
    }

    #[test]
    fn durations_must_be_positive() {
        assert_eq!(duration("30s"), Ok(SignedDuration::from_secs(30)));
        assert_eq!(duration("1h"), Ok(SignedDuration::from_hours(1)));
        assert_eq!(duration("30d"), Ok(SignedDuration::from_hours(720)));
        assert!(duration("1 month").is_err(), "months have no fixed length");
        assert!(duration("0s").is_err());
        assert!(duration("-5s").is_err());
        assert!(duration("soon").is_err());
    }
}
