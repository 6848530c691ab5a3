/*
 * AVX2 + FMA + F16C GEMM for every weight format: Y[t, j] = sum_k X[t, k] * W[j, k].
 * For laptop- and desktop-class x86 CPUs without AVX-512.
 *
 * Weights are decoded in registers, 8 columns (a "group") at a time, and fed
 * straight into fp32 FMAs; a register tile of R rows x NT tokens reuses each
 * decoded weight vector NT times and each activation vector R times. The
 * column loop runs over 32-column chunks (4 groups): one MXFP4 scale, two
 * NVFP4 scales, a quarter of an FP8 tile.
 *
 *   E2M1 (MXFP4, NVFP4)  the 4 packed bytes of a group are broadcast to all
 *                        dwords; vpsrlvd by 4i puts nibble i in the low bits
 *                        of dword i; vpermps (reads bits 0-2) looks up the
 *                        magnitude in 8 entries of the block's scale code,
 *                        and one xor with (index << 28) sets the sign. The
 *                        entries are stored pre-xored with (c << 28) so that
 *                        the xor cancels the magnitude bits it also moves
 *                        (bits 28-30) and leaves only the sign flip: no mask.
 *                        The per-call table holds all 256 scale codes
 *                        (MXFP4: e2m1 * 2^(e-127), exact; NVFP4: (e2m1 *
 *                        ue4m3) * scale2, the reference's two roundings; a
 *                        negative code is the exact negation of the positive
 *                        one because round-to-nearest-even is sign-symmetric).
 *   E4M3 (FP8 block)     sign-extended byte << 7, masked to 0xBF80, is an
 *                        fp16 whose value is e4m3 * 2^-8 (subnormals
 *                        included); vcvtph2ps, then one multiply by
 *                        scale * 2^8 (an exact power-of-two fold, so one
 *                        rounding, as the reference). A chunk holding a NaN
 *                        code (0x7F / 0xFF; one byte compare per 32 columns)
 *                        or a tile scale too large for the fold (|s| >=
 *                        2^119, Inf, NaN) is decoded by moe_weight_at_f32.
 *   BF16 / F16 / F32 / F64  vpmovzxwd + shift / vcvtph2ps / load / vcvtpd2ps.
 *
 * Invariants (the kernel contract of cpu/kernels.h):
 *  1. Never allocates; the stack holds a 32-float edge chunk, an R x 32
 *     FP8 rare-chunk buffer, the 8 KiB E2M1 table and, for E2M1 token
 *     tiles of 6 or more tokens, the decode-once panel (4 rows x 512 columns,
 *     8 KiB) and its parked accumulators (4 rows x 32 tokens x 8 lanes,
 *     4 KiB): about 21 KiB in all.
 *  2. Fixed reduction order: each (token, row) owns one 8-lane accumulator;
 *     group g (columns 8g .. 8g+7) adds acc = fma(x[8g..], w[8g..], acc), for
 *     g = 0, 1, ... in order. In the edge chunk (the last cols % 32 columns)
 *     the lanes past cols keep acc (blend). The 8 lanes are summed by one
 *     fixed tree (hsum8). Token tile, row tile, n, r0, r1 and the calling
 *     thread change none of these operations.
 *  3. Decoded values equal moe_weight_at_f32 (= moe_weight_row_f32) bit for
 *     bit; the edge chunk and FP8 rare chunks are decoded by that very
 *     function.
 *
 * The E2M1 decode costs 4 vector instructions per 8 weights (broadcast
 * load aside), three of them on the shuffle/shift ports (Zen: pipes 1 and
 * 2; Intel: port 5 and the FMA ports 0/1), about 6 cycles per 32 weights per
 * core on Zen 4, so at 1-4 tokens per expert the decode, not memory, bounds
 * MXFP4 / NVFP4 on a core that streams more than ~10 GB/s. Measured
 * alternatives (single core, L1-resident, docs/performance.md): vpshufb to
 * int8 + vpmovsxbd + vcvtdq2ps + scale multiply 1.5x slower, vpshufb to fp16
 * + vcvtph2ps 1.4x slower, the sign by vpmulld or by and/compare no faster.
 * From 6 tokens the decode-once panels (gemm_fmt) decode each weight once
 * per 32-token tile.
 * Needs AVX2, FMA, F16C and the OS's YMM state; dispatch.c checks.
 */
#include "cpu/cpu_internal.h"

#include <immintrin.h>
#include <math.h>

#define MOE_INL static inline __attribute__((always_inline))

enum { MOE_CHUNK = 32, MOE_TOK_TILE = 32 };

/* 8 E2M1 values of the 4 bytes at p (lane i: nibble i) through `lut`, 8
 * magnitudes stored as bits(value(c)) ^ (c << 28) (see build_e2m1_table). */
MOE_INL __m256 e2m1x8(const uint8_t *p, const float *lut) {
    const __m256i cnt = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    int32_t a;
    memcpy(&a, p, 4);
    __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(a), cnt);
    __m256 mag = _mm256_permutevar8x32_ps(_mm256_loadu_ps(lut), idx);
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

/* FP8 tile multiplier s * 2^8, or 0 with *ok = false when that fold would
 * not be exact (|s| >= 2^119, Inf, NaN: such tiles use the scalar decoder). */
MOE_INL float fp8_fold(const moe_cpu_row *rc, int64_t tc, bool *ok) {
    float s = moe_cpu_row_fp8_scale(rc, tc);
    *ok = fabsf(s) < 0x1p119f;
    return *ok ? s * 256.0f : 0.0f;
}

/* True when one of the 32 FP8 codes of chunk c is a NaN code (0x7F, 0xFF). */
MOE_INL bool fp8_has_nan(const moe_cpu_row *rc, int64_t c) {
    __m256i b = _mm256_loadu_si256((const __m256i *)(rc->q + 32 * c));
    const __m256i m7f = _mm256_set1_epi8(0x7F);
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(b, m7f), m7f)) != 0;
}

/* Decode group g (columns 32c + 8g .. +7) of a full chunk c of a row.
 * lut: MXFP4 / NVFP4, the 8 entries of this group's scale code.
 * sc:  FP8, the tile's scale * 2^8 (fp8_fold; the chunk has no NaN code and
 *      the fold was exact, else the chunk went through the scalar decoder). */
MOE_INL __m256 decode_group(const moe_wfmt fmt, const moe_cpu_row *rc, int64_t c, int g, const float *lut,
                            const float *sc) {
    int64_t k = 32 * c + 8 * g; /* first column */
    switch (fmt) {
    case MOE_WFMT_F32: return _mm256_loadu_ps((const float *)rc->q + k);
    case MOE_WFMT_F64: {
        const double *p = (const double *)rc->q + k;
        return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(_mm256_loadu_pd(p))),
                                    _mm256_cvtpd_ps(_mm256_loadu_pd(p + 4)), 1);
    }
    case MOE_WFMT_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rc->q + 2 * k)));
    case MOE_WFMT_BF16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(rc->q + 2 * k))), 16));
    case MOE_WFMT_FP8_BLOCK: {
        __m128i b = _mm_loadl_epi64((const __m128i *)(rc->q + k));
        __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16((short)0xBF80));
        /* e4m3 * s == (e4m3 * 2^-8) * (s * 2^8): s * 2^8 is exact, one rounding */
        return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(sc[0]));
    }
    case MOE_WFMT_MXFP4:
    case MOE_WFMT_NVFP4: return e2m1x8(rc->q + 16 * c + 4 * g, lut);
    }
    return _mm256_setzero_ps();
}

/*
 * The 8 E2M1 magnitudes of every scale code, stored for e2m1x8:
 * tab[8 * code + c] = bits(e2m1(c) * e8m0(code)) ^ (c << 28)       (MXFP4, exact)
 *                   = bits((e2m1(c) * ue4m3(code)) * scale2) ^ (c << 28)  (NVFP4)
 * 8 KiB, built per call: per group the kernel then needs no multiply.
 */
MOE_INL void build_e2m1_table(const moe_wfmt fmt, float scale2, float *tab) {
    const __m256 lut = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i tag = _mm256_setr_epi32(0, 1 << 28, 2 << 28, 3 << 28, 4 << 28, 5 << 28, 6 << 28, 7 << 28);
    const __m256 s2 = _mm256_set1_ps(scale2);
    for (int code = 0; code < 256; code++) {
        __m256 v;
        if (fmt == MOE_WFMT_MXFP4) v = _mm256_mul_ps(lut, _mm256_set1_ps(moe_e8m0_to_f32((uint8_t)code)));
        else v = _mm256_mul_ps(_mm256_mul_ps(lut, _mm256_set1_ps(moe_ue4m3_to_f32((uint8_t)code))), s2);
        _mm256_store_ps(tab + 8 * code, _mm256_xor_ps(v, _mm256_castsi256_ps(tag)));
    }
}

/* Fixed summation tree of 8 lanes. */
MOE_INL float hsum8(__m256 v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

enum { MOE_RMAX = 4, MOE_TMAX = 4 };

/* The 4 groups of full chunk c for rows rc[0 .. R-1] and tokens xp[0 .. NT-1].
 * buf: NULL, or [R][32] values already decoded (the FP8 rare path). */
MOE_INL void chunk(const moe_wfmt fmt, const int R, const int NT, const moe_cpu_row *rc, int64_t c,
                   const float *(*lut)[2], const float *sb, const float *buf, const float *const *xp,
                   __m256 (*acc)[MOE_TMAX]) {
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        __m256 wv[MOE_RMAX];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            wv[r] = buf ? _mm256_loadu_ps(buf + 32 * r + 8 * g) : decode_group(fmt, &rc[r], c, g, lut[r][g >> 1], &sb[r]);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            __m256 x = _mm256_loadu_ps(xp[t] + 32 * c + 8 * g);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(x, wv[r], acc[r][t]);
        }
    }
}

/*
 * One register tile: rows j0 .. j0+R-1, tokens t0 .. t0+NT-1, all columns.
 *   X: [n, ldx], Y: [n, ldy] with column j - r0 for row j.
 * Shapes used: 4 x 1, 4 x 2, 3 x 3, 3 x 4 (and 1 x NT for leftover rows).
 * With 16 YMM registers, 8 accumulators leave the two FMA pipes short of
 * independent chains (4-cycle latency); 12 (3 x 4), with activations read
 * as FMA memory operands, measured 1.3x faster than 2 x 4 for BF16 and
 * MXFP4 at 16 tokens. One token: 4 rows beat 6 and 8 (spills).
 */
MOE_INL void tile(const moe_wfmt fmt, const int R, const int NT, const moe_weight *w, const float *tab, int64_t j0,
                  const float *X, int64_t ldx, int64_t t0, float *Y, int64_t ldy, int64_t r0) {
    __m256 acc[MOE_RMAX][MOE_TMAX];
    moe_cpu_row rc[MOE_RMAX];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        rc[r] = moe_cpu_row_of(fmt, w, j0 + r);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[r][t] = _mm256_setzero_ps();
    }
    const float *xp[MOE_TMAX];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) xp[t] = X + (t0 + t) * ldx;
    int64_t cols = w->cols, nfull = cols / MOE_CHUNK, m = cols % MOE_CHUNK;
    /* bytes per chunk of a row; prefetch distance: one row block ahead */
    const int64_t bpc = moe_cpu_chunk_bytes(fmt);
    const int64_t pf_data = R * (cols * bpc / MOE_CHUNK);
    const int64_t spc = fmt == MOE_WFMT_MXFP4 ? 1 : fmt == MOE_WFMT_NVFP4 ? 2 : 0; /* scale bytes per chunk */
    const int64_t pf_scale = spc ? R * w->scale_cols : 0;
    float sb[MOE_RMAX] = {0};       /* FP8: the folded multiplier of the current 128-column tile */
    bool sok[MOE_RMAX] = {0};       /* FP8: that fold is exact */
    const float *lut[MOE_RMAX][2];  /* E2M1: table entries of the chunk's scale codes */
    for (int64_t c = 0; c < nfull; c++) {
        if (((c * bpc) & 63) == 0)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                for (int64_t o = 0; o < bpc; o += 64)
                    _mm_prefetch((const char *)(rc[r].q + c * bpc + o + pf_data), _MM_HINT_T0);
        if (spc && ((c * spc) & 63) == 0)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(rc[r].s8 + spc * c + pf_scale), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            if (fmt == MOE_WFMT_FP8_BLOCK) {
                if ((c & 3) == 0) sb[r] = fp8_fold(&rc[r], (32 * c) / MOE_FP8_TILE, &sok[r]);
                lut[r][0] = lut[r][1] = NULL;
            } else if (fmt == MOE_WFMT_MXFP4) {
                lut[r][0] = lut[r][1] = tab + 8 * rc[r].s8[c];
            } else if (fmt == MOE_WFMT_NVFP4) {
                lut[r][0] = tab + 8 * rc[r].s8[2 * c];
                lut[r][1] = tab + 8 * rc[r].s8[2 * c + 1];
            } else {
                lut[r][0] = lut[r][1] = NULL;
            }
        }
        bool rare = false; /* FP8: a NaN code or an unfoldable scale in some row of the chunk */
        if (fmt == MOE_WFMT_FP8_BLOCK)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) rare |= !sok[r] || fp8_has_nan(&rc[r], c);
        if (fmt == MOE_WFMT_FP8_BLOCK && rare) {
            float buf[MOE_RMAX * MOE_CHUNK];
            for (int r = 0; r < R; r++)
                for (int k = 0; k < MOE_CHUNK; k++) buf[32 * r + k] = moe_weight_at_f32(w, j0 + r, 32 * c + k);
            chunk(fmt, R, NT, rc, c, lut, sb, buf, xp, acc);
        } else {
            chunk(fmt, R, NT, rc, c, lut, sb, NULL, xp, acc);
        }
    }
    if (m) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        int ng = (int)((m + 7) / 8);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            float buf[MOE_CHUNK] = {0};
            for (int64_t k = 0; k < m; k++) buf[k] = moe_weight_at_f32(w, j0 + r, 32 * nfull + k);
            for (int g = 0; g < ng; g++) {
                __m256i msk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(m - 8 * g)), lane);
                __m256 wv = _mm256_loadu_ps(buf + 8 * g);
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    __m256 x = _mm256_maskload_ps(xp[t] + 32 * nfull + 8 * g, msk);
                    acc[r][t] = _mm256_blendv_ps(acc[r][t], _mm256_fmadd_ps(x, wv, acc[r][t]),
                                                 _mm256_castsi256_ps(msk));
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) Y[(t0 + t) * ldy + (j0 + r - r0)] = hsum8(acc[r][t]);
}

/* E2M1 tiles of 4 and 1 rows: one function per (format, R, NT), as in the
 * AVX-512 file, so each gets its own register allocation (inlined into one
 * driver beside the panels, the 4 x 2 tile ran 20% slower). The 3-row tiles
 * stay inlined: as functions of their own, the 3 x 4 tile ran 20% slower. */
#define MOE_TILE_FN(name, F, R_, NT_)                                                                            \
    static __attribute__((noinline)) void name(const moe_weight *w, const float *tab, int64_t j0, const float *X, \
                                               int64_t ldx, int64_t t0, float *Y, int64_t ldy, int64_t r0) {      \
        tile(F, R_, NT_, w, tab, j0, X, ldx, t0, Y, ldy, r0);                                                     \
    }
#define MOE_TILE_FNS(fn, F, R_)                                                                                  \
    MOE_TILE_FN(fn##_1, F, R_, 1) MOE_TILE_FN(fn##_2, F, R_, 2) MOE_TILE_FN(fn##_3, F, R_, 3)                     \
    MOE_TILE_FN(fn##_4, F, R_, 4)                                                                                 \
    static void fn(int64_t nt, const moe_weight *w, const float *tab, int64_t j0, const float *X, int64_t ldx,    \
                   int64_t t0, float *Y, int64_t ldy, int64_t r0) {                                               \
        switch (nt) {                                                                                             \
        case 4: fn##_4(w, tab, j0, X, ldx, t0, Y, ldy, r0); break;                                                \
        case 3: fn##_3(w, tab, j0, X, ldx, t0, Y, ldy, r0); break;                                                \
        case 2: fn##_2(w, tab, j0, X, ldx, t0, Y, ldy, r0); break;                                                \
        default: fn##_1(w, tab, j0, X, ldx, t0, Y, ldy, r0); break;                                               \
        }                                                                                                         \
    }
MOE_TILE_FNS(tile_mxfp4_r4, MOE_WFMT_MXFP4, 4)
MOE_TILE_FNS(tile_mxfp4_r1, MOE_WFMT_MXFP4, 1)
MOE_TILE_FNS(tile_nvfp4_r4, MOE_WFMT_NVFP4, 4)
MOE_TILE_FNS(tile_nvfp4_r1, MOE_WFMT_NVFP4, 1)

/* Tokens t0 .. t0+nt-1 over rows j0 .. j0+R-1 (R * nt <= 12). */
MOE_INL void tile_tokens(const moe_wfmt fmt, const int R, const moe_weight *w, const float *tab, int64_t j0,
                         const float *X, int64_t ldx, int64_t t0, int64_t nt, float *Y, int64_t ldy, int64_t r0) {
    if (fmt == MOE_WFMT_MXFP4 && R != 3) {
        (R == 4 ? tile_mxfp4_r4 : tile_mxfp4_r1)(nt, w, tab, j0, X, ldx, t0, Y, ldy, r0);
        return;
    }
    if (fmt == MOE_WFMT_NVFP4 && R != 3) {
        (R == 4 ? tile_nvfp4_r4 : tile_nvfp4_r1)(nt, w, tab, j0, X, ldx, t0, Y, ldy, r0);
        return;
    }
    switch (nt) {
    case 4: tile(fmt, R, 4, w, tab, j0, X, ldx, t0, Y, ldy, r0); break;
    case 3: tile(fmt, R, 3, w, tab, j0, X, ldx, t0, Y, ldy, r0); break;
    case 2: tile(fmt, R, 2, w, tab, j0, X, ldx, t0, Y, ldy, r0); break;
    default: tile(fmt, R, 1, w, tab, j0, X, ldx, t0, Y, ldy, r0); break;
    }
}

/*
 * Decode once, reuse for every token (n >= 6, E2M1 weights): the
 * register tiles above decode a weight vector for at most 4 tokens, so a
 * call with more tokens decoded each weight once per token block (5 tokens:
 * twice, 32: 8 times). Here R rows x MOE_PANEL columns are decoded once into
 * an L1 buffer (the same decode_group values) and every token block of the
 * token tile then runs its FMAs from it; each (token, row) accumulator is
 * parked in a stack array between panels. Per (token, row) the operations
 * are tile()'s, in tile()'s order (group after group, then the edge chunk's
 * blended FMAs, then hsum8): the bits do not depend on which path ran.
 */
enum { MOE_PANEL = 512 }; /* columns per decoded panel: 4 rows x 2 KiB = 8 KiB of L1 */

/* Rows rc[0 .. R-1], full chunks c0 .. c0+nc-1 decoded into wb [R][MOE_PANEL]. */
MOE_INL void panel_decode(const moe_wfmt fmt, const int R, const moe_cpu_row *rc, const float *tab, int64_t c0,
                          int64_t nc, float *wb) {
    for (int64_t c = c0; c < c0 + nc; c++) {
        /* prefetch the next panel's codes of each row (one 64-byte line holds
         * 4 chunks; the scales, 16-32 bytes a panel, follow the hardware's) */
        if ((c & 3) == 0)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(rc[r].q + 16 * (c + nc)), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float *lut[2];
            if (fmt == MOE_WFMT_MXFP4) {
                lut[0] = lut[1] = tab + 8 * rc[r].s8[c];
            } else {
                lut[0] = tab + 8 * rc[r].s8[2 * c];
                lut[1] = tab + 8 * rc[r].s8[2 * c + 1];
            }
            float *d = wb + (size_t)r * MOE_PANEL + 32 * (c - c0);
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) _mm256_store_ps(d + 8 * g, decode_group(fmt, &rc[r], c, g, lut[g >> 1], NULL));
        }
    }
}

/* The FMAs of nc decoded chunks for an R x NT block: acc [R][NT] 8-lane
 * accumulators in accb (rows of MOE_TOK_TILE x 8 floats), x pointers at the
 * panel's first column. */
MOE_INL void panel_fma(const int R, const int NT, const float *wb, int64_t nc, const float *const *xp, float *accb,
                       int64_t tb) {
    __m256 acc[MOE_RMAX][MOE_TMAX];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[r][t] = _mm256_load_ps(accb + 8 * ((size_t)r * MOE_TOK_TILE + tb + t));
    for (int64_t k = 0; k < 32 * nc; k += 8) {
        __m256 wv[MOE_RMAX];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) wv[r] = _mm256_load_ps(wb + (size_t)r * MOE_PANEL + k);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            __m256 x = _mm256_loadu_ps(xp[t] + k);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(x, wv[r], acc[r][t]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) _mm256_store_ps(accb + 8 * ((size_t)r * MOE_TOK_TILE + tb + t), acc[r][t]);
}

/* tile()'s edge chunk (m = cols % 32 > 0 columns, decoded by moe_weight_at_f32)
 * for an R x NT block, on the parked accumulators. */
MOE_INL void panel_edge(const int R, const int NT, const moe_weight *w, int64_t j0, const float *const *xp,
                        float *accb, int64_t tb) {
    int64_t cols = w->cols, nfull = cols / MOE_CHUNK, m = cols % MOE_CHUNK;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int ng = (int)((m + 7) / 8);
    for (int r = 0; r < R; r++) {
        float buf[MOE_CHUNK] = {0};
        for (int64_t k = 0; k < m; k++) buf[k] = moe_weight_at_f32(w, j0 + r, 32 * nfull + k);
        for (int g = 0; g < ng; g++) {
            __m256i msk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(m - 8 * g)), lane);
            __m256 wv = _mm256_loadu_ps(buf + 8 * g);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                float *a = accb + 8 * ((size_t)r * MOE_TOK_TILE + tb + t);
                __m256 acc = _mm256_load_ps(a);
                __m256 x = _mm256_maskload_ps(xp[t] + 32 * nfull + 8 * g, msk);
                _mm256_store_ps(a, _mm256_blendv_ps(acc, _mm256_fmadd_ps(x, wv, acc), _mm256_castsi256_ps(msk)));
            }
        }
    }
}

MOE_INL void panel_fma_nt(const int R, int64_t nt, const float *wb, int64_t nc, const float *const *xp, float *accb,
                          int64_t tb) {
    switch (nt) {
    case 4: panel_fma(R, 4, wb, nc, xp, accb, tb); break;
    case 3: panel_fma(R, 3, wb, nc, xp, accb, tb); break;
    case 2: panel_fma(R, 2, wb, nc, xp, accb, tb); break;
    default: panel_fma(R, 1, wb, nc, xp, accb, tb); break;
    }
}

/* Rows j0 .. j0+R-1 for tokens tt .. tt+nt-1 (nt <= MOE_TOK_TILE) in nb
 * balanced blocks (base + (b < extra) tokens each), decoding each panel once. */
MOE_INL void panel_rows(const moe_wfmt fmt, const int R, const moe_weight *w, const float *tab, int64_t j0,
                        const float *X, int64_t ldx, int64_t tt, int64_t nt, int64_t nb, int64_t base, int64_t extra,
                        float *Y, int64_t ldy, int64_t r0) {
    float wb[MOE_RMAX * MOE_PANEL] __attribute__((aligned(32)));
    float accb[MOE_RMAX * MOE_TOK_TILE * 8] __attribute__((aligned(32)));
    moe_cpu_row rc[MOE_RMAX];
    for (int r = 0; r < R; r++) rc[r] = moe_cpu_row_of(fmt, w, j0 + r);
    memset(accb, 0, sizeof accb);
    int64_t cols = w->cols, nfull = cols / MOE_CHUNK;
    for (int64_t c0 = 0; c0 < nfull; c0 += MOE_PANEL / MOE_CHUNK) {
        int64_t nc = nfull - c0 < MOE_PANEL / MOE_CHUNK ? nfull - c0 : MOE_PANEL / MOE_CHUNK;
        panel_decode(fmt, R, rc, tab, c0, nc, wb);
        for (int64_t b = 0, tb = 0; b < nb; tb += base + (b < extra), b++) {
            int64_t k = base + (b < extra);
            const float *xp[MOE_TMAX];
            for (int64_t t = 0; t < k; t++) xp[t] = X + (tt + tb + t) * ldx + 32 * c0;
            panel_fma_nt(R, k, wb, nc, xp, accb, tb);
        }
    }
    if (cols % MOE_CHUNK)
        for (int64_t b = 0, tb = 0; b < nb; tb += base + (b < extra), b++) {
            int64_t k = base + (b < extra);
            const float *xp[MOE_TMAX];
            for (int64_t t = 0; t < k; t++) xp[t] = X + (tt + tb + t) * ldx;
            switch (k) {
            case 4: panel_edge(R, 4, w, j0, xp, accb, tb); break;
            case 3: panel_edge(R, 3, w, j0, xp, accb, tb); break;
            case 2: panel_edge(R, 2, w, j0, xp, accb, tb); break;
            default: panel_edge(R, 1, w, j0, xp, accb, tb); break;
            }
        }
    for (int r = 0; r < R; r++)
        for (int64_t t = 0; t < nt; t++)
            Y[(tt + t) * ldy + (j0 + r - r0)] = hsum8(_mm256_load_ps(accb + 8 * ((size_t)r * MOE_TOK_TILE + t)));
}

/* One function per (E2M1 format, R): kept out of gemm_fmt so that the
 * register tiles inlined there keep their own register allocation (inlined,
 * the panels' code slowed the 1-3-token tiles by 5-20%). */
#define MOE_PANEL_FN(name, F, R_)                                                                                \
    static __attribute__((noinline)) void name(const moe_weight *w, const float *tab, int64_t j0, const float *X, \
                                               int64_t ldx, int64_t tt, int64_t nt, int64_t nb, int64_t base,     \
                                               int64_t extra, float *Y, int64_t ldy, int64_t r0) {                \
        panel_rows(F, R_, w, tab, j0, X, ldx, tt, nt, nb, base, extra, Y, ldy, r0);                               \
    }
MOE_PANEL_FN(panel_mxfp4_4, MOE_WFMT_MXFP4, 4)
MOE_PANEL_FN(panel_mxfp4_3, MOE_WFMT_MXFP4, 3)
MOE_PANEL_FN(panel_mxfp4_1, MOE_WFMT_MXFP4, 1)
MOE_PANEL_FN(panel_nvfp4_4, MOE_WFMT_NVFP4, 4)
MOE_PANEL_FN(panel_nvfp4_3, MOE_WFMT_NVFP4, 3)
MOE_PANEL_FN(panel_nvfp4_1, MOE_WFMT_NVFP4, 1)

/* panel_rows for a compile-time E2M1 fmt and R in {4, 3, 1}. */
MOE_INL void panel_rows_fn(const moe_wfmt fmt, const int R, const moe_weight *w, const float *tab, int64_t j0,
                           const float *X, int64_t ldx, int64_t tt, int64_t nt, int64_t nb, int64_t base,
                           int64_t extra, float *Y, int64_t ldy, int64_t r0) {
    if (fmt == MOE_WFMT_MXFP4) {
        if (R == 4) panel_mxfp4_4(w, tab, j0, X, ldx, tt, nt, nb, base, extra, Y, ldy, r0);
        else if (R == 3) panel_mxfp4_3(w, tab, j0, X, ldx, tt, nt, nb, base, extra, Y, ldy, r0);
        else panel_mxfp4_1(w, tab, j0, X, ldx, tt, nt, nb, base, extra, Y, ldy, r0);
    } else {
        if (R == 4) panel_nvfp4_4(w, tab, j0, X, ldx, tt, nt, nb, base, extra, Y, ldy, r0);
        else if (R == 3) panel_nvfp4_3(w, tab, j0, X, ldx, tt, nt, nb, base, extra, Y, ldy, r0);
        else panel_nvfp4_1(w, tab, j0, X, ldx, tt, nt, nb, base, extra, Y, ldy, r0);
    }
}

/*
 * The driver: token tiles of MOE_TOK_TILE (their activations stay in L2
 * while every row block passes over them), split into balanced token blocks
 * of at most 4; then row blocks of 4 when the blocks hold 1 or 2 tokens, of
 * 3 when they hold 3 or 4 (at most 12 accumulators), leftover rows one at a
 * time. E2M1 weights with 6 or more tokens in the tile take the decode-once
 * panels (panel_rows): same operations, each weight decoded once per token
 * tile instead of once per token block.
 */
MOE_INL void gemm_fmt(const moe_wfmt fmt, const moe_weight *w, int64_t r0, int64_t r1, const float *X,
                      int64_t ldx, int64_t n, float *Y, int64_t ldy) {
    float tab[256 * 8] __attribute__((aligned(32)));
    const bool e2m1 = fmt == MOE_WFMT_MXFP4 || fmt == MOE_WFMT_NVFP4;
    if (e2m1) build_e2m1_table(fmt, w->scale2, tab);
    for (int64_t tt = 0; tt < n; tt += MOE_TOK_TILE) {
        int64_t te = tt + MOE_TOK_TILE < n ? tt + MOE_TOK_TILE : n;
        int64_t j = r0;
        /* balanced token blocks: 5 tokens run as 3 + 2, not 4 + 1 (each
         * block re-decodes the weights) */
        int64_t nt = te - tt, nb = (nt + MOE_TMAX - 1) / MOE_TMAX, base = nt / nb, extra = nt % nb;
        int64_t bmax = base + (extra > 0);
        /* the panels from 6 tokens: at 5 (blocks 3 + 2) their stores and
         * reloads cost more than the second decode saves (measured: 1.05 vs
         * 0.97 ns per 32 weights per token; equal at 6, 23-36% faster at 8-32) */
        if (e2m1 && nt >= 6) {
            if (bmax <= 2) {
                for (; j + 4 <= r1; j += 4) panel_rows_fn(fmt, 4, w, tab, j, X, ldx, tt, nt, nb, base, extra, Y, ldy, r0);
            } else {
                for (; j + 3 <= r1; j += 3) panel_rows_fn(fmt, 3, w, tab, j, X, ldx, tt, nt, nb, base, extra, Y, ldy, r0);
            }
            for (; j < r1; j++) panel_rows_fn(fmt, 1, w, tab, j, X, ldx, tt, nt, nb, base, extra, Y, ldy, r0);
            continue;
        }
        if (bmax <= 2) {
            for (; j + 4 <= r1; j += 4)
                for (int64_t b = 0, t = tt; b < nb; t += base + (b < extra), b++)
                    tile_tokens(fmt, 4, w, tab, j, X, ldx, t, base + (b < extra), Y, ldy, r0);
        } else {
            for (; j + 3 <= r1; j += 3)
                for (int64_t b = 0, t = tt; b < nb; t += base + (b < extra), b++)
                    tile_tokens(fmt, 3, w, tab, j, X, ldx, t, base + (b < extra), Y, ldy, r0);
        }
        for (; j < r1; j++)
            for (int64_t b = 0, t = tt; b < nb; t += base + (b < extra), b++)
                tile_tokens(fmt, 1, w, tab, j, X, ldx, t, base + (b < extra), Y, ldy, r0);
    }
}

MOE_CPU_FMT_KERNELS(avx2_kernels, , gemm_fmt)

static void gemm_avx2(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n,
                       float *Y, int64_t ldy) {
    moe_cpu_gemm_by_format(&avx2_kernels, w, r0, r1, X, ldx, n, Y, ldy);
}

static const moe_cpu_kernels moe_avx2_table = {
    .isa = "avx2",
    .gemm = gemm_avx2,
    .gemm_bf16act = NULL,
    .swiglu = moe_cpu_avx2_swiglu,
};

const moe_cpu_kernels *moe_cpu_avx2_table(void) { return &moe_avx2_table; }
