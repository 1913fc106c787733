//! The client side of the engine fast path (see the daemon's `fast`
//! module): lookup, pin and unpin as framed protobuf messages over a second
//! Unix-socket connection, without HTTP/2. Calls may overlap: each frame
//! carries an id, and every answer is handed to its caller by id.
//!
//! Two ways to wait for answers, chosen when the client connects:
//! - [`TaskFast`] (the async client): a writer task and a reader task on the
//!   runtime; a caller queues its frame and awaits a oneshot.
//! - [`CallerFast`] (the blocking client, so the C ABI and Python): the
//!   calling thread writes its frame itself and, when no other caller is
//!   reading, reads the connection itself until its own answer comes,
//!   handing any other caller's answer to it on the way (one reader at a
//!   time; the others wait on a condition variable and take the turn when
//!   the reader got its own). A lone caller thus blocks in `read` on the
//!   socket and is woken by the daemon's answer: no runtime thread between
//!   them (two thread wake-ups fewer per call than the task path).
//!
//! The connection is its own session in the daemon, so every pin made here
//! is released here (the client routes all pins and unpins through it).
//! When the daemon does not offer it (or `KVMESH_FAST_PATH=off`), the client
//! uses gRPC for everything.

use std::cell::Cell;
use std::collections::HashMap;
use std::io::Read;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
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
const CLOSED: &str =
    "the fast-path connection to kvmeshd closed (the pins taken over it were released; create a new client)";

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
    Callers(Arc<CallerFast>),
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
                    Ok(s) => Some(Fast::Callers(Arc::new(CallerFast::new(s)))),
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
            Fast::Callers(c) => {
                let len = checked_len(req)?;
                let id = c.next.fetch_add(1, Ordering::Relaxed);
                let frame = fast::frame(id, method, len, |v| req.encode(v).expect("a Vec grows"));
                if CALLER_BLOCKS.with(Cell::get) {
                    c.call(id, &frame)?
                } else {
                    let c = Arc::clone(c);
                    tokio::task::spawn_blocking(move || c.call(id, &frame))
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
            Fast::Callers(c) => Some(c.own_reads.load(Ordering::Relaxed)),
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
    /// Signalled when an answer is handed to its caller, when the reader
    /// gives up its turn while others wait, and when the connection ends.
    turn: Condvar,
    next: AtomicU64,
    own_reads: AtomicU64,
}

struct Readers {
    /// The callers waiting, by frame id: `Some` once their answer was read.
    answers: HashMap<u64, Option<Answer>>,
    /// A caller is reading the socket.
    reading: bool,
    /// Why the connection ended, once it did.
    closed: Option<String>,
}

impl CallerFast {
    fn new(sock: std::os::unix::net::UnixStream) -> CallerFast {
        CallerFast {
            sock,
            write: Mutex::new(()),
            state: Mutex::new(Readers { answers: HashMap::new(), reading: false, closed: None }),
            turn: Condvar::new(),
            next: AtomicU64::new(1),
            own_reads: AtomicU64::new(0),
        }
    }

    fn readers(&self) -> std::sync::MutexGuard<'_, Readers> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `frame` (whose id is `id`) and waits for its answer, reading
    /// the connection while no one else does. Blocks the calling thread.
    fn call(&self, id: u64, frame: &[u8]) -> std::result::Result<Vec<u8>, tonic::Status> {
        {
            let mut r = self.readers();
            if let Some(why) = &r.closed {
                return Err(tonic::Status::unavailable(why.clone()));
            }
            r.answers.insert(id, None);
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
        let mut r = self.readers();
        loop {
            if let Some(Some(_)) = r.answers.get(&id) {
                let answer = r.answers.remove(&id).flatten().expect("checked above");
                return answer;
            }
            if let Some(why) = &r.closed {
                let why = why.clone();
                r.answers.remove(&id);
                return Err(tonic::Status::unavailable(why));
            }
            if r.reading {
                r = self.turn.wait(r).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            // This caller's turn to read, until its own answer comes.
            r.reading = true;
            drop(r);
            loop {
                match self.read_frame() {
                    Ok((got, answer)) => {
                        let mut g = self.readers();
                        if got == id {
                            g.answers.remove(&id);
                            g.reading = false;
                            if !g.answers.is_empty() {
                                // Another caller waits: one of them reads next.
                                self.turn.notify_all();
                            }
                            self.own_reads.fetch_add(1, Ordering::Relaxed);
                            return answer;
                        }
                        // Another caller's answer (one that is no longer
                        // waited for is dropped).
                        if let Some(slot) = g.answers.get_mut(&got) {
                            *slot = Some(answer);
                            self.turn.notify_all();
                        }
                    }
                    Err(why) => {
                        self.end(why);
                        r = self.readers();
                        r.reading = false;
                        break;
                    }
                }
            }
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
            return Err(format!("kvmeshd sent a fast-path frame of {len} bytes"));
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
    fn end(&self, why: String) {
        let mut r = self.readers();
        if r.closed.is_none() {
            r.closed = Some(why);
        }
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        self.turn.notify_all();
    }
}
