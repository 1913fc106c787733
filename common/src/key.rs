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
}

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

    #[test]
    fn parse_and_print_round_trip() {
        let k: Key = "00112233445566778899aabbccddeeff".parse().unwrap();
        assert_eq!(k.hi(), 0x0011223344556677);
        assert_eq!(k.lo(), 0x8899aabbccddeeff);
        assert_eq!(k.to_string(), "00112233445566778899aabbccddeeff");
        assert_eq!(Key::from_parts(k.hi(), k.lo()), k);
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
