/*
 * moeaudit_model.h: the whole DeepSeek-V4 model, exactly: embedding, the mHC
 * streams around every layer's attention and MoE blocks, the attention
 * (sliding window, CSA with the lightning indexer, HCA), the final hc head,
 * norm and LM head; prefill and decode in chunks with the caches carried
 * (docs/model.md is the math, step by step, with the shapes).
 *
 * Worked example: the float64 forward of T tokens, every tensor streamed.
 *
 *     moe_fwd *f = NULL;
 *     if (moe_fwd_open("tests/data/dsv4-tiny", &f, &err) != MOE_OK) { ... }
 *     moe_fwd_opts o = moe_fwd_opts_default(f);   // every layer, logits, float64
 *     o.sink = my_sink;                           // receives each tensor's rows
 *     o.sink_ctx = my_ctx;
 *     moe_fwd_state *s = NULL;
 *     if (moe_fwd_state_init(f, &o, &s, &err) != MOE_OK) { ... }
 *     // one shot:   moe_fwd_run(f, s, ids, T, NULL, &err)
 *     // or chunked: moe_fwd_run(f, s, ids, 4096, ...); moe_fwd_run(f, s, ids + 4096, 1, ...); ...
 *     moe_fwd_state_free(s);
 *     moe_fwd_free(f);
 *
 * Memory: the weights stay mapped in their stored formats (BF16, FP8 128x128
 * with E8M0 or fp32 scales, MXFP4, NVFP4) and are decoded row by row inside
 * the linears; a layer's small float parameters (norms, mHC, sinks, ape) are
 * widened to double while the layer runs and freed after it. A chunk of S
 * tokens holds the streams [S, hc_mult, H] twice, one layer's activations
 * (attention queries in blocks of at most 64 tokens) and the caches: per
 * layer window - 1 KV rows, the compressed entries (S_total / ratio rows of
 * head_dim, and of index_head_dim on CSA layers) and the partial windows.
 * Every output is handed to the caller's sink as it is produced; nothing
 * accumulates across layers.
 */
#ifndef MOEAUDIT_MODEL_H
#define MOEAUDIT_MODEL_H

#include "moeaudit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Attention of one layer, from its compress ratio. */
typedef enum moe_attn_type {
    MOE_ATTN_SLIDING, /* ratio 0: the sliding window alone (main RoPE) */
    MOE_ATTN_CSA,     /* compressed sparse: overlapping windows + lightning indexer top-k */
    MOE_ATTN_HCA      /* heavily compressed: non-overlapping windows, every visible entry */
} moe_attn_type;

/* "sliding", "csa", "hca". */
const char *moe_attn_type_name(moe_attn_type t);

/* One rotary embedding: interleaved pairs on the trailing rope_dim channels. */
typedef struct moe_rope_config {
    double theta;           /* base */
    bool yarn;              /* YaRN frequency interpolation */
    double factor;          /* YaRN scale factor */
    double original_max_pos;/* YaRN original_max_position_embeddings */
    double beta_fast, beta_slow;
    bool truncate;          /* YaRN: floor/ceil the correction range (transformers' default) */
    double attention_factor;/* multiplies cos and sin (1 unless the config asks otherwise) */
} moe_rope_config;

/* The model's shape, from config.json in either schema (transformers:
 * layer_types, compress_rates, mlp_layer_types, rope_parameters; DeepSeek:
 * compress_ratios, num_hash_layers / n_hash_layers, rope_scaling,
 * compress_rope_theta). */
typedef struct moe_fwd_config {
    int hidden, vocab, n_layers;
    int heads, head_dim, rope_dim;      /* rope_dim: trailing RoPE channels of each head */
    int q_lora_rank, o_groups, o_lora_rank;
    int window;                         /* sliding_window */
    int index_heads, index_dim, index_topk;
    int hc_mult, hc_iters;
    double hc_eps, rms_eps;
    int n_mtp;                          /* MTP blocks in the checkpoint (0 or 1: mtp.0.e_proj found) */
    const int *ratio;                   /* [n_layers + n_mtp] compress ratio (0 = sliding) */
    const moe_attn_type *attn;          /* [n_layers + n_mtp] */
    moe_rope_config rope_main;          /* sliding layers */
    moe_rope_config rope_compress;      /* CSA/HCA layers, their compressors and indexer */
    bool native_schema;                 /* config in DeepSeek's schema (compress_ratios) */
} moe_fwd_config;

/* A model opened for the forward pass. */
typedef struct moe_fwd moe_fwd;

/* Open a checkpoint directory for the forward: reads config.json (both
 * schemas), checks that the per-layer fields agree with num_hidden_layers
 * and with each other, and finds the root tensors (embedding, head, final
 * norm, hc head) in either naming (DeepSeek's, with or without "model.", or
 * transformers' embed_tokens / lm_head / hc_head.hc_fn). Layer weights are
 * looked up when a layer first runs. MOE_ERR_CONFIG names the key at fault,
 * MOE_ERR_MISSING / SHAPE / DTYPE the tensor. *out is caller-owned. */
moe_status moe_fwd_open(const char *dir, moe_fwd **out, moe_error *err);
/* The same over a model already open (moe_model_open_mem: a checkpoint held
 * in memory). Takes ownership of m: freed with the forward, or on failure. */
moe_status moe_fwd_open_model(moe_model *m, moe_fwd **out, moe_error *err);
void moe_fwd_free(moe_fwd *f); /* NULL is a no-op */
const moe_fwd_config *moe_fwd_get_config(const moe_fwd *f);
/* The MoE model underneath (routers, experts), owned by f. */
moe_model *moe_fwd_model(moe_fwd *f);

/* What a streamed tensor is. Shapes per row. */
typedef enum moe_fwd_what {
    MOE_FWD_IN,         /* streams entering the layer       [hc_mult, H] */
    MOE_FWD_ATTN_IN,    /* attention block's normed input  [H] */
    MOE_FWD_ATTN_OUT,   /* attention block's output        [H] */
    MOE_FWD_FFN_IN,     /* MoE block's normed input        [H] */
    MOE_FWD_FFN_OUT,    /* MoE block's output              [H] */
    MOE_FWD_OUT,        /* streams leaving the layer       [hc_mult, H] */
    MOE_FWD_INDEX_TOPK, /* CSA: compressed entries kept    [index_topk] int32, -1 pads (a patched
                           index_topk changes the row length) */
    MOE_FWD_LOGITS,     /* the LM head                     [vocab] */
    /* Probed positions only (moe_fwd_opts.probe), one row per position: */
    MOE_FWD_INDEX_SCORES, /* CSA: the indexer's score of every visible entry [visible] (the
                             precision the run's patches give; the picks are the top index_topk) */
    MOE_FWD_ATTN_PROBS    /* the weight of every key the query read [heads, n_keys]: window rows
                             and compressed entries, as its output used them (the sink's share is
                             1 minus their sum); keys in moe_fwd_tensor.keys */
} moe_fwd_what;

/* "in", "attn.in", "attn.out", "ffn.in", "ffn.out", "out", "index_topk", "logits",
 * "index_scores", "attn_probs". */
const char *moe_fwd_what_name(moe_fwd_what w);

/* Rows of one tensor: positions row0 .. row0 + rows - 1 of the sequence. */
typedef struct moe_fwd_tensor {
    int layer;              /* 0 .. n_layers-1; n_layers for the MTP block (its logits too); -1: the main logits */
    moe_fwd_what what;
    int64_t row0, rows;
    int64_t row_elems;      /* elements of one row */
    const double *data;     /* [rows, row_elems]; float32 runs hold float values widened */
    const int32_t *idata;   /* MOE_FWD_INDEX_TOPK only */
    const int64_t *keys;    /* MOE_FWD_ATTN_PROBS only: [n_keys]; k >= 0 is the window row of
                               position k, k < 0 the compressed entry -1 - k */
    int64_t n_keys;
} moe_fwd_tensor;

/* Receives every tensor as it is produced; the pointers are valid only
 * during the call. A status other than MOE_OK stops the run with it. */
typedef moe_status (*moe_fwd_sink)(void *ctx, const moe_fwd_tensor *t, moe_error *err);

/* The MoE block of a layer, replaceable (expert parallelism): x [T, H] the
 * normed input, ids [T] token ids, out [T, H] the block's output. Must give
 * moe_block_run's moe_out. L->index is the layer (n_layers + k for MTP
 * block k); with moe_fwd_opts.moe_external_experts, L holds no routed
 * expert (its w1/w3/w2 have rows = 0) and the function brings its own. */
typedef moe_status (*moe_fwd_moe_fn)(void *ctx, const moe_layer *L, const double *x, const int64_t *ids,
                                     int64_t T, const moe_run_opts *o, double *out, moe_error *err);

/* Replaces the lightning indexer's picks on a CSA layer before the attention
 * reads them (to replay another engine's choices, or an oracle's where
 * scores tie). sel [rows, topk] (positions row0 ..) holds ours on entry; each
 * slot written must be -1 or an entry visible to its query (j < (p+1)/ratio)
 * with no entry twice, else the run stops with MOE_ERR_INPUT naming it. The
 * picks used are what MOE_FWD_INDEX_TOPK streams. */
typedef moe_status (*moe_fwd_index_fn)(void *ctx, int layer, int64_t row0, int64_t rows, int topk, int32_t *sel,
                                       moe_error *err);

/* A deployment's precision patches (moeaudit_patch.h). */
typedef struct moe_patch_set moe_patch_set;

/* The phase of the chunks a state runs: a serving engine's prefill, or its
 * decode steps (patches can apply to one of them: moeaudit_patch.h). */
typedef enum moe_phase {
    MOE_PHASE_PREFILL = 1,
    MOE_PHASE_DECODE = 2,
    MOE_PHASE_ALL = 3       /* patches only: both */
} moe_phase;

/* "prefill", "decode", "all" (defined in src/patch/patch.c). */
const char *moe_phase_name(moe_phase p);

typedef struct moe_fwd_opts {
    moe_precision precision;    /* REF: float64; F32: float32 arithmetic (linears through
                                   moe_linear_f32, the f32 MoE path, mHC in fp32) */
    int first_layer;            /* tensors of layers [first_layer, last_layer] go to the sink */
    int last_layer;             /* layers 0 .. last_layer run (from first_layer with start streams) */
    bool logits;                /* run the head (needs last_layer = n_layers - 1) */
    bool mtp;                   /* run MTP block 0 after the last layer: row t mixes the last
                                   streams at t with the embedding of token t + 1 (so a chunk's
                                   last position runs with the next chunk); its tensors and
                                   logits stream as layer n_layers (docs/model.md section 2b) */
    moe_fwd_sink sink;          /* may be NULL */
    void *sink_ctx;
    moe_fwd_moe_fn moe;         /* NULL: moe_block_run */
    void *moe_ctx;
    bool moe_external_experts;  /* needs moe: the driver loads each MoE block without its routed
                                   experts (router, bias, tid2eid, shared expert; no routed
                                   expert tensor is looked up, mapped or checked) and moe brings
                                   them (expert parallelism: each process maps only its share) */
    moe_fwd_index_fn index;     /* NULL: the indexer's own picks */
    void *index_ctx;
    moe_patch_set *patch;       /* NULL: none. Every stage reads its component of the
                                   patches enabled by patch_mask; the set caches the
                                   quantized MoE layers it needs (one forward at a time) */
    uint64_t patch_mask;        /* bit i enables the set's patch i (MOE_PATCH_ALL: all) */
    const int64_t *probe;       /* [n_probe] positions whose MOE_FWD_INDEX_SCORES and
                                   MOE_FWD_ATTN_PROBS rows go to the sink (NULL: none) */
    int n_probe;
    moe_isa isa;                /* CPU kernels of every linear, attention GEMM and MoE block
                                   (MOE_ISA_AUTO: the best; moe_fwd_state_init refuses one this
                                   CPU lacks). float64 results have the same bits on every ISA;
                                   float32 results are the ISA's */
} moe_fwd_opts;

/* Every layer, logits, float64, no sink. */
moe_fwd_opts moe_fwd_opts_default(const moe_fwd *f);

/* The caches of one sequence: per layer the last window - 1 KV rows, the
 * compressors' partial windows and CSA overlap halves, the compressed
 * entries; the position. Caller-owned; opts are copied. MOE_ERR_ARG for a
 * layer range outside the model (naming it), logits or MTP without the last
 * layer, moe_external_experts without moe; MOE_ERR_MISSING for MTP without
 * an MTP block. */
typedef struct moe_fwd_state moe_fwd_state;
moe_status moe_fwd_state_init(const moe_fwd *f, const moe_fwd_opts *o, moe_fwd_state **out, moe_error *err);
void moe_fwd_state_free(moe_fwd_state *s); /* NULL is a no-op */
/* Tokens processed so far (the next chunk's first position). */
int64_t moe_fwd_state_pos(const moe_fwd_state *s);

/* The phase of the chunks run from now on (a new state: MOE_PHASE_PREFILL);
 * patches whose phase excludes it do not apply to them. MOE_PHASE_ALL is
 * not a chunk's phase (MOE_ASSERT). */
void moe_fwd_state_set_phase(moe_fwd_state *s, moe_phase p);

/* A copy of src's caches and position (the KV windows, compressor windows
 * and entries, MTP pending row) under new options o, to continue the same
 * sequence another way (a prefix run once, then decode steps under several
 * patch sets). o must name the same layer range, MTP and start mode as
 * src's options (else MOE_ERR_ARG); its patch, probes and sink are free.
 * MOE_ERR_ARG when src failed earlier. *out is caller-owned. */
moe_status moe_fwd_state_clone(const moe_fwd_state *src, const moe_fwd_opts *o, moe_fwd_state **out,
                               moe_error *err);

/*
 * Run the next T tokens of the sequence (positions pos .. pos + T - 1).
 *   ids      int64 [T], each in [0, vocab) (else MOE_ERR_INPUT naming the token)
 *   streams  double [T, hc_mult, H] entering opts.first_layer (the tokens'
 *            hidden streams as another engine dumped them), or NULL: embed
 *            ids and start at layer 0
 * The first call loads and checks every layer it will run (a missing or
 * misshapen tensor fails before anything is computed: MOE_ERR_MISSING /
 * SHAPE / DTYPE naming it). T = 0 is MOE_ERR_INPUT. In float64 any split of
 * a sequence into chunks
 * gives the one-shot outputs to rounding. On error the state is unusable
 * (free it). Thread safety: one state per thread; a moe_fwd may be shared by
 * states run one at a time (layers load on first use).
 */
moe_status moe_fwd_run(moe_fwd *f, moe_fwd_state *s, const int64_t *ids, int64_t T, const double *streams,
                       moe_error *err);

/* ------------------------------------------ the forward's input files */

/* What `forward --input` holds: the token ids, and optionally the streams
 * entering the first layer run (another engine's dump of them). */
typedef struct moe_fwd_input {
    int64_t T;          /* tokens, >= 1 */
    int64_t *ids;       /* [T], each in [0, vocab) */
    double *streams;    /* [T, hc_mult, hidden] (tensor layers.{first_layer}.in), or NULL: start from the
                           embedding */
} moe_fwd_input;

/*
 * Read a forward's input from f: tensor input_ids [T] (I32 or I64, T >= 1,
 * every id in [0, c->vocab)) and, when first_layer > 0 and f holds it,
 * layers.{first_layer}.in [T, c->hc_mult, c->hidden] of a float dtype,
 * widened to double as stored (NaN and Inf included: the forward propagates
 * them per token). f may hold any other tensors (a forward's own output does).
 * Errors name the file, the tensor and the value: MOE_ERR_MISSING (no
 * input_ids), MOE_ERR_DTYPE, MOE_ERR_SHAPE, MOE_ERR_INPUT (0 tokens, an id
 * outside the vocabulary), MOE_ERR_NOMEM. *in is owned by the caller (free
 * with moe_fwd_input_free), zeroed on failure. Thread safety: f and c are
 * only read.
 */
moe_status moe_fwd_input_read(const moe_st_file *f, const moe_fwd_config *c, int first_layer, moe_fwd_input *in,
                              moe_error *err);
void moe_fwd_input_free(moe_fwd_input *in); /* zeroed or NULL: no-op */

/* Another engine's indexer picks to replay (`forward --replay-index`): the
 * tensors layers.{l}.index_topk [T, K] of a file, as a moe_fwd_index_fn. */
typedef struct moe_fwd_replay {
    const moe_st_file *f;   /* borrowed: outlives the replay */
    int64_t T;              /* rows of every index_topk tensor: the run's tokens */
} moe_fwd_replay;

/*
 * Check every tensor of f named layers.{l}.index_topk (other tensors are
 * ignored) against config c and a run of T tokens, before anything runs:
 * l names a CSA layer of c (0 .. n_layers + n_mtp - 1; other layers have no
 * indexer picks to replace), the tensor is an integer tensor [T, K] with
 * K >= 1, and in row p (position p) each entry is -1 or a compressed entry
 * visible to p (0 <= j < (p + 1) / ratio of layer l) and no entry appears
 * twice. MOE_ERR_INPUT (a layer that is not CSA, a value), MOE_ERR_DTYPE,
 * MOE_ERR_SHAPE, MOE_ERR_NOMEM, naming the file, tensor, row and value. *r
 * borrows f (it must outlive r); nothing to free.
 * Thread safety: f and c are only read.
 */
moe_status moe_fwd_replay_init(const moe_st_file *f, const moe_fwd_config *c, int64_t T, moe_fwd_replay *r,
                               moe_error *err);
/* The moe_fwd_index_fn of a checked replay (ctx: its moe_fwd_replay): rows
 * row0 .. row0 + rows - 1 of layer's tensor into sel [rows, topk]; a layer
 * with no tensor keeps the indexer's own picks. MOE_ERR_SHAPE when the
 * tensor's K differs from the run's topk, MOE_ERR_INPUT when the rows
 * exceed T. Reads only: concurrent calls are safe. */
moe_status moe_fwd_replay_pick(void *ctx, int layer, int64_t row0, int64_t rows, int topk, int32_t *sel,
                               moe_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MOEAUDIT_MODEL_H */
