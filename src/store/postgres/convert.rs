//! Conversions between the domain's types and `PostgreSQL`'s, and the mapping
//! of database failures to storage errors. Nothing read from the database is
//! trusted: a value that does not map is a [`StoreError`] naming it.

use jiff::Timestamp;
use sha2::{Digest, Sha256};
use sqlx::postgres::PgRow;
use sqlx::types::time::OffsetDateTime;
use sqlx::{Decode, Postgres, Row, Type};

use crate::store::StoreError;

/// A failed database call, as a storage error: the call may or may not have
/// taken effect.
pub(super) fn storage(context: &str, error: &sqlx::Error) -> StoreError {
    StoreError::new(format!("postgres: {context}: {error}"))
}

/// `at`, truncated down to the microsecond: the precision `PostgreSQL` keeps.
/// Every instant the store writes goes through here first, so what it
/// returns is what it stored.
pub(super) fn micros(at: Timestamp) -> Timestamp {
    let nanos = at.as_nanosecond();
    let floored = nanos - nanos.rem_euclid(1_000);
    // The smallest timestamp is a whole second, so flooring stays in range;
    // the fallback is unreachable but keeps this total.
    Timestamp::from_nanosecond(floored).unwrap_or(at)
}

/// `at` rounded up to the microsecond: as a bound on stored instants, which
/// are whole microseconds, `stored >= at` holds exactly when
/// `stored >= micros_up(at)`, and likewise for `<`. (Rounded down, a bound
/// a few nanoseconds past an event's instant would still take it in as a
/// lower bound and leave it out as an upper one.) At the last representable
/// microsecond, where there is nothing to round up to, `at` floored.
pub(super) fn micros_up(at: Timestamp) -> Timestamp {
    let floored = micros(at);
    if floored == at {
        return at;
    }
    floored
        .checked_add(jiff::SignedDuration::from_micros(1))
        .unwrap_or(floored)
}

/// `at` as `PostgreSQL`'s `timestamptz`.
pub(super) fn to_pg(at: Timestamp) -> Result<OffsetDateTime, StoreError> {
    OffsetDateTime::from_unix_timestamp_nanos(at.as_nanosecond())
        .map_err(|_| StoreError::new(format!("postgres: {at} cannot be stored")))
}

/// A `timestamptz` read back.
pub(super) fn from_pg(at: OffsetDateTime, what: &str) -> Result<Timestamp, StoreError> {
    Timestamp::from_nanosecond(at.unix_timestamp_nanos())
        .map_err(|_| StoreError::new(format!("postgres: {what} {at} is out of range")))
}

/// `value` as a bigint, or `None` when no bigint can hold it (no stored row
/// can then match it).
pub(super) fn to_i64(value: u64) -> Option<i64> {
    i64::try_from(value).ok()
}

/// A stored amount as a bigint. Stored amounts never exceed `i64::MAX`; a
/// larger one is refused before it reaches here.
pub(super) fn amount(value: u64, what: &str) -> Result<i64, StoreError> {
    to_i64(value).ok_or_else(|| StoreError::new(format!("postgres: {what} {value} is too large")))
}

/// A stored id, which is always positive.
pub(super) fn id(value: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(value)
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| StoreError::new(format!("postgres: {what} {value} is not a valid id")))
}

/// A stored amount of units, which is never negative.
pub(super) fn units(value: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(value)
        .map_err(|_| StoreError::new(format!("postgres: {what} {value} is negative")))
}

/// One column of a row.
pub(super) fn get<'r, T>(row: &'r PgRow, column: &str) -> Result<T, StoreError>
where
    T: Decode<'r, Postgres> + Type<Postgres>,
{
    row.try_get(column)
        .map_err(|error| StoreError::new(format!("postgres: reading {column}: {error}")))
}

/// A `timestamptz` column.
pub(super) fn get_at(row: &PgRow, column: &str) -> Result<Timestamp, StoreError> {
    from_pg(get(row, column)?, column)
}

/// A nullable `timestamptz` column.
pub(super) fn get_opt_at(row: &PgRow, column: &str) -> Result<Option<Timestamp>, StoreError> {
    get::<Option<OffsetDateTime>>(row, column)?
        .map(|at| from_pg(at, column))
        .transpose()
}

/// The advisory lock key for `purpose` in `schema`: the first eight bytes
/// of a SHA-256, so each schema (and each purpose) has its own lock.
pub(super) fn advisory_key(purpose: &str, schema: &str) -> i64 {
    let digest = Sha256::digest(format!("tollgate:{purpose}:{schema}").as_bytes());
    let mut key = [0_u8; 8];
    key.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(key)
}

/// A request id as the 32 hex digits `PostgreSQL` parses as a `uuid`.
pub(super) fn uuid_text(request_id: u128) -> String {
    format!("{request_id:032x}")
}

/// A `uuid` read back as text (with or without dashes).
pub(super) fn parse_uuid(text: &str) -> Result<u128, StoreError> {
    let digits: String = text.chars().filter(|c| *c != '-').collect();
    if digits.len() != 32 {
        return Err(StoreError::new(format!(
            "postgres: request id {text:?} is not a uuid"
        )));
    }
    u128::from_str_radix(&digits, 16)
        .map_err(|_| StoreError::new(format!("postgres: request id {text:?} is not a uuid")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_truncate_down_to_the_microsecond() {
        let at = Timestamp::from_nanosecond(1_000_001_999).unwrap();
        assert_eq!(micros(at).as_nanosecond(), 1_000_001_000);
        let before = Timestamp::from_nanosecond(-1).unwrap();
        assert_eq!(micros(before).as_nanosecond(), -1_000);
        assert_eq!(micros(Timestamp::MIN), Timestamp::MIN);
        let stored = to_pg(micros(at)).unwrap();
        assert_eq!(from_pg(stored, "at").unwrap(), micros(at));
    }

    #[test]
    fn bounds_round_up_to_the_microsecond() {
        let at = Timestamp::from_nanosecond(1_000_001_001).unwrap();
        assert_eq!(micros_up(at).as_nanosecond(), 1_000_002_000);
        let whole = Timestamp::from_nanosecond(1_000_001_000).unwrap();
        assert_eq!(micros_up(whole), whole);
        let before = Timestamp::from_nanosecond(-1).unwrap();
        assert_eq!(micros_up(before).as_nanosecond(), 0);
        assert_eq!(micros_up(Timestamp::MAX), micros(Timestamp::MAX));
        assert_eq!(micros_up(Timestamp::MIN), Timestamp::MIN);
    }

    #[test]
    fn request_ids_round_trip_through_uuid_text() {
        for id in [0, 1, u128::MAX, 0x0123_4567_89ab_cdef_0011_2233_4455_6677] {
            assert_eq!(parse_uuid(&uuid_text(id)).unwrap(), id);
        }
        assert_eq!(
            parse_uuid("01234567-89ab-cdef-0011-223344556677").unwrap(),
            0x0123_4567_89ab_cdef_0011_2233_4455_6677
        );
        assert!(parse_uuid("xyz").is_err());
    }

    #[test]
    fn rows_that_do_not_map_are_errors_not_panics() {
        assert!(id(0, "lease id").is_err());
        assert!(id(-5, "lease id").is_err());
        assert_eq!(id(5, "lease id").unwrap(), 5);
        assert!(units(-1, "balance").is_err());
        assert_eq!(to_i64(u64::MAX), None);
    }
}
