/* The kernels of the C ABI (kvmesh_kv_gather / _scatter / kvmesh_kvsum64)
 * on host memory, checked against a reference written here in C from the
 * layouts' definitions (independent of the Rust one). Device memory: on a
 * machine without a CUDA driver the call must fail with KVMESH_E_NO_DEVICE
 * (and say why); with one, the GPU check (scripts/gpu-check.sh) covers it. */
#include <kvmesh.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0, checks = 0;
#define CHECK(c, ...)                                                    \
    do {                                                                 \
        checks++;                                                        \
        if (!(c)) {                                                      \
            failures++;                                                  \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                  \
            printf(__VA_ARGS__);                                         \
            printf(" (%s)\n", kvmesh_last_error());                      \
        }                                                                \
    } while (0)

/* Offset of element (page b, layer l, kv, token t, head h), in rows, inside
 * the tensor holding it, written from the table in docs/GPU.md. */
static size_t row_of(uint32_t layout, size_t nb, size_t nl, size_t T, size_t H, size_t b, size_t l, size_t kv,
                     size_t t, size_t h) {
    switch (layout) {
    case KVMESH_LAYOUT_NHD: /* [2, nb, T, H, D] */ return ((kv * nb + b) * T + t) * H + h;
    case KVMESH_LAYOUT_HND: /* [2, nb, H, T, D] */ return ((kv * nb + b) * H + h) * T + t;
    case KVMESH_LAYOUT_FLASHINFER: /* [nb, 2, T, H, D] */ return ((b * 2 + kv) * T + t) * H + h;
    case KVMESH_LAYOUT_MLA: /* [nb, T, D] */ return b * T + t;
    default: /* [nb, L, 2, T, H, D] */ return ((((b * nl + l) * 2 + kv) * T + t) * H) + h;
    }
}

static int run_layout(uint32_t layout, uint32_t dtype) {
    kvmesh_kv_shape_t s = {layout, dtype, 3, 4, 5, 2, 6};
    size_t esz = dtype == KVMESH_DTYPE_FP8 ? 1 : 2;
    int mla = layout == KVMESH_LAYOUT_MLA;
    size_t L = 3, NB = 4, T = 5, H = mla ? 1 : 2, KV = mla ? 1 : 2, row = 6 * esz;
    uint64_t block = 0, count = 0, tbytes = 0;
    CHECK(kvmesh_kv_sizes(&s, &block, &count, &tbytes) == KVMESH_OK, "sizes");
    CHECK(block == L * KV * T * H * row, "block bytes %llu", (unsigned long long)block);
    CHECK(count == (layout == KVMESH_LAYOUT_CROSS_LAYER ? 1 : L), "tensor count %llu", (unsigned long long)count);
    CHECK(tbytes * count == NB * block, "tensor bytes %llu", (unsigned long long)tbytes);
    unsigned char *tensors[8], *back[8];
    for (size_t i = 0; i < count; i++) {
        tensors[i] = malloc(tbytes);
        back[i] = calloc(1, tbytes);
        for (size_t j = 0; j < tbytes; j++) tensors[i][j] = (unsigned char)(j * 131 + i * 17 + 7);
    }
    unsigned char *slot = malloc(block + 8);
    memset(slot, 0xEE, block + 8);
    uint64_t page = 2;
    void *slots[1] = {slot};
    CHECK(kvmesh_kv_gather(&s, KVMESH_DEVICE_HOST, (const void *const *)tensors, count, &page, slots, 1, block + 8) ==
              KVMESH_OK,
          "gather layout %u", layout);
    /* The packing: [L, KV, T, H, row]. */
    size_t at = 0, bad = 0;
    for (size_t l = 0; l < L; l++)
        for (size_t kv = 0; kv < KV; kv++)
            for (size_t t = 0; t < T; t++)
                for (size_t h = 0; h < H; h++) {
                    size_t tensor = layout == KVMESH_LAYOUT_CROSS_LAYER ? 0 : l;
                    size_t r = row_of(layout, NB, L, T, H, page, l, kv, t, h);
                    if (memcmp(slot + at, tensors[tensor] + r * row, row) != 0) bad++;
                    at += row;
                }
    CHECK(bad == 0, "layout %u dtype %u: %zu rows differ from the C reference", layout, dtype, bad);
    CHECK(slot[block] == 0xEE, "nothing written past the block");
    /* Scatter into page 1 of zeroed tensors, then gather page 1: same bytes. */
    uint64_t p1 = 1;
    const void *cslots[1] = {slot};
    CHECK(kvmesh_kv_scatter(&s, KVMESH_DEVICE_HOST, (void *const *)back, count, &p1, cslots, 1, block) == KVMESH_OK,
          "scatter");
    unsigned char *again = malloc(block);
    void *aslots[1] = {again};
    CHECK(kvmesh_kv_gather(&s, KVMESH_DEVICE_HOST, (const void *const *)back, count, &p1, aslots, 1, block) == KVMESH_OK,
          "gather back");
    CHECK(memcmp(again, slot, block) == 0, "scatter then gather is the identity");
    /* Errors: page out of range, short slot, wrong tensor count, bad layout. */
    uint64_t far = NB;
    CHECK(kvmesh_kv_gather(&s, KVMESH_DEVICE_HOST, (const void *const *)tensors, count, &far, aslots, 1, block) ==
              KVMESH_E_INVALID,
          "page out of range refused");
    CHECK(kvmesh_kv_gather(&s, KVMESH_DEVICE_HOST, (const void *const *)tensors, count, &p1, aslots, 1, block - 1) ==
              KVMESH_E_INVALID,
          "short slot refused");
    if (count > 1)
        CHECK(kvmesh_kv_gather(&s, KVMESH_DEVICE_HOST, (const void *const *)tensors, count - 1, &p1, aslots, 1,
                               block) == KVMESH_E_INVALID,
              "tensor count refused");
    free(again);
    free(slot);
    for (size_t i = 0; i < count; i++) {
        free(tensors[i]);
        free(back[i]);
    }
    return 0;
}

/* kvsum64 written here from its definition in docs/GPU.md. */
static uint64_t fmix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static uint64_t c_kvsum64(const unsigned char *p, size_t len) {
    const uint64_t P1 = 0x9E3779B97F4A7C15ULL, P2 = 0xC2B2AE3D27D4EB4FULL;
    uint64_t seed = 0;
    memcpy(&seed, "kvsum64", 8); /* little-endian "kvsum64\0" (x86-64, aarch64) */
    uint64_t s = 0;
    for (size_t i = 0; i * 8 < len; i++) {
        uint64_t w = 0;
        for (size_t b = 0; b < 8 && i * 8 + b < len; b++) w |= (uint64_t)p[i * 8 + b] << (8 * b);
        s += fmix64(w ^ ((uint64_t)(i + 1) * P1));
    }
    return fmix64(s ^ (uint64_t)len * P2 ^ seed);
}

int main(void) {
    uint32_t layouts[] = {KVMESH_LAYOUT_NHD, KVMESH_LAYOUT_HND, KVMESH_LAYOUT_FLASHINFER, KVMESH_LAYOUT_MLA,
                          KVMESH_LAYOUT_CROSS_LAYER};
    uint32_t dtypes[] = {KVMESH_DTYPE_F16, KVMESH_DTYPE_BF16, KVMESH_DTYPE_FP8};
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 3; j++) run_layout(layouts[i], dtypes[j]);

    kvmesh_kv_shape_t bad = {9, 0, 1, 1, 1, 1, 1};
    CHECK(kvmesh_kv_sizes(&bad, NULL, NULL, NULL) == KVMESH_E_INVALID, "unknown layout refused");
    kvmesh_kv_shape_t zero = {0, 0, 1, 1, 0, 1, 1};
    CHECK(kvmesh_kv_sizes(&zero, NULL, NULL, NULL) == KVMESH_E_INVALID, "zero dimension refused");

    /* kvsum64 against the C definition, on lengths around word edges. */
    unsigned char buf[4096];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (unsigned char)(i * 7 + 3);
    uint64_t a = 0, b = 0;
    size_t lens[] = {0, 1, 7, 8, 9, 15, 16, 17, 1000, 4095, 4096};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        CHECK(kvmesh_kvsum64(KVMESH_DEVICE_HOST, buf, lens[i], &a) == KVMESH_OK, "kvsum64");
        CHECK(a == c_kvsum64(buf, lens[i]), "kvsum64 of %zu bytes differs from the C definition", lens[i]);
    }
    CHECK(kvmesh_kvsum64(KVMESH_DEVICE_HOST, buf, sizeof buf, &a) == KVMESH_OK, "kvsum64");
    buf[100] ^= 4;
    CHECK(kvmesh_kvsum64(KVMESH_DEVICE_HOST, buf, sizeof buf, &b) == KVMESH_OK && a != b, "a flip changes kvsum64");
    CHECK(kvmesh_kvsum64(KVMESH_DEVICE_HOST, NULL, 8, &a) == KVMESH_E_INVALID, "NULL refused");
    CHECK(kvmesh_kvsum64(-7, buf, 8, &a) == KVMESH_E_INVALID, "device -7 refused");

    /* Device memory: without a driver, KVMESH_E_NO_DEVICE and a reason. */
    int rc = kvmesh_kvsum64(0, buf, 8, &a);
    if (rc == KVMESH_E_NO_DEVICE) {
        printf("device 0: %s\n", kvmesh_last_error());
        CHECK(strstr(kvmesh_last_error(), "CUDA") != NULL, "the reason names CUDA");
    } else {
        printf("device 0: a CUDA driver answered (%s)\n", kvmesh_code_name(rc));
    }
    printf("%d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
