//! Identifier newtypes. Each is a distinct type so an account id can never be
//! passed where a lease id is expected.

use std::fmt;

macro_rules! id_type {
    ($(#[$meta:meta])* $name:ident($repr:ty), $prefix:literal) => {
        id_type!($(#[$meta])* $name($repr));

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
    ($(#[$meta:meta])* $name:ident($repr:ty)) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub $repr);

        impl $name {
            /// The raw value.
            #[inline]
            #[must_use]
            pub const fn get(self) -> $repr {
                self.0
            }
        }
    };
}

id_type!(
    /// Who pays: an account holding a balance of cost units.
    AccountId(u64),
    "acct_"
);
id_type!(
    /// One grant of units from the allocator to one instance.
    LeaseId(u64),
    "lease_"
);
id_type!(
    /// The capability that must accompany every release, consolidation and
    /// usage event naming a lease. A holder that presents the wrong token is
    /// fenced out.
    FencingToken(u64),
    "fence_"
);
id_type!(
    /// One API key's identity, as recorded on the usage events it pays for.
    KeyId(u64),
    "key_"
);
id_type!(
    /// Who calls: the identity a credential resolves to, bound to one account.
    Principal(u64),
    "principal_"
);
id_type!(
    /// The application's identity for the pricing policy that priced a
    /// request, stamped on its usage event.
    PolicyRevision(u64),
    "rev_"
);
id_type!(
    /// One admitted request. It is the idempotency key of the request's usage
    /// event (I8), so it must be unique across every instance.
    ///
    /// Displayed as `req_` and 32 lowercase hexadecimal digits: fixed width,
    /// and cheap to render on every response.
    RequestId(u128)
);

impl PolicyRevision {
    /// The revision used when the application states none.
    pub const UNSTATED: Self = Self(0);

    /// The largest revision every store can record: `PostgreSQL` keeps it in
    /// a `bigint`. An event stamped with a larger one is rejected as
    /// malformed, so the layer refuses to be built with one (I17).
    pub const MAX: Self = Self(i64::MAX as u64);
}

impl RequestId {
    /// Builds an id from a per-process prefix and a per-process counter, so
    /// instances mint unique ids without talking to each other.
    #[inline]
    #[must_use]
    pub const fn from_parts(prefix: u64, counter: u64) -> Self {
        Self(((prefix as u128) << 64) | counter as u128)
    }

    /// The id as displayed, in a fixed-size buffer: `req_` and 32 lowercase
    /// hexadecimal digits. No allocation and no division, so the HTTP layer
    /// can put it in a header on every response.
    #[must_use]
    pub const fn to_ascii(self) -> [u8; 36] {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = *b"req_00000000000000000000000000000000";
        let mut i = 0;
        while i < 32 {
            let nibble = (self.0 >> (124 - 4 * i)) & 0xf;
            out[4 + i] = DIGITS[nibble as usize];
            i += 1;
        }
        out
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ascii = self.to_ascii();
        // Every byte is ASCII by construction.
        f.write_str(std::str::from_utf8(&ascii).map_err(|_| fmt::Error)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_from_different_prefixes_never_collide() {
        assert_ne!(RequestId::from_parts(1, 7), RequestId::from_parts(2, 7));
        assert_eq!(RequestId::from_parts(1, 7).get() >> 64, 1);
        assert_eq!(RequestId::from_parts(1, 7).get() & u128::from(u64::MAX), 7);
    }

    #[test]
    fn ids_display_with_their_kind() {
        assert_eq!(AccountId(3).to_string(), "acct_3");
        assert_eq!(LeaseId(4).to_string(), "lease_4");
        assert_eq!(
            RequestId(0xab).to_string(),
            "req_000000000000000000000000000000ab"
        );
        assert_eq!(
            RequestId::from_parts(u64::MAX, 1).to_string(),
            "req_ffffffffffffffff0000000000000001"
        );
    }
}
