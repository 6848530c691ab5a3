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
 * GEMM on exact small-integer data (BF16 weights with ones / random
 * operands to separate row, column and k-swizzle errors; MXFP4 and NVFP4
 * weights), 200 rows (a partial token tile), 3 k steps, 384 weight rows (a
 * full and a half weight tile), each through both load paths: the
 * producer's cp.async and the bulk tensor copies (TMA) of the weight and
 * activation tiles. */
int moe_cuda_wg_selftest(char *msg, size_t n);

#ifdef __cplusplus
}
#endif
#endif
