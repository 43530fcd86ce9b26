//! API keys: generated once, shown once, stored only as a hash.

use std::fmt::{self, Write as _};

use crate::model::KeyHash;

/// A freshly generated API key, in plaintext.
///
/// The only place a key's plaintext exists. Stores keep its [`KeyHash`] and
/// its [`KeyPrefix`], never the key (I16). `Debug` shows the prefix only, so
/// a key cannot leak through a log line.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

/// The short, visible start of a key (`tg_` and eight characters), kept so
/// an operator can tell keys apart without the store holding the secret.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyPrefix(String);

impl ApiKey {
    /// What every tollgate key starts with, so a leaked key is recognisable
    /// to secret scanners and to people.
    pub const PREFIX: &'static str = "tg_";
    /// Random bytes per key: 192 bits, well past guessing.
    const RANDOM_BYTES: usize = 24;
    const VISIBLE_RANDOM_CHARS: usize = 8;

    /// Generates a key from the operating system's random source.
    ///
    /// # Errors
    ///
    /// When the operating system cannot supply randomness.
    pub fn generate() -> Result<Self, getrandom::Error> {
        let mut bytes = [0_u8; Self::RANDOM_BYTES];
        getrandom::fill(&mut bytes)?;
        let mut key = String::with_capacity(Self::PREFIX.len() + 2 * Self::RANDOM_BYTES);
        key.push_str(Self::PREFIX);
        push_hex(&mut key, &bytes);
        Ok(Self(key))
    }

    /// The plaintext, for showing to the key's owner once.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The hash stores keep.
    #[must_use]
    pub fn hash(&self) -> KeyHash {
        KeyHash::of(self.0.as_bytes())
    }

    /// The visible prefix stores keep.
    #[must_use]
    pub fn prefix(&self) -> KeyPrefix {
        let end = Self::PREFIX.len() + Self::VISIBLE_RANDOM_CHARS;
        KeyPrefix(self.0[..end].to_owned())
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ApiKey({}…)", self.prefix().as_str())
    }
}

impl KeyPrefix {
    /// A prefix as a store kept it.
    #[cfg(feature = "postgres")]
    pub(crate) fn from_stored(prefix: String) -> Self {
        Self(prefix)
    }

    /// The prefix text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for KeyPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    for byte in bytes {
        write!(out, "{byte:02x}").expect("writing to a String cannot fail");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_prefixed_long_random_and_hashed_by_its_bytes() {
        let key = ApiKey::generate().unwrap();
        let text = key.expose();
        assert!(text.starts_with("tg_"));
        assert_eq!(text.len(), 3 + 48, "192 random bits as hex");
        assert!(text[3..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(key.hash(), KeyHash::of(text.as_bytes()));
        assert_eq!(key.prefix().as_str(), &text[..11]);
        assert_ne!(ApiKey::generate().unwrap(), key, "two keys never repeat");
    }

    #[test]
    fn debug_output_never_shows_the_secret() {
        let key = ApiKey::generate().unwrap();
        let shown = format!("{key:?}");
        assert!(!shown.contains(&key.expose()[11..]), "{shown}");
        assert!(shown.contains(key.prefix().as_str()));
    }
}
