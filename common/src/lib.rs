//! Vocabulary shared by every kvmesh process: block keys, the byte layout of
//! a pool slot (header, payload, trailer), the payload checksum and the
//! fd-handshake framing. Both the daemon and the client library depend on
//! this crate; it depends on neither, and it does no IO.
#![forbid(unsafe_code)]

pub mod handshake;
pub mod key;
pub mod slot;
pub mod table;

pub use key::{KEY_SEED, Key, KeyParseError};
pub use slot::{SlotMeta, SlotState, ValidationError};

/// xxh3-64 of a block payload, the checksum stored in slot headers.
///
/// Every remote copy is hashed before it is used, so this is on the data
/// path: `twox-hash` picks its AVX2 loop at run time where the CPU has one
/// (about twice the speed of the SSE2 loop on 256 KiB; see
/// docs/DATAPLANE.md), and any implementation gives the same value.
pub fn checksum(payload: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(payload)
}

/// 64-bit fingerprint of a namespace: incompatible KV (other model, dtype,
/// layout, TP shape or weights version) gets another fingerprint.
pub fn namespace_fingerprint(name: &str, block_bytes: u64, layout: &str) -> u64 {
    let mut buf = Vec::with_capacity(name.len() + layout.len() + 16);
    buf.extend_from_slice(&(name.len() as u64).to_le_bytes());
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(&block_bytes.to_le_bytes());
    buf.extend_from_slice(layout.as_bytes());
    twox_hash::XxHash3_64::oneshot(&buf)
}

/// Version of the slot layout and engine API, reported by `Hello`.
pub const LAYOUT_VERSION: u32 = 1;

#[cfg(test)]
mod tests {
    use super::*;

    /// Checksums are in slot headers that other processes (and older
    /// daemons) check: the value must be xxh3-64's, whichever SIMD loop
    /// computed it. The values were computed by another implementation
    /// (xxhash-rust 0.8); the empty input's is XXH3's published one. The
    /// long inputs go through the stripe loop that AVX2 / SSE2 speed up.
    #[test]
    fn checksum_is_xxh3_64_on_every_length() {
        let bytes =
            |n: usize| -> Vec<u8> { (0..n).map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[1]).collect() };
        for (n, want) in [
            (0usize, 0x2d06800538d394c2u64),
            (3, 0xddbabe9a1f4715a1),
            (200, 0xc81891076fff88bd),
            (1000, 0x1f31110eb12040c4),
            (256 * 1024, 0x81715a2e5b6b623c),
        ] {
            assert_eq!(checksum(&bytes(n)), want, "{n} bytes");
        }
    }
}
