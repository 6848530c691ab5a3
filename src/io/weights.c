/*
 * Loading a linear weight from a checkpoint: which tensors make it, their
 * shapes and dtypes (docs/formats.md, "Checkpoint layouts"). What the loaded
 * weight's values are is src/formats/weights.c's (moe_weight_row_f64).
 *
 * Invariants:
 *  1. A moe_weight never owns memory: data and scale point into mappings.
 *  2. A weight is returned only when every companion tensor (scales, the
 *     NVFP4 per-tensor scale) exists with the shape and dtype its format
 *     needs; otherwise the error names the directory, tensor and value.
 */
#include "core/core.h"
#include "io/weights.h"

#include <float.h>
#include <math.h>
#include <string.h>

static moe_wfmt plain_fmt(moe_dtype t, bool *ok) {
    *ok = true;
    switch (t) {
    case MOE_DTYPE_F64: return MOE_WFMT_F64;
    case MOE_DTYPE_F32: return MOE_WFMT_F32;
    case MOE_DTYPE_F16: return MOE_WFMT_F16;
    case MOE_DTYPE_BF16: return MOE_WFMT_BF16;
    default: *ok = false; return MOE_WFMT_F32;
    }
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int64_t numel(const moe_st_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

/* FP8 E4M3 weight with 128 x 128 tile scales: "<base>.weight_scale_inv" F32
 * (HF V3; dequantize by multiplying) or "<base>.scale" E8M0 (V4 native). The
 * scale grid is derived from the weight's shape: transformers writes routed
 * experts' scales squeezed ([2] for a [1, 2] grid), so any shape with the
 * right element count is accepted. */
static moe_status load_fp8_block(moe_ckpt *ck, const char *base, const moe_st_tensor *t, moe_weight *w,
                                 moe_error *err) {
    const char *dir = moe_ckpt_dir(ck);
    if (t->ndim != 2 || t->shape[0] != w->rows || t->shape[1] != w->cols)
        return moe_errf(err, MOE_ERR_SHAPE, "%s: FP8 tensor %s.weight must have shape [%lld, %lld]", dir, base,
                        (long long)w->rows, (long long)w->cols);
    char sname[300];
    const moe_st_tensor *s = NULL;
    snprintf(sname, sizeof sname, "%s.weight_scale_inv", base);
    moe_status st = moe_ckpt_lookup(ck, sname, &s, err);
    if (st == MOE_OK && !s) {
        snprintf(sname, sizeof sname, "%s.scale", base);
        st = moe_ckpt_lookup(ck, sname, &s, err);
    }
    if (st != MOE_OK) return st; /* a shard that cannot be read: its own message */
    if (!s)
        return moe_errf(err, MOE_ERR_MISSING,
                        "%s: FP8 weight %s.weight has no block scales (%s.weight_scale_inv or %s.scale)", dir, base,
                        base, base);
    int64_t gr = ceil_div(w->rows, 128), gc = ceil_div(w->cols, 128);
    if (s->dtype != MOE_DTYPE_F32 && s->dtype != MOE_DTYPE_F8_E8M0)
        return moe_errf(err, MOE_ERR_DTYPE, "%s: scale tensor %s has dtype %s; expected F32 or F8_E8M0", dir, sname,
                        moe_dtype_name(s->dtype));
    if (numel(s) != gr * gc)
        return moe_errf(err, MOE_ERR_SHAPE,
                        "%s: scale tensor %s has %lld elements; a [%lld, %lld] weight in 128x128 tiles needs %lld x %lld",
                        dir, sname, (long long)numel(s), (long long)w->rows, (long long)w->cols, (long long)gr,
                        (long long)gc);
    w->fmt = MOE_WFMT_FP8_BLOCK;
    w->scale = s->data;
    w->scale_dtype = s->dtype;
    w->scale_rows = gr;
    w->scale_cols = gc;
    return MOE_OK;
}

/* Packed E2M1 weight [rows, cols / 2]: MXFP4 with "<base>.scale" E8M0
 * [rows, cols / 32] (V4 native experts), or NVFP4 with "<base>.weight_scale"
 * F8_E4M3 [rows, cols / 16] and "<base>.weight_scale_2" F32 (ModelOpt). */
static moe_status load_fp4(moe_ckpt *ck, const char *base, const moe_st_tensor *t, moe_weight *w, moe_error *err) {
    const char *dir = moe_ckpt_dir(ck);
    if (w->cols % 32 != 0 || t->ndim != 2 || t->shape[0] != w->rows || t->shape[1] != w->cols / 2)
        return moe_errf(err, MOE_ERR_SHAPE, "%s: packed FP4 tensor %s.weight must have shape [%lld, %lld] "
                        "(two E2M1 codes per byte, %lld inputs)", dir, base, (long long)w->rows,
                        (long long)(w->cols / 2), (long long)w->cols);
    char sname[300], s2name[300];
    const moe_st_tensor *s = NULL, *s2 = NULL;
    moe_status st;
    snprintf(sname, sizeof sname, "%s.scale", base);
    if ((st = moe_ckpt_lookup(ck, sname, &s, err)) != MOE_OK) return st;
    if (s) {
        if (s->dtype != MOE_DTYPE_F8_E8M0 && s->dtype != MOE_DTYPE_U8)
            return moe_errf(err, MOE_ERR_DTYPE, "%s: MXFP4 scale %s has dtype %s; expected F8_E8M0", dir, sname,
                            moe_dtype_name(s->dtype));
        if (numel(s) != w->rows * (w->cols / 32))
            return moe_errf(err, MOE_ERR_SHAPE, "%s: MXFP4 scale %s must have shape [%lld, %lld]", dir, sname,
                            (long long)w->rows, (long long)(w->cols / 32));
        w->fmt = MOE_WFMT_MXFP4;
        w->scale = s->data;
        w->scale_dtype = MOE_DTYPE_F8_E8M0;
        w->scale_rows = w->rows;
        w->scale_cols = w->cols / 32;
        return MOE_OK;
    }
    snprintf(sname, sizeof sname, "%s.weight_scale", base);
    snprintf(s2name, sizeof s2name, "%s.weight_scale_2", base);
    if ((st = moe_ckpt_lookup(ck, sname, &s, err)) != MOE_OK) return st;
    if (!s)
        return moe_errf(err, MOE_ERR_MISSING, "%s: packed FP4 weight %s.weight has neither %s.scale (MXFP4) nor "
                        "%s.weight_scale (NVFP4)", dir, base, base, base);
    if ((st = moe_ckpt_find(ck, s2name, &s2, err)) != MOE_OK) return st;
    if (s->dtype != MOE_DTYPE_F8_E4M3 && s->dtype != MOE_DTYPE_U8)
        return moe_errf(err, MOE_ERR_DTYPE, "%s: NVFP4 scale %s has dtype %s; expected F8_E4M3", dir, sname,
                        moe_dtype_name(s->dtype));
    if (numel(s) != w->rows * (w->cols / 16))
        return moe_errf(err, MOE_ERR_SHAPE, "%s: NVFP4 scale %s must have shape [%lld, %lld]", dir, sname,
                        (long long)w->rows, (long long)(w->cols / 16));
    if (!moe_dtype_is_float(s2->dtype) || numel(s2) != 1)
        return moe_errf(err, MOE_ERR_SHAPE, "%s: %s must be one float", dir, s2name);
    double v = moe_load_f64(s2->data, s2->dtype, 0);
    /* a float, so at most FLT_MAX (a larger double would make the cast to
     * float undefined) */
    if (!(v > 0) || !(v <= FLT_MAX))
        return moe_errf(err, MOE_ERR_FORMAT, "%s: %s = %g must be a positive finite float", dir, s2name, v);
    w->fmt = MOE_WFMT_NVFP4;
    w->scale = s->data;
    w->scale_dtype = MOE_DTYPE_F8_E4M3;
    w->scale_rows = w->rows;
    w->scale_cols = w->cols / 16;
    w->scale2 = (float)v;
    return MOE_OK;
}

moe_status moe_weight_load(moe_ckpt *ck, const char *base, int64_t rows, int64_t cols, moe_weight *w,
                           const char *name, moe_error *err) {
    char wname[300];
    snprintf(wname, sizeof wname, "%s.weight", base);
    const moe_st_tensor *t;
    moe_status st = moe_ckpt_find(ck, wname, &t, err);
    if (st != MOE_OK) return st;
    memset(w, 0, sizeof *w);
    w->rows = rows;
    w->cols = cols;
    w->data = t->data;
    w->scale2 = 1.0f;
    w->name = name ? name : base;
    const char *dir = moe_ckpt_dir(ck);
    bool ok;
    w->fmt = plain_fmt(t->dtype, &ok);
    if (ok) {
        if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)
            return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s has shape [%lld%s], expected [%lld, %lld]", dir,
                            wname, (long long)t->shape[0], t->ndim == 2 ? ", ..." : "", (long long)rows,
                            (long long)cols);
        return MOE_OK;
    }
    if (t->dtype == MOE_DTYPE_F8_E4M3) return load_fp8_block(ck, base, t, w, err);
    if (t->dtype == MOE_DTYPE_U8 || t->dtype == MOE_DTYPE_I8) return load_fp4(ck, base, t, w, err);
    return moe_errf(err, MOE_ERR_DTYPE, "%s: tensor %s has dtype %s, which is no weight format moeaudit knows",
                    dir, wname, moe_dtype_name(t->dtype));
}
