/*
 * AVX-512 GEMM for every weight format: Y[t, j] = sum_k X[t, k] * W[j, k].
 *
 * Weights are decoded in registers, 32 columns (a "chunk") at a time, and fed
 * straight into fp32 FMAs; a register tile of R rows x NT tokens reuses each
 * decoded weight vector NT times and each activation vector R times.
 *
 *   E2M1 (MXFP4, NVFP4)  vpermb + vpsrlvd put nibble i of 16 packed bytes in
 *                        the low bits of dword i (see e2m1x32); vpermps looks
 *                        it up in the 16 values of the block's scale code, from a per-call
 *                        table of all 256 codes (MXFP4: e2m1 * 2^(e-127),
 *                        exact; NVFP4: (e2m1 * ue4m3) * scale2, the
 *                        reference's two roundings). Tiles of 1-2 tokens
 *                        decode two chunks per vpermb (e2m1x64, pair_step):
 *                        the same values and FMAs in the same order.
 *   E4M3 (FP8 block)     sign-extended byte << 7 is an fp16 whose value is
 *                        e4m3 * 2^-8 (subnormals included); vcvtph2ps, then
 *                        one multiply by scale * 2^8 (exact power-of-two fold,
 *                        so one rounding, as the reference); NaN codes 0x7F /
 *                        0xFF are patched in through a byte compare mask.
 *   BF16 / F16 / F32 / F64  shift / vcvtph2ps / load / vcvtpd2ps.
 *
 * Invariants (the kernel contract of cpu/kernels.h):
 *  1. Never allocates; stack buffers: a 32-float edge chunk and (NVFP4) the
 *     16 KiB table of decoded values per scale code; MXFP4's table is static,
 *     built once (pthread_once), read-only after.
 *  2. Fixed reduction order: each (token, row) owns one 16-lane accumulator;
 *     chunk c adds fma(x[32c..+16], w[..], acc) then fma(x[32c+16..], w[..],
 *     acc); edge lanes past cols are masked (acc kept). The 16 lanes are
 *     summed by one fixed tree (hsum16). Token tile, row tile, n, r0, r1 and
 *     the calling thread change none of these operations.
 *  3. Decoded values equal moe_weight_at_f32 (= moe_weight_row_f32) bit for
 *     bit; the edge chunk is decoded by that very function.
 * Needs AVX-512 F/BW/VL/DQ + VBMI (vpermb); dispatch.c checks.
 *
 * The second half of this file is the bf16-activation entry (gemm_bf16act,
 * AVX512_BF16: vdpbf16ps), with its own invariants stated there.
 */
#include "cpu/cpu_internal.h"

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#define MOE_TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,fma,f16c")))
#define MOE_INL static inline __attribute__((always_inline)) MOE_TGT

enum { MOE_CHUNK = 32, MOE_TOK_TILE = 32 };


/*
 * The 32 E2M1 values of the 16 bytes at p (lane i of lo: nibble i, of hi:
 * nibble 16 + i) through the 16-value tables lut_lo, lut_hi. One vpermb puts
 * byte i/2 in byte 0 of dword i and byte 8 + i/2 in its byte 1; vpsrlvd by
 * 0/4 (lo) or 8/12 (hi) brings the nibble to bits 0-3, the only index bits
 * vpermps reads. Per 32 weights: 1 load, 1 vpermb, 2 shifts, 2 vpermps. On
 * Zen 5 the shifts run beside the FMAs; the previous decode (vpmultishiftqb
 * per 16 weights, which takes an FMA pipe slot) measured 24 FMAs + 8 decodes
 * at 1.46x the FMAs alone.
 */
MOE_INL void e2m1x32(const uint8_t *p, __m512 lut_lo, __m512 lut_hi, __m512 *lo, __m512 *hi) {
    const __m512i sel = _mm512_set_epi32(0x0F0F0F07, 0x0F0F0F07, 0x0F0F0E06, 0x0F0F0E06, 0x0F0F0D05, 0x0F0F0D05,
                                         0x0F0F0C04, 0x0F0F0C04, 0x0F0F0B03, 0x0F0F0B03, 0x0F0F0A02, 0x0F0F0A02,
                                         0x0F0F0901, 0x0F0F0901, 0x0F0F0800, 0x0F0F0800);
    const __m512i clo = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    const __m512i chi = _mm512_set_epi32(12, 8, 12, 8, 12, 8, 12, 8, 12, 8, 12, 8, 12, 8, 12, 8);
    __m512i v = _mm512_permutexvar_epi8(sel, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p)));
    *lo = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, clo), lut_lo);
    *hi = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, chi), lut_hi);
}

/*
 * Two chunks at once: the 64 E2M1 values of the 32 bytes at p (w[0]: nibbles
 * 0-15, w[1]: 16-31, w[2]: 32-47, w[3]: 48-63) through the tables l[0..3].
 * One vpermb puts bytes i/2, 8 + i/2, 16 + i/2 and 24 + i/2 in the four
 * bytes of dword i; one vpsrlvd by 0/4 brings lane i's nibble of each byte
 * to the byte's low bits, and immediate shifts by 8, 16, 24 bring bytes 1-3
 * down to bits 0-3. Per 64 weights: 1 vpermb, 1 vpsrlvd, 3 vpsrld, 4
 * vpermps, where e2m1x32 twice spends 2 vpermb and 4 vpsrlvd: on an Intel
 * core, whose 512-bit shuffles, shifts and FMAs share ports 0 and 5, 13
 * instead of 14 of those per 64 weights and token at n = 1 (the FMAs
 * included). The same values as e2m1x32 on each half, bit for bit.
 */
MOE_INL void e2m1x64(const uint8_t *p, const __m512 *l, __m512 *w) {
    const __m512i sel = _mm512_setr_epi32(0x18100800, 0x18100800, 0x19110901, 0x19110901, 0x1A120A02, 0x1A120A02,
                                          0x1B130B03, 0x1B130B03, 0x1C140C04, 0x1C140C04, 0x1D150D05, 0x1D150D05,
                                          0x1E160E06, 0x1E160E06, 0x1F170F07, 0x1F170F07);
    const __m512i c04 = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    __m512i v = _mm512_permutexvar_epi8(sel, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)));
    __m512i s = _mm512_srlv_epi32(v, c04);
    w[0] = _mm512_permutexvar_ps(s, l[0]);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(s, 8), l[1]);
    w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(s, 16), l[2]);
    w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(s, 24), l[3]);
}

MOE_INL __m512 e2m1_lut(void) {
    return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f,
                          -4.0f, -6.0f);
}

/* Decode full chunk c (columns 32c .. 32c+31) of a row into lo, hi.
 * sc: FP8 only, the tile's folded multiplier (see fp8_fold). */
MOE_INL void decode_chunk(const moe_wfmt fmt, const moe_cpu_row *rc, int64_t c, const float *sc,
                          __m512 *lo, __m512 *hi) {
    switch (fmt) {
    case MOE_WFMT_F32: {
        const float *p = (const float *)rc->q + 32 * c;
        *lo = _mm512_loadu_ps(p);
        *hi = _mm512_loadu_ps(p + 16);
        return;
    }
    case MOE_WFMT_F64: {
        const double *p = (const double *)rc->q + 32 * c;
        *lo = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(_mm512_loadu_pd(p))),
                                 _mm512_cvtpd_ps(_mm512_loadu_pd(p + 8)), 1);
        *hi = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(_mm512_loadu_pd(p + 16))),
                                 _mm512_cvtpd_ps(_mm512_loadu_pd(p + 24)), 1);
        return;
    }
    case MOE_WFMT_F16: {
        const uint8_t *p = rc->q + 64 * c;
        *lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        *hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        return;
    }
    case MOE_WFMT_BF16: {
        const uint8_t *p = rc->q + 64 * c;
        *lo = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
        *hi = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 32))), 16));
        return;
    }
    case MOE_WFMT_FP8_BLOCK: {
        __m256i b = _mm256_loadu_si256((const __m256i *)(rc->q + 32 * c));
        __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7), _mm512_set1_epi16((short)0xBF80));
        __m512 l = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
        __m512 u = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
        if (sc[1] == 0.0f) {
            /* e4m3 * s == (e4m3 * 2^-8) * (s * 2^8): s * 2^8 is exact, one rounding */
            __m512 m = _mm512_set1_ps(sc[0]);
            l = _mm512_mul_ps(l, m);
            u = _mm512_mul_ps(u, m);
        } else {
            /* huge, Inf or NaN scale: two steps, the first exact */
            __m512 m1 = _mm512_set1_ps(256.0f), m2 = _mm512_set1_ps(sc[0]);
            l = _mm512_mul_ps(_mm512_mul_ps(l, m1), m2);
            u = _mm512_mul_ps(_mm512_mul_ps(u, m1), m2);
        }
        __mmask32 nan = _mm256_cmpeq_epi8_mask(_mm256_and_si256(b, _mm256_set1_epi8(0x7F)), _mm256_set1_epi8(0x7F));
        if (nan) {
            __m512 qn = _mm512_set1_ps(NAN);
            l = _mm512_mask_mov_ps(l, (__mmask16)nan, qn);
            u = _mm512_mask_mov_ps(u, (__mmask16)(nan >> 16), qn);
        }
        *lo = l;
        *hi = u;
        return;
    }
    case MOE_WFMT_MXFP4: {
        const float *t = rc->tab + 16 * (size_t)rc->s8[c];
        __m512 lut = _mm512_load_ps(t);
        e2m1x32(rc->q + 16 * c, lut, lut, lo, hi);
        return;
    }
    case MOE_WFMT_NVFP4: {
        e2m1x32(rc->q + 16 * c, _mm512_load_ps(rc->tab + 16 * (size_t)rc->s8[2 * c]),
                _mm512_load_ps(rc->tab + 16 * (size_t)rc->s8[2 * c + 1]), lo, hi);
        return;
    }
    }
}

/* FP8 tile multiplier: out[0] = s * 2^8 and out[1] = 0 when that fold is
 * exact (|s| < 2^119); else out[0] = s, out[1] = 1 (two-step path). */
MOE_INL void fp8_fold(const moe_cpu_row *rc, int64_t tc, float *out) {
    float s = moe_cpu_row_fp8_scale(rc, tc);
    if (fabsf(s) < 0x1p119f) {
        out[0] = s * 256.0f;
        out[1] = 0.0f;
    } else {
        out[0] = s;
        out[1] = 1.0f;
    }
}

/*
 * The 16 decoded E2M1 values of every scale code: tab[16 * code + i] =
 * e2m1(i) * e8m0(code) (MXFP4, exact) or (e2m1(i) * ue4m3(code)) * scale2
 * (NVFP4, the reference's operations in its order). 16 KiB: per chunk the
 * kernel then needs no multiply, only vpermps from the row. The MXFP4 table
 * depends on nothing else and is built once (g_mx_tab); NVFP4's carries the
 * weight's scale2 and is built per call.
 */
MOE_INL void build_e2m1_table(const moe_wfmt fmt, float scale2, float *tab) {
    const __m512 lut = e2m1_lut(), s2 = _mm512_set1_ps(scale2);
    for (int code = 0; code < 256; code++) {
        __m512 v;
        if (fmt == MOE_WFMT_MXFP4) {
            v = _mm512_mul_ps(lut, _mm512_set1_ps(moe_e8m0_to_f32((uint8_t)code)));
        } else {
            v = _mm512_mul_ps(_mm512_mul_ps(lut, _mm512_set1_ps(moe_ue4m3_to_f32((uint8_t)code))), s2);
        }
        _mm512_store_ps(tab + 16 * code, v);
    }
}

static float g_mx_tab[256 * 16] __attribute__((aligned(64)));
static pthread_once_t g_mx_tab_once = PTHREAD_ONCE_INIT;
static MOE_TGT void build_mx_table(void) { build_e2m1_table(MOE_WFMT_MXFP4, 1.0f, g_mx_tab); }

/* Edge chunk (m < 32 valid columns): the scalar decoder, zeros past m. */
MOE_INL void decode_edge(const moe_weight *w, int64_t j, int64_t c, int64_t m, __m512 *lo, __m512 *hi) {
    float buf[MOE_CHUNK] = {0};
    for (int64_t k = 0; k < m; k++) buf[k] = moe_weight_at_f32(w, j, 32 * c + k);
    *lo = _mm512_loadu_ps(buf);
    *hi = _mm512_loadu_ps(buf + 16);
}

/* Fixed summation tree of 16 lanes. */
MOE_INL float hsum16(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

enum { MOE_RMAX = 4, MOE_TMAX = 4 };

/* Chunk c (columns 32c .. 32c+31) of an R x NT tile: FP8 tile multiplier,
 * prefetch (when `pf` and c starts a cache line), decode, 2 R NT FMAs. */
MOE_INL void chunk_step(const moe_wfmt fmt, const int R, const int NT, const moe_cpu_row *rc,
                        float (*sb)[2], int64_t c, int pf, const float *const *xp, __m512 (*acc)[MOE_TMAX],
                        int64_t bpc, int64_t pf_data, int64_t spc, int64_t pf_scale) {
    __m512 wl[MOE_RMAX], wh[MOE_RMAX];
    if (fmt == MOE_WFMT_FP8_BLOCK && (c & 3) == 0)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) fp8_fold(&rc[r], (32 * c) / MOE_FP8_TILE, sb[r]);
    /* prefetch the same columns of the next row block (the hardware
     * prefetchers lose track of R interleaved row streams): +40% from DRAM */
    if (pf && ((c * bpc) & 63) == 0)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            for (int64_t o = 0; o < bpc; o += 64)
                _mm_prefetch((const char *)(rc[r].q + c * bpc + o + pf_data), _MM_HINT_T0);
    if (pf && spc && ((c * spc) & 63) == 0)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) _mm_prefetch((const char *)(rc[r].s8 + spc * c + pf_scale), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) decode_chunk(fmt, &rc[r], c, sb[r], &wl[r], &wh[r]);
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        __m512 xl = _mm512_loadu_ps(xp[t] + 32 * c), xh = _mm512_loadu_ps(xp[t] + 32 * c + 16);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            acc[r][t] = _mm512_fmadd_ps(xl, wl[r], acc[r][t]);
            acc[r][t] = _mm512_fmadd_ps(xh, wh[r], acc[r][t]);
        }
    }
}

/* Whether tile() takes E2M1 chunks in pairs (pair_step): MXFP4 / NVFP4
 * tiles of at most 2 tokens, where the decode is most of the work and the
 * 4 decoded vectors per row plus 2 x 4 activations fit the 32 registers.
 * MOE_AVX512_E2M1_PAIR=0 builds the single-chunk steps everywhere, for A/B
 * timing (the outputs are the same bits either way). */
#ifndef MOE_AVX512_E2M1_PAIR
#define MOE_AVX512_E2M1_PAIR 1
#endif
#define MOE_PAIRED(fmt, NT) (MOE_AVX512_E2M1_PAIR && ((fmt) == MOE_WFMT_MXFP4 || (fmt) == MOE_WFMT_NVFP4) && (NT) <= 2)

/* Chunks c and c + 1 (c even) of an R x NT E2M1 tile: the prefetches of
 * chunk_step for chunk c (every fourth chunk starts a cache line of codes,
 * c is even, so c + 1 never does), e2m1x64 per row, then per token the FMAs
 * of chunk c and then of chunk c + 1, in chunk_step's order for each
 * accumulator: the same operations as two chunk_steps. */
MOE_INL void pair_step(const moe_wfmt fmt, const int R, const int NT, const moe_cpu_row *rc, int64_t c,
                       const float *const *xp, __m512 (*acc)[MOE_TMAX], int64_t pf_data, int64_t spc,
                       int64_t pf_scale) {
    if (((c * 16) & 63) == 0)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) _mm_prefetch((const char *)(rc[r].q + c * 16 + pf_data), _MM_HINT_T0);
    if (((c * spc) & 63) == 0)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) _mm_prefetch((const char *)(rc[r].s8 + spc * c + pf_scale), _MM_HINT_T0);
    __m512 x[MOE_TMAX][4];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++)
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) x[t][q] = _mm512_loadu_ps(xp[t] + 32 * c + 16 * q);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        __m512 l[4], wv[4];
        if (fmt == MOE_WFMT_MXFP4) {
            l[0] = l[1] = _mm512_load_ps(rc[r].tab + 16 * (size_t)rc[r].s8[c]);
            l[2] = l[3] = _mm512_load_ps(rc[r].tab + 16 * (size_t)rc[r].s8[c + 1]);
        } else {
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) l[q] = _mm512_load_ps(rc[r].tab + 16 * (size_t)rc[r].s8[2 * c + q]);
        }
        e2m1x64(rc[r].q + 16 * c, l, wv);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) acc[r][t] = _mm512_fmadd_ps(x[t][q], wv[q], acc[r][t]);
    }
}

/*
 * One register tile: rows j0 .. j0+R-1, tokens t0 .. t0+NT-1, all columns.
 *   X: [n, ldx], Y: [n, ldy] with column j - r0 for row j.
 */
MOE_INL void tile(const moe_wfmt fmt, const int R, const int NT, const moe_weight *w, const float *tab, int64_t j0,
                  int64_t rs, int64_t pfr, const float *X, int64_t ldx, int64_t t0, float *Y, int64_t ldy, int64_t r0) {
    __m512 acc[MOE_RMAX][MOE_TMAX];
    moe_cpu_row rc[MOE_RMAX];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        rc[r] = moe_cpu_row_of(fmt, w, j0 + r * rs);
        rc[r].tab = tab;
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();
    }
    const float *xp[MOE_TMAX];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) xp[t] = X + (t0 + t) * ldx;
    int64_t cols = w->cols, nfull = cols / MOE_CHUNK, m = cols % MOE_CHUNK;
    /* bytes per chunk of a row; prefetch distances (one row block) */
    const int64_t bpc = moe_cpu_chunk_bytes(fmt);
    const int64_t pf_data = pfr * (cols * bpc / MOE_CHUNK);
    const int64_t spc = fmt == MOE_WFMT_MXFP4 ? 1 : fmt == MOE_WFMT_NVFP4 ? 2 : 0; /* scale bytes per chunk */
    const int64_t pf_scale = spc ? pfr * w->scale_cols : 0;
    /* FP8: the folded multiplier of the current 128-column tile */
    float sb[MOE_RMAX][2] = {{0}};
    /* two chunks per iteration (fewer pointer and loop updates: the loop is
     * issue-bound at small NT), then the odd one; same operations per chunk */
    int64_t c = 0;
    if (MOE_PAIRED(fmt, NT))
        for (; c + 2 <= nfull; c += 2) pair_step(fmt, R, NT, rc, c, xp, acc, pf_data, spc, pf_scale);
    else
        for (; c + 2 <= nfull; c += 2)
#pragma GCC unroll 2
            for (int u = 0; u < 2; u++)
                chunk_step(fmt, R, NT, rc, sb, c + u, u == 0 || bpc >= 64, xp, acc, bpc, pf_data, spc, pf_scale);
    if (c < nfull) chunk_step(fmt, R, NT, rc, sb, c, 1, xp, acc, bpc, pf_data, spc, pf_scale);
    if (m) {
        __mmask16 ml = (__mmask16)(m >= 16 ? 0xFFFF : (1u << m) - 1);
        __mmask16 mh = (__mmask16)(m <= 16 ? 0 : (1u << (m - 16)) - 1);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512 wl, wh;
            decode_edge(w, j0 + r * rs, nfull, m, &wl, &wh);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const float *x = xp[t] + 32 * nfull;
                __m512 xl = _mm512_maskz_loadu_ps(ml, x), xh = _mm512_maskz_loadu_ps(mh, x + 16);
                acc[r][t] = _mm512_mask3_fmadd_ps(xl, wl, acc[r][t], ml);
                acc[r][t] = _mm512_mask3_fmadd_ps(xh, wh, acc[r][t], mh);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) Y[(t0 + t) * ldy + (j0 + r * rs - r0)] = hsum16(acc[r][t]);
}

/* One function per (format, R, NT): each register tile gets its own register
 * allocation (inlined into one driver, the tiles' loops were allocated
 * together, and one tile's spills slowed another by up to 15%). */
#define MOE_TILE_FN(name, F, R_, NT_)                                                                            \
    static MOE_TGT __attribute__((noinline)) void name(const moe_weight *w, const float *tab, int64_t j0,        \
                                                      int64_t rs, int64_t pfr, const float *X, int64_t ldx,      \
                                                      int64_t t0, float *Y, int64_t ldy, int64_t r0) {           \
        tile(F, R_, NT_, w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0);                                            \
    }
#define MOE_TILE_FNS(fn, F)                                                                                      \
    MOE_TILE_FN(fn##_4x1, F, 4, 1) MOE_TILE_FN(fn##_4x2, F, 4, 2) MOE_TILE_FN(fn##_4x3, F, 4, 3)                 \
    MOE_TILE_FN(fn##_4x4, F, 4, 4)
MOE_TILE_FNS(tile_mxfp4, MOE_WFMT_MXFP4)
MOE_TILE_FNS(tile_nvfp4, MOE_WFMT_NVFP4)

/* Tokens t0 .. t0+nt-1 (nt <= MOE_TMAX) over rows j0 .. j0+R-1. */
MOE_INL void tile_tokens(const moe_wfmt fmt, const int R, const moe_weight *w, const float *tab, int64_t j0,
                         int64_t rs, int64_t pfr, const float *X, int64_t ldx, int64_t t0, int64_t nt, float *Y,
                         int64_t ldy, int64_t r0) {
    if (R == 4 && fmt == MOE_WFMT_MXFP4) {
        switch (nt) {
        case 4: tile_mxfp4_4x4(w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); return;
        case 3: tile_mxfp4_4x3(w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); return;
        case 2: tile_mxfp4_4x2(w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); return;
        default: tile_mxfp4_4x1(w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); return;
        }
    }
    if (R == 4 && fmt == MOE_WFMT_NVFP4) {
        switch (nt) {
        case 4: tile_nvfp4_4x4(w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); return;
        case 3: tile_nvfp4_4x3(w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); return;
        case 2: tile_nvfp4_4x2(w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); return;
        default: tile_nvfp4_4x1(w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); return;
        }
    }
    switch (nt) {
    case 4: tile(fmt, R, 4, w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); break;
    case 3: tile(fmt, R, 3, w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); break;
    case 2: tile(fmt, R, 2, w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); break;
    default: tile(fmt, R, 1, w, tab, j0, rs, pfr, X, ldx, t0, Y, ldy, r0); break;
    }
}

/*
 * Row spread: the 4 rows of a register tile are rs rows apart (rows j + u,
 * j + u + rs, j + u + 2 rs, j + u + 3 rs for u = 0 .. rs - 1), with rs =
 * 4096 / (bytes of a row's codes), at least 1 and at most 8, so that no two
 * of a tile's row streams share a 4 KiB page: the L2 streamer follows one
 * forward stream per page, and 4 adjacent rows of an MXFP4 weight of 4096
 * columns (2 KiB each) put two streams in every page. Software prefetch
 * (into L1, one fill buffer a line) then carried the rest, and one core
 * read about 10 GB/s where the read probe reaches 15-16. The order in
 * which rows are visited changes no operation on any (token, row)
 * accumulator: the bits are those of each row alone (test-kernels'
 * test_row_spread: spreads 1-5 and 8, every row against itself alone and
 * against float64, the bf16-activation entry too). Measured (docs/performance.md,
 * issue #18, twelfth session): one core streaming MXFP4 from DRAM at n = 1,
 * 2048 x 4096 +13% and 4096 x 2048 +27% on the Zen 4 EPYC.
 * MOE_AVX512_ROW_SPREAD=0 builds adjacent rows, for A/B timing.
 */
#ifndef MOE_AVX512_ROW_SPREAD
#define MOE_AVX512_ROW_SPREAD 1
#endif
static int64_t row_spread(const moe_wfmt fmt, const moe_weight *w) {
    const int64_t bpc = moe_cpu_chunk_bytes(fmt);
    const int64_t rowb = w->cols / MOE_CHUNK * bpc;
    if (!MOE_AVX512_ROW_SPREAD || rowb <= 0 || rowb >= 4096) return 1;
    const int64_t rs = 4096 / rowb;
    return rs > 8 ? 8 : rs;
}

/*
 * The driver: token tiles of MOE_TOK_TILE (their activations stay in L2
 * while every row block passes over them), then row blocks of 4 (spread:
 * row_spread), then token blocks of 4. (An 8-row tile for one token measured slower: register spills.)
 */
MOE_INL void gemm_fmt(const moe_wfmt fmt, const moe_weight *w, int64_t r0, int64_t r1, const float *X,
                      int64_t ldx, int64_t n, float *Y, int64_t ldy) {
    float nv_tab[256 * 16] __attribute__((aligned(64)));
    const float *tab = nv_tab;
    if (fmt == MOE_WFMT_MXFP4) {
        pthread_once(&g_mx_tab_once, build_mx_table);
        tab = g_mx_tab;
    } else if (fmt == MOE_WFMT_NVFP4) {
        build_e2m1_table(fmt, w->scale2, nv_tab);
    }
    /* prefetch distance in rows: the same rows of the next group of 4 rs */
    const int64_t rs = row_spread(fmt, w), pfr = 4 * rs;
    for (int64_t tt = 0; tt < n; tt += MOE_TOK_TILE) {
        int64_t te = tt + MOE_TOK_TILE < n ? tt + MOE_TOK_TILE : n;
        int64_t j = r0;
        /* balanced token blocks: 5 tokens run as 3 + 2, not 4 + 1 (each
         * block re-decodes the weights) */
        int64_t nt = te - tt, nb = (nt + MOE_TMAX - 1) / MOE_TMAX, base = nt / nb, extra = nt % nb;
        for (; j + 4 * rs <= r1; j += 4 * rs)
            for (int64_t u = 0; u < rs; u++)
                for (int64_t b = 0, t = tt; b < nb; t += base + (b < extra), b++)
                    tile_tokens(fmt, 4, w, tab, j + u, rs, pfr, X, ldx, t, base + (b < extra), Y, ldy, r0);
        for (; j + 4 <= r1; j += 4)
            for (int64_t b = 0, t = tt; b < nb; t += base + (b < extra), b++)
                tile_tokens(fmt, 4, w, tab, j, 1, 4, X, ldx, t, base + (b < extra), Y, ldy, r0);
        for (; j < r1; j++)
            for (int64_t b = 0, t = tt; b < nb; t += base + (b < extra), b++)
                tile_tokens(fmt, 1, w, tab, j, 1, 4, X, ldx, t, base + (b < extra), Y, ldy, r0);
    }
}

MOE_CPU_FMT_KERNELS(avx512_kernels, MOE_TGT, gemm_fmt)

static void gemm_avx512(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n,
                       float *Y, int64_t ldy) {
    moe_cpu_gemm_by_format(&avx512_kernels, w, r0, r1, X, ldx, n, Y, ldy);
}

/* ======================================================================
 * bf16 activations: vdpbf16ps (AVX512_BF16)
 * ====================================================================== */

/*
 * Entry gemm_bf16act (kernels.h): X holds bf16 values (as floats). MXFP4,
 * NVFP4 and BF16 weights are decoded to bf16 and multiplied by vdpbf16ps,
 * 32 weights per instruction per token; the other formats, and rows too wide
 * for the packed activations (MOE_BF_XWORDS), run the f32 kernel above.
 *
 *   Activations  once per token tile (up to MOE_TOK_TILE tokens, no more
 *                than MOE_BF_XWORDS bf16 values in all: 64 KiB of workspace),
 *                X is packed to bf16 with vcvtne2ps2bf16 (RNE: the identity
 *                on bf16 values; NaN stays NaN, fp32 subnormals become 0),
 *                columns zero-padded to a multiple of 32.
 *   Tiles        4 rows x up to 6 tokens (balanced token blocks), one
 *                accumulator per (row, token); the row remainder 1 x NT.
 *   E2M1         the 16 packed bytes of a chunk are broadcast to the four
 *                128-bit lanes (a load), one vpsrlvw by 4 x lane brings a
 *                nibble to bits 0-3 of each word, one vpermw looks the 32
 *                words up in the 32-entry bf16 table of the block's scale
 *                code (entries 16..31 repeat 0..15: index bit 4 is the next
 *                nibble's and is ignored). The words come out in the column
 *                order e2m1_perm (below), and the activations are packed in
 *                that order. NVFP4 chunks span two scale blocks: a second,
 *                masked vpermw. No vpermb (the f32 path's e2m1x32 needs one):
 *                Zen 5 measured the same either way; Intel cores run both
 *                shuffles on one port. MXFP4 table: e2m1(i) * 2^(e-127),
 *                exact in bf16 (2 significant bits, fp32's exponent range).
 *                NVFP4 table: e2m1(i) * ue4m3, exact (<= 6 significant bits,
 *                |v| in [2^-10, 2688]); scale2 is applied once to each
 *                output instead of to each weight.
 *   BF16         the stored words as they are.
 *
 * Operation sequence per (token t, row j) (kernel contract 2; whatever n,
 * r0, r1, the tile or the thread):
 *   acc[i] = 0 for the 16 lanes i; for each 32-column chunk c in order
 *   (the last one zero-padded on both sides), one vdpbf16ps:
 *     acc[i] = fma(x[k1], w[k1], acc[i])   (the pair's high word first)
 *     acc[i] = fma(x[k0], w[k0], acc[i])
 *   with k1 = 32c + col(2i + 1), k0 = 32c + col(2i); col(p) = p for BF16
 *   weights, e2m1_perm(p) = 4 (p mod 8) + p / 8 for MXFP4 and NVFP4;
 *   each a single fp32 rounding to nearest even with denormal inputs (bf16
 *   operands and acc) read as zero and denormal results flushed to zero
 *   (that is the instruction's definition, MXCSR ignored; measured bit for
 *   bit on Zen 5, tests/test-kernels.c). The products are exact (bf16 x bf16
 *   has <= 16 significant bits). Then y = hsum16(acc) (the fixed tree of
 *   the f32 path, IEEE fp32 adds) and, NVFP4 only, y = y * scale2.
 * Differences from the reference, and so from the f32 kernel: weights and
 * activations below 2^-126 in magnitude count as zero (MXFP4: only scale
 * codes 0 and 1 give such weights; NVFP4: none), partial sums below 2^-126
 * flush to zero, NVFP4 rounds sum(x * e2m1 * ue4m3) * scale2 once instead of
 * every (e2m1 * ue4m3) * scale2 (and may overflow where the reference does
 * not when |x * e2m1 * ue4m3| sums exceed FLT_MAX with scale2 < 1).
 *
 * Invariants (kernel contract):
 *  1. Never allocates: the packed activations live in the caller's
 *     workspace (gemm_avx512_bf16act_ws: one token tile, at most 64 KiB);
 *     the two 16 KiB E2M1 tables are static, built once (pthread_once) and
 *     read-only after.
 *  2. The operation sequence above depends on w only (format, cols: the f32
 *     fallback above 32768 columns), never on n, r0, r1, the token tile or
 *     block, or the thread.
 *  3. Decoded weights equal the reference's (NVFP4: before scale2) bit for
 *     bit; tests/test-kernels.c compares every output with a scalar model
 *     of the sequence above, ties and flushes included.
 */
#include "cpu/avx512/e2m1_bf16.h"


/* bf16 words of packed activations in the workspace (64 KiB): cols up to
 * MOE_BF_XWORDS take this path, with up to MOE_BF_XWORDS / cols_pad tokens
 * per tile (cols 4096: 8, 2048: 16, 7168: 4), rounded down to a multiple of
 * MOE_BF_TMAX when the call has more tokens than that (4096: 6, 2048: 12) */
enum { MOE_BF_XWORDS = 32768, MOE_BF_TMAX = 6 };

/* bf16 bits of an exactly representable float (NaN: a quiet NaN, sign kept) */
static inline uint16_t bf16_exact_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if (v != v) return (uint16_t)((u >> 16) | 0x0040u);
    MOE_ASSERT((u & 0xFFFFu) == 0);
    return (uint16_t)(u >> 16);
}

/* The tables of moe_cpu_e2m1_bf16_tab: g_bf_tab[0] MXFP4, g_bf_tab[1] NVFP4. */
static uint16_t g_bf_tab[2][256 * 32] __attribute__((aligned(64)));
static pthread_once_t g_bf_tab_once = PTHREAD_ONCE_INIT;

static void build_e2m1_bf16_tables(void) {
    for (int f = 0; f < 2; f++)
        for (int code = 0; code < 256; code++) {
            float s = f == 0 ? moe_e8m0_to_f32((uint8_t)code) : moe_ue4m3_to_f32((uint8_t)code);
            for (int i = 0; i < 32; i++)
                g_bf_tab[f][32 * code + i] = bf16_exact_bits(moe_e2m1_to_f32((uint8_t)(i & 15)) * s);
        }
}

const uint16_t *moe_cpu_e2m1_bf16_tab(bool nvfp4) {
    pthread_once(&g_bf_tab_once, build_e2m1_bf16_tables);
    return g_bf_tab[nvfp4];
}


enum { MOE_BF_BLOCK = 4 };

/* Chunk c of an R x NT tile: prefetch (when `pf` and c starts a cache line:
 * the same columns R rows further on, as chunk_step), decode, R NT vdpbf16ps. */
MOE_INL_BF void bf_chunk_step(const moe_wfmt fmt, const int R, const int NT, const bf_rows *rw, const uint16_t *tab,
                              int64_t c, int pf, const uint16_t *xb, int64_t ldxb, __m512 (*acc)[MOE_BF_TMAX],
                              int64_t bpc, int64_t spc, __m512i sh) {
    if (pf && ((c * bpc) & 63) == 0)
#pragma GCC unroll 6
        for (int r = 0; r < R; r++)
            for (int64_t o = 0; o < bpc; o += 64)
                _mm_prefetch((const char *)(rw->q + (r + R) * rw->qs + c * bpc + o), _MM_HINT_T0);
    if (pf && spc && ((c * spc) & 63) == 0)
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) _mm_prefetch((const char *)(rw->s + (r + R) * rw->ss + spc * c), _MM_HINT_T0);
    __m512i wv[MOE_BF_BLOCK];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) wv[r] = bf_decode_chunk(fmt, rw, r, tab, c, sh);
#pragma GCC unroll 6
    for (int t = 0; t < NT; t++) {
        __m512bh x = (__m512bh)_mm512_load_si512(xb + t * ldxb + 32 * c);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], x, (__m512bh)wv[r]);
    }
}

/*
 * One register tile: rows j0 .. j0+R-1 x the NT packed tokens at xb ([NT,
 * ldxb] bf16, zero-padded to a multiple of 32), written to Y rows
 * t0 .. t0+NT-1, column j - r0.
 */
MOE_INL_BF void bf_tile(const moe_wfmt fmt, const int R, const int NT, const moe_weight *w, const uint16_t *tab,
                        int64_t j0, int64_t rs, const uint16_t *xb, int64_t ldxb, float *Y, int64_t ldy, int64_t t0,
                        int64_t r0) {
    const __m512i sh = e2m1_bf16_shifts();
    __m512 acc[MOE_BF_BLOCK][MOE_BF_TMAX];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t cols = w->cols, nfull = cols / MOE_CHUNK, m = cols % MOE_CHUNK;
    moe_cpu_row rc = moe_cpu_row_of(fmt, w, j0);
    const int64_t bpc = moe_cpu_chunk_bytes(fmt);
    const int64_t spc = fmt == MOE_WFMT_MXFP4 ? 1 : fmt == MOE_WFMT_NVFP4 ? 2 : 0;
    /* rows j0 + r rs (row_spread); the prefetch of R rows on is the same rows of the next group */
    const bf_rows rw = {rc.q, rc.s8, rs * (cols * bpc / MOE_CHUNK), spc ? rs * w->scale_cols : 0};
    int64_t c = 0;
    for (; c + 2 <= nfull; c += 2)
#pragma GCC unroll 2
        for (int u = 0; u < 2; u++)
            bf_chunk_step(fmt, R, NT, &rw, tab, c + u, u == 0 || bpc >= 64, xb, ldxb, acc, bpc, spc, sh);
    if (c < nfull) bf_chunk_step(fmt, R, NT, &rw, tab, c, 1, xb, ldxb, acc, bpc, spc, sh);
    if (m) {
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            __m512bh wv = (__m512bh)bf_decode_edge(fmt, &rw, r, tab, nfull, m, sh);
#pragma GCC unroll 6
            for (int t = 0; t < NT; t++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)_mm512_load_si512(xb + t * ldxb + 32 * nfull), wv);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int t = 0; t < NT; t++) {
            float y = hsum16(acc[r][t]);
            if (fmt == MOE_WFMT_NVFP4) y = y * w->scale2;
            Y[(t0 + t) * ldy + (j0 + r * rs - r0)] = y;
        }
}

/*
 * One function per (format, NT) for a block of 4 rows, and one for a single
 * row (the remainder of r0 .. r1), each with its own register allocation (as
 * MOE_TILE_FN). 4 x NT: 4 to 24 accumulators + 4 weight vectors. Measured
 * (Zen 5, 2 threads streaming 2048 x 4096 MXFP4 from DRAM): up to 6 tokens
 * per pass decodes each weight once where 4 needed two passes (n = 5: 0.146
 * -> 0.108 ms, n = 6: 0.163 -> 0.124 ms); 2 x 7 and 2 x 8 tiles were slower
 * than 4 x 4 + 4 x 3 / 4 x 4; 8-row tiles for 1-2 tokens (more accumulators
 * against vdpbf16ps's 6-cycle latency) did not measure faster: those token
 * counts are bound by the weight stream.
 */
#define MOE_BF_BLOCK_FN(name, F, NT_)                                                                            \
    static MOE_TGT_BF __attribute__((noinline)) void name##_b##NT_(                                              \
        const moe_weight *w, const uint16_t *tab, int64_t j0, int64_t rs, const uint16_t *xb, int64_t ldxb,       \
        float *Y, int64_t ldy, int64_t t0, int64_t r0) {                                                         \
        bf_tile(F, MOE_BF_BLOCK, NT_, w, tab, j0, rs, xb, ldxb, Y, ldy, t0, r0);                                \
    }                                                                                                            \
    static MOE_TGT_BF __attribute__((noinline)) void name##_r##NT_(                                              \
        const moe_weight *w, const uint16_t *tab, int64_t j0, int64_t rs, const uint16_t *xb, int64_t ldxb,       \
        float *Y, int64_t ldy, int64_t t0, int64_t r0) {                                                         \
        bf_tile(F, 1, NT_, w, tab, j0, rs, xb, ldxb, Y, ldy, t0, r0);                                           \
    }
typedef void (*moe_bf_tile_fn)(const moe_weight *w, const uint16_t *tab, int64_t j0, int64_t rs,
                               const uint16_t *xb, int64_t ldxb, float *Y, int64_t ldy, int64_t t0, int64_t r0);
/* fn[1][NT - 1]: 4-row block, fn[0][NT - 1]: one row */
#define MOE_BF_TILE_FNS(fn, F)                                                                                   \
    MOE_BF_BLOCK_FN(fn, F, 1) MOE_BF_BLOCK_FN(fn, F, 2) MOE_BF_BLOCK_FN(fn, F, 3) MOE_BF_BLOCK_FN(fn, F, 4)      \
    MOE_BF_BLOCK_FN(fn, F, 5) MOE_BF_BLOCK_FN(fn, F, 6)                                                          \
    static const moe_bf_tile_fn fn[2][MOE_BF_TMAX] = {{fn##_r1, fn##_r2, fn##_r3, fn##_r4, fn##_r5, fn##_r6},     \
                                                      {fn##_b1, fn##_b2, fn##_b3, fn##_b4, fn##_b5, fn##_b6}};
MOE_BF_TILE_FNS(bf_tiles_mxfp4, MOE_WFMT_MXFP4)
MOE_BF_TILE_FNS(bf_tiles_nvfp4, MOE_WFMT_NVFP4)
MOE_BF_TILE_FNS(bf_tiles_bf16, MOE_WFMT_BF16)


/* Tokens per packed tile for a weight of `cols` columns and a call of n
 * tokens: the tiles that fit MOE_BF_XWORDS words; more tokens than one tile
 * holds: whole token blocks per tile (T = 4096, 2 threads: tiles of 6 tokens
 * at cols 4096 and 12 at 2048 ran 1.71-1.75 s against 1.83-1.84 s for 8 / 16
 * and 1.79-1.80 s for a 96 KiB buffer, 12 / 24); fewer: one tile (one pass
 * over the weights). */
static int64_t bf_tile_tokens(int64_t cols, int64_t n) {
    int64_t ldxb = (cols + MOE_CHUNK - 1) / MOE_CHUNK * MOE_CHUNK, tt_max = MOE_BF_XWORDS / ldxb;
    if (tt_max > MOE_TOK_TILE) tt_max = MOE_TOK_TILE;
    if (n > tt_max && tt_max >= MOE_BF_TMAX) tt_max -= tt_max % MOE_BF_TMAX;
    return tt_max;
}

/* The bf16-activation driver: token tiles packed once into the workspace
 * xb ([tile tokens, ldxb] bf16), then row blocks of 4 (spread as the f32
 * driver's: row_spread; then adjacent rows and single rows), then
 * balanced token blocks of up to MOE_BF_TMAX (the rows' weights stay in L1
 * across the blocks). */
static MOE_TGT_BF void gemm_bf_fmt(const moe_wfmt fmt, const moe_bf_tile_fn (*tiles)[MOE_BF_TMAX],
                                   const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n,
                                   float *Y, int64_t ldy, uint16_t *xb) {
    int64_t ldxb = (w->cols + MOE_CHUNK - 1) / MOE_CHUNK * MOE_CHUNK, tt_max = bf_tile_tokens(w->cols, n);
    const uint16_t *tab = moe_cpu_e2m1_bf16_tab(fmt == MOE_WFMT_NVFP4);
    const int64_t rs = row_spread(fmt, w);
    for (int64_t tt = 0; tt < n; tt += tt_max) {
        int64_t nt = n - tt < tt_max ? n - tt : tt_max;
        bf_pack(X, ldx, tt, nt, w->cols, xb, ldxb, fmt != MOE_WFMT_BF16);
        int64_t nb = (nt + MOE_BF_TMAX - 1) / MOE_BF_TMAX, base = nt / nb, extra = nt % nb;
        int64_t j = r0;
        for (; j + MOE_BF_BLOCK * rs <= r1; j += MOE_BF_BLOCK * rs)
            for (int64_t u = 0; u < rs; u++)
                for (int64_t b = 0, t = 0; b < nb; t += base + (b < extra), b++)
                    tiles[1][base + (b < extra) - 1](w, tab, j + u, rs, xb + t * ldxb, ldxb, Y, ldy, tt + t, r0);
        while (j < r1) {
            int full = j + MOE_BF_BLOCK <= r1;
            for (int64_t b = 0, t = 0; b < nb; t += base + (b < extra), b++)
                tiles[full][base + (b < extra) - 1](w, tab, j, 1, xb + t * ldxb, ldxb, Y, ldy, tt + t, r0);
            j += full ? MOE_BF_BLOCK : 1;
        }
    }
}

/* Does the bf16-activation entry multiply w in bf16 (vdpbf16ps)? MXFP4,
 * NVFP4 and BF16 rows up to MOE_BF_XWORDS columns; the rest run the f32
 * kernels (the formats whose weights are not exact in bf16: F32, F64, F16,
 * FP8; wider rows). Depends on w only. */
static bool bf_path(const moe_weight *w) {
    return (w->fmt == MOE_WFMT_MXFP4 || w->fmt == MOE_WFMT_NVFP4 || w->fmt == MOE_WFMT_BF16) &&
           w->cols <= MOE_BF_XWORDS;
}

/* Workspace: one packed token tile, [tile tokens, ldxb] bf16 (at most 64 KiB). */
static size_t gemm_avx512_bf16act_ws(const moe_weight *w, int64_t n) {
    if (!bf_path(w) || n <= 0) return 0;
    int64_t ldxb = (w->cols + MOE_CHUNK - 1) / MOE_CHUNK * MOE_CHUNK, tt = bf_tile_tokens(w->cols, n);
    return (size_t)((n < tt ? n : tt) * ldxb) * 2;
}

static void gemm_avx512_bf16act(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx,
                                int64_t n, float *Y, int64_t ldy, void *ws) {
    if (!bf_path(w)) {
        moe_cpu_gemm_by_format(&avx512_kernels, w, r0, r1, X, ldx, n, Y, ldy);
        return;
    }
    MOE_ASSERT(r0 >= 0 && r0 <= r1 && r1 <= w->rows && n >= 0);
    MOE_ASSERT(w->fmt == MOE_WFMT_BF16 || w->cols % MOE_NVFP4_BLOCK == 0);
    MOE_ASSERT(w->fmt != MOE_WFMT_MXFP4 || w->cols % MOE_MXFP4_BLOCK == 0);
    if (r0 == r1 || n == 0) return;
    MOE_ASSERT(ws && ((uintptr_t)ws & 63) == 0);
    uint16_t *xb = ws;
    switch (w->fmt) {
    case MOE_WFMT_MXFP4: gemm_bf_fmt(MOE_WFMT_MXFP4, bf_tiles_mxfp4, w, r0, r1, X, ldx, n, Y, ldy, xb); break;
    case MOE_WFMT_NVFP4: gemm_bf_fmt(MOE_WFMT_NVFP4, bf_tiles_nvfp4, w, r0, r1, X, ldx, n, Y, ldy, xb); break;
    default: gemm_bf_fmt(MOE_WFMT_BF16, bf_tiles_bf16, w, r0, r1, X, ldx, n, Y, ldy, xb); break;
    }
}

/* For the AMX table (amx/gemm_amx.c): this file's f32 entry and bf16 one. */
void moe_cpu_avx512_gemm(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n,
                         float *Y, int64_t ldy) {
    gemm_avx512(w, r0, r1, X, ldx, n, Y, ldy);
}

static const moe_cpu_kernels moe_avx512_table = {
    .isa = "avx512",
    .gemm = gemm_avx512,
    .gemm_bf16act = NULL,
    .bf16act_ws = NULL,
    .swiglu = moe_cpu_avx512_swiglu,
};

static const moe_cpu_kernels moe_avx512_bf16_table = {
    .isa = "avx512",
    .gemm = gemm_avx512,
    .gemm_bf16act = gemm_avx512_bf16act,
    .bf16act_ws = gemm_avx512_bf16act_ws,
    .swiglu = moe_cpu_avx512_swiglu,
};

const moe_cpu_kernels *moe_cpu_avx512_table(bool bf16) { return bf16 ? &moe_avx512_bf16_table : &moe_avx512_table; }
