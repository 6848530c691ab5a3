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
 */
#include "attn/attn.h"
#include "core/core.h"
#include "cpu/kernels.h"
#include "linalg/gemm.h"
#include "moeaudit_indexer.h"

#include <math.h>
#include <string.h>

#define QBLOCK 64

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

/* One query token in float64 through the GEMM tiles (invariant 3): heads
 * [heads, head_dim] of q (normed, rotated) against kv rows kv0 .. kv0+nw-1
 * and the compressed entries listed in cidx [nc] of ent; o [heads,
 * head_dim]. S = q E^T for all heads (E: the nw window rows, then the nc
 * listed entries), a per-head softmax with the sink in the normaliser,
 * o = P E. ptrs [nw + nc], S
 * [heads, nw + nc], ws moe_gemm_f64_workspace() bytes (64-byte aligned). */
static void attend_f64(const moe_attn_w *w, const double *q, const double *kv, int64_t nw, const double *ent,
                       const int64_t *cidx, int64_t nc, const double **ptrs, double *S, double *o, void *ws) {
    const int hd = w->head_dim, nh = w->heads;
    const int64_t n = nw + nc;
    const double scale = 1.0 / sqrt((double)hd);
    for (int64_t k = 0; k < n; k++) ptrs[k] = k < nw ? kv + (size_t)k * hd : ent + (size_t)cidx[k - nw] * hd;
    moe_gemm_f64_rows(NULL, q, hd, nh, ptrs, n, hd, S, n, ws);
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
    moe_gemm_f64_cols(NULL, S, n, nh, ptrs, n, hd, o, hd, ws);
}

/* The same in float32 through the kernel table `kt` (invariant 3): the keys
 * gathered as an F32 weight E [n, hd] and its transpose Et [hd, n]; S = q E^T
 * for all heads, the softmax with the sink in float32 (exp of a float,
 * rounded to float, as moe_fl), o = P Et^T. Buffers: E, Et [cap * hd], qf
 * [heads * hd], S [heads * cap], of [heads * hd] floats. */
static void attend_f32(const moe_attn_w *w, const moe_cpu_kernels *kt, const double *q, const double *kv, int64_t nw,
                       const double *ent, const int64_t *cidx, int64_t nc, float *E, float *Et, float *qf, float *S,
                       float *of, double *o) {
    const int hd = w->head_dim, nh = w->heads;
    const int64_t n = nw + nc;
    for (int64_t k = 0; k < n; k++) {
        const double *kr = k < nw ? kv + (size_t)k * hd : ent + (size_t)cidx[k - nw] * hd;
        for (int i = 0; i < hd; i++) E[(size_t)k * hd + i] = Et[(size_t)i * n + k] = (float)kr[i];
    }
    for (int64_t i = 0; i < (int64_t)nh * hd; i++) qf[i] = (float)q[i];
    const moe_weight we = {MOE_WFMT_F32, n, hd, E, NULL, MOE_DTYPE_F32, 0, 0, 1.0f, "attention keys"};
    const moe_weight wt = {MOE_WFMT_F32, hd, n, Et, NULL, MOE_DTYPE_F32, 0, 0, 1.0f, "attention values"};
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
    kt->gemm(&wt, 0, hd, S, n, nh, of, hd);
    for (int64_t i = 0; i < (int64_t)nh * hd; i++) o[i] = (double)of[i];
}

/* The lightning indexer on one block of B queries (positions pos [B]):
 * q from the shared low-rank query qr [B, q_lora], weights from x [B, H],
 * scores against the indexer's compressed keys, top-k into sel [B, topk]. */
static moe_status index_block(const moe_attn_w *w, const moe_attn_state *s, const double *qr, const double *x,
                              const int64_t *pos, int64_t B, bool f32, int32_t *sel, moe_error *err) {
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
    st = moe_attn_linear(&w->idx_wq_b, qr, w->q_lora, B, q, (int64_t)ih * id, f32, err);
    if (st == MOE_OK) st = moe_attn_linear(&w->idx_wproj, x, w->hidden, B, wt, ih, f32, err);
    if (st != MOE_OK) goto out;
    const double wscale = moe_fl(moe_fl(1.0 / sqrt((double)ih), f32) * moe_fl(1.0 / sqrt((double)id), f32), f32);
    for (int64_t t = 0; t < B; t++) {
        double cs[MOE_ATTN_MAX_ROPE];
        moe_rope_angles(w->rope, pos[t], cs, f32);
        for (int h = 0; h < ih; h++) moe_rope_rotate(cs, q + ((size_t)t * ih + h) * id + (id - rd), rd, false, f32);
        for (int h = 0; h < ih; h++) wt[t * ih + h] = moe_fl(wt[t * ih + h] * wscale, f32);
    }
    moe_idx_shape sh = {.T = B, .S = ne, .heads = ih, .dim = id, .ratio = w->ratio};
    if (ne > 0) {
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
        st = moe_idx_topk(&sh, sc, pos, w->index_topk, sel, err);
    } else {
        for (int64_t i = 0; i < B * w->index_topk; i++) sel[i] = -1;
    }
out:
    free(q);
    free(wt);
    free(sc);
    return st;
}

/* Replace the picks sel [B, K] of queries at pos [B] by the caller's and check them. */
static moe_status replace_picks(const moe_attn_w *w, const moe_attn_state *s, const moe_attn_pick *pick,
                                const int64_t *pos, int64_t B, int32_t *sel, moe_error *err) {
    const int K = w->index_topk;
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
                            const moe_attn_pick *pick, double *out, int32_t *topk, moe_attn_stats *stats,
                            moe_error *err) {
    moe_attn_stats st0 = {0};
    if (S == 0) {
        if (stats) *stats = st0;
        return MOE_OK;
    }
    const int H = w->hidden, hd = w->head_dim, rd = w->rope_dim, nh = w->heads, G = w->o_groups;
    const int64_t pos0 = s->pos, m = s->n_win, nkv = m + S;
    const int64_t QH = (int64_t)nh * hd, ghd = QH / G, GR = (int64_t)G * w->o_lora;
    const int K = w->type == MOE_ATTN_CSA ? w->index_topk : 0;
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
    st = moe_attn_linear(&w->wq_a, x, H, S, qr, w->q_lora, f32, err);
    if (st != MOE_OK) goto out;
    for (int64_t t = 0; t < S; t++) moe_attn_rmsnorm(qr + (size_t)t * w->q_lora, w->q_lora, w->q_norm, w->rms_eps, f32);

    /* KV rows: the cached window, then this chunk's (normed, rotated) */
    memcpy(kv, s->win_kv, (size_t)m * (size_t)hd * sizeof(double));
    st = moe_attn_linear(&w->wkv, x, H, S, kv + (size_t)m * hd, hd, f32, err);
    if (st != MOE_OK) goto out;
    for (int64_t t = 0; t < S; t++) {
        double cs[MOE_ATTN_MAX_ROPE];
        double *row = kv + (size_t)(m + t) * hd;
        moe_attn_rmsnorm(row, hd, w->kv_norm, w->rms_eps, f32);
        moe_rope_angles(w->rope, pos0 + t, cs, f32);
        moe_rope_rotate(cs, row + (hd - rd), rd, false, f32);
    }

    /* compressed entries of the windows this chunk completes */
    if (w->type != MOE_ATTN_SLIDING) st = moe_compressor_feed(&w->comp, &s->comp, x, S, f32, err);
    if (st == MOE_OK && w->type == MOE_ATTN_CSA) st = moe_compressor_feed(&w->idx_comp, &s->idx_comp, x, S, f32, err);
    if (st != MOE_OK) goto out;
    const int64_t ne = s->comp.n_entries;

    for (int64_t b0 = 0; b0 < S; b0 += QBLOCK) {
        const int64_t B = S - b0 < QBLOCK ? S - b0 : QBLOCK;
        for (int64_t t = 0; t < B; t++) pos[t] = pos0 + b0 + t;
        st = moe_attn_linear(&w->wq_b, qr + (size_t)b0 * w->q_lora, w->q_lora, B, q, QH, f32, err);
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
            st = index_block(w, s, qr + (size_t)b0 * w->q_lora, x + (size_t)b0 * H, pos, B, f32, sel, err);
            if (st == MOE_OK && pick && pick->fn) st = replace_picks(w, s, pick, pos, B, sel, err);
            if (st != MOE_OK) goto out;
            if (topk) memcpy(topk + (size_t)b0 * K, sel, (size_t)B * (size_t)K * sizeof(int32_t));
        }
        int64_t nwin_sum = 0, ncomp_sum = 0;
        int failed = 0;
        const moe_cpu_kernels *kt = moe_cpu_ref();
        if (f32) (void)moe_cpu_table(MOE_ISA_AUTO, &kt, NULL); /* AUTO always resolves (ref at worst) */
#pragma omp parallel reduction(+ : nwin_sum, ncomp_sum)
        {
            const int64_t cap = (int64_t)w->window + (K ? K : ne) + 1;
            /* float32: the scores of one head; float64: of all heads, with
             * the entry pointers and the GEMM workspace */
            double *sc = f32 ? NULL : moe_malloc((size_t)cap * (size_t)nh, sizeof *sc);
            int64_t *cidx = moe_malloc((size_t)cap, sizeof *cidx);
            const double **ptrs = f32 ? NULL : moe_malloc((size_t)cap, sizeof *ptrs);
            void *gws = f32 ? NULL : aligned_alloc(64, moe_gemm_f64_workspace());
            /* float32: keys, their transpose, q, scores, output */
            float *fb = f32 ? moe_malloc((size_t)(2 * cap * hd + nh * hd + nh * cap + nh * hd), sizeof(float)) : NULL;
            float *fE = fb, *fEt = fb ? fE + (size_t)cap * hd : NULL, *fq = fb ? fEt + (size_t)cap * hd : NULL;
            float *fS = fb ? fq + (size_t)nh * hd : NULL, *fo = fb ? fS + (size_t)nh * cap : NULL;
            bool ok = cidx && (f32 ? fb != NULL : (sc && ptrs && gws));
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
                if (f32) attend_f32(w, kt, q + (size_t)t * QH, k0, nw, s->comp.entries, cidx, nc, fE, fEt, fq, fS, fo, ot);
                else attend_f64(w, q + (size_t)t * QH, k0, nw, s->comp.entries, cidx, nc, ptrs, sc, ot, gws);
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
        if (failed) {
            st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for the attention scores");
            goto out;
        }
        st0.window_rows += nwin_sum;
        st0.compressed_rows += ncomp_sum;
        /* grouped low-rank output: group g's heads through its rows of wo_a */
        for (int g = 0; g < G && st == MOE_OK; g++)
            st = moe_attn_linear(&w->wo_a[g], o + (size_t)g * ghd, QH, B, rall + (size_t)b0 * GR + (size_t)g * w->o_lora,
                                 GR, f32, err);
        if (st != MOE_OK) goto out;
    }
    st = moe_attn_linear(&w->wo_b, rall, GR, S, out, H, f32, err);
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
