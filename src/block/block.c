/*
 * The CPU block driver: one MoE block on T tokens, in chunks, through the
 * stages' own headers: router (src/router: logits, routing, hash ids) ->
 * routed experts grouped by expert and the shared expert (src/experts:
 * moe_expert_rows) -> combine under the contract (src/experts). Nothing of
 * the math is here: this file orders the stages, sorts the assignments and
 * owns the buffers.
 *
 * Invariants:
 *  1. routed_scaling_factor enters through moe_contract alone: the router
 *     multiplies by c.router_mult, the runner by c.runner_mult, the combine by
 *     c.output_mult. eff_weights records the product actually applied.
 *  2. Each token's output is combined in column order from per-(token,
 *     column) expert outputs, so it is independent of the batch it sits in
 *     and of the thread count.
 *  3. Tokens are processed in chunks of CHUNK; a chunk's buffers bound the
 *     memory whatever T is.
 *  4. The f32 path's kernel table is resolved once per call from opts->isa
 *     (moe_cpu_table); no state outlives the call.
 */
#include "core/core.h"
#include "experts/experts.h"
#include "moeaudit_variant.h"
#include "router/router.h"

#include <string.h>

#define CHUNK 256

static int n_cols_for(const moe_layer *L, const moe_run_opts *o) {
    return L->cfg.top_k + (o->fuse_shared && L->cfg.shared_inter > 0 ? 1 : 0);
}

moe_status moe_block_out_init(moe_block_out *o, const moe_layer *L, int64_t T, const moe_run_opts *opts,
                              moe_error *err) {
    memset(o, 0, sizeof *o);
    if (T < 0) return moe_errf(err, MOE_ERR_ARG, "token count %lld is negative", (long long)T);
    int H = L->cfg.hidden, E = L->cfg.n_experts, C = n_cols_for(L, opts);
    o->T = T;
    o->H = H;
    o->E = E;
    o->n_cols = C;
    size_t t = (size_t)T;
    o->router_logits = moe_calloc(t * (size_t)E, sizeof(double));
    o->topk_ids = moe_calloc(t * (size_t)C, sizeof(int32_t));
    o->topk_weights = moe_calloc(t * (size_t)C, sizeof(double));
    o->eff_weights = moe_calloc(t * (size_t)C, sizeof(double));
    o->routed_out = moe_calloc(t * (size_t)H, sizeof(double));
    o->shared_out = moe_calloc(t * (size_t)H, sizeof(double));
    o->moe_out = moe_calloc(t * (size_t)H, sizeof(double));
    if (!o->router_logits || !o->topk_ids || !o->topk_weights || !o->eff_weights || !o->routed_out ||
        !o->shared_out || !o->moe_out) {
        moe_block_out_free(o);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory for %lld tokens", (long long)T);
    }
    return MOE_OK;
}

moe_run_opts moe_run_opts_default(void) {
    moe_run_opts o;
    memset(&o, 0, sizeof o);
    o.precision = MOE_PREC_REF;
    o.act = MOE_ACT_EXACT;
    o.router = MOE_ROUTER_PATH;
    o.owner = MOE_SCALE_ROUTER;
    o.fuse_shared = false;
    o.check_invariants = false;
    return o;
}

void moe_block_out_free(moe_block_out *o) {
    if (!o) return;
    free(o->router_logits);
    free(o->topk_ids);
    free(o->topk_weights);
    free(o->eff_weights);
    free(o->routed_out);
    free(o->shared_out);
    free(o->moe_out);
    memset(o, 0, sizeof *o);
}

typedef struct chunk_ctx {
    const moe_layer *L;
    const moe_run_opts *o;
    const moe_variant *v;
    const moe_cpu_kernels *kern; /* f32 path: the table of o->isa */
    moe_contract c;
    bool f32;
    int C;             /* columns per token */
    /* per chunk, [n] tokens: */
    int64_t *count;    /* [E + 1] assignments per expert (index E: shared) */
    int64_t *start;    /* [E + 2] prefix sums */
    int64_t *assign;   /* [n * C] token-local index * C + column, sorted by expert */
    double *Y;         /* [n, C, H] expert outputs per (token, column), ref */
    float *Yf;         /* same, f32 path */
    double *Ysh;       /* [n, H] shared expert output (unfused too), ref */
    float *Yshf;
} chunk_ctx;

/* Run expert e (e == E: shared) over its assigned tokens of this chunk;
 * rows: the chunk's tokens in the path's precision. */
static moe_status run_expert(chunk_ctx *k, int e, const void *rows, int64_t n_tok, moe_error *err) {
    const moe_layer *L = k->L;
    int E = L->cfg.n_experts, H = L->cfg.hidden;
    if (e == E)
        return moe_expert_rows(&L->sw1, &L->sw3, &L->sw2, L->cfg.swiglu_limit, k->f32, k->o->act, k->kern, H, n_tok,
                               rows, NULL, k->f32 ? (void *)k->Yshf : (void *)k->Ysh, NULL, err);
    int64_t n = k->count[e];
    if (n == 0) return MOE_OK;
    const int64_t *as = k->assign + k->start[e];
    int64_t *src = moe_malloc((size_t)n, sizeof *src);
    if (!src) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    for (int64_t q = 0; q < n; q++) src[q] = as[q] / k->C;
    moe_status st = moe_expert_rows(&L->w1[e], &L->w3[e], &L->w2[e], L->cfg.swiglu_limit, k->f32, k->o->act, k->kern,
                                    H, n, rows, src, k->f32 ? (void *)k->Yf : (void *)k->Y, as, err);
    free(src);
    return st;
}

/* The f32 path's experts of a chunk: every routed expert with tokens and
 * the shared one in one moe_experts_rows_f32 call (one work split over all
 * threads, by (expert, row range)). rows_f: the chunk's n tokens [n, H]. */
static moe_status run_experts_f32(chunk_ctx *k, const float *rows_f, int64_t n, moe_error *err) {
    const moe_layer *L = k->L;
    int E = L->cfg.n_experts, C = k->C;
    int has_shared = L->cfg.shared_inter > 0;
    int64_t *src = moe_malloc((size_t)k->start[E] + 1, sizeof *src);
    moe_rows_job *jobs = moe_calloc((size_t)E + 1, sizeof *jobs);
    if (!src || !jobs) {
        free(src);
        free(jobs);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    }
    for (int64_t q = 0; q < k->start[E]; q++) src[q] = k->assign[q] / C;
    int nj = 0;
    for (int e = 0; e < E; e++)
        if (k->count[e] > 0)
            jobs[nj++] = (moe_rows_job){&L->w1[e], &L->w3[e], &L->w2[e], k->count[e], src + k->start[e], k->Yf,
                                        k->assign + k->start[e]};
    if (has_shared) jobs[nj++] = (moe_rows_job){&L->sw1, &L->sw3, &L->sw2, n, NULL, k->Yshf, NULL};
    moe_status st = moe_experts_rows_f32(jobs, nj, L->cfg.swiglu_limit, k->o->act, k->kern, L->cfg.hidden, rows_f, err);
    free(src);
    free(jobs);
    return st;
}

static moe_status run_chunk(chunk_ctx *k, const double *hid, const int64_t *ids, int64_t t0, int64_t n,
                            moe_block_out *out, moe_error *err) {
    const moe_layer *L = k->L;
    const moe_run_opts *o = k->o;
    int E = L->cfg.n_experts, K = L->cfg.top_k, H = L->cfg.hidden, C = k->C;
    bool f32 = k->f32;
    double *logits = out->router_logits + t0 * E;
    moe_status st = moe_router_logits(L, f32, o->router, hid, n, logits, err);
    if (st != MOE_OK) return st;

    /* route */
    st = moe_router_route(L, f32, &k->c, k->v, ids, t0, n, out, err);
    if (st != MOE_OK) return st;
    memset(k->count, 0, (size_t)(E + 1) * sizeof *k->count);
    for (int64_t t = 0; t < n; t++)
        for (int j = 0; j < K; j++) k->count[out->topk_ids[(t0 + t) * C + j]]++;
    k->start[0] = 0;
    for (int e = 0; e <= E; e++) k->start[e + 1] = k->start[e] + k->count[e];
    /* assignments sorted by expert, then token, then column: a stable fill */
    int64_t *fill = moe_calloc((size_t)E + 1, sizeof *fill);
    if (!fill) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    for (int64_t t = 0; t < n; t++)
        for (int j = 0; j < K; j++) {
            int e = out->topk_ids[(t0 + t) * C + j];
            k->assign[k->start[e] + fill[e]++] = t * C + j;
        }
    free(fill);

    /* experts, the shared one as index E; parallel over experts, each writes
     * its own (token, column) rows. */
    moe_status first = MOE_OK;
    int has_shared = L->cfg.shared_inter > 0;
    const void *rows = hid;
    float *rows_f = NULL;
    if (f32) { /* the chunk's tokens in float, gathered per expert from here */
        rows_f = moe_malloc((size_t)(n * H), sizeof(float));
        if (!rows_f) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        for (int64_t i = 0; i < n * H; i++) rows_f[i] = (float)hid[i];
        rows = rows_f;
    }
    if (f32) {
        first = run_experts_f32(k, rows_f, n, err);
    } else {
#pragma omp parallel for schedule(dynamic, 1)
        for (int e = 0; e <= E; e++) {
            if (e == E && !has_shared) continue;
            moe_error local;
            moe_status s = run_expert(k, e, rows, n, &local);
            if (s != MOE_OK) {
#pragma omp critical
                {
                    if (first == MOE_OK) { first = s; if (err) *err = local; }
                }
            }
        }
    }
    free(rows_f);
    if (first != MOE_OK) return first;

    /* combine, per token in column order (invariant 2) */
    size_t es = f32 ? sizeof(float) : sizeof(double);
    const char *Y = f32 ? (const char *)k->Yf : (const char *)k->Y;
    const char *Ysh = f32 ? (const char *)k->Yshf : (const char *)k->Ysh;
    const void *ys[256];
    for (int64_t t = 0; t < n; t++) {
        for (int j = 0; j < K; j++) ys[j] = Y + ((size_t)t * (size_t)C + (size_t)j) * (size_t)H * es;
        moe_combine_token(&k->c, f32, K, C, H, out->topk_weights + (t0 + t) * C, ys,
                          has_shared ? Ysh + (size_t)t * (size_t)H * es : NULL, out->routed_out + (t0 + t) * H,
                          out->shared_out + (t0 + t) * H, out->moe_out + (t0 + t) * H);
    }
    return MOE_OK;
}

moe_status moe_block_run(const moe_layer *L, const double *hidden, const int64_t *input_ids, int64_t T,
                         const moe_run_opts *opts, moe_block_out *out, moe_error *err) {
    return moe_block_run_variant(L, hidden, input_ids, T, opts, NULL, out, err);
}

moe_status moe_block_run_variant(const moe_layer *L, const double *hidden, const int64_t *input_ids, int64_t T,
                                 const moe_run_opts *opts, const moe_variant *v, moe_block_out *out,
                                 moe_error *err) {
    MOE_ASSERT(L && opts && out);
    if (v && v->score_override > (int)MOE_SCORE_SQRTSOFTPLUS)
        return moe_errf(err, MOE_ERR_ARG, "unknown score override %d", v->score_override);
    int E = L->cfg.n_experts, H = L->cfg.hidden;
    int C = n_cols_for(L, opts);
    if (out->T != T || out->H != H || out->E != E || out->n_cols != C)
        return moe_errf(err, MOE_ERR_ARG, "output buffers were sized for another layer, T or shared mode");
    moe_status st = moe_router_check_ids(&L->cfg, L->index, input_ids, T, 0, err);
    if (st != MOE_OK) return st;
    if ((st = moe_act_check_layer(L, opts->act, err)) != MOE_OK) return st;
    chunk_ctx k;
    memset(&k, 0, sizeof k);
    k.L = L;
    k.o = opts;
    k.v = v;
    k.f32 = opts->precision == MOE_PREC_F32;
    k.C = C;
    st = moe_contract_applied(opts->owner, opts->fuse_shared && L->cfg.shared_inter > 0, L->cfg.scaling, v, &k.c, err);
    if (st != MOE_OK) return st;
    if (k.f32 && (st = moe_cpu_table(opts->isa, &k.kern, err)) != MOE_OK) return st;
    if (T == 0) return MOE_OK;

    int64_t cn = T < CHUNK ? T : CHUNK;
    size_t es = k.f32 ? sizeof(float) : sizeof(double);
    k.count = moe_calloc((size_t)E + 1, sizeof *k.count);
    k.start = moe_calloc((size_t)E + 2, sizeof *k.start);
    k.assign = moe_calloc((size_t)cn * (size_t)C, sizeof *k.assign);
    void *Y = moe_calloc((size_t)cn * (size_t)C * (size_t)H, es);
    void *Ysh = moe_calloc((size_t)cn * (size_t)H, es);
    if (!k.count || !k.start || !k.assign || !Y || !Ysh) {
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for a chunk of %lld tokens", (long long)cn);
        goto done;
    }
    if (k.f32) { k.Yf = Y; k.Yshf = Ysh; } else { k.Y = Y; k.Ysh = Ysh; }
    for (int64_t t0 = 0; t0 < T && st == MOE_OK; t0 += CHUNK) {
        int64_t n = T - t0 < CHUNK ? T - t0 : CHUNK;
        st = run_chunk(&k, hidden + t0 * H, input_ids, t0, n, out, err);
    }
    if (st == MOE_OK && opts->check_invariants) st = moe_block_check_variant(L, out, opts, v, err);
done:
    free(k.count);
    free(k.start);
    free(k.assign);
    free(Y);
    free(Ysh);
    return st;
}

/* ------------------------------------------------------- invariant check */

moe_status moe_block_check(const moe_layer *L, const moe_block_out *out, const moe_run_opts *opts,
                           moe_error *err) {
    return moe_block_check_variant(L, out, opts, NULL, err);
}

moe_status moe_block_check_variant(const moe_layer *L, const moe_block_out *out, const moe_run_opts *opts,
                                   const moe_variant *v, moe_error *err) {
    MOE_ASSERT(L && out && opts);
    return moe_contract_check(&L->cfg, L->index, out, opts->precision == MOE_PREC_F32, v, err);
}
