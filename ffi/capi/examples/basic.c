/* kvmesh from C: store a block, read it back in place, copy it out.
 *
 *   cargo build --release -p kvmesh-capi
 *   cc -I ffi/capi/include ffi/capi/examples/basic.c -L target/release -lkvmesh \
 *      -Wl,-rpath,$PWD/target/release -o /tmp/kvmesh-basic
 *   /tmp/kvmesh-basic            # default socket; or: /tmp/kvmesh-basic SOCKET
 */
#include "kvmesh.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CALL(expr)                                                                  \
    do {                                                                            \
        int32_t rc_ = (expr);                                                       \
        if (rc_ < 0) {                                                              \
            fprintf(stderr, "%s: %s\n", kvmesh_code_name(rc_), kvmesh_last_error()); \
            return 1;                                                               \
        }                                                                           \
    } while (0)

int main(int argc, char **argv) {
    kvmesh_client_t *client = NULL;
    CALL(kvmesh_open(argc > 1 ? argv[1] : NULL, &client));

    const size_t block_bytes = 4096;
    kvmesh_namespace_t ns;
    CALL(kvmesh_register_namespace(client, "example/c", block_bytes, "demo-layout", &ns));

    /* Keys of a 64-token prompt in blocks of 16 tokens: 4 chained keys. */
    uint32_t tokens[64];
    for (uint32_t i = 0; i < 64; i++) tokens[i] = 1000 + i;
    kvmesh_key_t keys[4];
    size_t nkeys = 0;
    CALL(kvmesh_prefix_keys(tokens, 64, 16, keys, 4, &nkeys));

    uint8_t *blocks = malloc(nkeys * block_bytes);
    for (size_t i = 0; i < nkeys * block_bytes; i++) blocks[i] = (uint8_t)(i / block_bytes + 1);
    kvmesh_put_summary_t put;
    CALL(kvmesh_put(client, ns.id, keys, nkeys, blocks, nkeys * block_bytes, 0, &put));
    printf("put: %u stored, %u already cached\n", put.stored, put.existed);

    uint32_t prefix = 0;
    CALL(kvmesh_lookup(client, ns.id, keys, nkeys, &prefix, NULL));
    printf("cached prefix: %u of %zu blocks\n", prefix, nkeys);

    /* Read in place: the pointers are inside the daemon's pool. */
    kvmesh_batch_t *batch = NULL;
    CALL(kvmesh_pin(client, ns.id, keys, prefix, 0, KVMESH_PIN_STOP_AT_FIRST_MISS, &batch));
    for (size_t i = 0; i < kvmesh_batch_len(batch); i++) {
        const uint8_t *data;
        size_t len;
        if (kvmesh_batch_block(batch, i, &data, &len) == KVMESH_OK)
            printf("block %zu: %zu bytes, first byte %u, matches: %s\n", i, len, data[0],
                   memcmp(data, blocks + i * block_bytes, len) == 0 ? "yes" : "NO");
    }
    CALL(kvmesh_unpin(batch));

    free(blocks);
    kvmesh_close(client);
    return 0;
}
