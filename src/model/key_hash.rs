//! The hash by which an API key is known everywhere but in its owner's hands.

use std::fmt::{self, Write as _};

use sha2::{Digest, Sha256};

/// The SHA-256 digest of a key's exact bytes: how stores find a principal.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyHash(pub [u8; 32]);

impl KeyHash {
    /// The hash of a presented credential's exact bytes. The HTTP layer and
    /// every store hash the same way, so a key resolves wherever it is
    /// checked.
    #[must_use]
    pub fn of(credential: &[u8]) -> Self {
        Self(Sha256::digest(credential).into())
    }

    /// The digest as lowercase hex.
    #[must_use]
    pub fn to_hex(&self) -> String {
        let mut hex = String::with_capacity(64);
        for byte in &self.0 {
            write!(hex, "{byte:02x}").expect("writing to a String cannot fail");
        }
        hex
    }
}

impl fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyHash({})", &self.to_hex()[..12])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_sha256() {
        // The SHA-256 of "abc", from FIPS 180-2.
        assert_eq!(
            KeyHash::of(b"abc").to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
