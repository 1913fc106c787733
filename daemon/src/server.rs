//! The engine socket: claiming the path safely, telling the fd handshake
//! from gRPC on each new connection, tying each gRPC connection to a session
//! that is released the moment the connection closes, the lease reaper, and
//! graceful shutdown.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use kvmesh_common::handshake::{FAST_MAGIC, FD_HANDSHAKE_MAGIC, PoolFd, PoolKind};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, Interest, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tonic::transport::server::Connected;

use crate::config::Config;
use crate::memory::PoolMemory;
use crate::service::{ConnInfo, EngineService};
use crate::store::{SessionId, Store};

/// The default engine socket: `$XDG_RUNTIME_DIR/kvmesh/kvmeshd.sock`, else
/// `/tmp/kvmesh-<uid>/kvmeshd.sock`. The client library uses the same rule.
pub fn default_socket_path() -> PathBuf {
    kvmesh_ffi_os::default_socket_path()
}

/// Holds the socket path for the life of the daemon: an exclusive lock on
/// `<socket>.lock` proves that no other live daemon serves the path.
pub struct SocketClaim {
    path: PathBuf,
    _lock: File,
}

impl Drop for SocketClaim {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn private_dir(dir: &Path) -> anyhow::Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) => {
            if !m.is_dir() {
                bail!("{} exists and is not a directory", dir.display());
            }
            if m.uid() != kvmesh_ffi_os::current_uid() || m.mode() & 0o077 != 0 {
                bail!(
                    "socket directory {} must be owned by uid {} with mode 0700 (found uid {}, mode {:o})",
                    dir.display(),
                    kvmesh_ffi_os::current_uid(),
                    m.uid(),
                    m.mode() & 0o777
                );
            }
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(dir)
                .with_context(|| format!("cannot create socket directory {}", dir.display()))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
            Ok(())
        }
        Err(e) => Err(e).with_context(|| format!("cannot inspect socket directory {}", dir.display())),
    }
}

/// Claims `path` for this daemon and binds it with `mode` (0600, or 0666
/// when other uids are allowed and checked per connection). A path held by
/// a live daemon is an error; a stale socket file is removed. The socket
/// is bound in a private (0700) directory beside `path` and given its mode
/// there; it appears at `path` (renamed into place, with its final mode)
/// only at [`Unpublished::publish`], once the daemon answers connections:
/// a client that reaches the socket is never left waiting for a daemon
/// still starting (large pools take seconds to allocate; the client's
/// handshake waits 10 s at most), it finds no socket and can retry.
pub fn bind_socket(
    path: &Path,
    default_location: bool,
    mode: u32,
) -> anyhow::Result<(UnixListener, SocketClaim, Unpublished)> {
    // (A path from the command line or the default rule is checked here;
    // one from the file already was, with the config.)
    crate::config::check_socket_path(path).map_err(|e| anyhow::anyhow!(e))?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if default_location {
        private_dir(dir)?;
    } else if !dir.is_dir() {
        bail!("socket directory {} does not exist", dir.display());
    }
    let lock_path = PathBuf::from(format!("{}.lock", path.display()));
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&lock_path)
        .with_context(|| format!("cannot open lock file {}", lock_path.display()))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            bail!("socket {} is held by a live daemon (lock file {} is locked)", path.display(), lock_path.display())
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("cannot lock {}", lock_path.display()));
        }
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            bail!(
                "server.socket {} exists and is not a socket (a file? a typo in the path?): not removed; \
                 choose another path or remove it",
                path.display()
            );
        }
        tracing::info!(socket = %path.display(), "removing stale socket of a daemon that is gone");
        std::fs::remove_file(path).with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    // Named after the socket, under its lock: a stale one (a daemon that
    // died binding) is ours to clear.
    let private = PathBuf::from(format!("{}.bind.d", path.display()));
    let _ = std::fs::remove_dir_all(&private);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .with_context(|| format!("cannot create {}", private.display()))?;
    let staged = private.join("s");
    let unpublished = Unpublished { staged, private, path: path.to_path_buf() };
    let l = UnixListener::bind(&unpublished.staged)
        .with_context(|| format!("cannot bind {}", unpublished.staged.display()))?;
    std::fs::set_permissions(&unpublished.staged, std::fs::Permissions::from_mode(mode))?;
    Ok((l, SocketClaim { path: path.to_path_buf(), _lock: lock }, unpublished))
}

/// A socket bound (see [`bind_socket`]) but not yet at its path. Dropped
/// unpublished (start-up failed), its private directory goes.
pub struct Unpublished {
    staged: PathBuf,
    private: PathBuf,
    path: PathBuf,
}

impl Unpublished {
    /// Moves the socket to its path: clients can connect from now on.
    pub fn publish(self) -> anyhow::Result<()> {
        std::fs::rename(&self.staged, &self.path)
            .with_context(|| format!("cannot move the socket to {}", self.path.display()))
    }
}

impl Drop for Unpublished {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.staged);
        let _ = std::fs::remove_dir(&self.private);
    }
}

/// Releases a session's pins and allocations when its connection closes.
struct SessionGuard {
    session: SessionId,
    store: Arc<Mutex<Store>>,
    /// The engine's process (a pidfd: SO_PEERPIDFD, or of the SO_PEERCRED
    /// pid before Linux 6.5, taken as the connection is accepted): while it
    /// lives, the allocations it left unfinished stay fenced
    /// ([`Store::release_session_of`]). `None` where the kernel names no
    /// process (an engine in a pid namespace the daemon cannot see into,
    /// Linux before 5.3): they are freed at once, as before.
    writer: Option<Arc<dyn crate::store::WriterProbe>>,
}

/// An engine's process, as the store's fence watches it.
struct EngineProcess(kvmesh_ffi_os::Process);

impl crate::store::WriterProbe for EngineProcess {
    fn gone(&self) -> bool {
        self.0.exited()
    }
}

/// The process at the other end of an engine connection, if the kernel
/// names it.
fn engine_process(stream: &UnixStream) -> Option<Arc<dyn crate::store::WriterProbe>> {
    match kvmesh_ffi_os::Process::of_peer(std::os::fd::AsFd::as_fd(stream)) {
        Ok(p) => Some(Arc::new(EngineProcess(p))),
        Err(e) => {
            tracing::debug!(
                "no pidfd for the engine's process ({e}): its unfinished allocations are freed at disconnect"
            );
            None
        }
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        let (pins, allocs) = self.store.lock().release_session_of(self.session, self.writer.take(), Instant::now());
        if pins + allocs > 0 {
            tracing::info!(
                session = self.session,
                pins,
                allocs,
                "connection closed: released its pins and allocations"
            );
        } else {
            tracing::debug!(session = self.session, "connection closed");
        }
    }
}

/// A gRPC connection that knows its session.
struct TrackedStream {
    inner: UnixStream,
    guard: Arc<SessionGuard>,
}

impl Connected for TrackedStream {
    type ConnectInfo = ConnInfo;
    fn connect_info(&self) -> ConnInfo {
        ConnInfo {
            session: self.guard.session,
            hold: Some(Arc::clone(&self.guard) as Arc<dyn std::any::Any + Send + Sync>),
        }
    }
}

impl AsyncRead for TrackedStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TrackedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// How long a new connection may take to send its first byte.
const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(10);

async fn peek_first(stream: &UnixStream) -> io::Result<u8> {
    loop {
        stream.readable().await?;
        let mut b = [0u8; 1];
        match stream.try_io(Interest::READABLE, || kvmesh_ffi_os::fdpass::peek(stream.as_fd(), &mut b)) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => return Ok(b[0]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

async fn send_pool_fds(mut stream: UnixStream, store: &Arc<Mutex<Store>>) -> io::Result<()> {
    let mut magic = [0u8; FD_HANDSHAKE_MAGIC.len()];
    stream.read_exact(&mut magic).await?;
    if &magic != FD_HANDSHAKE_MAGIC {
        return Err(io::Error::other("bad fd handshake magic"));
    }
    let (instance, maps): (u64, Vec<_>) = {
        let st = store.lock();
        (st.instance_id, st.pools().iter().map(|p| (p.index, p.memory.clone())).collect())
    };
    // A GPU pool travels as a fresh fd of its CUDA allocation (exported per
    // handshake; ours is closed when this function returns, the client's
    // copy keeps the allocation importable).
    let mut exported = Vec::new();
    let mut table = Vec::with_capacity(maps.len());
    for (i, m) in &maps {
        let kind = match m {
            PoolMemory::Host(h) => h.sysv_id().map_or(PoolKind::Memfd, PoolKind::SysV),
            PoolMemory::Cuda(c) => {
                exported.push(c.pool.export_fd().map_err(|e| io::Error::other(format!("export GPU pool {i}: {e}")))?);
                PoolKind::Cuda(c.gpu.ordinal() as u32)
            }
        };
        table.push(PoolFd { pool: *i, bytes: m.len(), kind });
    }
    let payload = kvmesh_common::handshake::encode(instance, &table);
    let mut exported_fds = exported.iter();
    let fds: Vec<_> = maps
        .iter()
        .filter_map(|(_, m)| match m {
            PoolMemory::Host(h) => h.fd(),
            PoolMemory::Cuda(_) => exported_fds.next().map(|f| f.as_fd()),
        })
        .collect();
    loop {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, || kvmesh_ffi_os::fdpass::send_fds(stream.as_fd(), &payload, &fds)) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Whether the process at the other end of `stream` may use this daemon:
/// its uid is the daemon's, root's (which can read the daemon's memory
/// anyway), or one of `server.allow_uids`.
fn check_uid(stream: &UnixStream, allow: &[u32]) -> Result<(), String> {
    let me = kvmesh_ffi_os::current_uid();
    match stream.peer_cred() {
        Ok(c) if c.uid() == me || c.uid() == 0 || allow.contains(&c.uid()) => Ok(()),
        Ok(c) => Err(format!(
            "uid {} (pid {}) may not use this daemon (uid {me}); add it to server.allow_uids",
            c.uid(),
            c.pid().map_or_else(|| "?".into(), |p| p.to_string())
        )),
        Err(e) => Err(format!("cannot tell the client's uid: {e}")),
    }
}

/// Answers a refused client: the reason on an fd handshake (what a client
/// sends first; it reports it), then the connection is closed.
async fn refuse(mut stream: UnixStream, why: String) {
    tracing::warn!("engine connection refused: {why}");
    let first = tokio::time::timeout(Duration::from_secs(1), peek_first(&stream)).await;
    if matches!(first, Ok(Ok(b)) if b == FD_HANDSHAKE_MAGIC[0]) {
        let mut msg = kvmesh_common::handshake::REFUSED_MAGIC.to_vec();
        msg.extend_from_slice(why.as_bytes());
        let _ =
            tokio::time::timeout(Duration::from_secs(1), tokio::io::AsyncWriteExt::write_all(&mut stream, &msg)).await;
    }
}

/// Tells each new connection apart: the fd handshake is answered here,
/// gRPC connections are handed to the server with a fresh session.
async fn classify(
    stream: UnixStream,
    store: Arc<Mutex<Store>>,
    next_session: Arc<AtomicU64>,
    to_grpc: mpsc::Sender<io::Result<TrackedStream>>,
    fast: Arc<std::sync::OnceLock<Arc<crate::fast::FastPath>>>,
) {
    // Before anything else: the longer it waits, the likelier a pid (on
    // kernels without SO_PEERPIDFD) names another process.
    let writer = engine_process(&stream);
    let first = match tokio::time::timeout(FIRST_BYTE_TIMEOUT, peek_first(&stream)).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            tracing::debug!("connection closed before its first byte: {e}");
            return;
        }
        Err(_) => {
            tracing::warn!("connection sent nothing for {FIRST_BYTE_TIMEOUT:?}; closed");
            return;
        }
    };
    if first == FD_HANDSHAKE_MAGIC[0] {
        if let Err(e) = send_pool_fds(stream, &store).await {
            tracing::warn!("fd handshake failed: {e}");
        }
        return;
    }
    let session = next_session.fetch_add(1, Ordering::Relaxed);
    let guard = Arc::new(SessionGuard { session, store, writer });
    if first == FAST_MAGIC[0] {
        // A fast-path connection: a session of its own, served by a thread.
        let Some(ctx) = fast.get() else {
            tracing::debug!("fast-path connection before the service is up; closed (the client uses gRPC)");
            return;
        };
        let spawned = stream.into_std().and_then(|s| crate::fast::spawn(Arc::clone(ctx), s, session, guard));
        if let Err(e) = spawned {
            tracing::warn!("fast path: cannot serve a connection: {e}");
        }
        return;
    }
    let _ = to_grpc.send(Ok(TrackedStream { inner: stream, guard })).await;
}

/// The watchdog ping period asked by systemd (`WATCHDOG_USEC`, for this
/// process per `WATCHDOG_PID`): half the timeout.
fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID")
        && pid.parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// Pings systemd's watchdog only while the daemon works: the runtime runs
/// a fresh task, and the store and the coherence state (each behind a lock
/// that every engine call or protocol event takes) can be locked, all
/// within half a period. A wedged runtime, a deadlock or a driver stuck
/// holding its state stops the pings, and systemd restarts the daemon. Runs
/// on a thread of its own, so it can still judge (and log) when the runtime
/// cannot run anything.
fn watchdog(
    every: Duration,
    rt: tokio::runtime::Handle,
    store: Arc<Mutex<Store>>,
    cluster: Option<Arc<crate::cluster::Cluster>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    // Checks start every `every` (half the systemd period) and share one
    // budget of half that: a responsive daemon pings at most 0.75 of the
    // period apart, however slow each check is within the budget.
    let budget = every / 2;
    let mut silent = false;
    let mut next = Instant::now() + every;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let started = Instant::now();
        next = started + every;
        let left = || (started + budget).saturating_duration_since(Instant::now());
        let (tx, rx) = std::sync::mpsc::channel();
        rt.spawn(async move {
            let _ = tx.send(());
        });
        let runtime_ok = rx.recv_timeout(left()).is_ok();
        let locks_ok = store.try_lock_for(left()).is_some() && cluster.as_ref().is_none_or(|c| c.responsive(left()));
        if runtime_ok && locks_ok {
            sd_notify("WATCHDOG=1");
            if silent {
                tracing::warn!("watchdog: the daemon is responsive again; pinging");
                silent = false;
            }
        } else if !silent {
            tracing::error!(
                "watchdog: not pinging systemd (runtime runs tasks: {runtime_ok}, store and coherence state lockable: {locks_ok})"
            );
            silent = true;
        }
    }
}

/// Test-only (`KVMESH_TEST_HOOK=wedge-store-after-ms:N`): after N ms, take
/// the store lock and never release it, as a deadlock would.
fn wedge_hook(store: &Arc<Mutex<Store>>) {
    let Some(ms) = crate::peers::test_hook_ms("wedge-store-after-ms") else { return };
    tracing::warn!("TEST HOOK ACTIVE: the store lock will be held forever after {ms} ms");
    let store = Arc::clone(store);
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(ms));
        std::mem::forget(store.lock());
        tracing::warn!("TEST HOOK: store wedged");
    });
}

/// Tells systemd (when started with `Type=notify`) that the daemon is ready.
fn sd_notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sock = match std::os::unix::net::UnixDatagram::unbound() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("sd_notify: {e}");
            return;
        }
    };
    let bytes = path.as_encoded_bytes();
    let res = if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name).and_then(|a| sock.send_to_addr(state.as_bytes(), &a))
    } else {
        sock.send_to(state.as_bytes(), Path::new(&path))
    };
    if let Err(e) = res {
        tracing::warn!("sd_notify to {:?} failed: {e}", path);
    }
}

/// Runs the daemon until `shutdown` resolves (or a SIGTERM/SIGINT arrives
/// when `handle_signals`).
pub async fn run(
    cfg: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    handle_signals: bool,
) -> anyhow::Result<()> {
    run_with(cfg, shutdown, handle_signals, None).await
}

/// Installs a new log filter; fails with a message.
pub type SetLogFilter = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// How `SIGHUP` reloads the configuration: the file to read again and the
/// hook that swaps the log filter.
pub struct Reload {
    /// The configuration file.
    pub path: PathBuf,
    /// The engine socket given on the command line (`--socket`), which
    /// overrides the file's `server.socket` on every reload too.
    pub socket_override: Option<PathBuf>,
    /// Installs a new log filter (`log.filter`).
    pub set_log_filter: SetLogFilter,
}

/// Re-reads the configuration (SIGHUP): applies `log.filter`, `limits.*`
/// and `eviction.*`; refuses the whole reload, naming the fields, when
/// anything else changed.
fn reload_config(r: &Reload, live: &mut Config, store: &Arc<Mutex<Store>>) {
    let text = match std::fs::read_to_string(&r.path) {
        Ok(t) => t,
        Err(e) => {
            tracing::error!("config reload: cannot read {}: {e}; nothing changed", r.path.display());
            return;
        }
    };
    let mut new = match Config::parse(&text, &r.path.display().to_string()) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("config reload: {e}; nothing changed");
            return;
        }
    };
    // The socket may come from the command line; a change of the file's
    // `server.socket` otherwise refuses the reload like any `server` change.
    if let Some(s) = &r.socket_override {
        new.server.socket = Some(s.clone());
    }
    let refused = live.unreloadable_changes(&new);
    if !refused.is_empty() {
        tracing::error!(
            "config reload refused: {} changed and can only change with a restart; nothing changed",
            refused.join(", ")
        );
        return;
    }
    if std::env::var_os("KVMESH_LOG").is_none()
        && new.log.filter != live.log.filter
        && let Err(e) = (r.set_log_filter)(&new.log.filter)
    {
        tracing::error!("config reload: log.filter: {e}; nothing changed");
        return;
    }
    {
        let mut st = store.lock();
        st.reload_limits(new.limits.clone(), new.eviction.clone());
        st.reload_log(new.log.clone());
    }
    tracing::info!("config reloaded from {} (log.filter, limits, eviction)", r.path.display());
    *live = new;
}

/// A graceful drain: refuses new pins and allocations, waits (up to
/// `deadline`) for engines' pins and allocations to end, leaves the
/// cluster (the core stops serving, the homes and the membership are told),
/// then returns so the daemon stops (true when it left; false when a
/// second SIGTERM/SIGINT ended it at once).
async fn drain(
    why: &str,
    deadline: Duration,
    store: &Arc<Mutex<Store>>,
    cluster: Option<&Arc<crate::cluster::Cluster>>,
    signals: &mut mpsc::Receiver<&'static str>,
) -> bool {
    let t0 = Instant::now();
    // A signal stops a drain at once only if it is the second: a drain a
    // signal started stops at the next; one `kvmesh drain` started goes on
    // through the first (a `systemctl stop` or restart after `kvmesh
    // drain` must not cut it short), and stops at the one after.
    let mut signals_left = if why == KVMESH_DRAIN { 2 } else { 1 };
    let mut stop_at = |sig: &str, doing: &str| {
        signals_left -= 1;
        if signals_left == 0 {
            tracing::warn!("{sig} {doing}: stopping at once (peers wait out this daemon's lease)");
            true
        } else {
            tracing::info!("{sig} {doing}, started by `kvmesh drain`: draining on (another stops at once)");
            false
        }
    };
    store.lock().set_draining();
    let (pins, allocs) = store.lock().engine_outstanding();
    tracing::info!(
        pins,
        allocations = allocs,
        "{why}: draining: new pins and allocations are refused; waiting up to {deadline:?} for engines to release what they hold (a second SIGTERM stops at once)"
    );
    sd_notify("STATUS=draining");
    let until = t0 + deadline;
    loop {
        let (p, a) = store.lock().engine_outstanding();
        if p + a == 0 {
            break;
        }
        if Instant::now() >= until {
            tracing::warn!(
                pins = p,
                allocations = a,
                "drain deadline passed with pins or allocations outstanding; leaving anyway"
            );
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            Some(sig) = signals.recv() => {
                if stop_at(sig, "during the drain") {
                    return false;
                }
            }
        }
    }
    if let Some(c) = cluster {
        let leave = c.leave(Duration::from_secs(2));
        tokio::pin!(leave);
        loop {
            tokio::select! {
                r = &mut leave => {
                    tracing::info!(
                        copies_dropped = r.copies_dropped,
                        peers_confirmed = r.peers_confirmed,
                        peers = r.peers,
                        etcd_left = ?r.etcd_left,
                        "left the cluster"
                    );
                    break;
                }
                Some(sig) = signals.recv() => {
                    if stop_at(sig, "while leaving the cluster") {
                        return false;
                    }
                }
            }
        }
    }
    tracing::info!("drained in {:?}", t0.elapsed());
    true
}

/// Why a drain started when `kvmesh drain` asked for it.
const KVMESH_DRAIN: &str = "kvmesh drain";

/// What start-up reads from disk besides the config — the peer TLS files
/// of a clustered daemon (its certificate must name `node.id`) and those
/// of `[membership.tls]` — loaded and checked by the loaders start-up
/// uses, for `kvmeshd --check-config` (which must refuse what start-up
/// would refuse).
pub fn check_files(cfg: &Config) -> Result<(), String> {
    if cfg.peer.listen.is_some() || !cfg.peers.is_empty() {
        crate::tls::PeerTls::load(&cfg.peer.tls, cfg.node.id)?;
        if let ("etcd", Some(t)) = (cfg.membership.kind.as_str(), &cfg.membership.tls) {
            crate::etcd::load_tls(t)?;
        }
    }
    Ok(())
}

/// [`run`] with a configuration reload on `SIGHUP` (when `handle_signals`).
pub async fn run_with(
    cfg: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    handle_signals: bool,
    reload: Option<Reload>,
) -> anyhow::Result<()> {
    let mut live_cfg = cfg.clone();
    let cfg_drain_ms = cfg.server.drain_timeout_ms;
    let fast_poll = Duration::from_micros(cfg.server.fast_path_poll_us);
    let (path, default_location) = match &cfg.server.socket {
        Some(p) => (p.clone(), false),
        None => (default_socket_path(), true),
    };
    let allow_uids: Arc<[u32]> = cfg.server.allow_uids.clone().into();
    let refusing = Arc::new(tokio::sync::Semaphore::new(16));
    let mode = if allow_uids.is_empty() { 0o600 } else { 0o666 };
    // Signal handlers before the socket exists: once a client can see the
    // daemon, SIGHUP/SIGTERM are ours (queued until the loop below reads
    // them), never the default action that ends the process.
    let signals = if handle_signals {
        use tokio::signal::unix::{SignalKind, signal};
        Some((signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?, signal(SignalKind::hangup())?))
    } else {
        None
    };
    let (listener, claim, unpublished) = bind_socket(&path, default_location, mode)?;
    // The metrics port, bound before anything starts: a port in use is a
    // start-up error that names the field.
    let metrics_listener = match cfg.metrics.addr().map_err(anyhow::Error::msg)? {
        Some(addr) => {
            let l = std::net::TcpListener::bind(addr)
                .map_err(|e| anyhow::anyhow!("metrics.listen {addr}: cannot listen: {e}"))?;
            l.set_nonblocking(true)?;
            tracing::info!("metrics at http://{}/metrics", l.local_addr()?);
            Some(tokio::net::TcpListener::from_std(l)?)
        }
        None => None,
    };
    let reaper_every = Duration::from_millis(cfg.limits.reaper_interval_ms);
    let peer_cfg = cfg.peer.clone();
    let staging_lock = cfg.pools.iter().any(|p| p.mlock);
    let pool_count = cfg.pools.len();
    let peer_entries = cfg.peers.clone();
    let coherence_cfg = cfg.coherence.clone();
    let membership_cfg = cfg.membership.clone();
    let node_id = cfg.node.id;
    let cluster = peer_cfg.listen.is_some() || !peer_entries.is_empty();
    let transports = match peer_cfg.transports.as_str() {
        "sm" => kvmesh_ucx::Transports::SharedMemory,
        "tcp" => kvmesh_ucx::Transports::Tcp,
        _ => kvmesh_ucx::Transports::All,
    };
    // Pools of a clustered daemon on shared memory are allocated by UCX, so
    // its sm transports can read them one-sided; engines attach them by
    // SysV id. Elsewhere the daemon allocates memfds and registers them.
    let ucx_alloc = cluster
        && (peer_cfg.pool_alloc == "ucx"
            || (peer_cfg.pool_alloc == "auto" && transports == kvmesh_ucx::Transports::SharedMemory));
    let ctx = if cluster {
        Some(kvmesh_ucx::Context::new(&transports).map_err(|e| anyhow!("UCX context ({}): {e}", transports.tls()))?)
    } else {
        None
    };
    let mut regions: Vec<Option<Arc<kvmesh_ucx::MemoryRegion>>> = vec![None; cfg.pools.len()];
    let mut premade: Vec<Option<Arc<kvmesh_ffi_os::SharedMapping>>> = vec![None; cfg.pools.len()];
    if let (true, Some(ctx)) = (ucx_alloc, &ctx) {
        for i in 0..cfg.pools.len() {
            if cfg.pools[i].device != "host" {
                continue; // device memory: the store allocates it (staged)
            }
            let bytes = Store::pool_bytes(&cfg, i);
            let mr = kvmesh_ucx::MemoryRegion::allocate(ctx, bytes as usize)
                .map_err(|e| anyhow!("pool {}: UCX cannot allocate {bytes} bytes: {e}", cfg.pools[i].name))?;
            match mr.sysv_id() {
                Some(id) => {
                    let m = kvmesh_ffi_os::SharedMapping::attach_sysv(id, bytes)
                        .map_err(|e| anyhow!("pool {}: attach SysV segment {id}: {e}", cfg.pools[i].name))?;
                    tracing::info!(pool = %cfg.pools[i].name, shmid = id, "pool allocated by UCX (one-sided shared-memory reads)");
                    premade[i] = Some(Arc::new(m));
                    regions[i] = Some(Arc::new(mr));
                }
                None => tracing::warn!(
                    pool = %cfg.pools[i].name,
                    "UCX did not place the pool in a SysV segment engines can attach; using a memfd pool"
                ),
            }
        }
    }
    let store = Arc::new(Mutex::new(Store::with_mappings(cfg, premade).map_err(|e| anyhow!("{e}"))?));
    tracing::info!(socket = %path.display(), "kvmeshd listening");
    if std::env::var("KVMESH_TEST_HOOK").as_deref() == Ok("panic-in-task") {
        // Test-only: what a bug in a background task does to the process.
        tracing::warn!("TEST HOOK ACTIVE: a task panics in a second");
        tokio::spawn(async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            panic!("test hook: a background task panicked");
        });
    }

    // Data plane and peers, when this daemon is part of a cluster.
    let mut peer_listener = None;
    let peers = if let Some(ctx) = ctx {
        let tls = crate::tls::PeerTls::load(&peer_cfg.tls, node_id).map_err(|e| anyhow!("{e}"))?.map(Arc::new);
        match &tls {
            Some(_) => {
                tracing::info!(node = node_id, "peer TLS required: peers must present a certificate naming them")
            }
            None => tracing::warn!(
                "peer.tls.mode = \"off\": any process that reaches the peer port is trusted as a daemon \
                 (it can read every cached block); see docs/SECURITY.md"
            ),
        }
        // Pools UCX cannot reach (GPU pools: kvmesh does not register
        // device memory with UCX yet, and Debian's UCX has no CUDA support)
        // move through host staging slots (docs/GPU.md).
        let (mappings, staged, stride_max, incarnation) = {
            let st = store.lock();
            let staged: Vec<bool> = st.pools().iter().map(|p| crate::staging::is_staged(&p.memory)).collect();
            let stride_max = st.pools().iter().zip(&staged).filter(|(_, s)| **s).map(|(p, _)| p.stride).max();
            (
                st.pools().iter().map(|p| p.memory.host().cloned()).collect::<Vec<_>>(),
                staged,
                stride_max,
                st.instance_id,
            )
        };
        match ctx.cuda_memory() {
            Ok(true) => tracing::info!(
                "UCX supports CUDA memory; kvmesh still moves GPU pools' blocks through host staging slots (docs/GPU.md)"
            ),
            Ok(false) => {
                tracing::info!("UCX has no CUDA memory support: GPU pools' blocks move through host staging slots")
            }
            Err(e) => tracing::warn!("UCX memory types unknown: {e}"),
        }
        let mut regs = Vec::new();
        for (i, m) in mappings.iter().enumerate() {
            regs.push(match (regions[i].take(), m) {
                (Some(r), _) => Some(r),
                (None, Some(m)) => Some(Arc::new(
                    kvmesh_ucx::MemoryRegion::register(&ctx, Arc::clone(m))
                        .map_err(|e| anyhow!("register pool {i}: {e}"))?,
                )),
                (None, None) => None,
            });
        }
        let staging = match stride_max {
            Some(stride) => {
                let slots = peer_cfg.staging_slots;
                let s = crate::staging::Staging::new(slots, stride, regs.len() as u32, staging_lock)
                    .map_err(|e| anyhow!("peer.staging_slots: {e}"))?;
                let mr = kvmesh_ucx::MemoryRegion::register(&ctx, Arc::clone(s.mapping()))
                    .map_err(|e| anyhow!("register the staging slots: {e}"))?;
                tracing::info!(
                    slots,
                    slot_bytes = stride,
                    pools = ?staged.iter().enumerate().filter(|(_, s)| **s).map(|(i, _)| i).collect::<Vec<_>>(),
                    "staged pools: blocks move between daemons through host staging slots"
                );
                Some((s, Arc::new(mr)))
            }
            None => None,
        };
        let limits = crate::dataplane::Limits {
            inflight_requests_max: peer_cfg.inflight_requests_max as usize,
            inflight_bytes_max: peer_cfg.inflight_bytes_max,
            poll_idle: std::time::Duration::from_micros(peer_cfg.poll_idle_us),
        };
        let (staging, staging_region) = match staging {
            Some((s, mr)) => (Some(s), Some(mr)),
            None => (None, None),
        };
        let dp = crate::dataplane::DataPlane::start_with(ctx, regs, staging_region, transports.clone(), limits)
            .map_err(|e| anyhow!("{e}"))?;
        debug_assert_eq!(dp.staging_region(), staging.as_ref().map(|_| pool_count as u32));
        tracing::info!(transports = transports.tls(), "UCX data plane ready");
        if let Some(listen) = &peer_cfg.listen {
            let l = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot bind peer.listen {listen}"))?;
            tracing::info!(addr = %listen, node = node_id, "peer service listening");
            peer_listener = Some(l);
        }
        Some(Arc::new(crate::peers::Peers::new(
            node_id,
            incarnation,
            peer_cfg,
            peer_entries,
            Arc::new(dp),
            Arc::clone(&store),
            tls,
            staging,
        )))
    } else {
        None
    };

    let (tx, rx) = mpsc::channel::<io::Result<TrackedStream>>(64);
    let next_session = Arc::new(AtomicU64::new(1));
    let fast: Arc<std::sync::OnceLock<Arc<crate::fast::FastPath>>> = Arc::default();
    let accept_fast = Arc::clone(&fast);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);

    // Accept loop; the socket appears at its path now (not while pools
    // were being set up: see `bind_socket`).
    if let Some(ms) = crate::peers::test_hook_ms("delay-start-ms") {
        // Test-only: a set-up that takes long (huge pools, a slow host).
        tracing::warn!("TEST HOOK ACTIVE: set-up held {ms} ms before the socket appears");
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    unpublished.publish()?;
    let accept_store = Arc::clone(&store);
    let mut stop_accept = stop_rx.clone();
    let accept = tokio::spawn(async move {
        loop {
            tokio::select! {
                r = listener.accept() => match r {
                    Ok((stream, _)) => {
                        if let Err(why) = check_uid(&stream, &allow_uids) {
                            // Told why, a bounded number at once (more are
                            // just closed): a flood costs no more than that.
                            if let Ok(permit) = Arc::clone(&refusing).try_acquire_owned() {
                                tokio::spawn(async move {
                                    refuse(stream, why).await;
                                    drop(permit);
                                });
                            }
                            continue;
                        }
                        tokio::spawn(classify(
                            stream,
                            Arc::clone(&accept_store),
                            Arc::clone(&next_session),
                            tx.clone(),
                            Arc::clone(&accept_fast),
                        ));
                    }
                    Err(e) => {
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                },
                _ = stop_accept.changed() => break,
            }
        }
    });

    // Lease reaper.
    let reaper_store = Arc::clone(&store);
    let mut stop_reaper = stop_rx.clone();
    let reaper = tokio::spawn(async move {
        let mut tick = tokio::time::interval(reaper_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let n = reaper_store.lock().expire(Instant::now());
                    if n > 0 {
                        tracing::info!(expired = n, "reclaimed pins/allocations whose lease passed");
                    }
                }
                _ = stop_reaper.changed() => break,
            }
        }
    });

    // The coherence driver runs on every clustered daemon.
    let state_dir = match &coherence_cfg.state_dir {
        Some(d) => d.clone(),
        None => path.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from(".")),
    };
    let cluster = match &peers {
        Some(p) => Some(crate::cluster::Cluster::start(
            coherence_cfg,
            &membership_cfg,
            &state_dir,
            Arc::clone(p),
            Arc::clone(&store),
        )?),
        None => None,
    };
    let peer_server = match (peer_listener, &peers) {
        (Some(l), Some(p)) => {
            let svc = kvmesh_proto::peer::v1::peer_server::PeerServer::new(crate::peers::PeerService {
                peers: Arc::clone(p),
                cluster: cluster.clone(),
            })
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
            let mut stop = stop_rx.clone();
            let mut builder = tonic::transport::Server::builder();
            if let Some(t) = p.tls() {
                builder = builder.tls_config(t.server_config()).map_err(|e| anyhow!("peer TLS: {e}"))?;
            }
            Some(tokio::spawn(builder.add_service(svc).serve_with_incoming_shutdown(
                // Small control messages: no Nagle delay (it costs 40 ms
                // against delayed ACKs when an answer spans several writes).
                tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(l), |r| {
                    r.inspect(|s| {
                        let _ = s.set_nodelay(true);
                    })
                }),
                async move {
                    let _ = stop.changed().await;
                },
            )))
        }
        _ => None,
    };
    if let Some(p) = &peers {
        p.serve_send_orders();
        let p = Arc::clone(p);
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            loop {
                p.connect_all().await;
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.changed() => break,
                }
            }
        });
    }
    let (drain_tx, mut drain_rx) = tokio::sync::watch::channel::<Option<u64>>(None);
    let source = reload
        .as_ref()
        .map_or("no file (the embedded default, or given in-process)".to_string(), |r| r.path.display().to_string());
    let engine = EngineService::new(Arc::clone(&store), peers.clone(), cluster.clone(), drain_tx, source);
    let lease_left = store.lock().lease_left_at_unpin();
    let mut metrics = crate::metrics::Metrics::default().with_lease_left(lease_left);
    if let Some(c) = &cluster {
        metrics = metrics.with_remote(Arc::clone(&c.remote_metrics));
    }
    let metrics = Arc::new(metrics);
    if let Some(l) = metrics_listener {
        let engine = engine.clone();
        let snapshot = move || {
            let e = engine.clone();
            async move { e.snapshot().await }
        };
        tokio::spawn(crate::metrics::serve(l, Arc::clone(&metrics), snapshot, stop_rx.clone()));
    }
    let _ = fast.set(Arc::new(crate::fast::FastPath {
        service: engine.clone(),
        metrics: Arc::clone(&metrics),
        rt: tokio::runtime::Handle::current(),
        open: Default::default(),
        instance_id: store.lock().instance_id,
        poll: fast_poll,
    }));
    let svc = kvmesh_proto::engine::v1::engine_server::EngineServer::new(engine)
        .max_decoding_message_size(16 << 20)
        .max_encoding_message_size(16 << 20);
    let mut stop_grpc = stop_rx.clone();
    let incoming = tokio_stream::wrappers::ReceiverStream::new(rx);
    let grpc = tokio::spawn(
        tonic::transport::Server::builder()
            .layer(crate::metrics::TimedLayer(Arc::clone(&metrics)))
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stop_grpc.changed().await;
            }),
    );

    sd_notify("READY=1");
    let watchdog_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(every) = watchdog_interval() {
        tracing::info!("systemd watchdog: a liveness-checked ping every {every:?}");
        let (rt, store, cluster, stop) =
            (tokio::runtime::Handle::current(), Arc::clone(&store), cluster.clone(), Arc::clone(&watchdog_stop));
        std::thread::Builder::new()
            .name("kvmesh-watchdog".into())
            .spawn(move || watchdog(every, rt, store, cluster, stop))?;
    }
    wedge_hook(&store);
    let hup_store = Arc::clone(&store);
    // Signals become messages, so that a second SIGTERM can end a drain.
    let (sig_tx, mut sig_rx) = mpsc::channel::<&'static str>(4);
    if let Some((mut term, mut int, mut hup)) = signals {
        tokio::spawn(async move {
            loop {
                let sig = tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = int.recv() => "SIGINT",
                    _ = hup.recv() => {
                        match &reload {
                            Some(r) => reload_config(r, &mut live_cfg, &hup_store),
                            None => tracing::warn!("SIGHUP: no configuration file to reload (started on the embedded default)"),
                        }
                        continue;
                    }
                };
                if sig_tx.send(sig).await.is_err() {
                    return;
                }
            }
        });
    }
    let drain_ms = cfg_drain_ms;
    let first = tokio::select! {
        why = sig_rx.recv() => Some((why.unwrap_or("signal"), drain_ms)),
        r = drain_rx.wait_for(|d| d.is_some()) => Some((KVMESH_DRAIN, r.map(|d| d.unwrap_or(drain_ms)).unwrap_or(drain_ms))),
        _ = shutdown => None,
    };
    let drained = match first {
        Some((why, ms)) => drain(why, Duration::from_millis(ms), &store, cluster.as_ref(), &mut sig_rx).await,
        None => {
            tracing::info!("shutdown requested");
            false
        }
    };
    sd_notify("STOPPING=1");
    watchdog_stop.store(true, Ordering::Relaxed);
    // Watch streams end now (UNAVAILABLE), so the gRPC server can stop.
    store.lock().close_events();
    let _ = stop_tx.send(true);
    let _ = accept.await;
    let _ = reaper.await;
    // Give in-flight calls a moment; engines see their connection close.
    match tokio::time::timeout(Duration::from_secs(5), grpc).await {
        Ok(Ok(Err(e))) => tracing::warn!("grpc server ended with error: {e}"),
        Err(_) => tracing::warn!("grpc server did not stop within 5 s"),
        _ => {}
    }
    if let Some(mut ps) = peer_server {
        // Peers keep their streams open; once this daemon left the cluster
        // nothing they send matters any more.
        let wait = if drained { Duration::from_millis(100) } else { Duration::from_secs(2) };
        if tokio::time::timeout(wait, &mut ps).await.is_err() {
            ps.abort();
        }
    }
    drop(peers);
    drop(claim);
    tracing::info!("kvmeshd stopped");
    Ok(())
}
