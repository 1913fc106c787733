//! Byte layout of one pool slot: `header | payload | trailer`.
//!
//! Header and trailer are 64 bytes each and carry the same metadata (key,
//! version, generation, payload length, xxh3-64 checksum) under different
//! magics. A reader that copied a whole slot (locally or with a one-sided
//! remote read) checks that header and trailer agree with each other and
//! with what it expected, then checks the payload checksum: a torn read, a
//! slot reused under the reader, or a half-written block all fail one of
//! these checks and are never used. All integers are little-endian.

/// Size of the header in front of the payload.
pub const HEADER_BYTES: usize = 64;
/// Size of the trailer after the payload capacity.
pub const TRAILER_BYTES: usize = 64;
/// Alignment of slots (and so of payloads, which start one header later).
pub const SLOT_ALIGN: usize = 64;

const HEADER_MAGIC: u32 = u32::from_le_bytes(*b"KVMH");
const TRAILER_MAGIC: u32 = u32::from_le_bytes(*b"KVMT");
const LAYOUT: u16 = 1;

/// Distance between two slots whose payload holds up to `payload_bytes`.
pub fn slot_stride(payload_bytes: u64) -> u64 {
    let raw = HEADER_BYTES as u64 + payload_bytes + TRAILER_BYTES as u64;
    raw.div_ceil(SLOT_ALIGN as u64) * SLOT_ALIGN as u64
}

/// Offset of the trailer from the start of a slot.
pub fn trailer_offset(payload_bytes: u64) -> u64 {
    slot_stride(payload_bytes) - TRAILER_BYTES as u64
}

/// What a slot holds, as written in its header and trailer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum SlotState {
    /// Holds nothing.
    Free = 0,
    /// Being written (an uncommitted put) or filled by a transfer.
    Pending = 1,
    /// Holds a committed block whose checksum is in the header.
    Valid = 2,
}

impl SlotState {
    fn from_u16(v: u16) -> Option<Self> {
        match v {
            0 => Some(SlotState::Free),
            1 => Some(SlotState::Pending),
            2 => Some(SlotState::Valid),
            _ => None,
        }
    }
}

/// Metadata stored twice in a slot, in its header and in its trailer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotMeta {
    /// Lifecycle state of the slot.
    pub state: SlotState,
    /// Fingerprint of the namespace the block belongs to.
    pub namespace: u64,
    /// Key of the block.
    pub key: crate::Key,
    /// Version of the block (grows on every overwrite of the key).
    pub version: u64,
    /// Slot generation, bumped on every reuse of the slot.
    pub generation: u64,
    /// Bytes of payload in use.
    pub payload_len: u64,
    /// xxh3-64 of the payload bytes in use.
    pub checksum: u64,
}

/// A slot that does not hold what its reader expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// The slot could not be read at all (a mapping or device error).
    #[error("slot unreadable: {0}")]
    Unreadable(String),
    /// The buffer is not a whole slot.
    #[error("slot buffer is {found} bytes, expected {expected}")]
    Size {
        /// Expected size.
        expected: u64,
        /// Size found.
        found: u64,
    },
    /// A magic or layout number is wrong: not a slot, or another layout.
    #[error("{which} magic/layout mismatch")]
    Magic {
        /// "header" or "trailer".
        which: &'static str,
    },
    /// Header and trailer disagree: the slot changed during the read.
    #[error("torn slot: header {header:?} differs from trailer {trailer:?}")]
    Torn {
        /// What the header says.
        header: Box<SlotMeta>,
        /// What the trailer says.
        trailer: Box<SlotMeta>,
    },
    /// The slot holds something else than expected.
    #[error("slot holds {found:?}, expected {expected:?}")]
    Mismatch {
        /// What the reader expected.
        expected: Box<SlotMeta>,
        /// What the slot holds.
        found: Box<SlotMeta>,
    },
    /// The payload does not hash to the stored checksum.
    #[error("payload checksum {found:016x} does not match header {expected:016x}")]
    Checksum {
        /// Checksum in the header.
        expected: u64,
        /// Checksum of the bytes read.
        found: u64,
    },
}

impl SlotMeta {
    fn encode_with(&self, magic: u32, out: &mut [u8; 64]) {
        out[0..4].copy_from_slice(&magic.to_le_bytes());
        out[4..6].copy_from_slice(&LAYOUT.to_le_bytes());
        out[6..8].copy_from_slice(&(self.state as u16).to_le_bytes());
        out[8..16].copy_from_slice(&self.namespace.to_le_bytes());
        out[16..24].copy_from_slice(&self.key.hi().to_le_bytes());
        out[24..32].copy_from_slice(&self.key.lo().to_le_bytes());
        out[32..40].copy_from_slice(&self.version.to_le_bytes());
        out[40..48].copy_from_slice(&self.generation.to_le_bytes());
        out[48..56].copy_from_slice(&self.payload_len.to_le_bytes());
        out[56..64].copy_from_slice(&self.checksum.to_le_bytes());
    }

    /// The 64 header bytes for this metadata.
    pub fn encode_header(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        self.encode_with(HEADER_MAGIC, &mut b);
        b
    }

    /// The 64 trailer bytes for this metadata.
    pub fn encode_trailer(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        self.encode_with(TRAILER_MAGIC, &mut b);
        b
    }

    fn decode_with(magic: u32, which: &'static str, b: &[u8]) -> Result<Self, ValidationError> {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        if b.len() < 64
            || u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")) != magic
            || u16::from_le_bytes([b[4], b[5]]) != LAYOUT
        {
            return Err(ValidationError::Magic { which });
        }
        let state = SlotState::from_u16(u16::from_le_bytes([b[6], b[7]])).ok_or(ValidationError::Magic { which })?;
        Ok(SlotMeta {
            state,
            namespace: u64_at(8),
            key: crate::Key::from_parts(u64_at(16), u64_at(24)),
            version: u64_at(32),
            generation: u64_at(40),
            payload_len: u64_at(48),
            checksum: u64_at(56),
        })
    }

    /// Reads a header.
    pub fn decode_header(b: &[u8]) -> Result<Self, ValidationError> {
        Self::decode_with(HEADER_MAGIC, "header", b)
    }

    /// Reads a trailer.
    pub fn decode_trailer(b: &[u8]) -> Result<Self, ValidationError> {
        Self::decode_with(TRAILER_MAGIC, "trailer", b)
    }
}

/// Validates a whole-slot copy (`header | payload capacity | trailer`, as
/// laid out for `payload_capacity`) against what the reader expects, and
/// returns the payload bytes in use. `expected.state` must be `Valid`.
pub fn validate_slot<'a>(
    slot: &'a [u8],
    payload_capacity: u64,
    expected: &SlotMeta,
) -> Result<&'a [u8], ValidationError> {
    let stride = slot_stride(payload_capacity);
    if slot.len() as u64 != stride {
        return Err(ValidationError::Size { expected: stride, found: slot.len() as u64 });
    }
    let t = trailer_offset(payload_capacity) as usize;
    let header = validate_meta(&slot[..HEADER_BYTES], &slot[t..t + TRAILER_BYTES], payload_capacity, expected)?;
    let payload = &slot[HEADER_BYTES..HEADER_BYTES + header.payload_len as usize];
    let found = crate::checksum(payload);
    if found != header.checksum {
        return Err(ValidationError::Checksum { expected: header.checksum, found });
    }
    Ok(payload)
}

/// The checks of [`validate_slot`] that do not read the payload: header
/// and trailer decode, agree (no torn copy), match what the reader
/// expected, and the length fits. For a slot whose payload is checked
/// elsewhere (on a GPU, with the pool's own checksum). Returns the header.
pub fn validate_meta(
    header: &[u8],
    trailer: &[u8],
    payload_capacity: u64,
    expected: &SlotMeta,
) -> Result<SlotMeta, ValidationError> {
    let h = SlotMeta::decode_header(header)?;
    let t = SlotMeta::decode_trailer(trailer)?;
    if h != t {
        return Err(ValidationError::Torn { header: Box::new(h), trailer: Box::new(t) });
    }
    if h != *expected || h.payload_len > payload_capacity {
        return Err(ValidationError::Mismatch { expected: Box::new(*expected), found: Box::new(h) });
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Key;

    fn meta(payload: &[u8]) -> SlotMeta {
        SlotMeta {
            state: SlotState::Valid,
            namespace: 7,
            key: Key(0x1234),
            version: 1,
            generation: 9,
            payload_len: payload.len() as u64,
            checksum: crate::checksum(payload),
        }
    }

    fn build(cap: u64, payload: &[u8], m: &SlotMeta) -> Vec<u8> {
        let mut s = vec![0u8; slot_stride(cap) as usize];
        s[..64].copy_from_slice(&m.encode_header());
        s[64..64 + payload.len()].copy_from_slice(payload);
        let t = trailer_offset(cap) as usize;
        s[t..t + 64].copy_from_slice(&m.encode_trailer());
        s
    }

    #[test]
    fn stride_is_aligned_and_holds_everything() {
        for cap in [1u64, 63, 64, 4096, 65536, 1 << 20] {
            let s = slot_stride(cap);
            assert_eq!(s % SLOT_ALIGN as u64, 0);
            assert!(s >= cap + 128);
            assert!(s < cap + 128 + SLOT_ALIGN as u64);
        }
    }

    #[test]
    fn header_round_trip() {
        let m = meta(b"abc");
        assert_eq!(SlotMeta::decode_header(&m.encode_header()).unwrap(), m);
        assert_eq!(SlotMeta::decode_trailer(&m.encode_trailer()).unwrap(), m);
        assert!(SlotMeta::decode_header(&m.encode_trailer()).is_err());
    }

    #[test]
    fn validation_accepts_good_and_rejects_each_kind_of_bad() {
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let m = meta(&payload);
        let good = build(1024, &payload, &m);
        assert_eq!(validate_slot(&good, 1024, &m).unwrap(), &payload[..]);

        // flipped payload byte
        let mut bad = good.clone();
        bad[100] ^= 1;
        assert!(matches!(validate_slot(&bad, 1024, &m), Err(ValidationError::Checksum { .. })));
        // torn: trailer from the next generation
        let mut torn = good.clone();
        let t = trailer_offset(1024) as usize;
        torn[t..t + 64].copy_from_slice(&SlotMeta { generation: 10, ..m }.encode_trailer());
        assert!(matches!(validate_slot(&torn, 1024, &m), Err(ValidationError::Torn { .. })));
        // reused slot: consistent but another generation
        let reused = build(1024, &payload, &SlotMeta { generation: 10, ..m });
        assert!(matches!(validate_slot(&reused, 1024, &m), Err(ValidationError::Mismatch { .. })));
        // wrong size
        assert!(matches!(validate_slot(&good[1..], 1024, &m), Err(ValidationError::Size { .. })));
        // zeroed header
        let mut zero = good.clone();
        zero[..64].fill(0);
        assert!(matches!(validate_slot(&zero, 1024, &m), Err(ValidationError::Magic { .. })));
    }
}
