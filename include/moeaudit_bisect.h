/*
 * moeaudit_bisect.h: which of a deployment's precision patches loses the
 * needle. The float64 forward runs once (the reference); then every patch
 * alone, all together (the deployment) and all but one (leave-one-out), each
 * as the engines run a request: a prefill, then decode steps, the needle
 * retrieved by the query's step. Each run is measured where retrieval
 * happens (per CSA layer: are the needle's compressed entries in the query's
 * top-k, their rank and margin; per layer: the attention weight on the keys
 * holding the needle, the stream error) and at the output (KL divergence of
 * the next-token distribution, top-1, the answer's log-probability), graded,
 * and summed up in one sentence (docs/bisect.md).
 *
 *     moe_bisect *b = NULL;
 *     moe_bisect_spec sp = moe_bisect_spec_default();
 *     sp.ids = ids; sp.n_ids = T;                  // the prompt; its last token is the query
 *     sp.needle_start = 1200; sp.needle_end = 1208;
 *     sp.answer = ans; sp.n_answer = 4;            // optional
 *     sp.patches = "mhc-bf16,index-keys-fp8,kv-fp8,attn-bf16";
 *     if (moe_bisect_init(fwd, &sp, &b, &err) != MOE_OK) ...
 *     moe_bisect_reference(b, &err);               // float64, once
 *     for (int i = 0; i < moe_bisect_n_runs(b); i++)
 *         moe_bisect_run(b, i, &results[i], &err); // any order, any process
 *     moe_bisect_report *rep = NULL;
 *     moe_bisect_conclude(b, results, &rep, &err); // grades, verdict (may run one more)
 *     moe_bisect_report_json(stdout, rep);
 *
 * Determinism: every number is a function of the checkpoint, the spec and
 * the patch list; thread counts and the split of runs over processes change
 * no bit of any result or report.
 */
#ifndef MOEAUDIT_BISECT_H
#define MOEAUDIT_BISECT_H

#include "moeaudit.h"
#include "moeaudit_patch.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Layers a report describes at most (V4-Pro has 61). */
#define MOE_BISECT_MAX_LAYERS 128

typedef struct moe_bisect_spec {
    const int64_t *ids;          /* [n_ids] the prompt; its last position is the query */
    int64_t n_ids;
    int64_t needle_start;        /* the needle span [needle_start, needle_end) of the prompt */
    int64_t needle_end;
    const int64_t *answer;       /* [n_answer] the expected continuation, teacher-forced after the
                                    query (NULL: none) */
    int n_answer;
    const int64_t *chunks;       /* [n_chunks] prefill chunk sizes (the last repeats); NULL: one chunk */
    int n_chunks;
    bool query_in_prefill;       /* the query is the prefill's last position (the first token of a
                                    disaggregated prefill); default: the query is the first decode step */
    const char *patches;         /* comma-separated patches (moeaudit_patch.h grammar) */
    bool deployment_only;        /* plan only the run of every patch together (the grid's cells) */
    bool no_sharing;             /* run every run from layer 0 and the first token (slower, the
                                    same bits: a check of the sharing) */
} moe_bisect_spec;

moe_bisect_spec moe_bisect_spec_default(void);

typedef enum moe_bisect_kind {
    MOE_BISECT_REFERENCE,        /* float64, no patch */
    MOE_BISECT_ALONE,            /* one patch */
    MOE_BISECT_ALL,              /* every patch: the deployment */
    MOE_BISECT_LEAVE_OUT,        /* every patch but one */
    MOE_BISECT_FIX               /* the deployment without the patches named as culprits (a check) */
} moe_bisect_kind;

/* "reference", "alone", "all", "leave-one-out", "fix". */
const char *moe_bisect_kind_name(moe_bisect_kind k);

/* One planned run. */
typedef struct moe_bisect_run_info {
    moe_bisect_kind kind;
    int patch;                   /* ALONE: the patch; LEAVE_OUT: the one left out; else -1 */
    uint64_t mask;               /* patches enabled */
    char name[160];              /* "index-keys-fp8", "all", "all but kv-fp8", ... */
    int start_layer;             /* layers below start as the reference's streams (0: all computed) */
    bool prefix_shared;          /* decode steps only, from the reference's prefill caches */
    double cost;                 /* estimated work, in token-layers */
} moe_bisect_run_info;

/* What one run shows at one layer, at the query position. */
typedef struct moe_bisect_layer {
    int layer;
    moe_attn_type type;
    int ratio;
    int64_t visible;             /* compressed entries visible to the query */
    int needle_entries;          /* of those, entries whose pooling reads a needle token */
    int topk;                    /* CSA: entries the indexer keeps */
    int kept;                    /* CSA: needle entries among the picks; HCA: all visible ones */
    bool dense;                  /* CSA: fewer other entries than topk: the needle cannot be cut */
    int64_t best_rank;           /* CSA: best rank (1-based, ties to the lower index) of a needle
                                    entry among the visible; 0 when none */
    double best_score;           /* its indexer score */
    double cutoff;               /* the topk-th largest score of the other entries */
    double margin;               /* (best_score - cutoff) / sigma, sigma = std of the reference's
                                    scores at this layer; 0 when dense */
    double mass;                 /* attention weight on the keys holding the needle (window rows and
                                    entries), summed over heads, the sink in the denominator */
    double stream_err;           /* ||X_out - X_out,ref|| / ||X_out,ref|| at the query */
} moe_bisect_layer;

/* Grades (src/bisect/bisect.c states the thresholds and where they come from). */
typedef enum moe_bisect_grade {
    MOE_BISECT_HARMLESS,
    MOE_BISECT_MARGINAL,         /* moves the needle (entries lost, weight shifted) or the output
                                    measurably, keeps the answer */
    MOE_BISECT_HARMFUL           /* loses the needle (a CSA layer keeps none of the entries the
                                    reference keeps) or changes the answer */
} moe_bisect_grade;

const char *moe_bisect_grade_name(moe_bisect_grade g);

typedef struct moe_bisect_result {
    moe_status status;           /* MOE_OK, or why the run failed (msg) */
    char msg[512];
    int n_layers;
    moe_bisect_layer layers[MOE_BISECT_MAX_LAYERS];
    double kl;                   /* KL(p_ref || p_run) of the query's next-token distribution, nats */
    int top1;                    /* argmax of the query's logits (ties to the lower id) */
    bool top1_agrees;            /* with the reference's */
    double answer_logprob;       /* sum of log p(answer_i) over the answer (0 without one) */
    double logits_err;           /* ||logits - logits_ref|| / ||logits_ref|| at the query */
    /* filled by moe_bisect_conclude */
    moe_bisect_grade grade;
    bool needle_lost;            /* a CSA layer where the reference keeps a needle entry keeps none */
    bool output_changed;         /* top-1 differs, KL or the answer's log-probability beyond bounds */
    int lost_layer;              /* the first such CSA layer, or -1 */
} moe_bisect_result;

typedef struct moe_bisect moe_bisect;

/*
 * Check the spec against the model f (ids in the vocabulary, 0 <= start <
 * end <= query, answer ids, chunk sizes, the patch list parsed against f's
 * config and each MoE patch against each layer's shapes) and plan the runs.
 * MOE_ERR_INPUT / MOE_ERR_ARG / MOE_ERR_SHAPE name the value at fault.
 * f must outlive b; the spec's arrays are copied. Loads no weights beyond
 * the MoE layers' descriptors.
 */
moe_status moe_bisect_init(moe_fwd *f, const moe_bisect_spec *spec, moe_bisect **out, moe_error *err);
void moe_bisect_free(moe_bisect *b); /* NULL is a no-op */

/* The patch set (owned by b). */
const moe_patch_set *moe_bisect_patches(const moe_bisect *b);
/* Planned runs (reference and fix excluded), in report order. */
int moe_bisect_n_runs(const moe_bisect *b);
const moe_bisect_run_info *moe_bisect_run_at(const moe_bisect *b, int i);

/* Run the float64 reference and keep what runs share: its results, the
 * streams entering each layer a run starts at, the caches after the
 * prefill. Must succeed before moe_bisect_run. */
moe_status moe_bisect_reference(moe_bisect *b, moe_error *err);
/* The reference's result (after moe_bisect_reference), or NULL. */
const moe_bisect_result *moe_bisect_reference_result(const moe_bisect *b);

/* Run planned run i: out is filled in full; a failure is out->status and
 * out->msg, also returned. Runs are independent of each other. */
moe_status moe_bisect_run(moe_bisect *b, int i, moe_bisect_result *out, moe_error *err);

/* A finished bisect: the runs' results graded and the verdict. */
typedef struct moe_bisect_report {
    const char *model;           /* directory */
    const moe_fwd_config *cfg;
    int64_t n_ids, needle_start, needle_end, query, decode_from;
    int n_answer;
    int64_t *answer;             /* [n_answer] */
    int64_t *chunks;             /* [n_chunks] */
    int n_chunks;
    const moe_patch_set *patches;
    moe_bisect_result reference;
    int n_runs;
    moe_bisect_run_info *runs;   /* [n_runs] planned runs, then the fix run when one was needed */
    moe_bisect_result *results;  /* [n_runs] */
    char verdict[2048];          /* one sentence (a few clauses) */
    uint64_t culprits;           /* patches whose revert restores the deployment (or the fix set) */
    uint64_t harmful_alone;      /* patches harmful alone */
    uint64_t harmless;           /* patches harmless alone and not needed for the harm */
} moe_bisect_report;

/*
 * Grade results [moe_bisect_n_runs(b)] (in run order; failed runs keep their
 * status), derive the verdict, and when the deployment is harmful and no
 * single revert restores it, run the deployment without the patches harmful
 * alone (a FIX run, appended) to check the advice. *out is caller-owned
 * (moe_bisect_report_free); it points into b, which must outlive it.
 */
moe_status moe_bisect_conclude(moe_bisect *b, const moe_bisect_result *results, moe_bisect_report **out,
                               moe_error *err);
void moe_bisect_report_free(moe_bisect_report *r);

/* ------------------------------------------------------------- haystack */

/*
 * The built-in prompt (docs/bisect.md): `length` tokens of filler drawn
 * uniformly from [0, vocab) without the needle's ids, a needle of
 * needle_len distinct ids planted at round(depth * (length - needle_len -
 * key_len)), and the prompt's last key_len tokens repeating the needle's
 * first key_len ids (the key), so the query (the last position) asks for
 * the rest (the answer). Deterministic in seed. ids [length], answer
 * [needle_len - key_len]. MOE_ERR_ARG: length too short for the needle and
 * key, key_len >= needle_len, vocab too small for distinct needle ids and
 * filler.
 */
moe_status moe_haystack(int vocab, int64_t length, double depth, int needle_len, int key_len, uint64_t seed,
                        int64_t *ids, int64_t *needle_start, int64_t *answer, moe_error *err);

/* --------------------------------------------------------------- grid */

/* One needle-in-a-haystack cell: the reference and the deployment at one
 * prompt length and needle depth. */
typedef struct moe_bisect_cell {
    int64_t length;
    double depth;
    int64_t needle_start;
    moe_status status;
    char msg[256];
    bool sparse;                 /* length > the smallest CSA index_topk x ratio: entries discarded */
    int ref_kept_layers;         /* CSA layers keeping a needle entry, reference */
    int dep_kept_layers;         /* the same, deployment */
    int csa_layers;
    double dep_min_margin;       /* deployment's smallest margin over CSA layers (sigma units) */
    double kl;                   /* deployment vs reference at the query */
    bool top1_agrees;
    double answer_logprob_ref, answer_logprob_dep;
    moe_bisect_grade grade;      /* the deployment's */
} moe_bisect_cell;

/* Run one cell from a spec (its ids, needle, answer; deployment_only is
 * forced): reference and deployment, graded. Pure computation; allocates. */
moe_status moe_bisect_cell_run(moe_fwd *f, const moe_bisect_spec *spec, moe_bisect_cell *cell, moe_error *err);

/* ------------------------------------------------------------- reports */

typedef struct moe_bisect_grid {
    int n_cells;
    const moe_bisect_cell *cells; /* [n_cells], lengths ascending within each depth */
    int64_t onset;               /* the prompt length past which a CSA layer discards entries */
    int ratio;                   /* the CSA compress ratio (length mod ratio is marked) */
} moe_bisect_grid;

/* A report, or NULL for none, and a grid, or NULL: text (stdout's summary),
 * JSON (byte-identical for identical inputs: no timings, no host data) and
 * one self-contained HTML page (inline SVG, no script, no network). */
moe_status moe_bisect_report_text(FILE *f, const moe_bisect_report *r, const moe_bisect_grid *g);
moe_status moe_bisect_report_json(FILE *f, const moe_bisect_report *r, const moe_bisect_grid *g);
moe_status moe_bisect_report_html(FILE *f, const moe_bisect_report *r, const moe_bisect_grid *g);

#ifdef __cplusplus
}
#endif
#endif /* MOEAUDIT_BISECT_H */
