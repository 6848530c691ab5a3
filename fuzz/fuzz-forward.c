/*
 * libFuzzer target: the whole model's input files, `forward --input` and
 * `forward --replay-index` (moe_fwd_input_read, moe_fwd_replay_init and
 * moe_fwd_replay_pick, the readers the CLI calls), against the config of the
 * bundled V4 fixture (tests/data/dsv4-tiny: 4 layers, layer 3 CSA at ratio
 * 4 with index_topk 8, no MTP block, vocabulary 300, hc_mult 4, hidden 96;
 * opened once, never run). The first byte picks the first layer (bits 0-1:
 * 0..3; a first layer above 0 reads its streams tensor), whether the same
 * file is also the replay (bit 2, as test-model replays the oracle's own
 * output) and the chunk size the picks are asked in (bits 3-5: 1..8 rows);
 * the rest is the safetensors file, parsed in memory.
 *
 * Properties: a failure has a message and leaves its output zeroed; read
 * ids lie in the vocabulary, streams are present only when asked for and
 * equal the stored values; a replay that opened hands every layer picks the
 * attention accepts (each -1 or an entry visible to its row, none twice:
 * replace_picks in src/attn/attention.c), layers without a tensor keep the
 * indexer's own, and a K other than the run's is an error.
 */
#include "fuzz.h"
#include "moeaudit_model.h"

#include <stdio.h>

#ifndef MOE_TEST_DATA
#error "MOE_TEST_DATA must name tests/data"
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static moe_fwd *fw; /* read only after this: its config is what the inputs are checked against */

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    moe_error err;
    if (moe_fwd_open(MOE_TEST_DATA "/dsv4-tiny", &fw, &err) != MOE_OK) {
        fprintf(stderr, "fuzz-forward: %s\n", err.msg);
        abort();
    }
    return 0;
}

static bool zeroed(const void *p, size_t n) {
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i]) return false;
    return true;
}

/* The replay of f over T tokens: what it hands each layer. */
static void replay(const moe_fwd_config *c, const moe_st_file *f, int64_t T, int chunk) {
    moe_fwd_replay r;
    memset(&r, 0xA5, sizeof r);
    moe_error err = {{0}};
    moe_status st = moe_fwd_replay_init(f, c, T, &r, &err);
    if (st != MOE_OK) {
        if (!err.msg[0] || !zeroed(&r, sizeof r)) abort();
        return;
    }
    if (T > 4096) return; /* bounded work per input (the file is at most max_len bytes) */
    enum { K_MAX = 16 };
    int32_t sel[8 * K_MAX];
    for (int l = 0; l < c->n_layers + c->n_mtp; l++) {
        char name[64];
        snprintf(name, sizeof name, "layers.%d.index_topk", l);
        const moe_st_tensor *t = moe_st_find(f, name);
        int K = c->index_topk;
        /* the run's K, and the tensor's when they differ (a patch may change K) */
        for (int pass = 0; pass < (t && t->shape[1] != K && t->shape[1] <= K_MAX ? 2 : 1); pass++) {
            int k_run = pass ? (int)t->shape[1] : K;
            if (k_run > K_MAX) break;
            for (int64_t row0 = 0; row0 < T; row0 += chunk) {
                int64_t rows = T - row0 < chunk ? T - row0 : chunk;
                for (int i = 0; i < rows * k_run; i++) sel[i] = -7; /* "the indexer's own" */
                err.msg[0] = '\0';
                st = moe_fwd_replay_pick(&r, l, row0, rows, k_run, sel, &err);
                if (st != MOE_OK) {
                    /* only a K other than the tensor's fails */
                    if (st != MOE_ERR_SHAPE || !err.msg[0] || !t || t->shape[1] == k_run) abort();
                    break;
                }
                for (int64_t p = row0; p < row0 + rows; p++) {
                    const int32_t *s = sel + (p - row0) * k_run;
                    for (int k = 0; k < k_run; k++) {
                        if (!t) {
                            if (s[k] != -7) abort(); /* no tensor: untouched */
                            continue;
                        }
                        if (c->attn[l] != MOE_ATTN_CSA) abort(); /* init refuses picks for other layers */
                        int64_t vis = (p + 1) / c->ratio[l];
                        if (s[k] < -1 || s[k] >= vis) abort();
                        for (int k2 = 0; k2 < k && s[k] >= 0; k2++)
                            if (s[k2] == s[k]) abort();
                    }
                }
            }
        }
    }
    /* rows past T are an error, not a read past the tensor */
    st = moe_fwd_replay_pick(&r, 3, T, 1, c->index_topk, sel, &err);
    if (st == MOE_OK && moe_st_find(f, "layers.3.index_topk")) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const moe_fwd_config *c = moe_fwd_get_config(fw);
    const uint8_t sel = data[0];
    const int first = sel & 3, chunk = 1 + ((sel >> 3) & 7);
    const bool do_replay = (sel >> 2) & 1;
    uint8_t *buf;
    moe_st_file *f = fuzz_st_rest(data, size, "fuzz-forward", &buf);
    if (!f) return 0;
    moe_error err = {{0}};
    moe_fwd_input in;
    memset(&in, 0xA5, sizeof in);
    moe_status st = moe_fwd_input_read(f, c, first, &in, &err);
    if (st != MOE_OK) {
        if (!err.msg[0] || !zeroed(&in, sizeof in)) abort();
    } else {
        if (in.T < 1 || !in.ids) abort();
        for (int64_t i = 0; i < in.T; i++)
            if (in.ids[i] < 0 || in.ids[i] >= c->vocab) abort();
        char name[64];
        snprintf(name, sizeof name, "layers.%d.in", first);
        const moe_st_tensor *s = first > 0 ? moe_st_find(f, name) : NULL;
        if ((s != NULL) != (in.streams != NULL)) abort();
        for (size_t i = 0; s && i < (size_t)in.T * (size_t)c->hc_mult * (size_t)c->hidden; i++) {
            double v = moe_load_f64(s->data, s->dtype, i);
            if (memcmp(&v, &in.streams[i], sizeof v) != 0) abort(); /* as stored, NaN payloads too */
        }
        if (do_replay) replay(c, f, in.T, chunk);
        moe_fwd_input_free(&in);
        if (in.ids || in.streams || in.T) abort();
    }
    moe_st_close(f);
    free(buf);
    return 0;
}
