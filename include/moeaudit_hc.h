/*
 * moeaudit_hc.h: manifold-constrained hyper-connections (mHC) of DeepSeek V4
 * (docs/semantics.md section 3, docs/hc.md).
 *
 * Worked example: the FFN hyper-connection of layer 3, float64 reference.
 *
 *     moe_hc_weights *hc = NULL;
 *     if (moe_hc_load(model, 3, MOE_HC_FFN, &hc, &err) != MOE_OK) { ... }
 *     size_t ws_bytes = moe_hc_workspace_size(&hc->cfg);
 *     void *ws = malloc(ws_bytes);
 *     // streams: double [T, n, H]
 *     moe_hc_forward(hc, MOE_HC_REF, streams, T, pre, post, comb, collapsed, ws);
 *     // pre [T, n], post [T, n], comb [T, n, n], collapsed [T, H]
 *     moe_hc_weights_free(hc);
 *
 * Per token, with X the streams [n, H], v = vec(X) [n*H]:
 *     m    = (fn . v) * rsqrt(mean(v^2) + rms_eps)      the "MHC linear", [(2+n)*n]
 *     pre  = sigmoid(m[0:n]  * scale[0] + base[0:n]) + hc_eps
 *     post = 2 * sigmoid(m[n:2n] * scale[1] + base[n:2n])
 *     comb = softmax_rows(m[2n:] * scale[2] + base[2n:]) + hc_eps        [n, n]
 *     comb = comb / (column sums + hc_eps); (iters - 1) times: rows then columns
 *     collapsed = sum_j pre_j * X_j                                          [H]
 * The caller's next step is X'_k = post_k * F(collapsed) + sum_j comb[j, k] X_j
 * (comb is used transposed).
 */
#ifndef MOEAUDIT_HC_H
#define MOEAUDIT_HC_H

#include "moeaudit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which sublayer's hyper-connection: hc_attn_* or hc_ffn_* tensors. */
typedef enum moe_hc_site {
    MOE_HC_ATTN,
    MOE_HC_FFN
} moe_hc_site;

/* Precision of the MHC linear (fn . v). Everything else on the non-reference
 * paths (rsqrt, sigmoid, softmax, Sinkhorn, collapse) runs in fp32, as the
 * engines do; MOE_HC_REF is float64 throughout. */
typedef enum moe_hc_prec {
    MOE_HC_REF,        /* float64 everywhere: the definition */
    MOE_HC_F32,        /* fp32 inputs, fp32 products and accumulation */
    MOE_HC_TF32,       /* v and fn rounded to 10-bit mantissas (nearest even), fp32 accumulation */
    MOE_HC_BF16,       /* v and fn rounded to bf16, fp32 accumulation */
    MOE_HC_BF16_SPLIT, /* bf16 hi/lo split: a = ah + al (both bf16), ah*bh + ah*bl + al*bh, fp32 accumulation */
    MOE_HC_PREC_COUNT
} moe_hc_prec;

/* "ref", "f32", "tf32", "bf16", "bf16-split" (_parse also takes "fp32", "f64"). */
const char *moe_hc_prec_name(moe_hc_prec p);
bool moe_hc_prec_parse(const char *s, moe_hc_prec *p);

/* Largest hc_mult (streams) the forward's per-token scratch holds; V4 uses 4. */
#define MOE_HC_MAX_MULT 64

typedef struct moe_hc_config {
    int n;            /* hc_mult (streams) */
    int H;            /* hidden size of one stream */
    int iters;        /* hc_sinkhorn_iters (>= 1) */
    double hc_eps;    /* hc_eps */
    double rms_eps;   /* rms_norm_eps */
} moe_hc_config;

/* One hyper-connection's parameters, as float64 (exact for BF16/F32 storage). */
typedef struct moe_hc_weights {
    moe_hc_config cfg;
    double *fn;       /* [(2+n)*n, n*H] */
    double *base;     /* [(2+n)*n] */
    double scale[3];  /* pre, post, comb */
} moe_hc_weights;

/* Load layer `layer`'s hc_attn_* or hc_ffn_* tensors (fn, base, scale; F64,
 * F32, F16 or BF16) and hc_mult, hc_sinkhorn_iters, hc_eps, rms_norm_eps
 * from config.json. MOE_ERR_MISSING names an absent tensor or key,
 * MOE_ERR_SHAPE a tensor whose shape does not match the config, MOE_ERR_DTYPE
 * a non-float tensor. *out is owned by the caller (moe_hc_weights_free). */
moe_status moe_hc_load(moe_model *m, int layer, moe_hc_site site, moe_hc_weights **out,
                       moe_error *err);

/* Weights from caller arrays (copied): fn [(2+n)*n, n*H], base [(2+n)*n],
 * scale [3]. MOE_ERR_ARG for n < 1, H < 1 or iters < 1. */
moe_status moe_hc_weights_init(const moe_hc_config *cfg, const double *fn, const double *base,
                               const double *scale, moe_hc_weights **out, moe_error *err);
void moe_hc_weights_free(moe_hc_weights *w); /* NULL is a no-op */

/* Bytes of workspace one moe_hc_forward call needs (independent of T). */
size_t moe_hc_workspace_size(const moe_hc_config *cfg);

/*
 * Run the hyper-connection on T tokens.
 *   streams   double [T, n, H]
 *   pre       double [T, n]      or NULL
 *   post      double [T, n]      or NULL
 *   comb      double [T, n, n]   or NULL (comb[t, j, k]: row j, column k)
 *   collapsed double [T, H]      or NULL
 *   ws        moe_hc_workspace_size bytes, any alignment of malloc
 * Outputs hold the path's values widened to double. Never allocates; tokens
 * are independent (a NaN in one token's streams poisons only that token).
 * Thread safety: concurrent calls with distinct ws and outputs are safe.
 */
void moe_hc_forward(const moe_hc_weights *w, moe_hc_prec prec, const double *streams, int64_t T,
                    double *pre, double *post, double *comb, double *collapsed, void *ws);

/*
 * The stream update after a sublayer (post expand + comb mix), per token:
 *   out[t, k, :] = post[t, k] * f[t, :] + sum_j comb[t, j, k] * X[t, j, :]
 *   X, out [T, n, H] (distinct), post [T, n], comb [T, n, n], f [T, H]: the
 *   sublayer's output. The sum runs over j in order, then the post term is
 *   added (transformers' matmul then add). f32: float32 arithmetic on the
 *   float-rounded operands (results widened to double). Never allocates.
 */
void moe_hc_expand(int n, int H, int64_t T, const double *post, const double *comb, const double *f,
                   const double *X, double *out, bool f32);

/*
 * The final hyper-connection head (no Sinkhorn): per token, v = vec(X),
 *   pre = sigmoid((fn . v) * rsqrt(mean(v^2) + rms_eps) * scale + base) + hc_eps
 *   y   = sum_j pre_j * X_j
 *   X [T, n, H], fn [n, n*H], base [n], y [T, H]. f32: float32 arithmetic.
 */
void moe_hc_head_forward(int n, int H, int64_t T, const double *fn, const double *base, double scale,
                         double rms_eps, double hc_eps, const double *X, double *y, bool f32);

/* How far a matrix c [n, n] is from doubly stochastic: the largest
 * |row sum - 1| or |column sum - 1|. */
double moe_hc_ds_deviation(const double *c, int n);

/* One audit row: a precision of the MHC linear against the float64 reference
 * on the same streams. Relative errors are per token, infinity-norm based:
 * max_t ||x_t - ref_t||_inf / ||ref_t||_inf (0 when both are 0). */
typedef struct moe_hc_audit_row {
    moe_hc_prec prec;
    double collapsed_rel_err;   /* of collapsed [T, H] */
    double post_rel_err;        /* of post [T, n] */
    double pre_rel_err;         /* of pre [T, n] */
    double comb_max_abs_err;    /* max |comb - comb_ref| */
    double comb_ds_dev;         /* max over tokens of moe_hc_ds_deviation(comb_t) */
    double comb_ds_dev_ref;     /* the same for the reference (Sinkhorn's own residual) */
} moe_hc_audit_row;

/* Audit every precision in `precs` [n_prec] on streams [T, n, H]; rows
 * [n_prec] out. Allocates its own scratch (MOE_ERR_NOMEM). Pure computation. */
moe_status moe_hc_audit(const moe_hc_weights *w, const double *streams, int64_t T,
                        const moe_hc_prec *precs, int n_prec, moe_hc_audit_row *rows,
                        moe_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MOEAUDIT_HC_H */
