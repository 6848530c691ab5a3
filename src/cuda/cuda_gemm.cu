/*
 * Grouped tensor-core GEMMs of the routed experts (mma.sync m16n8k16 bf16,
 * fp32 accumulation; sm_80+ instructions, built for sm_90a).
 *
 * One block computes a 128 (tokens of one expert) x 128 (weight rows) tile,
 * k in steps of 64, two shared-memory stages: activations arrive by cp.async
 * (rows gathered through the sort's permutation), weights are loaded raw
 * into registers one step ahead and decoded into bf16 in shared memory
 * (exact for BF16, MXFP4, NVFP4 codes x UE4M3, FP8 x E8M0; FP8 x fp32 tile
 * scale rounds once to bf16). NVFP4's per-tensor scale multiplies the fp32
 * accumulator.
 *
 * gate/up: the 128 weight rows are 64 gate rows and the same 64 up rows,
 * interleaved by 16 so that each thread holds gate and up of the same
 * (token, i) in its accumulators; the SwiGLU (with clamp) runs in registers.
 *
 * Invariants:
 *  1. A row's output depends on that row's activations and the weights only
 *     (fixed k order, fixed mma shape), not on the other rows of its tile.
 *  2. Rows past the expert's segment are zero-filled and never stored.
 */
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_internal.cuh"

#define BM MOE_CUDA_MMA_BM
#define BN 128
#define BK 64
#define PITCH 72 /* bf16 per shared row: 64 + 8 (ldmatrix without bank conflicts) */
#define STAGE_HALVES (2 * BM * PITCH)

__device__ __forceinline__ float e2m1_raw_g(uint32_t n) {
    return __uint_as_float(((n & 7u) << 22) | ((n & 8u) << 28));
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&v);
}

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void mma16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 ldg16g(const uint8_t *p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <int F> struct braw {
    /* raw weight bytes of one k step held by one thread */
    uint4 q[F == DF_FP8 ? 2 : 1];
    float sc[F == DF_FP8 ? 2 : 2];
};

struct mma_args {
    dweights wa, wb;                /* gate/up: w1, w3; down: w2 (wb unused) */
    const __nv_bfloat16 *A;         /* Xb [T, lda] or Hb [n_pos, lda] */
    int lda;
    const int32_t *perm;            /* sorted position -> assignment (t * C + j), or NULL */
    int C;
    const mma_tile *tiles;          /* or NULL: one expert, rows p0 = 128 * tile */
    const int32_t *n_tiles;
    int n_pos;
    float limit;
    __nv_bfloat16 *Hb;              /* gate/up output, bf16 */
    float *Hf;                      /* gate/up output, fp32 (when Hb == NULL) */
    float *Y;                       /* down output */
    int ldo;
};

template <bool GATEUP> __device__ __forceinline__ int brow(int r, int blk, int *which) {
    if (GATEUP) {
        int wn = r >> 5, w = r & 31;
        *which = w >> 4;
        return blk * 64 + wn * 16 + (w & 15);
    }
    *which = 0;
    return blk * 128 + r;
}

template <int F> __device__ __forceinline__ size_t rbytes(int kp) {
    return F == DF_BF16 ? (size_t)kp * 2 : F == DF_FP8 ? (size_t)kp : (size_t)kp / 2;
}

template <int F, bool GATEUP>
__global__ void __launch_bounds__(256) k_mma(mma_args p) {
    extern __shared__ __align__(16) __nv_bfloat16 smem[];
    int tile = blockIdx.y;
    int e, p0, p_end;
    if (p.tiles) {
        if (tile >= *p.n_tiles) return;
        mma_tile tl = p.tiles[tile];
        e = tl.e;
        p0 = tl.p0;
        p_end = tl.p_end;
    } else {
        e = 0;
        p0 = tile * BM;
        p_end = p.n_pos;
        if (p0 >= p_end) return;
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    const int kp = p.wa.kp, KT = kp / BK;

    /* activation rows of this thread's 4 chunks */
    const __nv_bfloat16 *asrc[4];
    int abytes[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int c = tid + 256 * i, r = c >> 3, ch = c & 7;
        int pp = p0 + r;
        bool ok = pp < p_end;
        size_t row = 0;
        if (ok) row = GATEUP ? (p.perm ? (size_t)(p.perm[pp] / p.C) : (size_t)pp) : (size_t)pp;
        asrc[i] = p.A + row * p.lda + ch * 8;
        abytes[i] = ok ? 16 : 0;
    }
    /* weight rows of this thread's chunks */
    const int nch = F == DF_BF16 ? 4 : F == DF_FP8 ? 2 : 1;
    const uint8_t *bsrc[4];
    const uint8_t *ssrc[4];
    int bsr[4], bch[4];
    float s2a = p.wa.scale2 ? p.wa.scale2[e] : 1.0f, s2b = (GATEUP && p.wb.scale2) ? p.wb.scale2[e] : 1.0f;
#pragma unroll
    for (int i = 0; i < nch; i++) {
        int c = tid + 256 * i;
        int per_row = F == DF_BF16 ? 8 : F == DF_FP8 ? 4 : 2;
        int r = c / per_row, ch = c % per_row;
        int which;
        int gr = brow<GATEUP>(r, blockIdx.x, &which);
        const dweights &w = which ? p.wb : p.wa;
        bsrc[i] = w.data + (size_t)e * w.dstride + (size_t)gr * rbytes<F>(kp) + ch * 16;
        const uint8_t *sb = F == DF_BF16 ? nullptr : w.scale + (size_t)e * w.sstride;
        if (F == DF_FP8) sb += (size_t)(gr / 128) * ((kp + 127) / 128) * 4;
        if (F == DF_MXFP4) sb += (size_t)gr * (kp / 32);
        if (F == DF_NVFP4) sb += (size_t)gr * (kp / 16);
        ssrc[i] = sb;
        bsr[i] = r;
        bch[i] = ch;
    }

    auto load_a = [&](int stage, int kt) {
        __nv_bfloat16 *As = smem + stage * STAGE_HALVES;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int c = tid + 256 * i, r = c >> 3, ch = c & 7;
            cp_async16(smem_u32(As + r * PITCH + ch * 8), asrc[i] + kt * BK, abytes[i]);
        }
        if (F == DF_BF16) {
            __nv_bfloat16 *Bs = As + BM * PITCH;
#pragma unroll
            for (int i = 0; i < 4; i++)
                cp_async16(smem_u32(Bs + bsr[i] * PITCH + bch[i] * 8), bsrc[i] + (size_t)kt * BK * 2, 16);
        }
    };
    braw<F> raw;
    auto load_b = [&](int kt) {
        if (F == DF_FP8) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                raw.q[i] = ldg16g(bsrc[i] + (size_t)kt * BK);
                raw.sc[i] = reinterpret_cast<const float *>(ssrc[i])[(kt * BK) / 128];
            }
        } else if (F == DF_MXFP4) {
            raw.q[0] = ldg16g(bsrc[0] + (size_t)kt * BK / 2);
            raw.sc[0] = moe_e8m0_to_f32(ssrc[0][kt * 2 + bch[0]]);
        } else if (F == DF_NVFP4) {
            raw.q[0] = ldg16g(bsrc[0] + (size_t)kt * BK / 2);
            raw.sc[0] = moe_ue4m3_to_f32(ssrc[0][kt * 4 + 2 * bch[0]]);
            raw.sc[1] = moe_ue4m3_to_f32(ssrc[0][kt * 4 + 2 * bch[0] + 1]);
        }
    };
    auto store_b = [&](int stage) {
        __nv_bfloat16 *Bs = smem + stage * STAGE_HALVES + BM * PITCH;
        if (F == DF_FP8) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const uint32_t wd[4] = {raw.q[i].x, raw.q[i].y, raw.q[i].z, raw.q[i].w};
                uint32_t o[8];
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(wd[k] & 0xFFFFu), __NV_E4M3);
                    __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(wd[k] >> 16), __NV_E4M3);
                    float2 a = __half22float2(*reinterpret_cast<__half2 *>(&lo));
                    float2 b = __half22float2(*reinterpret_cast<__half2 *>(&hi));
                    o[2 * k] = pack_bf16(a.x * raw.sc[i], a.y * raw.sc[i]);
                    o[2 * k + 1] = pack_bf16(b.x * raw.sc[i], b.y * raw.sc[i]);
                }
                uint4 *dst = reinterpret_cast<uint4 *>(Bs + bsr[i] * PITCH + bch[i] * 16);
                dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
                dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
            }
        } else if (F == DF_MXFP4 || F == DF_NVFP4) {
            const uint32_t wd[4] = {raw.q[0].x, raw.q[0].y, raw.q[0].z, raw.q[0].w};
            uint32_t o[16];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float sc = (F == DF_NVFP4 && k >= 2) ? raw.sc[1] : raw.sc[0];
#pragma unroll
                for (int n = 0; n < 4; n++) {
                    float a = (e2m1_raw_g(wd[k] >> (8 * n)) * 0x1p126f) * sc;
                    float b = (e2m1_raw_g(wd[k] >> (8 * n + 4)) * 0x1p126f) * sc;
                    o[4 * k + n] = pack_bf16(a, b);
                }
            }
            uint4 *dst = reinterpret_cast<uint4 *>(Bs + bsr[0] * PITCH + bch[0] * 32);
#pragma unroll
            for (int k = 0; k < 4; k++) dst[k] = make_uint4(o[4 * k], o[4 * k + 1], o[4 * k + 2], o[4 * k + 3]);
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][b][c] = 0.0f;

    load_a(0, 0);
    cp_commit();
    load_b(0);
    store_b(0);
    for (int kt = 0; kt < KT; kt++) {
        int cur = kt & 1;
        bool more = kt + 1 < KT;
        if (more) {
            load_a(cur ^ 1, kt + 1);
            cp_commit();
            load_b(kt + 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const __nv_bfloat16 *As = smem + cur * STAGE_HALVES, *Bs = As + BM * PITCH;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ks++) {
            uint32_t af[4][4], bfr[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
                ldsm_x4(smem_u32(As + (wm * 64 + mi * 16 + (lane & 15)) * PITCH + ks * 16 + (lane >> 4) * 8),
                        af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
#pragma unroll
            for (int nj2 = 0; nj2 < 2; nj2++)
                ldsm_x4(smem_u32(Bs + (wn * 32 + nj2 * 16 + (lane >> 4) * 8 + (lane & 7)) * PITCH + ks * 16 +
                                 ((lane >> 3) & 1) * 8),
                        bfr[2 * nj2][0], bfr[2 * nj2][1], bfr[2 * nj2 + 1][0], bfr[2 * nj2 + 1][1]);
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int nj = 0; nj < 4; nj++) mma16816(acc[mi][nj], af[mi], bfr[nj][0], bfr[nj][1]);
        }
        if (more && F != DF_BF16) store_b(cur ^ 1);
        __syncthreads();
    }

    /* epilogue */
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int rl = wm * 64 + mi * 16 + (lane >> 2) + hh * 8;
            int pp = p0 + rl;
            if (pp >= p_end) continue;
            if (GATEUP) {
#pragma unroll
                for (int nj = 0; nj < 2; nj++) {
                    int i = blockIdx.x * 64 + wn * 16 + nj * 8 + 2 * (lane & 3);
                    const float h0 = swiglu(acc[mi][nj][2 * hh] * s2a, acc[mi][nj + 2][2 * hh] * s2b, p.limit);
                    const float h1 = swiglu(acc[mi][nj][2 * hh + 1] * s2a, acc[mi][nj + 2][2 * hh + 1] * s2b, p.limit);
                    if (p.Hb)
                        *reinterpret_cast<uint32_t *>(p.Hb + (size_t)pp * p.ldo + i) = pack_bf16(h0, h1);
                    else
                        *reinterpret_cast<float2 *>(p.Hf + (size_t)pp * p.ldo + i) = make_float2(h0, h1);
                }
            } else {
                size_t orow = p.perm ? (size_t)p.perm[pp] : (size_t)pp;
#pragma unroll
                for (int nj = 0; nj < 4; nj++) {
                    int n = blockIdx.x * 128 + wn * 32 + nj * 8 + 2 * (lane & 3);
                    *reinterpret_cast<float2 *>(p.Y + orow * p.ldo + n) =
                        make_float2(acc[mi][nj][2 * hh] * s2a, acc[mi][nj][2 * hh + 1] * s2a);
                }
            }
        }
}

static const size_t MMA_SMEM = 2 * STAGE_HALVES * sizeof(__nv_bfloat16);

template <bool GATEUP> static cudaError_t launch(const mma_args &a, int fmt, dim3 grid, cudaStream_t s) {
    static void (*const ks[4])(mma_args) = {k_mma<DF_BF16, GATEUP>, k_mma<DF_FP8, GATEUP>, k_mma<DF_MXFP4, GATEUP>,
                                            k_mma<DF_NVFP4, GATEUP>};
    return moe_launch_fmt(fmt, ks, grid, 256, MMA_SMEM, s, a);
}

cudaError_t moe_k_gateup_mma(const dweights *w1, const dweights *w3, const __nv_bfloat16 *Xb, int Hp,
                             const int32_t *perm, int C, const mma_tile *tiles, const int32_t *n_tiles,
                             int max_tiles, int n_pos, float limit, __nv_bfloat16 *Hb, float *Hf, int Ip,
                             cudaStream_t s) {
    if (n_pos == 0 || max_tiles == 0) return cudaSuccess;
    mma_args a = {};
    a.wa = *w1;
    a.wb = *w3;
    a.A = Xb;
    a.lda = Hp;
    a.perm = perm;
    a.C = C;
    a.tiles = tiles;
    a.n_tiles = n_tiles;
    a.n_pos = n_pos;
    a.limit = limit;
    a.Hb = Hb;
    a.Hf = Hf;
    a.ldo = Ip;
    return launch<true>(a, w1->fmt, dim3(Ip / 64, max_tiles), s);
}

cudaError_t moe_k_down_mma(const dweights *w2, const __nv_bfloat16 *Hb, int Ip, const int32_t *perm,
                           const mma_tile *tiles, const int32_t *n_tiles, int max_tiles, int n_pos, float *Y,
                           int Yp, cudaStream_t s) {
    if (n_pos == 0 || max_tiles == 0) return cudaSuccess;
    mma_args a = {};
    a.wa = *w2;
    a.A = Hb;
    a.lda = Ip;
    a.perm = perm;
    a.tiles = tiles;
    a.n_tiles = n_tiles;
    a.n_pos = n_pos;
    a.Y = Y;
    a.ldo = Yp;
    return launch<false>(a, w2->fmt, dim3(w2->rows_p / 128, max_tiles), s);
}
