//! The engine fast path: the hot calls (lookup, pin, unpin; allocate,
//! commit and abort where the client sees `Hello.fast_path_writes`) over a plain
//! framed Unix-socket connection beside gRPC, served by a thread of its own
//! per connection. gRPC (HTTP/2 framing, tonic's tasks, a tokio wake-up on
//! each side) costs about as much as the store work of a pin of 64 blocks
//! on a small machine; here a request is read by a blocking thread and run
//! at once: the service's own handler is polled on that thread, and only a
//! call that has to wait (a remote fetch through the coherence driver, a
//! commit that runs in a task of its own) is handed to the runtime,
//! answering when it ends. Answers carry the
//! request's id, so calls of one connection may overlap.
//!
//! The connection is a session of its own (its pins and uncommitted
//! allocations die with it), served by
//! exactly the handlers gRPC calls, so limits, draining and errors are the
//! same. Framing: [`kvmesh_common::handshake::FAST_MAGIC`].

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvmesh_common::handshake::{FAST_MAGIC, fast};
use kvmesh_proto::engine::v1 as pb;
use kvmesh_proto::engine::v1::engine_server::Engine;
use parking_lot::Mutex;
use prost::Message;
use tonic::Status;

use crate::metrics::{FastAnswer, Metrics};
use crate::service::{ConnInfo, EngineService};

/// Fast-path connections served at once at most (a thread each).
pub const CONNECTIONS_MAX: usize = 256;

/// How long the client may take to send its magic.
const MAGIC_TIMEOUT: Duration = Duration::from_secs(10);
/// Calls of one connection that wait (remote fetches, large commits) at
/// once: at this many the connection's next frame is not read until one
/// ends (an engine pipelining more only waits; one that never stops
/// sending cannot make the daemon hold calls without bound).
pub const WAITING_CALLS_MAX: usize = 1024;
/// How long writing an answer may block (a client that stops reading)
/// before the connection is dropped — with its session, so its pins: as
/// long as the default pin lease, which a client that stalls this long
/// outlives anyway.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Answer bytes queued on one connection at most (answers of calls whose
/// client stopped reading); past it the connection is dropped.
const QUEUED_BYTES_MAX: usize = 64 << 20;

/// The connection's own thread, having queued an answer behind a flusher,
/// waits until the queue is below this before it reads the next request:
/// a client that sends and does not read is slowed down, as when every
/// answer was a blocking write.
const QUEUED_BYTES_RESUME: usize = 1 << 20;

/// The answering side of a connection. Frames go out whole and never
/// interleave. A frame the socket takes at once is written by whoever
/// finished the call — a runtime worker too, since the write never waits
/// (one wake-up less than handing it to a blocking thread); what the
/// socket does not take queues, and one flusher on a thread that may
/// block (the connection's own, or a blocking-pool thread; never a
/// runtime worker) writes the queue out, waiting for the client up to
/// `WRITE_TIMEOUT` per write. While it flushes, later frames queue behind.
///
/// A queued frame's call may end (and drop its hold on the session) before
/// the frame is written: the flusher holds the session meanwhile (the
/// connection thread's, or the one its task took), so pins named in an
/// answer outlive its writing.
struct Writer {
    stream: UnixStream,
    state: Mutex<Queue>,
    /// Signalled when the flusher takes a frame, stops, or fails.
    drained: parking_lot::Condvar,
}

#[derive(Default)]
struct Queue {
    frames: std::collections::VecDeque<Vec<u8>>,
    bytes: usize,
    /// A flusher owns the socket's writes.
    flushing: bool,
    /// A write failed or the queue overflowed: nothing more is written.
    broken: bool,
}

/// What became of an offered frame.
#[derive(Debug, PartialEq, Eq)]
enum Offered {
    /// Written whole.
    Sent,
    /// Queued behind a flusher.
    Queued,
    /// Queued, and the caller is now the flusher: it must call
    /// [`Writer::flush`] from a thread that may block.
    Flush,
}

impl Writer {
    fn new(stream: UnixStream) -> Writer {
        Writer { stream, state: Mutex::default(), drained: parking_lot::Condvar::new() }
    }

    /// Writes `frame` at once when the socket takes it whole, or queues it.
    /// Never waits.
    fn offer(&self, frame: Vec<u8>) -> io::Result<Offered> {
        let mut q = self.state.lock();
        if q.broken {
            return Err(io::Error::other("connection broken"));
        }
        let written = if q.flushing {
            0
        } else {
            match kvmesh_ffi_os::fdpass::send_now(std::os::fd::AsFd::as_fd(&self.stream), &frame) {
                Ok(n) if n == frame.len() => return Ok(Offered::Sent),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                Err(e) => {
                    q.broken = true;
                    return Err(e);
                }
            }
        };
        let rest = frame.len() - written;
        if q.bytes + rest > QUEUED_BYTES_MAX {
            q.broken = true;
            self.drained.notify_all();
            return Err(io::Error::other(format!("over {QUEUED_BYTES_MAX} bytes of answers unread")));
        }
        q.bytes += rest;
        q.frames.push_back(if written == 0 { frame } else { frame[written..].to_vec() });
        if q.flushing {
            return Ok(Offered::Queued);
        }
        q.flushing = true;
        Ok(Offered::Flush)
    }

    /// Writes the queue out, waiting for the client (the flusher only).
    fn flush(&self) -> io::Result<()> {
        loop {
            let frame = {
                let mut q = self.state.lock();
                if q.broken {
                    q.frames.clear();
                    q.bytes = 0;
                    self.drained.notify_all();
                    return Err(io::Error::other("connection broken"));
                }
                let f = q.frames.pop_front();
                match f {
                    Some(f) => {
                        q.bytes -= f.len();
                        self.drained.notify_all();
                        f
                    }
                    None => {
                        q.flushing = false;
                        self.drained.notify_all();
                        return Ok(());
                    }
                }
            };
            if let Err(e) = (&self.stream).write_all(&frame) {
                self.fail();
                return Err(e);
            }
        }
    }

    /// Nothing more is written (a write failed, or a flusher never ran).
    fn fail(&self) {
        let mut q = self.state.lock();
        q.broken = true;
        q.frames.clear();
        q.bytes = 0;
        self.drained.notify_all();
    }

    /// Writes `frame` from a thread that may block: flushes when it has to,
    /// and, queued behind another flusher, waits until the queue is short.
    fn write(&self, frame: Vec<u8>) -> io::Result<()> {
        match self.offer(frame)? {
            Offered::Sent => Ok(()),
            Offered::Flush => self.flush(),
            Offered::Queued => {
                let mut q = self.state.lock();
                while q.flushing && q.bytes > QUEUED_BYTES_RESUME && !q.broken {
                    self.drained.wait(&mut q);
                }
                if q.broken { Err(io::Error::other("connection broken")) } else { Ok(()) }
            }
        }
    }

    fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Held by a flusher handed to a blocking thread: if that thread never runs
/// it (the runtime shutting down), the connection is failed and closed
/// rather than left with frames nobody writes.
struct FlushDuty(Arc<Writer>, bool);

impl Drop for FlushDuty {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fail();
            self.0.shutdown();
        }
    }
}

/// What a fast-path connection needs, set once the service exists.
pub struct FastPath {
    /// The engine service (the same handlers as gRPC).
    pub service: EngineService,
    /// Call metrics (the same histograms as gRPC calls).
    pub metrics: Arc<Metrics>,
    /// The runtime that finishes calls that have to wait.
    pub rt: tokio::runtime::Handle,
    /// Connections being served.
    pub open: AtomicUsize,
    /// This daemon instance (the client checks it against `Hello`'s, so it
    /// never pairs pools of one daemon with pins of another).
    pub instance_id: u64,
    /// After a call answered at once, how long the connection's thread
    /// polls for the next before it sleeps (`server.fast_path_poll_us`).
    pub poll: Duration,
}

/// Counts a served connection until dropped (also when its thread panics).
struct Open(Arc<FastPath>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves one fast-path connection on a thread of its own; `guard` is its
/// session (kept alive by calls still running when the connection ends).
pub fn spawn<G: Send + Sync + 'static>(
    ctx: Arc<FastPath>,
    stream: UnixStream,
    session: u64,
    guard: Arc<G>,
) -> io::Result<()> {
    let counted = ctx.open.fetch_add(1, Ordering::SeqCst);
    let open = Open(Arc::clone(&ctx));
    if counted >= CONNECTIONS_MAX {
        tracing::warn!("fast path: {CONNECTIONS_MAX} connections already served; refused (the client uses gRPC)");
        return Ok(());
    }
    std::thread::Builder::new().name(format!("kvmesh-fast-{session}")).spawn(move || {
        let _open = open;
        if let Err(e) = serve(&ctx, stream, session, &guard) {
            tracing::debug!(session, "fast path connection ended: {e}");
        }
    })?;
    Ok(())
}

fn serve<G: Send + Sync + 'static>(
    ctx: &Arc<FastPath>,
    stream: UnixStream,
    session: u64,
    guard: &Arc<G>,
) -> io::Result<()> {
    // Handlers polled here use the runtime's timers and spawn tasks.
    let _rt = ctx.rt.enter();
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(MAGIC_TIMEOUT))?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let mut reader = stream.try_clone()?;
    let mut magic = [0u8; FAST_MAGIC.len()];
    reader.read_exact(&mut magic)?;
    if &magic != FAST_MAGIC {
        return Err(io::Error::other("bad fast-path magic"));
    }
    let mut hello = FAST_MAGIC.to_vec();
    hello.extend_from_slice(&session.to_le_bytes());
    hello.extend_from_slice(&ctx.instance_id.to_le_bytes());
    (&stream).write_all(&hello)?;
    let writer = Arc::new(Writer::new(stream));
    reader.set_read_timeout(None)?;
    let r = read_calls(ctx, &mut reader, &writer, session, guard);
    // Whatever ended the connection, the client sees it end now (answers
    // still running hold the writer).
    writer.shutdown();
    r
}

fn read_calls<G: Send + Sync + 'static>(
    ctx: &Arc<FastPath>,
    reader: &mut UnixStream,
    writer: &Arc<Writer>,
    session: u64,
    guard: &Arc<G>,
) -> io::Result<()> {
    let mut head = [0u8; 4 + fast::HEAD];
    // When the last call was answered at once (`Some`): the engine's next
    // may follow within microseconds (see `FastPath::poll`). Polled for
    // (after the first such answer) only while this engine's last gap
    // between an answer and its next call was within the bound, so one
    // slower to call again (an async client, a remote fetch in between) is
    // polled for once and then no more until it is quick again. A gap
    // measured without polling includes this thread's own wake-up, so an
    // engine that takes more than about half the bound to call again may
    // not be polled for again (twice the bound was tried: it polled for an
    // async client often enough to slow it by 5-8%). No poll right after a
    // call that waits.
    let mut answered_at: Option<Instant> = None;
    let mut quick = true;
    let waiting = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let me = std::thread::current();
    loop {
        while waiting.load(std::sync::atomic::Ordering::Acquire) >= WAITING_CALLS_MAX {
            // (Unparked by the call that ends; the timeout only guards a
            // wake-up lost to a spurious one.)
            std::thread::park_timeout(Duration::from_millis(10));
        }
        if answered_at.is_some() && quick && !ctx.poll.is_zero() {
            kvmesh_ffi_os::fdpass::spin_until_readable(std::os::fd::AsFd::as_fd(&*reader), ctx.poll);
        }
        match reader.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        if let Some(t) = answered_at.take() {
            quick = t.elapsed() < ctx.poll;
        }
        let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
        let id = u64::from_le_bytes(head[4..12].try_into().expect("8 bytes"));
        let method = head[12];
        if !(fast::HEAD..=fast::HEAD + fast::FRAME_MAX).contains(&len) {
            return Err(io::Error::other(format!("fast-path frame of {len} bytes")));
        }
        let mut body = vec![0u8; len - fast::HEAD];
        reader.read_exact(&mut body)?;
        let started = Instant::now();
        let label = match method {
            fast::LOOKUP => "lookup",
            fast::PIN => "pin",
            fast::UNPIN => "unpin",
            fast::ALLOCATE => "allocate",
            fast::COMMIT => "commit",
            fast::ABORT => "abort",
            _ => "unknown",
        };
        tracing::trace!(session, id, label, "fast call read");
        let call = call(ctx.service.clone(), session, id, method, body);
        let mut call = Box::pin(call);
        // Run it here; a call that has to wait goes on where it is woken
        // (inline.rs).
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match call.as_mut().poll(&mut cx) {
            Poll::Ready(r) => {
                ctx.metrics.count_fast_answer(FastAnswer::Connection);
                writer.write(answer(&ctx.metrics, label, id, r, started))?;
                answered_at = Some(Instant::now());
            }
            Poll::Pending => {
                // The engine waits for this one (a remote fetch): no
                // polling, which would hold a core the fetch's hops need.
                let (w, m, g) = (Arc::clone(writer), Arc::clone(&ctx.metrics), Arc::clone(guard));
                waiting.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                let ended = WaitingCall(Arc::clone(&waiting), me.clone());
                // Continued by the thread that wakes it: mostly the
                // data-plane thread, which writes the answer itself.
                crate::inline::spawn(&ctx.rt, async move {
                    let r = call.await;
                    drop(ended);
                    let failed = |w: &Writer, e: io::Error| {
                        tracing::warn!("fast path: answer not written ({e}); connection closed, its pins released");
                        w.shutdown();
                    };
                    // Written from here when the socket takes it at once;
                    // waiting for a client slow to read is not for a
                    // runtime worker.
                    let on_data_plane = crate::inline::serving();
                    m.count_fast_answer(if on_data_plane { FastAnswer::DataPlane } else { FastAnswer::Other });
                    let sent = w.offer(answer(&m, label, id, r, started));
                    tracing::trace!(id, label, on_data_plane, "fast answer offered");
                    match sent {
                        Ok(Offered::Sent | Offered::Queued) => drop(g),
                        Ok(Offered::Flush) => {
                            let mut duty = FlushDuty(w, false);
                            let _ = tokio::task::spawn_blocking(move || {
                                duty.1 = true;
                                if let Err(e) = duty.0.flush() {
                                    failed(&duty.0, e);
                                }
                                drop(g);
                            })
                            .await;
                        }
                        Err(e) => failed(&w, e),
                    }
                });
            }
        }
    }
}

/// A call of a connection that waits: counted until it has its answer
/// (dropped, also if its task is), when the connection's reader, stopped
/// at [`WAITING_CALLS_MAX`], is unparked.
struct WaitingCall(Arc<std::sync::atomic::AtomicUsize>, std::thread::Thread);

impl Drop for WaitingCall {
    fn drop(&mut self) {
        if self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == WAITING_CALLS_MAX {
            self.1.unpark();
        }
    }
}

/// The answer frame of a call that succeeded: the message encoded in place.
fn ok_frame<M: Message>(id: u64, m: &M) -> Vec<u8> {
    fast::frame(id, 0, m.encoded_len(), |v| m.encode(v).expect("a Vec grows"))
}

/// Runs one call through the service's handler, as gRPC would; the
/// answer comes back as a whole frame.
async fn call(svc: EngineService, session: u64, id: u64, method: u8, body: Vec<u8>) -> Result<Vec<u8>, Status> {
    fn req<T>(m: T, session: u64) -> tonic::Request<T> {
        let mut r = tonic::Request::new(m);
        r.extensions_mut().insert(ConnInfo { session, hold: None });
        r
    }
    enum Decoded {
        Lookup(pb::LookupRequest),
        Pin(pb::PinRequest),
        Unpin(pb::UnpinRequest),
        Allocate(pb::AllocateRequest),
        Commit(pb::CommitRequest),
        Abort(pb::AbortRequest),
    }
    let bad = |e: prost::DecodeError| Status::invalid_argument(format!("undecodable request: {e}"));
    // Decoded, then the frame dropped, before anything waits: a call that
    // waits holds its request, not the frame it came in (which may carry
    // up to `FRAME_MAX` of fields the request does not have).
    let m = match method {
        fast::LOOKUP => Decoded::Lookup(pb::LookupRequest::decode(&body[..]).map_err(bad)?),
        fast::PIN => Decoded::Pin(pb::PinRequest::decode(&body[..]).map_err(bad)?),
        fast::UNPIN => Decoded::Unpin(pb::UnpinRequest::decode(&body[..]).map_err(bad)?),
        fast::ALLOCATE => Decoded::Allocate(pb::AllocateRequest::decode(&body[..]).map_err(bad)?),
        fast::COMMIT => Decoded::Commit(pb::CommitRequest::decode(&body[..]).map_err(bad)?),
        fast::ABORT => Decoded::Abort(pb::AbortRequest::decode(&body[..]).map_err(bad)?),
        other => return Err(Status::unimplemented(format!("fast-path method {other}"))),
    };
    drop(body);
    Ok(match m {
        Decoded::Lookup(m) => ok_frame(id, &svc.lookup(req(m, session)).await?.into_inner()),
        Decoded::Pin(m) => ok_frame(id, &svc.pin(req(m, session)).await?.into_inner()),
        Decoded::Unpin(m) => ok_frame(id, &svc.unpin(req(m, session)).await?.into_inner()),
        Decoded::Allocate(m) => ok_frame(id, &svc.allocate(req(m, session)).await?.into_inner()),
        Decoded::Commit(m) => ok_frame(id, &svc.commit(req(m, session)).await?.into_inner()),
        Decoded::Abort(m) => ok_frame(id, &svc.abort(req(m, session)).await?.into_inner()),
    })
}

/// The answer frame of a call (counted in the call metrics).
fn answer(metrics: &Metrics, label: &'static str, id: u64, r: Result<Vec<u8>, Status>, started: Instant) -> Vec<u8> {
    metrics.observe_call(label, r.is_ok(), started);
    r.unwrap_or_else(|s| {
        let msg = s.message().as_bytes();
        fast::frame(id, s.code() as i32 as u8, msg.len(), |v| v.extend_from_slice(msg))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writer() -> (Arc<Writer>, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        (Arc::new(Writer::new(a)), b)
    }

    fn frame(i: u32, len: usize) -> Vec<u8> {
        let mut f = vec![(i % 251) as u8; len];
        f[..4].copy_from_slice(&i.to_le_bytes());
        f
    }

    #[test]
    fn answers_go_out_whole_and_in_order_when_the_socket_is_full() {
        let (w, mut client) = writer();
        // Taken at once: nothing queues, nobody has to flush.
        assert_eq!(w.offer(frame(0, 100)).unwrap(), Offered::Sent);
        let mut got = vec![0u8; 100];
        client.read_exact(&mut got).unwrap();
        assert_eq!(got, frame(0, 100));
        // A client that does not read: the socket fills, the frame that
        // does not fit makes its writer the flusher, later ones queue.
        let mut sent = fill(&w);
        for i in 2000..2020u32 {
            let f = frame(i, 1000 + i as usize);
            sent.extend_from_slice(&f);
            assert_eq!(w.offer(f).unwrap(), Offered::Queued, "one flusher at a time");
        }
        let reader = read_all(client, sent.len());
        w.flush().unwrap();
        assert_eq!(reader.join().unwrap(), sent, "frames interleaved or lost");
        // Flushed: frames go straight out again.
        assert!(!w.state.lock().flushing);
    }

    #[test]
    fn a_client_that_never_reads_breaks_its_connection_not_the_daemon() {
        let (w, _client) = writer();
        let mut queued = 0usize;
        let err = loop {
            match w.offer(vec![1u8; 1 << 20]) {
                Ok(_) => queued += 1,
                Err(e) => break e,
            }
            assert!(queued < 1000, "the queue has no bound");
        };
        assert!(err.to_string().contains("unread"), "{err}");
        assert!(w.state.lock().bytes <= QUEUED_BYTES_MAX);
        assert!(w.offer(vec![1u8; 10]).is_err(), "a broken connection takes nothing more");
    }

    /// Offers frames of 64 KiB until the socket is full; returns the bytes
    /// offered (the caller is then the flusher).
    fn fill(w: &Writer) -> Vec<u8> {
        let mut sent = Vec::new();
        for i in 1..1000u32 {
            let f = frame(i, 64 << 10);
            sent.extend_from_slice(&f);
            match w.offer(f).unwrap() {
                Offered::Sent => {}
                Offered::Flush => return sent,
                Offered::Queued => panic!("queued with no flusher"),
            }
        }
        panic!("64 MiB went into a socket nobody reads");
    }

    /// Reads `total` bytes from the client's end on a thread of its own.
    fn read_all(mut client: UnixStream, total: usize) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut all = vec![0u8; total];
            client.read_exact(&mut all).unwrap();
            all
        })
    }

    #[test]
    fn the_connection_thread_waits_for_a_long_queue_before_reading_on() {
        let (w, client) = writer();
        let mut sent = fill(&w);
        for i in 0..40u32 {
            let f = frame(5000 + i, 64 << 10);
            sent.extend_from_slice(&f);
            assert_eq!(w.offer(f).unwrap(), Offered::Queued);
        }
        // 2.5 MiB queued behind the flusher: the connection thread's write
        // queues its frame and waits.
        let last = frame(9999, 300);
        sent.extend_from_slice(&last);
        let w2 = Arc::clone(&w);
        let conn_thread = std::thread::spawn(move || w2.write(last));
        std::thread::sleep(Duration::from_millis(100));
        assert!(!conn_thread.is_finished(), "wrote on over a queue of {} bytes", w.state.lock().bytes);
        let reader = read_all(client, sent.len());
        w.flush().unwrap();
        conn_thread.join().unwrap().unwrap();
        assert_eq!(reader.join().unwrap(), sent);
    }

    #[test]
    fn a_flusher_that_never_runs_closes_the_connection() {
        let (w, _client) = writer();
        fill(&w);
        assert_eq!(w.offer(frame(1, 10)).unwrap(), Offered::Queued);
        drop(FlushDuty(Arc::clone(&w), false));
        assert!(w.offer(frame(2, 10)).is_err(), "frames taken that nobody will write");
        assert!(w.write(frame(3, 10)).is_err());
    }
}
