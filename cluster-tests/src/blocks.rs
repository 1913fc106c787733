//! Blocks whose every byte is checkable: the content of a key at a writer
//! sequence, and the check that a block read is exactly one of them. Used
//! by `kvmesh-nemesis` and the daemon's cluster test.

use kvmesh_client::Key;

/// Bytes of a block.
pub const BLOCK: usize = 4096;

/// Block of `key` at writer sequence `seq`: key and sequence up front, the
/// rest derived from both.
pub fn content(key: Key, seq: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(BLOCK);
    v.extend_from_slice(&key.0.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    let mut x = (key.0 as u64) ^ ((key.0 >> 64) as u64).rotate_left(17) ^ seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while v.len() < BLOCK {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(BLOCK);
    v
}

/// The writer sequence of a block read for `key`, or why it is not exactly
/// the content of `key` at some sequence.
pub fn check(key: Key, bytes: &[u8]) -> Result<u64, String> {
    if bytes.len() != BLOCK {
        return Err(format!("{key}: {} bytes", bytes.len()));
    }
    let k = u128::from_le_bytes(bytes[..16].try_into().expect("16 bytes"));
    if k != key.0 {
        return Err(format!("{key}: the block of another key {k:032x}"));
    }
    let seq = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
    if bytes != content(key, seq) {
        return Err(format!("{key}: bytes differ from sequence {seq}"));
    }
    Ok(seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_checks_and_every_change_is_caught() {
        let k = Key(0x1234_5678_9abc_def0_0fed_cba9_8765_4321);
        let b = content(k, 7);
        assert_eq!(check(k, &b), Ok(7));
        assert!(check(Key(1), &b).is_err(), "another key");
        for i in [0, 16, 24, 100, BLOCK - 1] {
            let mut c = b.clone();
            c[i] ^= 1;
            assert!(check(k, &c).is_err(), "byte {i} flipped");
        }
        assert!(check(k, &b[..BLOCK - 1]).is_err());
        assert_ne!(content(k, 7), content(k, 8));
    }
}
