/*
 * Indexer tensors from a file (moeaudit_indexer.h: moe_idx_tensors_read):
 * the one reader of `needle --tensors` and its fuzzer.
 */
#include "core/core.h"
#include "indexer/indexer_impl.h"

#include <string.h>

void moe_idx_tensors_free(moe_idx_tensors *t) {
    if (!t) return;
    free(t->q);
    free(t->k);
    free(t->w);
    free(t->pos);
    memset(t, 0, sizeof *t);
}

moe_status moe_idx_tensors_read(const moe_st_file *f, int ratio, moe_idx_tensors *out, moe_error *err) {
    MOE_ASSERT(f && out);
    memset(out, 0, sizeof *out);
    const char *path = moe_st_path(f);
    if (ratio < 1) return moe_errf(err, MOE_ERR_ARG, "compression ratio %d must be >= 1", ratio);
    int64_t sq[3] = {-1, -1, -1}, sk[2] = {-1, -1}, sw[2] = {-1, -1};
    moe_status st = moe_st_read_f64(f, "q", 3, sq, &out->q, err);
    if (st == MOE_OK) {
        sk[1] = sq[2]; /* k [S, dim], w [T, heads] must agree with q */
        st = moe_st_read_f64(f, "k", 2, sk, &out->k, err);
    }
    if (st == MOE_OK) {
        sw[0] = sq[0];
        sw[1] = sq[1];
        st = moe_st_read_f64(f, "w", 2, sw, &out->w, err);
    }
    if (st == MOE_OK && (sq[0] < 1 || sk[0] < 1))
        st = moe_errf(err, MOE_ERR_SHAPE, "%s: q has %lld queries and k %lld entries: both must be >= 1", path,
                      (long long)sq[0], (long long)sk[0]);
    /* bounds before any narrowing to int */
    if (st == MOE_OK && (sq[1] < 1 || sq[1] > MOE_IDX_MAX_HEADS || sq[2] < 1 || sq[2] > MOE_IDX_MAX_DIM))
        st = moe_errf(err, MOE_ERR_SHAPE, "%s: q [T, heads, dim] has heads = %lld, dim = %lld: need 1..%d heads and "
                      "1..%d dims", path, (long long)sq[1], (long long)sq[2], MOE_IDX_MAX_HEADS, MOE_IDX_MAX_DIM);
    if (st != MOE_OK) { moe_idx_tensors_free(out); return st; }
    out->sh = (moe_idx_shape){.T = sq[0], .S = sk[0], .heads = (int)sq[1], .dim = (int)sq[2], .ratio = ratio};
    if (moe_st_find(f, "pos")) {
        int64_t sp[1] = {sq[0]};
        st = moe_st_read_i64(f, "pos", 1, sp, &out->pos, err);
    } else {
        /* the last T of S * ratio positions, computed without overflow */
        int64_t S = sk[0], T = sq[0], end;
        if (S > INT64_MAX / ratio) {
            st = moe_errf(err, MOE_ERR_SHAPE, "%s: %lld entries x ratio %d positions overflow: give pos", path,
                          (long long)S, ratio);
        } else {
            end = S * ratio;
            out->pos = moe_malloc((size_t)T, sizeof *out->pos);
            if (!out->pos) st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", path);
            for (int64_t t = 0; st == MOE_OK && t < T; t++) out->pos[t] = end - T + t; /* may be negative: invisible */
        }
    }
    if (st != MOE_OK) moe_idx_tensors_free(out);
    return st;
}
