/*
 * One MoE block: router -> routed experts grouped by expert -> combine.
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
 */
#include "core/core.h"
#include "experts/act.h"
#include "experts/experts.h"
#include "experts/experts_fast.h"
#include "experts/block_internal.h"
#include "router/router.h"
#include "moe_formats.h"

#include <math.h>
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

/* The contract actually applied, faults included. */
moe_status moe_block_contract(const moe_layer *L, const moe_run_opts *o, moe_contract *c, moe_error *err) {
    double s = L->cfg.scaling;
    bool fused = o->fuse_shared && L->cfg.shared_inter > 0;
    moe_status st = moe_contract_for(o->owner, fused, s, c, err);
    if (st != MOE_OK) return st;
    switch (o->fault) {
    case MOE_FAULT_SCALE_DOUBLE:
        if (o->owner == MOE_SCALE_ROUTER) c->runner_mult = s;
        else if (o->owner == MOE_SCALE_RUNNER) c->output_mult = s;
        else c->router_mult = s;
        break;
    case MOE_FAULT_SCALE_MISSING:
        c->router_mult = c->runner_mult = c->output_mult = 1.0;
        break;
    case MOE_FAULT_SHARED_WEIGHT:
        if (!fused)
            return moe_errf(err, MOE_ERR_ARG, "the SHARED_WEIGHT fault needs fused shared experts");
        c->fused_shared_w = o->owner == MOE_SCALE_RUNNER ? 1.0 : 1.0 / s;
        break;
    default:
        break;
    }
    return MOE_OK;
}

/* In the f32 path every combine step is rounded to float: a double op on
 * float operands followed by a rounding is exactly the float op. */
static inline double rnd(bool f32, double v) { return f32 ? (double)(float)v : v; }

typedef struct chunk_ctx {
    const moe_layer *L;
    const moe_run_opts *o;
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

/* A 64-byte aligned block of `bytes` (0: a minimal one); free() releases it. */
static void *alloc64(size_t bytes) {
    size_t b = (bytes + 63) & ~(size_t)63;
    return aligned_alloc(64, b ? b : 64);
}

/* The fast experts over jobs on the active CPU table (f32 path). */
static moe_status run_fast_jobs(const moe_run_opts *o, double limit, const moe_expert_job *jobs, int njobs,
                                moe_error *err) {
    const moe_cpu_kernels *k = moe_cpu_active();
    int nth = moe_experts_fast_threads();
    void *scr = alloc64(moe_experts_fast_scratch(k, o->act, jobs, njobs, nth));
    if (!scr) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for the experts' scratch");
    moe_experts_fast(k, limit, o->act, jobs, njobs, scr, nth);
    free(scr);
    return MOE_OK;
}

moe_status moe_block_expert_rows(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double limit,
                                 const moe_run_opts *o, int H, int64_t n, const void *src, const int64_t *src_idx,
                                 void *dst, const int64_t *dst_idx, moe_error *err) {
    if (n == 0) return MOE_OK;
    bool f32 = o->precision == MOE_PREC_F32;
    int64_t I = w1->rows;
    size_t xs = (size_t)n * (size_t)H, ss = f32 ? 0 : moe_expert_scratch(H, I, n);
    size_t es = f32 ? sizeof(float) : sizeof(double), row = (size_t)H * es;
    char *buf = moe_malloc(2 * xs + ss, es);
    if (!buf) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for expert %s (%lld rows)", w1->name, (long long)n);
    char *X = buf, *Yo = buf + xs * es, *scr = Yo + xs * es;
    for (int64_t q = 0; q < n; q++) {
        memcpy(X + (size_t)q * row, (const char *)src + (size_t)(src_idx ? src_idx[q] : q) * row, row);
        if (f32) moe_act_round_f32(o->act, (float *)(void *)X + q * H, H);
        else moe_act_round_f64(o->act, (double *)(void *)X + q * H, H);
    }
    moe_status st = MOE_OK;
    if (f32) {
        moe_expert_job job = {w1, w3, w2, (const float *)(void *)X, (float *)(void *)Yo, n};
        st = run_fast_jobs(o, limit, &job, 1, err);
    } else {
        moe_expert_ref(w1, w3, w2, limit, o->act, (const double *)(void *)X, n, (double *)(void *)Yo,
                       (double *)(void *)scr);
    }
    if (st == MOE_OK)
        for (int64_t q = 0; q < n; q++)
            memcpy((char *)dst + (size_t)(dst_idx ? dst_idx[q] : q) * row, Yo + (size_t)q * row, row);
    free(buf);
    return st;
}

/* The f32 path of a chunk: every routed expert with tokens and the shared
 * one in one moe_experts_fast call (work split by (expert, row tile) over
 * all threads). rows_f: the chunk's n tokens [n, H] in float. */
static moe_status run_experts_f32(chunk_ctx *k, const float *rows_f, int64_t n, moe_error *err) {
    const moe_layer *L = k->L;
    int E = L->cfg.n_experts, H = L->cfg.hidden, C = k->C;
    int has_shared = L->cfg.shared_inter > 0;
    int64_t total = k->start[E] + (has_shared ? n : 0);
    float *Xa = moe_malloc((size_t)total * (size_t)H, sizeof(float));
    float *Ya = moe_malloc((size_t)total * (size_t)H, sizeof(float));
    moe_expert_job *jobs = moe_calloc((size_t)E + 1, sizeof *jobs);
    if (!Xa || !Ya || !jobs) {
        free(Xa); free(Ya); free(jobs);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory for the experts of %lld tokens", (long long)n);
    }
    size_t row = (size_t)H * sizeof(float);
    int nj = 0;
    /* the gather and the caller's rounding, over all threads: row q of the
     * assignment list (sorted by expert) is token assign[q] / C */
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < k->start[E]; q++) {
        float *x = Xa + (size_t)q * (size_t)H;
        memcpy(x, rows_f + (size_t)(k->assign[q] / C) * (size_t)H, row);
        moe_act_round_f32(k->o->act, x, H);
    }
    for (int e = 0; e < E; e++) {
        int64_t c = k->count[e];
        if (c == 0) continue;
        jobs[nj++] = (moe_expert_job){&L->w1[e], &L->w3[e], &L->w2[e], Xa + (size_t)k->start[e] * (size_t)H,
                                      Ya + (size_t)k->start[e] * (size_t)H, c};
    }
    if (has_shared) {
        float *x = Xa + (size_t)k->start[E] * (size_t)H;
        memcpy(x, rows_f, (size_t)n * row);
        moe_act_round_f32(k->o->act, x, n * H);
        jobs[nj++] = (moe_expert_job){&L->sw1, &L->sw3, &L->sw2, x, Ya + (size_t)k->start[E] * (size_t)H, n};
    }
    moe_status st = run_fast_jobs(k->o, L->cfg.swiglu_limit, jobs, nj, err);
    if (st == MOE_OK) {
#pragma omp parallel for schedule(static)
        for (int64_t q = 0; q < k->start[E]; q++)
            memcpy(k->Yf + (size_t)k->assign[q] * (size_t)H, Ya + (size_t)q * (size_t)H, row);
        if (has_shared) memcpy(k->Yshf, Ya + (size_t)k->start[E] * (size_t)H, (size_t)n * row);
    }
    free(Xa);
    free(Ya);
    free(jobs);
    return st;
}

/* Run expert e (e == E: shared) over its assigned tokens of this chunk;
 * rows: the chunk's tokens in the path's precision. */
static moe_status run_expert(chunk_ctx *k, int e, const void *rows, int64_t n_tok, moe_error *err) {
    const moe_layer *L = k->L;
    int E = L->cfg.n_experts, H = L->cfg.hidden;
    if (e == E)
        return moe_block_expert_rows(&L->sw1, &L->sw3, &L->sw2, L->cfg.swiglu_limit, k->o, H, n_tok, rows, NULL,
                                     k->f32 ? (void *)k->Yshf : (void *)k->Ysh, NULL, err);
    int64_t n = k->count[e];
    if (n == 0) return MOE_OK;
    const int64_t *as = k->assign + k->start[e];
    int64_t *src = moe_malloc((size_t)n, sizeof *src);
    if (!src) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    for (int64_t q = 0; q < n; q++) src[q] = as[q] / k->C;
    moe_status st = moe_block_expert_rows(&L->w1[e], &L->w3[e], &L->w2[e], L->cfg.swiglu_limit, k->o, H, n, rows, src,
                                          k->f32 ? (void *)k->Yf : (void *)k->Y, as, err);
    free(src);
    return st;
}

/* Router logits [n, E] for the chunk's tokens: each gate row decoded once. */
moe_status moe_block_logits(const moe_layer *L, bool f32, moe_router_prec rp, const double *hid, int64_t n,
                            double *logits, moe_error *err) {
    int E = L->cfg.n_experts, H = L->cfg.hidden;
    if (f32 || rp != MOE_ROUTER_PATH) {
        /* float32 GEMM (fp32 accumulation), optionally on bf16 inputs */
        float *row = moe_malloc((size_t)H, sizeof(float));
        float *X = moe_malloc((size_t)n * (size_t)H, sizeof(float));
        if (!row || !X) { free(row); free(X); return moe_errf(err, MOE_ERR_NOMEM, "out of memory"); }
        for (int64_t i = 0; i < n * H; i++) X[i] = (float)hid[i];
        if (rp != MOE_ROUTER_PATH) moe_act_round_f32(MOE_ACT_BF16, X, n * H);
        for (int e = 0; e < E; e++) {
            moe_weight_row_f32(&L->gate, e, row);
            for (int64_t t = 0; t < n; t++) {
                float s = 0.0f;
                for (int h = 0; h < H; h++) s += X[t * H + h] * row[h];
                logits[t * E + e] = rp == MOE_ROUTER_BF16_LOGITS ? moe_bf16_to_f32(moe_bf16_from_f32(s)) : s;
            }
        }
        free(row);
        free(X);
    } else {
        double *row = moe_malloc((size_t)H, sizeof(double));
        if (!row) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        for (int e = 0; e < E; e++) {
            moe_weight_row_f64(&L->gate, e, row);
            for (int64_t t = 0; t < n; t++) {
                double s = 0.0;
                for (int h = 0; h < H; h++) s += hid[t * H + h] * row[h];
                logits[t * E + e] = s;
            }
        }
        free(row);
    }
    return MOE_OK;
}

moe_status moe_block_check_ids(const moe_block_config *cfg, int index, const int64_t *ids, int64_t T, int64_t offset,
                               moe_error *err) {
    if (cfg->kind != MOE_LAYER_HASH) return MOE_OK;
    if (!ids && T > 0) return moe_errf(err, MOE_ERR_INPUT, "layer %d is hash-routed: input_ids are required", index);
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= cfg->vocab)
            return moe_errf(err, MOE_ERR_INPUT,
                            "input_ids[%lld] = %lld is outside the vocabulary [0, %d) of layer %d's tid2eid",
                            (long long)(offset + t), (long long)ids[t], cfg->vocab, index);
    return MOE_OK;
}

static moe_status run_chunk(chunk_ctx *k, const double *hid, const int64_t *ids, int64_t t0, int64_t n,
                            moe_block_out *out, moe_error *err) {
    const moe_layer *L = k->L;
    const moe_run_opts *o = k->o;
    int E = L->cfg.n_experts, K = L->cfg.top_k, H = L->cfg.hidden, C = k->C;
    bool f32 = k->f32;
    double *logits = out->router_logits + t0 * E;
    moe_status st = moe_block_logits(L, f32, o->router, hid, n, logits, err);
    if (st != MOE_OK) return st;

    /* route */
    st = moe_block_route(L, o, &k->c, ids, t0, n, out, err);
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
        moe_block_combine_token(&k->c, f32, K, C, H, out->topk_weights + (t0 + t) * C, ys,
                                has_shared ? Ysh + (size_t)t * (size_t)H * es : NULL, out->routed_out + (t0 + t) * H,
                                out->shared_out + (t0 + t) * H, out->moe_out + (t0 + t) * H);
    }
    return MOE_OK;
}

moe_status moe_block_route(const moe_layer *L, const moe_run_opts *o, const moe_contract *c, const int64_t *ids,
                           int64_t t0, int64_t n, moe_block_out *out, moe_error *err) {
    int E = L->cfg.n_experts, K = L->cfg.top_k, C = out->n_cols;
    bool f32 = o->precision == MOE_PREC_F32, fused = C > K;
    double work[1024]; /* E <= 512 on the stack; larger E on the heap */
    double *wk = E <= 512 ? work : moe_malloc(2 * (size_t)E, sizeof(double));
    double wraw[256];
    if (!wk || K > 256) {
        if (wk != work) free(wk);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory (E = %d, K = %d)", E, K);
    }
    for (int64_t t = 0; t < n; t++) {
        int32_t *tid = out->topk_ids + (t0 + t) * C;
        double *tw = out->topk_weights + (t0 + t) * C, *ew = out->eff_weights + (t0 + t) * C;
        moe_route_token(L, out->router_logits + (t0 + t) * E, ids ? ids[t0 + t] : 0, o, tid, wraw, wk);
        for (int j = 0; j < K; j++) {
            double w = rnd(f32, wraw[j]);
            tw[j] = rnd(f32, w * c->router_mult);
            ew[j] = tw[j] * c->runner_mult * c->output_mult;
        }
        if (fused) {
            tid[K] = E; /* the shared expert as column E */
            tw[K] = rnd(f32, c->fused_shared_w);
            ew[K] = tw[K] * c->runner_mult;
        }
    }
    if (wk != work) free(wk);
    return MOE_OK;
}

void moe_block_combine_token(const moe_contract *c, bool f32, int K, int C, int H, const double *tw,
                             const void *const *ys, const void *sh_row, double *ro, double *so, double *mo) {
    bool fused = C > K;
    for (int h = 0; h < H; h++) {
        double part = 0.0;
        for (int j = 0; j < K; j++) {
            double y = f32 ? (double)((const float *)ys[j])[h] : ((const double *)ys[j])[h];
            part = rnd(f32, part + rnd(f32, tw[j] * y));
        }
        double sh = sh_row ? (f32 ? (double)((const float *)sh_row)[h] : ((const double *)sh_row)[h]) : 0.0;
        so[h] = sh;
        ro[h] = rnd(f32, rnd(f32, part * c->runner_mult) * c->output_mult);
        if (fused) {
            double all = rnd(f32, part + rnd(f32, tw[K] * sh));
            mo[h] = rnd(f32, all * c->runner_mult);
        } else {
            mo[h] = rnd(f32, ro[h] + sh);
        }
    }
}

moe_status moe_block_run(const moe_layer *L, const double *hidden, const int64_t *input_ids, int64_t T,
                         const moe_run_opts *opts, moe_block_out *out, moe_error *err) {
    MOE_ASSERT(L && opts && out);
    int E = L->cfg.n_experts, H = L->cfg.hidden;
    int C = n_cols_for(L, opts);
    if (out->T != T || out->H != H || out->E != E || out->n_cols != C)
        return moe_errf(err, MOE_ERR_ARG, "output buffers were sized for another layer, T or shared mode");
    moe_status st = moe_block_check_ids(&L->cfg, L->index, input_ids, T, 0, err);
    if (st != MOE_OK) return st;
    chunk_ctx k;
    memset(&k, 0, sizeof k);
    k.L = L;
    k.o = opts;
    k.f32 = opts->precision == MOE_PREC_F32;
    k.C = C;
    if (k.f32) { /* a bad MOE_ISA is an error of the run that would use it */
        const moe_cpu_kernels *kt;
        st = moe_cpu_kernels_for(NULL, &kt, err);
        if (st != MOE_OK) return st;
    }
    st = moe_block_contract(L, opts, &k.c, err);
    if (st != MOE_OK) return st;
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
    if (st == MOE_OK && opts->check_invariants) st = moe_block_check(L, out, opts, err);
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
    const moe_block_config *c = &L->cfg;
    int E = c->n_experts, K = c->top_k, H = c->hidden, C = out->n_cols;
    double s = c->scaling;
    /* Tolerances: the reference rounds each weight a handful of times in
     * float64 (eps 1.1e-16); the f32 path rounds emitted weights and the
     * combine to float (eps 6e-8) a few times per step. */
    double tol = opts->precision == MOE_PREC_F32 ? 1e-5 : 1e-12;
    double *p = moe_malloc((size_t)E, sizeof *p);
    if (!p) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    moe_status st = MOE_OK;
    for (int64_t t = 0; t < out->T && st == MOE_OK; t++) {
        const double *lg = out->router_logits + t * E;
        bool finite = true;
        for (int e = 0; e < E; e++) finite = finite && isfinite(lg[e]);
        if (!finite) continue; /* a NaN token's weights are NaN by definition */
        moe_router_scores(opts->score_override >= 0 ? (moe_score_func)opts->score_override : c->score, E, lg, p);
        const int32_t *id = out->topk_ids + t * C;
        const double *ew = out->eff_weights + t * C;
        double sum = 0.0, esum = 0.0;
        for (int j = 0; j < K; j++) sum += p[id[j]];
        for (int j = 0; j < K; j++) {
            double want = s * (c->renormalize ? p[id[j]] / (sum + opts->renorm_eps) : p[id[j]]);
            esum += ew[j];
            if (!(fabs(ew[j] - want) <= tol * fabs(want) + 1e-300)) {
                st = moe_errf(err, MOE_ERR_INVARIANT,
                              "layer %d token %lld column %d (expert %d): effective routed weight %.17g, "
                              "expected s * w = %.17g (s = %g): the factor is applied %s",
                              L->index, (long long)t, j, id[j], ew[j], want, s,
                              fabs(ew[j] - s * want) <= tol * fabs(s * want) ? "twice"
                              : fabs(ew[j] * s - want) <= tol * fabs(want) ? "never" : "wrongly");
                break;
            }
        }
        if (st != MOE_OK) break;
        if (c->renormalize && !(fabs(esum - s) <= tol * s * K)) {
            st = moe_errf(err, MOE_ERR_INVARIANT, "layer %d token %lld: effective routed weights sum to %.17g, not s = %g",
                          L->index, (long long)t, esum, s);
            break;
        }
        for (int j = K; j < C; j++)
            if (!(fabs(ew[j] - 1.0) <= tol)) {
                st = moe_errf(err, MOE_ERR_INVARIANT,
                              "layer %d token %lld: effective shared-expert weight is %.17g, not 1", L->index,
                              (long long)t, ew[j]);
                break;
            }
        if (st != MOE_OK) break;
        const double *ro = out->routed_out + t * H, *so = out->shared_out + t * H, *mo = out->moe_out + t * H;
        double mag = 0.0;
        for (int h = 0; h < H; h++) mag = fmax(mag, fabs(ro[h]) + fabs(so[h]));
        for (int h = 0; h < H; h++)
            if (!(fabs(mo[h] - (ro[h] + so[h])) <= tol * mag + 1e-300)) {
                st = moe_errf(err, MOE_ERR_INVARIANT,
                              "layer %d token %lld: moe_out[%d] = %.17g is not routed_out + shared_out = %.17g",
                              L->index, (long long)t, h, mo[h], ro[h] + so[h]);
                break;
            }
    }
    free(p);
    return st;
}
