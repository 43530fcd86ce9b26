//! Finding the API key a request presents.

use http::HeaderMap;
use http::header::{AUTHORIZATION, HeaderName};

use crate::DenyReason;

/// The longest key, in bytes, [`BearerOrApiKey`] accepts. Longer values are
/// refused before any hashing, so a hostile client cannot make admission
/// hash megabytes.
pub const MAX_KEY_BYTES: usize = 255;

/// Finds the credential in a request's headers.
///
/// The returned bytes are hashed with [`KeyHash::of`](crate::KeyHash::of)
/// and looked up. They are never logged (a trace records at most the
/// eleven-character visible prefix a store keeps anyway) and never written
/// anywhere; the layer's per-thread memo of recently presented keys holds
/// them in process memory, as the request's own buffers do (I16).
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key's bytes, borrowed from `headers`.
    ///
    /// # Errors
    ///
    /// [`DenyReason::MissingCredential`] when no credential is present,
    /// [`DenyReason::MalformedCredential`] when one is present but unusable.
    fn extract<'a>(&self, headers: &'a HeaderMap) -> Result<&'a [u8], DenyReason>;
}

/// The default [`KeyExtractor`]: an `Authorization: Bearer <key>` header,
/// else an `x-api-key: <key>` header.
///
/// A request is refused as [`DenyReason::MalformedCredential`] when it has
/// more than one `Authorization` or more than one `x-api-key` header, an
/// `Authorization` scheme other than `Bearer` (matched case-insensitively),
/// an empty key, a key longer than [`MAX_KEY_BYTES`], or any key byte outside
/// visible ASCII (`0x21..=0x7E`). Every check runs before any hashing.
#[derive(Debug, Clone, Copy, Default)]
pub struct BearerOrApiKey;

const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
const BEARER: &[u8] = b"bearer";

impl KeyExtractor for BearerOrApiKey {
    fn extract<'a>(&self, headers: &'a HeaderMap) -> Result<&'a [u8], DenyReason> {
        let authorization = single(headers, &AUTHORIZATION)?;
        let api_key = single(headers, &X_API_KEY)?;
        match (authorization, api_key) {
            (Some(value), _) => checked(bearer_token(value)?),
            (None, Some(value)) => checked(value),
            (None, None) => Err(DenyReason::MissingCredential),
        }
    }
}

/// The one value of header `name`, if any; two or more is malformed.
fn single<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<Option<&'a [u8]>, DenyReason> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    if values.next().is_some() {
        return Err(DenyReason::MalformedCredential);
    }
    Ok(first.map(http::HeaderValue::as_bytes))
}

/// The token after `Bearer` and at least one space.
fn bearer_token(value: &[u8]) -> Result<&[u8], DenyReason> {
    let scheme_matches = value.len() > BEARER.len()
        && value[..BEARER.len()].eq_ignore_ascii_case(BEARER)
        && value[BEARER.len()] == b' ';
    if !scheme_matches {
        return Err(DenyReason::MalformedCredential);
    }
    let rest = &value[BEARER.len()..];
    let start = rest
        .iter()
        .position(|byte| *byte != b' ')
        .unwrap_or(rest.len());
    Ok(&rest[start..])
}

/// `key` if it is non-empty, short enough and visible ASCII throughout.
fn checked(key: &[u8]) -> Result<&[u8], DenyReason> {
    // A fold rather than `all`: without the early exit the compiler checks
    // many bytes per instruction.
    let well_formed = !key.is_empty()
        && key.len() <= MAX_KEY_BYTES
        && key
            .iter()
            .fold(true, |visible, byte| visible & (0x21..=0x7E).contains(byte));
    if well_formed {
        Ok(key)
    } else {
        Err(DenyReason::MalformedCredential)
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[track_caller]
    fn check(pairs: &[(&HeaderName, &[u8])], expected: Result<&[u8], DenyReason>) {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, HeaderValue::from_bytes(value).unwrap());
        }
        assert_eq!(BearerOrApiKey.extract(&headers), expected, "{pairs:?}");
    }

    #[test]
    fn each_header_shape_is_read_or_refused_by_rule() {
        let malformed = Err(DenyReason::MalformedCredential);
        check(&[], Err(DenyReason::MissingCredential));
        check(&[(&AUTHORIZATION, b"Bearer tg_abc")], Ok(b"tg_abc"));
        check(&[(&AUTHORIZATION, b"bearer   tg_abc")], Ok(b"tg_abc"));
        check(&[(&X_API_KEY, b"tg_abc")], Ok(b"tg_abc"));
        check(
            &[(&AUTHORIZATION, b"Bearer tg_a"), (&X_API_KEY, b"tg_b")],
            Ok(b"tg_a"),
        );
        check(&[(&AUTHORIZATION, b"Basic dXNlcjpwYXNz")], malformed);
        check(&[(&AUTHORIZATION, b"Bearer")], malformed);
        check(&[(&AUTHORIZATION, b"Bearer ")], malformed);
        check(&[(&AUTHORIZATION, b"Bearertg_abc")], malformed);
        check(&[(&AUTHORIZATION, b"Bearer tg_a b")], malformed);
        check(&[(&AUTHORIZATION, b"Bearer tg_abc\xff")], malformed);
        check(&[(&X_API_KEY, b"")], malformed);
        check(&[(&X_API_KEY, &[b'k'; MAX_KEY_BYTES + 1])], malformed);
        check(
            &[(&X_API_KEY, &[b'k'; MAX_KEY_BYTES])],
            Ok(&[b'k'; MAX_KEY_BYTES]),
        );
        check(
            &[(&AUTHORIZATION, b"Bearer a"), (&AUTHORIZATION, b"Bearer b")],
            malformed,
        );
        check(&[(&X_API_KEY, b"a"), (&X_API_KEY, b"b")], malformed);
    }
}
