/* Router: scores, (grouped) biased top-k, hash routing. Float64 reference. */
#ifndef MOE_ROUTER_H
#define MOE_ROUTER_H

#include "moeaudit.h"
#include "moeaudit_variant.h"

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

#endif
