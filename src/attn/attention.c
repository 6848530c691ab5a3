/*
 * The attention layer of DeepSeek-V4 (docs/model.md sections 3, 5 and 6).
 *
 * Invariants:
 *  1. Query t (position p) reads the KV rows of positions
 *     max(0, p - window + 1) .. p (one shared KV vector per token, used as
 *     key and value for every head), then compressed entries: on HCA layers
 *     every entry j < (p + 1) / ratio, on CSA layers the indexer's picks
 *     (visible entries only, -1 padding skipped), in the order picked.
 *  2. Per head: scores q . k * head_dim^-1/2; the learned sink joins the
 *     softmax's normaliser only; the output's rope slice is rotated back at p.
 *  3. Every query's arithmetic is one fixed sequence (keys in the order of
 *     invariant 1, channels in index order), whatever the chunking, the
 *     block of queries it runs in and the thread count; the KV rows and
 *     entries it reads are themselves per-token / per-window functions.
 *     float64: the scores of all heads and the weighted sums are products
 *     through src/linalg/gemm.h (each dot product one fma chain over the
 *     channels, each output channel one fma chain over the keys in order);
 *     float32: the same two products in float32 through the CPU kernel
 *     table's gemm (src/cpu/kernels.h, its fixed per-lane order; the keys
 *     gathered into a float buffer and its transpose), softmax in float32.
 *  4. The state keeps the last window - 1 KV rows: exactly what later
 *     queries can still see.
 *  5. A layer patch (moeaudit_patch.h) changes only what it names: KV rows
 *     and main-compressor entries are rounded once, as they enter the cache
 *     (kv-*); attn-bf16 replaces the per-query arithmetic by attend_bf16;
 *     indexer patches score through moe_idx_scores_prepped (keys rotated
 *     and rounded once per block); index_topk changes the picks' count.
 *     With ap NULL (or moe_layer_patch_none) every value is the reference's.
 */
#include "attn/attn.h"
#include "core/core.h"
#include "cpu/kernels.h"
#include "linalg/gemm.h"
#include "moe_formats.h"
#include "moeaudit_indexer.h"

#include <math.h>
#include <string.h>

#define QBLOCK 64
#define MAX_HEAD_DIM 4096

static inline float bf(double x) { return moe_bf16_round((float)x); }

moe_status moe_attn_state_init(moe_attn_state *s, const moe_attn_w *w, moe_error *err) {
    memset(s, 0, sizeof *s);
    size_t keep = (size_t)(w->window > 1 ? w->window - 1 : 1);
    s->win_kv = moe_calloc(keep * (size_t)w->head_dim, sizeof(double));
    if (!s->win_kv) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for the sliding-window cache");
    moe_status st = MOE_OK;
    if (w->type != MOE_ATTN_SLIDING) st = moe_compressor_state_init(&s->comp, &w->comp, err);
    if (st == MOE_OK && w->type == MOE_ATTN_CSA) st = moe_compressor_state_init(&s->idx_comp, &w->idx_comp, err);
    if (st != MOE_OK) moe_attn_state_free(s);
    return st;
}

void moe_attn_state_free(moe_attn_state *s) {
    if (!s) return;
    free(s->win_kv);
    moe_compressor_state_free(&s->comp);
    moe_compressor_state_free(&s->idx_comp);
    memset(s, 0, sizeof *s);
}

moe_status moe_attn_state_copy(moe_attn_state *dst, const moe_attn_state *src, const moe_attn_w *w, moe_error *err) {
    moe_status st = moe_attn_state_init(dst, w, err);
    if (st != MOE_OK) return st;
    size_t keep = (size_t)(w->window > 1 ? w->window - 1 : 1);
    memcpy(dst->win_kv, src->win_kv, keep * (size_t)w->head_dim * sizeof(double));
    dst->pos = src->pos;
    dst->n_win = src->n_win;
    if (w->type != MOE_ATTN_SLIDING) {
        moe_compressor_state_free(&dst->comp);
        st = moe_compressor_state_copy(&dst->comp, &src->comp, &w->comp, err);
    }
    if (st == MOE_OK && w->type == MOE_ATTN_CSA) {
        moe_compressor_state_free(&dst->idx_comp);
        st = moe_compressor_state_copy(&dst->idx_comp, &src->idx_comp, &w->idx_comp, err);
    }
    if (st != MOE_OK) moe_attn_state_free(dst);
    return st;
}

/* One query token in float64 through the GEMM tiles (invariant 3): heads
 * [heads, head_dim] of q (normed, rotated) against kv rows kv0 .. kv0+nw-1
 * and the compressed entries listed in cidx [nc] of ent; o [heads,
 * head_dim]. S = q E^T for all heads (E: the nw window rows, then the nc
 * listed entries), a per-head softmax with the sink in the normaliser,
 * o = P E. ptrs [nw + nc], S
 * [heads, nw + nc], ws moe_gemm_f64_workspace() bytes (64-byte aligned);
 * pw NULL or [heads, nw + nc]: each key's weight in the output. */
static void attend_f64(const moe_attn_w *w, const moe_cpu_kernels *kt, const double *q, const double *kv, int64_t nw,
                       const double *ent, const int64_t *cidx, int64_t nc, const double **ptrs, double *S, double *o,
                       double *pw, void *ws) {
    const int hd = w->head_dim, nh = w->heads;
    const int64_t n = nw + nc;
    const double scale = 1.0 / sqrt((double)hd);
    for (int64_t k = 0; k < n; k++) ptrs[k] = k < nw ? kv + (size_t)k * hd : ent + (size_t)cidx[k - nw] * hd;
    moe_gemm_f64_rows(kt, q, hd, nh, ptrs, n, hd, S, n, ws);
    for (int h = 0; h < nh; h++) {
        double *sc = S + (size_t)h * n, m = w->sink[h];
        for (int64_t k = 0; k < n; k++) {
            sc[k] = sc[k] * scale;
            if (sc[k] > m) m = sc[k];
        }
        double z = exp(w->sink[h] - m);
        for (int64_t k = 0; k < n; k++) {
            sc[k] = exp(sc[k] - m);
            z = z + sc[k];
        }
        for (int64_t k = 0; k < n; k++) sc[k] = sc[k] / z;
    }
    if (pw) memcpy(pw, S, (size_t)nh * (size_t)n * sizeof *pw);
    moe_gemm_f64_cols(kt, S, n, nh, ptrs, n, hd, o, hd, ws);
}

/* The same in float32 through the kernel table `kt` (invariant 3): the keys
 * gathered as an F32 weight E [n, hd] and its transpose Et [hd, n]; S = q E^T
 * for all heads, the softmax with the sink in float32 (exp of a float,
 * rounded to float, as moe_fl), o = P Et^T. Buffers: E, Et [cap * hd], qf
 * [heads * hd], S [heads * cap], of [heads * hd] floats; pw NULL or
 * [heads, nw + nc]: each key's weight in the output. */
static void attend_f32(const moe_attn_w *w, const moe_cpu_kernels *kt, const double *q, const double *kv, int64_t nw,
                       const double *ent, const int64_t *cidx, int64_t nc, float *E, float *Et, float *qf, float *S,
                       float *of, double *o, double *pw) {
    const int hd = w->head_dim, nh = w->heads;
    const int64_t n = nw + nc;
    for (int64_t k = 0; k < n; k++) {
        const double *kr = k < nw ? kv + (size_t)k * hd : ent + (size_t)cidx[k - nw] * hd;
        for (int i = 0; i < hd; i++) E[(size_t)k * hd + i] = Et[(size_t)i * n + k] = (float)kr[i];
    }
    for (int64_t i = 0; i < (int64_t)nh * hd; i++) qf[i] = (float)q[i];
    const moe_weight we = {.fmt = MOE_WFMT_F32, .rows = n, .cols = hd, .data = E,
                            .scale_dtype = MOE_DTYPE_F32, .scale2 = 1.0f, .name = "attention keys"};
    const moe_weight wt = {.fmt = MOE_WFMT_F32, .rows = hd, .cols = n, .data = Et,
                            .scale_dtype = MOE_DTYPE_F32, .scale2 = 1.0f, .name = "attention values"};
    kt->gemm(&we, 0, n, qf, hd, nh, S, n);
    const float scale = (float)(1.0 / sqrt((double)hd));
    for (int h = 0; h < nh; h++) {
        float *sc = S + (size_t)h * n, m = (float)w->sink[h];
        for (int64_t k = 0; k < n; k++) {
            sc[k] = sc[k] * scale;
            if (sc[k] > m) m = sc[k];
        }
        float z = (float)exp((double)((float)w->sink[h] - m));
        for (int64_t k = 0; k < n; k++) {
            sc[k] = (float)exp((double)(sc[k] - m));
            z = z + sc[k];
        }
        for (int64_t k = 0; k < n; k++) sc[k] = sc[k] / z;
    }
    if (pw)
        for (int64_t i = 0; i < (int64_t)nh * n; i++) pw[i] = (double)S[i];
    kt->gemm(&wt, 0, hd, S, n, nh, of, hd);
    for (int64_t i = 0; i < (int64_t)nh * hd; i++) o[i] = (double)of[i];
}

/* attend() as a bf16 MMA decode kernel computes it (MOE_ATTN_ARITH_BF16):
 * q and the keys (= values) in bf16; each score an fp32 sum in channel
 * order of exact bf16 products, scaled in fp32; fp32 max, exp and
 * normaliser with the sink; the unnormalised weights rounded to bf16 for
 * the PV product, accumulated in fp32 in key order; the sum divided by the
 * normaliser in fp32 and the output rounded to bf16. The same shapes. */
static void attend_bf16(const moe_attn_w *w, const double *q, const double *kv, int64_t nw, const double *ent,
                        const int64_t *cidx, int64_t nc, double *sc, double *o, double *pw) {
    const int hd = w->head_dim;
    const float scale = (float)(1.0 / sqrt((double)hd));
    float qb[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
    for (int h = 0; h < w->heads; h++) {
        const double *qh = q + (size_t)h * hd;
        for (int i = 0; i < hd; i++) qb[i] = bf(qh[i]);
        const float sink = (float)w->sink[h];
        float m = sink;
        for (int64_t k = 0; k < nw + nc; k++) {
            const double *kr = k < nw ? kv + (size_t)k * hd : ent + (size_t)cidx[k - nw] * hd;
            float dot = 0.0f;
            for (int i = 0; i < hd; i++) dot += qb[i] * bf(kr[i]);
            float sk = dot * scale;
            sc[k] = sk;
            if (sk > m) m = sk;
        }
        float z = (float)exp((double)(sink - m));
        for (int64_t k = 0; k < nw + nc; k++) {
            float e = (float)exp((double)((float)sc[k] - m));
            sc[k] = e;
            z += e;
        }
        for (int i = 0; i < hd; i++) acc[i] = 0.0f;
        for (int64_t k = 0; k < nw + nc; k++) {
            const double *kr = k < nw ? kv + (size_t)k * hd : ent + (size_t)cidx[k - nw] * hd;
            const float pb = bf(sc[k]);
            if (pw) pw[(size_t)h * (size_t)(nw + nc) + (size_t)k] = (double)(pb / z);
            for (int i = 0; i < hd; i++) acc[i] += pb * bf(kr[i]);
        }
        double *oh = o + (size_t)h * hd;
        for (int i = 0; i < hd; i++) oh[i] = bf(acc[i] / z);
    }
}

static bool probed(const moe_attn_probe *pr, int64_t p) {
    for (int i = 0; pr && i < pr->n; i++)
        if (pr->pos[i] == p) return true;
    return false;
}

/* The lightning indexer on one block of B queries (positions pos [B]):
 * q from the shared low-rank query qr [B, q_lora], weights from x [B, H],
 * scores against the indexer's compressed keys, top-K into sel [B, K]
 * (K = moe_attn_topk). An indexer patch scores through the engine scorer
 * (the keys prepared once, the queries threaded); probed positions report
 * their scores. */
static moe_status index_block(const moe_attn_w *w, const moe_attn_state *s, const double *qr, const double *x,
                              const int64_t *pos, int64_t B, bool f32, const moe_cpu_kernels *kt,
                              const moe_attn_patch *ap,
                              const moe_attn_probe *probe, int32_t *sel, moe_error *err) {
    const int ih = w->index_heads, id = w->index_dim, rd = w->rope_dim;
    const int64_t ne = s->idx_comp.n_entries;
    double *q = moe_malloc((size_t)B * (size_t)ih * (size_t)id, sizeof *q);
    double *wt = moe_malloc((size_t)B * (size_t)ih, sizeof *wt);
    double *sc = moe_malloc((size_t)B * (size_t)(ne > 0 ? ne : 1), sizeof *sc);
    moe_status st = MOE_OK;
    if (!q || !wt || !sc) {
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for the indexer scores of %lld queries x %lld entries",
                      (long long)B, (long long)ne);
        goto out;
    }
    st = moe_attn_linear(&w->idx_wq_b, qr, w->q_lora, B, q, (int64_t)ih * id, f32, kt, err);
    if (st == MOE_OK) st = moe_attn_linear(&w->idx_wproj, x, w->hidden, B, wt, ih, f32, kt, err);
    if (st != MOE_OK) goto out;
    const double wscale = moe_fl(moe_fl(1.0 / sqrt((double)ih), f32) * moe_fl(1.0 / sqrt((double)id), f32), f32);
    for (int64_t t = 0; t < B; t++) {
        double cs[MOE_ATTN_MAX_ROPE];
        moe_rope_angles(w->rope, pos[t], cs, f32);
        for (int h = 0; h < ih; h++) moe_rope_rotate(cs, q + ((size_t)t * ih + h) * id + (id - rd), rd, false, f32);
        for (int h = 0; h < ih; h++) wt[t * ih + h] = moe_fl(wt[t * ih + h] * wscale, f32);
    }
    moe_idx_shape sh = {.T = B, .S = ne, .heads = ih, .dim = id, .ratio = w->ratio};
    const int K = moe_attn_topk(w, ap);
    if (ne > 0 && ap && ap->index_engine) {
        float *kr = moe_malloc((size_t)ne * (size_t)id, sizeof *kr);
        void *ksc = moe_malloc(moe_idx_quant_scratch(id), 1);
        if (!kr || !ksc) {
            free(kr);
            free(ksc);
            st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for %lld prepared index keys", (long long)ne);
            goto out;
        }
        moe_idx_prep_keys(&sh, &ap->idx, s->idx_comp.entries, kr, ksc);
        free(ksc);
        int failed = 0;
#pragma omp parallel
        {
            void *ws = moe_malloc(moe_idx_query_workspace_size(&sh), 1);
            if (!ws) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < B; t++) {
                if (!ws) continue;
                moe_idx_shape one = sh;
                one.T = 1;
                moe_idx_scores_prepped(&one, &ap->idx, q + (size_t)t * ih * id, kr, wt + (size_t)t * ih, pos + t,
                                       sc + (size_t)t * ne, ws);
            }
            free(ws);
        }
        free(kr);
        if (failed) {
            st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for the indexer workspace");
            goto out;
        }
        st = moe_idx_topk(&sh, sc, pos, K, sel, err);
    } else if (ne > 0) {
        if (!f32) {
            /* float64: one query per call, threaded over queries (each row is a fixed sequence) */
#pragma omp parallel for schedule(dynamic, 1)
            for (int64_t t = 0; t < B; t++) {
                moe_idx_shape one = sh;
                one.T = 1;
                moe_idx_scores_ref(&one, q + (size_t)t * ih * id, s->idx_comp.entries, wt + (size_t)t * ih,
                                   pos + t, false, sc + (size_t)t * ne);
            }
        } else {
            moe_idx_opts io = moe_idx_opts_default();
            io.hadamard = false;
            void *ws = moe_malloc(moe_idx_workspace_size(&sh), 1);
            if (!ws) {
                st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for the float32 indexer workspace");
                goto out;
            }
            moe_idx_scores(&sh, &io, q, s->idx_comp.entries, wt, pos, sc, ws);
            free(ws);
        }
        st = moe_idx_topk(&sh, sc, pos, K, sel, err);
    } else {
        for (int64_t i = 0; i < B * K; i++) sel[i] = -1;
    }
    for (int64_t t = 0; st == MOE_OK && probe && probe->index_scores && t < B; t++)
        if (probed(probe, pos[t])) st = probe->index_scores(probe->ctx, pos[t], sc + (size_t)t * (ne > 0 ? ne : 1),
                                                            moe_idx_visible(&sh, pos[t]), err);
out:
    free(q);
    free(wt);
    free(sc);
    return st;
}

/* Replace the picks sel [B, K] of queries at pos [B] by the caller's and check them. */
static moe_status replace_picks(const moe_attn_w *w, const moe_attn_state *s, const moe_attn_pick *pick,
                                const int64_t *pos, int64_t B, int K, int32_t *sel, moe_error *err) {
    moe_status st = pick->fn(pick->ctx, pick->layer, pos[0], B, K, sel, err);
    if (st != MOE_OK) return st;
    for (int64_t t = 0; t < B; t++) {
        int64_t vis = (pos[t] + 1) / w->ratio;
        if (vis > s->idx_comp.n_entries) vis = s->idx_comp.n_entries;
        for (int k = 0; k < K; k++) {
            int32_t j = sel[t * K + k];
            bool dup = false;
            for (int k2 = 0; k2 < k && j >= 0; k2++) dup |= sel[t * K + k2] == j;
            if (j < -1 || j >= vis || dup)
                return moe_errf(err, MOE_ERR_INPUT,
                                "layer %d: replacement index_topk[%lld][%d] = %d is not -1 or a new entry visible to "
                                "position %lld (entries 0..%lld)", pick->layer, (long long)pos[t], k, j,
                                (long long)pos[t], (long long)vis - 1);
        }
    }
    return MOE_OK;
}

moe_status moe_attn_forward(const moe_attn_w *w, moe_attn_state *s, const double *x, int64_t S, bool f32,
                            const moe_cpu_kernels *kt, const moe_attn_patch *ap, const moe_attn_pick *pick,
                            const moe_attn_probe *probe, double *out, int32_t *topk, moe_attn_stats *stats,
                            moe_error *err) {
    moe_attn_stats st0 = {0};
    if (!kt) (void)moe_cpu_table(MOE_ISA_AUTO, &kt, NULL); /* AUTO always resolves (ref at worst) */
    if (S == 0) {
        if (stats) *stats = st0;
        return MOE_OK;
    }
    const int H = w->hidden, hd = w->head_dim, rd = w->rope_dim, nh = w->heads, G = w->o_groups;
    const int64_t pos0 = s->pos, m = s->n_win, nkv = m + S;
    const int64_t QH = (int64_t)nh * hd, ghd = QH / G, GR = (int64_t)G * w->o_lora;
    const int K = moe_attn_topk(w, ap);
    const moe_kv_round kvr = ap ? ap->kv : MOE_KV_EXACT;
    const bool bf16_arith = ap && ap->arith == MOE_ATTN_ARITH_BF16;
    if (hd > MAX_HEAD_DIM) return moe_errf(err, MOE_ERR_UNSUPPORTED, "head_dim %d exceeds %d", hd, MAX_HEAD_DIM);
    double *qr = moe_malloc((size_t)S * (size_t)w->q_lora, sizeof *qr);
    double *kv = moe_malloc((size_t)nkv * (size_t)hd, sizeof *kv);
    double *rall = moe_malloc((size_t)S * (size_t)GR, sizeof *rall);
    double *q = moe_malloc((size_t)QBLOCK * (size_t)QH, sizeof *q);
    double *o = moe_malloc((size_t)QBLOCK * (size_t)QH, sizeof *o);
    int32_t *sel = K ? moe_malloc((size_t)QBLOCK * (size_t)K, sizeof *sel) : NULL;
    int64_t pos[QBLOCK];
    moe_status st = MOE_OK;
    if (!qr || !kv || !rall || !q || !o || (K && !sel)) {
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for the attention of %lld tokens", (long long)S);
        goto out;
    }

    /* low-rank query latent, shared with the indexer */
    st = moe_attn_linear(&w->wq_a, x, H, S, qr, w->q_lora, f32, kt, err);
    if (st != MOE_OK) goto out;
    for (int64_t t = 0; t < S; t++) moe_attn_rmsnorm(qr + (size_t)t * w->q_lora, w->q_lora, w->q_norm, w->rms_eps, f32);

    /* KV rows: the cached window, then this chunk's (normed, rotated) */
    memcpy(kv, s->win_kv, (size_t)m * (size_t)hd * sizeof(double));
    st = moe_attn_linear(&w->wkv, x, H, S, kv + (size_t)m * hd, hd, f32, kt, err);
    if (st != MOE_OK) goto out;
    for (int64_t t = 0; t < S; t++) {
        double cs[MOE_ATTN_MAX_ROPE];
        double *row = kv + (size_t)(m + t) * hd;
        moe_attn_rmsnorm(row, hd, w->kv_norm, w->rms_eps, f32);
        moe_rope_angles(w->rope, pos0 + t, cs, f32);
        moe_rope_rotate(cs, row + (hd - rd), rd, false, f32);
        moe_attn_kv_round(row, hd, rd, kvr);
    }

    /* compressed entries of the windows this chunk completes */
    const bool cbf = ap && ap->compress_bf16;
    if (w->type != MOE_ATTN_SLIDING) st = moe_compressor_feed(&w->comp, &s->comp, x, S, f32, kt, cbf, kvr, err);
    if (st == MOE_OK && w->type == MOE_ATTN_CSA)
        st = moe_compressor_feed(&w->idx_comp, &s->idx_comp, x, S, f32, kt, cbf, MOE_KV_EXACT, err);
    if (st != MOE_OK) goto out;
    const int64_t ne = s->comp.n_entries;

    for (int64_t b0 = 0; b0 < S; b0 += QBLOCK) {
        const int64_t B = S - b0 < QBLOCK ? S - b0 : QBLOCK;
        for (int64_t t = 0; t < B; t++) pos[t] = pos0 + b0 + t;
        st = moe_attn_linear(&w->wq_b, qr + (size_t)b0 * w->q_lora, w->q_lora, B, q, QH, f32, kt, err);
        if (st != MOE_OK) goto out;
        for (int64_t t = 0; t < B; t++) {
            double cs[MOE_ATTN_MAX_ROPE];
            moe_rope_angles(w->rope, pos[t], cs, f32);
            for (int h = 0; h < nh; h++) {
                double *qh = q + (size_t)t * QH + (size_t)h * hd;
                moe_attn_rmsnorm(qh, hd, NULL, w->rms_eps, f32);
                moe_rope_rotate(cs, qh + (hd - rd), rd, false, f32);
            }
        }
        if (K) {
            st = index_block(w, s, qr + (size_t)b0 * w->q_lora, x + (size_t)b0 * H, pos, B, f32, kt, ap, probe, sel,
                             err);
            if (st == MOE_OK && pick && pick->fn) st = replace_picks(w, s, pick, pos, B, K, sel, err);
            if (st != MOE_OK) goto out;
            if (topk) memcpy(topk + (size_t)b0 * K, sel, (size_t)B * (size_t)K * sizeof(int32_t));
        }
        /* probed queries of the block: their keys' weights [heads, keys] */
        const int64_t kcap = (int64_t)w->window + (K ? K : ne) + 1;
        double *pw[QBLOCK];
        int64_t *pkeys[QBLOCK], pnk[QBLOCK];
        bool probe_fail = false;
        for (int64_t t = 0; t < B; t++) {
            pw[t] = NULL;
            pkeys[t] = NULL;
            pnk[t] = 0;
            if (probe && probe->probs && probed(probe, pos[t])) {
                pw[t] = moe_malloc((size_t)nh * (size_t)kcap, sizeof(double));
                pkeys[t] = moe_malloc((size_t)kcap, sizeof(int64_t));
                probe_fail |= !pw[t] || !pkeys[t];
            }
        }
        int64_t nwin_sum = 0, ncomp_sum = 0;
        int failed = probe_fail;
#pragma omp parallel reduction(+ : nwin_sum, ncomp_sum)
        {
            const int64_t cap = (int64_t)w->window + (K ? K : ne) + 1;
            /* float32: the scores of one head; float64: of all heads, with
             * the entry pointers and the GEMM workspace */
            double *sc = f32 && !bf16_arith ? NULL : moe_malloc((size_t)cap * (size_t)nh, sizeof *sc);
            int64_t *cidx = moe_malloc((size_t)cap, sizeof *cidx);
            const double **ptrs = f32 ? NULL : moe_malloc((size_t)cap, sizeof *ptrs);
            void *gws = f32 ? NULL : aligned_alloc(64, moe_gemm_f64_workspace());
            /* float32: keys, their transpose, q, scores, output */
            float *fb = f32 ? moe_malloc((size_t)(2 * cap * hd + nh * hd + nh * cap + nh * hd), sizeof(float)) : NULL;
            float *fE = fb, *fEt = fb ? fE + (size_t)cap * hd : NULL, *fq = fb ? fEt + (size_t)cap * hd : NULL;
            float *fS = fb ? fq + (size_t)nh * hd : NULL, *fo = fb ? fS + (size_t)nh * cap : NULL;
            bool ok = cidx && (f32 ? fb != NULL : (ptrs && gws)) && (sc || (f32 && !bf16_arith));
            if (!ok) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < B; t++) {
                if (!ok) continue;
                const int64_t p = pos[t];
                int64_t first = p - w->window + 1;
                if (first < 0) first = 0;
                const int64_t nw = p - first + 1;
                const double *k0 = kv + (size_t)(first - (pos0 - m)) * hd;
                int64_t nc = 0;
                if (w->type == MOE_ATTN_HCA) {
                    int64_t vis = (p + 1) / w->ratio;
                    if (vis > ne) vis = ne;
                    for (int64_t j = 0; j < vis; j++) cidx[nc++] = j;
                } else if (K) {
                    for (int j = 0; j < K; j++)
                        if (sel[(size_t)t * K + j] >= 0) cidx[nc++] = sel[(size_t)t * K + j];
                }
                double *ot = o + (size_t)t * QH;
                if (bf16_arith) attend_bf16(w, q + (size_t)t * QH, k0, nw, s->comp.entries, cidx, nc, sc, ot, pw[t]);
                else if (f32)
                    attend_f32(w, kt, q + (size_t)t * QH, k0, nw, s->comp.entries, cidx, nc, fE, fEt, fq, fS, fo, ot,
                               pw[t]);
                else attend_f64(w, kt, q + (size_t)t * QH, k0, nw, s->comp.entries, cidx, nc, ptrs, sc, ot, pw[t], gws);
                if (pkeys[t]) {
                    for (int64_t k = 0; k < nw; k++) pkeys[t][k] = first + k;
                    for (int64_t k = 0; k < nc; k++) pkeys[t][nw + k] = -1 - cidx[k];
                    pnk[t] = nw + nc;
                }
                double cs[MOE_ATTN_MAX_ROPE];
                moe_rope_angles(w->rope, p, cs, f32);
                for (int h = 0; h < nh; h++) moe_rope_rotate(cs, ot + (size_t)h * hd + (hd - rd), rd, true, f32);
                nwin_sum += nw;
                ncomp_sum += nc;
            }
            free(sc);
            free(cidx);
            free(ptrs);
            free(gws);
            free(fb);
        }
        for (int64_t t = 0; t < B; t++) {
            /* attend wrote pw [heads, pnk] (rows of the keys read) */
            if (!failed && st == MOE_OK && pw[t] && pkeys[t]) st = probe->probs(probe->ctx, pos[t], pw[t], pkeys[t], pnk[t], err);
            free(pw[t]);
            free(pkeys[t]);
        }
        if (failed) {
            st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for the attention scores");
            goto out;
        }
        if (st != MOE_OK) goto out;
        st0.window_rows += nwin_sum;
        st0.compressed_rows += ncomp_sum;
        /* grouped low-rank output: group g's heads through its rows of wo_a */
        for (int g = 0; g < G && st == MOE_OK; g++)
            st = moe_attn_linear(&w->wo_a[g], o + (size_t)g * ghd, QH, B, rall + (size_t)b0 * GR + (size_t)g * w->o_lora,
                                 GR, f32, kt, err);
        if (st != MOE_OK) goto out;
    }
    st = moe_attn_linear(&w->wo_b, rall, GR, S, out, H, f32, kt, err);
    if (st != MOE_OK) goto out;

    /* keep the last window - 1 KV rows */
    {
        int64_t keep = (int64_t)w->window - 1;
        if (keep > nkv) keep = nkv;
        if (keep < 0) keep = 0;
        memmove(s->win_kv, kv + (size_t)(nkv - keep) * hd, (size_t)keep * (size_t)hd * sizeof(double));
        s->n_win = keep;
    }
    s->pos += S;
    st0.entries = ne;
    if (stats) *stats = st0;
out:
    free(qr);
    free(kv);
    free(rall);
    free(q);
    free(o);
    free(sel);
    return st;
}
