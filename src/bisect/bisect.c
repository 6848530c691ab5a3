/*
 * moeaudit bisect: which patch loses the needle (include/moeaudit_bisect.h,
 * docs/bisect.md).
 *
 * Invariants:
 *  1. Every run is the whole-model forward (src/model) on the same token
 *     sequence, chunked the same way: the prefill [0, decode_from) in the
 *     spec's chunks, then one decode step per position up to the last answer
 *     token. A run differs from the reference only by the patches its mask
 *     enables, which the forward hands to the stages (moeaudit_patch.h).
 *  2. Runs share the reference's work only where the patches cannot change
 *     it: a run whose patches change layers >= k (moe_patch_first_changed)
 *     starts at layer k from the reference's streams entering it (kept for
 *     every position); a run whose patches all apply to decode steps only
 *     continues from a copy of the reference's caches after the prefill. The
 *     forward is deterministic, so a shared start gives the bits a full run
 *     would (test-bisect checks both against full runs).
 *  3. Every metric is read at the query position: the indexer's scores and
 *     picks and the attention weights through the forward's probe, the
 *     streams leaving each layer and the logits through its sink.
 *  4. Grades come from the thresholds below and the reference alone; the
 *     verdict from the grades of the alone, all and leave-one-out runs (and
 *     the fix run it may add). Nothing depends on timing, threads or on
 *     which process ran a run.
 *
 * Thresholds (where the numbers come from):
 *  - HARMFUL: the needle is lost (a CSA layer where the reference keeps a
 *    needle entry keeps none), or the answer changes: top-1 differs, or the
 *    answer's log-probability falls by more than ln 2 (it became less than
 *    half as likely), or KL > 0.1 nats (a tenth of a nat moves sampling at
 *    any temperature and greedy decoding at near-ties).
 *  - MARGINAL: a CSA layer keeps fewer needle entries than the reference,
 *    or KL > 1e-3 nats (above what bf16 rounding of a whole forward costs
 *    on the bundled models, ~1e-5..1e-4: docs/bisect.md), or the answer's
 *    log-probability moves by more than 0.05 nats, or a layer's attention
 *    weight on the needle moves by more than half of the reference's (where
 *    that is at least 0.01).
 */
#include "core/core.h"
#include "moeaudit_bisect.h"

#include <limits.h>
#include <math.h>
#include <string.h>

#define KL_HARM 0.1
#define KL_MARGINAL 1e-3
#define ANSWER_DROP_HARM 0.6931471805599453 /* ln 2 */
#define ANSWER_MOVE_MARGINAL 0.05
#define MASS_MOVE_MARGINAL 0.5
#define MASS_FLOOR 0.01
/* Streams the reference keeps for runs that start past layer 0, at most. */
#define STREAM_BUDGET ((size_t)4 << 30)

static const char *const kind_names[] = {"reference", "alone", "all", "leave-one-out", "fix"};
const char *moe_bisect_kind_name(moe_bisect_kind k) { return (unsigned)k <= MOE_BISECT_FIX ? kind_names[k] : "?"; }
static const char *const grade_names[] = {"HARMLESS", "MARGINAL", "HARMFUL"};
const char *moe_bisect_grade_name(moe_bisect_grade g) { return (unsigned)g <= MOE_BISECT_HARMFUL ? grade_names[g] : "?"; }

moe_bisect_spec moe_bisect_spec_default(void) {
    moe_bisect_spec s;
    memset(&s, 0, sizeof s);
    return s;
}

struct moe_bisect {
    moe_fwd *f;
    const moe_fwd_config *cfg;
    moe_patch_set *set;
    int np;                     /* patches */
    uint64_t all;               /* mask of every patch */
    int64_t *seq;               /* [T] prompt, then the answer's first n_answer - 1 ids */
    int64_t T, n_ids, query, decode_from, needle_start, needle_end;
    int64_t *answer;            /* [n_answer] */
    int n_answer;
    int64_t *chunks;
    int n_chunks;
    bool deployment_only, no_sharing;
    int n_runs;
    moe_bisect_run_info runs[2 * MOE_PATCH_MAX + 2];
    /* the reference */
    bool ref_done;
    moe_bisect_result ref;
    double sigma[MOE_BISECT_MAX_LAYERS];      /* std of the reference's index scores per CSA layer */
    double *ref_xout;           /* [n_layers, hc_mult * H] streams leaving each layer at the query */
    double *ref_logits;         /* [V] at the query */
    double **streams_in;        /* [n_layers]: NULL or [T, hc_mult * H] entering the layer */
    moe_fwd_state *prefix;      /* the reference's caches at decode_from (NULL before) */
};

/* --------------------------------------------------------------- helpers */

/* Does compressed entry j of a layer of this type and ratio pool a token of [s, e)? */
static bool holds(moe_attn_type t, int m, int64_t j, int64_t s, int64_t e) {
    int64_t lo = t == MOE_ATTN_CSA ? (j - 1) * m : j * m, hi = (j + 1) * m;
    return lo < e && hi > s;
}

static double now_cost(const moe_bisect *b, int start, bool prefix_shared) {
    const int nl = b->cfg->n_layers;
    if (prefix_shared) return (double)(b->T - b->decode_from) * nl;
    return (double)b->T * (nl - start);
}

const moe_patch_set *moe_bisect_patches(const moe_bisect *b) { return b->set; }
int moe_bisect_n_runs(const moe_bisect *b) { return b->n_runs; }
const moe_bisect_run_info *moe_bisect_run_at(const moe_bisect *b, int i) {
    return i >= 0 && i < b->n_runs ? &b->runs[i] : NULL;
}
const moe_bisect_result *moe_bisect_reference_result(const moe_bisect *b) { return b->ref_done ? &b->ref : NULL; }

static void plan(moe_bisect *b, moe_bisect_run_info *r, moe_bisect_kind kind, int patch, uint64_t mask) {
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->patch = patch;
    r->mask = mask;
    if (kind == MOE_BISECT_ALONE) snprintf(r->name, sizeof r->name, "%s", moe_patch_set_at(b->set, patch)->text);
    else if (kind == MOE_BISECT_ALL) snprintf(r->name, sizeof r->name, "all");
    else if (kind == MOE_BISECT_LEAVE_OUT)
        snprintf(r->name, sizeof r->name, "all but %s", moe_patch_set_at(b->set, patch)->text);
    else if (kind == MOE_BISECT_FIX) {
        char list[128];
        int len = 0;
        list[0] = 0;
        for (int i = 0; i < b->np; i++)
            if (!(mask >> i & 1) && len < (int)sizeof list)
                len += snprintf(list + len, sizeof list - (size_t)len, "%s%s", len ? ", " : "",
                                moe_patch_set_at(b->set, i)->text);
        snprintf(r->name, sizeof r->name, "all but %s", list);
    }
    r->prefix_shared = !b->no_sharing && b->decode_from > 0 && !moe_patch_any_in(b->set, mask, MOE_PHASE_PREFILL);
    int k = moe_patch_first_changed(b->set, mask, MOE_PHASE_ALL);
    r->start_layer = b->no_sharing || r->prefix_shared || k == INT32_MAX ? 0 : k;
    r->cost = now_cost(b, r->start_layer, r->prefix_shared);
}

void moe_bisect_free(moe_bisect *b) {
    if (!b) return;
    moe_patch_set_free(b->set);
    free(b->seq);
    free(b->answer);
    free(b->chunks);
    free(b->ref_xout);
    free(b->ref_logits);
    if (b->streams_in)
        for (int l = 0; l < b->cfg->n_layers; l++) free(b->streams_in[l]);
    free(b->streams_in);
    moe_fwd_state_free(b->prefix);
    free(b);
}

moe_status moe_bisect_init(moe_fwd *f, const moe_bisect_spec *sp, moe_bisect **out, moe_error *err) {
    *out = NULL;
    const moe_fwd_config *c = moe_fwd_get_config(f);
    if (c->n_layers > MOE_BISECT_MAX_LAYERS)
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "the model has %d layers: a bisect report holds at most %d",
                        c->n_layers, MOE_BISECT_MAX_LAYERS);
    if (!sp->ids || sp->n_ids < 1) return moe_errf(err, MOE_ERR_INPUT, "the prompt is empty: a bisect needs a query token");
    for (int64_t t = 0; t < sp->n_ids; t++)
        if (sp->ids[t] < 0 || sp->ids[t] >= c->vocab)
            return moe_errf(err, MOE_ERR_INPUT, "input_ids[%lld] = %lld is not a token id: the vocabulary has %d entries",
                            (long long)t, (long long)sp->ids[t], c->vocab);
    const int64_t q = sp->n_ids - 1;
    if (sp->needle_start < 0 || sp->needle_end <= sp->needle_start || sp->needle_end > q)
        return moe_errf(err, MOE_ERR_INPUT,
                        "needle %lld:%lld must be a non-empty span of the prompt before the query (position %lld)",
                        (long long)sp->needle_start, (long long)sp->needle_end, (long long)q);
    if (sp->n_answer < 0 || (sp->n_answer > 0 && !sp->answer))
        return moe_errf(err, MOE_ERR_ARG, "%d answer ids given without an array", sp->n_answer);
    for (int i = 0; i < sp->n_answer; i++)
        if (sp->answer[i] < 0 || sp->answer[i] >= c->vocab)
            return moe_errf(err, MOE_ERR_INPUT, "answer id %d = %lld is not a token id: the vocabulary has %d entries", i,
                            (long long)sp->answer[i], c->vocab);
    for (int i = 0; i < sp->n_chunks; i++)
        if (sp->chunks[i] < 1) return moe_errf(err, MOE_ERR_ARG, "chunk %d has %lld tokens: chunks need at least one", i,
                                              (long long)sp->chunks[i]);
    moe_bisect *b = moe_calloc(1, sizeof *b);
    if (!b) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    b->f = f;
    b->cfg = c;
    moe_status st = moe_patch_set_parse(sp->patches, c, &b->set, err);
    if (st == MOE_OK && moe_patch_set_count(b->set) == 0)
        st = moe_errf(err, MOE_ERR_ARG, "no patches to bisect: give --patches LIST");
    if (st == MOE_OK && moe_patch_set_count(b->set) > 62)
        st = moe_errf(err, MOE_ERR_ARG, "%d patches: a bisect takes at most 62", moe_patch_set_count(b->set));
    if (st != MOE_OK) {
        moe_bisect_free(b);
        return st;
    }
    /* every MoE patch against every layer's shapes, before anything runs */
    moe_model *m = moe_fwd_model(f);
    for (int l = 0; l < c->n_layers && st == MOE_OK; l++) {
        moe_layer_kind kind;
        st = moe_model_layer_kind(m, l, &kind, err);
        if (st != MOE_OK || kind == MOE_LAYER_DENSE) continue;
        const moe_layer *L = NULL;
        st = moe_model_layer(m, l, &L, err);
        if (st == MOE_OK) st = moe_patch_check_layer(b->set, L, err);
    }
    b->np = moe_patch_set_count(b->set);
    b->all = b->np >= 64 ? MOE_PATCH_ALL : (((uint64_t)1 << b->np) - 1);
    b->n_ids = sp->n_ids;
    b->query = q;
    b->needle_start = sp->needle_start;
    b->needle_end = sp->needle_end;
    b->decode_from = sp->query_in_prefill ? q + 1 : q;
    b->n_answer = sp->n_answer;
    b->T = q + 1 + (sp->n_answer > 1 ? sp->n_answer - 1 : 0);
    b->seq = moe_malloc((size_t)b->T, sizeof *b->seq);
    b->answer = moe_malloc((size_t)sp->n_answer + 1, sizeof *b->answer);
    b->chunks = moe_malloc((size_t)sp->n_chunks + 1, sizeof *b->chunks);
    b->streams_in = moe_calloc((size_t)c->n_layers, sizeof *b->streams_in);
    b->ref_xout = moe_calloc((size_t)c->n_layers * (size_t)c->hc_mult * (size_t)c->hidden, sizeof(double));
    b->ref_logits = moe_calloc((size_t)c->vocab, sizeof(double));
    if (st == MOE_OK && (!b->seq || !b->answer || !b->chunks || !b->streams_in || !b->ref_xout || !b->ref_logits))
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for a bisect of %lld tokens", (long long)b->T);
    if (st != MOE_OK) {
        moe_bisect_free(b);
        return st;
    }
    memcpy(b->seq, sp->ids, (size_t)sp->n_ids * sizeof *b->seq);
    for (int i = 0; i + 1 < sp->n_answer; i++) b->seq[sp->n_ids + i] = sp->answer[i];
    if (sp->n_answer) memcpy(b->answer, sp->answer, (size_t)sp->n_answer * sizeof *b->answer);
    if (sp->n_chunks) memcpy(b->chunks, sp->chunks, (size_t)sp->n_chunks * sizeof *b->chunks);
    b->n_chunks = sp->n_chunks;
    b->deployment_only = sp->deployment_only;
    b->no_sharing = sp->no_sharing;
    /* the plan: each patch alone, all, all but each (deduplicated: with two
     * patches "all but one" is the other alone) */
    if (b->deployment_only) {
        plan(b, &b->runs[b->n_runs++], MOE_BISECT_ALL, -1, b->all);
    } else {
        for (int i = 0; i < b->np; i++) plan(b, &b->runs[b->n_runs++], MOE_BISECT_ALONE, i, (uint64_t)1 << i);
        if (b->np >= 2) plan(b, &b->runs[b->n_runs++], MOE_BISECT_ALL, -1, b->all);
        if (b->np >= 3)
            for (int i = 0; i < b->np; i++)
                plan(b, &b->runs[b->n_runs++], MOE_BISECT_LEAVE_OUT, i, b->all & ~((uint64_t)1 << i));
    }
    /* the streams the reference keeps: each start layer runs begin at, most
     * useful first (runs x layers skipped), within the budget */
    size_t row = (size_t)c->hc_mult * (size_t)c->hidden * sizeof(double), used = 0;
    for (;;) {
        int best = -1;
        double gain = 0;
        for (int l = 1; l < c->n_layers; l++) {
            if (b->streams_in[l]) continue;
            double g = 0;
            for (int r = 0; r < b->n_runs; r++)
                if (!b->runs[r].prefix_shared && b->runs[r].start_layer == l) g += l;
            if (g > gain) {
                gain = g;
                best = l;
            }
        }
        if (best < 0 || used + row * (size_t)b->T > STREAM_BUDGET) break;
        b->streams_in[best] = moe_malloc((size_t)b->T, row);
        if (!b->streams_in[best]) break; /* runs then start lower: slower, same bits */
        used += row * (size_t)b->T;
    }
    for (int r = 0; r < b->n_runs; r++) {
        moe_bisect_run_info *ri = &b->runs[r];
        while (ri->start_layer > 0 && !b->streams_in[ri->start_layer]) ri->start_layer--;
        ri->cost = now_cost(b, ri->start_layer, ri->prefix_shared);
    }
    *out = b;
    return MOE_OK;
}

/* ------------------------------------------------------------ the sink */

typedef struct collect {
    moe_bisect *b;
    bool reference;
    int nl, nx;                 /* layers, hc_mult * H */
    double *xout;               /* [nl, nx] at the query */
    bool *has_xout;
    double **scores;            /* [nl] -> [visible] at the query */
    int64_t *n_scores;
    int32_t **picks;            /* [nl] -> [topk] */
    int *n_picks;
    double *mass;               /* [nl] */
    bool *has_mass;
    double *logits;             /* [max(n_answer, 1), V] */
    int n_logit_rows;
} collect;

static void collect_free(collect *c) {
    for (int l = 0; c->scores && l < c->nl; l++) free(c->scores[l]);
    for (int l = 0; c->picks && l < c->nl; l++) free(c->picks[l]);
    free(c->scores);
    free(c->picks);
    free(c->n_scores);
    free(c->n_picks);
    free(c->xout);
    free(c->has_xout);
    free(c->mass);
    free(c->has_mass);
    free(c->logits);
    memset(c, 0, sizeof *c);
}

static moe_status collect_init(collect *c, moe_bisect *b, bool reference, moe_error *err) {
    memset(c, 0, sizeof *c);
    const moe_fwd_config *cf = b->cfg;
    c->b = b;
    c->reference = reference;
    c->nl = cf->n_layers;
    c->nx = cf->hc_mult * cf->hidden;
    c->n_logit_rows = b->n_answer > 1 ? b->n_answer : 1;
    c->xout = moe_calloc((size_t)c->nl * (size_t)c->nx, sizeof(double));
    c->has_xout = moe_calloc((size_t)c->nl, sizeof(bool));
    c->scores = moe_calloc((size_t)c->nl, sizeof(double *));
    c->n_scores = moe_calloc((size_t)c->nl, sizeof(int64_t));
    c->picks = moe_calloc((size_t)c->nl, sizeof(int32_t *));
    c->n_picks = moe_calloc((size_t)c->nl, sizeof(int));
    c->mass = moe_calloc((size_t)c->nl, sizeof(double));
    c->has_mass = moe_calloc((size_t)c->nl, sizeof(bool));
    c->logits = moe_calloc((size_t)c->n_logit_rows * (size_t)cf->vocab, sizeof(double));
    if (!c->xout || !c->has_xout || !c->scores || !c->n_scores || !c->picks || !c->n_picks || !c->mass ||
        !c->has_mass || !c->logits) {
        collect_free(c);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory for a bisect run's measurements");
    }
    return MOE_OK;
}

static moe_status sink(void *ctx, const moe_fwd_tensor *t, moe_error *err) {
    collect *c = ctx;
    moe_bisect *b = c->b;
    const int64_t q = b->query;
    const int l = t->layer;
    if (l >= c->nl) return MOE_OK; /* no MTP here */
    const bool at_q = t->row0 <= q && q < t->row0 + t->rows;
    switch (t->what) {
    case MOE_FWD_IN:
        if (c->reference && l >= 0 && b->streams_in[l])
            memcpy(b->streams_in[l] + (size_t)t->row0 * (size_t)c->nx, t->data,
                   (size_t)t->rows * (size_t)c->nx * sizeof(double));
        break;
    case MOE_FWD_OUT:
        if (at_q) {
            memcpy(c->xout + (size_t)l * (size_t)c->nx, t->data + (size_t)(q - t->row0) * (size_t)t->row_elems,
                   (size_t)c->nx * sizeof(double));
            c->has_xout[l] = true;
        }
        break;
    case MOE_FWD_INDEX_TOPK:
        if (at_q) {
            free(c->picks[l]);
            c->picks[l] = moe_malloc((size_t)t->row_elems + 1, sizeof(int32_t));
            if (!c->picks[l]) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
            memcpy(c->picks[l], t->idata + (size_t)(q - t->row0) * (size_t)t->row_elems,
                   (size_t)t->row_elems * sizeof(int32_t));
            c->n_picks[l] = (int)t->row_elems;
        }
        break;
    case MOE_FWD_INDEX_SCORES:
        if (at_q) {
            free(c->scores[l]);
            c->scores[l] = moe_malloc((size_t)t->row_elems + 1, sizeof(double));
            if (!c->scores[l]) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
            memcpy(c->scores[l], t->data, (size_t)t->row_elems * sizeof(double));
            c->n_scores[l] = t->row_elems;
        }
        break;
    case MOE_FWD_ATTN_PROBS:
        if (at_q) {
            const moe_attn_type ty = b->cfg->attn[l];
            const int m = b->cfg->ratio[l];
            double mass = 0;
            for (int64_t k = 0; k < t->n_keys; k++) {
                int64_t key = t->keys[k];
                bool needle = key >= 0 ? key >= b->needle_start && key < b->needle_end
                                       : holds(ty, m, -1 - key, b->needle_start, b->needle_end);
                if (!needle) continue;
                for (int64_t h = 0; h < t->row_elems / t->n_keys; h++) mass += t->data[(size_t)h * (size_t)t->n_keys + (size_t)k];
            }
            c->mass[l] = mass;
            c->has_mass[l] = true;
        }
        break;
    case MOE_FWD_LOGITS:
        if (l < 0)
            for (int64_t r = 0; r < t->rows; r++) {
                int64_t p = t->row0 + r, i = p - q;
                if (i < 0 || i >= c->n_logit_rows) continue;
                memcpy(c->logits + (size_t)i * (size_t)b->cfg->vocab, t->data + (size_t)r * (size_t)t->row_elems,
                       (size_t)b->cfg->vocab * sizeof(double));
            }
        break;
    default:
        break;
    }
    return MOE_OK;
}

/* --------------------------------------------------------------- running */

/* Feed the sequence from position `from` (0, or decode_from for a copied
 * prefix), prefill chunks then single-token decode steps; streams [T, nx]
 * when the state starts past layer 0. clone_prefix: keep a copy of the
 * caches at decode_from (the reference). */
static moe_status feed(moe_bisect *b, moe_fwd_state *s, int64_t from, const double *streams, bool clone_prefix,
                       moe_error *err) {
    const size_t nx = (size_t)b->cfg->hc_mult * (size_t)b->cfg->hidden;
    moe_status st = MOE_OK;
    int64_t p = from;
    int ci = 0;
    moe_fwd_state_set_phase(s, MOE_PHASE_PREFILL);
    while (st == MOE_OK && p < b->decode_from) {
        int64_t n = b->n_chunks ? b->chunks[ci < b->n_chunks ? ci : b->n_chunks - 1] : b->decode_from - p;
        if (n > b->decode_from - p) n = b->decode_from - p;
        st = moe_fwd_run(b->f, s, b->seq + p, n, streams ? streams + (size_t)p * nx : NULL, err);
        p += n;
        ci++;
    }
    if (st == MOE_OK && clone_prefix) {
        moe_fwd_opts po = moe_fwd_opts_default(b->f);
        st = moe_fwd_state_clone(s, &po, &b->prefix, err);
    }
    moe_fwd_state_set_phase(s, MOE_PHASE_DECODE);
    for (; st == MOE_OK && p < b->T; p++)
        st = moe_fwd_run(b->f, s, b->seq + p, 1, streams ? streams + (size_t)p * nx : NULL, err);
    return st;
}

static double log_softmax_at(const double *z, int V, int id) {
    double m = -INFINITY;
    for (int v = 0; v < V; v++)
        if (z[v] > m) m = z[v];
    double s = 0;
    for (int v = 0; v < V; v++) s += exp(z[v] - m);
    return z[id] - m - log(s);
}

static int argmax(const double *z, int V) {
    int best = 0;
    for (int v = 1; v < V; v++)
        if (z[v] > z[best] || (z[best] != z[best] && z[v] == z[v])) best = v;
    return best;
}

static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* A run's result from its collected measurements. */
static moe_status measure(moe_bisect *b, const collect *c, int start, moe_bisect_result *r, moe_error *err) {
    const moe_fwd_config *cf = b->cfg;
    const int V = cf->vocab;
    const int64_t q = b->query, s0 = b->needle_start, s1 = b->needle_end;
    r->n_layers = cf->n_layers;
    for (int l = 0; l < cf->n_layers; l++) {
        moe_bisect_layer *L = &r->layers[l];
        if (l < start) {
            *L = b->ref.layers[l];
            L->stream_err = 0;
            continue;
        }
        memset(L, 0, sizeof *L);
        L->layer = l;
        L->type = cf->attn[l];
        L->ratio = cf->ratio[l];
        if (L->type != MOE_ATTN_SLIDING) {
            L->visible = (q + 1) / L->ratio;
            for (int64_t j = 0; j < L->visible; j++) L->needle_entries += holds(L->type, L->ratio, j, s0, s1);
        }
        if (L->type == MOE_ATTN_HCA) {
            L->kept = L->needle_entries;
            L->topk = (int)L->visible;
            L->dense = true;
        }
        if (L->type == MOE_ATTN_CSA) {
            L->topk = c->n_picks[l];
            for (int k = 0; c->picks[l] && k < c->n_picks[l]; k++) {
                int32_t j = c->picks[l][k];
                L->kept += j >= 0 && holds(L->type, L->ratio, j, s0, s1);
            }
            const double *sc = c->scores[l];
            const int64_t nv = c->n_scores[l];
            if (!sc && L->visible > 0)
                return moe_errf(err, MOE_ERR_INVARIANT, "layer %d: the forward reported no indexer scores at the query", l);
            double *others = moe_malloc((size_t)nv + 1, sizeof(double));
            if (!others) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
            int64_t no = 0, best_j = -1;
            for (int64_t j = 0; j < nv; j++) {
                if (holds(L->type, L->ratio, j, s0, s1)) {
                    int64_t rk = moe_idx_rank(sc, nv, j);
                    if (L->best_rank == 0 || rk < L->best_rank) {
                        L->best_rank = rk;
                        best_j = j;
                    }
                } else {
                    others[no++] = sc[j];
                }
            }
            L->dense = no < L->topk;
            if (best_j >= 0) L->best_score = sc[best_j];
            if (!L->dense && best_j >= 0) {
                qsort(others, (size_t)no, sizeof *others, cmp_desc);
                L->cutoff = others[L->topk - 1];
                L->margin = (L->best_score - L->cutoff) / b->sigma[l];
            }
            free(others);
        }
        L->mass = c->has_mass[l] ? c->mass[l] : 0;
        const double *x = c->xout + (size_t)l * (size_t)c->nx, *xr = b->ref_xout + (size_t)l * (size_t)c->nx;
        double dd = 0, rr = 0;
        for (int i = 0; i < c->nx; i++) {
            dd += (x[i] - xr[i]) * (x[i] - xr[i]);
            rr += xr[i] * xr[i];
        }
        L->stream_err = rr > 0 ? sqrt(dd / rr) : sqrt(dd);
    }
    /* the output at the query */
    const double *z = c->logits, *zr = b->ref_logits;
    double mr = -INFINITY, m = -INFINITY, sr = 0, s = 0, dd = 0, rr = 0;
    for (int v = 0; v < V; v++) {
        if (zr[v] > mr) mr = zr[v];
        if (z[v] > m) m = z[v];
    }
    for (int v = 0; v < V; v++) {
        sr += exp(zr[v] - mr);
        s += exp(z[v] - m);
        dd += (z[v] - zr[v]) * (z[v] - zr[v]);
        rr += zr[v] * zr[v];
    }
    double kl = 0;
    for (int v = 0; v < V; v++) {
        double lpr = zr[v] - mr - log(sr), lp = z[v] - m - log(s);
        kl += exp(lpr) * (lpr - lp);
    }
    r->kl = kl < 0 ? 0 : kl; /* rounding can leave -1e-17 where the distributions agree */
    r->top1 = argmax(z, V);
    r->top1_agrees = r->top1 == argmax(zr, V);
    r->logits_err = rr > 0 ? sqrt(dd / rr) : sqrt(dd);
    r->answer_logprob = 0;
    for (int i = 0; i < b->n_answer; i++) r->answer_logprob += log_softmax_at(c->logits + (size_t)i * (size_t)V, V, (int)b->answer[i]);
    return MOE_OK;
}

moe_status moe_bisect_reference(moe_bisect *b, moe_error *err) {
    if (b->ref_done) return MOE_OK;
    collect c;
    moe_status st = collect_init(&c, b, true, err);
    if (st != MOE_OK) return st;
    moe_fwd_opts o = moe_fwd_opts_default(b->f);
    o.sink = sink;
    o.sink_ctx = &c;
    o.probe = &b->query;
    o.n_probe = 1;
    moe_fwd_state *s = NULL;
    st = moe_fwd_state_init(b->f, &o, &s, err);
    if (st == MOE_OK) st = feed(b, s, 0, NULL, b->decode_from > 0, err);
    moe_fwd_state_free(s);
    if (st == MOE_OK) {
        const moe_fwd_config *cf = b->cfg;
        memcpy(b->ref_xout, c.xout, (size_t)cf->n_layers * (size_t)c.nx * sizeof(double));
        memcpy(b->ref_logits, c.logits, (size_t)cf->vocab * sizeof(double));
        for (int l = 0; l < cf->n_layers; l++) {
            b->sigma[l] = 1;
            if (cf->attn[l] != MOE_ATTN_CSA || c.n_scores[l] < 2) continue;
            double mean = 0, var = 0;
            for (int64_t j = 0; j < c.n_scores[l]; j++) mean += c.scores[l][j];
            mean /= (double)c.n_scores[l];
            for (int64_t j = 0; j < c.n_scores[l]; j++) var += (c.scores[l][j] - mean) * (c.scores[l][j] - mean);
            var /= (double)c.n_scores[l];
            if (var > 0 && isfinite(var)) b->sigma[l] = sqrt(var);
        }
        memset(&b->ref, 0, sizeof b->ref);
        st = measure(b, &c, 0, &b->ref, err);
    }
    collect_free(&c);
    if (st != MOE_OK) {
        moe_fwd_state_free(b->prefix);
        b->prefix = NULL;
        return st;
    }
    b->ref.status = MOE_OK;
    b->ref_done = true;
    return MOE_OK;
}

static moe_status run_info(moe_bisect *b, const moe_bisect_run_info *ri, moe_bisect_result *out, moe_error *err) {
    memset(out, 0, sizeof *out);
    moe_status st = MOE_OK;
    if (!b->ref_done) st = moe_errf(err, MOE_ERR_ARG, "run %s before the reference ran", ri->name);
    collect c;
    if (st == MOE_OK) st = collect_init(&c, b, false, err);
    if (st != MOE_OK) {
        out->status = st;
        snprintf(out->msg, sizeof out->msg, "%s", err ? err->msg : "");
        return st;
    }
    moe_fwd_opts o = moe_fwd_opts_default(b->f);
    o.sink = sink;
    o.sink_ctx = &c;
    o.probe = &b->query;
    o.n_probe = 1;
    o.patch = b->set;
    o.patch_mask = ri->mask;
    moe_fwd_state *s = NULL;
    if (ri->prefix_shared) {
        st = moe_fwd_state_clone(b->prefix, &o, &s, err);
        if (st == MOE_OK) {
            moe_fwd_state_set_phase(s, MOE_PHASE_DECODE);
            for (int64_t p = b->decode_from; st == MOE_OK && p < b->T; p++) st = moe_fwd_run(b->f, s, b->seq + p, 1, NULL, err);
        }
    } else {
        o.first_layer = ri->start_layer;
        st = moe_fwd_state_init(b->f, &o, &s, err);
        if (st == MOE_OK) st = feed(b, s, 0, ri->start_layer > 0 ? b->streams_in[ri->start_layer] : NULL, false, err);
    }
    moe_fwd_state_free(s);
    if (st == MOE_OK) st = measure(b, &c, ri->prefix_shared ? 0 : ri->start_layer, out, err);
    collect_free(&c);
    out->status = st;
    if (st != MOE_OK) snprintf(out->msg, sizeof out->msg, "%s", err ? err->msg : "");
    return st;
}

moe_status moe_bisect_run(moe_bisect *b, int i, moe_bisect_result *out, moe_error *err) {
    if (i < 0 || i >= b->n_runs) {
        memset(out, 0, sizeof *out);
        out->status = moe_errf(err, MOE_ERR_ARG, "run %d of %d", i, b->n_runs);
        return out->status;
    }
    moe_error local;
    moe_status st = run_info(b, &b->runs[i], out, &local);
    if (st != MOE_OK && err) *err = local;
    return st;
}

/* --------------------------------------------------------------- grading */

static void grade(const moe_bisect *b, moe_bisect_result *r) {
    const moe_bisect_result *ref = &b->ref;
    r->needle_lost = false;
    r->output_changed = false;
    r->lost_layer = -1;
    r->grade = MOE_BISECT_HARMLESS;
    if (r->status != MOE_OK) return;
    bool marginal = false;
    for (int l = 0; l < r->n_layers; l++) {
        const moe_bisect_layer *L = &r->layers[l], *R = &ref->layers[l];
        if (L->type == MOE_ATTN_CSA) {
            if (R->kept > 0 && L->kept == 0 && !r->needle_lost) {
                r->needle_lost = true;
                r->lost_layer = l;
            }
            if (L->kept < R->kept) marginal = true;
        }
        if (R->mass >= MASS_FLOOR && fabs(L->mass - R->mass) > MASS_MOVE_MARGINAL * R->mass) marginal = true;
    }
    const double drop = ref->answer_logprob - r->answer_logprob;
    r->output_changed = !r->top1_agrees || !(r->kl <= KL_HARM) || (b->n_answer > 0 && !(drop <= ANSWER_DROP_HARM));
    if (r->kl > KL_MARGINAL || (b->n_answer > 0 && fabs(drop) > ANSWER_MOVE_MARGINAL)) marginal = true;
    r->grade = r->needle_lost || r->output_changed ? MOE_BISECT_HARMFUL : marginal ? MOE_BISECT_MARGINAL
                                                                                  : MOE_BISECT_HARMLESS;
}

void moe_bisect_report_free(moe_bisect_report *r) {
    if (!r) return;
    free(r->runs);
    free(r->results);
    free(r->answer);
    free(r->chunks);
    free(r);
}

static const moe_bisect_result *by_mask(const moe_bisect_report *r, uint64_t mask) {
    for (int i = 0; i < r->n_runs; i++)
        if (r->runs[i].mask == mask && r->results[i].status == MOE_OK) return &r->results[i];
    return NULL;
}

/* "a", "a and b", "a, b and c" of the patches in mask. */
static void names(const moe_patch_set *s, uint64_t mask, const char *conj, char *buf, size_t cap) {
    int n = 0, total = 0;
    for (int i = 0; i < moe_patch_set_count(s); i++) total += (int)(mask >> i & 1);
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; i < moe_patch_set_count(s); i++) {
        if (!(mask >> i & 1)) continue;
        n++;
        const char *sep = n == 1 ? "" : n == total ? conj : ", ";
        int w = snprintf(buf + len, cap > len ? cap - len : 0, "%s%s", sep, moe_patch_set_at(s, i)->text);
        if (w < 0 || len + (size_t)w >= cap) break;
        len += (size_t)w;
    }
}

/* What is wrong with a harmful run, in a few words. */
static void harm(const moe_bisect *b, const moe_bisect_result *r, char *buf, size_t cap) {
    const moe_bisect_result *ref = &b->ref;
    if (r->needle_lost) {
        const moe_bisect_layer *L = &r->layers[r->lost_layer], *R = &ref->layers[r->lost_layer];
        snprintf(buf, cap, "loses the needle (layer %d: none of its %d entries in the top-%d, the reference keeps %d%s)",
                 L->layer, L->needle_entries, L->topk, R->kept, r->output_changed ? "; the answer changes too" : "");
        return;
    }
    if (!r->top1_agrees)
        snprintf(buf, cap, "changes the answer (top-1 %d instead of %d, KL %.3g nats)", r->top1, ref->top1, r->kl);
    else if (b->n_answer > 0 && ref->answer_logprob - r->answer_logprob > ANSWER_DROP_HARM)
        snprintf(buf, cap, "makes the answer %.3g times less likely (KL %.3g nats)",
                 exp(ref->answer_logprob - r->answer_logprob), r->kl);
    else
        snprintf(buf, cap, "changes the output (KL %.3g nats)", r->kl);
}

static void append(char *dst, size_t cap, const char *fmt, const char *a, const char *c2) {
    size_t len = strlen(dst);
    if (len + 1 >= cap) return;
    snprintf(dst + len, cap - len, fmt, a, c2);
}

static moe_status verdict(moe_bisect *b, moe_bisect_report *r, moe_error *err) {
    const moe_patch_set *s = b->set;
    const int np = b->np;
    char v[2048] = "", tmp[512], list[512], h[400];
    const moe_bisect_result *dep = by_mask(r, b->all);
    uint64_t alone_bad = 0, alone_marg = 0, alone_ok = 0, needed = 0;
    for (int i = 0; i < np; i++) {
        const moe_bisect_result *a = by_mask(r, (uint64_t)1 << i);
        if (!a) continue;
        if (a->grade == MOE_BISECT_HARMFUL) alone_bad |= (uint64_t)1 << i;
        else if (a->grade == MOE_BISECT_MARGINAL) alone_marg |= (uint64_t)1 << i;
        else alone_ok |= (uint64_t)1 << i;
    }
    if (!dep) {
        snprintf(r->verdict, sizeof r->verdict, "The deployment's run failed: no verdict (see the failed runs).");
        return MOE_OK;
    }
    char depname[64];
    snprintf(depname, sizeof depname, np == 1 ? "The patch" : "The deployment (all %d patches)", np);
    /* does the reference itself keep the needle somewhere? (else only the output can judge) */
    bool ref_keeps = false, any_sparse = false;
    int best_l = -1;
    for (int l = 0; l < b->ref.n_layers; l++) {
        const moe_bisect_layer *L = &b->ref.layers[l];
        if (L->type != MOE_ATTN_CSA || L->needle_entries == 0) continue;
        ref_keeps |= L->kept > 0;
        any_sparse |= !L->dense;
        if (best_l < 0 || L->best_rank < b->ref.layers[best_l].best_rank) best_l = l;
    }
    char pre[320] = "";
    if (!ref_keeps && best_l >= 0 && any_sparse)
        snprintf(pre, sizeof pre, "The float64 reference keeps no needle entry in any CSA layer's top-k (best: rank %lld of "
                 "%lld at layer %d), so the patches are judged by the output. ",
                 (long long)b->ref.layers[best_l].best_rank, (long long)b->ref.layers[best_l].visible, best_l);
    if (dep->grade == MOE_BISECT_HARMFUL) {
        harm(b, dep, h, sizeof h);
        snprintf(v, sizeof v, "%s %s.", depname, h);
        if (np >= 2)
            for (int i = 0; i < np; i++) {
                const moe_bisect_result *lo = by_mask(r, b->all & ~((uint64_t)1 << i));
                if (lo && lo->grade != MOE_BISECT_HARMFUL) needed |= (uint64_t)1 << i;
            }
        if (np == 1) needed = b->all;
        const char *what = dep->needle_lost ? "the needle" : "the answer";
        if (needed) {
            uint64_t single = needed & alone_bad, together = needed & ~alone_bad;
            const char *does = dep->needle_lost ? "loses the needle" : "changes the answer";
            if (single && np > 1) {
                names(s, single, " and ", list, sizeof list);
                snprintf(tmp, sizeof tmp, " %%s alone %s too%s", __builtin_popcountll(single) > 1 ? "each" : does,
                         together ? ";" : ".");
                if (__builtin_popcountll(single) > 1) snprintf(tmp, sizeof tmp, " %%s each %s alone%s", does, together ? ";" : ".");
                append(v, sizeof v, tmp, list, "");
            }
            if (together) {
                names(s, together, " and ", list, sizeof list);
                if (single) append(v, sizeof v, " %s %s harmless alone but needed for it.", list,
                                   __builtin_popcountll(together) > 1 ? "are" : "is");
                else append(v, sizeof v, " %s do it only together (none is harmful alone).", list, "");
            }
            names(s, needed, " or ", list, sizeof list);
            if (np > 1) {
                snprintf(tmp, sizeof tmp, " Reverting %%s restores %s.", what);
                append(v, sizeof v, tmp, list, "");
            }
        } else if (alone_bad) {
            names(s, alone_bad, " and ", list, sizeof list);
            append(v, sizeof v, " No single revert restores it: %s each do harm alone;", list, "");
            const moe_bisect_result *fx = NULL;
            for (int i = 0; i < r->n_runs; i++)
                if (r->runs[i].kind == MOE_BISECT_FIX) fx = &r->results[i];
            if (fx && fx->status == MOE_OK)
                append(v, sizeof v, fx->grade == MOE_BISECT_HARMFUL ? " reverting all of them still leaves it harmful (checked)."
                                                                      : " reverting all of them restores %s (checked).",
                       what, "");
            else append(v, sizeof v, " revert all of them.", "", "");
            needed = alone_bad;
        } else {
            append(v, sizeof v, " No patch harms alone and no single revert restores it: the harm needs several of "
                   "them together.", "", "");
        }
    } else {
        snprintf(v, sizeof v, "%s keeps %s%s.", depname, ref_keeps ? "the needle and the answer" : "the answer",
                 dep->grade == MOE_BISECT_MARGINAL ? " (marginal: it moves them)" : "");
        if (alone_bad) {
            names(s, alone_bad, " and ", list, sizeof list);
            append(v, sizeof v, " Alone, %s %s harmful (the other patches compensate).", list,
                   __builtin_popcountll(alone_bad) > 1 ? "are" : "is");
        }
    }
    /* the rest, alone */
    uint64_t other_bad = alone_bad & ~needed;
    for (int i = 0; i < np && dep->grade == MOE_BISECT_HARMFUL; i++)
        if (other_bad >> i & 1) {
            harm(b, by_mask(r, (uint64_t)1 << i), h, sizeof h);
            snprintf(tmp, sizeof tmp, " %%s also %s alone.", h);
            append(v, sizeof v, tmp, moe_patch_set_at(s, i)->text, "");
        }
    uint64_t marg = alone_marg & ~needed;
    if (marg) {
        names(s, marg, " and ", list, sizeof list);
        append(v, sizeof v, " Marginal alone: %s.", list, "");
    }
    uint64_t ok = alone_ok & ~needed;
    if (ok) {
        names(s, ok, ", ", list, sizeof list);
        append(v, sizeof v, " Harmless: %s.", list, "");
    }
    /* pre, then as much of v as fits (the verdict is bounded; memcpy, not
     * snprintf, so no truncation warning hides a real one elsewhere) */
    size_t lp = strlen(pre), lv = strlen(v);
    if (lp > sizeof r->verdict - 1) lp = sizeof r->verdict - 1;
    if (lv > sizeof r->verdict - 1 - lp) lv = sizeof r->verdict - 1 - lp;
    memcpy(r->verdict, pre, lp);
    memcpy(r->verdict + lp, v, lv);
    r->verdict[lp + lv] = 0;
    r->culprits = needed;
    r->harmful_alone = alone_bad;
    r->harmless = ok;
    (void)err;
    return MOE_OK;
}

moe_status moe_bisect_conclude(moe_bisect *b, const moe_bisect_result *results, moe_bisect_report **out,
                               moe_error *err) {
    *out = NULL;
    if (!b->ref_done) return moe_errf(err, MOE_ERR_ARG, "the reference has not run");
    moe_bisect_report *r = moe_calloc(1, sizeof *r);
    if (!r) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    r->runs = moe_calloc((size_t)b->n_runs + 1, sizeof *r->runs);
    r->results = moe_calloc((size_t)b->n_runs + 1, sizeof *r->results);
    r->answer = moe_calloc((size_t)b->n_answer + 1, sizeof *r->answer);
    r->chunks = moe_calloc((size_t)b->n_chunks + 1, sizeof *r->chunks);
    if (!r->runs || !r->results || !r->answer || !r->chunks) {
        moe_bisect_report_free(r);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    }
    r->model = moe_ckpt_dir(moe_model_ckpt(moe_fwd_model(b->f)));
    r->cfg = b->cfg;
    r->n_ids = b->n_ids;
    r->needle_start = b->needle_start;
    r->needle_end = b->needle_end;
    r->query = b->query;
    r->decode_from = b->decode_from;
    r->n_answer = b->n_answer;
    memcpy(r->answer, b->answer, (size_t)b->n_answer * sizeof *r->answer);
    r->n_chunks = b->n_chunks;
    memcpy(r->chunks, b->chunks, (size_t)b->n_chunks * sizeof *r->chunks);
    r->patches = b->set;
    r->reference = b->ref;
    r->n_runs = b->n_runs;
    memcpy(r->runs, b->runs, (size_t)b->n_runs * sizeof *r->runs);
    memcpy(r->results, results, (size_t)b->n_runs * sizeof *r->results);
    for (int i = 0; i < r->n_runs; i++) grade(b, &r->results[i]);
    /* a fix run checks the advice when no single revert restores the deployment */
    const moe_bisect_result *dep = by_mask(r, b->all);
    if (!b->deployment_only && b->np >= 2 && dep && dep->grade == MOE_BISECT_HARMFUL) {
        uint64_t bad = 0, needed = 0;
        for (int i = 0; i < b->np; i++) {
            const moe_bisect_result *a = by_mask(r, (uint64_t)1 << i), *lo = by_mask(r, b->all & ~((uint64_t)1 << i));
            if (a && a->grade == MOE_BISECT_HARMFUL) bad |= (uint64_t)1 << i;
            if (lo && lo->grade != MOE_BISECT_HARMFUL) needed |= (uint64_t)1 << i;
        }
        uint64_t fix = b->all & ~bad;
        if (!needed && bad && fix && !by_mask(r, fix)) {
            moe_bisect_run_info *ri = &r->runs[r->n_runs];
            plan(b, ri, MOE_BISECT_FIX, -1, fix);
            while (ri->start_layer > 0 && !b->streams_in[ri->start_layer]) ri->start_layer--;
            ri->cost = now_cost(b, ri->start_layer, ri->prefix_shared);
            moe_error e2;
            run_info(b, ri, &r->results[r->n_runs], &e2);
            grade(b, &r->results[r->n_runs]);
            r->n_runs++;
        }
    }
    moe_status st = verdict(b, r, err);
    if (st != MOE_OK) {
        moe_bisect_report_free(r);
        return st;
    }
    *out = r;
    return MOE_OK;
}

/* -------------------------------------------------------------- haystack */

moe_status moe_haystack(int vocab, int64_t length, double depth, int needle_len, int key_len, uint64_t seed,
                        int64_t *ids, int64_t *needle_start, int64_t *answer, moe_error *err) {
    if (needle_len < 2 || key_len < 1 || key_len >= needle_len)
        return moe_errf(err, MOE_ERR_ARG, "a needle of %d tokens with a key of %d: the key must be 1 .. needle - 1",
                        needle_len, key_len);
    if (length < (int64_t)needle_len + key_len + 1)
        return moe_errf(err, MOE_ERR_ARG, "a haystack of %lld tokens cannot hold a %d-token needle and a %d-token query",
                        (long long)length, needle_len, key_len);
    if (vocab < 2 * needle_len)
        return moe_errf(err, MOE_ERR_ARG, "a vocabulary of %d ids is too small for %d distinct needle ids and filler",
                        vocab, needle_len);
    if (!(depth >= 0 && depth <= 1)) return moe_errf(err, MOE_ERR_ARG, "needle depth %g is not in [0, 1]", depth);
    uint64_t s = seed;
    int64_t needle[256];
    if (needle_len > 256) return moe_errf(err, MOE_ERR_ARG, "needle of %d tokens: at most 256", needle_len);
    for (int i = 0; i < needle_len; i++) {
        for (;;) {
            int64_t v = (int64_t)(moe_splitmix64(&s) % (uint64_t)vocab);
            bool dup = false;
            for (int k = 0; k < i; k++) dup |= needle[k] == v;
            if (!dup) {
                needle[i] = v;
                break;
            }
        }
    }
    int64_t room = length - needle_len - key_len;
    int64_t start = (int64_t)floor(depth * (double)room + 0.5);
    for (int64_t t = 0; t < length; t++) {
        for (;;) {
            int64_t v = (int64_t)(moe_splitmix64(&s) % (uint64_t)vocab);
            bool in = false;
            for (int k = 0; k < needle_len; k++) in |= needle[k] == v;
            if (!in) {
                ids[t] = v;
                break;
            }
        }
    }
    for (int i = 0; i < needle_len; i++) ids[start + i] = needle[i];
    for (int i = 0; i < key_len; i++) ids[length - key_len + i] = needle[i];
    for (int i = key_len; i < needle_len; i++) answer[i - key_len] = needle[i];
    *needle_start = start;
    return MOE_OK;
}

/* ------------------------------------------------------------------ grid */

moe_status moe_bisect_cell_run(moe_fwd *f, const moe_bisect_spec *spec, moe_bisect_cell *cell, moe_error *err) {
    moe_bisect_spec sp = *spec;
    sp.deployment_only = true;
    cell->status = MOE_OK;
    cell->msg[0] = 0;
    cell->needle_start = sp.needle_start;
    moe_bisect *b = NULL;
    moe_bisect_report *rep = NULL;
    moe_bisect_result res;
    moe_status st = moe_bisect_init(f, &sp, &b, err);
    if (st == MOE_OK) st = moe_bisect_reference(b, err);
    if (st == MOE_OK) st = moe_bisect_run(b, 0, &res, err);
    if (st == MOE_OK) st = moe_bisect_conclude(b, &res, &rep, err);
    if (st == MOE_OK) {
        const moe_bisect_result *R = &rep->reference, *D = &rep->results[0];
        cell->csa_layers = cell->ref_kept_layers = cell->dep_kept_layers = 0;
        cell->dep_min_margin = INFINITY;
        cell->sparse = false;
        for (int l = 0; l < R->n_layers; l++) {
            if (R->layers[l].type != MOE_ATTN_CSA) continue;
            cell->csa_layers++;
            cell->ref_kept_layers += R->layers[l].kept > 0;
            cell->dep_kept_layers += D->layers[l].kept > 0;
            if (!D->layers[l].dense) {
                cell->sparse = true;
                if (D->layers[l].margin < cell->dep_min_margin) cell->dep_min_margin = D->layers[l].margin;
            }
        }
        if (!cell->sparse) cell->dep_min_margin = 0;
        cell->kl = D->kl;
        cell->top1_agrees = D->top1_agrees;
        cell->answer_logprob_ref = R->answer_logprob;
        cell->answer_logprob_dep = D->answer_logprob;
        cell->grade = D->grade;
    } else {
        cell->status = st;
        snprintf(cell->msg, sizeof cell->msg, "%.250s", err ? err->msg : "");
    }
    moe_bisect_report_free(rep);
    moe_bisect_free(b);
    return st;
}
