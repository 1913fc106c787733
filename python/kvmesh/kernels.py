"""kvmesh.kernels: move an engine's paged KV pages into block slots and back.

    from kvmesh import kernels
    shape = kernels.KvShape("nhd", "float16", num_layers=32, num_blocks=4096,
                            block_tokens=16, kv_heads=8, head_dim=128)
    block_bytes, _, _ = shape.sizes()
    kernels.gather(shape, layer_tensors, pages=[7, 9], slots=[s0, s1])
    kernels.scatter(shape, layer_tensors, pages=[3, 4], slots=[s0, s1])

Tensors and slots are torch tensors (CPU or CUDA), CuPy arrays or NumPy
arrays: contiguous, all in host memory or all on one CUDA
device. Host memory runs the CPU implementation, device memory the CUDA
kernels (compiled at first use with NVRTC); both produce the same bytes.

A block is packed in a slot the same way whatever the engine's layout
(``[layers, K/V, tokens, kv_heads, head_dim]``, MLA ``[layers, tokens,
latent]``), so an engine can reuse a block another engine wrote with
another layout. Layouts (per-layer tensors unless said):

- ``nhd``: ``[2, num_blocks, block_tokens, kv_heads, head_dim]`` (vLLM)
- ``hnd``: ``[2, num_blocks, kv_heads, block_tokens, head_dim]``
- ``flashinfer``: ``[num_blocks, 2, block_tokens, kv_heads, head_dim]``
- ``mla``: ``[num_blocks, block_tokens, latent_dim]`` (``head_dim`` = latent)
- ``cross_layer``: one tensor ``[num_blocks, num_layers, 2, block_tokens,
  kv_heads, head_dim]``

Every size is checked before a byte moves (``InvalidArgument``); GPU memory
on a machine without a CUDA driver raises ``NoDevice``.
"""

from typing import Any, NamedTuple, Sequence, Tuple

from . import _kvmesh
from .errors import InvalidArgument

__all__ = ["KvShape", "gather", "scatter", "kvsum64", "kvsum64_py", "LAYOUTS", "DTYPES"]

LAYOUTS = {"nhd": 0, "hnd": 1, "flashinfer": 2, "mla": 3, "cross_layer": 4}
DTYPES = {
    "float16": 0,
    "f16": 0,
    "half": 0,
    "bfloat16": 1,
    "bf16": 1,
    "float8_e4m3fn": 2,
    "float8_e5m2": 2,
    "fp8": 2,
}


class KvShape(NamedTuple):
    """The shape of an engine's paged KV cache."""

    layout: str
    dtype: str
    num_layers: int
    num_blocks: int
    block_tokens: int
    kv_heads: int
    head_dim: int

    def _codes(self) -> Tuple[int, int, int, int, int, int, int]:
        if self.layout not in LAYOUTS:
            raise InvalidArgument(f"layout {self.layout!r}: one of {sorted(LAYOUTS)}")
        dtype = str(self.dtype).replace("torch.", "")
        if dtype not in DTYPES:
            raise InvalidArgument(f"dtype {self.dtype!r}: one of {sorted(DTYPES)}")
        dims = (self.num_layers, self.num_blocks, self.block_tokens, self.kv_heads, self.head_dim)
        if any(not isinstance(d, int) or d < 0 for d in dims):
            raise InvalidArgument(f"dimensions must be non-negative ints: {dims}")
        return (LAYOUTS[self.layout], DTYPES[dtype]) + dims

    def sizes(self) -> Tuple[int, int, int]:
        """(bytes of one block in a slot, number of engine tensors, bytes of each)."""
        return tuple(_kvmesh.kv_sizes(self._codes()))  # type: ignore[return-value]


def _itemsize(typestr: str) -> int:
    return int(typestr[2:])


def _region(obj: Any, writable: bool, what: str) -> Tuple[int, int, int]:
    """(address, bytes, device) of a contiguous array; device -1 is host."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):  # torch
        if not obj.is_contiguous():
            raise InvalidArgument(f"{what}: a contiguous tensor is needed")
        dev = obj.device
        if dev.type == "cuda":
            device = dev.index if dev.index is not None else 0
        elif dev.type == "cpu":
            device = -1
        else:
            raise InvalidArgument(f"{what}: tensors on {dev.type} are not supported")
        return obj.data_ptr(), obj.numel() * obj.element_size(), device
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:  # CuPy, Numba, ...
        _contiguous(cai, what)
        addr, readonly = cai["data"]
        # A kvmesh.DeviceView of a pinned block says False in its interface
        # (torch refuses read-only CUDA arrays) and True in ``readonly``.
        if writable and (readonly or getattr(obj, "readonly", False)):
            raise InvalidArgument(f"{what}: read-only array")
        device = getattr(obj, "device_id", None)  # kvmesh.DeviceView
        if device is None:
            device = getattr(getattr(obj, "device", None), "id", None)  # CuPy
        if device is None:
            raise InvalidArgument(f"{what}: cannot tell which CUDA device holds it")
        return addr, _nbytes(cai), int(device)
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:  # NumPy
        _contiguous(ai, what)
        addr, readonly = ai["data"]
        if writable and readonly:
            raise InvalidArgument(f"{what}: read-only array")
        return addr, _nbytes(ai), -1
    raise InvalidArgument(f"{what}: a torch tensor, CuPy or NumPy array is needed, not {type(obj).__name__}")


def _nbytes(iface: dict) -> int:
    n = _itemsize(iface["typestr"])
    for d in iface["shape"]:
        n *= d
    return n


def _contiguous(iface: dict, what: str) -> None:
    strides = iface.get("strides")
    if strides is None:
        return
    expect = _itemsize(iface["typestr"])
    for dim, stride in zip(reversed(iface["shape"]), reversed(strides)):
        if dim > 1 and stride != expect:
            raise InvalidArgument(f"{what}: a C-contiguous array is needed")
        expect *= dim


def _move(shape: KvShape, tensors: Sequence[Any], pages: Sequence[int], slots: Sequence[Any], gather: bool) -> None:
    codes = shape._codes()
    block, count, tensor_bytes = shape.sizes()
    if len(tensors) != count:
        raise InvalidArgument(f"{count} engine tensors expected ({shape.layout}), got {len(tensors)}")
    if len(pages) != len(slots):
        raise InvalidArgument(f"{len(pages)} pages but {len(slots)} slots")
    if not slots:
        return
    t_regions = [_region(t, not gather, f"tensors[{i}]") for i, t in enumerate(tensors)]
    s_regions = [_region(s, gather, f"slots[{i}]") for i, s in enumerate(slots)]
    devices = {r[2] for r in t_regions + s_regions}
    if len(devices) != 1:
        raise InvalidArgument(f"tensors and slots must all be in host memory or all on one CUDA device, got {sorted(devices)}")
    for i, (_, n, _) in enumerate(t_regions):
        if n != tensor_bytes:
            raise InvalidArgument(f"tensors[{i}]: {n} bytes, the shape needs {tensor_bytes}")
    slot_bytes = min(n for _, n, _ in s_regions)
    if slot_bytes < block:
        raise InvalidArgument(f"a slot of {slot_bytes} bytes is smaller than the block ({block})")
    for p in pages:
        if not isinstance(p, int) or p < 0:
            raise InvalidArgument(f"page {p!r} is not a non-negative int")
    # The arrays stay referenced by `tensors` and `slots` for the whole call.
    _kvmesh.kv_move(
        codes,
        devices.pop(),
        gather,
        [r[0] for r in t_regions],
        list(pages),
        [r[0] for r in s_regions],
        slot_bytes,
    )


def gather(shape: KvShape, tensors: Sequence[Any], pages: Sequence[int], slots: Sequence[Any]) -> None:
    """Packs page ``pages[i]`` of the engine's ``tensors`` into ``slots[i]``
    (each at least ``shape.sizes()[0]`` bytes)."""
    _move(shape, tensors, pages, slots, True)


def scatter(shape: KvShape, tensors: Sequence[Any], pages: Sequence[int], slots: Sequence[Any]) -> None:
    """Unpacks ``slots[i]`` into page ``pages[i]`` of the engine's
    ``tensors``; nothing else of them is written."""
    _move(shape, tensors, pages, slots, False)


def kvsum64(buf: Any) -> int:
    """The ``kvsum64`` checksum of a contiguous array's bytes (on the GPU for
    device memory, whose address must be 8-byte aligned)."""
    addr, n, device = _region(buf, False, "buf")
    return _kvmesh.kvsum64(device, addr, n)


def kvsum64_py(data: bytes) -> int:
    """``kvsum64`` written in Python from its definition (docs/GPU.md), for
    checking the native and GPU implementations; slow (one word at a time)."""
    m = (1 << 64) - 1

    def fmix(k: int) -> int:
        k ^= k >> 33
        k = (k * 0xFF51AFD7ED558CCD) & m
        k ^= k >> 33
        k = (k * 0xC4CEB9FE1A85EC53) & m
        k ^= k >> 33
        return k

    s = 0
    for i in range(0, len(data), 8):
        w = int.from_bytes(data[i : i + 8].ljust(8, b"\0"), "little")
        s = (s + fmix(w ^ (((i // 8 + 1) * 0x9E3779B97F4A7C15) & m))) & m
    seed = int.from_bytes(b"kvsum64\0", "little")
    return fmix(s ^ ((len(data) * 0xC2B2AE3D27D4EB4F) & m) ^ seed)
