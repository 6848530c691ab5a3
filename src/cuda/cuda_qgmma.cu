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
 * MXFP4 weights (V4-Flash's routed experts) take this kernel unchanged
 * (AUTO from T = 32, MOE_CUDA_MXQ_MIN_T in cuda_layer.cu; WGMMA):
 * the layer transcodes them once at upload (k_mx_to_fp8 below, over the
 * packed codes and E8M0 scales cuda_pack.c writes, for the bench's random
 * layers too) into FP8_BLOCK data with exactly the same values: per 128 x
 * 128 tile a reference exponent R and the codes e2m1 x 2^(e - R), exact in
 * E4M3 while d = e - R lies in [-8, 6] (moe_formats.h, MOE_MX_E4M3_DMIN /
 * DMAX, tested over every code and d), with the tile scale 2^(R - 127).
 * A tile whose nonzero blocks span more than 14 binades, or that holds a
 * NaN scale, is not rounded: the layer then keeps no transcode and FP8
 * activations stay on the bf16-operand kernel (moe_cuda_layer_note says
 * which tile). The transcode costs 2x the FP4 bytes more device memory
 * (the FP4 copy stays for the GEMVs, T <= 7, and the A/B path), and this
 * kernel reads 2x the bytes an FP4 kernel would. NVFP4 cannot take this
 * route: a UE4M3 block scale times an E2M1 value has up to 5 significant
 * bits (1.875 x 1.5), E4M3 has 4, and the per-16 scales change inside one
 * k32 wgmma step, so no per-tile power of two makes its values E4M3; it
 * stays on the bf16-operand kernel.
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
 *    two xor shuffles, the scale by fp8_block_scale, the codes by fp8_code
 *    (cuda_device.cuh). No fp32 H round trip and no rounding kernel.
 *    Columns past Ip count as zero (as warp_act128's) and are not stored.
 *    down: acc x the NVFP4-style per-tensor scale (1 for FP8) per
 *    assignment row (perm), combined by moe_k_combine (routed weight and
 *    the contract's multipliers there, as on every path).
 *
 * The cluster kernel (PAIR; MOE_CUDA_QG_CLUSTER=1 selects it, the
 * single-block kernel above stays the default: measured no faster, see
 * docs/performance-cuda.md, eighth session): clusters of two blocks
 * (cudaLaunchKernelEx, as many clusters as are resident) share one load
 * of an operand through TMA multicast (.multicast::cluster, mask 0b11):
 *  - two token tiles of one expert (tiles pair from the end of each
 *    expert's segment), one weight tile: each block loads its own 128
 *    token rows and half of the 256 weight rows into both blocks; per k
 *    block a block reads 16 + 16 KB from L2 instead of 16 + 32;
 *  - a lone token tile (an expert with an odd count of tiles: its first):
 *    one token tile, two weight tiles 2 n and 2 n + 1, each block loads
 *    64 token rows into both and its own weight tile (8 + 32 KB).
 *  The pair's items walk the (token tile, weight tile) grid of the single
 *  kernel; an item that is the second tile of a pair, or past ceil(NT / 2)
 *  for a lone tile, is empty for both blocks (qg_decode), so both blocks'
 *  ring positions stay equal. "empty" then counts 16 arrivals: lane 0 of
 *  each consumer warp of both blocks, after its wait_group 0 (mapa and a
 *  remote arrive, release at CTA scope), since both producers write every
 *  slot of both blocks. A block's
 *  "full" still counts its own producer's expect-tx; the partner's
 *  complete-tx may come first (the transaction count goes negative until
 *  then). Start: the barrier inits, then a cluster barrier. End: thread 0
 *  of the producer waits for the releases of its last R loads, so neither
 *  block exits while the partner's consumers may still arrive on its
 *  barriers. The MMAs, their order and the epilogue are those of the
 *  single kernel: outputs equal bit for bit (self-test qg_ab).
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
 *     (the 256 consumer arrivals of j - R; PAIR: the 16 warp arrivals of
 *     both blocks), arrives with expect-tx on "full";
 *     consumers wait "full" with parity (j / R) & 1.
 */
#include "cuda/cuda_wg.cuh"
#include "cuda/cuda_selftest.h"
#include "cuda/cuda_selftest_host.h"

#include <float.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
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

/* ----------------------------------------- the 2-CTA cluster (PAIR) */

/* Every thread of both blocks: the barrier inits visible cluster-wide
 * before either block's first remote arrive or multicast. */
__device__ __forceinline__ void cl_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
/* Arrive on the mbarrier at the same offset in the shared memory of the
 * cluster's block `rank` (this block's own included). Release at CTA scope:
 * the slot's readers are the wgmmas, complete at wait_group 0, and its
 * writer is the TMA (async proxy); no generic write has to be ordered.
 * A .release.cluster arrive (a cluster-scope fence per k block) made the
 * block 1.4-1.7x slower on the H200 (eighth session). */
__device__ __forceinline__ void mbar_arrive_cl(uint32_t bar, uint32_t rank) {
    asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                 "mbarrier.arrive.release.cta.shared::cluster.b64 _, [ra];\n}" ::"r"(bar),
                 "r"(rank)
                 : "memory");
}
/* mbar_wait with acquire at cluster scope: the drain before exit. */
__device__ __forceinline__ bool mbar_try_cl(uint32_t bar, uint32_t parity) {
    uint32_t ok;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return ok != 0;
}
__device__ __forceinline__ void mbar_wait_cl(uint32_t bar, uint32_t parity) {
    if (mbar_try_cl(bar, parity)) return;
    const long long t0 = clock64();
    while (!mbar_try_cl(bar, parity))
        if (clock64() - t0 > (1ll << 31)) __trap();
}
/* tma2d / tma3d multicast: the box lands at the same shared-memory offset
 * in every block of `mask` and completes its bytes on the mbarrier at the
 * same offset in each of them. */
__device__ __forceinline__ void tma2d_mc(uint32_t dst, const CUtensorMap *m, int c0, int c1, uint32_t bar,
                                         uint16_t mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
                 : "memory");
}
__device__ __forceinline__ void tma3d_mc(uint32_t dst, const CUtensorMap *m, int c0, int c1, int c2, uint32_t bar,
                                         uint16_t mask) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(m)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
                 : "memory");
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

/* Row pp's h codes of the 128-column block at i0 (32 here: columns
 * i0 + 8 jj + 2 (lane % 4) + 0/1), columns past ldo not stored. */
template <bool POW2>
static __device__ __forceinline__ void qg_put_h(uint8_t *__restrict__ row, const float *v, int i0, int lane, int ldo,
                                                float sc) {
    const float inv = POW2 ? 1.0f / sc : 0.0f;
#pragma unroll
    for (int jj = 0; jj < 16; jj++) {
        const int i = i0 + 8 * jj + 2 * (lane & 3);
        if (i >= ldo) continue;
        const uint32_t c2 = fp8_code<POW2>(v[2 * jj], sc, inv) | (fp8_code<POW2>(v[2 * jj + 1], sc, inv) << 8);
        *reinterpret_cast<uint16_t *>(row + i) = (uint16_t)c2;
    }
}

/* One block's part of a work item. Single block (PAIR = false): item w is
 * token tile m = w / NT, weight tile n = w % NT. Cluster of two (PAIR): w
 * is the pair's item over the same (m, n) grid, and block `rank` takes:
 *  - tile m of an expert with an even count of tiles left from m (tiles
 *    pair from the end of each expert's segment): token tile m + rank,
 *    weight tile n, the weight tile multicast (block `rank` loads its half
 *    `rank` of the 256 rows into both); wpair;
 *  - tile m otherwise the second of such a pair: nothing (w is empty for
 *    both blocks);
 *  - tile m alone (the first tile of an expert with an odd count): for
 *    n < ceil(NT / 2) token tile m with weight tile 2 n + rank (none when
 *    that is NT), the token tile multicast (block `rank` loads its rows
 *    64 rank .. 64 rank + 63 into both); else nothing.
 * Both blocks decode the same w to the same kind, so their ring positions
 * stay in step. false: nothing to do. */
struct qg_work {
    int m, n;  /* token tile, weight tile (n valid when hw) */
    bool hw;   /* this block has a weight tile */
    bool wpair; /* PAIR: the weight tile is shared (else the token tile is) */
};

template <bool PAIR> static __device__ __forceinline__ bool qg_decode(const qg_args &p, int w, int rank, qg_work &it) {
    const int mt = w / p.NT, nq = w - mt * p.NT; /* wg_item with WG_GROUP_M = 1 */
    if (!PAIR) {
        it = qg_work{mt, nq, true, false};
        return true;
    }
    int e, p0, p_end;
    qg_tile(p, mt, e, p0, p_end);
    if (((p_end - p0 + QG_BM - 1) / QG_BM) % 2 == 0) {
        it = qg_work{mt + rank, nq, true, true};
        return true;
    }
    if (mt > 0) {
        int e1, a0, a1;
        qg_tile(p, mt - 1, e1, a0, a1);
        if (e1 == e) return false;
    }
    if (2 * nq >= p.NT) return false;
    it = qg_work{mt, 2 * nq + rank, 2 * nq + rank < p.NT, false};
    return true;
}

template <bool GATEUP, bool PAIR>
__global__ void __launch_bounds__(QG_THREADS, 1) k_qg(const __grid_constant__ qg_args p) {
    extern __shared__ uint8_t qg_smem[];
    const uint32_t base = (sa(qg_smem) + 1023u) & ~1023u;
    const uint32_t full = base + QG_BARS, empty = full + 8 * QG_R;
    const int tid = threadIdx.x;
    /* PAIR: "empty" counts lane 0 of each consumer warp of both blocks */
    const int rank = PAIR ? (int)(blockIdx.x & 1u) : 0; /* %cluster_ctarank of a 2 x 1 x 1 cluster */
    if (tid == 0) {
        for (int s = 0; s < QG_R; s++) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, PAIR ? 2 * 8 : 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tw[0])) : "memory");
        if (GATEUP) asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tw[1])) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.ta)) : "memory");
    }
    if (PAIR) cl_sync();
    else __syncthreads();
    const int n_m = p.tiles ? *p.n_tiles : (p.n_pos + QG_BM - 1) / QG_BM;
    const int items = n_m * p.NT, KB = p.KB;
    const int wrows = p.wa.rows_p;
    const int w0 = PAIR ? (int)blockIdx.x / 2 : (int)blockIdx.x, step = PAIR ? (int)gridDim.x / 2 : (int)gridDim.x;

    if (tid < 128) {
        /* ------------------------------------------------------ producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
        if (tid != 0) return;
        int j = 0;
        for (int w = w0; w < items; w += step) {
            qg_work it;
            if (!qg_decode<PAIR>(p, w, rank, it)) continue;
            const int m = it.m, n = it.n;
            int e, p0, p_end;
            qg_tile(p, m, e, p0, p_end);
            const int r0 = GATEUP ? n * 128 : n * 256, r1 = GATEUP ? n * 128 : n * 256 + 128;
            const bool h1 = r1 < wrows;
            const uint32_t wbytes = it.hw ? (uint32_t)((1 + h1) * 128 * 128) : 0u;
            for (int kb = 0; kb < KB; kb++, j++) {
                const int s = j % QG_R;
                const uint32_t slot = base + (uint32_t)(s * QG_SLOT), fb = full + 8 * s;
                mbar_wait(empty + 8 * s, ((uint32_t)(j / QG_R) & 1u) ^ 1u);
                mbar_expect_tx(fb, (uint32_t)QG_A + wbytes);
                if (!PAIR) {
                    tma2d(slot, &p.ta, kb * QG_BK, p0, fb);
                    tma3d(slot + QG_A, &p.tw[0], kb * QG_BK, r0, e, fb);
                    if (h1) tma3d(slot + QG_A + 128 * 128, &p.tw[GATEUP ? 1 : 0], kb * QG_BK, r1, e, fb);
                } else if (it.wpair) {
                    /* own token rows (two boxes of 64), half `rank` of the shared weight tile */
                    tma2d(slot, &p.ta, kb * QG_BK, p0, fb);
                    tma2d(slot + QG_A / 2, &p.ta, kb * QG_BK, p0 + 64, fb);
                    if (rank == 0) tma3d_mc(slot + QG_A, &p.tw[0], kb * QG_BK, r0, e, fb, 3);
                    else if (h1) tma3d_mc(slot + QG_A + 128 * 128, &p.tw[GATEUP ? 1 : 0], kb * QG_BK, r1, e, fb, 3);
                } else {
                    /* rows 64 rank .. of the shared token tile, own weight tile */
                    tma2d_mc(slot + (uint32_t)(rank * (QG_A / 2)), &p.ta, kb * QG_BK, p0 + 64 * rank, fb, 3);
                    if (it.hw) {
                        tma3d(slot + QG_A, &p.tw[0], kb * QG_BK, r0, e, fb);
                        if (h1) tma3d(slot + QG_A + 128 * 128, &p.tw[GATEUP ? 1 : 0], kb * QG_BK, r1, e, fb);
                    }
                }
            }
        }
        if (PAIR) {
            /* Drain before exit: the last R loads' releases in "empty" hold
             * both blocks' last arrivals on this block's barriers (the
             * partner's consumers arrive here after their last wait, and
             * this block's consumers' last release follows every byte the
             * partner multicast here), so no remote arrive or copy into
             * this block's shared memory is outstanding once they are in;
             * this thread keeps the block (and its shared memory) alive
             * until then. */
            for (int jj = j - QG_R > 0 ? j - QG_R : 0; jj < j; jj++)
                mbar_wait_cl(empty + 8 * (jj % QG_R), (uint32_t)(jj / QG_R) & 1u);
        }
        return;
    }

    /* ---------------------------------------------------------- consumers */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
    const int ct = tid - 128, wg = ct >> 7, wi = (ct >> 5) & 3, lane = ct & 31;
    const int tr = 64 * wg + 16 * wi + (lane >> 2); /* this thread's tile rows: tr and tr + 8 */
    float acc[128], part[64];
    int j = 0;
    for (int w = w0; w < items; w += step) {
        qg_work it;
        if (!qg_decode<PAIR>(p, w, rank, it)) continue;
        const int m = it.m, n = it.hw ? it.n : 0; /* no weight tile: addresses of tile 0, nothing read */
        int e, p0, p_end;
        qg_tile(p, m, e, p0, p_end);
        const bool active = it.hw && p0 + 64 * wg < p_end;
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
            if (!PAIR) {
                mbar_arrive(empty + 8 * s);
            } else if (lane == 0) {
                /* the warpgroup's wgmmas reading the slot are complete
                 * (wait_group 0): release it in both blocks, whose
                 * producers both write into it */
                mbar_arrive_cl(empty + 8 * s, 0);
                mbar_arrive_cl(empty + 8 * s, 1);
            }
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
                uint8_t *hrow = p.Hq + (size_t)pp * p.ldo;
                if (p.act == ACT_FP8_F32) qg_put_h<false>(hrow, v, n * 128, lane, p.ldo, sc);
                else qg_put_h<true>(hrow, v, n * 128, lane, p.ldo, sc);
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

/* Activation codes [n_pos][lda] uint8 in sorted order; box 128 bytes x
 * `rows` (128; the cluster kernel: 64, half a token tile). */
static cudaError_t qg_act_map(wg_encode_fn enc, const uint8_t *A, int lda, int n_pos, int rows, CUtensorMap *m) {
    if (!A || ((uintptr_t)A & 15u) || lda % 16) return cudaErrorInvalidValue;
    const cuuint64_t dims[2] = {(cuuint64_t)lda, (cuuint64_t)n_pos};
    const cuuint64_t strides[1] = {(cuuint64_t)lda};
    const cuuint32_t box[2] = {128, (cuuint32_t)rows};
    const cuuint32_t estr[2] = {1, 1};
    CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, (void *)A, dims, strides, box, estr,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

/* The launch of `clusters` clusters of two k_qg blocks (QG_THREADS,
 * QG_SMEM) on stream s; *at is the one attribute it points to (the
 * caller's, living as long as the config). Used by the launcher and by
 * the self-test's occupancy report. */
static cudaLaunchConfig_t qg_cluster_config(cudaLaunchAttribute *at, int clusters, cudaStream_t s) {
    *at = cudaLaunchAttribute{};
    at->id = cudaLaunchAttributeClusterDimension;
    at->val.clusterDim.x = 2;
    at->val.clusterDim.y = 1;
    at->val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(2 * clusters));
    cfg.blockDim = dim3(QG_THREADS);
    cfg.dynamicSmemBytes = QG_SMEM;
    cfg.stream = s;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    return cfg;
}

/* The single-block kernel unless MOE_CUDA_QG_CLUSTER is "1" (the cluster
 * kernel: the same MMAs in the same order per output, so the same bits;
 * the self-test checks it). The H200 A/B of the eighth session put the
 * two within 1.5% at T = 8192 (docs/performance-cuda.md). */
static bool qg_pair_default() {
    const char *v = getenv("MOE_CUDA_QG_CLUSTER");
    return v && v[0] == '1' && v[1] == 0;
}

/* Single block: grid min(items, SMs). Pair: clusters of two blocks, as
 * many as are resident at once (cudaOccupancyMaxActiveClusters: the
 * GPCs' SM counts decide) and no more than items; each cluster walks the
 * pair items c, c + clusters, ... */
template <bool GATEUP>
static cudaError_t qg_launch(qg_args &a, const uint8_t *Aq, int max_items, int n_sm, bool pair, cudaStream_t s) {
    int grid = max_items < n_sm ? max_items : n_sm;
    if (grid < 1) return cudaSuccess;
    wg_encode_fn enc = nullptr;
    cudaError_t e = wg_encoder(&enc);
    if (e == cudaSuccess) e = qg_weight_map(enc, a.wa, &a.tw[0]);
    if (e == cudaSuccess && GATEUP) e = qg_weight_map(enc, a.wb, &a.tw[1]);
    if (e == cudaSuccess) e = qg_act_map(enc, Aq, a.wa.kp, a.n_pos, pair ? 64 : 128, &a.ta);
    if (!pair) {
        if (e == cudaSuccess) e = moe_smem_attr((const void *)k_qg<GATEUP, false>, QG_SMEM);
        if (e != cudaSuccess) return e;
        k_qg<GATEUP, false><<<grid, QG_THREADS, QG_SMEM, s>>>(a);
        return cudaGetLastError();
    }
    if (e == cudaSuccess) e = moe_smem_attr((const void *)k_qg<GATEUP, true>, QG_SMEM);
    if (e != cudaSuccess) return e;
    cudaLaunchAttribute at;
    int clusters = (n_sm / 2 > 0) ? n_sm / 2 : 1;
    cudaLaunchConfig_t cfg = qg_cluster_config(&at, clusters, s);
    /* a query that fails leaves n_sm / 2 clusters: correct either way (no
     * cluster waits on another), only later waves would run late */
    int resident = 0;
    if (cudaOccupancyMaxActiveClusters(&resident, k_qg<GATEUP, true>, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        resident = clusters;
    }
    if (resident < 1) return cudaErrorInvalidConfiguration;
    if (clusters > resident) clusters = resident;
    if (clusters > max_items) clusters = max_items;
    cfg.gridDim = dim3((unsigned)(2 * clusters));
    e = cudaLaunchKernelEx(&cfg, k_qg<GATEUP, true>, a);
    if (e != cudaSuccess) return e;
    return cudaGetLastError();
}

static cudaError_t qg_gateup(const dweights *w1, const dweights *w3, const uint8_t *Xq, const float *Xs, int Hp,
                             const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float limit,
                             int act, uint8_t *Hq, float *Hs, int Ip, int n_sm, bool pair, cudaStream_t s) {
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
    return qg_launch<true>(a, Xq, max_tiles * a.NT, n_sm, pair, s);
}

static cudaError_t qg_down(const dweights *w2, const uint8_t *Hq, const float *Hs, int Ip, const int32_t *perm,
                           const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float *Y, int Yp,
                           int n_sm, bool pair, cudaStream_t s) {
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
    return qg_launch<false>(a, Hq, max_tiles * a.NT, n_sm, pair, s);
}

cudaError_t moe_k_gateup_qg(const dweights *w1, const dweights *w3, const uint8_t *Xq, const float *Xs, int Hp,
                            const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float limit,
                            int act, uint8_t *Hq, float *Hs, int Ip, int n_sm, cudaStream_t s) {
    return qg_gateup(w1, w3, Xq, Xs, Hp, tiles, n_tiles, max_tiles, n_pos, limit, act, Hq, Hs, Ip, n_sm,
                     qg_pair_default(), s);
}

cudaError_t moe_k_down_qg(const dweights *w2, const uint8_t *Hq, const float *Hs, int Ip, const int32_t *perm,
                          const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float *Y, int Yp,
                          int n_sm, cudaStream_t s) {
    return qg_down(w2, Hq, Hs, Ip, perm, tiles, n_tiles, max_tiles, n_pos, Y, Yp, n_sm, qg_pair_default(), s);
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
        const float inv = 1.0f / sc;
        if (act == ACT_FP8_F32) {
#pragma unroll
            for (int i = 0; i < 4; i++) w |= fp8_code<false>(v[i], sc, inv) << (8 * i);
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) w |= fp8_code<true>(v[i], sc, inv) << (8 * i);
        }
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

/* ------------------------------------- MXFP4 weights as FP8_BLOCK data */

/* One block per (128-column tile ct, 128-row tile rt, expert e), 256
 * threads: the tile's E8M0 codes of nonzero blocks (min, max; a NaN scale
 * anywhere refuses the tile), its reference exponent R
 * (moe_mx_tile_exponent), the tile scale 2^(R - 127) and the E4M3 codes
 * e2m1 x 2^(e - R) (moe_e2m1_to_e4m3_pow2), all exact. A tile that does not
 * fit writes scale NaN and no codes and counts in bad [0] (bad [1]: the
 * smallest such tile index, (e x tiles_r + rt) x KB + ct); integer min /
 * max / add only, so the result does not depend on the order. */
__global__ void __launch_bounds__(256) k_mx_to_fp8(const dweights src, uint8_t *__restrict__ dst, float *__restrict__ dsc,
                                                   long long dstride, long long sstride, int *__restrict__ bad) {
    const int ct = blockIdx.x, rt = blockIdx.y, e = blockIdx.z, tid = threadIdx.x;
    const int kp = src.kp, KB = (kp + 127) / 128, c0 = ct * 128, nblk = min(4, (kp - c0) / 32);
    const int half = kp / 2, sb = kp / 32;
    const uint8_t *sd = src.data + (size_t)e * src.dstride, *ss = src.scale + (size_t)e * src.sstride;
    __shared__ int lo, hi, nan;
    if (tid == 0) {
        lo = 255;
        hi = -1;
        nan = 0;
    }
    __syncthreads();
    for (int q = tid; q < 512; q += 256) {
        const int r = rt * 128 + q / 4, b = q % 4;
        if (b >= nblk) continue;
        const int sc = ss[(size_t)r * sb + ct * 4 + b];
        const uint4 v = *reinterpret_cast<const uint4 *>(sd + (size_t)r * half + (c0 + 32 * b) / 2);
        const bool nonzero = ((v.x | v.y | v.z | v.w) & 0x77777777u) != 0;
        if (sc == 0xFF) atomicOr(&nan, 1);
        else if (nonzero) {
            atomicMin(&lo, sc);
            atomicMax(&hi, sc);
        }
    }
    __syncthreads();
    const int R = nan ? -1 : moe_mx_tile_exponent(lo, hi);
    if (tid == 0) {
        dsc[(size_t)e * (sstride / 4) + (size_t)rt * KB + ct] = R >= 0 ? ldexpf(1.0f, R - 127) : __int_as_float(0x7FC00000);
        if (R < 0) {
            atomicAdd(bad, 1);
            atomicMin(bad + 1, ((int)e * (int)gridDim.y + rt) * KB + ct);
        }
    }
    if (R < 0) return;
    /* 16 columns (8 packed bytes in, 16 codes out) per step */
    for (int i = tid; i < 128 * 2 * nblk; i += 256) {
        const int r = rt * 128 + i / (2 * nblk), j = i % (2 * nblk), col = c0 + 16 * j;
        int d = ss[(size_t)r * sb + ct * 4 + j / 2] - R; /* a zero block's codes are zeros whatever d */
        d = min(max(d, MOE_MX_E4M3_DMIN), MOE_MX_E4M3_DMAX);
        const uint2 in = *reinterpret_cast<const uint2 *>(sd + (size_t)r * half + col / 2);
        uint32_t o[4];
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const uint32_t b2 = ((w < 2 ? in.x : in.y) >> (16 * (w & 1))) & 0xFFFFu; /* columns 4 w .. 4 w + 3 */
            o[w] = 0;
#pragma unroll
            for (int k = 0; k < 4; k++)
                o[w] |= (uint32_t)moe_e2m1_to_e4m3_pow2((uint8_t)((b2 >> (4 * k)) & 0xFu), d) << (8 * k);
        }
        *reinterpret_cast<uint4 *>(dst + (size_t)e * dstride + (size_t)r * kp + col) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

cudaError_t moe_k_mx_to_fp8(const dweights *src, const dweights *dst, int *bad, cudaStream_t s) {
    if (src->fmt != DF_MXFP4 || dst->fmt != DF_FP8 || src->rows_p != dst->rows_p || src->kp != dst->kp ||
        src->rows_p % 128 || src->kp % 64 || src->n < 1 || src->n > 65535 || (src->dstride & 15) ||
        (dst->dstride & 15) || (dst->sstride & 3) ||
        dst->sstride < (long long)(src->rows_p / 128) * ((src->kp + 127) / 128) * 4 ||
        dst->dstride < (long long)src->rows_p * src->kp)
        return cudaErrorInvalidValue;
    dim3 grid((unsigned)((src->kp + 127) / 128), (unsigned)(src->rows_p / 128), (unsigned)src->n);
    k_mx_to_fp8<<<grid, 256, 0, s>>>(*src, const_cast<uint8_t *>(dst->data),
                                     reinterpret_cast<float *>(const_cast<uint8_t *>(dst->scale)), dst->dstride,
                                     dst->sstride, bad);
    return cudaGetLastError();
}

/* ------------------------------------------------------------ self-test */

namespace {

moe_st_rng qg_rng = {0xD1B54A32D192ED03ull};
uint32_t qg_next() { return qg_rng.next(); }

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
        moe_st_put(msg, n, used, "%s: CUDA error %s\n", name, cudaGetErrorString(e));
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
            if (!ok && bad++ < 3) moe_st_put(msg, n, used, "  %s: Y[%d][%d] = %.9g, want %.9g\n", name, m, c, g, s);
        }
    if (worst && wr > *worst) *worst = wr;
    if (exact)
        moe_st_put(msg, n, used, "%s: %d of %d outputs wrong\n", name, bad, R * NP);
    else
        moe_st_put(msg, n, used, "%s: %d of %d outputs outside %.1e; worst |y - ref| / sum |a w| = %.3e (%.1f bits)\n",
               name, bad, R * NP, QG_RANDOM_BOUND, wr, wr > 0 ? -log2(wr) : 99.0);
    return bad > 0;
}


/* The MXFP4 -> FP8_BLOCK transcode (moe_k_mx_to_fp8) on two experts of
 * 256 x 320 (tiles 2 x 3, the last 64 columns wide), expert 0's six tiles
 * each a case: (0, 0) block codes 100 .. 114 (a spread of 14: every d of
 * the window, the columns cycling through all 16 E2M1 codes); (0, 1) codes
 * 0 .. 6 (R clamped to 1; weights below fp32's normal range); (0, 2) a
 * spread of 15 (must be refused); (1, 0) zero blocks scaled 0 and 250
 * beside nonzero ones at 120 .. 127 (zero blocks do not count: R = 121);
 * (1, 1) one zero block with a NaN scale (refused); (1, 2) codes 240 ..
 * 254 (R = 248). Expert 1: random codes, scales 120 .. 127 (the bench's).
 * Every element of a fitting tile must decode (E4M3 x tile scale, in
 * float64) to the MXFP4 value exactly, the tile's R must be the expected
 * one, and exactly the two refused tiles must be counted, the first one's
 * index reported, their scales NaN. */
int qg_mx_transcode(char *msg, size_t n, size_t *used) {
    const int NE = 2, RP = 256, KP = 320, SB = KP / 32, KB = (KP + 127) / 128;
    const size_t dbytes = (size_t)RP * KP / 2, sbytes = (size_t)RP * SB;
    std::vector<uint8_t> D(dbytes * NE), S(sbytes * NE);
    for (int e = 0; e < NE; e++)
        for (int r = 0; r < RP; r++)
            for (int b = 0; b < SB; b++) {
                const int tr = r / 128, tc = b / 4, q = (r % 128) * 4 + b % 4;
                uint8_t sc = (uint8_t)(120 + qg_next() % 8);
                bool zero = false;
                if (e == 0) {
                    if (tr == 0 && tc == 0) sc = (uint8_t)(100 + q % 15);
                    if (tr == 0 && tc == 1) sc = (uint8_t)(q % 7);
                    if (tr == 0 && tc == 2) sc = (uint8_t)(q == 5 ? 105 : q == 9 ? 120 : 110);
                    if (tr == 1 && tc == 0 && q % 5 == 0) { sc = q % 10 ? 0 : 250; zero = true; }
                    if (tr == 1 && tc == 1 && q == 77) { sc = 0xFF; zero = true; }
                    if (tr == 1 && tc == 2) sc = (uint8_t)(240 + q % 15);
                }
                S[e * sbytes + (size_t)r * SB + b] = sc;
                for (int k = 0; k < 16; k++) {
                    uint8_t v = (uint8_t)(e == 0 && tr == 0 && tc == 0 ? ((2 * k + r) % 16) | (((2 * k + 1 + r) % 16) << 4)
                                                                       : qg_next() & 0xFF);
                    if (zero) v &= 0x88; /* +-0 only */
                    D[e * dbytes + (size_t)r * (KP / 2) + b * 16 + k] = v;
                }
            }
    dweights src, dst;
    memset(&src, 0, sizeof src);
    src.fmt = DF_MXFP4;
    src.rows_p = RP;
    src.kp = KP;
    src.n = NE;
    src.dstride = (long long)dbytes;
    src.sstride = (long long)sbytes;
    dst = src;
    dst.fmt = DF_FP8;
    dst.dstride = (long long)RP * KP;
    dst.sstride = (long long)(RP / 128) * KB * 4;
    void *dD = nullptr, *dS = nullptr, *dQ = nullptr, *dQs = nullptr, *dbad = nullptr;
    const int bad0[2] = {0, 0x7FFFFFFF};
    cudaError_t e = cudaMalloc(&dD, D.size());
    if (e == cudaSuccess) e = cudaMalloc(&dS, S.size());
    if (e == cudaSuccess) e = cudaMalloc(&dQ, (size_t)dst.dstride * NE);
    if (e == cudaSuccess) e = cudaMalloc(&dQs, (size_t)dst.sstride * NE);
    if (e == cudaSuccess) e = cudaMalloc(&dbad, sizeof bad0);
    if (e == cudaSuccess) e = cudaMemcpy(dD, D.data(), D.size(), cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(dS, S.data(), S.size(), cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(dbad, bad0, sizeof bad0, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemset(dQ, 0x7F, (size_t)dst.dstride * NE); /* NaN codes: unwritten ones show */
    src.data = (const uint8_t *)dD;
    src.scale = (const uint8_t *)dS;
    dst.data = (const uint8_t *)dQ;
    dst.scale = (const uint8_t *)dQs;
    if (e == cudaSuccess) e = moe_k_mx_to_fp8(&src, &dst, (int *)dbad, 0);
    std::vector<uint8_t> Q((size_t)dst.dstride * NE);
    std::vector<float> Qs((size_t)dst.sstride / 4 * NE);
    int bad[2] = {0, 0};
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpy(Q.data(), dQ, Q.size(), cudaMemcpyDeviceToHost);
    if (e == cudaSuccess) e = cudaMemcpy(Qs.data(), dQs, Qs.size() * 4, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess) e = cudaMemcpy(bad, dbad, sizeof bad, cudaMemcpyDeviceToHost);
    cudaFree(dD);
    cudaFree(dS);
    cudaFree(dQ);
    cudaFree(dQs);
    cudaFree(dbad);
    const char *name = "MXFP4 -> E4M3 tile transcode";
    if (e != cudaSuccess) {
        moe_st_put(msg, n, used, "%s: CUDA error %s\n", name, cudaGetErrorString(e));
        return 1;
    }
    int wrong = 0;
    for (int ex = 0; ex < NE; ex++)
        for (int tr = 0; tr < RP / 128; tr++)
            for (int tc = 0; tc < KB; tc++) {
                const float sc = Qs[(size_t)ex * (dst.sstride / 4) + (size_t)tr * KB + tc];
                const bool refuse = ex == 0 && ((tr == 0 && tc == 2) || (tr == 1 && tc == 1));
                int wantR = 121;
                if (ex == 0 && tr == 0) wantR = tc == 0 ? 114 - MOE_MX_E4M3_DMAX : 1;
                if (ex == 0 && tr == 1 && tc == 2) wantR = 248;
                if (refuse) {
                    if (!(sc != sc) && wrong++ < 4) moe_st_put(msg, n, used, "  %s: tile (%d, %d, %d) not refused\n", name, ex, tr, tc);
                    continue;
                }
                if (sc != ldexpf(1.0f, wantR - 127) && wrong++ < 4)
                    moe_st_put(msg, n, used, "  %s: tile (%d, %d, %d) scale %a, want 2^%d\n", name, ex, tr, tc, sc, wantR - 127);
                for (int r = tr * 128; r < tr * 128 + 128; r++)
                    for (int c = tc * 128; c < KP && c < tc * 128 + 128; c++) {
                        const uint8_t pk = D[ex * dbytes + (size_t)r * (KP / 2) + c / 2];
                        const uint8_t es = S[ex * sbytes + (size_t)r * SB + c / 32];
                        const double want = (double)moe_e2m1_to_f32((uint8_t)(c % 2 ? pk >> 4 : pk)) * ldexp(1.0, es - 127);
                        const uint8_t code = Q[(size_t)ex * dst.dstride + (size_t)r * KP + c];
                        const double got = (double)moe_fp8_e4m3_to_f32(code) * (double)sc;
                        if ((got != want || signbit(got) != signbit(want)) && wrong++ < 4)
                            moe_st_put(msg, n, used, "  %s: expert %d [%d][%d] = %a (code 0x%02x), want %a\n", name, ex, r, c,
                                   got, code, want);
                    }
            }
    if (bad[0] != 2 || bad[1] != 2) {
        wrong++;
        moe_st_put(msg, n, used, "  %s: %d tiles refused (first %d), want 2 (first 2)\n", name, bad[0], bad[1]);
    }
    moe_st_put(msg, n, used, "%s: %d wrong (%d tiles, every E2M1 code x every d of the window)\n", name, wrong,
           NE * (RP / 128) * KB);
    return wrong > 0;
}

/* The cluster kernel against the single-block one, bit for bit: gate/up
 * (h's codes and scales) and down (Y) on five experts of 300, 0, 100, 256
 * and 129 token rows (tiles: a lone tile then a pair, an empty expert, a
 * lone partial tile, a full pair, a pair whose second tile has one row),
 * H = 640 (down: three weight tiles, the last with its second half past
 * the rows), I = 320 (gate/up: three weight tiles, so a lone token tile's
 * second pair item has no weight tile for its second block), K = 320 (a
 * half k block). Both kernels make the same MMAs in the same order for
 * each output (the header's invariant 1), so every byte must agree; on
 * the full grid and on one cluster (n_sm = 2: items wrap the ring many
 * times). Every h scale must be finite and positive and every Y finite
 * (every output written), so two kernels that both write nothing fail. */
int qg_ab(char *msg, size_t n, size_t *used, int n_sm) {
    static const int cnt[5] = {300, 0, 100, 256, 129};
    const int E = 5, K = 320, Ip = 320, H = 640, I_p = 384, KB = 3, NTg = 3;
    std::vector<mma_tile> tl;
    int np = 0;
    for (int e = 0; e < E; e++) {
        for (int m0 = np; m0 < np + cnt[e]; m0 += QG_BM) tl.push_back(mma_tile{e, m0, np + cnt[e]});
        np += cnt[e];
    }
    const int nt = (int)tl.size();
    auto rnd_code = [&]() {
        uint8_t c;
        do c = (uint8_t)qg_next(); while ((c & 0x7F) == 0x7F);
        return c;
    };
    std::vector<uint8_t> X((size_t)np * K), W1((size_t)E * I_p * K), W3(W1.size()), W2((size_t)E * H * Ip);
    std::vector<float> Xs((size_t)np * KB), S1((size_t)E * (I_p / 128) * KB), S3(S1.size()), S2((size_t)E * (H / 128) * KB);
    for (auto &c : X) c = rnd_code();
    for (auto &c : W1) c = rnd_code();
    for (auto &c : W3) c = rnd_code();
    for (auto &c : W2) c = rnd_code();
    for (auto &v : Xs) v = ldexpf(1.0f, (int)(qg_next() % 3) - 9);
    for (std::vector<float> *S : {&S1, &S3, &S2})
        for (auto &v : *S) v = ldexpf(1.0f + (float)(qg_next() % 4096) / 1024.0f, -8);
    const float one[5] = {1, 1, 1, 1, 1};
    void *d[12] = {};
    const size_t sz[12] = {X.size(), Xs.size() * 4, W1.size(), W3.size(), W2.size(), S1.size() * 4, S3.size() * 4,
                           S2.size() * 4, sizeof one, (size_t)nt * sizeof(mma_tile), 4, 0};
    const void *src[11] = {X.data(), Xs.data(), W1.data(), W3.data(), W2.data(), S1.data(), S3.data(), S2.data(),
                           one, tl.data(), &nt};
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < 11 && e == cudaSuccess; i++) {
        e = cudaMalloc(&d[i], sz[i]);
        if (e == cudaSuccess) e = cudaMemcpy(d[i], src[i], sz[i], cudaMemcpyHostToDevice);
    }
    uint8_t *dHq = nullptr;
    float *dHs = nullptr, *dY = nullptr;
    if (e == cudaSuccess) e = cudaMalloc((void **)&dHq, (size_t)np * Ip);
    if (e == cudaSuccess) e = cudaMalloc((void **)&dHs, (size_t)np * NTg * 4);
    if (e == cudaSuccess) e = cudaMalloc((void **)&dY, (size_t)np * H * 4);
    auto wts = [&](int rows, int di, int si) {
        dweights w;
        memset(&w, 0, sizeof w);
        w.fmt = DF_FP8;
        w.rows_p = rows;
        w.kp = K;
        w.n = E;
        w.dstride = (long long)rows * K;
        w.sstride = (long long)(rows / 128) * KB * 4;
        w.data = (const uint8_t *)d[di];
        w.scale = (const uint8_t *)d[si];
        w.scale2 = (const float *)d[8];
        return w;
    };
    const dweights w1 = wts(I_p, 2, 5), w3 = wts(I_p, 3, 6), w2 = wts(H, 4, 7);
    const mma_tile *dt = (const mma_tile *)d[9];
    const int32_t *dn = (const int32_t *)d[10];
    std::vector<uint8_t> hq[2];
    std::vector<float> hs[2], y[2];
    for (int pair = 0; pair < 2 && e == cudaSuccess; pair++) {
        hq[pair].resize((size_t)np * Ip);
        hs[pair].resize((size_t)np * NTg);
        y[pair].resize((size_t)np * H);
        e = cudaMemset(dHq, 0x5A, (size_t)np * Ip);
        if (e == cudaSuccess) e = cudaMemset(dHs, 0xFF, (size_t)np * NTg * 4);
        if (e == cudaSuccess) e = cudaMemset(dY, 0xFF, (size_t)np * H * 4);
        if (e == cudaSuccess)
            e = qg_gateup(&w1, &w3, (const uint8_t *)d[0], (const float *)d[1], K, dt, dn, nt, np, 10.0f, ACT_FP8_POW2,
                          dHq, dHs, Ip, n_sm, pair != 0, 0);
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
        if (e == cudaSuccess) e = cudaMemcpy(hq[pair].data(), dHq, hq[pair].size(), cudaMemcpyDeviceToHost);
        if (e == cudaSuccess) e = cudaMemcpy(hs[pair].data(), dHs, hs[pair].size() * 4, cudaMemcpyDeviceToHost);
        /* down on the single-block kernel's h in both runs: the two GEMMs are checked apart */
        if (e == cudaSuccess && pair == 1)
            e = cudaMemcpy(dHq, hq[0].data(), hq[0].size(), cudaMemcpyHostToDevice);
        if (e == cudaSuccess && pair == 1)
            e = cudaMemcpy(dHs, hs[0].data(), hs[0].size() * 4, cudaMemcpyHostToDevice);
        if (e == cudaSuccess)
            e = qg_down(&w2, dHq, dHs, Ip, nullptr, dt, dn, nt, np, dY, H, n_sm, pair != 0, 0);
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
        if (e == cudaSuccess) e = cudaMemcpy(y[pair].data(), dY, y[pair].size() * 4, cudaMemcpyDeviceToHost);
    }
    for (int i = 0; i < 11; i++) cudaFree(d[i]);
    cudaFree(dHq);
    cudaFree(dHs);
    cudaFree(dY);
    char name[96];
    snprintf(name, sizeof name, "fp8 x fp8 cluster kernel vs single block, 5 experts%s", n_sm == 2 ? ", one cluster" : "");
    if (e != cudaSuccess) {
        moe_st_put(msg, n, used, "%s: CUDA error %s\n", name, cudaGetErrorString(e));
        return 1;
    }
    size_t dq = 0, ds = 0, dy = 0, badh = 0, bady = 0;
    for (size_t i = 0; i < hq[0].size(); i++) dq += hq[0][i] != hq[1][i];
    for (size_t i = 0; i < hs[0].size(); i++) {
        ds += memcmp(&hs[0][i], &hs[1][i], 4) != 0;
        badh += !(hs[0][i] > 0.0f && hs[0][i] <= FLT_MAX);
    }
    for (size_t i = 0; i < y[0].size(); i++) {
        dy += memcmp(&y[0][i], &y[1][i], 4) != 0;
        bady += !(fabsf(y[0][i]) <= FLT_MAX);
    }
    moe_st_put(msg, n, used,
           "%s: h codes %zu of %zu differ, h scales %zu of %zu, Y %zu of %zu; unwritten or not finite: h scales %zu, "
           "Y %zu\n",
           name, dq, hq[0].size(), ds, hs[0].size(), dy, y[0].size(), badh, bady);
    return (dq + ds + dy + badh + bady) > 0;
}

} // namespace

extern "C" int moe_cuda_qg_selftest(char *msg, size_t n) {
    size_t used = 0;
    if (msg && n) msg[0] = 0;
    int n_sm = 0, dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        moe_st_put(msg, n, &used, "no device\n");
        return -1;
    }
    int fails = 0;
    double worst = 0;
    for (int g = 0; g < 2; g++) {
        fails += qg_gemm(msg, n, &used, true, g ? 1 : n_sm, nullptr);
        fails += qg_gemm(msg, n, &used, false, g ? 1 : n_sm, &worst);
    }
    fails += qg_mx_transcode(msg, n, &used);
    {
        cudaLaunchAttribute at;
        cudaLaunchConfig_t cfg = qg_cluster_config(&at, n_sm / 2, 0);
        int rc = 0;
        if (moe_smem_attr((const void *)k_qg<true, true>, QG_SMEM) == cudaSuccess &&
            cudaOccupancyMaxActiveClusters(&rc, k_qg<true, true>, &cfg) == cudaSuccess)
            moe_st_put(msg, n, &used, "fp8 x fp8 cluster kernel: %d clusters of 2 resident on %d SMs\n", rc, n_sm);
        (void)cudaGetLastError();
    }
    fails += qg_ab(msg, n, &used, n_sm);
    fails += qg_ab(msg, n, &used, 2);
    return fails;
}
