/*
 * AVX-512F float64 GEMM tile: up to 8 tokens x 24 weight rows.
 *
 * Layout: the 24 rows of a packed panel are three zmm vectors per k
 * (Wp[k, 0..23]); each token's X[t, k] is broadcast from memory (folded into
 * the FMA as {1to8}); 24 accumulators (8 tokens x 3 vectors), 3 weight
 * vectors: 27 of the 32 zmm registers. Per k: 3 vector loads, 8 broadcasts,
 * 24 FMAs.
 *
 * Invariants (linalg_internal.h, invariant 1):
 *  1. Lane j of accumulator (t, v) holds output (t, 8v + j) alone and takes
 *     one vfmadd231pd per k in index order: the scalar fma chain, bit for bit
 *     (no reassociation, no horizontal sums). The tile's position, mr, nr,
 *     the K block and the thread change nothing.
 *  2. Rows past nr are masked on the load of Y's partial sums and on the
 *     store; their lanes compute with the panel's zero padding and are
 *     dropped. Tokens past mr are never read.
 *  3. No allocation.
 * Needs AVX-512 F/BW/VL/DQ, FMA and F16C (the avx512 kernel table's CPU
 * check covers them).
 *
 * The second half of the file is the decode-and-pack twin of pack.c, with
 * its own invariants.
 */
#include "linalg/linalg_internal.h"

#include "core/core.h"
#include "moe_formats.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

enum { MR = 8, NR = 24, NV = NR / 8 };
_Static_assert(MOE_DGEMM_NR_MAX % NR == 0, "moe_linear_f64_workspace_for sizes by the widest tile");

static inline __attribute__((always_inline)) TGT void tile_body(const int mr, int64_t kc, const double *Wp,
                                                              const double *X, int64_t ldx, double *Y,
                                                              int64_t ldy, int nr, bool first) {
    __mmask8 m[NV];
    for (int v = 0; v < NV; v++) {
        int rem = nr - 8 * v;
        m[v] = (__mmask8)(rem >= 8 ? 0xFF : rem <= 0 ? 0 : (1u << rem) - 1u);
    }
    __m512d acc[MR][NV];
#pragma GCC unroll 8
    for (int t = 0; t < mr; t++)
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++)
            acc[t][v] = first ? _mm512_setzero_pd() : _mm512_maskz_loadu_pd(m[v], Y + t * ldy + 8 * v);
    const double *xp[MR];
#pragma GCC unroll 8
    for (int t = 0; t < mr; t++) xp[t] = X + t * ldx;
    for (int64_t k = 0; k < kc; k++) {
        const double *wk = Wp + k * NR;
        __m512d w0 = _mm512_load_pd(wk), w1 = _mm512_load_pd(wk + 8), w2 = _mm512_load_pd(wk + 16);
#pragma GCC unroll 8
        for (int t = 0; t < mr; t++) {
            __m512d x = _mm512_set1_pd(xp[t][k]);
            acc[t][0] = _mm512_fmadd_pd(x, w0, acc[t][0]);
            acc[t][1] = _mm512_fmadd_pd(x, w1, acc[t][1]);
            acc[t][2] = _mm512_fmadd_pd(x, w2, acc[t][2]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < mr; t++)
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++) _mm512_mask_storeu_pd(Y + t * ldy + 8 * v, m[v], acc[t][v]);
}

/* One function per token count: each gets its own register allocation. */
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
TILE_MR(7)
TILE_MR(8)

static void tile_avx512(int64_t kc, const double *Wp, const double *X, int64_t ldx, int mr, double *Y,
                        int64_t ldy, int nr, bool first) {
    switch (mr) {
    case 8: tile_8(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 7: tile_7(kc, Wp, X, ldx, Y, ldy, nr, first); return;
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
 * Each group of 8 rows of a panel is decoded 8 columns at a time, one zmm
 * of 8 doubles per row, then transposed (8 x 8, three shuffle stages) into
 * 8 zmm of one column each and stored whole (64-byte aligned) at the panel's
 * rows 8g .. 8g+7. Per format, 8 values of one row (one scale block: k0 is a
 * multiple of 8 and every block size is a multiple of 8):
 *   F64 / F32 / BF16 / F16  load, widen (vcvtps2pd; BF16 << 16; vcvtph2ps)
 *   FP8_BLOCK   byte b -> the fp16 bits (sext(b) << 7) & 0xBF80, whose
 *               value is e4m3(b) * 2^-8 exactly (subnormals included), ->
 *               float -> double, times m * 2^8 (m the tile's multiplier as
 *               in pack.c; * 2^8 is exact in double); the product is the
 *               exact e4m3 * m. NaN codes 0x7F / 0xFF are set to NaN by a
 *               byte compare mask.
 *   MXFP4/NVFP4 the 8 nibbles of 4 bytes (element 2j low nibble of byte j)
 *               by a variable shift per lane, looked up in the 16 E2M1
 *               doubles (vpermt2pd), times the block's m (pack.c).
 * Every value is an exact product, so these are pack.c's values bit for bit
 * (tests/test-linear.c compares the two packs on every format, NaN and
 * subnormal codes included).
 * Invariants:
 *  1. Columns past the last multiple of 8 and rows of a group past the
 *     weight go through moe_dgemm_decode_row / zeros, as pack.c.
 *  2. No allocation; reads never pass the rows' stored bytes.
 */

/* 8 x 8 transpose: r[i] lane j -> r[j] lane i. */
INL void tr8x8(__m512d *r) {
    const __m512i ia = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), ib = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    __m512d t[8], u[8];
#pragma GCC unroll 4
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_pd(r[i], r[i + 1]);     /* r_i[0] r_i+1[0] r_i[2] r_i+1[2] ... */
        t[i + 1] = _mm512_unpackhi_pd(r[i], r[i + 1]); /* r_i[1] r_i+1[1] r_i[3] r_i+1[3] ... */
    }
#pragma GCC unroll 2
    for (int h = 0; h < 8; h += 4) {
        u[h + 0] = _mm512_permutex2var_pd(t[h + 0], ia, t[h + 2]); /* rows h..h+3 of columns 0, 4 */
        u[h + 1] = _mm512_permutex2var_pd(t[h + 0], ib, t[h + 2]); /* columns 2, 6 */
        u[h + 2] = _mm512_permutex2var_pd(t[h + 1], ia, t[h + 3]); /* columns 1, 5 */
        u[h + 3] = _mm512_permutex2var_pd(t[h + 1], ib, t[h + 3]); /* columns 3, 7 */
    }
    r[0] = _mm512_shuffle_f64x2(u[0], u[4], 0x44);
    r[4] = _mm512_shuffle_f64x2(u[0], u[4], 0xEE);
    r[2] = _mm512_shuffle_f64x2(u[1], u[5], 0x44);
    r[6] = _mm512_shuffle_f64x2(u[1], u[5], 0xEE);
    r[1] = _mm512_shuffle_f64x2(u[2], u[6], 0x44);
    r[5] = _mm512_shuffle_f64x2(u[2], u[6], 0xEE);
    r[3] = _mm512_shuffle_f64x2(u[3], u[7], 0x44);
    r[7] = _mm512_shuffle_f64x2(u[3], u[7], 0xEE);
}


/* The multiplier m of row r's scale block holding column k (pack.c), times
 * 2^8 for FP8 (see the file's second head). Plain formats: 1. */
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

/* Columns k .. k+7 of row r (fmt the caller's compile-time format); m: the
 * block multiplier (block_mult). */
INL __m512d dec8(const moe_wfmt fmt, const moe_weight *w, int64_t r, int64_t k, double m) {
    const uint8_t *d = (const uint8_t *)w->data;
    const int64_t cols = w->cols;
    switch (fmt) {
    case MOE_WFMT_F64: return _mm512_loadu_pd(d + (size_t)(r * cols + k) * 8);
    case MOE_WFMT_F32: return _mm512_cvtps_pd(_mm256_loadu_ps((const float *)(d + (size_t)(r * cols + k) * 4)));
    case MOE_WFMT_BF16: {
        __m128i h = _mm_loadu_si128((const __m128i *)(d + (size_t)(r * cols + k) * 2));
        return _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
    case MOE_WFMT_F16: {
        __m128i h = _mm_loadu_si128((const __m128i *)(d + (size_t)(r * cols + k) * 2));
        return _mm512_cvtps_pd(_mm256_cvtph_ps(h));
    }
    case MOE_WFMT_FP8_BLOCK: {
        __m128i b = _mm_loadl_epi64((const __m128i *)(d + (size_t)(r * cols + k)));
        __m128i hb = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16((short)0xBF80));
        __m512d v = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_cvtph_ps(hb)), _mm512_set1_pd(m));
        __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
        return _mm512_mask_mov_pd(v, (__mmask8)nan, _mm512_set1_pd(NAN));
    }
    case MOE_WFMT_MXFP4:
    case MOE_WFMT_NVFP4: {
        const __m512d lo = _mm512_setr_pd(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
        const __m512d hi = _mm512_setr_pd(-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0);
        uint32_t x;
        memcpy(&x, d + (size_t)(r * (cols / 2) + k / 2), 4);
        __m512i idx = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64((long long)x),
                                                         _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28)),
                                       _mm512_set1_epi64(15));
        return _mm512_mul_pd(_mm512_permutex2var_pd(lo, idx, hi), _mm512_set1_pd(m));
    }
    }
    return _mm512_setzero_pd();
}

/* Block sizes along K (multiples of 8): where block_mult must be re-read. */
INL int64_t block_of(const moe_wfmt fmt) {
    return fmt == MOE_WFMT_FP8_BLOCK ? MOE_FP8_TILE : fmt == MOE_WFMT_MXFP4 ? MOE_MXFP4_BLOCK
           : fmt == MOE_WFMT_NVFP4   ? MOE_NVFP4_BLOCK
                                     : (int64_t)1 << 40;
}

INL void pack_fmt(const moe_wfmt fmt, const moe_weight *w, int64_t r0, int64_t nrows, int64_t k0, int64_t kc, int nr,
                  double *Wp) {
    const int64_t npan = (nrows + nr - 1) / nr, k8 = kc / 8 * 8, blk = block_of(fmt);
    for (int64_t p = 0; p < npan; p++) {
        double *panel = Wp + p * kc * nr;
        for (int g = 0; g < nr / 8; g++) {
            int64_t rb = p * nr + 8 * g; /* first row of the group, relative to r0 */
            int live = (int)(nrows - rb >= 8 ? 8 : nrows - rb > 0 ? nrows - rb : 0);
            double m[8] = {0};
            for (int64_t k = 0; k < k8; k += 8) {
                if (k == 0 || (k0 + k) % blk == 0)
                    for (int i = 0; i < live; i++) m[i] = block_mult(w, r0 + rb + i, k0 + k);
                __m512d v[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++)
                    v[i] = i < live ? dec8(fmt, w, r0 + rb + i, k0 + k, m[i]) : _mm512_setzero_pd();
                tr8x8(v);
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) _mm512_store_pd(panel + (k + i) * nr + 8 * g, v[i]);
            }
            if (k8 < kc) { /* the last columns, through pack.c's decoder */
                double tail[8][8];
                for (int i = 0; i < 8; i++) {
                    if (i < live) moe_dgemm_decode_row(w, r0 + rb + i, k0 + k8, kc - k8, tail[i]);
                    else
                        for (int64_t k = 0; k < kc - k8; k++) tail[i][k] = 0.0;
                }
                for (int64_t k = k8; k < kc; k++)
                    for (int i = 0; i < 8; i++) panel[k * nr + 8 * g + i] = tail[i][k - k8];
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

static void pack_avx512(const moe_weight *w, int64_t r0, int64_t nrows, int64_t k0, int64_t kc, int nr, double *Wp) {
    MOE_ASSERT(r0 >= 0 && nrows >= 0 && r0 + nrows <= w->rows && k0 >= 0 && kc >= 0 && k0 + kc <= w->cols);
    MOE_ASSERT(nr % 8 == 0 && k0 % 8 == 0);
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

/* moe_dgemm_pack_ptrs: "rows" through the 8 x 8 transpose, "cols" by
 * 8-double copies (pure data movement: the same bits as pack.c). */
static TGT void pack_ptrs_avx512(const double *const *v, bool by_cols, int64_t r0, int64_t nrows, int64_t k0,
                                 int64_t kc, int nr, double *Wp) {
    MOE_ASSERT(nr % 8 == 0);
    const int64_t npan = (nrows + nr - 1) / nr, k8 = kc / 8 * 8;
    for (int64_t p = 0; p < npan; p++) {
        double *panel = Wp + p * kc * nr;
        for (int g = 0; g < nr / 8; g++) {
            int64_t rb = p * nr + 8 * g;
            int live = (int)(nrows - rb >= 8 ? 8 : nrows - rb > 0 ? nrows - rb : 0);
            if (by_cols) {
                __mmask8 m = (__mmask8)((1u << live) - 1u);
                for (int64_t k = 0; k < kc; k++)
                    _mm512_store_pd(panel + k * nr + 8 * g, _mm512_maskz_loadu_pd(m, v[k0 + k] + r0 + rb));
                continue;
            }
            for (int64_t k = 0; k < k8; k += 8) {
                __m512d x[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) x[i] = i < live ? _mm512_loadu_pd(v[r0 + rb + i] + k0 + k) : _mm512_setzero_pd();
                tr8x8(x);
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) _mm512_store_pd(panel + (k + i) * nr + 8 * g, x[i]);
            }
            for (int64_t k = k8; k < kc; k++)
                for (int i = 0; i < 8; i++) panel[k * nr + 8 * g + i] = i < live ? v[r0 + rb + i][k0 + k] : 0.0;
        }
    }
}

static const moe_dgemm_kernel avx512_kernel = {"avx512", MR, NR, tile_avx512, pack_avx512, pack_ptrs_avx512};

const moe_dgemm_kernel *moe_dgemm_avx512(void) { return &avx512_kernel; }
