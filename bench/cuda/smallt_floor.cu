/*
 * The practical floor of the T = 1 expert step and what its launch
 * structure costs (issue 17, seventh session). Reads exactly the bytes the
 * FP4 GEMVs read at T = 1 on a V4-Flash layer (H 4096, I 2048, 6 of 256
 * experts): per expert the gate and up rows (2 x 2048 rows x 2048 bytes of
 * E2M1 codes) with their scale rows (2048 x 128 bytes E8M0 each; NVFP4:
 * x 256 bytes UE4M3), then the down rows (4096 x 1024 bytes) with theirs,
 * from separate allocations of all 256 experts as the layer holds them,
 * with no arithmetic, in CUDA graph replay over 8 rotating expert sets
 * (so nothing stays in L2 from one replay to the next). Block shapes are
 * the GEMVs': gate/up 64 blocks per expert of 32 rows of each matrix, down
 * 128 blocks per expert of 32 rows, 128 threads, each lane with 8 16-byte
 * loads in flight. Modes, all timed in one run:
 *   two        gate/up launch, then the down launch (the GEMVs' structure)
 *   two-pdl    the same with programmatic dependent launch: gate/up
 *              triggers at once, down waits (griddepcontrol.wait) before
 *              reading, as a dependent kernel must when it reads gate/up's
 *              output
 *   two-pf     two launches, each gate/up block asks L2 for its share of
 *              down's rows (prefetch.global.L2) after its own reads, so the
 *              down launch reads them from L2
 *   two-pdl-pf both
 *   one        gate/up and down blocks in one launch, no dependency (the
 *              floor of this access pattern with no launch boundary)
 * and, per mode, the span of each launch inside the graph from
 * %globaltimer stamps (first block start, last block end; a separate
 * replay loop, not the timed one): the gate/up span, the gap to the first
 * down block (negative: overlap), the down span.
 * The memory floor is the bytes over the device-to-device copy rate
 * measured here (2 x 2 GiB per copy, best of 10), as the bench's.
 * Build and run on the GPU machine (bench/cuda/run.sh smallt):
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/cuda/smallt_floor.cu -o floor && ./floor [nvfp4]
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

static const int H = 4096, I = 2048, K = 6, E = 256, ROWS = 32, SETS = 8;

__device__ __forceinline__ uint4 ld16(const uint8_t *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint64_t gtimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void dep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void dep_launch() { asm volatile("griddepcontrol.launch_dependents;"); }

/* Read n bytes (n % 16 == 0) at p with the block, 8 loads in flight per lane. */
__device__ __forceinline__ uint32_t read_chunk(const uint8_t *p, size_t n) {
    uint32_t acc = 0;
    const size_t step = (size_t)blockDim.x * 16;
    for (size_t o = (size_t)threadIdx.x * 16; o < n; o += 8 * step) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = o + u * step < n ? ld16(p + o + u * step) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < 8; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    return acc;
}
__device__ __forceinline__ void prefetch_chunk(const uint8_t *p, size_t n) {
    for (size_t o = (size_t)threadIdx.x * 128; o < n; o += (size_t)blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}

struct set { int e[K]; };
struct bufs {
    const uint8_t *w1, *w3, *w2, *s1, *s3, *s2;
    size_t sb_gu, sb_dn; /* scale bytes per row: gate/up, down */
};
enum { GU_BLOCKS = I / ROWS, DN_BLOCKS = H / ROWS };

/* blocks [0, K GU_BLOCKS): gate/up slices; the rest (one launch only):
 * down slices. pf: prefetch this block's share of down (64 rows) after. */
__device__ void gu_block(const bufs &b, const set &st, int blk, bool pf, uint32_t *sink) {
    int j = blk / GU_BLOCKS, x = blk % GU_BLOCKS, e = st.e[j];
    size_t rb = H / 2, r0 = (size_t)x * ROWS;
    uint32_t acc = read_chunk(b.w1 + (size_t)e * I * rb + r0 * rb, ROWS * rb);
    acc ^= read_chunk(b.w3 + (size_t)e * I * rb + r0 * rb, ROWS * rb);
    acc ^= read_chunk(b.s1 + (size_t)e * I * b.sb_gu + r0 * b.sb_gu, ROWS * b.sb_gu);
    acc ^= read_chunk(b.s3 + (size_t)e * I * b.sb_gu + r0 * b.sb_gu, ROWS * b.sb_gu);
    if (pf) {
        size_t db = I / 2, d0 = (size_t)x * (H / GU_BLOCKS), dn = H / GU_BLOCKS;
        prefetch_chunk(b.w2 + (size_t)e * H * db + d0 * db, dn * db);
        prefetch_chunk(b.s2 + (size_t)e * H * b.sb_dn + d0 * b.sb_dn, dn * b.sb_dn);
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
__device__ void dn_block(const bufs &b, const set &st, int blk, uint32_t *sink) {
    int j = blk / DN_BLOCKS, x = blk % DN_BLOCKS, e = st.e[j];
    size_t rb = I / 2, r0 = (size_t)x * ROWS;
    uint32_t acc = read_chunk(b.w2 + (size_t)e * H * rb + r0 * rb, ROWS * rb);
    acc ^= read_chunk(b.s2 + (size_t)e * H * b.sb_dn + r0 * b.sb_dn, ROWS * b.sb_dn);
    if (acc == 0x12345678u) sink[0] = acc;
}
__device__ __forceinline__ void stamp(unsigned long long *ts, int launch, bool start) {
    if (!ts || threadIdx.x != 0) return;
    unsigned long long t = gtimer();
    if (start) atomicMin(ts + 2 * launch, t);
    else atomicMax(ts + 2 * launch + 1, t);
}

__global__ void __launch_bounds__(128) k_gu(bufs b, set st, int pf, int trigger, uint32_t *sink,
                                            unsigned long long *ts) {
    stamp(ts, 0, true);
    if (trigger) dep_launch();
    gu_block(b, st, blockIdx.x, pf, sink);
    stamp(ts, 0, false);
}
__global__ void __launch_bounds__(128) k_dn(bufs b, set st, uint32_t *sink, unsigned long long *ts) {
    stamp(ts, 1, true);
    dep_wait(); /* a no-op without the programmatic attribute */
    dn_block(b, st, blockIdx.x, sink);
    stamp(ts, 1, false);
}
__global__ void __launch_bounds__(128) k_one(bufs b, set st, uint32_t *sink, unsigned long long *ts) {
    stamp(ts, 0, true);
    if ((int)blockIdx.x < K * GU_BLOCKS) gu_block(b, st, blockIdx.x, false, sink);
    else dn_block(b, st, blockIdx.x - K * GU_BLOCKS, sink);
    stamp(ts, 0, false);
}

static void launch_mode(int mode, const bufs &b, const set &st, uint32_t *sink, unsigned long long *ts,
                        cudaStream_t s) {
    bool pdl = mode == 1 || mode == 3, pf = mode == 2 || mode == 3;
    if (mode == 4) {
        k_one<<<K * (GU_BLOCKS + DN_BLOCKS), 128, 0, s>>>(b, st, sink, ts);
        CK(cudaGetLastError());
        return;
    }
    k_gu<<<K * GU_BLOCKS, 128, 0, s>>>(b, st, pf, pdl, sink, ts);
    CK(cudaGetLastError());
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(K * DN_BLOCKS);
    cfg.blockDim = dim3(128);
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, k_dn, b, st, sink, ts));
}

int main(int argc, char **argv) {
    bool nv = argc > 1 && !strcmp(argv[1], "nvfp4");
    size_t sb_gu = nv ? H / 16 : H / 32, sb_dn = nv ? I / 16 : I / 32;
    size_t w13 = (size_t)E * I * (H / 2), w2b = (size_t)E * H * (I / 2);
    uint8_t *w1, *w3, *w2, *s1, *s3, *s2;
    CK(cudaMalloc(&w1, w13));
    CK(cudaMalloc(&w3, w13));
    CK(cudaMalloc(&w2, w2b));
    CK(cudaMalloc(&s1, (size_t)E * I * sb_gu));
    CK(cudaMalloc(&s3, (size_t)E * I * sb_gu));
    CK(cudaMalloc(&s2, (size_t)E * H * sb_dn));
    CK(cudaMemset(w1, 1, w13));
    CK(cudaMemset(w3, 2, w13));
    CK(cudaMemset(w2, 3, w2b));
    CK(cudaMemset(s1, 4, (size_t)E * I * sb_gu));
    CK(cudaMemset(s3, 5, (size_t)E * I * sb_gu));
    CK(cudaMemset(s2, 6, (size_t)E * H * sb_dn));
    bufs b = {w1, w3, w2, s1, s3, s2, sb_gu, sb_dn};
    uint32_t *sink;
    unsigned long long *ts;
    CK(cudaMalloc(&sink, 4));
    CK(cudaMalloc(&ts, 4 * sizeof(unsigned long long)));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t a, z;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&z));
    /* the copy ceiling, as moe_cuda_measure_ceilings */
    double copy_bps = 0;
    {
        size_t cb = (size_t)1 << 31;
        void *x, *y;
        CK(cudaMalloc(&x, cb));
        CK(cudaMalloc(&y, cb));
        CK(cudaMemset(x, 7, cb));
        float best = 1e30f;
        for (int r = 0; r < 12; r++) {
            CK(cudaEventRecord(a, s));
            CK(cudaMemcpyAsync(y, x, cb, cudaMemcpyDeviceToDevice, s));
            CK(cudaEventRecord(z, s));
            CK(cudaEventSynchronize(z));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, z));
            if (r >= 2 && ms < best) best = ms;
        }
        copy_bps = 2.0 * (double)cb / (best * 1e-3);
        CK(cudaFree(x));
        CK(cudaFree(y));
    }
    srand(7);
    std::vector<set> sets(SETS);
    for (int k = 0; k < SETS; k++)
        for (int j = 0; j < K; j++) {
            int e;
            bool dup;
            do { /* distinct experts, as top-k picks them */
                e = rand() % E;
                dup = false;
                for (int i = 0; i < j; i++) dup |= sets[k].e[i] == e;
            } while (dup);
            sets[k].e[j] = e;
        }
    double bytes = (double)K * (2.0 * I * (H / 2 + sb_gu) + (double)H * (I / 2 + sb_dn));
    double floor_ms = bytes / copy_bps * 1e3;
    printf("smallt_floor %s: %.2f MB per step (6 experts' gate/up/down codes and scales); copy %.0f GB/s; "
           "memory floor %.4f ms\n", nv ? "nvfp4" : "mxfp4", bytes * 1e-6, copy_bps * 1e-9, floor_ms);
    const char *names[] = {"two", "two-pdl", "two-pf", "two-pdl-pf", "one"};
    for (int mode = 0; mode < 5; mode++) {
        std::vector<cudaGraphExec_t> ge(SETS), gs(SETS);
        for (int pass = 0; pass < 2; pass++)
            for (int k = 0; k < SETS; k++) {
                cudaGraph_t g;
                CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
                launch_mode(mode, b, sets[k], sink, pass ? ts : nullptr, s);
                CK(cudaStreamEndCapture(s, &g));
                CK(cudaGraphInstantiate(pass ? &gs[k] : &ge[k], g, 0));
                CK(cudaGraphDestroy(g));
            }
        std::vector<float> t;
        for (int it = 0; it < 420; it++) {
            CK(cudaEventRecord(a, s));
            CK(cudaGraphLaunch(ge[it % SETS], s));
            CK(cudaEventRecord(z, s));
            CK(cudaEventSynchronize(z));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, z));
            if (it >= 20) t.push_back(ms);
        }
        std::sort(t.begin(), t.end());
        /* spans from the stamped graphs: medians over 200 replays */
        std::vector<double> gu, gap, dn, tot;
        for (int it = 0; it < 220; it++) {
            unsigned long long init[4] = {~0ull, 0ull, ~0ull, 0ull};
            CK(cudaMemcpyAsync(ts, init, sizeof init, cudaMemcpyHostToDevice, s));
            CK(cudaGraphLaunch(gs[it % SETS], s));
            unsigned long long r[4];
            CK(cudaMemcpyAsync(r, ts, sizeof r, cudaMemcpyDeviceToHost, s));
            CK(cudaStreamSynchronize(s));
            if (it < 20) continue;
            gu.push_back((double)(r[1] - r[0]) * 1e-6);
            if (mode != 4) {
                gap.push_back(((double)r[2] - (double)r[1]) * 1e-6);
                dn.push_back((double)(r[3] - r[2]) * 1e-6);
                tot.push_back((double)(r[3] - r[0]) * 1e-6);
            } else {
                tot.push_back((double)(r[1] - r[0]) * 1e-6);
            }
        }
        auto med = [](std::vector<double> &v) { std::sort(v.begin(), v.end()); return v.empty() ? 0.0 : v[v.size() / 2]; };
        double m = t[t.size() / 2];
        printf("%-11s median %.4f ms  p10 %.4f  p90 %.4f  %5.0f GB/s  %.2fx floor", names[mode], m, t[t.size() / 10],
               t[t.size() * 9 / 10], bytes / (m * 1e-3) * 1e-9, m / floor_ms);
        if (mode != 4)
            printf("  | spans: gate/up %.4f, gap %+.4f, down %.4f, first start to last end %.4f ms\n", med(gu),
                   med(gap), med(dn), med(tot));
        else
            printf("  | span %.4f ms\n", med(tot));
        for (int k = 0; k < SETS; k++) {
            CK(cudaGraphExecDestroy(ge[k]));
            CK(cudaGraphExecDestroy(gs[k]));
        }
    }
    return 0;
}
