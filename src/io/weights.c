/*
 * Weight descriptors and their row decoders.
 *
 * Invariants:
 *  1. moe_weight_row_f64 is the definition of a weight's values; every fast
 *     path must agree with it (exactly for formats whose values are floats).
 *  2. A moe_weight never owns memory: data and scale point into mappings.
 */
#include "core/core.h"
#include "io/weights.h"

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
    return moe_errf(err, MOE_ERR_UNSUPPORTED,
                    "%s: tensor %s has dtype %s: quantized weights are not supported by this build yet", dir,
                    wname, moe_dtype_name(t->dtype));
}

void moe_weight_row_f64(const moe_weight *w, int64_t r, double *out) {
    MOE_ASSERT(r >= 0 && r < w->rows);
    int64_t n = w->cols;
    const unsigned char *p = w->data;
    switch (w->fmt) {
    case MOE_WFMT_F64:
        memcpy(out, p + (size_t)(r * n) * 8, (size_t)n * 8);
        return;
    case MOE_WFMT_F32:
        for (int64_t i = 0; i < n; i++) out[i] = moe_load_f64(p, MOE_DTYPE_F32, (size_t)(r * n + i));
        return;
    case MOE_WFMT_F16:
        for (int64_t i = 0; i < n; i++) out[i] = moe_load_f64(p, MOE_DTYPE_F16, (size_t)(r * n + i));
        return;
    case MOE_WFMT_BF16:
        for (int64_t i = 0; i < n; i++) out[i] = moe_load_f64(p, MOE_DTYPE_BF16, (size_t)(r * n + i));
        return;
    default:
        MOE_ASSERT(!"row decoder for this format is not built");
    }
}

void moe_weight_row_f32(const moe_weight *w, int64_t r, float *out) {
    MOE_ASSERT(r >= 0 && r < w->rows);
    int64_t n = w->cols;
    const unsigned char *p = w->data;
    switch (w->fmt) {
    case MOE_WFMT_F64:
        for (int64_t i = 0; i < n; i++) out[i] = (float)moe_load_f64(p, MOE_DTYPE_F64, (size_t)(r * n + i));
        return;
    case MOE_WFMT_F32:
        memcpy(out, p + (size_t)(r * n) * 4, (size_t)n * 4);
        return;
    case MOE_WFMT_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + (size_t)(r * n + i) * 2, 2);
            out[i] = moe_f16_to_f32(h);
        }
        return;
    case MOE_WFMT_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + (size_t)(r * n + i) * 2, 2);
            out[i] = moe_bf16_to_f32(h);
        }
        return;
    default:
        MOE_ASSERT(!"row decoder for this format is not built");
    }
}
