/*
 * Host-side packing of moe_weight tensors into the GPU layout (C, shared by
 * the CUDA host code). Device layout of one expert's projection [rows, cols]:
 *   rows_p = rows rounded up to 128, kp = cols rounded up to 64, zero padding;
 *   BF16       data u16 [rows_p, kp]
 *   FP8_BLOCK  data E4M3 [rows_p, kp]; scale f32 [rows_p / 128, ceil(kp / 128)]
 *              (E8M0 scales decoded to float: exact), padding tiles 1.0
 *   MXFP4      data u8 [rows_p, kp / 2]; scale E8M0 [rows_p, kp / 32], pad 127 (1.0)
 *   NVFP4      data u8 [rows_p, kp / 2]; scale UE4M3 [rows_p, kp / 16], pad 0x38 (1.0);
 *              scale2 per expert (applied to the accumulator)
 * F32, F16 and F64 weights are rounded to BF16 (nearest-even): the GPU's
 * tensor-core operand.
 */
#ifndef MOE_CUDA_PACK_H
#define MOE_CUDA_PACK_H

#include "moeaudit.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_cuda_pack {
    moe_wfmt fmt;            /* device format: BF16, FP8_BLOCK, MXFP4, NVFP4 */
    int rows, cols;          /* logical */
    int rows_p, kp;          /* padded */
    size_t dbytes, sbytes;   /* per expert: data bytes, scale bytes */
} moe_cuda_pack;

/* Plan the layout of n weights that must share shape and format (family of
 * one projection over experts). MOE_ERR_UNSUPPORTED naming the tensor when
 * they do not. */
moe_status moe_cuda_pack_plan(const moe_weight *w, int n, moe_cuda_pack *p, moe_error *err);
/* Write one weight in the planned layout: data [dbytes], scale [sbytes]
 * (may be NULL when sbytes == 0); *scale2 receives the NVFP4 tensor scale
 * (1 otherwise). */
void moe_cuda_pack_one(const moe_cuda_pack *p, const moe_weight *w, uint8_t *data, uint8_t *scale, float *scale2);

#ifdef __cplusplus
}
#endif
#endif
