//! The engine fast path: the hot calls (lookup, pin, unpin) over a plain
//! framed Unix-socket connection beside gRPC, served by a thread of its own
//! per connection. gRPC (HTTP/2 framing, tonic's tasks, a tokio wake-up on
//! each side) costs about as much as the store work of a pin of 64 blocks
//! on a small machine; here a request is read by a blocking thread and run
//! at once: the service's own handler is polled on that thread, and only a
//! call that has to wait (a remote fetch through the coherence driver) is
//! handed to the runtime, answering when it ends. Answers carry the
//! request's id, so calls of one connection may overlap.
//!
//! The connection is a session of its own (its pins die with it), served by
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

use crate::metrics::Metrics;
use crate::service::{ConnInfo, EngineService};

/// Fast-path connections served at once at most (a thread each).
pub const CONNECTIONS_MAX: usize = 256;

/// How long the client may take to send its magic.
const MAGIC_TIMEOUT: Duration = Duration::from_secs(10);
/// How long writing an answer may block (a client that stops reading)
/// before the connection is dropped — with its session, so its pins: as
/// long as the default pin lease, which a client that stalls this long
/// outlives anyway.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

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
    let writer = Arc::new(Mutex::new(stream));
    {
        let mut w = writer.lock();
        w.write_all(FAST_MAGIC)?;
        w.write_all(&session.to_le_bytes())?;
        w.write_all(&ctx.instance_id.to_le_bytes())?;
    }
    reader.set_read_timeout(None)?;
    let r = read_calls(ctx, &mut reader, &writer, session, guard);
    // Whatever ended the connection, the client sees it end now (answers
    // still running hold the writer).
    let _ = writer.lock().shutdown(std::net::Shutdown::Both);
    r
}

fn read_calls<G: Send + Sync + 'static>(
    ctx: &Arc<FastPath>,
    reader: &mut UnixStream,
    writer: &Arc<Mutex<UnixStream>>,
    session: u64,
    guard: &Arc<G>,
) -> io::Result<()> {
    let mut head = [0u8; 4 + fast::HEAD];
    loop {
        match reader.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
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
            _ => "unknown",
        };
        let call = call(ctx.service.clone(), session, id, method, body);
        let mut call = Box::pin(call);
        // Run it here; a call that has to wait finishes on the runtime.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match call.as_mut().poll(&mut cx) {
            Poll::Ready(r) => answer(writer, &ctx.metrics, label, id, r, started)?,
            Poll::Pending => {
                let (w, m, g) = (Arc::clone(writer), Arc::clone(&ctx.metrics), Arc::clone(guard));
                ctx.rt.spawn(async move {
                    let r = call.await;
                    // The write may block (a client slow to read): not on a
                    // runtime worker.
                    let _ = tokio::task::spawn_blocking(move || {
                        if let Err(e) = answer(&w, &m, label, id, r, started) {
                            tracing::warn!("fast path: answer not written ({e}); connection closed, its pins released");
                            let _ = w.lock().shutdown(std::net::Shutdown::Both);
                        }
                        drop(g);
                    })
                    .await;
                });
            }
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
        r.extensions_mut().insert(ConnInfo { session });
        r
    }
    let bad = |e: prost::DecodeError| Status::invalid_argument(format!("undecodable request: {e}"));
    Ok(match method {
        fast::LOOKUP => {
            let m = pb::LookupRequest::decode(&body[..]).map_err(bad)?;
            ok_frame(id, &svc.lookup(req(m, session)).await?.into_inner())
        }
        fast::PIN => {
            let m = pb::PinRequest::decode(&body[..]).map_err(bad)?;
            ok_frame(id, &svc.pin(req(m, session)).await?.into_inner())
        }
        fast::UNPIN => {
            let m = pb::UnpinRequest::decode(&body[..]).map_err(bad)?;
            ok_frame(id, &svc.unpin(req(m, session)).await?.into_inner())
        }
        other => return Err(Status::unimplemented(format!("fast-path method {other}"))),
    })
}

fn answer(
    writer: &Mutex<UnixStream>,
    metrics: &Metrics,
    label: &'static str,
    id: u64,
    r: Result<Vec<u8>, Status>,
    started: Instant,
) -> io::Result<()> {
    metrics.observe_call(label, r.is_ok(), started);
    let frame = r.unwrap_or_else(|s| {
        let msg = s.message().as_bytes();
        fast::frame(id, s.code() as i32 as u8, msg.len(), |v| v.extend_from_slice(msg))
    });
    writer.lock().write_all(&frame)
}
