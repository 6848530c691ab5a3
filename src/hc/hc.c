/*
 * mHC hyper-connections (docs/semantics.md section 3, docs/hc.md).
 *
 * Invariants:
 *  1. The float64 path (MOE_HC_REF) is the definition. It follows HF
 *     transformers 5.17 DeepseekV4HyperConnection step by step: RMS factor of
 *     the flattened streams, linear, sigmoid/softmax, comb + hc_eps, one
 *     column normalisation, then (iters - 1) row-then-column rounds, each sum
 *     offset by hc_eps. (HF normalises before the linear, DeepSeek's inference
 *     code multiplies the rsqrt after it: equal in exact arithmetic; we
 *     multiply after, as the fused engine kernels do.)
 *  2. The other paths differ from the reference only where engines differ:
 *     the linear's operands and products (tf32, bf16, bf16 split) and fp32
 *     for everything else. Reductions run in index order, so results do not
 *     depend on threads or on the other tokens.
 *  3. moe_hc_forward never allocates; its scratch is the caller's ws.
 */
#include "moeaudit_hc.h"
#include "core/core.h"
#include "formats/mathf.h"
#include "io/model_util.h"
#include "moe_formats.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static const char *const prec_names[MOE_HC_PREC_COUNT] = {"ref", "f32", "tf32", "bf16", "bf16-split"};

const char *moe_hc_prec_name(moe_hc_prec p) {
    return (unsigned)p < MOE_HC_PREC_COUNT ? prec_names[p] : "?";
}

bool moe_hc_prec_parse(const char *s, moe_hc_prec *p) {
    for (int i = 0; i < MOE_HC_PREC_COUNT; i++)
        if (!strcmp(s, prec_names[i])) { *p = (moe_hc_prec)i; return true; }
    if (!strcmp(s, "fp32")) { *p = MOE_HC_F32; return true; } /* older spelling */
    if (!strcmp(s, "f64")) { *p = MOE_HC_REF; return true; }
    return false;
}

/* ------------------------------------------------------------- weights */

moe_status moe_hc_weights_init(const moe_hc_config *cfg, const double *fn, const double *base,
                               const double *scale, moe_hc_weights **out, moe_error *err) {
    if (cfg->n < 1 || cfg->H < 1 || cfg->iters < 1 || cfg->n > MOE_HC_MAX_MULT)
        return moe_errf(err, MOE_ERR_ARG, "hyper-connection config n=%d H=%d iters=%d: need 1 <= n <= %d, H >= 1, iters >= 1",
                        cfg->n, cfg->H, cfg->iters, MOE_HC_MAX_MULT);
    size_t rows = (size_t)(2 + cfg->n) * (size_t)cfg->n, cols = (size_t)cfg->n * (size_t)cfg->H;
    moe_hc_weights *w = moe_calloc(1, sizeof *w);
    if (!w) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for hyper-connection weights");
    w->cfg = *cfg;
    w->fn = moe_malloc(rows * cols, sizeof(double));
    w->base = moe_malloc(rows, sizeof(double));
    if (!w->fn || !w->base) {
        moe_hc_weights_free(w);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory for hyper-connection weights [%zu, %zu]", rows, cols);
    }
    if (fn) memcpy(w->fn, fn, rows * cols * sizeof(double));
    if (base) memcpy(w->base, base, rows * sizeof(double));
    if (scale) memcpy(w->scale, scale, sizeof w->scale);
    *out = w;
    return MOE_OK;
}

void moe_hc_weights_free(moe_hc_weights *w) {
    if (!w) return;
    free(w->fn);
    free(w->base);
    free(w);
}

moe_status moe_hc_load(moe_model *m, int layer, moe_hc_site site, moe_hc_weights **out, moe_error *err) {
    const moe_model_info *info = moe_model_get_info(m);
    if (layer < 0 || layer >= info->n_layers)
        return moe_errf(err, MOE_ERR_ARG, "layer %d out of range: the model has %d layers", layer, info->n_layers);
    cJSON *root = cJSON_Parse(moe_model_config_json(m));
    if (!root) return moe_errf(err, MOE_ERR_FORMAT, "config.json: not valid JSON");
    moe_hc_config cfg = {0};
    cfg.H = info->hidden;
    /* required: hc_mult in [1, MOE_HC_MAX_MULT] (the forward's fixed scratch),
     * Sinkhorn iterations in [1, 10000] (V4: 20), finite numbers >= 0 */
    const char *cj = "config.json";
    moe_status st = moe_cfg_int(root, cj, "hc_mult", true, 0, 1, MOE_HC_MAX_MULT, &cfg.n, err);
    if (st == MOE_OK) st = moe_cfg_int(root, cj, "hc_sinkhorn_iters", true, 0, 1, 10000, &cfg.iters, err);
    if (st == MOE_OK) st = moe_cfg_num(root, cj, "hc_eps", true, 0, 0.0, &cfg.hc_eps, err);
    if (st == MOE_OK) st = moe_cfg_num(root, cj, "rms_norm_eps", true, 0, 0.0, &cfg.rms_eps, err);
    cJSON_Delete(root);
    if (st != MOE_OK) return st;
    /* the tensors are found and their shapes checked before anything is
     * sized from the config (moe_model_load_f64_alloc), then copied */
    const char *tag = site == MOE_HC_ATTN ? "attn" : "ffn";
    char name[128];
    int64_t rows = (int64_t)(2 + cfg.n) * cfg.n, cols = (int64_t)cfg.n * cfg.H;
    int64_t s_fn[2] = {rows, cols}, s_base[1] = {rows}, s_scale[1] = {3};
    double *fn = NULL, *base = NULL, *scale = NULL;
    snprintf(name, sizeof name, "layers.%d.hc_%s_fn", layer, tag);
    st = moe_model_load_f64_alloc(m, name, 2, s_fn, &fn, err);
    if (st == MOE_OK) {
        snprintf(name, sizeof name, "layers.%d.hc_%s_base", layer, tag);
        st = moe_model_load_f64_alloc(m, name, 1, s_base, &base, err);
    }
    if (st == MOE_OK) {
        snprintf(name, sizeof name, "layers.%d.hc_%s_scale", layer, tag);
        st = moe_model_load_f64_alloc(m, name, 1, s_scale, &scale, err);
    }
    moe_hc_weights *w = NULL;
    if (st == MOE_OK) st = moe_hc_weights_init(&cfg, fn, base, scale, &w, err);
    free(fn);
    free(base);
    free(scale);
    if (st != MOE_OK) return st;
    *out = w;
    return MOE_OK;
}

/* ------------------------------------------------------------- rounding */

/* fp32 -> tf32 (8-bit exponent, 10-bit mantissa), nearest even; Inf/NaN kept. */
static inline float round_tf32(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7F800000u) == 0x7F800000u) return x;
    u = (u + 0xFFFu + ((u >> 13) & 1u)) & ~0x1FFFu;
    float r;
    memcpy(&r, &u, 4);
    return r;
}

/* ------------------------------------------------------------- forward */

size_t moe_hc_workspace_size(const moe_hc_config *cfg) {
    size_t rows = (size_t)(2 + cfg->n) * (size_t)cfg->n, K = (size_t)cfg->n * (size_t)cfg->H;
    /* v as double [n*H] + m [rows] + comb [n*n]; rounded v hi/lo as float [2 * n*H]; fn rounded
     * to the path's precision once per call, hi/lo as float [2 * rows * n*H] */
    return (K + rows + (size_t)cfg->n * (size_t)cfg->n) * sizeof(double) + 2 * K * sizeof(float) +
           2 * rows * K * sizeof(float) + 64;
}

static double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }
/* The f32 path's exp is the project's (formats/mathf.h), not libm's: its
 * bits are the same on every x86-64, as the f32 expert path's. */
static float sigmoid_f(float x) { return 1.0f / (1.0f + moe_expf_f32(-x)); }

/* Reference token: everything in float64. */
static void token_ref(const moe_hc_weights *w, const double *X /*[n*H]*/, double *m /*[rows]*/,
                      double *c /*[n*n]*/, double *pre, double *post, double *comb, double *collapsed) {
    const int n = w->cfg.n, H = w->cfg.H, K = n * H, rows = (2 + n) * n;
    double ss = 0;
    for (int i = 0; i < K; i++) ss += X[i] * X[i];
    double r = 1.0 / sqrt(ss / K + w->cfg.rms_eps);
    for (int o = 0; o < rows; o++) {
        const double *f = w->fn + (size_t)o * K;
        double acc = 0;
        for (int i = 0; i < K; i++) acc += f[i] * X[i];
        m[o] = acc * r;
    }
    const double eps = w->cfg.hc_eps;
    double p[64];
    for (int j = 0; j < n; j++) {
        p[j] = sigmoid_d(m[j] * w->scale[0] + w->base[j]) + eps;
        if (pre) pre[j] = p[j];
        if (post) post[j] = 2.0 * sigmoid_d(m[n + j] * w->scale[1] + w->base[n + j]);
    }
    for (int j = 0; j < n; j++) {
        double *row = c + j * n, mx = -INFINITY, s = 0;
        for (int k = 0; k < n; k++) {
            row[k] = m[2 * n + j * n + k] * w->scale[2] + w->base[2 * n + j * n + k];
            if (row[k] > mx) mx = row[k];
        }
        for (int k = 0; k < n; k++) { row[k] = exp(row[k] - mx); s += row[k]; }
        for (int k = 0; k < n; k++) row[k] = row[k] / s + eps;
    }
    for (int it = 0; it < w->cfg.iters; it++) {
        if (it > 0)
            for (int j = 0; j < n; j++) {
                double s = 0;
                for (int k = 0; k < n; k++) s += c[j * n + k];
                for (int k = 0; k < n; k++) c[j * n + k] /= s + eps;
            }
        for (int k = 0; k < n; k++) {
            double s = 0;
            for (int j = 0; j < n; j++) s += c[j * n + k];
            for (int j = 0; j < n; j++) c[j * n + k] /= s + eps;
        }
    }
    if (comb) memcpy(comb, c, (size_t)n * n * sizeof(double));
    if (collapsed)
        for (int h = 0; h < H; h++) {
            double acc = 0;
            for (int j = 0; j < n; j++) acc += p[j] * X[j * H + h];
            collapsed[h] = acc;
        }
}

/* fn [rows, K] rounded as `prec` reads it: fh (and fl, the bf16 split's
 * low halves) [rows, K]. */
static void round_fn(const moe_hc_weights *w, moe_hc_prec prec, float *fh, float *fl) {
    const size_t n = (size_t)(2 + w->cfg.n) * (size_t)w->cfg.n * (size_t)w->cfg.n * (size_t)w->cfg.H;
    for (size_t i = 0; i < n; i++) {
        float f = (float)w->fn[i];
        switch (prec) {
        case MOE_HC_TF32: fh[i] = round_tf32(f); break;
        case MOE_HC_BF16: fh[i] = moe_bf16_round(f); break;
        case MOE_HC_BF16_SPLIT: fh[i] = moe_bf16_round(f); fl[i] = moe_bf16_round(f - fh[i]); break;
        default: fh[i] = f; break;
        }
    }
}

/* Engine token: the linear at `prec` (fn already rounded into fh/fl), the rest in fp32. */
static void token_f32(const moe_hc_weights *w, moe_hc_prec prec, const float *fhn, const float *fln,
                      const double *Xd /*[n*H]*/, float *xh, float *xl, double *m /*[rows]*/, double *pre,
                      double *post, double *comb, double *collapsed) {
    const int n = w->cfg.n, H = w->cfg.H, K = n * H, rows = (2 + n) * n;
    float ss = 0;
    for (int i = 0; i < K; i++) {
        float x = (float)Xd[i];
        ss += x * x;
        switch (prec) {
        case MOE_HC_TF32: xh[i] = round_tf32(x); break;
        case MOE_HC_BF16: xh[i] = moe_bf16_round(x); break;
        case MOE_HC_BF16_SPLIT: xh[i] = moe_bf16_round(x); xl[i] = moe_bf16_round(x - xh[i]); break;
        default: xh[i] = x; break;
        }
    }
    float r = 1.0f / sqrtf(ss / (float)K + (float)w->cfg.rms_eps);
    for (int o = 0; o < rows; o++) {
        const float *fh = fhn + (size_t)o * K, *fl = fln + (size_t)o * K;
        float acc = 0;
        if (prec == MOE_HC_BF16_SPLIT) {
            for (int i = 0; i < K; i++) {
                acc += fh[i] * xh[i];
                acc += fh[i] * xl[i];
                acc += fl[i] * xh[i];
            }
        } else {
            for (int i = 0; i < K; i++) acc += fh[i] * xh[i];
        }
        m[o] = (double)(acc * r);
    }
    const float eps = (float)w->cfg.hc_eps;
    float p[64], c[64 * 64];
    for (int j = 0; j < n; j++) {
        p[j] = sigmoid_f((float)m[j] * (float)w->scale[0] + (float)w->base[j]) + eps;
        if (pre) pre[j] = p[j];
        if (post) post[j] = 2.0f * sigmoid_f((float)m[n + j] * (float)w->scale[1] + (float)w->base[n + j]);
    }
    for (int j = 0; j < n; j++) {
        float *row = c + j * n, mx = -INFINITY, s = 0;
        for (int k = 0; k < n; k++) {
            row[k] = (float)m[2 * n + j * n + k] * (float)w->scale[2] + (float)w->base[2 * n + j * n + k];
            if (row[k] > mx) mx = row[k];
        }
        for (int k = 0; k < n; k++) { row[k] = moe_expf_f32(row[k] - mx); s += row[k]; }
        for (int k = 0; k < n; k++) row[k] = row[k] / s + eps;
    }
    for (int it = 0; it < w->cfg.iters; it++) {
        if (it > 0)
            for (int j = 0; j < n; j++) {
                float s = 0;
                for (int k = 0; k < n; k++) s += c[j * n + k];
                for (int k = 0; k < n; k++) c[j * n + k] /= s + eps;
            }
        for (int k = 0; k < n; k++) {
            float s = 0;
            for (int j = 0; j < n; j++) s += c[j * n + k];
            for (int j = 0; j < n; j++) c[j * n + k] /= s + eps;
        }
    }
    if (comb)
        for (int i = 0; i < n * n; i++) comb[i] = c[i];
    if (collapsed)
        for (int h = 0; h < H; h++) {
            float acc = 0;
            for (int j = 0; j < n; j++) acc += p[j] * (float)Xd[j * H + h];
            collapsed[h] = acc;
        }
}

void moe_hc_forward(const moe_hc_weights *w, moe_hc_prec prec, const double *streams, int64_t T,
                    double *pre, double *post, double *comb, double *collapsed, void *ws) {
    MOE_ASSERT(w && ws && (unsigned)prec < MOE_HC_PREC_COUNT && w->cfg.n <= MOE_HC_MAX_MULT);
    const int n = w->cfg.n, H = w->cfg.H, K = n * H, rows = (2 + n) * n;
    double *m = (double *)ws;
    double *c = m + rows;
    float *xh = (float *)(c + n * n), *xl = xh + K;
    float *fh = xl + K, *fl = fh + (size_t)rows * K;
    if (prec != MOE_HC_REF && T > 0) round_fn(w, prec, fh, fl);
    for (int64_t t = 0; t < T; t++) {
        const double *X = streams + (size_t)t * K;
        double *o_pre = pre ? pre + t * n : NULL, *o_post = post ? post + t * n : NULL;
        double *o_comb = comb ? comb + t * n * n : NULL, *o_col = collapsed ? collapsed + t * H : NULL;
        if (prec == MOE_HC_REF) token_ref(w, X, m, c, o_pre, o_post, o_comb, o_col);
        else token_f32(w, prec, fh, fl, X, xh, xl, m, o_pre, o_post, o_comb, o_col);
    }
}

/* ------------------------------------------------- stream update, head */

static inline double fl_(double x, bool f32) { return f32 ? (double)(float)x : x; }

void moe_hc_expand(int n, int H, int64_t T, const double *post, const double *comb, const double *f,
                   const double *X, double *out, bool f32) {
    for (int64_t t = 0; t < T; t++) {
        const double *Xt = X + (size_t)t * n * H, *ct = comb + (size_t)t * n * n, *ft = f + (size_t)t * H;
        double *ot = out + (size_t)t * n * H;
        for (int k = 0; k < n; k++) {
            const double pk = fl_(post[t * n + k], f32);
            for (int h = 0; h < H; h++) {
                double acc = 0;
                for (int j = 0; j < n; j++) acc = fl_(acc + fl_(fl_(ct[j * n + k], f32) * Xt[(size_t)j * H + h], f32), f32);
                ot[(size_t)k * H + h] = fl_(fl_(pk * ft[h], f32) + acc, f32);
            }
        }
    }
}

void moe_hc_head_forward(int n, int H, int64_t T, const double *fn, const double *base, double scale,
                         double rms_eps, double hc_eps, const double *X, double *y, bool f32) {
    MOE_ASSERT(n >= 1 && n <= 64);
    const int K = n * H;
    for (int64_t t = 0; t < T; t++) {
        const double *Xt = X + (size_t)t * K;
        double ss = 0;
        for (int i = 0; i < K; i++) ss = fl_(ss + fl_(Xt[i] * Xt[i], f32), f32);
        const double r = fl_(1.0 / fl_(sqrt(fl_(fl_(ss / K, f32) + rms_eps, f32)), f32), f32);
        double pre[64];
        for (int j = 0; j < n; j++) {
            const double *fj = fn + (size_t)j * K;
            double acc = 0;
            for (int i = 0; i < K; i++) acc = fl_(acc + fl_(fl_(fj[i], f32) * Xt[i], f32), f32);
            double z = fl_(fl_(fl_(acc * r, f32) * scale, f32) + base[j], f32);
            pre[j] = fl_(fl_(1.0 / fl_(1.0 + fl_(exp(-z), f32), f32), f32) + hc_eps, f32);
        }
        for (int h = 0; h < H; h++) {
            double acc = 0;
            for (int j = 0; j < n; j++) acc = fl_(acc + fl_(pre[j] * Xt[(size_t)j * H + h], f32), f32);
            y[(size_t)t * H + h] = acc;
        }
    }
}

/* --------------------------------------------------------------- audit */

double moe_hc_ds_deviation(const double *c, int n) {
    double dev = 0;
    for (int j = 0; j < n; j++) {
        double r = 0, s = 0;
        for (int k = 0; k < n; k++) { r += c[j * n + k]; s += c[k * n + j]; }
        dev = fmax(dev, fmax(fabs(r - 1.0), fabs(s - 1.0)));
        if (isnan(r) || isnan(s)) return NAN;
    }
    return dev;
}

/* max over rows of ||a - b||_inf / ||b||_inf; rows [T, len]. */
static double rel_err_rows(const double *a, const double *b, int64_t T, int len) {
    double worst = 0;
    for (int64_t t = 0; t < T; t++) {
        double num = 0, den = 0;
        for (int i = 0; i < len; i++) {
            double d = fabs(a[t * len + i] - b[t * len + i]);
            if (isnan(d)) return NAN;
            num = fmax(num, d);
            den = fmax(den, fabs(b[t * len + i]));
        }
        double e = den > 0 ? num / den : (num > 0 ? INFINITY : 0);
        worst = fmax(worst, e);
    }
    return worst;
}

moe_status moe_hc_audit(const moe_hc_weights *w, const double *streams, int64_t T,
                        const moe_hc_prec *precs, int n_prec, moe_hc_audit_row *rows,
                        moe_error *err) {
    const int n = w->cfg.n, H = w->cfg.H;
    size_t tn = (size_t)T * n, tnn = tn * n, th = (size_t)T * H;
    size_t per = 2 * tn + tnn + th; /* pre, post, comb, collapsed */
    double *ref = moe_malloc(2 * per + 1, sizeof(double));
    void *ws = moe_malloc(moe_hc_workspace_size(&w->cfg), 1);
    if (!ref || !ws) {
        free(ref);
        free(ws);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory auditing %lld tokens", (long long)T);
    }
    double *r_pre = ref, *r_post = r_pre + tn, *r_comb = r_post + tn, *r_col = r_comb + tnn;
    double *p_pre = ref + per, *p_post = p_pre + tn, *p_comb = p_post + tn, *p_col = p_comb + tnn;
    moe_hc_forward(w, MOE_HC_REF, streams, T, r_pre, r_post, r_comb, r_col, ws);
    double ds_ref = 0;
    for (int64_t t = 0; t < T; t++) ds_ref = fmax(ds_ref, moe_hc_ds_deviation(r_comb + t * n * n, n));
    for (int i = 0; i < n_prec; i++) {
        moe_hc_audit_row *row = &rows[i];
        memset(row, 0, sizeof *row);
        row->prec = precs[i];
        moe_hc_forward(w, precs[i], streams, T, p_pre, p_post, p_comb, p_col, ws);
        row->collapsed_rel_err = rel_err_rows(p_col, r_col, T, H);
        row->post_rel_err = rel_err_rows(p_post, r_post, T, n);
        row->pre_rel_err = rel_err_rows(p_pre, r_pre, T, n);
        for (size_t k = 0; k < tnn; k++) row->comb_max_abs_err = fmax(row->comb_max_abs_err, fabs(p_comb[k] - r_comb[k]));
        for (int64_t t = 0; t < T; t++) row->comb_ds_dev = fmax(row->comb_ds_dev, moe_hc_ds_deviation(p_comb + t * n * n, n));
        row->comb_ds_dev_ref = ds_ref;
    }
    free(ref);
    free(ws);
    return MOE_OK;
}
