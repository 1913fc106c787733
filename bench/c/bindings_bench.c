/* The C side of `kvmesh-bench bindings`: copy-get, pin + read (memcpy of
 * each pinned block out of the pool) and a one-key lookup through the C ABI.
 *   bindings_bench SOCKET NAMESPACE BLOCKS ITERS LOOKUPS
 * Keys: kvmesh_prefix_keys(0..BLOCKS*16, 16), as the Rust and Python sides.
 * Prints one JSON line of medians: {"copy_s":..,"pin_read_s":..,"lookup_us":..,"checksum":..} */
#include "kvmesh.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp);
    return v[n / 2];
}

#define CALL(expr)                                                                      \
    do {                                                                                \
        int32_t rc_ = (expr);                                                           \
        if (rc_ != KVMESH_OK) {                                                         \
            fprintf(stderr, "%s: %s: %s\n", #expr, kvmesh_code_name(rc_), kvmesh_last_error()); \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s SOCKET NAMESPACE BLOCKS ITERS LOOKUPS\n", argv[0]);
        return 2;
    }
    size_t blocks = (size_t)atol(argv[3]);
    int iters = atoi(argv[4]);
    int lookups = atoi(argv[5]);
    kvmesh_client_t *c = NULL;
    CALL(kvmesh_open(argv[1], &c));
    kvmesh_namespace_t ns;
    CALL(kvmesh_get_namespace(c, argv[2], &ns));
    size_t bs = (size_t)ns.block_bytes;
    uint32_t *tokens = malloc(blocks * 16 * sizeof *tokens);
    for (size_t i = 0; i < blocks * 16; i++) tokens[i] = (uint32_t)i;
    kvmesh_key_t *keys = malloc(blocks * sizeof *keys);
    size_t n = 0;
    CALL(kvmesh_prefix_keys(tokens, blocks * 16, 16, keys, blocks, &n));
    uint8_t *dst = malloc(blocks * bs);
    memset(dst, 0, blocks * bs);
    double *copy = malloc((size_t)iters * sizeof(double)), *pin = malloc((size_t)iters * sizeof(double)),
           *look = malloc((size_t)lookups * sizeof(double));
    uint64_t checksum = 0;
    for (int it = 0; it < iters; it++) {
        uint32_t hits = 0;
        double t0 = now();
        CALL(kvmesh_get_into(c, ns.id, keys, blocks, dst, blocks * bs, NULL, &hits));
        copy[it] = now() - t0;
        if (hits != blocks) {
            fprintf(stderr, "copy-get: %u of %zu hits\n", hits, blocks);
            return 1;
        }
        checksum += dst[(size_t)it % (blocks * bs)];
        t0 = now();
        kvmesh_batch_t *b = NULL;
        CALL(kvmesh_pin(c, ns.id, keys, blocks, 0, 0, &b));
        for (size_t i = 0; i < blocks; i++) {
            const uint8_t *p;
            size_t len;
            CALL(kvmesh_batch_block(b, i, &p, &len));
            memcpy(dst + i * bs, p, len);
        }
        CALL(kvmesh_unpin(b));
        pin[it] = now() - t0;
        checksum += dst[(size_t)(it * 7) % (blocks * bs)];
    }
    for (int it = 0; it < lookups; it++) {
        uint32_t prefix = 0;
        double t0 = now();
        CALL(kvmesh_lookup(c, ns.id, keys, 1, &prefix, NULL));
        look[it] = (now() - t0) * 1e6;
    }
    printf("{\"copy_s\":%.9f,\"pin_read_s\":%.9f,\"lookup_us\":%.3f,\"checksum\":%llu}\n", median(copy, iters),
           median(pin, iters), median(look, lookups), (unsigned long long)checksum);
    kvmesh_close(c);
    return 0;
}
