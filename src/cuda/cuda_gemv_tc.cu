/*
 * FP4 expert GEMVs on the tensor cores (the small-T path: one token per
 * assignment, as the fp32 GEMVs of cuda_kernels.cu, which stay for BF16 and
 * FP8 weights and as the MOE_CUDA_GEMV_TC=0 comparison).
 *
 * Why: the fp32 GEMV decodes E2M1 to f32 and spends ~115 instructions per
 * 16 weight bytes per lane (decode, 2 conversions per weight, 32 FMAs, 8
 * shared loads of fp32 activations): at HBM speed that is more than the SM
 * can issue (docs/performance-cuda.md, ncu). Here the decoded weights go to
 * mma.sync m16n8k16 (f16 in, f32 accumulate): 9 instructions per 8 weights
 * plus one mma per 256 weights of a warp.
 *
 * Layout. A warp owns 16 weight rows (the mma's M) and walks K in steps of
 * 128 columns. In a step, lane (g = lane / 4, q = lane % 4) loads 16 bytes
 * (32 E2M1 codes = one MXFP4 scale block) of row g and of row g + 8, at
 * columns 128 s + 32 q: the warp reads 16 rows x 64 contiguous bytes. The
 * mma's K index is only a label, so each lane feeds its own 32 columns as
 * the A fragment and the sum over the quad would mix four scale blocks. To
 * keep them apart, the activation of quad lane q's block goes to B column
 * q only (the other columns of that K range are zero): column c of the
 * product is then the dot product of block c alone, which is scaled by its
 * E8M0 scale in fp32 afterwards. NVFP4 (UE4M3 per 16 columns): each lane's
 * two halves go to columns 2q and 2q + 1, all eight columns used.
 *
 * Work split. A block (4 warps) stages one assignment's activations and
 * covers 32 rows (gate/up: 32 rows of each); two warps share a row group and
 * split its K steps (even / odd), meeting through shared memory at the end
 * (TC_KS). Each warp loads the next step's weights while it decodes and
 * multiplies the current one (deeper prefetch through a cp.async ring, or
 * the scales staged in shared memory, measured slower: per-block setup
 * costs more than the latency it hides here; docs/performance-cuda.md).
 *
 * Exactness. E2M1 -> E4M3 (x 2^-6) -> f16 is exact (cuda_device.cuh). The
 * activations are bf16 values (bf16 or FP8 rounding upstream); each block of
 * 32 is scaled by a power of two that puts its largest magnitude in
 * [2^14, 2^15), so the f16 copy is exact for every element within 2^28 of
 * that maximum (smaller ones round as f16 subnormals: a relative
 * contribution below 2^-28, far under the fp32 accumulation's error). The
 * tensor core multiplies exactly and accumulates in fp32 (Hopper truncates
 * the additions: TOL_MMA in tests/cuda/test-cuda.c); the block sum is then
 * scaled by (weight scale x 2^(shift + 6)), a power of two for MXFP4, and
 * accumulated over steps in a fixed order; the quad's partial sums meet in
 * a fixed xor tree. No atomics: bit-identical reruns, batch-independent.
 */
#include "cuda/cuda_device.cuh"

#include <cuda_fp16.h>

#define TC_WARPS 4                       /* warps per block */
#ifndef TC_KS
#define TC_KS 2                          /* warps splitting one row group's K */
#endif
#define TC_ROWS (16 * TC_WARPS / TC_KS)  /* weight rows per block */
#ifndef TC_UNROLL
#define TC_UNROLL 1                      /* K steps per loop trip */
#endif
constexpr int tc_unroll = TC_UNROLL;

/* Slot of column k (0..31) of a 32-column block in the staged activations:
 * the order in which e2m1x8_to_e4m3 + one cvt per pair produce the weights
 * (per 8 columns: 0 2 4 6 1 3 5 7). */
__device__ __forceinline__ int tc_slot(int k) {
    int j = k >> 3, m = k & 7;
    return 8 * j + 2 * ((m & 1) * 2 + (m >> 2)) + ((m >> 1) & 1);
}

/* Stage one warp's 128 activations (lane: columns c0 + 4 lane .. + 3, values
 * already bf16-exact) as f16 in slot order, one power-of-two shift per
 * 32-column block; xm[block] = 2^(shift + 6) undoes the shift and the
 * decoder's 2^-6. NaN / Inf are left to propagate. */
__device__ __forceinline__ void tc_stage128(const float v[4], int c0, int lane, __half *xh, float *xm) {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float a = fabsf(v[i]);
        if (a <= 3.402823466e38f) m = fmaxf(m, a);
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
    int sh = m > 0.0f ? ilogbf(m) - 14 : 0;
    sh = sh < -100 ? -100 : sh; /* 2^-sh stays finite; smaller blocks are all f16 zeros anyway */
    float down = ldexpf(1.0f, -sh);
    int c = c0 + 4 * lane, blk = c >> 5;
#pragma unroll
    for (int i = 0; i < 4; i++) xh[blk * 32 + tc_slot((c + i) & 31)] = __float2half_rn(v[i] * down);
    if ((lane & 7) == 0) xm[blk] = ldexpf(64.0f, sh);
}

/* E2M1 word (8 codes) -> 4 f16x2 in slot order (exact, values x 2^-6). */
__device__ __forceinline__ void tc_dec8(uint32_t w, uint32_t out[4]) {
    uint32_t ev, od;
    e2m1x8_to_e4m3(w, ev, od);
    __half2_raw h;
    h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(ev & 0xFFFFu), __NV_E4M3);
    out[0] = (uint32_t)h.x | ((uint32_t)h.y << 16);
    h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(ev >> 16), __NV_E4M3);
    out[1] = (uint32_t)h.x | ((uint32_t)h.y << 16);
    h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(od & 0xFFFFu), __NV_E4M3);
    out[2] = (uint32_t)h.x | ((uint32_t)h.y << 16);
    h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(od >> 16), __NV_E4M3);
    out[3] = (uint32_t)h.x | ((uint32_t)h.y << 16);
}

/* d += A B, m16n8k16, f16 inputs, f32 accumulators. */
__device__ __forceinline__ void tc_mma(float d[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t u4w(const uint4 &v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

/* The 16 B fragment registers of one step: quad lane q's block (4 s + q),
 * or zeros where this lane's B column is not that block's. */
template <int F>
__device__ __forceinline__ void tc_bfrag(const __half *xh, int s, int g, int q, uint32_t X[16]) {
    const uint4 *p = reinterpret_cast<const uint4 *>(xh + (size_t)(4 * s + q) * 32);
    bool lo = F == DF_MXFP4 ? g == q : g == 2 * q, hi = F == DF_MXFP4 ? g == q : g == 2 * q + 1;
    uint4 z = make_uint4(0, 0, 0, 0);
    uint4 v0 = lo ? p[0] : z, v1 = lo ? p[1] : z, v2 = hi ? p[2] : z, v3 = hi ? p[3] : z;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        X[j] = u4w(v0, j);
        X[4 + j] = u4w(v1, j);
        X[8 + j] = u4w(v2, j);
        X[12 + j] = u4w(v3, j);
    }
}

/* The block sums of one step for rows g and g + 8 of a weight: c[0..1] row
 * g columns 2q, 2q + 1; c[2..3] row g + 8. */
__device__ __forceinline__ void tc_step(const uint4 &ag, const uint4 &ah, const uint32_t X[16], float c[4]) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t gq[4], hq[4];
        tc_dec8(u4w(ag, j), gq);
        tc_dec8(u4w(ah, j), hq);
        tc_mma(c, gq[0], hq[0], gq[1], hq[1], X[4 * j], X[4 * j + 1]);
        tc_mma(c, gq[2], hq[2], gq[3], hq[3], X[4 * j + 2], X[4 * j + 3]);
    }
}

/* Block-scale decoders without branches (moe_formats.h's values: E8M0 0 is
 * 2^-127, 0xFF NaN; UE4M3 through the exact E4M3 -> f16 conversion, NaN
 * for 0x7F and for any code with the sign bit set). */
__device__ __forceinline__ float tc_e8m0(uint32_t b) {
    uint32_t v = b << 23;
    v = b == 0u ? 0x00400000u : v;
    v = b == 0xFFu ? 0x7FC00000u : v;
    return __uint_as_float(v);
}
__device__ __forceinline__ float tc_ue4m3(uint32_t b) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(b & 0x7Fu), __NV_E4M3);
    float f = __half2float(*reinterpret_cast<const __half *>(&h));
    return (b & 0x80u) ? __uint_as_float(0x7FC00000u) : f;
}

/* Weight scales of this lane's two columns in step s for one row (scale
 * row sr in global memory) and the 32-column block each column's
 * activations came from (bi); 0 where the column is no block of this row
 * (MXFP4 columns 4..7, columns past kp). Both scale bytes come in one
 * aligned 2-byte load (row strides and 2q are even); invalid columns read
 * block 0 and are zeroed by a select, not a branch. */
template <int F>
__device__ __forceinline__ void tc_sw(const uint8_t *sr, int s, int q, int kp, float w[2], int bi[2]) {
    if (F == DF_MXFP4) {
        int b = 4 * s + 2 * q;
        bool v0 = q < 2 && 32 * b < kp, v1 = q < 2 && 32 * (b + 1) < kp;
        int bb = v0 ? b : 0;
        uint32_t u = *reinterpret_cast<const uint16_t *>(sr + bb);
        w[0] = v0 ? tc_e8m0(u & 0xFFu) : 0.0f;
        w[1] = v1 ? tc_e8m0(u >> 8) : 0.0f;
        bi[0] = bb;
        bi[1] = bb + 1;
    } else {
        int b = 4 * s + q;
        bool ok = 32 * b < kp;
        int bb = ok ? b : 0;
        uint32_t u = *reinterpret_cast<const uint16_t *>(sr + 2 * bb);
        w[0] = ok ? tc_ue4m3(u & 0xFFu) : 0.0f;
        w[1] = ok ? tc_ue4m3(u >> 8) : 0.0f;
        bi[0] = bi[1] = bb;
    }
}

/* Multipliers of one row's two columns: weight scale x the activations'
 * block multiplier xm. */
template <int F>
__device__ __forceinline__ void tc_mult(const uint8_t *sr, const float *xm, int s, int q, int kp, float m[2]) {
    float w[2];
    int bi[2];
    tc_sw<F>(sr, s, q, kp, w, bi);
    m[0] = w[0] * xm[bi[0]];
    m[1] = w[1] * xm[bi[1]];
}

/* 16 bytes of a row at column 128 s + 32 q, zeros past kp. */
__device__ __forceinline__ uint4 tc_load(const uint8_t *row, int s, int q, int kp) {
    return 128 * s + 32 * q < kp ? ldg16(row + 64 * s + 16 * q) : make_uint4(0, 0, 0, 0);
}

/* Sum of the quad's partials of rows g (v[0..1]) and g + 8 (v[2..3]). */
__device__ __forceinline__ void tc_rows(const float acc[4], float &rg, float &rh) {
    rg = acc[0] + acc[1];
    rh = acc[2] + acc[3];
    rg += __shfl_xor_sync(0xffffffffu, rg, 1);
    rh += __shfl_xor_sync(0xffffffffu, rh, 1);
    rg += __shfl_xor_sync(0xffffffffu, rg, 2);
    rh += __shfl_xor_sync(0xffffffffu, rh, 2);
}

__device__ __forceinline__ void tc_fma(float acc[4], const float c[4], const float mg[2], const float mh[2]) {
    acc[0] = fmaf(c[0], mg[0], acc[0]);
    acc[1] = fmaf(c[1], mg[1], acc[1]);
    acc[2] = fmaf(c[2], mh[0], acc[2]);
    acc[3] = fmaf(c[3], mh[1], acc[3]);
}

/* Shared memory of a block: the staged activations (f16 in slot order, then
 * one multiplier per 32 columns), then the K split's partials. */
static size_t tc_smem(int kp) {
    int nb = (kp + 127) / 128 * 4; /* 32-column blocks, whole steps */
    return (size_t)nb * 32 * 2 + (size_t)nb * 4 + (size_t)TC_WARPS * 32 * 8 * 4;
}

/* Stage one bf16 activation row (Hp % 64 == 0 columns, zeros up to ns steps)
 * with the block's warps: tc_stage128 per 128 columns. */
__device__ __forceinline__ void tc_stage_x(const __nv_bfloat16 *__restrict__ x, int Hp, int ns, __half *xh,
                                           float *xm) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int c0 = warp * 128; c0 < ns * 128; c0 += TC_WARPS * 128) {
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int c = c0 + 4 * lane;
        if (c < Hp) { /* Hp % 64 == 0: four columns are all in or all out */
            uint2 r = *reinterpret_cast<const uint2 *>(x + c);
            v[0] = bf16_lo(r.x);
            v[1] = bf16_hi(r.x);
            v[2] = bf16_lo(r.y);
            v[3] = bf16_hi(r.y);
        }
        tc_stage128(v, c0, lane, xh, xm);
    }
}

/* Stage act(h) for the down projection: the activation rounding of the
 * other GEMVs (warp_act128: bf16, or FP8 per 128 with its scale), then the
 * bf16 operand, zeros past Ip. */
__device__ __forceinline__ void tc_stage_h(const float *__restrict__ h, int Ip, int act, int ns, __half *xh,
                                           float *xm) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int c0 = warp * 128; c0 < ns * 128; c0 += TC_WARPS * 128) {
        float v[4];
        warp_act128(h, c0, Ip, act, lane, v);
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = __bfloat162float(__float2bfloat16_rn(v[i]));
        tc_stage128(v, c0, lane, xh, xm);
    }
}

/* The K split's partials meet in a fixed order: part 0 + part 1 + ... */
template <int N>
__device__ __forceinline__ void tc_ksum(float *red, int warp, int lane, int kpart, float v[N]) {
    float *mine = red + ((size_t)warp * 32 + lane) * 8;
    if (kpart > 0)
#pragma unroll
        for (int i = 0; i < N; i++) mine[i] = v[i];
    __syncthreads();
    if (kpart == 0)
        for (int k = 1; k < TC_KS; k++)
#pragma unroll
            for (int i = 0; i < N; i++) v[i] += red[((size_t)(warp + k) * 32 + lane) * 8 + i];
}

/* L2 prefetch of the per-assignment GEMVs (MOE_CUDA_SMALLT_L2, off by
 * default): a warp asks L2 for the 16 bytes of each of its rows that it
 * will load pfd steps after the one it loads next (tc_load's addresses),
 * and for its scale rows and its first pfd steps before it stages the
 * activations. Why it was tried: the register double buffer alone keeps
 * one step (2 KB a warp) in flight, and ncu at T = 1 put 45% of the
 * gate/up GEMV's stall cycles on global loads, with the whole grid
 * resident and DRAM at 46%. Measured 3-11% slower at T = 1 all the same
 * (docs/performance-cuda.md, seventh session). The prefetch moves no value
 * into a register: results are the same bits. */
__device__ __forceinline__ void tc_pf(const uint8_t *row, int s, int q, int kp) {
    if (128 * s + 32 * q < kp) prefetch_l2(row + 64 * s + 16 * q);
}
/* Steps first .. first + (pfd - 1) stride of n rows, and the scale rows
 * (sb bytes each; lane q takes line q). */
__device__ __forceinline__ void tc_pf_start(const uint8_t *const *rows, const uint8_t *const *sc, int n, int first,
                                            int stride, int pfd, int ns, int q, int kp, int sb) {
    for (int d = 0; d < pfd; d++) {
        int sp = first + d * stride;
        if (sp < ns)
            for (int j = 0; j < n; j++) tc_pf(rows[j], sp, q, kp);
    }
    if (pfd > 0 && 128 * q < sb)
        for (int j = 0; j < n; j++) prefetch_l2(sc[j] + 128 * q);
}
template <int F> __host__ __device__ constexpr int tc_scale_bytes(int kp) { return F == DF_NVFP4 ? kp / 16 : kp / 32; }

/* One warp's walk over its K steps (kpart, kpart + TC_KS, ...) for NM
 * matrices: rows[2m], rows[2m + 1] are rows g and g + 8 of matrix m,
 * sc[2m], sc[2m + 1] their scale rows; nxt holds the first step's weights
 * (loaded before the activations were staged). The next step's weights are
 * loaded while this step's are decoded and multiplied; pfd > 0: the step
 * pfd after that one is asked of L2 (tc_pf). */
template <int F, int NM>
__device__ __forceinline__ void tc_walk(const uint8_t *const rows[2 * NM], const uint8_t *const sc[2 * NM],
                                        uint4 nxt[2 * NM], const __half *xh, const float *xm, int kp, int ns,
                                        int kpart, int lane, int pfd, float acc[4 * NM]) {
    int g = lane >> 2, q = lane & 3;
#pragma unroll(tc_unroll)
    for (int s = kpart; s < ns; s += TC_KS) {
        uint4 cur[2 * NM];
#pragma unroll
        for (int j = 0; j < 2 * NM; j++) cur[j] = nxt[j];
        int sp = s + (pfd + 1) * TC_KS;
        if (pfd > 0 && sp < ns)
#pragma unroll
            for (int j = 0; j < 2 * NM; j++) tc_pf(rows[j], sp, q, kp);
        if (s + TC_KS < ns)
#pragma unroll
            for (int j = 0; j < 2 * NM; j++) nxt[j] = tc_load(rows[j], s + TC_KS, q, kp);
        uint32_t X[16];
        tc_bfrag<F>(xh, s, g, q, X);
#pragma unroll
        for (int m = 0; m < NM; m++) {
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tc_step(cur[2 * m], cur[2 * m + 1], X, c);
            float mg[2], mh[2];
            tc_mult<F>(sc[2 * m], xm, s, q, kp, mg);
            tc_mult<F>(sc[2 * m + 1], xm, s, q, kp, mh);
            tc_fma(acc + 4 * m, c, mg, mh);
        }
    }
}

template <int F>
__global__ void __launch_bounds__(128, 4) k_gateup_tc(dweights w1, dweights w3, const __nv_bfloat16 *__restrict__ Xb,
                                                      int Hp, const int32_t *__restrict__ ids, int K, int C,
                                                      float limit, float *__restrict__ Hf, int Ip, int pfd) {
    griddep_launch(); /* the down GEMV may take free slots now; it waits for this grid before reading Hf */
    extern __shared__ __align__(16) uint8_t tc_sm[];
    const int kp = w1.kp, ns = (kp + 127) / 128;
    __half *xh = reinterpret_cast<__half *>(tc_sm);
    float *xm = reinterpret_cast<float *>(tc_sm + (size_t)ns * 128 * 2);
    float *red = xm + (size_t)ns * 4;
    int a = blockIdx.y;
    int t = ids ? a / K : a;
    int e = ids ? ids[(size_t)t * C + a % K] : 0;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, kpart = warp % TC_KS;
    int r0 = blockIdx.x * TC_ROWS + (warp / TC_KS) * 16;
    size_t rb = (size_t)kp / 2;
    const uint8_t *p1 = w1.data + (size_t)e * w1.dstride + (size_t)(r0 + g) * rb;
    const uint8_t *p3 = w3.data + (size_t)e * w3.dstride + (size_t)(r0 + g) * rb;
    const uint8_t *rows[4] = {p1, p1 + 8 * rb, p3, p3 + 8 * rb};
    /* the first step's weights travel while the activations are staged */
    uint4 nxt[4];
#pragma unroll
    for (int j = 0; j < 4; j++) nxt[j] = tc_load(rows[j], kpart, q, kp);
    const uint8_t *sc[4] = {scale_row<F>(w1, e, r0 + g), scale_row<F>(w1, e, r0 + g + 8), scale_row<F>(w3, e, r0 + g),
                            scale_row<F>(w3, e, r0 + g + 8)};
    tc_pf_start(rows, sc, 4, kpart + TC_KS, TC_KS, pfd, ns, q, kp, tc_scale_bytes<F>(kp));
    tc_stage_x(Xb + (size_t)t * Hp, Hp, ns, xh, xm);
    __syncthreads();
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}; /* gate 0..3, up 4..7 */
    tc_walk<F, 2>(rows, sc, nxt, xh, xm, kp, ns, kpart, lane, pfd, acc);
    tc_ksum<8>(red, warp, lane, kpart, acc);
    float gg, gh, ug, uh;
    tc_rows(acc, gg, gh);
    tc_rows(acc + 4, ug, uh);
    if (q == 0 && kpart == 0) {
        float sg = w1.scale2 ? w1.scale2[e] : 1.0f, su = w3.scale2 ? w3.scale2[e] : 1.0f;
        float *out = Hf + (size_t)a * Ip;
        out[r0 + g] = swiglu(gg * sg, ug * su, limit);
        out[r0 + g + 8] = swiglu(gh * sg, uh * su, limit);
    }
}

template <int F>
__global__ void __launch_bounds__(128, 4) k_down_tc(dweights w2, const float *__restrict__ Hf, int Ip, int act,
                                                    const int32_t *__restrict__ ids, int K, int C,
                                                    float *__restrict__ Y, int Yp, int pfd) {
    griddep_launch(); /* the combine waits for this grid */
    extern __shared__ __align__(16) uint8_t tc_sm[];
    const int kp = w2.kp, ns = (kp + 127) / 128;
    __half *xh = reinterpret_cast<__half *>(tc_sm);
    float *xm = reinterpret_cast<float *>(tc_sm + (size_t)ns * 128 * 2);
    float *red = xm + (size_t)ns * 4;
    int a = blockIdx.y;
    int t = ids ? a / K : a, j = ids ? a % K : 0;
    int e = ids ? ids[(size_t)t * C + j] : 0;
    size_t yrow = ids ? (size_t)t * C + j : (size_t)a;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, kpart = warp % TC_KS;
    int r0 = blockIdx.x * TC_ROWS + (warp / TC_KS) * 16;
    size_t rb = (size_t)kp / 2;
    const uint8_t *p2 = w2.data + (size_t)e * w2.dstride + (size_t)(r0 + g) * rb;
    const uint8_t *rows[2] = {p2, p2 + 8 * rb};
    uint4 nxt[2] = {tc_load(rows[0], kpart, q, kp), tc_load(rows[1], kpart, q, kp)};
    const uint8_t *sc[2] = {scale_row<F>(w2, e, r0 + g), scale_row<F>(w2, e, r0 + g + 8)};
    tc_pf_start(rows, sc, 2, kpart + TC_KS, TC_KS, pfd, ns, q, kp, tc_scale_bytes<F>(kp));
    griddep_wait(); /* launched programmatically: gate/up's Hf is complete and visible past here */
    tc_stage_h(Hf + (size_t)a * Ip, Ip, act, ns, xh, xm);
    __syncthreads();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    tc_walk<F, 1>(rows, sc, nxt, xh, xm, kp, ns, kpart, lane, pfd, acc);
    tc_ksum<4>(red, warp, lane, kpart, acc);
    float rgs, rhs;
    tc_rows(acc, rgs, rhs);
    if (q == 0 && kpart == 0) {
        float s2 = w2.scale2 ? w2.scale2[e] : 1.0f;
        float *out = Y + yrow * Yp;
        out[r0 + g] = rgs * s2;
        out[r0 + g + 8] = rhs * s2;
    }
}

/* ------------------------------------------------ grouped (small T) */

/* The grouped GEMV: up to NT tokens of one expert (a tile of moe_k_sort)
 * share one pass over its weights. Per K step each lane decodes its codes
 * once and runs the step's mmas once per token (B holds that token's
 * activations in the per-block columns, as above). A token's sums use only
 * its own activations, in the same order whatever else the tile holds, so
 * its output does not depend on its batch. (No K split: with many tiles
 * the grid is large enough; the steps are summed in order, so results
 * differ from the one-token kernels' in the last bits.) */
#define GRP_NT MOE_CUDA_GRP_NT
#define GRP_ROWS (16 * TC_WARPS) /* rows per block: 4 warps x 16, no K split */

/* This lane's B registers of word j (4 f16x2) of step s for one token. */
template <int F>
__device__ __forceinline__ void tc_bword(const __half *xh, int s, int j, int g, int q, uint32_t X[4]) {
    bool act = F == DF_MXFP4 ? g == q : (j < 2 ? g == 2 * q : g == 2 * q + 1);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (act) v = reinterpret_cast<const uint4 *>(xh + (size_t)(4 * s + q) * 32)[j];
    X[0] = v.x;
    X[1] = v.y;
    X[2] = v.z;
    X[3] = v.w;
}

static size_t grp_smem(int kp) {
    int nb = (kp + 127) / 128 * 4;
    return (size_t)GRP_NT * ((size_t)nb * 32 * 2 + (size_t)nb * 4);
}

/* One pass of NM matrices (rows[2m], rows[2m + 1]: rows g, g + 8 of matrix
 * m; sc likewise) over nt tokens' staged activations: acc[n][4 m .. +3]. */
template <int F, int NM>
__device__ __forceinline__ void grp_walk(const uint8_t *const rows[2 * NM], const uint8_t *const sc[2 * NM],
                                         uint4 nxt[2 * NM], const __half *xh, const float *xm, int kp, int ns,
                                         int nt, int lane, float acc[GRP_NT][4 * NM]) {
    int g = lane >> 2, q = lane & 3;
    const size_t xstride = (size_t)ns * 128, mstride = (size_t)ns * 4;
    for (int s = 0; s < ns; s++) {
        uint4 cur[2 * NM];
#pragma unroll
        for (int j = 0; j < 2 * NM; j++) cur[j] = nxt[j];
        if (s + 1 < ns)
#pragma unroll
            for (int j = 0; j < 2 * NM; j++) nxt[j] = tc_load(rows[j], s + 1, q, kp);
        float c[GRP_NT][4 * NM];
#pragma unroll
        for (int n = 0; n < GRP_NT; n++)
#pragma unroll
            for (int i = 0; i < 4 * NM; i++) c[n][i] = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            uint32_t A[2 * NM][4];
#pragma unroll
            for (int r = 0; r < 2 * NM; r++) tc_dec8(u4w(cur[r], j), A[r]);
#pragma unroll
            for (int n = 0; n < GRP_NT; n++) {
                if (n < nt) { /* nt is the block's: no divergence */
                    uint32_t X[4];
                    tc_bword<F>(xh + n * xstride, s, j, g, q, X);
#pragma unroll
                    for (int m = 0; m < NM; m++) {
                        tc_mma(&c[n][4 * m], A[2 * m][0], A[2 * m + 1][0], A[2 * m][1], A[2 * m + 1][1], X[0], X[1]);
                        tc_mma(&c[n][4 * m], A[2 * m][2], A[2 * m + 1][2], A[2 * m][3], A[2 * m + 1][3], X[2], X[3]);
                    }
                }
            }
        }
#pragma unroll
        for (int m = 0; m < NM; m++) {
            float wg[2], wh[2];
            int bi[2], bh[2];
            tc_sw<F>(sc[2 * m], s, q, kp, wg, bi);
            tc_sw<F>(sc[2 * m + 1], s, q, kp, wh, bh);
#pragma unroll
            for (int n = 0; n < GRP_NT; n++) {
                if (n < nt) {
                    const float *xmn = xm + n * mstride;
                    float mg[2] = {wg[0] * xmn[bi[0]], wg[1] * xmn[bi[1]]};
                    float mh[2] = {wh[0] * xmn[bh[0]], wh[1] * xmn[bh[1]]};
                    tc_fma(&acc[n][4 * m], &c[n][4 * m], mg, mh);
                }
            }
        }
    }
}

/* What every grouped block derives from its tile: the expert, the tokens
 * (nt <= GRP_NT), the staged activations' places, this lane's rows. */
struct grp_frame {
    mma_tile tl;
    int kp, ns, nt, lane, g, q, r0;
    __half *xh;
    float *xm;
};

__device__ __forceinline__ grp_frame grp_begin(const dweights &w, const mma_tile *tiles, uint8_t *sm) {
    grp_frame f;
    f.tl = tiles[blockIdx.y];
    f.kp = w.kp;
    f.ns = (f.kp + 127) / 128;
    f.nt = f.tl.p_end - f.tl.p0 < GRP_NT ? f.tl.p_end - f.tl.p0 : GRP_NT;
    f.xh = reinterpret_cast<__half *>(sm);
    f.xm = reinterpret_cast<float *>(sm + (size_t)GRP_NT * f.ns * 128 * 2);
    f.lane = threadIdx.x & 31;
    f.g = f.lane >> 2;
    f.q = f.lane & 3;
    f.r0 = blockIdx.x * GRP_ROWS + (threadIdx.x >> 5) * 16;
    return f;
}

template <int F>
__global__ void __launch_bounds__(128) k_gateup_grp(dweights w1, dweights w3, const __nv_bfloat16 *__restrict__ Xb,
                                                     int Hp, const int32_t *__restrict__ perm, int C,
                                                     const mma_tile *__restrict__ tiles,
                                                     const int32_t *__restrict__ n_tiles, float limit,
                                                     float *__restrict__ Hf, int Ip) {
    griddep_launch();
    if ((int)blockIdx.y >= *n_tiles) return;
    extern __shared__ __align__(16) uint8_t tc_sm[];
    const grp_frame f = grp_begin(w1, tiles, tc_sm);
    const int e = f.tl.e;
    size_t rb = (size_t)f.kp / 2;
    const uint8_t *p1 = w1.data + (size_t)e * w1.dstride + (size_t)(f.r0 + f.g) * rb;
    const uint8_t *p3 = w3.data + (size_t)e * w3.dstride + (size_t)(f.r0 + f.g) * rb;
    const uint8_t *rows[4] = {p1, p1 + 8 * rb, p3, p3 + 8 * rb};
    uint4 nxt[4];
#pragma unroll
    for (int j = 0; j < 4; j++) nxt[j] = tc_load(rows[j], 0, f.q, f.kp);
    for (int n = 0; n < f.nt; n++)
        tc_stage_x(Xb + (size_t)(perm[f.tl.p0 + n] / C) * Hp, Hp, f.ns, f.xh + (size_t)n * f.ns * 128,
                   f.xm + (size_t)n * f.ns * 4);
    __syncthreads();
    const uint8_t *sc[4] = {scale_row<F>(w1, e, f.r0 + f.g), scale_row<F>(w1, e, f.r0 + f.g + 8),
                            scale_row<F>(w3, e, f.r0 + f.g), scale_row<F>(w3, e, f.r0 + f.g + 8)};
    float acc[GRP_NT][8];
#pragma unroll
    for (int n = 0; n < GRP_NT; n++)
#pragma unroll
        for (int i = 0; i < 8; i++) acc[n][i] = 0.0f;
    grp_walk<F, 2>(rows, sc, nxt, f.xh, f.xm, f.kp, f.ns, f.nt, f.lane, acc);
    float sg = w1.scale2 ? w1.scale2[e] : 1.0f, su = w3.scale2 ? w3.scale2[e] : 1.0f;
#pragma unroll
    for (int n = 0; n < GRP_NT; n++) {
        if (n < f.nt) {
            float gg, gh, ug, uh;
            tc_rows(&acc[n][0], gg, gh);
            tc_rows(&acc[n][4], ug, uh);
            if (f.q == 0) {
                float *out = Hf + (size_t)(f.tl.p0 + n) * Ip;
                out[f.r0 + f.g] = swiglu(gg * sg, ug * su, limit);
                out[f.r0 + f.g + 8] = swiglu(gh * sg, uh * su, limit);
            }
        }
    }
}

template <int F>
__global__ void __launch_bounds__(128) k_down_grp(dweights w2, const float *__restrict__ Hf, int Ip, int act,
                                                   const int32_t *__restrict__ perm, const mma_tile *__restrict__ tiles,
                                                   const int32_t *__restrict__ n_tiles, float *__restrict__ Y,
                                                   int Yp) {
    griddep_launch();
    if ((int)blockIdx.y >= *n_tiles) { /* every block waits (griddep_wait's rule) */
        griddep_wait();
        return;
    }
    extern __shared__ __align__(16) uint8_t tc_sm[];
    const grp_frame f = grp_begin(w2, tiles, tc_sm);
    const int e = f.tl.e;
    size_t rb = (size_t)f.kp / 2;
    const uint8_t *p2 = w2.data + (size_t)e * w2.dstride + (size_t)(f.r0 + f.g) * rb;
    const uint8_t *rows[2] = {p2, p2 + 8 * rb};
    uint4 nxt[2] = {tc_load(rows[0], 0, f.q, f.kp), tc_load(rows[1], 0, f.q, f.kp)};
    griddep_wait(); /* programmatic launch: gate/up's Hf past here */
    for (int n = 0; n < f.nt; n++)
        tc_stage_h(Hf + (size_t)(f.tl.p0 + n) * Ip, Ip, act, f.ns, f.xh + (size_t)n * f.ns * 128,
                   f.xm + (size_t)n * f.ns * 4);
    __syncthreads();
    const uint8_t *sc[2] = {scale_row<F>(w2, e, f.r0 + f.g), scale_row<F>(w2, e, f.r0 + f.g + 8)};
    float acc[GRP_NT][4];
#pragma unroll
    for (int n = 0; n < GRP_NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
    grp_walk<F, 1>(rows, sc, nxt, f.xh, f.xm, f.kp, f.ns, f.nt, f.lane, acc);
    float s2 = w2.scale2 ? w2.scale2[e] : 1.0f;
#pragma unroll
    for (int n = 0; n < GRP_NT; n++) {
        if (n < f.nt) {
            float rg, rh;
            tc_rows(acc[n], rg, rh);
            if (f.q == 0) {
                float *out = Y + (size_t)perm[f.tl.p0 + n] * Yp;
                out[f.r0 + f.g] = rg * s2;
                out[f.r0 + f.g + 8] = rh * s2;
            }
        }
    }
}

/* Launch the MXFP4 or the NVFP4 instance of a kernel (others: invalid);
 * pdl: as a programmatic dependent of the kernel before it. */
template <typename... P, typename... A>
static cudaError_t tc_launch(int fmt, void (*kmx)(P...), void (*knv)(P...), dim3 grid, size_t smem, cudaStream_t s,
                             bool pdl, A... args) {
    void (*const ks[4])(P...) = {nullptr, nullptr, kmx, knv};
    return moe_launch_fmt_pdl(fmt, ks, grid, 32 * TC_WARPS, smem, s, pdl, args...);
}

cudaError_t moe_k_gateup_grp(const dweights *w1, const dweights *w3, const __nv_bfloat16 *Xb, int Hp,
                             const int32_t *perm, int C, const mma_tile *tiles, const int32_t *n_tiles,
                             int max_tiles, float limit, float *Hf, int Ip, cudaStream_t s) {
    if (max_tiles == 0) return cudaSuccess;
    if (Ip % GRP_ROWS != 0 || w1->kp != Hp || w1->rows_p < Ip) return cudaErrorInvalidValue;
    dim3 grid(Ip / GRP_ROWS, max_tiles);
    return tc_launch(w1->fmt, k_gateup_grp<DF_MXFP4>, k_gateup_grp<DF_NVFP4>, grid, grp_smem(w1->kp), s, false, *w1, *w3,
                     Xb, Hp, perm, C, tiles, n_tiles, limit, Hf, Ip);
}

cudaError_t moe_k_down_grp(const dweights *w2, const float *Hf, int Ip, int act, const int32_t *perm,
                           const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, float *Y, int Yp,
                           cudaStream_t s, bool pdl) {
    if (max_tiles == 0) return cudaSuccess;
    if (w2->rows_p % GRP_ROWS != 0 || Yp < w2->rows_p || w2->kp != Ip) return cudaErrorInvalidValue;
    dim3 grid(w2->rows_p / GRP_ROWS, max_tiles);
    return tc_launch(w2->fmt, k_down_grp<DF_MXFP4>, k_down_grp<DF_NVFP4>, grid, grp_smem(w2->kp), s, pdl, *w2, Hf, Ip,
                     act, perm, tiles, n_tiles, Y, Yp);
}

cudaError_t moe_k_gateup_tc(const dweights *w1, const dweights *w3, const __nv_bfloat16 *Xb, int Hp,
                            const int32_t *ids, int K, int C, int n_assign, float limit, float *Hf, int Ip,
                            cudaStream_t s, int pfd) {
    if (n_assign == 0) return cudaSuccess;
    if (Ip % TC_ROWS != 0 || w1->kp != Hp || w1->rows_p < Ip || pfd < 0) return cudaErrorInvalidValue;
    dim3 grid(Ip / TC_ROWS, n_assign);
    return tc_launch(w1->fmt, k_gateup_tc<DF_MXFP4>, k_gateup_tc<DF_NVFP4>, grid, tc_smem(w1->kp), s, false, *w1, *w3,
                     Xb, Hp, ids, K, C, limit, Hf, Ip, pfd);
}

cudaError_t moe_k_down_tc(const dweights *w2, const float *Hf, int Ip, int act, const int32_t *ids, int K, int C,
                          int n_assign, float *Y, int Yp, cudaStream_t s, bool pdl, int pfd) {
    if (n_assign == 0) return cudaSuccess;
    if (w2->rows_p % TC_ROWS != 0 || Yp < w2->rows_p || w2->kp != Ip || pfd < 0) return cudaErrorInvalidValue;
    dim3 grid(w2->rows_p / TC_ROWS, n_assign);
    return tc_launch(w2->fmt, k_down_tc<DF_MXFP4>, k_down_tc<DF_NVFP4>, grid, tc_smem(w2->kp), s, pdl, *w2, Hf, Ip, act,
                     ids, K, C, Y, Yp, pfd);
}
