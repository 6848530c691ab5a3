/* Host-side packing into the GPU layout (see cuda_pack.h). */
#include "cuda/cuda_pack.h"
#include "core/core.h"
#include "moe_formats.h"

#include <string.h>

static int round_up(int v, int m) { return (v + m - 1) / m * m; }

moe_status moe_cuda_pack_plan(const moe_weight *w, int n, moe_cuda_pack *p, moe_error *err) {
    memset(p, 0, sizeof *p);
    if (n <= 0) return moe_errf(err, MOE_ERR_ARG, "no weights to pack");
    moe_wfmt f = w[0].fmt;
    for (int i = 0; i < n; i++) {
        if (w[i].fmt != f || w[i].rows != w[0].rows || w[i].cols != w[0].cols ||
            (f == MOE_WFMT_FP8_BLOCK && w[i].scale_dtype != w[0].scale_dtype))
            return moe_errf(err, MOE_ERR_UNSUPPORTED,
                            "the GPU path needs one format and shape per projection: %s differs from %s",
                            w[i].name ? w[i].name : "?", w[0].name ? w[0].name : "?");
    }
    for (int i = 0; i < n; i++)
        if (f == MOE_WFMT_FP8_BLOCK && ((w[i].block_rows && w[i].block_rows != 128) || (w[i].block_cols && w[i].block_cols != 128)))
            return moe_errf(err, MOE_ERR_UNSUPPORTED,
                            "%s: FP8 blocks of %d x %d; the GPU path decodes 128 x 128 blocks only (run it on the CPU)",
                            w[i].name ? w[i].name : "?", (int)w[i].block_rows, (int)w[i].block_cols);
    if (w[0].rows <= 0 || w[0].cols <= 0 || w[0].rows > (1 << 20) || w[0].cols > (1 << 20))
        return moe_errf(err, MOE_ERR_SHAPE, "%s: shape [%lld, %lld] is outside what the GPU path takes",
                        w[0].name ? w[0].name : "?", (long long)w[0].rows, (long long)w[0].cols);
    p->rows = (int)w[0].rows;
    p->cols = (int)w[0].cols;
    p->rows_p = round_up(p->rows, 128);
    p->kp = round_up(p->cols, 64);
    size_t R = (size_t)p->rows_p, K = (size_t)p->kp;
    switch (f) {
    case MOE_WFMT_F64:
    case MOE_WFMT_F32:
    case MOE_WFMT_F16:
    case MOE_WFMT_BF16:
        p->fmt = MOE_WFMT_BF16;
        p->dbytes = R * K * 2;
        break;
    case MOE_WFMT_FP8_BLOCK:
        p->fmt = f;
        p->dbytes = R * K;
        p->sbytes = (R / 128) * ((K + 127) / 128) * 4;
        break;
    case MOE_WFMT_MXFP4:
        p->fmt = f;
        p->dbytes = R * K / 2;
        p->sbytes = R * K / 32;
        break;
    case MOE_WFMT_NVFP4:
        p->fmt = f;
        p->dbytes = R * K / 2;
        p->sbytes = R * K / 16;
        break;
    default:
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "%s: weight format %d has no GPU decoder",
                        w[0].name ? w[0].name : "?", (int)f);
    }
    return MOE_OK;
}

void moe_cuda_pack_one(const moe_cuda_pack *p, const moe_weight *w, uint8_t *data, uint8_t *scale, float *scale2) {
    size_t K = (size_t)p->kp;
    memset(data, 0, p->dbytes);
    *scale2 = 1.0f;
    const uint8_t *src = w->data, *sc = w->scale;
    switch (p->fmt) {
    case MOE_WFMT_BF16:
        if (w->fmt == MOE_WFMT_BF16) {
            for (int r = 0; r < p->rows; r++)
                memcpy(data + (size_t)r * K * 2, src + (size_t)r * (size_t)p->cols * 2, (size_t)p->cols * 2);
        } else {
            float *row = moe_malloc((size_t)p->cols, sizeof(float));
            MOE_ASSERT(row);
            for (int r = 0; r < p->rows; r++) {
                moe_weight_row_f32(w, r, row);
                for (int c = 0; c < p->cols; c++) {
                    uint16_t h = moe_bf16_from_f32(row[c]);
                    memcpy(data + ((size_t)r * K + (size_t)c) * 2, &h, 2);
                }
            }
            free(row);
        }
        return;
    case MOE_WFMT_FP8_BLOCK: {
        for (int r = 0; r < p->rows; r++)
            memcpy(data + (size_t)r * K, src + (size_t)r * (size_t)p->cols, (size_t)p->cols);
        size_t gr = (size_t)p->rows_p / 128, gc = (K + 127) / 128;
        float *s = (float *)(void *)scale;
        for (size_t i = 0; i < gr * gc; i++) s[i] = 1.0f;
        for (int64_t tr = 0; tr < w->scale_rows; tr++)
            for (int64_t tc = 0; tc < w->scale_cols; tc++) {
                float v;
                if (w->scale_dtype == MOE_DTYPE_F8_E8M0) v = moe_e8m0_to_f32(sc[tr * w->scale_cols + tc]);
                else memcpy(&v, sc + 4 * (tr * w->scale_cols + tc), 4);
                s[(size_t)tr * gc + (size_t)tc] = v;
            }
        return;
    }
    case MOE_WFMT_MXFP4:
    case MOE_WFMT_NVFP4: {
        int blk = p->fmt == MOE_WFMT_MXFP4 ? 32 : 16;
        size_t spr = K / (size_t)blk, sps = (size_t)p->cols / (size_t)blk;
        memset(scale, p->fmt == MOE_WFMT_MXFP4 ? 127 : 0x38, p->sbytes);
        for (int r = 0; r < p->rows; r++) {
            memcpy(data + (size_t)r * K / 2, src + (size_t)r * (size_t)p->cols / 2, (size_t)p->cols / 2);
            memcpy(scale + (size_t)r * spr, sc + (size_t)r * sps, sps);
        }
        if (p->fmt == MOE_WFMT_NVFP4) *scale2 = w->scale2;
        return;
    }
    default:
        MOE_ASSERT(!"unplanned format");
    }
}
