/*
 * Routing a batch: the token ids a hash layer needs, then per token the
 * top-k of moe_route_token with the weights the router emits under the
 * scaling contract (docs/contract.md) and the fused shared column.
 *
 * Invariants:
 *  1. The router multiplies by c->router_mult alone; eff_weights records
 *     router_mult * runner_mult * output_mult, what the block applies in all
 *     (the fused shared column: its weight times runner_mult).
 *  2. In the f32 path every emitted weight is rounded to float after each
 *     operation (a double op on float operands rounded to float is exactly
 *     the float op), so the CPU, MPI and GPU drivers emit the same bits.
 *  3. Tokens are independent: token t's outputs depend on its logits and id
 *     alone.
 */
#include "router/router.h"
#include "core/core.h"

/* In the f32 path every step is rounded to float (invariant 2). */
static inline double rnd(bool f32, double v) { return f32 ? (double)(float)v : v; }

moe_status moe_router_check_ids(const moe_block_config *cfg, int index, const int64_t *ids, int64_t T,
                                int64_t offset, moe_error *err) {
    if (cfg->kind != MOE_LAYER_HASH) return MOE_OK;
    if (!ids && T > 0) return moe_errf(err, MOE_ERR_INPUT, "layer %d is hash-routed: input_ids are required", index);
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= cfg->vocab)
            return moe_errf(err, MOE_ERR_INPUT,
                            "input_ids[%lld] = %lld is outside the vocabulary [0, %d) of layer %d's tid2eid",
                            (long long)(offset + t), (long long)ids[t], cfg->vocab, index);
    return MOE_OK;
}

moe_status moe_router_route(const moe_layer *L, bool f32, const moe_contract *c, const moe_variant *v,
                            const int64_t *ids, int64_t t0, int64_t n, moe_block_out *out, moe_error *err) {
    int E = L->cfg.n_experts, K = L->cfg.top_k, C = out->n_cols;
    bool fused = C > K;
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
        moe_route_token(L, out->router_logits + (t0 + t) * E, ids ? ids[t0 + t] : 0, v, tid, wraw, wk);
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
