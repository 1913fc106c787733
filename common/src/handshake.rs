//! Framing of the fd handshake on the daemon's Unix socket.
//!
//! The engine socket speaks gRPC (HTTP/2), except on connections whose first
//! bytes are [`FD_HANDSHAKE_MAGIC`]: on those the daemon answers with one
//! message carrying the pools' memfds (SCM_RIGHTS) and a small table saying
//! which fd is which pool, then closes. The client maps each memfd once.

/// First bytes a client sends to ask for the pool fds.
pub const FD_HANDSHAKE_MAGIC: &[u8; 12] = b"KVMESH-FD/1\n";

/// Most pools one daemon exposes (and so most fds in one handshake).
pub const POOLS_MAX: usize = 16;

/// One pool in the handshake table; the i-th entry names the i-th fd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolFd {
    /// Pool index, as in `Hello`.
    pub pool: u32,
    /// Size of the memfd in bytes.
    pub bytes: u64,
}

/// Encodes the handshake table: pool count, daemon instance id, then one
/// (pool, bytes) entry per attached fd.
pub fn encode(instance: u64, pools: &[PoolFd]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD + 12 * pools.len());
    out.extend_from_slice(&(pools.len() as u32).to_le_bytes());
    out.extend_from_slice(&instance.to_le_bytes());
    for p in pools {
        out.extend_from_slice(&p.pool.to_le_bytes());
        out.extend_from_slice(&p.bytes.to_le_bytes());
    }
    out
}

const HEAD: usize = 12;

/// Decodes the handshake table, checking it against the number of fds.
/// Returns the daemon instance id and the table.
pub fn decode(buf: &[u8], fds: usize) -> Result<(u64, Vec<PoolFd>), String> {
    if buf.len() < HEAD {
        return Err(format!("handshake reply is {} bytes, expected at least {HEAD}", buf.len()));
    }
    let n = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    let instance = u64::from_le_bytes(buf[4..12].try_into().expect("8 bytes"));
    if n > POOLS_MAX || buf.len() != HEAD + 12 * n || n != fds {
        return Err(format!("handshake reply names {n} pools in {} bytes with {fds} fds attached", buf.len()));
    }
    Ok((
        instance,
        (0..n)
            .map(|i| {
                let b = &buf[HEAD + 12 * i..HEAD + 12 * (i + 1)];
                PoolFd {
                    pool: u32::from_le_bytes(b[..4].try_into().expect("4 bytes")),
                    bytes: u64::from_le_bytes(b[4..].try_into().expect("8 bytes")),
                }
            })
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_mismatch() {
        let t = [PoolFd { pool: 0, bytes: 1 << 28 }, PoolFd { pool: 3, bytes: 4096 }];
        let b = encode(42, &t);
        assert_eq!(decode(&b, 2).unwrap(), (42, t.to_vec()));
        assert!(decode(&b, 1).is_err());
        assert!(decode(&b[..5], 2).is_err());
    }
}
