"""kvmesh.kernels against a NumPy (and, with a CUDA GPU, torch) reference
of the layouts, written from their definitions: the slot packing is
[layers, K/V, tokens, heads, head_dim] (MLA [layers, tokens, latent])."""

import numpy as np
import pytest

import kvmesh
from kvmesh import kernels
from kvmesh.errors import InvalidArgument, NoDevice

L, NB, T, H, D = 3, 5, 4, 2, 8


def engine_tensors(layout, rng, itemsize):
    """Random engine tensors of a layout, as uint8 arrays of the logical shape
    with the element bytes as the last axis."""
    shapes = {
        "nhd": (2, NB, T, H, D),
        "hnd": (2, NB, H, T, D),
        "flashinfer": (NB, 2, T, H, D),
        "mla": (NB, T, D),
        "cross_layer": (NB, L, 2, T, H, D),
    }
    count = 1 if layout == "cross_layer" else L
    return [rng.integers(0, 256, size=shapes[layout] + (itemsize,), dtype=np.uint8) for _ in range(count)]


def packed(layout, tensors, page):
    """The slot bytes of `page`, from numpy indexing."""
    if layout == "cross_layer":
        return tensors[0][page].tobytes()  # [L, 2, T, H, D, e]
    per_layer = []
    for t in tensors:
        if layout == "nhd":
            per_layer.append(t[:, page])  # [2, T, H, D, e]
        elif layout == "hnd":
            per_layer.append(t[:, page].transpose(0, 2, 1, 3, 4))  # [2, H, T] -> [2, T, H]
        elif layout == "flashinfer":
            per_layer.append(t[page])
        else:
            per_layer.append(t[page])  # [T, D, e]
    return np.ascontiguousarray(np.stack(per_layer)).tobytes()


@pytest.mark.parametrize("layout", list(kernels.LAYOUTS))
@pytest.mark.parametrize("dtype,itemsize", [("float16", 2), ("bfloat16", 2), ("fp8", 1)])
def test_gather_scatter_match_numpy_reference(layout, dtype, itemsize):
    rng = np.random.default_rng(7)
    shape = kernels.KvShape(layout, dtype, L, NB, T, H, D)
    block, count, tensor_bytes = shape.sizes()
    tensors = engine_tensors(layout, rng, itemsize)
    assert len(tensors) == count and tensors[0].nbytes == tensor_bytes
    pages = [4, 0, 2]
    slots = [np.zeros(block + 16, dtype=np.uint8) for _ in pages]
    kernels.gather(shape, tensors, pages, slots)
    for p, s in zip(pages, slots):
        assert s[:block].tobytes() == packed(layout, tensors, p), f"{layout} page {p}"
        assert not s[block:].any(), "nothing past the block"
    # Scatter into zeroed tensors: only those pages, equal to the originals.
    out = [np.zeros_like(t) for t in tensors]
    kernels.scatter(shape, out, pages, slots)
    for p in range(NB):
        want = packed(layout, tensors, p) if p in pages else bytes(block)
        assert packed(layout, out, p) == want, f"{layout} page {p} after scatter"


def test_bad_arguments_are_invalid_argument():
    shape = kernels.KvShape("nhd", "float16", L, NB, T, H, D)
    block, count, tensor_bytes = shape.sizes()
    tensors = [np.zeros(tensor_bytes, dtype=np.uint8) for _ in range(count)]
    slot = np.zeros(block, dtype=np.uint8)
    with pytest.raises(InvalidArgument):
        kernels.gather(shape, tensors, [NB], [slot])  # page outside
    with pytest.raises(InvalidArgument):
        kernels.gather(shape, tensors[:1], [0], [slot])  # tensor count
    with pytest.raises(InvalidArgument):
        kernels.gather(shape, tensors, [0], [slot[:-1]])  # short slot
    with pytest.raises(InvalidArgument):
        kernels.gather(shape, [t[:-1] for t in tensors], [0], [slot])  # tensor size
    with pytest.raises(InvalidArgument):
        kernels.gather(shape, tensors, [0], [np.zeros((block, 2), dtype=np.uint8)[:, 0]])  # strided
    ro = np.zeros(block, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgument):
        kernels.gather(shape, tensors, [0], [ro])  # read-only slot
    with pytest.raises(InvalidArgument):
        kernels.gather(shape, tensors, [0], [tensors[0][:block]])  # a slot inside a tensor
    with pytest.raises(InvalidArgument):
        kernels.scatter(shape, tensors, [0], [tensors[-1][tensor_bytes - block:]])  # read where written
    if count > 1:
        with pytest.raises(InvalidArgument):
            kernels.scatter(shape, [tensors[0]] * count, [0], [slot])  # tensors written twice at once
    with pytest.raises(InvalidArgument):
        kernels.KvShape("paged", "float16", 1, 1, 1, 1, 1).sizes()
    with pytest.raises(InvalidArgument):
        kernels.KvShape("nhd", "float16", 1, 1, 0, 1, 1).sizes()


def test_kvsum64_matches_its_definition():
    rng = np.random.default_rng(3)
    for n in [1, 7, 8, 9, 100, 4096, 4099]:
        a = rng.integers(0, 256, size=n, dtype=np.uint8)
        assert kernels.kvsum64(a) == kernels.kvsum64_py(a.tobytes()), n


def test_a_pinned_device_block_is_never_a_kernel_destination():
    # A DeviceView of a pinned block says "writable" in its CUDA array
    # interface (torch refuses read-only CUDA arrays) and readonly=True on
    # itself: it is refused as a destination before anything runs.
    view = kvmesh.DeviceView(0x1000, 4096, 0, True, None)
    with pytest.raises(InvalidArgument, match="read-only"):
        kernels._region(view, True, "slot")
    assert kernels._region(view, False, "slot") == (0x1000, 4096, 0)
    writable = kvmesh.DeviceView(0x1000, 4096, 0, False, None)
    assert kernels._region(writable, True, "slot") == (0x1000, 4096, 0)


def test_device_memory_without_a_driver_is_no_device():
    import ctypes.util

    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("a CUDA driver library is installed here")
    with pytest.raises(NoDevice, match="CUDA"):
        kvmesh._kvmesh.kvsum64(0, 4096, 8)  # device 0: refused before any access


def test_gpu_gather_matches_the_numpy_reference():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch: the GPU path is checked by scripts/gpu-check.sh")
    shape = kernels.KvShape("nhd", "float16", L, NB, T, H, D)
    block, count, _ = shape.sizes()
    g = torch.Generator(device="cpu").manual_seed(1)
    cpu = [torch.randint(0, 256, (2, NB, T, H, D * 2), dtype=torch.uint8, generator=g) for _ in range(count)]
    dev = [t.cuda() for t in cpu]
    slots = [torch.zeros(block, dtype=torch.uint8, device="cuda") for _ in range(2)]
    try:
        kernels.gather(shape, dev, [1, 3], slots)
    except NoDevice as e:  # torch sees a GPU but NVRTC is missing
        pytest.skip(f"NoDevice: {e}")
    for p, s in zip([1, 3], slots):
        assert s.cpu().numpy().tobytes() == packed("nhd", [t.numpy() for t in cpu], p)
    assert kernels.kvsum64(slots[0]) == kernels.kvsum64_py(slots[0].cpu().numpy().tobytes())


def test_device_views_speak_the_cuda_array_interface():
    # No device memory is touched: the interface and the kernels' argument
    # parsing only read the numbers.
    v = kvmesh.DeviceView(0x7F0000001000, 4096, 1, True, None)
    cai = v.__cuda_array_interface__
    assert cai["shape"] == (4096,) and cai["typestr"] == "|u1" and cai["version"] == 3
    assert cai["data"] == (0x7F0000001000, False), "torch refuses read-only CUDA arrays"
    assert v.readonly and len(v) == 4096
    assert kernels._region(v, False, "v") == (0x7F0000001000, 4096, 1)
