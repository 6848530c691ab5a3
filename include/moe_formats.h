/*
 * moe_formats.h: the number formats, defined once (docs/formats.md).
 *
 * Included by C (C99 and later) and by CUDA (.cu, compiled as C++). The
 * decoders are `static inline` and marked MOE_HD, so host and device code use
 * the same definition. The encoders and the block codecs are scalar reference
 * implementations in src/formats/formats.c (host only, never fast-math).
 *
 * Invariants:
 *  1. Every decoder is exact: each code maps to one float (or NaN) with no
 *     rounding. E8M0 code 0 is 2^-127, a float subnormal: code that flushes
 *     subnormals to zero (CUDA -ftz=true, x87 DAZ) decodes it as 0.
 *  2. Every encoder rounds to nearest, ties to even, unless a rounding enum
 *     passed by the caller says otherwise; nothing depends on the FPU
 *     rounding mode or on global state.
 *  3. Two 4-bit codes per byte: element 2j in the LOW nibble, element 2j+1 in
 *     the HIGH nibble.
 *  4. Block codecs never allocate; every buffer is caller-owned and the shape
 *     of each is given beside the pointer.
 */
#ifndef MOE_FORMATS_H
#define MOE_FORMATS_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MOE_HD __host__ __device__
#else
#define MOE_HD
#endif

/* static assert usable from C99, C11 and C++ (CUDA). */
#if defined(__cplusplus) && __cplusplus >= 201103L
#define MOE_STATIC_ASSERT(c, msg) static_assert(c, msg)
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
#define MOE_STATIC_ASSERT(c, msg) _Static_assert(c, msg)
#else
#define MOE_SA_CAT2(a, b) a##b
#define MOE_SA_CAT(a, b) MOE_SA_CAT2(a, b)
#define MOE_STATIC_ASSERT(c, msg) \
    typedef char MOE_SA_CAT(moe_static_assert_, __LINE__)[(c) ? 1 : -1]
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------- constants */

#define MOE_MXFP4_BLOCK 32    /* elements per E8M0 scale (OCP MX) */
#define MOE_NVFP4_BLOCK 16    /* elements per UE4M3 scale (NVFP4) */
#define MOE_FP8_TILE 128      /* FP8 weight tiles are 128 x 128 */
#define MOE_FP8_ACT_BLOCK 128 /* FP8 activations: one scale per 128 values of a token */

#define MOE_FP8_E4M3_MAX 448.0f
#define MOE_FP8_E5M2_MAX 57344.0f
#define MOE_E2M1_MAX 6.0f

/* Interleaved storage descriptors of one block. Checkpoints keep scales and
 * codes in separate tensors; these describe one block when both travel
 * together (kernels, docs). qs: packed E2M1, element 2j low nibble. */
typedef struct moe_block_mxfp4 {
    uint8_t e;                            /* E8M0 scale 2^(e-127) */
    uint8_t qs[MOE_MXFP4_BLOCK / 2];      /* [32] E2M1 codes, 2 per byte */
} moe_block_mxfp4;

typedef struct moe_block_nvfp4 {
    uint8_t s;                            /* UE4M3 block scale */
    uint8_t qs[MOE_NVFP4_BLOCK / 2];      /* [16] E2M1 codes, 2 per byte */
} moe_block_nvfp4;

MOE_STATIC_ASSERT(sizeof(moe_block_mxfp4) == 1 + MOE_MXFP4_BLOCK / 2, "moe_block_mxfp4 is 17 bytes");
MOE_STATIC_ASSERT(sizeof(moe_block_nvfp4) == 1 + MOE_NVFP4_BLOCK / 2, "moe_block_nvfp4 is 9 bytes");
MOE_STATIC_ASSERT(sizeof(float) == 4, "float is IEEE binary32");

/* -------------------------------------------------------------- decoders */

/* The float whose bits are u (no conversion). */
MOE_HD static inline float moe_fmt_f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* FP8 E4M3 "fn" (s eeee mmm, bias 7, no Inf) to float, exact.
 * 0x7F and 0xFF are NaN (quiet, sign kept); 0x80 is -0. */
MOE_HD static inline float moe_fp8_e4m3_to_f32(uint8_t c) {
    uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t e = (c >> 3) & 0xFu, m = c & 0x7u;
    if ((c & 0x7Fu) == 0x7Fu) return moe_fmt_f32_from_bits(sign | 0x7FC00000u);
    if (e == 0) {
        /* subnormal: m * 2^-9, m < 8, exact */
        float v = (float)m * (1.0f / 512.0f);
        return sign ? -v : v;
    }
    return moe_fmt_f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

/* FP8 E5M2 (s eeeee mm, bias 15; the top byte of an IEEE half) to float,
 * exact. Exponent 31: mantissa 0 is +-Inf, otherwise NaN (quiet, sign kept). */
MOE_HD static inline float moe_fp8_e5m2_to_f32(uint8_t c) {
    uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t e = (c >> 2) & 0x1Fu, m = c & 0x3u;
    if (e == 31) return moe_fmt_f32_from_bits(sign | (m ? 0x7FC00000u : 0x7F800000u));
    if (e == 0) {
        /* subnormal: m * 2^-16 */
        float v = (float)m * (1.0f / 65536.0f);
        return sign ? -v : v;
    }
    return moe_fmt_f32_from_bits(sign | ((e + 112u) << 23) | (m << 21));
}

/* E2M1 (FP4, s ee m, bias 1) code in the low 4 bits of c (high bits
 * ignored) to float: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives; 0x8 is -0. */
MOE_HD static inline float moe_e2m1_to_f32(uint8_t c) {
    uint32_t e = (c >> 1) & 0x3u, m = c & 0x1u;
    /* e == 0: m * 0.5; else (2 + m) * 2^(e-2), all exact */
    float v = e == 0 ? 0.5f * (float)m : (float)((2u + m) << (e - 1u)) * 0.5f;
    return (c & 0x8u) ? -v : v;
}

/* E8M0 scale (exponent only, bias 127) to float: 2^(e-127), exact.
 * e = 0 is 2^-127 (float subnormal), e = 254 is 2^127, 0xFF is NaN. */
MOE_HD static inline float moe_e8m0_to_f32(uint8_t e) {
    if (e == 0xFFu) return moe_fmt_f32_from_bits(0x7FC00000u);
    if (e == 0) return moe_fmt_f32_from_bits(0x00400000u);
    return moe_fmt_f32_from_bits((uint32_t)e << 23);
}

/* UE4M3 (unsigned E4M3, the NVFP4 block scale) to float, exact.
 * 0x00..0x7E decode as E4M3; 0x7F is NaN. A code with the sign bit set is
 * not a UE4M3 value: it decodes to NaN so that a corrupt scale poisons its
 * block visibly (use moe_fp8_e4m3_to_f32 to read such bytes as signed E4M3). */
MOE_HD static inline float moe_ue4m3_to_f32(uint8_t c) {
    if (c & 0x80u) return moe_fmt_f32_from_bits(0x7FC00000u);
    return moe_fp8_e4m3_to_f32(c);
}

/* ------------------------------------ MXFP4 as E4M3 with a tile exponent */

/* An MXFP4 value m x 2^(e - 127) (m an E2M1 value, e its block's E8M0
 * code) is, for a reference exponent R, the E4M3 value m x 2^d times
 * 2^(R - 127) with d = e - R; m x 2^d is an E4M3 value exactly iff d lies
 * in [MOE_MX_E4M3_DMIN, MOE_MX_E4M3_DMAX] (or m = 0): the E2M1 magnitudes
 * 0.5 .. 6 have at most two significant bits (E4M3 keeps four); the
 * largest, 6 x 2^6 = 384, is below 448 (6 x 2^7 = 768 is not), and the
 * smallest, 0.5 x 2^-8 = 2^-9, is E4M3's smallest subnormal (1.5 x 2^-8 =
 * 3 x 2^-9 is a subnormal too; 0.5 x 2^-9 is not representable). So a
 * 128 x 128 tile whose blocks' codes span at most DMAX - DMIN = 14 is
 * FP8_BLOCK data with the power-of-two tile scale 2^(R - 127), exactly. */
#define MOE_MX_E4M3_DMIN (-8)
#define MOE_MX_E4M3_DMAX 6

/* The E4M3 code of e2m1(c) x 2^d (c in the low 4 bits; d in [DMIN, DMAX],
 * the caller's contract), built from the bits: exact, no rounding. The
 * sign is kept (E2M1 -0, code 0x8, gives E4M3 -0, 0x80). */
MOE_HD static inline uint8_t moe_e2m1_to_e4m3_pow2(uint8_t c, int d) {
    const uint32_t s = (uint32_t)(c & 0x8u) << 4, e2 = (c >> 1) & 0x3u, m1 = c & 0x1u;
    if (e2 == 0 && m1 == 0) return (uint8_t)s;
    /* value (1 + mant / 2) x 2^E */
    const int E = e2 == 0 ? d - 1 : (int)e2 - 1 + d;
    const uint32_t mant = e2 == 0 ? 0u : m1;
    if (E >= -6) return (uint8_t)(s | ((uint32_t)(E + 7) << 3) | (mant << 2));
    /* subnormal: (2 + mant) x 2^(E - 1) = k x 2^-9, k = (2 + mant) x 2^(E + 8)
     * (E >= -9; E = -9 only with mant = 0, so the halving below is exact) */
    return (uint8_t)(s | (((2u + mant) << (E + 9)) >> 1));
}

/* The reference exponent R of a tile whose nonzero blocks' E8M0 codes lie
 * in [lo, hi] (lo > hi: no nonzero block), or -1 when none exists: R =
 * max(hi - DMAX, 1), the largest tile scale 2^(R - 127), kept an fp32
 * normal (R >= 1), valid iff lo - R >= DMIN. A block whose 32 codes are
 * all +-0 is the same zeros whatever R, so only nonzero blocks count; a
 * NaN scale (0xFF) must be refused by the caller before (the block decodes
 * to NaN, which no E4M3 code times a finite scale gives). */
MOE_HD static inline int moe_mx_tile_exponent(int lo, int hi) {
    if (lo > hi) return 127;
    const int R = hi - MOE_MX_E4M3_DMAX > 1 ? hi - MOE_MX_E4M3_DMAX : 1;
    return lo - R >= MOE_MX_E4M3_DMIN ? R : -1;
}

/* ------------------------------------------- encoders and block codecs */
#ifndef __CUDACC__

/* What an FP8 encoder does with a value whose rounding exceeds the format's
 * largest finite value (E4M3 448, E5M2 57344) and with +-Inf. NaN always
 * encodes as NaN keeping the sign. */
typedef enum moe_fp8_overflow {
    MOE_FP8_SATURATE = 0,  /* clamp to +-max, Inf -> +-max (CUDA __NV_SATFINITE).
                              Default for E4M3. */
    MOE_FP8_OVERFLOW_NAN,  /* E4M3 only: overflow and Inf -> NaN (PyTorch
                              .to(torch.float8_e4m3fn)) */
    MOE_FP8_OVERFLOW_INF   /* E5M2 only: overflow -> +-Inf, Inf -> Inf (IEEE,
                              PyTorch float8_e5m2). Default for E5M2. */
} moe_fp8_overflow;

/* Rounding of E2M1 encoders. All saturate to +-6. */
typedef enum moe_e2m1_round {
    MOE_E2M1_RNE = 0,      /* nearest, ties to even code (CUDA cvt.rn, ModelOpt,
                              DeepSeek V4, torch reference casts) */
    MOE_E2M1_TIES_UP,      /* nearest, ties away from zero (software fallbacks
                              that compare against midpoints with >=) */
    MOE_E2M1_TOWARD_ZERO   /* truncation: the largest magnitude <= |x| */
} moe_e2m1_round;

/* Rule choosing an MXFP4 block's E8M0 scale from the block's amax. */
typedef enum moe_mx_scale_rule {
    MOE_MX_SCALE_CEIL = 0, /* e = ceil(log2(amax / 6)): DeepSeek V4, ModelOpt,
                              TRT-LLM; never clips. Default. */
    MOE_MX_SCALE_FLOOR     /* e = floor(log2(amax)) - 2: OCP MX reference, ggml;
                              values in (6, 8) * 2^e clip to 6 * 2^e */
} moe_mx_scale_rule;

/* Kind of FP8 block scale. */
typedef enum moe_fp8_scale {
    MOE_FP8_SCALE_F32 = 0, /* scale = amax / 448 in fp32 (V3 weight_scale_inv) */
    MOE_FP8_SCALE_POW2     /* scale = 2^ceil(log2(amax / 448)) (V3.1+, V4 ue8m0) */
} moe_fp8_scale;

/* ---- element encoders. Pure functions of their arguments; thread-safe. */

/* bf16 bits of x rounded to nearest even. NaN -> quiet NaN keeping the sign
 * (0x7FC0 / 0xFFC0); overflow rounds to +-Inf as IEEE does. */
uint16_t moe_bf16_from_f32(float x);

/* x rounded to the nearest bf16 (as moe_bf16_from_f32), back as a float:
 * exact widening of the bf16 bits. Host only, as moe_bf16_from_f32. */
static inline float moe_bf16_round(float x) {
    return moe_fmt_f32_from_bits((uint32_t)moe_bf16_from_f32(x) << 16);
}

/* E4M3 code of x, nearest even. `mode`: MOE_FP8_SATURATE or
 * MOE_FP8_OVERFLOW_NAN (MOE_ASSERT on MOE_FP8_OVERFLOW_INF: no Inf in E4M3).
 * Note: 464 is the midpoint of 448 (even) and 480 (odd, not representable),
 * so it rounds to 448 in both modes; only |x| > 464 overflows. Subnormals go
 * down to 2^-9; |x| <= 2^-10 rounds to +-0 (keeping the sign). */
uint8_t moe_fp8_e4m3_from_f32(float x, moe_fp8_overflow mode);

/* E5M2 code of x, nearest even. `mode`: MOE_FP8_OVERFLOW_INF (IEEE default:
 * |x| >= 61440, the midpoint of 57344 and 2^16, becomes Inf) or
 * MOE_FP8_SATURATE (clamp to +-57344, Inf too). MOE_ASSERT on
 * MOE_FP8_OVERFLOW_NAN. NaN -> NaN keeping the sign (0x7E / 0xFE). */
uint8_t moe_fp8_e5m2_from_f32(float x, moe_fp8_overflow mode);

/* UE4M3 code of a scale x >= 0: E4M3 nearest even, saturating at 448.
 * x <= 0 (including -0) -> 0x00; NaN -> 0x7F; +Inf -> 448 (0x7E). */
uint8_t moe_ue4m3_from_f32(float x);

/* E2M1 code (low 4 bits) of x under rounding `r`, saturating to +-6.
 * +-Inf -> +-6. NaN -> 0x0 (+0): E2M1 has no NaN; the block formats carry a
 * NaN through their scale (E8M0 0xFF, UE4M3 0x7F). -0 -> 0x8. Values that
 * round to zero keep their sign (0x8 for negatives). */
uint8_t moe_e2m1_from_f32(float x, moe_e2m1_round r);

/* Smallest E8M0 code e with 2^(e-127) >= x (exact; no log2), clamped to
 * [0, 254]. x <= 0 -> 0. NaN or +Inf -> 0xFF (NaN). */
uint8_t moe_e8m0_ceil_f32(float x);

/* Largest E8M0 code e with 2^(e-127) <= x (exact), clamped to [0, 254].
 * x <= 0 -> 0. NaN or +Inf -> 0xFF. */
uint8_t moe_e8m0_floor_f32(float x);

/* E8M0 scale of an MXFP4 block whose largest magnitude is `amax` (>= 0):
 *   MOE_MX_SCALE_CEIL:  smallest e with 6 * 2^(e-127) >= amax
 *   MOE_MX_SCALE_FLOOR: floor(log2(amax)) - 2 + 127
 * computed exactly (frexp and exact comparisons, no log2), clamped to
 * [0, 254]. amax = 0 -> 0 (the smallest scale, 2^-127: the block is all
 * zeros, any scale decodes it exactly). NaN or Inf amax -> 0xFF, so the
 * block decodes to NaN. */
uint8_t moe_mxfp4_scale_e8m0(float amax, moe_mx_scale_rule rule);

/* ---- block codecs. Never allocate; thread-safe on distinct outputs. */

/* Quantize n floats (n % 32 == 0, MOE_ASSERT) to MXFP4.
 *   x      [n]      input
 *   packed [n/2]    E2M1 codes, element 2j in the low nibble
 *   scales [n/32]   E8M0, chosen by `rule` from the block's amax
 * Each element is x * 2^-(e-127) (exact in double) encoded with `r`. A NaN
 * or Inf in a block makes its scale 0xFF (the block decodes to NaN). */
void moe_mxfp4_quant_row(const float *x, int64_t n, moe_mx_scale_rule rule,
                         moe_e2m1_round r, uint8_t *packed, uint8_t *scales);

/* Row of an MXFP4 weight: out[j] = e2m1(packed, j) * 2^(scales[j/32]-127).
 *   packed [cols/2], scales [cols/32], out [cols]; cols % 32 == 0.
 * Exact in float unless the product leaves the float range (scale code 253
 * with |e2m1| >= 4, or 254 with |e2m1| >= 2, gives Inf); the f64 twin is
 * always exact. Scale 0xFF decodes the block to NaN. */
void moe_mxfp4_dequant_row(const uint8_t *packed, const uint8_t *scales,
                           int64_t cols, float *out);
void moe_mxfp4_dequant_row_f64(const uint8_t *packed, const uint8_t *scales,
                               int64_t cols, double *out);

/* NVFP4 per-tensor scale of a whole tensor x [n]: amax / (6 * 448) in fp32
 * (ModelOpt weight_scale_2). An all-zero (or empty) tensor returns 1.0.
 * NaN anywhere -> NaN. */
float moe_nvfp4_scale2(const float *x, int64_t n);

/* Quantize n floats (n % 16 == 0) to NVFP4 with per-tensor scale `scale2`
 * (from moe_nvfp4_scale2 over the whole tensor; > 0, MOE_ASSERT).
 *   packed [n/2]   E2M1 codes
 *   scales [n/16]  UE4M3: ue4m3(max(bamax / (6 * scale2), 2^-9)), fp32
 *                  arithmetic as ModelOpt; an all-zero block gets 1.0 (0x38);
 *                  a block holding NaN gets 0x7F (NaN)
 * Element: x / (float(scale) * scale2), both fp32 operations, encoded with r. */
void moe_nvfp4_quant_row(const float *x, int64_t n, float scale2, moe_e2m1_round r,
                         uint8_t *packed, uint8_t *scales);

/* Row of an NVFP4 weight: out[j] = e2m1(packed, j) * ue4m3(scales[j/16]) * scale2.
 *   packed [cols/2], scales [cols/16], out [cols]; cols % 16 == 0.
 * Float: e2m1 * ue4m3 is exact, the multiply by scale2 rounds once (the
 * correctly rounded value). f64 twin: exact. */
void moe_nvfp4_dequant_row(const uint8_t *packed, const uint8_t *scales, float scale2,
                           int64_t cols, float *out);
void moe_nvfp4_dequant_row_f64(const uint8_t *packed, const uint8_t *scales,
                               float scale2, int64_t cols, double *out);

/* Quantize a [rows, cols] tensor to FP8 E4M3 in 128x128 tiles (edge tiles
 * are partial: any rows, cols >= 0).
 *   w      [rows, cols]                       input
 *   q      [rows, cols]                       E4M3 codes (saturating)
 *   scale  [ceil(rows/128), ceil(cols/128)]   fp32 multiply-to-dequantize
 * kind MOE_FP8_SCALE_F32: scale = amax / 448 (fp32 division);
 * kind MOE_FP8_SCALE_POW2: scale = 2^ceil(log2(amax / 448)) exactly.
 * An all-zero tile gets scale 1.0. Element: e4m3_sat(w / scale) (fp32). */
void moe_fp8_block_quant(const float *w, int64_t rows, int64_t cols, moe_fp8_scale kind,
                         uint8_t *q, float *scale);

/* The V4 variant: scales stored as E8M0 codes, scale = 2^ceil(log2(amax/448))
 * (all-zero tile: 127, i.e. 1.0). Same shapes as moe_fp8_block_quant. */
void moe_fp8_block_quant_e8m0(const float *w, int64_t rows, int64_t cols,
                              uint8_t *q, uint8_t *scale_e8m0);

/* Row of an FP8 block weight: out[j] = e4m3(w_row[j]) * scale_row[j/128].
 *   w_row [cols], scale_row [ceil(cols/128)] (this row's tile row), out [cols]
 * Float: one rounding of the product; f64 twin: exact. */
void moe_fp8_block_dequant_row(const uint8_t *w_row, const float *scale_row,
                               int64_t cols, float *out);
void moe_fp8_block_dequant_row_f64(const uint8_t *w_row, const float *scale_row,
                                   int64_t cols, double *out);

/* E8M0-scaled twin: out[j] = e4m3(w_row[j]) * 2^(scale_row[j/128] - 127).
 * Exact in float unless the product overflows (448 * 2^120, scale code 247
 * and up, is Inf); f64 twin always exact. */
void moe_fp8_block_dequant_row_e8m0(const uint8_t *w_row, const uint8_t *scale_row,
                                    int64_t cols, float *out);
void moe_fp8_block_dequant_row_e8m0_f64(const uint8_t *w_row, const uint8_t *scale_row,
                                        int64_t cols, double *out);

/* Quantize one token's activations x [n] (any n >= 0; the last block may be
 * partial) to E4M3 with one scale per 128 values:
 *   amax = max(block amax, 1e-4); scale = amax / 448 (MOE_FP8_SCALE_F32) or
 *   2^ceil(log2(amax / 448)) (MOE_FP8_SCALE_POW2); q = e4m3_sat(x / scale).
 *   q [n], scales [ceil(n/128)] fp32.
 * Dequantize with moe_fp8_block_dequant_row (same layout). A NaN in a block
 * makes its scale NaN. */
void moe_fp8_act_quant_row(const float *x, int64_t n, moe_fp8_scale kind,
                           uint8_t *q, float *scales);

/* NVFP4 activations (W4A4) with a static global scale, as TensorRT-LLM,
 * vLLM and FlashInfer quantize a GEMM's input (vLLM ref_nvfp4_quant /
 * cvt_warp_fp16_to_fp4; the CUDA kernels use rcp.approx.ftz for the two
 * reciprocals where this reference divides exactly). gs = 1 / input_scale
 * (fp32), input_scale the checkpoint's amax / (6 * 448). Per block of 16
 * consecutive values (the last block may be partial), fp32 arithmetic:
 *   vmax  = max |x|
 *   sf    = ue4m3(min(gs * (vmax * fp32(1/6)), 448))      (nearest even)
 *   os    = sf == 0 ? 0 : 1 / (float(sf) * fp32(1 / gs))
 *   code  = e2m1(clamp(x * os, -6, 6))                    (nearest even)
 * The GEMM sees code * float(sf) * input_scale.
 *   x [n], codes [n] (one E2M1 code per byte, low 4 bits), sf [ceil(n/16)]
 * A NaN or Inf in a block makes its sf 0x7F (NaN: the block poisons visibly;
 * engines map Inf to 6 * sf). */
void moe_nvfp4_act_quant_row(const float *x, int64_t n, float input_scale, uint8_t *codes, uint8_t *sf);

#endif /* !__CUDACC__ */

#ifdef __cplusplus
}
#endif
#endif /* MOE_FORMATS_H */
