/* Tests of the kvmesh C ABI against a real daemon: capi_test SOCKET.
 * Compiled with the system cc and run by ffi/capi/tests/c_api.rs (also
 * once under AddressSanitizer). Exit status 0 only if every check passed. */
#include "kvmesh.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int failures = 0;
static int checks = 0;

#define CHECK(cond, ...)                                                            \
    do {                                                                            \
        checks++;                                                                   \
        if (!(cond)) {                                                              \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                    \
            fprintf(stderr, __VA_ARGS__);                                           \
            fprintf(stderr, " (kvmesh_last_error: %s)\n", kvmesh_last_error());     \
            failures++;                                                             \
        }                                                                           \
    } while (0)

#define EXPECT(expr, code)                                                          \
    do {                                                                            \
        int32_t rc_ = (expr);                                                       \
        CHECK(rc_ == (code), "%s returned %s, expected %s", #expr,                  \
              kvmesh_code_name(rc_), kvmesh_code_name(code));                       \
    } while (0)

#define BS 65536u
#define N 8u
#define BLOCK_TOKENS 16u

static void fill(uint8_t *p, size_t n, uint64_t seed) {
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = (uint8_t)x;
    }
}

static int has(const char *haystack, const char *needle) { return strstr(haystack, needle) != NULL; }

struct thread_arg {
    kvmesh_client_t *client;
    uint32_t ns;
    const kvmesh_key_t *keys;
    const uint8_t *expect;
    int errors;
};

/* A reader blocked for ever in kvmesh_events_next, stopped by another
 * thread's kvmesh_events_cancel. */
struct reader_arg {
    kvmesh_events_t *w;
    int32_t rc;
    double waited_s;
};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void *events_reader(void *p) {
    struct reader_arg *a = p;
    kvmesh_event_t ev[4];
    size_t n = 0;
    double t0 = now_s();
    a->rc = kvmesh_events_next(a->w, 0, ev, 4, &n, NULL);
    a->waited_s = now_s() - t0;
    return NULL;
}

/* Many threads share one client: pins, reads in place, copies. */
static void *worker(void *p) {
    struct thread_arg *a = p;
    uint8_t *buf = malloc(BS);
    for (int round = 0; round < 50; round++) {
        uint32_t i = (uint32_t)round % N;
        uint32_t hits = 0;
        if (kvmesh_get_into(a->client, a->ns, &a->keys[i], 1, buf, BS, NULL, &hits) != KVMESH_OK || hits != 1 ||
            memcmp(buf, a->expect + (size_t)i * BS, BS) != 0) {
            a->errors++;
        }
        kvmesh_batch_t *b = NULL;
        const uint8_t *data = NULL;
        size_t len = 0;
        if (kvmesh_pin(a->client, a->ns, a->keys, N, 0, 0, &b) != KVMESH_OK ||
            kvmesh_batch_block(b, i, &data, &len) != KVMESH_OK || len != BS ||
            memcmp(data, a->expect + (size_t)i * BS, BS) != 0) {
            a->errors++;
        }
        kvmesh_unpin(b);
    }
    free(buf);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    const char *sock = argv[1];
    CHECK(kvmesh_abi_version() == KVMESH_ABI_VERSION, "ABI %u, header %u", kvmesh_abi_version(), KVMESH_ABI_VERSION);
    CHECK(strlen(kvmesh_version()) > 0, "empty version");

    /* Connecting. */
    kvmesh_client_t *c = NULL;
    EXPECT(kvmesh_open("/nonexistent/kvmesh.sock", &c), KVMESH_E_TRANSPORT);
    CHECK(has(kvmesh_last_error(), "/nonexistent/kvmesh.sock"), "message names the path: %s", kvmesh_last_error());
    CHECK(c == NULL, "no handle on failure");
    EXPECT(kvmesh_open(sock, NULL), KVMESH_E_INVALID);
    EXPECT(kvmesh_open(sock, &c), KVMESH_OK);
    if (c == NULL) {
        fprintf(stderr, "cannot continue without a client\n");
        return 1;
    }

    /* Namespaces. */
    kvmesh_namespace_t ns;
    EXPECT(kvmesh_register_namespace(c, "capi-test", BS, "layout=capi", &ns), KVMESH_OK);
    CHECK(ns.block_bytes == BS, "block_bytes %llu", (unsigned long long)ns.block_bytes);
    kvmesh_namespace_t again;
    EXPECT(kvmesh_get_namespace(c, "capi-test", &again), KVMESH_OK);
    CHECK(again.id == ns.id && again.fingerprint == ns.fingerprint, "get_namespace finds the same namespace");
    EXPECT(kvmesh_register_namespace(c, "capi-test", BS * 2, "layout=capi", &again), KVMESH_E_INVALID);
    CHECK(has(kvmesh_last_error(), "block size"), "message says why: %s", kvmesh_last_error());
    EXPECT(kvmesh_get_namespace(c, "no-such-namespace", &again), KVMESH_E_NOT_FOUND);
    EXPECT(kvmesh_register_namespace(c, "", BS, "x", &again), KVMESH_E_INVALID);
    EXPECT(kvmesh_register_namespace(c, NULL, BS, "x", &again), KVMESH_E_INVALID);
    EXPECT(kvmesh_register_namespace(NULL, "x", BS, "x", &again), KVMESH_E_INVALID);
    EXPECT(kvmesh_register_namespace(c, "x", BS, "x", NULL), KVMESH_E_INVALID);

    /* KV events: a watcher sees the puts in order, split across calls. */
    {
        kvmesh_namespace_t ens;
        EXPECT(kvmesh_register_namespace(c, "capi-events", BS, "layout=capi", &ens), KVMESH_OK);
        kvmesh_events_t *w = NULL;
        EXPECT(kvmesh_watch_events(c, ens.id, 0, &w), KVMESH_OK);
        kvmesh_key_t ek[3] = {{0, 11}, {0, 12}, {0, 13}};
        uint8_t *edata = calloc(3, BS);
        kvmesh_put_summary_t es;
        EXPECT(kvmesh_put(c, ens.id, ek, 3, edata, 3 * (size_t)BS, 0, &es), KVMESH_OK);
        free(edata);
        kvmesh_event_t ev[2];
        size_t en = 0;
        uint32_t node = 0;
        EXPECT(kvmesh_events_next(w, 10000, ev, 2, &en, &node), KVMESH_OK);
        size_t total = en;
        CHECK(en >= 1 && ev[0].kind == KVMESH_EVENT_STORED && ev[0].seq == 1 && ev[0].key.lo == 11,
              "first event: n %zu kind %u seq %llu", en, ev[0].kind, (unsigned long long)ev[0].seq);
        CHECK(node == 1, "node id %u", node);
        while (total < 3) {
            kvmesh_event_t one;
            EXPECT(kvmesh_events_next(w, 10000, &one, 1, &en, NULL), KVMESH_OK);
            CHECK(en == 1 && one.kind == KVMESH_EVENT_STORED && one.seq == total + 1, "event %zu in order", total + 1);
            if (en != 1) break;
            total += en;
        }
        EXPECT(kvmesh_events_next(w, 100, ev, 2, &en, NULL), KVMESH_OK);
        CHECK(en == 0, "nothing more within 100 ms: %zu", en);
        EXPECT(kvmesh_events_next(w, 100, ev, 0, &en, NULL), KVMESH_E_INVALID);
        EXPECT(kvmesh_watch_events(c, 9999, 0, &w), KVMESH_E_NOT_FOUND);

        /* A reader waiting without a timeout is stopped by a cancel from
         * this thread; every later call says cancelled too. */
        struct reader_arg ra = {w, 12345, 0};
        pthread_t reader;
        pthread_create(&reader, NULL, events_reader, &ra);
        struct timespec pause = {0, 300 * 1000 * 1000};
        nanosleep(&pause, NULL);
        double t_cancel = now_s();
        kvmesh_events_cancel(w);
        pthread_join(reader, NULL);
        double after_cancel = now_s() - t_cancel;
        EXPECT(ra.rc, KVMESH_E_CANCELLED);
        CHECK(ra.waited_s >= 0.25, "the reader waited until the cancel: %.3f s", ra.waited_s);
        CHECK(after_cancel < 5.0, "the reader returned %.3f s after the cancel", after_cancel);
        EXPECT(kvmesh_events_next(w, 100, ev, 2, &en, NULL), KVMESH_E_CANCELLED);
        kvmesh_events_cancel(w); /* idempotent */
        kvmesh_events_cancel(NULL);
        kvmesh_events_close(w);
        kvmesh_events_close(NULL);

        /* Cancelled before the first call: that call does not wait. */
        kvmesh_events_t *w2 = NULL;
        EXPECT(kvmesh_watch_events(c, ens.id, 0, &w2), KVMESH_OK);
        kvmesh_events_cancel(w2);
        double t1 = now_s();
        EXPECT(kvmesh_events_next(w2, 0, ev, 2, &en, NULL), KVMESH_E_CANCELLED);
        CHECK(now_s() - t1 < 5.0, "a cancelled stream's next returned at once");
        kvmesh_events_close(w2);
    }

    /* Keys derived from token ids, the documented rule. */
    uint32_t tokens[N * BLOCK_TOKENS + 5];
    for (size_t i = 0; i < sizeof tokens / sizeof tokens[0]; i++) tokens[i] = (uint32_t)(i * 7919u + 11u);
    kvmesh_key_t keys[N + 1];
    size_t nkeys = 0;
    EXPECT(kvmesh_prefix_keys(tokens, sizeof tokens / sizeof tokens[0], BLOCK_TOKENS, keys, N, &nkeys), KVMESH_OK);
    CHECK(nkeys == N, "%zu keys of full blocks", nkeys);
    EXPECT(kvmesh_prefix_keys(tokens, sizeof tokens / sizeof tokens[0], BLOCK_TOKENS, keys, N - 1, &nkeys),
           KVMESH_E_INVALID);
    EXPECT(kvmesh_prefix_keys(tokens, 10, 0, keys, N, &nkeys), KVMESH_E_INVALID);
    kvmesh_key_t k0, k1, chained;
    uint32_t t0[4] = {1, 2, 3, 4}, t1[4] = {5, 6, 7, 8};
    EXPECT(kvmesh_key_chain(NULL, t0, 4, &k0), KVMESH_OK);
    EXPECT(kvmesh_key_chain(&k0, t1, 4, &k1), KVMESH_OK);
    EXPECT(kvmesh_key_parse("7e8cd2980a866481ae4126a9ed4d27a5", &chained), KVMESH_OK);
    CHECK(k1.hi == chained.hi && k1.lo == chained.lo, "chained key matches the pinned value of the Rust tests");
    CHECK(k0.hi == 0x03874a2e9a827a52ull && k0.lo == 0x10e073f5d377b7b9ull, "first key matches");
    EXPECT(kvmesh_key_parse("not-hex", &chained), KVMESH_E_INVALID);
    EXPECT(kvmesh_key_parse(NULL, &chained), KVMESH_E_INVALID);
    EXPECT(kvmesh_key_chain(NULL, NULL, 4, &k0), KVMESH_E_INVALID);

    /* Round trip. */
    uint8_t *data = malloc((size_t)N * BS);
    fill(data, (size_t)N * BS, 1);
    kvmesh_put_summary_t sum;
    EXPECT(kvmesh_put(c, ns.id, keys, N, data, (size_t)N * BS, 0, &sum), KVMESH_OK);
    CHECK(sum.stored == N, "stored %u", sum.stored);
    EXPECT(kvmesh_put(c, ns.id, keys, N, data, (size_t)N * BS, 0, &sum), KVMESH_OK);
    CHECK(sum.stored == 0 && sum.existed == N, "second put: stored %u existed %u", sum.stored, sum.existed);
    EXPECT(kvmesh_put(c, ns.id, keys, N, data, (size_t)N * BS - 1, 0, &sum), KVMESH_E_INVALID);
    CHECK(has(kvmesh_last_error(), "data_len"), "message: %s", kvmesh_last_error());
    EXPECT(kvmesh_put(c, ns.id, keys, N, NULL, (size_t)N * BS, 0, &sum), KVMESH_E_INVALID);
    EXPECT(kvmesh_put(c, ns.id, keys, N, data, (size_t)N * BS, 0x80, &sum), KVMESH_E_INVALID);

    uint32_t prefix = 99;
    uint8_t present[N + 1];
    EXPECT(kvmesh_lookup(c, ns.id, keys, N, &prefix, present), KVMESH_OK);
    CHECK(prefix == N, "prefix %u", prefix);
    kvmesh_key_t holes[N];
    memcpy(holes, keys, sizeof holes);
    holes[3].lo ^= 1; /* not cached */
    EXPECT(kvmesh_lookup(c, ns.id, holes, N, &prefix, present), KVMESH_OK);
    CHECK(prefix == 3 && present[3] == 0 && present[4] == 1, "prefix %u present[3]=%u", prefix, present[3]);
    /* Where: a single daemon answers from its own copies (node id 1). */
    uint32_t nodes[N], info = 99;
    EXPECT(kvmesh_lookup_where(c, ns.id, holes, N, 0, &prefix, nodes, &info), KVMESH_OK);
    CHECK(prefix == 3 && nodes[0] == 1 && nodes[3] == KVMESH_NODE_NONE && nodes[4] == 1 &&
              info == KVMESH_LOOKUP_COMPLETE,
          "prefix %u nodes %u %u %u info %u", prefix, nodes[0], nodes[3], nodes[4], info);
    EXPECT(kvmesh_lookup_where(c, ns.id, holes, N, KVMESH_LOOKUP_LOCAL_ONLY, &prefix, NULL, NULL), KVMESH_OK);
    CHECK(prefix == 3, "prefix %u", prefix);
    EXPECT(kvmesh_lookup_where(c, ns.id, holes, N, 0x10, &prefix, nodes, &info), KVMESH_E_INVALID);
    CHECK(has(kvmesh_last_error(), "flags"), "message: %s", kvmesh_last_error());
    EXPECT(kvmesh_lookup_where(c, ns.id, holes, N, 0, NULL, nodes, &info), KVMESH_E_INVALID);
    EXPECT(kvmesh_lookup(c, ns.id, keys, N, NULL, present), KVMESH_E_INVALID);
    EXPECT(kvmesh_lookup(c, ns.id, NULL, N, &prefix, present), KVMESH_E_INVALID);
    EXPECT(kvmesh_lookup(c, 4242, keys, N, &prefix, present), KVMESH_E_NOT_FOUND);
    CHECK(has(kvmesh_last_error(), "4242"), "message names the namespace id: %s", kvmesh_last_error());

    /* Zero-copy reads: pointers into the pool, the same slot for two pins. */
    kvmesh_batch_t *b1 = NULL, *b2 = NULL;
    EXPECT(kvmesh_pin(c, ns.id, keys, N, 0, 0, &b1), KVMESH_OK);
    EXPECT(kvmesh_pin(c, ns.id, keys, N, 5000, 0, &b2), KVMESH_OK);
    CHECK(kvmesh_batch_len(b1) == N && kvmesh_batch_hits(b1) == N, "len %zu hits %zu", kvmesh_batch_len(b1),
          kvmesh_batch_hits(b1));
    CHECK(kvmesh_batch_lease_remaining_ms(b1) > 1000, "lease %llu ms",
          (unsigned long long)kvmesh_batch_lease_remaining_ms(b1));
    for (uint32_t i = 0; i < N; i++) {
        const uint8_t *p1 = NULL, *p2 = NULL;
        size_t l1 = 0, l2 = 0;
        EXPECT(kvmesh_batch_block(b1, i, &p1, &l1), KVMESH_OK);
        EXPECT(kvmesh_batch_block(b2, i, &p2, &l2), KVMESH_OK);
        CHECK(l1 == BS && p1 != NULL && memcmp(p1, data + (size_t)i * BS, BS) == 0, "block %u content", i);
        CHECK(p1 == p2, "block %u: both pins point at the same slot (in place, no copy)", i);
        CHECK(p1 < data || p1 >= data + (size_t)N * BS, "block %u points into the pool, not our buffer", i);
        EXPECT(kvmesh_batch_verify(b1, i), KVMESH_OK);
    }
    const uint8_t *p = NULL;
    size_t len = 0;
    EXPECT(kvmesh_batch_block(b1, N, &p, &len), KVMESH_E_INVALID);
    EXPECT(kvmesh_batch_block(b1, 0, NULL, &len), KVMESH_E_INVALID);
    EXPECT(kvmesh_batch_block(NULL, 0, &p, &len), KVMESH_E_INVALID);
    EXPECT(kvmesh_unpin(b1), KVMESH_OK);
    EXPECT(kvmesh_unpin(b2), KVMESH_OK);
    EXPECT(kvmesh_unpin(NULL), KVMESH_OK);

    /* Misses. */
    kvmesh_batch_t *bm = NULL;
    EXPECT(kvmesh_pin(c, ns.id, holes, N, 0, 0, &bm), KVMESH_OK);
    CHECK(kvmesh_batch_len(bm) == N && kvmesh_batch_hits(bm) == N - 1, "hits %zu", kvmesh_batch_hits(bm));
    EXPECT(kvmesh_batch_block(bm, 3, &p, &len), KVMESH_E_NOT_FOUND);
    EXPECT(kvmesh_batch_block(bm, 4, &p, &len), KVMESH_OK);
    EXPECT(kvmesh_unpin(bm), KVMESH_OK);
    EXPECT(kvmesh_pin(c, ns.id, holes, N, 0, KVMESH_PIN_STOP_AT_FIRST_MISS, &bm), KVMESH_OK);
    CHECK(kvmesh_batch_hits(bm) == 3, "a prefix fetch stops at the miss: %zu hits", kvmesh_batch_hits(bm));
    EXPECT(kvmesh_batch_block(bm, 5, &p, &len), KVMESH_E_NOT_FOUND);
    EXPECT(kvmesh_unpin(bm), KVMESH_OK);
    EXPECT(kvmesh_pin(c, ns.id, keys, N, 0, 0x40, &bm), KVMESH_E_INVALID);
    EXPECT(kvmesh_pin(c, ns.id, keys, N, 0, 0, NULL), KVMESH_E_INVALID);

    /* Copies into a caller buffer. */
    uint8_t *buf = malloc((size_t)N * BS);
    memset(buf, 0xAB, (size_t)N * BS);
    uint8_t hits[N];
    uint32_t nhits = 0;
    EXPECT(kvmesh_get_into(c, ns.id, holes, N, buf, (size_t)N * BS, hits, &nhits), KVMESH_OK);
    CHECK(nhits == N - 1 && hits[3] == 0 && hits[2] == 1, "hits %u", nhits);
    CHECK(memcmp(buf, data, 3 * (size_t)BS) == 0, "hit bytes copied");
    CHECK(buf[3 * (size_t)BS] == 0xAB && buf[4 * (size_t)BS - 1] == 0xAB, "bytes of a miss untouched");
    EXPECT(kvmesh_get_into(c, ns.id, keys, N, buf, (size_t)N * BS - 1, NULL, NULL), KVMESH_E_INVALID);
    EXPECT(kvmesh_get_into(c, ns.id, keys, N, NULL, (size_t)N * BS, NULL, NULL), KVMESH_E_INVALID);

    /* In-place puts: allocate, write through the pointer, commit. */
    kvmesh_key_t fresh[3] = {{1, 1}, {1, 2}, keys[0]};
    kvmesh_alloc_t *a = NULL;
    EXPECT(kvmesh_allocate(c, ns.id, fresh, 3, 0, &a), KVMESH_OK);
    CHECK(kvmesh_alloc_len(a) == 3, "alloc len");
    for (uint32_t i = 0; i < 2; i++) {
        uint8_t *w = NULL;
        size_t wl = 0;
        EXPECT(kvmesh_alloc_block(a, i, &w, &wl), KVMESH_OK);
        CHECK(wl == BS, "writable length %zu", wl);
        if (w) fill(w, wl, 100 + i);
    }
    uint8_t *w = NULL;
    size_t wl = 0;
    EXPECT(kvmesh_alloc_block(a, 2, &w, &wl), KVMESH_EXISTS);
    EXPECT(kvmesh_alloc_block(a, 3, &w, &wl), KVMESH_E_INVALID);
    int32_t outcomes[3] = {-99, -99, -99};
    uint32_t stored = 0;
    EXPECT(kvmesh_commit(a, outcomes, &stored), KVMESH_OK);
    CHECK(stored == 2 && outcomes[0] == KVMESH_OK && outcomes[1] == KVMESH_OK && outcomes[2] == KVMESH_EXISTS,
          "commit: stored %u outcomes %d %d %d", stored, outcomes[0], outcomes[1], outcomes[2]);
    uint8_t expect[BS];
    fill(expect, BS, 101);
    EXPECT(kvmesh_get_into(c, ns.id, &fresh[1], 1, buf, BS, NULL, &nhits), KVMESH_OK);
    CHECK(nhits == 1 && memcmp(buf, expect, BS) == 0, "committed block reads back");
    /* Aborted: nothing stored. */
    kvmesh_key_t aborted = {2, 2};
    EXPECT(kvmesh_allocate(c, ns.id, &aborted, 1, 0, &a), KVMESH_OK);
    EXPECT(kvmesh_abort(a), KVMESH_OK);
    EXPECT(kvmesh_lookup(c, ns.id, &aborted, 1, &prefix, NULL), KVMESH_OK);
    CHECK(prefix == 0, "aborted put is not visible");
    /* Overwrite a cached key. */
    EXPECT(kvmesh_allocate(c, ns.id, &fresh[0], 1, KVMESH_OVERWRITE, &a), KVMESH_OK);
    EXPECT(kvmesh_alloc_block(a, 0, &w, &wl), KVMESH_OK);
    fill(w, wl, 555);
    EXPECT(kvmesh_commit(a, NULL, &stored), KVMESH_OK);
    fill(expect, BS, 555);
    EXPECT(kvmesh_get_into(c, ns.id, &fresh[0], 1, buf, BS, NULL, &nhits), KVMESH_OK);
    CHECK(nhits == 1 && memcmp(buf, expect, BS) == 0, "overwritten block reads the new version");
    EXPECT(kvmesh_allocate(c, ns.id, fresh, 3, 0x8, &a), KVMESH_E_INVALID);
    EXPECT(kvmesh_commit(NULL, NULL, NULL), KVMESH_E_INVALID);
    EXPECT(kvmesh_abort(NULL), KVMESH_OK);

    /* Threads sharing one client. */
    enum { THREADS = 4 };
    pthread_t th[THREADS];
    struct thread_arg args[THREADS];
    for (int i = 0; i < THREADS; i++) {
        args[i] = (struct thread_arg){c, ns.id, keys, data, 0};
        pthread_create(&th[i], NULL, worker, &args[i]);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(th[i], NULL);
        CHECK(args[i].errors == 0, "thread %d: %d errors", i, args[i].errors);
    }

    /* Stats as JSON. */
    size_t needed = 0;
    EXPECT(kvmesh_stats_json(c, NULL, 0, &needed), KVMESH_E_INVALID);
    CHECK(needed > 10, "needed %zu", needed);
    char *json = malloc(needed + 256);
    EXPECT(kvmesh_stats_json(c, json, needed + 256, &needed), KVMESH_OK);
    CHECK(has(json, "\"pins_outstanding\":0") && has(json, "\"commits\""), "stats: %.200s", json);
    free(json);

    /* Remove and invalidate. */
    uint32_t count = 0;
    uint8_t removed[2];
    EXPECT(kvmesh_remove(c, ns.id, &keys[N - 2], 2, removed, &count), KVMESH_OK);
    CHECK(count == 2 && removed[0] == 1, "removed %u", count);
    EXPECT(kvmesh_remove(c, ns.id, &keys[N - 2], 2, removed, &count), KVMESH_OK);
    CHECK(count == 0, "removed twice: %u", count);
    kvmesh_invalidate_summary_t inv;
    EXPECT(kvmesh_invalidate(c, ns.id, keys, 2, &inv), KVMESH_OK);
    CHECK(inv.invalidated == 2 && inv.failed == 0, "invalidated %llu", (unsigned long long)inv.invalidated);
    EXPECT(kvmesh_lookup(c, ns.id, keys, 2, &prefix, NULL), KVMESH_OK);
    CHECK(prefix == 0, "invalidated keys are gone");
    EXPECT(kvmesh_invalidate_namespace(c, ns.id, &inv), KVMESH_OK);
    EXPECT(kvmesh_lookup(c, ns.id, &keys[2], 1, &prefix, NULL), KVMESH_OK);
    CHECK(prefix == 0, "invalidated namespace is empty");

    /* A batch outlives its client. */
    EXPECT(kvmesh_put(c, ns.id, keys, 1, data, BS, 0, &sum), KVMESH_OK);
    EXPECT(kvmesh_pin(c, ns.id, keys, 1, 0, 0, &b1), KVMESH_OK);
    kvmesh_close(c);
    EXPECT(kvmesh_batch_block(b1, 0, &p, &len), KVMESH_OK);
    CHECK(len == BS && memcmp(p, data, BS) == 0, "batch readable after kvmesh_close");
    EXPECT(kvmesh_unpin(b1), KVMESH_OK);
    kvmesh_close(NULL);

    free(buf);
    free(data);
    printf("capi tests: %d checks, %d failures\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
