/*
 * GPU kernels of the block other than the grouped GEMMs: router, activation
 * rounding, sort by expert, the small-T GEMV experts with the fused combine,
 * the combine of the tensor-core path, benchmark fills.
 *
 * Invariants: see cuda_internal.cuh. In addition:
 *  1. The router follows src/router/router.c step by step (in fp32): the same
 *     strict order (score desc, id asc, NaN last), the same group rule.
 *  2. The combine is the f32 combine of src/experts/combine.c, in column order.
 *  3. GEMV partial sums: lane l takes units l, l + 32, ...; each unit's sum
 *     is scaled, accumulated in unit order, then reduced by a fixed xor tree.
 *  4. The sort's segments, tiles and offsets never vary between runs; only
 *     the order of positions inside a block's part of a segment does.
 */
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_selftest.h"
#include "cuda/cuda_selftest_host.h"
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <algorithm>
#include <vector>

/* ------------------------------------------------------------ helpers */

/* Prescale of activations in the GEMV's shared memory: x * 2^64 keeps the
 * products with the FP4 decoder's values (e2m1 x 2^-6) normal and exact. */
#define XPRE 0x1p64f
#define XPRE_INV 0x1p-64f

/* padded shared-memory index: 4 floats of padding every 32 (bank spread) */
__device__ __forceinline__ int xi(int i) { return i + (i >> 5) * 4; }

/* ------------------------------------------------------------- logits */

/* 64 x 64 output tile per block, 256 threads x 4 x 4, k step 16. */
__global__ void k_logits(const float *__restrict__ X, const float *__restrict__ G, int T, int E, int Hp,
                         float *__restrict__ out) {
    __shared__ float xs[16][64 + 4], gs[16][64 + 4];
    int t0 = blockIdx.y * 64, e0 = blockIdx.x * 64;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < Hp; k0 += 16) {
        for (int i = threadIdx.x; i < 64 * 16; i += 256) {
            int r = i / 16, k = i % 16;
            xs[k][r] = t0 + r < T ? X[(size_t)(t0 + r) * Hp + k0 + k] : 0.0f;
            gs[k][r] = e0 + r < E ? G[(size_t)(e0 + r) * Hp + k0 + k] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 16; k++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) { a[i] = xs[k][ty * 4 + i]; b[i] = gs[k][tx * 4 + i]; }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            int t = t0 + ty * 4 + i, e = e0 + tx * 4 + j;
            if (t < T && e < E) out[(size_t)t * E + e] = acc[i][j];
        }
}

cudaError_t moe_k_logits(const float *X, const float *G, int T, int E, int Hp, float *logits, cudaStream_t s) {
    dim3 grid((E + 63) / 64, (T + 63) / 64);
    k_logits<<<grid, 256, 0, s>>>(X, G, T, E, Hp, logits);
    return cudaGetLastError();
}

/* -------------------------------------------------------------- route */

/* a (id ia) ranks before b (id ib): larger, then lower id; NaN after all */
__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) {
    if (isnan(a) || isnan(b)) return isnan(a) == isnan(b) ? ia < ib : isnan(b);
    return a > b || (a == b && ia < ib);
}

/* top-k of v[0..n) into out[k] (k passes of a linear scan, as the reference) */
__device__ void topk_scan(const float *v, int n, int k, int *out) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            bool taken = false;
            for (int q = 0; q < j; q++) taken |= out[q] == i;
            if (taken) continue;
            if (best < 0 || ranks_before(v[i], i, v[best], best)) best = i;
        }
        out[j] = best;
    }
}

__global__ void k_route(route_params p, const float *__restrict__ logits, const float *__restrict__ bias,
                        const int32_t *__restrict__ tid2eid, const int64_t *__restrict__ token_ids,
                        float *__restrict__ work, int32_t *__restrict__ ids, float *__restrict__ tw,
                        float *__restrict__ ew) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= p.T) return;
    int E = p.E, K = p.K;
    const float *lg = logits + (size_t)t * E;
    float *pr = work + (size_t)t * 2 * E, *pb = pr + E;
    switch (p.score) {
    case 1: /* sigmoid */
        for (int e = 0; e < E; e++) pr[e] = 1.0f / (1.0f + expf(-lg[e]));
        break;
    case 2: /* sqrtsoftplus */
        for (int e = 0; e < E; e++) {
            float l = lg[e];
            pr[e] = sqrtf(l > 20.0f ? l : log1pf(expf(l)));
        }
        break;
    default: { /* softmax */
        float mx = -INFINITY;
        for (int e = 0; e < E; e++) mx = lg[e] > mx ? lg[e] : mx;
        if (isnan(mx) || isinf(mx)) mx = 0.0f;
        float sum = 0.0f;
        for (int e = 0; e < E; e++) { pr[e] = expf(lg[e] - mx); sum += pr[e]; }
        for (int e = 0; e < E; e++) pr[e] /= sum;
    }
    }
    int sel[MOE_CUDA_MAX_COLS];
    if (p.hash) {
        for (int j = 0; j < K; j++) sel[j] = tid2eid[token_ids[t] * K + j];
        for (int e = 0; e < E; e++) pb[e] = pr[e];
    } else {
        for (int e = 0; e < E; e++) pb[e] = pr[e] + (bias ? bias[e] : 0.0f);
        int G = p.n_group;
        if (G > 1 && p.topk_group < G) {
            int per = E / G;
            float gsc[64];
            int gsel[64];
            for (int g = 0; g < G; g++) {
                int top2[2];
                int m = per < 2 ? per : 2;
                topk_scan(pb + g * per, per, m, top2);
                float s = 0.0f;
                for (int q = 0; q < m; q++) s += pb[g * per + top2[q]];
                gsc[g] = s;
            }
            topk_scan(gsc, G, p.topk_group, gsel);
            for (int e = 0; e < E; e++) {
                bool keep = false;
                for (int q = 0; q < p.topk_group; q++) keep |= gsel[q] == e / per;
                if (!keep) pb[e] = p.group_mask_zero ? 0.0f : -INFINITY;
            }
        }
        topk_scan(pb, E, K, sel);
    }
    const float *src = p.biased_weights_fault ? pb : pr;
    float w[MOE_CUDA_MAX_COLS], sum = 0.0f;
    for (int j = 0; j < K; j++) { w[j] = src[sel[j]]; sum += w[j]; }
    if (p.renormalize && !p.not_renorm_fault) {
        float d = sum + p.renorm_eps;
        for (int j = 0; j < K; j++) w[j] /= d;
    }
    int C = p.C;
    for (int j = 0; j < K; j++) {
        float v = w[j] * p.router_mult;
        ids[(size_t)t * C + j] = sel[j];
        tw[(size_t)t * C + j] = v;
        ew[(size_t)t * C + j] = v * p.runner_mult * p.output_mult;
    }
    if (p.fused) {
        ids[(size_t)t * C + K] = E;
        tw[(size_t)t * C + K] = p.fused_shared_w;
        ew[(size_t)t * C + K] = p.fused_shared_w * p.runner_mult;
    }
}

cudaError_t moe_k_route(const route_params *p, const float *logits, const float *bias, const int32_t *tid2eid,
                        const int64_t *token_ids, float *work, int32_t *ids, float *tw, float *ew, cudaStream_t s) {
    k_route<<<(p->T + 127) / 128, 128, 0, s>>>(*p, logits, bias, tid2eid, token_ids, work, ids, tw, ew);
    return cudaGetLastError();
}

/* -------------------------------------------------- activation rounding */

/* One warp per (row, 128-block): 4 values per lane. */
__global__ void k_act_round(const float *__restrict__ X, int rows, int n, int ld_in, int act,
                            __nv_bfloat16 *__restrict__ Xb, int pitch) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    int nb = pitch / 128 + (pitch % 128 != 0);
    if (warp >= rows * nb) return;
    int r = warp / nb, c0 = (warp % nb) * 128;
    float v[4];
    warp_act128(X + (size_t)r * ld_in, c0, n, act, lane, v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int c = c0 + lane * 4 + i;
        if (c < pitch) Xb[(size_t)r * pitch + c] = __float2bfloat16_rn(c < n ? v[i] : 0.0f);
    }
}

cudaError_t moe_k_act_round(const float *X, int rows, int n, int ld_in, int act, __nv_bfloat16 *Xb, int pitch,
                            cudaStream_t s) {
    int nb = pitch / 128 + (pitch % 128 != 0);
    long long warps = (long long)rows * nb;
    if (warps == 0) return cudaSuccess;
    k_act_round<<<(unsigned)((warps * 32 + 255) / 256), 256, 0, s>>>(X, rows, n, ld_in, act, Xb, pitch);
    return cudaGetLastError();
}

/* --------------------------------------------------------------- sort */

/*
 * The sort by expert in two launches over blocks of SORT_CHUNK consecutive
 * assignments (a = t * K + j):
 *   k_sort_count: block b counts its chunk's assignments per expert into
 *     cnt [b, E] (shared atomics: counts do not depend on their order).
 *   k_sort_place: every block derives, from all of cnt, the experts'
 *     segments (offsets: exclusive scan of the totals over e), the tiles
 *     (the same list as a serial walk over e, then m0, would write) and
 *     its own start inside each segment (offset + the counts of the blocks
 *     before it), then writes its chunk's assignments there. Block 0
 *     writes offsets, tiles and n_tiles.
 * Up to SORT_CHUNK assignments (one block) moe_k_sort1 runs instead.
 * Positions inside one block's part of a segment come from shared atomics:
 * their order varies, the results do not (each row's GEMM output depends on
 * its own row alone, and outputs are written by assignment). The segments,
 * the tiles and which chunk's assignments fill which range never vary.
 */
#define SORT_CHUNK 2048
#define SORT_THREADS 512

static int sort_blocks(int A) { return A > 0 ? (A + SORT_CHUNK - 1) / SORT_CHUNK : 1; }

size_t moe_k_sort_scratch(int T, int K, int E) { return (size_t)sort_blocks(T * K) * (size_t)E; }

__global__ void __launch_bounds__(SORT_THREADS) k_sort_count(const int32_t *__restrict__ ids, int T, int K, int C,
                                                             int E, int32_t *__restrict__ cnt) {
    extern __shared__ int32_t sc[]; /* [E] */
    for (int e = threadIdx.x; e < E; e += blockDim.x) sc[e] = 0;
    __syncthreads();
    int A = T * K, a0 = blockIdx.x * SORT_CHUNK, a1 = min(A, a0 + SORT_CHUNK);
    for (int a = a0 + threadIdx.x; a < a1; a += blockDim.x) atomicAdd(&sc[ids[(size_t)(a / K) * C + a % K]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[(size_t)blockIdx.x * E + e] = sc[e];
}

/* In-place exclusive scan of v [n] (shared) by the whole block; returns the
 * total. Thread i takes a contiguous run of ceil(n / threads) values; the
 * runs' sums are scanned by warp shuffles, then across warps (wsum [32]). */
__device__ int block_scan_excl(int32_t *v, int n, int32_t *wsum) {
    int nt = blockDim.x, per = (n + nt - 1) / nt, lo = min(n, threadIdx.x * per), hi = min(n, lo + per);
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = (nt + 31) / 32;
    int s = 0;
    for (int i = lo; i < hi; i++) s += v[i];
    int inc = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    if (lane == 31) wsum[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int x = lane < nw ? wsum[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        wsum[lane] = x;
    }
    __syncthreads();
    int run = (warp ? wsum[warp - 1] : 0) + inc - s, total = wsum[nw - 1];
    for (int i = lo; i < hi; i++) {
        int t = v[i];
        v[i] = run;
        run += t;
    }
    __syncthreads(); /* wsum free for the next scan, v complete */
    return total;
}

__global__ void __launch_bounds__(SORT_THREADS) k_sort_place(const int32_t *__restrict__ ids, int T, int K, int C,
                                                             int E, int bm, const int32_t *__restrict__ cnt, int nb,
                                                             int32_t *__restrict__ perm, int32_t *__restrict__ offsets,
                                                             mma_tile *__restrict__ tiles, int max_tiles,
                                                             int32_t *__restrict__ n_tiles) {
    extern __shared__ int32_t sp[]; /* tot [E], off [E], ts [E], pos [E], wsum [32] */
    int32_t *tot = sp, *off = sp + E, *ts = sp + 2 * E, *pos = sp + 3 * E, *wsum = sp + 4 * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int s = 0, before = 0;
        for (int b = 0; b < nb; b++) {
            if (b == (int)blockIdx.x) before = s;
            s += cnt[(size_t)b * E + e];
        }
        tot[e] = s;
        off[e] = s;
        ts[e] = (s + bm - 1) / bm;
        pos[e] = before;
    }
    __syncthreads();
    int A = block_scan_excl(off, E, wsum);
    int ntot = block_scan_excl(ts, E, wsum);
    for (int e = threadIdx.x; e < E; e += blockDim.x) pos[e] += off[e];
    if (blockIdx.x == 0) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            offsets[e] = off[e];
            int end = off[e] + tot[e];
            for (int q = 0, m0 = off[e]; m0 < end && ts[e] + q < max_tiles; q++, m0 += bm)
                tiles[ts[e] + q] = mma_tile{e, m0, end};
        }
        if (threadIdx.x == 0) {
            offsets[E] = A;
            *n_tiles = min(ntot, max_tiles);
        }
    }
    __syncthreads();
    int a0 = blockIdx.x * SORT_CHUNK, a1 = min(T * K, a0 + SORT_CHUNK);
    for (int a = a0 + threadIdx.x; a < a1; a += blockDim.x) {
        int t = a / K, j = a % K;
        int e = ids[(size_t)t * C + j];
        perm[atomicAdd(&pos[e], 1)] = t * C + j;
    }
}

cudaError_t moe_k_sort(const int32_t *ids, int T, int K, int C, int E, int bm, int32_t *perm, int32_t *offsets,
                       mma_tile *tiles, int max_tiles, int32_t *n_tiles, int32_t *scratch, cudaStream_t s) {
    int nb = sort_blocks(T * K);
    /* one chunk (the small-T grouped GEMV's T): the single-block kernel, one
     * launch, as before this sort existed */
    if (nb == 1) return moe_k_sort1(ids, T, K, C, E, bm, perm, offsets, tiles, max_tiles, n_tiles, s);
    size_t s1 = (size_t)E * sizeof(int32_t), s2 = (size_t)(4 * E + 32) * sizeof(int32_t);
    if (s2 > 48 * 1024) return cudaErrorInvalidValue; /* E > 3064: more experts than the shared arrays hold */
    k_sort_count<<<nb, SORT_THREADS, s1, s>>>(ids, T, K, C, E, scratch);
    k_sort_place<<<nb, SORT_THREADS, s2, s>>>(ids, T, K, C, E, bm, scratch, nb, perm, offsets, tiles, max_tiles,
                                              n_tiles);
    return cudaGetLastError();
}

/* The single-block sort (the earlier kernel): moe_k_sort's for one chunk,
 * and the reference of its self-test (same offsets, tiles and segments). */
__global__ void k_sort1(const int32_t *__restrict__ ids, int T, int K, int C, int E, int bm,
                        int32_t *__restrict__ perm, int32_t *__restrict__ offsets, mma_tile *__restrict__ tiles,
                        int max_tiles, int32_t *__restrict__ n_tiles) {
    extern __shared__ int32_t sm[]; /* cnt [E], off [E + 1] */
    int32_t *cnt = sm, *off = sm + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    int A = T * K;
    for (int a = threadIdx.x; a < A; a += blockDim.x) {
        int e = ids[(size_t)(a / K) * C + a % K];
        atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0, nt = 0;
        for (int e = 0; e < E; e++) {
            off[e] = acc;
            offsets[e] = acc;
            for (int m0 = acc; m0 < acc + cnt[e] && nt < max_tiles; m0 += bm)
                tiles[nt++] = mma_tile{e, m0, acc + cnt[e]};
            acc += cnt[e];
        }
        off[E] = acc;
        offsets[E] = acc;
        *n_tiles = nt;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < A; a += blockDim.x) {
        int t = a / K, j = a % K;
        int e = ids[(size_t)t * C + j];
        int pos = off[e] + atomicAdd(&cnt[e], 1);
        perm[pos] = t * C + j;
    }
}

cudaError_t moe_k_sort1(const int32_t *ids, int T, int K, int C, int E, int bm, int32_t *perm, int32_t *offsets,
                        mma_tile *tiles, int max_tiles, int32_t *n_tiles, cudaStream_t s) {
    size_t smem = (size_t)(2 * E + 1) * sizeof(int32_t);
    k_sort1<<<1, 1024, smem, s>>>(ids, T, K, C, E, bm, perm, offsets, tiles, max_tiles, n_tiles);
    return cudaGetLastError();
}

/* -------------------------------------------------------------- GEMV */

/* Elements per 16-byte unit of a row. */
template <int F> struct unit_elems { static const int v = F == DF_BF16 ? 8 : F == DF_FP8 ? 16 : 32; };

/* The dot product of 16-byte unit u of one weight row with the prescaled
 * activations xs (shared, padded), times the unit's block scale, divided by
 * the prescale. rowq: the row's bytes; srow: the row's scales (FP4: codes of
 * this row; FP8: the row's tile row of float scales). */
template <int F>
__device__ __forceinline__ float dot_unit(uint4 q, const uint8_t *srow, int u, const float *xs) {
    const uint32_t wd[4] = {q.x, q.y, q.z, q.w};
    if (F == DF_BF16) {
        const float *x = xs + xi(u * 8);
        float4 x0 = *reinterpret_cast<const float4 *>(x), x1 = *reinterpret_cast<const float4 *>(x + 4);
        float s = bf16_lo(wd[0]) * x0.x;
        s = fmaf(bf16_hi(wd[0]), x0.y, s);
        s = fmaf(bf16_lo(wd[1]), x0.z, s);
        s = fmaf(bf16_hi(wd[1]), x0.w, s);
        s = fmaf(bf16_lo(wd[2]), x1.x, s);
        s = fmaf(bf16_hi(wd[2]), x1.y, s);
        s = fmaf(bf16_lo(wd[3]), x1.z, s);
        s = fmaf(bf16_hi(wd[3]), x1.w, s);
        return s * XPRE_INV;
    } else if (F == DF_FP8) {
        const float *x = xs + xi(u * 16);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float4 xv = *reinterpret_cast<const float4 *>(x + 4 * i);
            float2 a = fp8x2_to_f2((uint16_t)(wd[i] & 0xFFFFu)), b = fp8x2_to_f2((uint16_t)(wd[i] >> 16));
            s = fmaf(a.x, xv.x, s);
            s = fmaf(a.y, xv.y, s);
            s = fmaf(b.x, xv.z, s);
            s = fmaf(b.y, xv.w, s);
        }
        float sc = reinterpret_cast<const float *>(srow)[(u * 16) / 128];
        return s * XPRE_INV * sc;
    } else {
        const float *x = xs + xi(u * 32);
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            /* 8 nibbles -> 8 E4M3 bytes in two words (e2m1 x 2^-6, exact):
             * even nibbles (low nibble of each byte) and odd ones, then
             * one cvt per pair to f16x2 (exact), then fp32 FMAs. */
            uint32_t ev, od;
            e2m1x8_to_e4m3(wd[i], ev, od);
            float4 xa = *reinterpret_cast<const float4 *>(x + 8 * i), xb = *reinterpret_cast<const float4 *>(x + 8 * i + 4);
            float2 e0 = fp8x2_to_f2((uint16_t)(ev & 0xFFFFu)), e1 = fp8x2_to_f2((uint16_t)(ev >> 16));
            float2 o0 = fp8x2_to_f2((uint16_t)(od & 0xFFFFu)), o1 = fp8x2_to_f2((uint16_t)(od >> 16));
            float &acc = (F == DF_NVFP4 && i >= 2) ? s1 : s0;
            acc = fmaf(e0.x, xa.x, acc); /* element 8i + 0 */
            acc = fmaf(o0.x, xa.y, acc); /* 1 */
            acc = fmaf(e0.y, xa.z, acc); /* 2 */
            acc = fmaf(o0.y, xa.w, acc); /* 3 */
            acc = fmaf(e1.x, xb.x, acc); /* 4 */
            acc = fmaf(o1.x, xb.y, acc); /* 5 */
            acc = fmaf(e1.y, xb.z, acc); /* 6 */
            acc = fmaf(o1.y, xb.w, acc); /* 7 */
        }
        /* s * 2^-58 is the dot of the codes' values with x (x carries 2^64,
         * the codes 2^-6); activations stay below 2^57 (bf16 hidden states) */
        if (F == DF_MXFP4) return (s0 * 0x1p-58f) * moe_e8m0_to_f32(srow[u]);
        return (s0 * 0x1p-58f) * moe_ue4m3_to_f32(srow[2 * u]) + (s1 * 0x1p-58f) * moe_ue4m3_to_f32(srow[2 * u + 1]);
    }
}

/* Stage a bf16 activation row [Hp] (Hp % 64 == 0) into padded shared memory,
 * prescaled: 16-byte loads, all of a thread's loads in flight at once. */
__device__ __forceinline__ void stage_x(const __nv_bfloat16 *__restrict__ x, int Hp, float *xs) {
    const uint4 *x4 = reinterpret_cast<const uint4 *>(x);
    int n8 = Hp / 8;
#pragma unroll 4
    for (int v = threadIdx.x; v < n8; v += blockDim.x) {
        uint4 q = x4[v];
        float *d = xs + xi(v * 8); /* 8 consecutive elements never straddle a pad */
        *reinterpret_cast<float4 *>(d) =
            make_float4(bf16_lo(q.x) * XPRE, bf16_hi(q.x) * XPRE, bf16_lo(q.y) * XPRE, bf16_hi(q.y) * XPRE);
        *reinterpret_cast<float4 *>(d + 4) =
            make_float4(bf16_lo(q.z) * XPRE, bf16_hi(q.z) * XPRE, bf16_lo(q.w) * XPRE, bf16_hi(q.w) * XPRE);
    }
}

#define GEMV_GU_ROWS 16 /* i per block: 8 warps x 2 */
#define GU_UNR 4        /* unrolled 16-byte units per lane (H 4096 MXFP4: all of a row's) */

template <int F>
__global__ void __launch_bounds__(256) k_gateup_gemv(dweights w1, dweights w3, const __nv_bfloat16 *__restrict__ Xb,
                                                     int Hp, const int32_t *__restrict__ ids, int K, int C,
                                                     float limit, float *__restrict__ Hf, int Ip) {
    griddep_launch(); /* the down GEMV may take free slots now; it waits for this grid before reading Hf */
    extern __shared__ float xs[];
    int a = blockIdx.y;
    int t = ids ? a / K : a;
    int e = ids ? ids[(size_t)t * C + a % K] : 0;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int i0 = blockIdx.x * GEMV_GU_ROWS + warp * 2;
    const int U = unit_elems<F>::v, nu = Hp / U;
    size_t rb = row_bytes<F>(w1.kp);
    const uint8_t *r1 = w1.data + (size_t)e * w1.dstride + (size_t)i0 * rb;
    const uint8_t *r3 = w3.data + (size_t)e * w3.dstride + (size_t)i0 * rb;
    /* FP4: the weights start moving before the activations are staged (BF16
     * ran slower with the prefetch: twice the load instructions of a
     * memory-bound loop, docs/performance-cuda.md) */
    for (int u = lane; F >= DF_MXFP4 && u < nu; u += 32) {
        prefetch_l2(r1 + (size_t)u * 16);
        prefetch_l2(r1 + rb + (size_t)u * 16);
        prefetch_l2(r3 + (size_t)u * 16);
        prefetch_l2(r3 + rb + (size_t)u * 16);
    }
    stage_x(Xb + (size_t)t * Hp, Hp, xs);
    __syncthreads();
    const uint8_t *s1a = F == DF_BF16 ? nullptr : scale_row<F>(w1, e, i0);
    const uint8_t *s1b = F == DF_BF16 ? nullptr : scale_row<F>(w1, e, i0 + 1);
    const uint8_t *s3a = F == DF_BF16 ? nullptr : scale_row<F>(w3, e, i0);
    const uint8_t *s3b = F == DF_BF16 ? nullptr : scale_row<F>(w3, e, i0 + 1);
    float g0 = 0.0f, g1 = 0.0f, u0 = 0.0f, u1 = 0.0f;
    /* all loads of GU_UNR iterations in flight before the first use */
    for (int ub = lane; ub < nu; ub += 32 * GU_UNR) {
        uint4 q[GU_UNR][4];
#pragma unroll
        for (int k = 0; k < GU_UNR; k++) {
            int u = ub + 32 * k;
            if (u < nu) {
                q[k][0] = ldg16(r1 + (size_t)u * 16);
                q[k][1] = ldg16(r1 + rb + (size_t)u * 16);
                q[k][2] = ldg16(r3 + (size_t)u * 16);
                q[k][3] = ldg16(r3 + rb + (size_t)u * 16);
            }
        }
#pragma unroll
        for (int k = 0; k < GU_UNR; k++) {
            int u = ub + 32 * k;
            if (u < nu) {
                g0 += dot_unit<F>(q[k][0], s1a, u, xs);
                g1 += dot_unit<F>(q[k][1], s1b, u, xs);
                u0 += dot_unit<F>(q[k][2], s3a, u, xs);
                u1 += dot_unit<F>(q[k][3], s3b, u, xs);
            }
        }
    }
    g0 = warp_sum(g0);
    g1 = warp_sum(g1);
    u0 = warp_sum(u0);
    u1 = warp_sum(u1);
    if (lane == 0) {
        float sg = w1.scale2 ? w1.scale2[e] : 1.0f, su = w3.scale2 ? w3.scale2[e] : 1.0f;
        Hf[(size_t)a * Ip + i0] = swiglu(g0 * sg, u0 * su, limit);
        Hf[(size_t)a * Ip + i0 + 1] = swiglu(g1 * sg, u1 * su, limit);
    }
}

cudaError_t moe_k_gateup_gemv(const dweights *w1, const dweights *w3, const __nv_bfloat16 *Xb, int Hp,
                              const int32_t *ids, int K, int C, int n_assign, float limit, float *Hf, int Ip,
                              cudaStream_t s) {
    if (n_assign == 0) return cudaSuccess;
    dim3 grid(Ip / GEMV_GU_ROWS, n_assign);
    size_t smem = (size_t)(Hp + Hp / 32 * 4) * sizeof(float);
    static void (*const ks[4])(dweights, dweights, const __nv_bfloat16 *, int, const int32_t *, int, int, float,
                               float *, int) = {k_gateup_gemv<DF_BF16>, k_gateup_gemv<DF_FP8>, k_gateup_gemv<DF_MXFP4>,
                                                k_gateup_gemv<DF_NVFP4>};
    return moe_launch_fmt(w1->fmt, ks, grid, 256, smem, s, *w1, *w3, Xb, Hp, ids, K, C, limit, Hf, Ip);
}

/* Combine of one output element, the f32 combine of block.c, given the
 * routed part sum_j tw_j * y_j accumulated in column order. */
__device__ __forceinline__ void combine_finish(const combine_params &cp, int t, int h, float part, float sh) {
    const float *tw = cp.tw + (size_t)t * cp.C;
    float ro = __fmul_rn(__fmul_rn(part, cp.runner_mult), cp.output_mult);
    float mo;
    if (cp.fused) mo = __fmul_rn(__fadd_rn(part, __fmul_rn(tw[cp.K], sh)), cp.runner_mult);
    else mo = __fadd_rn(ro, sh);
    size_t o = (size_t)t * cp.H + h;
    cp.routed[o] = ro;
    cp.shared[o] = sh;
    cp.out[o] = mo;
}

#define GEMV_DN_ROWS 16 /* rows per block: 8 warps x 2 */

/* Load act(Hf row) into padded shared memory, prescaled. The whole block
 * takes part; FP8 blocks of 128 get their amax through a warp each. */
__device__ void load_act_row(const float *__restrict__ src, int Ip, int act, float *dst) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    for (int b = warp; b * 128 < Ip; b += nw) {
        float v[4];
        warp_act128(src, b * 128, Ip, act, lane, v);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int c = b * 128 + lane * 4 + i;
            /* the bf16 operand (exact for bf16 and power-of-two FP8) */
            if (c < Ip) dst[xi(c)] = __bfloat162float(__float2bfloat16_rn(v[i])) * XPRE;
        }
    }
}

template <int F, bool COMBINE, int NC>
__global__ void __launch_bounds__(256) k_down_gemv(dweights w2, const float *__restrict__ Hf, int Ip, int act,
                                                   const int32_t *__restrict__ ids, combine_params cp,
                                                   float *__restrict__ Y, int Yp) {
    extern __shared__ float hs[];
    int t = blockIdx.y;
    int ncol = COMBINE ? cp.K : 1;
    int pitch = Ip + Ip / 32 * 4;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int U = unit_elems<F>::v, nu = Ip / U;
    size_t rb = row_bytes<F>(w2.kp);
    int e[NC];
#pragma unroll
    for (int j = 0; j < NC; j++) e[j] = (COMBINE && j < ncol) ? ids[(size_t)t * cp.C + j] : 0;
    /* FP4: the weights start moving before the activations are staged */
#pragma unroll
    for (int j = 0; j < NC; j++)
        if (F >= DF_MXFP4 && j < ncol)
            for (int rr = 0; rr < 2; rr++) {
                const uint8_t *row =
                    w2.data + (size_t)e[j] * w2.dstride + (size_t)(blockIdx.x * GEMV_DN_ROWS + warp * 2 + rr) * rb;
                for (int u = lane; u < nu; u += 32) prefetch_l2(row + (size_t)u * 16);
            }
    griddep_wait(); /* launched programmatically: gate/up's Hf is complete and visible past here */
    for (int j = 0; j < ncol; j++) load_act_row(Hf + ((size_t)t * ncol + j) * Ip, Ip, act, hs + j * pitch);
    __syncthreads();
    for (int rr = 0; rr < 2; rr++) {
        int h = blockIdx.x * GEMV_DN_ROWS + warp * 2 + rr;
        float acc[NC];
#pragma unroll
        for (int j = 0; j < NC; j++) acc[j] = 0.0f;
#pragma unroll 2
        for (int u = lane; u < nu; u += 32) {
#pragma unroll
            for (int j = 0; j < NC; j++) {
                if (j < ncol) {
                    const uint8_t *row = w2.data + (size_t)e[j] * w2.dstride + (size_t)h * rb;
                    uint4 q = ldg16(row + (size_t)u * 16);
                    acc[j] += dot_unit<F>(q, F == DF_BF16 ? nullptr : scale_row<F>(w2, e[j], h), u, hs + j * pitch);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < NC; j++)
            if (j < ncol) acc[j] = warp_sum(acc[j]) * (w2.scale2 ? w2.scale2[e[j]] : 1.0f);
        if (lane == 0) {
            if (!COMBINE) {
                Y[(size_t)t * Yp + h] = acc[0];
            } else if (h < cp.H) {
                float sh = cp.has_shared ? cp.Ysh[(size_t)t * cp.Ysh_pitch + h] : 0.0f;
                const float *tw = cp.tw + (size_t)t * cp.C;
                float part = 0.0f;
#pragma unroll
                for (int j = 0; j < NC; j++)
                    if (j < ncol) part = __fadd_rn(part, __fmul_rn(tw[j], acc[j]));
                combine_finish(cp, t, h, part, sh);
            }
        }
    }
}

cudaError_t moe_k_down_gemv(const dweights *w2, const float *Hf, int Ip, int act, const int32_t *ids,
                            const combine_params *cp, int T, float *Y, int Yp, cudaStream_t s, bool pdl) {
    if (T == 0) return cudaSuccess;
    bool comb = ids != nullptr;
    int ncol = comb ? cp->K : 1;
    dim3 grid(w2->rows_p / GEMV_DN_ROWS, T);
    size_t smem = (size_t)ncol * (Ip + Ip / 32 * 4) * sizeof(float);
    combine_params c0 = {};
    const combine_params &c = cp ? *cp : c0;
    /* one column without combine; K routed columns combined (8, or up to MOE_CUDA_MAX_COLS) */
    typedef void (*dn_fn)(dweights, const float *, int, int, const int32_t *, combine_params, float *, int);
#define DN(CB, NC) {k_down_gemv<DF_BF16, CB, NC>, k_down_gemv<DF_FP8, CB, NC>, k_down_gemv<DF_MXFP4, CB, NC>, \
                    k_down_gemv<DF_NVFP4, CB, NC>}
    static const dn_fn single[4] = DN(false, 1), comb8[4] = DN(true, 8), combmax[4] = DN(true, MOE_CUDA_MAX_COLS);
#undef DN
    const dn_fn(&ks)[4] = !comb ? single : ncol <= 8 ? comb8 : combmax;
    return moe_launch_fmt_pdl(w2->fmt, ks, grid, 256, smem, s, pdl, *w2, Hf, Ip, act, ids, c, Y, Yp);
}

/* ------------------------------------------------------------- combine */

__global__ void k_combine(const float *__restrict__ Y, int Yp, combine_params cp) {
    griddep_wait(); /* launched programmatically: the down GEMV's Y past here (every thread, before any exit) */
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)cp.T * cp.H) return;
    int t = (int)(i / cp.H), h = (int)(i % cp.H);
    const float *tw = cp.tw + (size_t)t * cp.C;
    float part = 0.0f;
    for (int j = 0; j < cp.K; j++) part = __fadd_rn(part, __fmul_rn(tw[j], Y[((size_t)t * cp.C + j) * Yp + h]));
    float sh = cp.has_shared ? cp.Ysh[(size_t)t * cp.Ysh_pitch + h] : 0.0f;
    combine_finish(cp, t, h, part, sh);
}

#define COMB_BATCH 8 /* Y loads of one thread in flight before the first add */

/* The same combine, 4 consecutive columns per thread: 16-byte loads of Y
 * (streaming: read once), all of a batch of COMB_BATCH columns issued
 * before the sums, 16-byte stores. Per element the same operations in the
 * same order as k_combine (bit for bit). Needs H, Yp, Ysh_pitch multiples of
 * 4 and 16-byte aligned arrays (moe_k_combine checks). */
__global__ void k_combine4(const float *__restrict__ Y, int Yp, combine_params cp) {
    griddep_wait(); /* launched programmatically: the down GEMV's Y past here (every thread, before any exit) */
    int n4 = cp.H / 4;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)cp.T * n4) return;
    int t = (int)(i / n4), h = (int)(i % n4) * 4;
    const float *tw = cp.tw + (size_t)t * cp.C;
    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j0 = 0; j0 < cp.K; j0 += COMB_BATCH) {
        float4 y[COMB_BATCH];
#pragma unroll
        for (int q = 0; q < COMB_BATCH; q++)
            if (j0 + q < cp.K) y[q] = __ldcs(reinterpret_cast<const float4 *>(Y + ((size_t)t * cp.C + j0 + q) * Yp + h));
#pragma unroll
        for (int q = 0; q < COMB_BATCH; q++)
            if (j0 + q < cp.K) {
                float w = tw[j0 + q];
                p[0] = __fadd_rn(p[0], __fmul_rn(w, y[q].x));
                p[1] = __fadd_rn(p[1], __fmul_rn(w, y[q].y));
                p[2] = __fadd_rn(p[2], __fmul_rn(w, y[q].z));
                p[3] = __fadd_rn(p[3], __fmul_rn(w, y[q].w));
            }
    }
    float4 s4 = cp.has_shared ? *reinterpret_cast<const float4 *>(cp.Ysh + (size_t)t * cp.Ysh_pitch + h)
                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float sh[4] = {s4.x, s4.y, s4.z, s4.w};
    float ro[4], mo[4];
#pragma unroll
    for (int k = 0; k < 4; k++) { /* combine_finish's arithmetic */
        ro[k] = __fmul_rn(__fmul_rn(p[k], cp.runner_mult), cp.output_mult);
        if (cp.fused) mo[k] = __fmul_rn(__fadd_rn(p[k], __fmul_rn(tw[cp.K], sh[k])), cp.runner_mult);
        else mo[k] = __fadd_rn(ro[k], sh[k]);
    }
    size_t o = (size_t)t * cp.H + h;
    *reinterpret_cast<float4 *>(cp.routed + o) = make_float4(ro[0], ro[1], ro[2], ro[3]);
    *reinterpret_cast<float4 *>(cp.shared + o) = s4;
    *reinterpret_cast<float4 *>(cp.out + o) = make_float4(mo[0], mo[1], mo[2], mo[3]);
}

static bool al16(const void *p) { return ((uintptr_t)p & 15) == 0; }

cudaError_t moe_k_combine(const float *Y, int Yp, const combine_params *cp, cudaStream_t s, bool pdl) {
    long long n = (long long)cp->T * cp->H;
    if (n == 0) return cudaSuccess;
    bool v4 = cp->H % 4 == 0 && Yp % 4 == 0 && (!cp->has_shared || (cp->Ysh_pitch % 4 == 0 && al16(cp->Ysh))) &&
              al16(Y) && al16(cp->routed) && al16(cp->shared) && al16(cp->out);
    if (v4) return moe_launch_pdl(k_combine4, dim3((unsigned)((n / 4 + 255) / 256)), 256, 0, s, pdl, Y, Yp, *cp);
    return moe_launch_pdl(k_combine, dim3((unsigned)((n + 255) / 256)), 256, 0, s, pdl, Y, Yp, *cp);
}

/* --------------------------------------------------------- bench fills */

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__global__ void k_fill_random(uint8_t *p, size_t n, uint64_t seed, int kind) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (; i < n / 8; i += stride) {
        uint64_t v = mix64(seed + i * 0x9E3779B97F4A7C15ull);
        switch (kind) {
        case 1: v &= 0xBFBFBFBFBFBFBFBFull; break;
        case 2: v = (v & 0x807F807F807F807Full) | 0x3F003F003F003F00ull; break;
        case 3: v = (v & 0x0707070707070707ull) | 0x7878787878787878ull; break;
        case 4: v = (v & 0x0F0F0F0F0F0F0F0Full) | 0x3030303030303030ull; break;
        default: break;
        }
        reinterpret_cast<uint64_t *>(p)[i] = v;
    }
}

cudaError_t moe_k_fill_random(uint8_t *p, size_t n, uint64_t seed, int kind, cudaStream_t s) {
    k_fill_random<<<1024, 256, 0, s>>>(p, n, seed, kind);
    return cudaGetLastError();
}

__global__ void k_fill_f32(float *p, size_t n, float v) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

cudaError_t moe_k_fill_f32(float *p, size_t n, float v, cudaStream_t s) {
    k_fill_f32<<<256, 256, 0, s>>>(p, n, v);
    return cudaGetLastError();
}

/* ------------------------------------------------------------ self-test */

namespace {

moe_st_rng ng_rng = {0x9E3779B97F4A7C15ull};
uint32_t ng_next() { return ng_rng.next(); }

/* moe_k_sort against moe_k_sort1 and the host on one routing: offsets,
 * n_tiles and tiles equal; every segment holds the same assignments (as
 * sets: the order inside a segment varies) and exactly those whose expert
 * it is, each assignment once. skew: 0 uniform, 1 half of all assignments
 * on expert 3 and experts E/3 .. 2E/3 empty, 2 every assignment on the
 * last expert. */
int ng_sort_case(char *msg, size_t n, size_t *used, int T, int K, int C, int E, int bm, int skew) {
    std::vector<int32_t> ids((size_t)T * C, E);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < K; j++) {
            int e = (int)(ng_next() % (uint32_t)E);
            if (skew == 1 && (ng_next() & 1)) e = 3;
            if (skew == 1 && e >= E / 3 && e < 2 * E / 3) e = 3;
            if (skew == 2) e = E - 1;
            ids[(size_t)t * C + j] = e;
        }
    int A = T * K, mt = (A + bm - 1) / bm + E;
    size_t sc = moe_k_sort_scratch(T, K, E);
    int32_t *d_ids = nullptr, *d_sc = nullptr, *d_p[2] = {}, *d_o[2] = {}, *d_n[2] = {};
    mma_tile *d_t[2] = {};
    cudaError_t e = cudaMalloc(&d_ids, ids.size() * 4);
    if (e == cudaSuccess) e = cudaMalloc(&d_sc, sc * 4);
    for (int v = 0; v < 2; v++) {
        if (e == cudaSuccess) e = cudaMalloc(&d_p[v], (size_t)A * 4 + 4);
        if (e == cudaSuccess) e = cudaMalloc(&d_o[v], (size_t)(E + 1) * 4);
        if (e == cudaSuccess) e = cudaMalloc(&d_n[v], 4);
        if (e == cudaSuccess) e = cudaMalloc(&d_t[v], (size_t)mt * sizeof(mma_tile));
        if (e == cudaSuccess) e = cudaMemset(d_t[v], 0xFF, (size_t)mt * sizeof(mma_tile));
        if (e == cudaSuccess) e = cudaMemset(d_p[v], 0xFF, (size_t)A * 4 + 4);
    }
    if (e == cudaSuccess) e = cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = moe_k_sort1(d_ids, T, K, C, E, bm, d_p[0], d_o[0], d_t[0], mt, d_n[0], 0);
    if (e == cudaSuccess) e = moe_k_sort(d_ids, T, K, C, E, bm, d_p[1], d_o[1], d_t[1], mt, d_n[1], d_sc, 0);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    std::vector<int32_t> perm[2], off[2];
    std::vector<mma_tile> tl[2];
    int nt[2] = {-1, -1};
    for (int v = 0; v < 2; v++) {
        perm[v].resize((size_t)A + 1);
        off[v].resize((size_t)E + 1);
        tl[v].resize((size_t)mt);
        if (e == cudaSuccess) e = cudaMemcpy(perm[v].data(), d_p[v], perm[v].size() * 4, cudaMemcpyDeviceToHost);
        if (e == cudaSuccess) e = cudaMemcpy(off[v].data(), d_o[v], off[v].size() * 4, cudaMemcpyDeviceToHost);
        if (e == cudaSuccess) e = cudaMemcpy(tl[v].data(), d_t[v], tl[v].size() * sizeof(mma_tile), cudaMemcpyDeviceToHost);
        if (e == cudaSuccess) e = cudaMemcpy(&nt[v], d_n[v], 4, cudaMemcpyDeviceToHost);
        cudaFree(d_p[v]);
        cudaFree(d_o[v]);
        cudaFree(d_n[v]);
        cudaFree(d_t[v]);
    }
    cudaFree(d_ids);
    cudaFree(d_sc);
    char name[96];
    snprintf(name, sizeof name, "sort T %d K %d C %d E %d bm %d skew %d", T, K, C, E, bm, skew);
    if (e != cudaSuccess) {
        moe_st_put(msg, n, used, "%s: CUDA error %s\n", name, cudaGetErrorString(e));
        return 1;
    }
    int bad = 0;
    /* host: offsets from the counts */
    std::vector<int> cnt((size_t)E, 0);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < K; j++) cnt[(size_t)ids[(size_t)t * C + j]]++;
    for (int x = 0, acc = 0; x <= E; x++) {
        for (int v = 0; v < 2; v++)
            if (off[v][(size_t)x] != acc && bad++ < 3)
                moe_st_put(msg, n, used, "  %s: %s offsets[%d] = %d, want %d\n", name, v ? "multi" : "single", x,
                       off[v][(size_t)x], acc);
        if (x < E) acc += cnt[(size_t)x];
    }
    if (nt[0] != nt[1] && bad++ < 3) moe_st_put(msg, n, used, "  %s: n_tiles %d, single %d\n", name, nt[1], nt[0]);
    for (int q = 0; q < nt[0] && q < mt; q++) {
        const mma_tile &a = tl[0][(size_t)q], &b = tl[1][(size_t)q];
        if ((a.e != b.e || a.p0 != b.p0 || a.p_end != b.p_end) && bad++ < 3)
            moe_st_put(msg, n, used, "  %s: tile %d = {%d %d %d}, single {%d %d %d}\n", name, q, b.e, b.p0, b.p_end, a.e,
                   a.p0, a.p_end);
    }
    if (perm[1][(size_t)A] != -1 && bad++ < 3) moe_st_put(msg, n, used, "  %s: perm written past T * K\n", name);
    std::vector<char> seen((size_t)T * C, 0);
    for (int x = 0; x < E; x++) {
        int p0 = off[0][(size_t)x], p1 = off[0][(size_t)x + 1];
        std::vector<int32_t> s0(perm[0].begin() + p0, perm[0].begin() + p1), s1(perm[1].begin() + p0, perm[1].begin() + p1);
        std::sort(s0.begin(), s0.end());
        std::sort(s1.begin(), s1.end());
        if (s0 != s1 && bad++ < 3) moe_st_put(msg, n, used, "  %s: expert %d's segment differs from single's\n", name, x);
        for (int32_t r : s1) {
            bool ok = r >= 0 && r < T * C && r % C < K && ids[(size_t)r] == x && !seen[(size_t)r];
            if (!ok && bad++ < 3) moe_st_put(msg, n, used, "  %s: expert %d's segment holds %d\n", name, x, r);
            if (ok) seen[(size_t)r] = 1;
        }
    }
    moe_st_put(msg, n, used, "%s: %d wrong\n", name, bad);
    return bad > 0;
}

/* k_combine4 against k_combine bit for bit on random Y (every exponent of
 * the normal range and zeros' signs), weights and shared outputs: the three
 * outputs of every element. */
int ng_combine_case(char *msg, size_t n, size_t *used, int T, int H, int K, bool fused, bool has_shared) {
    int C = K + (fused ? 1 : 0), Yp = H + 12, Sp = H + 4;
    std::vector<float> Y((size_t)T * C * Yp), tw((size_t)T * C), Ysh((size_t)T * Sp);
    auto rf = [&]() {
        uint32_t u = ng_next() << 1 ^ ng_next();
        if ((u & 0x7F800000u) == 0x7F800000u) u &= 0x807FFFFFu; /* finite */
        float f;
        memcpy(&f, &u, 4);
        return f;
    };
    for (auto &v : Y) v = rf();
    for (auto &v : tw) v = (float)(ng_next() % 4096) / 4096.0f;
    for (auto &v : Ysh) v = rf();
    float *dY = nullptr, *dtw = nullptr, *dsh = nullptr, *dout[2] = {};
    size_t no = (size_t)T * H;
    cudaError_t e = cudaMalloc(&dY, Y.size() * 4);
    if (e == cudaSuccess) e = cudaMalloc(&dtw, tw.size() * 4);
    if (e == cudaSuccess) e = cudaMalloc(&dsh, Ysh.size() * 4);
    for (int v = 0; v < 2; v++) {
        if (e == cudaSuccess) e = cudaMalloc(&dout[v], 3 * no * 4);
        if (e == cudaSuccess) e = cudaMemset(dout[v], 0xFF, 3 * no * 4);
    }
    if (e == cudaSuccess) e = cudaMemcpy(dY, Y.data(), Y.size() * 4, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(dtw, tw.data(), tw.size() * 4, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(dsh, Ysh.data(), Ysh.size() * 4, cudaMemcpyHostToDevice);
    combine_params cp;
    memset(&cp, 0, sizeof cp);
    cp.T = T;
    cp.H = H;
    cp.K = K;
    cp.C = C;
    cp.fused = fused;
    cp.has_shared = has_shared;
    cp.runner_mult = 0.75f;
    cp.output_mult = 1.25f;
    cp.tw = dtw;
    cp.Ysh = has_shared ? dsh : nullptr;
    cp.Ysh_pitch = has_shared ? Sp : 0;
    std::vector<float> out[2];
    for (int v = 0; v < 2 && e == cudaSuccess; v++) {
        cp.routed = dout[v];
        cp.shared = dout[v] + no;
        cp.out = dout[v] + 2 * no;
        if (v == 0) k_combine<<<(unsigned)((no + 255) / 256), 256>>>(dY, Yp, cp);
        else e = moe_k_combine(dY, Yp, &cp, 0, false); /* the 16-byte kernel: these shapes qualify */
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
        out[v].resize(3 * no);
        if (e == cudaSuccess) e = cudaMemcpy(out[v].data(), dout[v], 3 * no * 4, cudaMemcpyDeviceToHost);
    }
    cudaFree(dY);
    cudaFree(dtw);
    cudaFree(dsh);
    cudaFree(dout[0]);
    cudaFree(dout[1]);
    char name[96];
    snprintf(name, sizeof name, "combine T %d H %d K %d%s%s", T, H, K, fused ? " fused" : "",
             has_shared ? " shared" : "");
    if (e != cudaSuccess) {
        moe_st_put(msg, n, used, "%s: CUDA error %s\n", name, cudaGetErrorString(e));
        return 1;
    }
    int bad = 0;
    for (size_t i = 0; i < 3 * no; i++)
        if (memcmp(&out[0][i], &out[1][i], 4) && bad++ < 3)
            moe_st_put(msg, n, used, "  %s: output %zu element %zu: %.9g, scalar kernel %.9g\n", name, i / no, i % no,
                   out[1][i], out[0][i]);
    moe_st_put(msg, n, used, "%s: %d of %zu outputs differ\n", name, bad, 3 * no);
    return bad > 0;
}

__global__ void k_swiglu_probe(const float *__restrict__ g, const float *__restrict__ u,
                               const float *__restrict__ L, float *__restrict__ y, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) y[i] = swiglu(g[i], u[i], L[i]);
}

/* The GPU paths' one SwiGLU (cuda_device.cuh) against float64 on
 * adversarial operands: zeros of both signs, subnormals, +-Inf, NaN, FLT_MAX,
 * the exp's overflow edges (-g = 88.72, 87.34, where 1 + e^-g passes 2^126
 * and div.rn.f32 would leave its fast path, 103.97), the clamp limit and its
 * neighbours, and random values over every binade of [2^-30, 2^8) and a
 * normal of sd 60 (the bench's MXFP4 gate pre-activations); limits 0
 * (none), 7 and 10. Bound per output, from what the device computes:
 * NaN where float64 gives NaN, the same infinity where the rounded float64
 * value overflows, else |y - ref| <= 2^-21 |ref| + 2^-120 max(1, |u|):
 * 2^-21 is 8 fp32 ulps (expf within 2, the sum 1/2, div.full.f32 within 2,
 * the product 1/2, with room); 2^-120 covers silu below g = -88.72, where
 * e^-g overflows fp32 and the quotient is 0 (|silu| < 89 e^-88.7 < 2^-120),
 * or where g is subnormal and fp32's silu rounds to 0. With u infinite that
 * term is unbounded, and 0 x Inf = NaN is accepted beside the infinity
 * (the fp32 formula of every engine gives it; float64 does not). */
int swiglu_case(char *msg, size_t n, size_t *used) {
    static const float fixed[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 0x1p-149f, -0x1p-149f, 0x1.fffffcp-127f,
                                  -0x1p-126f, 1.0f, -1.0f, 0x1.fffffep127f, -0x1.fffffep127f, 1e30f, -1e30f,
                                  88.7228394f, -88.7228394f, 87.3365479f, -87.3365479f, -87.0f, -88.0f, -88.5f,
                                  103.972084f, -103.972084f, 100.0f, -100.0f, 20.0f, -20.0f, 7.0f, 0x1.bffffep2f,
                                  0x1.c00002p2f, -7.0f, 10.0f, -10.0f, 0x1.3ffffep3f, 0x1.400002p3f, 0.5f, -0.5f};
    const int nf = (int)(sizeof fixed / sizeof fixed[0]);
    static const float lims[] = {0.0f, 7.0f, 10.0f};
    std::vector<float> g, u, L;
    for (int li = 0; li < 3; li++)
        for (int a = 0; a < nf; a++)
            for (int b = 0; b < nf; b++) {
                g.push_back(fixed[a]);
                u.push_back(fixed[b]);
                L.push_back(lims[li]);
            }
    moe_st_rng r{0x5EED5u};
    auto wide = [&]() {
        const float m = 1.0f + (float)(r.next() % 8388608u) / 8388608.0f;
        const float v = ldexpf(m, (int)(r.next() % 38) - 30);
        return r.next() & 1u ? -v : v;
    };
    for (int i = 0; i < 16384; i++) {
        float gv;
        if (i & 1) {
            gv = wide();
        } else { /* a normal of sd 60 (Box-Muller) */
            const double u1 = ((double)r.next() + 1.0) / 4294967297.0, u2 = (double)r.next() / 4294967296.0;
            gv = (float)(60.0 * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
        }
        g.push_back(gv);
        u.push_back(wide());
        L.push_back(lims[i % 3]);
    }
    const int N = (int)g.size();
    float *d = nullptr;
    std::vector<float> y((size_t)N);
    cudaError_t e = cudaMalloc(&d, (size_t)N * 16);
    if (e == cudaSuccess) e = cudaMemcpy(d, g.data(), (size_t)N * 4, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(d + N, u.data(), (size_t)N * 4, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(d + 2 * N, L.data(), (size_t)N * 4, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) k_swiglu_probe<<<(unsigned)((N + 255) / 256), 256>>>(d, d + N, d + 2 * N, d + 3 * N, N);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpy(y.data(), d + 3 * N, (size_t)N * 4, cudaMemcpyDeviceToHost);
    cudaFree(d);
    if (e != cudaSuccess) {
        moe_st_put(msg, n, used, "swiglu: CUDA error %s\n", cudaGetErrorString(e));
        return 1;
    }
    int bad = 0;
    double worst = 0.0;
    for (int i = 0; i < N; i++) {
        double gd = g[(size_t)i], ud = u[(size_t)i];
        const double Ld = L[(size_t)i];
        if (Ld > 0.0) {
            gd = gd > Ld ? Ld : gd;
            ud = ud > Ld ? Ld : (ud < -Ld ? -Ld : ud);
        }
        const double silu = gd / (1.0 + exp(-gd)), ref = silu * ud;
        const float rf = (float)ref, yv = y[(size_t)i];
        bool ok;
        if (isnan(ref)) ok = isnan(yv);
        else if (isinf(ud) && fabs(silu) < 0x1p-120) ok = isnan(yv) || yv == rf; /* fp32 silu is 0 there: 0 x Inf */
        else if (isinf(rf)) ok = yv == rf;
        else {
            const double err = fabs((double)yv - ref), bound = 0x1p-21 * fabs(ref) + 0x1p-120 * fmax(1.0, fabs(ud));
            ok = err <= bound;
            if (fabs(silu) > 0x1p-100 && fabs(ref) > 0x1p-100) worst = fmax(worst, err / fabs(ref));
        }
        if (!ok && bad++ < 4)
            moe_st_put(msg, n, used, "  swiglu(g %.9g, u %.9g, limit %g) = %.9g, float64 %.17g\n", g[(size_t)i],
                       u[(size_t)i], L[(size_t)i], yv, ref);
    }
    moe_st_put(msg, n, used, "swiglu against float64: %d of %d outside the bound; worst relative error %.2e (%.1f ulp)\n",
               bad, N, worst, worst / 0x1p-24);
    return bad > 0;
}

} // namespace

extern "C" int moe_cuda_swiglu_selftest(char *msg, size_t n) {
    size_t used = 0;
    if (msg && n) msg[0] = 0;
    return swiglu_case(msg, n, &used);
}

extern "C" int moe_cuda_ng_selftest(char *msg, size_t n) {
    size_t used = 0;
    if (msg && n) msg[0] = 0;
    int fails = 0;
    fails += ng_sort_case(msg, n, &used, 8192, 6, 6, 256, MOE_CUDA_MMA_BM, 0);
    fails += ng_sort_case(msg, n, &used, 8191, 6, 6, 256, MOE_CUDA_MMA_BM, 1);
    fails += ng_sort_case(msg, n, &used, 1000, 6, 7, 256, MOE_CUDA_GRP_NT, 1); /* a fused column, not sorted */
    fails += ng_sort_case(msg, n, &used, 337, 8, 8, 64, MOE_CUDA_MMA_BM, 2); /* two chunks, one partial */
    fails += ng_sort_case(msg, n, &used, 5003, 8, 8, 1000, MOE_CUDA_MMA_BM, 1); /* E > the block's threads */
    fails += ng_combine_case(msg, n, &used, 37, 264, 6, false, false);
    fails += ng_combine_case(msg, n, &used, 19, 4096, 6, true, true);
    fails += ng_combine_case(msg, n, &used, 5, 64, 16, false, true); /* two load batches */
    return fails;
}
