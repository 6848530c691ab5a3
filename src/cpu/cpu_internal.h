/*
 * Internal to src/cpu: the SIMD kernels' per-row decode state and the
 * per-ISA tables. Element values come from moe_weight_at_f32
 * (src/formats/weight.h); CPU features from core's one detector
 * (moe_cpu_get_features, src/core/cpuid.c).
 *
 * Invariants:
 *  1. Tables are immutable after construction (static const, or built once
 *     under pthread_once by the ISA's file).
 */
#ifndef MOE_CPU_INTERNAL_H
#define MOE_CPU_INTERNAL_H

#include "cpu/kernels.h"
#include "core/core.h"
#include "formats/weight.h"
#include "moe_formats.h"

#include <string.h>

/* Where row j of w starts, per format: the SIMD kernels' per-row decode
 * state (fmt is the caller's compile-time format, w->fmt at run time).
 * tab: the AVX-512 kernels' table of decoded E2M1 values (set by them). */
typedef struct moe_cpu_row {
    const uint8_t *q;     /* this row's codes / values */
    const uint8_t *s8;    /* this row's scales (E8M0, UE4M3) or FP8 tile-row scales (E8M0) */
    const float *s32;     /* FP8 tile-row scales (F32) */
    const float *tab;     /* MXFP4 / NVFP4: [256][16] decoded values per scale code (AVX-512) */
} moe_cpu_row;

/* Bytes of a row's codes / values per 32-column chunk (scales apart). */
static inline int64_t moe_cpu_chunk_bytes(const moe_wfmt fmt) {
    return fmt == MOE_WFMT_F64 ? 256 : fmt == MOE_WFMT_F32 ? 128 : fmt == MOE_WFMT_F16 || fmt == MOE_WFMT_BF16 ? 64
         : fmt == MOE_WFMT_FP8_BLOCK ? 32 : 16;
}

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

/* The AVX-512 table (src/cpu/avx512/gemm_avx512.c): needs F, BW, VL, DQ,
 * VBMI and the OS's ZMM state; bf16: the table whose gemm_bf16act is set,
 * which needs AVX512_BF16 too. NULL is never returned; check features first. */
const moe_cpu_kernels *moe_cpu_avx512_table(bool bf16);

/* The SIMD SwiGLU entries (src/cpu/avx512/swiglu_avx512.c, needs AVX-512F;
 * src/cpu/avx2/swiglu_avx2.c, needs AVX2): moe_swiglu_fn (cpu/kernels.h). */
void moe_cpu_avx512_swiglu(float *g, const float *u, int64_t n, float limit);
void moe_cpu_avx2_swiglu(float *g, const float *u, int64_t n, float limit);
/* Their exp alone, y[i] = moe_expf_f32(x[i]) for i < n (x, y: [n], may be
 * the same array): for the tests' sweeps of every float. */
void moe_cpu_avx512_expf(const float *x, float *y, int64_t n);
void moe_cpu_avx2_expf(const float *x, float *y, int64_t n);

/* The AVX2 table (src/cpu/avx2/gemm_avx2.c): needs AVX2, FMA, F16C and the
 * OS's YMM state. NULL is never returned; check features first. */
const moe_cpu_kernels *moe_cpu_avx2_table(void);

/* The AMX table (src/cpu/amx/gemm_amx.c): the AVX-512 table's f32 entry and
 * AMX-BF16 tiles for gemm_bf16act; needs the avx512 table's features +
 * AVX512_BF16 + AMX-TILE + AMX-BF16 (with Linux's tile data permission).
 * NULL when this build has no AMX code (a compiler without -mamx-tile). */
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
    /* FP8 blocks other than 128 x 128 (V4.1's 32 x 32, per channel): the
     * reference kernel, which decodes any block through moe_weight_at_f32 */
    if (!moe_weight_fast_layout(w)) {
        moe_cpu_ref()->gemm(w, r0, r1, X, ldx, n, Y, ldy);
        return;
    }
    k->fmt[w->fmt](w, r0, r1, X, ldx, n, Y, ldy);
}

#endif
