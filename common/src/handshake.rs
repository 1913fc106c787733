//! Framing of the fd handshake on the daemon's Unix socket.
//!
//! The engine socket speaks gRPC (HTTP/2), except on connections whose first
//! bytes are [`FD_HANDSHAKE_MAGIC`]: on those the daemon answers with one
//! message carrying the pools' fds (SCM_RIGHTS) and a table saying which
//! pool each is, then closes. A host pool travels as its memfd; a pool UCX
//! allocated (a SysV segment, for one-sided shared-memory reads between
//! daemons) as its segment id instead of an fd; a GPU pool as the POSIX fd
//! of its CUDA allocation (`cuMemExportToShareableHandle`) and the device
//! ordinal. The client maps (or imports) each pool once.

/// First bytes a client sends to ask for the pool fds (version 2: pool
/// kinds in the table; a version-1 client is refused at the magic).
pub const FD_HANDSHAKE_MAGIC: &[u8; 12] = b"KVMESH-FD/2\n";

/// First bytes of the daemon's answer to a client it refuses (another uid
/// not in `server.allow_uids`, say), followed by the reason in UTF-8; no
/// fds are attached.
pub const REFUSED_MAGIC: &[u8; 15] = b"KVMESH-REFUSED\n";

/// Most pools one daemon exposes (and so most fds in one handshake).
pub const POOLS_MAX: usize = 16;

/// How a pool reaches the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolKind {
    /// The next attached fd is the pool's memfd: map it.
    Memfd,
    /// Attach this SysV segment (no fd).
    SysV(i32),
    /// The next attached fd is a CUDA allocation of device N: import it.
    Cuda(u32),
}

impl PoolKind {
    /// Whether an fd is attached for this pool.
    pub fn has_fd(self) -> bool {
        !matches!(self, PoolKind::SysV(_))
    }
}

/// One pool in the handshake table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolFd {
    /// Pool index, as in `Hello`.
    pub pool: u32,
    /// Size of the pool in bytes.
    pub bytes: u64,
    /// How to map it.
    pub kind: PoolKind,
}

const HEAD: usize = 12;
const ENTRY: usize = 24;

/// Encodes the handshake table: pool count, daemon instance id, then one
/// (pool, kind, argument, 0, bytes) entry per pool, in pool order — kind 0
/// memfd, 1 SysV (argument: the segment id), 2 CUDA (argument: the device
/// ordinal); fds are attached in the order of the entries that have one.
pub fn encode(instance: u64, pools: &[PoolFd]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD + ENTRY * pools.len());
    out.extend_from_slice(&(pools.len() as u32).to_le_bytes());
    out.extend_from_slice(&instance.to_le_bytes());
    for p in pools {
        let (kind, arg): (u32, i32) = match p.kind {
            PoolKind::Memfd => (0, 0),
            PoolKind::SysV(id) => (1, id),
            PoolKind::Cuda(d) => (2, d as i32),
        };
        out.extend_from_slice(&p.pool.to_le_bytes());
        out.extend_from_slice(&kind.to_le_bytes());
        out.extend_from_slice(&arg.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
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
    let mut table = Vec::with_capacity(n);
    for i in 0..n {
        let b = &buf[HEAD + ENTRY * i..HEAD + ENTRY * (i + 1)];
        let u = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let arg = u(8) as i32;
        let kind = match (u(4), arg) {
            (0, _) => PoolKind::Memfd,
            (1, id) if id >= 0 => PoolKind::SysV(id),
            (2, d) if d >= 0 => PoolKind::Cuda(d as u32),
            (k, a) => return Err(format!("handshake reply: pool entry {i} has kind {k} with argument {a}")),
        };
        table.push(PoolFd { pool: u(0), kind, bytes: u64::from_le_bytes(b[16..].try_into().expect("8 bytes")) });
    }
    let with_fd = table.iter().filter(|p| p.kind.has_fd()).count();
    if with_fd != fds {
        return Err(format!("handshake reply names {with_fd} pools with an fd, {fds} fds attached"));
    }
    Ok((instance, table))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_mismatch() {
        let t = [
            PoolFd { pool: 0, bytes: 1 << 28, kind: PoolKind::Memfd },
            PoolFd { pool: 3, bytes: 4096, kind: PoolKind::SysV(77) },
            PoolFd { pool: 4, bytes: 8192, kind: PoolKind::Memfd },
            PoolFd { pool: 5, bytes: 1 << 30, kind: PoolKind::Cuda(1) },
        ];
        let b = encode(42, &t);
        assert_eq!(decode(&b, 3).unwrap(), (42, t.to_vec()));
        assert!(decode(&b, 2).is_err());
        assert!(decode(&b[..5], 3).is_err());
        // An unknown kind, or a negative id, is refused.
        let mut bad = b.clone();
        bad[HEAD + 4] = 9;
        assert!(decode(&bad, 3).unwrap_err().contains("kind 9"));
        let mut bad = b.clone();
        bad[HEAD + ENTRY + 8..HEAD + ENTRY + 12].copy_from_slice(&(-5i32).to_le_bytes());
        assert!(decode(&bad, 3).is_err());
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
    /// `AllocateRequest` -> `AllocateResponse` (daemons whose `Hello` says
    /// `fast_path_writes`, as the next two).
    pub const ALLOCATE: u8 = 4;
    /// `CommitRequest` -> `CommitResponse`.
    pub const COMMIT: u8 = 5;
    /// `AbortRequest` -> `AbortResponse`.
    pub const ABORT: u8 = 6;
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
