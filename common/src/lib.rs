//! Vocabulary shared by every kvmesh process: block keys, the byte layout of
//! a pool slot (header, payload, trailer), the payload checksum and the
//! fd-handshake framing. Both the daemon and the client library depend on
//! this crate; it depends on neither, and it does no IO.
#![forbid(unsafe_code)]

pub mod handshake;
pub mod key;
pub mod slot;

pub use key::{KEY_SEED, Key, KeyParseError};
pub use slot::{SlotMeta, SlotState, ValidationError};

/// xxh3-64 of a block payload, the checksum stored in slot headers.
pub fn checksum(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

/// 64-bit fingerprint of a namespace: incompatible KV (other model, dtype,
/// layout, TP shape or weights version) gets another fingerprint.
pub fn namespace_fingerprint(name: &str, block_bytes: u64, layout: &str) -> u64 {
    let mut buf = Vec::with_capacity(name.len() + layout.len() + 16);
    buf.extend_from_slice(&(name.len() as u64).to_le_bytes());
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(&block_bytes.to_le_bytes());
    buf.extend_from_slice(layout.as_bytes());
    xxhash_rust::xxh3::xxh3_64(&buf)
}

/// Version of the slot layout and engine API, reported by `Hello`.
pub const LAYOUT_VERSION: u32 = 1;
