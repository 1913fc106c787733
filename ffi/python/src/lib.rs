//! `kvmesh._kvmesh`: the native half of the Python package (`python/`).
//!
//! The public API is the pure-Python `kvmesh` package, which wraps these
//! classes; this module keeps to what needs Rust: the connection (the
//! blocking client, called with the GIL released), key conversion, and the
//! lifetime rules of pinned and allocated blocks.
//!
//! **Zero-copy views under abi3 (CPython >= 3.9).** The limited API of 3.9
//! has no buffer protocol for extension classes, so a block's bytes reach
//! Python as a `ctypes` array over the pool address, wrapped in a
//! `memoryview` by the package. Each such array holds an [`Export`] token;
//! while any token of a batch lives, its pins are kept (a `release()` then
//! only marks the batch: the unpin follows the last view). An allocation
//! refuses to commit while a writable view of it lives, and an abort waits
//! for the views like a release. So no view ever reads or writes a slot the
//! daemon may have handed to another block — within the lease, which the
//! daemon enforces.
#![deny(unsafe_op_in_unsafe_fn)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kvmesh_client::blocking;
use kvmesh_client::{Allocation, ClientError, CommitOutcome, ErrorKind, Key, PinOptions, PinnedBlock, WritableBlock};
use pyo3::exceptions::{PyIndexError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyInt, PyString, PyType};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An exception of `kvmesh.errors` by class name.
fn error(py: Python<'_>, class: &str, msg: String) -> PyErr {
    static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    let module = ERRORS.get_or_try_init(py, || py.import("kvmesh.errors").map(Bound::unbind));
    match module.and_then(|m| m.bind(py).getattr(class)).and_then(|c| Ok(c.cast_into::<PyType>()?)) {
        Ok(cls) => PyErr::from_type(cls, msg),
        Err(_) => PyRuntimeError::new_err(format!("{class}: {msg}")),
    }
}

fn invalid(py: Python<'_>, msg: impl Into<String>) -> PyErr {
    error(py, "InvalidArgument", msg.into())
}

fn client_error(py: Python<'_>, e: ClientError) -> PyErr {
    let class = match e.kind() {
        ErrorKind::InvalidArgument => "InvalidArgument",
        ErrorKind::NotFound => "NotFound",
        ErrorKind::ResourceExhausted => "ResourceExhausted",
        ErrorKind::LeaseExpired => "LeaseExpired",
        ErrorKind::Refused => "Refused",
        ErrorKind::Unavailable => "DaemonUnavailable",
        ErrorKind::Internal => "KvmeshError",
        ErrorKind::NoDevice => "NoDevice",
    };
    error(py, class, e.to_string())
}

/// One key from `bytes` (16, big-endian), `int` (0 <= k < 2**128) or `str`
/// (32 hex digits).
fn key_of(py: Python<'_>, k: &Bound<'_, PyAny>) -> PyResult<Key> {
    if let Ok(b) = k.cast::<PyBytes>() {
        let bytes: [u8; 16] = b
            .as_bytes()
            .try_into()
            .map_err(|_| invalid(py, format!("a key as bytes must be 16 bytes, got {}", b.as_bytes().len())))?;
        return Ok(Key(u128::from_be_bytes(bytes)));
    }
    if let Ok(s) = k.cast::<PyString>() {
        let s = s.to_cow()?;
        return s.parse().map_err(|e: kvmesh_common::KeyParseError| invalid(py, e.to_string()));
    }
    if k.is_instance_of::<PyInt>() {
        return k
            .extract::<u128>()
            .map(Key)
            .map_err(|_| invalid(py, format!("a key as int must be in [0, 2**128), got {k}")));
    }
    Err(invalid(py, format!("a key is 16 bytes, an int or 32 hex digits, not {}", k.get_type().name()?)))
}

fn keys_of(py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
    if keys.is_instance_of::<PyString>() || keys.is_instance_of::<PyBytes>() {
        return Err(invalid(py, "keys must be a sequence of keys, not a single key"));
    }
    let iter = keys.try_iter().map_err(|_| invalid(py, "keys must be an iterable of keys"))?;
    iter.map(|k| key_of(py, &k?)).collect()
}

fn key_bytes(py: Python<'_>, k: Key) -> Bound<'_, PyBytes> {
    PyBytes::new(py, &k.0.to_be_bytes())
}

/// A registered namespace.
#[pyclass(module = "kvmesh", frozen, name = "Namespace")]
struct PyNamespace {
    ns: Arc<kvmesh_client::Namespace>,
}

#[pymethods]
impl PyNamespace {
    /// Handle used in requests (valid on the daemon that registered it).
    #[getter]
    fn id(&self) -> u32 {
        self.ns.id
    }
    /// Name.
    #[getter]
    fn name(&self) -> &str {
        &self.ns.name
    }
    /// Size of every block in bytes.
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.ns.block_bytes
    }
    /// Layout fingerprint string given at registration.
    #[getter]
    fn layout(&self) -> &str {
        &self.ns.layout
    }
    /// Pool holding its blocks.
    #[getter]
    fn pool(&self) -> u32 {
        self.ns.pool
    }
    /// 64-bit fingerprint of (name, block size, layout).
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.ns.fingerprint
    }
    fn __repr__(&self) -> String {
        format!(
            "Namespace(name={:?}, block_bytes={}, layout={:?}, id={})",
            self.ns.name, self.ns.block_bytes, self.ns.layout, self.ns.id
        )
    }
}

/// A connection to the local kvmeshd (see `kvmesh.Client`).
#[pyclass(module = "kvmesh._kvmesh", frozen, name = "Client")]
struct PyClient {
    client: Mutex<Option<blocking::Client>>,
    namespaces: Mutex<HashMap<String, Arc<kvmesh_client::Namespace>>>,
    socket: String,
}

impl PyClient {
    fn get(&self, py: Python<'_>) -> PyResult<blocking::Client> {
        lock(&self.client).clone().ok_or_else(|| error(py, "DaemonUnavailable", "the client is closed".into()))
    }

    /// The namespace of an argument: shared, never copied per call.
    fn ns(&self, py: Python<'_>, ns: &Bound<'_, PyAny>) -> PyResult<Arc<kvmesh_client::Namespace>> {
        if let Ok(n) = ns.cast::<PyNamespace>() {
            return Ok(Arc::clone(&n.get().ns));
        }
        let Ok(name) = ns.cast::<PyString>() else {
            return Err(invalid(
                py,
                format!("a namespace is a kvmesh.Namespace or its name, not {}", ns.get_type().name()?),
            ));
        };
        let name = name.to_cow()?.into_owned();
        if let Some(n) = lock(&self.namespaces).get(&name) {
            return Ok(n.clone());
        }
        let c = self.get(py)?;
        let n = Arc::new(py.detach(|| c.call(c.inner().namespace(&name))).map_err(|e| client_error(py, e))?);
        lock(&self.namespaces).insert(name, Arc::clone(&n));
        Ok(n)
    }

    /// Runs a call on the daemon with the GIL released.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&blocking::Client) -> Result<T, ClientError> + Send,
    ) -> PyResult<T> {
        let c = self.get(py)?;
        py.detach(|| f(&c)).map_err(|e| client_error(py, e))
    }
}

/// The address and length of a `ctypes` array (the package passes caller
/// buffers as `(ctypes.c_char * n).from_buffer(buf)`, which holds the
/// buffer's export while the array lives).
fn carray(py: Python<'_>, a: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
    static CTYPES: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    let ctypes = CTYPES.get_or_try_init(py, || py.import("ctypes").map(Bound::unbind))?.bind(py);
    if !a.is_instance(&ctypes.getattr("Array")?)? {
        return Err(invalid(py, "internal: expected a ctypes array over the caller's buffer"));
    }
    let addr: usize = ctypes.getattr("addressof")?.call1((a,))?.extract()?;
    let len: usize = ctypes.getattr("sizeof")?.call1((a,))?.extract()?;
    Ok((addr, len))
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (socket=None))]
    fn new(py: Python<'_>, socket: Option<std::path::PathBuf>) -> PyResult<PyClient> {
        let c = py.detach(|| blocking::Client::connect(socket.as_deref())).map_err(|e| client_error(py, e))?;
        let socket = c.inner().socket_path().display().to_string();
        Ok(PyClient { client: Mutex::new(Some(c)), namespaces: Mutex::new(HashMap::new()), socket })
    }

    /// The daemon socket this client is connected to.
    #[getter]
    fn socket(&self) -> &str {
        &self.socket
    }

    /// Most keys in one request (the daemon's `limits.batch_keys_max`).
    #[getter]
    fn batch_keys_max(&self, py: Python<'_>) -> PyResult<u32> {
        Ok(self.get(py)?.inner().hello().batch_keys_max)
    }

    fn close(&self) {
        lock(&self.client).take();
    }

    #[pyo3(signature = (name, block_bytes, layout="", device=""))]
    fn register_namespace(
        &self,
        py: Python<'_>,
        name: String,
        block_bytes: u64,
        layout: &str,
        device: &str,
    ) -> PyResult<PyNamespace> {
        let (layout, device) = (layout.to_string(), device.to_string());
        let ns =
            Arc::new(self.call(py, |c| c.call(c.inner().register_namespace_on(&name, block_bytes, &layout, &device)))?);
        lock(&self.namespaces).insert(ns.name.clone(), Arc::clone(&ns));
        Ok(PyNamespace { ns })
    }

    fn namespace(&self, py: Python<'_>, name: String) -> PyResult<PyNamespace> {
        let ns = Arc::new(self.call(py, |c| c.call(c.inner().namespace(&name)))?);
        lock(&self.namespaces).insert(ns.name.clone(), Arc::clone(&ns));
        Ok(PyNamespace { ns })
    }

    fn lookup(&self, py: Python<'_>, ns: &Bound<'_, PyAny>, keys: &Bound<'_, PyAny>) -> PyResult<(u32, Vec<bool>)> {
        let ns = self.ns(py, ns)?;
        let keys = keys_of(py, keys)?;
        let r = self.call(py, |c| c.call(c.inner().lookup(&ns, &keys)))?;
        Ok((r.prefix_len, r.present))
    }

    /// (prefix_len, per-key node or None, cluster_wide, complete).
    #[pyo3(signature = (ns, keys, local_only=false))]
    #[allow(clippy::type_complexity)]
    fn locate(
        &self,
        py: Python<'_>,
        ns: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        local_only: bool,
    ) -> PyResult<(u32, Vec<Option<u32>>, bool, bool)> {
        let ns = self.ns(py, ns)?;
        let keys = keys_of(py, keys)?;
        let r = self.call(py, |c| {
            let inner = c.inner();
            if local_only { c.call(inner.lookup_local(&ns, &keys)) } else { c.call(inner.lookup(&ns, &keys)) }
        })?;
        Ok((r.prefix_len, r.nodes, r.cluster_wide, r.complete))
    }

    #[pyo3(signature = (ns, keys, lease_ms=0, stop_at_first_miss=false))]
    fn pin(
        &self,
        py: Python<'_>,
        ns: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        lease_ms: u64,
        stop_at_first_miss: bool,
    ) -> PyResult<PyBatch> {
        let ns = self.ns(py, ns)?;
        let keys = keys_of(py, keys)?;
        let opts = PinOptions { lease_ms, stop_at_first_miss };
        let c = self.get(py)?;
        let mut blocks = py.detach(|| c.call(c.inner().pin_with(&ns, &keys, opts))).map_err(|e| client_error(py, e))?;
        blocks.resize_with(keys.len(), || None);
        Ok(PyBatch { state: Arc::new(Mutex::new(BatchState { blocks, exports: 0, released: false })), keys, client: c })
    }

    fn _get_into(
        &self,
        py: Python<'_>,
        ns: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<bool>> {
        let ns = self.ns(py, ns)?;
        let keys = keys_of(py, keys)?;
        let (addr, len) = carray(py, dst)?;
        self.call(py, move |c| {
            let dst: &mut [u8] = if len == 0 {
                &mut []
            } else {
                // `addr`/`len` come from `ctypes.Array.from_buffer` over a
                // writable, C-contiguous buffer; kvmesh.Client.get_into keeps
                // the array (the buffer export) alive until this returns.
                // SAFETY: a live, writable, unaliased buffer of `len` bytes.
                unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
            };
            c.call(c.inner().get_into(&ns, &keys, dst))
        })
    }

    fn _put(
        &self,
        py: Python<'_>,
        ns: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        blocks: Vec<Bound<'_, PyAny>>,
        overwrite: bool,
    ) -> PyResult<(u32, u32, u32, u32, u32, Option<String>)> {
        let ns = self.ns(py, ns)?;
        let keys = keys_of(py, keys)?;
        if keys.len() != blocks.len() {
            return Err(invalid(py, "internal: keys and blocks differ in length"));
        }
        // (address, length) of each block; the objects stay referenced by
        // `blocks` (alive) for the whole call.
        let mut parts = Vec::with_capacity(blocks.len());
        for b in &blocks {
            if let Ok(bytes) = b.cast::<PyBytes>() {
                let s = bytes.as_bytes();
                parts.push((s.as_ptr() as usize, s.len()));
            } else {
                parts.push(carray(py, b)?);
            }
        }
        let s = self.call(py, move |c| {
            let views: Vec<(Key, &[u8])> = keys
                .iter()
                .zip(&parts)
                .map(|(&k, &(addr, len))| {
                    let s: &[u8] = if len == 0 {
                        &[]
                    } else {
                        // Each (addr, len) is a `bytes` object's contents or a
                        // ctypes array over a caller buffer (see `_get_into`).
                        // SAFETY: `blocks` keeps every object alive meanwhile.
                        unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
                    };
                    (k, s)
                })
                .collect();
            if overwrite { c.call(c.inner().put_overwrite(&ns, &views)) } else { c.call(c.inner().put(&ns, &views)) }
        })?;
        Ok((s.stored, s.existed, s.in_progress, s.lost, s.refused, s.first_refusal))
    }

    #[pyo3(signature = (ns, keys, overwrite=false, lease_ms=0))]
    fn allocate(
        &self,
        py: Python<'_>,
        ns: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        overwrite: bool,
        lease_ms: u64,
    ) -> PyResult<PyAllocation> {
        let ns = self.ns(py, ns)?;
        let keys = keys_of(py, keys)?;
        let c = self.get(py)?;
        let allocs = py
            .detach(|| {
                if overwrite {
                    c.call(c.inner().allocate_overwrite(&ns, &keys))
                } else {
                    c.call(c.inner().allocate_with_lease(&ns, &keys, lease_ms))
                }
            })
            .map_err(|e| client_error(py, e))?;
        Ok(PyAllocation {
            state: Arc::new(Mutex::new(AllocState {
                slots: allocs.into_iter().map(Some).collect(),
                exports: 0,
                done: false,
            })),
            keys,
            client: c,
        })
    }

    fn invalidate(
        &self,
        py: Python<'_>,
        ns: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<(u64, u64, String)> {
        let ns = self.ns(py, ns)?;
        let keys = keys_of(py, keys)?;
        let s = self.call(py, |c| c.call(c.inner().invalidate(&ns, &keys)))?;
        Ok((s.invalidated, s.failed, s.first_error))
    }

    fn invalidate_namespace(&self, py: Python<'_>, ns: &Bound<'_, PyAny>) -> PyResult<(u64, u64, String)> {
        let ns = self.ns(py, ns)?;
        let s = self.call(py, |c| c.call(c.inner().invalidate_namespace(&ns)))?;
        Ok((s.invalidated, s.failed, s.first_error))
    }

    fn remove(&self, py: Python<'_>, ns: &Bound<'_, PyAny>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let ns = self.ns(py, ns)?;
        let keys = keys_of(py, keys)?;
        self.call(py, |c| c.call(c.inner().remove(&ns, &keys)))
    }

    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        let s = self.call(py, |c| c.call(c.inner().stats()))?;
        Ok(kvmesh_client::stats_json(&s))
    }

    #[pyo3(signature = (ns, snapshot=false))]
    fn watch_events(&self, py: Python<'_>, ns: &Bound<'_, PyAny>, snapshot: bool) -> PyResult<PyEvents> {
        let ns = self.ns(py, ns)?;
        let c = self.get(py)?;
        let stream = self.call(py, |c| c.call(c.inner().watch_events(&ns, snapshot)))?;
        Ok(PyEvents {
            client: c,
            stream: Mutex::new(Some(stream)),
            closed: std::sync::atomic::AtomicBool::new(false),
            wake: Arc::new(tokio::sync::Notify::new()),
        })
    }
}

/// A `WatchEvents` stream: `next_batch(timeout_ms)` waits (GIL released)
/// for the next batch; `close()` from another thread wakes a waiting
/// `next_batch`, which then raises.
#[pyclass(module = "kvmesh._kvmesh", frozen, name = "Events")]
struct PyEvents {
    client: blocking::Client,
    /// Out of the option while a `next_batch` waits on it (the lock is
    /// never held while waiting, nor while taking the GIL back).
    stream: Mutex<Option<tonic::Streaming<kvmesh_client::KvEventBatch>>>,
    closed: std::sync::atomic::AtomicBool,
    wake: Arc<tokio::sync::Notify>,
}

impl PyEvents {
    /// Returns the stream a `next_batch` took, unless the events were
    /// closed meanwhile: checked under the lock, which `close` takes after
    /// setting `closed`, so a close racing with this drops the stream
    /// either way (the daemon frees the watcher).
    fn put_back(&self, stream: tonic::Streaming<kvmesh_client::KvEventBatch>) {
        let mut g = lock(&self.stream);
        if !self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            *g = Some(stream);
        }
    }
}

/// One batch as Python sees it: (node_id, instance_id, snapshot,
/// snapshot_seq, snapshot_done, [(kind, seq, key bytes, version)]).
type PyEventBatch = (u32, u64, bool, u64, bool, Vec<(String, u64, Vec<u8>, u64)>);

enum Waited {
    Batch(Option<kvmesh_client::KvEventBatch>),
    Status(tonic::Status),
    Timeout,
    Closed,
}

#[pymethods]
impl PyEvents {
    /// The next batch, or None when `timeout_ms` (0: wait for ever) passed
    /// first. Raises `ResourceExhausted` when the daemon cut this watcher
    /// off, `DaemonUnavailable` when the stream ended or was closed.
    #[pyo3(signature = (timeout_ms=0))]
    fn next_batch(&self, py: Python<'_>, timeout_ms: u64) -> PyResult<Option<PyEventBatch>> {
        use std::sync::atomic::Ordering;
        if self.closed.load(Ordering::SeqCst) {
            return Err(error(py, "DaemonUnavailable", "the event stream was closed".into()));
        }
        let Some(mut stream) = lock(&self.stream).take() else {
            return Err(if self.closed.load(Ordering::SeqCst) {
                error(py, "DaemonUnavailable", "the event stream was closed".into())
            } else {
                invalid(py, "another thread is waiting on this event stream (one reader at a time)")
            });
        };
        let (c, wake) = (self.client.clone(), Arc::clone(&self.wake));
        let waited = py.detach(|| {
            c.block_on(async {
                let msg = async {
                    match stream.message().await {
                        Ok(b) => Waited::Batch(b),
                        Err(s) => Waited::Status(s),
                    }
                };
                let limit = async {
                    if timeout_ms == 0 {
                        std::future::pending::<()>().await
                    } else {
                        tokio::time::sleep(std::time::Duration::from_millis(timeout_ms)).await
                    }
                };
                tokio::select! {
                    w = msg => w,
                    _ = limit => Waited::Timeout,
                    _ = wake.notified() => Waited::Closed,
                }
            })
        });
        let waited = match waited {
            Ok(w) => w,
            Err(e) => {
                self.put_back(stream);
                return Err(client_error(py, e));
            }
        };
        match waited {
            Waited::Timeout => {
                self.put_back(stream);
                Ok(None)
            }
            Waited::Closed => Err(error(py, "DaemonUnavailable", "the event stream was closed".into())),
            // An ended stream stays ended: later calls say so (not "another
            // thread is waiting").
            Waited::Batch(None) => {
                self.closed.store(true, Ordering::SeqCst);
                Err(error(py, "DaemonUnavailable", "the event stream ended".into()))
            }
            Waited::Status(status) => {
                self.closed.store(true, Ordering::SeqCst);
                Err(client_error(py, ClientError::Rpc(status)))
            }
            Waited::Batch(Some(b)) => {
                self.put_back(stream);
                let events = b
                    .events
                    .iter()
                    .map(|e| {
                        let kind = kvmesh_client::event_kind_name(e.kind);
                        let key =
                            e.key.map(|k| key_be_bytes(kvmesh_client::Key::from_parts(k.hi, k.lo))).unwrap_or_default();
                        (kind, e.seq, key, e.version)
                    })
                    .collect();
                Ok(Some((b.node_id, b.instance_id, b.snapshot, b.snapshot_seq, b.snapshot_done, events)))
            }
        }
    }

    /// Ends the stream (the daemon frees the watcher); a `next_batch`
    /// waiting in another thread wakes and raises.
    fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        lock(&self.stream).take();
        self.wake.notify_one();
    }
}

fn key_be_bytes(k: kvmesh_client::Key) -> Vec<u8> {
    k.0.to_be_bytes().to_vec()
}

struct BatchState {
    blocks: Vec<Option<PinnedBlock>>,
    /// Live views (`Export` tokens) of this batch.
    exports: usize,
    released: bool,
}

/// Pinned blocks (see `kvmesh.Batch`).
#[pyclass(module = "kvmesh._kvmesh", frozen, name = "Batch")]
struct PyBatch {
    state: Arc<Mutex<BatchState>>,
    keys: Vec<Key>,
    client: blocking::Client,
}

/// Keeps a batch's pins, or an allocation's slots, while a view lives —
/// and the connection they belong to: the daemon releases a connection's
/// pins and allocations when it closes, so a view must keep it open even
/// after its batch and client are gone.
#[pyclass(module = "kvmesh._kvmesh", frozen, name = "Export")]
struct Export {
    of: Exported,
    _client: blocking::Client,
}

enum Exported {
    Batch(Arc<Mutex<BatchState>>),
    Alloc(Arc<Mutex<AllocState>>),
}

impl Drop for Export {
    fn drop(&mut self) {
        match &self.of {
            Exported::Batch(b) => {
                let mut st = lock(b);
                st.exports -= 1;
                if st.exports == 0 && st.released {
                    // Unpins in the background (the guards' drop).
                    st.blocks.clear();
                }
            }
            Exported::Alloc(a) => {
                let mut st = lock(a);
                st.exports -= 1;
                if st.exports == 0 && st.done {
                    // Aborts in the background (the guards' drop).
                    st.slots.clear();
                }
            }
        }
    }
}

#[pymethods]
impl PyBatch {
    fn __len__(&self) -> usize {
        self.keys.len()
    }

    /// Keys of the batch, as 16-byte `bytes`.
    #[getter]
    fn keys<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        self.keys.iter().map(|&k| key_bytes(py, k)).collect()
    }

    /// Per entry: pinned (True) or a miss (False).
    #[getter]
    fn present(&self) -> Vec<bool> {
        lock(&self.state).blocks.iter().map(Option::is_some).collect()
    }

    #[getter]
    fn released(&self) -> bool {
        lock(&self.state).released
    }

    /// Milliseconds left on the batch's lease (0: ended, or no pin).
    #[getter]
    fn lease_remaining_ms(&self) -> u64 {
        let st = lock(&self.state);
        st.blocks.iter().flatten().map(|b| b.lease_remaining().as_millis() as u64).min().unwrap_or(0)
    }

    /// Number of live views of this batch.
    #[getter]
    fn views(&self) -> usize {
        lock(&self.state).exports
    }

    /// `(address, length, token, device)` of entry `i` for a view (device
    /// -1: host memory; N: a device address on CUDA device N), or None on a
    /// miss.
    fn _export(&self, py: Python<'_>, i: isize) -> PyResult<Option<(usize, usize, Export, i32)>> {
        let mut st = lock(&self.state);
        if st.released {
            return Err(error(py, "Released", "the batch was released; pin again".into()));
        }
        let i = index(i, st.blocks.len())?;
        let Some(b) = &st.blocks[i] else { return Ok(None) };
        if b.lease_remaining().is_zero() {
            return Err(error(py, "LeaseExpired", format!("the lease of entry {i} has ended; pin again")));
        }
        let (addr, len, device) = match b.device() {
            Some(d) => (d.ptr as usize, d.len as usize, d.device as i32),
            None => (b.as_ptr() as usize, b.len(), -1),
        };
        st.exports += 1;
        Ok(Some((
            addr,
            len,
            Export { of: Exported::Batch(Arc::clone(&self.state)), _client: self.client.clone() },
            device,
        )))
    }

    /// Re-reads entry `i`'s whole slot and checks it still holds this block
    /// with a matching checksum (raises `KvmeshError` if not).
    fn verify(&self, py: Python<'_>, i: isize) -> PyResult<()> {
        let st = lock(&self.state);
        if st.released {
            return Err(error(py, "Released", "the batch was released; pin again".into()));
        }
        let i = index(i, st.blocks.len())?;
        let b = st.blocks[i].as_ref().ok_or_else(|| error(py, "Miss", format!("entry {i} is a miss")))?;
        b.verify().map_err(|e| error(py, "KvmeshError", format!("entry {i} failed validation: {e}")))
    }

    /// Unpins (now if no view of the batch lives, else when the last view
    /// goes). Idempotent.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let blocks: Vec<PinnedBlock> = {
            let mut st = lock(&self.state);
            if st.released {
                return Ok(());
            }
            st.released = true;
            if st.exports > 0 {
                return Ok(());
            }
            std::mem::take(&mut st.blocks).into_iter().flatten().collect()
        };
        if blocks.is_empty() {
            return Ok(());
        }
        let c = self.client.clone();
        py.detach(|| c.call(c.inner().unpin(blocks))).map(|_| ()).map_err(|e| client_error(py, e))
    }
}

fn index(i: isize, len: usize) -> PyResult<usize> {
    let j = if i < 0 { i + len as isize } else { i };
    if j < 0 || j as usize >= len {
        return Err(PyIndexError::new_err(format!("index {i} out of {len} entries")));
    }
    Ok(j as usize)
}

struct AllocState {
    slots: Vec<Option<Allocation>>,
    exports: usize,
    /// Committed or aborted.
    done: bool,
}

/// Slots of a put in progress (see `kvmesh.Allocation`).
#[pyclass(module = "kvmesh._kvmesh", frozen, name = "Allocation")]
struct PyAllocation {
    state: Arc<Mutex<AllocState>>,
    keys: Vec<Key>,
    client: blocking::Client,
}

fn status_name(a: &Option<Allocation>) -> &'static str {
    match a {
        Some(Allocation::Allocated(_)) => "allocated",
        Some(Allocation::Exists) => "exists",
        Some(Allocation::InProgress) => "in_progress",
        None => "done",
    }
}

#[pymethods]
impl PyAllocation {
    fn __len__(&self) -> usize {
        self.keys.len()
    }

    #[getter]
    fn keys<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        self.keys.iter().map(|&k| key_bytes(py, k)).collect()
    }

    /// Per entry: "allocated" (write it), "exists" or "in_progress".
    #[getter]
    fn status(&self) -> Vec<&'static str> {
        lock(&self.state).slots.iter().map(status_name).collect()
    }

    #[getter]
    fn done(&self) -> bool {
        lock(&self.state).done
    }

    #[getter]
    fn views(&self) -> usize {
        lock(&self.state).exports
    }

    fn _export(&self, py: Python<'_>, i: isize) -> PyResult<Option<(usize, usize, Export, i32)>> {
        let mut st = lock(&self.state);
        if st.done {
            return Err(error(py, "Released", "the allocation was committed or aborted".into()));
        }
        let i = index(i, st.slots.len())?;
        let Some(Allocation::Allocated(w)) = &mut st.slots[i] else { return Ok(None) };
        let (addr, len, device) = match w.device() {
            Some(d) => (d.ptr as usize, d.len as usize, d.device as i32),
            None => (w.as_mut_ptr() as usize, w.len(), -1),
        };
        st.exports += 1;
        Ok(Some((
            addr,
            len,
            Export { of: Exported::Alloc(Arc::clone(&self.state)), _client: self.client.clone() },
            device,
        )))
    }

    /// Commits every allocated entry; per entry "stored", "exists",
    /// "in_progress", "lost" (lease ended: not stored) or "refused: why".
    fn commit(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let (writes, mut out) = {
            let mut st = lock(&self.state);
            if st.done {
                return Err(error(py, "Released", "the allocation was already committed or aborted".into()));
            }
            if st.exports > 0 {
                return Err(invalid(
                    py,
                    format!(
                        "{} writable view(s) of the allocation are alive: release them (del, or memoryview.release()) before commit",
                        st.exports
                    ),
                ));
            }
            st.done = true;
            let mut writes: Vec<WritableBlock> = Vec::new();
            let mut out = Vec::with_capacity(st.slots.len());
            for s in std::mem::take(&mut st.slots) {
                out.push(match s {
                    Some(Allocation::Allocated(w)) => {
                        writes.push(w);
                        String::new()
                    }
                    other => status_name(&other).to_string(),
                });
            }
            (writes, out)
        };
        if writes.is_empty() {
            return Ok(out);
        }
        let c = self.client.clone();
        let results = py.detach(|| c.call(c.inner().commit(writes))).map_err(|e| client_error(py, e))?;
        let mut results = results.into_iter();
        for o in out.iter_mut().filter(|o| o.is_empty()) {
            *o = match results.next() {
                Some(CommitOutcome::Committed { .. }) => "stored".into(),
                Some(CommitOutcome::Refused(why)) => format!("refused: {why}"),
                Some(CommitOutcome::Lost) | None => "lost".into(),
            };
        }
        Ok(out)
    }

    /// Frees the slots without storing anything (when the last writable
    /// view goes, if some live). Idempotent.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        let writes: Vec<WritableBlock> = {
            let mut st = lock(&self.state);
            if st.done {
                return Ok(());
            }
            st.done = true;
            if st.exports > 0 {
                return Ok(());
            }
            std::mem::take(&mut st.slots)
                .into_iter()
                .filter_map(|s| match s {
                    Some(Allocation::Allocated(w)) => Some(w),
                    _ => None,
                })
                .collect()
        };
        if writes.is_empty() {
            return Ok(());
        }
        let c = self.client.clone();
        py.detach(|| c.call(c.inner().abort(writes))).map(|_| ()).map_err(|e| client_error(py, e))
    }
}

/// `kvmesh.chain_key`: the key of a block of `tokens` after the block whose
/// key is `parent` (None for the first block), as 16-byte `bytes`.
#[pyfunction]
#[pyo3(signature = (parent, tokens))]
fn chain_key<'py>(
    py: Python<'py>,
    parent: Option<&Bound<'py, PyAny>>,
    tokens: Vec<u32>,
) -> PyResult<Bound<'py, PyBytes>> {
    let parent = parent.map(|p| key_of(py, p)).transpose()?;
    Ok(key_bytes(py, Key::chain(parent, &tokens)))
}

/// `kvmesh.prefix_keys`: keys of the full blocks of `tokens`.
#[pyfunction]
fn prefix_keys<'py>(py: Python<'py>, tokens: Vec<u32>, block_tokens: usize) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    if block_tokens == 0 {
        return Err(invalid(py, "block_tokens must be at least 1"));
    }
    let keys = py.detach(|| Key::prefix_keys(&tokens, block_tokens));
    Ok(keys.into_iter().map(|k| key_bytes(py, k)).collect())
}

/// Normalizes a key (bytes, int or hex str) to 16-byte `bytes`.
#[pyfunction]
fn key<'py>(py: Python<'py>, k: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    Ok(key_bytes(py, key_of(py, k)?))
}

fn gpu_error(py: Python<'_>, e: kvmesh_kernels::cuda::GpuError) -> PyErr {
    use kvmesh_kernels::cuda::GpuError as G;
    match e {
        G::Layout(_) | G::Invalid(_) => invalid(py, e.to_string()),
        G::NoDriver(_) | G::NoDevice { .. } | G::Nvrtc(_) | G::Unsupported { .. } => {
            error(py, "NoDevice", e.to_string())
        }
        G::Driver { .. } => error(py, "KvmeshError", e.to_string()),
    }
}

fn kv_shape(
    py: Python<'_>,
    shape: (u32, u32, usize, usize, usize, usize, usize),
) -> PyResult<kvmesh_kernels::layout::PagedKv> {
    let (layout, dtype, l, b, t, h, d) = shape;
    let dims = [l, b, t, h, d].map(|x| x as u64);
    kvmesh_kernels::layout::PagedKv::from_codes(layout, dtype, dims).map_err(|e| invalid(py, e.to_string()))
}

/// `kvmesh._kvmesh.kv_sizes(shape)`: (block bytes, tensor count, tensor bytes).
#[pyfunction]
fn kv_sizes(py: Python<'_>, shape: (u32, u32, usize, usize, usize, usize, usize)) -> PyResult<(usize, usize, usize)> {
    let s = kv_shape(py, shape)?;
    let block = s.block_bytes().map_err(|e| invalid(py, e.to_string()))?;
    let (n, bytes) = s.tensors().map_err(|e| invalid(py, e.to_string()))?;
    Ok((block, n, bytes))
}

/// `kvmesh._kvmesh.kv_move(shape, device, gather, tensors, pages, slots,
/// slot_bytes)`: the C ABI's kvmesh_kv_gather/scatter over addresses. Only
/// `kvmesh.kernels` calls it, with addresses of arrays it keeps referenced
/// for the call and whose sizes it checked against the shape.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn kv_move(
    py: Python<'_>,
    shape: (u32, u32, usize, usize, usize, usize, usize),
    device: i32,
    gather: bool,
    tensors: Vec<u64>,
    pages: Vec<u64>,
    slots: Vec<u64>,
    slot_bytes: usize,
) -> PyResult<()> {
    use kvmesh_kernels::raw::{Direction, Memory, move_pages};
    let s = kv_shape(py, shape)?;
    let mem = Memory::from_code(device).ok_or_else(|| invalid(py, format!("device {device}")))?;
    let dir = if gather { Direction::Gather } else { Direction::Scatter };
    // What `move_pages` needs beyond what kvmesh.kernels checked: the memory
    // written does not overlap what is read (a slot that is a view of an
    // engine tensor), nor, for a scatter (every tensor written at once),
    // another tensor.
    let (_, tensor_bytes) = s.tensors().map_err(|e| invalid(py, e.to_string()))?;
    if let Some(why) = overlap(&tensors, tensor_bytes, &slots, slot_bytes, !gather) {
        return Err(invalid(py, why));
    }
    // kvmesh.kernels passes the addresses of arrays it holds
    // references to for the whole call, after checking each one is
    // contiguous, of the memory kind `device` names, as long as the shape
    // needs (tensors) or `slot_bytes` (slots), and writable where written;
    // the GIL is released, but the arrays stay referenced by the caller;
    // no slot overlaps a tensor, nor (scatter) a tensor another (checked
    // above). Python code writing these arrays from another thread during
    // the call breaks the contract as it would with any buffer handed to
    // native code without the GIL.
    // SAFETY: arrays held and checked by kvmesh.kernels and above.
    py.detach(|| unsafe { move_pages(&s, mem, dir, &tensors, &pages, &slots, slot_bytes) })
        .map_err(|e| gpu_error(py, e))
}

/// Why regions of a move overlap where they must not: a slot (`slot_bytes`
/// at each of `slots`) with a tensor (`tensor_bytes` at each of
/// `tensors`), or, with `tensors_written`, two tensors. `None` when none
/// does.
fn overlap(
    tensors: &[u64],
    tensor_bytes: usize,
    slots: &[u64],
    slot_bytes: usize,
    tensors_written: bool,
) -> Option<String> {
    let end = |a: u64, n: usize| a.saturating_add(n as u64);
    // Tensors by start, with the furthest end among those up to each.
    let mut t: Vec<u64> = tensors.to_vec();
    t.sort_unstable();
    let mut reach = Vec::with_capacity(t.len());
    let mut far = 0u64;
    for (i, &a) in t.iter().enumerate() {
        if tensors_written && i > 0 && a < far {
            return Some("two engine tensors overlap (a scatter writes them all)".into());
        }
        far = far.max(end(a, tensor_bytes));
        reach.push(far);
    }
    for (i, &s) in slots.iter().enumerate() {
        let e = end(s, slot_bytes);
        // Tensors starting before the slot ends; one overlaps if any of
        // them ends after the slot starts.
        let n = t.partition_point(|&a| a < e);
        if n > 0 && reach[n - 1] > s {
            return Some(format!("slots[{i}] overlaps an engine tensor (it is written or read where the other is)"));
        }
    }
    None
}

/// `kvmesh._kvmesh.kvsum64(device, address, length)`.
#[pyfunction]
fn kvsum64(py: Python<'_>, device: i32, address: u64, length: usize) -> PyResult<u64> {
    use kvmesh_kernels::raw::Memory;
    let mem = Memory::from_code(device).ok_or_else(|| invalid(py, format!("device {device}")))?;
    // SAFETY: kvmesh.kernels passes the address and length of a contiguous
    // array it keeps referenced for the call, of that memory kind.
    py.detach(|| unsafe { kvmesh_kernels::raw::kvsum64(mem, address, length) }).map_err(|e| gpu_error(py, e))
}

#[pymodule]
fn _kvmesh(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("KEY_SEED", kvmesh_common::KEY_SEED)?;
    m.add_class::<PyClient>()?;
    m.add_class::<PyNamespace>()?;
    m.add_class::<PyBatch>()?;
    m.add_class::<PyAllocation>()?;
    m.add_class::<Export>()?;
    m.add_class::<PyEvents>()?;
    m.add_function(wrap_pyfunction!(chain_key, m)?)?;
    m.add_function(wrap_pyfunction!(prefix_keys, m)?)?;
    m.add_function(wrap_pyfunction!(key, m)?)?;
    m.add_function(wrap_pyfunction!(kv_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(kv_move, m)?)?;
    m.add_function(wrap_pyfunction!(kvsum64, m)?)?;
    Ok(())
}
