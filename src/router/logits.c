/*
 * Router logits: the gate GEMM, logits [n, E] = hid [n, H] . gate^T, in the
 * precision the run asks for (docs/semantics.md section 1: float64 in the
 * reference; engines use fp32, HF V3 and SGLang on bf16 inputs).
 *
 * Invariants:
 *  1. Each gate row is decoded once per call (moe_weight_row_f64 / _f32) and
 *     each logit is one dot product summed in index order, so a token's
 *     logits do not depend on the other tokens of the batch.
 *  2. The float32 path accumulates in fp32 (s = s + x * w, two roundings);
 *     MOE_ROUTER_BF16_INPUT rounds the hidden states to bf16 first,
 *     MOE_ROUTER_BF16_LOGITS also rounds each logit (a bf16 F.linear).
 */
#include "router/router.h"
#include "core/core.h"
#include "formats/act.h"
#include "moe_formats.h"

moe_status moe_router_logits(const moe_layer *L, bool f32, moe_router_prec rp, const double *hid, int64_t n,
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
