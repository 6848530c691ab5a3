/*
 * moeaudit_patch.h: a deployment's precision patches as data. One table of
 * named toggles, each a component of the model and a rounding of it
 * (docs/bisect.md lists them with their sources); a patch set is parsed from
 * a list such as "mhc-bf16,index-keys-fp8@3..,attn-bf16" and passed in the
 * forward's options, where every stage reads its own component: the mHC
 * linear (src/hc), the KV cache, attention arithmetic, compressor state and
 * the lightning indexer (src/attn, src/indexer), the MoE block's weights,
 * activations, router and contract faults (src/experts through
 * moe_block_run_variant). Nothing is global: the set is read, never kept.
 *
 *     moe_patch_set *ps = NULL;
 *     if (moe_patch_set_parse("mhc-bf16,kv-fp8,experts-mxfp4", moe_fwd_get_config(f), &ps, &err) != MOE_OK) ...
 *     moe_fwd_opts o = moe_fwd_opts_default(f);
 *     o.patch = ps;                       // every patch of the set ...
 *     o.patch_mask = MOE_PATCH_ALL;       // ... or a subset: bit i enables patch i
 *     ... moe_fwd_state_init / moe_fwd_run as usual ...
 *     moe_patch_set_free(ps);
 *
 * `moeaudit audit` reads the same table: its MoE paths are patch lists
 * (moe_audit_path.patches), so a row it grades can be bisected by name.
 *
 * Grammar of one patch: NAME[=VALUE][@LAYERS][:PHASE]
 *   LAYERS  A, A..B or A.. (inclusive; default: every layer of the model)
 *   PHASE   all | prefill | decode (default: the table's; attn-bf16 models a
 *           decode kernel and defaults to decode, every other patch to all)
 */
#ifndef MOEAUDIT_PATCH_H
#define MOEAUDIT_PATCH_H

#include "moeaudit.h"
#include "moeaudit_variant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The components a patch can set. One value per component and layer in a
 * set: two patches giving one component different values on a common layer
 * and phase are a conflict (MOE_ERR_ARG). */
typedef enum moe_patch_comp {
    MOE_PC_HC,          /* mHC linear of both sublayers: moe_hc_prec */
    MOE_PC_INDEX_Q,     /* indexer query rounding: moe_idx_quant */
    MOE_PC_INDEX_K,     /* indexer key rounding: moe_idx_quant */
    MOE_PC_INDEX_ACC,   /* indexer dot / head-sum accumulation: moe_idx_accum */
    MOE_PC_INDEX_ROT,   /* Hadamard rotation of q and k: 1 on (the engines' default), 0 off */
    MOE_PC_INDEX_TOPK,  /* index_topk: entries the indexer keeps */
    MOE_PC_KV,          /* KV cache rows and compressed entries as stored: moe_kv_round */
    MOE_PC_ATTN,        /* attention score / softmax / PV arithmetic: moe_attn_arith */
    MOE_PC_COMPRESS,    /* compressor state (open window, overlap halves): 1 = bf16 */
    MOE_PC_EXPERTS,     /* routed experts' weights: index into the expert-format list */
    MOE_PC_SHARED,      /* shared expert's weights: moe_qfmt */
    MOE_PC_ACT,         /* expert GEMM activations: moe_act_prec */
    MOE_PC_ROUTER,      /* router GEMM: moe_router_prec */
    MOE_PC_FAULT,       /* a contract fault of the MoE block: moe_fault */
    MOE_PC_COUNT
} moe_patch_comp;

/* "hc", "index-q", "index-keys", ... */
const char *moe_patch_comp_name(moe_patch_comp c);

/* ------------------------------------------- per-stage settings of a layer */

/* How KV cache rows (the sliding window's and the main compressor's
 * entries) are stored before the attention reads them. */
typedef enum moe_kv_round {
    MOE_KV_EXACT,   /* the path's precision */
    MOE_KV_BF16,    /* every channel bf16 (a bf16 cache) */
    MOE_KV_FP8      /* FlashMLA's V4 cache: the head_dim - rope_dim NoPE channels E4M3 in tiles
                       of 64 with power-of-two (ue8m0) scales, amax floored at 1e-4, from their
                       bf16 values; the rope_dim RoPE channels bf16 */
} moe_kv_round;

/* Attention arithmetic of one query. */
typedef enum moe_attn_arith {
    MOE_ATTN_ARITH_PATH, /* the path's (float64 or float32) */
    MOE_ATTN_ARITH_BF16  /* a bf16 MMA kernel: q and keys bf16, scores accumulated in fp32 and
                            scaled in fp32, fp32 softmax (sink in the denominator), the
                            probabilities rounded to bf16 for the PV product (fp32
                            accumulation), fp32 normalisation, output rounded to bf16 */
} moe_attn_arith;

/* What the attention stage (src/attn) reads from a layer's patch. */
typedef struct moe_attn_patch {
    moe_kv_round kv;
    moe_attn_arith arith;
    bool compress_bf16;      /* compressors' open-window and overlap projections stored in bf16 */
    bool index_engine;       /* some indexer patch applies: scores through moe_idx_scores(idx) */
    moe_idx_opts idx;        /* q / k rounding, accumulation, rotation (when index_engine) */
    int index_topk;          /* > 0: replaces the config's index_topk */
} moe_attn_patch;

/* What the MoE block reads from a layer's patch. */
typedef struct moe_moe_patch {
    moe_qfmt experts;        /* routed experts re-quantized (MOE_Q_NONE: as stored) */
    int e2m1_round;          /* moe_e2m1_round of the FP4 encoders */
    int mx_scale_rule;       /* moe_mx_scale_rule */
    moe_qfmt shared;         /* shared expert re-quantized (MOE_Q_NONE or MOE_Q_FP8) */
    moe_act_prec act;
    moe_router_prec router;
    moe_fault fault;
} moe_moe_patch;

/* Everything a layer's stages read, for one phase. */
typedef struct moe_layer_patch {
    bool hc_set;             /* the mHC linear's precision is patched ... */
    moe_hc_prec hc;          /* ... to this one */
    moe_attn_patch attn;
    moe_moe_patch moe;
    bool moe_set;            /* some MoE patch applies (moe differs from the defaults) */
} moe_layer_patch;

/* The settings of an unpatched layer (the path's own precision everywhere). */
moe_layer_patch moe_layer_patch_none(void);

/* ------------------------------------------------------------ the table */

/* One named toggle. A patch sets up to three components (index-qk-fp8-norot
 * sets the query's and key's rounding and the rotation). */
typedef struct moe_patch_info {
    const char *name;        /* e.g. "index-keys-fp8"; "index-topk" takes =N */
    int n_set;
    moe_patch_comp comp[3];
    int value[3];
    moe_phase phase;         /* default phase */
    bool takes_value;        /* NAME=N */
    const char *what;        /* what it models and which engine does it (one line) */
} moe_patch_info;

/* The table: moe_patch_info entries [moe_patch_table_size()], in a fixed order. */
int moe_patch_table_size(void);
const moe_patch_info *moe_patch_table_at(int i);
/* The entry named `name` (without =VALUE, @ or :), or NULL. */
const moe_patch_info *moe_patch_find(const char *name);

/* ------------------------------------------------------------ a set */

/* At most this many patches in one set (a run enables a subset by mask). */
#define MOE_PATCH_MAX 48
#define MOE_PATCH_ALL (~(uint64_t)0)

typedef struct moe_patch {
    const moe_patch_info *info;
    int value;               /* NAME=N's N (index-topk), else 0 */
    int first, last;         /* layers, inclusive */
    moe_phase phase;
    int first_changed;       /* first layer whose computation the patch changes
                                (index patches: the first CSA layer of the range, ...) */
    char text[96];           /* as written, canonical: "index-keys-fp8@3..5:decode" */
} moe_patch;

typedef struct moe_patch_set moe_patch_set;

/*
 * Parse a comma-separated list of patches. cfg: the model the set will run
 * on (layer ranges checked against it, index patches need a CSA layer in
 * their range, compressor patches a compressed layer), or NULL for a set
 * without layer ranges that only the MoE block reads (the audit's paths).
 * MOE_ERR_ARG names the patch at fault: unknown name (with the closest
 * names), bad value, layer range, phase, a patch that changes nothing on
 * this model, two patches in conflict, more than MOE_PATCH_MAX, a fault the
 * model cannot carry (shared-weight without a shared expert). *out is
 * caller-owned.
 */
moe_status moe_patch_set_parse(const char *list, const moe_fwd_config *cfg, moe_patch_set **out, moe_error *err);
void moe_patch_set_free(moe_patch_set *s); /* NULL is a no-op; frees the quantized layers it cached */
int moe_patch_set_count(const moe_patch_set *s);
const moe_patch *moe_patch_set_at(const moe_patch_set *s, int i);

/*
 * The settings of layer `layer` in `phase` with the patches of `mask` (bit i:
 * patch i) enabled: into *out. s NULL: moe_layer_patch_none(). Pure.
 */
void moe_patch_layer(const moe_patch_set *s, uint64_t mask, int layer, moe_phase phase, moe_layer_patch *out);

/* The first layer that the enabled patches change in any of `phases`, or
 * INT32_MAX when they change none. */
int moe_patch_first_changed(const moe_patch_set *s, uint64_t mask, moe_phase phases);
/* True when some enabled patch applies in `phase`. */
bool moe_patch_any_in(const moe_patch_set *s, uint64_t mask, moe_phase phase);

/* Check that the MoE patches of the set can be applied to layer L (the
 * expert formats' block sizes against its shapes, a shared expert for
 * shared-fp8 / shared-weight). MOE_ERR_SHAPE / MOE_ERR_ARG name the patch,
 * layer and tensor. */
moe_status moe_patch_check_layer(const moe_patch_set *s, const moe_layer *L, moe_error *err);

/*
 * The MoE block of layer L under the MoE settings mp (a layer's
 * moe_layer_patch.moe), through moe_block_run_variant: weights re-quantized
 * in memory by moe_layer_quantize (a copy per layer and format, cached in the
 * set until it is freed), o's activations and router replaced by mp's, mp's
 * fault as the variant. x [T, H], ids [T], out [T, H]: the block's moe_out.
 * Not thread-safe on one set (the cache).
 */
moe_status moe_patch_moe_run(moe_patch_set *s, const moe_layer *L, const moe_moe_patch *mp, const double *x,
                             const int64_t *ids, int64_t T, const moe_run_opts *o, double *out, moe_error *err);

/* The set's patches of `mask` as a comma-separated list of their texts into
 * buf [cap] ("" when none). Returns buf. */
char *moe_patch_set_text(const moe_patch_set *s, uint64_t mask, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* MOEAUDIT_PATCH_H */
