/*
 * RoPE of DeepSeek-V4 (docs/model.md section 3) and the stage's small
 * helpers (the linear wrapper, RMSNorm).
 *
 * Invariants:
 *  1. Frequencies are float64 throughout: inv_freq[k] = 1 / theta^(2k/dim),
 *     YaRN blends inv_freq / factor and inv_freq with transformers 5.17's
 *     ramp (floor/ceil correction range clamped to [0, dim - 1], ramp over
 *     dim / 2 pairs). The angle of pair k at position p is p * inv_freq[k].
 *  2. Pairs are interleaved: channels (2k, 2k + 1) of the rotated slice.
 *     y0 = x0 cos - x1 sin, y1 = x1 cos + x0 sin; the inverse uses -sin.
 */
#include "attn/attn.h"
#include "core/core.h"
#include "linalg/linear.h"

#include <math.h>
#include <string.h>

moe_status moe_attn_linear(const moe_weight *w, const double *X, int64_t ldx, int64_t T, double *Y, int64_t ldy,
                           bool f32, const moe_cpu_kernels *kt, moe_error *err) {
    if (!f32) return moe_linear_f64_with(kt, w, X, ldx, T, Y, ldy, err);
    if (T == 0 || w->rows == 0) return MOE_OK;
    float *xf = moe_malloc((size_t)(T * w->cols), sizeof *xf);
    float *yf = moe_malloc((size_t)(T * w->rows), sizeof *yf);
    if (!xf || !yf) {
        free(xf);
        free(yf);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory for the float32 linear %s [%lld tokens]",
                        w->name ? w->name : "(unnamed)", (long long)T);
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < w->cols; k++) xf[t * w->cols + k] = (float)X[t * ldx + k];
    moe_status st = moe_linear_f32_with(kt, w, xf, w->cols, T, yf, w->rows, err);
    if (st == MOE_OK)
        for (int64_t t = 0; t < T; t++)
            for (int64_t r = 0; r < w->rows; r++) Y[t * ldy + r] = (double)yf[t * w->rows + r];
    free(xf);
    free(yf);
    return st;
}

void moe_attn_rmsnorm(double *x, int n, const double *weight, double eps, bool f32) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss = moe_fl(ss + moe_fl(x[i] * x[i], f32), f32);
    double r = moe_fl(1.0 / moe_fl(sqrt(moe_fl(moe_fl(ss / n, f32) + eps, f32)), f32), f32);
    for (int i = 0; i < n; i++) {
        double v = moe_fl(x[i] * r, f32);
        x[i] = weight ? moe_fl(weight[i] * v, f32) : v;
    }
}

/* ---------------------------------------------------------------- RoPE */

static double correction_dim(double rotations, int dim, double base, double max_pos) {
    return (double)dim * log(max_pos / (rotations * 2.0 * 3.14159265358979323846)) / (2.0 * log(base));
}

moe_status moe_rope_init(moe_rope *r, const moe_rope_config *c, int dim, moe_error *err) {
    memset(r, 0, sizeof *r);
    if (dim < 2 || dim % 2)
        return moe_errf(err, MOE_ERR_CONFIG, "the rotary dimension %d must be an even number >= 2", dim);
    if (!(c->theta > 1) || !isfinite(c->theta))
        return moe_errf(err, MOE_ERR_CONFIG, "rope_theta = %.17g must be a finite number > 1", c->theta);
    if (c->yarn && (!(c->factor > 0) || !(c->original_max_pos > 0) || !(c->beta_fast > 0) || !(c->beta_slow > 0)))
        return moe_errf(err, MOE_ERR_CONFIG,
                        "YaRN parameters factor = %g, original_max_position_embeddings = %g, beta_fast = %g, "
                        "beta_slow = %g must be > 0", c->factor, c->original_max_pos, c->beta_fast, c->beta_slow);
    int half = dim / 2;
    r->inv_freq = moe_malloc((size_t)half, sizeof *r->inv_freq);
    if (!r->inv_freq) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for RoPE frequencies");
    r->dim = dim;
    r->attn_factor = c->attention_factor;
    double low = 0, high = 0;
    if (c->yarn) {
        low = correction_dim(c->beta_fast, dim, c->theta, c->original_max_pos);
        high = correction_dim(c->beta_slow, dim, c->theta, c->original_max_pos);
        if (c->truncate) {
            low = floor(low);
            high = ceil(high);
        }
        if (low < 0) low = 0;
        if (high > dim - 1) high = dim - 1;
        if (low == high) high += 0.001;
    }
    for (int k = 0; k < half; k++) {
        double extrap = 1.0 / pow(c->theta, (double)(2 * k) / (double)dim);
        if (!c->yarn) {
            r->inv_freq[k] = extrap;
            continue;
        }
        double interp = 1.0 / (c->factor * pow(c->theta, (double)(2 * k) / (double)dim));
        double ramp = ((double)k - low) / (high - low);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        double ef = 1.0 - ramp; /* transformers' inv_freq_extrapolation_factor */
        r->inv_freq[k] = interp * (1.0 - ef) + extrap * ef;
    }
    return MOE_OK;
}

void moe_rope_free(moe_rope *r) {
    if (!r) return;
    free(r->inv_freq);
    r->inv_freq = NULL;
}

void moe_rope_angles(const moe_rope *r, int64_t pos, double *cs, bool f32) {
    for (int k = 0; k < r->dim / 2; k++) {
        double a = (double)pos * r->inv_freq[k];
        if (f32) a = (double)(float)((float)pos * (float)r->inv_freq[k]);
        cs[2 * k] = moe_fl(moe_fl(cos(a), f32) * r->attn_factor, f32);
        cs[2 * k + 1] = moe_fl(moe_fl(sin(a), f32) * r->attn_factor, f32);
    }
}

void moe_rope_rotate(const double *cs, double *x, int dim, bool inverse, bool f32) {
    for (int k = 0; k < dim / 2; k++) {
        double c = cs[2 * k], s = inverse ? -cs[2 * k + 1] : cs[2 * k + 1];
        double x0 = x[2 * k], x1 = x[2 * k + 1];
        x[2 * k] = moe_fl(moe_fl(x0 * c, f32) - moe_fl(x1 * s, f32), f32);
        x[2 * k + 1] = moe_fl(moe_fl(x1 * c, f32) + moe_fl(x0 * s, f32), f32);
    }
}
