//! Block keys: a 128-bit chained prefix hash, written as 32 hex digits.

use std::fmt;
use std::str::FromStr;

/// Key of a block inside its namespace: the 128-bit chained hash of the
/// token prefix the block ends.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Key(pub u128);

impl Key {
    /// Builds a key from its two 64-bit halves (the wire form).
    pub fn from_parts(hi: u64, lo: u64) -> Self {
        Key(((hi as u128) << 64) | lo as u128)
    }
    /// High 64 bits.
    pub fn hi(self) -> u64 {
        (self.0 >> 64) as u64
    }
    /// Low 64 bits.
    pub fn lo(self) -> u64 {
        self.0 as u64
    }

    /// The key of the block that holds `tokens` after the prefix whose last
    /// block has key `parent` (`None` for the first block): xxh3-128 with
    /// seed [`KEY_SEED`] over the parent key's 16 bytes (big-endian, absent
    /// for the first block) followed by each token id as 4 little-endian
    /// bytes. Every process and language computes the same keys (no
    /// per-process hash seed).
    pub fn chain(parent: Option<Key>, tokens: &[u32]) -> Key {
        let mut buf = Vec::with_capacity(16 + tokens.len() * 4);
        if let Some(p) = parent {
            buf.extend_from_slice(&p.0.to_be_bytes());
        }
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        Key(twox_hash::XxHash3_128::oneshot_with_seed(KEY_SEED, &buf))
    }

    /// Keys of the full blocks of a token sequence, `block_tokens` tokens
    /// per block, chained with [`Key::chain`]; a trailing partial block has
    /// no key. Empty when `block_tokens` is 0.
    pub fn prefix_keys(tokens: &[u32], block_tokens: usize) -> Vec<Key> {
        if block_tokens == 0 {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(tokens.len() / block_tokens);
        let mut parent = None;
        for chunk in tokens.chunks_exact(block_tokens) {
            let k = Key::chain(parent, chunk);
            out.push(k);
            parent = Some(k);
        }
        out
    }
}

/// Seed of the key derivation ([`Key::chain`]): the ASCII bytes of
/// "kvmesh" as a big-endian integer. Part of the public contract: changing
/// it changes every key.
pub const KEY_SEED: u64 = 0x6b76_6d65_7368;

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({:032x})", self.0)
    }
}

/// A key string that is not 32 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("key {input:?} is not 32 hex digits ({reason})")]
pub struct KeyParseError {
    input: String,
    reason: &'static str,
}

impl FromStr for Key {
    type Err = KeyParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| KeyParseError { input: s.chars().take(64).collect(), reason };
        if s.len() != 32 {
            return Err(err("wrong length"));
        }
        if !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(err("non-hex character"));
        }
        u128::from_str_radix(s, 16).map(Key).map_err(|_| err("not a number"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY0_PINNED: &str = "03874a2e9a827a5210e073f5d377b7b9";
    const KEY1_PINNED: &str = "7e8cd2980a866481ae4126a9ed4d27a5";

    #[test]
    fn parse_and_print_round_trip() {
        let k: Key = "00112233445566778899aabbccddeeff".parse().unwrap();
        assert_eq!(k.hi(), 0x0011223344556677);
        assert_eq!(k.lo(), 0x8899aabbccddeeff);
        assert_eq!(k.to_string(), "00112233445566778899aabbccddeeff");
        assert_eq!(Key::from_parts(k.hi(), k.lo()), k);
    }

    #[test]
    fn chained_keys_are_fixed_and_depend_on_the_whole_prefix() {
        // Pinned values: the rule is a public contract (C, Python and other
        // engines reproduce it), so a change must be deliberate.
        let k0 = Key::chain(None, &[1, 2, 3, 4]);
        let k1 = Key::chain(Some(k0), &[5, 6, 7, 8]);
        assert_eq!(Key::prefix_keys(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4), vec![k0, k1]);
        assert_eq!(k0.to_string(), KEY0_PINNED);
        assert_eq!(k1.to_string(), KEY1_PINNED);
        // Same tokens after a different prefix: a different key.
        assert_ne!(Key::chain(Some(k1), &[5, 6, 7, 8]), k1);
        assert_ne!(Key::chain(None, &[5, 6, 7, 8]), k1);
        assert!(Key::prefix_keys(&[1, 2, 3], 4).is_empty());
        assert!(Key::prefix_keys(&[1, 2, 3], 0).is_empty());
    }

    #[test]
    fn bad_keys_are_rejected_with_reason() {
        for (input, reason) in [
            ("", "wrong length"),
            ("0011", "wrong length"),
            ("00112233445566778899aabbccddeeff00", "wrong length"),
            ("0011223344556677889zaabbccddeeff", "non-hex character"),
            ("+0112233445566778899aabbccddeeff", "non-hex character"),
        ] {
            let e = input.parse::<Key>().unwrap_err();
            assert!(e.to_string().contains(reason), "{input}: {e}");
        }
    }
}
