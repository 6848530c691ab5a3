/*
 * Lightning indexer: scores, key/query precisions, selection (docs/semantics.md
 * section 4, docs/indexer.md).
 *
 * Invariants:
 *  1. moe_idx_scores_ref is the definition: float64, Hadamard-rotated q and k
 *     (the rotation is orthonormal, so it changes the float64 scores only by
 *     rounding), I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]).
 *  2. Entry s is visible to a query at position p iff s < min(S, (p+1)/ratio)
 *     (ratio 1: s <= p). Invisible entries score -INFINITY and are never
 *     selected; selection slots beyond the visible count hold -1.
 *  3. Selection order: descending score, ties to the lower index; NaN ranks
 *     below every number (so a poisoned entry is never preferred).
 *  4. Every score is a function of (q_t, w_t, k_s) alone: results do not
 *     depend on threads, batch composition or the other entries. Reductions
 *     run in index order (dot over i, then heads over h).
 *  5. Scoring kernels never allocate; selection and the audits do.
 */
#include "moeaudit_indexer.h"
#include "core/core.h"
#include "indexer/indexer_impl.h"
#include "io/model_util.h"
#include "moe_formats.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

/* The project's precision names (docs/guide.md): "fp8" is E4M3 with a
 * power-of-two scale (V3.1+, V4) everywhere, "fp8-f32scale" the fp32 scale. */
static const char *const quant_names[MOE_IDX_Q_COUNT] = {"f32", "bf16", "fp8-f32scale", "fp8", "fp4"};

const char *moe_idx_quant_name(moe_idx_quant q) {
    return (unsigned)q < MOE_IDX_Q_COUNT ? quant_names[q] : "?";
}

bool moe_idx_quant_parse(const char *s, moe_idx_quant *q) {
    for (int i = 0; i < MOE_IDX_Q_COUNT; i++)
        if (!strcmp(s, quant_names[i])) { *q = (moe_idx_quant)i; return true; }
    /* older spellings */
    if (!strcmp(s, "none") || !strcmp(s, "fp32")) { *q = MOE_IDX_Q_F32; return true; }
    if (!strcmp(s, "fp8-pow2")) { *q = MOE_IDX_Q_FP8_POW2; return true; }
    if (!strcmp(s, "e4m3")) { *q = MOE_IDX_Q_FP8; return true; }
    if (!strcmp(s, "e2m1") || !strcmp(s, "mxfp4")) { *q = MOE_IDX_Q_FP4; return true; }
    return false;
}

moe_idx_opts moe_idx_opts_default(void) {
    moe_idx_opts o = {MOE_IDX_Q_F32, MOE_IDX_Q_F32, MOE_IDX_ACC_F32, true};
    return o;
}

int64_t moe_idx_visible(const moe_idx_shape *sh, int64_t pos) {
    if (pos < 0) return 0;
    int64_t r = sh->ratio > 1 ? sh->ratio : 1;
    /* (pos + 1) / r without forming pos + 1 (pos = INT64_MAX overflowed) */
    int64_t S = sh->S > 0 ? sh->S : 0, q = pos / r;
    if (q >= S) return S;
    int64_t v = q + (pos % r == r - 1); /* q < S: no overflow */
    return v < S ? v : S;
}

/* ------------------------------------------------------------ Hadamard */

void moe_hadamard_ref(double *x, int n) {
    MOE_ASSERT(n > 0 && (n & (n - 1)) == 0);
    for (int len = 1; len < n; len <<= 1)
        for (int i = 0; i < n; i += 2 * len)
            for (int j = i; j < i + len; j++) {
                double a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
    double s = 1.0 / sqrt((double)n);
    for (int i = 0; i < n; i++) x[i] *= s;
}

void moe_hadamard_f32(float *x, int n) {
    MOE_ASSERT(n > 0 && (n & (n - 1)) == 0);
    for (int len = 1; len < n; len <<= 1)
        for (int i = 0; i < n; i += 2 * len)
            for (int j = i; j < i + len; j++) {
                float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
    float s = (float)(1.0 / sqrt((double)n));
    for (int i = 0; i < n; i++) x[i] *= s;
}

/* ------------------------------------------------------------ rounding */

static int round32(int n) { return (n + 31) / 32 * 32; }

size_t moe_idx_quant_scratch(int n) {
    size_t n32 = (size_t)round32(n);
    return (n32 + n32 / 128 + 1) * sizeof(float) + n32 + n32 / 32 + 16;
}

void moe_idx_round(float *x, int n, moe_idx_quant q, void *scratch) {
    if (q == MOE_IDX_Q_F32) return;
    for (int i = 0; i < n; i++) x[i] = moe_bf16_round(x[i]);
    if (q == MOE_IDX_Q_BF16) return;
    int n32 = round32(n);
    float *buf = (float *)scratch;
    float *fscale = buf + n32;
    uint8_t *codes = (uint8_t *)(fscale + n32 / 128 + 1);
    uint8_t *e8 = codes + n32;
    if (q == MOE_IDX_Q_FP8 || q == MOE_IDX_Q_FP8_POW2) {
        moe_fp8_act_quant_row(x, n, q == MOE_IDX_Q_FP8 ? MOE_FP8_SCALE_F32 : MOE_FP8_SCALE_POW2, codes, fscale);
        moe_fp8_block_dequant_row(codes, fscale, n, x);
        return;
    }
    MOE_ASSERT(q == MOE_IDX_Q_FP4);
    memcpy(buf, x, (size_t)n * sizeof(float));
    for (int i = n; i < n32; i++) buf[i] = 0.0f; /* padding never changes a block's amax */
    moe_mxfp4_quant_row(buf, n32, MOE_MX_SCALE_CEIL, MOE_E2M1_RNE, codes, e8);
    moe_mxfp4_dequant_row(codes, e8, n32, buf);
    memcpy(x, buf, (size_t)n * sizeof(float));
}

/* --------------------------------------------------------- score cores */

static inline double relu_d(double x) { return x > 0 ? x : (x != x ? x : 0.0); }
static inline float relu_f(float x) { return x > 0 ? x : (x != x ? x : 0.0f); }

double moe_idx_score1_ref(const double *qT, const double *w, const double *kr, int heads, int dim) {
    double acc[MOE_IDX_MAX_HEADS];
    for (int h = 0; h < heads; h++) acc[h] = 0;
    for (int i = 0; i < dim; i++) {
        const double *qi = qT + (size_t)i * heads;
        double ki = kr[i];
        for (int h = 0; h < heads; h++) acc[h] += qi[h] * ki;
    }
    double s = 0;
    for (int h = 0; h < heads; h++) s += w[h] * relu_d(acc[h]);
    return s;
}

float moe_idx_score1(const float *qT, const float *w, const float *kr, int heads, int dim, moe_idx_accum mode) {
    float acc[MOE_IDX_MAX_HEADS];
    for (int h = 0; h < heads; h++) acc[h] = 0;
    for (int i = 0; i < dim; i++) {
        const float *qi = qT + (size_t)i * heads;
        float ki = kr[i];
        for (int h = 0; h < heads; h++) acc[h] += qi[h] * ki;
    }
    float s = 0;
    if (mode == MOE_IDX_ACC_BF16) {
        for (int h = 0; h < heads; h++)
            s = moe_bf16_round(s + moe_bf16_round(moe_bf16_round(relu_f(moe_bf16_round(acc[h]))) * w[h]));
    } else {
        for (int h = 0; h < heads; h++) s += w[h] * relu_f(acc[h]);
    }
    return s;
}

/* Blocks of keys scored together (the same operations per score as the
 * one-key cores above, in the same order: each head's dot product summed
 * over the channels in index order, then the heads in order; the block only
 * lets the compiler run several keys per instruction). Keys enter
 * transposed: kt [dim, KB] holds the block's keys as columns. */
#define KB_D 8
#define KB_F 16
#define KB_MAX_DIM 512

static void score_block_ref(const double *qT, const double *w, const double *kt, int nb, int heads, int dim,
                            double *out) {
    double acc[MOE_IDX_MAX_HEADS][KB_D];
    for (int h = 0; h < heads; h++)
        for (int j = 0; j < KB_D; j++) acc[h][j] = 0;
    for (int i = 0; i < dim; i++) {
        const double *qi = qT + (size_t)i * heads, *ki = kt + (size_t)i * KB_D;
        for (int h = 0; h < heads; h++) {
            const double qh = qi[h];
            for (int j = 0; j < KB_D; j++) acc[h][j] += qh * ki[j];
        }
    }
    for (int j = 0; j < nb; j++) {
        double sum = 0;
        for (int h = 0; h < heads; h++) sum += w[h] * relu_d(acc[h][j]);
        out[j] = sum;
    }
}

static void score_block_f32(const float *qT, const float *w, const float *kt, int nb, int heads, int dim,
                            moe_idx_accum mode, float *out) {
    float acc[MOE_IDX_MAX_HEADS][KB_F];
    for (int h = 0; h < heads; h++)
        for (int j = 0; j < KB_F; j++) acc[h][j] = 0;
    for (int i = 0; i < dim; i++) {
        const float *qi = qT + (size_t)i * heads, *ki = kt + (size_t)i * KB_F;
        for (int h = 0; h < heads; h++) {
            const float qh = qi[h];
            for (int j = 0; j < KB_F; j++) acc[h][j] += qh * ki[j];
        }
    }
    for (int j = 0; j < nb; j++) {
        float sum = 0;
        if (mode == MOE_IDX_ACC_BF16) {
            for (int h = 0; h < heads; h++)
                sum = moe_bf16_round(sum + moe_bf16_round(moe_bf16_round(relu_f(moe_bf16_round(acc[h][j]))) * w[h]));
        } else {
            for (int h = 0; h < heads; h++) sum += w[h] * relu_f(acc[h][j]);
        }
        out[j] = sum;
    }
}

void moe_idx_prep_q_ref(const double *q /*[heads, dim]*/, int heads, int dim, bool hadamard, double *tmp /*[dim]*/,
                        double *qT /*[dim, heads]*/) {
    for (int h = 0; h < heads; h++) {
        memcpy(tmp, q + (size_t)h * dim, (size_t)dim * sizeof(double));
        if (hadamard) moe_hadamard_ref(tmp, dim);
        for (int i = 0; i < dim; i++) qT[(size_t)i * heads + h] = tmp[i];
    }
}

void moe_idx_prep_q(const double *q, int heads, int dim, bool hadamard, moe_idx_quant quant, float *tmp /*[dim]*/,
                    void *scratch, float *qT) {
    for (int h = 0; h < heads; h++) {
        for (int i = 0; i < dim; i++) tmp[i] = (float)q[(size_t)h * dim + i];
        if (hadamard) moe_hadamard_f32(tmp, dim);
        moe_idx_round(tmp, dim, quant, scratch);
        for (int i = 0; i < dim; i++) qT[(size_t)i * heads + h] = tmp[i];
    }
}

void moe_idx_prep_k(const double *k, int dim, bool hadamard, moe_idx_quant quant, void *scratch, float *out) {
    for (int i = 0; i < dim; i++) out[i] = (float)k[i];
    if (hadamard) moe_hadamard_f32(out, dim);
    moe_idx_round(out, dim, quant, scratch);
}

/* ------------------------------------------------------------- scores */

void moe_idx_scores_ref(const moe_idx_shape *sh, const double *q, const double *k, const double *w,
                        const int64_t *pos, bool hadamard, double *scores) {
    const int H = sh->heads, d = sh->dim;
    MOE_ASSERT(H >= 1 && H <= MOE_IDX_MAX_HEADS && d >= 1 && d <= MOE_IDX_MAX_DIM);
    double qT[MOE_IDX_MAX_DIM * 4]; /* [dim, heads] */
    MOE_ASSERT((size_t)H * d <= sizeof qT / sizeof qT[0]);
    double tmp[MOE_IDX_MAX_DIM], kr[MOE_IDX_MAX_DIM];
    double kt[KB_MAX_DIM * KB_D]; /* [dim, KB_D]: a block of keys as columns */
    for (int64_t t = 0; t < sh->T; t++) {
        moe_idx_prep_q_ref(q + (size_t)t * H * d, H, d, hadamard, tmp, qT);
        int64_t nv = moe_idx_visible(sh, pos[t]);
        double *row = scores + (size_t)t * sh->S;
        int64_t s = 0;
        if (d <= KB_MAX_DIM)
            for (; s < nv; s += KB_D) {
                const int nb = nv - s < KB_D ? (int)(nv - s) : KB_D;
                for (int j = 0; j < KB_D; j++) {
                    if (j < nb) {
                        memcpy(kr, k + (size_t)(s + j) * d, (size_t)d * sizeof(double));
                        if (hadamard) moe_hadamard_ref(kr, d);
                    }
                    for (int i = 0; i < d; i++) kt[(size_t)i * KB_D + j] = j < nb ? kr[i] : 0.0;
                }
                score_block_ref(qT, w + (size_t)t * H, kt, nb, H, d, row + s);
            }
        if (s > nv) s = nv;
        for (; s < sh->S; s++) {
            if (s >= nv) { row[s] = -INFINITY; continue; }
            memcpy(kr, k + (size_t)s * d, (size_t)d * sizeof(double));
            if (hadamard) moe_hadamard_ref(kr, d);
            row[s] = moe_idx_score1_ref(qT, w + (size_t)t * H, kr, H, d);
        }
    }
}

size_t moe_idx_workspace_size(const moe_idx_shape *sh) {
    return ((size_t)sh->S * sh->dim + (size_t)sh->heads * sh->dim + (size_t)sh->heads + (size_t)sh->dim) *
               sizeof(float) + moe_idx_quant_scratch(sh->dim) + 64;
}

void moe_idx_prep_keys(const moe_idx_shape *sh, const moe_idx_opts *o, const double *k, float *kr, void *scratch) {
    const int d = sh->dim;
    MOE_ASSERT(d >= 1 && d <= MOE_IDX_MAX_DIM && scratch);
    for (int64_t s = 0; s < sh->S; s++) moe_idx_prep_k(k + (size_t)s * d, d, o->hadamard, o->k_quant, scratch, kr + (size_t)s * d);
}

size_t moe_idx_query_workspace_size(const moe_idx_shape *sh) {
    return ((size_t)sh->heads * sh->dim + (size_t)sh->heads + (size_t)sh->dim) * sizeof(float) +
           moe_idx_quant_scratch(sh->dim) + 64;
}

void moe_idx_scores(const moe_idx_shape *sh, const moe_idx_opts *o, const double *q, const double *k,
                    const double *w, const int64_t *pos, double *scores, void *ws) {
    MOE_ASSERT(ws);
    float *kr = (float *)ws;
    void *rest = kr + (size_t)sh->S * sh->dim;
    /* the key pass's scratch lies past the query workspace's floats (both are free here) */
    moe_idx_prep_keys(sh, o, k, kr, (char *)rest + ((size_t)sh->heads * sh->dim + (size_t)sh->heads + (size_t)sh->dim) * sizeof(float));
    moe_idx_scores_prepped(sh, o, q, kr, w, pos, scores, rest);
}

void moe_idx_scores_prepped(const moe_idx_shape *sh, const moe_idx_opts *o, const double *q, const float *kr,
                            const double *w, const int64_t *pos, double *scores, void *ws) {
    const int H = sh->heads, d = sh->dim;
    MOE_ASSERT(H >= 1 && H <= MOE_IDX_MAX_HEADS && d >= 1 && d <= MOE_IDX_MAX_DIM && ws);
    float *qT = (float *)ws, *wf = qT + (size_t)H * d, *tmp = wf + H;
    void *scratch = tmp + d;
    for (int64_t t = 0; t < sh->T; t++) {
        moe_idx_prep_q(q + (size_t)t * H * d, H, d, o->hadamard, o->q_quant, tmp, scratch, qT);
        for (int h = 0; h < H; h++) wf[h] = (float)w[(size_t)t * H + h];
        int64_t nv = moe_idx_visible(sh, pos[t]);
        double *row = scores + (size_t)t * sh->S;
        if (d > KB_MAX_DIM) {
#pragma omp parallel for schedule(static) if (nv > 4096)
            for (int64_t s = 0; s < sh->S; s++)
                row[s] = s < nv ? (double)moe_idx_score1(qT, wf, kr + (size_t)s * d, H, d, o->accum) : -INFINITY;
            continue;
        }
        const int64_t nblk = (nv + KB_F - 1) / KB_F;
#pragma omp parallel for schedule(static) if (nv > 4096)
        for (int64_t b = 0; b < nblk; b++) {
            float kt[KB_MAX_DIM * KB_F], out[KB_F];
            const int64_t s = b * KB_F;
            const int nb = nv - s < KB_F ? (int)(nv - s) : KB_F;
            for (int j = 0; j < KB_F; j++)
                for (int i = 0; i < d; i++) kt[(size_t)i * KB_F + j] = j < nb ? kr[(size_t)(s + j) * d + i] : 0.0f;
            score_block_f32(qT, wf, kt, nb, H, d, o->accum, out);
            for (int j = 0; j < nb; j++) row[s + j] = (double)out[j];
        }
        for (int64_t s = nv; s < sh->S; s++) row[s] = -INFINITY;
    }
}

/* ------------------------------------------------------------ selection */

typedef struct ent {
    double v;
    int64_t i;
} ent;

/* a before b: larger score, NaN last, then lower index */
static int ent_cmp(const void *pa, const void *pb) {
    const ent *a = pa, *b = pb;
    bool na = a->v != a->v, nb = b->v != b->v;
    if (na != nb) return na ? 1 : -1;
    if (!na && a->v != b->v) return a->v > b->v ? -1 : 1;
    return a->i < b->i ? -1 : (a->i > b->i);
}

/* Heap of the k best entries seen, the worst at the root (ent_cmp is a
 * strict total order: indices differ). */
static void heap_down(ent *h, int n, int i) {
    for (;;) {
        int w = i, l = 2 * i + 1, r = l + 1;
        if (l < n && ent_cmp(&h[l], &h[w]) > 0) w = l;
        if (r < n && ent_cmp(&h[r], &h[w]) > 0) w = r;
        if (w == i) return;
        ent t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

moe_status moe_idx_topk(const moe_idx_shape *sh, const double *scores, const int64_t *pos, int topk,
                        int32_t *sel, moe_error *err) {
    if (topk < 1) return moe_errf(err, MOE_ERR_ARG, "index_topk = %d must be >= 1", topk);
    if (sh->S > INT32_MAX) return moe_errf(err, MOE_ERR_ARG, "%lld key entries exceed int32 indices", (long long)sh->S);
    ent *e = moe_malloc((size_t)sh->S + 1, sizeof *e);
    if (!e) return moe_errf(err, MOE_ERR_NOMEM, "out of memory selecting over %lld entries", (long long)sh->S);
    for (int64_t t = 0; t < sh->T; t++) {
        int64_t nv = moe_idx_visible(sh, pos[t]); /* in [0, S] */
        MOE_ASSERT(nv >= 0 && nv <= sh->S);
        const double *row = scores + (size_t)t * sh->S;
        int64_t m = nv;
        if (nv <= topk) {
            for (int64_t s = 0; s < nv; s++) { e[s].v = row[s]; e[s].i = s; }
        } else {
            /* the topk best by a bounded heap; the order is total, so the set
             * and its sorted order are those of sorting every entry */
            m = topk;
            for (int64_t s = 0; s < m; s++) { e[s].v = row[s]; e[s].i = s; }
            for (int64_t i = m / 2 - 1; i >= 0; i--) heap_down(e, (int)m, (int)i);
            for (int64_t s = m; s < nv; s++) {
                ent c = {row[s], s};
                if (ent_cmp(&c, &e[0]) < 0) {
                    e[0] = c;
                    heap_down(e, (int)m, 0);
                }
            }
        }
        qsort(e, (size_t)m, sizeof *e, ent_cmp);
        for (int j = 0; j < topk; j++) sel[(size_t)t * topk + j] = j < m ? (int32_t)e[j].i : -1;
    }
    free(e);
    return MOE_OK;
}

int64_t moe_idx_rank(const double *scores, int64_t n_vis, int64_t j) {
    double v = scores[j];
    bool nan_j = v != v;
    int64_t r = 1;
    for (int64_t s = 0; s < n_vis; s++) {
        if (s == j) continue;
        double x = scores[s];
        bool nan_s = x != x;
        if (nan_j) { if (!nan_s || s < j) r++; }
        else if (!nan_s && (x > v || (x == v && s < j))) r++;
    }
    return r;
}

/* ------------------------------------------------------ V4 weights */

moe_status moe_idx_load(moe_model *m, int layer, moe_idx_weights **out, moe_error *err) {
    const moe_model_info *info = moe_model_get_info(m);
    if (layer < 0 || layer >= info->n_layers)
        return moe_errf(err, MOE_ERR_ARG, "layer %d out of range: the model has %d layers", layer, info->n_layers);
    cJSON *root = cJSON_Parse(moe_model_config_json(m));
    if (!root) return moe_errf(err, MOE_ERR_FORMAT, "config.json: not valid JSON");
    moe_idx_weights *w = moe_calloc(1, sizeof *w);
    if (!w) { cJSON_Delete(root); return moe_errf(err, MOE_ERR_NOMEM, "out of memory"); }
    w->hidden = info->hidden;
    /* required positive integers <= 1e7 */
    const char *cj = "config.json";
    /* bounded before anything is sized from them: heads and dim by the
     * scorer's fixed scratch, the rest far above real configs (V4: 64 heads,
     * dim 128, top-k 512 or 1024, q_lora_rank 1024 or 1536, ratio 4) */
    moe_status st = moe_cfg_int(root, cj, "index_n_heads", true, 0, 1, MOE_IDX_MAX_HEADS, &w->heads, err);
    if (st == MOE_OK) st = moe_cfg_int(root, cj, "index_head_dim", true, 0, 1, MOE_IDX_MAX_DIM, &w->dim, err);
    if (st == MOE_OK) st = moe_cfg_int(root, cj, "index_topk", true, 0, 1, 1 << 20, &w->topk, err);
    if (st == MOE_OK) st = moe_cfg_int(root, cj, "q_lora_rank", true, 0, 1, 1 << 16, &w->q_lora_rank, err);
    /* compress_rates.compressed_sparse_attention (default 4): read as a
     * bounded integer (a cast of an unbounded double was undefined) */
    const cJSON *cr = cJSON_GetObjectItemCaseSensitive(root, "compress_rates");
    w->ratio = 4;
    if (st == MOE_OK && cJSON_IsObject(cr))
        st = moe_cfg_int(cr, "config.json compress_rates", "compressed_sparse_attention", false, 4, 1, 1 << 20,
                         &w->ratio, err);
    cJSON_Delete(root);
    if (st == MOE_OK && (size_t)w->heads * (size_t)w->dim > MOE_IDX_MAX_DIM * 4)
        st = moe_errf(err, MOE_ERR_CONFIG, "config.json: index_n_heads x index_head_dim = %d x %d exceeds the supported %d",
                      w->heads, w->dim, MOE_IDX_MAX_DIM * 4);
    /* V4 names the indexer layers.N.attn.indexer (wq_b FP8 + E8M0 .scale in
     * the release, weights_proj BF16); V3.2 model.layers.N.self_attn.indexer
     * with wk and a LayerNorm k_norm (weight, bias) as well. Linears decode
     * from any storage format (moe_model_load_linear_f64_alloc). */
    char pre[96], name[200];
    snprintf(pre, sizeof pre, "layers.%d.attn.indexer", layer);
    snprintf(name, sizeof name, "%s.wq_b.weight", pre);
    bool has = false;
    if (st == MOE_OK) st = moe_model_probe(m, name, &has, err);
    if (st == MOE_OK && !has) {
        snprintf(name, sizeof name, "model.layers.%d.self_attn.indexer.wq_b.weight", layer);
        st = moe_model_probe(m, name, &has, err);
        if (st == MOE_OK && has) {
            snprintf(pre, sizeof pre, "model.layers.%d.self_attn.indexer", layer);
            w->v32 = true;
        }
    }
    if (st == MOE_OK) {
        snprintf(name, sizeof name, "%s.wq_b", pre);
        st = moe_model_load_linear_f64_alloc(m, name, (int64_t)w->heads * w->dim, w->q_lora_rank, &w->wq_b, err);
    }
    if (st == MOE_OK) {
        snprintf(name, sizeof name, "%s.weights_proj", pre);
        st = moe_model_load_linear_f64_alloc(m, name, w->heads, w->hidden, &w->weights_proj, err);
    }
    if (st == MOE_OK && w->v32) {
        snprintf(name, sizeof name, "%s.wk", pre);
        st = moe_model_load_linear_f64_alloc(m, name, w->dim, w->hidden, &w->wk, err);
        int64_t shape[1] = {w->dim};
        snprintf(name, sizeof name, "%s.k_norm.weight", pre);
        if (st == MOE_OK) st = moe_model_load_f64_alloc(m, name, 1, shape, &w->k_norm_w, err);
        snprintf(name, sizeof name, "%s.k_norm.bias", pre);
        if (st == MOE_OK) st = moe_model_load_f64_alloc(m, name, 1, shape, &w->k_norm_b, err);
    }
    if (st != MOE_OK) { moe_idx_weights_free(w); return st; }
    static const char *const comp[] = {"wkv.weight", "wgate.weight", "ape", "norm.weight"};
    w->has_compressor = !w->v32;
    for (int i = 0; i < 4 && w->has_compressor; i++) {
        snprintf(name, sizeof name, "%s.compressor.%s", pre, comp[i]);
        bool hc = false;
        st = moe_model_probe(m, name, &hc, err);
        if (st != MOE_OK) { moe_idx_weights_free(w); return st; }
        if (!hc) w->has_compressor = false;
    }
    *out = w;
    return MOE_OK;
}

void moe_idx_weights_free(moe_idx_weights *w) {
    if (!w) return;
    free(w->wq_b);
    free(w->weights_proj);
    free(w->wk);
    free(w->k_norm_w);
    free(w->k_norm_b);
    free(w);
}

void moe_idx_project(const moe_idx_weights *iw, const double *qr, const double *x, int64_t T, double *q, double *w) {
    const int HD = iw->heads * iw->dim, R = iw->q_lora_rank, Hd = iw->hidden;
    const double ws = 1.0 / sqrt((double)iw->heads) / sqrt((double)iw->dim);
    for (int64_t t = 0; t < T; t++) {
        for (int o = 0; o < HD; o++) {
            double acc = 0;
            for (int i = 0; i < R; i++) acc += iw->wq_b[(size_t)o * R + i] * qr[(size_t)t * R + i];
            q[(size_t)t * HD + o] = acc;
        }
        for (int h = 0; h < iw->heads; h++) {
            double acc = 0;
            for (int i = 0; i < Hd; i++) acc += iw->weights_proj[(size_t)h * Hd + i] * x[(size_t)t * Hd + i];
            w[(size_t)t * iw->heads + h] = acc * ws;
        }
    }
}

/* ---------------------------------------------------------- recall */

moe_status moe_idx_recall_run(const moe_idx_shape *sh, const double *q, const double *k, const double *w,
                              const int64_t *pos, int topk, const moe_idx_opts *precs, int n_prec,
                              moe_idx_recall *out, moe_error *err) {
    if (topk < 1) return moe_errf(err, MOE_ERR_ARG, "index_topk = %d must be >= 1", topk);
    if (sh->heads < 1 || sh->heads > MOE_IDX_MAX_HEADS || sh->dim < 1 || sh->dim > MOE_IDX_MAX_DIM ||
        (size_t)sh->heads * sh->dim > MOE_IDX_MAX_DIM * 4)
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "%d heads x %d dims: the reference supports heads * dim <= %d",
                        sh->heads, sh->dim, MOE_IDX_MAX_DIM * 4);
    bool pow2 = sh->dim > 0 && (sh->dim & (sh->dim - 1)) == 0;
    for (int p = 0; p < n_prec; p++)
        if (precs[p].hadamard && !pow2)
            return moe_errf(err, MOE_ERR_ARG, "index head dim %d is not a power of two: no Hadamard rotation", sh->dim);
    size_t ts = (size_t)sh->T * (size_t)sh->S;
    double *ref = moe_malloc(ts + 1, sizeof(double)), *sc = moe_malloc(ts + 1, sizeof(double));
    int32_t *sref = moe_malloc((size_t)sh->T * topk + 1, sizeof(int32_t));
    int32_t *sp = moe_malloc((size_t)sh->T * topk + 1, sizeof(int32_t));
    void *ws = moe_malloc(moe_idx_workspace_size(sh), 1);
    uint8_t *mark = moe_calloc((size_t)sh->S + 1, 1);
    moe_status st = MOE_OK;
    if (!ref || !sc || !sref || !sp || !ws || !mark) {
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory scoring %lld x %lld", (long long)sh->T, (long long)sh->S);
        goto done;
    }
    bool had = n_prec > 0 ? precs[0].hadamard : true;
    moe_idx_scores_ref(sh, q, k, w, pos, had, ref);
    if ((st = moe_idx_topk(sh, ref, pos, topk, sref, err)) != MOE_OK) goto done;
    bool any_sparse = false;
    for (int64_t t = 0; t < sh->T; t++) any_sparse |= moe_idx_visible(sh, pos[t]) > topk;
    for (int p = 0; p < n_prec; p++) {
        moe_idx_recall *r = &out[p];
        r->opts = precs[p];
        r->mean_recall = 0;
        r->min_recall = 1;
        r->queries = 0;
        moe_idx_scores(sh, &precs[p], q, k, w, pos, sc, ws);
        if ((st = moe_idx_topk(sh, sc, pos, topk, sp, err)) != MOE_OK) goto done;
        for (int64_t t = 0; t < sh->T; t++) {
            int64_t nv = moe_idx_visible(sh, pos[t]);
            if (any_sparse && nv <= topk) continue;
            int n_ref = 0, hit = 0;
            for (int j = 0; j < topk; j++) {
                int32_t a = sref[(size_t)t * topk + j];
                if (a >= 0) { mark[a] = 1; n_ref++; }
            }
            for (int j = 0; j < topk; j++) {
                int32_t b = sp[(size_t)t * topk + j];
                if (b >= 0 && mark[b]) hit++;
            }
            for (int j = 0; j < topk; j++) {
                int32_t a = sref[(size_t)t * topk + j];
                if (a >= 0) mark[a] = 0;
            }
            double rc = n_ref ? (double)hit / n_ref : 1.0;
            r->mean_recall += rc;
            r->min_recall = fmin(r->min_recall, rc);
            r->queries++;
        }
        if (r->queries) r->mean_recall /= (double)r->queries;
        else r->mean_recall = 1;
    }
done:
    free(ref);
    free(sc);
    free(sref);
    free(sp);
    free(ws);
    free(mark);
    return st;
}
