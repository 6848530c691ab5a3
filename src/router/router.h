/*
 * The router stage: everything routing (docs/semantics.md section 1) behind
 * one header that every driver (CPU block, MPI, CUDA host) includes.
 *
 *   moe_router_logits    gate GEMM, float64 / f32 / bf16 variants   (logits.c)
 *   moe_router_scores    sigmoid | sqrtsoftplus | softmax           (router.c)
 *   moe_route_token      (grouped) biased top-k or hash routing,
 *                        weights from the unbiased scores, renorm   (router.c)
 *   moe_router_route     a batch: emitted weights under the scaling
 *                        contract, effective weights, fused shared
 *                        column                                     (route.c)
 *   moe_router_check_ids token ids of a hash layer                  (route.c)
 *
 * Thread safety: every function is pure on its arguments; concurrent calls
 * are safe on distinct outputs. Nothing here allocates except route (large E).
 */
#ifndef MOE_ROUTER_H
#define MOE_ROUTER_H

#include "moeaudit.h"
#include "moeaudit_variant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Router logits [n, E] of hid [n, H]: float64 (f32 false and rp
 * MOE_ROUTER_PATH), else a float32 GEMM, on bf16-rounded inputs when rp
 * asks, with bf16-rounded logits for MOE_ROUTER_BF16_LOGITS. MOE_ERR_NOMEM
 * only. */
moe_status moe_router_logits(const moe_layer *L, bool f32, moe_router_prec rp, const double *hid, int64_t n,
                             double *logits, moe_error *err);

/* Scores p [E] from logits [E] by the layer's scoring function.
 * sqrtsoftplus(l) = sqrt(log1p(exp(l))), softplus(l) = l above 20. */
void moe_router_scores(moe_score_func f, int E, const double *logits, double *p);

/*
 * Route one token.
 *   logits [E]; token_id (hash layers; validated by the caller)
 *   ids [K] out: chosen experts, descending biased score then ascending id
 *                (hash layers: tid2eid order)
 *   w   [K] out: the router's weights before any routed_scaling_factor:
 *                p[ids] (unbiased scores), renormalized when configured
 *   work [2 * E] scratch
 * Ties: lower expert id wins; among equal group scores the lower group id.
 * NaN scores never win a comparison, so a NaN token still yields K distinct
 * ids (and NaN weights). v (NULL: the specified routing) may override the
 * scoring function, drop the bias, mask dropped groups with 0.0, change
 * renorm_eps, or apply the NOT_RENORMALIZED / BIASED_WEIGHTS faults.
 */
void moe_route_token(const moe_layer *L, const double *logits, int64_t token_id,
                     const moe_variant *v, int32_t *ids, double *w, double *work);

/* The groups a token's biased scores pb [E] keep (c->n_group > 1 and
 * c->topk_group < c->n_group): keep [n_group] set to 1 for the topk_group
 * groups with the largest sum of their two largest scores (ties and NaN as
 * above), 0 for the others. moe_route_token masks the experts of the others;
 * the diagnosis' flip search uses it to rebuild the block's weights of any
 * expert set exactly. n_group <= 1024. */
void moe_router_group_keep(const moe_block_config *c, const double *pb, unsigned char *keep);

/* Route tokens [t0, t0 + n) of out (their router_logits filled): topk_ids,
 * topk_weights (the router's weights times c->router_mult) and eff_weights
 * (times runner_mult and output_mult too), each rounded to float when f32;
 * the fused shared column (id E, weight c->fused_shared_w) when
 * out->n_cols > K. ids: token ids [T] (hash layers) or NULL. v: as
 * moe_route_token. MOE_ERR_NOMEM when E > 512 and the scratch cannot be
 * allocated, or K > 256. */
moe_status moe_router_route(const moe_layer *L, bool f32, const moe_contract *c, const moe_variant *v,
                            const int64_t *ids, int64_t t0, int64_t n, moe_block_out *out, moe_error *err);

/* Token ids of a hash layer (cfg->kind MOE_LAYER_HASH; others: MOE_OK): ids
 * present when T > 0 and each inside [0, cfg->vocab). MOE_ERR_INPUT names the
 * first bad one as input_ids[offset + t] and the layer `index`. */
moe_status moe_router_check_ids(const moe_block_config *cfg, int index, const int64_t *ids, int64_t T,
                                int64_t offset, moe_error *err);

#ifdef __cplusplus
}
#endif
#endif
