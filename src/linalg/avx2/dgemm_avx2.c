/*
 * AVX2 + FMA float64 GEMM tile: up to 6 tokens x 8 weight rows.
 *
 * Layout: the 8 rows of a packed panel are two ymm vectors per k; each
 * token's X[t, k] is broadcast (vbroadcastsd); 12 accumulators (6 tokens x
 * 2 vectors), 2 weight vectors and 1 broadcast: 15 of the 16 ymm registers.
 * Per k: 2 vector loads, 6 broadcasts, 12 FMAs.
 *
 * Invariants (linalg_internal.h, invariant 1):
 *  1. Lane j of accumulator (t, v) holds output (t, 4v + j) alone and takes
 *     one vfmadd231pd per k in index order: the scalar fma chain, bit for bit.
 *  2. Rows past nr are masked (vmaskmovpd) on the load of Y's partial sums
 *     and on the store; tokens past mr are never read.
 *  3. No allocation.
 * Needs AVX2, FMA and F16C (the avx2 kernel table's CPU check covers them).
 *
 * The second half of the file is the decode-and-pack twin of pack.c.
 */
#include "linalg/linalg_internal.h"

#include "core/core.h"
#include "moe_formats.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

enum { MR = 6, NR = 8, NV = NR / 4 };
_Static_assert(MOE_DGEMM_NR_MAX % NR == 0, "moe_linear_f64_workspace_for sizes by the widest tile");

static inline __attribute__((always_inline)) TGT void tile_body(const int mr, int64_t kc, const double *Wp,
                                                              const double *X, int64_t ldx, double *Y,
                                                              int64_t ldy, int nr, bool first) {
    __m256i m[NV];
    for (int v = 0; v < NV; v++) {
        int rem = nr - 4 * v;
        m[v] = _mm256_set_epi64x(rem > 3 ? -1 : 0, rem > 2 ? -1 : 0, rem > 1 ? -1 : 0, rem > 0 ? -1 : 0);
    }
    __m256d acc[MR][NV];
#pragma GCC unroll 6
    for (int t = 0; t < mr; t++)
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++)
            acc[t][v] = first ? _mm256_setzero_pd() : _mm256_maskload_pd(Y + t * ldy + 4 * v, m[v]);
    const double *xp[MR];
#pragma GCC unroll 6
    for (int t = 0; t < mr; t++) xp[t] = X + t * ldx;
    for (int64_t k = 0; k < kc; k++) {
        const double *wk = Wp + k * NR;
        __m256d w0 = _mm256_load_pd(wk), w1 = _mm256_load_pd(wk + 4);
#pragma GCC unroll 6
        for (int t = 0; t < mr; t++) {
            __m256d x = _mm256_broadcast_sd(xp[t] + k);
            acc[t][0] = _mm256_fmadd_pd(x, w0, acc[t][0]);
            acc[t][1] = _mm256_fmadd_pd(x, w1, acc[t][1]);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < mr; t++)
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++) _mm256_maskstore_pd(Y + t * ldy + 4 * v, m[v], acc[t][v]);
}

#define TILE_MR(n)                                                                                              \
    static TGT __attribute__((noinline)) void tile_##n(int64_t kc, const double *Wp, const double *X,           \
                                                       int64_t ldx, double *Y, int64_t ldy, int nr, bool first) { \
        tile_body(n, kc, Wp, X, ldx, Y, ldy, nr, first);                                                        \
    }
TILE_MR(1)
TILE_MR(2)
TILE_MR(3)
TILE_MR(4)
TILE_MR(5)
TILE_MR(6)

static void tile_avx2(int64_t kc, const double *Wp, const double *X, int64_t ldx, int mr, double *Y, int64_t ldy,
                      int nr, bool first) {
    switch (mr) {
    case 6: tile_6(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 5: tile_5(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 4: tile_4(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 3: tile_3(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 2: tile_2(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    default: tile_1(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    }
}

/* ======================================================================
 * Decode and pack (the twin of pack.c's moe_dgemm_pack)
 * ======================================================================
 *
 * Each group of 4 rows of a panel is decoded 4 columns at a time (one ymm
 * of 4 doubles per row), transposed 4 x 4 and stored whole at the panel's
 * rows 4g .. 4g+3. Per format, 4 values of one row (one scale block):
 *   F64 / F32 / BF16 / F16  load, widen
 *   FP8_BLOCK   the fp16 trick of the AVX-512 twin ((sext(b) << 7) & 0xBF80
 *               is e4m3(b) * 2^-8 in fp16, exact), widened, times m * 2^8;
 *               NaN codes blended in from a byte compare
 *   MXFP4/NVFP4 the 4 nibbles of 2 bytes by variable shifts; magnitude from
 *               the 8 E2M1 magnitudes (vpermps), widened, the sign bit xor-ed
 *               in (E2M1 code 8 is -0: the xor gives -0.0 as pack.c), times m
 * Every value is an exact product: pack.c's bits (tests/test-linear.c).
 * Columns past the last multiple of 4 go through moe_dgemm_decode_row.
 */

/* 4 x 4 transpose: r[i] lane j -> r[j] lane i. */
INL void tr4x4(__m256d *r) {
    __m256d a = _mm256_unpacklo_pd(r[0], r[1]), b = _mm256_unpackhi_pd(r[0], r[1]);
    __m256d c = _mm256_unpacklo_pd(r[2], r[3]), d = _mm256_unpackhi_pd(r[2], r[3]);
    r[0] = _mm256_permute2f128_pd(a, c, 0x20);
    r[1] = _mm256_permute2f128_pd(b, d, 0x20);
    r[2] = _mm256_permute2f128_pd(a, c, 0x31);
    r[3] = _mm256_permute2f128_pd(b, d, 0x31);
}


/* The block multiplier of row r at column k (pack.c; FP8 times 2^8). */
INL double block_mult(const moe_weight *w, int64_t r, int64_t k) {
    const uint8_t *s8 = (const uint8_t *)w->scale;
    switch (w->fmt) {
    case MOE_WFMT_FP8_BLOCK: {
        size_t si = (size_t)((r / MOE_FP8_TILE) * w->scale_cols + k / MOE_FP8_TILE);
        double m;
        if (w->scale_dtype == MOE_DTYPE_F8_E8M0) {
            m = moe_dgemm_e8m0(s8[si]);
        } else {
            float f;
            memcpy(&f, s8 + si * 4, 4);
            m = (double)f;
        }
        return m * 256.0;
    }
    case MOE_WFMT_MXFP4: return moe_dgemm_e8m0(s8[(size_t)(r * w->scale_cols + k / MOE_MXFP4_BLOCK)]);
    case MOE_WFMT_NVFP4:
        return (double)moe_ue4m3_to_f32(s8[(size_t)(r * w->scale_cols + k / MOE_NVFP4_BLOCK)]) * (double)w->scale2;
    default: return 1.0;
    }
}

INL __m256d dec4(const moe_wfmt fmt, const moe_weight *w, int64_t r, int64_t k, double m) {
    const uint8_t *d = (const uint8_t *)w->data;
    const int64_t cols = w->cols;
    switch (fmt) {
    case MOE_WFMT_F64: return _mm256_loadu_pd((const double *)(d + (size_t)(r * cols + k) * 8));
    case MOE_WFMT_F32: return _mm256_cvtps_pd(_mm_loadu_ps((const float *)(d + (size_t)(r * cols + k) * 4)));
    case MOE_WFMT_BF16: {
        __m128i h = _mm_loadl_epi64((const __m128i *)(d + (size_t)(r * cols + k) * 2));
        return _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16)));
    }
    case MOE_WFMT_F16: {
        __m128i h = _mm_loadl_epi64((const __m128i *)(d + (size_t)(r * cols + k) * 2));
        return _mm256_cvtps_pd(_mm_cvtph_ps(h));
    }
    case MOE_WFMT_FP8_BLOCK: {
        uint32_t x;
        memcpy(&x, d + (size_t)(r * cols + k), 4);
        __m128i b = _mm_cvtsi32_si128((int)x);
        __m128i hb = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16((short)0xBF80));
        __m256d v = _mm256_mul_pd(_mm256_cvtps_pd(_mm_cvtph_ps(hb)), _mm256_set1_pd(m));
        __m128i nan8 = _mm_cmpeq_epi8(_mm_and_si128(b, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
        __m256d nan = _mm256_castsi256_pd(_mm256_cvtepi8_epi64(nan8));
        return _mm256_blendv_pd(v, _mm256_set1_pd(NAN), nan);
    }
    case MOE_WFMT_MXFP4:
    case MOE_WFMT_NVFP4: {
        const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
        uint16_t x;
        memcpy(&x, d + (size_t)(r * (cols / 2) + k / 2), 2);
        __m128i nib = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(x), _mm_setr_epi32(0, 4, 8, 12)), _mm_set1_epi32(15));
        __m128 a = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(mag, _mm256_castsi128_si256(nib)));
        __m256i sign = _mm256_slli_epi64(_mm256_cvtepu32_epi64(_mm_srli_epi32(nib, 3)), 63);
        __m256d v = _mm256_xor_pd(_mm256_cvtps_pd(a), _mm256_castsi256_pd(sign));
        return _mm256_mul_pd(v, _mm256_set1_pd(m));
    }
    }
    return _mm256_setzero_pd();
}

INL int64_t block_of(const moe_wfmt fmt) {
    return fmt == MOE_WFMT_FP8_BLOCK ? MOE_FP8_TILE : fmt == MOE_WFMT_MXFP4 ? MOE_MXFP4_BLOCK
           : fmt == MOE_WFMT_NVFP4   ? MOE_NVFP4_BLOCK
                                     : (int64_t)1 << 40;
}

INL void pack_fmt(const moe_wfmt fmt, const moe_weight *w, int64_t r0, int64_t nrows, int64_t k0, int64_t kc, int nr,
                  double *Wp) {
    const int64_t npan = (nrows + nr - 1) / nr, k4 = kc / 4 * 4, blk = block_of(fmt);
    for (int64_t p = 0; p < npan; p++) {
        double *panel = Wp + p * kc * nr;
        for (int g = 0; g < nr / 4; g++) {
            int64_t rb = p * nr + 4 * g;
            int live = (int)(nrows - rb >= 4 ? 4 : nrows - rb > 0 ? nrows - rb : 0);
            double m[4] = {0};
            for (int64_t k = 0; k < k4; k += 4) {
                if (k == 0 || (k0 + k) % blk == 0)
                    for (int i = 0; i < live; i++) m[i] = block_mult(w, r0 + rb + i, k0 + k);
                __m256d v[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++)
                    v[i] = i < live ? dec4(fmt, w, r0 + rb + i, k0 + k, m[i]) : _mm256_setzero_pd();
                tr4x4(v);
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) _mm256_store_pd(panel + (k + i) * nr + 4 * g, v[i]);
            }
            if (k4 < kc) {
                double tail[4][4];
                for (int i = 0; i < 4; i++) {
                    if (i < live) moe_dgemm_decode_row(w, r0 + rb + i, k0 + k4, kc - k4, tail[i]);
                    else
                        for (int64_t k = 0; k < kc - k4; k++) tail[i][k] = 0.0;
                }
                for (int64_t k = k4; k < kc; k++)
                    for (int i = 0; i < 4; i++) panel[k * nr + 4 * g + i] = tail[i][k - k4];
            }
        }
    }
}

#define PACK_FMT(name, F)                                                                                       \
    static TGT __attribute__((noinline)) void pack_##name(const moe_weight *w, int64_t r0, int64_t nrows,       \
                                                         int64_t k0, int64_t kc, int nr, double *Wp) {          \
        pack_fmt(F, w, r0, nrows, k0, kc, nr, Wp);                                                              \
    }
PACK_FMT(f64, MOE_WFMT_F64)
PACK_FMT(f32, MOE_WFMT_F32)
PACK_FMT(f16, MOE_WFMT_F16)
PACK_FMT(bf16, MOE_WFMT_BF16)
PACK_FMT(fp8, MOE_WFMT_FP8_BLOCK)
PACK_FMT(mxfp4, MOE_WFMT_MXFP4)
PACK_FMT(nvfp4, MOE_WFMT_NVFP4)

static void pack_avx2(const moe_weight *w, int64_t r0, int64_t nrows, int64_t k0, int64_t kc, int nr, double *Wp) {
    MOE_ASSERT(r0 >= 0 && nrows >= 0 && r0 + nrows <= w->rows && k0 >= 0 && kc >= 0 && k0 + kc <= w->cols);
    MOE_ASSERT(nr % 4 == 0 && k0 % 4 == 0);
    switch (w->fmt) {
    case MOE_WFMT_F64: pack_f64(w, r0, nrows, k0, kc, nr, Wp); return;
    case MOE_WFMT_F32: pack_f32(w, r0, nrows, k0, kc, nr, Wp); return;
    case MOE_WFMT_F16: pack_f16(w, r0, nrows, k0, kc, nr, Wp); return;
    case MOE_WFMT_BF16: pack_bf16(w, r0, nrows, k0, kc, nr, Wp); return;
    case MOE_WFMT_FP8_BLOCK: pack_fp8(w, r0, nrows, k0, kc, nr, Wp); return;
    case MOE_WFMT_MXFP4: pack_mxfp4(w, r0, nrows, k0, kc, nr, Wp); return;
    case MOE_WFMT_NVFP4: pack_nvfp4(w, r0, nrows, k0, kc, nr, Wp); return;
    }
    MOE_ASSERT(!"unknown weight format");
}

static const moe_dgemm_kernel avx2_kernel = {"avx2", MR, NR, tile_avx2, pack_avx2, moe_dgemm_pack_ptrs};

const moe_dgemm_kernel *moe_dgemm_avx2(void) { return &avx2_kernel; }
