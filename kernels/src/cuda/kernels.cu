// kvmesh CUDA kernels, compiled at run time with NVRTC (kernels/src/cuda.rs).
// Each one has a CPU reference in Rust that tests compare it with:
//   kvsum_partial          -> checksum.rs (partial)
//   kv_gather_*/kv_scatter_* -> layout.rs (PagedKv::gather / scatter)
// No headers: NVRTC compiles this without a CUDA toolkit's include files.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

#define KVSUM_P1 0x9E3779B97F4A7C15ULL

__device__ __forceinline__ u64 fmix64(u64 k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

// S of kvsum64 over `len` bytes at `p` (8-byte aligned: the host checks),
// added into *out (zeroed by the host). Launched with 256 threads per block
// (whole warps: the shuffle below needs every lane). Word i is mixed with key (i+1)*P1;
// sums are mod 2^64, so the order of additions does not matter.
extern "C" __global__ void kvsum_partial(const u8* __restrict__ p, u64 len, u64* __restrict__ out) {
    const u64 nw = len >> 3;
    const u64* w = (const u64*)p;
    u64 s = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nw; i += stride) {
        s += fmix64(w[i] ^ ((i + 1) * KVSUM_P1));
    }
    if (blockIdx.x == 0 && threadIdx.x == 0 && (len & 7)) {
        u64 t = 0;
        for (u64 b = 0; b < (len & 7); b++) {
            t |= (u64)p[nw * 8 + b] << (8 * b);
        }
        s += fmix64(t ^ ((nw + 1) * KVSUM_P1));
    }
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_down_sync(0xffffffffu, s, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(out, s);
    }
}

// Row index, in the engine tensor, of (page b, layer l, kv, token t, head h);
// the same formulas as PagedKv::engine_row in layout.rs.
// layout: 0 NHD, 1 HND, 2 FlashInfer, 3 MLA, 4 cross-layer.
__device__ __forceinline__ u64 engine_row(u32 layout, u64 nb, u64 nl, u64 tt, u64 hh,
                                          u64 b, u64 l, u64 kv, u64 t, u64 h) {
    switch (layout) {
    case 0: return ((kv * nb + b) * tt + t) * hh + h;
    case 1: return ((kv * nb + b) * hh + h) * tt + t;
    case 2: return ((b * 2 + kv) * tt + t) * hh + h;
    case 3: return b * tt + t;
    default: return (((b * nl + l) * 2 + kv) * tt + t) * hh + h;
    }
}

// One grid row (blockIdx.y) per (page, slot) pair; threads stride over the
// units (U: 16, 8, 4 or 1 bytes) of the packed block, slot order
// [layers, kv, tokens, heads, row]. dir 0 gathers (engine -> slot), 1
// scatters (slot -> engine). The host checked every page, size and
// alignment; all indices of one block fit in 32 bits (checked too).
template <typename U>
__device__ void kv_move(u32 dir, u32 layout, u64 nb, u32 nl, u32 kvn, u32 tt, u32 hh, u32 row_units,
                        U* const* tensors, const u64* pages, U* const* slots) {
    const u64 page = pages[blockIdx.y];
    U* slot = slots[blockIdx.y];
    const u32 total = nl * kvn * tt * hh * row_units;
    for (u32 u = blockIdx.x * blockDim.x + threadIdx.x; u < total; u += gridDim.x * blockDim.x) {
        const u32 r = u / row_units;
        const u32 within = u - r * row_units;
        const u32 h = r % hh;
        u32 q = r / hh;
        const u32 t = q % tt;
        q /= tt;
        const u32 kv = q % kvn;
        const u32 l = q / kvn;
        const u64 er = engine_row(layout, nb, nl, tt, hh, page, l, kv, t, h);
        U* e = tensors[layout == 4 ? 0 : l] + er * row_units + within;
        if (dir == 0) {
            slot[u] = *e;
        } else {
            *e = slot[u];
        }
    }
}

struct __align__(16) v16 { u64 a, b; };

#define KV_MOVE(name, U)                                                                         \
    extern "C" __global__ void name(u32 dir, u32 layout, u64 nb, u32 nl, u32 kvn, u32 tt, u32 hh, \
                                    u32 row_units, U* const* tensors, const u64* pages,          \
                                    U* const* slots) {                                           \
        kv_move<U>(dir, layout, nb, nl, kvn, tt, hh, row_units, tensors, pages, slots);         \
    }

KV_MOVE(kv_move_16, v16)
KV_MOVE(kv_move_8, u64)
KV_MOVE(kv_move_4, u32)
KV_MOVE(kv_move_1, u8)
