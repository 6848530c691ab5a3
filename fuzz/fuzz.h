/*
 * Shared by the libFuzzer targets (fuzz/fuzz-*.c) and the seed generator
 * (fuzz/seeds.c): the file container of the multi-file targets and the small
 * layers the runners run on.
 *
 * Container (fuzz-checkpoint, fuzz-config): a sequence of records
 *     u8 name_len | name_len bytes of name | u32 LE data_len | data
 * up to FUZZ_MAX_FILES records; a record cut short ends the list (so every
 * byte string is some container: the fuzzer never wastes an input).
 */
#ifndef MOE_FUZZ_H
#define MOE_FUZZ_H

#include "moeaudit.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_MAX_FILES 8

typedef struct fuzz_files {
    size_t n;
    moe_mem_file f[FUZZ_MAX_FILES];
    char names[FUZZ_MAX_FILES][256];
} fuzz_files;

/* Split data [size] into files (views into data; names copied and
 * NUL-terminated). */
static inline void fuzz_split(const uint8_t *data, size_t size, fuzz_files *out) {
    size_t at = 0;
    out->n = 0;
    while (out->n < FUZZ_MAX_FILES && at < size) {
        size_t nl = data[at++];
        if (at + nl + 4 > size) break;
        memcpy(out->names[out->n], data + at, nl);
        out->names[out->n][nl] = '\0';
        at += nl;
        uint32_t dl = (uint32_t)data[at] | (uint32_t)data[at + 1] << 8 | (uint32_t)data[at + 2] << 16 |
                      (uint32_t)data[at + 3] << 24;
        at += 4;
        if (dl > size - at) dl = (uint32_t)(size - at); /* cut short: keep what is there */
        out->f[out->n] = (moe_mem_file){out->names[out->n], data + at, dl};
        out->n++;
        at += dl;
    }
}

/* Append one record to buf [*len] (cap bytes); 0, or -1 when it does not fit. */
static inline int fuzz_pack(uint8_t *buf, size_t cap, size_t *len, const char *name, const void *data, size_t n) {
    size_t nl = strlen(name);
    if (nl > 255 || *len + 1 + nl + 4 + n > cap || n > UINT32_MAX) return -1;
    buf[(*len)++] = (uint8_t)nl;
    memcpy(buf + *len, name, nl);
    *len += nl;
    for (int i = 0; i < 4; i++) buf[(*len)++] = (uint8_t)(n >> (8 * i));
    memcpy(buf + *len, data, n);
    *len += n;
    return 0;
}

/* A deterministic value in about [-3.5, 3.5] (sum of four uniforms): seeds
 * and fixed inputs, never the library's own generator. */
static inline double fuzz_gauss(uint64_t *s) {
    double u = 0;
    for (int k = 0; k < 4; k++) {
        uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        u += (double)((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
    }
    return (u - 2.0) * 1.7320508075688772;
}

/* The rest of an input (data [size], the first byte a selector the caller
 * has read) as a safetensors file: copied into a heap buffer of exactly
 * size - 1 bytes (so ASan sees a read one byte past the file; an empty
 * file gets a 1-byte buffer and length 0) and parsed by moe_st_open_buffer
 * under `label`. Returns the open file with *buf to free after
 * moe_st_close, or NULL (nothing to free) when the bytes are not a file;
 * aborts when such a failure has no message (every failure explains
 * itself). */
static inline moe_st_file *fuzz_st_rest(const uint8_t *data, size_t size, const char *label, uint8_t **buf) {
    size_t n = size > 0 ? size - 1 : 0;
    *buf = malloc(n > 0 ? n : 1);
    if (!*buf) return NULL;
    if (n > 0) memcpy(*buf, data + 1, n);
    moe_st_file *f = NULL;
    moe_error err = {{0}};
    if (moe_st_open_buffer(*buf, n, label, &f, &err) != MOE_OK) {
        if (err.msg[0] == '\0') abort();
        free(*buf);
        *buf = NULL;
        return NULL;
    }
    return f;
}

/* The small synthetic layers the runner targets run inputs through: a V4
 * top-k layer (sqrtsoftplus, bias, shared expert, SwiGLU clamp), a V4 hash
 * layer (tid2eid over a vocabulary of 32) and a V3 grouped layer (sigmoid,
 * 4 groups, top-2 groups). H = 16 keeps an input small. */
#define FUZZ_H 16
static inline moe_synth_opts fuzz_synth(int which) {
    moe_synth_opts o = moe_synth_opts_default();
    o.hidden = FUZZ_H;
    o.inter = 8;
    o.n_experts = 8;
    o.top_k = 2;
    o.vocab = 32;
    o.seed = 12;
    if (which == 2) {
        o.arch = MOE_ARCH_V3;
        o.n_hash_layers = 0;
        o.n_group = 4;
        o.topk_group = 2;
        o.swiglu_limit = 0;
    }
    return o;
}

/* Layer `which` (0: V4 top-k, 1: V4 hash, 2: V3 grouped); aborts on failure
 * (a fuzzer that cannot set up must not report inputs as clean). */
static inline moe_layer *fuzz_layer(int which) {
    moe_synth_opts o = fuzz_synth(which);
    moe_layer *L = NULL;
    moe_error err;
    /* V4: layer 0 is hash-routed, layer 1 top-k */
    int layer = which == 0 ? 1 : 0;
    if (moe_synth_layer(&o, layer, &L, &err) != MOE_OK) abort();
    return L;
}

#endif
