/*
 * Grouped expert GEMMs with FP8 activations on Hopper's FP8 tensor cores
 * (wgmma ... .f32.e4m3.e4m3, "QGMMA" in the SASS): the large-T path of FP8
 * weights (E4M3 codes, one fp32 scale per 128 x 128 weight tile, as the
 * upload holds them) with FP8 activations (`--act fp8`: E4M3 codes with one
 * power-of-two scale per token per 128 columns; `fp8-f32scale`: an fp32
 * scale amax / 448), MOE_CUDA_PATH_WGMMA and AUTO. The bf16-operand kernel
 * of cuda_wgmma.cu (activations rounded through E4M3, then multiplied as
 * bf16: MOE_CUDA_PATH_WGMMA_BF16) stays selectable for the A/B.
 *
 * What it computes. For an output (token row t, weight row r):
 *   y = sum over k blocks kb of (s_a[t][kb] x s_w[r / 128][kb]) x
 *       sum over the 128 columns c of kb of code_a[t][c] x code_w[r][c]
 * The inner sum is one k block on the tensor cores (four k32 wgmmas into
 * fresh fp32 registers); the outer sum is an fp32 FMA per k block in the
 * consumer's registers (the "promotion", DeepGEMM's recipe):
 *   acc = fma(part, s_a x s_w, acc).
 * Hopper's FP8 wgmma does not accumulate at fp32 precision: its adder keeps
 * about 14 significant bits (the DeepSeek-V3 report, section 3.3.2), so a
 * long K in the tensor core loses the low bits of every partial sum; one k
 * block of 128 products bounds that loss to one block, and the promotion's
 * FMA is fp32. Measured here (the self-test, random E4M3 codes): the worst
 * error of an output is 2^-10.1 of the sum of its products' magnitudes;
 * on V4-Flash-shaped FP8 layers the routed output moves by 3.6e-3 - 3.9e-3
 * relative against the float64 reference, where the bf16-operand kernel
 * (exact operands there too, fp32 accumulator) moves by 4e-5
 * (tests/cuda/test-cuda.c, TOL_FP8_QGMMA). The activation codes and scales are exactly those of the CPU
 * reference's rounding (moe_fp8_act_quant_row, src/formats/act.c; on the
 * GPU warp_act128 / fp8_block_scale of cuda_device.cuh); the weights are the
 * checkpoint's codes and tile scales, not a bf16 rounding of their product
 * (the bf16 kernel rounds e4m3 x scale to bf16 once per weight).
 *
 * Block: three warpgroups, one block per SM, persistent; a work item is a
 * tile of 128 token rows (one expert's sorted positions, moe_k_sort) x 256
 * weight rows, in the order of cuda_wgmma.cu's wg_item (weight tile
 * fastest); block b takes items b, b + grid, ...: equal-sized items, so
 * skewed and empty experts spread evenly.
 *  - warpgroup 0, the producer: `setmaxnreg` down to 40 registers; thread 0
 *    issues, per k block of 128 columns, the three TMA boxes into a ring of
 *    R = 4 slots of 48 KB: the 128 activation rows (uint8 codes, 128 x 128
 *    bytes) and the 256 weight rows (two boxes of 128 rows; gate/up: 128
 *    rows of w1 then the same 128 rows of w3; down: 256 rows of w2, the
 *    second box not issued when it lies past the weight's rows), completing
 *    on the slot's "full" mbarrier (expect-tx). Rows past the tensors'
 *    extents and columns past kp land as zeros (a last k block of 64
 *    columns multiplies zeros).
 *  - warpgroups 1 and 2, the consumers (232 registers): token rows 0-63
 *    and 64-127 of the tile. Per k block and per half h of the 256 weight
 *    rows: four wgmma.m64n128k32 into part [64], wait, then 64 FMAs of
 *    the promotion into acc [128] (acc [64 h ..] holds half h). 128 + 64
 *    registers: the n256 tile cannot keep a second full 128-register
 *    accumulator, so the halves run one after the other and the other
 *    consumer warpgroup's MMAs fill the tensor pipe meanwhile. The scales:
 *    two activation scales per thread (its two token rows) and the two
 *    weight-tile scales of the block, read from global (L1) before the
 *    wait. A consumer whose 64 rows hold no token skips its MMAs; the half
 *    past the weight rows is skipped too. Then "empty" (256 arrivals).
 *  - epilogue, gate/up: gate column n (< 128 of the item) and up column n
 *    sit in the same thread (acc [4 j + q] and acc [4 (j + 16) + q]): the
 *    SwiGLU with clamp runs in registers, and the item's 128 gate rows are
 *    one whole 128-column block of h (item n covers h columns 128 n ..
 *    128 n + 127), so the epilogue quantizes h for down itself: a token
 *    row's 128 values sit in the four threads of a quad (32 each); amax by
 *    two xor shuffles, the scale by fp8_block_scale, the codes by the same
 *    conversion as fp8_round. No fp32 H round trip and no rounding kernel.
 *    Columns past Ip count as zero (as warp_act128's) and are not stored.
 *    down: acc x the NVFP4-style per-tensor scale (1 for FP8) per
 *    assignment row (perm), combined by moe_k_combine (routed weight and
 *    the contract's multipliers there, as on every path).
 *
 * Operand layout: both operands K-major, 128-byte swizzle (TMA
 * SWIZZLE_128B): row r of a tile is one k block of 128 E4M3 codes = 128
 * bytes at r x 128, its 16-byte chunk c at c ^ (r % 8); tiles 1024-byte
 * aligned; descriptor as cuda_wg.cuh's wg_desc; the k32 sub-steps advance
 * the start address by 32 bytes.
 *
 * Invariants:
 *  1. A row's output depends on its own activations and the weights only
 *     (fixed k order, fixed instruction shapes, the promotion in k order):
 *     bit-identical reruns, outputs independent of the batch.
 *  2. Rows past an expert's segment are never stored (they hold the next
 *     expert's rows or zeros, which by 1 touch no stored row).
 *  3. Ring: load j waits "empty" of slot j % R with parity ((j / R) & 1) ^ 1
 *     (the 256 consumer arrivals of j - R), arrives with expect-tx on "full";
 *     consumers wait "full" with parity (j / R) & 1.
 */
#include "cuda/cuda_wg.cuh"
#include "cuda/cuda_selftest.h"

#include <float.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <vector>

namespace {

constexpr int QG_BM = 128;   /* token rows per tile */
constexpr int QG_BN = 256;   /* weight rows per tile */
constexpr int QG_BK = 128;   /* columns per k block: one 128-byte swizzle row of E4M3 */
constexpr int QG_THREADS = 384;
constexpr int QG_A = QG_BM * 128;        /* activation codes of a slot */
constexpr int QG_SLOT = QG_A + QG_BN * 128;
constexpr int QG_R = 4;                  /* ring slots: 192 KB */
constexpr int QG_BARS = QG_R * QG_SLOT;
constexpr int QG_SMEM = QG_BARS + 2 * QG_R * 8 + 1024; /* full [R], empty [R]; slack to align the base */
static_assert(QG_SLOT % 1024 == 0, "operand tiles must stay 1024-byte aligned");
static_assert(QG_SMEM <= 232448, "more shared memory than a Hopper block has");

/* D [64 x 128] (+)= A [64 x 32] B [128 x 32]^T, E4M3 x E4M3 with fp32
 * accumulation (Hopper's reduced-precision FP8 accumulator: see the
 * header), both operands K-major from shared memory (accumulate = 0:
 * D = A B^T). */
__device__ __forceinline__ void qgmma_m64n128k32(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}

} // namespace

struct qg_args {
    CUtensorMap tw[2];     /* the weight maps (gate/up: w1, w3; down: w2 in tw[0]), uint8 [n][rows_p][kp] */
    CUtensorMap ta;        /* the activation codes, uint8 [n_pos][kp], sorted order */
    dweights wa, wb;       /* gate/up: w1, w3; down: w2 (wb unused) */
    const float *as;       /* activation scales [n_pos][KB] */
    int KB;                /* k blocks: ceil(kp / 128) */
    const int32_t *perm;   /* down: sorted position -> assignment row of Y, or NULL */
    const mma_tile *tiles; /* or NULL: one expert (e = 0), tile m = positions 128 m .. */
    const int32_t *n_tiles;
    int n_pos;
    int NT;                /* weight tiles per token tile */
    float limit;
    int act;               /* ACT_FP8_POW2 / ACT_FP8_F32: h's scales (gate/up) */
    uint8_t *Hq;           /* gate/up out: h codes [n_pos][ldo] */
    float *Hs;             /* gate/up out: h scales [n_pos][NT] */
    float *Y;              /* down out [rows, ldo] */
    int ldo;
};

static __device__ __forceinline__ void qg_tile(const qg_args &p, int m, int &e, int &p0, int &p_end) {
    if (p.tiles) {
        const mma_tile tl = p.tiles[m];
        e = tl.e;
        p0 = tl.p0;
        p_end = tl.p_end;
    } else {
        e = 0;
        p0 = m * QG_BM;
        p_end = p.n_pos;
    }
}

static __device__ __forceinline__ uint32_t qg_code(float x, float sc) {
    return (uint32_t)__nv_cvt_float_to_fp8(x / sc, __NV_SATFINITE, __NV_E4M3); /* as fp8_round */
}

template <bool GATEUP>
__global__ void __launch_bounds__(QG_THREADS, 1) k_qg(const __grid_constant__ qg_args p) {
    extern __shared__ uint8_t qg_smem[];
    const uint32_t base = (sa(qg_smem) + 1023u) & ~1023u;
    const uint32_t full = base + QG_BARS, empty = full + 8 * QG_R;
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < QG_R; s++) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tw[0])) : "memory");
        if (GATEUP) asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tw[1])) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.ta)) : "memory");
    }
    __syncthreads();
    const int n_m = p.tiles ? *p.n_tiles : (p.n_pos + QG_BM - 1) / QG_BM;
    const int items = n_m * p.NT, KB = p.KB;
    const int wrows = p.wa.rows_p;

    if (tid < 128) {
        /* ------------------------------------------------------ producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
        if (tid != 0) return;
        int j = 0;
        for (int w = blockIdx.x; w < items; w += gridDim.x) {
            const int m = w / p.NT, n = w - m * p.NT; /* wg_item with WG_GROUP_M = 1 */
            int e, p0, p_end;
            qg_tile(p, m, e, p0, p_end);
            const int r0 = GATEUP ? n * 128 : n * 256, r1 = GATEUP ? n * 128 : n * 256 + 128;
            const bool h1 = r1 < wrows;
            for (int kb = 0; kb < KB; kb++, j++) {
                const int s = j % QG_R;
                const uint32_t slot = base + (uint32_t)(s * QG_SLOT), fb = full + 8 * s;
                mbar_wait(empty + 8 * s, ((uint32_t)(j / QG_R) & 1u) ^ 1u);
                mbar_expect_tx(fb, (uint32_t)(QG_A + (1 + h1) * 128 * 128));
                tma2d(slot, &p.ta, kb * QG_BK, p0, fb);
                tma3d(slot + QG_A, &p.tw[0], kb * QG_BK, r0, e, fb);
                if (h1) tma3d(slot + QG_A + 128 * 128, &p.tw[GATEUP ? 1 : 0], kb * QG_BK, r1, e, fb);
            }
        }
        return;
    }

    /* ---------------------------------------------------------- consumers */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
    const int ct = tid - 128, wg = ct >> 7, wi = (ct >> 5) & 3, lane = ct & 31;
    const int tr = 64 * wg + 16 * wi + (lane >> 2); /* this thread's tile rows: tr and tr + 8 */
    float acc[128], part[64];
    int j = 0;
    for (int w = blockIdx.x; w < items; w += gridDim.x) {
        const int m = w / p.NT, n = w - m * p.NT;
        int e, p0, p_end;
        qg_tile(p, m, e, p0, p_end);
        const bool active = p0 + 64 * wg < p_end;
        const int r0 = GATEUP ? n * 128 : n * 256, r1 = GATEUP ? n * 128 : n * 256 + 128;
        const bool h1 = r1 < wrows;
        /* activation scale rows of the thread's two token rows (clamped:
         * rows past n_pos are never stored) and the two weight-tile scale
         * rows of the item */
        const int q0 = min(p0 + tr, p.n_pos - 1), q1 = min(p0 + tr + 8, p.n_pos - 1);
        const float *as0 = p.as + (size_t)q0 * KB, *as1 = p.as + (size_t)q1 * KB;
        const float *ws0 = reinterpret_cast<const float *>(scale_row<DF_FP8>(p.wa, e, r0));
        const float *ws1 = reinterpret_cast<const float *>(scale_row<DF_FP8>(GATEUP ? p.wb : p.wa, e, h1 ? r1 : r0));
#pragma unroll
        for (int i = 0; i < 128; i++) acc[i] = 0.0f;
        for (int kb = 0; kb < KB; kb++, j++) {
            const int s = j % QG_R;
            const uint32_t slot = base + (uint32_t)(s * QG_SLOT);
            const float sa0 = __ldg(as0 + kb), sa1 = __ldg(as1 + kb);
            const float sw0 = __ldg(ws0 + kb), sw1 = __ldg(ws1 + kb);
            mbar_wait(full + 8 * s, (uint32_t)(j / QG_R) & 1u);
            if (active) {
                const uint64_t da = wg_desc(slot + (uint32_t)(wg * 64 * 128));
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    if (h == 1 && !h1) break;
                    /* issue, wait and promote in one block (C7518: ptxas
                     * serializes a wgmma whose issue and wait sit in
                     * different conditional blocks) */
                    const uint64_t db = wg_desc(slot + (uint32_t)(QG_A + h * 128 * 128));
                    wg_fence_acc(part);
                    wg_fence();
                    qgmma_m64n128k32(part, da, db, 0);
                    qgmma_m64n128k32(part, da + 2, db + 2, 1);
                    qgmma_m64n128k32(part, da + 4, db + 4, 1);
                    qgmma_m64n128k32(part, da + 6, db + 6, 1);
                    wg_commit();
                    wg_wait0();
                    wg_fence_acc(part);
                    const float sw = h ? sw1 : sw0, s0 = sa0 * sw, s1 = sa1 * sw;
#pragma unroll
                    for (int i = 0; i < 64; i++) acc[64 * h + i] = fmaf(part[i], (i & 2) ? s1 : s0, acc[64 * h + i]);
                }
            }
            mbar_arrive(empty + 8 * s);
        }
        if (!active) continue;
        /* accumulator (j, q): row tr + 8 (q >> 1), column 8 j + 2 (lane % 4) + (q & 1) */
        const float s2a = p.wa.scale2 ? p.wa.scale2[e] : 1.0f;
        const float s2b = GATEUP && p.wb.scale2 ? p.wb.scale2[e] : 1.0f;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int pp = p0 + tr + 8 * hh;
            if (GATEUP) {
                /* h's 128-column block n of row pp: 32 values here, 128 in
                 * the quad; every lane takes part in the shuffles */
                float v[32], amax = 0.0f;
                int bad = 0;
#pragma unroll
                for (int jj = 0; jj < 16; jj++)
#pragma unroll
                    for (int q = 0; q < 2; q++) {
                        const int i = n * 128 + 8 * jj + 2 * (lane & 3) + q;
                        float x = swiglu(acc[4 * jj + 2 * hh + q] * s2a, acc[4 * (jj + 16) + 2 * hh + q] * s2b, p.limit);
                        if (i >= p.ldo) x = 0.0f; /* the last tile's rows past Ip */
                        v[2 * jj + q] = x;
                        const float a = fabsf(x);
                        if (!(a <= 3.402823466e38f)) bad = 1;
                        else amax = fmaxf(amax, a);
                    }
#pragma unroll
                for (int o = 1; o <= 2; o <<= 1) {
                    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                    bad |= __shfl_xor_sync(0xffffffffu, bad, o);
                }
                const float sc = fp8_block_scale(amax, bad != 0, p.act);
                if (pp >= p_end) continue;
#pragma unroll
                for (int jj = 0; jj < 16; jj++) {
                    const int i = n * 128 + 8 * jj + 2 * (lane & 3);
                    if (i >= p.ldo) continue;
                    const uint32_t c2 = qg_code(v[2 * jj], sc) | (qg_code(v[2 * jj + 1], sc) << 8);
                    *reinterpret_cast<uint16_t *>(p.Hq + (size_t)pp * p.ldo + i) = (uint16_t)c2;
                }
                if ((lane & 3) == 0) p.Hs[(size_t)pp * p.NT + n] = sc;
            } else {
                if (pp >= p_end) continue;
                const size_t orow = p.perm ? (size_t)p.perm[pp] : (size_t)pp;
#pragma unroll
                for (int jj = 0; jj < 32; jj++) {
                    const int c = n * 256 + 8 * jj + 2 * (lane & 3);
                    if (c >= wrows) continue; /* the last tile's rows past rows_p */
                    *reinterpret_cast<float2 *>(p.Y + orow * p.ldo + c) =
                        make_float2(acc[4 * jj + 2 * hh] * s2a, acc[4 * jj + 2 * hh + 1] * s2a);
                }
            }
        }
    }
}

/* ------------------------------------------------------- tensor maps */

/* An FP8 projection's codes [n experts][rows_p][kp] uint8; box: one k block
 * (128 bytes) x 128 rows x 1 expert into the operand layout (SWIZZLE_128B). */
static cudaError_t qg_weight_map(wg_encode_fn enc, const dweights &w, CUtensorMap *m) {
    if (w.fmt != DF_FP8 || w.n < 1 || !w.data || ((uintptr_t)w.data & 15u) || (w.dstride & 15) || w.kp % 16)
        return cudaErrorInvalidValue;
    const cuuint64_t dims[3] = {(cuuint64_t)w.kp, (cuuint64_t)w.rows_p, (cuuint64_t)w.n};
    const cuuint64_t strides[2] = {(cuuint64_t)w.kp, (cuuint64_t)w.dstride};
    const cuuint32_t box[3] = {128, 128, 1};
    const cuuint32_t estr[3] = {1, 1, 1};
    CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, (void *)w.data, dims, strides, box, estr,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

/* Activation codes [n_pos][lda] uint8 in sorted order; box 128 x 128. */
static cudaError_t qg_act_map(wg_encode_fn enc, const uint8_t *A, int lda, int n_pos, CUtensorMap *m) {
    if (!A || ((uintptr_t)A & 15u) || lda % 16) return cudaErrorInvalidValue;
    const cuuint64_t dims[2] = {(cuuint64_t)lda, (cuuint64_t)n_pos};
    const cuuint64_t strides[1] = {(cuuint64_t)lda};
    const cuuint32_t box[2] = {128, 128};
    const cuuint32_t estr[2] = {1, 1};
    CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, (void *)A, dims, strides, box, estr,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <bool GATEUP> static cudaError_t qg_launch(qg_args &a, const uint8_t *Aq, int max_items, int n_sm, cudaStream_t s) {
    int grid = max_items < n_sm ? max_items : n_sm;
    if (grid < 1) return cudaSuccess;
    wg_encode_fn enc = nullptr;
    cudaError_t e = wg_encoder(&enc);
    if (e == cudaSuccess) e = qg_weight_map(enc, a.wa, &a.tw[0]);
    if (e == cudaSuccess && GATEUP) e = qg_weight_map(enc, a.wb, &a.tw[1]);
    if (e == cudaSuccess) e = qg_act_map(enc, Aq, a.wa.kp, a.n_pos, &a.ta);
    if (e == cudaSuccess) e = moe_smem_attr((const void *)k_qg<GATEUP>, QG_SMEM);
    if (e != cudaSuccess) return e;
    k_qg<GATEUP><<<grid, QG_THREADS, QG_SMEM, s>>>(a);
    return cudaGetLastError();
}

cudaError_t moe_k_gateup_qg(const dweights *w1, const dweights *w3, const uint8_t *Xq, const float *Xs, int Hp,
                            const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float limit,
                            int act, uint8_t *Hq, float *Hs, int Ip, int n_sm, cudaStream_t s) {
    if (n_pos == 0 || max_tiles == 0) return cudaSuccess;
    if (w1->fmt != DF_FP8 || w1->kp != Hp || Hp % 64 || Ip % 64 || (act != ACT_FP8_POW2 && act != ACT_FP8_F32))
        return cudaErrorInvalidValue;
    if (w3->fmt != w1->fmt || w3->kp != w1->kp || w3->rows_p != w1->rows_p) return cudaErrorInvalidValue;
    qg_args a;
    memset(&a, 0, sizeof a);
    a.wa = *w1;
    a.wb = *w3;
    a.as = Xs;
    a.KB = (Hp + QG_BK - 1) / QG_BK;
    a.tiles = tiles;
    a.n_tiles = n_tiles;
    a.n_pos = n_pos;
    a.NT = (Ip + 127) / 128;
    a.limit = limit;
    a.act = act;
    a.Hq = Hq;
    a.Hs = Hs;
    a.ldo = Ip;
    return qg_launch<true>(a, Xq, max_tiles * a.NT, n_sm, s);
}

cudaError_t moe_k_down_qg(const dweights *w2, const uint8_t *Hq, const float *Hs, int Ip, const int32_t *perm,
                          const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float *Y, int Yp,
                          int n_sm, cudaStream_t s) {
    if (n_pos == 0 || max_tiles == 0) return cudaSuccess;
    if (w2->fmt != DF_FP8 || w2->kp != Ip || Ip % 64 || w2->rows_p % 128) return cudaErrorInvalidValue;
    qg_args a;
    memset(&a, 0, sizeof a);
    a.wa = *w2;
    a.as = Hs;
    a.KB = (Ip + QG_BK - 1) / QG_BK;
    a.perm = perm;
    a.tiles = tiles;
    a.n_tiles = n_tiles;
    a.n_pos = n_pos;
    a.NT = (w2->rows_p + QG_BN - 1) / QG_BN;
    a.Y = Y;
    a.ldo = Yp;
    return qg_launch<false>(a, Hq, max_tiles * a.NT, n_sm, s);
}

/* One warp per (row, 128-column block): the codes and the scale of the
 * block as warp_act128 rounds it (the same amax, scale and conversion),
 * columns past n as zeros, past pitch not stored. */
__global__ void k_qg_quant(const float *__restrict__ X, int rows, int n, int ld_in, int act, uint8_t *__restrict__ Q,
                           float *__restrict__ S, int pitch, int KB) {
    const int warp = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32;
    if (warp >= rows * KB) return;
    const int r = warp / KB, kb = warp - r * KB, c0 = kb * 128;
    const float *src = X + (size_t)r * ld_in;
    float v[4], amax = 0.0f;
    bool bad = false;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int c = c0 + lane * 4 + i;
        v[i] = c < n ? src[c] : 0.0f;
        const float a = fabsf(v[i]);
        if (!(a <= 3.402823466e38f)) bad = true;
        else amax = fmaxf(amax, a);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    bad = __any_sync(0xffffffffu, bad);
    const float sc = fp8_block_scale(amax, bad, act);
    const int c = c0 + lane * 4;
    if (c < pitch) {
        uint32_t w = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) w |= qg_code(v[i], sc) << (8 * i);
        *reinterpret_cast<uint32_t *>(Q + (size_t)r * pitch + c) = w;
    }
    if (lane == 0) S[(size_t)r * KB + kb] = sc;
}

cudaError_t moe_k_qg_quant(const float *X, int rows, int n, int ld_in, int act, uint8_t *Q, float *S, int pitch,
                           cudaStream_t s) {
    if (pitch % 64 || n > pitch || (act != ACT_FP8_POW2 && act != ACT_FP8_F32)) return cudaErrorInvalidValue;
    const int KB = (pitch + 127) / 128;
    const long long warps = (long long)rows * KB;
    if (warps == 0) return cudaSuccess;
    k_qg_quant<<<(unsigned)((warps * 32 + 255) / 256), 256, 0, s>>>(X, rows, n, ld_in, act, Q, S, pitch, KB);
    return cudaGetLastError();
}

/* Qs [p] = Q [perm[p] / C], Ss [p] = S [perm[p] / C]: one block per sorted
 * position, 16-byte copies of the codes. */
__global__ void __launch_bounds__(128) k_qg_gather(const uint8_t *__restrict__ Q, const float *__restrict__ S,
                                                   int pitch, int KB, const int32_t *__restrict__ perm, int C,
                                                   uint8_t *__restrict__ Qs, float *__restrict__ Ss) {
    const size_t pp = blockIdx.x, row = (size_t)(perm[pp] / C);
    const uint4 *src = reinterpret_cast<const uint4 *>(Q + row * pitch);
    uint4 *dst = reinterpret_cast<uint4 *>(Qs + pp * pitch);
    for (int c = threadIdx.x; c < pitch / 16; c += blockDim.x) dst[c] = src[c];
    for (int c = threadIdx.x; c < KB; c += blockDim.x) Ss[pp * KB + c] = S[row * KB + c];
}

cudaError_t moe_k_qg_gather(const uint8_t *Q, const float *S, int pitch, const int32_t *perm, int C, int n_pos,
                            uint8_t *Qs, float *Ss, cudaStream_t s) {
    if (n_pos == 0) return cudaSuccess;
    if (pitch % 16 || C < 1) return cudaErrorInvalidValue;
    k_qg_gather<<<n_pos, 128, 0, s>>>(Q, S, pitch, (pitch + 127) / 128, perm, C, Qs, Ss);
    return cudaGetLastError();
}

/* ------------------------------------------------------------ self-test */

namespace {

uint64_t qg_rng = 0xD1B54A32D192ED03ull;
uint32_t qg_next() {
    qg_rng ^= qg_rng << 13;
    qg_rng ^= qg_rng >> 7;
    qg_rng ^= qg_rng << 17;
    return (uint32_t)(qg_rng >> 11);
}

void qg_put(char *msg, size_t n, size_t *used, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
void qg_put(char *msg, size_t n, size_t *used, const char *fmt, ...) {
    if (!msg || *used + 1 >= n) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(msg + *used, n - *used, fmt, ap);
    va_end(ap);
    if (k > 0) *used = *used + (size_t)k < n ? *used + (size_t)k : n - 1;
}

/* The relative bound of the random case, on |y - ref| / sum |a w| per
 * output: measured on the H200 2^-10.1 (8.9e-4; 7.5e-4 in one block) over
 * 2 x 69120 outputs, i.e. the FP8 wgmma keeps about 10 bits of a k
 * block's sum relative to the sum of its products' magnitudes on random
 * codes; 2^-9 holds it with a factor 2. */
#define QG_RANDOM_BOUND 0x1p-9

/* One down-projection GEMM Y [R, NP] = A [R, K] W [NP, K]^T through
 * moe_k_down_qg on one expert without a permutation. K = 320: two full k
 * blocks and a half one (its other 64 columns land as zeros); R = 180
 * token rows (the second token tile has 52: its second consumer
 * warpgroup has no row); NP = 384: a full weight tile and one whose
 * second half lies past the rows (not loaded, not multiplied).
 * exact: activation codes 0, +-1 .. +-4 and weight codes 0, +-0.25 ..
 * +-1 (steps of 0.25), power-of-two scales 2^-1 .. 2^1 on both: every
 * product is a multiple of 2^-2 of magnitude <= 4, a k block's partial
 * sums are multiples of 2^-2 below 2^9 (11 significant bits: inside the
 * FP8 wgmma's ~14-bit accumulator, whatever its order or truncation), the
 * promotion's products by the scales are exact and the sum of three
 * blocks is below 2^12 in steps of 2^-4: exact in fp32. The result must
 * equal the float64 sum bit for bit. random: every finite E4M3 code on
 * both sides, activation scales 2^-4 .. 2^4, weight tile scales fp32 in
 * [2^-8, 2^-6] (as quantizers write them): the error per output against
 * float64, relative to sum |a w|, is measured and held to QG_RANDOM_BOUND. */
int qg_gemm(char *msg, size_t n, size_t *used, bool exact, int n_sm, double *worst) {
    const int R = 180, K = 320, NP = 384, KB = (K + 127) / 128;
    std::vector<uint8_t> A((size_t)R * K), W((size_t)NP * K);
    std::vector<float> As((size_t)R * KB), Ws((size_t)(NP / 128) * KB);
    static const uint8_t ea[5] = {0x00, 0x38, 0x40, 0x44, 0x48}; /* 0 1 2 3 4 */
    static const uint8_t ew[5] = {0x00, 0x28, 0x30, 0x34, 0x38}; /* 0 0.25 0.5 0.75 1 */
    auto rnd_code = [&]() {
        uint8_t c;
        do c = (uint8_t)qg_next(); while ((c & 0x7F) == 0x7F); /* not NaN */
        return c;
    };
    for (auto &c : A) c = exact ? (uint8_t)(ea[qg_next() % 5] | (qg_next() & 0x80u)) : rnd_code();
    for (auto &c : W) c = exact ? (uint8_t)(ew[qg_next() % 5] | (qg_next() & 0x80u)) : rnd_code();
    for (auto &v : As) v = exact ? ldexpf(1.0f, (int)(qg_next() % 3) - 1) : ldexpf(1.0f, (int)(qg_next() % 9) - 4);
    for (auto &v : Ws)
        v = exact ? ldexpf(1.0f, (int)(qg_next() % 3) - 1) : ldexpf(1.0f + (float)(qg_next() % 4096) / 1024.0f, -8);
    void *dA = nullptr, *dW = nullptr, *dAs = nullptr, *dWs = nullptr, *dY = nullptr, *d2 = nullptr;
    const float one = 1.0f;
    cudaError_t e = cudaMalloc(&dA, A.size());
    if (e == cudaSuccess) e = cudaMalloc(&dW, W.size());
    if (e == cudaSuccess) e = cudaMalloc(&dAs, As.size() * 4);
    if (e == cudaSuccess) e = cudaMalloc(&dWs, Ws.size() * 4);
    if (e == cudaSuccess) e = cudaMalloc(&dY, (size_t)R * NP * 4);
    if (e == cudaSuccess) e = cudaMalloc(&d2, 4);
    if (e == cudaSuccess) e = cudaMemcpy(dA, A.data(), A.size(), cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(dW, W.data(), W.size(), cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(dAs, As.data(), As.size() * 4, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(dWs, Ws.data(), Ws.size() * 4, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(d2, &one, 4, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemset(dY, 0xFF, (size_t)R * NP * 4); /* NaN: unwritten outputs show */
    dweights w;
    memset(&w, 0, sizeof w);
    w.fmt = DF_FP8;
    w.rows_p = NP;
    w.kp = K;
    w.n = 1;
    w.dstride = (long long)W.size();
    w.sstride = (long long)Ws.size() * 4;
    w.data = (const uint8_t *)dW;
    w.scale = (const uint8_t *)dWs;
    w.scale2 = (const float *)d2;
    if (e == cudaSuccess)
        e = moe_k_down_qg(&w, (const uint8_t *)dA, (const float *)dAs, K, nullptr, nullptr, nullptr, (R + 127) / 128,
                          R, (float *)dY, NP, n_sm, 0);
    std::vector<float> Y((size_t)R * NP);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpy(Y.data(), dY, Y.size() * 4, cudaMemcpyDeviceToHost);
    cudaFree(dA);
    cudaFree(dW);
    cudaFree(dAs);
    cudaFree(dWs);
    cudaFree(dY);
    cudaFree(d2);
    char name[128];
    snprintf(name, sizeof name, "fp8 x fp8 GEMM (QGMMA), %s%s", exact ? "exact data" : "random codes",
             n_sm == 1 ? ", one block" : "");
    if (e != cudaSuccess) {
        qg_put(msg, n, used, "%s: CUDA error %s\n", name, cudaGetErrorString(e));
        return 1;
    }
    int bad = 0;
    double wr = 0;
    for (int m = 0; m < R; m++)
        for (int c = 0; c < NP; c++) {
            double s = 0, sabs = 0;
            for (int k = 0; k < K; k++) {
                const double t = (double)moe_fp8_e4m3_to_f32(A[(size_t)m * K + k]) * As[(size_t)m * KB + k / 128] *
                                 ((double)moe_fp8_e4m3_to_f32(W[(size_t)c * K + k]) * Ws[(size_t)(c / 128) * KB + k / 128]);
                s += t;
                sabs += fabs(t);
            }
            const double g = Y[(size_t)m * NP + c];
            const double r = sabs > 0 ? fabs(g - s) / sabs : fabs(g - s);
            if (!(r <= wr)) wr = r == r ? (r > wr ? r : wr) : INFINITY;
            const bool ok = exact ? g == s : r <= QG_RANDOM_BOUND;
            if (!ok && bad++ < 3) qg_put(msg, n, used, "  %s: Y[%d][%d] = %.9g, want %.9g\n", name, m, c, g, s);
        }
    if (worst && wr > *worst) *worst = wr;
    if (exact)
        qg_put(msg, n, used, "%s: %d of %d outputs wrong\n", name, bad, R * NP);
    else
        qg_put(msg, n, used, "%s: %d of %d outputs outside %.1e; worst |y - ref| / sum |a w| = %.3e (%.1f bits)\n",
               name, bad, R * NP, QG_RANDOM_BOUND, wr, wr > 0 ? -log2(wr) : 99.0);
    return bad > 0;
}

} // namespace

extern "C" int moe_cuda_qg_selftest(char *msg, size_t n) {
    size_t used = 0;
    if (msg && n) msg[0] = 0;
    int n_sm = 0, dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        qg_put(msg, n, &used, "no device\n");
        return -1;
    }
    int fails = 0;
    double worst = 0;
    for (int g = 0; g < 2; g++) {
        fails += qg_gemm(msg, n, &used, true, g ? 1 : n_sm, nullptr);
        fails += qg_gemm(msg, n, &used, false, g ? 1 : n_sm, &worst);
    }
    return fails;
}
