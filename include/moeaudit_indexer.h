/*
 * moeaudit_indexer.h: the lightning indexer of DeepSeek V3.2 (DSA) and V4
 * (compressed sparse attention), its key/query precisions, and the needle
 * probe (docs/semantics.md section 4, docs/indexer.md).
 *
 * Worked example: score T queries against S keys in float64 and select.
 *
 *     moe_idx_shape sh = {.T = T, .S = S, .heads = 64, .dim = 128, .ratio = 4};
 *     // q [T, heads, dim], k [S, dim], w [T, heads] (weights_proj output
 *     //   already multiplied by heads^-1/2 * dim^-1/2), pos [T] positions
 *     moe_idx_scores_ref(&sh, q, k, w, pos, true, scores);      // [T, S]
 *     moe_idx_topk(&sh, scores, pos, 512, sel);                 // [T, 512]
 *
 * Scope: the scoring core works on given q, k and w. moe_idx_load reads the
 * V4 indexer weights (attn.indexer.wq_b, weights_proj, compressor.*) and
 * moe_idx_project computes q (no RoPE) and w from the attention's low-rank
 * query and the hidden state; the indexer's key compressor (overlapping
 * windows, gated pooling, kv_norm, RoPE) is not reproduced: keys come from
 * the caller.
 */
#ifndef MOEAUDIT_INDEXER_H
#define MOEAUDIT_INDEXER_H

#include "moeaudit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rounding of q or k after the Hadamard rotation. */
typedef enum moe_idx_quant {
    MOE_IDX_Q_F32,      /* fp32, no further rounding */
    MOE_IDX_Q_BF16,     /* bf16, nearest even */
    MOE_IDX_Q_FP8,      /* bf16, then E4M3 per 128 values, fp32 scale amax/448 (V3.2) */
    MOE_IDX_Q_FP8_POW2, /* bf16, then E4M3 per 128, scale 2^ceil(log2(amax/448)) */
    MOE_IDX_Q_FP4,      /* bf16, then E2M1 per 32, E8M0 scale 2^ceil(log2(amax/6)) (V4 reference) */
    MOE_IDX_Q_COUNT
} moe_idx_quant;

/* The project's precision names: "f32", "bf16", "fp8-f32scale" (MOE_IDX_Q_FP8),
 * "fp8" (MOE_IDX_Q_FP8_POW2: "fp8" is the power-of-two scale everywhere),
 * "fp4". _parse also takes the older "fp32", "none", "fp8-pow2", "e4m3"
 * (fp32 scale), "e2m1" and "mxfp4". */
const char *moe_idx_quant_name(moe_idx_quant q);
bool moe_idx_quant_parse(const char *s, moe_idx_quant *q);

/* Accumulation of the per-head dot products and of the head sum. */
typedef enum moe_idx_accum {
    MOE_IDX_ACC_F32,    /* fp32, index order (V3.2 kernels, SGLang) */
    MOE_IDX_ACC_BF16    /* fp32 dot rounded to bf16, ReLU, times w rounded to bf16,
                           head sum rounded to bf16 after each add (V4 reference's bf16 einsum) */
} moe_idx_accum;

typedef struct moe_idx_opts {
    moe_idx_quant q_quant, k_quant;
    moe_idx_accum accum;
    bool hadamard;      /* rotate q and k (size dim, normalised) before rounding */
} moe_idx_opts;

moe_idx_opts moe_idx_opts_default(void); /* fp32 q and k, fp32 accumulation, Hadamard on */

typedef struct moe_idx_shape {
    int64_t T;          /* queries */
    int64_t S;          /* key entries (tokens for V3.2, compressed entries for V4) */
    int heads;          /* H_I */
    int dim;            /* d_I, a power of two when Hadamard is on */
    int ratio;          /* 1: V3.2 (entry s visible to query at pos p iff s <= p);
                           r > 1: V4 (entry j visible iff j < (p + 1) / r) */
} moe_idx_shape;

/* Number of entries visible to a query at position pos: min(S, (pos+1)/ratio). */
int64_t moe_idx_visible(const moe_idx_shape *sh, int64_t pos);

/* In-place fast Walsh-Hadamard transform of x [n] scaled by n^-1/2 (n a power
 * of two; MOE_ASSERT otherwise). The float twin rounds at each butterfly. */
void moe_hadamard_ref(double *x, int n);
void moe_hadamard_f32(float *x, int n);

/* Round one rotated vector x [n] in place as `q` defines (fp32 in, fp32 out,
 * the values dequantized). scratch: [n + 32] floats + [n] bytes; see
 * moe_idx_quant_scratch. Never allocates. */
size_t moe_idx_quant_scratch(int n);
void moe_idx_round(float *x, int n, moe_idx_quant q, void *scratch);

/*
 * Float64 reference scores: I[t, s] = sum_h w[t, h] * ReLU(q'[t, h] . k'[s])
 * with q', k' the Hadamard-rotated vectors (when `hadamard`), all in double.
 *   q [T, heads, dim], k [S, dim], w [T, heads], pos [T] (int64 positions),
 *   scores [T, S]: -INFINITY for entries the query cannot see.
 * Never allocates (dim <= 4096). Deterministic; entries are independent.
 */
void moe_idx_scores_ref(const moe_idx_shape *sh, const double *q, const double *k, const double *w,
                        const int64_t *pos, bool hadamard, double *scores);

/* Bytes of workspace moe_idx_scores needs. */
size_t moe_idx_workspace_size(const moe_idx_shape *sh);

/*
 * Engine scores under `o`: q and k rotated in fp32, rounded per o->q_quant /
 * o->k_quant, dot products and head sum accumulated per o->accum; w is used
 * in fp32. Shapes as moe_idx_scores_ref; scores [T, S] float widened to
 * double (-INFINITY when invisible). ws: moe_idx_workspace_size bytes.
 */
void moe_idx_scores(const moe_idx_shape *sh, const moe_idx_opts *o, const double *q, const double *k,
                    const double *w, const int64_t *pos, double *scores, void *ws);

/* moe_idx_scores in two passes, for callers that score many queries against
 * the same keys (threaded over queries): the keys once, rotated and rounded
 * per o into kr [S, dim] floats (scratch: moe_idx_quant_scratch(dim) bytes),
 * then any block of queries against them (ws: moe_idx_query_workspace_size
 * bytes, one per concurrent caller). The scores are moe_idx_scores' bit for
 * bit. Never allocate. */
void moe_idx_prep_keys(const moe_idx_shape *sh, const moe_idx_opts *o, const double *k, float *kr, void *scratch);
size_t moe_idx_query_workspace_size(const moe_idx_shape *sh);
void moe_idx_scores_prepped(const moe_idx_shape *sh, const moe_idx_opts *o, const double *q, const float *kr,
                            const double *w, const int64_t *pos, double *scores, void *ws);

/*
 * Selection: for each query, the top `topk` visible entries by score,
 * descending, ties to the lower index. sel [T, topk] (int32); slots past the
 * visible count are -1. NaN scores rank below every number. Allocates a
 * per-call index buffer (MOE_ERR_NOMEM).
 */
moe_status moe_idx_topk(const moe_idx_shape *sh, const double *scores, const int64_t *pos, int topk,
                        int32_t *sel, moe_error *err);

/* Rank (1-based) of entry j among the first n_vis scores, descending, ties to
 * the lower index; NaN ranks last. */
int64_t moe_idx_rank(const double *scores, int64_t n_vis, int64_t j);

/* ------------------------------------------------------- V4 weights */

typedef struct moe_idx_weights {
    int heads, dim, q_lora_rank, hidden, topk, ratio;
    double *wq_b;           /* [heads * dim, q_lora_rank] */
    double *weights_proj;   /* [heads, hidden] */
    bool has_compressor;    /* attn.indexer.compressor.{wkv,wgate,ape,norm} found (V4) */
    bool v32;               /* DeepSeek V3.2 names: model.layers.N.self_attn.indexer.* */
    double *wk;             /* V3.2: [dim, hidden] key projection; NULL for V4 */
    double *k_norm_w, *k_norm_b; /* V3.2: [dim] LayerNorm of the keys; NULL for V4 */
} moe_idx_weights;

/* Load layer `layer`'s indexer with index_n_heads, index_head_dim,
 * index_topk, q_lora_rank and the compress ratio of
 * "compressed_sparse_attention" from config.json: V4's
 * layers.N.attn.indexer.{wq_b, weights_proj, compressor.*} or V3.2's
 * model.layers.N.self_attn.indexer.{wq_b, wk, k_norm, weights_proj} (with
 * or without "model."). Linears may be stored in any format moe_weight_load
 * reads (the releases: FP8 wq_b / wk with their block scales, BF16
 * weights_proj) and are decoded to float64 exactly. MOE_ERR_MISSING when the
 * layer has no indexer (the message says which tensor). */
moe_status moe_idx_load(moe_model *m, int layer, moe_idx_weights **out, moe_error *err);
void moe_idx_weights_free(moe_idx_weights *w);

/* q [T, heads, dim] = wq_b . qr (qr [T, q_lora_rank]: the attention's
 * normalised low-rank query; no RoPE applied) and
 * w [T, heads] = weights_proj . x * heads^-1/2 * dim^-1/2 (x [T, hidden]). */
void moe_idx_project(const moe_idx_weights *iw, const double *qr, const double *x, int64_t T,
                     double *q, double *w);

/* Indexer tensors from a file (`needle --tensors`). */
typedef struct moe_idx_tensors {
    moe_idx_shape sh;   /* T, S, heads, dim from the tensors; ratio as asked */
    double *q;          /* [T, heads, dim] */
    double *k;          /* [S, dim] */
    double *w;          /* [T, heads] (weights already scaled) */
    int64_t *pos;       /* [T] positions */
} moe_idx_tensors;

/* q [T, heads, dim], k [S, dim], w [T, heads] (float dtypes) and, when the
 * file has it, pos [T] (any integer dtype) of f; without pos the queries are
 * the last T of S * ratio positions (pos[t] = S * ratio - T + t). The shapes
 * must agree, T, S >= 1, 1 <= heads <= 256, 1 <= dim <= 4096 and ratio >= 1,
 * else MOE_ERR_SHAPE / MOE_ERR_ARG naming the file and tensors (positions
 * may be anything: invisible ones select nothing). Owned by *out: free with
 * moe_idx_tensors_free; zeroed on failure. */
moe_status moe_idx_tensors_read(const moe_st_file *f, int ratio, moe_idx_tensors *out, moe_error *err);
void moe_idx_tensors_free(moe_idx_tensors *t); /* zeroed or NULL: no-op */

/* ---------------------------------------------------------- top-k recall */

/* Top-k set recall of each precision against float64 on real tensors:
 * mean and minimum over queries with more visible entries than topk (all
 * queries when none has) of |sel_p & sel_ref| / |sel_ref|. */
typedef struct moe_idx_recall {
    moe_idx_opts opts;
    double mean_recall, min_recall;
    int64_t queries;          /* queries counted */
} moe_idx_recall;

moe_status moe_idx_recall_run(const moe_idx_shape *sh, const double *q, const double *k, const double *w,
                              const int64_t *pos, int topk, const moe_idx_opts *precs, int n_prec,
                              moe_idx_recall *out, moe_error *err);

/* ------------------------------------------------------------- needle */

/* One query, S keys, and a needle entry: where the needle lands under a
 * precision. Margins are in units of `sigma` (the caller's score scale;
 * the probe uses the std of the float64 distractor scores). */
typedef struct moe_needle_result {
    bool selected;        /* rank <= topk */
    int64_t rank;         /* 1-based, ties to the lower index */
    double score;         /* the needle's score */
    double cutoff;        /* the topk-th largest score among the other entries */
    double margin;        /* (score - cutoff) / sigma; +INFINITY when n_vis <= topk */
} moe_needle_result;

/*
 * Evaluate one query against keys k [S, dim] (all visible), needle at entry
 * j, under float64 (ref) and each of `precs` [n_prec]:
 *   q [heads, dim], w [heads]; res_ref; res [n_prec].
 * Allocates its scratch (MOE_ERR_NOMEM).
 */
moe_status moe_needle_eval(int heads, int dim, int64_t S, const double *q, const double *w, const double *k,
                           int64_t j, int topk, bool hadamard, double sigma, const moe_idx_opts *precs,
                           int n_prec, moe_needle_result *res_ref, moe_needle_result *res, moe_error *err);

/* The synthetic needle sweep (docs/indexer.md describes the model). */
typedef struct moe_needle_config {
    int heads, dim, ratio;
    double margin;          /* needle's float64 score = cutoff + margin * sigma */
    int trials;             /* contexts per length (fresh seeds) */
    uint64_t seed;
    const int64_t *lens;    /* context lengths in tokens [n_lens] */
    int n_lens;
    const double *depths;   /* needle depth in [0, 1] [n_depths] (0 = oldest entry) */
    int n_depths;
    const int *topks;       /* index_topk values [n_topks] */
    int n_topks;
    const moe_idx_opts *precs; /* [n_prec] */
    int n_prec;
    double mean_scale;      /* distractor shared-mean norm relative to the noise norm (0.5) */
    double outlier_scale;   /* std of the outlier channels (8) */
    int n_outliers;         /* outlier channels per key (4) */
    double rope_theta;      /* RoPE base of the rotary half (160000); 0: no RoPE */
    int rope_dim;           /* rotary channels at the end of each vector (64) */
} moe_needle_config;

/* Defaults for V4-Flash: 64 heads x 128, ratio 4, margin 0.1, 4 trials. */
moe_needle_config moe_needle_config_default(void);

/* One cell of the sweep, aggregated over trials. prec = -1 is float64. */
typedef struct moe_needle_cell {
    int64_t len;
    double depth;
    int topk;
    int prec;               /* index into precs, or -1 for float64 */
    int trials;
    bool sparse;            /* visible entries > topk */
    double recall;          /* fraction of trials with the needle selected */
    double mean_rank, worst_rank;
    double mean_margin, min_margin; /* in sigma units; +INFINITY when not sparse */
} moe_needle_cell;

/* Number of cells: n_lens * n_depths * n_topks * (n_prec + 1). */
size_t moe_needle_cell_count(const moe_needle_config *c);

/* Run the sweep; cells [moe_needle_cell_count] in the order
 * len, depth, topk, prec (-1 first). Pure computation; allocates scratch. */
moe_status moe_needle_probe(const moe_needle_config *c, moe_needle_cell *cells, moe_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MOEAUDIT_INDEXER_H */
