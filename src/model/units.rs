//! Cost units and permission bits.

use std::fmt;

/// An amount of cost units: what a request is priced at, what a lease holds,
/// what an account's balance counts.
///
/// There are no arithmetic operators on purpose. Every sum and difference goes
/// through a `checked_*` or `saturating_*` method, so an overflow is a value
/// the caller must handle rather than a silent wrap (I1):
///
/// ```compile_fail
/// use tollgate::CostUnits;
/// let _ = CostUnits(1) + CostUnits(2);
/// ```
///
/// ```compile_fail
/// use tollgate::CostUnits;
/// let mut units = CostUnits(1);
/// units -= CostUnits(2);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CostUnits(pub u64);

impl CostUnits {
    /// No units.
    pub const ZERO: Self = Self(0);
    /// The largest representable amount.
    pub const MAX: Self = Self(u64::MAX);

    /// The raw count.
    #[inline]
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Whether this is zero units.
    #[inline]
    #[must_use]
    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// `self + rhs`, or `None` on overflow.
    #[inline]
    #[must_use]
    pub const fn checked_add(self, rhs: Self) -> Option<Self> {
        match self.0.checked_add(rhs.0) {
            Some(sum) => Some(Self(sum)),
            None => None,
        }
    }

    /// `self - rhs`, or `None` when `rhs` is larger.
    #[inline]
    #[must_use]
    pub const fn checked_sub(self, rhs: Self) -> Option<Self> {
        match self.0.checked_sub(rhs.0) {
            Some(difference) => Some(Self(difference)),
            None => None,
        }
    }

    /// `self * factor`, or `None` on overflow.
    #[inline]
    #[must_use]
    pub const fn checked_mul(self, factor: u64) -> Option<Self> {
        match self.0.checked_mul(factor) {
            Some(product) => Some(Self(product)),
            None => None,
        }
    }

    /// `self - rhs`, stopping at zero. For quantities where "none left" is
    /// the honest answer to an over-subtraction, such as headroom.
    #[inline]
    #[must_use]
    pub const fn saturating_sub(self, rhs: Self) -> Self {
        Self(self.0.saturating_sub(rhs.0))
    }

    /// Sum of an iterator of amounts, or `None` on overflow.
    pub fn checked_sum<I: IntoIterator<Item = Self>>(amounts: I) -> Option<Self> {
        amounts.into_iter().try_fold(Self::ZERO, Self::checked_add)
    }
}

impl fmt::Display for CostUnits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} units", self.0)
    }
}

impl From<u64> for CostUnits {
    fn from(units: u64) -> Self {
        Self(units)
    }
}

/// A set of permissions, one bit each.
///
/// What each bit means is the embedding application's choice; tollgate only
/// checks that a principal holds every bit a route requires.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PermissionBits(pub u64);

impl PermissionBits {
    /// No permissions.
    pub const NONE: Self = Self(0);
    /// Every permission.
    pub const ALL: Self = Self(u64::MAX);

    /// The set holding only bit `index`.
    ///
    /// # Panics
    ///
    /// When `index` is 64 or more: there are only 64 bits.
    #[must_use]
    #[inline]
    pub const fn bit(index: u32) -> Self {
        assert!(index < 64, "permission bit index must be below 64");
        Self(1 << index)
    }

    /// Whether every bit of `required` is in `self`.
    #[inline]
    #[must_use]
    pub const fn contains(self, required: Self) -> bool {
        self.0 & required.0 == required.0
    }

    /// The bits of `required` that `self` lacks.
    #[inline]
    #[must_use]
    pub const fn missing(self, required: Self) -> Self {
        Self(required.0 & !self.0)
    }

    /// Both sets together.
    #[inline]
    #[must_use]
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// Whether the set is empty.
    #[inline]
    #[must_use]
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for PermissionBits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_reports_overflow_instead_of_wrapping() {
        assert_eq!(CostUnits::MAX.checked_add(CostUnits(1)), None);
        assert_eq!(CostUnits(1).checked_sub(CostUnits(2)), None);
        assert_eq!(CostUnits(u64::MAX / 2 + 1).checked_mul(2), None);
        assert_eq!(CostUnits(3).checked_add(CostUnits(4)), Some(CostUnits(7)));
        assert_eq!(CostUnits(7).checked_sub(CostUnits(4)), Some(CostUnits(3)));
        assert_eq!(CostUnits(1).saturating_sub(CostUnits(9)), CostUnits::ZERO);
    }

    #[test]
    fn a_sum_that_overflows_is_none() {
        assert_eq!(
            CostUnits::checked_sum([CostUnits(1), CostUnits(2), CostUnits(3)]),
            Some(CostUnits(6))
        );
        assert_eq!(CostUnits::checked_sum([CostUnits::MAX, CostUnits(1)]), None);
    }

    #[test]
    fn a_principal_needs_every_required_bit() {
        let read = PermissionBits::bit(0);
        let write = PermissionBits::bit(1);
        let held = read;
        assert!(held.contains(read));
        assert!(held.contains(PermissionBits::NONE));
        assert!(!held.contains(read.union(write)));
        assert_eq!(held.missing(read.union(write)), write);
    }
}
