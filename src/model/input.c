/*
 * The forward's input files (moeaudit_model.h: moe_fwd_input_read,
 * moe_fwd_replay_init / moe_fwd_replay_pick): `forward --input` and
 * `forward --replay-index` read through these, and so does fuzz-forward, so
 * that what is fuzzed is what runs.
 *
 * Invariants:
 *  1. Every check happens before the run: a replay's picks are checked
 *     whole (layer, dtype, shape, every value) when it is opened, so a bad
 *     file fails before any output exists; the attention checks the picks
 *     it is handed again (replace_picks, src/attn/attention.c).
 *  2. Integers are compared as int64 before any narrowing: a stored value
 *     outside int32 is an error naming it, never a wrapped index.
 */
#include "core/core.h"
#include "moeaudit_model.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

void moe_fwd_input_free(moe_fwd_input *in) {
    if (!in) return;
    free(in->ids);
    free(in->streams);
    memset(in, 0, sizeof *in);
}

moe_status moe_fwd_input_read(const moe_st_file *f, const moe_fwd_config *c, int first_layer, moe_fwd_input *in,
                              moe_error *err) {
    MOE_ASSERT(f && c && in && first_layer >= 0);
    memset(in, 0, sizeof *in);
    const char *path = moe_st_path(f);
    const moe_st_tensor *t = moe_st_find(f, "input_ids");
    if (!t) return moe_errf(err, MOE_ERR_MISSING, "%s: no tensor named \"input_ids\"", path);
    if (t->dtype != MOE_DTYPE_I32 && t->dtype != MOE_DTYPE_I64)
        return moe_errf(err, MOE_ERR_DTYPE, "%s: tensor input_ids has dtype %s; expected I32 or I64", path,
                        moe_dtype_name(t->dtype));
    if (t->ndim != 1)
        return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor input_ids must have shape [T]; it has %d dimensions", path,
                        t->ndim);
    const int64_t T = t->shape[0];
    if (T == 0) return moe_errf(err, MOE_ERR_INPUT, "%s: tensor input_ids has 0 tokens: nothing to run", path);
    int64_t *ids = moe_malloc((size_t)T, sizeof *ids);
    if (!ids) return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for %lld token ids", path, (long long)T);
    for (int64_t i = 0; i < T; i++) {
        ids[i] = moe_load_i64(t->data, t->dtype, (size_t)i);
        if (ids[i] < 0 || ids[i] >= c->vocab) {
            moe_status st = moe_errf(err, MOE_ERR_INPUT,
                                     "%s: input_ids[%lld] = %lld is not a token id: the vocabulary has %d entries",
                                     path, (long long)i, (long long)ids[i], c->vocab);
            free(ids);
            return st;
        }
    }
    double *streams = NULL;
    if (first_layer > 0) {
        char name[64];
        snprintf(name, sizeof name, "layers.%d.in", first_layer);
        const moe_st_tensor *s = moe_st_find(f, name);
        if (s) {
            if (!moe_dtype_is_float(s->dtype) || s->ndim != 3 || s->shape[0] != T || s->shape[1] != c->hc_mult ||
                s->shape[2] != c->hidden) {
                free(ids);
                return moe_errf(err, moe_dtype_is_float(s->dtype) ? MOE_ERR_SHAPE : MOE_ERR_DTYPE,
                                "%s: tensor %s must be a float tensor [%lld, %d, %d] (T, hc_mult, hidden); it is %s "
                                "with %d dimensions",
                                path, name, (long long)T, c->hc_mult, c->hidden, moe_dtype_name(s->dtype), s->ndim);
            }
            /* the shape equals [T, hc_mult, hidden], so the tensor's own size bounds n */
            size_t n = (size_t)T * (size_t)c->hc_mult * (size_t)c->hidden;
            streams = moe_malloc(n, sizeof *streams);
            if (!streams) {
                free(ids);
                return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for tensor %s", path, name);
            }
            for (size_t i = 0; i < n; i++) streams[i] = moe_load_f64(s->data, s->dtype, i);
        }
    }
    in->T = T;
    in->ids = ids;
    in->streams = streams;
    return MOE_OK;
}

/* l when name is exactly "layers.{l}.index_topk" (l decimal, no sign, no
 * leading zero, below 2^30), else -1. */
static int replay_layer(const char *name) {
    static const char pre[] = "layers.", suf[] = ".index_topk";
    if (strncmp(name, pre, sizeof pre - 1) != 0) return -1;
    const char *p = name + sizeof pre - 1;
    int64_t l = 0;
    int digits = 0;
    for (; *p >= '0' && *p <= '9'; p++, digits++) {
        if (digits == 0 && *p == '0' && p[1] >= '0' && p[1] <= '9') return -1;
        l = l * 10 + (*p - '0');
        if (l >= (int64_t)1 << 30) return -1;
    }
    if (digits == 0 || strcmp(p, suf) != 0) return -1;
    return (int)l;
}

moe_status moe_fwd_replay_init(const moe_st_file *f, const moe_fwd_config *c, int64_t T, moe_fwd_replay *r,
                               moe_error *err) {
    MOE_ASSERT(f && c && r && T >= 1);
    memset(r, 0, sizeof *r);
    const char *path = moe_st_path(f);
    const int layers = c->n_layers + c->n_mtp;
    int64_t *seen = NULL; /* [max entries + 1]: the last row + 1 that picked each entry */
    size_t seen_n = 0;
    moe_status st = MOE_OK;
    for (size_t i = 0; st == MOE_OK && i < moe_st_count(f); i++) {
        const moe_st_tensor *t = moe_st_at(f, i);
        int l = replay_layer(t->name);
        if (l < 0) continue;
        if (l >= layers) {
            st = moe_errf(err, MOE_ERR_INPUT, "%s: tensor %s names layer %d; the model has layers 0..%d", path,
                          t->name, l, layers - 1);
            break;
        }
        if (c->attn[l] != MOE_ATTN_CSA || c->ratio[l] < 1) {
            st = moe_errf(err, MOE_ERR_INPUT,
                          "%s: tensor %s: layer %d has %s attention, which has no indexer picks to replace", path,
                          t->name, l, moe_attn_type_name(c->attn[l]));
            break;
        }
        if (!moe_dtype_is_int(t->dtype)) {
            st = moe_errf(err, MOE_ERR_DTYPE, "%s: tensor %s has dtype %s; expected an integer dtype", path, t->name,
                          moe_dtype_name(t->dtype));
            break;
        }
        if (t->ndim != 2 || t->shape[0] != T || t->shape[1] < 1) {
            st = moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s must be an integer tensor [%lld, K] (T, index_topk) with "
                          "K >= 1; it has %d dimensions%s%lld", path, t->name, (long long)T, t->ndim,
                          t->ndim >= 1 ? " and rows " : "", t->ndim >= 1 ? (long long)t->shape[0] : 0LL);
            break;
        }
        const int64_t K = t->shape[1], ratio = c->ratio[l];
        const int64_t n_vis = T / ratio; /* entries visible to the last row */
        if ((size_t)n_vis + 1 > seen_n) {
            free(seen);
            seen_n = (size_t)n_vis + 1;
            seen = moe_calloc(seen_n, sizeof *seen);
            if (!seen) {
                st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory checking tensor %s", path, t->name);
                break;
            }
        } else {
            memset(seen, 0, seen_n * sizeof *seen);
        }
        for (int64_t p = 0; st == MOE_OK && p < T; p++) {
            const int64_t vis = (p + 1) / ratio;
            for (int64_t k = 0; k < K; k++) {
                int64_t v = moe_load_i64(t->data, t->dtype, (size_t)(p * K + k));
                if (v == -1) continue;
                if (v < 0 || v >= vis || v > INT32_MAX) {
                    char seen_by[96];
                    if (vis > 0)
                        snprintf(seen_by, sizeof seen_by, "entries 0..%lld", (long long)vis - 1);
                    else
                        snprintf(seen_by, sizeof seen_by, "no entry yet");
                    st = moe_errf(err, MOE_ERR_INPUT, "%s: %s[%lld][%lld] = %lld is not -1 or an entry visible to "
                                  "position %lld (%s at compress ratio %lld)", path, t->name, (long long)p,
                                  (long long)k, (long long)v, (long long)p, seen_by, (long long)ratio);
                    break;
                }
                if (seen[v] == p + 1) {
                    st = moe_errf(err, MOE_ERR_INPUT, "%s: %s[%lld][%lld] = %lld repeats an entry of row %lld", path,
                                  t->name, (long long)p, (long long)k, (long long)v, (long long)p);
                    break;
                }
                seen[v] = p + 1;
            }
        }
    }
    free(seen);
    if (st != MOE_OK) return st;
    r->f = f;
    r->T = T;
    return MOE_OK;
}

moe_status moe_fwd_replay_pick(void *ctx, int layer, int64_t row0, int64_t rows, int topk, int32_t *sel,
                               moe_error *err) {
    const moe_fwd_replay *r = ctx;
    MOE_ASSERT(r && r->f && rows >= 0 && topk >= 0 && (sel || rows == 0 || topk == 0));
    char name[64];
    snprintf(name, sizeof name, "layers.%d.index_topk", layer);
    const moe_st_tensor *t = moe_st_find(r->f, name);
    if (!t) return MOE_OK; /* this layer keeps the indexer's own picks */
    const char *path = moe_st_path(r->f);
    /* init checked dtype, ndim and rows; K must be the run's */
    if (t->shape[1] != topk)
        return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s must be an integer tensor [%lld, %d]; it has %lld picks "
                        "per row", path, name, (long long)r->T, topk, (long long)t->shape[1]);
    if (row0 < 0 || row0 > r->T || rows > r->T - row0)
        return moe_errf(err, MOE_ERR_INPUT, "%s: tensor %s has %lld rows; the run asks for rows %lld..%lld", path,
                        name, (long long)r->T, (long long)row0, (long long)(row0 + rows - 1));
    /* values were checked by moe_fwd_replay_init: -1 or in [0, T / ratio) */
    for (int64_t i = 0; i < rows * topk; i++)
        sel[i] = (int32_t)moe_load_i64(t->data, t->dtype, (size_t)(row0 * topk + i));
    return MOE_OK;
}
