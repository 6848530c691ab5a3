/*
 * libFuzzer target: a whole checkpoint, as moeaudit loads and runs it. The
 * input is a container of files (fuzz/fuzz.h: config.json, shards, the
 * index) held in memory (moe_model_open_mem: the loader's own code, no disk).
 * Every layer the config declares (up to 8) is loaded; a layer that loads is
 * run on 3 tokens through the float64 reference and the f32 path and its
 * contract checked, its hyper-connection and indexer weights are loaded, and
 * a slice of its experts (the MPI loader's path) too.
 *
 * Properties beyond "no crash, no sanitizer report":
 *  - a failure has a message; a loaded layer's shapes agree with its config;
 *  - the reference run on finite input either fails with a status or passes
 *    its own contract check (the weights are hostile, the check is not).
 * Seeds (fuzz/corpus-checkpoint) are tiny real checkpoints in every layout
 * and format: V4 (hash + top-k, shared), V3 grouped, FP8, MXFP4, NVFP4,
 * sharded with an index (fuzz/seeds.c).
 */
#include "fuzz.h"
#include "moeaudit_indexer.h"

#include <math.h>
#include <stdio.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void need_msg(moe_status st, const moe_error *err) {
    if (st != MOE_OK && err->msg[0] == '\0') abort(); /* every failure explains itself */
}

static void run_layer(const moe_layer *L) {
    const moe_block_config *c = &L->cfg;
    if (c->hidden < 1 || c->n_experts < 1 || c->top_k < 1 || c->top_k > c->n_experts) abort();
    if (L->gate.rows != c->n_experts || L->gate.cols != c->hidden) abort();
    for (int e = 0; e < c->n_experts; e++)
        if (L->w1[e].rows != c->inter || L->w1[e].cols != c->hidden || L->w2[e].rows != c->hidden ||
            L->w2[e].cols != c->inter)
            abort();
    /* bounded work per input: the shapes come from the input's own bytes */
    if ((int64_t)c->hidden * (c->inter + c->n_experts) > (1 << 20)) return;
    enum { T = 3 };
    double *x = malloc((size_t)T * (size_t)c->hidden * sizeof *x);
    int64_t ids[T] = {0, 1, 2};
    if (!x) return;
    for (int64_t i = 0; i < (int64_t)T * c->hidden; i++) x[i] = sin(0.37 * (double)i) * 2.0;
    if (c->kind == MOE_LAYER_HASH)
        for (int t = 0; t < T; t++) ids[t] = c->vocab > 0 ? t % c->vocab : 0;
    for (int p = 0; p < 2; p++) {
        moe_run_opts o = moe_run_opts_default();
        o.precision = p ? MOE_PREC_F32 : MOE_PREC_REF;
        o.fuse_shared = p == 1;
        o.owner = p ? MOE_SCALE_RUNNER : MOE_SCALE_ROUTER;
        moe_error err = {{0}};
        moe_block_out out;
        moe_status st = moe_block_out_init(&out, L, T, &o, &err);
        need_msg(st, &err);
        if (st != MOE_OK) continue;
        st = moe_block_run(L, x, ids, T, &o, &out, &err);
        need_msg(st, &err);
        if (st == MOE_OK) {
            for (int64_t i = 0; i < (int64_t)T * out.n_cols; i++)
                if (out.topk_ids[i] < 0 || out.topk_ids[i] > c->n_experts) abort();
            st = moe_block_check(L, &out, &o, &err);
            need_msg(st, &err);
            (void)moe_block_vanishing(L, &out, NULL);
        }
        moe_block_out_free(&out);
    }
    free(x);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_files files;
    fuzz_split(data, size, &files);
    moe_error err = {{0}};
    moe_model *m = NULL;
    moe_status st = moe_model_open_mem("fuzz", files.f, files.n, &m, &err);
    need_msg(st, &err);
    if (st != MOE_OK) return 0;
    const moe_model_info *info = moe_model_get_info(m);
    for (int l = 0; l < info->n_layers && l < 8; l++) {
        moe_layer_kind kind;
        st = moe_model_layer_kind(m, l, &kind, &err);
        need_msg(st, &err);
        if (st != MOE_OK || kind == MOE_LAYER_DENSE) continue;
        const moe_layer *L = NULL;
        st = moe_model_layer(m, l, &L, &err);
        need_msg(st, &err);
        if (st == MOE_OK) {
            run_layer(L);
            moe_layer *part = NULL;
            int E = L->cfg.n_experts;
            st = moe_model_layer_experts(m, l, E / 2, E, &part, &err);
            need_msg(st, &err);
            if (st == MOE_OK) moe_layer_free(part);
        }
        moe_hc_weights *hw = NULL;
        st = moe_hc_load(m, l, MOE_HC_FFN, &hw, &err);
        need_msg(st, &err);
        moe_hc_weights_free(hw);
        moe_idx_weights *iw = NULL;
        st = moe_idx_load(m, l, &iw, &err);
        need_msg(st, &err);
        moe_idx_weights_free(iw);
    }
    moe_model_free(m);
    return 0;
}
