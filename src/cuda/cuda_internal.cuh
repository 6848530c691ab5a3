/*
 * Internals of the GPU block: device descriptors, fast exact decoders and the
 * kernel launchers (C++ linkage, used by cuda_layer.cu only).
 *
 * Invariants:
 *  1. Kernels never allocate: every buffer is carved from the layer's
 *     workspace by the host code, with its shape written beside it.
 *  2. Every sum has a fixed order (per-lane partials, a fixed shuffle tree,
 *     the combine in column order): no atomics take part in arithmetic, so
 *     results are bit-identical run to run and independent of the batch.
 *  3. Decoders are exact: a weight's value is (code value) x (block scale)
 *     with the per-tensor NVFP4 scale applied once to the fp32 accumulator.
 */
#ifndef MOE_CUDA_INTERNAL_CUH
#define MOE_CUDA_INTERNAL_CUH

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "moe_formats.h"

/* The weight formats of the device layout (cuda_pack.h). */
enum { DF_BF16 = 0, DF_FP8 = 1, DF_MXFP4 = 2, DF_NVFP4 = 3 };

/* One projection (w1, w3 or w2) of a group of experts, device layout. Expert
 * e's rows start at data + e * dstride. */
struct dweights {
    int fmt;               /* DF_* */
    int rows_p, kp;        /* padded rows (x128) and columns (x64) */
    int n;                 /* experts in the allocation (the TMA's outer extent; 0: unknown) */
    long long dstride;     /* data bytes per expert */
    long long sstride;     /* scale bytes per expert */
    const uint8_t *data;
    const uint8_t *scale;  /* FP4: codes; FP8: float tiles; BF16: NULL */
    const float *scale2;   /* [experts] NVFP4 tensor scale; 1 otherwise */
};

/* One tile of a grouped GEMM: sorted positions [p0, min(p0 + bm, p_end)) of
 * expert e (bm: MOE_CUDA_MMA_BM for the tensor-core GEMM, MOE_CUDA_GRP_NT for
 * the grouped FP4 GEMV). */
struct mma_tile {
    int e, p0, p_end;
};

/* Activation rounding at the GEMM inputs (moe_act_prec). */
enum { ACT_BF16 = 0, ACT_FP8_POW2 = 1, ACT_FP8_F32 = 2 };

#define MOE_CUDA_MAX_COLS 16  /* top_k + fused shared columns */
#define MOE_CUDA_MMA_BM 128
#define MOE_CUDA_WG_BM2 256  /* positions per tile of the 256-token wgmma kernel */
#define MOE_CUDA_GRP_NT 4    /* tokens of one expert per weight pass, grouped FP4 GEMV */

/* Let a kernel launch with `bytes` of dynamic shared memory. No state of
 * ours: the limit is the runtime's per-function attribute, read back
 * (cudaFuncGetAttributes, a host-side query) on each launch and, when lower
 * than needed, raised to the most the device allows that kernel (the opt-in
 * maximum less its static shared memory). Every caller that raises it sets
 * that same value, so concurrent first launches from several host threads
 * cannot lower it under one another. The limit reserves nothing: occupancy
 * follows the bytes each launch asks for. The bench captures its CUDA graphs
 * after a plain warm-up run, so captures only read the attribute. */
static inline cudaError_t moe_smem_attr(const void *func, int bytes) {
    if (bytes <= 0) return cudaSuccess;
    cudaFuncAttributes a;
    cudaError_t e = cudaFuncGetAttributes(&a, func);
    if (e != cudaSuccess || a.maxDynamicSharedSizeBytes >= bytes) return e;
    int dev = 0, optin = 0;
    if ((e = cudaGetDevice(&dev)) != cudaSuccess) return e;
    if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess) return e;
    int most = optin - (int)a.sharedSizeBytes;
    if (most < bytes) return cudaErrorInvalidValue; /* more than the device has: the launch would fail */
    return cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
}

/* Launch kernels[fmt], the instance of a kernel for weight format fmt (DF_*),
 * after raising its shared-memory limit; a NULL entry (a format the kernel
 * has no instance for) is cudaErrorInvalidValue. One launch path for every
 * per-format kernel. */
template <typename... P, typename... A>
static inline cudaError_t moe_launch_fmt(int fmt, void (*const (&kernels)[4])(P...), dim3 grid, int threads,
                                         size_t smem, cudaStream_t s, A... args) {
    if (fmt < 0 || fmt > DF_NVFP4 || !kernels[fmt]) return cudaErrorInvalidValue;
    void (*k)(P...) = kernels[fmt];
    cudaError_t e = moe_smem_attr((const void *)k, (int)smem);
    if (e != cudaSuccess) return e;
    k<<<grid, threads, smem, s>>>(args...);
    return cudaGetLastError();
}

/* Launch kernel k; pdl: as a programmatic dependent of the kernel before
 * it in the stream (cudaLaunchAttributeProgrammaticStreamSerialization,
 * kept by graph capture): k may start while that kernel still runs, once
 * all of its blocks have called griddep_launch or exited, and must call
 * griddep_wait (cuda_device.cuh) before it reads that kernel's output. */
template <typename... P, typename... A>
static inline cudaError_t moe_launch_pdl(void (*k)(P...), dim3 grid, int threads, size_t smem, cudaStream_t s,
                                         bool pdl, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    cudaError_t e = cudaLaunchKernelEx(&cfg, k, args...);
    return e != cudaSuccess ? e : cudaGetLastError();
}

/* moe_launch_fmt, optionally as a programmatic dependent (moe_launch_pdl). */
template <typename... P, typename... A>
static inline cudaError_t moe_launch_fmt_pdl(int fmt, void (*const (&kernels)[4])(P...), dim3 grid, int threads,
                                             size_t smem, cudaStream_t s, bool pdl, A... args) {
    if (fmt < 0 || fmt > DF_NVFP4 || !kernels[fmt]) return cudaErrorInvalidValue;
    void (*k)(P...) = kernels[fmt];
    cudaError_t e = moe_smem_attr((const void *)k, (int)smem);
    if (e != cudaSuccess) return e;
    return moe_launch_pdl(k, grid, threads, smem, s, pdl, args...);
}

/* ------------------------------------------------------------ launchers */
/* Each returns the launch's cudaError_t (cudaGetLastError after launch). */

/* logits [T, E] = X [T, Hp] . G [E, Hp]^T in fp32. */
cudaError_t moe_k_logits(const float *X, const float *G, int T, int E, int Hp, float *logits, cudaStream_t s);

struct route_params {
    int T, E, K, C;         /* C = K (+ 1 fused shared column) */
    int score;              /* moe_score_func */
    int hash;               /* hash layer: ids from tid2eid */
    int n_group, topk_group, group_mask_zero;
    int renormalize, not_renorm_fault, biased_weights_fault;
    float renorm_eps;
    float router_mult, runner_mult, output_mult, fused_shared_w;
    int fused;
};
/* One thread per token: scores, selection, weights. work [T, 2E] floats.
 * ids [T, C], tw [T, C] emitted weights, ew [T, C] effective weights. */
cudaError_t moe_k_route(const route_params *p, const float *logits, const float *bias, const int32_t *tid2eid,
                        const int64_t *token_ids, float *work, int32_t *ids, float *tw, float *ew, cudaStream_t s);

/* X [rows, n] fp32 -> Xb [rows, pitch] bf16 rounded per `act` (columns n..pitch
 * zero). */
cudaError_t moe_k_act_round(const float *X, int rows, int n, int ld_in, int act, __nv_bfloat16 *Xb, int pitch,
                            cudaStream_t s);

/* Sort the T x K routed assignments by expert (two launches over blocks of
 * assignments, cuda_kernels.cu): perm [T*K] (the assignment t * C + j at
 * each sorted position), offsets [E + 1], tiles [max_tiles] of at most bm
 * positions of one expert, and *n_tiles. scratch: moe_k_sort_scratch(T, K,
 * E) int32s of the caller's. moe_k_sort1: the earlier single-block kernel
 * (same offsets, tiles and segments): moe_k_sort runs it for T * K <= 2048
 * (one chunk), and it is the reference of the self-test. */
size_t moe_k_sort_scratch(int T, int K, int E);
cudaError_t moe_k_sort(const int32_t *ids, int T, int K, int C, int E, int bm, int32_t *perm, int32_t *offsets,
                       mma_tile *tiles, int max_tiles, int32_t *n_tiles, int32_t *scratch, cudaStream_t s);
cudaError_t moe_k_sort1(const int32_t *ids, int T, int K, int C, int E, int bm, int32_t *perm, int32_t *offsets,
                        mma_tile *tiles, int max_tiles, int32_t *n_tiles, cudaStream_t s);

/* Grouped tensor-core GEMMs (cuda_gemm.cu).
 * gate/up: H [n_pos, Ip] = act(SwiGLU(A W1^T, A W3^T)) with A row p =
 *   Xb[perm[p] / C] (or Xb[p] when perm == NULL: the shared expert over all
 *   tokens). Writes bf16 (act bf16) or fp32 (fp8 acts: rounded after). */
cudaError_t moe_k_gateup_mma(const dweights *w1, const dweights *w3, const __nv_bfloat16 *Xb, int Hp,
                             const int32_t *perm, int C, const mma_tile *tiles, const int32_t *n_tiles,
                             int max_tiles, int n_pos, float limit, __nv_bfloat16 *Hb, float *Hf, int Ip,
                             cudaStream_t s);
/* down: Y [row, Yp] = Hb[p] W2^T for row = perm[p] (or p when perm == NULL). */
cudaError_t moe_k_down_mma(const dweights *w2, const __nv_bfloat16 *Hb, int Ip, const int32_t *perm,
                           const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float *Y,
                           int Yp, cudaStream_t s);

/* The same two GEMMs on wgmma (cuda_wgmma.cu, sm_90a): identical arguments
 * and outputs; a persistent grid of min(n_sm, max_tiles x weight tiles)
 * blocks walks the (tile, weight tile) items. tma: the weight tiles and
 * the activation tiles come by the bulk tensor copy engine from tensor
 * maps encoded here on the host (w->n experts must be set), the activation
 * rows in sorted order (gate/up: perm NULL, Xb pre-gathered by
 * moe_k_gather_rows; down's Hb already is); otherwise every byte comes by
 * the producer warpgroup's cp.async (the earlier kernel, kept for
 * comparison: identical results bit for bit). cdec (tma only): the FP8 /
 * FP4 weights are decoded by the two consumer warpgroups, each step's B
 * tile while the previous step's MMAs run, the producer only issuing the
 * copies; otherwise by the producer warpgroup (the fifth session's kernel,
 * kept for comparison: identical results bit for bit; BF16 weights take
 * that kernel either way, there is nothing to decode).
 * cudaErrorInvalidValue when a width is not a multiple of 64 (w1->kp == Hp,
 * Ip) or w2->rows_p of 128, or (tma) a tensor map cannot describe the
 * operands or gate/up gets a perm, or cdec is set without tma;
 * cudaErrorNotSupported when the driver lacks cuTensorMapEncodeTiled.
 * t256 (tma; FP8 / FP4 weights with cdec): the 256-token tile, tiles of MOE_CUDA_WG_BM2
 * positions (moe_k_sort with that bm; tiles NULL: positions 256 m ..) x 128
 * weight rows, each weight tile read once per 256 tokens of an expert
 * instead of per 128; cudaErrorInvalidValue without tma, or for FP8 /
 * FP4 weights without cdec. The same bits as the 128-token kernel (tested). */
cudaError_t moe_k_gateup_wg(const dweights *w1, const dweights *w3, const __nv_bfloat16 *Xb, int Hp,
                            const int32_t *perm, int C, const mma_tile *tiles, const int32_t *n_tiles, int max_tiles,
                            int n_pos, float limit, __nv_bfloat16 *Hb, float *Hf, int Ip, int n_sm, bool tma,
                            bool cdec, cudaStream_t s, bool t256 = false);
cudaError_t moe_k_down_wg(const dweights *w2, const __nv_bfloat16 *Hb, int Ip, const int32_t *perm,
                          const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float *Y, int Yp,
                          int n_sm, bool tma, bool cdec, cudaStream_t s, bool t256 = false);
/* The same two GEMMs for FP8 weights with FP8 activations on the FP8
 * tensor cores (cuda_qgmma.cu: wgmma e4m3 x e4m3, fp32 promotion per
 * 128-column k block; TMA loads, w->n experts must be set). Activations
 * come as E4M3 codes in sorted order with one fp32 scale per row per 128
 * columns: gate/up Xq [n_pos, Hp] uint8 and Xs [n_pos, ceil(Hp / 128)]
 * (moe_k_qg_quant, moe_k_qg_gather); gate/up writes h quantized the same
 * way for down, Hq [n_pos, Ip] uint8 and Hs [n_pos, ceil(Ip / 128)]
 * (act: ACT_FP8_POW2 or ACT_FP8_F32); down writes Y [perm[p], Yp] as
 * moe_k_down_wg. cudaErrorInvalidValue for other weight formats or
 * activation modes, widths not multiples of 64 (w1->kp == Hp, Ip) or
 * w2->rows_p not of 128, or operands a tensor map cannot describe;
 * cudaErrorNotSupported when the driver lacks cuTensorMapEncodeTiled. */
cudaError_t moe_k_gateup_qg(const dweights *w1, const dweights *w3, const uint8_t *Xq, const float *Xs, int Hp,
                            const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float limit,
                            int act, uint8_t *Hq, float *Hs, int Ip, int n_sm, cudaStream_t s);
cudaError_t moe_k_down_qg(const dweights *w2, const uint8_t *Hq, const float *Hs, int Ip, const int32_t *perm,
                          const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float *Y, int Yp,
                          int n_sm, cudaStream_t s);
/* MXFP4 weights as FP8_BLOCK data for the FP8 x FP8 GEMMs, exactly
 * (cuda_qgmma.cu): per 128 x 128 tile of every expert of src (DF_MXFP4),
 * the E4M3 codes e2m1 x 2^(e - R) into dst->data [rows_p][kp] and the tile
 * scale 2^(R - 127) into dst->scale (the DF_FP8 layout; dst: fmt DF_FP8,
 * the same rows_p, kp and n, its strides and buffers set by the caller),
 * R from moe_mx_tile_exponent (include/moe_formats.h). A tile whose
 * nonzero blocks' E8M0 codes span more than 14, or that holds a NaN scale,
 * gets a NaN scale and adds 1 to bad [0]; bad [1] receives the smallest
 * such tile index ((e x rows_p / 128 + tile row) x ceil(kp / 128) + tile
 * column). bad [2] device ints, set to {0, INT_MAX} by the caller.
 * cudaErrorInvalidValue for other formats or shapes. */
cudaError_t moe_k_mx_to_fp8(const dweights *src, const dweights *dst, int *bad, cudaStream_t s);
/* X [rows, n] fp32 (row pitch ld_in) -> E4M3 codes Q [rows, pitch] and
 * scales S [rows, ceil(pitch / 128)], per row per 128 columns exactly as
 * moe_k_act_round rounds them (act ACT_FP8_POW2 / ACT_FP8_F32; columns n ..
 * pitch zero codes; pitch % 64 == 0). */
cudaError_t moe_k_qg_quant(const float *X, int rows, int n, int ld_in, int act, uint8_t *Q, float *S, int pitch,
                           cudaStream_t s);
/* Qs [p] = Q [perm[p] / C], Ss [p] = S [perm[p] / C] for p < n_pos (rows of
 * pitch codes, pitch % 16 == 0, and their ceil(pitch / 128) scales). */
cudaError_t moe_k_qg_gather(const uint8_t *Q, const float *S, int pitch, const int32_t *perm, int C, int n_pos,
                            uint8_t *Qs, float *Ss, cudaStream_t s);
/* Xs [p, ld] = X [perm[p] / C, ld] for p < n_pos (bf16, ld % 8 == 0): the
 * activation rows of the sorted assignments, for the TMA gate/up. */
cudaError_t moe_k_gather_rows(const __nv_bfloat16 *X, int ld, const int32_t *perm, int C, int n_pos,
                              __nv_bfloat16 *Xs, cudaStream_t s);

/* GEMV kernels (small T): one pass over each assignment's expert rows.
 * gate/up: Hf [n_assign, Ip] fp32 = SwiGLU for assignment a = (t, j):
 *   token t = a / K, expert ids[t * C + j] (ids == NULL: expert 0, token a).
 * The small-T chain's second and third launches (down_gemv, down_tc,
 * down_grp, combine) take pdl: launched as programmatic dependents of the
 * kernel before them (moe_launch_pdl), they start as that one's blocks
 * retire, load their first weights and wait (griddep_wait) before reading
 * its output; the gate/up kernels let them (griddep_launch). Same results
 * bit for bit either way. gateup_tc / down_tc's pfd > 0: each warp asks
 * L2 for its rows pfd K steps ahead of the step it loads into registers
 * next (and for its scale rows), cuda_gemv_tc.cu; 0: no prefetch. */
cudaError_t moe_k_gateup_gemv(const dweights *w1, const dweights *w3, const __nv_bfloat16 *Xb, int Hp,
                              const int32_t *ids, int K, int C, int n_assign, float limit, float *Hf, int Ip,
                              cudaStream_t s);
/* down: for token t, rows h: y_j = act(Hf[t * K + j]) . W2[e_j][h] for the
 * K routed columns (ids == NULL: one column, expert 0, writes Y [T, Yp]);
 * with ids, combines per token in column order into routed/shared/moe out. */
struct combine_params {
    int T, H, K, C, fused, has_shared;
    float runner_mult, output_mult;
    const float *tw;       /* [T, C] emitted weights */
    const float *Ysh;      /* [T, Ysh_pitch] shared expert output or NULL */
    int Ysh_pitch;
    float *routed, *shared, *out; /* [T, H] */
};
cudaError_t moe_k_down_gemv(const dweights *w2, const float *Hf, int Ip, int act, const int32_t *ids,
                            const combine_params *cp, int T, float *Y, int Yp, cudaStream_t s, bool pdl = false);
/* The same two stages for FP4 weights on the tensor cores (cuda_gemv_tc.cu):
 * gate/up as moe_k_gateup_gemv (Ip % 64 == 0, w1->kp == Hp); down writes
 * Y [row, Yp] per assignment (row t * C + j; ids == NULL: row a), combined by
 * moe_k_combine. cudaErrorInvalidValue for other formats or shapes. */
cudaError_t moe_k_gateup_tc(const dweights *w1, const dweights *w3, const __nv_bfloat16 *Xb, int Hp,
                            const int32_t *ids, int K, int C, int n_assign, float limit, float *Hf, int Ip,
                            cudaStream_t s, int pfd = 0);
cudaError_t moe_k_down_tc(const dweights *w2, const float *Hf, int Ip, int act, const int32_t *ids, int K, int C,
                          int n_assign, float *Y, int Yp, cudaStream_t s, bool pdl = false, int pfd = 0);
/* The grouped FP4 GEMV (cuda_gemv_tc.cu): the tokens of one expert share a
 * pass over its weights, MOE_CUDA_GRP_NT at a time, from moe_k_sort's tiles
 * (bm = MOE_CUDA_GRP_NT). gate/up writes Hf [position, Ip]; down reads
 * act(Hf [position]) and writes Y [perm[position], Yp], combined by
 * moe_k_combine. Grid y = max_tiles; blocks past *n_tiles return. */
cudaError_t moe_k_gateup_grp(const dweights *w1, const dweights *w3, const __nv_bfloat16 *Xb, int Hp,
                             const int32_t *perm, int C, const mma_tile *tiles, const int32_t *n_tiles,
                             int max_tiles, float limit, float *Hf, int Ip, cudaStream_t s);
cudaError_t moe_k_down_grp(const dweights *w2, const float *Hf, int Ip, int act, const int32_t *perm,
                           const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, float *Y, int Yp,
                           cudaStream_t s, bool pdl = false);
/* Combine of the MMA path: Y [T * C, Yp] per assignment. */
cudaError_t moe_k_combine(const float *Y, int Yp, const combine_params *cp, cudaStream_t s, bool pdl = false);

/* Random valid codes for benchmark weights (bench only). kind: 0 bytes,
 * 1 E4M3 finite, 2 bf16 in +-[0.5, 1), 3 E8M0 120..127, 4 UE4M3 0.5..2,
 * 5 float 2^-k in [2^-8, 2^-1]. */
cudaError_t moe_k_fill_random(uint8_t *p, size_t n, uint64_t seed, int kind, cudaStream_t s);
cudaError_t moe_k_fill_f32(float *p, size_t n, float v, cudaStream_t s);

#endif
