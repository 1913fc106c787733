//! Passing file descriptors over Unix sockets (SCM_RIGHTS) and peeking at a
//! socket's first bytes without consuming them.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recv, recvmsg, send, sendmsg};

/// Sends `payload` with `fds` attached, in one message.
pub fn send_fds(sock: BorrowedFd<'_>, payload: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsgs = [ControlMessage::ScmRights(&raw)];
    let iov = [IoSlice::new(payload)];
    let n = sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    if n != payload.len() {
        return Err(std::io::Error::other(format!("short send of fd message: {n} of {}", payload.len())));
    }
    Ok(())
}

/// Receives one message into `buf` with at most `fds_max` fds attached.
/// Returns the payload length and the fds, each owned (closed on drop).
pub fn recv_fds(sock: BorrowedFd<'_>, buf: &mut [u8], fds_max: usize) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut cmsg = vec![0u8; nix::sys::socket::cmsg_space::<RawFd>() * fds_max.max(1)];
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: the kernel just installed `fd` in this process for
                // us (SCM_RIGHTS); nothing else owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC) || msg.flags.contains(MsgFlags::MSG_TRUNC);
    let n = msg.bytes;
    if truncated {
        return Err(std::io::Error::other("fd message truncated (more fds or bytes than expected)"));
    }
    Ok((n, fds))
}

/// Reads up to `buf.len()` bytes without consuming them (MSG_PEEK,
/// non-blocking). `WouldBlock` when nothing is there yet.
pub fn peek(sock: BorrowedFd<'_>, buf: &mut [u8]) -> std::io::Result<usize> {
    Ok(recv(sock.as_raw_fd(), buf, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT)?)
}

/// Polls `sock` (non-blocking peeks) for up to `limit` until something
/// can be read (or the socket reports an error or its end): a thread that
/// then reads finds it there without having slept. Returns whether it did.
pub fn spin_until_readable(sock: BorrowedFd<'_>, limit: std::time::Duration) -> bool {
    let t0 = std::time::Instant::now();
    let mut b = [0u8; 1];
    while t0.elapsed() < limit {
        match peek(sock, &mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            _ => return true,
        }
    }
    false
}

/// Writes as much of `buf` as the socket takes at once, without waiting
/// (MSG_DONTWAIT; no SIGPIPE). Returns the bytes written (possibly fewer
/// than asked); `WouldBlock` when it takes none.
pub fn send_now(sock: BorrowedFd<'_>, buf: &[u8]) -> std::io::Result<usize> {
    Ok(send(sock.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL)?)
}

/// Writes all of `buf` to a socket, waiting while it is full (a blocking
/// socket), and without SIGPIPE where the peer is gone: a process that
/// links the client (a C or Python engine) keeps SIGPIPE's default, which
/// would kill it. Interrupted sends are resumed.
pub fn send_all(sock: BorrowedFd<'_>, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match send(sock.as_raw_fd(), buf, MsgFlags::MSG_NOSIGNAL) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn send_all_writes_everything_and_reports_a_gone_peer() {
        let (a, mut b) = UnixStream::pair().unwrap();
        // More than a socket buffer: the reader drains while it waits.
        let data: Vec<u8> = (0..1_000_000u32).map(|i| i as u8).collect();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            b.read_to_end(&mut got).unwrap();
            got
        });
        send_all(a.as_fd(), &data).unwrap();
        drop(a);
        assert_eq!(reader.join().unwrap(), data);
        // The peer gone: an error (EPIPE). (This test's binary ignores
        // SIGPIPE, as every Rust program does; MSG_NOSIGNAL is for hosts
        // that do not.)
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        let e = send_all(a.as_fd(), b"late").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    }

    #[test]
    fn spin_until_readable_waits_for_bytes_or_the_end_and_consumes_nothing() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let limit = std::time::Duration::from_millis(5);
        let t0 = std::time::Instant::now();
        assert!(!spin_until_readable(a.as_fd(), limit), "nothing was sent");
        assert!(t0.elapsed() >= limit);
        b.write_all(b"x").unwrap();
        assert!(spin_until_readable(a.as_fd(), limit));
        let mut got = [0u8; 1];
        (&a).read_exact(&mut got).unwrap();
        assert_eq!(&got, b"x", "the peeked byte is still there to read");
        drop(b);
        assert!(spin_until_readable(a.as_fd(), limit), "the peer's end is readable");
    }

    #[test]
    fn fds_travel_and_stay_usable() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut p1, p2) = UnixStream::pair().unwrap();
        send_fds(a.as_fd(), b"table", &[p2.as_fd()]).unwrap();
        drop(p2);
        let mut buf = [0u8; 16];
        let (n, fds) = recv_fds(b.as_fd(), &mut buf, 4).unwrap();
        assert_eq!(&buf[..n], b"table");
        assert_eq!(fds.len(), 1);
        let mut p2 = UnixStream::from(fds.into_iter().next().unwrap());
        p2.write_all(b"x").unwrap();
        let mut got = [0u8; 1];
        p1.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"x");
    }

    #[test]
    fn peek_does_not_consume() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let mut buf = [0u8; 4];
        assert_eq!(peek(b.as_fd(), &mut buf).unwrap_err().kind(), std::io::ErrorKind::WouldBlock);
        a.write_all(b"abcd").unwrap();
        assert_eq!(peek(b.as_fd(), &mut buf).unwrap(), 4);
        let mut all = [0u8; 4];
        b.read_exact(&mut all).unwrap();
        assert_eq!(&all, b"abcd");
    }

    #[test]
    fn send_now_never_waits() {
        let (a, mut b) = UnixStream::pair().unwrap();
        assert_eq!(send_now(a.as_fd(), b"abcd").unwrap(), 4);
        let mut got = [0u8; 4];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"abcd");
        // Fill the socket: a send then takes part of what it is given, or
        // nothing (WouldBlock), and returns at once either way.
        let chunk = vec![7u8; 1 << 16];
        let mut short = false;
        for _ in 0..1024 {
            match send_now(a.as_fd(), &chunk) {
                Ok(n) if n == chunk.len() => {}
                Ok(_) => short = true,
                Err(e) => {
                    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
                    short = true;
                }
            }
            if short {
                break;
            }
        }
        assert!(short, "64 MiB went into a socket nobody reads");
    }
}
