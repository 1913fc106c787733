//! Framing of the fd handshake on the daemon's Unix socket.
//!
//! The engine socket speaks gRPC (HTTP/2), except on connections whose first
//! bytes are [`FD_HANDSHAKE_MAGIC`]: on those the daemon answers with one
//! message carrying the pools' memfds (SCM_RIGHTS) and a table saying which
//! pool each is, then closes. A pool UCX allocated (a SysV segment, for
//! one-sided shared-memory reads between daemons) travels as its segment id
//! instead of an fd. The client maps each pool once.

/// First bytes a client sends to ask for the pool fds.
pub const FD_HANDSHAKE_MAGIC: &[u8; 12] = b"KVMESH-FD/1\n";

/// First bytes of the daemon's answer to a client it refuses (another uid
/// not in `server.allow_uids`, say), followed by the reason in UTF-8; no
/// fds are attached.
pub const REFUSED_MAGIC: &[u8; 15] = b"KVMESH-REFUSED\n";

/// Most pools one daemon exposes (and so most fds in one handshake).
pub const POOLS_MAX: usize = 16;

/// One pool in the handshake table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolFd {
    /// Pool index, as in `Hello`.
    pub pool: u32,
    /// Size of the pool in bytes.
    pub bytes: u64,
    /// `Some(shmid)`: attach this SysV segment; `None`: the next attached fd
    /// (memfd) is this pool.
    pub sysv: Option<i32>,
}

const HEAD: usize = 12;
const ENTRY: usize = 16;

/// Encodes the handshake table: pool count, daemon instance id, then one
/// (pool, sysv id or -1, bytes) entry per pool, in pool order; memfds are
/// attached in the order of the entries that have no SysV id.
pub fn encode(instance: u64, pools: &[PoolFd]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD + ENTRY * pools.len());
    out.extend_from_slice(&(pools.len() as u32).to_le_bytes());
    out.extend_from_slice(&instance.to_le_bytes());
    for p in pools {
        out.extend_from_slice(&p.pool.to_le_bytes());
        out.extend_from_slice(&p.sysv.unwrap_or(-1).to_le_bytes());
        out.extend_from_slice(&p.bytes.to_le_bytes());
    }
    out
}

/// Decodes the handshake table, checking it against the number of fds.
/// Returns the daemon instance id and the table.
pub fn decode(buf: &[u8], fds: usize) -> Result<(u64, Vec<PoolFd>), String> {
    if let Some(why) = buf.strip_prefix(REFUSED_MAGIC) {
        return Err(format!("the daemon refused this client: {}", String::from_utf8_lossy(why)));
    }
    if buf.len() < HEAD {
        return Err(format!("handshake reply is {} bytes, expected at least {HEAD}", buf.len()));
    }
    let n = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    let instance = u64::from_le_bytes(buf[4..12].try_into().expect("8 bytes"));
    if n > POOLS_MAX || buf.len() != HEAD + ENTRY * n {
        return Err(format!("handshake reply names {n} pools in {} bytes", buf.len()));
    }
    let table: Vec<PoolFd> = (0..n)
        .map(|i| {
            let b = &buf[HEAD + ENTRY * i..HEAD + ENTRY * (i + 1)];
            let id = i32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
            PoolFd {
                pool: u32::from_le_bytes(b[..4].try_into().expect("4 bytes")),
                sysv: (id >= 0).then_some(id),
                bytes: u64::from_le_bytes(b[8..].try_into().expect("8 bytes")),
            }
        })
        .collect();
    let memfds = table.iter().filter(|p| p.sysv.is_none()).count();
    if memfds != fds {
        return Err(format!("handshake reply names {memfds} memfd pools with {fds} fds attached"));
    }
    Ok((instance, table))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_mismatch() {
        let t = [
            PoolFd { pool: 0, bytes: 1 << 28, sysv: None },
            PoolFd { pool: 3, bytes: 4096, sysv: Some(77) },
            PoolFd { pool: 4, bytes: 8192, sysv: None },
        ];
        let b = encode(42, &t);
        assert_eq!(decode(&b, 2).unwrap(), (42, t.to_vec()));
        assert!(decode(&b, 1).is_err());
        assert!(decode(&b[..5], 2).is_err());
        // A refusal carries its reason to the client.
        let refused = [&REFUSED_MAGIC[..], b"uid 7 may not use this daemon"].concat();
        let e = decode(&refused, 0).unwrap_err();
        assert_eq!(e, "the daemon refused this client: uid 7 may not use this daemon");
    }
}

/// First bytes of a fast-path connection on the engine socket (lowercase:
/// its first byte differs from [`FD_HANDSHAKE_MAGIC`]'s and from HTTP/2's
/// preface). The daemon answers with the same bytes, the connection's
/// session id and the daemon's instance id (u64s, little endian; the
/// client checks the instance against `Hello`'s); then both sides exchange
/// frames:
/// `u32 len | u64 id | u8 method-or-status | body` (len counts from `id`).
/// Requests and answers are the engine API's protobuf messages; an answer
/// with a non-zero status carries the gRPC status code and a UTF-8 message.
pub const FAST_MAGIC: &[u8; 14] = b"kvmesh-fast/1\n";

/// Methods of the fast path.
pub mod fast {
    /// `LookupRequest` -> `LookupResponse`.
    pub const LOOKUP: u8 = 1;
    /// `PinRequest` -> `PinResponse`.
    pub const PIN: u8 = 2;
    /// `UnpinRequest` -> `UnpinResponse`.
    pub const UNPIN: u8 = 3;
    /// Bytes of a frame after its length.
    pub const HEAD: usize = 9;
    /// Largest frame body either side accepts.
    pub const FRAME_MAX: usize = 16 << 20;

    /// One frame: `id`, `tag` (method or status), and a body of `body_len`
    /// bytes that `write` appends (encoded in place: no second copy).
    pub fn frame(id: u64, tag: u8, body_len: usize, write: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut f = Vec::with_capacity(4 + HEAD + body_len);
        f.extend_from_slice(&((HEAD + body_len) as u32).to_le_bytes());
        f.extend_from_slice(&id.to_le_bytes());
        f.push(tag);
        write(&mut f);
        debug_assert_eq!(f.len(), 4 + HEAD + body_len, "frame body length");
        f
    }
}
