/*
 * The block's stages, shared by every driver of the block: moe_block_run
 * (block.c), expert parallelism (src/mpi/ep.c) and the GPU path's contract
 * (src/cuda). One implementation each, so that every driver routes, applies
 * the scaling contract and combines identically (bit for bit).
 */
#ifndef MOE_BLOCK_INTERNAL_H
#define MOE_BLOCK_INTERNAL_H

#include "moeaudit.h"
#include "moeaudit_variant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The contract a run applies: moe_contract_for(owner) with v's deliberate
 * break on top (v NULL: none). MOE_ERR_ARG for impossible combinations. */
moe_status moe_block_contract(const moe_layer *L, const moe_run_opts *o, const moe_variant *v, moe_contract *c,
                              moe_error *err);

/* Token ids of a hash layer (cfg->kind MOE_LAYER_HASH; others: MOE_OK): ids
 * present when T > 0 and each inside [0, cfg->vocab). MOE_ERR_INPUT names the
 * first bad one as input_ids[offset + t] and the layer `index`. */
moe_status moe_block_check_ids(const moe_block_config *cfg, int index, const int64_t *ids, int64_t T, int64_t offset,
                               moe_error *err);

/* Router logits [n, E] of hid [n, H]: float64, or a float32 GEMM when f32 or
 * rp asks for bf16 inputs/logits. */
moe_status moe_block_logits(const moe_layer *L, bool f32, moe_router_prec rp, const double *hid, int64_t n,
                            double *logits, moe_error *err);

/* Route tokens [t0, t0 + n) of out (their router_logits filled): topk_ids,
 * topk_weights (with c->router_mult) and eff_weights; the fused shared
 * column when out->n_cols > K. ids: token ids (hash layers) or NULL. */
moe_status moe_block_route(const moe_layer *L, const moe_run_opts *o, const moe_variant *v, const moe_contract *c,
                           const int64_t *ids, int64_t t0, int64_t n, moe_block_out *out, moe_error *err);

/* One expert over n rows in the path's precision (float for MOE_PREC_F32,
 * else double): row q is src[src_idx[q]] (or src[q]), rounded to o->act,
 * and its output goes to dst[dst_idx[q]] (or dst[q]); H columns each. */
moe_status moe_block_expert_rows(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double limit,
                                 const moe_run_opts *o, int H, int64_t n, const void *src, const int64_t *src_idx,
                                 void *dst, const int64_t *dst_idx, moe_error *err);

/* Combine one token: ys[j] is column j's expert output row (float or
 * double per f32), sh_row the shared expert's row or NULL; tw [C] the
 * emitted weights. Writes routed_out, shared_out, moe_out rows [H]. */
void moe_block_combine_token(const moe_contract *c, bool f32, int K, int C, int H, const double *tw,
                             const void *const *ys, const void *sh_row, double *ro, double *so, double *mo);

#ifdef __cplusplus
}
#endif
#endif
