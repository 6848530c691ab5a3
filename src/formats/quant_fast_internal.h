/*
 * The two builds of the fast quantizers: AVX-512 (src/formats/avx512/quant_avx512.c,
 * called by src/formats/quant_fast.c only after a runtime CPU check) and
 * portable (src/formats/quant_fast.c). Same
 * contracts as the public functions of include/moe_quant_fast.h, arguments
 * already checked by the caller.
 */
#ifndef MOE_QUANT_FAST_INTERNAL_H
#define MOE_QUANT_FAST_INTERNAL_H

#include "moe_formats.h"

/* The entry points of one build (SUFFIX avx512 or portable), defined by
 * MOE_QF_DEFINE_ENTRY_POINTS (quant_fast_impl.h) in that build's file. */
#define MOE_QF_DECLARE_ENTRY_POINTS(SUFFIX)                                                                    \
    void moe_qf_mxfp4_row_##SUFFIX(const float *x, int64_t n, moe_mx_scale_rule rule, moe_e2m1_round r,        \
                                   uint8_t *packed, uint8_t *scales);                                           \
    void moe_qf_nvfp4_row_##SUFFIX(const float *x, int64_t n, float scale2, moe_e2m1_round r, uint8_t *packed, \
                                   uint8_t *scales);                                                            \
    void moe_qf_fp8_tiles_##SUFFIX(const float *w, int64_t rows, int64_t cols, moe_fp8_scale kind, uint8_t *q,  \
                                   float *scale_f32, uint8_t *scale_e8m0);                                      \
    void moe_qf_bf16_row_##SUFFIX(const float *x, int64_t n, uint16_t *out);

MOE_QF_DECLARE_ENTRY_POINTS(avx512)
/* The portable build, always available (the tests run both builds). */
MOE_QF_DECLARE_ENTRY_POINTS(portable)

/* 1 when the public functions take the AVX-512 build. */
int moe_qf_uses_avx512(void);

#endif
