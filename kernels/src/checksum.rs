//! `kvsum64`: the payload checksum of blocks in GPU pools, and its CPU
//! reference.
//!
//! Host pools checksum payloads with xxh3-64, which is fast on a CPU but
//! sequential in its 1 KiB stripes: a GPU would hash a 1 MiB block on a
//! handful of threads. `kvsum64` is built to be computed by every GPU
//! thread at once and summed in any order:
//!
//! ```text
//! w_i  = little-endian u64 of payload bytes [8i, 8i+8)   (the last one zero-padded)
//! h_i  = fmix64(w_i XOR (i + 1) * P1)                    (P1 odd: the key is never 0)
//! S    = sum of h_i mod 2^64                             (order-free: a tree, atomics, any grid)
//! sum  = fmix64(S XOR len * P2 XOR SEED)
//! ```
//!
//! `fmix64` is MurmurHash3's 64-bit finaliser, a bijection. Strength, for
//! what a checksum here must catch (torn or partial copies, stale or reused
//! slots, bit flips, a transfer that moved the wrong bytes):
//! - any change confined to one 8-byte word changes `h_i` (a bijection of
//!   `w_i` for a fixed `i`) and so `S` and `sum`: such corruption is always
//!   caught, not just with high probability;
//! - words are keyed by position, so moved or swapped words change the sum
//!   (unless two mixed values collide: probability about 2^-64);
//! - the length is mixed in, so a truncated copy or one with trailing zeros
//!   differs;
//! - changes to several words are caught unless their `h` deltas sum to 0
//!   mod 2^64, about 2^-64 for unrelated data.
//!
//! It is not a cryptographic MAC (neither is xxh3): a peer that wants to
//! forge a block can compute it. Hostile peers are kept out by mutual TLS
//! and the coherence checks (docs/SECURITY.md), not by the checksum.
//!
//! The CUDA kernel (`cuda.rs`, `KVSUM_PARTIAL`) computes `S` with a
//! grid-stride loop, warp shuffles and one 64-bit atomic add per warp; the
//! host applies the final mix. Both must equal [`kvsum64`] byte for byte.

/// Multiplier of the word keys (the golden ratio, odd).
pub const P1: u64 = 0x9E37_79B9_7F4A_7C15;
/// Multiplier of the length.
pub const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
/// Seed of the final mix (`"kvsum64\0"` little-endian), so a payload of
/// zeros does not sum to a small number.
pub const SEED: u64 = u64::from_le_bytes(*b"kvsum64\0");

/// MurmurHash3's 64-bit finaliser (a bijection of u64).
#[inline]
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// The mixed value of word `i` (`w` already read little-endian).
#[inline]
pub fn word(i: u64, w: u64) -> u64 {
    fmix64(w ^ (i.wrapping_add(1)).wrapping_mul(P1))
}

/// The partial sum `S` of `bytes`, whose first word is word `first` of the
/// payload (`first` lets a payload be summed in pieces that start on word
/// boundaries; pieces' partial sums add up).
pub fn partial(bytes: &[u8], first: u64) -> u64 {
    let mut s = 0u64;
    let mut chunks = bytes.chunks_exact(8);
    let mut i = first;
    for c in &mut chunks {
        let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        s = s.wrapping_add(word(i, w));
        i += 1;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut b = [0u8; 8];
        b[..rest.len()].copy_from_slice(rest);
        s = s.wrapping_add(word(i, u64::from_le_bytes(b)));
    }
    s
}

/// The final mix of a partial sum over a payload of `len` bytes.
#[inline]
pub fn finish(s: u64, len: u64) -> u64 {
    fmix64(s ^ len.wrapping_mul(P2) ^ SEED)
}

/// `kvsum64` of a whole payload (the CPU reference of the GPU kernel).
pub fn kvsum64(bytes: &[u8]) -> u64 {
    finish(partial(bytes, 0), bytes.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fmix64_matches_murmur3_and_is_a_bijection_on_samples() {
        // MurmurHash3's finaliser maps 0 to 0 and 1 to this constant
        // (computed by hand from the reference `fmix64`).
        assert_eq!(fmix64(0), 0);
        let mut k: u64 = 1;
        k ^= k >> 33;
        k = k.wrapping_mul(0xff51afd7ed558ccd);
        k ^= k >> 33;
        k = k.wrapping_mul(0xc4ceb9fe1a85ec53);
        k ^= k >> 33;
        assert_eq!(fmix64(1), k);
        assert_eq!(fmix64(1), 0xb456_bcfc_34c2_cb2c);
        let mut seen = std::collections::HashSet::new();
        for x in 0..100_000u64 {
            assert!(seen.insert(fmix64(x.wrapping_mul(0x1234_5678_9abc_def1))));
        }
    }

    #[test]
    fn hand_computed_small_cases() {
        // Empty payload: S = 0.
        assert_eq!(kvsum64(&[]), fmix64(SEED));
        // One byte 0x01: w_0 = 1, key_0 = P1.
        assert_eq!(kvsum64(&[1]), fmix64(fmix64(1 ^ P1) ^ P2 ^ SEED));
        // Nine bytes: a full word and a padded one.
        let b = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let w0 = 0x0807_0605_0403_0201u64;
        let s = fmix64(w0 ^ P1).wrapping_add(fmix64(9 ^ 2u64.wrapping_mul(P1)));
        assert_eq!(kvsum64(&b), fmix64(s ^ 9u64.wrapping_mul(P2) ^ SEED));
    }

    #[test]
    fn pieces_on_word_boundaries_add_up_in_any_order() {
        let data: Vec<u8> = (0..10_007u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        let whole = kvsum64(&data);
        let mut s = 0u64;
        // Pieces of 8 * k bytes, summed back to front.
        let cuts = [0usize, 8, 800, 4096, 8000, data.len()];
        for w in cuts.windows(2).rev() {
            s = s.wrapping_add(partial(&data[w[0]..w[1]], (w[0] / 8) as u64));
        }
        assert_eq!(finish(s, data.len() as u64), whole);
    }

    #[test]
    fn catches_flips_swaps_truncation_and_zero_tails() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(40_503) >> 5) as u8).collect();
        let base = kvsum64(&data);
        // Every single-bit flip of the first and last 128 bytes.
        for at in (0..128).chain(data.len() - 128..data.len()) {
            for bit in 0..8 {
                let mut d = data.clone();
                d[at] ^= 1 << bit;
                assert_ne!(kvsum64(&d), base, "flip at {at} bit {bit}");
            }
        }
        // Two words swapped.
        let mut d = data.clone();
        let (a, b) = d.split_at_mut(8);
        a.swap_with_slice(&mut b[..8]);
        assert_ne!(kvsum64(&d), base);
        // Truncated, or padded with zeros.
        assert_ne!(kvsum64(&data[..data.len() - 1]), base);
        let mut z = data.clone();
        z.extend_from_slice(&[0; 8]);
        assert_ne!(kvsum64(&z), base);
        // Zeros of different lengths differ.
        assert_ne!(kvsum64(&[0; 64]), kvsum64(&[0; 72]));
    }
}
