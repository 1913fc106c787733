//! The client side of the engine fast path (see the daemon's `fast`
//! module): lookup, pin and unpin — and allocate, commit and abort where
//! the daemon's `Hello` says `fast_path_writes` — as framed protobuf
//! messages over a second Unix-socket connection, without HTTP/2. Calls may overlap: each frame
//! carries an id, and every answer is handed to its caller by id.
//!
//! Two ways to wait for answers, chosen when the client connects:
//! - [`TaskFast`] (the async client): a writer task and a reader task on the
//!   runtime; a caller queues its frame and awaits a oneshot.
//! - [`CallerFast`] (the blocking client, so the C ABI and Python): the
//!   calling thread writes its frame itself and, when no other caller is
//!   reading, reads the connection itself until its own answer comes,
//!   handing any other caller's answer to it on the way (one reader at a
//!   time; the others park, and the reader unparks the one whose answer it
//!   read, and one still waiting when it got its own: that one reads next). A lone caller thus blocks in `read` on the
//!   socket and is woken by the daemon's answer: no runtime thread between
//!   them (two thread wake-ups fewer per call than the task path).
//!
//! The connection is its own session in the daemon, so every pin made here
//! is released here (the client routes all pins and unpins through it),
//! and every allocation made here is committed or aborted here.
//! When the daemon does not offer it (or `KVMESH_FAST_PATH=off`), the client
//! uses gRPC for everything.

use std::cell::Cell;
use std::collections::HashMap;
use std::io::Read;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvmesh_common::handshake::{FAST_MAGIC, fast};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::oneshot;

use crate::{ClientError, Result};

type Answer = std::result::Result<Vec<u8>, tonic::Status>;

/// What a call says once the connection is gone.
const CLOSED: &str = "the fast-path connection to kvmeshd closed (the pins and unfinished puts taken over it were released; create a new client)";

/// Writes whole frames in order until the client or the connection goes.
async fn write_frames(mut w: OwnedWriteHalf, mut frames: tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>) {
    while let Some(f) = frames.recv().await {
        if let Err(e) = w.write_all(&f).await {
            tracing::debug!("kvmesh fast path: write failed: {e}");
            return;
        }
    }
}
type Waiting = Arc<std::sync::Mutex<Option<HashMap<u64, oneshot::Sender<Answer>>>>>;

/// How long the daemon may take to answer the fast-path magic.
const OPEN_TIMEOUT: Duration = Duration::from_secs(2);

pub(crate) struct TaskFast {
    /// Whole frames to the writer task: a caller that gives up mid-call
    /// can never leave half a frame on the connection.
    writer: tokio::sync::mpsc::UnboundedSender<Vec<u8>>,
    /// Callers waiting for an answer; `None` once the connection is gone.
    waiting: Waiting,
    next: AtomicU64,
}

/// Whether the environment turns the fast path off.
pub(crate) fn disabled() -> bool {
    matches!(std::env::var("KVMESH_FAST_PATH").as_deref(), Ok("off" | "0" | "false"))
}

impl TaskFast {
    /// Opens the fast path to daemon instance `instance` (from `Hello`);
    /// `None` when the daemon does not offer it (or is another instance:
    /// it restarted since the handshake).
    async fn connect(path: &Path, instance: u64) -> Option<UnixStream> {
        let attempt = async {
            let mut s = UnixStream::connect(path).await?;
            s.write_all(FAST_MAGIC).await?;
            let mut back = [0u8; FAST_MAGIC.len() + 16];
            s.read_exact(&mut back).await?;
            if &back[..FAST_MAGIC.len()] != FAST_MAGIC {
                return Err(std::io::Error::other("the daemon does not speak the fast path"));
            }
            let theirs = u64::from_le_bytes(back[FAST_MAGIC.len() + 8..].try_into().expect("8 bytes"));
            if theirs != instance {
                return Err(std::io::Error::other("another daemon instance answered (it restarted)"));
            }
            Ok::<_, std::io::Error>(s)
        };
        let s = match tokio::time::timeout(OPEN_TIMEOUT, attempt).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!("kvmesh fast path not available ({e}); using gRPC");
                return None;
            }
            Err(_) => {
                tracing::debug!("kvmesh fast path did not answer; using gRPC");
                return None;
            }
        };
        Some(s)
    }

    fn start(s: UnixStream) -> TaskFast {
        let (mut reader, writer) = s.into_split();
        let (to_writer, frames) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
        tokio::spawn(write_frames(writer, frames));
        let waiting: Waiting = Arc::new(std::sync::Mutex::new(Some(HashMap::new())));
        let w = Arc::clone(&waiting);
        tokio::spawn(async move {
            let end = loop {
                let mut head = [0u8; 4 + fast::HEAD];
                if let Err(e) = reader.read_exact(&mut head).await {
                    break format!("{CLOSED}: {e}");
                }
                let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
                let id = u64::from_le_bytes(head[4..12].try_into().expect("8 bytes"));
                if !(fast::HEAD..=fast::HEAD + fast::FRAME_MAX).contains(&len) {
                    break format!("kvmeshd sent a fast-path frame of {len} bytes");
                }
                let mut body = vec![0u8; len - fast::HEAD];
                if let Err(e) = reader.read_exact(&mut body).await {
                    break format!("{CLOSED}: {e}");
                }
                let answer = match head[12] {
                    0 => Ok(body),
                    code => Err(tonic::Status::new(
                        tonic::Code::from(code as i32),
                        String::from_utf8_lossy(&body).into_owned(),
                    )),
                };
                let tx = w.lock().unwrap_or_else(|e| e.into_inner()).as_mut().and_then(|m| m.remove(&id));
                if let Some(tx) = tx {
                    let _ = tx.send(answer);
                }
            };
            // Whoever still waits learns why.
            let left = w.lock().unwrap_or_else(|e| e.into_inner()).take();
            for (_, tx) in left.into_iter().flatten() {
                let _ = tx.send(Err(tonic::Status::unavailable(end.clone())));
            }
        });
        TaskFast { writer: to_writer, waiting, next: AtomicU64::new(1) }
    }

    /// One call: `req` encoded, the answer's body.
    async fn call<Req: Message>(&self, method: u8, req: &Req) -> Result<Vec<u8>> {
        let len = checked_len(req)?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        match self.waiting.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            Some(m) => m.insert(id, tx),
            None => return Err(tonic::Status::unavailable(CLOSED).into()),
        };
        let frame = fast::frame(id, method, len, |v| req.encode(v).expect("a Vec grows"));
        if self.writer.send(frame).is_err() {
            if let Some(m) = self.waiting.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                m.remove(&id);
            }
            return Err(tonic::Status::unavailable(CLOSED).into());
        }
        Ok(rx.await.map_err(|_| tonic::Status::unavailable(CLOSED))??)
    }
}

/// The encoded length of `req`, refused where no frame can carry it.
fn checked_len<Req: Message>(req: &Req) -> Result<usize> {
    let len = req.encoded_len();
    if len > fast::FRAME_MAX {
        return Err(ClientError::InvalidArgument(format!("request of {len} bytes is too large")));
    }
    Ok(len)
}

/// How a client waits for the fast path's answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Reader and writer tasks on the runtime (async callers).
    Tasks,
    /// The calling threads read and write the connection themselves
    /// (callers that block: [`crate::blocking::Client`]).
    Callers,
}

/// An open fast path.
pub(crate) enum Fast {
    Tasks(TaskFast),
    /// With the client's runtime, whose blocking pool takes calls made
    /// where the thread must not block.
    Callers(Arc<CallerFast>, tokio::runtime::Handle),
}

impl Drop for Fast {
    /// The client is gone: a background call still blocked on the socket
    /// (an unpin to a daemon that hangs) returns, and the session closes.
    fn drop(&mut self) {
        if let Fast::Callers(c, _) = self {
            c.end(format!("{CLOSED}: the client was dropped"));
        }
    }
}

thread_local! {
    /// Set while this thread runs a call of the blocking client to its end
    /// (`blocking::Client::block_on`): it may block in the socket's `read`.
    static CALLER_BLOCKS: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread marked as one that may block on the fast
/// path's socket (the blocking client's calls). Anywhere else (a runtime
/// worker: the background release of dropped pins, or the async client
/// taken out of a blocking one with `inner()`), a [`CallerFast`] call is
/// moved to the runtime's blocking pool rather than block a worker.
pub(crate) fn as_blocking_caller<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            CALLER_BLOCKS.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CALLER_BLOCKS.with(|c| c.replace(true)));
    f()
}

impl Fast {
    /// Opens the fast path to daemon instance `instance` (from `Hello`);
    /// `None` when the daemon does not offer it (or is another instance:
    /// it restarted since the handshake).
    pub(crate) async fn open(path: &Path, instance: u64, mode: Mode) -> Option<Fast> {
        let s = TaskFast::connect(path, instance).await?;
        match mode {
            Mode::Tasks => Some(Fast::Tasks(TaskFast::start(s))),
            Mode::Callers => {
                let std = s.into_std().and_then(|s| {
                    s.set_nonblocking(false)?;
                    Ok(s)
                });
                match std {
                    Ok(s) => Some(Fast::Callers(Arc::new(CallerFast::new(s)), tokio::runtime::Handle::current())),
                    Err(e) => {
                        tracing::debug!("kvmesh fast path: cannot make the socket blocking ({e}); using gRPC");
                        None
                    }
                }
            }
        }
    }

    /// One call: `req` encoded, the answer decoded.
    pub(crate) async fn call<Req: Message, Resp: Message + Default>(&self, method: u8, req: &Req) -> Result<Resp> {
        let body = match self {
            Fast::Tasks(t) => t.call(method, req).await?,
            Fast::Callers(c, rt) => {
                let len = checked_len(req)?;
                let id = c.next.fetch_add(1, Ordering::Relaxed);
                let frame = fast::frame(id, method, len, |v| req.encode(v).expect("a Vec grows"));
                if CALLER_BLOCKS.with(Cell::get) {
                    c.call(id, &frame)?
                } else {
                    let c = Arc::clone(c);
                    rt.spawn_blocking(move || c.call(id, &frame))
                        .await
                        .map_err(|e| ClientError::Protocol(format!("fast-path call task: {e}")))??
                }
            }
        };
        Resp::decode(&body[..]).map_err(|e| ClientError::Protocol(format!("undecodable fast-path answer: {e}")))
    }

    /// Answers read by the thread that waited for them (callers mode);
    /// for tests and benches.
    pub(crate) fn answers_read_by_their_caller(&self) -> Option<u64> {
        match self {
            Fast::Tasks(_) => None,
            Fast::Callers(c, _) => Some(c.own_reads.load(Ordering::Relaxed)),
        }
    }
}

/// The fast path read and written by the calling threads (see the module).
pub(crate) struct CallerFast {
    /// In blocking mode. Written under `write` (whole frames, one writer
    /// at a time), read by the one caller whose turn it is (`reading`).
    sock: std::os::unix::net::UnixStream,
    write: Mutex<()>,
    state: Mutex<Readers>,
    next: AtomicU64,
    own_reads: AtomicU64,
    /// The process that opened the connection: a child made by `fork`
    /// shares the socket and the ids, and must not read the parent's
    /// answers (nor write into its stream).
    pid: u32,
    /// How long a reader polls for its answer before it blocks.
    spin: Duration,
}

/// Default of `KVMESH_CLIENT_SPIN_US`.
pub(crate) const SPIN_US_DEFAULT: u64 = 20;
/// Largest `KVMESH_CLIENT_SPIN_US` taken.
pub(crate) const SPIN_US_MAX: u64 = 1_000;

/// How long a blocking caller polls the socket for its answer before it
/// sleeps in `read`: `KVMESH_CLIENT_SPIN_US` (default 20 µs, at most
/// 1,000; 0 never polls). A local call is answered within it, so the
/// caller's CPU never halts between request and answer; a call that
/// waits longer (a remote fetch) costs at most that much CPU more.
fn spin_from_env() -> Duration {
    let us = match std::env::var("KVMESH_CLIENT_SPIN_US") {
        Err(_) => SPIN_US_DEFAULT,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(us) => us.min(SPIN_US_MAX),
            Err(_) => {
                tracing::warn!("KVMESH_CLIENT_SPIN_US={v:?} is not a number of microseconds; using {SPIN_US_DEFAULT}");
                SPIN_US_DEFAULT
            }
        },
    };
    Duration::from_micros(us)
}

/// A waiting caller: its answer once read, and its thread to wake.
struct Waiter {
    answer: Option<Answer>,
    thread: std::thread::Thread,
    /// Its frame is written and it waits in the loop (not still sending:
    /// a sender may be stuck until someone reads, so the turn must go to
    /// a caller that will look at it now).
    parked: bool,
}

struct Readers {
    /// The callers waiting, by frame id.
    waiting: HashMap<u64, Waiter>,
    /// A caller is reading the socket.
    reading: bool,
    /// Why the connection ended, once it did.
    closed: Option<String>,
}

impl Readers {
    /// Wakes one caller that waits in the loop for its answer, to take the
    /// turn. (Where none does, every caller without an answer is still
    /// sending, and each finds the turn free when it comes to the loop.)
    fn wake_one_waiting(&self) {
        if let Some(w) = self.waiting.values().find(|w| w.parked && w.answer.is_none()) {
            w.thread.unpark();
        }
    }
}

impl CallerFast {
    fn new(sock: std::os::unix::net::UnixStream) -> CallerFast {
        CallerFast {
            sock,
            write: Mutex::new(()),
            state: Mutex::new(Readers { waiting: HashMap::new(), reading: false, closed: None }),
            next: AtomicU64::new(1),
            own_reads: AtomicU64::new(0),
            pid: std::process::id(),
            spin: spin_from_env(),
        }
    }

    fn readers(&self) -> std::sync::MutexGuard<'_, Readers> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `frame` (whose id is `id`) and waits for its answer, reading
    /// the connection while no one else does. Blocks the calling thread.
    ///
    /// Waiting callers park; a caller is unparked when its answer was read
    /// for it, when the reader got its own answer and it is the one to read
    /// next, and when the connection ends. (A spurious return from `park`
    /// only makes it look again.)
    fn call(&self, id: u64, frame: &[u8]) -> std::result::Result<Vec<u8>, tonic::Status> {
        if std::process::id() != self.pid {
            return Err(tonic::Status::unavailable(
                "a kvmesh client cannot be used in a process forked from the one that made it (create a new client)",
            ));
        }
        {
            let mut r = self.readers();
            if let Some(why) = &r.closed {
                return Err(tonic::Status::unavailable(why.clone()));
            }
            r.waiting.insert(id, Waiter { answer: None, thread: std::thread::current(), parked: false });
        }
        let written = {
            let _w = self.write.lock().unwrap_or_else(|e| e.into_inner());
            kvmesh_ffi_os::fdpass::send_all(self.sock.as_fd(), frame)
        };
        if let Err(e) = written {
            // Part of a frame may be on the connection: nothing more can be
            // read or written on it.
            self.end(format!("{CLOSED}: write failed: {e}"));
        }
        loop {
            let mut r = self.readers();
            if r.waiting.get(&id).is_some_and(|w| w.answer.is_some()) {
                return r.waiting.remove(&id).and_then(|w| w.answer).expect("checked above");
            }
            if let Some(why) = &r.closed {
                let why = why.clone();
                r.waiting.remove(&id);
                return Err(tonic::Status::unavailable(why));
            }
            if r.reading {
                if let Some(w) = r.waiting.get_mut(&id) {
                    w.parked = true;
                }
                drop(r);
                std::thread::park();
                continue;
            }
            // This caller's turn to read, until its own answer comes.
            r.reading = true;
            if let Some(w) = r.waiting.get_mut(&id) {
                w.parked = false;
            }
            drop(r);
            loop {
                self.spin_for_answer();
                match self.read_frame() {
                    Ok((got, answer)) => {
                        let mut g = self.readers();
                        if got == id {
                            g.waiting.remove(&id);
                            g.reading = false;
                            // Another caller waits for its answer: it reads next.
                            g.wake_one_waiting();
                            self.own_reads.fetch_add(1, Ordering::Relaxed);
                            return answer;
                        }
                        // Another caller's answer (one no longer waited for
                        // is dropped).
                        if let Some(w) = g.waiting.get_mut(&got) {
                            w.answer = Some(answer);
                            w.thread.unpark();
                        }
                    }
                    Err(why) => {
                        self.end(why);
                        self.readers().reading = false;
                        break;
                    }
                }
            }
        }
    }

    /// Before a blocking read, polls the socket for up to `spin` (see
    /// [`spin_from_env`]): an answer that comes within it is read without
    /// the thread going to sleep, so the daemon's answer needs no wake-up
    /// of a halted CPU.
    fn spin_for_answer(&self) {
        if !self.spin.is_zero() {
            kvmesh_ffi_os::fdpass::spin_until_readable(self.sock.as_fd(), self.spin);
        }
    }

    /// Reads one whole frame: its id and the answer it carries.
    fn read_frame(&self) -> std::result::Result<(u64, Answer), String> {
        let mut s = &self.sock;
        let mut head = [0u8; 4 + fast::HEAD];
        s.read_exact(&mut head).map_err(|e| format!("{CLOSED}: {e}"))?;
        let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
        let id = u64::from_le_bytes(head[4..12].try_into().expect("8 bytes"));
        if !(fast::HEAD..=fast::HEAD + fast::FRAME_MAX).contains(&len) {
            return Err(format!("{CLOSED}: kvmeshd sent a fast-path frame of {len} bytes"));
        }
        let mut body = vec![0u8; len - fast::HEAD];
        s.read_exact(&mut body).map_err(|e| format!("{CLOSED}: {e}"))?;
        let answer = match head[12] {
            0 => Ok(body),
            code => {
                Err(tonic::Status::new(tonic::Code::from(code as i32), String::from_utf8_lossy(&body).into_owned()))
            }
        };
        Ok((id, answer))
    }

    /// Ends the connection for every caller, saying why (the first reason
    /// wins): a reader blocked in `read` returns, later calls are refused.
    /// Nothing in a forked child: its `shutdown` would cut the parent's,
    /// and the state lock may have been held by another of the parent's
    /// threads at the fork (locking it would never return).
    fn end(&self, why: String) {
        if std::process::id() != self.pid {
            return;
        }
        let mut r = self.readers();
        if r.closed.is_none() {
            r.closed = Some(why);
        }
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        for w in r.waiting.values() {
            w.thread.unpark();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    /// Reads one request frame as the daemon would: (id, method, body).
    fn read_request(s: &mut UnixStream) -> (u64, u8, Vec<u8>) {
        let mut head = [0u8; 4 + fast::HEAD];
        s.read_exact(&mut head).unwrap();
        let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len - fast::HEAD];
        s.read_exact(&mut body).unwrap();
        (u64::from_le_bytes(head[4..12].try_into().unwrap()), head[12], body)
    }

    fn answer(s: &mut UnixStream, id: u64, body: &[u8]) {
        s.write_all(&fast::frame(id, 0, body.len(), |v| v.extend_from_slice(body))).unwrap();
    }

    fn request(id: u64, body: &[u8]) -> Vec<u8> {
        fast::frame(id, fast::LOOKUP, body.len(), |v| v.extend_from_slice(body))
    }

    /// Answers sent in the reverse order of the requests: whoever reads
    /// hands each answer to the caller that asked, and each caller gets
    /// its own body back.
    #[test]
    fn answers_out_of_order_reach_their_callers() {
        let (ours, mut daemon) = UnixStream::pair().unwrap();
        let c = Arc::new(CallerFast::new(ours));
        let n = 6u64;
        let callers: Vec<_> = (1..=n)
            .map(|id| {
                let c = Arc::clone(&c);
                std::thread::spawn(move || c.call(id, &request(id, &id.to_le_bytes())).unwrap())
            })
            .collect();
        let mut got = Vec::new();
        for _ in 0..n {
            got.push(read_request(&mut daemon));
        }
        got.sort_by_key(|r| std::cmp::Reverse(r.0));
        for (id, method, body) in &got {
            assert_eq!(*method, fast::LOOKUP);
            assert_eq!(body, &id.to_le_bytes());
            answer(&mut daemon, *id, &[body.as_slice(), b"-answer"].concat());
        }
        for (i, h) in callers.into_iter().enumerate() {
            let id = i as u64 + 1;
            assert_eq!(h.join().unwrap(), [id.to_le_bytes().as_slice(), b"-answer"].concat());
        }
        // Each reader read its own answer last; the rest were handed over.
        let own = c.own_reads.load(Ordering::Relaxed);
        assert!((1..=n).contains(&own), "{own}");
        assert!(c.readers().waiting.is_empty());
    }

    /// The connection ends (a frame cut off, or one too large) while
    /// several callers wait: each gets an error naming the closed
    /// connection, and later calls are refused at once.
    #[test]
    fn a_broken_connection_fails_every_waiting_caller() {
        for cut in [false, true] {
            let (ours, mut daemon) = UnixStream::pair().unwrap();
            let c = Arc::new(CallerFast::new(ours));
            let callers: Vec<_> = (1..=4u64)
                .map(|id| {
                    let c = Arc::clone(&c);
                    std::thread::spawn(move || c.call(id, &request(id, b"q")))
                })
                .collect();
            for _ in 0..4 {
                read_request(&mut daemon);
            }
            // One answer arrives whole, then the stream breaks.
            answer(&mut daemon, 2, b"fine");
            if cut {
                let f = fast::frame(3, 0, 100, |v| v.extend_from_slice(&[7u8; 100]));
                daemon.write_all(&f[..40]).unwrap();
            } else {
                daemon.write_all(&u32::MAX.to_le_bytes()).unwrap();
                daemon.write_all(&[0u8; fast::HEAD]).unwrap();
                std::thread::sleep(Duration::from_millis(50));
            }
            drop(daemon);
            for (i, h) in callers.into_iter().enumerate() {
                let r = h.join().unwrap();
                if i == 1 {
                    assert_eq!(r.unwrap(), b"fine");
                } else {
                    let e = r.unwrap_err();
                    assert!(e.message().contains("closed"), "{e:?}");
                }
            }
            let e = c.call(9, &request(9, b"late")).unwrap_err();
            assert!(e.message().contains("closed"), "{e:?}");
            assert!(c.readers().waiting.is_empty());
        }
    }
}
