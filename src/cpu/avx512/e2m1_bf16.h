/*
 * Internal to src/cpu: the E2M1/BF16 -> bf16 decode and the bf16 activation
 * packing shared by the AVX-512 vdpbf16ps kernels (gemm_avx512.c) and the
 * AMX tile kernels (amx/gemm_amx.c, which run on CPUs that have AVX-512).
 * Every function is static inline with the AVX-512 + BF16 target attribute;
 * including files need that ISA (dispatch.c checks it before a table is used).
 *
 * Invariants:
 *  1. bf_decode_chunk returns the 32 bf16 words of one 32-column chunk of a
 *     row: BF16 in column order, MXFP4 / NVFP4 in e2m1_perm order, each word
 *     the exact bf16 of the decoded weight (NVFP4 without scale2).
 *  2. bf_pack writes activations in the same word order (perm) or in column
 *     order, rounded to bf16 by vcvtne2ps2bf16 (the identity on bf16 values),
 *     zero-padded past cols.
 *  3. moe_cpu_e2m1_bf16_tab returns static tables built once, read-only.
 */
#ifndef MOE_CPU_E2M1_BF16_H
#define MOE_CPU_E2M1_BF16_H

#include "cpu/cpu_internal.h"

#include <immintrin.h>

#define MOE_TGT_BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,fma,f16c")))
#define MOE_INL_BF static inline __attribute__((always_inline)) MOE_TGT_BF

/* The decoded bf16 E2M1 values of every scale code, 16 KiB per format
 * (gemm_avx512.c; built on first use, thread-safe, read-only after):
 * nvfp4 = false: tab[32 * code + i] = bf16(e2m1(i & 15) * e8m0(code));
 * nvfp4 = true: the same with ue4m3(code) (NVFP4's scale2 is applied to the
 * outputs). Entries 16..31 repeat 0..15 (vpermw reads index bit 4). */
const uint16_t *moe_cpu_e2m1_bf16_tab(bool nvfp4);

/*
 * E2M1 word order. The 16 packed bytes of a chunk are broadcast to the four
 * 128-bit lanes; word w' (0..7) of lane L then holds bytes 2w', 2w' + 1, i.e.
 * nibbles 4w' .. 4w' + 3 (nibble 2k: low half of byte k), and vpsrlvw by 4L
 * brings nibble 4w' + L to bits 0-3. So word p = 8L + w' of the decoded chunk
 * is column e2m1_perm(p) = 4 (p mod 8) + p / 8; the activations are packed
 * in the same order (one vpermw per 32 at pack time), so that the pairs of
 * vdpbf16ps match.
 */
static inline int e2m1_perm(int p) { return 4 * (p % 8) + p / 8; }

/* The word indices of the 16 packed bytes at p (see above). */
MOE_INL_BF __m512i e2m1_bf16_idx(const uint8_t *p, __m512i sh) {
    return _mm512_srlv_epi16(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p)), sh);
}

/* vpsrlvw counts: 4L for the words of 128-bit lane L */
MOE_INL_BF __m512i e2m1_bf16_shifts(void) {
    return _mm512_set_epi64(0x000C000C000C000C, 0x000C000C000C000C, 0x0008000800080008, 0x0008000800080008,
                            0x0004000400040004, 0x0004000400040004, 0, 0);
}

/* NVFP4: the words whose column is in the second 16-column scale block */
#define MOE_E2M1_HI_WORDS ((__mmask32)0xF0F0F0F0u)

/* Rows of a bf16 tile: row r's codes at q + r * qs, its scales at s + r * ss. */
typedef struct bf_rows {
    const uint8_t *q, *s;
    int64_t qs, ss;
} bf_rows;

/* Chunk c (32 columns) of row r as 32 bf16 words (FP4: in e2m1_perm order). */
MOE_INL_BF __m512i bf_decode_chunk(const moe_wfmt fmt, const bf_rows *rw, int r, const uint16_t *tab, int64_t c,
                                   __m512i sh) {
    /* BF16 has no scales: s stays NULL (NULL + 0 is undefined) */
    const uint8_t *q = rw->q + r * rw->qs, *s = rw->s ? rw->s + r * rw->ss : NULL;
    switch (fmt) {
    case MOE_WFMT_MXFP4:
        return _mm512_permutexvar_epi16(e2m1_bf16_idx(q + 16 * c, sh), _mm512_load_si512(tab + 32 * (size_t)s[c]));
    case MOE_WFMT_NVFP4: {
        __m512i idx = e2m1_bf16_idx(q + 16 * c, sh);
        __m512i lo = _mm512_permutexvar_epi16(idx, _mm512_load_si512(tab + 32 * (size_t)s[2 * c]));
        return _mm512_mask_permutexvar_epi16(lo, MOE_E2M1_HI_WORDS, idx,
                                             _mm512_load_si512(tab + 32 * (size_t)s[2 * c + 1]));
    }
    default: /* BF16 */
        return _mm512_loadu_si512(q + 64 * c);
    }
}

/* The last, partial chunk c of row r (m < 32 columns; NVFP4: m = 16), zeros past m. */
MOE_INL_BF __m512i bf_decode_edge(const moe_wfmt fmt, const bf_rows *rw, int r, const uint16_t *tab, int64_t c,
                                  int64_t m, __m512i sh) {
    /* BF16 has no scales: s stays NULL (NULL + 0 is undefined) */
    const uint8_t *q = rw->q + r * rw->qs, *s = rw->s ? rw->s + r * rw->ss : NULL;
    if (fmt == MOE_WFMT_NVFP4) {
        MOE_ASSERT(m == 16);
        /* 8 bytes: never read past the row */
        __m512i v = _mm512_broadcast_i32x4(_mm_loadl_epi64((const __m128i *)(q + 16 * c)));
        return _mm512_maskz_permutexvar_epi16((__mmask32)~MOE_E2M1_HI_WORDS, _mm512_srlv_epi16(v, sh),
                                              _mm512_load_si512(tab + 32 * (size_t)s[2 * c]));
    }
    MOE_ASSERT(fmt == MOE_WFMT_BF16);
    return _mm512_maskz_loadu_epi16((__mmask32)((1u << m) - 1u), q + 64 * c);
}

/* Pack tokens t0 .. t0+nt-1 of X to bf16: xb [nt, ldxb], zeros from cols to
 * ldxb; FP4 (perm): each 32 in e2m1_perm order. */
MOE_INL_BF void bf_pack(const float *X, int64_t ldx, int64_t t0, int64_t nt, int64_t cols, uint16_t *xb,
                        int64_t ldxb, bool perm) {
    uint16_t pi[32] __attribute__((aligned(64)));
    for (int p = 0; p < 32; p++) pi[p] = (uint16_t)(perm ? e2m1_perm(p) : p);
    const __m512i pidx = _mm512_load_si512(pi);
    for (int64_t t = 0; t < nt; t++) {
        const float *x = X + (t0 + t) * ldx;
        uint16_t *o = xb + t * ldxb;
        for (int64_t k = 0; k < ldxb; k += 32) {
            int64_t m = cols - k;
            __mmask16 ml = (__mmask16)(m >= 16 ? 0xFFFF : m <= 0 ? 0 : (1u << m) - 1);
            __mmask16 mh = (__mmask16)(m >= 32 ? 0xFFFF : m <= 16 ? 0 : (1u << (m - 16)) - 1);
            __m512 lo = _mm512_maskz_loadu_ps(ml, x + k), hi = _mm512_maskz_loadu_ps(mh, x + k + 16);
            _mm512_store_si512(o + k, _mm512_permutexvar_epi16(pidx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
        }
    }
}

#endif
