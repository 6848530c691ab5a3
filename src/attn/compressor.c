/*
 * The KV compressors of DeepSeek-V4 (docs/model.md section 4): learned gated
 * pooling of `ratio` consecutive tokens into one entry.
 *
 * Invariants:
 *  1. Windows are aligned to multiples of ratio from position 0; entry w
 *     covers tokens [w * ratio, (w + 1) * ratio) and is emitted only once all
 *     of them were fed (a trailing partial window waits in the state).
 *  2. Entry w, channel c: a softmax over slots of (gate + ape) weighs the
 *     slots' kv values. Without overlap the slots are window w's tokens.
 *     With overlap (CSA) they are window w-1's tokens on the first half of
 *     the projection (channel c) then window w's on the second half (channel
 *     dim + c); window 0 has no predecessor: kv 0, gate -inf (weight 0).
 *  3. The pooled vector is RMS-normed (weighted) and its trailing rope->dim
 *     channels rotated at position w * ratio (the window's first token).
 *  4. Each entry is a function of its window's (and predecessor's) tokens
 *     alone: feeding a sequence in any chunks gives the same entries.
 *  5. Patches (moeaudit_patch.h) act where an engine stores: the state's
 *     kv values and scores (gate + ape) in bf16 (compress-state-bf16: the
 *     kv rounded as it enters the state, each score when it is formed),
 *     each entry once it is emitted (kv-fp8 / kv-bf16 on the main
 *     compressor). Without them no value is touched.
 */
#include "attn/attn.h"
#include "core/core.h"
#include "moe_formats.h"

#include <math.h>
#include <string.h>

static int proj_dim(const moe_compressor_w *w) { return (w->overlap ? 2 : 1) * w->dim; }

/* FlashMLA's V4 cache quantizes the NoPE channels in tiles of 64 (ATTENTION.md 2.3) */
#define KV_FP8_TILE 64

/* The KV rounding of a cache row (attn.h); here, below attention.c, since
 * both the compressor's entries and attention's window rows take it. */
void moe_attn_kv_round(double *x, int dim, int rope_dim, moe_kv_round mode) {
    if (mode == MOE_KV_EXACT) return;
    const int nope = dim - rope_dim;
    if (mode == MOE_KV_FP8) {
        for (int t0 = 0; t0 < nope; t0 += KV_FP8_TILE) {
            const int n = nope - t0 < KV_FP8_TILE ? nope - t0 : KV_FP8_TILE;
            float v[KV_FP8_TILE], scale;
            uint8_t q[KV_FP8_TILE];
            for (int i = 0; i < n; i++) v[i] = moe_bf16_round((float)x[t0 + i]);
            /* one block of n <= 128 values: amax floored at 1e-4, scale 2^ceil(log2(amax/448)) */
            moe_fp8_act_quant_row(v, n, MOE_FP8_SCALE_POW2, q, &scale);
            moe_fp8_block_dequant_row(q, &scale, n, v);
            for (int i = 0; i < n; i++) x[t0 + i] = v[i];
        }
        for (int i = nope; i < dim; i++) x[i] = moe_bf16_round((float)x[i]);
        return;
    }
    for (int i = 0; i < dim; i++) x[i] = moe_bf16_round((float)x[i]);
}

moe_status moe_compressor_state_init(moe_compressor_state *s, const moe_compressor_w *w, moe_error *err) {
    memset(s, 0, sizeof *s);
    size_t C = (size_t)proj_dim(w), r = (size_t)w->ratio;
    s->buf_kv = moe_calloc(r * C, sizeof(double));
    s->buf_gate = moe_calloc(r * C, sizeof(double));
    if (w->overlap) {
        s->prev_kv = moe_calloc(r * (size_t)w->dim, sizeof(double));
        s->prev_gate = moe_calloc(r * (size_t)w->dim, sizeof(double));
    }
    if (!s->buf_kv || !s->buf_gate || (w->overlap && (!s->prev_kv || !s->prev_gate))) {
        moe_compressor_state_free(s);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory for a compressor state (ratio %d, dim %d)", w->ratio,
                        w->dim);
    }
    return MOE_OK;
}

void moe_compressor_state_free(moe_compressor_state *s) {
    if (!s) return;
    free(s->buf_kv);
    free(s->buf_gate);
    free(s->prev_kv);
    free(s->prev_gate);
    free(s->entries);
    memset(s, 0, sizeof *s);
}

static moe_status grow(moe_compressor_state *s, int dim, moe_error *err) {
    if (s->n_entries < s->cap) return MOE_OK;
    int64_t cap = s->cap ? 2 * s->cap : 16;
    double *e = realloc(s->entries, (size_t)cap * (size_t)dim * sizeof(double));
    if (!e) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for %lld compressed entries", (long long)cap);
    s->entries = e;
    s->cap = cap;
    return MOE_OK;
}

static inline double bf16d(double x) { return (double)moe_bf16_round((float)x); }

/* The open window is complete: pool it into entry n_entries. */
static void emit(const moe_compressor_w *w, moe_compressor_state *s, bool f32, bool state_bf16, moe_kv_round entry) {
    const int r = w->ratio, d = w->dim, C = proj_dim(w), slots = (w->overlap ? 2 : 1) * r;
    double *out = s->entries + (size_t)s->n_entries * (size_t)d;
    double g[2 * MOE_ATTN_MAX_RATIO], v[2 * MOE_ATTN_MAX_RATIO];
    for (int c = 0; c < d; c++) {
        int n = 0;
        if (w->overlap) {
            for (int i = 0; i < r; i++) {
                v[n] = s->has_prev ? s->prev_kv[(size_t)i * d + c] : 0.0;
                g[n++] = s->has_prev ? s->prev_gate[(size_t)i * d + c] : -INFINITY;
            }
        }
        const int off = w->overlap ? d : 0;
        for (int i = 0; i < r; i++) {
            v[n] = s->buf_kv[(size_t)i * C + off + c];
            double gi = moe_fl(s->buf_gate[(size_t)i * C + off + c] + w->ape[(size_t)i * C + off + c], f32);
            g[n++] = state_bf16 ? bf16d(gi) : gi;
        }
        double m = -INFINITY;
        for (int i = 0; i < slots; i++)
            if (g[i] > m) m = g[i];
        double sum = 0;
        for (int i = 0; i < slots; i++) {
            g[i] = moe_fl(exp(moe_fl(g[i] - m, f32)), f32);
            sum = moe_fl(sum + g[i], f32);
        }
        double acc = 0;
        for (int i = 0; i < slots; i++) acc = moe_fl(acc + moe_fl(v[i] * moe_fl(g[i] / sum, f32), f32), f32);
        out[c] = acc;
    }
    moe_attn_rmsnorm(out, d, w->norm, w->rms_eps, f32);
    const int rd = w->rope->dim;
    double cs[MOE_ATTN_MAX_ROPE];
    moe_rope_angles(w->rope, s->n_entries * (int64_t)r, cs, f32);
    moe_rope_rotate(cs, out + (d - rd), rd, false, f32);
    moe_attn_kv_round(out, d, rd, entry);
    if (w->overlap) {
        /* this window's first halves (gate with its ape) feed the next entry */
        for (int i = 0; i < r; i++)
            for (int c = 0; c < d; c++) {
                s->prev_kv[(size_t)i * d + c] = s->buf_kv[(size_t)i * C + c];
                double gp = moe_fl(s->buf_gate[(size_t)i * C + c] + w->ape[(size_t)i * C + c], f32);
                s->prev_gate[(size_t)i * d + c] = state_bf16 ? bf16d(gp) : gp;
            }
        s->has_prev = true;
    }
    s->n_entries++;
    s->n_buf = 0;
}

moe_status moe_compressor_feed(const moe_compressor_w *w, moe_compressor_state *s, const double *x, int64_t S,
                               bool f32, const moe_cpu_kernels *kt, bool state_bf16, moe_kv_round entry,
                               moe_error *err) {
    if (S == 0) return MOE_OK;
    const int C = proj_dim(w);
    double *kv = moe_malloc((size_t)S * (size_t)C, sizeof *kv);
    double *gate = moe_malloc((size_t)S * (size_t)C, sizeof *gate);
    moe_status st = MOE_OK;
    if (!kv || !gate) {
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for the compressor projections of %lld tokens",
                      (long long)S);
        goto out;
    }
    st = moe_attn_linear(&w->wkv, x, w->wkv.cols, S, kv, C, f32, kt, err);
    if (st == MOE_OK) st = moe_attn_linear(&w->wgate, x, w->wgate.cols, S, gate, C, f32, kt, err);
    for (int64_t t = 0; st == MOE_OK && t < S; t++) {
        double *bk = s->buf_kv + (size_t)s->n_buf * C, *bg = s->buf_gate + (size_t)s->n_buf * C;
        memcpy(bk, kv + (size_t)t * C, (size_t)C * sizeof(double));
        memcpy(bg, gate + (size_t)t * C, (size_t)C * sizeof(double));
        if (state_bf16)
            for (int c = 0; c < C; c++) bk[c] = bf16d(bk[c]);
        if (++s->n_buf == w->ratio) {
            st = grow(s, w->dim, err);
            if (st == MOE_OK) emit(w, s, f32, state_bf16, entry);
        }
    }
out:
    free(kv);
    free(gate);
    return st;
}

moe_status moe_compressor_state_copy(moe_compressor_state *dst, const moe_compressor_state *src,
                                     const moe_compressor_w *w, moe_error *err) {
    moe_status st = moe_compressor_state_init(dst, w, err);
    if (st != MOE_OK) return st;
    size_t C = (size_t)proj_dim(w), r = (size_t)w->ratio, d = (size_t)w->dim;
    memcpy(dst->buf_kv, src->buf_kv, r * C * sizeof(double));
    memcpy(dst->buf_gate, src->buf_gate, r * C * sizeof(double));
    if (w->overlap) {
        memcpy(dst->prev_kv, src->prev_kv, r * d * sizeof(double));
        memcpy(dst->prev_gate, src->prev_gate, r * d * sizeof(double));
    }
    dst->n_buf = src->n_buf;
    dst->has_prev = src->has_prev;
    if (src->n_entries > 0) {
        dst->entries = moe_malloc((size_t)src->cap, d * sizeof(double));
        if (!dst->entries) {
            moe_compressor_state_free(dst);
            return moe_errf(err, MOE_ERR_NOMEM, "out of memory copying %lld compressed entries", (long long)src->n_entries);
        }
        memcpy(dst->entries, src->entries, (size_t)src->n_entries * d * sizeof(double));
        dst->cap = src->cap;
        dst->n_entries = src->n_entries;
    }
    return MOE_OK;
}
