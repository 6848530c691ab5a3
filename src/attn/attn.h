/*
 * The attention stage of DeepSeek-V4 (docs/model.md sections 3-6): RoPE,
 * the KV compressors (HCA and CSA), the lightning indexer from hidden
 * states, and the attention layer with its sliding window and sink.
 *
 * The stage owns no weights: the driver (src/model) fills the descriptors
 * (linears stay in their stored formats, vectors are float64 arrays it owns)
 * and keeps one moe_attn_state per layer and sequence.
 *
 * Precision: every function takes `f32`. false is the float64 reference;
 * true computes in float32 arithmetic: linears through moe_linear_f32, every
 * other operation done in double and rounded to float at once (moe_fl),
 * which for + - * / sqrt is exactly the float32 operation.
 */
#ifndef MOE_ATTN_H
#define MOE_ATTN_H

#include "moeaudit.h"
#include "moeaudit_model.h"
#include "moeaudit_patch.h"
#include "cpu/kernels.h"

#include <stdbool.h>
#include <stdint.h>

/* x rounded to float32 when f32, else x. */
static inline double moe_fl(double x, bool f32) { return f32 ? (double)(float)x : x; }

/* Y [T, ldy] = X [T, ldx] W^T through moe_linear_f64_with, or
 * moe_linear_f32_with on the float-rounded X when f32 (Y then holds float
 * values widened). kt: the CPU kernel table of the run (moe_cpu_table; NULL:
 * MOE_ISA_AUTO's); the float64 product has the same bits on every table. */
moe_status moe_attn_linear(const moe_weight *w, const double *X, int64_t ldx, int64_t T, double *Y, int64_t ldy,
                           bool f32, const moe_cpu_kernels *kt, moe_error *err);

/* A KV row x [dim] rounded as the cache stores it (moe_kv_round): the
 * leading dim - rope_dim NoPE channels and the trailing rope_dim RoPE ones. */
void moe_attn_kv_round(double *x, int dim, int rope_dim, moe_kv_round mode);

/* x [n] <- weight ⊙ x · rsqrt(mean(x²) + eps); weight NULL: unweighted. */
void moe_attn_rmsnorm(double *x, int n, const double *weight, double eps, bool f32);

/* --------------------------------------------------------------- RoPE */

/* Largest rotary dimension (stack buffers of cos/sin pairs). */
#define MOE_ATTN_MAX_ROPE 1024
/* Largest compress ratio (stack buffers of 2 * ratio slots). */
#define MOE_ATTN_MAX_RATIO 256

typedef struct moe_rope {
    int dim;               /* rotated channels (even) */
    double *inv_freq;      /* [dim / 2] */
    double attn_factor;
} moe_rope;

/* inv_freq of c (plain or YaRN, float64). MOE_ERR_NOMEM / MOE_ERR_CONFIG. */
moe_status moe_rope_init(moe_rope *r, const moe_rope_config *c, int dim, moe_error *err);
void moe_rope_free(moe_rope *r);
/* cs [dim]: (cos, sin) of each pair at position pos, times attn_factor. */
void moe_rope_angles(const moe_rope *r, int64_t pos, double *cs, bool f32);
/* Rotate the interleaved pairs of x [dim] by cs (inverse: by the conjugate). */
void moe_rope_rotate(const double *cs, double *x, int dim, bool inverse, bool f32);

/* --------------------------------------------------------- compressor */

/* Learned gated pooling of `ratio` tokens into one entry of `dim` channels.
 * overlap (CSA): projections of 2 * dim channels; entry w pools the first
 * half of window w-1 with the second half of window w over 2 * ratio slots. */
typedef struct moe_compressor_w {
    int ratio, dim;
    bool overlap;
    moe_weight wkv, wgate;      /* [(1 + overlap) * dim, H] */
    const double *ape;          /* [ratio, (1 + overlap) * dim] position bias of the gate */
    const double *norm;         /* [dim] RMSNorm weight */
    double rms_eps;
    const moe_rope *rope;       /* rotation at the window's first position */
} moe_compressor_w;

typedef struct moe_compressor_state {
    int64_t n_buf;              /* tokens of the open window (< ratio) */
    double *buf_kv, *buf_gate;  /* [ratio, (1 + overlap) * dim] raw projections of the open window */
    bool has_prev;              /* overlap: the previous window's first halves are kept */
    double *prev_kv, *prev_gate;/* [ratio, dim] (gate with ape added) */
    int64_t n_entries, cap;
    double *entries;            /* [n_entries, dim] compressed, normed, rotated */
} moe_compressor_state;

moe_status moe_compressor_state_init(moe_compressor_state *s, const moe_compressor_w *w, moe_error *err);
void moe_compressor_state_free(moe_compressor_state *s);
/* dst (uninitialised) <- a deep copy of src. MOE_ERR_NOMEM. */
moe_status moe_compressor_state_copy(moe_compressor_state *dst, const moe_compressor_state *src,
                                     const moe_compressor_w *w, moe_error *err);
/* Feed S more tokens x [S, H] (hidden states, the attention's input): emits
 * an entry for every window they complete. state_bf16: the open window's
 * projections and the overlap halves are stored in bf16 (a patch); entry:
 * how each emitted entry is stored (the main compressor's share of the KV
 * cache; MOE_KV_EXACT for the indexer's). */
moe_status moe_compressor_feed(const moe_compressor_w *w, moe_compressor_state *s, const double *x, int64_t S,
                               bool f32, const moe_cpu_kernels *kt, bool state_bf16, moe_kv_round entry,
                               moe_error *err);

/* ------------------------------------------------------ attention layer */

typedef struct moe_attn_w {
    moe_attn_type type;
    int ratio;                  /* 0 on sliding layers */
    int hidden, heads, head_dim, rope_dim, q_lora, o_groups, o_lora, window;
    double rms_eps;
    moe_weight wq_a;            /* [q_lora, H] */
    moe_weight wq_b;            /* [heads * head_dim, q_lora] */
    moe_weight wkv;             /* [head_dim, H] */
    const moe_weight *wo_a;     /* [o_groups] each [o_lora, heads * head_dim / o_groups]: group g's rows */
    moe_weight wo_b;            /* [H, o_groups * o_lora] */
    const double *q_norm;       /* [q_lora] */
    const double *kv_norm;      /* [head_dim] */
    const double *sink;         /* [heads] */
    const moe_rope *rope;       /* main (sliding) or compress (CSA/HCA) */
    moe_compressor_w comp;      /* CSA / HCA */
    /* CSA: the lightning indexer */
    int index_heads, index_dim, index_topk;
    moe_weight idx_wq_b;        /* [index_heads * index_dim, q_lora] */
    moe_weight idx_wproj;       /* [index_heads, H] */
    moe_compressor_w idx_comp;  /* overlapping, at index_dim */
} moe_attn_w;

typedef struct moe_attn_state {
    int64_t pos;                /* tokens seen */
    int64_t n_win;              /* kept KV rows (<= window - 1) */
    double *win_kv;             /* [window - 1, head_dim], oldest first */
    moe_compressor_state comp, idx_comp;
} moe_attn_state;

moe_status moe_attn_state_init(moe_attn_state *s, const moe_attn_w *w, moe_error *err);
void moe_attn_state_free(moe_attn_state *s);

/* Entries the attention of a query at position p reads: window rows and
 * compressed entries (HCA: all visible; CSA: the indexer's picks). */
typedef struct moe_attn_stats {
    int64_t window_rows;        /* summed over the chunk's queries */
    int64_t compressed_rows;
    int64_t entries;            /* compressed entries after the chunk */
} moe_attn_stats;

/* An optional replacement of the indexer's picks (moe_fwd_index_fn's contract). */
typedef struct moe_attn_pick {
    moe_fwd_index_fn fn;
    void *ctx;
    int layer;
} moe_attn_pick;

/* Positions whose indexer scores and attention weights the caller wants
 * (moe_fwd_opts.probe): the callbacks run after each block of queries, one
 * probed position at a time, outside any parallel region. */
typedef struct moe_attn_probe {
    const int64_t *pos;         /* [n] positions (any order) */
    int n;
    void *ctx;
    /* scores [n_visible]: the indexer's score of every visible entry (CSA) */
    moe_status (*index_scores)(void *ctx, int64_t pos, const double *scores, int64_t n_visible, moe_error *err);
    /* p [heads, n_keys]: each key's weight in the output; keys as moe_fwd_tensor.keys */
    moe_status (*probs)(void *ctx, int64_t pos, const double *p, const int64_t *keys, int64_t n_keys,
                        moe_error *err);
} moe_attn_probe;

/* index_topk under a patch: the patch's when it sets one, else the layer's. */
static inline int moe_attn_topk(const moe_attn_w *w, const moe_attn_patch *ap) {
    return w->type != MOE_ATTN_CSA ? 0 : ap && ap->index_topk > 0 ? ap->index_topk : w->index_topk;
}

/*
 * The attention block on the next S tokens of the sequence.
 *   x     [S, H]: the block's normed input (attn_norm of the mHC collapse)
 *   f32   float32 arithmetic (else float64)
 *   kt    the CPU kernel table of the run's linears and GEMMs (NULL: the
 *         MOE_ISA_AUTO table); float64 results have the same bits on every
 *         table, float32 ones are the table's
 *   ap    the layer's patch for this chunk (moeaudit_patch.h), or NULL: none
 *   out   [S, H]
 *   topk  [S, moe_attn_topk(w, ap)] int32 (CSA; -1 where fewer entries are
 *         visible) or NULL: the picks the attention used
 *   pick  NULL, or a replacement of the picks (validated: MOE_ERR_INPUT)
 *   probe NULL, or positions to report
 * Queries run in blocks of 64 tokens, threaded over tokens; each output row
 * is a fixed sequence of operations (thread count and chunking change no bit
 * of the per-query arithmetic; only the KV rows it reads come from the
 * cache or the chunk).
 */
moe_status moe_attn_forward(const moe_attn_w *w, moe_attn_state *s, const double *x, int64_t S, bool f32,
                            const moe_cpu_kernels *kt, const moe_attn_patch *ap, const moe_attn_pick *pick,
                            const moe_attn_probe *probe, double *out, int32_t *topk, moe_attn_stats *stats,
                            moe_error *err);

/* A deep copy of src (same layer w) into dst. MOE_ERR_NOMEM. */
moe_status moe_attn_state_copy(moe_attn_state *dst, const moe_attn_state *src, const moe_attn_w *w, moe_error *err);

#endif
