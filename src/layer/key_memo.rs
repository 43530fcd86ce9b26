//! A per-thread memo of [`KeyHash::of`] for presented keys.
//!
//! SHA-256 of a 51-byte key is the largest single cost of admitting a
//! request (about 3,500 instructions without SHA extensions, more than the
//! rest of admission). The hash is a pure function of the key's bytes, so a
//! remembered result can never be stale: revoking or deleting a key changes
//! what its hash resolves to in the snapshot map, not the hash itself. No
//! invalidation is needed, and a memo miss costs only the hash it would
//! have computed anyway.
//!
//! Each thread keeps its own direct-mapped table, so a lookup takes no lock
//! and touches no shared cache line. A slot holds the key's full bytes and
//! a hit requires all of them to match, so a collision of the slot index can
//! only cause a miss, never a wrong hash. The comparison reads every byte of
//! the slot whatever the outcome, so its timing does not reveal how much of
//! a remembered key a guess shares. The slot index comes from a per-process
//! random seed, so a client cannot aim its keys at a chosen slot; flooding
//! the table with distinct keys only evicts entries, which costs the hashes
//! the memo would otherwise have saved.
//!
//! Keys longer than [`WIDTH`] bytes are hashed directly. The plaintext of
//! recently presented keys stays in this table until evicted or until the
//! thread exits, as it stays in the connection's buffers; it is never
//! written anywhere or logged (I16).

use std::cell::RefCell;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::OnceLock;

use crate::KeyHash;

/// The longest key the memo keeps, in bytes: room for tollgate's own keys
/// (`tg_` and 48 hex digits) and most other bearer tokens.
const WIDTH: usize = 64;
const WORDS: usize = WIDTH / 8;
/// Slots per thread: a power of two.
const SLOTS: usize = 256;

/// A key's bytes zero-padded to [`WIDTH`], as little-endian words, with its
/// length alongside (so `ab` and `ab\0` differ).
#[derive(Clone, Copy)]
struct Padded {
    words: [u64; WORDS],
    len: u64,
}

#[derive(Clone, Copy)]
struct Slot {
    key: Padded,
    hash: KeyHash,
}

const EMPTY: Slot = Slot {
    // A length of zero never matches: the memo is not asked about empty
    // keys.
    key: Padded {
        words: [0; WORDS],
        len: 0,
    },
    hash: KeyHash([0; 32]),
};

thread_local! {
    // Boxed on a thread's first key, so threads that never admit a request
    // carry no table.
    static TABLE: RefCell<Option<Box<[Slot]>>> = const { RefCell::new(None) };
}

/// `KeyHash::of(key)`, remembered per thread.
pub(crate) fn key_hash(key: &[u8]) -> KeyHash {
    if key.is_empty() || key.len() > WIDTH {
        return KeyHash::of(key);
    }
    let padded = pad(key);
    let index = index(&padded);
    TABLE
        .try_with(|table| {
            let mut table = table.borrow_mut();
            let slots = table.get_or_insert_with(|| vec![EMPTY; SLOTS].into_boxed_slice());
            let slot = &mut slots[index];
            if same(&slot.key, &padded) {
                return slot.hash;
            }
            let hash = KeyHash::of(key);
            *slot = Slot { key: padded, hash };
            hash
        })
        // A thread being torn down has no table.
        .unwrap_or_else(|_| KeyHash::of(key))
}

fn pad(key: &[u8]) -> Padded {
    let mut bytes = [0u8; WIDTH];
    bytes[..key.len()].copy_from_slice(key);
    let mut words = [0u64; WORDS];
    for (word, chunk) in words.iter_mut().zip(bytes.chunks_exact(8)) {
        let mut eight = [0u8; 8];
        eight.copy_from_slice(chunk);
        *word = u64::from_le_bytes(eight);
    }
    Padded {
        words,
        len: key.len() as u64,
    }
}

/// Whether two padded keys are equal, reading all of both either way.
fn same(a: &Padded, b: &Padded) -> bool {
    let mut difference = a.len ^ b.len;
    for (x, y) in a.words.iter().zip(&b.words) {
        difference |= x ^ y;
    }
    difference == 0
}

/// The slot for `key`: a seeded multiplicative hash of its words.
fn index(key: &Padded) -> usize {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = seed() ^ key.len;
    for word in key.words {
        h = (h ^ word).wrapping_mul(K).rotate_left(29);
    }
    h = (h ^ (h >> 32)).wrapping_mul(K);
    // The top bits are the best mixed; fewer than 32 of them fit any usize.
    usize::try_from(h >> (64 - SLOTS.trailing_zeros())).unwrap_or(0)
}

fn seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    // `RandomState` is seeded from the operating system's randomness once
    // per process.
    *SEED.get_or_init(|| RandomState::new().hash_one(0x746f_6c6c_6761_7465_u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_answer_is_the_sha256_of_the_key() {
        // More distinct keys than slots, each asked twice (a miss, then a
        // hit unless evicted), of every length around the width, including
        // keys that differ only by trailing zero bytes.
        let mut keys: Vec<Vec<u8>> = Vec::new();
        for n in 0..(3 * SLOTS) {
            keys.push(format!("tg_{n:048x}").into_bytes());
        }
        for len in 1..=(WIDTH + 8) {
            keys.push(vec![b'k'; len]);
        }
        keys.push(b"ab".to_vec());
        keys.push(b"ab\0".to_vec());
        keys.push(b"ab\0\0".to_vec());
        for _ in 0..2 {
            for key in &keys {
                assert_eq!(key_hash(key), KeyHash::of(key), "{key:?}");
            }
        }
        // The same key asked back to back is a hit: its slot holds it.
        let key = b"tg_0123456789abcdef0123456789abcdef0123456789abcdef";
        let first = key_hash(key);
        TABLE.with(|table| {
            let table = table.borrow();
            let slot = &table.as_ref().expect("allocated")[index(&pad(key))];
            assert!(same(&slot.key, &pad(key)));
            assert_eq!(slot.hash, first);
        });
    }

    #[test]
    fn padding_keeps_the_length() {
        assert!(!same(&pad(b"ab"), &pad(b"ab\0")));
        assert!(same(&pad(b"ab"), &pad(b"ab")));
        assert!(!same(&pad(b"ab"), &pad(b"ac")));
    }

    #[test]
    fn threads_keep_their_own_tables() {
        let key: &'static [u8] = b"tg_ffffffffffffffffffffffffffffffffffffffffffffffff";
        let expected = KeyHash::of(key);
        let handles: Vec<_> = (0..4)
            .map(|_| std::thread::spawn(move || (0..100).all(|_| key_hash(key) == expected)))
            .collect();
        for handle in handles {
            assert!(handle.join().expect("no panic"));
        }
        // Four other threads remembered the key; this one never asked, so
        // its slot for the key does not hold it.
        let remembered_here = TABLE.with(|table| {
            table
                .borrow()
                .as_ref()
                .is_some_and(|slots| same(&slots[index(&pad(key))].key, &pad(key)))
        });
        assert!(!remembered_here);
    }
}
