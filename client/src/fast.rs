//! The client side of the engine fast path (see the daemon's `fast`
//! module): lookup, pin and unpin as framed protobuf messages over a second
//! Unix-socket connection, without HTTP/2. Calls may overlap: each frame
//! carries an id and a reader task hands every answer to its caller.
//!
//! The connection is its own session in the daemon, so every pin made here
//! is released here (the client routes all pins and unpins through it).
//! When the daemon does not offer it (or `KVMESH_FAST_PATH=off`), the client
//! uses gRPC for everything.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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

pub(crate) struct Fast {
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

impl Fast {
    /// Opens the fast path to daemon instance `instance` (from `Hello`);
    /// `None` when the daemon does not offer it (or is another instance:
    /// it restarted since the handshake).
    pub(crate) async fn open(path: &Path, instance: u64) -> Option<Fast> {
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
        Some(Fast { writer: to_writer, waiting, next: AtomicU64::new(1) })
    }

    /// One call: `req` encoded, the answer decoded.
    pub(crate) async fn call<Req: Message, Resp: Message + Default>(&self, method: u8, req: &Req) -> Result<Resp> {
        let len = req.encoded_len();
        if len > fast::FRAME_MAX {
            return Err(ClientError::InvalidArgument(format!("request of {len} bytes is too large")));
        }
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
        let body = rx.await.map_err(|_| tonic::Status::unavailable(CLOSED))??;
        Resp::decode(&body[..]).map_err(|e| ClientError::Protocol(format!("undecodable fast-path answer: {e}")))
    }
}
