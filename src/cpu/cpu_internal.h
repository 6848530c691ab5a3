/*
 * Internal to src/cpu: the scalar element decoder shared by the reference
 * table and by the edge paths of the SIMD kernels, CPU feature detection, and
 * the per-ISA tables.
 *
 * Invariants:
 *  1. moe_cpu_weight_f32(w, r, k) equals moe_weight_row_f32(w, r, out)[k]
 *     bit for bit (same operations in the same order; NaN payloads aside):
 *       FP8_BLOCK  e4m3 * scale          (scale F32, or E8M0 decoded to float)
 *       MXFP4      e2m1 * e8m0
 *       NVFP4      (e2m1 * ue4m3) * scale2
 *  2. Tables are immutable after construction; only the active pointer moves.
 */
#ifndef MOE_CPU_INTERNAL_H
#define MOE_CPU_INTERNAL_H

#include "cpu/kernels.h"
#include "core/core.h"
#include "moe_formats.h"

#include <string.h>

/* Element (r, k) of w as float. No bounds checks: callers loop inside w. */
static inline float moe_cpu_weight_f32(const moe_weight *w, int64_t r, int64_t k) {
    const uint8_t *p = (const uint8_t *)w->data;
    int64_t cols = w->cols;
    switch (w->fmt) {
    case MOE_WFMT_F64: {
        double d;
        memcpy(&d, p + (size_t)(r * cols + k) * 8, 8);
        return (float)d;
    }
    case MOE_WFMT_F32: {
        float f;
        memcpy(&f, p + (size_t)(r * cols + k) * 4, 4);
        return f;
    }
    case MOE_WFMT_F16: {
        uint16_t h;
        memcpy(&h, p + (size_t)(r * cols + k) * 2, 2);
        return moe_f16_to_f32(h);
    }
    case MOE_WFMT_BF16: {
        uint16_t h;
        memcpy(&h, p + (size_t)(r * cols + k) * 2, 2);
        return moe_bf16_to_f32(h);
    }
    case MOE_WFMT_FP8_BLOCK: {
        float v = moe_fp8_e4m3_to_f32(p[(size_t)(r * cols + k)]);
        size_t si = (size_t)((r / MOE_FP8_TILE) * w->scale_cols + k / MOE_FP8_TILE);
        float s;
        if (w->scale_dtype == MOE_DTYPE_F8_E8M0) s = moe_e8m0_to_f32(((const uint8_t *)w->scale)[si]);
        else memcpy(&s, (const uint8_t *)w->scale + si * 4, 4);
        return v * s;
    }
    case MOE_WFMT_MXFP4: {
        uint8_t b = p[(size_t)(r * (cols / 2) + k / 2)];
        float v = moe_e2m1_to_f32((uint8_t)((k & 1) ? b >> 4 : b & 0xF));
        uint8_t e = ((const uint8_t *)w->scale)[(size_t)(r * w->scale_cols + k / MOE_MXFP4_BLOCK)];
        return v * moe_e8m0_to_f32(e);
    }
    case MOE_WFMT_NVFP4: {
        uint8_t b = p[(size_t)(r * (cols / 2) + k / 2)];
        float v = moe_e2m1_to_f32((uint8_t)((k & 1) ? b >> 4 : b & 0xF));
        uint8_t s = ((const uint8_t *)w->scale)[(size_t)(r * w->scale_cols + k / MOE_NVFP4_BLOCK)];
        float vs = v * moe_ue4m3_to_f32(s);
        return vs * w->scale2;
    }
    }
    MOE_ASSERT(!"unknown weight format");
    return 0.0f;
}

/* Where row j of w starts, per format: the SIMD kernels' per-row decode
 * state (fmt is the caller's compile-time format, w->fmt at run time).
 * tab: the AVX-512 kernels' table of decoded E2M1 values (set by them). */
typedef struct moe_cpu_row {
    const uint8_t *q;     /* this row's codes / values */
    const uint8_t *s8;    /* this row's scales (E8M0, UE4M3) or FP8 tile-row scales (E8M0) */
    const float *s32;     /* FP8 tile-row scales (F32) */
    const float *tab;     /* MXFP4 / NVFP4: [256][16] decoded values per scale code (AVX-512) */
} moe_cpu_row;

static inline moe_cpu_row moe_cpu_row_of(const moe_wfmt fmt, const moe_weight *w, int64_t j) {
    moe_cpu_row c = {0, 0, 0, 0};
    const uint8_t *d = (const uint8_t *)w->data;
    int64_t cols = w->cols;
    switch (fmt) {
    case MOE_WFMT_F64: c.q = d + (size_t)(j * cols) * 8; break;
    case MOE_WFMT_F32: c.q = d + (size_t)(j * cols) * 4; break;
    case MOE_WFMT_F16:
    case MOE_WFMT_BF16: c.q = d + (size_t)(j * cols) * 2; break;
    case MOE_WFMT_FP8_BLOCK:
        c.q = d + (size_t)(j * cols);
        if (w->scale_dtype == MOE_DTYPE_F8_E8M0)
            c.s8 = (const uint8_t *)w->scale + (size_t)((j / MOE_FP8_TILE) * w->scale_cols);
        else
            c.s32 = (const float *)w->scale + (size_t)((j / MOE_FP8_TILE) * w->scale_cols);
        break;
    case MOE_WFMT_MXFP4:
    case MOE_WFMT_NVFP4:
        c.q = d + (size_t)(j * (cols / 2));
        c.s8 = (const uint8_t *)w->scale + (size_t)(j * w->scale_cols);
        break;
    }
    return c;
}

/* The float scale of FP8 tile column `tc` of a row. */
static inline float moe_cpu_row_fp8_scale(const moe_cpu_row *rc, int64_t tc) {
    if (rc->s8) return moe_e8m0_to_f32(rc->s8[tc]);
    return rc->s32[tc];
}

/* What this CPU and OS support (cpuid + xgetbv). */
typedef struct moe_cpu_features {
    bool avx2, fma, f16c;
    bool avx512f, avx512bw, avx512vl, avx512dq, avx512bf16, avx512vbmi;
    bool os_avx, os_avx512;     /* XCR0 enables the register state */
    bool amx_tile, amx_bf16, amx_int8;
    bool os_amx;                /* XCR0 has XTILECFG | XTILEDATA and Linux granted the tile data state */
} moe_cpu_features;

const moe_cpu_features *moe_cpu_get_features(void);

/* The AVX-512 table (src/cpu/avx512/gemm_avx512.c): needs F, BW, VL, DQ,
 * VBMI and the OS's ZMM state; bf16: the table whose gemm_bf16act is set,
 * which needs AVX512_BF16 too. NULL is never returned; check features first. */
const moe_cpu_kernels *moe_cpu_avx512_table(bool bf16);

/* The AVX2 table (src/cpu/avx2/gemm_avx2.c): needs AVX2, FMA, F16C and the
 * OS's YMM state. NULL is never returned; check features first. */
const moe_cpu_kernels *moe_cpu_avx2_table(void);

/* The AMX table (src/cpu/amx/gemm_amx.c): the AVX-512 table with AMX-BF16
 * tiles for gemm_bf16act; needs have_avx512 + AVX512_BF16 + AMX-TILE +
 * AMX-BF16 and the tile state granted by the OS. NULL when this build has no
 * AMX code (a compiler without -mamx-tile). */
const moe_cpu_kernels *moe_cpu_amx_table(void);

/* A SIMD ISA's kernels, one per weight format (indexed by moe_wfmt). */
typedef struct moe_cpu_fmt_kernels {
    moe_gemm_fn fmt[MOE_WFMT_NVFP4 + 1];
} moe_cpu_fmt_kernels;

/* An ISA's per-format kernels: `driver(fmt, w, r0, r1, X, ldx, n, Y, ldy)`
 * instantiated once per format (fmt a compile-time constant there), each
 * with the ISA's target attribute `attr` (may be empty), collected into the
 * moe_cpu_fmt_kernels `table`. */
#define MOE_CPU_FMT_FN(table, attr, driver, name, F)                                                          \
    static attr void table##_##name(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx,  \
                                    int64_t n, float *Y, int64_t ldy) {                                      \
        driver(F, w, r0, r1, X, ldx, n, Y, ldy);                                                              \
    }
#define MOE_CPU_FMT_KERNELS(table, attr, driver)                                                              \
    MOE_CPU_FMT_FN(table, attr, driver, f64, MOE_WFMT_F64)                                                    \
    MOE_CPU_FMT_FN(table, attr, driver, f32, MOE_WFMT_F32)                                                    \
    MOE_CPU_FMT_FN(table, attr, driver, f16, MOE_WFMT_F16)                                                    \
    MOE_CPU_FMT_FN(table, attr, driver, bf16, MOE_WFMT_BF16)                                                  \
    MOE_CPU_FMT_FN(table, attr, driver, fp8, MOE_WFMT_FP8_BLOCK)                                              \
    MOE_CPU_FMT_FN(table, attr, driver, mxfp4, MOE_WFMT_MXFP4)                                                \
    MOE_CPU_FMT_FN(table, attr, driver, nvfp4, MOE_WFMT_NVFP4)                                                \
    static const moe_cpu_fmt_kernels table = {{                                                               \
        [MOE_WFMT_F64] = table##_f64, [MOE_WFMT_F32] = table##_f32, [MOE_WFMT_F16] = table##_f16,             \
        [MOE_WFMT_BF16] = table##_bf16, [MOE_WFMT_FP8_BLOCK] = table##_fp8, [MOE_WFMT_MXFP4] = table##_mxfp4, \
        [MOE_WFMT_NVFP4] = table##_nvfp4,                                                                     \
    }};

/* The table's gemm for a per-format ISA: checks the contract's shapes, skips
 * empty work and calls the format's kernel. One switch for every ISA. */
static inline void moe_cpu_gemm_by_format(const moe_cpu_fmt_kernels *k, const moe_weight *w, int64_t r0, int64_t r1,
                                          const float *X, int64_t ldx, int64_t n, float *Y, int64_t ldy) {
    MOE_ASSERT(r0 >= 0 && r0 <= r1 && r1 <= w->rows && n >= 0);
    MOE_ASSERT((unsigned)w->fmt <= MOE_WFMT_NVFP4);
    MOE_ASSERT(w->fmt != MOE_WFMT_MXFP4 || w->cols % MOE_MXFP4_BLOCK == 0);
    MOE_ASSERT(w->fmt != MOE_WFMT_NVFP4 || w->cols % MOE_NVFP4_BLOCK == 0);
    if (r0 == r1 || n == 0) return;
    k->fmt[w->fmt](w, r0, r1, X, ldx, n, Y, ldy);
}

#endif
