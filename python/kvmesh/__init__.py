"""kvmesh: Python client of the local kvmeshd (KV-cache sharing daemon).

    import kvmesh
    client = kvmesh.Client()                       # default socket, or Client("/path/kvmeshd.sock")
    ns = client.register_namespace("llama3-8b/bf16/tp1", 65536, "layout=nhd")
    keys = kvmesh.prefix_keys(token_ids, block_tokens=16)
    client.put(ns, [(keys[0], block_bytes)])
    n = client.lookup(ns, keys)                    # cached prefix length
    with client.pin(ns, keys[:n]) as batch:        # zero copy: views into the daemon's pool
        arr = numpy.frombuffer(batch[0], dtype=numpy.uint8)

Every call into the daemon releases the GIL; one ``Client`` may be used by
many threads. See ``kvmesh.aio`` for asyncio.
"""

import ctypes as _ctypes
import json as _json
from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import _kvmesh, errors
from .errors import (
    DaemonUnavailable,
    InvalidArgument,
    KvmeshError,
    LeaseExpired,
    Miss,
    NoDevice,
    NotFound,
    Refused,
    Released,
    ResourceExhausted,
)

__version__ = _kvmesh.__version__
KEY_SEED = _kvmesh.KEY_SEED
Namespace = _kvmesh.Namespace
chain_key = _kvmesh.chain_key
prefix_keys = _kvmesh.prefix_keys
key = _kvmesh.key

KeyLike = Union[bytes, int, str]
NamespaceLike = Union["Namespace", str]

__all__ = [
    "Client",
    "Batch",
    "Allocation",
    "Namespace",
    "PutSummary",
    "InvalidateSummary",
    "chain_key",
    "prefix_keys",
    "key",
    "KEY_SEED",
    "DeviceView",
    "EventStream",
    "EventBatch",
    "KvEvent",
    "Location",
] + errors.__all__


class PutSummary(NamedTuple):
    """What a put did, per kind of outcome."""

    stored: int
    existed: int
    in_progress: int
    lost: int
    refused: int
    first_refusal: Optional[str]


class Location(NamedTuple):
    """Where keys are cached (``Client.locate``)."""

    #: Leading keys all cached.
    prefix_len: int
    #: Per key: the node id (``[node] id``) holding it, or None.
    nodes: List[Optional[int]]
    #: The answer covers the cluster (each key's home was asked); False:
    #: the daemon's own copies only.
    cluster_wide: bool
    #: Every home asked answered.
    complete: bool


class InvalidateSummary(NamedTuple):
    """What an invalidation did (``failed`` keys did not complete)."""

    invalidated: int
    failed: int
    first_error: str


class KvEvent(NamedTuple):
    """One KV event: ``kind`` is "stored", "removed", "evicted",
    "invalidated" or "snapshot"; ``key`` 16 bytes."""

    kind: str
    seq: int
    key: bytes
    version: int


class EventBatch(NamedTuple):
    """Events of one message of the stream, with the daemon that sent them
    (``node_id``; ``instance_id`` changes when it restarts)."""

    node_id: int
    instance_id: int
    snapshot: bool
    snapshot_seq: int
    snapshot_done: bool
    events: List[KvEvent]


class EventStream:
    """A ``WatchEvents`` stream (``Client.watch_events``). Iterating yields
    ``KvEvent``s for ever; ``next_batch(timeout)`` returns an ``EventBatch``
    or None after ``timeout`` seconds. Waiting releases the GIL; one thread
    reads at a time; ``close()`` from another thread wakes the reader."""

    __slots__ = ("_e",)

    def __init__(self, native):
        self._e = native

    def next_batch(self, timeout: Optional[float] = None) -> Optional[EventBatch]:
        ms = 0 if timeout is None else max(1, int(timeout * 1000))
        b = self._e.next_batch(ms)
        if b is None:
            return None
        node, instance, snap, snap_seq, snap_done, events = b
        return EventBatch(node, instance, snap, snap_seq, snap_done, [KvEvent(*e) for e in events])

    def __iter__(self):
        while True:
            # Short waits, so Ctrl-C (KeyboardInterrupt) gets through.
            b = self.next_batch(timeout=0.5)
            if b is not None:
                yield from b.events

    def close(self) -> None:
        self._e.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DeviceView:
    """A block in GPU memory (a namespace registered with ``device="cuda:N"``):
    ``length`` bytes at device address ``address`` of CUDA device
    ``device_id``, zero copy. torch and CuPy see it through
    ``__cuda_array_interface__`` (``torch.as_tensor(view, device="cuda")``,
    ``cupy.asarray(view)``); it keeps the pin (or slot) while it lives, like a
    host block's memoryview."""

    __slots__ = ("address", "length", "device_id", "readonly", "_token")

    def __init__(self, address: int, length: int, device_id: int, readonly: bool, token) -> None:
        self.address = address
        self.length = length
        self.device_id = device_id
        self.readonly = readonly
        self._token = token

    def __len__(self) -> int:
        return self.length

    @property
    def __cuda_array_interface__(self) -> dict:
        # The read-only flag is always False in the interface: torch refuses
        # read-only CUDA arrays outright. A pinned block must not be written
        # all the same (``readonly`` says so; verify() would catch it).
        return {
            "shape": (self.length,),
            "typestr": "|u1",
            "data": (self.address, False),
            "version": 3,
            "strides": None,
        }

    def __repr__(self) -> str:
        return f"DeviceView(cuda:{self.device_id}, {self.length} bytes at {self.address:#x})"


def _view(exported, readonly: bool):
    """A memoryview over (address, length) that keeps `token` alive, or a
    DeviceView for GPU memory."""
    if exported is None:
        return None
    addr, length, token, device = exported
    if device >= 0:
        return DeviceView(addr, length, device, readonly, token)
    arr = (_ctypes.c_char * length).from_address(addr)
    arr._kvmesh_export = token  # the view keeps the pin (or slot) while it lives
    mv = memoryview(arr).cast("B")
    return mv.toreadonly() if readonly else mv


def _writable_array(buffer):
    """A ctypes array over a writable, C-contiguous buffer (holds its export)."""
    try:
        n = memoryview(buffer).nbytes
    except TypeError:
        raise InvalidArgument(f"expected a buffer (bytearray, memoryview, numpy array...), not {type(buffer).__name__}") from None
    try:
        return (_ctypes.c_char * n).from_buffer(buffer)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"the destination must be a writable, C-contiguous buffer: {e}") from None


def _readable(block):
    if isinstance(block, bytes):
        return block
    try:
        mv = memoryview(block)
    except TypeError:
        raise InvalidArgument(f"a block is a buffer (bytes, bytearray, numpy array...), not {type(block).__name__}") from None
    if mv.readonly or not mv.c_contiguous:
        return mv.tobytes()  # one copy; writable contiguous buffers are read in place
    return (_ctypes.c_char * mv.nbytes).from_buffer(block)


class Batch:
    """Pinned blocks, read in place. ``batch[i]`` is a read-only
    ``memoryview`` into the daemon's pool (``None`` on a miss); use it with
    ``numpy.frombuffer`` for a zero-copy array. Use as a context manager, or
    call ``release()``. Read within the lease (``lease_remaining_ms``).

    After ``release()`` no new view can be taken (``Released``); views
    already taken keep the pins until the last of them goes.
    """

    __slots__ = ("_b",)

    def __init__(self, native):
        self._b = native

    def __len__(self) -> int:
        return len(self._b)

    def __getitem__(self, i: int) -> Optional[Union[memoryview, "DeviceView"]]:
        return _view(self._b._export(i), readonly=True)

    def __iter__(self):
        for i in range(len(self._b)):
            yield self[i]

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def keys(self) -> List[bytes]:
        return self._b.keys

    @property
    def present(self) -> List[bool]:
        """Per entry: pinned (True) or a miss."""
        return self._b.present

    @property
    def hits(self) -> int:
        return sum(self._b.present)

    @property
    def lease_remaining_ms(self) -> int:
        return self._b.lease_remaining_ms

    @property
    def released(self) -> bool:
        return self._b.released

    def verify(self, i: int) -> None:
        """Re-reads entry ``i``'s whole slot and checks it still holds this
        block with a matching checksum (raises ``KvmeshError`` if not,
        ``Miss`` for a missed entry)."""
        self._b.verify(i)

    def release(self) -> None:
        """Unpins (idempotent)."""
        self._b.release()


class Allocation:
    """Slots of a put in progress. ``alloc[i]`` is a writable ``memoryview``
    of the slot (``None`` if the key ``exists`` or is ``in_progress``, see
    ``status``); fill it, drop the views, then ``commit()``. As a context
    manager, anything not committed at exit is aborted.
    """

    __slots__ = ("_a",)

    def __init__(self, native):
        self._a = native

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, i: int) -> Optional[Union[memoryview, "DeviceView"]]:
        return _view(self._a._export(i), readonly=False)

    def __enter__(self) -> "Allocation":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    @property
    def keys(self) -> List[bytes]:
        return self._a.keys

    @property
    def status(self) -> List[str]:
        """Per entry: "allocated", "exists" or "in_progress"."""
        return self._a.status

    def commit(self) -> List[str]:
        """Makes the written blocks visible. Per entry: "stored", "exists",
        "in_progress", "lost" (lease ended: not stored) or "refused: <why>".
        Raises ``InvalidArgument`` while a view of the allocation lives."""
        return self._a.commit()

    def abort(self) -> None:
        """Frees the slots without storing (idempotent; after commit: no-op)."""
        self._a.abort()


class Client:
    """A connection to the local kvmeshd (``socket``: its path; None: the
    default, ``$XDG_RUNTIME_DIR/kvmesh/kvmeshd.sock`` else
    ``/tmp/kvmesh-<uid>/kvmeshd.sock``).

    Thread-safe: share one client between threads (each call releases the
    GIL while it waits for the daemon). When it is closed, or the process
    dies, the daemon drops its pins and unfinished puts.

    ``ns`` arguments are a ``Namespace`` or a registered namespace's name;
    keys are 16-byte ``bytes`` (big-endian), ``int`` or 32-hex-digit ``str``.
    """

    __slots__ = ("_c",)

    def __init__(self, socket: Optional[str] = None):
        self._c = _kvmesh.Client(socket)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def socket(self) -> str:
        return self._c.socket

    @property
    def batch_keys_max(self) -> int:
        """Most keys in one request."""
        return self._c.batch_keys_max

    def close(self) -> None:
        """Closes the connection (views and batches already made stay valid
        until released)."""
        self._c.close()

    def register_namespace(self, name: str, block_bytes: int, layout: str = "", device: str = "") -> Namespace:
        """Registers a namespace, or returns the identical existing one
        (another block size, layout or device under the same name:
        InvalidArgument). ``device="cuda:N"`` puts its blocks in the
        daemon's GPU pools on device N: ``batch[i]`` is then a
        ``DeviceView`` (``__cuda_array_interface__``), not a memoryview."""
        return self._c.register_namespace(name, block_bytes, layout, device)

    def namespace(self, name: str) -> Namespace:
        """Finds a registered namespace (NotFound if none)."""
        return self._c.namespace(name)

    def lookup(self, ns: NamespaceLike, keys: Sequence[KeyLike]) -> int:
        """Length of the cached prefix of ``keys``. Pins nothing."""
        return self._c.lookup(ns, keys)[0]

    def contains(self, ns: NamespaceLike, keys: Sequence[KeyLike]) -> List[bool]:
        """Per key: cached or not. Pins nothing."""
        return self._c.lookup(ns, keys)[1]

    def locate(self, ns: NamespaceLike, keys: Sequence[KeyLike], local_only: bool = False) -> Location:
        """Where ``keys`` are cached: on a clustered daemon, cluster-wide
        (each key's home is asked; nothing is pinned, granted or moved)
        unless ``local_only``. A key reported at a node was Valid there
        during the call (unless that node had just dropped it); a later pin
        may still miss."""
        return Location(*self._c.locate(ns, keys, local_only))

    def pin(self, ns: NamespaceLike, keys: Sequence[KeyLike], lease_ms: int = 0, stop_at_first_miss: bool = False) -> Batch:
        """Pins the cached keys for reading in place (see ``Batch``)."""
        return Batch(self._c.pin(ns, keys, lease_ms, stop_at_first_miss))

    def get_into(self, ns: NamespaceLike, keys: Sequence[KeyLike], buffer) -> List[bool]:
        """Copies cached blocks into ``buffer`` (any writable C-contiguous
        buffer of ``len(keys) * block_bytes`` bytes: bytearray, numpy array,
        memoryview...), back to back. Per key: hit or miss (a miss's bytes
        are left untouched)."""
        arr = _writable_array(buffer)
        return self._c._get_into(ns, keys, arr)

    def put(self, ns: NamespaceLike, blocks: Iterable[Tuple[KeyLike, object]]) -> PutSummary:
        """Stores whole blocks (``(key, buffer)`` pairs; keys already cached
        are left as they are)."""
        return self._put(ns, blocks, False)

    def put_overwrite(self, ns: NamespaceLike, blocks: Iterable[Tuple[KeyLike, object]]) -> PutSummary:
        """Stores a new version of each block, cached or not (mutable keys):
        when it returns, no daemon of the cluster serves an older version."""
        return self._put(ns, blocks, True)

    def _put(self, ns, blocks, overwrite: bool) -> PutSummary:
        pairs = list(blocks)
        keys = [k for k, _ in pairs]
        data = [_readable(b) for _, b in pairs]
        return PutSummary(*self._c._put(ns, keys, data, overwrite))

    def allocate(self, ns: NamespaceLike, keys: Sequence[KeyLike], overwrite: bool = False, lease_ms: int = 0) -> Allocation:
        """Put, phase one: a writable slot per absent key (every key with
        ``overwrite``), see ``Allocation``."""
        return Allocation(self._c.allocate(ns, keys, overwrite, lease_ms))

    def invalidate(self, ns: NamespaceLike, keys: Sequence[KeyLike]) -> InvalidateSummary:
        """Makes sure no daemon of the cluster serves the current version of
        ``keys`` (without peers: removes them). Raises ``Refused`` if some
        did not complete."""
        s = InvalidateSummary(*self._c.invalidate(ns, keys))
        if s.failed:
            raise Refused(f"invalidation of {s.failed} keys did not complete: {s.first_error}")
        return s

    def invalidate_namespace(self, ns: NamespaceLike) -> InvalidateSummary:
        """As ``invalidate`` for every key of the namespace."""
        s = InvalidateSummary(*self._c.invalidate_namespace(ns))
        if s.failed:
            raise Refused(f"invalidation of {s.failed} keys did not complete: {s.first_error}")
        return s

    def remove(self, ns: NamespaceLike, keys: Sequence[KeyLike]) -> List[bool]:
        """Removes keys from this daemon; per key whether it was cached."""
        return self._c.remove(ns, keys)

    def stats(self) -> dict:
        """The daemon's statistics (the JSON of ``kvmesh stats --json``)."""
        return _json.loads(self._c.stats_json())

    def watch_events(self, ns: NamespaceLike, snapshot: bool = False) -> "EventStream":
        """KV events of a namespace on this daemon (stored, removed, evicted,
        invalidated), for cache-aware routers: iterate the ``EventStream``,
        or call ``next_batch(timeout)``. With ``snapshot``, the blocks held
        now come first (kind ``"snapshot"``). ``seq`` numbers a namespace's
        events from 1 without gaps; a gap, or ``ResourceExhausted`` (the
        daemon cut a slow watcher off), means watching again with
        ``snapshot=True``."""
        return EventStream(self._c.watch_events(ns, snapshot))
