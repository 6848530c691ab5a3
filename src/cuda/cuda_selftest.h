/*
 * Device self-tests of the GPU kernels' building blocks, for tests/cuda only
 * (not installed; C linkage). Each runs on the current device, compares with
 * a host computation and writes what it found to msg [n] (one line per
 * check, the first mismatches with their positions, so that a failing run
 * says which layout or decoder is wrong). Returns the number of failed
 * checks, or -1 when the device could not run them (msg says why).
 */
#ifndef MOE_CUDA_SELFTEST_H
#define MOE_CUDA_SELFTEST_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The wgmma path (src/cuda/cuda_wgmma.cu): the FP4 decoders against every
 * code x every E8M0 and UE4M3 scale, bit for bit; then the down-projection
 * GEMM on exact data (BF16 weights with ones / random operands to separate
 * row, column and k-swizzle errors; FP8, MXFP4 and NVFP4 weights), 180 rows
 * (a partial token tile with a consumer warpgroup that has no row), 3 k
 * steps, 384 weight rows (a full and a half weight tile), each through the
 * three kernels: the producer's cp.async loads and decode, TMA loads with
 * the producer's decode, TMA loads with the consumers' decode (FP8 / FP4
 * only, also in a single block: the decode of the next step across items
 * and the ring wrapping). */
int moe_cuda_wg_selftest(char *msg, size_t n);

/* The FP8 x FP8 path (src/cuda/cuda_qgmma.cu): the down-projection GEMM
 * on the FP8 tensor cores against float64, on exact data (bit for bit) and
 * on random E4M3 codes (the error per output relative to sum |a w|, which
 * the message reports), each on the full grid and in one block. */
int moe_cuda_qg_selftest(char *msg, size_t n);

/* The non-GEMM kernels of the large-T path (src/cuda/cuda_kernels.cu): the
 * multi-block sort against the single-block one and the host (uniform,
 * skewed with empty experts, all on one expert, E above the block's
 * threads, T not a multiple of anything), and the 16-byte combine against
 * the scalar one bit for bit (fused and shared columns, two load batches). */
int moe_cuda_ng_selftest(char *msg, size_t n);

/* The SwiGLU every GPU gate/up epilogue calls (cuda_device.cuh) against
 * float64 on adversarial and random operands, limits 0, 7 and 10, within a
 * stated bound (cuda_kernels.cu, swiglu_case). */
int moe_cuda_swiglu_selftest(char *msg, size_t n);

/* An MXFP4 layer of V4-Flash size uploaded into a device filled to leave
 * room for its FP4 weights but not their E4M3 twins (cuda_layer.cu): the
 * upload succeeds, its note says the twins did not fit, FP8 activations run
 * on the bf16-operand kernels. 0 with a "skipped" line where the device has
 * not the FP4 bytes plus 2 GiB free. */
int moe_cuda_mxq_room_selftest(char *msg, size_t n);

#ifdef __cplusplus
}
#endif
#endif
