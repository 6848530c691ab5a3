/*
 * Grouped expert GEMMs on Hopper's asynchronous tensor cores (wgmma, sm_90a):
 * the large-T path (MOE_CUDA_PATH_WGMMA; MOE_CUDA_PATH_WGMMA_PD, the same
 * kernel with the earlier decode in the producer warpgroup;
 * MOE_CUDA_PATH_WGMMA_CP, that one with the earlier all-cp.async loads).
 * Same contract as the mma.sync
 * kernels of cuda_gemm.cu (moe_k_gateup_mma / moe_k_down_mma), same tiles
 * (moe_k_sort, 128 positions of one expert), same outputs.
 *
 * Block: three warpgroups, one block per SM, persistent. A work item is a
 * tile of 128 token rows (one expert's sorted positions) x 256 weight rows.
 *  - warpgroup 0, the producer: for each k step (64 columns) of an item it
 *    loads, LOOKAHEAD steps ahead into a ring of R load slots, the 128
 *    activation rows and the raw weight bytes of the 256 weight rows (codes
 *    and scale bytes; BF16 weights straight into the operand layout); then
 *    it decodes the step's FP8 / FP4 weights into bf16 in the operand
 *    layout (a ring of two decoded B tiles), fences the async proxy and
 *    arrives on the step's "full" barrier. Two load paths:
 *    TMA (the default): thread 0 issues the step's boxes with
 *    cp.async.bulk.tensor from tensor maps encoded on the host (two 128-row
 *    weight boxes, the 128-row activation box; rows past the activations
 *    land as zeros), completing on the slot's "raw" mbarrier (expect-tx);
 *    the activation rows are contiguous because they are in sorted order
 *    (gate/up: pre-gathered once per layer, moe_k_gather_rows; down: Hb
 *    is). The scale bytes stay on cp.async (2-4 bytes per row and step).
 *    cp.async (WGMMA_CP): every 16-byte piece by the 128 producer threads,
 *    activation rows through the sort's permutation, zero-filled past the
 *    expert's segment.
 *    Consumer decode (CD, path WGMMA, FP8 / FP4 weights; the default): the
 *    producer only issues the copies (thread 0 the TMA boxes, the 128
 *    threads the scale words' cp.async), waits for them and arrives on
 *    "full"; `setmaxnreg` gives its registers to the consumers (40 a thread
 *    against the consumers' 232; 168 at launch).
 *  - warpgroups 1 and 2, the consumers: token rows 0-63 and 64-127; per
 *    step four wgmma.m64n256k16 (bf16 x bf16, fp32 accumulators in
 *    registers: 128 per thread), then "empty". A consumer whose 64 rows hold
 *    no token of the tile skips its MMAs (partial tiles of small experts).
 *    CD: the 256 consumer threads decode the B tile of step it + 1 (one
 *    weight row each, the producer's decoder, wg_dec_step) while their
 *    wgmma of step it runs (one commit group in flight), then wait for it,
 *    release its load slot and meet at a named barrier (bar.sync 1, 256):
 *    step it + 1's B is complete and step it's MMAs, the last readers of
 *    the B buffer step it + 2 decodes into, are done in both warpgroups.
 *    Why this design rather than weights as wgmma's register operand A
 *    (D = W X^T): it keeps the operand layout, the decoders and their
 *    exactness proofs, the tiles and the epilogue of the producer-decode
 *    kernel (the two stay bit-identical, tested), and 8 warps decode where
 *    4 did; the register-A form would need the weights' row-major
 *    fragments decoded per k16 inside the MMA loop, a transposed epilogue
 *    (SwiGLU pairs across threads) and 64 weight rows per consumer.
 *    Issue, decode and wait of a step sit in one conditional block: with
 *    the issue and the wait in separate blocks ptxas serialized the wgmma
 *    (C7518, "WG.DP in divergent path").
 *  - why 128 x 256: every item reads its activation tile (bf16) and its
 *    weight tile once per k step from L2 / HBM; at 128 x 128 the kernel
 *    moved ~3-3.7 TB/s of L2 traffic and ran at 193-221 TFLOP/s (first
 *    measurement, docs/performance-cuda.md); 256 weight rows halve the
 *    activation traffic per MMA.
 *  - the 256-token tile (M2; TMA, FP8 / FP4 decoded by the consumers, two
 *    threads a weight row, wg_dec_half; moe_k_gateup_wg's t256):
 *    256 token rows x 128 weight rows, each consumer warpgroup 128 token
 *    rows as two m64 blocks of wgmma.m64n128k16 on one B (the same 128
 *    accumulators a thread), gate/up's 128 rows 64 gate + the same 64 up
 *    (boxes of 64 rows), down's one 128-row box; the activation tile two
 *    128-row boxes, the second only for tiles over 128 positions, and a
 *    warpgroup's second m64 block skipped when it holds no row. Why: at 128
 *    tokens an expert with 129-256 positions reads its weights twice, and
 *    BF16 weights are DRAM-bound there (T = 8192: 17.42 GB read for 8.6 GB
 *    of gate/up weights), FP8 / FP4 decode every weight tile per token
 *    tile; measured at T = 8192 BF16 7.26 -> 5.67-5.76 ms, MXFP4 8.01 ->
 *    7.36, NVFP4 8.31 -> 7.04, FP8 8.58 -> 7.24, and slower below ~128
 *    positions per expert (docs/performance-cuda.md).
 *    Same k order, same instruction k16 steps: the same bits (tested).
 *  - scheduler: work item w -> (token tile m, weight tile n) by wg_item
 *    (groups of WG_GROUP_M token tiles, weight tile by weight tile); block
 *    b takes w = b, b + grid, ... Items are of equal size whatever the
 *    expert, so skewed expert loads (one expert with most tokens, empty
 *    experts) spread evenly. Weight rows past the projection (the last tile
 *    of a width that is not a multiple of 256) are zero-filled (cp.async)
 *    or not loaded (TMA: a whole 128-row box past them), and not stored.
 *
 * Operand layout (both operands K-major, 128-byte swizzle, the layout the
 * TMA's SWIZZLE_128B writes): row r of a tile is 64 bf16 = 128 bytes at
 * r * 128, its 16-byte chunk c (columns 8c .. 8c + 7) stored at chunk
 * c ^ (r % 8); tiles start 1024-byte aligned; descriptor: start address,
 * stride between 8-row groups 1024 bytes, swizzle mode 1 (128 B); the k16
 * sub-steps advance the start address by 32 bytes.
 *
 * gate/up: the item's 256 weight rows are 128 gate rows (w1, i0 .. i0 + 127)
 * then the same 128 up rows (w3), so accumulator column n < 128 (gate)
 * pairs with n + 128 (up) in the same thread: the SwiGLU with clamp runs in
 * registers. down: 256 rows of w2, written per assignment row (perm) for
 * moe_k_combine.
 *
 * Exactness of the decode (weights reach the tensor cores exactly as the
 * mma.sync path decodes them, NVFP4's times 2^-8): E2M1 x E8M0 and E2M1 x
 * UE4M3 x 2^-8 are exact in bf16 (at most 6 significant bits, exponents in
 * range: cuda_wg_fp4 and cuda_wg_nv_mult below); FP8 x fp32 tile scale
 * rounds once to bf16 (as cuda_gemm.cu). NVFP4's per-tensor scale times
 * 2^8 multiplies the fp32 accumulator: the fp32 sums of products scaled by
 * 2^-8 are the unscaled sums scaled by 2^-8 exactly (a power of two; only
 * products below fp32's normal range, activations under ~2^-100, could
 * round differently), so the output equals that of the unscaled decode.
 *
 * Invariants:
 *  1. A row's output depends on its own activations and the weights only
 *     (fixed k order, fixed instruction shape), not on the other rows of its
 *     tile nor on which block ran the item: bit-identical reruns, outputs
 *     independent of the batch.
 *  2. Rows past the expert's segment are never stored: zero-filled on the
 *     cp.async path; on the TMA path they hold the next expert's rows (or
 *     zeros past n_pos), which by 1 touch no stored row.
 *  3. Ring protocol: load iteration j waits "empty" of load slot j % R with
 *     parity ((j / R) & 1) ^ 1 (the release of iteration j - R); decode
 *     iteration d = j - LOOKAHEAD waits for its own cp.async group
 *     (cp.async.wait_group LOOKAHEAD: one group per load iteration), on
 *     the TMA path for "raw" of slot d % R with parity (d / R) & 1 (thread
 *     0's expect-tx arrive of iteration d and the boxes' bytes), and, for
 *     formats the producer decodes, "emptyB" of B slot d % 2 (the release
 *     of d - 2), then fences (fence.proxy.async) and arrives on "full" (128
 *     producer threads); consumers wait "full" with parity (d / R) & 1 and
 *     arrive on "empty" (and "emptyB"; 256 consumer threads) after their
 *     wgmma group completed. LOOKAHEAD = R - 2 keeps one published step
 *     ahead of the consumers while the producer waits for a free slot.
 *  4. CD: consumers wait "full" of step it + 1 (not it: they waited for it
 *     before decoding it) during step it; step 0 is decoded before the
 *     loop. The producer publishes step d (cp.async.wait_group
 *     LOOKAHEAD - 1, "raw", "full") at load iteration d + LOOKAHEAD before
 *     it waits for that iteration's slot, so step it + 1 is published once
 *     load iteration it + LOOKAHEAD took its slot, released at consumer
 *     step it - 2: no cycle, one step of slack. B slot (it + 1) % 2 is written after the consumer barrier of
 *     step it - 1 (its readers, step it - 1's wgmma, waited in both
 *     warpgroups) and read by step it + 1's wgmma after the barrier of step
 *     it (every row written, each writer fenced the async proxy). "emptyB"
 *     is unused.
 */
#include "cuda/cuda_wg.cuh"
#include "cuda/cuda_selftest.h"
#include "cuda/cuda_selftest_host.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <type_traits>
#include <vector>

namespace {

constexpr int WG_BM = 128;       /* token rows per tile (two consumer warpgroups of 64) */
constexpr int WG_BN = 256;       /* weight rows per tile */
constexpr int WG_BK = 64;        /* columns per k step: one 128-byte swizzle row of bf16 */
constexpr int WG_THREADS = 384;

/* Shared memory: a load ring of R slots, each [A tile: 128 rows x 128 B]
 * [weights: BF16 the B operand itself, 256 rows x 128 B; FP8 / FP4 the raw
 * codes, 256 rows x RAW B, and one scale word per row], and for FP8 / FP4 a
 * ring of 2 decoded B operands [256 rows x 128 B]. The loads run LOOKAHEAD
 * = R - 2 k steps ahead of the decode; R is as deep as 227 KB allow. */
template <int F, bool M2 = false> struct wg_cfg {
    /* M2: the 256-token tile (BF16 weights only): 256 token rows x 128
     * weight rows, each consumer warpgroup 128 token rows as two m64 blocks */
    static constexpr int BM = M2 ? 2 * WG_BM : WG_BM; /* token rows per tile */
    static constexpr int BN = M2 ? WG_BN / 2 : WG_BN; /* weight rows per tile */
    static constexpr bool DEC = F != DF_BF16;                           /* weights decoded by the producer */
    static constexpr int RAW = F == DF_FP8 ? 64 : F == DF_BF16 ? 0 : 32; /* code bytes per row per k step */
    static constexpr int RAWB = DEC ? RAW : 128;                         /* bytes per weight row per slot */
    static constexpr int BOX0 = (F == DF_MXFP4 || F == DF_NVFP4) ? 32 : 64;                  /* TMA box, inner extent (elements) */
    static constexpr int A_OFF = 0;
    static constexpr int W_OFF = BM * 128;                               /* BF16: B operand; else raw codes */
    static constexpr int SC_OFF = W_OFF + BN * (DEC ? RAW : 128);
    static constexpr int SLOT = (SC_OFF + (DEC ? BN * 4 : 0) + 1023) / 1024 * 1024; /* operand tiles 1024-aligned */
    /* load ring slots (M2: FP4 5, the 37 KB slots and the decoded B ring in 227 KB) */
    static constexpr int R = F == DF_BF16 ? 4 : F == DF_FP8 ? 4 : M2 ? 5 : 6;
    static constexpr int LOOKAHEAD = R - 2;
    static constexpr int B_RING = R * SLOT;                              /* decoded B [2][256 x 128 B] */
    static constexpr int BARS = B_RING + (DEC ? 2 * BN * 128 : 0);
    /* full [R], empty [R] (load slots), emptyB [2], raw [R] (TMA landed) */
    static constexpr int SMEM = BARS + (3 * R + 2) * 8 + 1024;           /* + slack to align the base */
    static_assert(SLOT % 1024 == 0, "operand tiles must stay 1024-byte aligned");
    static_assert(SMEM <= 232448, "more shared memory than a Hopper block has");
};

/* D [64 x 256] (+)= A [64 x 16] B [256 x 16]^T, both from shared memory
 * (accumulate = 0: D = A B^T). */
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(accumulate));
}

/* D [64 x 128] (+)= A [64 x 16] B [128 x 16]^T, both from shared memory,
 * into accumulators d [O .. O + 63] (the 256-token kernel: two m64 blocks
 * of one warpgroup's 128 token rows in one 128-register array). */
template <int O>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[128], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[O + 0]), "+f"(d[O + 1]), "+f"(d[O + 2]), "+f"(d[O + 3]),
          "+f"(d[O + 4]), "+f"(d[O + 5]), "+f"(d[O + 6]), "+f"(d[O + 7]),
          "+f"(d[O + 8]), "+f"(d[O + 9]), "+f"(d[O + 10]), "+f"(d[O + 11]),
          "+f"(d[O + 12]), "+f"(d[O + 13]), "+f"(d[O + 14]), "+f"(d[O + 15]),
          "+f"(d[O + 16]), "+f"(d[O + 17]), "+f"(d[O + 18]), "+f"(d[O + 19]),
          "+f"(d[O + 20]), "+f"(d[O + 21]), "+f"(d[O + 22]), "+f"(d[O + 23]),
          "+f"(d[O + 24]), "+f"(d[O + 25]), "+f"(d[O + 26]), "+f"(d[O + 27]),
          "+f"(d[O + 28]), "+f"(d[O + 29]), "+f"(d[O + 30]), "+f"(d[O + 31]),
          "+f"(d[O + 32]), "+f"(d[O + 33]), "+f"(d[O + 34]), "+f"(d[O + 35]),
          "+f"(d[O + 36]), "+f"(d[O + 37]), "+f"(d[O + 38]), "+f"(d[O + 39]),
          "+f"(d[O + 40]), "+f"(d[O + 41]), "+f"(d[O + 42]), "+f"(d[O + 43]),
          "+f"(d[O + 44]), "+f"(d[O + 45]), "+f"(d[O + 46]), "+f"(d[O + 47]),
          "+f"(d[O + 48]), "+f"(d[O + 49]), "+f"(d[O + 50]), "+f"(d[O + 51]),
          "+f"(d[O + 52]), "+f"(d[O + 53]), "+f"(d[O + 54]), "+f"(d[O + 55]),
          "+f"(d[O + 56]), "+f"(d[O + 57]), "+f"(d[O + 58]), "+f"(d[O + 59]),
          "+f"(d[O + 60]), "+f"(d[O + 61]), "+f"(d[O + 62]), "+f"(d[O + 63])
        : "l"(da), "l"(db), "r"(accumulate));
}

__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&v);
}

} // namespace

/* Eight E2M1 codes (element k at bits 4k .. 4k + 3) as four bf16 pairs
 * (pair j: elements 2j, 2j + 1) of value e2m1 x 2^-126, exactly: the 3-bit
 * magnitude m at bits 6-8 of a bf16 is exponent m >> 1 and mantissa bit
 * m & 1, i.e. 2^((m >> 1) - 127) x (1 + (m & 1) / 2) = e2m1(m) x 2^-126 for
 * m >= 2, and m = 1 is the subnormal 2^-127 = 0.5 x 2^-126; the sign goes to
 * bit 15. Per pair: one byte permute (byte j low nibble to bits 0-3, its high
 * nibble to bits 16-19), two shifts, two logic ops. */
__device__ __forceinline__ void cuda_wg_fp4(uint32_t w, uint32_t o[4]) {
    uint32_t w4 = w >> 4;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t v = __byte_perm(w, w4, (uint32_t)(j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12)));
        o[j] = ((v << 6) & 0x01C001C0u) | ((v << 12) & 0x80008000u);
    }
}

/* bf16 bits of 2^(e - 127) for an E8M0 code (0: the subnormal 2^-127, 255:
 * NaN), as moe_e8m0_to_f32. */
__device__ __forceinline__ uint32_t cuda_wg_e8m0_bf16(uint32_t e) {
    uint32_t b = e == 0 ? 0x0040u : e == 255 ? 0x7FC0u : e << 7;
    return b | (b << 16);
}
#define WG_TWO126 0x7E807E80u /* bf16 pair 2^126 */

/* Eight FP4 codes times a block scale (bf16 pair) as four bf16 pairs, exact:
 * (e2m1 x 2^-126) x 2^126 is e2m1 exactly, then one exact product. */
__device__ __forceinline__ void cuda_wg_fp4_scaled(uint32_t w, uint32_t scale2x, uint32_t o[4]) {
    cuda_wg_fp4(w, o);
#pragma unroll
    for (int j = 0; j < 4; j++) o[j] = bmul2(bmul2(o[j], WG_TWO126), scale2x);
}

/* Eight FP4 codes times one multiplier m (bf16 pair) in one product:
 * (e2m1 x 2^-126) x m, exact whenever e2m1 x 2^-126 x m is a bf16 value. */
__device__ __forceinline__ void cuda_wg_fp4_mul(uint32_t w, uint32_t m2x, uint32_t o[4]) {
    cuda_wg_fp4(w, o);
#pragma unroll
    for (int j = 0; j < 4; j++) o[j] = bmul2(o[j], m2x);
}

/* MXFP4: eight codes times the E8M0 scale 2^(e - 127), exact. For e <= 128
 * (scales up to 2, those of every published checkpoint) one product by
 * 2^(e - 1), a bf16 normal (biased exponent e + 126 <= 254): e2m1 x 2^-126
 * x 2^(e - 1) = e2m1 x 2^(e - 127), a bf16 value (subnormal down to 2^-128
 * for e = 0); larger scales and the NaN code take the two products of
 * cuda_wg_fp4_scaled. */
__device__ __forceinline__ void cuda_wg_fp4_e8m0(uint32_t w, uint32_t e, uint32_t o[4]) {
    if (e <= 128u) {
        const uint32_t m = (e + 126u) << 7;
        cuda_wg_fp4_mul(w, m | (m << 16), o);
    } else {
        cuda_wg_fp4_scaled(w, cuda_wg_e8m0_bf16(e), o);
    }
}

/* NVFP4: the one multiplier of a UE4M3 scale code c, the bf16 pair of
 * s x 2^118 = 2^126 x s x 2^-8, so that cuda_wg_fp4_mul gives e2m1 x s x
 * 2^-8 in one product; the GEMM's epilogue multiplies by 2^8 (with the
 * per-tensor scale). In range and exact: s <= 448 < 2^9, so s x 2^118 <
 * 2^127, and e2m1 x s x 2^-8 has at most 6 significant bits and magnitude
 * in [2^-18, 10.5]. Normal codes (exponent field E >= 1): s x 2^118 has
 * biased exponent E + 238 and s's 3 mantissa bits, i.e. bits (c << 4) +
 * (238 << 7); subnormal codes (E = 0): c x 2^-9 x 2^118 = c x 2^109,
 * computed in fp32 (exact, at most 3 significant bits: the bf16 is the
 * float's upper half); NaN for 0x7F and for codes with bit 7 set (as
 * moe_ue4m3_to_f32). Selects, no branch: the consumers run it while their
 * wgmma is in flight, and ptxas serializes wgmma around divergent code
 * there (C7518). */
__device__ __forceinline__ uint32_t cuda_wg_nv_mult(uint32_t c) {
    const uint32_t bn = (c << 4) + (238u << 7);
    const uint32_t bs = __float_as_uint((float)(c & 7u) * 0x1p109f) >> 16;
    uint32_t b = (c >> 3) ? bn : bs;
    b = ((c & 0x80u) || c == 0x7Fu) ? 0x7FC0u : b;
    return b | (b << 16);
}
#define WG_NV_EPI 256.0f /* 2^8: the NVFP4 decode's 2^-8 undone in the epilogue */

/* Work item w -> (token tile m, weight tile n), a bijection of
 * [0, n_m NT): groups of WG_GROUP_M consecutive token tiles (the last
 * group: what is left), within a group weight tile by weight tile with the
 * group's token tiles adjacent. WG_GROUP_M = 1 is the plain order (weight
 * tile fastest: consecutive items share the token tile, and an expert's
 * next token tile runs NT items later, in the same wave of the grid, on
 * the same weight tiles). Groups of 4, meant to make one expert's token
 * tiles read each weight tile together (BF16 gate/up at T = 8192 moves
 * ~18 GB at 84% of DRAM bandwidth for 8.6 GB of weights, L2 hit rate
 * 34-38%), measured slower: BF16 T = 8192 8.37 against 7.55 ms, FP8 9.47
 * against 9.18 (H200, docs/performance-cuda.md). */
#define WG_GROUP_M 1
__device__ __forceinline__ void wg_item(int w, int NT, int n_m, int &m, int &n) {
    const int g = w / (WG_GROUP_M * NT), r = w - g * (WG_GROUP_M * NT);
    const int left = n_m - g * WG_GROUP_M, gm = left < WG_GROUP_M ? left : WG_GROUP_M;
    m = g * WG_GROUP_M + r % gm;
    n = r / gm;
}

/* NC FP4 words of a weight row's k step (wd: chunk c0 + c = columns
 * 8 (c0 + c) .. + 7) into its 128-byte swizzled operand row at bb: P = 1,
 * one product by the multiplier pair m[c / 2] (cuda_wg_fp4_mul); P = 2, by
 * 2^126 then by the scale pair m[c / 2] (cuda_wg_fp4_scaled). */
template <int P, int NC>
__device__ __forceinline__ void wg_dec_row(const uint32_t (&wd)[NC], const uint32_t (&m)[NC / 2], int c0, uint32_t bb,
                                           uint32_t bswz) {
#pragma unroll
    for (int c = 0; c < NC; c++) {
        uint32_t o[4];
        if (P == 1)
            cuda_wg_fp4_mul(wd[c], m[c / 2], o);
        else
            cuda_wg_fp4_scaled(wd[c], m[c / 2], o);
        sts128(bb + ((((uint32_t)(c0 + c)) ^ bswz) << 4), o[0], o[1], o[2], o[3]);
    }
}

/* 16 FP8 codes of a weight row's k step (the 16 bytes at rb + 16 q4) times
 * the fp32 tile scale sc, each rounded once to bf16, into chunks 2 q4 and
 * 2 q4 + 1 of its swizzled operand row at bb. */
__device__ __forceinline__ void wg_dec_fp8x16(uint32_t rb, int q4, float sc, uint32_t bb, uint32_t bswz) {
    const uint4 q = lds128(rb + 16 * (uint32_t)q4);
    const uint32_t wd[4] = {q.x, q.y, q.z, q.w};
    uint32_t o[8];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float2 a = fp8x2_to_f2((uint16_t)(wd[k] & 0xFFFFu));
        float2 b = fp8x2_to_f2((uint16_t)(wd[k] >> 16));
        o[2 * k] = pack_bf16x2(a.x * sc, a.y * sc);
        o[2 * k + 1] = pack_bf16x2(b.x * sc, b.y * sc);
    }
    sts128(bb + ((((uint32_t)(2 * q4)) ^ bswz) << 4), o[0], o[1], o[2], o[3]);
    sts128(bb + ((((uint32_t)(2 * q4 + 1)) ^ bswz) << 4), o[4], o[5], o[6], o[7]);
}

/* MXFP4: the k step's two E8M0 codes (bits 0-7: columns 0-31, bits 8-15:
 * 32-63) from weight row br's scale word sw, at byte 0 or 2 as the copy
 * computed it: the scale row of weight row r starts at r * kp / 32 bytes
 * from a 4-aligned base, and the tile's first row is a multiple of 4. */
__device__ __forceinline__ uint32_t wg_mx_codes(uint32_t sw, int br, int kt, int kp) {
    return (sw >> (8 * ((br * (kp / 32) + 2 * kt) & 3))) & 0xFFFFu;
}

/* Weight row br (0 .. 255) of the B tile of one k step (kt: its index in
 * the item, for MXFP4's scale byte offset): from the raw codes and the scale
 * word of load slot `slot` into its 128-byte swizzled row of the decoded B
 * operand at bring. Reads the slot, writes 128 bytes; the caller fences the
 * async proxy before a wgmma reads them. The same arithmetic whichever
 * warpgroup runs it (producer: rows tid and tid + 128; consumers: row ct). */
template <int F>
__device__ __forceinline__ void wg_dec_step(uint32_t slot, uint32_t bring, int br, int kt, int kp) {
    using cfg = wg_cfg<F>;
    const uint32_t bswz = (uint32_t)(br & 7);
    const uint32_t rb = slot + cfg::W_OFF + (uint32_t)(br * cfg::RAW);
    const uint32_t bb = bring + (uint32_t)(br * 128);
    const uint32_t sw = lds32(slot + cfg::SC_OFF + (uint32_t)(br * 4));
    if (F == DF_FP8) {
#pragma unroll
        for (int q4 = 0; q4 < 4; q4++) wg_dec_fp8x16(rb, q4, __uint_as_float(sw), bb, bswz);
    } else {
        /* MXFP4: the step's two E8M0 codes (one per 32 columns); NVFP4: the
         * multipliers of its four UE4M3 codes (one per 16) */
        uint32_t e8[2] = {0, 0}, nvm[4] = {0, 0, 0, 0};
        if (F == DF_MXFP4) {
            const uint32_t b2 = wg_mx_codes(sw, br, kt, kp);
            e8[0] = b2 & 0xFFu;
            e8[1] = (b2 >> 8) & 0xFFu;
        } else {
#pragma unroll
            for (int b = 0; b < 4; b++) nvm[b] = cuda_wg_nv_mult((sw >> (8 * b)) & 0xFFu);
        }
        const uint4 q0 = lds128(rb), q1 = lds128(rb + 16);
        const uint32_t wd[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        if (F == DF_NVFP4) {
            wg_dec_row<1>(wd, nvm, 0, bb, bswz);
        } else if ((e8[0] > e8[1] ? e8[0] : e8[1]) <= 128u) {
            /* one product by 2^(e - 1) (cuda_wg_fp4_e8m0); the branch is taken
             * per row and k step, not per word, so that either side is
             * straight-line code (a branch per word measured slower than two
             * products: 10.83 against 9.62 ms, MXFP4 T = 8192) */
            uint32_t m[4];
            m[0] = m[1] = ((e8[0] + 126u) << 7) * 0x10001u;
            m[2] = m[3] = ((e8[1] + 126u) << 7) * 0x10001u;
            wg_dec_row<1>(wd, m, 0, bb, bswz);
        } else {
            uint32_t sc[4];
            sc[0] = sc[1] = cuda_wg_e8m0_bf16(e8[0]);
            sc[2] = sc[3] = cuda_wg_e8m0_bf16(e8[1]);
            wg_dec_row<2>(wd, sc, 0, bb, bswz);
        }
    }
}

/* Half hf (columns 32 hf .. 32 hf + 31) of weight row br (0 .. 127) of the
 * 256-token tile's B for one k step: wg_dec_step's arithmetic on four
 * chunks (two threads a row: the 256 consumers decode the 128 rows; MXFP4
 * the half's one E8M0 code, NVFP4 its two UE4M3 codes). */
template <int F>
__device__ __forceinline__ void wg_dec_half(uint32_t slot, uint32_t bring, int br, int hf, int kt, int kp) {
    using cfg = wg_cfg<F, true>;
    const uint32_t bswz = (uint32_t)(br & 7);
    const uint32_t rb = slot + cfg::W_OFF + (uint32_t)(br * cfg::RAW);
    const uint32_t bb = bring + (uint32_t)(br * 128);
    const uint32_t sw = lds32(slot + cfg::SC_OFF + (uint32_t)(br * 4));
    if (F == DF_FP8) {
#pragma unroll
        for (int q = 0; q < 2; q++) wg_dec_fp8x16(rb, 2 * hf + q, __uint_as_float(sw), bb, bswz);
    } else {
        const uint4 q = lds128(rb + 16 * (uint32_t)hf);
        const uint32_t wd[4] = {q.x, q.y, q.z, q.w};
        uint32_t m[2];
        if (F == DF_MXFP4) {
            const uint32_t e = (wg_mx_codes(sw, br, kt, kp) >> (8 * hf)) & 0xFFu;
            if (e <= 128u) { /* one product by 2^(e - 1), as wg_dec_step */
                m[0] = m[1] = ((e + 126u) << 7) * 0x10001u;
                wg_dec_row<1>(wd, m, 4 * hf, bb, bswz);
            } else {
                m[0] = m[1] = cuda_wg_e8m0_bf16(e);
                wg_dec_row<2>(wd, m, 4 * hf, bb, bswz);
            }
        } else {
            m[0] = cuda_wg_nv_mult((sw >> (16 * hf)) & 0xFFu);
            m[1] = cuda_wg_nv_mult((sw >> (16 * hf + 8)) & 0xFFu);
            wg_dec_row<1>(wd, m, 4 * hf, bb, bswz);
        }
    }
}

__device__ __forceinline__ void bar_consumers() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

struct wg_args {
    CUtensorMap tw[2];      /* TMA: the weight maps (gate/up: w1, w3; down: w2 in tw[0]), [n][rows_p][row] */
    CUtensorMap ta;         /* TMA, down: the activation rows A [n_pos][lda] */
    dweights wa, wb;        /* gate/up: w1, w3; down: w2 (wb unused) */
    const __nv_bfloat16 *A; /* Xb [T, lda] (gate/up) or Hb [n_pos, lda] (down) */
    int lda;
    const int32_t *perm;    /* sorted position -> assignment t * C + j, or NULL */
    int C;
    const mma_tile *tiles;  /* or NULL: one expert (e = 0), tile m = positions 128 m .. */
    const int32_t *n_tiles;
    int n_pos;
    int NT;                 /* weight tiles per token tile */
    float limit;
    __nv_bfloat16 *Hb;      /* gate/up out, bf16 [n_pos, ldo] */
    float *Hf;              /* gate/up out, fp32, when Hb == NULL */
    float *Y;               /* down out [rows, ldo] */
    int ldo;
};

template <int F, bool GATEUP, bool TMA, bool CD, bool M2 = false>
__global__ void __launch_bounds__(WG_THREADS, 1) k_wg(const __grid_constant__ wg_args p) {
    using cfg = wg_cfg<F, M2>;
    static_assert(!CD || (cfg::DEC && TMA), "the consumers decode FP8 / FP4 weights on the TMA path only");
    static_assert(!M2 || (TMA && CD == cfg::DEC), "the 256-token tile: TMA loads, FP8 / FP4 decoded by the consumers");
    constexpr int BM = cfg::BM;
    constexpr int R = cfg::R, LA = cfg::LOOKAHEAD;
    constexpr bool TA = TMA; /* activation rows contiguous in sorted order (gate/up: pre-gathered): TMA too */
    extern __shared__ uint8_t wg_smem[];
    const uint32_t base = (sa(wg_smem) + 1023u) & ~1023u;
    const uint32_t full = base + cfg::BARS, empty = full + 8 * R, emptyb = empty + 8 * R, raw = emptyb + 16;
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < R; s++) {
            mbar_init(full + 8 * s, 128);
            mbar_init(empty + 8 * s, 256);
            mbar_init(raw + 8 * s, 1);
        }
        for (int s = 0; s < 2; s++) mbar_init(emptyb + 8 * s, 256);
        /* the barriers' initialisation visible to the copy engine */
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        if (TMA) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tw[0])) : "memory");
            if (GATEUP) asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tw[1])) : "memory");
            if (TA) asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.ta)) : "memory");
        }
    }
    __syncthreads();
    const int n_m = p.tiles ? *p.n_tiles : (p.n_pos + BM - 1) / BM;
    const int items = n_m * p.NT;
    const int kp = p.wa.kp, KT = kp / WG_BK;
    const int wrows = p.wa.rows_p; /* weight rows that exist (gate/up: w1 and w3 alike) */

    if (tid < 128) {
        /* ------------------------------------------------------ producer */
        /* CD: TMA issue and the scale bytes only; its registers go to the
         * consumers (168 a thread at launch: 128 x 128 freed, 256 x 64 taken) */
        if (CD) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
        /* A: chunk column ach of rows ar0 + 16 i (i < 8). Weights: rows tid
         * and tid + 128 of the tile (gate/up: gate row i0 + tid and up row
         * i0 + tid). */
        const int ach = tid & 7, ar0 = tid >> 3;
        const uint32_t aoff = (uint32_t)(ar0 * 128 + ((ach ^ (ar0 & 7)) << 4));
        const uint32_t bswz = (uint32_t)(tid & 7);
        const int mine = items > (int)blockIdx.x ? (items - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
        const int N = mine * KT;
        const __nv_bfloat16 *asrc[8];
        uint32_t amask = 0, wmask = 0;
        const uint8_t *bsrc[2] = {nullptr, nullptr}, *ssrc[2] = {nullptr, nullptr};
        int te = 0, tp0 = 0, tpe = 0, trow[2] = {0, 0}; /* TMA: expert, first A row (and the tile's end), first weight rows */
        int item = blockIdx.x, lkt = 0;
        auto setup = [&](int w) {
            int m, n;
            wg_item(w, p.NT, n_m, m, n);
            int e, p0, p_end;
            if (p.tiles) {
                mma_tile tl = p.tiles[m];
                e = tl.e;
                p0 = tl.p0;
                p_end = tl.p_end;
            } else {
                e = 0;
                p0 = m * BM;
                p_end = p.n_pos;
            }
            te = e;
            tp0 = p0;
            tpe = p_end;
            amask = 0;
#pragma unroll
            for (int i = 0; i < 8 && !TA; i++) {
                int pp = p0 + ar0 + 16 * i;
                size_t row = 0;
                if (pp < p_end) {
                    amask |= 1u << i;
                    row = GATEUP ? (p.perm ? (size_t)(p.perm[pp] / p.C) : (size_t)pp) : (size_t)pp;
                }
                asrc[i] = p.A + row * p.lda + ach * 8;
            }
            wmask = 0;
#pragma unroll
            for (int h = 0; h < (M2 ? 1 : 2); h++) {
                /* M2: one row a thread, gate/up rows 0-63 of w1, 64-127 of w3 */
                const dweights &w8 = GATEUP && (M2 ? tid >= 64 : h) ? p.wb : p.wa;
                const int gr = M2 ? (GATEUP ? n * 64 + (tid & 63) : n * 128 + tid)
                                  : GATEUP ? n * 128 + tid : n * 256 + 128 * h + tid;
                const bool ok = gr < wrows;
                wmask |= (uint32_t)ok << h;
                const int r = ok ? gr : 0;
                trow[h] = GATEUP ? n * 128 : n * 256 + 128 * h;
                if (M2) trow[0] = trow[1] = GATEUP ? n * 64 : n * 128;
                bsrc[h] = w8.data + (size_t)e * w8.dstride + (size_t)r * row_bytes<F>(kp);
                ssrc[h] = F == DF_BF16 ? nullptr : scale_row<F>(w8, e, r);
            }
        };
        if (N > 0) setup(item);
        for (int j = 0; j < N + LA; j++) {
            if (CD && j >= LA) {
                /* CD: publish step d = j - LA before taking the slot of j
                 * (which waits for the release of step j - R = d - 2): the
                 * consumers ask for step d during step d - 1, right after
                 * releasing d - 2; published after that release, its wake-up
                 * chain would sit on their critical path every step. Its
                 * scale words: the groups after d, LA - 1, may be pending. */
                const int d = j - LA, s = d % R;
                cpa_wait<LA - 1>();
                mbar_wait(raw + 8 * s, (uint32_t)(d / R) & 1u);
                mbar_arrive(full + 8 * s);
            }
            if (j < N) {
                const int s = j % R;
                const uint32_t slot = base + (uint32_t)(s * cfg::SLOT);
                mbar_wait(empty + 8 * s, ((uint32_t)(j / R) & 1u) ^ 1u);
                if (M2 && tid == 0) {
                    /* 256-token tile: the 128 weight rows (gate/up: 64 gate
                     * rows of w1, then the same 64 of w3, boxes of 64 rows;
                     * down: one 128-row box) and two 128-row activation boxes
                     * (rows past n_pos land as zeros, whole boxes included) */
                    const uint32_t rb = raw + 8 * s;
                    const bool a2 = tpe - tp0 > 128; /* else the second warpgroup has no row: no second box */
                    mbar_expect_tx(rb, (uint32_t)(cfg::BN * cfg::RAWB + (a2 ? 2 : 1) * 128 * 128));
                    tma3d(slot + cfg::W_OFF, &p.tw[0], lkt * cfg::BOX0, trow[0], te, rb);
                    if (GATEUP)
                        tma3d(slot + cfg::W_OFF + (uint32_t)(64 * cfg::RAWB), &p.tw[1], lkt * cfg::BOX0, trow[1], te, rb);
                    tma2d(slot + cfg::A_OFF, &p.ta, lkt * WG_BK, tp0, rb);
                    if (a2) tma2d(slot + cfg::A_OFF + 128u * 128u, &p.ta, lkt * WG_BK, tp0 + 128, rb);
                } else if (TMA && tid == 0) {
                    /* one thread issues the step's boxes: the two 128-row weight
                     * boxes (a box wholly past the weight's rows, the last down
                     * tile's second half, is not issued: its columns are never
                     * stored) and, for down, the 128 activation rows */
                    const bool h1 = trow[1] < wrows;
                    const uint32_t rb = raw + 8 * s;
                    mbar_expect_tx(rb, (uint32_t)((1 + h1) * 128 * cfg::RAWB + (TA ? WG_BM * 128 : 0)));
                    tma3d(slot + cfg::W_OFF, &p.tw[0], lkt * cfg::BOX0, trow[0], te, rb);
                    if (h1)
                        tma3d(slot + cfg::W_OFF + (uint32_t)(128 * cfg::RAWB), &p.tw[GATEUP ? 1 : 0], lkt * cfg::BOX0,
                              trow[1], te, rb);
                    if (TA) tma2d(slot + cfg::A_OFF, &p.ta, lkt * WG_BK, tp0, rb);
                }
#pragma unroll
                for (int i = 0; i < 8 && !TA; i++)
                    cpa16(slot + cfg::A_OFF + aoff + (uint32_t)(i * 16 * 128), asrc[i] + lkt * WG_BK,
                          (amask >> i) & 1u ? 16 : 0);
#pragma unroll
                for (int h = 0; h < (M2 ? 1 : 2); h++) {
                    const int br = tid + 128 * h;
                    const int nb = (wmask >> h) & 1u ? 16 : 0, ns = (wmask >> h) & 1u ? 4 : 0;
                    const uint8_t *src = bsrc[h];
                    if (F == DF_BF16) {
#pragma unroll
                        for (int c = 0; c < 8 && !TMA; c++)
                            cpa16(slot + cfg::W_OFF + (uint32_t)(br * 128) + (((uint32_t)c ^ bswz) << 4),
                                  src + (size_t)lkt * 128 + c * 16, nb);
                        continue;
                    }
                    const uint32_t rb = slot + cfg::W_OFF + (uint32_t)(br * cfg::RAW);
                    const uint32_t sb = slot + cfg::SC_OFF + (uint32_t)(br * 4);
                    if (F == DF_FP8) {
#pragma unroll
                        for (int c = 0; c < 4 && !TMA; c++) cpa16(rb + 16 * c, src + (size_t)lkt * 64 + c * 16, nb);
                        cpa4(sb, ssrc[h] + 4 * ((lkt * WG_BK) / 128), ns);
                    } else {
                        if (!TMA) {
                            cpa16(rb, src + (size_t)lkt * 32, nb);
                            cpa16(rb + 16, src + (size_t)lkt * 32 + 16, nb);
                        }
                        if (F == DF_MXFP4) {
                            /* the step's two E8M0 bytes from the aligned word holding
                             * them, reading nothing past them (the rest zero-filled) */
                            const uint8_t *a = ssrc[h] + 2 * lkt;
                            const int off = (int)((uintptr_t)a & 3u);
                            cpa4(sb, a - off, ns ? off + 2 : 0);
                        } else {
                            cpa4(sb, ssrc[h] + 4 * lkt, ns); /* four UE4M3 bytes, 4-aligned */
                        }
                    }
                }
                if (++lkt == KT) {
                    lkt = 0;
                    item += gridDim.x;
                    if (j + 1 < N) setup(item);
                }
            }
            cpa_commit();
            const int d = j - LA;
            if (CD || d < 0) continue;
            cpa_wait<LA>();
            const int s = d % R;
            const uint32_t slot = base + (uint32_t)(s * cfg::SLOT);
            if (TMA) mbar_wait(raw + 8 * s, (uint32_t)(d / R) & 1u); /* the step's boxes landed */
            if (cfg::DEC) {
                const uint32_t bring = base + (uint32_t)cfg::B_RING + (uint32_t)((d & 1) * cfg::BN * 128);
                mbar_wait(emptyb + 8 * (d & 1), ((uint32_t)(d >> 1) & 1u) ^ 1u);
                wg_dec_step<F>(slot, bring, tid, d % KT, kp);
                wg_dec_step<F>(slot, bring, tid + 128, d % KT, kp);
            }
            fence_async_smem();
            mbar_arrive(full + 8 * s);
        }
        return;
    }

    /* ---------------------------------------------------------- consumers */
    if (CD) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
    const int ct = tid - 128, wg = ct >> 7, wi = (ct >> 5) & 3, lane = ct & 31;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.0f;
    int it = 0;
    /* CD: the block's k steps, all items (as the producer counts them); step
     * 0's B decoded before the loop, step it + 1's during step it's MMAs */
    const int mine = items > (int)blockIdx.x ? (items - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int NC = mine * KT;
    const uint32_t bring0 = base + (uint32_t)cfg::B_RING;
    if (CD && NC > 0) {
        mbar_wait(full, 0u);
        if (M2)
            wg_dec_half<F>(base, bring0, ct & 127, ct >> 7, 0, kp);
        else
            wg_dec_step<F>(base, bring0, ct, 0, kp);
        fence_async_smem();
        bar_consumers();
    }
    for (int w = blockIdx.x; w < items; w += gridDim.x) {
        int m, n;
        wg_item(w, p.NT, n_m, m, n);
        int e, p0, p_end;
        if (p.tiles) {
            mma_tile tl = p.tiles[m];
            e = tl.e;
            p0 = tl.p0;
            p_end = tl.p_end;
        } else {
            e = 0;
            p0 = m * BM;
            p_end = p.n_pos;
        }
        const bool active = p0 + (BM / 2) * wg < p_end;
        const bool act1 = p0 + 128 * wg + 64 < p_end; /* M2: the warpgroup's second m64 block holds a row */
        /* One k step's MMAs of an active warpgroup: NB m64 blocks (M2: 2,
         * or 1 when its second block holds no row: those MMAs skipped, the
         * accumulators never stored; else the one m64n256 block) */
        auto issue = [&](auto nb, uint32_t slot, int kt) {
            constexpr int NB = decltype(nb)::value;
            const uint64_t da = wg_desc(slot + cfg::A_OFF + (uint32_t)(wg * (BM / 2) * 128));
            const uint64_t db = wg_desc(cfg::DEC ? bring0 + (uint32_t)((it & 1) * cfg::BN * 128) : slot + cfg::W_OFF);
            wg_fence_acc(acc);
            wg_fence();
            if (M2) {
                /* m64 blocks: rows 0-63, 64-127 of the warpgroup's 128
                 * (descriptors 64 x 128 bytes apart), one B */
                const uint64_t da1 = da + ((64u * 128u) >> 4);
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    wgmma_m64n128k16<0>(acc, da + 2 * k, db + 2 * k, k > 0 || kt > 0);
                    if (NB == 2) wgmma_m64n128k16<64>(acc, da1 + 2 * k, db + 2 * k, k > 0 || kt > 0);
                }
            } else {
                wgmma_m64n256k16(acc, da, db, kt > 0);
                wgmma_m64n256k16(acc, da + 2, db + 2, 1);
                wgmma_m64n256k16(acc, da + 4, db + 4, 1);
                wgmma_m64n256k16(acc, da + 6, db + 6, 1);
            }
            wg_commit();
        };
        if constexpr (!CD) {
            /* the producer decodes (or BF16: nothing to decode): each
             * step's MMAs waited for before its slot (and decoded B) is
             * released. One group kept in flight across steps (the slot
             * released a step later) measured slower: BF16 256-token
             * T = 8192 6.33-6.37 against 5.67-5.76 ms (H200, one run,
             * docs/performance-cuda.md), the ring's lookahead one step
             * shorter on a kernel that waits for its loads. The whole k
             * loop of an active warpgroup is one branch, the number of
             * blocks fixed in it: ptxas serializes wgmma (C7518) whose
             * issue and wait sit in different conditional blocks. */
            auto release = [&](int j) {
                mbar_arrive(empty + 8 * (j % R));
                if (cfg::DEC) mbar_arrive(emptyb + 8 * (j & 1));
            };
            auto kloop = [&](auto nb) {
                for (int kt = 0; kt < KT; kt++, it++) {
                    const int s = it % R;
                    mbar_wait(full + 8 * s, (uint32_t)(it / R) & 1u);
                    issue(nb, base + (uint32_t)(s * cfg::SLOT), kt);
                    wg_wait0();
                    wg_fence_acc(acc);
                    release(it);
                }
            };
            if (M2 && active && act1)
                kloop(std::integral_constant<int, 2>());
            else if (active)
                kloop(std::integral_constant<int, 1>());
            else
                for (int kt = 0; kt < KT; kt++, it++) {
                    mbar_wait(full + 8 * (it % R), (uint32_t)(it / R) & 1u);
                    release(it);
                }
        } else {
            for (int kt = 0; kt < KT; kt++, it++) {
                const int s = it % R;
                const uint32_t slot = base + (uint32_t)(s * cfg::SLOT);
                /* step it + 1's B while step it's MMAs run (step it's "full"
                 * waited before decoding it): its slot landed ("full"), its
                 * B buffer's last readers (step it - 1's wgmma in both
                 * consumer warpgroups) finished before the last consumer
                 * barrier */
                auto decode_next = [&]() {
                    if (it + 1 >= NC) return;
                    const int s1 = (it + 1) % R;
                    const uint32_t slot1 = base + (uint32_t)(s1 * cfg::SLOT);
                    mbar_wait(full + 8 * s1, (uint32_t)((it + 1) / R) & 1u);
                    const uint32_t b1 = bring0 + (uint32_t)(((it + 1) & 1) * cfg::BN * 128);
                    if (M2)
                        wg_dec_half<F>(slot1, b1, ct & 127, ct >> 7, (it + 1) % KT, kp);
                    else
                        wg_dec_step<F>(slot1, b1, ct, (it + 1) % KT, kp);
                    fence_async_smem();
                };
                if (M2 && active && act1) {
                    /* issue, decode and wait in one block: ptxas serializes the
                     * wgmma (C7518) when its issue and its wait sit in
                     * different conditional blocks with divergent code between */
                    issue(std::integral_constant<int, 2>(), slot, kt);
                    decode_next();
                    wg_wait0();
                    wg_fence_acc(acc);
                } else if (active) {
                    issue(std::integral_constant<int, 1>(), slot, kt);
                    decode_next();
                    wg_wait0();
                    wg_fence_acc(acc);
                } else {
                    decode_next();
                }
                mbar_arrive(empty + 8 * s);
                bar_consumers(); /* step it + 1's B complete; step it's MMAs done in both warpgroups */
            }
        }
        if (!active) continue;
        /* NVFP4: the per-tensor scale times the 2^8 the decode took out (exact) */
        const float epi = F == DF_NVFP4 ? WG_NV_EPI : 1.0f;
        const float s2a = (p.wa.scale2 ? p.wa.scale2[e] : 1.0f) * epi;
        const float s2b = (GATEUP && p.wb.scale2 ? p.wb.scale2[e] : 1.0f) * epi;
        /* accumulator (b, j, q) = acc [NA b + 4 j + q] (m64 block b of the
         * warpgroup's NB): row 64 b + 16 wi + lane / 4 + 8 (q >> 1) of its
         * rows, column 8 j + 2 (lane % 4) + (q & 1) of the BN; gate/up: the
         * gate columns j < GJ, each with its up partner j + GJ */
        constexpr int NB = M2 ? 2 : 1, NA = 128 / NB, GJ = NA / 8;
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int pp = p0 + (BM / 2) * wg + 64 * b + 16 * wi + (lane >> 2) + 8 * h;
                if (pp >= p_end) continue;
                const float *ab = acc + NA * b;
                if (GATEUP) {
#pragma unroll
                    for (int j = 0; j < GJ; j++) {
                        const int i = n * (cfg::BN / 2) + 8 * j + 2 * (lane & 3);
                        if (i >= p.ldo) continue; /* the last tile's rows past Ip */
                        const float h0 = swiglu(ab[4 * j + 2 * h] * s2a, ab[4 * (j + GJ) + 2 * h] * s2b, p.limit);
                        const float h1 =
                            swiglu(ab[4 * j + 2 * h + 1] * s2a, ab[4 * (j + GJ) + 2 * h + 1] * s2b, p.limit);
                        if (p.Hb)
                            *reinterpret_cast<uint32_t *>(p.Hb + (size_t)pp * p.ldo + i) = pack_bf16x2(h0, h1);
                        else
                            *reinterpret_cast<float2 *>(p.Hf + (size_t)pp * p.ldo + i) = make_float2(h0, h1);
                    }
                } else {
                    const size_t orow = p.perm ? (size_t)p.perm[pp] : (size_t)pp;
#pragma unroll
                    for (int j = 0; j < NA / 4; j++) {
                        const int c = n * cfg::BN + 8 * j + 2 * (lane & 3);
                        if (c >= wrows) continue; /* the last tile's rows past rows_p */
                        *reinterpret_cast<float2 *>(p.Y + orow * p.ldo + c) =
                            make_float2(ab[4 * j + 2 * h] * s2a, ab[4 * j + 2 * h + 1] * s2a);
                    }
                }
            }
    }
}

/* ------------------------------------------------------- tensor maps */

/* The map of one projection: [n experts][rows_p rows][row] with row the
 * weight row's bytes (FP8 / FP4 codes, uint8) or its kp bf16 values; box:
 * one k step (64 columns: 32 bytes of FP4, 64 of FP8, 64 bf16) x 128 rows
 * x 1 expert. BF16 lands in the operand layout itself (SWIZZLE_128B: chunk
 * c of row r at c ^ (r % 8)); codes land row after row, as the cp.async
 * path lays them out. */
static cudaError_t wg_weight_map(wg_encode_fn enc, const dweights &w, CUtensorMap *m, int box_rows = 128) {
    if (w.n < 1 || !w.data || ((uintptr_t)w.data & 15u) || (w.dstride & 15)) return cudaErrorInvalidValue;
    const bool bf = w.fmt == DF_BF16;
    const cuuint64_t row = w.fmt == DF_BF16 ? (cuuint64_t)w.kp : w.fmt == DF_FP8 ? (cuuint64_t)w.kp : (cuuint64_t)w.kp / 2;
    const cuuint64_t row_b = bf ? row * 2 : row;
    if (row_b % 16) return cudaErrorInvalidValue;
    const cuuint64_t dims[3] = {row, (cuuint64_t)w.rows_p, (cuuint64_t)w.n};
    const cuuint64_t strides[2] = {row_b, (cuuint64_t)w.dstride};
    const cuuint32_t box[3] = {(cuuint32_t)(w.fmt == DF_MXFP4 || w.fmt == DF_NVFP4 ? 32 : 64), (cuuint32_t)box_rows, 1};
    const cuuint32_t estr[3] = {1, 1, 1};
    CUresult r = enc(m, bf ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, (void *)w.data, dims,
                     strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     bf ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

/* Down's activation rows A [n_pos][lda] bf16 in sorted order; box 64
 * columns x 128 rows into the operand layout (SWIZZLE_128B). Rows past
 * n_pos land as zeros; rows of the next expert inside a tile's box land too
 * and are never stored (a row's output depends on its own row only). */
static cudaError_t wg_act_map(wg_encode_fn enc, const __nv_bfloat16 *A, int lda, int n_pos, CUtensorMap *m) {
    if (!A || ((uintptr_t)A & 15u) || ((size_t)lda * 2) % 16) return cudaErrorInvalidValue;
    const cuuint64_t dims[2] = {(cuuint64_t)lda, (cuuint64_t)n_pos};
    const cuuint64_t strides[1] = {(cuuint64_t)lda * 2};
    const cuuint32_t box[2] = {64, 128};
    const cuuint32_t estr[2] = {1, 1};
    CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)A, dims, strides, box, estr,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <bool GATEUP>
static cudaError_t wg_launch(wg_args &a, int fmt, int max_items, int n_sm, bool tma, bool cdec, cudaStream_t s,
                             bool m2 = false) {
    static void (*const kc[4])(wg_args) = {k_wg<DF_BF16, GATEUP, false, false>, k_wg<DF_FP8, GATEUP, false, false>,
                                           k_wg<DF_MXFP4, GATEUP, false, false>, k_wg<DF_NVFP4, GATEUP, false, false>};
    static void (*const kt[4])(wg_args) = {k_wg<DF_BF16, GATEUP, true, false>, k_wg<DF_FP8, GATEUP, true, false>,
                                           k_wg<DF_MXFP4, GATEUP, true, false>, k_wg<DF_NVFP4, GATEUP, true, false>};
    /* consumer decode; BF16 weights need none (the producer's kernel) */
    static void (*const kd[4])(wg_args) = {k_wg<DF_BF16, GATEUP, true, false>, k_wg<DF_FP8, GATEUP, true, true>,
                                           k_wg<DF_MXFP4, GATEUP, true, true>, k_wg<DF_NVFP4, GATEUP, true, true>};
    static const int smem[4] = {wg_cfg<DF_BF16>::SMEM, wg_cfg<DF_FP8>::SMEM, wg_cfg<DF_MXFP4>::SMEM,
                                wg_cfg<DF_NVFP4>::SMEM};
    if (fmt < 0 || fmt > DF_NVFP4 || (cdec && !tma) || (m2 && (!tma || (fmt != DF_BF16 && !cdec))))
        return cudaErrorInvalidValue;
    int grid = max_items < n_sm ? max_items : n_sm;
    if (grid < 1) return cudaSuccess;
    if (tma) {
        if (GATEUP && a.perm) return cudaErrorInvalidValue; /* TMA reads rows in order: pre-gather them */
        wg_encode_fn enc = nullptr;
        cudaError_t e = wg_encoder(&enc);
        const int box = m2 && GATEUP ? 64 : 128; /* 256-token gate/up: 64 gate rows + the same 64 up rows */
        if (e == cudaSuccess) e = wg_weight_map(enc, a.wa, &a.tw[0], box);
        if (e == cudaSuccess && GATEUP) e = wg_weight_map(enc, a.wb, &a.tw[1], box);
        if (e == cudaSuccess) e = wg_act_map(enc, a.A, a.lda, a.n_pos, &a.ta);
        if (e != cudaSuccess) return e;
    }
    if (m2) {
        /* the 256-token tile: BF16 as loaded, FP8 / FP4 decoded by the consumers */
        static void (*const k2[4])(wg_args) = {k_wg<DF_BF16, GATEUP, true, false, true>,
                                               k_wg<DF_FP8, GATEUP, true, true, true>,
                                               k_wg<DF_MXFP4, GATEUP, true, true, true>,
                                               k_wg<DF_NVFP4, GATEUP, true, true, true>};
        static const int smem2[4] = {wg_cfg<DF_BF16, true>::SMEM, wg_cfg<DF_FP8, true>::SMEM,
                                     wg_cfg<DF_MXFP4, true>::SMEM, wg_cfg<DF_NVFP4, true>::SMEM};
        return moe_launch_fmt(fmt, k2, dim3(grid), WG_THREADS, (size_t)smem2[fmt], s, a);
    }
    return moe_launch_fmt(fmt, cdec ? kd : tma ? kt : kc, dim3(grid), WG_THREADS, (size_t)smem[fmt], s, a);
}

cudaError_t moe_k_gateup_wg(const dweights *w1, const dweights *w3, const __nv_bfloat16 *Xb, int Hp,
                            const int32_t *perm, int C, const mma_tile *tiles, const int32_t *n_tiles, int max_tiles,
                            int n_pos, float limit, __nv_bfloat16 *Hb, float *Hf, int Ip, int n_sm, bool tma,
                            bool cdec, cudaStream_t s, bool t256) {
    if (n_pos == 0 || max_tiles == 0) return cudaSuccess;
    if (w1->kp != Hp || Hp % WG_BK || Ip % 64) return cudaErrorInvalidValue;
    if (w3->fmt != w1->fmt || w3->kp != w1->kp || w3->rows_p != w1->rows_p) return cudaErrorInvalidValue;
    wg_args a;
    memset(&a, 0, sizeof a);
    a.wa = *w1;
    a.wb = *w3;
    a.A = Xb;
    a.lda = Hp;
    a.perm = perm;
    a.C = C;
    a.tiles = tiles;
    a.n_tiles = n_tiles;
    a.n_pos = n_pos;
    a.NT = t256 ? Ip / 64 : (Ip + 127) / 128;
    a.limit = limit;
    a.Hb = Hb;
    a.Hf = Hf;
    a.ldo = Ip;
    return wg_launch<true>(a, w1->fmt, max_tiles * a.NT, n_sm, tma, cdec, s, t256);
}

cudaError_t moe_k_down_wg(const dweights *w2, const __nv_bfloat16 *Hb, int Ip, const int32_t *perm,
                          const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float *Y, int Yp,
                          int n_sm, bool tma, bool cdec, cudaStream_t s, bool t256) {
    if (n_pos == 0 || max_tiles == 0) return cudaSuccess;
    if (w2->kp != Ip || Ip % WG_BK || w2->rows_p % 128) return cudaErrorInvalidValue;
    wg_args a;
    memset(&a, 0, sizeof a);
    a.wa = *w2;
    a.A = Hb;
    a.lda = Ip;
    a.perm = perm;
    a.tiles = tiles;
    a.n_tiles = n_tiles;
    a.n_pos = n_pos;
    a.NT = t256 ? w2->rows_p / 128 : (w2->rows_p + WG_BN - 1) / WG_BN;
    a.Y = Y;
    a.ldo = Yp;
    return wg_launch<false>(a, w2->fmt, max_tiles * a.NT, n_sm, tma, cdec, s, t256);
}

/* Xs [p] = X [perm[p] / C] for the n_pos sorted positions, rows of ld bf16
 * (a multiple of 8): one block per row, 16-byte copies. */
__global__ void __launch_bounds__(128) k_wg_gather(const __nv_bfloat16 *__restrict__ X, int ld,
                                                   const int32_t *__restrict__ perm, int C,
                                                   __nv_bfloat16 *__restrict__ Xs) {
    const size_t pp = blockIdx.x;
    const uint4 *src = reinterpret_cast<const uint4 *>(X + (size_t)(perm[pp] / C) * ld);
    uint4 *dst = reinterpret_cast<uint4 *>(Xs + pp * ld);
    for (int c = threadIdx.x; c < ld / 8; c += blockDim.x) dst[c] = src[c];
}

cudaError_t moe_k_gather_rows(const __nv_bfloat16 *X, int ld, const int32_t *perm, int C, int n_pos,
                              __nv_bfloat16 *Xs, cudaStream_t s) {
    if (n_pos == 0) return cudaSuccess;
    if (ld % 8 || C < 1) return cudaErrorInvalidValue;
    k_wg_gather<<<n_pos, 128, 0, s>>>(X, ld, perm, C, Xs);
    return cudaGetLastError();
}

/* ------------------------------------------------------------ self-test */

/* Every byte of codes (64 words of 4) under every scale code: block x =
 * scale code, y = 0 (E8M0) or 1 (UE4M3); out [2][256][64][4] bf16 pairs. */
__global__ void k_wg_dec_test(uint32_t *out) {
    const uint32_t s = blockIdx.x, f = blockIdx.y, t = threadIdx.x;
    const uint32_t w = (4 * t) | ((4 * t + 1) << 8) | ((4 * t + 2) << 16) | ((4 * t + 3) << 24);
    uint32_t o[4];
    if (f)
        cuda_wg_fp4_mul(w, cuda_wg_nv_mult(s), o);
    else
        cuda_wg_fp4_e8m0(w, s, o);
    for (int j = 0; j < 4; j++) out[((f * 256 + s) * 64 + t) * 4 + j] = o[j];
}

namespace {

struct st_log {
    char *msg;
    size_t n, used;
    void put(const char *fmt, ...) __attribute__((format(printf, 2, 3))) {
        if (!msg || used + 1 >= n) return;
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(msg + used, n - used, fmt, ap);
        va_end(ap);
        if (k > 0) used = used + (size_t)k < n ? used + (size_t)k : n - 1;
    }
};

moe_st_rng st_rng = {0x9E3779B97F4A7C15ull};
uint32_t st_next() { return st_rng.next(); }
uint16_t st_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)(u >> 16); /* callers pass bf16-exact values */
}
float st_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

int st_decoders(st_log &L) {
    uint32_t *d = nullptr;
    const size_t n = 2 * 256 * 64 * 4;
    std::vector<uint32_t> h(n);
    cudaError_t e = cudaMalloc(&d, n * 4);
    if (e == cudaSuccess) {
        k_wg_dec_test<<<dim3(256, 2), 64>>>(d);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost);
    cudaFree(d);
    if (e != cudaSuccess) {
        L.put("decoder test: CUDA error %s\n", cudaGetErrorString(e));
        return -1;
    }
    int bad[2] = {0, 0};
    for (int f = 0; f < 2; f++)
        for (int s = 0; s < 256; s++)
            for (int t = 0; t < 64; t++)
                for (int k = 0; k < 8; k++) {
                    const uint32_t byte = (uint32_t)(4 * t + k / 2), code = k & 1 ? byte >> 4 : byte & 15;
                    /* NVFP4's decode carries 2^-8 (undone in the epilogue): exact in float */
                    const float want = moe_e2m1_to_f32((uint8_t)code) *
                                       (f ? moe_ue4m3_to_f32((uint8_t)s) * 0x1p-8f : moe_e8m0_to_f32((uint8_t)s));
                    const uint32_t o = h[((size_t)(f * 256 + s) * 64 + t) * 4 + k / 2];
                    const uint32_t got = k & 1 ? o >> 16 : o & 0xFFFFu;
                    uint32_t wb;
                    memcpy(&wb, &want, 4);
                    const bool ok = want != want ? ((got & 0x7F80u) == 0x7F80u && (got & 0x7Fu))
                                                 : ((wb & 0xFFFFu) == 0 && got == wb >> 16);
                    if (!ok && bad[f]++ < 4)
                        L.put("  %s scale 0x%02x code 0x%x: got bf16 0x%04x (%g), want %g\n", f ? "UE4M3" : "E8M0", s,
                              code, got, (double)st_f32(got << 16), (double)want);
                }
    L.put("decoder E2M1 x E8M0 (4096 values x 256 scales): %d wrong\n", bad[0]);
    L.put("decoder E2M1 x UE4M3 (4096 values x 256 scales): %d wrong\n", bad[1]);
    return (bad[0] > 0) + (bad[1] > 0);
}

/* The kernel variants the self-test runs: cp.async loads with the
 * producer's decode (path wgmma-cp), TMA with the producer's decode
 * (wgmma-pd), TMA with the consumers' decode (wgmma), and the 256-token
 * tile of BF16 weights (TMA; 180 rows: one tile whose second warpgroup
 * holds 52 rows, its second m64 block none). */
enum { ST_CP, ST_TMA_PD, ST_TMA_CD, ST_TMA_256 };

/* One down-projection GEMM Y [R, NP] = A [R, K] W [NP, K]^T through
 * moe_k_down_wg on one expert without a permutation. pattern: 0 A = 1,
 * 1 W = 1, 2 both random (BF16 weights); fmt MXFP4 / NVFP4: random codes
 * and scales, random A; FP8: random E4M3 codes of magnitude in [2^-1, 30]
 * and power-of-two tile scales 2^-1 .. 2^1. Exact arithmetic: every weight
 * a multiple of 2^-5 (FP8 2^-1 x 2^-3 x 2^-1; MXFP4 0.5 x 2^-3 at its
 * scales 2^-3 .. 2^3; NVFP4 0.5 x 0.25), every partial sum of products by
 * activations of |a| <= 4 below 2^16 (192 x 4 x 60): at most 21
 * significant bits, exact in fp32 whatever the order or the tensor core's
 * truncation; the result must match the float64 sum bit for bit. Shapes:
 * K = 192 (three k steps), 180 token rows (the second token tile has 52:
 * its second consumer warpgroup has no row and only decodes), 384 weight
 * rows (a full and a half weight tile): 4 items over a grid of min(4, n_sm)
 * blocks; n_sm = 1 walks them all in one block, so a step's next B belongs
 * to the next item and the load ring wraps. */
int st_gemm(st_log &L, const char *name0, int fmt, int pattern, int var, int n_sm) {
    char name[160];
    snprintf(name, sizeof name, "%s, %s%s", name0,
             var == ST_CP       ? "cp.async loads"
             : var == ST_TMA_PD ? "TMA loads, producer decode"
             : var == ST_TMA_CD ? "TMA loads, consumer decode"
                                : "TMA loads, 256-token tile",
             n_sm == 1 ? ", one block" : "");
    const bool t256 = var == ST_TMA_256, tma = var != ST_CP, cdec = var == ST_TMA_CD || (t256 && fmt != DF_BF16);
    const int R = 180, K = 192, NP = 384, bm = t256 ? 256 : 128;
    std::vector<uint16_t> A((size_t)R * K);
    std::vector<double> Av((size_t)R * K), Wv((size_t)NP * K);
    for (size_t i = 0; i < A.size(); i++) {
        float v = pattern == 0 && fmt == DF_BF16 ? 1.0f : (float)((int)(st_next() % 9) - 4);
        A[i] = st_bf16(v);
        Av[i] = v;
    }
    std::vector<uint8_t> data, scale;
    if (fmt == DF_FP8) {
        /* E4M3 with exponent field 6 .. 11: 2^-1 .. 2^4 x (1 + m / 8) */
        data.resize((size_t)NP * K);
        for (size_t i = 0; i < data.size(); i++)
            data[i] = (uint8_t)((st_next() & 0x80u) | ((6u + st_next() % 6u) << 3) | (st_next() & 7u));
        scale.resize((size_t)(NP / 128) * ((K + 127) / 128) * 4);
        for (size_t i = 0; i < scale.size() / 4; i++) {
            const float v = (float)(0.5 * (double)(1u << (st_next() % 3)));
            memcpy(&scale[4 * i], &v, 4);
        }
        for (int r = 0; r < NP; r++)
            for (int k = 0; k < K; k++) {
                float sc;
                memcpy(&sc, &scale[4 * ((size_t)(r / 128) * ((K + 127) / 128) + k / 128)], 4);
                Wv[(size_t)r * K + k] = (double)moe_fp8_e4m3_to_f32(data[(size_t)r * K + k]) * sc;
            }
    } else if (fmt == DF_BF16) {
        data.resize((size_t)NP * K * 2);
        for (size_t i = 0; i < (size_t)NP * K; i++) {
            float v = pattern == 1 ? 1.0f : (float)((int)(st_next() % 9) - 4);
            uint16_t b = st_bf16(v);
            memcpy(&data[2 * i], &b, 2);
            Wv[i] = v;
        }
    } else {
        const int blk = fmt == DF_MXFP4 ? 32 : 16;
        data.resize((size_t)NP * K / 2);
        scale.resize((size_t)NP * K / blk);
        static const uint8_t ue[5] = {0x28, 0x30, 0x38, 0x3C, 0x40}; /* 0.25 0.5 1 1.5 2 */
        for (size_t i = 0; i < scale.size(); i++)
            scale[i] = fmt == DF_MXFP4 ? (uint8_t)(124 + st_next() % 7) : ue[st_next() % 5];
        for (size_t i = 0; i < data.size(); i++) data[i] = (uint8_t)st_next();
        for (int r = 0; r < NP; r++)
            for (int k = 0; k < K; k++) {
                uint8_t b = data[((size_t)r * K + k) / 2], c = k & 1 ? b >> 4 : b & 15;
                uint8_t sc = scale[(size_t)r * (K / blk) + k / blk];
                Wv[(size_t)r * K + k] =
                    (double)moe_e2m1_to_f32(c) * (fmt == DF_MXFP4 ? moe_e8m0_to_f32(sc) : moe_ue4m3_to_f32(sc));
            }
    }
    void *dA = nullptr, *dW = nullptr, *dS = nullptr, *dY = nullptr, *d2 = nullptr;
    const float one = 1.0f;
    cudaError_t e = cudaMalloc(&dA, A.size() * 2);
    if (e == cudaSuccess) e = cudaMalloc(&dW, data.size());
    if (e == cudaSuccess) e = cudaMalloc(&dS, scale.size() + 16);
    if (e == cudaSuccess) e = cudaMalloc(&dY, (size_t)R * NP * 4);
    if (e == cudaSuccess) e = cudaMalloc(&d2, 4);
    if (e == cudaSuccess) e = cudaMemcpy(dA, A.data(), A.size() * 2, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(dW, data.data(), data.size(), cudaMemcpyHostToDevice);
    if (e == cudaSuccess && !scale.empty()) e = cudaMemcpy(dS, scale.data(), scale.size(), cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(d2, &one, 4, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemset(dY, 0xFF, (size_t)R * NP * 4); /* NaN: unwritten outputs show */
    dweights w;
    memset(&w, 0, sizeof w);
    w.fmt = fmt;
    w.rows_p = NP;
    w.kp = K;
    w.n = 1;
    w.dstride = (long long)data.size();
    w.sstride = (long long)scale.size();
    w.data = (const uint8_t *)dW;
    w.scale = fmt == DF_BF16 ? nullptr : (const uint8_t *)dS;
    w.scale2 = (const float *)d2;
    if (e == cudaSuccess)
        e = moe_k_down_wg(&w, (const __nv_bfloat16 *)dA, K, nullptr, nullptr, nullptr, (R + bm - 1) / bm, R,
                          (float *)dY, NP, n_sm, tma, cdec, 0, t256);
    std::vector<float> Y((size_t)R * NP);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpy(Y.data(), dY, Y.size() * 4, cudaMemcpyDeviceToHost);
    cudaFree(dA);
    cudaFree(dW);
    cudaFree(dS);
    cudaFree(dY);
    cudaFree(d2);
    if (e != cudaSuccess) {
        L.put("%s: CUDA error %s\n", name, cudaGetErrorString(e));
        return 1;
    }
    std::vector<double> ref((size_t)R * NP);
    for (int m = 0; m < R; m++)
        for (int c = 0; c < NP; c++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += Av[(size_t)m * K + k] * Wv[(size_t)c * K + k];
            ref[(size_t)m * NP + c] = s;
        }
    int bad = 0;
    for (int m = 0; m < R; m++)
        for (int c = 0; c < NP; c++) {
            double g = Y[(size_t)m * NP + c], r = ref[(size_t)m * NP + c];
            if (g == r) continue;
            if (bad++ >= 3) continue;
            int fm = -1, fc = -1;
            for (size_t q = 0; q < ref.size() && fm < 0; q++)
                if (ref[q] == g) {
                    fm = (int)(q / NP);
                    fc = (int)(q % NP);
                }
            L.put("  %s: Y[%d][%d] = %g, want %g", name, m, c, g, r);
            if (fm >= 0) L.put(" (the value of Y[%d][%d])", fm, fc);
            L.put("\n");
        }
    L.put("%s: %d of %d outputs wrong\n", name, bad, R * NP);
    return bad > 0;
}

} // namespace

extern "C" int moe_cuda_wg_selftest(char *msg, size_t n) {
    st_log L{msg, n, 0};
    if (msg && n) msg[0] = 0;
    int n_sm = 0, dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        L.put("no device\n");
        return -1;
    }
    int fails = st_decoders(L);
    if (fails < 0) return -1;
    for (int var = ST_CP; var <= ST_TMA_CD; var++) {
        /* BF16 weights have no decode: wgmma and wgmma-pd are one kernel */
        if (var != ST_TMA_CD) {
            fails += st_gemm(L, "bf16 GEMM, A = 1 (weight rows, N mapping)", DF_BF16, 0, var, n_sm);
            fails += st_gemm(L, "bf16 GEMM, W = 1 (token rows, M mapping)", DF_BF16, 1, var, n_sm);
            fails += st_gemm(L, "bf16 GEMM, random (k swizzle)", DF_BF16, 2, var, n_sm);
        }
        /* the consumers' decode also in one block (across items, the ring wrapping) */
        for (int g = 0; g < (var == ST_TMA_CD ? 2 : 1); g++) {
            fails += st_gemm(L, "fp8 GEMM, random", DF_FP8, 2, var, g ? 1 : n_sm);
            fails += st_gemm(L, "mxfp4 GEMM, random", DF_MXFP4, 2, var, g ? 1 : n_sm);
            fails += st_gemm(L, "nvfp4 GEMM, random", DF_NVFP4, 2, var, g ? 1 : n_sm);
        }
    }
    /* the 256-token tile (FP8 / FP4: the consumers' half-row decode), also
     * in one block (3 weight tiles: the ring wraps) */
    for (int g = 0; g < 2; g++) {
        for (int pat = 0; pat < 3; pat++)
            fails += st_gemm(L, pat == 0 ? "bf16 GEMM, A = 1" : pat == 1 ? "bf16 GEMM, W = 1" : "bf16 GEMM, random",
                             DF_BF16, pat, ST_TMA_256, g ? 1 : n_sm);
        fails += st_gemm(L, "fp8 GEMM, random", DF_FP8, 2, ST_TMA_256, g ? 1 : n_sm);
        fails += st_gemm(L, "mxfp4 GEMM, random", DF_MXFP4, 2, ST_TMA_256, g ? 1 : n_sm);
        fails += st_gemm(L, "nvfp4 GEMM, random", DF_NVFP4, 2, ST_TMA_256, g ? 1 : n_sm);
    }
    return fails;
}
