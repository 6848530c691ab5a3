/*
 * How fast can a T = 1 expert step read its weights at all? Reads the bytes
 * the FP4 GEMVs read (6 random experts of a V4-Flash MXFP4 layer: gate+up
 * 6 x 8 MiB, then down 6 x 4 MiB) with no arithmetic, in three patterns,
 * one kernel per projection as the block runs them, replayed in a CUDA graph:
 *   linear: each block streams a contiguous slice (16-byte loads, 8 in flight)
 *   rows16: the GEMVs' pattern: a warp reads 16 rows x 64 bytes per step
 *   rows512: a warp reads 16 rows x 512 bytes per step (contiguous per row)
 * Build and run on the GPU machine (bench/cuda/run.sh probe):
 *   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a bench/cuda/stream_probe.cu -o probe && ./probe
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

static const size_t EXPERT = 12u << 20;   /* stride between experts (bytes) */
static const int H = 4096, I = 2048, K = 6;

__device__ __forceinline__ uint4 ld16(const uint8_t *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

struct job { const uint8_t *base[K]; size_t bytes; int rows, rowbytes; };

/* linear: blocks split each expert's region evenly */
__global__ void k_linear(job j, uint32_t *sink) {
    int per = gridDim.x / K, ex = blockIdx.x / per, b = blockIdx.x % per;
    size_t chunk = j.bytes / per, lo = (size_t)b * chunk;
    const uint8_t *p = j.base[ex] + lo;
    uint32_t acc = 0;
    for (size_t o = (size_t)threadIdx.x * 16; o < chunk; o += (size_t)blockDim.x * 16 * 8) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = o + (size_t)u * blockDim.x * 16 < chunk ? ld16(p + o + (size_t)u * blockDim.x * 16) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < 8; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

/* rows: warp owns 16 rows; per step lane (g, q) reads W bytes/4 of rows g and g+8 */
template <int W>
__global__ void k_rows(job j, uint32_t *sink) {
    int per = gridDim.x / K, ex = blockIdx.x / per, b = blockIdx.x % per;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int r0 = (b * (blockDim.x / 32) + warp) * 16;
    if (r0 >= j.rows) return;
    const uint8_t *pg = j.base[ex] + (size_t)(r0 + g) * j.rowbytes, *ph = pg + (size_t)8 * j.rowbytes;
    uint32_t acc = 0;
    for (int s = 0; s < j.rowbytes; s += W) {
        uint4 v[W / 32];
#pragma unroll
        for (int u = 0; u < W / 64; u++) {
            v[2 * u] = ld16(pg + s + 64 * u + 16 * q);
            v[2 * u + 1] = ld16(ph + s + 64 * u + 16 * q);
        }
#pragma unroll
        for (int u = 0; u < W / 32; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

int main() {
    uint8_t *w;
    size_t total = (size_t)256 * EXPERT;
    CK(cudaMalloc(&w, total));
    CK(cudaMemset(w, 1, total));
    uint32_t *sink;
    CK(cudaMalloc(&sink, 4));
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    srand(7);
    const int SETS = 8;
    std::vector<job> gu(SETS), dn(SETS);
    for (int k = 0; k < SETS; k++) {
        for (int i = 0; i < K; i++) {
            const uint8_t *e = w + (size_t)(rand() % 256) * EXPERT;
            gu[k].base[i] = e;               /* gate+up: 2I rows of H/2 bytes */
            dn[k].base[i] = e + (8u << 20);  /* down: H rows of I/2 bytes */
        }
        gu[k].bytes = (size_t)2 * I * H / 2; gu[k].rows = 2 * I; gu[k].rowbytes = H / 2;
        dn[k].bytes = (size_t)H * I / 2; dn[k].rows = H; dn[k].rowbytes = I / 2;
    }
    const char *names[] = {"linear (256 blocks/expert x 256 thr)", "rows16 (64 B/row/step, 128 thr)", "rows512 (512 B/row/step, 128 thr)"};
    for (int pat = 0; pat < 3; pat++) {
        std::vector<cudaGraphExec_t> ge(SETS);
        for (int k = 0; k < SETS; k++) {
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            if (pat == 0) {
                k_linear<<<K * 128, 256, 0, s>>>(gu[k], sink);
                k_linear<<<K * 64, 256, 0, s>>>(dn[k], sink);
            } else if (pat == 1) {
                k_rows<64><<<K * (2 * I / 64), 128, 0, s>>>(gu[k], sink);
                k_rows<64><<<K * (H / 64), 128, 0, s>>>(dn[k], sink);
            } else {
                k_rows<512><<<K * (2 * I / 64), 128, 0, s>>>(gu[k], sink);
                k_rows<512><<<K * (H / 64), 128, 0, s>>>(dn[k], sink);
            }
            CK(cudaStreamEndCapture(s, &g));
            CK(cudaGraphInstantiate(&ge[k], g, 0));
            CK(cudaGraphDestroy(g));
        }
        std::vector<float> t;
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        for (int it = 0; it < 220; it++) {
            CK(cudaEventRecord(a, s));
            CK(cudaGraphLaunch(ge[it % SETS], s));
            CK(cudaEventRecord(b, s));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            if (it >= 20) t.push_back(ms);
        }
        std::sort(t.begin(), t.end());
        double bytes = (double)K * (gu[0].bytes + dn[0].bytes);
        printf("%-40s median %.4f ms  p90 %.4f ms  %.0f GB/s over %.1f MB\n", names[pat], t[t.size() / 2],
               t[t.size() * 9 / 10], bytes / (t[t.size() / 2] * 1e-3) * 1e-9, bytes * 1e-6);
    }
    return 0;
}
