/*
 * Loading a linear weight from a checkpoint: which tensors make it, their
 * shapes and dtypes, as the published layouts write them (docs/formats.md,
 * "Checkpoint layouts"; shared/design/layouts/). What the loaded weight's
 * values are is src/formats/weights.c's (moe_weight_row_f64).
 *
 *   <base>.weight BF16/F16/F32/F64                          plain
 *   <base>.weight F8_E4M3 + .weight_scale_inv F32           FP8 blocks (DeepSeek V3 HF, transformers)
 *                         + .scale F8_E8M0 | F32            FP8 blocks (DeepSeek V4 native)
 *                         + .weight_scale [] (+ .input_scale) FP8 per tensor (ModelOpt FP8)
 *                         + .weight_scale [R/b, C/b] BF16|F32  FP8 blocks (compressed-tensors FP8_BLOCK)
 *                         + .weight_scale [R, 1]            FP8 per channel (compressed-tensors)
 *   <base>.weight I8/U8 [R, C/2] + .scale E8M0 [R, C/32]    MXFP4 (DeepSeek V4 experts)
 *                    + .weight_scale F8_E4M3 [R, C/16]
 *                    + .weight_scale_2 F32 [] (+ .input_scale F32 [])      NVFP4 (ModelOpt)
 *   <base>.weight_packed U8 [R, C/2] + .weight_scale F8_E4M3 [R, C/16]
 *     + .weight_global_scale F32 [1] (+ .input_global_scale F32 [1])       NVFP4 (compressed-tensors)
 *
 * The block size of FP8 scales is the declared one (weight_block_size,
 * compressed-tensors block_structure) or, undeclared, 128 x 128.
 *
 * Invariants:
 *  1. A moe_weight never owns memory: data and scale point into mappings or
 *     into buffers the checkpoint keeps (io/ckpt.h: BF16 block scales
 *     widened to F32, a per-tensor scale spread over its 128x128 tiles).
 *  2. A weight is returned only when every companion tensor (scales, the
 *     NVFP4 per-tensor scale) exists with the shape and dtype its format
 *     needs, and when its format is the one the checkpoint declares for it
 *     (io/quant_decl.h); otherwise the error names the directory, tensor,
 *     value and, for a contradiction, the declaration.
 */
#include "core/core.h"
#include "io/ckpt.h"
#include "io/weights.h"
#include "moe_formats.h"

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

static const char *plain_scheme(moe_dtype t) {
    switch (t) {
    case MOE_DTYPE_F64: return "f64";
    case MOE_DTYPE_F32: return "f32";
    case MOE_DTYPE_F16: return "f16";
    default: return "bf16";
    }
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int64_t numel(const moe_st_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

static void shape_text(const moe_st_tensor *t, char *buf, size_t cap) {
    buf[0] = 0;
    for (int d = 0; d < t->ndim; d++)
        snprintf(buf + strlen(buf), cap - strlen(buf), "%s%lld", d ? ", " : "", (long long)t->shape[d]);
}

/* One positive finite float of a scalar tensor ([] or [1]) named sname: at
 * most FLT_MAX, since it becomes a float (a larger double would make the
 * cast undefined). */
static moe_status scalar_of(moe_ckpt *ck, const char *sname, const moe_st_tensor *s, double *v, moe_error *err) {
    const char *dir = moe_ckpt_dir(ck);
    char sh[64];
    shape_text(s, sh, sizeof sh);
    if (!moe_dtype_is_float(s->dtype) || numel(s) != 1 || s->ndim > 1)
        return moe_errf(err, MOE_ERR_SHAPE, "%s: %s must be one float ([] or [1]); it is %s [%s]", dir, sname,
                        moe_dtype_name(s->dtype), sh);
    *v = moe_load_f64(s->data, s->dtype, 0);
    if (!(*v > 0) || !(*v <= FLT_MAX))
        return moe_errf(err, MOE_ERR_FORMAT, "%s: %s = %g must be a positive finite float", dir, sname, *v);
    return MOE_OK;
}

/* The optional static input scale "<base>.<key>" (a scalar); *out = 0 when
 * absent. inverse: the tensor holds 1 / scale (compressed-tensors). */
static moe_status input_scale(moe_ckpt *ck, const char *base, const char *key, bool inverse, float *out,
                              moe_error *err) {
    char n[320];
    snprintf(n, sizeof n, "%s.%s", base, key);
    *out = 0.0f;
    const moe_st_tensor *t = NULL;
    moe_status st = moe_ckpt_lookup(ck, n, &t, err); /* a probe that keeps a shard's read error */
    if (st != MOE_OK || !t) return st;
    double v = 0;
    if ((st = scalar_of(ck, n, t, &v, err)) != MOE_OK) return st;
    if (inverse && !(1.0 / v <= FLT_MAX))
        return moe_errf(err, MOE_ERR_FORMAT, "%s: %s = %g: its inverse %g is not a finite float", moe_ckpt_dir(ck), n,
                        v, 1.0 / v);
    *out = inverse ? (float)(1.0 / v) : (float)v;
    return MOE_OK;
}

/* Scale grid of an FP8 weight [rows, cols] in blocks br x bc: the tensor s
 * must hold ceil(rows/br) x ceil(cols/bc) values, as [gr, gc] or squeezed
 * (transformers writes a [1, g] or [g, 1] grid as [g]). */
static bool grid_fits(const moe_st_tensor *s, int64_t gr, int64_t gc) {
    if (s->ndim == 2) return s->shape[0] == gr && s->shape[1] == gc;
    if (s->ndim == 1) return s->shape[0] == gr * gc && (gr == 1 || gc == 1);
    return s->ndim == 0 && gr * gc == 1;
}

/* Scales of dtype F32/E8M0 as they are; BF16/F16 widened to F32 (exact)
 * into a buffer the checkpoint keeps. */
static moe_status fp8_scale_data(moe_ckpt *ck, const char *sname, const moe_st_tensor *s, moe_weight *w,
                                 moe_error *err) {
    const char *dir = moe_ckpt_dir(ck);
    if (s->dtype == MOE_DTYPE_F32 || s->dtype == MOE_DTYPE_F8_E8M0) {
        w->scale = s->data;
        w->scale_dtype = s->dtype;
        return MOE_OK;
    }
    if (s->dtype == MOE_DTYPE_BF16 || s->dtype == MOE_DTYPE_F16) {
        int64_t n = numel(s);
        float *f = moe_ckpt_keep(ck, (size_t)n * sizeof(float));
        if (!f) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for scale tensor %s", sname);
        for (int64_t i = 0; i < n; i++) f[i] = (float)moe_load_f64(s->data, s->dtype, (size_t)i);
        w->scale = f;
        w->scale_dtype = MOE_DTYPE_F32;
        return MOE_OK;
    }
    return moe_errf(err, MOE_ERR_DTYPE, "%s: FP8 scale tensor %s has dtype %s; expected F32, BF16, F16 or F8_E8M0", dir,
                    sname, moe_dtype_name(s->dtype));
}

/* FP8 E4M3 weight: its scale companion decides the layout (file comment). */
static moe_status load_fp8(moe_ckpt *ck, const char *base, const moe_st_tensor *t, moe_weight *w, moe_error *err) {
    const char *dir = moe_ckpt_dir(ck);
    const moe_qdecl *d = moe_ckpt_decl(ck);
    if (t->ndim != 2 || t->shape[0] != w->rows || t->shape[1] != w->cols)
        return moe_errf(err, MOE_ERR_SHAPE, "%s: FP8 tensor %s.weight must have shape [%lld, %lld]", dir, base,
                        (long long)w->rows, (long long)w->cols);
    static const char *const keys[] = {"weight_scale_inv", "scale", "weight_scale"};
    static const char *const schemes[] = {"fp8 blocks (weight_scale_inv)", "fp8 blocks (.scale)",
                                          "fp8 blocks (weight_scale)"};
    char sname[320];
    const moe_st_tensor *s = NULL;
    moe_status st = MOE_OK;
    int k = 0;
    for (; k < 3; k++) {
        snprintf(sname, sizeof sname, "%s.%s", base, keys[k]);
        if ((st = moe_ckpt_lookup(ck, sname, &s, err)) != MOE_OK) return st; /* a shard that cannot be read */
        if (s) break;
    }
    if (k == 3)
        return moe_errf(err, MOE_ERR_MISSING,
                        "%s: FP8 weight %s.weight has no scales (%s.weight_scale_inv, %s.scale or %s.weight_scale)",
                        dir, base, base, base, base);
    char sh[96];
    shape_text(s, sh, sizeof sh);
    w->fmt = MOE_WFMT_FP8_BLOCK;
    w->scheme = schemes[k];

    /* One scale for the whole tensor (ModelOpt FP8, compressed-tensors
     * "tensor"): spread over 128x128 tiles, which every kernel reads. */
    if (k == 2 && numel(s) == 1 && s->ndim <= 1) {
        double v;
        if ((st = scalar_of(ck, sname, s, &v, err)) != MOE_OK) return st;
        int64_t gr = ceil_div(w->rows, MOE_FP8_TILE), gc = ceil_div(w->cols, MOE_FP8_TILE);
        float *g = moe_ckpt_keep(ck, (size_t)(gr * gc) * sizeof(float));
        if (!g) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for scale tensor %s", sname);
        for (int64_t i = 0; i < gr * gc; i++) g[i] = (float)v;
        w->scale = g;
        w->scale_dtype = MOE_DTYPE_F32;
        w->scale_rows = gr;
        w->scale_cols = gc;
        w->block_rows = w->block_cols = MOE_FP8_TILE;
        w->scheme = "fp8 per-tensor (weight_scale [])";
        /* ModelOpt FP8's input_scale (amax / 448) serves static FP8
         * activations, which moeaudit does not run: not an NVFP4 scale,
         * so not recorded (moe_weight.input_scale is NVFP4's) */
        return MOE_OK;
    }

    int br = 0, bc = 0;
    const char *bwhere = NULL;
    bool declared = moe_qdecl_fp8_block(d, &br, &bc, &bwhere);
    /* Per channel ([rows, 1], compressed-tensors "channel"): blocks of one row. */
    if (k == 2 && s->ndim == 2 && s->shape[0] == w->rows && s->shape[1] == 1 && w->cols > 1 &&
        !(declared && grid_fits(s, ceil_div(w->rows, br), ceil_div(w->cols, bc)))) {
        br = 1;
        bc = (int)w->cols;
        w->scheme = "fp8 per-channel (weight_scale [rows, 1])";
    } else if (!declared) {
        br = bc = MOE_FP8_TILE;
    }
    int64_t gr = ceil_div(w->rows, br), gc = ceil_div(w->cols, bc);
    if (!grid_fits(s, gr, gc)) {
        char alt[96] = "";
        if (s->ndim == 2 && s->shape[0] > 0 && s->shape[1] > 0) {
            int64_t ar = ceil_div(w->rows, s->shape[0]), ac = ceil_div(w->cols, s->shape[1]);
            if (ceil_div(w->rows, ar) == s->shape[0] && ceil_div(w->cols, ac) == s->shape[1])
                snprintf(alt, sizeof alt, "; the shape fits blocks of [%lld, %lld]", (long long)ar, (long long)ac);
        }
        if (declared)
            return moe_errf(err, MOE_ERR_SHAPE,
                            "%s: %s declares FP8 blocks of [%d, %d] (%s), but scale tensor %s has shape [%s]: a "
                            "[%lld, %lld] weight in [%d, %d] blocks has [%lld, %lld] scales%s",
                            dir, d->cfg_where[0] ? d->cfg_where : "the checkpoint", br, bc, bwhere, sname, sh,
                            (long long)w->rows, (long long)w->cols, br, bc, (long long)gr, (long long)gc, alt);
        return moe_errf(err, MOE_ERR_SHAPE,
                        "%s: scale tensor %s has shape [%s]; a [%lld, %lld] weight in 128x128 blocks needs [%lld, %lld]"
                        "%s (no weight_block_size is declared: a config.json quantization_config.weight_block_size "
                        "would say which blocks)",
                        dir, sname, sh, (long long)w->rows, (long long)w->cols, (long long)gr, (long long)gc, alt);
    }
    if ((st = fp8_scale_data(ck, sname, s, w, err)) != MOE_OK) return st;
    w->scale_rows = gr;
    w->scale_cols = gc;
    w->block_rows = br;
    w->block_cols = bc;
    return st;
}

/* NVFP4 block scales "<sname>" F8_E4M3 (or U8) [rows, cols / 16]. */
static moe_status nvfp4_scales(moe_ckpt *ck, const char *sname, moe_weight *w, moe_error *err) {
    const char *dir = moe_ckpt_dir(ck);
    const moe_st_tensor *s = NULL;
    moe_status st = moe_ckpt_find(ck, sname, &s, err);
    if (st != MOE_OK) return st;
    if (s->dtype != MOE_DTYPE_F8_E4M3 && s->dtype != MOE_DTYPE_U8)
        return moe_errf(err, MOE_ERR_DTYPE, "%s: NVFP4 scale %s has dtype %s; expected F8_E4M3", dir, sname,
                        moe_dtype_name(s->dtype));
    if (!(s->ndim == 2 && s->shape[0] == w->rows && s->shape[1] == w->cols / 16))
        return moe_errf(err, MOE_ERR_SHAPE, "%s: NVFP4 scale %s must have shape [%lld, %lld] (one UE4M3 per 16 inputs)",
                        dir, sname, (long long)w->rows, (long long)(w->cols / 16));
    w->fmt = MOE_WFMT_NVFP4;
    w->scale = s->data;
    w->scale_dtype = MOE_DTYPE_F8_E4M3;
    w->scale_rows = w->rows;
    w->scale_cols = w->cols / 16;
    return MOE_OK;
}

static moe_status packed_shape(moe_ckpt *ck, const char *tname, const moe_st_tensor *t, const moe_weight *w,
                               moe_error *err) {
    if (w->cols % 32 != 0 || t->ndim != 2 || t->shape[0] != w->rows || t->shape[1] != w->cols / 2)
        return moe_errf(err, MOE_ERR_SHAPE,
                        "%s: packed FP4 tensor %s must have shape [%lld, %lld] (two E2M1 codes per byte, %lld inputs)",
                        moe_ckpt_dir(ck), tname, (long long)w->rows, (long long)(w->cols / 2), (long long)w->cols);
    return MOE_OK;
}

/* Packed E2M1 "<base>.weight" [rows, cols / 2]: MXFP4 with "<base>.scale"
 * E8M0 [rows, cols / 32] (V4 native experts), or NVFP4 with
 * "<base>.weight_scale" F8_E4M3 [rows, cols / 16] and "<base>.weight_scale_2"
 * F32 (ModelOpt). */
static moe_status load_fp4(moe_ckpt *ck, const char *base, const moe_st_tensor *t, moe_weight *w, moe_error *err) {
    const char *dir = moe_ckpt_dir(ck);
    char tname[320], sname[320], s2name[320];
    snprintf(tname, sizeof tname, "%s.weight", base);
    moe_status st = packed_shape(ck, tname, t, w, err);
    if (st != MOE_OK) return st;
    const moe_st_tensor *s = NULL, *s2 = NULL;
    snprintf(sname, sizeof sname, "%s.scale", base);
    if ((st = moe_ckpt_lookup(ck, sname, &s, err)) != MOE_OK) return st;
    if (s) {
        if (s->dtype != MOE_DTYPE_F8_E8M0 && s->dtype != MOE_DTYPE_U8)
            return moe_errf(err, MOE_ERR_DTYPE, "%s: MXFP4 scale %s has dtype %s; expected F8_E8M0", dir, sname,
                            moe_dtype_name(s->dtype));
        if (!(s->ndim == 2 && s->shape[0] == w->rows && s->shape[1] == w->cols / 32))
            return moe_errf(err, MOE_ERR_SHAPE, "%s: MXFP4 scale %s must have shape [%lld, %lld]", dir, sname,
                            (long long)w->rows, (long long)(w->cols / 32));
        w->fmt = MOE_WFMT_MXFP4;
        w->scale = s->data;
        w->scale_dtype = MOE_DTYPE_F8_E8M0;
        w->scale_rows = w->rows;
        w->scale_cols = w->cols / 32;
        w->scheme = t->dtype == MOE_DTYPE_I8 ? "mxfp4 (I8 + .scale E8M0)" : "mxfp4 (U8 + .scale E8M0)";
        return MOE_OK;
    }
    snprintf(sname, sizeof sname, "%s.weight_scale", base);
    snprintf(s2name, sizeof s2name, "%s.weight_scale_2", base);
    if ((st = moe_ckpt_lookup(ck, sname, &s, err)) != MOE_OK) return st;
    if (!s)
        return moe_errf(err, MOE_ERR_MISSING, "%s: packed FP4 weight %s.weight has neither %s.scale (MXFP4) nor "
                        "%s.weight_scale (NVFP4)", dir, base, base, base);
    if ((st = nvfp4_scales(ck, sname, w, err)) != MOE_OK) return st;
    if ((st = moe_ckpt_find(ck, s2name, &s2, err)) != MOE_OK) return st;
    double v;
    if ((st = scalar_of(ck, s2name, s2, &v, err)) != MOE_OK) return st;
    w->scale2 = (float)v;
    w->scheme = "nvfp4 (ModelOpt: weight_scale + weight_scale_2)";
    return input_scale(ck, base, "input_scale", false, &w->input_scale, err);
}

/* compressed-tensors NVFP4: "<base>.weight_packed", "<base>.weight_scale",
 * "<base>.weight_global_scale" = 1 / ModelOpt's weight_scale_2. */
static moe_status load_ct_nvfp4(moe_ckpt *ck, const char *base, const moe_st_tensor *t, moe_weight *w, moe_error *err) {
    const char *dir = moe_ckpt_dir(ck);
    char tname[320], sname[320], gname[320];
    snprintf(tname, sizeof tname, "%s.weight_packed", base);
    if (t->dtype != MOE_DTYPE_U8 && t->dtype != MOE_DTYPE_I8)
        return moe_errf(err, MOE_ERR_DTYPE, "%s: tensor %s has dtype %s; compressed-tensors NVFP4 packs E2M1 codes in U8",
                        dir, tname, moe_dtype_name(t->dtype));
    moe_status st = packed_shape(ck, tname, t, w, err);
    if (st != MOE_OK) return st;
    snprintf(sname, sizeof sname, "%s.weight_scale", base);
    snprintf(gname, sizeof gname, "%s.weight_global_scale", base);
    if ((st = nvfp4_scales(ck, sname, w, err)) != MOE_OK) return st;
    const moe_st_tensor *g = NULL;
    if ((st = moe_ckpt_find(ck, gname, &g, err)) != MOE_OK) return st;
    double G;
    if ((st = scalar_of(ck, gname, g, &G, err)) != MOE_OK) return st;
    if (!(1.0 / G <= FLT_MAX))
        return moe_errf(err, MOE_ERR_FORMAT, "%s: %s = %g: its inverse (weight_scale_2) %g is not a finite float", dir,
                        gname, G, 1.0 / G);
    w->global_scale = G;
    w->scale2 = (float)(1.0 / G);
    w->data = t->data;
    w->scheme = "nvfp4 (compressed-tensors: weight_packed + weight_global_scale)";
    return input_scale(ck, base, "input_global_scale", true, &w->input_scale, err);
}

/* -------------------------------------------------- the declared quantization */

static moe_qkind kind_of(const moe_weight *w) {
    switch (w->fmt) {
    case MOE_WFMT_FP8_BLOCK: return w->scheme && strstr(w->scheme, "per-tensor") ? MOE_QK_FP8_TENSOR : MOE_QK_FP8;
    case MOE_WFMT_MXFP4: return MOE_QK_MXFP4;
    case MOE_WFMT_NVFP4: return w->global_scale > 0 ? MOE_QK_NVFP4_CT : MOE_QK_NVFP4;
    default: return MOE_QK_PLAIN;
    }
}

/* A power of two (E8M0 can hold it): positive, finite, mantissa bits zero. */
static bool is_pow2(float v) {
    if (!(v > 0) || !isfinite(v)) return false;
    int e;
    return frexpf(v, &e) == 0.5f;
}

moe_status moe_weight_check_declared(moe_ckpt *ck, const char *base, const moe_weight *w, moe_error *err) {
    const moe_qdecl *d = moe_ckpt_decl(ck);
    if (!moe_qdecl_present(d)) return MOE_OK;
    const char *dir = moe_ckpt_dir(ck);
    char why[400];
    moe_qexp e = moe_qdecl_expect(d, base, why, sizeof why);
    moe_qkind k = kind_of(w);
    if (!moe_qexp_allows(e, k))
        return moe_errf(err, MOE_ERR_FORMAT, "%s: %s requires %s for %s, but the checkpoint stores it as %s",
                        dir, why, moe_qexp_name(e), base, w->scheme ? w->scheme : "?");
    int group = d->modelopt ? d->mo_group : 0;
    for (int g = 0; g < d->n_groups; g++)
        if (d->groups[g].wbits == 4 && d->groups[g].wgroup) group = d->groups[g].wgroup;
    if ((k == MOE_QK_NVFP4 || k == MOE_QK_NVFP4_CT) && group && group != MOE_NVFP4_BLOCK)
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "%s: the checkpoint declares NVFP4 group_size %d; %s has one scale "
                        "per %d inputs, the only NVFP4 group moeaudit reads", dir, group, base, MOE_NVFP4_BLOCK);
    /* scale_fmt "ue8m0": every FP8 block scale a power of two. */
    if (k == MOE_QK_FP8 && !strcmp(d->scale_fmt, "ue8m0") && w->scale_dtype == MOE_DTYPE_F32) {
        const unsigned char *p = w->scale;
        for (int64_t i = 0; i < w->scale_rows * w->scale_cols; i++) {
            float v;
            memcpy(&v, p + 4 * i, 4);
            if (!is_pow2(v))
                return moe_errf(err, MOE_ERR_FORMAT,
                                "%s: %s declares scale_fmt \"ue8m0\" (power-of-two block scales), but the scale of "
                                "%s at block [%lld, %lld] is %.9g, not a power of two",
                                dir, d->cfg_where, base, (long long)(i / w->scale_cols),
                                (long long)(i % w->scale_cols), v);
        }
    }
    return MOE_OK;
}

moe_status moe_weight_load(moe_ckpt *ck, const char *base, int64_t rows, int64_t cols, moe_weight *w,
                           const char *name, moe_error *err) {
    char wname[320];
    snprintf(wname, sizeof wname, "%s.weight", base);
    memset(w, 0, sizeof *w);
    w->rows = rows;
    w->cols = cols;
    w->scale2 = 1.0f;
    w->name = name ? name : base;
    const char *dir = moe_ckpt_dir(ck);
    const moe_st_tensor *t;
    moe_status st;
    /* probes that keep a shard's read error (moe_ckpt_lookup) */
    if ((st = moe_ckpt_lookup(ck, wname, &t, err)) != MOE_OK) return st;
    if (!t) {
        char pname[320];
        snprintf(pname, sizeof pname, "%s.weight_packed", base);
        if ((st = moe_ckpt_lookup(ck, pname, &t, err)) != MOE_OK) return st;
        if (t) {
            st = load_ct_nvfp4(ck, base, t, w, err);
            return st == MOE_OK ? moe_weight_check_declared(ck, base, w, err) : st;
        }
    }
    if ((st = moe_ckpt_find(ck, wname, &t, err)) != MOE_OK) return st;
    w->data = t->data;
    bool ok;
    w->fmt = plain_fmt(t->dtype, &ok);
    if (ok) {
        if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) {
            char sh[96];
            shape_text(t, sh, sizeof sh);
            return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s has shape [%s], expected [%lld, %lld]", dir, wname, sh,
                            (long long)rows, (long long)cols);
        }
        w->scheme = plain_scheme(t->dtype);
        return moe_weight_check_declared(ck, base, w, err);
    }
    if (t->dtype == MOE_DTYPE_F8_E4M3) st = load_fp8(ck, base, t, w, err);
    else if (t->dtype == MOE_DTYPE_U8 || t->dtype == MOE_DTYPE_I8) st = load_fp4(ck, base, t, w, err);
    else
        return moe_errf(err, MOE_ERR_DTYPE, "%s: tensor %s has dtype %s, which is no weight format moeaudit knows",
                        dir, wname, moe_dtype_name(t->dtype));
    return st == MOE_OK ? moe_weight_check_declared(ck, base, w, err) : st;
}

moe_status moe_weight_view_stacked(moe_ckpt *ck, const char *tname, const char *base, int64_t e, int64_t row0,
                                   int64_t rows, int64_t cols, moe_weight *w, const char *name, moe_error *err) {
    const char *dir = moe_ckpt_dir(ck);
    const moe_st_tensor *t = NULL;
    moe_status st = moe_ckpt_find(ck, tname, &t, err);
    if (st != MOE_OK) return st;
    bool ok;
    moe_wfmt f = plain_fmt(t->dtype, &ok);
    if (!ok)
        return moe_errf(err, MOE_ERR_UNSUPPORTED,
                        "%s: stacked expert tensor %s has dtype %s; moeaudit reads stacked experts in BF16, F16, F32 "
                        "or F64 only (quantized experts: one tensor per expert, as the releases write them)",
                        dir, tname, moe_dtype_name(t->dtype));
    if (t->ndim != 3 || e >= t->shape[0] || t->shape[1] < row0 + rows || t->shape[2] != cols) {
        char sh[96];
        shape_text(t, sh, sizeof sh);
        return moe_errf(err, MOE_ERR_SHAPE,
                        "%s: stacked expert tensor %s has shape [%s]; expert %lld needs rows [%lld, %lld) of %lld "
                        "columns", dir, tname, sh, (long long)e, (long long)row0, (long long)(row0 + rows),
                        (long long)cols);
    }
    memset(w, 0, sizeof *w);
    size_t es = moe_dtype_size(t->dtype);
    w->fmt = f;
    w->rows = rows;
    w->cols = cols;
    w->data = (const unsigned char *)t->data + ((size_t)e * (size_t)t->shape[1] + (size_t)row0) * (size_t)cols * es;
    w->scale2 = 1.0f;
    w->name = name ? name : tname;
    w->scheme = "stacked experts";
    return moe_weight_check_declared(ck, base, w, err);
}
